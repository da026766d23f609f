#!/usr/bin/env bash
# examples/token-stream: a corpus tokenized in Python and written as a headerless uint16 .bin
# trains the transformer as the example says, and its held-out loss beats a uniform guess.
#   token_stream_example_test.sh PYTHON TRAINER SCRATCH
set -euo pipefail
python=$1 trainer=$2 out=$3
root=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$out"
"$python" "$root/examples/token-stream/prepare.py" "$out"
"$trainer" --config "$root/examples/token-stream/train.toml" --dataset "tensors:$out/train.bin" \
  --output-dir "$out/run" --threads 1 --log-every 0
"$python" "$root/examples/token-stream/prepare.py" "$out" --check
