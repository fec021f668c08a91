// Autograd functions of the fused elementwise kernels (contract: fused_ops.h).
#include "fused_ops.h"

#include <ATen/record_function.h>
#include <ATen/DeviceGuard.h>
#include <torch/autograd.h>

#include "fused_launchers.h"

namespace nsad::nsa::cuda {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;

// Outputs: the parts outside `chunks`, in order, then (with chunks) their stack in the chunk
// layout, which autograd sees as one tensor (its parts as views of it would each get a
// select's backward: a zero fill and a copy).
struct RopeFn : torch::autograd::Function<RopeFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x,
                             const torch::Tensor& cos, const torch::Tensor& sin,
                             int64_t rotate_mask, const GradientPart& dx, std::vector<int64_t> chunk_spec,
                             const c10::intrusive_ptr<GradientHandoff>& handoff) {
    RECORD_FUNCTION("nsa::rope_forward", std::vector<c10::IValue>());
    const PartChunks chunks = ChunksFrom(chunk_spec);
    TORCH_CHECK(!handoff || handoff->size() == static_cast<size_t>(x.size(2)), "RoPE: a handoff of ",
                handoff ? handoff->size() : 0, " slots for ", x.size(2), " parts");
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["rotate_mask"] = rotate_mask;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["x_type"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["dx"] = dx.ToSaved();
    ctx->saved_data["chunks"] = chunk_spec;
    ctx->saved_data["handoff"] = GradientHandoff::ToSaved(handoff);
    // Undefined gradients stay undefined: a part may take its gradient from the handoff.
    ctx->set_materialize_grads(false);
    auto parts = detail::RopeForward(x, cos, sin, static_cast<uint32_t>(rotate_mask), chunks);
    if (!chunks.Any()) return parts;
    tensor_list outs;
    for (int64_t p = 0; p < x.size(2); ++p) {
      if (!chunks.Holds(p)) outs.push_back(parts[p]);
    }
    outs.push_back(parts.back());
    return outs;
  }
  // A part whose gradient autograd leaves undefined takes the handoff's (a float32 one is
  // rounded by the kernel), else zeros (the loss does not use that part), so the kernel always
  // sees P gradients.
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::rope_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const auto mask = static_cast<uint32_t>(ctx->saved_data["rotate_mask"].toInt());
    const auto x_sizes = ctx->saved_data["x_sizes"].toIntVector();
    const auto x_type = static_cast<at::ScalarType>(ctx->saved_data["x_type"].toInt());
    const PartChunks chunks = ChunksFrom(ctx->saved_data["chunks"].toIntVector());
    const auto handoff = GradientHandoff::FromSaved(ctx->saved_data["handoff"]);
    const auto options = s[0].options().dtype(x_type);
    const int64_t B = x_sizes[0], T = x_sizes[1], M = x_sizes[3], D = x_sizes[4];
    const torch::Tensor stack = chunks.Any() ? grads.back() : torch::Tensor();
    tensor_list part_grads;
    for (int64_t p = 0, plain = 0; p < x_sizes[2]; ++p) {
      const bool chunked = chunks.Holds(p);
      torch::Tensor g = chunked ? (stack.defined() ? stack[p - chunks.first] : torch::Tensor()) : grads[plain++];
      if (!g.defined() && handoff) g = handoff->Take(p);
      if (!g.defined()) {
        g = chunked ? torch::zeros({B, chunks.chunks, M, chunks.len, D}, options) : torch::zeros({B, T, M, D}, options);
      }
      part_grads.push_back(g);
    }
    const auto dx = GradientPart::FromSaved(ctx->saved_data["dx"]).Take(x_sizes);
    return {detail::RopeBackward(part_grads, s[0], s[1], mask, x_type, dx, chunks),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor(),
            torch::Tensor()};
  }

  // The chunk layout as autograd's saved data takes it: {first, count, len, chunks}.
  static std::vector<int64_t> ChunkSpec(const PartChunks& c) { return {c.first, c.count, c.len, c.chunks}; }
  static PartChunks ChunksFrom(const std::vector<int64_t>& v) {
    return {static_cast<int>(v[0]), static_cast<int>(v[1]), v[2], v[3]};
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

// Mean cross-entropy over the rows whose target is not ignore_index (LibTorch's
// cross_entropy with reduction 'mean'). Two paths:
// - one pass (one_pass: the logits need a gradient and a row fits the kernel's shared memory):
//   the forward also writes the gradient for an incoming expected_grad and saves only that;
//   the backward rescales it in place if another gradient came (a device-side check) and
//   returns it. About 1.1 ms less per m7c step at batch 16 on an H100 than the two kernels.
// - two kernels: the forward saves the logits and each row's max and log-sum; the backward
//   recomputes the softmax from them.
struct CrossEntropyFn : torch::autograd::Function<CrossEntropyFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& logits, const torch::Tensor& targets,
                               int64_t ignore_index, double expected_grad, bool one_pass) {
    RECORD_FUNCTION("nsa::cross_entropy_forward", std::vector<c10::IValue>());
    // Counted on the device: no host read, so the step stays capturable in a CUDA graph.
    const auto count = targets.ne(ignore_index).sum().to(torch::kFloat);
    ctx->saved_data["ignore_index"] = ignore_index;
    ctx->saved_data["one_pass"] = one_pass;
    if (one_pass) {
      auto [row_loss, grad] = detail::CrossEntropyForwardWithGrad(logits, targets, ignore_index, count, expected_grad);
      ctx->save_for_backward({grad});
      ctx->saved_data["expected_grad"] = expected_grad;
      return row_loss.sum() / count;
    }
    auto [row_loss, row_stats] = detail::CrossEntropyForward(logits, targets, ignore_index);
    ctx->save_for_backward({logits, targets, row_stats, count});
    return row_loss.sum() / count;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::cross_entropy_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const tensor_list no_grads = {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    if (ctx->saved_data["one_pass"].toBool()) {
      // The saved gradient is rescaled in place: a second backward would scale it twice.
      TORCH_CHECK(ctx->saved_data.count("backward_ran") == 0,
                  "the one-pass cross-entropy's backward runs once (retain_graph is not supported)");
      ctx->saved_data["backward_ran"] = true;
      auto grad = s[0];
      detail::CrossEntropyRescaleGrad(grad, grads[0].to(torch::kFloat).reshape({1}),
                                      ctx->saved_data["expected_grad"].toDouble());
      tensor_list out = {grad};
      out.insert(out.end(), no_grads.begin(), no_grads.end());
      return out;
    }
    const auto scale = (grads[0].to(torch::kFloat) / s[3]).reshape({1});
    tensor_list out = {detail::CrossEntropyBackward(s[0], s[1], s[2], scale, ctx->saved_data["ignore_index"].toInt())};
    out.insert(out.end(), no_grads.begin(), no_grads.end());
    return out;
  }
};

