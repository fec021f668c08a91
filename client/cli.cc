#include "cli.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <optional>
#include <sstream>

namespace nsactl {
namespace {

struct CommandSpec {
  Command command;
  const char* name;
  const char* usage;    // after "nsactl [GLOBAL OPTIONS] "
  const char* summary;  // one line for the general help
  const char* details;  // extra lines for the command's own help (may be empty)
  bool takes_run_id;
};

// One table drives parsing, the general help and each command's help, so they cannot
// drift apart.
constexpr CommandSpec kCommands[] = {
    {Command::kStart, "start", "start --config FILE.json [--name NAME] [--watch]",
     "start a run from a RunConfig JSON file",
     "  --config FILE.json  RunConfig in protobuf JSON (see configs/); the daemon validates it\n"
     "                      and reports unknown fields by name\n"
     "  --name NAME         override the config's name\n"
     "  --watch             follow the new run like `nsactl watch`\n",
     false},
    {Command::kStatus, "status", "status RUN_ID", "show one run: state, progress, effective config",
     "", true},
    {Command::kList, "list", "list [--state STATE...]", "list runs, optionally only some states",
     "  --state STATE...    PENDING RUNNING PAUSING PAUSED HALTING HALTED COMPLETED FAILED;\n"
     "                      repeat the option, list several, or separate them with commas\n",
     false},
    {Command::kPause, "pause", "pause RUN_ID", "pause a running run (it keeps its state)", "", true},
    {Command::kResume, "resume", "resume RUN_ID", "resume a paused run, or a halted/failed one",
     "  A PAUSED run goes on where it is; a HALTED or FAILED run restarts from its last\n"
     "  checkpoint, exactly where that checkpoint left off.\n",
     true},
    {Command::kHalt, "halt", "halt RUN_ID [--reason TEXT]", "stop a run after its current step",
     "  --reason TEXT       recorded in the run's message\n"
     "  The run is HALTING until its step ends and a checkpoint of that step is written\n"
     "  (unless the run writes no checkpoints), then HALTED; `nsactl resume` continues it\n"
     "  from there. A step or checkpoint still running nsad's --halt-timeout later is ended\n"
     "  by killing the run's workers; the run then resumes from its last checkpoint.\n",
     true},
    {Command::kGates, "gates", "gates RUN_ID", "per-layer NSA branch gate statistics", "", true},
    {Command::kThroughput, "throughput", "throughput RUN_ID", "tokens per second and step time",
     "", true},
    {Command::kWatch, "watch", "watch RUN_ID", "follow a run's progress until it ends",
     "  Prints one line per event (step, loss, tok/s, lr, state). Exits 0 when the run\n"
     "  reaches COMPLETED or HALTED, 4 when it FAILED. Ctrl-C stops watching, not the run.\n",
     true},
};

const CommandSpec* FindCommand(const std::string& name) {
  for (const auto& spec : kCommands) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

const CommandSpec& SpecOf(Command command) {
  for (const auto& spec : kCommands) {
    if (spec.command == command) return spec;
  }
  return kCommands[0];  // unreachable: every Command has an entry
}

constexpr char kGlobalOptionsHelp[] =
    "Global options:\n"
    "  --addr HOST:PORT    daemon address (default: $NSAD_ADDR, else 127.0.0.1:50051)\n"
    "  --timeout SECONDS   deadline of each request and of connecting (default 10)\n"
    "  --json              print protobuf JSON instead of tables (for scripts)\n"
    "  -h, --help          show help (after a command: that command's help)\n";

constexpr char kExitCodesHelp[] =
    "Exit codes: 0 ok, 1 the daemon returned an error, 2 usage error, 3 daemon unreachable,\n"
    "            4 watched run FAILED, 130 interrupted.\n";

ParseResult Error(const std::string& message) {
  ParseResult result;
  result.kind = ParseResult::Kind::kError;
  result.text = "nsactl: " + message + "\nRun 'nsactl --help' for usage.\n";
  return result;
}

ParseResult Help(const std::string& text) {
  ParseResult result;
  result.kind = ParseResult::Kind::kHelp;
  result.text = text;
  return result;
}

std::vector<std::string> SplitCommas(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream stream(text);
  std::string part;
  while (std::getline(stream, part, ',')) {
    if (!part.empty()) parts.push_back(part);
  }
  return parts;
}

// Walks argv once. Options may use "--name value" or "--name=value"; global options are
// accepted anywhere, so `nsactl list --json` and `nsactl --json list` mean the same.
class Parser {
 public:
  explicit Parser(const std::vector<std::string>& args) : args_(args) {}

  ParseResult Parse(const std::string& env_address) {
    Invocation& inv = result_.invocation;
    if (!env_address.empty()) inv.address = env_address;

    const CommandSpec* spec = nullptr;
    std::vector<std::string> positionals;
    bool want_help = false;
    bool options_ended = false;

    for (pos_ = 0; pos_ < args_.size(); ++pos_) {
      const std::string& arg = args_[pos_];
      if (options_ended || arg.size() < 2 || arg[0] != '-') {
        if (spec == nullptr && positionals.empty()) {
          if (arg == "help") {
            want_help = true;
            continue;
          }
          spec = FindCommand(arg);
          if (spec == nullptr) return Error("unknown command '" + arg + "'");
          continue;
        }
        positionals.push_back(arg);
        continue;
      }
      if (arg == "--") {
        options_ended = true;
        continue;
      }
      SplitOption(arg);
      if (option_ == "-h" || option_ == "--help") {
        want_help = true;
      } else if (option_ == "--json") {
        if (!NoValue()) return error_;
        inv.json = true;
      } else if (option_ == "--addr") {
        if (!Value(&inv.address)) return error_;
        if (inv.address.empty()) return Error("--addr needs HOST:PORT");
      } else if (option_ == "--timeout") {
        std::string text;
        if (!Value(&text)) return error_;
        if (!ParseSeconds(text, &inv.timeout_seconds)) {
          return Error("--timeout needs a positive number of seconds, got '" + text + "'");
        }
      } else if (spec == nullptr) {
        return Error("unknown option '" + option_ + "' (before any command)");
      } else {
        ParseResult failure;
        if (!CommandOption(*spec, &failure)) return failure;
      }
    }

    if (want_help) {
      // `nsactl start --help` and `nsactl help start` both show the command's help.
      return Help(spec != nullptr ? CommandHelp(spec->command) : GeneralHelp());
    }
    if (spec == nullptr) return Error("no command given");
    inv.command = spec->command;

    if (spec->takes_run_id) {
      if (positionals.empty()) return Error(std::string(spec->name) + " needs a RUN_ID");
      if (positionals.size() > 1) {
        return Error(std::string(spec->name) + " takes one RUN_ID, got extra '" + positionals[1] +
                     "'");
      }
      inv.run_id = positionals[0];
    } else if (!positionals.empty()) {
      return Error(std::string(spec->name) + " takes no argument '" + positionals[0] + "'");
    }
    if (spec->command == Command::kStart && inv.config_path.empty()) {
      return Error("start needs --config FILE.json");
    }
    result_.kind = ParseResult::Kind::kRun;
    return result_;
  }

 private:
  // Options that only some commands accept.
  bool CommandOption(const CommandSpec& spec, ParseResult* failure) {
    Invocation& inv = result_.invocation;
    const Command cmd = spec.command;
    bool ok = true;
    if (cmd == Command::kStart && option_ == "--config") {
      ok = Value(&inv.config_path);
    } else if (cmd == Command::kStart && option_ == "--name") {
      ok = Value(&inv.name_override);
    } else if (cmd == Command::kStart && option_ == "--watch") {
      ok = NoValue();
      inv.watch_after_start = true;
    } else if (cmd == Command::kHalt && option_ == "--reason") {
      ok = Value(&inv.halt_reason);
    } else if (cmd == Command::kList && option_ == "--state") {
      ok = States(&inv.states);
    } else {
      error_ = Error("unknown option '" + option_ + "' for " + spec.name);
      ok = false;
    }
    if (!ok) *failure = error_;
    return ok;
  }

  void SplitOption(const std::string& arg) {
    const auto eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      option_ = arg.substr(0, eq);
      inline_value_ = arg.substr(eq + 1);
    } else {
      option_ = arg;
      inline_value_.reset();
    }
  }

  bool Value(std::string* out) {
    if (inline_value_) {
      *out = *inline_value_;
      return true;
    }
    if (pos_ + 1 >= args_.size()) {
      error_ = Error(option_ + " needs a value");
      return false;
    }
    *out = args_[++pos_];
    return true;
  }

  bool NoValue() {
    if (inline_value_) {
      error_ = Error(option_ + " takes no value");
      return false;
    }
    return true;
  }

  // --state takes one or more states: "--state RUNNING PAUSED", "--state=RUNNING,PAUSED".
  // Following words are consumed while they parse as states, so the option can be repeated.
  bool States(std::vector<nsa::v1::RunState>* states) {
    std::vector<std::string> words;
    if (inline_value_) {
      words = SplitCommas(*inline_value_);
    } else {
      while (pos_ + 1 < args_.size() && !args_[pos_ + 1].empty() && args_[pos_ + 1][0] != '-') {
        for (const auto& word : SplitCommas(args_[++pos_])) words.push_back(word);
      }
    }
    if (words.empty()) {
      error_ = Error("--state needs at least one STATE");
      return false;
    }
    for (const auto& word : words) {
      nsa::v1::RunState state;
      if (!ParseRunState(word, &state)) {
        error_ = Error("unknown run state '" + word +
                       "' (PENDING RUNNING PAUSING PAUSED HALTING HALTED COMPLETED FAILED)");
        return false;
      }
      if (std::find(states->begin(), states->end(), state) == states->end()) {
        states->push_back(state);
      }
    }
    return true;
  }

  static bool ParseSeconds(const std::string& text, double* seconds) {
    try {
      size_t used = 0;
      const double value = std::stod(text, &used);
      if (used != text.size() || !std::isfinite(value) || value <= 0) return false;
      *seconds = value;
      return true;
    } catch (const std::exception&) {
      return false;
    }
  }

  const std::vector<std::string>& args_;
  size_t pos_ = 0;
  std::string option_;
  std::optional<std::string> inline_value_;
  ParseResult result_;
  ParseResult error_;
};

}  // namespace

ParseResult ParseCommandLine(const std::vector<std::string>& args, const std::string& env_address) {
  return Parser(args).Parse(env_address);
}

std::string GeneralHelp() {
  std::ostringstream out;
  out << "nsactl: control the nsad training daemon\n\n"
      << "Usage: nsactl [--addr HOST:PORT] [--timeout SECONDS] [--json] COMMAND ...\n\n"
      << "Commands:\n";
  for (const auto& spec : kCommands) {
    std::string usage = spec.usage;
    usage.resize(std::max<size_t>(usage.size(), 50), ' ');
    out << "  " << usage << " " << spec.summary << "\n";
  }
  out << "\n" << kGlobalOptionsHelp << "\n" << kExitCodesHelp
      << "\nRun 'nsactl COMMAND --help' for a command's options.\n";
  return out.str();
}

std::string CommandHelp(Command command) {
  const CommandSpec& spec = SpecOf(command);
  std::ostringstream out;
  out << "Usage: nsactl [GLOBAL OPTIONS] " << spec.usage << "\n\n" << spec.summary << "\n";
  if (spec.details[0] != '\0') out << "\n" << spec.details;
  out << "\n" << kGlobalOptionsHelp;
  return out.str();
}

const char* CommandName(Command command) { return SpecOf(command).name; }

bool ParseRunState(const std::string& text, nsa::v1::RunState* state) {
  std::string upper = text;
  std::transform(upper.begin(), upper.end(), upper.begin(),
                 [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  nsa::v1::RunState parsed;
  if (!nsa::v1::RunState_Parse(upper, &parsed) || parsed == nsa::v1::RUN_STATE_UNSPECIFIED) {
    return false;
  }
  *state = parsed;
  return true;
}

}  // namespace nsactl
