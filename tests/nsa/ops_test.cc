// The vectorised reference ops (reference.cc) against the per-token loops (naive.cc), plus
// limits, causality, empty-row and gradient checks. Double precision on CPU throughout, so
// tolerances can be tight.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "nsa/naive.h"
#include "nsa/ops.h"
#include "test_util.h"

namespace nsad::nsa {
namespace {

using testing::AllFinite;
using testing::Grads;
using testing::Leaf;
using testing::MaxDiff;
using torch::indexing::Slice;

constexpr double kTol = 1e-10;

Geometry SmallGeometry() {  // top-n binds at a few dozen tokens already
  Geometry g;
  g.cmp_block = 8;
  g.cmp_stride = 4;
  g.slc_block = 16;
  g.top_n = 3;
  g.window = 24;
  return g;
}

struct Shape {
  int64_t B, T, H, G, D;
};

struct OpInputs {
  torch::Tensor q, k, v, k_cmp, v_cmp;
};

OpInputs RandomInputs(const Shape& s, const Geometry& g) {
  const int64_t N = NumCmpBlocks(s.T, g);
  return {Leaf({s.B, s.T, s.H, s.D}), Leaf({s.B, s.T, s.G, s.D}), Leaf({s.B, s.T, s.G, s.D}),
          Leaf({s.B, N, s.G, s.D}), Leaf({s.B, N, s.G, s.D})};
}

// Runs all four ops with both implementations and compares values and gradients.
void CompareNaiveAndReference(const Shape& s, const Geometry& g, uint64_t seed) {
  torch::manual_seed(seed);
  const auto in = RandomInputs(s, g);
  const auto w = torch::randn({s.B, s.T, s.H, s.D}, torch::kDouble);  // upstream gradient

  // Compressed attention: outputs, probabilities, gradients.
  const auto ref_cmp = CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g);
  const auto naive_cmp = naive::CompressedAttention(in.q, in.k_cmp, in.v_cmp, g);
  EXPECT_EQ(ref_cmp.probs.scalar_type(), torch::kFloat);
  EXPECT_FALSE(ref_cmp.probs.requires_grad());
  EXPECT_LT(MaxDiff(ref_cmp.out, naive_cmp.out), kTol) << "cmp out";
  EXPECT_LT(MaxDiff(ref_cmp.probs, naive_cmp.probs), 1e-6) << "cmp probs";
  {
    const std::vector<torch::Tensor> wrt = {in.q, in.k_cmp, in.v_cmp};
    const auto ref_g = Grads(ref_cmp.out, w, wrt);
    const auto naive_g = Grads(naive_cmp.out, w, wrt);
    for (size_t i = 0; i < wrt.size(); ++i) {
      EXPECT_LT(MaxDiff(ref_g[i], naive_g[i]), kTol) << "cmp grad " << i;
      EXPECT_TRUE(AllFinite(ref_g[i]));
    }
  }

  // Selection: identical indices from identical probabilities.
  const auto ref_idx = SelectBlocksReference(ref_cmp.probs, s.G, s.T, g);
  const auto naive_idx = naive::SelectBlocks(ref_cmp.probs, s.G, s.T, g);
  ASSERT_EQ(ref_idx.sizes(), (std::vector<int64_t>{s.B, s.T, s.G, g.top_n}));
  EXPECT_EQ(ref_idx.scalar_type(), torch::kInt);
  EXPECT_TRUE(torch::equal(ref_idx, naive_idx)) << "selection differs";

