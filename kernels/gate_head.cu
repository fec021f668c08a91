// The gate MLP's head, gates = sigmoid(silu(u + c) W^T + b), as one kernel forward and one (plus
// a small reduction) backward, on tensor cores (bf16 / fp16). c is the gate MLP's hidden bias
// (optional): added here rather than in the epilogue of the joint projection's GEMM, its
// gradient (the column sums of du) comes out of this kernel's reduction, where the GEMM's
// backward ran four small kernels for it (a ones fill, a split-K GEMV and its reduction, a
// cast: 18.6 us a layer), and the forward needs no joint bias vector (a fill and a copy).
//
// Why: ATen ran it as silu over the strided slice, the bias's cast, a cuBLAS GEMM with N = 36
// outputs (72-byte rows: cuBLAS's sm80 align2 kernels) and sigmoid; the backward as sigmoid's
// backward, a dh GEMM, a split-K dW GEMM with its reduction, the bias's column sum (a GEMV with
// a ones vector and its casts) and silu's backward: about 30 us forward and 70 us backward per
// layer for m7c at batch 16 (ncu, H100), 1.2 ms a step, for data (u 12.6 MB, the gates 2.4 MB)
// that moves in about 5 + 10 us. These take 17 us forward and 30 + 4 us backward (ncu, same
// shape), latency-bound: a 16-row warp is the unit, so the grid holds about 15 warps per SM.
//
// u [M, K]: rows u_stride apart (a column slice of the attention's joint projection); c [K]
// float32 or null; W [N, K] 16-bit (the weight's copy); b [N] float32; gates [M, N]. mma.sync
// m16n8k16 fragments straight from registers as in mma_tile.cuh: a lane loads 16-byte pieces of its rows (physical columns
// 32i + 8c .. +7) and uses them as logical k columns -- the same for both operands, so the
// contraction is unchanged. A warp takes 16 rows.
//
// Backward, per CTA of 128 rows: dz = dg g (1 - g) in registers; du = (dz W) silu'(u + c) with W's
// rows as the B operand through movmatrix (PRTile's layout: a lane ends up with 8 contiguous
// columns of du, stored 16 bytes at a time); dz and silu(u + c) staged in shared memory, where each
// warp then reduces dW = dz^T silu(u + c) over the CTA's rows for a slice of W's columns (ldmatrix
// .trans), and db = the column sums of dz. dc = the column sums of du (as rounded): each warp's
// 16 rows by a reduce-scatter over its lanes per piece, into a shared row per warp, summed
// across the warps at the end. Each CTA writes its dW, db and dc; one launch of SumParts sums
// them in a fixed order (SumParts, launch_util.cuh: deterministic).
#include <type_traits>

#include "fused_launchers.h"
#include "launch_util.cuh"
#include "mma_tile.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kMaxN = 64;            // outputs (3 heads' gates each)
constexpr int kMaxTiles = kMaxN / 8;  // n8 tiles
constexpr int kFwdWarps = 4;
constexpr int kBwdWarps = 8;
constexpr int kBwdRows = kBwdWarps * 16;
// Inputs up to 480 features: the backward's silu(u) tile (128 rows of K + 8), W's (64 rows of
// K + 32 or K) and the warps' dc rows (8 x K floats) then still fit a CTA's shared memory
// (217 KB at N = 64; checked below).
constexpr int kMaxK = 480;

// 1 / (1 + 2^(-x log2 e)) with the SFU's approximate exponential and reciprocal (relative error
// a few float32 ulps, far below the 16-bit outputs' rounding; 1 / inf = 0 for very negative x).
// The IEEE division `1.f / (..)` compiles to a checked sequence with a slow-path call: with it,
// the per-element work (silu and its derivative over u's 6.3 M elements at m7c batch 16) made
// both kernels instruction-bound at about 35 us each (ncu, H100).
__device__ __forceinline__ float SigmoidOf(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.f + mma::Exp2(-1.4426950408889634f * x)));
  return r;
}

