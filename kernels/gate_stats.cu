// The per-layer gate statistics every training step reports (GetGates, the Grafana gate
// panels): the mean and population standard deviation of each branch's gate over all
// (position, head) pairs, and the mean number of selected blocks per (position, group).
//
// Why a kernel: LibTorch computes them with eight ops per layer (a float copy of the gates,
// mean and std over dim 0 of a [rows, 3] tensor, a compare, a sum, a cast, a mean and a
// cat), about a hundred kernels per m7c step on the path every daemon step replays. Here it
// is a memset and one pass over gates and indices, whose last CTA turns the sums into the
// seven values -- for all of a model's layers in one launch (GateStatsOfLayers): one launch
// per layer took 9-10 us each plus its memset (ncu, m7c batch 16 on an H100), 146 us a step,
// for 6.6 MB a layer.
#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// sums: [sum g0, g1, g2, sum g0^2, g1^2, g2^2, count of idx >= 0], float64 (so that the
// variance, E[g^2] - E[g]^2 with gates near 0.5, keeps its digits), then the count of CTAs
// done (as a float64 slot: the buffer is one at::zeros).
constexpr int kSums = 7;
constexpr int kWarps = kThreads / 32;

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

// Each CTA adds its seven partial sums (the threads' acc) into sums with float64 atomics; the
// last CTA to finish (a counter after the sums) turns them into the seven values.
__device__ void AddAndFinish(const double (&acc)[kSums], double* sums, double rows, double positions,
                             float* __restrict__ out) {
  __shared__ double scratch[kSums][kWarps];
  __shared__ bool last;
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
    FinishGateStats(total, rows, positions, out);
  }
}

// The statistics of up to kMaxBatchLayers layers in one launch: blockIdx.y is the layer, each
// with its own sums and finishing CTA. 16-byte loads: a group of three 16-byte gate chunks
// (3 * kGate elements, a multiple of 3) starts on a row, so element j of a group belongs to
// branch j % 3; the elements past the last whole group are added one at a time.
constexpr int kMaxBatchLayers = 16;  // per launch (the kernel parameter holds their pointers)
struct LayerInputs {
  const void* gates;
  const void* idx;
  int64_t rows, idx_count;
  double positions;
};
struct LayerBatch {
  LayerInputs layer[kMaxBatchLayers];
};

template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kThreads)
    GateStatsLayersKernel(LayerBatch batch, double* __restrict__ all_sums, float* __restrict__ all_out) {
  constexpr int kGate = 16 / sizeof(scalar_t), kIdx = 16 / sizeof(index_t);
  using GateChunk = Packed<scalar_t, kGate>;
  using IdxChunk = Packed<index_t, kIdx>;
  const LayerInputs& in = batch.layer[blockIdx.y];
  double* sums = all_sums + blockIdx.y * (kSums + 1);
  const auto* gates = static_cast<const scalar_t*>(in.gates);
  const auto* idx = static_cast<const index_t*>(in.idx);
  double acc[kSums] = {0, 0, 0, 0, 0, 0, 0};
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t groups = in.rows / kGate;  // 3 chunks each
  for (int64_t q = first; q < groups; q += stride) {
    GateChunk c[3];
#pragma unroll
    for (int k = 0; k < 3; ++k) c[k] = reinterpret_cast<const GateChunk*>(gates)[3 * q + k];
#pragma unroll
    for (int j = 0; j < 3 * kGate; ++j) {
      const double v = static_cast<float>(c[j / kGate].v[j % kGate]);
      acc[j % 3] += v;
      acc[3 + j % 3] += v * v;
    }
  }
  for (int64_t e = 3 * groups * kGate + first; e < 3 * in.rows; e += stride) {
    const double v = static_cast<float>(gates[e]);
    const int b = static_cast<int>(e % 3);
    acc[0] += b == 0 ? v : 0.0;
    acc[1] += b == 1 ? v : 0.0;
    acc[2] += b == 2 ? v : 0.0;
    acc[3] += b == 0 ? v * v : 0.0;
    acc[4] += b == 1 ? v * v : 0.0;
    acc[5] += b == 2 ? v * v : 0.0;
  }
  const int64_t idx_chunks = in.idx_count / kIdx;
  for (int64_t q = first; q < idx_chunks; q += stride) {
    const IdxChunk c = reinterpret_cast<const IdxChunk*>(idx)[q];
#pragma unroll
    for (int j = 0; j < kIdx; ++j) acc[6] += c.v[j] >= 0 ? 1.0 : 0.0;
  }
  for (int64_t i = idx_chunks * kIdx + first; i < in.idx_count; i += stride) acc[6] += idx[i] >= 0 ? 1.0 : 0.0;

  AddAndFinish(acc, sums, static_cast<double>(in.rows), in.positions, all_out + blockIdx.y * kSums);
}

}  // namespace

