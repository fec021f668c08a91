// Hosts training runs: one thread per run drives an engine Trainer step by step, and
// control requests (pause, resume, halt) take effect between steps. Every transition is
// persisted to <state_dir>/runs/<run_id>/run.json (atomically) and published to watchers.
#pragma once

#include <grpcpp/grpcpp.h>
#include <grpcpp/support/sync_stream.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <filesystem>
#include <thread>
#include <vector>

#include "abort_slot.h"
#include "metrics.h"
#include "nsa/v1/trainer.pb.h"
#include "nsad/engine.h"

namespace nsad::server {

// Builds a run's trainer; run_dir is the run's folder in the state dir (for its logs). `gpus`
// is the GPU of each worker (rank order) where the daemon placed a run whose device is "auto",
// empty where the config's device decides. From when its building can hang (its workers
// started) until the trainer goes, it registers in `abort` how to end that work from another
// thread (the halt timeout).
using TrainerFactory = std::function<std::unique_ptr<Trainer>(
    const std::string& run_dir, const TrainConfig&, const std::vector<int>& gpus, AbortSlot* abort)>;
// Checks a config beyond ValidateConfig (e.g. the shards' contents) before a run is
// created; returns field errors. Empty by default.
using ConfigChecker = std::function<std::vector<FieldError>(const TrainConfig&)>;

struct RunManagerOptions {
  // Lets configs use fault_injection (tests, drills); refused otherwise.
  bool allow_fault_injection = false;
  // A halt (or the daemon's shutdown) takes effect between steps. A step, or the workers'
  // start, still in flight this long after the halt (a hung collective, a stopped worker, a GPU
  // that hangs at initialisation) is ended by killing the run's workers (the AbortSlot the
  // trainer registered in); the run is HALTED and resumes from its last checkpoint.
  // Zero: wait for it however long it takes.
  std::chrono::seconds halt_timeout{60};
  // The machine's GPUs (the workers' probe). A run whose device is "auto" goes on those the
  // fewest live runs hold (gpu_placement.h); with none, on the CPU as "auto" says.
  int cuda_devices = 0;
  // At most this many live runs on a GPU: a run that finds no room (auto: on no GPU; a named
  // device: on its own) waits PENDING until a run ends, first come first served among the runs
  // that want the same GPUs. 0: no limit (a run with device auto shares the least busy GPU).
  int runs_per_gpu = 0;
};

class RunManager {
 public:
  RunManager(std::string state_dir, Metrics* metrics, TrainerFactory factory,
             ConfigChecker checker = nullptr, RunManagerOptions options = {});
  ~RunManager();  // halts every live run and joins its thread
  RunManager(const RunManager&) = delete;
  RunManager& operator=(const RunManager&) = delete;

  grpc::Status Start(const nsa::v1::StartRunRequest& request, nsa::v1::RunInfo* out);
  grpc::Status Pause(const std::string& run_id, nsa::v1::RunInfo* out);
  // PAUSED/PAUSING -> RUNNING; a HALTED or FAILED run with a checkpoint restarts from its
  // latest checkpoint (exactly where that checkpoint left off).
  grpc::Status Resume(const std::string& run_id, nsa::v1::RunInfo* out);
  // The reason (the run's message from then on) is at most nsa::v1::kMaxHaltReasonBytes.
  grpc::Status Halt(const std::string& run_id, const std::string& reason, nsa::v1::RunInfo* out);
  grpc::Status Get(const std::string& run_id, nsa::v1::RunInfo* out);
  // One page of runs (trainer.proto's ListRunsRequest): at most kMaxListPageRuns of them and
  // at most kMaxListPageBytes.
  grpc::Status List(const nsa::v1::ListRunsRequest& request, nsa::v1::ListRunsResponse* out);
  static constexpr int kMaxListPageRuns = 1000;
  static constexpr size_t kMaxListPageBytes = 2 << 20;
  // Blocks, streaming events until the run ends, the client cancels or the daemon stops.
  grpc::Status Watch(const std::string& run_id, grpc::ServerContext* context,
                     grpc::ServerWriterInterface<nsa::v1::RunEvent>* writer);
  grpc::Status Gates(const std::string& run_id, nsa::v1::InspectGatesResponse* out);
  grpc::Status Throughput(const std::string& run_id, nsa::v1::GetThroughputResponse* out);

