// The CUDA NSA ops (kernels/nsa_cuda.h) against the plain-LibTorch reference (nsa/ops.h),
// forward and every gradient, on random shapes: lengths that are multiples of no block size,
// batch 2, GQA groups of 1..16 heads, head dims 64 and 128, bf16, fp16 and fp32 (bf16 and
// fp16 run the tensor-core kernels, fp32 the scalar ones).
//
// The reference runs on the same inputs upcast to float32. Metric: ||x - ref|| / ||ref||
// (float64), under 2e-2 for bf16/fp16 inputs and 1e-4 for fp32 inputs; NaN never passes.
// Every check draws fresh random inputs, and the CUDA caching allocator is filled with NaN
// before each op runs, so an output element the kernels forget to write shows up as NaN.
//
// Without a CUDA device every test skips. With a device, kernels that cannot load (built
// for another architecture) fail the suite rather than skip it.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "nsa/ops.h"
#include "nsa/rope.h"
#include "nsa/shared_gradient.h"
#include "nsa_cuda.h"
#include "test_names.h"
#include "block_map.h"
#include "kernel_choice.h"
#include "launchers.h"
#include "fused_ops.h"

namespace nsad::nsa {
namespace {

struct Case {
  int64_t T, H, G, D;
  torch::ScalarType dtype;
  bool small_geometry;  // slc_block 32, top_n 5, window 64: more blocks, fewer chosen
  // Nonzero: overrides slc_block. 16 makes a 64-block compressed tile touch 65 selection
  // blocks, more than the shared-memory compressed kernels map, so the register-only
  // compressed kernels run (their fallback).
  int64_t slc_block = 0;
};

std::string Name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return "T" + std::to_string(c.T) + "_H" + std::to_string(c.H) + "_G" + std::to_string(c.G) +
         "_D" + std::to_string(c.D) +
         DtypeSuffix(c.dtype) +
         (c.small_geometry ? "_smallgeo" : "") +
         (c.slc_block ? "_slc" + std::to_string(c.slc_block) : "");
}

constexpr int64_t kBatch = 2;

const char* MmaName(cuda::detail::TiledForwardChoice::Mma mma) {
  using Mma = cuda::detail::TiledForwardChoice::Mma;
  if (mma == Mma::kSync) return "mma.sync";
  if (mma == Mma::kWgmma) return "wgmma, two warpgroups";
  if (mma == Mma::kWgmmaOverlap) return "wgmma, one warpgroup, P V overlapped";
  return "wgmma, one warpgroup";
}
// Every kind the tiled forward has (where each runs: TiledMmaRuns).
constexpr cuda::detail::TiledForwardChoice::Mma kTiledMmaKinds[] = {
    cuda::detail::TiledForwardChoice::Mma::kSync, cuda::detail::TiledForwardChoice::Mma::kWgmma,
    cuda::detail::TiledForwardChoice::Mma::kWgmmaOneWarpgroup, cuda::detail::TiledForwardChoice::Mma::kWgmmaOverlap};
// Whether a kind runs at head_dim D here: mma.sync everywhere (bf16/fp16), the warpgroup kinds
// on an sm_90 device at head_dim 64, and at 128 all but the two-warpgroup one.
bool TiledMmaRuns(cuda::detail::TiledForwardChoice::Mma mma, int64_t D) {
  using Mma = cuda::detail::TiledForwardChoice::Mma;
  if (mma == Mma::kSync) return true;
  return cuda::detail::WgmmaRunsHere() && (D == 64 || (D == 128 && mma != Mma::kWgmma));
}

class KernelsTest : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(cuda::Available()) << "CUDA device present but the NSA kernels cannot run on it";
    torch::manual_seed(1234 + GetParam().T * 7 + GetParam().H);
    if (GetParam().small_geometry) {
      geo_.slc_block = 32;
      geo_.top_n = 5;
      geo_.window = 64;
    }
    if (GetParam().slc_block) geo_.slc_block = GetParam().slc_block;
  }

  double Tolerance() const { return GetParam().dtype == torch::kFloat ? 1e-4 : 2e-2; }
  torch::TensorOptions Opts() const {
    return torch::TensorOptions().dtype(GetParam().dtype).device(torch::kCUDA);
  }
  torch::Tensor Random(std::vector<int64_t> shape) const {
    return torch::randn(shape, Opts()).requires_grad_(true);
  }
  // Fills the allocator's cache with NaN so that fresh outputs start as NaN, not zero.
  static void Poison() {
    torch::full({64 << 20}, std::numeric_limits<float>::quiet_NaN(),
                torch::TensorOptions().device(torch::kCUDA));
  }
  static torch::Tensor Upcast(const torch::Tensor& t) {
    return t.detach().to(torch::kFloat).requires_grad_(true);
  }

  void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) const {
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    const auto g = got.detach().to(torch::kDouble).cpu(), w = want.detach().to(torch::kDouble).cpu();
    ASSERT_FALSE(g.isnan().any().item<bool>()) << what << " has NaN";
    const double ref_norm = w.norm().item<double>();
    const double err_norm = (g - w).norm().item<double>();
    if (ref_norm == 0.0) {
      // Mathematically zero (e.g. dq and dk when a row attends exactly one key): the kernels
      // get it as dO.V - dO.O with O rounded to the input type, so allow rounding-level RMS.
      const double rms = err_norm / std::sqrt(static_cast<double>(std::max<int64_t>(1, g.numel())));
      EXPECT_LT(rms, 1e-4) << what << ": reference is zero, kernel is not";
      return;
    }
    std::printf("    %-10s rel err %.2e\n", what.c_str(), err_norm / ref_norm);
    EXPECT_LT(err_norm / ref_norm, Tolerance()) << what << " relative error";
  }

  // Random q and dout [kBatch, T, H, D], k and v [kBatch, T, G, D] of the case, no gradients.
  std::array<torch::Tensor, 4> RandomAttentionInputs() const {
    const Case c = GetParam();
    return {torch::randn({kBatch, c.T, c.H, c.D}, Opts()), torch::randn({kBatch, c.T, c.G, c.D}, Opts()),
            torch::randn({kBatch, c.T, c.G, c.D}, Opts()), torch::randn({kBatch, c.T, c.H, c.D}, Opts())};
  }

  // Forward and gradients against the reference for block_idx (default: a selection of random
  // importance); returns the kernels' {dq, dk, dv}.
  std::vector<torch::Tensor> CheckSelectedAttention(torch::Tensor idx = {});
  // The selected forward of random inputs under each named kernel choice against the
  // reference, for the selection idx (the outputs start as NaN).
  void CheckSelectedForwardUnder(const torch::Tensor& idx,
                                 const std::vector<std::pair<const char*, cuda::detail::SelectedKernelChoice>>& choices);
  void CheckCompressedAttention();
  void CheckSlidingWindow();

  // A selected-attention call under `choice` (which this shape cannot run) fails with a
  // c10::Error instead of running another kernel.
  void ExpectSelectedAttentionRefuses(const cuda::detail::SelectedKernelChoice& choice) {
    const Case c = GetParam();
    const int64_t NS = NumSlcBlocks(c.T, geo_);
    const auto q = torch::randn({1, c.T, c.H, c.D}, Opts());
    const auto kv = torch::randn({1, c.T, c.G, c.D}, Opts());
    const auto importance = torch::rand({1, c.T, c.G, NS}, Opts().dtype(torch::kFloat));
    const auto idx = cuda::SelectBlocks(importance, c.T, geo_);
    const cuda::detail::ScopedSelectedKernelChoice force(choice);
    EXPECT_THROW(cuda::SelectedAttention(q, kv, kv, idx, geo_), c10::Error);
  }

  Geometry geo_;
};

std::vector<torch::Tensor> KernelsTest::CheckSelectedAttention(torch::Tensor idx) {
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto k = Random({kBatch, c.T, c.G, c.D});
  auto v = Random({kBatch, c.T, c.G, c.D});
  if (!idx.defined()) {
    const auto importance = torch::rand({kBatch, c.T, c.G, NS}, Opts().dtype(torch::kFloat));
    idx = cuda::SelectBlocks(importance, c.T, geo_);
  }
  const auto grad = torch::randn({kBatch, c.T, c.H, c.D}, Opts());

  Poison();
  auto out = cuda::SelectedAttention(q, k, v, idx, geo_);
  Poison();
  out.backward(grad);

  auto q32 = Upcast(q), k32 = Upcast(k), v32 = Upcast(v);
  auto ref = SelectedAttentionReference(q32, k32, v32, idx, geo_);
  ref.backward(grad.to(torch::kFloat));
  ExpectClose(out, ref, "out");
  ExpectClose(q.grad(), q32.grad(), "dq");
  ExpectClose(k.grad(), k32.grad(), "dk");
  ExpectClose(v.grad(), v32.grad(), "dv");
  return {q.grad(), k.grad(), v.grad()};
}

TEST_P(KernelsTest, SelectedAttentionForwardAndGradients) { CheckSelectedAttention(); }

