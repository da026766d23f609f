#!/usr/bin/env bash
# Builds core, plugins and their tests with clang under AddressSanitizer + UndefinedBehaviorSanitizer
# (build-asan/), runs those tests, then runs each libFuzzer target for FUZZ_SECONDS (default 60).
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_seconds=${1:-60}
bash scripts/setup.sh
export CCACHE_BASEDIR="$PWD"
CC=clang CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1" \
  -DFUSEBOX_SANITIZE=ON -DFUSEBOX_FUZZ=ON -DFUSEBOX_BUILD_TRAINER=OFF -DFUSEBOX_BUILD_BENCH=OFF >/dev/null
cmake --build build-asan -j "$(nproc)" --target core_tests plugin_tests \
  checkpoint_fuzz config_fuzz safetensors_fuzz fusebox_test_plugins
# LibTorch's global registries are never freed: leak reports would be noise.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_init_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
for t in core_tests plugin_tests; do
  echo "== ${t} under ASan+UBSan"
  build-asan/bin/${t} --gtest_brief=1
done
mkdir -p build-asan/crashes build-asan/corpus/config build-asan/corpus/checkpoint \
  build-asan/corpus/safetensors
for target in config checkpoint safetensors; do
  echo "== fuzzing ${target} for ${fuzz_seconds}s"
  build-asan/bin/${target}_fuzz -max_total_time="${fuzz_seconds}" -timeout=10 -rss_limit_mb=4096 \
    -artifact_prefix=build-asan/crashes/ -print_final_stats=1 \
    build-asan/corpus/${target} tests/fuzz/corpus/${target} 2>&1 | tail -n 8
done
echo "sanitizer tests and fuzzing: no findings"