__device__ __forceinline__ uint32_t WordOf(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// The two 16-bit values of a 32-bit word as floats.
template <bool kBf16>
__device__ __forceinline__ float2 Unpack(uint32_t word) {
  if constexpr (kBf16) {
    __nv_bfloat162 v;
    memcpy(&v, &word, 4);
    return __bfloat1622float2(v);
  } else {
    __half2 v;
    memcpy(&v, &word, 4);
    return __half22float2(v);
  }
}

// The hidden bias of a piece's 8 columns (zeros without one).
struct PieceBias {
  float v[8];
  __device__ __forceinline__ PieceBias(const float* __restrict__ c, int col) {
    if (c != nullptr) {
      const float4 lo = __ldg(reinterpret_cast<const float4*>(c + col));
      const float4 hi = __ldg(reinterpret_cast<const float4*>(c + col) + 1);
      v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = 0.f;
    }
  }
  // The pre-activation of word w's two values: u + c, float32.
  template <bool kBf16>
  __device__ __forceinline__ float2 Add(uint32_t word, int w) const {
    const float2 u = Unpack<kBf16>(word);
    return make_float2(u.x + v[2 * w], u.y + v[2 * w + 1]);
  }
};

// silu of the 8 values of a piece plus their bias, rounded to 16 bits (as the unfused silu's
// output was).
template <bool kBf16>
__device__ __forceinline__ uint4 SiluPiece(const uint4& x, const PieceBias& c) {
  uint32_t out[4];
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const float2 v = c.Add<kBf16>(WordOf(x, w), w);
    out[w] = mma::Pack<kBf16>(v.x * SigmoidOf(v.x), v.y * SigmoidOf(v.y));
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Shared memory of the forward: each lane's own 16-byte pieces of its two rows, [warp][piece]
// [row a, b][lane] (consecutive lanes, consecutive 16 bytes), copied with cp.async so that all of
// a warp's row data is in flight at once (one load latency per warp, not one per piece).
//
// Both kernels first copy W into shared memory (rows up to N rounded up to 16, zeros past N):
// its pieces are then one 32-bit-addressed load each (from global memory, the 64-bit address
// arithmetic and null checks of eight rows made the forward's loop 343 instructions a piece
// instead of 240, static SASS).
// Row stride 32 mod 64 elements, so that the 8 lanes of a quarter warp (rows 8j + g, g = 0, 1;
// pieces c = 0..3) meet 8 different 16-byte bank groups.
__host__ __device__ constexpr int WStride(int K) { return K % 64 == 0 ? K + 32 : K; }
__host__ __device__ constexpr int WRows(int N) { return (N + 15) / 16 * 16; }
__host__ __device__ constexpr size_t WTileBytes(int N, int K) { return static_cast<size_t>(WRows(N)) * WStride(K) * 2; }

template <int kCtaThreads, typename scalar_t>
__device__ __forceinline__ void StageWeight(scalar_t* tile, const scalar_t* __restrict__ w, int N, int K) {
  const int chunks = K / 8, stride = WStride(K);
  for (int x = threadIdx.x; x < WRows(N) * chunks; x += kCtaThreads) {
    const int n = x / chunks, chunk = x % chunks;
    mma::CpAsync16(mma::SmemAddr(tile + n * stride + 8 * chunk), n < N ? w + n * K + 8 * chunk : w, n < N);
  }
}

size_t ForwardSmemBytes(int N, int K) {
  return WTileBytes(N, K) + static_cast<size_t>(kFwdWarps) * (K / 32) * 2 * 32 * 16;
}

template <typename scalar_t>
__global__ void __launch_bounds__(kFwdWarps * 32)
    GateHeadForwardKernel(const scalar_t* __restrict__ u, int64_t u_stride, const float* __restrict__ hidden_bias,
                          const scalar_t* __restrict__ w, const float* __restrict__ bias, scalar_t* __restrict__ gates,
                          int64_t M, int N, int K) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int64_t r0 = (static_cast<int64_t>(blockIdx.x) * kFwdWarps + warp) * 16;
  const int tiles = (N + 7) / 8, pieces = K / 32, ws = WStride(K);
  const int64_t ra = r0 + g, rb = r0 + g + 8;
  const scalar_t* row_a = ra < M ? u + ra * u_stride : nullptr;
  const scalar_t* row_b = rb < M ? u + rb * u_stride : nullptr;
  auto* w_tile = reinterpret_cast<scalar_t*>(smem_raw);
  StageWeight<kFwdWarps * 32>(w_tile, w, N, K);
  uint4* mine = reinterpret_cast<uint4*>(smem_raw + WTileBytes(N, K)) + warp * pieces * 64 + lane;
  for (int i = 0; i < pieces; ++i) {
    mma::CpAsync16(mma::SmemAddr(mine + 64 * i), row_a ? row_a + 32 * i + 8 * c : u, row_a != nullptr);
    mma::CpAsync16(mma::SmemAddr(mine + 64 * i + 32), row_b ? row_b + 32 * i + 8 * c : u, row_b != nullptr);
  }
  mma::CpAsyncCommit();
  mma::CpAsyncWaitAll();
  __syncthreads();  // W, copied by all
  if (r0 >= M) return;  // the whole warp
  const scalar_t* w_lane = w_tile + g * ws + 8 * c;  // row g's piece c

  float acc[kMaxTiles][4] = {};
  for (int i = 0; i < pieces; ++i) {
    const PieceBias cb(hidden_bias, 32 * i + 8 * c);
    const uint4 sa = SiluPiece<kBf16>(mine[64 * i], cb);
    const uint4 sb = SiluPiece<kBf16>(mine[64 * i + 32], cb);
    // W row n = 8j + g is the B operand's column g of tile j. Every tile's load is issued
    // before the first product (predicated, not behind a branch per tile).
    uint4 wr[kMaxTiles];
#pragma unroll
    for (int j = 0; j < kMaxTiles; ++j) {
      wr[j] = j < tiles ? *reinterpret_cast<const uint4*>(w_lane + 8 * j * ws + 32 * i) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int j = 0; j < kMaxTiles; ++j) {
      if (j >= tiles) break;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mma::Mma<kBf16>(acc[j], WordOf(sa, 2 * h), WordOf(sb, 2 * h), WordOf(sa, 2 * h + 1), WordOf(sb, 2 * h + 1),
                        WordOf(wr[j], 2 * h), WordOf(wr[j], 2 * h + 1));
      }
    }
  }
  // acc[j]: (row a, outputs 8j + 2c, +1), (row b, the same); N is even, so a pair is whole.
#pragma unroll
  for (int j = 0; j < kMaxTiles; ++j) {
    const int n = 8 * j + 2 * c;
    if (j >= tiles || n >= N) continue;
    const float b0 = bias[n], b1 = bias[n + 1];
    if (row_a) {
      *reinterpret_cast<uint32_t*>(gates + ra * N + n) =
          mma::Pack<kBf16>(SigmoidOf(acc[j][0] + b0), SigmoidOf(acc[j][1] + b1));
    }
    if (row_b) {
      *reinterpret_cast<uint32_t*>(gates + rb * N + n) =
          mma::Pack<kBf16>(SigmoidOf(acc[j][2] + b0), SigmoidOf(acc[j][3] + b1));
    }
  }
}

