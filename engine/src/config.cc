#include "nsad/config.h"

#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <sstream>

#include "nsa/kernel_limits.h"
#include "nsad/engine.h"
#include "trainer/resume_target.h"

namespace nsad {

int EffectiveMlpHidden(const ModelConfig& model) {
  if (model.mlp_hidden > 0) return model.mlp_hidden;
  // In 64 bits: a dim above 2^28 (which the memory check refuses) must not overflow here.
  const int64_t raw = (8 * int64_t{model.dim} + 2) / 3;
  return static_cast<int>(std::min<int64_t>((raw + 63) / 64 * 64, std::numeric_limits<int>::max()));
}

int64_t CompressionHidden(const ModelConfig& model) { return 2 * int64_t{model.head_dim}; }

int64_t GateHidden(const ModelConfig& model) { return std::max<int64_t>(1, int64_t{model.dim} / 4); }

double ParameterCount(const ModelConfig& m) {
  const double dim = m.dim, H = m.n_heads, G = m.n_kv_groups, D = m.head_dim, l = m.nsa.cmp_block;
  const double F = EffectiveMlpHidden(m), cmp = static_cast<double>(CompressionHidden(m)),
               gate = static_cast<double>(GateHidden(m));
  const double attention = dim * H * D                                  // q
                           + dim * 6 * G * D                            // k, v of the three branches
                           + H * D * dim                                // output projection
                           + 2 * l * D                                  // intra-block positions (k, v)
                           + 2 * (l * D * cmp + cmp + cmp * D + D)      // compression MLPs (k, v)
                           + dim * gate + gate + gate * 3 * H + 3 * H;  // gate MLP
  const double block = 2 * dim + attention + 3 * dim * F;  // two RMSNorms, attention, SwiGLU
  return static_cast<double>(m.vocab_size) * dim + m.n_layers * block + dim;
}

double TrainingStateBytes(const ModelConfig& model) { return 16.0 * ParameterCount(model); }

ModelConfig M7cModelConfig() {
  ModelConfig c;
  c.vocab_size = 50304;
  c.dim = 768;
  c.n_layers = 12;
  c.n_heads = 12;
  c.n_kv_groups = 2;
  c.head_dim = 64;
  return c;
}

TrainConfig M7cTrainConfig() {
  TrainConfig c;
  c.name = "m7c-125m";
  c.model = M7cModelConfig();
  c.optim.lr = 6e-4f;
  c.optim.min_lr = 6e-5f;
  c.optim.weight_decay = 0.1f;
  c.optim.beta1 = 0.9f;
  c.optim.beta2 = 0.95f;
  c.optim.warmup_steps = 700;
  c.optim.grad_clip = 1.0f;
  c.seq_len = 2048;
  c.batch_size = 16;
  c.grad_accum = 1;
  c.max_steps = 50000;
  c.log_every = 10;
  c.eval_every = 500;
  c.eval_batches = 20;
  c.seed = 1234;
  c.device = "cuda";
  c.dtype = "bfloat16";
  c.attention_backend = AttentionBackend::kAuto;
  c.cuda_graphs = true;
  return c;
}

const char* ToString(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kAuto: return "auto";
    case AttentionBackend::kReference: return "reference";
    case AttentionBackend::kCuda: return "cuda";
  }
  return "unknown";
}

namespace {

// Collects field errors with the value that was rejected, so every message can be acted on
// without looking anything up.
class Checker {
 public:
  template <typename T>
  void Positive(const char* field, T value) {
    if (!(value > 0)) Add(field, "must be positive (got " + Str(value) + ")");
  }
  template <typename T>
  void NonNegative(const char* field, T value) {
    if (!(value >= 0)) Add(field, "must be >= 0 (got " + Str(value) + ")");
  }
  template <typename T>
  void Finite(const char* field, T value) {
    if (!std::isfinite(static_cast<double>(value))) Add(field, "must be a finite number (got " + Str(value) + ")");
  }
  void AtMost(const char* field, int64_t value, int64_t most) {
    if (value > most) Add(field, "must be at most " + Str(most) + " (got " + Str(value) + ")");
  }
  // Strings the daemon stores in run records and lists back in every ListRuns reply.
  void LengthAtMost(const char* field, const std::string& value, size_t most) {
    if (value.size() > most) {
      Add(field, "must be at most " + Str(most) + " bytes (got " + Str(value.size()) + ")");
    }
  }
  void InRange(const char* field, float value, float lo, float hi, bool hi_inclusive) {
    const bool ok = value >= lo && (hi_inclusive ? value <= hi : value < hi);
    if (!ok) {
      Add(field, "must be in [" + Str(lo) + ", " + Str(hi) + (hi_inclusive ? "]" : ")") +
                     " (got " + Str(value) + ")");
    }
  }
  void Add(std::string field, std::string message) {
    errors_.push_back({std::move(field), std::move(message)});
  }
  std::vector<FieldError> Take() { return std::move(errors_); }

