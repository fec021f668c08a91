#!/usr/bin/env bash
# One device call: where an m7c training step's kernel time goes. Builds train_bench (Release),
# runs its graph step (batch 16, the figure the kernels add up to), then one steady eager step
# under ncu (no clock lock, no cache flush: as in training) and sums each kernel per step
# (bench/scripts/step_kernels.py). With PREV_TREE (e.g. .prev from `git archive HEAD`,
# carried) the same for that tree first, and the per-kernel change between the two.
#   [PREV_TREE=.prev] bench/scripts/step_kernels.sh OUT_DIR
# Env: BUILD_DIR [/tmp/build], TOP [60] (lines printed)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:?OUT_DIR}
B=${BUILD_DIR:-/tmp/build}
mkdir -p "$out"
cd "$root" || exit 1
source scripts/device_env.sh
trees=("this:.:$B")
[ -n "${PREV_TREE:-}" ] && trees=("prev:$PREV_TREE:$B-prev" "this:.:$B")
for t in "${trees[@]}"; do
  IFS=: read -r tag src dir <<< "$t"
  echo "== build $tag ($(date +%T))"
  device_build "$src" "$dir" "$out" "-$tag" train_bench || exit 1
done
for t in "${trees[@]}"; do
  IFS=: read -r tag src dir <<< "$t"
  echo "== $tag: graph step, then ncu of one eager step ($(date +%T))"
  timeout 120 "$dir/bench/train/train_bench" --batches 16 --steps 20 --variants nsa-cuda --cuda-graphs 1 | tail -1
  # train_bench --steps 1 runs 3 warm-up steps and the timed one: 4 steps in the log.
  timeout 300 ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
    "$dir/bench/train/train_bench" --batches 16 --steps 1 --cuda-graphs 0 --variants nsa-cuda \
    > "$out/ncu-$tag.csv" 2> "$out/ncu-$tag.err" || { tail -n 5 "$out/ncu-$tag.err"; echo "NCU FAILED ($tag)"; exit 1; }
done
if [ -n "${PREV_TREE:-}" ]; then
  python3 bench/scripts/step_kernels.py "$out/ncu-this.csv" "$out/ncu-prev.csv" --steps 4 --top "${TOP:-60}"
else
  python3 bench/scripts/step_kernels.py "$out/ncu-this.csv" --steps 4 --top "${TOP:-60}"
fi
echo "== done ($(date +%T))"
