// Executes a parsed nsactl Invocation against the daemon over gRPC.
#pragma once

#include <memory>
#include <mutex>
#include <ostream>

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>

#include "cli.h"

namespace nsactl {

// Lets another thread (main's signal thread) end a `watch` on Ctrl-C: it cancels the
// stream, which stops watching but leaves the run alone. Interrupt() may come before the
// stream exists; it then ends the watch as soon as it starts.
class WatchInterrupter {
 public:
  void Interrupt();
  bool interrupted() const;

  // Used by the watch command around the lifetime of its ClientContext.
  void Attach(grpc::ClientContext* context);
  void Detach();

 private:
  mutable std::mutex mutex_;
  grpc::ClientContext* context_ = nullptr;
  bool interrupted_ = false;
};

// Connects to invocation.address and runs the command. Results go to `out`, errors to
// `err`; returns the process exit code (see ExitCode).
int Execute(const Invocation& invocation, std::ostream& out, std::ostream& err,
            WatchInterrupter* interrupter = nullptr);

// Same on an existing channel (tests use an in-process server).
int ExecuteOnChannel(const Invocation& invocation, const std::shared_ptr<grpc::Channel>& channel,
                     std::ostream& out, std::ostream& err, WatchInterrupter* interrupter = nullptr);

// "NOT_FOUND", "UNAVAILABLE", ... for error messages.
const char* StatusCodeName(grpc::StatusCode code);

}  // namespace nsactl
