"""Quantised dot kernels (native/quant/dot.h) and the matmul built on them.

- scalar kernel == float dot of the dequantised weight row and the dequantised activation row
  (relative 1e-5 of sum |w * x|: the integer sums are exact, only the float scale products and
  their summation order differ);
- every SIMD kernel this CPU has == the scalar kernel (relative 1e-6 of sum |w * x|), on weights
  quantised from random floats and on random weight bytes, for several row lengths;
- clover_matmul on a quantised matrix == numpy on the dequantised matrix and Q8-roundtripped
  activations, identical for 1 and 2 threads and for T = 1 and T > 1.
"""
import cffi
import numpy as np
import pytest

from clover_gguf._ffi import _find_library, lib

ffi = cffi.FFI()
ffi.cdef("""
typedef float (*clover_vec_dot_fn)(int64_t n, const void *w_row, const void *xq);
clover_vec_dot_fn clover_dot_scalar(int type);
clover_vec_dot_fn clover_dot_avx2(int type);
clover_vec_dot_fn clover_dot_avx512(int type);
int clover_dot_best_isa(void);
int clover_dot_act_type(int type);
int64_t clover_quantize_act(int act_type, const float *x, void *dst, int64_t n);
int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x, int64_t T,
                  float *y, int n_threads);
int clover_to_f32(int type, const void *src, float *dst, int64_t n);
int64_t clover_from_f32(int type, const float *src, void *dst, int64_t n);
int64_t clover_type_nbytes(int type, int64_t n);
typedef void (*clover_vec_dot4_fn)(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out);
clover_vec_dot4_fn clover_dot4_kernel(int type);
clover_vec_dot4_fn clover_dot4_avx512(int type);
clover_vec_dot4_fn clover_dot4_avx2(int type);
int clover_dot4_packed(int type);
int64_t clover_x4_row_bytes(int64_t n);
void clover_x4_pack_q8_0(const void *xq, void *dst, int64_t n);
int64_t clover_x4_split_row_bytes(int64_t n);
void clover_x4_split_q8_0(const void *xq, void *dst, int64_t n);
clover_vec_dot_fn clover_dot1_x4_avx2(int type);
clover_vec_dot_fn clover_dot1_x4_kernel(int type);
typedef float (*clover_dot_f16_fn)(const float *q, const uint16_t *k, int64_t n);
typedef void (*clover_axpy_f16_fn)(float *o, float p, const uint16_t *v, int64_t n);
clover_dot_f16_fn clover_dot_f16_kernel(int isa);
clover_axpy_f16_fn clover_axpy_f16_kernel(int isa);
typedef float (*clover_dot_f32_fn)(const float *q, const float *k, int64_t n);
typedef void (*clover_axpy_f32_fn)(float *o, float p, const float *v, int64_t n);
clover_dot_f32_fn clover_dot_f32_kernel(int isa);
clover_axpy_f32_fn clover_axpy_f32_kernel(int isa);
typedef void (*clover_dot_f32x4_fn)(const float *q, const float *k, int64_t k_stride, int64_t n, float *out);
typedef void (*clover_axpy_f32_rows_fn)(float *o, const float *p, const float *v, int64_t v_stride, int64_t n_rows,
                                        int64_t n);
clover_dot_f32x4_fn clover_dot_f32x4_kernel(void);
clover_axpy_f32_rows_fn clover_axpy_f32_rows_kernel(void);
typedef void (*clover_dot_f16x4_fn)(const float *q, const uint16_t *k, int64_t k_stride, int64_t n, float *out);
typedef void (*clover_axpy_f16_rows_fn)(float *o, const float *p, const uint16_t *v, int64_t v_stride,
                                        int64_t n_rows, int64_t n);
clover_dot_f16x4_fn clover_dot_f16x4_kernel(void);
clover_axpy_f16_rows_fn clover_axpy_f16_rows_kernel(void);
typedef void (*clover_gemm_f32_fn)(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                   const float *B, int64_t ldb, float *C, int64_t ldc);
clover_gemm_f32_fn clover_gemm_f32_kernel(int isa);
""")
L = ffi.dlopen(_find_library())

