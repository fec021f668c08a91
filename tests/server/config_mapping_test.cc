// The proto <-> engine config mapping and validation: defaults, strict JSON, field names.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <limits>
#include <sstream>

#include "config_mapping.h"
#include "daemon_options.h"
#include "trainer/config_text.h"

namespace nsad::server {
namespace {

TEST(ConfigMapping, UnsetFieldsTakeEngineDefaultsAndSetFieldsWin) {
  nsa::v1::RunConfig proto;
  proto.set_seq_len(77);
  proto.mutable_model()->mutable_nsa()->set_window(99);
  const TrainConfig config = FromProto(proto);
  const TrainConfig defaults;
  EXPECT_EQ(config.seq_len, 77);
  EXPECT_EQ(config.model.nsa.window, 99);
  EXPECT_EQ(config.model.nsa.cmp_block, defaults.model.nsa.cmp_block);
  EXPECT_EQ(config.batch_size, defaults.batch_size);
  EXPECT_FLOAT_EQ(config.optim.lr, defaults.optim.lr);
}

TEST(ConfigMapping, ExplicitZeroIsKeptSoValidationCanRejectIt) {
  nsa::v1::RunConfig proto;
  ASSERT_EQ(ParseRunConfigJson(R"({"seq_len": 0})", &proto), "");
  const TrainConfig config = FromProto(proto);
  EXPECT_EQ(config.seq_len, 0);
  const auto errors = ValidateConfig(config);
  bool named = false;
  for (const auto& e : errors) named = named || e.field == "seq_len";
  EXPECT_TRUE(named) << FormatFieldErrors(errors);
}

TEST(ConfigMapping, EffectiveConfigRoundTripsAndSetsEveryField) {
  TrainConfig config;
  config.name = "x";
  config.model.dim = 96;
  config.data.train_path = "/tmp/shards";
  config.attention_backend = AttentionBackend::kReference;
  const nsa::v1::RunConfig proto = ToProto(config);
  EXPECT_TRUE(proto.has_seq_len());
  EXPECT_TRUE(proto.model().nsa().has_slc_top_n());
  EXPECT_EQ(proto.model().mlp_hidden(), EffectiveMlpHidden(config.model))
      << "the effective config reports the derived MLP width, not 0";
  const TrainConfig back = FromProto(proto);
  EXPECT_EQ(back.model.dim, 96);
  EXPECT_EQ(back.data.train_path, "/tmp/shards");
  EXPECT_EQ(back.attention_backend, AttentionBackend::kReference);
  EXPECT_EQ(ToProto(back).SerializeAsString(), proto.SerializeAsString());
}

// Checkpoints record the effective config as ConfigToText. Every RunConfig field must be in
// that record under its dotted proto name, so a field added to the proto and the engine
// cannot be left out of it (activation_checkpointing and cuda_graphs once were).
TEST(ConfigText, RecordsEveryRunConfigField) {
  const auto recorded = ParseKeyValueLines(ConfigToText(FromProto(nsa::v1::RunConfig())));
  std::vector<std::string> missing;
  std::function<void(const google::protobuf::Descriptor*, const std::string&)> walk =
      [&](const google::protobuf::Descriptor* message, const std::string& prefix) {
        for (int i = 0; i < message->field_count(); ++i) {
          const auto* field = message->field(i);
          const std::string name = prefix + field->name();
          if (field->message_type() != nullptr) {
            walk(field->message_type(), name + ".");
          } else if (recorded.count(name) == 0) {
            missing.push_back(name);
          }
        }
      };
  walk(nsa::v1::RunConfig::descriptor(), "");
  EXPECT_TRUE(missing.empty()) << "not in the checkpoint's config record: "
                               << testing::PrintToString(missing);
}

// world_size shapes the trajectory (the global batch), so resuming with another one is
// refused; a checkpoint from before the field existed was written by one worker.
TEST(ConfigText, WorldSizeShapesTheTrajectoryAndWasOneBeforeItWasRecorded) {
  nsa::v1::RunConfig proto;
  ASSERT_EQ(ParseRunConfigJson(R"({"world_size": 2, "batch_size": 8})", &proto), "");
  TrainConfig two = FromProto(proto);
  EXPECT_EQ(two.world_size, 2);
  EXPECT_EQ(ToProto(two).world_size(), 2);
  TrainConfig one = two;
  one.world_size = 1;
  const auto differences = TrajectoryDifferences(ConfigToText(two), one);
  ASSERT_EQ(differences.size(), 1u);
  EXPECT_EQ(differences[0], "world_size: checkpoint 2, now 1");

  std::string before_the_field;  // the record without its world_size line
  std::istringstream lines(ConfigToText(one));
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("world_size=", 0) != 0) before_the_field += line + "\n";
  }
  ASSERT_NE(before_the_field, ConfigToText(one));
  EXPECT_TRUE(TrajectoryDifferences(before_the_field, one).empty());
  EXPECT_EQ(TrajectoryDifferences(before_the_field, two).size(), 1u);
}

