// TunedMm / TunedMmAdd (kernels/tuned_gemm.h) against float32 products of the same 16-bit
// operands, in the layouts the linear layers hand it: the forward x @ W^T (W^T a transposed
// view), dX = dY @ W (W a row slice of the joint weight), dW = dY^T @ x with a float32 result
// (dY^T a transposed view, dY a column slice of a wider gradient), and dX += dY @ W.
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernel_choice.h"
#include "tuned_gemm.h"

namespace nsad::nsa::cuda {
namespace {

// Largest |got - want| relative to want's largest magnitude.
double RelErr(const torch::Tensor& got, const torch::Tensor& want) {
  const auto w = want.to(torch::kDouble);
  return (got.to(torch::kDouble) - w).abs().max().item<double>() / w.abs().max().item<double>();
}

class TunedGemmTest : public ::testing::TestWithParam<torch::ScalarType> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  }
  torch::Tensor Rand(std::vector<int64_t> sizes) const {
    return torch::randn(sizes, torch::dtype(GetParam()).device(torch::kCUDA));
  }
  // The output type's rounding (8 bits of mantissa for bf16, 11 for fp16) and float32's.
  double Tolerance(torch::ScalarType out) const {
    if (out == torch::kFloat) return 1e-5;
    return GetParam() == torch::kBFloat16 ? 8e-3 : 1e-3;
  }
  void ExpectProduct(const torch::Tensor& a, const torch::Tensor& b, torch::ScalarType out_dtype) const {
    ASSERT_TRUE(TunedMmTakes(a, b, out_dtype)) << a.sizes() << a.strides() << " @ " << b.sizes() << b.strides();
    const auto got = TunedMm(a, b, out_dtype);
    ASSERT_EQ(got.scalar_type(), out_dtype);
    ASSERT_TRUE(got.is_contiguous());
    const auto want = a.to(torch::kFloat).mm(b.to(torch::kFloat));
    EXPECT_LT(RelErr(got, want), Tolerance(out_dtype)) << a.sizes() << " @ " << b.sizes();
    // The shape's algorithm, once chosen, gives the same bits again.
    EXPECT_TRUE(torch::equal(TunedMm(a, b, out_dtype), got));
  }
};

TEST_P(TunedGemmTest, MatchesFloatProductsInEachLinearLayout) {
  torch::manual_seed(5);
  const int64_t M = 300, K = 96, parts[] = {40, 24, 72};
  const int64_t N = parts[0] + parts[1] + parts[2];
  const auto x = Rand({M, K}), joint = Rand({N, K}), dy = Rand({M, N});
  ExpectProduct(x, joint.t(), GetParam());                          // forward
  ExpectProduct(dy, joint, GetParam());                             // dX of the joint output
  ExpectProduct(dy.t(), x, torch::kFloat);                          // dW of the joint output
  const auto w1 = joint.narrow(0, parts[0], parts[1]);              // a row slice: 16-byte aligned
  const auto g1 = dy.narrow(1, parts[0], parts[1]);                 // a column slice, row stride N
  ExpectProduct(g1, w1, GetParam());                                // dX of one part
  ExpectProduct(g1.t(), x, torch::kFloat);                          // dW of one part
  ExpectProduct(g1.t(), x, GetParam());                             // ... in the operands' type

  auto dx = Rand({M, K});
  const auto want = dx.to(torch::kFloat) + g1.to(torch::kFloat).mm(w1.to(torch::kFloat));
  TunedMmAdd(dx, g1, w1);
  EXPECT_LT(RelErr(dx, want), Tolerance(GetParam()));
}

// A shape first met inside a CUDA graph capture runs the heuristic's first pick (nothing can be
// timed there) and is timed by its next call outside one.
TEST_P(TunedGemmTest, FirstCallInsideACaptureRunsUntimed) {
  torch::manual_seed(6);
  const int64_t M = 136, K = 56, N = 88;  // a shape no other test uses
  const auto a = Rand({M, K}), b = Rand({K, N});
  const auto want = a.to(torch::kFloat).mm(b.to(torch::kFloat));
  const int64_t shapes = detail::TunedGemmShapes();
  at::cuda::CUDAGraph graph;
  torch::Tensor captured;
  {
    const auto stream = c10::cuda::getStreamFromPool();
    const c10::cuda::CUDAStreamGuard guard(stream);
    graph.capture_begin();
    captured = TunedMm(a, b, GetParam());
    graph.capture_end();
  }
  EXPECT_EQ(detail::TunedGemmShapes(), shapes);
  graph.replay();
  torch::cuda::synchronize();
  EXPECT_LT(RelErr(captured, want), Tolerance(GetParam()));
  const auto eager = TunedMm(a, b, GetParam());
  EXPECT_EQ(detail::TunedGemmShapes(), shapes + 1);
  EXPECT_LT(RelErr(eager, want), Tolerance(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(Types, TunedGemmTest, ::testing::Values(torch::kBFloat16, torch::kHalf),
                         [](const auto& info) { return info.param == torch::kBFloat16 ? "Bf16" : "Fp16"; });

TEST(TunedGemm, RefusesWhatItCannotTake) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto bf16 = torch::dtype(torch::kBFloat16).device(torch::kCUDA);
  const auto a = torch::randn({32, 64}, bf16), b = torch::randn({64, 48}, bf16);
  EXPECT_TRUE(TunedMmTakes(a, b, torch::kBFloat16));
  EXPECT_TRUE(TunedMmTakes(a, b, torch::kFloat));
  EXPECT_FALSE(TunedMmTakes(a.to(torch::kFloat), b.to(torch::kFloat), torch::kFloat));  // float32 operands
  EXPECT_FALSE(TunedMmTakes(a, b.to(torch::kHalf), torch::kBFloat16));                 // mixed types
  EXPECT_FALSE(TunedMmTakes(a, b, torch::kHalf));                                      // another 16-bit result
  EXPECT_FALSE(TunedMmTakes(a.cpu(), b.cpu(), torch::kBFloat16));
  EXPECT_FALSE(TunedMmTakes(a, b.narrow(0, 0, 32), torch::kBFloat16));                  // K disagrees
  EXPECT_FALSE(TunedMmTakes(a, b.narrow(1, 0, 44), torch::kBFloat16));                  // N not a multiple of 8
  EXPECT_FALSE(TunedMmTakes(a.narrow(1, 1, 48), b.narrow(0, 0, 48), torch::kBFloat16));  // 2-byte aligned
  const auto odd_rows = torch::randn({32, 66}, bf16).narrow(1, 0, 64);                   // leading dimension 66
  EXPECT_FALSE(TunedMmTakes(odd_rows, b, torch::kBFloat16));
  EXPECT_THROW(TunedMm(a.to(torch::kFloat), b.to(torch::kFloat), torch::kFloat), c10::Error);
  auto wrong_out = torch::zeros({32, 48}, torch::dtype(torch::kFloat).device(torch::kCUDA));
  EXPECT_THROW(TunedMmAdd(wrong_out, a, b), c10::Error);
}

}  // namespace
}  // namespace nsad::nsa::cuda
