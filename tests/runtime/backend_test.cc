// The backend a config names is the backend that runs: each NSA layer's forward is counted
// per backend by the dispatch (nsa::LayersExecuted), the fused CUDA elementwise ops (RoPE,
// gate mixing) run exactly with the CUDA backend (nsa::FusedCallsExecuted), and environment
// variables named like the field reports' flags switch nothing. GPU cases run only where a
// GPU is present.
#include <ATen/autocast_mode.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>

#include "../common/first_losses.h"
#include "../common/temp_dir.h"
#include "data/shard.h"
#include "model/shared_input_linear.h"
#include "model/transformer.h"
#include "model/weight_copies.h"
#include "nsa/compress.h"
#include "nsa/dispatch.h"
#include "nsad/engine.h"
#include "trainer/optimizer.h"
#include "trainer/step_graph.h"

namespace nsad {
namespace {

// The tiny model of these tests: dim 128 so that the gate MLP's hidden layer (dim / 4 = 32)
// takes the fused gate head; head dim 64, one of the kernels' two.
ModelConfig TinyModel() {
  ModelConfig m;
  m.dim = 128;
  m.n_layers = 2;
  m.n_heads = 4;
  m.n_kv_groups = 2;
  m.head_dim = 64;
  m.nsa = {16, 8, 32, 4, 64};
  return m;
}

class BackendTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<uint32_t> tokens(20000);
    for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>((i * 7) % 251);
    data::WriteShard(tmp_.path() + "/train.bin", tokens, data::TokenWidth::kUint16);
  }
  TrainConfig Tiny(const std::string& device, AttentionBackend backend) const {
    TrainConfig c;
    c.model = TinyModel();
    c.data.train_path = tmp_.path() + "/train.bin";
    c.data.val_fraction = 0.1f;
    c.seq_len = 128;
    c.batch_size = 2;
    c.max_steps = 10;
    c.device = device;
    c.dtype = device == "cpu" ? "float32" : "bfloat16";
    c.attention_backend = backend;
    return c;
  }
  // Runs `steps` steps and returns how many layer forwards each backend executed; the
  // fused elementwise calls of those steps go to *fused.
  std::pair<int64_t, int64_t> Count(const TrainConfig& config, int steps,
                                    int64_t* fused = nullptr) {
    const int64_t ref0 = nsa::LayersExecuted(AttentionBackend::kReference);
    const int64_t cuda0 = nsa::LayersExecuted(AttentionBackend::kCuda);
    const int64_t fused0 = nsa::FusedCallsExecuted();
    auto trainer = Trainer::Create(config);
    for (int i = 0; i < steps; ++i) EXPECT_TRUE(std::isfinite(trainer->Step().loss));
    if (fused != nullptr) *fused = nsa::FusedCallsExecuted() - fused0;
    return {nsa::LayersExecuted(AttentionBackend::kReference) - ref0,
            nsa::LayersExecuted(AttentionBackend::kCuda) - cuda0};
  }
  // Fused calls per layer and step with the CUDA backend: RoPE of q, of the selected+window
  // keys (one call) and of the compressed keys, the gate mixing, the gate MLP's head (silu,
  // its output layer and sigmoid in one), the residual add + the MLP's norm and the SwiGLU.
  static constexpr int64_t kFusedPerLayer = 7;
  // Per step of the 2-layer model: its layers, the first layer's attention norm, the previous
  // MLP output's residual add with the second layer's attention norm and with the final norm,
  // the loss, and the gate statistics of all layers the step reads out (one call).
  static constexpr int64_t kFusedPerStep = 2 * kFusedPerLayer + 3 + 1 + 1;
  testing::TempDir tmp_{"nsad-backend-test"};
};

