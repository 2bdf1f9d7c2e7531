"""The CUDA backend (native/cuda): products, experts and attention on the GPU against the CPU.

Always run:
- a library built where nvcc exists has the CUDA code compiled in (CI compiles it on every run),
  and on a machine without a usable GPU it says why and the engine runs on the CPU
  (clover_model_offload refuses with CLOVER_E_DEVICE; Model(n_gpu_layers=...) warns);
- the GPU kernels' dequantisation (native/cuda/dequant.cuh) built for the host with nvcc, bit
  for bit against the CPU engine.
Only with a GPU (skipped otherwise, with the reason), or under the CUDA emulator
(tests/native/test_cuda_emu.py runs this file against a CLOVER_CUDA=EMU library on the CPU):
- clover_cuda_matmul for every weight type against the CPU engine's clover_matmul (both round
  activations to Q8_0/Q8_K the same way, so they differ only in float summation order:
  tolerance 1e-5 of sum |w x| per output; seen: below 4e-7 of max |y|; F16/BF16 on tensor cores
  split the float32 activations into 16-bit terms: one-value products within 2^-20);
- clover_cuda_experts (grouped expert products) against the CPU expert by expert, and
  clover_cuda_attention (device KV cache, prefix and block mode, GQA), clover_cuda_gdn (the
  recurrence and its chunked form) and clover_cuda_gdn_block(_d) (the block operator's mixing,
  spec 3.3 steps 3-4) against float64;
- whole-model logits (prefix mode, and block mode with the v1 block operator) with every layer
  offloaded against the CPU, and greedy tokens identical to the CPU in ar, diffusion and spec
  (as far as the CPU's own scalar and SIMD kernels agree), for the whole offload and a partial
  one, at F32, Q8_0 and Q4_K_M, and across the GPU placements;
- selection on the GPU of a resident model: greedy with the sampler's edits, and top-k
  (clover_cuda_top_k_d against a numpy sort, then sampled tokens equal to the CPU's seed for
  seed in every mode);
- under the emulator only (its device memory size and allocation faults): a GPU too small for
  the weights, a full GPU during generation, and a failed allocation at every point of a load
  and a generation, each a clear error after which the model still works, with no memory left
  allocated. Under the emulator (about 1000x slower
  than the CPU engine) the model has 8-token blocks and 16 tokens are generated, not 32-token
  blocks and 32 tokens: the same code paths in a few minutes.
"""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import cffi

import numpy as np
import pytest

from clover_gguf import _ffi
from clover_gguf._ffi import err_buf, ffi, lib

_info = ffi.new("char[]", 256)
N_DEV = int(lib.clover_gpu_devices(_info, 256))
INFO = ffi.string(_info).decode()
gpu = pytest.mark.skipif(N_DEV <= 0, reason=f"no GPU: {INFO}")
EMULATED = "emulator" in INFO  # native/cuda/emu (CLOVER_CUDA=EMU): the GPU code on the CPU
# generation in the whole-model tests: the test model's options and tokens per mode
GEN_MODEL, GEN_TOKENS = (dict(block_size=8), 16) if EMULATED else ({}, 32)

_cffi = cffi.FFI()
_cffi.cdef("""
int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size);
void clover_cuda_free(void *dev);
int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size);
int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x, int64_t T, float *y,
                  int n_threads);
typedef struct { int type; const void *dev; int64_t ne0, ne1, stride; } clover_cuda_weight;
int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size);
int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size);
int clover_cuda_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16, int64_t n_ctx,
                          int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale,
                          float *out, char *err, size_t err_size);
int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size);
int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size);
int clover_context_checkpoint(void *c, int32_t n_max, char *err, size_t err_size);
int clover_context_rollback(void *c, int32_t n_keep, char *err, size_t err_size);
int64_t clover_context_graph_launches(const void *c);
int64_t clover_context_passes(const void *c);
int64_t clover_context_full_rows(const void *c);
typedef struct { int32_t kind, id, count; float value; } clover_logit_op;
typedef struct { float z; int32_t id; } clover_cand;
int clover_cuda_top_k_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                        float repetition, float frequency, float presence, int32_t mask_id, int32_t k,
                        clover_cand *cand, float *bad, float *pre, char *err, size_t err_size);
int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                        int64_t n_expert, const int64_t *start, const float *xg, float *yg, char *err, size_t err_size);
int clover_cuda_rmsnorm_d(const float *x, int64_t x_stride, const int32_t *idx, const float *w, int64_t n,
                          int64_t rows, float eps, float *y, int64_t y_stride, char *err, size_t err_size);
int clover_cuda_head_norm_rope_d(float *x, int64_t T, int64_t n_head, int64_t row_stride, int64_t head_stride,
                                 const float *w, int64_t hd, float eps, const int64_t *pos, int32_t rope_dim,
                                 float theta, char *err, size_t err_size);
int clover_cuda_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                          const float *state, const float *lambda, const float *beta0, const float *c, int64_t P,
                          float *o, char *err, size_t err_size);
int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                            const float *state, const float *lambda, const float *beta0, const float *c,
                            const int64_t *pos, float *o, char *err, size_t err_size);
int clover_cuda_capture_begin(char *err, size_t err_size);
int clover_cuda_capture_end(void **graph, char *err, size_t err_size);
int clover_cuda_graph_launch(void *graph, char *err, size_t err_size);
void clover_cuda_graph_free(void *graph);
int clover_cuda_conv_d(const float *w, const float *wr, const float *hist, const float *in, int64_t T, int64_t C,
                       int32_t K, float *out, char *err, size_t err_size);
int clover_cuda_conv_hist_d(float *hist, const float *in, int64_t T, int64_t C, int32_t K, char *err, size_t err_size);
int clover_cuda_gdn_prep_d(float *conv, int64_t T, int64_t C, int64_t Hk, int64_t dk, float eps, float *b, float *a,
                           const float *ssm_a, const float *dt_bias, int64_t Hv, char *err, size_t err_size);
int clover_cuda_gdn_out_d(float *o, const float *z, const float *w, int64_t T, int64_t Hv, int64_t dv, float eps,
                          char *err, size_t err_size);
int clover_cuda_route_d(float *probs, int64_t T, int64_t E, int32_t k, float coreset_top_p, int32_t *sel, float *wsel,
                        int32_t *prow, float *pw, int32_t *pair, void *tiles, int32_t *stats, char *err,
                        size_t err_size);
int clover_cuda_moe_combine_d(float *x, const float *yg, const float *pw, const int32_t *pair, int32_t k,
                              const float *ys, const float *sg, int64_t T, int64_t H, int32_t *bad, char *err,
                              size_t err_size);
int clover_cuda_greedy_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                         float repetition, float frequency, float presence, int32_t mask_id, int32_t *id, float *conf,
                         char *err, size_t err_size);
int clover_cuda_row_total_d(const float *z, int64_t n, int64_t V, int32_t mask_id, const clover_cand *cand,
                            int32_t k, float temperature, double *total, char *err, size_t err_size);
int clover_cuda_kv_store_d(void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t kvd, const int64_t *pos,
                           const float *k_new, const float *v_new, int64_t T, char *err, size_t err_size);
int clover_cuda_gather_d(const float *x, const int32_t *rows, int64_t n, int64_t H, float *y, char *err,
                         size_t err_size);
int clover_cuda_swiglu_d(float *g, const float *u, int64_t n, char *err, size_t err_size);
int clover_cuda_add_d(float *x, const float *o, int64_t n, int32_t *bad, char *err, size_t err_size);
int clover_cuda_copy_d(float *dst, const float *src, int64_t n, char *err, size_t err_size);
int64_t clover_emu_fail_alloc(int64_t n); /* the emulator's only (native/cuda/emu/cuda_runtime.h) */
""")
_clib = _cffi.dlopen(_ffi._find_library())

PLAIN = {"F32": lib.CLOVER_TYPE_F32, "F16": lib.CLOVER_TYPE_F16, "BF16": lib.CLOVER_TYPE_BF16,
         "Q8_0": lib.CLOVER_TYPE_Q8_0}
BLOCKS = {"Q4_0": lib.CLOVER_TYPE_Q4_0, "IQ4_NL": lib.CLOVER_TYPE_IQ4_NL, "MXFP4": lib.CLOVER_TYPE_MXFP4,
          "Q4_K": lib.CLOVER_TYPE_Q4_K, "Q5_K": lib.CLOVER_TYPE_Q5_K, "Q6_K": lib.CLOVER_TYPE_Q6_K,
          "IQ4_XS": lib.CLOVER_TYPE_IQ4_XS}


def test_cuda_is_compiled_in_where_nvcc_exists_and_absent_gpu_is_reported():
    if shutil.which("nvcc"):
        assert "built without CUDA" not in INFO, INFO
    if N_DEV > 0:
        pytest.skip(f"a GPU is present: {INFO}")
    assert N_DEV in (0, lib.CLOVER_E_DEVICE) and INFO  # the reason, e.g. no driver


def test_offload_without_gpu_is_refused_and_model_falls_back(make_gguf):
    if N_DEV > 0:
        pytest.skip(f"a GPU is present: {INFO}")
    from clover_gguf import Model

    err = err_buf()
    m = lib.clover_model_load(str(make_gguf("f32")).encode(), err, len(err))
    try:
        rc = lib.clover_model_offload(m, 99, 0, err, len(err))
        assert rc == lib.CLOVER_E_DEVICE and "n_gpu_layers" in ffi.string(err).decode()
        assert lib.clover_model_offload(m, 0, 0, err, len(err)) == 0 and lib.clover_model_gpu_bytes(m) == 0
        assert lib.clover_model_offload(m, -1, 0, err, len(err)) == lib.CLOVER_E_ARG
    finally:
        lib.clover_model_free(m)
    with pytest.warns(UserWarning, match="running on the CPU"):
        with Model(make_gguf("f32"), n_ctx=64, n_threads=1, n_gpu_layers=-1) as gm, \
                Model(make_gguf("f32"), n_ctx=64, n_threads=1) as cm:
            assert gm.n_gpu_layers == 0
            assert gm.generate_tokens([1, 2, 3], max_tokens=6, mode="ar")[0] == \
                cm.generate_tokens([1, 2, 3], max_tokens=6, mode="ar")[0]


@pytest.mark.parametrize("outtype,wtype", [("q2_k", "Q2_K"), ("q3_k_m", "Q3_K")])
def test_offload_refuses_cpu_only_weight_types(make_gguf, outtype, wtype):
    """Q2_K and Q3_K have no GPU kernels: offloading a layer that holds them is refused (before
    any device is asked for) with the layer, the type and the types the GPU runs; the model
    stays on the CPU and works."""
    err = err_buf()
    m = lib.clover_model_load(str(make_gguf(outtype)).encode(), err, len(err))
    assert m != ffi.NULL, ffi.string(err)
    try:
        for n_gpu, n_cpu_moe in ((99, 0), (1, 0), (1, 99)):
            rc = lib.clover_model_offload(m, n_gpu, n_cpu_moe, err, len(err))
            msg = ffi.string(err).decode()
            assert rc == lib.CLOVER_E_ARG, msg
            assert re.search(rf"n_gpu_layers: layer 0 has {wtype} weights, which the CUDA backend does not run "
                             r"\(it runs F32, F16, BF16, Q8_0, Q4_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS\)", msg), msg
            assert lib.clover_model_gpu_bytes(m) == 0
    finally:
        lib.clover_model_free(m)
    # a Q4_K_S file (Q4_K, Q5_K, Q6_K, Q8_0) gets past the type check: the GPU's absence, or an offload
    m = lib.clover_model_load(str(make_gguf("q4_k_s")).encode(), err, len(err))
    try:
        rc = lib.clover_model_offload(m, 99, 0, err, len(err))
        assert rc == (lib.CLOVER_E_DEVICE if N_DEV <= 0 else 5), ffi.string(err)
    finally:
        lib.clover_model_free(m)


