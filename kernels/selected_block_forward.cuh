// Key-centric forward of the selected branch for long sequences (SelectedKernelChoice::Fwd::
// kBlocks), included by selected_attention.cu.
//
// Why: the query-centric kernels read every selected block once per (position, group). At 64k
// with unrelated selections nothing is shared between neighbours, so that is 16 blocks of K
// and V per position: 34 GB from L2 per call at D=64, 12:2, and the kernel runs at the L2's
// bandwidth (PERFORMANCE.md). Here a block is read once per work item instead, like the dK/dV
// kernel does, and each (position, head) gets one partial result per selected block:
//   1. SelectedBlockFwdKernel: one CTA per work item of the inverted block map (a block and a
//      slice of the entries that chose it, SelectedKeyPolicy). K/V of the block are staged
//      once in shared memory; the slice's (entry, head) rows follow through shared memory
//      kRows at a time, each warp takes 16 kM of them, softmax over the block's causal keys
//      in one step, and writes o / l (input type) and the partial log2-sum-exp per row.
//   2. CombineSelectedPartials: per (position, head), the log2-sum-exp over the distinct
//      selected blocks (a block listed twice counts once, as in the reference: InvertBlockMap
//      marks the entries without a partial) and the partials weighted by 2^(lse_i - lse): the
//      output and lse the backward expects; four blocks' loads in flight at a time.
// At head_dim 64 a position's local blocks (block 0, its own and the previous one, which
// every position of its block shares) leave the block kernel: a tiled pass over neighbouring
// positions (smem_fwd's kernel with ChosenBlocksWalk<true>, selected_attention.cu, or with
// 64-key selection blocks on sm_90a LocalBlocksWgmmaKernel below) gives one result for the
// three, which the combine starts from (SelectedKernelChoice::Local).
// The partials cost B T G n hq (D + 2) 16-bit words of HBM traffic each way, against 16
// blocks of K and V per (position, group) from L2 for the query-centric kernels: this pays
// only when neighbours share few blocks (long sequences; the dispatch is measured).
#pragma once

#include <cmath>
#include <type_traits>

#include "smem_fwd_tile.cuh"

