// nsad::Trainer through its public, torch-free API: config errors, backend resolution,
// learning, determinism, schedule and throughput accounting. CPU, tiny models.
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <cmath>
#include <stdexcept>
#include <functional>

#include "../common/first_losses.h"
#include "tiny_run.h"

namespace nsad {
namespace {

TEST_F(TrainerTest, InvalidConfigThrowsConfigErrorNamingTheField) {
  auto config = Tiny();
  config.model.n_kv_groups = 3;
  try {
    Trainer::Create(config);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_FALSE(e.errors().empty());
    EXPECT_EQ(e.errors()[0].field, "model.n_kv_groups");
  }
}

TEST_F(TrainerTest, BadShardIsAConfigErrorOnTheDataField) {
  auto config = Tiny();
  std::FILE* f = std::fopen((dir_ / "broken.bin").c_str(), "wb");
  std::fputs("not a shard", f);
  std::fclose(f);
  config.data.train_path = (dir_ / "broken.bin").string();
  try {
    Trainer::Create(config);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.errors().at(0).field, "data.train_path") << e.what();
  }
}

TEST_F(TrainerTest, BackendResolvesToReferenceOnCpuAndCudaIsRefused) {
  auto config = Tiny();
  auto trainer = Trainer::Create(config);
  EXPECT_EQ(trainer->attention_backend(), AttentionBackend::kReference);
  EXPECT_EQ(trainer->device(), "cpu");
  config.attention_backend = AttentionBackend::kCuda;
  const auto plan = PlanRuntime(config, ProbeRuntime());
  ASSERT_EQ(plan.errors.size(), 1u);
  EXPECT_EQ(plan.errors[0].field, "attention_backend");
  EXPECT_THROW(Trainer::Create(config), ConfigError);
}

// world_size > 1 needs one CUDA device per worker and NCCL, and a device the workers can be
// spread over; each refusal names the field. CUDA graphs go with it.
TEST_F(TrainerTest, DataParallelRunsArePlannedOnlyWhereTheyCanRun) {
  TrainConfig config = Tiny();
  config.world_size = 0;
  const auto errors = ValidateConfig(config);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0].field, "world_size");

  config.world_size = 2;
  config.device = "auto";
  RuntimeCapabilities two_gpus;
  two_gpus.cuda_devices = 2;
  two_gpus.cuda_kernels = true;
  two_gpus.nccl = true;
  const auto fits = PlanRuntime(config, two_gpus);
  EXPECT_TRUE(fits.errors.empty()) << FormatFieldErrors(fits.errors);
  EXPECT_EQ(fits.device, "cuda:0") << "rank 0's device";

  auto refused = [&](const TrainConfig& c, const RuntimeCapabilities& caps, const std::string& field,
                     const std::string& says) {
    const auto plan = PlanRuntime(c, caps);
    ASSERT_EQ(plan.errors.size(), 1u) << FormatFieldErrors(plan.errors);
    EXPECT_EQ(plan.errors[0].field, field);
    EXPECT_NE(plan.errors[0].message.find(says), std::string::npos) << plan.errors[0].message;
  };
  RuntimeCapabilities one_gpu = two_gpus;
  one_gpu.cuda_devices = 1;
  refused(config, one_gpu, "world_size", "1 CUDA device(s) are visible");
  RuntimeCapabilities no_nccl = two_gpus;
  no_nccl.nccl = false;
  refused(config, no_nccl, "world_size", "NCCL");
  TrainConfig pinned = config;
  pinned.device = "cuda:1";
  refused(pinned, two_gpus, "world_size", "device must be auto or cuda");
  TrainConfig cpu = config;
  cpu.device = "cpu";
  refused(cpu, two_gpus, "world_size", "device must be auto or cuda");
  // CUDA graphs capture the step with its all-reduces; they still need the kernels' shapes.
  TrainConfig graphs = config;
  graphs.cuda_graphs = true;
  graphs.model.head_dim = 64;
  const auto graphed = PlanRuntime(graphs, two_gpus);
  EXPECT_TRUE(graphed.errors.empty()) << FormatFieldErrors(graphed.errors);
  EXPECT_EQ(graphed.backend, AttentionBackend::kCuda);
  // And on this machine, through Create, when it lacks two GPUs.
  if (ProbeRuntime().cuda_devices < 2) {
    EXPECT_THROW(Trainer::Create(config, {0, (dir_ / "rendezvous").string()}), ConfigError);
  }
}