// The selected branch has several kernels picked by shape or kept for A/B measurements:
// forward/dQ per position (the group's heads as MMA rows) or over flattened (position, head)
// rows walking the union of neighbours' blocks; dK/dV staged in shared memory (three
// register budgets at D=64) or unstaged; and the dK/dV work split (queries per work item).
// SelectedKernelChoice forces each, so every path is checked on every shape it applies to
// (the kernel-forcing choices apply to bf16/fp16, the D=64 register budgets to D=64 only).
TEST_P(KernelsTest, SelectedAttentionEveryKernelPath) {
  using Choice = cuda::detail::SelectedKernelChoice;
  struct Path {
    const char* name;
    Choice choice;
    bool tensor_cores_only, d64_only;
    bool wgmma_only = false;  // runs only where the warpgroup-MMA kernels do (an sm_90 device)
  };
  const auto make = [](Choice::Fwd fwd, Choice::DkDv dkdv, int qpc, Choice::Dq dq = Choice::Dq::kQuerySide,
                       long long partial_bytes = 0) {
    Choice c;
    c.fwd = fwd;
    c.dkdv = dkdv;
    c.queries_per_item = qpc;
    c.dq = dq;
    c.partial_bytes = partial_bytes;
    return c;
  };
  // The same choice with its work items launched in position order.
  const auto in_position_order = [](Choice c) {
    c.order = Choice::Order::kPosition;
    return c;
  };
  // The same choice with the key-centric forward's local blocks where `local` says.
  const auto with_local = [](Choice c, Choice::Local local) {
    c.local = local;
    return c;
  };
  using Dq = Choice::Dq;
  const std::vector<Path> paths = {
      {"fwd rows", make(Choice::Fwd::kRows, Choice::DkDv::kAuto, 0), true, false},
      {"fwd tiled", make(Choice::Fwd::kTiled, Choice::DkDv::kAuto, 0), true, false},
      {"fwd tiled, dq fused", make(Choice::Fwd::kTiled, Choice::DkDv::kAuto, 0, Dq::kFused), true, false},
      // Key-centric forward: per-block partials, combined per position; short slices split a
      // block's entries over many work items.
      {"fwd blocks", make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 0), true, false},
      {"fwd blocks, 24 queries per item", make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 24), true, false},
      {"fwd blocks, combine one block at a time",
       [&] {
         Choice c = make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 0);
         c.combine = Choice::Combine::kOne;
         return c;
       }(),
       true, false},
      {"fwd blocks, one batch element per pass", make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 0, Dq::kQuerySide, 1),
       true, false},
      // The local blocks (0, a position's own and the previous one) in the block kernel with
      // the rest, and on the tiled pass the combine starts from (with short slices, and one
      // batch element per pass: the pass's out and lse are views of the whole call's).
      {"fwd blocks, local blocks in the block kernel",
       with_local(make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 0), Choice::Local::kInBlocks), true, false},
      {"fwd blocks, local blocks on the tiled pass, 24 queries per item",
       with_local(make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 24), Choice::Local::kTiledPass), true, false},
      {"fwd blocks, local blocks on the tiled pass, one batch element per pass",
       with_local(make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 0, Dq::kQuerySide, 1), Choice::Local::kTiledPass),
       true, false},
      // (The pass's own kernel is the default wherever it runs: "fwd blocks" above.)
      {"fwd heads, dkdv unstaged", make(Choice::Fwd::kHeads, Choice::DkDv::kUnstaged, 0), true, false},
      {"dkdv staged 16x3", make(Choice::Fwd::kAuto, Choice::DkDv::kStaged16x3, 0), true, true},
      {"dkdv staged 32x1", make(Choice::Fwd::kAuto, Choice::DkDv::kStaged32x1, 0), true, true},
      // Short slices: many work items per block, one atomic add per slice.
      {"24 queries per dkdv item", make(Choice::Fwd::kAuto, Choice::DkDv::kAuto, 24), false, false},
      // dQ from the dK/dV kernel, in each staged build (one and two 16-row pairs per step;
      // D=128 has one build, its K fragments in shared memory), and with short slices (a
      // row's dQ then sums partials of several work items).
      {"dq fused, staged 32x3", make(Choice::Fwd::kAuto, Choice::DkDv::kStaged32x3, 0, Dq::kFused), true, true},
      {"dq fused, staged 16x3", make(Choice::Fwd::kAuto, Choice::DkDv::kStaged16x3, 0, Dq::kFused), true, true},
      {"dq fused, staged 32x1", make(Choice::Fwd::kAuto, Choice::DkDv::kStaged32x1, 0, Dq::kFused), true, true},
      {"dq fused, 24 queries per item", make(Choice::Fwd::kAuto, Choice::DkDv::kAuto, 24, Dq::kFused), true,
       false},
      // The warpgroup-MMA dK/dV kernel (both head dims), with and without fused dQ, whole and
      // short slices (a 24-query slice of 6 heads is 144 rows: two full 64-row steps and a
      // partial one).
      {"dkdv wgmma", make(Choice::Fwd::kAuto, Choice::DkDv::kWgmma, 0), true, false, true},
      {"dkdv wgmma, 24 queries per item", make(Choice::Fwd::kAuto, Choice::DkDv::kWgmma, 24), true, false, true},
      {"dq fused, dkdv wgmma", make(Choice::Fwd::kAuto, Choice::DkDv::kWgmma, 0, Dq::kFused), true, false, true},
      {"dq fused, dkdv wgmma, 24 queries per item", make(Choice::Fwd::kAuto, Choice::DkDv::kWgmma, 24, Dq::kFused),
       true, false, true},
      {"dq fused, dkdv wgmma, position order, 24 queries per item",
       in_position_order(make(Choice::Fwd::kAuto, Choice::DkDv::kWgmma, 24, Dq::kFused)), true, false, true},
      // Work items launched in position order (an indirection through the sorted item list)
      // for the block forward and dK/dV, with short slices so the order has many items to
      // permute.
      {"fwd blocks, position order, 24 queries per item",
       in_position_order(make(Choice::Fwd::kBlocks, Choice::DkDv::kAuto, 24)), true, false},
      {"dkdv position order, 24 queries per item",
       in_position_order(make(Choice::Fwd::kAuto, Choice::DkDv::kAuto, 24)), false, false},
      {"dq fused, position order, 24 queries per item",
       in_position_order(make(Choice::Fwd::kAuto, Choice::DkDv::kAuto, 24, Dq::kFused)), true, false}};
  const Case c = GetParam();
  for (const Path& path : paths) {
    if (path.tensor_cores_only && c.dtype == torch::kFloat) continue;
    if (path.d64_only && c.D != 64) continue;
    if (path.wgmma_only && !cuda::detail::WgmmaRunsHere()) continue;
    SCOPED_TRACE(path.name);
    const cuda::detail::ScopedSelectedKernelChoice force(path.choice);  // restored on failure too
    CheckSelectedAttention();
  }
}

// The selection is a set in the reference: a block listed twice counts once, in every
// forward (tiled: a bitmask per block; blocks: the combine skips a repeated block's partial;
// per position, rows and the fp32 kernel: a repeated slot is skipped) and backward (the
// query-side dQ skips the slot, the key-centric kernels' inverted map drops it). The
// selection kernel never repeats a block; every position here lists block 0 again in its last
// slot (whatever was there is dropped).
torch::Tensor SelectionWithBlockZeroRepeated(const Case& c, const Geometry& geo) {
  const int64_t NS = NumSlcBlocks(c.T, geo);
  const auto importance =
      torch::rand({kBatch, c.T, c.G, NS}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  auto idx = cuda::SelectBlocks(importance, c.T, geo);
  idx.select(3, geo.top_n - 1).fill_(0);
  return idx;
}

void KernelsTest::CheckSelectedForwardUnder(
    const torch::Tensor& idx, const std::vector<std::pair<const char*, cuda::detail::SelectedKernelChoice>>& choices) {
  const auto [q, k, v, unused_dout] = RandomAttentionInputs();
  const auto ref = SelectedAttentionReference(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), idx,
                                              geo_);
  for (const auto& [name, choice] : choices) {
    SCOPED_TRACE(name);
    const cuda::detail::ScopedSelectedKernelChoice force(choice);
    Poison();
    ExpectClose(cuda::SelectedAttention(q, k, v, idx, geo_), ref, "out");
  }
}

TEST_P(KernelsTest, SelectedForwardCountsARepeatedBlockOnce) {
  using Choice = cuda::detail::SelectedKernelChoice;
  // "blocks" combines four partials at a time, so its repeat falls inside a batch; one at a
  // time, it falls across batches. With the local blocks on the tiled pass the repeated block
  // 0 is one of them: the combine skips both its slots.
  const auto forward = [](Choice::Fwd fwd, Choice::Combine combine = Choice::Combine::kAuto,
                          Choice::Local local = Choice::Local::kAuto) {
    Choice choice;
    choice.fwd = fwd;
    choice.combine = combine;
    choice.local = local;
    return choice;
  };
  const std::vector<std::pair<const char*, Choice>> forwards =
      GetParam().dtype == torch::kFloat  // one scalar kernel
          ? std::vector<std::pair<const char*, Choice>>{{"fp32", Choice{}}}
          : std::vector<std::pair<const char*, Choice>>{
                {"tiled", forward(Choice::Fwd::kTiled)},
                {"blocks", forward(Choice::Fwd::kBlocks)},
                {"blocks, combine one block at a time", forward(Choice::Fwd::kBlocks, Choice::Combine::kOne)},
                {"blocks, local blocks in the block kernel",
                 forward(Choice::Fwd::kBlocks, Choice::Combine::kAuto, Choice::Local::kInBlocks)},
                {"blocks, local blocks on the tiled pass",
                 forward(Choice::Fwd::kBlocks, Choice::Combine::kAuto, Choice::Local::kTiledPass)},
                {"rows", forward(Choice::Fwd::kRows)},
                {"heads", forward(Choice::Fwd::kHeads)}};
  CheckSelectedForwardUnder(SelectionWithBlockZeroRepeated(GetParam(), geo_), forwards);
}

// The key-centric forward's split of the local blocks (block 0, a position's own and the one
// before it) follows the selection it is given, not the rules that make one: here every odd
// position dropped its local blocks (their slots -1), so it attends only its other blocks, and
// the tiled pass, the block kernel and the combine must each leave them out.
TEST_P(KernelsTest, SelectedForwardFollowsASelectionWithoutLocalBlocks) {
  using Choice = cuda::detail::SelectedKernelChoice;
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  const auto importance =
      torch::rand({kBatch, c.T, c.G, NS}, torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  auto idx = cuda::SelectBlocks(importance, c.T, geo_);
  const auto t = torch::arange(c.T, idx.options()).view({1, c.T, 1, 1});
  const auto own = torch::div(t, geo_.slc_block, "floor");
  const auto local = (idx >= 0) & ((idx == 0) | (idx == own) | (idx == own - 1));
  idx = torch::where(local & (t % 2 == 1), torch::full_like(idx, -1), idx);
  const auto blocks_with = [](Choice::Local where) {
    Choice choice;
    choice.fwd = Choice::Fwd::kBlocks;
    choice.local = where;
    return choice;
  };
  if (c.dtype == torch::kFloat) return CheckSelectedForwardUnder(idx, {{"fp32", Choice{}}});
  std::vector<std::pair<const char*, Choice>> forwards = {
      {"in the block kernel", blocks_with(Choice::Local::kInBlocks)},
      {"on the tiled pass", blocks_with(Choice::Local::kTiledPass)}};
  // The pass's own kernel runs at head_dim 64 and 128 with 64-key selection blocks on an sm_90
  // device; elsewhere a forced choice of it fails the call.
  const bool own_kernel_runs = geo_.slc_block == 64 && cuda::detail::WgmmaRunsHere();
  if (own_kernel_runs) {
    forwards.push_back({"on its own kernel", blocks_with(Choice::Local::kLocalKernel)});
  } else {
    const cuda::detail::ScopedSelectedKernelChoice force(blocks_with(Choice::Local::kLocalKernel));
    EXPECT_THROW(cuda::SelectedAttention(torch::randn({kBatch, c.T, c.H, c.D}, Opts()),
                                         torch::randn({kBatch, c.T, c.G, c.D}, Opts()),
                                         torch::randn({kBatch, c.T, c.G, c.D}, Opts()), idx, geo_),
                 c10::Error);
  }
  CheckSelectedForwardUnder(idx, forwards);
}

// The backward under the default kernels and with short slices (a block's entries over many
// dK/dV work items).
TEST_P(KernelsTest, SelectedBackwardCountsARepeatedBlockOnce) {
  using Choice = cuda::detail::SelectedKernelChoice;
  const auto idx = SelectionWithBlockZeroRepeated(GetParam(), geo_);
  for (const int qpc : {0, 24}) {
    SCOPED_TRACE(qpc == 0 ? "default work items" : "24 queries per item");
    Choice choice;
    choice.queries_per_item = qpc;
    const cuda::detail::ScopedSelectedKernelChoice force(choice);
    CheckSelectedAttention(idx);
  }
}

// A key block no position selected gets exactly zero dK and dV: the inverted block map has
// empty segments for them and the backward's work items cover only selected blocks. Every
// position here selects block 0 alone.
TEST_P(KernelsTest, SelectedBackwardGivesZerosForBlocksNobodySelected) {
  const Case c = GetParam();
  auto idx = torch::full({kBatch, c.T, c.G, geo_.top_n}, -1, Opts().dtype(torch::kInt));
  idx.select(3, 0).fill_(0);
  const auto grads = CheckSelectedAttention(idx);
  if (NumSlcBlocks(c.T, geo_) > 1) {
    const int64_t rest = c.T - geo_.slc_block;
    EXPECT_EQ(grads[1].narrow(1, geo_.slc_block, rest).abs().max().item<double>(), 0.0) << "dk";
    EXPECT_EQ(grads[2].narrow(1, geo_.slc_block, rest).abs().max().item<double>(), 0.0) << "dv";
  }
}

// A forced kernel that cannot run on a call fails it rather than running another kernel.
TEST_P(KernelsTest, SelectedAttentionRejectsInapplicableChoice) {
  using Choice = cuda::detail::SelectedKernelChoice;
  const Case c = GetParam();
  Choice choice;
  if (c.dtype == torch::kFloat) {
    choice.fwd = Choice::Fwd::kRows;  // fp32 has the scalar kernels only
  } else if (c.D != 64) {
    choice.dkdv = Choice::DkDv::kStaged32x1;  // a D=64 build
  } else {
    choice.queries_per_item = 513;  // over the staged kernel's shared-memory positions
  }
  ExpectSelectedAttentionRefuses(choice);
}

// Fused dQ lives in the staged tensor-core builds only: fp32 and the unstaged dK/dV kernel
// refuse it instead of computing dQ elsewhere.
TEST_P(KernelsTest, SelectedAttentionRejectsInapplicableFusedDq) {
  using Choice = cuda::detail::SelectedKernelChoice;
  const Case c = GetParam();
  Choice choice;
  choice.dq = Choice::Dq::kFused;
  if (c.dtype != torch::kFloat) choice.dkdv = Choice::DkDv::kUnstaged;
  ExpectSelectedAttentionRefuses(choice);
}

TEST_P(KernelsTest, CompressedAttentionForwardImportanceAndGradients) { CheckCompressedAttention(); }

// The register-only kernels are the fallback for geometries the shared-memory kernels cannot
// take; force them on every shape so that fallback stays correct too.
TEST_P(KernelsTest, CompressedAttentionRegisterKernels) {
  cuda::detail::CompressedKernelChoice choice;
  choice.path = cuda::detail::CompressedKernelChoice::Path::kRegisters;
  const cuda::detail::ScopedCompressedKernelChoice force(choice);  // restored on failure too
  CheckCompressedAttention();
}

// Long sequences run the compressed branch's attention on cuDNN over packed query rows
// (kernels/compressed_packed.cu) and the importance pass on our kernel; force that path on
// every shape so the packing stays right for short, ragged and batched inputs too. fp32
// inputs refuse it instead of quietly running the scalar kernels.
TEST_P(KernelsTest, CompressedAttentionOnCudnn) {
  cuda::detail::CompressedKernelChoice choice;
  choice.path = cuda::detail::CompressedKernelChoice::Path::kDense;
  const cuda::detail::ScopedCompressedKernelChoice force(choice);
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) {
    const int64_t N = NumCmpBlocks(c.T, geo_);
    const auto q = torch::randn({1, c.T, c.H, c.D}, Opts());
    const auto kv = torch::randn({1, N, c.G, c.D}, Opts());
    EXPECT_THROW(cuda::CompressedAttention(q, kv, kv, geo_), c10::Error);
    return;
  }
  CheckCompressedAttention();
}

