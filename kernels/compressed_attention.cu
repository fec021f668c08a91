// Compressed attention (NSA section 3.3.1), forward with the selection importance, and
// backward. Query t sees compressed block j iff j*d + l - 1 <= t, so the visible blocks of a
// position are a prefix 0..Visible(t)-1 and a CTA serves a tile of consecutive positions of
// one GQA group (all its heads) by walking that prefix in chunks of kKeyChunk blocks. No
// [T, N] score matrix is written anywhere.
//
// Importance needs the normalised probabilities, which are known only once the whole row
// has been seen: the forward kernel saves the row log-sum-exp, and a second pass
// (CmpImportanceKernel) recomputes the scores chunk by chunk, turns them into probabilities
// and maps them straight onto selection blocks (weighted by the token overlap), summed over
// the group's heads. The [B,T,H,N] probabilities are never stored. Where every compressed
// block fits two 64-key tiles (T <= 2064 in m7c's geometry, head_dim 64), CmpOnePassKernel
// does both in one pass: all of a row's scores fit its registers, so the row's sum is known
// before any P is used.
//
// bf16/fp16 inputs run on tensor cores. Default: FlashAttention-2-style kernels with
// shared-memory tiles (CmpSmemKernel forward / importance, CmpSmemDqKernel,
// CmpSmemDkDvKernel; the importance at head_dim 64 with an even head count per group up to 8
// on CmpImportanceLaneKernel, all of a position's heads in one lane, or on sm_90 its
// warpgroup-MMA twin CmpImportanceLaneWgmmaKernel): 128 flattened
// (position, head) rows per query-side CTA, each 64-block
// K/V tile copied once per CTA with cp.async (double buffered) and read by all warps with
// ldmatrix. The earlier register-only kernels (CmpQueryMmaKernel, CmpImportanceMmaKernel,
// mma::DkDvMmaKernel: 64 rows per CTA, 16 per warp, operands straight from L1/L2) remain for
// geometries the shared-memory importance mapping does not cover and for A/B timing
// (CompressedKernelChoice in kernel_choice.h). On sm_90 (head_dim 64 and 128) dK/dV run on the
// selected branch's warpgroup-MMA kernel instead (selected_dkdv_wgmma.cuh) under CmpKeyPolicy's
// mask. fp32 inputs keep the scalar kernels of attention_tile.cuh.
#include <ATen/detail/CUDAHooksInterface.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "kernel_choice.h"
#include "launch_util.cuh"
#include "mma_tile.cuh"
#include "selected_dkdv_wgmma.cuh"
#include "smem_fwd_tile.cuh"

namespace nsad::nsa::cuda::detail {

namespace {
std::atomic<CompressedKernelChoice::Path> compressed_choice{CompressedKernelChoice::Path::kAuto};
std::atomic<CompressedKernelChoice::Map> compressed_map{CompressedKernelChoice::Map::kAuto};
std::atomic<CompressedKernelChoice::KeySide> compressed_key_side{CompressedKernelChoice::KeySide::kAuto};
std::atomic<CompressedKernelChoice::Pass> compressed_pass{CompressedKernelChoice::Pass::kAuto};
}  // namespace

void SetCompressedKernelChoiceForTesting(const CompressedKernelChoice& choice) {
  compressed_choice.store(choice.path);
  compressed_map.store(choice.map);
  compressed_key_side.store(choice.key_side);
  compressed_pass.store(choice.pass);
}

CompressedKernelChoice GetCompressedKernelChoice() {
  CompressedKernelChoice choice;
  choice.path = compressed_choice.load();
  choice.map = compressed_map.load();
  choice.key_side = compressed_key_side.load();
  choice.pass = compressed_pass.load();
  return choice;
}

namespace {

// Query positions per key-side backward CTA (dK/dV): 512 where the grid is large anyway
// (long sequences, batch 16), halved down to 32 while keys x batch x groups alone would leave
// SMs idle. At batch 1, T = 2048 there are only 2 chunks of 64 compressed keys per group:
// 512 positions per CTA gave 16 CTAs (fewer with work) on 132 SMs.
constexpr int kMaxQueriesPerKeyCta = 512, kMinQueriesPerKeyCta = 32;

// Compressed blocks visible from position t: j*d + l - 1 <= t.
__device__ __forceinline__ int CmpVisible(int t, int num_blocks, int cmp_block, int cmp_stride) {
  return t < cmp_block - 1 ? 0 : min(num_blocks, (t - (cmp_block - 1)) / cmp_stride + 1);
}

// The rows of a tensor-core CTA: positions [t0, t0 + positions) of group g, all heads,
// flattened as r = (t - t0) * hq + head. CTAs are issued longest-first (the last positions
// see the most blocks) so the causal imbalance does not leave a tail.
struct CmpMmaTile {
  int b, g, t0, positions, rows;
  __device__ CmpMmaTile(const Shape& s, int positions_per_cta) {
    t0 = static_cast<int>(gridDim.x - 1 - blockIdx.x) * positions_per_cta;
    g = static_cast<int>(blockIdx.y);
    b = static_cast<int>(blockIdx.z);
    positions = min(positions_per_cta, s.T - t0);
    rows = positions * s.hq();
  }
};

// Per lane: its two MMA rows (16*warp + g and + 8) of the tile.
struct CmpLaneRows {
  bool valid[2];
  int t[2], visible[2];
  int64_t index[2];  // (b, t, head) row index into [B,T,H]
  __device__ CmpLaneRows(const Shape& s, const CmpMmaTile& tile, int warp, int lane, int cmp_block,
                         int cmp_stride) {
    const int hq = s.hq();
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = 16 * warp + (lane >> 2) + 8 * half;
      valid[half] = r < tile.rows;
      t[half] = valid[half] ? tile.t0 + r / hq : 0;
      visible[half] = valid[half] ? CmpVisible(t[half], s.Tk, cmp_block, cmp_stride) : 0;
      index[half] = (static_cast<int64_t>(tile.b) * s.T + t[half]) * s.H + tile.g * hq + (valid[half] ? r % hq : 0);
    }
  }
};

// Forward (kDq false) or dQ (kDq true) of one tile on tensor cores.
template <typename scalar_t, int D, bool kDq>
__global__ void __launch_bounds__(mma::kMmaThreads)
    CmpQueryMmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                      const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                      const float* __restrict__ delta, scalar_t* __restrict__ out,
                      float* __restrict__ lse, Shape s, int positions_per_cta, int cmp_block,
                      int cmp_stride, float scale_log2, float dq_scale) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kN = kDq ? mma::KeysPerStep<D>() / 2 : mma::KeysPerStep<D>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const CmpMmaTile tile(s, positions_per_cta);
  if (16 * warp >= tile.rows) return;  // whole warps
  const CmpLaneRows rows(s, tile, warp, lane, cmp_block, cmp_stride);
  // The warp walks the blocks its last row sees; rows that see fewer mask the rest.
  const int last_row = min(16 * warp + 15, tile.rows - 1);
  const int visible = CmpVisible(tile.t0 + last_row / s.hq(), s.Tk, cmp_block, cmp_stride);
  mma::RowFrag<D> qa, qb;
  mma::LoadRow<D>(qa, rows.valid[0] ? q + rows.index[0] * s.D : nullptr, lane);
  mma::LoadRow<D>(qb, rows.valid[1] ? q + rows.index[1] * s.D : nullptr, lane);
  const int64_t stride = static_cast<int64_t>(s.G) * s.D;

  if constexpr (!kDq) {
    mma::FwdState<D> st;
    st.Init();
    for (int key0 = 0; key0 < visible; key0 += kN) {
      const auto allowed = [&](int half, int key) { return key0 + key < rows.visible[half]; };
      mma::FwdStep<kBf16, D, kN>(st, qa, qb, k + KeyOffset(s, tile.b, key0, tile.g),
                                 v + KeyOffset(s, tile.b, key0, tile.g), stride,
                                 min(kN, visible - key0), scale_log2, allowed, lane);
    }
    scalar_t* const out_row[2] = {rows.valid[0] ? out + rows.index[0] * s.D : nullptr,
                                  rows.valid[1] ? out + rows.index[1] * s.D : nullptr};
    float* const lse_row[2] = {lse + rows.index[0], lse + rows.index[1]};
    mma::FwdFinish<kBf16, D>(st, out_row, lse_row, lane);
  } else {
    mma::RowFrag<D> da, db;
    mma::LoadRow<D>(da, rows.valid[0] ? dout + rows.index[0] * s.D : nullptr, lane);
    mma::LoadRow<D>(db, rows.valid[1] ? dout + rows.index[1] * s.D : nullptr, lane);
    const float row_lse[2] = {rows.valid[0] ? lse[rows.index[0]] : INFINITY,
                              rows.valid[1] ? lse[rows.index[1]] : INFINITY};
    const float row_delta[2] = {rows.valid[0] ? delta[rows.index[0]] : 0.f,
                                rows.valid[1] ? delta[rows.index[1]] : 0.f};
    float acc[D / 8][4];
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    for (int key0 = 0; key0 < visible; key0 += kN) {
      const auto allowed = [&](int half, int key) { return key0 + key < rows.visible[half]; };
      mma::DqStep<kBf16, D, kN>(acc, qa, qb, da, db, k + KeyOffset(s, tile.b, key0, tile.g),
                                v + KeyOffset(s, tile.b, key0, tile.g), stride,
                                min(kN, visible - key0), scale_log2, row_lse, row_delta, allowed,
                                lane);
    }
#pragma unroll
    for (int half = 0; half < 2; ++half)
      if (rows.valid[half]) mma::StoreRow<kBf16, D>(out + rows.index[half] * s.D, acc, half, dq_scale, lane);
  }
}

// Adds the overlap-weighted probabilities of compressed blocks [start, start + count) (in
// p_s: tile row r, block start + j at p_s[r * p_stride + j]) to the importance of the tile's
// positions. A selection block straddles at most two chunks, so a value gets at most two
// addends and the result does not depend on their order.
__device__ __forceinline__ void AddImportance(const float* p_s, int p_stride, int start, int count,
                                              const Shape& s, int b, int g, int t0, int positions,
                                              int NS, int slc_block, int cmp_block, int cmp_stride,
                                              float* __restrict__ importance) {
  const int hq = s.hq();
  const int last = start + count - 1;
  const int sb_lo = start * cmp_stride / slc_block;
  const int sb_hi = min(NS - 1, (last * cmp_stride + cmp_block - 1) / slc_block);
  const int span = sb_hi - sb_lo + 1;
  for (int i = threadIdx.x; i < positions * span; i += blockDim.x) {
    const int tq = i / span, sb = sb_lo + i % span;
    const int sb_start = sb * slc_block, sb_end = sb_start + slc_block;
    // Blocks j with j*d < sb_end and j*d + l > sb_start.
    const int lo_num = sb_start - cmp_block + 1;
    const int j_lo = max(start, lo_num <= 0 ? 0 : (lo_num + cmp_stride - 1) / cmp_stride);
    const int j_hi = min(last, (sb_end - 1) / cmp_stride);
    float sum = 0.f;
    for (int j = j_lo; j <= j_hi; ++j) {
      const int js = j * cmp_stride;
      const float overlap = static_cast<float>(min(js + cmp_block, sb_end) - max(js, sb_start));
      float p = 0.f;
      for (int h = 0; h < hq; ++h) p += p_s[(tq * hq + h) * p_stride + (j - start)];
      sum = fmaf(p, overlap, sum);
    }
    if (sum != 0.f)
      atomicAdd(importance + ((static_cast<int64_t>(b) * s.T + t0 + tq) * s.G + g) * NS + sb, sum);
  }
}

// Importance on tensor cores: recomputes S chunk by chunk, P = exp2(S - lse) into shared
// memory, then AddImportance.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(mma::kMmaThreads)
    CmpImportanceMmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                           const float* __restrict__ lse, float* __restrict__ importance, Shape s,
                           int positions_per_cta, int NS, int slc_block, int cmp_block,
                           int cmp_stride, float scale_log2) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kN = mma::KeysPerStep<D>();
  constexpr int kStride = kN + 1;  // odd: the quad's column writes spread over banks
  __shared__ float p_s[mma::kTileRows * kStride];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const CmpMmaTile tile(s, positions_per_cta);
  const bool active = 16 * warp < tile.rows;  // idle warps still take part in the barriers
  const CmpLaneRows rows(s, tile, warp, lane, cmp_block, cmp_stride);
  mma::RowFrag<D> qa, qb;
  mma::LoadRow<D>(qa, rows.valid[0] ? q + rows.index[0] * s.D : nullptr, lane);
  mma::LoadRow<D>(qb, rows.valid[1] ? q + rows.index[1] * s.D : nullptr, lane);
  const float row_lse[2] = {rows.valid[0] ? lse[rows.index[0]] : INFINITY,
                            rows.valid[1] ? lse[rows.index[1]] : INFINITY};
  const int64_t stride = static_cast<int64_t>(s.G) * s.D;
  const int visible = CmpVisible(tile.t0 + tile.positions - 1, s.Tk, cmp_block, cmp_stride);
  for (int key0 = 0; key0 < visible; key0 += kN) {
    const int count = min(kN, visible - key0);
    if (active) {
      const scalar_t* k_rows = k + KeyOffset(s, tile.b, key0, tile.g);
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        mma::RowFrag<D> kr;
        const int key = 8 * j + g;
        mma::LoadRow<D>(kr, key < count ? k_rows + key * stride : nullptr, lane);
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        mma::QKTile<kBf16, D>(sc, qa, qb, kr);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int half = e >> 1, col = 8 * j + 2 * c + (e & 1);
          const float p = key0 + col < rows.visible[half] ? mma::Exp2(sc[e] * scale_log2 - row_lse[half]) : 0.f;
          p_s[(16 * warp + g + 8 * half) * kStride + col] = p;
        }
      }
    }
    __syncthreads();
    AddImportance(p_s, kStride, key0, count, s, tile.b, tile.g, tile.t0, tile.positions, NS,
                  slc_block, cmp_block, cmp_stride, importance);
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------------------
// Forward and importance with shared-memory tiles (FlashAttention-2 style), the default for
// bf16/fp16. A CTA owns Cfg::kRows flattened (position, head) rows of one group (whole
// positions, so a position's heads meet in one CTA for importance), kM m16 tiles per warp.
// Each tile of kN compressed keys (and values) is copied once into shared memory with
// cp.async, double buffered so the next tile's copy overlaps this tile's products, and read
// by all warps with ldmatrix: one L2 read per key per CTA instead of one per warp.
//
// The importance pass (kImportance) runs the same walk with K only and no P.V: with the
// final lse, P = exp2(S - lse) is exact per tile, and its mapping onto selection blocks is
// two shuffles per n8 tile in the paper's geometry (QuadMapRow) and elsewhere a small
// product X = P W, W[j][sb] = token overlap of compressed block j with
// selection block sb (integers <= l, exact in fp16; P in [0, 1] as a sum of two fp16
// parts, see SplitHalf2). X goes to shared memory, where the group's heads are summed in a fixed
// order. Tiles start at multiples of kN blocks and kN * d is a multiple of l' (checked on
// the host), so every tile starts on a selection-block boundary and W is the same for every
// tile. Only the last few selection blocks of a tile are shared with the next tile (blocks
// are l >= d tokens long); their sums are carried in shared memory to the next tile of the
// same CTA, everything else is final and stored plainly, and the CTA zero-fills the
// selection blocks past its last tile (zero_tail; the fused layer's selection never reads
// them: up to half of the tensor at long T): no atomics, no zero-initialised importance
// tensor, and the result does not depend on scheduling.
//
// m16 tiles per warp (kTilesPerWarp): the importance pass takes two at D=64 (128 registers,
// four CTAs of four warps per SM). The forward and dQ take one at every head_dim (eight
// warps, two CTAs per SM at D=64): with two, ptxas gave them 254 and 244 registers, so two
// CTAs of four warps per SM, and at the training shape (at most two key tiles per CTA) ncu
// found no eligible warp in 64% of the forward's cycles.
template <int D, bool kImportance>
constexpr int CmpTilesPerWarp() {
  return kImportance && D == 64 ? 2 : 1;
}
template <int D, int kTilesPerWarp = CmpTilesPerWarp<D, false>()>
struct CmpSmemCfg {
  static constexpr int kM = kTilesPerWarp;
  static constexpr int kWarps = 8 / kM;
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kRows = 16 * kM * kWarps;  // 128 rows per CTA
  static constexpr int kN = 64;                   // compressed keys per tile
  static constexpr int kTileBytes = kN * D * 2;
  static constexpr int kSbTiles = 5;          // selection-block columns per key tile / 8
  static constexpr int kXld = 8 * kSbTiles + 4;  // floats per row of staged X
  static constexpr int kMaxCarry = 4;  // selection blocks a tile shares with the next
  // Dynamic shared memory of the forward and dQ (K and V, two stages) and of the importance
  // pass. Functions, not constants: each configuration is used by one side only, and nvcc
  // warns about the other side's constants (#177-D), never about an unused function.
  static constexpr int FwdSmem() { return 2 * 2 * kTileBytes; }
  static constexpr int ImpSmem() {
    // W's B fragments, one uint2 per lane per (k16 step, n8 tile): read from shared memory
    // instead of held in 40 registers, which kept the pass at two CTAs per SM.
    constexpr int kWFragBytes = kN / 16 * kSbTiles * 32 * 8;
    return 2 * kTileBytes + kRows * kXld * 4 + 2 * kRows * kMaxCarry * 4 + kWFragBytes;
  }
};

