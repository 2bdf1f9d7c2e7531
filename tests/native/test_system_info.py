"""clover_system_info (native/core/system.c): the line names the kernels' ISA that the dispatch
chose (clover_dot_best_isa), and $CLOVER_ISA lowers both alike."""
import os
import subprocess
import sys

import cffi

from clover_gguf._ffi import _find_library, ffi, lib

_ffi = cffi.FFI()
_ffi.cdef("int clover_dot_best_isa(void);")
_L = _ffi.dlopen(_find_library())
NAMES = {0: "scalar", 1: "avx2", 2: "avx512-vnni"}


def _fields(line: str) -> dict:
    return dict(part.split(" = ", 1) for part in line.split(" | "))


def test_names_the_chosen_kernels():
    f = _fields(ffi.string(lib.clover_system_info()).decode())
    assert f["kernels"] == NAMES[_L.clover_dot_best_isa()]
    assert set(f) >= {"AVX2", "FMA", "F16C", "AVX512", "AVX512_VNNI", "OPENMP", "CUDA"}
    assert all(f[k] in ("0", "1") for k in f if k != "kernels")
    if f["kernels"] != "scalar":
        assert f["AVX2"] == f["FMA"] == f["F16C"] == "1"


def test_clover_isa_lowers_it():
    code = "from clover_gguf._ffi import ffi, lib; print(ffi.string(lib.clover_system_info()).decode())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "CLOVER_ISA": "scalar"},
                         capture_output=True, text=True, check=True).stdout
    assert _fields(out.strip())["kernels"] == "scalar"
