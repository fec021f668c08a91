#include "model/row_ops.h"

#include <torch/autograd.h>

#include <utility>

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "fused_launchers.h"
#endif

namespace nsad {

torch::Tensor SumRows(const torch::Tensor& g) {
  TORCH_CHECK(g.dim() == 2, "SumRows takes [rows, n], got ", g.sizes());
  if (!g.is_cuda()) return g.sum(0);
  return at::mv(g.t(), at::ones({g.size(0)}, g.options()));
}

namespace {

// Whether t, viewed as 8-byte words along its last dimension, keeps its layout.
bool WordAligned(const torch::Tensor& t) {
  const int64_t item = t.element_size();
  if (t.dim() == 0 || t.stride(-1) != 1 || (t.size(-1) * item) % 8 != 0 || (t.storage_offset() * item) % 8 != 0) {
    return false;
  }
  for (int64_t i = 0; i + 1 < t.dim(); ++i) {
    if ((t.stride(i) * item) % 8 != 0) return false;
  }
  return true;
}

}  // namespace

void CopyInWords(torch::Tensor dst, const torch::Tensor& src) {
  TORCH_CHECK(dst.sizes() == src.sizes(), "CopyInWords: shapes differ: ", dst.sizes(), " and ", src.sizes());
  if (dst.scalar_type() == src.scalar_type() && dst.element_size() < 8 && WordAligned(dst) && WordAligned(src)) {
    dst.view(torch::kLong).copy_(src.view(torch::kLong));
  } else {
    dst.copy_(src);
  }
}

void TiedGradient::Save(torch::autograd::AutogradContext* ctx, const c10::intrusive_ptr<TiedGradient>& tied) {
  if (tied) ctx->saved_data["tied"] = c10::IValue::make_capsule(tied);
}

c10::intrusive_ptr<TiedGradient> TiedGradient::Saved(torch::autograd::AutogradContext* ctx) {
  const auto it = ctx->saved_data.find("tied");
  if (it == ctx->saved_data.end()) return {};
  return c10::static_intrusive_pointer_cast<TiedGradient>(it->second.toCapsule());
}

namespace {

struct EmbeddingRowsFn : torch::autograd::Function<EmbeddingRowsFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& weight,
                               const torch::Tensor& tokens, const c10::intrusive_ptr<TiedGradient>& tied) {
    ctx->save_for_backward({tokens});
    ctx->saved_data["vocab"] = weight.size(0);
    TiedGradient::Save(ctx, tied);
    return at::embedding(weight, tokens);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto tokens = ctx->get_saved_variables()[0];
    const auto& g = grads[0];
    const int64_t dim = g.size(-1), vocab = ctx->saved_data["vocab"].toInt();
    torch::Tensor dw;  // the tied head's, where its backward left it
    if (const auto tied = TiedGradient::Saved(ctx)) dw = std::exchange(tied->pending, torch::Tensor());
    if (dw.defined()) {
      TORCH_CHECK(dw.sizes() == at::IntArrayRef({vocab, dim}) && dw.scalar_type() == g.scalar_type(),
                  "EmbeddingRows: the tied head's gradient ", dw.scalar_type(), " ", dw.sizes(),
                  " does not fit the embedding's ", g.scalar_type(), " [", vocab, ", ", dim, "]");
    } else {
      dw = at::zeros({vocab, dim}, g.options());
    }
    const auto index = tokens.reshape({-1});
    const auto rows = g.reshape({-1, dim});
#ifdef NSAD_HAVE_CUDA_KERNELS
    if (nsa::cuda::detail::AddRowsAtTakes(dw, index, rows)) {
      nsa::cuda::detail::AddRowsAt(dw, index, rows);
      return {dw, torch::Tensor(), torch::Tensor()};
    }
#endif
    dw.index_add_(0, index, rows);
    return {dw, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool EmbeddingRowsTakesTied(const torch::Tensor& weight) {
  return weight.is_cuda() && weight.requires_grad() && torch::GradMode::is_enabled();
}

torch::Tensor EmbeddingRows(const torch::Tensor& weight, const torch::Tensor& tokens,
                            const c10::intrusive_ptr<TiedGradient>& tied) {
  TORCH_CHECK(weight.dim() == 2, "EmbeddingRows takes weight [V, D], got ", weight.sizes());
  if (!EmbeddingRowsTakesTied(weight)) return at::embedding(weight, tokens);
  return EmbeddingRowsFn::apply(weight, tokens, tied);
}

}  // namespace nsad