struct SwiGluFn : torch::autograd::Function<SwiGluFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& joint) {
    RECORD_FUNCTION("nsa::swiglu_forward", std::vector<c10::IValue>());
    ctx->save_for_backward({joint});
    return detail::SwiGluForward(joint);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::swiglu_backward", std::vector<c10::IValue>());
    return {detail::SwiGluBackward(grads[0], ctx->get_saved_variables()[0])};
  }
};

struct SiluRowsFn : torch::autograd::Function<SiluRowsFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x, const GradientPart& dx) {
    RECORD_FUNCTION("nsa::silu_rows_forward", std::vector<c10::IValue>());
    ctx->save_for_backward({x});
    ctx->saved_data["dx"] = dx.ToSaved();
    return detail::SiluRowsForward(x);
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::silu_rows_backward", std::vector<c10::IValue>());
    const auto x = ctx->get_saved_variables()[0];
    const auto dx = GradientPart::FromSaved(ctx->saved_data["dx"]).Take(x.sizes());
    return {detail::SiluRowsBackward(grads[0], x, dx), torch::Tensor()};
  }
};

// gates = sigmoid(silu(u + c) W^T + b): differentiable w.r.t. u, c (the hidden bias; empty for
// none: an autograd node takes no undefined input), W and b; w16 (W's 16-bit operand, no
// gradient of its own) is what the kernels multiply by. Saves u, c, w16 and the gates.
struct GateHeadFn : torch::autograd::Function<GateHeadFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& u, const torch::Tensor& hidden_bias,
                               const torch::Tensor& weight, const torch::Tensor& bias, const torch::Tensor& w16,
                               const GradientPart& du) {
    RECORD_FUNCTION("nsa::gate_head_forward", std::vector<c10::IValue>());
    auto gates = detail::GateHeadForward(u, hidden_bias, w16, bias);
    ctx->save_for_backward({u, hidden_bias, w16, gates});
    ctx->saved_data["du"] = du.ToSaved();
    ctx->saved_data["weight_dtype"] = static_cast<int64_t>(weight.scalar_type());
    ctx->saved_data["bias_dtype"] = static_cast<int64_t>(bias.scalar_type());
    return gates;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::gate_head_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    if (!grads[0].defined()) return tensor_list(6);
    const auto &u = s[0], &hidden_bias = s[1], &w16 = s[2], &gates = s[3];
    const auto du_out = GradientPart::FromSaved(ctx->saved_data["du"]).Take(u.sizes());
    auto g = detail::GateHeadBackward(grads[0], gates, u, hidden_bias, w16, du_out);
    const auto wt = static_cast<at::ScalarType>(ctx->saved_data["weight_dtype"].toInt());
    const auto bt = static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt());
    const auto dc = g.dc.defined() ? g.dc.to(hidden_bias.scalar_type()).view(hidden_bias.sizes()) : torch::Tensor();
    return {g.du, dc, g.dw.to(wt), g.db.to(bt), torch::Tensor(), torch::Tensor()};
  }
};

