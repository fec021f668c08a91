// The fused elementwise ops of the attention module (kernels/fused_ops.h) against their
// LibTorch references: RoPE (nsa/rope.h ApplyRope) and the gate mixing of the three branch
// outputs, forward and gradients (torch::autograd::grad), bf16 / fp16 / fp32, odd lengths,
// batch > 1, several head counts, head dims 64 and 128.
//
// Two references: the same maths on inputs upcast to float32 (metric ||x-ref||/||ref||,
// under 2e-2 for bf16/fp16 and 1e-5 for fp32, as kernels_test), and for RoPE also the
// reference run in the input dtype itself -- what the reference backend computes -- which
// rounds once at the end like the kernel, so the two agree to (nearly) every bit.
// Without a CUDA device every test skips.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "fused_launchers.h"
#include "fused_ops.h"
#include "launchers.h"
#include "nsa/rope.h"
#include "nsa_cuda.h"
#include "test_names.h"

namespace nsad::nsa {
namespace {

struct FusedCase {
  int64_t B, T, H, D;
  torch::ScalarType dtype;
};

std::string FusedName(const testing::TestParamInfo<FusedCase>& info) {
  const FusedCase& c = info.param;
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) +
         "_D" + std::to_string(c.D) +
         DtypeSuffix(c.dtype);
}

class FusedOpsTest : public testing::TestWithParam<FusedCase> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(cuda::Available()) << "CUDA device present but the NSA kernels cannot run on it";
    torch::manual_seed(99 + GetParam().T * 3 + GetParam().H);
  }
  torch::TensorOptions Opts() const {
    return torch::TensorOptions().dtype(GetParam().dtype).device(torch::kCUDA);
  }
  double Tolerance() const { return GetParam().dtype == torch::kFloat ? 1e-5 : 2e-2; }
  static torch::Tensor Upcast(const torch::Tensor& t) {
    return t.detach().to(torch::kFloat).requires_grad_(true);
  }
  // Fresh allocations start as NaN, so an element a kernel forgets to write shows up.
  static void Poison() {
    torch::full({64 << 20}, std::numeric_limits<float>::quiet_NaN(),
                torch::TensorOptions().device(torch::kCUDA));
  }
  static double RelErr(const torch::Tensor& got, const torch::Tensor& want) {
    const auto g = got.detach().to(torch::kDouble), w = want.detach().to(torch::kDouble);
    const double ref = w.norm().item<double>();
    const double err = (g - w).norm().item<double>();
    return ref == 0.0 ? err : err / ref;
  }
  void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, double tol,
                   const std::string& what) const {
    ASSERT_EQ(got.sizes(), want.sizes()) << what;
    ASSERT_EQ(got.scalar_type(), GetParam().dtype) << what;
    ASSERT_FALSE(got.isnan().any().item<bool>()) << what << " has NaN";
    const double err = RelErr(got, want);
    std::printf("    %-16s rel err %.2e\n", what.c_str(), err);
    EXPECT_LT(err, tol) << what;
  }
  RopeTable Table(int64_t n) const {
    const auto positions = torch::arange(n, torch::TensorOptions().device(torch::kCUDA)) * 3 + 5;
    return MakeRopeTable(positions, GetParam().D, 10000.0, torch::kFloat);
  }

  // x [B,T,P,M,D] (a view as the module passes it) through the fused op and the reference:
  // forward and gradient w.r.t. x, with only part `used` (or all parts, -1) carrying
  // gradient. Parts with rotate[p] are rotated, the others copied.
  void CheckRope(const torch::Tensor& x, const RopeTable& table, const std::vector<bool>& rotate,
                 int used) {
    const int64_t P = x.size(2);
    std::vector<torch::Tensor> w;
    for (int64_t p = 0; p < P; ++p) {
      w.push_back(torch::randn({x.size(0), x.size(1), x.size(3), x.size(4)}, Opts()));
    }
    Poison();
    const auto parts = cuda::ApplyRopeParts(x, table.cos, table.sin, rotate);
    ASSERT_EQ(static_cast<int64_t>(parts.size()), P);
    std::vector<torch::Tensor> outs, grads;
    for (int64_t p = 0; p < P; ++p) {
      EXPECT_TRUE(parts[p].is_contiguous());
      if (used < 0 || used == p) {
        outs.push_back(parts[p]);
        grads.push_back(w[p]);
      }
    }
    Poison();
    const auto dx = torch::autograd::grad(outs, {x}, grads)[0];

    const auto x32 = Upcast(x);
    std::vector<torch::Tensor> ref_outs, ref_grads;
    for (int64_t p = 0; p < P; ++p) {
      const std::string part = "part " + std::to_string(p) + (rotate[p] ? " rope" : " copy");
      // float32 reference on the upcast inputs.
      const auto ref = rotate[p] ? ApplyRope(x32.select(2, p), table) : x32.select(2, p);
      ExpectClose(parts[p], ref, Tolerance(), part);
      // Same-dtype reference: what the reference backend computes from the same inputs.
      // Both round one float32 value computed the same way; allow a rare last-bit flip.
      const auto same = rotate[p] ? ApplyRope(x.detach().select(2, p), table)
                                  : x.detach().select(2, p);
      ExpectClose(parts[p], same, GetParam().dtype == torch::kFloat ? 1e-6 : 1e-3,
                  part + " vs same dtype");
      if (used < 0 || used == p) {
        ref_outs.push_back(ref);
        ref_grads.push_back(w[p].to(torch::kFloat));
      }
    }
    const auto dx32 = torch::autograd::grad(ref_outs, {x32}, ref_grads)[0];
    ExpectClose(dx, dx32, Tolerance(), used < 0 ? "dx" : "dx (1 part used)");
  }
};

TEST_P(FusedOpsTest, RopeOfQueriesMatchesTheReference) {
  const FusedCase c = GetParam();
  // As the module: a view [B,T,1,H,D] of a projection output.
  const auto x = torch::randn({c.B, c.T, c.H * c.D}, Opts()).requires_grad_(true);
  CheckRope(x.view({c.B, c.T, 1, c.H, c.D}), Table(c.T), {true}, -1);
}

