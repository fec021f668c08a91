#include "nsa/dispatch.h"

#include <ATen/autocast_mode.h>

#include <atomic>
#include <stdexcept>

#include "model/shared_input_linear.h"
#include "model/weight_copies.h"
#include "nsa/compress.h"

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "fused_ops.h"
#include "nsa_cuda.h"
#endif

namespace nsad::nsa {
namespace {

std::atomic<int64_t> reference_layers{0};
std::atomic<int64_t> cuda_layers{0};
std::atomic<int64_t> fused_calls{0};

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

std::pair<torch::Tensor, torch::Tensor> SelectedAndWindowAttention(AttentionBackend backend, const torch::Tensor& q,
                                                                   const torch::Tensor& k_slc,
                                                                   const torch::Tensor& v_slc,
                                                                   const torch::Tensor& block_idx,
                                                                   const torch::Tensor& k_win,
                                                                   const torch::Tensor& v_win, const Geometry& g) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend)) return cuda::SelectedAndWindowAttention(q, k_slc, v_slc, block_idx, k_win, v_win, g);
#else
  UseCuda(backend);
#endif
  return {SelectedAttentionReference(q, k_slc, v_slc, block_idx, g), SlidingWindowAttentionReference(q, k_win, v_win, g)};
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

MixedBranches AttendAndMix(AttentionBackend backend, const torch::Tensor& q_unrotated, const RopeTable& q_rope,
                           const torch::Tensor& k_cmp, const torch::Tensor& v_cmp, const torch::Tensor& k_slc,
                           const torch::Tensor& v_slc, const torch::Tensor& k_win, const torch::Tensor& v_win,
                           const torch::Tensor& gates, int64_t num_groups, const Geometry& g,
                           const GradientPart& dq_unrotated, const HandoffSlot& dk_slc_to,
                           const HandoffSlot& dv_slc_to) {
  const auto& q_in = q_unrotated;
#ifdef NSAD_HAVE_CUDA_KERNELS
  const auto type = q_in.scalar_type();
  const bool one_reduced_type = (type == torch::kBFloat16 || type == torch::kHalf) && q_in.is_cuda() &&
                                q_in.stride(3) == 1 && q_rope.cos.scalar_type() == torch::kFloat &&
                                k_cmp.scalar_type() == type && v_cmp.scalar_type() == type &&
                                k_slc.scalar_type() == type && v_slc.scalar_type() == type &&
                                k_win.scalar_type() == type && v_win.scalar_type() == type &&
                                gates.scalar_type() == type;
  if (UseCuda(backend) && one_reduced_type) {
    cuda_layers.fetch_add(1, std::memory_order_relaxed);
    fused_calls.fetch_add(1, std::memory_order_relaxed);  // the gate mixing
    fused_calls.fetch_add(1, std::memory_order_relaxed);  // RoPE
    auto [out, block_idx] =
        cuda::BranchesMixed(q_in, q_rope.cos, q_rope.sin, k_cmp, v_cmp, k_slc, v_slc, k_win, v_win, gates, g,
                            dq_unrotated, dk_slc_to, dv_slc_to);
    return {out, block_idx};
  }
#endif
  const auto q = RotateParts(backend, q_in.unsqueeze(2), q_rope, {true})[0];
  const auto cmp = CompressAndSelect(backend, q, k_cmp, v_cmp, num_groups, q.size(1), g);
  const auto [o_slc, o_win] = SelectedAndWindowAttention(backend, q, k_slc, v_slc, cmp.block_idx, k_win, v_win, g);
  return {MixBranches(backend, gates, cmp.out, o_slc, o_win), cmp.block_idx};
}

std::vector<torch::Tensor> RotateParts(AttentionBackend backend, const torch::Tensor& x,
                                       const RopeTable& table, const std::vector<bool>& rotate,
                                       const GradientPart& dx, const PartChunks& chunks,
                                       const c10::intrusive_ptr<GradientHandoff>& handoff) {
  TORCH_CHECK(x.dim() == 5, "RotateParts takes x [B,T,P,M,D], got ", x.sizes());
  TORCH_CHECK(static_cast<int64_t>(rotate.size()) == x.size(2), "RotateParts: ", rotate.size(),
              " rotate flags for ", x.size(2), " parts");
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(x) && table.cos.scalar_type() == torch::kFloat) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::ApplyRopeParts(x, table.cos, table.sin, rotate, dx, chunks, handoff);
  }
#else
  UseCuda(backend);
#endif
  TORCH_CHECK(!chunks.Any() || chunks.Fits(x.size(2), x.size(1)), "RotateParts: a chunk layout that does not fit x ",
              x.sizes());
  std::vector<torch::Tensor> parts, chunked;
  for (int64_t p = 0; p < x.size(2); ++p) {
    const auto part = x.select(2, p);
    const auto out = rotate[p] ? ApplyRope(part, table) : part.contiguous();
    if (!chunks.Holds(p)) {
      parts.push_back(out);
      continue;
    }
    parts.emplace_back();
    chunked.push_back(TokensAsChunks(out, chunks.chunks, chunks.len));
  }
  if (chunks.Any()) parts.push_back(torch::stack(chunked));
  return parts;
}

torch::Tensor MixBranches(AttentionBackend backend, const torch::Tensor& gates,
                          const torch::Tensor& o_cmp, const torch::Tensor& o_slc,
                          const torch::Tensor& o_win) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(gates) &&
      gates.scalar_type() == o_cmp.scalar_type() && o_slc.scalar_type() == o_cmp.scalar_type() &&
      o_win.scalar_type() == o_cmp.scalar_type()) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::MixBranches(gates, o_cmp, o_slc, o_win);
  }