 private:
  template <typename T>
  static std::string Str(T value) {
    std::ostringstream out;
    out << value;
    return out.str();
  }
  std::vector<FieldError> errors_;
};

bool PathMatchesSomething(const std::string& pattern) {
  struct stat st {};
  if (::stat(pattern.c_str(), &st) == 0) return true;
  glob_t matches{};
  const int rc = ::glob(pattern.c_str(), 0, nullptr, &matches);
  const bool found = rc == 0 && matches.gl_pathc > 0;
  ::globfree(&matches);
  return found;
}

bool ValidDevice(const std::string& device) {
  if (device == "auto" || device == "cpu" || device == "cuda") return true;
  // At most 4 digits: the index must parse as an int (PlanRuntime), and no host has more GPUs.
  if (device.rfind("cuda:", 0) != 0 || device.size() == 5 || device.size() > 9) return false;
  for (size_t i = 5; i < device.size(); ++i) {
    if (device[i] < '0' || device[i] > '9') return false;
  }
  return true;
}

void CheckModel(const ModelConfig& m, Checker& c) {
  c.Positive("model.vocab_size", m.vocab_size);
  c.Positive("model.dim", m.dim);
  c.Positive("model.n_layers", m.n_layers);
  c.Positive("model.n_heads", m.n_heads);
  c.Positive("model.n_kv_groups", m.n_kv_groups);
  c.Positive("model.head_dim", m.head_dim);
  c.NonNegative("model.mlp_hidden", m.mlp_hidden);
  c.Positive("model.rope_theta", m.rope_theta);
  c.Finite("model.rope_theta", m.rope_theta);
  c.Positive("model.norm_eps", m.norm_eps);
  c.Finite("model.norm_eps", m.norm_eps);
  if (m.n_heads > 0 && m.n_kv_groups > 0 && m.n_heads % m.n_kv_groups != 0) {
    c.Add("model.n_kv_groups", "must divide model.n_heads (" + std::to_string(m.n_heads) +
                                   "), got " + std::to_string(m.n_kv_groups));
  }
  if (m.head_dim > 0 && m.head_dim % 2 != 0) {
    c.Add("model.head_dim", "must be even for rotary embeddings (got " +
                                std::to_string(m.head_dim) + ")");
  }
  const NsaConfig& n = m.nsa;
  c.Positive("model.nsa.cmp_block", n.cmp_block);
  c.Positive("model.nsa.cmp_stride", n.cmp_stride);
  c.Positive("model.nsa.slc_block", n.slc_block);
  c.Positive("model.nsa.slc_top_n", n.slc_top_n);
  c.Positive("model.nsa.window", n.window);
  if (n.cmp_block > 0 && n.cmp_stride > n.cmp_block) {
    c.Add("model.nsa.cmp_stride", "must not exceed model.nsa.cmp_block (" +
                                      std::to_string(n.cmp_block) + "), got " +
                                      std::to_string(n.cmp_stride));
  }
  // Block 0 and the two local blocks are always selected (ops.h), so n must hold them.
  if (n.slc_top_n > 0 && n.slc_top_n < 3) {
    c.Add("model.nsa.slc_top_n", "must be at least 3 (the first block and two local blocks "
                                 "are always selected), got " + std::to_string(n.slc_top_n));
  }
}

void CheckOptim(const OptimConfig& o, Checker& c) {
  c.Positive("optim.lr", o.lr);
  c.Finite("optim.lr", o.lr);
  c.NonNegative("optim.min_lr", o.min_lr);
  if (o.lr > 0 && o.min_lr > o.lr) c.Add("optim.min_lr", "must not exceed optim.lr");
  c.NonNegative("optim.weight_decay", o.weight_decay);
  c.Finite("optim.weight_decay", o.weight_decay);
  c.InRange("optim.beta1", o.beta1, 0.0f, 1.0f, false);
  c.InRange("optim.beta2", o.beta2, 0.0f, 1.0f, false);
  c.Positive("optim.eps", o.eps);
  c.Finite("optim.eps", o.eps);
  c.NonNegative("optim.warmup_steps", o.warmup_steps);
  c.NonNegative("optim.grad_clip", o.grad_clip);
  c.Finite("optim.grad_clip", o.grad_clip);
}

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Selection slots past the sequence's selection blocks select nothing (n >= their count takes
// every block), yet each costs memory at every position ([B, T, groups, n] indices): bounded,
// so that a slip such as 100000 is refused rather than exhausting the host on the reference
// backend. The CUDA kernels' own bound (kernel_limits.h) is below this one.
void CheckSelectionSlots(const TrainConfig& config, Checker& c) {
  const NsaConfig& n = config.model.nsa;
  if (n.slc_block <= 0 || config.seq_len <= 0) return;  // refused by name already
  const int64_t blocks = (static_cast<int64_t>(config.seq_len) + n.slc_block - 1) / n.slc_block;
  const int64_t most = std::max<int64_t>(nsa::kernel_limits::kMaxTopN, blocks);
  if (n.slc_top_n > most) {
    c.Add("model.nsa.slc_top_n", "must be at most " + std::to_string(most) + " (seq_len " +
                                     std::to_string(config.seq_len) + " has " + std::to_string(blocks) +
                                     " selection blocks of model.nsa.slc_block " + std::to_string(n.slc_block) +
                                     "; more slots select nothing), got " + std::to_string(n.slc_top_n));
  }
}

void CheckCheckpoints(const TrainConfig& config, Checker& c) {
  c.NonNegative("checkpoint_every", config.checkpoint_every);
  c.Positive("checkpoint_keep", config.checkpoint_keep);
  c.NonNegative("checkpoint_milestone_every", config.checkpoint_milestone_every);
  const std::string& resume = config.resume_from;
  if (resume == "latest") {
    if (config.checkpoint_dir.empty()) {
      c.Add("resume_from", "\"latest\" needs checkpoint_dir to say where to look");
    }
  } else if (!resume.empty() && !IsDirectory(resume)) {
    c.Add("resume_from", "must be \"latest\" or a checkpoint directory; no such directory: " +
                             resume);
  }
}

void CheckNonFinite(const TrainConfig& config, Checker& c) {
  if (config.nonfinite_policy != "halt" && config.nonfinite_policy != "skip") {
    c.Add("nonfinite_policy", "must be halt or skip (got \"" + config.nonfinite_policy + "\")");
  }
  c.NonNegative("nonfinite_max_skips", config.nonfinite_max_skips);

  const FaultInjectionConfig& f = config.fault_injection;
  if (f.nan_at_step == 0) return;  // off
  if (!config.allow_fault_injection) {
    c.Add("fault_injection", "is a testing aid and refused unless fault injection is "
                             "explicitly enabled (nsad --allow-fault-injection)");
    return;
  }
  c.Positive("fault_injection.nan_at_step", f.nan_at_step);
  c.Positive("fault_injection.count", f.count);
  if (f.layer < -1 || f.layer >= config.model.n_layers) {
    c.Add("fault_injection.layer", "must be -1 (the loss) or a layer in [0, " +
                                       std::to_string(config.model.n_layers) + ") (got " +
                                       std::to_string(f.layer) + ")");
  }
  if (f.sublayer != "attention" && f.sublayer != "mlp") {
    c.Add("fault_injection.sublayer", "must be attention or mlp (got \"" + f.sublayer + "\")");
  }
  if (f.layer == -1 && f.backward) {
    c.Add("fault_injection.backward", "needs a layer: the loss has no incoming gradient");
  }
}

}  // namespace

