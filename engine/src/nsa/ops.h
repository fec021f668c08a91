// The NSA branch operations: the contract shared by the plain-LibTorch reference
// (engine/src/nsa/reference.cc, the oracle) and the CUDA kernels (kernels/). Both
// implementations take and return exactly these tensors with exactly these semantics;
// tests compare them element by element.
//
// Layout: batch, time, heads, head_dim ("BTHD", as FlashAttention) for every activation.
//   B batch, T tokens, H query heads, G kv groups (H % G == 0, heads h*G/H share group),
//   D head dim, N = NumCmpBlocks(T) compressed blocks, n = top_n.
//
// Semantics (DeepSeek NSA, arXiv 2502.11089, section 3.3):
//  * Compression block j covers tokens [j*d, j*d + l). A query at position t may attend
//    block j iff j*d + l - 1 <= t (the block lies entirely in its past, t included).
//    A query with no eligible block gets a zero output and zero probabilities (never NaN).
//  * Selection block b covers tokens [b*l', (b+1)*l'). Importance of b for a query is
//      sum over heads h of its GQA group, sum over eligible cmp blocks j of
//      p_cmp[h, j] * |[j*d, j*d+l) ∩ [b*l', (b+1)*l')|
//    (token overlap of the two blocks). Blocks starting after t are never chosen. Block 0
//    and the local blocks (the one holding t and the one before it) are always chosen.
//    The rest of the n slots take the highest importance; ties go to the lower block index.
//    Output indices are sorted ascending, unused slots hold -1.
//  * Selected attention: a query attends the tokens of its selected blocks with key
//    position <= t (causal inside the current block).
//  * Sliding window: a query at t attends keys in (t - w, t].
//  * Softmax scale is 1/sqrt(D) everywhere.
#pragma once

#include <torch/torch.h>

namespace nsad::nsa {

struct Geometry {
  int64_t cmp_block = 32;   // l
  int64_t cmp_stride = 16;  // d
  int64_t slc_block = 64;   // l'
  int64_t top_n = 16;       // n
  int64_t window = 512;     // w
};

inline int64_t NumCmpBlocks(int64_t seq_len, const Geometry& g) {
  return seq_len < g.cmp_block ? 0 : (seq_len - g.cmp_block) / g.cmp_stride + 1;
}
inline int64_t NumSlcBlocks(int64_t seq_len, const Geometry& g) {
  return (seq_len + g.slc_block - 1) / g.slc_block;
}

struct CmpAttentionResult {
  torch::Tensor out;    // [B,T,H,D], differentiable w.r.t. q, k_cmp, v_cmp
  torch::Tensor probs;  // [B,T,H,N] float32, detached: softmax weights for selection
};

// q [B,T,H,D]; k_cmp, v_cmp [B,N,G,D].
CmpAttentionResult CompressedAttentionReference(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                                const torch::Tensor& v_cmp, const Geometry& g);

// probs [B,T,H,N] -> the importance of each selection block [B,T,G,NS] in float64: each
// group's heads summed, mapped onto selection blocks by token overlap (the header's rule).
torch::Tensor ImportanceReference(const torch::Tensor& probs, int64_t num_groups, const Geometry& g);

// probs [B,T,H,N] -> block indices [B,T,G,n] int32 (GQA group shares one selection).
torch::Tensor SelectBlocksReference(const torch::Tensor& probs, int64_t num_groups,
                                    int64_t seq_len, const Geometry& g);

// q [B,T,H,D]; k, v [B,T,G,D]; block_idx [B,T,G,n] int32 -> [B,T,H,D].
torch::Tensor SelectedAttentionReference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& block_idx,
                                         const Geometry& g);

// q [B,T,H,D]; k, v [B,T,G,D] -> [B,T,H,D].
torch::Tensor SlidingWindowAttentionReference(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const Geometry& g);

}  // namespace nsad::nsa
