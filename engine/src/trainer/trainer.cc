// The training loop behind nsad::Trainer: model, AdamW, schedule, autocast, clipping,
// non-finite guard, throughput and gate statistics.
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>

#include "data/data_error.h"
#include "model/transformer.h"
#include "nsad/engine.h"
#include "trainer/batches.h"
#include "trainer/runtime.h"

namespace nsad {
namespace {

// Enables autocast for one region on the current thread (autocast state is thread-local,
// and every run has its own thread) and drops the cast-weight cache on exit.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType device, bool enabled) : device_(device), enabled_(enabled) {
    if (!enabled_) return;
    previous_ = at::autocast::is_autocast_enabled(device_);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, at::kBFloat16);
  }
  ~AutocastScope() {
    if (!enabled_) return;
    at::autocast::set_autocast_enabled(device_, previous_);
    at::autocast::clear_cache();
  }

 private:
  c10::DeviceType device_;
  bool enabled_;
  bool previous_ = false;
};

// Linear warmup to lr, then cosine decay to min_lr at max_steps (step counts from 0).
double ScheduledLr(const OptimConfig& o, int64_t step, int64_t max_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) {
    return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  }
  const double span = std::max<int64_t>(1, max_steps - o.warmup_steps);
  const double progress = std::min(1.0, (step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

class TorchTrainer final : public Trainer {
 public:
  explicit TorchTrainer(const TrainConfig& config)
      : config_(config), runtime_(ResolveRuntime(config)), device_(runtime_.device) {
    torch::manual_seed(config_.seed);
    model_ = NsaTransformer(config_.model, runtime_.backend);
    model_->to(device_);
    parameter_count_ = 0;
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& p : model_->parameters()) {
      parameter_count_ += p.numel();
      // Weight decay only on matrices: norms' gains and biases are not decayed.
      (p.dim() >= 2 ? decay : no_decay).push_back(p);
    }
    const auto& o = config_.optim;
    auto options = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(options).weight_decay(o.weight_decay)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(options).weight_decay(0.0)));
    optimizer_ = std::make_unique<torch::optim::AdamW>(std::move(groups), options);
    batches_ = std::make_unique<BatchSource>(config_, device_);
  }

  StepMetrics Step() override {
    const auto start = std::chrono::steady_clock::now();
    model_->train();
    const double lr = ScheduledLr(config_.optim, step_, config_.max_steps);
    for (auto& group : optimizer_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    optimizer_->zero_grad(/*set_to_none=*/true);

    double loss_sum = 0.0;
    for (int micro = 0; micro < config_.grad_accum; ++micro) {
      torch::Tensor batch = batches_->NextTrain(step_ + 1);  // [B, T+1] int64
      torch::Tensor loss = ForwardLoss(batch) / config_.grad_accum;
      loss.backward();
      loss_sum += loss.detach().item<double>();
    }
    const int64_t failing_step = step_ + 1;
    if (!std::isfinite(loss_sum)) {
      throw TrainingHalt(failing_step, "non-finite loss (" + std::to_string(loss_sum) +
                                           ") at step " + std::to_string(failing_step) +
                                           "; the weights were not updated");
    }
    const double max_norm = config_.optim.grad_clip > 0 ? config_.optim.grad_clip
                                                        : std::numeric_limits<double>::infinity();
    const double grad_norm = torch::nn::utils::clip_grad_norm_(model_->parameters(), max_norm);
    if (!std::isfinite(grad_norm)) {
      throw TrainingHalt(failing_step, "non-finite gradient norm at step " +
                                           std::to_string(failing_step) +
                                           "; the weights were not updated");
    }
    optimizer_->step();
    ++step_;
    if (device_.is_cuda()) torch::cuda::synchronize(device_.index());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    StepMetrics m;
    m.step = step_;
    m.loss = loss_sum;
    m.lr = lr;
    m.grad_norm = grad_norm;
    m.step_seconds = seconds;
    const int64_t tokens =
        static_cast<int64_t>(config_.batch_size) * config_.seq_len * config_.grad_accum;
    tokens_seen_ += tokens;
    m.tokens_seen = tokens_seen_;
    m.tokens_per_second = seconds > 0 ? tokens / seconds : 0.0;
    gates_.step = step_;
    gates_.layers = model_->last_gate_stats();
    return m;
  }

  double Evaluate() override {
    torch::NoGradGuard no_grad;
    model_->eval();
    const auto& batches = batches_->ValBatches();
    if (batches.empty()) return std::numeric_limits<double>::quiet_NaN();  // no validation split
    double total = 0.0;
    for (const auto& batch : batches) total += ForwardLoss(batch).item<double>();
    model_->train();
    return total / static_cast<double>(batches.size());
  }

  int64_t step() const override { return step_; }
  bool finished() const override { return step_ >= config_.max_steps; }
  GateReport gates() const override { return gates_; }
  const TrainConfig& config() const override { return config_; }
  std::string device() const override { return device_.str(); }
  AttentionBackend attention_backend() const override { return runtime_.backend; }
  int64_t parameter_count() const override { return parameter_count_; }

 private:
  torch::Tensor ForwardLoss(const torch::Tensor& batch) {
    using torch::indexing::Slice;
    const auto inputs = batch.index({Slice(), Slice(0, -1)});
    const auto targets = batch.index({Slice(), Slice(1, torch::indexing::None)});
    torch::Tensor logits;
    {
      AutocastScope autocast(device_.type(), config_.dtype == "bfloat16");
      logits = model_->forward(inputs);
    }
    return torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}));
  }

  TrainConfig config_;
  Runtime runtime_;
  torch::Device device_;
  NsaTransformer model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<BatchSource> batches_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  int64_t parameter_count_ = 0;
  GateReport gates_;
};

}  // namespace

std::unique_ptr<Trainer> Trainer::Create(const TrainConfig& config) {
  auto errors = ValidateConfig(config);
  if (errors.empty()) errors = CheckRuntime(config);
  if (!errors.empty()) throw ConfigError(std::move(errors));
  try {
    return std::make_unique<TorchTrainer>(config);
  } catch (const data::DataError& e) {
    throw ConfigError({{e.field(), e.message()}});
  }
}

ConfigError::ConfigError(std::vector<FieldError> errors)
    : std::runtime_error(FormatFieldErrors(errors)), errors_(std::move(errors)) {}

TrainingHalt::TrainingHalt(int64_t step, const std::string& reason)
    : std::runtime_error(reason), step_(step) {}

}  // namespace nsad
