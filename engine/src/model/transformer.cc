// The NSA language model. GPT-2 style: token embedding, n_layers pre-norm blocks
// (RMSNorm -> NsaAttention -> residual, RMSNorm -> SwiGLU -> residual), final RMSNorm, LM
// head tied to the embedding (logits = x E^T: saves vocab*dim parameters -- 38.6M of the
// m7c_125m's ~125M -- and is what GPT-2 does at this scale).
//
// Init: every weight matrix N(0, 0.02) except the two residual output projections of each
// block (attention out, SwiGLU down), which get 0.02/sqrt(2*n_layers) so the residual
// stream's variance does not grow with depth (GPT-2); the gate MLP keeps its own init
// (nsa/attention.cc). Norm weights start at 1, biases at 0.
#include "model/transformer.h"

#include <cmath>
#include <stdexcept>

#include <ATen/autocast_mode.h>

#include "model/row_ops.h"
#include "model/shared_input_linear.h"
#include "model/weight_copies.h"
#include "nsa/attention.h"
#include "nsa/dispatch.h"

namespace nsad {
namespace {

RmsNorm MakeNorm(const ModelConfig& config) { return RmsNorm(config.dim, config.norm_eps); }

// {x + pending, norm(x + pending)} in one step (nsa::AddRmsNorm, one kernel on the CUDA
// backend); x and norm(x) when nothing is pending (before the first block, nsa::RmsNormOfResidual).
std::pair<torch::Tensor, torch::Tensor> AddPendingAndNorm(AttentionBackend backend, const torch::Tensor& x,
                                                          const torch::Tensor& pending, RmsNorm& norm) {
  if (!pending.defined()) return nsa::RmsNormOfResidual(backend, x, norm->weight, norm->eps());
  return nsa::AddRmsNorm(backend, x, pending, norm->weight, norm->eps());
}

torch::nn::Linear NormalLinear(int64_t in, int64_t out, double std) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out).bias(false));
  torch::NoGradGuard no_grad;
  linear->weight.normal_(0.0, std);
  return linear;
}

class NsaBlockImpl : public torch::nn::Module {
 public:
  NsaBlockImpl(const ModelConfig& config, AttentionBackend backend, double residual_std)
      : backend_(backend) {
    const int64_t dim = config.dim, hidden = EffectiveMlpHidden(config);
    attn_norm = register_module("attn_norm", MakeNorm(config));
    attn = register_module("attn", nsa::NsaAttention(config, backend, residual_std));
    mlp_norm = register_module("mlp_norm", MakeNorm(config));
    mlp_gate = register_module("mlp_gate", NormalLinear(dim, hidden, 0.02));
    mlp_up = register_module("mlp_up", NormalLinear(dim, hidden, 0.02));
    mlp_down = register_module("mlp_down", NormalLinear(hidden, dim, residual_std));
  }

  // The residual stream enters as x plus the previous block's MLP output not yet added
  // (`pending`; undefined before the first block) and leaves the same way: every residual
  // add happens together with the RMSNorm that follows it (nsa::AddRmsNorm, one kernel on
  // the CUDA backend, the norm written in the GEMM's dtype). Returns {x + pending +
  // attn_out, mlp_out}.
  std::pair<torch::Tensor, torch::Tensor> forward(torch::Tensor x, const torch::Tensor& pending, int layer,
                                                  const NsaTransformerImpl::Tap& tap) {
    torch::Tensor normed;
    std::tie(x, normed) = AddPendingAndNorm(backend_, x, pending, attn_norm);
    auto attn_out = attn->forward(normed);
    if (tap) attn_out = tap(layer, "attention", attn_out);
    std::tie(x, normed) = nsa::AddRmsNorm(backend_, x, attn_out, mlp_norm->weight, mlp_norm->eps());
    const auto gate_up = SharedInputLinearJoint(normed, MlpInputs());
    auto mlp_out = ApplyLinear(mlp_down, nsa::SwiGlu(backend_, gate_up));
    if (tap) mlp_out = tap(layer, "mlp", mlp_out);
    return {x, mlp_out};
  }

  // The weights of the block's GEMMs, as their operands stack them (WeightCopies' groups).
  void AddGemmWeights(std::vector<std::vector<torch::Tensor>>& groups) const {
    for (auto& group : attn->GemmWeights()) groups.push_back(std::move(group));
    std::vector<torch::Tensor> inputs;
    for (const auto& layer : MlpInputs()) inputs.push_back(layer->weight);
    groups.push_back(std::move(inputs));
    groups.push_back({mlp_down->weight});
  }