// Shared memory of the backward: silu(u) [kBwdRows][K + 8] and dz [kBwdRows][NP + 8] (16-bit;
// rows 16 bytes longer than their data, so that ldmatrix's 8 row addresses, an odd number of
// 16-byte units apart, meet 8 different bank groups), the warps' db sums [kBwdWarps][kMaxN],
// their dc sums [kBwdWarps][K] (float32) and W.
struct BwdSmem {
  int s_stride, dz_stride;  // elements
  size_t s_bytes, dz_bytes;
  __host__ __device__ constexpr BwdSmem(int N, int K)
      : s_stride(K + 8),
        dz_stride((N + 15) / 16 * 16 + 8),
        s_bytes(static_cast<size_t>(kBwdRows) * (K + 8) * 2),
        dz_bytes(static_cast<size_t>(kBwdRows) * ((N + 15) / 16 * 16 + 8) * 2) {}
  __host__ __device__ constexpr size_t DbBytes() const { return kBwdWarps * kMaxN * sizeof(float); }
  __host__ __device__ constexpr size_t DcOffset() const { return s_bytes + dz_bytes + DbBytes(); }
  // Then W's tile (StageWeight).
  __host__ __device__ constexpr size_t WOffset(int K) const {
    return DcOffset() + static_cast<size_t>(kBwdWarps) * K * 4;
  }
};
constexpr size_t BackwardSmemBytes(int N, int K) { return BwdSmem(N, K).WOffset(K) + WTileBytes(N, K); }
// The opt-in limit of a CTA's shared memory on sm_90 (227 KB).
static_assert(BackwardSmemBytes(kMaxN, kMaxK) <= 232448, "the gate head's backward must fit a CTA");

