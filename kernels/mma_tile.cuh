// Tensor-core (mma.sync m16n8k16, fp32 accumulate) building blocks for the bf16/fp16 paths
// of the selected and compressed attention kernels. fp32 inputs keep the scalar kernels of
// attention_tile.cuh.
//
// Most of this is warp-level and works straight from registers: operands are loaded from
// global memory (L1/L2) with 16-byte loads into mma fragments, no shared-memory staging
// (the cp.async / ldmatrix helpers further down serve the compressed branch's kernels,
// whose warps share staged tiles and use the standard fragment layout instead).
// Two facts make that possible:
//   * In S = Q K^T the contraction runs over head_dim, and the order of a contraction does
//     not matter as long as both operands use the same one. So each lane loads 16-byte
//     pieces of its Q and K rows (physical columns 32i + 8c .. 32i + 8c + 7, c = lane % 4)
//     and those are used as the fragments' logical columns: every load is a plain,
//     coalesced 16-byte load and no shuffle is needed.
//   * O = P V contracts over keys, and V is stored key-major, so its fragments need a
//     transpose: each lane loads 16-byte pieces of V rows the same way and
//     movmatrix.trans (an 8x8 in-register transpose) turns them into B fragments. The
//     output columns come out in a known permutation that maps back to 16 contiguous bytes
//     per lane and row again, so stores are 16 bytes wide too.
// Query rows are the M dimension (16 per warp): the heads of one GQA group for the selected
// branch (padded to 16), flattened (position, head) rows for the compressed branch.
//
// Fragment layout of m16n8k16 (g = lane / 4, c = lane % 4), used throughout:
//   A (16x16): a0a1 (row g, k 2c..2c+1), a2a3 (row g+8, same k), a4a5 (row g, k 2c+8..),
//              a6a7 (row g+8, k 2c+8..)            B (16x8): b0b1 (k 2c.., n g), b2b3 (k 2c+8.., n g)
//   C (16x8):  c0c1 (row g, n 2c..2c+1), c2c3 (row g+8, same n)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include <c10/util/BFloat16.h>

#include "attention_tile.cuh"

