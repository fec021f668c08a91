// The training loop behind nsad::Trainer: model, AdamW, schedule, autocast, clipping,
// non-finite guard (skip or halt, with localisation), checkpoints and exact resume,
// throughput and gate statistics; optionally the step replayed from a CUDA graph, or data
// parallel over several GPUs (one worker each). A step reads the device once, after its
// update: loss, gradient norm and gate statistics.
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAFunctions.h>
#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <sstream>

#include "data/data_error.h"
#include "model/transformer.h"
#include "nsa/dispatch.h"
#include "nsad/engine.h"
#include "trainer/batches.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_store.h"
#include "trainer/data_parallel.h"
#include "trainer/nonfinite.h"
#include "trainer/optimizer.h"
#include "trainer/resume_target.h"
#include "trainer/runtime.h"
#include "trainer/schedule.h"
#include "trainer/step_graph.h"

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

// The worker's device: the GPU the daemon placed it on, else cuda:rank in a data-parallel run,
// else the config's. A CUDA device is made the current one: the NSA kernels launch on the
// current device's stream (a run on an explicit "cuda:1" launched them on cuda:0's).
torch::Device WorkerDevice(const TrainConfig& config, const WorkerPlace& place, const Runtime& runtime) {
  torch::Device device = runtime.device;
  if (place.cuda_device >= 0) {
    if (!device.is_cuda()) {
      throw std::invalid_argument("worker place: cuda:" + std::to_string(place.cuda_device) + " for a run on " +
                                  device.str());
    }
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(place.cuda_device));
  } else if (config.world_size > 1) {
    device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(place.rank));
  }
  if (device.is_cuda()) {
    if (device.index() >= static_cast<int>(torch::cuda::device_count())) {
      throw std::invalid_argument("worker place: " + device.str() + ", but " +
                                  std::to_string(torch::cuda::device_count()) + " CUDA device(s) are visible");
    }
    c10::cuda::set_device(device.index());
  }
  return device;
}

class TorchTrainer final : public Trainer {
 public:
  TorchTrainer(const TrainConfig& config, const WorkerPlace& place)
      : config_(config),
        runtime_(ResolveRuntime(config)),
        device_(WorkerDevice(config, place, runtime_)),
        injector_(config.fault_injection) {
    if (config_.world_size > 1) {
      parallel_ = std::make_unique<DataParallel>(place.rank, config_.world_size, place.rendezvous);
    }
    torch::manual_seed(config_.seed);
    model_ = NsaTransformer(config_.model, runtime_.backend);
    model_->set_activation_checkpointing(config_.activation_checkpointing);
    model_->to(device_);
    parameter_count_ = 0;
    for (const auto& p : model_->parameters()) parameter_count_ += p.numel();
    optimizer_ = std::make_unique<AdamW>(AdamW::ForModel(model_->parameters(), config_.optim));
    if (config_.cuda_graphs) graph_ = std::make_unique<StepGraph>(device_);
    batches_ = std::make_unique<BatchSource>(config_, device_, Rank());
    if (!config_.checkpoint_dir.empty() && Rank() == 0) {
      checkpoint::RemoveIncompleteCheckpoints(config_.checkpoint_dir);
    }
    if (!config_.resume_from.empty()) Resume();
    // Every worker starts from rank 0's weights, as DDP does: the same seed gives the same
    // initialisation, but nothing else would guarantee it.
    if (parallel_) parallel_->Broadcast(model_->parameters());
  }

  StepMetrics Step() override {
    const auto start = std::chrono::steady_clock::now();
    model_->train();
    const int64_t this_step = step_ + 1;
    const double lr = ScheduledLr(config_.optim, step_, config_.max_steps);
    const bool inject = injector_.ActiveAt(this_step);
    // With CUDA graphs every step runs on the graph's side stream, the eager ones included.
    const std::shared_ptr<void> stream = graph_ ? graph_->UseStream() : nullptr;
    optimizer_->SetLr(lr);

    std::vector<torch::Tensor> batches;
    torch::Tensor readout;  // [loss, grad_norm, gate stats...] as float64 on the device
    if (Replayable(inject)) {
      batches.push_back(batches_->NextTrain(this_step));  // [B, T+1] int64
      readout = ReplayStep(batches.back());
    } else {
      readout = EagerStep(this_step, inject, batches);
      if (graph_ && !inject) ++eager_graph_steps_;
    }
    // The step's one read of the device; a non-finite loss or norm has already made the
    // optimizer skip its update on the device (found_inf).
    const auto host = readout.to(torch::kCPU);
    const double loss_sum = host[0].item<double>();
    const double grad_norm = host[1].item<double>();
    if (!std::isfinite(loss_sum) || !std::isfinite(grad_norm)) {
      return NonFiniteStep(this_step, loss_sum, grad_norm, lr, batches, inject);
    }
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
    m.data_seconds = batches_->TakeDataSeconds();
    const int64_t tokens = TokensPerStep();
    tokens_seen_ += tokens;
    m.tokens_seen = tokens_seen_;
    m.tokens_per_second = seconds > 0 ? tokens / seconds : 0.0;
    m.skipped_steps = skipped_steps_;
    gates_.step = step_;
    gates_.layers = host.numel() > 2 ? NsaTransformerImpl::GateStatsFromValues(
                                           host.narrow(0, 2, host.numel() - 2).view({-1, 7}))
                                     : model_->last_gate_stats();
    if (CheckpointDue(step_)) m.checkpoint = WriteCheckpoint(/*prune=*/true);
    return m;
  }

