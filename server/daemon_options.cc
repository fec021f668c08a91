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
         "The bound addresses are written to DIR/endpoints.json.\n";
}

bool ParseDaemonOptions(int argc, char** argv, DaemonOptions* options, std::string* error) {
  const std::map<std::string, std::string*> flags = {
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
  static const char* kLevels[] = {"trace", "debug", "info", "warn", "error", "critical", "off"};
  for (const char* level : kLevels) {
    if (options->log_level == level) return true;
  }
  *error = "--log-level must be one of trace, debug, info, warn, error, critical, off";
  return false;
}

}  // namespace nsad::server
