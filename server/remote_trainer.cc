#include "remote_trainer.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <thread>
#include <vector>

#include "config_mapping.h"

extern char** environ;

namespace nsad::server {
namespace worker = nsa::worker::v1;

namespace {

constexpr auto kExitGrace = std::chrono::seconds(10);  // after stdin closes, before SIGKILL

void CloseFd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

[[noreturn]] void ThrowWorkerError(const worker::Error& error) {
  switch (error.kind()) {
    case worker::Error::CONFIG: {
      std::vector<FieldError> fields;
      for (const auto& f : error.fields()) fields.push_back({f.field(), f.message()});
      if (fields.empty()) fields.push_back({"config", error.message()});
      throw ConfigError(std::move(fields));
    }
    case worker::Error::HALT:
      throw TrainingHalt(error.step(), error.message());
    default:
      throw std::runtime_error(error.message());
  }
}

}  // namespace

WorkerProcess::WorkerProcess(const std::string& worker_binary, const std::string& log_path)
    : log_path_(log_path) {
  int in_pipe[2], out_pipe[2];  // [0] read end, [1] write end
  if (::pipe2(in_pipe, O_CLOEXEC) != 0 || ::pipe2(out_pipe, O_CLOEXEC) != 0) {
    throw std::runtime_error("cannot create pipes for nsad-worker");
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, in_pipe[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out_pipe[1], STDOUT_FILENO);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, log_path.c_str(),
                                   O_WRONLY | O_CREAT | O_APPEND, 0644);
  std::string binary = worker_binary;
  char* argv[] = {binary.data(), nullptr};
  // Its own process group: a Ctrl-C at the daemon's terminal reaches only the daemon, which
  // halts runs cleanly between steps; the worker exits when its stdin closes. Signals the
  // daemon handles revert to their default action in the worker.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setpgroup(&attributes, 0);
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGINT);
  sigaddset(&handled, SIGTERM);
  posix_spawnattr_setsigdefault(&attributes, &handled);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF);
  const int rc = ::posix_spawn(&pid_, binary.c_str(), &actions, &attributes, argv, environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  ::close(in_pipe[0]);
  ::close(out_pipe[1]);
  to_worker_ = in_pipe[1];
  from_worker_ = out_pipe[0];
  if (rc != 0) {
    CloseFd(to_worker_);
    CloseFd(from_worker_);
    pid_ = -1;
    throw std::runtime_error("cannot start " + worker_binary + ": " + std::strerror(rc));
  }
  channel_ = std::make_unique<WorkerChannel>(from_worker_, to_worker_);
}

void WorkerProcess::CloseInput() {
  channel_.reset();     // it writes to_worker_, which closes next
  CloseFd(to_worker_);  // EOF on its stdin: the worker finishes and exits
}