TEST(ConfigMapping, CheckpointAndAnomalyFieldsMapBothWays) {
  nsa::v1::RunConfig proto;
  ASSERT_EQ(ParseRunConfigJson(R"({"checkpoint_every": 50, "checkpoint_keep": 5,
      "checkpoint_milestone_every": 1000, "checkpoint_dir": "/state/runs/r1/checkpoints",
      "resume_from": "latest", "nonfinite_policy": "skip", "nonfinite_max_skips": 7,
      "fault_injection": {"nan_at_step": 12, "count": 2, "layer": 1, "sublayer": "mlp",
                          "backward": true}})",
                               &proto),
            "");
  const TrainConfig config = FromProto(proto);
  EXPECT_EQ(config.checkpoint_every, 50);
  EXPECT_EQ(config.checkpoint_keep, 5);
  EXPECT_EQ(config.checkpoint_milestone_every, 1000);
  EXPECT_EQ(config.checkpoint_dir, "/state/runs/r1/checkpoints");
  EXPECT_EQ(config.resume_from, "latest");
  EXPECT_EQ(config.nonfinite_policy, "skip");
  EXPECT_EQ(config.nonfinite_max_skips, 7);
  EXPECT_EQ(config.fault_injection.nan_at_step, 12);
  EXPECT_EQ(config.fault_injection.count, 2);
  EXPECT_EQ(config.fault_injection.layer, 1);
  EXPECT_EQ(config.fault_injection.sublayer, "mlp");
  EXPECT_TRUE(config.fault_injection.backward);
  EXPECT_FALSE(config.allow_fault_injection) << "only the daemon's flag may allow injection";
  EXPECT_EQ(ToProto(config).SerializeAsString(), ToProto(FromProto(ToProto(config))).SerializeAsString());
  EXPECT_EQ(ToProto(config).fault_injection().layer(), 1);

  // Unset: the engine defaults (checkpoints every 100 steps once a directory is set, halt).
  const TrainConfig defaults = FromProto(nsa::v1::RunConfig());
  EXPECT_EQ(defaults.checkpoint_every, TrainConfig().checkpoint_every);
  EXPECT_EQ(defaults.nonfinite_policy, "halt");
  EXPECT_EQ(defaults.fault_injection.nan_at_step, 0);
  EXPECT_EQ(defaults.fault_injection.layer, -1);

  // A config asking for fault injection is refused by name unless the flag allowed it.
  TrainConfig asked = config;
  asked.data.train_path = "/";
  asked.resume_from = "";
  std::vector<std::string> fields;
  for (const auto& e : ValidateConfig(asked)) fields.push_back(e.field);
  EXPECT_EQ(fields, std::vector<std::string>{"fault_injection"}) << FormatFieldErrors(ValidateConfig(asked));
  asked.allow_fault_injection = true;
  EXPECT_TRUE(ValidateConfig(asked).empty()) << FormatFieldErrors(ValidateConfig(asked));
}

