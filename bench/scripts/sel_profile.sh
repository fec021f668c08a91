#!/usr/bin/env bash
# ncu details (speed of light, stalls, occupancy, hottest source lines) of the selected
# kernels at the training shape, default kernel choice. Needs a built nsa_bench in $BUILD_DIR
# (bench/scripts/sel_device.sh builds one). Usage: bench/scripts/sel_profile.sh OUT_DIR
set -uo pipefail
out=${1:-$OUT}
nb=${BUILD_DIR:-/tmp/build-sel}/bench/nsa_bench
timeout 240 ncu --clock-control none -k regex:"SelectedDkDvStaged|SelectedRowsMma" -c 3 \
  --section SpeedOfLight --section WarpStateStats --section Occupancy --section ComputeWorkloadAnalysis \
  --section InstructionStats --section SourceCounters --section MemoryWorkloadAnalysis \
  $nb --slc-only 1 --batch 16 --seqs 2048 --dims 64 --heads 12:2 --reps 1 --warmup 0 > "$out/ncu_detail.log" 2>&1
grep -E "^  [a-zA-Z].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Achieved Occupancy|Theoretical Occupancy|Stall|Executed Ipc|Warp Cycles Per Issued|L1/TEX Hit|L2 Hit|Block Limit Reg|Registers Per" "$out/ncu_detail.log" | sed -E 's/\(const .*//' | cut -c1-150 | head -120
