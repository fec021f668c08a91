# shellcheck shell=bash
# Sourced through scripts/device_env.sh by the GPU scripts: the build and daemon steps they all
# take, so a flag or a wait changes in one place. Needs CMAKE_PREFIX_PATH (device_env.sh sets it).

# device_build SRC BUILD_DIR LOG_DIR TAG TARGET...: configures SRC (Ninja, Release, benches on)
# into BUILD_DIR and builds the targets, logging to LOG_DIR/configure$TAG.log and
# LOG_DIR/build$TAG.log. On failure prints the logs' tails and "BUILD FAILED (SRC)", returns 1.
# The build's timeout (BUILD_TIMEOUT, 480 s) leaves a 600 s device call time to report.
device_build() {
  local src=$1 dir=$2 logs=$3 tag=$4
  shift 4
  if cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DNSAD_BUILD_BENCH=ON \
       -DCMAKE_PREFIX_PATH="$CMAKE_PREFIX_PATH" > "$logs/configure$tag.log" 2>&1 &&
     timeout "${BUILD_TIMEOUT:-480}" cmake --build "$dir" -j "$(nproc)" --target "$@" \
       > "$logs/build$tag.log" 2>&1; then
    return 0
  fi
  tail -n 30 "$logs/configure$tag.log" "$logs/build$tag.log" 2>/dev/null
  echo "BUILD FAILED ($src)"
  return 1
}

# device_daemon_start BIN_DIR STATE_DIR LOG: nsad from BIN_DIR on 127.0.0.1:50051 (metrics on
# :9464; NSAD_LISTEN / NSAD_METRICS override them, port 0 picks a free one) with STATE_DIR,
# its output in LOG; waits up to 20 s for the endpoints file it writes once it serves. Sets
# DAEMON_PID. Returns 1 (log tail printed, daemon stopped) if it never serves.
device_daemon_start() {
  local bin=$1 state=$2 log=$3
  "$bin/nsad" --listen "${NSAD_LISTEN:-127.0.0.1:50051}" --metrics "${NSAD_METRICS:-127.0.0.1:9464}" \
    --state-dir "$state" > "$log" 2>&1 &
  DAEMON_PID=$!
  for _ in $(seq 100); do
    [ -f "$state/endpoints.json" ] && return 0
    kill -0 "$DAEMON_PID" 2>/dev/null || break
    sleep 0.2
  done
  tail -n 20 "$log"
  echo "DAEMON DID NOT START ($state)"
  device_daemon_stop
  return 1
}

# device_daemon_stop: stops the daemon device_daemon_start started (SIGTERM: it halts its runs
# and exits) and prints its exit status.
device_daemon_stop() {
  [ -n "${DAEMON_PID:-}" ] || return 0
  kill "$DAEMON_PID" 2>/dev/null
  wait "$DAEMON_PID"
  echo "nsad exit $?"
  DAEMON_PID=
}
