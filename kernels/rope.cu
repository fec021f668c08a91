// Fused rotary position embedding: one kernel forward, one backward, instead of LibTorch's
// cast / narrow / 4 mul / sub / add / cat / cast chain (and its fp32 temporaries).
//
// It also splits: x [B,T,P,M,D] comes in as a strided view (the module passes its whole kv
// projection, 6 parts) and each part goes out contiguous, rotated or copied as the part's
// bit in rotate_mask says. The backward writes the gradient of all parts into one
// contiguous tensor, so autograd sees no select/narrow backward (zeros + copy per part)
// and no sum over the parts.
//
// Each thread rotates one pair (x[j], x[j + D/2]) of one row, in float32 with the products
// rounded separately (__fmul_rn, no FMA contraction) so that the float32 result is the one
// the reference computes, then rounds once to the input type, as the reference does.
#include <algorithm>

#include "fused_launchers.h"
#include "launch_util.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

// Where the rows of x and the parts' outputs / gradients live.
template <typename T>
struct PartPtrs {
  T* p[kMaxRopeParts];
};
struct RopeGeometry {
  int64_t stride_b, stride_t, stride_p, stride_m;  // strides of x (elements)
  int T, P, M, half;
  uint32_t rotate_mask;  // bit p: part p is rotated (else copied)
};

// Grid-stride over all pairs: i = (((b*T + t)*P + p)*M + m)*half + j.
__device__ __forceinline__ void SplitIndex(int64_t i, const RopeGeometry& g, int& b, int& t,
                                           int& p, int& m, int& j) {
  j = static_cast<int>(i % g.half);
  i /= g.half;
  m = static_cast<int>(i % g.M);
  i /= g.M;
  p = static_cast<int>(i % g.P);
  i /= g.P;
  t = static_cast<int>(i % g.T);
  b = static_cast<int>(i / g.T);
}

template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    RopeForwardKernel(const scalar_t* __restrict__ x, PartPtrs<scalar_t> out,
                      const float* __restrict__ cos, const float* __restrict__ sin,
                      RopeGeometry g, int64_t pairs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < pairs;
       i += step) {
    int b, t, p, m, j;
    SplitIndex(i, g, b, t, p, m, j);
    const scalar_t* in = x + b * g.stride_b + t * g.stride_t + p * g.stride_p + m * g.stride_m;
    scalar_t* o = out.p[p] + ((static_cast<int64_t>(b) * g.T + t) * g.M + m) * (2 * g.half);
    if (!((g.rotate_mask >> p) & 1u)) {
      o[j] = in[j];
      o[j + g.half] = in[j + g.half];
      continue;
    }
    const float x1 = static_cast<float>(in[j]), x2 = static_cast<float>(in[j + g.half]);
    const float c = cos[static_cast<int64_t>(t) * g.half + j];
    const float s = sin[static_cast<int64_t>(t) * g.half + j];
    o[j] = static_cast<scalar_t>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    o[j + g.half] = static_cast<scalar_t>(__fadd_rn(__fmul_rn(x1, s), __fmul_rn(x2, c)));
  }
}

// y1 = x1 c - x2 s, y2 = x1 s + x2 c  =>  dx1 = dy1 c + dy2 s, dx2 = dy2 c - dy1 s.
template <typename scalar_t>
__global__ void __launch_bounds__(kThreads)
    RopeBackwardKernel(PartPtrs<const scalar_t> grads, scalar_t* __restrict__ dx,
                       const float* __restrict__ cos, const float* __restrict__ sin,
                       RopeGeometry g, int64_t pairs) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < pairs;
       i += step) {
    int b, t, p, m, j;
    SplitIndex(i, g, b, t, p, m, j);
    const scalar_t* gp =
        grads.p[p] + ((static_cast<int64_t>(b) * g.T + t) * g.M + m) * (2 * g.half);
    scalar_t* o = dx + (i / g.half) * (2 * g.half);  // dx is [B,T,P,M,D] contiguous
    if (!((g.rotate_mask >> p) & 1u)) {
      o[j] = gp[j];
      o[j + g.half] = gp[j + g.half];
      continue;
    }
    const float g1 = static_cast<float>(gp[j]), g2 = static_cast<float>(gp[j + g.half]);
    const float c = cos[static_cast<int64_t>(t) * g.half + j];
    const float s = sin[static_cast<int64_t>(t) * g.half + j];
    o[j] = static_cast<scalar_t>(__fadd_rn(__fmul_rn(g1, c), __fmul_rn(g2, s)));
    o[j + g.half] = static_cast<scalar_t>(__fsub_rn(__fmul_rn(g2, c), __fmul_rn(g1, s)));
  }
}

