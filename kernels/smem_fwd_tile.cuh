// FlashAttention-2-style forward steps over key/value tiles staged in shared memory, shared
// by the compressed branch's forward (CmpSmemKernel) and the tiled forward below
// (TiledFwdKernel: selected blocks, sliding window). A warp owns kM m16 tiles of query rows (A fragments of Q in
// registers, standard m16n8k16 layout); each tile of kN keys sits in shared memory as
// swizzled D-element rows (mma::StageTileAsync) and is read with ldmatrix:
//   Scores:    S = Q K^T (ldmatrix of K rows: B fragments of two k16 steps per load)
//   SoftmaxPV: online softmax of S under a per-element mask (mma::OnlineSoftmaxLazyRescale),
//              then O += P V (ldmatrix.trans of V rows), P rounded to the input type as
//              FlashAttention does
//   Finish:    O / l and the row's log2-sum-exp (+inf, with a zero row, when it saw nothing);
//              FinishStaged does the same through shared memory, whole rows a store
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "kernel_choice.h"
#include "launch_util.cuh"
#include "mma_tile.cuh"
#include "wgmma.cuh"

namespace nsad::nsa::cuda::detail::smem_fwd {

// Online-softmax state of a lane: kM m16 tiles, rows g and g + 8 of each.
template <int D, int kM>
struct State {
  float o[kM][D / 8][4];
  float m[kM][2], l[kM][2];  // running max (log2 units) and the lane's partial row sum
  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int t = 0; t < kM; ++t) {
#pragma unroll
      for (int i = 0; i < D / 8; ++i) o[t][i][0] = o[t][i][1] = o[t][i][2] = o[t][i][3] = 0.f;
      m[t][0] = m[t][1] = -INFINITY;
      l[t][0] = l[t][1] = 0.f;
    }
  }
};

// The lane's query rows in a CTA of flattened (position, head) rows of one (b, grp): m16 tile
// m, half h is CTA row r = 16 (kM warp + m) + g + 8h, i.e. position t0 + r / hq, head
// grp * hq + r % hq. Rows from `rows` on are invalid (they point at position t0, head grp * hq).
// kLaneHeads > 1 (it divides hq): all kLaneHeads rows of a lane are heads of one position
// instead, so the lane can add their values before anything per position. 2: a tile's rows g
// and g + 8 (slot u = 8 (kM warp + m) + g, half h its head 2 (u % (hq / 2)) + h); 2 kM: the
// lane's rows of all its tiles (slot u = 8 warp + g, tile m half h its head 2m + h of the
// slot's). Slot u is heads kLaneHeads (u % s) .. of position u / s, s = hq / kLaneHeads. The
// same rows, in another order.
template <int kM, int kLaneHeads = 1>
struct LaneRows {
  static_assert(kLaneHeads == 1 || kLaneHeads == 2 || kLaneHeads == 2 * kM, "a tile's two rows, or all a lane's");
  int64_t index[kM][2];  // into [B,T,H]
  bool valid[kM][2];
  int pos[kM][2];  // the position relative to t0 (0 when invalid)
  __device__ LaneRows(const Shape& s, int b, int grp, int t0, int rows, int warp, int lane) {
    const int hq = s.hq();
#pragma unroll
    for (int m = 0; m < kM; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int r_pos, r_head;
        if constexpr (kLaneHeads > 1) {
          constexpr int kTilesPerSlot = kLaneHeads / 2;
          const int u = 8 * ((kM * warp + m) / kTilesPerSlot) + (lane >> 2), slots = hq / kLaneHeads;
          valid[m][h] = kLaneHeads * u < rows;
          r_pos = u / slots;
          r_head = kLaneHeads * (u - r_pos * slots) + 2 * (m % kTilesPerSlot) + h;
        } else {
          const int r = 16 * (kM * warp + m) + (lane >> 2) + 8 * h;
          valid[m][h] = r < rows;
          r_pos = r / hq;
          r_head = r - r_pos * hq;
        }
        pos[m][h] = valid[m][h] ? r_pos : 0;
        index[m][h] = (static_cast<int64_t>(b) * s.T + t0 + pos[m][h]) * s.H + grp * hq + (valid[m][h] ? r_head : 0);
      }
    }
  }
};

// A fragments (standard m16n8k16 layout) of the lane's rows of a [rows, D] tensor such as Q
// or dO (row_index[t][h]; invalid rows get zeros).
template <int D, int kM, typename scalar_t>
__device__ __forceinline__ void LoadRowFragments(uint32_t (&qf)[kM][D / 16][4], const scalar_t* q,
                                      const int64_t (&row_index)[kM][2], const bool (&row_valid)[kM][2], int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int t = 0; t < kM; ++t) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint32_t* qr = reinterpret_cast<const uint32_t*>(q + row_index[t][h] * D);
        qf[t][ks][h] = row_valid[t][h] ? __ldg(qr + 8 * ks + c) : 0u;
        qf[t][ks][2 + h] = row_valid[t][h] ? __ldg(qr + 8 * ks + 4 + c) : 0u;
      }
    }
  }
}