def _weights(name: str, type_: int, ne0: int, ne1: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(bytes of the quantised [ne1, ne0] matrix, its float64 dequantisation)."""
    w = rng.standard_normal((ne1, ne0)).astype(np.float32)
    if name == "F32":
        return w.view(np.uint8).reshape(-1), w.astype(np.float64)
    n = lib.clover_type_nbytes(type_, ne0 * ne1)
    q = np.zeros(n, np.uint8)
    assert lib.clover_from_f32(type_, ffi.cast("float *", w.ctypes.data), ffi.cast("void *", q.ctypes.data),
                               w.size) == n
    back = np.zeros(w.size, np.float32)
    assert lib.clover_to_f32(type_, ffi.cast("void *", q.ctypes.data), ffi.cast("float *", back.ctypes.data),
                             w.size) == 0
    return q, back.reshape(ne1, ne0).astype(np.float64)


def _cpu_matmul(type_: int, q: np.ndarray, ne0: int, ne1: int, x: np.ndarray) -> np.ndarray:
    """The CPU engine's clover_matmul of the quantised bytes q ([ne1, ne0]) with x [T, ne0]."""
    x = np.ascontiguousarray(x, np.float32)
    y = np.zeros((x.shape[0], ne1), np.float32)
    assert _clib.clover_matmul(type_, _cffi.cast("void *", q.ctypes.data), ne0, ne1, _cffi.cast("float *", x.ctypes.data),
                               x.shape[0], _cffi.cast("float *", y.ctypes.data), 2) == 0
    return y


def _gpu_matmul(type_: int, q: np.ndarray, ne0: int, ne1: int, x: np.ndarray) -> np.ndarray:
    """clover_cuda_matmul of the quantised bytes q ([ne1, ne0], uploaded for the call) with x [T, ne0]."""
    dev = _cffi.new("void **")
    err = _cffi.new("char[]", 256)
    assert _clib.clover_cuda_upload(_cffi.cast("void *", q.ctypes.data), q.size, dev, err, 256) == 0, \
        _cffi.string(err)
    try:
        y = np.zeros((x.shape[0], ne1), np.float32)
        rc = _clib.clover_cuda_matmul(type_, dev[0], ne0, ne1, _cffi.cast("float *", x.ctypes.data), x.shape[0],
                                      _cffi.cast("float *", y.ctypes.data), err, 256)
        assert rc == 0, _cffi.string(err)
    finally:
        _clib.clover_cuda_free(dev[0])
    return y


@gpu
@pytest.mark.parametrize("name", list(PLAIN) + list(BLOCKS))
@pytest.mark.parametrize("T,mma", [(1, "1"), (3, "1"), (9, "1"), (32, "1"), (41, "1"), (32, "0")])
def test_matmul_every_type_equals_the_cpu_engine(name, T, mma, monkeypatch):
    """One product per type against the CPU engine's, within 1e-5 of sum |w x|: 1 to 9 rows take
    the dp4a kernel (k_matmul_q), 32 and 41 rows (a full group of 32 and a partial one) the
    tensor-core kernel on a GPU of compute 8.0 or later, or k_matmul_q with CLOVER_CUDA_MMA=0;
    67 weight rows leave a partial tile of 16."""
    monkeypatch.setenv("CLOVER_CUDA_MMA", mma)
    rng = np.random.default_rng(T)
    type_ = {**PLAIN, **BLOCKS}[name]
    ne0, ne1 = 1024, 67
    q, w = _weights(name, type_, ne0, ne1, rng)
    x = (rng.standard_normal((T, ne0)) * rng.uniform(0.01, 10, (T, 1))).astype(np.float32)
    y = _gpu_matmul(type_, q, ne0, ne1, x)
    want = _cpu_matmul(type_, q, ne0, ne1, x)
    scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
    assert np.all(np.abs(y - want) <= 1e-5 * scale), (name, float(np.max(np.abs(y - want) / scale)))


def _compute_capability() -> tuple[int, int]:
    m = re.search(r"compute (\d+)\.(\d+)", INFO)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


@gpu
def test_many_row_products_take_the_tensor_core_kernel(monkeypatch):
    """With compute 8.0 or later, 32 rows of Q4_K and Q6_K go through k_matmul_mma, and of F16 and
    BF16 through k_matmul_mma_f: their results (within the CPU tolerance, as above) differ in the
    last bits from k_matmul_q's / k_matmul_plain's (CLOVER_CUDA_MMA=0), which sum each row in
    another order; equal results would mean the tensor-core path never ran."""
    if _compute_capability() < (8, 0):
        pytest.skip("mma needs compute capability 8.0")
    rng = np.random.default_rng(11)
    ne0, ne1 = 2048, 40
    x = rng.standard_normal((32, ne0)).astype(np.float32)
    types = {**PLAIN, **BLOCKS}
    for name in ("Q4_K", "Q6_K", "F16", "BF16"):
        q, w = _weights(name, types[name], ne0, ne1, rng)
        monkeypatch.setenv("CLOVER_CUDA_MMA", "1")
        y_mma = _gpu_matmul(types[name], q, ne0, ne1, x)
        monkeypatch.setenv("CLOVER_CUDA_MMA", "0")
        y_plain = _gpu_matmul(types[name], q, ne0, ne1, x)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
        assert np.all(np.abs(y_mma - y_plain) <= 2e-5 * scale), name
        assert not np.array_equal(y_mma, y_plain), name


@gpu
@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
@pytest.mark.parametrize("ne0", [1004, 1001])
def test_float_products_of_any_row_length(name, ne0):
    """Float weights whose rows do not allow 16-byte loads: ne0 1004 (F32 still takes them, F16
    and BF16 not) and 1001 (no type), 3 and 20 rows (20 would take tensor cores with ne0 a
    multiple of 32): the element-wise kernel against the CPU engine, within 1e-5 of sum |w x|."""
    rng = np.random.default_rng(ne0)
    q, w = _weights(name, PLAIN[name], ne0, 37, rng)
    for T in (3, 20):
        x = rng.standard_normal((T, ne0)).astype(np.float32)
        y = _gpu_matmul(PLAIN[name], q, ne0, 37, x)
        want = _cpu_matmul(PLAIN[name], q, ne0, 37, x)
        scale = np.abs(x.astype(np.float64)) @ np.abs(w).T
        assert np.all(np.abs(y - want) <= 1e-5 * scale), (T, float(np.max(np.abs(y - want) / scale)))


@gpu
@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_weights_on_tensor_cores_keep_float32_activations(name):
    """32 rows of F16 / BF16 weights (tensor cores on compute 8.0 or later, their activations split
    into 16-bit terms) with one nonzero activation a row, of magnitude 1e-3 to 1e3: each product
    is one multiplication w x, which the terms must reproduce within 2^-20 of |w x| (a first
    term alone is up to 2^-9 off (BF16) or 2^-12 (F16), two BF16 terms 2^-18)."""
    rng = np.random.default_rng(17)
    ne0, ne1, T = 256, 48, 32
    q, w = _weights(name, PLAIN[name], ne0, ne1, rng)
    x = np.zeros((T, ne0), np.float32)
    cols = rng.integers(0, ne0, T)
    x[np.arange(T), cols] = rng.uniform(1, 2, T) * 10.0 ** rng.uniform(-3, 3, T) * rng.choice([-1, 1], T)
    y = _gpu_matmul(PLAIN[name], q, ne0, ne1, x)
    want = x[np.arange(T), cols].astype(np.float64)[:, None] * w[:, cols].T
    assert np.all(np.abs(y - want) <= 2.0 ** -20 * np.abs(want)), float(np.max(np.abs(y - want) / np.abs(want)))


@gpu
def test_matmul_refuses_bad_arguments():
    err = _cffi.new("char[]", 256)
    x = np.zeros(64, np.float32)
    dev = _cffi.new("void **")
    assert _clib.clover_cuda_upload(_cffi.cast("void *", x.ctypes.data), x.nbytes, dev, err, 256) == 0
    try:
        xp = _cffi.cast("float *", x.ctypes.data)
        assert _clib.clover_cuda_matmul(PLAIN["F32"], dev[0], 0, 1, xp, 1, xp, err, 256) == lib.CLOVER_E_ARG
        assert "ne0" in _cffi.string(err).decode()
        assert _clib.clover_cuda_matmul(99, dev[0], 32, 1, xp, 1, xp, err, 256) == lib.CLOVER_E_ARG
        assert "type 99" in _cffi.string(err).decode()
        assert _clib.clover_cuda_matmul(BLOCKS["Q4_0"], dev[0], 48, 1, xp, 1, xp, err, 256) == lib.CLOVER_E_ARG
        assert "multiple of 32" in _cffi.string(err).decode()
    finally:
        _clib.clover_cuda_free(dev[0])


@gpu
@pytest.mark.parametrize("types,H,I", [(("Q4_K", "Q4_K", "Q6_K"), 256, 512), (("Q8_0", "Q8_0", "Q8_0"), 256, 512),
                                       (("F16", "Q4_K", "IQ4_NL"), 256, 512), (("MXFP4", "Q5_K", "BF16"), 256, 512),
                                       (("Q4_K", "Q4_K", "Q6_K"), 2048, 512)])  # the last: 35B-A3B's H and I
def test_grouped_experts_equal_the_cpu_expert_by_expert(types, H, I):
    """clover_cuda_experts (one grouped product per projection over every expert's tiles) against
    the CPU engine's products expert by expert with silu(g) * u between (model/moe.c expert_ffn):
    8 experts, buckets of 0 to 19 pairs (tiles of 8 and a remainder), mixed weight types (also
    gate and up rounding x differently), and the real model's H = 2048, I = 512; tolerance
    1e-5 of sum |w x| as for one product, plus two steps of down's int8 activations (h, from the
    GPU's gate and up, may round one step apart where it lies within float error of a boundary:
    seen with F16 gate on tensor cores, 1.2e-4 of sum |w x| on one row)."""
    rng = np.random.default_rng(7)
    E = 8
    counts = np.array([3, 0, 19, 8, 1, 0, 16, 5])
    start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    P = int(start[-1])
    xg = (rng.standard_normal((P, H)) * rng.uniform(0.05, 1, (P, 1)) * np.sqrt(256 / H)).astype(np.float32)
    mats, devs = {}, []
    try:
        ws = []
        for name, tname, (ne0, ne1) in zip(("gate", "up", "down"), types, ((H, I), (H, I), (I, H))):
            type_ = {**PLAIN, **BLOCKS}[tname]
            parts = [_weights(tname, type_, ne0, ne1, rng) for _ in range(E)]
            q = np.concatenate([p[0] for p in parts])
            mats[name] = (type_, [p[0] for p in parts], [p[1] for p in parts], ne0, ne1)
            dev = _cffi.new("void **")
            err = _cffi.new("char[]", 256)
            assert _clib.clover_cuda_upload(_cffi.cast("void *", q.ctypes.data), q.size, dev, err, 256) == 0
            devs.append(dev[0])
            ws.append(_cffi.new("clover_cuda_weight *", [type_, dev[0], ne0, ne1, parts[0][0].size]))
        yg = np.zeros((P, H), np.float32)
        err = _cffi.new("char[]", 256)
        rc = _clib.clover_cuda_experts(ws[0], ws[1], ws[2], E, _cffi.cast("int64_t *", start.ctypes.data),
                                       _cffi.cast("float *", xg.ctypes.data), _cffi.cast("float *", yg.ctypes.data),
                                       err, 256)
        assert rc == 0, _cffi.string(err)
        # refused: a decreasing start, and down with the wrong shape
        bad = start.copy()
        bad[3] = bad[2] - 1
        assert _clib.clover_cuda_experts(ws[0], ws[1], ws[2], E, _cffi.cast("int64_t *", bad.ctypes.data),
                                         _cffi.cast("float *", xg.ctypes.data), _cffi.cast("float *", yg.ctypes.data),
                                         err, 256) == lib.CLOVER_E_ARG and "start" in _cffi.string(err).decode()
        assert _clib.clover_cuda_experts(ws[0], ws[1], ws[0], E, _cffi.cast("int64_t *", start.ctypes.data),
                                         _cffi.cast("float *", xg.ctypes.data), _cffi.cast("float *", yg.ctypes.data),
                                         err, 256) == lib.CLOVER_E_ARG and "down" in _cffi.string(err).decode()
    finally:
        for d in devs:
            _clib.clover_cuda_free(d)
    for e in range(E):
        rows = slice(start[e], start[e + 1])
        if counts[e] == 0:
            continue
        x = xg[rows]
        g = _cpu_matmul(mats["gate"][0], mats["gate"][1][e], H, I, x)
        u = _cpu_matmul(mats["up"][0], mats["up"][1][e], H, I, x)
        h = (g / (1.0 + np.exp(-g)) * u).astype(np.float32)
        want = _cpu_matmul(mats["down"][0], mats["down"][1][e], I, H, h)
        scale = np.abs(h.astype(np.float64)) @ np.abs(mats["down"][2][e]).T
        # h differs from the GPU's in the last bits, so a value of h lying that close to a rounding
        # boundary of down's int8 activations can round one step apart: allow two such steps
        step = np.abs(h).max(1, keepdims=True) / 127 * np.abs(mats["down"][2][e]).max(1) if types[2] in BLOCKS else 0
        assert np.all(np.abs(yg[rows] - want) <= 1e-5 * scale + 2 * step + 1e-6), \
            (e, float(np.max(np.abs(yg[rows] - want) / scale)))


def _f(a: np.ndarray):
    return _cffi.cast("float *", a.ctypes.data)


@gpu
@pytest.mark.parametrize("mma", [True, False], ids=["tensor-cores", "no-tensor-cores"])
@pytest.mark.parametrize("hd,n_head,n_kv,kv_f16", [(64, 4, 2, 0), (256, 16, 2, 0), (256, 16, 2, 3), (128, 6, 6, 1),
                                                  (32, 20, 2, 2), (32, 16, 16, 0), (64, 12, 4, 1)])
def test_attention_with_the_cache_on_the_device_equals_float64(hd, n_head, n_kv, kv_f16, mma, monkeypatch):
    """clover_cuda_attention in prefix (causal) and block mode, GQA, a cache holding 37 earlier
    rows written by clover_cuda_write, against float64 numpy (softmax(q K^T / sqrt(hd)) V times
    sigmoid(gate), spec 2.2): within 1e-5 of max |v| (float32 sums, or tf32 products of three
    terms; seen about 1e-7). Block mode then runs again on the same rows with other values: the
    cache rows are overwritten, as a denoising step rewrites its block's scratch rows. One row
    takes k_attention, its keys in up to 64 splits (most empty); 11 and 40 rows take
    k_attention_mma where there are tensor cores (16 queries a warp, from rows that differ in
    their causal key counts; 12 heads on 4 KV heads: 3 a KV head, so a tile's queries straddle
    rows), its keys in splits of 64 or more (48 keys: one, 77: two, the merge skipping the empty
    ones), else k_attention, its keys in several splits or, with 16 KV heads at 40 rows, one (the
    output written without k_attention_merge); 20 heads on 2 KV heads: two k_attention blocks per
    KV head, the second with warps past the group's heads. kv_f16 (1: K, 2: V, 3: both): those
    caches hold fp16 values (the reference reads the same fp16 values); 35B-A3B's heads with both
    cache types."""
    if not mma:
        monkeypatch.setenv("CLOVER_CUDA_MMA", "0")
    for T in (1, 11, 40):
        _check_attention(hd, n_head, n_kv, T, kv_f16)


@gpu
def test_long_prefill_attention_on_tensor_cores_without_splits():
    """1024 causal rows at 16 heads on 16 KV heads: 1024 tiles of 16 queries (a warp each) of
    k_attention_mma, enough to fill the GPU, so one split and the output written by the kernel
    itself (no k_attention_merge); against float64 numpy as above, over up to 1024 keys."""
    _check_attention(32, 16, 16, 1024, 0, n_ctx=1024, pos0=0, modes=(1,))


def _check_attention(hd, n_head, n_kv, T, kv_f16, n_ctx=96, pos0=37, modes=(1, 0, 0)):
    rng = np.random.default_rng(hd + T)
    kvd = n_kv * hd
    dts = [np.float16 if kv_f16 & bit else np.float32 for bit in (1, 2)]  # K, V cache element types
    k_all = rng.standard_normal((n_ctx, kvd)).astype(dts[0])
    v_all = rng.standard_normal((n_ctx, kvd)).astype(dts[1])
    err = _cffi.new("char[]", 256)
    kd, vd = _cffi.new("void **"), _cffi.new("void **")
    assert _clib.clover_cuda_alloc(k_all.nbytes, kd, err, 256) == 0
    assert _clib.clover_cuda_alloc(v_all.nbytes, vd, err, 256) == 0

    def write(rows):
        for dev, a in ((kd[0], k_all), (vd[0], v_all)):
            at, n = rows.start * a[0].nbytes, (rows.stop - rows.start) * a[0].nbytes
            assert _clib.clover_cuda_write(dev, at, _cffi.cast("char *", a.ctypes.data) + at, n, err, 256) == 0

    try:
        write(slice(0, pos0))
        for causal in modes:
            q = (rng.standard_normal((T, n_head, 2 * hd)) * 0.3).astype(np.float32)
            k_all[pos0:pos0 + T] = rng.standard_normal((T, kvd))
            v_all[pos0:pos0 + T] = rng.standard_normal((T, kvd))
            write(slice(pos0, pos0 + T))
            out = np.zeros((T, n_head, hd), np.float32)
            rc = _clib.clover_cuda_attention(_f(q), kd[0], vd[0], kv_f16, n_ctx, pos0, T, n_head, n_kv, hd, causal,
                                             1 / np.sqrt(hd), _f(out), err, 256)
            assert rc == 0, _cffi.string(err)
            n_rep, n_all = n_head // n_kv, pos0 + T
            for h in range(n_head):
                kv = slice((h // n_rep) * hd, (h // n_rep + 1) * hd)
                sc = q[:, h, :hd].astype(np.float64) @ k_all[:n_all, kv].astype(np.float64).T / np.sqrt(hd)  # [T][keys]
                if causal:
                    sc[np.arange(n_all)[None, :] > pos0 + np.arange(T)[:, None]] = -np.inf
                p = np.exp(sc - sc.max(axis=1, keepdims=True))
                gate = 1 / (1 + np.exp(-q[:, h, hd:].astype(np.float64)))
                want = (p / p.sum(axis=1, keepdims=True)) @ v_all[:n_all, kv].astype(np.float64) * gate
                err_h = np.max(np.abs(out[:, h] - want), axis=1)
                assert np.all(err_h <= 1e-5 * np.abs(v_all).max()), (causal, int(np.argmax(err_h)), h)
        bad = _clib.clover_cuda_attention(_f(q), kd[0], vd[0], kv_f16, n_ctx, n_ctx - T + 1, T, n_head, n_kv, hd, 1,
                                          1.0, _f(out), err, 256)
        assert bad == lib.CLOVER_E_ARG and "pos0" in _cffi.string(err).decode()
    finally:
        _clib.clover_cuda_free(kd[0])
        _clib.clover_cuda_free(vd[0])


def _gdn_reference(conv, beta, g, S, Hk, dk, dv):
    """The delta rule of spec 2.1 step 6 in float64. conv [T][C]; S [Hv][dk][dv] (updated in
    place). Returns o [T][Hv][dv]."""
    T, Hv = beta.shape
    o = np.zeros((T, Hv, dv))
    for h in range(Hv):
        Sh = S[h]
        for t in range(T):
            q = conv[t, (h % Hk) * dk:(h % Hk + 1) * dk]
            k = conv[t, Hk * dk + (h % Hk) * dk:Hk * dk + (h % Hk + 1) * dk]
            v = conv[t, 2 * Hk * dk + h * dv:2 * Hk * dk + (h + 1) * dv]
            Sh *= np.exp(g[t, h])
            Sh += np.outer(k, (v - Sh.T @ k) * beta[t, h])
            o[t, h] = Sh.T @ q
    return o


def _gdn_inputs(rng, T: int, Hk: int, Hv: int, dk: int, dv: int):
    """Random GDN inputs as the engine feeds them: conv [T][2 Hk dk + Hv dv] with l2-normed q and k
    heads, beta in (0.05, 0.95), log-decays g in (-1.5, -0.01), a state [Hv][dk][dv]; float32."""
    conv = rng.standard_normal((T, 2 * Hk * dk + Hv * dv))
    for j in range(2 * Hk):
        conv[:, j * dk:(j + 1) * dk] /= np.linalg.norm(conv[:, j * dk:(j + 1) * dk], axis=1, keepdims=True)
    beta = rng.uniform(0.05, 0.95, (T, Hv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, (T, Hv)).astype(np.float32)
    S0 = (rng.standard_normal((Hv, dk, dv)) * 0.5).astype(np.float32)
    return conv.astype(np.float32), beta, g, S0


@gpu
@pytest.mark.parametrize("Hk,Hv,dk,dv", [(2, 4, 64, 64), (1, 3, 128, 32), (2, 2, 32, 128), (16, 32, 128, 128),
                                         (1, 2, 256, 48), (1, 1, 20, 40)])
def test_gdn_recurrence_on_the_device_equals_float64(Hk, Hv, dk, dv):
    """clover_cuda_gdn (kind CLOVER_GDN_FORWARD) against the float64 delta rule: the outputs and
    the device state it updates (read back and compared), twice in a row (the second from the
    first's state); 13 rows, l2-normed q/k as the engine feeds them (one case has the real
    model's 16 key and 32 value heads of 128), random decays and betas. Tolerance 1e-4 of
    max |o| (float32 recurrences; seen about 1e-6)."""
    T, C = 13, 2 * Hk * dk + Hv * dv
    conv, beta, g, S0 = _gdn_inputs(np.random.default_rng(dk + dv), T, Hk, Hv, dk, dv)
    err = _cffi.new("char[]", 256)
    dev = _dev(S0)  # the state
    try:
        for _ in range(2):
            o = np.zeros((T, Hv, dv), np.float32)
            assert _clib.clover_cuda_gdn(0, _f(conv), _f(beta), _f(g), T, Hk, Hv, dk, dv, C,
                                         _cffi.cast("float *", dev), _f(o), err, 256) == 0, _cffi.string(err)
            S_ref = S0.astype(np.float64)
            want = _gdn_reference(conv.astype(np.float64), beta.astype(np.float64), g.astype(np.float64), S_ref,
                                  Hk, dk, dv)
            assert np.max(np.abs(o - want)) <= 1e-4 * np.abs(want).max(), float(np.max(np.abs(o - want)))
            back = _host(dev, S0.shape)
            assert np.max(np.abs(back - S_ref)) <= 1e-4 * np.abs(S_ref).max()
            S0 = back
        for kind, bad_dk in ((0, 512), (2, dk)):  # dk past 256; no kind 2
            assert _clib.clover_cuda_gdn(kind, _f(conv), _f(beta), _f(g), T, Hk, Hv, bad_dk, dv, C,
                                         _cffi.cast("float *", dev), _f(o), err, 256) == lib.CLOVER_E_ARG
            assert "kind" in _cffi.string(err).decode()
    finally:
        _clib.clover_cuda_free(dev)


@gpu
@pytest.mark.parametrize("Hk,Hv,dk,dv,T", [(2, 4, 64, 48, 150), (16, 32, 128, 128, 70), (1, 1, 20, 40, 64),
                                           (1, 2, 256, 32, 65), (1, 2, 32, 32, 600)])
def test_gdn_chunked_prefill_equals_float64(Hk, Hv, dk, dv, T):
    """clover_cuda_gdn's chunked forward (kind CLOVER_GDN_FORWARD_CHUNKED, gdn_chunk.cuh: chunks of
    64 rows, every chunk's products at once, then the state carried through them) against the
    float64 delta rule: the
    outputs and the updated device state, for several chunks and a partial last one (150 rows),
    the real model's heads (70 rows), one exact chunk, dk 20 and 256, dv not a multiple of 32,
    and two windows of chunks (600 rows: 512, then 88, the state carried between).
    Tolerance 1e-4 of max |o| and of max |S|, as the recurrence's test."""
    C = 2 * Hk * dk + Hv * dv
    conv, beta, g, S0 = _gdn_inputs(np.random.default_rng(T + dk), T, Hk, Hv, dk, dv)
    err = _cffi.new("char[]", 256)
    dev = _dev(S0)  # the state
    try:
        o = np.zeros((T, Hv, dv), np.float32)
        assert _clib.clover_cuda_gdn(1, _f(conv), _f(beta), _f(g), T, Hk, Hv, dk, dv, C, _cffi.cast("float *", dev),
                                     _f(o), err, 256) == 0, _cffi.string(err)
        back = _host(dev, S0.shape)
    finally:
        _clib.clover_cuda_free(dev)
    S_ref = S0.astype(np.float64)
    want = _gdn_reference(conv.astype(np.float64), beta.astype(np.float64), g.astype(np.float64), S_ref, Hk, dk, dv)
    assert np.max(np.abs(o - want)) <= 1e-4 * np.abs(want).max(), float(np.max(np.abs(o - want)))
    assert np.max(np.abs(back - S_ref)) <= 1e-4 * np.abs(S_ref).max(), float(np.max(np.abs(back - S_ref)))


def _gdn_block_reference(conv, S, lam, beta0, c, P, Hk, dk, dv):
    """Spec 3.3 steps 3-4 in float64: per value head h (key head h % Hk) and block row i,
    s_ij = exp(lambda_h) q~_i . k~_j over every block row j, s_iH = beta0_h + c_h ln(1 + P),
    a_i = softmax(s_i), o_i = a_iH S_h^T q_i + sum_j a_ij v_j; conv [T][C] as the engine feeds it
    (q carrying 1/sqrt(dk), so q~ = sqrt(dk) q), S [Hv][dk][dv]. Returns o [T][Hv][dv]."""
    T, Hv = conv.shape[0], S.shape[0]
    o = np.zeros((T, Hv, dv))
    for h in range(Hv):
        kh = h % Hk
        q = conv[:, kh * dk:(kh + 1) * dk]
        k = conv[:, Hk * dk + kh * dk:Hk * dk + (kh + 1) * dk]
        v = conv[:, 2 * Hk * dk + h * dv:2 * Hk * dk + (h + 1) * dv]
        s = np.exp(lam[h]) * (np.sqrt(dk) * q) @ k.T  # [T][T]
        s = np.concatenate([s, np.full((T, 1), beta0[h] + c[h] * np.log1p(P))], axis=1)
        a = np.exp(s - s.max(axis=1, keepdims=True))
        a /= a.sum(axis=1, keepdims=True)
        o[:, h] = a[:, T:] * (q @ S[h]) + a[:, :T] @ v
    return o


# (Hk, Hv, dk, dv): the real model's GDN heads; small odd ones (dk odd, dv past one column tile of
# 128 and not a multiple of 32, value heads sharing key heads); dk at its bound of 256
BLOCK_DIMS = {"real": (16, 32, 128, 128), "odd": (2, 6, 19, 130), "tiny": (1, 1, 5, 3), "dk256": (1, 2, 256, 40)}


@gpu
@pytest.mark.parametrize("dims", BLOCK_DIMS.values(), ids=BLOCK_DIMS.keys())
@pytest.mark.parametrize("T", [1, 7, 32, 70])
def test_gdn_block_operator_equals_float64(dims, T):
    """clover_cuda_gdn_block (host conv, lambda, beta0, c; P an argument) and
    clover_cuda_gdn_block_d (all on the device, P = *pos) against spec 3.3 steps 3-4 in float64
    (_gdn_block_reference), for T = 1, 7, 32 (one tile of keys) and 70 (three tiles, the last
    partial; nine tiles of 8 rows), P = 0, 5 and 100000 (the history slot from beta0 alone to
    dominant), random state, lambda in (-0.5, 2.5), beta0 and c of both signs; q and k l2-normed
    as the engine feeds them. The state stays as it was. Bound: 5e-6 of max |o| (float32; the
    scores' rounding is scaled by exp(lambda) and exponentiated; seen under the emulator: up to
    5.7e-7). Then the device variant captured
    in a CUDA graph and replayed after *pos changed gives the new P's result (a graph holds *pos,
    not its value), and bad arguments are refused by name."""
    Hk, Hv, dk, dv = dims
    C = 2 * Hk * dk + Hv * dv
    rng = np.random.default_rng(T * 1000 + dk + dv)
    conv, _, _, S0 = _gdn_inputs(rng, T, Hk, Hv, dk, dv)
    conv[:, :Hk * dk] /= np.float32(np.sqrt(dk))  # q carries 1/sqrt(dk) (qk_norm)
    lam = rng.uniform(-0.5, 2.5, Hv).astype(np.float32)
    beta0 = rng.normal(0.0, 1.5, Hv).astype(np.float32)
    c = rng.uniform(-1.0, 1.5, Hv).astype(np.float32)
    c64 = [x.astype(np.float64) for x in (conv, S0, lam, beta0, c)]
    err = _cffi.new("char[]", 256)
    pos = np.zeros(1, np.int64)
    o = np.zeros((T, Hv, dv), np.float32)
    with _on_device(S0, conv, lam, beta0, c, pos, o) as (dS, dconv, dlam, dbeta0, dc, dpos, do):
        fS = _cffi.cast("float *", dS)
        for P in (0, 5, 100000):
            want = _gdn_block_reference(*c64[:2], *c64[2:], P, Hk, dk, dv)
            o[:] = np.nan
            assert _clib.clover_cuda_gdn_block(_f(conv), T, Hk, Hv, dk, dv, C, fS, _f(lam), _f(beta0), _f(c), P,
                                               _f(o), err, 256) == 0, _cffi.string(err)
            assert _rel(o, want) <= 5e-6, ("host", P, _rel(o, want))
            _call(_clib.clover_cuda_write, dpos, 0, _cffi.cast("void *", np.array([P], np.int64).ctypes.data), 8)
            _call(_clib.clover_cuda_gdn_block_d, dconv, T, Hk, Hv, dk, dv, C, fS, dlam, dbeta0, dc, dpos, do)
            got = _host(do, o.shape)
            assert _rel(got, want) <= 5e-6, ("device", P, _rel(got, want))
        np.testing.assert_array_equal(_host(dS, S0.shape), S0)  # read only
        # a graph of the device variant replays with the P in *pos when it runs
        graph = _cffi.new("void **")
        _call(_clib.clover_cuda_capture_begin)
        rc = _clib.clover_cuda_gdn_block_d(dconv, T, Hk, Hv, dk, dv, C, fS, dlam, dbeta0, dc, dpos, do, err, 256)
        _call(_clib.clover_cuda_capture_end, graph)
        assert rc == 0, _cffi.string(err)
        try:
            for P in (3, 0):
                _call(_clib.clover_cuda_write, dpos, 0, _cffi.cast("void *", np.array([P], np.int64).ctypes.data), 8)
                _call(_clib.clover_cuda_graph_launch, graph[0])
                want = _gdn_block_reference(*c64[:2], *c64[2:], P, Hk, dk, dv)
                assert _rel(_host(do, o.shape), want) <= 5e-6, ("graph", P)
        finally:
            _clib.clover_cuda_graph_free(graph[0])
        for args in ((T, Hk, Hv, 512, dv, C), (T, Hk, Hv, dk, 2048, C), (T, Hk, Hv, dk, dv, C - 1),
                     (0, Hk, Hv, dk, dv, C)):  # dk past 256, dv past 1024, C too small, no rows
            assert _clib.clover_cuda_gdn_block_d(dconv, *args, fS, dlam, dbeta0, dc, dpos, do, err, 256) == \
                lib.CLOVER_E_ARG, args
            assert "gdn_block_d: bad arguments" in _cffi.string(err).decode()
        assert _clib.clover_cuda_gdn_block_d(dconv, T, Hk, Hv, dk, dv, C, fS, dlam, dbeta0, dc, _cffi.NULL, do, err,
                                             256) == lib.CLOVER_E_ARG
        assert _clib.clover_cuda_gdn_block(_f(conv), T, Hk, Hv, dk, dv, C, fS, _f(lam), _f(beta0), _f(c), -1, _f(o),
                                           err, 256) == lib.CLOVER_E_ARG
        assert "gdn_block: bad arguments" in _cffi.string(err).decode()


@gpu
@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0", "q4_k_m"])
def test_whole_model_on_gpu_equals_the_cpu(make_gguf, outtype):
    """Logits of a prefill with every layer and the output offloaded (the resident forward:
    activations stay on the GPU) are within 2e-3 * the logits' std of the CPU's (seen: 7.6e-6
    at F32, 1.6e-6 at Q4_K_M, emulated), and so are block-mode logits (a block pass after a
    prefix and one from an empty cache) on the resident path and the per-product one (the
    partial offload) with float weights (F32, BF16; seen: up to 4.8e-6 x std), and greedy
    tokens and the experts counted per block
    pass are identical in all three modes, for the whole offload and a partial one (the
    per-product path).

    Q8_0 has no logits bound: on this random model it turns float-order differences into
    large ones (a Q8_0 activation crossing a rounding step moves a router near a tie), as the
    CPU engine's own kernels show: its scalar, AVX2 and AVX-512 paths, same weights, differ by
    up to 0.08 * std on the test prompts (measured 2026-12-01), the GPU by up to 1 * std; its
    greedy tokens must still be identical. Block logits have no bound at Q8_0 and Q4_K_M for
    the same reason: at Q4_K_M the per-product block pass after the prefix differed by 0.07 *
    std (2026-12-03, emulated) while the GPU's layer 0 (block operator included, bit for bit
    the CPU's from the same inputs) handed layer 1, on the CPU, inputs within 1e-7 of the CPU
    run's, and layer 1 jumped there; the block softmax mixes every row, so every row moved.

    KV caches: F32 (the default) at Q8_0 and Q4_K_M; F32 keys with F16 values at F32, F16 keys
    with F32 values at BF16 (the GPU rounds to fp16 as the CPU does), where the partial offload
    takes all 4 layers without the output, so the attention layer (3) runs on the per-product
    path against the host cache's fp16 rows. An F16 cache turns the
    backends' last-bit differences in K and V into fp16 steps: with both F16 at Q4_K_M the
    emulated diffusion tokens differed from the CPU's at index 10 (2026-12-01), which is why F32
    is the default."""
    from clover_gguf import Model

    path = make_gguf(outtype, **GEN_MODEL)
    kv = {"f32": dict(type_k="f32", type_v="f16"), "bf16": dict(type_k="f16", type_v="f32")}.get(outtype, {})
    n_half = 4 if kv else 2
    with Model(path, n_ctx=512, n_threads=2, **kv) as cpu, \
            Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1, **kv) as g, \
            Model(path, n_ctx=512, n_threads=2, n_gpu_layers=n_half, **kv) as half:
        assert g.n_gpu_layers == g.hparams["n_layer"] + 1 and half.n_gpu_layers == n_half
        assert lib.clover_model_gpu_resident(g._model) == 1 and lib.clover_model_gpu_resident(half._model) == 0
        ids = cpu.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
        lc, lg = cpu.prefix_logits(ids), g.prefix_logits(ids)
        assert np.all(np.isfinite(lg)) and lg.shape == lc.shape
        if outtype != "q8_0":
            assert np.max(np.abs(lc - lg)) <= 2e-3 * float(np.std(lc)) + 1e-4, float(np.max(np.abs(lc - lg)))
        # block mode (spec 3.3: right taps, the block softmax with the history slot), after a
        # prefix (P > 0) and from an empty cache (P = 0, a zero state), on both GPU paths
        mask = cpu.hparams["mask_token_id"]
        for prefix, block in ((ids[:-3], ids[-3:] + [mask] * 5), ([], ids[:2] + [mask] * 6)):
            bc = cpu.block_logits(prefix, block)[0]
            for name, m in (("resident", g), ("per-product", half)):
                bg = m.block_logits(prefix, block)[0]
                assert np.all(np.isfinite(bg)), name
                if outtype in ("f32", "bf16"):
                    assert np.max(np.abs(bc - bg)) <= 2e-3 * float(np.std(bc)) + 1e-4, \
                        (name, len(prefix), float(np.max(np.abs(bc - bg))))
        experts = ("sum_distinct_experts", "max_distinct_experts", "mean_distinct_experts_full",
                   "max_distinct_experts_full")
        for mode in ("ar", "diffusion", "spec"):
            want, st = cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])
            assert len(want) == GEN_TOKENS
            got, st_g = g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])
            _tokens_as_the_cpu(got, want, path, ids, mode, kv, "resident")
            # the experts each block pass used, with and without the coreset (counted on the GPU
            # in the resident forward); F32 only: quantised, a router near-tie flips one expert
            # of one pass (Q4_K_M: 234 against 235 summed over the passes, on both GPU paths)
            if outtype == "f32":
                assert [st_g[k] for k in experts] == [st[k] for k in experts], mode
            got = half.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0]
            _tokens_as_the_cpu(got, want, path, ids, mode, kv, "per-product")


