// Fused gate mixing of the three branch outputs: out = g0 o_cmp + g1 o_slc + g2 o_win per
// (position, head), one kernel forward and one backward instead of LibTorch's 3 mul + 2 add
// forward and ~10 kernels backward (each mul's backward plus a sum over D for each gate).
//
// Where D is 8 (16-bit types: 16 bytes) times a power of two up to 32 and the tensors are
// aligned for it, D/8 lanes share a (b, t, h) row, each moving 8 elements per access;
// otherwise one warp per row, one element per lane and access (the same kernels with
// kVec = 1). The backward reduces the three gate gradients (sum over D of dout * o_k) with
// shuffles inside the lane group, and on request the three branches' attention deltas
// (sum over D of d_k * o_k, BranchesMixed in nsa_cuda.h) the same way. BranchesMixed also
// folds the gates of the branches on our kernels into their softmax (GateFold,
// fused_launchers.h): for those the backward writes a shifted lse row instead of d_k. With
// 2-byte accesses the kernels moved about 2 TB/s on an H100 (forward 0.098 ms, backward
// 0.164 ms per layer at batch 16, T=2048, 12 heads, D=64). Arithmetic in float32, outputs
// rounded once to the input type.
#include <initializer_list>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// The three gates of (b, t, h) row `row`, as float32.
struct RowGates {
  float g0, g1, g2;
};
template <typename scalar_t>
__device__ __forceinline__ RowGates LoadGates(const scalar_t* __restrict__ gates, int64_t row) {
  return {static_cast<float>(gates[row * 3]), static_cast<float>(gates[row * 3 + 1]),
          static_cast<float>(gates[row * 3 + 2])};
}

constexpr int kMixVec = 8;

// Branch a's row for (b, t, h) row `row` of [B,T,H]: the row itself, or with kPackedA its packed
// row (CmpPackedRows), -1 where t sees no compressed block.
template <bool kPackedA>
__device__ __forceinline__ int64_t RowOfA(int64_t row, const CmpPackedRows& p) {
  if constexpr (!kPackedA) {
    return row;
  } else {
    const int64_t bt = row / p.H;
    const int h = static_cast<int>(row - bt * p.H);
    const int64_t b = bt / p.T;
    const int t = static_cast<int>(bt - b * p.T);
    return PackedCmpRow(static_cast<int>(b), t, h, p.N, p.H, p.first, p.stride);
  }
}

// kVec elements of a at element `i` of row a_row, zeros where the row has none.
template <bool kPackedA, int kVec, typename scalar_t>
__device__ __forceinline__ Packed<scalar_t, kVec> LoadA(const scalar_t* __restrict__ a, int64_t a_row, int64_t i) {
  Packed<scalar_t, kVec> v;
  if (!kPackedA || a_row >= 0) {
    v = *reinterpret_cast<const Packed<scalar_t, kVec>*>(a + i);
  } else {
#pragma unroll
    for (int k = 0; k < kVec; ++k) v.v[k] = static_cast<scalar_t>(0.f);
  }
  return v;
}

// `lanes` (a power of two up to 32) lanes per (b, t, h) row, kVec elements each per access:
// kVec = 8 with D/8 lanes (16-byte accesses for 16-bit types), or kVec = 1 with a warp per
// row. Rows past the end still run the backward's shuffles (with nothing loaded), so that
// every lane of a warp takes part in them.
template <typename scalar_t, int kVec, bool kPackedA>
__global__ void __launch_bounds__(kThreads)
    GateMixForwardKernel(const scalar_t* __restrict__ gates, const scalar_t* __restrict__ a,
                         const scalar_t* __restrict__ b, const scalar_t* __restrict__ c,
                         scalar_t* __restrict__ out, int64_t rows, int D, int lanes, CmpPackedRows a_rows) {
  using Vec = Packed<scalar_t, kVec>;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = thread / lanes;
  const int lane = static_cast<int>(thread % lanes);
  if (row >= rows) return;  // no shuffles here
  const auto [g0, g1, g2] = LoadGates(gates, row);
  const int64_t a_row = RowOfA<kPackedA>(row, a_rows);
  for (int d = lane * kVec; d < D; d += lanes * kVec) {
    const int64_t i = row * D + d;
    const Vec va = LoadA<kPackedA, kVec>(a, a_row, a_row * D + d), vb = *reinterpret_cast<const Vec*>(b + i),
              vc = *reinterpret_cast<const Vec*>(c + i);
    Vec vo;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      vo.v[k] = static_cast<scalar_t>(g0 * static_cast<float>(va.v[k]) + g1 * static_cast<float>(vb.v[k]) +
                                      g2 * static_cast<float>(vc.v[k]));
    }
    *reinterpret_cast<Vec*>(out + i) = vo;
  }
}

