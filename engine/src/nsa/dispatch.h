// The one place that picks an implementation of the NSA ops for a resolved backend:
// kReference -> the LibTorch reference (reference.cc), kCuda -> the CUDA kernels
// (kernels/nsa_cuda.h). Same signatures and semantics as ops.h.
#pragma once

#include <vector>

#include "nsa/ops.h"
#include "nsa/part_chunks.h"
#include "nsa/rope.h"
#include "nsa/shared_gradient.h"
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
// Both of the above for one q: {selected, window}. On the CUDA kernels one autograd node
// whose backward sums the two branches' dq in float32 and rounds once (nsa_cuda.h).
std::pair<torch::Tensor, torch::Tensor> SelectedAndWindowAttention(AttentionBackend backend, const torch::Tensor& q,
                                                                   const torch::Tensor& k_slc,
                                                                   const torch::Tensor& v_slc,
                                                                   const torch::Tensor& block_idx,
                                                                   const torch::Tensor& k_win,
                                                                   const torch::Tensor& v_win, const Geometry& g);

// The three branches mixed by the gates [B,T,H,3] (cmp, slc, win), for the query q_unrotated
// [B,T,H,D] rotated by q_rope: RotateParts, CompressAndSelect, SelectedAndWindowAttention,
// MixBranches. On the CUDA kernels with bf16/fp16 inputs of one dtype, one autograd node
// (cuda::BranchesMixed in nsa_cuda.h) whose backward hands the attention backwards the row
// sums the mixing's backward already has and rounds the three branches' summed dq once, in
// RoPE's backward, into dq_unrotated when given (q's part of a SharedGradient), and hands the
// selected branch's float32 dK and dV to the slots given where their producer made k_slc and
// v_slc (RotateParts with that handoff); otherwise those four calls, which ignore
// dq_unrotated and the slots.
struct MixedBranches {
  torch::Tensor out;        // [B,T,H,D]
  torch::Tensor block_idx;  // selected blocks [B,T,G,n] int32
};
MixedBranches AttendAndMix(AttentionBackend backend, const torch::Tensor& q_unrotated, const RopeTable& q_rope,
                           const torch::Tensor& k_cmp,
                           const torch::Tensor& v_cmp, const torch::Tensor& k_slc, const torch::Tensor& v_slc,
                           const torch::Tensor& k_win, const torch::Tensor& v_win, const torch::Tensor& gates,
                           int64_t num_groups, const Geometry& g, const GradientPart& dq_unrotated = {},
                           const HandoffSlot& dk_slc_to = {}, const HandoffSlot& dv_slc_to = {});

// The attention module's elementwise steps. With the CUDA backend and CUDA tensors of a
// type the kernels take (bf16, fp16, fp32) they run the fused kernels (kernels/fused_ops.h);
// otherwise -- the reference backend on any device, CPU tensors, double -- the LibTorch
// reference (the oracle).
//
// x [B,T,P,M,D] split into its P parts x[:,:,p], each a contiguous [B,T,M,D], with RoPE
// applied to the parts where rotate[p] (one call for a whole projection: its gradient then
// comes back in one piece on the fused path, written into dx when given: x's part of a
// SharedGradient). With chunks, the parts it names come out as one contiguous tensor in its
// chunk layout (nsa/part_chunks.h: what CompressChunksTogether reads), returned after the P
// parts, whose entries for those parts are undefined. With handoff (one slot per part), the
// fused path is its producer: a consumer may hand a part's gradient over in float32
// (GradientHandoff); elsewhere nothing records it, so no consumer does.
std::vector<torch::Tensor> RotateParts(AttentionBackend backend, const torch::Tensor& x,
                                       const RopeTable& table, const std::vector<bool>& rotate,
                                       const GradientPart& dx = {}, const PartChunks& chunks = {},
                                       const c10::intrusive_ptr<GradientHandoff>& handoff = {});
// gates [B,T,H,3] (cmp, slc, win) -> sum over k of gates[...,k] * branch k, [B,T,H,D].
torch::Tensor MixBranches(AttentionBackend backend, const torch::Tensor& gates,
                          const torch::Tensor& o_cmp, const torch::Tensor& o_slc,
                          const torch::Tensor& o_win);
