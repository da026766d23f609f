#!/usr/bin/env bash
# Installs what fusebox needs on Debian bookworm, non-interactively; does nothing when all is there.
set -euo pipefail
packages=(
  build-essential cmake ninja-build ccache
  libtorch-dev libopenblas0-pthread   # OpenBLAS: without it LibTorch's matmuls are ~40x slower
  libboost-dev libboost-program-options-dev libboost-filesystem-dev
  libtomlplusplus-dev libgtest-dev libgloo-dev
  zlib1g-dev                          # np.savez_compressed archives
  clang libclang-rt-14-dev            # sanitizer and libFuzzer builds
  python3-torch                       # tests: files and TorchScript modules with Python's PyTorch
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "fusebox setup: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