TEST_P(FusedOpsTest, SplitOfTheKvProjectionWithRopeOnTwoPartsMatchesTheReference) {
  const FusedCase c = GetParam();
  const int64_t G = std::max<int64_t>(1, c.H / 4);
  // The module's layout: kv [B,T,6,G,D], the selected and window keys (parts 2, 4) rotated.
  const auto kv = torch::randn({c.B, c.T, 6 * G * c.D}, Opts()).requires_grad_(true);
  const std::vector<bool> rotate = {false, false, true, false, true, false};
  CheckRope(kv.view({c.B, c.T, 6, G, c.D}), Table(c.T), rotate, -1);
  CheckRope(kv.view({c.B, c.T, 6, G, c.D}), Table(c.T), rotate, 4);  // the rest get zeros
}

// The kv split as the CUDA backend's module runs it: the compression's two parts (0, 1) come
// out as one tensor of their chunks of 16 positions (nsa/part_chunks.h), every case's T
// leaving positions past the last chunk. The chunks hold exactly the plain split's values;
// the other parts are unchanged; and given the plain gradients in the chunk layout (zero past
// the chunks, which nothing reads), the gradient of x is exactly the plain one.
TEST_P(FusedOpsTest, SplitOfTheKvProjectionWritesTheCompressionsPartsAsChunks) {
  const FusedCase c = GetParam();
  const int64_t G = std::max<int64_t>(1, c.H / 4), len = 16, chunks = c.T / len;
  const auto kv = torch::randn({c.B, c.T, 6 * G * c.D}, Opts()).requires_grad_(true);
  const auto x = kv.view({c.B, c.T, 6, G, c.D});
  const auto table = Table(c.T);
  const std::vector<bool> rotate = {false, false, true, false, true, false};
  const auto as_chunks = [&](const torch::Tensor& t) {
    return t.narrow(1, 0, chunks * len).view({c.B, chunks, len, G, c.D}).permute({0, 1, 3, 2, 4});
  };
  const auto plain = cuda::ApplyRopeParts(x, table.cos, table.sin, rotate);
  Poison();
  const auto parts = cuda::ApplyRopeParts(x, table.cos, table.sin, rotate, {}, PartChunks{0, 2, len, chunks});
  ASSERT_EQ(parts.size(), 7u);
  EXPECT_FALSE(parts[0].defined());
  EXPECT_FALSE(parts[1].defined());
  const auto& stack = parts.back();
  ASSERT_EQ(stack.sizes(), (std::vector<int64_t>{2, c.B, chunks, G, len, c.D}));
  EXPECT_TRUE(stack.is_contiguous());
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(torch::equal(stack[i], as_chunks(plain[i]))) << "part " << i;
  for (int p = 2; p < 6; ++p) EXPECT_TRUE(torch::equal(parts[p], plain[p])) << "part " << p;

  std::vector<torch::Tensor> w;
  for (int p = 0; p < 6; ++p) w.push_back(torch::randn_like(plain[p]));
  for (int i = 0; i < 2; ++i) w[i].narrow(1, chunks * len, c.T - chunks * len).zero_();
  const auto dx_plain = torch::autograd::grad(plain, {kv}, w)[0];
  Poison();
  const auto dx = torch::autograd::grad({parts[2], parts[3], parts[4], parts[5], stack}, {kv},
                                        {w[2], w[3], w[4], w[5], torch::stack({as_chunks(w[0]), as_chunks(w[1])})})[0];
  EXPECT_TRUE(torch::equal(dx, dx_plain));
}

// Gradients handed past autograd (GradientHandoff), as the selected branch hands its float32
// dK/dV to the kv split's backward: parts 2 (rotated) and 3 (copied) get float32 gradients
// through the handoff while autograd gives them none; their dx is the float32 gradient rotated
// back and rounded once (part 3: bitwise the gradient's rounding), the other parts' dx is
// exactly the dx of a run without the handoff. The handoff knows its producer's outputs (so a
// consumer hands over only what this split's backward will take) and is empty afterwards; a
// part with neither gradient gets zeros. Both with and without the compression's chunks.
TEST_P(FusedOpsTest, SplitOfTheKvProjectionTakesHandedFloatGradients) {
  const FusedCase c = GetParam();
  const int64_t G = std::max<int64_t>(1, c.H / 4), len = 16, n_chunks = c.T / len;
  const auto kv = torch::randn({c.B, c.T, 6 * G * c.D}, Opts()).requires_grad_(true);
  const auto x = kv.view({c.B, c.T, 6, G, c.D});
  const auto table = Table(c.T);
  const std::vector<bool> rotate = {false, false, true, false, true, false};
  for (const bool chunked : {false, true}) {
    const PartChunks chunks = chunked && n_chunks > 0 ? PartChunks{0, 2, len, n_chunks} : PartChunks{};
    const auto handoff = c10::make_intrusive<GradientHandoff>(6);
    const auto parts = cuda::ApplyRopeParts(x, table.cos, table.sin, rotate, {}, chunks, handoff);
    const auto plain = cuda::ApplyRopeParts(x, table.cos, table.sin, rotate);
    EXPECT_TRUE(handoff->Produced(2, parts[2]) && handoff->Produced(3, parts[3]) && handoff->Produced(5, parts[5]));
    EXPECT_FALSE(handoff->Produced(2, parts[3])) << "another output";
    EXPECT_FALSE(handoff->Produced(2, parts[2].clone())) << "a copy's gradient would not reach the split";
    EXPECT_FALSE(handoff->Produced(2, plain[2])) << "another split's output";
    if (chunks.Any()) EXPECT_FALSE(handoff->Produced(0, parts[0])) << "chunked parts are not handed over";

    std::vector<torch::Tensor> w;
    for (int p = 0; p < 6; ++p) w.push_back(torch::randn_like(plain[p]));
    const auto w2 = torch::randn_like(plain[2], torch::kFloat), w3 = torch::randn_like(plain[3], torch::kFloat);
    // Parts 4 and 5 through autograd; 2 and 3 handed over; 0 and 1 unused (zeros).
    handoff->Put(2, w2);
    handoff->Put(3, w3);
    Poison();
    const auto dx = torch::autograd::grad({parts[4], parts[5]}, {kv}, {w[4], w[5]})[0].view(x.sizes());
    EXPECT_FALSE(handoff->Take(2).defined() || handoff->Take(3).defined()) << "the backward took them";
    const auto dx_plain = torch::autograd::grad({plain[4], plain[5]}, {kv}, {w[4], w[5]})[0].view(x.sizes());
    for (const int p : {0, 1, 4, 5}) EXPECT_TRUE(torch::equal(dx.select(2, p), dx_plain.select(2, p))) << "part " << p;
    EXPECT_EQ(dx.select(2, 0).abs().max().item<float>(), 0.f);
    EXPECT_TRUE(torch::equal(dx.select(2, 3), w3.to(c.dtype))) << "a copied part: the float32 gradient rounded once";
    // The rotated part against the inverse rotation of the float32 gradient in float64.
    const auto x64 = x.detach().select(2, 2).to(torch::kDouble).requires_grad_(true);
    const RopeTable table64{table.cos.to(torch::kDouble), table.sin.to(torch::kDouble)};
    const auto ref = torch::autograd::grad({ApplyRope(x64, table64)}, {x64}, {w2.to(torch::kDouble)})[0];
    ExpectClose(dx.select(2, 2), ref, GetParam().dtype == torch::kFloat ? 1e-6 : 5e-3, "handed rotated part");
  }
}

