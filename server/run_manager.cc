#include "run_manager.h"

#include <fcntl.h>
#include <google/protobuf/util/json_util.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <system_error>

#include "config_mapping.h"
#include "gpu_placement.h"
#include "nsa/v1/run_state.h"
#include "recent_throughput.h"
#include "trainer/checkpoint_store.h"

namespace nsad::server {

namespace fs = std::filesystem;
using nsa::v1::RunState;

namespace {

constexpr size_t kMaxEventsKept = 1024;  // a watcher further behind resumes from the latest

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string StateName(RunState s) { return nsa::v1::RunState_Name(s); }

grpc::Status Precondition(const std::string& run_id, RunState s, const std::string& wanted) {
  return {grpc::StatusCode::FAILED_PRECONDITION,
          "run " + run_id + " is " + StateName(s) + ": cannot " + wanted};
}

// write tmp -> fsync -> rename: a crash leaves either the old or the new file, never half.
void WriteFileAtomically(const fs::path& path, const std::string& content) {
  const fs::path tmp = path.string() + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot write " + tmp.string());
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n <= 0) {
      ::close(fd);
      throw std::runtime_error("short write to " + tmp.string());
    }
    done += static_cast<size_t>(n);
  }
  ::fsync(fd);
  ::close(fd);
  fs::rename(tmp, path);
}

// A run keeps its last checkpoint_keep checkpoints (step_*) in checkpoint_dir and deletes the
// older ones, whoever wrote them. A folder that already holds checkpoints is therefore only
// taken by a run that continues them (resume_from inside it, or "latest"); otherwise the
// message says what is there. Empty = fine.
std::string ForeignCheckpoints(const TrainConfig& config) {
  if (config.checkpoint_dir.empty() || config.resume_from == "latest") return "";
  // What PruneCheckpoints would delete: the store's own listing.
  const auto stored = checkpoint::ListCheckpoints(config.checkpoint_dir);
  if (stored.empty()) return "";
  const std::string found = fs::path(stored.back().path).filename().string();
  if (!config.resume_from.empty()) {
    std::error_code ignored;
    const fs::path parent = fs::weakly_canonical(fs::path(config.resume_from), ignored).parent_path();
    if (parent == fs::weakly_canonical(config.checkpoint_dir, ignored)) return "";
  }
  return config.checkpoint_dir + " already holds checkpoints (" + found +
         ") that this run would prune; give an empty folder, or resume_from one of them";
}

// A checkpoint_dir the run could not write would fail it at its first checkpoint, after
// checkpoint_every steps of work: found here instead. Empty = fine (or no checkpoints asked).
std::string UnwritableCheckpointDir(const TrainConfig& config) {
  if (config.checkpoint_dir.empty() || config.checkpoint_every <= 0) return "";
  std::error_code error;
  fs::create_directories(config.checkpoint_dir, error);
  if (error) return "cannot create " + config.checkpoint_dir + ": " + error.message();
  if (::access(config.checkpoint_dir.c_str(), W_OK) != 0) {
    return "cannot write " + config.checkpoint_dir + ": " + std::strerror(errno);
  }
  return "";
}

}  // namespace

struct RunManager::Run {
  std::mutex mutex;
  std::condition_variable changed;  // state, progress or events changed
  nsa::v1::RunInfo info;
  TrainConfig config;
  std::deque<nsa::v1::RunEvent> events;
  int64_t next_sequence = 1;
  GateReport gates;
  bool has_gates = false;
  double step_seconds = 0.0;
  double data_seconds = 0.0;  // of the last step's step_seconds
  RecentThroughput recent;    // steps this daemon ran (a restart starts it afresh)
  std::thread thread;
  AbortSlot abort;  // the trainer's (from its workers' start): WatchHalts may end its work
  std::chrono::steady_clock::time_point halting_since;  // when the run last became HALTING
  bool aborted = false;  // WatchHalts ended the work in flight
  // The GPUs its workers use while it is not ended (TryPlaceOnGpus) and, while it waits for
  // room on them (--runs-per-gpu), its place in the queue. Guarded by the manager's mutex_;
  // Execute reads them in its own thread once they are set.
  std::vector<int> gpus;
  bool waiting = false;
  int64_t ticket = 0;
};

RunManager::RunManager(std::string state_dir, Metrics* metrics, TrainerFactory factory,
                       ConfigChecker checker, RunManagerOptions options)
    : state_dir_(std::move(state_dir)),
      metrics_(metrics),
      factory_(std::move(factory)),
      checker_(std::move(checker)),
      options_(options) {
  fs::create_directories(RunsDir());
  LoadPersistedRuns();
  if (options_.halt_timeout.count() > 0) halt_watch_ = std::thread([this] { WatchHalts(); });
}