// sc[t] = Q K^T for keys 8n..8n+7 of the tile staged at kbuf (fresh accumulators): one
// ldmatrix.x4 gives them for two k16 steps.
template <bool kBf16, int D, int kM>
__device__ __forceinline__ void ScoresN8(float (&sc)[kM][4], const uint32_t (&qf)[kM][D / 16][4], uint32_t kbuf,
                                         int n, int lane) {
#pragma unroll
  for (int t = 0; t < kM; ++t) sc[t][0] = sc[t][1] = sc[t][2] = sc[t][3] = 0.f;
#pragma unroll
  for (int p = 0; p < D / 32; ++p) {
    uint32_t kb[4];
    mma::LdMatrixX4(kb, kbuf + mma::SwizzledOffset<D>(8 * n + (lane & 7), 4 * p + (lane >> 3)));
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      const uint32_t(&a0)[4] = qf[t][2 * p];
      const uint32_t(&a1)[4] = qf[t][2 * p + 1];
      mma::Mma<kBf16>(sc[t], a0[0], a0[1], a0[2], a0[3], kb[0], kb[1]);
      mma::Mma<kBf16>(sc[t], a1[0], a1[1], a1[2], a1[3], kb[2], kb[3]);
    }
  }
}

// sc = Q K^T for the kN keys staged at kbuf (fresh accumulators).
template <bool kBf16, int D, int kM, int kN>
__device__ __forceinline__ void Scores(float (&sc)[kM][kN / 8][4], const uint32_t (&qf)[kM][D / 16][4],
                                       uint32_t kbuf, int lane) {
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
    float acc[kM][4];
    ScoresN8<kBf16, D, kM>(acc, qf, kbuf, n, lane);
#pragma unroll
    for (int t = 0; t < kM; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[t][n][e] = acc[t][e];
  }
}

// Online softmax of sc (allowed(t, h, key): may row g + 8h of m-tile t attend tile-relative
// key `key`; not allowed scores become -inf) and O += P V with V staged at vbuf. kFresh: st is
// as Init left it (the rows' first step; mma::OnlineSoftmaxLazyRescale).
template <bool kBf16, int D, int kM, int kN, bool kFresh = false, typename Allowed>
__device__ __forceinline__ void SoftmaxPV(State<D, kM>& st, float (&sc)[kM][kN / 8][4], uint32_t vbuf,
                                          float scale_log2, Allowed allowed, int lane) {
#pragma unroll
  for (int t = 0; t < kM; ++t) {
    mma::OnlineSoftmaxLazyRescale<D, kN, kFresh>(sc[t], st.o[t], st.m[t], st.l[t], scale_log2,
                                                 [&](int h, int key) { return allowed(t, h, key); }, lane);
  }
  // P's C fragments of key tiles 2kk, 2kk+1 are the A fragment of k16 step kk;
  // ldmatrix.trans gives V's B fragments (keys 16kk.., head-dim tiles 2p, 2p+1).
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int t = 0; t < kM; ++t) mma::PackA<kBf16>(a[t], sc[t][2 * kk], sc[t][2 * kk + 1]);
#pragma unroll
    for (int p = 0; p < D / 16; ++p) {
      uint32_t vb[4];
      mma::LdMatrixX4Trans(vb, vbuf + mma::SwizzledOffset<D>(16 * kk + (lane & 7) + (lane & 8), 2 * p + (lane >> 4)));
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        mma::Mma<kBf16>(st.o[t][2 * p], a[t][0], a[t][1], a[t][2], a[t][3], vb[0], vb[1]);
        mma::Mma<kBf16>(st.o[t][2 * p + 1], a[t][0], a[t][1], a[t][2], a[t][3], vb[2], vb[3]);
      }
    }
  }
}

// Writes the lane's valid rows of out ([rows, D]) and their log2-sum-exp.
template <bool kBf16, int D, int kM, typename scalar_t>
__device__ __forceinline__ void Finish(const State<D, kM>& st, scalar_t* out, float* lse,
                                       const int64_t (&row_index)[kM][2], const bool (&row_valid)[kM][2], int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int t = 0; t < kM; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const mma::RowFinish row = mma::FinishRow(st.m[t][h], mma::QuadSum(st.l[t][h]));
      if (!row_valid[t][h]) continue;
      const float inv = row.inv;
      uint32_t* orow = reinterpret_cast<uint32_t*>(out + row_index[t][h] * D);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) orow[4 * i + c] = mma::Pack<kBf16>(st.o[t][i][2 * h] * inv, st.o[t][i][2 * h + 1] * inv);
      if (c == 0) lse[row_index[t][h]] = row.lse;
    }
  }
}

