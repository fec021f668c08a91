#include "trainer/runtime.h"

#include <ATen/cuda/CUDAContext.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "nsad/engine.h"
#include "trainer/data_parallel.h"
#ifdef NSAD_HAVE_CUDA_KERNELS
#include "nsa_cuda.h"
#endif

namespace nsad {
namespace {

// The host's memory: its RAM, or the limit of the process's memory cgroup (v2, else v1) where
// that is smaller, as seen from inside a container (its cgroup namespace's root).
int64_t HostMemoryBytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGESIZE);
  int64_t bytes = pages > 0 && page > 0 ? static_cast<int64_t>(pages) * page : 0;
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}) {
    std::ifstream file(path);
    int64_t limit = 0;
    if (file >> limit && limit > 0) {  // v2's "max" reads as nothing
      bytes = bytes > 0 ? std::min(bytes, limit) : limit;
      break;
    }
  }
  return bytes;
}

}  // namespace

RuntimeCapabilities ProbeRuntime() {
  RuntimeCapabilities caps;
  caps.cuda_devices = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
#ifdef NSAD_HAVE_CUDA_KERNELS
  caps.cuda_kernels = caps.cuda_devices > 0 && nsa::cuda::Available();
#endif
  caps.nccl = DataParallel::Available();
  for (int i = 0; i < caps.cuda_devices; ++i) {
    caps.cuda_memory_bytes.push_back(static_cast<int64_t>(at::cuda::getDeviceProperties(i)->totalGlobalMem));
  }
  caps.host_memory_bytes = HostMemoryBytes();
  return caps;
}

Runtime ResolveRuntime(const TrainConfig& config) {
  RuntimePlan plan = PlanRuntime(config, ProbeRuntime());
  if (!plan.errors.empty()) throw ConfigError(std::move(plan.errors));
  return {torch::Device(plan.device), plan.backend};
}

}  // namespace nsad
