// Shard format (llm.c layout), shard discovery and every broken-shard error.
#include "data/shard.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <functional>

#include "data/data_error.h"
#include "data/dataset.h"
#include "test_util.h"

namespace nsad::data {
namespace {

using testing::Iota;
using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;
using testing::WriteRawShard;

int32_t HeaderInt(const std::string& bytes, int index) {
  int32_t value = 0;
  std::memcpy(&value, bytes.data() + 4 * index, 4);
  return value;
}

TEST(ShardFormat, Uint16RoundTripMatchesLlmcLayout) {
  TempDir dir;
  const std::vector<uint32_t> tokens = {0, 1, 255, 256, 4242, 65535, 7};
  WriteShard(dir.File("a.bin"), tokens, TokenWidth::kUint16);

  // The bytes on disk: 256 int32 header, then little-endian uint16 tokens.
  const std::string bytes = ReadBytes(dir.File("a.bin"));
  ASSERT_EQ(bytes.size(), 1024u + 2 * tokens.size());
  EXPECT_EQ(HeaderInt(bytes, 0), 20240520);
  EXPECT_EQ(HeaderInt(bytes, 1), 1);
  EXPECT_EQ(HeaderInt(bytes, 2), static_cast<int32_t>(tokens.size()));
  for (int i = 3; i < 256; ++i) ASSERT_EQ(HeaderInt(bytes, i), 0) << i;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const auto lo = static_cast<unsigned char>(bytes[1024 + 2 * i]);
    const auto hi = static_cast<unsigned char>(bytes[1024 + 2 * i + 1]);
    EXPECT_EQ(lo | (hi << 8), tokens[i]) << i;
  }

