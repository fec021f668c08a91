// Training configuration as plain C++ (no torch, no protobuf): the engine's view of
// nsa.v1.RunConfig. The default member initialisers below are THE defaults of the project;
// the daemon fills unset proto fields from them and reports the result as the effective
// config. Field names (dotted paths) match the proto's field names exactly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace nsad {

struct NsaConfig {
  int cmp_block = 32;   // l
  int cmp_stride = 16;  // d
  int slc_block = 64;   // l'
  int slc_top_n = 16;   // n
  int window = 512;     // w
};

struct ModelConfig {
  int vocab_size = 256;
  int dim = 128;
  int n_layers = 2;
  int n_heads = 4;
  int n_kv_groups = 2;
  int head_dim = 32;
  int mlp_hidden = 0;  // 0 = derived, see EffectiveMlpHidden()
  float rope_theta = 10000.0f;
  float norm_eps = 1e-5f;
  NsaConfig nsa;
};

// The reference model of the field reports, "m7c 125M": dim 768, 12 layers, 12 query heads,
// 2 KV groups, head dim 64, GPT-2 vocabulary padded to 50304, NSA l=32 d=16 l'=64 n=16
// w=512 (the defaults). configs/m7c_125m.json says the same (a test keeps them equal).
ModelConfig M7cModelConfig();

// SwiGLU hidden width: 8/3 * dim rounded up to a multiple of 64 unless set explicitly.
int EffectiveMlpHidden(const ModelConfig& model);

// Widths of the NSA attention's hidden layers: the compression MLP's (l*D -> this -> D) and
// the gate MLP's (dim -> this -> 3*H).
int64_t CompressionHidden(const ModelConfig& model);
int64_t GateHidden(const ModelConfig& model);

// The model's trainable parameters (the embedding is tied with the LM head; docs/NSA.md,
// "Parameter count"). A double: a config not yet refused may describe more than 2^63.
double ParameterCount(const ModelConfig& model);

// Bytes of a run's training state on each of its devices, activations aside: float32 weights,
// their gradients and AdamW's two moments, 16 bytes a parameter. A lower bound, so a run it
// refuses (PlanRuntime) could never have taken a step there.
double TrainingStateBytes(const ModelConfig& model);

struct DataConfig {
  std::string train_path;
  std::string val_path;
  float val_fraction = 0.05f;
};

struct OptimConfig {
  float lr = 3e-3f;
  float min_lr = 3e-4f;
  float weight_decay = 0.1f;
  float beta1 = 0.9f;
  float beta2 = 0.95f;
  float eps = 1e-8f;
  int warmup_steps = 20;
  float grad_clip = 1.0f;
};

// Test-only fault: poisons training with NaN so the anomaly path can be exercised end to
// end. Refused by ValidateConfig unless TrainConfig::allow_fault_injection is set.
struct FaultInjectionConfig {
  int64_t nan_at_step = 0;  // optimizer step (1-based, as reported) poisoned first; 0 = off
  int count = 1;            // consecutive steps poisoned from nan_at_step on
  int layer = -1;           // -1 = the loss itself; 0..n_layers-1 = that block's output
  std::string sublayer = "attention";  // "attention" | "mlp": which output of the block
  bool backward = false;    // poison the gradient flowing into that output, not the output
};

enum class AttentionBackend { kAuto, kReference, kCuda };
const char* ToString(AttentionBackend backend);

struct TrainConfig {
  std::string name;
  ModelConfig model;
  DataConfig data;
  OptimConfig optim;
  int seq_len = 256;
  int batch_size = 8;
  int grad_accum = 1;
  // Data-parallel workers, one process per GPU on cuda:0 .. cuda:world_size-1, gradients
  // averaged through NCCL (c10d). batch_size is per worker: a step trains on world_size x
  // batch_size x grad_accum sequences, the same global batch a single worker with
  // world_size x batch_size sequences would read, in the same order.
  int world_size = 1;
  int64_t max_steps = 200;
  uint64_t seed = 1234;
  std::string device = "auto";
  std::string dtype = "float32";
  AttentionBackend attention_backend = AttentionBackend::kAuto;
  int log_every = 1;
  int eval_every = 50;
  int eval_batches = 4;