RunManager::~RunManager() {
  Shutdown();
  WaitForRuns();  // WatchHalts still ends steps that outlast the shutdown's halt
  {
    std::lock_guard<std::mutex> lock(mutex_);
    watch_ended_ = true;
  }
  watch_wake_.notify_all();
  if (halt_watch_.joinable()) halt_watch_.join();
}

void RunManager::WatchHalts() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!watch_ended_) {
    watch_wake_.wait_for(lock, std::chrono::seconds(1));
    if (watch_ended_) break;
    const auto runs = runs_;
    lock.unlock();  // the runs are checked without holding up Start, List and the rest
    const auto now = std::chrono::steady_clock::now();
    for (const auto& [id, run] : runs) {
      std::lock_guard<std::mutex> run_lock(run->mutex);
      if (run->info.state() != nsa::v1::HALTING || run->aborted) continue;
      if (now - run->halting_since < options_.halt_timeout) continue;
      run->aborted = run->abort.Abort();
      if (run->aborted) {
        spdlog::warn("run {}: its work had not ended {} s after the halt; killed its workers", id,
                     options_.halt_timeout.count());
      }
    }
    lock.lock();
  }
}

void RunManager::WaitForRuns() {
  // After Shutdown no thread is started any more (Start and Restart check shutting_down_
  // under mutex_), so the handles can be taken and joined without holding the lock.
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& [id, run] : runs_) threads.push_back(std::move(run->thread));
  }
  for (auto& thread : threads) {
    if (thread.joinable()) thread.join();
  }
}

void RunManager::Shutdown() {
  std::map<std::string, std::shared_ptr<Run>> runs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (shutting_down_) return;
    shutting_down_ = true;
    runs = runs_;
  }
  for (auto& [id, run] : runs) {
    std::lock_guard<std::mutex> lock(run->mutex);
    if (!nsa::v1::IsTerminal(run->info.state()) && run->info.state() != nsa::v1::HALTING) {
      Transition(*run, nsa::v1::HALTING, "daemon shutting down");
    }
    run->changed.notify_all();
  }
  gpus_freed_.notify_all();
}

void RunManager::LoadPersistedRuns() {
  for (const auto& entry : fs::directory_iterator(RunsDir())) {
    const fs::path file = entry.path() / "run.json";
    if (!fs::exists(file)) continue;
    std::ifstream in(file);
    std::stringstream buffer;
    buffer << in.rdbuf();
    auto run = std::make_shared<Run>();
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = true;  // records written by a newer daemon stay readable
    if (!google::protobuf::util::JsonStringToMessage(buffer.str(), &run->info, options).ok()) {
      spdlog::warn("ignoring unreadable run record {}", file.string());
      continue;
    }
    run->config = FromProto(run->info.config());
    if (!nsa::v1::IsTerminal(run->info.state())) {
      // The process that ran it is gone; say so instead of showing a run that never moves.
      run->info.set_message("daemon stopped while the run was " + StateName(run->info.state()));
      run->info.set_state(nsa::v1::FAILED);
      PersistOrLog(*run);  // a full or read-only state dir: serve what is known, do not abort
    }
    const std::string& id = run->info.run_id();
    if (id.rfind("run-", 0) == 0) {
      try {
        next_id_ = std::max<int64_t>(next_id_, std::stoll(id.substr(4)) + 1);
      } catch (const std::exception&) {
      }
    }
    metrics_->SetState(id, run->info.state());
    runs_[id] = run;
  }
  if (!runs_.empty()) spdlog::info("loaded {} run records from {}", runs_.size(), state_dir_);
}

fs::path RunManager::RunsDir() const { return fs::path(state_dir_) / "runs"; }

fs::path RunManager::RunDir(const std::string& run_id) const { return RunsDir() / run_id; }

std::string RunManager::NextRunId() {
  // Past every folder in runs/ too: a record that could not be read (and so set no next_id_)
  // still owns its folder and checkpoints.
  while (true) {
    char id[32];
    std::snprintf(id, sizeof(id), "run-%06lld", static_cast<long long>(next_id_++));
    std::error_code ignored;
    if (!fs::exists(RunDir(id), ignored)) return id;
  }
}