TEST_P(FusedOpsTest, RopeOfAStridedViewMatchesTheReference) {
  const FusedCase c = GetParam();
  const int64_t G = std::max<int64_t>(1, c.H / 4);
  // Non-contiguous rows: parts 1..2 of the key/value pairs of a [B,T,3,2,G,D] tensor.
  const auto kv = torch::randn({c.B, c.T, 3, 2, G, c.D}, Opts()).requires_grad_(true);
  const auto keys = kv.select(3, 0).narrow(2, 1, 2);
  ASSERT_FALSE(keys.is_contiguous());
  CheckRope(keys, Table(c.T), {true, true}, -1);
}

TEST_P(FusedOpsTest, RopeOfRowsNotAlignedForVectorAccessMatchesTheReference) {
  const FusedCase c = GetParam();
  // Rows D + 1 elements apart, starting one element in: the kernels' 8- and 4-pair vector
  // paths cannot take them and the one-pair path must.
  const auto wide = torch::randn({c.B, c.T, c.H, c.D + 1}, Opts()).requires_grad_(true);
  const auto x = wide.narrow(3, 1, c.D).unsqueeze(2);
  CheckRope(x, Table(c.T), {true}, -1);
}

TEST_P(FusedOpsTest, RopeOfRowsAlignedForFourPairsOnlyMatchesTheReference) {
  const FusedCase c = GetParam();
  // Rows D + 4 elements apart, starting four elements in: 4-aligned, not 8-aligned, so the
  // 4-pair path runs.
  const auto wide = torch::randn({c.B, c.T, c.H, c.D + 4}, Opts()).requires_grad_(true);
  const auto x = wide.narrow(3, 4, c.D).unsqueeze(2);
  CheckRope(x, Table(c.T), {true}, -1);
}

// The RoPE kernels once indexed their part pointers at run time, which put the array on every
// thread's stack (64 bytes each) and cost 40% of their bandwidth; no instance may use local
// memory again.
TEST(FusedOpsKernels, RopeKernelsUseNoLocalMemory) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  EXPECT_EQ(cuda::detail::RopeKernelsLocalBytes(), 0);
}

// The embedding's backward (AddRowsAt): rows added into the rows their indices name, against
// index_add_ in float64 (float32 atomics in no fixed order: sums of up to ~400 rows of
// magnitude ~1 agree far below 1e-5 relative; one row missing or doubled is ~3e-2). Covers a row stride wider than the rows (a column
// slice), many rows on one index (the atomics' contention), indices outside [0, V) (add
// nothing; every other row stays as it was) and the shapes AddRowsAtTakes refuses.
TEST(FusedOpsKernels, AddRowsAtAddsEachRowIntoItsIndexsRow) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  torch::manual_seed(41);
  const auto opts = torch::TensorOptions(torch::kFloat).device(torch::kCUDA);
  for (const int64_t D : {4, 24, 768}) {
    const int64_t V = 97, N = 1500;
    auto index = torch::randint(0, V, {N}, opts.dtype(torch::kLong));
    index = torch::where(torch::rand({N}, opts) < 0.25, torch::full({}, 3, opts.dtype(torch::kLong)), index);
    index.narrow(0, 7, 1).fill_(-1);
    index.narrow(0, 11, 1).fill_(V);
    const auto wide = torch::randn({N, D + 8}, opts);
    const auto rows = wide.narrow(1, 4, D);  // a row stride of D + 8, 16-byte aligned
    auto dst = torch::randn({V, D}, opts);
    const auto before = dst.clone();
    ASSERT_TRUE(cuda::detail::AddRowsAtTakes(dst, index, rows)) << "D " << D;
    cuda::detail::AddRowsAt(dst, index, rows);
    const auto valid = (index >= 0) & (index < V);
    const auto ref = before.to(torch::kDouble).index_add(0, index.masked_select(valid),
                                                         rows.to(torch::kDouble).index({valid}));
    EXPECT_LT(((dst.to(torch::kDouble) - ref).norm() / ref.norm()).item<double>(), 1e-5) << "D " << D;
    const auto touched = torch::zeros({V}, opts.dtype(torch::kBool)).index_fill_(0, index.masked_select(valid), true);
    EXPECT_TRUE(torch::equal(dst.index({~touched}), before.index({~touched}))) << "D " << D;
  }
  const auto index = torch::zeros({8}, opts.dtype(torch::kLong));
  auto dst = torch::zeros({5, 8}, opts);
  EXPECT_FALSE(cuda::detail::AddRowsAtTakes(dst, index, torch::zeros({8, 8}, opts).narrow(1, 1, 6).contiguous()))
      << "widths differ";
  auto narrow_dst = torch::zeros({5, 6}, opts);
  EXPECT_FALSE(cuda::detail::AddRowsAtTakes(narrow_dst, index, torch::zeros({8, 6}, opts))) << "D not a multiple of 4";
  EXPECT_FALSE(cuda::detail::AddRowsAtTakes(dst, index, torch::zeros({65}, opts).as_strided({8, 8}, {8, 1}, 1)))
      << "rows 4 bytes off 16-byte alignment";
  EXPECT_FALSE(cuda::detail::AddRowsAtTakes(dst, index.to(torch::kInt), torch::zeros({8, 8}, opts))) << "int32 index";
  EXPECT_FALSE(cuda::detail::AddRowsAtTakes(dst, index, torch::zeros({8, 8}, opts.dtype(torch::kBFloat16))))
      << "bf16 rows";
  EXPECT_THROW(cuda::detail::AddRowsAt(narrow_dst, index, torch::zeros({8, 6}, opts)), c10::Error);
}

