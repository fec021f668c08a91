// What the daemon, its metrics and nsactl agree about trainer.proto's RunState.
#pragma once

#include "nsa/v1/trainer.pb.h"

namespace nsa::v1 {

// COMPLETED, HALTED or FAILED: the run's thread and its workers are gone; only a resume
// (of a HALTED or FAILED run) starts it again.
inline bool IsTerminal(RunState state) { return state == COMPLETED || state == HALTED || state == FAILED; }

}  // namespace nsa::v1
