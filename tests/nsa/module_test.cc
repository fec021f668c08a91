// NsaAttention as a module: causality, gate initialisation, gradients, statistics, backend
// handling. Small shapes on CPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <stdexcept>

#include <ATen/autocast_mode.h>

#include "model/shared_input_linear.h"
#include "model/transformer.h"
#include "nsa/attention.h"
#include "nsa/compress.h"
#include "nsa/dispatch.h"
#include "nsa/rope.h"
#include "nsa/shared_gradient.h"
#include "test_util.h"

#ifdef NSAD_HAVE_CUDA_KERNELS
#include "kernel_choice.h"
#include "tuned_gemm.h"
#endif

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

// The joint GEMM gives each layer exactly its own output: its bias on its own part only, and
// the gradients of every weight and bias as separate layers would get them.
TEST(SharedInputLinear, MatchesSeparateLayersWithAndWithoutBias) {
  torch::manual_seed(11);
  torch::nn::Linear a(torch::nn::LinearOptions(6, 5).bias(false)), b(6, 3), c(torch::nn::LinearOptions(6, 4).bias(false));
  for (auto* layer : {&a, &b, &c}) (*layer)->to(torch::kDouble);
  const auto x = torch::randn({2, 7, 6}, torch::kDouble).requires_grad_(true);
  const auto parts = SharedInputLinear(x, {a, b, c});
  ASSERT_EQ(parts.size(), 3u);
  const auto w = torch::randn({2, 7, 12}, torch::kDouble);
  torch::cat(parts, -1).mul(w).sum().backward();
  const std::vector<torch::Tensor> joint_grads = {a->weight.grad().clone(), b->weight.grad().clone(),
                                                  b->bias.grad().clone(), c->weight.grad().clone(),
                                                  x.grad().clone()};
  for (auto* layer : {&a, &b, &c}) (*layer)->zero_grad();
  x.mutable_grad().reset();
  const std::vector<torch::Tensor> separate = {a->forward(x), b->forward(x), c->forward(x)};
  for (size_t i = 0; i < separate.size(); ++i) EXPECT_LT(MaxDiff(parts[i], separate[i]), 1e-12) << i;
  torch::cat(separate, -1).mul(w).sum().backward();
  const std::vector<torch::Tensor> separate_grads = {a->weight.grad(), b->weight.grad(), b->bias.grad(),
                                                     c->weight.grad(), x.grad()};
  for (size_t i = 0; i < joint_grads.size(); ++i) EXPECT_LT(MaxDiff(joint_grads[i], separate_grads[i]), 1e-12) << i;

  // Only the biased middle part used: it alone gets gradients, and x gets its share.
  for (auto* layer : {&a, &b, &c}) (*layer)->zero_grad();
  x.mutable_grad().reset();
  SharedInputLinear(x, {a, b, c})[1].mul(w.narrow(-1, 5, 3)).sum().backward();
  const auto middle_dx = x.grad().clone();
  const auto middle_dw = b->weight.grad().clone(), middle_db = b->bias.grad().clone();
  EXPECT_FALSE(a->weight.grad().defined() && a->weight.grad().abs().sum().item<double>() != 0);
  x.mutable_grad().reset();
  b->zero_grad();
  b->forward(x).mul(w.narrow(-1, 5, 3)).sum().backward();
  EXPECT_LT(MaxDiff(middle_dx, x.grad()), 1e-12);
  EXPECT_LT(MaxDiff(middle_dw, b->weight.grad()), 1e-12);
  EXPECT_LT(MaxDiff(middle_db, b->bias.grad()), 1e-12);
  EXPECT_THROW(SharedInputLinearJoint(x, {a, b}), c10::Error);  // the joint output has no biased layer
}

