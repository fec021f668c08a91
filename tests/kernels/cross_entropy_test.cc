// The fused cross-entropy kernels (kernels/cross_entropy.cu) against LibTorch's
// cross_entropy on the same logits upcast to float32 -- the trainer's loss before, and the
// reference backend's loss now. Loss and gradient, vector and scalar row paths (V a multiple
// of 8 or not), the one-pass path (the gradient written in the forward) and the two-kernel
// one, ignored targets, an incoming gradient other than the declared one, targets outside
// the vocabulary. Skips without a CUDA device.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <string>

#include "fused_ops.h"
#include "nsa_cuda.h"
#include "test_names.h"

namespace nsad::nsa {
namespace {

struct LossCase {
  int64_t N, V;
  torch::ScalarType dtype;
};

std::string LossName(const testing::TestParamInfo<LossCase>& info) {
  const LossCase& c = info.param;
  return "N" + std::to_string(c.N) + "_V" + std::to_string(c.V) +
         DtypeSuffix(c.dtype);
}

class CrossEntropyTest : public testing::TestWithParam<LossCase> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    ASSERT_TRUE(cuda::Available()) << "CUDA device present but the NSA kernels cannot run on it";
    torch::manual_seed(7 + GetParam().N + GetParam().V);
  }
  torch::TensorOptions Opts() const {
    return torch::TensorOptions().dtype(GetParam().dtype).device(torch::kCUDA);
  }
  // Logits with the spread of a trained head (a few large ones per row).
  torch::Tensor Logits() const {
    const auto& c = GetParam();
    return (torch::randn({c.N, c.V}, Opts().dtype(torch::kFloat)) * 3).to(c.dtype).requires_grad_(true);
  }
  torch::Tensor Targets() const {
    const auto& c = GetParam();
    return torch::randint(c.V, {c.N}, torch::TensorOptions().dtype(torch::kLong).device(torch::kCUDA));
  }
  // Loss and d logits from both implementations with the loss scaled by `scale`, compared:
  // the loss in float32 maths on both sides (relative 1e-5), the gradient against
  // LibTorch's float32 gradient rounded to the logits' dtype.
  // expected_grad: what the caller declares it will back-propagate (the one-pass path writes
  // the gradient for it in the forward and rescales it when `scale` differs).
  void Compare(const torch::Tensor& logits, const torch::Tensor& targets, double scale, double expected_grad = 1.0) {
    const auto loss = cuda::CrossEntropy(logits, targets, -100, expected_grad);
    ASSERT_EQ(loss.scalar_type(), torch::kFloat);
    const auto grad = torch::autograd::grad({loss * scale}, {logits})[0];

    const auto x32 = logits.detach().to(torch::kFloat).requires_grad_(true);
    const auto ref = torch::nn::functional::cross_entropy(x32, targets);
    const auto ref_grad = torch::autograd::grad({ref * scale}, {x32})[0];

    const double got = loss.item<double>(), want = ref.item<double>();
    EXPECT_NEAR(got, want, 1e-5 * std::abs(want)) << "loss";
    ASSERT_EQ(grad.scalar_type(), GetParam().dtype);
    ASSERT_FALSE(grad.isnan().any().item<bool>());
    const auto want_grad = ref_grad.to(GetParam().dtype).to(torch::kDouble);
    const double err = (grad.to(torch::kDouble) - want_grad).norm().item<double>() /
                       want_grad.norm().item<double>();
    // One float32 value rounded once on each side; exp2f vs expf may flip a last bit.
    const double tol = GetParam().dtype == torch::kFloat ? 1e-5 : 1e-2;
    std::printf("    loss %.6f vs %.6f, grad rel err %.2e\n", got, want, err);
    EXPECT_LT(err, tol) << "gradient";
  }
};

TEST_P(CrossEntropyTest, MatchesLibTorchInLossAndGradient) {
  Compare(Logits(), Targets(), 1.0);
}