// (a, b) as fp16 pairs hi + lo: hi rounded, lo the rounding residual.
__device__ __forceinline__ void SplitHalf2(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __half2 h = __floats2half2_rn(a, b);
  const __half2 l = __floats2half2_rn(a - __low2float(h), b - __high2float(h));
  memcpy(&hi, &h, 4);
  memcpy(&lo, &l, 4);
}

// Selection blocks a tile of kN compressed blocks can touch (W's columns).
__host__ __device__ inline int CmpTileSpan(int kN, int cmp_block, int cmp_stride, int slc_block) {
  return ((kN - 1) * cmp_stride + cmp_block - 1) / slc_block + 1;
}

// X = P W without the product, for l = 2d and l' = 4d (NSA's defaults, m7c's 32/16/64): key k
// of a tile (which starts on a selection-block boundary) covers the d-token chunks k and
// k + 1, and chunk u lies in selection block u / 4. So keys 4s, 4s + 1 and 4s + 2 add 2d p
// to block s, and key 4s + 3 adds d p to block s and d p to block s + 1. In P's C layout lane
// c of a quad holds keys 8n + 2c and 8n + 2c + 1 of each n8 tile: lanes 0-1 hold block 2n's
// keys, lanes 2-3 block 2n + 1's, and lanes 1 and 3 the keys that spill into the next
// block. Per tile and half row: one shuffle sums a block's two lanes, one more brings the
// spill in (lanes 2-3 from lane 1 of the same tile, lanes 0-1 from lane 3 of the tile
// before); lanes 0 and 2 store the block, lane 3 the tile's last spill (column 16, carried
// to the next tile as W's last column is). fp32 throughout, where the W product took P as
// two fp16 parts; it leaves the tensor cores to S and saves the hi/lo split.
__host__ __device__ inline bool QuadMapApplies(int cmp_block, int cmp_stride, int slc_block) {
  return cmp_block == 2 * cmp_stride && slc_block == 4 * cmp_stride;
}

// The quad map of one row of P: pair_at(n) gives the lane's keys 8n + 2c and 8n + 2c + 1, x
// is the row's staged X. spill (lane 3's): in, the spill of the key tile before into this
// tile's first selection block (0 for a first tile); out, the last mapped n8 tile's, which the
// caller stores (column 2 n_end) or carries on. With n_end < kNt (warp-uniform) only the first
// n_end n8 tiles are mapped (the rest of P is 0).
// kTimes2d: P holds 2 d P (the importance pass folds log2(2d) into its lse), so a key's weights
// are 1 and 1/2 and each mapped pair costs one FFMA and one FMUL; otherwise the weights 2d and
// d are the lane's constants (one FFMA and two FMULs). Either way the result is what d (2 p0
// + w p1) rounds to when d is a power of two (scaling by a power of two is exact).
template <int kNt, bool kTimes2d, typename PairAt, typename Store>
__device__ __forceinline__ void QuadMapRowTo(const PairAt& pair_at, const Store& store, float d, int lane,
                                             float& spill, int n_end = kNt) {
  constexpr unsigned kAll = 0xffffffffu;
  const int c = lane & 3;
  const bool odd = (c & 1) != 0;
  const int spill_src = (lane & ~3) | (c >= 2 ? 1 : 3);
  // own = w0 p0 + w1 p1 (the lane's block), spill = ws p1 (the next block's share of key 4s+3).
  const float w0 = kTimes2d ? 1.f : 2.f * d;
  const float w1 = kTimes2d ? (odd ? 0.5f : 1.f) : (odd ? d : 2.f * d);
  const float ws = kTimes2d ? (odd ? 0.5f : 0.f) : (odd ? d : 0.f);
  float prev_spill = spill;  // lane 3: its spill of the n8 tile before
#pragma unroll
  for (int n = 0; n < kNt; ++n) {
    if (n >= n_end) break;
    const float2 p = pair_at(n);
    const float own = kTimes2d ? fmaf(w1, p.y, p.x) : fmaf(w1, p.y, w0 * p.x);
    const float next = ws * p.y;
    const float pair = own + __shfl_xor_sync(kAll, own, 1);
    const float in = __shfl_sync(kAll, c == 3 ? prev_spill : next, spill_src);
    if (!odd) store(n, 2 * n + (c >> 1), pair + in);
    prev_spill = next;
  }
  spill = prev_spill;
}
// QuadMapRowTo with store(n, col, value) writing column col of the staged row x.
template <int kNt, bool kTimes2d, typename PairAt>
__device__ __forceinline__ void QuadMapRow(const PairAt& pair_at, float* x, float d, int lane, float& spill,
                                           int n_end = kNt) {
  QuadMapRowTo<kNt, kTimes2d>(pair_at, [x](int, int col, float value) { x[col] = value; }, d, lane, spill, n_end);
}

// The lane's rows of kTiles m16 tiles (p[0] .. p[kTiles - 1]) that are heads of one position
// (LaneRows' kLaneHeads = 2 kTiles), 2 d P: their P added first, then mapped once into the X
// row of the position's slot, the last spill in column 2 kNt. Per score, 1 / (2 kTiles) of
// the map's shuffles, selects and stores, and as few X rows for the heads' sum after it.
template <int kNt, int kTiles>
__device__ __forceinline__ void QuadMapLaneRows(const float (*p)[kNt][4], float* x_row, int lane) {
  float spill = 0.f;
  QuadMapRow<kNt, true>(
      [&](int n) {
        // The lane's keys 8n + 2c and 8n + 2c + 1 (from the first tile: 0 + x is not x for -0,
        // so a sum from 0 would cost an add the compiler must keep).
        float even = p[0][n][0] + p[0][n][2], odd = p[0][n][1] + p[0][n][3];
#pragma unroll
        for (int t = 1; t < kTiles; ++t) {
          even += p[t][n][0] + p[t][n][2];
          odd += p[t][n][1] + p[t][n][3];
        }
        return make_float2(even, odd);
      },
      x_row, /*d: unused for 2 d P*/ 0.f, lane, spill);
  if ((lane & 3) == 3) x_row[2 * kNt] = spill;
}

// The query positions a CTA of the query-side kernels (forward, importance, one pass, dQ)
// takes: grid x counts slices of positions_per_cta from the end, so the longest rows start
// first; y is the KV group, z the batch.
struct CmpCtaRows {
  int t0, grp, b, positions, rows;
  __device__ CmpCtaRows(const Shape& s, int positions_per_cta)
      : t0(static_cast<int>(gridDim.x - 1 - blockIdx.x) * positions_per_cta),
        grp(static_cast<int>(blockIdx.y)),
        b(static_cast<int>(blockIdx.z)),
        positions(min(positions_per_cta, s.T - t0)),
        rows(positions * s.hq()) {}
};

