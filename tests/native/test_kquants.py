"""Block formats of native/quant/kquants.c and kquants23.c against gguf-py and ggml's reference
quantisers (spec 6).

Types: Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 (weights) and Q8_K (activations).
References:
- type ids and block sizes/bytes: gguf's GGMLQuantizationType and GGML_QUANT_SIZES.
- Q4_0 and MXFP4 bytes equal gguf.quants.quantize (gguf-py's numpy ports of ggml's reference).
- dequantisation equals gguf.quants.dequantize bit for bit, on random bytes and on our bytes
  (Q8_K: gguf has no Q8_K; checked against numpy d*q, and bsums against the q sums).
- bytes equal ggml's own quantize_row_*_ref for all ten types: ggml-quants.c from the
  llama.cpp source under /tmp/llsrc (read-only, never committed) is compiled into a throwaway
  shared library in pytest's tmp dir; skipped when the source or a C compiler is absent.
- quantise -> dequantise error on N(0,1) data (65536 values, seed 1), as RMSE relative to the
  data's RMS, under these bounds (measured value in brackets, equal to ggml's reference
  quantiser on the same data):
    Q2_K 0.31 (0.2982)  Q3_K 0.158 (0.1513)
    Q4_0 0.090 (0.0865)  Q4_K 0.075 (0.0719)  Q5_K 0.038 (0.0363)  Q6_K 0.019 (0.0178)
    IQ4_NL 0.082 (0.0789)  IQ4_XS 0.081 (0.0769)  MXFP4 0.120 (0.1161)  Q8_K 0.0075 (0.0070)
  and Q8_K per element within half a step (|x - d*q| <= |d|/2).
Q8_K bytes also equal a numpy transcription of ggml's quantize_row_q8_K_ref (the activation
quantiser llama.cpp runs on x86), on the AVX-512 path and the portable one.
"""
import shutil
import subprocess

import cffi
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from clover_gguf import _ffi
from clover_gguf._ffi import ffi, lib

NAMES = ["Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ4_NL", "IQ4_XS", "MXFP4"]
TYPE = {n: getattr(lib, f"CLOVER_TYPE_{n}") for n in NAMES}
GGUF_DEQ = [n for n in NAMES if n != "Q8_K"]  # gguf 0.19 has no Q8_K
REL_RMSE_BOUND = {"Q2_K": 0.31, "Q3_K": 0.158, "Q4_0": 0.090, "Q4_K": 0.075, "Q5_K": 0.038, "Q6_K": 0.019,
                  "IQ4_NL": 0.082, "IQ4_XS": 0.081, "MXFP4": 0.120, "Q8_K": 0.0075}

_iffi = cffi.FFI()
_iffi.cdef("""
int64_t clover_kq_nbytes(int type, int64_t n);
int clover_kq_to_f32(int type, const void *src, float *dst, int64_t n);
int64_t clover_kq_from_f32(int type, const float *src, void *dst, int64_t n);
int64_t clover_row_nbytes(int type, int64_t n_in);
""")
_ilib = _iffi.dlopen(_ffi._find_library())


def block(name):
    return GGML_QUANT_SIZES[QT[name]]  # (values, bytes)


def quant(name, x):
    """Our bytes for float32 x through the public clover_from_f32."""
    x = np.ascontiguousarray(x, dtype=np.float32).ravel()
    nbytes = _ilib.clover_kq_nbytes(TYPE[name], x.size)
    assert nbytes >= 0
    out = np.zeros(nbytes, dtype=np.uint8)
    rc = lib.clover_from_f32(TYPE[name], ffi.from_buffer("float[]", x), ffi.from_buffer(out), x.size)
    assert rc == nbytes
    return out


def dequant(name, raw, n):
    """Our float32 values through the public clover_to_f32."""
    out = np.empty(n, dtype=np.float32)
    rc = lib.clover_to_f32(TYPE[name], ffi.from_buffer(np.ascontiguousarray(raw)), ffi.from_buffer("float[]", out), n)
    assert rc == lib.CLOVER_OK
    return out


