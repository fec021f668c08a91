#include "trainer/config_text.h"

#include <cstdio>
#include <sstream>
#include <utility>

namespace nsad {
namespace {

class Lines {
 public:
  void Add(const char* key, const std::string& value) { out_ << key << '=' << value << '\n'; }
  void Add(const char* key, const char* value) { Add(key, std::string(value)); }
  void Add(const char* key, bool value) { Add(key, value ? "true" : "false"); }
  void Add(const char* key, int value) { Add(key, std::to_string(value)); }
  void Add(const char* key, int64_t value) { Add(key, std::to_string(value)); }
  void Add(const char* key, uint64_t value) { Add(key, std::to_string(value)); }
  void Add(const char* key, float value) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.9g", value);  // 9 significant digits round-trip a float
    Add(key, std::string(text));
  }
  std::string str() const { return out_.str(); }

 private:
  std::ostringstream out_;
};

bool ShapesTrajectory(const std::string& key) {
  for (const char* prefix : {"model.", "optim.", "data."}) {
    if (key.rfind(prefix, 0) == 0) return true;
  }
  return key == "seq_len" || key == "batch_size" || key == "grad_accum" || key == "seed" ||
         key == "world_size";
}

}  // namespace

std::string ConfigToText(const TrainConfig& c) {
  Lines l;
  l.Add("name", c.name);
  const ModelConfig& m = c.model;
  l.Add("model.vocab_size", m.vocab_size);
  l.Add("model.dim", m.dim);
  l.Add("model.n_layers", m.n_layers);
  l.Add("model.n_heads", m.n_heads);
  l.Add("model.n_kv_groups", m.n_kv_groups);
  l.Add("model.head_dim", m.head_dim);
  l.Add("model.mlp_hidden", EffectiveMlpHidden(m));
  l.Add("model.rope_theta", m.rope_theta);
  l.Add("model.norm_eps", m.norm_eps);
  l.Add("model.nsa.cmp_block", m.nsa.cmp_block);
  l.Add("model.nsa.cmp_stride", m.nsa.cmp_stride);
  l.Add("model.nsa.slc_block", m.nsa.slc_block);
  l.Add("model.nsa.slc_top_n", m.nsa.slc_top_n);
  l.Add("model.nsa.window", m.nsa.window);
  l.Add("data.train_path", c.data.train_path);
  l.Add("data.val_path", c.data.val_path);
  l.Add("data.val_fraction", c.data.val_fraction);
  const OptimConfig& o = c.optim;
  l.Add("optim.lr", o.lr);
  l.Add("optim.min_lr", o.min_lr);
  l.Add("optim.weight_decay", o.weight_decay);
  l.Add("optim.beta1", o.beta1);
  l.Add("optim.beta2", o.beta2);
  l.Add("optim.eps", o.eps);
  l.Add("optim.warmup_steps", o.warmup_steps);
  l.Add("optim.grad_clip", o.grad_clip);
  l.Add("seq_len", c.seq_len);
  l.Add("batch_size", c.batch_size);
  l.Add("grad_accum", c.grad_accum);
  l.Add("world_size", c.world_size);
  l.Add("max_steps", c.max_steps);
  l.Add("seed", c.seed);
  l.Add("device", c.device);
  l.Add("dtype", c.dtype);
  l.Add("attention_backend", ToString(c.attention_backend));
  l.Add("log_every", c.log_every);
  l.Add("eval_every", c.eval_every);
  l.Add("eval_batches", c.eval_batches);
  l.Add("checkpoint_every", c.checkpoint_every);
  l.Add("checkpoint_keep", c.checkpoint_keep);
  l.Add("checkpoint_milestone_every", c.checkpoint_milestone_every);
  l.Add("checkpoint_dir", c.checkpoint_dir);
  l.Add("resume_from", c.resume_from);
  l.Add("nonfinite_policy", c.nonfinite_policy);
  l.Add("nonfinite_max_skips", c.nonfinite_max_skips);
  l.Add("activation_checkpointing", c.activation_checkpointing);
  l.Add("cuda_graphs", c.cuda_graphs);
  const FaultInjectionConfig& f = c.fault_injection;
  l.Add("fault_injection.nan_at_step", f.nan_at_step);
  l.Add("fault_injection.count", f.count);
  l.Add("fault_injection.layer", f.layer);
  l.Add("fault_injection.sublayer", f.sublayer);
  l.Add("fault_injection.backward", f.backward);
  return l.str();
}

std::map<std::string, std::string> ParseKeyValueLines(const std::string& text) {
  std::map<std::string, std::string> values;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    const size_t eq = line.find('=');
    if (eq == std::string::npos) continue;
    values[line.substr(0, eq)] = line.substr(eq + 1);
  }
  return values;
}

std::vector<std::string> TrajectoryDifferences(const std::string& checkpoint_config_text,
                                               const TrainConfig& now) {
  const auto saved = ParseKeyValueLines(checkpoint_config_text);
  const auto current = ParseKeyValueLines(ConfigToText(now));
  std::vector<std::string> differences;
  for (const auto& [key, value] : current) {
    if (!ShapesTrajectory(key)) continue;
    const auto it = saved.find(key);
    // world_size came later; checkpoints written before it ran on one worker.
    const std::string absent = key == "world_size" ? "1" : "(absent)";
    const std::string was = it == saved.end() ? absent : it->second;
    if (was != value) differences.push_back(key + ": checkpoint " + was + ", now " + value);
  }
  return differences;
}

}  // namespace nsad
