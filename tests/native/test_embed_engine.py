"""clover_embed (model/forward.c): the final hidden state after output_norm of a causal prefill,
pooled NONE / MEAN / LAST, and its argument checks.

Reference: on a Clover (diffusion) file, the engine's own prefix-mode logits: the LM head
(output.weight, in float64 here) applied to the embedding rows must give them (the rows are
the LM head's input). transformers' last_hidden_state: tests/oracles/test_embed_oracle.py.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

from clover_gguf._ffi import err_buf, ffi, lib
from clover_gguf.gguf import GGUFFile
from clover_gguf.model import Model
from conftest import engine_load_error, rewrite_gguf

NONE, MEAN, CLS, LAST, RANK = 0, 1, 2, 3, 4


@pytest.fixture(scope="module")
def path(make_gguf):
    return str(make_gguf("f32"))


@pytest.fixture(scope="module")
def model(path):
    with Model(path, n_ctx=2200, n_threads=2) as m:
        yield m


def _embed(m, toks, pooling, out_size=None):
    """clover_embed's (rc, message, out) for out of out_size floats (None: what the pooling writes)."""
    n_out = (len(toks) if pooling == NONE else 1) * m.n_embd
    out = np.full(max(n_out if out_size is None else out_size, 1), np.nan, np.float32)
    err = err_buf()
    rc = lib.clover_embed(m._ctx, ffi.new("int32_t[]", toks or [0]), len(toks), pooling,
                          ffi.cast("float *", out.ctypes.data), out.size if out_size is None else out_size,
                          err, len(err))
    return rc, ffi.string(err).decode(), out


def _lm_head(path):
    with GGUFFile(path) as g:
        names = {t["name"] for t in g.tensors}
        return g.tensor("output.weight" if "output.weight" in names else "token_embd.weight").astype(np.float64)


def test_lm_head_of_the_rows_is_the_prefix_logits(model, path):
    assert model.arch == "clover_moe" and model.has_block
    toks = np.random.default_rng(3).integers(0, 2000, 45).tolist()
    rows = model.embed(toks, pooling="none")
    logits = model.prefix_logits(toks)
    got = rows.astype(np.float64) @ _lm_head(path).T
    diff = float(np.abs(got - logits).max())
    print(f"\nLM head(embedding rows) vs prefix logits: max abs diff {diff:.2e} (max |logit| {np.abs(logits).max():.1f})")
    assert rows.shape == (45, model.n_embd) and np.isfinite(rows).all()
    assert diff <= 1e-5 * float(np.abs(logits).max())
    assert np.array_equal(model.embed(toks, pooling="last"), rows[-1])
    assert np.allclose(model.embed(toks, pooling="mean"), rows.astype(np.float64).mean(0), rtol=0, atol=1e-6)
    # the C enum values work as the names
    assert np.array_equal(model.embed(toks, pooling=LAST), rows[-1]) and model.embed(toks, pooling=NONE).shape == rows.shape


def test_context_is_reset_before_and_after(model):
    toks = list(range(10, 30))
    model.prefix_logits(list(range(50, 90)))  # leaves 40 tokens cached
    assert lib.clover_context_n_past(model._ctx) == 40
    rc, msg, first = _embed(model, toks, NONE)
    assert rc == 0, msg
    assert lib.clover_context_n_past(model._ctx) == 0
    rc, msg, again = _embed(model, toks, NONE)
    assert rc == 0 and np.array_equal(first, again)


def test_long_input_runs_in_passes(model):
    """Over 2048 tokens the prefill runs in two passes (model/forward.c CPU_ROWS): each pass's rows
    land at their positions (NONE), the mean covers both, LAST is the last row of the second."""
    toks = np.random.default_rng(8).integers(0, 2000, 2100).tolist()
    rows = model.embed(toks, pooling="none")
    logits = model.prefix_logits(toks)
    diff = float(np.abs(rows.astype(np.float64) @ _lm_head(model.path).T - logits).max())
    assert rows.shape == (2100, model.n_embd) and diff <= 1e-5 * float(np.abs(logits).max())
    assert np.array_equal(model.embed(toks, pooling="last"), rows[-1])
    assert np.allclose(model.embed(toks, pooling="mean"), rows.astype(np.float64).mean(0), rtol=0, atol=1e-5)


