// Per-token loops over the NSA ops: for every batch row, query position and head, list the
// key positions the query may see, then softmax-attend over exactly those keys.
#include "nsa/naive.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace nsad::nsa::naive {
namespace {

torch::Tensor AsIndex(const std::vector<int64_t>& positions) {
  return torch::tensor(positions, torch::kLong);
}

// One query vector [D] over keys/values [S,D]: (output [D], probabilities [S]).
std::pair<torch::Tensor, torch::Tensor> AttendOne(const torch::Tensor& query,
                                                  const torch::Tensor& keys,
                                                  const torch::Tensor& values) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(query.size(0)));
  const auto scores = torch::mv(keys, query) * scale;
  const auto probs = torch::softmax(scores.to(torch::kDouble), 0).to(values.scalar_type());
  return {torch::mv(values.t(), probs), probs};
}

// Calls visible(b, t, h) for the key positions of each query and attends over them.
// Queries that see nothing get zeros.
template <typename VisibleFn>
torch::Tensor AttendEachQuery(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, VisibleFn visible,
                              torch::Tensor* probs_out = nullptr) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t heads_per_group = H / k.size(2);
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t group = h / heads_per_group;
        const std::vector<int64_t> keys_seen = visible(b, t, h);
        if (keys_seen.empty()) {
          rows.push_back(torch::zeros({D}, q.options()));
          continue;
        }
        const auto idx = AsIndex(keys_seen);
        auto [out, probs] = AttendOne(q[b][t][h], k[b].index_select(0, idx).select(1, group),
                                      v[b].index_select(0, idx).select(1, group));
        rows.push_back(out);
        if (probs_out) probs_out->index_put_({b, t, h, idx}, probs.detach().to(torch::kFloat));
      }
    }
  }
  return torch::stack(rows).view({B, T, H, D});
}

// Tokens shared by compression block j and selection block b.
int64_t Overlap(int64_t j, int64_t b, const Geometry& g) {
  const int64_t lo = std::max(j * g.cmp_stride, b * g.slc_block);
  const int64_t hi = std::min(j * g.cmp_stride + g.cmp_block, (b + 1) * g.slc_block);
  return std::max<int64_t>(0, hi - lo);
}

bool CmpBlockVisible(int64_t j, int64_t t, const Geometry& g) {
  return j * g.cmp_stride + g.cmp_block - 1 <= t;
}

}  // namespace

CmpAttentionResult CompressedAttention(const torch::Tensor& q, const torch::Tensor& k_cmp,
                                       const torch::Tensor& v_cmp, const Geometry& g) {
  const int64_t N = k_cmp.size(1);
  auto probs = torch::zeros({q.size(0), q.size(1), q.size(2), N}, torch::kFloat);
  auto out = AttendEachQuery(
      q, k_cmp, v_cmp,
      [&](int64_t, int64_t t, int64_t) {
        std::vector<int64_t> blocks;
        for (int64_t j = 0; j < N; ++j) {
          if (CmpBlockVisible(j, t, g)) blocks.push_back(j);
        }
        return blocks;
      },
      &probs);
  return {out, probs};
}

torch::Tensor SelectBlocks(const torch::Tensor& probs, int64_t num_groups, int64_t seq_len,
                           const Geometry& g) {
  const int64_t B = probs.size(0), T = seq_len, H = probs.size(2), N = probs.size(3);
  const int64_t heads_per_group = H / num_groups;
  const int64_t NS = NumSlcBlocks(T, g);
  const auto p = probs.to(torch::kFloat).contiguous();
  const auto pa = p.accessor<float, 4>();
  auto result = torch::full({B, T, num_groups, g.top_n}, -1, torch::kInt);
  auto ra = result.accessor<int32_t, 4>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t grp = 0; grp < num_groups; ++grp) {
        const int64_t current = t / g.slc_block;
        std::vector<double> importance(NS, 0.0);
        for (int64_t blk = 0; blk <= current; ++blk) {
          for (int64_t h = grp * heads_per_group; h < (grp + 1) * heads_per_group; ++h) {
            for (int64_t j = 0; j < N; ++j) {
              if (CmpBlockVisible(j, t, g)) importance[blk] += pa[b][t][h][j] * Overlap(j, blk, g);
            }
          }
        }
        std::vector<int64_t> chosen = {0};
        if (current >= 1) chosen.push_back(current);
        if (current >= 2) chosen.push_back(current - 1);
        std::vector<bool> taken(NS, false);
        for (int64_t blk : chosen) taken[blk] = true;
        while (static_cast<int64_t>(chosen.size()) < g.top_n) {
          int64_t best = -1;
          for (int64_t blk = 0; blk <= current; ++blk) {  // ascending: ties keep the lower
            if (!taken[blk] && (best < 0 || importance[blk] > importance[best])) best = blk;
          }
          if (best < 0) break;
          taken[best] = true;
          chosen.push_back(best);
        }
        std::sort(chosen.begin(), chosen.end());
        for (size_t i = 0; i < chosen.size(); ++i) ra[b][t][grp][i] = chosen[i];
      }
    }
  }
  return result;
}

torch::Tensor SelectedAttention(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& block_idx,
                                const Geometry& g) {
  const int64_t heads_per_group = q.size(2) / k.size(2);
  const auto idx = block_idx.to(torch::kInt).contiguous();
  const auto ia = idx.accessor<int32_t, 4>();
  return AttendEachQuery(q, k, v, [&](int64_t b, int64_t t, int64_t h) {
    std::vector<int64_t> keys;
    for (int64_t slot = 0; slot < idx.size(3); ++slot) {
      const int64_t blk = ia[b][t][h / heads_per_group][slot];
      if (blk < 0) continue;
      for (int64_t s = blk * g.slc_block; s < (blk + 1) * g.slc_block; ++s) {
        if (s <= t) keys.push_back(s);
      }
    }
    std::sort(keys.begin(), keys.end());
    return keys;
  });
}

torch::Tensor SlidingWindowAttention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const Geometry& g) {
  return AttendEachQuery(q, k, v, [&](int64_t, int64_t t, int64_t) {
    std::vector<int64_t> keys;
    for (int64_t s = std::max<int64_t>(0, t - g.window + 1); s <= t; ++s) keys.push_back(s);
    return keys;
  });
}

}  // namespace nsad::nsa::naive