TEST_P(CrossEntropyTest, ScalesTheGradientByTheIncomingOne) {
  Compare(Logits(), Targets(), 0.25);  // the trainer divides by grad_accum
}

// The trainer's case: the loss divided by grad_accum, declared as the incoming gradient.
TEST_P(CrossEntropyTest, TheDeclaredIncomingGradientIsWrittenInTheForward) {
  Compare(Logits(), Targets(), 0.25, 0.25);
}

// Rows that fit the one-pass kernel (16-byte multiples up to 112 KiB: m7c's 50304 bf16 logits)
// take it when the logits need a gradient; its backward rescales the saved gradient in place,
// so a second backward (retain_graph) fails instead of scaling twice. The two-kernel path
// recomputes, so there a second backward gives the first's gradient again.
TEST_P(CrossEntropyTest, OnePathPerRowSizeAndASecondBackwardOnlyWhereItIsSafe) {
  const auto& c = GetParam();
  const int64_t row_bytes = c.V * static_cast<int64_t>(c10::elementSize(c.dtype));
  const bool one_pass = row_bytes % 16 == 0 && row_bytes <= 112 * 1024;
  const auto logits = Logits();
  const auto loss = cuda::CrossEntropy(logits, Targets());
  const auto first = torch::autograd::grad({loss * 0.5}, {logits}, {}, /*retain_graph=*/true)[0].clone();
  if (one_pass) {
    EXPECT_THROW(torch::autograd::grad({loss * 0.5}, {logits}), c10::Error);
  } else {
    const auto second = torch::autograd::grad({loss * 0.5}, {logits})[0];
    EXPECT_TRUE(torch::equal(first, second));
  }
}

TEST_P(CrossEntropyTest, IgnoredTargetsCountNeitherInTheMeanNorInTheGradient) {
  auto targets = Targets();
  // Every third row from the second on (none for N = 1: LibTorch's mean of nothing is NaN).
  targets.index_put_({torch::arange(1, GetParam().N, 3, targets.options())}, -100);
  Compare(Logits(), targets, 1.0);
  Compare(Logits(), targets, 0.5, 0.5);
}

TEST_P(CrossEntropyTest, ATargetOutsideTheVocabularyGivesANaNLossNotACrash) {
  auto targets = Targets();
  targets.index_put_({GetParam().N / 2}, GetParam().V);  // one past the last class
  const auto loss = cuda::CrossEntropy(Logits(), targets);
  EXPECT_TRUE(std::isnan(loss.item<double>()));
  targets.index_put_({GetParam().N / 2}, -7);
  EXPECT_TRUE(std::isnan(cuda::CrossEntropy(Logits(), targets).item<double>()));
}

TEST_P(CrossEntropyTest, LargeLogitsStayFinite) {
  const auto& c = GetParam();
  if (c.dtype == torch::kHalf) GTEST_SKIP() << "2000 is near fp16's range; covered by bf16/fp32";
  // Values far outside exp's range in float32: only a max-subtracted softmax survives them.
  const auto logits =
      (torch::randn({c.N, c.V}, Opts().dtype(torch::kFloat)) * 3 + 2000).to(c.dtype).requires_grad_(true);
  Compare(logits, Targets(), 1.0);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CrossEntropyTest,
                         testing::Values(LossCase{1, 8, torch::kBFloat16},
                                         LossCase{64, 50304, torch::kBFloat16},  // m7c's vocabulary
                                         LossCase{5, 57344, torch::kBFloat16},   // the largest one-pass row
                                         LossCase{9, 57352, torch::kBFloat16},   // and the next 16 bytes
                                         LossCase{33, 1003, torch::kBFloat16},   // rows not 16-byte aligned
                                         LossCase{130, 4096, torch::kHalf},
                                         LossCase{7, 50257, torch::kHalf},
                                         LossCase{40, 777, torch::kFloat},
                                         LossCase{16, 32000, torch::kFloat}),
                         LossName);

}  // namespace
}  // namespace nsad::nsa
