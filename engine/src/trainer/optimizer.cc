#include "trainer/optimizer.h"

#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_mul.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>

#include <cmath>
#include <string>

#include "model/weight_copies.h"

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "adamw.h"
#endif

namespace nsad {
namespace {

constexpr char kFormatKey[] = "nsad_adamw_format";
constexpr int64_t kFormat = 1;

}  // namespace

std::vector<torch::Tensor> AdamW::GradsInModelOrder() const {
  std::vector<torch::Tensor> grads;
  grads.reserve(params_.size());
  for (const size_t i : model_order_) {
    if (params_[i].grad().defined()) grads.push_back(params_[i].grad());
  }
  return grads;
}

AdamW::AdamW(std::vector<torch::Tensor> decay, std::vector<torch::Tensor> no_decay,
             const OptimConfig& config)
    // The config's floats widened to double, as torch::optim::AdamWOptions held them.
    : lr_(config.lr), beta1_(config.beta1), beta2_(config.beta2), eps_(config.eps) {
  groups_[0] = {0, decay.size(), static_cast<double>(config.weight_decay)};
  groups_[1] = {decay.size(), decay.size() + no_decay.size(), 0.0};
  params_ = std::move(decay);
  params_.insert(params_.end(), no_decay.begin(), no_decay.end());
  fused_ = !params_.empty() && params_.front().is_cuda();
  torch::NoGradGuard no_grad;
  for (const auto& p : params_) {
    TORCH_CHECK(p.device() == params_.front().device(), "AdamW: parameters on several devices");
    exp_avg_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    exp_avg_sq_.push_back(torch::zeros_like(p, torch::MemoryFormat::Preserve));
    if (fused_) steps_.push_back(torch::zeros({}, p.options().dtype(torch::kFloat32)));
  }
  cpu_steps_.assign(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) model_order_.push_back(i);
  if (fused_) lr_tensor_ = torch::full({}, lr_, params_.front().options().dtype(torch::kFloat32));
#ifdef NSAD_HAVE_CUDA_KERNELS
  // The gradients are not there yet; their shapes and dtype follow the parameters'.
  own_kernel_ = fused_ && nsa::cuda::detail::FusedAdamWTakes(params_, params_, exp_avg_, exp_avg_sq_, steps_);
#endif
}

AdamW AdamW::ForModel(const std::vector<torch::Tensor>& parameters, const OptimConfig& config) {
  std::vector<torch::Tensor> decay, no_decay;
  std::vector<bool> decays;
  for (const auto& p : parameters) {
    decays.push_back(p.dim() >= 2);
    (decays.back() ? decay : no_decay).push_back(p);
  }
  AdamW optimizer(std::move(decay), std::move(no_decay), config);
  // params_ holds the decay group first; the clip must still visit the model's order.
  size_t next_decay = optimizer.groups_[0].begin, next_plain = optimizer.groups_[1].begin;
  optimizer.model_order_.clear();
  for (const bool d : decays) optimizer.model_order_.push_back(d ? next_decay++ : next_plain++);
  return optimizer;
}

void AdamW::SetLr(double lr) {
  lr_ = lr;
  if (fused_) lr_tensor_.fill_(lr);
}

torch::Tensor AdamW::ClipGradNorm(double max_norm) {
  torch::NoGradGuard no_grad;
  const auto grads = GradsInModelOrder();
  if (grads.empty()) {
    return torch::zeros({}, torch::TensorOptions(torch::kFloat32).device(
                                params_.empty() ? torch::Device(torch::kCPU) : params_.front().device()));
  }
  torch::Tensor total;
  if (fused_) {
    total = at::stack(at::_foreach_norm(grads, 2)).norm(2);
  } else {
    // LibTorch's clip_grad_norm_, op for op.
    std::vector<torch::Tensor> norms;
    norms.reserve(grads.size());
    for (const auto& g : grads) norms.push_back(g.norm(2));
    total = norms.size() == 1 ? norms[0] : torch::stack(norms).norm(2);
  }
  pending_clip_ = torch::Tensor();
  if (max_norm > 0) {
    const auto coef = torch::clamp(max_norm / (total + 1e-6), std::nullopt, 1.0);
    if (own_kernel_) {
      pending_clip_ = coef;  // Step()'s kernel scales the gradients as it reads them
    } else if (fused_) {
      at::_foreach_mul_(grads, coef);
    } else {
      for (const auto& g : grads) g.mul_(coef);
    }
  }
  return total;
}

torch::Tensor AdamW::NonFiniteFlag(const torch::Tensor& loss, const torch::Tensor& grad_norm) {
  torch::NoGradGuard no_grad;
  const auto values = torch::stack({loss.detach().to(torch::kFloat32).reshape({}),
                                    grad_norm.to(loss.device(), torch::kFloat32).reshape({})});
  return torch::logical_not(torch::isfinite(values)).any().to(torch::kFloat32);
}

void AdamW::Step(const torch::Tensor& found_inf, WeightCopies* copies) {
  torch::NoGradGuard no_grad;
  if (fused_) return StepFused(found_inf, copies);
  if (found_inf.defined() && found_inf.item<float>() != 0.0f) return;
  for (const Group& group : groups_) {
    for (size_t i = group.begin; i < group.end; ++i) StepPerTensor(group, i);
  }
}

void AdamW::StepFused(const torch::Tensor& found_inf, WeightCopies* copies) {
  for (const Group& group : groups_) {
    std::vector<torch::Tensor> params, grads, exp_avg, exp_avg_sq, steps, weight_copies;
    for (size_t i = group.begin; i < group.end; ++i) {
      if (!params_[i].grad().defined()) continue;
      params.push_back(params_[i]);
      grads.push_back(params_[i].grad());
      exp_avg.push_back(exp_avg_[i]);
      exp_avg_sq.push_back(exp_avg_sq_[i]);
      steps.push_back(steps_[i]);
      weight_copies.push_back(copies ? copies->CopyOf(params_[i]) : torch::Tensor());
    }
    if (params.empty()) continue;
    // The kernel reads the step count (bias correction) but does not advance it; a skipped
    // step must not advance it either.
    if (found_inf.defined()) {
      at::_foreach_add_(steps, 1.0 - found_inf);
    } else {
      at::_foreach_add_(steps, 1.0);
    }
#ifdef NSAD_HAVE_CUDA_KERNELS
    if (own_kernel_ && nsa::cuda::detail::FusedAdamWTakes(params, grads, exp_avg, exp_avg_sq, steps)) {
      nsa::cuda::detail::FusedAdamW(params, grads, exp_avg, exp_avg_sq, steps, lr_tensor_, beta1_, beta2_,
                                    group.weight_decay, eps_, pending_clip_, found_inf, weight_copies);
      if (copies) copies->NoteWrittenWith(params);  // those without a copy are ignored
      continue;
    }
#endif
    if (pending_clip_.defined()) at::_foreach_mul_(grads, pending_clip_);  // gradients the kernel does not take
    at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, /*max_exp_avg_sqs=*/{}, steps, lr_tensor_,
                      beta1_, beta2_, group.weight_decay, eps_, /*amsgrad=*/false,
                      /*maximize=*/false, /*grad_scale=*/std::nullopt,
                      found_inf.defined() ? std::optional<at::Tensor>(found_inf) : std::nullopt);
  }
  pending_clip_ = torch::Tensor();
}