#else
  UseCuda(backend);
#endif
  return gates.select(-1, 0).unsqueeze(-1) * o_cmp + gates.select(-1, 1).unsqueeze(-1) * o_slc +
         gates.select(-1, 2).unsqueeze(-1) * o_win;
}

std::pair<torch::Tensor, torch::Tensor> AddRmsNorm(AttentionBackend backend, const torch::Tensor& x,
                                                   const torch::Tensor& y,
                                                   const torch::Tensor& weight, double eps) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::AddRmsNormTakes(x, y, weight)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::AddRmsNorm(x, y, weight, eps);
  }
#else
  UseCuda(backend);
#endif
  auto s = x + y;
  auto h = torch::rms_norm(s, {weight.size(0)}, weight, eps);
  return {s, h};
}

std::pair<torch::Tensor, torch::Tensor> RmsNormOfResidual(AttentionBackend backend, const torch::Tensor& x,
                                                          const torch::Tensor& weight, double eps) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::AddRmsNormTakes(x, x, weight)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    const bool autocast = at::autocast::is_autocast_enabled(x.device().type());
    return cuda::RmsNormOfResidual(x, weight, eps,
                                   autocast ? at::autocast::get_autocast_dtype(x.device().type()) : x.scalar_type());
  }
#else
  UseCuda(backend);
#endif
  return {x, torch::rms_norm(x, {weight.size(0)}, weight, eps)};
}

torch::Tensor SwiGlu(AttentionBackend backend, const torch::Tensor& joint) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(joint)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::SwiGlu(joint);
  }
#else
  UseCuda(backend);
#endif
  const auto halves = joint.chunk(2, -1);
  return torch::silu(halves[0]) * halves[1];
}

torch::Tensor Silu(AttentionBackend backend, const torch::Tensor& x, const GradientPart& dx) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(x)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::SiluRows(x, dx);
  }
#else
  UseCuda(backend);
#endif
  return torch::silu(x);
}

torch::Tensor GateHead(AttentionBackend backend, const torch::Tensor& hidden, const torch::Tensor& hidden_bias,
                       const torch::nn::Linear& out, const GradientPart& dx) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && out->bias.defined() && LinearComputeType(hidden) == hidden.scalar_type() &&
      cuda::GateHeadTakes(hidden, hidden_bias, out->weight, out->bias)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    torch::Tensor w16;
    if (const auto* copies = UseWeightCopies::Current()) w16 = copies->Joint({out->weight}, hidden.scalar_type());
    return cuda::GateHead(hidden, hidden_bias, out->weight, out->bias, w16, dx);
  }
#else
  UseCuda(backend);
#endif
  // Where hidden's gradient goes into dx, the sum stays in hidden's dtype: add's backward then
  // hands silu's input gradient (dx's slice) to hidden as it is, where the joint projection's
  // backward finds it. Otherwise u + c in float32 (a 16-bit hidden promoted), as the fused path
  // adds it.
  const auto pre = !hidden_bias.defined() ? hidden
                   : dx.defined()         ? hidden + hidden_bias.to(hidden.scalar_type())
                                          : hidden + hidden_bias;
  return torch::sigmoid(ApplyLinear(out, Silu(backend, pre, dx)));
}

torch::Tensor CrossEntropyLoss(AttentionBackend backend, const torch::Tensor& logits,
                               const torch::Tensor& targets, double expected_grad) {
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(logits)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::CrossEntropy(logits, targets, /*ignore_index=*/-100, expected_grad);
  }
#else
  UseCuda(backend);
#endif
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32), targets);
}

torch::Tensor GateStats(AttentionBackend backend, const torch::Tensor& gates,
                        const torch::Tensor& block_idx) {
  torch::NoGradGuard no_grad;
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::FusedOpsTake(gates) && block_idx.is_cuda() &&
      (block_idx.scalar_type() == torch::kInt || block_idx.scalar_type() == torch::kLong)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::GateStats(gates, block_idx);
  }
#else
  UseCuda(backend);
#endif
  const auto flat = gates.to(torch::kFloat).reshape({-1, 3});
  const auto mean = flat.mean(0);
  const auto stddev = flat.std(0, /*unbiased=*/false);
  const auto selected = (block_idx >= 0).sum(-1).to(torch::kFloat).mean().view({1});
  return torch::cat({mean, stddev, selected});
}

torch::Tensor GateStatsOfLayers(AttentionBackend backend, const std::vector<torch::Tensor>& gates,
                                const std::vector<torch::Tensor>& block_idx) {
  torch::NoGradGuard no_grad;
#ifdef NSAD_HAVE_CUDA_KERNELS
  if (UseCuda(backend) && cuda::GateStatsOfLayersTake(gates, block_idx)) {
    fused_calls.fetch_add(1, std::memory_order_relaxed);
    return cuda::GateStatsOfLayers(gates, block_idx);
  }
#else
  UseCuda(backend);
#endif
  TORCH_CHECK(gates.size() == block_idx.size(), "GateStatsOfLayers: one block_idx per layer's gates");
  std::vector<torch::Tensor> rows;
  for (size_t l = 0; l < gates.size(); ++l) rows.push_back(GateStats(backend, gates[l], block_idx[l]));
  return torch::stack(rows);
}

int64_t FusedCallsExecuted() { return fused_calls.load(); }

int64_t LayersExecuted(AttentionBackend backend) {
  switch (backend) {
    case AttentionBackend::kReference: return reference_layers.load();
    case AttentionBackend::kCuda: return cuda_layers.load();
    case AttentionBackend::kAuto: break;
  }
  return 0;
}

}  // namespace nsad::nsa