namespace nsad::nsa::cuda::detail::mma {

constexpr int kWarps = 4;                 // warps per CTA of every tensor-core kernel
constexpr int kMmaThreads = kWarps * 32;  // threads per CTA
constexpr int kTileRows = kWarps * 16;    // query rows per CTA on the compressed side

// Keys processed per step: 64 at D=64, 32 at D=128, so that one step's K (or V) fragments
// take 64 registers per lane either way.
template <int D>
constexpr int KeysPerStep() {
  return 4096 / D;
}

template <bool kBf16>
__device__ __forceinline__ void Mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                    uint32_t b0, uint32_t b1) {
  if constexpr (kBf16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 8x8 16-bit transpose across the warp: lane (g, c) gets elements [2c][g], [2c+1][g].
__device__ __forceinline__ uint32_t Transpose(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Two floats as one 16-bit pair, the lower index in the low half (fragment order).
template <bool kBf16>
__device__ __forceinline__ uint32_t Pack(float lo, float hi) {
  uint32_t r;
  if constexpr (kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&r, &v, 4);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&r, &v, 4);
  }
  return r;
}

// The A fragment of a 16x16 piece whose two 8-column halves are the C fragments lo and hi,
// rounded to 16 bits: an MMA's output fed straight into the next one (P or dS, as
// FlashAttention-2 does).
template <bool kBf16>
__device__ __forceinline__ void PackA(uint32_t (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = Pack<kBf16>(lo[0], lo[1]);
  a[1] = Pack<kBf16>(lo[2], lo[3]);
  a[2] = Pack<kBf16>(hi[0], hi[1]);
  a[3] = Pack<kBf16>(hi[2], hi[3]);
}

// A lane's share of one row of D 16-bit elements: physical columns 32i + 8c .. +7 in c[i].
template <int D>
struct RowFrag {
  uint4 c[D / 32];
  // 32-bit word w (0..3) of piece i: columns 32i + 8c + 2w, +1.
  __device__ __forceinline__ uint32_t Word(int i, int w) const {
    return w == 0 ? c[i].x : w == 1 ? c[i].y : w == 2 ? c[i].z : c[i].w;
  }
};

// Loads the lane's pieces of a row (16-byte loads; a warp's 4 lanes of a row read 64
// contiguous bytes per load). A null row gives zeros.
template <int D>
__device__ __forceinline__ void LoadRow(RowFrag<D>& r, const void* row, int lane) {
  const uint4* p = static_cast<const uint4*>(row);
#pragma unroll
  for (int i = 0; i < D / 32; ++i) r.c[i] = row ? __ldg(p + 4 * i + (lane & 3)) : make_uint4(0, 0, 0, 0);
}

// Stores a lane's 8 accumulator columns per piece i (the layout PV / dS K produce) for one
// row: acc[4i + m][2*half + 0..1] are physical columns 32i + 8c + 2m + 0..1.
template <bool kBf16, int D>
__device__ __forceinline__ void StoreRow(void* row, const float (&acc)[D / 8][4], int half, float mul,
                                         int lane) {
  uint4* p = static_cast<uint4*>(row);
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    uint4 v;
    v.x = Pack<kBf16>(acc[4 * i + 0][2 * half] * mul, acc[4 * i + 0][2 * half + 1] * mul);
    v.y = Pack<kBf16>(acc[4 * i + 1][2 * half] * mul, acc[4 * i + 1][2 * half + 1] * mul);
    v.z = Pack<kBf16>(acc[4 * i + 2][2 * half] * mul, acc[4 * i + 2][2 * half + 1] * mul);
    v.w = Pack<kBf16>(acc[4 * i + 3][2 * half] * mul, acc[4 * i + 3][2 * half + 1] * mul);
    p[4 * i + (lane & 3)] = v;
  }
}

// s[j] += Q (16 rows: qa row g, qb row g+8) . K row (8j + g) for every 8-key tile j.
template <bool kBf16, int D>
__device__ __forceinline__ void QKTile(float (&s)[4], const RowFrag<D>& qa, const RowFrag<D>& qb,
                                       const RowFrag<D>& kr) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      Mma<kBf16>(s, qa.Word(i, 2 * h), qb.Word(i, 2 * h), qa.Word(i, 2 * h + 1), qb.Word(i, 2 * h + 1),
                 kr.Word(i, 2 * h), kr.Word(i, 2 * h + 1));
    }
  }
}

