// Sliding-window attention forward (query t attends keys (t - w, t]) on the tiled forward of
// smem_fwd_tile.cuh: a CTA's 128 (position, head) rows walk the 64-key blocks their windows
// cover, every K/V block copied once per CTA into shared memory. Blocks inside every row's
// window run without the per-element test. The backward stays FlashAttention-2's (nsa_cuda.cc
// hands it this forward's output and log-sum-exp); FlashAttention-2's own windowed forward
// masks every block of the window, which made it slower than its full causal forward at
// T = 2048 (PERFORMANCE.md).
#include <atomic>

#include "kernel_choice.h"
#include "launch_util.cuh"
#include "smem_fwd_tile.cuh"

namespace nsad::nsa::cuda::detail {
namespace {

std::atomic<WindowKernelChoice::Forward> window_choice{WindowKernelChoice::Forward::kAuto};

constexpr int kBlock = smem_fwd::TiledCfg<64>::kN;  // keys per tile (64 for every D)

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
  __device__ bool Sees(int, int, int t, int key) const { return key <= t && key > t - window; }
};

}  // namespace

void SetWindowKernelChoiceForTesting(const WindowKernelChoice& choice) { window_choice = choice.forward; }
WindowKernelChoice GetWindowKernelChoice() { return {window_choice.load()}; }

// Auto takes the tiled forward at head_dim 64 only. Measured on H100 (nsa_bench window
// forward, ms, FlashAttention-2 -> tiled): B16 T2048 D64 12:2 0.479 -> 0.307, 64:4 2.626 ->
// 1.446, 64k D64 12:2 1.109 -> 0.644, 64:4 5.970 -> 3.184; but D128 12:2 0.507 -> 0.561 and
// 64:4 2.515 -> 2.713 (one m16 tile per warp there: twice the shared-memory reads per product).
bool UseTiledWindowForward(const at::Tensor& q) {
  const auto forward = window_choice.load();
  const bool applies = q.scalar_type() != at::kFloat && (q.size(3) == 64 || q.size(3) == 128);
  TORCH_CHECK(forward != WindowKernelChoice::Forward::kTiled || applies,
              "WindowKernelChoice: the tiled window forward takes bf16/fp16 with head_dim 64 or 128");
  return forward == WindowKernelChoice::Forward::kTiled ||
         (forward == WindowKernelChoice::Forward::kAuto && applies && q.size(3) == 64);
}

std::tuple<at::Tensor, at::Tensor> WindowForward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 int64_t window) {
  CheckInput(q, "q", 4);
  CheckInput(k, "k", 4);
  CheckInput(v, "v", 4);
  CheckKv(q, k, v);
  TORCH_CHECK(k.size(1) == q.size(1), "k must have as many positions as q");
  TORCH_CHECK(window > 0 && window <= INT32_MAX, "window must be positive, got ", window);
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

}  // namespace nsad::nsa::cuda::detail
