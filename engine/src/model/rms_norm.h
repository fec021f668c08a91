// RMSNorm with a learnable per-channel weight (LibTorch's C++ frontend has no RMSNorm
// module; the functional at::rms_norm does the work, fused on CUDA).
#pragma once

#include <torch/torch.h>

namespace nsad {

class RmsNormImpl : public torch::nn::Module {
 public:
  RmsNormImpl(int64_t dim, double eps) : eps_(eps) {
    weight = register_parameter("weight", torch::ones({dim}));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::rms_norm(x, {weight.size(0)}, weight, eps_);
  }
  double eps() const { return eps_; }
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RmsNorm);

}  // namespace nsad