// acc += P (16 rows x kN keys, C-fragment floats p[j][*] of 8-key tile j) . R, where R's
// rows (keys 8j + g of the step) were loaded into rows[j] with LoadRow. acc uses StoreRow's
// column layout.
template <bool kBf16, int D, int kN>
__device__ __forceinline__ void PRTile(float (&acc)[D / 8][4], const float (&p)[kN / 8][4],
                                       const RowFrag<D> (&rows)[kN / 8]) {
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    uint32_t a[4];
    PackA<kBf16>(a, p[2 * kk], p[2 * kk + 1]);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        Mma<kBf16>(acc[4 * i + m], a[0], a[1], a[2], a[3], Transpose(rows[2 * kk].Word(i, m)),
                   Transpose(rows[2 * kk + 1].Word(i, m)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------
// Shared-memory staging for kernels whose warps share one key/value tile (compressed
// branch): cp.async copies 16-byte chunks global -> shared without a register round trip,
// ldmatrix hands them out as mma fragments. A staged row of D 16-bit elements is D / 8
// chunks; chunk c of row r sits at chunk c ^ (r % 8) so the 8 row addresses of one ldmatrix
// (same logical chunk, consecutive rows) hit 8 different bank groups.

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Copies 16 bytes, or writes 16 zero bytes when !valid (src is then not read).
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}
// Copies 4 bytes, or writes 4 zero bytes when !valid. Through L1 (.ca): cp.async.cg takes
// 16 bytes only.
__device__ __forceinline__ void CpAsync4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(SmemAddr(smem)), "l"(gmem), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void CpAsyncWaitAll() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
// Tiles [0, tiles) through shared memory: stage(t) issues tile t's cp.async copy. The barrier
// before each tile publishes it to the whole CTA; landed() runs between this thread's copies
// arriving and that barrier (a proxy fence, where the tensor cores read the tile: wgmma.cuh).
// - Two buffers (kOneBuffer false): body(t) works on tile t while tile t + 1's copy is in
//   flight; the barrier also tells everyone the other buffer is free again.
// - One buffer (kOneBuffer true): body(t, refill) works on tile t and calls refill() once,
//   CTA-uniformly, when no thread reads the tile any more; refill's barrier says so, and tile
//   t + 1's copy then runs under the rest of body(t). One buffer where two would cost an SM a
//   CTA (CmpImportanceLaneWgmmaKernel at head_dim 128; at 64 it runs as fast as two).
template <bool kOneBuffer = false, typename Stage, typename Body, typename Landed>
__device__ __forceinline__ void ForEachStagedTile(int tiles, const Stage& stage, const Body& body,
                                                  const Landed& landed) {
  if (tiles > 0) {
    stage(0);
    CpAsyncCommit();
  }
  for (int tile = 0; tile < tiles; ++tile) {
    CpAsyncWaitAll();
    landed();
    __syncthreads();
    const auto stage_next = [&] {
      if (tile + 1 < tiles) stage(tile + 1);
      CpAsyncCommit();
    };
    if constexpr (kOneBuffer) {
      body(tile, [&] {
        __syncthreads();
        stage_next();
      });
    } else {
      stage_next();
      body(tile);
    }
  }
}
template <typename Stage, typename Body>
__device__ __forceinline__ void ForEachStagedTile(int tiles, const Stage& stage, const Body& body) {
  ForEachStagedTile(tiles, stage, body, [] {});
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
// One step of a double-buffered row loop: issues the copy of the rows after [r0, r0 + step)
// into the other buffer (stage(r1, buf), which commits its group), if there are any, then
// waits for this step's rows. The caller's barrier follows.
template <typename Stage>
__device__ __forceinline__ void StageNextAndWait(int r0, int step, int total, int buf, Stage&& stage) {
  if (r0 + step < total) {
    stage(r0 + step, buf ^ 1);  // the buffer the previous step read; freed by its barrier
    CpAsyncWait<1>();
  } else {
    CpAsyncWait<0>();
  }
}

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled tile of D-element rows.
template <int D>
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int chunk) {
  return static_cast<uint32_t>(row * (D * 2) + ((chunk ^ (row & 7)) << 4));
}

// Issues the cp.async copies of rows [0, kRows) of a tile (row i at src + i * stride
// elements) into a swizzled tile at smem address dst; rows >= count are zero-filled so
// that masked products never meet NaN garbage. All threads of the CTA take part, or the
// kCtaThreads threads numbered tid = 0 .. kCtaThreads - 1 of a warp-specialised kernel.
template <int D, int kRows, int kCtaThreads, typename scalar_t>
__device__ __forceinline__ void StageTileAsync(uint32_t dst, const scalar_t* src, int64_t stride,
                                               int count, int tid = static_cast<int>(threadIdx.x)) {
  constexpr int kChunks = D / 8;
  static_assert(kRows * kChunks % kCtaThreads == 0, "whole chunks per thread");
#pragma unroll
  for (int it = 0; it < kRows * kChunks / kCtaThreads; ++it) {
    const int i = tid + it * kCtaThreads;
    const int row = i / kChunks, chunk = i % kChunks;
    const bool ok = row < count;
    CpAsync16(dst + SwizzledOffset<D>(row, chunk), ok ? src + row * stride + chunk * 8 : src, ok);
  }
}

// StageTileAsync for a kernel that stages many tiles of the same shape: a thread's chunks land
// at the same swizzled offsets and come from the same element offsets from the tile's first
// row in every tile, so they are worked out once (the per-tile index and 64-bit address
// arithmetic was about a sixth of the tiled forward's instructions). A thread's chunks are
// kRowsPerPass rows apart, a multiple of the swizzle's 8-row period, so one chunk's offsets
// give the others'. Per tile, Issue adds the first row's address and tests the thread's rows
// against the tile's count.
template <int D, int kRows, int kCtaThreads>
struct TileCopyPlan {
  static constexpr int kChunks = D / 8;
  static constexpr int kRowsPerPass = kCtaThreads / kChunks;
  static_assert(kCtaThreads % kChunks == 0 && kRowsPerPass % 8 == 0 && kRows % kRowsPerPass == 0,
                "whole rows per pass, passes in the swizzle's phase");
  uint32_t dst;  // swizzled byte offset of the thread's first chunk in the tile
  int src;       // its element offset from the tile's first row
  int row;
  int pass_src;  // kRowsPerPass rows, in elements

  // stride: elements between consecutive rows (kRows * stride must fit an int).
  __device__ __forceinline__ explicit TileCopyPlan(int stride) {
    const int chunk = static_cast<int>(threadIdx.x) % kChunks;
    row = static_cast<int>(threadIdx.x) / kChunks;
    dst = SwizzledOffset<D>(row, chunk);
    src = row * stride + chunk * 8;
    pass_src = kRowsPerPass * stride;
  }
  // Copies rows [0, count) of the tile whose row 0 is at first_row into the tile at smem
  // address tile; rows >= count are zero-filled. The caller commits.
  template <typename scalar_t>
  __device__ __forceinline__ void Issue(uint32_t tile, const scalar_t* first_row, int count) const {
#pragma unroll
    for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
      const bool ok = row + pass * kRowsPerPass < count;
      CpAsync16(tile + dst + pass * kRowsPerPass * D * 2, ok ? first_row + src + pass * pass_src : first_row, ok);
    }
  }
};

// 2^x on the SFU (ex2.approx.ftz, relative error ~2^-22; results below 2^-126 flush to 0,
// far under what a bf16/fp16 softmax keeps). exp2f compiles to ex2.approx without ftz, whose
// denormal handling adds three instructions per element: more than the rest of the
// per-element softmax in these kernels.
__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) and 1 / x on the SFU, for a softmax row's sum (l >= 1) when a 16-bit forward stores
// its rows: lg2.approx.ftz (absolute error about 2^-22 near 1, 2 ulp elsewhere) and
// rcp.approx.ftz (1 ulp). log2f and 1.f / l compile to about 30 and 10 instructions with their
// special cases. In smem_fwd::FinishStaged, ncu at 64k 12:2 (forty-third session): the selected
// block kernel 1.06 -> 1.01 ms at D = 64 (611 M -> 563 M warp instructions), 1.95 -> 1.86 ms
// at D = 128; the local-blocks kernel 152 -> 146 us and 297 -> 285 us; the window's tiled
// forward 352-356 -> 343 us and 649-654 -> 641 us.
__device__ __forceinline__ float Log2(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float Rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// How a forward finishes a softmax row from its running max m (log2 domain) and its sum l: the
// factor its output is scaled by (1 / l) and its log2-sum-exp (m + log2 l). A row no key reached
// (l = 0) gets 0 and +inf: its output is zero, and the backward and the combine read +inf as
// "attended nothing". Every forward (FwdFinish, smem_fwd::Finish and FinishStaged, the one-pass
// compressed kernel, the selected partials' combine) finishes its rows here.
struct RowFinish {
  float inv, lse;
};
__device__ __forceinline__ RowFinish FinishRow(float m, float l) {
  return l > 0.f ? RowFinish{Rcp(l), m + Log2(l)} : RowFinish{0.f, INFINITY};
}

__device__ __forceinline__ float QuadMax(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}
__device__ __forceinline__ float QuadSum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// Online-softmax forward state of a lane: its two rows (g and g+8), O in StoreRow's layout.
template <int D>
struct FwdState {
  float o[D / 8][4];
  float m[2], l[2];  // running max (log2 units) and the lane's partial row sum
  __device__ __forceinline__ void Init() {
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
  }
};

// The online-softmax update of one m16 tile for a step of kN keys (s: its scores, C layout):
// scores `allowed(half, key)` rejects become -inf, the running max m (log2 units) and the
// lane's partial row sums l move on, O is rescaled, and s becomes P = exp2(s - max), ready
// for the P V product. The register kernels' (FwdStep); the shared-memory forwards take
// OnlineSoftmaxLazyRescale below. Moving FwdStep onto it too took ptxas's register counts
// of those kernels from 168-190 to 254-255: not done without a measurement.
template <int D, int kN, typename Allowed>
__device__ __forceinline__ void OnlineSoftmax(float (&s)[kN / 8][4], float (&o)[D / 8][4], float (&m)[2],
                                              float (&l)[2], float scale_log2, Allowed allowed, int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    // The max over the raw scores (scale_log2 > 0 keeps their order), so the scale folds into
    // one FMA per score below instead of a multiply and a subtraction.
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * half + e];
        x = allowed(half, 8 * j + 2 * c + e) ? x : -INFINITY;
        mx = fmaxf(mx, x);
      }
    }
    const float m_new = fmaxf(m[half], QuadMax(mx) * scale_log2);
    const float base = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: p = 0
    const float alpha = Exp2(m[half] - base);
    float sum = 0.f;
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * half + e];
        x = Exp2(fmaf(x, scale_log2, -base));
        sum += x;
      }
    }
    l[half] = l[half] * alpha + sum;
    m[half] = m_new;
