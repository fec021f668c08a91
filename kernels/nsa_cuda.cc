// The NSA CUDA ops as autograd functions (contract: nsa_cuda.h / nsa/ops.h).
//
// Selected and compressed attention run the custom kernels of this folder; from 16k tokens the
// compressed branch's attention runs on cuDNN over packed query rows (CompressedForwardToSave), its
// importance pass still on our kernel. Sliding-window attention runs our tiled forward and
// warpgroup-MMA backward where they apply (window_attention.cu), else PyTorch's own
// FlashAttention-2 kernels (at::_flash_attention_forward / _backward with window_size_left =
// w - 1, window_size_right = 0), which take GQA natively too (K/V keep G heads). fp32 inputs
// (tests, debugging) take a masked SDPA path.
#include "nsa_cuda.h"

#include <ATen/cuda/CUDAContext.h>
#include <ATen/record_function.h>
#include <ATen/DeviceGuard.h>
#include <torch/autograd.h>

#include <cmath>
#include <limits>
#include <tuple>

#include "fused_launchers.h"
#include "launchers.h"

namespace nsad::nsa::cuda {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::tensor_list;
using detail::Geo;

Geo ToGeo(const Geometry& g) {
  TORCH_CHECK(g.cmp_block > 0 && g.cmp_stride > 0 && g.slc_block > 0 && g.window > 0,
              "geometry sizes must be positive");
  return {static_cast<int>(g.cmp_block), static_cast<int>(g.cmp_stride),
          static_cast<int>(g.slc_block), static_cast<int>(g.top_n), static_cast<int>(g.window)};
}

void SaveGeometry(AutogradContext* ctx, const Geometry& g) {
  ctx->saved_data["cmp_block"] = g.cmp_block;
  ctx->saved_data["cmp_stride"] = g.cmp_stride;
  ctx->saved_data["slc_block"] = g.slc_block;
  ctx->saved_data["top_n"] = g.top_n;
  ctx->saved_data["window"] = g.window;
}
Geometry LoadGeometry(AutogradContext* ctx) {
  Geometry g;
  g.cmp_block = ctx->saved_data["cmp_block"].toInt();
  g.cmp_stride = ctx->saved_data["cmp_stride"].toInt();
  g.slc_block = ctx->saved_data["slc_block"].toInt();
  g.top_n = ctx->saved_data["top_n"].toInt();
  g.window = ctx->saved_data["window"].toInt();
  return g;
}

struct SelectedAttentionFn : torch::autograd::Function<SelectedAttentionFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, const torch::Tensor& block_idx,
                               const Geometry& g) {
    RECORD_FUNCTION("nsa::selected_forward", std::vector<c10::IValue>());
    auto [out, lse] = detail::SelectedForward(q, k, v, block_idx, ToGeo(g));
    ctx->save_for_backward({q, k, v, out, lse, block_idx});
    SaveGeometry(ctx, g);
    return out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::selected_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] =
        detail::SelectedBackward(grads[0], s[0], s[1], s[2], s[3], s[4], s[5], ToGeo(LoadGeometry(ctx)));
    return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
  }
};

// The compressed branch's forward as it is saved, on our kernels or on cuDNN (long sequences;
// CompressedKernelChoice, kernel_choice.h): cuDNN runs causal attention of the packed query
// rows over the compressed blocks (compressed_packed.cu says why that is the branch), then our
// importance pass reads its log-sum-exp. cuDNN's backward is given the forward's packed rows,
// output, log-sum-exp and RNG state (no dropout: empty). CompressedAttentionFn and
// BranchesMixedFn share the two halves below.
struct CompressedSaved {
  torch::Tensor out, importance;  // [B,T,H,D]; [B,T,G,NS] float32, detached
  torch::Tensor lse;              // ours: [B,T,H] (log2 units); cuDNN: the packed rows'
  torch::Tensor q_rows, out_rows, seed, offset;  // cuDNN only
};
// 1/sqrt(head_dim): the softmax scale every branch's attention takes.
double SoftmaxScale(const torch::Tensor& q) { return 1.0 / std::sqrt(static_cast<double>(q.size(3))); }

