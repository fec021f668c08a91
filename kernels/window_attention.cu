// Sliding-window attention (query t attends keys (t - w, t]).
// Forward: the tiled forward of smem_fwd_tile.cuh; a CTA's 128 (position, head) rows walk the
// 64-key blocks their windows cover, every K/V block copied once per CTA into shared memory.
// Blocks inside every row's window run without the per-element test. FlashAttention-2's own
// windowed forward masks every block of the window, which made it slower than its full causal
// forward at T = 2048 (PERFORMANCE.md).
// Backward: the key-centric warpgroup-MMA kernel of selected_dkdv_wgmma.cuh (dK/dV, fused
// dQ) with WindowKeyPolicy: a CTA takes one 64-key block and a slice of the positions whose
// windows cover it. Elsewhere (other devices, a forced kFlash) nsa_cuda.cc runs
// FlashAttention-2's backward.
#include <algorithm>
#include <atomic>
#include <cmath>

#include "kernel_choice.h"
#include "launch_util.cuh"
#include "selected_dkdv_wgmma.cuh"
#include "smem_fwd_tile.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

std::atomic<WindowKernelChoice::Forward> window_forward{WindowKernelChoice::Forward::kAuto};
std::atomic<WindowKernelChoice::Backward> window_backward{WindowKernelChoice::Backward::kAuto};
std::atomic<int> window_queries_per_item{0};

constexpr int kBlock = smem_fwd::TiledCfg<64>::kN;  // keys per tile (64 for every D)
static_assert(kBlock == 64, "the backward kernel takes blocks of 64 keys (the M of its MMAs)");

struct WindowWalk {
  int window;  // keys (t - window, t]
  int t0 = 0, t_last = 0, first = 0, last = 0;

  __device__ void Prepare(void*, const Shape&, int, int, int first_position, int positions) {
    t0 = first_position;
    t_last = first_position + positions - 1;
    first = max(0, t0 - window + 1) / kBlock;
    last = t_last / kBlock;
  }
  __device__ int First() const { return first; }
  __device__ int Next(int blk) const { return blk <= last ? blk : -1; }
  __device__ int Start(int blk) const { return blk * kBlock; }
  __device__ int Count(const Shape& s, int blk) const { return min(kBlock, s.T - blk * kBlock); }
  __device__ bool EveryRowSeesAll(int, int key0, int count) const {
    return key0 > t_last - window && key0 + count - 1 <= t0;
  }
  static constexpr bool kWholeBlockRows = false;  // rows see ranges of a block (see ChosenBlocksWalk)
  // The one-warpgroup wgmma kernel waits for a block's P V after the next block's Q K^T by
  // default (TiledWgmmaOverlap). H200, 12:2 (ncu): D64 64k 386 -> 355 us, 4k 31.8 -> 29.7 us,
  // B16 T2048 183 -> 169-171 us; D128 64k 716-717 -> 684 us.
  static constexpr bool kOverlapByDefault = true;
  // Block-relative keys [lo, hi] that row t sees: keys (t - window, t].
  __device__ void RowKeys(int, int, int t, int key0, int count, int& lo, int& hi) const {
    const int d = t - key0;  // (d >= window first: no overflow for any window)
    lo = d >= window ? d - window + 1 : 0;
    hi = min(count - 1, d);
  }
};

// The backward's work split: CTA -> (b, g, 64-key block, slice). Keys key0 .. key0 + 63 are
// attended by positions key0 .. key0 + 63 + w - 1; each slice takes queries_per_cta of them
// (all heads of the group), and its partial dK/dV are added into float32 buffers; with one
// slice per block (dk_out/dv_out set) it writes them rounded instead. The grid is an upper
// bound: slices past a block's last position (at the end of the sequence) exit.
struct WindowKeyPolicy {
  int window, queries_per_cta, slices, key_blocks;
  void* dk_out = nullptr;  // [B,T,G,D] scalar_t, or null: add into the float32 buffers
  void* dv_out = nullptr;