TEST(ConfigMapping, StrictJsonNamesUnknownAndMistypedFields) {
  nsa::v1::RunConfig proto;
  EXPECT_EQ(ParseRunConfigJson(R"({"model": {"nsa": {"windw": 3}}})", &proto),
            "model.nsa.windw: unknown field");
  EXPECT_EQ(ParseRunConfigJson(R"({"bogus": 1})", &proto), "bogus: unknown field");
  EXPECT_NE(ParseRunConfigJson(R"({"batch_size": "eight"})", &proto).find("batch_size"),
            std::string::npos);
  EXPECT_NE(ParseRunConfigJson("[1, 2]", &proto), "");
  EXPECT_EQ(ParseRunConfigJson(R"({"attention_backend": "ATTENTION_BACKEND_CUDA"})", &proto), "");
  EXPECT_EQ(proto.attention_backend(), nsa::v1::ATTENTION_BACKEND_CUDA);
}

TEST(ConfigMapping, UnknownBinaryFieldsFromANewerClientAreFound) {
  nsa::v1::RunConfig proto;
  proto.set_seq_len(8);
  proto.mutable_model()->set_dim(16);
  // Append field 99 (varint) to the nested model message, as a newer client would.
  std::string model_bytes = proto.model().SerializeAsString();
  model_bytes += std::string("\x98\x06\x01", 3);  // tag (99 << 3 | 0) = 792 -> 0x98 0x06
  nsa::v1::ModelConfig model;
  ASSERT_TRUE(model.ParseFromString(model_bytes));
  *proto.mutable_model() = model;
  const auto unknown = UnknownFieldPaths(proto);
  ASSERT_EQ(unknown.size(), 1u);
  EXPECT_EQ(unknown[0], "model.#99");
  EXPECT_TRUE(UnknownFieldPaths(nsa::v1::RunConfig()).empty());
}

TEST(Validation, ReportsEveryBadFieldWithTheValue) {
  TrainConfig config;
  config.data.train_path = "/";
  config.model.dim = -1;
  config.model.nsa.slc_top_n = 2;
  config.optim.beta1 = 1.0f;
  config.device = "cuda:x";
  const auto errors = ValidateConfig(config);
  const std::string all = FormatFieldErrors(errors);
  EXPECT_NE(all.find("model.dim: must be positive (got -1)"), std::string::npos) << all;
  EXPECT_NE(all.find("model.nsa.slc_top_n"), std::string::npos) << all;
  EXPECT_NE(all.find("optim.beta1"), std::string::npos) << all;
  EXPECT_NE(all.find("device"), std::string::npos) << all;
  TrainConfig ok;
  ok.data.train_path = "/";
  EXPECT_TRUE(ValidateConfig(ok).empty()) << FormatFieldErrors(ValidateConfig(ok));
}

// More selection slots than the sequence has selection blocks select nothing more, but the
// reference backend keeps [B, T, groups, n] indices: 100000 of them, at the demo's batch 8 of
// 512 positions in 2 groups, are 819 M indices (3.3 GB as int32, twice that as int64), which
// nothing refused. Up to the kernels' 32, or the sequence's block count, stays allowed.
TEST(Validation, SelectionSlotsAreBoundedByTheSequencesBlocks) {
  TrainConfig config;
  config.data.train_path = "/";
  config.model.nsa.slc_block = 64;
  const auto slots_error = [&](int seq_len, int n) {
    config.seq_len = seq_len;
    config.model.nsa.slc_top_n = n;
    for (const FieldError& e : ValidateConfig(config)) {
      if (e.field == "model.nsa.slc_top_n") return e.message;
    }
    return std::string();
  };
  EXPECT_EQ(slots_error(256, 16), "") << "4 blocks, within the kernels' 32";
  EXPECT_EQ(slots_error(256, 32), "");
  EXPECT_EQ(slots_error(256, 33),
            "must be at most 32 (seq_len 256 has 4 selection blocks of model.nsa.slc_block 64; more slots "
            "select nothing), got 33");
  EXPECT_EQ(slots_error(4096, 64), "") << "64 blocks";
  EXPECT_NE(slots_error(4096, 65).find("must be at most 64"), std::string::npos);
  EXPECT_NE(slots_error(256, 100000).find("got 100000"), std::string::npos);
}

