#include "model/shared_input_linear.h"

#include <ATen/ATen.h>
#include <ATen/TensorUtils.h>
#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <algorithm>
#include <atomic>
#include <numeric>
#include <utility>

#include "model/row_ops.h"
#include "model/weight_copies.h"

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "kernel_choice.h"
#include "tuned_gemm.h"
#endif

namespace nsad {
namespace {

std::atomic<int64_t> joint_gradient_backwards{0};

// The parts' gradients as one [rows, sum of sizes] matrix, when they lie as its adjacent
// column slices (written there by their consumers through a nsa::SharedGradient), in dtype
// `type`; else undefined.
torch::Tensor AdjacentParts(const torch::autograd::variable_list& grads, const std::vector<int64_t>& sizes,
                            int64_t rows, at::ScalarType type) {
  const int64_t width = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  if (grads.size() < 2 || !grads[0].defined() || rows < 2) return {};
  const auto& first = grads[0];
  const char* base = static_cast<const char*>(first.data_ptr());
  for (size_t i = 0, offset = 0; i < grads.size(); offset += sizes[i], ++i) {
    const auto& g = grads[i];
    if (!g.defined() || g.scalar_type() != type || g.device() != first.device() ||
        !g.storage().is_alias_of(first.storage()) ||
        static_cast<const char*>(g.data_ptr()) != base + offset * g.element_size()) {
      return {};
    }
    const std::vector<int64_t> as_matrix = {rows, sizes[i]};
    const auto strides = at::detail::computeStride(g.sizes(), g.strides(), at::IntArrayRef(as_matrix));
    if (!strides || (*strides)[0] != width || (*strides)[1] != 1) return {};
  }
  return first.as_strided({rows, width}, {width, 1});
}

#ifdef NSAD_HAVE_CUDA_KERNELS
// Whether this product runs on the tuned cuBLASLt path (GemmChoice kAuto and kTuned,
// kernel_choice.h).
bool Tuned(const torch::Tensor& a, const torch::Tensor& b, at::ScalarType out_dtype) {
  using Algo = nsa::cuda::detail::GemmChoice::Algo;
  return nsa::cuda::detail::GetGemmChoice().algo != Algo::kCublas && nsa::cuda::TunedMmTakes(a, b, out_dtype);
}
#endif

// a @ b in out_dtype (a's, or float32 from 16-bit operands on CUDA).
torch::Tensor Mm(const torch::Tensor& a, const torch::Tensor& b, at::ScalarType out_dtype) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (Tuned(a, b, out_dtype)) return nsa::cuda::TunedMm(a, b, out_dtype);
#endif
  return out_dtype == a.scalar_type() ? at::mm(a, b) : at::mm(a, b, out_dtype);
}

// out += a @ b.
void MmAdd(torch::Tensor& out, const torch::Tensor& a, const torch::Tensor& b) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (out.is_contiguous() && Tuned(a, b, a.scalar_type())) return nsa::cuda::TunedMmAdd(out, a, b);
#endif
  out.addmm_(a, b);
}

// dW = g^T x in the parameters' dtype. Where the GEMM can write it (CUDA, 16-bit operands,
// float32 parameters) it does, instead of writing 16-bit and casting: one kernel and one
// rounding less per weight.
torch::Tensor WeightGradient(const torch::Tensor& g, const torch::Tensor& x2, at::ScalarType param_dtype) {
  const bool narrow = x2.scalar_type() == at::kBFloat16 || x2.scalar_type() == at::kHalf;
  if (x2.is_cuda() && narrow && param_dtype == at::kFloat) return Mm(g.t(), x2, param_dtype);
  return Mm(g.t(), x2, g.scalar_type()).to(param_dtype);
}