// Each dK/dV kernel of our compressed backward (the shared-memory one, the selected branch's
// warpgroup-MMA one under the compressed mask) matches the reference on every shape. A forced
// warpgroup-MMA kernel that cannot run (fp32, another head_dim, no sm_90 device) refuses
// instead of running another kernel.
TEST_P(KernelsTest, CompressedAttentionEveryKeySide) {
  using Choice = cuda::detail::CompressedKernelChoice;
  const Case c = GetParam();
  const bool wgmma_runs =
      c.dtype != torch::kFloat && (c.D == 64 || c.D == 128) && cuda::detail::WgmmaRunsHere();
  for (const Choice::KeySide side : {Choice::KeySide::kSmem, Choice::KeySide::kWgmma}) {
    SCOPED_TRACE("key side " + std::to_string(static_cast<int>(side)));
    Choice choice;
    choice.path = Choice::Path::kOwn;
    choice.key_side = side;
    const cuda::detail::ScopedCompressedKernelChoice force(choice);
    if (side == Choice::KeySide::kWgmma && !wgmma_runs) {
      const int64_t N = NumCmpBlocks(c.T, geo_);
      const auto q = torch::randn({1, c.T, c.H, c.D}, Opts()).requires_grad_();
      const auto kv = torch::randn({1, N, c.G, c.D}, Opts());
      const auto out = cuda::CompressedAttention(q, kv, kv, geo_).out;
      EXPECT_THROW(out.backward(torch::ones_like(out)), c10::Error);
      continue;
    }
    CheckCompressedAttention();
  }
}

// In the paper's geometry (l = 2d, l' = 4d, the default here) the shared-memory importance
// pass maps P onto selection blocks with shuffles (QuadMapRow) instead of the product with
// W. Both are exact up to float32 rounding (the product takes P as two fp16 parts), so they
// must agree far tighter than the bf16 tolerance against the reference: a weight or a spill
// sent to the wrong block would be a whole chunk's share off. On our kernels and on the
// cuDNN path, whose importance pass is the same kernel.
TEST_P(KernelsTest, CompressedImportanceQuadMapEqualsTheProduct) {
  using Choice = cuda::detail::CompressedKernelChoice;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "tensor-core kernels only";
  if (geo_.cmp_block != 2 * geo_.cmp_stride || geo_.slc_block != 4 * geo_.cmp_stride) {
    GTEST_SKIP() << "the quad map needs l = 2d and l' = 4d";
  }
  const int64_t N = NumCmpBlocks(c.T, geo_);
  const auto q = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto kc = torch::randn({kBatch, N, c.G, c.D}, Opts());
  const auto vc = torch::randn({kBatch, N, c.G, c.D}, Opts());
  for (const Choice::Path path : {Choice::Path::kOwn, Choice::Path::kDense}) {
    if (path == Choice::Path::kDense && N < 2) continue;
    SCOPED_TRACE(path == Choice::Path::kOwn ? "our kernels" : "cuDNN");
    const auto importance = [&](Choice::Map map) {
      Choice choice;
      choice.path = path;
      choice.map = map;
      const cuda::detail::ScopedCompressedKernelChoice force(choice);
      Poison();
      return cuda::CompressedAttention(q, kc, vc, geo_).importance;
    };
    const auto quad = importance(Choice::Map::kAuto), product = importance(Choice::Map::kProduct);
    ASSERT_TRUE(torch::isfinite(quad).all().item<bool>());
    const double scale = product.abs().max().item<double>();
    EXPECT_LT((quad - product).abs().max().item<double>(), 1e-5 * std::max(scale, 1.0))
        << "max |quad - product| over max |product| = " << scale;
    // The default's heads in one lane (D64, even heads per group up to 8; warpgroup MMAs on sm_90,
    // where D128 takes them too) against the staged rows and the lane kernel on mma.sync (D64;
    // at D128 kLaneSync takes the staged rows).
    EXPECT_LT((quad - importance(Choice::Map::kSlots)).abs().max().item<double>(), 1e-5 * std::max(scale, 1.0))
        << "against the staged rows";
    EXPECT_LT((quad - importance(Choice::Map::kLaneSync)).abs().max().item<double>(), 1e-5 * std::max(scale, 1.0))
        << "against the lane kernel on mma.sync";
  }
}

void KernelsTest::CheckCompressedAttention() {
  const Case c = GetParam();
  const int64_t N = NumCmpBlocks(c.T, geo_);
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto kc = Random({kBatch, N, c.G, c.D});
  auto vc = Random({kBatch, N, c.G, c.D});
  const auto grad = torch::randn({kBatch, c.T, c.H, c.D}, Opts());

  Poison();
  auto res = cuda::CompressedAttention(q, kc, vc, geo_);
  Poison();
  res.out.backward(grad);

  auto q32 = Upcast(q), k32 = Upcast(kc), v32 = Upcast(vc);
  auto ref = CompressedAttentionReference(q32, k32, v32, geo_);
  ref.out.backward(grad.to(torch::kFloat));
  ExpectClose(res.out, ref.out, "out");
  ExpectClose(q.grad(), q32.grad(), "dq");
  ExpectClose(kc.grad(), k32.grad(), "dk_cmp");
  ExpectClose(vc.grad(), v32.grad(), "dv_cmp");

  // Importance as the contract defines it, from the reference probabilities.
  const auto want = ImportanceReference(ref.probs, c.G, geo_);
  ASSERT_EQ(res.importance.scalar_type(), torch::kFloat);
  ExpectClose(res.importance, want, "importance");
}

// The selection rules of ops.h written out per row on the CPU: forced blocks, then top
// importance with ties to the lower index, ascending, -1 padded. A NaN importance counts as
// -inf (never preferred), as the kernel reads it.
std::vector<int> SelectRow(const float* imp, int64_t t, int64_t NS, const Geometry& g) {
  const int64_t current = t / g.slc_block;
  std::vector<int> order;
  for (int64_t b = 0; b <= current && b < NS; ++b) order.push_back(static_cast<int>(b));
  auto key = [&](int b) {
    const bool forced = b == 0 || b == current || b == current - 1;
    if (forced) return std::numeric_limits<double>::infinity();
    return std::isnan(imp[b]) ? -std::numeric_limits<double>::infinity() : static_cast<double>(imp[b]);
  };
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return key(a) > key(b); });
  order.resize(std::min<size_t>(order.size(), g.top_n));
  std::sort(order.begin(), order.end());
  order.resize(g.top_n, -1);
  return order;
}

TEST_P(KernelsTest, SelectBlocksMatchesTheRules) {
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  // Distinct values per row (a random permutation of 0..NS-1): no ties, so the choice is
  // unique and must match exactly.
  const auto importance =
      torch::rand({kBatch, c.T, c.G, NS}, torch::TensorOptions().device(torch::kCUDA)).argsort(/*stable=*/false, /*dim=*/-1, /*descending=*/false).to(torch::kFloat);
  Poison();
  const auto got = cuda::SelectBlocks(importance, c.T, geo_).cpu();
  ASSERT_EQ(got.scalar_type(), torch::kInt);
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{kBatch, c.T, c.G, geo_.top_n}));
  const auto imp = importance.cpu().contiguous();
  const float* imp_data = imp.data_ptr<float>();
  const int* got_data = got.data_ptr<int>();
  int64_t mismatches = 0;
  for (int64_t row = 0; row < kBatch * c.T * c.G; ++row) {
    const int64_t t = (row / c.G) % c.T;
    const auto want = SelectRow(imp_data + row * NS, t, NS, geo_);
    for (int64_t i = 0; i < geo_.top_n; ++i) mismatches += got_data[row * geo_.top_n + i] != want[i];
  }
  EXPECT_EQ(mismatches, 0);
}

// Output slots where the kernel's choice for importance [B,T,G,NS] differs from SelectRow's.
int64_t SelectionMismatches(const torch::Tensor& importance, const Geometry& geo) {
  const int64_t T = importance.size(1), G = importance.size(2), NS = importance.size(3);
  const auto got = cuda::SelectBlocks(importance, T, geo).cpu();
  const auto imp = importance.cpu().contiguous();
  int64_t mismatches = 0;
  for (int64_t row = 0; row < importance.size(0) * T * G; ++row) {
    const auto want = SelectRow(imp.data_ptr<float>() + row * NS, (row / G) % T, NS, geo);
    for (int64_t i = 0; i < geo.top_n; ++i) mismatches += got.data_ptr<int>()[row * geo.top_n + i] != want[i];
  }
  return mismatches;
}

TEST_P(KernelsTest, SelectBlocksResolvesTiesToTheLowerIndex) {
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  // Only a few distinct values: many exact ties.
  const auto importance =
      torch::randint(0, 3, {kBatch, c.T, c.G, NS}, torch::TensorOptions().device(torch::kCUDA))
          .to(torch::kFloat);
  EXPECT_EQ(SelectionMismatches(importance, geo_), 0);
}

// -0 and +0 are one value, tied like any other (the kernel finds equal values by their bits,
// so it must make the zeros' bits one first).
TEST_P(KernelsTest, SelectBlocksTiesZerosOfEitherSign) {
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  const auto opts = torch::TensorOptions().device(torch::kCUDA);
  const auto pick = torch::randint(0, 3, {kBatch, c.T, c.G, NS}, opts);  // -0, +0 or 1
  const auto importance = torch::where(pick == 0, torch::full({}, -0.f, opts), (pick - 1).to(torch::kFloat));
  ASSERT_TRUE(torch::signbit(importance).any().item<bool>());
  EXPECT_EQ(SelectionMismatches(importance, geo_), 0);
}

