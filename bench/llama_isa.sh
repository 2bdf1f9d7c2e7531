#!/usr/bin/env bash
# The ggml SIMD CMake flags for the CPU at hand, from /proc/cpuinfo: AVX, AVX2, FMA and F16C
# always (every x86-64 CPU this project runs on has them), AVX-512 F/VNNI/BF16 and AVX-VNNI
# each only where the CPU lists it. Printed on one line for CMAKE_ARGS.
set -euo pipefail
flags="$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)"
has() { [[ " $flags " == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }
echo "-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
     "-DGGML_AVX512=$(onoff avx512f) -DGGML_AVX512_VNNI=$(onoff avx512_vnni)" \
     "-DGGML_AVX512_BF16=$(onoff avx512_bf16) -DGGML_AVX_VNNI=$(onoff avx_vnni)"