  // A halt's checkpoint prunes none of the run's others: a halt for a loss spike must not push
  // the checkpoints from before the spike out of checkpoint_keep.
  std::string Checkpoint() override {
    if (!WritesCheckpoints() || step_ == checkpointed_step_ || step_ == 0) return last_checkpoint_;
    return WriteCheckpoint(/*prune=*/false);
  }

  double Evaluate() override {
    torch::NoGradGuard no_grad;
    model_->eval();
    const auto& batches = batches_->ValBatches();
    if (batches.empty()) return std::numeric_limits<double>::quiet_NaN();  // no validation split
    double total = 0.0;
    for (const auto& batch : batches) total += Loss(Logits(batch), batch, false).item<double>();
    model_->train();
    const double mean = total / static_cast<double>(batches.size());
    if (!parallel_) return mean;
    // Each worker saw its rows of the same validation batches: the mean of the means.
    auto means = torch::full({1}, mean, torch::TensorOptions(torch::kFloat64).device(device_));
    parallel_->Average({means});
    return means.item<double>();
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

  // expected_grad: what the caller will back-propagate into this loss (nsa::CrossEntropyLoss).
  torch::Tensor Loss(const torch::Tensor& logits, const torch::Tensor& batch, bool inject,
                     double expected_grad = 1.0) {
    using torch::indexing::Slice;
    const auto targets = batch.index({Slice(), Slice(1, torch::indexing::None)});
    auto loss = nsa::CrossEntropyLoss(runtime_.backend, logits.reshape({-1, logits.size(-1)}),
                                      targets.reshape({-1}), expected_grad);
    return inject ? injector_.ApplyToLoss(loss) : loss;
  }

  // Forward and backward of every micro-batch, then the optimizer on the device.
  torch::Tensor EagerStep(int64_t this_step, bool inject, std::vector<torch::Tensor>& batches) {
    optimizer_->ZeroGrad();
    torch::Tensor loss_sum;
    std::optional<TapScope> tap;
    if (inject) {
      tap.emplace(model_, [this](int layer, const char* sublayer, torch::Tensor output) {
        return injector_.Apply(layer, sublayer, std::move(output));
      });
    }
    for (int micro = 0; micro < config_.grad_accum; ++micro) {
      batches.push_back(batches_->NextTrain(this_step));  // [B, T+1] int64
      torch::Tensor loss =
          Loss(Logits(batches.back()), batches.back(), inject, 1.0 / config_.grad_accum) / config_.grad_accum;
      loss.backward();
      const auto value = loss.detach().to(torch::kFloat64);
      loss_sum = loss_sum.defined() ? loss_sum + value : value;
    }
    AverageOverWorkers(loss_sum);
    return ClipAndUpdate(loss_sum);
  }

  // Data parallel: the gradients and the loss become their means over the workers, in
  // place, so that every worker clips, skips or updates alike (a NaN anywhere reaches all).
  // A parameter without a gradient gets zeros: every worker must send the same layout.
  void AverageOverWorkers(const torch::Tensor& loss_sum) {
    if (!parallel_) return;
    std::vector<torch::Tensor> grads;
    for (const auto& p : optimizer_->parameters()) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      grads.push_back(p.grad());
    }
    parallel_->Average(grads);
    parallel_->Average({loss_sum});
  }

  int Rank() const { return parallel_ ? parallel_->rank() : 0; }

  // Clipping and AdamW, skipped on the device when the loss or the norm is not finite.
  // Returns what the host reads after the step, in one tensor: [loss, grad_norm, the gate
  // statistics of the last forward (n_layers x 7)] as float64.
  torch::Tensor ClipAndUpdate(const torch::Tensor& loss_sum) {
    const auto grad_norm = optimizer_->ClipGradNorm(config_.optim.grad_clip);
    optimizer_->Step(AdamW::NonFiniteFlag(loss_sum, grad_norm), model_->weight_copies_for_update());
    std::vector<torch::Tensor> parts = {loss_sum.reshape({1}), grad_norm.to(torch::kFloat64).reshape({1})};
    const auto gates = model_->last_gate_stats_tensor();
    if (gates.defined()) parts.push_back(gates.detach().to(torch::kFloat64).flatten());
    return torch::cat(parts);
  }

