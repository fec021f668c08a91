#!/usr/bin/env bash
# Per-kernel GPU times (ncu, gpu__time_duration) of one NSA attention layer forward+backward
# at 64k (batch 1) and at the training shape (batch 16, T=2048), D=64, GQA 12:2, plus ncu
# details (speed of light, stalls, occupancy) of the kernels named by DETAIL_KERNELS at 64k.
#   bench/scripts/kernel_times.sh OUT_DIR   (BUILD_DIR, SKIP_BUILD=1, DETAIL_KERNELS=regex,
#                                            DETAIL_SHAPE='nsa_bench shape flags' (64k),
#                                            BENCH_FLAGS='extra nsa_bench flags')
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$OUT}
B=${BUILD_DIR:-/tmp/build-prof}
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  BUILD_DIR=$B SKIP_TESTS=1 SKIP_MEMCHECK=1 SKIP_BENCH=1 timeout 400 "$root/scripts/gpu_check.sh" "$out" || exit 1
fi
nb=$B/bench/nsa_bench
# One line per kernel: ms per launch (average over its launches), short name.
summarize() {
  awk '/^  [a-zA-Z].*\(/ { name=$0; gsub(/nsad::nsa::cuda::detail::|\(anonymous namespace\)::|at::native::|c10::/, "", name)
                           sub(/\(.*/, "", name); sub(/^ +/, "", name); sub(/^void /, "", name) }
       /gpu__time_duration.sum/ { unit=$2; v=$NF; gsub(/,/, "", v)
                                  if (unit ~ /^u/) v/=1000; else if (unit ~ /^n/) v/=1e6; else if (unit ~ /^s/) v*=1000;
                                  printf "%9.3f ms  %s\n", v, substr(name, 1, 120) }' "$1"
}
for shape in "--seqs 65536 --batch 1" "--seqs 2048 --batch 16"; do
  tag=$(echo "$shape" | tr -d ' -' | cut -c1-20)
  # shellcheck disable=SC2086
  timeout 240 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
    $nb $shape --dims 64 --heads 12:2 --reps 1 --warmup 0 ${BENCH_FLAGS:-} > "$out/ncu_$tag.log" 2>&1
  echo "== per-kernel ($shape, D64 12:2, one fwd+bwd of NSA and the dense baselines)"
  summarize "$out/ncu_$tag.log" | tee "$out/kernels_$tag.txt"
done
if [ -n "${DETAIL_KERNELS:-}" ]; then
  shape=${DETAIL_SHAPE:---seqs 65536 --dims 64 --heads 12:2}
  echo "== ncu details ($shape): $DETAIL_KERNELS"
  # shellcheck disable=SC2086
  timeout 240 ncu --clock-control none -k regex:"$DETAIL_KERNELS" -c 6 \
    --section SpeedOfLight --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
    --section MemoryWorkloadAnalysis \
    $nb $shape --reps 1 --warmup 0 ${BENCH_FLAGS:-} > "$out/ncu_detail.log" 2>&1
  grep -E "^  [a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Stall|Executed Ipc|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Block Limit|Registers Per|Shared Memory Configuration|Dynamic Shared" \
    "$out/ncu_detail.log" | sed -E 's/\(const .*//; s/\(T[0-9].*//' | cut -c1-150 | head -150
fi
