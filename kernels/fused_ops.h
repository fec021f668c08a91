// Fused CUDA versions of the attention module's elementwise steps (RoPE and the gate
// mixing of the three branches) and of the model's residual add + RMSNorm, SwiGLU and loss
// (cross-entropy), as autograd functions with a one-kernel forward and a one-kernel
// backward. Their oracles are the LibTorch code in nsa/rope.h (ApplyRope) and
// nsa/dispatch.cc (the reference mixing, add + norm, SwiGLU and loss); nsa/dispatch.h
// decides which one runs. Like the NSA ops (nsa_cuda.h), each runs on its inputs' device
// whichever device is current.
// Only compiled when nvcc is present (NSAD_HAVE_CUDA_KERNELS).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "nsa/part_chunks.h"
#include "nsa/shared_gradient.h"

namespace nsad::nsa::cuda {

// True when the fused ops take tensors of this device and dtype (CUDA; bf16, fp16, fp32).
bool FusedOpsTake(const torch::Tensor& t);

// x [B,T,P,M,D] (any strides with unit stride in D; P <= 8) split into its P parts
// x[:,:,p], each a contiguous [B,T,M,D]; part p rotated by RoPE at the angles of position t
// (cos, sin [T, D/2] float32, a RopeTable) when rotate[p], else copied. Differentiable
// w.r.t. x, whose gradient comes back as one contiguous tensor. A rotated part equals
// ApplyRope(x[:,:,p], table) up to the rounding of the result to x's dtype. Given dx (x's
// part of a SharedGradient), the gradient is written there instead. With chunks, the parts
// it names come out as one tensor in its chunk layout (nsa/part_chunks.h), returned after the
// P parts, whose entries for those parts are undefined. With handoff (one slot per part), a
// part whose gradient autograd leaves undefined takes the one a consumer's backward put into
// its slot (of x's dtype or float32: GradientHandoff); a part with neither gets zeros.
std::vector<torch::Tensor> ApplyRopeParts(const torch::Tensor& x, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const std::vector<bool>& rotate,
                                          const GradientPart& dx = {}, const PartChunks& chunks = {},
                                          const c10::intrusive_ptr<GradientHandoff>& handoff = {});

// gates [B,T,H,3]; o_cmp, o_slc, o_win [B,T,H,D], one dtype ->
// gates[...,0] * o_cmp + gates[...,1] * o_slc + gates[...,2] * o_win, differentiable w.r.t.
// all four inputs.
torch::Tensor MixBranches(const torch::Tensor& gates, const torch::Tensor& o_cmp,
                          const torch::Tensor& o_slc, const torch::Tensor& o_win);

// Residual add + RMSNorm: x float32 [.., C], y [.., C] (bf16, fp16 or fp32), weight
// float32 [C] -> (s = x + y float32, h = rms_norm(s, weight, eps) in y's dtype),
// differentiable w.r.t. x, y and weight. C at most detail::kAddRmsNormMaxChannels (3072).
std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(const torch::Tensor& x, const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps);
// Whether AddRmsNorm takes these inputs (devices, dtypes, shapes, channel count).
bool AddRmsNormTakes(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& weight);
// The norm of a residual x with nothing added to it (before the first block): (x, h =
// rms_norm(x, weight, eps) in h_type), differentiable w.r.t. x and weight; x's two gradients
// (through the first output and through h) are summed in the backward's kernel. Takes what
// AddRmsNorm takes for x and weight (AddRmsNormTakes(x, x, weight)).
std::pair<torch::Tensor, torch::Tensor> RmsNormOfResidual(const torch::Tensor& x, const torch::Tensor& weight,
                                                          double eps, torch::ScalarType h_type);

// joint [.., 2F] = [gate | up] -> silu(gate) * up [.., F], differentiable w.r.t. joint
// (whose gradient comes back as one contiguous tensor).
torch::Tensor SwiGlu(const torch::Tensor& joint);

// silu(x) for bf16 / fp16 / fp32 CUDA x (FusedOpsTake) whose rows [.., F] may be a column
// slice of a wider tensor (one row stride): read where they lie (other layouts are copied
// first), returned contiguous, differentiable w.r.t. x; its gradient goes into dx when given
// (x's part of a SharedGradient).
torch::Tensor SiluRows(const torch::Tensor& x, const GradientPart& dx = {});

// The gate MLP's head, sigmoid(silu(u + c) W^T + b) for u [.., K] (the hidden layer's
// pre-activation without its bias, a column slice of the attention's joint projection),
// hidden_bias c [K] or undefined, weight [N, K], bias [N] (float32 parameters under autocast):
// the gates [.., N] in u's dtype, differentiable w.r.t. u, c, weight and bias, from one kernel
// each way (kernels/gate_head.cu). w16: the weight's 16-bit copy for the product
// (model/weight_copies.h), or undefined (cast here). u's gradient goes into du when given (u's
// part of a SharedGradient); c's (the column sums of u's), the weight's and the bias's come out
// float32 from the kernels and are cast to the parameters' dtypes. Differs from the composed
// ops only in rounding: silu(u + c) is rounded to u's dtype as before, u + c and the product
// are not rounded.
bool GateHeadTakes(const torch::Tensor& u, const torch::Tensor& hidden_bias, const torch::Tensor& weight,
                   const torch::Tensor& bias);
torch::Tensor GateHead(const torch::Tensor& u, const torch::Tensor& hidden_bias, const torch::Tensor& weight,
                       const torch::Tensor& bias, const torch::Tensor& w16 = {}, const GradientPart& du = {});

// Mean cross-entropy of logits [N, V] (bf16, fp16 or fp32; the maths in float32) against
// int64 targets [N], over the targets that are not ignore_index: LibTorch's
// cross_entropy(logits.to(float32), targets) in value, differentiable w.r.t. the logits,
// whose gradient comes back in their dtype. A target outside [0, V) makes the loss NaN.
//
// expected_grad: the gradient the caller will back-propagate into the loss (the trainer's is
// 1 / grad_accum). When the logits need a gradient and a row fits the one-pass kernel (m7c's
// 50304 bf16 logits do), the forward writes the logits' gradient for it while it reads them
// once; the backward then returns it, rescaled on the device only if another gradient comes.
// That path's backward runs once: a second (retain_graph) fails.
torch::Tensor CrossEntropy(const torch::Tensor& logits, const torch::Tensor& targets,
                           int64_t ignore_index = -100, double expected_grad = 1.0);

// The layer's gate statistics as the trainer reports them: gates [B,T,H,3], block_idx
// [B,T,G,n] (-1 = no block) -> float32 [7] = mean of each branch's gate, their population
// standard deviations, mean selected blocks per (position, group). Not differentiable.
torch::Tensor GateStats(const torch::Tensor& gates, const torch::Tensor& block_idx);
// GateStats of several layers at once (one gates and one block_idx per layer, one dtype each
// across the layers: GateStatsOfLayersTake) -> float32 [L, 7], in one launch.
bool GateStatsOfLayersTake(const std::vector<torch::Tensor>& gates, const std::vector<torch::Tensor>& block_idx);
torch::Tensor GateStatsOfLayers(const std::vector<torch::Tensor>& gates, const std::vector<torch::Tensor>& block_idx);

}  // namespace nsad::nsa::cuda
