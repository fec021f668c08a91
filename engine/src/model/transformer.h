// The NSA transformer language model (torch side of the engine; never include from the
// server). Pre-norm blocks: RMSNorm -> NSA attention -> residual, RMSNorm -> SwiGLU ->
// residual; the LM head is tied to the token embedding (see transformer.cc).
#pragma once

#include <torch/torch.h>

#include <functional>
#include <optional>
#include <vector>

#include "nsad/config.h"
#include "model/rms_norm.h"
#include "model/weight_copies.h"
#include "nsad/engine.h"

namespace nsad {

class NsaTransformerImpl : public torch::nn::Module {
 public:
  // backend must already be resolved (kReference or kCuda, never kAuto).
  NsaTransformerImpl(const ModelConfig& config, AttentionBackend backend);

  // tokens [B,T] int64 -> logits [B,T,vocab], in the head matmul's dtype (bf16 under
  // autocast; the loss computes in float32 either way).
  torch::Tensor forward(const torch::Tensor& tokens);

  // Gate means/stddevs per branch and mean selected blocks per query, per layer, from the
  // most recent forward() (gathered without autograd).
  std::vector<LayerGateStats> last_gate_stats() const;
  // The same in two halves, so that a caller can fold the device-to-host copy into one of its
  // own (the trainer reads loss, gradient norm and these together, also under a CUDA graph):
  // [n_layers, 7] float32 on the device (undefined before the first forward), and its host
  // copy (any floating dtype) turned into stats.
  torch::Tensor last_gate_stats_tensor() const;
  static std::vector<LayerGateStats> GateStatsFromValues(const torch::Tensor& values);

  const ModelConfig& config() const { return config_; }

  // Diagnostics hook, unset (and free) by default: while set, forward() passes each block's
  // attention and MLP outputs (before the residual add) through
  // tap(layer, "attention" | "mlp", output) and carries on with what it returns. The
  // trainer uses it to find the first non-finite tensor of a failed step and to inject
  // faults in tests (trainer/nonfinite.h).
  using Tap = std::function<torch::Tensor(int layer, const char* sublayer, torch::Tensor output)>;
  void set_tap(Tap tap) { tap_ = std::move(tap); }

  // Activation checkpointing: blocks keep no activations for backward and are recomputed
  // there instead (less memory, about one more forward of compute). Off by default.
  void set_activation_checkpointing(bool on) { activation_checkpointing_ = on; }

  // On CUDA under 16-bit autocast, forward() first writes a 16-bit copy of every GEMM weight
  // in one multi-tensor copy and the GEMMs read those (model/weight_copies.h) instead of
  // each casting its own; same values. On by default; off only to compare (tests).
  void set_weight_copies(bool on) { weight_copies_on_ = on; }
  // The copies, for the optimizer to write as it updates the weights (AdamW::Step; the next
  // forward then copies only what it did not write); null while they are off.
  WeightCopies* weight_copies_for_update() { return weight_copies_on_ ? &weight_copies_ : nullptr; }
  // Copies the weights whose copy is no longer current (WeightCopies::RefreshStale): before
  // replaying a captured step, whose forward copies nothing when the copies were current at
  // capture.
  void RefreshStaleWeightCopies() {
    if (weight_copies_on_) weight_copies_.RefreshStale();
  }

 private:
  // The dtype of the weight copies this forward reads, if it reads any.
  std::optional<at::ScalarType> WeightCopyType() const;

  ModelConfig config_;
  AttentionBackend backend_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};  // NsaBlock (transformer.cc)
  RmsNorm final_norm_{nullptr};
  // No separate LM head matrix: logits = final_norm(x) @ embed_.weight^T (tied, GPT-2 style).
  Tap tap_;
  bool activation_checkpointing_ = false;
  bool weight_copies_on_ = true;
  WeightCopies weight_copies_;
};
TORCH_MODULE(NsaTransformer);

}  // namespace nsad
