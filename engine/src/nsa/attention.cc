#include "nsa/attention.h"

#include <cmath>
#include <stdexcept>

#include "model/shared_input_linear.h"
#include "nsa/compress.h"
#include "nsa/dispatch.h"

namespace nsad::nsa {
namespace {

torch::Tensor Positions(int64_t n, const torch::Device& device) {
  return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(device));
}

torch::nn::Linear NormalLinear(int64_t in, int64_t out, bool bias, double std) {
  torch::nn::Linear linear(torch::nn::LinearOptions(in, out).bias(bias));
  torch::NoGradGuard no_grad;
  linear->weight.normal_(0.0, std);
  if (bias) linear->bias.zero_();
  return linear;
}

}  // namespace

Geometry GeometryFrom(const NsaConfig& config) {
  Geometry g;
  g.cmp_block = config.cmp_block;
  g.cmp_stride = config.cmp_stride;
  g.slc_block = config.slc_block;
  g.top_n = config.slc_top_n;
  g.window = config.window;
  return g;
}


NsaAttentionImpl::NsaAttentionImpl(const ModelConfig& config, AttentionBackend backend,
                                   double out_proj_std)
    : geometry_(GeometryFrom(config.nsa)),
      heads_(config.n_heads),
      groups_(config.n_kv_groups),
      head_dim_(config.head_dim),
      rope_theta_(config.rope_theta),
      backend_(backend) {
  if (backend == AttentionBackend::kAuto) {
    throw std::invalid_argument("NsaAttention needs a resolved backend (reference or cuda)");
  }
  TORCH_CHECK(heads_ % groups_ == 0, "n_heads must be a multiple of n_kv_groups");
  const int64_t dim = config.dim, H = heads_, G = groups_, D = head_dim_;
  const int64_t l = geometry_.cmp_block;
  constexpr double kStd = 0.02;  // GPT-2 style init for the projections

  q_proj_ = register_module("q_proj", NormalLinear(dim, H * D, false, kStd));
  kv_proj_ = register_module("kv_proj", NormalLinear(dim, 6 * G * D, false, kStd));
  o_proj_ = register_module("o_proj", NormalLinear(H * D, dim, false, out_proj_std));

  const int64_t cmp_hidden = CompressionHidden(config);
  auto make_compressor = [&] {
    return torch::nn::Sequential(NormalLinear(l * D, cmp_hidden, true, kStd),
                                 torch::nn::SiLU(), NormalLinear(cmp_hidden, D, true, kStd));
  };
  cmp_k_mlp_ = register_module("cmp_k_mlp", make_compressor());
  cmp_v_mlp_ = register_module("cmp_v_mlp", make_compressor());
  cmp_k_pos_ = register_parameter("cmp_k_pos", torch::randn({l, D}) * kStd);
  cmp_v_pos_ = register_parameter("cmp_v_pos", torch::randn({l, D}) * kStd);

  // Gates: PyTorch's default fan-in init (NOT zero) in both layers, so that at init every
  // gate is near sigmoid(0) = 0.5 -- no branch switched off -- yet varies with the input
  // and passes gradient to the first layer. Only the last bias is zeroed (centres at 0.5).
  const int64_t gate_hidden = GateHidden(config);
  torch::nn::Linear gate_out(gate_hidden, 3 * H);
  {
    torch::NoGradGuard no_grad;
    gate_out->bias.zero_();
  }
  gate_mlp_ = register_module(
      "gate_mlp", torch::nn::Sequential(torch::nn::Linear(dim, gate_hidden), torch::nn::SiLU(),
                                        gate_out, torch::nn::Sigmoid()));
}

torch::Tensor NsaAttentionImpl::Compress(const torch::Tensor& tokens,
                                         const torch::Tensor& position_encoding,
                                         const torch::nn::Sequential& mlp) const {
  return CompressBlocks(tokens, position_encoding, torch::nn::Linear(mlp->ptr<torch::nn::LinearImpl>(0)),
                        torch::nn::Linear(mlp->ptr<torch::nn::LinearImpl>(2)), geometry_);
}

