#!/usr/bin/env bash
# cmake/FuseboxCxxStandard.cmake: the standard follows the guard in LibTorch's ATen/ATen.h and
# its version; a requested standard below what LibTorch needs, or not 17/20/23, stops the
# configuration with a message naming FUSEBOX_CXX_STANDARD.
set -uo pipefail
module=$(cd "$(dirname "$0")/../.." && pwd)/cmake/FuseboxCxxStandard.cmake
source "$(dirname "$0")/checks.sh"

# include_tree NAME GUARD: an include folder whose ATen/ATen.h carries LibTorch's guard
# (GUARD empty: an ATen.h without one).
include_tree() {
  mkdir -p "$work/$1/ATen"
  if [ -n "$2" ]; then
    printf '#pragma once\n#if !defined(_MSC_VER) && __cplusplus < %s\n#error C++ too old\n#endif\n' \
      "$2" >"$work/$1/ATen/ATen.h"
  else
    printf '#pragma once\n#include <ATen/Functions.h>\n' >"$work/$1/ATen/ATen.h"
  fi
}
include_tree old 201402L
include_tree cxx17 201703L
include_tree cxx20 202002L
include_tree unguarded ""
mkdir -p "$work/empty"

# choose REQUESTED VERSION DIR...: prints the chosen standard, or the error, and exits like cmake.
# CMAKE_STD in the environment stands for a -DCMAKE_CXX_STANDARD on the command line.
choose() {
  local requested=$1 version=$2
  shift 2
  cat >"$work/driver.cmake" <<CMAKE
include("$module")
fusebox_cxx_standard(std REQUESTED "$requested" CMAKE_REQUESTED "${CMAKE_STD:-}"
  VERSION "$version" INCLUDE_DIRS $*)
message(STATUS "std=\${std}")
CMAKE
  cmake -P "$work/driver.cmake" 2>&1
}
chosen() {  # chosen EXPECTED REQUESTED VERSION DIR...
  local expected=$1
  shift
  local out
  out=$(choose "$@") && [[ "$out" == *"std=$expected"* ]] || { echo "  got: $out"; return 1; }
}
refused() {  # refused PATTERN REQUESTED VERSION DIR...
  local pattern=$1
  shift
  local out
  if out=$(choose "$@"); then echo "  accepted: $out"; return 1; fi
  [[ "$out" == *"$pattern"* ]] || { echo "  got: $out"; return 1; }
}

check "Debian's 1.13 (guard C++14) compiles as C++17" chosen 17 "" 1.13.0 "$work/old"
check "LibTorch 2.6 (guard C++17) compiles as C++17" chosen 17 "" 2.6.0 "$work/cxx17"
check "a C++20 guard gives C++20" chosen 20 "" 2.14.0 "$work/cxx20"
check "the guard decides whatever the version" chosen 20 "" 2.9.0 "$work/cxx20"
check "LibTorch 2.12 gives C++20 under a C++17 guard" chosen 20 "" 2.12.0 "$work/cxx17"
check "LibTorch 2.13.1 gives C++20" chosen 20 "" 2.13.1 "$work/unguarded"
check "no ATen.h and no version gives C++17" chosen 17 "" "" "$work/empty"
check "an ATen.h without a guard gives C++17" chosen 17 "" 2.6.0 "$work/unguarded"
check "the first folder holding ATen/ATen.h is read, as the compiler would" \
  chosen 17 "" 2.6.0 "$work/empty" "$work/old" "$work/cxx20"
check "C++20 on request over a C++17 LibTorch" chosen 20 20 2.6.0 "$work/cxx17"
check "C++23 on request over a C++20 LibTorch" chosen 23 23 2.14.0 "$work/cxx20"
check "C++17 requested for a C++20 LibTorch is refused, saying what to set" \
  refused "set -DFUSEBOX_CXX_STANDARD=20" 17 2.14.0 "$work/cxx20"
check "C++17 requested for LibTorch 2.12 is refused" \
  refused "LibTorch 2.12.0 needs C++20" 17 2.12.0 "$work/cxx17"
check "C++14 is refused" refused "FUSEBOX_CXX_STANDARD=14: use 17, 20 or 23" 14 1.13.0 "$work/old"
check "a non-number is refused" refused "FUSEBOX_CXX_STANDARD=c++20: use 17, 20 or 23" \
  c++20 1.13.0 "$work/old"
# The CMake way of asking, -DCMAKE_CXX_STANDARD=NN, is a request too, checked the same way.
CMAKE_STD=20 check "CMAKE_CXX_STANDARD=20 asks for C++20 over a C++17 LibTorch" \
  chosen 20 "" 2.6.0 "$work/cxx17"
CMAKE_STD=17 check "CMAKE_CXX_STANDARD=17 for a C++20 LibTorch is refused, naming it" \
  refused "set -DCMAKE_CXX_STANDARD=20 or leave it out" \
  "" 2.14.0 "$work/cxx20"
CMAKE_STD=14 check "CMAKE_CXX_STANDARD=14 is refused" \
  refused "CMAKE_CXX_STANDARD=14: use 17, 20 or 23" "" 1.13.0 "$work/old"
CMAKE_STD=20 check "FUSEBOX_CXX_STANDARD wins over CMAKE_CXX_STANDARD" \
  chosen 17 17 1.13.0 "$work/old"

finish