def _tokens_as_the_cpu(got: list, want: list, path, ids: list, mode: str, model_kw: dict, what: str) -> None:
    """The GPU's greedy tokens got equal the CPU engine's want, or, where they differ, the CPU's
    scalar kernels (CLOVER_ISA=scalar, in a child process) differ from its SIMD ones (want) at
    or before that index, and got equals want before the first index where the CPU's own
    paths part: the GPU is held to what the CPU agrees with itself on. On a random model with
    int8-rounded activations a token can sit on a threshold or a tie that float order decides
    (seen at Q4_K_M, 2026-12-03, emulated: diffusion's token 13 was 1768 on the GPU and the
    scalar CPU, 807 with AVX2, 1217 with AVX-512)."""
    if got == want:
        return
    code = ("import json, sys\nfrom clover_gguf import Model\n"
            "with Model(sys.argv[1], n_ctx=512, n_threads=2, **json.loads(sys.argv[2])) as m:\n"
            "    print(json.dumps(m.generate_tokens(json.loads(sys.argv[3]), max_tokens=int(sys.argv[4]), "
            "mode=sys.argv[5], end_ids=[])[0]))\n")
    env = dict(os.environ, CLOVER_ISA="scalar", PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", code, str(path), json.dumps(model_kw), json.dumps(list(ids)),
                        str(len(want)), mode], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    scalar = json.loads(r.stdout.strip().splitlines()[-1])
    n = next((i for i, (a, b) in enumerate(zip(want, scalar)) if a != b), len(want))
    first = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    assert n < len(want) and first >= n, (what, mode, "GPU", got, "CPU", want, "CPU scalar", scalar)


