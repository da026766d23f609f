#!/usr/bin/env bash
# GPU check: builds fusebox against this machine's PyTorch (LibTorch 2.x with CUDA) and runs, on
# the GPU, the plugin and step-mode equivalence tests, the trainer on a denoiser of about 1.08
# billion parameters in the normal, fused and groups modes and on a transformer without and with
# gradient checkpointing, and the memory benchmark on the GPU.
# About 8 minutes in all; every part has its own time limit.
#
#   bash bench/gpu_check.sh OUTDIR        (or OUT=OUTDIR bash bench/gpu_check.sh)
#
# Writes OUTDIR/gpu_check.log (everything), OUTDIR/summary.txt (one line per part), the test XML,
# each trainer run's log and output folder (metrics.jsonl, summary.json with peak memory), the
# environment (PyTorch, CUDA, nvcc, nvidia-smi), and all of it in OUTDIR/gpu_check_results.tar.gz.
# Exit status 0 only when every part passed.
#
# Needs: python3 with a CUDA build of PyTorch whose C++ ABI is the new one (pip wheels from 2.7
# on; the system's Boost and GoogleTest use it), a visible NVIDIA GPU, nvcc (CUDACXX, PATH or
# /usr/local/cuda/bin; ideally the CUDA major version PyTorch was built with), a C++ compiler,
# cmake >= 3.18 and ninja or make (PATH, or beside python3 as pip installs them), and Boost,
# toml++ and GoogleTest: the system's (scripts/setup.sh on Debian), or, on a machine that cannot
# install packages, Debian 12's .deb files in .gpu-deps/ (made by `bash bench/gpu_deps.sh fetch`
# on a Debian 12 machine and copied along), which this script unpacks under the build folder.
# Environment: FUSEBOX_GPU_BUDGET_S (default 480), FUSEBOX_GPU_BUILD (default build-gpu),
# TORCH_CUDA_ARCH_LIST (the kernels' architectures: a CUDA LibTorch ignores CMAKE_CUDA_ARCHITECTURES;
# default: the GPU's compute capability), FUSEBOX_GPU_DEPS (default .gpu-deps),
# FUSEBOX_GPU_BUILD_S (the build's time limit, default 300), FUSEBOX_GPU_DISTRIBUTED (the build's
# FUSEBOX_DISTRIBUTED, default OFF).
set -uo pipefail

OUT_DIR=${1:-${OUT:-}}
if [ -z "$OUT_DIR" ]; then
  echo "usage: bash bench/gpu_check.sh OUTDIR" >&2
  exit 2
fi
mkdir -p "$OUT_DIR" || exit 2
OUT_DIR=$(cd "$OUT_DIR" && pwd)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
BUILD=${FUSEBOX_GPU_BUILD:-build-gpu}
BUDGET=${FUSEBOX_GPU_BUDGET_S:-480}
START=$(date +%s)
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
exec > >(tee -a "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
FAILED=0
# However the check ends: everything in one archive too, to send from a remote machine. First the
# log is finished: tee gets the end of its input and is waited for.
pack() {
  exec >/dev/null 2>&1
  wait "$TEE_PID" 2>/dev/null || sleep 1
  local tmp
  tmp=$(mktemp) || return
  tar -czf "$tmp" --exclude=./gpu_check_results.tar.gz -C "$OUT_DIR" . 2>/dev/null
  mv -f "$tmp" "$OUT_DIR/gpu_check_results.tar.gz" && chmod 644 "$OUT_DIR/gpu_check_results.tar.gz"
}
trap pack EXIT

left() { echo $((BUDGET - ($(date +%s) - START))); }
note() { echo "$*" | tee -a "$SUMMARY"; }
fail() {
  note "gpu_check: FAILED: $*"
  exit 1
}

# part NAME LIMIT_S COMMAND...: runs COMMAND under `timeout` (LIMIT_S, or less if the budget is
# nearly spent), its output into $PART_LOG when that is set; records pass/fail/timeout and time.
part() {
  local name=$1 limit=$2
  shift 2
  local remaining
  remaining=$(left)
  if [ "$remaining" -le 5 ]; then
    note "SKIPPED  $name (time budget of ${BUDGET}s spent)"
    FAILED=1
    return 1
  fi
  [ "$limit" -gt "$remaining" ] && limit=$remaining
  echo "=== $name (limit ${limit}s): $*"
  local t0 rc
  t0=$(date +%s)
  if [ -n "${PART_LOG:-}" ]; then
    timeout --kill-after=10 "$limit" "$@" >"$PART_LOG" 2>&1
  else
    timeout --kill-after=10 "$limit" "$@"
  fi
  rc=$?
  local dt=$(($(date +%s) - t0))
  if [ $rc -eq 0 ]; then
    note "PASSED   $name (${dt}s)"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    note "TIMEOUT  $name (after ${dt}s, limit ${limit}s)"
    FAILED=1
  else
    note "FAILED   $name (exit $rc, ${dt}s)"
    FAILED=1
  fi
  return $rc
}

# ---- 1. What this machine has ----------------------------------------------------------------
command -v python3 >/dev/null || fail "python3 not found (this check builds against PyTorch's LibTorch)"
if ! python3 -c 'import torch' 2>"$OUT_DIR/torch_import.err"; then
  fail "python3 cannot import torch ($(tail -n 1 "$OUT_DIR/torch_import.err")); install a CUDA build of PyTorch"
fi
python3 - >"$OUT_DIR/environment.txt" 2>&1 <<'PY'
import torch
print("torch", torch.__version__)
print("torch_cuda", torch.version.cuda)
print("cuda_available", torch.cuda.is_available())
print("cxx11_abi", torch._C._GLIBCXX_USE_CXX11_ABI)
print("cmake_prefix_path", torch.utils.cmake_prefix_path)
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(0))
    print("capability", "%d.%d" % torch.cuda.get_device_capability(0))
