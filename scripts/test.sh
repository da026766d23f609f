#!/usr/bin/env bash
# Builds fusebox and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads that spin while waiting starve each other on a busy machine.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
bash scripts/build.sh
# Core and plugin tests under AddressSanitizer + UndefinedBehaviorSanitizer, then each libFuzzer
# target briefly (FUSEBOX_FUZZ_SECONDS, default 60).
bash scripts/sanitize.sh "${FUSEBOX_FUZZ_SECONDS:-60}"
# The whole suite (ctest's summary is the last line).
cd build
ctest --output-on-failure -j "$(nproc)" --timeout 900