grpc::Status RunManager::Start(const nsa::v1::StartRunRequest& request, nsa::v1::RunInfo* out) {
  nsa::v1::RunConfig proto;
  switch (request.source_case()) {
    case nsa::v1::StartRunRequest::kConfig:
      proto = request.config();
      break;
    case nsa::v1::StartRunRequest::kConfigJson: {
      const std::string error = ParseRunConfigJson(request.config_json(), &proto);
      if (!error.empty()) {
        return {grpc::StatusCode::INVALID_ARGUMENT, "config_json: " + error};
      }
      break;
    }
    default:
      return {grpc::StatusCode::INVALID_ARGUMENT, "config: required (config or config_json)"};
  }
  const auto unknown = UnknownFieldPaths(proto);
  if (!unknown.empty()) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "config: unknown field " + unknown.front() + " (client newer than daemon?)"};
  }
  // FromProto reads a value it does not know as auto: a newer client's backend must not run as
  // another one.
  if (!nsa::v1::AttentionBackend_IsValid(proto.attention_backend())) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "invalid config: attention_backend: unknown value " +
                                                    std::to_string(proto.attention_backend())};
  }
  TrainConfig config = FromProto(proto);
  config.allow_fault_injection = options_.allow_fault_injection;
  auto errors = ValidateConfig(config);
  if (errors.empty() && checker_) errors = checker_(config);
  if (!errors.empty()) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "invalid config: " + FormatFieldErrors(errors)};
  }

  auto run = std::make_shared<Run>();
  run->config = config;
  std::unique_lock<std::mutex> manager_lock(mutex_);
  if (shutting_down_) return {grpc::StatusCode::UNAVAILABLE, "daemon is shutting down"};
  if (const std::string used_by = CheckpointDirUser(config.checkpoint_dir); !used_by.empty()) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "invalid config: checkpoint_dir: " + config.checkpoint_dir + " is the checkpoint folder of run " +
                used_by + " (a run prunes its folder to its last checkpoint_keep checkpoints)"};
  }
  if (const std::string error = ForeignCheckpoints(config); !error.empty()) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "invalid config: checkpoint_dir: " + error};
  }
  if (const std::string error = UnwritableCheckpointDir(config); !error.empty()) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "invalid config: checkpoint_dir: " + error};
  }
  const std::string id = NextRunId();
  run->info.set_run_id(id);
  if (run->config.checkpoint_dir.empty()) {
    // Every run checkpoints into its own folder unless the config says otherwise.
    run->config.checkpoint_dir = (RunDir(id) / "checkpoints").string();
  }
  config = run->config;
  run->ticket = next_ticket_++;
  run->waiting = !TryPlaceOnGpus(*run);
  *run->info.mutable_config() = ToProto(config);
  run->info.set_attention_backend(ToProto(config.attention_backend));
  run->info.set_created_unix_ms(NowMs());
  run->info.mutable_progress()->set_max_steps(config.max_steps);
  run->info.mutable_progress()->set_val_loss(std::numeric_limits<double>::quiet_NaN());
  run->info.set_state(nsa::v1::PENDING);
  if (run->waiting) run->info.set_message(WaitingMessage());
  run->info.set_updated_unix_ms(NowMs());
  // The record is on disk before the run exists: a state dir that cannot take it refuses the
  // run instead of leaving one that no restart would know. (Written once: Transition would
  // write it again, and only log a failure.)
  try {
    fs::create_directories(RunDir(id));
    Persist(*run);
  } catch (const std::exception& e) {
    std::error_code ignored;
    fs::remove_all(RunDir(id), ignored);
    return {grpc::StatusCode::FAILED_PRECONDITION,
            "state_dir: cannot record run " + id + " under " + RunsDir().string() + ": " + e.what()};
  }
  runs_[id] = run;
  {
    std::lock_guard<std::mutex> lock(run->mutex);
    Announce(*run);
    *out = run->info;
  }
  spdlog::info("run {} started: {}", out->run_id(), config.name);
  // Still under mutex_, which guards run->thread against WaitForRuns.
  return StartThread(run, out);
}

grpc::Status RunManager::StartThread(const std::shared_ptr<Run>& run, nsa::v1::RunInfo* out) {
  JoinEndedRunThreads();
  try {
    run->thread = std::thread([this, run] { Execute(run); });
    return grpc::Status::OK;
  } catch (const std::system_error& e) {
    // Out of threads or address space (a cgroup's pids limit, RLIMIT_AS): the run fails with
    // the reason rather than the exception ending the daemon.
    const std::string why = std::string("could not start the run's thread: ") + e.what();
    spdlog::error("run {}: {}", run->info.run_id(), why);
    std::lock_guard<std::mutex> lock(run->mutex);
    Transition(*run, nsa::v1::FAILED, why);
    *out = run->info;
    return {grpc::StatusCode::RESOURCE_EXHAUSTED, "run " + run->info.run_id() + " " + why};
  }
}