bool GateStatsOfLayersTake(const std::vector<at::Tensor>& gates, const std::vector<at::Tensor>& block_idx) {
  if (gates.empty() || gates.size() != block_idx.size()) return false;
  for (size_t l = 0; l < gates.size(); ++l) {
    const auto &g = gates[l], &i = block_idx[l];
    if (!g.defined() || !i.defined() || !g.is_cuda() || !i.is_cuda() || g.device() != gates[0].device() ||
        i.device() != g.device() || g.scalar_type() != gates[0].scalar_type() ||
        i.scalar_type() != block_idx[0].scalar_type() || g.dim() != 4 || g.size(3) != 3 || i.dim() != 4 ||
        (g.scalar_type() != at::kFloat && g.scalar_type() != at::kHalf && g.scalar_type() != at::kBFloat16) ||
        (i.scalar_type() != at::kInt && i.scalar_type() != at::kLong)) {
      return false;
    }
  }
  return true;
}

at::Tensor GateStatsOfLayers(const std::vector<at::Tensor>& gates, const std::vector<at::Tensor>& block_idx) {
  TORCH_CHECK(GateStatsOfLayersTake(gates, block_idx), "GateStatsOfLayers takes one [B,T,H,3] gates and one "
              "[B,T,G,n] block_idx (int32 or int64) per layer, CUDA, of one dtype each");
  const int64_t L = static_cast<int64_t>(gates.size());
  const auto gopts = gates[0].options();
  auto sums = at::zeros({L, kSums + 1}, gopts.dtype(at::kDouble));
  auto out = at::empty({L, kSums}, gopts.dtype(at::kFloat));
  // The tensors the kernels read (contiguous, 16-byte aligned), kept alive to the launch.
  std::vector<at::Tensor> g(L), idx(L);
  const auto aligned = [](const at::Tensor& t) {
    const auto c = t.contiguous();
    return AlignedFor(c, static_cast<int>(16 / c.element_size())) ? c : c.clone();
  };
  int64_t largest = 0;
  for (int64_t l = 0; l < L; ++l) {
    g[l] = aligned(gates[l]);
    idx[l] = aligned(block_idx[l]);
    largest = std::max({largest, g[l].numel(), idx[l].numel()});
  }
  // About eight CTAs per SM in all: the layers' loads in flight together.
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  for (int64_t l0 = 0; l0 < L; l0 += kMaxBatchLayers) {
    const int64_t n = std::min<int64_t>(kMaxBatchLayers, L - l0);
    LayerBatch batch{};
    for (int64_t k = 0; k < n; ++k) {
      const auto &gl = g[l0 + k], &il = idx[l0 + k];
      batch.layer[k] = {gl.data_ptr(), il.data_ptr(), gl.numel() / 3, il.numel(),
                        static_cast<double>(il.size(0) * il.size(1) * il.size(2))};
    }
    const unsigned per_layer = std::max<unsigned>(
        1, std::min<unsigned>(GridStride(largest / 8).x, static_cast<unsigned>((8 * sms + n - 1) / n)));
    NSA_DISPATCH_TYPES(g[0].scalar_type(), "nsa_gate_stats_layers", [&] {
      using gate_t = scalar_t;
      AT_DISPATCH_INDEX_TYPES(idx[0].scalar_type(), "nsa_gate_stats_layers_index", [&] {
        Launch(GateStatsLayersKernel<gate_t, index_t>, dim3(per_layer, static_cast<unsigned>(n)), 0, batch,
               sums.data_ptr<double>() + l0 * (kSums + 1), out.data_ptr<float>() + l0 * kSums);
      });
    });
  }
  return out;
}

at::Tensor GateStats(const at::Tensor& gates, const at::Tensor& block_idx) {
  TORCH_CHECK(gates.is_cuda() && block_idx.is_cuda(), "gate statistics take CUDA tensors");
  TORCH_CHECK(gates.dim() == 4 && gates.size(3) == 3, "gates must be [B,T,H,3], got ", gates.sizes());
  TORCH_CHECK(block_idx.dim() == 4, "block_idx must be [B,T,G,n], got ", block_idx.sizes());
  return GateStatsOfLayers({gates}, {block_idx})[0];
}

}  // namespace nsad::nsa::cuda::detail