namespace nsad::nsa::cuda::detail::block_fwd {

// Eight warps of one m16 tile each (kRows = 128 rows per CTA step) and a register budget
// for three CTAs per SM at D=64 (ncu: with 32-row warps at 200 registers, 8 warps per SM
// stalled on their own dependencies; two CTAs at 128 registers left 25% of the warps active
// and the kernel 1.75 ms at 64k 12:2; three at 80 registers, 100 bytes spilled, 37% and 1.55
// ms). D=128 holds twice the accumulators: two CTAs (128 registers, 56 bytes spilled, 2 x 100
// KB of shared memory) took the 64k 12:2 `slc` from 5.33-5.37 to 4.21-4.42 ms on the H200,
// where one CTA's budget gave 201 registers and 8 warps an SM.
template <int D>
struct BlockFwdCfg {
  static constexpr int kM = 1, kWarps = 8, kThreads = 32 * kWarps, kRows = 16 * kM * kWarps;
  static constexpr int kMinCtas = D == 64 ? 3 : 2;
  static constexpr int kN = 64;  // keys per block tile (slc_block <= 64)
  static constexpr int kTileBytes = kN * D * 2;
};

// The CTA's shared memory: the K and V tiles, two buffers of kRows staged Q rows, and the
// item's entries and their positions.
template <int D, int kMaxEntries>
struct BlockFwdSmem {
  using Cfg = BlockFwdCfg<D>;
  static constexpr int kQBytes = Cfg::kRows * D * 2;  // one buffer of staged Q rows
  static constexpr int kQOffset = 2 * Cfg::kTileBytes;
  static constexpr int kEntryOffset = kQOffset + 2 * kQBytes;
  static constexpr int kPosOffset = kEntryOffset + 4 * kMaxEntries;
  static constexpr int kBytes = kPosOffset + 4 * kMaxEntries;
};

// One CTA per work item (BlockFwdCfg: kM m16 tiles of rows per warp, kRows rows per CTA
// step), with the products of the tiled forward (smem_fwd) and its staged row output
// (smem_fwd::FinishStaged). The item's (entry, head) rows are gathered kRows at a time into
// shared memory with cp.async, the next step's copy in flight while this one computes (a warp
// loading its own Q rows would wait on each gather: a row's position comes from the entry
// list, so they are scattered across the sequence).
template <typename scalar_t, int D, int kMaxEntries, typename KeyPolicy>
__global__ void __launch_bounds__(BlockFwdCfg<D>::kThreads, BlockFwdCfg<D>::kMinCtas)
    SelectedBlockFwdKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const scalar_t* __restrict__ v, scalar_t* __restrict__ part_o,
                           float* __restrict__ part_lse, Shape s, KeyPolicy pol, float scale_log2) {
  using Cfg = BlockFwdCfg<D>;
  using Smem = BlockFwdSmem<D, kMaxEntries>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kRows = Cfg::kRows, kChunks = D / 8;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 block_fwd_smem[];
  unsigned char* const smem = reinterpret_cast<unsigned char*>(block_fwd_smem);
  int* const entry = reinterpret_cast<int*>(smem + Smem::kEntryOffset);
  int* const pos = reinterpret_cast<int*>(smem + Smem::kPosOffset);  // entry i's position

  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;  // whole CTA
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hq = s.hq();
  const int total = w.num_queries * hq;  // (entry, head) rows
  const uint32_t kbuf = mma::SmemAddr(smem), qbuf0 = kbuf + Smem::kQOffset;
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  mma::StageTileAsync<D, kN, Cfg::kThreads>(kbuf, k + KeyOffset(s, w.b, w.keys.start, w.g), kv_stride,
                                            w.keys.count);
  mma::StageTileAsync<D, kN, Cfg::kThreads>(kbuf + Cfg::kTileBytes, v + KeyOffset(s, w.b, w.keys.start, w.g),
                                            kv_stride, w.keys.count);
  for (int i = threadIdx.x; i < w.num_queries; i += Cfg::kThreads) {
    const int e = pol.Entry(w, i);
    entry[i] = e;
    pos[i] = e / pol.per_position % s.T;
  }
  __syncthreads();  // entries are read by every thread below
  // (entry, head) of a row: a multiply-high, not a division by the run-time hq (rows < 2^31 /
  // hq: kMaxEntries hq rows at most). With signed divisions here and in the rows' setup below,
  // ncu at 64k 12:2 (forty-third session): D64 1.22 ms and 753 M instructions, now 1.06 ms and
  // 611 M; D128 2.29 -> 1.95 ms.
  const SmallDivisor by_hq(hq);
  const int64_t q_row0 = (static_cast<int64_t>(w.b) * s.T) * s.H + w.g * hq;  // QueryOffset's row of (b, 0, g hq)
  // Rows [r0, r0 + kRows) into Q buffer buf: row r at its swizzled place, zeros past the end.
  const auto stage_q = [&](int r0, int buf) {
    for (int i = threadIdx.x; i < kRows * kChunks; i += Cfg::kThreads) {
      const int r = i / kChunks, ch = i % kChunks, rho = r0 + r;
      const bool ok = rho < total;
      int e, head;
      by_hq.DivMod(rho, e, head);
      const int64_t off = ok ? (q_row0 + pos[e] * s.H + head) * D + ch * 8 : 0;
      mma::CpAsync16(qbuf0 + buf * Smem::kQBytes + mma::SwizzledOffset<D>(r, ch), q + off, ok);
    }
    mma::CpAsyncCommit();
  };

  stage_q(0, 0);  // the same group as the K/V tiles
  for (int r0 = 0, buf = 0; r0 < total; r0 += kRows, buf ^= 1) {
    mma::StageNextAndWait(r0, kRows, total, buf, stage_q);
    __syncthreads();
    const int row0 = r0 + 16 * kM * warp;  // the warp's first row
    if (row0 < total) {
      // A fragments of the warp's m16 tiles: ldmatrix.x4, lanes 0-15 rows at chunk 2ks,
      // lanes 16-31 the same rows at chunk 2ks + 1.
      uint32_t qf[kM][D / 16][4];
      const uint32_t qbuf = qbuf0 + buf * Smem::kQBytes;
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          mma::LdMatrixX4(qf[m][ks], qbuf + mma::SwizzledOffset<D>(16 * (kM * warp + m) + (lane & 15),
                                                                   2 * ks + (lane >> 4)));
        }
      }
      // The lane's rows' positions now; their partial rows only at the store, so that the
      // 64-bit indices are not live through the products (80 registers at D = 64).
      const auto row_of = [&](int m, int h) { return row0 + 16 * m + (lane >> 2) + 8 * h; };
      bool valid[kM][2];
      int t[kM][2];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          valid[m][h] = row_of(m, h) < total;
          int i, head;
          by_hq.DivMod(valid[m][h] ? row_of(m, h) : 0, i, head);
          t[m][h] = pos[i];
        }
      }
      smem_fwd::State<D, kM> st;
      st.Init();
      float sc[kM][kN / 8][4];
      smem_fwd::Scores<kBf16, D, kM, kN>(sc, qf, kbuf, lane);
      // Most rows see the whole block (only a position's own block is cut by causality):
      // then the step runs without a per-key test.
      bool sees_all = w.keys.count == kN;
