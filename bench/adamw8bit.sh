#!/usr/bin/env bash
# Optimizer state, peak memory, time per step and losses of adamw8bit against adamw, measured in
# one run: the trainer trains each model twice (fused backward pass, the same seed and data) and
# this prints both optimizer states (summary.json), their ratio, the ratio of the peaks, the
# median step time ratio (metrics.jsonl, the first step left out), and the last training and
# held-out losses of both.
#
#   bash bench/adamw8bit.sh [TRAINER]     (default: build/bin/trainer)
#
# Environment: FUSEBOX_BENCH_STEPS (default 200), FUSEBOX_BENCH_THREADS (default: the trainer's).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
TRAINER=${1:-$ROOT/build/bin/trainer}
STEPS=${FUSEBOX_BENCH_STEPS:-200}
THREADS=()
[ -n "${FUSEBOX_BENCH_THREADS:-}" ] && THREADS=(--threads "$FUSEBOX_BENCH_THREADS")
if [ ! -x "$TRAINER" ]; then
  echo "adamw8bit.sh: $TRAINER is not built (bash scripts/build.sh)" >&2
  exit 2
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# field FILE KEY: a number from summary.json
field() { sed -n "s/.*\"$2\":\([-0-9.e+]*\).*/\1/p" "$1"; }
median_step() {
  sed -n 's/.*"step_seconds":\([-0-9.e+]*\).*/\1/p' "$1" | tail -n +2 | sort -g |
    awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'
}
mib() { awk -v b="$1" 'BEGIN {printf "%.2f MiB", b / 1048576}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%.2fx", a / b}'; }

printf '%-44s %11s %11s %6s %6s %6s  %s\n' "model (fused backward pass)" "adamw state" \
  "8-bit state" "state" "peak" "time" "last loss / eval loss: adamw, adamw8bit"
run_case() {
  local label=$1
  shift
  local args=(--fused-backward-pass --max-train-steps "$STEPS" --log-every 0 "${THREADS[@]}" "$@")
  "$TRAINER" --optimizer adamw "${args[@]}" --output-dir "$WORK/a" >/dev/null
  "$TRAINER" --optimizer adamw8bit "${args[@]}" --output-dir "$WORK/b" >/dev/null
  local sa sb
  sa=$(field "$WORK/a/summary.json" optimizer_state_bytes)
  sb=$(field "$WORK/b/summary.json" optimizer_state_bytes)
  printf '%-44s %11s %11s %6s %6s %6s  %.4f / %s, %.4f / %s\n' "$label" "$(mib "$sa")" \
    "$(mib "$sb")" "$(ratio "$sb" "$sa")" \
    "$(ratio "$(field "$WORK/b/summary.json" peak_bytes)" "$(field "$WORK/a/summary.json" peak_bytes)")" \
    "$(ratio "$(median_step "$WORK/b/metrics.jsonl")" "$(median_step "$WORK/a/metrics.jsonl")")" \
    "$(field "$WORK/a/summary.json" last_loss)" "$(field "$WORK/a/summary.json" eval_loss)" \
    "$(field "$WORK/b/summary.json" last_loss)" "$(field "$WORK/b/summary.json" eval_loss)"
  rm -rf "$WORK/a" "$WORK/b"
}

run_case "transformer 512 x 4, text, 10% held out" --model transformer --model-width 512 \
  --model-depth 4 --model-heads 8 --dataset "text:$ROOT/data/pride-and-prejudice-ch1.txt" \
  --eval-holdout 0.1 --eval-every "$STEPS" --learning-rate 3e-4
run_case "mlp 1024 x 8, batch 256" --model mlp --model-width 1024 --model-depth 8 \
  --train-batch-size 256 --eval-every "$STEPS"
echo "state: adamw8bit's optimizer state / adamw's; peak: peak tensor memory, adamw8bit / adamw;"
echo "time: median step time, adamw8bit / adamw; eval loss: held-out batches after the last step"
