// Token batches as device tensors for the trainer: the training stream (shuffled, seeded,
// prefetched by data::BatchLoader) and a fixed set of validation batches. In a data-parallel
// run every worker reads the whole global batch (world_size x batch_size windows, what one
// worker would read) and keeps its own rows: together the workers train on exactly the
// single worker's batches, and the saved position is the same on all of them.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <vector>

#include "data/batch_loader.h"
#include "nsad/config.h"

namespace nsad {

class BatchSource {
 public:
  // Opens the data (throws data::DataError naming the field on bad data). `rank` in
  // [0, config.world_size): which batch_size rows of each global batch this worker gets.
  BatchSource(const TrainConfig& config, torch::Device device, int rank = 0);
  ~BatchSource();

  // [batch_size, seq_len + 1] int64 on the device: this worker's rows. Throws TrainingHalt(step) when the data
  // turns out to be bad mid-run (e.g. a token outside the vocabulary).
  torch::Tensor NextTrain(int64_t step);

  // Host seconds NextTrain has taken since the last call (the step's data time).
  double TakeDataSeconds();

  // The same eval_batches batches on every call, so validation losses are comparable.
  const std::vector<torch::Tensor>& ValBatches();

  data::BatchLoader& train_loader() { return *train_; }

 private:
  torch::Tensor ToDevice(const data::Batch& batch);  // this worker's rows of it

  struct PinnedStaging;  // page-locked host buffers for the copies to a CUDA device

  TrainConfig config_;
  torch::Device device_;
  int rank_;
  data::DatasetSplits splits_;
  std::unique_ptr<data::BatchLoader> train_;
  std::vector<torch::Tensor> val_;
  std::unique_ptr<PinnedStaging> staging_;
  double data_seconds_ = 0.0;
};

}  // namespace nsad
