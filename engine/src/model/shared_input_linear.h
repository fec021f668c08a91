// Linear layers run through at::linear, and several linear layers that read the same input
// run as one GEMM.
#pragma once

#include <torch/torch.h>

#include <vector>

#include "model/row_ops.h"

namespace nsad {

// layer(x) through at::linear, which adds the bias in the GEMM's epilogue (cuBLASLt) for
// contiguous inputs of any rank. torch::nn::Linear's own forward (the C++ frontend's
// F::linear) runs matmul and then `out += bias` as a separate kernel; under bf16 autocast
// that add mixes a bf16 output with a float32 bias and takes PyTorch's slow casting path
// (0.245 ms per layer for the 113 MB joint projection at batch 16, T=2048, on an H100:
// longer than the GEMM itself).
// On CUDA under 16-bit autocast with float32 parameters it runs SharedInputLinear's node
// instead (the same GEMMs): the weight gradient comes out of the GEMM in float32, where
// at::linear's is written in 16 bits and then cast by autocast's backward (one kernel per
// weight, 4-117 us each for m7c at batch 16 on an H100).
torch::Tensor ApplyLinear(const torch::nn::Linear& layer, const torch::Tensor& x);
// x @ weight^T (no bias) the same way: the tied LM head. Given tied (model/row_ops.h), the
// weight's gradient is left there for the tied embedding's backward instead of returned, where
// this takes its own node (CUDA, 16-bit compute type, float32 weight; else tied stays unused).
torch::Tensor ApplyWeight(const torch::Tensor& x, const torch::Tensor& weight,
                          const c10::intrusive_ptr<TiedGradient>& tied = {});

// The dtype at::linear computes in for input x: autocast's where it is on for x's device,
// else x's own. For autograd nodes that run their GEMMs with autocast off.
torch::ScalarType LinearComputeType(const torch::Tensor& x);

// y = x [W_1; ...; W_n]^T, split back into the n outputs, each plus its layer's bias if it
// has one. The parameters stay the layers' own (names, checkpoints and init unchanged);
// only the forward is fused.
//
// Why: under bf16 autocast each separate layer casts the float32 input again, and in the
// backward each hands back its own input gradient, cast to float32 and summed with the
// others; one GEMM casts once, sums the input gradient inside the GEMM (float32
// accumulators) and runs at a larger, more efficient N. It is one autograd node with its own
// backward: each part's gradient goes into dx and its layer's gradients directly, without
// the concatenation autograd's split backward makes, and a bias gradient sums its own part
// only (the forward adds the biases in the GEMM's epilogue).
//
// Biases::kLeftToCaller: no bias is added (nor gets a gradient here): the caller adds the
// layers' biases where it reads the outputs (the attention's gate MLP adds its hidden bias
// inside its fused head, which also sums its gradient).
enum class Biases { kAdded, kLeftToCaller };
std::vector<torch::Tensor> SharedInputLinear(const torch::Tensor& x, const std::vector<torch::nn::Linear>& layers,
                                             Biases biases = Biases::kAdded);
// Backward: where the outputs' gradients come back as adjacent column slices of one
// [rows, sum of out_features] buffer (their consumers wrote them through a nsa::SharedGradient,
// nsa/shared_gradient.h), one dx GEMM and one dW GEMM for all the layers; otherwise one of
// each per output that got a gradient.
//
// How many backwards took the one-buffer path in this process: lets tests prove that the
// attention's three parts arrive as one.
int64_t JointGradientBackwards();

// The joint output [..., sum of out_features] = [layers[0](x) | layers[1](x) | ...], for
// layers without a bias (throws otherwise).
torch::Tensor SharedInputLinearJoint(const torch::Tensor& x,
                                     const std::vector<torch::nn::Linear>& layers);

}  // namespace nsad
