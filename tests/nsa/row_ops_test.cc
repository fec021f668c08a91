// SumRows, CopyInWords and EmbeddingRows (model/row_ops.h) against the plain ops, on the CPU and, where
// there is one, on a CUDA device (their fast paths are CUDA's).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/autocast_mode.h>

#include <vector>

#include "model/row_ops.h"
#include "model/shared_input_linear.h"
#include "test_util.h"

namespace nsad {
namespace {

using nsa::testing::MaxDiff;

std::vector<torch::Device> Devices() {
  std::vector<torch::Device> devices = {torch::kCPU};
  if (torch::cuda::is_available()) devices.emplace_back(torch::kCUDA);
  return devices;
}

TEST(SumRows, MatchesSumOverRows) {
  torch::manual_seed(21);
  for (const auto& device : Devices()) {
    for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
      const auto g = torch::randn({300, 7}, torch::TensorOptions(dtype).device(device));
      const auto s = SumRows(g);
      EXPECT_EQ(s.sizes(), (std::vector<int64_t>{7}));
      EXPECT_EQ(s.scalar_type(), dtype);
      // bf16: the sums of 300 values of magnitude ~1 are rounded to 8 bits of mantissa.
      const double tol = dtype == torch::kFloat ? 1e-4 : 0.25;
      EXPECT_LT(MaxDiff(s.to(torch::kDouble).cpu(), g.to(torch::kDouble).sum(0).cpu()), tol) << device;
    }
  }
  EXPECT_THROW(SumRows(torch::ones({4})), c10::Error);
  EXPECT_THROW(SumRows(torch::ones({2, 3, 4})), c10::Error);
}

// Word copies of permuted rows (the compression's chunks: bf16 rows of 64 and 4), and the
// element-wise fallback for rows whose bytes are not a multiple of 8 and for a dtype change.
TEST(CopyInWords, CopiesPermutedRowsExactly) {
  torch::manual_seed(22);
  for (const auto& device : Devices()) {
    for (const int64_t D : {64, 4, 3}) {
      const auto src = torch::randn({2, 5, 3, 4, D}, torch::TensorOptions(torch::kBFloat16).device(device));
      const auto view = src.permute({0, 1, 3, 2, 4});
      auto dst = torch::empty(view.sizes(), src.options());
      CopyInWords(dst, view);
      EXPECT_TRUE(torch::equal(dst, view.contiguous())) << "D=" << D << " " << device;
      // Into a permuted destination (the backward's direction).
      auto back = torch::empty_like(src);
      CopyInWords(back.permute({0, 1, 3, 2, 4}), dst);
      EXPECT_TRUE(torch::equal(back, src)) << "D=" << D << " " << device;
    }
    const auto wide = torch::randn({3, 8}, torch::TensorOptions(torch::kFloat).device(device));
    auto narrow = torch::empty({3, 8}, wide.options().dtype(torch::kBFloat16));
    CopyInWords(narrow, wide);
    EXPECT_TRUE(torch::equal(narrow, wide.to(torch::kBFloat16)));
  }
  EXPECT_THROW(CopyInWords(torch::empty({2, 3}), torch::empty({3, 2})), c10::Error);
}

// The rows and their gradient against at::embedding's, repeated tokens included (token 3 is
// a quarter of them, so its row sums many gradient rows), on [B, T] and flat token tensors,
// rows of 24 (on CUDA our float4 kernel) and 22 (index_add_). The CUDA backward adds in no
// fixed order: float32 sums of up to ~150 rows of magnitude ~1 agree to well under 1e-4.
TEST(EmbeddingRows, MatchesEmbeddingAndItsGradient) {
  torch::manual_seed(23);
  for (const auto& device : Devices()) {
    const auto opts = torch::TensorOptions(torch::kFloat).device(device);
    for (const auto& shape : {std::vector<int64_t>{4, 150}, std::vector<int64_t>{600}, std::vector<int64_t>{300}}) {
      auto tokens = torch::randint(0, 97, shape, opts.dtype(torch::kLong));
      tokens = torch::where(torch::rand(shape, opts) < 0.25, torch::full({}, 3, opts.dtype(torch::kLong)), tokens);
      const int64_t width = shape.size() == 1 && shape[0] == 300 ? 22 : 24;
      const auto weight = torch::randn({97, width}, opts).requires_grad_(true);
      const auto ref_weight = weight.detach().clone().requires_grad_(true);
      const auto rows = EmbeddingRows(weight, tokens);
      const auto ref = at::embedding(ref_weight, tokens);
      EXPECT_TRUE(torch::equal(rows, ref)) << device;
      const auto up = torch::randn(ref.sizes(), opts);
      const auto grad = torch::autograd::grad({rows}, {weight}, {up})[0];
      const auto ref_grad = torch::autograd::grad({ref}, {ref_weight}, {up})[0];
      EXPECT_EQ(grad.sizes(), weight.sizes());
      EXPECT_LT(MaxDiff(grad.cpu(), ref_grad.cpu()), 1e-4) << device;
      // Rows no token names get exactly zero.
      const auto unused = (torch::bincount(tokens.reshape({-1}).cpu(), {}, 97) == 0).nonzero().reshape({-1});
      if (unused.numel() > 0) EXPECT_EQ(grad.cpu().index_select(0, unused).abs().max().item<float>(), 0.f);
    }
  }
  EXPECT_THROW(EmbeddingRows(torch::ones({4}), torch::zeros({2}, torch::kLong)), c10::Error);
}

// A weight read by the embedding and by the tied LM head (bf16 autocast, as the model runs):
// with a TiedGradient the head leaves its gradient to the embedding's backward, which adds its
// rows to it; the weight gets the same gradient as from two separate ones (up to the order of
// the float32 additions), and nothing stays pending.
TEST(EmbeddingRows, TiedWithTheHeadGivesTheSummedGradient) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "the tied gradient is the CUDA path's";
  torch::manual_seed(24);
  const auto opts = torch::TensorOptions(torch::kFloat).device(torch::kCUDA);
  const auto weight = (torch::randn({50, 16}, opts) * 0.5).requires_grad_(true);
  const auto tokens = torch::randint(0, 50, {3, 40}, opts.dtype(torch::kLong));
  const auto up = torch::randn({3, 40, 50}, opts);
  const auto gradient = [&](bool tie) {
    weight.mutable_grad().reset();
    const auto tied = tie ? c10::make_intrusive<TiedGradient>() : c10::intrusive_ptr<TiedGradient>();
    at::autocast::set_autocast_enabled(at::kCUDA, true);
    at::autocast::set_autocast_dtype(at::kCUDA, at::kBFloat16);
    const auto x = EmbeddingRows(weight, tokens, tied);
    const auto logits = ApplyWeight(torch::tanh(x), weight, tied);
    at::autocast::set_autocast_enabled(at::kCUDA, false);
    at::autocast::clear_cache();
    EXPECT_EQ(logits.scalar_type(), torch::kBFloat16);
    (logits.to(torch::kFloat) * up).sum().backward();
    if (tied) EXPECT_FALSE(tied->pending.defined()) << "the embedding took the head's gradient";
    return weight.grad().clone();
  };
  const auto separate = gradient(false);
  const auto tied = gradient(true);
  EXPECT_GT(separate.abs().max().item<double>(), 0.1);
  EXPECT_LT(MaxDiff(tied.cpu(), separate.cpu()), 1e-4);
}

}  // namespace
}  // namespace nsad
