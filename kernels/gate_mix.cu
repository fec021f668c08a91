// Fused gate mixing of the three branch outputs: out = g0 o_cmp + g1 o_slc + g2 o_win per
// (position, head), one kernel forward and one backward instead of LibTorch's 3 mul + 2 add
// forward and ~10 kernels backward (each mul's backward plus a sum over D for each gate).
//
// One warp per (b, t, h) row: its lanes stride over D, so the backward reduces the three
// gate gradients (sum over D of dout * o_k) with warp shuffles. Arithmetic in float32,
// outputs rounded once to the input type.
#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    GateMixForwardKernel(const scalar_t* __restrict__ gates, const scalar_t* __restrict__ a,
                         const scalar_t* __restrict__ b, const scalar_t* __restrict__ c,
                         scalar_t* __restrict__ out, int64_t rows, int D) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float g0 = static_cast<float>(gates[row * 3]);
  const float g1 = static_cast<float>(gates[row * 3 + 1]);
  const float g2 = static_cast<float>(gates[row * 3 + 2]);
  const int64_t base = row * D;
  for (int d = lane; d < D; d += 32) {
    const int64_t i = base + d;
    out[i] = static_cast<scalar_t>(g0 * static_cast<float>(a[i]) + g1 * static_cast<float>(b[i]) +
                                   g2 * static_cast<float>(c[i]));
  }
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    GateMixBackwardKernel(const scalar_t* __restrict__ dout, const scalar_t* __restrict__ gates,
                          const scalar_t* __restrict__ a, const scalar_t* __restrict__ b,
                          const scalar_t* __restrict__ c, scalar_t* __restrict__ dgates,
                          scalar_t* __restrict__ da, scalar_t* __restrict__ db,
                          scalar_t* __restrict__ dc, int64_t rows, int D) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;  // whole warps exit together
  const float g0 = static_cast<float>(gates[row * 3]);
  const float g1 = static_cast<float>(gates[row * 3 + 1]);
  const float g2 = static_cast<float>(gates[row * 3 + 2]);
  const int64_t base = row * D;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f;
  for (int d = lane; d < D; d += 32) {
    const int64_t i = base + d;
    const float go = static_cast<float>(dout[i]);
    s0 += go * static_cast<float>(a[i]);
    s1 += go * static_cast<float>(b[i]);
    s2 += go * static_cast<float>(c[i]);
    da[i] = static_cast<scalar_t>(g0 * go);
    db[i] = static_cast<scalar_t>(g1 * go);
    dc[i] = static_cast<scalar_t>(g2 * go);
  }
  s0 = WarpSum(s0);
  s1 = WarpSum(s1);
  s2 = WarpSum(s2);
  if (lane == 0) {
    dgates[row * 3] = static_cast<scalar_t>(s0);
    dgates[row * 3 + 1] = static_cast<scalar_t>(s1);
    dgates[row * 3 + 2] = static_cast<scalar_t>(s2);
  }
}

void CheckMixInputs(const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
                    const at::Tensor& c) {
  for (const at::Tensor* t : {&gates, &a, &b, &c}) {
    TORCH_CHECK(t->is_cuda() && t->is_contiguous() && t->dim() == 4,
                "gate mixing takes contiguous 4-d CUDA tensors");
    TORCH_CHECK(t->scalar_type() == a.scalar_type(), "gate mixing inputs must have one dtype");
  }
  TORCH_CHECK(b.sizes() == a.sizes() && c.sizes() == a.sizes(),
              "branch outputs must have one shape");
  TORCH_CHECK(gates.size(0) == a.size(0) && gates.size(1) == a.size(1) &&
                  gates.size(2) == a.size(2) && gates.size(3) == 3,
              "gates must be [B,T,H,3] for outputs ", a.sizes(), ", got ", gates.sizes());
}

dim3 WarpGrid(int64_t rows) {
  return dim3(static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads));
}

}  // namespace

at::Tensor GateMixForward(const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& c) {
  CheckMixInputs(gates, a, b, c);
  auto out = at::empty_like(a);
  const int64_t rows = a.size(0) * a.size(1) * a.size(2);
  if (rows == 0 || a.size(3) == 0) return out;
  NSA_DISPATCH_TYPES(a.scalar_type(), "nsa_gate_mix_forward", [&] {
    Launch(GateMixForwardKernel<scalar_t>, WarpGrid(rows), 0, gates.data_ptr<scalar_t>(),
           a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(), c.data_ptr<scalar_t>(),
           out.data_ptr<scalar_t>(), rows, static_cast<int>(a.size(3)));
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> GateMixBackward(
    const at::Tensor& dout_in, const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& c) {
  CheckMixInputs(gates, a, b, c);
  TORCH_CHECK(dout_in.sizes() == a.sizes(), "gradient must have the output's shape");
  const auto dout = dout_in.to(a.scalar_type()).contiguous();
  auto dgates = at::empty_like(gates), da = at::empty_like(a), db = at::empty_like(b),
       dc = at::empty_like(c);
  const int64_t rows = a.size(0) * a.size(1) * a.size(2);
  if (rows == 0) return {dgates, da, db, dc};
  if (a.size(3) == 0) return {dgates.zero_(), da, db, dc};
  NSA_DISPATCH_TYPES(a.scalar_type(), "nsa_gate_mix_backward", [&] {
    Launch(GateMixBackwardKernel<scalar_t>, WarpGrid(rows), 0, dout.data_ptr<scalar_t>(),
           gates.data_ptr<scalar_t>(), a.data_ptr<scalar_t>(), b.data_ptr<scalar_t>(),
           c.data_ptr<scalar_t>(), dgates.data_ptr<scalar_t>(), da.data_ptr<scalar_t>(),
           db.data_ptr<scalar_t>(), dc.data_ptr<scalar_t>(), rows, static_cast<int>(a.size(3)));
  });
  return {dgates, da, db, dc};
}

}  // namespace nsad::nsa::cuda::detail
