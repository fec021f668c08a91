// The training loop behind nsad::Trainer: model, AdamW, schedule, autocast, clipping,
// non-finite guard (skip or halt, with localisation), checkpoints and exact resume,
// throughput and gate statistics.
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>

#include "data/data_error.h"
#include "model/transformer.h"
#include "nsad/engine.h"
#include "trainer/batches.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_store.h"
#include "trainer/nonfinite.h"
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

// Sets the model's diagnostics tap for one scope (a step that injects a fault, or the
// re-run that localises a non-finite value) and always unsets it again.
class TapScope {
 public:
  TapScope(NsaTransformer& model, NsaTransformerImpl::Tap tap) : model_(model) {
    model_->set_tap(std::move(tap));
  }
  ~TapScope() { model_->set_tap(nullptr); }

 private:
  NsaTransformer& model_;
};

std::string FormatNumber(double value) {
  if (std::isnan(value)) return "nan";  // not "-nan": a NaN's sign bit means nothing
  std::ostringstream out;
  out << value;
  return out.str();
}

class TorchTrainer final : public Trainer {
 public:
  explicit TorchTrainer(const TrainConfig& config)
      : config_(config),
        runtime_(ResolveRuntime(config)),
        device_(runtime_.device),
        injector_(config.fault_injection) {
    torch::manual_seed(config_.seed);
    model_ = NsaTransformer(config_.model, runtime_.backend);
    model_->set_activation_checkpointing(config_.activation_checkpointing);
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
    if (!config_.checkpoint_dir.empty()) {
      checkpoint::RemoveIncompleteCheckpoints(config_.checkpoint_dir);
    }
    if (!config_.resume_from.empty()) Resume();
  }