TEST_F(BackendTest, ReferenceOnCpuRunsOnlyTheReference) {
  // Flags of the kind the field reports found ignored: none of them may matter here.
  ::setenv("NSA_USE_FA2", "1", 1);
  ::setenv("NSAD_ATTENTION_BACKEND", "cuda", 1);
  int64_t fused = -1;
  const auto [reference, cuda] = Count(Tiny("cpu", AttentionBackend::kAuto), 3, &fused);
  EXPECT_EQ(reference, 3 * 2) << "3 steps x 2 layers";
  EXPECT_EQ(cuda, 0);
  EXPECT_EQ(fused, 0);
  ::unsetenv("NSA_USE_FA2");
  ::unsetenv("NSAD_ATTENTION_BACKEND");
}

TEST_F(BackendTest, CudaBackendRunsOnlyTheKernels) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(ProbeRuntime().cuda_kernels) << "a GPU build must have runnable NSA kernels";
  int64_t fused = -1;
  const int64_t joint0 = JointGradientBackwards();
  const auto [reference, cuda] = Count(Tiny("cuda", AttentionBackend::kCuda), 3, &fused);
  EXPECT_EQ(cuda, 3 * 2);
  EXPECT_EQ(reference, 0);
  EXPECT_EQ(fused, 3 * kFusedPerStep) << "RoPE, gate mixing, the gate head, add + norm, SwiGLU, gate statistics and the loss run fused";
  EXPECT_EQ(JointGradientBackwards() - joint0, 3 * 2)
      << "each layer's q, kv and gate gradients reach the input projection as one buffer";
}

TEST_F(BackendTest, AutoOnAGpuPicksTheKernelsAndReferenceStaysReference) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  auto [reference, cuda] = Count(Tiny("cuda", AttentionBackend::kAuto), 2);
  EXPECT_EQ(cuda, 2 * 2);
  EXPECT_EQ(reference, 0);
  int64_t fused = -1;
  std::tie(reference, cuda) = Count(Tiny("cuda", AttentionBackend::kReference), 2, &fused);
  EXPECT_EQ(reference, 2 * 2) << "the reference backend on a GPU is still the reference";
  EXPECT_EQ(cuda, 0);
  EXPECT_EQ(fused, 0) << "the reference backend keeps the reference RoPE and mixing";
}

TEST_F(BackendTest, CudaAndReferenceTrainToTheSameLosses) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  auto losses = [&](AttentionBackend backend) {
    auto config = Tiny("cuda", backend);
    config.dtype = "float32";  // compare the maths, not bf16 rounding
    return testing::FirstLosses(config, 5);
  };
  const auto reference = losses(AttentionBackend::kReference);
  const auto cuda = losses(AttentionBackend::kCuda);
  for (size_t i = 0; i < reference.size(); ++i) {
    EXPECT_NEAR(cuda[i], reference[i], 1e-3 * reference[i]) << "step " << i + 1;
  }
}

// Activation checkpointing on the GPU: the recomputation runs on autograd's device thread,
// where the forward's bf16 autocast state must be restored. Same losses up to the kernels'
// nondeterministic fp32 atomics in dK/dV.
TEST_F(BackendTest, ActivationCheckpointingOnTheGpuTrainsTheSame) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  auto losses = [&](bool checkpointing) {
    auto config = Tiny("cuda", AttentionBackend::kCuda);
    config.activation_checkpointing = checkpointing;
    return testing::FirstLosses(config, 4);
  };
  const int64_t before = nsa::LayersExecuted(AttentionBackend::kCuda);
  const auto recomputed = losses(true);
  EXPECT_EQ(nsa::LayersExecuted(AttentionBackend::kCuda) - before, 4 * 2 * 2)
      << "4 steps x 2 layers, each forward run twice";
  const auto plain = losses(false);
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_NEAR(recomputed[i], plain[i], 2e-3 * plain[i]) << "step " << i + 1;
  }
}

