// End to end: the built nsa-shard binary turns text into shards that read back byte for byte.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>

#include "data/batch_loader.h"
#include "data/dataset.h"
#include "test_util.h"

namespace nsad::data {
namespace {

using testing::ReadBytes;
using testing::TempDir;
using testing::WriteBytes;

// Runs nsa-shard with `args` (already shell-quoted), output to `log`; returns the exit code.
int RunNsaShard(const std::string& args, const std::string& log) {
  const std::string command =
      std::string("'") + NSA_SHARD_BINARY + "' " + args + " >'" + log + "' 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string Quote(const std::string& s) { return "'" + s + "'"; }

// The exact bytes of an llm.c uint16 shard holding `text` byte-for-byte as tokens.
std::string ExpectedShardBytes(const std::string& text) {
  std::string bytes(1024, '\0');
  const int32_t header[3] = {20240520, 1, static_cast<int32_t>(text.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  for (char c : text) {
    bytes.push_back(c);     // low byte = the byte value
    bytes.push_back('\0');  // high byte of a token < 256
  }
  return bytes;
}

std::string SampleText(size_t size) {
  std::string text;
  for (size_t i = 0; text.size() < size; ++i) {
    text += "Fortune " + std::to_string(i) + ": na\xc3\xafve caf\xc3\xa9 \t\x01\xff\n";
  }
  text.resize(size);
  return text;
}

TEST(NsaShardTool, WritesValThenBalancedTrainShardsByteForByte) {
  TempDir dir;
  const std::string a = SampleText(700);
  const std::string b = "second file\n" + std::string(89, 'z');  // 101 bytes
  WriteBytes(dir.File("a.txt"), a);
  WriteBytes(dir.File("b.txt"), b);
  const std::string out = dir.File("out");
  ASSERT_EQ(
      RunNsaShard("--out " + Quote(out) + " --prefix tiny --shard-tokens 300 --val-tokens 100 " +
                      Quote(dir.File("a.txt")) + " " + Quote(dir.File("b.txt")),
                  dir.File("log")),
      0)
      << ReadBytes(dir.File("log"));

  // 801 bytes: val = the first 100; train = 701 bytes in 3 shards of 234, 234, 233.
  const std::string all = a + b;
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"tiny_val_000000.bin", all.substr(0, 100)},
      {"tiny_train_000000.bin", all.substr(100, 234)},
      {"tiny_train_000001.bin", all.substr(334, 234)},
      {"tiny_train_000002.bin", all.substr(568, 233)},
  };
  size_t files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(out)) {
    (void)entry;
    ++files;
  }
  EXPECT_EQ(files, expected.size());
  for (const auto& [name, text] : expected) {
    const std::string path = (std::filesystem::path(out) / name).string();
    ASSERT_TRUE(std::filesystem::exists(path)) << path;
    EXPECT_TRUE(ReadBytes(path) == ExpectedShardBytes(text)) << name << " differs";
  }

  // And the data layer reads it: byte tokens fit vocab 256, windows are the text.
  DataConfig config;
  config.train_path = out + "/tiny_train_*.bin";
  config.val_path = out + "/tiny_val_*.bin";
  const DatasetSummary summary = ValidateDataset(config, 32, 256);
  EXPECT_EQ(summary.train_tokens, 701);
  EXPECT_EQ(summary.val_tokens, 100);
  EXPECT_EQ(summary.scanned_tokens, 801);
  LoaderOptions options;
  options.batch_size = 2;
  options.seq_len = 32;
  options.shuffle = false;
  options.vocab_size = 256;
  BatchLoader loader(OpenDataset(config, 32).val, options);
  const Batch batch = loader.Next();
  for (int i = 0; i <= 32; ++i) {
    EXPECT_EQ(batch.tokens[i], static_cast<unsigned char>(all[i]));
    EXPECT_EQ(batch.tokens[33 + i], static_cast<unsigned char>(all[32 + i]));
  }
}

TEST(NsaShardTool, OutputIsDeterministicAndNeedsForceToReplace) {
  TempDir dir;
  WriteBytes(dir.File("in.txt"), SampleText(5000));
  const std::string args = " --shard-tokens 1000 --val-tokens 500 " + Quote(dir.File("in.txt"));
  ASSERT_EQ(RunNsaShard("--out " + Quote(dir.File("one")) + args, dir.File("log")), 0);
  ASSERT_EQ(RunNsaShard("--out " + Quote(dir.File("two")) + args, dir.File("log")), 0);
  int compared = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.File("one"))) {
    const std::string twin = dir.File("two/" + entry.path().filename().string());
    EXPECT_TRUE(ReadBytes(entry.path().string()) == ReadBytes(twin)) << twin;
    ++compared;
  }
  EXPECT_EQ(compared, 6);  // 1 val + 5 train shards

