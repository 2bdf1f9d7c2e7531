#!/usr/bin/env python3
"""Speed of the GPU's kernels alone, everything on the device:

- weight products: one [ne1][ne0] weight matrix of each type times T activation rows
  (clover_cuda_matmul_d), for T = 1 (decode), 32 (a block forward) and 512 (a prefill pass),
  with and without tensor cores (CLOVER_CUDA_MMA=0) where T >= 16 (fewer rows never take them);
- attention against a KV cache of ``--keys`` rows at 35B-A3B's heads (16 query heads, 2 KV
  heads, head_dim 256; clover_cuda_attention_d): a decode step (1 row, causal), a 32-row block
  pass and the last 512 rows of a prefill (causal), the last two with and without tensor cores,
  with an F32 and an F16 cache (``-ctk/-ctv f16``);
- the Gated DeltaNet block operator's mixing (spec 3.3 steps 3-4, clover_cuda_gdn_block_d) at
  35B-A3B's GDN heads (16 key and 32 value heads of 128) for ``--gdn-rows`` block rows; its bytes
  are the clean state's (read once per tile of 8 rows, from L2 after the first).

Printed per case: microseconds per call, the bytes read per second (weights; K and V; the state), that as
a percentage of the device's copy bandwidth measured here (2 x bytes / time of a
device-to-device copy of 1 GiB: read plus write), and for products the multiply-adds per second
(2 ne0 ne1 T / time, TFLOP/s). Each figure is the best of ``--reps`` timings of ``--iters`` calls
in a row (launches are asynchronous; a 4-byte read waits for the device).

Usage: python bench/gpu_kernels.py [--ne0 2048] [--ne1 32768] [--types Q4_K,Q6_K,Q8_0,BF16,F16]
       [--rows 1,32,512] [--keys 4096] [--gdn-rows 32,512] [--iters 20] [--reps 3] [--json]
Needs a library with the CUDA backend (CLOVER_LIB) and a GPU, or the emulator for a smoke run
with small sizes. Nothing here imports torch.
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
from clover_gguf._ffi import ffi, lib  # noqa: E402

_cffi = cffi.FFI()
_cffi.cdef("""
typedef struct { int type; const void *dev; int64_t ne0, ne1, stride; } clover_cuda_weight;
int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size);
int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size);
void clover_cuda_free(void *dev);
int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size);
int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size);
int clover_cuda_matmul_d(int n, const clover_cuda_weight *w, const float *x, int64_t T, float *const *y, char *err,
                         size_t err_size);
int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size);
int clover_cuda_attention_d(const float *q, const void *k_cache, const void *v_cache, int kv_f16, const int64_t *pos,
                            int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale, float *out,
                            char *err, size_t err_size);
int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                            const float *state, const float *lambda, const float *beta0, const float *c,
                            const int64_t *pos, float *o, char *err, size_t err_size);
