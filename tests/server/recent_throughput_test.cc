#include "recent_throughput.h"

#include <gtest/gtest.h>

namespace nsad::server {
namespace {

TEST(RecentThroughput, IsZeroBeforeTheFirstStep) {
  const RecentThroughput recent;
  EXPECT_EQ(recent.steps(), 0);
  EXPECT_EQ(recent.TokensPerSecond(), 0.0);
}

// Tokens over time, not the mean of per-step rates: a slow step weighs by its duration.
TEST(RecentThroughput, DividesTheWindowsTokensByItsTime) {
  RecentThroughput recent(10);
  recent.Add(1000, 1.0);  // 1000 tok/s
  recent.Add(1000, 0.5);  // 2000 tok/s
  EXPECT_EQ(recent.steps(), 2);
  EXPECT_DOUBLE_EQ(recent.TokensPerSecond(), 2000.0 / 1.5);
}

// A run's first steps (GEMM timing, graph capture) leave the window after `capacity` steps.
TEST(RecentThroughput, ForgetsStepsOlderThanItsCapacity) {
  RecentThroughput recent(3);
  recent.Add(32768, 1.5);  // the first step: seconds of one-off work
  for (int i = 0; i < 2; ++i) recent.Add(32768, 0.08);
  EXPECT_LT(recent.TokensPerSecond(), 32768 / 0.5);
  recent.Add(32768, 0.08);
  EXPECT_EQ(recent.steps(), 3);
  EXPECT_DOUBLE_EQ(recent.TokensPerSecond(), 3 * 32768 / (3 * 0.08));
}

TEST(RecentThroughput, AZeroCapacityStillKeepsTheLastStep) {
  RecentThroughput recent(0);
  recent.Add(10, 2.0);
  recent.Add(30, 1.0);
  EXPECT_EQ(recent.steps(), 1);
  EXPECT_DOUBLE_EQ(recent.TokensPerSecond(), 30.0);
}

}  // namespace
}  // namespace nsad::server