std::vector<FieldError> ValidateConfig(const TrainConfig& config) {
  Checker c;
  CheckModel(config.model, c);
  CheckOptim(config.optim, c);

  c.Positive("seq_len", config.seq_len);
  c.Positive("batch_size", config.batch_size);
  c.Positive("grad_accum", config.grad_accum);
  c.Positive("world_size", config.world_size);
  c.Positive("max_steps", config.max_steps);
  c.Positive("log_every", config.log_every);
  c.NonNegative("eval_every", config.eval_every);
  c.Positive("eval_batches", config.eval_batches);
  // The evaluation's batches are built once and kept on the run's device.
  c.AtMost("eval_batches", config.eval_batches, kMaxEvalBatches);
  c.LengthAtMost("name", config.name, kMaxNameBytes);
  c.LengthAtMost("data.train_path", config.data.train_path, kMaxPathBytes);
  c.LengthAtMost("data.val_path", config.data.val_path, kMaxPathBytes);
  c.LengthAtMost("checkpoint_dir", config.checkpoint_dir, kMaxPathBytes);
  c.LengthAtMost("resume_from", config.resume_from, kMaxPathBytes);
  if (!ValidDevice(config.device)) {
    c.Add("device", "must be auto, cpu, cuda or cuda:N (got \"" + config.device + "\")");
  }
  if (config.dtype != "float32" && config.dtype != "bfloat16") {
    c.Add("dtype", "must be float32 or bfloat16 (got \"" + config.dtype + "\")");
  }

  const DataConfig& d = config.data;
  if (d.train_path.empty()) {
    c.Add("data.train_path", "is required: a token shard file, directory or glob");
  } else if (!PathMatchesSomething(d.train_path)) {
    c.Add("data.train_path", "no such file, directory or glob match: " + d.train_path);
  }
  if (!d.val_path.empty() && !PathMatchesSomething(d.val_path)) {
    c.Add("data.val_path", "no such file, directory or glob match: " + d.val_path);
  }
  if (d.val_path.empty()) c.InRange("data.val_fraction", d.val_fraction, 0.0f, 1.0f, false);
  CheckSelectionSlots(config, c);
  CheckCheckpoints(config, c);
  CheckNonFinite(config, c);
  auto errors = c.Take();
  // A config valid so far that resumes is held against its checkpoint as the trainer will load
  // it (file sizes, not checksums: those read every byte and stay with the load), so that a
  // checkpoint of another model or run is refused before a run exists.
  if (errors.empty() && !config.resume_from.empty()) {
    try {
      CheckResumeTarget(ResolveResumeDir(config), config, checkpoint::Verify::kSizes);
    } catch (const ConfigError& e) {
      errors = e.errors();
    }
  }
  return errors;
}