// Register budgets of the importance pass, measured on H100 at 64k: D=64 four CTAs per SM
// (128 registers, 52 bytes of spill; 164 and three CTAs without the bound), 1.90 -> 1.82 ms at
// 12:2. D=128 two CTAs (128 registers, 32 bytes of spill): with a one-CTA bound ptxas took 170
// registers and forward + importance went 5.84 -> 6.99 ms at 12:2, 29.5 -> 34.3 ms at 64:4.
// kQuadMap (importance only): X by QuadMapLaneRows over LaneRows' order of kLaneHeads heads of
// one position in a lane (2: a tile's two rows, for an even head count per group; 2 kM: all of
// the lane's rows, for a multiple of 2 kM), for the geometry QuadMapApplies to; its own
// instances, so that the W product's registers do not weigh on them. ptxas (CUDA 13.0,
// sm_90a): the D=64 and D=128 pair instances spill 20 bytes and reload 20 (24/24 and 16/16
// before the pairing; 64 and 64 at D=64 before the pass mapped 2 d P and skipped the mask on
// unmasked tiles).
template <typename scalar_t, int D, bool kImportance, bool kQuadMap = false, int kLaneHeads = 2>
__global__ void __launch_bounds__(CmpSmemCfg<D, CmpTilesPerWarp<D, kImportance>()>::kThreads,
                                  kImportance ? (D == 64 ? 4 : 2) : (D == 64 ? 2 : 1))
    CmpSmemKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                  const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                  float* __restrict__ lse, float* __restrict__ importance, Shape s,
                  int positions_per_cta, int NS, int slc_block, int cmp_block, int cmp_stride,
                  float scale_log2, bool zero_tail) {
  using Cfg = CmpSmemCfg<D, CmpTilesPerWarp<D, kImportance>()>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kKs = D / 16, kNt = kN / 8;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kStageBytes = (kImportance ? 1 : 2) * Cfg::kTileBytes;
  extern __shared__ float smem[];  // the one dynamic buffer of the file's kernels, see below
  const uint32_t smem_base = mma::SmemAddr(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int hq = s.hq();
  const CmpCtaRows cta(s, positions_per_cta);
  const int t0 = cta.t0, grp = cta.grp, b = cta.b, positions = cta.positions, rows = cta.rows;
  const bool active = 16 * kM * warp < rows;  // idle warps still copy and meet the barriers

  // The lane's rows (m16 tile m, half h) and the compressed keys each sees.
  // With the quad map a lane's rows are kLaneHeads heads of one position, whose P the map adds
  // before mapping (QuadMapLaneRows): X has a row per (position, slot of kLaneHeads heads).
  static_assert(!kQuadMap || kLaneHeads == 2 || kLaneHeads == 2 * kM, "a tile's two rows, or all a lane's");
  const smem_fwd::LaneRows<kM, kQuadMap ? kLaneHeads : 1> lr(s, b, grp, t0, rows, warp, lane);
  const int x_rows = kQuadMap ? hq / kLaneHeads : hq;  // X rows per position
  const auto& row_index = lr.index;
  const auto& row_valid = lr.valid;
  int row_vis[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      row_vis[m][h] = row_valid[m][h] ? CmpVisible(t0 + lr.pos[m][h], s.Tk, cmp_block, cmp_stride) : 0;
  uint32_t qf[kM][kKs][4];  // A fragments of Q, standard m16n8k16 layout
  smem_fwd::LoadRowFragments<D, kM>(qf, q, row_index, row_valid, lane);
  // Keys every row of the CTA sees (no mask needed below it) and keys the last row sees.
  const int vis_min = CmpVisible(t0, s.Tk, cmp_block, cmp_stride);
  const int vis_end = CmpVisible(t0 + positions - 1, s.Tk, cmp_block, cmp_stride);
  const int tiles = (vis_end + kN - 1) / kN;
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  const scalar_t* k_base = k + KeyOffset(s, b, 0, grp);
  const scalar_t* v_base = v + KeyOffset(s, b, 0, grp);
  const mma::TileCopyPlan<D, kN, Cfg::kThreads> copy_plan(static_cast<int>(kv_stride));
  const auto stage = [&](int tile) {
    const int key0 = tile * kN, count = min(kN, vis_end - key0);
    const uint32_t buf = smem_base + (tile & 1) * kStageBytes;
    copy_plan.Issue(buf, k_base + key0 * kv_stride, count);
    if constexpr (!kImportance) copy_plan.Issue(buf + Cfg::kTileBytes, v_base + key0 * kv_stride, count);
  };

  // Forward state (unused by the importance pass; the compiler drops it there).
  smem_fwd::State<D, kM> st;
  // Importance state: the lane's lse, the staged X rows, W's B fragments (fp16).
  float row_lse[kM][2];
  float* const xs = smem + 2 * Cfg::kTileBytes / 4;
  float* const carry_s = xs + Cfg::kRows * Cfg::kXld;  // [2][position][kMaxCarry]
  uint2* const w_frags = reinterpret_cast<uint2*>(carry_s + 2 * Cfg::kRows * Cfg::kMaxCarry);
  int sb_tiles = 0, carried = 0, sb_end = 0;  // sb_end: selection blocks written so far
  // Importance row of the CTA's first position; positions are G * NS floats apart.
  float* const imp_rows =
      kImportance ? importance + (static_cast<int64_t>(b) * s.T + t0) * s.G * NS + static_cast<int64_t>(grp) * NS
                  : nullptr;
  const int imp_pos_stride = s.G * NS;
  if constexpr (!kImportance) {
    st.Init();
  } else {
    // The quad map takes 2 d P (QuadMapRow's kTimes2d): exp2(S - (lse - log2(2d))).
    const float lse_shift = kQuadMap ? log2f(2.f * static_cast<float>(cmp_stride)) : 0.f;
#pragma unroll
    for (int m = 0; m < kM; ++m)
#pragma unroll
      for (int h = 0; h < 2; ++h) row_lse[m][h] = row_valid[m][h] ? lse[row_index[m][h]] - lse_shift : INFINITY;
    sb_tiles = (CmpTileSpan(kN, cmp_block, cmp_stride, slc_block) + 7) / 8;
    // Overlap in tokens of tile block j ([j d, j d + l)) with tile selection block n.
    const auto overlap = [&](int j, int n) {
      const int lo = max(j * cmp_stride, n * slc_block);
      const int hi = min(j * cmp_stride + cmp_block, (n + 1) * slc_block);
      return static_cast<float>(max(0, hi - lo));
    };
    // Every lane's fragments, [k16 step][n8 tile][lane]; the first tile's barrier publishes them.
    for (int i = threadIdx.x; i < kN / 16 * Cfg::kSbTiles * 32; i += Cfg::kThreads) {
      const int ln = i & 31, kk = i / (32 * Cfg::kSbTiles), n = (i / 32) % Cfg::kSbTiles;
      const int j = 16 * kk + 2 * (ln & 3), col = 8 * n + (ln >> 2);
      w_frags[i] = make_uint2(mma::Pack<false>(overlap(j, col), overlap(j + 1, col)),
                              mma::Pack<false>(overlap(j + 8, col), overlap(j + 9, col)));
    }
  }

  // The importance's per-tile constants (see the walk after each tile): selection blocks a
  // tile starts past the one before, those a full tile touches, and its item walk. The quad
  // map's instances only: in the product's, five more live registers raised the spills (D128
  // from 0 to 36 bytes, ptxas), and they keep the divisions of every tile.
  const int sb_per_tile = kQuadMap ? kN * cmp_stride / slc_block : 0;
  const int full_span = kQuadMap ? CmpTileSpan(kN, cmp_block, cmp_stride, slc_block) : 1;
  const int full_step_pos = Cfg::kThreads / full_span, full_step_col = Cfg::kThreads - full_step_pos * full_span;
  const int full_pos0 = static_cast<int>(threadIdx.x) / full_span,
            full_col0 = static_cast<int>(threadIdx.x) - full_pos0 * full_span;
  mma::ForEachStagedTile(tiles, stage, [&](int tile) {
    const int key0 = tile * kN;
    const uint32_t kbuf = smem_base + (tile & 1) * kStageBytes;
    if (active) {
      float sc[kM][kNt][4];
      smem_fwd::Scores<kBf16, D, kM, kN>(sc, qf, kbuf, lane);
      const bool masked = key0 + kN > vis_min;  // CTA-uniform
      if constexpr (!kImportance) {
        smem_fwd::SoftmaxPV<kBf16, D, kM, kN>(
            st, sc, kbuf + Cfg::kTileBytes, scale_log2,
            [&](int m, int h, int key) { return !masked || key0 + key < row_vis[m][h]; }, lane);
      } else {
        // P = exp2(S - lse), then X = P W into shared memory: by QuadMapLaneRows in the paper's
        // geometry, else as a product where P goes in as two fp16 parts (P = hi + lo, lo the
        // rounding residual), so X keeps ~fp32 accuracy.
        // Only a CTA's last tile holds keys some of its rows do not see: with the quad map the
        // other tiles skip the per-score mask (the product instances keep one path: two raised
        // their spills, ptxas). With the quad map P here is 2 d P (row_lse is lse - log2(2d)).
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          if (kQuadMap && !masked) {
#pragma unroll
            for (int n = 0; n < kNt; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) sc[m][n][e] = mma::Exp2(sc[m][n][e] * scale_log2 - row_lse[m][e >> 1]);
            }
          } else {
#pragma unroll
            for (int n = 0; n < kNt; ++n) {
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const int h = e >> 1, key = key0 + 8 * n + 2 * c + (e & 1);
                float& x = sc[m][n][e];
                x = (!masked || key < row_vis[m][h]) ? mma::Exp2(x * scale_log2 - row_lse[m][h]) : 0.f;
              }
            }
          }
          if constexpr (kQuadMap) {
            // Two heads a tile: each tile maps its own; all of the lane's: after the last tile.
            if constexpr (kLaneHeads == 2) {
              QuadMapLaneRows<kNt, 1>(&sc[m], xs + (8 * (kM * warp + m) + g) * Cfg::kXld, lane);
            } else if (m == kM - 1) {
              QuadMapLaneRows<kNt, kM>(sc, xs + (8 * warp + g) * Cfg::kXld, lane);
            }
          } else {
            float xa[Cfg::kSbTiles][4];
#pragma unroll
            for (int n = 0; n < Cfg::kSbTiles; ++n) xa[n][0] = xa[n][1] = xa[n][2] = xa[n][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < kN / 16; ++kk) {
              uint32_t hi[4], lo[4];
              SplitHalf2(sc[m][2 * kk][0], sc[m][2 * kk][1], hi[0], lo[0]);
              SplitHalf2(sc[m][2 * kk][2], sc[m][2 * kk][3], hi[1], lo[1]);
              SplitHalf2(sc[m][2 * kk + 1][0], sc[m][2 * kk + 1][1], hi[2], lo[2]);
              SplitHalf2(sc[m][2 * kk + 1][2], sc[m][2 * kk + 1][3], hi[3], lo[3]);
#pragma unroll
              for (int n = 0; n < Cfg::kSbTiles; ++n) {
                if (n < sb_tiles) {
                  const uint2 w = w_frags[(kk * Cfg::kSbTiles + n) * 32 + lane];
                  mma::Mma<false>(xa[n], hi[0], hi[1], hi[2], hi[3], w.x, w.y);
                  mma::Mma<false>(xa[n], lo[0], lo[1], lo[2], lo[3], w.x, w.y);
                }
              }
            }
            const int r = 16 * (kM * warp + m) + g;
#pragma unroll
            for (int n = 0; n < Cfg::kSbTiles; ++n) {
              if (n < sb_tiles) {
                *reinterpret_cast<float2*>(xs + r * Cfg::kXld + 8 * n + 2 * c) = make_float2(xa[n][0], xa[n][1]);
                *reinterpret_cast<float2*>(xs + (r + 8) * Cfg::kXld + 8 * n + 2 * c) = make_float2(xa[n][2], xa[n][3]);
              }
            }
          }
        }
      }
    }
    if constexpr (kImportance) {
      __syncthreads();  // X of every row is staged
      // A tile starts on a selection-block boundary (kN d is a multiple of l', checked on the
      // host), so a full tile's blocks are sb_lo + [0, full_span) and its item walk is the
      // same every tile (hoisted above the loop); with the quad map only the last tile divides.
      const int sb_lo = kQuadMap ? tile * sb_per_tile : key0 * cmp_stride / slc_block;
      const bool full = kQuadMap && tile + 1 < tiles && sb_lo + full_span <= NS;
      int sb_hi, ncol, step_pos, step_col, pos, col;
      if (full) {
        sb_hi = sb_lo + full_span - 1;
        ncol = full_span, step_pos = full_step_pos, step_col = full_step_col, pos = full_pos0, col = full_col0;
      } else {
        const int count = min(kN, vis_end - key0);
        sb_hi = min(NS - 1, ((key0 + count - 1) * cmp_stride + cmp_block - 1) / slc_block);
        ncol = sb_hi - sb_lo + 1;
        // Items (pos, col) = thread + k kThreads, walked without a division per item.
        step_pos = Cfg::kThreads / ncol, step_col = Cfg::kThreads - step_pos * ncol;
        pos = threadIdx.x / ncol, col = threadIdx.x - pos * ncol;
      }
      // Selection blocks from sb_next on get more from the next tile: carry them.
      const int sb_next =
          tile + 1 < tiles ? (kQuadMap ? sb_lo + sb_per_tile : (key0 + kN) * cmp_stride / slc_block) : sb_hi + 1;
      const float* carry_in = carry_s + (tile & 1) * Cfg::kRows * Cfg::kMaxCarry;
      float* carry_out = carry_s + ((tile + 1) & 1) * Cfg::kRows * Cfg::kMaxCarry;
      while (pos < positions) {
        const float* x = xs + pos * x_rows * Cfg::kXld + col;
        float sum = col < carried ? carry_in[pos * Cfg::kMaxCarry + col] : 0.f;
        for (int h = 0; h < x_rows; ++h) sum += x[h * Cfg::kXld];
        const int sb = sb_lo + col;
        if (sb < sb_next)
          imp_rows[static_cast<int64_t>(pos) * imp_pos_stride + sb] = sum;
        else
          carry_out[pos * Cfg::kMaxCarry + sb - sb_next] = sum;
        pos += step_pos;
        col += step_col;
        if (col >= ncol) {
          col -= ncol;
          ++pos;
        }
      }
      carried = sb_hi + 1 - sb_next;
      sb_end = sb_next;
    }
  });
  if (kImportance && zero_tail) {
    // Selection blocks no visible compressed block overlaps.
    const int ncol = NS - sb_end;
    for (int i = threadIdx.x; i < positions * ncol; i += Cfg::kThreads) {
      const int pos = i / ncol, col = i - pos * ncol;
      imp_rows[static_cast<int64_t>(pos) * imp_pos_stride + sb_end + col] = 0.f;
    }
  }

  if constexpr (!kImportance) smem_fwd::Finish<kBf16, D, kM>(st, out, lse, row_index, row_valid, lane);
}

// The importance pass with all of a position's heads in one lane, for an even head count per
// group up to 2 kMaxLaneTiles at head_dim 64 in the paper's geometry (QuadMapApplies): lane
// (g, c) of warp w holds position 8 w + g of the CTA, head 2 m + h in row g + 8 h of its m16
// tile m (kM = hq / 2 tiles). Per n8 tile of keys the lane adds its 2 kM rows' 2 d P (one
// visibility test for all of them: they share the position) and maps the sum once
// (QuadMapRowTo), so each quad's map is the position's final importance: stored straight to
// global memory, the spill into the next key tile's first selection block carried in lane 3's
// register. Against CmpSmemKernel's quad map (a lane's two heads, X rows staged in shared
// memory and the group's heads summed after a barrier every tile) that drops the staging,
// the per-tile barrier and summation walk, and 1 - 1/kM of the map's shuffles, selects and
// stores; Q stays in registers (kM D / 4 of them). ncu, H200, 64k D64 12:2 (kM = 3): 1.21 ->
// 0.984 ms, 725 M -> 310 M warp instructions; it now waits on latency (16 warps an SM: four
// CTAs' budget of 128 registers, 124 used, no spill; XU pipe 45% busy). Measured and not kept:
// five CTAs (96 registers, 36 bytes spilled) 1.01 ms, four n8 tiles' scores at a time 0.994 ms.
constexpr int kMaxLaneTiles = 4;