// The step captured in a CUDA graph trains like the eager step: two eager warm-up steps,
// then the capture and replays. Replayed steps run no host code, so the dispatch counts
// only the eager steps' and the capture's forwards.
TEST_F(BackendTest, CudaGraphReplayTrainsLikeTheEagerStep) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  if (std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING")) GTEST_SKIP() << "graphs need the caching allocator";
  auto config = Tiny("cuda", AttentionBackend::kCuda);
  const auto eager = testing::FirstLosses(config, 6);
  config.cuda_graphs = true;
  const int64_t before = nsa::LayersExecuted(AttentionBackend::kCuda);
  const auto graphed = testing::FirstLosses(config, 6);
  EXPECT_EQ(nsa::LayersExecuted(AttentionBackend::kCuda) - before, 3 * 2)
      << "2 eager steps + the capture, x 2 layers; the replays launch no host code";
  for (size_t i = 0; i < eager.size(); ++i) {
    EXPECT_TRUE(std::isfinite(graphed[i])) << "step " << i + 1;
    EXPECT_NEAR(graphed[i], eager[i], 2e-3 * eager[i]) << "step " << i + 1;
  }
}

// A non-finite step under CUDA graphs (the injected fault runs eagerly, on the graph's
// stream) is skipped without touching the weights, and the replays go on afterwards.
TEST_F(BackendTest, CudaGraphsSkipANonFiniteStepAndGoOn) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  if (std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING")) GTEST_SKIP() << "graphs need the caching allocator";
  auto config = Tiny("cuda", AttentionBackend::kCuda);
  config.cuda_graphs = true;
  config.allow_fault_injection = true;
  config.fault_injection.nan_at_step = 5;
  config.fault_injection.count = 1;
  config.nonfinite_policy = "skip";
  auto trainer = Trainer::Create(config);
  for (int step = 1; step <= 8; ++step) {
    const StepMetrics m = trainer->Step();
    if (step == 5) {
      EXPECT_FALSE(m.skipped_reason.empty());
      EXPECT_EQ(m.skipped_steps, 1);
    } else {
      EXPECT_TRUE(m.skipped_reason.empty()) << "step " << step << ": " << m.skipped_reason;
      EXPECT_TRUE(std::isfinite(m.loss)) << "step " << step;
      EXPECT_TRUE(std::isfinite(m.grad_norm)) << "step " << step;
    }
  }
  EXPECT_TRUE(std::isfinite(trainer->Evaluate()));
}