Q8_0_FAMILY = {"Q8_0": lib.CLOVER_TYPE_Q8_0, "Q4_0": lib.CLOVER_TYPE_Q4_0, "IQ4_NL": lib.CLOVER_TYPE_IQ4_NL,
               "MXFP4": lib.CLOVER_TYPE_MXFP4}
K_FAMILY = {"Q4_K": lib.CLOVER_TYPE_Q4_K, "Q5_K": lib.CLOVER_TYPE_Q5_K, "Q6_K": lib.CLOVER_TYPE_Q6_K,
            "IQ4_XS": lib.CLOVER_TYPE_IQ4_XS, "Q2_K": lib.CLOVER_TYPE_Q2_K, "Q3_K": lib.CLOVER_TYPE_Q3_K}
NO_AVX512 = ("Q2_K", "Q3_K")  # the dispatch gives them the AVX2 kernel (test_dot_k.py)
TYPES = {**Q8_0_FAMILY, **K_FAMILY}
ISAS = {1: ("avx2", L.clover_dot_avx2), 2: ("avx512", L.clover_dot_avx512)}


def _quantize(type_, x):
    n = x.size
    out = np.zeros(L.clover_type_nbytes(type_, n), np.uint8)
    rc = L.clover_from_f32(type_, ffi.cast("float *", x.ctypes.data), ffi.cast("void *", out.ctypes.data), n)
    assert rc == out.size
    return out


def _dequantize(type_, buf, n):
    y = np.zeros(n, np.float32)
    assert L.clover_to_f32(type_, ffi.cast("void *", buf.ctypes.data), ffi.cast("float *", y.ctypes.data), n) == 0
    return y


def _act(type_, x):
    act = L.clover_dot_act_type(type_)
    buf = np.zeros(L.clover_type_nbytes(act, x.size), np.uint8)
    assert L.clover_quantize_act(act, ffi.cast("float *", x.ctypes.data), ffi.cast("void *", buf.ctypes.data),
                                 x.size) == buf.size
    return act, buf


def _call(fn, n, w, xq):
    return float(fn(n, ffi.cast("void *", w.ctypes.data), ffi.cast("void *", xq.ctypes.data)))


def _random_weight_bytes(type_, n, rng):
    """Random block bytes with finite, moderate scales (random codes, random scale fields)."""
    w = _quantize(type_, rng.standard_normal(n).astype(np.float32))
    noise = rng.integers(0, 256, w.size, dtype=np.uint8)
    y = _dequantize(type_, noise, n)
    return noise if np.all(np.isfinite(y)) and np.abs(y).max() < 1e6 else w


@pytest.mark.parametrize("name", list(TYPES))
def test_scalar_kernel_equals_dequantised_dot(name):
    t = TYPES[name]
    scalar = L.clover_dot_scalar(t)
    assert scalar != ffi.NULL, f"{name}: no scalar kernel"
    rng = np.random.default_rng(t)
    for n in (256, 512, 2048, 4096):
        x = rng.standard_normal(n).astype(np.float32)
        w = _quantize(t, rng.standard_normal(n).astype(np.float32) * 0.02)
        act, xq = _act(t, x)
        wf = _dequantize(t, w, n).astype(np.float64)
        xf = _dequantize(act, xq, n).astype(np.float64)
        want = float(wf @ xf)
        got = _call(scalar, n, w, xq)
        assert abs(got - want) <= 1e-5 * float(np.abs(wf * xf).sum()) + 1e-30, (name, n, got, want)


