// The per-layer gate statistics every training step reports (GetGates, the Grafana gate
// panels): the mean and population standard deviation of each branch's gate over all
// (position, head) pairs, and the mean number of selected blocks per (position, group).
//
// Why a kernel: LibTorch computes them with eight ops per layer (a float copy of the gates,
// mean and std over dim 0 of a [rows, 3] tensor, a compare, a sum, a cast, a mean and a
// cat), about a hundred kernels per m7c step on the path every daemon step replays. Here it
// is a memset and one pass over gates and indices, then one thread turns the sums into the
// seven values.
#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// sums: [sum g0, g1, g2, sum g0^2, g1^2, g2^2, count of idx >= 0], float64 (so that the
// variance, E[g^2] - E[g]^2 with gates near 0.5, keeps its digits).
constexpr int kSums = 7;

__device__ __forceinline__ double BlockSum(double v, double* scratch) {
  v = WarpSum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // scratch may still be read from the previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double total = 0.0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kThreads / 32; ++w) total += scratch[w];
  }
  return total;  // valid in thread 0
}

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    GateSumsKernel(const scalar_t* __restrict__ gates, int64_t rows,
                   const index_t* __restrict__ idx, int64_t idx_count, double* __restrict__ sums) {
  __shared__ double scratch[kThreads / 32];
  double acc[kSums] = {0, 0, 0, 0, 0, 0, 0};
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; r < rows; r += stride) {
#pragma unroll
    for (int b = 0; b < 3; ++b) {
      const double g = static_cast<double>(static_cast<float>(gates[r * 3 + b]));
      acc[b] += g;
      acc[3 + b] += g * g;
    }
  }
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < idx_count; i += stride) {
    acc[6] += idx[i] >= 0 ? 1.0 : 0.0;
  }
#pragma unroll
  for (int k = 0; k < kSums; ++k) {
    const double total = BlockSum(acc[k], scratch);
    if (threadIdx.x == 0) atomicAdd(&sums[k], total);
  }
}

// out (float32 [7]): mean g0..g2, std g0..g2, mean selected blocks per (position, group).
__global__ void GateStatsFinishKernel(const double* __restrict__ sums, double rows,
                                      double positions, float* __restrict__ out) {
  for (int b = 0; b < 3; ++b) {
    const double mean = rows > 0 ? sums[b] / rows : 0.0;
    const double var = rows > 0 ? sums[3 + b] / rows - mean * mean : 0.0;
    out[b] = static_cast<float>(mean);
    out[3 + b] = static_cast<float>(sqrt(var > 0.0 ? var : 0.0));
  }
  out[6] = static_cast<float>(positions > 0 ? sums[6] / positions : 0.0);
}

}  // namespace

at::Tensor GateStats(const at::Tensor& gates, const at::Tensor& block_idx) {
  TORCH_CHECK(gates.is_cuda() && block_idx.is_cuda(), "gate statistics take CUDA tensors");
  TORCH_CHECK(gates.dim() == 4 && gates.size(3) == 3, "gates must be [B,T,H,3], got ", gates.sizes());
  TORCH_CHECK(block_idx.dim() == 4, "block_idx must be [B,T,G,n], got ", block_idx.sizes());
  const auto g = gates.contiguous();
  const auto idx = block_idx.contiguous();
  const int64_t rows = g.numel() / 3;
  const int64_t positions = idx.size(0) * idx.size(1) * idx.size(2);
  auto sums = at::zeros({kSums}, g.options().dtype(at::kDouble));
  auto out = at::empty({kSums}, g.options().dtype(at::kFloat));
  // A few CTAs per SM: every CTA ends with seven float64 atomics on the same seven sums.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const dim3 grid(std::min(GridStride(std::max(rows, idx.numel())).x, static_cast<unsigned>(2 * sms)));
  NSA_DISPATCH_TYPES(g.scalar_type(), "nsa_gate_stats", [&] {
    using gate_t = scalar_t;
    AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "nsa_gate_stats_index", [&] {
      Launch(GateSumsKernel<gate_t, index_t>, grid, 0, g.data_ptr<gate_t>(), rows,
             idx.data_ptr<index_t>(), idx.numel(), sums.data_ptr<double>());
    });
  });
  GateStatsFinishKernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      sums.data_ptr<double>(), static_cast<double>(rows), static_cast<double>(positions),
      out.data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace nsad::nsa::cuda::detail