#pragma unroll
    for (int i = 0; i < D / 8; ++i) {
      o[i][2 * half] *= alpha;
      o[i][2 * half + 1] *= alpha;
    }
  }
}

// OnlineSoftmax with FlashAttention-4's lazy rescale: the reference a row's p are taken
// against (m) moves only when the row's max rises more than kLazyRescaleLog2 above it, and a
// warp rescales its O and l only when one of its rows does so; most blocks after a row's
// first skip the rescale (32 multiplies and two exponentials per lane and block at D = 64).
// Exact in real arithmetic: the softmax does not depend on the reference subtracted, and
// the log2-sum-exp is m + log2(l) for any m. The cost is p up to 2^8 instead of 1, which
// every type P is rounded to holds with the same relative precision, and l and O stay far
// from float32's range. The row max and sum each take two partial chains (half as many
// dependent steps; a deeper tree spilled at the wgmma kernel's 128 registers).
constexpr float kLazyRescaleLog2 = 8.f;

// kRowGate: each of the lane's rows sees all of the step's keys or none (sees[half]), so the
// mask is worked out per row, not per score: a row that sees none drops its max and takes
// p = 2^(0 x - inf) = 0 (its scores are finite: finite inputs, zero-filled rows).
// kFresh: the rows' first step (m = -inf, l = 0, O = 0 on entry, as State::Init leaves them).
// The reference is the step's max; nothing is rescaled, so O stays a known zero until P V.
template <int D, int kN, bool kRowGate, bool kFresh, typename Allowed>
__device__ __forceinline__ void OnlineSoftmaxLazyRescaleImpl(float (&s)[kN / 8][4], float (&o)[D / 8][4],
                                                             float (&m)[2], float (&l)[2], float scale_log2,
                                                             Allowed allowed, const bool (&sees)[2], int lane) {
  const int c = lane & 3;
  float row_max[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * half + e];
        if constexpr (!kRowGate) x = allowed(half, 8 * j + 2 * c + e) ? x : -INFINITY;
        mx[e] = fmaxf(mx[e], x);
      }
    }
    row_max[half] = QuadMax(fmaxf(mx[0], mx[1])) * scale_log2;  // scale_log2 > 0 keeps the order
    if constexpr (kRowGate) row_max[half] = sees[half] ? row_max[half] : -INFINITY;
  }
  if constexpr (kFresh) {
    m[0] = row_max[0];
    m[1] = row_max[1];
  } else {
    // -inf + 8 is -inf: a row's first finite max always moves its reference.
    const bool rises = row_max[0] > m[0] + kLazyRescaleLog2 || row_max[1] > m[1] + kLazyRescaleLog2;
    if (__any_sync(0xffffffffu, rises)) {  // warp-uniform, so the skip saves the instructions
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const float m_new = fmaxf(m[half], row_max[half]);
        const float alpha = Exp2(m[half] - (m_new == -INFINITY ? 0.f : m_new));  // 0 from -inf
        l[half] *= alpha;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
          o[i][2 * half] *= alpha;
          o[i][2 * half + 1] *= alpha;
        }
        m[half] = m_new;
      }
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const bool off = kRowGate && !sees[half];
    const float mul = off ? 0.f : scale_log2;
    const float neg_base = off ? -INFINITY : (m[half] == -INFINITY ? 0.f : -m[half]);  // nothing seen: p = 0
    float sum[2] = {0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[j][2 * half + e];
        x = Exp2(fmaf(x, mul, neg_base));
        sum[j & 1] += x;
      }
    }
    l[half] += sum[0] + sum[1];
  }
}

