// Checkpoints through the public Trainer API: exact resume, checksum verification, the
// atomic on-disk layout and retention, and refusal of a checkpoint from another config;
// and the archive writer's errors. CPU, tiny models.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "tiny_run.h"
#include "trainer/checkpoint.h"
#include "trainer/checkpoint_store.h"

namespace nsad {
namespace {

std::vector<std::string> Entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream out;
  out << in.rdbuf();
  return out.str();
}

void WriteAll(const std::string& path, const std::string& contents) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << contents;
}

struct Trajectory {
  std::vector<StepMetrics> steps;
  double val_loss = 0.0;
};

class CheckpointTest : public TrainerTest {
 protected:
  // Two micro-batches per step, so resume covers gradient accumulation too.
  TrainConfig Config() const {
    auto c = Tiny();
    c.batch_size = 2;
    c.grad_accum = 2;
    c.max_steps = 8;
    c.optim.warmup_steps = 3;
    return c;
  }
  std::string CheckpointDir() const { return (dir_ / "ckpt").string(); }

  // Steps `trainer` until step `until` and records every step's metrics.
  static Trajectory Run(Trainer& trainer, int64_t until) {
    Trajectory t;
    while (trainer.step() < until) t.steps.push_back(trainer.Step());
    t.val_loss = trainer.Evaluate();
    return t;
  }

  static void ExpectSameSteps(const std::vector<StepMetrics>& expected,
                              const std::vector<StepMetrics>& actual) {
    ASSERT_EQ(expected.size(), actual.size());
    for (size_t i = 0; i < expected.size(); ++i) {
      // Bitwise: the same ops on the same values in the same order on one CPU thread pool.
      EXPECT_EQ(actual[i].step, expected[i].step);
      EXPECT_EQ(actual[i].loss, expected[i].loss) << "step " << expected[i].step;
      EXPECT_EQ(actual[i].grad_norm, expected[i].grad_norm) << "step " << expected[i].step;
      EXPECT_EQ(actual[i].lr, expected[i].lr) << "step " << expected[i].step;
      EXPECT_EQ(actual[i].tokens_seen, expected[i].tokens_seen) << "step " << expected[i].step;
    }
  }

  // A run with a checkpoint at step 2 (and 4, ... up to `steps`).
  void WriteCheckpoints(int64_t steps) {
    auto c = Config();
    c.checkpoint_dir = CheckpointDir();
    c.checkpoint_every = 2;
    auto trainer = Trainer::Create(c);
    Run(*trainer, steps);
  }

  ConfigError ResumeError(const std::string& resume_from) {
    auto c = Config();
    c.resume_from = resume_from;
    try {
      Trainer::Create(c);
    } catch (const ConfigError& e) {
      return e;
    }
    ADD_FAILURE() << "resuming from " << resume_from << " was accepted";
    return ConfigError({});
  }
};

TEST_F(CheckpointTest, ResumeContinuesExactlyAsTheUninterruptedRun) {
  auto uninterrupted = Trainer::Create(Config());
  const Trajectory reference = Run(*uninterrupted, 8);

  {
    // Halted after step 5: checkpoints at 2 and 4; step 5's batches were already consumed
    // (and more prefetched) when it stopped, which resume must not be fooled by.
    auto c = Config();
    c.checkpoint_dir = CheckpointDir();
    c.checkpoint_every = 2;
    auto first = Trainer::Create(c);
    const Trajectory head = Run(*first, 5);
    ExpectSameSteps({reference.steps.begin(), reference.steps.begin() + 5}, head.steps);
    EXPECT_EQ(head.steps[3].checkpoint, CheckpointDir() + "/step_000000004");
    EXPECT_EQ(head.steps[4].checkpoint, "");
  }

  auto c = Config();
  c.checkpoint_dir = CheckpointDir();
  c.checkpoint_every = 2;
  c.checkpoint_keep = 4;  // keeps step 2 for the explicit resume below
  c.resume_from = "latest";
  auto resumed = Trainer::Create(c);
  EXPECT_EQ(resumed->step(), 4);
  const Trajectory tail = Run(*resumed, 8);
  ExpectSameSteps({reference.steps.begin() + 4, reference.steps.end()}, tail.steps);
  EXPECT_EQ(tail.val_loss, reference.val_loss);
  EXPECT_TRUE(resumed->finished());

  // An explicit checkpoint directory works the same way (and the step-2 one was kept).
  c = Config();
  c.resume_from = CheckpointDir() + "/step_000000002";
  auto from_two = Trainer::Create(c);
  EXPECT_EQ(from_two->step(), 2);
  ExpectSameSteps({reference.steps[2], reference.steps[3]}, Run(*from_two, 4).steps);
}