// The sum over a warp's 8 lanes of one c (lanes c, c + 4, .., c + 28) of each lane's 8 values,
// scattered: lane g ends with the sum of value g (7 shuffles, a fixed order).
__device__ __forceinline__ float ReduceScatter8(const float (&v)[8], int g) {
  const bool b2 = (g & 4) != 0, b1 = (g & 2) != 0, b0 = (g & 1) != 0;
  float h[4], q[2];
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = (b2 ? v[4 + j] : v[j]) + __shfl_xor_sync(0xffffffffu, b2 ? v[j] : v[4 + j], 16);
#pragma unroll
  for (int j = 0; j < 2; ++j) q[j] = (b1 ? h[2 + j] : h[j]) + __shfl_xor_sync(0xffffffffu, b1 ? h[j] : h[2 + j], 8);
  return (b0 ? q[1] : q[0]) + __shfl_xor_sync(0xffffffffu, b0 ? q[0] : q[1], 4);
}

// partial: [gridDim.x][N K + N + K] float32, each CTA's dW (row-major like W), db, then dc.
template <typename scalar_t>
__global__ void __launch_bounds__(kBwdWarps * 32)
    GateHeadBackwardKernel(const scalar_t* __restrict__ dgates, const scalar_t* __restrict__ gates,
                           const scalar_t* __restrict__ u, int64_t u_stride, const float* __restrict__ hidden_bias,
                           const scalar_t* __restrict__ w, scalar_t* __restrict__ du, int64_t du_stride,
                           float* __restrict__ partial, int64_t M, int N, int K) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, at::BFloat16>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const BwdSmem layout(N, K);
  auto* s_tile = reinterpret_cast<scalar_t*>(smem_raw);
  auto* dz_tile = reinterpret_cast<scalar_t*>(smem_raw + layout.s_bytes);
  auto* db_sums = reinterpret_cast<float*>(smem_raw + layout.s_bytes + layout.dz_bytes);
  auto* dc_sums = reinterpret_cast<float*>(smem_raw + layout.DcOffset());
  auto* w_tile = reinterpret_cast<scalar_t*>(smem_raw + layout.WOffset(K));

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int np16 = (N + 15) / 16;
  const int local_a = warp * 16 + g, local_b = local_a + 8;  // the lane's rows in the tiles
  const int64_t ra = static_cast<int64_t>(blockIdx.x) * kBwdRows + local_a, rb = ra + 8;
  const bool has_a = ra < M, has_b = rb < M;
  const scalar_t* row_a = has_a ? u + ra * u_stride : nullptr;
  const scalar_t* row_b = has_b ? u + rb * u_stride : nullptr;

  // W, and the lane's pieces of u (its two rows, columns 32i + 8c .. +7) into their places in
  // the silu(u) tile, all in flight while dz is worked out (rows past M read as zeros); silu(u)
  // then replaces them in place.
  StageWeight<kBwdWarps * 32>(w_tile, w, N, K);
  for (int i = 0; i < K / 32; ++i) {
    const int col = 32 * i + 8 * c;
    mma::CpAsync16(mma::SmemAddr(s_tile + local_a * layout.s_stride + col), has_a ? row_a + col : u, has_a);
    mma::CpAsync16(mma::SmemAddr(s_tile + local_b * layout.s_stride + col), has_b ? row_b + col : u, has_b);
  }
  mma::CpAsyncCommit();

  // dz = dg g (1 - g) at (rows a, b; outputs 8j + 2c, +1), zero past N and M, rounded to 16 bits
  // once: the products and the bias sum all use the rounded values.
  uint32_t dz_words[kMaxTiles][2];
  float db_part[kMaxTiles][2];
