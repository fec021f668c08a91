// End-to-end: the real nsad daemon, driven over gRPC (and /metrics over HTTP) with a tiny
// NSA model training on CPU. Every RPC carries a deadline; every wait is bounded.
#include <curl/curl.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "daemon_fixture.h"
#include "data/shard.h"
#include "nsa/v1/run_state.h"

namespace nsad::testing {
namespace {

using nsa::v1::RunState;

// A tiny model so steps take milliseconds; max_steps is large so runs do not end on their own.
nsa::v1::RunConfig TinyConfig(const fs::path& shards) {
  nsa::v1::RunConfig c;
  c.set_name("tiny");
  auto* m = c.mutable_model();
  m->set_vocab_size(256);
  m->set_dim(32);
  m->set_n_layers(1);
  m->set_n_heads(2);
  m->set_n_kv_groups(1);
  m->set_head_dim(16);
  auto* n = m->mutable_nsa();
  n->set_cmp_block(8);
  n->set_cmp_stride(4);
  n->set_slc_block(16);
  n->set_slc_top_n(4);
  n->set_window(32);
  c.mutable_data()->set_train_path(shards.string());
  c.set_seq_len(64);
  c.set_batch_size(2);
  c.set_max_steps(1000000);
  c.set_device("cpu");
  c.set_eval_every(0);
  c.mutable_optim()->set_lr(3e-3f);
  c.mutable_optim()->set_warmup_steps(5);
  return c;
}

// `config` on `world_size` workers: with more than one, data parallel on cuda:0, cuda:1, ...
// on the reference backend (which takes TinyConfig's head_dim).
nsa::v1::RunConfig OnWorkers(nsa::v1::RunConfig config, int world_size) {
  if (world_size > 1) {
    config.set_device("auto");
    config.set_attention_backend(nsa::v1::ATTENTION_BACKEND_REFERENCE);
    config.set_world_size(world_size);
  }
  return config;
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = MakeTempDir("nsad-daemon-test");
    // Structured text: a repeating phrase, so a model can learn it quickly.
    const std::string phrase = "the quick brown fox jumps over the lazy dog. ";
    std::vector<uint32_t> tokens;
    for (int i = 0; i < 400; ++i) {
      for (unsigned char ch : phrase) tokens.push_back(ch);
    }
    shards_ = dir_ / "shards";
    fs::create_directories(shards_);
    data::WriteShard((shards_ / "tiny_train_000000.bin").string(), tokens, data::TokenWidth::kUint16);
    daemon_ = std::make_unique<Daemon>(dir_ / "state");
  }
  void TearDown() override {
    daemon_.reset();
    fs::remove_all(dir_);
  }

  grpc::Status Start(const nsa::v1::RunConfig& config, nsa::v1::RunInfo* run) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::StartRunRequest request;
    *request.mutable_config() = config;
    nsa::v1::StartRunResponse response;
    auto status = daemon_->stub().StartRun(&ctx, request, &response);
    *run = response.run();
    return status;
  }
  grpc::Status StartJson(const std::string& json) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::StartRunRequest request;
    request.set_config_json(json);
    nsa::v1::StartRunResponse response;
    return daemon_->stub().StartRun(&ctx, request, &response);
  }
  nsa::v1::RunInfo Get(const std::string& id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::RunRequest request;
    request.set_run_id(id);
    nsa::v1::RunResponse response;
    auto status = daemon_->stub().GetRun(&ctx, request, &response);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return response.run();
  }
  using Call = grpc::Status (nsa::v1::Trainer::Stub::*)(grpc::ClientContext*,
                                                          const nsa::v1::RunRequest&,
                                                          nsa::v1::RunResponse*);
  grpc::Status Control(Call call, const std::string& id, nsa::v1::RunInfo* run = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::RunRequest request;
    request.set_run_id(id);
    nsa::v1::RunResponse response;
    auto status = (daemon_->stub().*call)(&ctx, request, &response);
    if (run) *run = response.run();
    return status;
  }
  grpc::Status Halt(const std::string& id, const std::string& reason) {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::HaltRunRequest request;
    request.set_run_id(id);
    request.set_reason(reason);
    nsa::v1::RunResponse response;
    return daemon_->stub().HaltRun(&ctx, request, &response);
  }
  bool WaitForState(const std::string& id, RunState state, int seconds = 120) {
    return WaitFor([&] { return Get(id).state() == state; }, std::chrono::seconds(seconds));
  }
  bool WaitForStep(const std::string& id, int64_t step, int seconds = 120) {
    return WaitFor([&] { return Get(id).progress().step() >= step; }, std::chrono::seconds(seconds));
  }
  // A tiny run on `world_size` workers (OnWorkers) checkpointing into dir_/checkpoints every
  // 2 steps, once its first checkpoint is recorded; a start this machine refuses (fewer GPUs
  // than workers) returns a run without an id, for the caller to skip.
  nsa::v1::RunInfo StartCheckpointingRun(int world_size = 1) {
    auto config = OnWorkers(TinyConfig(shards_), world_size);
    config.set_checkpoint_every(2);
    config.set_checkpoint_dir((dir_ / "checkpoints").string());
    nsa::v1::RunInfo run;
    const auto status = Start(config, &run);
    if (world_size > 1 && !status.ok()) return {};
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(WaitFor([&] { return !Get(run.run_id()).progress().last_checkpoint().empty(); },
                        std::chrono::seconds(120)));
    return run;
  }
  // The run once it has ended (halted, completed or failed), or as it stands after `seconds`.
  nsa::v1::RunInfo Ended(const std::string& id, int seconds = 300) {
    WaitFor([&] { return Get(id).state() >= nsa::v1::HALTED; }, std::chrono::seconds(seconds));
    return Get(id);
  }

  fs::path dir_;
  fs::path shards_;
  std::unique_ptr<Daemon> daemon_;
};

