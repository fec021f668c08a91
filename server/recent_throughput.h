// A run's throughput over its most recent steps: the tokens of the last (up to) `capacity`
// steps over their summed step time, the window TorchTitan logs its tokens/s over.
//
// Why a window: the last step alone swings with each step's time (the m7c step on one H100
// moves by 1-2 ms from step to step), and the run's mean includes its first steps (the GEMM
// timing and the CUDA graph's capture take seconds), so it nears the steady rate only over
// thousands of steps.
#pragma once

#include <cstddef>
#include <deque>
#include <utility>

namespace nsad::server {

class RecentThroughput {
 public:
  static constexpr std::size_t kDefaultSteps = 100;

  explicit RecentThroughput(std::size_t capacity = kDefaultSteps) : capacity_(capacity > 0 ? capacity : 1) {}

  // One finished step: its tokens (over all workers) and its seconds (pauses excluded).
  void Add(double tokens, double seconds) {
    steps_.emplace_back(tokens, seconds);
    if (steps_.size() > capacity_) steps_.pop_front();
  }

  // Tokens per second over the window; 0 before the first step. Summed afresh on each call
  // (at most `capacity` pairs), so no running sum drifts over a long run.
  double TokensPerSecond() const {
    double tokens = 0.0, seconds = 0.0;
    for (const auto& [t, s] : steps_) tokens += t, seconds += s;
    return seconds > 0.0 ? tokens / seconds : 0.0;
  }

  // Steps in the window: min(steps added, capacity).
  int steps() const { return static_cast<int>(steps_.size()); }

 private:
  std::size_t capacity_;
  std::deque<std::pair<double, double>> steps_;
};

}  // namespace nsad::server
