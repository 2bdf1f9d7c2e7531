#!/usr/bin/env bash
# llama.cpp as an oracle: build llama-cpp-python 0.3.36 from source (CPU, this CPU's SIMD flags, no AMX)
# into its own virtual environment when it is not there yet, unpack its source for
# llama.cpp's converter, and run the tests that use them:
#   tests/oracles/test_llama_oracle.py  our engine vs llama.cpp on our converter's and llama.cpp's
#                               converter/quantizer qwen35moe files (F32, Q8_0, Q4_K_M)
#   tests/convert/test_convert.py -k llama   our converter vs llama.cpp's convert_hf_to_gguf.py and
#                                    llama_model_quantize (MTP files included)
#   tests/native/test_kquants.py -k llama   our quantisers vs ggml's reference ones, byte for byte
# Usage: bench/llama_oracle.sh [VENV_DIR] [pytest args...]   (default VENV_DIR /tmp/llama-venv)
#   LLAMA_SRC_DIR  where the sdist is downloaded and unpacked (default /tmp/llsrc)
# Needs the package installed with its test extra (pip install ".[test]"): torch runs
# llama.cpp's converter. About 6 minutes on 2 cores the first time (the build), 1 after.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-/tmp/llama-venv}"
shift || true
VERSION=0.3.36
SRC_DIR="${LLAMA_SRC_DIR:-/tmp/llsrc}"
SDIST="$SRC_DIR/llama_cpp_python-${VERSION}.tar.gz"
TREE="$SRC_DIR/llama_cpp_python-${VERSION}/vendor/llama.cpp"

mkdir -p "$SRC_DIR"
if [ ! -f "$SDIST" ]; then
    python -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==${VERSION}" -d "$SRC_DIR"
fi
if [ ! -f "$TREE/convert_hf_to_gguf.py" ]; then
    tar -xzf "$SDIST" -C "$SRC_DIR"
fi
# a venv built for another CPU kind (its clover-isa differs) would die with an illegal instruction
if [ -f "$VENV/pyvenv.cfg" ] && [ "$(cat "$VENV/clover-isa" 2>/dev/null)" != "$(bash bench/llama_isa.sh)" ]; then
    echo "llama.cpp in $VENV was built for other SIMD flags: rebuilding"
    rm -rf "$VENV"
fi
if ! "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
    LLAMA_SDIST="$SDIST" bash bench/build_llama_cpp.sh "$VENV"
fi

export CLOVER_LLAMA_PYTHON="$VENV/bin/python" CLOVER_LLAMA_CPP_SRC="$TREE"
exec python -m pytest -q -rfEs -s tests/oracles/test_llama_oracle.py tests/convert/test_convert.py tests/native/test_kquants.py \
    -k "converter_files or llama or ggml_reference" "$@"
