#include "trainer/runtime.h"

#include "nsad/engine.h"
#include "trainer/data_parallel.h"
#ifdef NSAD_HAVE_CUDA_KERNELS
#include "nsa_cuda.h"
#endif

namespace nsad {

RuntimeCapabilities ProbeRuntime() {
  RuntimeCapabilities caps;
  caps.cuda_devices = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#ifdef NSAD_HAVE_CUDA_KERNELS
  caps.cuda_kernels = caps.cuda_devices > 0 && nsa::cuda::Available();
#endif
  caps.nccl = DataParallel::Available();
  return caps;
}

Runtime ResolveRuntime(const TrainConfig& config) {
  RuntimePlan plan = PlanRuntime(config, ProbeRuntime());
  if (!plan.errors.empty()) throw ConfigError(std::move(plan.errors));
  return {torch::Device(plan.device), plan.backend};
}

}  // namespace nsad
