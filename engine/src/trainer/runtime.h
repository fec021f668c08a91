// Where a run executes: the device and attention backend that "auto" resolves to.
#pragma once

#include <torch/torch.h>

#include "nsad/config.h"

namespace nsad {

struct Runtime {
  torch::Device device{torch::kCPU};
  AttentionBackend backend = AttentionBackend::kReference;  // never kAuto
};

// Throws ConfigError when the config asks for something this machine cannot do.
Runtime ResolveRuntime(const TrainConfig& config);

// True when the custom CUDA kernels were compiled in and can run on this machine.
bool CudaKernelsAvailable();

}  // namespace nsad
