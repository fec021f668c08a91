#include "trainer/schedule.h"

#include <algorithm>
#include <cmath>

namespace nsad {

double ScheduledLr(const OptimConfig& o, int64_t step, int64_t max_steps) {
  if (o.warmup_steps > 0 && step < o.warmup_steps) {
    return o.lr * static_cast<double>(step + 1) / o.warmup_steps;
  }
  const double span = std::max<int64_t>(1, max_steps - o.warmup_steps);
  const double progress = std::min(1.0, (step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace nsad
