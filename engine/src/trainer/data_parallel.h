// Data parallelism across a run's workers, one process per GPU, through LibTorch's c10d NCCL
// process group: what torch.distributed's DDP does for a model, without the Python. The
// weights start from rank 0's; after each step's backward the gradients (and the loss, for
// the report) become their means over the workers, so every worker clips, skips a
// non-finite step or updates exactly as the others do.
#pragma once

#include <torch/torch.h>

#include <memory>
#include <string>
#include <vector>

namespace nsad {

class DataParallel {
 public:
  // True where this build has c10d's NCCL process group.
  static bool Available();

  // Joins the run's process group through the c10d FileStore at `rendezvous`, on the current
  // CUDA device (the worker's); all world_size workers must construct one. Throws
  // std::runtime_error where NCCL is not Available().
  DataParallel(int rank, int world_size, const std::string& rendezvous);
  ~DataParallel();
  DataParallel(const DataParallel&) = delete;
  DataParallel& operator=(const DataParallel&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }

  // Overwrites every tensor with rank 0's values (one collective).
  void Broadcast(const std::vector<torch::Tensor>& tensors);

  // Replaces every tensor with its mean over the workers, in place (one NCCL group of
  // all-reduces). The tensors must be contiguous and share a dtype. Stream-ordered: the
  // host does not wait for the result.
  void Average(const std::vector<torch::Tensor>& tensors);

 private:
  struct Group;
  int rank_;
  int world_size_;
  std::unique_ptr<Group> group_;
};

}  // namespace nsad
