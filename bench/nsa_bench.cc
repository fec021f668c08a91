// One NSA attention layer (compressed branch with importance, top-n selection, selected
// branch, sliding window) against dense causal FlashAttention (PyTorch SDPA, flash backend
// only, GQA via enable_gqa so K/V are not expanded), forward and forward+backward.
//
//   nsa_bench [--seqs 2048,8192,16384,32768,65536] [--dims 64,128] [--heads 12:2,64:4]
//             [--reps 5] [--warmup 2] [--batch 1] [--slc-only 0|1] [--layer 0|1]
//             [--slc-fwd auto|rows|heads|tiled|blocks] [--slc-dkdv auto|staged16x3|staged32x1|staged32x3|unstaged|wgmma]
//             [--slc-dq auto|query|fused] [--slc-qpc N] [--slc-order auto|block|position] [--slc-combine auto|one|batch4] [--slc-local auto|blocks|tiled|kernel] [--win-fwd auto|flash|tiled] [--win-bwd auto|flash|wgmma] [--win-qpc N] [--cmp-kernel auto|own|registers|dense] [--cmp-map auto|product|slots|lane-sync] [--cmp-key-side auto|smem|wgmma] [--cmp-pass auto|two]
//             [--tiled-mma auto|sync|wgmma|wgmma1|wgmma-overlap]
//
// --layer 1 also times the node training runs, BranchesMixed (nsa_cuda.h: the three branches,
// the selection on its importance without the causal zero tail, RoPE of q and the gate mix),
// forward and forward+backward, before the row's other timings, as a line of its own.
//
// --slc-only 1 times only the selected branch (forward, and its backward alone from saved
// out/lse) and prints how many distinct blocks 16/32/64 consecutive positions select
// (the union a query-tile kernel would stage), to size the selected kernels' work split.
//
// --slc-fwd / --slc-dkdv / --slc-dq / --slc-qpc force the selected branch's forward/dQ kernel,
// dK/dV kernel (staged register budgets rows x CTAs per SM are D=64 builds), where dQ comes
// from (the query-side kernel, or fused into the staged dK/dV kernel) and queries per dK/dV
// work item (0 = auto), the launch order of the key-centric work items, and --slc-combine /
// --slc-local how the key-centric forward combines its partials and where it computes the
// local blocks, through SelectedKernelChoice (kernels/kernel_choice.h), for A/B runs
// in one binary; --cmp-kernel own / registers / dense force the compressed branch onto our
// kernels at every length, our register-only kernels, or cuDNN over packed query rows
// (CompressedKernelChoice); --win-fwd flash runs the window branch's forward on
// FlashAttention-2 instead of the tiled kernel and --win-bwd flash its backward on
// FlashAttention-2 instead of the warpgroup-MMA kernel, --win-qpc N sets that kernel's
// positions per work item (WindowKernelChoice); --tiled-mma sync|wgmma|wgmma1
// runs the tiled forward (the selected branch's and the window's) on mma.sync or on
// warpgroup MMAs, CTAs of two warpgroups or of one (TiledForwardChoice). The default is the
// dispatch training uses. Choices print first.
//
// bf16, batch --batch (default 1), default NSA geometry (l=32, d=16, l'=64, n=16, w=512). Times are medians of
// --reps runs bracketed by CUDA events after --warmup runs. TFLOP/s count the attention
// matrix products only (4*D flops per query-head-key pair forward, 2.5x that forward+backward
// as FlashAttention counts them), over the keys each branch really visits.
// The compression MLP producing k_cmp/v_cmp and the output gates are not part of the timing.
//
// Second dense baseline (cudnn_f / cudnn_fb): the same SDPA call with only the cuDNN backend
// enabled. When cuDNN rejects GQA (enable_gqa), K/V are expanded to H heads before the timed
// region and the times are marked '*'; '-' when cuDNN attention is unavailable.
// GB/s_n: bytes the NSA forward must move at least, over its time: every branch reads Q and
// writes its output and lse; compressed reads each K/V block once per group and writes the
// importance, selection reads the importance and writes the indices, selected reads the K/V
// blocks of each (position, group) (16 blocks of l' rows: no reuse across positions assumed),
// the window reads each key/value once per group.
#include <ATen/Context.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "nsa/ops.h"
#include "nsa/rope.h"
#include "launchers.h"
#include "nsa_cuda.h"
#include "kernel_choice_names.h"

