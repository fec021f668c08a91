#!/usr/bin/env bash
# Device-side run for the selected-attention work: build + kernels_test (+ memcheck) via
# scripts/gpu_check.sh, then selected-only benches under kernel choices (A/B in one binary,
# nsa_bench --slc-fwd/--slc-dkdv/--slc-qpc), the full NSA tables (default kernels, and the
# old ones forced by the same flags), and an ncu per-kernel breakdown of the selected branch
# at the training shape.
#   bench/scripts/sel_device.sh OUT_DIR   (BUILD_DIR, SKIP_MEMCHECK, FULL=0|1, NCU=0|1,
#                                          VARIANTS='flags;flags;...', NCU_FLAGS='nsa_bench flags'
#                                          override the defaults)
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-$OUT}
B=${BUILD_DIR:-/tmp/build-sel}
BUILD_DIR=$B SKIP_MEMCHECK=${SKIP_MEMCHECK:-1} SKIP_BENCH=1 timeout 400 "$root/scripts/gpu_check.sh" "$out" || echo "gpu_check status $?"
nb=$B/bench/nsa_bench
[ -x "$nb" ] || exit 1
# "old": the kernels before the selected-branch work (per-position forward/dQ, unstaged
# dK/dV, 64 queries per work item). staged* register budgets are D=64 builds.
old="--slc-fwd heads --slc-dkdv unstaged --slc-qpc 64"
IFS=';' read -ra variants <<< "${VARIANTS:-$old;;--slc-dkdv staged16x3;--slc-dkdv staged32x1}"
for var in "${variants[@]}"; do
  echo "== slc-only [${var:-default}]"
  timeout 60 $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 10 --warmup 2 $var 2>&1 | tail -1
  if [[ $var == *staged[0-9]* || $var == *fused* ]]; then  # D=64 builds
    timeout 90 $nb --slc-only 1 --seqs 65536 --dims 64 --heads 12:2,64:4 --reps 5 --warmup 1 $var 2>&1 | tail -2
  else
    timeout 90 $nb --slc-only 1 --seqs 65536 --dims 64,128 --heads 12:2,64:4 --reps 5 --warmup 1 $var 2>&1 | tail -4
  fi
done 2>&1 | tee -a "$out/bench.log"
echo "== slc-only rows forced at 64k"; timeout 60 $nb --slc-only 1 --seqs 65536 --dims 64 --heads 12:2 --reps 5 --warmup 1 --slc-fwd rows 2>&1 | tail -1 | tee -a "$out/bench.log"
if [ "${FULL:-1}" = 1 ]; then
for var in "" "$old"; do
  echo "== full B16 T2048 [${var:-default}]"; timeout 60 $nb --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 5 --warmup 1 $var 2>&1 | tail -2 | head -1
  echo "== full B1 [${var:-default}]"; timeout 150 $nb --seqs 2048,65536 --dims 64,128 --heads 12:2,64:4 --reps 3 --warmup 1 $var 2>&1 | tail -9 | head -8
done 2>&1 | tee -a "$out/bench.log"
fi
if [ "${NCU:-1}" = 1 ]; then
echo "== ncu B16 T2048 slc"
timeout 120 ncu --clock-control none --metrics gpu__time_duration.sum --print-summary per-kernel \
  $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 1 --warmup 0 ${NCU_FLAGS:-} > "$out/ncu.log" 2>&1
grep -A6 -E "^  void .*(Selected|DkDv|RowDot|Radix|search)" "$out/ncu.log" | grep -E "^  void|duration" | sed -E 's/\(const .*//; s/\(T[0-9].*//' | cut -c1-110
fi