#pragma unroll
  for (int j = 0; j < kMaxTiles; ++j) {
    const int n = 8 * j + 2 * c;
    float za[2] = {0.f, 0.f}, zb[2] = {0.f, 0.f};
    if (n < N) {
      if (has_a) {
        const float2 d = Unpack<kBf16>(*reinterpret_cast<const uint32_t*>(dgates + ra * N + n));
        const float2 y = Unpack<kBf16>(*reinterpret_cast<const uint32_t*>(gates + ra * N + n));
        za[0] = d.x * y.x * (1.f - y.x);
        za[1] = d.y * y.y * (1.f - y.y);
      }
      if (has_b) {
        const float2 d = Unpack<kBf16>(*reinterpret_cast<const uint32_t*>(dgates + rb * N + n));
        const float2 y = Unpack<kBf16>(*reinterpret_cast<const uint32_t*>(gates + rb * N + n));
        zb[0] = d.x * y.x * (1.f - y.x);
        zb[1] = d.y * y.y * (1.f - y.y);
      }
    }
    dz_words[j][0] = mma::Pack<kBf16>(za[0], za[1]);
    dz_words[j][1] = mma::Pack<kBf16>(zb[0], zb[1]);
    const float2 qa = Unpack<kBf16>(dz_words[j][0]), qb = Unpack<kBf16>(dz_words[j][1]);
    db_part[j][0] = qa.x + qb.x;
    db_part[j][1] = qa.y + qb.y;
    if (8 * j < np16 * 16) {
      *reinterpret_cast<uint32_t*>(dz_tile + local_a * layout.dz_stride + n) = dz_words[j][0];
      *reinterpret_cast<uint32_t*>(dz_tile + local_b * layout.dz_stride + n) = dz_words[j][1];
    }
  }
  // db: the lane's two rows, then the warp's 16 (lanes of one c hold the same outputs).