void RunManager::JoinEndedRunThreads() {
  for (auto& [id, other] : runs_) {
    if (!other->thread.joinable()) continue;
    bool ended = false;
    {
      std::lock_guard<std::mutex> lock(other->mutex);
      ended = nsa::v1::IsTerminal(other->info.state());
    }
    // An ended run's thread only logs and wakes waiting runs after its last transition; it
    // takes no lock of the manager's, so joining it here waits for nothing.
    if (ended) other->thread.join();
  }
}

RunManager::Ending RunManager::HaltAborted(Run& run, const std::string& what_hung, const std::string& error) {
  const std::string message = run.info.message() + "; " + what_hung + " " +
                              std::to_string(options_.halt_timeout.count()) +
                              " s after the halt, so its workers were killed";
  spdlog::warn("run {} halted: {} ({})", run.info.run_id(), message, error);
  return {nsa::v1::HALTED, message};
}

RunManager::Ending RunManager::FinishHalt(Run& run, Trainer& trainer) {
  std::string checkpoint, failure;
  try {
    checkpoint = trainer.Checkpoint();
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(run.mutex);
    if (run.aborted) {  // WatchHalts killed the workers mid-write: the earlier checkpoints stand
      return HaltAborted(run, "its checkpoint had not been written", e.what());
    }
    failure = std::string("; its checkpoint could not be written: ") + e.what();
    spdlog::error("run {}: the halt's checkpoint failed: {}", run.info.run_id(), e.what());
  }
  std::lock_guard<std::mutex> lock(run.mutex);
  if (!checkpoint.empty()) run.info.mutable_progress()->set_last_checkpoint(checkpoint);
  return {nsa::v1::HALTED, run.info.message() + failure};
}

