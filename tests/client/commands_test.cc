// nsactl commands against an in-process fake Trainer service, and the built nsactl binary
// against an address where nothing listens.
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "cli.h"
#include "commands.h"
#include "nsa/v1/trainer.grpc.pb.h"

namespace nsactl {
namespace {

using grpc::ServerContext;
using grpc::Status;
using grpc::StatusCode;

nsa::v1::RunInfo MakeRun(const std::string& id, nsa::v1::RunState state) {
  nsa::v1::RunInfo run;
  run.set_run_id(id);
  run.set_state(state);
  run.mutable_config()->set_name("tiny-" + id);
  run.set_device("cpu");
  run.mutable_progress()->set_max_steps(100);
  return run;
}

nsa::v1::RunEvent MakeEvent(nsa::v1::RunState state, int64_t step, const std::string& message = "") {
  nsa::v1::RunEvent event;
  event.set_state(state);
  event.mutable_progress()->set_step(step);
  event.mutable_progress()->set_max_steps(100);
  event.mutable_progress()->set_loss(4.0 - step * 0.01);
  event.mutable_progress()->set_tokens_per_second(1000);
  event.mutable_progress()->set_lr(1e-3);
  event.set_message(message);
  return event;
}

// Knows runs r1 (RUNNING) and r2 (PAUSED); records what clients sent.
class FakeTrainer final : public nsa::v1::Trainer::Service {
 public:
  std::map<std::string, std::vector<nsa::v1::RunEvent>> scripted_events;
  std::string last_config_json;
  std::string last_halt_reason;
  std::vector<nsa::v1::RunState> last_list_states;
  std::atomic<bool> endless_watch_started{false};
  std::atomic<bool> endless_watch_cancelled{false};
  std::atomic<int> halts{0};

  Status StartRun(ServerContext*, const nsa::v1::StartRunRequest* request,
                  nsa::v1::StartRunResponse* response) override {
    std::lock_guard<std::mutex> lock(mutex_);
    last_config_json = request->config_json();
    *response->mutable_run() = MakeRun("r-new", nsa::v1::PENDING);
    return Status::OK;
  }
  Status PauseRun(ServerContext*, const nsa::v1::RunRequest* request,
                  nsa::v1::RunResponse* response) override {
    return Lookup(request->run_id(), nsa::v1::PAUSING, response);
  }
  Status ResumeRun(ServerContext*, const nsa::v1::RunRequest* request,
                   nsa::v1::RunResponse* response) override {
    return Lookup(request->run_id(), nsa::v1::RUNNING, response);
  }
  Status HaltRun(ServerContext*, const nsa::v1::HaltRunRequest* request,
                 nsa::v1::RunResponse* response) override {
    ++halts;
    std::lock_guard<std::mutex> lock(mutex_);
    last_halt_reason = request->reason();
    return Lookup(request->run_id(), nsa::v1::HALTING, response);
  }
  Status GetRun(ServerContext*, const nsa::v1::RunRequest* request,
                nsa::v1::RunResponse* response) override {
    return Lookup(request->run_id(), nsa::v1::RUN_STATE_UNSPECIFIED, response);
  }
  Status ListRuns(ServerContext*, const nsa::v1::ListRunsRequest* request,
                  nsa::v1::ListRunsResponse* response) override {
    std::lock_guard<std::mutex> lock(mutex_);
    last_list_states.clear();
    for (int state : request->states()) {
      last_list_states.push_back(static_cast<nsa::v1::RunState>(state));
    }
    // One run a page, as a daemon with many runs pages them.
    for (const auto& run : {MakeRun("r1", nsa::v1::RUNNING), MakeRun("r2", nsa::v1::PAUSED)}) {
      const bool wanted =
          request->states().empty() ||
          std::find(request->states().begin(), request->states().end(), run.state()) !=
              request->states().end();
      if (!wanted || run.run_id() <= request->page_token()) continue;
      if (response->runs_size() == 1) {
        response->set_next_page_token(response->runs(0).run_id());
        break;
      }
      *response->add_runs() = run;
    }
    return Status::OK;
  }
  Status WatchRun(ServerContext* context, const nsa::v1::WatchRunRequest* request,
                  grpc::ServerWriter<nsa::v1::RunEvent>* writer) override {
    if (request->run_id() == "endless") {
      // Streams one event, then waits for the client to go away, like a long run.
      writer->Write(MakeEvent(nsa::v1::RUNNING, 1));
      endless_watch_started = true;
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!context->IsCancelled() && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      endless_watch_cancelled = context->IsCancelled();
      return Status::CANCELLED;
    }
    const auto it = scripted_events.find(request->run_id());
    if (it == scripted_events.end()) {
      return Status(StatusCode::NOT_FOUND, "run '" + request->run_id() + "' not found");
    }
    for (const auto& event : it->second) writer->Write(event);
    return Status::OK;
  }
  Status InspectGates(ServerContext*, const nsa::v1::RunRequest* request,
                      nsa::v1::InspectGatesResponse* response) override {
    response->set_run_id(request->run_id());
    response->set_step(7);
    for (int layer = 0; layer < 2; ++layer) {
      auto* gates = response->add_layers();
      gates->set_layer(layer);
      gates->mutable_mean()->set_cmp(0.1 * (layer + 1));
      gates->set_mean_selected_blocks(3);
    }
    return Status::OK;
  }
  Status GetThroughput(ServerContext*, const nsa::v1::RunRequest* request,
                       nsa::v1::GetThroughputResponse* response) override {
    response->set_run_id(request->run_id());
    response->set_tokens_per_second(5000);
    response->set_mean_tokens_per_second(4500);
    response->set_recent_tokens_per_second(4900);
    response->set_recent_steps(12);
    response->set_step_seconds(0.25);
    response->set_data_seconds(0.00018);
    response->set_step(12);
    response->set_tokens_seen(60000);
    return Status::OK;
  }