// Finish for one m16 tile a warp, through shared memory: the C fragments of the warp's 16 rows
// go to rows warp_row0 .. + 15 of `tile` (a [rows][D] tile in SwizzledOffset's layout that no
// other warp touches meanwhile), then 16-byte stores of whole rows, D / 8 lanes a row.
// Finish stores 4 bytes a lane straight from the fragments, so each store instruction touches
// 8 rows. The selected block kernel (selected_block_forward.cuh) on this path, ncu, H200, 64k
// 12:2 (forty-first session): 1.27 -> 1.23 ms at D = 64 and 2.46 -> 2.30 ms at D = 128, `slc`
// D128 3.84-3.92 -> 3.68-3.74 ms. (A third Q buffer at D = 64, 68 KB a CTA, measured alongside:
// 1.29 ms alone, 1.22 with these stores; not kept.)
// kHalvesAtOnce 1 (the local-blocks kernel, whose K/V tiles leave room for 8 rows a warp):
// 8 rows of `tile` a pass, the warp's two halves one after the other.
template <bool kBf16, int D, int kHalvesAtOnce = 2, typename scalar_t>
__device__ __forceinline__ void FinishStaged(const State<D, 1>& st, uint32_t tile, int warp_row0, scalar_t* out,
                                             float* lse, const int64_t (&row_index)[1][2],
                                             const bool (&row_valid)[1][2], int lane) {
  static_assert(kHalvesAtOnce == 1 || kHalvesAtOnce == 2, "8 or 16 rows a pass");
  constexpr int kChunks = D / 8, kRowsPerPass = 32 / kChunks;  // 4 rows a pass at D = 64, 2 at 128
  static_assert(8 % kRowsPerPass == 0, "a pass's rows lie in one half");
  const int c = lane & 3;
#pragma unroll
  for (int h0 = 0; h0 < 2; h0 += kHalvesAtOnce) {
    __syncwarp();  // every lane is done with whatever the warp's rows of the tile held
#pragma unroll
    for (int hh = 0; hh < kHalvesAtOnce; ++hh) {
      const int h = h0 + hh;
      const mma::RowFinish row = mma::FinishRow(st.m[0][h], mma::QuadSum(st.l[0][h]));
      const float inv = row.inv;
      const int r = warp_row0 + (lane >> 2) + 8 * hh;  // the C fragments' row: columns 8 i + 2 c, + 1
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const uint32_t packed = mma::Pack<kBf16>(st.o[0][i][2 * h] * inv, st.o[0][i][2 * h + 1] * inv);
        asm volatile("st.shared.b32 [%0], %1;" ::"r"(tile + mma::SwizzledOffset<D>(r, i) + 4 * c), "r"(packed));
      }
      if (c == 0 && row_valid[0][h]) lse[row_index[0][h]] = row.lse;
    }
    __syncwarp();  // the rows are in shared memory
#pragma unroll
    for (int j = 0; j < 8 * kHalvesAtOnce / kRowsPerPass; ++j) {
      const int rr = kRowsPerPass * j + lane / kChunks, ch = lane % kChunks;  // row of this pass's
      // The pass's rows lie in one half (kRowsPerPass divides 8), known when unrolled; row rr's
      // index and validity sit with lane 4 (rr & 7) of that half.
      const int h = h0 + kRowsPerPass * j / 8, holder = 4 * (rr & 7);
      const long long idx = __shfl_sync(0xffffffffu, static_cast<long long>(row_index[0][h]), holder);
      const int ok = __shfl_sync(0xffffffffu, static_cast<int>(row_valid[0][h]), holder);
      uint4 val;
      asm volatile("ld.shared.v4.b32 {%0,%1,%2,%3}, [%4];"
                   : "=r"(val.x), "=r"(val.y), "=r"(val.z), "=r"(val.w)
                   : "r"(tile + mma::SwizzledOffset<D>(warp_row0 + rr, ch)));
      if (ok) *reinterpret_cast<uint4*>(out + idx * D + ch * 8) = val;
    }
  }
}

// ---------------------------------------------------------------------------------------
// The tiled forward: a CTA owns the (position, head) rows of up to 32 consecutive positions
// of one (b, g), kRows = 128 rows (21 positions at 6 heads per group), and walks the key
// blocks a Walk policy hands out. Each block (<= 64 keys) is copied once per CTA with
// cp.async (double buffered: the next block's copy overlaps this block's products) and read
// by every warp with ldmatrix. The Walk says which rows see which keys:
//   static int SmemBytes(...)        its shared memory after the two K/V stages
//   Prepare(smem, s, b, g, t0, positions)   once per CTA, every thread (may use barriers)
//   First() / Next(blk)               CTA-uniform block sequence, -1 at the end
//   Start(blk) / Count(s, blk)        the block's keys [Start, Start + Count), Count <= 64
//   EveryRowSeesAll(blk, key0, count) CTA-uniform: no per-row test needed
//   RowKeys(blk, pos, t, key0, count, lo, hi)  the block-relative keys [lo, hi] the row of
//                                     position t (t0 + pos) attends, one range per row
//                                     (empty when lo > hi): worked out once per row and
//                                     block instead of a test per score
//   kWholeBlockRows                   static: whether the two below exist (the warpgroup-MMA
//                                     kernel's per-row mask)
//   RowsSeeWholeBlock(key0, count)    CTA-uniform: each row sees all of a full block or none
//   RowSees(blk, pos)                 then, whether the row of position t0 + pos sees it
// The block-relative keys [lo, hi] (empty when lo > hi) each of the lane's rows attends in
// block blk: the whole block when every row sees all of it, else the walk's RowKeys. Worked
// out once per row and block, so the softmax's mask is two compares per score.
template <int kM, typename Walk>
__device__ __forceinline__ void RowKeyRanges(const Walk& walk, const LaneRows<kM>& lr, int t0, int blk, int key0,
                                             int count, bool every_row, int (&lo)[kM][2], int (&hi)[kM][2]) {
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      walk.RowKeys(blk, lr.pos[m][h], t0 + lr.pos[m][h], key0, count, lo[m][h], hi[m][h]);
      if (every_row) lo[m][h] = 0, hi[m][h] = count - 1;
    }
  }
}

