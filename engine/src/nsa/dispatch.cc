#include "nsa/dispatch.h"

#include <atomic>
#include <stdexcept>

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "nsa_cuda.h"
#endif

namespace nsad::nsa {
namespace {

std::atomic<int64_t> reference_layers{0};
std::atomic<int64_t> cuda_layers{0};

// Throws unless the CUDA kernels can run here; returns true for the CUDA backend.
bool UseCuda(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kReference:
      return false;
    case AttentionBackend::kCuda:
#ifdef NSAD_HAVE_CUDA_KERNELS
      if (!cuda::Available()) {
        throw std::runtime_error(
            "attention backend 'cuda': the NSA CUDA kernels cannot run here (no CUDA device, "
            "or the kernels were not built for it); use the reference backend");
      }
      return true;
#else
      throw std::runtime_error(
          "attention backend 'cuda': this build has no NSA CUDA kernels (nvcc was not found "
          "at configure time); use the reference backend");
#endif
    case AttentionBackend::kAuto:
      break;
  }
  throw std::runtime_error("attention backend must be resolved (reference or cuda) before use");
}

}  // namespace

// Each op: the CUDA kernel when asked for and available, else the reference. UseCuda()
// throws for kCuda in builds without kernels, so the #else branches never run for it.
CmpAndSelection CompressAndSelect(AttentionBackend backend, const torch::Tensor& q,
                                  const torch::Tensor& k_cmp, const torch::Tensor& v_cmp,
                                  int64_t num_groups, int64_t seq_len, const Geometry& g) {
  const bool use_cuda = UseCuda(backend);
  (use_cuda ? cuda_layers : reference_layers).fetch_add(1, std::memory_order_relaxed);
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (use_cuda) {
    auto cmp = cuda::CompressedAttention(q, k_cmp, v_cmp, g);
    return {cmp.out, cuda::SelectBlocks(cmp.importance, seq_len, g)};
  }
#endif
  auto cmp = CompressedAttentionReference(q, k_cmp, v_cmp, g);
  return {cmp.out, SelectBlocksReference(cmp.probs, num_groups, seq_len, g)};
}

torch::Tensor SelectedAttention(AttentionBackend backend, const torch::Tensor& q,
                                const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& block_idx, const Geometry& g) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend)) return cuda::SelectedAttention(q, k, v, block_idx, g);
#else
  UseCuda(backend);
#endif
  return SelectedAttentionReference(q, k, v, block_idx, g);
}

torch::Tensor SlidingWindowAttention(AttentionBackend backend, const torch::Tensor& q,
                                     const torch::Tensor& k, const torch::Tensor& v,
                                     const Geometry& g) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend)) return cuda::SlidingWindowAttention(q, k, v, g);
#else
  UseCuda(backend);
#endif
  return SlidingWindowAttentionReference(q, k, v, g);
}

int64_t LayersExecuted(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kReference: return reference_layers.load();
    case AttentionBackend::kCuda: return cuda_layers.load();
    case AttentionBackend::kAuto: break;
  }
  return 0;
}

}  // namespace nsad::nsa