#pragma unroll
      for (int m = 0; m < kM; ++m) sees_all &= w.keys.start + kN - 1 <= min(t[m][0], t[m][1]);
      // A row's one step (kFresh): no rescale of O, which stays a known zero until P V rather
      // than 32 (D / 2) live accumulators through Q K^T.
      if (__all_sync(0xffffffffu, sees_all)) {
        smem_fwd::SoftmaxPV<kBf16, D, kM, kN, true>(st, sc, kbuf + Cfg::kTileBytes, scale_log2,
                                                    [](int, int, int) { return true; }, lane);
      } else {
        smem_fwd::SoftmaxPV<kBf16, D, kM, kN, true>(
            st, sc, kbuf + Cfg::kTileBytes, scale_log2,
            [&](int m, int h, int key) { return key < w.keys.count && w.keys.start + key <= t[m][h]; }, lane);
      }
      // o / l and the log2-sum-exp per (entry, head) row; a row that saw no key (a block
      // past its position) gets +inf, which the combine skips.
      // Through the warp's own 16 Q rows of this step's buffer, read already.
      static_assert(kM == 1, "FinishStaged takes one m16 tile a warp");
      int64_t p_row[kM][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int i, head;
        by_hq.DivMod(valid[0][h] ? row_of(0, h) : 0, i, head);
        p_row[0][h] = static_cast<int64_t>(entry[i]) * hq + head;
      }
      smem_fwd::FinishStaged<kBf16, D>(st, qbuf, 16 * warp, part_o, part_lse, p_row, valid, lane);
    }
    __syncthreads();  // everyone is done with buf before the next step stages into it
  }
}

