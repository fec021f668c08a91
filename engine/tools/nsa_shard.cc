// nsa-shard: turns text files into llm.c-format token shards with a byte-level tokenizer
// (token = byte value, vocabulary 256), so any text can be trained on without a tokenizer.
//
//   nsa-shard --out DIR [--prefix NAME] [--shard-tokens N] [--val-tokens N] [--force] FILE...
//
// The files' bytes, concatenated in command-line order, form one token sequence. Its first
// --val-tokens tokens become DIR/NAME_val_000000.bin ... and the rest DIR/NAME_train_000000.bin
// ... (validation first, as llm.c's fineweb.py does). Each split is cut into the fewest shards
// of at most --shard-tokens tokens, of (almost) equal size, so no tail shard is tiny. The
// output depends only on the input bytes and the options.
#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "data/shard.h"

namespace fs = std::filesystem;
using nsad::data::ShardWriter;
using nsad::data::TokenWidth;

namespace {

constexpr int kExitRuntimeError = 1;
constexpr int kExitUsage = 2;

constexpr const char* kUsage =
    "usage: nsa-shard --out DIR [--prefix NAME] [--shard-tokens N] [--val-tokens N] [--force] "
    "FILE...\n"
    "\n"
    "Byte-level tokenizer (token = byte value, vocabulary 256): writes the files' bytes, in\n"
    "command-line order, as llm.c-format token shards (uint16 tokens, magic 20240520).\n"
    "\n"
    "  --out DIR           output directory (created if missing)\n"
    "  --prefix NAME       shard file prefix (default: text)\n"
    "  --shard-tokens N    at most N tokens per shard (default: 100000000)\n"
    "  --val-tokens N      the first N tokens go to NAME_val_*.bin (default: 0 = no val shard)\n"
    "  --force             replace existing NAME_train_*.bin / NAME_val_*.bin shards in DIR\n"
    "\n"
    "Writes DIR/NAME_val_000000.bin ... then DIR/NAME_train_000000.bin ...\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string out_dir;
  std::string prefix = "text";
  int64_t shard_tokens = 100'000'000;
  int64_t val_tokens = 0;
  bool force = false;
  std::vector<std::string> inputs;
};

int64_t ParseCount(const std::string& flag, const std::string& text, int64_t min, int64_t max) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || value < min || value > max) {
    throw UsageError(flag + " needs an integer in [" + std::to_string(min) + ", " +
                     std::to_string(max) + "], got \"" + text + "\"");
  }
  return value;
}

Options ParseArgs(int argc, char** argv) {
  Options o;
  bool options_done = false;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (options_done || arg.empty() || arg[0] != '-') {
      o.inputs.push_back(arg);
      continue;
    }
    if (arg == "--") {
      options_done = true;
      continue;
    }
    if (arg == "--force") {
      o.force = true;
      continue;
    }
    // "--flag value" or "--flag=value"
    std::string value;
    const size_t eq = arg.find('=');
    if (eq != std::string::npos) {
      value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    } else if (arg == "--out" || arg == "--prefix" || arg == "--shard-tokens" ||
               arg == "--val-tokens") {
      if (i + 1 >= argc) throw UsageError(arg + " needs a value");
      value = argv[++i];
    }
    if (arg == "--out") {
      o.out_dir = value;
    } else if (arg == "--prefix") {
      o.prefix = value;
    } else if (arg == "--shard-tokens") {
      o.shard_tokens = ParseCount(arg, value, 1, nsad::data::kMaxShardTokens);
    } else if (arg == "--val-tokens") {
      o.val_tokens = ParseCount(arg, value, 0, INT64_MAX);
    } else {
      throw UsageError("unknown option " + arg);
    }
  }
  if (o.out_dir.empty()) throw UsageError("--out DIR is required");
  if (o.prefix.empty() || o.prefix.find('/') != std::string::npos) {
    throw UsageError("--prefix must be a non-empty file name prefix without '/', got \"" +
                     o.prefix + "\"");
  }
  if (o.inputs.empty()) throw UsageError("no input files");
  return o;
}

struct PlannedShard {
  std::string path;
  int64_t tokens = 0;
};

// Cuts `total` tokens into the fewest shards of at most `max_tokens`, sizes differing by at
// most one (the first total % count shards get the extra token).
void PlanSplit(const Options& o, const char* split, int64_t total,
               std::vector<PlannedShard>& plan) {
  if (total == 0) return;
  const int64_t count = (total + o.shard_tokens - 1) / o.shard_tokens;
  for (int64_t i = 0; i < count; ++i) {
    char name[32];
    std::snprintf(name, sizeof(name), "_%s_%06lld.bin", split, static_cast<long long>(i));
    const int64_t tokens = total / count + (i < total % count ? 1 : 0);
    plan.push_back({(fs::path(o.out_dir) / (o.prefix + name)).string(), tokens});
  }
}