@pytest.mark.parametrize("name", list(TYPES))
def test_simd_kernels_equal_scalar(name):
    t = TYPES[name]
    best = L.clover_dot_best_isa()
    scalar = L.clover_dot_scalar(t)
    rng = np.random.default_rng(100 + t)
    checked = []
    for isa, (isa_name, getter) in ISAS.items():
        if isa > best:
            continue  # this CPU lacks it; the build still has to compile it
        fn = getter(t)
        if isa == 2 and name in NO_AVX512:
            assert fn == ffi.NULL
            continue
        assert fn != ffi.NULL, f"{name}: no {isa_name} kernel"
        for n in (256, 768, 2048, 8192):
            for trial in range(3):
                x = (rng.standard_normal(n) * rng.uniform(0.1, 10)).astype(np.float32)
                w = (_random_weight_bytes(t, n, rng) if trial == 2
                     else _quantize(t, rng.standard_normal(n).astype(np.float32)))
                act, xq = _act(t, x)
                wf = _dequantize(t, w, n).astype(np.float64)
                xf = _dequantize(act, xq, n).astype(np.float64)
                ref, got = _call(scalar, n, w, xq), _call(fn, n, w, xq)
                assert abs(got - ref) <= 1e-6 * float(np.abs(wf * xf).sum()) + 1e-30, (name, isa_name, n, got, ref)
        checked.append(isa_name)
    print(f"{name}: SIMD kernels checked against scalar: {checked or 'none on this CPU'}")


@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_quantised_types(name):
    t = TYPES[name]
    rng = np.random.default_rng(200 + t)
    n_in, n_out = 512, 37  # odd row count
    W = rng.standard_normal((n_out, n_in)).astype(np.float32) * 0.05
    Wq = np.concatenate([_quantize(t, row) for row in W])
    Wf = np.stack([_dequantize(t, _quantize(t, row), n_in) for row in W]).astype(np.float64)
    for T in (1, 3, 5, 7):  # 3 and 7: a 3-row tail padded to a 4-row pass
        x = rng.standard_normal((T, n_in)).astype(np.float32)
        act = L.clover_dot_act_type(t)
        xf = np.stack([_dequantize(act, _act(t, row)[1], n_in) for row in x]).astype(np.float64)
        want = xf @ Wf.T
        outs = []
        for nth in (1, 2):
            y = np.zeros((T, n_out), np.float32)
            rc = L.clover_matmul(t, ffi.cast("void *", Wq.ctypes.data), n_in, n_out,
                                 ffi.cast("float *", x.ctypes.data), T, ffi.cast("float *", y.ctypes.data), nth)
            assert rc == 0
            outs.append(y)
        scale = np.abs(xf) @ np.abs(Wf).T
        assert np.all(np.abs(outs[0] - want) <= 1e-5 * scale + 1e-6), name
        assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("name", list(Q8_0_FAMILY))