// The selection at the lengths the benchmarks use (64k tokens: 1,024 blocks per row, far more
// than the other cases' 71) and past them, with distinct values, with many ties, and with one
// lane's blocks (1, 33, 65, ...) ahead of all others, so that more than 32 candidates pass
// the kernel's threshold and it takes its fallback. Every 7th row is checked against the CPU
// oracle (it sorts each row), plus the last rows, which have the most candidates.
// Outside the parameterised shapes: a geometry whose block length is not a multiple of its
// stride (l = 40, d = 8: rows of 8 positions, the first at t = 39) on the cuDNN path, and the
// default dispatch from 16k tokens, which takes cuDNN without being forced.
class CompressedOnCudnn : public testing::Test {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(cuda::Available());
    torch::manual_seed(77);
  }
  // Output and every gradient against the float32 reference.
  static void Check(int64_t T, int64_t H, int64_t G, const Geometry& geo) {
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
    const int64_t N = NumCmpBlocks(T, geo), D = 64;
    auto q = torch::randn({2, T, H, D}, opts).requires_grad_(true);
    auto k = torch::randn({2, N, G, D}, opts).requires_grad_(true);
    auto v = torch::randn({2, N, G, D}, opts).requires_grad_(true);
    const auto grad = torch::randn({2, T, H, D}, opts);
    auto got = cuda::CompressedAttention(q, k, v, geo);
    got.out.backward(grad);
    auto q32 = q.detach().to(torch::kFloat).requires_grad_(true);
    auto k32 = k.detach().to(torch::kFloat).requires_grad_(true);
    auto v32 = v.detach().to(torch::kFloat).requires_grad_(true);
    auto ref = CompressedAttentionReference(q32, k32, v32, geo);
    ref.out.backward(grad.to(torch::kFloat));
    const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
      const auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
      return ((a64 - b64).norm() / b64.norm()).item<double>();
    };
    EXPECT_LT(rel(got.out, ref.out), 2e-2);
    EXPECT_LT(rel(q.grad(), q32.grad()), 2e-2);
    EXPECT_LT(rel(k.grad(), k32.grad()), 2e-2);
    EXPECT_LT(rel(v.grad(), v32.grad()), 2e-2);
    // Positions before l - 1 see no block: exactly zero output and gradient.
    const int64_t blind = std::min(T, geo.cmp_block - 1);
    EXPECT_EQ(got.out.narrow(1, 0, blind).abs().max().item<float>(), 0.f);
    EXPECT_EQ(q.grad().narrow(1, 0, blind).abs().max().item<float>(), 0.f);
  }
};

TEST_F(CompressedOnCudnn, BlockLengthNotAMultipleOfTheStride) {
  cuda::detail::CompressedKernelChoice choice;
  choice.path = cuda::detail::CompressedKernelChoice::Path::kDense;
  const cuda::detail::ScopedCompressedKernelChoice force(choice);
  Geometry geo;
  geo.cmp_block = 40;
  geo.cmp_stride = 8;
  Check(1003, 6, 2, geo);
}

TEST_F(CompressedOnCudnn, DefaultFromSixteenKTokens) {
  const auto q = [](int64_t T, torch::ScalarType dtype) {
    return torch::empty({1, T, 4, 64}, torch::TensorOptions().dtype(dtype).device(torch::kCUDA));
  };
  const cuda::detail::Geo geo{32, 16, 64, 16, 512};
  EXPECT_TRUE(cuda::detail::UseDenseCompressed(q(16384, torch::kBFloat16), geo));
  EXPECT_TRUE(cuda::detail::UseDenseCompressed(q(16384, torch::kHalf), geo));
  EXPECT_FALSE(cuda::detail::UseDenseCompressed(q(16383, torch::kBFloat16), geo));
  EXPECT_FALSE(cuda::detail::UseDenseCompressed(q(16384, torch::kFloat), geo));
  Check(16400, 4, 2, Geometry{});
}

// The one-pass forward and importance (CmpOnePassKernel: every compressed block in two
// 64-key tiles, head_dim 64, the paper's geometry) at the lengths around its limits: no
// block (T < 32), one tile, the second tile's first block (T = 1056), the training length
// and the last length it takes (T = 2064, 128 blocks); 6 and 16 heads per group, bf16 and
// fp16. Against the float32 reference (output, gradients, importance from the reference
// probabilities) and against the two-pass kernels (CompressedKernelChoice::Pass::kTwo),
// whose output must differ in some bits at T = 2048 -- the proof that another kernel ran.
TEST(CompressedOnePass, MatchesTheReferenceAndTheTwoPassKernels) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(cuda::Available());
  using Choice = cuda::detail::CompressedKernelChoice;
  const Geometry geo;
  const int64_t B = 2, D = 64;
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto a64 = a.detach().to(torch::kDouble), b64 = b.detach().to(torch::kDouble);
    const double ref = b64.norm().item<double>(), err = (a64 - b64).norm().item<double>();
    return ref == 0.0 ? err : err / ref;
  };
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto [H, G] : {std::pair<int64_t, int64_t>{12, 2}, {64, 4}}) {
      for (const int64_t T : {int64_t{1}, int64_t{31}, int64_t{33}, int64_t{1056}, int64_t{2048}, int64_t{2064}}) {
        SCOPED_TRACE("T=" + std::to_string(T) + " H=" + std::to_string(H) + " G=" + std::to_string(G) +
                     (dtype == torch::kHalf ? " fp16" : " bf16"));
        torch::manual_seed(T * 7 + H);
        const auto opts = torch::TensorOptions().dtype(dtype).device(torch::kCUDA);
        const int64_t N = NumCmpBlocks(T, geo);
        ASSERT_LE(N, 128);
        auto q = torch::randn({B, T, H, D}, opts).requires_grad_(true);
        auto k = torch::randn({B, N, G, D}, opts).requires_grad_(true);
        auto v = torch::randn({B, N, G, D}, opts).requires_grad_(true);
        const auto grad = torch::randn({B, T, H, D}, opts);
        auto one = cuda::CompressedAttention(q, k, v, geo);
        one.out.backward(grad);
        Choice two_pass;
        two_pass.pass = Choice::Pass::kTwo;
        cuda::CmpImportanceResult two;
        {
          const cuda::detail::ScopedCompressedKernelChoice force(two_pass);
          two = cuda::CompressedAttention(q.detach(), k.detach(), v.detach(), geo);
        }

        auto q32 = q.detach().to(torch::kFloat).requires_grad_(true);
        auto k32 = k.detach().to(torch::kFloat).requires_grad_(true);
        auto v32 = v.detach().to(torch::kFloat).requires_grad_(true);
        auto ref = CompressedAttentionReference(q32, k32, v32, geo);
        ref.out.backward(grad.to(torch::kFloat));
        EXPECT_FALSE(one.out.isnan().any().item<bool>());
        EXPECT_LT(rel(one.out, ref.out), 2e-2);
        EXPECT_LT(rel(q.grad(), q32.grad()), 2e-2);
        if (N > 0) {
          EXPECT_LT(rel(k.grad(), k32.grad()), 2e-2);
          EXPECT_LT(rel(v.grad(), v32.grad()), 2e-2);
        }
        EXPECT_LT(rel(one.importance, ImportanceReference(ref.probs, G, geo)), 2e-2);

        // The two kernels compute the same probabilities in float32, in another order.
        EXPECT_LT(rel(one.importance, two.importance), 1e-5);
        EXPECT_LT(rel(one.out, two.out), 1e-2);
        if (T == 2048) EXPECT_FALSE(torch::equal(one.out, two.out)) << "the one-pass kernel did not run";
      }
    }
  }
}

// The quad map adds the heads of one position that a lane holds before it maps them: all of
// them at head_dim 64 with an even count per group up to 8 (CmpImportanceLaneKernel: 2, 4, 6
// and 8 here), else a tile's two rows (LaneRows' kLaneHeads) where the heads per group are
// even, all four of the lane's rows where they are a multiple of four at head_dim 64, and an
// odd count takes the W product. Each, in the one-pass length range (T = 2048) and the
// two-pass one (T = 4500; 3000 at head_dim 128), against the importance of the float32
// reference's probabilities, and against the forced W product and the forced staged rows
// (Map::kSlots) far tighter (all exact up to float32 rounding): heads added across two
// positions would be a whole head's share off.
TEST(CompressedImportance, EachHeadCountPerGroupMatchesTheReference) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(cuda::Available());
  using Choice = cuda::detail::CompressedKernelChoice;
  const Geometry geo;
  for (const auto [H, G] : {std::pair<int64_t, int64_t>{9, 3}, {12, 2}, {16, 2}, {4, 2}, {8, 2}}) {
    for (const auto [T, D] : {std::pair<int64_t, int64_t>{2048, 64}, {4500, 64}, {3000, 128}}) {
      SCOPED_TRACE("H=" + std::to_string(H) + " G=" + std::to_string(G) + " T=" + std::to_string(T) +
                   " D=" + std::to_string(D));
      torch::manual_seed(T + D + H);
      const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
      const int64_t N = NumCmpBlocks(T, geo);
      const auto q = torch::randn({1, T, H, D}, opts);
      const auto k = torch::randn({1, N, G, D}, opts), v = torch::randn({1, N, G, D}, opts);
      const auto importance_under = [&](Choice::Map map) {
        Choice choice;
        choice.map = map;
        const cuda::detail::ScopedCompressedKernelChoice force(choice);
        return cuda::CompressedAttention(q, k, v, geo).importance.to(torch::kDouble);
      };
      const auto importance = importance_under(Choice::Map::kAuto);
      const auto product = importance_under(Choice::Map::kProduct);
      const auto slots = importance_under(Choice::Map::kSlots);
      const auto ref =
          CompressedAttentionReference(q.to(torch::kFloat), k.to(torch::kFloat), v.to(torch::kFloat), geo);
      const auto want = ImportanceReference(ref.probs, G, geo).to(torch::kDouble);
      const double err = (importance - want).norm().item<double>() / want.norm().item<double>();
      EXPECT_LT(err, 2e-2) << "||importance - reference|| / ||reference||";
      const double scale = std::max(product.abs().max().item<double>(), 1.0);
      EXPECT_LT((importance - product).abs().max().item<double>(), 1e-5 * scale) << "against the W product";
      EXPECT_LT((importance - slots).abs().max().item<double>(), 1e-5 * scale) << "against the staged rows";
    }
  }
}

// The importance pass alone (CompressedImportance) on random bf16 inputs, H = 12, G = 2, in
// m7c's geometry: q, the compressed keys and values, and the compressed forward's lse.
struct ImportanceInputs {
  static constexpr int64_t kH = 12, kG = 2;
  const cuda::detail::Geo geo{32, 16, 64, 16, 512};
  int64_t T, NS;
  torch::Tensor q, k, v, lse;
  ImportanceInputs(int64_t seq, int64_t head_dim) : T(seq), NS(NumSlcBlocks(seq, Geometry{})) {
    torch::manual_seed(seq + head_dim);
    const auto opts = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
    const int64_t N = NumCmpBlocks(T, Geometry{});
    q = torch::randn({1, T, kH, head_dim}, opts);
    k = torch::randn({1, N, kG, head_dim}, opts);
    v = torch::randn({1, N, kG, head_dim}, opts);
    lse = std::get<1>(cuda::detail::CompressedForward(q, k, v, geo));
  }
  // NaN in the block the caching allocator hands the next importance tensor (freed at once).
  void PoisonNextImportance() const {
    torch::full({1, T, kG, NS}, std::nan(""), torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA));
  }
  torch::Tensor Importance(bool selection_only = false) const {
    return cuda::detail::CompressedImportance(q, k, lse, geo, selection_only);
  }
};

