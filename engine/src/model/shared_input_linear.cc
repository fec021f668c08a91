#include "model/shared_input_linear.h"

namespace nsad {

torch::Tensor SharedInputLinearJoint(const torch::Tensor& x,
                                     const std::vector<torch::nn::Linear>& layers) {
  TORCH_CHECK(!layers.empty(), "SharedInputLinear needs at least one layer");
  std::vector<torch::Tensor> weights, biases;
  bool any_bias = false;
  for (const auto& layer : layers) {
    weights.push_back(layer->weight);
    any_bias = any_bias || layer->bias.defined();
  }
  if (any_bias) {
    for (const auto& layer : layers) {
      biases.push_back(layer->bias.defined() ? layer->bias
                                             : torch::zeros({layer->weight.size(0)},
                                                            layer->weight.options()));
    }
  }
  return torch::nn::functional::linear(x, torch::cat(weights),
                                      any_bias ? torch::cat(biases) : torch::Tensor());
}

std::vector<torch::Tensor> SharedInputLinear(const torch::Tensor& x,
                                             const std::vector<torch::nn::Linear>& layers) {
  std::vector<int64_t> sizes;
  for (const auto& layer : layers) sizes.push_back(layer->weight.size(0));
  return SharedInputLinearJoint(x, layers).split_with_sizes(sizes, -1);
}

}  // namespace nsad
