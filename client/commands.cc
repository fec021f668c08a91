#include "commands.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <google/protobuf/util/json_util.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/security/credentials.h>

#include "format.h"
#include "nsa/v1/run_state.h"
#include "nsa/v1/trainer.grpc.pb.h"

namespace nsactl {
namespace {

using nsa::v1::RunState;
using nsa::v1::Trainer;

std::chrono::system_clock::time_point DeadlineAfter(double seconds) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             std::chrono::duration<double>(seconds));
}

std::string FormatSeconds(double seconds) {
  std::ostringstream text;
  text << seconds;
  return text.str();
}

void PrintUnreachable(const Invocation& inv, std::ostream& err) {
  err << "nsactl: nsad is not reachable at " << inv.address << " (deadline "
      << FormatSeconds(inv.timeout_seconds) << " s): is the daemon running?\n";
}

// Waits until the channel is connected. A refused connection puts the channel into
// TRANSIENT_FAILURE at once, and we give up then instead of letting gRPC retry until the
// deadline; the deadline bounds the wait for hosts that do not answer at all.
bool Connect(grpc::Channel& channel, double timeout_seconds) {
  const auto deadline = DeadlineAfter(timeout_seconds);
  grpc_connectivity_state state = channel.GetState(/*try_to_connect=*/true);
  while (state != GRPC_CHANNEL_READY) {
    if (state == GRPC_CHANNEL_TRANSIENT_FAILURE || state == GRPC_CHANNEL_SHUTDOWN) return false;
    if (!channel.WaitForStateChange(state, deadline)) return false;  // deadline passed
    state = channel.GetState(/*try_to_connect=*/true);
  }
  return true;
}

// Reports a failed RPC. UNAVAILABLE means the daemon went away after we connected.
int RpcFailure(const grpc::Status& status, const Invocation& inv, std::ostream& err) {
  err << "nsactl: " << StatusCodeName(status.error_code()) << ": " << status.error_message()
      << "\n";
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    PrintUnreachable(inv, err);
    return kExitUnreachable;
  }
  return kExitRpcError;
}

class CommandRunner {
 public:
  CommandRunner(const Invocation& inv, const std::shared_ptr<grpc::Channel>& channel,
                std::ostream& out, std::ostream& err, WatchInterrupter* interrupter)
      : inv_(inv), stub_(Trainer::NewStub(channel)), out_(out), err_(err),
        interrupter_(interrupter) {}

  int Run() {
    switch (inv_.command) {
      case Command::kStart: return Start();
      case Command::kStatus: return Unary(&Trainer::Stub::GetRun, RunRequest(), ShowRun);
      case Command::kList: return List();
      case Command::kPause: return Unary(&Trainer::Stub::PauseRun, RunRequest(), ShowState);
      case Command::kResume: return Unary(&Trainer::Stub::ResumeRun, RunRequest(), ShowState);
      case Command::kHalt: {
        nsa::v1::HaltRunRequest request;
        request.set_run_id(inv_.run_id);
        request.set_reason(inv_.halt_reason);
        return Unary(&Trainer::Stub::HaltRun, request, ShowState);
      }
      case Command::kGates:
        return Unary(&Trainer::Stub::InspectGates, RunRequest(),
                     [](const nsa::v1::InspectGatesResponse& r) { return FormatGates(r); });
      case Command::kThroughput:
        return Unary(&Trainer::Stub::GetThroughput, RunRequest(),
                     [](const nsa::v1::GetThroughputResponse& r) { return FormatThroughput(r); });
      case Command::kWatch: return Watch(inv_.run_id);
    }
    err_ << "nsactl: command not implemented\n";
    return kExitUsage;
  }

 private:
  static std::string ShowRun(const nsa::v1::RunResponse& response) {
    return FormatRun(response.run());
  }

  static std::string ShowState(const nsa::v1::RunResponse& response) {
    const auto& run = response.run();
    std::string line = "run " + run.run_id() + ": " + StateName(run.state());
    if (!run.message().empty()) line += " (" + run.message() + ")";
    return line + "\n";
  }

  nsa::v1::RunRequest RunRequest() const {
    nsa::v1::RunRequest request;
    request.set_run_id(inv_.run_id);
    return request;
  }

