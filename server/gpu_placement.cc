#include "gpu_placement.h"

#include <algorithm>
#include <numeric>

namespace nsad::server {

std::vector<int> NamedGpus(const std::string& device, int world_size, int cuda_devices) {
  const std::string prefix = "cuda:";
  if (device.rfind(prefix, 0) == 0) return {std::stoi(device.substr(prefix.size()))};
  if (device == "cuda" || (device == "auto" && cuda_devices > 0)) {
    std::vector<int> gpus(std::max(world_size, 1));
    std::iota(gpus.begin(), gpus.end(), 0);
    return gpus;
  }
  return {};
}

std::vector<int> LeastLoadedGpus(const std::vector<int>& runs_per_gpu, int count) {
  if (count <= 0 || static_cast<size_t>(count) > runs_per_gpu.size()) return {};
  std::vector<int> order(runs_per_gpu.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return runs_per_gpu[a] < runs_per_gpu[b]; });
  order.resize(count);
  std::sort(order.begin(), order.end());
  return order;
}

std::string GpuNames(const std::vector<int>& gpus) {
  std::string names;
  for (const int gpu : gpus) names += (names.empty() ? "cuda:" : ",cuda:") + std::to_string(gpu);
  return names;
}

}  // namespace nsad::server
