#include "data/dataset.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "data/data_error.h"

namespace nsad::data {

namespace {

std::vector<TokenSpan> OpenShards(const std::string& path, const char* field, int seq_len) {
  std::vector<TokenSpan> spans;
  for (const std::string& file : FindShards(path, field)) {
    std::shared_ptr<const ShardFile> shard = ShardFile::Open(file, field);
    if (shard->num_tokens() < static_cast<int64_t>(seq_len) + 1) {
      throw DataError(field, "shard " + file + " has " + std::to_string(shard->num_tokens()) +
                                 " tokens, fewer than seq_len + 1 = " +
                                 std::to_string(seq_len + 1) + " (one training window)");
    }
    spans.push_back({shard, 0, shard->num_tokens()});
  }
  return spans;
}

int64_t TotalTokens(const std::vector<TokenSpan>& spans) {
  int64_t total = 0;
  for (const TokenSpan& s : spans) total += s.size();
  return total;
}

int64_t TotalWindows(const std::vector<TokenSpan>& spans, int seq_len) {
  int64_t total = 0;
  for (const TokenSpan& s : spans) total += s.NumWindows(seq_len);
  return total;
}

// Cuts the concatenation of `spans` at token `cut`: [0, cut) -> train, [cut, end) -> val.
void SplitAt(const std::vector<TokenSpan>& spans, int64_t cut, int seq_len, DatasetSplits& out) {
  int64_t offset = 0;  // tokens before the current span
  for (const TokenSpan& s : spans) {
    const int64_t local_cut = std::clamp<int64_t>(cut - offset, 0, s.size());
    const TokenSpan head{s.shard, s.begin, s.begin + local_cut};
    const TokenSpan tail{s.shard, s.begin + local_cut, s.end};
    if (head.NumWindows(seq_len) > 0) out.train.push_back(head);
    if (tail.NumWindows(seq_len) > 0) out.val.push_back(tail);
    offset += s.size();
  }
}

int64_t CountShards(const std::vector<TokenSpan>& spans) {
  std::set<const ShardFile*> shards;
  for (const TokenSpan& s : spans) shards.insert(s.shard.get());
  return static_cast<int64_t>(shards.size());
}

}  // namespace

DatasetSplits OpenDataset(const DataConfig& config, int seq_len) {
  if (seq_len <= 0)
    throw DataError("seq_len", "must be positive (got " + std::to_string(seq_len) + ")");
  DatasetSplits splits;
  std::vector<TokenSpan> train = OpenShards(config.train_path, kTrainPathField, seq_len);
  if (!config.val_path.empty()) {
    splits.train = std::move(train);
    splits.val = OpenShards(config.val_path, kValPathField, seq_len);
    return splits;
  }

  const double fraction = config.val_fraction;
  if (!(fraction >= 0.0 && fraction < 1.0)) {
    throw DataError(kValFractionField, "must be in [0, 1) (got " + std::to_string(fraction) + ")");
  }
  const int64_t total = TotalTokens(train);
  const int64_t held_out = std::llround(static_cast<double>(total) * fraction);
  SplitAt(train, total - held_out, seq_len, splits);
  if (splits.train.empty()) {
    throw DataError(kValFractionField,
                    "holding out " + std::to_string(held_out) + " of " + std::to_string(total) +
                        " tokens for validation leaves no training window of seq_len + 1 = " +
                        std::to_string(seq_len + 1) + " tokens");
  }
  if (fraction > 0.0 && splits.val.empty()) {
    throw DataError(kValFractionField,
                    "holds out " + std::to_string(held_out) + " of " + std::to_string(total) +
                        " tokens, too few for one validation window of seq_len + 1 = " +
                        std::to_string(seq_len + 1) +
                        " tokens; raise data.val_fraction or set data.val_path");
  }
  return splits;
}

std::string OutOfVocabMessage(const ShardFile& shard, int64_t index, int64_t vocab_size) {
  return "shard " + shard.path() + ": token " + std::to_string(shard.Token(index)) +
         " at token index " + std::to_string(index) +
         " is outside the vocabulary (model.vocab_size = " + std::to_string(vocab_size) +
         "): the data was tokenized for a different vocabulary";
}

int64_t CheckVocabulary(const std::vector<TokenSpan>& spans, int64_t vocab_size,
                        int64_t max_tokens) {
  int64_t scanned = 0;
  for (const TokenSpan& s : spans) {
    const int64_t count = std::min(s.size(), max_tokens - scanned);
    if (count <= 0) break;
    const int64_t bad = s.shard->FindTokenOutsideVocab(vocab_size, s.begin, count);
    if (bad >= 0) throw DataError(s.shard->field(), OutOfVocabMessage(*s.shard, bad, vocab_size));
    scanned += count;
  }
  return scanned;
}

DatasetSummary ValidateDataset(const DataConfig& config, int seq_len, int64_t vocab_size,
                               int64_t max_scan_tokens) {
  const DatasetSplits splits = OpenDataset(config, seq_len);
  DatasetSummary summary;
  summary.train_shards = CountShards(splits.train);
  summary.val_shards = CountShards(splits.val);
  summary.train_tokens = TotalTokens(splits.train);
  summary.val_tokens = TotalTokens(splits.val);
  summary.train_windows = TotalWindows(splits.train, seq_len);
  summary.val_windows = TotalWindows(splits.val, seq_len);

  // Most of the budget checks the training data; the validation split gets what the training
  // split leaves, but at least a quarter, so a mis-tokenized val shard is caught too.
  const int64_t val_budget = std::min(summary.val_tokens, max_scan_tokens / 4);
  const int64_t train_scanned =
      CheckVocabulary(splits.train, vocab_size, max_scan_tokens - val_budget);
  summary.scanned_tokens =
      train_scanned + CheckVocabulary(splits.val, vocab_size, max_scan_tokens - train_scanned);
  return summary;
}

}  // namespace nsad::data