// selection_only: the importance goes to SelectBlocksLaunch alone (CompressedImportance).
// unpack_out = false (cuDNN only): out stays undefined, the output being read where cuDNN wrote
// it, in packed rows (PackedOut).
CompressedSaved CompressedForwardToSave(const torch::Tensor& q, const torch::Tensor& k_cmp, const torch::Tensor& v_cmp,
                                        const Geo& geo, bool dense, bool selection_only = false,
                                        bool unpack_out = true) {
  CompressedSaved c;
  if (!dense) {
    std::tie(c.out, c.lse, c.importance) = detail::CompressedForward(q, k_cmp, v_cmp, geo);
    return c;
  }
  const int64_t T = q.size(1);
  c.q_rows = detail::PackCompressedRows(q, geo);
  torch::Tensor lse_rows;
  std::tie(c.out_rows, lse_rows, std::ignore, std::ignore, std::ignore, std::ignore, c.seed, c.offset, std::ignore) =
      at::_scaled_dot_product_cudnn_attention(
          c.q_rows.transpose(1, 2), k_cmp.transpose(1, 2), v_cmp.transpose(1, 2), /*attn_bias=*/std::nullopt,
          /*compute_log_sumexp=*/true, /*dropout_p=*/0.0, /*is_causal=*/true, /*return_debug_mask=*/false,
          SoftmaxScale(q));
  if (unpack_out) c.out = detail::UnpackCompressedRows(c.out_rows.transpose(1, 2).contiguous(), T, geo);
  c.importance = detail::CompressedImportance(q, k_cmp, detail::CompressedLseFromPacked(lse_rows, T, geo), geo,
                                              selection_only);
  c.lse = lse_rows;
  return c;
}

// cuDNN's compressed output as packed rows [B, N, H*d, D] (its memory order) and how a [B,T,H]
// row finds its packed row there (the gate mix reads and writes the branch there).
torch::Tensor PackedOut(const torch::Tensor& out_rows) { return out_rows.transpose(1, 2).contiguous(); }
detail::CmpPackedRows PackedRowsOf(const torch::Tensor& q, const torch::Tensor& k_cmp, const Geo& geo) {
  return {static_cast<int>(q.size(1)), static_cast<int>(q.size(2)), static_cast<int>(k_cmp.size(1)),
          geo.cmp_block - 1, geo.cmp_stride};
}

// dq, dk, dv of the compressed branch; with dq_float, dq is written there in float32 (the start
// of a sum) and comes back undefined. delta: as in SelectedBackward (cuDNN computes its own).
// dout_packed (cuDNN only): dout comes in packed rows already (GateMixBackward's packed d_a).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> CompressedGradients(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k_cmp, const torch::Tensor& v_cmp,
    const CompressedSaved& c, const Geo& geo, bool dense, torch::Tensor* dq_float, const torch::Tensor& delta,
    bool dout_packed = false) {
  if (!dense) return detail::CompressedBackward(dout, q, k_cmp, v_cmp, c.out, c.lse, geo, dq_float, delta);
  const int64_t N = k_cmp.size(1), T = q.size(1);  // N: compressed blocks = rows
  // Same layout as the saved output ([B,N,H*d,D] in memory), as cuDNN's backward expects.
  const auto dout_rows = dout_packed ? dout.contiguous() : detail::PackCompressedRows(dout.contiguous(), geo);
  auto [dq_rows, dk, dv] = at::_scaled_dot_product_cudnn_attention_backward(
      dout_rows.transpose(1, 2), c.q_rows.transpose(1, 2), k_cmp.transpose(1, 2), v_cmp.transpose(1, 2), c.out_rows,
      c.lse, c.seed, c.offset, /*attn_bias=*/torch::Tensor(), /*cum_seq_q=*/torch::Tensor(),
      /*cum_seq_k=*/torch::Tensor(), N, N, /*dropout_p=*/0.0, /*is_causal=*/true, SoftmaxScale(q));
  if (dq_float) {  // unpacked straight into the float32 sum: no bf16 dq in between
    detail::UnpackCompressedRowsToFloat(dq_rows.transpose(1, 2).contiguous(), *dq_float, geo);
    return {torch::Tensor(), dk.transpose(1, 2), dv.transpose(1, 2)};
  }
  auto dq = detail::UnpackCompressedRows(dq_rows.transpose(1, 2).contiguous(), T, geo);
  return {dq, dk.transpose(1, 2), dv.transpose(1, 2)};
}