  // Existing shards are not silently mixed with new ones...
  EXPECT_EQ(RunNsaShard("--out " + Quote(dir.File("one")) + args, dir.File("log")), 2);
  EXPECT_NE(ReadBytes(dir.File("log")).find("--force"), std::string::npos);
  // ...but --force replaces them, dropping shards the new run does not write.
  ASSERT_EQ(RunNsaShard("--force --out " + Quote(dir.File("one")) + " --shard-tokens 5000 " +
                            Quote(dir.File("in.txt")),
                        dir.File("log")),
            0)
      << ReadBytes(dir.File("log"));
  EXPECT_TRUE(std::filesystem::exists(dir.File("one/text_train_000000.bin")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("one/text_train_000001.bin")));
  EXPECT_FALSE(std::filesystem::exists(dir.File("one/text_val_000000.bin")));
}

TEST(NsaShardTool, UsageAndInputErrorsExitNonZero) {
  TempDir dir;
  WriteBytes(dir.File("in.txt"), "hello world");
  WriteBytes(dir.File("empty.txt"), "");
  const std::string log = dir.File("log");
  const std::string in = Quote(dir.File("in.txt"));
  const std::string out = " --out " + Quote(dir.File("out")) + " ";

  EXPECT_EQ(RunNsaShard("--help", log), 0);
  EXPECT_NE(ReadBytes(log).find("usage: nsa-shard"), std::string::npos);
  EXPECT_EQ(RunNsaShard(in, log), 2);  // no --out
  EXPECT_NE(ReadBytes(log).find("--out DIR is required"), std::string::npos);
  EXPECT_EQ(RunNsaShard(out, log), 2);  // no inputs
  EXPECT_EQ(RunNsaShard(out + "--bogus " + in, log), 2);
  EXPECT_EQ(RunNsaShard(out + "--shard-tokens 0 " + in, log), 2);
  EXPECT_EQ(RunNsaShard(out + "--shard-tokens 12x " + in, log), 2);
  EXPECT_EQ(RunNsaShard(out + "--val-tokens 11 " + in, log), 2);  // nothing left to train on
  EXPECT_NE(ReadBytes(log).find("leaves no training tokens"), std::string::npos);
  EXPECT_EQ(RunNsaShard(out + Quote(dir.File("missing.txt")), log), 1);
  EXPECT_NE(ReadBytes(log).find("does not exist"), std::string::npos);
  EXPECT_EQ(RunNsaShard(out + Quote(dir.File("empty.txt")), log), 1);
  EXPECT_FALSE(std::filesystem::exists(dir.File("out/text_train_000000.bin")));
}

}  // namespace
}  // namespace nsad::data

namespace nsad::data {
namespace {

// scripts/make_default_dataset.sh on the real fortunes package (installed by the setup script).
TEST(DefaultDataset, ScriptBuildsLoadableShardsOnceAndIsIdempotent) {
  if (!std::filesystem::exists("/usr/share/games/fortunes/fortunes")) {
    GTEST_SKIP() << "Debian package fortunes is not installed";
  }
  TempDir dir;
  const std::string out = dir.File("default");
  const std::string command = std::string("'") + NSAD_SOURCE_DIR +
                              "/scripts/make_default_dataset.sh' '" + out + "' '" + NSAD_BUILD_DIR +
                              "' >'" + dir.File("log") + "' 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << ReadBytes(dir.File("log"));

  DataConfig config;
  config.train_path = out + "/fortunes_train_*.bin";
  config.val_path = out + "/fortunes_val_*.bin";
  const DatasetSummary summary = ValidateDataset(config, 256, 256);
  EXPECT_EQ(summary.val_tokens, 131072);
  EXPECT_GT(summary.train_tokens, 2'000'000);
  EXPECT_EQ(summary.scanned_tokens, summary.train_tokens + summary.val_tokens);

  const auto shard = out + "/fortunes_train_000000.bin";
  const auto written = std::filesystem::last_write_time(shard);
  ASSERT_EQ(std::system(command.c_str()), 0) << ReadBytes(dir.File("log"));
  EXPECT_NE(ReadBytes(dir.File("log")).find("up to date"), std::string::npos)
      << ReadBytes(dir.File("log"));
  EXPECT_EQ(std::filesystem::last_write_time(shard), written);
}

}  // namespace
}  // namespace nsad::data