void RunManager::Execute(const std::shared_ptr<Run>& run) {
  // However the run ends, a run waiting for its GPUs may now have room.
  struct WakeWaitingRuns {
    std::condition_variable& freed;
    ~WakeWaitingRuns() { freed.notify_all(); }
  } wake{gpus_freed_};
  const std::string id = run->info.run_id();
  if (!WaitForGpus(*run)) {
    std::lock_guard<std::mutex> lock(run->mutex);
    Transition(*run, nsa::v1::HALTED, run->info.message() + " (while waiting for a GPU)");
    return;
  }
  {
    std::lock_guard<std::mutex> lock(run->mutex);
    run->aborted = false;
  }
  std::unique_ptr<Trainer> trainer;
  try {
    trainer = factory_(RunDir(id).string(), run->config,
                       ChoosesGpus(run->config) ? run->gpus : std::vector<int>{}, &run->abort);
  } catch (const ConfigError& e) {
    std::lock_guard<std::mutex> lock(run->mutex);
    Transition(*run, nsa::v1::FAILED, std::string("invalid config: ") + e.what());
    return;
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(run->mutex);
    const Ending ending = run->aborted
                              ? HaltAborted(*run, "its trainer had not started", e.what())
                              : Ending{nsa::v1::FAILED, std::string("could not build the trainer: ") + e.what()};
    Transition(*run, ending.state, ending.message);
    return;
  }
  const std::string backend = ToString(trainer->attention_backend());
  {
    std::lock_guard<std::mutex> lock(run->mutex);
    run->info.set_device(trainer->device());
    run->info.set_attention_backend(ToProto(trainer->attention_backend()));
    run->info.set_parameter_count(trainer->parameter_count());
    if (run->info.state() == nsa::v1::PENDING) Transition(*run, nsa::v1::RUNNING, "");
  }
  metrics_->RecordDevices(id, trainer->device(), backend);
  spdlog::info("run {}: {} parameters on {} (attention backend {})", id,
               trainer->parameter_count(), trainer->device(), backend);

  const TrainConfig& config = run->config;
  Ending ending{nsa::v1::FAILED, ""};
  while (true) {
    bool halting = false;
    {
      std::unique_lock<std::mutex> lock(run->mutex);
      if (run->info.state() == nsa::v1::PAUSING) Transition(*run, nsa::v1::PAUSED, "");
      run->changed.wait(lock, [&] { return run->info.state() != nsa::v1::PAUSED; });
      halting = run->info.state() == nsa::v1::HALTING;
    }
    if (halting) {
      ending = FinishHalt(*run, *trainer);
      break;
    }
    StepMetrics m;
    double val_loss = std::numeric_limits<double>::quiet_NaN();
    try {
      m = trainer->Step();
      if (config.eval_every > 0 && (m.step % config.eval_every == 0 || trainer->finished())) {
        val_loss = trainer->Evaluate();
      }
    } catch (const TrainingHalt& e) {
      spdlog::error("run {} halted by the engine at step {}: {}", id, e.step(), e.what());
      ending = {nsa::v1::HALTED, e.what()};
      break;
    } catch (const std::exception& e) {
      std::lock_guard<std::mutex> lock(run->mutex);
      if (run->aborted) {  // the halt's timeout killed the workers: halted, not failed
        ending = HaltAborted(*run, "its step had not ended", e.what());
        break;
      }
      spdlog::error("run {} failed: {}", id, e.what());
      ending = {nsa::v1::FAILED, e.what()};
      break;
    }
    const GateReport gates = trainer->gates();
    metrics_->RecordStep(id, backend, m);
    metrics_->RecordGates(id, gates);
    if (!std::isnan(val_loss)) metrics_->RecordValLoss(id, val_loss);

    std::lock_guard<std::mutex> lock(run->mutex);
    auto* p = run->info.mutable_progress();
    p->set_step(m.step);
    p->set_loss(m.loss);
    p->set_lr(m.lr);
    p->set_grad_norm(m.grad_norm);
    p->set_tokens_per_second(m.tokens_per_second);
    p->set_tokens_seen(m.tokens_seen);
    p->set_elapsed_seconds(p->elapsed_seconds() + m.step_seconds);
    p->set_skipped_steps(m.skipped_steps);
    if (!m.checkpoint.empty()) {
      p->set_last_checkpoint(m.checkpoint);
      // On disk at once: after a crash or SIGKILL of the daemon, resume starts from here.
      PersistOrLog(*run);
    }
    if (!std::isnan(val_loss)) {
      p->set_val_loss(val_loss);
      p->set_val_step(m.step);
    }
    run->step_seconds = m.step_seconds;
    run->data_seconds = m.data_seconds;
    // The step's tokens as its rate says (tokens_seen restarts from a checkpoint on resume).
    run->recent.Add(m.tokens_per_second * m.step_seconds, m.step_seconds);
    run->gates = gates;
    run->has_gates = true;
    run->info.set_updated_unix_ms(NowMs());
    if (trainer->finished()) {
      ending = {nsa::v1::COMPLETED, ""};
      break;
    }
    if (!m.skipped_reason.empty()) {
      spdlog::warn("run {} skipped the update of step {}: {}", id, m.step, m.skipped_reason);
      run->info.set_message("skipped step " + std::to_string(m.step) + ": " + m.skipped_reason);
      Publish(*run);
    } else if (m.step % config.log_every == 0 || !std::isnan(val_loss) || !m.checkpoint.empty()) {
      Publish(*run);
    }
  }
  // The workers exit before the run ends, so that an ended run's GPUs are free (a run started
  // right after it gets their memory) and ResumeRun's join of this thread waits for nothing.
  trainer.reset();
  std::lock_guard<std::mutex> lock(run->mutex);
  Transition(*run, ending.state, ending.message);
  spdlog::info("run {} ended {} at step {}", id, StateName(run->info.state()),
               run->info.progress().step());
}

void RunManager::Transition(Run& run, RunState state, const std::string& message) {
  if (state == nsa::v1::HALTING) run.halting_since = std::chrono::steady_clock::now();
  run.info.set_state(state);
  run.info.set_message(message);
  run.info.set_updated_unix_ms(NowMs());
  PersistOrLog(run);
  Announce(run);
}

void RunManager::Announce(Run& run) {
  metrics_->SetState(run.info.run_id(), run.info.state());
  Publish(run);
}

void RunManager::PersistOrLog(const Run& run) {
  try {
    Persist(run);
  } catch (const std::exception& e) {
    spdlog::error("run {}: cannot persist its record: {}", run.info.run_id(), e.what());
  }
}

bool RunManager::ChoosesGpus(const TrainConfig& config) const {
  return config.device == "auto" && options_.cuda_devices > 0;
}