  // Selected and sliding-window attention.
  const std::vector<torch::Tensor> wrt = {in.q, in.k, in.v};
  const auto ref_slc = SelectedAttentionReference(in.q, in.k, in.v, ref_idx, g);
  const auto naive_slc = naive::SelectedAttention(in.q, in.k, in.v, ref_idx, g);
  EXPECT_LT(MaxDiff(ref_slc, naive_slc), kTol) << "slc out";
  const auto ref_win = SlidingWindowAttentionReference(in.q, in.k, in.v, g);
  const auto naive_win = naive::SlidingWindowAttention(in.q, in.k, in.v, g);
  EXPECT_LT(MaxDiff(ref_win, naive_win), kTol) << "win out";
  for (const auto& [ref, nv, name] : {std::tuple{ref_slc, naive_slc, "slc"},
                                      std::tuple{ref_win, naive_win, "win"}}) {
    const auto ref_g = Grads(ref, w, wrt);
    const auto naive_g = Grads(nv, w, wrt);
    for (size_t i = 0; i < wrt.size(); ++i) {
      EXPECT_LT(MaxDiff(ref_g[i], naive_g[i]), kTol) << name << " grad " << i;
    }
  }
}

// --- Naive vs reference at the lengths of the issue, default geometry ----------------------

class NaiveVsReference : public ::testing::TestWithParam<int64_t> {};

TEST_P(NaiveVsReference, DefaultGeometry) {
  const int64_t T = GetParam();
  const int64_t B = T <= 127 ? 3 : (T <= 513 ? 2 : 1);  // several batch sizes, bounded cost
  CompareNaiveAndReference({B, T, /*H=*/4, /*G=*/2, /*D=*/8}, Geometry{}, 1000 + T);
}

INSTANTIATE_TEST_SUITE_P(Lengths, NaiveVsReference,
                         ::testing::Values(1, 31, 32, 33, 63, 64, 65, 127, 511, 512, 513, 1000,
                                           2048));

// Small blocks: top-n binds after a few dozen tokens, 3 query heads per group.
class NaiveVsReferenceSmall : public ::testing::TestWithParam<int64_t> {};

TEST_P(NaiveVsReferenceSmall, TopNBinds) {
  const int64_t T = GetParam();
  CompareNaiveAndReference({2, T, /*H=*/6, /*G=*/2, /*D=*/4}, SmallGeometry(), 7 + T);
}

INSTANTIATE_TEST_SUITE_P(Lengths, NaiveVsReferenceSmall,
                         ::testing::Values(1, 7, 8, 9, 15, 16, 17, 23, 24, 25, 48, 100, 203));

// --- Selection rules ---------------------------------------------------------------------

TEST(SelectBlocks, StructuralRulesHoldForRandomProbabilities) {
  const Geometry g;  // l'=64, n=16: 2048 tokens have 32 selection blocks
  const int64_t T = 2048, H = 4, G = 2, N = NumCmpBlocks(T, g);
  torch::manual_seed(3);
  const auto probs = torch::rand({2, T, H, N});
  const auto idx = SelectBlocksReference(probs, G, T, g);
  const auto a = idx.accessor<int32_t, 4>();
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t t = 0; t < T; t += 37) {
      for (int64_t grp = 0; grp < G; ++grp) {
        const int64_t current = t / g.slc_block;
        std::vector<int64_t> row;
        for (int64_t i = 0; i < g.top_n; ++i) row.push_back(a[b][t][grp][i]);
        const auto used = std::count_if(row.begin(), row.end(), [](int64_t x) { return x >= 0; });
        ASSERT_EQ(used, std::min<int64_t>(g.top_n, current + 1)) << "t=" << t;
        for (int64_t i = used; i < g.top_n; ++i) EXPECT_EQ(row[i], -1);  // -1 only at the end
        EXPECT_TRUE(std::is_sorted(row.begin(), row.begin() + used));
        EXPECT_EQ(std::adjacent_find(row.begin(), row.begin() + used), row.begin() + used);
        EXPECT_EQ(row[0], 0);
        EXPECT_EQ(row[used - 1], current) << "current block always chosen";
        if (current >= 1) EXPECT_EQ(row[used - 2], current - 1) << "previous block chosen";
      }
    }
  }
}

TEST(SelectBlocks, TiesGoToLowerBlocks) {
  // All-zero probabilities: every optional block ties at importance 0.
  Geometry g = SmallGeometry();
  g.top_n = 5;
  const int64_t T = 120;
  const auto probs = torch::zeros({1, T, 2, NumCmpBlocks(T, g)});
  for (const auto& idx : {SelectBlocksReference(probs, 1, T, g), naive::SelectBlocks(probs, 1, T, g)}) {
    // t=100: current block 6, previous 5, first 0; free slots go to 1 and 2.
    EXPECT_TRUE(torch::equal(idx[0][100][0], torch::tensor({0, 1, 2, 5, 6}, torch::kInt)));
    // t=20: blocks 0 and 1 exist only; the rest unused.
    EXPECT_TRUE(torch::equal(idx[0][20][0], torch::tensor({0, 1, -1, -1, -1}, torch::kInt)));
  }
}