  __device__ KeyWork Work(const Shape& s) const {
    KeyWork w{};
    int item = static_cast<int>(blockIdx.x);
    const int slice = item % slices;
    item /= slices;
    const int kb = item % key_blocks;
    item /= key_blocks;
    const int key0 = kb * kBlock, first = key0 + slice * queries_per_cta;
    const int end = static_cast<int>(min(static_cast<int64_t>(s.T), static_cast<int64_t>(key0) + kBlock + window - 1));
    if (first >= end) return w;
    w.b = item / s.G;
    w.g = item % s.G;
    w.keys = {key0, min(kBlock, s.T - key0)};
    w.num_queries = min(queries_per_cta, end - first);
    w.query_base = first;
    w.valid = true;
    return w;
  }
  // With one slice per block the CTAs walk their positions in phase: the i-th position of
  // every block is the one congruent to i modulo its count, so the (up to) nine CTAs whose
  // windows share a position read its Q/dO rows and add its dQ at about the same time, while
  // they are in L2. In plain order neighbouring blocks' CTAs reach a position 64 positions
  // apart, and what all running CTAs read in between (about 50 MB counted at batch 16, T = 2048,
  // 12:2) overflows the L2: measured 80.2-80.5 -> 81.7-82.5 ms per m7c step on an H100.
  __device__ int Query(const KeyWork& w, int i) const {
    if (slices != 1) return static_cast<int>(w.query_base) + i;
    int u = i - w.keys.start % w.num_queries;
    if (u < 0) u += w.num_queries;
    return static_cast<int>(w.query_base) + u;
  }
  __device__ bool Allowed(const Shape&, int t, int key) const { return key <= t && key > t - window; }
  // Whether every position in [t_min, t_max] sees every key of `keys`.
  __device__ bool AllowsAll(int t_min, int t_max, const KeyChunk& keys) const {
    return keys.start + keys.count - 1 <= t_min && keys.start > t_max - window;
  }
};

// q [B,T,H,D], k and v [B,T,G,D] of the same length, and a window the kernels' 32-bit
// position arithmetic holds (t - window, key0 + 64 + window computed in 64 bits).
void CheckWindowInputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window) {
  CheckInput(q, "q", 4);
  CheckInput(k, "k", 4);
  CheckInput(v, "v", 4);
  CheckKv(q, k, v);
  TORCH_CHECK(k.size(1) == q.size(1), "k must have as many positions as q");
  TORCH_CHECK(window > 0 && window <= INT32_MAX - 2 * kBlock, "window must be in [1, ", INT32_MAX - 2 * kBlock,
              "], got ", window);
}

// Positions per backward work item where one item cannot take all of a block's (a window
// over kWindowMaxQueriesPerCta - 63 keys), and the most a CTA holds (its positions sit in
// shared memory).
constexpr int kWindowQueriesPerCta = 128;
constexpr int kWindowMaxQueriesPerCta = kMaxWindowQueriesPerItem;

}  // namespace

void SetWindowKernelChoiceForTesting(const WindowKernelChoice& choice) {
  window_forward = choice.forward;
  window_backward = choice.backward;
  window_queries_per_item = choice.queries_per_item;
}
WindowKernelChoice GetWindowKernelChoice() {
  return {window_forward.load(), window_backward.load(), window_queries_per_item.load()};
}