// An identity whose backward writes its gradient into a SharedGradient's part, as the fused
// ops that read the attention's projection do.
struct IdentityIntoPart : torch::autograd::Function<IdentityIntoPart> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const GradientPart& part) {
    ctx->saved_data["part"] = part.ToSaved();
    ctx->saved_data["sizes"] = x.sizes().vec();
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto dx = GradientPart::FromSaved(ctx->saved_data["part"]).Take(ctx->saved_data["sizes"].toIntVector());
    if (!dx.defined()) return {grads[0], torch::Tensor()};
    dx.copy_(grads[0]);
    return {dx, torch::Tensor()};
  }
};

// Gradients that come back as adjacent slices of one buffer take one dx and one dW GEMM
// (JointGradientBackwards counts them) and give what separate gradients give; with one part
// outside the buffer the per-part GEMMs run, with the same result.
TEST(SharedInputLinear, GradientsInOneSharedBufferMatchSeparateOnes) {
  torch::manual_seed(13);
  torch::nn::Linear a(torch::nn::LinearOptions(6, 5).bias(false)), b(6, 3), c(torch::nn::LinearOptions(6, 4).bias(false));
  for (auto* layer : {&a, &b, &c}) (*layer)->to(torch::kDouble);
  const auto x = torch::randn({2, 7, 6}, torch::kDouble).requires_grad_(true);
  const auto w = torch::randn({2, 7, 12}, torch::kDouble);
  // The gradients of x, a, b (weight and bias), c after a backward through the parts, each
  // part through IdentityIntoPart with `parts[i]`.
  const auto gradients = [&](bool shared, bool all_parts) {
    for (auto* layer : {&a, &b, &c}) (*layer)->zero_grad();
    x.mutable_grad().reset();
    const auto outs = SharedInputLinear(x, {a, b, c});
    std::vector<GradientPart> parts(outs.size());
    if (shared) parts = SharedGradientParts(outs);
    if (!all_parts) parts[1] = GradientPart();
    std::vector<torch::Tensor> ys;
    for (size_t i = 0; i < outs.size(); ++i) ys.push_back(IdentityIntoPart::apply(outs[i], parts[i]));
    torch::cat(ys, -1).mul(w).sum().backward();
    return std::vector<torch::Tensor>{x.grad().clone(), a->weight.grad().clone(), b->weight.grad().clone(),
                                      b->bias.grad().clone(), c->weight.grad().clone()};
  };
  const auto separate = gradients(false, true);
  const int64_t joint0 = JointGradientBackwards();
  const auto joint = gradients(true, true);
  EXPECT_EQ(JointGradientBackwards() - joint0, 1);
  const auto two_of_three = gradients(true, false);
  EXPECT_EQ(JointGradientBackwards() - joint0, 1);
  for (size_t i = 0; i < separate.size(); ++i) {
    EXPECT_LT(MaxDiff(joint[i], separate[i]), 1e-12) << i;
    EXPECT_LT(MaxDiff(two_of_three[i], separate[i]), 1e-12) << i;
  }
}

// Under bf16 autocast the float32 bias must not promote a layer's output to float32 (the
// next op would then run in float32 and the activations kept for backward double in size).
TEST(SharedInputLinear, BiasedPartsStayInTheAutocastType) {
  torch::manual_seed(12);
  torch::nn::Linear plain(torch::nn::LinearOptions(8, 4).bias(false)), biased(8, 4);
  const auto x = torch::randn({3, 8});
  at::autocast::set_autocast_enabled(torch::kCPU, true);
  at::autocast::set_autocast_dtype(torch::kCPU, torch::kBFloat16);
  const auto parts = SharedInputLinear(x, {plain, biased});
  const auto single = ApplyLinear(biased, x);
  at::autocast::set_autocast_enabled(torch::kCPU, false);
  at::autocast::clear_cache();
  EXPECT_EQ(parts[0].scalar_type(), torch::kBFloat16);
  EXPECT_EQ(parts[1].scalar_type(), torch::kBFloat16);
  EXPECT_EQ(single.scalar_type(), torch::kBFloat16);
  const auto expect = biased->forward(x);
  EXPECT_LT(MaxDiff(parts[1], expect), 0.05);
  EXPECT_LT(MaxDiff(single, expect), 0.05);
}