TEST_F(DaemonTest, StartWatchPauseResumeHalt) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  const std::string id = run.run_id();
  EXPECT_EQ(id.rfind("run-", 0), 0u) << "server-assigned ids look like run-000001: " << id;
  EXPECT_EQ(run.state(), nsa::v1::PENDING);

  // Watch: the first event is the current state; later ones carry increasing sequences
  // and steps as the run trains.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline(120));
    nsa::v1::WatchRunRequest request;
    request.set_run_id(id);
    auto reader = daemon_->stub().WatchRun(&ctx, request);
    nsa::v1::RunEvent event;
    int64_t last_sequence = -1;
    int64_t max_step = 0;
    while (max_step < 3 && reader->Read(&event)) {
      EXPECT_GT(event.sequence(), last_sequence);
      last_sequence = event.sequence();
      max_step = std::max(max_step, event.progress().step());
    }
    EXPECT_GE(max_step, 3) << "watch should report training progress";
    ctx.TryCancel();
    reader->Finish();
  }
  ASSERT_EQ(Get(id).state(), nsa::v1::RUNNING);

  nsa::v1::RunInfo paused;
  ASSERT_TRUE(Control(&nsa::v1::Trainer::Stub::PauseRun, id, &paused).ok());
  EXPECT_TRUE(paused.state() == nsa::v1::PAUSING || paused.state() == nsa::v1::PAUSED);
  ASSERT_TRUE(WaitForState(id, nsa::v1::PAUSED, 60));
  const int64_t step_at_pause = Get(id).progress().step();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  EXPECT_EQ(Get(id).progress().step(), step_at_pause) << "a paused run must not step";

  // Pausing a paused run is a precondition failure, and it names the state.
  auto again = Control(&nsa::v1::Trainer::Stub::PauseRun, id);
  EXPECT_EQ(again.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(again.error_message().find("PAUSED"), std::string::npos) << again.error_message();

  nsa::v1::RunInfo resumed;
  ASSERT_TRUE(Control(&nsa::v1::Trainer::Stub::ResumeRun, id, &resumed).ok());
  EXPECT_EQ(resumed.state(), nsa::v1::RUNNING);
  ASSERT_TRUE(WaitForStep(id, step_at_pause + 2)) << "a resumed run steps again";
  EXPECT_EQ(Control(&nsa::v1::Trainer::Stub::ResumeRun, id).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  ASSERT_TRUE(Halt(id, "test says stop").ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::HALTED, 60));
  const auto halted = Get(id);
  EXPECT_EQ(halted.message(), "test says stop");
  const int64_t final_step = halted.progress().step();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  EXPECT_EQ(Get(id).progress().step(), final_step);
  EXPECT_EQ(Halt(id, "again").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(Control(&nsa::v1::Trainer::Stub::PauseRun, id).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  // Gates and throughput of a run that trained.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::RunRequest request;
    request.set_run_id(id);
    nsa::v1::InspectGatesResponse gates;
    ASSERT_TRUE(daemon_->stub().InspectGates(&ctx, request, &gates).ok());
    ASSERT_EQ(gates.layers_size(), 1);
    for (double g : {gates.layers(0).mean().cmp(), gates.layers(0).mean().slc(),
                     gates.layers(0).mean().win()}) {
      EXPECT_GT(g, 0.0);
      EXPECT_LT(g, 1.0);
    }
    EXPECT_GT(gates.layers(0).mean_selected_blocks(), 0.0);
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::RunRequest request;
    request.set_run_id(id);
    nsa::v1::GetThroughputResponse tput;
    ASSERT_TRUE(daemon_->stub().GetThroughput(&ctx, request, &tput).ok());
    EXPECT_GT(tput.tokens_per_second(), 0.0);
    EXPECT_EQ(tput.tokens_seen(), final_step * 64 * 2);
    // The window holds every step this daemon ran, up to 100; under 100 steps it covers the
    // whole run, so its rate is the run's mean (tokens over summed step time).
    EXPECT_EQ(tput.recent_steps(), std::min<int64_t>(final_step, 100));
    EXPECT_GT(tput.recent_tokens_per_second(), 0.0);
    if (final_step <= 100) {
      EXPECT_NEAR(tput.recent_tokens_per_second(), tput.mean_tokens_per_second(),
                  1e-6 * tput.mean_tokens_per_second());
    }
    EXPECT_GT(tput.data_seconds(), 0.0);  // the last step's batch, through the worker
    EXPECT_LT(tput.data_seconds(), tput.step_seconds());
  }
}

TEST_F(DaemonTest, RunsToCompletionLearnsAndReportsEffectiveConfig) {
  auto config = TinyConfig(shards_);
  config.set_max_steps(60);
  config.set_eval_every(30);
  config.mutable_model()->clear_nsa();  // defaults must be filled in and reported
  config.mutable_model()->mutable_nsa()->set_window(32);
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(config, &run).ok());

  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline(300));
  nsa::v1::WatchRunRequest request;
  request.set_run_id(run.run_id());
  auto reader = daemon_->stub().WatchRun(&ctx, request);
  nsa::v1::RunEvent event;
  double first_loss = NAN;
  RunState last_state = nsa::v1::RUN_STATE_UNSPECIFIED;
  while (reader->Read(&event)) {
    if (std::isnan(first_loss) && event.progress().step() > 0) first_loss = event.progress().loss();
    last_state = event.state();
  }
  ASSERT_TRUE(reader->Finish().ok()) << "the stream ends by itself when the run completes";
  EXPECT_EQ(last_state, nsa::v1::COMPLETED);

  const auto done = Get(run.run_id());
  EXPECT_EQ(done.state(), nsa::v1::COMPLETED);
  EXPECT_EQ(done.progress().step(), 60);
  EXPECT_LT(done.progress().loss(), first_loss * 0.7)
      << "loss should fall on a repeated phrase: " << first_loss << " -> " << done.progress().loss();
  EXPECT_TRUE(std::isfinite(done.progress().val_loss()));
  EXPECT_EQ(done.progress().val_step(), 60);
  // Effective config: every default filled in.
  EXPECT_EQ(done.config().model().nsa().cmp_block(), 32);
  EXPECT_EQ(done.config().model().nsa().slc_top_n(), 16);
  EXPECT_EQ(done.config().model().nsa().window(), 32);
  EXPECT_TRUE(done.config().optim().has_beta2());
  EXPECT_EQ(done.device(), "cpu");
  EXPECT_EQ(done.attention_backend(), nsa::v1::ATTENTION_BACKEND_REFERENCE)
      << "on a CPU, auto resolves to the reference backend";
  EXPECT_GT(done.parameter_count(), 0);
}

// Every bad config is INVALID_ARGUMENT naming the field, and the daemon keeps serving.
TEST_F(DaemonTest, BadConfigsAreRejectedByField) {
  struct Case {
    std::string name;
    std::function<void(nsa::v1::RunConfig&)> mutate;
    std::string field;
  };
  const std::vector<Case> cases = {
      {"negative dim", [](auto& c) { c.mutable_model()->set_dim(-8); }, "model.dim"},
      {"zero seq_len", [](auto& c) { c.set_seq_len(0); }, "seq_len"},
      {"negative seq_len", [](auto& c) { c.set_seq_len(-5); }, "seq_len"},
      {"negative batch", [](auto& c) { c.set_batch_size(-1); }, "batch_size"},
      {"negative window", [](auto& c) { c.mutable_model()->mutable_nsa()->set_window(-1); },
       "model.nsa.window"},
      {"heads not divisible", [](auto& c) { c.mutable_model()->set_n_kv_groups(3); },
       "model.n_kv_groups"},
      {"missing data path", [](auto& c) { c.mutable_data()->clear_train_path(); }, "data.train_path"},
      {"data path does not exist",
       [](auto& c) { c.mutable_data()->set_train_path("/nonexistent/shards"); }, "data.train_path"},
      {"bad dtype", [](auto& c) { c.set_dtype("float8"); }, "dtype"},
      {"bad device", [](auto& c) { c.set_device("tpu"); }, "device"},
      {"cuda backend on cpu",
       [](auto& c) { c.set_attention_backend(nsa::v1::ATTENTION_BACKEND_CUDA); }, "attention_backend"},
      {"no workers", [](auto& c) { c.set_world_size(0); }, "world_size"},
      {"data parallel on the cpu", [](auto& c) { c.set_world_size(2); }, "world_size"},
      {"a backend this daemon does not know (a newer client's)",
       [](auto& c) { c.set_attention_backend(static_cast<nsa::v1::AttentionBackend>(7)); }, "attention_backend"},
      {"device index past int", [](auto& c) { c.set_device("cuda:2147483648"); }, "device"},
  };
  for (const auto& tc : cases) {
    auto config = TinyConfig(shards_);
    tc.mutate(config);
    nsa::v1::RunInfo run;
    const auto status = Start(config, &run);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << tc.name;
    EXPECT_NE(status.error_message().find(tc.field), std::string::npos)
        << tc.name << ": message should name " << tc.field << ": " << status.error_message();
  }

  // Unknown fields in JSON are named, not dropped.
  auto status = StartJson(R"({"seq_len": 64, "model": {"dimm": 64}})");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("model.dimm"), std::string::npos) << status.error_message();
  status = StartJson(R"({"seq_len": "long"})");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("seq_len"), std::string::npos) << status.error_message();
  status = StartJson("{not json");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  status = StartJson("");
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);

  // Empty request, unknown run, empty run id.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::StartRunResponse response;
    EXPECT_EQ(daemon_->stub().StartRun(&ctx, nsa::v1::StartRunRequest(), &response).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
  }
  EXPECT_EQ(Control(&nsa::v1::Trainer::Stub::GetRun, "run-999999").error_code(),
            grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Control(&nsa::v1::Trainer::Stub::PauseRun, "").error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);

  // Nothing was created, and the daemon still serves.
  ASSERT_TRUE(daemon_->Alive());
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  nsa::v1::ListRunsResponse list;
  ASSERT_TRUE(daemon_->stub().ListRuns(&ctx, nsa::v1::ListRunsRequest(), &list).ok());
  EXPECT_EQ(list.runs_size(), 0);
  nsa::v1::RunInfo run;
  EXPECT_TRUE(Start(TinyConfig(shards_), &run).ok());
}

size_t AppendToString(char* data, size_t size, size_t count, void* out) {
  static_cast<std::string*>(out)->append(data, size * count);
  return size * count;
}

// GET, or POST when `post_body` is given; bounded by a 10 s timeout.
std::string Http(const std::string& url, long* code, const std::string* post_body = nullptr) {
  std::string body;
  CURL* curl = curl_easy_init();
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_slist* headers = nullptr;
  if (post_body) {
    headers = curl_slist_append(headers, "Content-Type: application/json");
    curl_easy_setopt(curl, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl, CURLOPT_POSTFIELDS, post_body->c_str());
  }
  curl_easy_setopt(curl, CURLOPT_TIMEOUT, 10L);
  curl_easy_setopt(curl, CURLOPT_WRITEFUNCTION, AppendToString);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
  const CURLcode rc = curl_easy_perform(curl);
  *code = 0;
  if (rc == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, code);
  curl_easy_cleanup(curl);
  curl_slist_free_all(headers);
  return body;
}