// The lane importance kernels' stores of a key tile's map: lanes 0 and 2 of each quad hold the
// position's selection blocks sb_lo + 2j + c / 2 (QuadMapRowTo's columns).
template <int kNt>
__device__ __forceinline__ void StoreLaneColumns(const float (&xv)[kNt], float* imp_row, int sb_lo, int NS,
                                                 bool valid, int c) {
  if (!valid || (c & 1) != 0) return;
  float* const dst = imp_row + sb_lo + (c >> 1);
  if (sb_lo + 2 * kNt <= NS) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) dst[2 * j] = xv[j];
  } else {
#pragma unroll
    for (int j = 0; j < kNt; ++j) {
      if (sb_lo + 2 * j + (c >> 1) < NS) dst[2 * j] = xv[j];
    }
  }
}
// StoreLaneColumns through the warp's 8 rows of 20 floats of shared memory (a row stride of 20
// keeps the quads' writes on distinct banks): lanes 0 and 2 of each quad put the position's 16
// values of the tile there, then every lane stores 4 of them, one 16-byte store where the
// importance rows are 16-byte aligned (NS % 4 == 0), instead of 8 stores of 4 bytes from half
// the lanes. The warpgroup-MMA kernel's stores, ncu, H200, 64k 12:2 (forty-second session):
// D = 64 928 -> 881 us, D = 128 1.21 -> 1.10 ms (its stall samples had 12.5% at the stores,
// thirty-sixth session).
template <int kNt>
__device__ __forceinline__ void StoreLaneColumnsStaged(const float (&xv)[kNt], float* warp_stage, float* imp_row,
                                                       int sb_lo, int NS, bool valid, int lane) {
  static_assert(kNt == 8, "16 selection blocks a key tile");
  const int c = lane & 3;
  float* const row = warp_stage + 20 * (lane >> 2);
  if ((c & 1) == 0) {
#pragma unroll
    for (int j = 0; j < kNt; ++j) row[2 * j + (c >> 1)] = xv[j];
  }
  __syncwarp();
  const float4 v = *reinterpret_cast<const float4*>(row + 4 * c);
  __syncwarp();  // every lane has read before the next tile's values come in
  if (!valid) return;
  float* const dst = imp_row + sb_lo + 4 * c;
  if ((NS & 3) == 0 && sb_lo + 16 <= NS) {
    *reinterpret_cast<float4*>(dst) = v;
  } else {
    const float e[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (sb_lo + 4 * c + k < NS) dst[k] = e[k];
    }
  }
}
// After the last key tile: lane 3's spill into the block past it, then (zero_tail) zeros up to NS.
// A causal row's tail is half the importance tensor on average (256 MB at 64k, 2 groups). Where
// the rows are 16-byte aligned (NS % 4 == 0) a quad zeroes 64 contiguous bytes a store, one
// float4 a lane, after up to 3 single floats; else one float a lane. The warpgroup-MMA kernel,
// ncu, H200, 64k 12:2 (forty-second session): D = 64 877 -> 643-652 us, D = 128 1.10 -> 0.88 ms,
// against one float a lane (8 rows of 16 bytes a store: 32% of its L2 sectors excessive).
__device__ __forceinline__ void FinishLaneRow(float* imp_row, int spill_block, float spill, int NS, bool valid,
                                              int c, bool zero_tail) {
  if (valid && c == 3 && spill_block < NS) imp_row[spill_block] = spill;
  if (!valid || !zero_tail) return;
  const int first = spill_block + 1;
  if ((NS & 3) == 0) {
    const int aligned = min((first + 3) & ~3, NS);
    if (first + c < aligned) imp_row[first + c] = 0.f;
    for (int sb = aligned + 4 * c; sb < NS; sb += 16) {
      *reinterpret_cast<float4*>(imp_row + sb) = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    return;
  }
  for (int sb = first + c; sb < NS; sb += 4) imp_row[sb] = 0.f;
}

// A lane importance kernel's thread: lane (g, c) of warp w holds position 8 w + g of its CTA
// (t; the CTA's first position where that is past its end, then not valid) and the compressed
// keys that position sees (vis; 0 where not valid).
struct LanePosition {
  CmpCtaRows cta;
  int lane;
  bool valid;
  int t, vis;
  __device__ LanePosition(const Shape& s, int positions_per_cta, int cmp_block, int cmp_stride)
      : cta(s, positions_per_cta), lane(static_cast<int>(threadIdx.x) & 31) {
    const int pos = 8 * (static_cast<int>(threadIdx.x) >> 5) + (lane >> 2);
    valid = pos < cta.positions;
    t = cta.t0 + (valid ? pos : 0);
    vis = valid ? CmpVisible(t, s.Tk, cmp_block, cmp_stride) : 0;
  }
};

// A lane importance kernel's walk over compressed keys: kN-key tiles up to the CTA's last
// position's visible end, copied with cp.async into kBuffers (two, or one) buffers of kN D
// elements at `buffers` (rows past the end zero-filled), and the lane's position's importance
// row. kWgmmaHalves: each tile as D / 64 [kN][64] pieces in the 128-byte swizzle, kN * 64 * 2
// bytes apart (the warpgroup kernel's K-major operand; one piece at D = 64, the same layout as
// without).
template <typename scalar_t, int D, int kN, int kThreads, bool kWgmmaHalves = false, int kBuffers = 2>
struct LaneKeyTiles {
  static_assert(kBuffers == 1 || kBuffers == 2, "one or two key buffers");
  static constexpr uint32_t kTileBytes = kN * D * 2;
  static constexpr int kCols = kWgmmaHalves ? 64 : D;  // columns of one staged piece
  int vis_min, vis_end, tiles;  // the CTA's first and last positions' visible keys; tiles to walk
  int64_t kv_stride;
  const scalar_t* k_base;
  mma::TileCopyPlan<kCols, kN, kThreads> plan;
  uint32_t buffers;
  __device__ LaneKeyTiles(const scalar_t* k, const Shape& s, const CmpCtaRows& cta, int cmp_block, int cmp_stride,
                          uint32_t buffers_)
      : vis_min(CmpVisible(cta.t0, s.Tk, cmp_block, cmp_stride)),
        vis_end(CmpVisible(cta.t0 + cta.positions - 1, s.Tk, cmp_block, cmp_stride)),
        tiles((vis_end + kN - 1) / kN),
        kv_stride(static_cast<int64_t>(s.G) * D),
        k_base(k + KeyOffset(s, cta.b, 0, cta.grp)),
        plan(static_cast<int>(kv_stride)),
        buffers(buffers_) {}
  // Tile `tile`'s copy (the caller commits) and its buffer.
  __device__ void Stage(int tile) const {
    const int key0 = tile * kN;
#pragma unroll
    for (int piece = 0; piece < D / kCols; ++piece) {
      plan.Issue(Buffer(tile) + piece * kN * kCols * 2, k_base + key0 * kv_stride + piece * kCols,
                 min(kN, vis_end - key0));
    }
  }
  __device__ uint32_t Buffer(int tile) const { return buffers + (kBuffers == 2 ? (tile & 1) * kTileBytes : 0u); }
};
// Position t's importance row of the CTA's (b, group): NS selection blocks.
__device__ __forceinline__ float* LaneImportanceRow(float* importance, const Shape& s, const CmpCtaRows& cta, int t,
                                                    int NS) {
  return importance + ((static_cast<int64_t>(cta.b) * s.T + t) * s.G + cta.grp) * NS;
}

template <int D>
struct CmpLaneImpCfg {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kPositions = 8 * kWarps;  // per CTA
  static constexpr int kN = 64;                  // compressed keys per tile
  static constexpr int kTileBytes = kN * D * 2;
  static constexpr int kSmem = 2 * kTileBytes;   // K, two stages
};

// kScoreGroup: n8 tiles whose scores are computed before their exponentials (independent
// MMA chains in flight). One at a time, with the stores inside the map: 1.05 ms (ncu above).
template <typename scalar_t, int D, int kM, int kScoreGroup = 2>
__global__ void __launch_bounds__(CmpLaneImpCfg<D>::kThreads, 4)
    CmpImportanceLaneKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                            const float* __restrict__ lse, float* __restrict__ importance, Shape s, int NS,
                            int cmp_block, int cmp_stride, float scale_log2, bool zero_tail) {
  using Cfg = CmpLaneImpCfg<D>;
  constexpr int kN = Cfg::kN, kNt = kN / 8;
  constexpr int kBlocksPerTile = kN / 4;  // kN d / l' with l' = 4 d
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float smem[];
  const uint32_t smem_base = mma::SmemAddr(smem);
  const LanePosition lp(s, Cfg::kPositions, cmp_block, cmp_stride);
  const CmpCtaRows& cta = lp.cta;
  const int lane = lp.lane, c = lane & 3, t = lp.t, vis = lp.vis;
  const bool valid = lp.valid;
  int64_t row_index[kM][2];
  bool row_valid[kM][2];
  float row_lse[kM][2];  // lse - log2(2d): P arrives as 2 d P (QuadMapRow's kTimes2d)
  const float lse_shift = log2f(2.f * static_cast<float>(cmp_stride));
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_index[m][h] = (static_cast<int64_t>(cta.b) * s.T + t) * s.H + cta.grp * s.hq() + 2 * m + h;
      row_valid[m][h] = valid;
      row_lse[m][h] = valid ? lse[row_index[m][h]] - lse_shift : INFINITY;
    }
  }
  uint32_t qf[kM][D / 16][4];
  smem_fwd::LoadRowFragments<D, kM>(qf, q, row_index, row_valid, lane);

  const LaneKeyTiles<scalar_t, D, kN, Cfg::kThreads> keys(k, s, cta, cmp_block, cmp_stride, smem_base);
  float* const imp_row = LaneImportanceRow(importance, s, cta, t, NS);
  float spill = 0.f;  // lane 3: the last mapped n8 tile's share of the next selection block
  mma::ForEachStagedTile(keys.tiles, [&](int tile) { keys.Stage(tile); }, [&](int tile) {
    const int key0 = tile * kN, sb_lo = tile * kBlocksPerTile;
    const uint32_t kbuf = keys.Buffer(tile);
    const bool masked = key0 + kN > keys.vis_min;  // CTA-uniform: only a CTA's last tiles
    // Scores of kScoreGroup n8 tiles at a time (independent MMA chains in flight), summed over
    // the lane's rows, then mapped; the lane's columns 2n + c / 2 are stored after the map.
    float2 pairs[kScoreGroup];
    float xv[kNt];
    QuadMapRowTo<kNt, true>(
        [&](int n) {
          if (n % kScoreGroup == 0) {
            float sc[kScoreGroup][kM][4];
#pragma unroll
            for (int i = 0; i < kScoreGroup; ++i) smem_fwd::ScoresN8<kBf16, D, kM>(sc[i], qf, kbuf, n + i, lane);
#pragma unroll
            for (int i = 0; i < kScoreGroup; ++i) {
              // The lane's keys 8n + 2c (even) and + 1 (odd), summed over its rows (from the first:
              // 0 + x is not x for -0, so a sum from 0 would cost an add the compiler must keep).
              float even = 0.f, odd = 0.f;
#pragma unroll
              for (int m = 0; m < kM; ++m) {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) p[e] = mma::Exp2(sc[i][m][e] * scale_log2 - row_lse[m][e >> 1]);
                if (m == 0) {
                  even = p[0] + p[2];
                  odd = p[1] + p[3];
                } else {
                  even += p[0] + p[2];
                  odd += p[1] + p[3];
                }
              }
              if (masked) {  // the keys past the position's last visible block (a select: NaN-safe)
                const int key = key0 + 8 * (n + i) + 2 * c;
                even = key < vis ? even : 0.f;
                odd = key + 1 < vis ? odd : 0.f;
              }
              pairs[i] = make_float2(even, odd);
            }
          }
          return pairs[n % kScoreGroup];
        },
        [&](int n, int, float value) { xv[n] = value; }, /*d: unused for 2 d P*/ 0.f, lane, spill);
    StoreLaneColumns(xv, imp_row, sb_lo, NS, valid, c);
  });
  FinishLaneRow(imp_row, keys.tiles * kBlocksPerTile, spill, NS, valid, c, zero_tail);
}

// CmpImportanceLaneKernel on warpgroup MMAs (sm_90a, head_dim 64 or 128): the same lanes, rows and map,
// one warpgroup (32 positions) per CTA, and S = Q K^T of head pair m (kM of them) as one m64n64
// product per k16 step with both operands in shared memory. Q's kM tiles are staged once per CTA,
// row r of tile m holding position 8 (r / 16) + r % 8, head 2 m + (r / 8) % 2 (the accumulator
// layout then puts each lane's rows where CmpImportanceLaneKernel has them), so Q takes no
// registers there (48 at kM = 3 held that kernel at 16 warps an SM, latency-bound), and a head
// pair's scores are 4 instructions a key tile instead of 32 HMMA and a share of 16 ldmatrix.
// ncu, H200, 64k D64 12:2 (kM = 3): 0.976 ms on mma.sync -> 0.924-0.929 ms, 310 M -> 281 M warp
// instructions, 94 registers, five CTAs an SM; still latency-bound (issue 33% active, XU 48%).
// Not kept: head pair m + 1's product issued before pair m's exponentials (two accumulator
// sets, 126 registers, four CTAs): 0.932 ms.
// At D = 128 every Q and K tile is two [64][64] halves (as the selected dK/dV kernel stages
// them), eight k16 steps a product. H200, 64k 12:2 D128 (fortieth session), with two K buffers
// (81 KB at kM = 3, two CTAs an SM, 137 registers): 1.30 ms in ncu, 12.4% of warps active,
// 0.34 warps eligible a scheduler; nsa_bench's `cmp` column 3.88-3.94 ms with the staged-rows
// kernel it replaces (--cmp-map slots), 2.95-2.98 ms with it. So at D = 128 the K tiles take
// one buffer (65 KB, three CTAs an SM; 162 registers, no spill): a tile's copy waits for the last
// head pair's product and runs under that pair's exponentials and map, and the third CTA fills
// the rest: 1.21 ms in ncu, 18.5% of warps active, 0.48 eligible; `cmp` 2.84 ms. D = 64 takes one
// buffer too (33 KB, six CTAs an SM, 79 registers against 94 and five CTAs with two): 912-927
// us in ncu at 64k 12:2 (forty-first session, five launches) against 924-929 with two, the
// same time for less code. Not kept there: a quarter of the exponentials on the FMA pipe (2^x
// as a degree-5 polynomial with the exponent added into its bits, as FlashAttention-4 offloads
// the SFU; the XU pipe 48% -> 36% busy, issue 33% -> 46%) ran 925-927 us, half of them 1.02 ms
// (D = 128: 1.29 and 1.40 ms against 1.20). That was with each row's zero tail still stored
// 4 bytes a lane (15% of the stall samples); with the tail in float4s (FinishLaneRow) the
// exponentials hold half of the D = 64 kernel's stall samples (forty-second session), so the
// offload is to be measured again (branch wip/imp-exp-fma2).
template <int D>
struct CmpLaneWgmmaCfg {
  static_assert(D == 64 || D == 128, "head_dim 64 or 128");
  static constexpr int kD = D, kThreads = wgmma::kWarpgroupThreads, kPositions = 32, kN = 64;
  static constexpr int kTileBytes = 64 * kD * 2;  // a Q tile (64 rows) or a K tile (64 keys): 8 or 16 KB
  static constexpr uint32_t kHalfBytes = 64 * 64 * 2;  // one [64][64] half of a tile
  static constexpr int kMinCtas = D == 64 ? 6 : 3;
  // Dynamic shared memory is only 16-byte aligned; the tiles start at the next 1 KB (the swizzle).
  static constexpr int kAlignSlack = static_cast<int>(wgmma::kSwizzleBytes);
  static constexpr int kStoreStageBytes = 4 * 8 * 20 * 4;  // StoreLaneColumnsStaged's rows, 4 warps
  // One K tile, kM Q tiles, then the store stage.
  static constexpr int Smem(int kM) { return kAlignSlack + (1 + kM) * kTileBytes + kStoreStageBytes; }
  // k16 step kk's byte offset in a K-major tile: half kk / 4, 16 columns further per step.
  static constexpr uint32_t StepOffset(int kk) { return (kk / 4) * kHalfBytes + wgmma::kKMajorStepBytes * (kk % 4); }
};

template <typename scalar_t, int D, int kM>
__global__ void __launch_bounds__(CmpLaneWgmmaCfg<D>::kThreads, CmpLaneWgmmaCfg<D>::kMinCtas)
    CmpImportanceLaneWgmmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                                 const float* __restrict__ lse, float* __restrict__ importance, Shape s, int NS,
                                 int cmp_block, int cmp_stride, float scale_log2, bool zero_tail) {
  using Cfg = CmpLaneWgmmaCfg<D>;
  constexpr int kN = Cfg::kN, kNt = kN / 8;
  constexpr int kBlocksPerTile = kN / 4;  // kN d / l' with l' = 4 d
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float4 lane_wgmma_smem[];  // [slack][one K tile][kM Q tiles][store stage]
  const uint32_t raw = mma::SmemAddr(lane_wgmma_smem);
  const uint32_t k_tiles = (raw + Cfg::kAlignSlack - 1) & ~static_cast<uint32_t>(Cfg::kAlignSlack - 1);
  const uint32_t q_tiles = k_tiles + Cfg::kTileBytes;
  const LanePosition lp(s, Cfg::kPositions, cmp_block, cmp_stride);
  const CmpCtaRows& cta = lp.cta;
  const int lane = lp.lane, c = lane & 3, t = lp.t, vis = lp.vis;
  const bool valid = lp.valid;
  const int64_t head0 = (static_cast<int64_t>(cta.b) * s.T + t) * s.H + cta.grp * s.hq();
  float row_lse[kM][2];  // lse - log2(2d): P arrives as 2 d P (QuadMapRow's kTimes2d)
  const float lse_shift = log2f(2.f * static_cast<float>(cmp_stride));
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) row_lse[m][h] = valid ? lse[head0 + 2 * m + h] - lse_shift : INFINITY;
  }
  const LaneKeyTiles<scalar_t, D, kN, Cfg::kThreads, true, 1> keys(k, s, cta, cmp_block, cmp_stride, k_tiles);
  // Q's tiles, in the first tile's copy group (positions past the CTA's are zero rows); 16-byte
  // chunk `chunk` of a row goes to half chunk / 8.
  for (int i = static_cast<int>(threadIdx.x); keys.tiles > 0 && i < kM * 64 * (D / 8); i += Cfg::kThreads) {
    const int m = i / (64 * (D / 8)), r = (i / (D / 8)) % 64, chunk = i % (D / 8);
    const int p = 8 * (r / 16) + r % 8, head = 2 * m + (r / 8) % 2;
    const bool ok = p < cta.positions;
    const scalar_t* src =
        q + ((static_cast<int64_t>(cta.b) * s.T + cta.t0 + (ok ? p : 0)) * s.H + cta.grp * s.hq() + head) * D +
        chunk * 8;
    const uint32_t dst = m * Cfg::kTileBytes + (chunk / 8) * Cfg::kHalfBytes + mma::SwizzledOffset<64>(r, chunk % 8);
    mma::CpAsync16(q_tiles + dst, src, ok);
  }
  float* const imp_row = LaneImportanceRow(importance, s, cta, t, NS);
  // This warp's 8 rows of StoreLaneColumnsStaged, past the Q tiles.
  float* const warp_stage = reinterpret_cast<float*>(reinterpret_cast<unsigned char*>(lane_wgmma_smem) +
                                                     (q_tiles - raw) + kM * Cfg::kTileBytes) +
                            8 * 20 * (static_cast<int>(threadIdx.x) >> 5);
  const uint64_t q_desc = wgmma::KMajorTile(q_tiles), k_desc = wgmma::KMajorTile(k_tiles);
  float spill = 0.f;  // lane 3: the last mapped n8 tile's share of the next selection block
  // Tile `tile`'s products, exponentials, map and stores; products_done() runs once the last
  // head pair's product has left the K tile (CTA-uniform: it holds a barrier, being
  // the one-buffer ForEachStagedTile's refill).
  const auto body = [&](int tile, const auto& products_done) {
    const int key0 = tile * kN, sb_lo = tile * kBlocksPerTile;
    // The lane's keys 8j + 2c (even) and + 1 (odd) of n8 tile j, summed over its rows.
    float even[kNt], odd[kNt];
#pragma unroll
    for (int m = 0; m < kM; ++m) {
      float sc[kNt][4];  // the first step overwrites: no zeroing
      wgmma::Fence();
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        const uint64_t a = wgmma::Advance(q_desc, m * Cfg::kTileBytes + Cfg::StepOffset(kk));
        const uint64_t b = wgmma::Advance(k_desc, Cfg::StepOffset(kk));
        if (kk == 0) {
          wgmma::MmaM64N64K16Smem<kBf16, false, false, true>(sc, a, b);
        } else {
          wgmma::MmaM64N64K16Smem<kBf16, false, false>(sc, a, b);
        }
      }
      wgmma::Commit();
      wgmma::Wait<0>();
      wgmma::FenceRegisters(sc);
      if (m == kM - 1) products_done();
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        float p[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) p[e] = mma::Exp2(sc[j][e] * scale_log2 - row_lse[m][e >> 1]);
        // From the first head pair: 0 + x is not x for -0, so a sum from 0 costs an add.
        even[j] = m == 0 ? p[0] + p[2] : even[j] + (p[0] + p[2]);
        odd[j] = m == 0 ? p[1] + p[3] : odd[j] + (p[1] + p[3]);
      }
    }
    if (key0 + kN > keys.vis_min) {  // CTA-uniform: the keys past the position's last visible block
#pragma unroll
      for (int j = 0; j < kNt; ++j) {
        const int key = key0 + 8 * j + 2 * c;
        even[j] = key < vis ? even[j] : 0.f;
        odd[j] = key + 1 < vis ? odd[j] : 0.f;
      }
    }
    float xv[kNt];
    QuadMapRowTo<kNt, true>([&](int j) { return make_float2(even[j], odd[j]); },
                            [&](int j, int, float value) { xv[j] = value; }, /*d: unused for 2 d P*/ 0.f,
                            lane, spill);
    StoreLaneColumnsStaged(xv, warp_stage, imp_row, sb_lo, NS, valid, lane);
  };
  // The next tile's copy starts once every warp's last product has read this one; the proxy
  // fence makes the tile (and Q) visible to the tensor cores after the barrier.
  mma::ForEachStagedTile</*kOneBuffer=*/true>(keys.tiles, [&](int tile) { keys.Stage(tile); }, body,
                                              [] { wgmma::FenceProxyAsync(); });
  FinishLaneRow(imp_row, keys.tiles * kBlocksPerTile, spill, NS, valid, c, zero_tail);
}

