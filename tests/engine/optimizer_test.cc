// nsad::AdamW (trainer/optimizer.h): on the CPU it must compute exactly what LibTorch's
// torch::optim::AdamW and clip_grad_norm_ computed before it (the trajectory and resume
// tests rely on that), skip a flagged step without touching anything, and save/load its
// state, including the archives torch::optim::AdamW wrote. On a GPU the fused path must
// agree with the CPU path within float tolerance.
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <sstream>

#include "nsad/engine.h"
#include "trainer/optimizer.h"

namespace nsad {
namespace {

OptimConfig Optim() {
  OptimConfig o;
  o.lr = 1e-2f;
  o.weight_decay = 0.1f;
  o.beta1 = 0.9f;
  o.beta2 = 0.95f;
  o.eps = 1e-8f;
  o.grad_clip = 0.5f;
  return o;
}

// A matrix, a vector and a 3-d tensor: two groups (decay on dim >= 2).
std::vector<torch::Tensor> Params(const torch::Device& device) {
  torch::manual_seed(7);
  std::vector<torch::Tensor> params = {torch::randn({5, 4}), torch::randn({4}), torch::randn({2, 3, 2})};
  for (auto& p : params) p = p.to(device).requires_grad_(true);
  return params;
}

// Serialises what `save` writes and reads it back, as a checkpoint file round trip would.
// Tensors load onto `device`.
torch::serialize::InputArchive RoundTrip(
    const std::function<void(torch::serialize::OutputArchive&)>& save,
    const torch::Device& device = torch::kCPU) {
  torch::serialize::OutputArchive out;
  save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes, device);
  return in;
}

std::vector<torch::Tensor> Clones(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

void SetGrads(std::vector<torch::Tensor>& params, int step) {
  torch::manual_seed(100 + step);
  for (auto& p : params) p.mutable_grad() = torch::randn_like(p) * (step + 1);
}

std::vector<double> Lrs() { return {1e-2, 8e-3, 5e-3, 3e-3, 1e-3}; }

TEST(AdamWTest, CpuMatchesLibTorchAdamWAndClippingBitForBit) {
  const auto o = Optim();
  auto ours = Params(torch::kCPU);
  auto theirs = Clones(ours);
  AdamW optimizer = AdamW::ForModel(ours, o);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{theirs[0], theirs[2]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay)));
  groups.emplace_back(std::vector<torch::Tensor>{theirs[1]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(0.0)));
  torch::optim::AdamW reference(std::move(groups), torch::optim::AdamWOptions(o.lr));
  for (int step = 0; step < 5; ++step) {
    SetGrads(ours, step);
    SetGrads(theirs, step);
    optimizer.SetLr(Lrs()[step]);
    for (auto& g : reference.param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(g.options()).lr(Lrs()[step]);
    }
    const double norm = optimizer.ClipGradNorm(o.grad_clip).item<double>();
    const double reference_norm = torch::nn::utils::clip_grad_norm_(theirs, o.grad_clip);
    EXPECT_EQ(norm, reference_norm) << "step " << step;
    optimizer.Step(AdamW::NonFiniteFlag(torch::tensor(1.0), torch::tensor(norm)));
    reference.step();
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(torch::equal(ours[i], theirs[i])) << "step " << step << " parameter " << i;
    }
  }
}

// The total norm adds the per-tensor norms in the model's parameter order, as
// clip_grad_norm_(model->parameters()) did before this class: float addition is not
// associative, so summing the decay group first changed the clip factor in its last bits and,
// over a run, the whole trajectory (the CPU demo's loss at step 200 moved from 2.52 to 2.35).
TEST(AdamWTest, ClipNormAddsTensorsInTheModelsParameterOrder) {
  torch::manual_seed(11);
  std::vector<torch::Tensor> params;  // matrices and vectors interleaved, as in a model
  for (int i = 0; i < 64; ++i) {
    params.push_back((i % 2 == 0 ? torch::randn({7, 5}) : torch::randn({5})).requires_grad_(true));
  }
  auto twin = Clones(params);
  AdamW optimizer = AdamW::ForModel(params, Optim());
  for (int step = 0; step < 3; ++step) {
    SetGrads(params, step);
    SetGrads(twin, step);
    for (size_t i = 0; i < params.size(); ++i) {  // magnitudes over several decades
      const double scale = std::pow(3.0, static_cast<double>(i % 11) - 5.0);
      params[i].mutable_grad().mul_(scale);
      twin[i].mutable_grad().mul_(scale);
    }
    const double norm = optimizer.ClipGradNorm(0.5).item<double>();
    const double want = torch::nn::utils::clip_grad_norm_(twin, 0.5);
    EXPECT_EQ(norm, want) << "step " << step;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].grad(), twin[i].grad())) << "step " << step << " grad " << i;
    }
  }
}

