#include "trainer/runtime.h"

#include "nsad/engine.h"
#ifdef NSAD_HAVE_CUDA_KERNELS
#include "nsa_cuda.h"
#endif

namespace nsad {

bool CudaKernelsAvailable() {
#ifdef NSAD_HAVE_CUDA_KERNELS
  return nsa::cuda::Available();
#else
  return false;
#endif
}

namespace {

// The device as torch sees it, or a field error. No environment variable is consulted:
// what runs is what the config says (the field reports had flags that switched nothing).
bool ResolveDevice(const std::string& requested, torch::Device* device, std::vector<FieldError>* errors) {
  const bool have_cuda = torch::cuda::is_available();
  if (requested == "auto") {
    *device = have_cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    return true;
  }
  if (requested == "cpu") {
    *device = torch::Device(torch::kCPU);
    return true;
  }
  const int index = requested == "cuda" ? 0 : std::stoi(requested.substr(5));
  const int count = have_cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  if (index >= count) {
    errors->push_back({"device", "\"" + requested + "\" requested but " +
                                     std::to_string(count) + " CUDA device(s) are visible"});
    return false;
  }
  *device = torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
  return true;
}

std::vector<FieldError> Resolve(const TrainConfig& config, Runtime* runtime) {
  std::vector<FieldError> errors;
  if (!ResolveDevice(config.device, &runtime->device, &errors)) return errors;
  const bool on_gpu = runtime->device.is_cuda();
  switch (config.attention_backend) {
    case AttentionBackend::kAuto:
      runtime->backend = on_gpu && CudaKernelsAvailable() ? AttentionBackend::kCuda
                                                          : AttentionBackend::kReference;
      break;
    case AttentionBackend::kReference:
      runtime->backend = AttentionBackend::kReference;
      break;
    case AttentionBackend::kCuda:
      if (!on_gpu) {
        errors.push_back({"attention_backend", "cuda needs a CUDA device, but the run's device is " +
                                                   runtime->device.str()});
      } else if (!CudaKernelsAvailable()) {
        errors.push_back({"attention_backend",
                          "cuda kernels are not available in this build or for this GPU"});
      }
      runtime->backend = AttentionBackend::kCuda;
      break;
  }
  return errors;
}

}  // namespace

Runtime ResolveRuntime(const TrainConfig& config) {
  Runtime runtime;
  auto errors = Resolve(config, &runtime);
  if (!errors.empty()) throw ConfigError(std::move(errors));
  return runtime;
}

std::vector<FieldError> CheckRuntime(const TrainConfig& config) {
  Runtime runtime;
  return Resolve(config, &runtime);
}

}  // namespace nsad
