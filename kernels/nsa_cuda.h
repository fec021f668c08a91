// CUDA implementations of the NSA branch ops. Same signatures and semantics as the
// reference in engine/src/nsa/ops.h (read its header comment: it is the contract), and
// differentiable: each op is an autograd function with a CUDA backward. Each op runs on its
// inputs' device whichever device is current, as ATen's ops do (its kernels launch on the
// current device, so the entry takes a device guard; autograd runs the backward there).
// Only compiled when nvcc is present (NSAD_HAVE_CUDA_KERNELS); callers check Available().
#pragma once

#include <torch/torch.h>

#include "nsa/ops.h"
#include "nsa/shared_gradient.h"

namespace nsad::nsa::cuda {

// True when the kernels were compiled for this GPU and a CUDA device is present.
bool Available();

// Unlike the reference, the kernel never writes the [B,T,H,N] probabilities (at 64k tokens
// they would be ~13 GB): it maps them straight onto selection blocks, summed over the
// heads of each GQA group, exactly as SelectBlocksReference does internally.
struct CmpImportanceResult {
  torch::Tensor out;         // [B,T,H,D], differentiable w.r.t. q, k_cmp, v_cmp
  torch::Tensor importance;  // [B,T,G,NumSlcBlocks(T)] float32, detached
};
CmpImportanceResult CompressedAttention(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                        const torch::Tensor& v_cmp, const Geometry& g);
// importance [B,T,G,NS] -> block indices [B,T,G,n] int32, same rules as the reference.
torch::Tensor SelectBlocks(const torch::Tensor& importance, int64_t seq_len, const Geometry& g);
torch::Tensor SelectedAttention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& block_idx,
                                const Geometry& g);
torch::Tensor SlidingWindowAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const Geometry& g);
// {SelectedAttention(q, k_slc, v_slc, block_idx, g), SlidingWindowAttention(q, k_win, v_win, g)}
// as one autograd node for bf16/fp16 (separate calls for fp32): the two branches' dq are
// summed in float32 and rounded once, instead of rounded each and added by autograd.
std::pair<torch::Tensor, torch::Tensor> SelectedAndWindowAttention(const torch::Tensor& q, const torch::Tensor& k_slc,
                                                                   const torch::Tensor& v_slc,
                                                                   const torch::Tensor& block_idx,
                                                                   const torch::Tensor& k_win,
                                                                   const torch::Tensor& v_win, const Geometry& g);

// The three branches mixed by the gates, for bf16/fp16 inputs of one dtype: {out, block_idx}
// with out = MixBranches(gates, o_cmp, o_slc, o_win) (fused_ops.h), o_cmp and block_idx as
// from CompressedAttention + SelectBlocks, o_slc and o_win as from SelectedAndWindowAttention,
// all of them for the query ApplyRopeParts(q, rope_cos, rope_sin) (fused_ops.h): q comes in
// unrotated ([B,T,H,D], unit stride in D; cos, sin [T, D/2] float32), so that its gradient
// leaves the float32 sum of the branches' through RoPE's backward, rounded there once.
// One autograd node: the mixing's backward reads each branch's output, so it also sums
// rowsum(dO * O) for each, which the three attention backwards otherwise each computed in a
// pass of their own (36 us per branch per layer at batch 16, T=2048, D64 12:2 on an H100). A
// branch whose backward runs on our kernels gets its gate folded into its softmax (GateFold,
// fused_launchers.h) and the mix's gradient itself; only cuDNN / FlashAttention-2 branches get
// a written g * dO. The three branches' dq are summed in float32, the compressed one starting
// the sum, and rounded once, into dq when given (q's part of a SharedGradient). Given slots
// whose handoff's producer made k_slc and v_slc (HandoffSlot::Takes: RoPE's split of the kv
// projection), the selected branch's dK and dV go there as its kernel's float32 sums, to be
// rounded by that producer's backward, and come back undefined from this node.
std::pair<torch::Tensor, torch::Tensor> BranchesMixed(const torch::Tensor& q, const torch::Tensor& rope_cos,
                                                      const torch::Tensor& rope_sin, const torch::Tensor& k_cmp,
                                                      const torch::Tensor& v_cmp, const torch::Tensor& k_slc,
                                                      const torch::Tensor& v_slc, const torch::Tensor& k_win,
                                                      const torch::Tensor& v_win, const torch::Tensor& gates,
                                                      const Geometry& g, const GradientPart& dq = {},
                                                      const HandoffSlot& dk_slc_to = {},
                                                      const HandoffSlot& dv_slc_to = {});

}  // namespace nsad::nsa::cuda
