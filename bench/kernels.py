#!/usr/bin/env python3
"""Rates of the CPU product kernels, in GMAC/s (1e9 multiply-adds a second), on this machine.

For each weight type, ``clover_matmul`` (native/quant/matmul.h) of a random matrix (``--rows``
x ``--cols``, quantised by the engine's ``clover_from_f32``; small enough to stay in cache) with
T = 1, 2, 4, 8 activation rows on one thread: T = 1 is the one-row kernel (a decode step's
products), T >= 2 the 4-row kernel (a tail of 2 rows padded to 4). The best of ``--reps`` calls;
a GMAC/s figure counts the MACs of the T rows. With ``--gguf FILE --tensor NAME`` it also times
that tensor of a GGUF (read from memory, not cache: e.g. ``output.weight``, the LM head) on
``--threads`` threads, in ms per product.

The figures show where batching rows stops being free: a product whose T-row time is near its
one-row time is bound by reading the weights, one whose time grows with T by the arithmetic.

Usage: python bench/kernels.py [--types Q4_K,Q6_K,Q8_0] [--gguf F --tensor output.weight] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import cffi
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from clover_gguf import _ffi  # noqa: E402
from clover_gguf._ffi import lib  # noqa: E402

_ffi_k = cffi.FFI()
_ffi_k.cdef("""
int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x, int64_t T,
                  float *y, int n_threads);
int64_t clover_from_f32(int type, const float *src, void *dst, int64_t n);
int64_t clover_type_nbytes(int type, int64_t n);
""")
K = _ffi_k.dlopen(_ffi._find_library())
ROWS = (1, 2, 4, 8)


def _type_id(name: str) -> int:
    tid = getattr(lib, f"CLOVER_TYPE_{name}", None)
    if tid is None:
        raise SystemExit(f"--types: unknown type {name!r}")
    return int(tid)


def _time(type_id: int, W: np.ndarray, n_in: int, n_out: int, T: int, reps: int, threads: int) -> float:
    """Best seconds of ``reps`` calls of clover_matmul(W, T random rows)."""
    x = np.random.default_rng(T).standard_normal((T, n_in)).astype(np.float32)
    y = np.zeros((T, n_out), np.float32)
    wp, xp, yp = (_ffi_k.cast("void *", W.ctypes.data), _ffi_k.cast("float *", x.ctypes.data),
                  _ffi_k.cast("float *", y.ctypes.data))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        if K.clover_matmul(type_id, wp, n_in, n_out, xp, T, yp, threads) != 0:
            raise SystemExit(f"clover_matmul failed (type {type_id}, T={T})")
        best = min(best, time.perf_counter() - t0)
    return best


def in_cache(name: str, rows: int, cols: int, reps: int) -> dict:
    """GMAC/s of one thread for each T of ROWS on a random rows x cols matrix of type name."""
    tid = _type_id(name)
    w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32) * 0.05
    W = np.zeros(K.clover_type_nbytes(tid, rows * cols), np.uint8)
    if K.clover_from_f32(tid, _ffi_k.cast("float *", w.ctypes.data), _ffi_k.cast("void *", W.ctypes.data),
                         w.size) != W.size:
        raise SystemExit(f"--types: {name} cannot be quantised by the engine")
    return {T: T * rows * cols / _time(tid, W, cols, rows, T, reps, 1) / 1e9 for T in ROWS}


def from_gguf(path: str, tensor: str, reps: int, threads: int) -> dict:
    """ms per product of the GGUF tensor for each T of ROWS on ``threads`` threads."""
    from gguf import GGUFReader

    t = next((t for t in GGUFReader(path).tensors if t.name == tensor), None)
    if t is None:
        raise SystemExit(f"--tensor: no tensor {tensor!r} in {path}")
    n_in, n_out = int(t.shape[0]), int(np.prod([int(v) for v in t.shape[1:]]))
    W = np.ascontiguousarray(t.data).view(np.uint8)
    tid = _type_id(t.tensor_type.name)
    return {"type": t.tensor_type.name, "shape": [n_out, n_in], "mbytes": W.size / 1e6,
            "ms": {T: 1e3 * _time(tid, W, n_in, n_out, T, reps, threads) for T in ROWS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default="Q4_K,Q5_K,Q6_K,Q8_0,Q4_0")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--gguf")
    ap.add_argument("--tensor", default="output.weight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.rows <= 0 or a.cols <= 0 or a.cols % 256 or a.reps <= 0 or a.threads <= 0:
        raise SystemExit("--rows, --reps, --threads: > 0; --cols: a multiple of 256")
    out = {"cache": {name: in_cache(name, a.rows, a.cols, a.reps) for name in a.types.split(",")}}
    if a.gguf:
        out["gguf"] = from_gguf(a.gguf, a.tensor, max(3, a.reps // 40), a.threads)
    if a.json:
        print(json.dumps(out, indent=1))
        return
    print(f"one thread, {a.rows} x {a.cols} in cache, GMAC/s with T activation rows:")
    print("| type | " + " | ".join(f"T={T}" for T in ROWS) + " |")
    print("|---|" + "---:|" * len(ROWS))
    for name, r in out["cache"].items():
        print(f"| {name} | " + " | ".join(f"{r[T]:.1f}" for T in ROWS) + " |")
    if a.gguf:
        g = out["gguf"]
        one = g["ms"][1]
        print(f"{a.tensor} ({g['type']}, {g['shape'][0]} x {g['shape'][1]}, {g['mbytes']:.0f} MB), {a.threads} threads: "
              + ", ".join(f"T={T} {ms:.2f} ms ({ms / one:.2f}x)" for T, ms in g["ms"].items()))


if __name__ == "__main__":
    main()