@gpu
def test_long_prefill_runs_the_chunked_gdn_and_equals_the_cpu(make_gguf):
    """A prefill past one chunk (150 tokens) runs the GDN in the chunked form on the GPU, on the
    resident path and the per-product one (2 layers offloaded): all rows' logits within 2e-3 of
    the CPU's std, as the short prompt's above. With the chunked form turned off
    (clover_context_set_gdn_chunked 0: the recurrence) the GPU's logits are within the same
    bound and differ in the last bits from the chunked ones, so the chunked form ran."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g, \
            Model(path, n_ctx=512, n_threads=2, n_gpu_layers=2) as half:
        ids = list(np.random.default_rng(5).integers(0, cpu.n_vocab - 300, 150))
        lc = cpu.prefix_logits(ids)
        bound = 2e-3 * float(np.std(lc)) + 1e-4
        runs = {}
        for name, m in (("resident", g), ("per-product", half)):
            for chunked in (1, 0):
                lib.clover_context_set_gdn_chunked(m._ctx, chunked)
                runs[name, chunked] = lg = m.prefix_logits(ids)
                assert np.max(np.abs(lc - lg)) <= bound, (name, chunked, float(np.max(np.abs(lc - lg))))
            assert not np.array_equal(runs[name, 1], runs[name, 0]), name


@gpu
def test_embeddings_on_the_gpu_equal_the_cpu(make_gguf):
    """clover_embed on the resident path (the final residual read back from the device,
    output_norm on the host) and the per-product one (2 layers offloaded): every pooling within
    2e-3 of the CPU rows' std, as the logits above; 150 tokens (the chunked GDN), and the
    context empty after."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g, \
            Model(path, n_ctx=512, n_threads=2, n_gpu_layers=2) as half:
        assert lib.clover_model_gpu_resident(g._model) == 1 and lib.clover_model_gpu_resident(half._model) == 0
        ids = list(np.random.default_rng(6).integers(0, cpu.n_vocab - 300, 150))
        want = {p: cpu.embed(ids, pooling=p) for p in ("none", "mean", "last")}
        bound = 2e-3 * float(np.std(want["none"])) + 1e-4
        for name, m in (("resident", g), ("per-product", half)):
            for p, w in want.items():
                got = m.embed(ids, pooling=p)
                assert got.shape == w.shape and np.max(np.abs(got - w)) <= bound, (name, p, float(np.max(np.abs(got - w))))
            assert lib.clover_context_n_past(m._ctx) == 0


@gpu
def test_long_prefill_with_some_layers_on_the_gpu_runs_in_passes(make_gguf):
    """With some layers offloaded (the per-product path) a prefill runs in passes of at most 512
    rows (model/forward.c PASS_ROWS_GPU: the GPU's per-product scratch stays bounded): 600 tokens take 2
    passes, and every row's logits are within 2e-3 of the CPU's std (one pass there)."""
    from clover_gguf import Model

    passes = _clib.clover_context_passes
    path = make_gguf("f32", **GEN_MODEL)  # not Q8_0: see test_whole_model_on_gpu_equals_the_cpu
    ids = list(np.random.default_rng(9).integers(0, 2000, 600))
    with Model(path, n_ctx=700, n_threads=2) as cpu, Model(path, n_ctx=700, n_threads=2, n_gpu_layers=2) as half:
        assert lib.clover_model_gpu_resident(half._model) == 0
        lc = cpu.prefix_logits(ids)
        before = passes(half._ctx)
        lg = half.prefix_logits(ids)
        assert passes(half._ctx) - before == 2
    assert np.max(np.abs(lc - lg)) <= 2e-3 * float(np.std(lc)) + 1e-4, float(np.max(np.abs(lc - lg)))


@gpu
def test_greedy_tokens_identical_across_placements(make_gguf):
    """Placements: CPU only, all on the GPU, routed experts on the CPU (--cpu-moe, --n-cpu-moe 2: the
    resident forward, those experts' inputs and outputs crossing to the CPU and back), partial
    layers, and a --fit budget give the same greedy tokens in every mode, at Q4_K_M
    (the issue's type). Not Q8_0: there this prompt's diffusion tokens differ at index 13
    between the CPU engine's own AVX2 and AVX-512 kernels (see the test above)."""
    from clover_gguf import Model
    from clover_gguf.placement import RESERVE, placement

    path = make_gguf("q4_k_m", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu:
        ids = cpu.tokenize("class Config:\n    def __init__(self")
        want = {mode: cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0]
                for mode in ("ar", "diffusion", "spec")}
        budget = placement(cpu, -1)["gpu"] // 2 + RESERVE
    for kw in (dict(n_gpu_layers=-1), dict(n_gpu_layers=-1, n_cpu_moe=1 << 30), dict(n_gpu_layers=-1, n_cpu_moe=2),
               dict(n_gpu_layers=2), dict(gpu_budget=budget)):
        with Model(path, n_ctx=512, n_threads=2, **kw) as g:
            assert g.n_gpu_layers > 0, kw
            if "n_cpu_moe" in kw:  # the resident forward, with those layers' routed experts on the CPU
                assert lib.clover_model_gpu_resident(g._model) == 1, kw
            for mode, toks in want.items():
                assert g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0] == toks, (kw, mode)



emulated = pytest.mark.skipif(not EMULATED, reason="needs the CUDA emulator's memory size and allocation faults")


def _gpu_memory() -> tuple[int, int]:
    """The GPU's free and total bytes (clover_gpu_memory)."""
    free, total = ffi.new("int64_t *"), ffi.new("int64_t *")
    assert lib.clover_gpu_memory(free, total) == 0
    return int(free[0]), int(total[0])


def _gpu_free() -> int:
    return _gpu_memory()[0]