bool RunManager::TryPlaceOnGpus(Run& run) {
  const TrainConfig& config = run.config;
  const int devices = options_.cuda_devices;
  const bool placed = ChoosesGpus(config);
  std::vector<int> load(devices, 0);
  std::vector<const Run*> waiting_before;  // earlier runs still waiting for GPUs
  for (const auto& [id, other] : runs_) {
    if (other.get() == &run) continue;
    std::lock_guard<std::mutex> lock(other->mutex);
    const RunState state = other->info.state();
    if (nsa::v1::IsTerminal(state)) continue;  // its workers are gone
    if (other->waiting) {
      if (other->ticket < run.ticket && state != nsa::v1::HALTING) waiting_before.push_back(other.get());
      continue;  // it holds no GPU yet
    }
    for (const int gpu : other->gpus) {
      if (gpu >= 0 && gpu < devices) ++load[gpu];
    }
  }
  std::vector<int> gpus = placed ? LeastLoadedGpus(load, config.world_size) : std::vector<int>{};
  // Named devices, and a run wanting more GPUs than there are (the config check refused it).
  if (gpus.empty()) gpus = NamedGpus(config.device, config.world_size, devices);
  run.gpus.clear();
  if (options_.runs_per_gpu > 0) {
    for (const int gpu : gpus) {
      if (gpu >= 0 && gpu < devices && load[gpu] >= options_.runs_per_gpu) return false;
    }
    // First come, first served among runs that want the same GPUs: an earlier run waiting for
    // any GPU (auto) or for one of these goes first.
    for (const Run* earlier : waiting_before) {
      if (earlier->config.device == "auto" && devices > 0) return false;
      for (const int gpu : NamedGpus(earlier->config.device, earlier->config.world_size, devices)) {
        if (std::find(gpus.begin(), gpus.end(), gpu) != gpus.end()) return false;
      }
    }
  }
  run.gpus = gpus;
  if (placed) {
    std::lock_guard<std::mutex> lock(run.mutex);
    run.info.set_device(GpuNames(run.gpus));  // before its workers report it
  }
  int sharing = 0;  // the most other runs on one of its GPUs
  for (const int gpu : run.gpus) {
    if (gpu >= 0 && gpu < devices) sharing = std::max(sharing, load[gpu]);
  }
  if (placed && sharing > 0) {
    spdlog::warn("run {}: every GPU is in use; it shares {} with {} other run(s)", run.info.run_id(),
                 GpuNames(run.gpus), sharing);
  }
  return true;
}

bool RunManager::WaitForGpus(Run& run) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (run.waiting) {
    {
      std::lock_guard<std::mutex> run_lock(run.mutex);
      // The shutdown halts every run, but a run ending before it came to this one could have
      // made room: a worker started only to be halted.
      if (shutting_down_ && run.info.state() != nsa::v1::HALTING) {
        Transition(run, nsa::v1::HALTING, "daemon shutting down");
      }
      if (run.info.state() == nsa::v1::HALTING) return false;
    }
    if (TryPlaceOnGpus(run)) {
      run.waiting = false;
      spdlog::info("run {}: a GPU has room, starting on {}", run.info.run_id(), GpuNames(run.gpus));
      break;
    }
    // Ended and halted runs wake it; the timeout covers a wake-up sent while it was checking.
    gpus_freed_.wait_for(lock, std::chrono::milliseconds(500));
  }
  return true;
}

std::string RunManager::WaitingMessage() const {
  return "waiting for a GPU (at most " + std::to_string(options_.runs_per_gpu) +
         " live run(s) on each: nsad --runs-per-gpu)";
}

std::string RunManager::CheckpointDirUser(const std::string& dir) const {
  if (dir.empty()) return "";
  std::error_code ignored;
  const fs::path wanted = fs::weakly_canonical(dir, ignored);
  for (const auto& [id, run] : runs_) {
    std::lock_guard<std::mutex> lock(run->mutex);
    if (nsa::v1::IsTerminal(run->info.state())) continue;  // a resume is refused while the folder is taken
    if (fs::weakly_canonical(run->config.checkpoint_dir, ignored) == wanted) return id;
  }
  return "";
}

void RunManager::Publish(Run& run) {
  nsa::v1::RunEvent event;
  event.set_sequence(run.next_sequence++);
  event.set_state(run.info.state());
  *event.mutable_progress() = run.info.progress();
  event.set_message(run.info.message());
  run.events.push_back(std::move(event));
  if (run.events.size() > kMaxEventsKept) run.events.pop_front();
  run.changed.notify_all();
}

void RunManager::Persist(const Run& run) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  google::protobuf::util::MessageToJsonString(run.info, &json, options);
  WriteFileAtomically(RunDir(run.info.run_id()) / "run.json", json);
}

std::shared_ptr<RunManager::Run> RunManager::Find(const std::string& run_id, grpc::Status* status) {
  if (run_id.empty()) {
    *status = {grpc::StatusCode::INVALID_ARGUMENT, "run_id: required"};
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = runs_.find(run_id);
  if (it == runs_.end()) {
    *status = {grpc::StatusCode::NOT_FOUND, "run_id: no run " + run_id};
    return nullptr;
  }
  return it->second;
}

grpc::Status RunManager::Pause(const std::string& run_id, nsa::v1::RunInfo* out) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::lock_guard<std::mutex> lock(run->mutex);
  const RunState s = run->info.state();
  if (s != nsa::v1::PENDING && s != nsa::v1::RUNNING) return Precondition(run_id, s, "pause");
  Transition(*run, nsa::v1::PAUSING, "");
  *out = run->info;
  return grpc::Status::OK;
}

