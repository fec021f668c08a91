#include "data/batch_loader.h"

#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "data/data_error.h"

namespace nsad::data {

namespace {

constexpr const char* kPositionTag = "nsad-data-position/1";

std::vector<int64_t> WindowsPerSpan(const std::vector<TokenSpan>& spans, int seq_len) {
  std::vector<int64_t> counts;
  counts.reserve(spans.size());
  for (const TokenSpan& s : spans) counts.push_back(s.NumWindows(seq_len));
  return counts;
}

const LoaderOptions& Checked(const LoaderOptions& o) {
  if (o.batch_size <= 0) throw std::invalid_argument("LoaderOptions: batch_size must be positive");
  if (o.seq_len <= 0) throw std::invalid_argument("LoaderOptions: seq_len must be positive");
  if (o.prefetch_batches < 0)
    throw std::invalid_argument("LoaderOptions: prefetch_batches must be >= 0");
  return o;
}

// The order needs at least one window; say which data came up short.
std::vector<int64_t> CheckedWindows(const std::vector<TokenSpan>& spans, int seq_len) {
  std::vector<int64_t> counts = WindowsPerSpan(spans, seq_len);
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  if (total == 0) {
    const std::string field = spans.empty() ? kTrainPathField : spans.front().shard->field();
    throw DataError(field, "no window of seq_len + 1 = " + std::to_string(seq_len + 1) +
                               " tokens in " + std::to_string(spans.size()) + " span(s)");
  }
  return counts;
}

}  // namespace

// Members initialise in declaration order, so options_ is checked before order_ uses it.
BatchLoader::BatchLoader(std::vector<TokenSpan> spans, LoaderOptions options)
    : spans_(std::move(spans)),
      options_(Checked(options)),
      order_(CheckedWindows(spans_, options_.seq_len), options_.seed, options_.shuffle) {
  StartProducer();
}

BatchLoader::~BatchLoader() { StopProducer(); }

Batch BatchLoader::Produce(uint64_t position) {
  const int64_t row_len = int64_t{options_.seq_len} + 1;
  Batch batch;
  batch.batch_size = options_.batch_size;
  batch.seq_len = options_.seq_len;
  batch.position = position;
  batch.epoch = position / order_.windows_per_epoch();
  batch.tokens.resize(static_cast<size_t>(options_.batch_size * row_len));
  for (int row = 0; row < options_.batch_size; ++row) {
    const WindowOrder::Window w = order_.At(position + static_cast<uint64_t>(row));
    const TokenSpan& span = spans_[w.span];
    const int64_t start = span.begin + w.index * options_.seq_len;
    if (options_.vocab_size > 0) {
      const int64_t bad = span.shard->FindTokenOutsideVocab(options_.vocab_size, start, row_len);
      if (bad >= 0) {
        throw DataError(span.shard->field(),
                        OutOfVocabMessage(*span.shard, bad, options_.vocab_size));
      }
    }
    span.shard->CopyTokens(start, row_len, batch.tokens.data() + row * row_len);
  }
  return batch;
}

// ---------------------------------------------------------------------------------------
// Prefetching. The producer owns its own cursor; the consumer's position (consumed_) moves
// only when Next() hands a batch out, so queued batches are never lost: RestorePosition()
// and SavePosition() work from consumed_, and a restore simply restarts the producer there.

void BatchLoader::StartProducer() {
  if (options_.prefetch_batches == 0) return;
  stop_ = false;
  producer_ = std::thread(&BatchLoader::ProducerLoop, this, consumed_);
}

void BatchLoader::StopProducer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  space_cv_.notify_all();
  if (producer_.joinable()) producer_.join();
  std::lock_guard<std::mutex> lock(mu_);
  queue_.clear();
}

void BatchLoader::ProducerLoop(uint64_t position) {
  const size_t capacity = static_cast<size_t>(options_.prefetch_batches);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      space_cv_.wait(lock, [&] { return stop_ || queue_.size() < capacity; });
      if (stop_) return;
    }
    Item item;
    try {
      item.batch = Produce(position);
      position += static_cast<uint64_t>(options_.batch_size);
    } catch (...) {
      item.error = std::current_exception();
    }
    const bool failed = item.error != nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      queue_.push_back(std::move(item));
    }
    ready_cv_.notify_one();
    if (failed) return;  // the error stays at the head of the queue (sticky)
  }
}

Batch BatchLoader::Next() {
  if (options_.prefetch_batches == 0) {
    Batch batch = Produce(consumed_);
    std::lock_guard<std::mutex> lock(mu_);
    consumed_ += static_cast<uint64_t>(options_.batch_size);
    return batch;
  }
  std::unique_lock<std::mutex> lock(mu_);
  ready_cv_.wait(lock, [&] { return !queue_.empty(); });
  if (queue_.front().error) std::rethrow_exception(queue_.front().error);
  Batch batch = std::move(queue_.front().batch);
  queue_.pop_front();
  consumed_ = batch.position + static_cast<uint64_t>(options_.batch_size);
  lock.unlock();
  space_cv_.notify_one();
  return batch;
}

uint64_t BatchLoader::position() const {
  std::lock_guard<std::mutex> lock(mu_);
  return consumed_;
}

// ---------------------------------------------------------------------------------------
// Position strings

std::string BatchLoader::SavePosition() const {
  std::ostringstream out;
  out << kPositionTag << " position=" << position() << " seed=" << options_.seed
      << " seq_len=" << options_.seq_len << " shuffle=" << (options_.shuffle ? 1 : 0)
      << " windows_per_epoch=" << order_.windows_per_epoch() << " spans=" << spans_.size();
  return out.str();
}

void BatchLoader::RestorePosition(const std::string& saved) {
  std::istringstream in(saved);
  std::string tag;
  in >> tag;
  if (tag != kPositionTag) {
    throw std::invalid_argument("not a data position (expected \"" + std::string(kPositionTag) +
                                " ...\"): \"" + saved + "\"");
  }
  std::map<std::string, uint64_t> values;
  for (std::string word; in >> word;) {
    const size_t eq = word.find('=');
    std::istringstream number(eq == std::string::npos ? "" : word.substr(eq + 1));
    uint64_t value = 0;
    if (!(number >> value) || !number.eof()) {
      throw std::invalid_argument("malformed data position entry \"" + word + "\" in \"" + saved +
                                  "\"");
    }
    values[word.substr(0, eq)] = value;
  }
  auto get = [&](const char* key) {
    const auto it = values.find(key);
    if (it == values.end()) {
      throw std::invalid_argument(std::string("data position lacks ") + key + ": \"" + saved +
                                  "\"");
    }
    return it->second;
  };
  const std::string data_field = spans_.front().shard->field();
  auto require = [&](const char* key, uint64_t expected, const std::string& field) {
    const uint64_t got = get(key);
    if (got != expected) {
      throw DataError(field, std::string("cannot resume the data stream: the saved position has ") +
                                 key + "=" + std::to_string(got) + " but this run has " +
                                 std::to_string(expected) + ", so the batches would differ");
    }
  };
  require("seed", options_.seed, "seed");
  require("seq_len", static_cast<uint64_t>(options_.seq_len), "seq_len");
  require("shuffle", options_.shuffle ? 1 : 0, data_field);
  require("windows_per_epoch", order_.windows_per_epoch(), data_field);
  require("spans", spans_.size(), data_field);
  Seek(get("position"));
}

void BatchLoader::Seek(uint64_t position) {
  StopProducer();
  {
    std::lock_guard<std::mutex> lock(mu_);
    consumed_ = position;
  }
  StartProducer();
}

}  // namespace nsad::data
