// A deliberately naive, per-token loop implementation of the four NSA ops of ops.h.
// Same signatures and semantics as the reference; written to be read, not run: the tests
// use it as an independent second implementation of the contract (it is differentiable
// through ordinary autograd, so gradients are compared too). Never used by the model.
#pragma once

#include "nsa/ops.h"

namespace nsad::nsa::naive {

CmpAttentionResult CompressedAttention(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                       const torch::Tensor& v_cmp, const Geometry& g);
torch::Tensor SelectBlocks(const torch::Tensor& probs, int64_t num_groups, int64_t seq_len,
                           const Geometry& g);
torch::Tensor SelectedAttention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& block_idx,
                                const Geometry& g);
torch::Tensor SlidingWindowAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const Geometry& g);

}  // namespace nsad::nsa::naive
