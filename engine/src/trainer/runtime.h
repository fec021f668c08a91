// Where a run executes, as torch objects: the device and backend of PlanRuntime.
#pragma once

#include <torch/torch.h>

#include "nsad/config.h"

namespace nsad {

struct Runtime {
  torch::Device device{torch::kCPU};
  AttentionBackend backend = AttentionBackend::kReference;  // never kAuto
};

// PlanRuntime on this machine's ProbeRuntime(); throws ConfigError when the config asks
// for something the machine cannot do.
Runtime ResolveRuntime(const TrainConfig& config);

}  // namespace nsad