// silu over column slices of a wider tensor, as the gate MLP's hidden layer lies in the
// attention's joint projection: an aligned slice (16-byte path), one starting 3 elements in
// (element path), and a transposed view whose rows do not collapse to one stride (copied
// first). Forward and gradient against silu on float32 and on the input dtype.
TEST_P(FusedOpsTest, SiluOfRowSlicesMatchesTheReference) {
  const FusedCase c = GetParam();
  const int64_t F = 3 * c.D, wide = 5 * c.D + 16;
  const auto joint = torch::randn({c.B, c.T, wide}, Opts()).requires_grad_(true);
  for (const int64_t offset : {int64_t{8}, int64_t{3}}) {
    const auto x = joint.narrow(-1, offset, F);
    Poison();
    const auto y = cuda::SiluRows(x);
    ASSERT_TRUE(y.is_contiguous());
    const auto up = torch::randn(y.sizes(), Opts());
    const auto dx = torch::autograd::grad({y}, {joint}, {up})[0].narrow(-1, offset, F);
    const auto x32 = Upcast(x);
    const auto ref = torch::silu(x32);
    const std::string at = "offset " + std::to_string(offset);
    ExpectClose(y, ref, Tolerance(), "silu " + at);
    ExpectClose(y, torch::silu(x.detach()), GetParam().dtype == torch::kFloat ? 1e-6 : 1e-2, "silu same dtype " + at);
    ExpectClose(dx, torch::autograd::grad({ref}, {x32}, {up.to(torch::kFloat)})[0], Tolerance(), "dx " + at);
  }
  const auto t = torch::randn({c.T, c.B, F}, Opts()).transpose(0, 1);
  ExpectClose(cuda::SiluRows(t), torch::silu(t.to(torch::kFloat)), Tolerance(), "transposed");
}

// The gate MLP's head, sigmoid(silu(u + c) W^T + b), from one kernel each way
// (kernels/gate_head.cu), against the same maths on float32 (u upcast, c, W and b the float32
// parameters): gates and the gradients of u, c, W and b. u is a column slice of a wider tensor,
// as the attention's joint projection hands it over; K = 32 and 3 D, N = 3 H and 2 outputs; the
// row counts B T of the cases (1 .. 4122) leave partial CTAs. With a hidden bias c and without
// one (N = 2). u's gradient also goes into a SharedGradient's slice, with the same values. fp32
// is refused (the composed ops run there), and so are K past 480 and a c of the wrong length.
TEST_P(FusedOpsTest, GateHeadMatchesTheReference) {
  const FusedCase c = GetParam();
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
  for (const int64_t K : {int64_t{32}, 3 * c.D}) {
    for (const int64_t N : {3 * c.H, int64_t{2}}) {
      const int64_t wide = K + 5 * c.D + 16, offset = 8;
      const bool with_c = N != 2;
      const auto joint = torch::randn({c.B, c.T, wide}, Opts()).requires_grad_(true);
      const auto u = joint.narrow(-1, offset, K);
      const auto hidden_bias = with_c ? (torch::randn({K}, f32) * 0.5).requires_grad_(true) : torch::Tensor();
      const auto weight = (torch::randn({N, K}, f32) / std::sqrt(static_cast<double>(K))).requires_grad_(true);
      const auto bias = (torch::randn({N}, f32) * 0.5).requires_grad_(true);
      const std::string at = "K" + std::to_string(K) + " N" + std::to_string(N) + (with_c ? " with c" : "");
      if (c.dtype == torch::kFloat) {
        EXPECT_FALSE(cuda::GateHeadTakes(u, hidden_bias, weight, bias)) << at;
        continue;
      }
      ASSERT_TRUE(cuda::GateHeadTakes(u, hidden_bias, weight, bias)) << at;
      EXPECT_FALSE(cuda::GateHeadTakes(u, torch::zeros({K + 1}, f32), weight, bias)) << at << ": c of K + 1";
      Poison();
      const auto gates = cuda::GateHead(u, hidden_bias, weight, bias);
      const auto up = torch::randn(gates.sizes(), Opts());
      Poison();
      std::vector<torch::Tensor> inputs = {joint, weight, bias};
      if (with_c) inputs.push_back(hidden_bias);
      const auto grads = torch::autograd::grad({gates}, inputs, {up});
      const auto du = grads[0].narrow(-1, offset, K);

      const auto u32 = Upcast(u);
      const auto w32 = weight.detach().clone().requires_grad_(true), b32 = bias.detach().clone().requires_grad_(true);
      const auto c32 = with_c ? hidden_bias.detach().clone().requires_grad_(true) : torch::zeros({K}, f32);
      const auto ref = torch::sigmoid(torch::linear(torch::silu(u32 + c32), w32, b32));
      std::vector<torch::Tensor> ref_inputs = {u32, w32, b32};
      if (with_c) ref_inputs.push_back(c32);
      const auto ref_grads = torch::autograd::grad({ref}, ref_inputs, {up.to(torch::kFloat)});
      ExpectClose(gates, ref, Tolerance(), "gates " + at);
      ExpectClose(du, ref_grads[0], Tolerance(), "du " + at);
      for (size_t i = 1; i < grads.size(); ++i) {
        const auto& got = grads[i];
        const std::string what = (i == 1 ? "dW " : i == 2 ? "db " : "dc ") + at;
        ASSERT_EQ(got.scalar_type(), torch::kFloat) << what;
        ASSERT_FALSE(got.isnan().any().item<bool>()) << what;
        const double err = RelErr(got, ref_grads[i]);
        std::printf("    %-22s rel err %.2e\n", what.c_str(), err);
        EXPECT_LT(err, Tolerance()) << what;
      }
      // dc is exactly the column sums of du as the kernel rounded it (float32 sums of 16-bit
      // values: equal up to the order of the additions).
      if (with_c) {
        EXPECT_LT(RelErr(grads[3], du.to(torch::kFloat).sum(std::vector<int64_t>{0, 1})), 1e-5)
            << "dc = column sums of du " << at;
      }

      // u's gradient into its slice of a SharedGradient (and the 16-bit weight given): the
      // same values, in place.
      const auto parts = SharedGradientParts({joint.narrow(-1, 0, offset), u});
      const auto again = cuda::GateHead(u, hidden_bias, weight, bias, weight.detach().to(c.dtype), parts[1]);
      const auto shared = torch::autograd::grad({again}, {u}, {up})[0];
      EXPECT_TRUE(torch::equal(again, gates)) << at;
      EXPECT_TRUE(torch::equal(shared,
                               torch::autograd::grad({cuda::GateHead(u, hidden_bias, weight, bias)}, {u}, {up})[0]))
          << at;
      if (c.B * c.T > 1) EXPECT_EQ(shared.stride(-2), offset + K) << at;
    }
  }
  if (c.dtype != torch::kFloat) {
    const auto wide_u = torch::randn({c.B, c.T, 512}, Opts());
    EXPECT_FALSE(cuda::GateHeadTakes(wide_u, torch::Tensor(), torch::zeros({2, 512}, f32), torch::zeros({2}, f32)))
        << "K 512";
  }
}