// The forward and the importance in one pass, where every compressed block fits two kN-key
// tiles (s.Tk <= 128: T <= 2064 in m7c's geometry, whose training shape has 127 blocks), at
// head_dim 64 in the paper's geometry (QuadMapRow). Two passes compute every score and
// exponential twice: the importance needs the final row sums. With at most 128 keys a lane
// holds all of its rows' scores (two tiles of one m16 tile: 64 floats), so the row max and sum
// are exact before any P is used, and P = exp2(S - max) / sum serves both the map onto
// selection blocks and O = P V (P normalised first, so O needs no division). Both tiles' K and
// V are staged at once, next to the X rows the map writes. 128 rows per CTA as the two-pass
// kernels, one m16 tile per warp.
struct CmpOnePassCfg {
  static constexpr int kD = 64, kN = 64, kTiles = 2;
  static constexpr int kWarps = 8, kThreads = 32 * kWarps, kRows = 16 * kWarps;
  static constexpr int kTileBytes = kN * kD * 2;
  // Selection blocks per key tile in the paper's geometry (kN d / l' with l' = 4d), and the
  // columns of a row's X: kTiles of them plus the last tile's spill, padded.
  static constexpr int kBlocksPerTile = kN / 4;
  static constexpr int kXld = kTiles * kBlocksPerTile + 4;
  static constexpr int kKvBytes = 2 * kTiles * kTileBytes;
  static constexpr int kSmem = kKvBytes + kRows * kXld * 4;
};

template <typename scalar_t>
__global__ void __launch_bounds__(CmpOnePassCfg::kThreads, 2)
    CmpOnePassKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                     const scalar_t* __restrict__ v, scalar_t* __restrict__ out, float* __restrict__ lse,
                     float* __restrict__ importance, Shape s, int positions_per_cta, int NS, int cmp_block,
                     int cmp_stride, float scale_log2) {
  using Cfg = CmpOnePassCfg;
  constexpr int D = Cfg::kD, kN = Cfg::kN, kNt = kN / 8;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  extern __shared__ float smem[];
  const uint32_t smem_base = mma::SmemAddr(smem);
  float* const xs = smem + Cfg::kKvBytes / 4;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int hq = s.hq();
  const CmpCtaRows cta(s, positions_per_cta);
  const int t0 = cta.t0, grp = cta.grp, b = cta.b, positions = cta.positions, rows = cta.rows;

  // A lane's two rows are two heads of one position (LaneRows' kLaneHeads = 2; UseOnePass needs
  // an even head count per group): the map adds their P (QuadMapRow), X has a row per head pair.
  const smem_fwd::LaneRows<1, 2> lr(s, b, grp, t0, rows, warp, lane);
  const int x_rows = hq / 2;  // X rows per position
  int row_vis[2];
#pragma unroll
  for (int h = 0; h < 2; ++h)
    row_vis[h] = lr.valid[0][h] ? CmpVisible(t0 + lr.pos[0][h], s.Tk, cmp_block, cmp_stride) : 0;
  const int vis_end = CmpVisible(t0 + positions - 1, s.Tk, cmp_block, cmp_stride);
  const int tiles = (vis_end + kN - 1) / kN;  // <= kTiles (the host checks s.Tk)

  // Both tiles at once (buffer t: K then V); Q's fragments load meanwhile.
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  const scalar_t* k_base = k + KeyOffset(s, b, 0, grp);
  const scalar_t* v_base = v + KeyOffset(s, b, 0, grp);
  const mma::TileCopyPlan<D, kN, Cfg::kThreads> copy_plan(static_cast<int>(kv_stride));
  for (int tile = 0; tile < tiles; ++tile) {
    const int key0 = tile * kN, count = min(kN, vis_end - key0);
    const uint32_t buf = smem_base + tile * 2 * Cfg::kTileBytes;
    copy_plan.Issue(buf, k_base + key0 * kv_stride, count);
    copy_plan.Issue(buf + Cfg::kTileBytes, v_base + key0 * kv_stride, count);
  }
  mma::CpAsyncCommit();
  uint32_t qf[1][D / 16][4];
  smem_fwd::LoadRowFragments<D, 1>(qf, q, lr.index, lr.valid, lane);
  mma::CpAsyncWaitAll();
  __syncthreads();

  // CTA-uniform bounds, in n8 tiles (8 keys) over both key tiles: those holding a key the
  // CTA's last position sees (the rest is never computed: P = 0 there), and those whose keys
  // its first position sees all of (no mask). Every branch on them is taken by the whole CTA,
  // so the shuffles below stay convergent. A CTA's last tile holds 1-64 of its keys; at the
  // training shape (T = 2048, 21 positions a CTA) the bound skips 17% of the score MMAs (32-key
  // steps) and 29% of the per-score softmax and map work (n8 tiles), counted from the geometry.
  constexpr int kNtAll = Cfg::kTiles * kNt;
  const int nt_used = (vis_end + 7) / 8;
  const int nt_full = CmpVisible(t0, s.Tk, cmp_block, cmp_stride) / 8;

  // A warp past the CTA's rows (the last slice of positions) computes on its zero rows and
  // stores nothing: no branch on the warp around the shuffles.
  // Raw scores, -inf where the row does not see the key; computed 32 keys at a time (four
  // independent MMA chains between branches), masked and maxed per used n8 tile.
  constexpr int kNtStep = 4;
  float sc[Cfg::kTiles][1][kNt][4];
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int tile = 0; tile < Cfg::kTiles; ++tile) {
#pragma unroll
    for (int n0 = 0; n0 < kNt; n0 += kNtStep) {
      if (tile * kNt + n0 >= nt_used) break;
      float acc[kNtStep][1][4];
#pragma unroll
      for (int j = 0; j < kNtStep; ++j)
        smem_fwd::ScoresN8<kBf16, D, 1>(acc[j], qf, smem_base + tile * 2 * Cfg::kTileBytes, n0 + j, lane);
#pragma unroll
      for (int j = 0; j < kNtStep; ++j) {
        const int nt = tile * kNt + n0 + j;
        if (nt >= nt_used) break;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, key = 8 * nt + 2 * c + (e & 1);
          float& x = sc[tile][0][n0 + j][e];
          x = nt < nt_full || key < row_vis[h] ? acc[j][0][e] : -INFINITY;
          mx[h] = fmaxf(mx[h], x);
        }
      }
    }
  }
  // Exact row max and sum (log2 units), then P normalised in place; 0 past nt_used.
  float base[2], sum[2] = {0.f, 0.f}, inv[2], row_lse[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m = mma::QuadMax(mx[h]) * scale_log2;  // scale_log2 > 0 keeps the order
    base[h] = m == -INFINITY ? 0.f : m;                 // a row that sees nothing: p = 0
  }
#pragma unroll
  for (int nt = 0; nt < kNtAll; ++nt) {
    float(&x)[4] = sc[nt / kNt][0][nt % kNt];
    if (nt < nt_used) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        x[e] = mma::Exp2(fmaf(x[e], scale_log2, -base[e >> 1]));
        sum[e >> 1] += x[e];
      }
    } else {
      x[0] = x[1] = x[2] = x[3] = 0.f;
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const mma::RowFinish row = mma::FinishRow(base[h], mma::QuadSum(sum[h]));
    inv[h] = row.inv;
    row_lse[h] = row.lse;
  }
#pragma unroll
  for (int nt = 0; nt < kNtAll; ++nt) {
    if (nt >= nt_used) break;
#pragma unroll
    for (int e = 0; e < 4; ++e) sc[nt / kNt][0][nt % kNt][e] *= inv[e >> 1];
  }

  // Importance: the two heads' P onto selection blocks, the spill of tile 0's last key carried
  // into tile 1; the last mapped n8 tile's spill goes to column 2 nt_used.
  float* const x_row = xs + (8 * warp + g) * Cfg::kXld;
  float carry = 0.f;
  const float overlap_d = static_cast<float>(cmp_stride);
#pragma unroll
  for (int tile = 0; tile < Cfg::kTiles; ++tile) {
    const int n_end = min(kNt, nt_used - tile * kNt);
    const auto& p = sc[tile][0];
    if (n_end > 0)
      QuadMapRow<kNt, false>([&](int n) { return make_float2(p[n][0] + p[n][2], p[n][1] + p[n][3]); },
                             x_row + tile * Cfg::kBlocksPerTile, overlap_d, lane, carry, n_end);
  }
  if (c == 3 && nt_used > 0) x_row[2 * nt_used] = carry;

  // O = P V over the 16-key steps that hold a used n8 tile, then the rows and their lse.
  float o[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
#pragma unroll
  for (int tile = 0; tile < Cfg::kTiles; ++tile) {
    const uint32_t vbuf = smem_base + tile * 2 * Cfg::kTileBytes + Cfg::kTileBytes;
#pragma unroll
    for (int kk = 0; kk < kN / 16; ++kk) {
      if (tile * kNt + 2 * kk >= nt_used) break;
      uint32_t a[4];
      mma::PackA<kBf16>(a, sc[tile][0][2 * kk], sc[tile][0][2 * kk + 1]);
#pragma unroll
      for (int p = 0; p < D / 16; ++p) {
        uint32_t vb[4];
        mma::LdMatrixX4Trans(vb, vbuf + mma::SwizzledOffset<D>(16 * kk + (lane & 7) + (lane & 8), 2 * p + (lane >> 4)));
        mma::Mma<kBf16>(o[2 * p], a[0], a[1], a[2], a[3], vb[0], vb[1]);
        mma::Mma<kBf16>(o[2 * p + 1], a[0], a[1], a[2], a[3], vb[2], vb[3]);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!lr.valid[0][h]) continue;
    uint32_t* orow = reinterpret_cast<uint32_t*>(out + lr.index[0][h] * D);
#pragma unroll
    for (int i = 0; i < D / 8; ++i) orow[4 * i + c] = mma::Pack<kBf16>(o[i][2 * h], o[i][2 * h + 1]);
    if (c == 0) lse[lr.index[0][h]] = row_lse[h];
  }
  __syncthreads();  // every row's X is staged

  // The group's heads summed per (position, selection block) in a fixed order; blocks past
  // the columns the map wrote (no visible compressed block reaches them) are 0.
  const int written = nt_used == 0 ? 0 : 2 * nt_used + 1;
  float* const imp_rows =
      importance + (static_cast<int64_t>(b) * s.T + t0) * s.G * NS + static_cast<int64_t>(grp) * NS;
  for (int i = threadIdx.x; i < positions * NS; i += Cfg::kThreads) {
    const int pos = i / NS, sb = i - pos * NS;
    float total = 0.f;
    if (sb < written) {
      const float* x = xs + pos * x_rows * Cfg::kXld + sb;
      for (int h = 0; h < x_rows; ++h) total += x[h * Cfg::kXld];
    }
    imp_rows[static_cast<int64_t>(pos) * s.G * NS + sb] = total;
  }
}

// dQ with shared-memory K/V tiles, the same CTA shape and staging as CmpSmemKernel's
// forward. Per 16-key step: S = Q K^T and dP = dO V^T (ldmatrix of K / V rows),
// dS = P (dP - delta) with P = exp2(S - lse), dQ += dS K (ldmatrix.trans of the same K
// rows). Working in 16-key steps keeps S / dP small, so two m16 tiles per warp fit at D=64.
// dq_t: scalar_t, or float32 to start a float32 sum of several branches' dq (written, not
// added; CompressedBackward's dq_float).
template <typename scalar_t, int D, typename dq_t>
__global__ void __launch_bounds__(CmpSmemCfg<D>::kThreads, D == 64 ? 2 : 1)
    CmpSmemDqKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                    const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                    const float* __restrict__ lse, const float* __restrict__ delta,
                    dq_t* __restrict__ dq, Shape s, int positions_per_cta, int cmp_block,
                    int cmp_stride, float scale_log2, float dq_scale) {
  using Cfg = CmpSmemCfg<D>;
  constexpr int kM = Cfg::kM, kN = Cfg::kN, kKs = D / 16;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kStageBytes = 2 * Cfg::kTileBytes;
  extern __shared__ float smem[];
  const uint32_t smem_base = mma::SmemAddr(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, c = lane & 3;
  const int hq = s.hq();
  const CmpCtaRows cta(s, positions_per_cta);
  const int t0 = cta.t0, grp = cta.grp, b = cta.b, positions = cta.positions, rows = cta.rows;
  const bool active = 16 * kM * warp < rows;

  const smem_fwd::LaneRows<kM> lr(s, b, grp, t0, rows, warp, lane);
  const auto& row_index = lr.index;
  const auto& row_valid = lr.valid;
  int row_vis[kM][2];
  float row_lse[kM][2], row_delta[kM][2];
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_vis[m][h] = row_valid[m][h] ? CmpVisible(t0 + lr.pos[m][h], s.Tk, cmp_block, cmp_stride) : 0;
      row_lse[m][h] = row_valid[m][h] ? lse[row_index[m][h]] : INFINITY;
      row_delta[m][h] = row_valid[m][h] ? delta[row_index[m][h]] : 0.f;
    }
  }
  uint32_t qf[kM][kKs][4], df[kM][kKs][4];  // A fragments of Q and dO
  smem_fwd::LoadRowFragments<D, kM>(qf, q, row_index, row_valid, lane);
  smem_fwd::LoadRowFragments<D, kM>(df, dout, row_index, row_valid, lane);
  const int vis_min = CmpVisible(t0, s.Tk, cmp_block, cmp_stride);
  const int vis_end = CmpVisible(t0 + positions - 1, s.Tk, cmp_block, cmp_stride);
  const int tiles = (vis_end + kN - 1) / kN;
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  const scalar_t* k_base = k + KeyOffset(s, b, 0, grp);
  const scalar_t* v_base = v + KeyOffset(s, b, 0, grp);
  const auto stage = [&](int tile) {
    const int key0 = tile * kN, count = min(kN, vis_end - key0);
    const uint32_t buf = smem_base + (tile & 1) * kStageBytes;
    mma::StageTileAsync<D, kN, Cfg::kThreads>(buf, k_base + key0 * kv_stride, kv_stride, count);
    mma::StageTileAsync<D, kN, Cfg::kThreads>(buf + Cfg::kTileBytes, v_base + key0 * kv_stride,
                                               kv_stride, count);
  };
  float acc[kM][D / 8][4];