// Scores allowed(half, key) rejects become -inf.
template <int D, int kN, bool kFresh = false, typename Allowed>
__device__ __forceinline__ void OnlineSoftmaxLazyRescale(float (&s)[kN / 8][4], float (&o)[D / 8][4],
                                                         float (&m)[2], float (&l)[2], float scale_log2,
                                                         Allowed allowed, int lane) {
  const bool all[2] = {true, true};
  OnlineSoftmaxLazyRescaleImpl<D, kN, false, kFresh>(s, o, m, l, scale_log2, allowed, all, lane);
}
// Row g + 8 half sees every score of the step if sees[half], else none.
template <int D, int kN>
__device__ __forceinline__ void OnlineSoftmaxLazyRescaleRows(float (&s)[kN / 8][4], float (&o)[D / 8][4],
                                                             float (&m)[2], float (&l)[2], float scale_log2,
                                                             const bool (&sees)[2], int lane) {
  OnlineSoftmaxLazyRescaleImpl<D, kN, true, false>(s, o, m, l, scale_log2, [](int, int) { return true; }, sees,
                                                   lane);
}

// One step of the forward over keys [key0, key0 + count) (count <= kN) whose rows start at
// k_rows / v_rows with a stride of `stride` elements. allowed(half, key) says whether the
// lane's row g + 8*half may attend step-relative key `key` (< count is checked here).
template <bool kBf16, int D, int kN, typename scalar_t, typename Allowed>
__device__ __forceinline__ void FwdStep(FwdState<D>& st, const RowFrag<D>& qa, const RowFrag<D>& qb,
                                        const scalar_t* k_rows, const scalar_t* v_rows, int64_t stride,
                                        int count, float scale_log2, Allowed allowed, int lane) {
  const int g = lane >> 2;
  float s[kN / 8][4];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    RowFrag<D> kr;
    const int key = 8 * j + g;
    LoadRow<D>(kr, key < count ? k_rows + key * stride : nullptr, lane);
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    QKTile<kBf16, D>(s[j], qa, qb, kr);
  }
  RowFrag<D> vr[kN / 8];  // issued before the softmax so the loads overlap it
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int key = 8 * j + g;
    LoadRow<D>(vr[j], key < count ? v_rows + key * stride : nullptr, lane);
  }
  OnlineSoftmax<D, kN>(s, st.o, st.m, st.l, scale_log2,
                       [&](int half, int key) { return key < count && allowed(half, key); }, lane);
  PRTile<kBf16, D, kN>(st.o, s, vr);
}