// The attention's three readers of its joint input projection [q | kv | gate hidden] write
// their gradients into one SharedGradient (nsa/shared_gradient.h): each lands in its own
// column slice of one buffer, the slices adjacent, with exactly the values the ops return
// without it.
TEST_P(FusedOpsTest, GradientsGoIntoTheirSliceOfASharedGradient) {
  const FusedCase c = GetParam();
  const int64_t G = std::max<int64_t>(1, c.H / 4), F = 3 * c.D;
  const int64_t widths[] = {c.H * c.D, 6 * G * c.D, F};
  const auto joint = torch::randn({c.B, c.T, widths[0] + widths[1] + widths[2]}, Opts()).requires_grad_(true);
  const std::vector<torch::Tensor> slices = {joint.narrow(-1, 0, widths[0]), joint.narrow(-1, widths[0], widths[1]),
                                             joint.narrow(-1, widths[0] + widths[1], widths[2])};
  const auto table = Table(c.T);
  const std::vector<bool> kv_rotate = {false, false, true, false, true, false};
  // The three ops' outputs, with or without the shared gradient's parts.
  const auto run = [&](const std::vector<GradientPart>& parts) {
    auto outs = cuda::ApplyRopeParts(slices[0].view({c.B, c.T, 1, c.H, c.D}), table.cos, table.sin, {true}, parts[0]);
    const auto kv = cuda::ApplyRopeParts(slices[1].view({c.B, c.T, 6, G, c.D}), table.cos, table.sin, kv_rotate,
                                         parts[1]);
    outs.insert(outs.end(), kv.begin(), kv.end());
    outs.push_back(cuda::SiluRows(slices[2], parts[2]));
    return outs;
  };
  std::vector<torch::Tensor> w;
  for (const auto& out : run(std::vector<GradientPart>(3))) w.push_back(torch::randn(out.sizes(), Opts()));
  const auto own = torch::autograd::grad(run(std::vector<GradientPart>(3)), slices, w);
  Poison();
  const auto shared = torch::autograd::grad(run(SharedGradientParts(slices)), slices, w);
  const int64_t row = widths[0] + widths[1] + widths[2];
  for (int i = 0; i < 3; ++i) {
    const std::string what = "part " + std::to_string(i);
    EXPECT_TRUE(torch::equal(shared[i], own[i])) << what;
    EXPECT_TRUE(shared[i].storage().is_alias_of(shared[0].storage())) << what;
    if (c.B * c.T > 1) EXPECT_EQ(shared[i].stride(-2), row) << what;  // (a lone row's stride is arbitrary)
    const int64_t offset = i == 0 ? 0 : (i == 1 ? widths[0] : widths[0] + widths[1]);
    EXPECT_EQ(static_cast<const char*>(shared[i].data_ptr()),
              static_cast<const char*>(shared[0].data_ptr()) + offset * shared[0].element_size())
        << what;
  }
}

// D = the case's head dim takes the vector kernels (16-bit types; D/8 lanes per row), D - 4
// (not 8 times a power of two) the one-element-per-lane kernels.
TEST_P(FusedOpsTest, GateMixingMatchesTheReference) {
  const FusedCase c = GetParam();
  for (const int64_t D : {c.D, c.D - 4}) {
    const auto gates = torch::sigmoid(torch::randn({c.B, c.T, c.H, 3}, Opts())).requires_grad_(true);
    const auto a = torch::randn({c.B, c.T, c.H, D}, Opts()).requires_grad_(true);
    const auto b = torch::randn({c.B, c.T, c.H, D}, Opts()).requires_grad_(true);
    const auto o = torch::randn({c.B, c.T, c.H, D}, Opts()).requires_grad_(true);
    const auto w = torch::randn({c.B, c.T, c.H, D}, Opts());
    Poison();
    const auto out = cuda::MixBranches(gates, a, b, o);
    Poison();
    const auto grads = torch::autograd::grad({out}, {gates, a, b, o}, {w});

    auto g32 = Upcast(gates), a32 = Upcast(a), b32 = Upcast(b), o32 = Upcast(o);
    const auto ref = g32.select(-1, 0).unsqueeze(-1) * a32 + g32.select(-1, 1).unsqueeze(-1) * b32 +
                     g32.select(-1, 2).unsqueeze(-1) * o32;
    const auto ref_grads =
        torch::autograd::grad({ref}, {g32, a32, b32, o32}, {w.to(torch::kFloat)});
    const std::string at = " D=" + std::to_string(D);
    ExpectClose(out, ref, Tolerance(), "mix out" + at);
    ExpectClose(grads[0], ref_grads[0], Tolerance(), "mix dgates" + at);
    ExpectClose(grads[1], ref_grads[1], Tolerance(), "mix d_cmp" + at);
    ExpectClose(grads[2], ref_grads[2], Tolerance(), "mix d_slc" + at);
    ExpectClose(grads[3], ref_grads[3], Tolerance(), "mix d_win" + at);
  }
}