#pragma unroll
  for (int m = 0; m < kM; ++m)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) acc[m][i][0] = acc[m][i][1] = acc[m][i][2] = acc[m][i][3] = 0.f;

  if (tiles > 0) {
    stage(0);
    mma::CpAsyncCommit();
  }
  for (int tile = 0; tile < tiles; ++tile) {
    mma::CpAsyncWaitAll();
    __syncthreads();
    if (tile + 1 < tiles) stage(tile + 1);
    mma::CpAsyncCommit();
    if (!active) continue;
    const int key0 = tile * kN;
    const uint32_t kbuf = smem_base + (tile & 1) * kStageBytes, vbuf = kbuf + Cfg::kTileBytes;
    const bool masked = key0 + kN > vis_min;
    // The 16-key steps that hold a key the CTA's last position sees: the last tile holds 1-64
    // of them (the rest would be masked to P = 0, a quarter of the steps at the training shape).
    const int steps = min(kN / 16, (vis_end - key0 + 15) / 16);
#pragma unroll 1  // the steps share nothing; unrolling them only raises register pressure
    for (int kk = 0; kk < steps; ++kk) {
      float sc[kM][2][4], dp[kM][2][4];
#pragma unroll
      for (int m = 0; m < kM; ++m)
#pragma unroll
        for (int nn = 0; nn < 2; ++nn)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[m][nn][e] = dp[m][nn][e] = 0.f;
#pragma unroll
      for (int nn = 0; nn < 2; ++nn) {
        const int n = 2 * kk + nn;
#pragma unroll
        for (int p = 0; p < D / 32; ++p) {
          const uint32_t off = mma::SwizzledOffset<D>(8 * n + (lane & 7), 4 * p + (lane >> 3));
          uint32_t kb[4], vb[4];
          mma::LdMatrixX4(kb, kbuf + off);
          mma::LdMatrixX4(vb, vbuf + off);
#pragma unroll
          for (int m = 0; m < kM; ++m) {
            const uint32_t(&q0)[4] = qf[m][2 * p];
            const uint32_t(&q1)[4] = qf[m][2 * p + 1];
            const uint32_t(&d0)[4] = df[m][2 * p];
            const uint32_t(&d1)[4] = df[m][2 * p + 1];
            mma::Mma<kBf16>(sc[m][nn], q0[0], q0[1], q0[2], q0[3], kb[0], kb[1]);
            mma::Mma<kBf16>(sc[m][nn], q1[0], q1[1], q1[2], q1[3], kb[2], kb[3]);
            mma::Mma<kBf16>(dp[m][nn], d0[0], d0[1], d0[2], d0[3], vb[0], vb[1]);
            mma::Mma<kBf16>(dp[m][nn], d1[0], d1[1], d1[2], d1[3], vb[2], vb[3]);
          }
        }
      }
      uint32_t a[kM][4];
#pragma unroll
      for (int m = 0; m < kM; ++m) {
#pragma unroll
        for (int nn = 0; nn < 2; ++nn) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int h = e >> 1, key = key0 + 16 * kk + 8 * nn + 2 * c + (e & 1);
            const bool ok = !masked || key < row_vis[m][h];
            const float p = ok ? mma::Exp2(sc[m][nn][e] * scale_log2 - row_lse[m][h]) : 0.f;
            sc[m][nn][e] = p * (dp[m][nn][e] - row_delta[m][h]);  // dS
          }
        }
        mma::PackA<kBf16>(a[m], sc[m][0], sc[m][1]);
      }
      // dQ += dS K: K rows 16kk.. as the B operand over keys (transposed by ldmatrix).
#pragma unroll
      for (int p = 0; p < D / 16; ++p) {
        uint32_t kt[4];
        mma::LdMatrixX4Trans(kt, kbuf + mma::SwizzledOffset<D>(16 * kk + (lane & 7) + (lane & 8),
                                                                2 * p + (lane >> 4)));
#pragma unroll
        for (int m = 0; m < kM; ++m) {
          mma::Mma<kBf16>(acc[m][2 * p], a[m][0], a[m][1], a[m][2], a[m][3], kt[0], kt[1]);
          mma::Mma<kBf16>(acc[m][2 * p + 1], a[m][0], a[m][1], a[m][2], a[m][3], kt[2], kt[3]);
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < kM; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!row_valid[m][h]) continue;
      if constexpr (std::is_same_v<dq_t, float>) {
        float2* drow = reinterpret_cast<float2*>(dq + row_index[m][h] * D);
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          drow[4 * i + c] = make_float2(acc[m][i][2 * h] * dq_scale, acc[m][i][2 * h + 1] * dq_scale);
      } else {
        uint32_t* drow = reinterpret_cast<uint32_t*>(dq + row_index[m][h] * D);
#pragma unroll
        for (int i = 0; i < D / 8; ++i)
          drow[4 * i + c] = mma::Pack<kBf16>(acc[m][i][2 * h] * dq_scale, acc[m][i][2 * h + 1] * dq_scale);
      }
    }
  }
}

struct CmpQueryPolicy {
  int positions_per_cta, cmp_block, cmp_stride;

  __device__ int Visible(const Shape& s, int t) const {
    return t < cmp_block - 1 ? 0 : min(s.Tk, (t - (cmp_block - 1)) / cmp_stride + 1);
  }
  __device__ QueryTile Tile(const Shape& s) const {
    QueryTile tile{};
    tile.t0 = static_cast<int>(blockIdx.x) * positions_per_cta;
    tile.g = static_cast<int>(blockIdx.y);
    tile.b = static_cast<int>(blockIdx.z);
    tile.positions = min(positions_per_cta, s.T - tile.t0);
    tile.valid = tile.positions > 0;
    return tile;
  }
  __device__ int NumChunks(const Shape& s, const QueryTile& tile) const {
    return (Visible(s, tile.t0 + tile.positions - 1) + kKeyChunk - 1) / kKeyChunk;
  }
  __device__ KeyChunk Chunk(const Shape& s, const QueryTile& tile, int c) const {
    const int visible = Visible(s, tile.t0 + tile.positions - 1);
    return {c * kKeyChunk, min(kKeyChunk, visible - c * kKeyChunk)};
  }
  __device__ bool Allowed(const Shape&, int t, int j) const {
    return j * cmp_stride + cmp_block - 1 <= t;
  }
};

struct CmpKeyPolicy {
  int cmp_block, cmp_stride;
  int queries_per_cta;  // query positions per CTA (grid.y slices), see KeyQueriesPerCta

  __device__ KeyWork Work(const Shape& s) const {
    KeyWork w{};
    const int start = static_cast<int>(blockIdx.x) * kKeyChunk;
    w.b = static_cast<int>(blockIdx.z) / s.G;
    w.g = static_cast<int>(blockIdx.z) % s.G;
    w.keys = {start, min(kKeyChunk, s.Tk - start)};
    // The first query that sees the chunk's first block; later blocks are masked per key.
    const int first = max(static_cast<int>(blockIdx.y) * queries_per_cta,
                          start * cmp_stride + cmp_block - 1);
    const int end = min(s.T, static_cast<int>(blockIdx.y + 1) * queries_per_cta);
    w.num_queries = max(0, end - first);
    w.query_base = first;
    w.valid = true;
    return w;
  }
  __device__ int Query(const KeyWork& w, int i) const { return static_cast<int>(w.query_base) + i; }
  // j <= t first: the warpgroup-MMA kernel asks about padding keys as j = INT_MAX (and every
  // key a position sees is at most the position).
  __device__ bool Allowed(const Shape&, int t, int j) const {
    return j <= t && j * cmp_stride + cmp_block - 1 <= t;
  }
  // Whether every position in [t_min, t_max] sees every key of `keys`: a position sees a
  // prefix of the keys that grows with it.
  __device__ bool AllowsAll(int t_min, int, const KeyChunk& keys) const {
    return (keys.start + keys.count - 1) * cmp_stride + cmp_block - 1 <= t_min;
  }
};

// Key-side backward (dK, dV) with shared-memory tiles, the work split of CmpKeyPolicy: a CTA
// owns 64 compressed keys of (b, g) (16 per warp, the MMA rows) and walks the flattened
// (position, head) query rows of its position range kR at a time. The key and value chunk is
// staged once; each query step stages the Q and dO rows (cp.async, double buffered) plus
// their lse / delta / position, and every warp reads them with ldmatrix:
//   S^T = K Q^T, dP^T = V dO^T (Q, dO rows non-transposed), P^T = exp2(S^T - lse),
//   dS^T = P^T (dP^T - delta), dV += P^T dO, dK += dS^T Q (dO, Q rows transposed).
// The CTA's sums are added into the float32 buffers once at the end (two CTAs share a chunk
// only when its query range is split).
template <int D>
struct CmpDkDvCfg {
  static constexpr int kWarps = 4, kThreads = 32 * kWarps, kKeys = 16 * kWarps;
  static constexpr int kR = D == 64 ? 64 : 32;  // query rows per step (register budget)
  static constexpr int kKeyBytes = kKeys * D * 2, kRowBytes = kR * D * 2;
  static constexpr int kStageBytes = 2 * kRowBytes + kR * 12;  // Q, dO, lse, delta, position
  static constexpr int kSmem = 2 * kKeyBytes + 2 * kStageBytes;
};

