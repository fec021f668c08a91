// FlashAttention-2-style forward steps over key/value tiles staged in shared memory, shared
// by the compressed branch's forward (CmpSmemKernel) and the selected branch's tiled forward
// (SelectedSmemFwdKernel). A warp owns kM m16 tiles of query rows (A fragments of Q in
// registers, standard m16n8k16 layout); each tile of kN keys sits in shared memory as
// swizzled D-element rows (mma::StageTileAsync) and is read with ldmatrix:
//   Scores:    S = Q K^T (ldmatrix of K rows: B fragments of two k16 steps per load)
//   SoftmaxPV: online softmax of S under a per-element mask, then O += P V (ldmatrix.trans
//              of V rows), P rounded to the input type as FlashAttention does
//   Finish:    O / l and the row's log2-sum-exp (+inf, with a zero row, when it saw nothing)
#pragma once

#include "mma_tile.cuh"

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

// A fragments of the lane's Q rows (row_index[t][h] into [rows, D]; invalid rows get zeros).
template <int D, int kM, typename scalar_t>
__device__ __forceinline__ void LoadQ(uint32_t (&qf)[kM][D / 16][4], const scalar_t* q,
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

// sc = Q K^T for the kN keys staged at kbuf (fresh accumulators).
template <bool kBf16, int D, int kM, int kN>
__device__ __forceinline__ void Scores(float (&sc)[kM][kN / 8][4], const uint32_t (&qf)[kM][D / 16][4],
                                       uint32_t kbuf, int lane) {
#pragma unroll
  for (int t = 0; t < kM; ++t)
#pragma unroll
    for (int n = 0; n < kN / 8; ++n) sc[t][n][0] = sc[t][n][1] = sc[t][n][2] = sc[t][n][3] = 0.f;
  // One ldmatrix.x4 gives keys 8n..8n+7 for two k16 steps.
#pragma unroll
  for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
    for (int p = 0; p < D / 32; ++p) {
      uint32_t kb[4];
      mma::LdMatrixX4(kb, kbuf + mma::SwizzledOffset<D>(8 * n + (lane & 7), 4 * p + (lane >> 3)));
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        const uint32_t(&a0)[4] = qf[t][2 * p];
        const uint32_t(&a1)[4] = qf[t][2 * p + 1];
        mma::Mma<kBf16>(sc[t][n], a0[0], a0[1], a0[2], a0[3], kb[0], kb[1]);
        mma::Mma<kBf16>(sc[t][n], a1[0], a1[1], a1[2], a1[3], kb[2], kb[3]);
      }
    }
  }
}

// Online softmax of sc (allowed(t, h, key): may row g + 8h of m-tile t attend tile-relative
// key `key`; not allowed scores become -inf) and O += P V with V staged at vbuf.
template <bool kBf16, int D, int kM, int kN, typename Allowed>
__device__ __forceinline__ void SoftmaxPV(State<D, kM>& st, float (&sc)[kM][kN / 8][4], uint32_t vbuf,
                                          float scale_log2, Allowed allowed, int lane) {
  const int c = lane & 3;
#pragma unroll
  for (int t = 0; t < kM; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[t][n][2 * h + e];
          x = allowed(t, h, 8 * n + 2 * c + e) ? x * scale_log2 : -INFINITY;
          mx = fmaxf(mx, x);
        }
      }
      const float m_new = fmaxf(st.m[t][h], mma::QuadMax(mx));
      const float base = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: p = 0
      const float alpha = exp2f(st.m[t][h] - base);
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < kN / 8; ++n) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[t][n][2 * h + e];
          x = exp2f(x - base);
          sum += x;
        }
      }
      st.l[t][h] = st.l[t][h] * alpha + sum;
      st.m[t][h] = m_new;
#pragma unroll
      for (int i = 0; i < D / 8; ++i) {
        st.o[t][i][2 * h] *= alpha;
        st.o[t][i][2 * h + 1] *= alpha;
      }
    }
  }
  // P's C fragments of key tiles 2kk, 2kk+1 are the A fragment of k16 step kk;
  // ldmatrix.trans gives V's B fragments (keys 16kk.., head-dim tiles 2p, 2p+1).
#pragma unroll
  for (int kk = 0; kk < kN / 16; ++kk) {
    uint32_t a[kM][4];
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      a[t][0] = mma::Pack<kBf16>(sc[t][2 * kk][0], sc[t][2 * kk][1]);
      a[t][1] = mma::Pack<kBf16>(sc[t][2 * kk][2], sc[t][2 * kk][3]);
      a[t][2] = mma::Pack<kBf16>(sc[t][2 * kk + 1][0], sc[t][2 * kk + 1][1]);
      a[t][3] = mma::Pack<kBf16>(sc[t][2 * kk + 1][2], sc[t][2 * kk + 1][3]);
    }
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
      const float l = mma::QuadSum(st.l[t][h]);
      if (!row_valid[t][h]) continue;
      const float inv = l > 0.f ? 1.f / l : 0.f;
      uint32_t* orow = reinterpret_cast<uint32_t*>(out + row_index[t][h] * D);
#pragma unroll
      for (int i = 0; i < D / 8; ++i) orow[4 * i + c] = mma::Pack<kBf16>(st.o[t][i][2 * h] * inv, st.o[t][i][2 * h + 1] * inv);
      if (c == 0) lse[row_index[t][h]] = l > 0.f ? st.m[t][h] + log2f(l) : INFINITY;
    }
  }
}

}  // namespace nsad::nsa::cuda::detail::smem_fwd