// The gate fold of BranchesMixed's backward (GateFold, fused_launchers.h): a folded branch
// gets no d_k, its delta is the gate's gradient rowsum(dout * k) and its lse becomes
// lse - log2(g) (+inf where g = 0 or the row had no keys); an unfolded branch gets exactly
// what the call without a fold gives it.
TEST_P(FusedOpsTest, GateFoldGivesFoldedLseAndGateGradientDeltas) {
  const FusedCase c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "BranchesMixed folds 16-bit outputs only";
  for (const int64_t D : {c.D, c.D - 4}) {
    auto gates = torch::sigmoid(torch::randn({c.B, c.T, c.H, 3}, Opts()));
    gates.select(3, 0).select(1, 0).fill_(0);  // position 0: the compressed gate is shut
    const auto a = torch::randn({c.B, c.T, c.H, D}, Opts()), b = torch::randn({c.B, c.T, c.H, D}, Opts()),
               o = torch::randn({c.B, c.T, c.H, D}, Opts()), dout = torch::randn({c.B, c.T, c.H, D}, Opts());
    const auto f32 = torch::TensorOptions().dtype(torch::kFloat).device(torch::kCUDA);
    auto lse_a = torch::randn({c.B, c.T, c.H}, f32), lse_o = torch::randn({c.B, c.T, c.H}, f32);
    lse_o.select(1, c.T - 1).fill_(std::numeric_limits<float>::infinity());  // a row with no keys

    torch::Tensor deltas_plain, deltas;
    const auto [dg_plain, da_plain, db_plain, dc_plain] =
        cuda::detail::GateMixBackward(dout, gates, a, b, o, &deltas_plain);
    cuda::detail::GateFold fold;
    fold.lse[0] = lse_a;
    fold.lse[2] = lse_o;
    Poison();
    const auto [dg, da, db, dc] = cuda::detail::GateMixBackward(dout, gates, a, b, o, &deltas, &fold);
    const std::string at = " D=" + std::to_string(D);

    EXPECT_FALSE(da.defined()) << at;
    EXPECT_FALSE(dc.defined()) << at;
    ASSERT_TRUE(db.defined()) << at;
    EXPECT_TRUE(torch::equal(db, db_plain)) << at;
    EXPECT_TRUE(torch::equal(dg, dg_plain)) << at;
    EXPECT_TRUE(torch::equal(deltas[1], deltas_plain[1])) << at;
    EXPECT_FALSE(fold.folded_lse[1].defined()) << at;
    EXPECT_TRUE(torch::equal(fold.dout, dout)) << at;

    // float32 sums of the same 16-bit products: only their order differs.
    const auto d32 = dout.to(torch::kFloat);
    EXPECT_LT(RelErr(deltas[0], (d32 * a.to(torch::kFloat)).sum(-1)), 1e-5) << "folded delta cmp" << at;
    EXPECT_LT(RelErr(deltas[2], (d32 * o.to(torch::kFloat)).sum(-1)), 1e-5) << "folded delta win" << at;
    const auto log2_g = gates.to(torch::kFloat).log2();
    const auto want_a = lse_a - log2_g.select(3, 0), want_o = lse_o - log2_g.select(3, 2);
    EXPECT_TRUE(torch::allclose(fold.folded_lse[0], want_a, 1e-5, 1e-5)) << at;
    EXPECT_TRUE(torch::allclose(fold.folded_lse[2], want_o, 1e-5, 1e-5)) << at;
    const float inf = std::numeric_limits<float>::infinity();
    EXPECT_TRUE((fold.folded_lse[0].select(1, 0) == inf).all().item<bool>()) << "a shut gate" << at;
    EXPECT_TRUE((fold.folded_lse[2].select(1, c.T - 1) == inf).all().item<bool>()) << "a row with no keys" << at;
    EXPECT_FALSE(fold.folded_lse[0].isnan().any().item<bool>()) << at;
    EXPECT_FALSE(fold.folded_lse[2].isnan().any().item<bool>()) << at;
  }
}

// The compressed branch held in cuDNN's packed rows (CmpPackedRows, BranchesMixed's cuDNN path):
// the mix reads it there and writes its gradient there, with exactly the results of the same
// calls on the unpacked rows. The packed d_a is PackCompressedRows of the unpacked one: zero in
// the slots past T (which hold noise in the input: never read). dq's float32 unpack equals the
// unpack's float32 copy. Geometries l = 5, d = 2 (four positions before any block) and 32 / 16.
TEST_P(FusedOpsTest, GateMixingReadsAndWritesPackedCompressedRows) {
  const FusedCase c = GetParam();
  if (c.dtype == torch::kFloat) GTEST_SKIP() << "the packed rows are cuDNN's: bf16/fp16 only";
  for (const auto& [l, d] : {std::pair{5, 2}, std::pair{32, 16}}) {
    const cuda::detail::Geo geo{l, d, 4 * d, 16, 512};
    const int64_t N = cuda::detail::NumCmpBlocks(c.T, geo);
    const std::string at = " l=" + std::to_string(l) + " d=" + std::to_string(d);
    if (N == 0) continue;  // no position sees a block: nothing is packed
    const cuda::detail::CmpPackedRows rows{static_cast<int>(c.T), static_cast<int>(c.H), static_cast<int>(N), l - 1,
                                           d};
    const auto gates = torch::sigmoid(torch::randn({c.B, c.T, c.H, 3}, Opts()));
    const auto a_packed = torch::randn({c.B, N, c.H * d, c.D}, Opts());
    const auto a = cuda::detail::UnpackCompressedRows(a_packed, c.T, geo);
    const auto b = torch::randn({c.B, c.T, c.H, c.D}, Opts()), o = torch::randn({c.B, c.T, c.H, c.D}, Opts()),
               dout = torch::randn({c.B, c.T, c.H, c.D}, Opts());

    const auto out_plain = cuda::detail::GateMixForward(gates, a, b, o);
    Poison();
    const auto out = cuda::detail::GateMixForward(gates, a_packed, b, o, &rows);
    EXPECT_TRUE(torch::equal(out, out_plain)) << "forward" << at;

    torch::Tensor deltas_plain, deltas;
    const auto [dg_plain, da_plain, db_plain, dc_plain] =
        cuda::detail::GateMixBackward(dout, gates, a, b, o, &deltas_plain);
    Poison();
    const auto [dg, da, db, dc] = cuda::detail::GateMixBackward(dout, gates, a_packed, b, o, &deltas, nullptr, &rows);
    EXPECT_TRUE(torch::equal(dg, dg_plain)) << "dgates" << at;
    EXPECT_TRUE(torch::equal(db, db_plain)) << "d_slc" << at;
    EXPECT_TRUE(torch::equal(dc, dc_plain)) << "d_win" << at;
    EXPECT_TRUE(torch::equal(deltas, deltas_plain)) << "deltas" << at;
    ASSERT_EQ(da.sizes(), a_packed.sizes()) << at;
    EXPECT_TRUE(torch::equal(da, cuda::detail::PackCompressedRows(da_plain, geo))) << "packed d_cmp" << at;

    auto dq = torch::empty({c.B, c.T, c.H, c.D}, Opts().dtype(torch::kFloat));
    Poison();
    cuda::detail::UnpackCompressedRowsToFloat(a_packed, dq, geo);
    EXPECT_TRUE(torch::equal(dq, a.to(torch::kFloat))) << "float32 unpack" << at;

    // Rows that do not cover T name the packed branch.
    const cuda::detail::CmpPackedRows short_rows{rows.T, rows.H, rows.N - 1, rows.first, rows.stride};
    try {
      cuda::detail::GateMixForward(gates, a_packed, b, o, &short_rows);
      ADD_FAILURE() << "rows that do not cover T were taken" << at;
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("packed rows"), std::string::npos) << e.what();
    }
  }
}