// A worker trains on the GPU the daemon placed it on (a run whose device is "auto"), or the
// one its config names, with the NSA kernels launched there: they launch on the current
// device's stream, which for a run on cuda:1 was cuda:0's. A CPU run placed on a GPU is refused.
TEST_F(TrainerTest, AWorkerTrainsOnTheGpuItIsPlacedOn) {
  WorkerPlace first_gpu;
  first_gpu.cuda_device = 0;
  EXPECT_THROW(Trainer::Create(Tiny(), first_gpu), std::invalid_argument);
  const RuntimeCapabilities caps = ProbeRuntime();
  if (caps.cuda_devices < 2 || !caps.cuda_kernels) GTEST_SKIP() << "needs two CUDA devices and the NSA kernels";
  // A worker makes its GPU the current device for good; this process's later tests expect theirs.
  const c10::cuda::CUDAGuard restore_current_device(c10::cuda::current_device());
  TrainConfig config = Tiny();
  config.device = "auto";
  config.model.head_dim = 64;  // a shape the kernels take
  config.attention_backend = AttentionBackend::kCuda;
  const auto train = [](const TrainConfig& c, const WorkerPlace& place, std::string* device) {
    auto trainer = Trainer::Create(c, place);
    *device = trainer->device();
    std::vector<double> losses;
    for (int i = 0; i < 4; ++i) losses.push_back(trainer->Step().loss);
    return losses;
  };
  WorkerPlace second_gpu;
  second_gpu.cuda_device = 1;
  TrainConfig named = config;
  named.device = "cuda:1";
  std::string on_first, placed, on_named;
  const auto expected = train(config, first_gpu, &on_first);
  const auto placed_losses = train(config, second_gpu, &placed);
  const auto named_losses = train(named, {}, &on_named);
  EXPECT_EQ(on_first, "cuda:0");
  EXPECT_EQ(placed, "cuda:1");
  EXPECT_EQ(on_named, "cuda:1");
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_NEAR(placed_losses[i], expected[i], 1e-3 * expected[i]) << "step " << i + 1;
    EXPECT_NEAR(named_losses[i], expected[i], 1e-3 * expected[i]) << "step " << i + 1;
  }
}

// On a GPU, auto takes the CUDA kernels only for shapes they are built for; asked for
// explicitly with another shape they are refused up front, naming the field, instead of a
// run that fails at its first step ("NSA CUDA kernels support head_dim 64 and 128").
TEST_F(TrainerTest, ShapesTheKernelsLackStayOnTheReference) {
  RuntimeCapabilities gpu;
  gpu.cuda_devices = 1;
  gpu.cuda_kernels = true;
  TrainConfig config = Tiny();
  config.device = "auto";
  config.model.head_dim = 64;
  EXPECT_EQ(PlanRuntime(config, gpu).backend, AttentionBackend::kCuda);

  struct Case {
    std::function<void(ModelConfig&)> change;
    std::string field;
  };
  const std::vector<Case> cases = {
      {[](ModelConfig& m) { m.head_dim = 16; }, "model.head_dim"},
      {[](ModelConfig& m) { m.head_dim = 96; }, "model.head_dim"},
      {[](ModelConfig& m) { m.n_heads = 17 * m.n_kv_groups; }, "model.n_heads"},
      {[](ModelConfig& m) { m.nsa.slc_top_n = 33; }, "model.nsa.slc_top_n"},
      {[](ModelConfig& m) { m.nsa.slc_block = 128; }, "model.nsa.slc_block"},
  };
  for (const auto& c : cases) {
    TrainConfig shaped = config;
    c.change(shaped.model);
    const auto automatic = PlanRuntime(shaped, gpu);
    EXPECT_TRUE(automatic.errors.empty()) << c.field << ": " << FormatFieldErrors(automatic.errors);
    EXPECT_EQ(automatic.backend, AttentionBackend::kReference) << c.field;
    shaped.attention_backend = AttentionBackend::kCuda;
    const auto refused = PlanRuntime(shaped, gpu);
    ASSERT_EQ(refused.errors.size(), 1u) << c.field << ": " << FormatFieldErrors(refused.errors);
    EXPECT_EQ(refused.errors[0].field, c.field);
  }
}

// The evaluation takes the validation split once at most: eval_batches past it would only
// repeat its windows (all of them held on the device; 2e9 of them filled 15 GB before it
// was capped). val.bin holds 62 windows of 64 tokens: 16 batches of 4.
TEST_F(TrainerTest, EvaluationTakesTheValidationSplitOnceAtMost) {
  auto whole = Tiny();
  whole.eval_batches = 16;
  auto more = Tiny();
  more.eval_batches = static_cast<int>(kMaxEvalBatches);
  const double val_whole = Trainer::Create(whole)->Evaluate();
  const double val_more = Trainer::Create(more)->Evaluate();
  ASSERT_TRUE(std::isfinite(val_whole));
  EXPECT_EQ(val_more, val_whole);
}