 private:
  Status Lookup(const std::string& run_id, nsa::v1::RunState new_state,
                nsa::v1::RunResponse* response) {
    if (run_id != "r1" && run_id != "r2") {
      return Status(StatusCode::NOT_FOUND, "run '" + run_id + "' not found");
    }
    nsa::v1::RunInfo run = MakeRun(run_id, run_id == "r1" ? nsa::v1::RUNNING : nsa::v1::PAUSED);
    if (new_state != nsa::v1::RUN_STATE_UNSPECIFIED) run.set_state(new_state);
    *response->mutable_run() = run;
    return Status::OK;
  }
  std::mutex mutex_;
};

class CommandsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int port = 0;
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&trainer_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    address_ = "127.0.0.1:" + std::to_string(port);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(1));
  }

  // Parses argv like main() does and executes it; returns the exit code.
  int Run(std::vector<std::string> args, WatchInterrupter* interrupter = nullptr) {
    out_.str("");
    err_.str("");
    args.insert(args.begin(), {"--addr", address_, "--timeout", "5"});
    const ParseResult parsed = ParseCommandLine(args, "");
    EXPECT_EQ(parsed.kind, ParseResult::Kind::kRun) << parsed.text;
    return Execute(parsed.invocation, out_, err_, interrupter);
  }

  std::string WriteFile(const std::string& name, const std::string& contents) {
    const std::string path = ::testing::TempDir() + name;
    std::ofstream(path) << contents;
    return path;
  }

  FakeTrainer trainer_;
  std::unique_ptr<grpc::Server> server_;
  std::string address_;
  std::ostringstream out_, err_;
};

TEST_F(CommandsTest, StatusPrintsTheRun) {
  ASSERT_EQ(Run({"status", "r1"}), kExitOk) << err_.str();
  EXPECT_NE(out_.str().find("run_id:"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("RUNNING"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("tiny-r1"), std::string::npos) << out_.str();
  EXPECT_EQ(err_.str(), "");
}

TEST_F(CommandsTest, StatusJsonIsTheResponseMessage) {
  ASSERT_EQ(Run({"--json", "status", "r2"}), kExitOk) << err_.str();
  nsa::v1::RunResponse parsed;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(out_.str(), &parsed).ok()) << out_.str();
  EXPECT_EQ(parsed.run().run_id(), "r2");
  EXPECT_EQ(parsed.run().state(), nsa::v1::PAUSED);
  EXPECT_NE(out_.str().find("\"parameter_count\""), std::string::npos) << out_.str();
}

TEST_F(CommandsTest, RpcErrorPrintsCodeNameAndExitsOne) {
  EXPECT_EQ(Run({"status", "nope"}), kExitRpcError);
  EXPECT_EQ(err_.str(), "nsactl: NOT_FOUND: run 'nope' not found\n");
  EXPECT_EQ(out_.str(), "");
}

TEST_F(CommandsTest, ListSendsStateFilter) {
  ASSERT_EQ(Run({"list", "--state", "paused"}), kExitOk) << err_.str();
  EXPECT_EQ(trainer_.last_list_states, std::vector<nsa::v1::RunState>{nsa::v1::PAUSED});
  EXPECT_EQ(out_.str().find("r1 "), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("r2 "), std::string::npos) << out_.str();

  ASSERT_EQ(Run({"list"}), kExitOk);
  EXPECT_TRUE(trainer_.last_list_states.empty());
  EXPECT_NE(out_.str().find("r1 "), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("r2 "), std::string::npos) << "from the second page:\n" << out_.str();
}

TEST_F(CommandsTest, StartSendsTheFileVerbatimAsConfigJson) {
  // Includes a field the client does not know: the daemon must be the one to judge it.
  const std::string contents = "{\"name\": \"exp\", \"seq_len\": 64, \"not_a_field\": 1}\n";
  ASSERT_EQ(Run({"start", "--config", WriteFile("verbatim.json", contents)}), kExitOk)
      << err_.str();
  EXPECT_EQ(trainer_.last_config_json, contents);
  EXPECT_NE(out_.str().find("started run r-new"), std::string::npos) << out_.str();
}

TEST_F(CommandsTest, StartNameOverridesTheConfigName) {
  const std::string path =
      WriteFile("named.json", "{\"name\": \"exp\", \"seq_len\": 64, \"model\": {\"dim\": 32}}");
  ASSERT_EQ(Run({"start", "--config", path, "--name", "renamed"}), kExitOk) << err_.str();
  nsa::v1::RunConfig sent;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(trainer_.last_config_json, &sent).ok());
  EXPECT_EQ(sent.name(), "renamed");
  EXPECT_EQ(sent.seq_len(), 64);
  EXPECT_EQ(sent.model().dim(), 32);
  EXPECT_FALSE(sent.has_batch_size());  // unset fields stay unset for the daemon's defaults
}

