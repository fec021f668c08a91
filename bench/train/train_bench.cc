// train_bench: tokens/s of one training step (forward, backward, AdamW) of the m7c 125M
// model at seq 2048 in bf16 autocast, for
//   nsa-cuda       the NSA transformer with the custom kernels
//   nsa-reference  the same model on the plain-LibTorch reference (the oracle)
//   dense-flash    a GPT of the same width/depth/heads/GQA/MLP with dense causal attention
//                  through PyTorch's SDPA (FlashAttention), the baseline of the issue
// at batch 1 and 16. Every variant runs the trainer's step: the optimizer is the trainer's
// (nsad::AdamW: decay on matrices, clipping at 1.0, found_inf skip, all on the device), and
// the step ends with the trainer's one host read of loss, gradient norm and (NSA) every
// layer's gate statistics (--gate-stats 0 leaves those out, as before 2026-11-23's seventh
// session). Random tokens
// already on the GPU (data loading is not measured) are copied into the step's input, a
// warm-up, then the median of timed steps with CUDA synchronisation around each step.
//   train_bench [--batches 1,16] [--seq 2048] [--steps 20] [--variants a,b]
//               [--cuda-graphs 0|1|0,1] [--torch-optim 1] [--fused-loss 0] [--breakdown 1]
//               [--profile N] [--slc-dq auto|query|fused] [--slc-fwd auto|rows|heads|tiled|blocks]
//               [--slc-dkdv auto|staged16x3|staged32x1|staged32x3|unstaged|wgmma]
//               [--slc-order auto|block|position] [--slc-qpc N]
//               [--win-fwd auto|flash|tiled] [--win-bwd auto|flash|wgmma] [--tiled-mma auto|sync|wgmma|wgmma1] [--gate-stats 0]
//               [--cmp-key-side auto|smem|wgmma] [--cmp-pass auto|two]
//               [--gemm auto|cublas|tuned] [--batch-pool N] [--lr-warmup 1] [--spread 1]
// --cuda-graphs 1 captures the step in a CUDA graph after the warm-up and replays it (the
// trainer's cuda_graphs, trainer/step_graph.h); "0,1" (the default) measures each variant
// both ways (rows "+graph"; nsa-reference eager only). --torch-optim 1 adds a row per variant with the trainer's previous
// optimizer path (LibTorch's per-tensor AdamW and clip_grad_norm_, "+torchopt"), eager.
// The loss is the trainer's nsa::CrossEntropyLoss (the fused kernels for nsa-cuda and
// dense-flash alike); --fused-loss 0 uses LibTorch's float32 cross_entropy instead.
// --breakdown 1 also times each phase (forward, backward, clip, optimizer) of the timed steps
// twice: as the host enqueues it and with a device synchronisation after it. A phase whose
// two numbers agree is bound by the host (launch/dispatch overhead or a hidden sync), one
// whose synchronised time is much larger is bound by the GPU.
// --slc-dq / --slc-fwd / --slc-dkdv force where the selected branch's dQ comes from (the
// query-side kernel or fused into the dK/dV kernel), its forward kernel and its dK/dV kernel,
// --slc-order / --slc-qpc its dK/dV work items' order and size (kernels/kernel_choice.h),
// for A/B runs of the training step in one invocation, and --win-fwd the window branch's
// forward (the tiled kernel or FlashAttention-2's), --win-bwd its backward (the warpgroup-MMA
// kernel or FlashAttention-2's), --tiled-mma the tiled forward's matrix
// instructions (mma.sync or warpgroup MMAs, CTAs of two warpgroups or of one); auto (the default) is the dispatch training
// uses.
// --gemm tuned (and auto) runs the linear layers' GEMMs on cuBLASLt with each shape's fastest
// algorithm, timed on its first call (kernels/tuned_gemm.h); cublas runs at::mm (cuBLAS).
// --batch-pool N cycles the step's input through N different random batches (default 1: the
// same batch every step) and --lr-warmup 1 sets each step's learning rate by the trainer's
// schedule with m7c's warmup (trainer/schedule.h; default: 6e-4 throughout), both as the
// daemon trains; --spread 1 prints the timed steps' minimum, 90th percentile and maximum
// under each row. Together they tell a step time that follows the data and the weights from
// one the bench's repeated batch hides (PERFORMANCE.md, thirty-first session).
// --profile N records one extra step with the legacy LibTorch profiler (CUDA events, no
// kineto needed) and prints the N ops with the most host time and with the most GPU time,
// plus the op count per step and any op that copies to the host (a sync).
#include <ATen/autocast_mode.h>
#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/torch.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "model/rms_norm.h"
#include "model/shared_input_linear.h"
#include "model/transformer.h"
#include "nsa/dispatch.h"
#include "trainer/optimizer.h"
#include "trainer/schedule.h"
#include "trainer/step_graph.h"
#ifdef NSAD_HAVE_CUDA_KERNELS
#include "kernel_choice_names.h"
#endif

