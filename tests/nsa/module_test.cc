// NsaAttention as a module: causality, gate initialisation, gradients, statistics, backend
// handling. Small shapes on CPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include "model/transformer.h"
#include "nsa/attention.h"
#include "test_util.h"

namespace nsad::nsa {
namespace {

using testing::MaxDiff;
using torch::indexing::Slice;

ModelConfig SmallConfig() {
  ModelConfig c;
  c.vocab_size = 32;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_groups = 2;
  c.head_dim = 8;
  c.nsa = {/*cmp_block=*/8, /*cmp_stride=*/4, /*slc_block=*/16, /*slc_top_n=*/3, /*window=*/24};
  return c;
}

TEST(NsaAttention, FutureInputsNeverChangeEarlierOutputs) {
  torch::manual_seed(1);
  NsaAttention attn(SmallConfig(), AttentionBackend::kReference, 0.02);
  attn->to(torch::kDouble);
  const auto x = torch::randn({2, 120, 32}, torch::kDouble);
  torch::NoGradGuard no_grad;
  const auto out = attn->forward(x);
  for (int64_t p : {0, 9, 50, 77, 119}) {
    auto x2 = x.clone();
    x2.index_put_({Slice(), p}, torch::randn({2, 32}, torch::kDouble));
    const auto out2 = attn->forward(x2);
    EXPECT_LT(MaxDiff(out.index({Slice(), Slice(0, p)}), out2.index({Slice(), Slice(0, p)})),
              1e-12) << "p=" << p;
    EXPECT_GT(MaxDiff(out.index({Slice(), p}), out2.index({Slice(), p})), 1e-6) << "p=" << p;
  }
}

TEST(NsaTransformer, FutureTokensNeverChangeEarlierLogits) {
  torch::manual_seed(2);
  NsaTransformer model(SmallConfig(), AttentionBackend::kReference);
  model->to(torch::kDouble);
  const auto tokens = torch::randint(32, {2, 100}, torch::kLong);
  torch::NoGradGuard no_grad;
  const auto logits = model->forward(tokens);
  EXPECT_EQ(logits.sizes(), (std::vector<int64_t>{2, 100, 32}));
  for (int64_t p : {3, 40, 99}) {
    auto changed = tokens.clone();
    changed.index_put_({Slice(), p}, (tokens.index({Slice(), p}) + 1) % 32);
    const auto logits2 = model->forward(changed);
    EXPECT_LT(MaxDiff(logits.index({Slice(), Slice(0, p)}), logits2.index({Slice(), Slice(0, p)})),
              1e-12);
    EXPECT_GT(MaxDiff(logits.index({Slice(), p}), logits2.index({Slice(), p})), 1e-8);
  }
}

// Catches the zero-init gate class of bug: gates must start near 0.5 for every branch, vary
// with the input, and pass gradient into every gate parameter.
TEST(NsaAttention, GatesStartOpenAndDependOnTheInput) {
  for (int dim : {32, 768}) {
    torch::manual_seed(3);
    ModelConfig config = SmallConfig();
    config.dim = dim;
    NsaAttention attn(config, AttentionBackend::kReference, 0.02);
    const auto x = torch::randn({2, 64, dim});  // unit RMS, like a normalised layer input
    const auto out = attn->forward(x);
    const auto gates = attn->last_gates();
    ASSERT_EQ(gates.sizes(), (std::vector<int64_t>{2, 64, 4, 3}));
    for (int branch = 0; branch < 3; ++branch) {
      const auto g = gates.select(-1, branch);
      EXPECT_GT(g.mean().item<double>(), 0.35) << "branch " << branch << " dim " << dim;
      EXPECT_LT(g.mean().item<double>(), 0.65) << "branch " << branch << " dim " << dim;
      EXPECT_GT(g.std().item<double>(), 0.01) << "gate constant: branch " << branch;
      std::cout << "dim " << dim << " branch " << branch << ": gate mean " << g.mean().item<double>()
                << " std " << g.std().item<double>() << "\n";
    }
    out.pow(2).sum().backward();
    for (const auto& p : attn->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << "no gradient: " << p.key();
    }
  }
}

TEST(NsaAttention, StatsDescribeTheLastForward) {
  torch::manual_seed(4);
  const ModelConfig config = SmallConfig();
  NsaAttention attn(config, AttentionBackend::kReference, 0.02);
  const int64_t T = 100;
  attn->forward(torch::randn({3, T, 32}));
  const auto stats = attn->last_stats(5);
  const auto gates = attn->last_gates().reshape({-1, 3});
  EXPECT_EQ(stats.layer, 5);
  EXPECT_NEAR(stats.mean.cmp, gates.select(1, 0).mean().item<double>(), 1e-6);
  EXPECT_NEAR(stats.mean.slc, gates.select(1, 1).mean().item<double>(), 1e-6);
  EXPECT_NEAR(stats.mean.win, gates.select(1, 2).mean().item<double>(), 1e-6);
  EXPECT_NEAR(stats.stddev.win, gates.select(1, 2).std(false).item<double>(), 1e-6);
  EXPECT_GT(stats.stddev.cmp, 0.0);
  // Every eligible block is chosen until n (=3) are: a query at t has min(3, t/16 + 1).
  double expected = 0.0;
  for (int64_t t = 0; t < T; ++t) expected += std::min<int64_t>(3, t / 16 + 1);
  EXPECT_NEAR(stats.mean_selected_blocks, expected / T, 1e-6);
}

TEST(NsaTransformer, LastGateStatsCoverEveryLayer) {
  torch::manual_seed(5);
  ModelConfig config = SmallConfig();
  config.n_layers = 3;
  NsaTransformer model(config, AttentionBackend::kReference);
  model->forward(torch::randint(32, {2, 40}, torch::kLong));
  const auto stats = model->last_gate_stats();
  ASSERT_EQ(stats.size(), 3u);
  double expected = 0.0;
  for (int64_t t = 0; t < 40; ++t) expected += std::min<int64_t>(3, t / 16 + 1);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(stats[i].layer, i);
    for (double m : {stats[i].mean.cmp, stats[i].mean.slc, stats[i].mean.win}) {
      EXPECT_GT(m, 0.3);
      EXPECT_LT(m, 0.7);
    }
    EXPECT_GT(stats[i].stddev.slc, 0.0);
    EXPECT_NEAR(stats[i].mean_selected_blocks, expected / 40, 1e-6);
  }
}

TEST(NsaAttention, GradcheckInDouble) {
  torch::manual_seed(6);
  ModelConfig config = SmallConfig();
  config.dim = 16;
  config.n_heads = 2;
  config.n_kv_groups = 1;
  config.head_dim = 4;
  config.nsa = {4, 2, 8, 3, 6};
  NsaAttention attn(config, AttentionBackend::kReference, 0.02);
  attn->to(torch::kDouble);
  const auto x = testing::Leaf({1, 20, 16});
  const auto w = torch::randn({1, 20, 16}, torch::kDouble);
  const auto params = attn->named_parameters();
  testing::ExpectGradcheck([&] { return (attn->forward(x) * w).sum(); },
                           {x, params["cmp_k_pos"], params["gate_mlp.0.weight"]});
}

TEST(NsaAttention, RopeRotatesPairsByPosition) {
  // Relative-position property: <R(a)q, R(b)k> depends only on a - b.
  torch::manual_seed(7);
  const auto q = torch::randn({1, 1, 1, 8}, torch::kDouble);
  const auto k = torch::randn({1, 1, 1, 8}, torch::kDouble);
  auto dot = [&](int64_t a, int64_t b) {
    const auto qa = ApplyRope(q, torch::tensor({a}), 10000.0);
    const auto kb = ApplyRope(k, torch::tensor({b}), 10000.0);
    return (qa * kb).sum().item<double>();
  };
  EXPECT_NEAR(dot(7, 3), dot(104, 100), 1e-10);
  EXPECT_GT(std::abs(dot(7, 3) - dot(7, 6)), 1e-6);
  EXPECT_NEAR(ApplyRope(q, torch::tensor({0L}), 10000.0).sub(q).abs().max().item<double>(), 0.0,
              1e-15);
}

TEST(NsaAttention, BackendMustBeResolvedAndAvailable) {
  EXPECT_THROW(NsaAttention(SmallConfig(), AttentionBackend::kAuto, 0.02),
               std::invalid_argument);
  EXPECT_THROW(NsaTransformer(SmallConfig(), AttentionBackend::kAuto), std::invalid_argument);
  if (torch::cuda::is_available()) GTEST_SKIP() << "a CUDA device is present";
  NsaAttention attn(SmallConfig(), AttentionBackend::kCuda, 0.02);
  try {
    attn->forward(torch::randn({1, 40, 32}));
    FAIL() << "the cuda backend ran without a GPU";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("cuda"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nsad::nsa
