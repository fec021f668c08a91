// Which GPUs a run's workers go on. A run whose device is "auto" is placed by the daemon on
// the GPUs the fewest live runs hold, so that runs started on a machine with several GPUs
// spread over them instead of all sharing cuda:0 (as "auto" alone resolves); a run that names
// its device ("cuda:N", "cuda", "cpu") goes where it says. Plain C++: the run manager's
// bookkeeping, tested without a GPU.
#pragma once

#include <string>
#include <vector>

namespace nsad::server {

// The GPUs a run holds from the device its config names and its worker count: "cuda:N" ->
// {N}; "cuda", or "auto" on a machine with GPUs -> {0 .. world_size - 1} (one worker per GPU,
// rank order); "cpu", or "auto" without GPUs -> {}.
std::vector<int> NamedGpus(const std::string& device, int world_size, int cuda_devices);

// `count` distinct GPUs out of runs_per_gpu.size() for a run placed by the daemon: those the
// fewest live runs hold, ties to the lower index, in ascending order (rank 0 on the first).
// Empty when the machine has fewer than `count` GPUs (the config check refuses that run).
std::vector<int> LeastLoadedGpus(const std::vector<int>& runs_per_gpu, int count);

// "cuda:1" or "cuda:2,cuda:3", as a run reports its workers' devices.
std::string GpuNames(const std::vector<int>& gpus);

}  // namespace nsad::server
