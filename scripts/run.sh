#!/usr/bin/env bash
# Builds fusebox and runs the main job: the shipped example config.
set -euo pipefail
cd "$(dirname "$0")/.."
# OpenMP threads that spin while waiting starve each other on a busy machine.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
bash scripts/build.sh
exec build/bin/trainer --config examples/compare.toml "$@"