PY
cat "$OUT_DIR/environment.txt"
envget() { sed -n "s/^$1 //p" "$OUT_DIR/environment.txt"; }
[ "$(envget torch_cuda)" != "None" ] && [ -n "$(envget torch_cuda)" ] ||
  fail "this PyTorch has no CUDA (torch.version.cuda is None)"
[ "$(envget cuda_available)" = "True" ] ||
  fail "torch.cuda.is_available() is False: no GPU visible (check nvidia-smi and the driver)"
[ "$(envget cxx11_abi)" = "True" ] ||
  fail "this PyTorch uses the old C++ ABI (_GLIBCXX_USE_CXX11_ABI=0); the system Boost and GoogleTest use the new one: use PyTorch >= 2.7 or a cxx11-ABI LibTorch"
PREFIX=$(envget cmake_prefix_path)
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1
NVCC=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
[ -x "$NVCC" ] || fail "nvcc not found (set CUDACXX, or put the CUDA toolkit's bin in PATH)"
NVCC_VERSION=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
note "torch $(envget torch) (CUDA $(envget torch_cuda)) on $(envget device) (sm $(envget capability)); nvcc $NVCC_VERSION"
if [ "${NVCC_VERSION%%.*}" != "$(envget torch_cuda | cut -d. -f1)" ]; then
  note "warning: nvcc $NVCC_VERSION and PyTorch's CUDA $(envget torch_cuda) differ in major version: the kernels then load a second CUDA runtime, which needs a driver for the newer one"
fi
# cmake and ninja from pip live beside python3, which need not be on PATH.
PATH=$PATH:$(python3 -c 'import os, sys; e = sys.executable
print(os.path.dirname(e) + ":" + os.path.dirname(os.path.realpath(e)))')
command -v cmake >/dev/null || fail "cmake not found (PATH, or pip install cmake)"
command -v "${CXX:-c++}" >/dev/null || command -v g++ >/dev/null ||
  fail "no C++ compiler (set CXX, or install g++)"
if command -v ninja >/dev/null; then
  GENERATOR=Ninja
elif command -v make >/dev/null; then
  GENERATOR="Unix Makefiles"
else
  fail "neither ninja nor make found (pip install ninja)"
fi
# LibTorch's CMake compiles the kernels for TORCH_CUDA_ARCH_LIST: this GPU's capability.
ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$(envget capability)}

# ---- 2. Build (only what the checks run) ------------------------------------------------------
# Boost, toml++ and GoogleTest carried as .deb files, for a machine that cannot install them.
DEPS=${FUSEBOX_GPU_DEPS:-$ROOT/.gpu-deps}
if compgen -G "$DEPS/*.deb" >/dev/null; then
  DEPS_PREFIX=$(bash bench/gpu_deps.sh unpack "$DEPS" "$BUILD/deps") || fail "unpacking $DEPS"
  note "build dependencies from $DEPS ($(ls "$DEPS"/*.deb | wc -l) packages), unpacked in $DEPS_PREFIX"
  PREFIX="$DEPS_PREFIX;$PREFIX"
fi
export CUDACXX=$NVCC
# Data parallel is off by default here: this check runs on one GPU and no part of it uses c10d,
# so the communicator's build (c10d's and gloo's headers) cannot cost the GPU parts.
part "configure" 120 cmake -S . -B "$BUILD" -G "$GENERATOR" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$PREFIX" -DFUSEBOX_CUDA=ON -DTORCH_CUDA_ARCH_LIST="$ARCH_LIST" \
  -DFUSEBOX_DISTRIBUTED="${FUSEBOX_GPU_DISTRIBUTED:-OFF}" -DFUSEBOX_BUILD_BENCH=ON ||
  fail "configure (see gpu_check.log; FUSEBOX_CUDA=ON stops there when LibTorch has no CUDA)"
cache_value() { sed -n "s/^$1:[A-Z]*=//p" "$BUILD/CMakeCache.txt"; }
CXX_USED=$(cache_value CMAKE_CXX_COMPILER)
note "configured: C++$(cache_value FUSEBOX_CXX_STANDARD_IN_USE), $CXX_USED ($("$CXX_USED" --version | head -n 1))"
part "build" "${FUSEBOX_GPU_BUILD_S:-300}" cmake --build "$BUILD" -j "$(nproc)" \
  --target plugin_tests core_tests trainer memory_bench ||
  fail "build (see gpu_check.log)"
