// Top-n selection block choice on the GPU: one warp per (batch, position, group).
//
// Rules (ops.h): blocks starting after t are never chosen; block 0, the current block and
// the one before it are always chosen; the remaining slots take the highest importance,
// ties to the lower block index; output ascending, unused slots -1.
//
// Rows with up to 32 candidates rank them in one pass, one per lane. Longer rows first find
// a threshold, the (n-3)-th best of the 32 lanes' own best candidates: at least n - 3
// candidates come at or before it, so every pick does. The candidates at or before it are
// compacted in index order (typically 13-25 of up to 1,022) and ranked in one pass like a
// short row. When more than 32 qualify (one lane holding most of the best blocks), the row
// falls back to n - 3 rounds of warp argmax, each round taking the best candidate that comes
// after the previous pick in (importance desc, index asc) order, so no "already taken" marks
// are needed and ties resolve exactly as the reference's stable sort.
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kMaxTopN = kernel_limits::kMaxTopN;  // one warp lane per chosen block

struct Candidate {
  float value;
  int index;
};
// a before b in (value desc, index asc) order. | and & rather than || and &&: three compares
// and a predicate op, where the short-circuit forms compiled to branches around each compare.
__device__ __forceinline__ bool Before(const Candidate& a, const Candidate& b) {
  return (a.value > b.value) | ((a.value == b.value) & (a.index < b.index));
}

// A row's importance of block i, NaN read as -inf (never preferred, never an error).
__device__ __forceinline__ float Importance(const float* __restrict__ imp, int i) {
  const float value = imp[i];
  return isnan(value) ? -INFINITY : value;
}

constexpr unsigned kFullWarp = 0xffffffffu;

// How many of the warp's 32 lane candidates come before this lane's. They go through the
// warp's 32 slots of shared memory (one store, sixteen broadcast 16-byte reads of two
// candidates each): two shuffles and a compare per lane cost about three times the
// instructions. With it, Before's branch-free form and PickThroughThreshold's stepped pointer:
// 64k 12:2 on an H200 (fortieth session), ncu 248.5-250.9 -> 162.9-164.0 us, 217 -> 140 M warp
// instructions.
__device__ __forceinline__ int CountBeforeAmongLanes(const Candidate& mine, int lane, Candidate* slots) {
  slots[lane] = mine;
  __syncwarp();
  int before = 0;
#pragma unroll
  for (int j = 0; j < 32; j += 2) {
    const float4 two = *reinterpret_cast<const float4*>(slots + j);
    before += Before(Candidate{two.x, __float_as_int(two.y)}, mine);
    before += Before(Candidate{two.z, __float_as_int(two.w)}, mine);
  }
  __syncwarp();  // every lane has read the slots before they are written again
  return before;
}

// How many of lanes [0, count)'s candidates come before this lane's, for lanes [0, count) that
// hold their candidates in ascending index order, lanes from count on -inf (count
// warp-uniform): the candidates before this lane's are those of higher value and those of
// equal value on lanes to its left. The values go through the warp's 32 floats of shared
// memory (one store, eight broadcast 16-byte reads) and the equal ones through
// __match_any_sync: about a third of the instructions of two shuffles and a compare per lane,
// which made the selection instruction-bound (37 us per m7c layer at batch 16). Zeros of
// either sign are one value to the comparisons; the match sees bits, so -0 becomes +0 first.
// A lane of -inf (invalid, or a NaN importance) comes after every lane of higher value and is
// never counted by a lane to its left.
__device__ __forceinline__ int CountBeforeInIndexOrder(float value, int lane, float* warp_values) {
  value = value == 0.f ? 0.f : value;
  warp_values[lane] = value;
  __syncwarp();
  int higher = 0;
#pragma unroll
  for (int j = 0; j < 32; j += 4) {
    const float4 v = *reinterpret_cast<const float4*>(warp_values + j);
    higher += (v.x > value) + (v.y > value) + (v.z > value) + (v.w > value);
  }
  __syncwarp();  // every lane has read the values before the buffer is written again
  const unsigned equal = __match_any_sync(kFullWarp, __float_as_uint(value));
  return higher + __popc(equal & ((1u << lane) - 1u));
}

// Lanes [0, count) hold candidates in ascending index order (count <= 32, warp-uniform), the
// others -inf: a candidate is picked iff fewer than `picks` others come before it in
// (importance desc, index asc) order. Picked candidates keep the lanes' order, so they land
// in dst ascending. warp_values: the warp's 32 floats of shared memory, 16-byte aligned.
__device__ __forceinline__ void PickBest(const Candidate& mine, int count, int picks, int* dst,
                                         int lane, float* warp_values) {
  const int before = CountBeforeInIndexOrder(mine.value, lane, warp_values);  // every lane
  const bool picked = lane < count && before < picks;
  const unsigned picked_mask = __ballot_sync(kFullWarp, picked);
  if (picked) dst[__popc(picked_mask & ((1u << lane) - 1u))] = mine.index;
}

