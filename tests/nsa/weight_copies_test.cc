// The model's 16-bit weight copies (model/weight_copies.h): a GEMM's operand is a view of
// the copies only where its weights are one group's consecutive members in order, the
// copies follow the weights through in-place updates and new storage (a refresh copies only
// the weights whose version moved), and a refresh bumps the version of any copy handed out
// before it (so autograd refuses a stale saved operand instead of using it).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

#include "model/weight_copies.h"

namespace nsad {
namespace {

torch::Tensor Weight(int64_t rows, int64_t cols) { return torch::randn({rows, cols}).requires_grad_(true); }

TEST(WeightCopies, AJointIsTheCastOfAGroupsConsecutiveWeightsInOrder) {
  torch::manual_seed(1);
  const auto a = Weight(3, 4), b = Weight(5, 4), c = Weight(2, 4), other = Weight(6, 8), outside = Weight(3, 4);
  WeightCopies copies;
  copies.Refresh({{a, b, c}, {other}}, torch::kBFloat16);
  const int64_t served = WeightCopies::JointsServed();

  const auto ab = copies.Joint({a, b}, torch::kBFloat16);
  ASSERT_TRUE(ab.defined());
  EXPECT_EQ(ab.sizes(), (std::vector<int64_t>{8, 4}));
  EXPECT_TRUE(torch::equal(ab, torch::cat({a, b}).detach().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(copies.Joint({a, b, c}, torch::kBFloat16),
                           torch::cat({a, b, c}).detach().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(copies.Joint({c}, torch::kBFloat16), c.detach().to(torch::kBFloat16)));
  EXPECT_TRUE(torch::equal(copies.Joint({other}, torch::kBFloat16), other.detach().to(torch::kBFloat16)));
  EXPECT_EQ(WeightCopies::JointsServed() - served, 4);

  EXPECT_FALSE(copies.Joint({b, a}, torch::kBFloat16).defined()) << "out of order";
  EXPECT_FALSE(copies.Joint({a, c}, torch::kBFloat16).defined()) << "not consecutive";
  EXPECT_FALSE(copies.Joint({c, other}, torch::kBFloat16).defined()) << "two groups";
  EXPECT_FALSE(copies.Joint({outside}, torch::kBFloat16).defined()) << "never copied";
  EXPECT_FALSE(copies.Joint({a}, torch::kHalf).defined()) << "another dtype";
  EXPECT_EQ(WeightCopies::JointsServed() - served, 4) << "a refused joint is not counted";
}

TEST(WeightCopies, RefreshFollowsTheWeightsAndBumpsOldCopiesVersion) {
  torch::manual_seed(2);
  const auto a = Weight(3, 4), b = Weight(5, 4);
  WeightCopies copies;
  copies.Refresh({{a, b}}, torch::kBFloat16);
  const auto handed_out = copies.Joint({a, b}, torch::kBFloat16);
  const auto version = handed_out._version();

  {
    torch::NoGradGuard no_grad;
    a.add_(1.0);  // the optimizer's in-place update
  }
  copies.Refresh({{a, b}}, torch::kBFloat16);
  EXPECT_GT(handed_out._version(), version) << "a saved stale copy must fail autograd's version check";
  EXPECT_TRUE(torch::equal(copies.Joint({a, b}, torch::kBFloat16), torch::cat({a, b}).detach().to(torch::kBFloat16)));

  // New storage behind the same parameter (what Module::to does): no joint until refreshed.
  a.set_data(torch::randn({3, 4}));
  EXPECT_FALSE(copies.Joint({a, b}, torch::kBFloat16).defined());
  copies.Refresh({{a, b}}, torch::kBFloat16);
  EXPECT_TRUE(torch::equal(copies.Joint({a, b}, torch::kBFloat16), torch::cat({a, b}).detach().to(torch::kBFloat16)));

  // Another dtype re-lays the copies out in that dtype.
  copies.Refresh({{a, b}}, torch::kHalf);
  EXPECT_FALSE(copies.Joint({a, b}, torch::kBFloat16).defined());
  EXPECT_TRUE(torch::equal(copies.Joint({a, b}, torch::kHalf), torch::cat({a, b}).detach().to(torch::kHalf)));
}

// A refresh copies only the weights whose copy is not current: none right after one, a weight
// written in place since (its version moved), and none that a writer noted as written together
// with its copy (NoteWrittenWith, as the optimizer's CUDA kernel does). CopyOf hands out a
// weight's own copy and nothing for a weight without one.
TEST(WeightCopies, ARefreshCopiesOnlyWhatIsNotCurrent) {
  torch::manual_seed(3);
  const auto a = Weight(3, 4), b = Weight(5, 4), c = Weight(2, 8), outside = Weight(3, 4);
  const std::vector<std::vector<torch::Tensor>> groups = {{a, b}, {c}};
  WeightCopies copies;
  copies.Refresh(groups, torch::kBFloat16);
  EXPECT_EQ(copies.weights_copied(), 3);
  copies.Refresh(groups, torch::kBFloat16);
  EXPECT_EQ(copies.weights_copied(), 3) << "every copy was current";

  torch::NoGradGuard no_grad;
  b.mul_(2.0);
  copies.Refresh(groups, torch::kBFloat16);
  EXPECT_EQ(copies.weights_copied(), 4) << "only b moved";
  EXPECT_TRUE(torch::equal(copies.CopyOf(b), b.detach().to(torch::kBFloat16)));

  // A writer that updates a weight and its copy together, then says so.
  c.add_(1.0);
  copies.CopyOf(c).copy_(c.detach());
  copies.NoteWrittenWith({c, outside});
  copies.Refresh(groups, torch::kBFloat16);
  EXPECT_EQ(copies.weights_copied(), 4) << "c's copy was noted as written with it";
  EXPECT_TRUE(torch::equal(copies.CopyOf(c), c.detach().to(torch::kBFloat16)));

  // Written without a note: RefreshStale copies it as Refresh would.
  a.sub_(1.0);
  copies.RefreshStale();
  EXPECT_EQ(copies.weights_copied(), 5);
  EXPECT_TRUE(torch::equal(copies.CopyOf(a), a.detach().to(torch::kBFloat16)));
  EXPECT_EQ(copies.CopyOf(a).data_ptr(), copies.Joint({a}, torch::kBFloat16).data_ptr());
  EXPECT_FALSE(copies.CopyOf(outside).defined());
}

TEST(WeightCopies, RefusesAWeightInTwoGroupsAndAnythingButMatrices) {
  const auto a = Weight(3, 4), b = Weight(5, 4);
  WeightCopies copies;
  EXPECT_THROW(copies.Refresh({{a, b}, {a}}, torch::kBFloat16), c10::Error);
  EXPECT_THROW(copies.Refresh({{torch::randn({4})}}, torch::kBFloat16), c10::Error);
}

TEST(WeightCopies, TheInnermostScopeIsCurrentOnItsThreadOnly) {
  WeightCopies outer, inner;
  EXPECT_EQ(UseWeightCopies::Current(), nullptr);
  {
    UseWeightCopies use_outer(&outer);
    EXPECT_EQ(UseWeightCopies::Current(), &outer);
    {
      UseWeightCopies use_inner(&inner);
      EXPECT_EQ(UseWeightCopies::Current(), &inner);
    }
    EXPECT_EQ(UseWeightCopies::Current(), &outer);
    const WeightCopies* seen = &outer;
    std::thread([&] { seen = UseWeightCopies::Current(); }).join();
    EXPECT_EQ(seen, nullptr) << "autograd's backward threads must not see the forward's scope";
  }
  EXPECT_EQ(UseWeightCopies::Current(), nullptr);
}

}  // namespace
}  // namespace nsad
