// Selected-block attention (NSA section 3.3.2), forward and backward.
//
// bf16/fp16 inputs run on tensor cores (mma_tile.cuh); fp32 inputs keep the scalar kernels
// of attention_tile.cuh.
//
// Forward and dQ are query-centric. Where neighbouring positions share their blocks (short
// sequences) the forward runs over shared-memory tiles (smem_fwd::TiledFwdKernel with
// ChosenBlocksWalk, below). Where they share few (long sequences, small groups) it is
// key-centric instead: one partial result per selected block, combined per position
// (selected_block_forward.cuh, UseBlockForward; at head_dim 64, and 128 on an sm_90 device,
// the local blocks go to a pass of their own first, LocalBlocksOnTheirOwnPass). Otherwise,
// and for the query-side dQ, two register kernels picked by shape (UseRowsKernel):
//   * per position (SelectedQueryMmaKernel): one warp per (b, t, g), the group's heads as
//     the 16 MMA rows (padded when H/G < 16), K/V fragments loaded straight from L2; four
//     consecutive positions share a CTA so their common blocks come from L1.
//   * flattened rows (SelectedRowsMmaKernel): one warp per 16 consecutive (position, head)
//     rows of a (b, g), walking the union of the blocks those positions chose with a
//     per-row mask. No padded rows; it wins whenever neighbours share their blocks (short
//     sequences: every position below n * l' selects all its causal blocks) and loses a
//     little at 64k with H/G = 6 and unrelated selections (measured, see PERFORMANCE.md).
//
// dK/dV are key-centric: the block index map is inverted on the GPU (a stable sort of
// (batch, group, block) keys, so each block's query list comes out in position order), and
// one CTA per (block, slice of at most kQueriesPerCta of its queries) accumulates dK/dV of
// the block in registers, its query rows staged in shared memory with cp.async one step
// ahead (SelectedDkDvStagedKernel). Block 0 and the local blocks are chosen by every query,
// so a block can have up to T queries; slicing the lists keeps the grid balanced at the
// price of one float32 atomic add per key element per slice (not per query). For groups of
// fewer than 16 heads, that kernel also produces dQ (fused, as FlashAttention's
// backward does): it holds dS already, and the query-side dQ kernel would recompute S, P,
// dP and dS; the CTA adds its dQ rows into a float32 buffer once per (row, block).
//
// Tests and benchmarks force a forward/dQ kernel, a dK/dV kernel or register budget, and the
// queries per dK/dV work item through SelectedKernelChoice (kernel_choice.h), read once per
// call; the default (all auto) is the dispatch below. kernels_test forces every path.
#include <algorithm>
#include <climits>
#include <mutex>
#include <type_traits>

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>

#include "block_map.h"
#include "launch_util.cuh"
#include "mma_tile.cuh"
#include "smem_fwd_tile.cuh"
#include "selected_block_forward.cuh"
#include "selected_dkdv_wgmma.cuh"
#include "kernel_choice.h"

namespace nsad::nsa::cuda::detail {

namespace {
std::mutex choice_mutex;
SelectedKernelChoice choice_state;  // guarded by choice_mutex
}  // namespace

void SetSelectedKernelChoiceForTesting(const SelectedKernelChoice& choice) {
  std::lock_guard<std::mutex> lock(choice_mutex);
  choice_state = choice;
}

SelectedKernelChoice GetSelectedKernelChoice() {
  std::lock_guard<std::mutex> lock(choice_mutex);
  return choice_state;
}

namespace {

constexpr int kQueriesPerCta = 256;  // measured on H100: see QueriesPerCta
constexpr int kMaxQueriesPerCta = kMaxSelectedQueriesPerItem;  // the dK/dV kernels keep positions in smem
// The staged dK/dV build the auto choice takes at D=64 where the warpgroup-MMA kernel cannot
// run, with and without fused dQ (see LaunchSelectedDkDv; measured on H100, PERFORMANCE.md).
constexpr SelectedKernelChoice::DkDv kDefaultDkDv64 = SelectedKernelChoice::DkDv::kStaged32x3;

using Choice = SelectedKernelChoice;

// Reads the process-wide choice once for a call and rejects what this call cannot run, so a
// forced kernel is never replaced by another one without notice.
Choice ChoiceFor(const at::Tensor& q, const Shape& s, int n) {
  const Choice c = GetSelectedKernelChoice();
  TORCH_CHECK(c.queries_per_item >= 0 && c.queries_per_item <= kMaxQueriesPerCta,
              "SelectedKernelChoice: queries_per_item must be 0 (auto) or 1..", kMaxQueriesPerCta,
              ", got ", c.queries_per_item);
  TORCH_CHECK(c.partial_bytes >= 0, "SelectedKernelChoice: partial_bytes must be 0 (default) or positive, got ",
              c.partial_bytes);
  if (q.scalar_type() == at::kFloat) {
    TORCH_CHECK(c.fwd == Choice::Fwd::kAuto && c.dkdv == Choice::DkDv::kAuto,
                "SelectedKernelChoice: fp32 inputs run the scalar kernels; only kAuto applies");
  }
  TORCH_CHECK(c.fwd != Choice::Fwd::kRows || n <= 32,
              "SelectedKernelChoice: the rows kernel needs top_n <= 32, got ", n);
  TORCH_CHECK(s.D == 64 || c.dkdv == Choice::DkDv::kAuto || c.dkdv == Choice::DkDv::kUnstaged ||
                  c.dkdv == Choice::DkDv::kWgmma,
              "SelectedKernelChoice: the staged dK/dV register budgets are D=64 builds; D=", s.D,
              " takes kAuto, kUnstaged or kWgmma");
  TORCH_CHECK(c.dkdv != Choice::DkDv::kWgmma || WgmmaRunsHere(),
              "SelectedKernelChoice: the warpgroup-MMA dK/dV kernel needs an sm_90 device and kernels built for "
              "sm_90a");
  if (c.dq == Choice::Dq::kFused) {
    TORCH_CHECK(q.scalar_type() != at::kFloat, "SelectedKernelChoice: fused dQ is a tensor-core kernel; fp32 "
                "inputs run the scalar kernels");
    TORCH_CHECK(c.dkdv != Choice::DkDv::kUnstaged,
                "SelectedKernelChoice: fused dQ runs in the staged dK/dV kernel, not kUnstaged");
  }
  return c;
}

// Queries per dK/dV work item (and per CTA of the key-centric forward). Measured on H100,
// 256 against 128 (one call, 128 -> 256): 64k forward D128 12:2 11.24 / 11.19 -> 10.96 /
// 10.97 ms, D64 12:2 6.02 / 6.01 -> 5.93 / 5.99 ms; the m7c batch 16 training step the same
// within the machine's spread (86.18-86.46 -> 85.96-86.34 ms); 512 is no faster at B16 T2048
// and slower at 64k backward (a sweep of 128/256/384/512 in an earlier call).
int QueriesPerCta(const Choice& c) { return c.queries_per_item > 0 ? c.queries_per_item : kQueriesPerCta; }

// Forward (and, with kDq, the dQ backward) of one (b, t, g) per warp on tensor cores.
template <typename scalar_t, int D, bool kDq>
__global__ void __launch_bounds__(mma::kMmaThreads)
    SelectedQueryMmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                           const float* __restrict__ delta, scalar_t* __restrict__ out,
                           float* __restrict__ lse, Shape s, const int* __restrict__ block_idx,
                           int n, int slc_block, float scale_log2, float dq_scale) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  // dQ keeps K fragments live across two products: half the keys per step keeps it in registers.
  constexpr int kN = kDq ? mma::KeysPerStep<D>() / 2 : mma::KeysPerStep<D>();
  const int lane = threadIdx.x & 31;
  const int t = static_cast<int>(blockIdx.x) * mma::kWarps + static_cast<int>(threadIdx.x >> 5);
  if (t >= s.T) return;  // whole warps
  const int grp = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z), hq = s.hq();
  const int head[2] = {lane >> 2, (lane >> 2) + 8};  // the lane's two MMA rows
  const bool valid[2] = {head[0] < hq, head[1] < hq};
  // Padding rows (heads >= hq) get Q = 0: harmless scores, never stored.
  mma::RowFrag<D> qa, qb;
  mma::LoadRow<D>(qa, valid[0] ? q + QueryOffset(s, b, t, grp * hq + head[0]) : nullptr, lane);
  mma::LoadRow<D>(qb, valid[1] ? q + QueryOffset(s, b, t, grp * hq + head[1]) : nullptr, lane);
  const int* idx = block_idx + ((static_cast<int64_t>(b) * s.T + t) * s.G + grp) * n;
  const int64_t stride = static_cast<int64_t>(s.G) * s.D;
  const auto all = [](int, int) { return true; };  // causality is in the step's key count
  int64_t row_index[2];