void CheckTable(const at::Tensor& cos, const at::Tensor& sin, int64_t T, int64_t half,
                const at::Device& device) {
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope tables must be float32");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous(), "rope tables must be contiguous");
  TORCH_CHECK(cos.device() == device && sin.device() == device,
              "rope tables must be on the device of x");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T && cos.size(1) == half &&
                  sin.sizes() == cos.sizes(),
              "rope table ", cos.sizes(), " does not fit ", T, " positions and D/2 = ", half);
}

dim3 GridFor(int64_t n) {
  // Grid-stride: a few waves of CTAs are enough for a memory-bound kernel.
  const int64_t ctas = std::min<int64_t>((n + kThreads - 1) / kThreads, int64_t{1} << 16);
  return dim3(static_cast<unsigned>(std::max<int64_t>(ctas, 1)));
}

}  // namespace

std::vector<at::Tensor> RopeForward(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, uint32_t rotate_mask) {
  TORCH_CHECK(x.is_cuda(), "x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 5, "x must be [B,T,P,M,D], got ", x.sizes());
  TORCH_CHECK(x.stride(4) == 1, "x must have unit stride in its last dim");
  const int64_t B = x.size(0), T = x.size(1), P = x.size(2), M = x.size(3), D = x.size(4);
  TORCH_CHECK(D % 2 == 0, "RoPE needs an even head dim, got ", D);
  TORCH_CHECK(P >= 1 && P <= kMaxRopeParts, "RoPE takes 1..", kMaxRopeParts, " parts, got ", P);
  CheckTable(cos, sin, T, D / 2, x.device());
  std::vector<at::Tensor> outs;
  for (int64_t p = 0; p < P; ++p) outs.push_back(at::empty({B, T, M, D}, x.options()));
  const int64_t pairs = B * T * P * M * (D / 2);
  if (pairs == 0) return outs;
  const RopeGeometry g{x.stride(0),         x.stride(1),         x.stride(2),
                       x.stride(3),         static_cast<int>(T), static_cast<int>(P),
                       static_cast<int>(M), static_cast<int>(D / 2), rotate_mask};
  NSA_DISPATCH_TYPES(x.scalar_type(), "nsa_rope_forward", [&] {
    PartPtrs<scalar_t> ptrs{};
    for (int64_t p = 0; p < P; ++p) ptrs.p[p] = outs[p].data_ptr<scalar_t>();
    Launch(RopeForwardKernel<scalar_t>, GridFor(pairs), 0, x.data_ptr<scalar_t>(), ptrs,
           cos.data_ptr<float>(), sin.data_ptr<float>(), g, pairs);
  });
  return outs;
}

at::Tensor RopeBackward(const std::vector<at::Tensor>& grads_in, const at::Tensor& cos,
                        const at::Tensor& sin, uint32_t rotate_mask) {
  const int64_t P = static_cast<int64_t>(grads_in.size());
  TORCH_CHECK(P >= 1 && P <= kMaxRopeParts, "RoPE takes 1..", kMaxRopeParts, " parts, got ", P);
  std::vector<at::Tensor> grads;
  for (const auto& g : grads_in) {
    TORCH_CHECK(g.is_cuda() && g.dim() == 4 && g.sizes() == grads_in[0].sizes() &&
                    g.scalar_type() == grads_in[0].scalar_type(),
                "rope gradients must be CUDA [B,T,M,D] of one shape and dtype");
    grads.push_back(g.contiguous());
  }
  const int64_t B = grads[0].size(0), T = grads[0].size(1), M = grads[0].size(2),
                D = grads[0].size(3);
  TORCH_CHECK(D % 2 == 0, "RoPE needs an even head dim, got ", D);
  CheckTable(cos, sin, T, D / 2, grads[0].device());
  auto dx = at::empty({B, T, P, M, D}, grads[0].options());
  const int64_t pairs = B * T * P * M * (D / 2);
  if (pairs == 0) return dx;
  const RopeGeometry g{0, 0, 0, 0, static_cast<int>(T), static_cast<int>(P),
                       static_cast<int>(M), static_cast<int>(D / 2), rotate_mask};
  NSA_DISPATCH_TYPES(dx.scalar_type(), "nsa_rope_backward", [&] {
    PartPtrs<const scalar_t> ptrs{};
    for (int64_t p = 0; p < P; ++p) ptrs.p[p] = grads[p].data_ptr<scalar_t>();
    Launch(RopeBackwardKernel<scalar_t>, GridFor(pairs), 0, ptrs, dx.data_ptr<scalar_t>(),
           cos.data_ptr<float>(), sin.data_ptr<float>(), g, pairs);
  });
  return dx;
}

}  // namespace nsad::nsa::cuda::detail