def sample(kind, n, bs, rng):
    """float32 test data of n values (n a multiple of the block size bs)."""
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "heavy":  # Student-t(3): outliers
        return rng.standard_t(3, n).astype(np.float32)
    if kind == "scaled":  # every block at its own scale, 1e-6 .. 1e3
        return (rng.standard_normal(n) * np.repeat(10.0 ** rng.uniform(-6, 3, n // bs), bs)).astype(np.float32)
    if kind == "edge":  # zero blocks, constant blocks, one-sign blocks, tiny and ties
        x = rng.standard_normal(n).astype(np.float32)
        nb = n // bs
        x[0:bs] = 0.0
        if nb > 1:
            x[bs:2 * bs] = 0.75
        if nb > 2:
            x[2 * bs:3 * bs] = -np.abs(x[2 * bs:3 * bs])
        if nb > 3:
            x[3 * bs:4 * bs] = np.abs(x[3 * bs:4 * bs])
        if nb > 4:
            x[4 * bs:5 * bs] *= 1e-30  # sub-fp16 scales
        if nb > 5:
            x[5 * bs:6 * bs] = rng.integers(-8, 8, bs) * 0.5  # exact grid points and midpoints
        if nb > 6:
            x[6 * bs] = 1e4  # one large outlier
        return x
    raise ValueError(kind)


KINDS = ["normal", "heavy", "scaled", "edge"]


# ------------------------------------------------------------------------ ids and sizes
@pytest.mark.parametrize("name", NAMES)
def test_type_ids_and_sizes_match_gguf(name):
    assert TYPE[name] == int(QT[name])
    bs, nbytes = block(name)
    assert _ilib.clover_kq_nbytes(TYPE[name], 7 * bs) == 7 * nbytes
    assert _ilib.clover_kq_nbytes(TYPE[name], 0) == 0
    assert _ilib.clover_kq_nbytes(TYPE[name], bs + 16) == -1
    assert _ilib.clover_kq_nbytes(TYPE[name], -bs) == -1
    # weight types with a dot kernel (dot.h) are engine types; Q8_K is activation-only
    assert _ilib.clover_row_nbytes(TYPE[name], bs) == (-1 if name == "Q8_K" else nbytes)
    assert lib.clover_type_nbytes(TYPE[name], 7 * bs) == 7 * nbytes


def test_kq_nbytes_rejects_other_types():
    for t in (lib.CLOVER_TYPE_F32, lib.CLOVER_TYPE_F16, lib.CLOVER_TYPE_Q8_0, 3, 16, 99):
        assert _ilib.clover_kq_nbytes(t, 256) == -1


@pytest.mark.parametrize("name", NAMES)
def test_bad_lengths_are_errors(name):
    bs, nbytes = block(name)
    x = np.zeros(bs + 16, dtype=np.float32)
    buf = np.zeros(2 * nbytes, dtype=np.uint8)
    assert lib.clover_from_f32(TYPE[name], ffi.from_buffer("float[]", x), ffi.from_buffer(buf), x.size) < 0
    y = np.zeros(bs + 16, dtype=np.float32)
    assert lib.clover_to_f32(TYPE[name], ffi.from_buffer(buf), ffi.from_buffer("float[]", y), y.size) == lib.CLOVER_E_ARG
    assert lib.clover_from_f32(TYPE[name], ffi.NULL, ffi.NULL, bs) < 0
    assert lib.clover_to_f32(TYPE[name], ffi.NULL, ffi.NULL, bs) == lib.CLOVER_E_ARG
    # zero values: nothing to do, no pointers needed
    assert lib.clover_from_f32(TYPE[name], ffi.NULL, ffi.NULL, 0) == 0
    assert lib.clover_to_f32(TYPE[name], ffi.NULL, ffi.NULL, 0) == lib.CLOVER_OK


# ------------------------------------------------------------------------ gguf quantisers
@pytest.mark.parametrize("name", ["Q4_0", "MXFP4"])
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_equal_gguf_quantize(name, kind):
    bs, nbytes = block(name)
    rng = np.random.default_rng([TYPE[name], KINDS.index(kind)])
    x = sample(kind, 64 * bs, bs, rng)
    ours = quant(name, x)
    ref = quantize(x.reshape(8, -1), QT[name]).reshape(-1)
    assert ours.size == ref.size
    np.testing.assert_array_equal(ours, ref)


# ------------------------------------------------------------------------ dequantisation
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf's numpy on inf/NaN scales
@pytest.mark.parametrize("name", GGUF_DEQ)
def test_dequantize_random_bytes_equals_gguf(name):
    bs, nbytes = block(name)
    rng = np.random.default_rng(TYPE[name])
    nb = 400
    raw = rng.integers(0, 256, (nb, nbytes), dtype=np.uint8)
    # keep fp16 scales finite and moderate (random exponent bits 0..0x5b = |d| < 2^8)
    # except in the first 8 blocks, which keep fully random bytes (inf/NaN scales included)
    for off in {"Q4_0": [0], "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0],
                "IQ4_XS": [0], "MXFP4": []}[name]:
        raw[8:, off + 1] &= 0x5B
    if name == "MXFP4":
        raw[8:, 0] %= 250  # E8M0 exponent: keep 12 * 2^(e-128) finite
    got = dequant(name, raw.reshape(-1), nb * bs)
    ref = dequantize(raw, QT[name]).reshape(-1).astype(np.float32)
    np.testing.assert_array_equal(got, ref)  # NaN positions must match too
    assert np.isfinite(got[8 * bs:]).all()


@pytest.mark.parametrize("name", GGUF_DEQ)
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_reads_our_bytes(name, kind):
    bs, nbytes = block(name)
    rng = np.random.default_rng(1000 + TYPE[name])
    x = sample(kind, 32 * bs, bs, rng)
    raw = quant(name, x)
    ours = dequant(name, raw, x.size)
    ref = dequantize(raw.reshape(-1, nbytes), QT[name]).reshape(-1).astype(np.float32)
    np.testing.assert_array_equal(ours, ref)
    assert np.isfinite(ours).all()
    if kind == "edge":
        np.testing.assert_array_equal(ours[:bs], 0.0)  # an all-zero block stays zero


def q8k_numpy(raw):
    """numpy Q8_K decode: (d float32, q int8[256], bsums int16[16]) per block."""
    blocks = raw.reshape(-1, 292)
    d = blocks[:, :4].copy().view(np.float32)
    q = blocks[:, 4:260].copy().view(np.int8)
    bsums = blocks[:, 260:].copy().view(np.int16)
    return d, q, bsums


@pytest.mark.parametrize("kind", KINDS)
def test_q8_k_against_numpy(kind):
    rng = np.random.default_rng(7)
    x = sample(kind, 32 * 256, 256, rng)
    raw = quant("Q8_K", x)
    d, q, bsums = q8k_numpy(raw)
    np.testing.assert_array_equal(bsums, q.reshape(-1, 16, 16).astype(np.int32).sum(-1))
    y = dequant("Q8_K", raw, x.size)
    np.testing.assert_array_equal(y, (d * q.astype(np.float32)).reshape(-1))
    xb = x.reshape(-1, 256)
    amax = np.abs(xb).max(1)
    np.testing.assert_array_equal(np.abs(q).max(1)[amax > 0], 127)  # the largest |x| maps to 127
    err = np.abs(y.reshape(-1, 256) - xb)
    assert (err <= np.abs(d) * (0.5 + 1e-5) + 1e-30).all()
    # random bytes decode as d*q too
    raw = rng.integers(0, 256, 10 * 292, dtype=np.uint8)
    raw.reshape(-1, 292)[:, 3] &= 0x3F  # finite d
    d, q, _ = q8k_numpy(raw)
    np.testing.assert_array_equal(dequant("Q8_K", raw, 2560), (d * q.astype(np.float32)).reshape(-1))


# ------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("name", NAMES)
def test_roundtrip_error_bound(name):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(65536).astype(np.float32)
    y = dequant(name, quant(name, x), x.size)
    rel = np.sqrt(np.mean((y.astype(np.float64) - x) ** 2) / np.mean(x.astype(np.float64) ** 2))
    assert rel <= REL_RMSE_BOUND[name], (name, rel)
    assert rel > 0.0


def test_more_bits_less_error():
    rng = np.random.default_rng(2)
    x = rng.standard_normal(16384).astype(np.float32)
    err = {n: float(np.sqrt(np.mean((dequant(n, quant(n, x), x.size) - x) ** 2))) for n in NAMES}
    assert err["Q8_K"] < err["Q6_K"] < err["Q5_K"] < err["Q4_K"] < err["Q4_0"] < err["MXFP4"] < err["Q3_K"] < err["Q2_K"]
    assert err["IQ4_XS"] < err["Q4_0"] and err["IQ4_NL"] < err["Q4_0"]


@pytest.mark.parametrize("name", NAMES)
def test_scale_invariance(name):
    """Scaling the data by a power of two scales the values exactly (no fp16 over/underflow)."""
    bs, _ = block(name)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(8 * bs).astype(np.float32)
    y1 = dequant(name, quant(name, x), x.size)
    y2 = dequant(name, quant(name, x * np.float32(4.0)), x.size)
    np.testing.assert_array_equal(y2, y1 * np.float32(4.0))


# ------------------------------------------------------------------------ ggml oracle
from llamacpp import LLAMA_CPP_SRC as LLAMA_CPP  # noqa: E402  (llama.cpp source tree, read only)
GGML_QUANTS_C = LLAMA_CPP / "ggml" / "src" / "ggml-quants.c"
_STUBS = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
void ggml_abort(const char *file, int line, const char *fmt, ...) { fprintf(stderr, "%s:%d\n", file, line); abort(); }
size_t ggml_row_size(int t, long long n) { (void)t; (void)n; abort(); }
const char *ggml_type_name(int t) { (void)t; return "?"; }
size_t ggml_type_size(int t) { (void)t; abort(); }
"""


@pytest.fixture(scope="module")
def ggml_ref(tmp_path_factory):
    """ggml's scalar reference quantisers, built from the read-only llama.cpp source (no FMA
    contraction: plain -O2 for generic x86-64, as our library is built)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not GGML_QUANTS_C.is_file() or cc is None:
        pytest.skip("llama.cpp source or C compiler not present")
    d = tmp_path_factory.mktemp("ggmlref")
    (d / "stubs.c").write_text(_STUBS)
    so = d / "libggmlq.so"
    g = LLAMA_CPP / "ggml"
    subprocess.run([cc, "-O2", "-std=c11", "-fPIC", "-shared", "-ffp-contract=off", "-D_GNU_SOURCE",
                    f"-I{g / 'include'}", f"-I{g / 'src'}", str(GGML_QUANTS_C), str(d / "stubs.c"),
                    "-o", str(so), "-lm"], check=True, capture_output=True)
    f = cffi.FFI()
    f.cdef("\n".join(f"void quantize_row_{n.lower().replace('_k', '_K')}_ref(const float *x, void *y, int64_t k);"
                     for n in NAMES))
    return f, f.dlopen(str(so))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_bytes_equal_ggml_reference(ggml_ref, name, kind):
    f, glib = ggml_ref
    bs, nbytes = block(name)
    rng = np.random.default_rng(2000 + TYPE[name])
    x = sample(kind, 64 * bs, bs, rng)
    ours = quant(name, x)
    ref = np.zeros_like(ours)
    getattr(glib, f"quantize_row_{name.lower().replace('_k', '_K')}_ref")(
        f.from_buffer("float[]", x), f.from_buffer(ref), x.size)
    ours_b, ref_b = ours.reshape(-1, nbytes), ref.reshape(-1, nbytes)
    if kind == "edge":
        # all-zero blocks: ggml leaves some bytes unwritten (IQ4_NL nibbles, Q8_K bsums);
        # compare the values there, the bytes elsewhere
        np.testing.assert_array_equal(dequant(name, ours[:nbytes], bs), 0.0)
        if name == "Q8_K":
            np.testing.assert_array_equal(ours_b[0, :260], ref_b[0, :260])
        elif name != "IQ4_NL":
            np.testing.assert_array_equal(ours_b[0], ref_b[0])
        ours_b, ref_b = ours_b[1:], ref_b[1:]
    if name == "IQ4_NL":
        # a block below 1e-15 gets scale 0; ggml then stores the previous block's nibbles,
        # we store zeros: same values (0), different bytes. Only the nibbles of blocks with
        # a zero fp16 scale may differ.
        zero = (ref_b[:, :2] == 0).all(1)
        assert zero.mean() < 0.1
        np.testing.assert_array_equal(ours_b[zero, :2], 0)
        ours_b, ref_b = ours_b[~zero], ref_b[~zero]
    np.testing.assert_array_equal(ours_b, ref_b)


def _q8_k_ggml_ref(x):
    """numpy transcription of ggml's quantize_row_q8_K_ref (what llama.cpp runs on x86): per
    256 values, max = the first element of largest |x|, iscale = -127/max, q = nearest_int
    (ties to even) of iscale*x capped at 127, d = 1/iscale, bsums per 16; all-zero block -> 0."""
    out = np.zeros((x.size // 256, 292), np.uint8)
    for b, xb in enumerate(x.reshape(-1, 256).astype(np.float32)):
        j = int(np.argmax(np.abs(xb)))  # argmax returns the first of equal maxima
        if np.abs(xb[j]) == 0:
            continue
        iscale = np.float32(-127.0) / xb[j]
        q = np.minimum(np.rint((iscale * xb).astype(np.float32)), 127).astype(np.int8)
        out[b, :4] = np.array([np.float32(1.0) / iscale], np.float32).view(np.uint8)
        out[b, 4:260] = q.view(np.uint8)
        out[b, 260:] = q.reshape(16, 16).astype(np.int16).sum(1).astype(np.int16).view(np.uint8)
    return out.reshape(-1)


def test_q8_k_bytes_equal_ggml_reference():
    """Q8_K activation bytes equal ggml's reference quantiser, on the SIMD path this CPU takes:
    random blocks, blocks with exact .5 ties, equal-magnitude maxima of both signs (the first
    wins) and an all-zero block."""
    rng = np.random.default_rng(11)
    x = (rng.standard_normal(64 * 256) * rng.uniform(0.01, 100, 64).repeat(256)).astype(np.float32)
    ties = np.full(256, 0.5, np.float32)
    ties[0] = -127.0  # iscale = 1: 0.5 * 1 is an exact tie
    ties[1::7] = 2.5
    pm = rng.standard_normal(256).astype(np.float32)
    pm[[3, 9]] = [-8.0, 8.0]  # |max| twice: the first (-8) sets the sign of d
    x = np.concatenate([x, ties, pm, np.zeros(256, np.float32)])
    assert np.array_equal(quant("Q8_K", x), _q8_k_ggml_ref(x))