// One thread per (b, t, head, 8 columns): out and lse (log2 units, +inf and a zero row when no
// block had a visible key) from the partials of the position's distinct selected blocks,
// and with local_lse set, from the local pass's result for its local blocks (out and
// local_lse on entry; SelectedKernelChoice::Local) and the partials of the rest.
// Which entries count, the lse says: InvertBlockMap marked every entry that got no partial (an
// unused slot, a repeat, a local block the local pass took) -inf (NoPartialMarks), and the
// block kernel writes +inf for a block with no visible key. So the block indices are not read;
// with them, the repeat and local checks, ncu at 64k 12:2 (forty-third session): D64 488 ->
// 368 us (381 M -> 209 M instructions), D128 959 -> 719 us.
// kBatch entries at a time (SelectedKernelChoice::Combine): a batch's lse, then its o, are
// loaded before any is used, and the next batch's lse go out with this batch's o, so a thread
// waits on one load a batch (the kernel is a stream of HBM reads). kBatch 8 at 86 registers
// (two CTAs an SM) was slower than one at a time (PERFORMANCE.md, thirty-third session); 4
// under four CTAs an SM keeps most of the occupancy and is the default.
template <typename scalar_t, int D, int kBatch>
__global__ void __launch_bounds__(256, 4)
    CombineSelectedPartials(const scalar_t* __restrict__ part_o, const float* __restrict__ part_lse,
                            scalar_t* __restrict__ out, float* __restrict__ lse, Shape s, int n,
                            const float* __restrict__ local_lse) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t rows = static_cast<int64_t>(s.B) * s.T * s.H;
  if (i >= rows * kChunks) return;
  const int ch = static_cast<int>(i % kChunks);
  const int64_t row = i / kChunks;  // (b, t, h) of [B,T,H]
  const int h = static_cast<int>(row % s.H), hq = s.hq(), grp = h / hq, head = h % hq;
  const int64_t e0 = (row / s.H * s.G + grp) * n;  // the (b, t, g) entries
  float m = -INFINITY, l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  // The local blocks' partial, when the tiled pass made it: out holds it (a zero row when its
  // lse is +inf), so both loads go out unconditionally, next to the first batch's.
  if (local_lse != nullptr) {
    const float x = local_lse[row];
    const uint4 raw = *reinterpret_cast<const uint4*>(out + row * D + 8 * ch);
    const scalar_t* val = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
    for (int d = 0; d < 8; ++d) acc[d] = static_cast<float>(val[d]);
    if (x != INFINITY) m = x, l = 1.f;
  }
  // The next batch's lse go out behind this batch's o loads, so a batch waits on one round trip
  // to memory, not two (ncu, 64k 12:2: D64 510 -> 491 us, D128 955 -> 913 us against the same
  // loop loading them at its end; thirty-eighth session).
  const auto load_batch = [&](int j0, float (&x)[kBatch]) {
#pragma unroll
    for (int u = 0; u < kBatch; ++u) x[u] = j0 + u < n ? part_lse[(e0 + j0 + u) * hq + head] : -INFINITY;
  };
  float x[kBatch];
  load_batch(0, x);
  for (int j0 = 0; j0 < n; j0 += kBatch) {
    // -inf for an entry that does not count, and for a block with no visible key (+inf):
    // such an entry weighs 0 and its o is not read. Then the o of the rest.
    float m_new = m;
    uint4 raw[kBatch];
#pragma unroll
    for (int u = 0; u < kBatch; ++u) {
      if (x[u] == INFINITY) x[u] = -INFINITY;
      m_new = fmaxf(m_new, x[u]);
      raw[u] = make_uint4(0u, 0u, 0u, 0u);
      if (x[u] != -INFINITY)
        raw[u] = *reinterpret_cast<const uint4*>(part_o + ((e0 + j0 + u) * hq + head) * D + 8 * ch);
    }
    float next_x[kBatch];
    load_batch(j0 + kBatch, next_x);
    if (m_new != -INFINITY) {  // else nothing visible yet
      const float alpha = mma::Exp2(m - m_new);  // 0 for the first visible batch
#pragma unroll
      for (int d = 0; d < 8; ++d) acc[d] *= alpha;
      l *= alpha;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        const float wgt = mma::Exp2(x[u] - m_new);  // 0 for a skipped entry
        const scalar_t* val = reinterpret_cast<const scalar_t*>(&raw[u]);
#pragma unroll
        for (int d = 0; d < 8; ++d) acc[d] += wgt * static_cast<float>(val[d]);
        l += wgt;
      }
      m = m_new;
    }
#pragma unroll
    for (int u = 0; u < kBatch; ++u) x[u] = next_x[u];
  }
  const mma::RowFinish fin = mma::FinishRow(m, l);
  alignas(16) scalar_t res[8];
#pragma unroll
  for (int d = 0; d < 8; ++d) res[d] = static_cast<scalar_t>(acc[d] * fin.inv);
  *reinterpret_cast<uint4*>(out + row * D + 8 * ch) = *reinterpret_cast<const uint4*>(res);
  if (ch == 0) lse[row] = fin.lse;
}