@emulated
def test_a_gpu_too_small_for_the_weights_is_refused_and_fit_uses_what_is_free(make_gguf, monkeypatch):
    """Placements on a small GPU (the emulator's device memory cut to CLOVER_EMU_MEMORY bytes):
    - room for half the weights: every layer is refused before any upload, by name (n_gpu_layers,
      the MiB needed and free), leaving the memory as it was;
    - room for the weights and half the context's state on the GPU (KV cache, GDN state, conv
      history: placement's ``cache``): the context, which allocates that state when it is
      created (as llama.cpp's), fails by name (n_ctx, the allocation), leaving the memory as it
      was;
    - room for the weights, that state and 4 KiB: the model loads, taking exactly the plan's
      bytes, and the first forward's buffers fail with CloverError naming the allocation, not a
      crash; closing the model gives all its memory back;
    - room for half the weights and placement.RESERVE: --fit's budget taken from the free memory
      (gpu_budget="free") chooses a placement that holds and runs, with the CPU's greedy tokens
      in ar and diffusion."""
    from clover_gguf import CloverError, Model
    from clover_gguf.placement import RESERVE, describe, placement

    path = make_gguf("q4_k_m", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu:
        ids = cpu.tokenize("class Config:\n    def __init__(self")
        want = {mode: cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0]
                for mode in ("ar", "diffusion")}
        plan = placement(cpu, -1)
        gpu_bytes, cache = plan["gpu"], plan["cache"]
        plan_line = describe(plan, cpu.hparams["n_layer"])
    free, total = _gpu_memory()
    used = total - free  # what earlier tests left allocated

    monkeypatch.setenv("CLOVER_EMU_MEMORY", str(used + gpu_bytes // 2))
    free = _gpu_free()
    seen = []  # plan_callback's calls: (the plan line, the free memory then)
    with pytest.raises(CloverError, match=r"n_gpu_layers: 5 needs [0-9.]+ MiB of weights on the GPU; [0-9.]+ MiB of [0-9.]+ MiB is free \(offload fewer"):
        Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1, plan_callback=lambda p: seen.append((p, _gpu_free())))
    assert _gpu_free() == free
    assert seen == [(plan_line, free)]  # the plan came before the refusal
    # the CLI prints it too: the plan line, then the error naming n_gpu_layers
    pkg = str(pathlib.Path(_ffi.__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-m", "clover_gguf", "run", "-m", str(path), "-p", "x", "-n", "1", "-ngl", "all"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=pkg + os.pathsep + os.environ.get("PYTHONPATH", "")))
    assert r.returncode == 2 and "placement: GPU:" in r.stderr, r.stderr
    assert r.stderr.index(f"placement: {plan_line}") < r.stderr.index("n_gpu_layers: 5 needs"), r.stderr

    monkeypatch.setenv("CLOVER_EMU_MEMORY", str(used + gpu_bytes + cache // 2))
    free = _gpu_free()
    with pytest.raises(CloverError, match=r"n_ctx: 512: the KV cache and GDN state on the GPU: CUDA: cudaMalloc of "
                                          r".* out of memory"):
        Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1)
    assert _gpu_free() == free

    monkeypatch.setenv("CLOVER_EMU_MEMORY", str(used + gpu_bytes + cache + 4096))
    free = _gpu_free()
    with Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:  # placement's bytes are the load's
        assert lib.clover_model_gpu_bytes(g._model) == gpu_bytes and _gpu_free() == free - gpu_bytes - cache
        with pytest.raises(CloverError, match=r"cudaMalloc of .* out of memory .*the GPU's memory is full"):
            g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode="ar", end_ids=[])
    assert _gpu_free() == free

    monkeypatch.setenv("CLOVER_EMU_MEMORY", str(used + RESERVE + gpu_bytes // 2))
    free = _gpu_free()
    seen.clear()
    with Model(path, n_ctx=512, n_threads=2, gpu_budget="free",
               plan_callback=lambda p: seen.append((p, _gpu_free()))) as g:
        plan = g.placement
        assert 0 < plan["gpu"] <= gpu_bytes // 2 and plan["budget"] == free, plan
        assert seen == [(plan["plan"], free)]  # --fit's plan, before any upload
        for mode, toks in want.items():
            assert g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0] == toks, (plan, mode)


@emulated
@pytest.mark.parametrize("placement", [dict(n_gpu_layers=-1, n_cpu_moe=2), dict(n_gpu_layers=2)],
                         ids=["resident_cpu_moe", "two_layers"])
def test_each_failed_gpu_allocation_is_an_error_and_the_model_recovers(make_gguf, placement):
    """Out of GPU memory at any point (clover_emu_fail_alloc: the k-th allocation from the load on
    fails, for every k until a run makes fewer than k), in two placements: every layer offloaded
    with the routed experts of the first two on the CPU (the resident forward, its buffers, the
    backend's scratch, pinned host memory for the experts' activations), and two layers
    offloaded (the per-product path): loading the model and generating in ar, diffusion and
    spec (its verify record and state snapshots) either raise CloverError naming the
    allocation's size and what to change,
    or (pinned host memory, which has a fallback) give the CPU's tokens, never crash. After a
    failed generation the same model, with memory back, generates the CPU's tokens in that mode (the
    emulator's failed allocations set the runtime's last error, as a GPU's do, so an error left
    there would fail that run). Closing the model gives back all the GPU memory: the free memory
    equals that after a clean run (the last context's close frees the backend's scratch too)."""
    from clover_gguf import CloverError, Model

    fail_alloc = _clib.clover_emu_fail_alloc
    path = make_gguf("q4_k_m", **GEN_MODEL)
    n_tok = 6
    with Model(path, n_ctx=256, n_threads=2) as cpu:
        ids = cpu.tokenize("import os\n")
        want = {mode: cpu.generate_tokens(ids, max_tokens=n_tok, mode=mode, end_ids=[])[0]
                for mode in ("ar", "diffusion", "spec")}

    def cycle():
        """Load, generate in each mode: the model (None if the load failed), tokens per mode, error."""
        got, m = {}, None
        try:
            m = Model(path, n_ctx=256, n_threads=2, **placement)
            for mode in want:
                got[mode] = m.generate_tokens(ids, max_tokens=n_tok, mode=mode, end_ids=[])[0]
            return m, got, None
        except CloverError as e:
            return m, got, e

    m, got, e = cycle()
    assert e is None and got == want
    m.close()
    free, total = _gpu_memory()
    assert free == total  # nothing left allocated
    n_load_failed = n_gen_failed = 0
    for k in range(1, 1000):
        start = fail_alloc(k)
        m, got, e = cycle()
        made = fail_alloc(0) - start
        try:
            if e is not None:
                assert made >= k and re.search(r"cudaMalloc of [0-9.]+ (MiB|bytes) \(.*\): out of memory .*the GPU's "
                                               r"memory is full: offload fewer layers", str(e)), (k, str(e))
                n_load_failed += m is None
                n_gen_failed += m is not None
                if m is not None:  # generation failed: the model still works, in the mode that failed
                    mode = next(mode for mode in want if mode not in got)
                    assert m.generate_tokens(ids, max_tokens=n_tok, mode=mode, end_ids=[])[0] == want[mode], (k, mode)
            else:
                assert got == want, k
        finally:
            if m is not None:
                m.close()
        assert _gpu_free() == free, (k, str(e))
        if made < k:  # this run never reached the k-th allocation: every point was tried
            break
    else:
        pytest.fail("more than 1000 GPU allocations in one run")
    # the weights' uploads, then the context's and the scratch's buffers in the first forwards
    assert n_load_failed >= 20 and n_gen_failed >= 15, (k, n_load_failed, n_gen_failed)

# byte offsets of fp16 fields in each block (kept finite when blocks are random bytes)
FP16_AT = {"Q8_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "MXFP4": (), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
           "IQ4_XS": (0,)}
BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "IQ4_NL": 18, "MXFP4": 17, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}


@pytest.fixture(scope="module")
def dq_check(tmp_path_factory):
    """tests/cuda/dq_check.cu built for the host with nvcc (the GPU kernels' dequantisation)."""
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("nvcc not found")

    exe = tmp_path_factory.mktemp("dq") / "dq_check"
    src = pathlib.Path(__file__).resolve().parents[1] / "cuda" / "dq_check.cu"
    r = subprocess.run([nvcc, "-O1", "-o", str(exe), str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return exe


@pytest.mark.parametrize("name", ["Q8_0", *BLOCKS])
def test_gpu_dequantisation_equals_the_cpu_engine(dq_check, tmp_path, name):
    """native/cuda/dequant.cuh (element j of a block, as the kernels read it) equals the CPU
    engine's clover_to_f32 bit for bit, on blocks quantised from random floats and on random
    bytes (finite fp16 scales): the index and bit arithmetic of every format, checked without
    a GPU; and so does the integer form the products use (s * q_j + o from qpack/qscale, with
    its alignment claims checked)."""

    rng = np.random.default_rng(3)
    type_ = {**PLAIN, **BLOCKS}[name]
    n = 256 * 16
    q = np.zeros(lib.clover_type_nbytes(type_, n), np.uint8)
    x = (rng.standard_normal(n) * rng.uniform(0.01, 5, n)).astype(np.float32)
    assert lib.clover_from_f32(type_, ffi.cast("float *", x.ctypes.data), ffi.cast("void *", q.ctypes.data), n) == q.size
    raw = rng.integers(0, 256, q.size, dtype=np.uint8)
    for b in range(q.size // BLOCK_BYTES[name]):
        for off in FP16_AT[name]:
            raw[b * BLOCK_BYTES[name] + off: b * BLOCK_BYTES[name] + off + 2] = \
                np.array([rng.uniform(-2, 2)], np.float16).view(np.uint8)
    for blocks in (q, raw):
        want = np.zeros(n, np.float32)
        assert lib.clover_to_f32(type_, ffi.cast("void *", blocks.ctypes.data), ffi.cast("float *", want.ctypes.data),
                                 n) == 0
        (tmp_path / "in").write_bytes(blocks.tobytes())
        for form in ([], ["int"]):
            r = subprocess.run([str(dq_check), str(type_), str(tmp_path / "in"), str(tmp_path / "out"), *form],
                               capture_output=True, text=True)
            assert r.returncode == 0, (form, r.stderr)
            got = np.fromfile(tmp_path / "out", np.float32)
            np.testing.assert_array_equal(got, want, err_msg=str(form))


@gpu
@pytest.mark.parametrize("resident", ["1", "0"])
def test_saved_state_and_rollback_with_the_gdn_state_on_the_gpu(make_gguf, monkeypatch, resident):
    """The GDN state of offloaded layers stays on the GPU between forwards; save_state brings it
    back to the host, restore_state marks the host copy current, checkpoint copies it on the
    device and rollback restores and replays it there. On a context with every
    layer on the GPU: prefill p1, save, prefill p2, restore, then the logits of one token equal
    those of p1 + that token on the CPU; and after a checkpoint, a recorded prefill of 5 tokens
    and a rollback to 2, the next token's logits equal the CPU's for p1 + those 2 + it (one
    token after the state moved: the GDN state decides them, tolerance as for the prefill).
    Both for the resident forward (conv history and the verify record on the device too) and,
    with CLOVER_GPU_RESIDENT=0, the per-product path."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    monkeypatch.setenv("CLOVER_GPU_RESIDENT", resident)
    with Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g, Model(path, n_ctx=512, n_threads=2) as cpu:
        assert g.n_gpu_layers > 0 and lib.clover_model_gpu_resident(g._model) == int(resident)
        p1 = g.tokenize("def fibonacci(n):\n    if n < 2:")
        p2 = g.tokenize("\n        return n\n    return")
        nxt = g.tokenize(" fib")[:1]
        V = g.n_vocab
        err = err_buf()

        def prefill(ids, logits=None):
            out = ffi.NULL if logits is None else ffi.cast("float *", logits.ctypes.data)
            assert lib.clover_prefill(g._ctx, ffi.new("int32_t[]", ids), len(ids), out, 0, err, len(err)) == 0, \
                ffi.string(err)

        def close(got, ids):
            want = cpu.prefix_logits(ids)[-1]
            assert np.max(np.abs(got - want)) <= 2e-3 * float(np.std(want)) + 1e-4, float(np.max(np.abs(got - want)))

        lib.clover_context_reset(g._ctx)
        prefill(p1)
        assert lib.clover_context_save_state(g._ctx, err, len(err)) == 0
        prefill(p2)
        assert lib.clover_context_restore_state(g._ctx, err, len(err)) == len(p1)
        got = np.zeros(V, np.float32)
        prefill(nxt, got)
        close(got, p1 + nxt)

        lib.clover_context_reset(g._ctx)
        prefill(p1)
        ctx = _cffi.cast("void *", int(ffi.cast("uintptr_t", g._ctx)))  # internal API (native/model/model.h)
        assert _clib.clover_context_checkpoint(ctx, 5, err, len(err)) == 0
        prefill(p2[:5])
        assert _clib.clover_context_rollback(ctx, 2, err, len(err)) == 0
        prefill(nxt, got)
        close(got, p1 + p2[:2] + nxt)


@gpu
@pytest.mark.parametrize("resident", ["1", "0"])
def test_state_bytes_move_between_the_gpu_and_the_cpu(make_gguf, monkeypatch, resident):
    """clover_state_get_data / set_data on a model with every layer on the GPU (resident: the KV
    cache and conv history on the device; CLOVER_GPU_RESIDENT=0: the GDN states there): p1 is
    prefilled with clover_context_save_state after its first 5 tokens; its state loaded into a
    CPU context, and the CPU's into the GPU context, gives the next token's logits of p1 + that
    token, and after restore_state those of p1[:5] + it, as the CPU computes them (tolerance as
    for the prefill: the GPU's caches differ in rounding); a loaded state saves to its own bytes."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    monkeypatch.setenv("CLOVER_GPU_RESIDENT", resident)
    with Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g, Model(path, n_ctx=512, n_threads=2) as cpu:
        assert g.n_gpu_layers > 0 and lib.clover_model_gpu_resident(g._model) == int(resident)
        p1 = g.tokenize("def fibonacci(n):\n    if n < 2:")
        nxt = g.tokenize(" fib")[:1]
        other = g.tokenize("class Stack:\n    def push(self, item):")
        err = err_buf()

        def prefill(m, ids, logits=None):
            out = ffi.NULL if logits is None else ffi.cast("float *", logits.ctypes.data)
            assert lib.clover_prefill(m._ctx, ffi.new("int32_t[]", ids), len(ids), out, 0, err, len(err)) == 0, \
                ffi.string(err)

        def get(m):
            buf = bytearray(lib.clover_state_get_size(m._ctx))
            assert lib.clover_state_get_data(m._ctx, ffi.from_buffer("uint8_t[]", buf), len(buf), err, len(err)) == \
                len(buf), ffi.string(err)
            return bytes(buf)

        def state_of(m):
            lib.clover_context_reset(m._ctx)
            prefill(m, p1[:5])
            assert lib.clover_context_save_state(m._ctx, err, len(err)) == 0
            prefill(m, p1[5:])
            return get(m)

        def next_logits(m, ids):
            got = np.zeros(m.n_vocab, np.float32)
            prefill(m, nxt, got)
            want = cpu.prefix_logits(ids + nxt)[-1]
            assert np.max(np.abs(got - want)) <= 2e-3 * float(np.std(want)) + 1e-4, float(np.max(np.abs(got - want)))

        def load(m, state):
            assert lib.clover_state_set_data(m._ctx, ffi.from_buffer("uint8_t[]", state), len(state), err,
                                             len(err)) == len(state), ffi.string(err)

        for src, dst in ((g, cpu), (cpu, g)):
            state = state_of(src)
            lib.clover_context_reset(dst._ctx)
            prefill(dst, other)  # rows that the state must replace
            load(dst, state)
            assert get(dst) == state  # through the device and back, bit for bit
            next_logits(dst, p1)
            load(dst, state)  # (next_logits' prefix_logits reset the CPU context)
            assert lib.clover_context_restore_state(dst._ctx, err, len(err)) == 5
            next_logits(dst, p1[:5])


@gpu
@pytest.mark.parametrize("resident", ["1", "0"])
def test_non_finite_values_on_the_gpu_name_the_layer(nan_model, monkeypatch, resident):
    """A NaN in blk.2's post-attention norm (conftest's nan_model) on a model with every layer on
    the GPU: the prefill fails with CLOVER_E_NUMERIC naming layer 2's MoE, as on the CPU (the
    resident forward flags non-finite layer outputs on the device and reads the flags once per
    forward), in a prefill (twice: the context stays usable) and a block forward."""
    from clover_gguf import Model
    from clover_gguf._ffi import CloverError

    monkeypatch.setenv("CLOVER_GPU_RESIDENT", resident)
    with Model(str(nan_model), n_ctx=128, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == int(resident)
        ids = g.tokenize("def f(x):")
        for _ in range(2):
            with pytest.raises(CloverError, match=r"non-finite value.* after layer 2 \(blk\.2\) moe"):
                g.generate_tokens(ids, max_tokens=2, mode="ar")
        lib.clover_context_reset(g._ctx)
        logits, err = np.zeros((len(ids), g.n_vocab), np.float32), err_buf()
        rc = lib.clover_block_forward(g._ctx, ffi.new("int32_t[]", ids), len(ids), 0.9,
                                      ffi.cast("float *", logits.ctypes.data), ffi.NULL, err, len(err))
        assert rc == lib.CLOVER_E_NUMERIC and "after layer 2 (blk.2) moe" in ffi.string(err).decode(), ffi.string(err)


@gpu
def test_greedy_selection_on_the_gpu_applies_the_samplers_edits(make_gguf):
    """Every mode at temperature 0 on a resident model selects on the GPU
    (clover_block_forward_select, clover_prefill_select: the sampler's spec 5.4 edits of each
    needed row go up, an id and a confidence come back; spec's draft only when its edits cannot
    depend on the drafted tokens or only through penalties that lower logits, so with these
    negative penalties it selects on the CPU): with logit_bias,
    with penalties (negative, so that they change this random model's output) and with the
    end-token ramp, the tokens equal the CPU's, and each setting changes them from the plain run
    (so the edits are exercised)."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == 1
        ids = cpu.tokenize("def fibonacci(n):\n    if n < 2:\n        return n\n")
        for mode in ("diffusion", "ar", "spec"):
            plain = cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[])[0]
            for kw in (dict(logit_bias={plain[2]: -40.0, plain[5]: -40.0, 100: 9.0}, end_ids=[]),
                       dict(repeat_penalty=0.5, presence_penalty=-8.0, frequency_penalty=-1.0, end_ids=[]),
                       dict(end_ids=[plain[6]], eos_bias_start=1, bias_slope=4.0, bias_max=20.0)):
                want, st = cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, **kw)
                assert want != plain, (mode, kw)
                got, st_g = g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, **kw)
                assert got == want, (mode, kw)
                # spec: the drafts (which decide acceptance, not tokens) were the CPU's too
                assert st_g["accept_hist"] == st["accept_hist"], (mode, kw)


def _dev(a: np.ndarray):
    """A device copy of a (freed by the caller with clover_cuda_free)."""
    d = _cffi.new("void **")
    assert _clib.clover_cuda_upload(_cffi.cast("void *", a.ctypes.data), a.nbytes, d, _cffi.NULL, 0) == 0
    return d[0]


def _host(dev, shape, dtype=np.float32) -> np.ndarray:
    """A host copy of the device array dev of that shape and dtype."""
    a = np.zeros(shape, dtype)
    assert _clib.clover_cuda_read(dev, 0, _cffi.cast("void *", a.ctypes.data), a.nbytes, _cffi.NULL, 0) == 0
    return a


@contextlib.contextmanager
def _on_device(*arrays: np.ndarray):
    """Device copies of arrays (a list, to which more may be appended), freed on exit."""
    devs = [_dev(a) for a in arrays]
    try:
        yield devs
    finally:
        for d in devs:
            _clib.clover_cuda_free(d)


@gpu
@pytest.mark.parametrize("V, k", [(300, 1), (300, 7), (5000, 256), (248320, 20)])
def test_top_k_kernel_against_numpy_with_ties_signed_zeros_edits_and_the_mask(V, k):
    """clover_cuda_top_k_d against a numpy sort by (z descending, id ascending) of each edited row
    without the mask: rows of few distinct values (ties everywhere, -0.0 beside +0.0), a row of
    distinct floats, logit_bias edits (ADD) on some rows, and a NaN row, which sets its flag; pre
    holds the value each edit found."""
    rng = np.random.default_rng(V + k)
    rows = [rng.integers(-3, 4, V).astype(np.float32), rng.standard_normal(V).astype(np.float32) * 4,
            np.where(rng.random(V) < 0.5, -0.0, 0.0).astype(np.float32), rng.integers(0, 3, V).astype(np.float32)]
    rows[3][rng.integers(0, V)] = np.nan
    z = np.stack(rows)
    mask = int(np.argmax(rows[0]))
    ops = [(1, int(rng.integers(0, V)), 0, 2.5), (1, int(rng.integers(0, V)), 0, -1.0), (1, mask, 0, 9.0),
           (2, mask, 0, 0.0)]
    start = np.array([0, 2, 2, 4, 4], np.int32)  # rows 0 and 2 get edits, both end by masking
    want_z, want_pre = z.copy(), np.zeros(len(ops), np.float32)
    for r in (0, 2):
        for q in range(start[r], start[r + 1]):
            kind, i, _, v = ops[q]
            want_pre[q] = want_z[r, i]
            want_z[r, i] = -np.inf if kind == 2 else want_z[r, i] + np.float32(v)
    c_ops = _cffi.new("clover_logit_op[]", [dict(kind=o[0], id=o[1], count=o[2], value=o[3]) for o in ops])
    c_ops_host = np.frombuffer(_cffi.buffer(c_ops), np.uint8).copy()
    dz, dops, dstart = _dev(z), _dev(c_ops_host), _dev(start)
    dcand, dbad, dpre = _cffi.new("void **"), _cffi.new("void **"), _cffi.new("void **")
    assert _clib.clover_cuda_alloc(8 * 4 * k, dcand, _cffi.NULL, 0) == 0
    assert _clib.clover_cuda_alloc(4 * 4, dbad, _cffi.NULL, 0) == 0
    assert _clib.clover_cuda_alloc(4 * len(ops), dpre, _cffi.NULL, 0) == 0
    try:
        err = _cffi.new("char[256]")
        assert _clib.clover_cuda_top_k_d(dz, 4, V, dops, dstart, 1.0, 0.0, 0.0, mask, k, dcand[0], dbad[0], dpre[0],
                                         err, 256) == 0, _cffi.string(err)
        np.testing.assert_array_equal(_host(dpre[0], len(ops)), want_pre)  # each edit's input, for the host to redo edits
        cand, bad = _host(dcand[0], 4 * k * 2, np.int32), _host(dbad[0], 4)
        cz, cid = cand.view(np.float32)[0::2].reshape(4, k), cand[1::2].reshape(4, k)
        for r in range(3):
            order = sorted((i for i in range(V) if i != mask), key=lambda i: (-want_z[r, i], i))[:k]
            assert cid[r].tolist() == order, r
            np.testing.assert_array_equal(cz[r], want_z[r, order])
        assert bad[:3].tolist() == [0, 0, 0] and np.isnan(bad[3])
        assert _clib.clover_cuda_top_k_d(dz, 4, V, dops, dstart, 1.0, 0.0, 0.0, mask, 257, dcand[0], dbad[0],
                                         _cffi.NULL, err, 256) == lib.CLOVER_E_ARG
    finally:
        for d in (dz, dops, dstart, dcand[0], dbad[0], dpre[0]):
            _clib.clover_cuda_free(d)


def _call(fn, *args) -> None:
    """fn(*args, err, 256) of a device function, which must return 0."""
    err = _cffi.new("char[256]")
    assert fn(*args, err, 256) == 0, _cffi.string(err).decode()


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (want in float64)."""
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def _silu(x):
    return x / (1.0 + np.exp(-x))


# real: the real model's attention heads (head_dim 256, q heads interleaved with their gates,
# partial RoPE on 64 dimensions, theta 1e7) and GDN (16 key and 32 value heads of 128, conv
# kernel 4, C 8192); small: sizes that are no multiple of 32, contiguous heads
NORM_DIMS = {"real": dict(hd=256, n_head=16, head_stride=512, rd=64, theta=1e7, pos0=5000, Hk=16, Hv=32, dk=128,
                          dv=128, K=4, T=33, n=2048),
             "small": dict(hd=40, n_head=3, head_stride=40, rd=24, theta=1e4, pos0=3, Hk=2, Hv=4, dk=20, dv=24,
                           K=3, T=5, n=100)}


@gpu
@pytest.mark.parametrize("dims", NORM_DIMS.values(), ids=NORM_DIMS.keys())
def test_norm_rope_conv_and_gdn_gate_kernels_equal_float64(dims):
    """The element-wise kernels of the resident forward, each against float64 (the CPU engine's
    formulas in native/cpu/kernels.h and native/model/gdn.c: rmsnorm, rope_neox, conv_silu, qk_norm, gates, gdn_layer's end),
    on random inputs, weights and gates; bound: max |diff| <= 2e-6 x max |ref|
    for every kernel (float32 arithmetic; the angles of RoPE in double as on the CPU; seen under
    the emulator: up to 1.4e-7):
    - clover_cuda_rmsnorm_d: rows picked by an index list, strided input and output rows;
    - clover_cuda_head_norm_rope_d: per-head rmsnorm and NeoX RoPE on the first rope_dim values at
      *pos + t, heads head_stride apart (the gates between the real model's q heads untouched);
    - clover_cuda_conv_d over the K-1 rows of history and the T inputs, without and with the right
      taps of block mode (spec 3.3 step 1: row t + d for d = 1..K-1, zero past the last row), and
      clover_cuda_conv_hist_d (the history after T rows);
    - clover_cuda_gdn_prep_d: q and k heads l2-normed (q times 1/sqrt(dk)), v untouched; beta =
      sigmoid(b), g = ssm_a softplus(a + dt_bias), some a + dt_bias past softplus's cut at 20; with
      b and a NULL (block mode) the same norms and no gates; one of them NULL is refused;
    - clover_cuda_gdn_out_d: per-head rmsnorm times silu(z)."""
    d = dims
    rng = np.random.default_rng(d["hd"] + d["T"])

    def f32(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    T, eps = d["T"], 1e-6

    # rmsnorm: rows idx of x (stride n + 8) into y (stride n + 4)
    n = d["n"]
    x, w = f32(T, n + 8, s=3.0), f32(n, s=0.5) + 1.0
    idx = rng.permutation(T)[: T - 2].astype(np.int32)
    y = np.zeros((len(idx), n + 4), np.float32)
    xs = x[idx, :n].astype(np.float64)
    want = xs / np.sqrt(np.mean(xs * xs, axis=1, keepdims=True) + eps) * w
    with _on_device(x, idx, w, y) as devs:
        _call(_clib.clover_cuda_rmsnorm_d, devs[0], n + 8, devs[1], devs[2], n, len(idx), eps, devs[3], n + 4)
        assert _rel(_host(devs[3], y.shape)[:, :n], want) <= 2e-6

    # head norm + RoPE
    hd, nh, hs, rd, theta = d["hd"], d["n_head"], d["head_stride"], d["rd"], d["theta"]
    x = f32(T, nh * hs, s=2.0)
    w = f32(hd, s=0.3) + 1.0
    pos = np.array([d["pos0"]], np.int64)
    want = x.astype(np.float64).copy()
    for t in range(T):
        for h in range(nh):
            v = want[t, h * hs:h * hs + hd]
            v[:] = v / np.sqrt(np.mean(v * v) + eps) * w
            j = np.arange(rd // 2)
            ang = (d["pos0"] + t) * np.power(float(theta), -2.0 * j / rd)
            a, b = v[:rd // 2].copy(), v[rd // 2:rd].copy()
            v[:rd // 2], v[rd // 2:rd] = a * np.cos(ang) - b * np.sin(ang), b * np.cos(ang) + a * np.sin(ang)
    with _on_device(x, w, pos) as devs:
        _call(_clib.clover_cuda_head_norm_rope_d, devs[0], T, nh, nh * hs, hs, devs[1], hd, eps, devs[2], rd,
              theta)
        assert _rel(_host(devs[0], x.shape), want) <= 2e-6

    # conv: over the history, then with the right taps; the new history
    Hk, Hv, dk, dvv, K = d["Hk"], d["Hv"], d["dk"], d["dv"], d["K"]
    C = 2 * Hk * dk + Hv * dvv
    cin, cw, cr, hist = f32(T, C), f32(C, K, s=0.5), f32(C, K - 1, s=0.5), f32(K - 1, C)
    ext = np.concatenate([hist, cin]).astype(np.float64)  # K-1 history rows, then the inputs
    left = sum(cw[:, j].astype(np.float64) * ext[j:j + T] for j in range(K))
    pad = np.concatenate([cin.astype(np.float64), np.zeros((K - 1, C))])  # zero past the last row
    right = sum(cr[:, dd - 1].astype(np.float64) * pad[dd:dd + T] for dd in range(1, K))
    out = np.zeros((T, C), np.float32)
    with _on_device(cw, hist, cin, out, cr) as devs:
        _call(_clib.clover_cuda_conv_d, devs[0], _cffi.NULL, devs[1], devs[2], T, C, K, devs[3])
        assert _rel(_host(devs[3], out.shape), _silu(left)) <= 2e-6
        _call(_clib.clover_cuda_conv_d, devs[0], devs[4], devs[1], devs[2], T, C, K, devs[3])
        assert _rel(_host(devs[3], out.shape), _silu(left + right)) <= 2e-6
        _call(_clib.clover_cuda_conv_hist_d, devs[1], devs[2], T, C, K)
        np.testing.assert_array_equal(_host(devs[1], hist.shape), ext[-(K - 1):].astype(np.float32))
        short = cin[:1]  # one row: the history keeps K-2 of its rows
        devs.append(_dev(short))
        _call(_clib.clover_cuda_conv_hist_d, devs[1], devs[-1], 1, C, K)
        np.testing.assert_array_equal(_host(devs[1], hist.shape), np.concatenate([ext, short])[-(K - 1):])

    # GDN prep: qk norm and gates
    conv = f32(T, C)
    b, a = f32(T, Hv, s=3.0), f32(T, Hv, s=8.0)
    a[0, :] = 30.0  # a + dt_bias past 20: softplus(x) = x
    ssm_a, dt_bias = -np.exp(f32(Hv, s=0.5)), f32(Hv)
    want = conv.astype(np.float64).copy()
    for t in range(T):
        for h in range(2 * Hk):
            v = want[t, h * dk:(h + 1) * dk]
            v[:] = v / np.sqrt(np.sum(v * v) + eps) * (1 / np.sqrt(dk) if h < Hk else 1.0)
    xa = a.astype(np.float64) + dt_bias
    want_b = 1 / (1 + np.exp(-b.astype(np.float64)))
    want_g = ssm_a * np.where(xa > 20, xa, np.log1p(np.exp(np.minimum(xa, 20))))
    with _on_device(conv, b, a, ssm_a, dt_bias, conv) as devs:
        _call(_clib.clover_cuda_gdn_prep_d, devs[0], T, C, Hk, dk, eps, devs[1], devs[2], devs[3], devs[4], Hv)
        got = _host(devs[0], conv.shape)
        assert _rel(got, want) <= 2e-6
        np.testing.assert_array_equal(got[:, 2 * Hk * dk:], conv[:, 2 * Hk * dk:])  # v untouched
        assert _rel(_host(devs[1], b.shape), want_b) <= 2e-6 and _rel(_host(devs[2], a.shape), want_g) <= 2e-6
        # block mode: no gates (b, a NULL; ssm_a and dt_bias unused)
        _call(_clib.clover_cuda_gdn_prep_d, devs[5], T, C, Hk, dk, eps, _cffi.NULL, _cffi.NULL, _cffi.NULL,
              _cffi.NULL, Hv)
        np.testing.assert_array_equal(_host(devs[5], conv.shape), got)
        err = _cffi.new("char[256]")
        assert _clib.clover_cuda_gdn_prep_d(devs[5], T, C, Hk, dk, eps, devs[1], _cffi.NULL, devs[3], devs[4], Hv, err,
                                            256) == lib.CLOVER_E_ARG
        assert "both or neither" in _cffi.string(err).decode()

    # GDN out: rmsnorm with w, times silu(z)
    o, z = f32(T, Hv, dvv), f32(T, Hv, dvv, s=2.0)
    w = f32(dvv, s=0.3) + 1.0
    oo = o.astype(np.float64)
    want = oo / np.sqrt(np.mean(oo * oo, axis=2, keepdims=True) + eps) * w * _silu(z.astype(np.float64))
    with _on_device(o, z, w) as devs:
        _call(_clib.clover_cuda_gdn_out_d, devs[0], devs[1], devs[2], T, Hv, dvv, eps)
        assert _rel(_host(devs[0], o.shape), want) <= 2e-6


def _route_reference(p: np.ndarray, k: int, top_p: float) -> tuple[list, int]:
    """model/moe.c's routing on the probabilities p [T][E]: each row's top-k (ties to the lower id)
    among the coreset's experts (spec 5.6: experts by their summed top-k mass over the rows,
    largest first, ties to the lower id, the fewest whose share reaches top_p, at least k;
    top_p 0: every expert); returns the rows' picks and the experts with mass (coreset only)."""
    T, E = p.shape
    topk = lambda row, allowed: sorted(allowed, key=lambda e: (-row[e], e))[:k]  # noqa: E731
    allowed, n_full = list(range(E)), 0
    if top_p > 0:
        S = np.zeros(E)
        for t in range(T):
            for e in topk(p[t], range(E)):
                S[e] += float(p[t, e])
        tot = S.sum()
        S = S / tot
        n_full = int(np.sum(S > 0))
        order = sorted(range(E), key=lambda e: (-S[e], e))
        m, cum = E, 0.0
        for i, e in enumerate(order):
            cum += S[e]
            if cum >= top_p:
                m = i + 1
                break
        allowed = sorted(order[:max(m, k)])
    return [topk(p[t], allowed) for t in range(T)], n_full


ROUTE_CASES = {"block_coreset": (32, 256, 8, 0.9, "normal"), "block_no_coreset": (32, 256, 8, 0.0, "normal"),
               "decode": (1, 256, 8, 0.0, "normal"), "ties_coreset": (32, 256, 8, 0.5, "ties"),
               "e1000": (5, 1000, 10, 0.7, "normal")}


@gpu
@pytest.mark.parametrize("T, E, k, top_p, kind", ROUTE_CASES.values(), ids=ROUTE_CASES.keys())
def test_routing_kernel_equals_the_cpus_top_k_and_coreset(T, E, k, top_p, kind):
    """clover_cuda_route_d against model/moe.c's routing redone in Python: the softmax within 1e-6 x
    the largest probability of float64's; on the kernel's own probabilities (so float order
    cannot move a pick) the exact experts of each row (top-k, coreset of spec 5.6 at top_p,
    ties to the lower id: the "ties" case has router logits of 4 distinct values, so most
    probabilities and coreset masses tie), their weights p / sum(p) of the picks (float64, then
    float32), the pairs bucketed by expert with rows ascending, each row's pair indices
    ascending, the product tiles of 8 pairs, and the count of experts used and (coreset) with
    mass. The real model: E 256, k 8; E 1000 is near the kernel's limit of 1024."""
    rng = np.random.default_rng(T * E + k)
    logits = (rng.integers(0, 4, (T, E)).astype(np.float32) if kind == "ties"
              else (rng.standard_normal((T, E)) * 2).astype(np.float32))
    P = T * k
    n_tiles = P // 8 + 1 + min(E, P)
    bufs = dict(sel=np.zeros(P, np.int32), wsel=np.zeros(P, np.float32), prow=np.zeros(P, np.int32),
                pw=np.zeros(P, np.float32), pair=np.zeros(P, np.int32), tiles=np.full(3 * n_tiles, -7, np.int32),
                stats=np.full(2, -1, np.int32))
    arrays = dict(probs=logits, **bufs)
    with _on_device(*arrays.values()) as devs:
        _call(_clib.clover_cuda_route_d, devs[0], T, E, k, top_p, *devs[1:])
        got = {name: _host(d, a.shape, a.dtype) for d, (name, a) in zip(devs, arrays.items())}
    lg = logits.astype(np.float64)
    soft = np.exp(lg - lg.max(axis=1, keepdims=True))
    soft /= soft.sum(axis=1, keepdims=True)
    p = got["probs"]
    assert np.max(np.abs(p - soft)) <= 1e-6 * soft.max()
    picks, n_full = _route_reference(p, k, float(np.float32(top_p)))
    weights = [[np.float32(float(p[t, e]) / sum(float(p[t, u]) for u in picks[t])) for e in picks[t]]
               for t in range(T)]
    pairs = sorted((e, t, s) for t in range(T) for s, e in enumerate(picks[t]))  # by expert, rows ascending
    assert got["prow"].tolist() == [t for _, t, _ in pairs]
    assert got["pw"].tolist() == [weights[t][s] for _, t, s in pairs]
    at = {(t, s): q for q, (_, t, s) in enumerate(pairs)}
    assert got["pair"].reshape(T, k).tolist() == [sorted(at[t, s] for s in range(k)) for t in range(T)]
    tiles, experts = [], sorted({e for e, _, _ in pairs})
    for e in experts:
        q = [i for i, (pe, _, _) in enumerate(pairs) if pe == e]
        tiles += [(e, q[0] + i, min(8, len(q) - i)) for i in range(0, len(q), 8)]
    tiles += [(0, 0, 0)] * (n_tiles - len(tiles))
    assert [tuple(r) for r in got["tiles"].reshape(n_tiles, 3).tolist()] == tiles
    assert got["stats"][0] == len(experts)
    if top_p > 0:
        assert got["stats"][1] == n_full and len(experts) < n_full  # the coreset dropped some
    if kind == "ties":
        assert len({float(v) for v in p[0]}) == 4  # the ties are there


@gpu
def test_moe_combine_kernel_equals_float64_and_flags_non_finite_results():
    """clover_cuda_moe_combine_d: x[t] += sum of pw[q] yg[q] over row t's pairs q + sigmoid(sg[t])
    ys[t], at the real model's H 2048 and k 8 for 5 rows (pairs in a random order of the
    buckets), within 1e-6 x max |ref| of float64, and the flag stays 0; an infinite expert output
    sets it."""
    rng = np.random.default_rng(11)
    T, H, k = 5, 2048, 8
    x, ys = rng.standard_normal((T, H)).astype(np.float32), rng.standard_normal((T, H)).astype(np.float32)
    yg = rng.standard_normal((T * k, H)).astype(np.float32)
    pw, sg = rng.random(T * k).astype(np.float32), rng.standard_normal(T).astype(np.float32)
    pair = rng.permutation(T * k).astype(np.int32).reshape(T, k)
    want = x.astype(np.float64) + 1 / (1 + np.exp(-sg.astype(np.float64)))[:, None] * ys
    for t in range(T):
        want[t] += sum(float(pw[q]) * yg[q].astype(np.float64) for q in pair[t])
    for inf in (False, True):
        if inf:
            yg[pair[2, 3], 7] = np.inf
        bad = np.zeros(1, np.int32)
        with _on_device(x, yg, pw, pair, ys, sg, bad) as devs:
            _call(_clib.clover_cuda_moe_combine_d, devs[0], devs[1], devs[2], devs[3], k, devs[4], devs[5], T, H,
                  devs[6])
            got, flag = _host(devs[0], x.shape), int(_host(devs[6], (1,), np.int32)[0])
        assert flag == int(inf)
        if not inf:
            assert _rel(got, want) <= 1e-6


@gpu
@pytest.mark.parametrize("V", [300, 248320])
def test_greedy_and_row_total_kernels_against_numpy(V):
    """clover_cuda_greedy_d against the CPU sampler's greedy rule redone in numpy: per row the
    edits (repetition, frequency and presence penalties as native/decode/sampler.c applies them in
    float32, a logit_bias, a mask), then the argmax, lowest id on ties and never the mask token,
    exact; its confidence 1 / sum of exp(z - max) over the other ids within 1e-6 relative. Rows:
    few distinct values (ties everywhere), distinct floats, edited. clover_cuda_row_total_d (top-p
    alone's row weight at temperature 0.7, from a row's maximum) within 1e-9 relative of float64.
    V 248320 is the real vocabulary."""
    rng = np.random.default_rng(V)
    z = np.stack([rng.integers(-3, 4, V).astype(np.float32), (rng.standard_normal(V) * 4).astype(np.float32),
                  (rng.standard_normal(V) * 4).astype(np.float32)])
    mask = int(np.argmax(z[0]))  # the mask token holds the first row's largest value
    top2 = np.argsort(-z[2], kind="stable")[:2]
    ops = [(0, int(top2[0]), 3, 0.0), (0, int(top2[1]), 0, 0.0), (1, int(rng.integers(0, V)), 0, 1.5),
           (2, int(top2[1]), 0, 0.0)]
    start = np.array([0, 0, 0, 4], np.int32)  # the edits are row 2's
    rep, freq, pres = 1.3, 0.4, 0.25
    want = z.copy()
    for kind, i, count, value in ops:
        v = want[2, i]
        if kind == 0:
            v = np.float32(v / np.float32(rep)) if v > 0 else np.float32(v * np.float32(rep))
            if count > 0:
                v = np.float32(v - np.float32(np.float32(np.float32(count) * np.float32(freq)) + np.float32(pres)))
        want[2, i] = v + np.float32(value) if kind == 1 else (-np.inf if kind == 2 else v)
    c_ops = _cffi.new("clover_logit_op[]", [dict(kind=o[0], id=o[1], count=o[2], value=o[3]) for o in ops])
    with _on_device(z, np.frombuffer(_cffi.buffer(c_ops), np.uint8).copy(), start, np.zeros(3, np.int32),
                    np.zeros(3, np.float32)) as devs:
        _call(_clib.clover_cuda_greedy_d, devs[0], 3, V, devs[1], devs[2], rep, freq, pres, mask, devs[3], devs[4])
        ids, conf, edited = _host(devs[3], (3,), np.int32), _host(devs[4], (3,)), _host(devs[0], z.shape)
    np.testing.assert_array_equal(edited, want)
    for r in range(3):
        others = np.delete(want[r], mask).astype(np.float64)
        best = max((i for i in range(V) if i != mask), key=lambda i: (want[r, i], -i))
        assert ids[r] == best, r
        assert abs(conf[r] - 1 / np.sum(np.exp(others - others.max()))) <= 1e-6 * conf[r], r
    # row_total from each row's maximum (as clover_cuda_top_k_d's first candidate gives it)
    cand = np.zeros((3, 2), np.int32)
    cand[:, 0] = np.array([np.max(np.delete(want[r], mask)) for r in range(3)], np.float32).view(np.int32)
    with _on_device(want, cand, np.zeros(3, np.float64)) as devs:
        _call(_clib.clover_cuda_row_total_d, devs[0], 3, V, mask, devs[1], 1, 0.7, devs[2])
        total = _host(devs[2], (3,), np.float64)
    for r in range(3):
        d = (np.delete(want[r], mask) - cand[r, 0:1].view(np.float32)).astype(np.float32).astype(np.float64)
        ref = np.sum(np.exp(d / np.float64(np.float32(0.7))).astype(np.float32).astype(np.float64))
        assert abs(total[r] - ref) <= 1e-9 * ref, r


@gpu
@pytest.mark.parametrize("kv_f16", [0, 1, 2, 3])
def test_kv_store_gather_swiglu_add_and_copy_kernels(kv_f16):
    """The resident forward's data-movement kernels: clover_cuda_kv_store_d writes rows *pos ..
    *pos + T - 1 of the caches (fp16 where kv_f16 says, rounded to nearest even as numpy's
    float16), leaves the others and skips rows past n_ctx; clover_cuda_gather_d, _swiglu_d
    (within 1e-6 relative of float64), _add_d (exact; its flag set only by a non-finite sum) and
    _copy_d. The real model's K and V rows: 2 KV heads of 256."""
    rng = np.random.default_rng(kv_f16)
    n_ctx, kvd, T = 12, 512, 5
    kn, vn = rng.standard_normal((T, kvd)).astype(np.float32), rng.standard_normal((T, kvd)).astype(np.float32)
    for pos0 in (3, 9):  # 9: the last two rows fall past n_ctx
        caches = [np.full((n_ctx, kvd), 7.0, np.float16 if kv_f16 & bit else np.float32) for bit in (1, 2)]
        with _on_device(*caches, np.array([pos0], np.int64), kn, vn) as devs:
            _call(_clib.clover_cuda_kv_store_d, devs[0], devs[1], kv_f16, n_ctx, kvd, devs[2], devs[3], devs[4], T)
            got = [_host(devs[i], c.shape, c.dtype) for i, c in enumerate(caches)]
        for c, g, new in zip(caches, got, (kn, vn)):
            want = c.copy()
            n = min(T, n_ctx - pos0)
            want[pos0:pos0 + n] = new[:n].astype(c.dtype)
            np.testing.assert_array_equal(g, want)
    x = rng.standard_normal((T, kvd)).astype(np.float32)
    rows = np.array([4, 0, 4, 2], np.int32)
    g, u = rng.standard_normal(3000).astype(np.float32) * 4, rng.standard_normal(3000).astype(np.float32)
    a, o = g.copy(), u.copy()
    o[17] = np.inf
    with _on_device(x, rows, np.zeros((len(rows), kvd), np.float32), g, u, a, o, np.zeros(1, np.int32),
                    np.zeros(3000, np.float32)) as devs:
        _call(_clib.clover_cuda_gather_d, devs[0], devs[1], len(rows), kvd, devs[2])
        np.testing.assert_array_equal(_host(devs[2], (len(rows), kvd)), x[rows])
        _call(_clib.clover_cuda_swiglu_d, devs[3], devs[4], 3000)
        want = _silu(g.astype(np.float64)) * u
        assert _rel(_host(devs[3], g.shape), want) <= 1e-6
        _call(_clib.clover_cuda_add_d, devs[5], devs[4], 3000, devs[7])
        np.testing.assert_array_equal(_host(devs[5], a.shape), a + u)
        assert _host(devs[7], (1,), np.int32)[0] == 0
        _call(_clib.clover_cuda_add_d, devs[5], devs[6], 3000, devs[7])
        assert _host(devs[7], (1,), np.int32)[0] == 1
        _call(_clib.clover_cuda_copy_d, devs[8], devs[4], 3000)
        np.testing.assert_array_equal(_host(devs[8], u.shape), u)


@gpu
def test_sampling_with_top_k_selects_on_the_gpu_and_draws_as_the_cpu(make_gguf):
    """Above temperature 0 with a top_k that cuts (<= 256), a resident model selects each needed
    row's top-k candidates on the GPU (clover_cuda_top_k_d: edits, then a radix select) and the
    host draws from them (clover_sample_top) in the CPU's order, so every mode's tokens equal the
    CPU's seed for seed: top_k alone, with top_p / min_p / logit_bias, and with penalties (spec's
    drafts then sample on the CPU); the kernel test covers the cap of 256 candidates. The seed
    changes the output, so these are draws, not the argmax."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == 1
        ids = cpu.tokenize("def fibonacci(n):\n    if n < 2:\n")
        for mode in ("diffusion", "ar", "spec"):
            outs = set()
            for kw in (dict(temperature=1.0, top_k=20, seed=1),
                       dict(temperature=1.0, top_k=20, seed=2),
                       dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, logit_bias={100: 3.0}, seed=3),
                       dict(temperature=1.3, top_k=12, repeat_penalty=0.7, presence_penalty=-2.0, seed=4)):
                want, st = cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[], **kw)
                got, st_g = g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[], **kw)
                assert got == want, (mode, kw)
                assert st_g["accept_hist"] == st["accept_hist"], (mode, kw)
                outs.add(tuple(want))
            assert len(outs) == 4, mode  # each seed gave other tokens


@gpu
def test_sampling_with_top_p_alone_selects_on_the_gpu_and_draws_as_the_cpu(make_gguf):
    """Top-p without top-k above temperature 0 (2048 ids): the GPU hands back each needed row's
    best 256 candidates and its weight (clover_cuda_row_total_d); a row whose top-p prefix ends
    within them is drawn from them (clover_sample_top with that weight, the CPU's own path for
    such a row), the others come back whole (the CPU sampler takes them). Every mode's tokens and
    spec's accept histogram equal the CPU's seed for seed. A low temperature keeps the rows on
    the GPU, a high one with top_p 0.99 sends some back whole: both occur, counted by
    clover_context_full_rows; with min_p, logit_bias and penalties too."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == 1
        ids = cpu.tokenize("def fibonacci(n):\n    if n < 2:\n")
        for mode in ("diffusion", "ar", "spec"):
            full = []
            for kw in (dict(temperature=0.3, top_p=0.9, seed=1),
                       dict(temperature=2.0, top_p=0.99, seed=2),
                       dict(temperature=0.7, top_p=0.95, min_p=0.05, logit_bias={100: 3.0}, presence_penalty=0.5,
                            seed=3)):
                before = _clib.clover_context_full_rows(g._ctx)
                want, st = cpu.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[], **kw)
                got, st_g = g.generate_tokens(ids, max_tokens=GEN_TOKENS, mode=mode, end_ids=[], **kw)
                assert got == want, (mode, kw)
                assert st_g["accept_hist"] == st["accept_hist"], (mode, kw)
                full.append(_clib.clover_context_full_rows(g._ctx) - before)
            assert full[0] == 0 and full[1] > 0, (mode, full)


@gpu
def test_top_p_alone_with_blocks_over_32_rows_samples_on_the_cpu(make_gguf):
    """Top-p alone reads rows back from the LM head's one group of 32, so a 40-token block
    (block_size 40) takes the host path instead (native/decode/decode.c: the needed logits rows come
    back and the CPU samples): diffusion's and spec's tokens equal the CPU's seed for seed, and no
    row went through the GPU's top-p selection (clover_context_full_rows stays 0)."""
    from clover_gguf import Model

    path = make_gguf("f32", block_size=40)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == 1
        ids = cpu.tokenize("def fibonacci(n):\n")
        for mode in ("diffusion", "spec"):
            kw = dict(temperature=2.0, top_p=0.99, seed=4)
            want = cpu.generate_tokens(ids, max_tokens=12, mode=mode, end_ids=[], **kw)[0]
            assert g.generate_tokens(ids, max_tokens=12, mode=mode, end_ids=[], **kw)[0] == want, mode
        assert _clib.clover_context_full_rows(g._ctx) == 0


@gpu
def test_spec_greedy_draft_with_penalties_selects_on_the_gpu(make_gguf):
    """spec at temperature 0 with penalties that only lower logits (presence, frequency >= 0,
    repetition >= 1: the defaults of a Clover GGUF) drafts on the GPU: each row's candidates under
    the history's edits come back and the host redoes the drafted tokens' logits (draft_pick). Six
    logit_bias ids 30 apart with presence 100 and frequency 40 (ten times the random model's
    logits' spread, so the edits decide, not the model's rows) make greedy decoding cycle through
    them, so a draft is accepted only if it counted its own drafted tokens: the CPU accepts long
    runs, and the GPU's tokens and accept histogram equal the CPU's."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert lib.clover_model_gpu_resident(g._model) == 1
        ids = cpu.tokenize("def fibonacci(n):")
        kw = dict(max_tokens=GEN_TOKENS, mode="spec", end_ids=[], presence_penalty=100.0, frequency_penalty=40.0,
                  repeat_penalty=1.1, logit_bias={100 + 7 * i: 600.0 - 30.0 * i for i in range(6)})
        want, st = cpu.generate_tokens(ids, **kw)
        assert set(want) == {100 + 7 * i for i in range(6)}
        hist = st["accept_hist"]
        assert sum(a * n for a, n in enumerate(hist)) >= GEN_TOKENS // 2, hist  # most drafted tokens accepted
        got, st_g = g.generate_tokens(ids, **kw)
        assert got == want and st_g["accept_hist"] == hist


@gpu
def test_spec_sampled_draft_with_penalties_selects_on_the_gpu(make_gguf):
    """spec above temperature 0 with a top_k and penalties that only lower logits drafts on the
    GPU too: each row's best top_k + B - 1 candidates under the history's edits come back, the
    host redoes the drafted tokens' logits, re-ranks, and draws from the first top_k
    (draft_pick). The six biased ids of the greedy test, presence 10 and frequency 4, top_k 4,
    temperature 1: the draws depend on the drafted tokens' penalties. Tokens and accept histogram
    equal the CPU's for two seeds, which give different outputs."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    with Model(path, n_ctx=512, n_threads=2) as cpu, Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        ids = cpu.tokenize("def fibonacci(n):")
        outs = set()
        for seed in (1, 2):
            kw = dict(max_tokens=GEN_TOKENS, mode="spec", end_ids=[], temperature=1.0, top_k=4, seed=seed,
                      presence_penalty=10.0, frequency_penalty=4.0, repeat_penalty=1.1,
                      logit_bias={100 + 7 * i: 60.0 - 3.0 * i for i in range(6)})
            want, st = cpu.generate_tokens(ids, **kw)
            got, st_g = g.generate_tokens(ids, **kw)
            assert got == want and st_g["accept_hist"] == st["accept_hist"], seed
            outs.add(tuple(want))
        assert len(outs) == 2


@gpu
def test_ar_decode_steps_replay_a_cuda_graph(make_gguf, monkeypatch):
    """ar's decode steps on a resident model run through a CUDA graph (gpu/forward_resident.c res_layer_loop_graph): the
    first step runs plainly, the second records the graph and runs it, the rest replay it with the
    position, token and edits in device memory. Greedy with penalties, sampled top-k and top-p
    alone (two temperatures: a graph each) tokens equal the CPU's, the graph ran at every step but
    the first, and CLOVER_CUDA_GRAPHS=0, or a
    second context that has used the GPU alive in the process (graphs record the one stream all
    contexts launch on), gives the same tokens with no replay; a second context on the CPU alone
    does not stop them, nor does one on the GPU once freed. Under the emulator a capture also fails on any copy or
    allocation, as on a GPU."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    n = 2 * GEN_TOKENS
    runs = (dict(presence_penalty=0.5, repeat_penalty=1.2, logit_bias={100: 2.0}),
            dict(temperature=1.0, top_k=16, seed=3),
            dict(temperature=0.3, top_p=0.9, seed=5),  # top-p alone: the temperature is in the graph
            dict(temperature=2.0, top_p=0.99, seed=6))
    with Model(path, n_ctx=512, n_threads=2) as cpu:
        ids = cpu.tokenize("def fibonacci(n):")
        want = [cpu.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[], **kw)[0] for kw in runs]
    for graphs in ("1", "0"):
        monkeypatch.setenv("CLOVER_CUDA_GRAPHS", graphs)
        with Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
            assert lib.clover_model_gpu_resident(g._model) == 1
            for kw, w in zip(runs, want):
                before = _clib.clover_context_graph_launches(g._ctx)
                assert g.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[], **kw)[0] == w, (graphs, kw)
                replays = _clib.clover_context_graph_launches(g._ctx) - before
                assert replays == (n - 2 if graphs == "1" else 0), (graphs, kw, replays)  # n - 1 steps, 1 plain
            with Model(path, n_ctx=64, n_threads=2) as other:  # a second context, on the CPU: graphs go on
                other.prefix_logits(ids)
                before = _clib.clover_context_graph_launches(g._ctx)
                assert g.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[], **runs[0])[0] == want[0]
                replays = _clib.clover_context_graph_launches(g._ctx) - before
                assert replays == (n - 1 if graphs == "1" else 0), replays  # recorded before: every step
            with Model(path, n_ctx=64, n_threads=2, n_gpu_layers=-1) as other:  # one on the GPU too: no graphs
                other.prefix_logits(ids)
                before = _clib.clover_context_graph_launches(g._ctx)
                assert g.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[], **runs[0])[0] == want[0]
                assert _clib.clover_context_graph_launches(g._ctx) == before
            before = _clib.clover_context_graph_launches(g._ctx)  # that one freed: graphs again
            assert g.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[], **runs[0])[0] == want[0]
            assert _clib.clover_context_graph_launches(g._ctx) - before == (n - 1 if graphs == "1" else 0)


@gpu
def test_gpu_kernels_bench_runs():
    """bench/gpu_kernels.py (device_check.sh runs it) at small sizes: its declarations match the
    library (a stale one would crash on the device), every case is timed, the attention cases
    cover the F32 and F16 caches, the block pass with and without tensor cores (64 keys: no
    prefill case), and the GDN block operator runs for the rows asked."""
    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "gpu_kernels.py"
    r = subprocess.run([sys.executable, str(script), "--ne0", "256", "--ne1", "64", "--types", "Q4_K,F16",
                        "--rows", "1,32", "--keys", "64", "--gdn-rows", "1,9", "--iters", "1", "--reps", "1", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert [(c["type"], c["T"], c["mma"]) for c in out["cases"]] == [
        ("Q4_K", 1, None), ("Q4_K", 32, True), ("Q4_K", 32, False), ("F16", 1, None), ("F16", 32, True),
        ("F16", 32, False)]
    assert [(c["case"], c["cache"], c["mma"]) for c in out["attention"]] == [
        (case, cache, mma) for cache in ("f32", "f16")
        for case, mma in (("decode", None), ("block32", True), ("block32", False))]
    assert [c["rows"] for c in out["gdn_block"]] == [1, 9]
    assert all(c["us"] > 0 for c in out["cases"] + out["attention"] + out["gdn_block"])


@gpu
def test_one_token_forwards_with_logits_replay_a_cuda_graph(make_gguf, monkeypatch):
    """One-token prefills that return logits (bench's tg, llama.cpp's decode of one token) on a
    resident model run their layers through a CUDA graph, the LM head and the read after it:
    the prompt's prefill (4 tokens) runs plainly, the first one-token step too, the second
    records, the rest replay. Every step's logits are within 2e-3 of the CPU's std (as the
    whole-model test) and within 1e-5 of it of the same steps with CLOVER_CUDA_GRAPHS=0."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    err = ffi.new("char[]", 256)

    def steps(m):
        lib.clover_context_reset(m._ctx)
        V = m.n_vocab
        out = np.zeros((len(ids) - 3, V), np.float32)
        for i, (a, b) in enumerate([(0, 4)] + [(t, t + 1) for t in range(4, len(ids))]):
            toks = ffi.new("int32_t[]", ids[a:b])
            rc = lib.clover_prefill(m._ctx, toks, b - a, ffi.cast("float *", out[i].ctypes.data), 0, err, 256)
            assert rc == 0, ffi.string(err)
        return out

    with Model(path, n_ctx=128, n_threads=2) as cpu:
        ids = cpu.tokenize("def fibonacci(n):\n    if n < 2:\n        return n")[:12]
        want = steps(cpu)
    got = {}
    for graphs in ("1", "0"):
        monkeypatch.setenv("CLOVER_CUDA_GRAPHS", graphs)
        with Model(path, n_ctx=128, n_threads=2, n_gpu_layers=-1) as g:
            assert lib.clover_model_gpu_resident(g._model) == 1
            before = _clib.clover_context_graph_launches(g._ctx)
            got[graphs] = steps(g)
            replays = _clib.clover_context_graph_launches(g._ctx) - before
            assert replays == (len(ids) - 4 - 1 if graphs == "1" else 0), (graphs, replays)
    std = float(np.std(want))
    assert np.max(np.abs(got["1"] - want)) <= 2e-3 * std + 1e-4
    assert np.max(np.abs(got["1"] - got["0"])) <= 1e-5 * std


@gpu
def test_diffusion_and_spec_passes_replay_cuda_graphs(make_gguf):
    """Diffusion's denoising passes (a block pass that selects on every row, only the masked
    slots' rows read), and spec's drafts and verifies (whose GDN inputs are recorded for the
    rollback by copy kernels), and diffusion's commits (prefills without logits when
    shift_logits is off), replay CUDA graphs too, a graph per pass shape kept across blocks (all
    but the first pass of each shape replay): tokens and spec's accept histogram equal the CPU's
    (graphs off: the ar test)."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    kw = dict(max_tokens=2 * GEN_TOKENS, end_ids=[], presence_penalty=0.5, repeat_penalty=1.2)
    with Model(path, n_ctx=512, n_threads=2) as cpu:
        ids = cpu.tokenize("def fibonacci(n):")
        want = {mode: cpu.generate_tokens(ids, mode=mode, **kw) for mode in ("diffusion", "spec")}
    with Model(path, n_ctx=512, n_threads=2, n_gpu_layers=-1) as g:
        assert not g.hparams["shift_logits"]
        for mode, (toks, st) in want.items():
            before = _clib.clover_context_graph_launches(g._ctx)
            got, st_g = g.generate_tokens(ids, mode=mode, **kw)
            assert got == toks and st_g["accept_hist"] == st["accept_hist"], mode
            # every pass but the first of each shape (diffusion: denoise; spec: draft, verify)
            if mode == "diffusion":
                commits = st_g["n_forward_commit"]
                passes, shapes = st_g["n_forward_denoise"] + commits, 1 + (commits > 0)
            else:
                passes, shapes = st_g["n_forward_draft"] + st_g["n_forward_verify"], 2
            replays = _clib.clover_context_graph_launches(g._ctx) - before
            assert replays == passes - shapes, (mode, replays, passes)


@gpu
def test_context_used_on_the_cpu_then_resident(make_gguf):
    """C API order the Python API never takes: a context prefilled on the CPU, then the model
    offloaded whole (resident); the next prefill's logits equal the CPU's for the whole text
    (the host KV rows, GDN state and conv history are brought to the GPU at first use)."""
    from clover_gguf import Model

    path = make_gguf("f32", **GEN_MODEL)
    err = err_buf()
    with Model(path, n_ctx=256, n_threads=2) as cpu:
        p1, p2 = cpu.tokenize("def fibonacci(n):\n    if n < 2:"), cpu.tokenize("\n        return n")
        want = cpu.prefix_logits(p1 + p2)[-1]
    m = lib.clover_model_load(str(path).encode(), err, len(err))
    assert m != ffi.NULL, ffi.string(err)
    c = lib.clover_context_new(m, 256, 2, 0, 0, err, len(err))  # F32 KV cache, as Model's default
    try:
        assert lib.clover_prefill(c, ffi.new("int32_t[]", p1), len(p1), ffi.NULL, 0, err, len(err)) == 0
        assert lib.clover_model_offload(m, 1 << 20, 0, err, len(err)) > 0, ffi.string(err)
        assert lib.clover_model_gpu_resident(m) == 1
        got = np.zeros(len(want), np.float32)
        assert lib.clover_prefill(c, ffi.new("int32_t[]", p2), len(p2), ffi.cast("float *", got.ctypes.data), 0, err,
                                  len(err)) == 0, ffi.string(err)
        assert np.max(np.abs(got - want)) <= 2e-3 * float(np.std(want)) + 1e-4, float(np.max(np.abs(got - want)))
    finally:
        lib.clover_context_free(c)
        lib.clover_model_free(m)