""")
_clib = _cffi.dlopen(_ffi._find_library())
_err = _cffi.new("char[]", 256)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {_cffi.string(_err).decode()} (rc {rc})")


def _alloc(nbytes: int):
    p = _cffi.new("void **")
    _check(_clib.clover_cuda_alloc(nbytes, p, _err, 256), "clover_cuda_alloc")
    return p[0]


def _wait(dev) -> None:
    """Waits for the device (a read of 4 bytes after the queued launches)."""
    buf = _cffi.new("char[]", 4)
    _check(_clib.clover_cuda_read(dev, 0, buf, 4, _err, 256), "clover_cuda_read")


def _best(fn, iters: int, reps: int, dev) -> float:
    """Seconds per call of fn: the best of reps runs of iters calls."""
    fn()
    _wait(dev)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        _wait(dev)
        best = min(best, (time.perf_counter() - t) / iters)
    return best


def copy_bandwidth(nbytes: int, iters: int, reps: int) -> float:
    """Bytes/s read plus written by a device-to-device copy of nbytes."""
    a, b = _alloc(nbytes), _alloc(nbytes)
    try:
        def copy():
            _check(_clib.clover_cuda_copy(b, a, nbytes, _err, 256), "copy")
        return 2 * nbytes / _best(copy, iters, reps, b)
    finally:
        _clib.clover_cuda_free(a), _clib.clover_cuda_free(b)


def quantise(type_name: str, ne0: int, ne1: int, rng) -> tuple[int, np.ndarray]:
    """(ggml type, bytes) of a random normal [ne1][ne0] matrix in type_name."""
    type_ = int(getattr(lib, f"CLOVER_TYPE_{type_name}"))
    w = rng.standard_normal((ne1, ne0)).astype(np.float32)
    n = lib.clover_type_nbytes(type_, w.size)
    q = np.zeros(n, np.uint8)
    if lib.clover_from_f32(type_, ffi.cast("float *", w.ctypes.data), ffi.cast("void *", q.ctypes.data), w.size) != n:
        raise RuntimeError(f"clover_from_f32 {type_name}")
    return type_, q


def run(ne0: int, ne1: int, types: list[str], rows: list[int], iters: int, reps: int) -> dict:
    rng = np.random.default_rng(0)
    bw = copy_bandwidth(1 << 30 if ne1 * ne0 >= 1 << 24 else 1 << 20, iters, reps)
    T_max = max(rows)
    xs = rng.standard_normal((T_max, ne0)).astype(np.float32)
    xdev = _cffi.new("void **")
    _check(_clib.clover_cuda_upload(_cffi.cast("void *", xs.ctypes.data), xs.nbytes, xdev, _err, 256), "upload x")
    x, y = xdev[0], _alloc(4 * T_max * ne1)
    out = {"ne0": ne0, "ne1": ne1, "copy_bandwidth": bw, "cases": []}
    try:
        for name in types:
            type_, q = quantise(name, ne0, ne1, rng)
            wdev = _cffi.new("void **")
            _check(_clib.clover_cuda_upload(_cffi.cast("void *", q.ctypes.data), q.size, wdev, _err, 256), "upload w")
            w = _cffi.new("clover_cuda_weight *", [type_, wdev[0], ne0, ne1, 0])
            yp = _cffi.new("float *[1]", [_cffi.cast("float *", y)])
            try:
                for T in rows:
                    for mma in (("1", "0") if T >= 16 else ("1",)):
                        os.environ["CLOVER_CUDA_MMA"] = mma
                        s = _best(lambda: _check(_clib.clover_cuda_matmul_d(1, w, _cffi.cast("float *", x), T, yp,
                                                                            _err, 256), "matmul_d"), iters, reps, y)
                        out["cases"].append({"type": name, "T": T, "mma": mma == "1" if T >= 16 else None,
                                             "us": s * 1e6, "weight_bytes_per_s": q.size / s,
                                             "tflops": 2 * ne0 * ne1 * T / s / 1e12,
                                             "pct_bandwidth": 100 * q.size / s / bw})
            finally:
                _clib.clover_cuda_free(wdev[0])
    finally:
        os.environ.pop("CLOVER_CUDA_MMA", None)
        _clib.clover_cuda_free(x), _clib.clover_cuda_free(y)
    return out


def attention(n_keys: int, bw: float, iters: int, reps: int, n_head: int = 16, n_kv: int = 2, hd: int = 256) -> list:
    """Cases of clover_cuda_attention_d over a cache of n_keys rows (random values), F32 and F16: a
    decode step (row n_keys - 1, causal), a 32-row block pass (its rows the cache's last 32) and
    a 512-row prefill pass (causal, the last 512 rows; where n_keys >= 512), the last two with
    tensor cores (k_attention_mma) and without (CLOVER_CUDA_MMA=0: k_attention)."""
    rng = np.random.default_rng(1)
    kvd, T_max = n_kv * hd, min(512, n_keys)
    kv = rng.standard_normal((n_keys, kvd)).astype(np.float32)
    q = (rng.standard_normal((T_max, n_head, 2 * hd)) * 0.1).astype(np.float32)
    bufs = {}
    try:
        for name, a in (("k", kv), ("k16", kv.astype(np.float16)), ("q", q)):
            p = _cffi.new("void **")
            _check(_clib.clover_cuda_upload(_cffi.cast("void *", a.ctypes.data), a.nbytes, p, _err, 256), "upload")
            bufs[name] = p[0]
        bufs["o"], bufs["pos"] = _alloc(4 * T_max * n_head * hd), _alloc(8)
        cases = []
        shapes = [(1, 1, "decode"), (32, 0, "block32")] + ([(512, 1, "prefill512")] if n_keys >= 512 else [])
        for cache, kv_f16, es in (("f32", 0, 4), ("f16", 3, 2)):  # K and V: the same buffer, read twice
            k = bufs["k16" if kv_f16 else "k"]
            for T, causal, what in shapes:
                pos = _cffi.new("int64_t *", n_keys - T)
                _check(_clib.clover_cuda_write(bufs["pos"], 0, pos, 8, _err, 256), "write pos")

                def call():
                    _check(_clib.clover_cuda_attention_d(_cffi.cast("float *", bufs["q"]), k, k, kv_f16,
                                                         _cffi.cast("int64_t *", bufs["pos"]), T, n_head, n_kv, hd,
                                                         causal, hd ** -0.5, _cffi.cast("float *", bufs["o"]), _err,
                                                         256), "attention_d")
                for mma in (("1", "0") if T > 1 else ("1",)):
                    os.environ["CLOVER_CUDA_MMA"] = mma
                    s = _best(call, iters, reps, bufs["o"])
                    kv_bytes = 2 * n_keys * kvd * es
                    cases.append({"case": what, "cache": cache, "keys": n_keys, "rows": T,
                                  "mma": mma == "1" if T > 1 else None, "us": s * 1e6,
                                  "kv_bytes_per_s": kv_bytes / s, "pct_bandwidth": 100 * kv_bytes / s / bw})
        return cases
    finally:
        os.environ.pop("CLOVER_CUDA_MMA", None)
        for p in bufs.values():
            _clib.clover_cuda_free(p)


def gdn_block(rows: list[int], bw: float, iters: int, reps: int, Hk: int = 16, Hv: int = 32, dk: int = 128,
              dv: int = 128) -> list:
    """Cases of clover_cuda_gdn_block_d for each T in rows (random conv rows, state and per-head
    constants; P = 1000 in device memory): microseconds, and the state's bytes per second."""
    rng = np.random.default_rng(2)
    C, T_max = 2 * Hk * dk + Hv * dv, max(rows)
    arrays = {"conv": (rng.standard_normal((T_max, C)) * 0.1).astype(np.float32),
              "S": (rng.standard_normal((Hv, dk, dv)) * 0.1).astype(np.float32),
              "lam": rng.uniform(0.0, 2.0, Hv).astype(np.float32), "beta0": rng.standard_normal(Hv).astype(np.float32),
              "c": rng.uniform(0.0, 1.0, Hv).astype(np.float32), "pos": np.array([1000], np.int64)}
    bufs = {}
    try:
        for name, a in arrays.items():
            p = _cffi.new("void **")
            _check(_clib.clover_cuda_upload(_cffi.cast("void *", a.ctypes.data), a.nbytes, p, _err, 256), "upload")
            bufs[name] = p[0]
        bufs["o"] = _alloc(4 * T_max * Hv * dv)
        f = {k: _cffi.cast("float *", v) for k, v in bufs.items()}
        cases = []
        for T in rows:
            def call():
                _check(_clib.clover_cuda_gdn_block_d(f["conv"], T, Hk, Hv, dk, dv, C, f["S"], f["lam"], f["beta0"],
                                                     f["c"], _cffi.cast("int64_t *", bufs["pos"]), f["o"], _err, 256),
                       "gdn_block_d")
            s = _best(call, iters, reps, bufs["o"])
            state_bytes = 4 * Hv * dk * dv
            cases.append({"rows": T, "us": s * 1e6, "state_bytes_per_s": state_bytes / s,
                          "pct_bandwidth": 100 * state_bytes / s / bw})
        return cases
    finally:
        for p in bufs.values():
            _clib.clover_cuda_free(p)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ne0", type=int, default=2048)
    ap.add_argument("--ne1", type=int, default=32768)
    ap.add_argument("--types", default="Q4_K,Q6_K,Q8_0,BF16,F16")
    ap.add_argument("--rows", default="1,32,512")
    ap.add_argument("--keys", type=int, default=4096, help="KV cache rows of the attention cases (0: none)")
    ap.add_argument("--gdn-rows", default="32,512", help="block rows of the GDN block operator's cases ('': none)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="also print the results as one JSON line")
    a = ap.parse_args(argv)
    gdn_rows = [int(t) for t in a.gdn_rows.split(",") if t]
    if a.ne0 <= 0 or a.ne0 % 256 or a.ne1 <= 0 or a.iters <= 0 or a.reps <= 0 or a.keys < 0 or 0 < a.keys < 32 or \
            any(t <= 0 for t in gdn_rows):
        ap.error("--ne0 must be a positive multiple of 256; --ne1, --iters, --reps, --gdn-rows positive; --keys 0 or "
                 ">= 32")
    info = ffi.new("char[]", 256)
    if lib.clover_gpu_devices(info, 256) <= 0:
        print(f"no GPU: {ffi.string(info).decode()}", file=sys.stderr)
        return 1
    r = run(a.ne0, a.ne1, a.types.split(","), [int(t) for t in a.rows.split(",")], a.iters, a.reps)
    print(f"{ffi.string(info).decode()}; weights [{a.ne1}][{a.ne0}]; device copy bandwidth "
          f"{r['copy_bandwidth'] / 1e9:.0f} GB/s (read + write)")
    print(f"{'type':6s} {'rows':>5s} {'tensor cores':>12s} {'us':>10s} {'GB/s':>8s} {'% bw':>6s} {'TFLOP/s':>8s}")
    for c in r["cases"]:
        tc = "-" if c["mma"] is None else "yes" if c["mma"] else "no"
        print(f"{c['type']:6s} {c['T']:5d} {tc:>12s} {c['us']:10.1f} "
              f"{c['weight_bytes_per_s'] / 1e9:8.1f} {c['pct_bandwidth']:6.1f} {c['tflops']:8.2f}")
    if a.keys:
        r["attention"] = attention(a.keys, r["copy_bandwidth"], a.iters, a.reps)
        print("attention (16 heads, 2 KV heads, head_dim 256)")
        for c in r["attention"]:
            tc = "-" if c["mma"] is None else "yes" if c["mma"] else "no"
            print(f"{c['case']:10s} {c['cache']} {c['keys']:6d} keys {c['rows']:3d} rows tensor cores {tc:3s} "
                  f"{c['us']:10.1f} us {c['kv_bytes_per_s'] / 1e9:8.1f} GB/s of K and V {c['pct_bandwidth']:6.1f} % bw")
    if gdn_rows:
        r["gdn_block"] = gdn_block(gdn_rows, r["copy_bandwidth"], a.iters, a.reps)
        print("GDN block operator (16 key and 32 value heads of 128)")
        for c in r["gdn_block"]:
            print(f"{c['rows']:4d} rows {c['us']:10.1f} us {c['state_bytes_per_s'] / 1e9:8.1f} GB/s of the state "
                  f"{c['pct_bandwidth']:6.1f} % bw")
    if a.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