template <int D>
struct TiledCfg {
  static constexpr int kM = D == 64 ? 2 : 1;  // m16 tiles per warp (register budget)
  static constexpr int kWarps = 8 / kM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kM * kWarps;  // 128
  static constexpr int kN = 64;                   // keys per tile
  static constexpr int kTileBytes = kN * D * 2;
  static constexpr int kStageBytes = 2 * kTileBytes;  // K and V
};

// Positions per CTA of a tiled kernel with `rows` (position, head) rows: all heads of a
// position in one CTA, at most 32 positions (one bit each in the walks' masks).
inline int TiledPositionsPerCta(int rows, int hq) { return std::min(32, rows / hq); }

// Copies block blk's K and V tiles into stage buf at smem_base (cp.async; the caller commits).
// kTensorCores: tiles for warpgroup MMAs, D / 64 [kN][64] halves in the 128-byte swizzle
// (kWgmmaHalfBytes apart); else one [kN][D] tile for ldmatrix.
template <int D, int kN, int kCtaThreads, int kStageBytes, bool kTensorCores, typename scalar_t, typename Walk>
struct BlockStager {
  static constexpr int kCols = kTensorCores ? 64 : D;  // columns of one staged piece
  const Shape& s;
  const Walk& walk;
  const uint32_t smem_base;
  const int kv_stride;
  const mma::TileCopyPlan<kCols, kN, kCtaThreads> plan;
  const scalar_t* const k_bg;
  const scalar_t* const v_bg;

  __device__ __forceinline__ BlockStager(uint32_t smem_base_, const scalar_t* k, const scalar_t* v, const Shape& s_,
                                         const Walk& walk_, int b, int grp)
      : s(s_), walk(walk_), smem_base(smem_base_), kv_stride(s_.G * D), plan(kv_stride),
        k_bg(k + KeyOffset(s_, b, 0, grp)), v_bg(v + KeyOffset(s_, b, 0, grp)) {}
  __device__ __forceinline__ void operator()(int blk, int buf) const {
    const int64_t first_row = static_cast<int64_t>(walk.Start(blk)) * kv_stride;
    const int count = walk.Count(s, blk);
    const uint32_t dst = smem_base + buf * kStageBytes;
#pragma unroll
    for (int piece = 0; piece < D / kCols; ++piece) {
      const uint32_t piece_dst = dst + piece * kN * kCols * 2;
      plan.Issue(piece_dst, k_bg + first_row + piece * kCols, count);
      plan.Issue(piece_dst + kN * D * 2, v_bg + first_row + piece * kCols, count);
    }
  }
};

// The block walk both tiled kernels share: each of the walk's blocks is staged into one of two
// stages at smem_base (K tile, then V tile; the next block's copy issued once this one has
// landed, so it overlaps this block's products), then body(blk, stage address) runs on it.
// kTensorCores: the stages are read by warpgroup MMAs, so each thread fences its copies for
// them before the barrier.
template <int D, int kN, int kCtaThreads, int kStageBytes, bool kTensorCores, typename scalar_t, typename Walk,
          typename Body>
__device__ __forceinline__ void WalkStagedBlocks(uint32_t smem_base, const scalar_t* k, const scalar_t* v,
                                                 const Shape& s, const Walk& walk, int b, int grp, Body&& body) {
  const BlockStager<D, kN, kCtaThreads, kStageBytes, kTensorCores, scalar_t, Walk> stage(smem_base, k, v, s, walk,
                                                                                        b, grp);
  int blk = walk.First();
  if (blk >= 0) stage(blk, 0);
  mma::CpAsyncCommit();
  for (int it = 0; blk >= 0; ++it) {
    const int nxt = walk.Next(blk + 1);
    mma::CpAsyncWaitAll();
    if constexpr (kTensorCores) wgmma::FenceProxyAsync();  // visible to the tensor cores after the barrier
    __syncthreads();  // this block landed for everyone; everyone (every MMA) is done with the other stage
    if (nxt >= 0) stage(nxt, (it + 1) & 1);
    mma::CpAsyncCommit();
    body(blk, smem_base + (it & 1) * kStageBytes);
    blk = nxt;
  }
}

// The same walk for a warpgroup kernel that waits for a block's O += P V only after the next
// block's S = Q K^T went out (TiledFwdWgmmaKernel's kOverlap). Three stages, block i in stage
// i % 3: while block i's scores run, block i - 1's P V may still read its stage, so block
// i + 2's copy goes out only after scores(blk, stage) has waited for both and a barrier has
// seen every warp do so; then rest(blk, stage) runs the softmax and issues P V.
template <int D, int kN, int kCtaThreads, int kStageBytes, typename scalar_t, typename Walk, typename Scores,
          typename Rest>
