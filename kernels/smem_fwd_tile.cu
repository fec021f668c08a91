// Host side of the tiled forward's kernel choice (smem_fwd_tile.cuh): mma.sync or warpgroup
// MMAs.
#include <ATen/cuda/CUDAContext.h>

#include <atomic>

#include "kernel_choice.h"
#include "smem_fwd_tile.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

std::atomic<TiledForwardChoice::Mma> tiled_choice{TiledForwardChoice::Mma::kAuto};

}  // namespace

// The warpgroup MMAs exist on sm_90 devices in sm_90a builds only (NSAD_CUDA_ARCHS).
bool WgmmaRunsHere() {
#if defined(NSAD_BUILT_FOR_SM90A)
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  return prop->major == 9 && prop->minor == 0;
#else
  return false;
#endif
}

void SetTiledForwardChoiceForTesting(const TiledForwardChoice& choice) { tiled_choice = choice.mma; }
TiledForwardChoice GetTiledForwardChoice() { return {tiled_choice.load()}; }

namespace smem_fwd {

bool TiledWgmmaRuns(const at::Tensor& q) {
  return q.scalar_type() != at::kFloat && (q.size(3) == 64 || q.size(3) == 128) && WgmmaRunsHere();
}

int TiledWgmmaWarpgroups(const at::Tensor& q) {
  const auto mma = tiled_choice.load();
  if (mma == TiledForwardChoice::Mma::kSync) return 0;
  const int64_t D = q.size(3);
  const bool applies = TiledWgmmaRuns(q);
  TORCH_CHECK(mma == TiledForwardChoice::Mma::kAuto || applies,
              "TiledForwardChoice: the warpgroup-MMA tiled forward takes bf16/fp16 with head_dim 64 or 128 on an "
              "sm_90 device (kernels built for sm_90a)");
  TORCH_CHECK(mma != TiledForwardChoice::Mma::kWgmma || D == 64,
              "TiledForwardChoice: the two-warpgroup tiled forward takes head_dim 64 only, got ", D);
  if (!applies) return 0;
  return mma == TiledForwardChoice::Mma::kWgmma ? 2 : 1;
}

bool TiledWgmmaOverlap(bool walk_default) {
  const auto mma = tiled_choice.load();
  return mma == TiledForwardChoice::Mma::kWgmmaOverlap || (mma == TiledForwardChoice::Mma::kAuto && walk_default);
}

}  // namespace smem_fwd
}  // namespace nsad::nsa::cuda::detail