// Value of the first sample line starting with `series` ("name{labels}"), NaN if absent.
double Sample(const std::string& body, const std::string& series) {
  std::istringstream in(body);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(series, 0) == 0) return std::stod(line.substr(line.rfind(' ') + 1));
  }
  return NAN;
}

TEST_F(DaemonTest, MetricsAreScrapedWithSaneValues) {
  ASSERT_GT(daemon_->metrics_port(), 0);
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  const std::string id = run.run_id();
  ASSERT_TRUE(WaitForStep(id, 3));
  ASSERT_TRUE(Control(&nsa::v1::Trainer::Stub::PauseRun, id).ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::PAUSED, 60));
  const auto info = Get(id);

  long code = 0;
  const std::string body =
      Http("http://127.0.0.1:" + std::to_string(daemon_->metrics_port()) + "/metrics", &code);
  ASSERT_EQ(code, 200);
  const std::string run_label = "run_id=\"" + id + "\"";
  EXPECT_EQ(Sample(body, "nsad_run_step{" + run_label + "}"), info.progress().step());
  const double loss = Sample(body, "nsad_run_loss{" + run_label + "}");
  EXPECT_TRUE(std::isfinite(loss) && loss > 0 && loss < 10) << loss;
  const double tps = Sample(body, "nsad_run_tokens_per_second{attention_backend=\"reference\"," + run_label + "}");
  EXPECT_GT(tps, 0) << body;
  const double data = Sample(body, "nsad_run_data_seconds{" + run_label + "}");
  EXPECT_GT(data, 0) << body;
  EXPECT_LT(data, 60) << body;
  EXPECT_EQ(Sample(body, "nsad_run_tokens_total{" + run_label + "}"), info.progress().tokens_seen());
  EXPECT_EQ(Sample(body, "nsad_run_state{" + run_label + ",state=\"PAUSED\"}"), 1);
  EXPECT_EQ(Sample(body, "nsad_run_state{" + run_label + ",state=\"RUNNING\"}"), 0);
  EXPECT_EQ(Sample(body, "nsad_runs{state=\"PAUSED\"}"), 1);
  // Where it trains, for dashboards to group runs by GPU.
  EXPECT_EQ(Sample(body, "nsad_run_device_info{attention_backend=\"reference\",device=\"cpu\"," + run_label + "}"), 1);
  const double gate = Sample(body, "nsad_run_gate_mean{branch=\"slc\",layer=\"0\"," + run_label + "}");
  EXPECT_GT(gate, 0);
  EXPECT_LT(gate, 1);

  // An ended run keeps its state row and loses its progress series (they were kept for every
  // run the daemon ever hosted before); resumed, it gets them back with its next step.
  ASSERT_TRUE(Halt(id, "").ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::HALTED, 60));
  const auto scrape = [&] {
    return Http("http://127.0.0.1:" + std::to_string(daemon_->metrics_port()) + "/metrics", &code);
  };
  std::string ended = scrape();
  EXPECT_EQ(Sample(ended, "nsad_run_state{" + run_label + ",state=\"HALTED\"}"), 1);
  EXPECT_EQ(Sample(ended, "nsad_runs{state=\"HALTED\"}"), 1);
  for (const std::string series : {"nsad_run_step{", "nsad_run_loss{", "nsad_run_tokens_per_second{",
                                   "nsad_run_tokens_total{", "nsad_run_lr{", "nsad_run_gate_mean{",
                                   "nsad_run_selected_blocks{", "nsad_run_device_info{"}) {
    EXPECT_EQ(ended.find(series), std::string::npos) << series << " of an ended run:\n" << ended;
  }
  ASSERT_TRUE(Control(&nsa::v1::Trainer::Stub::ResumeRun, id).ok());
  ASSERT_TRUE(WaitForStep(id, Get(id).progress().step() + 1));
  EXPECT_GT(Sample(scrape(), "nsad_run_loss{" + run_label + "}"), 0);
}

// A halt's reason becomes the run's message, kept in its record and sent in every ListRuns
// reply (4 MiB at most for a client). Reasons of megabytes were taken: two of them made
// ListRuns fail for every client from then on, daemon restarts included. Now a reason is
// refused by name above kMaxHaltReasonBytes (nsa/v1/run_state.h), and the run goes on.
TEST_F(DaemonTest, AHaltReasonOfMegabytesIsRefusedByName) {
  nsa::v1::RunInfo first, second;
  ASSERT_TRUE(Start(TinyConfig(shards_), &first).ok());
  ASSERT_TRUE(Start(TinyConfig(shards_), &second).ok());
  ASSERT_TRUE(WaitForStep(first.run_id(), 1) && WaitForStep(second.run_id(), 1));
  const std::string huge(2 << 20, 'x');
  for (const auto& run : {first, second}) {
    const auto status = Halt(run.run_id(), huge);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message().substr(0, 200);
    EXPECT_EQ(status.error_message().substr(0, 7), "reason:") << status.error_message().substr(0, 200);
  }
  EXPECT_EQ(Get(first.run_id()).state(), nsa::v1::RUNNING) << "a refused halt halts nothing";
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(Deadline());
    nsa::v1::ListRunsResponse list;
    const auto status = daemon_->stub().ListRuns(&ctx, nsa::v1::ListRunsRequest(), &list);
    EXPECT_TRUE(status.ok()) << status.error_message();
  }
  const std::string longest(nsa::v1::kMaxHaltReasonBytes, 'y');
  ASSERT_TRUE(Halt(first.run_id(), longest).ok());
  ASSERT_TRUE(Halt(second.run_id(), "").ok());
  EXPECT_EQ(Ended(first.run_id()).message(), longest);
}

// The path an Alertmanager alert takes: webhook -> daemon -> HaltRun, reason recorded.
TEST_F(DaemonTest, AlertmanagerWebhookHaltsTheNamedRun) {
  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state", std::vector<std::string>{"--alert-webhook", "127.0.0.1:0"});
  ASSERT_GT(daemon_->webhook_port(), 0);
  nsa::v1::RunInfo victim, bystander;
  ASSERT_TRUE(Start(TinyConfig(shards_), &victim).ok());
  ASSERT_TRUE(Start(TinyConfig(shards_), &bystander).ok());
  ASSERT_TRUE(WaitForStep(victim.run_id(), 1));

  const std::string payload = R"({"version": "4", "status": "firing", "receiver": "nsad-halt",
    "alerts": [{"status": "firing",
                "labels": {"alertname": "LossSpike", "nsad_action": "halt", "run_id": ")" +
                              victim.run_id() + R"("},
                "annotations": {"summary": "loss tripled"}}]})";
  long code = 0;
  const std::string reply = Http("http://127.0.0.1:" + std::to_string(daemon_->webhook_port()) +
                                     "/alertmanager", &code, &payload);
  EXPECT_EQ(code, 200) << reply;
  ASSERT_TRUE(WaitForState(victim.run_id(), nsa::v1::HALTED, 60));
  const auto halted = Get(victim.run_id());
  EXPECT_NE(halted.message().find("LossSpike"), std::string::npos) << halted.message();
  const auto other = Get(bystander.run_id()).state();
  EXPECT_TRUE(other == nsa::v1::RUNNING || other == nsa::v1::PENDING) << "only the named run halts";

  // A summary longer than a halt's reason may be (kMaxHaltReasonBytes) still halts the run,
  // its reason shortened at a character's boundary (3-byte characters, cut mid-character).
  std::string summary;
  for (int i = 0; i < 2000; ++i) summary += "\u20ac";  // the euro sign, escaped in the JSON
  const std::string long_payload = R"({"alerts": [{"status": "firing",
                "labels": {"alertname": "LossSpike", "nsad_action": "halt", "run_id": ")" +
                                   bystander.run_id() + R"("},
                "annotations": {"summary": ")" + summary + R"("}}]})";
  Http("http://127.0.0.1:" + std::to_string(daemon_->webhook_port()) + "/alertmanager", &code, &long_payload);
  EXPECT_EQ(code, 200);
  ASSERT_TRUE(WaitForState(bystander.run_id(), nsa::v1::HALTED, 60));
  const std::string reason = Get(bystander.run_id()).message();  // a reply that parsed: valid UTF-8
  EXPECT_LE(reason.size(), nsa::v1::kMaxHaltReasonBytes);
  EXPECT_EQ(reason.rfind("alert LossSpike: \xe2\x82\xac", 0), 0u) << reason.substr(0, 40);
  EXPECT_EQ(reason.substr(reason.size() - 6), "\xe2\x82\xac...") << "whole characters, then the ellipsis";
}

