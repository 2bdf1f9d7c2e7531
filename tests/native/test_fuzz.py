"""Hostile files against the native reader and loader, under AddressSanitizer + UBSan.

The session builds libclover and tests/fuzz/fuzz_gguf.c with ``-DCLOVER_SANITIZE=ON
-DCLOVER_FUZZ=ON`` (about 30 s), then:

- a fixed-seed run of 100,000 mutated inputs (``FUZZ_ITERS``) over valid seed files of both
  architectures and every engine weight type plus a small file with every KV type and
  ``general.alignment``: no crash, hang, leak or message-less error, and every field kind of the
  format was mutated;
- every prefix of the small files and of the embedded model's metadata (truncation at every
  byte);
- the regression corpus tests/fuzz/corpus/ replayed, and each of its files refused by the reader
  with a message;
- a subset of the native-facing tests run again in a child pytest against the sanitised library
  (the ASan runtime preloaded, leak checks off there: the Python interpreter's own allocations
  are not ours to judge).

docs/reliability.md says how to run a longer fuzz campaign.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

import clover_gguf
from clover_gguf._ffi import ERR_SIZE, err_buf, ffi, lib
from conftest import engine_load_error, rewrite_gguf

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORPUS = ROOT / "tests" / "fuzz" / "corpus"
FUZZ_ITERS = int(os.environ.get("CLOVER_FUZZ_ITERS", "100000"))
# corpus files the reader accepts: legal GGUF (a zero-sized tensor), refused later by the loader
ACCEPTED_BY_READER = {"dim_zero.gguf"}
# native-facing tests re-run against the sanitised library (no torch-heavy or slow ones)
SANITISED_TESTS = ["tests/native/test_gguf.py", "tests/native/test_dot.py", "tests/native/test_fuzz.py::test_model_level_validation",
                   "tests/native/test_fuzz.py::test_nonfinite_values_stop_with_the_layer_named",
                   "tests/native/test_sampler.py", "-k", "not penalties_off_reproduce",
                   "tests/native/test_load_layout.py", "tests/native/test_state_bytes.py", "tests/native/test_batch.py",
                   "tests/python/test_misuse.py"]

def _asan_runtime() -> str:
    out = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else ""


@pytest.fixture(scope="session")
def san_build(tmp_path_factory) -> pathlib.Path:
    if shutil.which("cmake") is None or shutil.which("gcc") is None:
        pytest.fail("cmake and gcc are needed to build the sanitised library")
    if os.environ.get("CLOVER_UNDER_ASAN") == "1":
        pytest.skip("already inside the sanitised child run")
    out = tmp_path_factory.mktemp("sanbuild")
    try:
        _bench_fuzz().build(out)
    except subprocess.CalledProcessError as e:
        pytest.fail(f"sanitised build failed: {e.stdout[-3000:]}{e.stderr[-3000:]}")
    assert (out / "fuzz_gguf").exists() and (out / "libclover.so").exists()
    return out


def _bench_fuzz():
    spec = importlib.util.spec_from_file_location("bench_fuzz_gguf", ROOT / "bench" / "fuzz_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def seeds(make_gguf, tmp_path_factory) -> list[pathlib.Path]:
    d = tmp_path_factory.mktemp("fuzzseeds")
    files = [_bench_fuzz().small_kv_file(d / "kv.gguf"), pathlib.Path(clover_gguf.DEFAULT_MODEL),
             make_gguf("q8_0"), make_gguf("f32", arch="qwen35moe", clover=False), make_gguf("q8_0", arch="qwen35moe"),
             make_gguf("bf16", arch="qwen35moe", clover=False)]
    for t in ("q4_k_m", "q6_k", "iq4_xs", "q4_0", "f16"):
        files.append(make_gguf(t))
    return files


_SAN_ENV = dict(ASAN_OPTIONS="detect_leaks=1:abort_on_error=0:allocator_may_return_null=1",
                UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1")


def _report(returncode: int, stdout: str, stderr: str) -> dict:
    assert returncode == 0, f"exit {returncode}\n{stderr[-6000:]}"
    assert "ERROR: AddressSanitizer" not in stderr and "runtime error" not in stderr, stderr[-6000:]
    return json.loads(stdout.strip().splitlines()[-1])


def _run(cmd, **kw) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **_SAN_ENV), **kw)
    return _report(r.returncode, r.stdout, r.stderr)


@pytest.mark.slow
def test_fuzz_fixed_seed_run(san_build, seeds, tmp_path):
    """FUZZ_ITERS mutated inputs in two processes at once (seeds 1 and 2, half each: the harness is
    single-threaded and CI has 2 cores): no finding, every operation and field kind used by each,
    some inputs loading and running forwards."""
    procs = []
    for seed, n in ((1, FUZZ_ITERS // 2), (2, FUZZ_ITERS - FUZZ_ITERS // 2)):
        out = tmp_path / f"seed{seed}"
        out.mkdir()
        cmd = [str(san_build / "fuzz_gguf"), "--iters", str(n), "--seed", str(seed), "--out", str(out), *map(str, seeds)]
        procs.append((n, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                               env=dict(os.environ, **_SAN_ENV))))
    for n, out, p in procs:
        stdout, stderr = p.communicate(timeout=1800)
        rep = _report(p.returncode, stdout, stderr)
        assert rep["inputs"] == n and rep["findings"] == 0
        assert not list(out.glob("crash-*")), "the harness wrote a crash input"
        assert all(v > 0 for v in rep["ops"].values()), rep["ops"]
        assert all(v > 0 for v in rep["fields"].values()), rep["fields"]  # every field kind was mutated
        assert 0 < rep["model_ok"] < rep["inputs"] and rep["forwards"] > 0, rep
        print(json.dumps(rep))


def test_truncation_at_every_byte(san_build, seeds, tmp_path):
    small = [seeds[0], seeds[1]]  # the KV file (every byte) and the embedded model (every metadata byte)
    rep = _run([str(san_build / "fuzz_gguf"), "--truncate-all", "--out", str(tmp_path), *map(str, small)],
               timeout=900)
    assert rep["findings"] == 0 and rep["inputs"] > small[0].stat().st_size
    assert rep["model_ok"] == 0  # a truncated model never loads


def test_regression_corpus_replays_under_sanitisers(san_build, tmp_path):
    files = sorted(CORPUS.glob("*.gguf"))
    assert len(files) >= 40
    rep = _run([str(san_build / "fuzz_gguf"), "--replay", "--out", str(tmp_path), *map(str, files)], timeout=300)
    assert rep["inputs"] == len(files) and rep["findings"] == 0


@pytest.mark.parametrize("path", sorted(CORPUS.glob("*.gguf")), ids=lambda p: p.name)
def test_corpus_file_is_refused_with_a_message(path):
    err = err_buf()
    g = lib.clover_gguf_open(str(path).encode(), err, ERR_SIZE)
    msg = ffi.string(err).decode()
    if path.name.startswith("crash-"):  # a fuzz finding: may be a valid file; must fail cleanly or work
        from clover_gguf import Model
        from clover_gguf._ffi import CloverError
        if g != ffi.NULL:
            lib.clover_gguf_close(g)
        try:
            with Model(str(path), n_ctx=64, n_threads=1) as m:
                m.generate_tokens([0, 1, 2], max_tokens=2, mode="ar")
        except CloverError as e:
            assert str(e), path
        return
    if path.name in ACCEPTED_BY_READER:
        assert g != ffi.NULL
        lib.clover_gguf_close(g)
        m = lib.clover_model_load(str(path).encode(), err, ERR_SIZE)
        assert m == ffi.NULL and ffi.string(err)
        return
    assert g == ffi.NULL and msg.startswith(str(path)) and len(msg) > len(str(path)) + 8, msg


# ---------------------------------------------------------------------------- model level
def test_model_level_validation(make_gguf, tmp_path):
    """Hyperparameters checked against each other, the tensor shapes and limits before any
    allocation; special token ids against the vocabulary; each error names the key."""
    from gguf import GGUFValueType as VT

    src = make_gguf("f32")
    assert engine_load_error(src) == ""
    cases = {
        "clover_moe.block_count": (100000, VT.UINT32, "block_count"),
        "clover_moe.expert_used_count": (9, VT.UINT32, "expert_used_count > expert_count"),
        "clover_moe.expert_count": (0, VT.UINT32, "expert_count"),
        "clover_moe.attention.head_count": (3, VT.UINT32, "head_count"),
        "clover_moe.attention.head_count_kv": (0, VT.UINT32, "head_count_kv"),
        "clover_moe.embedding_length": (None, None, "missing key clover_moe.embedding_length"),
        "tokenizer.ggml.mask_token_id": (10**6, VT.UINT32, "mask_token_id"),
        "diffusion.threshold": (1.5, VT.FLOAT32, "threshold"),
        "diffusion.block_size": (0, VT.UINT32, "block_size"),
        "tokenizer.ggml.eos_token_id": (10**6, VT.UINT32, "tokenizer.ggml.eos_token_id"),
        "tokenizer.ggml.bos_token_id": ("x", VT.STRING, "tokenizer.ggml.bos_token_id"),
        "clover_moe.rope.dimension_count": (1000, VT.UINT32, "rope.dimension_count"),
    }
    for i, (key, (v, t, want)) in enumerate(cases.items()):
        msg = engine_load_error(rewrite_gguf(src, tmp_path / f"m{i}.gguf", {key: (v, t)}))
        assert want in msg, (key, msg)
    # a tensor of the wrong shape is named
    from gguf import GGUFReader
    r = GGUFReader(str(src))
    dims = [int(x) for x in next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight").shape]
    assert dims
    msg = engine_load_error(rewrite_gguf(src, tmp_path / "shape.gguf", tensor_fn=lambda n, a: a[:-1]
                               if n == "blk.0.attn_norm.weight" else a))
    assert "blk.0.attn_norm.weight" in msg and "shape" in msg, msg


def test_context_memory_is_computed_up_front(make_gguf):
    """clover_context_mem_required counts the KV cache and GDN state; a context that cannot fit
    the machine's memory is refused with a message naming n_ctx instead of being allocated."""
    err = err_buf()
    m = lib.clover_model_load(str(make_gguf("f32")).encode(), err, ERR_SIZE)
    assert m != ffi.NULL
    try:
        hp = ffi.new("clover_hparams *")
        lib.clover_model_hparams(m, hp)
        n_attn = sum(1 for i in range(hp.n_layer) if (i + 1) % 4 == 0)
        for type_k, type_v, per_value in [(0, 0, 8), (1, 1, 4), (1, 0, 6), (0, 1, 6)]:  # F32 = 0, F16 = 1
            a = lib.clover_context_mem_required(m, 1000, type_k, type_v)
            b = lib.clover_context_mem_required(m, 2000, type_k, type_v)
            assert b - a == n_attn * 1000 * hp.n_head_kv * hp.head_dim * per_value
        assert lib.clover_context_mem_required(m, 0, 1, 1) == -1
        assert lib.clover_context_mem_required(m, 16, 8, 1) == -1  # Q8_0: not a cache type
        for type_k, type_v, name in [(8, 1, "type_k"), (1, 30, "type_v"), (-1, 0, "type_k")]:
            assert lib.clover_context_new(m, 16, 1, type_k, type_v, err, ERR_SIZE) == ffi.NULL
            assert ffi.string(err).decode().startswith(name + ":"), ffi.string(err)
        c = lib.clover_context_new(m, 2**31 - 1, 1, 1, 1, err, ERR_SIZE)
        if c != ffi.NULL:  # only on a machine with that much memory (TBs)
            lib.clover_context_free(c)
        else:
            msg = ffi.string(err).decode()
            assert "n_ctx" in msg and "GiB" in msg, msg
    finally:
        lib.clover_model_free(m)