  const auto shard = ShardFile::Open(dir.File("a.bin"), kTrainPathField);
  EXPECT_EQ(shard->width(), TokenWidth::kUint16);
  ASSERT_EQ(shard->num_tokens(), static_cast<int64_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(shard->Token(i), tokens[i]);
  std::vector<int32_t> copy(4);
  shard->CopyTokens(2, 4, copy.data());
  EXPECT_EQ(copy, (std::vector<int32_t>{255, 256, 4242, 65535}));
}

TEST(ShardFormat, Uint32RoundTripForLargeVocabularies) {
  TempDir dir;
  const std::vector<uint32_t> tokens = {0, 65535, 65536, 100000, 151935, 1u << 30};
  EXPECT_EQ(TokenWidthForVocab(65536), TokenWidth::kUint16);
  EXPECT_EQ(TokenWidthForVocab(151936), TokenWidth::kUint32);
  WriteShard(dir.File("big.bin"), tokens, TokenWidth::kUint32);

  const std::string bytes = ReadBytes(dir.File("big.bin"));
  ASSERT_EQ(bytes.size(), 1024u + 4 * tokens.size());
  EXPECT_EQ(HeaderInt(bytes, 1), 2);
  const auto shard = ShardFile::Open(dir.File("big.bin"), kTrainPathField);
  EXPECT_EQ(shard->width(), TokenWidth::kUint32);
  std::vector<int32_t> copy(tokens.size());
  shard->CopyTokens(0, static_cast<int64_t>(tokens.size()), copy.data());
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(static_cast<uint32_t>(copy[i]), tokens[i]);
  EXPECT_EQ(shard->FindTokenOutsideVocab(151936, 0, 6), 5);
  EXPECT_EQ(shard->FindTokenOutsideVocab(65536, 0, 6), 2);
  EXPECT_EQ(shard->FindTokenOutsideVocab(65536, 0, 2), -1);
}

TEST(ShardFormat, WriterRejectsTokensTooWideAndLeavesNoFile) {
  TempDir dir;
  EXPECT_THROW(WriteShard(dir.File("x.bin"), {1, 70000}, TokenWidth::kUint16), std::runtime_error);
  EXPECT_FALSE(std::filesystem::exists(dir.File("x.bin")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("x.bin.tmp")));
}

TEST(ShardDiscovery, DirectoryTakesSortedBinFilesOnly) {
  TempDir dir;
  WriteShard(dir.File("b_000001.bin"), Iota(10), TokenWidth::kUint16);
  WriteShard(dir.File("a_000000.bin"), Iota(10), TokenWidth::kUint16);
  WriteShard(dir.File("b_000000.bin"), Iota(10), TokenWidth::kUint16);
  WriteBytes(dir.File("README.txt"), "not a shard");
  std::filesystem::create_directory(dir.File("nested.bin"));  // a directory, not a shard

  const std::vector<std::string> found = FindShards(dir.path().string(), kTrainPathField);
  EXPECT_EQ(found, (std::vector<std::string>{dir.File("a_000000.bin"), dir.File("b_000000.bin"),
                                             dir.File("b_000001.bin")}));
}

TEST(ShardDiscovery, GlobAndSingleFile) {
  TempDir dir;
  WriteShard(dir.File("web_train_000001.bin"), Iota(10), TokenWidth::kUint16);
  WriteShard(dir.File("web_val_000000.bin"), Iota(10), TokenWidth::kUint16);
  WriteShard(dir.File("web_train_000000.bin"), Iota(10), TokenWidth::kUint16);

  EXPECT_EQ(FindShards(dir.File("web_train_*.bin"), kTrainPathField),
            (std::vector<std::string>{dir.File("web_train_000000.bin"),
                                      dir.File("web_train_000001.bin")}));
  EXPECT_EQ(FindShards(dir.File("web_val_000000.bin"), kValPathField),
            (std::vector<std::string>{dir.File("web_val_000000.bin")}));
}

// Expects OpenDataset on `train_path` to fail with a DataError for data.train_path whose
// message contains every one of `needles`.
void ExpectTrainPathError(const std::string& train_path, std::vector<std::string> needles,
                          int seq_len = 4) {
  DataConfig config;
  config.train_path = train_path;
  try {
    OpenDataset(config, seq_len);
    ADD_FAILURE() << "no error for " << train_path;
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "data.train_path");
    for (const std::string& needle : needles) {
      EXPECT_NE(e.message().find(needle), std::string::npos)
          << "message \"" << e.message() << "\" lacks \"" << needle << "\"";
    }
    EXPECT_EQ(std::string(e.what()), "data.train_path: " + e.message());
  }
}

TEST(ShardErrors, MissingPath) {
  TempDir dir;
  ExpectTrainPathError(dir.File("nope.bin"), {"does not exist", dir.File("nope.bin")});
}

TEST(ShardErrors, NoShardsInDirectoryOrGlob) {
  TempDir dir;
  WriteBytes(dir.File("notes.txt"), "hello");
  ExpectTrainPathError(dir.path().string(), {"no shards found", dir.path().string()});
  ExpectTrainPathError(dir.File("*.bin"), {"no shards found", dir.File("*.bin")});
}

TEST(ShardErrors, EmptyFileAndEmptyShard) {
  TempDir dir;
  WriteBytes(dir.File("zero.bin"), "");
  ExpectTrainPathError(dir.File("zero.bin"), {"empty", dir.File("zero.bin")});
  WriteRawShard(dir.File("none.bin"), kShardMagic, 1, 0, {});
  ExpectTrainPathError(dir.File("none.bin"), {"empty shard", dir.File("none.bin")});
}

TEST(ShardErrors, TruncatedShard) {
  TempDir dir;
  // Header promises 100 uint16 tokens (200 bytes) but only 150 bytes follow.
  WriteRawShard(dir.File("cut.bin"), kShardMagic, 1, 100, std::vector<unsigned char>(150, 1));
  ExpectTrainPathError(dir.File("cut.bin"),
                       {"truncated", "100 tokens", "1224", "1174", dir.File("cut.bin")});
  // Shorter than the header itself.
  WriteBytes(dir.File("stub.bin"), std::string(100, '\0'));
  ExpectTrainPathError(dir.File("stub.bin"), {"truncated", "header", dir.File("stub.bin")});
  // Trailing garbage is just as wrong: the header and the size disagree.
  WriteRawShard(dir.File("long.bin"), kShardMagic, 2, 10, std::vector<unsigned char>(44, 1));
  ExpectTrainPathError(dir.File("long.bin"), {"oversized", dir.File("long.bin")});
}

TEST(ShardErrors, WrongMagicAndUnknownVersion) {
  TempDir dir;
  WriteRawShard(dir.File("magic.bin"), 20240801, 1, 10, std::vector<unsigned char>(20, 1));
  ExpectTrainPathError(dir.File("magic.bin"),
                       {"magic", "20240801", "20240520", dir.File("magic.bin")});
  WriteRawShard(dir.File("v7.bin"), kShardMagic, 7, 10, std::vector<unsigned char>(40, 1));
  ExpectTrainPathError(dir.File("v7.bin"), {"unknown version 7", dir.File("v7.bin")});
}

TEST(ShardErrors, ShardShorterThanOneWindow) {
  TempDir dir;
  WriteShard(dir.File("ok.bin"), Iota(100), TokenWidth::kUint16);
  WriteShard(dir.File("short.bin"), Iota(8), TokenWidth::kUint16);
  ExpectTrainPathError(dir.path().string(), {dir.File("short.bin"), "8 tokens", "seq_len + 1 = 9"},
                       /*seq_len=*/8);
}

TEST(ShardErrors, ValPathErrorsNameValPath) {
  TempDir dir;
  WriteShard(dir.File("train.bin"), Iota(100), TokenWidth::kUint16);
  WriteRawShard(dir.File("val.bin"), 1234, 1, 10, std::vector<unsigned char>(20, 1));
  DataConfig config;
  config.train_path = dir.File("train.bin");
  config.val_path = dir.File("val.bin");
  try {
    OpenDataset(config, 4);
    ADD_FAILURE() << "bad val shard accepted";
  } catch (const DataError& e) {
    EXPECT_EQ(e.field(), "data.val_path");
    EXPECT_NE(e.message().find(dir.File("val.bin")), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nsad::data
