// The prefetching batch loader: window layout, deterministic order, exact resume (with
// batches in flight), and out-of-vocabulary tokens found mid-run.
#include "data/batch_loader.h"

#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <thread>

#include "data/data_error.h"
#include "test_util.h"

namespace nsad::data {
namespace {

using testing::Iota;
using testing::TempDir;

// Shard k holds tokens k*100000, k*100000 + 1, ...: a token says which shard and offset it
// came from, and no run of consecutive ids crosses a shard.
constexpr uint32_t kShardStride = 100000;

std::vector<TokenSpan> UniqueTokenShards(const TempDir& dir, const std::vector<int64_t>& sizes) {
  for (size_t k = 0; k < sizes.size(); ++k) {
    WriteShard(dir.File("s_00000" + std::to_string(k) + ".bin"),
               Iota(sizes[k], static_cast<uint32_t>(k) * kShardStride), TokenWidth::kUint32);
  }
  DataConfig config;
  config.train_path = dir.File("s_*.bin");
  config.val_fraction = 0.0f;
  return OpenDataset(config, 1).train;  // seq_len only matters for the split check here
}

LoaderOptions Options(int batch_size, int seq_len, uint64_t seed, int prefetch = 3) {
  LoaderOptions o;
  o.batch_size = batch_size;
  o.seq_len = seq_len;
  o.seed = seed;
  o.prefetch_batches = prefetch;
  return o;
}

std::vector<Batch> Take(BatchLoader& loader, int n) {
  std::vector<Batch> batches;
  for (int i = 0; i < n; ++i) batches.push_back(loader.Next());
  return batches;
}

// The first token of every row, in stream order: identifies each window.
std::vector<int32_t> RowStarts(const std::vector<Batch>& batches) {
  std::vector<int32_t> starts;
  for (const Batch& b : batches) {
    for (int r = 0; r < b.batch_size; ++r) starts.push_back(b.tokens[r * (b.seq_len + 1)]);
  }
  return starts;
}

void ExpectSameBatches(const std::vector<Batch>& got, const std::vector<Batch>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].position, want[i].position) << "batch " << i;
    EXPECT_EQ(got[i].epoch, want[i].epoch) << "batch " << i;
    EXPECT_EQ(got[i].tokens, want[i].tokens) << "batch " << i;
  }
}

TEST(BatchLoader, RowsAreWindowsInsideOneShardWithShiftedTargets) {
  TempDir dir;
  const int seq_len = 8;
  const auto spans = UniqueTokenShards(dir, {100, 57, 33});
  BatchLoader loader(spans, Options(5, seq_len, 42));
  // (99/8) + (56/8) + (32/8) = 12 + 7 + 4 windows per epoch.
  EXPECT_EQ(loader.windows_per_epoch(), 23u);
  for (const Batch& b : Take(loader, 10)) {
    ASSERT_EQ(b.batch_size, 5);
    ASSERT_EQ(b.seq_len, seq_len);
    ASSERT_EQ(b.tokens.size(), 5u * (seq_len + 1));
    for (int r = 0; r < b.batch_size; ++r) {
      const int32_t* row = &b.tokens[r * (seq_len + 1)];
      const int32_t offset = row[0] % kShardStride;
      EXPECT_EQ(offset % seq_len, 0) << "window starts on a seq_len boundary";
      // Target j is input j + 1: the row is seq_len + 1 consecutive tokens of one shard.
      for (int j = 0; j < seq_len; ++j) ASSERT_EQ(row[j + 1], row[j] + 1);
    }
  }
}

TEST(BatchLoader, EachEpochVisitsEveryWindowOnceInANewOrder) {
  TempDir dir;
  const int seq_len = 4;
  const auto spans = UniqueTokenShards(dir, {41, 21, 13});  // 10 + 5 + 3 = 18 windows
  BatchLoader loader(spans, Options(3, seq_len, 7));
  const std::vector<int32_t> starts = RowStarts(Take(loader, 12));  // two epochs of 18
  const std::vector<int32_t> epoch0(starts.begin(), starts.begin() + 18);
  const std::vector<int32_t> epoch1(starts.begin() + 18, starts.end());

  std::set<int32_t> expected;
  for (int k = 0; k < 10; ++k) expected.insert(k * seq_len);
  for (int k = 0; k < 5; ++k) expected.insert(kShardStride + k * seq_len);
  for (int k = 0; k < 3; ++k) expected.insert(2 * kShardStride + k * seq_len);
  EXPECT_EQ(std::set<int32_t>(epoch0.begin(), epoch0.end()), expected);
  EXPECT_EQ(std::set<int32_t>(epoch1.begin(), epoch1.end()), expected);
  EXPECT_NE(epoch0, epoch1) << "each epoch reshuffles";
}