def test_arguments_are_checked(model):
    n_ctx, H, V = model.n_ctx, model.n_embd, model.n_vocab
    cases = [([1, 2], CLS, None, "pooling: CLS (2) is not supported"),
             ([1, 2], RANK, None, "pooling: RANK (4) is not supported"),
             ([1, 2], 7, None, "pooling: 7 unknown"),
             ([], LAST, None, "n_tokens: 0 outside [1, n_ctx"),
             ([1] * (n_ctx + 1), LAST, None, f"n_tokens: {n_ctx + 1} outside [1, n_ctx {n_ctx}]"),
             ([1, V], LAST, None, f"tokens[1]: id {V} outside"),
             ([1, 2, 3], NONE, 3 * H - 1, f"out_size: {3 * H - 1} floats, the pooling writes {3 * H}"),
             ([1, 2, 3], MEAN, H - 1, f"out_size: {H - 1} floats, the pooling writes {H}"),
             ([1, 2, 3], LAST, -1, "out_size: -1 floats")]
    for toks, pooling, size, msg in cases:
        rc, got, out = _embed(model, toks, pooling, size)
        assert rc == lib.CLOVER_E_ARG and msg in got, (toks[:3], pooling, size, got)
        assert np.isnan(out).all()  # nothing written
    err = err_buf()
    assert lib.clover_embed(model._ctx, ffi.NULL, 1, LAST, ffi.new("float[]", H), H, err, len(err)) == lib.CLOVER_E_ARG
    assert lib.clover_embed(ffi.NULL, ffi.new("int32_t[]", [1]), 1, LAST, ffi.new("float[]", H), H, err,
                            len(err)) == lib.CLOVER_E_ARG
    assert lib.clover_embed(model._ctx, ffi.new("int32_t[]", [1]), 1, LAST, ffi.NULL, H, err, len(err)) == lib.CLOVER_E_ARG
    with pytest.raises(ValueError, match="pooling: 'cls' is not supported"):
        model.embed([1, 2], pooling="cls")
    with pytest.raises(ValueError, match="pooling: expected one of"):
        model.embed([1, 2], pooling="max")
    with pytest.raises(ValueError, match=r"input\[1\]: token id"):
        model.embed([1, V])
    with pytest.raises(ValueError, match=f"input: {n_ctx + 1} tokens do not fit n_ctx={n_ctx}"):
        model.embed([1] * (n_ctx + 1))


def test_pooling_type_key_is_the_default(path, tmp_path):
    import gguf

    toks = list(range(3, 20))
    mean = tmp_path / "mean.gguf"
    rewrite_gguf(pathlib.Path(path), mean, kv={"clover_moe.pooling_type": (MEAN, gguf.GGUFValueType.UINT32)})
    with Model(str(mean), n_ctx=64, n_threads=1) as m:
        assert m.pooling == "mean" and m.hparams["pooling_type"] == MEAN
        assert np.array_equal(m.embed(toks), m.embed(toks, pooling="mean"))
        rc, msg, out = _embed(m, toks, -1)  # CLOVER_POOLING_UNSPECIFIED: the model's
        assert rc == 0 and np.array_equal(out, m.embed(toks, pooling="mean"))
    bad = tmp_path / "bad.gguf"
    rewrite_gguf(pathlib.Path(path), bad, kv={"clover_moe.pooling_type": (9, gguf.GGUFValueType.UINT32)})
    assert "key clover_moe.pooling_type: value 9 outside [0, 4]" in engine_load_error(bad)