// Compressed attention and its importance; the importance is a detached by-product.
struct CompressedAttentionFn : torch::autograd::Function<CompressedAttentionFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k_cmp,
                             const torch::Tensor& v_cmp, const Geometry& g, bool dense) {
    RECORD_FUNCTION("nsa::compressed_forward", std::vector<c10::IValue>());
    const auto c = CompressedForwardToSave(q, k_cmp, v_cmp, ToGeo(g), dense);
    ctx->save_for_backward({q, k_cmp, v_cmp, c.out, c.lse, c.q_rows, c.out_rows, c.seed, c.offset});
    ctx->saved_data["dense"] = dense;
    ctx->mark_non_differentiable({c.importance});
    // The importance never gets a gradient; materialised, it would be a zero fill of the whole
    // [B,T,G,NS] float32 tensor in every backward (0.16 ms at 64k D64 12:2 on an H100). The
    // backward takes an undefined output gradient.
    ctx->set_materialize_grads(false);
    SaveGeometry(ctx, g);
    return {c.out, c.importance};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::compressed_backward", std::vector<c10::IValue>());
    // No gradient for the output (only the importance was used): none for the inputs either,
    // rather than a whole backward over zeros.
    if (!grads[0].defined()) return {torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto s = ctx->get_saved_variables();
    const CompressedSaved c{s[3], torch::Tensor(), s[4], s[5], s[6], s[7], s[8]};
    auto [dq, dk, dv] = CompressedGradients(grads[0], s[0], s[1], s[2], c, ToGeo(LoadGeometry(ctx)),
                                            ctx->saved_data["dense"].toBool(), nullptr, torch::Tensor());
    return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
  }
};

// A causal window of w keys: window_size_left = w - 1 keeps keys (t - w, t], exactly the
// contract's window. Forward: the tiled kernel (window_attention.cu) where it applies, else
// FlashAttention-2's. Backward: the warpgroup-MMA kernel (WindowBackward) where it applies,
// given the forward's output and its log-sum-exp as the tiled forward writes it ([B,T,H], log2
// units); else FlashAttention-2's, given them in FlashAttention's layout ([B,H,T], natural log)
// and, as its own forward returns them without dropout, empty RNG tensors. The saved lse is
// in the layout the backward reads, so only a forward and backward of different kinds convert.
// SlidingWindowFn and SelectedAndWindowFn share the two halves below.

// The window's forward as it is saved: out, lse (in the layout the backward named by
// wgmma_backward reads), and FlashAttention-2's RNG state and its unused partner.
struct WindowSaved {
  torch::Tensor out, lse, rng_state, unused;
};
WindowSaved WindowForwardToSave(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                int64_t window, bool tiled_forward, bool wgmma_backward) {
  const int64_t T = q.size(1);
  const double scale = SoftmaxScale(q);
  WindowSaved w;
  if (tiled_forward) {
    std::tie(w.out, w.lse) = detail::WindowForward(q, k, v, window);
    if (!wgmma_backward) w.lse = (w.lse * static_cast<float>(M_LN2)).transpose(1, 2).contiguous();
    w.rng_state = torch::empty({}, torch::kLong);
    w.unused = torch::empty({}, torch::kLong);
  } else {
    std::tie(w.out, w.lse, w.rng_state, w.unused, std::ignore) = at::_flash_attention_forward(
        q, k, v, std::nullopt, std::nullopt, T, T, /*dropout_p=*/0.0, /*is_causal=*/true,
        /*return_debug_mask=*/false, scale, window - 1, /*window_size_right=*/0);
    if (wgmma_backward) w.lse = (w.lse * static_cast<float>(M_LOG2E)).transpose(1, 2).contiguous();
  }
  return w;
}