TEST_F(CommandsTest, StartInputErrorsAreUsageErrors) {
  EXPECT_EQ(Run({"start", "--config", "/nonexistent/config.json"}), kExitUsage);
  EXPECT_NE(err_.str().find("cannot read config file"), std::string::npos) << err_.str();
  // A folder opens like a file but reads as nothing: not sent as an empty config.
  EXPECT_EQ(Run({"start", "--config", ::testing::TempDir()}), kExitUsage);
  EXPECT_NE(err_.str().find("cannot read config file"), std::string::npos) << err_.str();
  EXPECT_TRUE(trainer_.last_config_json.empty());
}

// With --name, a config that does not parse is still the daemon's to judge: it goes as it is,
// so that the error and exit code are the ones the same file gets without --name.
TEST_F(CommandsTest, StartNameLeavesAnInvalidConfigToTheDaemon) {
  const std::string contents = "{\"name\": \"x\", \"sequence_length\": 3}";
  ASSERT_EQ(Run({"start", "--config", WriteFile("bad.json", contents), "--name", "y"}), kExitOk) << err_.str();
  EXPECT_EQ(trainer_.last_config_json, contents);
}

TEST_F(CommandsTest, PauseResumeHalt) {
  ASSERT_EQ(Run({"pause", "r1"}), kExitOk);
  EXPECT_EQ(out_.str(), "run r1: PAUSING\n");
  ASSERT_EQ(Run({"resume", "r2"}), kExitOk);
  EXPECT_EQ(out_.str(), "run r2: RUNNING\n");
  ASSERT_EQ(Run({"halt", "r1", "--reason", "enough"}), kExitOk);
  EXPECT_EQ(out_.str(), "run r1: HALTING\n");
  EXPECT_EQ(trainer_.last_halt_reason, "enough");
}

