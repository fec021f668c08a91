// nsactl: command-line client of the nsad training daemon. See `nsactl --help`.
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "cli.h"
#include "commands.h"

namespace {

// SIGINT/SIGTERM are handled on a dedicated thread with sigwait() rather than in a signal
// handler, because cancelling a gRPC call is not async-signal-safe. The signals are blocked
// before any other thread exists so that gRPC's threads inherit the mask.
void HandleSignalsOn(sigset_t signals, nsactl::WatchInterrupter* interrupter) {
  std::thread([signals, interrupter] {
    int signal_number = 0;
    if (sigwait(&signals, &signal_number) != 0) return;
    interrupter->Interrupt();
    // Commands other than watch have nothing to clean up; a watch ends promptly after the
    // cancel. A second signal always ends the process.
    if (sigwait(&signals, &signal_number) == 0) std::_Exit(nsactl::kExitInterrupted);
  }).detach();
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  const char* env_address = std::getenv("NSAD_ADDR");
  const nsactl::ParseResult parsed =
      nsactl::ParseCommandLine(args, env_address != nullptr ? env_address : "");
  if (parsed.kind != nsactl::ParseResult::Kind::kRun) {
    (parsed.kind == nsactl::ParseResult::Kind::kHelp ? std::cout : std::cerr) << parsed.text;
    return parsed.exit_code();
  }

  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  static nsactl::WatchInterrupter interrupter;  // outlives the detached signal thread
  const bool is_watch = parsed.invocation.command == nsactl::Command::kWatch ||
                        parsed.invocation.watch_after_start;
  if (is_watch) {
    HandleSignalsOn(signals, &interrupter);
  } else {
    // A unary command is bounded by its deadline; Ctrl-C just ends it.
    pthread_sigmask(SIG_UNBLOCK, &signals, nullptr);
  }
  return nsactl::Execute(parsed.invocation, std::cout, std::cerr, &interrupter);
}