#ifdef NSAD_HAVE_CUDA_KERNELS
// The linear layers' GEMMs on the tuned cuBLASLt path (GemmChoice::kTuned) give what cuBLAS
// gives, up to the rounding of bf16: outputs and every gradient, through the joint backward
// (one buffer) and the per-part one.
TEST(SharedInputLinear, TunedGemmsMatchCublasOnCuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  using cuda::detail::GemmChoice;
  torch::manual_seed(21);
  torch::nn::Linear a(torch::nn::LinearOptions(64, 40).bias(false)), b(torch::nn::LinearOptions(64, 24).bias(false)),
      c(torch::nn::LinearOptions(64, 72).bias(false));
  for (auto* layer : {&a, &b, &c}) (*layer)->to(torch::kCUDA);
  const auto x = torch::randn({4, 50, 64}, torch::kCUDA).requires_grad_(true);
  const auto w = torch::randn({4, 50, 136}, torch::kCUDA);
  const auto run = [&](GemmChoice::Algo algo, bool shared) {
    const cuda::detail::ScopedGemmChoice choice({algo});
    for (auto* layer : {&a, &b, &c}) (*layer)->zero_grad();
    x.mutable_grad().reset();
    at::autocast::set_autocast_enabled(torch::kCUDA, true);
    at::autocast::set_autocast_dtype(torch::kCUDA, torch::kBFloat16);
    const auto outs = SharedInputLinear(x, {a, b, c});
    std::vector<GradientPart> parts(outs.size());
    if (shared) parts = SharedGradientParts(outs);
    std::vector<torch::Tensor> ys;
    for (size_t i = 0; i < outs.size(); ++i) ys.push_back(IdentityIntoPart::apply(outs[i], parts[i]));
    const auto y = torch::cat(ys, -1);
    at::autocast::set_autocast_enabled(torch::kCUDA, false);
    at::autocast::clear_cache();
    y.to(torch::kFloat).mul(w).sum().backward();
    return std::vector<torch::Tensor>{y.detach().to(torch::kFloat), x.grad().clone(), a->weight.grad().clone(),
                                      b->weight.grad().clone(), c->weight.grad().clone()};
  };
  for (const bool shared : {false, true}) {
    const auto cublas = run(GemmChoice::Algo::kCublas, shared);
    const int64_t shapes = cuda::detail::TunedGemmShapes();
    const auto tuned = run(GemmChoice::Algo::kTuned, shared);
    if (!shared) EXPECT_GT(cuda::detail::TunedGemmShapes(), shapes) << "the tuned path did not run";
    for (size_t i = 0; i < cublas.size(); ++i) {
      const double scale = cublas[i].abs().max().item<double>();
      EXPECT_LT(MaxDiff(tuned[i], cublas[i]) / scale, 1e-2) << "shared " << shared << ", tensor " << i;
    }
  }
}
#endif