// dq, dk, dv of the window; with dq_sum, dq is added into it (float32) and comes back undefined.
// delta as in SelectedBackward (FlashAttention-2 computes its own).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> WindowGradients(
    const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const WindowSaved& w, int64_t window, bool wgmma_backward, torch::Tensor* dq_sum,
    const torch::Tensor& delta = {}) {
  if (wgmma_backward) return detail::WindowBackward(dout, q, k, v, w.out, w.lse, window, dq_sum, delta);
  const int64_t T = q.size(1);
  const double scale = SoftmaxScale(q);
  auto [dq, dk, dv] = at::_flash_attention_backward(
      dout.contiguous(), q, k, v, w.out, w.lse, torch::Tensor(), torch::Tensor(), T, T, /*dropout_p=*/0.0,
      /*is_causal=*/true, w.rng_state, w.unused, scale, window - 1, /*window_size_right=*/0);
  if (dq_sum) {
    dq_sum->add_(dq);
    dq = torch::Tensor();
  }
  return {dq, dk, dv};
}

struct SlidingWindowFn : torch::autograd::Function<SlidingWindowFn> {
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t window, bool tiled_forward, bool wgmma_backward) {
    const auto w = WindowForwardToSave(q, k, v, window, tiled_forward, wgmma_backward);
    ctx->save_for_backward({q, k, v, w.out, w.lse, w.rng_state, w.unused});
    ctx->saved_data["window"] = window;
    ctx->saved_data["wgmma_backward"] = wgmma_backward;
    return w.out;
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    const auto s = ctx->get_saved_variables();
    auto [dq, dk, dv] = WindowGradients(grads[0], s[0], s[1], s[2], {s[3], s[4], s[5], s[6]},
                                        ctx->saved_data["window"].toInt(),
                                        ctx->saved_data["wgmma_backward"].toBool(), nullptr);
    return {dq, dk, dv, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The selected and window branches as one node (bf16/fp16): the forwards as in
// SelectedAttentionFn and SlidingWindowFn; the backward adds both branches' dq into one
// float32 sum and rounds it once. Two nodes each rounded their own float32 dq (45 us each at
// batch 16, T=2048, D64 12:2 on an H100) and autograd then added the two (another 45 us).
struct SelectedAndWindowFn : torch::autograd::Function<SelectedAndWindowFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k_slc,
                             const torch::Tensor& v_slc, const torch::Tensor& block_idx, const torch::Tensor& k_win,
                             const torch::Tensor& v_win, const Geometry& g, bool tiled_forward, bool wgmma_backward) {
    RECORD_FUNCTION("nsa::selected_and_window_forward", std::vector<c10::IValue>());
    auto [o_slc, lse_slc] = detail::SelectedForward(q, k_slc, v_slc, block_idx, ToGeo(g));
    const auto w = WindowForwardToSave(q, k_win, v_win, g.window, tiled_forward, wgmma_backward);
    ctx->save_for_backward({q, k_slc, v_slc, o_slc, lse_slc, block_idx, k_win, v_win, w.out, w.lse, w.rng_state,
                            w.unused});
    SaveGeometry(ctx, g);
    ctx->saved_data["wgmma_backward"] = wgmma_backward;
    return {o_slc, w.out};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::selected_and_window_backward", std::vector<c10::IValue>());
    const auto s = ctx->get_saved_variables();
    const auto& q = s[0];
    const Geometry g = LoadGeometry(ctx);
    auto dq_sum = at::zeros(q.sizes(), q.options().dtype(at::kFloat));
    auto [dq_s, dk_slc, dv_slc] =
        detail::SelectedBackward(grads[0], q, s[1], s[2], s[3], s[4], s[5], ToGeo(g), &dq_sum);
    auto [dq_w, dk_win, dv_win] = WindowGradients(grads[1], q, s[6], s[7], {s[8], s[9], s[10], s[11]}, g.window,
                                                  ctx->saved_data["wgmma_backward"].toBool(), &dq_sum);
    return {dq_sum.to(q.scalar_type()), dk_slc, dv_slc, torch::Tensor(), dk_win, dv_win,
            torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// fp32 path: SDPA over [B,H,T,D] with an explicit band mask (K/V repeated to H heads; this
// path exists for precision checks, not for speed).
torch::Tensor SlidingWindowMasked(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, int64_t window) {
  const int64_t T = q.size(1), H = q.size(2), G = k.size(2);
  const auto pos = torch::arange(T, q.options().dtype(torch::kLong));
  const auto t = pos.unsqueeze(1), s = pos.unsqueeze(0);
  const auto allowed = (s <= t) & (s > t - window);
  const auto kh = k.repeat_interleave(H / G, 2).transpose(1, 2);
  const auto vh = v.repeat_interleave(H / G, 2).transpose(1, 2);
  return at::scaled_dot_product_attention(q.transpose(1, 2), kh, vh, allowed)
      .transpose(1, 2)
      .contiguous();
}

// The window's forward and backward for these inputs, after checking them; a forced choice
// (WindowKernelChoice) this input cannot take fails here, fp32 included.
struct WindowPaths {
  bool tiled_forward, wgmma_backward;
};
WindowPaths ChooseWindowPaths(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const Geometry& g) {
  TORCH_CHECK(q.is_cuda(), "q must be a CUDA tensor");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be [B,T,*,D]");
  TORCH_CHECK(g.window > 0, "window must be positive");
  return {detail::UseTiledWindowForward(q), detail::UseWgmmaWindowBackward(q)};
}

// Whether the compressed branch runs on cuDNN. Under two compressed blocks the custom kernels
// run: with none (T < l) there is nothing to attend, and cuDNN's backward refuses a single row.
// UseDenseCompressed still refuses a forced path it cannot run at all.
bool DenseCompressed(const torch::Tensor& q, const torch::Tensor& k_cmp, const Geometry& g) {
  return detail::UseDenseCompressed(q, ToGeo(g)) && k_cmp.size(1) >= 2;
}

// The three branches and their gate mixing as one node (bf16/fp16; BranchesMixed in
// nsa_cuda.h). Forward: compressed attention and its importance, the selection, the selected and
// window forwards, the mixing; q is rotated (RoPE) first. Backward: the mixing's backward also
// returns each branch's delta (rowsum(dO * O), GateMixBackward) and folds the gates into the
// branches that run on our kernels (GateFold: no d_k for them); the compressed dQ starts the
// float32 dq sum, the selected and window backwards add to it, and RoPE's backward rounds it.
// The selected backward's block map is built on a side stream meanwhile (StartSelectedBackwardMap).
struct BranchesMixedFn : torch::autograd::Function<BranchesMixedFn> {
  static tensor_list forward(AutogradContext* ctx, const torch::Tensor& q_unrotated, const torch::Tensor& k_cmp,
                             const torch::Tensor& v_cmp, const torch::Tensor& k_slc, const torch::Tensor& v_slc,
                             const torch::Tensor& k_win, const torch::Tensor& v_win, const torch::Tensor& gates,
                             const torch::Tensor& rope_cos, const torch::Tensor& rope_sin, const Geometry& g,
                             bool dense_cmp, bool tiled_forward, bool wgmma_backward, const GradientPart& dq,
                             const HandoffSlot& dk_slc_to, const HandoffSlot& dv_slc_to) {
    RECORD_FUNCTION("nsa::branches_mixed_forward", std::vector<c10::IValue>());
    const Geo geo = ToGeo(g);
    const auto q = detail::RopeForward(q_unrotated.unsqueeze(2), rope_cos, rope_sin, 1u)[0];
    // On cuDNN the compressed output stays in its packed rows: the mix reads it there.
    const auto c = CompressedForwardToSave(q, k_cmp, v_cmp, geo, dense_cmp, /*selection_only=*/true,
                                           /*unpack_out=*/!dense_cmp);
    auto block_idx = detail::SelectBlocksLaunch(c.importance, q.size(1), geo);
    auto [o_slc, lse_slc] = detail::SelectedForward(q, k_slc, v_slc, block_idx, geo);
    const auto w = WindowForwardToSave(q, k_win, v_win, g.window, tiled_forward, wgmma_backward);
    const detail::CmpPackedRows cmp_rows = PackedRowsOf(q, k_cmp, geo);
    auto mixed = dense_cmp ? detail::GateMixForward(gates, PackedOut(c.out_rows), o_slc, w.out, &cmp_rows)
                           : detail::GateMixForward(gates, c.out, o_slc, w.out);
    ctx->save_for_backward({q, k_cmp, v_cmp, c.out, c.lse, c.q_rows, c.out_rows, c.seed, c.offset,  // 0-8
                            k_slc, v_slc, o_slc, lse_slc, block_idx,                                 // 9-13
                            k_win, v_win, w.out, w.lse, w.rng_state, w.unused, gates,                // 14-20
                            rope_cos, rope_sin});                                                    // 21-22
    SaveGeometry(ctx, g);
    ctx->saved_data["dense_cmp"] = dense_cmp;
    ctx->saved_data["wgmma_backward"] = wgmma_backward;
    ctx->saved_data["dq"] = dq.ToSaved();
    if (dk_slc_to.to && dv_slc_to.to) {
      ctx->saved_data["slc_handoff"] = c10::ivalue::Tuple::create(
          {GradientHandoff::ToSaved(dk_slc_to.to), static_cast<int64_t>(dk_slc_to.index),
           GradientHandoff::ToSaved(dv_slc_to.to), static_cast<int64_t>(dv_slc_to.index)});
    }
    ctx->mark_non_differentiable({block_idx});
    ctx->set_materialize_grads(false);
    return {mixed, block_idx};
  }
  static tensor_list backward(AutogradContext* ctx, tensor_list grads) {
    RECORD_FUNCTION("nsa::branches_mixed_backward", std::vector<c10::IValue>());
    const torch::Tensor none;
    if (!grads[0].defined()) return tensor_list(17);
    const auto s = ctx->get_saved_variables();
    const auto& q = s[0];
    const Geometry g = LoadGeometry(ctx);
    const Geo geo = ToGeo(g);
    const bool dense_cmp = ctx->saved_data["dense_cmp"].toBool();
    const bool wgmma_backward = ctx->saved_data["wgmma_backward"].toBool();
    // The selected backward's block map needs only the forward's selection: started now on a
    // side stream, its small kernels overlap the mixing's and the compressed branch's backwards.
    auto selected_map = detail::StartSelectedBackwardMap(q, s[9], s[13], geo);
    // Each branch whose backward runs on our kernels (log2 lse) takes its gate folded into its
    // softmax and the mix's gradient itself (GateFold); cuDNN and FlashAttention-2 get d_k.
    detail::GateFold fold;
    if (!dense_cmp) fold.lse[0] = s[4];
    fold.lse[1] = s[12];
    if (wgmma_backward) fold.lse[2] = s[17];
    torch::Tensor deltas;  // [3,B,T,H]: compressed, selected, window
    // On cuDNN the compressed output (s[6]) and its gradient are in packed rows (the forward's mix).
    const detail::CmpPackedRows cmp_rows = PackedRowsOf(q, s[1], geo);
    auto [dgates, d_cmp, d_slc, d_win] =
        dense_cmp ? detail::GateMixBackward(grads[0], s[20], PackedOut(s[6]), s[11], s[16], &deltas, &fold, &cmp_rows)
                  : detail::GateMixBackward(grads[0], s[20], s[3], s[11], s[16], &deltas, &fold);
    // The gradient and lse each branch's backward takes.
    const auto branch_dout = [&](const torch::Tensor& d_k) { return d_k.defined() ? d_k : fold.dout; };
    const auto branch_lse = [&](int k, const torch::Tensor& lse) {
      return fold.folded_lse[k].defined() ? fold.folded_lse[k] : lse;
    };
    auto dq_sum = at::empty(q.sizes(), q.options().dtype(at::kFloat));
    const CompressedSaved c{s[3], none, branch_lse(0, s[4]), s[5], s[6], s[7], s[8]};
    auto [dq_c, dk_cmp, dv_cmp] =
        CompressedGradients(branch_dout(d_cmp), q, s[1], s[2], c, geo, dense_cmp, &dq_sum, deltas[0],
                            /*dout_packed=*/dense_cmp);
    // Handed to RoPE's backward as the kernel's float32 sums (GradientHandoff), rounded there.
    const auto handoff = ctx->saved_data.find("slc_handoff");
    const bool hand_off = handoff != ctx->saved_data.end();
    auto [dq_s, dk_slc, dv_slc] =
        detail::SelectedBackward(branch_dout(d_slc), q, s[9], s[10], s[11], branch_lse(1, s[12]), s[13], geo,
                                 &dq_sum, deltas[1], selected_map.get(), /*round_dkdv=*/!hand_off);
    if (hand_off) {
      const auto& h = handoff->second.toTupleRef().elements();
      GradientHandoff::FromSaved(h[0])->Put(static_cast<size_t>(h[1].toInt()), std::exchange(dk_slc, {}));
      GradientHandoff::FromSaved(h[2])->Put(static_cast<size_t>(h[3].toInt()), std::exchange(dv_slc, {}));
    }
    auto [dq_w, dk_win, dv_win] =
        WindowGradients(branch_dout(d_win), q, s[14], s[15], {s[16], branch_lse(2, s[17]), s[18], s[19]},
                        g.window, wgmma_backward, &dq_sum, deltas[2]);
    // The float32 sum goes through RoPE's backward and is rounded there: one pass.
    const auto dq_out = GradientPart::FromSaved(ctx->saved_data["dq"]).Take(q.unsqueeze(2).sizes());
    auto dq = detail::RopeBackward({dq_sum}, s[21], s[22], 1u, q.scalar_type(), dq_out).view(q.sizes());
    return {dq,   dk_cmp, dv_cmp, dk_slc, dv_slc, dk_win, dv_win, dgates, none,
            none, none,   none,   none,   none,   none,   none,   none};
  }
};

}  // namespace

bool Available() {
  if (!torch::cuda::is_available() || torch::cuda::device_count() == 0) return false;
  return detail::KernelImageLoads();
}

CmpImportanceResult CompressedAttention(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                        const torch::Tensor& v_cmp, const Geometry& g) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(q));
  // Under two compressed blocks the custom kernels run: with none (T < l) there is nothing to
  // attend, and cuDNN's backward refuses a single row. UseDenseCompressed still refuses a
  // forced path it cannot run at all.
  auto outs = CompressedAttentionFn::apply(q.contiguous(), k_cmp.contiguous(), v_cmp.contiguous(), g,
                                          DenseCompressed(q, k_cmp, g));
  return {outs[0], outs[1]};
}