// Checkpoint() (what a halt asks for) writes the current step between scheduled ones, and a
// resume from it continues exactly as the uninterrupted run; it prunes none of the others
// (a halt for a loss spike keeps the checkpoints from before it), writes nothing twice,
// nothing before a step, and nothing for a run without checkpoints.
TEST_F(CheckpointTest, ACheckpointOnRequestResumesExactlyAtTheStepItWasAskedAt) {
  auto uninterrupted = Trainer::Create(Config());
  const Trajectory reference = Run(*uninterrupted, 8);
  EXPECT_EQ(uninterrupted->Checkpoint(), "") << "no checkpoint_dir";

  auto c = Config();
  c.checkpoint_dir = CheckpointDir();
  c.checkpoint_every = 4;
  c.checkpoint_keep = 1;
  {
    auto first = Trainer::Create(c);
    EXPECT_EQ(first->Checkpoint(), "") << "nothing trained yet";
    Run(*first, 5);  // a scheduled checkpoint at 4
    EXPECT_EQ(first->Checkpoint(), CheckpointDir() + "/step_000000005");
    EXPECT_EQ(first->Checkpoint(), CheckpointDir() + "/step_000000005") << "once";
    EXPECT_EQ(Entries(CheckpointDir()), (std::vector<std::string>{"step_000000004", "step_000000005"}));
  }
  c.resume_from = "latest";
  auto resumed = Trainer::Create(c);
  EXPECT_EQ(resumed->step(), 5);
  EXPECT_EQ(resumed->Checkpoint(), CheckpointDir() + "/step_000000005") << "the step it resumed from has one";
  const Trajectory tail = Run(*resumed, 8);
  ExpectSameSteps({reference.steps.begin() + 5, reference.steps.end()}, tail.steps);
  EXPECT_EQ(tail.val_loss, reference.val_loss);
  EXPECT_EQ(Entries(CheckpointDir()), std::vector<std::string>{"step_000000008"}) << "scheduled ones prune";

  auto off = Config();  // checkpoint_every 0 and no milestones: the run asked for none
  off.checkpoint_dir = (dir_ / "off").string();
  off.checkpoint_every = 0;
  auto without = Trainer::Create(off);
  Run(*without, 2);
  EXPECT_EQ(without->Checkpoint(), "");
  EXPECT_TRUE(Entries(off.checkpoint_dir).empty());
}

// A full disk while an archive is written is an error naming the file and the reason, not
// a crash (/dev/full: every write fails with ENOSPC). OutputArchive::save_to(path) ended the
// worker with std::terminate there.
TEST_F(CheckpointTest, AFullDiskIsAnErrorNamingTheFile) {
  torch::serialize::OutputArchive archive;
  archive.write("weights", torch::ones({1024, 64}));
  try {
    SaveArchive(archive, "/dev/full");
    ADD_FAILURE() << "a write to /dev/full succeeded";
  } catch (const checkpoint::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot write /dev/full"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(std::strerror(ENOSPC)), std::string::npos) << e.what();
  }
  const std::string path = (dir_ / "archive.pt").string();
  SaveArchive(archive, path);
  torch::serialize::InputArchive back;
  back.load_from(path);
  torch::Tensor weights;
  back.read("weights", weights);
  EXPECT_TRUE(torch::equal(weights, torch::ones({1024, 64})));
  if (ProbeRuntime().cuda_devices == 0) return;
  // A CUDA model's archive (what a GPU run checkpoints) through the same writer.
  const auto on_gpu = torch::randn({333, 77}, torch::Device(torch::kCUDA, 0));
  torch::serialize::OutputArchive gpu_archive;
  gpu_archive.write("weights", on_gpu);
  SaveArchive(gpu_archive, path);
  torch::serialize::InputArchive gpu_back;
  gpu_back.load_from(path);
  gpu_back.read("weights", weights);
  EXPECT_TRUE(torch::equal(weights.cpu(), on_gpu.cpu()));
}

TEST_F(CheckpointTest, CorruptionIsDetectedAndNamesTheFile) {
  WriteCheckpoints(2);
  const std::string step2 = CheckpointDir() + "/step_000000002";

  // One flipped bit, same size: only the checksum can tell.
  const std::string model = ReadAll(step2 + "/model.pt");
  std::string flipped = model;
  flipped[flipped.size() / 2] ^= 0x10;
  WriteAll(step2 + "/model.pt", flipped);
  ConfigError e = ResumeError(step2);
  ASSERT_EQ(e.errors().size(), 1u);
  EXPECT_EQ(e.errors()[0].field, "resume_from");
  EXPECT_NE(e.errors()[0].message.find(step2 + "/model.pt is corrupt"), std::string::npos)
      << e.what();
  WriteAll(step2 + "/model.pt", model);

  const std::string optim = ReadAll(step2 + "/optim.pt");
  WriteAll(step2 + "/optim.pt", optim.substr(0, optim.size() - 1));
  e = ResumeError(step2);
  EXPECT_NE(std::string(e.what()).find("optim.pt is corrupt"), std::string::npos) << e.what();
  WriteAll(step2 + "/optim.pt", optim);

  const std::string manifest = ReadAll(step2 + "/MANIFEST");
  std::remove((step2 + "/MANIFEST").c_str());
  e = ResumeError(step2);
  EXPECT_NE(std::string(e.what()).find("no MANIFEST"), std::string::npos) << e.what();
  WriteAll(step2 + "/MANIFEST", manifest);

  auto c = Config();
  c.resume_from = step2;
  EXPECT_EQ(Trainer::Create(c)->step(), 2) << "restored files verify again";
}

