// The engine's public, torch-free API. The daemon drives a Trainer from one thread per run;
// everything torch lives behind the pimpl in engine/src.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "nsad/config.h"

namespace nsad {

// The config was rejected; errors() names each offending field.
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(std::vector<FieldError> errors);
  const std::vector<FieldError>& errors() const { return errors_; }

 private:
  std::vector<FieldError> errors_;
};

// Training cannot continue (non-finite loss, bad data found mid-run, ...). The weights
// were not updated by the failing step and no checkpoint was written for it. For a
// non-finite step, what() names the step and the first non-finite tensor.
class TrainingHalt : public std::runtime_error {
 public:
  TrainingHalt(int64_t step, const std::string& reason);
  int64_t step() const { return step_; }

 private:
  int64_t step_;
};

struct StepMetrics {
  int64_t step = 0;  // optimizer steps completed, including this one
  double loss = 0.0;
  double lr = 0.0;
  double grad_norm = 0.0;
  double step_seconds = 0.0;
  // Of step_seconds: host time spent getting the step's batches (waiting for the prefetching
  // loader, copying them to the device). Near zero when the GPU never waits on data.
  double data_seconds = 0.0;
  double tokens_per_second = 0.0;
  int64_t tokens_seen = 0;
  // Set when the step's loss or gradient norm was not finite and nonfinite_policy "skip"
  // skipped its update: what was non-finite and where (loss is then not finite either).
  std::string skipped_reason;
  int64_t skipped_steps = 0;  // updates skipped so far in the run (survives resume)
  std::string checkpoint;     // checkpoint directory written after this step, or ""
};

struct BranchGateStats {
  double cmp = 0.0;
  double slc = 0.0;
  double win = 0.0;
};

struct LayerGateStats {
  int layer = 0;
  BranchGateStats mean;
  BranchGateStats stddev;
  double mean_selected_blocks = 0.0;
};

struct GateReport {
  int64_t step = 0;  // optimizer step whose forward pass produced the statistics
  std::vector<LayerGateStats> layers;
};

// Asks torch what this machine offers (CUDA devices, whether the NSA kernels can run).
RuntimeCapabilities ProbeRuntime();

// This process's place in a run: in a data-parallel run of TrainConfig::world_size workers its
// rank (rank 0 reports and writes the checkpoints) and the path of the file through which the
// run's workers meet (a c10d FileStore; fresh for every run, the same for all its workers);
// and, in any run, the GPU the daemon placed the worker on.
struct WorkerPlace {
  int rank = 0;
  std::string rendezvous;
  // The GPU this worker trains on, where the daemon placed a run whose device is "auto";
  // -1: the config's device (cuda:rank with world_size > 1).
  int cuda_device = -1;
};

class Trainer {
 public:
  // Validates the config (throws ConfigError), opens the data, builds model and optimizer,
  // and with resume_from set continues from that checkpoint (step() = its step). A missing,
  // corrupt or mismatched checkpoint is a ConfigError on field resume_from.
  // With world_size > 1 every worker calls Create with its own place, at the same time.
  static std::unique_ptr<Trainer> Create(const TrainConfig& config, const WorkerPlace& place = {});
  virtual ~Trainer() = default;

  // One optimizer step (grad_accum micro-batches), then a checkpoint when one is due.
  // Throws TrainingHalt.
  virtual StepMetrics Step() = 0;
  // Mean loss over eval_batches validation batches, without touching the weights.
  virtual double Evaluate() = 0;
  // A checkpoint of the current step, written now unless the step has one already (a halt's:
  // a resume then loses no step). Returns its path; "" when the run writes no checkpoints
  // (checkpoint_dir empty, or checkpoint_every and checkpoint_milestone_every both 0) or has
  // neither trained nor resumed. Data parallel: rank 0 writes it, every worker returns it.
  virtual std::string Checkpoint() = 0;

  virtual int64_t step() const = 0;
  virtual bool finished() const = 0;  // step() >= max_steps
  virtual GateReport gates() const = 0;

  virtual const TrainConfig& config() const = 0;
  virtual std::string device() const = 0;  // this worker's: "cpu", "cuda:0"
  virtual AttentionBackend attention_backend() const = 0;  // resolved: never kAuto
  virtual int64_t parameter_count() const = 0;
};

}  // namespace nsad
