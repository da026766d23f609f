#!/usr/bin/env bash
# examples/own-data: a classifier and its samples made in Python train with the trainer as the
# example says, and the trained module, read back by torch.jit.load, classifies the samples.
#   own_data_example_test.sh PYTHON TRAINER SCRATCH
set -euo pipefail
python=$1 trainer=$2 out=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$out"
"$python" "$root/examples/own-data/make_example.py" "$out"
"$trainer" --config "$root/examples/own-data/train.toml" --model-script "$out/net.pt" \
  --dataset "tensors:$out/train.pt" --output-dir "$out/run" --save-model "$out/trained.pt" \
  --threads 1 --log-every 0
"$python" "$root/examples/own-data/make_example.py" "$out" --check
