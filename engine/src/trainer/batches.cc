#include "trainer/batches.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>

#include <algorithm>
#include <array>
#include <chrono>

#include "data/data_error.h"
#include "nsad/engine.h"

namespace nsad {

namespace {

// `rows` rows of the batch from row `first` on, as int64, widened by this thread into `out`.
// Tensor::copy_ would hand it to ATen's OpenMP pool: 16 x 2049 tokens are just over its
// 32768-element grain. In the daemon's worker on the H100 machine that copy took 3-9 ms of
// every m7c step; this loop takes 0.05 ms, the same copy_ with OMP_NUM_THREADS=1 0.06 ms
// (measured with a temporary timer).
void WidenTokens(const data::Batch& batch, int64_t first, int64_t rows, int64_t* out) {
  const int64_t row_tokens = int64_t{batch.seq_len} + 1;
  const auto begin = batch.tokens.begin() + first * row_tokens;
  std::copy(begin, begin + rows * row_tokens, out);
}

}  // namespace

// Page-locked int64 buffers allocated once and reused round-robin, each only after its last
// copy to the device has finished (its event). With every batch pinned afresh
// (Tensor::pin_memory) the daemon's m7c steps on the H100 machine spent 11.5-16.9 ms of
// their ~125 ms getting the batch; with this ring, 3.9-8.1 ms, most of it the widening that
// WidenTokens now does in 0.05 ms.
struct BatchSource::PinnedStaging {
  struct Slot {
    torch::Tensor host;
    at::cuda::CUDAEvent copied;
  };
  std::array<Slot, 4> slots;  // more than one: validation copies several batches back to back
  size_t next = 0;
};

BatchSource::BatchSource(const TrainConfig& config, torch::Device device, int rank)
    : config_(config),
      device_(device),
      rank_(rank),
      splits_(data::OpenDataset(config.data, config.seq_len)) {
  data::LoaderOptions options;
  options.batch_size = config.batch_size * config.world_size;
  options.seq_len = config.seq_len;
  options.seed = config.seed;
  options.shuffle = true;
  options.vocab_size = config.model.vocab_size;
  train_ = std::make_unique<data::BatchLoader>(splits_.train, options);
}

BatchSource::~BatchSource() = default;

torch::Tensor BatchSource::ToDevice(const data::Batch& batch) {
  const int64_t rows = config_.batch_size, first = int64_t{rank_} * rows;
  const std::vector<int64_t> sizes = {rows, int64_t{batch.seq_len} + 1};
  if (!device_.is_cuda()) {
    auto tokens = torch::empty(sizes, torch::kInt64);
    WidenTokens(batch, first, rows, tokens.data_ptr<int64_t>());
    return tokens;
  }
  if (!staging_) staging_ = std::make_unique<PinnedStaging>();
  auto& slot = staging_->slots[staging_->next++ % staging_->slots.size()];
  if (!slot.host.defined() || slot.host.sizes() != torch::IntArrayRef(sizes)) {
    slot.host = torch::empty(sizes, torch::TensorOptions(torch::kInt64).pinned_memory(true));
  } else {
    slot.copied.synchronize();  // its previous copy has left the buffer
  }
  WidenTokens(batch, first, rows, slot.host.data_ptr<int64_t>());
  // Asynchronous from page-locked memory, on the stream the step runs on.
  auto on_device = slot.host.to(device_, /*non_blocking=*/true);
  slot.copied.record(at::cuda::getCurrentCUDAStream(device_.index()));
  return on_device;
}

torch::Tensor BatchSource::NextTrain(int64_t step) {
  const auto start = std::chrono::steady_clock::now();
  try {
    auto batch = ToDevice(train_->Next());
    data_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return batch;
  } catch (const data::DataError& e) {
    throw TrainingHalt(step, std::string("bad training data: ") + e.what());
  }
}

double BatchSource::TakeDataSeconds() {
  const double seconds = data_seconds_;
  data_seconds_ = 0.0;
  return seconds;
}

const std::vector<torch::Tensor>& BatchSource::ValBatches() {
  if (!val_.empty() || splits_.val.empty()) return val_;
  data::LoaderOptions options;
  options.batch_size = config_.batch_size * config_.world_size;
  options.seq_len = config_.seq_len;
  options.shuffle = false;  // the first windows of the split, always the same ones
  options.vocab_size = config_.model.vocab_size;
  options.prefetch_batches = 0;
  data::BatchLoader loader(splits_.val, options);
  // More batches than the split holds would only repeat its windows (and hold them all on
  // the device): the evaluation takes the split once at most.
  int64_t windows = 0;
  for (const auto& span : splits_.val) windows += span.NumWindows(config_.seq_len);
  const int64_t batches =
      std::min<int64_t>(config_.eval_batches, (windows + options.batch_size - 1) / options.batch_size);
  for (int64_t i = 0; i < batches; ++i) val_.push_back(ToDevice(loader.Next()));
  return val_;
}

}  // namespace nsad