template <typename scalar_t, int D>
__global__ void __launch_bounds__(CmpDkDvCfg<D>::kThreads)
    CmpSmemDkDvKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                      const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                      const float* __restrict__ lse, const float* __restrict__ delta,
                      float* __restrict__ dk_acc, float* __restrict__ dv_acc, Shape s,
                      CmpKeyPolicy pol, float scale) {
  using Cfg = CmpDkDvCfg<D>;
  static_assert(Cfg::kKeys == kKeyChunk, "CmpKeyPolicy hands out kKeyChunk keys per CTA");
  constexpr int kR = Cfg::kR;
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;  // CTA-uniform
  extern __shared__ float smem[];
  const uint32_t smem_base = mma::SmemAddr(smem);
  const uint32_t k_s = smem_base, v_s = smem_base + Cfg::kKeyBytes;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int hq = s.hq();
  const float scale_log2 = scale * kLog2e;
  const int64_t kv_stride = static_cast<int64_t>(s.G) * D;
  const int total = w.num_queries * hq;  // flattened (position, head) rows
  const int tiles = (total + kR - 1) / kR;
  const int first = static_cast<int>(w.query_base);

  mma::StageTileAsync<D, Cfg::kKeys, Cfg::kThreads>(k_s, k + KeyOffset(s, w.b, w.keys.start, w.g),
                                                    kv_stride, w.keys.count);
  mma::StageTileAsync<D, Cfg::kKeys, Cfg::kThreads>(v_s, v + KeyOffset(s, w.b, w.keys.start, w.g),
                                                    kv_stride, w.keys.count);
  const auto stage_base = [&](int tile) { return 2 * Cfg::kKeyBytes + (tile & 1) * Cfg::kStageBytes; };
  const auto stage = [&](int tile) {
    const int base = stage_base(tile);
    constexpr int kChunks = D / 8;
#pragma unroll
    for (int it = 0; it < kR * kChunks / Cfg::kThreads; ++it) {
      const int i = static_cast<int>(threadIdx.x) + it * Cfg::kThreads;
      const int row = i / kChunks, chunk = i % kChunks, rho = tile * kR + row;
      const bool ok = rho < total;
      const int64_t off = ok ? QueryOffset(s, w.b, first + rho / hq, w.g * hq + rho % hq) + chunk * 8 : 0;
      const uint32_t dst = smem_base + base + mma::SwizzledOffset<D>(row, chunk);
      mma::CpAsync16(dst, q + off, ok);
      mma::CpAsync16(dst + Cfg::kRowBytes, dout + off, ok);
    }
    if (threadIdx.x < kR) {
      const int rho = tile * kR + static_cast<int>(threadIdx.x);
      float* info = smem + (base + 2 * Cfg::kRowBytes) / 4;
      if (rho < total) {
        const int t = first + rho / hq;
        const int64_t row = (static_cast<int64_t>(w.b) * s.T + t) * s.H + w.g * hq + rho % hq;
        info[threadIdx.x] = lse[row];
        info[kR + threadIdx.x] = delta[row];
        reinterpret_cast<int*>(info)[2 * kR + threadIdx.x] = t;
      } else {
        info[threadIdx.x] = INFINITY;
        info[kR + threadIdx.x] = 0.f;
        reinterpret_cast<int*>(info)[2 * kR + threadIdx.x] = -1;  // sees no key
      }
    }
  };

  // The lane's key rows (g, g + 8 of the warp's 16) and the first position that sees them.
  int min_t[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key_local = 16 * warp + g + 8 * h;
    min_t[h] = key_local < w.keys.count ? (w.keys.start + key_local) * pol.cmp_stride + pol.cmp_block - 1
                                        : INT_MAX;
  }
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;

  stage(0);
  mma::CpAsyncCommit();
  for (int tile = 0; tile < tiles; ++tile) {
    mma::CpAsyncWaitAll();
    __syncthreads();
    if (tile + 1 < tiles) stage(tile + 1);
    mma::CpAsyncCommit();
    const int base = stage_base(tile);
    const uint32_t q_t = smem_base + base, do_t = q_t + Cfg::kRowBytes;
    const float* info = smem + (base + 2 * Cfg::kRowBytes) / 4;
    if (16 * warp >= w.keys.count) continue;  // warp without keys (last chunk)
    float st[kR / 8][4], dpt[kR / 8][4];
#pragma unroll
    for (int j = 0; j < kR / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[j][e] = dpt[j][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      // A fragments of the warp's 16 key / value rows, k16 step ks.
      const uint32_t a_off = mma::SwizzledOffset<D>(16 * warp + (lane & 7) + (lane & 8), 2 * ks + (lane >> 4));
      uint32_t ka[4], va[4];
      mma::LdMatrixX4(ka, k_s + a_off);
      mma::LdMatrixX4(va, v_s + a_off);
#pragma unroll
      for (int j = 0; j < kR / 8; j += 2) {
        // B fragments of query rows 8j.. and 8j+8.. for this k step.
        const uint32_t b_off = mma::SwizzledOffset<D>(8 * j + (lane & 7) + ((lane >> 4) << 3), 2 * ks + ((lane >> 3) & 1));
        uint32_t qb[4], db[4];
        mma::LdMatrixX4(qb, q_t + b_off);
        mma::LdMatrixX4(db, do_t + b_off);
        mma::Mma<kBf16>(st[j], ka[0], ka[1], ka[2], ka[3], qb[0], qb[1]);
        mma::Mma<kBf16>(st[j + 1], ka[0], ka[1], ka[2], ka[3], qb[2], qb[3]);
        mma::Mma<kBf16>(dpt[j], va[0], va[1], va[2], va[3], db[0], db[1]);
        mma::Mma<kBf16>(dpt[j + 1], va[0], va[1], va[2], va[3], db[2], db[3]);
      }
    }
#pragma unroll
    for (int j = 0; j < kR / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * j + 2 * c + (e & 1), h = e >> 1;
        const int t = reinterpret_cast<const int*>(info)[2 * kR + col];
        const float p = t >= min_t[h] ? mma::Exp2(st[j][e] * scale_log2 - info[col]) : 0.f;
        st[j][e] = p;
        dpt[j][e] = p * (dpt[j][e] - info[kR + col]);  // dS^T
      }
    }
    // dV += P^T dO, dK += dS^T Q: the query rows are the contraction (ldmatrix.trans).
#pragma unroll
    for (int kk = 0; kk < kR / 16; ++kk) {
      uint32_t pa[4], sa[4];
      mma::PackA<kBf16>(pa, st[2 * kk], st[2 * kk + 1]);
      mma::PackA<kBf16>(sa, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int p = 0; p < D / 16; ++p) {
        const uint32_t off = mma::SwizzledOffset<D>(16 * kk + (lane & 7) + (lane & 8), 2 * p + (lane >> 4));
        uint32_t db[4], qb[4];
        mma::LdMatrixX4Trans(db, do_t + off);
        mma::LdMatrixX4Trans(qb, q_t + off);
        mma::Mma<kBf16>(dv[2 * p], pa[0], pa[1], pa[2], pa[3], db[0], db[1]);
        mma::Mma<kBf16>(dv[2 * p + 1], pa[0], pa[1], pa[2], pa[3], db[2], db[3]);
        mma::Mma<kBf16>(dk[2 * p], sa[0], sa[1], sa[2], sa[3], qb[0], qb[1]);
        mma::Mma<kBf16>(dk[2 * p + 1], sa[0], sa[1], sa[2], sa[3], qb[2], qb[3]);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int key_local = 16 * warp + g + 8 * h;
    if (key_local >= w.keys.count) continue;
    const int64_t off = KeyOffset(s, w.b, w.keys.start + key_local, w.g);
    mma::AtomicAddRowColumns<D>(dk_acc + off, dk, h, scale, lane);
    mma::AtomicAddRowColumns<D>(dv_acc + off, dv, h, 1.f, lane);
  }
}

// importance[b,t,g,sb] = sum_{h in g} sum_j p[t,h,j] * |cmp block j ∩ selection block sb|.
// Each CTA adds its chunk's share with one atomic per (position, selection block): a
// selection block straddles at most two chunks, so a value gets at most two addends and the
// result does not depend on their order.
template <typename scalar_t, int D>
__global__ void __launch_bounds__(kThreads)
    CmpImportanceKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                        const float* __restrict__ lse, float* __restrict__ importance, Shape s,
                        CmpQueryPolicy pol, int NS, int slc_block, float scale_log2, int rows_cap) {
  extern __shared__ float smem[];
  const QueryTile tile = pol.Tile(s);
  if (!tile.valid) return;
  const int hq = s.hq();
  const int R = tile.positions * hq;
  float* q_s = smem;
  float* k_s = q_s + rows_cap * D;
  float* p_s = k_s + kKeyChunk * (D + 1);
  float* lse_s = p_s + rows_cap * kKeyChunk;
  for (int i = threadIdx.x; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    q_s[i] = static_cast<float>(q[QueryOffset(s, tile.b, tile.t0 + r / hq, tile.g * hq + r % hq) + d]) *
             scale_log2;
  }
  for (int r = threadIdx.x; r < R; r += kThreads)
    lse_s[r] = lse[(static_cast<int64_t>(tile.b) * s.T + tile.t0 + r / hq) * s.H + tile.g * hq + r % hq];

  const int chunks = pol.NumChunks(s, tile);
  for (int c = 0; c < chunks; ++c) {
    const KeyChunk ch = pol.Chunk(s, tile, c);
    __syncthreads();
    StageRows<scalar_t, D>(k, s, tile.b, tile.g, ch, k_s);
    __syncthreads();
    for (int i = threadIdx.x; i < R * kKeyChunk; i += kThreads) {
      const int r = i / kKeyChunk, key = i % kKeyChunk;
      float p = 0.f;
      if (key < ch.count && pol.Allowed(s, tile.t0 + r / hq, ch.start + key))
        p = exp2f(Dot<D>(q_s + r * D, k_s + key * (D + 1)) - lse_s[r]);
      p_s[i] = p;
    }
    __syncthreads();
    AddImportance(p_s, kKeyChunk, ch.start, ch.count, s, tile.b, tile.g, tile.t0, tile.positions, NS,
                  slc_block, pol.cmp_block, pol.cmp_stride, importance);
  }
}

void CheckCompressed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Geo& g) {
  CheckInput(q, "q", 4);
  CheckInput(k, "k_cmp", 4);
  CheckInput(v, "v_cmp", 4);
  CheckKv(q, k, v);
  const int64_t T = q.size(1);
  const int64_t N = NumCmpBlocks(T, g);
  TORCH_CHECK(k.size(1) == N, "k_cmp has ", k.size(1), " blocks, expected ", N, " for ", T,
              " tokens");
}

int KeyQueriesPerCta(const Shape& s, int most = kMaxQueriesPerKeyCta) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t key_ctas = static_cast<int64_t>((s.Tk + kKeyChunk - 1) / kKeyChunk) * s.B * s.G;
  int queries = most;
  while (queries > kMinQueriesPerKeyCta && key_ctas * ((s.T + queries - 1) / queries) < sms) queries /= 2;
  return queries;
}

// The warpgroup-MMA key side: at most this many positions per work item (they sit in its
// shared memory), as the window's backward takes.
constexpr int kWgmmaQueriesPerKeyCta = 128;

// Which dK/dV kernel CompressedBackward runs (CompressedKernelChoice::KeySide) on our kernels:
// a forced choice, or kAuto's, the warpgroup-MMA kernel wherever it runs. Measured on H100,
// m7c batch 16 (train_bench, graph): 85.42 / 85.35 / 85.48 -> 84.68 / 84.96 / 84.63 ms per
// step; one layer forward+backward at B16 T2048 D64 12:2 2.659 / 2.656 -> 2.601 / 2.627 ms.
// Its dQ too (fused, into a zeroed float32 sum, no query-side dQ kernel) measured the same
// step (84.72 / 84.55 / 85.06 ms) and a slower layer (2.692 / 2.688 ms): not kept.
CompressedKernelChoice::KeySide KeySideFor(const Shape& s, bool reduced) {
  using KeySide = CompressedKernelChoice::KeySide;
  const KeySide forced = compressed_key_side.load();
  const bool wgmma_ok = reduced && (s.D == 64 || s.D == 128) && WgmmaRunsHere();
  if (forced == KeySide::kWgmma) {
    TORCH_CHECK(wgmma_ok, "the compressed branch's warpgroup-MMA backward needs bf16/fp16 inputs, head_dim 64 or "
                "128 and an sm_90 device with an sm_90a build, got head_dim ", s.D);
    return forced;
  }
  return forced == KeySide::kSmem || !wgmma_ok ? KeySide::kSmem : KeySide::kWgmma;
}

// Grid of a query-side kernel: `positions` whole positions of one group, all heads, per CTA.
struct QueryGrid {
  int per_cta;
  dim3 grid;
  QueryGrid(const Shape& s, int positions)
      : per_cta(positions), grid((s.T + positions - 1) / positions, s.G, s.B) {}
  bool Empty() const { return grid.x == 0 || grid.y == 0 || grid.z == 0; }
};

// The register-only tensor-core kernels: whole positions per CTA (all heads of a position in
// one CTA, for importance).
QueryGrid MmaQueryGrid(const Shape& s) { return {s, std::max(1, mma::kTileRows / s.hq())}; }

// The shared-memory kernels (forward, importance, dQ): their 128 rows in whole positions.
template <int D>
QueryGrid SmemQueryGrid(const Shape& s) {
  return {s, CmpSmemCfg<D>::kRows / s.hq()};
}

CmpQueryPolicy QueryPolicy(const Shape& s, const Geo& g) {
  return {std::max(1, kMaxRows / s.hq()), g.cmp_block, g.cmp_stride};
}

// The shared-memory forward needs every key tile to start on a selection-block boundary
// (kN * d a multiple of l') and W to fit its registers; other geometries, and a forced
// CompressedKernelChoice::Path::kRegisters (tests, A/B timing), take the register-only
// kernels above.
bool LegacyRequested() {
  return GetCompressedKernelChoice().path == CompressedKernelChoice::Path::kRegisters;
}

bool UseSmemForward(const Geo& g) {
  const bool legacy = LegacyRequested();
  constexpr int kN = CmpSmemCfg<64>::kN;
  const int span = CmpTileSpan(kN, g.cmp_block, g.cmp_stride, g.slc_block);
  return !legacy && g.cmp_block >= g.cmp_stride && (kN * g.cmp_stride) % g.slc_block == 0 &&
         span <= 8 * CmpSmemCfg<64>::kSbTiles &&
         span - kN * g.cmp_stride / g.slc_block <= CmpSmemCfg<64>::kMaxCarry;
}

