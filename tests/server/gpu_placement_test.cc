#include "gpu_placement.h"

#include <gtest/gtest.h>

namespace nsad::server {
namespace {

using Gpus = std::vector<int>;

TEST(GpuPlacement, ANamedDeviceHoldsWhatItNames) {
  EXPECT_EQ(NamedGpus("cuda:3", 1, 8), Gpus({3}));
  EXPECT_EQ(NamedGpus("cuda", 1, 8), Gpus({0}));
  EXPECT_EQ(NamedGpus("cuda", 4, 8), Gpus({0, 1, 2, 3})) << "one worker per GPU, rank order";
  EXPECT_EQ(NamedGpus("auto", 2, 2), Gpus({0, 1}));
  EXPECT_EQ(NamedGpus("cpu", 1, 8), Gpus());
  EXPECT_EQ(NamedGpus("auto", 1, 0), Gpus()) << "auto without a GPU is the CPU";
}

// Before: every run with device "auto" went on cuda:0, however many GPUs stood idle.
TEST(GpuPlacement, ARunGoesOnTheGpusTheFewestRunsHold) {
  EXPECT_EQ(LeastLoadedGpus({0, 0, 0, 0}, 1), Gpus({0})) << "ties to the lower index";
  EXPECT_EQ(LeastLoadedGpus({1, 0, 0, 0}, 1), Gpus({1}));
  EXPECT_EQ(LeastLoadedGpus({1, 1, 0, 1}, 1), Gpus({2}));
  EXPECT_EQ(LeastLoadedGpus({2, 1, 1, 1}, 1), Gpus({1})) << "all in use: the least shared";
  EXPECT_EQ(LeastLoadedGpus({1, 0, 1, 0}, 2), Gpus({1, 3})) << "a data-parallel run on two free GPUs";
  EXPECT_EQ(LeastLoadedGpus({0, 3, 0, 1}, 3), Gpus({0, 2, 3})) << "ascending: rank 0 on the first";
}

TEST(GpuPlacement, MoreGpusThanTheMachineHasPlacesNothing) {
  EXPECT_EQ(LeastLoadedGpus({0, 0}, 3), Gpus());
  EXPECT_EQ(LeastLoadedGpus({}, 1), Gpus());
  EXPECT_EQ(LeastLoadedGpus({0}, 0), Gpus());
}

TEST(GpuPlacement, NamesTheGpusAsTheWorkersReportThem) {
  EXPECT_EQ(GpuNames({1}), "cuda:1");
  EXPECT_EQ(GpuNames({2, 3}), "cuda:2,cuda:3");
  EXPECT_EQ(GpuNames({}), "");
}

}  // namespace
}  // namespace nsad::server
