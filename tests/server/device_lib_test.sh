#!/usr/bin/env bash
# scripts/device_lib.sh, which every GPU script sources, checked here where no GPU is: the
# daemon start serves and stops cleanly, and a daemon or a build that cannot start fails its
# step with the reason instead of leaving the next command to time out.
#   device_lib_test.sh NSAD_BIN_DIR
set -uo pipefail
bin=${1:?NSAD_BIN_DIR}
root=$(cd "$(dirname "$0")/../.." && pwd)
source "$root/scripts/device_lib.sh"
work=$(mktemp -d)
trap 'device_daemon_stop > /dev/null 2>&1; rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# A daemon that serves: the endpoints file is there when the start returns, and the stop ends
# the process with status 0. Port 0: ctest runs suites in parallel.
export NSAD_LISTEN=127.0.0.1:0 NSAD_METRICS=127.0.0.1:0
if device_daemon_start "$bin" "$work/state" "$work/nsad.log"; then
  [ -f "$work/state/endpoints.json" ] || fail "started, but no endpoints.json"
  pid=$DAEMON_PID
  kill -0 "$pid" 2>/dev/null || fail "started, but nsad ($pid) is not running"
  device_daemon_stop > "$work/stop.txt"  # not in $(...): wait needs the daemon's parent shell
  [ "$(cat "$work/stop.txt")" = "nsad exit 0" ] || fail "stop printed '$(cat "$work/stop.txt")', not 'nsad exit 0'"
  ! kill -0 "$pid" 2>/dev/null || fail "nsad ($pid) still runs after the stop"
  [ -z "${DAEMON_PID:-}" ] || fail "DAEMON_PID still set after the stop"
else
  fail "the daemon did not start: $(tail -n 5 "$work/nsad.log")"
fi

# A daemon that cannot start (no binary): the step fails within its wait and says so.
start=$SECONDS
out=$(device_daemon_start "$work/no-such-dir" "$work/state2" "$work/nsad2.log" 2>&1) && fail "a missing nsad started"
[[ $out == *"DAEMON DID NOT START"* ]] || fail "a missing nsad printed: $out"
[ $((SECONDS - start)) -le 20 ] || fail "a missing nsad took $((SECONDS - start)) s to fail"

# A daemon that exits at once (a bad flag value): the step fails without waiting out 20 s.
start=$SECONDS
out=$(NSAD_LISTEN=not-an-address device_daemon_start "$bin" "$work/state3" "$work/nsad3.log" 2>&1) &&
  fail "nsad with a bad --listen started"
[[ $out == *"DAEMON DID NOT START"* ]] || fail "a bad --listen printed: $out"
[ $((SECONDS - start)) -lt 10 ] || fail "a daemon that exited took $((SECONDS - start)) s to be noticed"

# A build that cannot configure: the step fails, names the source, and shows the log.
mkdir -p "$work/logs"
out=$(CMAKE_PREFIX_PATH='' device_build "$work/no-such-source" "$work/build" "$work/logs" -t nsad 2>&1) &&
  fail "a build of a missing source succeeded"
[[ $out == *"BUILD FAILED ($work/no-such-source)"* ]] || fail "a failed build printed: $out"
[ -s "$work/logs/configure-t.log" ] || fail "no configure log for the failed build"

[ $failures -eq 0 ] && echo "device_lib: all checks passed"
exit $((failures > 0))