// torch::optim::AdamW::step for one parameter, op for op (amsgrad off).
void AdamW::StepPerTensor(const Group& group, size_t i) {
  auto& p = params_[i];
  if (!p.grad().defined()) return;
  const auto& grad = p.grad();
  if (group.weight_decay != 0) p.mul_(1 - lr_ * group.weight_decay);
  const int64_t step = ++cpu_steps_[i];
  const double bias_correction1 = 1 - std::pow(beta1_, step);
  const double bias_correction2 = 1 - std::pow(beta2_, step);
  exp_avg_[i].mul_(beta1_).add_(grad, 1 - beta1_);
  exp_avg_sq_[i].mul_(beta2_).addcmul_(grad, grad, 1 - beta2_);
  const auto denom = (exp_avg_sq_[i].sqrt() / std::sqrt(bias_correction2)).add_(eps_);
  p.addcdiv_(exp_avg_[i], denom, -lr_ / bias_correction1);
}

void AdamW::ZeroGrad() {
  pending_clip_ = torch::Tensor();
  for (auto& p : params_) p.mutable_grad().reset();
}

void AdamW::Save(torch::serialize::OutputArchive& archive) const {
  archive.write(kFormatKey, c10::IValue(kFormat));
  // Device step counts come to the host in one transfer.
  const auto device_steps = fused_ ? torch::stack(steps_).to(torch::kCPU) : torch::Tensor();
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::string n = std::to_string(i);
    archive.write("exp_avg." + n, exp_avg_[i]);
    archive.write("exp_avg_sq." + n, exp_avg_sq_[i]);
    const int64_t step =
        fused_ ? static_cast<int64_t>(device_steps[i].item<float>()) : cpu_steps_[i];
    archive.write("step." + n, torch::tensor(step));
  }
}

void AdamW::Load(torch::serialize::InputArchive& archive) {
  torch::NoGradGuard no_grad;
  auto set_step = [&](size_t i, int64_t step) {
    cpu_steps_[i] = step;
    if (fused_) steps_[i].fill_(static_cast<double>(step));
  };
  c10::IValue format;
  if (archive.try_read(kFormatKey, format)) {
    TORCH_CHECK(format.isInt() && format.toInt() == kFormat, "unknown optimizer state format ",
                format);
    for (size_t i = 0; i < params_.size(); ++i) {
      const std::string n = std::to_string(i);
      torch::Tensor exp_avg, exp_avg_sq, step;
      archive.read("exp_avg." + n, exp_avg);
      archive.read("exp_avg_sq." + n, exp_avg_sq);
      archive.read("step." + n, step);
      TORCH_CHECK(exp_avg.sizes() == params_[i].sizes() && exp_avg_sq.sizes() == params_[i].sizes(),
                  "optimizer state ", i, " does not fit its parameter");
      exp_avg_[i].copy_(exp_avg);
      exp_avg_sq_[i].copy_(exp_avg_sq);
      set_step(i, step.item<int64_t>());
    }
    return;
  }
  // A torch::optim::AdamW archive: let LibTorch read it into an optimizer over the same
  // tensors and groups, then take its state. A parameter it never stepped has no state.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const Group& g : groups_) {
    groups.emplace_back(std::vector<torch::Tensor>(params_.begin() + g.begin, params_.begin() + g.end),
                        std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(lr_).weight_decay(g.weight_decay)));
  }
  torch::optim::AdamW legacy(std::move(groups), torch::optim::AdamWOptions(lr_));
  legacy.load(archive);
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto it = legacy.state().find(params_[i].unsafeGetTensorImpl());
    if (it == legacy.state().end()) {
      exp_avg_[i].zero_();
      exp_avg_sq_[i].zero_();
      set_step(i, 0);
      continue;
    }
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    exp_avg_[i].copy_(s.exp_avg());
    exp_avg_sq_[i].copy_(s.exp_avg_sq());
    set_step(i, s.step());
  }
}

}  // namespace nsad