namespace {

using nsad::nsa::Geometry;
namespace nsa_cuda = nsad::nsa::cuda;

using Choice = nsad::bench::SelectedChoice;
using WinChoice = nsad::bench::WindowChoice;
using CmpChoice = nsad::bench::CompressedChoice;
using TiledChoice = nsad::bench::TiledChoice;
using nsad::bench::ParseChoiceFlag;
using nsad::bench::NameOf;
using nsad::bench::kCmpMapNames;
using nsad::bench::kCmpNames;
using nsad::bench::kTiledMmaNames;
using nsad::bench::kSlcDkDvNames;
using nsad::bench::kSlcDqNames;
using nsad::bench::kSlcFwdNames;
using nsad::bench::kSlcOrderNames;
using nsad::bench::kSlcCombineNames;
using nsad::bench::kSlcLocalNames;
using nsad::bench::kWinBwdNames;
using nsad::bench::kWinFwdNames;

// Drops the leaves' .grad before a backward, as FlashAttention's benchmark does (x.grad =
// None): otherwise every rep after the first adds its gradients into the previous ones, an
// accumulation a layer inside a model does not do.
void ClearGrads(std::initializer_list<torch::Tensor> leaves) {
  for (const auto& t : leaves) t.mutable_grad() = torch::Tensor();
}

double MedianMs(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    at::cuda::CUDAEvent start(cudaEventDefault), stop(cudaEventDefault);
    start.record();
    fn();
    stop.record();
    stop.synchronize();
    ms.push_back(start.elapsed_time(stop));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// Query-head-key pairs each branch computes (batch 1, one head).
struct PairCounts {
  double dense = 0, cmp = 0, slc = 0, win = 0;
};
PairCounts CountPairs(int64_t T, const Geometry& g) {
  PairCounts p;
  const int64_t N = nsad::nsa::NumCmpBlocks(T, g);
  for (int64_t t = 0; t < T; ++t) {
    p.dense += t + 1;
    p.cmp += t < g.cmp_block - 1 ? 0 : std::min(N, (t - (g.cmp_block - 1)) / g.cmp_stride + 1);
    const int64_t blocks = std::min<int64_t>(g.top_n, t / g.slc_block + 1);
    p.slc += (blocks - 1) * g.slc_block + (t % g.slc_block) + 1;  // current block is partial
    p.win += std::min<int64_t>(t + 1, g.window);
  }
  return p;
}

// Minimum bytes of one NSA forward (see the header comment), bf16 activations.
double NsaBytes(int64_t B, int64_t T, int64_t H, int64_t G, int64_t D, const Geometry& g) {
  const double e = 2.0;  // bytes per bf16 element
  const int64_t N = nsad::nsa::NumCmpBlocks(T, g), NS = nsad::nsa::NumSlcBlocks(T, g);
  const double q_rows = static_cast<double>(B) * T * H;
  const double per_branch_q_out = q_rows * (2.0 * D * e + 4.0);  // read Q, write out + lse
  const double cmp = per_branch_q_out + 2.0 * B * N * G * D * e + 4.0 * B * T * G * NS;
  const double select = 4.0 * B * T * G * NS + 4.0 * B * T * G * g.top_n;
  double slc_rows = 0;  // key rows visited per (b, t, g)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t blocks = std::min<int64_t>(g.top_n, t / g.slc_block + 1);
    slc_rows += (blocks - 1) * g.slc_block + (t % g.slc_block) + 1;
  }
  const double slc = per_branch_q_out + 2.0 * B * G * slc_rows * D * e;
  const double win = per_branch_q_out + 2.0 * B * T * G * D * e;
  return cmp + select + slc + win;
}

std::vector<int64_t> ParseList(const char* s) {
  std::vector<int64_t> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(std::stoll(item));
  return out;
}

// Mean number of distinct selected blocks over tiles of `tile` consecutive positions of one
// (batch, group); idx [B,T,G,n] with -1 for unused slots.
double MeanUnion(const torch::Tensor& idx, int64_t NS, int64_t tile) {
  const int64_t B = idx.size(0), T = idx.size(1), G = idx.size(2);
  const int64_t tiles = (T + tile - 1) / tile;
  auto onehot = torch::zeros({B, tiles * tile, G, NS + 1}, idx.options().dtype(torch::kBool));
  auto ix = torch::where(idx >= 0, idx, torch::full({}, NS, idx.options())).to(torch::kLong);
  onehot.slice(1, 0, T).scatter_(3, ix, true);
  auto u = onehot.slice(3, 0, NS).reshape({B, tiles, tile, G, NS}).any(2).sum(-1);
  return u.to(torch::kDouble).mean().item<double>();
}

nsad::nsa::cuda::detail::Geo ToGeo(const Geometry& g) {
  return {static_cast<int>(g.cmp_block), static_cast<int>(g.cmp_stride), static_cast<int>(g.slc_block),
          static_cast<int>(g.top_n), static_cast<int>(g.window)};
}

// The machine's two ceilings, measured as METHOD.md asks rather than taken from the
// datasheet: device-to-device copy bandwidth (bytes read + written, 1 GiB buffers) and the
// rate of a large bf16 matrix product (cuBLAS, 8192^3). The TF/s and GB/s columns compare
// against these.
struct Ceilings {
  double copy_gbs, matmul_tflops;
};
Ceilings MeasureCeilings(int warmup, int reps) {
  const auto bytes = int64_t{1} << 30;
  auto src = torch::empty({bytes}, torch::TensorOptions().dtype(torch::kUInt8).device(torch::kCUDA));
  auto dst = torch::empty_like(src);
  const double copy_ms = MedianMs([&] { dst.copy_(src); }, warmup, reps);
  const int64_t n = 8192;
  const auto bf16 = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  auto a = torch::randn({n, n}, bf16), b = torch::randn({n, n}, bf16);
  const double mm_ms = MedianMs([&] { torch::mm(a, b); }, warmup, reps);
  return {2.0 * bytes / copy_ms / 1e6, 2.0 * n * n * n / mm_ms / 1e9};
}

// Dense causal SDPA with only the cuDNN backend enabled (restores flash-only on return).
struct CudnnTimes {
  double fwd = -1, fwd_bwd = -1;
  bool expanded = false;  // K/V expanded to H heads (cuDNN refused enable_gqa)
  std::string Fmt(double ms) const {
    if (ms < 0) return "-";
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.3f%s", ms, expanded ? "*" : "");
    return buf;
  }
  std::string Fwd() const { return Fmt(fwd); }
  std::string FwdBwd() const { return Fmt(fwd_bwd); }
};

CudnnTimes TimeCudnn(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& grad, int warmup, int reps) {
  CudnnTimes r;
  auto& ctx = at::globalContext();
  ctx.setSDPUseFlash(false);
  ctx.setSDPUseCuDNN(true);
  auto sdpa = [](const torch::Tensor& qq, const torch::Tensor& kk, const torch::Tensor& vv, bool gqa) {
    return at::scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                            {}, 0.0, /*is_causal=*/true, std::nullopt, gqa);
  };
  const int64_t rep = q.size(2) / k.size(2);
  torch::Tensor kk = k, vv = v;
  bool gqa = true;
  try {
    torch::NoGradGuard ng;
    sdpa(q, kk, vv, true);
  } catch (const std::exception&) {
    // No GQA in cuDNN here: expand K/V to H heads once, outside every timed region.
    kk = k.repeat_interleave(rep, 2).contiguous();
    vv = v.repeat_interleave(rep, 2).contiguous();
    gqa = false;
    r.expanded = rep > 1;
  }
  try {
    {
      torch::NoGradGuard ng;
      r.fwd = MedianMs([&] { sdpa(q, kk, vv, gqa); }, warmup, reps);
    }
    torch::AutoGradMode grad_on(true);
    auto ql = q.detach().requires_grad_(true), kl = kk.detach().requires_grad_(true),
         vl = vv.detach().requires_grad_(true);
    r.fwd_bwd = MedianMs(
        [&] {
          ClearGrads({ql, kl, vl});
          auto o = sdpa(ql, kl, vl, gqa);
          torch::autograd::backward({o}, {grad.transpose(1, 2)});
        },
        warmup, reps);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuDNN SDPA unavailable: %.200s\n", e.what());
  }
  ctx.setSDPUseCuDNN(false);
  ctx.setSDPUseFlash(true);
  return r;
}