def test_nonfinite_values_stop_with_the_layer_named(make_gguf, tmp_path):
    """NaN/Inf in the hidden state or the logits stops the forward with CLOVER_E_NUMERIC naming the
    layer (or the LM head), and generation raises instead of producing text."""
    from clover_gguf import Model
    from clover_gguf._ffi import CloverError

    src = make_gguf("f32")

    def poison(target):
        def fn(name, a):
            if name == target:
                a = a.copy()
                a.reshape(-1)[0] = np.nan
            return a
        return fn

    for target, want in [("blk.1.post_attention_norm.weight", "after layer 1"),
                         ("blk.3.attn_norm.weight", "after layer 3"),
                         ("output.weight", "LM head")]:
        path = rewrite_gguf(src, tmp_path / f"{target}.gguf", tensor_fn=poison(target))
        err = err_buf()
        m = lib.clover_model_load(str(path).encode(), err, ERR_SIZE)
        assert m != ffi.NULL, ffi.string(err)
        c = lib.clover_context_new(m, 32, 1, 1, 1, err, ERR_SIZE)
        hp = ffi.new("clover_hparams *")
        lib.clover_model_hparams(m, hp)
        logits = ffi.new("float[]", hp.n_vocab)
        toks = ffi.new("int32_t[]", [1, 2, 3])
        rc = lib.clover_prefill(c, toks, 3, logits, 0, err, ERR_SIZE)
        msg = ffi.string(err).decode()
        assert rc == lib.CLOVER_E_NUMERIC and want in msg and "non-finite" in msg, (rc, msg)
        lib.clover_context_free(c)
        lib.clover_model_free(m)
        with Model(str(path), n_ctx=64, n_threads=1) as model:
            for mode in ("ar", "diffusion"):
                with pytest.raises(CloverError, match="non-finite"):
                    model.generate_tokens([1, 2, 3], max_tokens=4, mode=mode)