TEST(SelectBlocks, ImportanceFollowsBlockOverlapAndGroupSum) {
  // Default blocks (l=32, d=16, l'=64), T=320: selection blocks 0..4. The last query
  // (t=319) always gets 0, 3 and 4; with n=4 one free slot goes to block 1 or block 2.
  Geometry g;
  g.top_n = 4;
  const int64_t T = 320, t = T - 1, N = NumCmpBlocks(T, g);
  auto probs = torch::zeros({1, T, 2, N});
  auto chosen = [&](int64_t groups, int64_t group) {
    return SelectBlocksReference(probs, groups, T, g)[0][t][group];
  };
  const auto with_1 = torch::tensor({0, 1, 3, 4}, torch::kInt);
  const auto with_2 = torch::tensor({0, 2, 3, 4}, torch::kInt);
  // cmp block 8 = tokens [128,160) lies in selection block 2, cmp block 5 = [80,112) in 1.
  probs[0][t][0][8] = 0.6;
  probs[0][t][1][5] = 0.7;
  EXPECT_TRUE(torch::equal(chosen(1, 0), with_1));  // one group: 0.7 beats 0.6
  EXPECT_TRUE(torch::equal(chosen(2, 0), with_2));  // two groups: each head decides alone
  EXPECT_TRUE(torch::equal(chosen(2, 1), with_1));
  probs[0][t][1][8] = 0.3;  // the group sums its heads: 0.6 + 0.3 on block 2 beats 0.7
  EXPECT_TRUE(torch::equal(chosen(1, 0), with_2));
  // cmp block 7 = [112,144) straddles blocks 1 and 2 (16 tokens each): a tie, and ties go
  // to the lower block...
  probs.zero_();
  probs[0][t][0][7] = 1.0;
  EXPECT_TRUE(torch::equal(chosen(1, 0), with_1));
  // ...and it counts 16 tokens, not 32, towards block 1: 16 + 0.05 * 32 for block 2 wins.
  probs[0][t][0][10] = 0.05;  // [160,192), inside block 2
  EXPECT_TRUE(torch::equal(chosen(1, 0), with_2));
}

// --- Limits: everything selected and a window covering the sequence = dense attention ------

torch::Tensor DenseCausal(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t R = q.size(2) / k.size(2);
  // BTHD -> BHTD for SDPA, keys shared by the R heads of a group.
  const auto out = at::scaled_dot_product_attention(
      q.transpose(1, 2), k.repeat_interleave(R, 2).transpose(1, 2),
      v.repeat_interleave(R, 2).transpose(1, 2), /*attn_mask=*/{}, /*dropout_p=*/0.0,
      /*is_causal=*/true);
  return out.transpose(1, 2);
}

class DenseLimit : public ::testing::TestWithParam<int64_t> {};

TEST_P(DenseLimit, SelectedAndWindowEqualCausalAttention) {
  const int64_t T = GetParam();
  Geometry g;
  g.top_n = std::max<int64_t>(3, NumSlcBlocks(T, g));
  g.window = T;
  torch::manual_seed(T);
  const auto in = RandomInputs({2, T, 4, 2, 16}, g);
  const auto probs = CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g).probs;
  const auto idx = SelectBlocksReference(probs, 2, T, g);
  const auto dense = DenseCausal(in.q, in.k, in.v);
  const auto w = torch::randn_like(dense);
  const std::vector<torch::Tensor> wrt = {in.q, in.k, in.v};
  const auto dense_g = Grads(dense, w, wrt);
  for (const auto& out : {SelectedAttentionReference(in.q, in.k, in.v, idx, g),
                          SlidingWindowAttentionReference(in.q, in.k, in.v, g)}) {
    EXPECT_LT(MaxDiff(out, dense), kTol);
    const auto got = Grads(out, w, wrt);
    for (size_t i = 0; i < wrt.size(); ++i) EXPECT_LT(MaxDiff(got[i], dense_g[i]), kTol);
  }
}

INSTANTIATE_TEST_SUITE_P(Lengths, DenseLimit, ::testing::Values(1, 33, 64, 65, 200, 513));

// A window smaller than the sequence must differ from dense attention (the limit test above
// would also pass if the window were ignored).
TEST(SlidingWindow, NarrowWindowIsNotDense) {
  Geometry g;
  g.window = 16;
  torch::manual_seed(5);
  const auto in = RandomInputs({1, 64, 2, 1, 8}, g);
  const auto out = SlidingWindowAttentionReference(in.q, in.k, in.v, g);
  const auto dense = DenseCausal(in.q, in.k, in.v);
  EXPECT_LT(MaxDiff(out.index({Slice(), Slice(0, 16)}), dense.index({Slice(), Slice(0, 16)})),
            kTol);
  EXPECT_GT(MaxDiff(out.index({Slice(), Slice(16)}), dense.index({Slice(), Slice(16)})), 1e-3);
}

