#include "trainer/data_parallel.h"

#include <stdexcept>

#ifdef NSAD_HAVE_NCCL
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace nsad {

#ifdef NSAD_HAVE_NCCL

namespace {

// The broadcast at start goes through one flat buffer: one collective instead of one per
// tensor (the m7c model has 266), once per run, so its copies cost nothing that matters.
torch::Tensor Flatten(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat;
  flat.reserve(tensors.size());
  for (const auto& t : tensors) flat.push_back(t.reshape({-1}));
  return torch::cat(flat);
}

// Into parameters too (the broadcast), whose in-place writes autograd must not record.
void CopyBack(const torch::Tensor& flat, const std::vector<torch::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> views;
  views.reserve(tensors.size());
  int64_t offset = 0;
  for (const auto& t : tensors) {
    views.push_back(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
  torch::_foreach_copy_(tensors, views);
}

}  // namespace

struct DataParallel::Group {
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
};

bool DataParallel::Available() { return true; }

DataParallel::DataParallel(int rank, int world_size, const std::string& rendezvous)
    : rank_(rank), world_size_(world_size), group_(std::make_unique<Group>()) {
  auto store = c10::make_intrusive<c10d::FileStore>(rendezvous, world_size);
  group_->nccl = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, world_size);
}

DataParallel::~DataParallel() {
  try {
    group_->nccl->shutdown();  // what destroy_process_group() does; NCCL warns without it
  } catch (const std::exception&) {
    // A worker that ends because another failed has nothing left to shut down cleanly.
  }
}

void DataParallel::Broadcast(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> flat = {Flatten(tensors)};
  c10d::BroadcastOptions options;
  options.rootRank = 0;
  group_->nccl->broadcast(flat, options)->wait();
  CopyBack(flat[0], tensors);
}

void DataParallel::Average(const std::vector<torch::Tensor>& tensors) {
  // One NCCL group of an all-reduce per tensor, in place. A flat copy (the broadcast's way)
  // would cost a model-sized float32 buffer (500 MB for m7c) and 1 GB of copies per step;
  // on two H100s both ran at the same speed (docs/PERFORMANCE.md), so the memory decides.
  std::vector<torch::Tensor> in_place(tensors.begin(), tensors.end());
  c10d::AllreduceCoalescedOptions options;
  options.reduceOp = c10d::ReduceOp::AVG;
  group_->nccl->allreduce_coalesced(in_place, options)->wait();  // the current stream waits, not the host
}

#else  // no NCCL in this build: PlanRuntime refuses world_size > 1 (caps.nccl is false)

struct DataParallel::Group {};

bool DataParallel::Available() { return false; }

DataParallel::DataParallel(int rank, int world_size, const std::string&)
    : rank_(rank), world_size_(world_size) {
  throw std::runtime_error("this build has no NCCL: world_size must be 1");
}

DataParallel::~DataParallel() = default;
void DataParallel::Broadcast(const std::vector<torch::Tensor>&) {}
void DataParallel::Average(const std::vector<torch::Tensor>&) {}

#endif

}  // namespace nsad
