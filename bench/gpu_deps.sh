#!/usr/bin/env bash
# fusebox's own build dependencies (Boost, toml++, GoogleTest) for a machine that has PyTorch, nvcc
# and a C++ compiler but cannot install packages: a GPU node without network access, or one whose
# distribution is not Debian. On a Debian 12 machine with apt, `fetch` downloads the .deb files;
# copy the folder along with the source tree; there, `unpack` extracts them under a prefix of their
# own (never into /), and CMake finds them through CMAKE_PREFIX_PATH. Debian's CMake packages for
# these libraries are relocatable, and the executables find the shared libraries through the
# build tree's RPATH. bench/gpu_check.sh does the unpacking itself when the folder is there.
#
#   bash bench/gpu_deps.sh fetch [DIR]          DIR defaults to .gpu-deps in the source tree (about 12 MB)
#   bash bench/gpu_deps.sh unpack DIR PREFIX    prints the folder to add to CMAKE_PREFIX_PATH
#
# LibTorch and gloo are not among them: they come with PyTorch.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The -dev packages fusebox builds with; `fetch` adds what they need from the same libraries.
ROOTS=(libboost-dev libboost-program-options-dev libboost-filesystem-dev libtomlplusplus-dev libgtest-dev)
# Only these families travel: the C library, libstdc++ and the compiler are the target's own.
FAMILIES='^(libboost|libtomlplusplus|libgtest|googletest)'

die() {
  echo "gpu_deps: $*" >&2
  exit 1
}

fetch() {
  local dir=${1:-$ROOT/.gpu-deps}
  command -v apt-get >/dev/null || die "apt-get not found: fetch runs on a Debian 12 machine (unpack runs on the GPU machine)"
  local names
  names=$(apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
    --no-replaces --no-enhances "${ROOTS[@]}" 2>/dev/null | grep -v '^[ <]' | grep -E "$FAMILIES" | sort -u) ||
    die "apt-cache knows none of ${ROOTS[*]} (run apt-get update?)"
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  rm -f "$dir"/*.deb
  # apt-get download writes into the current folder (as root it warns that _apt cannot write
  # there, which is harmless).
  local log
  log=$(cd "$dir" && apt-get download -q $names 2>&1) ||
    die "apt-get download failed: $(echo "$log" | grep -v unsandboxed | tail -n 1)"
  echo "gpu_deps: $(ls "$dir"/*.deb | wc -l) packages, $(du -sh "$dir" | cut -f1), in $dir"
}

# extract DEB PREFIX: dpkg-deb where there is one; otherwise ar and tar, which any machine with a
# compiler has (the data member is data.tar.xz, .zst or .gz).
extract() {
  local deb=$1 prefix=$2
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$deb" "$prefix"
    return
  fi
  local member
  member=$(ar t "$deb" | grep '^data\.tar') || return 1
  case $member in
    *.xz) ar p "$deb" "$member" | tar -xJ -C "$prefix" ;;
    *.zst) ar p "$deb" "$member" | zstd -dq | tar -x -C "$prefix" ;;
    *.gz) ar p "$deb" "$member" | tar -xz -C "$prefix" ;;
    *) ar p "$deb" "$member" | tar -x -C "$prefix" ;;
  esac
}

unpack() {
  [ $# -eq 2 ] || die "usage: bash bench/gpu_deps.sh unpack DIR PREFIX"
  local dir=$1 prefix=$2
  [ -d "$dir" ] || die "$dir: no such folder (make it with: bash bench/gpu_deps.sh fetch $dir)"
  local debs=("$dir"/*.deb)
  [ -e "${debs[0]}" ] || die "$dir holds no .deb files (make them with: bash bench/gpu_deps.sh fetch $dir)"
  mkdir -p "$prefix"
  prefix=$(cd "$prefix" && pwd)
  [ "$prefix" != / ] || die "refusing to unpack into / (give a folder of its own)"
  local deb
  for deb in "${debs[@]}"; do
    extract "$deb" "$prefix" 2>/dev/null || die "$deb: not a readable .deb (fetch it again)"
  done
  # What CMake needs from each: a package configuration file under the prefix.
  local pkg
  for pkg in Boost tomlplusplus GTest; do
    compgen -G "$prefix/usr/lib/*/cmake/$pkg*/*onfig.cmake" >/dev/null ||
      die "$dir has no CMake package for $pkg (fetch it again on a Debian 12 machine)"
  done
  echo "$prefix/usr"
}

case ${1:-} in
  fetch) shift; fetch "$@" ;;
  unpack) shift; unpack "$@" ;;
  *) die "usage: bash bench/gpu_deps.sh fetch [DIR] | unpack DIR PREFIX" ;;
esac