  // The graph holds one micro-batch of one shape and no fault-injection tap; activation
  // checkpointing's recompute inside backward is not captured either.
  bool Replayable(bool inject) const {
    return graph_ && !inject && config_.grad_accum == 1 && !config_.activation_checkpointing &&
           (graph_->captured() || eager_graph_steps_ >= kGraphWarmupSteps);
  }

  // Copies the batch into the graph's input and replays the step (capturing it first).
  torch::Tensor ReplayStep(const torch::Tensor& batch) {
    if (!graph_->captured()) {
      static_batch_ = batch.clone();
      optimizer_->ZeroGrad();  // the captured backward allocates the gradients in its pool
      graph_->Capture([this] {
        torch::Tensor loss =
            Loss(Logits(static_batch_), static_batch_, false, 1.0 / config_.grad_accum) / config_.grad_accum;
        loss.backward();
        // Data parallel: the all-reduces are captured too (NCCL kernels in the graph), so
        // every replay averages that replay's gradients and loss over the workers.
        const torch::Tensor loss_sum = loss.detach().to(torch::kFloat64);
        AverageOverWorkers(loss_sum);
        return ClipAndUpdate(loss_sum);
      });
    } else {
      static_batch_.copy_(batch);
    }
    model_->RefreshStaleWeightCopies();
    return graph_->Replay();
  }

  int64_t TokensPerStep() const {  // over all workers
    return static_cast<int64_t>(config_.batch_size) * config_.seq_len * config_.grad_accum *
           config_.world_size;
  }

  // The step's update is dropped; then it is skipped (policy "skip", budget left) or the
  // run halts. Either way the report says what was non-finite and where it appeared first.
  StepMetrics NonFiniteStep(int64_t this_step, double loss, double grad_norm, double lr,
                            const std::vector<torch::Tensor>& batches, bool inject) {
    optimizer_->ZeroGrad();
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
      m.data_seconds = batches_->TakeDataSeconds();
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
        optimizer_->ZeroGrad();
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
    optimizer_->ZeroGrad();
    return first.empty() ? "none when the step was re-run with checks (not reproducible)" : first;
  }

  // The current step's checkpoint: rank 0 writes it (the weights are the same on every
  // worker); the others take its path, so that a halt reported by one of them names it too.
  std::string WriteCheckpoint(bool prune) {
    last_checkpoint_ = Rank() == 0 ? SaveCheckpoint(config_, *model_, *optimizer_, CurrentState(), device_, prune)
                                   : checkpoint::CheckpointPath(config_.checkpoint_dir, step_);
    checkpointed_step_ = step_;
    return last_checkpoint_;
  }

  // Whether the run writes checkpoints at all: a folder, and a period or milestones.
  bool WritesCheckpoints() const {
    return !config_.checkpoint_dir.empty() &&
           (config_.checkpoint_every > 0 || config_.checkpoint_milestone_every > 0);
  }

  bool CheckpointDue(int64_t step) const {
    if (!WritesCheckpoints()) return false;
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
    checkpointed_step_ = step_;
  }

  TrainConfig config_;
  Runtime runtime_;
  torch::Device device_;  // WorkerDevice
  FaultInjector injector_;
  std::unique_ptr<DataParallel> parallel_;  // world_size > 1 only
  NsaTransformer model_{nullptr};
  std::unique_ptr<AdamW> optimizer_;
  // CUDA graphs (config.cuda_graphs): the step is captured after kGraphWarmupSteps eager
  // steps on the graph's stream (lazy initialisation: cuBLAS workspaces, RoPE tables).
  static constexpr int kGraphWarmupSteps = 2;
  std::unique_ptr<StepGraph> graph_;
  int eager_graph_steps_ = 0;
  torch::Tensor static_batch_;
  std::unique_ptr<BatchSource> batches_;
  int64_t step_ = 0;
  int64_t tokens_seen_ = 0;
  int64_t skipped_steps_ = 0;
  int64_t parameter_count_ = 0;
  std::string last_checkpoint_;
  int64_t checkpointed_step_ = -1;  // last_checkpoint_'s step
  GateReport gates_;
};

}  // namespace

std::unique_ptr<Trainer> Trainer::Create(const TrainConfig& config, const WorkerPlace& place) {
  auto errors = ValidateConfig(config);
  if (!errors.empty()) throw ConfigError(std::move(errors));
  if (place.rank < 0 || place.rank >= config.world_size ||
      (config.world_size > 1 && place.rendezvous.empty())) {
    throw std::invalid_argument("worker place: rank " + std::to_string(place.rank) +
                                " of world_size " + std::to_string(config.world_size) +
                                (place.rendezvous.empty() ? ", no rendezvous" : ""));
  }
  try {
    return std::make_unique<TorchTrainer>(config, place);
  } catch (const data::DataError& e) {
    throw ConfigError({{e.field(), e.message()}});
  } catch (const c10::Error& e) {
    // LibTorch's what() carries a C++ backtrace (3.5 KB for a failed allocation): the run's
    // reason is the message alone.
    throw std::runtime_error(e.what_without_backtrace());
  }
}

}  // namespace nsad
