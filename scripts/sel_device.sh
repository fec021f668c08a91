#!/usr/bin/env bash
# Device-side run for the selected-attention work: build + kernels_test (+ memcheck) via
# gpu_check.sh, then selected-only benches under kernel-choice variants (A/B in one run),
# the full NSA tables (default kernels, and the old ones through the knobs), and an ncu
# per-kernel breakdown of the selected branch at the training shape.
set -uo pipefail
out=${1:-$OUT}
B=${BUILD_DIR:-/tmp/build-sel}
BUILD_DIR=$B SKIP_MEMCHECK=${SKIP_MEMCHECK:-1} SKIP_BENCH=1 timeout 400 scripts/gpu_check.sh "$out" || echo "gpu_check status $?"
nb=$B/bench/nsa_bench
[ -x "$nb" ] || exit 1
old="NSAD_SLC_KERNEL=heads,NSAD_SLC_DKDV=old,NSAD_SLC_QPC=64"
variants=${VARIANTS:-"$old default NSAD_SLC_DKDV_VARIANT=r16x3 NSAD_SLC_DKDV_VARIANT=r32x3"}
split() { envs=(); [ "$1" != default ] && IFS=, read -ra envs <<< "$1"; }
for var in $variants; do
  split "$var"
  echo "== slc-only [$var]"
  env "${envs[@]}" timeout 60 $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 10 --warmup 2 2>&1 | tail -1
  env "${envs[@]}" timeout 90 $nb --slc-only 1 --seqs 65536 --dims 64,128 --heads 12:2,64:4 --reps 5 --warmup 1 2>&1 | tail -4
done 2>&1 | tee -a "$out/bench.log"
echo "== slc-only rows forced at 64k"; NSAD_SLC_KERNEL=rows timeout 60 $nb --slc-only 1 --seqs 65536 --dims 64 --heads 12:2 --reps 5 --warmup 1 2>&1 | tail -1 | tee -a "$out/bench.log"
if [ "${FULL:-1}" = 1 ]; then
for var in default $old; do
  split "$var"
  echo "== full B16 T2048 [$var]"; env "${envs[@]}" timeout 60 $nb --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 5 --warmup 1 2>&1 | tail -2 | head -1
  echo "== full B1 [$var]"; env "${envs[@]}" timeout 150 $nb --seqs 2048,65536 --dims 64,128 --heads 12:2,64:4 --reps 3 --warmup 1 2>&1 | tail -9 | head -8
done 2>&1 | tee -a "$out/bench.log"
fi
if [ "${NCU:-1}" = 1 ]; then
echo "== ncu B16 T2048 slc"
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
  $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 1 --warmup 0 > "$out/ncu.log" 2>&1
grep -A6 -E "^  void .*(Selected|DkDv|RowDot|Radix|search)" "$out/ncu.log" | grep -E "^  void|duration" | sed -E 's/\(const .*//; s/\(T[0-9].*//' | cut -c1-110
fi
