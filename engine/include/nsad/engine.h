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
// were not updated by the failing step.
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
  double tokens_per_second = 0.0;
  int64_t tokens_seen = 0;
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

// Checks what only torch and the hardware can tell: the device exists, the attention
// backend can run there, bf16 is supported. Cheap (builds no model); the daemon calls it
// at StartRun so that such errors are INVALID_ARGUMENT, not a failed run.
std::vector<FieldError> CheckRuntime(const TrainConfig& config);

class Trainer {
 public:
  // Validates the config (throws ConfigError), opens the data, builds model and optimizer.
  static std::unique_ptr<Trainer> Create(const TrainConfig& config);
  virtual ~Trainer() = default;

  // One optimizer step (grad_accum micro-batches). Throws TrainingHalt.
  virtual StepMetrics Step() = 0;
  // Mean loss over eval_batches validation batches, without touching the weights.
  virtual double Evaluate() = 0;

  virtual int64_t step() const = 0;
  virtual bool finished() const = 0;  // step() >= max_steps
  virtual GateReport gates() const = 0;

  virtual const TrainConfig& config() const = 0;
  virtual std::string device() const = 0;                 // "cpu", "cuda:0"
  virtual AttentionBackend attention_backend() const = 0;  // resolved: never kAuto
  virtual int64_t parameter_count() const = 0;
};

}  // namespace nsad