// CompressBlocksTogether on CUDA (its kernels between the GEMMs, kernels/compress_mlp.h:
// float32 parameters, a bf16 or float32 compute type) computes what the composed reference
// ops (CompressBlocks) compute in float64 on the CPU from the same rounded tokens: both
// outputs and every gradient, for r = 1, 2, 4 and the model's l = 32, d = 16, hidden widths
// that are not multiples of a warp, a partial last chunk, and one output without a gradient.
TEST(CompressBlocksTogetherOnCuda, TheKernelsComputeWhatTheReferenceDoes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    int64_t l, d, T, hidden, D;
  };
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto bd = b.to(torch::kDouble).cpu();
    return ((a.to(torch::kDouble).cpu() - bd).norm() / bd.norm()).item<double>();
  };
  for (const auto& c : std::vector<Case>{{32, 16, 300, 128, 64}, {8, 4, 37, 6, 4}, {8, 8, 37, 40, 8}, {8, 2, 21, 33, 4}}) {
    for (const auto ct : {torch::kBFloat16, torch::kFloat}) {
      SCOPED_TRACE("l=" + std::to_string(c.l) + " d=" + std::to_string(c.d) + " T=" + std::to_string(c.T) +
                   " ct=" + std::string(c10::toString(ct)));
      torch::manual_seed(c.l * 1000 + c.d * 10 + c.T);
      nsa::Geometry g;
      g.cmp_block = c.l;
      g.cmp_stride = c.d;
      const int64_t B = 2, G = 2;
      std::vector<nsa::Compressor> cpu, gpu;
      std::vector<torch::Tensor> tokens_cpu, tokens_gpu, inputs_cpu, inputs_gpu;
      for (int p = 0; p < 2; ++p) {
        nsa::Compressor ref{torch::randn({c.l, c.D}, torch::kDouble) * 0.5, torch::nn::Linear(c.l * c.D, c.hidden),
                            torch::nn::Linear(c.hidden, c.D)};
        ref.first->to(torch::kDouble);
        ref.second->to(torch::kDouble);
        nsa::Compressor dev{ref.position_encoding.to(torch::kCUDA, torch::kFloat), torch::nn::Linear(c.l * c.D, c.hidden),
                            torch::nn::Linear(c.hidden, c.D)};
        dev.first->to(torch::kCUDA);
        dev.second->to(torch::kCUDA);
        {
          torch::NoGradGuard no_grad;
          dev.first->weight.copy_(ref.first->weight);
          dev.first->bias.copy_(ref.first->bias);
          dev.second->weight.copy_(ref.second->weight);
          dev.second->bias.copy_(ref.second->bias);
        }
        ref.position_encoding.requires_grad_(true);
        dev.position_encoding.requires_grad_(true);
        const auto x = torch::randn({B, c.T, G, c.D}, torch::TensorOptions().device(torch::kCUDA)).to(ct);
        tokens_gpu.push_back(x.clone().requires_grad_(true));
        tokens_cpu.push_back(x.to(torch::kCPU, torch::kDouble).requires_grad_(true));
        for (auto* side : {&ref, &dev}) {
          auto& in = side == &ref ? inputs_cpu : inputs_gpu;
          in.insert(in.end(), {(side == &ref ? tokens_cpu : tokens_gpu).back(), side->position_encoding,
                               side->first->weight, side->first->bias, side->second->weight, side->second->bias});
        }
        cpu.push_back(ref);
        gpu.push_back(dev);
      }
      const auto got = nsa::CompressBlocksTogether(tokens_gpu, gpu, g);
      const double tol = ct == torch::kFloat ? 1e-4 : 2e-2;
      std::vector<torch::Tensor> want;
      for (int p = 0; p < 2; ++p) {
        want.push_back(nsa::CompressBlocks(tokens_cpu[p], cpu[p].position_encoding, cpu[p].first, cpu[p].second, g));
        ASSERT_EQ(got[p].scalar_type(), ct);
        EXPECT_LT(rel(got[p], want[p]), tol) << "output " << p;
      }
      for (const bool both : {true, false}) {
        const auto w0 = torch::randn_like(want[0]), w1 = torch::randn_like(want[1]);
        auto got_loss = (got[0].to(torch::kDouble) * w0.to(torch::kCUDA)).sum();
        auto want_loss = (want[0] * w0).sum();
        if (both) {
          got_loss = got_loss + (got[1].to(torch::kDouble) * w1.to(torch::kCUDA)).sum();
          want_loss = want_loss + (want[1] * w1).sum();
        }
        const auto got_grads = torch::autograd::grad({got_loss}, inputs_gpu, {}, true, false, true);
        const auto want_grads = torch::autograd::grad({want_loss}, inputs_cpu, {}, true, false, true);
        for (size_t i = 0; i < inputs_gpu.size(); ++i) {
          ASSERT_TRUE(got_grads[i].defined()) << "input " << i;
          if (!want_grads[i].defined() || want_grads[i].norm().item<double>() == 0) {
            EXPECT_EQ(got_grads[i].abs().max().item<double>(), 0) << "input " << i << " both=" << both;
            continue;
          }
          EXPECT_LT(rel(got_grads[i], want_grads[i]), tol) << "input " << i << " both=" << both;
        }
      }
    }
  }
}