#pragma unroll
  for (int half = 0; half < 2; ++half)
    row_index[half] = (static_cast<int64_t>(b) * s.T + t) * s.H + grp * hq + head[half];

  if constexpr (!kDq) {
    mma::FwdState<D> st;
    st.Init();
    for (int slot = 0; slot < n; ++slot) {
      const int blk = idx[slot];
      if (blk < 0 || RepeatsEarlierSlot(idx, slot)) continue;
      const int end = min(min(blk * slc_block + slc_block, s.T), t + 1);
      for (int start = blk * slc_block; start < end; start += kN) {
        mma::FwdStep<kBf16, D, kN>(st, qa, qb, k + KeyOffset(s, b, start, grp),
                                   v + KeyOffset(s, b, start, grp), stride, min(kN, end - start),
                                   scale_log2, all, lane);
      }
    }
    scalar_t* const out_row[2] = {valid[0] ? out + row_index[0] * s.D : nullptr,
                                  valid[1] ? out + row_index[1] * s.D : nullptr};
    float* const lse_row[2] = {lse + row_index[0], lse + row_index[1]};
    mma::FwdFinish<kBf16, D>(st, out_row, lse_row, lane);
  } else {
    mma::RowFrag<D> da, db;
    mma::LoadRow<D>(da, valid[0] ? dout + row_index[0] * s.D : nullptr, lane);
    mma::LoadRow<D>(db, valid[1] ? dout + row_index[1] * s.D : nullptr, lane);
    const float row_lse[2] = {valid[0] ? lse[row_index[0]] : INFINITY,
                              valid[1] ? lse[row_index[1]] : INFINITY};
    const float row_delta[2] = {valid[0] ? delta[row_index[0]] : 0.f,
                                valid[1] ? delta[row_index[1]] : 0.f};
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    for (int slot = 0; slot < n; ++slot) {
      const int blk = idx[slot];
      if (blk < 0 || RepeatsEarlierSlot(idx, slot)) continue;
      const int end = min(min(blk * slc_block + slc_block, s.T), t + 1);
      for (int start = blk * slc_block; start < end; start += kN) {
        mma::DqStep<kBf16, D, kN>(acc, qa, qb, da, db, k + KeyOffset(s, b, start, grp),
                                  v + KeyOffset(s, b, start, grp), stride, min(kN, end - start),
                                  scale_log2, row_lse, row_delta, all, lane);
      }
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (valid[half]) mma::StoreRow<kBf16, D>(out + row_index[half] * s.D, acc, half, dq_scale, lane);
  }
}

// Forward (and, with kDq, dQ) over flattened (position, head) rows: each warp takes 16
// consecutive rows of one (b, g), i.e. ceil(16 / hq) or so positions, and walks the UNION of
// the blocks those positions selected (a merge of their ascending lists), masking per row
// the blocks its own position did not select. With hq < 16 heads per group the per-position
// kernel above pads the MMA rows (hq = 6: 10 of 16 rows wasted); this one fills them, which
// pays whenever neighbouring positions share most blocks (short sequences: every position
// below n * l' selects all its causal blocks), or when the warp spans whole positions
// (16 % hq == 0: the union is at most what the padded kernel would do anyway).
template <typename scalar_t, int D, bool kDq>
__global__ void __launch_bounds__(mma::kMmaThreads)
    SelectedRowsMmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                          const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                          const float* __restrict__ delta, scalar_t* __restrict__ out,
                          float* __restrict__ lse, Shape s, const int* __restrict__ block_idx,
                          int n, int slc_block, float scale_log2, float dq_scale) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kN = kDq ? mma::KeysPerStep<D>() / 2 : mma::KeysPerStep<D>();
  const int lane = threadIdx.x & 31, hq = s.hq();
  const int total = s.T * hq;  // flattened rows of this (b, g)
  const int r0 = (static_cast<int>(blockIdx.x) * mma::kWarps + static_cast<int>(threadIdx.x >> 5)) * 16;
  if (r0 >= total) return;  // whole warps
  const int grp = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int p_lo = r0 / hq, p_hi = min(r0 + 15, total - 1) / hq;  // positions spanned (<= 16)
  int t[2], pos_rel[2];
  bool valid[2];
  int64_t row_index[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int rho = r0 + (lane >> 2) + 8 * half;
    valid[half] = rho < total;
    t[half] = valid[half] ? rho / hq : p_hi;
    pos_rel[half] = valid[half] ? t[half] - p_lo : 31;  // bit 31 of the selection mask is never set
    row_index[half] = (static_cast<int64_t>(b) * s.T + t[half]) * s.H + grp * hq + (valid[half] ? rho % hq : 0);
  }
  mma::RowFrag<D> qa, qb;
  mma::LoadRow<D>(qa, valid[0] ? q + row_index[0] * s.D : nullptr, lane);
  mma::LoadRow<D>(qb, valid[1] ? q + row_index[1] * s.D : nullptr, lane);
  const int64_t stride = static_cast<int64_t>(s.G) * s.D;

  // Lane p < npos walks the list of position p_lo + p; head = its next block (INT_MAX: done).
  // Unused (-1) slots and repeats (RepeatsEarlierSlot) are skipped wherever they are.
  const int npos = p_hi - p_lo + 1;
  const int* list = block_idx + ((static_cast<int64_t>(b) * s.T + p_lo + min(lane, npos - 1)) * s.G + grp) * n;
  int ptr = lane < npos ? 0 : n;
  const auto next_head = [&]() {
    while (ptr < n) {
      const int x = list[ptr];
      if (x >= 0 && !RepeatsEarlierSlot(list, ptr)) return x;
      ++ptr;
    }
    return INT_MAX;
  };
  int head = next_head();
  const unsigned all_pos = (1u << npos) - 1;  // npos <= 16

  // Runs step(start, count, allowed) over every key step of the union of blocks.
  const auto walk = [&](auto&& step) {
    for (;;) {
      const int blk = __reduce_min_sync(0xffffffffu, head);
      if (blk == INT_MAX) break;
      const unsigned sel = __ballot_sync(0xffffffffu, head == blk);  // positions that chose blk
      if (head == blk) {
        ++ptr;
        head = next_head();
      }
      const int end = min(min(blk * slc_block + slc_block, s.T), p_hi + 1);
      const bool row_sel[2] = {((sel >> pos_rel[0]) & 1u) != 0, ((sel >> pos_rel[1]) & 1u) != 0};
      const bool all_sel = (sel & all_pos) == all_pos;
      for (int start = blk * slc_block; start < end; start += kN) {
        if (all_sel && start + kN <= min(end, p_lo + 1)) {
          // Every row chose the block and sees the whole step (the common case when the
          // positions share their blocks): a literal count and no mask, so the inlined step
          // drops all per-key checks. Rows past the end have Q = 0 and are never stored.
          step(start, std::integral_constant<int, kN>{}, [](int, int) { return true; });
        } else {
          const int lim[2] = {t[0] - start, t[1] - start};  // causal: step-relative key <= t
          step(start, min(kN, end - start),
               [&](int half, int key) { return row_sel[half] && key <= lim[half]; });
        }
      }
    }
  };

  if constexpr (!kDq) {
    mma::FwdState<D> st;
    st.Init();
    walk([&](int start, auto count, auto allowed) {
      mma::FwdStep<kBf16, D, kN>(st, qa, qb, k + KeyOffset(s, b, start, grp), v + KeyOffset(s, b, start, grp),
                                 stride, count, scale_log2, allowed, lane);
    });
    scalar_t* const out_row[2] = {valid[0] ? out + row_index[0] * s.D : nullptr,
                                  valid[1] ? out + row_index[1] * s.D : nullptr};
    float* const lse_row[2] = {lse + row_index[0], lse + row_index[1]};
    mma::FwdFinish<kBf16, D>(st, out_row, lse_row, lane);
  } else {
    mma::RowFrag<D> da, db;
    mma::LoadRow<D>(da, valid[0] ? dout + row_index[0] * s.D : nullptr, lane);
    mma::LoadRow<D>(db, valid[1] ? dout + row_index[1] * s.D : nullptr, lane);
    const float row_lse[2] = {valid[0] ? lse[row_index[0]] : INFINITY, valid[1] ? lse[row_index[1]] : INFINITY};
    const float row_delta[2] = {valid[0] ? delta[row_index[0]] : 0.f, valid[1] ? delta[row_index[1]] : 0.f};
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    walk([&](int start, auto count, auto allowed) {
      mma::DqStep<kBf16, D, kN>(acc, qa, qb, da, db, k + KeyOffset(s, b, start, grp),
                                v + KeyOffset(s, b, start, grp), stride, count, scale_log2, row_lse,
                                row_delta, allowed, lane);
    });
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (valid[half]) mma::StoreRow<kBf16, D>(out + row_index[half] * s.D, acc, half, dq_scale, lane);
  }
}

