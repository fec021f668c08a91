// The NSA transformer language model (torch side of the engine; never include from the
// server). Pre-norm blocks: RMSNorm -> NSA attention -> residual, RMSNorm -> SwiGLU ->
// residual; the LM head is tied to the token embedding (see transformer.cc).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "nsad/config.h"
#include "model/rms_norm.h"
#include "nsad/engine.h"

namespace nsad {

class NsaTransformerImpl : public torch::nn::Module {
 public:
  // backend must already be resolved (kReference or kCuda, never kAuto).
  NsaTransformerImpl(const ModelConfig& config, AttentionBackend backend);

  // tokens [B,T] int64 -> logits [B,T,vocab] (float32 under autocast too).
  torch::Tensor forward(const torch::Tensor& tokens);

  // Gate means/stddevs per branch and mean selected blocks per query, per layer, from the
  // most recent forward() (gathered without autograd).
  std::vector<LayerGateStats> last_gate_stats() const;

  const ModelConfig& config() const { return config_; }

 private:
  ModelConfig config_;
  AttentionBackend backend_;
  torch::nn::Embedding embed_{nullptr};
  torch::nn::ModuleList blocks_{nullptr};  // NsaBlock (transformer.cc)
  RmsNorm final_norm_{nullptr};
  // No separate LM head matrix: logits = final_norm(x) @ embed_.weight^T (tied, GPT-2 style).
};
TORCH_MODULE(NsaTransformer);

}  // namespace nsad
