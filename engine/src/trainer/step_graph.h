// A whole training step (forward, backward, clipping, AdamW) captured once in a CUDA graph
// and replayed for every later step of the same shape: at batch 1 the m7c NSA step is bound
// by the host's ~25,000 op launches, which a replay turns into one graph launch.
//
// Everything the step touches must keep its address between replays: the input batch is
// copied into a static buffer, the optimizer's moments, step counts and learning rate are
// device tensors allocated once (trainer/optimizer.h), and the gradients and activations
// come from the graph's private memory pool. The body must not read the device from the
// host; its result (here: loss and gradient norm) is read after Replay().
#pragma once

#include <torch/torch.h>

#include <functional>
#include <memory>

namespace nsad {

class StepGraph {
 public:
  // Throws std::runtime_error where CUDA graphs are not available: no CUDA in this build, or
  // the caching allocator turned off (PYTORCH_NO_CUDA_MEMORY_CACHING; capture cannot cudaMalloc).
  explicit StepGraph(const torch::Device& device);
  static bool CachingAllocatorEnabled();
  ~StepGraph();

  // Makes the graph's own stream (not the default one: capture needs a side stream) current
  // on this thread until the returned object is destroyed. Eager steps run there too, so the
  // warm-up steps before the capture initialise the same stream's handles and workspaces.
  std::shared_ptr<void> UseStream();

  // Runs `body` once under capture (its kernels are recorded, not executed); `body` returns
  // the step's output, a device tensor that every Replay() rewrites.
  void Capture(const std::function<torch::Tensor()>& body);
  bool captured() const;

  // Launches the recorded step on the current stream and returns the output tensor.
  torch::Tensor Replay();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace nsad
