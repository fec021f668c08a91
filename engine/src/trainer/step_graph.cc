#include "trainer/step_graph.h"

#include <cstdlib>
#include <stdexcept>

#if defined(NSAD_HAVE_CUDA_KERNELS)
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace nsad {

bool StepGraph::CachingAllocatorEnabled() {
  // The variable c10 reads (set = no caching; a value of "0" is treated as set, to be safe).
  return std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING") == nullptr;
}

#if defined(NSAD_HAVE_CUDA_KERNELS)

// Switches to the side stream; on exit the original stream waits for the side stream's
// work, so whatever runs next on it (evaluation, checkpoints) sees the step's results.
struct SideStreamScope {
  explicit SideStreamScope(c10::cuda::CUDAStream side) : side(side), guard(side) {}
  ~SideStreamScope() {
    at::cuda::CUDAEvent done;
    done.record(side);
    done.block(guard.original_stream());
  }
  c10::cuda::CUDAStream side;
  c10::cuda::CUDAStreamGuard guard;
};

struct StepGraph::Impl {
  explicit Impl(const torch::Device& device)
      : stream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index())) {}
  c10::cuda::CUDAStream stream;
  std::unique_ptr<at::cuda::CUDAGraph> graph;
  torch::Tensor output;
};

StepGraph::StepGraph(const torch::Device& device) {
  if (!device.is_cuda()) throw std::runtime_error("CUDA graphs need a CUDA device");
  if (!CachingAllocatorEnabled()) {
    // Without it every allocation is a cudaMalloc, which a stream capture forbids.
    throw std::runtime_error(
        "cuda_graphs needs PyTorch's CUDA caching allocator, but PYTORCH_NO_CUDA_MEMORY_CACHING "
        "disables it");
  }
  impl_ = std::make_unique<Impl>(device);
}

std::shared_ptr<void> StepGraph::UseStream() {
  // The side stream starts after everything already queued on the current one.
  const auto previous = c10::cuda::getCurrentCUDAStream(impl_->stream.device_index());
  at::cuda::CUDAEvent queued;
  queued.record(previous);
  queued.block(impl_->stream);
  return std::make_shared<SideStreamScope>(impl_->stream);
}

void StepGraph::Capture(const std::function<torch::Tensor()>& body) {
  impl_->stream.synchronize();
  // The eager warm-up steps' cached blocks are of no use to the graph's private pool.
  c10::cuda::CUDACachingAllocator::emptyCache();
  impl_->graph = std::make_unique<at::cuda::CUDAGraph>();
  // Thread-local mode: another run's thread allocating or synchronising (the daemon runs
  // several) must not invalidate this capture.
  impl_->graph->capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
  try {
    impl_->output = body();
  } catch (...) {
    try {
      impl_->graph->capture_end();
    } catch (...) {
    }
    impl_->graph.reset();
    throw;
  }
  impl_->graph->capture_end();
}

bool StepGraph::captured() const { return impl_->graph != nullptr; }

torch::Tensor StepGraph::Replay() {
  impl_->graph->replay();
  return impl_->output;
}

#else  // no CUDA in this build

struct StepGraph::Impl {};

StepGraph::StepGraph(const torch::Device&) {
  throw std::runtime_error("CUDA graphs are not available: this build has no CUDA support");
}
std::shared_ptr<void> StepGraph::UseStream() { return nullptr; }
void StepGraph::Capture(const std::function<torch::Tensor()>&) {}
bool StepGraph::captured() const { return false; }
torch::Tensor StepGraph::Replay() { return {}; }

#endif

StepGraph::~StepGraph() = default;

}  // namespace nsad
