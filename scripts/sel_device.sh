#!/usr/bin/env bash
# Device-side run for the selected-attention work: build + kernels_test (+ memcheck) via
# gpu_check.sh, then selected-only benches under kernel-choice variants (A/B in one run),
# the full NSA tables, and an ncu per-kernel breakdown of the selected branch.
set -uo pipefail
out=${1:-$OUT}
B=${BUILD_DIR:-/tmp/build-sel}
BUILD_DIR=$B SKIP_MEMCHECK=${SKIP_MEMCHECK:-1} SKIP_BENCH=1 timeout 400 scripts/gpu_check.sh "$out" || echo "gpu_check status $?"
nb=$B/bench/nsa_bench
[ -x "$nb" ] || exit 1
variants=${VARIANTS:-"NSAD_SLC_KERNEL=heads,NSAD_SLC_DKDV=old default NSAD_SLC_QPC=128 NSAD_SLC_QPC=256"}
for var in $variants; do
  envs=(); [ "$var" != default ] && IFS=, read -ra envs <<< "$var"
  echo "== slc-only [$var]"
  env "${envs[@]}" timeout 60 $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 10 --warmup 2 2>&1 | tail -1
  env "${envs[@]}" timeout 90 $nb --slc-only 1 --seqs 65536 --dims 64,128 --heads 12:2,64:4 --reps 5 --warmup 1 2>&1 | tail -4
done 2>&1 | tee -a "$out/bench.log"
if [ "${FULL:-1}" = 1 ]; then
echo "== full B1"; timeout 120 $nb --seqs 2048,65536 --dims 64 --heads 12:2 --reps 5 --warmup 1 2>&1 | tee -a "$out/bench.log"
echo "== full B16 T2048"; timeout 60 $nb --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 5 --warmup 1 2>&1 | tee -a "$out/bench.log"
fi
if [ "${NCU:-1}" = 1 ]; then
echo "== ncu B16 T2048 slc"
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
  $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 1 --warmup 0 > "$out/ncu.log" 2>&1
grep -A6 -E "^  void .*(Selected|DkDv|RowDot)" "$out/ncu.log" | grep -E "^  void|duration" | sed -E 's/\(const .*//' | cut -c1-120
fi
