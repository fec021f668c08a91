#include "daemon_options.h"

#include <map>

namespace nsad::server {

std::string DaemonUsage() {
  return "usage: nsad [options]\n"
         "  --listen HOST:PORT         gRPC address (default 127.0.0.1:50051; port 0 = any)\n"
         "  --metrics HOST:PORT|off    Prometheus /metrics (default 127.0.0.1:9464)\n"
         "  --alert-webhook HOST:PORT|off\n"
         "                             Alertmanager webhook that halts runs (default off)\n"
         "  --state-dir DIR            run records (default ./nsad-state)\n"
         "  --log-level LEVEL          trace|debug|info|warn|error (default info)\n"
         "  --worker PATH              nsad-worker binary (default: next to nsad)\n"
         "  --allow-fault-injection    accept run configs with fault_injection (drills, tests)\n"
         "  --halt-timeout SECONDS     a halt (or shutdown) waits this long for the step in flight,\n"
         "                             then kills the run's workers (default 60; 0 = no limit)\n"
         "  --runs-per-gpu N           at most N live runs on a GPU; a run that finds none with room\n"
         "                             waits PENDING for one, first come first served (default 0 =\n"
         "                             no limit: a run with device auto shares the least busy GPU)\n"
         "The bound addresses are written to DIR/endpoints.json.\n";
}

namespace {

// `text` as a number from 0 to `most` (digits only: no sign, no fraction, no overflow), or false
// with "FLAG must be WHAT from 0 to MOST (got "TEXT")".
bool WholeNumber(const std::string& flag, const std::string& what, const std::string& text, int most, int* value,
                 std::string* error) {
  const size_t digits = std::to_string(most).size();
  if (text.size() > digits || text.find_first_not_of("0123456789") != std::string::npos || std::stoi(text) > most) {
    *error = flag + " must be " + what + " from 0 to " + std::to_string(most) + " (got \"" + text + "\")";
    return false;
  }
  *value = std::stoi(text);
  return true;
}

}  // namespace

bool ParseDaemonOptions(int argc, char** argv, DaemonOptions* options, std::string* error) {
  std::string halt_timeout = std::to_string(options->halt_timeout_seconds);
  std::string runs_per_gpu = std::to_string(options->runs_per_gpu);
  const std::map<std::string, std::string*> flags = {
      {"--halt-timeout", &halt_timeout},
      {"--runs-per-gpu", &runs_per_gpu},
      {"--listen", &options->listen_address},
      {"--metrics", &options->metrics_address},
      {"--alert-webhook", &options->alert_webhook_address},
      {"--state-dir", &options->state_dir},
      {"--log-level", &options->log_level},
      {"--worker", &options->worker_binary},
  };
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      *error = "help";
      return false;
    }
    if (arg == "--allow-fault-injection") {
      options->allow_fault_injection = true;
      continue;
    }
    std::string value;
    const auto eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    const auto flag = flags.find(arg);
    if (flag == flags.end()) {
      *error = "unknown option " + arg;
      return false;
    }
    if (eq == std::string::npos) {
      if (i + 1 >= argc) {
        *error = arg + " needs a value";
        return false;
      }
      value = argv[++i];
    }
    if (value.empty()) {
      *error = arg + " needs a non-empty value";
      return false;
    }
    *flag->second = value;
  }
  if (!WholeNumber("--halt-timeout", "a whole number of seconds", halt_timeout, 86400,
                   &options->halt_timeout_seconds, error) ||
      !WholeNumber("--runs-per-gpu", "a whole number", runs_per_gpu, 1000, &options->runs_per_gpu, error)) {
    return false;
  }
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  for (const char* level : kLevels) {
    if (options->log_level == level) return true;
  }
  *error = "--log-level must be one of trace, debug, info, warn, error, critical, off";
  return false;
}

}  // namespace nsad::server
