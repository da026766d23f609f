#!/usr/bin/env bash
# Builds fusebox against LibTorch 2.x and runs its test suite there.
#
# LibTorch 2.x comes from Debian 13 (trixie): libtorch-dev 2.6, CPU, with GCC 14 and CMake 3.31,
# inside a Debian 13 tree made with mmdebstrap, so this works on the Debian 12 machine that builds
# against 1.13. The tree is kept (FUSEBOX_TORCH2_ROOT), so a rerun only rebuilds what changed.
#
#   bash scripts/check-libtorch2.sh          build with warnings as errors, run every test
#   bash scripts/check-libtorch2.sh --cuda   against libtorch-cuda-dev 2.6 and nvcc 12.4 (Debian 13
#                                            contrib/non-free): build with warnings as errors, then
#                                            run every test on the CPU (no GPU needed)
#   bash scripts/check-libtorch2.sh --std 20 the same in C++20 (FUSEBOX_CXX_STANDARD), as fusebox
#                                            builds against LibTorch 2.12 and later; combines
#                                            with --cuda
#
# The --cuda tree is about 11 GB. Debian's cuDNN package downloads cuDNN from NVIDIA when it is
# configured, which fails where only Debian's mirror is reachable; LibTorch's CUDA headers and
# libraries are unpacked all the same, which is all a build needs. To load, libtorch_cuda.so
# needs a libcudnn.so.9: the tests run with a stand-in made here, whose every function aborts
# with its name (nothing on the CPU calls cuDNN), so the suite runs against the CUDA LibTorch with
# fusebox's CUDA paths compiled in, and CUDA reported unavailable.
#
# Needs root (mmdebstrap, chroot, mounts); the mounts live in a private mount namespace and vanish
# when the script ends, however it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
src=$PWD

cuda=0
std=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda) cuda=1 ;;
    --std)
      if [[ ! "${2:-}" =~ ^(17|20|23)$ ]]; then
        echo "check-libtorch2: --std needs 17, 20 or 23 (got '${2:-}')" >&2
        exit 2
      fi
      std=$2
      shift
      ;;
    *)
      echo "check-libtorch2: unknown argument '$1' (use --cuda, --std N or nothing)" >&2
      exit 2
      ;;
  esac
  shift
done
if [ "$(id -u)" -ne 0 ]; then
  echo "check-libtorch2: needs root (mmdebstrap, chroot and mounts); run it with sudo" >&2
  exit 2
fi

suffix=$([ $cuda -eq 1 ] && echo "-cuda" || true)
root=${FUSEBOX_TORCH2_ROOT:-/var/cache/fusebox/trixie-libtorch2$suffix}
mirror=http://deb.debian.org/debian
common=build-essential,cmake,ninja-build,ccache,libboost-dev,libboost-program-options-dev,libboost-filesystem-dev,libtomlplusplus-dev,libgtest-dev,libgmock-dev,libopenblas0-pthread,zlib1g-dev,python3

if [ ! -f "$root/.fusebox-ready" ]; then
  if ! command -v mmdebstrap >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends mmdebstrap
  fi
  rm -rf "$root"
  mkdir -p "$(dirname "$root")"
  echo "check-libtorch2: making a Debian 13 tree with LibTorch 2.x in $root"
  if [ $cuda -eq 0 ]; then
    mmdebstrap --quiet --variant=apt --include="$common,libtorch-dev,libgloo-dev" \
      trixie "$root" "$mirror"
  else
    mmdebstrap --quiet --variant=apt --components=main,contrib,non-free --include="$common" \
      trixie "$root" "$mirror"
    # mmdebstrap leaves no package lists behind. The install fails in nvidia-cudnn's configure step
    # only (see above); what the build needs is checked next.
    chroot "$root" apt-get update -qq
    chroot "$root" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -qq libtorch-cuda-dev nvidia-cuda-toolkit >"$root/.install.log" 2>&1 || true
    for f in usr/bin/nvcc usr/include/c10/cuda/CUDACachingAllocator.h \
      usr/lib/x86_64-linux-gnu/libtorch_cuda.so; do
      if [ ! -e "$root/$f" ]; then
        echo "check-libtorch2: /$f is missing from the tree; see $root/.install.log" >&2
        exit 1
      fi
    done
  fi
  touch "$root/.fusebox-ready"
fi

cmake_args="-DCMAKE_BUILD_TYPE=Release -DCMAKE_COMPILE_WARNING_AS_ERROR=ON"
build=/root/build
if [ -n "$std" ]; then
  # A build folder of its own, so the default build stays warm.
  cmake_args="$cmake_args -DFUSEBOX_CXX_STANDARD=$std"
  build=/root/build-cxx$std
fi
tests="OMP_WAIT_POLICY=passive ctest --output-on-failure -j $(nproc) --timeout 900"
# Debian 13's oneDNN (3.7) computes non-finite convolution gradients on AMD EPYC processors with
# its AVX-512 and its AVX2 kernels, in float32 too, depending on the shapes and thread count (the
# denoiser's tests fail at steps 1 to 24; the same at fded331). With oneDNN limited to SSE4.1 every
# run is finite. LibTorch 1.13's bundled oneDNN and ATen's own kernels are not affected; on an AMD
# processor the 2.x tests run with ONEDNN_MAX_CPU_ISA=SSE41.
if grep -q AuthenticAMD /proc/cpuinfo; then
  echo "check-libtorch2: AMD processor: oneDNN limited to SSE4.1 (ONEDNN_MAX_CPU_ISA=SSE41)"
  tests="ONEDNN_MAX_CPU_ISA=SSE41 $tests"
fi
if [ $cuda -eq 1 ]; then
  # libtorch_cuda.so needs libcudnn.so.9, which the tree lacks (see above): executables are linked
  # without checking the libraries' own undefined symbols. Plugins and libraries link as always.
  cmake_args="$cmake_args -DFUSEBOX_CUDA=ON -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined"
  # scripts/cudnn-stand-in.sh makes the stand-in (see above) inside the tree.
  tests="bash /src/scripts/cudnn-stand-in.sh /root/cudnn-stub && LD_LIBRARY_PATH=/root/cudnn-stub $tests"
fi
# What runs inside the tree; the build lives there too ($build), not in the source tree.
cat >"$root/fusebox-check.sh" <<INNER
set -euo pipefail
export CCACHE_BASEDIR=/src
cmake -S /src -B $build -G Ninja $cmake_args | grep -E '^-- fusebox:' || true
cmake --build $build -j $(nproc)
cd $build
$tests
INNER
mkdir -p "$root/src" "$root/proc" "$root/dev"
unshare --mount --propagation private bash -euo pipefail -c "
  mount -t proc proc '$root/proc'
  mount --bind /dev '$root/dev'
  mount --bind '$src' '$root/src'
  mount -o remount,bind,ro '$root/src'
  chroot '$root' bash /fusebox-check.sh
"
