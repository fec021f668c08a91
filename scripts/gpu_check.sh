#!/usr/bin/env bash
# Builds and checks the NSA CUDA kernels on a GPU machine in one go:
#   configure + build (Ninja, Release, only kernels_test and nsa_bench), kernels_test,
#   compute-sanitizer memcheck on a small kernels_test filter, the benchmark table.
# Logs go to $1, else $OUT (the device tool's result folder), else /tmp/nsa-gpu-check.
#
#   scripts/gpu_check.sh [LOG_DIR]
# Env: BUILD_DIR (default /tmp/build), BENCH_ARGS (default: nsa_bench's own defaults),
#      SKIP_TESTS=1, SKIP_BENCH=1, SKIP_MEMCHECK=1.
# On the lent device machine: carry .device-deps (gRPC & co., see ../shared/device) and
# .kernel-deps (libgtest-dev .debs: apt-get download libgtest-dev googletest); both are
# unpacked outside / by this script.
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-/tmp/nsa-gpu-check}}
build=${BUILD_DIR:-/tmp/build}
mkdir -p "$logs"
status=0
step() { echo "== $* ($(date +%T))"; }

source scripts/device_env.sh
nvidia-smi > "$logs/nvidia-smi.txt" 2>&1 || true

step configure+build
device_build . "$build" "$logs" "" kernels_test nsa_bench || exit 1

if [ "${SKIP_TESTS:-0}" != 1 ]; then
  step kernels_test
  timeout 900 "$build/tests/kernels/kernels_test" 2>&1 | tee "$logs/kernels_test.log" | grep -E "FAILED|OK \]|PASSED|SKIPPED|Failure|error" | tail -80
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

if [ "${SKIP_MEMCHECK:-0}" != 1 ]; then
  step compute-sanitizer memcheck
  # No caching allocator: every tensor is its own allocation, so out-of-bounds accesses
  # past a tensor's end are caught instead of landing in a cached neighbour.
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 900 compute-sanitizer --tool memcheck --leak-check no \
    --error-exitcode 9 "$build/tests/kernels/kernels_test" \
    --gtest_filter='*T100_H16_G1_D128_bf16_smallgeo:*T257_H12_G2_D128_bf16:*T257_H12_G2_D64_fp16_smallgeo:*T257_H12_G2_D64_fp32_smallgeo' \
    > "$logs/memcheck.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$logs/memcheck.log" | tail -5
  [ "$rc" -eq 0 ] || { echo "memcheck exit code $rc"; status=1; }
fi

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step nsa_bench
  # shellcheck disable=SC2086
  timeout 1200 "$build/bench/nsa_bench" ${BENCH_ARGS:-} 2>&1 | tee "$logs/bench.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi
step "done, status $status"
exit $status
