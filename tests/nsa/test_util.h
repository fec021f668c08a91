// Helpers shared by the NSA test files.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <functional>
#include <vector>

namespace nsad::nsa::testing {

inline torch::TensorOptions Double() { return torch::TensorOptions().dtype(torch::kDouble); }

// A random tensor that requires grad.
inline torch::Tensor Leaf(at::IntArrayRef sizes, torch::Dtype dtype = torch::kDouble) {
  return torch::randn(sizes, torch::TensorOptions().dtype(dtype)).requires_grad_(true);
}

// Max |a - b| as a double (0 for two empty tensors).
inline double MaxDiff(const torch::Tensor& a, const torch::Tensor& b) {
  if (a.numel() == 0 && b.numel() == 0) return 0.0;
  return (a.detach().to(torch::kDouble) - b.detach().to(torch::kDouble)).abs().max().item<double>();
}

inline bool AllFinite(const torch::Tensor& t) {
  return t.numel() == 0 || torch::isfinite(t.detach()).all().item<bool>();
}

// Gradients of sum(out * weight) w.r.t. inputs (zeros where an input got no gradient).
inline std::vector<torch::Tensor> Grads(const torch::Tensor& out, const torch::Tensor& weight,
                                        const std::vector<torch::Tensor>& inputs) {
  if (!out.requires_grad()) {  // e.g. an output of constant zeros: no graph at all
    std::vector<torch::Tensor> zeros;
    for (const auto& input : inputs) zeros.push_back(torch::zeros_like(input));
    return zeros;
  }
  auto grads = torch::autograd::grad({(out * weight).sum()}, inputs, /*grad_outputs=*/{},
                                     /*retain_graph=*/false, /*create_graph=*/false,
                                     /*allow_unused=*/true);
  for (size_t i = 0; i < grads.size(); ++i) {
    if (!grads[i].defined()) grads[i] = torch::zeros_like(inputs[i]);
  }
  return grads;
}

// Central finite differences of a scalar loss against autograd, element by element.
// Double precision only; meant for tiny shapes.
inline void ExpectGradcheck(const std::function<torch::Tensor()>& loss_fn,
                            const std::vector<torch::Tensor>& inputs, double eps = 1e-6,
                            double tol = 1e-6) {
  const auto analytic = torch::autograd::grad({loss_fn()}, inputs, {}, false, false, true);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < inputs.size(); ++i) {
    auto flat = inputs[i].view({-1});
    auto expected = analytic[i].defined() ? analytic[i].reshape({-1})
                                          : torch::zeros_like(flat);
    for (int64_t e = 0; e < flat.numel(); ++e) {
      const double original = flat[e].item<double>();
      flat[e].fill_(original + eps);
      const double plus = loss_fn().item<double>();
      flat[e].fill_(original - eps);
      const double minus = loss_fn().item<double>();
      flat[e].fill_(original);
      const double numeric = (plus - minus) / (2 * eps);
      ASSERT_NEAR(expected[e].item<double>(), numeric, tol * (1.0 + std::abs(numeric)))
          << "input " << i << " element " << e;
    }
  }
}

}  // namespace nsad::nsa::testing