TEST_F(CheckpointTest, AtomicLayoutKeepsTheNewestAndMilestones) {
  auto c = Config();
  c.max_steps = 7;
  c.checkpoint_dir = CheckpointDir();
  c.checkpoint_every = 1;
  c.checkpoint_keep = 2;
  c.checkpoint_milestone_every = 3;
  // Leftover of a commit interrupted by a crash: never loaded, removed at start.
  ASSERT_EQ(::mkdir(CheckpointDir().c_str(), 0755), 0);
  ASSERT_EQ(::mkdir((CheckpointDir() + "/step_000000009.tmp").c_str(), 0755), 0);
  auto trainer = Trainer::Create(c);
  EXPECT_EQ(Entries(CheckpointDir()), std::vector<std::string>{});

  std::vector<std::string> after_step;
  while (!trainer->finished()) {
    const StepMetrics m = trainer->Step();
    EXPECT_EQ(m.checkpoint, CheckpointDir() + "/step_00000000" + std::to_string(m.step));
    after_step.push_back(m.checkpoint);
  }
  EXPECT_EQ(Entries(CheckpointDir()),
            (std::vector<std::string>{"step_000000003", "step_000000006", "step_000000007"}))
      << "newest 2 (6, 7) plus milestones (3, 6); no .tmp left behind";
  const std::string last = CheckpointDir() + "/step_000000007";
  EXPECT_EQ(Entries(last),
            (std::vector<std::string>{"MANIFEST", "config", "model.pt", "optim.pt", "state"}));
  const std::string config_text = ReadAll(last + "/config");
  EXPECT_NE(config_text.find("\nmodel.dim=32\n"), std::string::npos) << config_text;
  EXPECT_NE(config_text.find("\ncheckpoint_keep=2\n"), std::string::npos) << config_text;
  const std::string state = ReadAll(last + "/state");
  EXPECT_NE(state.find("\nstep=7\n"), std::string::npos) << state;
  EXPECT_NE(state.find("\ndata_position=nsad-data-position/1 position=28 "), std::string::npos)
      << "7 steps x 2 micro-batches x 2 windows:\n" << state;
  EXPECT_NE(state.find("\nrng.cpu="), std::string::npos) << state;
}

TEST_F(CheckpointTest, ResumeRefusesACheckpointOfAnotherTrajectory) {
  WriteCheckpoints(2);
  auto c = Config();
  c.resume_from = CheckpointDir() + "/step_000000002";
  c.optim.lr *= 2;
  c.seed += 1;
  // ValidateConfig (the daemon's StartRun) says so before any trainer exists.
  const auto errors = ValidateConfig(c);
  ASSERT_EQ(errors.size(), 1u) << FormatFieldErrors(errors);
  EXPECT_EQ(errors[0].field, "resume_from");
  EXPECT_NE(errors[0].message.find("seed: checkpoint 1234, now 1235"), std::string::npos) << errors[0].message;
  try {
    Trainer::Create(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.errors().size(), 1u);
    EXPECT_EQ(e.errors()[0].field, "resume_from");
    EXPECT_NE(e.errors()[0].message.find("optim.lr: checkpoint 0.00300000003, now 0.00600000005"),
              std::string::npos) << e.what();
    EXPECT_NE(e.errors()[0].message.find("seed: checkpoint 1234, now 1235"), std::string::npos)
        << e.what();
  }
  // Operational fields may change: a longer run, another log cadence.
  c = Config();
  c.resume_from = CheckpointDir() + "/step_000000002";
  c.max_steps = 20;
  c.log_every = 5;
  EXPECT_EQ(Trainer::Create(c)->step(), 2);

  c = Config();
  c.checkpoint_dir = (dir_ / "empty").string();
  c.resume_from = "latest";
  try {
    Trainer::Create(c);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.errors().at(0).field, "resume_from");
    EXPECT_NE(std::string(e.what()).find("no checkpoint in"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nsad