// Outputs (s, h); saves s and rstd (h is recomputable, not needed by the backward).
struct AddRmsNormFn : torch::autograd::Function<AddRmsNormFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& y,
                             const torch::Tensor& weight, double eps) {
    RECORD_FUNCTION("nsa::add_rms_norm_forward", std::vector<c10::IValue>());
    auto [s, h, rstd] = detail::AddRmsNormForward(x, y, weight, eps);
    ctx->save_for_backward({s, rstd, weight});
    ctx->saved_data["h_dtype"] = static_cast<int64_t>(h.scalar_type());
    // An unused s (the final norm's) gets no gradient: materialised, it was a 100 MB zero fill
    // per m7c batch 16 step that the kernel then read.
    ctx->set_materialize_grads(false);
    return {s, h};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::add_rms_norm_backward", std::vector<c10::IValue>());
    if (!grads[0].defined() && !grads[1].defined()) return tensor_list(4);
    const auto saved = ctx->get_saved_variables();
    const auto dh = grads[1].defined()
                        ? grads[1]
                        : at::zeros(saved[0].sizes(), saved[0].options().dtype(static_cast<at::ScalarType>(
                                                          ctx->saved_data["h_dtype"].toInt())));
    auto [dx, dy, dw] = detail::AddRmsNormBackward(grads[0], dh, saved[0], saved[1], saved[2]);
    return {dx, dy, dw, torch::Tensor()};
  }
};