// Each field refuses what would otherwise run with nonsense or fail later without naming it:
// infinities that only the sign was checked for, a device index past int, a name that would
// make every ListRuns reply too large, eval batches that would fill the device.
TEST(Validation, NamesInfinitiesHugeIndicesAndOversizedFields) {
  const auto fields_of = [](const TrainConfig& config) {
    std::vector<std::string> fields;
    for (const auto& e : ValidateConfig(config)) fields.push_back(e.field);
    return fields;
  };
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<std::string, std::function<void(TrainConfig&)>>> cases = {
      {"optim.weight_decay", [&](TrainConfig& c) { c.optim.weight_decay = inf; }},
      {"optim.eps", [&](TrainConfig& c) { c.optim.eps = inf; }},
      {"optim.grad_clip", [&](TrainConfig& c) { c.optim.grad_clip = inf; }},
      {"model.rope_theta", [&](TrainConfig& c) { c.model.rope_theta = inf; }},
      {"model.norm_eps", [&](TrainConfig& c) { c.model.norm_eps = inf; }},
      {"device", [](TrainConfig& c) { c.device = "cuda:2147483648"; }},
      {"device", [](TrainConfig& c) { c.device = "cuda:99999999999999"; }},
      {"name", [](TrainConfig& c) { c.name = std::string(kMaxNameBytes + 1, 'x'); }},
      {"checkpoint_dir", [](TrainConfig& c) { c.checkpoint_dir = std::string(kMaxPathBytes + 1, 'x'); }},
      {"eval_batches", [](TrainConfig& c) { c.eval_batches = 2000000000; }},
  };
  for (const auto& [field, spoil] : cases) {
    TrainConfig config;
    config.data.train_path = "/";
    spoil(config);
    EXPECT_EQ(fields_of(config), std::vector<std::string>{field}) << FormatFieldErrors(ValidateConfig(config));
  }
  TrainConfig at_the_limits;
  at_the_limits.data.train_path = "/";
  at_the_limits.device = "cuda:9999";
  at_the_limits.name = std::string(kMaxNameBytes, 'x');
  at_the_limits.eval_batches = static_cast<int>(kMaxEvalBatches);
  EXPECT_TRUE(ValidateConfig(at_the_limits).empty()) << FormatFieldErrors(ValidateConfig(at_the_limits));
}

TEST(RuntimePlan, AutoPicksWhatTheMachineOffersAndExplicitRequestsAreChecked) {
  TrainConfig config;
  config.model.head_dim = 64;  // a shape the kernels take (the default, 32, is not)
  const RuntimeCapabilities cpu_only{0, false};
  const RuntimeCapabilities gpu{1, true};
  const RuntimeCapabilities gpu_without_kernels{2, false};

  auto plan = PlanRuntime(config, cpu_only);
  EXPECT_EQ(plan.device, "cpu");
  EXPECT_EQ(plan.backend, AttentionBackend::kReference);
  plan = PlanRuntime(config, gpu);
  EXPECT_EQ(plan.device, "cuda:0");
  EXPECT_EQ(plan.backend, AttentionBackend::kCuda);
  plan = PlanRuntime(config, gpu_without_kernels);
  EXPECT_EQ(plan.backend, AttentionBackend::kReference);
  EXPECT_TRUE(plan.errors.empty());

  config.attention_backend = AttentionBackend::kCuda;
  plan = PlanRuntime(config, gpu_without_kernels);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "attention_backend");
  config.device = "cpu";
  plan = PlanRuntime(config, gpu);
  ASSERT_EQ(plan.errors.size(), 1u) << "cuda kernels on a cpu device";
  EXPECT_EQ(plan.errors[0].field, "attention_backend");

  config.attention_backend = AttentionBackend::kReference;
  config.device = "cuda:1";
  plan = PlanRuntime(config, gpu);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "device");
  plan = PlanRuntime(config, gpu_without_kernels);
  EXPECT_TRUE(plan.errors.empty());
  EXPECT_EQ(plan.device, "cuda:1");
  EXPECT_EQ(plan.backend, AttentionBackend::kReference) << "reference runs anywhere";
}