// The local blocks' pass on its own kernel (SelectedKernelChoice::Local::kLocalKernel): head_dim
// 64, selection blocks of 64 keys, bf16/fp16 on sm_90a. Why: the general tiled pass
// (ChosenBlocksWalk<true>) holds 10 positions of 6 heads a CTA, so each CTA stages the same
// three blocks for a tenth of their positions, builds chooser masks in shared memory and
// keeps 24% of its warps active (218 us at 64k D64 12:2). Here one CTA takes a selection block
// c of one (b, g): its 64 positions all have the local blocks 0, c - 1 and c, staged once for
// every head of the group; the warpgroup walks the heads, each head's 64 positions being the
// 64 rows of its warpgroup MMAs (S = Q K^T, online softmax, O += P V, as TiledFwdWgmmaKernel).
// A row sees a block if its position's selection lists it (bits read once per CTA from
// block_idx, so a hand-made selection without its local blocks is followed too), and in block
// c only the causal keys. Out and lse as the tiled pass writes them. At D = 128 each K and V
// tile is two [64][64] halves (smem_fwd::kWgmmaHalfBytes) and O two m64n64 products.
template <int D>
struct LocalCfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kN = 64;                    // keys per block (= selection block)
  static constexpr int kThreads = wgmma::kWarpgroupThreads;
  static constexpr int kTileBytes = kN * D * 2;    // 8 or 16 KB: a multiple of the swizzle's 1 KB
  static constexpr int kBlocks = 3;                // 0, c - 1, c
  static constexpr int kAlignSlack = static_cast<int>(wgmma::kSwizzleBytes);
  // 8 output rows a warp after the tiles: the rows leave through them, 16 bytes a lane
  // (smem_fwd::FinishStaged by halves), not as 4-byte fragments.
  static constexpr int kStageOffset = kBlocks * 2 * kTileBytes;  // from the aligned base
  static constexpr int kStageRowBytes = 4 * 8 * D * 2;
  static constexpr int kSmemBytes = kAlignSlack + kStageOffset + kStageRowBytes;
  // D = 64: four CTAs an SM (128 registers, 4 x 53 KB of shared memory), as the tiled pass's
  // kernel. D = 128 holds twice Q's fragments and O's accumulators: two (105 KB each).
  static constexpr int kMinCtas = D == 64 ? 4 : 2;
};