TEST(AdamWTest, AFlaggedStepLeavesWeightsMomentsAndStepCountsAlone) {
  auto params = Params(torch::kCPU);
  auto twin = Clones(params);
  AdamW optimizer = AdamW::ForModel(params, Optim());
  AdamW plain = AdamW::ForModel(twin, Optim());
  SetGrads(params, 0);
  SetGrads(twin, 0);
  optimizer.Step();
  plain.Step();
  // A NaN gradient under a NaN norm: flagged, so nothing may change.
  const auto before = Clones(params);
  SetGrads(params, 1);
  params[0].mutable_grad()[0][0] = std::numeric_limits<float>::quiet_NaN();
  const auto norm = optimizer.ClipGradNorm(1.0);
  EXPECT_TRUE(std::isnan(norm.item<double>()));
  const auto flag = AdamW::NonFiniteFlag(torch::tensor(2.0), norm);
  EXPECT_EQ(flag.item<float>(), 1.0f);
  optimizer.Step(flag);
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], before[i]));
  // The next step matches an optimizer that never saw the skipped one (same moments, same
  // bias correction).
  SetGrads(params, 2);
  SetGrads(twin, 2);
  optimizer.Step(AdamW::NonFiniteFlag(torch::tensor(2.0), torch::tensor(1.0)));
  plain.Step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], twin[i])) << i;
  // A non-finite loss alone flags the step too.
  EXPECT_EQ(AdamW::NonFiniteFlag(torch::tensor(std::numeric_limits<double>::infinity()),
                                 torch::tensor(1.0)).item<float>(), 1.0f);
}

// Save/Load (and loading a torch::optim::AdamW archive, the format of older checkpoints)
// continue exactly.
TEST(AdamWTest, SavedStateAndLibTorchArchivesResumeExactly) {
  const auto o = Optim();
  auto params = Params(torch::kCPU);
  AdamW optimizer = AdamW::ForModel(params, o);
  for (int step = 0; step < 2; ++step) {
    SetGrads(params, step);
    optimizer.Step();
  }
  auto resumed_params = Clones(params);
  AdamW resumed = AdamW::ForModel(resumed_params, o);
  auto in = RoundTrip([&](torch::serialize::OutputArchive& out) { optimizer.Save(out); });
  resumed.Load(in);
  SetGrads(params, 2);
  SetGrads(resumed_params, 2);
  optimizer.Step();
  resumed.Step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], resumed_params[i]));

  // torch::optim::AdamW over the same groups, two steps, saved; ours loads and continues.
  auto legacy_params = Params(torch::kCPU);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  const auto options = torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps);
  groups.emplace_back(std::vector<torch::Tensor>{legacy_params[0], legacy_params[2]},
                      std::make_unique<torch::optim::AdamWOptions>(
                          torch::optim::AdamWOptions(options).weight_decay(o.weight_decay)));
  groups.emplace_back(std::vector<torch::Tensor>{legacy_params[1]},
                      std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(options).weight_decay(0.0)));
  torch::optim::AdamW legacy(std::move(groups), options);
  for (int step = 0; step < 2; ++step) {
    SetGrads(legacy_params, step);
    legacy.step();
  }
  auto loaded_params = Clones(legacy_params);
  AdamW loaded = AdamW::ForModel(loaded_params, o);
  auto legacy_in = RoundTrip([&](torch::serialize::OutputArchive& out) { legacy.save(out); });
  loaded.Load(legacy_in);
  SetGrads(legacy_params, 2);
  SetGrads(loaded_params, 2);
  legacy.step();
  loaded.Step();
  for (size_t i = 0; i < legacy_params.size(); ++i) {
    EXPECT_TRUE(torch::equal(legacy_params[i], loaded_params[i])) << i;
  }
}