#pragma unroll
  for (int j = 0; j < kMaxTiles; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float v = db_part[j][e];
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      v += __shfl_xor_sync(0xffffffffu, v, 8);
      v += __shfl_xor_sync(0xffffffffu, v, 16);
      if (g == 0) db_sums[warp * kMaxN + 8 * j + 2 * c + e] = v;
    }
  }

  // du = (dz W) silu'(u + c), one 32-column piece at a time; silu(u + c) into the tile for dW.
  mma::CpAsyncWaitAll();
  __syncthreads();  // W, copied by all
  const int ws = WStride(K);
  const scalar_t* w_lane = w_tile + g * ws + 8 * c;  // row g's piece c
  for (int i = 0; i < K / 32; ++i) {
    const int col = 32 * i + 8 * c;
    uint4* tile_a = reinterpret_cast<uint4*>(s_tile + local_a * layout.s_stride + col);
    uint4* tile_b = reinterpret_cast<uint4*>(s_tile + local_b * layout.s_stride + col);
    const uint4 xa = *tile_a, xb = *tile_b;
    // W rows 8j + g: after the transposes, the B operand's k rows of k step j / 2. All loads
    // are issued before the first product.
    uint4 wr[kMaxTiles];
#pragma unroll
    for (int j = 0; j < kMaxTiles; ++j) {
      wr[j] = j < 2 * np16 ? *reinterpret_cast<const uint4*>(w_lane + 8 * j * ws + 32 * i) : make_uint4(0, 0, 0, 0);
    }
    float acc[4][4] = {};
#pragma unroll
    for (int kk = 0; kk < kMaxTiles / 2; ++kk) {
      if (kk >= np16) break;
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        mma::Mma<kBf16>(acc[m], dz_words[2 * kk][0], dz_words[2 * kk][1], dz_words[2 * kk + 1][0],
                        dz_words[2 * kk + 1][1], mma::Transpose(WordOf(wr[2 * kk], m)),
                        mma::Transpose(WordOf(wr[2 * kk + 1], m)));
      }
    }
    // acc[m]: (row a, columns 32i + 8c + 2m, +1), (row b, the same): the lane's 8 columns.
    const PieceBias cb(hidden_bias, col);
    uint32_t dua[4], dub[4], sa[4], sb[4];
    float dc[8];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const float2 va = cb.Add<kBf16>(WordOf(xa, m), m), vb = cb.Add<kBf16>(WordOf(xb, m), m);
      const float ga0 = SigmoidOf(va.x), ga1 = SigmoidOf(va.y), gb0 = SigmoidOf(vb.x), gb1 = SigmoidOf(vb.y);
      dua[m] = mma::Pack<kBf16>(acc[m][0] * ga0 * (1.f + va.x * (1.f - ga0)),
                                acc[m][1] * ga1 * (1.f + va.y * (1.f - ga1)));
      dub[m] = mma::Pack<kBf16>(acc[m][2] * gb0 * (1.f + vb.x * (1.f - gb0)),
                                acc[m][3] * gb1 * (1.f + vb.y * (1.f - gb1)));
      sa[m] = mma::Pack<kBf16>(va.x * ga0, va.y * ga1);
      sb[m] = mma::Pack<kBf16>(vb.x * gb0, vb.y * gb1);
      // dc sums du as rounded (what the projection's backward reads); rows past M are zeros.
      const float2 qa = Unpack<kBf16>(dua[m]), qb = Unpack<kBf16>(dub[m]);
      dc[2 * m] = qa.x + qb.x;
      dc[2 * m + 1] = qa.y + qb.y;
    }
    dc_sums[warp * K + 32 * i + 8 * c + g] = ReduceScatter8(dc, g);
    if (has_a) *reinterpret_cast<uint4*>(du + ra * du_stride + col) = make_uint4(dua[0], dua[1], dua[2], dua[3]);
    if (has_b) *reinterpret_cast<uint4*>(du + rb * du_stride + col) = make_uint4(dub[0], dub[1], dub[2], dub[3]);
    *tile_a = make_uint4(sa[0], sa[1], sa[2], sa[3]);
    *tile_b = make_uint4(sb[0], sb[1], sb[2], sb[3]);
  }
  __syncthreads();

  float* out = partial + static_cast<int64_t>(blockIdx.x) * (static_cast<int64_t>(N) * K + N + K);
  if (threadIdx.x < N) {
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < kBwdWarps; ++k) v += db_sums[k * kMaxN + threadIdx.x];
    out[static_cast<int64_t>(N) * K + threadIdx.x] = v;
  }
  for (int x = threadIdx.x; x < K; x += kBwdWarps * 32) {
    float v = 0.f;
#pragma unroll
    for (int k = 0; k < kBwdWarps; ++k) v += dc_sums[k * K + x];
    out[static_cast<int64_t>(N) * K + N + x] = v;
  }

  // dW [N, K] = dz^T (N x 128 rows) . silu(u) (128 rows x K): warp takes the 8-column tiles t
  // = warp, warp + 8, ...; A = dz^T and B = silu(u) both by ldmatrix.trans of row-major tiles.
  const uint32_t s_base = mma::SmemAddr(s_tile), dz_base = mma::SmemAddr(dz_tile);
  const int mat = lane / 8, mat_row = lane % 8;
  for (int t = warp; t < K / 8; t += kBwdWarps) {
    float acc[kMaxTiles / 2][4] = {};
#pragma unroll
    for (int ks = 0; ks < kBwdRows / 16; ks += 2) {
      // B for row steps ks and ks + 1: lane l gives the address of tile row 16 ks + l.
      uint32_t b[4];
      mma::LdMatrixX4Trans(b, s_base + ((16 * ks + lane) * layout.s_stride + 8 * t) * 2);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row0 = 16 * (ks + half);
#pragma unroll
        for (int mt = 0; mt < kMaxTiles / 2; ++mt) {
          if (mt >= np16) break;
          // Matrices (outputs 16mt + 0..7 | + 8..15) x (rows + 0..7 | + 8..15), in A's order.
          uint32_t a[4];
          const int row = row0 + mat_row + (mat >= 2 ? 8 : 0), col = 16 * mt + (mat & 1 ? 8 : 0);
          mma::LdMatrixX4Trans(a, dz_base + (row * layout.dz_stride + col) * 2);
          mma::Mma<kBf16>(acc[mt], a[0], a[1], a[2], a[3], b[2 * half], b[2 * half + 1]);
        }
      }
    }
    // acc[mt]: (output 16mt + g, columns 8t + 2c, +1), (output 16mt + g + 8, the same).