  RmsNorm attn_norm{nullptr}, mlp_norm{nullptr};
  nsa::NsaAttention attn{nullptr};
  torch::nn::Linear mlp_gate{nullptr}, mlp_up{nullptr}, mlp_down{nullptr};

 private:
  // The SwiGLU's two input layers, one GEMM: [gate | up].
  std::vector<torch::nn::Linear> MlpInputs() const { return {mlp_gate, mlp_up}; }

  AttentionBackend backend_;  // also picks the fused SwiGLU (nsa/dispatch.h)
};
TORCH_MODULE(NsaBlock);

// Recomputes a block in the backward pass instead of keeping its activations, the
// reentrant scheme of torch.utils.checkpoint: forward runs without autograd (as every
// custom Function's forward does); backward re-runs the block with autograd under the
// autocast state the forward saw (backward may run on another thread, and autocast state
// is thread-local), back-propagates into the block's parameters (their .grad accumulate as
// usual) and returns dL/dx. The block and the tap are owned by the model, which outlives
// the graph; they travel as integers because saved_data holds IValues.
class CheckpointedBlock : public torch::autograd::Function<CheckpointedBlock> {
 public:
  // Inputs and outputs as NsaBlockImpl::forward: {x, pending} -> {x, mlp_out}. A custom
  // Function takes no undefined tensor, so "nothing pending" (the first block) comes in as
  // an empty tensor.
  static torch::Tensor NothingPending(const torch::Tensor& x) { return x.new_empty({0}); }
  static torch::Tensor Pending(const torch::Tensor& t) { return t.numel() == 0 ? torch::Tensor() : t; }

  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                                                const torch::Tensor& pending, NsaBlockImpl* block, int64_t layer,
                                                const NsaTransformerImpl::Tap* tap) {
    const auto device = x.device().type();
    ctx->save_for_backward({x, pending});
    ctx->saved_data["block"] = reinterpret_cast<int64_t>(block);
    ctx->saved_data["tap"] = reinterpret_cast<int64_t>(tap);
    ctx->saved_data["layer"] = layer;
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(device);
    ctx->saved_data["autocast_dtype"] =
        static_cast<int64_t>(at::autocast::get_autocast_dtype(device));
    auto [out, mlp_out] = block->forward(x, Pending(pending), static_cast<int>(layer), *tap);
    return {out, mlp_out};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    auto x = saved[0].detach().requires_grad_(true);
    auto pending = Pending(saved[1]);
    if (pending.defined()) pending = pending.detach().requires_grad_(true);
    auto* block = reinterpret_cast<NsaBlockImpl*>(ctx->saved_data["block"].toInt());
    const auto* tap =
        reinterpret_cast<const NsaTransformerImpl::Tap*>(ctx->saved_data["tap"].toInt());
    const auto device = x.device().type();
    const bool autocast = ctx->saved_data["autocast"].toBool();
    const bool previous = at::autocast::is_autocast_enabled(device);
    const auto previous_dtype = at::autocast::get_autocast_dtype(device);
    at::autocast::set_autocast_enabled(device, autocast);
    at::autocast::set_autocast_dtype(
        device, static_cast<at::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()));
    std::pair<torch::Tensor, torch::Tensor> outs;
    {
      torch::AutoGradMode grad(true);
      outs = block->forward(x, pending, static_cast<int>(ctx->saved_data["layer"].toInt()), *tap);
    }
    at::autocast::set_autocast_enabled(device, previous);
    at::autocast::set_autocast_dtype(device, previous_dtype);
    if (autocast) at::autocast::clear_cache();
    // Back-propagate the outputs that received a gradient (both, in the model).
    torch::autograd::variable_list roots, grads;
    if (grad_outputs[0].defined()) {
      roots.push_back(outs.first);
      grads.push_back(grad_outputs[0]);
    }
    if (grad_outputs[1].defined()) {
      roots.push_back(outs.second);
      grads.push_back(grad_outputs[1]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    return {x.grad(), pending.defined() ? pending.grad() : torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

NsaTransformerImpl::NsaTransformerImpl(const ModelConfig& config, AttentionBackend backend)
    : config_(config), backend_(backend) {
  if (backend == AttentionBackend::kAuto) {
    throw std::invalid_argument("NsaTransformer needs a resolved backend (reference or cuda)");
  }
  embed_ = register_module("embed", torch::nn::Embedding(config.vocab_size, config.dim));
  {
    torch::NoGradGuard no_grad;
    embed_->weight.normal_(0.0, 0.02);
  }
  const double residual_std = 0.02 / std::sqrt(2.0 * config.n_layers);
  blocks_ = register_module("blocks", torch::nn::ModuleList());
  for (int i = 0; i < config.n_layers; ++i) {
    blocks_->push_back(NsaBlock(config, backend, residual_std));
  }
  final_norm_ = register_module("final_norm", MakeNorm(config));
}

std::optional<at::ScalarType> NsaTransformerImpl::WeightCopyType() const {
  const auto& w = embed_->weight;
  if (!weight_copies_on_ || !w.is_cuda() || w.scalar_type() != torch::kFloat ||
      !at::autocast::is_autocast_enabled(at::kCUDA)) {
    return std::nullopt;
  }
  const auto type = at::autocast::get_autocast_dtype(at::kCUDA);
  if (type != at::kBFloat16 && type != at::kHalf) return std::nullopt;
  return type;
}

torch::Tensor NsaTransformerImpl::forward(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 2, "tokens must be [B,T], got ", tokens.sizes());
  std::optional<UseWeightCopies> use_copies;
  if (const auto type = WeightCopyType()) {
    std::vector<std::vector<torch::Tensor>> groups;
    for (const auto& block : *blocks_) block->as<NsaBlockImpl>()->AddGemmWeights(groups);
    groups.push_back({embed_->weight});  // the tied LM head
    weight_copies_.Refresh(groups, *type);
    use_copies.emplace(&weight_copies_);
  }
  // The tied head's weight gradient goes to the embedding's backward, which adds its rows to it.
  const auto tied = EmbeddingRowsTakesTied(embed_->weight) ? c10::make_intrusive<TiedGradient>()
                                                            : c10::intrusive_ptr<TiedGradient>();
  auto x = EmbeddingRows(embed_->weight, tokens, tied);
  torch::Tensor pending;  // the last block's MLP output, added together with the next norm
  int layer = 0;
  const bool checkpoint = activation_checkpointing_ && is_training() &&
                          torch::GradMode::is_enabled() && x.requires_grad();
  for (const auto& block : *blocks_) {
    auto* impl = block->as<NsaBlockImpl>();
    if (checkpoint) {
      const auto outs = CheckpointedBlock::apply(
          x, pending.defined() ? pending : CheckpointedBlock::NothingPending(x), impl, static_cast<int64_t>(layer), &tap_);
      x = outs[0];
      pending = outs[1];
    } else {
      std::tie(x, pending) = impl->forward(x, pending, layer, tap_);
    }
    ++layer;
  }
  const auto normed = AddPendingAndNorm(backend_, x, pending, final_norm_).second;
  // Logits stay in the matmul's dtype (bf16 under autocast): the loss takes them as they
  // are (nsa::CrossEntropyLoss), and a float32 copy is 6.6 GB at batch 16.
  return ApplyWeight(normed, embed_->weight, tied);
}

torch::Tensor NsaTransformerImpl::last_gate_stats_tensor() const {
  // All layers' statistics from one call (on the CUDA backend one launch, where a launch per
  // layer cost a memset and a latency-bound pass each).
  std::vector<torch::Tensor> gates, block_idx;
  for (const auto& block : *blocks_) {
    const auto& attn = block->as<NsaBlockImpl>()->attn;
    if (!attn->last_gates().defined()) return {};
    gates.push_back(attn->last_gates());
    block_idx.push_back(attn->last_block_idx());
  }
  if (gates.empty()) return {};
  return nsa::GateStatsOfLayers(backend_, gates, block_idx);
}

std::vector<LayerGateStats> NsaTransformerImpl::GateStatsFromValues(const torch::Tensor& values) {
  const auto v = values.to(torch::kCPU, torch::kDouble).contiguous();
  std::vector<LayerGateStats> stats;
  for (int layer = 0; layer < static_cast<int>(v.size(0)); ++layer) {
    stats.push_back(nsa::NsaAttentionImpl::StatsFromValues(layer, v[layer].data_ptr<double>()));
  }
  return stats;
}

std::vector<LayerGateStats> NsaTransformerImpl::last_gate_stats() const {
  // One device-to-host copy for all layers (the trainer asks every step; a copy per layer
  // would be a host sync per layer).
  const auto values = last_gate_stats_tensor();
  if (values.defined()) return GateStatsFromValues(values);
  std::vector<LayerGateStats> stats;
  int layer = 0;
  for (const auto& block : *blocks_) stats.push_back(block->as<NsaBlockImpl>()->attn->last_stats(layer++));
  return stats;
}

}  // namespace nsad
