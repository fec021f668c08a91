// BatchSource on a CUDA device: the batches reach the GPU through a small ring of page-locked
// buffers, each reused only after its previous copy finished. Pulling more batches back to
// back than the ring holds must still give every batch intact, in the order the CPU source
// gives them (same seed, same data).
#include <gtest/gtest.h>

#include <vector>

#include "tiny_run.h"
#include "trainer/batches.h"

namespace nsad {
namespace {

TEST_F(TrainerTest, BatchesReachTheDeviceIntactThroughThePinnedRing) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  TrainConfig config = Tiny();
  config.eval_batches = 9;  // validation copies them back to back, more than the ring holds
  BatchSource on_cpu(config, torch::Device(torch::kCPU));
  BatchSource on_gpu(config, torch::Device(torch::kCUDA, 0));

  std::vector<torch::Tensor> train_gpu, train_cpu;
  for (int step = 1; step <= 11; ++step) {  // no synchronisation in between
    train_gpu.push_back(on_gpu.NextTrain(step));
    train_cpu.push_back(on_cpu.NextTrain(step));
  }
  for (size_t i = 0; i < train_gpu.size(); ++i) {
    ASSERT_TRUE(train_gpu[i].is_cuda());
    EXPECT_TRUE(torch::equal(train_gpu[i].cpu(), train_cpu[i])) << "train batch " << i;
  }
  const auto& val_gpu = on_gpu.ValBatches();
  const auto& val_cpu = on_cpu.ValBatches();
  ASSERT_EQ(val_gpu.size(), val_cpu.size());
  ASSERT_EQ(val_gpu.size(), 9u);
  for (size_t i = 0; i < val_gpu.size(); ++i) {
    EXPECT_TRUE(torch::equal(val_gpu[i].cpu(), val_cpu[i])) << "validation batch " << i;
  }
}

}  // namespace
}  // namespace nsad