// Sum over the `lanes` lanes of one row (a power of two, aligned groups inside the warp).
__device__ __forceinline__ float GroupSum(float v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Branch k is folded where folded_lse[k] is set (GateMixBackward's fold): its d_k is not
// stored, its delta is the gate's gradient (rowsum(dout * k)) and folded_lse[k] gets
// lse[k] - log2(g_k). The same for every thread of the grid.
struct FoldPtrs {
  const float* lse[3];
  float* folded_lse[3];
};

template <typename scalar_t, int kVec, bool kPackedA>
__global__ void __launch_bounds__(kThreads)
    GateMixBackwardKernel(const scalar_t* __restrict__ dout, const scalar_t* __restrict__ gates,
                          const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                          const scalar_t* __restrict__ c, scalar_t* __restrict__ dgates,
                          scalar_t* __restrict__ da, scalar_t* __restrict__ db,
                          scalar_t* __restrict__ dc, float* __restrict__ deltas, FoldPtrs fold,
                          int64_t rows, int D, int lanes, CmpPackedRows a_rows) {
  using Vec = Packed<scalar_t, kVec>;
  const int64_t thread = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t row = thread >> (__ffs(lanes) - 1);  // lanes is a power of two
  const int lane = static_cast<int>(thread) & (lanes - 1);
  const bool valid = row < rows;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f;  // the gates' gradients
  float r0 = 0.f, r1 = 0.f, r2 = 0.f;  // the deltas: rowsum(d_k * k) of the rounded d_k
  float g0 = 0.f, g1 = 0.f, g2 = 0.f;
  // Lane k % lanes finishes branch k (its gate's gradient, delta and folded lse); a folded
  // branch's lse is loaded now, with the row, not after the row's sums: finished by lane 0
  // alone, each row ended on three dependent loads (the kernel moved 2.35 TB/s, the unfolded
  // one 2.8).
  float lse[3] = {0.f, 0.f, 0.f};
  if (valid) {
    const RowGates loaded = LoadGates(gates, row);
    g0 = loaded.g0;
    g1 = loaded.g1;
    g2 = loaded.g2;
    if (deltas != nullptr) {
#pragma unroll
      for (int k = 0; k < 3; ++k) {
        if (k % lanes == lane && fold.folded_lse[k] != nullptr) lse[k] = fold.lse[k][row];
      }
    }
    const int64_t a_row = RowOfA<kPackedA>(row, a_rows);
    for (int d = lane * kVec; d < D; d += lanes * kVec) {
      const int64_t i = row * D + d;
      const Vec vg = *reinterpret_cast<const Vec*>(dout + i), va = LoadA<kPackedA, kVec>(a, a_row, a_row * D + d),
                vb = *reinterpret_cast<const Vec*>(b + i), vc = *reinterpret_cast<const Vec*>(c + i);
      Vec wa, wb, wc;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float go = static_cast<float>(vg.v[k]);
        s0 += go * static_cast<float>(va.v[k]);
        s1 += go * static_cast<float>(vb.v[k]);
        s2 += go * static_cast<float>(vc.v[k]);
        wa.v[k] = static_cast<scalar_t>(g0 * go);
        wb.v[k] = static_cast<scalar_t>(g1 * go);
        wc.v[k] = static_cast<scalar_t>(g2 * go);
        r0 += static_cast<float>(wa.v[k]) * static_cast<float>(va.v[k]);
        r1 += static_cast<float>(wb.v[k]) * static_cast<float>(vb.v[k]);
        r2 += static_cast<float>(wc.v[k]) * static_cast<float>(vc.v[k]);
      }
      if (da != nullptr && (!kPackedA || a_row >= 0)) *reinterpret_cast<Vec*>(da + a_row * D + d) = wa;
      if (db != nullptr) *reinterpret_cast<Vec*>(db + i) = wb;
      if (dc != nullptr) *reinterpret_cast<Vec*>(dc + i) = wc;
    }
  }
  s0 = GroupSum(s0, lanes);
  s1 = GroupSum(s1, lanes);
  s2 = GroupSum(s2, lanes);
  if (deltas != nullptr) {  // the same for every thread of the grid
    r0 = GroupSum(r0, lanes);
    r1 = GroupSum(r1, lanes);
    r2 = GroupSum(r2, lanes);
  }
  if (!valid) return;  // after the shuffles, which take every lane
  const float sum[3] = {s0, s1, s2}, r[3] = {r0, r1, r2}, g[3] = {g0, g1, g2};
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    if (k % lanes != lane) continue;
    dgates[row * 3 + k] = static_cast<scalar_t>(sum[k]);
    if (deltas == nullptr) continue;
    const bool folded = fold.folded_lse[k] != nullptr;
    deltas[k * rows + row] = folded ? sum[k] : r[k];
    // g = 0 gives +inf (no probability at all); lse = +inf (a row with no keys) stays +inf.
    if (folded) fold.folded_lse[k][row] = lse[k] - log2f(g[k]);
  }
}