namespace {

// The model shapes the NSA CUDA kernels are built for (nsa/kernel_limits.h, which the kernels
// check their inputs against), one FieldError per shape they are not.
std::vector<FieldError> CudaKernelShapeErrors(const ModelConfig& m) {
  namespace limits = nsa::kernel_limits;
  std::vector<FieldError> errors;
  const std::string why = " for the NSA CUDA kernels";
  const auto got = [](int value) { return " (got " + std::to_string(value) + ")"; };
  if (!limits::HeadDimSupported(m.head_dim)) {
    errors.push_back({"model.head_dim", "must be " + std::to_string(limits::kHeadDimSmall) + " or " +
                                            std::to_string(limits::kHeadDimLarge) + why + got(m.head_dim)});
  }
  if (m.n_kv_groups > 0 && m.n_heads / m.n_kv_groups > limits::kMaxHeadsPerGroup) {
    errors.push_back({"model.n_heads", "at most " + std::to_string(limits::kMaxHeadsPerGroup) +
                                           " query heads per kv group" + why + got(m.n_heads / m.n_kv_groups)});
  }
  if (m.nsa.slc_top_n > limits::kMaxTopN) {
    errors.push_back({"model.nsa.slc_top_n",
                      "must be at most " + std::to_string(limits::kMaxTopN) + why + got(m.nsa.slc_top_n)});
  }
  if (m.nsa.slc_block > limits::kMaxSelectionBlock) {
    errors.push_back({"model.nsa.slc_block",
                      "must be at most " + std::to_string(limits::kMaxSelectionBlock) + why + got(m.nsa.slc_block)});
  }
  return errors;
}

std::string Gib(double bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return text;
}

// The run's training state against the memory of each device it goes on (every worker of a
// data-parallel run holds all of it): refused here, by name, rather than failing the run with
// an allocator's message, or on the CPU swapping the host until the kernel kills something.
void CheckTrainingStateFits(const TrainConfig& config, const RuntimeCapabilities& caps, const std::string& device,
                            std::vector<FieldError>& errors) {
  std::string where;
  int64_t have = 0;
  if (device == "cpu") {
    where = "the host's";
    have = caps.host_memory_bytes;
  } else {
    const int first = std::stoi(device.substr(5)), last = first + config.world_size - 1;
    for (int i = first; i <= last && i < static_cast<int>(caps.cuda_memory_bytes.size()); ++i) {
      if (have == 0 || caps.cuda_memory_bytes[i] < have) {
        have = caps.cuda_memory_bytes[i];
        where = "cuda:" + std::to_string(i) + "'s";
      }
    }
  }
  const double need = TrainingStateBytes(config.model);
  if (have <= 0 || need <= static_cast<double>(have)) return;
  const ModelConfig& m = config.model;
  char count[32];
  std::snprintf(count, sizeof count, "%.4g", ParameterCount(m));
  errors.push_back({"model", std::string(count) + " parameters need " + Gib(need) +
                                 " for their float32 weights, gradients and AdamW moments alone, more than " + where +
                                 " " + Gib(static_cast<double>(have)) + " (model.vocab_size " +
                                 std::to_string(m.vocab_size) + ", model.dim " + std::to_string(m.dim) +
                                 ", model.n_layers " + std::to_string(m.n_layers) + ")"});
}

}  // namespace