torch::Tensor SelectBlocks(const torch::Tensor& importance, int64_t seq_len, const Geometry& g) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(importance));
  RECORD_FUNCTION("nsa::select_blocks", std::vector<c10::IValue>());
  return detail::SelectBlocksLaunch(importance.detach(), seq_len, ToGeo(g));
}

torch::Tensor SelectedAttention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& block_idx,
                                const Geometry& g) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(q));
  return SelectedAttentionFn::apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                    block_idx.to(torch::kInt).contiguous(), g);
}

std::pair<torch::Tensor, torch::Tensor> SelectedAndWindowAttention(const torch::Tensor& q, const torch::Tensor& k_slc,
                                                                   const torch::Tensor& v_slc,
                                                                   const torch::Tensor& block_idx,
                                                                   const torch::Tensor& k_win,
                                                                   const torch::Tensor& v_win, const Geometry& g) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(q));
  if (q.scalar_type() != torch::kHalf && q.scalar_type() != torch::kBFloat16) {
    return {SelectedAttention(q, k_slc, v_slc, block_idx, g), SlidingWindowAttention(q, k_win, v_win, g)};
  }
  const WindowPaths paths = ChooseWindowPaths(q, k_win, v_win, g);
  const auto outs = SelectedAndWindowFn::apply(q.contiguous(), k_slc.contiguous(), v_slc.contiguous(),
                                               block_idx.to(torch::kInt).contiguous(), k_win.contiguous(),
                                               v_win.contiguous(), g, paths.tiled_forward, paths.wgmma_backward);
  return {outs[0], outs[1]};
}

