// NsaAttention: one layer of DeepSeek Native Sparse Attention (arXiv 2502.11089) as a torch
// module. Three branches with their own keys and values -- compressed (cmp), selected (slc),
// sliding window (win) -- mixed per head by sigmoid gates computed from the layer input.
// The branch ops come from nsa/dispatch.h (reference or CUDA kernels). docs/NSA.md has the
// maths and the reasons behind the choices made here.
#pragma once

#include <torch/torch.h>

#include "nsa/compress.h"
#include "nsa/ops.h"
#include "nsa/part_chunks.h"
#include "nsa/rope.h"
#include "nsad/config.h"
#include "nsad/engine.h"

namespace nsad::nsa {

Geometry GeometryFrom(const NsaConfig& config);

class NsaAttentionImpl : public torch::nn::Module {
 public:
  // out_proj_std: init std of the output projection (scaled down for deep residual stacks).
  NsaAttentionImpl(const ModelConfig& config, AttentionBackend backend, double out_proj_std);

  // x [B,T,dim] (already normalised) -> [B,T,dim].
  torch::Tensor forward(const torch::Tensor& x);

  // Gate statistics of the most recent forward(): gates [B,T,H,3] (cmp, slc, win) and the
  // mean number of selected blocks per query. Syncs with the device; call sparingly.
  LayerGateStats last_stats(int layer) const;
  static LayerGateStats StatsFromValues(int layer, const double* v);
  // The gates [B,T,H,3] of the most recent forward(), detached (for tests and diagnostics),
  // and its selected blocks [B,T,G,n] int32: what the statistics reduce.
  const torch::Tensor& last_gates() const { return last_gates_; }
  const torch::Tensor& last_block_idx() const { return last_block_idx_; }

  // The weights of the layer's GEMMs (through SharedInputLinear), each GEMM's as its operand
  // stacks them: {q, kv, the gate MLP's first layer}, {the gate MLP's second} and {the output
  // projection}. What the model's 16-bit weight copies hold (model/weight_copies.h).
  std::vector<std::vector<torch::Tensor>> GemmWeights() const;

 private:
  // The three layers that read the layer input, as one GEMM: q, kv, the gate MLP's first.
  std::vector<torch::nn::Linear> InputProjections() const;
  // The gate MLP's first layer (dim -> hidden; its bias is added by GateHead) and second
  // (hidden -> 3 H gate logits).
  torch::nn::Linear GateHiddenLayer() const;
  torch::nn::Linear GateOutput() const;
  // last_stats' numbers as a [7] float32 tensor on the device (3 means, 3 stddevs, selected
  // blocks), undefined before the first forward(). (The model reads all layers at once through
  // nsa::GateStatsOfLayers.)
  torch::Tensor last_stats_tensor() const;
  // tokens [B,T,G,D] -> one vector per compression block [B,N,G,D].
  torch::Tensor Compress(const torch::Tensor& tokens, const torch::Tensor& position_encoding,
                         const torch::nn::Sequential& mlp) const;
  // The keys' and values' compressions [B,N,G,D], in one autograd node on the CUDA backend.
  std::vector<torch::Tensor> CompressKeysAndValues(const torch::Tensor& k_tokens,
                                                   const torch::Tensor& v_tokens) const;
  // The key and value compressors, as CompressBlocksTogether / CompressChunksTogether take them.
  std::vector<Compressor> Compressors() const;
  // Where the kv split hands the compression its two parts as chunks (CompressChunksTogether):
  // the CUDA backend, l a multiple of d and at least one block in seq_len; else none.
  PartChunks CompressionChunks(int64_t seq_len) const;
  // The rope tables for T tokens and for the compressed blocks of T tokens, on `device`,
  // computed on first use and kept while T, device and type stay the same (a training run
  // uses one sequence length, so this saves ~12 small launches per layer and step).
  struct RopeCache {
    int64_t seq_len = -1;
    torch::Device device = torch::kCPU;
    torch::ScalarType acc = torch::kFloat;
    RopeTable tokens, blocks;
  };
  const RopeCache& Rope(int64_t seq_len, const torch::Device& device, torch::ScalarType acc);

  Geometry geometry_;
  int64_t heads_, groups_, head_dim_;
  double rope_theta_;
  AttentionBackend backend_;

  torch::nn::Linear q_proj_{nullptr};
  // Keys and values of the three branches in one matmul: [k_cmp, v_cmp, k_slc, v_slc,
  // k_win, v_win], each G*D wide.
  torch::nn::Linear kv_proj_{nullptr};
  torch::nn::Linear o_proj_{nullptr};
  // Learnable intra-block position encodings [l, D] and the compression MLPs.
  torch::Tensor cmp_k_pos_, cmp_v_pos_;
  torch::nn::Sequential cmp_k_mlp_{nullptr}, cmp_v_mlp_{nullptr};
  torch::nn::Sequential gate_mlp_{nullptr};

  RopeCache rope_cache_;
  // Of the most recent forward(), detached; last_stats() reduces them when asked, so the
  // training path launches nothing for statistics.
  torch::Tensor last_gates_;      // [B,T,H,3]
  torch::Tensor last_block_idx_;  // [B,T,G,n] int32
};
TORCH_MODULE(NsaAttention);

}  // namespace nsad::nsa