  StepMetrics Step() override {
    const auto start = std::chrono::steady_clock::now();
    model_->train();
    const int64_t this_step = step_ + 1;
    const double lr = ScheduledLr(config_.optim, step_, config_.max_steps);
    for (auto& group : optimizer_->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
    }
    optimizer_->zero_grad(/*set_to_none=*/true);

    const bool inject = injector_.ActiveAt(this_step);
    std::vector<torch::Tensor> batches;
    double loss_sum = 0.0;
    {
      std::optional<TapScope> tap;
      if (inject) {
        tap.emplace(model_, [this](int layer, const char* sublayer, torch::Tensor output) {
          return injector_.Apply(layer, sublayer, std::move(output));
        });
      }
      for (int micro = 0; micro < config_.grad_accum; ++micro) {
        batches.push_back(batches_->NextTrain(this_step));  // [B, T+1] int64
        torch::Tensor loss = Loss(Logits(batches.back()), batches.back(), inject) / config_.grad_accum;
        loss.backward();
        loss_sum += loss.detach().item<double>();
      }
    }
    const double max_norm = config_.optim.grad_clip > 0 ? config_.optim.grad_clip
                                                        : std::numeric_limits<double>::infinity();
    // Clipping scales the gradients by a non-finite factor when the norm is not finite;
    // harmless, as such a step never reaches optimizer_->step().
    const double grad_norm = torch::nn::utils::clip_grad_norm_(model_->parameters(), max_norm);
    if (!std::isfinite(loss_sum) || !std::isfinite(grad_norm)) {
      return NonFiniteStep(this_step, loss_sum, grad_norm, lr, batches, inject);
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
    const int64_t tokens = TokensPerStep();
    tokens_seen_ += tokens;
    m.tokens_seen = tokens_seen_;
    m.tokens_per_second = seconds > 0 ? tokens / seconds : 0.0;
    m.skipped_steps = skipped_steps_;
    gates_.step = step_;
    gates_.layers = model_->last_gate_stats();
    if (CheckpointDue(step_)) {
      m.checkpoint = SaveCheckpoint(config_, *model_, *optimizer_, CurrentState(), device_);
      last_checkpoint_ = m.checkpoint;
    }
    return m;
  }

  double Evaluate() override {
    torch::NoGradGuard no_grad;
    model_->eval();
    const auto& batches = batches_->ValBatches();
    if (batches.empty()) return std::numeric_limits<double>::quiet_NaN();  // no validation split
    double total = 0.0;
    for (const auto& batch : batches) total += Loss(Logits(batch), batch, false).item<double>();
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
  torch::Tensor Logits(const torch::Tensor& batch) {
    using torch::indexing::Slice;
    AutocastScope autocast(device_.type(), config_.dtype == "bfloat16");
    return model_->forward(batch.index({Slice(), Slice(0, -1)}));
  }

  torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& batch, bool inject) {
    using torch::indexing::Slice;
    const auto targets = batch.index({Slice(), Slice(1, torch::indexing::None)});
    auto loss = torch::nn::functional::cross_entropy(
        logits.reshape({-1, logits.size(-1)}).to(torch::kFloat32), targets.reshape({-1}));
    return inject ? injector_.ApplyToLoss(loss) : loss;
  }

  int64_t TokensPerStep() const {
    return static_cast<int64_t>(config_.batch_size) * config_.seq_len * config_.grad_accum;
  }

  // The step's update is dropped; then it is skipped (policy "skip", budget left) or the
  // run halts. Either way the report says what was non-finite and where it appeared first.
  StepMetrics NonFiniteStep(int64_t this_step, double loss, double grad_norm, double lr,
                            const std::vector<torch::Tensor>& batches, bool inject) {
    optimizer_->zero_grad(/*set_to_none=*/true);
    const std::string what = !std::isfinite(loss)
                                 ? "non-finite loss (" + FormatNumber(loss) + ")"
                                 : "non-finite gradient norm (" + FormatNumber(grad_norm) + ")";
    const std::string report = "step " + std::to_string(this_step) + ": " + what +
                               "; first non-finite tensor: " + Localise(batches, inject);
    const bool skip = config_.nonfinite_policy == "skip";
    if (skip && skipped_steps_ < config_.nonfinite_max_skips) {
      ++skipped_steps_;
      ++step_;
      StepMetrics m;
      m.step = step_;
      m.loss = loss;
      m.lr = lr;
      m.grad_norm = grad_norm;
      m.tokens_seen = tokens_seen_;  // the skipped step's tokens were not trained on
      m.skipped_steps = skipped_steps_;
      m.skipped_reason = report + "; update skipped (" + std::to_string(skipped_steps_) + " of " +
                         std::to_string(config_.nonfinite_max_skips) + " allowed)";
      return m;
    }
    std::string message = report + "; the update was not applied";
    if (skip) {
      message += " (nonfinite_policy skip: all " + std::to_string(config_.nonfinite_max_skips) +
                 " allowed skips used)";
    }
    message += last_checkpoint_.empty() ? "; no checkpoint yet"
                                        : "; last good checkpoint: " + last_checkpoint_;
    throw TrainingHalt(this_step, message);
  }

  // Re-runs the failed step's micro-batches (same weights, same batches, same injected
  // fault) with every block output, the logits, the loss and all gradients checked.
  std::string Localise(const std::vector<torch::Tensor>& batches, bool inject) {
    const std::string bad_parameter = FirstNonFiniteParameter(*model_);
    if (!bad_parameter.empty()) return bad_parameter;
    std::string first;
    {
      NonFiniteProbe probe(*model_);
      TapScope tap(model_, [&](int layer, const char* sublayer, torch::Tensor output) {
        if (inject) output = injector_.Apply(layer, sublayer, std::move(output));
        return probe.Observe(layer, sublayer, std::move(output));
      });
      for (size_t micro = 0; micro < batches.size() && first.empty(); ++micro) {
        optimizer_->zero_grad(/*set_to_none=*/true);
        const auto logits = Logits(batches[micro]);
        probe.ObserveForward("logits", logits);
        const auto loss = Loss(logits, batches[micro], inject);
        probe.ObserveForward("loss", loss);
        loss.backward();
        first = probe.first();
        if (!first.empty() && batches.size() > 1) {
          first += " (micro-batch " + std::to_string(micro + 1) + " of " +
                   std::to_string(batches.size()) + ")";
        }
      }
    }
    optimizer_->zero_grad(/*set_to_none=*/true);
    return first.empty() ? "none when the step was re-run with checks (not reproducible)" : first;
  }

  bool CheckpointDue(int64_t step) const {
    if (config_.checkpoint_dir.empty()) return false;
    const int64_t every = config_.checkpoint_every, milestone = config_.checkpoint_milestone_every;
    return (every > 0 && (step % every == 0 || step == config_.max_steps)) ||
           (milestone > 0 && step % milestone == 0);
  }

  ResumeState CurrentState() const {
    ResumeState state;
    state.step = step_;
    state.tokens_seen = tokens_seen_;
    state.skipped_steps = skipped_steps_;
    state.data_position = batches_->train_loader().SavePosition();
    return state;
  }

  void Resume() {
    const std::string dir = ResolveResumeDir(config_);
    const ResumeState state = LoadCheckpoint(dir, config_, *model_, *optimizer_, device_);
    try {
      batches_->train_loader().RestorePosition(state.data_position);
    } catch (const std::exception& e) {  // data::DataError or std::invalid_argument
      throw ConfigError({{"resume_from", "the data position saved in " + dir +
                                             "/state does not fit this run's data: " + e.what()}});
    }
    step_ = state.step;
    tokens_seen_ = state.tokens_seen;
    skipped_steps_ = state.skipped_steps;
    last_checkpoint_ = dir;
  }

  TrainConfig config_;
  Runtime runtime_;
  torch::Device device_;
  FaultInjector injector_;
  NsaTransformer model_{nullptr};
  std::unique_ptr<torch::optim::AdamW> optimizer_;
  std::unique_ptr<BatchSource> batches_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  int64_t skipped_steps_ = 0;
  int64_t parameter_count_ = 0;
  std::string last_checkpoint_;
  GateReport gates_;
};

}  // namespace

std::unique_ptr<Trainer> Trainer::Create(const TrainConfig& config) {
  auto errors = ValidateConfig(config);
  if (!errors.empty()) throw ConfigError(std::move(errors));
  try {
    return std::make_unique<TorchTrainer>(config);
  } catch (const data::DataError& e) {
    throw ConfigError({{e.field(), e.message()}});
  }
}

}  // namespace nsad
