#!/usr/bin/env bash
# Real-shapes check: a random checkpoint with the 35B-A3B dimensions and
# 4 layers (3 GDN + 1 attention, vocab 248,320, 256 experts), converted to Q8_0 and run in both
# modes. Prints conversion time and peak RSS, file size, and tokens/s per mode.
# Needs the `test` extra (torch for the generator) and ~15 GB of free disk under $DIR.
# Usage: bench/real_shapes.sh [DIR] [N_TOKENS]
set -euo pipefail
DIR=${1:-/tmp/clover-real}
N=${2:-32}
mkdir -p "$DIR"
if [ ! -f "$DIR/ckpt/model.safetensors.index.json" ]; then
    /usr/bin/time -f "make_checkpoint: %e s, peak RSS %M KB" \
        python tests/reference/checkpoint.py "$DIR/ckpt" --dims real --layers 4
fi
/usr/bin/time -f "convert q8_0: %e s, peak RSS %M KB" \
    clover-gguf convert "$DIR/ckpt" -o "$DIR/real-q8_0.gguf" --outtype q8_0
ls -l "$DIR/real-q8_0.gguf"
for mode in ar diffusion; do
    /usr/bin/time -f "run $mode: %e s wall, peak RSS %M KB" \
        clover-gguf run -m "$DIR/real-q8_0.gguf" -p "def fibonacci(n):" -n "$N" --mode "$mode" --json
done
