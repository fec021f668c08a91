// Generic attention building blocks shared by the selected and the compressed branch: the
// scalar float32 path, used for fp32 inputs. bf16/fp16 inputs run the tensor-core kernels of
// mma_tile.cuh (same work split, same Shape / KeyWork / KeyPolicy types).
//
// Both branches are "a set of (position, head) query rows attends chunks of at most
// kKeyChunk key rows, with a per-branch mask". A Policy describes, per CTA, which rows it
// owns, which key chunks they visit and which (query position, key row) pairs are allowed;
// the kernels below do the rest:
//   * AttnFwdKernel   query-side forward, online softmax, writes out and log2-sum-exp.
//   * AttnDqKernel    query-side backward for dQ (recomputes P from the saved lse).
//   * AttnDkDvKernel  key-side backward: one CTA holds a key chunk in shared memory and
//                     loops over the queries that attend it (KeyPolicy), so dK/dV are
//                     summed in registers rather than by per-query atomics.
// All arithmetic is float32 whatever the input type (bf16, fp16 or fp32). Scores are kept
// in log2 units (scaled by softmax_scale * log2(e)) so that exp2f can be used.
//
// Group-centric: a CTA always serves all H/G query heads of one GQA group, so every key and
// value row it stages in shared memory is read once for all of those heads.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace nsad::nsa::cuda::detail {

constexpr int kThreads = 256;   // threads per CTA for every kernel here
constexpr int kKeyChunk = 64;   // key rows staged in shared memory at a time
constexpr int kMaxRows = 64;    // (position, head) rows per CTA on the query side
constexpr int kKeyRows = 16;    // query rows processed per step by the key-side kernel
constexpr float kLog2e = 1.4426950408889634f;

// Layout of every activation: [B, rows, G or H, D] contiguous ("BTHD").
struct Shape {
  int B, T, H, G, D;  // T query positions; H query heads; G kv groups
  int Tk;             // key rows per batch element (T for selected, N for compressed)
  __host__ __device__ int hq() const { return H / G; }
};

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
template <typename T>
__device__ __forceinline__ T WarpSum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// What a query-side CTA owns: rows r in [0, positions * hq) are (t0 + r / hq, head g*hq + r % hq).
struct QueryTile {
  int b, g, t0, positions;
  bool valid;
};
// One chunk of key rows [start, start + count) of group g (count <= kKeyChunk, 0 = skip).
struct KeyChunk {
  int start, count;
};

// n / d and n % d for 0 <= n with n d < 2^31, in one multiply-high and one multiply-add
// instead of the ~20 instructions of a division by a value known only at run time (the heads
// per group, in the loops over flattened (position, head) rows). With m = floor(2^31 / d) + 1,
// n m / 2^31 = n / d + e where 0 < e <= n / 2^31 < 1 / d, so the floor is exact.
struct SmallDivisor {
  int d;
  uint32_t m;
  __device__ explicit SmallDivisor(int divisor) : d(divisor), m(0x80000000u / static_cast<uint32_t>(divisor) + 1u) {}
  __device__ __forceinline__ void DivMod(int n, int& quotient, int& remainder) const {
    quotient = static_cast<int>(__umulhi(2u * static_cast<uint32_t>(n), m));
    remainder = n - quotient * d;
  }
};

__device__ __forceinline__ int64_t QueryOffset(const Shape& s, int b, int t, int h) {
  return ((static_cast<int64_t>(b) * s.T + t) * s.H + h) * s.D;
}
__device__ __forceinline__ int64_t KeyOffset(const Shape& s, int b, int row, int g) {
  return ((static_cast<int64_t>(b) * s.Tk + row) * s.G + g) * s.D;
}

// Stages key/value rows [start, start+count) into padded float rows (stride D+1 avoids bank
// conflicts when threads of a warp read different rows at the same column).
template <typename scalar_t, int D>
__device__ __forceinline__ void StageRows(const scalar_t* __restrict__ src, const Shape& s, int b,
                                          int g, KeyChunk ch, float* dst) {
  for (int i = threadIdx.x; i < ch.count * D; i += kThreads) {
    const int row = i / D, d = i % D;
    dst[row * (D + 1) + d] = static_cast<float>(src[KeyOffset(s, b, ch.start + row, g) + d]);
  }
}

template <int D>
__device__ __forceinline__ float Dot(const float* a, const float* b) {
  float acc = 0.f;
#pragma unroll 16
  for (int d = 0; d < D; ++d) acc = fmaf(a[d], b[d], acc);
  return acc;
}

