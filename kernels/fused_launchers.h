// Host-side entry points of the fused elementwise kernels of the attention module
// (kernels/rope.cu, kernels/gate_mix.cu, kernels/gate_stats.cu), the block (kernels/swiglu.cu,
// kernels/add_rms_norm.cu), the loss (kernels/cross_entropy.cu) and the embedding
// (kernels/embedding_rows.cu), called by the autograd functions in fused_ops.cc (AddRowsAt: by the
// engine's model/row_ops.cc). Plain ATen types only, like launchers.h. Inputs are bf16, fp16 or fp32; the arithmetic is
// float32 and every output is rounded once to the input type.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "nsa/part_chunks.h"

namespace nsad::nsa::cuda::detail {

// Parts one RoPE call takes (the module uses 1 for q and the compressed keys, 6 for the
// kv projection).
constexpr int kMaxRopeParts = 8;

// RoPE of x [B,T,P,M,D] (any strides, unit stride in D) by the angles of position t:
// cos, sin [T, D/2] float32. Returns P contiguous tensors [B,T,M,D]: part p = x[:,:,p],
// rotated when bit p of rotate_mask is set, else copied. Parts in `chunks` come out in its
// chunk layout instead: part p is stack[p - first], and the stack [count,B,chunks,M,len,D]
// is returned after the P parts.
std::vector<at::Tensor> RopeForward(const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, uint32_t rotate_mask, const PartChunks& chunks = {});
// The backward: the P part gradients [B,T,M,D], inversely rotated where rotated in the
// forward -> dx [B,T,P,M,D] contiguous, in dx_type (default: the dtype of the first part
// outside the chunk layout). Each part's gradient is of dx's dtype or float32 (a float32 sum,
// rounded once on the way: the query's summed dq, the selected branch's dK/dV). Given dx_out ([B,T,P,M,D] of that
// dtype, any strides with unit stride in D: a slice of a SharedGradient), written there and
// returned. The gradients of parts in `chunks` come in its chunk layout [B,chunks,M,len,D];
// dx at the positions the chunks leave out is zero for them.
at::Tensor RopeBackward(const std::vector<at::Tensor>& grads, const at::Tensor& cos,
                        const at::Tensor& sin, uint32_t rotate_mask,
                        std::optional<at::ScalarType> dx_type = std::nullopt,
                        const at::Tensor& dx_out = {}, const PartChunks& chunks = {});
// The most local memory (bytes per thread) any RoPE kernel instance uses: none is expected.
// Where one spills or indexes an array at run time, its threads go through local memory for
// every row (see PartPointer in rope.cu).
int64_t RopeKernelsLocalBytes();

// Branch a held as the compressed branch's packed query rows (the cuDNN path's layout,
// compressed_packed.cu: [B, N, H*stride, D]) instead of [B,T,H,D]: position t >= first of head h
// is packed row ((b N + (t - first) / stride) H + h) stride + (t - first) % stride; a position
// before first has no row (the branch's output there is zero). BranchesMixed mixes cuDNN's
// output there and writes its gradient there, without unpacking and packing the rows.
struct CmpPackedRows {
  int T = 0, H = 0, N = 0, first = 0, stride = 1;
};

// out = g0 * a + g1 * b + g2 * c with gates [B,T,H,3] and a, b, c [B,T,H,D], all contiguous
// and of one dtype; a in packed rows where a_packed is given.
at::Tensor GateMixForward(const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
                          const at::Tensor& c, const CmpPackedRows* a_packed = nullptr);
// Returns d_gates, d_a, d_b, d_c. With deltas, *deltas becomes float32 [3,B,T,H]: for each
// branch k, rowsum(d_k * k) over head_dim of the rounded d_k -- the attention backward's
// delta for that branch, as RowDot would compute it from d_k, while the row is loaded anyway.
// (g_k times the gate's gradient is the same sum before d_k's rounding; the attention
// backward's dP is computed from the rounded d_k, so its delta must be too: otherwise a row
// with a single key gets dS = P (dP - delta) of rounding size instead of zero.)
//
// With fold, the gate of each branch k whose fold->lse[k] is defined is folded into that
// branch's attention backward instead: the backward takes the mix's own gradient (fold->dout,
// dout contiguous in the outputs' dtype) and fold->folded_lse[k] = lse_k - log2(g_k), so its
// P' = exp2(S - folded_lse) = g_k P, with delta_k = rowsum(dout * k) (the gate's gradient
// before rounding). Then dV = P'^T dout, dS = P' (dout V^T - delta_k): the gradients of
// d_k = g_k dout, without d_k. lse_k: float32 [B,T,H] in log2 units, as our attention kernels
// write and read it (not cuDNN's or FlashAttention's). d_k comes back undefined. Where every
// branch is folded, the kernel writes no [B,T,H,D] tensor at all (three of them otherwise).
struct GateFold {
  at::Tensor lse[3];         // in: the branches' forward lse, undefined where not folded
  at::Tensor folded_lse[3];  // out
  at::Tensor dout;           // out
};
// With a_packed, a is in packed rows (GateMixForward) and so is d_a, whose rows for the slots
// past T (the last row's) are zero, as PackCompressedRows leaves them.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> GateMixBackward(
    const at::Tensor& dout, const at::Tensor& gates, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& c, at::Tensor* deltas = nullptr, GateFold* fold = nullptr,
    const CmpPackedRows* a_packed = nullptr);