def test_four_row_kernels_equal_single_row(name):
    """The 4-row AVX-512 kernels, on activations in their packed layout (dot.h), give exactly the
    single-row AVX-512 kernel's values on the plain Q8_0 rows (exact int32 block sums, the same
    scale products and FMA order)."""
    t = TYPES[name]
    if L.clover_dot_best_isa() < 2:
        pytest.skip("this CPU has no AVX-512 VNNI")
    dot4, dot1 = L.clover_dot4_avx512(t), L.clover_dot_avx512(t)
    assert dot4 != ffi.NULL and L.clover_dot4_kernel(t) == dot4
    rng = np.random.default_rng(300 + t)
    for n in (32 * 7, 2048):  # an odd block count exercises the tail block
        w = _quantize(t, rng.standard_normal(n).astype(np.float32))
        xs = [_act(t, rng.standard_normal(n).astype(np.float32) * 4)[1] for _ in range(4)]
        assert L.clover_dot4_packed(t) == 1
        pb = L.clover_x4_row_bytes(n)
        assert pb == n + 64 * ((n // 32 + 1) // 2)
        xp = np.zeros(4 * pb, np.uint8)
        for i, x in enumerate(xs):
            L.clover_x4_pack_q8_0(ffi.cast("void *", x.ctypes.data), ffi.cast("void *", xp[i * pb:].ctypes.data), n)
            q = x.reshape(-1, 34)[:, 2:].reshape(-1)
            assert np.array_equal(xp[i * pb:i * pb + n], q ^ 0x80)  # q + 128 as uint8
            d = xp[i * pb + n:(i + 1) * pb].view(np.float32)
            assert np.array_equal(d[:8 * (n // 32)].reshape(-1, 8)[:, 0],
                                  x.reshape(-1, 34)[:, :2].copy().view(np.float16).reshape(-1).astype(np.float32))
        out = ffi.new("float[4]")
        dot4(n, ffi.cast("void *", w.ctypes.data), ffi.cast("void *", xp.ctypes.data), pb, out)
        assert list(out) == [_call(dot1, n, w, x) for x in xs], name


def _split(x):
    """dot.h's split layout of a Q8_0 row: the int8 q in groups of 4 blocks (byte 32 m + 8 k + i =
    value 8 m + i of the group's block k), the last nb % 4 blocks as they are, then the block
    scales as float32."""
    blocks = x.reshape(-1, 34)
    nb = blocks.shape[0]
    g = nb - nb % 4
    q = blocks[:, 2:]
    grouped = q[:g].reshape(-1, 4, 4, 8).transpose(0, 2, 1, 3).reshape(-1)  # [group, k, m, i] -> [group, m, k, i]
    scales = blocks[:, :2].copy().view(np.float16).reshape(-1).astype(np.float32)
    return np.concatenate([grouped, q[g:].reshape(-1), scales.view(np.uint8)])


@pytest.mark.parametrize("name", list(Q8_0_FAMILY))
def test_four_row_avx2_kernels_equal_one_row_split_kernels(name):
    """The 4-row AVX2 kernels, on Q8_0 rows in the split layout of dot.h (clover_x4_split_q8_0,
    checked against its definition) at a padded stride, give exactly the one-row split kernel's
    values (clover_dot1_x4_avx2: the same int32 sums, scale products and FMA order), which equal
    the scalar kernel on the plain rows within 1e-6 of sum |w * x|; on an AVX2 CPU the dispatch
    gives both, with that layout."""
    t = TYPES[name]
    if L.clover_dot_best_isa() < 1:
        pytest.skip("this CPU has no AVX2")
    dot4, dot1 = L.clover_dot4_avx2(t), L.clover_dot1_x4_avx2(t)
    assert dot4 != ffi.NULL and dot1 != ffi.NULL
    if L.clover_dot_best_isa() == 1:
        assert L.clover_dot4_kernel(t) == dot4 and L.clover_dot4_packed(t) == 3 and L.clover_dot1_x4_kernel(t) == dot1
    else:
        assert L.clover_dot1_x4_kernel(t) == ffi.NULL
    scalar = L.clover_dot_scalar(t)
    rng = np.random.default_rng(400 + t)
    for n in (32, 32 * 7, 2048, 32 * 131):  # lone blocks, groups with a tail, groups only
        w = _random_weight_bytes(t, n, rng) if n >= 2048 else _quantize(t, rng.standard_normal(n).astype(np.float32))
        xs = [_act(t, (rng.standard_normal(n) * 4).astype(np.float32))[1] for _ in range(4)]
        pb = L.clover_x4_split_row_bytes(n)
        assert pb == n + 4 * (n // 32)
        stride = pb + 12
        buf = np.zeros(4 * stride, np.uint8)
        for i, x in enumerate(xs):
            L.clover_x4_split_q8_0(ffi.cast("void *", x.ctypes.data), ffi.cast("void *", buf[i * stride:].ctypes.data), n)
            assert np.array_equal(buf[i * stride:i * stride + pb], _split(x))
        out = ffi.new("float[4]")
        dot4(n, ffi.cast("void *", w.ctypes.data), ffi.cast("void *", buf.ctypes.data), stride, out)
        ones = [_call(dot1, n, w, np.ascontiguousarray(buf[i * stride:i * stride + pb])) for i in range(4)]
        assert list(out) == ones, (name, n)
        wf = _dequantize(t, w, n).astype(np.float64)
        for x, got in zip(xs, ones):
            mag = float(np.abs(wf * _dequantize(lib.CLOVER_TYPE_Q8_0, x, n)).sum())
            assert abs(got - _call(scalar, n, w, x)) <= 1e-6 * mag, (name, n)


@pytest.mark.parametrize("name", list(TYPES))
def test_matmul_rows_equal_one_row_products(name):
    """Each output row of a many-row product equals that activation row's product alone bit for
    bit (the 4-row kernels equal the single-row ones), so a prompt split anywhere gives the same
    values."""
    t = TYPES[name]
    rng = np.random.default_rng(500 + t)
    n_in, n_out, T = 512, 19, 7
    Wq = np.concatenate([_quantize(t, row) for row in rng.standard_normal((n_out, n_in)).astype(np.float32)])
    x = rng.standard_normal((T, n_in)).astype(np.float32)

    def mm(rows):
        y = np.zeros((rows.shape[0], n_out), np.float32)
        assert L.clover_matmul(t, ffi.cast("void *", Wq.ctypes.data), n_in, n_out, ffi.cast("float *", rows.ctypes.data),
                               rows.shape[0], ffi.cast("float *", y.ctypes.data), 2) == 0
        return y

    whole = mm(x)
    alone = np.concatenate([mm(np.ascontiguousarray(x[i:i + 1])) for i in range(T)])
    assert np.array_equal(whole.view(np.uint32), alone.view(np.uint32)), name


def _llama_cpp_x86_q8_0(x):
    """numpy emulation of llama.cpp's x86 quantize_row_q8_0 (ggml-cpu/arch/x86/quants.c):
    d = amax/127 as fp16, q = round-half-even(x * (127/amax)) in float32."""
    b = x.astype(np.float32).reshape(-1, 32)
    amax = np.abs(b).max(1, keepdims=True)
    with np.errstate(divide="ignore"):
        iscale = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint((b * iscale).astype(np.float32)).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float32).astype(np.float16)
    out = np.zeros((b.shape[0], 34), np.uint8)
    out[:, :2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(-1)


def test_q8_0_activation_quantisation_is_llama_cpps():
    """Activations are quantised the way llama.cpp runs on x86 (ties to even, x * 127/amax),
    not like the reference weight quantiser (roundf, x * 1/d), so both engines see the same
    activation bytes; a block with exact .5 ties shows the two rules apart."""
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.standard_normal(4096).astype(np.float32) * 3,
                        np.array([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 26, np.float32),
                        np.zeros(32, np.float32)])
    act, buf = _act(lib.CLOVER_TYPE_Q8_0, x)
    assert act == lib.CLOVER_TYPE_Q8_0
    assert np.array_equal(buf, _llama_cpp_x86_q8_0(x))
    tie = buf.reshape(-1, 34)[4096 // 32, 2:8].view(np.int8).tolist()
    assert tie == [127, 2, -4, 0, 0, 2]
    assert _quantize(lib.CLOVER_TYPE_Q8_0, x).reshape(-1, 34)[4096 // 32, 2:8].view(np.int8).tolist() == \
        [127, 3, -4, 1, -1, 2]  # weights: roundf, half away from zero (gguf-py / ggml ref bytes)


# per KV cache type: numpy dtype, cffi pointer type, kernel selectors, special values among k
_KV_KERNELS = {
    "f16": (np.float16, "uint16_t *", "clover_dot_f16_kernel", "clover_axpy_f16_kernel", (6e-8, -0.0, 65504.0)),
    "f32": (np.float32, "float *", "clover_dot_f32_kernel", "clover_axpy_f32_kernel", (1e-40, -0.0, 3.4e38 / 2**64)),
}


@pytest.mark.parametrize("kv", sorted(_KV_KERNELS))
@pytest.mark.parametrize("n", [1, 7, 8, 15, 16, 31, 32, 33, 40, 256])
def test_kv_kernels_against_float64(kv, n):
    """The attention kernels over F16 and F32 KV caches (dot.h clover_dot_f16_kernel,
    clover_axpy_f16_kernel, clover_dot_f32_kernel, clover_axpy_f32_kernel), scalar and, where this
    CPU has it, AVX2 (+ F16C): q . k and o + p v with k, v in the cache's type (random values, a
    subnormal, -0 and a large finite value among them: fp16's largest, 65504) equal float64 on
    the same values within 1e-6 of sum |q k| (dot) and, element by element, within one float32
    step of |o| + |p v| (axpy: a rounded product and sum, or one fused rounding). Row lengths
    cover the 32-, 16- and 8-wide loops and tails."""
    dtype, ptr, dot_name, axpy_name, specials = _KV_KERNELS[kv]
    rng = np.random.default_rng(n + 100 * (kv == "f32"))
    q = rng.standard_normal(n).astype(np.float32)
    k = (rng.standard_normal(n) * 4).astype(dtype)
    for i, x in zip((0, n // 2, n - 1), specials):  # one of each where n allows
        k[i] = x
    v = rng.standard_normal(n).astype(dtype)
    o0 = rng.standard_normal(n).astype(np.float32)
    p = np.float32(0.37 if kv == "f16" else -0.61)
    want_dot = float(q.astype(np.float64) @ k.astype(np.float64))
    scale = float(np.abs(q.astype(np.float64)) @ np.abs(k.astype(np.float64)))
    want_axpy = o0.astype(np.float64) + float(p) * v.astype(np.float64)
    isas = [0] + ([1] if L.clover_dot_best_isa() >= 1 else [])
    kernels = set()
    for isa in isas:
        dot, axpy = getattr(L, dot_name)(isa), getattr(L, axpy_name)(isa)
        kernels.add(int(ffi.cast("uintptr_t", dot)))
        got = dot(ffi.cast("float *", q.ctypes.data), ffi.cast(ptr, k.ctypes.data), n)
        assert abs(got - want_dot) <= 1e-6 * scale, (isa, got, want_dot)
        o = o0.copy()
        axpy(ffi.cast("float *", o.ctypes.data), float(p), ffi.cast(ptr, v.ctypes.data), n)
        step = np.spacing((np.abs(o0) + np.abs(float(p) * v.astype(np.float32))).astype(np.float32))
        assert np.all(np.abs(o - want_axpy) <= step), isa
    assert len(kernels) == len(isas)  # the AVX2 kernel is not the scalar one


@pytest.mark.skipif(L.clover_dot_best_isa() < 2, reason="this CPU has no AVX-512 (the several-key kernels' ISA)")
@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize("n", [8, 31, 40, 128, 200, 256])
def test_several_key_kernels_equal_the_one_key_kernels(kv, n):
    """dot.h clover_dot_f32x4_kernel / clover_axpy_f32_rows_kernel and their F16 forms
    clover_dot_f16x4_kernel / clover_axpy_f16_rows_kernel (AVX-512VL, used by attention): 4 keys'
    q . k, and o += p_j v_j over 13 rows, equal the AVX2 one-key kernels of the same cache type
    called key by key bit for bit (so a row's attention does not depend on which kernel took which
    key), on rows inside a strided cache (stride n + 24) with values over 60 binades (F32) or
    fp16's range with subnormals (F16)."""
    rng = np.random.default_rng(300 + n + 1000 * (kv == "f16"))
    stride, rows = n + 24, 13
    q = rng.standard_normal(n).astype(np.float32)
    if kv == "f32":
        cache = (rng.standard_normal(stride * rows) * np.exp2(rng.integers(-30, 30, stride * rows))).astype(np.float32)
    else:
        cache = (rng.standard_normal(stride * rows) * np.exp2(rng.integers(-20, 12, stride * rows))).astype(np.float16)
    ptr = "float *" if kv == "f32" else "uint16_t *"
    dot1, axpy1 = getattr(L, f"clover_dot_{kv}_kernel")(1), getattr(L, f"clover_axpy_{kv}_kernel")(1)
    dot4, rows_fn = getattr(L, f"clover_dot_{kv}x4_kernel")(), getattr(L, f"clover_axpy_{kv}_rows_kernel")()
    assert dot4 != ffi.NULL and rows_fn != ffi.NULL
    fp = lambda a, off=0: ffi.cast("float *", a.ctypes.data) + off  # noqa: E731
    cp = lambda off=0: ffi.cast(ptr, cache.ctypes.data) + off  # noqa: E731
    out = np.empty(4, np.float32)
    for base in (0, 5, 9):
        dot4(fp(q), cp(base * stride), stride, n, fp(out))
        want = [dot1(fp(q), cp((base + r) * stride), n) for r in range(4)]
        assert out.tobytes() == np.array(want, np.float32).tobytes(), (base, out, want)
    p = rng.random(rows).astype(np.float32)
    o0 = rng.standard_normal(n).astype(np.float32)
    o_rows, o_one = o0.copy(), o0.copy()
    rows_fn(fp(o_rows), fp(p), cp(), stride, rows, n)
    for j in range(rows):
        axpy1(fp(o_one), float(p[j]), cp(j * stride), n)
    assert o_rows.tobytes() == o_one.tobytes()
    assert not np.array_equal(o_rows, o0)


@pytest.mark.parametrize("M,N,K", [(64, 128, 128), (64, 64, 128), (128, 128, 64), (7, 37, 13), (1, 1, 1),
                                   (5, 24, 64), (4, 16, 0), (3, 9, 200)])
def test_gemm_f32_against_float64(M, N, K):
    """dot.h clover_gemm_f32_kernel (the chunked GDN's products), portable and, where this CPU has
    it, AVX2 + FMA: C + alpha A B on row-major blocks inside larger arrays (leading dimensions
    past the block) equals float64 within 4 K float32 steps of |C| + |alpha| |A| |B|, element by
    element; the GDN's shapes (64 x 128 x 128, ...) and shapes with row, column and sum tails;
    the elements outside the C block are untouched."""
    rng = np.random.default_rng(M * 10007 + N * 101 + K)
    lda, ldb, ldc = K + 3, N + 5, N + 7
    A = rng.standard_normal((M, lda)).astype(np.float32)
    B = rng.standard_normal((max(K, 1), ldb)).astype(np.float32)
    C0 = rng.standard_normal((M, ldc)).astype(np.float32)
    alpha = np.float32(-0.75)
    a64, b64 = A[:, :K].astype(np.float64), B[:K, :N].astype(np.float64)
    want = C0[:, :N].astype(np.float64) + float(alpha) * (a64 @ b64)
    bound = np.abs(C0[:, :N]).astype(np.float64) + abs(float(alpha)) * (np.abs(a64) @ np.abs(b64))
    tol = 4 * max(K, 1) * np.spacing(bound.astype(np.float32)).astype(np.float64)
    isas = [0] + ([1] if L.clover_dot_best_isa() >= 1 else [])
    kernels = set()
    for isa in isas:
        f = L.clover_gemm_f32_kernel(isa)
        kernels.add(int(ffi.cast("uintptr_t", f)))
        C = C0.copy()
        f(M, N, K, float(alpha), ffi.cast("float *", A.ctypes.data), lda, ffi.cast("float *", B.ctypes.data), ldb,
          ffi.cast("float *", C.ctypes.data), ldc)
        err = np.abs(C[:, :N] - want)
        assert np.all(err <= tol), (isa, float(err.max()), float(tol.min()))
        assert np.array_equal(C[:, N:], C0[:, N:]), isa
    assert len(kernels) == len(isas)  # the AVX2 kernel is not the portable one