// Shared-memory floats the query-side kernels need for `rows` rows (host and device).
__host__ __device__ constexpr int FwdSmemFloats(int rows, int D) {
  return rows * D + 2 * kKeyChunk * (D + 1) + rows * kKeyChunk + 3 * rows;
}
__host__ __device__ constexpr int DqSmemFloats(int rows, int D) {
  return 2 * rows * D + 2 * kKeyChunk * (D + 1) + rows * kKeyChunk + 2 * rows;
}
__host__ __device__ constexpr int DkDvSmemFloats(int D) {
  return 2 * kKeyChunk * (D + 1) + 2 * kKeyRows * D + 2 * kKeyRows * kKeyChunk + 3 * kKeyRows;
}

// ---------------------------------------------------------------------------------------
// Forward. lse (log2 units, [B,T,H]) is +inf for rows that attend nothing (zero output).
template <typename scalar_t, int D, typename Policy>
__global__ void __launch_bounds__(kThreads)
    AttnFwdKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                  const scalar_t* __restrict__ v, scalar_t* __restrict__ out,
                  float* __restrict__ lse, Shape s, Policy pol, float scale_log2, int rows_cap) {
  constexpr int kAcc = kMaxRows * D / kThreads;
  extern __shared__ float smem[];
  const QueryTile tile = pol.Tile(s);
  if (!tile.valid) return;
  const int hq = s.hq();
  const int R = tile.positions * hq;
  float* q_s = smem;
  float* k_s = q_s + rows_cap * D;
  float* v_s = k_s + kKeyChunk * (D + 1);
  float* p_s = v_s + kKeyChunk * (D + 1);
  float* m_s = p_s + rows_cap * kKeyChunk;
  float* l_s = m_s + rows_cap;
  float* a_s = l_s + rows_cap;

  for (int i = threadIdx.x; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    q_s[i] = static_cast<float>(q[QueryOffset(s, tile.b, tile.t0 + r / hq, tile.g * hq + r % hq) + d]) *
             scale_log2;
  }
  for (int r = threadIdx.x; r < R; r += kThreads) {
    m_s[r] = -INFINITY;
    l_s[r] = 0.f;
  }
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks = pol.NumChunks(s, tile);
  for (int c = 0; c < chunks; ++c) {
    const KeyChunk ch = pol.Chunk(s, tile, c);
    if (ch.count <= 0) continue;  // uniform across the CTA
    __syncthreads();              // previous chunk's readers are done with k_s/v_s/p_s
    StageRows<scalar_t, D>(k, s, tile.b, tile.g, ch, k_s);
    StageRows<scalar_t, D>(v, s, tile.b, tile.g, ch, v_s);
    __syncthreads();
    for (int i = threadIdx.x; i < R * kKeyChunk; i += kThreads) {
      const int r = i / kKeyChunk, key = i % kKeyChunk;
      float score = -INFINITY;
      if (key < ch.count && pol.Allowed(s, tile.t0 + r / hq, ch.start + key))
        score = Dot<D>(q_s + r * D, k_s + key * (D + 1));
      p_s[i] = score;
    }
    __syncthreads();
    // Online softmax, one warp per row; each lane owns keys lane and lane + 32.
    for (int r = warp; r < R; r += kThreads / 32) {
      const float s0 = p_s[r * kKeyChunk + lane], s1 = p_s[r * kKeyChunk + lane + 32];
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, WarpMax(fmaxf(s0, s1)));
      float p0 = 0.f, p1 = 0.f, alpha = 1.f;
      if (m_new != -INFINITY) {  // a fully masked row so far keeps m = -inf, l = 0
        p0 = exp2f(s0 - m_new);
        p1 = exp2f(s1 - m_new);
        alpha = exp2f(m_old - m_new);
      }
      const float sum = WarpSum(p0 + p1);
      p_s[r * kKeyChunk + lane] = p0;
      p_s[r * kKeyChunk + lane + 32] = p1;
      if (lane == 0) {
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
        a_s[r] = alpha;
      }
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      if (idx < R * D) {
        const int r = idx / D, d = idx % D;
        float a = acc[i] * a_s[r];
        const float* p_row = p_s + r * kKeyChunk;
        for (int key = 0; key < ch.count; ++key) a = fmaf(p_row[key], v_s[key * (D + 1) + d], a);
        acc[i] = a;
      }
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx < R * D) {
      const int r = idx / D, d = idx % D;
      const float l = l_s[r];
      out[QueryOffset(s, tile.b, tile.t0 + r / hq, tile.g * hq + r % hq) + d] =
          static_cast<scalar_t>(l > 0.f ? acc[i] / l : 0.f);
    }
  }
  for (int r = threadIdx.x; r < R; r += kThreads) {
    const int t = tile.t0 + r / hq, h = tile.g * hq + r % hq;
    lse[(static_cast<int64_t>(tile.b) * s.T + t) * s.H + h] =
        l_s[r] > 0.f ? m_s[r] + log2f(l_s[r]) : INFINITY;
  }
}