// The fused layer's importance pass leaves the selection blocks past each tile of positions
// unwritten (CompressedImportance's selection_only): the selection must not read them, and
// every block it ranks (up to t / l' - 2) is written and equals the zero-filling pass's. The
// tensor's memory is NaN first where the caching allocator hands back the freed block of the
// same size (as KernelsTest::Poison does), so that a skipped block the selection needed would
// not read as a plausible zero.
TEST(CompressedImportance, SelectionOnlyLeavesWhatTheSelectionNeeds) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(cuda::Available());
  for (const auto [T, D] : {std::pair<int64_t, int64_t>{4500, 64}, {3000, 128}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D));
    const ImportanceInputs in(T, D);
    const auto full = in.Importance();
    in.PoisonNextImportance();
    const auto partial = in.Importance(/*selection_only=*/true);
    EXPECT_TRUE(torch::equal(cuda::detail::SelectBlocksLaunch(partial, T, in.geo),
                             cuda::detail::SelectBlocksLaunch(full, T, in.geo)));
    // Blocks 0 .. t / l' - 2 of position t (those the selection ranks): the mask [T, NS].
    const auto cuda_ints = torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA);
    const auto own = torch::arange(in.NS, cuda_ints).unsqueeze(0) <=
                     torch::div(torch::arange(T, cuda_ints), in.geo.slc_block, "floor").unsqueeze(1) - 2;
    const auto mask = own.view({1, T, 1, in.NS}).expand_as(full);
    EXPECT_TRUE(torch::equal(partial.masked_select(mask), full.masked_select(mask)));
  }
}

// The zero-filling importance pass (the public CompressedAttention's) writes all NS blocks of a
// row: past the blocks a position's compressed keys reach, exactly 0. The lane kernels store
// that tail 16 bytes a lane where the rows are 16-byte aligned (NS % 4 == 0: T = 4096, NS = 64)
// and one float a lane where not (T = 4100, NS = 65). The tensor's memory is NaN first (as in
// the test above), so a block left unwritten shows.
TEST(CompressedImportance, ZeroFillsEachRowPastItsVisibleBlocks) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(cuda::Available());
  for (const auto [T, D] : {std::pair<int64_t, int64_t>{4096, 64}, {4100, 64}, {4096, 128}, {4100, 128}}) {
    SCOPED_TRACE("T=" + std::to_string(T) + " D=" + std::to_string(D));
    const ImportanceInputs in(T, D);
    in.PoisonNextImportance();
    const auto importance = in.Importance();
    ASSERT_TRUE(torch::isfinite(importance).all().item<bool>()) << "a block left unwritten";
    const auto ref = CompressedAttentionReference(in.q.to(torch::kFloat), in.k.to(torch::kFloat),
                                                  in.v.to(torch::kFloat), Geometry{});
    const auto unseen = ImportanceReference(ref.probs, ImportanceInputs::kG, Geometry{}) == 0;
    ASSERT_GT(unseen.sum().item<int64_t>(), T * ImportanceInputs::kG * in.NS / 3)
        << "the causal tails are most of a row's blocks";
    EXPECT_EQ(importance.masked_select(unseen).abs().max().item<float>(), 0.f);
  }
}

TEST(SelectBlocksLongRows, FollowTheRules) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(cuda::Available());
  const Geometry geo;
  const auto cuda_opts = torch::TensorOptions().device(torch::kCUDA);
  // kNaNsAndInfs: a third of the values NaN, a third -inf; kFewFinite: one in 128 finite, the
  // rest NaN or -inf, so the picks run into ties at -inf, broken by index.
  enum class Values { kDistinct, kTies, kOneLaneAhead, kNaNsAndInfs, kFewFinite };
  const auto nan_or_inf = [&](const torch::Tensor& x, double finite_share) {
    const auto draw = torch::rand_like(x);
    const auto non_finite = torch::full_like(x, -std::numeric_limits<float>::infinity())
                                .masked_fill(torch::rand_like(x) < 0.5, std::numeric_limits<float>::quiet_NaN());
    return torch::where(draw < finite_share, x, non_finite);
  };
  for (const int64_t T : {65536, 70000}) {
    for (const Values values : {Values::kDistinct, Values::kTies, Values::kOneLaneAhead, Values::kNaNsAndInfs,
                                Values::kFewFinite}) {
      const int64_t NS = NumSlcBlocks(T, geo);
      torch::manual_seed(T + static_cast<int>(values));
      torch::Tensor importance;
      switch (values) {
        case Values::kDistinct: importance = torch::rand({1, T, 1, NS}, cuda_opts); break;
        case Values::kTies: importance = torch::randint(0, 3, {1, T, 1, NS}, cuda_opts).to(torch::kFloat); break;
        case Values::kOneLaneAhead:
          importance = torch::rand({1, T, 1, NS}, cuda_opts) +
                       (torch::arange(NS, cuda_opts).remainder(32) == 1).to(torch::kFloat);
          break;
        case Values::kNaNsAndInfs: importance = nan_or_inf(torch::rand({1, T, 1, NS}, cuda_opts), 1.0 / 3); break;
        case Values::kFewFinite: importance = nan_or_inf(torch::rand({1, T, 1, NS}, cuda_opts), 1.0 / 128); break;
      }
      const auto got = cuda::SelectBlocks(importance, T, geo).cpu();
      const auto imp = importance.cpu().contiguous();
      int64_t mismatches = 0, checked = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (t % 7 != 0 && t < T - 64) continue;
        const auto want = SelectRow(imp.data_ptr<float>() + t * NS, t, NS, geo);
        ++checked;
        for (int64_t i = 0; i < geo.top_n; ++i)
          mismatches += got.data_ptr<int>()[t * geo.top_n + i] != want[i];
      }
      EXPECT_EQ(mismatches, 0) << "T=" << T << ", values " << static_cast<int>(values);
      EXPECT_GT(checked, T / 8);
    }
  }
}

// The smallest and largest top_n the kernel takes (3: forced blocks only; 32: one per lane)
// on long rows.
TEST(SelectBlocksLongRows, SmallestAndLargestTopN) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto cuda_opts = torch::TensorOptions().device(torch::kCUDA);
  const int64_t T = 65536;
  for (const int top_n : {3, 32}) {
    Geometry geo;
    geo.top_n = top_n;
    const int64_t NS = NumSlcBlocks(T, geo);
    torch::manual_seed(top_n);
    const auto importance = torch::rand({1, T, 1, NS}, cuda_opts);
    const auto got = cuda::SelectBlocks(importance, T, geo).cpu();
    const auto imp = importance.cpu().contiguous();
    int64_t mismatches = 0;
    for (int64_t t = 0; t < T; t += 61) {
      const auto want = SelectRow(imp.data_ptr<float>() + t * NS, t, NS, geo);
      for (int64_t i = 0; i < top_n; ++i) mismatches += got.data_ptr<int>()[t * top_n + i] != want[i];
    }
    EXPECT_EQ(mismatches, 0) << "top_n=" << top_n;
  }
}

// The inverted block map (block_map.h) against one built on the host from its definition:
// entries grouped by (b, g, block), positions ascending inside, unused slots last; segments
// cut into items of queries_per_item entries; items in position order by their first entry.
// Three uses of the slots: all blocks drawn; only even blocks, so every other segment is empty;
// no slot used at all, so every segment is. With skip_local_of (the key-centric forward's local
// pass) an entry whose block is local to its position (block 0, its own or the one before) is
// left out like an unused slot, and so is a block index past the last block (NS). Each entry
// left out has its rows of the marked buffer set to -inf (NoPartialMarks: the block forward's
// partial lse, from which its combine tells the entries that count); the others keep theirs.
// About one slot in ten repeats a block an earlier slot of its row listed: a repeat is left out
// too. Rows of n = 4 and n = 6 slots (a row of 6 can straddle two warps of the keys kernel).
TEST(InvertBlockMap, MatchesTheHostDefinition) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 2, T = 301, G = 3;
  enum class Use { kAll, kEvenBlocks, kNoSlot };
  for (const int64_t n : {4, 6}) {
    for (const Use use : {Use::kAll, Use::kEvenBlocks, Use::kNoSlot}) {
      for (const int per_item : {1, 7, 512}) {
        SCOPED_TRACE("n " + std::to_string(n) + ", use " + std::to_string(static_cast<int>(use)) + ", per_item " +
                     std::to_string(per_item));
        const int drawn = 11;  // blocks drawn from; even blocks spread them over 2 * drawn
        const int NS = use == Use::kEvenBlocks ? 2 * drawn : drawn;
        torch::manual_seed(per_item);
        // Distinct blocks per row (a random permutation's first n), about one slot in five unused
        // (all with kNoSlot).
        auto idx = torch::rand({B, T, G, drawn}).argsort(int64_t{-1}).slice(-1, 0, n).to(torch::kInt);
        if (use == Use::kEvenBlocks) idx = idx * 2;
        const double unused = use == Use::kNoSlot ? 1.0 : 0.2;
        idx = torch::where(torch::rand({B, T, G, n}) < unused, torch::full({}, -1, torch::kInt), idx);
        if (use != Use::kNoSlot) {  // about one slot in twenty past the last block
          idx = torch::where(torch::rand({B, T, G, n}) < 0.05, torch::full({}, NS, torch::kInt), idx);
        }
        idx = idx.contiguous();
        {  // about one slot in ten copies an earlier slot of its row
          auto* slots = idx.data_ptr<int>();
          const auto draw = torch::rand({idx.numel()});
          const auto pick = torch::randint(0, n, {idx.numel()}, torch::kLong);
          for (int64_t e = 0; e < idx.numel(); ++e) {
            const int64_t slot = e % n;
            if (slot > 0 && draw.data_ptr<float>()[e] < 0.1f) {
              slots[e] = slots[e - slot + pick.data_ptr<int64_t>()[e] % slot];
            }
          }
        }
        const int slc_block = static_cast<int>((T + NS - 1) / NS);  // NS blocks cover the sequence
        for (const auto& [position_order, skip_local_of] :
             std::vector<std::pair<bool, int>>{{false, 0}, {true, 0}, {false, slc_block}, {true, slc_block}}) {
          SCOPED_TRACE(std::string(position_order ? "position order" : "block order") +
                       (skip_local_of > 0 ? ", local blocks left out" : ""));
          const int64_t S = B * G * NS, E = idx.numel();
          constexpr int kRowsPerEntry = 3;
          const float kept = 7.f;
          auto marked = torch::full({E * kRowsPerEntry}, kept, torch::TensorOptions().device(torch::kCUDA));
          const auto map = cuda::detail::InvertBlockMap(idx.cuda(), NS, per_item, position_order, skip_local_of,
                                                        {marked.data_ptr<float>(), kRowsPerEntry});
          const int* e_blk = idx.data_ptr<int>();
          std::vector<int64_t> key(E), entries(E);
          for (int64_t e = 0; e < E; ++e) {
            const int64_t g = (e / n) % G, b = e / (n * G * T), t = (e / (n * G)) % T;
            const int64_t blk = e_blk[e], own = skip_local_of > 0 ? t / skip_local_of : -1;
            const bool local = skip_local_of > 0 && blk >= 0 && (blk == 0 || blk == own || blk == own - 1);
            const int* row = e_blk + (e - e % n);
            const bool repeat = std::find(row, row + e % n, blk) != row + e % n;
            key[e] = blk < 0 || blk >= NS || local || repeat ? S : (b * G + g) * NS + blk;
          }
          const auto marks = marked.cpu();
          int64_t wrong_marks = 0;
          for (int64_t e = 0; e < E; ++e) {
            const float want = key[e] == S ? -std::numeric_limits<float>::infinity() : kept;
            for (int r = 0; r < kRowsPerEntry; ++r) {
              wrong_marks += marks.data_ptr<float>()[e * kRowsPerEntry + r] != want;
            }
          }
          EXPECT_EQ(wrong_marks, 0);
          std::iota(entries.begin(), entries.end(), 0);
          std::stable_sort(entries.begin(), entries.end(), [&](int64_t x, int64_t y) { return key[x] < key[y]; });
          std::vector<int64_t> seg_off(S + 1, 0), chunk_off(S + 1, 0);
          for (int64_t s = 0; s < S; ++s) {
            const int64_t count = std::count(key.begin(), key.end(), s);
            seg_off[s + 1] = seg_off[s] + count;
            chunk_off[s + 1] = chunk_off[s] + (count + per_item - 1) / per_item;
          }
          const auto sorted = map.sorted_entry.cpu(), so = map.seg_off.cpu(), co = map.chunk_off.cpu();
          ASSERT_EQ(map.segments, S);
          ASSERT_GE(map.max_items, chunk_off[S]);
          for (int64_t i = 0; i < E; ++i) ASSERT_EQ(sorted.data_ptr<int>()[i], entries[i]) << i;
          for (int64_t s = 0; s <= S; ++s) {
            ASSERT_EQ(so.data_ptr<int64_t>()[s], seg_off[s]) << s;
            ASSERT_EQ(co.data_ptr<int64_t>()[s], chunk_off[s]) << s;
          }
          const auto item_seg = map.item_seg.cpu();
          std::vector<int64_t> first_position(map.max_items, std::numeric_limits<int64_t>::max());
          for (int64_t s = 0; s < S; ++s) {
            for (int64_t item = chunk_off[s]; item < chunk_off[s + 1]; ++item) {
              ASSERT_EQ(item_seg.data_ptr<int>()[item], s) << item;
              first_position[item] = entries[seg_off[s] + (item - chunk_off[s]) * per_item] / (G * n);
            }
          }
          ASSERT_EQ(map.item_order.defined(), position_order);
          if (!position_order) continue;
          std::vector<int64_t> order(map.max_items);
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(),
                           [&](int64_t x, int64_t y) { return first_position[x] < first_position[y]; });
          const auto got = map.item_order.cpu();
          for (int64_t i = 0; i < map.max_items; ++i) ASSERT_EQ(got.data_ptr<int>()[i], order[i]) << i;
        }
      }
    }
  }
}

