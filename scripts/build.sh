#!/usr/bin/env bash
# Configures and builds fusebox into build/ (ccache keeps rebuilds fast).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export CCACHE_BASEDIR="$PWD"  # lets ccache reuse objects across checkouts
jobs=$(nproc)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build build -j "$jobs"