// The model's kernels (the NSA branches, RoPE, the gate head and mixing, the norms, SwiGLU,
// the loss, the compression MLP) run on their inputs' device whichever device is current, as
// ATen's ops do: a model on cuda:1 under a current cuda:0 computes the loss and gradients it
// computes on cuda:0. They launch on the current device's stream: before their entries took a
// device guard, the model on cuda:1 gave a loss of 9.78 for 5.58 and NaN gradients, silently.
TEST(KernelsOnTheSecondGpu, RunThereWhicheverDeviceIsCurrent) {
  const RuntimeCapabilities caps = ProbeRuntime();
  if (caps.cuda_devices < 2 || !caps.cuda_kernels) GTEST_SKIP() << "needs two CUDA devices and the NSA kernels";
  const c10::cuda::CUDAGuard current(0);
  torch::manual_seed(11);
  const auto batch = torch::randint(0, 256, {2, 129}, torch::kLong);
  const auto run = [&](int gpu) {
    const torch::Device device(torch::kCUDA, gpu);
    torch::manual_seed(5);
    auto model = NsaTransformer(TinyModel(), AttentionBackend::kCuda);
    model->to(device);
    const auto tokens = batch.to(device);
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    const auto logits = model->forward(tokens.narrow(1, 0, 128));
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    const auto loss = nsa::CrossEntropyLoss(AttentionBackend::kCuda, logits.reshape({-1, logits.size(-1)}),
                                            tokens.narrow(1, 1, 128).reshape({-1}));
    loss.backward();
    EXPECT_EQ(c10::cuda::current_device(), 0) << "the ops leave the current device as they found it";
    std::vector<torch::Tensor> results = {loss.detach().cpu()};
    for (const auto& p : model->parameters()) results.push_back(p.grad().cpu());
    return results;
  };
  const auto first = run(0), second = run(1);
  ASSERT_EQ(first.size(), second.size());
  EXPECT_NEAR(second[0].item<double>(), first[0].item<double>(), 1e-3 * first[0].item<double>());
  for (size_t i = 1; i < first.size(); ++i) {
    const double scale = first[i].norm().item<double>();
    EXPECT_LE((second[i] - first[i]).norm().item<double>(), 1e-2 * scale + 1e-12) << "gradient " << i;
  }
}

// On CUDA under bf16 autocast a linear layer's weight gradient comes out of the GEMM in
// float32 (ApplyLinear's own node), where at::linear's is written in bf16 and cast: the same
// output and input gradient, and a weight gradient closer to the float64 one computed from
// the same bf16 operands. The tied LM head's ApplyWeight likewise.
TEST(LinearOnCuda, WeightGradientLeavesTheGemmInFloat32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(3);
  const auto cuda = torch::TensorOptions().device(torch::kCUDA);
  torch::nn::Linear layer(256, 384);
  layer->to(torch::kCUDA);
  const auto x = torch::randn({4, 257, 256}, cuda).requires_grad_(true);
  const auto dy = torch::randn({4, 257, 384}, cuda.dtype(torch::kBFloat16));
  at::autocast::set_autocast_enabled(at::kCUDA, true);
  at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
  const auto ours = ApplyLinear(layer, x);
  const auto theirs = at::linear(x, layer->weight, layer->bias);
  const auto head = ApplyWeight(x, layer->weight);
  at::autocast::set_autocast_enabled(at::kCUDA, false);
  at::autocast::clear_cache();
  ASSERT_EQ(ours.scalar_type(), torch::kBFloat16);
  ASSERT_EQ(head.scalar_type(), torch::kBFloat16);
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto bd = b.to(torch::kDouble);
    return ((a.to(torch::kDouble) - bd).norm() / bd.norm()).item<double>();
  };
  EXPECT_LT(rel(ours, theirs), 1e-2);
  const auto g_ours = torch::autograd::grad({ours}, {x, layer->weight, layer->bias}, {dy});
  const auto g_theirs = torch::autograd::grad({theirs}, {x, layer->weight, layer->bias}, {dy});
  const auto g_head = torch::autograd::grad({head}, {layer->weight}, {dy})[0];
  EXPECT_LT(rel(g_ours[0], g_theirs[0]), 1e-2);
  EXPECT_LT(rel(g_ours[2], g_theirs[2]), 1e-2);
  ASSERT_EQ(g_ours[1].scalar_type(), torch::kFloat);
  const auto dw_exact = torch::mm(dy.reshape({-1, 384}).t().to(torch::kDouble),
                                  x.detach().reshape({-1, 256}).to(torch::kBFloat16).to(torch::kDouble));
  const double ours_err = rel(g_ours[1], dw_exact), theirs_err = rel(g_theirs[1], dw_exact);
  std::printf("    dW rel err: float32 out %.2e, bf16 out and cast %.2e\n", ours_err, theirs_err);
  EXPECT_LT(ours_err, 0.5 * theirs_err);
  EXPECT_LT(rel(g_head, dw_exact), 0.5 * theirs_err);
}