// The gate MLP's head on the composed path (a head of N = 96 > 64 gates, which the fused kernel
// refuses) with a hidden bias added by GateHead: hidden's gradient still lands in its slice of
// the joint projection's shared gradient, so that projection's backward takes the one-buffer
// path, and every gradient matches the same graph without the shared buffer.
TEST(GateHead, ComposedPathWithAHiddenBiasKeepsTheSharedGradient) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(22);
  const int64_t C = 64, K = 48, N = 96;
  torch::nn::Linear q(torch::nn::LinearOptions(C, 32).bias(false)), hidden(C, K), out(K, N);
  for (auto* layer : {&q, &hidden, &out}) (*layer)->to(torch::kCUDA);
  const auto x = torch::randn({2, 40, C}, torch::kCUDA).requires_grad_(true);
  const auto wq = torch::randn({2, 40, 32}, torch::kCUDA), wg = torch::randn({2, 40, N}, torch::kCUDA);
  const auto run = [&](bool shared) {
    for (auto* layer : {&q, &hidden, &out}) (*layer)->zero_grad();
    x.mutable_grad().reset();
    at::autocast::set_autocast_enabled(torch::kCUDA, true);
    at::autocast::set_autocast_dtype(torch::kCUDA, torch::kBFloat16);
    const auto outs = SharedInputLinear(x, {q, hidden}, Biases::kLeftToCaller);
    std::vector<GradientPart> parts(outs.size());
    if (shared) parts = SharedGradientParts(outs);
    const auto yq = IdentityIntoPart::apply(outs[0], parts[0]);
    const auto gates = GateHead(AttentionBackend::kCuda, outs[1], hidden->bias, out, parts[1]);
    at::autocast::set_autocast_enabled(torch::kCUDA, false);
    at::autocast::clear_cache();
    EXPECT_EQ(gates.sizes(), torch::IntArrayRef({2, 40, N}));
    (yq.to(torch::kFloat).mul(wq).sum() + gates.to(torch::kFloat).mul(wg).sum()).backward();
    return std::vector<torch::Tensor>{gates.detach().to(torch::kFloat), x.grad().clone(),
                                      q->weight.grad().clone(),         hidden->weight.grad().clone(),
                                      hidden->bias.grad().clone(),      out->weight.grad().clone(),
                                      out->bias.grad().clone()};
  };
  const auto separate = run(false);
  const int64_t joint0 = JointGradientBackwards();
  const auto shared = run(true);
  EXPECT_EQ(JointGradientBackwards() - joint0, 1) << "the projection's backward did not find one buffer";
  for (size_t i = 0; i < separate.size(); ++i) {
    ASSERT_TRUE(shared[i].defined() && separate[i].defined()) << i;
    const double scale = separate[i].abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << i;
    EXPECT_LT(MaxDiff(shared[i], separate[i]) / scale, 1e-2) << "tensor " << i;
  }
}

// CompressBlocks against the paper's definition written out: block j = tokens [j d, j d + l)
// plus the position encoding, flattened, through Linear -> SiLU -> Linear. Output and every
// gradient, for strides that divide the block length (the chunked form: r = 1, 2, 4) and
// one that does not (unfolded), with lengths that leave a partial block and none at all.
Geometry CompressionGeometry(int64_t l, int64_t d) {
  Geometry g;
  g.cmp_block = l;
  g.cmp_stride = d;
  return g;
}

// The paper's definition written out: block j = tokens [j d, j d + l) plus the position
// encoding, flattened, through first -> SiLU -> second. Needs at least one block.
torch::Tensor CompressByDefinition(const torch::Tensor& tokens, const torch::Tensor& pos, torch::nn::Linear first,
                                   torch::nn::Linear second, const Geometry& g) {
  const int64_t B = tokens.size(0), G = tokens.size(2), D = tokens.size(3), l = g.cmp_block;
  std::vector<torch::Tensor> blocks;
  for (int64_t j = 0; j < NumCmpBlocks(tokens.size(1), g); ++j) {
    blocks.push_back((tokens.narrow(1, j * g.cmp_stride, l).permute({0, 2, 1, 3}) + pos).reshape({B, G, l * D}));
  }
  return second->forward(torch::silu(first->forward(torch::stack(blocks, 1))));
}

