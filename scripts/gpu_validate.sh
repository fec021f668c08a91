#!/usr/bin/env bash
# Validates the whole system on a GPU machine in one go (the device tool's single call):
#   build (Release) -> GPU tests (backend selection, CUDA vs reference losses, trainer,
#   kernels) -> compute-sanitizer memcheck on full training steps of a small NSA model with
#   the CUDA backend -> the daemon training m7c 125M (seq 2048, bf16) through nsactl, with
#   its /metrics scraped -> train_bench (m7c tok/s, NSA vs dense flash, batch 1 and 16).
# Logs go to $1, else $OUT, else /tmp/nsa-gpu-validate. On the lent machine carry
# .device-deps and .kernel-deps (see scripts/gpu_check.sh).
#   scripts/gpu_validate.sh [LOG_DIR]    env: SKIP_MEMCHECK=1, SKIP_BENCH=1, M7C_STEPS=30,
#                                        BENCH_ARGS="--torch-optim 1 --variants nsa-cuda" (train_bench),
#                                        GPU_TESTS="runtime/backend_test engine/trainer_test"
#                                        (paths under the build's tests/, each built first),
#                                        MEMCHECK_FILTER="*CudaGraph*" (backend_test cases),
#                                        MEMCHECK_NO_CACHING=0 (keep the caching allocator),
#                                        NSA_BENCH_ARGS="--seqs 65536 --reps 3" (also run the
#                                        kernel table, bench/nsa_bench.cc; unset: skipped)
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-/tmp/nsa-gpu-validate}}
build=${BUILD_DIR:-/tmp/build}
mkdir -p "$logs"
status=0
step() { echo "== $* ($(date +%T))"; }
record() { "$@" || { echo "FAILED: $*"; status=1; }; }

source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$logs/gpu.txt"

step build
gpu_tests=${GPU_TESTS:-runtime/backend_test engine/trainer_test kernels/kernels_test}
# backend_test for the memcheck; every test GPU_TESTS names is built too (nsa/nsa_tests was not).
targets="nsad nsad-worker nsactl nsa-shard backend_test train_bench nsa_bench"
for t in $gpu_tests; do targets="$targets $(basename "$t")"; done
device_build . "$build" "$logs" "" $targets || exit 1

step "GPU tests"
for t in $gpu_tests; do
  timeout 300 "$build/tests/$t" > "$logs/$(basename $t).log" 2>&1
  rc=$?
  echo "$t: exit $rc, $(grep -E '^\[  PASSED|^\[  FAILED|SKIPPED \] [0-9]' "$logs/$(basename $t).log" | tr '\n' ' ')"
  grep -E "Failure|Expected|Which is|actual" "$logs/$(basename $t).log" | head -10
  [ $rc -eq 0 ] || status=1
done

if [ "${SKIP_MEMCHECK:-0}" != 1 ]; then
  step "memcheck: full training steps, CUDA backend"
  # Without the caching allocator memcheck sees every allocation's bounds; CUDA graphs need
  # it, so MEMCHECK_NO_CACHING=0 (with MEMCHECK_FILTER="*CudaGraph*") checks the replays.
  caching=(PYTORCH_NO_CUDA_MEMORY_CACHING=1)
  [ "${MEMCHECK_NO_CACHING:-1}" = 1 ] || caching=()
  env "${caching[@]}" timeout 300 compute-sanitizer --tool memcheck --leak-check no \
    --error-exitcode 9 "$build/tests/runtime/backend_test" --gtest_filter="${MEMCHECK_FILTER:-*CudaBackendRunsOnlyTheKernels*}" \
    > "$logs/memcheck.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$logs/memcheck.log" | tail -3
  [ $rc -eq 0 ] || { echo "memcheck exit code $rc"; status=1; }
fi

step "daemon: m7c 125M on the GPU through nsactl"
state=/tmp/nsad-gpu-state; rm -rf "$state"
scripts/m7c_random_config.sh "$state" "${M7C_STEPS:-30}"
device_daemon_start "$build/bin" "$state" "$logs/nsad.log" || status=1
cat "$state/endpoints.json"
timeout 300 "$build/bin/nsactl" start --config "$state/m7c.json" --watch 2>&1 | tail -5 | tee "$logs/m7c_watch.log"
record "$build/bin/nsactl" status run-000001
"$build/bin/nsactl" throughput run-000001
"$build/bin/nsactl" gates run-000001 | head -6
env -u LD_LIBRARY_PATH curl -s -m 5 http://127.0.0.1:9464/metrics > "$logs/metrics.txt" && grep -E '^nsad_run_(tokens_per_second|step|loss)' "$logs/metrics.txt" | head -5 || { echo "metrics scrape FAILED"; status=1; }
device_daemon_stop
cp "$state"/runs/*/worker.log "$logs/" 2>/dev/null

if [ "${SKIP_BENCH:-0}" != 1 ]; then
  step "train_bench"
  timeout 300 "$build/bench/train/train_bench" --batches 1,16 --steps 15 ${BENCH_ARGS:-} 2>&1 | tee "$logs/train_bench.log"
fi
if [ -n "${NSA_BENCH_ARGS:-}" ]; then
  step "nsa_bench (kernel table)"
  timeout 300 "$build/bench/nsa_bench" $NSA_BENCH_ARGS 2>&1 | tee "$logs/nsa_bench.log"
fi
echo "== done, status $status"
exit $status
