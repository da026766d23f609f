#!/usr/bin/env bash
# Peak memory and time per step with and without --gradient-checkpointing, measured in one run:
# the trainer trains each model twice (fused backward pass, the same seed and data) and this
# prints both peaks (summary.json), their ratio, the median step time ratio (metrics.jsonl, the
# first step left out) and whether the losses of every step are the same.
#
#   bash bench/gradient_checkpointing.sh [TRAINER]     (default: build/bin/trainer)
#
# Environment: FUSEBOX_BENCH_STEPS (default 6), FUSEBOX_BENCH_THREADS (default: the trainer's).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRAINER=${1:-$ROOT/build/bin/trainer}
STEPS=${FUSEBOX_BENCH_STEPS:-6}
THREADS=()
[ -n "${FUSEBOX_BENCH_THREADS:-}" ] && THREADS=(--threads "$FUSEBOX_BENCH_THREADS")
if [ ! -x "$TRAINER" ]; then
  echo "gradient_checkpointing.sh: $TRAINER is not built (bash scripts/build.sh)" >&2
  exit 2
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# field FILE KEY: a number from summary.json
field() { sed -n "s/.*\"$2\":\([-0-9.e+]*\).*/\1/p" "$1"; }
# column FILE KEY: that key of every line of metrics.jsonl
column() { sed -n "s/.*\"$2\":\([-0-9.e+]*\).*/\1/p" "$1"; }
median_step() { column "$1" step_seconds | tail -n +2 | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }

printf '%-58s %12s %12s %7s %7s %s\n' "model (fused backward pass, adamw)" "peak" "checkpointed" \
  "memory" "time" "same losses"
run_case() {
  local label=$1
  shift
  local args=(--optimizer adamw --fused-backward-pass --max-train-steps "$STEPS" --log-every 0
    "${THREADS[@]}" "$@")
  "$TRAINER" "${args[@]}" --output-dir "$WORK/plain" >/dev/null
  "$TRAINER" "${args[@]}" --gradient-checkpointing --output-dir "$WORK/ckpt" >/dev/null
  local p c tp tc same=no
  p=$(field "$WORK/plain/summary.json" peak_bytes)
  c=$(field "$WORK/ckpt/summary.json" peak_bytes)
  tp=$(median_step "$WORK/plain/metrics.jsonl")
  tc=$(median_step "$WORK/ckpt/metrics.jsonl")
  cmp -s <(column "$WORK/plain/metrics.jsonl" loss) <(column "$WORK/ckpt/metrics.jsonl" loss) &&
    same=yes
  printf '%-58s %12s %12s %6.2fx %6.2fx %s\n' "$label" "$(mib "$p")" "$(mib "$c")" \
    "$(awk -v a="$c" -v b="$p" 'BEGIN {print a / b}')" \
    "$(awk -v a="$tc" -v b="$tp" 'BEGIN {print a / b}')" "$same"
  rm -rf "$WORK/plain" "$WORK/ckpt"
  [ "$same" = yes ]
}

run_case "transformer width 256, 8 blocks, seq-len 256, batch 16" --model transformer \
  --model-width 256 --model-depth 8 --seq-len 256 --train-batch-size 16
run_case "denoiser width 64, 3 levels, 64x64 images, batch 8" --model denoiser \
  --model-width 64 --model-depth 3 --image-size 64 --train-batch-size 8
run_case "mlp width 1024, 8 layers, batch 512" --model mlp --model-width 1024 --model-depth 8 \
  --train-batch-size 512
echo "memory: checkpointed peak / plain peak; time: median step time, checkpointed / plain"