TEST(CompressBlocks, MatchesTheDefinition) {
  const int64_t B = 2, G = 3, D = 4, hidden = 6;
  for (const auto& [l, d] : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {8, 4}, {8, 2}, {8, 3}}) {
    for (const int64_t T : {7, 8, 37}) {
      torch::manual_seed(l * 100 + d * 10 + T);
      const Geometry g = CompressionGeometry(l, d);
      const int64_t N = NumCmpBlocks(T, g);
      torch::nn::Linear first(l * D, hidden), second(hidden, D);
      first->to(torch::kDouble);
      second->to(torch::kDouble);
      const auto tokens = torch::randn({B, T, G, D}, torch::kDouble).requires_grad_(true);
      const auto pos = torch::randn({l, D}, torch::kDouble).requires_grad_(true);
      const auto got = CompressBlocks(tokens, pos, first, second, g);
      ASSERT_EQ(got.sizes(), (std::vector<int64_t>{B, N, G, D}));
      if (N == 0) continue;
      const auto want = CompressByDefinition(tokens, pos, first, second, g);
      EXPECT_LT(MaxDiff(got, want), 1e-12) << "l=" << l << " d=" << d << " T=" << T;
      const auto w = torch::randn_like(want);
      const std::vector<torch::Tensor> inputs = {tokens, pos, first->weight, first->bias, second->weight};
      const auto got_grads = torch::autograd::grad({(got * w).sum()}, inputs);
      const auto want_grads = torch::autograd::grad({(want * w).sum()}, inputs);
      for (size_t i = 0; i < inputs.size(); ++i) {
        EXPECT_LT(MaxDiff(got_grads[i], want_grads[i]), 1e-12) << "input " << i << " l=" << l << " d=" << d << " T=" << T;
      }
    }
  }
}

// Two compressors (keys, values) in double with random token tensors [B,T,G,D] for them, and
// each compressor's parameters (pos, W1, b1, W2, b2) in order.
struct TwoCompressions {
  std::vector<Compressor> compressors;
  std::vector<torch::Tensor> tokens, params;
};
TwoCompressions RandomCompressions(int64_t B, int64_t T, int64_t G, int64_t D, int64_t l, int64_t hidden) {
  TwoCompressions two;
  for (int p = 0; p < 2; ++p) {
    Compressor c{torch::randn({l, D}, torch::kDouble).requires_grad_(true), torch::nn::Linear(l * D, hidden),
                 torch::nn::Linear(hidden, D)};
    c.first->to(torch::kDouble);
    c.second->to(torch::kDouble);
    two.tokens.push_back(torch::randn({B, T, G, D}, torch::kDouble).requires_grad_(true));
    two.compressors.push_back(c);
    two.params.insert(two.params.end(),
                      {c.position_encoding, c.first->weight, c.first->bias, c.second->weight, c.second->bias});
  }
  return two;
}

// CompressBlocksTogether (the CUDA backend's one autograd node for keys and values) against
// the same definition, each token tensor through its own compressor: both outputs and every
// gradient, chunked strides only (r = 1, 2, 4), with a partial last chunk, no block at all,
// and one output's gradient missing (the other compressor's parameters then get zeros).
TEST(CompressBlocksTogether, MatchesTheDefinitionPerCompressor) {
  const int64_t B = 2, G = 3, D = 4, hidden = 6;
  for (const auto& [l, d] : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {8, 4}, {8, 2}}) {
    for (const int64_t T : {7, 8, 37}) {
      torch::manual_seed(l * 100 + d * 10 + T);
      const Geometry g = CompressionGeometry(l, d);
      const int64_t N = NumCmpBlocks(T, g);
      const auto [compressors, tokens, params] = RandomCompressions(B, T, G, D, l, hidden);
      std::vector<torch::Tensor> inputs;  // each token tensor, then its compressor's parameters
      for (int p = 0; p < 2; ++p) {
        inputs.push_back(tokens[p]);
        inputs.insert(inputs.end(), params.begin() + 5 * p, params.begin() + 5 * p + 5);
      }
      const auto got = CompressBlocksTogether(tokens, compressors, g);
      ASSERT_EQ(got.size(), 2u);
      for (const auto& out : got) ASSERT_EQ(out.sizes(), (std::vector<int64_t>{B, N, G, D}));
      if (N == 0) continue;
      std::vector<torch::Tensor> want;
      for (int p = 0; p < 2; ++p) {
        const auto& c = compressors[p];
        want.push_back(CompressByDefinition(tokens[p], c.position_encoding, c.first, c.second, g));
        EXPECT_LT(MaxDiff(got[p], want[p]), 1e-12) << "p=" << p << " l=" << l << " d=" << d << " T=" << T;
      }
      for (const bool both : {true, false}) {
        const auto w0 = torch::randn_like(want[0]), w1 = torch::randn_like(want[1]);
        const auto got_loss = (got[0] * w0).sum() + (both ? (got[1] * w1).sum() : torch::zeros({}, torch::kDouble));
        const auto want_loss = (want[0] * w0).sum() + (both ? (want[1] * w1).sum() : torch::zeros({}, torch::kDouble));
        const auto got_grads = torch::autograd::grad({got_loss}, inputs, {}, /*retain_graph=*/true, false,
                                                     /*allow_unused=*/true);
        const auto want_grads = torch::autograd::grad({want_loss}, inputs, {}, true, false, true);
        for (size_t i = 0; i < inputs.size(); ++i) {
          const auto expect = want_grads[i].defined() ? want_grads[i] : torch::zeros_like(inputs[i]);
          ASSERT_TRUE(got_grads[i].defined()) << "input " << i;
          EXPECT_LT(MaxDiff(got_grads[i], expect), 1e-12)
              << "input " << i << " both=" << both << " l=" << l << " d=" << d << " T=" << T;
        }
      }
    }
  }
}