// --layer: the training node's forward and forward+backward (BranchesMixed), with k, v serving
// the selected and the window branch alike and uniform gates; RoPE's tables as the model's
// (theta 10000).
void TimeLayer(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& kc,
               const torch::Tensor& vc, const torch::Tensor& grad, const Geometry& geo, int warmup, int reps) {
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const auto rope = nsad::nsa::MakeRopeTable(torch::arange(T, q.options().dtype(torch::kLong)), D, 10000.0,
                                             torch::kFloat);
  const auto &cos = rope.cos, &sin = rope.sin;
  const auto gates = torch::full({B, T, H, 3}, 1.0 / 3.0, q.options());
  const double fwd = MedianMs([&] { nsa_cuda::BranchesMixed(q, cos, sin, kc, vc, k, v, k, v, gates, geo); },
                              warmup, reps);
  torch::AutoGradMode grad_on(true);
  auto ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
       vl = v.detach().requires_grad_(true), kcl = kc.detach().requires_grad_(true),
       vcl = vc.detach().requires_grad_(true), gl = gates.detach().requires_grad_(true);
  const double fb = MedianMs(
      [&] {
        ClearGrads({ql, kl, vl, kcl, vcl, gl});
        auto out = nsa_cuda::BranchesMixed(ql, cos, sin, kcl, vcl, kl, vl, kl, vl, gl, geo).first;
        torch::autograd::backward({out}, {grad});
      },
      warmup, reps);
  std::printf("  layer (BranchesMixed) T=%lld D=%lld: fwd %.3f ms, fwd+bwd %.3f ms\n", static_cast<long long>(T),
              static_cast<long long>(D), fwd, fb);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int64_t> seqs = {2048, 8192, 16384, 32768, 65536};
  int64_t batch = 1;
  std::vector<int64_t> dims = {64, 128};
  struct Heads { int64_t H, G; };
  std::vector<Heads> head_cfgs = {{12, 2}, {64, 4}};
  int reps = 5, warmup = 2;
  bool slc_only = false, layer = false;
  Choice choice;
  CmpChoice cmp_choice;
  WinChoice win_choice;
  TiledChoice tiled_choice;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seqs") seqs = ParseList(argv[i + 1]);
    else if (a == "--dims") dims = ParseList(argv[i + 1]);
    else if (a == "--heads") {
      head_cfgs.clear();
      std::stringstream ss(argv[i + 1]);
      std::string item;
      while (std::getline(ss, item, ',')) {
        const auto colon = item.find(':');
        if (colon == std::string::npos) { std::fprintf(stderr, "--heads takes H:G pairs\n"); return 2; }
        head_cfgs.push_back({std::stoll(item.substr(0, colon)), std::stoll(item.substr(colon + 1))});
      }
    }
    else if (a == "--reps") reps = std::atoi(argv[i + 1]);
    else if (a == "--batch") batch = std::atoll(argv[i + 1]);
    else if (a == "--warmup") warmup = std::atoi(argv[i + 1]);
    else if (a == "--slc-only") slc_only = std::atoi(argv[i + 1]) != 0;
    else if (a == "--layer") layer = std::atoi(argv[i + 1]) != 0;
    else if (a == "--cmp-kernel") {
      if (!ParseChoiceFlag("--cmp-kernel", kCmpNames, argv[i + 1], cmp_choice.path)) return 2;
    } else if (a == "--cmp-map") {
      if (!ParseChoiceFlag("--cmp-map", kCmpMapNames, argv[i + 1], cmp_choice.map)) return 2;
    } else if (a == "--cmp-key-side") {
      if (!ParseChoiceFlag("--cmp-key-side", nsad::bench::kCmpKeySideNames, argv[i + 1], cmp_choice.key_side)) return 2;
    } else if (a == "--cmp-pass") {
      if (!ParseChoiceFlag("--cmp-pass", nsad::bench::kCmpPassNames, argv[i + 1], cmp_choice.pass)) return 2;
    } else if (a == "--win-fwd") {
      if (!ParseChoiceFlag("--win-fwd", kWinFwdNames, argv[i + 1], win_choice.forward)) return 2;
    } else if (a == "--win-bwd") {
      if (!ParseChoiceFlag("--win-bwd", kWinBwdNames, argv[i + 1], win_choice.backward)) return 2;
    } else if (a == "--tiled-mma") {
      if (!ParseChoiceFlag("--tiled-mma", kTiledMmaNames, argv[i + 1], tiled_choice.mma)) return 2;
    }
    else if (a == "--slc-fwd") {
      if (!ParseChoiceFlag("--slc-fwd", kSlcFwdNames, argv[i + 1], choice.fwd)) return 2;
    } else if (a == "--slc-dkdv") {
      if (!ParseChoiceFlag("--slc-dkdv", kSlcDkDvNames, argv[i + 1], choice.dkdv)) return 2;
    } else if (a == "--slc-dq") {
      if (!ParseChoiceFlag("--slc-dq", kSlcDqNames, argv[i + 1], choice.dq)) return 2;
    } else if (a == "--slc-order") {
      if (!ParseChoiceFlag("--slc-order", kSlcOrderNames, argv[i + 1], choice.order)) return 2;
    } else if (a == "--slc-combine") {
      if (!ParseChoiceFlag("--slc-combine", kSlcCombineNames, argv[i + 1], choice.combine)) return 2;
    } else if (a == "--slc-local") {
      if (!ParseChoiceFlag("--slc-local", kSlcLocalNames, argv[i + 1], choice.local)) return 2;
    } else if (a == "--slc-qpc") choice.queries_per_item = std::atoi(argv[i + 1]);
    else if (a == "--win-qpc") win_choice.queries_per_item = std::atoi(argv[i + 1]);
    else { std::fprintf(stderr, "unknown flag %s\n", a.c_str()); return 2; }
  }
  const bool d64_build = choice.dkdv != Choice::DkDv::kAuto && choice.dkdv != Choice::DkDv::kUnstaged &&
                         choice.dkdv != Choice::DkDv::kWgmma;
  if (d64_build && std::any_of(dims.begin(), dims.end(), [](int64_t d) { return d != 64; })) {
    std::fprintf(stderr, "--slc-dkdv %s is a D=64 build: run it with --dims 64\n", NameOf(kSlcDkDvNames, choice.dkdv));
    return 2;
  }
  // The kernels check these too; here they fail before any work, naming the flag.
  if (choice.queries_per_item < 0 || choice.queries_per_item > nsa_cuda::detail::kMaxSelectedQueriesPerItem) {
    std::fprintf(stderr, "--slc-qpc takes 0 (auto) or 1..%d\n", nsa_cuda::detail::kMaxSelectedQueriesPerItem);
    return 2;
  }
  if (win_choice.queries_per_item < 0 || win_choice.queries_per_item > nsa_cuda::detail::kMaxWindowQueriesPerItem) {
    std::fprintf(stderr, "--win-qpc takes 0 (auto) or 1..%d\n", nsa_cuda::detail::kMaxWindowQueriesPerItem);
    return 2;
  }
  if (!torch::cuda::is_available() || !nsa_cuda::Available()) {
    std::fprintf(stderr, "nsa_bench needs a CUDA GPU the kernels were built for\n");
    return 1;
  }
  nsad::nsa::cuda::detail::SetSelectedKernelChoiceForTesting(choice);
  std::printf("# selected kernels: fwd %s, dkdv %s, dq %s, item order %s, combine %s, local blocks %s, queries per dkdv item %d%s\n",
              NameOf(kSlcFwdNames, choice.fwd), NameOf(kSlcDkDvNames, choice.dkdv), NameOf(kSlcDqNames, choice.dq),
              NameOf(kSlcOrderNames, choice.order), NameOf(kSlcCombineNames, choice.combine),
              NameOf(kSlcLocalNames, choice.local),
              choice.queries_per_item,
              choice.queries_per_item == 0 ? " (auto)" : "");
  nsad::nsa::cuda::detail::SetCompressedKernelChoiceForTesting(cmp_choice);
  std::printf("# compressed kernels: %s, importance map %s, backward key side %s, forward passes %s\n",
              NameOf(kCmpNames, cmp_choice.path), NameOf(kCmpMapNames, cmp_choice.map),
              NameOf(nsad::bench::kCmpKeySideNames, cmp_choice.key_side),
              NameOf(nsad::bench::kCmpPassNames, cmp_choice.pass));
  nsad::nsa::cuda::detail::SetWindowKernelChoiceForTesting(win_choice);
  std::printf("# window forward: %s\n", NameOf(kWinFwdNames, win_choice.forward));
  std::printf("# window backward: %s, positions per work item %d%s\n", NameOf(kWinBwdNames, win_choice.backward),
              win_choice.queries_per_item, win_choice.queries_per_item == 0 ? " (auto)" : "");
  nsad::nsa::cuda::detail::SetTiledForwardChoiceForTesting(tiled_choice);
  std::printf("# tiled forward's MMAs: %s\n", NameOf(kTiledMmaNames, tiled_choice.mma));
  torch::NoGradGuard no_grad_default;  // re-enabled below where backward is timed
  const Ceilings ceilings = MeasureCeilings(warmup, std::max(reps, 5));
  std::printf("# ceilings on this GPU: copy %.0f GB/s (read + write), bf16 matmul %.0f TFLOP/s\n",
              ceilings.copy_gbs, ceilings.matmul_tflops);
  // Dense baseline must be FlashAttention: leave SDPA no other backend to fall back to.
  auto& ctx = at::globalContext();
  ctx.setSDPUseFlash(true);
  ctx.setSDPUseMemEfficient(false);
  ctx.setSDPUseMath(false);
  ctx.setSDPUseCuDNN(false);

  const Geometry geo;
  const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);

  if (slc_only) {
    std::printf("%3s %6s %4s %6s | %9s %9s | %7s %7s %7s %7s\n", "B", "seq", "D", "H:G", "slc_f", "slc_b",
                "sel/pos", "u16", "u32", "u64");
    for (const int64_t T : seqs) {
      for (const int64_t D : dims) {
        for (const Heads hc : head_cfgs) {
          const int64_t H = hc.H, G = hc.G, N = nsad::nsa::NumCmpBlocks(T, geo), B = batch;
          const int64_t NS = nsad::nsa::NumSlcBlocks(T, geo);
          torch::manual_seed(T + D + H);
          auto q = torch::randn({B, T, H, D}, opts), k = torch::randn({B, T, G, D}, opts),
               v = torch::randn({B, T, G, D}, opts);
          auto kc = torch::randn({B, N, G, D}, opts), vc = torch::randn({B, N, G, D}, opts);
          auto grad = torch::randn({B, T, H, D}, opts);
          auto idx = nsa_cuda::SelectBlocks(nsa_cuda::CompressedAttention(q, kc, vc, geo).importance, T, geo);
          namespace detail = nsad::nsa::cuda::detail;
          std::tuple<at::Tensor, at::Tensor> fwd;
          const double slc_f = MedianMs([&] { fwd = detail::SelectedForward(q, k, v, idx, ToGeo(geo)); },
                                        warmup, reps);
          const at::Tensor out = std::get<0>(fwd), lse = std::get<1>(fwd);
          const double slc_b = MedianMs(
              [&] { detail::SelectedBackward(grad, q, k, v, out, lse, idx, ToGeo(geo)); }, warmup, reps);
          const double sel = (idx >= 0).sum().item<double>() / static_cast<double>(B * T * G);
          char heads[16];
          std::snprintf(heads, sizeof(heads), "%lld:%lld", static_cast<long long>(H), static_cast<long long>(G));
          std::printf("%3lld %6lld %4lld %6s | %9.3f %9.3f | %7.2f %7.2f %7.2f %7.2f\n",
                      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(D), heads,
                      slc_f, slc_b, sel, MeanUnion(idx, NS, 16), MeanUnion(idx, NS, 32),
                      MeanUnion(idx, NS, 64));
          std::fflush(stdout);
        }
      }
    }
    return 0;
  }

  std::printf("batch %lld\n", static_cast<long long>(batch));
  std::printf("%6s %4s %6s | %9s %9s %6s | %9s %9s %6s %6s | %7s %7s | fwd ms: %7s %7s %7s %7s | %9s %9s %7s\n",
              "seq", "D", "H:G", "dense_f", "nsa_f", "x_f", "dense_fb", "nsa_fb", "x_fb", "x_b",
              "TF/s_d", "TF/s_n", "cmp", "select", "slc", "win", "cudnn_f", "cudnn_fb", "GB/s_n");
  for (const int64_t T : seqs) {
    const PairCounts pairs = CountPairs(T, geo);
    for (const int64_t D : dims) {
      for (const Heads hc : head_cfgs) {
        const int64_t H = hc.H, G = hc.G, N = nsad::nsa::NumCmpBlocks(T, geo);
        torch::manual_seed(T + D + H);
        const int64_t B = batch;
        auto q = torch::randn({B, T, H, D}, opts), k = torch::randn({B, T, G, D}, opts),
             v = torch::randn({B, T, G, D}, opts);
        auto kc = torch::randn({B, N, G, D}, opts), vc = torch::randn({B, N, G, D}, opts);
        auto grad = torch::randn({B, T, H, D}, opts);

        // Dense causal flash, BHTD views of the same data.
        auto dense_fwd = [&](const torch::Tensor& qq, const torch::Tensor& kk, const torch::Tensor& vv) {
          return at::scaled_dot_product_attention(qq.transpose(1, 2), kk.transpose(1, 2),
                                                  vv.transpose(1, 2), {}, 0.0, /*is_causal=*/true,
                                                  std::nullopt, /*enable_gqa=*/true);
        };
        auto nsa_fwd = [&](const torch::Tensor& qq, const torch::Tensor& kk, const torch::Tensor& vv,
                           const torch::Tensor& kkc, const torch::Tensor& vvc) {
          auto cmp = nsa_cuda::CompressedAttention(qq, kkc, vvc, geo);
          auto idx = nsa_cuda::SelectBlocks(cmp.importance, T, geo);
          auto slc = nsa_cuda::SelectedAttention(qq, kk, vv, idx, geo);
          auto win = nsa_cuda::SlidingWindowAttention(qq, kk, vv, geo);
          return std::vector<torch::Tensor>{cmp.out, slc, win};
        };

        if (layer) TimeLayer(q, k, v, kc, vc, grad, geo, warmup, reps);
        const double dense_f = MedianMs([&] { dense_fwd(q, k, v); }, warmup, reps);
        const double nsa_f = MedianMs([&] { nsa_fwd(q, k, v, kc, vc); }, warmup, reps);
        // Per-branch forward times.
        nsa_cuda::CmpImportanceResult cmp_res;
        const double cmp_f = MedianMs([&] { cmp_res = nsa_cuda::CompressedAttention(q, kc, vc, geo); }, 1, reps);
        torch::Tensor idx;
        const double sel_f = MedianMs([&] { idx = nsa_cuda::SelectBlocks(cmp_res.importance, T, geo); }, 1, reps);
        const double slc_f = MedianMs([&] { nsa_cuda::SelectedAttention(q, k, v, idx, geo); }, 1, reps);
        const double win_f = MedianMs([&] { nsa_cuda::SlidingWindowAttention(q, k, v, geo); }, 1, reps);

        torch::AutoGradMode grad_on(true);
        auto ql = q.detach().requires_grad_(true), kl = k.detach().requires_grad_(true),
             vl = v.detach().requires_grad_(true), kcl = kc.detach().requires_grad_(true),
             vcl = vc.detach().requires_grad_(true);
        const double dense_fb = MedianMs(
            [&] {
              ClearGrads({ql, kl, vl});
              auto o = dense_fwd(ql, kl, vl);
              torch::autograd::backward({o}, {grad.transpose(1, 2)});
            },
            warmup, reps);
        const double nsa_fb = MedianMs(
            [&] {
              ClearGrads({ql, kl, vl, kcl, vcl});
              auto outs = nsa_fwd(ql, kl, vl, kcl, vcl);
              torch::autograd::backward(outs, {grad, grad, grad});
            },
            warmup, reps);

        const CudnnTimes cudnn = TimeCudnn(q, k, v, grad, warmup, reps);

        const double flop_d = 4.0 * D * H * B * pairs.dense;
        const double flop_n = 4.0 * D * H * B * (pairs.cmp + pairs.slc + pairs.win);
        const double bytes_n = NsaBytes(B, T, H, G, D, geo);
        char heads[16];
        std::snprintf(heads, sizeof(heads), "%lld:%lld", static_cast<long long>(H), static_cast<long long>(G));
        // Backward alone (issue #5's second target): forward+backward minus forward.
        const double x_b = (dense_fb - dense_f) / (nsa_fb - nsa_f);
        std::printf("%6lld %4lld %6s | %9.3f %9.3f %6.2f | %9.3f %9.3f %6.2f %6.2f | %7.1f %7.1f | %15.3f %7.3f %7.3f %7.3f | %9s %9s %7.1f\n",
                    static_cast<long long>(T), static_cast<long long>(D), heads, dense_f, nsa_f,
                    dense_f / nsa_f, dense_fb, nsa_fb, dense_fb / nsa_fb, x_b, flop_d / dense_f / 1e9,
                    flop_n / nsa_f / 1e9, cmp_f, sel_f, slc_f, win_f, cudnn.Fwd().c_str(),
                    cudnn.FwdBwd().c_str(), bytes_n / nsa_f / 1e6);
        std::fflush(stdout);
      }
    }
  }
  std::printf("x_f / x_fb / x_b: dense time over NSA time (forward; forward+backward; backward, taken as\n"
              "forward+backward minus forward). TF/s: forward.\n");
  return 0;
}