// The selected branch's walk for the tiled forward (smem_fwd::TiledFwdKernel): the union of
// the blocks the CTA's positions chose. Prepare builds a mask per block in shared memory (bit
// p: position t0 + p chose the block); a row attends a block's keys only if its position chose
// it and the key is causal. The selection is a set here, as in the reference (a block listed
// twice counts once). kLocalOnly: only the positions' local blocks (IsLocalBlock), the
// key-centric forward's tiled pass (SelectedKernelChoice::Local); the candidates are then
// block 0 and the blocks from the one before the first position's to the last position's, so
// the masks are a few words and the walk does not scan every block of the sequence.
template <bool kLocalOnly>
struct ChosenBlocksWalk {
  // Masks of a local walk: blocks lo .. hi (hi - lo <= 32 for 32 positions, any slc_block),
  // then block 0's when lo > 0.
  static constexpr int kLocalMasks = 34;
  const int* block_idx;  // [B,T,G,n]
  int n, slc_block, num_blocks;
  unsigned* chosen = nullptr;  // the masks, in the CTA's shared memory
  unsigned all_rows = 0;
  int t0 = 0, lo = 0, hi = 0;  // the local walk's candidate range

  static int SmemBytes(int num_blocks) { return 4 * (kLocalOnly ? kLocalMasks : num_blocks); }
  // Where a local walk keeps candidate block blk's mask.
  __device__ int LocalSlot(int blk) const { return blk >= lo ? blk - lo : kLocalMasks - 1; }
  __device__ unsigned Mask(int blk) const {
    if constexpr (kLocalOnly) {
      return chosen[LocalSlot(blk)];
    } else {
      return chosen[blk];
    }
  }
  __device__ void Prepare(void* smem, const Shape& s, int b, int grp, int first, int positions) {
    chosen = static_cast<unsigned*>(smem);
    t0 = first;
    all_rows = positions >= 32 ? 0xffffffffu : (1u << positions) - 1u;
    if constexpr (kLocalOnly) {
      lo = max(0, first / slc_block - 1);
      hi = min(num_blocks - 1, (first + positions - 1) / slc_block);
    }
    const int masks = kLocalOnly ? kLocalMasks : num_blocks;
    for (int i = threadIdx.x; i < masks; i += blockDim.x) chosen[i] = 0u;
    __syncthreads();
    const int* idx = block_idx + ((static_cast<int64_t>(b) * s.T + t0) * s.G + grp) * n;
    for (int i = threadIdx.x; i < positions * n; i += blockDim.x) {
      const int p = i / n;
      const int blk = idx[static_cast<int64_t>(p) * s.G * n + i % n];
      if (blk < 0 || blk >= num_blocks) continue;
      if constexpr (kLocalOnly) {
        if (IsLocalBlock(blk, t0 + p, slc_block)) atomicOr(&chosen[LocalSlot(blk)], 1u << p);
      } else {
        atomicOr(&chosen[blk], 1u << p);
      }
    }
    __syncthreads();
  }
  __device__ int Next(int from) const {  // CTA-uniform: the masks are read-only from here on
    if constexpr (kLocalOnly) {
      if (from <= 0 && lo > 0 && chosen[kLocalMasks - 1] != 0u) return 0;
      for (from = max(from, lo); from <= hi && chosen[from - lo] == 0u;) ++from;
      return from <= hi ? from : -1;
    } else {
      while (from < num_blocks && chosen[from] == 0u) ++from;
      return from < num_blocks ? from : -1;
    }
  }
  __device__ int First() const { return Next(0); }
  __device__ int Start(int blk) const { return blk * slc_block; }
  __device__ int Count(const Shape& s, int blk) const { return min(slc_block, s.T - blk * slc_block); }
  // Every row chose the block and sees all its keys (CTA-uniform): no per-row test.
  __device__ bool EveryRowSeesAll(int blk, int key0, int count) const {
    return (Mask(blk) & all_rows) == all_rows && key0 + count - 1 <= t0;
  }
  // A block wholly before the CTA's first position: each row sees all of it (its position
  // chose it) or none (CTA-uniform), so the forward tests rows, not scores (RowSees).
  static constexpr bool kWholeBlockRows = true;
  // Not overlapped by default at D64 (TiledWgmmaOverlap; at D128 it is, LaunchTiledForward):
  // the overlapped walk spills 32 bytes there (ptxas), and on the H200 (ncu, D64 12:2) the
  // kernel went 372-374 -> 401-403 us at B16 T2048 (the selected forward at B1 T2048
  // 0.051-0.052 -> 0.055-0.058 ms).
  static constexpr bool kOverlapByDefault = false;
  __device__ bool RowsSeeWholeBlock(int key0, int count) const { return key0 + count - 1 <= t0; }
  __device__ bool RowSees(int blk, int pos) const { return ((Mask(blk) >> pos) & 1u) != 0u; }
  // Block-relative keys [lo, hi] that row (pos, t) sees: the causal ones if the position
  // chose the block, none otherwise.
  __device__ void RowKeys(int blk, int pos, int t, int key0, int count, int& lo_key, int& hi_key) const {
    lo_key = 0;
    hi_key = ((Mask(blk) >> pos) & 1u) != 0u ? min(count - 1, t - key0) : -1;
  }
};

// Which query-side tensor-core kernel runs. A forced choice wins (tests cover both paths on
// every shape; ChoiceFor rejected kRows with n > 32); the default picks rows where its union
// walk cannot do more block steps than the padded per-position kernel (see
// SelectedRowsMmaKernel).
bool UseRowsKernel(const Choice& c, const Shape& s, int n, int num_blocks) {
  if (c.fwd == Choice::Fwd::kRows) return true;
  if (c.fwd == Choice::Fwd::kHeads) return false;  // kTiled: forward only, dQ takes the auto rule
  if (n > 32) return false;  // ballot masks: at most 32 positions per warp (16 in practice)
  const int hq = s.hq();
  return hq < 16 && (num_blocks <= 2 * n || 16 % hq == 0);
}

template <typename scalar_t, int D, bool kDq>
void LaunchSelectedQueryMma(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor* dout, const at::Tensor* delta, at::Tensor& out,
                            const at::Tensor& lse, const Shape& s, const at::Tensor& block_idx,
                            const Geo& g, const Choice& choice) {
  const int n = static_cast<int>(block_idx.size(3));
  const bool rows = UseRowsKernel(choice, s, n, (s.T + g.slc_block - 1) / g.slc_block);
  const int64_t work = rows ? (static_cast<int64_t>(s.T) * s.hq() + 15) / 16 : s.T;  // warps per (b, g)
  const dim3 grid(static_cast<unsigned>((work + mma::kWarps - 1) / mma::kWarps), s.G, s.B);
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  const float scale = 1.f / std::sqrt(static_cast<float>(s.D));
  auto kernel = rows ? SelectedRowsMmaKernel<scalar_t, D, kDq> : SelectedQueryMmaKernel<scalar_t, D, kDq>;
  kernel<<<grid, mma::kMmaThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
          q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
          dout ? dout->data_ptr<scalar_t>() : nullptr, delta ? delta->data_ptr<float>() : nullptr,
          out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, block_idx.data_ptr<int>(),
          static_cast<int>(block_idx.size(3)), g.slc_block, scale * kLog2e, scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tiled forward (smem_fwd::TiledFwdKernel): forced, or (auto) where neighbouring positions
// share their blocks, num_blocks <= 2n (every position below n l' takes all its causal
// blocks; any group size the kernels take, <= 16 heads: 8+ positions per CTA). Measured
// on H100 at B16 T2048 (nsa_bench, selected forward ms, rows/heads kernel -> tiled): D64 12:2
// 0.836 -> 0.624, 64:4 3.588 -> 2.890, D128 12:2 1.344 -> 1.112, 64:4 7.045 -> 5.392. At 64k
// a CTA's positions share almost nothing (D64 12:2: 12.2 ms against 4.8).
bool UseTiledForward(const Choice& c, const Shape& s, int n, int num_blocks) {
  if (c.fwd == Choice::Fwd::kTiled) return true;
  if (c.fwd != Choice::Fwd::kAuto) return false;
  return num_blocks <= 2 * n;
}

template <typename scalar_t, int D>
void LaunchSelectedTiledForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                at::Tensor& lse, const Shape& s, const at::Tensor& block_idx, const Geo& g) {
  const int num_blocks = (s.T + g.slc_block - 1) / g.slc_block;
  const ChosenBlocksWalk<false> walk{block_idx.data_ptr<int>(), static_cast<int>(block_idx.size(3)), g.slc_block,
                                     num_blocks};
  smem_fwd::LaunchTiledForward<scalar_t, D>(q, k, v, out, lse, s, walk, walk.SmemBytes(num_blocks));
}

struct SelectedQueryPolicy {
  const int* block_idx;  // [B,T,G,n]
  int n, slc_block;

  __device__ QueryTile Tile(const Shape&) const {
    return {static_cast<int>(blockIdx.z), static_cast<int>(blockIdx.y), static_cast<int>(blockIdx.x),
            1, true};
  }
  __device__ int NumChunks(const Shape&, const QueryTile&) const { return n; }
  __device__ KeyChunk Chunk(const Shape& s, const QueryTile& tile, int slot) const {
    const int* list = block_idx + ((static_cast<int64_t>(tile.b) * s.T + tile.t0) * s.G + tile.g) * n;
    const int blk = list[slot];
    if (blk < 0 || RepeatsEarlierSlot(list, slot)) return {0, 0};
    const int start = blk * slc_block;
    const int end = min(min(start + slc_block, s.T), tile.t0 + 1);  // causal inside the block
    return {start, max(0, end - start)};
  }
  __device__ bool Allowed(const Shape&, int t, int key) const { return key <= t; }
};

