// The non-finite policy through the public Trainer API, driven by the test-only fault
// injection: a poisoned step never reaches the weights, halts (or is skipped up to K
// times), names the step and the first non-finite tensor, and leaves the last good
// checkpoint usable. CPU, tiny models.
#include <gtest/gtest.h>

#include <cmath>

#include "tiny_run.h"

namespace nsad {
namespace {

class NonFiniteTest : public TrainerTest {
 protected:
  TrainConfig Faulty(int64_t step, int layer, const std::string& sublayer = "attention",
                     bool backward = false) const {
    auto c = Tiny();
    c.model.n_layers = 2;
    c.max_steps = 10;
    c.allow_fault_injection = true;
    c.fault_injection.nan_at_step = step;
    c.fault_injection.layer = layer;
    c.fault_injection.sublayer = sublayer;
    c.fault_injection.backward = backward;
    return c;
  }

  // Runs until the trainer halts; returns the halt (fails the test if it never does).
  static TrainingHalt RunUntilHalt(Trainer& trainer) {
    while (!trainer.finished()) {
      try {
        trainer.Step();
      } catch (const TrainingHalt& halt) {
        return halt;
      }
    }
    ADD_FAILURE() << "the run did not halt";
    return TrainingHalt(-1, "");
  }

  static bool Contains(const std::string& text, const std::string& part) {
    return text.find(part) != std::string::npos;
  }
};

TEST_F(NonFiniteTest, HaltsWithoutUpdatingAndKeepsTheLastCheckpoint) {
  auto config = Faulty(3, 0);
  config.checkpoint_dir = (dir_ / "ckpt").string();
  config.checkpoint_every = 2;
  auto trainer = Trainer::Create(config);
  trainer->Step();
  trainer->Step();
  const double val_before = trainer->Evaluate();
  const TrainingHalt halt = RunUntilHalt(*trainer);
  EXPECT_EQ(halt.step(), 3);
  const std::string message = halt.what();
  EXPECT_TRUE(Contains(message, "step 3: non-finite loss (nan)")) << message;
  EXPECT_TRUE(Contains(message, "first non-finite tensor: layer 0 attention forward")) << message;
  EXPECT_TRUE(Contains(message, "last good checkpoint: " + config.checkpoint_dir + "/step_000000002"))
      << message;
  EXPECT_EQ(trainer->step(), 2);
  EXPECT_EQ(trainer->Evaluate(), val_before) << "the failed step must not touch the weights";

  // The checkpoint of step 2 is intact and continues exactly as a run that never failed.
  auto clean = Tiny();
  clean.model.n_layers = 2;
  clean.max_steps = 10;
  auto reference = Trainer::Create(clean);
  for (int i = 0; i < 2; ++i) reference->Step();
  clean.checkpoint_dir = config.checkpoint_dir;
  clean.resume_from = "latest";
  auto resumed = Trainer::Create(clean);
  EXPECT_EQ(resumed->step(), 2) << "no checkpoint was written for the failed step";
  EXPECT_EQ(resumed->Step().loss, reference->Step().loss);
}

struct Localisation {
  int layer;
  const char* sublayer;
  bool backward;
  const char* expected;
};

TEST_F(NonFiniteTest, LocalisesTheFirstNonFiniteTensor) {
  const Localisation cases[] = {
      {1, "mlp", false, "layer 1 mlp forward"},
      {1, "attention", false, "layer 1 attention forward"},
      {0, "attention", true, "layer 0 attention backward"},
      {1, "mlp", true, "layer 1 mlp backward"},
      {-1, "attention", false, "loss forward"},
  };
  for (const auto& c : cases) {
    auto trainer = Trainer::Create(Faulty(1, c.layer, c.sublayer, c.backward));
    const TrainingHalt halt = RunUntilHalt(*trainer);
    EXPECT_EQ(halt.step(), 1);
    const std::string message = halt.what();
    EXPECT_TRUE(Contains(message, std::string("first non-finite tensor: ") + c.expected))
        << "expected " << c.expected << " in: " << message;
    // A poisoned gradient leaves the loss finite: the gradient norm gives it away.
    EXPECT_TRUE(Contains(message, c.backward ? "non-finite gradient norm" : "non-finite loss"))
        << message;
  }
}

TEST_F(NonFiniteTest, SkipPolicySkipsUpToKStepsThenHalts) {
  auto config = Faulty(2, 1, "mlp");
  config.fault_injection.count = 3;  // steps 2, 3, 4 are poisoned
  config.nonfinite_policy = "skip";
  config.nonfinite_max_skips = 2;
  auto trainer = Trainer::Create(config);
  const StepMetrics first = trainer->Step();
  EXPECT_TRUE(first.skipped_reason.empty());
  const double val_before = trainer->Evaluate();

  for (int64_t step : {2, 3}) {
    const StepMetrics m = trainer->Step();
    EXPECT_EQ(m.step, step);
    EXPECT_FALSE(std::isfinite(m.loss));
    EXPECT_EQ(m.skipped_steps, step - 1);
    EXPECT_TRUE(Contains(m.skipped_reason, "step " + std::to_string(step) + ": non-finite loss"))
        << m.skipped_reason;
    EXPECT_TRUE(Contains(m.skipped_reason, "layer 1 mlp forward")) << m.skipped_reason;
    EXPECT_EQ(m.tokens_seen, first.tokens_seen) << "skipped tokens were not trained on";
  }
  EXPECT_EQ(trainer->Evaluate(), val_before) << "skipped updates must not touch the weights";
  const TrainingHalt halt = RunUntilHalt(*trainer);
  EXPECT_EQ(halt.step(), 4);
  EXPECT_TRUE(Contains(halt.what(), "all 2 allowed skips used")) << halt.what();

  // One bad step with budget left: the run carries on with finite, applied updates.
  config.fault_injection.count = 1;
  trainer = Trainer::Create(config);
  trainer->Step();
  EXPECT_FALSE(trainer->Step().skipped_reason.empty());
  const StepMetrics after = trainer->Step();
  EXPECT_TRUE(after.skipped_reason.empty());
  EXPECT_TRUE(std::isfinite(after.loss));
  EXPECT_EQ(after.skipped_steps, 1);
  EXPECT_NE(trainer->Evaluate(), val_before);
}

TEST_F(NonFiniteTest, FaultInjectionIsRefusedUnlessExplicitlyAllowed) {
  auto config = Faulty(1, 0);
  config.allow_fault_injection = false;
  try {
    Trainer::Create(config);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.errors().size(), 1u) << e.what();
    EXPECT_EQ(e.errors()[0].field, "fault_injection");
  }
  config.fault_injection.nan_at_step = 0;  // off: nothing to refuse
  EXPECT_NO_THROW(Trainer::Create(config));
}

TEST(NonFiniteConfig, NewFieldsAreValidatedByName) {
  auto fields = [](const TrainConfig& c) {
    std::vector<std::string> names;
    for (const auto& e : ValidateConfig(c)) names.push_back(e.field);
    return names;
  };
  TrainConfig c;
  c.data.train_path = "/";
  ASSERT_TRUE(fields(c).empty()) << FormatFieldErrors(ValidateConfig(c));
  c.checkpoint_every = -1;
  c.checkpoint_keep = 0;
  c.checkpoint_milestone_every = -5;
  c.nonfinite_policy = "ignore";
  c.nonfinite_max_skips = -1;
  c.resume_from = "latest";  // without checkpoint_dir
  EXPECT_EQ(fields(c), (std::vector<std::string>{"checkpoint_every", "checkpoint_keep",
                                                 "checkpoint_milestone_every", "resume_from",
                                                 "nonfinite_policy", "nonfinite_max_skips"}))
      << FormatFieldErrors(ValidateConfig(c));

  TrainConfig r;
  r.data.train_path = "/";
  r.resume_from = "/no/such/checkpoint";
  EXPECT_EQ(fields(r), std::vector<std::string>{"resume_from"});

  TrainConfig f;
  f.data.train_path = "/";
  f.allow_fault_injection = true;
  f.fault_injection.nan_at_step = -3;
  f.fault_injection.count = 0;
  f.fault_injection.layer = f.model.n_layers;
  f.fault_injection.sublayer = "ffn";
  EXPECT_EQ(fields(f), (std::vector<std::string>{"fault_injection.nan_at_step",
                                                 "fault_injection.count", "fault_injection.layer",
                                                 "fault_injection.sublayer"}))
      << FormatFieldErrors(ValidateConfig(f));
  f.fault_injection = {};
  f.fault_injection.nan_at_step = 1;
  f.fault_injection.backward = true;  // layer -1 = the loss: no incoming gradient to poison
  EXPECT_EQ(fields(f), std::vector<std::string>{"fault_injection.backward"});
}

}  // namespace
}  // namespace nsad
