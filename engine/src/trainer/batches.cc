#include "trainer/batches.h"

#include "data/data_error.h"
#include "nsad/engine.h"

namespace nsad {

BatchSource::BatchSource(const TrainConfig& config, torch::Device device)
    : config_(config), device_(device), splits_(data::OpenDataset(config.data, config.seq_len)) {
  data::LoaderOptions options;
  options.batch_size = config.batch_size;
  options.seq_len = config.seq_len;
  options.seed = config.seed;
  options.shuffle = true;
  options.vocab_size = config.model.vocab_size;
  train_ = std::make_unique<data::BatchLoader>(splits_.train, options);
}

torch::Tensor BatchSource::ToDevice(const data::Batch& batch) const {
  auto host = torch::from_blob(const_cast<int32_t*>(batch.tokens.data()),
                               {batch.batch_size, batch.seq_len + 1}, torch::kInt32)
                  .to(torch::kInt64);
  if (!device_.is_cuda()) return host;
  // Pinned staging lets the copy overlap with the previous step's kernels.
  return host.pin_memory().to(device_, /*non_blocking=*/true);
}

torch::Tensor BatchSource::NextTrain(int64_t step) {
  try {
    return ToDevice(train_->Next());
  } catch (const data::DataError& e) {
    throw TrainingHalt(step, std::string("bad training data: ") + e.what());
  }
}

const std::vector<torch::Tensor>& BatchSource::ValBatches() {
  if (!val_.empty() || splits_.val.empty()) return val_;
  data::LoaderOptions options;
  options.batch_size = config_.batch_size;
  options.seq_len = config_.seq_len;
  options.shuffle = false;  // the first windows of the split, always the same ones
  options.vocab_size = config_.model.vocab_size;
  options.prefetch_batches = 0;
  data::BatchLoader loader(splits_.val, options);
  for (int i = 0; i < config_.eval_batches; ++i) val_.push_back(ToDevice(loader.Next()));
  return val_;
}

}  // namespace nsad
