// The run manager's GPU placement and its queue (--runs-per-gpu) with a fake trainer on fake
// GPUs: where each run's workers are put, when a run waits, and how a waiting run ends. The
// daemon tests check the same on real GPUs where the lent machine has them; these run in CI.
#include "run_manager.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "../common/temp_dir.h"
#include "config_mapping.h"
#include "gpu_placement.h"

namespace nsad::server {
namespace {

namespace fs = std::filesystem;

long VmSizeKb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmSize:", 0) == 0) return std::stol(line.substr(7));
  }
  return 0;
}

// Steps every few milliseconds until max_steps, on the GPUs the manager handed it.
class FakeTrainer final : public Trainer {
 public:
  FakeTrainer(const TrainConfig& config, const std::vector<int>& gpus)
      : config_(config), device_(gpus.empty() ? config.device : GpuNames(gpus)) {}
  StepMetrics Step() override {
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
    StepMetrics m;
    m.step = ++step_;
    m.loss = 1.0;
    m.step_seconds = 0.002;
    return m;
  }
  double Evaluate() override { return 1.0; }
  std::string Checkpoint() override { return ""; }
  int64_t step() const override { return step_; }
  bool finished() const override { return step_ >= config_.max_steps; }
  GateReport gates() const override { return {}; }
  const TrainConfig& config() const override { return config_; }
  std::string device() const override { return device_; }
  AttentionBackend attention_backend() const override { return AttentionBackend::kReference; }
  int64_t parameter_count() const override { return 1; }

 private:
  TrainConfig config_;
  std::string device_;
  int64_t step_ = 0;
};

class RunManagerTest : public ::testing::Test {
 protected:
  void SetUp() override { std::ofstream(shard_) << "tokens"; }
  void TearDown() override { manager_.reset(); }

  void MakeManager(int cuda_devices, int runs_per_gpu) {
    RunManagerOptions options;
    options.cuda_devices = cuda_devices;
    options.runs_per_gpu = runs_per_gpu;
    auto factory = [this](const std::string& run_dir, const TrainConfig& config, const std::vector<int>& gpus,
                          AbortSlot*) -> std::unique_ptr<Trainer> {
      std::lock_guard<std::mutex> lock(mutex_);
      built_[fs::path(run_dir).filename().string()] = gpus;
      return std::make_unique<FakeTrainer>(config, gpus);
    };
    manager_ = std::make_unique<RunManager>(state_.path(), &metrics_, factory, nullptr, options);
  }
  // A run that trains until halted (or for `steps`).
  std::string Start(const std::string& device, int world_size = 1, int64_t steps = 100000000) {
    TrainConfig config;
    config.data.train_path = shard_;
    config.device = device;
    config.world_size = world_size;
    config.max_steps = steps;
    config.eval_every = 0;
    nsa::v1::StartRunRequest request;
    *request.mutable_config() = ToProto(config);
    nsa::v1::RunInfo info;
    const grpc::Status status = manager_->Start(request, &info);
    EXPECT_TRUE(status.ok()) << status.error_message();
    return info.run_id();
  }
  nsa::v1::RunInfo Get(const std::string& id) {
    nsa::v1::RunInfo info;
    EXPECT_TRUE(manager_->Get(id, &info).ok());
    return info;
  }
  bool WaitFor(const std::string& id, const std::function<bool(const nsa::v1::RunInfo&)>& done) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (std::chrono::steady_clock::now() < until) {
      if (done(Get(id))) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return false;
  }
  bool Training(const std::string& id) {
    return WaitFor(id, [](const nsa::v1::RunInfo& r) { return r.progress().step() > 0; });
  }
  bool Ended(const std::string& id) {
    return WaitFor(id, [](const nsa::v1::RunInfo& r) { return r.state() >= nsa::v1::HALTED; });
  }
  void Halt(const std::string& id) {
    nsa::v1::RunInfo info;
    ASSERT_TRUE(manager_->Halt(id, "halted by the test", &info).ok());
  }
  // The GPUs the run's trainer was built with; absent: never built.
  bool Built(const std::string& id, std::vector<int>* gpus = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = built_.find(id);
    if (it != built_.end() && gpus) *gpus = it->second;
    return it != built_.end();
  }