#pragma unroll
    for (int mt = 0; mt < kMaxTiles / 2; ++mt) {
      if (mt >= np16) break;
      const int n = 16 * mt + g, col = 8 * t + 2 * c;
      if (n < N) *reinterpret_cast<float2*>(out + static_cast<int64_t>(n) * K + col) = make_float2(acc[mt][0], acc[mt][1]);
      if (n + 8 < N) {
        *reinterpret_cast<float2*>(out + static_cast<int64_t>(n + 8) * K + col) = make_float2(acc[mt][2], acc[mt][3]);
      }
    }
  }
}

// W as the kernels read it: [N, K] contiguous 16-bit rows on 16-byte boundaries.
at::Tensor KernelWeight(const at::Tensor& w16, const at::Tensor& u) {
  auto w = w16.to(u.scalar_type()).contiguous();
  return AlignedFor(w, 8) ? w : w.clone();
}

// No hidden bias: undefined, or empty (what an autograd node takes for "none").
bool HasHiddenBias(const at::Tensor& hidden_bias) { return hidden_bias.defined() && hidden_bias.numel() > 0; }

// c as the kernels read it: float32 [K], contiguous, on a 16-byte boundary; undefined without one.
at::Tensor KernelHiddenBias(const at::Tensor& hidden_bias) {
  if (!HasHiddenBias(hidden_bias)) return {};
  auto c = hidden_bias.to(at::kFloat).contiguous().view({-1});
  return AlignedFor(c, 4) ? c : c.clone();
}

}  // namespace

bool GateHeadTakes(const at::Tensor& u, int64_t outputs) {
  if (!u.is_cuda() || (u.scalar_type() != at::kBFloat16 && u.scalar_type() != at::kHalf) || u.numel() == 0) {
    return false;
  }
  const int64_t K = u.size(-1), stride = CollapsedRowStride(u);
  return K % 32 == 0 && K <= kMaxK && stride >= 0 && stride % 8 == 0 && AlignedFor(u, 8) &&
         outputs >= 2 && outputs <= kMaxN && outputs % 2 == 0 && u.numel() / K < (int64_t{1} << 31);
}

