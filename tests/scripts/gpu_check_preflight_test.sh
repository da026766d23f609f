#!/usr/bin/env bash
# bench/gpu_check.sh stops at once, with one line naming what is missing, when the machine cannot
# run it: no PyTorch, a CPU-only PyTorch, no visible GPU, an old-ABI wheel, no nvcc. A stand-in
# `torch` Python package plays each case; the archive of results is written every time.
set -uo pipefail
script=$(cd "$(dirname "$0")/../.." && pwd)/bench/gpu_check.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0

# fake_torch DIR CUDA AVAILABLE ABI: a `torch` package answering what gpu_check.sh asks.
fake_torch() {
  mkdir -p "$1/torch"
  cat >"$1/torch/__init__.py" <<PY
__version__ = "9.9.9"
class version:
    cuda = $2
class cuda:
    is_available = staticmethod(lambda: $3)
    get_device_name = staticmethod(lambda i: "Stand-in GPU")
    get_device_capability = staticmethod(lambda i: (9, 0))
class _C:
    _GLIBCXX_USE_CXX11_ABI = $4
class utils:
    cmake_prefix_path = "/nonexistent"
PY
}

# expect NAME MESSAGE [ENV...]: gpu_check.sh exits 1, its last line and summary.txt say MESSAGE.
expect() {
  local name=$1 message=$2
  shift 2
  local out=$work/out-$name
  local all rc
  all=$(env "$@" bash "$script" "$out" 2>&1)
  rc=$?
  if [ $rc -eq 1 ] && echo "$all" | tail -n 1 | grep -qF "gpu_check: FAILED: $message" &&
    grep -qF "gpu_check: FAILED: $message" "$out/summary.txt" &&
    tar -tzf "$out/gpu_check_results.tar.gz" | grep -c summary.txt >/dev/null; then
    echo "ok   $name"
  else
    echo "FAIL $name (exit $rc): $all"
    failures=$((failures + 1))
  fi
}

if python3 -c 'import torch' 2>/dev/null; then
  echo "skip no-torch (this machine has PyTorch)"
else
  expect no-torch "python3 cannot import torch"
fi
fake_torch "$work/cpu" None True True
expect cpu-torch "this PyTorch has no CUDA" PYTHONPATH="$work/cpu"
fake_torch "$work/nogpu" '"13.0"' False True
expect no-gpu "torch.cuda.is_available() is False" PYTHONPATH="$work/nogpu"
fake_torch "$work/oldabi" '"12.4"' True False
expect old-abi "this PyTorch uses the old C++ ABI" PYTHONPATH="$work/oldabi"
fake_torch "$work/ok" '"13.0"' True True
expect no-nvcc "nvcc not found" PYTHONPATH="$work/ok" CUDACXX="$work/no-nvcc"
# A LibTorch without CUDA gets as far as the configuration, which FUSEBOX_CUDA=ON stops there.
nvcc=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
torch_cmake=$(ls -d /usr/lib/*/cmake/Torch 2>/dev/null | head -n 1)
if [ -x "$nvcc" ] && [ -n "$torch_cmake" ]; then
  fake_torch "$work/cpulib" '"13.0"' True True
  sed -i "s|/nonexistent|$(dirname "$torch_cmake")|" "$work/cpulib/torch/__init__.py"
  expect cpu-libtorch "configure (see gpu_check.log; FUSEBOX_CUDA=ON stops there" \
    PYTHONPATH="$work/cpulib" CUDACXX="$nvcc" FUSEBOX_GPU_BUILD="$work/build" FUSEBOX_GPU_DEPS="$work/none"
else
  echo "skip cpu-libtorch (needs nvcc and Debian's LibTorch)"
fi
# Usage: no output folder.
if bash "$script" >/dev/null 2>&1; then
  echo "FAIL no-outdir: exit 0"
  failures=$((failures + 1))
else
  echo "ok   no-outdir"
fi

[ $failures -eq 0 ] || { echo "$failures case(s) failed"; exit 1; }
echo "all cases passed"