TEST(BatchLoader, SameSeedSameOrderOtherSeedOtherOrder) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {400, 300});
  BatchLoader a(spans, Options(4, 16, 1234));
  BatchLoader b(spans, Options(4, 16, 1234));
  BatchLoader c(spans, Options(4, 16, 1235));
  const auto batches_a = Take(a, 15);
  ExpectSameBatches(Take(b, 15), batches_a);
  EXPECT_NE(RowStarts(Take(c, 15)), RowStarts(batches_a));
}

TEST(BatchLoader, WithoutShuffleWindowsComeInFileOrder) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {21, 13});  // 5 + 3 windows of 4
  LoaderOptions options = Options(3, 4, 99);
  options.shuffle = false;
  BatchLoader loader(spans, options);
  const int32_t s = kShardStride;
  EXPECT_EQ(RowStarts(Take(loader, 4)),
            (std::vector<int32_t>{0, 4, 8, 12, 16, s, s + 4, s + 8, 0, 4, 8, 12}));
}

TEST(BatchLoader, PrefetchDoesNotChangeTheStream) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {300, 200, 100});
  BatchLoader synchronous(spans, Options(4, 8, 5, /*prefetch=*/0));
  BatchLoader prefetching(spans, Options(4, 8, 5, /*prefetch=*/6));
  ExpectSameBatches(Take(prefetching, 40), Take(synchronous, 40));
}

// Saves after `consumed` batches (with the prefetch queue full), restores into a fresh
// loader and checks that it continues exactly like an uninterrupted one.
void CheckResume(const std::vector<TokenSpan>& spans, int consumed, int after) {
  BatchLoader reference(spans, Options(4, 8, 11));
  const std::vector<Batch> expected = Take(reference, consumed + after);

  std::string saved;
  {
    BatchLoader first(spans, Options(4, 8, 11, /*prefetch=*/5));
    Take(first, consumed);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // let the producer run ahead
    saved = first.SavePosition();
    EXPECT_EQ(first.position(), static_cast<uint64_t>(consumed) * 4);
  }
  BatchLoader resumed(spans, Options(4, 8, 11, /*prefetch=*/5));
  Take(resumed, 2);  // the restore must also discard this loader's own queued batches
  resumed.RestorePosition(saved);
  EXPECT_EQ(resumed.position(), static_cast<uint64_t>(consumed) * 4);
  ExpectSameBatches(Take(resumed, after),
                    std::vector<Batch>(expected.begin() + consumed, expected.end()));
}

TEST(BatchLoaderResume, MidEpochWithPrefetchInFlight) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {161, 137});  // 20 + 17 = 37 windows per epoch
  CheckResume(spans, /*consumed=*/3, /*after=*/12);       // saved at window 12 of epoch 0
}

TEST(BatchLoaderResume, AcrossAnEpochBoundary) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {161, 137});  // 37 windows per epoch
  // Batch 9 holds windows 36..39, straddling epochs 0 and 1; save right before and after it.
  CheckResume(spans, /*consumed=*/9, /*after=*/6);
  CheckResume(spans, /*consumed=*/10, /*after=*/12);
}

TEST(BatchLoaderResume, RewindOnTheSameLoaderAndChangeBatchSize) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {161, 137});
  BatchLoader loader(spans, Options(4, 8, 3));
  const std::vector<Batch> first = Take(loader, 5);
  loader.Seek(0);  // e.g. the same validation batches at every evaluation
  ExpectSameBatches(Take(loader, 5), first);
  const std::string saved = loader.SavePosition();
  const std::vector<Batch> next = Take(loader, 8);
  loader.RestorePosition(saved);
  ExpectSameBatches(Take(loader, 8), next);

  // The position counts windows, so a loader with another batch size continues the same
  // stream of windows.
  BatchLoader pairs(spans, Options(2, 8, 3));
  pairs.RestorePosition(saved);
  EXPECT_EQ(RowStarts(Take(pairs, 16)), RowStarts(next));
}

