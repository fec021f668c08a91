// AdamW's update of a model's float32 parameters on the GPU in a few launches
// (kernels/adamw.cu), for the optimizer's CUDA path (engine/src/trainer/optimizer.cc). Plain
// ATen types. Runs on the parameters' device whichever device is current.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace nsad::nsa::cuda::detail {

// Whether FusedAdamW takes these tensors: float32, contiguous, CUDA, one device, the four
// lists of equal length with equal shapes per index, each step a float32 scalar.
bool FusedAdamWTakes(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                     const std::vector<at::Tensor>& steps);

// One AdamW step with decoupled weight decay, the maths of ATen's _fused_adamw_: for each
// tensor i, with g = grads[i] * grad_scale,
//   p -= lr wd p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
//   p -= lr / (1 - b1^s) * m / (sqrt(v) / sqrt(1 - b2^s) + eps)
// where s = steps[i] (already advanced for this step) and lr, grad_scale and found_inf are
// float32 device scalars read by the kernel (no host sync: CUDA graphs capture it).
// grad_scale undefined means 1; the gradients are read, never written (ATen's grad_scale
// divides them and writes them back, a pass over them that this one saves). A nonzero
// found_inf (undefined: never) leaves every tensor as it was.
//
// copies: empty, or one per parameter, each undefined or a contiguous 16-bit tensor (bf16 or
// fp16, one dtype for all) of the parameter's size on its device: the kernel writes the
// updated parameter rounded to nearest into it, as p.to(dtype) would (the model's weight
// copies, model/weight_copies.h: 2 more bytes per element here instead of a 6-byte pass).
// found_inf leaves them as they were too. The parameters' and the copies' versions are
// bumped, as an in-place op's would be (whether or not found_inf skips the update: the host
// cannot know), so that a copy saved by an earlier autograd graph fails its version check.
void FusedAdamW(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                const std::vector<at::Tensor>& exp_avg, const std::vector<at::Tensor>& exp_avg_sq,
                const std::vector<at::Tensor>& steps, const at::Tensor& lr, double beta1, double beta2,
                double weight_decay, double eps, const at::Tensor& grad_scale, const at::Tensor& found_inf,
                const std::vector<at::Tensor>& copies = {});

}  // namespace nsad::nsa::cuda::detail