// Lanes per row for kVec = kMixVec, or 0 where they do not apply (the kernels then run with
// kVec = 1, a warp per row).
int VectorLanes(int64_t D, std::initializer_list<const at::Tensor*> tensors) {
  if (D % kMixVec != 0) return 0;
  const int64_t lanes = D / kMixVec;
  if (lanes > 32 || (lanes & (lanes - 1)) != 0) return 0;
  for (const at::Tensor* t : tensors) {
    if (!AlignedFor(*t, kMixVec)) return 0;
  }
  return static_cast<int>(lanes);
}

dim3 LaneGrid(int64_t rows, int lanes) {
  return dim3(static_cast<unsigned>((rows * lanes + kThreads - 1) / kThreads));
}

// b's shape [B,T,H,D] is the output's; a has it too, or packed rows of it (a_packed).
void CheckMixInputs(const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                    const CmpPackedRows* a_packed) {
  for (const at::Tensor* t : {&gates, &a, &b, &c}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->dim() == 4,
                "gate mixing takes contiguous 4-d CUDA tensors");
    TORCH_CHECK(t->scalar_type() == b.scalar_type(), "gate mixing inputs must have one dtype");
  }
  TORCH_CHECK(c.sizes() == b.sizes(), "branch outputs must have one shape");
  if (a_packed == nullptr) {
    TORCH_CHECK(a.sizes() == b.sizes(), "branch outputs must have one shape");
  } else {
    const CmpPackedRows& p = *a_packed;
    // Every position from first on has a row, and the last row starts before T.
    TORCH_CHECK(p.T == b.size(1) && p.H == b.size(2) && p.stride >= 1 && p.first >= 0 && p.N >= 0 &&
                    (p.N == 0 ? p.first >= p.T : p.first + static_cast<int64_t>(p.N) * p.stride >= p.T &&
                                                     p.first + static_cast<int64_t>(p.N - 1) * p.stride < p.T),
                "packed rows (T ", p.T, ", H ", p.H, ", N ", p.N, ", first ", p.first, ", stride ", p.stride,
                ") do not cover outputs ", b.sizes());
    TORCH_CHECK(a.size(0) == b.size(0) && a.size(1) == p.N && a.size(2) == static_cast<int64_t>(p.H) * p.stride &&
                    a.size(3) == b.size(3),
                "packed branch a must be [B, N, H*stride, D] = [", b.size(0), ", ", p.N, ", ",
                static_cast<int64_t>(p.H) * p.stride, ", ", b.size(3), "], got ", a.sizes());
  }
  TORCH_CHECK(gates.size(0) == b.size(0) && gates.size(1) == b.size(1) &&
                  gates.size(2) == b.size(2) && gates.size(3) == 3,
              "gates must be [B,T,H,3] for outputs ", b.sizes(), ", got ", gates.sizes());
}

// Zero the rows of packed d_a past T (the last row's slots from T - first - (N-1) stride on), which
// no (b, t, h) row writes: cuDNN's backward reads them as the gradient of zero queries.
void ZeroPackedTail(at::Tensor& da, const CmpPackedRows& p) {
  if (p.N == 0) return;
  const int64_t past = p.T - p.first - static_cast<int64_t>(p.N - 1) * p.stride;  // in 1..stride
  if (past >= p.stride) return;
  da.view({da.size(0), p.N, p.H, p.stride, da.size(3)}).select(1, p.N - 1).narrow(2, past, p.stride - past).zero_();
}

template <typename scalar_t, int kVec>
auto ForwardKernel(bool packed) {
  return packed ? GateMixForwardKernel<scalar_t, kVec, true> : GateMixForwardKernel<scalar_t, kVec, false>;
}
template <typename scalar_t, int kVec>
auto BackwardKernel(bool packed) {
  return packed ? GateMixBackwardKernel<scalar_t, kVec, true> : GateMixBackwardKernel<scalar_t, kVec, false>;
}

}  // namespace

