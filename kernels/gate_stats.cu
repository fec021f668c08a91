// The per-layer gate statistics every training step reports (GetGates, the Grafana gate
// panels): the mean and population standard deviation of each branch's gate over all
// (position, head) pairs, and the mean number of selected blocks per (position, group).
//
// Why a kernel: LibTorch computes them with eight ops per layer (a float copy of the gates,
// mean and std over dim 0 of a [rows, 3] tensor, a compare, a sum, a cast, a mean and a
// cat), about a hundred kernels per m7c step on the path every daemon step replays. Here it
// is a memset and one pass over gates and indices, whose last CTA turns the sums into the
// seven values.
#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// sums: [sum g0, g1, g2, sum g0^2, g1^2, g2^2, count of idx >= 0], float64 (so that the
// variance, E[g^2] - E[g]^2 with gates near 0.5, keeps its digits), then the count of CTAs
// done (as a float64 slot: the buffer is one at::zeros).
constexpr int kSums = 7;
constexpr int kWarps = kThreads / 32;
// Loads in flight per thread and loop trip: one load at a time per grid-stride step left the
// kernel waiting on memory latency (13.4 us per m7c layer at batch 16 for 6.4 MB, ncu on an
// H100, where this kernel takes 9.1 us with its finish).
constexpr int kUnroll = 4;

// out (float32 [7]): mean g0..g2, std g0..g2, mean selected blocks per (position, group).
__device__ void FinishGateStats(const double* sums, double rows, double positions, float* __restrict__ out) {
  for (int b = 0; b < 3; ++b) {
    const double mean = rows > 0 ? sums[b] / rows : 0.0;
    const double var = rows > 0 ? sums[3 + b] / rows - mean * mean : 0.0;
    out[b] = static_cast<float>(mean);
    out[3 + b] = static_cast<float>(sqrt(var > 0.0 ? var : 0.0));
  }
  out[6] = static_cast<float>(positions > 0 ? sums[6] / positions : 0.0);
}

// Each CTA adds its seven partial sums into sums with float64 atomics; the last CTA to finish
// (a counter after the sums) turns them into the seven values.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    GateStatsKernel(const scalar_t* __restrict__ gates, int64_t rows, const index_t* __restrict__ idx,
                    int64_t idx_count, double positions, double* __restrict__ sums, float* __restrict__ out) {
  __shared__ double scratch[kSums][kWarps];
  __shared__ bool last;
  double acc[kSums] = {0, 0, 0, 0, 0, 0, 0};
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t r0 = first; r0 < rows; r0 += kUnroll * stride) {
    float g[kUnroll][3];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t r = r0 + u * stride;
#pragma unroll
      for (int b = 0; b < 3; ++b) g[u][b] = r < rows ? static_cast<float>(gates[r * 3 + b]) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
#pragma unroll
      for (int b = 0; b < 3; ++b) {
        const double v = g[u][b];
        acc[b] += v;
        acc[3 + b] += v * v;
      }
    }
  }
  for (int64_t i0 = first; i0 < idx_count; i0 += kUnroll * stride) {
    int used = 0;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = i0 + u * stride;
      used += i < idx_count && idx[i] >= 0 ? 1 : 0;
    }
    acc[6] += used;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (int k = 0; k < kSums; ++k) {
    const double v = WarpSum(acc[k]);
    if (lane == 0) scratch[k][warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < kSums) {
    double total = 0.0;
    for (int w = 0; w < kWarps; ++w) total += scratch[threadIdx.x][w];
    atomicAdd(&sums[threadIdx.x], total);
    __threadfence();  // the adds land before this CTA counts itself done
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const double done = atomicAdd(&sums[kSums], 1.0);
    last = done == static_cast<double>(gridDim.x - 1);
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {
    __threadfence();
    double total[kSums];
    for (int k = 0; k < kSums; ++k) total[k] = __ldcg(&sums[k]);  // from L2, where the atomics are
    FinishGateStats(total, static_cast<double>(rows), positions, out);
  }
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
  auto sums = at::zeros({kSums + 1}, g.options().dtype(at::kDouble));
  auto out = at::empty({kSums}, g.options().dtype(at::kFloat));
  // A few CTAs per SM: every CTA ends with seven float64 atomics on the same seven sums.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const dim3 grid(std::min(GridStride(std::max(rows, idx.numel())).x, static_cast<unsigned>(2 * sms)));
  NSA_DISPATCH_TYPES(g.scalar_type(), "nsa_gate_stats", [&] {
    using gate_t = scalar_t;
    AT_DISPATCH_INDEX_TYPES(idx.scalar_type(), "nsa_gate_stats_index", [&] {
      Launch(GateStatsKernel<gate_t, index_t>, grid, 0, g.data_ptr<gate_t>(), rows, idx.data_ptr<index_t>(),
             idx.numel(), static_cast<double>(positions), sums.data_ptr<double>(), out.data_ptr<float>());
    });
  });
  return out;
}

}  // namespace nsad::nsa::cuda::detail