__device__ __forceinline__ void WalkStagedBlocksOverlapped(uint32_t smem_base, const scalar_t* k, const scalar_t* v,
                                                           const Shape& s, const Walk& walk, int b, int grp,
                                                           Scores&& scores, Rest&& rest) {
  const BlockStager<D, kN, kCtaThreads, kStageBytes, true, scalar_t, Walk> stage(smem_base, k, v, s, walk, b, grp);
  int blk = walk.First();
  int nxt = blk >= 0 ? walk.Next(blk + 1) : -1;
  if (blk >= 0) stage(blk, 0);
  mma::CpAsyncCommit();
  if (nxt >= 0) stage(nxt, 1);
  mma::CpAsyncCommit();
  for (int cur = 0; blk >= 0; cur = cur == 2 ? 0 : cur + 1) {
    const int after = nxt >= 0 ? walk.Next(nxt + 1) : -1;
    mma::CpAsyncWait<1>();  // this block's group landed; the next block's may be in flight
    wgmma::FenceProxyAsync();
    __syncthreads();
    const uint32_t buf = smem_base + cur * kStageBytes;
    scores(blk, buf);
    __syncthreads();  // every warp's previous P V is done: its stage takes block `after`
    if (after >= 0) stage(after, cur == 0 ? 2 : cur - 1);
    mma::CpAsyncCommit();
    rest(blk, buf);
    blk = nxt;
    nxt = after;
  }
}