at::Tensor GateHeadForward(const at::Tensor& u, const at::Tensor& hidden_bias, const at::Tensor& w16,
                           const at::Tensor& bias) {
  const int64_t N = w16.size(0), K = u.size(-1);
  TORCH_CHECK(GateHeadTakes(u, N) && w16.dim() == 2 && w16.size(1) == K && bias.numel() == N &&
                  (!HasHiddenBias(hidden_bias) || hidden_bias.numel() == K),
              "GateHeadForward: u [.., K] (bf16/fp16, rows of one 16-byte-aligned stride, K a multiple of 32), "
              "hidden bias [K] or none, weight [N, K] and bias [N] with N even and at most ", kMaxN, "; got u ",
              u.sizes(), " strides ", u.strides(), ", hidden bias ",
              HasHiddenBias(hidden_bias) ? hidden_bias.sizes() : at::IntArrayRef(), ", weight ", w16.sizes(), ", bias ",
              bias.sizes());
  const int64_t M = u.numel() / K;
  const auto w = KernelWeight(w16, u);
  const auto c = KernelHiddenBias(hidden_bias);
  const auto b = bias.to(at::kFloat).contiguous();
  auto sizes = u.sizes().vec();
  sizes.back() = N;
  auto gates = at::empty(sizes, u.options());
  const dim3 grid(static_cast<unsigned>((M + kFwdWarps * 16 - 1) / (kFwdWarps * 16)));
  AT_DISPATCH_REDUCED_FLOATING_TYPES(u.scalar_type(), "nsa_gate_head_forward", [&] {
    LaunchKernel(GateHeadForwardKernel<scalar_t>, grid, kFwdWarps * 32, ForwardSmemBytes(static_cast<int>(N), static_cast<int>(K)),
                 u.data_ptr<scalar_t>(), CollapsedRowStride(u), c.defined() ? c.data_ptr<float>() : nullptr,
                 w.data_ptr<scalar_t>(), b.data_ptr<float>(), gates.data_ptr<scalar_t>(), M, static_cast<int>(N),
                 static_cast<int>(K));
  });
  return gates;
}

GateHeadGrads GateHeadBackward(const at::Tensor& dgates_in, const at::Tensor& gates, const at::Tensor& u,
                               const at::Tensor& hidden_bias, const at::Tensor& w16, const at::Tensor& du_out) {
  const int64_t N = w16.size(0), K = u.size(-1), M = u.numel() / K;
  TORCH_CHECK(GateHeadTakes(u, N) && gates.numel() == M * N && dgates_in.numel() == M * N &&
                  (!HasHiddenBias(hidden_bias) || hidden_bias.numel() == K),
              "GateHeadBackward: the forward's u, hidden bias and gates, and a gradient of the gates' shape");
  const auto dgates = dgates_in.to(u.scalar_type()).contiguous();
  const auto y = gates.contiguous();
  const auto w = KernelWeight(w16, u);
  const auto c = KernelHiddenBias(hidden_bias);
  auto du = du_out.defined() ? du_out : at::empty(u.sizes(), u.options());
  const int64_t du_stride = CollapsedRowStride(du);
  TORCH_CHECK(du.sizes() == u.sizes() && du.scalar_type() == u.scalar_type() && du.device() == u.device() &&
                  du_stride >= 0 && du_stride % 8 == 0 && AlignedFor(du, 8),
              "GateHeadBackward: du_out must be u's shape and dtype, rows of one 16-byte-aligned stride; got ",
              du.scalar_type(), " ", du.sizes(), " strides ", du.strides());
  const auto fopts = u.options().dtype(at::kFloat);
  GateHeadGrads grads;
  grads.du = du;
  grads.dw = at::empty({N, K}, fopts);
  grads.db = at::empty({N}, fopts);
  // dc is summed with or without a hidden bias (a few columns more of the reduction).
  auto dc = at::empty({K}, fopts);
  const int64_t ctas = (M + kBwdRows - 1) / kBwdRows;
  const int64_t width = N * K + N + K;
  auto partial = at::empty({ctas, width}, fopts);
  AT_DISPATCH_REDUCED_FLOATING_TYPES(u.scalar_type(), "nsa_gate_head_backward", [&] {
    LaunchKernel(GateHeadBackwardKernel<scalar_t>, dim3(static_cast<unsigned>(ctas)), kBwdWarps * 32,
                 BackwardSmemBytes(static_cast<int>(N), static_cast<int>(K)), dgates.data_ptr<scalar_t>(),
                 y.data_ptr<scalar_t>(), u.data_ptr<scalar_t>(), CollapsedRowStride(u),
                 c.defined() ? c.data_ptr<float>() : nullptr, w.data_ptr<scalar_t>(), du.data_ptr<scalar_t>(),
                 du_stride, partial.data_ptr<float>(), M, static_cast<int>(N), static_cast<int>(K));
  });
  SumParts(partial, {grads.dw, grads.db, dc});
  if (HasHiddenBias(hidden_bias)) grads.dc = dc;
  return grads;
}

}  // namespace nsad::nsa::cuda::detail
