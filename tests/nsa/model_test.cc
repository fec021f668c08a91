// The NSA transformer: parameter count of m7c_125m, finiteness through training in float32
// and bf16 at every sequence length of the issue, and a tiny model that learns.
#include <gtest/gtest.h>
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <cmath>
#include <iostream>

#include "model/transformer.h"
#include "nsa/attention.h"
#include "nsa/dispatch.h"
#include "test_util.h"

namespace nsad {
namespace {

using nsa::testing::AllFinite;

// docs/NSA.md, "Parameter count", written out independently of the module code.
int64_t DocumentedParameterCount(const ModelConfig& c) {
  const int64_t dim = c.dim, H = c.n_heads, G = c.n_kv_groups, D = c.head_dim;
  const int64_t l = c.nsa.cmp_block, F = EffectiveMlpHidden(c);
  const int64_t cmp_hidden = 2 * D, gate_hidden = dim / 4;
  const int64_t attention = dim * H * D            // q
                            + dim * 6 * G * D      // k, v of cmp, slc, win
                            + H * D * dim          // output projection
                            + 2 * l * D            // intra-block position encodings (k, v)
                            + 2 * (l * D * cmp_hidden + cmp_hidden + cmp_hidden * D + D)
                            + dim * gate_hidden + gate_hidden + gate_hidden * 3 * H + 3 * H;
  const int64_t block = 2 * dim        // two RMSNorm weights
                        + attention
                        + 3 * dim * F;  // SwiGLU: gate, up, down
  return int64_t{c.vocab_size} * dim  // embedding, tied with the LM head
         + c.n_layers * block + dim;  // final RMSNorm
}

int64_t CountParameters(const torch::nn::Module& model) {
  int64_t total = 0;
  for (const auto& p : model.parameters()) total += p.numel();
  return total;
}


TEST(NsaTransformer, M7c125mParameterCount) {
  torch::manual_seed(0);
  const ModelConfig config = M7cModelConfig();  // mlp_hidden 2048, NSA defaults
  ASSERT_EQ(EffectiveMlpHidden(config), 2048);
  NsaTransformer model(config, AttentionBackend::kReference);
  const int64_t actual = CountParameters(*model);
  std::cout << "m7c_125m parameters: " << actual << "\n";
  EXPECT_EQ(actual, DocumentedParameterCount(config));
  EXPECT_EQ(static_cast<double>(actual), ParameterCount(config)) << "the count StartRun sizes runs with";
  EXPECT_GT(actual, 120'000'000);
  EXPECT_LT(actual, 130'000'000);
}

// ParameterCount (what StartRun holds against the device's memory, torch-free) against the
// modules for other shapes: another head_dim and geometry, an explicit MLP width, a dim
// whose gate width rounds down.
TEST(NsaTransformer, ParameterCountMatchesTheModulesForOtherShapes) {
  ModelConfig wide = M7cModelConfig();
  wide.vocab_size = 1000;
  wide.n_layers = 2;
  wide.head_dim = 128;
  wide.n_heads = 16;
  wide.n_kv_groups = 4;
  wide.nsa.cmp_block = 16;
  ModelConfig odd;
  odd.dim = 38;
  odd.mlp_hidden = 100;
  odd.n_layers = 3;
  for (const ModelConfig& config : {wide, odd, ModelConfig()}) {
    NsaTransformer model(config, AttentionBackend::kReference);
    EXPECT_EQ(static_cast<double>(CountParameters(*model)), ParameterCount(config)) << "dim " << config.dim;
  }
}

constexpr int64_t kLengths[] = {1, 31, 32, 33, 63, 64, 65, 127, 511, 512, 513, 1000, 2048};

ModelConfig FinitenessConfig() {  // tiny widths, the default NSA geometry
  ModelConfig c;
  c.vocab_size = 64;
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_groups = 1;
  c.head_dim = 16;
  return c;
}

torch::Tensor NextTokenLoss(NsaTransformer& model, const torch::Tensor& tokens) {
  const auto logits = model->forward(tokens.narrow(1, 0, tokens.size(1) - 1));
  return nsa::CrossEntropyLoss(AttentionBackend::kReference, logits.reshape({-1, logits.size(-1)}),
                               tokens.narrow(1, 1, tokens.size(1) - 1).reshape(-1));
}

// Forward and backward at every length; logits, loss and all gradients must be finite.
void ExpectFiniteAtEveryLength(NsaTransformer& model, int vocab, const std::string& when) {
  for (int64_t T : kLengths) {
    model->zero_grad();
    const auto tokens = torch::randint(vocab, {2, T}, torch::kLong);
    const auto logits = model->forward(tokens);
    ASSERT_TRUE(AllFinite(logits)) << when << ": logits at T=" << T;
    const auto targets = torch::randint(vocab, {2 * T}, torch::kLong);
    const auto loss = nsa::CrossEntropyLoss(AttentionBackend::kReference, logits.reshape({-1, vocab}), targets);
    ASSERT_TRUE(AllFinite(loss)) << when << ": loss at T=" << T;
    loss.backward();
    for (const auto& p : model->named_parameters()) {
      ASSERT_TRUE(!p.value().grad().defined() || AllFinite(p.value().grad()))
          << when << ": gradient of " << p.key() << " at T=" << T;
    }
    for (const auto& s : model->last_gate_stats()) {
      ASSERT_TRUE(std::isfinite(s.mean.cmp) && std::isfinite(s.mean.slc) &&
                  std::isfinite(s.mean.win) && std::isfinite(s.stddev.cmp))
          << when << ": gate stats at T=" << T;
    }
  }
}

class Finiteness : public ::testing::TestWithParam<torch::Dtype> {};

TEST_P(Finiteness, AtInitAndAfterFiftyTrainingSteps) {
  torch::manual_seed(1);
  const ModelConfig config = FinitenessConfig();
  NsaTransformer model(config, AttentionBackend::kReference);
  model->to(GetParam());
  ExpectFiniteAtEveryLength(model, config.vocab_size, "init");
  // 50 AdamW steps at a deliberately high learning rate, cycling through the lengths.
  torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
  for (int step = 0; step < 50; ++step) {
    const int64_t T = kLengths[step % std::size(kLengths)];
    const auto tokens = torch::randint(config.vocab_size, {1, T + 1}, torch::kLong);
    opt.zero_grad();
    const auto loss = NextTokenLoss(model, tokens);
    ASSERT_TRUE(AllFinite(loss)) << "step " << step;
    loss.backward();
    opt.step();
  }
  ExpectFiniteAtEveryLength(model, config.vocab_size, "after 50 steps");
}

INSTANTIATE_TEST_SUITE_P(Dtypes, Finiteness, ::testing::Values(torch::kFloat, torch::kBFloat16),
                         [](const auto& info) {
                           return std::string(info.param == torch::kFloat ? "float32" : "bf16");
                         });

// The trainer runs the model under bf16 autocast on CUDA; CPU autocast exercises the same
// mixed-precision paths (float32 weights, bf16 matmuls) here.
TEST(NsaTransformer, RunsUnderBf16Autocast) {
  torch::manual_seed(3);
  const ModelConfig config = FinitenessConfig();
  NsaTransformer model(config, AttentionBackend::kReference);
  at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
  at::autocast::set_autocast_enabled(at::kCPU, true);
  const auto tokens = torch::randint(config.vocab_size, {2, 301}, torch::kLong);
  const auto loss = NextTokenLoss(model, tokens);
  at::autocast::set_autocast_enabled(at::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_EQ(loss.scalar_type(), torch::kFloat);
  ASSERT_TRUE(AllFinite(loss));
  EXPECT_NEAR(loss.item<double>(), std::log(64.0), 0.5);  // near uniform at init
  loss.backward();
  for (const auto& p : model->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_EQ(p.value().grad().scalar_type(), torch::kFloat) << p.key();
    EXPECT_TRUE(AllFinite(p.value().grad())) << p.key();
  }
}

// Sequences of a random 8-token pattern repeated: after the first period every token is the
// one 8 positions back. A unigram model cannot beat ln(16); NSA must learn to look back.
torch::Tensor RepeatedPatterns(int64_t batch, int64_t len, int64_t vocab, int64_t period) {
  const auto pattern = torch::randint(vocab, {batch, period}, torch::kLong);
  return pattern.repeat({1, (len + period - 1) / period}).narrow(1, 0, len);
}

TEST(NsaTransformer, TinyModelLearnsRepeatedPatterns) {
  torch::manual_seed(2);
  ModelConfig config;
  config.vocab_size = 16;
  config.dim = 64;
  config.n_layers = 2;
  config.n_heads = 4;
  config.n_kv_groups = 2;
  config.head_dim = 16;
  config.nsa = {/*cmp_block=*/8, /*cmp_stride=*/4, /*slc_block=*/16, /*slc_top_n=*/3,
                /*window=*/16};
  NsaTransformer model(config, AttentionBackend::kReference);
  torch::optim::AdamW opt(model->parameters(),
                          torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  const double unigram = std::log(16.0);
  const int64_t kMaxSteps = 400, kLen = 65, kPeriod = 8;
  double loss_value = unigram;
  int64_t steps = 0;
  for (; steps < kMaxSteps && loss_value > 0.2 * unigram; ++steps) {
    opt.zero_grad();
    const auto loss = NextTokenLoss(model, RepeatedPatterns(16, kLen, 16, kPeriod));
    loss.backward();
    opt.step();
    loss_value = loss.item<double>();
  }
  // Held-out batch.
  torch::NoGradGuard no_grad;
  const double eval = NextTokenLoss(model, RepeatedPatterns(64, kLen, 16, kPeriod)).item<double>();
  std::cout << "repeated patterns: loss " << eval << " after " << steps
            << " steps (unigram baseline " << unigram << ")\n";
  EXPECT_LT(eval, 0.3 * unigram);  // the floor is ~1/8 (the first period is random)
}

// Activation checkpointing recomputes blocks in backward: the loss and every gradient are
// the same as without it, also under bf16 autocast (the recomputation must see the autocast
// state of the forward).
TEST(NsaTransformer, ActivationCheckpointingGivesTheSameLossAndGradients) {
  ModelConfig config = FinitenessConfig();
  config.n_layers = 2;
  for (const bool autocast : {false, true}) {
    torch::manual_seed(11);
    NsaTransformer model(config, AttentionBackend::kReference);
    const auto tokens = torch::randint(config.vocab_size, {2, 97}, torch::kLong);
    auto loss_and_grads = [&](bool checkpointing) {
      model->set_activation_checkpointing(checkpointing);
      model->zero_grad();
      const int64_t layers_before = nsa::LayersExecuted(AttentionBackend::kReference);
      at::autocast::set_autocast_enabled(at::kCPU, autocast);
      at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
      const auto logits = model->forward(tokens.narrow(1, 0, 96));
      at::autocast::set_autocast_enabled(at::kCPU, false);
      at::autocast::clear_cache();
      auto loss = nsa::CrossEntropyLoss(AttentionBackend::kReference,
                                        logits.reshape({-1, config.vocab_size}),
                                        tokens.narrow(1, 1, 96).reshape({-1}));
      loss.backward();
      // With checkpointing each block's forward runs again during backward.
      EXPECT_EQ(nsa::LayersExecuted(AttentionBackend::kReference) - layers_before,
                (checkpointing ? 2 : 1) * config.n_layers);
      std::vector<torch::Tensor> grads;
      for (const auto& p : model->parameters()) grads.push_back(p.grad().clone());
      return std::make_pair(loss.item<double>(), grads);
    };
    const auto plain = loss_and_grads(false);
    const auto recomputed = loss_and_grads(true);
    EXPECT_EQ(plain.first, recomputed.first) << "autocast " << autocast;
    ASSERT_EQ(plain.second.size(), recomputed.second.size());
    for (size_t i = 0; i < plain.second.size(); ++i) {
      ASSERT_TRUE(recomputed.second[i].defined()) << "parameter " << i << " got no gradient";
      EXPECT_TRUE(torch::equal(plain.second[i], recomputed.second[i]))
          << "parameter " << i << ", autocast " << autocast << ": max diff "
          << (plain.second[i] - recomputed.second[i]).abs().max().item<double>();
    }
  }
}

}  // namespace
}  // namespace nsad