// Auto takes the tiled forward at head_dim 64, and at 128 where it runs on warpgroup MMAs
// (smem_fwd::TiledWgmmaRuns). Measured on H100 (nsa_bench window forward, ms,
// FlashAttention-2 -> tiled on mma.sync): B16 T2048 D64 12:2 0.479 -> 0.307, 64:4 2.626 ->
// 1.446, 64k D64 12:2 1.109 -> 0.644, 64:4 5.970 -> 3.184; but D128 12:2 0.507 -> 0.561 and
// 64:4 2.515 -> 2.713 (one m16 tile per warp there: twice the shared-memory reads per product).
// On the H200, D128 12:2, FlashAttention-2 -> the overlapped one-warpgroup wgmma kernel: 64k
// 1.028-1.049 -> 0.689-0.699, 16k 0.291-0.292 -> 0.184-0.191, B16 T2048 0.518-0.530 ->
// 0.321-0.325 (mma.sync: 1.018-1.026, 0.266-0.273, 0.472-0.474).
bool UseTiledWindowForward(const at::Tensor& q) {
  const auto forward = window_forward.load();
  const bool applies = q.scalar_type() != at::kFloat && (q.size(3) == 64 || q.size(3) == 128);
  TORCH_CHECK(forward != WindowKernelChoice::Forward::kTiled || applies,
              "WindowKernelChoice: the tiled window forward takes bf16/fp16 with head_dim 64 or 128");
  return forward == WindowKernelChoice::Forward::kTiled ||
         (forward == WindowKernelChoice::Forward::kAuto && applies &&
          (q.size(3) == 64 || smem_fwd::TiledWgmmaRuns(q)));
}

std::tuple<at::Tensor, at::Tensor> WindowForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 int64_t window) {
  CheckWindowInputs(q, k, v, window);
  TORCH_CHECK(q.scalar_type() != at::kFloat, "the tiled window forward takes bf16/fp16");
  const Shape s = MakeShape(q, k);
  auto out = at::empty_like(q);
  auto lse = at::empty({s.B, s.T, s.H}, q.options().dtype(at::kFloat));
  const WindowWalk walk{static_cast<int>(window)};
  AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "nsa_window_fwd", [&] {
    DispatchHeadDim(s.D, [&](auto dim) {
      smem_fwd::LaunchTiledForward<scalar_t, decltype(dim)::value>(q, k, v, out, lse, s, walk, 0);
    });
  });
  return {out, lse};
}

