// Top-n selection block choice on the GPU: one warp per (batch, position, group).
//
// Rules (ops.h): blocks starting after t are never chosen; block 0, the current block and
// the one before it are always chosen; the remaining slots take the highest importance,
// ties to the lower block index; output ascending, unused slots -1.
//
// The top-k picks walk the candidates in the strict order (importance desc, index asc): each
// round takes the best candidate that comes after the previous pick in that order, so no
// "already taken" marks are needed and ties resolve exactly as the reference's stable sort.
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kMaxTopN = 32;  // one warp lane per chosen block

struct Candidate {
  float value;
  int index;
};
// a before b in (value desc, index asc) order.
__device__ __forceinline__ bool Before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

__global__ void __launch_bounds__(kThreads)
    SelectBlocksKernel(const float* __restrict__ importance, int* __restrict__ out, int64_t rows,
                       int T, int G, int NS, int n, int slc_block) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps exit together
  const int t = static_cast<int>((row / G) % T);
  const float* imp = importance + row * NS;
  const int current = t / slc_block;
  const int eligible = min(current + 1, NS);  // blocks 0..current start at or before t

  int* dst = out + row * n;
  if (eligible > n && current - 2 <= 32) {
    // Every candidate (blocks 1 .. current-2) fits one per lane, as at T <= 2048 with l' = 64:
    // a candidate is picked iff fewer than n - 3 others come before it in (importance desc,
    // index asc) order, one pass of 32 compares instead of n - 3 rounds of warp argmax.
    // Picked candidates are already ascending by lane and lie between block 0 and the
    // forced current - 1, current; exactly n - 3 of them are picked (there are >= n - 2).
    const int index = 1 + lane;
    const bool candidate = index <= current - 2;
    float value = candidate ? imp[index] : -INFINITY;
    if (isnan(value)) value = -INFINITY;
    const Candidate mine{value, index};
    int before = 0;
    for (int j = 0; j < 32; ++j) {
      const Candidate other{__shfl_sync(0xffffffffu, value, j), 1 + j};
      if (1 + j <= current - 2 && Before(other, mine)) ++before;
    }
    const bool picked = candidate && before < n - 3;
    const unsigned picked_mask = __ballot_sync(0xffffffffu, picked);
    if (picked) dst[1 + __popc(picked_mask & ((1u << lane) - 1u))] = index;
    if (lane == 0) {
      dst[0] = 0;
      dst[n - 2] = current - 1;
      dst[n - 1] = current;
    }
    return;
  }
  int chosen = -1;  // the block this lane holds, sorted into place below
  if (eligible <= n) {
    chosen = lane < eligible ? lane : -1;  // every eligible block fits, already ascending
  } else {
    // current >= n >= 3, so 0, current-1 and current are distinct; picks come from 1..current-2.
    if (lane == 0) chosen = 0;
    if (lane == 1) chosen = current - 1;
    if (lane == 2) chosen = current;
    Candidate prev{INFINITY, -1};
    for (int pick = 3; pick < n; ++pick) {
      Candidate best{-INFINITY, INT_MAX};
      for (int i = 1 + lane; i <= current - 2; i += 32) {
        float value = imp[i];
        if (isnan(value)) value = -INFINITY;
        const Candidate c{value, i};
        if (Before(prev, c) && (best.index == INT_MAX || Before(c, best))) best = c;
      }
      for (int o = 16; o > 0; o >>= 1) {
        const Candidate other{__shfl_xor_sync(0xffffffffu, best.value, o),
                              __shfl_xor_sync(0xffffffffu, best.index, o)};
        if (other.index != INT_MAX && (best.index == INT_MAX || Before(other, best))) best = other;
      }
      if (lane == pick) chosen = best.index;
      prev = best;
    }
  }
  // Rank of this lane's block among the chosen ones (all distinct) = its output slot.
  int rank = 0, used = 0;
  for (int m = 0; m < n; ++m) {
    const int other = __shfl_sync(0xffffffffu, chosen, m);
    if (other >= 0) {
      ++used;
      if (chosen >= 0 && other < chosen) ++rank;
    }
  }
  if (chosen >= 0 && lane < n) dst[rank] = chosen;
  if (lane >= used && lane < n) dst[lane] = -1;
}

}  // namespace

bool KernelImageLoads() {
  // Fails with cudaErrorInvalidDeviceFunction when no machine code matches the GPU.
  cudaFuncAttributes attr{};
  const bool ok = cudaFuncGetAttributes(&attr, SelectBlocksKernel) == cudaSuccess;
  if (!ok) (void)cudaGetLastError();  // clear the sticky-free error so later calls are clean
  return ok;
}

at::Tensor SelectBlocksLaunch(const at::Tensor& importance_in, int64_t seq_len, const Geo& g) {
  TORCH_CHECK(importance_in.is_cuda(), "importance must be a CUDA tensor");
  TORCH_CHECK(importance_in.dim() == 4, "importance must be [B,T,G,NS], got ", importance_in.sizes());
  const auto importance = importance_in.to(at::kFloat).contiguous();
  const int64_t B = importance.size(0), T = importance.size(1), G = importance.size(2);
  const int64_t NS = importance.size(3);
  TORCH_CHECK(T == seq_len, "importance has ", T, " positions, seq_len is ", seq_len);
  TORCH_CHECK(NS == (T + g.slc_block - 1) / g.slc_block, "importance has ", NS,
              " selection blocks, expected ", (T + g.slc_block - 1) / g.slc_block);
  TORCH_CHECK(g.top_n >= 3 && g.top_n <= kMaxTopN, "top_n must be in [3, ", kMaxTopN, "], got ",
              g.top_n);
  auto out = at::empty({B, T, G, g.top_n}, importance.options().dtype(at::kInt));
  const int64_t rows = B * T * G;
  if (rows == 0) return out;
  const dim3 grid(static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads));
  Launch(SelectBlocksKernel, grid, 0, importance.data_ptr<float>(), out.data_ptr<int>(), rows,
         static_cast<int>(T), static_cast<int>(G), static_cast<int>(NS), static_cast<int>(g.top_n),
         g.slc_block);
  return out;
}

}  // namespace nsad::nsa::cuda::detail