// Work items of the key-centric kernels (dK/dV, and the block forward of
// selected_block_forward.cuh) over the inverted block map (InvertBlockMap): item -> one
// (b, g, block) segment and a slice of at most queries_per_cta of its entries.
struct SelectedKeyPolicy {
  const int* item_order;     // [grid]: work item of each CTA (position order), or null: CTA = item
  const int64_t* chunk_off;  // [S+1]: first work item of each (b, g, block) segment
  const int* item_seg;       // [grid]: the segment of each work item (one load, not a search)
  const int64_t* seg_off;    // [S+1]: first entry of each segment in sorted_entry
  const int* sorted_entry;   // block_idx entries ((b T + t) G + g) n + slot, by segment, t ascending inside
  int num_segments, NS, slc_block, queries_per_cta;
  int T, per_position;  // per_position = G n entries per position

  __device__ KeyWork Work(const Shape& s) const {
    KeyWork w{};
    const int64_t item = item_order ? item_order[blockIdx.x] : blockIdx.x;
    if (item >= chunk_off[num_segments]) return w;  // grid is an upper bound
    const int seg = item_seg[item];                 // last segment with chunk_off <= item
    const int64_t first = seg_off[seg] + (item - chunk_off[seg]) * queries_per_cta;
    const int blk = seg % NS, bg = seg / NS;
    w.b = bg / s.G;
    w.g = bg % s.G;
    w.keys = {blk * slc_block, min(slc_block, s.T - blk * slc_block)};
    w.num_queries = static_cast<int>(min(static_cast<int64_t>(queries_per_cta), seg_off[seg + 1] - first));
    w.query_base = first;
    w.valid = true;
    return w;
  }
  __device__ int Entry(const KeyWork& w, int i) const { return sorted_entry[w.query_base + i]; }
  __device__ int Query(const KeyWork& w, int i) const { return Entry(w, i) / per_position % T; }  // position
  __device__ bool Allowed(const Shape&, int t, int key) const { return key <= t; }
  // Whether every position in [t_min, t_max] sees every key of `keys`.
  __device__ bool AllowsAll(int t_min, int, const KeyChunk& keys) const { return keys.start + keys.count - 1 <= t_min; }
};

// The key-centric kernels' view of an inverted block map (block_map.h).
SelectedKeyPolicy KeyPolicy(const BlockMap& map, const Shape& s, int n, int slc_block) {
  return {map.item_order.defined() ? map.item_order.data_ptr<int>() : nullptr, map.chunk_off.data_ptr<int64_t>(),
          map.item_seg.data_ptr<int>(), map.seg_off.data_ptr<int64_t>(), map.sorted_entry.data_ptr<int>(),
          static_cast<int>(map.segments), map.NS, slc_block, map.queries_per_item, s.T, s.G * n};
}

// Work items in position order: forced, or (auto) for the dK/dV kernel with fused dQ at long
// sequences (num_blocks >= 32 n), where a position's dQ row gets its n atomic adds from CTAs
// that now run close together, while the row is in L2. Measured on H100 (nsa_bench, one NSA
// layer, block -> position order): 64k D64 12:2 backward 10.26 -> 9.58 ms; the selected
// backward alone at 64k D128 12:2 10.25 -> 9.63 ms (--slc-only). No gain without fused dQ
// (64k D128 12:2, query-side dQ: 13.97 -> 14.06 ms selected backward) nor at 64:4 (71.70 ->
// 71.61 ms forward+backward), and losses elsewhere: batch 16 T=2048 forward+backward 4.19 ->
// 4.31, the block forward at 64k D64 12:2 3.33 -> 3.54 ms.
bool PositionOrder(const Choice& c, const Shape& s, int n, int num_blocks, bool fused_dq_backward) {
  if (c.order != Choice::Order::kAuto) return c.order == Choice::Order::kPosition;
  return fused_dq_backward && s.hq() <= 8 && num_blocks >= 32 * n;
}

// The key-centric forward (selected_block_forward.cuh): forced, or (auto) where neighbouring
// positions share few blocks (num_blocks >= 8 n at D=64, 4 n at D=128, whose blocks cost
// twice the bytes to read) and groups are small enough that the partials, which grow with
// the heads per group, cost less than the per-position kernel's block reads, which do not
// (it pads the group to 16 MMA rows). Measured on the H200 with the batched combine and three
// CTAs an SM at D=64 (nsa_bench, batch 1, 12:2, `slc` forward ms, 2 rounds (at 4k one of
// the per-position kernel), per-position -> blocks): 4k D64 0.279 -> 0.268-0.287 (even: the
// per-position kernel stays), D128 0.574 -> 0.407-0.457; 8k D64 0.567-0.598 -> 0.375-0.466,
// D128 1.193-1.201 -> 0.731-0.758; 16k D64 1.144-1.154 -> 0.637-0.681. 64:4 loses at every
// length (8k D64 1.12 -> 1.50-1.58, 64k D64 9.57-9.63 -> 11.39-11.52): by the H100's
// interpolation over the heads per group, it pays up to about 8 heads.
bool UseBlockForward(const Choice& c, const Shape& s, int n, int num_blocks) {
  if (c.fwd == Choice::Fwd::kBlocks) return true;
  if (c.fwd != Choice::Fwd::kAuto) return false;
  return num_blocks >= (s.D >= 128 ? 4 : 8) * n && s.hq() <= 8;
}

// The partials of a pass (B T G n hq rows of D values and an lse) stay under this many bytes:
// a batch too large for it runs in passes of whole batch elements, so the forward's memory
// does not grow with the batch (64k, D=128, 6 heads per group: 3.3 GB per element).
constexpr int64_t kDefaultPartialBytes = int64_t{4} << 30;

// Whether LocalBlocksWgmmaKernel can run: block_fwd::LocalCfg's shape (head_dim 64 or 128,
// selection blocks of 64 keys), bf16/fp16, an sm_90 device.
bool LocalKernelRuns(const at::Tensor& q, const Shape& s, const Geo& g) {
  return q.scalar_type() != at::kFloat && (s.D == 64 || s.D == 128) && g.slc_block == block_fwd::LocalCfg<64>::kN &&
         WgmmaRunsHere();
}

// Whether the key-centric forward hands the local blocks to a pass of their own (the tiled
// kernel, or LocalBlocksWgmmaKernel: LocalBlocksOnOwnKernel; SelectedKernelChoice::Local):
// forced, or (auto) at head_dim 64, where the pass runs on warpgroup MMAs (the local kernel,
// else the tiled one), and at head_dim 128 where the local kernel runs. Measured on the H200
// at 64k 12:2 (ncu): D64 the block kernel 1.56 -> 1.27 ms and the combine 479 -> 495 us for a
// 217 us pass on the tiled kernel (60 us saved; `slc` at 16k 0.70 -> 0.62 ms). D128: the
// block kernel 3.03 -> 2.47 ms and the combine 908 -> 964 us for a 313 us pass on the local
// kernel (168 registers), `slc` 64k 4.07-4.11 -> 3.86-3.87 ms, 16k 1.15-1.18 -> 1.05 ms; on
// the mma.sync tiled kernel (548 us, 242 registers) D128 gained nothing.
bool LocalBlocksOnTheirOwnPass(const Choice& c, const at::Tensor& q, const Shape& s, const Geo& g) {
  if (c.local != Choice::Local::kAuto) return c.local != Choice::Local::kInBlocks;
  return s.D == 64 || (s.D == 128 && LocalKernelRuns(q, s, g));
}

// Whether that pass runs on LocalBlocksWgmmaKernel: forced (a forced choice that cannot run
// fails the call), or (auto) wherever it runs. H200, 64k D64 12:2 (ncu): 219 us on the tiled
// pass's kernel -> 156 us (121 registers, 60M instructions against 104M); the selected
// forward 2.12-2.16 -> 2.05-2.07 ms (nsa_bench --slc-only, PERFORMANCE.md). Waiting for a
// block's P V only after the next block's Q K^T went out (FlashAttention-3's overlap) gained
// 1-2 us of 155 (D128 3 of 313) and was not kept.
bool LocalBlocksOnOwnKernel(const Choice& c, const at::Tensor& q, const Shape& s, const Geo& g) {
  const bool runs = LocalKernelRuns(q, s, g);
  if (c.local == Choice::Local::kLocalKernel) {
    TORCH_CHECK(runs, "SelectedKernelChoice: the local-blocks kernel needs bf16/fp16, head_dim 64 or 128, selection "
                      "blocks of 64 keys and an sm_90 device with kernels built for sm_90a");
    return true;
  }
  return c.local == Choice::Local::kAuto && runs;
}

