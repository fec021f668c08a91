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

// SwiGLU hidden width: 8/3 * dim rounded up to a multiple of 64 unless set explicitly.
int EffectiveMlpHidden(const ModelConfig& model);

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
  int64_t max_steps = 200;
  uint64_t seed = 1234;
  std::string device = "auto";
  std::string dtype = "float32";
  AttentionBackend attention_backend = AttentionBackend::kAuto;
  int log_every = 1;
  int eval_every = 50;
  int eval_batches = 4;
};

struct FieldError {
  std::string field;    // dotted proto path, e.g. "model.n_heads"
  std::string message;  // what is wrong and what is allowed
};

// Checks every field and cross-field constraint without touching torch or the GPU.
// Checks that the data path names at least one existing file, too. Empty = valid.
std::vector<FieldError> ValidateConfig(const TrainConfig& config);

// "model.dim: must be positive (got -1); seq_len: ..." for error messages.
std::string FormatFieldErrors(const std::vector<FieldError>& errors);

}  // namespace nsad
