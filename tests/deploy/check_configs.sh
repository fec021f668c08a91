#!/usr/bin/env bash
# Validates deploy/ with the real tools where they are installed:
#   promtool (Debian package `prometheus`): prometheus.yml, alerts.yml, and the alert unit
#     tests in alerts_test.yml;
#   amtool (`prometheus-alertmanager`): alertmanager.yml;
#   systemd-analyze: the unit file (a missing /usr/local/bin/nsad is expected and ignored).
# Any invalid file fails the script. When none of the tools exists it exits 77, which ctest
# reports as skipped (SKIP_RETURN_CODE) instead of pretending the files were checked.
#
# Usage: check_configs.sh [DEPLOY_DIR]   (default: deploy/ next to this script's tests/)
set -euo pipefail

deploy_dir=${1:-$(cd "$(dirname "$0")/../../deploy" && pwd)}
checked=0
failed=0

run_check() {  # run_check DESCRIPTION COMMAND...
  local description=$1
  shift
  echo "== ${description}"
  if "$@"; then
    checked=$((checked + 1))
  else
    echo "FAILED: ${description}" >&2
    failed=$((failed + 1))
  fi
}

if command -v promtool >/dev/null; then
  run_check "promtool check config" promtool check config "${deploy_dir}/prometheus/prometheus.yml"
  run_check "promtool check rules" promtool check rules "${deploy_dir}/prometheus/alerts.yml"
  # promtool resolves rule_files relative to the working directory.
  run_check "promtool test rules" \
    bash -c 'cd "$1" && promtool test rules alerts_test.yml' _ "${deploy_dir}/prometheus"
else
  echo "promtool not found (Debian package: prometheus): Prometheus files not checked" >&2
fi

if command -v amtool >/dev/null; then
  run_check "amtool check-config" amtool check-config "${deploy_dir}/alertmanager/alertmanager.yml"
else
  echo "amtool not found (Debian package: prometheus-alertmanager): alertmanager.yml not checked" >&2
fi

verify_unit() {
  local output
  output=$(systemd-analyze verify "$1" 2>&1) || true
  # The only acceptable complaint is that the daemon binary is not installed here.
  local problems
  problems=$(grep -v 'Command /usr/local/bin/nsad is not executable' <<<"${output}" || true)
  if [[ -n "${problems}" ]]; then
    echo "${problems}" >&2
    return 1
  fi
}
if command -v systemd-analyze >/dev/null; then
  run_check "systemd-analyze verify nsad.service" verify_unit "${deploy_dir}/systemd/nsad.service"
fi

if ((failed > 0)); then
  echo "${failed} deploy check(s) FAILED" >&2
  exit 1
fi
if ((checked == 0)); then
  echo "no validation tool available: skipped" >&2
  exit 77
fi
echo "${checked} deploy check(s) passed"
