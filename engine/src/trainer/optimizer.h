// The training step's optimizer: AdamW with decoupled weight decay on two groups (decay on
// matrices, none on norms' gains and biases) and gradient-norm clipping, used by the trainer
// and by bench/train/train_bench so that the bench measures the trainer's path.
//
// On CUDA everything stays on the device and launches a handful of multi-tensor kernels
// instead of ~13 per parameter tensor (the m7c NSA model has 266): the total norm through
// _foreach_norm, and the update through our AdamW kernel (kernels/adamw.h), which reads the
// learning rate and the clip factor from device tensors and scales each gradient as it reads
// it (ATen's fused AdamW where that kernel is not built: the clip then goes through
// _foreach_mul_). Nothing reads
// the device from the host, so a whole training step can be captured in a CUDA graph. A
// step is skipped on the device through `found_inf` (a float 0/1 scalar on the device): the
// fused kernel then leaves weights and moments untouched and the step counts stay. Our kernel
// can also write the model's 16-bit weight copies as it writes the weights (Step's `copies`).
//
// On the CPU the same AdamW and clipping maths run per tensor, exactly as LibTorch's
// torch::optim::AdamW and clip_grad_norm_ compute them (bit-for-bit: the CPU tests compare
// trajectories), and the skip decision is read on the host (free on the CPU).
#pragma once

#include <torch/torch.h>

#include <vector>

#include "nsad/config.h"

namespace nsad {

class WeightCopies;  // model/weight_copies.h

class AdamW {
 public:
  // `decay` get optim.weight_decay, `no_decay` none. Moments and step counts are allocated
  // now (zeros), so their addresses never change (CUDA graph replay relies on that).
  AdamW(std::vector<torch::Tensor> decay, std::vector<torch::Tensor> no_decay,
        const OptimConfig& config);

  // Weight decay only on matrices (dim >= 2), as the trainer groups them.
  static AdamW ForModel(const std::vector<torch::Tensor>& parameters, const OptimConfig& config);

  // The learning rate of the next Step(). On CUDA it lives in a device tensor, written by a
  // kernel on the current stream (no host sync), so a replayed graph reads the new value.
  void SetLr(double lr);

  // Clips the gradients for the next Step() by min(1, max_norm / (norm + 1e-6)) (max_norm
  // <= 0: no clipping) and returns the total L2 norm as a float32 0-dim tensor on the
  // parameters' device. No host sync. On the CPU the gradients are scaled here; on CUDA the
  // factor stays on the device and Step()'s kernel scales each gradient as it reads it (the
  // gradients themselves keep their values). A non-finite norm makes the update non-finite;
  // such a step must be skipped (found_inf).
  torch::Tensor ClipGradNorm(double max_norm);

  // float32 0-dim tensor on the device: 1 if `loss` or `grad_norm` is not finite, else 0.
  static torch::Tensor NonFiniteFlag(const torch::Tensor& loss, const torch::Tensor& grad_norm);

  // One AdamW update of every parameter with a gradient; none at all if `found_inf` (see
  // NonFiniteFlag; undefined = never skip) is 1: weights, moments and step counts keep
  // their values. With `copies` (the model's 16-bit weight copies), our CUDA kernel also
  // writes the new value of each weight that has a copy into it and records that with the
  // copies (WeightCopies::NoteWrittenWith), so that the next forward does not copy them
  // again; elsewhere the copies are left alone and that forward refreshes them.
  void Step(const torch::Tensor& found_inf = {}, WeightCopies* copies = nullptr);

  void ZeroGrad();  // sets gradients to none (and drops a clip factor not yet applied)

  void Save(torch::serialize::OutputArchive& archive) const;
  // Reads what Save wrote, or the archive of a torch::optim::AdamW over the same two groups
  // (the optimizer of checkpoints before this class). Copies into the existing state.
  void Load(torch::serialize::InputArchive& archive);

  const std::vector<torch::Tensor>& parameters() const { return params_; }

 private:
  struct Group {
    size_t begin = 0, end = 0;  // range in params_
    double weight_decay = 0;
  };

  // Gradients in the order of the parameters given to ForModel: the total norm adds the
  // per-tensor norms in that order, as clip_grad_norm_(model->parameters()) does (float
  // addition is not associative; another order moves the clip factor's last bits).
  std::vector<torch::Tensor> GradsInModelOrder() const;
  void StepFused(const torch::Tensor& found_inf, WeightCopies* copies);
  void StepPerTensor(const Group& group, size_t i);

  std::vector<torch::Tensor> params_, exp_avg_, exp_avg_sq_;
  // CUDA: float32 0-dim device tensors (what the fused kernel reads). CPU: unused; counts in
  // cpu_steps_ (LibTorch's AdamW counts steps as integers; the bias correction uses them).
  std::vector<torch::Tensor> steps_;
  std::vector<int64_t> cpu_steps_;
  Group groups_[2];
  std::vector<size_t> model_order_;  // params_ indices in the model's parameter order
  double lr_ = 0, beta1_ = 0, beta2_ = 0, eps_ = 0;
  torch::Tensor lr_tensor_;  // CUDA only
  // CUDA with our AdamW kernel: the factor of the last ClipGradNorm, for the next Step()
  // (undefined: none).
  torch::Tensor pending_clip_;
  bool own_kernel_ = false;  // CUDA: the update runs kernels/adamw.h's kernel
  bool fused_ = false;
};

}  // namespace nsad