// The per-layer gate statistics (3 means, 3 population stddevs, mean selected blocks per
// (position, group)) from the one-pass kernel against the same LibTorch ops the reference
// backend runs (nsa/dispatch.cc), on the CPU in float64, for int32 and int64 indices with a share of -1 (no block); constant gates must
// give a standard deviation of exactly 0, not NaN.
TEST_P(FusedOpsTest, GateStatisticsMatchTheReference) {
  const FusedCase c = GetParam();
  const int64_t G = 2, n = 5;
  const auto gates = torch::sigmoid(2 * torch::randn({c.B, c.T, c.H, 3}, Opts()));
  for (const auto index_type : {torch::kInt, torch::kLong}) {
    const auto idx = torch::randint(-1, 9, {c.B, c.T, G, n}, Opts().dtype(index_type));
    const auto got = cuda::GateStats(gates, idx);
    const auto flat64 = gates.cpu().to(torch::kDouble).reshape({-1, 3});
    const auto want = torch::cat({flat64.mean(0), flat64.std(0, /*unbiased=*/false),
                                  (idx.cpu() >= 0).sum(-1).to(torch::kDouble).mean().view({1})});
    ASSERT_EQ(got.scalar_type(), torch::kFloat);
    ASSERT_EQ(got.sizes(), want.sizes());
    const auto diff = (got.cpu().to(torch::kDouble) - want).abs().max().item<double>();
    EXPECT_LT(diff, 1e-5) << "got " << got.cpu() << "\nwant " << want;
  }
  const auto flat = torch::full({c.B, c.T, c.H, 3}, 0.375, Opts());
  const auto none = torch::full({c.B, c.T, G, n}, -1, Opts().dtype(torch::kInt));
  const auto constant = cuda::GateStats(flat, none).cpu();
  const auto expected = torch::tensor({0.375f, 0.375f, 0.375f, 0.f, 0.f, 0.f, 0.f});
  EXPECT_TRUE(torch::equal(constant, expected)) << constant;
}

// Many layers' statistics in one call (GateStatsOfLayers): 17 layers (two launches of up to 16),
// each of its own length (T + l, so every tail past the kernel's 16-byte groups occurs), one
// layer's gates a non-contiguous view, against the reference on each layer.
TEST_P(FusedOpsTest, GateStatisticsOfManyLayersMatchTheReference) {
  const FusedCase c = GetParam();
  const int64_t G = 2, n = 5, L = 17;
  for (const auto index_type : {torch::kInt, torch::kLong}) {
    std::vector<torch::Tensor> gates, idx;
    for (int64_t l = 0; l < L; ++l) {
      auto g = torch::sigmoid(2 * torch::randn({c.B, c.T + l, c.H, 3}, Opts()));
      if (l == 4) g = torch::sigmoid(torch::randn({c.T + l, c.B, c.H, 3}, Opts())).transpose(0, 1);
      gates.push_back(g);
      idx.push_back(torch::randint(-1, 9, {c.B, c.T + l, G, n}, Opts().dtype(index_type)));
    }
    ASSERT_TRUE(cuda::GateStatsOfLayersTake(gates, idx));
    const auto got = cuda::GateStatsOfLayers(gates, idx).cpu().to(torch::kDouble);
    ASSERT_EQ(got.sizes(), (std::vector<int64_t>{L, 7}));
    for (int64_t l = 0; l < L; ++l) {
      const auto flat64 = gates[l].cpu().to(torch::kDouble).reshape({-1, 3});
      const auto want = torch::cat({flat64.mean(0), flat64.std(0, /*unbiased=*/false),
                                    (idx[l].cpu() >= 0).sum(-1).to(torch::kDouble).mean().view({1})});
      const auto diff = (got[l] - want).abs().max().item<double>();
      EXPECT_LT(diff, 1e-5) << "layer " << l << " got " << got[l] << "\nwant " << want;
    }
  }
  // Layers of two gate dtypes cannot share a launch.
  const auto idx = torch::randint(-1, 9, {c.B, c.T, G, n}, Opts().dtype(torch::kInt));
  const auto other = c.dtype == torch::kFloat ? torch::kHalf : torch::kFloat;
  EXPECT_FALSE(cuda::GateStatsOfLayersTake({torch::rand({c.B, c.T, c.H, 3}, Opts()),
                                            torch::rand({c.B, c.T, c.H, 3}, Opts().dtype(other))},
                                           {idx, idx}));
}

// The joint [gate | up] projection through the fused SwiGLU and through float32 LibTorch:
// output and the joint gradient. F = H*D takes the 16-byte path, F = H*D - 3 the one-element
// path.
TEST_P(FusedOpsTest, SwiGluMatchesTheReference) {
  const FusedCase c = GetParam();
  for (const int64_t F : {c.H * c.D, c.H * c.D - 3}) {
    const auto joint = torch::randn({c.B, c.T, 2 * F}, Opts()).requires_grad_(true);
    const auto w = torch::randn({c.B, c.T, F}, Opts());
    Poison();
    const auto out = cuda::SwiGlu(joint);
    Poison();
    const auto grad = torch::autograd::grad({out}, {joint}, {w})[0];
    const auto j32 = Upcast(joint);
    const auto halves = j32.chunk(2, -1);
    const auto ref = torch::silu(halves[0]) * halves[1];
    const auto ref_grad = torch::autograd::grad({ref}, {j32}, {w.to(torch::kFloat)})[0];
    const std::string what = "swiglu F=" + std::to_string(F);
    ExpectClose(out, ref, Tolerance(), what + " out");
    ExpectClose(grad, ref_grad, Tolerance(), what + " d joint");
  }
}

