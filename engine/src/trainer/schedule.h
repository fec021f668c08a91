// The learning-rate schedule of a run: linear warmup to lr over warmup_steps, then cosine
// decay to min_lr at max_steps. The trainer's, and train_bench's --lr-warmup.
#pragma once

#include <cstdint>

#include "nsad/config.h"

namespace nsad {

// The learning rate of step `step` (counted from 0).
double ScheduledLr(const OptimConfig& o, int64_t step, int64_t max_steps);

}  // namespace nsad
