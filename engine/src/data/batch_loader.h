// Batches of training windows in the deterministic order of window_order.h, produced ahead
// of time by a background thread, with an exact, restorable stream position.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "data/dataset.h"
#include "data/window_order.h"

namespace nsad::data {

struct LoaderOptions {
  int batch_size = 8;
  int seq_len = 256;
  uint64_t seed = 0;
  bool shuffle = true;       // false: spans and windows in file order (e.g. for validation)
  int64_t vocab_size = 0;    // > 0: a token >= vocab_size stops the stream with a DataError
  int prefetch_batches = 4;  // ready batches kept queued; 0 = build each batch inside Next()
};

struct Batch {
  int batch_size = 0;
  int seq_len = 0;
  // batch_size rows of seq_len + 1 tokens, row-major. Row i: inputs tokens[i*(T+1) + 0..T-1],
  // targets tokens[i*(T+1) + 1..T] (T = seq_len).
  std::vector<int32_t> tokens;
  uint64_t position = 0;  // stream position of row 0 (windows handed out before this batch)
  uint64_t epoch = 0;     // epoch of row 0
};

// Batch i of the stream holds the windows at stream positions P + i*batch_size ... + batch_size-1,
// P = the position the loader started from (0, or what RestorePosition/Seek set). A batch may
// straddle an epoch boundary. Use from one thread (the trainer's); the producer thread is
// internal. Destruction stops and joins it, also while it waits on a full queue.
//
// Typical use: train = BatchLoader(splits.train, {batch_size, seq_len, seed, shuffle = true,
// vocab_size}); val = BatchLoader(splits.val, {..., shuffle = false}) with val.Seek(0) before
// each evaluation. Batch::tokens are host int32; copy them to pinned memory / the device.
class BatchLoader {
 public:
  // Throws DataError if the spans hold no window, std::invalid_argument for bad options.
  BatchLoader(std::vector<TokenSpan> spans, LoaderOptions options);
  ~BatchLoader();
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  // The next batch; blocks only if the producer is behind. Throws DataError when the batch
  // contains a token outside the vocabulary (field = the config field of its shard, message
  // names shard, index and token). The error is sticky: the position stays before the bad
  // batch and every later Next() throws it again.
  Batch Next();

  // Windows handed out by Next() so far (plus the restored start). Prefetched batches that
  // Next() has not returned yet are not counted, so nothing is skipped on restore.
  uint64_t position() const;
  uint64_t epoch() const { return position() / windows_per_epoch(); }
  uint64_t windows_per_epoch() const { return order_.windows_per_epoch(); }
  const LoaderOptions& options() const { return options_; }

  // "nsad-data-position/1 position=N seed=S seq_len=T shuffle=B windows_per_epoch=W spans=K".
  std::string SavePosition() const;
  // Continues the stream exactly where SavePosition() was taken: the next batches equal those
  // the saved loader would have returned. batch_size may differ (the position counts windows).
  // Throws std::invalid_argument for a malformed string and DataError when the position was
  // taken on different data, seed, seq_len or shuffling (the stream would differ).
  void RestorePosition(const std::string& saved);
  // Continues from stream position `position` (windows), e.g. Seek(0) before each evaluation
  // to score the same validation batches every time. Queued batches are discarded.
  void Seek(uint64_t position);

 private:
  struct Item {
    Batch batch;
    std::exception_ptr error;
  };

  Batch Produce(uint64_t position);  // reads the windows; throws DataError on bad tokens
  void StartProducer();
  void StopProducer();
  void ProducerLoop(uint64_t position);

  const std::vector<TokenSpan> spans_;
  const LoaderOptions options_;
  WindowOrder order_;  // used by the producer thread only (or by Next() without prefetch)

  mutable std::mutex mu_;
  std::condition_variable space_cv_;  // the queue has room, or stop_
  std::condition_variable ready_cv_;  // the queue has an item
  std::deque<Item> queue_;
  bool stop_ = false;
  uint64_t consumed_ = 0;  // = position()
  std::thread producer_;
};

}  // namespace nsad::data
