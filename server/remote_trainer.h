// nsad::Trainer implemented by nsad-worker processes: the daemon's run threads drive it
// exactly like an in-process trainer, while torch, CUDA and their failure modes stay in the
// workers. A run has one worker, or one per GPU when it is data parallel (world_size > 1).
// A worker that dies turns into an exception on the run, never into a daemon crash.
#pragma once

#include <sys/types.h>

#include <memory>
#include <mutex>
#include <string>

#include "abort_slot.h"
#include "nsa/v1/worker.pb.h"
#include "nsad/engine.h"
#include "worker_channel.h"

namespace nsad::server {

// One nsad-worker child process with pipes to its stdin/stdout; stderr goes to log_path.
class WorkerProcess {
 public:
  WorkerProcess(const std::string& worker_binary, const std::string& log_path);
  ~WorkerProcess();  // closes stdin (the worker exits on EOF), waits, kills if it must
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // Sends a request and waits for its response. Throws std::runtime_error naming the exit
  // status or signal when the worker is gone.
  nsa::worker::v1::Response Call(const nsa::worker::v1::Request& request);
  // Call in two halves, for driving several workers at once: Receive blocks until the
  // response arrives (readable() says when it has begun to).
  void Send(const nsa::worker::v1::Request& request);
  nsa::worker::v1::Response Receive();
  int readable() const { return from_worker_; }  // the fd to poll for the response
  // SIGKILL; the destructor reaps it. Safe from any thread (a halt that timed out): the
  // process is signalled only while it has not been reaped, so never a recycled pid.
  void Kill();
  // EOF on the worker's stdin: it finishes and exits, which the destructor waits for. No
  // request may follow. The destructor does it too; a data-parallel run's workers all get
  // theirs first (WorkerGroup), since each one's exit waits for its peers' (NCCL's shutdown).
  void CloseInput();

 private:
  std::string DescribeExit();
  // Reaps the process if it has exited (waitpid WNOHANG) and then forgets its pid; true
  // once it is reaped. *status gets its wait status.
  bool TryReap(int* status);

  std::string log_path_;
  std::mutex pid_mutex_;  // pid_ against Kill from another thread
  pid_t pid_ = -1;
  int to_worker_ = -1;
  int from_worker_ = -1;
  std::unique_ptr<WorkerChannel> channel_;
};

// Starts a worker just to ask what this machine offers (CUDA devices, kernels).
RuntimeCapabilities ProbeWorker(const std::string& worker_binary, const std::string& log_path);

// Creates a trainer in fresh workers: config.world_size of them, with their logs in run_dir
// (worker.log for rank 0, worker-<rank>.log for the others) and their rendezvous file there
// too. With `gpus` (one per worker, rank order: the daemon's placement) each worker trains on
// its own; empty: on the config's device. Throws ConfigError / std::runtime_error like
// Trainer::Create. From the workers' start until the trainer goes, `abort` (if given) kills the
// workers: the creation or the step in flight then throws with their exits.
std::unique_ptr<Trainer> CreateRemoteTrainer(const std::string& worker_binary,
                                             const std::string& run_dir,
                                             const TrainConfig& config, const std::vector<int>& gpus = {},
                                             AbortSlot* abort = nullptr);

}  // namespace nsad::server