// A model's float32 weights, gradients and AdamW moments (16 bytes a parameter) must fit the
// memory of each device the run goes on: the GPU it names, every GPU of a data-parallel run
// (each holds a replica), the host for the CPU. Unprobed memory checks nothing.
TEST(RuntimePlan, TheTrainingStateMustFitEachOfTheRunsDevices) {
  TrainConfig config = M7cTrainConfig();  // 125 M parameters: 1.9 GiB of state
  config.cuda_graphs = false;
  const double need = TrainingStateBytes(config.model);
  EXPECT_EQ(need, 16 * ParameterCount(config.model));
  const auto gib = [](double g) { return static_cast<int64_t>(g * 1024 * 1024 * 1024); };
  RuntimeCapabilities caps{2, true, true};
  caps.cuda_memory_bytes = {gib(80), gib(1.5)};
  caps.host_memory_bytes = gib(1);

  EXPECT_TRUE(PlanRuntime(config, caps).errors.empty()) << "auto: cuda:0, 80 GiB";
  config.device = "cuda:1";
  auto plan = PlanRuntime(config, caps);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "model");
  EXPECT_NE(plan.errors[0].message.find("1.9 GiB for their float32 weights, gradients and AdamW moments alone, "
                                        "more than cuda:1's 1.5 GiB (model.vocab_size 50304, model.dim 768, "
                                        "model.n_layers 12)"),
            std::string::npos)
      << plan.errors[0].message;
  config.device = "auto";
  config.world_size = 2;  // cuda:0 and cuda:1, each with all of it
  plan = PlanRuntime(config, caps);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_NE(plan.errors[0].message.find("cuda:1's"), std::string::npos) << plan.errors[0].message;
  config.world_size = 1;
  config.device = "cpu";
  config.attention_backend = AttentionBackend::kReference;
  plan = PlanRuntime(config, caps);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_NE(plan.errors[0].message.find("the host's 1.0 GiB"), std::string::npos) << plan.errors[0].message;
  caps.host_memory_bytes = static_cast<int64_t>(need);  // exactly enough
  EXPECT_TRUE(PlanRuntime(config, caps).errors.empty());

  const RuntimeCapabilities unprobed{1, true, true};
  config.model.n_layers = 1000000;
  EXPECT_TRUE(PlanRuntime(config, unprobed).errors.empty());
  config.device = "cuda:0";
  EXPECT_TRUE(PlanRuntime(config, unprobed).errors.empty());
}

