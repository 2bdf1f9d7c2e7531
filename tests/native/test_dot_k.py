"""K-quant dot-product kernels of native/quant/dot_k.c and kquants23.c (spec 6).

Weight types Q4_K, Q5_K, Q6_K, IQ4_XS against Q8_K activations, each with a scalar kernel
(the reference) and AVX2 / AVX-512-VNNI kernels; Q2_K and Q3_K with a scalar and an AVX2
kernel, which the dispatch (clover_dot_kernel) also gives for AVX-512 CPUs.
Checks:
- the scalar kernel equals the float64 dot of the dequantised weight row (clover_kq_to_f32)
  with the dequantised Q8_K row, within 1e-5 * sum|w*x|;
- every SIMD kernel equals the scalar kernel within 1e-6 * sum|w*x| (the per-block integer
  sums are exact; only the order of the float sums differs);
on row lengths of 1, 3, 5, 8 and 32 blocks (256 .. 8192 values), for weight rows of random
bytes (finite random fp16 scales) and rows quantised from random floats, and activations
quantised from random floats or random Q8_K bytes (qs in -127..127, consistent bsums).
- the four-row kernels (clover_dot4_k_avx2, clover_dot4_k_avx512) equal four calls of the
  single-row kernel of their ISA on the plain Q8_K rows bit for bit, with activation rows
  adjacent and at a padded stride, in the layout clover_dot4_packed names (Q4_K and Q5_K: AVX2
  paired by clover_x4_pair_q8_K, AVX-512 K-permuted by clover_x4_pack_q8_K, each checked against
  its definition in dot.h; the others plain rows);
- the AVX2 one-row kernels on paired rows (Q4_K, Q5_K) equal the single-row AVX2 kernel on the
  plain rows bit for bit, and the dispatch gives them exactly on AVX2 CPUs;
SIMD cases are skipped on CPUs without the features (read from /proc/cpuinfo).
"""
import pathlib

import cffi
import numpy as np
import pytest

from clover_gguf import _ffi
from clover_gguf._ffi import lib

TYPES = {"Q4_K": (lib.CLOVER_TYPE_Q4_K, 144), "Q5_K": (lib.CLOVER_TYPE_Q5_K, 176),
         "Q6_K": (lib.CLOVER_TYPE_Q6_K, 210), "IQ4_XS": (lib.CLOVER_TYPE_IQ4_XS, 136),
         "Q2_K": (lib.CLOVER_TYPE_Q2_K, 84), "Q3_K": (lib.CLOVER_TYPE_Q3_K, 110)}
K23 = ("Q2_K", "Q3_K")  # no AVX-512 kernels
# byte offsets of the fp16 scales in each block (d, and dmin for Q2_K/Q4_K/Q5_K)
FP16_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,), "Q2_K": (80, 82), "Q3_K": (108,)}
Q8K = lib.CLOVER_TYPE_Q8_K
LENGTHS = [256, 768, 1280, 2048, 8192]

_kffi = cffi.FFI()
_kffi.cdef("""
typedef float (*clover_vec_dot_fn)(int64_t n, const void *w_row, const void *xq);
clover_vec_dot_fn clover_dot_k_scalar(int type);
clover_vec_dot_fn clover_dot_k_avx2(int type);
clover_vec_dot_fn clover_dot_k_avx512(int type);
clover_vec_dot_fn clover_dot_kernel(int type, int isa);
int clover_dot_best_isa(void);
typedef void (*clover_vec_dot4_fn)(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out);
clover_vec_dot4_fn clover_dot4_k_avx512(int type);
clover_vec_dot4_fn clover_dot4_k_avx2(int type);
clover_vec_dot4_fn clover_dot4_kernel(int type);
int clover_dot4_packed(int type);
void clover_x4_pack_q8_K(const void *xq, void *dst, int64_t n);
void clover_x4_pair_q8_K(const void *xq, void *dst, int64_t n);
clover_vec_dot_fn clover_dot_paired_avx2(int type);
clover_vec_dot_fn clover_dot1_x4_kernel(int type);
int64_t clover_kq_from_f32(int type, const float *src, void *dst, int64_t n);
int clover_kq_to_f32(int type, const void *src, float *dst, int64_t n);
""")
klib = _kffi.dlopen(_ffi._find_library())


def _cpu_flags():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
ISAS = {
    "avx2": ({"avx2", "fma", "f16c"}, klib.clover_dot_k_avx2),
    "avx512": ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"},
               klib.clover_dot_k_avx512),
}


def _ptr(a):
    return _kffi.cast("void *", a.ctypes.data)