// Data parallel over two GPUs, one worker each: the two workers with batch 2 train as one
// worker with batch 4 does (the same global batches, gradients averaged), step for step.
// float32 on the reference backend, so that the only difference is the order of sums.
TEST_F(DaemonTest, TwoGpuWorkersTrainLikeOneWorkerWithTheirBatchesTogether) {
  auto config = TinyConfig(shards_);
  config.set_device("auto");
  config.set_attention_backend(nsa::v1::ATTENTION_BACKEND_REFERENCE);
  config.set_max_steps(4);
  config.set_eval_every(4);
  config.set_world_size(2);
  nsa::v1::RunInfo parallel;
  const auto status = Start(config, &parallel);
  if (!status.ok()) {
    // Without two GPUs (or NCCL) the run is refused up front, naming the field.
    ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    ASSERT_NE(status.error_message().find("world_size"), std::string::npos) << status.error_message();
    GTEST_SKIP() << "needs two CUDA devices: " << status.error_message();
  }
  config.set_world_size(1);
  config.set_batch_size(4);
  nsa::v1::RunInfo single;
  ASSERT_TRUE(Start(config, &single).ok());
  const auto p = Ended(parallel.run_id()), s = Ended(single.run_id());
  ASSERT_EQ(p.state(), nsa::v1::COMPLETED) << p.message();
  ASSERT_EQ(s.state(), nsa::v1::COMPLETED) << s.message();
  EXPECT_EQ(p.device(), "cuda:0,cuda:1");
  EXPECT_EQ(s.device(), "cuda:0");
  EXPECT_EQ(p.config().world_size(), 2) << "the effective config records the workers";
  EXPECT_EQ(p.progress().tokens_seen(), s.progress().tokens_seen());
  EXPECT_EQ(p.progress().tokens_seen(), 4 * 4 * 64);
  // Rows split wrongly would change the loss; gradients summed or not exchanged would
  // change the norm; a different update would change the validation loss after it.
  EXPECT_NEAR(p.progress().loss(), s.progress().loss(), 1e-4 * s.progress().loss());
  EXPECT_NEAR(p.progress().grad_norm(), s.progress().grad_norm(), 1e-3 * s.progress().grad_norm());
  EXPECT_NEAR(p.progress().val_loss(), s.progress().val_loss(), 1e-4 * s.progress().val_loss());
  EXPECT_EQ(p.progress().val_step(), 4);
  // Rank 0 alone writes checkpoints; each worker has its own log.
  EXPECT_FALSE(p.progress().last_checkpoint().empty());
  const fs::path run_dir = fs::path(p.config().checkpoint_dir()).parent_path();
  EXPECT_TRUE(fs::exists(run_dir / "worker.log"));
  EXPECT_TRUE(fs::exists(run_dir / "worker-1.log"));
}

// TinyConfig on the GPU in a shape the CUDA kernels take, with CUDA graphs (which need them).
nsa::v1::RunConfig GraphedGpuConfig(const fs::path& shards) {
  auto config = TinyConfig(shards);
  auto* model = config.mutable_model();
  model->set_dim(64);
  model->set_n_heads(4);
  model->set_n_kv_groups(2);
  model->set_head_dim(64);
  auto* nsa = model->mutable_nsa();
  nsa->set_cmp_block(16);
  nsa->set_cmp_stride(8);
  nsa->set_slc_block(32);
  nsa->set_slc_top_n(4);
  nsa->set_window(64);
  config.set_seq_len(128);
  config.set_device("auto");
  config.set_attention_backend(nsa::v1::ATTENTION_BACKEND_CUDA);
  config.set_cuda_graphs(true);
  return config;
}

// Runs whose device is "auto" go on the GPUs the fewest live runs hold; before, every one went
// on cuda:0 however many GPUs stood idle. A run on the second GPU, named or placed, trains as
// on the first (eager steps launched the NSA kernels on cuda:0's stream for a run on cuda:1,
// "CUDA error: invalid argument"; captured ones ran on the graph's stream), and an ended run's
// GPU is free again.
TEST_F(DaemonTest, RunsWithDeviceAutoGoOnTheGpusTheFewestRunsHold) {
  auto config = GraphedGpuConfig(shards_);
  config.set_max_steps(6);
  config.set_cuda_graphs(false);
  auto named = config;
  named.set_device("cuda:1");
  nsa::v1::RunInfo on_second;
  const auto status = Start(named, &on_second);
  if (!status.ok()) {
    // Only the machine may refuse it: fewer than two GPUs, or no kernels.
    ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    GTEST_SKIP() << "needs two CUDA devices and the kernels: " << status.error_message();
  }
  nsa::v1::RunInfo automatic;
  ASSERT_TRUE(Start(config, &automatic).ok());
  EXPECT_EQ(automatic.device(), "cuda:0") << "placed at the start, before its worker reports";
  const auto n = Ended(on_second.run_id()), a = Ended(automatic.run_id());
  ASSERT_EQ(n.state(), nsa::v1::COMPLETED) << n.message();
  ASSERT_EQ(a.state(), nsa::v1::COMPLETED) << a.message();
  EXPECT_EQ(n.device(), "cuda:1");
  EXPECT_EQ(a.device(), "cuda:0");
  EXPECT_NEAR(n.progress().loss(), a.progress().loss(), 2e-3 * a.progress().loss());
  EXPECT_NEAR(n.progress().grad_norm(), a.progress().grad_norm(), 2e-2 * a.progress().grad_norm());

  // Both GPUs free again: the first run takes cuda:0, the next one, while it runs, cuda:1.
  config.set_cuda_graphs(true);
  nsa::v1::RunInfo first, second;
  ASSERT_TRUE(Start(config, &first).ok());
  ASSERT_TRUE(Start(config, &second).ok());
  EXPECT_EQ(first.device(), "cuda:0");
  EXPECT_EQ(second.device(), "cuda:1");
  const auto f = Ended(first.run_id()), s = Ended(second.run_id());
  ASSERT_EQ(f.state(), nsa::v1::COMPLETED) << f.message();
  ASSERT_EQ(s.state(), nsa::v1::COMPLETED) << s.message();
  EXPECT_EQ(s.device(), "cuda:1") << "as its worker reports it";
  EXPECT_NEAR(s.progress().loss(), f.progress().loss(), 2e-3 * f.progress().loss());
}

// A data-parallel run with device auto takes the GPUs the fewest live runs hold, not cuda:0 and
// cuda:1 whatever runs there: beside a run on cuda:0 it trains on cuda:1 and cuda:2 (its ranks'
// NCCL group on GPUs that do not start at 0). Needs three GPUs (not run yet: the lent machines
// have one or two).
TEST_F(DaemonTest, ADataParallelAutoRunTakesTheGpusTheFewestRunsHold) {
  auto busy = GraphedGpuConfig(shards_);
  busy.set_cuda_graphs(false);
  busy.set_max_steps(1000000);
  busy.set_device("cuda:2");
  nsa::v1::RunInfo probe;
  if (!Start(busy, &probe).ok()) GTEST_SKIP() << "needs three CUDA devices and the kernels";
  ASSERT_TRUE(Halt(probe.run_id(), "only asked how many GPUs there are").ok());
  ASSERT_EQ(Ended(probe.run_id()).state(), nsa::v1::HALTED);
  busy.set_device("cuda:0");
  nsa::v1::RunInfo on_first;
  ASSERT_TRUE(Start(busy, &on_first).ok());
  auto config = OnWorkers(TinyConfig(shards_), 2);
  config.set_max_steps(4);
  nsa::v1::RunInfo parallel;
  ASSERT_TRUE(Start(config, &parallel).ok());
  EXPECT_EQ(parallel.device(), "cuda:1,cuda:2");
  const auto p = Ended(parallel.run_id());
  EXPECT_EQ(p.state(), nsa::v1::COMPLETED) << p.message();
  EXPECT_EQ(p.device(), "cuda:1,cuda:2") << "as its workers report it";
  EXPECT_TRUE(std::isfinite(p.progress().loss()));
  ASSERT_TRUE(Halt(on_first.run_id(), "done").ok());
  EXPECT_EQ(Ended(on_first.run_id()).state(), nsa::v1::HALTED);
}