// --- Causality of each op ----------------------------------------------------------------

TEST(Causality, FutureKeysNeverChangeEarlierOutputs) {
  const Geometry g = SmallGeometry();
  const int64_t T = 90;
  torch::manual_seed(11);
  const auto in = RandomInputs({2, T, 4, 2, 8}, g);
  for (int64_t p : {0, 17, 40, 63, 89}) {
    torch::NoGradGuard no_grad;
    auto k2 = in.k.clone(), v2 = in.v.clone(), kc2 = in.k_cmp.clone(), vc2 = in.v_cmp.clone();
    k2.index_put_({Slice(), Slice(p)}, torch::randn_like(k2.index({Slice(), Slice(p)})));
    v2.index_put_({Slice(), Slice(p)}, torch::randn_like(v2.index({Slice(), Slice(p)})));
    // Compressed blocks that contain token p or later ones: j*d + l - 1 >= p.
    const int64_t first_cmp = std::max<int64_t>(0, (p - g.cmp_block + 1 + g.cmp_stride - 1) / g.cmp_stride);
    kc2.index_put_({Slice(), Slice(first_cmp)}, torch::randn_like(kc2.index({Slice(), Slice(first_cmp)})));
    vc2.index_put_({Slice(), Slice(first_cmp)}, torch::randn_like(vc2.index({Slice(), Slice(first_cmp)})));
    const auto before = Slice(0, p);
    const auto cmp1 = CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g);
    const auto cmp2 = CompressedAttentionReference(in.q, kc2, vc2, g);
    EXPECT_EQ(MaxDiff(cmp1.out.index({Slice(), before}), cmp2.out.index({Slice(), before})), 0.0);
    const auto idx1 = SelectBlocksReference(cmp1.probs, 2, T, g);
    const auto idx2 = SelectBlocksReference(cmp2.probs, 2, T, g);
    EXPECT_TRUE(torch::equal(idx1.index({Slice(), before}), idx2.index({Slice(), before})));
    const auto s1 = SelectedAttentionReference(in.q, in.k, in.v, idx1, g);
    const auto s2 = SelectedAttentionReference(in.q, k2, v2, idx2, g);
    EXPECT_EQ(MaxDiff(s1.index({Slice(), before}), s2.index({Slice(), before})), 0.0);
    const auto w1 = SlidingWindowAttentionReference(in.q, in.k, in.v, g);
    const auto w2 = SlidingWindowAttentionReference(in.q, k2, v2, g);
    EXPECT_EQ(MaxDiff(w1.index({Slice(), before}), w2.index({Slice(), before})), 0.0);
    // ...while the outputs from p on do change (the test is not vacuous).
    EXPECT_GT(MaxDiff(w1.index({Slice(), Slice(p)}), w2.index({Slice(), Slice(p)})), 1e-6);
    EXPECT_GT(MaxDiff(s1.index({Slice(), Slice(p)}), s2.index({Slice(), Slice(p)})), 1e-6);
  }
}

// --- Queries with no visible compressed block ----------------------------------------------

TEST(CompressedAttention, QueriesWithoutBlocksGetZerosNotNaN) {
  const Geometry g;  // the first block is visible from t = 31 on
  torch::manual_seed(2);
  const auto in = RandomInputs({2, 60, 4, 2, 8}, g);
  const auto cmp = CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g);
  EXPECT_TRUE(AllFinite(cmp.out));
  EXPECT_EQ(cmp.out.index({Slice(), Slice(0, 31)}).abs().max().item<double>(), 0.0);
  EXPECT_EQ(cmp.probs.index({Slice(), Slice(0, 31)}).abs().max().item<double>(), 0.0);
  EXPECT_GT(cmp.out.index({Slice(), Slice(31)}).abs().max().item<double>(), 0.0);
  // t=31 and t=46 see only block 0 (probability 1); t=47 sees blocks 0 and 1.
  EXPECT_DOUBLE_EQ(cmp.probs[0][46][0][0].item<double>(), 1.0);
  EXPECT_NEAR(cmp.probs[0][47][0].sum().item<double>(), 1.0, 1e-6);
  EXPECT_GT(cmp.probs[0][47][0][1].item<double>(), 0.0);
  const auto grads = Grads(cmp.out, torch::ones_like(cmp.out), {in.q, in.k_cmp, in.v_cmp});
  for (const auto& gr : grads) EXPECT_TRUE(AllFinite(gr));
  EXPECT_EQ(grads[0].index({Slice(), Slice(0, 31)}).abs().max().item<double>(), 0.0);
  // No block at all (T < l): empty inputs, zero output.
  const auto tiny = RandomInputs({1, 5, 4, 2, 8}, g);
  const auto none = CompressedAttentionReference(tiny.q, tiny.k_cmp, tiny.v_cmp, g);
  EXPECT_EQ(none.probs.size(3), 0);
  EXPECT_EQ(none.out.abs().max().item<double>(), 0.0);
}