// CompressChunksTogether takes the same tokens as their chunks [P,B,chunks,G,d,D] (what the
// kv split writes on the CUDA backend): the same outputs and parameter gradients as
// CompressBlocksTogether, and the chunks' gradient is the tokens' gradient in that layout.
TEST(CompressChunksTogether, MatchesCompressBlocksTogetherOnTheTokensChunks) {
  const int64_t B = 2, G = 3, D = 4, hidden = 6;
  for (const auto& [l, d] : std::vector<std::pair<int64_t, int64_t>>{{8, 8}, {8, 4}, {8, 2}}) {
    for (const int64_t T : {8, 37}) {
      torch::manual_seed(l * 100 + d * 10 + T);
      const Geometry g = CompressionGeometry(l, d);
      const int64_t N = NumCmpBlocks(T, g), chunks = N + l / d - 1;
      const auto [compressors, tokens, params] = RandomCompressions(B, T, G, D, l, hidden);
      const auto stack = torch::stack({TokensAsChunks(tokens[0], chunks, d), TokensAsChunks(tokens[1], chunks, d)})
                             .detach()
                             .requires_grad_(true);
      const auto got = CompressChunksTogether(stack, compressors, g);
      const auto want = CompressBlocksTogether(tokens, compressors, g);
      ASSERT_EQ(got.size(), 2u);
      const auto w0 = torch::randn_like(want[0]), w1 = torch::randn_like(want[1]);
      std::vector<torch::Tensor> got_inputs = {stack}, want_inputs = tokens;
      got_inputs.insert(got_inputs.end(), params.begin(), params.end());
      want_inputs.insert(want_inputs.end(), params.begin(), params.end());
      const auto got_grads = torch::autograd::grad({(got[0] * w0).sum() + (got[1] * w1).sum()}, got_inputs);
      const auto want_grads = torch::autograd::grad({(want[0] * w0).sum() + (want[1] * w1).sum()}, want_inputs);
      const std::string where = " l=" + std::to_string(l) + " d=" + std::to_string(d) + " T=" + std::to_string(T);
      for (int p = 0; p < 2; ++p) {
        ASSERT_EQ(got[p].sizes(), want[p].sizes()) << where;
        EXPECT_LT(MaxDiff(got[p], want[p]), 1e-12) << "output " << p << where;
        EXPECT_LT(MaxDiff(got_grads[0][p], TokensAsChunks(want_grads[p], chunks, d)), 1e-12)
            << "chunks " << p << where;
      }
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_LT(MaxDiff(got_grads[1 + i], want_grads[2 + i]), 1e-12) << "parameter " << i << where;
      }
    }
  }
  // Chunks of another length than the stride, or too few for one block, are refused by name.
  const Geometry g = CompressionGeometry(8, 4);
  Compressor c{torch::randn({8, 4}), torch::nn::Linear(32, 6), torch::nn::Linear(6, 4)};
  EXPECT_THROW(CompressChunksTogether(torch::randn({1, 2, 3, 1, 2, 4}), {c}, g), c10::Error);
  EXPECT_THROW(CompressChunksTogether(torch::randn({1, 2, 1, 1, 4, 4}), {c}, g), c10::Error);
}