// With --runs-per-gpu 1 a run whose GPU already holds a run waits PENDING (no worker started)
// and starts when that run ends, first come first served; halted while it waits, it ends at
// once. Before, every run started at once and shared the GPU, and its memory, with the others.
TEST_F(DaemonTest, ARunWaitsForRoomOnItsGpu) {
  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state", std::vector<std::string>{"--runs-per-gpu", "1"});
  auto config = GraphedGpuConfig(shards_);
  config.set_cuda_graphs(false);
  config.set_device("cuda:0");
  config.set_max_steps(1000000);
  nsa::v1::RunInfo first;
  const auto status = Start(config, &first);
  if (!status.ok()) {
    ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    GTEST_SKIP() << "needs a CUDA device and the kernels: " << status.error_message();
  }
  ASSERT_TRUE(WaitForStep(first.run_id(), 1));
  nsa::v1::RunInfo second, third;
  ASSERT_TRUE(Start(config, &second).ok());
  ASSERT_TRUE(Start(config, &third).ok());
  for (const auto& waiting : {second, third}) {
    EXPECT_EQ(waiting.state(), nsa::v1::PENDING);
    EXPECT_NE(waiting.message().find("waiting for a GPU"), std::string::npos) << waiting.message();
    EXPECT_EQ(waiting.device(), "");
  }
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_EQ(Get(second.run_id()).state(), nsa::v1::PENDING) << "still waiting";
  const fs::path runs = dir_ / "state" / "runs";
  EXPECT_FALSE(fs::exists(runs / second.run_id() / "worker.log")) << "no worker while it waits";

  ASSERT_TRUE(Halt(second.run_id(), "not needed").ok());
  const auto halted = Ended(second.run_id(), 30);
  EXPECT_EQ(halted.state(), nsa::v1::HALTED);
  EXPECT_NE(halted.message().find("not needed (while waiting for a GPU)"), std::string::npos) << halted.message();
  EXPECT_FALSE(fs::exists(runs / second.run_id() / "worker.log"));

  EXPECT_EQ(Get(third.run_id()).state(), nsa::v1::PENDING);
  ASSERT_TRUE(Halt(first.run_id(), "make room").ok());
  ASSERT_TRUE(WaitForStep(third.run_id(), 1));
  EXPECT_EQ(Ended(first.run_id(), 30).state(), nsa::v1::HALTED);
  EXPECT_EQ(Get(third.run_id()).device(), "cuda:0");
  ASSERT_TRUE(Halt(third.run_id(), "done").ok());
  EXPECT_EQ(Ended(third.run_id()).state(), nsa::v1::HALTED);
}

// Data parallel with CUDA graphs: after two eager steps each worker captures its step with
// the all-reduces in it and replays that. The replays must train as eager data-parallel steps
// do. A capture without the all-reduces would update each worker with its own gradients:
// another gradient norm (random tokens, so the two workers' gradients differ), the workers'
// weights apart, another validation loss. bf16 on the kernels, so a tolerance.
TEST_F(DaemonTest, TwoGpuWorkersReplayCapturedStepsLikeTheirEagerSteps) {
  std::mt19937 rng(7);
  std::vector<uint32_t> tokens(20000);
  for (auto& t : tokens) t = rng() % 256;
  const fs::path random_shards = dir_ / "random-shards";
  fs::create_directories(random_shards);
  data::WriteShard((random_shards / "random_train_000000.bin").string(), tokens, data::TokenWidth::kUint16);
  auto config = GraphedGpuConfig(random_shards);
  config.set_max_steps(8);
  config.set_eval_every(8);
  config.set_world_size(2);
  nsa::v1::RunInfo graphed;
  const auto status = Start(config, &graphed);
  if (!status.ok()) {
    // Only the machine may refuse it (fewer than two GPUs, no NCCL, no kernels); a refusal
    // of cuda_graphs itself, as before graphs captured the all-reduces, is a failure.
    ASSERT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
    ASSERT_EQ(status.error_message().find("cuda_graphs"), std::string::npos) << status.error_message();
    GTEST_SKIP() << "needs two CUDA devices and the kernels: " << status.error_message();
  }
  config.set_cuda_graphs(false);
  nsa::v1::RunInfo eager;
  ASSERT_TRUE(Start(config, &eager).ok());
  const auto g = Ended(graphed.run_id()), e = Ended(eager.run_id());
  ASSERT_EQ(g.state(), nsa::v1::COMPLETED) << g.message();
  ASSERT_EQ(e.state(), nsa::v1::COMPLETED) << e.message();
  EXPECT_TRUE(g.config().cuda_graphs());
  EXPECT_EQ(g.config().world_size(), 2);
  EXPECT_EQ(g.progress().tokens_seen(), e.progress().tokens_seen());
  EXPECT_NEAR(g.progress().loss(), e.progress().loss(), 2e-3 * e.progress().loss());
  EXPECT_NEAR(g.progress().grad_norm(), e.progress().grad_norm(), 2e-2 * e.progress().grad_norm());
  EXPECT_NEAR(g.progress().val_loss(), e.progress().val_loss(), 2e-3 * e.progress().val_loss());
}

// One dead worker of a data-parallel run fails the run with its reason at once, and the
// other worker, which would wait for it in its all-reduce, is stopped.
// Eager steps, and replayed CUDA graphs, where the survivor's all-reduce is a kernel inside
// the graph (killed from step 5 on: two eager steps, the capture, then replays).
TEST_F(DaemonTest, ADeadWorkerFailsItsDataParallelRunAndStopsTheOthers) {
  auto eager = TinyConfig(shards_);
  eager.set_device("auto");
  eager.set_attention_backend(nsa::v1::ATTENTION_BACKEND_REFERENCE);  // head_dim 16
  for (auto [config, kill_at] : {std::pair{eager, 2}, std::pair{GraphedGpuConfig(shards_), 5}}) {
    SCOPED_TRACE(config.cuda_graphs() ? "CUDA graphs" : "eager");
    config.set_world_size(2);
    nsa::v1::RunInfo run;
    const auto status = Start(config, &run);
    if (!status.ok()) GTEST_SKIP() << "needs two CUDA devices: " << status.error_message();
    ASSERT_TRUE(WaitForStep(run.run_id(), kill_at));
    const auto workers = daemon_->Children();
    ASSERT_EQ(workers.size(), 2u);
    ASSERT_EQ(::kill(workers[1], SIGKILL), 0);

    ASSERT_TRUE(WaitForState(run.run_id(), nsa::v1::FAILED, 60)) << Get(run.run_id()).message();
    const auto failed = Get(run.run_id());
    EXPECT_NE(failed.message().find("killed by signal 9"), std::string::npos) << failed.message();
    EXPECT_TRUE(WaitFor([&] { return daemon_->Children().empty(); }, std::chrono::seconds(30)))
        << "the surviving worker must not linger in its all-reduce";
    ASSERT_TRUE(daemon_->Alive());
  }
}

// A worker that dies (an illegal memory access, the OOM killer, ...) fails its run with
// the reason; the daemon and the other runs carry on.
TEST_F(DaemonTest, AWorkerCrashFailsOnlyItsRun) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 1));
  const auto workers = daemon_->Children();
  ASSERT_EQ(workers.size(), 1u);
  ASSERT_EQ(::kill(workers[0], SIGKILL), 0);

  ASSERT_TRUE(WaitForState(run.run_id(), nsa::v1::FAILED, 60));
  const auto failed = Get(run.run_id());
  EXPECT_NE(failed.message().find("killed by signal 9"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find("worker.log"), std::string::npos) << failed.message();
  ASSERT_TRUE(daemon_->Alive());
  nsa::v1::RunInfo next;
  ASSERT_TRUE(Start(TinyConfig(shards_), &next).ok());
  EXPECT_TRUE(WaitForStep(next.run_id(), 1)) << "the daemon still trains";
}

// A token shard truncated under a running run (the shards are memory-mapped) ends its
// worker with SIGBUS: the run fails with a reason that points at the data, not a bare signal.
TEST_F(DaemonTest, AShardTruncatedUnderARunFailsItWithAHint) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 1));
  fs::resize_file(shards_ / "tiny_train_000000.bin", 0);
  ASSERT_TRUE(WaitForState(run.run_id(), nsa::v1::FAILED, 60));
  const auto failed = Get(run.run_id());
  EXPECT_NE(failed.message().find("signal 7"), std::string::npos) << failed.message();
  EXPECT_NE(failed.message().find("data shard truncated"), std::string::npos) << failed.message();
  ASSERT_TRUE(daemon_->Alive());
}