  // Stops accepting work and halts every live run (SIGTERM path); idempotent.
  void Shutdown();
  // Blocks until every run thread has ended (after Shutdown: each run is HALTED, and its
  // watchers have been sent that final event).
  void WaitForRuns();

 private:
  struct Run;

  std::filesystem::path RunsDir() const;                          // <state_dir>/runs
  std::filesystem::path RunDir(const std::string& run_id) const;  // .../runs/<run_id>
  std::shared_ptr<Run> Find(const std::string& run_id, grpc::Status* status);
  std::string NextRunId();
  void LoadPersistedRuns();
  void Execute(const std::shared_ptr<Run>& run);
  // How Execute ends a run once its trainer, and so its workers, are gone.
  struct Ending {
    nsa::v1::RunState state;
    std::string message;
  };
  // A halt taken between steps (asked for by a person, an alert or the daemon's shutdown):
  // the trainer checkpoints the step it stopped after; the run is then to be HALTED. Caller
  // holds no lock: the checkpoint takes a while, and WatchHalts may end it.
  Ending FinishHalt(Run& run, Trainer& trainer);
  grpc::Status Restart(const std::shared_ptr<Run>& run, nsa::v1::RunInfo* out);
  // The run's thread (Execute), after joining ended runs' threads; a run whose thread cannot
  // start is FAILED. Caller holds mutex_, not run->mutex.
  grpc::Status StartThread(const std::shared_ptr<Run>& run, nsa::v1::RunInfo* out);
  // Caller holds run->mutex.
  void Transition(Run& run, nsa::v1::RunState state, const std::string& message);
  // A HALTING run whose work WatchHalts ended (what_hung: what had not ended): HALTED, the
  // halt's reason and what was killed in its message. Caller holds run.mutex.
  Ending HaltAborted(Run& run, const std::string& what_hung, const std::string& error);
  // The run's state to /metrics and its watchers (Publish). Caller holds run.mutex.
  void Announce(Run& run);
  void Publish(Run& run);
  void Persist(const Run& run);       // throws when the record cannot be written
  void PersistOrLog(const Run& run);  // logs instead: the run goes on, the record is stale
  // The run (not ended) whose checkpoint folder is `dir`, or "". Caller holds mutex_.
  std::string CheckpointDirUser(const std::string& dir) const;
  // The GPUs for a run about to start (Run::gpus, and its info's device where the daemon chose
  // them): the config's device where it names one, else those the fewest live runs other than
  // `run` hold. False, with no GPUs set, when the run must wait: those GPUs hold
  // options_.runs_per_gpu runs, or an earlier run waits for them. Caller holds mutex_, not
  // run.mutex.
  bool TryPlaceOnGpus(Run& run);
  // Whether the daemon chooses a run's GPUs (device "auto" on a machine with GPUs) rather than
  // its config naming them.
  bool ChoosesGpus(const TrainConfig& config) const;
  // Joins the threads of runs that have ended: an unjoined thread keeps its stack mapped, 8 MB
  // of address space per run the daemon ever hosted. Caller holds mutex_.
  void JoinEndedRunThreads();
  // Blocks while the run waits for room on its GPUs; false when it was halted meanwhile.
  bool WaitForGpus(Run& run);
  std::string WaitingMessage() const;
  // Aborts the work in flight of runs that have been HALTING for options_.halt_timeout, once
  // a second, until the manager is destroyed.
  void WatchHalts();

  const std::string state_dir_;
  Metrics* metrics_;
  TrainerFactory factory_;
  ConfigChecker checker_;
  RunManagerOptions options_;

  std::mutex mutex_;  // guards runs_, next_id_, next_ticket_, shutting_down_, watch_ended_
  std::map<std::string, std::shared_ptr<Run>> runs_;
  int64_t next_id_ = 1;
  int64_t next_ticket_ = 1;                // the order runs asked for GPUs in (Run::ticket)
  std::condition_variable gpus_freed_;     // with mutex_: a run ended or was halted (WaitForGpus)
  bool shutting_down_ = false;
  bool watch_ended_ = false;
  std::condition_variable watch_wake_;  // ends WatchHalts' wait early (destruction)
  std::thread halt_watch_;              // WatchHalts, when halt_timeout > 0
};

}  // namespace nsad::server