// Auto takes the warpgroup-MMA backward wherever it runs (head_dim 64 and 128). Measured on
// H100 (nsa_bench, one NSA layer forward+backward, FlashAttention-2's window backward -> this
// one, two rounds in one call): B16 T2048 D64 12:2 3.472-3.485 -> 3.429-3.447 ms (2026-11-23;
// the kernel is faster since). At D=128 it first lost (64k 12:2 26.447 -> 26.537 ms,
// 2026-11-23) and auto kept FlashAttention-2 there; after the kernel's speedups it wins
// (2026-11-25): B16 T2048 12:2 5.786/5.808 -> 5.643/5.604 ms, 64k 12:2 26.142/26.292 ->
// 25.699/25.640 ms, 64k 64:4 124.856/124.162 -> 123.197/122.892 ms.
bool UseWgmmaWindowBackward(const at::Tensor& q) {
  const auto backward = window_backward.load();
  if (backward == WindowKernelChoice::Backward::kFlash) return false;
  const bool applies = q.scalar_type() != at::kFloat && (q.size(3) == 64 || q.size(3) == 128) && WgmmaRunsHere();
  TORCH_CHECK(backward != WindowKernelChoice::Backward::kWgmma || applies,
              "WindowKernelChoice: the warpgroup-MMA window backward takes bf16/fp16 with head_dim 64 or 128 on an "
              "sm_90 device (kernels built for sm_90a)");
  return applies;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> WindowBackward(const at::Tensor& dout_in, const at::Tensor& q,
                                                              const at::Tensor& k, const at::Tensor& v,
                                                              const at::Tensor& out, const at::Tensor& lse,
                                                              int64_t window, at::Tensor* dq_sum,
                                                              const at::Tensor& given_delta) {
  CheckWindowInputs(q, k, v, window);
  TORCH_CHECK(q.scalar_type() != at::kFloat && (q.size(3) == 64 || q.size(3) == 128),
              "the warpgroup-MMA window backward takes bf16/fp16 with head_dim 64 or 128");
  if (dq_sum) CheckDqSum(*dq_sum, q);
  TORCH_CHECK(out.sizes() == q.sizes() && dout_in.sizes() == q.sizes(), "out and dout must be shaped like q");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 3 && lse.size(0) == q.size(0) &&
                  lse.size(1) == q.size(1) && lse.size(2) == q.size(2),
              "lse must be float32 [B,T,H]");
  const auto dout = dout_in.contiguous();
  const Shape s = MakeShape(q, k);
  const float scale = 1.f / std::sqrt(static_cast<float>(s.D));
  const auto delta = DeltaOrRowDot(given_delta, dout, out);
  auto dq_acc = dq_sum ? *dq_sum : ZeroFloats(q.sizes(), q.options());
  const int key_blocks = (s.T + kBlock - 1) / kBlock;
  const int64_t span = std::min<int64_t>(s.T, kBlock + window - 1);  // positions of one block, at most
  const int forced = window_queries_per_item.load();
  TORCH_CHECK(forced >= 0 && forced <= kWindowMaxQueriesPerCta, "WindowKernelChoice: queries_per_item must be in [1, ",
              kWindowMaxQueriesPerCta, "] or 0 (the default), got ", forced);
  // By default one work item takes all of a block's positions where a CTA holds them (the
  // m7c window of 512: 575) and writes its dK/dV rounded: the float32 buffers' zero fills,
  // the slices' atomics and the rounding passes go.
  int per_item = forced;
  if (per_item == 0) {
    per_item = span <= kWindowMaxQueriesPerCta ? static_cast<int>(std::max<int64_t>(span, 1)) : kWindowQueriesPerCta;
  }
  const int slices = static_cast<int>((span + per_item - 1) / per_item);
  WindowKeyPolicy pol{static_cast<int>(window), per_item, slices, key_blocks};
  at::Tensor dk_acc, dv_acc, dk, dv;
  if (slices == 1) {
    dk = at::empty_like(k);
    dv = at::empty_like(v);
    pol.dk_out = dk.data_ptr();
    pol.dv_out = dv.data_ptr();
  } else {
    dk_acc = ZeroFloats(k.sizes(), k.options());
    dv_acc = ZeroFloats(v.sizes(), v.options());
  }
  const int64_t grid = static_cast<int64_t>(s.B) * s.G * key_blocks * slices;
  TORCH_CHECK(grid <= INT32_MAX, "window backward: too many work items (", grid, ")");
  if (grid > 0) {
    AT_DISPATCH_REDUCED_FLOATING_TYPES(q.scalar_type(), "nsa_window_bwd", [&] {
      DispatchHeadDim(s.D, [&](auto dim) {
        constexpr int D = decltype(dim)::value;
        using Cfg = dkdv_wgmma::Cfg<D, kWindowMaxQueriesPerCta>;
        LaunchKernel(dkdv_wgmma::SelectedDkDvWgmmaKernel<scalar_t, D, true, kWindowMaxQueriesPerCta, WindowKeyPolicy>,
                     dim3(static_cast<unsigned>(grid)), Cfg::kThreads, Cfg::kBytes, q.data_ptr<scalar_t>(),
                     k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(), lse.data_ptr<float>(),
                     delta.data_ptr<float>(), dk_acc.defined() ? dk_acc.data_ptr<float>() : nullptr,
                     dv_acc.defined() ? dv_acc.data_ptr<float>() : nullptr, dq_acc.data_ptr<float>(), s, pol, scale);
      });
    });
  }
  if (slices != 1) {
    dk = dk_acc.to(k.scalar_type());
    dv = dv_acc.to(v.scalar_type());
  }
  return {dq_sum ? at::Tensor() : dq_acc.to(q.scalar_type()), dk, dv};
}

void CheckDqSum(const at::Tensor& dq_sum, const at::Tensor& q) {
  TORCH_CHECK(dq_sum.scalar_type() == at::kFloat && dq_sum.sizes() == q.sizes() && dq_sum.is_contiguous() &&
                  dq_sum.device() == q.device(),
              "dq_sum must be a contiguous float32 tensor shaped like q on its device");
  // The backwards add into it with 16-byte atomics (float4 rows of 4 columns).
  TORCH_CHECK(reinterpret_cast<uintptr_t>(dq_sum.data_ptr()) % 16 == 0, "dq_sum must be 16-byte aligned");
}

}  // namespace nsad::nsa::cuda::detail