// Each run checkpoints into its own folder; a halted run resumes from its latest
// checkpoint, also after the daemon restarted.
TEST_F(DaemonTest, HaltedRunResumesFromItsLatestCheckpoint) {
  auto config = TinyConfig(shards_);
  config.set_checkpoint_every(3);
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(config, &run).ok());
  const std::string id = run.run_id();
  EXPECT_NE(run.config().checkpoint_dir().find("runs/" + id + "/checkpoints"), std::string::npos)
      << "the effective config names the run's own checkpoint folder: " << run.config().checkpoint_dir();
  ASSERT_TRUE(WaitForStep(id, 7));
  ASSERT_TRUE(Halt(id, "pause for maintenance").ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::HALTED, 60));
  const auto halted = Get(id);
  const std::string checkpoint = halted.progress().last_checkpoint();
  ASSERT_FALSE(checkpoint.empty());
  EXPECT_TRUE(fs::exists(checkpoint)) << checkpoint;

  // Across a daemon restart, too (one daemon per state dir: the first one stops first).
  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  nsa::v1::RunInfo resumed;
  const auto status = Control(&nsa::v1::Trainer::Stub::ResumeRun, id, &resumed);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resumed.state(), nsa::v1::PENDING);
  EXPECT_EQ(resumed.config().resume_from(), checkpoint);
  ASSERT_TRUE(WaitForState(id, nsa::v1::RUNNING, 60));
  ASSERT_TRUE(WaitForStep(id, halted.progress().step() + 3)) << "the resumed run trains on";
  ASSERT_TRUE(Halt(id, "done").ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::HALTED, 60));

  // A run that never checkpointed cannot be resumed that way.
  auto no_ckpt = TinyConfig(shards_);
  no_ckpt.set_checkpoint_every(0);
  nsa::v1::RunInfo other;
  ASSERT_TRUE(Start(no_ckpt, &other).ok());
  ASSERT_TRUE(WaitForStep(other.run_id(), 1));
  ASSERT_TRUE(Halt(other.run_id(), "").ok());
  ASSERT_TRUE(WaitForState(other.run_id(), nsa::v1::HALTED, 60));
  const auto refused = Control(&nsa::v1::Trainer::Stub::ResumeRun, other.run_id());
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("no checkpoint"), std::string::npos) << refused.error_message();
}

// A halt writes a checkpoint of the step it stopped after, so that the resumed run loses no
// step: here between two scheduled checkpoints (every 1000 steps: none before the halt).
// Before, the run was HALTED with no checkpoint and could not be resumed at all.
class HaltCheckpointTest : public DaemonTest {
 protected:
  // Halts a run of `world_size` workers after step 3 and resumes it; false when the machine
  // refused the start (fewer GPUs than workers).
  bool HaltAndResume(int world_size) {
    auto config = OnWorkers(TinyConfig(shards_), world_size);
    config.set_checkpoint_every(1000);
    nsa::v1::RunInfo run;
    const auto status = Start(config, &run);
    if (world_size > 1 && !status.ok()) return false;
    EXPECT_TRUE(status.ok()) << status.error_message();
    EXPECT_TRUE(WaitForStep(run.run_id(), 3));
    EXPECT_TRUE(Halt(run.run_id(), "maintenance").ok());
    EXPECT_TRUE(WaitForState(run.run_id(), nsa::v1::HALTED, 60));
    // Its workers are gone once it is HALTED: their GPUs are free for the next run (before,
    // a data-parallel run's two workers took 20 s to go, each killed after waiting for the
    // other's exit, and a ResumeRun meanwhile waited past its deadline).
    EXPECT_TRUE(daemon_->Children().empty()) << daemon_->Children().size() << " workers left";
    const auto halted = Get(run.run_id());
    EXPECT_EQ(halted.message(), "maintenance");
    char name[32];
    std::snprintf(name, sizeof name, "step_%09lld", static_cast<long long>(halted.progress().step()));
    const fs::path checkpoint = halted.progress().last_checkpoint();
    EXPECT_EQ(checkpoint.filename().string(), name) << checkpoint;
    EXPECT_TRUE(fs::exists(checkpoint / "MANIFEST")) << checkpoint;

    nsa::v1::RunInfo resumed;
    EXPECT_TRUE(Control(&nsa::v1::Trainer::Stub::ResumeRun, run.run_id(), &resumed).ok());
    EXPECT_EQ(resumed.config().resume_from(), checkpoint.string());
    EXPECT_TRUE(WaitForStep(run.run_id(), halted.progress().step() + 1)) << "it trains on from the checkpoint";
    EXPECT_EQ(daemon_->Children().size(), static_cast<size_t>(world_size));
    return true;
  }
};

TEST_F(HaltCheckpointTest, AHaltCheckpointsTheStepItStoppedAfter) { HaltAndResume(1); }

// Data parallel: rank 0 writes the halt's checkpoint and both workers resume from it.
TEST_F(HaltCheckpointTest, TwoGpuWorkersHaltWithACheckpointAndResumeFromIt) {
  if (!HaltAndResume(2)) GTEST_SKIP() << "needs two CUDA devices";
}

// A NaN injected into a layer halts the run at that step, names where it appeared and
// leaves the last good checkpoint alone; without --allow-fault-injection it is refused.
TEST_F(DaemonTest, InjectedNanHaltsTheRunWithItsLocation) {
  auto config = TinyConfig(shards_);
  config.set_checkpoint_every(2);
  config.mutable_fault_injection()->set_nan_at_step(5);
  config.mutable_fault_injection()->set_layer(0);
  nsa::v1::RunInfo run;
  const auto refused = Start(config, &run);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("fault_injection"), std::string::npos) << refused.error_message();

  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state", std::vector<std::string>{"--allow-fault-injection"});
  ASSERT_TRUE(Start(config, &run).ok());
  ASSERT_TRUE(WaitForState(run.run_id(), nsa::v1::HALTED, 120));
  const auto halted = Get(run.run_id());
  EXPECT_EQ(halted.progress().step(), 4) << "step 5's update never happened";
  EXPECT_NE(halted.message().find("step 5"), std::string::npos) << halted.message();
  EXPECT_NE(halted.message().find("layer 0"), std::string::npos) << halted.message();
  EXPECT_NE(halted.progress().last_checkpoint().find("step_000000004"), std::string::npos)
      << halted.progress().last_checkpoint();
}

TEST_F(DaemonTest, RunRecordsSurviveARestart) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 2));
  EXPECT_EQ(daemon_->Stop(), 0) << "SIGTERM shuts the daemon down cleanly";

  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  const auto after = Get(run.run_id());
  EXPECT_EQ(after.state(), nsa::v1::HALTED) << "a run stopped by shutdown is recorded as halted";
  EXPECT_GE(after.progress().step(), 2);
  EXPECT_EQ(after.config().seq_len(), 64);
  nsa::v1::RunInfo next;
  ASSERT_TRUE(Start(TinyConfig(shards_), &next).ok());
  EXPECT_NE(next.run_id(), run.run_id()) << "ids are never reused";
}

// A daemon killed outright (a crash, the OOM killer, systemd's SIGKILL after its stop
// timeout) writes nothing on the way out: the run record must already name the run's last
// checkpoint, so that the run resumes from it after a restart.
TEST_F(DaemonTest, AKilledDaemonsRunResumesFromItsLastCheckpoint) {
  auto config = TinyConfig(shards_);
  config.set_checkpoint_every(3);
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(config, &run).ok());
  const std::string id = run.run_id();
  ASSERT_TRUE(WaitForStep(id, 7));
  daemon_->Kill();

  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  const auto after = Get(id);
  EXPECT_EQ(after.state(), nsa::v1::FAILED);
  EXPECT_NE(after.message().find("daemon stopped"), std::string::npos) << after.message();
  const std::string checkpoint = after.progress().last_checkpoint();
  ASSERT_FALSE(checkpoint.empty()) << "the record was not written when the checkpoint was";
  EXPECT_TRUE(fs::exists(checkpoint)) << checkpoint;
  EXPECT_GE(after.progress().step(), 6);
  nsa::v1::RunInfo resumed;
  const auto status = Control(&nsa::v1::Trainer::Stub::ResumeRun, id, &resumed);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(resumed.config().resume_from(), checkpoint);
  ASSERT_TRUE(WaitForStep(id, after.progress().step() + 2)) << "the resumed run trains on";

  // Killed again, and the recorded checkpoint gone (the record can lag the folder by one
  // checkpoint, and keep-last pruning may remove the one it names): the run resumes from the
  // newest checkpoint its folder holds.
  daemon_->Kill();
  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  const auto again = Get(id);
  ASSERT_FALSE(again.progress().last_checkpoint().empty());
  fs::remove_all(again.progress().last_checkpoint());
  const auto from_latest = Control(&nsa::v1::Trainer::Stub::ResumeRun, id, &resumed);
  ASSERT_TRUE(from_latest.ok()) << from_latest.error_message();
  EXPECT_EQ(resumed.config().resume_from(), "latest");
  ASSERT_TRUE(WaitForState(id, nsa::v1::RUNNING, 60));
  ASSERT_TRUE(Halt(id, "done").ok());
  ASSERT_TRUE(WaitForState(id, nsa::v1::HALTED, 60));
}

