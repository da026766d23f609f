#!/usr/bin/env bash
# bench/gpu_deps.sh unpack: carried .deb files land under the prefix (with dpkg-deb, and with ar
# and tar where there is no dpkg), and every bad input is one line and a non-zero exit.
set -uo pipefail
script=$(cd "$(dirname "$0")/../.." && pwd)/bench/gpu_deps.sh
source "$(dirname "$0")/checks.sh"

# make_deb NAME PACKAGE-FOLDER-NAME...: a .deb holding a CMake package file for each name.
make_deb() {
  local name=$1
  shift
  local tree=$work/tree-$name
  mkdir -p "$tree/DEBIAN"
  printf 'Package: %s\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@t>\nDescription: t\n' \
    "$name" >"$tree/DEBIAN/control"
  for pkg in "$@"; do
    mkdir -p "$tree/usr/lib/x86_64-linux-gnu/cmake/$pkg"
    echo "# $pkg" >"$tree/usr/lib/x86_64-linux-gnu/cmake/$pkg/${pkg%%-*}Config.cmake"
  done
  mkdir -p "$tree/usr/include/$name"
  echo "// $name" >"$tree/usr/include/$name/header.h"
  dpkg-deb --root-owner-group -Zxz --build "$tree" "$work/debs/$name.deb" >/dev/null
}
mkdir -p "$work/debs"
make_deb boost Boost-1.74.0
make_deb toml tomlplusplus
make_deb gtest GTest
ls "$work/debs"/*.deb >/dev/null 2>&1 || { echo "FAIL could not make test packages"; exit 1; }

# 1. With dpkg-deb.
out=$(bash "$script" unpack "$work/debs" "$work/prefix1" 2>&1)
check "prints the prefix's usr folder" test "$out" = "$work/prefix1/usr"
check "headers unpacked" test -f "$work/prefix1/usr/include/toml/header.h"
check "CMake packages unpacked" test -f "$work/prefix1/usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake"

# 2. Without dpkg-deb: a PATH holding every command but dpkg-deb and dpkg.
mkdir -p "$work/bin"
for d in /usr/local/bin /usr/bin /bin; do
  for f in "$d"/*; do
    b=$(basename "$f")
    case $b in dpkg | dpkg-deb) continue ;; esac
    [ -e "$work/bin/$b" ] || ln -s "$f" "$work/bin/$b"
  done
done
check "the restricted PATH has no dpkg-deb" bash -c "! PATH=$work/bin command -v dpkg-deb"
out=$(PATH=$work/bin bash "$script" unpack "$work/debs" "$work/prefix2" 2>&1)
check "ar and tar: prints the prefix" test "$out" = "$work/prefix2/usr"
check "ar and tar: same files as dpkg-deb" diff -r "$work/prefix1" "$work/prefix2"

# 3. Bad input: one line on stderr, exit 1.
one_line_error() {  # one_line_error PATTERN COMMAND...
  local pattern=$1
  shift
  local err rc
  err=$("$@" 2>&1 >/dev/null)
  rc=$?
  [ $rc -eq 1 ] && [ "$(echo "$err" | wc -l)" -eq 1 ] && echo "$err" | grep -q "$pattern"
}
mkdir -p "$work/nogtest" "$work/corrupt" "$work/empty"
cp "$work/debs/boost.deb" "$work/debs/toml.deb" "$work/nogtest/"
check "a missing CMake package is named" \
  one_line_error "has no CMake package for GTest" bash "$script" unpack "$work/nogtest" "$work/p3"
echo "not a package" >"$work/corrupt/broken.deb"
check "a corrupt .deb is named" \
  one_line_error "broken.deb: not a readable .deb" bash "$script" unpack "$work/corrupt" "$work/p4"
check "an empty folder says how to fill it" \
  one_line_error "holds no .deb files (make them with: bash bench/gpu_deps.sh fetch" \
  bash "$script" unpack "$work/empty" "$work/p5"
check "a missing folder is named" \
  one_line_error "$work/none: no such folder" bash "$script" unpack "$work/none" "$work/p6"
check "never unpacks into /" \
  one_line_error "refusing to unpack into /" bash "$script" unpack "$work/debs" /
check "an unknown verb shows the usage" one_line_error "usage:" bash "$script" install

finish
