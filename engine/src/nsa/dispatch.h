// The one place that picks an implementation of the NSA ops for a resolved backend:
// kReference -> the LibTorch reference (reference.cc), kCuda -> the CUDA kernels
// (kernels/nsa_cuda.h). Same signatures and semantics as ops.h.
#pragma once

#include "nsa/ops.h"
#include "nsad/config.h"

namespace nsad::nsa {

struct CmpAndSelection {
  torch::Tensor out;        // compressed-branch output [B,T,H,D]
  torch::Tensor block_idx;  // selected blocks [B,T,G,n] int32
};

// Compressed attention followed by block selection. One step because the CUDA kernels
// hand selection per-block importance instead of the [B,T,H,N] probabilities that the
// reference exposes (13 GB at 64k tokens); both paths select the same blocks.
CmpAndSelection CompressAndSelect(AttentionBackend backend, const torch::Tensor& q,
                                  const torch::Tensor& k_cmp, const torch::Tensor& v_cmp,
                                  int64_t num_groups, int64_t seq_len, const Geometry& g);
torch::Tensor SelectedAttention(AttentionBackend backend, const torch::Tensor& q,
                                const torch::Tensor& k, const torch::Tensor& v,
                                const torch::Tensor& block_idx, const Geometry& g);
torch::Tensor SlidingWindowAttention(AttentionBackend backend, const torch::Tensor& q,
                                     const torch::Tensor& k, const torch::Tensor& v,
                                     const Geometry& g);

// How many NSA attention layers each backend has executed in this process: lets tests
// prove that the backend a run names is the one that ran.
int64_t LayersExecuted(AttentionBackend backend);

}  // namespace nsad::nsa