// Writes the lane's rows (out_row[half] null = padding row) and their log2-sum-exp (+inf for
// a row that attended nothing; its output is zero).
template <bool kBf16, int D, typename scalar_t>
__device__ __forceinline__ void FwdFinish(FwdState<D>& st, scalar_t* const (&out_row)[2],
                                          float* const (&lse_row)[2], int lane) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const RowFinish row = FinishRow(st.m[half], QuadSum(st.l[half]));
    if (out_row[half] == nullptr) continue;
    StoreRow<kBf16, D>(out_row[half], st.o, half, row.inv, lane);
    if ((lane & 3) == 0) *lse_row[half] = row.lse;
  }
}

// One step of dQ += dS K over keys [key0, key0 + count): recomputes P from the saved lse,
// dP = dO V^T, dS = P (dP - delta). lse/delta: the lane's two rows.
template <bool kBf16, int D, int kN, typename scalar_t, typename Allowed>
__device__ __forceinline__ void DqStep(float (&dq)[D / 8][4], const RowFrag<D>& qa, const RowFrag<D>& qb,
                                       const RowFrag<D>& da, const RowFrag<D>& db,
                                       const scalar_t* k_rows, const scalar_t* v_rows, int64_t stride,
                                       int count, float scale_log2, const float (&lse)[2],
                                       const float (&delta)[2], Allowed allowed, int lane) {
  const int g = lane >> 2, c = lane & 3;
  RowFrag<D> kr[kN / 8];
  float s[kN / 8][4], dp[kN / 8][4];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    const int key = 8 * j + g;
    LoadRow<D>(kr[j], key < count ? k_rows + key * stride : nullptr, lane);
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
    QKTile<kBf16, D>(s[j], qa, qb, kr[j]);
  }
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
    RowFrag<D> vr;
    const int key = 8 * j + g;
    LoadRow<D>(vr, key < count ? v_rows + key * stride : nullptr, lane);
    dp[j][0] = dp[j][1] = dp[j][2] = dp[j][3] = 0.f;
    QKTile<kBf16, D>(dp[j], da, db, vr);
  }
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int half = e >> 1, key = 8 * j + 2 * c + (e & 1);
      const bool ok = key < count && allowed(half, key);
      const float p = ok ? Exp2(s[j][e] * scale_log2 - lse[half]) : 0.f;
      s[j][e] = p * (dp[j][e] - delta[half]);  // dS
    }
  }
  PRTile<kBf16, D, kN>(dq, s, kr);
}

