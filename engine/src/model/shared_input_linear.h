// Several linear layers that read the same input, run as one GEMM: y = x [W_1; ...; W_n]^T
// (+ [b_1; ...; b_n]), split back into the n outputs. The parameters stay the layers' own
// (names, checkpoints and init unchanged); only the forward is fused.
//
// Why: under bf16 autocast each separate layer casts the float32 input again, and in the
// backward each hands back its own input gradient, cast to float32 and summed with the
// others; one GEMM casts once, sums the input gradient inside the GEMM (float32
// accumulators) and runs at a larger, more efficient N. Its backward through split is one
// concatenation of the output gradients.
#pragma once

#include <torch/torch.h>

#include <vector>

namespace nsad {

// layers[i] maps x's last dim to its out_features; returns the joint output
// [..., sum of out_features] = [layers[0](x) | layers[1](x) | ...]. Layers without a bias
// add zeros.
torch::Tensor SharedInputLinearJoint(const torch::Tensor& x,
                                     const std::vector<torch::nn::Linear>& layers);
// The same, split into layers[i](x) for each i (views into the joint output).
std::vector<torch::Tensor> SharedInputLinear(const torch::Tensor& x,
                                             const std::vector<torch::nn::Linear>& layers);

}  // namespace nsad