// The fused CUDA path: same trajectory as the CPU path within float tolerance, and a
// flagged step skipped on the device (weights and step counts stay).
TEST(AdamWTest, FusedCudaPathAgreesWithTheCpuPathAndSkipsOnTheDevice) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto o = Optim();
  auto cpu = Params(torch::kCPU);
  std::vector<torch::Tensor> gpu;
  for (const auto& p : cpu) gpu.push_back(p.detach().to(cuda).requires_grad_(true));
  AdamW on_cpu = AdamW::ForModel(cpu, o);
  AdamW on_gpu = AdamW::ForModel(gpu, o);
  for (int step = 0; step < 5; ++step) {
    SetGrads(cpu, step);
    for (size_t i = 0; i < cpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(cuda);
    on_cpu.SetLr(Lrs()[step]);
    on_gpu.SetLr(Lrs()[step]);
    const auto cpu_norm = on_cpu.ClipGradNorm(o.grad_clip);
    const auto gpu_norm = on_gpu.ClipGradNorm(o.grad_clip);
    EXPECT_NEAR(gpu_norm.item<double>(), cpu_norm.item<double>(), 1e-5 * cpu_norm.item<double>());
    on_cpu.Step(AdamW::NonFiniteFlag(torch::tensor(1.0), cpu_norm));
    on_gpu.Step(AdamW::NonFiniteFlag(torch::tensor(1.0, torch::TensorOptions().device(cuda)), gpu_norm));
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(torch::allclose(gpu[i].cpu(), cpu[i], 1e-5, 1e-6)) << "step " << step << " parameter " << i;
    }
  }
  const auto before = Clones(gpu);
  for (auto& p : gpu) p.mutable_grad() = torch::full_like(p, std::numeric_limits<float>::quiet_NaN());
  const auto norm = on_gpu.ClipGradNorm(o.grad_clip);
  on_gpu.Step(AdamW::NonFiniteFlag(torch::tensor(1.0, torch::TensorOptions().device(cuda)), norm));
  for (size_t i = 0; i < gpu.size(); ++i) EXPECT_TRUE(torch::equal(gpu[i], before[i])) << i;
  // Step counts did not advance: the next step still matches the CPU path, which never saw
  // the flagged step.
  SetGrads(cpu, 5);
  for (size_t i = 0; i < cpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(cuda);
  on_cpu.Step();
  on_gpu.Step();
  for (size_t i = 0; i < cpu.size(); ++i) {
    EXPECT_TRUE(torch::allclose(gpu[i].cpu(), cpu[i], 1e-5, 1e-6)) << "parameter " << i;
  }
}

// The fused step runs on its parameters' device whichever device is current, as ATen's ops
// do: its kernel launches on the current device's stream, so before its entry took a device
// guard, parameters on cuda:1 under a current cuda:0 came out wrong, silently.
TEST(AdamWTest, FusedCudaStepRunsOnItsParametersDeviceWhicheverIsCurrent) {
  if (ProbeRuntime().cuda_devices < 2) GTEST_SKIP() << "needs two CUDA devices";
  const c10::cuda::CUDAGuard current(0);
  const torch::Device second(torch::kCUDA, 1);
  const auto o = Optim();
  auto cpu = Params(torch::kCPU);
  std::vector<torch::Tensor> gpu;
  for (const auto& p : cpu) gpu.push_back(p.detach().to(second).requires_grad_(true));
  AdamW on_cpu = AdamW::ForModel(cpu, o);
  AdamW on_gpu = AdamW::ForModel(gpu, o);
  for (int step = 0; step < 2; ++step) {
    SetGrads(cpu, step);
    for (size_t i = 0; i < cpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(second);
    on_cpu.Step();
    on_gpu.Step();
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(torch::allclose(gpu[i].cpu(), cpu[i], 1e-5, 1e-6)) << "step " << step << " parameter " << i;
    }
  }
  EXPECT_EQ(c10::cuda::current_device(), 0);
}