  testing::TempDir state_{"nsad-run-manager-test"};
  const std::string shard_ = state_.path() + "/shard.bin";
  Metrics metrics_;
  std::mutex mutex_;
  std::map<std::string, std::vector<int>> built_;
  std::unique_ptr<RunManager> manager_;
};

// Before: every run with device auto went on cuda:0, however many GPUs stood idle.
TEST_F(RunManagerTest, AutoRunsGoOnTheGpusTheFewestLiveRunsHold) {
  MakeManager(2, 0);
  const std::string a = Start("auto"), b = Start("auto");
  EXPECT_EQ(Get(a).device(), "cuda:0") << "placed at the start";
  EXPECT_EQ(Get(b).device(), "cuda:1");
  ASSERT_TRUE(Training(a) && Training(b));
  std::vector<int> gpus;
  ASSERT_TRUE(Built(b, &gpus));
  EXPECT_EQ(gpus, std::vector<int>({1})) << "the worker is told its GPU";
  const std::string c = Start("auto");
  EXPECT_EQ(Get(c).device(), "cuda:0") << "no limit: it shares the least busy GPU";
  Halt(b);
  ASSERT_TRUE(Ended(b));
  const std::string d = Start("auto");
  EXPECT_EQ(Get(d).device(), "cuda:1") << "an ended run's GPU is free again";
  const std::string named = Start("cuda:1");
  ASSERT_TRUE(Training(named));
  EXPECT_TRUE(Built(named, &gpus));
  EXPECT_TRUE(gpus.empty()) << "a named device is the config's to set";
}

TEST_F(RunManagerTest, ADataParallelAutoRunTakesTheLeastHeldGpusInRankOrder) {
  MakeManager(3, 0);
  const std::string single = Start("cuda:0");
  const std::string parallel = Start("auto", 2, 3);
  EXPECT_EQ(Get(parallel).device(), "cuda:1,cuda:2");
  ASSERT_TRUE(Ended(parallel));
  std::vector<int> gpus;
  ASSERT_TRUE(Built(parallel, &gpus));
  EXPECT_EQ(gpus, std::vector<int>({1, 2}));
  EXPECT_EQ(Get(parallel).state(), nsa::v1::COMPLETED);
  Halt(single);
}

// With --runs-per-gpu a run that finds no room waits PENDING, without a trainer, and starts
// when a run ends; before, every run started at once and shared the GPU and its memory.
TEST_F(RunManagerTest, ARunWaitsForRoomAndStartsWhenARunEnds) {
  MakeManager(1, 1);
  const std::string first = Start("auto");
  ASSERT_TRUE(Training(first));
  const std::string second = Start("auto");
  const auto waiting = Get(second);
  EXPECT_EQ(waiting.state(), nsa::v1::PENDING);
  EXPECT_EQ(waiting.message(), "waiting for a GPU (at most 1 live run(s) on each: nsad --runs-per-gpu)");
  EXPECT_EQ(waiting.device(), "");
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // past a wait's timeout
  EXPECT_FALSE(Built(second)) << "no worker while it waits";
  Halt(first);
  ASSERT_TRUE(Training(second));
  EXPECT_EQ(Get(second).device(), "cuda:0");
  EXPECT_EQ(Get(first).state(), nsa::v1::HALTED);
}

TEST_F(RunManagerTest, AWaitingRunHaltedEndsAtOnceWithoutATrainer) {
  MakeManager(1, 1);
  const std::string first = Start("cuda:0");
  const std::string second = Start("cuda:0");
  Halt(second);
  ASSERT_TRUE(Ended(second));
  const auto halted = Get(second);
  EXPECT_EQ(halted.state(), nsa::v1::HALTED);
  EXPECT_EQ(halted.message(), "halted by the test (while waiting for a GPU)");
  EXPECT_FALSE(Built(second));
  EXPECT_TRUE(Training(first)) << "the run with the GPU goes on";
}

