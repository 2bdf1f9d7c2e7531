"""Quant formats and matmul kernels of native/quant/quants.c against numpy and gguf-py (spec 6).

References:
- fp16: numpy's float16 (all 65536 values widened; narrowing of all fp16 values, the midpoints
  between neighbours (ties to even), one float32 ulp either side of them, overflow edges and
  1M random float32 bit patterns): bit-exact, NaN only checked to stay NaN.
- bf16: a numpy bit-level round-to-nearest-even reference, and gguf-py's BF16 quantiser.
- Q8_0: bytes equal gguf.quants.quantize(x, Q8_0) (ggml's quantize_row_q8_0_ref);
  dequantisation equals gguf.quants.dequantize.
- clover_matmul against float64 numpy on the weights as the kernel sees them (dequantised):
  F32/F16/BF16 with float32 activations, Q8_0 with the activations Q8_0-roundtripped too (the
  kernel quantises them, as llama.cpp does). Error is measured per output relative to
  sum_i |W[r,i] x[t,i]| (the float32 accumulation bound); tolerance 1e-6 for every type (measured: at most 6e-8).
  n_threads 1, 2 and 3 must give bit-identical outputs.
"""
import cffi
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from clover_gguf import _ffi
from clover_gguf._ffi import ffi, lib

TYPES = {"F32": lib.CLOVER_TYPE_F32, "F16": lib.CLOVER_TYPE_F16, "BF16": lib.CLOVER_TYPE_BF16,
         "Q8_0": lib.CLOVER_TYPE_Q8_0}
GGUF_QT = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0}

# clover_matmul is internal (native/quant/matmul.h), not in clover.h: reach it with its own cdef on
# the same library.
_iffi = cffi.FFI()
_iffi.cdef("""
int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x, int64_t T,
                  float *y, int n_threads);
int64_t clover_row_nbytes(int type, int64_t n_in);
""")
_ilib = _iffi.dlopen(_ffi._find_library())


def to_f32(type_name, raw: np.ndarray, n: int) -> np.ndarray:
    out = np.empty(n, dtype=np.float32)
    rc = lib.clover_to_f32(TYPES[type_name], ffi.from_buffer(raw), ffi.from_buffer("float[]", out), n)
    assert rc == lib.CLOVER_OK
    return out