TEST_P(KernelsTest, SlidingWindowForwardAndGradients) { CheckSlidingWindow(); }

// FlashAttention-2's windowed forward, the path before the tiled one (kept for A/B timings):
// same checks, and the backward then gets FlashAttention's own log-sum-exp.
TEST_P(KernelsTest, SlidingWindowFlashForward) {
  const cuda::detail::ScopedWindowKernelChoice force({cuda::detail::WindowKernelChoice::Forward::kFlash});
  CheckSlidingWindow();  // the choice is restored on failure too
}

// The tiled window forward where auto does not take it (head_dim 128), and everywhere else.
TEST_P(KernelsTest, SlidingWindowTiledForward) {
  if (GetParam().dtype == torch::kFloat) GTEST_SKIP() << "fp32 has the masked path only";
  const cuda::detail::ScopedWindowKernelChoice force({cuda::detail::WindowKernelChoice::Forward::kTiled});
  CheckSlidingWindow();
}

// The default window forward is the tiled one at head_dim 64, and at 128 where the warpgroup
// kernel runs (an sm_90 device; FlashAttention-2 there before): the dispatch says so, and the
// output is bit for bit the forced tiled forward's.
TEST_P(KernelsTest, SlidingWindowAutoTakesTheTiledForward) {
  using Win = cuda::detail::WindowKernelChoice;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "fp32 has the masked path only";
  if (c.D == 128 && !cuda::detail::WgmmaRunsHere()) GTEST_SKIP() << "D128: FlashAttention-2 off sm_90";
  const auto q = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto k = torch::randn({kBatch, c.T, c.G, c.D}, Opts());
  const auto v = torch::randn({kBatch, c.T, c.G, c.D}, Opts());
  EXPECT_TRUE(cuda::detail::UseTiledWindowForward(q));
  const auto by_default = cuda::SlidingWindowAttention(q, k, v, geo_);
  const cuda::detail::ScopedWindowKernelChoice force({Win::Forward::kTiled});
  EXPECT_TRUE(torch::equal(by_default, cuda::SlidingWindowAttention(q, k, v, geo_)));
}

// The tiled window forward takes bf16/fp16 with head_dim 64 or 128: forcing it on fp32 fails
// instead of running the masked fp32 path.
TEST_P(KernelsTest, SlidingWindowRejectsATiledForwardItCannotRun) {
  const Case c = GetParam();
  if (c.dtype != torch::kFloat) GTEST_SKIP() << "bf16/fp16 at D=64/128 take the tiled forward";
  const cuda::detail::ScopedWindowKernelChoice force({cuda::detail::WindowKernelChoice::Forward::kTiled});
  const auto q = torch::randn({1, c.T, c.H, c.D}, Opts());
  const auto kv = torch::randn({1, c.T, c.G, c.D}, Opts());
  EXPECT_THROW(cuda::SlidingWindowAttention(q, kv, kv, geo_), c10::Error);
}

// Each window backward after each window forward: the warpgroup-MMA backward (the default on
// an sm_90 device, head_dim 64 and 128) reads the log-sum-exp in the tiled forward's layout,
// FlashAttention-2's in its own, so each pairing checks the conversion it needs, if any.
TEST_P(KernelsTest, SlidingWindowEachBackwardAfterEachForward) {
  using Win = cuda::detail::WindowKernelChoice;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "fp32 has the masked path only";
  for (const Win::Backward backward : {Win::Backward::kFlash, Win::Backward::kWgmma}) {
    if (backward == Win::Backward::kWgmma && !cuda::detail::WgmmaRunsHere()) continue;
    for (const Win::Forward forward : {Win::Forward::kFlash, Win::Forward::kTiled}) {
      SCOPED_TRACE(std::string(forward == Win::Forward::kFlash ? "flash" : "tiled") + " forward, " +
                   (backward == Win::Backward::kFlash ? "flash" : "wgmma") + " backward");
      const cuda::detail::ScopedWindowKernelChoice force({forward, backward});
      CheckSlidingWindow();
    }
  }
}

// The selected and window branches as one autograd node (the model's call) against the float32
// reference of both: outputs and the five gradients, dq being the two branches' summed in
// float32 and rounded once. bf16/fp16 after each window backward; fp32 takes separate calls.
TEST_P(KernelsTest, SelectedAndWindowInOneNodeMatchTheReference) {
  using Win = cuda::detail::WindowKernelChoice;
  const Case c = GetParam();
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto ks = Random({kBatch, c.T, c.G, c.D}), vs = Random({kBatch, c.T, c.G, c.D});
  auto kw = Random({kBatch, c.T, c.G, c.D}), vw = Random({kBatch, c.T, c.G, c.D});
  const auto importance = torch::rand({kBatch, c.T, c.G, NS}, Opts().dtype(torch::kFloat));
  const auto idx = cuda::SelectBlocks(importance, c.T, geo_);
  const auto grad_s = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto grad_w = torch::randn({kBatch, c.T, c.H, c.D}, Opts());

  auto q32 = Upcast(q), ks32 = Upcast(ks), vs32 = Upcast(vs), kw32 = Upcast(kw), vw32 = Upcast(vw);
  const auto ref_s = SelectedAttentionReference(q32, ks32, vs32, idx, geo_);
  const auto ref_w = SlidingWindowAttentionReference(q32, kw32, vw32, geo_);
  torch::autograd::backward({ref_s, ref_w}, {grad_s.to(torch::kFloat), grad_w.to(torch::kFloat)});

  std::vector<Win::Backward> backwards = {Win::Backward::kAuto};
  if (c.dtype != torch::kFloat) {
    backwards = {Win::Backward::kFlash};
    if (cuda::detail::WgmmaRunsHere() && (c.D == 64 || c.D == 128)) backwards.push_back(Win::Backward::kWgmma);
  }
  for (const Win::Backward backward : backwards) {
    SCOPED_TRACE(backward == Win::Backward::kFlash ? "flash backward" : "wgmma/auto backward");
    const cuda::detail::ScopedWindowKernelChoice force({Win::Forward::kAuto, backward});
    for (auto* t : {&q, &ks, &vs, &kw, &vw}) t->mutable_grad().reset();
    Poison();
    const auto [out_s, out_w] = cuda::SelectedAndWindowAttention(q, ks, vs, idx, kw, vw, geo_);
    Poison();
    torch::autograd::backward({out_s, out_w}, {grad_s, grad_w});
    ExpectClose(out_s, ref_s, "out slc");
    ExpectClose(out_w, ref_w, "out win");
    ExpectClose(q.grad(), q32.grad(), "dq");
    ExpectClose(ks.grad(), ks32.grad(), "dk slc");
    ExpectClose(vs.grad(), vs32.grad(), "dv slc");
    ExpectClose(kw.grad(), kw32.grad(), "dk win");
    ExpectClose(vw.grad(), vw32.grad(), "dv win");
  }
}

// The summed importance of the blocks idx [B,T,G,n] selects (-1: none), per (b, t, g).
torch::Tensor SelectedImportance(const torch::Tensor& importance, const torch::Tensor& idx) {
  const auto picked = importance.gather(3, idx.clamp_min(0).to(torch::kLong));
  return (picked * idx.ge(0)).sum(3);
}

// The three branches and their gate mixing as one node (the model's call on the CUDA backend)
// against the float32 reference: ApplyRope of q, then CompressedAttentionReference,
// SelectedAttentionReference over the node's selection, SlidingWindowAttentionReference, mixed
// by the gates; the output and all eight gradients (dq: three branches summed in float32,
// each attention backward given the mixing's row sums, rotated back by RoPE's backward). The node's selection must be worth what the separate ops' is (summed
// importance per position; those ops are held to the reference above). Each compressed path
// (ours, cuDNN) after each window backward; fp32 is refused (the dispatch takes separate calls).
TEST_P(KernelsTest, BranchesMixedInOneNodeMatchTheReference) {
  using Win = cuda::detail::WindowKernelChoice;
  using Cmp = cuda::detail::CompressedKernelChoice;
  const Case c = GetParam();
  const int64_t N = NumCmpBlocks(c.T, geo_);
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto kc = Random({kBatch, N, c.G, c.D}), vc = Random({kBatch, N, c.G, c.D});
  auto ks = Random({kBatch, c.T, c.G, c.D}), vs = Random({kBatch, c.T, c.G, c.D});
  auto kw = Random({kBatch, c.T, c.G, c.D}), vw = Random({kBatch, c.T, c.G, c.D});
  auto gates = torch::rand({kBatch, c.T, c.H, 3}, Opts()).requires_grad_(true);
  const auto rope = MakeRopeTable(torch::arange(c.T, Opts().dtype(torch::kLong)), c.D, 10000.0, torch::kFloat);
  if (c.dtype == torch::kFloat) {
    EXPECT_THROW(cuda::BranchesMixed(q, rope.cos, rope.sin, kc, vc, ks, vs, kw, vw, gates, geo_), c10::Error);
    return;
  }
  const auto grad = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto q_rotated = ApplyRope(q.detach(), rope);
  const auto separate_importance =
      cuda::CompressedAttention(q_rotated, kc.detach(), vc.detach(), geo_).importance;

  std::vector<Win::Backward> backwards = {Win::Backward::kFlash};
  if (cuda::detail::WgmmaRunsHere() && (c.D == 64 || c.D == 128)) backwards.push_back(Win::Backward::kWgmma);
  std::vector<Cmp::Path> cmp_paths = {Cmp::Path::kOwn};
  if (c.D % 8 == 0 && c.D <= 128 && N >= 2) cmp_paths.push_back(Cmp::Path::kDense);
  for (const Cmp::Path cmp_path : cmp_paths) {
    for (const Win::Backward backward : backwards) {
      SCOPED_TRACE(std::string(cmp_path == Cmp::Path::kOwn ? "own" : "cuDNN") + " compressed, " +
                   (backward == Win::Backward::kFlash ? "flash" : "wgmma") + " window backward");
      Cmp cmp_choice;
      cmp_choice.path = cmp_path;
      const cuda::detail::ScopedCompressedKernelChoice force_cmp(cmp_choice);
      const cuda::detail::ScopedWindowKernelChoice force_win({Win::Forward::kAuto, backward});
      for (auto* t : {&q, &kc, &vc, &ks, &vs, &kw, &vw, &gates}) t->mutable_grad().reset();
      Poison();
      const auto [out, idx] = cuda::BranchesMixed(q, rope.cos, rope.sin, kc, vc, ks, vs, kw, vw, gates, geo_);
      Poison();
      out.backward(grad);

      const auto node_worth = SelectedImportance(separate_importance, idx);
      const auto separate_worth =
          SelectedImportance(separate_importance, cuda::SelectBlocks(separate_importance, c.T, geo_));
      EXPECT_LT((node_worth - separate_worth).abs().max().item<float>(), 1e-3) << "selection";

      auto q32 = Upcast(q), kc32 = Upcast(kc), vc32 = Upcast(vc), ks32 = Upcast(ks), vs32 = Upcast(vs),
           kw32 = Upcast(kw), vw32 = Upcast(vw), g32 = Upcast(gates);
      const auto q32_rotated = ApplyRope(q32, rope);
      const auto ref_c = CompressedAttentionReference(q32_rotated, kc32, vc32, geo_).out;
      const auto ref_s = SelectedAttentionReference(q32_rotated, ks32, vs32, idx, geo_);
      const auto ref_w = SlidingWindowAttentionReference(q32_rotated, kw32, vw32, geo_);
      const auto ref = g32.select(3, 0).unsqueeze(3) * ref_c + g32.select(3, 1).unsqueeze(3) * ref_s +
                       g32.select(3, 2).unsqueeze(3) * ref_w;
      ref.backward(grad.to(torch::kFloat));
      ExpectClose(out, ref, "out");
      ExpectClose(q.grad(), q32.grad(), "dq");
      ExpectClose(kc.grad(), kc32.grad(), "dk cmp");
      ExpectClose(vc.grad(), vc32.grad(), "dv cmp");
      ExpectClose(ks.grad(), ks32.grad(), "dk slc");
      ExpectClose(vs.grad(), vs32.grad(), "dv slc");
      ExpectClose(kw.grad(), kw32.grad(), "dk win");
      ExpectClose(vw.grad(), vw32.grad(), "dv win");
      ExpectClose(gates.grad(), g32.grad(), "dgates");
    }
  }
}