// The kv split's chunk layout on the reference path (CPU; the CUDA kernel is held to it in
// kernels/fused_ops_test): the named parts come out as one tensor of their chunks, the others
// as without it, and a layout that does not fit x is refused.
TEST(RotateParts, GivesTheNamedPartsAsTheirChunks) {
  torch::manual_seed(3);
  const int64_t B = 2, T = 37, P = 4, M = 3, D = 8, len = 4, chunks = 9;
  const auto x = torch::randn({B, T, P, M, D});
  const auto table = MakeRopeTable(torch::arange(T), D, 10000.0, torch::kFloat);
  const std::vector<bool> rotate = {true, false, true, false};
  const auto plain = RotateParts(AttentionBackend::kReference, x, table, rotate);
  const auto parts = RotateParts(AttentionBackend::kReference, x, table, rotate, {}, PartChunks{1, 2, len, chunks});
  ASSERT_EQ(parts.size(), static_cast<size_t>(P + 1));
  EXPECT_TRUE(torch::equal(parts[0], plain[0]));
  EXPECT_TRUE(torch::equal(parts[3], plain[3]));
  EXPECT_FALSE(parts[1].defined());
  EXPECT_FALSE(parts[2].defined());
  const auto& stack = parts.back();
  ASSERT_EQ(stack.sizes(), (std::vector<int64_t>{2, B, chunks, M, len, D}));
  EXPECT_TRUE(stack.is_contiguous());
  EXPECT_TRUE(torch::equal(stack[0], TokensAsChunks(plain[1], chunks, len)));
  EXPECT_TRUE(torch::equal(stack[1], TokensAsChunks(plain[2], chunks, len)));
  EXPECT_THROW(RotateParts(AttentionBackend::kReference, x, table, rotate, {}, PartChunks{3, 2, len, chunks}),
               c10::Error);
  EXPECT_THROW(RotateParts(AttentionBackend::kReference, x, table, rotate, {}, PartChunks{0, 1, len, 10}),
               c10::Error);
}

// Under autocast the fused node computes in the autocast dtype, as the composed ops do, and
// gives the parameters float32 gradients.
TEST(CompressBlocksTogether, FollowsAutocastLikeCompressBlocks) {
  torch::manual_seed(5);
  Geometry g;
  g.cmp_block = 8;
  g.cmp_stride = 4;
  Compressor c{torch::randn({8, 4}).requires_grad_(true), torch::nn::Linear(32, 6), torch::nn::Linear(6, 4)};
  const auto tokens = torch::randn({2, 21, 2, 4}).to(torch::kBFloat16).requires_grad_(true);
  torch::Tensor got, want;
  {
    at::autocast::set_autocast_enabled(at::kCPU, true);
    at::autocast::set_autocast_dtype(at::kCPU, at::kBFloat16);
    got = CompressBlocksTogether({tokens}, {c}, g)[0];
    want = CompressBlocks(tokens, c.position_encoding, c.first, c.second, g);
    at::autocast::set_autocast_enabled(at::kCPU, false);
    at::autocast::clear_cache();
  }
  EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(want.scalar_type(), torch::kBFloat16);
  // bf16 GEMMs on both sides; the fused node adds W1 pos + b1 in float32 (the composed ops
  // round it to bf16 first).
  EXPECT_LT(MaxDiff(got.to(torch::kFloat), want.to(torch::kFloat)), 0.02);
  got.to(torch::kFloat).sum().backward();
  EXPECT_EQ(c.first->weight.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(c.position_encoding.grad().scalar_type(), torch::kFloat);
  EXPECT_EQ(tokens.grad().scalar_type(), torch::kBFloat16);
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