@pytest.mark.slow
def test_native_tests_pass_under_sanitisers(san_build):
    """The native-facing tests again, in a child pytest with the sanitised library."""
    rt = _asan_runtime()
    assert rt, "gcc's libasan.so not found"
    env = dict(os.environ, LD_PRELOAD=rt, CLOVER_LIB=str(san_build / "libclover.so"), CLOVER_UNDER_ASAN="1",
               ASAN_OPTIONS="detect_leaks=0:allocator_may_return_null=1",
               UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:abort_on_error=1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *SANITISED_TESTS],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    tail = r.stdout[-4000:] + r.stderr[-4000:]
    assert r.returncode == 0, tail
    assert "AddressSanitizer" not in r.stderr and "runtime error" not in r.stderr, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail


def test_nonfinite_activations_of_quantised_products_propagate(tmp_path):
    """A NaN entering a Q8_0 / Q8_K-quantised product (the embedded Q8_0 model, a NaN norm weight
    in layer 0) must not vanish in the activation quantiser (a NaN read as 0 would give finite
    garbage text): the block's scale becomes NaN and the guard names layer 0."""
    from clover_gguf import Model
    from clover_gguf._ffi import CloverError

    def fn(name, a):
        if name == "blk.0.attn_norm.weight":
            a = a.copy()
            a.reshape(-1)[0] = np.nan
        return a
    path = rewrite_gguf(pathlib.Path(clover_gguf.DEFAULT_MODEL), tmp_path / "q8nan.gguf", tensor_fn=fn)
    with Model(str(path), n_ctx=64, n_threads=1) as m:
        for mode in ("ar", "diffusion", "spec"):
            with pytest.raises(CloverError, match=r"non-finite value \(nan\) after layer 0"):
                m.generate_tokens(m.tokenize("def f("), max_tokens=4, mode=mode)