// The model's call passes the selected keys and values as outputs of the kv projection's split
// (ApplyRopeParts) with a GradientHandoff: the node's backward then hands its float32 dK/dV
// sums to the split's backward, which rounds them once, instead of returning them rounded. The
// split's input gets the gradients the plain call gives its leaves (up to the order of the
// float32 atomics, whose sums are rounded to the same dtype either way), and the slots were
// used: what they held before the backward is gone after it. Slots given for keys and values
// the split did not make (plain leaves) are ignored: those gradients come back through autograd.
TEST_P(KernelsTest, BranchesMixedHandsTheSelectedDkDvToTheirSplit) {
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "BranchesMixed takes bf16/fp16 only";
  const int64_t N = NumCmpBlocks(c.T, geo_);
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto kc = Random({kBatch, N, c.G, c.D}), vc = Random({kBatch, N, c.G, c.D});
  auto kw = Random({kBatch, c.T, c.G, c.D}), vw = Random({kBatch, c.T, c.G, c.D});
  auto gates = torch::rand({kBatch, c.T, c.H, 3}, Opts()).requires_grad_(true);
  const auto split_input = Random({kBatch, c.T, 2, c.G, c.D});  // [k_slc | v_slc], copied by the split
  auto ks = split_input.detach().select(2, 0).clone().requires_grad_(true);
  auto vs = split_input.detach().select(2, 1).clone().requires_grad_(true);
  const auto rope = MakeRopeTable(torch::arange(c.T, Opts().dtype(torch::kLong)), c.D, 10000.0, torch::kFloat);
  const auto grad = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto rel = [](const torch::Tensor& a, const torch::Tensor& b) {
    const auto bd = b.to(torch::kDouble);
    return ((a.to(torch::kDouble) - bd).norm() / bd.norm().clamp_min(1e-30)).item<double>();
  };

  const auto ignored = c10::make_intrusive<GradientHandoff>(2);
  const auto [out, idx] =
      cuda::BranchesMixed(q, rope.cos, rope.sin, kc, vc, ks, vs, kw, vw, gates, geo_, {}, {ignored, 0}, {ignored, 1});
  out.backward(grad);
  ASSERT_TRUE(ks.grad().defined() && vs.grad().defined()) << "slots the split did not make are ignored";
  EXPECT_FALSE(ignored->Take(0).defined() || ignored->Take(1).defined());
  const auto dq_plain = q.grad().clone(), dgates_plain = gates.grad().clone();
  for (auto* t : {&q, &kc, &vc, &kw, &vw, &gates}) t->mutable_grad().reset();

  const auto handoff = c10::make_intrusive<GradientHandoff>(2);
  const auto parts = cuda::ApplyRopeParts(split_input, rope.cos, rope.sin, {false, false}, {}, {}, handoff);
  const auto [out_h, idx_h] = cuda::BranchesMixed(q, rope.cos, rope.sin, kc, vc, parts[0], parts[1], kw, vw, gates,
                                                  geo_, {}, {handoff, 0}, {handoff, 1});
  EXPECT_TRUE(torch::equal(idx_h, idx));
  EXPECT_LT(rel(out_h, out), 1e-3);
  const auto sentinel = torch::full({1}, 7.0, Opts());
  handoff->Put(0, sentinel);
  handoff->Put(1, sentinel);
  Poison();
  out_h.backward(grad);
  EXPECT_FALSE(handoff->Take(0).defined() || handoff->Take(1).defined())
      << "the node put its sums into the slots and the split's backward took them";
  const auto d_split = split_input.grad();
  ASSERT_TRUE(d_split.defined());
  EXPECT_EQ(d_split.scalar_type(), c.dtype);
  EXPECT_LT(rel(d_split.select(2, 0), ks.grad()), 1e-2) << "dk slc";
  EXPECT_LT(rel(d_split.select(2, 1), vs.grad()), 1e-2) << "dv slc";
  EXPECT_LT(rel(q.grad(), dq_plain), 1e-2) << "dq";
  EXPECT_LT(rel(gates.grad(), dgates_plain), 1e-2) << "dgates";
}

// A window of one key makes each row's softmax that key alone (P = 1), so the backward is
// known exactly: dS = P (dO.V - dO.O) = 0, so dQ = dK = 0, and dV of a position is the sum
// of dO over the group's heads at that position. A mask that let in any other key would give
// those keys P > 0 and move dV off that sum.
TEST_P(KernelsTest, WgmmaWindowBackwardWindowOfOne) {
  const Case c = GetParam();
  if (c.dtype == torch::kFloat || !cuda::detail::WgmmaRunsHere()) GTEST_SKIP() << "sm_90, bf16/fp16 only";
  const auto [q, k, v, dout] = RandomAttentionInputs();
  const auto [out, lse] = cuda::detail::WindowForward(q, k, v, 1);
  Poison();
  const auto [dq, dk, dv] = cuda::detail::WindowBackward(dout, q, k, v, out, lse, 1);
  const auto head_sum = dout.to(torch::kFloat).view({kBatch, c.T, c.G, c.H / c.G, c.D}).sum(3);
  ExpectClose(dv, head_sum, "dv");
  ExpectClose(dq, torch::zeros_like(dq), "dq");
  ExpectClose(dk, torch::zeros_like(dk), "dk");
}

// The float32 sum the node's backwards add dq into must be 16-byte aligned: the backwards add
// into it with 16-byte atomics. A view one float into a buffer is refused with an error that
// names it instead of running a misaligned 16-byte atomic (a sticky CUDA error for the whole
// process); the aligned view of the same buffer takes the same dq as a backward without a
// sum.
TEST_P(KernelsTest, WindowBackwardRefusesAMisalignedDqSum) {
  const Case c = GetParam();
  if (c.dtype == torch::kFloat || !cuda::detail::WgmmaRunsHere()) GTEST_SKIP() << "sm_90, bf16/fp16 only";
  const auto [q, k, v, dout] = RandomAttentionInputs();
  const auto [out, lse] = cuda::detail::WindowForward(q, k, v, geo_.window);
  const auto buffer = torch::zeros({q.numel() + 4}, Opts().dtype(torch::kFloat));
  auto misaligned = buffer.narrow(0, 1, q.numel()).view(q.sizes());
  try {
    cuda::detail::WindowBackward(dout, q, k, v, out, lse, geo_.window, &misaligned);
    ADD_FAILURE() << "a backward into a misaligned dq_sum ran";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("dq_sum must be 16-byte aligned"), std::string::npos) << e.what();
  }
  auto aligned = buffer.narrow(0, 4, q.numel()).view(q.sizes());
  cuda::detail::WindowBackward(dout, q, k, v, out, lse, geo_.window, &aligned);
  const auto [dq, dk, dv] = cuda::detail::WindowBackward(dout, q, k, v, out, lse, geo_.window);
  ExpectClose(aligned, dq.to(torch::kFloat), "dq_sum");
}

// The warpgroup-MMA window backward with other slices of a key block's positions per work
// item: one position (a slice per position, every dK/dV row added from many CTAs), 24, 320
// (two slices of the window of 512's 575 positions) and the most a CTA holds (one slice per
// block, its dK/dV rows written rounded); out of range fails the call.
TEST_P(KernelsTest, WgmmaWindowBackwardAnyPositionsPerItem) {
  using Win = cuda::detail::WindowKernelChoice;
  constexpr int kMost = cuda::detail::kMaxWindowQueriesPerItem;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat || !cuda::detail::WgmmaRunsHere()) GTEST_SKIP() << "sm_90, bf16/fp16 only";
  for (const int per_item : {1, 24, 320, kMost}) {
    SCOPED_TRACE(std::to_string(per_item) + " positions per item");
    const cuda::detail::ScopedWindowKernelChoice force({Win::Forward::kAuto, Win::Backward::kWgmma, per_item});
    CheckSlidingWindow();
  }
  const cuda::detail::ScopedWindowKernelChoice force({Win::Forward::kAuto, Win::Backward::kWgmma, kMost + 1});
  const auto q = Random({1, c.T, c.H, c.D});
  const auto kv = Random({1, c.T, c.G, c.D});
  auto out = cuda::SlidingWindowAttention(q, kv, kv, geo_);
  try {
    out.backward(torch::ones_like(out));
    ADD_FAILURE() << "a backward with " << kMost + 1 << " positions per item ran";
  } catch (const std::exception& e) {  // rethrown by the autograd engine
    EXPECT_NE(std::string(e.what()).find("queries_per_item"), std::string::npos) << e.what();
  }
}

// The default split takes all of a key block's positions in one work item, which writes the
// block's dK/dV rounded (no float32 sums): above for windows whose blocks fit an item (64 and
// 512, shorter sequences). A window whose blocks have more positions than an item holds falls
// back to slices of 128 whose dK/dV are added in float32; here it must give the same
// gradients.
TEST_P(KernelsTest, WgmmaWindowBackwardWithMorePositionsPerBlockThanAnItemHolds) {
  constexpr int kMost = cuda::detail::kMaxWindowQueriesPerItem;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat || !cuda::detail::WgmmaRunsHere()) GTEST_SKIP() << "sm_90, bf16/fp16 only";
  if (c.T <= kMost) GTEST_SKIP() << "every block's positions fit one item at T = " << c.T;
  geo_.window = kMost;  // a block's keys are attended by kMost + 63 positions
  CheckSlidingWindow();
}

// The warpgroup-MMA window backward takes bf16/fp16 on an sm_90 device: forcing it elsewhere
// (fp32 here) fails the call instead of running another backward.
TEST_P(KernelsTest, SlidingWindowRejectsAWgmmaBackwardItCannotRun) {
  using Win = cuda::detail::WindowKernelChoice;
  const Case c = GetParam();
  if (c.dtype != torch::kFloat) GTEST_SKIP() << "fp32 only";
  const cuda::detail::ScopedWindowKernelChoice force({Win::Forward::kAuto, Win::Backward::kWgmma});
  const auto q = torch::randn({1, c.T, c.H, c.D}, Opts());
  const auto kv = torch::randn({1, c.T, c.G, c.D}, Opts());
  EXPECT_THROW(cuda::SlidingWindowAttention(q, kv, kv, geo_), c10::Error);
}