grpc::Status RunManager::Resume(const std::string& run_id, nsa::v1::RunInfo* out) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::unique_lock<std::mutex> lock(run->mutex);
  const RunState s = run->info.state();
  if (s == nsa::v1::HALTED || s == nsa::v1::FAILED) {
    lock.unlock();
    return Restart(run, out);
  }
  if (s != nsa::v1::PAUSING && s != nsa::v1::PAUSED) return Precondition(run_id, s, "resume");
  // A run still building its trainer stays PENDING; Execute moves it to RUNNING.
  const bool started = run->info.parameter_count() > 0;
  Transition(*run, started ? nsa::v1::RUNNING : nsa::v1::PENDING, "");
  *out = run->info;
  return grpc::Status::OK;
}

grpc::Status RunManager::Restart(const std::shared_ptr<Run>& run, nsa::v1::RunInfo* out) {
  const std::string& id = run->info.run_id();
  std::lock_guard<std::mutex> manager_lock(mutex_);  // guards run->thread against WaitForRuns
  if (shutting_down_) return {grpc::StatusCode::UNAVAILABLE, "daemon is shutting down"};
  std::unique_lock<std::mutex> lock(run->mutex);
  const RunState s = run->info.state();
  if (s != nsa::v1::HALTED && s != nsa::v1::FAILED) return Precondition(id, s, "resume");
  std::string checkpoint = run->info.progress().last_checkpoint();
  if (checkpoint.empty() || !fs::exists(checkpoint)) {
    // The record can lag the folder by one checkpoint (a daemon killed between the worker's
    // checkpoint and the record's rewrite, which keep-last pruning may have removed the
    // recorded one in): the newest committed checkpoint of the run's folder is as good.
    if (checkpoint::ListCheckpoints(run->config.checkpoint_dir).empty()) {
      return {grpc::StatusCode::FAILED_PRECONDITION,
              "run " + id + " is " + StateName(s) + " and has no checkpoint to resume from"};
    }
    checkpoint = "latest";
  }
  // The previous thread has finished its run (terminal state); reap it outside the lock.
  std::thread previous = std::move(run->thread);
  lock.unlock();
  if (previous.joinable()) previous.join();
  run->ticket = next_ticket_++;
  run->waiting = !TryPlaceOnGpus(*run);  // afresh: the GPUs it had may have been taken since it ended
  lock.lock();
  run->config.resume_from = checkpoint;
  *run->info.mutable_config() = ToProto(run->config);
  run->info.set_parameter_count(0);  // set again once the new worker has loaded it
  Transition(*run, nsa::v1::PENDING,
             "resuming from " + checkpoint + (run->waiting ? "; " + WaitingMessage() : std::string()));
  *out = run->info;
  lock.unlock();
  spdlog::info("run {} resuming from {}", id, checkpoint);
  return StartThread(run, out);
}

grpc::Status RunManager::Halt(const std::string& run_id, const std::string& reason,
                              nsa::v1::RunInfo* out) {
  if (reason.size() > nsa::v1::kMaxHaltReasonBytes) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "reason: at most " + std::to_string(nsa::v1::kMaxHaltReasonBytes) +
                                                    " bytes (got " + std::to_string(reason.size()) + ")"};
  }
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::lock_guard<std::mutex> lock(run->mutex);
  const RunState s = run->info.state();
  if (nsa::v1::IsTerminal(s) || s == nsa::v1::HALTING) return Precondition(run_id, s, "halt");
  Transition(*run, nsa::v1::HALTING, reason.empty() ? "halted by request" : reason);
  spdlog::info("run {} halting: {}", run_id, run->info.message());
  *out = run->info;
  gpus_freed_.notify_all();  // a run waiting for a GPU ends; those behind it may go
  return grpc::Status::OK;
}

grpc::Status RunManager::Get(const std::string& run_id, nsa::v1::RunInfo* out) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::lock_guard<std::mutex> lock(run->mutex);
  *out = run->info;
  return grpc::Status::OK;
}

