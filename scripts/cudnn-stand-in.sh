#!/usr/bin/env bash
# Makes DIR/libcudnn.so.9: a stand-in for cuDNN that lets a CUDA LibTorch load on a machine
# without cuDNN (scripts/check-libtorch2.sh --cuda runs the test suite on the CPU with it). It
# defines every cuDNN function libtorch_cuda.so imports, under cuDNN's symbol version; each one
# prints its name and aborts, so a test that reached cuDNN would fail loudly, never pass.
#
#   bash scripts/cudnn-stand-in.sh DIR [LIBTORCH_CUDA]     (default /usr/lib/x86_64-linux-gnu/libtorch_cuda.so)
set -euo pipefail
dir=${1:?usage: cudnn-stand-in.sh DIR [LIBTORCH_CUDA]}
lib=${2:-/usr/lib/x86_64-linux-gnu/libtorch_cuda.so}
[ -f "$lib" ] || { echo "cudnn-stand-in: $lib not found" >&2; exit 1; }
mkdir -p "$dir"
cd "$dir"
objdump -T "$lib" | awk '/UND/ && /libcudnn/ {print $NF}' | sort -u >symbols
[ -s symbols ] || { echo "cudnn-stand-in: $lib imports nothing from cuDNN" >&2; exit 1; }
{
  echo '#include <stdio.h>'
  echo '#include <stdlib.h>'
  while read -r f; do
    echo "int $f(void) { fputs(\"cuDNN stand-in: $f called\\n\", stderr); abort(); }"
  done <symbols
} >stand_in.c
echo 'libcudnn.so.9 { global: *; };' >stand_in.map
gcc -shared -fPIC -o libcudnn.so.9 stand_in.c -Wl,-soname,libcudnn.so.9 -Wl,--version-script=stand_in.map
echo "cudnn-stand-in: $dir/libcudnn.so.9 with $(wc -l <symbols) functions"
