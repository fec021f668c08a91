// train_bench: tokens/s of one training step (forward, backward, AdamW) of the m7c 125M
// model at seq 2048 in bf16 autocast, for
//   nsa-cuda       the NSA transformer with the custom kernels
//   nsa-reference  the same model on the plain-LibTorch reference (the oracle)
//   dense-flash    a GPT of the same width/depth/heads/GQA/MLP with dense causal attention
//                  through PyTorch's SDPA (FlashAttention), the baseline of the issue
// at batch 1 and 16. Every variant runs the same loop: random tokens already on the GPU
// (data loading is not measured), a warm-up, then the median of timed steps with CUDA
// synchronisation around each step. Usage: train_bench [--batches 1,16] [--seq 2048] [--steps 20] [--variants a,b]
#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <c10/cuda/CUDACachingAllocator.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "model/rms_norm.h"
#include "model/transformer.h"

namespace {

using nsad::AttentionBackend;
using nsad::ModelConfig;

ModelConfig M7c() {
  ModelConfig c;
  c.vocab_size = 50304;
  c.dim = 768;
  c.n_layers = 12;
  c.n_heads = 12;
  c.n_kv_groups = 2;
  c.head_dim = 64;
  c.nsa = {32, 16, 64, 16, 512};
  return c;
}

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
    const auto y = n2->forward(x);
    return x + w2->forward(torch::silu(w1->forward(y)) * w3->forward(y));
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

struct Result {
  double median_ms = 0, tokens_per_second = 0;
  int64_t parameters = 0;
  std::string error;
};

template <typename Model>
Result Measure(Model model, int batch, int seq, int steps, int vocab) {
  Result r;
  const torch::Device cuda(torch::kCUDA, 0);
  model->to(cuda);
  for (const auto& p : model->parameters()) r.parameters += p.numel();
  torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(6e-4).weight_decay(0.1));
  const auto tokens = torch::randint(vocab, {batch, seq + 1}, torch::TensorOptions().dtype(torch::kLong).device(cuda));
  const auto inputs = tokens.narrow(1, 0, seq), targets = tokens.narrow(1, 1, seq);
  auto step = [&] {
    optimizer.zero_grad(true);
    torch::Tensor logits;
    {
      at::autocast::set_autocast_enabled(at::kCUDA, true);
      at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
      logits = model->forward(inputs);
      at::autocast::set_autocast_enabled(at::kCUDA, false);
      at::autocast::clear_cache();
    }
    auto loss = torch::nn::functional::cross_entropy(logits.view({-1, vocab}).to(torch::kFloat), targets.reshape({-1}));
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
  };
  const int warmup = 3;
  for (int i = 0; i < warmup; ++i) step();
  torch::cuda::synchronize();
  std::vector<double> ms;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    step();
    torch::cuda::synchronize();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  r.median_ms = ms[ms.size() / 2];
  r.tokens_per_second = batch * seq / (r.median_ms / 1e3);
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
  std::vector<int> batches = {1, 16};
  int seq = 2048, steps = 20;
  std::vector<std::string> variants = {"nsa-cuda", "dense-flash", "nsa-reference"};
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
    } else {
      std::fprintf(stderr, "unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  if (!torch::cuda::is_available()) {
    std::printf("train_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  const ModelConfig config = M7c();
  std::printf("m7c: dim %d, %d layers, %d heads, %d kv groups, head dim %d, seq %d, bf16 autocast, AdamW\n",
              config.dim, config.n_layers, config.n_heads, config.n_kv_groups, config.head_dim, seq);
  std::printf("%-14s %5s %12s %12s %12s\n", "variant", "batch", "params", "step_ms", "tok/s");
  for (int batch : batches) {
    for (const auto& variant : variants) {
      Result r;
      try {
        torch::manual_seed(0);
        if (variant == "dense-flash") {
          r = Measure(DenseGpt(config), batch, seq, steps, config.vocab_size);
        } else {
          const auto backend = variant == "nsa-cuda" ? AttentionBackend::kCuda : AttentionBackend::kReference;
          r = Measure(nsad::NsaTransformer(config, backend), batch, seq,
                      variant == "nsa-reference" ? std::min(steps, 5) : steps, config.vocab_size);
        }
      } catch (const std::exception& e) {
        r.error = e.what();
        r.error = r.error.substr(0, r.error.find('\n'));
      }
      c10::cuda::CUDACachingAllocator::emptyCache();
      if (!r.error.empty()) {
        std::printf("%-14s %5d  error: %s\n", variant.c_str(), batch, r.error.c_str());
      } else {
        std::printf("%-14s %5d %12lld %12.2f %12.0f\n", variant.c_str(), batch,
                    static_cast<long long>(r.parameters), r.median_ms, r.tokens_per_second);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