  // One unary call with the invocation's deadline; prints the response as a table (via
  // `show`) or as JSON.
  template <typename Request, typename Response, typename Show>
  int Unary(grpc::Status (Trainer::Stub::*method)(grpc::ClientContext*, const Request&, Response*),
            const Request& request, Show show) {
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(inv_.timeout_seconds));
    Response response;
    const grpc::Status status = (stub_.get()->*method)(&context, request, &response);
    if (!status.ok()) return RpcFailure(status, inv_, err_);
    out_ << (inv_.json ? ToJson(response) : show(response));
    return kExitOk;
  }

  // Every page of the daemon's runs (each call with the invocation's deadline), shown as one.
  int List() {
    nsa::v1::ListRunsRequest request;
    for (RunState state : inv_.states) request.add_states(state);
    nsa::v1::ListRunsResponse all;
    do {
      grpc::ClientContext context;
      context.set_deadline(DeadlineAfter(inv_.timeout_seconds));
      nsa::v1::ListRunsResponse page;
      const grpc::Status status = stub_->ListRuns(&context, request, &page);
      if (!status.ok()) return RpcFailure(status, inv_, err_);
      for (auto& run : *page.mutable_runs()) *all.add_runs() = std::move(run);
      request.set_page_token(page.next_page_token());
    } while (!request.page_token().empty());
    out_ << (inv_.json ? ToJson(all) : FormatRunList(all));
    return kExitOk;
  }

  // Sends the config file as config_json so that the daemon, not nsactl, decides what is
  // valid and names unknown fields. Only --name needs the file parsed here; a file that does
  // not parse goes as it is, and the daemon's error names what is wrong (exit 1, as without
  // --name).
  int Start() {
    std::error_code ignored;
    std::ifstream file(inv_.config_path, std::ios::binary);
    if (!file || std::filesystem::is_directory(inv_.config_path, ignored)) {
      err_ << "nsactl: cannot read config file '" << inv_.config_path << "'\n";
      return kExitUsage;
    }
    std::stringstream contents;
    contents << file.rdbuf();
    std::string config_json = contents.str();

    if (!inv_.name_override.empty()) {
      nsa::v1::RunConfig config;
      if (google::protobuf::util::JsonStringToMessage(config_json, &config).ok()) {
        config.set_name(inv_.name_override);
        config_json = ToJson(config, /*multiline=*/false);
      }
    }

    nsa::v1::StartRunRequest request;
    request.set_config_json(config_json);
    nsa::v1::StartRunResponse response;
    grpc::ClientContext context;
    context.set_deadline(DeadlineAfter(inv_.timeout_seconds));
    const grpc::Status status = stub_->StartRun(&context, request, &response);
    if (!status.ok()) return RpcFailure(status, inv_, err_);

    const auto& run = response.run();
    if (inv_.json) {
      out_ << ToJson(response, /*multiline=*/!inv_.watch_after_start);
      if (inv_.watch_after_start) out_ << '\n';
    } else {
      out_ << "started run " << run.run_id();
      if (!run.config().name().empty()) out_ << " (" << run.config().name() << ")";
      // Device and size are known once the worker has built the model (nsactl status).
      out_ << ": " << nsa::v1::RunState_Name(run.state()) << "\n";
    }
    out_.flush();
    return inv_.watch_after_start ? Watch(run.run_id()) : kExitOk;
  }

  // Follows WatchRun until the run ends. No deadline: runs last hours. Connecting was
  // already checked with a deadline, and Ctrl-C cancels through the interrupter.
  int Watch(const std::string& run_id) {
    grpc::ClientContext context;
    nsa::v1::WatchRunRequest request;
    request.set_run_id(run_id);
    if (interrupter_ != nullptr) interrupter_->Attach(&context);
    auto reader = stub_->WatchRun(&context, request);

    nsa::v1::RunEvent event;
    RunState last_state = nsa::v1::RUN_STATE_UNSPECIFIED;
    std::string last_message;
    while (reader->Read(&event)) {
      out_ << (inv_.json ? ToJson(event, /*multiline=*/false) : FormatEvent(event)) << '\n';
      out_.flush();  // a line per event as it happens, also through pipes
      last_state = event.state();
      last_message = event.message();
      if (nsa::v1::IsTerminal(last_state)) {
        context.TryCancel();  // the run is over; do not wait for the server to close
        break;
      }
    }
    const grpc::Status status = reader->Finish();
    if (interrupter_ != nullptr) interrupter_->Detach();

    if (last_state == nsa::v1::FAILED) {
      err_ << "nsactl: run " << run_id << " FAILED"
           << (last_message.empty() ? "" : ": " + last_message) << "\n";
      return kExitRunFailed;
    }
    if (nsa::v1::IsTerminal(last_state)) return kExitOk;
    if (interrupter_ != nullptr && interrupter_->interrupted()) {
      err_ << "nsactl: stopped watching; run " << run_id << " keeps going\n";
      return kExitInterrupted;
    }
    if (!status.ok()) return RpcFailure(status, inv_, err_);
    err_ << "nsactl: the daemon closed the stream before run " << run_id << " ended (last state "
         << StateName(last_state) << ")\n";
    return kExitRpcError;
  }

  const Invocation& inv_;
  std::unique_ptr<Trainer::Stub> stub_;
  std::ostream& out_;
  std::ostream& err_;
  WatchInterrupter* interrupter_;
};

}  // namespace

void WatchInterrupter::Interrupt() {
  std::lock_guard<std::mutex> lock(mutex_);
  interrupted_ = true;
  if (context_ != nullptr) context_->TryCancel();
}

bool WatchInterrupter::interrupted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return interrupted_;
}

void WatchInterrupter::Attach(grpc::ClientContext* context) {
  std::lock_guard<std::mutex> lock(mutex_);
  context_ = context;
  if (interrupted_) context_->TryCancel();
}

void WatchInterrupter::Detach() {
  std::lock_guard<std::mutex> lock(mutex_);
  context_ = nullptr;
}

int ExecuteOnChannel(const Invocation& invocation, const std::shared_ptr<grpc::Channel>& channel,
                     std::ostream& out, std::ostream& err, WatchInterrupter* interrupter) {
  if (!Connect(*channel, invocation.timeout_seconds)) {
    PrintUnreachable(invocation, err);
    return kExitUnreachable;
  }
  return CommandRunner(invocation, channel, out, err, interrupter).Run();
}

int Execute(const Invocation& invocation, std::ostream& out, std::ostream& err,
            WatchInterrupter* interrupter) {
  auto channel = grpc::CreateChannel(invocation.address, grpc::InsecureChannelCredentials());
  return ExecuteOnChannel(invocation, channel, out, err, interrupter);
}

const char* StatusCodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK: return "OK";
    case grpc::StatusCode::CANCELLED: return "CANCELLED";
    case grpc::StatusCode::UNKNOWN: return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND: return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS: return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED: return "PERMISSION_DENIED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED: return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE: return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED: return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL: return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE: return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS: return "DATA_LOSS";
    case grpc::StatusCode::UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "UNKNOWN_STATUS_CODE";
  }
}

}  // namespace nsactl