// Candidates 1 .. last (last > 32; lane l holds 1 + l, 33 + l, ...). The threshold is the
// picks-th best of the lanes' own best candidates; candidates at or before it are compacted,
// in index order, into the warp's 32 slots and ranked by PickBest. Returns false, writing
// nothing, when more than 32 qualify.
__device__ __forceinline__ bool PickThroughThreshold(const float* __restrict__ imp, int last,
                                                     int picks, int* dst, int lane,
                                                     Candidate* slots, float* warp_values) {
  if (picks == 0) return true;  // top_n = 3: the forced blocks only
  // The lane's best: its candidates ascend in index, so the first maximum wins ties. The lane's
  // first candidate (1 + lane <= last) stands in when all its values are -inf.
  Candidate best{-INFINITY, 1 + lane};
  for (int i = 1 + lane; i <= last; i += 32) {
    const float value = Importance(imp, i);
    if (value > best.value) best = Candidate{value, i};
  }
  // Lane bests are distinct (distinct indices), so exactly one has rank picks - 1 <= 28.
  const int at = __ffs(__ballot_sync(kFullWarp, CountBeforeAmongLanes(best, lane, slots) == picks - 1)) - 1;
  const Candidate threshold{__shfl_sync(kFullWarp, best.value, at), __shfl_sync(kFullWarp, best.index, at)};
  const unsigned lanes_before = (1u << lane) - 1u;
  int count = 0;
  // Warp-uniform rounds (every lane meets the ballot), the lane's pointer stepped by a round:
  // indexing imp in the loop had each predicated load recompute its 64-bit address.
  const float* lane_imp = imp + 1 + lane;
#pragma unroll 4
  for (int base = 1; base <= last; base += 32, lane_imp += 32) {
    const int i = base + lane;
    const Candidate c{i <= last ? Importance(lane_imp, 0) : -INFINITY, i};
    const bool keep = (i <= last) & !Before(threshold, c);
    const unsigned keep_mask = __ballot_sync(kFullWarp, keep);
    const int slot = count + __popc(keep_mask & lanes_before);
    if (keep & (slot < 32)) slots[slot] = c;
    count += __popc(keep_mask);
  }
  if (count > 32) return false;
  __syncwarp();  // the slots are written
  const Candidate mine = lane < count ? slots[lane] : Candidate{-INFINITY, INT_MAX};
  PickBest(mine, count, picks, dst, lane, warp_values);
  return true;
}

__global__ void __launch_bounds__(kThreads)
    SelectBlocksKernel(const float* __restrict__ importance, int* __restrict__ out, int64_t rows,
                       int T, int G, int NS, int n, int slc_block) {
  __shared__ alignas(16) Candidate compacted[kThreads];  // 32 slots per warp, for PickThroughThreshold
  __shared__ alignas(16) float values[kThreads];  // 32 per warp, for PickBest
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps exit together
  const int t = static_cast<int>((row / G) % T);
  const float* imp = importance + row * NS;
  const int current = t / slc_block;
  const int eligible = min(current + 1, NS);  // blocks 0..current start at or before t

  int* dst = out + row * n;
  const int last = current - 2;  // candidates: blocks 1 .. current-2 (0, current-1, current are forced)
  const int picks = n - 3;
  if (eligible > n) {
    bool ranked = false;
    if (last <= 32) {
      // Every candidate fits one per lane, as at T <= 2048 with l' = 64.
      const Candidate mine{lane < last ? Importance(imp, 1 + lane) : -INFINITY, 1 + lane};
      PickBest(mine, last, picks, dst + 1, lane, values + (threadIdx.x & ~31));
      ranked = true;
    } else {
      ranked = PickThroughThreshold(imp, last, picks, dst + 1, lane,
                                    compacted + (threadIdx.x & ~31), values + (threadIdx.x & ~31));
    }
    if (ranked) {
      // The picks lie strictly between block 0 and the forced current - 1, current.
      if (lane == 0) {
        dst[0] = 0;
        dst[n - 2] = current - 1;
        dst[n - 1] = current;
      }
      return;
    }
  }
  if (eligible <= n) {  // every eligible block fits, already ascending
    if (lane < n) dst[lane] = lane < eligible ? lane : -1;
    return;
  }
  // The fallback of long rows. current >= n >= 3, so 0, current-1 and current are
  // distinct; picks come from 1..current-2.
  int chosen = -1;  // the block this lane holds, sorted into place below
  if (lane == 0) chosen = 0;
  if (lane == 1) chosen = current - 1;
  if (lane == 2) chosen = current;
  Candidate prev{INFINITY, -1};
  for (int pick = 3; pick < n; ++pick) {
    Candidate best{-INFINITY, INT_MAX};
    for (int i = 1 + lane; i <= last; i += 32) {
      const Candidate c{Importance(imp, i), i};
      if (Before(prev, c) && (best.index == INT_MAX || Before(c, best))) best = c;
    }
    for (int o = 16; o > 0; o >>= 1) {
      const Candidate other{__shfl_xor_sync(kFullWarp, best.value, o),
                            __shfl_xor_sync(kFullWarp, best.index, o)};
      if (other.index != INT_MAX && (best.index == INT_MAX || Before(other, best))) best = other;
    }
    if (lane == pick) chosen = best.index;
    prev = best;
  }
  // Rank of this lane's block among the chosen ones (all distinct) = its output slot.
  int rank = 0, used = 0;
  for (int m = 0; m < n; ++m) {
    const int other = __shfl_sync(kFullWarp, chosen, m);
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
