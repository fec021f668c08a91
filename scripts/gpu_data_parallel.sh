#!/usr/bin/env bash
# Data parallelism on a machine with two or more GPUs, in one go (the device tool's single call
# on a two-GPU kind: nvidia-h100-x2, nvidia-h200-x2): build (Release) -> the multi-GPU tests
# (two workers train as one with their batches together; a dead worker fails its run; a halt
# ends a step hung in its all-reduce; a model too large for the GPUs is refused; runs with
# device auto spread over the GPUs; the kernels run on the second GPU) -> the
# daemon training m7c 125M (seq 2048, bf16, batch 16 per GPU) through nsactl on WORLD_SIZES
# workers in turn, eager steps, then again with CUDA graphs, each run's throughput printed by
# nsactl.
# Logs go to $1, else $OUT, else /tmp/nsa-gpu-dp. Carry .device-deps and .kernel-deps.
#   scripts/gpu_data_parallel.sh [LOG_DIR]   env: M7C_STEPS=40, WORLD_SIZES="2 1",
#   DAEMON_TEST_FILTER (default: the multi-GPU tests; '*' for all of daemon_test)
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${1:-${OUT:-/tmp/nsa-gpu-dp}}
build=${BUILD_DIR:-/tmp/build}
mkdir -p "$logs"
status=0
step() { echo "== $* ($(date +%T))"; }

source scripts/device_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$logs/gpu.txt"
nvidia-smi topo -m | head -4

step build
targets="nsad nsad-worker nsactl trainer_test daemon_test backend_test"
device_build . "$build" "$logs" "" $targets || exit 1
grep -E "c10d NCCL" "$logs/configure.log"

step "multi-GPU tests"
run_test() {  # binary filter
  timeout 300 "$build/tests/$1" --gtest_filter="$2" > "$logs/$(basename $1).log" 2>&1
  local rc=$?
  echo "$1: exit $rc, $(grep -E '^\[  PASSED|^\[  FAILED|SKIPPED \] [0-9]' "$logs/$(basename $1).log" | tr '\n' ' ')"
  grep -E "Failure|Expected|Which is|actual|needs two" "$logs/$(basename $1).log" | head -10
  [ $rc -eq 0 ] || status=1
}
run_test server/daemon_test "${DAEMON_TEST_FILTER:-*TwoGpu*:*DeadWorker*:*DataParallelStepHung*:*WorkerCrash*:*BadConfigs*:*TooLarge*:*GpusTheFewest*:*DataParallelAutoRun*}"
run_test engine/trainer_test "*DataParallel*:*Cuda*:*Graph*:*PlacedOn*"
run_test runtime/backend_test "*SecondGpu*"

step "daemon: m7c 125M, batch 16 per GPU, through nsactl"
state=/tmp/nsad-gpu-dp-state; rm -rf "$state"
scripts/m7c_random_config.sh "$state" "${M7C_STEPS:-40}"
device_daemon_start "$build/bin" "$state" "$logs/nsad.log" || exit 1
n=0
train() {  # label jq-free sed edits of m7c.json
  local label=$1; shift
  n=$((n + 1)); local id=$(printf 'run-%06d' $n)
  sed -e "" "$@" "$state/m7c.json" > "$state/$label.json"
  echo "-- $label ($id)"
  timeout 300 "$build/bin/nsactl" start --config "$state/$label.json" --watch > "$logs/$label.watch.log" 2>&1
  tail -3 "$logs/$label.watch.log"
  "$build/bin/nsactl" status "$id" | head -8
  "$build/bin/nsactl" throughput "$id"
}
for w in ${WORLD_SIZES:-2 1}; do
  train "world$w-eager" -e 's#"cuda_graphs": true#"cuda_graphs": false#' \
                        -e "s#\"grad_accum\": 1,#\"grad_accum\": 1, \"world_size\": $w,#"
done
for w in ${WORLD_SIZES:-2 1}; do
  train "world$w-graph" -e "s#\"grad_accum\": 1,#\"grad_accum\": 1, \"world_size\": $w,#"
done
device_daemon_stop
cp -r "$state/runs" "$logs/runs" 2>/dev/null; find "$logs/runs" -name '*.pt' -delete 2>/dev/null
rm -rf "$logs/runs"/*/checkpoints
echo "== done, status $status"
exit $status