TEST_F(RunManagerTest, WaitingRunsStartInTheOrderTheyCame) {
  MakeManager(1, 1);
  const std::string first = Start("auto");
  ASSERT_TRUE(Training(first));
  const std::string second = Start("auto"), third = Start("auto");
  Halt(first);
  ASSERT_TRUE(Training(second));
  std::this_thread::sleep_for(std::chrono::milliseconds(700));
  EXPECT_FALSE(Built(third)) << "behind the second";
  Halt(second);
  ASSERT_TRUE(Training(third));
}

// Waiting runs queue per GPU: a run whose own GPU has room does not wait behind a run that
// waits for another one.
TEST_F(RunManagerTest, ARunWithRoomOnItsGpuDoesNotWaitBehindAnother) {
  MakeManager(2, 1);
  const std::string first = Start("cuda:0");
  const std::string queued = Start("cuda:0");
  const std::string other = Start("cuda:1");
  ASSERT_TRUE(Training(other));
  EXPECT_FALSE(Built(queued));
  // An auto run wants any GPU, so it waits behind the queued one (and finds no room anyway).
  const std::string automatic = Start("auto");
  EXPECT_EQ(Get(automatic).state(), nsa::v1::PENDING);
  Halt(first);
  ASSERT_TRUE(Training(queued));
  EXPECT_FALSE(Built(automatic));
}

// The daemon's shutdown halts waiting runs too, and does not wait for them forever.
TEST_F(RunManagerTest, AShutdownEndsWaitingRuns) {
  MakeManager(1, 1);
  const std::string first = Start("auto");
  ASSERT_TRUE(Training(first));
  const std::string second = Start("auto");
  const auto started = std::chrono::steady_clock::now();
  manager_->Shutdown();
  manager_->WaitForRuns();
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  EXPECT_EQ(Get(second).state(), nsa::v1::HALTED);
  EXPECT_EQ(Get(second).message(), "daemon shutting down (while waiting for a GPU)");
  EXPECT_FALSE(Built(second));
}

// ListRuns comes in pages that fit a client's 4 MiB reply. Before, one reply held every run
// the daemon ever hosted: with configs of long paths, 600 runs were 5 MB, and
// `nsactl list` failed from then on (after a restart too: the records stay).
TEST_F(RunManagerTest, ListRunsComesInPagesThatFitAReply) {
  MakeManager(0, 0);
  // A shard under a path of about 4000 bytes (the longest ValidateConfig takes is 4096).
  std::string dir = state_.path();
  while (dir.size() < 3800) {
    dir += "/" + std::string(200, 'd');
    fs::create_directory(dir);
  }
  const std::string long_shard = dir + "/shard.bin";
  std::ofstream(long_shard) << "tokens";
  TrainConfig config;
  config.data.train_path = long_shard;
  config.data.val_path = long_shard;
  config.name = std::string(kMaxNameBytes, 'n');
  config.device = "cpu";
  config.max_steps = 1;
  config.eval_every = 0;
  constexpr int kRuns = 600;
  std::vector<std::string> ids;
  for (int i = 0; i < kRuns; ++i) {
    nsa::v1::StartRunRequest request;
    *request.mutable_config() = ToProto(config);
    nsa::v1::RunInfo info;
    ASSERT_TRUE(manager_->Start(request, &info).ok());
    ids.push_back(info.run_id());
  }
  const auto list_all = [&](int page_size, std::vector<size_t>* page_bytes) {
    std::vector<std::string> listed;
    nsa::v1::ListRunsRequest request;
    request.set_page_size(page_size);
    do {
      nsa::v1::ListRunsResponse page;
      EXPECT_TRUE(manager_->List(request, &page).ok());
      page_bytes->push_back(page.ByteSizeLong());
      for (const auto& run : page.runs()) listed.push_back(run.run_id());
      request.set_page_token(page.next_page_token());
    } while (!request.page_token().empty());
    return listed;
  };
  std::vector<size_t> bytes;
  EXPECT_EQ(list_all(0, &bytes), ids) << "every run once, in the order they came";
  size_t total = 0;
  for (const size_t b : bytes) {
    EXPECT_LE(b, RunManager::kMaxListPageBytes);
    total += b;
  }
  EXPECT_GT(total, size_t{4} << 20) << "more than one 4 MiB reply could hold";
  bytes.clear();
  EXPECT_EQ(list_all(7, &bytes), ids);
  EXPECT_EQ(bytes.size(), (kRuns + 6) / 7u);

  nsa::v1::ListRunsRequest negative;
  negative.set_page_size(-1);
  nsa::v1::ListRunsResponse page;
  const grpc::Status status = manager_->List(negative, &page);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(status.error_message().substr(0, 10), "page_size:");
}