// A record the daemon must rewrite at startup (a run it finds RUNNING becomes FAILED) but
// cannot (a full or read-only state dir; here its temporary file's name is taken by a folder)
// is logged: the daemon serves, and the run shows FAILED. It aborted before, and under
// systemd's Restart=on-failure that was a crash loop.
TEST_F(DaemonTest, ARecordThatCannotBeRewrittenDoesNotStopTheDaemon) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 1));
  daemon_->Kill();
  fs::create_directories(dir_ / "state" / "runs" / run.run_id() / "run.json.tmp");

  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  const auto after = Get(run.run_id());
  EXPECT_EQ(after.state(), nsa::v1::FAILED);
  EXPECT_NE(after.message().find("daemon stopped"), std::string::npos) << after.message();
}

// One daemon per state dir, and one per gRPC port: a second one exits with a clear message
// and touches nothing of the first one's (whose live run stays RUNNING, not FAILED).
TEST_F(DaemonTest, ASecondDaemonOnTheSameStateDirOrPortExits) {
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 1));
  const fs::path log = dir_ / "second.log";
  EXPECT_EQ(RunNsadToExit({"--listen", "127.0.0.1:0", "--metrics", "off", "--state-dir", (dir_ / "state").string()},
                          log),
            1);
  EXPECT_NE(ReadFile(log).find("in use by another nsad"), std::string::npos) << ReadFile(log);
  EXPECT_EQ(Get(run.run_id()).state(), nsa::v1::RUNNING);
  EXPECT_EQ(RunNsadToExit({"--listen", daemon_->address(), "--metrics", "off", "--state-dir",
                           (dir_ / "other-state").string()},
                          log),
            1);
  EXPECT_NE(ReadFile(log).find("cannot listen"), std::string::npos) << ReadFile(log);
  EXPECT_EQ(Get(run.run_id()).state(), nsa::v1::RUNNING) << "calls still reach the first daemon";

  // A state dir that cannot take the lock file is named as such (it blamed the worker).
  fs::create_directories(dir_ / "third-state" / "nsad.lock");
  EXPECT_EQ(RunNsadToExit({"--listen", "127.0.0.1:0", "--metrics", "off", "--state-dir",
                           (dir_ / "third-state").string()},
                          log),
            1);
  EXPECT_NE(ReadFile(log).find("cannot use state dir"), std::string::npos) << ReadFile(log);
}

// A state dir that cannot take a new run's record refuses the run (naming the state dir)
// instead of listing a run that no restart would know; the next start, once it can, works.
TEST_F(DaemonTest, AStartTheStateDirCannotRecordIsRefused) {
  const fs::path runs = dir_ / "state" / "runs";
  fs::rename(runs, dir_ / "runs-away");
  std::ofstream(runs.string()) << "not a folder";
  nsa::v1::RunInfo run;
  const auto refused = Start(TinyConfig(shards_), &run);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("state_dir"), std::string::npos) << refused.error_message();
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  nsa::v1::ListRunsResponse listed;
  ASSERT_TRUE(daemon_->stub().ListRuns(&ctx, nsa::v1::ListRunsRequest(), &listed).ok());
  EXPECT_EQ(listed.runs_size(), 0) << "no run was left behind";

  fs::remove(runs);
  fs::rename(dir_ / "runs-away", runs);
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  ASSERT_TRUE(WaitForStep(run.run_id(), 1));
}

// A run whose record cannot be read still owns its folder: its id is not handed out again
// (the new run would write into the old one's folder and prune its checkpoints).
TEST_F(DaemonTest, AnUnreadableRecordsIdIsNotReused) {
  auto config = TinyConfig(shards_);
  config.set_checkpoint_every(2);
  nsa::v1::RunInfo old_run;
  ASSERT_TRUE(Start(config, &old_run).ok());
  ASSERT_TRUE(WaitFor([&] { return !Get(old_run.run_id()).progress().last_checkpoint().empty(); },
                      std::chrono::seconds(120)));
  daemon_.reset();
  const fs::path old_dir = dir_ / "state" / "runs" / old_run.run_id();
  std::ofstream(old_dir / "run.json", std::ios::trunc) << "{trunc";

  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  nsa::v1::RunInfo next;
  ASSERT_TRUE(Start(TinyConfig(shards_), &next).ok());
  EXPECT_NE(next.run_id(), old_run.run_id());
  EXPECT_EQ(ReadFile(old_dir / "run.json"), "{trunc") << "the old folder is left alone";
}

// A run prunes its checkpoint_dir to its last checkpoint_keep checkpoints, whoever wrote
// them: a folder another live run checkpoints into, or one that holds checkpoints already,
// is refused by name, unless the new run continues from one of them (resume_from there).
TEST_F(DaemonTest, ACheckpointFolderWithOthersCheckpointsIsRefused) {
  auto config = TinyConfig(shards_);
  config.set_checkpoint_every(2);
  config.set_checkpoint_dir((dir_ / "shared").string());
  nsa::v1::RunInfo first;
  ASSERT_TRUE(Start(config, &first).ok());
  nsa::v1::RunInfo second;
  auto refused = Start(config, &second);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("checkpoint_dir"), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find(first.run_id()), std::string::npos) << refused.error_message();

  ASSERT_TRUE(WaitFor([&] { return !Get(first.run_id()).progress().last_checkpoint().empty(); },
                      std::chrono::seconds(120)));
  ASSERT_TRUE(Halt(first.run_id(), "").ok());
  ASSERT_TRUE(WaitForState(first.run_id(), nsa::v1::HALTED, 60));
  refused = Start(config, &second);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("already holds checkpoints"), std::string::npos) << refused.error_message();

  config.set_resume_from(Get(first.run_id()).progress().last_checkpoint());
  ASSERT_TRUE(Start(config, &second).ok()) << "a run that continues the folder's checkpoints takes it";
  ASSERT_TRUE(Halt(second.run_id(), "").ok());

  // A folder the run could not create is refused at the start, not at the first checkpoint.
  std::ofstream((dir_ / "a-file").string()) << "x";
  auto unwritable = TinyConfig(shards_);
  unwritable.set_checkpoint_every(2);
  unwritable.set_checkpoint_dir((dir_ / "a-file" / "checkpoints").string());
  refused = Start(unwritable, &second);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("checkpoint_dir: cannot create"), std::string::npos)
      << refused.error_message();
}