TEST_F(CommandsTest, GatesAndThroughput) {
  ASSERT_EQ(Run({"gates", "r1"}), kExitOk) << err_.str();
  EXPECT_NE(out_.str().find("gates from step 7"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("0.200 ±0.000"), std::string::npos) << out_.str();
  ASSERT_EQ(Run({"throughput", "r1"}), kExitOk) << err_.str();
  EXPECT_NE(out_.str().find("4500"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("RECENT_TOK/S"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("4900 (12)"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("250.00ms"), std::string::npos) << out_.str();
  EXPECT_NE(out_.str().find("DATA_TIME"), std::string::npos) << out_.str();
  // A healthy data time is a fraction of a millisecond: it must not print as zero.
  EXPECT_NE(out_.str().find("0.18ms"), std::string::npos) << out_.str();
}

TEST_F(CommandsTest, WatchPrintsEventsAndExitsZeroOnCompletion) {
  trainer_.scripted_events["done"] = {MakeEvent(nsa::v1::RUNNING, 10),
                                      MakeEvent(nsa::v1::RUNNING, 20),
                                      MakeEvent(nsa::v1::COMPLETED, 100)};
  ASSERT_EQ(Run({"watch", "done"}), kExitOk) << err_.str();
  EXPECT_EQ(out_.str(),
            "step 10/100  loss 3.9000  tok/s 1000  lr 1.00e-03  RUNNING\n"
            "step 20/100  loss 3.8000  tok/s 1000  lr 1.00e-03  RUNNING\n"
            "step 100/100  loss 3.0000  tok/s 1000  lr 1.00e-03  COMPLETED\n");
}

TEST_F(CommandsTest, WatchJsonPrintsOneObjectPerLine) {
  trainer_.scripted_events["h"] = {MakeEvent(nsa::v1::RUNNING, 1),
                                   MakeEvent(nsa::v1::HALTED, 2, "alert LossSpike")};
  ASSERT_EQ(Run({"--json", "watch", "h"}), kExitOk) << err_.str();
  std::istringstream lines(out_.str());
  std::string line;
  int count = 0;
  while (std::getline(lines, line)) {
    nsa::v1::RunEvent event;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(line, &event).ok()) << line;
    ++count;
  }
  EXPECT_EQ(count, 2);
}

TEST_F(CommandsTest, WatchExitsNonZeroWhenTheRunFails) {
  trainer_.scripted_events["f"] = {MakeEvent(nsa::v1::RUNNING, 1),
                                   MakeEvent(nsa::v1::FAILED, 2, "loss is NaN")};
  EXPECT_EQ(Run({"watch", "f"}), kExitRunFailed);
  EXPECT_NE(err_.str().find("FAILED: loss is NaN"), std::string::npos) << err_.str();
}

TEST_F(CommandsTest, WatchStreamEndingEarlyIsAnError) {
  trainer_.scripted_events["cut"] = {MakeEvent(nsa::v1::RUNNING, 1)};
  EXPECT_EQ(Run({"watch", "cut"}), kExitRpcError);
  EXPECT_NE(err_.str().find("before run cut ended"), std::string::npos) << err_.str();
  EXPECT_EQ(Run({"watch", "unknown"}), kExitRpcError);
  EXPECT_NE(err_.str().find("NOT_FOUND"), std::string::npos) << err_.str();
}

TEST_F(CommandsTest, InterruptStopsWatchingButNotTheRun) {
  WatchInterrupter interrupter;
  int exit_code = -1;
  std::thread watcher([&] { exit_code = Run({"watch", "endless"}, &interrupter); });
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!trainer_.endless_watch_started && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(trainer_.endless_watch_started);
  interrupter.Interrupt();
  watcher.join();
  EXPECT_EQ(exit_code, kExitInterrupted);
  EXPECT_NE(err_.str().find("keeps going"), std::string::npos) << err_.str();
  EXPECT_EQ(trainer_.halts, 0);
  // The server sees the stream cancelled (it polls every 10 ms).
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (!trainer_.endless_watch_cancelled && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(trainer_.endless_watch_cancelled);
}

// --- The real binary ------------------------------------------------------------------

// A loopback port with no listener: bind port 0, note the port, close the socket.
int UnusedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return 0;
  }
  close(fd);
  return ntohs(addr.sin_port);
}

struct ProcessResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
  double seconds = 0;
};

ProcessResult RunNsactl(const std::string& arguments, const std::string& env = "") {
  const std::string command = env + " '" NSACTL_BINARY "' " + arguments + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  ProcessResult result;
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return result;
  char buffer[512];
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) result.output += buffer;
  const int status = pclose(pipe);
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  return result;
}

TEST(NsactlBinary, UnreachableDaemonExitsThreeQuickly) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  // Default 10 s deadline: a refused connection must not wait for it.
  const ProcessResult result = RunNsactl("--addr " + address + " list");
  EXPECT_EQ(result.exit_code, kExitUnreachable) << result.output;
  EXPECT_EQ(result.output, "nsactl: nsad is not reachable at " + address +
                               " (deadline 10 s): is the daemon running?\n");
  EXPECT_LT(result.seconds, 5.0);
}

TEST(NsactlBinary, WatchAlsoDetectsUnreachableDaemonAndUsesNsadAddr) {
  const int port = UnusedPort();
  ASSERT_GT(port, 0);
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const ProcessResult result = RunNsactl("--timeout 3 watch r1", "NSAD_ADDR=" + address);
  EXPECT_EQ(result.exit_code, kExitUnreachable) << result.output;
  EXPECT_NE(result.output.find("not reachable at " + address + " (deadline 3 s)"),
            std::string::npos)
      << result.output;
  EXPECT_LT(result.seconds, 5.0);
}

TEST(NsactlBinary, HelpAndUsageErrorExitCodes) {
  const ProcessResult help = RunNsactl("--help");
  EXPECT_EQ(help.exit_code, kExitOk);
  EXPECT_NE(help.output.find("Usage: nsactl"), std::string::npos) << help.output;
  const ProcessResult usage = RunNsactl("status");
  EXPECT_EQ(usage.exit_code, kExitUsage);
  EXPECT_NE(usage.output.find("needs a RUN_ID"), std::string::npos) << usage.output;
}

}  // namespace
}  // namespace nsactl
