#include "model/shared_input_linear.h"

#include <ATen/ATen.h>

namespace nsad {
namespace {

torch::Tensor JointWeight(const std::vector<torch::nn::Linear>& layers) {
  TORCH_CHECK(!layers.empty(), "SharedInputLinear needs at least one layer");
  std::vector<torch::Tensor> weights;
  for (const auto& layer : layers) weights.push_back(layer->weight);
  return torch::cat(weights);
}

}  // namespace

torch::Tensor ApplyLinear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias.defined() ? std::optional<at::Tensor>(layer->bias) : std::nullopt);
}

torch::Tensor SharedInputLinearJoint(const torch::Tensor& x,
                                     const std::vector<torch::nn::Linear>& layers) {
  for (const auto& layer : layers) {
    TORCH_CHECK(!layer->bias.defined(), "SharedInputLinearJoint takes layers without a bias");
  }
  return at::linear(x, JointWeight(layers));
}

std::vector<torch::Tensor> SharedInputLinear(const torch::Tensor& x,
                                             const std::vector<torch::nn::Linear>& layers) {
  std::vector<int64_t> sizes;
  for (const auto& layer : layers) sizes.push_back(layer->weight.size(0));
  auto parts = at::linear(x, JointWeight(layers)).split_with_sizes(sizes, -1);
  for (size_t i = 0; i < layers.size(); ++i) {
    // In the output's dtype: a float32 bias would promote a bf16 (autocast) output to float32.
    if (layers[i]->bias.defined()) parts[i] = parts[i] + layers[i]->bias.to(parts[i].scalar_type());
  }
  return parts;
}

}  // namespace nsad