// On CUDA under bf16 autocast the model's GEMMs read its 16-bit weight copies (one
// multi-tensor copy per forward) instead of casting each weight: every GEMM weight of every
// forward comes from the copies, and the logits and every gradient are those of the casts,
// also after an in-place update of the weights (the optimizer's).
TEST(WeightCopiesOnCuda, TheModelReadsItsCopiesAndComputesWhatTheCastsDo) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(11);
  const ModelConfig config = TinyModel();
  NsaTransformer model(config, AttentionBackend::kCuda);
  model->to(torch::kCUDA);
  const auto tokens = torch::randint(0, config.vocab_size, {2, 200}, torch::TensorOptions(torch::kCUDA).dtype(torch::kLong));
  struct Pass {
    torch::Tensor logits;
    std::vector<torch::Tensor> grads;
    int64_t joints_served = 0;
  };
  auto run = [&](bool copies) {
    model->set_weight_copies(copies);
    model->zero_grad();
    Pass pass;
    const int64_t served = WeightCopies::JointsServed();
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    pass.logits = model->forward(tokens);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    pass.joints_served = WeightCopies::JointsServed() - served;
    pass.logits.to(torch::kFloat).logsumexp(-1).mean().backward();
    for (const auto& p : model->parameters()) {
      pass.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
    }
    return pass;
  };
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto bd = b.to(torch::kDouble);
    return ((a.to(torch::kDouble) - bd).norm() / bd.norm().clamp_min(1e-30)).item<double>();
  };
  // Per layer: q|kv|gate, the gate head, the out projection, the MLP's gate|up and its down
  // projection; then the LM head.
  const int64_t gemms_per_forward = 5 * config.n_layers + 1;
  for (int round = 0; round < 2; ++round) {
    const auto with = run(true), without = run(false);
    EXPECT_EQ(with.joints_served, gemms_per_forward) << "round " << round;
    EXPECT_EQ(without.joints_served, 0) << "round " << round;
    // The dK/dV kernels add in float32 with atomics (not bit-reproducible), so gradients are
    // compared at a tolerance far below what a misplaced or stale weight would give.
    EXPECT_LT(rel(with.logits, without.logits), 1e-3) << "round " << round;
    ASSERT_EQ(with.grads.size(), without.grads.size());
    for (size_t i = 0; i < with.grads.size(); ++i) {
      ASSERT_EQ(with.grads[i].defined(), without.grads[i].defined()) << "parameter " << i;
      if (with.grads[i].defined()) {
        EXPECT_LT(rel(with.grads[i], without.grads[i]), 1e-2) << "round " << round << " parameter " << i;
      }
    }
    torch::NoGradGuard no_grad;  // an optimizer-like in-place update before the next round
    for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
}

