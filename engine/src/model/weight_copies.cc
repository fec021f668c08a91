#include "model/weight_copies.h"

#include <ATen/ops/_foreach_copy.h>

#include <atomic>

namespace nsad {
namespace {

std::atomic<int64_t> joints_served{0};
thread_local const WeightCopies* current_copies = nullptr;

}  // namespace

bool WeightCopies::Fits(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype) const {
  if (!flat_.defined() || flat_.scalar_type() != dtype) return false;
  size_t k = 0;
  for (const auto& group : groups) {
    for (const auto& w : group) {
      if (k >= sources_.size()) return false;
      const auto& source = sources_[k++];
      const auto it = slots_.find(w.unsafeGetTensorImpl());
      if (source.unsafeGetTensorImpl() != w.unsafeGetTensorImpl() || it == slots_.end() ||
          it->second.data != w.data_ptr() || source.sizes() != w.sizes() || w.device() != flat_.device()) {
        return false;
      }
    }
  }
  return k == sources_.size();
}

void WeightCopies::Build(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype) {
  flat_ = torch::Tensor();  // the old buffer goes before the new one is allocated
  sources_.clear();
  copies_.clear();
  versions_.clear();
  slots_.clear();
  int64_t total = 0;
  torch::TensorOptions options;
  for (const auto& group : groups) {
    for (const auto& w : group) {
      TORCH_CHECK(w.dim() == 2, "WeightCopies holds weight matrices, got a tensor of shape ", w.sizes());
      total += w.numel();
      options = w.options();
    }
  }
  if (total == 0) return;
  flat_ = torch::empty({total}, options.dtype(dtype).requires_grad(false));
  int64_t offset = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t m = 0; m < groups[g].size(); ++m) {
      const auto& w = groups[g][m];
      const bool added =
          slots_.emplace(w.unsafeGetTensorImpl(), Slot{g, m, sources_.size(), offset, w.data_ptr()}).second;
      TORCH_CHECK(added, "WeightCopies: a weight appears in two groups");
      sources_.push_back(w);
      copies_.push_back(flat_.narrow(0, offset, w.numel()).view(w.sizes()));
      versions_.push_back(-1);
      offset += w.numel();
    }
  }
}

void WeightCopies::Refresh(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype) {
  if (!Fits(groups, dtype)) Build(groups, dtype);
  RefreshStale();
}

void WeightCopies::RefreshStale() {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> copies, sources;
  std::vector<size_t> stale;
  for (size_t k = 0; k < sources_.size(); ++k) {
    if (sources_[k]._version() == versions_[k]) continue;
    copies.push_back(copies_[k]);
    sources.push_back(sources_[k]);
    stale.push_back(k);
  }
  if (stale.empty()) return;
  at::_foreach_copy_(copies, sources);
  for (const size_t k : stale) versions_[k] = sources_[k]._version();
  weights_copied_ += static_cast<int64_t>(stale.size());
}

const WeightCopies::Slot* WeightCopies::SlotOf(const torch::Tensor& weight) const {
  const auto it = slots_.find(weight.unsafeGetTensorImpl());
  if (it == slots_.end() || it->second.data != weight.data_ptr()) return nullptr;
  return &it->second;
}

torch::Tensor WeightCopies::CopyOf(const torch::Tensor& weight) const {
  const Slot* slot = SlotOf(weight);
  return slot ? copies_[slot->index] : torch::Tensor();
}

void WeightCopies::NoteWrittenWith(const std::vector<torch::Tensor>& weights) {
  for (const auto& w : weights) {
    if (const Slot* slot = SlotOf(w)) versions_[slot->index] = w._version();
  }
}

torch::Tensor WeightCopies::Joint(at::TensorList weights, at::ScalarType dtype) const {
  if (!flat_.defined() || flat_.scalar_type() != dtype || weights.empty()) return {};
  const Slot* first = nullptr;
  int64_t rows = 0, numel = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& w = weights[i];
    const Slot* found = SlotOf(w);
    if (found == nullptr) return {};
    const Slot& slot = *found;
    if (i == 0) first = &slot;
    if (slot.group != first->group || slot.member != first->member + i || w.size(1) != weights[0].size(1)) return {};
    rows += w.size(0);
    numel += w.numel();
  }
  joints_served.fetch_add(1, std::memory_order_relaxed);
  return flat_.narrow(0, first->offset, numel).view({rows, weights[0].size(1)});
}

int64_t WeightCopies::JointsServed() { return joints_served.load(std::memory_order_relaxed); }

UseWeightCopies::UseWeightCopies(const WeightCopies* copies) : previous_(current_copies) { current_copies = copies; }
UseWeightCopies::~UseWeightCopies() { current_copies = previous_; }
const WeightCopies* UseWeightCopies::Current() { return current_copies; }

}  // namespace nsad
