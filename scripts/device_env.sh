# shellcheck shell=bash
# Sourced by the GPU scripts (scripts/gpu_*.sh, bench/scripts/*.sh) from the repository root on
# the lent device machine: unpacks the carried packages under /opt (never into /), exports
# what CMake needs to find them and LibTorch, and defines the build and daemon steps
# (device_lib.sh).
#   .device-deps  gRPC, protobuf, prometheus-cpp, spdlog .debs + unpack.sh (../shared/device)
#   .kernel-deps  libgtest-dev / googletest .debs
if [ -f .device-deps/unpack.sh ]; then source .device-deps/unpack.sh; fi
if ls .kernel-deps/*.deb >/dev/null 2>&1; then
  mkdir -p /opt/nsad-gtest
  for f in .kernel-deps/*.deb; do dpkg -x "$f" /opt/nsad-gtest; done
  export CMAKE_PREFIX_PATH="${CMAKE_PREFIX_PATH:-};/opt/nsad-gtest/usr"
fi
if [ -z "${CMAKE_PREFIX_PATH:-}" ]; then
  CMAKE_PREFIX_PATH=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  export CMAKE_PREFIX_PATH
fi
source "$(dirname "${BASH_SOURCE[0]}")/device_lib.sh"
