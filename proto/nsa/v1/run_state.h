// What the daemon, its metrics and nsactl agree about trainer.proto's RunState.
#pragma once

#include <cstddef>

#include "nsa/v1/trainer.pb.h"

namespace nsa::v1 {

// COMPLETED, HALTED or FAILED: the run's thread and its workers are gone; only a resume
// (of a HALTED or FAILED run) starts it again.
inline bool IsTerminal(RunState state) { return state == COMPLETED || state == HALTED || state == FAILED; }

// HaltRun's reason becomes the run's message: in its record and in every ListRuns reply, which
// a client takes up to 4 MiB of. Longer reasons are refused (the webhook shortens an alert's).
inline constexpr size_t kMaxHaltReasonBytes = 1024;

}  // namespace nsa::v1