template <typename scalar_t, int D, typename Walk>
__global__ void __launch_bounds__(TiledCfg<D>::kThreads)
    TiledFwdKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                   scalar_t* __restrict__ out, float* __restrict__ lse, Shape s, Walk walk, int positions_per_cta,
                   float scale_log2) {
  using Cfg = TiledCfg<D>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 tiled_smem[];  // [2 stages][K tile, V tile], then the walk's data
  const uint32_t smem_base = mma::SmemAddr(tiled_smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hq = s.hq();
  const int t0 = static_cast<int>(blockIdx.x) * positions_per_cta;
  const int grp = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int positions = min(positions_per_cta, s.T - t0), rows = positions * hq;
  const bool active = 16 * kM * warp < rows;  // idle warps still copy and meet the barriers
  // Invalid rows have Q = 0 and are never stored, so what they attend does not matter. Q's
  // loads go out before the walk's set-up, whose barriers they then overlap.
  const LaneRows<kM> lr(s, b, grp, t0, rows, warp, lane);
  uint32_t qf[kM][D / 16][4];
  LoadRowFragments<D, kM>(qf, q, lr.index, lr.valid, lane);
  walk.Prepare(reinterpret_cast<unsigned char*>(tiled_smem) + 2 * Cfg::kStageBytes, s, b, grp, t0, positions);
  State<D, kM> st;
  st.Init();

  const auto block = [&](int blk, uint32_t buf) {
    if (active) {
      const int key0 = walk.Start(blk), count = walk.Count(s, blk);
      const bool every_row = walk.EveryRowSeesAll(blk, key0, count);  // CTA-uniform
      float sc[kM][kN / 8][4];
      Scores<kBf16, D, kM, kN>(sc, qf, buf, lane);
      if (every_row && count == kN) {  // CTA-uniform: no test per score
        SoftmaxPV<kBf16, D, kM, kN>(st, sc, buf + Cfg::kTileBytes, scale_log2, [](int, int, int) { return true; },
                                    lane);
      } else {
        int lo[kM][2], hi[kM][2];
        RowKeyRanges<kM>(walk, lr, t0, blk, key0, count, every_row, lo, hi);
        SoftmaxPV<kBf16, D, kM, kN>(
            st, sc, buf + Cfg::kTileBytes, scale_log2,
            [&](int m, int h, int key) { return key >= lo[m][h] && key <= hi[m][h]; }, lane);
      }
    }
  };
  WalkStagedBlocks<D, kN, Cfg::kThreads, Cfg::kStageBytes, false>(smem_base, k, v, s, walk, b, grp, block);
  Finish<kBf16, D, kM>(st, out, lse, lr.index, lr.valid, lane);
}

// ---------------------------------------------------------------------------------------
// The same tiled forward on warpgroup MMAs (sm_90a, bf16/fp16, D = 64 or 128): kWarpgroups of
// 64 rows each, so a CTA owns kRows = 64 or 128 rows (one warpgroup is the default: four
// independent CTAs per SM overlap each other's phases better than two whose warpgroups meet
// at every block's barrier; at D = 128 one warpgroup only, two CTAs an SM). Row r of the CTA
// is warp r / 16's row (LaneRows<1> with the CTA's warp index): warpgroup r / 64, its m16
// tile (r % 64) / 16. Per block, each warpgroup
//   S = Q K^T    D / 16 m64n64k16 steps, Q's A fragments in registers, K read by the tensor
//                cores from the staged tile (K-major, D / 64 halves);
//   softmax      the online softmax on S's fragments (same layout as mma.sync's) with the
//                lazy rescale (mma::OnlineSoftmaxLazyRescale); its mask per score, per row
//                (the walk's kWholeBlockRows blocks), or none (blocks every row sees whole);
//   O += P V     four steps per 64 columns of O, P packed from S in registers, V read from
//                the staged tile MN-major (the instruction transposes it).
// The copies stay cp.async (double buffered, as above), fenced for the tensor cores' reads.
// The four warps of a warpgroup issue each MMA together, so a warpgroup with no valid row
// skips the products as a whole; one with some valid rows computes the invalid ones on Q = 0.
// Whether the tiled forward of q runs TiledFwdWgmmaKernel, and with CTAs of how many
// warpgroups (TiledForwardChoice, kernel_choice.h): 0 for mma.sync; by default one wherever
// the kernel can run (bf16/fp16, head_dim 64 or 128 (one warpgroup only), an sm_90 device,
// kernels built for sm_90a). A forced choice that cannot run fails the call.
int TiledWgmmaWarpgroups(const at::Tensor& q);
// Whether TiledFwdWgmmaKernel can run for q at all (the rule above, whatever is forced).
bool TiledWgmmaRuns(const at::Tensor& q);
// Whether that one-warpgroup kernel overlaps a block's P V with the next block's Q K^T:
// forced (TiledForwardChoice::Mma::kWgmmaOverlap), or by default where the walk says it pays
// (walk_default: the Walk's kOverlapByDefault).
bool TiledWgmmaOverlap(bool walk_default);

template <int kWarpgroups_, int D_ = 64>
struct TiledWgmmaCfg {
  static_assert(D_ == 64 || (D_ == 128 && kWarpgroups_ == 1), "head_dim 64, or 128 with one warpgroup");
  static constexpr int kD = D_;
  static constexpr int kWarpgroups = kWarpgroups_;
  static constexpr int kThreads = kWarpgroups * wgmma::kWarpgroupThreads;
  static constexpr int kRows = 64 * kWarpgroups;
  // D = 64: 128 registers a thread. D = 128 holds twice Q's fragments and O's accumulators
  // (ptxas: 206-224 registers) and 32 KB stages: two CTAs.
  static constexpr int kCtasPerSm = D_ == 64 ? 4 / kWarpgroups : 2;
  static constexpr int kN = 64;
  static constexpr int kTileBytes = kN * kD * 2;     // 8 or 16 KB: a multiple of the swizzle's 1 KB
  static constexpr int kStageBytes = 2 * kTileBytes;  // K and V
  // Dynamic shared memory is only 16-byte aligned; the tiles start at the next 1 KB.
  static constexpr int kAlignSlack = static_cast<int>(wgmma::kSwizzleBytes);
};

// A warpgroup's two products for one staged 64-key tile (TiledFwdWgmmaKernel, and the selected
// forward's local-blocks kernel), each issued and waited for in place. A tile of 64 rows is
// staged as D / 64 [64][64] halves in the 128-byte swizzle, kWgmmaHalfBytes apart (one at D =
// 64; at D = 128 a row's two 64-column halves, as selected_dkdv_wgmma.cuh stages them).
constexpr uint32_t kWgmmaHalfBytes = 64 * 64 * 2;
// S = Q K^T: Q's A fragments in registers (the warp's 16 rows), K read K-major from the tile
// `off` bytes past k_rows's (k16 step 0); its first step overwrites, so sc needs no zeroing.
// WgmmaIssueScores only issues and commits the product; the caller waits.
template <bool kBf16, int D>
__device__ __forceinline__ void WgmmaIssueScores(float (&sc)[8][4], const uint32_t (&qf)[D / 16][4], uint64_t k_rows,
                                                 uint32_t off) {
  // k16 step kk: half kk / 4, 16 columns further along its rows per step.
  const auto step = [&](int kk) { return off + (kk / 4) * kWgmmaHalfBytes + wgmma::kKMajorStepBytes * (kk % 4); };
  wgmma::Fence();
  wgmma::MmaM64N64K16<kBf16, false, true>(sc, qf[0], wgmma::Advance(k_rows, off));
#pragma unroll
  for (int kk = 1; kk < D / 16; ++kk) {
    wgmma::MmaM64N64K16<kBf16, false>(sc, qf[kk], wgmma::Advance(k_rows, step(kk)));
  }
  wgmma::Commit();
}
template <bool kBf16, int D>
__device__ __forceinline__ void WgmmaScores(float (&sc)[8][4], const uint32_t (&qf)[D / 16][4], uint64_t k_rows,
                                            uint32_t off) {
  WgmmaIssueScores<kBf16, D>(sc, qf, k_rows, off);
  wgmma::Wait<0>();
  wgmma::FenceRegisters(sc);
}
// O += P V: P packed from the softmax's probabilities in sc into A fragments (k16 step kk =
// keys 16 kk ..), V read MN-major (the instruction transposes it) from the tile `off` bytes
// past v_cols's; O's columns 64 h .. 64 h + 63 (accumulators o[8 h ..]) from V's half h.
// WgmmaIssuePV only issues and commits it (P's fragments must then stay as they are until the
// caller's wait: ptxas keeps them live).
template <bool kBf16, int kN, int D>
__device__ __forceinline__ void WgmmaIssuePV(float (&o)[D / 8][4], const float (&sc)[kN / 8][4], uint64_t v_cols,
                                             uint32_t off) {
  uint32_t pf[kN / 16][4];
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) mma::PackA<kBf16>(pf[kk], sc[2 * kk], sc[2 * kk + 1]);
  wgmma::FenceRegisters(o);
  wgmma::Fence();
#pragma unroll
  for (int h = 0; h < D / 64; ++h) {
    float(&oh)[8][4] = *reinterpret_cast<float(*)[8][4]>(&o[8 * h]);
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      const uint32_t step = off + h * kWgmmaHalfBytes + wgmma::kMnMajorStepBytes * kk;
      wgmma::MmaM64N64K16<kBf16, true>(oh, pf[kk], wgmma::Advance(v_cols, step));
    }
  }
  wgmma::Commit();
}
template <bool kBf16, int kN, int D>
__device__ __forceinline__ void WgmmaAccumulatePV(float (&o)[D / 8][4], const float (&sc)[kN / 8][4],
                                                  uint64_t v_cols, uint32_t off) {
  WgmmaIssuePV<kBf16, kN, D>(o, sc, v_cols, off);
  wgmma::Wait<0>();
  wgmma::FenceRegisters(o);
}

