#!/usr/bin/env bash
# README command 2: install everything, build everything, run every test.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
scripts/install.sh
scripts/build.sh
scripts/check_header_hygiene.sh
echo "[test] ctest"
# Heavy suites (torch on 2 cores) run one at a time; ctest prints "N tests passed, M failed".
ctest --test-dir "${NSAD_BUILD_DIR:-build}" --output-on-failure -j "${NSAD_TEST_JOBS:-2}"
echo "[test] done in $(( $(date +%s) - start )) s"
