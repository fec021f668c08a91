#include "data/window_order.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <utility>

namespace nsad::data {

namespace {

// Uniform in [0, m) by rejection, so there is no modulo bias (m > 0).
uint64_t Below(uint64_t m, std::mt19937_64& rng) {
  const uint64_t limit = UINT64_MAX - (UINT64_MAX % m + 1) % m;  // largest multiple of m, minus 1
  uint64_t x = rng();
  while (x > limit) x = rng();
  return x % m;
}

uint32_t Low(uint64_t v) { return static_cast<uint32_t>(v); }
uint32_t High(uint64_t v) { return static_cast<uint32_t>(v >> 32); }

}  // namespace

std::mt19937_64 OrderRng(uint64_t seed, uint64_t epoch, uint64_t stream) {
  std::seed_seq seq{Low(seed), High(seed), Low(epoch), High(epoch), Low(stream), High(stream)};
  return std::mt19937_64(seq);
}

std::vector<uint32_t> Permutation(uint32_t n, std::mt19937_64& rng) {
  std::vector<uint32_t> a(n);
  std::iota(a.begin(), a.end(), 0u);
  for (uint32_t i = n; i > 1; --i) {
    std::swap(a[i - 1], a[Below(i, rng)]);
  }
  return a;
}

WindowOrder::WindowOrder(std::vector<int64_t> windows_per_span, uint64_t seed, bool shuffle)
    : windows_per_span_(std::move(windows_per_span)), seed_(seed), shuffle_(shuffle) {
  for (int64_t n : windows_per_span_) {
    // Shards hold < 2^31 tokens, so a span never has more windows than a uint32 counts.
    if (n < 0 || n > UINT32_MAX) throw std::invalid_argument("WindowOrder: bad window count");
    windows_per_epoch_ += static_cast<uint64_t>(n);
  }
  if (windows_per_span_.size() > UINT32_MAX)
    throw std::invalid_argument("WindowOrder: too many spans");
  if (windows_per_epoch_ == 0) throw std::invalid_argument("WindowOrder: no windows");
}

void WindowOrder::EnterEpoch(uint64_t epoch) {
  const uint32_t num_spans = static_cast<uint32_t>(windows_per_span_.size());
  if (shuffle_) {
    std::mt19937_64 rng = OrderRng(seed_, epoch, 0);
    span_order_ = Permutation(num_spans, rng);
  } else {
    span_order_.resize(num_spans);
    std::iota(span_order_.begin(), span_order_.end(), 0u);
  }
  span_end_.resize(num_spans);
  uint64_t total = 0;
  for (uint32_t i = 0; i < num_spans; ++i) {
    total += static_cast<uint64_t>(windows_per_span_[span_order_[i]]);
    span_end_[i] = total;
  }
  epoch_ = epoch;
  permuted_span_ = SIZE_MAX;
}

WindowOrder::Window WindowOrder::At(uint64_t position) {
  const uint64_t epoch = position / windows_per_epoch_;
  const uint64_t rank = position % windows_per_epoch_;
  if (epoch != epoch_) EnterEpoch(epoch);

  // First span (in visiting order) whose cumulative end lies beyond `rank`; empty spans have
  // the same end as their predecessor and are never chosen.
  const size_t slot =
      std::upper_bound(span_end_.begin(), span_end_.end(), rank) - span_end_.begin();
  const uint64_t first_of_span = slot == 0 ? 0 : span_end_[slot - 1];
  const uint64_t k = rank - first_of_span;

  Window window;
  window.span = span_order_[slot];
  if (!shuffle_) {
    window.index = static_cast<int64_t>(k);
    return window;
  }
  if (permuted_span_ != window.span) {
    std::mt19937_64 rng = OrderRng(seed_, epoch, window.span + 1);
    window_perm_ = Permutation(static_cast<uint32_t>(windows_per_span_[window.span]), rng);
    permuted_span_ = window.span;
  }
  window.index = window_perm_[k];
  return window;
}

}  // namespace nsad::data
