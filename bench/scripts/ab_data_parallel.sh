#!/usr/bin/env bash
# A/B of two trees' data-parallel training step on a machine with two or more GPUs, in one
# device call (a two-GPU kind: nvidia-h100-x2, nvidia-h200-x2): builds this tree and PREV_TREE
# at once (Release: nsad, nsad-worker, nsactl; daemon_test for this tree), runs this tree's
# multi-GPU daemon tests, then trains m7c 125M (seq 2048, bf16, batch 16 per GPU, random tokens)
# through nsactl on WORLD_SIZE workers, a fresh daemon per run, the trees alternated ROUNDS
# times so that drift shows up as spread. Each run prints nsactl's tok/s lines and its last step
# time.
#   PREV_TREE=.prev bench/scripts/ab_data_parallel.sh OUT_DIR
# Env: PREV_TREE (required; e.g. `git archive HEAD | tar -x -C .prev`, carried), M7C_STEPS
# [20], ROUNDS [2], WORLD_SIZE [2], GRAPHS [true], TEST_FILTER [*TwoGpu*:*DeadWorker*; skip].
# Carry .device-deps and .kernel-deps.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${1:-${OUT:-/tmp/ab-data-parallel}}
prev=${PREV_TREE:?PREV_TREE names the other tree}
mkdir -p "$out"
status=0
step() { echo "== $* ($(date +%T))"; }
source scripts/device_env.sh

step "build this tree and $prev"
device_build "$prev" /tmp/ab-dp-prev "$out" -prev nsad nsad-worker nsactl &
prev_build=$!
device_build . /tmp/ab-dp-this "$out" "" nsad nsad-worker nsactl daemon_test || exit 1
wait $prev_build || exit 1

if [ "${TEST_FILTER:-}" != skip ]; then
  step "daemon_test ${TEST_FILTER:-*TwoGpu*:*DeadWorker*}"
  timeout 300 /tmp/ab-dp-this/tests/server/daemon_test --gtest_filter="${TEST_FILTER:-*TwoGpu*:*DeadWorker*}" \
    > "$out/daemon_test.log" 2>&1 || status=1
  grep -E "^\[  PASSED|^\[  FAILED|SKIPPED \] [0-9]|Failure|Which is" "$out/daemon_test.log" | head -12
fi

state=/tmp/ab-dp-state
rm -rf "$state"
scripts/m7c_random_config.sh "$state" "${M7C_STEPS:-20}"
sed -e "s#\"grad_accum\": 1,#\"grad_accum\": 1, \"world_size\": ${WORLD_SIZE:-2},#" \
    -e "s#\"cuda_graphs\": true#\"cuda_graphs\": ${GRAPHS:-true}#" "$state/m7c.json" > "$state/run.json"
for round in $(seq "${ROUNDS:-2}"); do
  for tree in prev this; do
    step "round $round: $tree, world_size ${WORLD_SIZE:-2}, cuda_graphs ${GRAPHS:-true}"
    bin=/tmp/ab-dp-$tree/bin
    daemon_state=$state/daemon-$round-$tree  # a fresh daemon: its first run is run-000001
    device_daemon_start "$bin" "$daemon_state" "$out/nsad-$tree.log" || { status=1; continue; }
    timeout 300 "$bin/nsactl" start --config "$state/run.json" --watch > "$out/watch.log" 2>&1 || status=1
    grep -E "^step" "$out/watch.log" | tail -3
    "$bin/nsactl" throughput run-000001 | tail -1
    device_daemon_stop
  done
done
echo "== done, status $status"
exit $status