note "trainer: $("$BUILD/bin/trainer" --version 2>&1 | tail -n 1)"

# ---- 3. Tests on the GPU ------------------------------------------------------------------------
# Plugins on CUDA: the kernels against the host math, the reference trajectories, step() against
# step_param() and state round trips (fp32/bf16 take the kernels, fp64 the ATen path).
FUSEBOX_TEST_DEVICE=cuda part "plugin tests on cuda" 90 "$BUILD/bin/plugin_tests" \
  --gtest_filter='CudaMath.*:*ReferenceTrajectory.*:StepParam.EqualsStepBitForBit:StateDict.SaveLoadContinuesBitForBit' \
  --gtest_output="xml:$OUT_DIR/plugin_tests_cuda.xml"
# Step modes on CUDA: fused and groups equal normal bit for bit, clipping, grad norms (half and
# bfloat16 too); loss scaling; the training device each local rank selects.
FUSEBOX_TEST_DEVICE=cuda part "step-mode tests on cuda" 90 "$BUILD/bin/core_tests" \
  --gtest_filter='StepModes.FusedAndGroupsEqualNormal*:StepModes.WithClipping*:StepModes.GradNorm*:StepModes.UnusedParameter*:StepModes.HalfAndBFloat16*:LossScaling.*:Device.*:ActivationCheckpoint.*' \
  --gtest_output="xml:$OUT_DIR/core_tests_cuda.xml"
# The whole plugin suite on the CPU of the CUDA build.
part "plugin tests on cpu" 60 "$BUILD/bin/plugin_tests" --gtest_output="xml:$OUT_DIR/plugin_tests_cpu.xml"

# ---- 4. Trainer: denoiser, ~1.08e9 parameters (width 832, 3 levels), a few steps per mode -------
MODEL=(--device cuda --model denoiser --model-width 832 --model-depth 3 --image-size 16
  --train-batch-size 2 --max-train-steps 4 --log-every 1)
train() {
  local name=$1
  shift
  PART_LOG="$OUT_DIR/trainer_$name.log" part "trainer $name" 60 "$BUILD/bin/trainer" "${MODEL[@]}" \
    --output-dir "$OUT_DIR/trainer_$name" "$@"
  tail -n 5 "$OUT_DIR/trainer_$name.log"
}
train adamw_normal --optimizer adamw
train adamw_fused --optimizer adamw --fused-backward-pass
train adamw_groups --optimizer adamw --fused-optimizer-groups 4
train adafactor_fused --optimizer-plugin adafactor_fused.so --fused-backward-pass
# fp16 autocast with the dynamic loss scale (CUDA only: LibTorch 1.13 has no fp16 CPU autocast).
train adamw_fp16 --optimizer adamw --mixed-precision fp16

# Gradient checkpointing on the GPU: a transformer whose activations outweigh its weights, fused
# adamw, without and with --gradient-checkpointing (the same losses, a lower peak).
LM=(--device cuda --model transformer --model-width 1024 --model-depth 8 --model-heads 8
  --seq-len 1024 --train-batch-size 8 --max-train-steps 4 --log-every 1 --optimizer adamw
  --fused-backward-pass)
for ckpt in off on; do
  flag=()
  [ "$ckpt" = on ] && flag=(--gradient-checkpointing)
  PART_LOG="$OUT_DIR/trainer_lm_checkpointing_$ckpt.log" part "trainer lm checkpointing $ckpt" 45 \
    "$BUILD/bin/trainer" "${LM[@]}" "${flag[@]}" --output-dir "$OUT_DIR/trainer_lm_checkpointing_$ckpt"
  tail -n 3 "$OUT_DIR/trainer_lm_checkpointing_$ckpt.log"
done

# Weights files with Python: torch.load (and safetensors, when installed) reads what --save-model
# wrote; --init-weights reads what torch.save and safetensors' save_file wrote.
PART_LOG="$OUT_DIR/weights_interop.log" part "weights files with python" 60 \
  python3 tests/python/torch_interop.py "$BUILD/bin/trainer" "$OUT_DIR/weights_interop"
tail -n 5 "$OUT_DIR/weights_interop.log"

# ---- 5. Memory benchmark on the GPU: peak allocated and time per step, every mode ---------------
PART_LOG="$OUT_DIR/memory_bench_cuda.log" part "memory_bench --quick --device cuda" 90 \
  "$BUILD/bin/memory_bench" --quick --device cuda --out "$OUT_DIR/memory_bench_cuda"

note "total $(($(date +%s) - START))s of a ${BUDGET}s budget"
if [ $FAILED -ne 0 ]; then
  note "gpu_check: some parts failed or were skipped (see summary.txt and gpu_check.log)"
  exit 1
fi
note "gpu_check: all parts passed"