at::Tensor GateMixForward(const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& c, const CmpPackedRows* a_packed) {
  CheckMixInputs(gates, a, b, c, a_packed);
  auto out = at::empty_like(b);
  const int64_t rows = b.size(0) * b.size(1) * b.size(2);
  if (rows == 0 || b.size(3) == 0) return out;
  const int lanes = VectorLanes(b.size(3), {&a, &b, &c, &out});
  const CmpPackedRows a_rows = a_packed ? *a_packed : CmpPackedRows{};
  NSA_DISPATCH_TYPES(b.scalar_type(), "nsa_gate_mix_forward", [&] {
    const bool vec = lanes > 0 && sizeof(scalar_t) == 2;
    const bool packed = a_packed != nullptr;
    Launch(vec ? ForwardKernel<scalar_t, kMixVec>(packed) : ForwardKernel<scalar_t, 1>(packed),
           LaneGrid(rows, vec ? lanes : 32), 0, gates.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(),
           b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows,
           static_cast<int>(b.size(3)), vec ? lanes : 32, a_rows);
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> GateMixBackward(
    const at::Tensor& dout_in, const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& c, at::Tensor* deltas, GateFold* fold, const CmpPackedRows* a_packed) {
  CheckMixInputs(gates, a, b, c, a_packed);
  TORCH_CHECK(dout_in.sizes() == b.sizes(), "gradient must have the output's shape");
  TORCH_CHECK(!fold || deltas, "folding gates into the branches' backwards needs their deltas");
  TORCH_CHECK(!a_packed || !fold || !fold->lse[0].defined(), "a branch in packed rows is not folded");
  const auto dout = dout_in.to(b.scalar_type()).contiguous();
  const at::Tensor* branches[3] = {&a, &b, &c};
  at::Tensor d[3];
  FoldPtrs fold_ptrs{};
  for (int k = 0; k < 3; ++k) {
    const bool folded = fold && fold->lse[k].defined();
    if (!folded) {
      d[k] = at::empty_like(*branches[k]);
      continue;
    }
    const at::Tensor& lse = fold->lse[k];
    TORCH_CHECK(lse.is_cuda() && lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.dim() == 3 &&
                    lse.size(0) == b.size(0) && lse.size(1) == b.size(1) && lse.size(2) == b.size(2),
                "a folded branch's lse must be contiguous float32 [B,T,H], got ", lse.sizes());
    fold->folded_lse[k] = at::empty_like(lse);
    fold_ptrs.lse[k] = lse.data_ptr<float>();
    fold_ptrs.folded_lse[k] = fold->folded_lse[k].data_ptr<float>();
  }
  if (fold) fold->dout = dout;
  auto dgates = at::empty_like(gates);
  auto &da = d[0], &db = d[1], &dc = d[2];
  if (a_packed) ZeroPackedTail(da, *a_packed);
  if (deltas) *deltas = at::empty({3, b.size(0), b.size(1), b.size(2)}, b.options().dtype(at::kFloat));
  const int64_t rows = b.size(0) * b.size(1) * b.size(2);
  if (rows == 0) return {dgates, da, db, dc};
  if (b.size(3) == 0) {
    if (deltas) deltas->zero_();
    for (int k = 0; k < 3; ++k) {
      if (fold && fold->folded_lse[k].defined())
        fold->folded_lse[k].copy_(fold->lse[k] - gates.select(3, k).to(at::kFloat).log2());
    }
    return {dgates.zero_(), da, db, dc};
  }
  int lanes = VectorLanes(b.size(3), {&dout, &a, &b, &c});
  for (const at::Tensor& dk : d) {
    if (lanes > 0 && dk.defined() && !AlignedFor(dk, kMixVec)) lanes = 0;
  }
  const CmpPackedRows a_rows = a_packed ? *a_packed : CmpPackedRows{};
  NSA_DISPATCH_TYPES(b.scalar_type(), "nsa_gate_mix_backward", [&] {
    const bool vec = lanes > 0 && sizeof(scalar_t) == 2;
    const bool packed = a_packed != nullptr;
    Launch(vec ? BackwardKernel<scalar_t, kMixVec>(packed) : BackwardKernel<scalar_t, 1>(packed),
           LaneGrid(rows, vec ? lanes : 32), 0, dout.data_ptr<scalar_t>(), gates.data_ptr<scalar_t>(),
           a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(), dgates.data_ptr<scalar_t>(),
           da.defined() ? da.data_ptr<scalar_t>() : nullptr, db.defined() ? db.data_ptr<scalar_t>() : nullptr,
           dc.defined() ? dc.data_ptr<scalar_t>() : nullptr, deltas ? deltas->data_ptr<float>() : nullptr,
           fold_ptrs, rows, static_cast<int>(b.size(3)), vec ? lanes : 32, a_rows);
  });
  return {dgates, da, db, dc};
}

}  // namespace nsad::nsa::cuda::detail