TEST(BatchLoaderResume, RejectsPositionsOfAnotherStream) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {161, 137});
  BatchLoader loader(spans, Options(4, 8, 3));
  Take(loader, 2);
  const std::string saved = loader.SavePosition();
  EXPECT_NE(saved.find("position=8"), std::string::npos) << saved;

  BatchLoader other_seed(spans, Options(4, 8, 4));
  try {
    other_seed.RestorePosition(saved);
    ADD_FAILURE() << "restored a position of another seed";
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "seed");
  }
  BatchLoader other_seq_len(spans, Options(4, 16, 3));
  EXPECT_THROW(other_seq_len.RestorePosition(saved), DataError);
  TempDir other_dir;
  BatchLoader other_data(UniqueTokenShards(other_dir, {161, 137, 50}), Options(4, 8, 3));
  try {
    other_data.RestorePosition(saved);
    ADD_FAILURE() << "restored a position taken on other data";
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "data.train_path");
  }
  EXPECT_THROW(loader.RestorePosition("garbage"), std::invalid_argument);
  EXPECT_THROW(loader.RestorePosition("nsad-data-position/1 position=x"), std::invalid_argument);
  // A failed restore leaves the loader where it was.
  EXPECT_EQ(loader.position(), 8u);
  EXPECT_EQ(loader.Next().position, 8u);
}

TEST(BatchLoader, OutOfVocabularyTokenMidRunStopsTheStream) {
  TempDir dir;
  const int seq_len = 8;
  std::vector<uint32_t> tokens(8 * 40 + 1);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = i % 256;
  tokens[8 * 20 + 3] = 4096;  // inside window 20 only
  WriteShard(dir.File("bytes.bin"), tokens, TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("bytes.bin");
  config.val_fraction = 0.0f;
  // The StartRun scan is bounded; here it stops before the bad token, so only the producer
  // can find it.
  EXPECT_NO_THROW(ValidateDataset(config, seq_len, 256, /*max_scan_tokens=*/100));

  LoaderOptions options = Options(4, seq_len, 0, /*prefetch=*/3);
  options.shuffle = false;
  options.vocab_size = 256;
  BatchLoader loader(OpenDataset(config, seq_len).train, options);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(loader.Next().position, static_cast<uint64_t>(4 * i));
  for (int attempt = 0; attempt < 2; ++attempt) {  // sticky: the stream does not move on
    try {
      loader.Next();
      ADD_FAILURE() << "out-of-vocabulary token passed";
    } catch (const DataError& e) {
      EXPECT_EQ(e.field(), "data.train_path");
      EXPECT_NE(e.message().find(dir.File("bytes.bin")), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("token 4096 at token index 163"), std::string::npos) << e.what();
      EXPECT_NE(e.message().find("outside the vocabulary"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(loader.position(), 20u);
}

TEST(BatchLoader, DestructionWithAFullQueueDoesNotHang) {
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {1000});
  for (int prefetch : {1, 8}) {
    auto loader = std::make_unique<BatchLoader>(spans, Options(2, 8, 1, prefetch));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // producer blocks on a full queue
    loader.reset();
  }
  BatchLoader never_used(spans, Options(2, 8, 1));  // destroyed while possibly still producing
}

TEST(BatchLoader, RejectsDataWithoutAWindow) {
  EXPECT_THROW(BatchLoader(std::vector<TokenSpan>{}, Options(2, 8, 1)), DataError);
  TempDir dir;
  const auto spans = UniqueTokenShards(dir, {100});
  EXPECT_THROW(BatchLoader(spans, Options(2, 100, 1)), DataError);  // 100 tokens < 101
  EXPECT_THROW(BatchLoader(spans, Options(0, 8, 1)), std::invalid_argument);
}

}  // namespace
}  // namespace nsad::data
