#!/usr/bin/env bash
# Builds fusebox and runs the main job: the shipped example config.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
exec build/bin/trainer --config examples/compare.toml "$@"
