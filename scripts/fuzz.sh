#!/usr/bin/env bash
# Longer fuzzing: bash scripts/fuzz.sh 3600 (seconds per target). Crashers go to build-asan/crashes/.
set -euo pipefail
cd "$(dirname "$0")/.."
exec bash scripts/sanitize.sh "${1:-600}"