WorkerProcess::~WorkerProcess() {
  CloseInput();
  CloseFd(from_worker_);
  const auto deadline = std::chrono::steady_clock::now() + kExitGrace;
  int status = 0;
  while (!TryReap(&status)) {
    if (std::chrono::steady_clock::now() > deadline) {
      std::lock_guard<std::mutex> lock(pid_mutex_);
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool WorkerProcess::TryReap(int* status) {
  std::lock_guard<std::mutex> lock(pid_mutex_);
  if (pid_ <= 0) return true;
  if (::waitpid(pid_, status, WNOHANG) == 0) return false;
  pid_ = -1;
  return true;
}

std::string WorkerProcess::DescribeExit() {
  int status = 0;
  const pid_t pid = pid_;  // only this thread writes pid_
  // The pipe closed, so the worker is exiting or gone; give it a moment to be reaped.
  bool reaped = TryReap(&status);
  for (int i = 0; i < 200 && !reaped; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    reaped = TryReap(&status);
  }
  std::string what = "nsad-worker (pid " + std::to_string(pid) + ") ";
  if (!reaped) {
    what += "closed its pipe but did not exit; killed";
    Kill();  // the destructor reaps it
  } else if (WIFSIGNALED(status)) {
    what += "was killed by signal " + std::to_string(WTERMSIG(status)) + " (" +
            strsignal(WTERMSIG(status)) + ")";
    // The token shards are memory-mapped: a shard truncated or replaced in place while a run
    // reads it ends the worker with SIGBUS, which names no file.
    if (WTERMSIG(status) == SIGBUS) what += ": was a data shard truncated or rewritten while in use?";
  } else if (WIFEXITED(status)) {
    what += "exited with status " + std::to_string(WEXITSTATUS(status));
  } else {
    what += "stopped answering";
  }
  return what + "; its log: " + log_path_;
}

worker::Response WorkerProcess::Call(const worker::Request& request) {
  Send(request);
  return Receive();
}

void WorkerProcess::Send(const worker::Request& request) {
  if (pid_ <= 0 || !channel_) throw std::runtime_error("nsad-worker is gone; its log: " + log_path_);
  if (!channel_->Write(request)) throw std::runtime_error(DescribeExit());
}

worker::Response WorkerProcess::Receive() {
  if (pid_ <= 0 || !channel_) throw std::runtime_error("nsad-worker is gone; its log: " + log_path_);
  worker::Response response;
  if (!channel_->Read(&response)) throw std::runtime_error(DescribeExit());
  return response;
}

void WorkerProcess::Kill() {
  std::lock_guard<std::mutex> lock(pid_mutex_);
  if (pid_ > 0) ::kill(pid_, SIGKILL);
}

RuntimeCapabilities ProbeWorker(const std::string& worker_binary, const std::string& log_path) {
  WorkerProcess process(worker_binary, log_path);
  worker::Request request;
  request.mutable_probe();
  const auto response = process.Call(request);
  if (!response.has_capabilities()) throw std::runtime_error("nsad-worker: bad probe reply");
  RuntimeCapabilities caps;
  caps.cuda_devices = response.capabilities().cuda_devices();
  caps.cuda_kernels = response.capabilities().cuda_kernels();
  caps.nccl = response.capabilities().nccl();
  const auto& memory = response.capabilities().cuda_memory_bytes();
  caps.cuda_memory_bytes.assign(memory.begin(), memory.end());
  caps.host_memory_bytes = response.capabilities().host_memory_bytes();
  return caps;
}

namespace {

std::string WorkerLog(const std::string& run_dir, int rank) {
  return run_dir + (rank == 0 ? "/worker.log" : "/worker-" + std::to_string(rank) + ".log");
}

// The run's workers: one, or one per GPU of a data-parallel run. Every request goes to all
// of them before any reply is awaited, since a data-parallel step only ends once every
// worker has joined its collectives. For the same reason a worker that dies or answers with
// an error ends the call at once, and the workers still busy with the request are killed:
// they would wait for it until NCCL's timeout. Idle ones exit when their stdin closes.
class WorkerGroup {
 public:
  WorkerGroup(const std::string& worker_binary, const std::string& run_dir, int size) {
    for (int rank = 0; rank < size; ++rank) {
      workers_.push_back(std::make_unique<WorkerProcess>(worker_binary, WorkerLog(run_dir, rank)));
    }
  }

  // Every worker's stdin closes before any exit is awaited: a data-parallel worker's exit
  // (NCCL's shutdown) waits for its peers, so closing them one after another left each
  // waiting for the next until its kill, 10 s apiece.
  ~WorkerGroup() {
    for (auto& worker : workers_) worker->CloseInput();
  }

  int size() const { return static_cast<int>(workers_.size()); }

  // One request per worker (rank order); returns the replies in rank order. Throws what
  // the first worker to fail threw (its error reply, or its exit).
  std::vector<worker::Response> Call(const std::vector<worker::Request>& requests) {
    std::vector<bool> pending(workers_.size(), false);  // sent the request, not yet replied
    try {
      for (size_t r = 0; r < workers_.size(); ++r) {
        workers_[r]->Send(requests[r]);
        pending[r] = true;
      }
      std::vector<worker::Response> replies(workers_.size());
      while (std::find(pending.begin(), pending.end(), true) != pending.end()) {
        std::vector<pollfd> fds;
        std::vector<size_t> ranks;
        for (size_t r = 0; r < workers_.size(); ++r) {
          if (!pending[r]) continue;
          fds.push_back({workers_[r]->readable(), POLLIN, 0});
          ranks.push_back(r);
        }
        if (::poll(fds.data(), fds.size(), -1) < 0) {
          if (errno == EINTR) continue;
          throw std::runtime_error(std::string("poll on nsad-worker pipes: ") + std::strerror(errno));
        }
        for (size_t i = 0; i < fds.size(); ++i) {
          if (fds[i].revents == 0) continue;
          const size_t r = ranks[i];
          pending[r] = false;
          replies[r] = workers_[r]->Receive();
          if (replies[r].has_error()) ThrowWorkerError(replies[r].error());
        }
      }
      return replies;
    } catch (...) {
      for (size_t r = 0; r < workers_.size(); ++r) {
        if (pending[r]) workers_[r]->Kill();
      }
      throw;
    }
  }

  std::vector<worker::Response> CallAll(const worker::Request& request) {
    return Call(std::vector<worker::Request>(workers_.size(), request));
  }

  // From another thread: a Call in flight then throws with the workers' exits.
  void KillAll() {
    for (auto& worker : workers_) worker->Kill();
  }

 private:
  std::vector<std::unique_ptr<WorkerProcess>> workers_;
};

class RemoteTrainer final : public Trainer {
 public:
  RemoteTrainer(const std::string& worker_binary, const std::string& run_dir,
                const TrainConfig& config, const std::vector<int>& gpus, AbortSlot* abort)
      : config_(config),
        workers_(worker_binary, run_dir, config.world_size),
        abort_(abort ? abort->Register([this] { workers_.KillAll(); }) : nullptr) {
    std::vector<worker::Request> requests(workers_.size());
    const std::string rendezvous = run_dir + "/rendezvous";
    if (workers_.size() > 1) std::filesystem::remove(rendezvous);  // a stale one would mislead
    const nsa::v1::RunConfig wire_config = ToProto(config);
    for (int rank = 0; rank < workers_.size(); ++rank) {
      auto* create = requests[rank].mutable_create();
      *create->mutable_config() = wire_config;
      create->set_allow_fault_injection(config.allow_fault_injection);
      create->set_rank(rank);
      if (rank < static_cast<int>(gpus.size())) create->set_cuda_device(gpus[rank]);
      if (workers_.size() > 1) create->set_rendezvous(rendezvous);
    }
    const auto replies = workers_.Call(requests);
    for (const auto& reply : replies) {
      if (!reply.has_created()) throw std::runtime_error("nsad-worker: bad create reply");
      device_ += (device_.empty() ? "" : ",") + reply.created().device();
    }
    backend_ = FromProto(replies[0].created().attention_backend());
    parameter_count_ = replies[0].created().parameter_count();
  }

  // Rank 0 reports: after the all-reduce every worker holds the same loss and weights.
  StepMetrics Step() override {
    worker::Request request;
    request.mutable_step();
    const auto reply = workers_.CallAll(request)[0];
    if (!reply.has_stepped()) throw std::runtime_error("nsad-worker: bad step reply");
    const auto& s = reply.stepped();
    StepMetrics m;
    m.step = step_ = s.step();
    m.loss = s.loss();
    m.lr = s.lr();
    m.grad_norm = s.grad_norm();
    m.step_seconds = s.step_seconds();
    m.data_seconds = s.data_seconds();
    m.tokens_per_second = s.tokens_per_second();
    m.tokens_seen = s.tokens_seen();
    m.skipped_reason = s.skipped_reason();
    m.skipped_steps = s.skipped_steps();
    m.checkpoint = s.checkpoint();
    gates_.step = s.gates_step();
    gates_.layers.clear();
    for (const auto& l : s.gates()) gates_.layers.push_back(FromProto(l));
    return m;
  }

  double Evaluate() override {
    worker::Request request;
    request.mutable_evaluate();
    return workers_.CallAll(request)[0].evaluated().loss();
  }

  std::string Checkpoint() override {
    worker::Request request;
    request.mutable_checkpoint();
    const auto reply = workers_.CallAll(request)[0];
    if (!reply.has_checkpointed()) throw std::runtime_error("nsad-worker: bad checkpoint reply");
    return reply.checkpointed().path();
  }

  int64_t step() const override { return step_; }
  bool finished() const override { return step_ >= config_.max_steps; }
  GateReport gates() const override { return gates_; }
  const TrainConfig& config() const override { return config_; }
  std::string device() const override { return device_; }
  AttentionBackend attention_backend() const override { return backend_; }
  int64_t parameter_count() const override { return parameter_count_; }

 private:
  TrainConfig config_;
  WorkerGroup workers_;
  std::unique_ptr<AbortSlot::Registration> abort_;  // after workers_: unregistered before they go
  std::string device_;  // every worker's, in rank order: "cuda:0,cuda:1"
  AttentionBackend backend_ = AttentionBackend::kReference;
  int64_t parameter_count_ = 0;
  int64_t step_ = 0;
  GateReport gates_;
};

}  // namespace

std::unique_ptr<Trainer> CreateRemoteTrainer(const std::string& worker_binary,
                                             const std::string& run_dir,
                                             const TrainConfig& config, const std::vector<int>& gpus,
                                             AbortSlot* abort) {
  return std::make_unique<RemoteTrainer>(worker_binary, run_dir, config, gpus, abort);
}

}  // namespace nsad::server
