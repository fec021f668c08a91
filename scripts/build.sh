#!/usr/bin/env bash
# Configures (once) and builds nsad into build/. Usage: scripts/build.sh [TARGET...]
# (no targets: everything, tests included). ccache keeps rebuilds cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=/usr/local/cuda/bin:$PATH
TORCH_PREFIX=$(.venv/bin/python -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
BUILD_DIR=${NSAD_BUILD_DIR:-build}
if [ ! -f "$BUILD_DIR/build.ninja" ]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=${NSAD_BUILD_TYPE:-RelWithDebInfo} \
        -DCMAKE_PREFIX_PATH="$TORCH_PREFIX" ${NSAD_CMAKE_ARGS:-}
fi
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build "$BUILD_DIR" -j "${NSAD_JOBS:-$(nproc)}" "${targets[@]}"