std::vector<Compressor> NsaAttentionImpl::Compressors() const {
  auto compressor = [](const torch::Tensor& pos, const torch::nn::Sequential& mlp) {
    return Compressor{pos, torch::nn::Linear(mlp->ptr<torch::nn::LinearImpl>(0)),
                      torch::nn::Linear(mlp->ptr<torch::nn::LinearImpl>(2))};
  };
  return {compressor(cmp_k_pos_, cmp_k_mlp_), compressor(cmp_v_pos_, cmp_v_mlp_)};
}

PartChunks NsaAttentionImpl::CompressionChunks(int64_t seq_len) const {
  const auto& g = geometry_;
  const int64_t N = NumCmpBlocks(seq_len, g);
  if (backend_ != AttentionBackend::kCuda || g.cmp_block % g.cmp_stride != 0 || N == 0) return {};
  return {0, 2, g.cmp_stride, N + g.cmp_block / g.cmp_stride - 1};
}

std::vector<torch::Tensor> NsaAttentionImpl::CompressKeysAndValues(const torch::Tensor& k_tokens,
                                                                   const torch::Tensor& v_tokens) const {
  // The CUDA backend takes the fused node (same maths, a fraction of the launches); the
  // reference keeps the composed ops, which tests hold the fused node to.
  if (backend_ == AttentionBackend::kCuda && geometry_.cmp_block % geometry_.cmp_stride == 0) {
    return CompressBlocksTogether({k_tokens, v_tokens}, Compressors(), geometry_);
  }
  return {Compress(k_tokens, cmp_k_pos_, cmp_k_mlp_), Compress(v_tokens, cmp_v_pos_, cmp_v_mlp_)};
}

const NsaAttentionImpl::RopeCache& NsaAttentionImpl::Rope(int64_t seq_len,
                                                          const torch::Device& device,
                                                          torch::ScalarType acc) {
  auto& c = rope_cache_;
  if (c.seq_len != seq_len || c.device != device || c.acc != acc) {
    torch::NoGradGuard no_grad;
    const auto& g = geometry_;
    // A compressed key stands for a whole block; it is rotated as if it were the block's last
    // token, so q.k_cmp depends on the distance from the query to the end of the block.
    const auto block_end = Positions(NumCmpBlocks(seq_len, g), device) * g.cmp_stride +
                           (g.cmp_block - 1);
    c.tokens = MakeRopeTable(Positions(seq_len, device), head_dim_, rope_theta_, acc);
    c.blocks = MakeRopeTable(block_end, head_dim_, rope_theta_, acc);
    c.seq_len = seq_len;
    c.device = device;
    c.acc = acc;
  }
  return c;
}