// The norm of x alone, before the first block: outputs (x, h), x passed through so that the
// residual's gradient comes into this backward and is summed with the norm's in the kernel
// (no autograd add of x's two gradients); saves x and rstd.
struct RmsNormOfResidualFn : torch::autograd::Function<RmsNormOfResidualFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight, double eps,
                             int64_t h_type) {
    RECORD_FUNCTION("nsa::rms_norm_of_residual_forward", std::vector<c10::IValue>());
    auto [unused_s, h, rstd] =
        detail::AddRmsNormForward(x, torch::Tensor(), weight, eps, static_cast<at::ScalarType>(h_type));
    ctx->save_for_backward({x, rstd, weight});
    ctx->set_materialize_grads(false);
    return {x, h};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::rms_norm_of_residual_backward", std::vector<c10::IValue>());
    const torch::Tensor none;
    if (!grads[1].defined()) return {grads[0], none, none, none};  // h unused: x's own gradient
    const auto saved = ctx->get_saved_variables();
    auto [dx, unused_dy, dw] =
        detail::AddRmsNormBackward(grads[0], grads[1], saved[0], saved[1], saved[2], /*want_dy=*/false);
    return {dx, dw, none, none};
  }
};

}  // namespace

bool FusedOpsTake(const torch::Tensor& t) {
  const auto type = t.scalar_type();
  return t.is_cuda() &&
         (type == torch::kBFloat16 || type == torch::kHalf || type == torch::kFloat);
}

std::vector<torch::Tensor> ApplyRopeParts(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const std::vector<bool>& rotate,
                                          const GradientPart& dx, const PartChunks& chunks,
                                          const c10::intrusive_ptr<GradientHandoff>& handoff) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(x));
  TORCH_CHECK(x.dim() == 5, "x must be [B,T,P,M,D], got ", x.sizes());
  TORCH_CHECK(static_cast<int64_t>(rotate.size()) == x.size(2), "rotate must name each of the ",
              x.size(2), " parts, got ", rotate.size());
  int64_t mask = 0;
  for (size_t p = 0; p < rotate.size(); ++p) mask |= rotate[p] ? int64_t{1} << p : 0;
  // The kernel reads any row layout but needs the pairs of a row in unit stride.
  const auto input = x.stride(4) == 1 ? x : x.contiguous();
  auto outs = RopeFn::apply(input, cos.contiguous(), sin.contiguous(), mask, dx, RopeFn::ChunkSpec(chunks), handoff);
  if (handoff) {
    for (int64_t p = 0, plain = 0; p < x.size(2); ++p) {
      if (!chunks.Holds(p)) handoff->RecordOutput(p, outs[plain++]);
    }
  }
  if (!chunks.Any()) return outs;
  // P parts (undefined where chunked), then the stack.
  std::vector<torch::Tensor> parts;
  for (int64_t p = 0, plain = 0; p < x.size(2); ++p) parts.push_back(chunks.Holds(p) ? torch::Tensor() : outs[plain++]);
  parts.push_back(outs.back());
  return parts;
}

torch::Tensor MixBranches(const torch::Tensor& gates, const torch::Tensor& o_cmp,
                          const torch::Tensor& o_slc, const torch::Tensor& o_win) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(gates));
  return GateMixFn::apply(gates.contiguous(), o_cmp.contiguous(), o_slc.contiguous(),
                          o_win.contiguous());
}

}  // namespace nsad::nsa::cuda

namespace nsad::nsa::cuda {

bool AddRmsNormTakes(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& weight) {
  return x.is_cuda() && x.scalar_type() == torch::kFloat && FusedOpsTake(y) &&
         y.device() == x.device() && x.sizes() == y.sizes() && weight.is_cuda() &&
         weight.scalar_type() == torch::kFloat && weight.dim() == 1 && x.dim() >= 1 &&
         weight.size(0) == x.size(-1) && weight.size(0) <= detail::kAddRmsNormMaxChannels;
}

std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(x));
  auto out = AddRmsNormFn::apply(x.contiguous(), y.contiguous(), weight, eps);
  return {out[0], out[1]};
}

std::pair<torch::Tensor, torch::Tensor> RmsNormOfResidual(const torch::Tensor& x, const torch::Tensor& weight,
                                                          double eps, torch::ScalarType h_type) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(x));
  auto out = RmsNormOfResidualFn::apply(x.contiguous(), weight, eps, static_cast<int64_t>(h_type));
  return {out[0], out[1]};
}