// --- Finite-difference gradient check in double ------------------------------------------

TEST(Gradcheck, AttentionOpsMatchFiniteDifferences) {
  const Geometry g = SmallGeometry();
  torch::manual_seed(13);
  const Shape s{1, 40, 2, 1, 4};
  const auto in = RandomInputs(s, g);
  const auto w = torch::randn({s.B, s.T, s.H, s.D}, torch::kDouble);
  const auto idx = SelectBlocksReference(
      CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g).probs, s.G, s.T, g);
  testing::ExpectGradcheck(
      [&] { return (CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g).out * w).sum(); },
      {in.q, in.k_cmp, in.v_cmp});
  testing::ExpectGradcheck(
      [&] { return (SelectedAttentionReference(in.q, in.k, in.v, idx, g) * w).sum(); },
      {in.q, in.k, in.v});
  testing::ExpectGradcheck(
      [&] { return (SlidingWindowAttentionReference(in.q, in.k, in.v, g) * w).sum(); },
      {in.q, in.k, in.v});
}

// --- Reduced precision -------------------------------------------------------------------

TEST(ReducedPrecision, Bf16ReferenceTracksFloat32) {
  const Geometry g = SmallGeometry();
  torch::manual_seed(17);
  const auto in = RandomInputs({2, 100, 4, 2, 16}, g);
  auto bf = [](const torch::Tensor& t) { return t.detach().to(torch::kBFloat16); };
  auto f32 = [](const torch::Tensor& t) { return t.detach().to(torch::kFloat); };
  const auto cmp_bf = CompressedAttentionReference(bf(in.q), bf(in.k_cmp), bf(in.v_cmp), g);
  const auto cmp_f = CompressedAttentionReference(f32(in.q), f32(in.k_cmp), f32(in.v_cmp), g);
  EXPECT_EQ(cmp_bf.out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(cmp_bf.probs.scalar_type(), torch::kFloat);
  EXPECT_LT(MaxDiff(cmp_bf.out, cmp_f.out), 0.1);
  const auto idx = SelectBlocksReference(cmp_f.probs, 2, 100, g);
  EXPECT_LT(MaxDiff(SelectedAttentionReference(bf(in.q), bf(in.k), bf(in.v), idx, g),
                    SelectedAttentionReference(f32(in.q), f32(in.k), f32(in.v), idx, g)),
            0.1);
  EXPECT_LT(MaxDiff(SlidingWindowAttentionReference(bf(in.q), bf(in.k), bf(in.v), g),
                    SlidingWindowAttentionReference(f32(in.q), f32(in.k), f32(in.v), g)),
            0.1);
}

// --- Speed sanity: the reference must stay usable at 2048 tokens on CPU --------------------

TEST(ReferenceSpeed, Seq2048ForwardBackwardIsQuick) {
  const Geometry g;
  torch::manual_seed(19);
  const Shape s{1, 2048, 4, 2, 32};
  OpInputs in;
  {
    const int64_t N = NumCmpBlocks(s.T, g);
    auto f = torch::kFloat;
    in = {Leaf({s.B, s.T, s.H, s.D}, f), Leaf({s.B, s.T, s.G, s.D}, f),
          Leaf({s.B, s.T, s.G, s.D}, f), Leaf({s.B, N, s.G, s.D}, f), Leaf({s.B, N, s.G, s.D}, f)};
  }
  const auto start = std::chrono::steady_clock::now();
  const auto cmp = CompressedAttentionReference(in.q, in.k_cmp, in.v_cmp, g);
  const auto idx = SelectBlocksReference(cmp.probs, s.G, s.T, g);
  const auto out = cmp.out + SelectedAttentionReference(in.q, in.k, in.v, idx, g) +
                   SlidingWindowAttentionReference(in.q, in.k, in.v, g);
  out.sum().backward();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::cout << "reference fwd+bwd, 4 heads, T=2048: " << seconds << " s\n";
  EXPECT_LT(seconds, 20.0);
  EXPECT_TRUE(AllFinite(in.q.grad()));
}

}  // namespace
}  // namespace nsad::nsa