// Residual add + RMSNorm against float32 LibTorch (x + y, rms_norm): both outputs carry
// gradient, so dx/dy sum the residual and the norm paths; then h alone, as the final norm. C = H*D takes a 4-channel path
// (the backward's row-in-registers kernel up to 1024 channels, 256 to 1024 here; the other at
// 2048), C = H*D - 3 the one-channel path.
TEST_P(FusedOpsTest, AddRmsNormMatchesTheReference) {
  const FusedCase c = GetParam();
  const auto f32 = Opts().dtype(torch::kFloat);
  for (const int64_t C : {c.H * c.D, c.H * c.D - 3}) {
    const auto x = torch::randn({c.B, c.T, C}, f32).requires_grad_(true);
    const auto y = torch::randn({c.B, c.T, C}, Opts()).requires_grad_(true);
    const auto w = (torch::rand({C}, f32) + 0.5).requires_grad_(true);
    const auto ws = torch::randn({c.B, c.T, C}, f32), wh = torch::randn({c.B, c.T, C}, Opts());
    ASSERT_TRUE(cuda::AddRmsNormTakes(x, y, w));
    Poison();
    const auto [s_out, h_out] = cuda::AddRmsNorm(x, y, w, 1e-5);
    Poison();
    const auto grads = torch::autograd::grad({s_out, h_out}, {x, y, w}, {ws, wh});

    const auto y32 = Upcast(y);
    const auto x32 = x.detach().requires_grad_(true), w32 = w.detach().requires_grad_(true);
    const auto s_ref = x32 + y32;
    const auto h_ref = torch::rms_norm(s_ref, {C}, w32, 1e-5);
    const auto ref = torch::autograd::grad({s_ref, h_ref}, {x32, y32, w32}, {ws, wh.to(torch::kFloat)});
    const std::string what = "add_rms_norm C=" + std::to_string(C);
    // s and dx are float32 on both sides: the same additions, within float32 rounding.
    EXPECT_EQ(s_out.scalar_type(), torch::kFloat);
    EXPECT_LT(RelErr(s_out, s_ref), 1e-6) << what << " s";
    ExpectClose(h_out, h_ref, Tolerance(), what + " h");
    EXPECT_EQ(grads[0].scalar_type(), torch::kFloat);
    EXPECT_LT(RelErr(grads[0], ref[0]), 1e-4) << what << " dx";
    ExpectClose(grads[1], ref[1], Tolerance(), what + " dy");
    EXPECT_LT(RelErr(grads[2], ref[2]), 1e-4) << what << " dweight";
    std::printf("    %s dx %.2e dweight %.2e\n", what.c_str(), RelErr(grads[0], ref[0]),
                RelErr(grads[2], ref[2]));

    // Only h carries gradient (the final norm): s's gradient is never materialised.
    const auto [s_only, h_only] = cuda::AddRmsNorm(x, y, w, 1e-5);
    Poison();
    const auto h_grads = torch::autograd::grad({h_only}, {x, y, w}, {wh});
    const auto h_ref_grads =
        torch::autograd::grad({torch::rms_norm(x32 + y32, {C}, w32, 1e-5)}, {x32, y32, w32}, {wh.to(torch::kFloat)});
    EXPECT_LT(RelErr(h_grads[0], h_ref_grads[0]), 1e-4) << what << " dx, h only";
    ExpectClose(h_grads[1], h_ref_grads[1], Tolerance(), what + " dy, h only");
    EXPECT_LT(RelErr(h_grads[2], h_ref_grads[2]), 1e-4) << what << " dweight, h only";
  }
}

// The norm before the first block against float32 LibTorch: x passes through unchanged (no
// copy) and x's gradient sums the residual's and the norm's; then h alone and x alone carry
// gradient. C as in AddRmsNormMatchesTheReference.
TEST_P(FusedOpsTest, RmsNormOfResidualMatchesTheReference) {
  const FusedCase c = GetParam();
  const auto f32 = Opts().dtype(torch::kFloat);
  for (const int64_t C : {c.H * c.D, c.H * c.D - 3}) {
    const auto x = torch::randn({c.B, c.T, C}, f32).requires_grad_(true);
    const auto w = (torch::rand({C}, f32) + 0.5).requires_grad_(true);
    const auto ws = torch::randn({c.B, c.T, C}, f32), wh = torch::randn({c.B, c.T, C}, Opts());
    Poison();
    const auto [s_out, h_out] = cuda::RmsNormOfResidual(x, w, 1e-5, c.dtype);
    EXPECT_EQ(s_out.data_ptr(), x.data_ptr()) << "the residual is x itself";
    Poison();
    const auto grads = torch::autograd::grad({s_out, h_out}, {x, w}, {ws, wh});

    const auto x32 = x.detach().requires_grad_(true), w32 = w.detach().requires_grad_(true);
    const auto h_ref = torch::rms_norm(x32, {C}, w32, 1e-5);
    const auto ref = torch::autograd::grad({x32, h_ref}, {x32, w32}, {ws, wh.to(torch::kFloat)});
    const std::string what = "rms_norm_of_residual C=" + std::to_string(C);
    ExpectClose(h_out, h_ref, Tolerance(), what + " h");
    EXPECT_EQ(grads[0].scalar_type(), torch::kFloat);
    EXPECT_LT(RelErr(grads[0], ref[0]), 1e-4) << what << " dx";
    EXPECT_LT(RelErr(grads[1], ref[1]), 1e-4) << what << " dweight";

    const auto [s_h, h_only] = cuda::RmsNormOfResidual(x, w, 1e-5, c.dtype);
    Poison();
    const auto h_grads = torch::autograd::grad({h_only}, {x, w}, {wh});
    const auto h_ref_grads =
        torch::autograd::grad({torch::rms_norm(x32, {C}, w32, 1e-5)}, {x32, w32}, {wh.to(torch::kFloat)});
    EXPECT_LT(RelErr(h_grads[0], h_ref_grads[0]), 1e-4) << what << " dx, h only";
    EXPECT_LT(RelErr(h_grads[1], h_ref_grads[1]), 1e-4) << what << " dweight, h only";

    const auto [s_only, h_s] = cuda::RmsNormOfResidual(x, w, 1e-5, c.dtype);
    EXPECT_TRUE(torch::equal(torch::autograd::grad({s_only}, {x}, {ws})[0], ws)) << what << " dx, x only";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, FusedOpsTest,
                         testing::Values(FusedCase{1, 1, 4, 64, torch::kBFloat16},
                                         FusedCase{2, 33, 12, 64, torch::kBFloat16},
                                         FusedCase{3, 257, 16, 128, torch::kBFloat16},
                                         FusedCase{2, 2061, 12, 64, torch::kBFloat16},
                                         FusedCase{2, 100, 8, 128, torch::kHalf},
                                         FusedCase{2, 1001, 12, 64, torch::kHalf},
                                         FusedCase{2, 257, 4, 64, torch::kFloat},
                                         FusedCase{1, 1000, 16, 128, torch::kFloat}),
                         FusedName);

}  // namespace
}  // namespace nsad::nsa