int64_t TotalInputBytes(const std::vector<std::string>& inputs) {
  int64_t total = 0;
  for (const std::string& file : inputs) {
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) {
      throw std::runtime_error("input " + file + " is not a regular file" +
                               (fs::exists(file, ec) ? "" : " (it does not exist)"));
    }
    total += static_cast<int64_t>(fs::file_size(file));
  }
  return total;
}

// NAME_train_000000.bin, NAME_val_000012.bin, or such a file's leftover ".tmp".
bool IsShardOf(const std::string& file_name, const std::string& prefix) {
  if (file_name.rfind(prefix + "_", 0) != 0) return false;
  static const std::regex kSuffix(R"((train|val)_[0-9]{6}\.bin(\.tmp)?)");
  return std::regex_match(file_name.substr(prefix.size() + 1), kSuffix);
}

// Existing shards of this prefix would mix with the new ones (a longer old run leaves extra
// train shards behind), so they are removed with --force and refused otherwise.
void ClearOldShards(const Options& o) {
  std::vector<fs::path> old;
  for (const fs::directory_entry& entry : fs::directory_iterator(o.out_dir)) {
    if (IsShardOf(entry.path().filename().string(), o.prefix)) old.push_back(entry.path());
  }
  if (old.empty()) return;
  if (!o.force) {
    throw UsageError(o.out_dir + " already holds " + std::to_string(old.size()) + " " + o.prefix +
                     "_* shard(s), e.g. " + old.front().string() +
                     "; pass --force to replace them or choose another --prefix");
  }
  for (const fs::path& p : old) fs::remove(p);
}

// Streams the input bytes through the planned shards in order.
class ShardSequence {
 public:
  explicit ShardSequence(const std::vector<PlannedShard>& plan) : plan_(plan) {}

  void Write(const unsigned char* bytes, size_t count) {
    while (count > 0) {
      if (!writer_) Open();
      const int64_t room = plan_[next_ - 1].tokens - writer_->num_tokens();
      const size_t take = static_cast<size_t>(std::min<int64_t>(room, static_cast<int64_t>(count)));
      tokens_.assign(bytes, bytes + take);
      writer_->Append(tokens_.data(), tokens_.size());
      bytes += take;
      count -= take;
      if (writer_->num_tokens() == plan_[next_ - 1].tokens) Close();
    }
  }
  bool complete() const { return next_ == plan_.size() && !writer_; }

 private:
  void Open() {
    if (next_ == plan_.size()) throw std::runtime_error("inputs grew while they were read");
    writer_ = std::make_unique<ShardWriter>(plan_[next_++].path, TokenWidth::kUint16);
  }
  void Close() {
    writer_->Finish();
    std::cout << plan_[next_ - 1].path << ": " << writer_->num_tokens() << " tokens\n";
    writer_.reset();
  }

  const std::vector<PlannedShard>& plan_;
  size_t next_ = 0;
  std::unique_ptr<ShardWriter> writer_;
  std::vector<uint32_t> tokens_;
};

void Run(const Options& o) {
  const int64_t total = TotalInputBytes(o.inputs);
  if (total == 0) throw std::runtime_error("the input files are empty: nothing to shard");
  if (o.val_tokens >= total) {
    throw UsageError("--val-tokens " + std::to_string(o.val_tokens) +
                     " leaves no training tokens: the inputs hold " + std::to_string(total) +
                     " bytes");
  }
  fs::create_directories(o.out_dir);
  ClearOldShards(o);

  std::vector<PlannedShard> plan;
  PlanSplit(o, "val", o.val_tokens, plan);
  PlanSplit(o, "train", total - o.val_tokens, plan);

  ShardSequence shards(plan);
  std::vector<char> buffer(1 << 20);
  for (const std::string& file : o.inputs) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + file + ": " + std::strerror(errno));
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      shards.Write(reinterpret_cast<const unsigned char*>(buffer.data()),
                   static_cast<size_t>(in.gcount()));
    }
    if (in.bad()) throw std::runtime_error("error reading " + file);
  }
  if (!shards.complete()) throw std::runtime_error("inputs shrank while they were read");
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--help") == 0 || std::strcmp(argv[i], "-h") == 0) {
      std::cout << kUsage;
      return 0;
    }
  }
  try {
    Run(ParseArgs(argc, argv));
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "nsa-shard: " << e.what() << "\n\n" << kUsage;
    return kExitUsage;
  } catch (const std::exception& e) {
    std::cerr << "nsa-shard: error: " << e.what() << "\n";
    return kExitRuntimeError;
  }
}