RuntimePlan PlanRuntime(const TrainConfig& config, const RuntimeCapabilities& caps) {
  RuntimePlan plan;
  const std::string& d = config.device;
  if (d == "auto") {
    plan.device = caps.cuda_devices > 0 ? "cuda:0" : "cpu";
  } else if (d == "cpu") {
    plan.device = "cpu";
  } else if (ValidDevice(d)) {
    const int index = d == "cuda" ? 0 : std::stoi(d.substr(5));
    plan.device = "cuda:" + std::to_string(index);
    if (index >= caps.cuda_devices) {
      plan.errors.push_back({"device", "\"" + d + "\" requested but " +
                                           std::to_string(caps.cuda_devices) +
                                           " CUDA device(s) are visible"});
      return plan;
    }
  }
  if (config.world_size > 1) {
    // One worker per GPU on cuda:0 .. cuda:world_size-1: the device cannot be chosen.
    const std::string workers = std::to_string(config.world_size) + " workers ";
    if (d != "auto" && d != "cuda") {
      plan.errors.push_back({"world_size", workers + "go on cuda:0, cuda:1, ..., so device must be "
                                                     "auto or cuda (got \"" + d + "\")"});
    } else if (caps.cuda_devices < config.world_size) {
      plan.errors.push_back({"world_size", workers + "need one CUDA device each, but " +
                                               std::to_string(caps.cuda_devices) +
                                               " CUDA device(s) are visible"});
    } else if (!caps.nccl) {
      plan.errors.push_back({"world_size", workers + "need NCCL, which this build lacks"});
    }
    if (!plan.errors.empty()) return plan;
  }
  const bool on_gpu = plan.device != "cpu";
  switch (config.attention_backend) {
    case AttentionBackend::kAuto:  // the kernels where they run and take the model's shape
      plan.backend = on_gpu && caps.cuda_kernels && CudaKernelShapeErrors(config.model).empty()
                         ? AttentionBackend::kCuda
                         : AttentionBackend::kReference;
      break;
    case AttentionBackend::kReference:
      plan.backend = AttentionBackend::kReference;
      break;
    case AttentionBackend::kCuda:
      plan.backend = AttentionBackend::kCuda;
      if (!on_gpu) {
        plan.errors.push_back({"attention_backend",
                               "ATTENTION_BACKEND_CUDA needs a CUDA device, but the run's device is " +
                                   plan.device});
      } else if (!caps.cuda_kernels) {
        plan.errors.push_back({"attention_backend",
                               "the NSA CUDA kernels are not available in this build or for this GPU"});
      } else {
        for (auto& error : CudaKernelShapeErrors(config.model)) plan.errors.push_back(std::move(error));
      }
      break;
  }
  if (config.cuda_graphs && plan.errors.empty() && plan.backend != AttentionBackend::kCuda) {
    plan.errors.push_back({"cuda_graphs", std::string("needs a CUDA device and the CUDA attention backend, but "
                                                      "the run uses the ") +
                                              ToString(plan.backend) +
                                          " backend on " + plan.device});
  }
  CheckTrainingStateFits(config, caps, plan.device, plan.errors);
  return plan;
}

std::string FormatFieldErrors(const std::vector<FieldError>& errors) {
  std::string out;
  for (const FieldError& e : errors) {
    if (!out.empty()) out += "; ";
    out += e.field + ": " + e.message;
  }
  return out;
}

}  // namespace nsad