// Adds a lane's accumulator rows (StoreRow's layout, times mul) into a float32 row with
// 16-byte vector atomics (sm_90).
template <int D>
__device__ __forceinline__ void AtomicAddRow(float* row, const float (&acc)[D / 8][4], int half, float mul,
                                             int lane) {
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
#pragma unroll
    for (int m = 0; m < 4; m += 2) {
      const float4 v = make_float4(acc[4 * i + m][2 * half] * mul, acc[4 * i + m][2 * half + 1] * mul,
                                   acc[4 * i + m + 1][2 * half] * mul,
                                   acc[4 * i + m + 1][2 * half + 1] * mul);
      atomicAdd(reinterpret_cast<float4*>(row + 32 * i + 8 * (lane & 3) + 2 * m), v);
    }
  }
}

// Adds a lane's accumulator rows in natural column order (acc[nt][2 half + e] is row g + 8
// half, column 8 nt + 2c + e, the layout of products whose B fragments come from ldmatrix),
// times mul, into a float32 row with 8-byte vector atomics.
template <int D>
__device__ __forceinline__ void AtomicAddRowColumns(float* row, const float (&acc)[D / 8][4], int half, float mul,
                                                    int lane) {
#pragma unroll
  for (int nt = 0; nt < D / 8; ++nt) {
    atomicAdd(reinterpret_cast<float2*>(row + 8 * nt + 2 * (lane & 3)),
              make_float2(acc[nt][2 * half] * mul, acc[nt][2 * half + 1] * mul));
  }
}