grpc::Status RunManager::List(const nsa::v1::ListRunsRequest& request,
                              nsa::v1::ListRunsResponse* out) {
  for (int s : request.states()) {
    if (!nsa::v1::RunState_IsValid(s) || s == nsa::v1::RUN_STATE_UNSPECIFIED) {
      return {grpc::StatusCode::INVALID_ARGUMENT, "states: invalid state " + std::to_string(s)};
    }
  }
  if (request.page_size() < 0) {
    return {grpc::StatusCode::INVALID_ARGUMENT,
            "page_size: must not be negative (got " + std::to_string(request.page_size()) + ")"};
  }
  if (request.page_token().size() > kMaxNameBytes) {
    return {grpc::StatusCode::INVALID_ARGUMENT, "page_token: not one this daemon gave"};
  }
  const int page_size = request.page_size() == 0 ? kMaxListPageRuns : std::min(request.page_size(), kMaxListPageRuns);
  std::map<std::string, std::shared_ptr<Run>> runs;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    runs = runs_;
  }
  // std::map: ordered by id, i.e. by creation. The token is the last id of the page before.
  size_t bytes = 0;
  for (auto it = runs.upper_bound(request.page_token()); it != runs.end(); ++it) {
    std::lock_guard<std::mutex> lock(it->second->mutex);
    const nsa::v1::RunInfo& info = it->second->info;
    bool wanted = request.states().empty();
    for (int s : request.states()) wanted = wanted || s == info.state();
    if (!wanted) continue;
    const size_t size = info.ByteSizeLong() + 8;  // and its field's tag and length
    if (out->runs_size() == page_size || (out->runs_size() > 0 && bytes + size > kMaxListPageBytes)) {
      out->set_next_page_token(out->runs(out->runs_size() - 1).run_id());
      break;
    }
    *out->add_runs() = info;
    bytes += size;
  }
  return grpc::Status::OK;
}

grpc::Status RunManager::Watch(const std::string& run_id, grpc::ServerContext* context,
                               grpc::ServerWriterInterface<nsa::v1::RunEvent>* writer) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::unique_lock<std::mutex> lock(run->mutex);
  // First the current state, then every event published after it.
  nsa::v1::RunEvent current;
  current.set_sequence(run->next_sequence - 1);
  current.set_state(run->info.state());
  *current.mutable_progress() = run->info.progress();
  current.set_message(run->info.message());
  int64_t last_sent = current.sequence();
  lock.unlock();
  if (!writer->Write(current)) return grpc::Status::OK;
  if (nsa::v1::IsTerminal(current.state())) return grpc::Status::OK;

  while (true) {
    std::vector<nsa::v1::RunEvent> pending;
    lock.lock();
    run->changed.wait_for(lock, std::chrono::milliseconds(200),
                          [&] { return run->next_sequence - 1 > last_sent; });
    for (const auto& event : run->events) {
      if (event.sequence() > last_sent) pending.push_back(event);
    }
    lock.unlock();
    for (const auto& event : pending) {
      if (!writer->Write(event)) return grpc::Status::OK;  // client went away
      last_sent = event.sequence();
      if (nsa::v1::IsTerminal(event.state())) return grpc::Status::OK;
    }
    if (context->IsCancelled()) return {grpc::StatusCode::CANCELLED, "watch cancelled"};
  }
}

grpc::Status RunManager::Gates(const std::string& run_id, nsa::v1::InspectGatesResponse* out) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::lock_guard<std::mutex> lock(run->mutex);
  if (!run->has_gates) {
    return {grpc::StatusCode::FAILED_PRECONDITION,
            "run " + run_id + " has not completed a step yet: no gate statistics"};
  }
  out->set_run_id(run_id);
  out->set_step(run->gates.step);
  for (const auto& layer : run->gates.layers) ToProto(layer, out->add_layers());
  return grpc::Status::OK;
}

grpc::Status RunManager::Throughput(const std::string& run_id,
                                    nsa::v1::GetThroughputResponse* out) {
  grpc::Status status;
  auto run = Find(run_id, &status);
  if (!run) return status;
  std::lock_guard<std::mutex> lock(run->mutex);
  const auto& p = run->info.progress();
  out->set_run_id(run_id);
  out->set_step(p.step());
  out->set_tokens_per_second(p.tokens_per_second());
  out->set_tokens_seen(p.tokens_seen());
  out->set_step_seconds(run->step_seconds);
  out->set_data_seconds(run->data_seconds);
  out->set_mean_tokens_per_second(p.elapsed_seconds() > 0 ? p.tokens_seen() / p.elapsed_seconds()
                                                           : 0.0);
  out->set_recent_tokens_per_second(run->recent.TokensPerSecond());
  out->set_recent_steps(run->recent.steps());
  return grpc::Status::OK;
}

}  // namespace nsad::server