// cuda_graphs: strict JSON, shown in the effective config, and refused at StartRun (by
// name) unless the run gets a CUDA device and the CUDA attention backend.
TEST(RuntimePlan, CudaGraphsNeedTheCudaBackend) {
  nsa::v1::RunConfig proto;
  ASSERT_EQ(ParseRunConfigJson(R"({"cuda_graphs": true})", &proto), "");
  TrainConfig config = FromProto(proto);
  config.model.head_dim = 64;  // a shape the kernels take
  EXPECT_TRUE(config.cuda_graphs);
  EXPECT_TRUE(ToProto(config).cuda_graphs());
  EXPECT_FALSE(FromProto(nsa::v1::RunConfig()).cuda_graphs) << "off by default";
  EXPECT_TRUE(ToProto(FromProto(nsa::v1::RunConfig())).has_cuda_graphs())
      << "the effective config shows it";
  EXPECT_NE(ParseRunConfigJson(R"({"cuda_graph": true})", &proto).find("cuda_graph"), std::string::npos)
      << "strict: a misspelt field is refused by name";

  const RuntimeCapabilities cpu_only{0, false};
  const RuntimeCapabilities gpu{1, true};
  EXPECT_TRUE(PlanRuntime(config, gpu).errors.empty());
  auto plan = PlanRuntime(config, cpu_only);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "cuda_graphs");
  EXPECT_NE(plan.errors[0].message.find("cpu"), std::string::npos) << plan.errors[0].message;
  config.attention_backend = AttentionBackend::kReference;
  plan = PlanRuntime(config, gpu);
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "cuda_graphs");
  config.cuda_graphs = false;
  EXPECT_TRUE(PlanRuntime(config, cpu_only).errors.empty());
}

// The shipped config files parse strictly, validate (data paths aside), and m7c_125m.json
// describes exactly the run the engine, the benchmarks and the tests call m7c
// (M7cTrainConfig: its model, its optimizer, its schedule).
TEST(ShippedConfigs, ParseAndM7cMatchesTheEngine) {
  for (const std::string name : {"demo", "m7c_125m"}) {
    std::ifstream in(std::string(NSAD_SOURCE_DIR) + "/configs/" + name + ".json");
    ASSERT_TRUE(in) << name;
    std::stringstream json;
    json << in.rdbuf();
    nsa::v1::RunConfig proto;
    ASSERT_EQ(ParseRunConfigJson(json.str(), &proto), "") << name;
    TrainConfig config = FromProto(proto);
    EXPECT_FALSE(config.data.train_path.empty()) << name;
    config.data.train_path = "/";  // shards are not part of the repository
    config.data.val_path = "";
    EXPECT_EQ(FormatFieldErrors(ValidateConfig(config)), "") << name;
    if (name != "m7c_125m") continue;
    const TrainConfig m7c = M7cTrainConfig();
    const ModelConfig& model = m7c.model;
    EXPECT_EQ(config.name, m7c.name);
    EXPECT_EQ(config.model.vocab_size, model.vocab_size);
    EXPECT_EQ(config.model.dim, model.dim);
    EXPECT_EQ(config.model.n_layers, model.n_layers);
    EXPECT_EQ(config.model.n_heads, model.n_heads);
    EXPECT_EQ(config.model.n_kv_groups, model.n_kv_groups);
    EXPECT_EQ(config.model.head_dim, model.head_dim);
    EXPECT_EQ(EffectiveMlpHidden(config.model), EffectiveMlpHidden(model));
    EXPECT_EQ(config.model.rope_theta, model.rope_theta);
    EXPECT_EQ(config.model.norm_eps, model.norm_eps);
    EXPECT_EQ(config.model.nsa.cmp_block, model.nsa.cmp_block);
    EXPECT_EQ(config.model.nsa.cmp_stride, model.nsa.cmp_stride);
    EXPECT_EQ(config.model.nsa.slc_block, model.nsa.slc_block);
    EXPECT_EQ(config.model.nsa.slc_top_n, model.nsa.slc_top_n);
    EXPECT_EQ(config.model.nsa.window, model.nsa.window);
    EXPECT_EQ(config.optim.lr, m7c.optim.lr);
    EXPECT_EQ(config.optim.min_lr, m7c.optim.min_lr);
    EXPECT_EQ(config.optim.weight_decay, m7c.optim.weight_decay);
    EXPECT_EQ(config.optim.beta1, m7c.optim.beta1);
    EXPECT_EQ(config.optim.beta2, m7c.optim.beta2);
    EXPECT_EQ(config.optim.eps, m7c.optim.eps);
    EXPECT_EQ(config.optim.warmup_steps, m7c.optim.warmup_steps);
    EXPECT_EQ(config.optim.grad_clip, m7c.optim.grad_clip);
    EXPECT_EQ(config.seq_len, m7c.seq_len);
    EXPECT_EQ(config.batch_size, m7c.batch_size);
    EXPECT_EQ(config.grad_accum, m7c.grad_accum);
    EXPECT_EQ(config.max_steps, m7c.max_steps);
    EXPECT_EQ(config.log_every, m7c.log_every);
    EXPECT_EQ(config.eval_every, m7c.eval_every);
    EXPECT_EQ(config.eval_batches, m7c.eval_batches);
    EXPECT_EQ(config.seed, m7c.seed);
    EXPECT_EQ(config.device, m7c.device);
    EXPECT_EQ(config.dtype, m7c.dtype);
    EXPECT_EQ(config.attention_backend, m7c.attention_backend);
    EXPECT_EQ(config.cuda_graphs, m7c.cuda_graphs);
  }
}

