// Plain-LibTorch reference of the NSA branch ops (contract and semantics: ops.h).
//
// Every attention branch is written as the same thing: dense scaled-dot-product attention
// with a boolean "may attend" mask. Only the mask differs between branches, which keeps the
// oracle obviously right; the cost is O(T^2) memory for the selected and window branches,
// which is fine for the sequence lengths the reference is used at (tests, CPU runs, and a
// correctness fallback on the GPU).
#include <limits>

#include "nsa/ops.h"

namespace nsad::nsa {
namespace {

using torch::indexing::Slice;

// Attention of q [B,T,H,D] over k, v [B,S,G,D] where query (t, group g) may attend key s iff
// allowed[b,g,t,s]. allowed broadcasts as [B|1, G|1, T, S]. Rows with nothing allowed give a
// zero output and zero probabilities (never NaN, and a zero gradient).
// Returns out [B,T,H,D] and probs [B,T,H,S] (float32 or double, attached to the graph).
std::pair<torch::Tensor, torch::Tensor> MaskedAttention(const torch::Tensor& q,
                                                        const torch::Tensor& k,
                                                        const torch::Tensor& v,
                                                        const torch::Tensor& allowed) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t S = k.size(1), G = k.size(2);
  TORCH_CHECK(H % G == 0, "query heads (", H, ") must be a multiple of kv groups (", G, ")");
  const int64_t R = H / G;  // query heads per group: head h belongs to group h / R
  // Heads of one group sit next to each other, so viewing H as [G, R] puts them together
  // and the keys broadcast over R without being copied.
  const auto qg = q.view({B, T, G, R, D}).permute({0, 2, 3, 1, 4});     // [B,G,R,T,D]
  const auto kg = k.permute({0, 2, 1, 3}).unsqueeze(2);                  // [B,G,1,S,D]
  const auto vg = v.permute({0, 2, 1, 3}).unsqueeze(2);                  // [B,G,1,S,D]
  const auto mask = allowed.unsqueeze(2);                                // [B|1,G|1,1,T,S]
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  auto scores = torch::matmul(qg, kg.transpose(-1, -2)) * scale;         // [B,G,R,T,S]
  scores = scores.masked_fill(mask.logical_not(), -std::numeric_limits<double>::infinity());
  // A row with no allowed key would be all -inf and softmax would give NaN: give such rows
  // finite scores, then zero their probabilities below.
  const auto empty_row = mask.logical_not().all(-1, /*keepdim=*/true);
  scores = scores.masked_fill(empty_row, 0.0);
  // Softmax in float32 at least (bf16 inputs), in double for double inputs (tests).
  const auto acc = q.scalar_type() == torch::kDouble ? torch::kDouble : torch::kFloat;
  auto probs = torch::softmax(scores, -1, acc).masked_fill(empty_row, 0.0);
  auto out = torch::matmul(probs.to(v.scalar_type()), vg);                 // [B,G,R,T,D]
  out = out.permute({0, 3, 1, 2, 4}).reshape({B, T, H, D});
  probs = probs.permute({0, 3, 1, 2, 4}).reshape({B, T, H, S});
  return {out, probs};
}

torch::Tensor Positions(int64_t n, const torch::Device& device) {
  return torch::arange(n, torch::TensorOptions().dtype(torch::kLong).device(device));
}

void CheckActivation(const torch::Tensor& t, const char* name, int64_t dims) {
  TORCH_CHECK(t.dim() == dims, name, " must have ", dims, " dims, got ", t.sizes());
}

}  // namespace

CmpAttentionResult CompressedAttentionReference(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                                const torch::Tensor& v_cmp, const Geometry& g) {
  CheckActivation(q, "q", 4);
  CheckActivation(k_cmp, "k_cmp", 4);
  const int64_t T = q.size(1), N = k_cmp.size(1);
  TORCH_CHECK(N == NumCmpBlocks(T, g), "k_cmp has ", N, " blocks, expected ",
              NumCmpBlocks(T, g), " for ", T, " tokens");
  // Block j ends at token j*d + l - 1; query t sees it once that token is in its past.
  const auto t = Positions(T, q.device()).unsqueeze(1);                      // [T,1]
  const auto block_end = Positions(N, q.device()) * g.cmp_stride + (g.cmp_block - 1);  // [N]
  const auto allowed = (block_end.unsqueeze(0) <= t).view({1, 1, T, N});
  auto [out, probs] = MaskedAttention(q, k_cmp, v_cmp, allowed);
  return {out, probs.detach().to(torch::kFloat)};
}