template <typename scalar_t, int D>
void LaunchSelectedBlockForwardPass(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor out,
                                    at::Tensor lse, const Shape& s, const at::Tensor& block_idx, const Geo& g,
                                    const Choice& choice) {
  const int n = static_cast<int>(block_idx.size(3)), NS = (s.T + g.slc_block - 1) / g.slc_block;
  // The local blocks on their own pass: its result goes to out (the combine reads it there
  // before it writes the row) and local_lse, and the block map leaves those entries out.
  const bool local_pass = LocalBlocksOnTheirOwnPass(choice, q, s, g);
  at::Tensor local_lse;
  if (local_pass) {
    local_lse = at::empty_like(lse);
    if (LocalBlocksOnOwnKernel(choice, q, s, g)) {
      using Cfg = block_fwd::LocalCfg<D>;
      LaunchKernel(block_fwd::LocalBlocksWgmmaKernel<scalar_t, D>, dim3(static_cast<unsigned>(NS), s.G, s.B),
                   Cfg::kThreads, Cfg::kSmemBytes, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                   v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), local_lse.data_ptr<float>(), s,
                   block_idx.data_ptr<int>(), n, kLog2e / std::sqrt(static_cast<float>(s.D)));
    } else {
      const ChosenBlocksWalk<true> walk{block_idx.data_ptr<int>(), n, g.slc_block, NS};
      smem_fwd::LaunchTiledForward<scalar_t, D>(q, k, v, out, local_lse, s, walk, walk.SmemBytes(NS));
    }
  }
  // One partial row per (entry, head): an entry that gets none (unused, a repeat, local) has
  // its lse rows marked -inf by InvertBlockMap, and its o rows are never read.
  auto part_o = at::empty({block_idx.numel() * s.hq(), s.D}, q.options());
  auto part_lse = at::empty({block_idx.numel() * s.hq()}, q.options().dtype(at::kFloat));
  const BlockMap map = InvertBlockMap(block_idx, NS, QueriesPerCta(choice),
                                      PositionOrder(choice, s, n, NS, /*fused_dq_backward=*/false),
                                      local_pass ? g.slc_block : 0, {part_lse.data_ptr<float>(), s.hq()});
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  const auto stream = at::cuda::getCurrentCUDAStream();
  if (map.segments > 0) {
    LaunchKernel(block_fwd::SelectedBlockFwdKernel<scalar_t, D, kMaxQueriesPerCta, SelectedKeyPolicy>,
                 dim3(static_cast<unsigned>(map.max_items)), block_fwd::BlockFwdCfg<D>::kThreads,
                 block_fwd::BlockFwdSmem<D, kMaxQueriesPerCta>::kBytes, q.data_ptr<scalar_t>(),
                 k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), part_o.data_ptr<scalar_t>(),
                 part_lse.data_ptr<float>(), s, KeyPolicy(map, s, n, g.slc_block), scale_log2);
  }
  const int64_t threads = static_cast<int64_t>(s.B) * s.T * s.H * (D / 8);
  const auto combine = choice.combine == Choice::Combine::kOne ? block_fwd::CombineSelectedPartials<scalar_t, D, 1>
                                                               : block_fwd::CombineSelectedPartials<scalar_t, D, 4>;
  combine<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(
      part_o.data_ptr<scalar_t>(), part_lse.data_ptr<float>(), out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, n,
      local_pass ? local_lse.data_ptr<float>() : nullptr);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, int D>
void LaunchSelectedBlockForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                                at::Tensor& lse, const Shape& s, const at::Tensor& block_idx, const Geo& g,
                                const Choice& choice) {
  const int64_t n = block_idx.size(3);
  if (s.B == 0 || s.T == 0 || n == 0) {
    out.zero_();
    lse.fill_(INFINITY);
    return;
  }
  const int64_t budget = choice.partial_bytes > 0 ? choice.partial_bytes : kDefaultPartialBytes;
  const int64_t per_element = static_cast<int64_t>(s.T) * s.G * n * s.hq() * (s.D * q.element_size() + 4);
  const int64_t per_pass = std::max<int64_t>(1, budget / per_element);
  for (int64_t b0 = 0; b0 < s.B; b0 += per_pass) {
    const int64_t nb = std::min<int64_t>(per_pass, s.B - b0);
    Shape part = s;
    part.B = static_cast<int>(nb);
    // Whole batch elements of contiguous tensors: the slices are contiguous views.
    LaunchSelectedBlockForwardPass<scalar_t, D>(q.narrow(0, b0, nb), k.narrow(0, b0, nb), v.narrow(0, b0, nb),
                                                out.narrow(0, b0, nb), lse.narrow(0, b0, nb), part,
                                                block_idx.narrow(0, b0, nb), g, choice);
  }
}

// ---------------------------------------------------------------------------------------
// dK/dV with the CTA's query rows staged in shared memory (cp.async, double-buffered).
// Same work split and math as mma::DkDvMmaKernel (each warp owns 16 keys of the block as MMA
// rows and walks the CTA's flattened (position, head) rows kR at a time), but the rows of
// the next step (Q, dO, lse, delta) are copied into shared memory while the current one is
// computed, once for the four warps, instead of each warp loading them from L2 right before
// use: the old kernel spent most of its time waiting on those loads (two dependent gathers
// per step for lse/delta, at 8 warps per SM). The P dO and dS Q products also take their
// B operands from those tiles (PRTileShared, ldmatrix.trans) rather than transposing rows
// held in registers, so dK/dV come out in natural column order (mma::AtomicAddRowColumns).
// 4-byte copies (lse, delta) use mma::CpAsync4; the rows mma::CpAsync16.

// Shared-memory tile rows are D 16-bit elements; 16-byte chunk ch of row r is stored at
// chunk ch ^ Perm(r % 8), Perm(r) = 4 (r & 1) + (r >> 1) (a bijection on 0..7), which serves
// both ways the tiles are read without bank conflicts:
//   * LoadRowShared: the 8 lanes of a quarter-warp read rows 2m, 2m+1, chunks 4i..4i+3; the
//     two rows' chunks differ in bit 2 (4 (r & 1)), the 4 chunks of a row in bits 0-1;
//   * ldmatrix (PRTileShared): 8 consecutive rows, one logical chunk; Perm is a bijection.
__device__ __forceinline__ int SwizzledChunk(int r, int ch) { return ch ^ (((r & 1) << 2) | ((r >> 1) & 3)); }

template <int D, typename scalar_t>
__device__ __forceinline__ void LoadRowShared(mma::RowFrag<D>& f, const scalar_t* tile, int r, int lane) {
  const uint4* row = reinterpret_cast<const uint4*>(tile + r * D);
#pragma unroll
  for (int i = 0; i < D / 32; ++i) f.c[i] = row[SwizzledChunk(r, 4 * i + (lane & 3))];
}

// acc += P R for the warp's 16 keys: P (16 keys x kR staged rows) in C-fragment floats p[j]
// of 8-row tile j, as S^T and dS^T come out of QKTile; R the staged rows (dO or Q, kR x D) in
// shared memory. R's B fragments come from ldmatrix.trans of the staged tile, so the rows
// need no registers across the softmax and no movmatrix transposes (mma::PRTile's way, from
// rows in registers). acc is in natural column order: acc[nt][2h + e] is key g + 8h,
// column 8 nt + 2c + e.
template <bool kBf16, int D, int kR, typename scalar_t>
__device__ __forceinline__ void PRTileShared(float (&acc)[D / 8][4], const float (&p)[kR / 8][4],
                                             const scalar_t* tile, int lane) {
  const uint32_t base = mma::SmemAddr(tile);
#pragma unroll
  for (int kk = 0; kk < kR / 16; ++kk) {
    uint32_t a[4];
    mma::PackA<kBf16>(a, p[2 * kk], p[2 * kk + 1]);
    // Lanes 8m .. 8m + 7 address matrix m: rows 16 kk + (0..7) + 8 (m & 1), chunk 2 np + m / 2.
    const int row = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
      uint32_t b[4];
      mma::LdMatrixX4Trans(b, base + (row * D + SwizzledChunk(row, 2 * np + (lane >> 4)) * 8) * 2);
      mma::Mma<kBf16>(acc[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
      mma::Mma<kBf16>(acc[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
    }
  }
}

// With kFusedDq the same kernel also produces dQ, as FlashAttention's backward does: dS is
// already in registers, so dQ += dS K costs one more product per step instead of a second
// kernel (the query-side dQ kernel recomputes S, P, dP and dS). dQ of a row sums over all 64
// keys of the block, which the four warps hold 16 each; rather than reducing four partial dQ
// tiles (measured: a shared-memory round trip of 4 x kR x 64 floats per step), the warps
// exchange dS (kR x 64 bf16) and each computes dQ for 16 columns of every 64-column part of
// D over all keys. Its K columns are B fragments loaded once per work item: in registers at
// D=64 (16 per lane), in shared memory at D=128, whose build has no registers to spare (it
// uses 255). Each lane adds 4 contiguous columns per row and part into the float32 dq_acc
// with one 16-byte atomic: a query row receives one add per selected block and part, never
// one per key.

// The warp's K columns of one 64-column part (columns col0 .. col0 + 63) as B fragments of
// dS K (keys contracted): kt[kk][half][mi] covers keys 16 kk + 8 half + (2c, 2c+1) of the
// block and output columns col0 + cols(w) + 4 c + 2 mi + (0, 1) of lane (g, c),
// cols(w) = 32 (w / 2) + 4 (w % 2) (so a lane's 4 outputs per row are contiguous). Keys past
// `count` are zero.
template <typename scalar_t>
__device__ __forceinline__ void LoadDqKeyFragments(uint32_t (&kt)[4][2][2], const scalar_t* k, const Shape& s,
                                                   const KeyWork& w, int col0, int warp, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key = 16 * kk + 8 * half + g;
      uint2 words = make_uint2(0, 0);  // columns col0 + 32 i + 8 c + 4 (w % 2) + 0..3 of this key row
      if (key < w.keys.count) {
        words = *reinterpret_cast<const uint2*>(k + KeyOffset(s, w.b, w.keys.start + key, w.g) + col0 +
                                                32 * (warp >> 1) + 8 * c + 4 * (warp & 1));
      }
      kt[kk][half][0] = mma::Transpose(words.x);
      kt[kk][half][1] = mma::Transpose(words.y);
    }
  }
}

// The four fragments of key step kk as one 16-byte value {kt[kk][0][0], kt[kk][0][1],
// kt[kk][1][0], kt[kk][1][1]}: the unit AddDqColumns reads, from registers or shared memory.
__device__ __forceinline__ uint4 PackKeyStep(const uint32_t (&kt)[4][2][2], int kk) {
  return make_uint4(kt[kk][0][0], kt[kk][0][1], kt[kk][1][0], kt[kk][1][1]);
}

// Writes the warp's dS (keys 16 w .. 16 w + 15 of every staged row) as bf16/fp16 into the
// CTA's [kR rows][64 keys] tile (swizzled 16-byte chunks, as the ldmatrix reads expect).
// dS^T is held in C-fragment layout (keys x rows); movmatrix turns each 8x8 piece into rows.
template <bool kBf16, int kR>
__device__ __forceinline__ void StoreDsRows(unsigned char* ds_tile, const float (&ds_t)[kR / 8][4], int warp,
                                            int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int j = 0; j < kR / 8; ++j) {
    const int row = 8 * j + g;
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // keys 16 w + 8 half + 2c, +1
      const uint32_t v = mma::Transpose(mma::Pack<kBf16>(ds_t[j][2 * half], ds_t[j][2 * half + 1]));
      *reinterpret_cast<uint32_t*>(ds_tile + mma::SwizzledOffset<64>(row, 2 * warp + half) + 4 * c) = v;
    }
  }
}

