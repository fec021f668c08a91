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
// the group's heads. The [B,T,H,N] probabilities are never stored.
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

constexpr int kQueriesPerKeyCta = 512;  // query positions per key-side backward CTA

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

  __device__ KeyWork Work(const Shape& s) const {
    KeyWork w{};
    const int start = static_cast<int>(blockIdx.x) * kKeyChunk;
    w.b = static_cast<int>(blockIdx.z) / s.G;
    w.g = static_cast<int>(blockIdx.z) % s.G;
    w.keys = {start, min(kKeyChunk, s.Tk - start)};
    // The first query that sees the chunk's first block; later blocks are masked per key.
    const int first = max(static_cast<int>(blockIdx.y) * kQueriesPerKeyCta,
                          start * cmp_stride + cmp_block - 1);
    const int end = min(s.T, static_cast<int>(blockIdx.y + 1) * kQueriesPerKeyCta);
    w.num_queries = max(0, end - first);
    w.query_base = first;
    w.valid = true;
    return w;
  }
  __device__ int Query(const KeyWork& w, int i) const { return static_cast<int>(w.query_base) + i; }
  __device__ bool Allowed(const Shape&, int t, int j) const {
    return j * cmp_stride + cmp_block - 1 <= t;
  }
};

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
    const int last = ch.start + ch.count - 1;
    const int sb_lo = ch.start * pol.cmp_stride / slc_block;
    const int sb_hi = min(NS - 1, (last * pol.cmp_stride + pol.cmp_block - 1) / slc_block);
    const int span = sb_hi - sb_lo + 1;
    for (int i = threadIdx.x; i < tile.positions * span; i += kThreads) {
      const int tq = i / span, sb = sb_lo + i % span;
      const int sb_start = sb * slc_block, sb_end = sb_start + slc_block;
      // Blocks j with j*d < sb_end and j*d + l > sb_start.
      const int lo_num = sb_start - pol.cmp_block + 1;
      const int j_lo = max(ch.start, lo_num <= 0 ? 0 : (lo_num + pol.cmp_stride - 1) / pol.cmp_stride);
      const int j_hi = min(last, (sb_end - 1) / pol.cmp_stride);
      float sum = 0.f;
      for (int j = j_lo; j <= j_hi; ++j) {
        const int js = j * pol.cmp_stride;
        const float overlap = static_cast<float>(min(js + pol.cmp_block, sb_end) - max(js, sb_start));
        float p = 0.f;
        for (int h = 0; h < hq; ++h) p += p_s[(tq * hq + h) * kKeyChunk + (j - ch.start)];
        sum = fmaf(p, overlap, sum);
      }
      if (sum != 0.f)
        atomicAdd(importance + ((static_cast<int64_t>(tile.b) * s.T + tile.t0 + tq) * s.G + tile.g) * NS + sb,
                  sum);
    }
  }
}

void CheckCompressed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Geo& g) {
  CheckInput(q, "q", 4);
  CheckInput(k, "k_cmp", 4);
  CheckInput(v, "v_cmp", 4);
  CheckKv(q, k, v);
  const int64_t T = q.size(1);
  const int64_t N = T < g.cmp_block ? 0 : (T - g.cmp_block) / g.cmp_stride + 1;
  TORCH_CHECK(k.size(1) == N, "k_cmp has ", k.size(1), " blocks, expected ", N, " for ", T,
              " tokens");
}

CmpQueryPolicy QueryPolicy(const Shape& s, const Geo& g) {
  return {std::max(1, kMaxRows / s.hq()), g.cmp_block, g.cmp_stride};
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
  auto importance = at::zeros({s.B, s.T, s.G, NS}, q.options().dtype(at::kFloat));
  const CmpQueryPolicy pol = QueryPolicy(s, g);
  const int rows = pol.positions_per_cta * s.hq();
  const dim3 grid((s.T + pol.positions_per_cta - 1) / pol.positions_per_cta, s.G, s.B);
  const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(s.D));
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_cmp_fwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      Launch(AttnFwdKernel<scalar_t, D, CmpQueryPolicy>, grid, FwdSmemFloats(rows, D) * sizeof(float),
             q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
             out.data_ptr<scalar_t>(), lse.data_ptr<float>(), s, pol, scale_log2, rows);
      const size_t imp_smem = (rows * D + kKeyChunk * (D + 1) + rows * kKeyChunk + rows) * sizeof(float);
      Launch(CmpImportanceKernel<scalar_t, D>, grid, imp_smem, q.data_ptr<scalar_t>(),
             k_cmp.data_ptr<scalar_t>(), lse.data_ptr<float>(), importance.data_ptr<float>(), s, pol,
             NS, g.slc_block, scale_log2, rows);
    });
  });
  return {out, lse, importance};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> CompressedBackward(
    const at::Tensor& dout_in, const at::Tensor& q, const at::Tensor& k_cmp,
    const at::Tensor& v_cmp, const at::Tensor& out, const at::Tensor& lse, const Geo& g) {
  CheckCompressed(q, k_cmp, v_cmp, g);
  const auto dout = dout_in.contiguous();
  const Shape s = MakeShape(q, k_cmp);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.D));
  const auto delta = RowDot(dout, out);
  auto dq = at::empty_like(q);
  auto dk_acc = at::zeros(k_cmp.sizes(), k_cmp.options().dtype(at::kFloat));
  auto dv_acc = at::zeros(v_cmp.sizes(), v_cmp.options().dtype(at::kFloat));
  const CmpQueryPolicy qpol = QueryPolicy(s, g);
  const CmpKeyPolicy kpol{g.cmp_block, g.cmp_stride};
  const int rows = qpol.positions_per_cta * s.hq();
  const dim3 qgrid((s.T + qpol.positions_per_cta - 1) / qpol.positions_per_cta, s.G, s.B);
  const dim3 kgrid((s.Tk + kKeyChunk - 1) / kKeyChunk, (s.T + kQueriesPerKeyCta - 1) / kQueriesPerKeyCta,
                   s.B * s.G);
  NSA_DISPATCH_TYPES(q.scalar_type(), "nsa_cmp_bwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      constexpr int D = decltype(dim)::value;
      Launch(AttnDqKernel<scalar_t, D, CmpQueryPolicy>, qgrid, DqSmemFloats(rows, D) * sizeof(float),
             q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
             dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
             dq.data_ptr<scalar_t>(), s, qpol, scale, rows);
      Launch(AttnDkDvKernel<scalar_t, D, CmpKeyPolicy>, kgrid, DkDvSmemFloats(D) * sizeof(float),
             q.data_ptr<scalar_t>(), k_cmp.data_ptr<scalar_t>(), v_cmp.data_ptr<scalar_t>(),
             dout.data_ptr<scalar_t>(), lse.data_ptr<float>(), delta.data_ptr<float>(),
             dk_acc.data_ptr<float>(), dv_acc.data_ptr<float>(), s, kpol, scale);
    });
  });
  return {dq, dk_acc.to(k_cmp.scalar_type()), dv_acc.to(v_cmp.scalar_type())};
}

}  // namespace nsad::nsa::cuda::detail
