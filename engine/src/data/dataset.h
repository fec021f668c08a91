// Opening the training data named by a DataConfig: shard discovery, header checks, the
// train/validation split, and the cheap up-front validation the daemon runs at StartRun.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/shard.h"
#include "nsad/config.h"

namespace nsad::data {

// Tokens [begin, end) of one shard. A split is a list of spans.
struct TokenSpan {
  std::shared_ptr<const ShardFile> shard;
  int64_t begin = 0;
  int64_t end = 0;

  int64_t size() const { return end - begin; }
  // Windows of seq_len + 1 tokens, one every seq_len tokens (see window_order.h).
  int64_t NumWindows(int seq_len) const { return size() > seq_len ? (size() - 1) / seq_len : 0; }
};

struct DatasetSplits {
  std::vector<TokenSpan> train;
  std::vector<TokenSpan> val;  // empty only when val_path is empty and val_fraction == 0
};

// Finds and opens every shard (headers checked, see ShardFile::Open) and splits the data:
//  - val_path set: train = the shards of train_path, val = the shards of val_path.
//  - otherwise:    the shards of train_path, in order, are one token sequence; its last
//                  round(total * val_fraction) tokens are the validation split, the rest the
//                  training split. The cut may fall inside a shard; a piece too short for one
//                  window (seq_len + 1 tokens) is dropped, so the splits never share a token.
// Throws DataError naming the field: a path matching nothing, a broken shard, a shard shorter
// than seq_len + 1 tokens, val_fraction outside [0, 1), or a split left without one window.
DatasetSplits OpenDataset(const DataConfig& config, int seq_len);

// Scans tokens [span.begin, span.begin + max_tokens) of each span in turn, at most max_tokens
// in all, and throws DataError(shard field, "<shard>: token T at index I is outside the
// vocabulary ...") at the first token >= vocab_size. Returns the number of tokens scanned.
int64_t CheckVocabulary(const std::vector<TokenSpan>& spans, int64_t vocab_size,
                        int64_t max_tokens);

inline constexpr int64_t kDefaultVocabScanTokens = int64_t{64} << 20;

struct DatasetSummary {
  int64_t train_shards = 0;
  int64_t val_shards = 0;  // shards the validation split reads (shared with train when held out)
  int64_t train_tokens = 0;
  int64_t val_tokens = 0;
  int64_t train_windows = 0;
  int64_t val_windows = 0;
  int64_t scanned_tokens = 0;  // tokens checked against the vocabulary
};

// What the daemon calls at StartRun: OpenDataset (every shard header) plus a vocabulary scan
// of at most max_scan_tokens tokens: the first tokens of the training split, then the first
// of the validation split, which gets what training leaves but at least a quarter of the
// budget. Cheap: a linear pass over mapped memory (~0.1 s for 64M cached tokens).
DatasetSummary ValidateDataset(const DataConfig& config, int seq_len, int64_t vocab_size,
                               int64_t max_scan_tokens = kDefaultVocabScanTokens);

// The message for a token outside the vocabulary, shared by the scan and the batch producer.
std::string OutOfVocabMessage(const ShardFile& shard, int64_t index, int64_t vocab_size);

}  // namespace nsad::data