torch::Tensor NsaAttentionImpl::forward(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3, "NsaAttention expects [B,T,dim], got ", x.sizes());
  const int64_t B = x.size(0), T = x.size(1), H = heads_, G = groups_, D = head_dim_;
  const auto& g = geometry_;
  const auto& rope = Rope(T, x.device(), x.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat);

  // q_proj and kv_proj have no bias; the gate MLP's hidden bias is added (and its gradient
  // summed) by GateHead below.
  const auto projected = SharedInputLinear(x, InputProjections(), Biases::kLeftToCaller);
  // The three ops that read the projection's parts (q, kv, the gate MLP's hidden layer) write
  // their gradients into one buffer where their fused backwards run, so that the projection's
  // backward is one dx GEMM and one dW GEMM (nsa/shared_gradient.h). Only in a 16-bit compute
  // type, where all three take their fused paths (AttendAndMix's needs it): a part that no op
  // takes would keep the whole buffer alive until the graph is freed.
  std::vector<GradientPart> grad_parts(projected.size());
  const auto compute_type = projected[0].scalar_type();
  if (backend_ == AttentionBackend::kCuda && projected[0].requires_grad() &&
      (compute_type == torch::kBFloat16 || compute_type == torch::kHalf)) {
    grad_parts = SharedGradientParts(projected);
  }
  // The kv projection [B,T,6,G,D] = [k_cmp, v_cmp, k_slc, v_slc, k_win, v_win] split into
  // contiguous parts by one call, which also rotates the selected and window keys; its
  // gradient then reaches kv_proj in one piece instead of six zero-padded selects. On the
  // CUDA backend the compression's two parts come out as the chunks its GEMMs read.
  const auto chunks = CompressionChunks(T);
  // The selected branch's backward hands its float32 dK/dV sums to this split's backward,
  // which rounds them as it writes kv's gradient (nsa/shared_gradient.h, GradientHandoff).
  const auto handoff = backend_ == AttentionBackend::kCuda && projected[1].requires_grad()
                           ? c10::make_intrusive<GradientHandoff>(6)
                           : c10::intrusive_ptr<GradientHandoff>();
  const auto kv = RotateParts(backend_, projected[1].view({B, T, 6, G, D}), rope.tokens,
                              {false, false, true, false, true, false}, grad_parts[1], chunks, handoff);
  const auto& k_slc = kv[2];
  const auto& v_slc = kv[3];
  const auto& k_win = kv[4];
  const auto& v_win = kv[5];
  const auto compressed = chunks.Any() ? CompressChunksTogether(kv.back(), Compressors(), g)
                                       : CompressKeysAndValues(kv[0], kv[1]);
  const auto k_cmp = RotateParts(backend_, compressed[0].unsqueeze(2), rope.blocks, {true})[0];
  const auto v_cmp = compressed[1].contiguous();

  // The rest of the gate MLP [Linear, SiLU, Linear, Sigmoid] (built in the constructor)
  // after its first layer.
  const auto gates =
      GateHead(backend_, projected[2], GateHiddenLayer()->bias, GateOutput(), grad_parts[2]).view({B, T, H, 3});
  // q is rotated (RoPE) inside, fused with the attention on the CUDA backend.
  const auto mixed = AttendAndMix(backend_, projected[0].view({B, T, H, D}), rope.tokens, k_cmp, v_cmp, k_slc,
                                  v_slc, k_win, v_win, gates, G, g, grad_parts[0], {handoff, 2}, {handoff, 3});
  last_gates_ = gates.detach();
  last_block_idx_ = mixed.block_idx.detach();
  return ApplyLinear(o_proj_, mixed.out.reshape({B, T, H * D}));
}

std::vector<torch::nn::Linear> NsaAttentionImpl::InputProjections() const {
  return {q_proj_, kv_proj_, GateHiddenLayer()};
}

torch::nn::Linear NsaAttentionImpl::GateHiddenLayer() const {
  return torch::nn::Linear(gate_mlp_->ptr<torch::nn::LinearImpl>(0));
}

torch::nn::Linear NsaAttentionImpl::GateOutput() const {
  return torch::nn::Linear(gate_mlp_->ptr<torch::nn::LinearImpl>(2));
}

std::vector<std::vector<torch::Tensor>> NsaAttentionImpl::GemmWeights() const {
  std::vector<torch::Tensor> projections;
  for (const auto& layer : InputProjections()) projections.push_back(layer->weight);
  return {projections, {GateOutput()->weight}, {o_proj_->weight}};
}

torch::Tensor NsaAttentionImpl::last_stats_tensor() const {
  if (!last_gates_.defined()) return {};
  return GateStats(backend_, last_gates_, last_block_idx_);
}

LayerGateStats NsaAttentionImpl::StatsFromValues(int layer, const double* v) {
  LayerGateStats stats;
  stats.layer = layer;
  stats.mean = {v[0], v[1], v[2]};
  stats.stddev = {v[3], v[4], v[5]};
  stats.mean_selected_blocks = v[6];
  return stats;
}

LayerGateStats NsaAttentionImpl::last_stats(int layer) const {
  const auto t = last_stats_tensor();
  if (!t.defined()) {
    LayerGateStats stats;
    stats.layer = layer;
    return stats;
  }
  const auto s = t.to(torch::kCPU, torch::kDouble).contiguous();
  return StatsFromValues(layer, s.data_ptr<double>());
}

}  // namespace nsad::nsa