// ---------------------------------------------------------------------------------------
// Key-side backward on tensor cores, the same work split as AttnDkDvKernel (KeyPolicy gives
// a CTA's key chunk of <= 64 rows and its query positions): each warp owns 16 keys as the
// MMA rows and walks the CTA's (position, head) query rows kR at a time:
//   S^T = K Q^T, dP^T = V dO^T (Q / dO rows are the B operand: plain row loads),
//   P^T = exp2(S^T - lse), dS^T = P^T (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q (dO / Q transposed in registers, like V in the forward).
// The chunk's sums are added into float32 buffers once per CTA.
template <typename scalar_t, int D, typename KeyPolicy>
__global__ void __launch_bounds__(kMmaThreads)
    DkDvMmaKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                  const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                  const float* __restrict__ lse, const float* __restrict__ delta,
                  float* __restrict__ dk_acc, float* __restrict__ dv_acc, Shape s, KeyPolicy pol,
                  float scale) {
  constexpr bool kBf16 = std::is_same_v<scalar_t, c10::BFloat16>;
  constexpr int kR = D == 64 ? 32 : 16;  // query rows per step (register budget)
  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
  const int key_lo = 16 * warp;
  if (key_lo >= w.keys.count) return;  // whole warps
  const int hq = s.hq();
  const float scale_log2 = scale * kLog2e;
  int key[2];
  bool key_ok[2];
  RowFrag<D> ka, kb, va, vb;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    key[half] = w.keys.start + key_lo + g + 8 * half;
    key_ok[half] = key_lo + g + 8 * half < w.keys.count;
  }
  LoadRow<D>(ka, key_ok[0] ? k + KeyOffset(s, w.b, key[0], w.g) : nullptr, lane);
  LoadRow<D>(kb, key_ok[1] ? k + KeyOffset(s, w.b, key[1], w.g) : nullptr, lane);
  LoadRow<D>(va, key_ok[0] ? v + KeyOffset(s, w.b, key[0], w.g) : nullptr, lane);
  LoadRow<D>(vb, key_ok[1] ? v + KeyOffset(s, w.b, key[1], w.g) : nullptr, lane);
  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[i][e] = dv[i][e] = 0.f;
  }
  const int total = w.num_queries * hq;  // flattened (position, head) rows
  for (int r0 = 0; r0 < total; r0 += kR) {
    RowFrag<D> qr[kR / 8], dr[kR / 8];
    float st[kR / 8][4], dpt[kR / 8][4];
#pragma unroll
    for (int j = 0; j < kR / 8; ++j) {
      const int rho = r0 + 8 * j + g;
      const scalar_t* q_row = nullptr;
      const scalar_t* do_row = nullptr;
      if (rho < total) {
        const int64_t off = QueryOffset(s, w.b, pol.Query(w, rho / hq), w.g * hq + rho % hq);
        q_row = q + off;
        do_row = dout + off;
      }
      LoadRow<D>(qr[j], q_row, lane);
      LoadRow<D>(dr[j], do_row, lane);
      st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
      dpt[j][0] = dpt[j][1] = dpt[j][2] = dpt[j][3] = 0.f;
      QKTile<kBf16, D>(st[j], ka, kb, qr[j]);
      QKTile<kBf16, D>(dpt[j], va, vb, dr[j]);
    }
#pragma unroll
    for (int j = 0; j < kR / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int rho = r0 + 8 * j + 2 * c + e;  // this C column's query row
        int t = 0;
        float row_lse = INFINITY, row_delta = 0.f;
        if (rho < total) {
          t = pol.Query(w, rho / hq);
          const int64_t row = (static_cast<int64_t>(w.b) * s.T + t) * s.H + w.g * hq + rho % hq;
          row_lse = lse[row];
          row_delta = delta[row];
        }
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const bool ok = rho < total && key_ok[half] && pol.Allowed(s, t, key[half]);
          const float p = ok ? Exp2(st[j][2 * half + e] * scale_log2 - row_lse) : 0.f;
          st[j][2 * half + e] = p;
          dpt[j][2 * half + e] = p * (dpt[j][2 * half + e] - row_delta);  // dS^T
        }
      }
    }
    PRTile<kBf16, D, kR>(dv, st, dr);
    PRTile<kBf16, D, kR>(dk, dpt, qr);
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    if (!key_ok[half]) continue;
    const int64_t off = KeyOffset(s, w.b, key[half], w.g);
    AtomicAddRow<D>(dk_acc + off, dk, half, scale, lane);
    AtomicAddRow<D>(dv_acc + off, dv, half, 1.f, lane);
  }
}

}  // namespace nsad::nsa::cuda::detail::mma
