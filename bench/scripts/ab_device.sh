#!/usr/bin/env bash
# One device call for an A/B of kernel variants: build (Release) kernels_test, nsa_bench and
# train_bench; kernels_test on a filter; compute-sanitizer memcheck on a (smaller) filter;
# then nsa_bench and train_bench under each variant's flags, the variants alternated ROUNDS
# times so that drift between calls shows up as spread, not as a difference.
#   bench/scripts/ab_device.sh OUT_DIR
# Env (defaults in brackets):
#   VARIANTS       flag sets separated by ';', passed to both benches ["" : the default dispatch]
#   PREV_TREE      another source tree (e.g. .prev from `git archive HEAD | tar -x -C .prev`,
#                  carried): its benches are built too, and each variant runs on it ("prev")
#                  right before this tree ("this"), for an A/B of two commits in one call [unset]
#   TEST_FILTER    kernels_test --gtest_filter ['*'; "skip" runs none]
#   MEMCHECK_FILTER kernels_test filter under memcheck [skip]
#   SYNCCHECK_FILTER kernels_test filter under synccheck (barrier misuse: named barriers,
#                  warp-specialised kernels) [skip]
# A failing kernels_test or sanitizer run ends the call before the benches: a variant that
# computes wrong values is not worth device time.
#   NSA_ARGS       nsa_bench arguments ["--seqs 2048 --batch 16 --dims 64 --heads 12:2 --reps 10 --warmup 3"; "skip"]
#   TRAIN_ARGS     train_bench arguments ["--batches 16 --steps 20 --variants nsa-cuda --cuda-graphs 1"; "skip"]
#   ROUNDS [2], BUILD_DIR [/tmp/build]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-/tmp/ab-device}}
B=${BUILD_DIR:-/tmp/build}
mkdir -p "$out"
status=0
step() { echo "== $* ($(date +%T))"; }
cd "$root" || exit 1
source scripts/device_env.sh

# kernels_test only where a filter runs it (a bench-only A/B builds in half the time).
targets=(nsa_bench train_bench)
if [ "${TEST_FILTER:-*}" != skip ] || [ -n "${MEMCHECK_FILTER:-}" ] || [ -n "${SYNCCHECK_FILTER:-}" ]; then
  targets+=(kernels_test)
fi
step build
device_build . "$B" "$out" "" "${targets[@]}" || exit 1
trees=("this:$B")
if [ -n "${PREV_TREE:-}" ]; then
  step "build $PREV_TREE"
  device_build "$PREV_TREE" "$B-prev" "$out" -prev nsa_bench train_bench || exit 1
  trees=("prev:$B-prev" "this:$B")
fi

if [ "${TEST_FILTER:-*}" != skip ]; then
  step "kernels_test ${TEST_FILTER:-*}"
  timeout 400 "$B/tests/kernels/kernels_test" --gtest_filter="${TEST_FILTER:-*}" > "$out/kernels_test.log" 2>&1
  rc=$?
  grep -E "^\[  PASSED|^\[  FAILED|Failure|Which is|max \|" "$out/kernels_test.log" | head -30
  [ $rc -eq 0 ] || { echo "kernels_test exit $rc"; status=1; }
fi

if [ -n "${MEMCHECK_FILTER:-}" ]; then
  step "memcheck $MEMCHECK_FILTER"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool memcheck --leak-check no \
    --error-exitcode 9 "$B/tests/kernels/kernels_test" --gtest_filter="$MEMCHECK_FILTER" > "$out/memcheck.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/memcheck.log" | tail -3
  [ $rc -eq 0 ] || { echo "memcheck exit $rc"; status=1; }
fi

if [ -n "${SYNCCHECK_FILTER:-}" ]; then
  step "synccheck $SYNCCHECK_FILTER"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 300 compute-sanitizer --tool synccheck \
    --error-exitcode 9 "$B/tests/kernels/kernels_test" --gtest_filter="$SYNCCHECK_FILTER" > "$out/synccheck.log" 2>&1
  rc=$?
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$out/synccheck.log" | tail -3
  [ $rc -eq 0 ] || { echo "synccheck exit $rc"; status=1; }
fi
[ $status -eq 0 ] || { step "tests failed: no benches"; exit $status; }

IFS=';' read -ra variants <<< "${VARIANTS:-}"
[ ${#variants[@]} -gt 0 ] || variants=("")
nsa_args=${NSA_ARGS:---seqs 2048 --batch 16 --dims 64 --heads 12:2 --reps 10 --warmup 3}
train_args=${TRAIN_ARGS:---batches 16 --steps 20 --variants nsa-cuda --cuda-graphs 1}
for round in $(seq "${ROUNDS:-2}"); do
  for var in "${variants[@]}"; do
    for tree in "${trees[@]}"; do
      name=${tree%%:*} dir=${tree#*:}
      if [ "$nsa_args" != skip ]; then
        step "round $round nsa_bench [${var:-default}] $name"
        # shellcheck disable=SC2086
        timeout 240 "$dir/bench/nsa_bench" $nsa_args $var > "$out/nsa_bench.log.tmp" 2>&1 || status=1
        grep -E "^#.*(MMAs|forward|kernels)|^ *seq|^ *[0-9]|^ *layer" "$out/nsa_bench.log.tmp" | grep -v ceilings
        cat "$out/nsa_bench.log.tmp" >> "$out/nsa_bench.log"
      fi
      if [ "$train_args" != skip ]; then
        step "round $round train_bench [${var:-default}] $name"
        # shellcheck disable=SC2086
        timeout 240 "$dir/bench/train/train_bench" $train_args $var > "$out/train_bench.log.tmp" 2>&1 || status=1
        tail -n 3 "$out/train_bench.log.tmp"
        cat "$out/train_bench.log.tmp" >> "$out/train_bench.log"
      fi
    done
  done
done
rm -f "$out"/*.tmp
step "done, status $status"
exit $status