// Cross-entropy of logits [N, V] (contiguous) against int64 targets [N]: per-row loss
// (log-sum-exp - logit of the target; 0 where target == ignore_index, NaN where the target
// is outside [0, V)), float32 [N], and per-row softmax statistics (max, log of the sum of
// exp(x - max)), float32 [N, 2].
std::tuple<at::Tensor, at::Tensor> CrossEntropyForward(const at::Tensor& logits,
                                                       const at::Tensor& targets,
                                                       int64_t ignore_index);
// d logits = (softmax - onehot(target)) * grad_scale, zero on ignored rows, in the logits'
// dtype; grad_scale is a float32 device scalar (d loss / d row loss).
at::Tensor CrossEntropyBackward(const at::Tensor& logits, const at::Tensor& targets,
                                const at::Tensor& row_stats, const at::Tensor& grad_scale,
                                int64_t ignore_index);
// The one-pass path for logits that need a gradient, where CrossEntropyOnePassTakes: the
// forward's per-row loss and, for an incoming gradient of expected_grad, the gradient of the
// mean loss ((softmax - onehot) * expected_grad / count, count a float32 CUDA scalar: the rows
// not ignored) from one read of the logits. Returns row_loss, grad.
bool CrossEntropyOnePassTakes(const at::Tensor& logits);
std::tuple<at::Tensor, at::Tensor> CrossEntropyForwardWithGrad(const at::Tensor& logits, const at::Tensor& targets,
                                                               int64_t ignore_index, const at::Tensor& count,
                                                               double expected_grad);
// grad *= grad_output / expected_grad in place (grad_output a float32 CUDA scalar), a kernel
// whose CTAs return at once when the two are equal: no host read, so CUDA graphs capture it.
void CrossEntropyRescaleGrad(at::Tensor& grad, const at::Tensor& grad_output, double expected_grad);

// SwiGLU of the joint projection [.., 2F] = [gate | up] (contiguous): silu(gate) * up,
// [.., F]; the backward returns the joint gradient [.., 2F].
at::Tensor SwiGluForward(const at::Tensor& joint);
at::Tensor SwiGluBackward(const at::Tensor& dout, const at::Tensor& joint);
// The row stride of x viewed as [rows, F] (unit stride in F, leading dims collapsing to one
// stride), or -1 where they do not collapse.
int64_t CollapsedRowStride(const at::Tensor& x);
// silu(x) for x whose rows [.., F] have unit stride in F and one row stride (a column slice
// of a wider tensor), returned contiguous; the backward returns dx contiguous, or writes it
// into dx_out (x's shape and dtype, rows of one stride: a slice of a SharedGradient).
bool SiluRowsTake(const at::Tensor& x);
at::Tensor SiluRowsForward(const at::Tensor& x);
at::Tensor SiluRowsBackward(const at::Tensor& dout, const at::Tensor& x, const at::Tensor& dx_out = {});