// dQ of the step's rows for the warp's 16 columns of each 64-column part of D, dS (from the
// tile) times K, added into dq_acc rows times `scale`. key_step(part, kk) gives the part's
// PackKeyStep fragments. meta[r].z holds staged row r's position as float bits (-1 past the
// end).
template <bool kBf16, int kR, int D, typename KeyStep>
__device__ __forceinline__ void AddDqColumns(float* __restrict__ dq_acc, const unsigned char* ds_tile,
                                             KeyStep key_step, const float4 (&meta)[kR], const Shape& s,
                                             const KeyWork& w, int r0, float scale, int warp, int lane) {
  const int g = lane >> 2, c = lane & 3, hq = s.hq();
  const uint32_t tile = mma::SmemAddr(ds_tile);
#pragma unroll
  for (int p = 0; p < kR / 16; ++p) {
#pragma unroll
    for (int part = 0; part < D / 64; ++part) {
      float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        // ldmatrix.x4: lanes 8m .. 8m + 7 address matrix m = (rows +8 if m odd, keys +8 if m >= 2).
        const int mtx = lane >> 3, row = 16 * p + (lane & 7) + 8 * (mtx & 1);
        uint32_t a[4];
        mma::LdMatrixX4(a, tile + mma::SwizzledOffset<64>(row, 2 * kk + (mtx >> 1)));
        const uint4 b = key_step(part, kk);
        mma::Mma<kBf16>(acc[0], a[0], a[1], a[2], a[3], b.x, b.z);
        mma::Mma<kBf16>(acc[1], a[0], a[1], a[2], a[3], b.y, b.w);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = 16 * p + g + 8 * h;
        const int t = __float_as_int(meta[row].z);
        if (t < 0) continue;
        const int64_t off = QueryOffset(s, w.b, t, w.g * hq + (r0 + row) % hq) + 64 * part + 32 * (warp >> 1) +
                            8 * c + 4 * (warp & 1);
        atomicAdd(reinterpret_cast<float4*>(dq_acc + off),
                  make_float4(acc[0][2 * h] * scale, acc[0][2 * h + 1] * scale, acc[1][2 * h] * scale,
                              acc[1][2 * h + 1] * scale));
      }
    }
  }
}

// kR: query rows per step; kMinCtas: CTAs per SM the registers are budgeted for.
// Default: kR = 32 with 3 CTAs per SM at D=64, kR = 16 with 1 at D=128 (a tighter budget
// would spill heavily); SelectedKernelChoice::DkDv (kernel_choice.h) forces another D=64 build (A/B).
// kFusedDq: dq_acc receives dQ as well, see above.
template <typename scalar_t, int D, int kR, int kMinCtas, bool kFusedDq>
__global__ void __launch_bounds__(mma::kMmaThreads, kMinCtas)
    SelectedDkDvStagedKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                             const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             float* __restrict__ dk_acc, float* __restrict__ dv_acc,
                             float* __restrict__ dq_acc, Shape s, SelectedKeyPolicy pol, float scale) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  __shared__ int pos[kMaxQueriesPerCta];
  __shared__ alignas(16) scalar_t q_s[2][kR * D];
  __shared__ alignas(16) scalar_t do_s[2][kR * D];
  // Per staged row: lse, delta, position (-1 past the end) as float bits, unused. One
  // 16-byte load gives a C column everything its softmax/mask needs.
  __shared__ float4 meta[2][kR];

  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;  // whole CTA
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int hq = s.hq(), total = w.num_queries * hq;  // flattened (position, head) rows
  for (int i = threadIdx.x; i < w.num_queries; i += mma::kMmaThreads) pos[i] = pol.Query(w, i);
  __syncthreads();

  const auto stage = [&](int r0, int buf) {
    for (int e = threadIdx.x; e < kR * kChunks; e += mma::kMmaThreads) {
      const int r = e / kChunks, ch = e % kChunks, rho = r0 + r;
      const bool ok = rho < total;  // rows past the end are zero-filled
      const int64_t off = ok ? QueryOffset(s, w.b, pos[rho / hq], w.g * hq + rho % hq) + ch * 8 : 0;
      const int dst = r * D + SwizzledChunk(r, ch) * 8;
      mma::CpAsync16(mma::SmemAddr(&q_s[buf][dst]), q + off, ok);
      mma::CpAsync16(mma::SmemAddr(&do_s[buf][dst]), dout + off, ok);
    }
    if (threadIdx.x < kR) {
      const int rho = r0 + threadIdx.x;
      const bool ok = rho < total;
      const int t = ok ? pos[rho / hq] : -1;
      const int64_t row = ok ? (static_cast<int64_t>(w.b) * s.T + t) * s.H + w.g * hq + rho % hq : 0;
      mma::CpAsync4(&meta[buf][threadIdx.x].x, lse + row, ok);
      mma::CpAsync4(&meta[buf][threadIdx.x].y, delta + row, ok);
      meta[buf][threadIdx.x].z = __int_as_float(t);  // read after the step's barrier
    }
    mma::CpAsyncCommit();
  };

  const int key_lo = 16 * warp;
  const bool active = key_lo < w.keys.count;  // warp-uniform; idle warps still stage
  const float scale_log2 = scale * kLog2e;
  int key[2];
  bool key_ok[2];
  mma::RowFrag<D> ka, kb, va, vb;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    key[half] = w.keys.start + key_lo + g + 8 * half;
    key_ok[half] = key_lo + g + 8 * half < w.keys.count;
  }
  // key <= t is the whole mask: padding keys never pass it, nor rows past the end (t = -1).
  const int key_cut[2] = {key_ok[0] ? key[0] : INT_MAX, key_ok[1] ? key[1] : INT_MAX};
  mma::LoadRow<D>(ka, key_ok[0] ? k + KeyOffset(s, w.b, key[0], w.g) : nullptr, lane);
  mma::LoadRow<D>(kb, key_ok[1] ? k + KeyOffset(s, w.b, key[1], w.g) : nullptr, lane);
  mma::LoadRow<D>(va, key_ok[0] ? v + KeyOffset(s, w.b, key[0], w.g) : nullptr, lane);
  mma::LoadRow<D>(vb, key_ok[1] ? v + KeyOffset(s, w.b, key[1], w.g) : nullptr, lane);
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  }
  // Fused dQ: this warp's K columns as B fragments, and the step's dS rows in shared memory.
  static_assert(!kFusedDq || D == 64 || D == 128, "fused dQ: 16 columns per warp of each 64-column part");
  constexpr bool kKeyStepsShared = kFusedDq && D > 64;  // no registers for them at D=128
  __shared__ alignas(128) unsigned char ds_tile[kFusedDq ? kR * 64 * 2 : 16];
  __shared__ uint4 key_steps_s[kKeyStepsShared ? mma::kWarps * (D / 64) * 4 * 32 : 1];
  // The warp's own entry of part `part`, key step kk, for this lane.
  const auto key_step_slot = [&](int part, int kk) { return ((warp * (D / 64) + part) * 4 + kk) * 32 + lane; };
  uint32_t kt[4][2][2];
  if constexpr (kFusedDq) {
#pragma unroll
    for (int part = 0; part < D / 64; ++part) {
      LoadDqKeyFragments(kt, k, s, w, 64 * part, warp, lane);
      if constexpr (kKeyStepsShared) {
        // Each warp reads back only its own lanes' entries: no barrier needed.
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) key_steps_s[key_step_slot(part, kk)] = PackKeyStep(kt, kk);
      }
    }
    // Idle warps (keys past the block's end) never write their dS columns: zeros, ordered
    // before the first step's writes by that step's barrier.
    for (int i = threadIdx.x; i < kR * 64 * 2 / 16; i += mma::kMmaThreads)
      reinterpret_cast<uint4*>(ds_tile)[i] = make_uint4(0, 0, 0, 0);
  }
  const auto key_step = [&](int part, int kk) {
    if constexpr (kKeyStepsShared) {
      return key_steps_s[key_step_slot(part, kk)];
    } else {
      return PackKeyStep(kt, kk);
    }
  };

  stage(0, 0);
  for (int r0 = 0, buf = 0; r0 < total; r0 += kR, buf ^= 1) {
    mma::StageNextAndWait(r0, kR, total, buf, stage);
    __syncthreads();
    if (active) {
      mma::RowFrag<D> qr[kR / 8], dr[kR / 8];
      float st[kR / 8][4], dpt[kR / 8][4];
#pragma unroll
      for (int j = 0; j < kR / 8; ++j) {
        LoadRowShared<D>(qr[j], q_s[buf], 8 * j + g, lane);
        LoadRowShared<D>(dr[j], do_s[buf], 8 * j + g, lane);
        st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
        dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.f;
        mma::QKTile<kBf16, D>(st[j], ka, kb, qr[j]);
        mma::QKTile<kBf16, D>(dpt[j], va, vb, dr[j]);
      }
#pragma unroll
      for (int j = 0; j < kR / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float4 m = meta[buf][8 * j + 2 * c + e];  // this C column's query row
          const int t = __float_as_int(m.z);
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const float p = key_cut[half] <= t ? mma::Exp2(st[j][2 * half + e] * scale_log2 - m.x) : 0.f;
            st[j][2 * half + e] = p;
            dpt[j][2 * half + e] = p * (dpt[j][2 * half + e] - m.y);  // dS^T
          }
        }
      }
      PRTileShared<kBf16, D, kR>(dv, st, do_s[buf], lane);
      PRTileShared<kBf16, D, kR>(dk, dpt, q_s[buf], lane);
      if constexpr (kFusedDq) StoreDsRows<kBf16, kR>(ds_tile, dpt, warp, lane);
    }
    if constexpr (kFusedDq) {
      __syncthreads();  // the step's dS rows are complete (idle warps' keys stay zero)
      AddDqColumns<kBf16, kR, D>(dq_acc, ds_tile, key_step, meta[buf], s, w, r0, scale, warp, lane);
    }
    __syncthreads();
  }
  if (!active) return;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (!key_ok[half]) continue;
    const int64_t off = KeyOffset(s, w.b, key[half], w.g);
    mma::AtomicAddRowColumns<D>(dk_acc + off, dk, half, scale, lane);
    mma::AtomicAddRowColumns<D>(dv_acc + off, dv, half, 1.f, lane);
  }
}