// The optimizer writes the model's weight copies as it updates the weights (AdamW::Step given
// the model's copies): after every step each copy is its weight's cast bit for bit and the
// next forward copies none of them, eager and replayed from a CUDA graph (whose captured
// forward then copies nothing). A weight written by anything else (an in-place add here, as a
// checkpoint's load would) is copied again: by the next eager forward, or before a replay by
// RefreshStaleWeightCopies.
TEST(WeightCopiesOnCuda, TheOptimizerKeepsTheCopiesCurrentEagerAndInAGraph) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  if (std::getenv("PYTORCH_NO_CUDA_MEMORY_CACHING")) GTEST_SKIP() << "graphs need the caching allocator";
  torch::manual_seed(12);
  const torch::Device cuda(torch::kCUDA, 0);
  const ModelConfig config = TinyModel();
  NsaTransformer model(config, AttentionBackend::kCuda);
  model->to(cuda);
  OptimConfig optim;
  optim.lr = 1e-2f;  // large enough that every step moves bf16 values
  optim.weight_decay = 0.1f;
  optim.grad_clip = 1.0f;
  AdamW optimizer = AdamW::ForModel(model->parameters(), optim);
  optimizer.SetLr(optim.lr);
  WeightCopies* copies = model->weight_copies_for_update();
  ASSERT_NE(copies, nullptr);
  StepGraph graph(cuda);
  const auto stream = graph.UseStream();  // every step on the graph's stream, as the trainer runs them
  const auto tokens = torch::randint(0, config.vocab_size, {2, 200}, torch::TensorOptions(cuda).dtype(torch::kLong));
  const auto step = [&] {
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    const auto logits = model->forward(tokens);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    const auto loss = logits.to(torch::kFloat).logsumexp(-1).mean();
    loss.backward();
    const auto norm = optimizer.ClipGradNorm(optim.grad_clip);
    optimizer.Step(AdamW::NonFiniteFlag(loss.detach(), norm), copies);
    return loss.detach();
  };
  // Per layer: q|kv|gate's three weights, the gate head, the out projection, the MLP's
  // gate|up and down; then the tied embedding.
  const int64_t weights = 8 * config.n_layers + 1;
  const auto expect_current = [&](const std::string& when) {
    torch::cuda::synchronize();
    int64_t checked = 0;
    for (const auto& p : model->parameters()) {
      const auto copy = copies->CopyOf(p);
      if (!copy.defined()) continue;
      ++checked;
      EXPECT_TRUE(torch::equal(copy, p.detach().to(torch::kBFloat16))) << when << ": " << p.sizes();
    }
    EXPECT_EQ(checked, weights) << when;
  };
  const auto some_weight = [&] {
    for (const auto& p : model->parameters()) {
      if (copies->CopyOf(p).defined()) return p;
    }
    return torch::Tensor();
  };

  optimizer.ZeroGrad();
  step();
  EXPECT_EQ(copies->weights_copied(), weights) << "the first forward copies every weight";
  expect_current("after the first step");
  const auto before = some_weight().detach().clone();
  optimizer.ZeroGrad();
  step();
  EXPECT_EQ(copies->weights_copied(), weights) << "the optimizer kept every copy current";
  expect_current("after the second step");
  EXPECT_FALSE(torch::equal(before, some_weight().detach())) << "the weights must move";

  {
    torch::NoGradGuard no_grad;
    some_weight().add_(0.5);
  }
  optimizer.ZeroGrad();
  step();
  EXPECT_EQ(copies->weights_copied(), weights + 1) << "a weight written elsewhere is copied by the next forward";
  expect_current("after the third step");

  optimizer.ZeroGrad();  // the captured backward allocates the gradients in the graph's pool
  graph.Capture([&] { return step(); });
  for (int replay = 0; replay < 3; ++replay) {
    model->RefreshStaleWeightCopies();
    const auto loss = graph.Replay();
    EXPECT_TRUE(std::isfinite(loss.item<float>()));
    expect_current("after replay " + std::to_string(replay));
  }
  EXPECT_EQ(copies->weights_copied(), weights + 1) << "neither the capture nor the replays copied a weight";
  {
    torch::NoGradGuard no_grad;
    some_weight().add_(0.5);
  }
  model->RefreshStaleWeightCopies();
  EXPECT_EQ(copies->weights_copied(), weights + 2);
  expect_current("a weight written between replays, before the next replay");
  graph.Replay();
  expect_current("after the last replay");
}

}  // namespace
}  // namespace nsad