// The gate MLP's head (kernels/gate_head.cu): gates = sigmoid(silu(u + c) W^T + b) for u [.., K]
// (bf16 / fp16; rows of one stride, a multiple of 8 elements, 16-byte aligned: a column slice
// of the attention's joint projection), c [K] the hidden layer's bias, or undefined or empty for
// none (float32 arithmetic), W [N, K] (converted to u's dtype: the weight's 16-bit copy), b [N] (float32
// arithmetic). GateHeadTakes(u, N): K a multiple of 32 up to 480, N even and at most 64.
// silu(u + c) is rounded to u's dtype before the product (as the unfused silu's output was);
// u + c, the product, the bias and the sigmoid are float32, the gates rounded once.
bool GateHeadTakes(const at::Tensor& u, int64_t outputs);
at::Tensor GateHeadForward(const at::Tensor& u, const at::Tensor& hidden_bias, const at::Tensor& w16,
                           const at::Tensor& bias);
// From the gates' gradient and the forward's u, c, gates and W: du in u's dtype (written into
// du_out when given, u's shape with rows of one 16-byte-aligned stride: a slice of a
// SharedGradient), dW float32 [N, K], db float32 [N], and dc float32 [K] (the column sums of du
// as rounded; undefined without a c). dz = dg g (1 - g) is rounded to u's dtype once and feeds
// du, dW and db; dW, db and dc are summed in a fixed order (deterministic).
struct GateHeadGrads {
  at::Tensor du, dw, db, dc;
};
GateHeadGrads GateHeadBackward(const at::Tensor& dgates, const at::Tensor& gates, const at::Tensor& u,
                               const at::Tensor& hidden_bias, const at::Tensor& w16, const at::Tensor& du_out = {});

// Residual add + RMSNorm: s = x + y (x float32, s float32), h = s * rsqrt(mean(s^2) + eps)
// * weight (weight float32 [C]) in y's dtype; also returns rstd [rows] float32. Channels up
// to kAddRmsNormMaxChannels. y undefined: the norm of x alone, h in h_type; s is x, not
// written, and comes back undefined.
constexpr int64_t kAddRmsNormMaxChannels = 3072;
std::tuple<at::Tensor, at::Tensor, at::Tensor> AddRmsNormForward(const at::Tensor& x,
                                                                 const at::Tensor& y,
                                                                 const at::Tensor& weight,
                                                                 double eps, at::ScalarType h_type = at::kFloat);
// Gradients from ds_in (w.r.t. s; undefined: zeros, read from nowhere) and dh: returns
// (dx float32, dy in dh's dtype -- the same values -- and dweight float32 [C]). want_dy
// false (the norm of x alone): dy is not written and comes back undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor> AddRmsNormBackward(
    const at::Tensor& ds_in, const at::Tensor& dh, const at::Tensor& s, const at::Tensor& rstd,
    const at::Tensor& weight, bool want_dy = true);

// dst[index[r]] += rows[r] for every row r (kernels/embedding_rows.cu): the token embedding's
// backward. dst float32 [V, D], rows float32 [N, D] (rows 16-byte aligned, D a multiple of 4:
// AddRowsAtTakes), index int64 [N]; an index outside [0, V) adds nothing. Float atomics: the
// order of a row's additions, and so its last bits, vary from run to run.
bool AddRowsAtTakes(const at::Tensor& dst, const at::Tensor& index, const at::Tensor& rows);
void AddRowsAt(at::Tensor& dst, const at::Tensor& index, const at::Tensor& rows);

// Gate statistics of one layer (kernels/gate_stats.cu): gates [B,T,H,3] (bf16, fp16 or fp32)
// and block_idx [B,T,G,n] (int32 or int64, -1 = no block) -> float32 [7]: the mean of each
// branch's gate, their population standard deviations, and the mean count of entries >= 0
// per (b, t, group).
at::Tensor GateStats(const at::Tensor& gates, const at::Tensor& block_idx);
// The same for every layer of a model at once: one gates and one block_idx per layer (each
// layer's own shape; one gates dtype and one index dtype for all) -> float32 [L, 7], one launch
// per 16 layers instead of a memset and a launch per layer.
bool GateStatsOfLayersTake(const std::vector<at::Tensor>& gates, const std::vector<at::Tensor>& block_idx);
at::Tensor GateStatsOfLayers(const std::vector<at::Tensor>& gates, const std::vector<at::Tensor>& block_idx);

}  // namespace nsad::nsa::cuda::detail