// The residual add and the RMSNorm after it: (s = x + y, rms_norm(s) * weight). The fused
// path (float32 x, CUDA) returns the norm already in y's dtype -- the next GEMM's input
// dtype under autocast; the reference returns it in float32 and autocast casts it there.
std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(AttentionBackend backend, const torch::Tensor& x,
                                                   const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps);
// The norm before the first block, where nothing is added to the residual x yet: (x,
// rms_norm(x) * weight). The fused path (float32 x, CUDA) writes the norm in the dtype the
// next GEMM computes in (autocast's, else x's) and sums x's two gradients (the residual's and
// the norm's) in its backward kernel; the reference returns x itself and the norm in float32.
std::pair<torch::Tensor, torch::Tensor> RmsNormOfResidual(AttentionBackend backend, const torch::Tensor& x,
                                                          const torch::Tensor& weight, double eps);
// The SwiGLU of the model's MLP: joint [.., 2F] = [gate | up] (one GEMM's output) ->
// silu(gate) * up [.., F].
torch::Tensor SwiGlu(AttentionBackend backend, const torch::Tensor& joint);
// silu(x) of the gate MLP's hidden layer, a column slice of the attention's joint input
// projection: the fused path reads the slice where it lies with 16-byte accesses, and
// writes its gradient into dx when given (x's part of a SharedGradient).
torch::Tensor Silu(AttentionBackend backend, const torch::Tensor& x, const GradientPart& dx = {});
// The gate MLP after its first layer's GEMM: sigmoid(out(silu(hidden + hidden_bias))) for hidden
// [.., K], the first layer's pre-activation without its bias (a column slice of the attention's
// joint projection), hidden_bias that layer's bias [K] (or undefined), and out the Linear K ->
// 3H. The fused path (CUDA backend, hidden in the compute type, bf16 or fp16, and shapes
// cuda::GateHeadTakes takes) is one kernel each way (kernels/gate_head.cu), which also sums the
// hidden bias's gradient: it reads the weight's 16-bit copy where a UseWeightCopies scope holds
// one and writes hidden's gradient into dx when given. Otherwise hidden + hidden_bias, Silu,
// the linear layer (ApplyLinear) and sigmoid (dx used only without a hidden bias).
torch::Tensor GateHead(AttentionBackend backend, const torch::Tensor& hidden, const torch::Tensor& hidden_bias,
                       const torch::nn::Linear& out, const GradientPart& dx = {});
// The training loss: mean cross-entropy of logits [N, V] against int64 targets [N], in
// float32 whatever the logits' dtype (the reference: LibTorch's cross_entropy of the logits
// cast to float32). The fused path never materialises float32 logits; its gradient comes
// back in the logits' dtype. expected_grad: the gradient the caller will back-propagate into
// the loss (1 / grad_accum in the trainer); the fused path then writes the logits' gradient in
// the forward (cuda::CrossEntropy says when), and any other gradient still comes out right.
torch::Tensor CrossEntropyLoss(AttentionBackend backend, const torch::Tensor& logits,
                               const torch::Tensor& targets, double expected_grad = 1.0);
// One layer's gate statistics: gates [B,T,H,3], block_idx [B,T,G,n] (-1 = no block) ->
// float32 [7] = the mean of each branch's gate, their population standard deviations and
// the mean number of selected blocks per (position, group). The fused path is one pass
// (kernels/gate_stats.cu) instead of eight LibTorch ops.
torch::Tensor GateStats(AttentionBackend backend, const torch::Tensor& gates,
                        const torch::Tensor& block_idx);
// The same for every layer of a model: gates[l], block_idx[l] -> float32 [L, 7]. The fused path
// is one launch for all layers; otherwise GateStats per layer, stacked.
torch::Tensor GateStatsOfLayers(AttentionBackend backend, const std::vector<torch::Tensor>& gates,
                                const std::vector<torch::Tensor>& block_idx);
// How many fused calls (RotateParts / MixBranches / AddRmsNorm / RmsNormOfResidual / SwiGlu / Silu /
// GateHead / CrossEntropyLoss / GateStats / GateStatsOfLayers on the kernels) this process
// has run: lets tests prove that the reference backend never takes them.
int64_t FusedCallsExecuted();

// How many NSA attention layers each backend has executed in this process: lets tests
// prove that the backend a run names is the one that ran.
int64_t LayersExecuted(AttentionBackend backend);

}  // namespace nsad::nsa
