// Non-finite values in a training step: test-only fault injection (config.fault_injection)
// and localisation of the first non-finite tensor of a failed step, both through the
// model's diagnostics tap (NsaTransformerImpl::set_tap) and autograd tensor hooks.
//
// Localisation re-runs the failed step's forward and backward on the same batches with
// checks: every block's attention and MLP output in forward order, the logits and the
// loss, then in backward order the gradients arriving at those outputs and at every
// parameter. The first non-finite one is reported, e.g. "layer 1 attention forward" or
// "layer 0 mlp_down.weight gradient".
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "model/transformer.h"
#include "nsad/config.h"

namespace nsad {

// The configured fault, for one optimizer step.
class FaultInjector {
 public:
  explicit FaultInjector(const FaultInjectionConfig& config) : config_(config) {}

  // Whether optimizer step `step` (1-based) is poisoned.
  bool ActiveAt(int64_t step) const {
    return config_.nan_at_step > 0 && step >= config_.nan_at_step &&
           step < config_.nan_at_step + config_.count;
  }
  // Poisons a block output when it is the configured one: NaN in forward, or a hook that
  // turns the gradient arriving at it into NaN (backward).
  torch::Tensor Apply(int layer, const char* sublayer, torch::Tensor output) const;
  // Poisons the loss when the configured layer is -1.
  torch::Tensor ApplyToLoss(torch::Tensor loss) const;

 private:
  FaultInjectionConfig config_;
};

// Records where non-finite values appear first during one forward+backward.
class NonFiniteProbe {
 public:
  // Watches the gradients of every parameter of `model` until destruction.
  explicit NonFiniteProbe(torch::nn::Module& model);
  ~NonFiniteProbe();
  NonFiniteProbe(const NonFiniteProbe&) = delete;
  NonFiniteProbe& operator=(const NonFiniteProbe&) = delete;

  // A tapped block output: checked now (forward) and when its gradient arrives (backward).
  torch::Tensor Observe(int layer, const char* sublayer, torch::Tensor output);
  // Any other forward tensor ("logits", "loss").
  void ObserveForward(const std::string& name, const torch::Tensor& value);

  // Empty when everything seen so far was finite.
  const std::string& first() const { return first_; }

 private:
  void Check(const std::string& name, const torch::Tensor& value);

  std::vector<std::pair<torch::Tensor, unsigned>> parameter_hooks_;
  std::string first_;
};

// Names a parameter for reports: "blocks.1.mlp_down.weight" -> "layer 1 mlp_down.weight".
std::string DescribeParameter(const std::string& name);

// "parameter layer 0 attn.q_proj.weight" for the first parameter holding a non-finite value,
// or "" when all are finite.
std::string FirstNonFiniteParameter(torch::nn::Module& model);

}  // namespace nsad