torch::Tensor SwiGlu(const torch::Tensor& joint) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(joint));
  return SwiGluFn::apply(joint.contiguous());
}

torch::Tensor SiluRows(const torch::Tensor& x, const GradientPart& dx) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(x));
  TORCH_CHECK(FusedOpsTake(x), "SiluRows takes a bf16, fp16 or fp32 CUDA tensor");
  return SiluRowsFn::apply(detail::SiluRowsTake(x) ? x : x.contiguous(), dx);
}

bool GateHeadTakes(const torch::Tensor& u, const torch::Tensor& hidden_bias, const torch::Tensor& weight,
                   const torch::Tensor& bias) {
  return weight.dim() == 2 && weight.size(1) == u.size(-1) && bias.dim() == 1 && bias.size(0) == weight.size(0) &&
         (!hidden_bias.defined() ||
          (hidden_bias.dim() == 1 && hidden_bias.size(0) == u.size(-1) && hidden_bias.device() == u.device())) &&
         weight.device() == u.device() && bias.device() == u.device() && detail::GateHeadTakes(u, weight.size(0));
}

torch::Tensor GateHead(const torch::Tensor& u, const torch::Tensor& hidden_bias, const torch::Tensor& weight,
                       const torch::Tensor& bias, const torch::Tensor& w16, const GradientPart& du) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(u));
  TORCH_CHECK(GateHeadTakes(u, hidden_bias, weight, bias), "GateHead takes u [.., K] (bf16/fp16 CUDA rows of one "
              "16-byte-aligned stride, K a multiple of 32 up to 480), hidden_bias [K] or none, weight [N, K] and "
              "bias [N] with N even and at most 64; got u ", u.sizes(), " ", u.scalar_type(), ", hidden_bias ",
              hidden_bias.defined() ? hidden_bias.sizes() : at::IntArrayRef(), ", weight ", weight.sizes(),
              ", bias ", bias.sizes());
  const auto operand = w16.defined() ? w16.detach() : weight.detach().to(u.scalar_type());
  TORCH_CHECK(operand.sizes() == weight.sizes(), "GateHead: the weight's 16-bit copy must have its shape");
  const auto c = hidden_bias.defined() ? hidden_bias : u.new_empty({0}, u.options().dtype(at::kFloat));
  return GateHeadFn::apply(u, c, weight, bias, operand, du);
}

torch::Tensor GateStats(const torch::Tensor& gates, const torch::Tensor& block_idx) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(gates));
  torch::NoGradGuard no_grad;
  return detail::GateStats(gates.detach(), block_idx.detach());
}

bool GateStatsOfLayersTake(const std::vector<torch::Tensor>& gates, const std::vector<torch::Tensor>& block_idx) {
  return detail::GateStatsOfLayersTake(gates, block_idx);
}

torch::Tensor GateStatsOfLayers(const std::vector<torch::Tensor>& gates, const std::vector<torch::Tensor>& block_idx) {
  TORCH_CHECK(!gates.empty(), "GateStatsOfLayers takes at least one layer's gates");
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(gates.front()));
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> g, i;
  for (const auto& t : gates) g.push_back(t.detach());
  for (const auto& t : block_idx) i.push_back(t.detach());
  return detail::GateStatsOfLayers(g, i);
}

torch::Tensor CrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                           int64_t ignore_index, double expected_grad) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(logits));
  TORCH_CHECK(logits.dim() == 2, "cross-entropy takes logits [N, V], got ", logits.sizes());
  const auto rows = logits.contiguous();
  const bool one_pass =
      torch::GradMode::is_enabled() && rows.requires_grad() && detail::CrossEntropyOnePassTakes(rows);
  return CrossEntropyFn::apply(rows, targets.reshape({-1}).contiguous(), ignore_index, expected_grad, one_pass);
}

}  // namespace nsad::nsa::cuda