// Whether dQ comes from the dK/dV kernel (SelectedDkDvStagedKernel<..., true>). ChoiceFor
// already rejected a forced fused dQ that cannot run (fp32, unstaged dK/dV).
// Auto: fused for groups of fewer than 16 heads. Measured on H100 (selected backward alone,
// nsa_bench --slc-only), D=64: 12:2 at B16 T2048 2.19 -> 1.70 ms, at 64k 7.15 -> 5.02 ms
// (the per-position dQ kernel pads 6 heads to 16 MMA rows there); 64:4 at 64k 20.4 -> 26.4
// ms (16 heads fill the rows, and the fused kernel's dQ atomics, 3.3 ms of it, cost more).
// D=128 12:2: B16 T2048 3.87 -> 3.58 ms, 64k 13.97 -> 10.25 ms (9.63 in position order).
bool UseFusedDq(const Choice& c, const at::Tensor& q, const Shape& s) {
  if (c.dq == Choice::Dq::kFused) return true;
  if (c.dq == Choice::Dq::kQuerySide) return false;
  return q.scalar_type() != at::kFloat && c.dkdv != Choice::DkDv::kUnstaged && s.hq() < 16;
}

// The dK/dV kernel: a forced choice, else the warpgroup-MMA kernel wherever it runs
// (selected_dkdv_wgmma.cuh; measured on H100, selected backward alone with fused dQ, 12:2,
// against the staged kernel: D=64 B16 T2048 1.55-1.56 -> 1.23-1.31 ms, and one NSA layer at
// 64k forward+backward 15.39 -> 14.51 ms; D=128 B16 T2048 3.48-3.49 -> 2.09-2.12 ms, 64k
// 9.13-9.21 -> 6.83-6.89 ms), else the staged kernel's measured build (D=64: 32 rows per
// step on a 3-CTA-per-SM register budget, 168 registers and 28 bytes of spill, measured 3-17%
// faster than 2 CTAs per SM on H100, and with fused dQ too: 1.70 ms against 1.86 (16x3) and
// 1.89 (32x1) at B16 T2048 12:2; D=128: 16 rows, one CTA's budget). Every build has a fused
// dQ variant (dq_acc given).
template <typename scalar_t, int D>
void LaunchSelectedDkDv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                        const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dk_acc, at::Tensor& dv_acc,
                        at::Tensor* dq_acc, const Shape& s, const SelectedKeyPolicy& kpol, float scale,
                        const Choice& choice, dim3 kgrid) {
  using DkDv = Choice::DkDv;
  using Kernel = void (*)(const scalar_t*, const scalar_t*, const scalar_t*, const scalar_t*, const float*,
                          const float*, float*, float*, float*, Shape, SelectedKeyPolicy, float);
  Kernel kernel = nullptr;
  int threads = mma::kMmaThreads, smem = 0;  // the staged builds' shared memory is static (LaunchKernel
                                             // raises the limit for the wgmma kernel's dynamic one)
  if (choice.dkdv == DkDv::kUnstaged) {
    TORCH_CHECK(dq_acc == nullptr, "fused dQ needs a staged dK/dV kernel");  // ChoiceFor rejects it
    mma::DkDvMmaKernel<scalar_t, D, SelectedKeyPolicy><<<kgrid, mma::kMmaThreads, 0,
                                                         at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
        lse.data_ptr<float>(), delta.data_ptr<float>(), dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s,
        kpol, scale);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  const bool wgmma = choice.dkdv == DkDv::kWgmma || (choice.dkdv == DkDv::kAuto && WgmmaRunsHere());
  if (wgmma) {
    using Cfg = dkdv_wgmma::Cfg<D, kMaxQueriesPerCta>;
    kernel = dq_acc ? dkdv_wgmma::SelectedDkDvWgmmaKernel<scalar_t, D, true, kMaxQueriesPerCta, SelectedKeyPolicy>
                    : dkdv_wgmma::SelectedDkDvWgmmaKernel<scalar_t, D, false, kMaxQueriesPerCta, SelectedKeyPolicy>;
    threads = Cfg::kThreads;
    smem = Cfg::kBytes;
  } else if constexpr (D == 64) {
    const DkDv build = choice.dkdv != DkDv::kAuto ? choice.dkdv : kDefaultDkDv64;
    const auto pick = [&](auto rows, auto ctas) {
      constexpr int kR = decltype(rows)::value, kC = decltype(ctas)::value;
      if (dq_acc) {
        kernel = SelectedDkDvStagedKernel<scalar_t, D, kR, kC, true>;
      } else {
        kernel = SelectedDkDvStagedKernel<scalar_t, D, kR, kC, false>;
      }
    };
    if (build == DkDv::kStaged16x3) pick(std::integral_constant<int, 16>{}, std::integral_constant<int, 3>{});
    if (build == DkDv::kStaged32x1) pick(std::integral_constant<int, 32>{}, std::integral_constant<int, 1>{});
    if (build == DkDv::kStaged32x3) pick(std::integral_constant<int, 32>{}, std::integral_constant<int, 3>{});
  } else if (dq_acc) {
    kernel = SelectedDkDvStagedKernel<scalar_t, D, 16, 1, true>;
  } else {
    kernel = SelectedDkDvStagedKernel<scalar_t, D, 16, 1, false>;
  }
  TORCH_CHECK(kernel != nullptr, "no dK/dV build for this choice");
  LaunchKernel(kernel, kgrid, threads, smem, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
               dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(), dk_acc.data_ptr<float>(),
               dv_acc.data_ptr<float>(), dq_acc ? dq_acc->data_ptr<float>() : nullptr, s, kpol, scale);
}