std::pair<torch::Tensor, torch::Tensor> BranchesMixed(const torch::Tensor& q, const torch::Tensor& rope_cos,
                                                      const torch::Tensor& rope_sin, const torch::Tensor& k_cmp,
                                                      const torch::Tensor& v_cmp, const torch::Tensor& k_slc,
                                                      const torch::Tensor& v_slc, const torch::Tensor& k_win,
                                                      const torch::Tensor& v_win, const torch::Tensor& gates,
                                                      const Geometry& g, const GradientPart& dq,
                                                      const HandoffSlot& dk_slc_to, const HandoffSlot& dv_slc_to) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(q));
  TORCH_CHECK(q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16,
              "BranchesMixed takes bf16/fp16, got ", q.scalar_type());
  TORCH_CHECK(q.dim() == 4 && q.stride(3) == 1, "BranchesMixed: q must be [B,T,H,D] with unit stride in D");
  for (const torch::Tensor* t : {&k_cmp, &v_cmp, &k_slc, &v_slc, &k_win, &v_win, &gates}) {
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "BranchesMixed: every input must have q's dtype ",
                q.scalar_type(), ", got ", t->scalar_type());
  }
  const WindowPaths paths = ChooseWindowPaths(q, k_win, v_win, g);
  // Only gradients whose producer will take them are handed over (else they would be lost):
  // k_slc and v_slc exactly as the handoff's producer returned them (contiguous: no copy
  // between).
  const bool hand_off = dk_slc_to.Takes(k_slc) && dv_slc_to.Takes(v_slc) && k_slc.is_contiguous() &&
                        v_slc.is_contiguous();
  const auto outs = BranchesMixedFn::apply(q, k_cmp.contiguous(), v_cmp.contiguous(), k_slc.contiguous(),
                                           v_slc.contiguous(), k_win.contiguous(), v_win.contiguous(),
                                           gates.contiguous(), rope_cos, rope_sin, g, DenseCompressed(q, k_cmp, g),
                                           paths.tiled_forward, paths.wgmma_backward, dq,
                                           hand_off ? dk_slc_to : HandoffSlot{}, hand_off ? dv_slc_to : HandoffSlot{});
  return {outs[0], outs[1]};
}

torch::Tensor SlidingWindowAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const Geometry& g) {
  const at::OptionalDeviceGuard on_inputs_device(at::device_of(q));
  const WindowPaths paths = ChooseWindowPaths(q, k, v, g);
  if (q.scalar_type() == torch::kHalf || q.scalar_type() == torch::kBFloat16) {
    return SlidingWindowFn::apply(q.contiguous(), k.contiguous(), v.contiguous(), g.window, paths.tiled_forward,
                                  paths.wgmma_backward);
  }
  return SlidingWindowMasked(q, k, v, g.window);
}

}  // namespace nsad::nsa::cuda