torch::Tensor ImportanceReference(const torch::Tensor& probs, int64_t num_groups, const Geometry& g) {
  CheckActivation(probs, "probs", 4);
  const int64_t B = probs.size(0), T = probs.size(1), H = probs.size(2), N = probs.size(3);
  const int64_t G = num_groups, lp = g.slc_block;
  TORCH_CHECK(H % G == 0, "heads (", H, ") must be a multiple of groups (", G, ")");
  TORCH_CHECK(N == NumCmpBlocks(T, g), "probs has ", N, " compressed blocks, expected ",
              NumCmpBlocks(T, g));
  const int64_t NS = NumSlcBlocks(T, g);
  const auto dev = probs.device();
  // Double precision: importance is a sum of many small products, and ranking must not
  // depend on summation order (the naive loop and the kernels sum in other orders).
  const auto dbl = torch::TensorOptions().dtype(torch::kDouble).device(dev);

  // overlap[j, b] = |[j*d, j*d+l) ∩ [b*l', (b+1)*l')|, the tokens cmp block j shares with
  // selection block b.
  const auto cmp_start = (Positions(N, dev) * g.cmp_stride).to(torch::kDouble).unsqueeze(1);
  const auto slc_start = (Positions(NS, dev) * lp).to(torch::kDouble).unsqueeze(0);
  const auto overlap = (torch::minimum(cmp_start + g.cmp_block, slc_start + lp) -
                        torch::maximum(cmp_start, slc_start))
                           .clamp_min(0.0);                                    // [N,NS]

  const auto group_probs = probs.detach().to(dbl).view({B, T, G, H / G, N}).sum(3);  // [B,T,G,N]
  return torch::matmul(group_probs, overlap);                                 // [B,T,G,NS]
}

torch::Tensor SelectBlocksReference(const torch::Tensor& probs, int64_t num_groups,
                                    int64_t seq_len, const Geometry& g) {
  CheckActivation(probs, "probs", 4);
  const int64_t B = probs.size(0), T = probs.size(1);
  const int64_t G = num_groups, n = g.top_n, lp = g.slc_block;
  TORCH_CHECK(T == seq_len, "probs has ", T, " positions, seq_len is ", seq_len);
  // Block 0, the current block and the one before it are always chosen, so n must hold them.
  TORCH_CHECK(n >= 3, "top_n must be at least 3 (first block + two local blocks), got ", n);
  const int64_t NS = NumSlcBlocks(T, g);
  const auto dev = probs.device();
  auto importance = ImportanceReference(probs, num_groups, g);  // [B,T,G,NS]

  const auto t = Positions(T, dev).view({1, T, 1, 1});
  const auto b = Positions(NS, dev).view({1, 1, 1, NS});
  const auto current = torch::div(t, lp, "floor");
  const auto eligible = (b * lp <= t).expand({B, T, G, NS});
  const auto forced = (b == 0) | (b == current) | (b == current - 1);
  const double inf = std::numeric_limits<double>::infinity();
  importance = importance.masked_fill(forced, inf).masked_fill(eligible.logical_not(), -inf);

  // A stable descending sort keeps equal scores in index order: ties go to the lower block.
  const auto order = std::get<1>(importance.sort(/*stable=*/true, /*dim=*/-1, /*descending=*/true));
  const int64_t take = std::min(n, NS);
  auto chosen = order.index({Slice(), Slice(), Slice(), Slice(0, take)});
  const auto chosen_ok = eligible.gather(-1, chosen);
  // Ascending order with unused slots (-1) last: park them at NS while sorting.
  chosen = std::get<0>(chosen.masked_fill(chosen_ok.logical_not(), NS).sort(-1));
  chosen = chosen.masked_fill(chosen == NS, -1);
  if (take < n) {
    chosen = torch::cat({chosen, torch::full({B, T, G, n - take}, -1, chosen.options())}, -1);
  }
  return chosen.to(torch::kInt).contiguous();
}

torch::Tensor SelectedAttentionReference(const torch::Tensor& q, const torch::Tensor& k,
                                         const torch::Tensor& v, const torch::Tensor& block_idx,
                                         const Geometry& g) {
  CheckActivation(q, "q", 4);
  CheckActivation(k, "k", 4);
  CheckActivation(block_idx, "block_idx", 4);
  const int64_t B = q.size(0), T = q.size(1), G = k.size(2);
  const int64_t NS = NumSlcBlocks(T, g);
  TORCH_CHECK(block_idx.size(0) == B && block_idx.size(1) == T && block_idx.size(2) == G,
              "block_idx must be [B,T,G,n], got ", block_idx.sizes());
  // chosen[b,g,t,blk]: query t of group g selected selection block blk. Unused slots (-1)
  // are routed to an extra column NS that is dropped afterwards.
  const auto idx = block_idx.to(torch::kLong);
  const auto slots = idx.masked_fill(idx < 0, NS);
  auto chosen = torch::zeros({B, T, G, NS + 1}, q.options().dtype(torch::kBool));
  chosen.scatter_(-1, slots, true);
  chosen = chosen.index({Slice(), Slice(), Slice(), Slice(0, NS)}).permute({0, 2, 1, 3});
  // Token s belongs to selection block s / l'.
  const auto key_block = torch::div(Positions(T, q.device()), g.slc_block, "floor");
  const auto key_chosen = chosen.index_select(-1, key_block);               // [B,G,T,T]
  const auto pos = Positions(T, q.device());
  const auto causal = (pos.unsqueeze(0) <= pos.unsqueeze(1)).view({1, 1, T, T});
  return MaskedAttention(q, k, v, key_chosen & causal).first;
}

torch::Tensor SlidingWindowAttentionReference(const torch::Tensor& q, const torch::Tensor& k,
                                              const torch::Tensor& v, const Geometry& g) {
  CheckActivation(q, "q", 4);
  CheckActivation(k, "k", 4);
  const int64_t T = q.size(1);
  const auto pos = Positions(T, q.device());
  const auto t = pos.unsqueeze(1), s = pos.unsqueeze(0);
  const auto allowed = ((s <= t) & (s > t - g.window)).view({1, 1, T, T});
  return MaskedAttention(q, k, v, allowed).first;
}

}  // namespace nsad::nsa