// The tiled forward (the selected branch's kTiled forward and the window forward) on each
// kind of matrix instruction it has: mma.sync, and at head_dim 64 and 128 on an sm_90 device
// the warpgroup MMAs (at 128 all but the two-warpgroup kind: TiledForwardRejectsWgmmaItCannotRun),
// which the default takes there (so the other tests run them too).
TEST_P(KernelsTest, TiledForwardOnEachMmaKind) {
  using Mma = cuda::detail::TiledForwardChoice::Mma;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "tensor-core kernels only";
  for (const Mma mma : kTiledMmaKinds) {
    if (!TiledMmaRuns(mma, c.D)) continue;
    SCOPED_TRACE(MmaName(mma));
    const cuda::detail::ScopedTiledForwardChoice force_mma({mma});
    {
      cuda::detail::SelectedKernelChoice tiled;
      tiled.fwd = cuda::detail::SelectedKernelChoice::Fwd::kTiled;
      const cuda::detail::ScopedSelectedKernelChoice force(tiled);
      CheckSelectedAttention();
    }
    const cuda::detail::ScopedWindowKernelChoice force({cuda::detail::WindowKernelChoice::Forward::kTiled});
    CheckSlidingWindow();
  }
}

// A window of one key makes each row's softmax that key alone: the output is exactly the
// value row of its own position (P = 1), whatever the scores, and the log-sum-exp is the one
// score. So the two products of the tiled forward are checked apart: O = P V (for the
// warpgroup MMAs, V read transposed from shared memory) by the output, S = Q K^T (K read as
// it is staged) by the log-sum-exp.
TEST_P(KernelsTest, TiledForwardWindowOfOneReturnsItsOwnValue) {
  using Mma = cuda::detail::TiledForwardChoice::Mma;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "tensor-core kernels only";
  const auto q = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto k = torch::randn({kBatch, c.T, c.G, c.D}, Opts());
  const auto v = torch::randn({kBatch, c.T, c.G, c.D}, Opts());
  const int64_t hq = c.H / c.G;
  const auto own_v = v.repeat_interleave(hq, 2), own_k = k.repeat_interleave(hq, 2);
  const double scale_log2 = 1.0 / std::sqrt(static_cast<double>(c.D)) / std::log(2.0);
  const auto score = (q.to(torch::kDouble) * own_k.to(torch::kDouble)).sum(-1) * scale_log2;
  for (const Mma mma : kTiledMmaKinds) {
    if (!TiledMmaRuns(mma, c.D)) continue;
    SCOPED_TRACE(MmaName(mma));
    const cuda::detail::ScopedTiledForwardChoice force_mma({mma});
    Poison();
    const auto [out, lse] = cuda::detail::WindowForward(q, k, v, 1);
    EXPECT_TRUE(torch::equal(out, own_v)) << "max |out - v| "
                                          << (out.to(torch::kFloat) - own_v.to(torch::kFloat)).abs().max().item<float>();
    ExpectClose(lse, score, "lse");
  }
}

// Keys scaled by 1 + min(t, 255) / 16 make each of the first four 64-key blocks' row maxima
// rise about 14 (log2 units, D = 64) above the last block's, so the tiled forward's lazy
// rescale (mma::OnlineSoftmaxLazyRescale, which moves its reference only past a rise of 8)
// rescales block after block; scaled by 1 + max(0, 255 - t) / 16 instead, the first blocks
// set the reference and later p are small. The ramp stops at 17x, which keeps the top two
// scores of a row far apart compared with the rounding of bf16 scores. Selected (tiled walk)
// and window forwards on each MMA kind, against the float32 references; and the compressed
// forward on our shared-memory kernel (the same online softmax, mma.sync), its compressed
// keys ramped 4x as fast so that rows see the rise across its 64-key tiles at these lengths.
TEST_P(KernelsTest, TiledForwardFollowsRowMaxesThatRiseOrFall) {
  using Mma = cuda::detail::TiledForwardChoice::Mma;
  const Case c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "tensor-core kernels only";
  const int64_t NS = NumSlcBlocks(c.T, geo_);
  const auto fopts = Opts().dtype(torch::kFloat);
  const auto t = torch::arange(c.T, fopts).view({1, c.T, 1, 1});
  const auto q = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto v = torch::randn({kBatch, c.T, c.G, c.D}, Opts());
  const auto k_unit = torch::randn({kBatch, c.T, c.G, c.D}, fopts);
  const auto idx = cuda::SelectBlocks(torch::rand({kBatch, c.T, c.G, NS}, fopts), c.T, geo_);
  cuda::detail::SelectedKernelChoice tiled;
  tiled.fwd = cuda::detail::SelectedKernelChoice::Fwd::kTiled;
  for (const bool rising : {true, false}) {
    const auto ramp = rising ? t.clamp_max(255) : (255 - t).clamp_min(0);
    const auto k = (k_unit * (1 + ramp / 16)).to(c.dtype);
    const auto q32 = q.to(torch::kFloat), k32 = k.to(torch::kFloat), v32 = v.to(torch::kFloat);
    const auto selected_ref = SelectedAttentionReference(q32, k32, v32, idx, geo_);
    const auto window_ref = SlidingWindowAttentionReference(q32, k32, v32, geo_);
    for (const Mma mma : kTiledMmaKinds) {
      if (!TiledMmaRuns(mma, c.D)) continue;
      SCOPED_TRACE(std::string(rising ? "rising, " : "falling, ") + MmaName(mma));
      const cuda::detail::ScopedTiledForwardChoice force_mma({mma});
      {
        const cuda::detail::ScopedSelectedKernelChoice force(tiled);
        Poison();
        ExpectClose(cuda::SelectedAttention(q, k, v, idx, geo_), selected_ref, "selected");
      }
      const cuda::detail::ScopedWindowKernelChoice force({cuda::detail::WindowKernelChoice::Forward::kTiled});
      Poison();
      ExpectClose(cuda::SlidingWindowAttention(q, k, v, geo_), window_ref, "window");
    }
    const int64_t N = NumCmpBlocks(c.T, geo_);
    const auto n = torch::arange(N, fopts).view({1, N, 1, 1});
    const auto cmp_ramp = rising ? n.clamp_max(255) : (255 - n).clamp_min(0);
    const auto kc = (torch::randn({kBatch, N, c.G, c.D}, fopts) * (1 + cmp_ramp / 4)).to(c.dtype);
    const auto vc = torch::randn({kBatch, N, c.G, c.D}, Opts());
    const auto cmp_ref = CompressedAttentionReference(q32, kc.to(torch::kFloat), vc.to(torch::kFloat), geo_);
    cuda::detail::CompressedKernelChoice own;
    own.path = cuda::detail::CompressedKernelChoice::Path::kOwn;
    const cuda::detail::ScopedCompressedKernelChoice force(own);
    SCOPED_TRACE(rising ? "compressed, rising" : "compressed, falling");
    Poison();
    ExpectClose(cuda::CompressedAttention(q, kc, vc, geo_).out, cmp_ref.out, "compressed");
  }
}

// The two-warpgroup tiled forward is a head_dim-64 kernel (at 128 only the one-warpgroup kinds
// run): forcing it there fails the call instead of running another kernel.
TEST_P(KernelsTest, TiledForwardRejectsWgmmaItCannotRun) {
  const Case c = GetParam();
  if (c.dtype == torch::kFloat || c.D == 64) GTEST_SKIP() << "bf16/fp16 at head_dim 128 only";
  const cuda::detail::ScopedTiledForwardChoice force({cuda::detail::TiledForwardChoice::Mma::kWgmma});
  const auto q = torch::randn({1, c.T, c.H, c.D}, Opts());
  const auto kv = torch::randn({1, c.T, c.G, c.D}, Opts());
  EXPECT_THROW(cuda::detail::WindowForward(q, kv, kv, 8), c10::Error);
}

void KernelsTest::CheckSlidingWindow() {
  const Case c = GetParam();
  auto q = Random({kBatch, c.T, c.H, c.D});
  auto k = Random({kBatch, c.T, c.G, c.D});
  auto v = Random({kBatch, c.T, c.G, c.D});
  const auto grad = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  Poison();
  auto out = cuda::SlidingWindowAttention(q, k, v, geo_);
  out.backward(grad);
  auto q32 = Upcast(q), k32 = Upcast(k), v32 = Upcast(v);
  auto ref = SlidingWindowAttentionReference(q32, k32, v32, geo_);
  ref.backward(grad.to(torch::kFloat));
  ExpectClose(out, ref, "out");
  ExpectClose(q.grad(), q32.grad(), "dq");
  ExpectClose(k.grad(), k32.grad(), "dk");
  ExpectClose(v.grad(), v32.grad(), "dv");
}

// End to end as the model uses it: compressed importance -> selection -> selected attention.
// With random inputs the ranking can differ from the reference's on near-ties, so this
// checks the selection is valid (forced blocks present, causal, ascending, distinct).
TEST_P(KernelsTest, ImportanceDrivenSelectionIsValid) {
  const Case c = GetParam();
  const int64_t N = NumCmpBlocks(c.T, geo_);
  const auto q = torch::randn({kBatch, c.T, c.H, c.D}, Opts());
  const auto kc = torch::randn({kBatch, N, c.G, c.D}, Opts());
  const auto res = cuda::CompressedAttention(q, kc, kc, geo_);
  const auto idx = cuda::SelectBlocks(res.importance, c.T, geo_).cpu();
  const int* d = idx.data_ptr<int>();
  for (int64_t row = 0; row < kBatch * c.T * c.G; ++row) {
    const int64_t t = (row / c.G) % c.T, current = t / geo_.slc_block;
    const int* r = d + row * geo_.top_n;
    std::vector<int> used;
    for (int64_t i = 0; i < geo_.top_n; ++i)
      if (r[i] >= 0) used.push_back(r[i]);
    ASSERT_TRUE(std::is_sorted(used.begin(), used.end())) << "row " << row;
    ASSERT_EQ(std::adjacent_find(used.begin(), used.end()), used.end()) << "row " << row;
    ASSERT_EQ(used.size(), std::min<size_t>(geo_.top_n, current + 1)) << "row " << row;
    ASSERT_LE(used.back(), current) << "row " << row;
    ASSERT_EQ(used.front(), 0) << "row " << row;
    ASSERT_EQ(used.back(), current) << "row " << row;
    if (current > 0) ASSERT_TRUE(std::count(used.begin(), used.end(), current - 1)) << "row " << row;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, KernelsTest,
    testing::Values(Case{1, 4, 2, 64, torch::kBFloat16, false},
                    Case{33, 12, 2, 64, torch::kBFloat16, false},
                    Case{100, 16, 1, 128, torch::kBFloat16, true},
                    Case{257, 12, 2, 128, torch::kBFloat16, false},
                    Case{1000, 8, 4, 64, torch::kBFloat16, true},
                    Case{2061, 64, 4, 128, torch::kBFloat16, false},
                    Case{2061, 12, 2, 64, torch::kBFloat16, true},
                    // Several 64-block key tiles per CTA (compressed), 21 and 10 positions
                    // per 128-row CTA, the widest selection-block map (l' = 32).
                    Case{4500, 12, 2, 64, torch::kBFloat16, false},
                    Case{3000, 24, 2, 128, torch::kHalf, true},
                    Case{700, 8, 2, 64, torch::kBFloat16, true, 16},
                    // fp16 takes the tensor-core kernels' f16 MMA variant.
                    Case{257, 12, 2, 64, torch::kHalf, true},
                    Case{1000, 16, 1, 128, torch::kHalf, false},
                    Case{257, 12, 2, 64, torch::kFloat, true},
                    Case{1000, 16, 1, 128, torch::kFloat, false}),
    Name);

}  // namespace
}  // namespace nsad::nsa