def _quant(type_id, x):
    nbytes = {Q8K: 292}.get(type_id) or dict(TYPES.values()).get(type_id)
    out = np.zeros(x.size // 256 * nbytes, np.uint8)
    x = np.ascontiguousarray(x, np.float32)
    r = klib.clover_kq_from_f32(type_id, _kffi.cast("const float *", x.ctypes.data), _ptr(out), x.size)
    assert r == out.size
    return out


def _dequant(type_id, b, n):
    y = np.zeros(n, np.float32)
    assert klib.clover_kq_to_f32(type_id, _ptr(b), _kffi.cast("float *", y.ctypes.data), n) == 0
    return y


def _random_weight_bytes(rng, name, n):
    tid, nb = TYPES[name]
    b = rng.integers(0, 256, size=(n // 256, nb), dtype=np.uint8)
    for off in FP16_OFFSETS[name]:
        h = (rng.standard_normal(n // 256) * rng.choice([1e-3, 0.05, 2.0], n // 256)).astype(np.float16)
        b[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return b.reshape(-1)


def _random_q8k_bytes(rng, n):
    nblk = n // 256
    blk = np.zeros((nblk, 292), np.uint8)
    qs = rng.integers(-127, 128, size=(nblk, 256), dtype=np.int8)
    d = (rng.random(nblk) * 0.1 + 1e-3).astype(np.float32) * rng.choice([-1, 1], nblk)
    blk[:, 0:4] = d.astype(np.float32).view(np.uint8).reshape(nblk, 4)
    blk[:, 4:260] = qs.view(np.uint8)
    bsums = qs.reshape(nblk, 16, 16).astype(np.int16).sum(axis=2).astype(np.int16)
    blk[:, 260:292] = bsums.view(np.uint8).reshape(nblk, 32)
    return blk.reshape(-1)


def _cases(rng, name, n):
    """(weight bytes, Q8_K bytes) pairs: random bytes and quantised floats on both sides."""
    tid = TYPES[name][0]
    out = []
    for wkind in ("bytes", "quant"):
        if wkind == "bytes":
            w = _random_weight_bytes(rng, name, n)
        else:
            scale = rng.choice([1e-3, 1.0, 30.0])
            w = _quant(tid, (rng.standard_normal(n) * scale).astype(np.float32))
        for xkind in ("bytes", "quant"):
            if xkind == "bytes":
                x = _random_q8k_bytes(rng, n)
            else:
                xf = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-2, 1.0, 100.0])
                xf[rng.random(n) < 0.01] *= 20  # a few outliers, as in real activations
                x = _quant(Q8K, xf)
            out.append((wkind, xkind, w, x))
    return out


def _ref(tid, w, x, n):
    wf = _dequant(tid, w, n).astype(np.float64)
    xf = _dequant(Q8K, x, n).astype(np.float64)
    return float(wf @ xf), float(np.abs(wf * xf).sum())


def _call(fn, n, w, x):
    return float(fn(n, _ptr(w), _ptr(x)))


@pytest.mark.parametrize("name", list(TYPES))
def test_scalar_matches_dequantised_dot(name):
    rng = np.random.default_rng(100 + TYPES[name][0])
    tid = TYPES[name][0]
    fn = klib.clover_dot_k_scalar(tid)
    assert fn != _kffi.NULL
    worst = 0.0
    for n in LENGTHS:
        for wkind, xkind, w, x in _cases(rng, name, n):
            ref, mag = _ref(tid, w, x, n)
            got = _call(fn, n, w, x)
            assert mag > 0
            err = abs(got - ref) / mag
            worst = max(worst, err)
            assert err <= 1e-5, (name, n, wkind, xkind, got, ref, mag)
    print(f"{name} scalar: max |scalar - ref| / sum|w*x| = {worst:.2e}")


@pytest.mark.parametrize("name,isa", [(n, i) for n in TYPES for i in ISAS if not (n in K23 and i == "avx512")])
def test_simd_matches_scalar(name, isa):
    need, getter = ISAS[isa]
    tid = TYPES[name][0]
    fn = getter(tid)
    if fn == _kffi.NULL:
        pytest.skip(f"{isa} kernels not built (non-x86 build)")
    if not need <= FLAGS:
        pytest.skip(f"CPU lacks {sorted(need - FLAGS)}")
    ref_fn = klib.clover_dot_k_scalar(tid)
    rng = np.random.default_rng(200 + TYPES[name][0])
    worst = 0.0
    for n in LENGTHS:
        for wkind, xkind, w, x in _cases(rng, name, n):
            _, mag = _ref(tid, w, x, n)
            want = _call(ref_fn, n, w, x)
            got = _call(fn, n, w, x)
            err = abs(got - want) / mag
            worst = max(worst, err)
            assert err <= 1e-6, (name, isa, n, wkind, xkind, got, want, mag)
    assert _call(fn, 0, w, x) == 0.0  # empty row
    print(f"{name} {isa}: max |simd - scalar| / sum|w*x| = {worst:.2e}")


def _k_permuted(q8k):
    """dot.h's K-permuted layout of Q8_K blocks (292 bytes: float d, 256 qs, 16 int16 bsums):
    byte 64 s + 8 b + i of qs = value 8 s + i of sub-block b (qs[32 b + 8 s + i]); bsums[b] =
    the sum of sub-block b's 32 values, bsums[8:] = 0."""
    blocks = q8k.reshape(-1, 292).copy()
    qs = blocks[:, 4:260].reshape(-1, 8, 4, 8)  # [block, sub-block b, s, i]
    blocks[:, 4:260] = qs.transpose(0, 2, 1, 3).reshape(-1, 256)
    sums = blocks[:, 4:260].view(np.int8).reshape(-1, 4, 8, 8).astype(np.int64).sum(axis=(1, 3))
    bs = np.zeros((blocks.shape[0], 16), np.int16)
    bs[:, :8] = sums
    blocks[:, 260:292] = bs.view(np.uint8)
    return blocks.reshape(-1)


def _paired(q8k):
    """dot.h's paired layout of Q8_K blocks: byte 64 s + 32 h + 8 k + i of qs = value 8 s + i of
    sub-block 2 k + h (qs[32 (2 k + h) + 8 s + i]); bsums as in the K-permuted layout."""
    blocks = _k_permuted(q8k).reshape(-1, 292)
    qs = q8k.reshape(-1, 292)[:, 4:260].reshape(-1, 4, 2, 4, 8)  # [block, k, h, s, i]
    blocks[:, 4:260] = qs.transpose(0, 3, 2, 1, 4).reshape(-1, 256)
    return blocks.reshape(-1)


DOT4 = {"avx2": klib.clover_dot4_k_avx2, "avx512": klib.clover_dot4_k_avx512}
PACK = {2: (klib.clover_x4_pack_q8_K, _k_permuted), 4: (klib.clover_x4_pair_q8_K, _paired)}


@pytest.mark.parametrize("isa", list(DOT4))
@pytest.mark.parametrize("name", [n for n in TYPES if n not in K23])
def test_dot4_equals_single_row_bitwise(name, isa):
    need, getter = ISAS[isa]
    tid = TYPES[name][0]
    fn4 = DOT4[isa](tid)
    if fn4 == _kffi.NULL:
        pytest.skip(f"{isa} kernels not built (non-x86 build)")
    if not need <= FLAGS:
        pytest.skip(f"CPU lacks {sorted(need - FLAGS)}")
    fn1 = getter(tid)
    packing = ({"avx2": 4, "avx512": 2}[isa] if name in ("Q4_K", "Q5_K") else 0)  # the layout this kernel reads
    if klib.clover_dot_best_isa() == {"avx2": 1, "avx512": 2}[isa]:  # the dispatch gives this kernel
        assert klib.clover_dot4_kernel(tid) == fn4 and klib.clover_dot4_packed(tid) == packing
    rng = np.random.default_rng(300 + tid)
    checked = 0
    for n in LENGTHS:
        for wkind in ("bytes", "quant"):
            if wkind == "bytes":
                w = _random_weight_bytes(rng, name, n)
            else:
                w = _quant(tid, (rng.standard_normal(n) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32))
            rows = []
            for r in range(4):  # mix random Q8_K bytes and quantised activations
                if r % 2 == 0:
                    rows.append(_random_q8k_bytes(rng, n))
                else:
                    xf = rng.standard_normal(n).astype(np.float32) * rng.choice([1e-2, 1.0, 100.0])
                    xf[rng.random(n) < 0.01] *= 20
                    rows.append(_quant(Q8K, xf))
            row_bytes = rows[0].size
            for pad in (0, 64 + 4):  # adjacent rows, and rows at a larger stride
                stride = row_bytes + pad
                buf = np.zeros(4 * stride, np.uint8)
                for r in range(4):
                    if packing:
                        pack, ref = PACK[packing]
                        pack(_ptr(rows[r]), _ptr(buf[r * stride:]), n)
                        assert np.array_equal(buf[r * stride:r * stride + row_bytes], ref(rows[r]))
                    else:
                        buf[r * stride:r * stride + row_bytes] = rows[r]
                out = np.full(4, np.nan, np.float32)
                fn4(n, _ptr(w), _ptr(buf), stride, _kffi.cast("float *", out.ctypes.data))
                want = np.array([fn1(n, _ptr(w), _ptr(rows[r])) for r in range(4)], np.float32)
                assert np.all(np.isfinite(want))
                assert out.view(np.uint32).tolist() == want.view(np.uint32).tolist(), (name, n, wkind, pad, out, want)
                checked += 4
    out = np.full(4, np.nan, np.float32)
    fn4(0, _ptr(w), _ptr(rows[0]), 0, _kffi.cast("float *", out.ctypes.data))
    assert out.tolist() == [0.0] * 4  # empty row
    assert checked == len(LENGTHS) * 2 * 2 * 4


@pytest.mark.parametrize("name", list(TYPES))
def test_paired_one_row_kernels_equal_single_row_bitwise(name):
    """The AVX2 one-row kernels on paired rows (Q4_K, Q5_K; dot.h clover_dot_paired_avx2) give the
    single-row AVX2 kernel's value on the plain row bit for bit; the dispatch gives them exactly
    where the 4-row kernel reads paired rows; other types have none."""
    need, getter = ISAS["avx2"]
    tid = TYPES[name][0]
    fnp = klib.clover_dot_paired_avx2(tid)
    if name not in ("Q4_K", "Q5_K"):
        assert fnp == _kffi.NULL and klib.clover_dot1_x4_kernel(tid) == _kffi.NULL
        return
    if fnp == _kffi.NULL:
        pytest.skip("avx2 kernels not built (non-x86 build)")
    if not need <= FLAGS:
        pytest.skip(f"CPU lacks {sorted(need - FLAGS)}")
    if klib.clover_dot_best_isa() == 1:  # AVX2: the 4-row kernel reads paired rows, so does the one-row one
        assert klib.clover_dot4_packed(tid) == 4 and klib.clover_dot1_x4_kernel(tid) == fnp
    else:
        assert klib.clover_dot1_x4_kernel(tid) == _kffi.NULL
    fn1 = getter(tid)
    rng = np.random.default_rng(600 + tid)
    checked = 0
    for n in LENGTHS:
        for wkind, xkind, w, x in _cases(rng, name, n):
            xp = np.zeros_like(x)
            klib.clover_x4_pair_q8_K(_ptr(x), _ptr(xp), n)
            want, got = np.float32(fn1(n, _ptr(w), _ptr(x))), np.float32(fnp(n, _ptr(w), _ptr(xp)))
            assert np.isfinite(want)
            assert got.view(np.uint32) == want.view(np.uint32), (name, n, wkind, xkind, got, want)
            checked += 1
    assert checked >= 2 * len(LENGTHS)
    assert fnp(0, _ptr(w), _ptr(x)) == 0.0  # empty row


def test_other_types_have_no_kernel():
    for t in (lib.CLOVER_TYPE_F32, lib.CLOVER_TYPE_Q8_0, lib.CLOVER_TYPE_Q4_0, Q8K,
              lib.CLOVER_TYPE_IQ4_NL, lib.CLOVER_TYPE_MXFP4, 9999, -1):
        for getter in (klib.clover_dot_k_scalar, klib.clover_dot_k_avx2, klib.clover_dot_k_avx512,
                       klib.clover_dot4_k_avx512, klib.clover_dot4_k_avx2):
            assert getter(t) == _kffi.NULL


@pytest.mark.parametrize("name", K23)
def test_k23_dispatch_falls_back_to_avx2(name):
    """Q2_K and Q3_K have no AVX-512 kernels: clover_dot_kernel gives the AVX2 one at every ISA
    from AVX2 up that this CPU has, the scalar one at ISA 0, and no four-row kernel."""
    tid = TYPES[name][0]
    assert klib.clover_dot_k_avx512(tid) == _kffi.NULL and klib.clover_dot4_k_avx512(tid) == _kffi.NULL
    assert klib.clover_dot4_k_avx2(tid) == _kffi.NULL
    assert klib.clover_dot_kernel(tid, 0) == klib.clover_dot_k_scalar(tid) != _kffi.NULL
    best = klib.clover_dot_best_isa()
    for isa in range(1, best + 1):
        assert klib.clover_dot_kernel(tid, isa) == klib.clover_dot_k_avx2(tid) != _kffi.NULL
    assert klib.clover_dot_kernel(tid, -1) == (klib.clover_dot_k_avx2(tid) if best >= 1 else klib.clover_dot_k_scalar(tid))