void CheckSelected(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& block_idx, const Geo& g) {
  CheckInput(q, "q", 4);
  CheckInput(k, "k", 4);
  CheckInput(v, "v", 4);
  CheckInput(block_idx, "block_idx", 4);
  CheckKv(q, k, v);
  TORCH_CHECK(block_idx.scalar_type() == at::kInt, "block_idx must be int32");
  TORCH_CHECK(k.size(1) == q.size(1), "k must have as many positions as q");
  TORCH_CHECK(block_idx.size(0) == q.size(0) && block_idx.size(1) == q.size(1) &&
                  block_idx.size(2) == k.size(2),
              "block_idx must be [B,T,G,n], got ", block_idx.sizes());
  static_assert(kernel_limits::kMaxSelectionBlock == kKeyChunk, "a selection block is one staged key tile");
  TORCH_CHECK(g.slc_block > 0 && g.slc_block <= kernel_limits::kMaxSelectionBlock, "selection block must be in [1, ",
              kernel_limits::kMaxSelectionBlock, "], got ", g.slc_block);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> SelectedForward(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const at::Tensor& block_idx, const Geo& g) {
  CheckSelected(q, k, v, block_idx, g);
  const Shape s = MakeShape(q, k);
  const Choice choice = ChoiceFor(q, s, static_cast<int>(block_idx.size(3)));
  auto out = at::empty_like(q);
  auto lse = at::empty({s.B, s.T, s.H}, q.options().dtype(at::kFloat));
  const int rows = s.hq();
  const SelectedQueryPolicy pol{block_idx.data_ptr<int>(), static_cast<int>(block_idx.size(3)),
                                g.slc_block};
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_slc_fwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if constexpr (!std::is_same_v<scalar_t, float>) {
        const int n = static_cast<int>(block_idx.size(3)), num_blocks = (s.T + g.slc_block - 1) / g.slc_block;
        if (UseTiledForward(choice, s, n, num_blocks)) {
          LaunchSelectedTiledForward<scalar_t, D>(q, k, v, out, lse, s, block_idx, g);
        } else if (UseBlockForward(choice, s, n, num_blocks)) {
          LaunchSelectedBlockForward<scalar_t, D>(q, k, v, out, lse, s, block_idx, g, choice);
        } else {
          LaunchSelectedQueryMma<scalar_t, D, false>(q, k, v, nullptr, nullptr, out, lse, s, block_idx, g,
                                                     choice);
        }
      } else {
        Launch(AttnFwdKernel<scalar_t, D, SelectedQueryPolicy>, dim3(s.T, s.G, s.B),
               FwdSmemFloats(rows, D) * sizeof(float), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
               v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, pol,
               scale_log2, rows);
      }
    });
  });
  return {out, lse};
}

namespace {

// The block map the selected backward walks for these inputs (its work split and order follow
// the kernel choice).
BlockMap SelectedBackwardMap(const at::Tensor& q, const Shape& s, const at::Tensor& block_idx, const Geo& g) {
  const int n = static_cast<int>(block_idx.size(3));
  const Choice choice = ChoiceFor(q, s, n);
  const int NS = (s.T + g.slc_block - 1) / g.slc_block;
  return InvertBlockMap(block_idx, NS, QueriesPerCta(choice),
                        PositionOrder(choice, s, n, NS, UseFusedDq(choice, q, s)));
}

}  // namespace

struct PendingBlockMap {
  BlockMap map;
  at::cuda::CUDAEvent built;  // recorded on the side stream after the map's last kernel
  const void* block_idx = nullptr;  // the entries it inverted, checked by SelectedBackward
};
void PendingBlockMapDeleter::operator()(PendingBlockMap* p) const { delete p; }

PendingBlockMapPtr StartSelectedBackwardMap(const at::Tensor& q, const at::Tensor& k, const at::Tensor& block_idx,
                                            const Geo& g) {
  CheckSelected(q, k, k, block_idx, g);
  PendingBlockMapPtr pending(new PendingBlockMap);
  pending->block_idx = block_idx.data_ptr();
  const auto current = at::cuda::getCurrentCUDAStream();
  // High priority: its CTAs go ahead of the caller's wide kernels as SMs free up, so the map's
  // serial chain of small kernels is not left waiting behind them.
  const auto side = at::cuda::getStreamFromPool(/*isHighPriority=*/true, q.device().index());
  at::cuda::CUDAEvent forked;
  forked.record(current);
  forked.block(side);
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    pending->map = SelectedBackwardMap(q, MakeShape(q, k), block_idx, g);
    pending->built.record(side);
  }
  return pending;
}

namespace {

// The map a backward takes: one started ahead (joined here), or one built now.
BlockMap TakeBlockMap(PendingBlockMap* ahead, const at::Tensor& q, const Shape& s, const at::Tensor& block_idx,
                      const Geo& g) {
  if (!ahead) return SelectedBackwardMap(q, s, block_idx, g);
  TORCH_CHECK(ahead->block_idx == block_idx.data_ptr(), "SelectedBackward: the block map started ahead belongs to "
              "other block indices");
  const auto current = at::cuda::getCurrentCUDAStream();
  ahead->built.block(current);
  // Its tensors were allocated on the side stream: until this stream's kernels are done with
  // them, the allocator must not hand their memory to the side stream again.
  for (const at::Tensor* t : {&ahead->map.sorted_entry, &ahead->map.seg_off, &ahead->map.chunk_off,
                              &ahead->map.item_seg, &ahead->map.item_order}) {
    if (t->defined()) c10::cuda::CUDACachingAllocator::recordStream(t->storage().data_ptr(), current);
  }
  return ahead->map;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> SelectedBackward(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& block_idx, const Geo& g,
    at::Tensor* dq_sum, const at::Tensor& given_delta, PendingBlockMap* ahead, bool round_dkdv) {
  CheckSelected(q, k, v, block_idx, g);
  if (dq_sum) CheckDqSum(*dq_sum, q);
  const auto dout = dout_in.contiguous();
  const Shape s = MakeShape(q, k);
  const int n = static_cast<int>(block_idx.size(3));
  const Choice choice = ChoiceFor(q, s, n);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.D));
  const auto delta = DeltaOrRowDot(given_delta, dout, out);
  const bool fused_dq = UseFusedDq(choice, q, s);
  // Fused: float32 sums of every block's dQ rows, rounded to q's type at the end (by the
  // caller, with dq_sum).
  auto dq_acc = fused_dq ? (dq_sum ? *dq_sum : ZeroFloats(q.sizes(), q.options())) : at::Tensor();
  auto dq = fused_dq ? at::Tensor() : at::empty_like(q);
  auto dk_acc = ZeroFloats(k.sizes(), k.options());
  auto dv_acc = ZeroFloats(v.sizes(), v.options());

  const BlockMap map = TakeBlockMap(ahead, q, s, block_idx, g);
  const SelectedKeyPolicy kpol = KeyPolicy(map, s, n, g.slc_block);
  const int64_t S = map.segments, max_items = map.max_items;
  const SelectedQueryPolicy qpol{block_idx.data_ptr<int>(), n, g.slc_block};
  const int rows = s.hq();
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_slc_bwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if constexpr (!std::is_same_v<scalar_t, float>) {
        if (!fused_dq) {
          LaunchSelectedQueryMma<scalar_t, D, true>(q, k, v, &dout, &delta, dq, lse, s, block_idx, g,
                                                    choice);
        }
      } else {
        Launch(AttnDqKernel<scalar_t, D, SelectedQueryPolicy>, dim3(s.T, s.G, s.B),
               DqSmemFloats(rows, D) * sizeof(float), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
               v.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), lse.data_ptr<float>(),
               delta.data_ptr<float>(), dq.data_ptr<scalar_t>(), s, qpol, scale, rows);
      }
      if (S > 0) {
        const dim3 kgrid(static_cast<unsigned>(max_items));
        if constexpr (!std::is_same_v<scalar_t, float>) {
          LaunchSelectedDkDv<scalar_t, D>(q, k, v, dout, lse, delta, dk_acc, dv_acc,
                                          fused_dq ? &dq_acc : nullptr, s, kpol, scale, choice, kgrid);
        } else {
          Launch(AttnDkDvKernel<scalar_t, D, SelectedKeyPolicy>, kgrid, DkDvSmemFloats(D) * sizeof(float),
                 q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                 dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
                 dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s, kpol, scale);
        }
      }
    });
  });
  if (dq_sum) {
    if (!fused_dq) dq_sum->add_(dq);
    dq = at::Tensor();
  } else if (fused_dq) {
    dq = dq_acc.to(q.scalar_type());
  }
  if (!round_dkdv) return {dq, dk_acc, dv_acc};
  return {dq, dk_acc.to(k.scalar_type()), dv_acc.to(v.scalar_type())};
}

}  // namespace nsad::nsa::cuda::detail