template <typename scalar_t, int D>
__global__ void __launch_bounds__(LocalCfg<D>::kThreads, LocalCfg<D>::kMinCtas)
    LocalBlocksWgmmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const scalar_t* __restrict__ v, scalar_t* __restrict__ out, float* __restrict__ lse,
                           Shape s, const int* __restrict__ block_idx, int n, float scale_log2) {
  using Cfg = LocalCfg<D>;
  constexpr int kN = Cfg::kN;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 local_smem[];  // [slack][block j: K tile, V tile]
  const uint32_t raw_base = mma::SmemAddr(local_smem);
  const uint32_t base = (raw_base + Cfg::kAlignSlack - 1) & ~static_cast<uint32_t>(Cfg::kAlignSlack - 1);
  const int c = static_cast<int>(blockIdx.x), grp = static_cast<int>(blockIdx.y), b = static_cast<int>(blockIdx.z);
  const int t0 = c * kN, positions = min(kN, s.T - t0);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, hq = s.hq();

  // The local blocks, ascending and distinct: 0, then c - 1 and c where they are new (c, the
  // causal one, last). Worked out from j rather than held in an array, which took 16 bytes of
  // stack (ptxas).
  const int count = c == 0 ? 1 : c == 1 ? 2 : 3;
  const auto block_at = [&](int j) { return j == 0 ? 0 : j == count - 1 ? c : c - 1; };
  const mma::TileCopyPlan<64, kN, Cfg::kThreads> plan(s.G * D);  // one [64][64] half
  for (int j = 0; j < count; ++j) {
    const int first = block_at(j) * kN, keys = min(kN, s.T - first);
#pragma unroll
    for (int half = 0; half < D / 64; ++half) {
      const uint32_t dst = base + j * 2 * Cfg::kTileBytes + half * smem_fwd::kWgmmaHalfBytes;
      plan.Issue(dst, k + KeyOffset(s, b, first, grp) + 64 * half, keys);
      plan.Issue(dst + Cfg::kTileBytes, v + KeyOffset(s, b, first, grp) + 64 * half, keys);
    }
  }
  mma::CpAsyncCommit();

  // The lane's two rows (positions t0 + r): bit j of chose[h] says the position's selection
  // lists block_at(j). The four lanes of a row read every fourth slot and OR their bits.
  int r[2];
  bool valid[2];
  unsigned chose[2] = {0u, 0u};
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    r[h] = 16 * warp + (lane >> 2) + 8 * h;
    valid[h] = r[h] < positions;
    if (valid[h]) {
      const int* row = block_idx + ((static_cast<int64_t>(b) * s.T + t0 + r[h]) * s.G + grp) * n;
      for (int slot = lane & 3; slot < n; slot += 4) {
        const int blk = row[slot];
#pragma unroll
        for (int j = 0; j < Cfg::kBlocks; ++j) chose[h] |= j < count && blk == block_at(j) ? 1u << j : 0u;
      }
    }
    chose[h] |= __shfl_xor_sync(0xffffffffu, chose[h], 1);
    chose[h] |= __shfl_xor_sync(0xffffffffu, chose[h], 2);
  }
  mma::CpAsyncWaitAll();
  wgmma::FenceProxyAsync();  // the tiles, visible to the tensor cores after the barrier
  __syncthreads();

  const uint64_t k_rows = wgmma::KMajorTile(base), v_cols = wgmma::MnMajorTile(base + Cfg::kTileBytes);
  for (int head = 0; head < hq; ++head) {
    int64_t index[1][2];
    bool row_valid[1][2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_valid[0][h] = valid[h];
      index[0][h] = (static_cast<int64_t>(b) * s.T + t0 + (valid[h] ? r[h] : 0)) * s.H + grp * hq + head;
    }
    uint32_t qf[1][D / 16][4];  // invalid rows: Q = 0, never stored
    smem_fwd::LoadRowFragments<D, 1>(qf, q, index, row_valid, lane);
    smem_fwd::State<D, 1> st;
    st.Init();
    for (int j = 0; j < count; ++j) {
      const uint32_t off = j * 2 * Cfg::kTileBytes;
      float sc[kN / 8][4];
      smem_fwd::WgmmaScores<kBf16, D>(sc, qf[0], k_rows, off);
      const bool sees[2] = {valid[0] && ((chose[0] >> j) & 1u) != 0u, valid[1] && ((chose[1] >> j) & 1u) != 0u};
      if (block_at(j) < c) {  // wholly before every position: a row sees all of it or none
        if (__all_sync(0xffffffffu, sees[0] && sees[1])) {
          mma::OnlineSoftmaxLazyRescale<D, kN>(sc, st.o[0], st.m[0], st.l[0], scale_log2,
                                               [](int, int) { return true; }, lane);
        } else {
          mma::OnlineSoftmaxLazyRescaleRows<D, kN>(sc, st.o[0], st.m[0], st.l[0], scale_log2, sees, lane);
        }
      } else {  // the positions' own block: keys up to the row's position (key0 = t0)
        const int last[2] = {sees[0] ? r[0] : -1, sees[1] ? r[1] : -1};
        mma::OnlineSoftmaxLazyRescale<D, kN>(sc, st.o[0], st.m[0], st.l[0], scale_log2,
                                             [&](int h, int key) { return key <= last[h]; }, lane);
      }
      smem_fwd::WgmmaAccumulatePV<kBf16, kN, D>(st.o[0], sc, v_cols, off);
    }
    // Through this warp's 8 rows after the K/V tiles (rows 8 warp .. + 7 of that stage). ncu at
    // 64k 12:2 (forty-third session): D = 64 154.9 -> 152.2 us, D = 128 314.3 -> 298.3 us.
    smem_fwd::FinishStaged<kBf16, D, 1>(st, base + Cfg::kStageOffset, 8 * warp, out, lse, index,
                                        row_valid, lane);
  }
}

}  // namespace nsad::nsa::cuda::detail::block_fwd