// SharedInputLinear's autograd node. Inputs: x, then the layers' weights, then the biases of
// the layers whose has_bias is 1. Forward: one GEMM, the biases in its epilogue (a joint
// bias vector, zeros where a layer has none); its weight operand is the weights' 16-bit copy
// where a UseWeightCopies scope holds one (model/weight_copies.h), else their cast. Outputs:
// one per layer (`split`), or the joint output alone. Backward, per output part that got a
// gradient: dx += g_i W_i and dW_i = g_i^T x, db_i = the row sum of g_i. The parts'
// gradients are never concatenated (autograd's split backward copied all 113 MB of them at
// batch 16, T=2048) and no bias gradient reads another layer's part. A joint output's
// gradient is one part: one dx GEMM and one dW GEMM, whose rows are the layers' dW.
class SharedInputLinearFn : public torch::autograd::Function<SharedInputLinearFn> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                at::TensorList params, std::vector<int64_t> has_bias,
                                                int64_t compute_dtype, bool split,
                                                const c10::intrusive_ptr<TiedGradient>& tied) {
    // The caller chose the GEMM's dtype (autocast's, as at::linear would); nothing in here
    // may be recast.
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto ct = static_cast<at::ScalarType>(compute_dtype);
    const size_t n = has_bias.size();
    const std::vector<torch::Tensor> weights(params.begin(), params.begin() + n);
    std::vector<int64_t> sizes;
    for (const auto& w : weights) sizes.push_back(w.size(0));
    torch::Tensor joint;
    if (const auto* copies = UseWeightCopies::Current()) joint = copies->Joint(weights, ct);
    if (!joint.defined()) joint = (n == 1 ? weights[0] : at::cat(weights)).to(ct);
    const auto x2 = x.reshape({-1, x.size(-1)}).to(ct);
    torch::Tensor out;
    if (params.size() > n) {
      torch::Tensor bias;
      if (n == 1) {
        bias = params[1].to(ct);
      } else {
        bias = at::zeros({joint.size(0)}, joint.options());
        for (size_t i = 0, b = n, offset = 0; i < n; offset += sizes[i], ++i) {
          if (has_bias[i]) bias.narrow(0, offset, sizes[i]).copy_(params[b++]);
        }
      }
      out = at::addmm(bias, x2, joint.t());
    } else {
      out = Mm(x2, joint.t(), ct);
    }
    ctx->save_for_backward({x2, joint});
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["has_bias"] = has_bias;
    ctx->saved_data["param_dtype"] = static_cast<int64_t>(weights[0].scalar_type());
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["split"] = split;
    if (tied) {
      TORCH_CHECK(n == 1 && split, "SharedInputLinear: a TiedGradient takes one layer's weight gradient");
      TiedGradient::Save(ctx, tied);
    }
    auto out_sizes = x.sizes().vec();
    out_sizes.back() = joint.size(0);
    if (!split) return {out.view(out_sizes)};
    return out.view(out_sizes).split_with_sizes(sizes, -1);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &x2 = saved[0], &joint = saved[1];
    const auto sizes = ctx->saved_data["sizes"].toIntVector();
    const auto has_bias = ctx->saved_data["has_bias"].toIntVector();
    const auto param_dtype = static_cast<at::ScalarType>(ctx->saved_data["param_dtype"].toInt());
    const auto x_dtype = static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt());
    const size_t n = sizes.size();
    size_t biases = 0;
    for (const auto b : has_bias) biases += b != 0;

    // dx, the weights, the biases, and nothing for has_bias, compute_dtype, split and tied.
    torch::autograd::variable_list out(1 + n + biases + 4);
    std::vector<int64_t> offset(n, 0), bias_slot(n, 0);
    for (size_t i = 1; i < n; ++i) offset[i] = offset[i - 1] + sizes[i - 1];
    for (size_t i = 0, b = 1 + n; i < n; ++i) bias_slot[i] = has_bias[i] ? b++ : 0;
    // The gradient of all parts as one matrix g [rows, sum of sizes]: one dW GEMM, whose rows
    // are the layers' dW, and one dx GEMM; each bias sums its own columns.
    const auto from_one_matrix = [&](const torch::Tensor& g) {
      const auto dw = WeightGradient(g, x2, param_dtype);
      for (size_t i = 0; i < n; ++i) {
        out[1 + i] = dw.narrow(0, offset[i], sizes[i]);
        if (has_bias[i]) out[bias_slot[i]] = SumRows(g.narrow(1, offset[i], sizes[i])).to(param_dtype);
      }
      out[0] = Mm(g, joint, g.scalar_type()).view(ctx->saved_data["x_sizes"].toIntVector()).to(x_dtype);
      return out;
    };
    if (!ctx->saved_data["split"].toBool()) {  // the joint output (no biases)
      if (!grads[0].defined()) return out;
      return from_one_matrix(grads[0].reshape({-1, joint.size(0)}).to(x2.scalar_type()));
    }
    // Parts that their consumers wrote into one buffer.
    if (const auto g = AdjacentParts(grads, sizes, x2.size(0), x2.scalar_type()); g.defined()) {
      joint_gradient_backwards.fetch_add(1, std::memory_order_relaxed);
      return from_one_matrix(g);
    }
    // dx sums the parts' products, the narrowest first: it writes dx, and the wider ones,
    // bound by their arithmetic, hide the read of dx that accumulating costs (the gate's
    // 192-wide part accumulating last took 43 us, memory-bound).
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return sizes[a] < sizes[b]; });
    torch::Tensor dx;
    for (const size_t i : order) {
      if (!grads[i].defined()) continue;
      const auto g = grads[i].reshape({-1, sizes[i]}).to(x2.scalar_type());
      const auto w = joint.narrow(0, offset[i], sizes[i]);
      if (dx.defined()) {
        MmAdd(dx, g, w);
      } else {
        dx = Mm(g, w, g.scalar_type());
      }
      out[1 + i] = WeightGradient(g, x2, param_dtype);
      if (has_bias[i]) out[bias_slot[i]] = SumRows(g).to(param_dtype);
    }
    // The tied embedding's backward adds its rows to the weight's gradient and returns it.
    if (const auto tied = TiedGradient::Saved(ctx)) tied->pending = std::exchange(out[1], torch::Tensor());
    if (dx.defined()) out[0] = dx.view(ctx->saved_data["x_sizes"].toIntVector()).to(x_dtype);
    return out;
  }
};

}  // namespace

