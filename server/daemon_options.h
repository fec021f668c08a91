// Command-line options of the nsad daemon, and the wiring of optional pieces.
#pragma once

#include <memory>
#include <string>

#include "run_manager.h"

namespace nsad::server {

struct DaemonOptions {
  std::string listen_address = "127.0.0.1:50051";  // gRPC; port 0 = any free port
  std::string metrics_address = "127.0.0.1:9464";  // Prometheus /metrics; "off" disables
  std::string alert_webhook_address = "off";       // Alertmanager webhook; e.g. 127.0.0.1:9465
  std::string state_dir = "nsad-state";            // run records and checkpoints
  std::string log_level = "info";
  std::string worker_binary;  // nsad-worker; default: next to the nsad executable
  bool allow_fault_injection = false;  // lets run configs use fault_injection (drills, tests)
  int halt_timeout_seconds = 60;       // RunManagerOptions::halt_timeout; 0 = wait for the step
  int runs_per_gpu = 0;                // RunManagerOptions::runs_per_gpu; 0 = no limit
};

// Accepts --name=value and --name value. On failure returns false with *error set
// ("help" for --help).
bool ParseDaemonOptions(int argc, char** argv, DaemonOptions* options, std::string* error);
std::string DaemonUsage();

// Checks run at StartRun so that bad data or an impossible device/backend is an
// INVALID_ARGUMENT for the caller, not a failed run later: the device and backend against
// what the machine offers (probed once by a worker), then the shards (headers, vocabulary).
ConfigChecker DefaultConfigChecker(const RuntimeCapabilities& caps);

// Trainers in nsad-worker processes, one per run, logging to <run_dir>/worker.log.
TrainerFactory WorkerTrainerFactory(const std::string& worker_binary);

// The nsad-worker binary next to this executable (/proc/self/exe).
std::string DefaultWorkerBinary();

// Starts the Alertmanager webhook on `address` unless it is "off"; the returned object
// stops it when destroyed; *bound_port is its port (0 when off or failed). Never throws: a
// webhook that cannot start is logged and the daemon goes on without it.
std::shared_ptr<void> StartAlertWebhook(const std::string& address, RunManager* runs,
                                        int* bound_port);

}  // namespace nsad::server