// A halt takes effect between steps. A step that never ends (a hung collective, a GPU that
// stopped answering: a SIGSTOPped worker here) is ended --halt-timeout seconds after the
// halt by killing the run's workers; the run is HALTED and resumes from its checkpoint.
// Before, it stayed HALTING for as long as the step hung.
class HungStepTest : public DaemonTest {
 protected:
  void SetUp() override {
    DaemonTest::SetUp();
    daemon_.reset();  // it holds the state dir's lock
    daemon_ = std::make_unique<Daemon>(dir_ / "state", std::vector<std::string>{"--halt-timeout", "2"});
  }
  void TearDown() override {
    // A worker the daemon under test did not kill must not stay stopped behind it.
    if (stopped_ > 0 && ReadFile("/proc/" + std::to_string(stopped_) + "/comm") == "nsad-worker\n") {
      ::kill(stopped_, SIGKILL);
    }
    DaemonTest::TearDown();
  }
  // Starts a checkpointing run and stops one of its workers once a checkpoint is written
  // (with two, the other then waits in its all-reduce); returns the run as it stood then, or
  // a run without an id when the machine refused it.
  nsa::v1::RunInfo StartAndStopItsWorker(int world_size = 1) {
    const auto run = StartCheckpointingRun(world_size);
    if (run.run_id().empty()) return run;
    const auto workers = daemon_->Children();
    EXPECT_EQ(workers.size(), static_cast<size_t>(world_size));
    if (workers.size() != static_cast<size_t>(world_size)) return run;
    stopped_ = workers.back();
    EXPECT_EQ(::kill(stopped_, SIGSTOP), 0);
    // A reply already on its way is taken first; then the run's thread waits on a step that
    // cannot end.
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto stuck = Get(run.run_id());
    EXPECT_FALSE(WaitForStep(run.run_id(), stuck.progress().step() + 1, 1)) << "a stopped worker stepped";
    return stuck;
  }
  // Halts the run ("drill") and waits for it to be HALTED with its workers gone; the run then.
  nsa::v1::RunInfo HaltDrill(const std::string& id) {
    EXPECT_TRUE(Halt(id, "drill").ok());
    EXPECT_TRUE(WaitForState(id, nsa::v1::HALTED, 30)) << "still " << nsa::v1::RunState_Name(Get(id).state());
    EXPECT_TRUE(WaitFor([&] { return daemon_->Children().empty(); }, std::chrono::seconds(10)))
        << "the hung worker is killed and reaped";
    return Get(id);
  }
  // Stops a worker of a run of `world_size` workers, halts the run past the timeout and
  // resumes it from its checkpoint; the run's id, or "" when the machine refused the run.
  std::string DrillAndResume(int world_size) {
    const auto run = StartAndStopItsWorker(world_size);
    if (run.run_id().empty()) return "";
    EXPECT_GT(stopped_, 0);
    const auto halted = HaltDrill(run.run_id());
    EXPECT_NE(halted.message().find("drill; its step had not ended 2 s after the halt, so its workers were killed"),
              std::string::npos)
        << halted.message();
    nsa::v1::RunInfo resumed;
    EXPECT_TRUE(Control(&nsa::v1::Trainer::Stub::ResumeRun, run.run_id(), &resumed).ok());
    EXPECT_TRUE(WaitForStep(run.run_id(), halted.progress().step() + 1)) << "it resumes from its checkpoint";
    EXPECT_EQ(daemon_->Children().size(), static_cast<size_t>(world_size));
    return run.run_id();
  }
  pid_t stopped_ = -1;
};

TEST_F(HungStepTest, AHaltEndsAStepThatOutlastsTheHaltTimeout) { DrillAndResume(1); }

// The hung collective itself: one worker of a data-parallel run stops, the other waits for
// it in its all-reduce. A halt kills both after the timeout; the run resumes on two workers.
TEST_F(HungStepTest, AHaltEndsADataParallelStepHungInItsAllReduce) {
  const std::string id = DrillAndResume(2);
  if (id.empty()) GTEST_SKIP() << "needs two CUDA devices";
  EXPECT_EQ(Get(id).device(), "cuda:0,cuda:1");
}

// The daemon's shutdown halts its runs the same way: SIGTERM with a stopped worker ends the
// daemon cleanly within the halt timeout (it waited until the test's 30 s SIGKILL before), and
// the run's record says HALTED.
TEST_F(HungStepTest, AShutdownEndsAStepThatOutlastsTheHaltTimeout) {
  const auto run = StartAndStopItsWorker();
  ASSERT_GT(stopped_, 0);
  const auto asked = std::chrono::steady_clock::now();
  EXPECT_EQ(daemon_->Stop(), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - asked, std::chrono::seconds(20));

  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state");
  const auto after = Get(run.run_id());
  EXPECT_EQ(after.state(), nsa::v1::HALTED) << nsa::v1::RunState_Name(after.state());
  EXPECT_NE(after.message().find("daemon shutting down; its step had not ended 2 s after the halt"),
            std::string::npos)
      << after.message();
}

// Workers that never finish starting (a GPU that hangs at initialisation; here a worker
// binary that answers nsad's probe, then never again) are killed --halt-timeout seconds after
// a halt as well. Before, such a run stayed HALTING, and a shutdown waited for it.
TEST_F(HungStepTest, AHaltEndsAWorkerStartThatHangs) {
  const fs::path worker = dir_ / "hanging-worker";
  const fs::path real = fs::path(NSAD_BINARY).parent_path() / "nsad-worker";
  std::ofstream(worker.string()) << "#!/bin/sh\n"
                                 << "# nsad's probe gets the real worker; a run's worker never answers.\n"
                                 << "if [ -e \"$0.probed\" ]; then exec sleep 300; fi\n"
                                 << ": > \"$0.probed\"\n"
                                 << "exec " << real.string() << "\n";
  fs::permissions(worker, fs::perms::owner_all);
  daemon_.reset();
  daemon_ = std::make_unique<Daemon>(dir_ / "state",
                                     std::vector<std::string>{"--halt-timeout", "2", "--worker", worker.string()});
  nsa::v1::RunInfo run;
  ASSERT_TRUE(Start(TinyConfig(shards_), &run).ok());
  EXPECT_FALSE(WaitForState(run.run_id(), nsa::v1::RUNNING, 1)) << "the worker cannot have started";
  const auto halted = HaltDrill(run.run_id());
  EXPECT_NE(halted.message().find("drill; its trainer had not started 2 s after the halt, so its workers were killed"),
            std::string::npos)
      << halted.message();
}

// A model whose weights, gradients and AdamW moments alone exceed the memory of the run's
// device (a typo: 10^8 layers, or a dim of 10^6) is refused by StartRun, naming the sizes that
// make it; no run is created. Before, the run was created and its worker failed it with an
// allocator's message, or on the CPU grew until the host ran out of memory.
TEST_F(DaemonTest, AModelTooLargeForItsDeviceIsRefusedBeforeARunExists) {
  auto deep = TinyConfig(shards_);
  deep.mutable_model()->set_n_layers(100000000);
  auto wide = TinyConfig(shards_);
  wide.mutable_model()->set_dim(1000000);
  for (const auto& [config, cause] :
       {std::pair{deep, "model.n_layers 100000000"}, std::pair{wide, "model.dim 1000000"}}) {
    nsa::v1::RunInfo run;
    const auto status = Start(config, &run);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << cause;
    EXPECT_NE(status.error_message().find("model: "), std::string::npos) << status.error_message();
    EXPECT_NE(status.error_message().find("for their float32 weights, gradients and AdamW moments alone, more than"),
              std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find(cause), std::string::npos) << status.error_message();
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  nsa::v1::ListRunsResponse list;
  ASSERT_TRUE(daemon_->stub().ListRuns(&ctx, nsa::v1::ListRunsRequest(), &list).ok());
  EXPECT_EQ(list.runs_size(), 0) << "no run was created for the refused starts";
}

// A resume_from that cannot continue the new config's run (a checkpoint of another model,
// or "latest" in a folder without checkpoints) is refused by StartRun, naming the field and
// the difference; before, the run was created and its worker failed it.
TEST_F(DaemonTest, AResumeFromAnotherModelsCheckpointIsRefusedBeforeARunExists) {
  const auto first = StartCheckpointingRun();
  ASSERT_FALSE(Get(first.run_id()).progress().last_checkpoint().empty());
  ASSERT_TRUE(Halt(first.run_id(), "").ok());
  ASSERT_TRUE(WaitForState(first.run_id(), nsa::v1::HALTED, 60));

  auto wider = TinyConfig(shards_);
  wider.mutable_model()->set_dim(48);
  wider.set_resume_from(Get(first.run_id()).progress().last_checkpoint());
  nsa::v1::RunInfo refused_run;
  auto refused = Start(wider, &refused_run);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("resume_from"), std::string::npos) << refused.error_message();
  EXPECT_NE(refused.error_message().find("model.dim: checkpoint 32, now 48"), std::string::npos)
      << refused.error_message();

  auto latest = TinyConfig(shards_);
  latest.set_checkpoint_dir((dir_ / "empty").string());
  latest.set_resume_from("latest");
  refused = Start(latest, &refused_run);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("resume_from: \"latest\": no checkpoint in"), std::string::npos)
      << refused.error_message();

  grpc::ClientContext ctx;
  ctx.set_deadline(Deadline());
  nsa::v1::ListRunsResponse list;
  ASSERT_TRUE(daemon_->stub().ListRuns(&ctx, nsa::v1::ListRunsRequest(), &list).ok());
  EXPECT_EQ(list.runs_size(), 1) << "no run was created for the refused starts";

  // The same model resumes from it.
  auto same = TinyConfig(shards_);
  same.set_resume_from(Get(first.run_id()).progress().last_checkpoint());
  nsa::v1::RunInfo resumed;
  ASSERT_TRUE(Start(same, &resumed).ok());
  EXPECT_TRUE(WaitForStep(resumed.run_id(), Get(first.run_id()).progress().step() + 1));
}

}  // namespace
}  // namespace nsad::testing
