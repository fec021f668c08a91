#include "config_mapping.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/unknown_field_set.h>
#include <google/protobuf/util/json_util.h>

#include <regex>

namespace nsad::server {
namespace {

// Copies a proto3 `optional` scalar into the engine struct only when it was set.
#define NSAD_TAKE(proto, engine, field) \
  if ((proto).has_##field()) (engine).field = (proto).field()

}  // namespace

AttentionBackend FromProto(nsa::v1::AttentionBackend backend) {
  switch (backend) {
    case nsa::v1::ATTENTION_BACKEND_REFERENCE: return AttentionBackend::kReference;
    case nsa::v1::ATTENTION_BACKEND_CUDA: return AttentionBackend::kCuda;
    default: return AttentionBackend::kAuto;
  }
}

nsa::v1::AttentionBackend ToProto(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kReference: return nsa::v1::ATTENTION_BACKEND_REFERENCE;
    case AttentionBackend::kCuda: return nsa::v1::ATTENTION_BACKEND_CUDA;
    case AttentionBackend::kAuto: break;
  }
  return nsa::v1::ATTENTION_BACKEND_AUTO;
}

TrainConfig FromProto(const nsa::v1::RunConfig& p) {
  TrainConfig c;
  NSAD_TAKE(p, c, name);
  const auto& pm = p.model();
  ModelConfig& m = c.model;
  NSAD_TAKE(pm, m, vocab_size);
  NSAD_TAKE(pm, m, dim);
  NSAD_TAKE(pm, m, n_layers);
  NSAD_TAKE(pm, m, n_heads);
  NSAD_TAKE(pm, m, n_kv_groups);
  NSAD_TAKE(pm, m, head_dim);
  NSAD_TAKE(pm, m, mlp_hidden);
  NSAD_TAKE(pm, m, rope_theta);
  NSAD_TAKE(pm, m, norm_eps);
  const auto& pn = pm.nsa();
  NSAD_TAKE(pn, m.nsa, cmp_block);
  NSAD_TAKE(pn, m.nsa, cmp_stride);
  NSAD_TAKE(pn, m.nsa, slc_block);
  NSAD_TAKE(pn, m.nsa, slc_top_n);
  NSAD_TAKE(pn, m.nsa, window);
  NSAD_TAKE(p.data(), c.data, train_path);
  NSAD_TAKE(p.data(), c.data, val_path);
  NSAD_TAKE(p.data(), c.data, val_fraction);
  const auto& po = p.optim();
  NSAD_TAKE(po, c.optim, lr);
  NSAD_TAKE(po, c.optim, min_lr);
  NSAD_TAKE(po, c.optim, weight_decay);
  NSAD_TAKE(po, c.optim, beta1);
  NSAD_TAKE(po, c.optim, beta2);
  NSAD_TAKE(po, c.optim, eps);
  NSAD_TAKE(po, c.optim, warmup_steps);
  NSAD_TAKE(po, c.optim, grad_clip);
  NSAD_TAKE(p, c, seq_len);
  NSAD_TAKE(p, c, batch_size);
  NSAD_TAKE(p, c, grad_accum);
  NSAD_TAKE(p, c, world_size);
  NSAD_TAKE(p, c, max_steps);
  NSAD_TAKE(p, c, seed);
  NSAD_TAKE(p, c, device);
  NSAD_TAKE(p, c, dtype);
  NSAD_TAKE(p, c, log_every);
  NSAD_TAKE(p, c, eval_every);
  NSAD_TAKE(p, c, eval_batches);
  c.attention_backend = FromProto(p.attention_backend());
  NSAD_TAKE(p, c, checkpoint_every);
  NSAD_TAKE(p, c, checkpoint_keep);
  NSAD_TAKE(p, c, checkpoint_milestone_every);
  NSAD_TAKE(p, c, checkpoint_dir);
  NSAD_TAKE(p, c, resume_from);
  NSAD_TAKE(p, c, activation_checkpointing);
  NSAD_TAKE(p, c, cuda_graphs);
  NSAD_TAKE(p, c, nonfinite_policy);
  NSAD_TAKE(p, c, nonfinite_max_skips);
  const auto& pf = p.fault_injection();
  NSAD_TAKE(pf, c.fault_injection, nan_at_step);
  NSAD_TAKE(pf, c.fault_injection, count);
  NSAD_TAKE(pf, c.fault_injection, layer);
  NSAD_TAKE(pf, c.fault_injection, sublayer);
  NSAD_TAKE(pf, c.fault_injection, backward);
  // allow_fault_injection is deliberately not in the proto: only the daemon's flag sets it.
  return c;
}
#undef NSAD_TAKE

nsa::v1::RunConfig ToProto(const TrainConfig& c) {
  nsa::v1::RunConfig p;
  p.set_name(c.name);
  auto* m = p.mutable_model();
  m->set_vocab_size(c.model.vocab_size);
  m->set_dim(c.model.dim);
  m->set_n_layers(c.model.n_layers);
  m->set_n_heads(c.model.n_heads);
  m->set_n_kv_groups(c.model.n_kv_groups);
  m->set_head_dim(c.model.head_dim);
  m->set_mlp_hidden(EffectiveMlpHidden(c.model));
  m->set_rope_theta(c.model.rope_theta);
  m->set_norm_eps(c.model.norm_eps);
  auto* n = m->mutable_nsa();
  n->set_cmp_block(c.model.nsa.cmp_block);
  n->set_cmp_stride(c.model.nsa.cmp_stride);
  n->set_slc_block(c.model.nsa.slc_block);
  n->set_slc_top_n(c.model.nsa.slc_top_n);
  n->set_window(c.model.nsa.window);
  auto* d = p.mutable_data();
  d->set_train_path(c.data.train_path);
  d->set_val_path(c.data.val_path);
  d->set_val_fraction(c.data.val_fraction);
  auto* o = p.mutable_optim();
  o->set_lr(c.optim.lr);
  o->set_min_lr(c.optim.min_lr);
  o->set_weight_decay(c.optim.weight_decay);
  o->set_beta1(c.optim.beta1);
  o->set_beta2(c.optim.beta2);
  o->set_eps(c.optim.eps);
  o->set_warmup_steps(c.optim.warmup_steps);
  o->set_grad_clip(c.optim.grad_clip);
  p.set_seq_len(c.seq_len);
  p.set_batch_size(c.batch_size);
  p.set_grad_accum(c.grad_accum);
  p.set_world_size(c.world_size);
  p.set_max_steps(c.max_steps);
  p.set_seed(c.seed);
  p.set_device(c.device);
  p.set_dtype(c.dtype);
  p.set_attention_backend(ToProto(c.attention_backend));
  p.set_log_every(c.log_every);
  p.set_eval_every(c.eval_every);
  p.set_eval_batches(c.eval_batches);
  p.set_checkpoint_every(c.checkpoint_every);
  p.set_checkpoint_keep(c.checkpoint_keep);
  p.set_checkpoint_milestone_every(c.checkpoint_milestone_every);
  p.set_checkpoint_dir(c.checkpoint_dir);
  p.set_resume_from(c.resume_from);
  p.set_activation_checkpointing(c.activation_checkpointing);
  p.set_cuda_graphs(c.cuda_graphs);
  p.set_nonfinite_policy(c.nonfinite_policy);
  p.set_nonfinite_max_skips(c.nonfinite_max_skips);
  auto* f = p.mutable_fault_injection();
  f->set_nan_at_step(c.fault_injection.nan_at_step);
  f->set_count(c.fault_injection.count);
  f->set_layer(c.fault_injection.layer);
  f->set_sublayer(c.fault_injection.sublayer);
  f->set_backward(c.fault_injection.backward);
  return p;
}

void ToProto(const LayerGateStats& stats, nsa::v1::LayerGates* out) {
  out->set_layer(stats.layer);
  out->mutable_mean()->set_cmp(stats.mean.cmp);
  out->mutable_mean()->set_slc(stats.mean.slc);
  out->mutable_mean()->set_win(stats.mean.win);
  out->mutable_stddev()->set_cmp(stats.stddev.cmp);
  out->mutable_stddev()->set_slc(stats.stddev.slc);
  out->mutable_stddev()->set_win(stats.stddev.win);
  out->set_mean_selected_blocks(stats.mean_selected_blocks);
}

LayerGateStats FromProto(const nsa::v1::LayerGates& proto) {
  LayerGateStats stats;
  stats.layer = proto.layer();
  stats.mean = {proto.mean().cmp(), proto.mean().slc(), proto.mean().win()};
  stats.stddev = {proto.stddev().cmp(), proto.stddev().slc(), proto.stddev().win()};
  stats.mean_selected_blocks = proto.mean_selected_blocks();
  return stats;
}

std::string ParseRunConfigJson(const std::string& json, nsa::v1::RunConfig* out) {
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;  // a typo must not silently become a default
  const auto status = google::protobuf::util::JsonStringToMessage(json, out, options);
  if (status.ok()) return "";
  // protobuf says "(model) dimm: Cannot find field."; say "model.dimm: unknown field".
  std::string message(status.message());
  static const std::regex kUnknown(R"(^(?:\(([\w.]+)\) )?(\w+): Cannot find field\.?$)");
  std::smatch match;
  if (std::regex_match(message, match, kUnknown)) {
    const std::string parent = match[1].matched ? match[1].str() + "." : "";
    return parent + match[2].str() + ": unknown field";
  }
  return message;
}

namespace {
void CollectUnknown(const google::protobuf::Message& message, const std::string& prefix,
                    std::vector<std::string>* out) {
  const auto* reflection = message.GetReflection();
  const auto& unknown = reflection->GetUnknownFields(message);
  for (int i = 0; i < unknown.field_count(); ++i) {
    out->push_back(prefix + "#" + std::to_string(unknown.field(i).number()));
  }
  std::vector<const google::protobuf::FieldDescriptor*> fields;
  reflection->ListFields(message, &fields);
  for (const auto* field : fields) {
    if (field->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    if (field->is_repeated()) {
      for (int i = 0; i < reflection->FieldSize(message, field); ++i) {
        CollectUnknown(reflection->GetRepeatedMessage(message, field, i),
                       prefix + field->name() + "[" + std::to_string(i) + "].", out);
      }
    } else {
      CollectUnknown(reflection->GetMessage(message, field), prefix + field->name() + ".", out);
    }
  }
}
}  // namespace

std::vector<std::string> UnknownFieldPaths(const google::protobuf::Message& message) {
  std::vector<std::string> paths;
  CollectUnknown(message, "", &paths);
  return paths;
}

}  // namespace nsad::server