// kOverlap (one warpgroup a CTA, three stages: WalkStagedBlocksOverlapped): a block's O += P V
// is waited for after the next block's S = Q K^T was issued, so the two run back to back on
// the tensor cores (FlashAttention-3's overlap); P's fragments stay live meanwhile.
template <typename scalar_t, typename Walk, int kWarpgroups, bool kOverlap, int kHeadDim>
__global__ void __launch_bounds__(TiledWgmmaCfg<kWarpgroups, kHeadDim>::kThreads,
                                  TiledWgmmaCfg<kWarpgroups, kHeadDim>::kCtasPerSm)
    TiledFwdWgmmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                        const scalar_t* __restrict__ v, scalar_t* __restrict__ out, float* __restrict__ lse, Shape s,
                        Walk walk, int positions_per_cta, float scale_log2) {
  using Cfg = TiledWgmmaCfg<kWarpgroups, kHeadDim>;
  constexpr int D = Cfg::kD, kN = Cfg::kN, kStages = kOverlap ? 3 : 2;
  static_assert(!kOverlap || kWarpgroups == 1, "the overlapped walk's barriers are the one warpgroup's");
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 tiled_smem[];  // [slack][kStages][K tile, V tile], then the walk's data
  const uint32_t raw_base = mma::SmemAddr(tiled_smem);
  const uint32_t smem_base = (raw_base + Cfg::kAlignSlack - 1) & ~static_cast<uint32_t>(Cfg::kAlignSlack - 1);
  unsigned char* const walk_smem =
      reinterpret_cast<unsigned char*>(tiled_smem) + (smem_base - raw_base) + kStages * Cfg::kStageBytes;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hq = s.hq();
  const int t0 = static_cast<int>(blockIdx.x) * positions_per_cta;
  const int grp = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int positions = min(positions_per_cta, s.T - t0), rows = positions * hq;
  const bool active = 64 * (warp / 4) < rows;  // warpgroup-uniform
  // Q's loads first: they overlap the walk's set-up and its barriers.
  const LaneRows<1> lr(s, b, grp, t0, rows, warp, lane);
  uint32_t qf[1][D / 16][4];
  LoadRowFragments<D, 1>(qf, q, lr.index, lr.valid, lane);
  walk.Prepare(walk_smem, s, b, grp, t0, positions);
  State<D, 1> st;
  st.Init();

  // The first stage's descriptors, worked out once; a block's stage and k-step are an Advance.
  const uint64_t k_rows = wgmma::KMajorTile(smem_base), v_cols = wgmma::MnMajorTile(smem_base + Cfg::kTileBytes);
  // Block blk's keys and which of them the rows see (worked out while its scores run), and
  // the softmax of those scores in sc with that mask.
  struct BlockKeys {
    int key0, count;
    bool every_row;
  };
  const auto keys_of = [&](int blk) {
    BlockKeys bk;
    bk.key0 = walk.Start(blk);
    bk.count = walk.Count(s, blk);
    bk.every_row = walk.EveryRowSeesAll(blk, bk.key0, bk.count);  // CTA-uniform
    return bk;
  };
  const auto softmax = [&](int blk, const BlockKeys& bk, float (&sc)[kN / 8][4]) {
    const int key0 = bk.key0, count = bk.count;
    const bool every_row = bk.every_row;
    bool whole_block_rows = false;  // CTA-uniform: each row sees all of the block or none
    if constexpr (Walk::kWholeBlockRows) whole_block_rows = count == kN && walk.RowsSeeWholeBlock(key0, count);
    if (every_row && count == kN) {  // CTA-uniform: no test per score
      mma::OnlineSoftmaxLazyRescale<D, kN>(sc, st.o[0], st.m[0], st.l[0], scale_log2,
                                           [](int, int) { return true; }, lane);
    } else if (whole_block_rows) {
      bool sees[2] = {false, false};
      if constexpr (Walk::kWholeBlockRows) {
        sees[0] = walk.RowSees(blk, lr.pos[0][0]);
        sees[1] = walk.RowSees(blk, lr.pos[0][1]);
      }
      mma::OnlineSoftmaxLazyRescaleRows<D, kN>(sc, st.o[0], st.m[0], st.l[0], scale_log2, sees, lane);
    } else {
      int lo[1][2], hi[1][2];
      RowKeyRanges<1>(walk, lr, t0, blk, key0, count, every_row, lo, hi);
      mma::OnlineSoftmaxLazyRescale<D, kN>(
          sc, st.o[0], st.m[0], st.l[0], scale_log2,
          [&](int h, int key) { return key >= lo[0][h] && key <= hi[0][h]; }, lane);
    }
  };
  if constexpr (kOverlap) {
    // The CTA's one warpgroup always has rows (a CTA has at least one position), so no step is
    // behind `active`: ptxas, seeing a path where a P V went out and the next step's wait did
    // not, serialised every product (C7514).
    float sc[kN / 8][4];
    BlockKeys bk;
    const auto scores = [&](int blk, uint32_t kbuf) {
      WgmmaIssueScores<kBf16, D>(sc, qf[0], k_rows, kbuf - smem_base);
      bk = keys_of(blk);
      wgmma::Wait<0>();  // these scores, and the previous block's P V
      wgmma::FenceRegisters(sc);
      wgmma::FenceRegisters(st.o[0]);
    };
    const auto rest = [&](int blk, uint32_t kbuf) {
      softmax(blk, bk, sc);
      WgmmaIssuePV<kBf16, kN, D>(st.o[0], sc, v_cols, kbuf - smem_base);
    };
    WalkStagedBlocksOverlapped<D, kN, Cfg::kThreads, Cfg::kStageBytes>(smem_base, k, v, s, walk, b, grp, scores, rest);
    wgmma::Wait<0>();
    wgmma::FenceRegisters(st.o[0]);
  } else {
    const auto block = [&](int blk, uint32_t kbuf) {
      if (active) {
        const uint32_t stage_off = kbuf - smem_base;
        const BlockKeys bk = keys_of(blk);
        float sc[kN / 8][4];
        WgmmaScores<kBf16, D>(sc, qf[0], k_rows, stage_off);
        softmax(blk, bk, sc);
        WgmmaAccumulatePV<kBf16, kN, D>(st.o[0], sc, v_cols, stage_off);
      }
    };
    WalkStagedBlocks<D, kN, Cfg::kThreads, Cfg::kStageBytes, true>(smem_base, k, v, s, walk, b, grp, block);
  }
  // The rows go out through the first K/V stage, free once every warp is past the walk and no
  // copy is in flight (kRows rows of D: 16 or 32 KB, one stage). ncu, H200, 64k 12:2 window
  // branch (forty-second session): D = 128 688 -> 651 us, D = 64 356 us either way; nsa_bench
  // `win` D128 0.690-0.728 -> 0.669-0.694 ms, `slc` B16 T2048 D128 0.658-0.684 -> 0.640-0.652.
  static_assert(Cfg::kRows * D * 2 <= Cfg::kStageBytes, "the staged rows fit one stage");
  mma::CpAsyncWaitAll();
  __syncthreads();
  FinishStaged<kBf16, D>(st, smem_base, 16 * warp, out, lse, lr.index, lr.valid, lane);
}

