// 16-bit copies of a model's float32 weight matrices for its GEMMs under autocast, written by
// one multi-tensor copy at the start of each forward.
//
// Why: autocast casts each float32 weight when a GEMM first reads it, one kernel per weight
// (206 per m7c step; 1.1 ms at batch 16 on an H100, most of them a few us for a few MB), and
// the joint GEMMs (q|kv|gate, the MLP's gate|up) first concatenated their float32 weights.
// Here every weight is copied by _foreach_copy_ (a handful of launches) into one buffer laid
// out so that the weights of a joint GEMM lie next to each other: its operand is a view.
//
// The copies are only read through SharedInputLinear (model/shared_input_linear.h) while a
// UseWeightCopies scope is alive on the calling thread; everything else still casts as
// autocast does. The values are the same either way (one round-to-nearest cast of the same
// float32 numbers).
//
// The optimizer can write the copies as it writes the weights (its CUDA kernel, 2 bytes per
// element more than its own pass, where the copy pass read 4 and wrote 2: ~0.27 ms of an m7c
// batch 16 step on an H100). Then the next refresh has nothing to do. What is current is
// tracked by the weights' version counters (every in-place op bumps them): a copy is current
// while its weight's version is the one recorded when the copy was last written (by a refresh,
// or by a writer that says so, NoteWrittenWith), and a refresh copies only the others.
#pragma once

#include <torch/torch.h>

#include <unordered_map>
#include <vector>

namespace nsad {

class WeightCopies {
 public:
  // groups: the weights of each GEMM, in the order its operand stacks their rows. Copies
  // every weight into `dtype`; (re)allocates first when the groups' tensors (their storage,
  // shape or dtype), the device or `dtype` differ from the last call's. A weight must appear
  // in one group only.
  // Only the weights whose copy is not current are copied (none after an optimizer step that
  // wrote them all).
  void Refresh(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype);
  // The same for the groups of the last Refresh, which it does not check again: before
  // replaying a CUDA graph whose captured forward skipped a refresh because every copy was
  // current (it then relies on its own optimizer step to write them), in case something wrote
  // a weight in between (a checkpoint's load). A host loop over the weights' versions.
  void RefreshStale();

  // The copy of one weight (a view into the copies, its shape), or an undefined tensor where
  // this weight has none (never refreshed, or new storage since): what a writer of the weight
  // writes the rounded new values into, then calls NoteWrittenWith.
  torch::Tensor CopyOf(const torch::Tensor& weight) const;
  // Records that these weights' copies now hold their current values (each weight's version
  // as it is now, after the writer's bump). Weights without a copy are ignored.
  void NoteWrittenWith(const std::vector<torch::Tensor>& weights);

  // How many weights refreshes have copied, over this object's life: lets tests see a refresh
  // skip what a writer kept current.
  int64_t weights_copied() const { return weights_copied_; }

  // The copy of [weights[0]; weights[1]; ...] (rows stacked) in `dtype` if these are
  // consecutive members of one group, in that order, of the same width, and were refreshed
  // from these very tensors; else an undefined tensor (the caller casts for itself).
  torch::Tensor Joint(at::TensorList weights, at::ScalarType dtype) const;

  // How many Joint() calls found their copy, process-wide: lets tests prove the copies are
  // read, not silently bypassed.
  static int64_t JointsServed();

 private:
  struct Slot {
    size_t group = 0, member = 0;
    size_t index = 0;            // into sources_, copies_, versions_
    int64_t offset = 0;          // elements into flat_
    const void* data = nullptr;  // the weight's storage when it was copied
  };
  bool Fits(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype) const;
  void Build(const std::vector<std::vector<torch::Tensor>>& groups, at::ScalarType dtype);
  const Slot* SlotOf(const torch::Tensor& weight) const;  // null where weight has no copy

  torch::Tensor flat_;  // every copy, group after group
  std::vector<torch::Tensor> sources_, copies_;
  // Each source's version when its copy was last written; -1: never (versions start at 0).
  std::vector<int64_t> versions_;
  std::unordered_map<const c10::TensorImpl*, Slot> slots_;
  int64_t weights_copied_ = 0;
};

// While alive, SharedInputLinear on this thread reads weights from `copies` where it holds
// them. Scopes nest; the innermost wins. (Autograd's backward threads never see one: a
// recomputation there casts for itself.)
class UseWeightCopies {
 public:
  explicit UseWeightCopies(const WeightCopies* copies);
  ~UseWeightCopies();
  UseWeightCopies(const UseWeightCopies&) = delete;
  UseWeightCopies& operator=(const UseWeightCopies&) = delete;

  // The innermost live scope's copies on this thread, or nullptr.
  static const WeightCopies* Current();

 private:
  const WeightCopies* previous_;
};

}  // namespace nsad