// A run's thread is joined once the run has ended (when the next run starts), not at the
// daemon's exit: each ended run's thread kept its stack mapped. Seen here: 2000 runs of a
// fake trainer grew the process by 16.9 GB of address space (8 MB stacks) and 41 MB of
// memory, 500 in this test by 4 GB; at about 32k runs the stacks' mappings would reach
// vm.max_map_count and a start fail.
TEST_F(RunManagerTest, EndedRunsThreadsAreJoinedAsRunsComeAndGo) {
  MakeManager(0, 0);
  const long before = VmSizeKb();
  for (int i = 0; i < 500; ++i) ASSERT_TRUE(Ended(Start("cpu", 1, 1)));  // one after the other
  const long grown_mb = (VmSizeKb() - before) / 1024;
  EXPECT_LT(grown_mb, 256) << "MB of address space after 500 runs";
}

// A run whose thread cannot start (a cgroup's pids limit, RLIMIT_AS) fails with the reason;
// before, std::thread's exception left StartRun (in the daemon: through gRPC, ending it). Here
// the address space is limited to just above what the process maps, once glibc's cache of
// stacks is taken by threads that wait, so that the run's thread cannot map its stack.
TEST_F(RunManagerTest, ARunWhoseThreadCannotStartFailsWithTheReason) {
  MakeManager(0, 0);
  std::mutex gate;
  std::unique_lock<std::mutex> closed(gate);
  std::vector<std::thread> holders;
  for (int i = 0; i < 8; ++i) holders.emplace_back([&gate] { std::lock_guard<std::mutex> wait(gate); });
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_AS, &old), 0);
  rlimit tight = old;
  tight.rlim_cur = static_cast<rlim_t>(VmSizeKb() + 4096) * 1024;
  TrainConfig config;
  config.data.train_path = shard_;
  config.device = "cpu";
  config.max_steps = 1;
  nsa::v1::StartRunRequest request;
  *request.mutable_config() = ToProto(config);
  nsa::v1::RunInfo info;
  ASSERT_EQ(setrlimit(RLIMIT_AS, &tight), 0);
  grpc::Status status;
  try {
    status = manager_->Start(request, &info);
  } catch (const std::exception& e) {
    status = grpc::Status(grpc::StatusCode::INTERNAL, std::string("threw: ") + e.what());
  }
  setrlimit(RLIMIT_AS, &old);
  closed.unlock();
  for (auto& holder : holders) holder.join();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  ASSERT_FALSE(info.run_id().empty());
  const auto failed = Get(info.run_id());
  EXPECT_EQ(failed.state(), nsa::v1::FAILED);
  EXPECT_EQ(failed.message().rfind("could not start the run's thread: ", 0), 0u) << failed.message();
}

}  // namespace
}  // namespace nsad::server
