// Train/validation splits and the StartRun validation (headers + vocabulary scan).
#include "data/dataset.h"

#include <gtest/gtest.h>

#include <set>

#include "data/data_error.h"
#include "test_util.h"

namespace nsad::data {
namespace {

using testing::Iota;
using testing::TempDir;

// Every token id covered by the windows of a split (tokens are unique across the test shards).
std::set<uint32_t> WindowTokens(const std::vector<TokenSpan>& spans, int seq_len) {
  std::set<uint32_t> tokens;
  for (const TokenSpan& s : spans) {
    for (int64_t k = 0; k < s.NumWindows(seq_len); ++k) {
      for (int64_t i = 0; i <= seq_len; ++i)
        tokens.insert(s.shard->Token(s.begin + k * seq_len + i));
    }
  }
  return tokens;
}

TEST(DatasetSplit, HeldOutFractionIsTheTailAndDisjoint) {
  TempDir dir;
  // Two shards of unique tokens: 0..599 and 600..999 (one sequence of 1000 tokens).
  WriteShard(dir.File("d_000000.bin"), Iota(600, 0), TokenWidth::kUint32);
  WriteShard(dir.File("d_000001.bin"), Iota(400, 600), TokenWidth::kUint32);
  DataConfig config;
  config.train_path = dir.path().string();
  config.val_fraction = 0.5f;  // cut at token 500, inside the first shard
  const int seq_len = 10;
  const DatasetSplits splits = OpenDataset(config, seq_len);

  ASSERT_EQ(splits.train.size(), 1u);
  EXPECT_EQ(splits.train[0].begin, 0);
  EXPECT_EQ(splits.train[0].end, 500);
  ASSERT_EQ(splits.val.size(), 2u);
  EXPECT_EQ(splits.val[0].begin, 500);
  EXPECT_EQ(splits.val[0].end, 600);
  EXPECT_EQ(splits.val[1].shard->path(), dir.File("d_000001.bin"));
  EXPECT_EQ(splits.val[1].size(), 400);

  const std::set<uint32_t> train = WindowTokens(splits.train, seq_len);
  const std::set<uint32_t> val = WindowTokens(splits.val, seq_len);
  EXPECT_FALSE(train.empty());
  EXPECT_FALSE(val.empty());
  for (uint32_t t : val) ASSERT_EQ(train.count(t), 0u) << "token " << t << " in both splits";
  EXPECT_LT(*train.rbegin(), 500u);
  EXPECT_GE(*val.begin(), 500u);
}

TEST(DatasetSplit, NoFractionMeansNoValidationSplit) {
  TempDir dir;
  WriteShard(dir.File("d_000000.bin"), Iota(1000), TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("d_000000.bin");
  config.val_fraction = 0.0f;
  const DatasetSplits splits = OpenDataset(config, 16);
  ASSERT_EQ(splits.train.size(), 1u);
  EXPECT_EQ(splits.train[0].size(), 1000);
  EXPECT_TRUE(splits.val.empty());
}

TEST(DatasetSplit, PieceTooShortForAWindowIsDropped) {
  TempDir dir;
  WriteShard(dir.File("d_000000.bin"), Iota(1000), TokenWidth::kUint16);
  WriteShard(dir.File("d_000001.bin"), Iota(20, 1000), TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.path().string();
  config.val_fraction = 25.0f / 1020.0f;  // cut at token 995: 5 tokens of shard 0 are held out
  const DatasetSplits splits = OpenDataset(config, 16);
  ASSERT_EQ(splits.train.size(), 1u);
  EXPECT_EQ(splits.train[0].end, 995);
  // The 5-token tail of shard 0 cannot hold a 17-token window, so only shard 1 remains.
  ASSERT_EQ(splits.val.size(), 1u);
  EXPECT_EQ(splits.val[0].shard->path(), dir.File("d_000001.bin"));
  EXPECT_EQ(splits.val[0].size(), 20);
}

TEST(DatasetSplit, SeparateValPath) {
  TempDir dir;
  WriteShard(dir.File("x_train_000000.bin"), Iota(300), TokenWidth::kUint16);
  WriteShard(dir.File("x_train_000001.bin"), Iota(300, 300), TokenWidth::kUint16);
  WriteShard(dir.File("x_val_000000.bin"), Iota(100, 1000), TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("x_train_*.bin");
  config.val_path = dir.File("x_val_*.bin");
  config.val_fraction = 0.5f;  // ignored when val_path is set
  const DatasetSplits splits = OpenDataset(config, 8);
  ASSERT_EQ(splits.train.size(), 2u);
  EXPECT_EQ(splits.train[0].size() + splits.train[1].size(), 600);
  ASSERT_EQ(splits.val.size(), 1u);
  EXPECT_EQ(splits.val[0].shard->path(), dir.File("x_val_000000.bin"));
  EXPECT_EQ(splits.val[0].shard->field(), "data.val_path");
  EXPECT_EQ(splits.train[0].shard->field(), "data.train_path");
}

TEST(DatasetSplit, FractionErrorsNameValFraction) {
  TempDir dir;
  WriteShard(dir.File("d.bin"), Iota(100), TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("d.bin");
  for (float fraction : {0.01f /* 1 token: no val window */, 0.99f /* no train window */, 1.5f}) {
    config.val_fraction = fraction;
    try {
      OpenDataset(config, 8);
      ADD_FAILURE() << "val_fraction " << fraction << " accepted";
    } catch (const DataError& e) {
      EXPECT_EQ(e.field(), "data.val_fraction") << e.what();
    }
  }
}

TEST(DatasetValidation, SummaryCountsShardsTokensAndWindows) {
  TempDir dir;
  WriteShard(dir.File("t_000000.bin"), Iota(1001), TokenWidth::kUint16);
  WriteShard(dir.File("t_000001.bin"), Iota(501), TokenWidth::kUint16);
  WriteShard(dir.File("v.bin"), Iota(201), TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("t_*.bin");
  config.val_path = dir.File("v.bin");
  const DatasetSummary summary = ValidateDataset(config, 100, 2000);
  EXPECT_EQ(summary.train_shards, 2);
  EXPECT_EQ(summary.val_shards, 1);
  EXPECT_EQ(summary.train_tokens, 1502);
  EXPECT_EQ(summary.val_tokens, 201);
  EXPECT_EQ(summary.train_windows, 10 + 5);
  EXPECT_EQ(summary.val_windows, 2);
  EXPECT_EQ(summary.scanned_tokens, 1502 + 201);
}

TEST(DatasetValidation, OutOfVocabularyTokenIsFoundWithShardAndIndex) {
  TempDir dir;
  std::vector<uint32_t> tokens = Iota(1000);
  for (uint32_t& t : tokens) t %= 256;
  tokens[777] = 300;
  WriteShard(dir.File("bytes.bin"), tokens, TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("bytes.bin");
  config.val_fraction = 0.0f;
  try {
    ValidateDataset(config, 16, 256);
    ADD_FAILURE() << "token 300 accepted with vocab 256";
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "data.train_path");
    for (const std::string& needle : {dir.File("bytes.bin"), std::string("token 300"),
                                      std::string("index 777"), std::string("vocab_size = 256")}) {
      EXPECT_NE(e.message().find(needle), std::string::npos) << e.what();
    }
  }
  // The same data is fine for a larger vocabulary, and the scan is bounded by its budget.
  EXPECT_EQ(ValidateDataset(config, 16, 301).scanned_tokens, 1000);
  EXPECT_EQ(ValidateDataset(config, 16, 256, /*max_scan_tokens=*/700).scanned_tokens, 700);
}

TEST(DatasetValidation, OutOfVocabularyInValShardNamesValPath) {
  TempDir dir;
  WriteShard(dir.File("train.bin"), std::vector<uint32_t>(500, 7), TokenWidth::kUint16);
  WriteShard(dir.File("val.bin"), {1, 2, 3, 4, 5, 6, 7, 8, 9, 1000, 1, 2}, TokenWidth::kUint16);
  DataConfig config;
  config.train_path = dir.File("train.bin");
  config.val_path = dir.File("val.bin");
  try {
    ValidateDataset(config, 4, 256);
    ADD_FAILURE() << "bad val token accepted";
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "data.val_path");
    EXPECT_NE(e.message().find("token 1000"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nsad::data
