#!/usr/bin/env bash
# One device call: ncu kernel durations of two trees side by side, for a change too small for
# nsa_bench's per-branch columns to resolve (a 15 us kernel change hides in their noise). Builds
# this tree and PREV_TREE (via ab_device.sh, benches only), then alternates the two trees ROUNDS
# times under ncu (no clock lock, no cache flush: as in a training step) on one nsa_bench shape,
# printing the median duration of each matching kernel; then train_bench, alternated too
# (ab_device.sh's loop).
#   PREV_TREE=.prev KERNELS='CmpOnePass|CmpSmemDq' bench/scripts/ab_kernel_times.sh OUT_DIR
# Env: KERNELS (ncu -k regex, required), PREV_TREE (required), ROUNDS [3],
#      NSA_ARGS ["--seqs 2048 --batch 16 --dims 64 --heads 12:2 --reps 5 --warmup 1"],
#      TRAIN_ARGS ["--batches 16 --steps 20 --variants nsa-cuda --cuda-graphs 1"; "skip"]
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?OUT_DIR}
: "${KERNELS:?set KERNELS to an ncu kernel-name regex}" "${PREV_TREE:?set PREV_TREE}"
cd "$root" || exit 1
mkdir -p "$out"
TEST_FILTER=skip NSA_ARGS=skip TRAIN_ARGS=skip timeout 480 bench/scripts/ab_device.sh "$out" \
  > "$out/build_both.log" 2>&1 || { tail -n 30 "$out/build_both.log"; exit 1; }
source scripts/device_env.sh
nsa_args=${NSA_ARGS:-"--seqs 2048 --batch 16 --dims 64 --heads 12:2 --reps 5 --warmup 1"}
train_args=${TRAIN_ARGS:-"--batches 16 --steps 20 --variants nsa-cuda --cuda-graphs 1"}
for r in $(seq "${ROUNDS:-3}"); do
  for tree in prev this; do
    B=/tmp/build; [ "$tree" = prev ] && B=/tmp/build-prev
    # shellcheck disable=SC2086
    timeout 120 ncu --clock-control none --cache-control none -k regex:"$KERNELS" \
      --metrics gpu__time_duration.sum --csv "$B/bench/nsa_bench" $nsa_args > "$out/ncu_${tree}_$r.csv" 2>/dev/null
    python3 - "$out/ncu_${tree}_$r.csv" "$tree" "$r" <<'PY'
import collections, csv, re, statistics, sys
rows = [l for l in open(sys.argv[1], errors="replace") if l.startswith('"')]
us = collections.defaultdict(list)
for r in csv.DictReader(rows):
    if r.get("Metric Name") != "gpu__time_duration.sum":
        continue
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    v = float(r["Metric Value"].replace(",", "")) * scale.get(r.get("Metric Unit", "ns"), 1e-3)
    us[re.sub(r"<.*", "", r["Kernel Name"]).split("::")[-1]].append(v)
print(sys.argv[2], "round", sys.argv[3], "  ".join(
    f"{k}: {statistics.median(v):.1f} us (n={len(v)})" for k, v in sorted(us.items())) or "no kernel matched")
PY
  done
done
[ "$train_args" = skip ] && exit 0
# The step, both trees alternated: ab_device.sh's own loop (its build is now a no-op).
TEST_FILTER=skip NSA_ARGS=skip TRAIN_ARGS="$train_args" ROUNDS=${ROUNDS:-3} timeout 400 \
  bench/scripts/ab_device.sh "$out" | grep -E "^==|nsa-cuda"
