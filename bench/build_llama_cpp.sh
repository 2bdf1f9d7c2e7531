#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 (llama.cpp of 2026-10-01) from source, CPU only, into its own
# virtual environment, for bench/compare.py.
#
# Usage: bench/build_llama_cpp.sh [VENV_DIR]        (default /tmp/llama-venv)
#   LLAMA_SDIST=/path/to/llama_cpp_python-0.3.36.tar.gz  use this sdist instead of downloading
#   PYTHON=python3                                         interpreter for the venv
#   JOBS=2                                                 parallel compile jobs
#
# The SIMD flags come from the CPU at hand (bench/llama_isa.sh: AVX2, plus AVX-512, VNNI and
# BF16 where /proc/cpuinfo lists them); they are recorded in VENV_DIR/clover-isa, so a venv built
# on another CPU kind is rebuilt instead of dying with an illegal instruction.
# AMX is OFF on purpose (see shared/notes/oracles.md): a -DGGML_NATIVE=ON build enables AMX on
# these CPUs and dies with SIGILL on any multi-token batch of a Q8_0 or K-quant model, because
# GCC 12 drops the stores that fill the AMX tile configuration.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"

VENV="${1:-/tmp/llama-venv}"
PY="${PYTHON:-python3}"
VERSION=0.3.36
SDIST="${LLAMA_SDIST:-/tmp/llsrc/llama_cpp_python-${VERSION}.tar.gz}"
JOBS="${JOBS:-$(nproc)}"

if [ ! -f "$SDIST" ]; then
    dl="$(mktemp -d)"
    echo "downloading llama-cpp-python==${VERSION} source into $dl"
    "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==${VERSION}" -d "$dl"
    SDIST="$(ls "$dl"/llama_cpp_python-${VERSION}.tar.gz)"
fi
echo "source: $SDIST"
echo "venv:   $VENV"

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

ISA="$(bash "$HERE/llama_isa.sh")"
echo "isa:    $ISA"
export CMAKE_ARGS="-DGGML_NATIVE=OFF $ISA -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAVA_BUILD=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
export FORCE_CMAKE=1

start=$(date +%s)
"$VENV/bin/python" -m pip install --no-cache-dir "$SDIST"
end=$(date +%s)

"$VENV/bin/python" - <<'PY'
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "system info:", llama_cpp.llama_print_system_info().decode())
PY
echo "$ISA" > "$VENV/clover-isa"
echo "built in $((end - start)) s -> $VENV/bin/python"