// Launches the tiled forward (TiledFwdKernel, or TiledFwdWgmmaKernel where
// TiledWgmmaWarpgroups says so) over [B,T,H,D] q (k, v: [B,T,G,D]); out like q, lse [B,T,H] float32 in log2 units
// (+inf for a row that saw no key).
template <typename scalar_t, int D, typename Walk>
void LaunchTiledForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                        at::Tensor& lse, const Shape& s, const Walk& walk, int walk_smem_bytes) {
  using Cfg = TiledCfg<D>;
  const int warpgroups = TiledWgmmaWarpgroups(q);  // 0: mma.sync; a forced choice that cannot run throws
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  // The grid follows the launched kernel's rows per CTA.
  const auto launch = [&](auto kernel, int threads, int smem, int rows) {
    TORCH_CHECK(s.hq() <= rows, "tiled attention forward: at most ", rows, " heads per group, got ", s.hq());
    const int per_cta = TiledPositionsPerCta(rows, s.hq());
    const dim3 grid(static_cast<unsigned>((s.T + per_cta - 1) / per_cta), s.G, s.B);
    LaunchKernel(kernel, grid, threads, smem, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                 out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, walk, per_cta, scale_log2);
  };
  if constexpr (D == 64 || D == 128) {
    const auto launch_wgmma = [&](auto cfg, auto overlap) {
      using W = decltype(cfg);
      constexpr bool kOverlap = decltype(overlap)::value;
      launch(TiledFwdWgmmaKernel<scalar_t, Walk, W::kWarpgroups, kOverlap, D>, W::kThreads,
             W::kAlignSlack + (kOverlap ? 3 : 2) * W::kStageBytes + walk_smem_bytes, W::kRows);
    };
    // At D = 128 the overlap also won for the selected walk (H200, D128 12:2, nsa_bench `slc`
    // forward: B16 T2048 0.667-0.671 -> 0.653-0.655 ms, B1 T2048 0.072-0.074 -> 0.066-0.067).
    if (warpgroups == 1 && TiledWgmmaOverlap(Walk::kOverlapByDefault || D == 128)) {
      return launch_wgmma(TiledWgmmaCfg<1, D>{}, std::true_type{});
    }
    if (warpgroups == 1) return launch_wgmma(TiledWgmmaCfg<1, D>{}, std::false_type{});
    if constexpr (D == 64) {
      if (warpgroups == 2) return launch_wgmma(TiledWgmmaCfg<2>{}, std::false_type{});
    }
  }
  launch(TiledFwdKernel<scalar_t, D, Walk>, Cfg::kThreads, 2 * Cfg::kStageBytes + walk_smem_bytes, Cfg::kRows);
}

}  // namespace nsad::nsa::cuda::detail::smem_fwd
