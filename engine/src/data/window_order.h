// The deterministic order in which a split's training windows are visited.
//
// Windows. A span (a token range of one shard, see dataset.h) of n tokens is cut into
// (n - 1) / seq_len windows of seq_len + 1 tokens; window k starts at token k * seq_len of the
// span. Consecutive windows share one token (the last target of one is the first input of
// the next), so within an epoch every token after a span's first is a target exactly once.
// Windows never cross a span, hence never cross a shard.
//
// Order. Stream position p = 0, 1, 2, ... (never ends) is window r = p mod W of epoch
// e = p / W, where W is the number of windows per epoch. Without shuffling, epoch e visits
// span 0's windows in order, then span 1's, and so on. With shuffling, epoch e visits the
// spans in the order permutation(num_spans, Rng(seed, e, 0)) and, inside span s, its windows
// in the order permutation(windows of s, Rng(seed, e, s + 1)); so an epoch reads one shard
// at a time (page-cache friendly, like llm.c) but in random order at both levels.
//
// Rng(seed, epoch, stream) is std::mt19937_64 seeded with std::seed_seq over the 32-bit
// halves (low first) of seed, epoch and stream. permutation(n, rng) starts from 0..n-1 and
// runs Fisher-Yates from the back: for i = n-1 .. 1, swap a[i] with a[j], j = Below(i + 1),
// where Below(m) draws x = rng() until x < 2^64 - (2^64 mod m) and returns x mod m. All of
// it is specified exactly (unlike std::shuffle / std::uniform_int_distribution), so the
// order is the same with every compiler and standard library.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace nsad::data {

// Fisher-Yates permutation of 0..n-1, exactly as described above.
std::vector<uint32_t> Permutation(uint32_t n, std::mt19937_64& rng);
std::mt19937_64 OrderRng(uint64_t seed, uint64_t epoch, uint64_t stream);

class WindowOrder {
 public:
  struct Window {
    size_t span = 0;    // index into the split's spans
    int64_t index = 0;  // window index inside that span
  };

  // windows_per_span[s] = number of windows of span s (may be 0).
  WindowOrder(std::vector<int64_t> windows_per_span, uint64_t seed, bool shuffle);

  uint64_t windows_per_epoch() const { return windows_per_epoch_; }

  // The window at stream position `position`. Keeps the current epoch's span order and the
  // current span's window permutation, so walking forward costs O(1) per window plus one
  // permutation per span visited. Not thread-safe.
  Window At(uint64_t position);

 private:
  void EnterEpoch(uint64_t epoch);

  std::vector<int64_t> windows_per_span_;
  uint64_t seed_;
  bool shuffle_;
  uint64_t windows_per_epoch_ = 0;

  // Cache for the epoch at hand.
  uint64_t epoch_ = UINT64_MAX;
  std::vector<uint32_t> span_order_;  // spans in visiting order
  std::vector<uint64_t> span_end_;    // span_end_[i] = windows in span_order_[0..i]
  size_t permuted_span_ = SIZE_MAX;   // span whose window permutation is cached
  std::vector<uint32_t> window_perm_;
};

}  // namespace nsad::data