template <typename Kernel>
void AllowSmem(Kernel kernel, int bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

template <typename scalar_t, int D>
void SmemForward(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& v_cmp, at::Tensor& out,
                 at::Tensor& lse, const Shape& s, const Geo& g, int NS, float scale_log2) {
  using Cfg = CmpSmemCfg<D, CmpTilesPerWarp<D, false>()>;
  const QueryGrid sg = SmemQueryGrid<D>(s);
  if (sg.Empty()) return;
  const auto fwd = CmpSmemKernel<scalar_t, D, false>;
  AllowSmem(fwd, Cfg::FwdSmem());
  fwd<<<sg.grid, Cfg::kThreads, Cfg::FwdSmem(), at::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
      out.data_ptr<scalar_t>(), lse.data_ptr<float>(), nullptr, s, sg.per_cta, NS, g.slc_block,
      g.cmp_block, g.cmp_stride, scale_log2, /*zero_tail=*/false);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the importance maps P onto selection blocks by QuadMapRow: the paper's geometry
// (l = 2d, l' = 4d; m7c's 32/16/64), unless the W product is forced.
bool UseQuadMap(const Geo& g) {
  return QuadMapApplies(g.cmp_block, g.cmp_stride, g.slc_block) &&
         compressed_map.load() != CompressedKernelChoice::Map::kProduct;
}

// Whether the shared-memory forward and importance run as one pass (CmpOnePassKernel's
// conditions; the caller has chosen the shared-memory path for bf16/fp16).
bool UseOnePass(const Shape& s, const Geo& g) {
  return s.D == CmpOnePassCfg::kD && s.Tk <= CmpOnePassCfg::kTiles * CmpOnePassCfg::kN && UseQuadMap(g) &&
         s.hq() % 2 == 0 && compressed_pass.load() != CompressedKernelChoice::Pass::kTwo;
}

// The one-pass kernel takes the two-pass kernels' query grid (SmemQueryGrid): its rows per CTA
// must be theirs.
static_assert(CmpOnePassCfg::kRows == CmpSmemCfg<CmpOnePassCfg::kD>::kRows, "one grid for one and two passes");

template <typename scalar_t>
void OnePassForward(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& v_cmp, at::Tensor& out,
                    at::Tensor& lse, at::Tensor& importance, const Shape& s, const Geo& g, int NS, float scale_log2) {
  const QueryGrid sg = SmemQueryGrid<CmpOnePassCfg::kD>(s);
  if (sg.Empty()) return;
  const auto kernel = CmpOnePassKernel<scalar_t>;
  AllowSmem(kernel, CmpOnePassCfg::kSmem);
  kernel<<<sg.grid, CmpOnePassCfg::kThreads, CmpOnePassCfg::kSmem, at::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
      lse.data_ptr<float>(), importance.data_ptr<float>(), s, sg.per_cta, NS, g.cmp_block, g.cmp_stride, scale_log2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Whether the importance runs on a lane kernel (CompressedKernelChoice::Map: kAuto, or kLaneSync
// for the mma.sync one): head_dim 64 (Q's fragments in registers, or its tiles in shared memory
// on warpgroup MMAs), or 128 on warpgroup MMAs alone (kAuto), the quad map's geometry, an even
// head count per group up to 2 kMaxLaneTiles. The caller has chosen the shared-memory path.
bool UseLaneImportance(const Shape& s, const Geo& g) {
  const auto map = compressed_map.load();
  const bool lane_kernel =
      (s.D == 64 && (map == CompressedKernelChoice::Map::kAuto || map == CompressedKernelChoice::Map::kLaneSync)) ||
      (s.D == 128 && map == CompressedKernelChoice::Map::kAuto && WgmmaRunsHere());
  return lane_kernel && UseQuadMap(g) && s.hq() % 2 == 0 && s.hq() <= 2 * kMaxLaneTiles;
}

// CmpImportanceLaneKernel (mma.sync, head_dim 64), kM head pairs a lane.
template <typename scalar_t, int D, int kM>
void LaunchLaneImportanceSync(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& lse,
                              at::Tensor& importance, const Shape& s, const Geo& g, int NS, float scale_log2,
                              bool zero_tail) {
  using Cfg = CmpLaneImpCfg<D>;
  const QueryGrid grid(s, Cfg::kPositions);
  if (grid.Empty()) return;
  const auto kernel = CmpImportanceLaneKernel<scalar_t, D, kM>;
  AllowSmem(kernel, Cfg::kSmem);
  kernel<<<grid.grid, Cfg::kThreads, Cfg::kSmem, at::cuda::getCurrentCUDAStream()>>>(
      q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), lse.data_ptr<float>(), importance.data_ptr<float>(), s,
      NS, g.cmp_block, g.cmp_stride, scale_log2, zero_tail);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// CmpImportanceLaneWgmmaKernel where warpgroup MMAs run and Map is kAuto, else
// CmpImportanceLaneKernel, with kM = hq / 2 head pairs a lane (from kM up to kMaxLaneTiles).
template <typename scalar_t, int D, int kM>
void LaunchLaneImportance(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& lse,
                          at::Tensor& importance, const Shape& s, const Geo& g, int NS, float scale_log2,
                          bool zero_tail) {
  if constexpr (kM < kMaxLaneTiles) {
    if (s.hq() != 2 * kM) {
      LaunchLaneImportance<scalar_t, D, kM + 1>(q, k_cmp, lse, importance, s, g, NS, scale_log2, zero_tail);
      return;
    }
  }
  if (compressed_map.load() == CompressedKernelChoice::Map::kAuto && WgmmaRunsHere()) {
    using Cfg = CmpLaneWgmmaCfg<D>;
    const QueryGrid grid(s, Cfg::kPositions);
    if (grid.Empty()) return;
    const auto kernel = CmpImportanceLaneWgmmaKernel<scalar_t, D, kM>;
    AllowSmem(kernel, Cfg::Smem(kM));
    kernel<<<grid.grid, Cfg::kThreads, Cfg::Smem(kM), at::cuda::getCurrentCUDAStream()>>>(
        q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), lse.data_ptr<float>(), importance.data_ptr<float>(),
        s, NS, g.cmp_block, g.cmp_stride, scale_log2, zero_tail);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  if constexpr (D == 64) {  // the mma.sync lane kernel holds Q's fragments: head_dim 64 only
    LaunchLaneImportanceSync<scalar_t, D, kM>(q, k_cmp, lse, importance, s, g, NS, scale_log2, zero_tail);
  } else {
    TORCH_CHECK(false, "the lane importance kernel at head_dim ", D, " needs warpgroup MMAs");
  }
}

// The importance pass on tensor cores, from the row log-sum-exp (the shared-memory kernel
// writes every importance value; the register-only one adds into zeros).
template <typename scalar_t, int D>
void LaunchImportance(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& lse,
                      at::Tensor& importance, const Shape& s, const Geo& g, int NS, float scale_log2,
                      bool smem_path, bool zero_tail = true) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  if constexpr (D == 64 || D == 128) {
    if (smem_path && UseLaneImportance(s, g)) {
      LaunchLaneImportance<scalar_t, D, 1>(q, k_cmp, lse, importance, s, g, NS, scale_log2, zero_tail);
      return;
    }
  }
  if (smem_path) {
    using Cfg = CmpSmemCfg<D, CmpTilesPerWarp<D, true>()>;
    const QueryGrid sg = SmemQueryGrid<D>(s);
    if (sg.Empty()) return;
    // The quad map adds a position's heads in each lane first (LaneRows' kLaneHeads): all of the
    // lane's rows where 2 kM divide the heads per group, else a tile's two rows where two do; an
    // odd head count per group takes the product.
    constexpr int kM = Cfg::kM;
    const bool quad = UseQuadMap(g);
    auto imp = CmpSmemKernel<scalar_t, D, true, false>;
    if (quad && s.hq() % 2 == 0) imp = CmpSmemKernel<scalar_t, D, true, true, 2>;
    if constexpr (kM > 1) {
      if (quad && s.hq() % (2 * kM) == 0) imp = CmpSmemKernel<scalar_t, D, true, true, 2 * kM>;
    }
    AllowSmem(imp, Cfg::ImpSmem());
    imp<<<sg.grid, Cfg::kThreads, Cfg::ImpSmem(), stream>>>(
        q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), nullptr, nullptr, lse.data_ptr<float>(),
        importance.data_ptr<float>(), s, sg.per_cta, NS, g.slc_block, g.cmp_block, g.cmp_stride, scale_log2,
        zero_tail);
  } else {
    const QueryGrid mg = MmaQueryGrid(s);
    if (mg.Empty()) return;
    CmpImportanceMmaKernel<scalar_t, D><<<mg.grid, mma::kMmaThreads, 0, stream>>>(
        q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), lse.data_ptr<float>(),
        importance.data_ptr<float>(), s, mg.per_cta, NS, g.slc_block, g.cmp_block, g.cmp_stride, scale_log2);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor NewImportance(const at::Tensor& q, const Shape& s, int NS, bool smem_path) {
  const auto opts = q.options().dtype(at::kFloat);
  return smem_path ? at::empty({s.B, s.T, s.G, NS}, opts) : ZeroFloats({s.B, s.T, s.G, NS}, opts);
}

// From this many tokens the compressed branch runs on cuDNN by default. H100, one NSA layer
// forward+backward (PERFORMANCE.md, "Compressed branch on cuDNN"): at 8k our kernels win at
// 12:2 (1.85 against 2.07 ms, D=64), at 16k the two tie at D=64 and cuDNN wins at D=128
// (7.49 against 7.80 ms), from 32k cuDNN wins everywhere (64k D=64 12:2: 17.0 against 20.0
// ms); at T=2048 batch 16 it loses clearly (4.41 against 4.17 ms).
constexpr int64_t kDenseFromTokens = 16384;

bool CudnnAttentionUsable() {
  const auto& hooks = at::detail::getCUDAHooks();
  return at::globalContext().userEnabledCuDNN() && hooks.hasCuDNN() && hooks.versionRuntimeCuDNN() >= 90000;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressedForward(const at::Tensor& q,
                                                                 const at::Tensor& k_cmp,
                                                                 const at::Tensor& v_cmp,
                                                                 const Geo& g) {
  CheckCompressed(q, k_cmp, v_cmp, g);
  const Shape s = MakeShape(q, k_cmp);
  const int NS = (s.T + g.slc_block - 1) / g.slc_block;
  auto out = at::empty_like(q);
  auto lse = at::empty({s.B, s.T, s.H}, q.options().dtype(at::kFloat));
  // The shared-memory kernels write every importance value; the others add into zeros.
  const bool smem_path = q.scalar_type() != at::kFloat && UseSmemForward(g);
  auto importance = NewImportance(q, s, NS, smem_path);
  const CmpQueryPolicy pol = QueryPolicy(s, g);
  const int rows = pol.positions_per_cta * s.hq();
  const dim3 grid = QueryGrid(s, pol.positions_per_cta).grid;
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_cmp_fwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if constexpr (!std::is_same_v<scalar_t, float>) {
        if (smem_path) {
          if constexpr (D == CmpOnePassCfg::kD) {
            if (UseOnePass(s, g)) {
              OnePassForward<scalar_t>(q, k_cmp, v_cmp, out, lse, importance, s, g, NS, scale_log2);
              return;
            }
          }
          SmemForward<scalar_t, D>(q, k_cmp, v_cmp, out, lse, s, g, NS, scale_log2);
        } else {
          const QueryGrid mg = MmaQueryGrid(s);
          if (mg.Empty()) return;
          CmpQueryMmaKernel<scalar_t, D, false><<<mg.grid, mma::kMmaThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
              q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(), nullptr,
              nullptr, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, mg.per_cta, g.cmp_block,
              g.cmp_stride, scale_log2, 0.f);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        LaunchImportance<scalar_t, D>(q, k_cmp, lse, importance, s, g, NS, scale_log2, smem_path);
      } else {
        Launch(AttnFwdKernel<scalar_t, D, CmpQueryPolicy>, grid, FwdSmemFloats(rows, D) * sizeof(float),
               q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
               out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, pol, scale_log2, rows);
        const size_t imp_smem = (rows * D + kKeyChunk * (D + 1) + rows * kKeyChunk + rows) * sizeof(float);
        Launch(CmpImportanceKernel<scalar_t, D>, grid, imp_smem, q.data_ptr<scalar_t>(),
               k_cmp.data_ptr<scalar_t>(), lse.data_ptr<float>(), importance.data_ptr<float>(), s, pol,
               NS, g.slc_block, scale_log2, rows);
      }
    });
  });
  return {out, lse, importance};
}

at::Tensor CompressedImportance(const at::Tensor& q, const at::Tensor& k_cmp, const at::Tensor& lse,
                                const Geo& g, bool selection_only) {
  CheckCompressed(q, k_cmp, k_cmp, g);
  TORCH_CHECK(q.scalar_type() != at::kFloat, "the importance pass alone runs on bf16/fp16 inputs");
  const Shape s = MakeShape(q, k_cmp);
  TORCH_CHECK(lse.is_cuda() && lse.scalar_type() == at::kFloat && lse.is_contiguous() &&
                  lse.sizes() == at::IntArrayRef({s.B, s.T, s.H}),
              "lse must be a contiguous float32 [B,T,H] CUDA tensor, got ", lse.sizes());
  const int NS = (s.T + g.slc_block - 1) / g.slc_block;
  const bool smem_path = UseSmemForward(g);
  auto importance = NewImportance(q, s, NS, smem_path);
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "nsa_cmp_importance", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      LaunchImportance<scalar_t, decltype(dim)::value>(q, k_cmp, lse, importance, s, g, NS, scale_log2,
                                                        smem_path, /*zero_tail=*/!selection_only);
    });
  });
  return importance;
}

bool UseDenseCompressed(const at::Tensor& q, const Geo& g) {
  const auto path = GetCompressedKernelChoice().path;
  if (path == CompressedKernelChoice::Path::kRegisters || path == CompressedKernelChoice::Path::kOwn) return false;
  const bool reduced = q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16;
  const int64_t D = q.size(-1);
  const bool shape_ok = D % 8 == 0 && D <= 128;
  if (path == CompressedKernelChoice::Path::kDense) {
    TORCH_CHECK(reduced, "the cuDNN compressed path takes bf16/fp16 inputs, got ", q.scalar_type());
    TORCH_CHECK(shape_ok, "the cuDNN compressed path takes head_dim a multiple of 8 up to 128, got ", D);
    TORCH_CHECK(CudnnAttentionUsable(), "the cuDNN compressed path needs cuDNN 9 or newer, enabled");
    return true;
  }
  return reduced && shape_ok && q.size(1) >= kDenseFromTokens && CudnnAttentionUsable();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressedBackward(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k_cmp,
    const at::Tensor& v_cmp, const at::Tensor& out, const at::Tensor& lse, const Geo& g,
    at::Tensor* dq_float, const at::Tensor& given_delta) {
  CheckCompressed(q, k_cmp, v_cmp, g);
  if (dq_float) CheckDqSum(*dq_float, q);
  const auto dout = dout_in.contiguous();
  const Shape s = MakeShape(q, k_cmp);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.D));
  const auto delta = DeltaOrRowDot(given_delta, dout, out);
  using KeySide = CompressedKernelChoice::KeySide;
  const bool reduced = q.scalar_type() != at::kFloat;
  const KeySide key_side = LegacyRequested() ? KeySide::kSmem : KeySideFor(s, reduced);
  // The shared-memory dQ kernel writes float32 itself; the other kernels write q's type.
  const bool dq_float_direct = dq_float && reduced && !LegacyRequested();
  auto dq = dq_float_direct ? at::Tensor() : at::empty_like(q);
  auto dk_acc = ZeroFloats(k_cmp.sizes(), k_cmp.options());
  auto dv_acc = ZeroFloats(v_cmp.sizes(), v_cmp.options());
  const CmpQueryPolicy qpol = QueryPolicy(s, g);
  const CmpKeyPolicy kpol{g.cmp_block, g.cmp_stride, KeyQueriesPerCta(s)};
  const int rows = qpol.positions_per_cta * s.hq();
  const dim3 qgrid = QueryGrid(s, qpol.positions_per_cta).grid;
  const dim3 kgrid((s.Tk + kKeyChunk - 1) / kKeyChunk, (s.T + kpol.queries_per_cta - 1) / kpol.queries_per_cta,
                   s.B * s.G);
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_cmp_bwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      if constexpr (!std::is_same_v<scalar_t, float>) {
        using Cfg = CmpSmemCfg<D>;
        const QueryGrid sg = SmemQueryGrid<D>(s), mg = MmaQueryGrid(s);
        if (!LegacyRequested()) {
          if (!sg.Empty()) {
            const auto launch = [&](auto kernel, auto* dq_out) {
              AllowSmem(kernel, Cfg::FwdSmem());
              kernel<<<sg.grid, Cfg::kThreads, Cfg::FwdSmem(), at::cuda::getCurrentCUDAStream()>>>(
                  q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
                  dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(), dq_out, s,
                  sg.per_cta, g.cmp_block, g.cmp_stride, scale * kLog2e, scale);
              C10_CUDA_KERNEL_LAUNCH_CHECK();
            };
            if (dq_float_direct) {
              launch(CmpSmemDqKernel<scalar_t, D, float>, dq_float->data_ptr<float>());
            } else {
              launch(CmpSmemDqKernel<scalar_t, D, scalar_t>, dq.data_ptr<scalar_t>());
            }
          } else if (dq_float_direct) {
            dq_float->zero_();  // no rows (T = 0)
          }
        } else if (!mg.Empty()) {
          CmpQueryMmaKernel<scalar_t, D, true>
              <<<mg.grid, mma::kMmaThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                  q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
                  dout.data_ptr<scalar_t>(), delta.data_ptr<float>(), dq.data_ptr<scalar_t>(),
                  lse.data_ptr<float>(), s, mg.per_cta, g.cmp_block, g.cmp_stride, scale * kLog2e,
                  scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      } else {
        Launch(AttnDqKernel<scalar_t, D, CmpQueryPolicy>, qgrid, DqSmemFloats(rows, D) * sizeof(float),
               q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
               dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
               dq.data_ptr<scalar_t>(), s, qpol, scale, rows);
      }
      if constexpr (!std::is_same_v<scalar_t, float>) {
        if (key_side == KeySide::kWgmma) {
          const CmpKeyPolicy wpol{g.cmp_block, g.cmp_stride, KeyQueriesPerCta(s, kWgmmaQueriesPerKeyCta)};
          const dim3 wgrid(kgrid.x, (s.T + wpol.queries_per_cta - 1) / wpol.queries_per_cta, kgrid.z);
          using Cfg = dkdv_wgmma::Cfg<D, kWgmmaQueriesPerKeyCta>;
          LaunchKernel(dkdv_wgmma::SelectedDkDvWgmmaKernel<scalar_t, D, false, kWgmmaQueriesPerKeyCta, CmpKeyPolicy>,
                       wgrid, Cfg::kThreads, Cfg::kBytes, q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(),
                       v_cmp.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                       delta.data_ptr<float>(), dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(),
                       static_cast<float*>(nullptr), s, wpol, scale);
        } else if (kgrid.x > 0 && kgrid.y > 0 && kgrid.z > 0 && !LegacyRequested()) {
          const auto kernel = CmpSmemDkDvKernel<scalar_t, D>;
          AllowSmem(kernel, CmpDkDvCfg<D>::kSmem);
          kernel<<<kgrid, CmpDkDvCfg<D>::kThreads, CmpDkDvCfg<D>::kSmem,
                   at::cuda::getCurrentCUDAStream()>>>(
              q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
              dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
              dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s, kpol, scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        } else if (kgrid.x > 0 && kgrid.y > 0 && kgrid.z > 0) {
          mma::DkDvMmaKernel<scalar_t, D, CmpKeyPolicy>
              <<<kgrid, mma::kMmaThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
                  q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
                  dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
                  dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s, kpol, scale);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      } else {
        Launch(AttnDkDvKernel<scalar_t, D, CmpKeyPolicy>, kgrid, DkDvSmemFloats(D) * sizeof(float),
             q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
             dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
             dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s, kpol, scale);
      }
    });
  });
  if (dq_float) {
    if (!dq_float_direct) dq_float->copy_(dq);
    dq = at::Tensor();
  }
  return {dq, dk_acc.to(k_cmp.scalar_type()), dv_acc.to(v_cmp.scalar_type())};
}

}  // namespace nsad::nsa::cuda::detail