namespace {

using nsad::AttentionBackend;
using nsad::ModelConfig;

// The dense baseline: same embedding, pre-norm blocks, SwiGLU width and untied head as the
// NSA model, with one q/k/v projection and causal flash attention (GQA without expanding
// K/V: SDPA's enable_gqa).
struct DenseBlockImpl : torch::nn::Module {
  DenseBlockImpl(const ModelConfig& c)
      : h(c.n_heads), g(c.n_kv_groups), d(c.head_dim) {
    const int hidden = nsad::EffectiveMlpHidden(c);
    n1 = register_module("n1", nsad::RmsNorm(c.dim, c.norm_eps));
    n2 = register_module("n2", nsad::RmsNorm(c.dim, c.norm_eps));
    qkv = register_module("qkv", torch::nn::Linear(torch::nn::LinearOptions(c.dim, (h + 2 * g) * d).bias(false)));
    o = register_module("o", torch::nn::Linear(torch::nn::LinearOptions(h * d, c.dim).bias(false)));
    w1 = register_module("w1", torch::nn::Linear(torch::nn::LinearOptions(c.dim, hidden).bias(false)));
    w3 = register_module("w3", torch::nn::Linear(torch::nn::LinearOptions(c.dim, hidden).bias(false)));
    w2 = register_module("w2", torch::nn::Linear(torch::nn::LinearOptions(hidden, c.dim).bias(false)));
  }
  torch::Tensor forward(torch::Tensor x) {
    const auto B = x.size(0), T = x.size(1);
    auto parts = qkv->forward(n1->forward(x)).split({h * d, g * d, g * d}, -1);
    auto q = parts[0].view({B, T, h, d}).transpose(1, 2);
    auto k = parts[1].view({B, T, g, d}).transpose(1, 2);
    auto v = parts[2].view({B, T, g, d}).transpose(1, 2);
    auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true,
                                              std::nullopt, /*enable_gqa=*/true);
    x = x + o->forward(a.transpose(1, 2).reshape({B, T, h * d}));
    // As the NSA model: one GEMM for w1 and w3, the fused SwiGLU.
    const auto gate_up = nsad::SharedInputLinearJoint(n2->forward(x), {w1, w3});
    return x + w2->forward(nsad::nsa::SwiGlu(AttentionBackend::kCuda, gate_up));
  }
  int64_t h, g, d;
  nsad::RmsNorm n1{nullptr}, n2{nullptr};
  torch::nn::Linear qkv{nullptr}, o{nullptr}, w1{nullptr}, w3{nullptr}, w2{nullptr};
};
TORCH_MODULE(DenseBlock);