// delta[b,t,h] = sum_d dO * O, the softmax-backward row term.
template <typename scalar_t>
__global__ void RowDotKernel(const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                             float* __restrict__ out, int64_t rows, int D) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float acc = 0.f;
  for (int d = lane; d < D; d += 32)
    acc += static_cast<float>(a[row * D + d]) * static_cast<float>(b[row * D + d]);
  acc = WarpSum(acc);
  if (lane == 0) out[row] = acc;
}

// ---------------------------------------------------------------------------------------
// Backward, query side: dQ = scale * sum_keys dS * K with dS = P * (dO.V - delta).
template <typename scalar_t, int D, typename Policy>
__global__ void __launch_bounds__(kThreads)
    AttnDqKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                 const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                 const float* __restrict__ lse, const float* __restrict__ delta,
                 scalar_t* __restrict__ dq, Shape s, Policy pol, float scale, int rows_cap) {
  constexpr int kAcc = kMaxRows * D / kThreads;
  extern __shared__ float smem[];
  const QueryTile tile = pol.Tile(s);
  if (!tile.valid) return;
  const int hq = s.hq();
  const int R = tile.positions * hq;
  const float scale_log2 = scale * kLog2e;
  float* q_s = smem;
  float* do_s = q_s + rows_cap * D;
  float* k_s = do_s + rows_cap * D;
  float* v_s = k_s + kKeyChunk * (D + 1);
  float* ds_s = v_s + kKeyChunk * (D + 1);
  float* lse_s = ds_s + rows_cap * kKeyChunk;
  float* delta_s = lse_s + rows_cap;

  for (int i = threadIdx.x; i < R * D; i += kThreads) {
    const int r = i / D, d = i % D;
    const int64_t off = QueryOffset(s, tile.b, tile.t0 + r / hq, tile.g * hq + r % hq) + d;
    q_s[i] = static_cast<float>(q[off]) * scale_log2;
    do_s[i] = static_cast<float>(dout[off]);
  }
  for (int r = threadIdx.x; r < R; r += kThreads) {
    const int64_t row = (static_cast<int64_t>(tile.b) * s.T + tile.t0 + r / hq) * s.H +
                        tile.g * hq + r % hq;
    lse_s[r] = lse[row];
    delta_s[r] = delta[row];
  }
  float acc[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) acc[i] = 0.f;

  const int chunks = pol.NumChunks(s, tile);
  for (int c = 0; c < chunks; ++c) {
    const KeyChunk ch = pol.Chunk(s, tile, c);
    if (ch.count <= 0) continue;
    __syncthreads();
    StageRows<scalar_t, D>(k, s, tile.b, tile.g, ch, k_s);
    StageRows<scalar_t, D>(v, s, tile.b, tile.g, ch, v_s);
    __syncthreads();
    for (int i = threadIdx.x; i < R * kKeyChunk; i += kThreads) {
      const int r = i / kKeyChunk, key = i % kKeyChunk;
      float ds = 0.f;
      if (key < ch.count && pol.Allowed(s, tile.t0 + r / hq, ch.start + key)) {
        const float p = exp2f(Dot<D>(q_s + r * D, k_s + key * (D + 1)) - lse_s[r]);
        ds = p * (Dot<D>(do_s + r * D, v_s + key * (D + 1)) - delta_s[r]);
      }
      ds_s[i] = ds;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int idx = threadIdx.x + i * kThreads;
      if (idx < R * D) {
        const int r = idx / D, d = idx % D;
        float a = acc[i];
        const float* ds_row = ds_s + r * kKeyChunk;
        for (int key = 0; key < ch.count; ++key) a = fmaf(ds_row[key], k_s[key * (D + 1) + d], a);
        acc[i] = a;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    if (idx < R * D) {
      const int r = idx / D, d = idx % D;
      dq[QueryOffset(s, tile.b, tile.t0 + r / hq, tile.g * hq + r % hq) + d] =
          static_cast<scalar_t>(acc[i] * scale);
    }
  }
}

// What a key-side CTA owns: key rows [start, start+count) of (b, g) and a list of query
// positions (KeyPolicy::Query(i) for i < num_queries) that may attend them.
struct KeyWork {
  int b, g;
  KeyChunk keys;
  int num_queries;
  int64_t query_base;
  bool valid;
};

// ---------------------------------------------------------------------------------------
// Backward, key side. dK = scale * sum dS * Q, dV = sum P * dO over the CTA's queries and all
// heads of the group, summed in registers; the CTA's partial sums are then added into float32
// buffers (one atomic per element per CTA: several CTAs share a key chunk only when its query
// list is split for load balance).
template <typename scalar_t, int D, typename KeyPolicy>
__global__ void __launch_bounds__(kThreads)
    AttnDkDvKernel(const scalar_t* __restrict__ q, const scalar_t* __restrict__ k,
                   const scalar_t* __restrict__ v, const scalar_t* __restrict__ dout,
                   const float* __restrict__ lse, const float* __restrict__ delta,
                   float* __restrict__ dk_acc, float* __restrict__ dv_acc, Shape s,
                   KeyPolicy pol, float scale) {
  constexpr int kAcc = kKeyChunk * D / kThreads;
  extern __shared__ float smem[];
  const KeyWork w = pol.Work(s);
  if (!w.valid || w.num_queries <= 0 || w.keys.count <= 0) return;
  const int hq = s.hq();
  const int per_step = hq >= kKeyRows ? 1 : kKeyRows / hq;  // query positions per step
  const float scale_log2 = scale * kLog2e;
  float* k_s = smem;
  float* v_s = k_s + kKeyChunk * (D + 1);
  float* q_s = v_s + kKeyChunk * (D + 1);
  float* do_s = q_s + kKeyRows * D;
  float* p_s = do_s + kKeyRows * D;
  float* ds_s = p_s + kKeyRows * kKeyChunk;
  float* lse_s = ds_s + kKeyRows * kKeyChunk;
  float* delta_s = lse_s + kKeyRows;
  int* pos_s = reinterpret_cast<int*>(delta_s + kKeyRows);

  StageRows<scalar_t, D>(k, s, w.b, w.g, w.keys, k_s);
  StageRows<scalar_t, D>(v, s, w.b, w.g, w.keys, v_s);
  float dk[kAcc], dv[kAcc];
#pragma unroll
  for (int i = 0; i < kAcc; ++i) dk[i] = dv[i] = 0.f;

  for (int q0 = 0; q0 < w.num_queries; q0 += per_step) {
    const int nq = min(per_step, w.num_queries - q0);
    const int R = nq * hq;  // <= max(kKeyRows, hq); hq <= kKeyRows is checked on the host
    __syncthreads();
    if (threadIdx.x < nq) pos_s[threadIdx.x] = pol.Query(w, q0 + threadIdx.x);
    __syncthreads();
    for (int i = threadIdx.x; i < R * D; i += kThreads) {
      const int r = i / D, d = i % D;
      const int64_t off = QueryOffset(s, w.b, pos_s[r / hq], w.g * hq + r % hq) + d;
      q_s[i] = static_cast<float>(q[off]);
      do_s[i] = static_cast<float>(dout[off]);
    }
    for (int r = threadIdx.x; r < R; r += kThreads) {
      const int64_t row = (static_cast<int64_t>(w.b) * s.T + pos_s[r / hq]) * s.H + w.g * hq + r % hq;
      lse_s[r] = lse[row];
      delta_s[r] = delta[row];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < R * kKeyChunk; i += kThreads) {
      const int r = i / kKeyChunk, key = i % kKeyChunk;
      float p = 0.f, ds = 0.f;
      if (key < w.keys.count && pol.Allowed(s, pos_s[r / hq], w.keys.start + key)) {
        p = exp2f(Dot<D>(q_s + r * D, k_s + key * (D + 1)) * scale_log2 - lse_s[r]);
        ds = p * (Dot<D>(do_s + r * D, v_s + key * (D + 1)) - delta_s[r]);
      }
      p_s[i] = p;
      ds_s[i] = ds;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < kAcc; ++i) {
      const int idx = threadIdx.x + i * kThreads;  // kKeyChunk * D is a multiple of kThreads
      const int key = idx / D, d = idx % D;
      float a = dk[i], b = dv[i];
      for (int r = 0; r < R; ++r) {
        a = fmaf(ds_s[r * kKeyChunk + key], q_s[r * D + d], a);
        b = fmaf(p_s[r * kKeyChunk + key], do_s[r * D + d], b);
      }
      dk[i] = a;
      dv[i] = b;
    }
  }
#pragma unroll
  for (int i = 0; i < kAcc; ++i) {
    const int idx = threadIdx.x + i * kThreads;
    const int key = idx / D, d = idx % D;
    if (key < w.keys.count) {
      const int64_t off = KeyOffset(s, w.b, w.keys.start + key, w.g) + d;
      atomicAdd(dk_acc + off, dk[i] * scale);
      atomicAdd(dv_acc + off, dv[i]);
    }
  }
}

}  // namespace nsad::nsa::cuda::detail
