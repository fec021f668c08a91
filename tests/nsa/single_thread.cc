// ctest runs test processes side by side on a 2-core machine; torch's OpenMP pool would
// then oversubscribe the cores and its spin-waiting threads slow every test down by an
// order of magnitude (measured: 34 s vs 559 s for the naive-vs-reference cases at -j2).
// One intra-op thread per test process keeps the suite fast under any ctest -j.
#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

class SingleThreadedTorch : public ::testing::Environment {
 public:
  void SetUp() override { torch::set_num_threads(1); }
};

const auto* const kRegistered = ::testing::AddGlobalTestEnvironment(new SingleThreadedTorch);

}  // namespace