  // Checkpoints: <checkpoint_dir>/step_NNNNNNNNN/, written atomically after an applied
  // update every checkpoint_every steps, at every milestone and at max_steps. The newest
  // checkpoint_keep are kept, plus milestones (steps divisible by checkpoint_milestone_every)
  // forever. An empty checkpoint_dir turns checkpoints off (the daemon sets it per run).
  int64_t checkpoint_every = 100;  // 0 = only milestones
  int checkpoint_keep = 3;
  int64_t checkpoint_milestone_every = 0;  // 0 = no milestones
  std::string checkpoint_dir;
  // Continue a run exactly: a checkpoint directory (step_NNNNNNNNN), or "latest" = the
  // newest one in checkpoint_dir. Empty = start fresh.
  std::string resume_from;

  // A step whose loss or gradient norm is not finite never updates the weights. "halt":
  // the run stops (TrainingHalt naming the step and the first non-finite tensor); "skip":
  // the step is skipped, up to nonfinite_max_skips times in the run, then the run halts.
  std::string nonfinite_policy = "halt";
  int nonfinite_max_skips = 3;

  FaultInjectionConfig fault_injection;
  // Not part of the wire config: set only by code (tests; the daemon's
  // --allow-fault-injection flag), so a user's config can never inject faults by itself.
  bool allow_fault_injection = false;
  // Recompute each block in the backward pass instead of storing its activations: less
  // memory for about one more forward of compute. Off by default (the field reports
  // measured a large slowdown from a Python version of it).
  bool activation_checkpointing = false;
  // Capture the training step in a CUDA graph after two eager warm-up steps and replay it
  // (trainer/step_graph.h). CUDA device and CUDA attention backend only; steps with
  // grad_accum > 1, activation checkpointing or an injected fault run eagerly. Data parallel
  // (world_size > 1): the all-reduces are captured with the step.
  bool cuda_graphs = false;
};

// m7c's whole training config as configs/m7c_125m.json states it, data paths aside (a test
// keeps the two equal): M7cModelConfig(), AdamW lr 6e-4 -> 6e-5 cosine after 700 warm-up
// steps over 50000, weight decay 0.1, clipping at 1.0; seq 2048, batch 16, bf16, CUDA graphs.
// The benchmarks train with it, so their optimizer cannot drift from the shipped config's.
TrainConfig M7cTrainConfig();

struct FieldError {
  std::string field;    // dotted proto path, e.g. "model.n_heads"
  std::string message;  // what is wrong and what is allowed
};

// Bounds ValidateConfig holds strings and eval_batches to: a run record (and every ListRuns
// reply, 4 MiB at most) carries the config, and the evaluation's batches stay on the device.
inline constexpr size_t kMaxNameBytes = 256;
inline constexpr size_t kMaxPathBytes = 4096;  // PATH_MAX
inline constexpr int64_t kMaxEvalBatches = 10000;

// Checks every field and cross-field constraint without touching torch or the GPU.
// Checks that the data path names at least one existing file, too. Empty = valid.
std::vector<FieldError> ValidateConfig(const TrainConfig& config);

// What the machine offers a run; probed with torch (nsad::ProbeRuntime, in the worker) and
// used torch-free by the daemon to validate configs at StartRun.
struct RuntimeCapabilities {
  int cuda_devices = 0;
  bool cuda_kernels = false;  // custom NSA kernels compiled in and runnable on this GPU
  bool nccl = false;          // c10d's NCCL process group compiled in (world_size > 1)
  // Total memory of each CUDA device and of the host (the smaller of its RAM and its cgroup's
  // limit), in bytes; empty or 0 when not probed. PlanRuntime holds TrainingStateBytes to them.
  std::vector<int64_t> cuda_memory_bytes;
  int64_t host_memory_bytes = 0;
};

// Where a config runs: "auto" resolved to a device ("cpu" or "cuda:N"; rank 0's with
// world_size > 1) and a backend (never kAuto). No environment variable takes part: what runs is what the config says.
struct RuntimePlan {
  std::string device = "cpu";
  AttentionBackend backend = AttentionBackend::kReference;
  std::vector<FieldError> errors;  // the device or backend cannot be had here
};
RuntimePlan PlanRuntime(const TrainConfig& config, const RuntimeCapabilities& caps);

// "model.dim: must be positive (got -1); seq_len: ..." for error messages.
std::string FormatFieldErrors(const std::vector<FieldError>& errors);

}  // namespace nsad
