// Command-line parsing for nsactl.
//
// Parsing is kept free of any I/O and of gRPC so that tests can feed it argv vectors and
// compare the resulting Invocation field by field.
#pragma once

#include <string>
#include <vector>

#include "nsa/v1/trainer.pb.h"

namespace nsactl {

// Process exit codes. Scripts rely on these, so they are part of the CLI's contract.
enum ExitCode : int {
  kExitOk = 0,
  kExitRpcError = 1,     // the daemon answered with an error (or the stream broke)
  kExitUsage = 2,        // bad command line or unreadable input file
  kExitUnreachable = 3,  // no daemon at --addr within the deadline
  kExitRunFailed = 4,    // watch: the run ended in FAILED
  kExitInterrupted = 130,  // watch: Ctrl-C (the run keeps going)
};

inline constexpr char kDefaultAddress[] = "127.0.0.1:50051";
inline constexpr double kDefaultTimeoutSeconds = 10.0;

enum class Command { kStart, kStatus, kList, kPause, kResume, kHalt, kGates, kThroughput, kWatch };

// Everything a single nsactl invocation asks for. Fields that a command does not use stay
// at their defaults.
struct Invocation {
  // Global options.
  std::string address = kDefaultAddress;
  double timeout_seconds = kDefaultTimeoutSeconds;
  bool json = false;

  Command command = Command::kList;
  std::string run_id;                       // status, pause, resume, halt, gates, throughput, watch
  std::string config_path;                  // start
  std::string name_override;                // start --name (empty = keep the file's name)
  bool watch_after_start = false;           // start --watch
  std::vector<nsa::v1::RunState> states;    // list --state
  std::string halt_reason;                  // halt --reason
};

// Result of parsing: either an Invocation to execute, or text to print and an exit code
// (help goes to stdout with exit 0, usage errors to stderr with exit 2).
struct ParseResult {
  enum class Kind { kRun, kHelp, kError };
  Kind kind = Kind::kError;
  Invocation invocation;
  std::string text;
  int exit_code() const { return kind == Kind::kError ? kExitUsage : kExitOk; }
};

// Parses argv[1..] (without the program name). `env_address` is the value of NSAD_ADDR
// (empty when unset); --addr overrides it.
ParseResult ParseCommandLine(const std::vector<std::string>& args, const std::string& env_address);

// Top-level help, and help for one command (by its name, e.g. "start").
std::string GeneralHelp();
std::string CommandHelp(Command command);

// "start" <-> Command::kStart.
const char* CommandName(Command command);

// Accepts "RUNNING", "running" and the enum's full name; false for anything else.
bool ParseRunState(const std::string& text, nsa::v1::RunState* state);

}  // namespace nsactl