def test_nonfinite_values_in_the_cli_and_the_server(nan_model):
    """The CLI exits non-zero with the engine's message (no traceback, no text); the server
    answers 500 with an OpenAI-shaped error naming the layer, and stays up."""
    r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "run", "-m", str(nan_model), "-p", "hello",
                        "-n", "4", "-t", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode not in (0, 2) and "non-finite" in r.stderr and "after layer 2" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and r.stdout.strip() == ""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover_gguf.server import create_app

    app = create_app(str(nan_model), n_ctx=128, n_threads=1)
    with TestClient(app, raise_server_exceptions=False) as client:
        for _ in range(200):
            if client.get("/health").status_code == 200:
                break
            time.sleep(0.05)
        for body in ({"prompt": "hello", "max_tokens": 4}, {"prompt": "hello", "max_tokens": 4, "stream": True}):
            resp = client.post("/v1/completions", json=body)
            text = resp.text
            if body.get("stream"):  # headers went out before the error: it arrives as an SSE error event
                assert '"error"' in text and "non-finite" in text and "[DONE]" not in text.split('"error"')[0]
            else:
                assert resp.status_code == 500, text
                err = resp.json()["error"]
                assert "non-finite" in err["message"] and "after layer 2" in err["message"]
        assert client.get("/health").status_code == 200