def from_f32(type_name, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    nbytes = lib.clover_type_nbytes(TYPES[type_name], x.size)
    assert nbytes >= 0
    out = np.zeros(nbytes, dtype=np.uint8)
    rc = lib.clover_from_f32(TYPES[type_name], ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size)
    assert rc == nbytes
    return out


# ---------------------------------------------------------------------------- fp16
def test_fp16_to_f32_all_values():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = to_f32("F16", h.view(np.uint8), h.size)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert nan.sum() == 2 * 1023
    assert np.array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(got[nan]).all()
    # NaN keeps sign and payload (binary16 payload in the top mantissa bits)
    hb = h[nan].astype(np.uint32)
    assert np.array_equal(got[nan].view(np.uint32), ((hb & 0x8000) << 16) | 0x7F800000 | ((hb & 0x3FF) << 13))


def _fp16_narrowing_cases(rng) -> np.ndarray:
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    v = h.view(np.float16).astype(np.float32)
    v = v[np.isfinite(v)]
    pos = np.unique(np.abs(v))
    pos64 = pos.astype(np.float64)
    mids = ((pos64[1:] + pos64[:-1]) / 2).astype(np.float32)  # exact: fp16 midpoints fit fp32
    assert np.array_equal(mids.astype(np.float64), (pos64[1:] + pos64[:-1]) / 2)
    above = np.nextafter(mids, np.float32(np.inf))
    below = np.nextafter(mids, np.float32(0))
    edges = np.array([65504, 65519.996, 65520, 65536, 1e9, 2.0 ** -24, 2.0 ** -25, 2.0 ** -26,
                      3 * 2.0 ** -26, 1e-30, 1.5e-45, np.inf], dtype=np.float32)
    rand = rng.integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    allv = np.concatenate([v, mids, above, below, edges, rand])
    return np.concatenate([allv, -allv])


def test_fp32_to_fp16_round_to_nearest_even():
    rng = np.random.default_rng(1)
    x = _fp16_narrowing_cases(rng)
    got = from_f32("F16", x).view(np.uint16)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert nan.any() and (~nan).sum() > 1_000_000
    bad = np.flatnonzero(got[~nan] != ref[~nan])
    assert bad.size == 0, f"{bad.size} mismatches, e.g. x={x[~nan][bad[:5]]}"
    gh = got[nan]
    assert np.isnan(gh.view(np.float16)).all() and (gh & 0x0200).all()  # NaN stays a quiet NaN


# ---------------------------------------------------------------------------- bf16
def _bf16_ref(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even on the bits; NaN -> quiet NaN (ggml_compute_fp32_to_bf16)."""
    u = x.view(np.uint32).astype(np.uint64)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r[nan] = (u[nan] >> 16) | 0x40
    return r.astype(np.uint16)


def test_bf16_to_f32_all_values():
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    got = to_f32("BF16", h.view(np.uint8), h.size)
    assert np.array_equal(got.view(np.uint32), h.astype(np.uint32) << 16)


def test_fp32_to_bf16_round_to_nearest_even():
    rng = np.random.default_rng(2)
    rand = rng.integers(0, 2 ** 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    # ties (low half exactly 0x8000) with even and odd upper halves, and their neighbours
    up = rng.integers(0, 2 ** 16, size=4096, dtype=np.uint64).astype(np.uint32) << 16
    ties = np.concatenate([up | 0x8000, up | 0x7FFF, up | 0x8001, up | 0xFFFF, up])
    special = np.array([0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x7FC00000, 0x7F800001,
                        0xFF800001, 0x00000001, 0x80000000, 0], dtype=np.uint32)
    x = np.concatenate([rand, ties, special]).view(np.float32)
    got = from_f32("BF16", x).view(np.uint16)
    assert np.array_equal(got, _bf16_ref(x))
    assert np.array_equal(got.view(np.uint8), quantize(x, QT.BF16).ravel())


# ---------------------------------------------------------------------------- Q8_0
def _q8_cases(rng) -> np.ndarray:
    blocks = [
        rng.standard_normal((64, 32)),
        rng.standard_normal((16, 32)) * 1e4,
        rng.standard_normal((16, 32)) * 1e-6,
        rng.standard_normal((4, 32)) * 1e-40,         # fp32 subnormal inputs; d flushes to 0
        np.zeros((2, 32)),
        rng.integers(-127, 128, size=(8, 32)),          # exact integers: d == 1
        rng.integers(-3, 4, size=(8, 32)) / 2.0,        # many x*id ties at .5
        np.eye(32)[:4] * -5.0,                          # one nonzero per block
        rng.uniform(-1, 1, size=(16, 32)) ** 9,         # heavy-tailed
    ]
    return np.concatenate(blocks).astype(np.float32).ravel()


def test_q8_0_quantize_equals_gguf_py():
    x = _q8_cases(np.random.default_rng(3))
    got = from_f32("Q8_0", x)
    with np.errstate(all="ignore"):  # gguf-py meets inf/NaN in the subnormal-scale blocks
        ref = quantize(x, QT.Q8_0).ravel()
    assert got.size == x.size // 32 * 34
    assert np.array_equal(got, ref)


def test_q8_0_dequantize_equals_gguf_py():
    rng = np.random.default_rng(4)
    with np.errstate(all="ignore"):
        raw = quantize(_q8_cases(rng), QT.Q8_0).ravel()
    n = raw.size // 34 * 32
    got = to_f32("Q8_0", raw, n)
    assert np.array_equal(got.view(np.uint32), dequantize(raw, QT.Q8_0).ravel().view(np.uint32))
    # arbitrary bytes (any fp16 scale, any int8) dequantise like gguf-py too, NaN/inf included
    raw = rng.integers(0, 256, size=34 * 200, dtype=np.uint8)
    got = to_f32("Q8_0", raw, 32 * 200)
    with np.errstate(all="ignore"):
        ref = dequantize(raw, QT.Q8_0).ravel()
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all()


def test_type_nbytes_and_bad_arguments():
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_F32, 5) == 20
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_F16, 5) == 10
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_BF16, 5) == 10
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q8_0, 64) == 68
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q8_0, 33) == -1
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q4_K, 256) == 144  # ggml block_q4_K
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q4_K, 255) == -1
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q2_K, 256) == 84  # ggml block_q2_K
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_Q3_K, 256) == 110  # ggml block_q3_K
    assert lib.clover_type_nbytes(3, 32) == -1  # Q4_1: not a type of this engine
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_F32, -1) == -1
    assert lib.clover_type_nbytes(lib.CLOVER_TYPE_F32, 2 ** 62) == -1  # bytes overflow int64
    buf = ffi.new("float[64]")
    assert lib.clover_to_f32(lib.CLOVER_TYPE_Q8_0, buf, buf, 33) == lib.CLOVER_E_ARG
    assert lib.clover_to_f32(lib.CLOVER_TYPE_Q4_K, buf, buf, 32) == lib.CLOVER_E_ARG  # 32 % 256 != 0
    assert lib.clover_from_f32(lib.CLOVER_TYPE_Q8_0, buf, buf, 31) < 0
    assert lib.clover_from_f32(99, buf, buf, 32) < 0


# ---------------------------------------------------------------------------- matmul
def matmul(type_name, wraw: np.ndarray, n_in, n_out, x: np.ndarray, n_threads=1) -> np.ndarray:
    T = x.shape[0]
    y = np.full((T, n_out), np.nan, dtype=np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    rc = _ilib.clover_matmul(TYPES[type_name], _iffi.from_buffer(wraw), n_in, n_out,
                             _iffi.from_buffer("float[]", x), T, _iffi.from_buffer("float[]", y), n_threads)
    assert rc == 0
    return y


def _weights(type_name, rng, n_out, n_in):
    """(raw bytes as the kernel reads them, the float32 values they hold)."""
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    raw = quantize(w, GGUF_QT[type_name]).view(np.uint8).ravel() if type_name != "F32" else w.view(np.uint8).ravel()
    wd = dequantize(raw, GGUF_QT[type_name]).reshape(n_out, n_in) if type_name != "F32" else w
    assert np.array_equal(from_f32(type_name, w), raw)  # our quantiser writes the same bytes
    return raw, wd


def _check(type_name, rng, n_in, n_out, T, tol=1e-6):
    raw, wd = _weights(type_name, rng, n_out, n_in)
    x = (rng.standard_normal((T, n_in)) * rng.uniform(0.1, 10, size=(T, 1))).astype(np.float32)
    if type_name == "Q8_0":  # the kernel pairs Q8_0 weights with Q8_0 activations
        xs = dequantize(quantize(x, QT.Q8_0), QT.Q8_0).reshape(T, n_in).astype(np.float64)
    else:
        xs = x.astype(np.float64)
    ref = xs @ wd.astype(np.float64).T
    scale = np.abs(xs) @ np.abs(wd.astype(np.float64)).T
    y1 = matmul(type_name, raw, n_in, n_out, x, 1)
    y2 = matmul(type_name, raw, n_in, n_out, x, 2)
    y3 = matmul(type_name, raw, n_in, n_out, x, 3)
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))
    assert np.array_equal(y1.view(np.uint32), y3.view(np.uint32))
    err = np.abs(y1 - ref) / scale
    assert np.isfinite(y1).all()
    assert err.max() <= tol, f"{type_name} n_in={n_in} n_out={n_out} T={T}: max rel err {err.max():.3g}"
    # one row matmul'd alone equals the same row inside the batch (weights read once for all T)
    if T > 1:
        yt = matmul(type_name, raw, n_in, n_out, x[T // 2:T // 2 + 1], 2)
        assert np.array_equal(yt[0], y1[T // 2])
    return err.max()


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16", "Q8_0"])
@pytest.mark.parametrize("n_in,n_out,T", [(32, 1, 1), (64, 3, 2), (96, 5, 7), (160, 37, 33), (256, 4, 3),
                                          (2048, 131, 5)])
def test_matmul_against_numpy(type_name, n_in, n_out, T):
    rng = np.random.default_rng([n_in, n_out, T, len(type_name)])
    _check(type_name, rng, n_in, n_out, T)


@pytest.mark.parametrize("type_name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("n_in", [1, 7, 9, 33, 1001])
def test_matmul_row_length_not_multiple_of_lanes(type_name, n_in):
    rng = np.random.default_rng(n_in)
    _check(type_name, rng, n_in, 6, 3)


def test_matmul_bad_arguments():
    x = np.ones((1, 33), dtype=np.float32)
    y = np.zeros((1, 2), dtype=np.float32)
    w = np.zeros(2 * 34 * 2, dtype=np.uint8)
    xb, yb, wb = _iffi.from_buffer("float[]", x), _iffi.from_buffer("float[]", y), _iffi.from_buffer(w)
    assert _ilib.clover_matmul(lib.CLOVER_TYPE_Q8_0, wb, 33, 2, xb, 1, yb, 1) == -1  # row not /32
    assert _ilib.clover_matmul(12, wb, 32, 2, xb, 1, yb, 1) == -1                    # Q4_K
    assert _ilib.clover_matmul(lib.CLOVER_TYPE_F32, wb, 0, 2, xb, 1, yb, 1) == -1
    assert _ilib.clover_matmul(lib.CLOVER_TYPE_F32, wb, 8, 2, xb, 0, yb, 1) == 0     # T = 0: nothing
    assert _ilib.clover_row_nbytes(lib.CLOVER_TYPE_Q8_0, 2048) == 2176
