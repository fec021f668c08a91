#!/usr/bin/env bash
# README command 1: install everything, build, start the nsad daemon, and train a small NSA
# model on the embedded default dataset (byte-level text of Debian's `fortunes`) through
# nsactl, showing live progress until the run finishes. Then the daemon is stopped
# (NSAD_KEEP_DAEMON=1 leaves it running for more nsactl commands).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
scripts/build.sh nsad nsad-worker nsactl nsa-shard
BUILD=${NSAD_BUILD_DIR:-build}
STATE=${NSAD_STATE_DIR:-.state/demo}
CONFIG=${NSAD_DEMO_CONFIG:-configs/demo.json}
ADDR=${NSAD_ADDR:-127.0.0.1:50051}
export NSAD_ADDR=$ADDR

scripts/make_default_dataset.sh data/fortunes "$BUILD"

mkdir -p "$STATE"
if ! "$BUILD/bin/nsactl" --timeout 2 list >/dev/null 2>&1; then
  echo "[demo] starting nsad on $ADDR (log: $STATE/nsad.log, metrics: http://127.0.0.1:9464/metrics)"
  rm -f "$STATE/endpoints.json"
  nohup "$BUILD/bin/nsad" --listen "$ADDR" --metrics 127.0.0.1:9464 --state-dir "$STATE" \
      > "$STATE/nsad.log" 2>&1 &
  daemon_pid=$!
  if [ "${NSAD_KEEP_DAEMON:-0}" != 1 ]; then
    trap 'kill $daemon_pid 2>/dev/null; wait $daemon_pid 2>/dev/null || true' EXIT
  fi
  for _ in $(seq 1 300); do [ -f "$STATE/endpoints.json" ] && break; sleep 0.1; done
  [ -f "$STATE/endpoints.json" ] || { echo "nsad did not start; see $STATE/nsad.log" >&2; exit 1; }
else
  echo "[demo] using the nsad already serving $ADDR"
fi

echo "[demo] nsactl start --config $CONFIG --watch"
"$BUILD/bin/nsactl" start --config "$CONFIG" --watch
run_id=$("$BUILD/bin/nsactl" --json list | sed -n 's/.*"run_id": *"\([^"]*\)".*/\1/p' | tail -1)
echo
"$BUILD/bin/nsactl" status "$run_id"
echo
"$BUILD/bin/nsactl" gates "$run_id"