struct DenseGptImpl : torch::nn::Module {
  explicit DenseGptImpl(const ModelConfig& c) {
    embed = register_module("embed", torch::nn::Embedding(c.vocab_size, c.dim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < c.n_layers; ++i) blocks->push_back(DenseBlock(c));
    norm = register_module("norm", nsad::RmsNorm(c.dim, c.norm_eps));
    head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab_size).bias(false)));
  }
  torch::Tensor forward(const torch::Tensor& tokens) {
    auto x = embed->forward(tokens);
    for (const auto& b : *blocks) x = b->as<DenseBlockImpl>()->forward(x);
    return head->forward(norm->forward(x));
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  nsad::RmsNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(DenseGpt);

struct Options {
  bool cuda_graphs = false;
  bool torch_optim = false;  // LibTorch's AdamW + clip_grad_norm_ (the trainer's path before)
  bool breakdown = false;
  int profile_top = 0;  // 0: no profile
  // The loss's implementation: the trainer's (nsa::CrossEntropyLoss: fused kernels when the
  // backend is CUDA) or LibTorch's float32 cross_entropy (--fused-loss 0, the path before).
  bool fused_loss = true;
  AttentionBackend loss_backend = AttentionBackend::kCuda;
  bool gate_stats = true;  // NSA steps end with the gate statistics, as the trainer's do
  int batch_pool = 1;       // distinct input batches, cycled step by step
  bool lr_warmup = false;   // the trainer's schedule from step 0 instead of a constant lr
  bool spread = false;      // print min / p90 / max of the timed steps
};

struct Result {
  double median_ms = 0, tokens_per_second = 0;
  double min_ms = 0, p90_ms = 0, max_ms = 0;
  int64_t parameters = 0;
  std::string error;
};

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double MsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// Aggregates the legacy profiler's push/pop pairs per op name: host time (inclusive), GPU
// time between the op's CUDA start/end events (inclusive), and calls.
void PrintProfile(const torch::autograd::profiler::thread_event_lists& lists, int top) {
  using torch::autograd::profiler::EventKind;
  using torch::autograd::profiler::LegacyEvent;
  struct Agg {
    double cpu_us = 0, cuda_us = 0;
    int64_t calls = 0;
  };
  std::map<std::string, Agg> by_name;
  int64_t ops = 0;
  for (const auto& list : lists) {
    std::map<uint64_t, const LegacyEvent*> open;  // handle -> push event
    for (const auto& e : list) {
      if (e.kind() == EventKind::PushRange) {
        open[e.handle()] = &e;
      } else if (e.kind() == EventKind::PopRange) {
        const auto it = open.find(e.handle());
        if (it == open.end()) continue;
        auto& a = by_name[it->second->name()];
        a.cpu_us += it->second->cpuElapsedUs(e);
        if (it->second->hasCuda() && e.hasCuda()) a.cuda_us += it->second->cudaElapsedUs(e);
        ++a.calls;
        ++ops;
        open.erase(it);
      }
    }
  }
  std::vector<std::pair<std::string, Agg>> rows(by_name.begin(), by_name.end());
  auto print = [&](const char* title, auto key) {
    std::sort(rows.begin(), rows.end(), [&](const auto& a, const auto& b) { return key(a.second) > key(b.second); });
    std::printf("  %s (inclusive; nested ops count in their parents too)\n", title);
    std::printf("    %-52s %8s %11s %11s\n", "op", "calls", "host_ms", "gpu_ms");
    for (int i = 0; i < top && i < static_cast<int>(rows.size()); ++i) {
      std::printf("    %-52.52s %8lld %11.3f %11.3f\n", rows[i].first.c_str(),
                  static_cast<long long>(rows[i].second.calls), rows[i].second.cpu_us / 1e3,
                  rows[i].second.cuda_us / 1e3);
    }
  };
  std::printf("  profiled step: %lld recorded ops\n", static_cast<long long>(ops));
  print("top ops by host time", [](const Agg& a) { return a.cpu_us; });
  print("top ops by GPU time", [](const Agg& a) { return a.cuda_us; });
  for (const char* sync_op : {"aten::_local_scalar_dense", "aten::item", "aten::nonzero"}) {
    const auto it = by_name.find(sync_op);
    std::printf("  host syncs via %s: %lld\n", sync_op,
                static_cast<long long>(it == by_name.end() ? 0 : it->second.calls));
  }
}

template <typename Model>
Result Measure(Model model, int batch, int seq, int steps, int vocab, const Options& opt) {
  Result r;
  const torch::Device cuda(torch::kCUDA, 0);
  model->to(cuda);
  for (const auto& p : model->parameters()) r.parameters += p.numel();
  // m7c's optimizer and schedule, the shipped config's (configs/m7c_125m.json; a test keeps
  // the two equal).
  const nsad::TrainConfig m7c = nsad::M7cTrainConfig();
  const nsad::OptimConfig& optim = m7c.optim;
  nsad::AdamW optimizer = nsad::AdamW::ForModel(model->parameters(), optim);
  optimizer.SetLr(optim.lr);
  std::optional<nsad::StepGraph> graph;
  std::shared_ptr<void> stream;  // graphs: all steps on the graph's side stream
  if (opt.cuda_graphs) {
    graph.emplace(cuda);
    stream = graph->UseStream();
  }
  std::vector<torch::Tensor> pool;  // --batch-pool: the step's inputs, cycled
  for (int i = 0; i < std::max(1, opt.batch_pool); ++i) {
    pool.push_back(torch::randint(vocab, {batch, seq + 1}, torch::TensorOptions().dtype(torch::kLong).device(cuda)));
  }
  const auto batch_tokens = pool[0].clone();  // the step's input buffer (static under a graph)
  int64_t step_index = 0;  // steps run so far, warm-up included
  const auto inputs = batch_tokens.narrow(1, 0, seq), targets = batch_tokens.narrow(1, 1, seq);
  // Phase boundaries: with `sync` each phase ends with a device synchronisation and its time
  // lands in `phase_ms` (host enqueue time in `enqueue_ms`, taken before the sync).
  constexpr int kPhases = 4;
  const char* const phase_names[kPhases] = {"forward+loss", "backward", "clip_grad_norm", "adamw"};
  std::vector<double> phase_ms[kPhases], enqueue_ms[kPhases];
  // Forward under bf16 autocast and the float32 cross-entropy, as the trainer computes it.
  auto forward_loss = [&] {
    torch::Tensor logits;
    {
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      logits = model->forward(inputs);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
    }
    const auto flat = logits.view({-1, vocab});
    if (!opt.fused_loss) return torch::nn::functional::cross_entropy(flat.to(torch::kFloat), targets.reshape({-1}));
    return nsad::nsa::CrossEntropyLoss(opt.loss_backend, flat, targets.reshape({-1}));
  };
  // The step's device work up to the [loss, grad norm] readout (what the graph captures).
  auto body = [&](auto mark) {
    auto loss = forward_loss();
    mark();
    loss.backward();
    mark();
    const auto loss_value = loss.detach().to(torch::kFloat64);
    const auto norm = optimizer.ClipGradNorm(optim.grad_clip);
    mark();
    nsad::WeightCopies* copies = nullptr;  // the trainer's: the update writes the NSA model's weight copies
    if constexpr (std::is_same_v<Model, nsad::NsaTransformer>) copies = model->weight_copies_for_update();
    optimizer.Step(nsad::AdamW::NonFiniteFlag(loss_value, norm), copies);
    std::vector<torch::Tensor> parts = {loss_value.reshape({1}), norm.to(torch::kFloat64).reshape({1})};
    if constexpr (std::is_same_v<Model, nsad::NsaTransformer>) {
      // The trainer's readout also carries every layer's gate statistics (GetGates).
      if (opt.gate_stats) parts.push_back(model->last_gate_stats_tensor().to(torch::kFloat64).flatten());
    }
    mark();
    return torch::cat(parts);
  };
  // The previous trainer step, for comparison: per-tensor LibTorch AdamW and
  // clip_grad_norm_ (with its .item()), one optimizer over the same two groups.
  std::unique_ptr<torch::optim::AdamW> legacy;
  if (opt.torch_optim) {
    std::vector<torch::Tensor> decay, no_decay;
    for (const auto& p : model->parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
    const auto options = torch::optim::AdamWOptions(optim.lr).betas({optim.beta1, optim.beta2}).eps(optim.eps);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                   torch::optim::AdamWOptions(options).weight_decay(optim.weight_decay)));
    groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                      torch::optim::AdamWOptions(options).weight_decay(0.0)));
    legacy = std::make_unique<torch::optim::AdamW>(std::move(groups), options);
  }
  auto legacy_body = [&](auto mark) {
    auto loss = forward_loss();
    mark();
    loss.backward();
    mark();
    const double norm = torch::nn::utils::clip_grad_norm_(model->parameters(), optim.grad_clip);
    mark();
    legacy->step();
    mark();
    return torch::stack({loss.detach().to(torch::kFloat64), torch::tensor(norm, torch::kFloat64).to(cuda)});
  };
  auto step = [&](bool sync) {
    auto t0 = std::chrono::steady_clock::now();
    int phase = 0;
    auto mark = [&] {
      if (!sync) return;
      enqueue_ms[phase].push_back(MsSince(t0));
      torch::cuda::synchronize();
      phase_ms[phase].push_back(MsSince(t0));
      ++phase;
      t0 = std::chrono::steady_clock::now();
    };
    batch_tokens.copy_(pool[step_index % static_cast<int64_t>(pool.size())]);
    optimizer.SetLr(opt.lr_warmup ? nsad::ScheduledLr(optim, step_index, m7c.max_steps) : optim.lr);
    ++step_index;
    torch::Tensor readout;
    if (opt.torch_optim) {
      legacy->zero_grad(true);
      readout = legacy_body(mark);
    } else if (graph && graph->captured()) {
      if constexpr (std::is_same_v<Model, nsad::NsaTransformer>) model->RefreshStaleWeightCopies();
      readout = graph->Replay();
    } else {
      optimizer.ZeroGrad();
      readout = body(mark);
    }
    const auto host = readout.to(torch::kCPU);  // the trainer's one host read per step
    (void)host;
  };
  const int warmup = 3;
  for (int i = 0; i < warmup; ++i) step(false);
  torch::cuda::synchronize();
  if (graph) {
    optimizer.ZeroGrad();  // the captured backward allocates the gradients in the graph's pool
    graph->Capture([&] { return body([] {}); });
  }
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step(false);
    torch::cuda::synchronize();
    ms.push_back(MsSince(t0));
  }
  r.median_ms = Median(ms);
  std::sort(ms.begin(), ms.end());  // the spread, in place (ms is not read again)
  if (!ms.empty()) {
    r.min_ms = ms.front();
    r.max_ms = ms.back();
    r.p90_ms = ms[std::min(ms.size() - 1, ms.size() * 9 / 10)];
  }
  r.tokens_per_second = batch * seq / (r.median_ms / 1e3);
  if (opt.breakdown && !graph) {
    for (int i = 0; i < steps; ++i) step(true);
    std::printf("  breakdown, batch %d (median ms; host = enqueue time before the sync):\n", batch);
    double total = 0;
    for (int p = 0; p < kPhases; ++p) {
      total += Median(phase_ms[p]);
      std::printf("    %-16s host %9.2f  synced %9.2f\n", phase_names[p], Median(enqueue_ms[p]),
                  Median(phase_ms[p]));
    }
    std::printf("    %-16s %25.2f\n", "sum", total);
  }
  if (opt.profile_top > 0 && !graph) {
    torch::cuda::synchronize();
    using torch::profiler::impl::ProfilerConfig;
    using torch::profiler::impl::ProfilerState;
    torch::autograd::profiler::thread_event_lists lists;
    {
      torch::autograd::profiler::TLSLegacyProfilerGuard guard(
          ProfilerConfig(ProfilerState::CUDA),
          [&](const torch::autograd::profiler::thread_event_lists& l) { lists = l; });
      step(false);
      torch::cuda::synchronize();
    }
    PrintProfile(lists, opt.profile_top);
  }
  return r;
}

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) out.push_back(item);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const nsad::TrainConfig m7c = nsad::M7cTrainConfig();
  std::vector<int> batches = {1, 16};
  int seq = m7c.seq_len, steps = 20;
  std::vector<std::string> variants = {"nsa-cuda", "dense-flash", "nsa-reference"};
  std::vector<bool> graph_modes = {false, true};
  bool torch_optim = false;
  Options opt;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--batches") {
      batches.clear();
      for (const auto& b : Split(value)) batches.push_back(std::stoi(b));
    } else if (flag == "--seq") {
      seq = std::stoi(value);
    } else if (flag == "--steps") {
      steps = std::stoi(value);
    } else if (flag == "--variants") {
      variants = Split(value);
    } else if (flag == "--cuda-graphs") {
      graph_modes.clear();
      for (const auto& g : Split(value)) graph_modes.push_back(g != "0");
    } else if (flag == "--torch-optim") {
      torch_optim = value != "0";
    } else if (flag == "--breakdown") {
      opt.breakdown = value != "0";
    } else if (flag == "--fused-loss") {
      opt.fused_loss = value != "0";
    } else if (flag == "--gate-stats") {
      opt.gate_stats = value != "0";
    } else if (flag == "--batch-pool") {
      opt.batch_pool = std::stoi(value);
      if (opt.batch_pool < 1) {
        std::fprintf(stderr, "--batch-pool takes a count of 1 or more\n");
        return 2;
      }
    } else if (flag == "--lr-warmup") {
      opt.lr_warmup = value != "0";
    } else if (flag == "--spread") {
      opt.spread = value != "0";
    } else if (flag == "--profile") {
      opt.profile_top = std::stoi(value);
    } else if (flag == "--win-fwd" || flag == "--win-bwd") {
#ifdef NSAD_HAVE_CUDA_KERNELS
      auto choice = nsad::nsa::cuda::detail::GetWindowKernelChoice();  // keeps the other flag's half
      const bool ok = flag == "--win-fwd"
                          ? nsad::bench::ParseChoiceFlag("--win-fwd", nsad::bench::kWinFwdNames, value, choice.forward)
                          : nsad::bench::ParseChoiceFlag("--win-bwd", nsad::bench::kWinBwdNames, value, choice.backward);
      if (!ok) return 2;
      nsad::nsa::cuda::detail::SetWindowKernelChoiceForTesting(choice);
      std::printf("# window %s: %s\n", flag == "--win-fwd" ? "forward" : "backward", value.c_str());
#else
      std::fprintf(stderr, "%s needs the CUDA kernels (this build has none)\n", flag.c_str());
      return 2;
#endif
    } else if (flag == "--cmp-key-side" || flag == "--cmp-pass") {
#ifdef NSAD_HAVE_CUDA_KERNELS
      auto choice = nsad::nsa::cuda::detail::GetCompressedKernelChoice();  // keeps the other flag's part
      const bool key_side = flag == "--cmp-key-side";
      using nsad::bench::ParseChoiceFlag;
      const bool ok = key_side
                          ? ParseChoiceFlag("--cmp-key-side", nsad::bench::kCmpKeySideNames, value, choice.key_side)
                          : ParseChoiceFlag("--cmp-pass", nsad::bench::kCmpPassNames, value, choice.pass);
      if (!ok) return 2;
      nsad::nsa::cuda::detail::SetCompressedKernelChoiceForTesting(choice);
      std::printf("# compressed %s: %s\n", key_side ? "backward's key side" : "forward's passes", value.c_str());
#else
      std::fprintf(stderr, "%s needs the CUDA kernels (this build has none)\n", flag.c_str());
      return 2;
#endif
    } else if (flag == "--gemm" || flag == "--tiled-mma") {
#ifdef NSAD_HAVE_CUDA_KERNELS
      namespace kc = nsad::nsa::cuda::detail;
      const bool gemm = flag == "--gemm";
      const bool ok = gemm ? nsad::bench::SetOneFieldChoice("--gemm", nsad::bench::kGemmNames, value,
                                                            &kc::GemmChoice::algo, &kc::SetGemmChoiceForTesting)
                           : nsad::bench::SetOneFieldChoice("--tiled-mma", nsad::bench::kTiledMmaNames, value,
                                                            &kc::TiledForwardChoice::mma,
                                                            &kc::SetTiledForwardChoiceForTesting);
      if (!ok) return 2;
      std::printf("# %s: %s\n", gemm ? "linear layers' GEMMs" : "tiled forward's MMAs", value.c_str());
#else
      std::fprintf(stderr, "%s needs the CUDA kernels (this build has none)\n", flag.c_str());
      return 2;
#endif
    } else if (flag == "--slc-dq" || flag == "--slc-fwd" || flag == "--slc-dkdv" || flag == "--slc-order" ||
               flag == "--slc-qpc") {
#ifdef NSAD_HAVE_CUDA_KERNELS
      using nsad::bench::ParseChoiceFlag;
      auto choice = nsad::nsa::cuda::detail::GetSelectedKernelChoice();
      bool known = true;
      if (flag == "--slc-dq") known = ParseChoiceFlag("--slc-dq", nsad::bench::kSlcDqNames, value, choice.dq);
      if (flag == "--slc-fwd") known = ParseChoiceFlag("--slc-fwd", nsad::bench::kSlcFwdNames, value, choice.fwd);
      if (flag == "--slc-dkdv") known = ParseChoiceFlag("--slc-dkdv", nsad::bench::kSlcDkDvNames, value, choice.dkdv);
      if (flag == "--slc-order") known = ParseChoiceFlag("--slc-order", nsad::bench::kSlcOrderNames, value, choice.order);
      if (flag == "--slc-qpc") {
        choice.queries_per_item = std::atoi(value.c_str());
        known = choice.queries_per_item >= 0 &&
                choice.queries_per_item <= nsad::nsa::cuda::detail::kMaxSelectedQueriesPerItem;
        if (!known) {
          std::fprintf(stderr, "--slc-qpc takes 0 (auto) or 1..%d\n",
                       nsad::nsa::cuda::detail::kMaxSelectedQueriesPerItem);
        }
      }
      if (!known) return 2;
      nsad::nsa::cuda::detail::SetSelectedKernelChoiceForTesting(choice);
      std::printf("# selected kernels: %s %s\n", flag.c_str(), value.c_str());
#else
      std::fprintf(stderr, "%s needs the CUDA kernels (this build has none)\n", flag.c_str());
      return 2;
#endif
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::printf("train_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  const ModelConfig& config = m7c.model;
  std::printf("m7c: dim %d, %d layers, %d heads, %d kv groups, head dim %d, seq %d, bf16 autocast, AdamW\n",
              config.dim, config.n_layers, config.n_heads, config.n_kv_groups, config.head_dim, seq);
  std::printf("%-24s %5s %12s %12s %12s\n", "variant", "batch", "params", "step_ms", "tok/s");
  for (int batch : batches) {
    for (const auto& variant : variants) {
      // Modes: each --cuda-graphs value, then (--torch-optim 1) the previous optimizer path.
      std::vector<std::pair<bool, bool>> modes;  // {graphs, torch_optim}
      for (const bool graphs : graph_modes) modes.push_back({graphs, false});
      if (torch_optim) modes.push_back({false, true});
      for (const auto& [graphs, old_optim] : modes) {
        // The trainer allows graphs with the CUDA backend only (the reference is the oracle,
        // not a capturable fast path).
        if (graphs && variant == "nsa-reference") continue;
        Result r;
        Options o = opt;
        o.cuda_graphs = graphs;
        o.torch_optim = old_optim;
        try {
          torch::manual_seed(0);
          if (variant == "dense-flash") {
            r = Measure(DenseGpt(config), batch, seq, steps, config.vocab_size, o);
          } else {
            const auto backend = variant == "nsa-cuda" ? AttentionBackend::kCuda : AttentionBackend::kReference;
            o.loss_backend = backend;
            r = Measure(nsad::NsaTransformer(config, backend), batch, seq,
                        variant == "nsa-reference" ? std::min(steps, 5) : steps, config.vocab_size, o);
          }
        } catch (const std::exception& e) {
          r.error = e.what();
          r.error = r.error.substr(0, r.error.find('\n'));
        }
        torch::cuda::synchronize();
        c10::cuda::CUDACachingAllocator::emptyCache();
        const std::string name = variant + (graphs ? "+graph" : "") + (old_optim ? "+torchopt" : "");
        if (!r.error.empty()) {
          std::printf("%-24s %5d  error: %s\n", name.c_str(), batch, r.error.c_str());
        } else {
          std::printf("%-24s %5d %12lld %12.2f %12.0f\n", name.c_str(), batch,
                      static_cast<long long>(r.parameters), r.median_ms, r.tokens_per_second);
          if (opt.spread) {
            std::printf("  timed steps: min %.2f  p90 %.2f  max %.2f ms\n", r.min_ms, r.p90_ms, r.max_ms);
          }
        }
        std::fflush(stdout);
      }
    }
  }
  return 0;
}