int64_t JointGradientBackwards() { return joint_gradient_backwards.load(); }

torch::ScalarType LinearComputeType(const torch::Tensor& x) {
  const auto device = x.device().type();
  return at::autocast::is_autocast_enabled(device) ? at::autocast::get_autocast_dtype(device) : x.scalar_type();
}

// Whether x @ weight^T takes SharedInputLinearFn (its float32 weight gradient straight from the
// GEMM) instead of at::linear: CUDA, a 16-bit compute type, float32 weights.
bool TakesOwnNode(const torch::Tensor& x, const torch::Tensor& weight) {
  const auto ct = LinearComputeType(x);
  return x.is_cuda() && weight.scalar_type() == at::kFloat && (ct == at::kBFloat16 || ct == at::kHalf);
}

torch::Tensor ApplyLinear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  if (TakesOwnNode(x, layer->weight)) return SharedInputLinear(x, {layer})[0];
  return at::linear(x, layer->weight, layer->bias.defined() ? std::optional<at::Tensor>(layer->bias) : std::nullopt);
}

torch::Tensor ApplyWeight(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::intrusive_ptr<TiedGradient>& tied) {
  if (!TakesOwnNode(x, weight)) return at::linear(x, weight);
  return SharedInputLinearFn::apply(x, at::TensorList(weight), std::vector<int64_t>{0},
                                    static_cast<int64_t>(LinearComputeType(x)), /*split=*/true, tied)[0];
}

torch::Tensor SharedInputLinearJoint(const torch::Tensor& x,
                                     const std::vector<torch::nn::Linear>& layers) {
  TORCH_CHECK(!layers.empty(), "SharedInputLinear needs at least one layer");
  std::vector<torch::Tensor> weights;
  for (const auto& layer : layers) {
    TORCH_CHECK(!layer->bias.defined(), "SharedInputLinearJoint takes layers without a bias");
    weights.push_back(layer->weight);
  }
  if (!TakesOwnNode(x, weights[0])) return at::linear(x, torch::cat(weights));
  return SharedInputLinearFn::apply(x, at::TensorList(weights), std::vector<int64_t>(weights.size(), 0),
                                    static_cast<int64_t>(LinearComputeType(x)), /*split=*/false,
                                    c10::intrusive_ptr<TiedGradient>())[0];
}

std::vector<torch::Tensor> SharedInputLinear(const torch::Tensor& x, const std::vector<torch::nn::Linear>& layers,
                                             Biases biases) {
  TORCH_CHECK(!layers.empty(), "SharedInputLinear needs at least one layer");
  const auto added = [biases](const torch::nn::Linear& layer) {
    return biases == Biases::kAdded && layer->bias.defined();
  };
  std::vector<torch::Tensor> params;
  std::vector<int64_t> has_bias;
  for (const auto& layer : layers) {
    params.push_back(layer->weight);
    has_bias.push_back(added(layer));
  }
  for (const auto& layer : layers) {
    if (added(layer)) params.push_back(layer->bias);
  }
  // As a TensorList: autograd takes a list's tensors as inputs (a std::vector is not one).
  return SharedInputLinearFn::apply(x, at::TensorList(params), has_bias,
                                    static_cast<int64_t>(LinearComputeType(x)), /*split=*/true,
                                    c10::intrusive_ptr<TiedGradient>());
}

}  // namespace nsad