TEST(DaemonOptions, ParsesBothFlagFormsAndRejectsUnknownOnes) {
  DaemonOptions options;
  std::string error;
  const char* argv[] = {"nsad", "--listen=0.0.0.0:1", "--state-dir", "/tmp/s", "--metrics", "off"};
  ASSERT_TRUE(ParseDaemonOptions(6, const_cast<char**>(argv), &options, &error)) << error;
  EXPECT_EQ(options.listen_address, "0.0.0.0:1");
  EXPECT_EQ(options.state_dir, "/tmp/s");
  EXPECT_EQ(options.metrics_address, "off");
  const char* bad[] = {"nsad", "--lisen", "x"};
  EXPECT_FALSE(ParseDaemonOptions(3, const_cast<char**>(bad), &options, &error));
  EXPECT_NE(error.find("--lisen"), std::string::npos);
  const char* missing[] = {"nsad", "--state-dir"};
  EXPECT_FALSE(ParseDaemonOptions(2, const_cast<char**>(missing), &options, &error));
  const char* level[] = {"nsad", "--log-level", "loud"};
  EXPECT_FALSE(ParseDaemonOptions(3, const_cast<char**>(level), &options, &error));
}

// A whole-number flag takes 0 .. its most and names itself for anything else.
void ExpectWholeNumberFlag(const char* flag, int most, int DaemonOptions::*field, const std::string& says) {
  DaemonOptions options;
  std::string error;
  const std::string top = std::to_string(most), past = std::to_string(most + 1);
  for (const std::string& text : {std::string("0"), std::string("2"), top}) {
    const char* argv[] = {"nsad", flag, text.c_str()};
    ASSERT_TRUE(ParseDaemonOptions(3, const_cast<char**>(argv), &options, &error)) << text << ": " << error;
    EXPECT_EQ(options.*field, std::stoi(text));
  }
  for (const std::string& text : {std::string("-1"), std::string("1.5"), past, std::string("99999999999"),
                                  std::string("soon")}) {
    const char* argv[] = {"nsad", flag, text.c_str()};
    EXPECT_FALSE(ParseDaemonOptions(3, const_cast<char**>(argv), &options, &error)) << text;
    EXPECT_EQ(error, std::string(flag) + " must be " + says + " from 0 to " + top + " (got \"" + text + "\")");
  }
}

TEST(DaemonOptions, HaltTimeoutIsWholeSecondsUpToADay) {
  EXPECT_EQ(DaemonOptions().halt_timeout_seconds, 60);
  ExpectWholeNumberFlag("--halt-timeout", 86400, &DaemonOptions::halt_timeout_seconds, "a whole number of seconds");
}

TEST(DaemonOptions, RunsPerGpuIsAWholeNumberUpToAThousand) {
  EXPECT_EQ(DaemonOptions().runs_per_gpu, 0) << "no limit unless asked";
  ExpectWholeNumberFlag("--runs-per-gpu", 1000, &DaemonOptions::runs_per_gpu, "a whole number");
}

}  // namespace
}  // namespace nsad::server
