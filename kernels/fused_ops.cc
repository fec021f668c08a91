// Autograd functions of the fused elementwise kernels (contract: fused_ops.h).
#include "fused_ops.h"

#include <ATen/record_function.h>
#include <torch/autograd.h>

#include "fused_launchers.h"

namespace nsad::nsa::cuda {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

struct RopeFn : torch::autograd::Function<RopeFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& cos, const torch::Tensor& sin,
                             int64_t rotate_mask) {
    RECORD_FUNCTION("nsa::rope_forward", std::vector<c10::IValue>());
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["rotate_mask"] = rotate_mask;
    return detail::RopeForward(x, cos, sin, static_cast<uint32_t>(rotate_mask));
  }
  // Parts whose output the loss does not use get zero gradients (autograd materialises
  // them), so the kernel always sees P gradients.
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::rope_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const auto mask = static_cast<uint32_t>(ctx->saved_data["rotate_mask"].toInt());
    return {detail::RopeBackward(grads, s[0], s[1], mask), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

struct GateMixFn : torch::autograd::Function<GateMixFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gates,
                               const torch::Tensor& a, const torch::Tensor& b,
                               const torch::Tensor& c) {
    RECORD_FUNCTION("nsa::gate_mix_forward", std::vector<c10::IValue>());
    ctx->save_for_backward({gates, a, b, c});
    return detail::GateMixForward(gates, a, b, c);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::gate_mix_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    auto [dg, da, db, dc] = detail::GateMixBackward(grads[0], s[0], s[1], s[2], s[3]);
    return {dg, da, db, dc};
  }
};

}  // namespace

bool FusedOpsTake(const torch::Tensor& t) {
  const auto type = t.scalar_type();
  return t.is_cuda() &&
         (type == torch::kBFloat16 || type == torch::kHalf || type == torch::kFloat);
}

std::vector<torch::Tensor> ApplyRopeParts(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin,
                                          const std::vector<bool>& rotate) {
  TORCH_CHECK(x.dim() == 5, "x must be [B,T,P,M,D], got ", x.sizes());
  TORCH_CHECK(static_cast<int64_t>(rotate.size()) == x.size(2), "rotate must name each of the ",
              x.size(2), " parts, got ", rotate.size());
  int64_t mask = 0;
  for (size_t p = 0; p < rotate.size(); ++p) mask |= rotate[p] ? int64_t{1} << p : 0;
  // The kernel reads any row layout but needs the pairs of a row in unit stride.
  const auto input = x.stride(4) == 1 ? x : x.contiguous();
  return RopeFn::apply(input, cos.contiguous(), sin.contiguous(), mask);
}

torch::Tensor MixBranches(const torch::Tensor& gates, const torch::Tensor& o_cmp,
                          const torch::Tensor& o_slc, const torch::Tensor& o_win) {
  return GateMixFn::apply(gates.contiguous(), o_cmp.contiguous(), o_slc.contiguous(),
                          o_win.contiguous());
}

}  // namespace nsad::nsa::cuda