// On CUDA the clip factor is applied inside the update kernel as each gradient is read: the
// update is the CPU path's (which scales the gradients first) and the gradients keep their
// values. The sizes cover several CTAs' chunks, tails shorter than four elements, a vector of
// one element and a parameter that is not 16-byte aligned (one float into its storage).
TEST(AdamWTest, FusedCudaStepClipsAsItReadsTheGradients) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto o = Optim();
  torch::manual_seed(3);
  std::vector<torch::Tensor> cpu = {torch::randn({70001}), torch::randn({257, 3}), torch::randn({1}),
                                    torch::randn({4099})};
  std::vector<torch::Tensor> gpu;
  for (auto& p : cpu) {
    p.requires_grad_(true);
    gpu.push_back(p.detach().to(cuda).requires_grad_(true));
  }
  const auto misaligned_storage = torch::zeros({4100}, torch::TensorOptions().device(cuda));
  misaligned_storage.narrow(0, 1, 4099).copy_(cpu[3].detach());
  gpu[3] = misaligned_storage.narrow(0, 1, 4099).detach().requires_grad_(true);
  ASSERT_NE(reinterpret_cast<uintptr_t>(gpu[3].data_ptr()) % 16, 0u);
  AdamW on_cpu = AdamW::ForModel(cpu, o);
  AdamW on_gpu = AdamW::ForModel(gpu, o);
  for (int step = 0; step < 3; ++step) {
    SetGrads(cpu, step);
    std::vector<torch::Tensor> sent;
    for (size_t i = 0; i < cpu.size(); ++i) {
      gpu[i].mutable_grad() = cpu[i].grad().to(cuda);
      sent.push_back(gpu[i].grad().clone());
    }
    const auto cpu_norm = on_cpu.ClipGradNorm(o.grad_clip);
    const auto gpu_norm = on_gpu.ClipGradNorm(o.grad_clip);
    ASSERT_GT(cpu_norm.item<double>(), 10 * o.grad_clip) << "the clip must act";
    on_cpu.Step(AdamW::NonFiniteFlag(torch::tensor(1.0), cpu_norm));
    on_gpu.Step(AdamW::NonFiniteFlag(torch::tensor(1.0, torch::TensorOptions().device(cuda)), gpu_norm));
    for (size_t i = 0; i < cpu.size(); ++i) {
      EXPECT_TRUE(torch::equal(gpu[i].grad(), sent[i])) << "step " << step << " gradient " << i;
      EXPECT_TRUE(torch::allclose(gpu[i].cpu(), cpu[i], 1e-5, 1e-6)) << "step " << step << " parameter " << i;
    }
  }
}

// Checkpointing the fused path: the device step counts and moments survive Save/Load, and
// the resumed optimizer continues bit for bit (the fused kernel is elementwise).
TEST(AdamWTest, FusedCudaStateSavesAndResumesExactly) {
  if (ProbeRuntime().cuda_devices == 0) GTEST_SKIP() << "no CUDA device";
  const torch::Device cuda(torch::kCUDA, 0);
  const auto o = Optim();
  std::vector<torch::Tensor> params;
  for (const auto& p : Params(torch::kCPU)) params.push_back(p.detach().to(cuda).requires_grad_(true));
  auto with_grads = [&](std::vector<torch::Tensor>& ps, int step) {
    auto cpu = Params(torch::kCPU);
    SetGrads(cpu, step);
    for (size_t i = 0; i < ps.size(); ++i) ps[i].mutable_grad() = cpu[i].grad().to(cuda);
  };
  AdamW optimizer = AdamW::ForModel(params, o);
  for (int step = 0; step < 3; ++step) {
    with_grads(params, step);
    optimizer.Step();
  }
  auto resumed_params = Clones(params);
  AdamW resumed = AdamW::ForModel(resumed_params, o);
  auto in = RoundTrip([&](torch::serialize::OutputArchive& out) { optimizer.Save(out); }, cuda);
  resumed.Load(in);
  with_grads(params, 3);
  with_grads(resumed_params, 3);
  optimizer.Step();
  resumed.Step();
  for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(torch::equal(params[i], resumed_params[i])) << i;
}

}  // namespace
}  // namespace nsad
