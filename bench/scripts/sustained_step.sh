#!/usr/bin/env bash
# The m7c training step over a long run, with the GPU's SM clock, power and power-cap state
# logged beside it (one device call). A 20-40 step benchmark runs partly at the boost clock; an
# H100 at 700 W settles below it within seconds of a full-width step, so what a long run
# sustains is what this measures: train_bench's NSA and dense-flash graph steps and, unless
# DAEMON=0, m7c trained through nsad and nsactl, alternated ROUNDS times, each with the median
# SM clock, power and the share of samples nvidia-smi marks as held by the software power cap.
#   bench/scripts/sustained_step.sh OUT_DIR
# Env: STEPS [120] per run, ROUNDS [2], DAEMON [1], BUILD_DIR [/tmp/build].
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
out=${1:-${OUT:-/tmp/sustained}}
B=${BUILD_DIR:-/tmp/build}
steps=${STEPS:-120}
mkdir -p "$out"
cd "$root" || exit 1
source scripts/device_env.sh

targets=(train_bench)
[ "${DAEMON:-1}" = 0 ] || targets+=(nsad nsad-worker nsactl)
echo "== build ${targets[*]} ($(date +%T))"
device_build . "$B" "$out" "" "${targets[@]}" || exit 1

if [ "${DAEMON:-1}" != 0 ]; then
  state=/tmp/sustained-state; rm -rf "$state"
  scripts/m7c_random_config.sh "$state" "$steps" > /dev/null
  sed -i 's#"log_every": [0-9]*#"log_every": 1#' "$state/m7c.json"
  device_daemon_start "$B/bin" "$state" "$out/nsad.log" || exit 1
fi

fields=timestamp,clocks.sm,power.draw,power.limit,temperature.gpu,clocks_event_reasons.sw_power_cap
# Drivers before the "event reasons" names call the power-cap field a throttle reason.
nvidia-smi --query-gpu=$fields --format=csv > /dev/null 2>&1 || fields=${fields/event/throttle}
nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 250 > "$out/gpu.csv" &
smi=$!
: > "$out/runs.txt"
run() {  # name, log, command...
  local name=$1 log=$2; shift 2
  local t0; t0=$(date +%s.%N)
  timeout 300 "$@" > "$log" 2>&1
  echo "$name $t0 $(date +%s.%N) $log" >> "$out/runs.txt"
}
for r in $(seq "${ROUNDS:-2}"); do
  echo "== round $r ($(date +%T))"
  for v in nsa-cuda dense-flash; do
    run "train_bench:$v" "$out/train_$v$r.log" "$B/bench/train/train_bench" --batches 16 --steps "$steps" \
      --variants "$v" --cuda-graphs 1 --spread 1
  done
  if [ "${DAEMON:-1}" != 0 ]; then
    run daemon "$out/watch$r.log" "$B/bin/nsactl" start --config "$state/m7c.json" --watch
  fi
done
kill $smi
device_daemon_stop

python3 - "$out" "$steps" <<'PY'
import re, statistics as st, sys
from datetime import datetime
out, steps = sys.argv[1], int(sys.argv[2])
gpu = []
for line in open(f"{out}/gpu.csv"):
    f = [x.strip() for x in line.split(",")]
    try:
        t = datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        gpu.append((t, float(f[1]), float(f[2]), float(f[3]), float(f[4]), f[5] == "Active"))
    except (ValueError, IndexError):
        continue
print(f"{'run':<22} {'step ms (median)':>16} {'tok/s':>8} {'SM MHz':>7} {'W':>6} {'capped':>7} {'max C':>6}")
for line in open(f"{out}/runs.txt"):
    name, t0, t1, log = line.split()
    text = open(log).read()
    if name == "daemon":
        ms = [16 * 2048 / float(m.group(2)) * 1e3 for m in
              re.finditer(r"step (\d+)/\d+\s+loss \S+\s+tok/s (\d+)", text) if int(m.group(1)) > 20]
        step = st.median(ms) if ms else float("nan")
    else:
        m = re.search(r"\+graph\s+\d+\s+\d+\s+([\d.]+)", text)
        step = float(m.group(1)) if m else float("nan")
    # Samples while the run's GPU work runs: above half the power limit (start-up, compile and
    # teardown draw far less).
    busy = [g for g in gpu if float(t0) <= g[0] <= float(t1) and g[2] > 0.5 * g[3]]
    if not busy:
        print(f"{name:<22} {step:16.2f}  (no busy GPU samples)")
        continue
    print(f"{name:<22} {step:16.2f} {16 * 2048 / step * 1e3:8.0f} {st.median(g[1] for g in busy):7.0f} "
          f"{st.median(g[2] for g in busy):6.0f} {sum(g[5] for g in busy) / len(busy):7.0%} "
          f"{max(g[4] for g in busy):6.0f}")
PY
