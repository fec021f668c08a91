// BatchSource on a CUDA device: the batches reach the GPU through a small ring of page-locked
// buffers, each reused only after its previous copy finished. Pulling more batches back to
// back than the ring holds must still give every batch intact, in the order the CPU source
// gives them (same seed, same data).
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "data/batch_loader.h"
#include "data/dataset.h"
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

// Data parallel: each worker keeps its rows of the global batch, so the workers' batches
// side by side are the single worker's (world_size x batch_size rows), step after step,
// for training and for validation; the stream position is the same on every worker.
TEST_F(TrainerTest, DataParallelWorkersReadTheSingleWorkersBatchesBetweenThem) {
  TrainConfig single = Tiny();
  single.batch_size = 6;
  TrainConfig parallel = single;
  parallel.batch_size = 2;
  parallel.world_size = 3;
  const torch::Device cpu(torch::kCPU);
  BatchSource whole(single, cpu);
  std::vector<std::unique_ptr<BatchSource>> ranks;
  for (int r = 0; r < parallel.world_size; ++r) {
    ranks.push_back(std::make_unique<BatchSource>(parallel, cpu, r));
  }
  for (int step = 1; step <= 7; ++step) {
    std::vector<torch::Tensor> rows;
    for (auto& rank : ranks) rows.push_back(rank->NextTrain(step));
    for (const auto& r : rows) ASSERT_EQ(r.size(0), parallel.batch_size);
    EXPECT_TRUE(torch::equal(torch::cat(rows), whole.NextTrain(step))) << "step " << step;
    for (auto& rank : ranks) {
      EXPECT_EQ(rank->train_loader().SavePosition(), whole.train_loader().SavePosition());
    }
  }
  const auto& val = whole.ValBatches();
  ASSERT_FALSE(val.empty());
  for (size_t i = 0; i < val.size(); ++i) {
    std::vector<torch::Tensor> rows;
    for (auto& rank : ranks) rows.push_back(rank->ValBatches().at(i));
    EXPECT_TRUE(torch::equal(torch::cat(rows), val[i])) << "validation batch " << i;
  }
}

// The int64 batches hold exactly the loader's tokens, in its order, with values beyond 16 bits
// (a uint32 shard, vocabulary over 65535) intact.
TEST_F(TrainerTest, BatchesHoldTheLoadersTokensAsInt64) {
  std::vector<uint32_t> tokens;
  for (uint32_t i = 0; i < 6000; ++i) tokens.push_back((i * 7919u) % 200000u);
  const std::string path = (dir_ / "wide.bin").string();
  data::WriteShard(path, tokens, data::TokenWidth::kUint32);
  TrainConfig config = Tiny();
  config.model.vocab_size = 200000;
  config.data.train_path = path;
  config.data.val_path.clear();
  BatchSource source(config, torch::Device(torch::kCPU));

  data::LoaderOptions options;
  options.batch_size = config.batch_size;
  options.seq_len = config.seq_len;
  options.seed = config.seed;
  options.vocab_size = config.model.vocab_size;
  data::BatchLoader loader(data::OpenDataset(config.data, config.seq_len).train, options);
  int64_t widest = 0;
  for (int step = 1; step <= 5; ++step) {
    const torch::Tensor batch = source.NextTrain(step);
    const data::Batch expected = loader.Next();
    ASSERT_EQ(batch.scalar_type(), torch::kInt64);
    ASSERT_EQ(batch.sizes(), torch::IntArrayRef({config.batch_size, config.seq_len + 1}));
    const int64_t* got = batch.data_ptr<int64_t>();
    for (size_t i = 0; i < expected.tokens.size(); ++i) {
      ASSERT_EQ(got[i], expected.tokens[i]) << "step " << step << ", token " << i;
      widest = std::max(widest, got[i]);
    }
  }
  EXPECT_GT(widest, 65535);  // the test reached tokens a 16-bit shard cannot hold
}

}  // namespace
}  // namespace nsad