// A model too large for the machine fails before anything is allocated, with a message
// naming its sizes (PlanRuntime against the probed memory), not LibTorch's allocation error
// with its C++ backtrace (which the daemon would show as the run's reason). The embedding
// alone asks for 2e9 x 20000 floats: more than a process's address space.
TEST_F(TrainerTest, AModelTooLargeToAllocateFailsWithoutABacktrace) {
  auto huge = Tiny();
  huge.model.vocab_size = 2000000000;
  huge.model.dim = 20000;
  try {
    Trainer::Create(huge);
    ADD_FAILURE() << "a 160 TB embedding was allocated";
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("model: "), std::string::npos) << message;
    EXPECT_NE(message.find("AdamW moments alone, more than the host's"), std::string::npos) << message;
    EXPECT_NE(message.find("model.vocab_size 2000000000, model.dim 20000"), std::string::npos) << message;
    EXPECT_EQ(message.find("frame #"), std::string::npos) << message;
  }
}

TEST_F(TrainerTest, LearnsAndReportsSaneMetrics) {
  auto trainer = Trainer::Create(Tiny());
  EXPECT_GT(trainer->parameter_count(), 1000);
  const double val_before = trainer->Evaluate();
  StepMetrics first, last;
  for (int i = 0; i < 40; ++i) {
    last = trainer->Step();
    if (i == 0) first = last;
    ASSERT_TRUE(std::isfinite(last.loss));
    // The step's data time is a part of its wall time, taken afresh every step.
    EXPECT_GT(last.data_seconds, 0.0) << "step " << last.step;
    EXPECT_LT(last.data_seconds, last.step_seconds) << "step " << last.step;
  }
  EXPECT_TRUE(trainer->finished());
  EXPECT_EQ(last.step, 40);
  EXPECT_EQ(last.tokens_seen, 40 * 4 * 64);
  EXPECT_GT(last.tokens_per_second, 0.0);
  EXPECT_NEAR(first.loss, std::log(256.0), 0.5) << "a fresh model is near uniform";
  EXPECT_LT(last.loss, first.loss * 0.6) << first.loss << " -> " << last.loss;
  EXPECT_LT(trainer->Evaluate(), val_before * 0.7);
  // Warmup then cosine: lr rises for warmup_steps, then falls to min_lr at the end.
  EXPECT_NEAR(first.lr, Tiny().optim.lr / 5, 1e-9);
  EXPECT_NEAR(last.lr, Tiny().optim.min_lr, 1e-4);

  const GateReport gates = trainer->gates();
  EXPECT_EQ(gates.step, 40);
  ASSERT_EQ(gates.layers.size(), 1u);
  EXPECT_GT(gates.layers[0].mean_selected_blocks, 0.0);
  EXPECT_LE(gates.layers[0].mean_selected_blocks, 4.0);
}

TEST_F(TrainerTest, SameSeedSameLossesOtherSeedOtherLosses) {
  auto run = [&](uint64_t seed) {
    auto config = Tiny();
    config.seed = seed;
    return testing::FirstLosses(config, 5);
  };
  const auto a = run(7), b = run(7), c = run(8);
  EXPECT_EQ(a, b) << "same seed, same machine: bitwise identical";
  EXPECT_NE(a, c);
}

TEST_F(TrainerTest, GradientAccumulationMatchesTheLargerBatch) {
  // Two micro-batches of 2 see the same windows as one batch of 4, so the first step's loss
  // and update agree up to float rounding.
  auto big = Tiny();
  auto accum = Tiny();
  accum.batch_size = 2;
  accum.grad_accum = 2;
  auto a = Trainer::Create(big), b = Trainer::Create(accum);
  for (int i = 0; i < 3; ++i) {
    const auto ma = a->Step(), mb = b->Step();
    EXPECT_NEAR(ma.loss, mb.loss, 1e-4) << "step " << i;
    EXPECT_NEAR(ma.grad_norm, mb.grad_norm, 1e-3 * std::max(1.0, ma.grad_norm));
  }
}

TEST_F(TrainerTest, ActivationCheckpointingTrainsTheSameWay) {
  auto losses = [&](bool checkpointing) {
    auto config = Tiny();
    config.activation_checkpointing = checkpointing;
    return testing::FirstLosses(config, 4);
  };
  EXPECT_EQ(losses(true), losses(false)) << "recomputation changes memory, not results";
}

}  // namespace
}  // namespace nsad
