#include "trainer/nonfinite.h"

#include <cstring>
#include <limits>

namespace nsad {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool AllFinite(const torch::Tensor& t) { return torch::isfinite(t).all().item<bool>(); }

std::string OutputName(int layer, const char* sublayer) {
  return "layer " + std::to_string(layer) + " " + sublayer;
}

}  // namespace

torch::Tensor FaultInjector::Apply(int layer, const char* sublayer, torch::Tensor output) const {
  if (layer != config_.layer || config_.sublayer != sublayer) return output;
  if (!config_.backward) return output * kNaN;
  if (output.requires_grad()) {
    output.register_hook([](torch::Tensor grad) { return grad * kNaN; });
  }
  return output;
}

torch::Tensor FaultInjector::ApplyToLoss(torch::Tensor loss) const {
  return config_.layer == -1 ? loss * kNaN : loss;
}

NonFiniteProbe::NonFiniteProbe(torch::nn::Module& model) {
  for (const auto& item : model.named_parameters()) {
    torch::Tensor parameter = item.value();
    if (!parameter.requires_grad()) continue;
    const std::string name = DescribeParameter(item.key()) + " gradient";
    const unsigned handle =
        parameter.register_hook([this, name](torch::Tensor grad) { Check(name, grad); });
    parameter_hooks_.emplace_back(parameter, handle);
  }
}

NonFiniteProbe::~NonFiniteProbe() {
  for (auto& [parameter, handle] : parameter_hooks_) parameter.remove_hook(handle);
}

void NonFiniteProbe::Check(const std::string& name, const torch::Tensor& value) {
  if (first_.empty() && value.defined() && !AllFinite(value)) first_ = name;
}

torch::Tensor NonFiniteProbe::Observe(int layer, const char* sublayer, torch::Tensor output) {
  const std::string name = OutputName(layer, sublayer);
  Check(name + " forward", output);
  if (output.requires_grad()) {
    // Registered after any injection hook, so it sees the gradient that flows on.
    output.register_hook([this, name](torch::Tensor grad) { Check(name + " backward", grad); });
  }
  return output;
}

void NonFiniteProbe::ObserveForward(const std::string& name, const torch::Tensor& value) {
  Check(name + " forward", value);
}

std::string DescribeParameter(const std::string& name) {
  const std::string prefix = "blocks.";
  if (name.rfind(prefix, 0) != 0) return name;
  const size_t dot = name.find('.', prefix.size());
  if (dot == std::string::npos) return name;
  return "layer " + name.substr(prefix.size(), dot - prefix.size()) + " " + name.substr(dot + 1);
}

std::string FirstNonFiniteParameter(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model.named_parameters()) {
    if (!AllFinite(item.value())) return "parameter " + DescribeParameter(item.key());
  }
  return "";
}

}  // namespace nsad
