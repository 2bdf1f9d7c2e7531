"""Prefix reuse (``Model(prefix_reuse=True)``, on by default in ``Clover`` and the server) is
invisible: a generation that continues the caches a previous request left gives the tokens of a
fresh model's full prefill, bit for bit, in every mode and weight type.

Reference: the same model with ``prefix_reuse=False`` (every call one full prefill). The engine
property this rests on (clover.h CLOVER_GDN_CHUNK): on the CPU path a prefill stopped at a
multiple of the GDN chunk and continued by a call of 2 or more tokens equals one prefill, which
the first tests check on the logits of ``clover_prefill`` directly.
"""
import numpy as np
import pytest

import clover_gguf
from clover_gguf import Model
from clover_gguf._ffi import err_buf, ffi, lib

CHUNK = lib.CLOVER_GDN_CHUNK
TEXT = ("The river wound through the valley, past the mill and the old stone bridge, where the "
        "children of the village fished for trout on summer evenings. def mean(xs):\n    return "
        "sum(xs) / len(xs)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n")
PREFIX_LENS = (65, 100, 129, 300)  # none a multiple of the chunk
N_NEW = 37  # tokens the second prompt adds


@pytest.fixture(scope="module")
def paths(make_gguf):
    return {"f32": make_gguf("f32"), "bf16": make_gguf("bf16"), "q8_0": make_gguf("q8_0"),
            "q4_k_m": make_gguf("q4_k_m"), "embedded": clover_gguf.DEFAULT_MODEL}


def _ids(m, n):
    ids = m.tokenize(TEXT * 40)[:n]
    assert len(ids) == n
    return ids


def _prefill_logits(m, ids, cuts):
    """All-row logits of ``ids`` prefilled from an empty cache in calls split at ``cuts``."""
    lib.clover_context_reset(m._ctx)
    out = np.empty((len(ids), m.n_vocab), np.float32)
    err = err_buf()
    for a, b in zip([0, *cuts], [*cuts, len(ids)]):
        rc = lib.clover_prefill(m._ctx, ffi.new("int32_t[]", ids[a:b]), b - a,
                                ffi.cast("float *", out[a:].ctypes.data), 1, err, len(err))
        assert rc == 0, ffi.string(err)
    return out


@pytest.mark.parametrize("kind", ["q8_0", "embedded"])
def test_prefill_split_at_a_chunk_multiple_equals_one_prefill(paths, kind):
    """Split at a multiple of CLOVER_GDN_CHUNK: the logits of one prefill bit for bit; split
    elsewhere they differ (the chunked GDN's chunks start at each call's first token), which is
    why prefix reuse splits only at chunk multiples."""
    with Model(paths[kind], n_ctx=512, n_threads=2) as m:
        ids = _ids(m, 300)
        one = m.prefix_logits(ids)
        for cuts in ([CHUNK], [2 * CHUNK], [CHUNK, 4 * CHUNK]):
            np.testing.assert_array_equal(_prefill_logits(m, ids, cuts), one, err_msg=str(cuts))
        assert any(not np.array_equal(_prefill_logits(m, ids, [c]), one) for c in (65, 100, 129, 299))


def test_long_prefill_passes_equal_one_pass(paths):
    """A prompt longer than one pass of the CPU path (2048 rows) whose last pass would hold one
    token: its passes equal a prefill continued at any chunk multiple (no 1-row pass that runs
    the token-by-token GDN recurrence where the split prefill runs the chunked form)."""
    with Model(paths["f32"], n_ctx=2112, n_threads=2) as m:
        ids = _ids(m, 2049)
        one = m.prefix_logits(ids)
        np.testing.assert_array_equal(_prefill_logits(m, ids, [2048 - CHUNK]), one)


def _pair(path, n_ctx=512):
    return Model(path, n_ctx=n_ctx, n_threads=2, prefix_reuse=True), Model(path, n_ctx=n_ctx, n_threads=2)


def _caches(m):
    """Logits of a block pass (spec 3.2) over 4 tokens against m's caches as a generation left
    them (the pass reads the KV cache and GDN state, changing neither)."""
    out = np.empty((4, m.n_vocab), np.float32)
    err = err_buf()
    rc = lib.clover_block_forward(m._ctx, ffi.new("int32_t[]", [5, 6, 7, 8]), 4, 1.0,
                                  ffi.cast("float *", out.ctypes.data), ffi.NULL, err, len(err))
    assert rc == 0, ffi.string(err)
    return out


def _same(reuse, fresh, ids, **opts):
    """One generation on each model gives the same tokens and leaves the same caches; returns
    the prefix_reuse model's tokens and stats."""
    got, st = reuse.generate_tokens(ids, **opts)
    want, _ = fresh.generate_tokens(ids, **opts)
    assert got == want, len(ids)
    np.testing.assert_array_equal(_caches(reuse), _caches(fresh), err_msg=str(len(ids)))
    return got, st


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0", "q4_k_m", "embedded"])
def test_reused_prefix_gives_a_fresh_prefills_tokens(paths, kind, mode):
    """Prompt A (the prefix) then A + new tokens on one prefix_reuse model: both answers, and the
    caches they leave, equal a fresh model's, for prefixes that are not chunk multiples; the
    prefix is reused up to its last chunk boundary."""
    reuse, fresh = _pair(paths[kind])
    with reuse, fresh:
        ids = _ids(reuse, max(PREFIX_LENS) + N_NEW)
        opts = dict(mode=mode, end_ids=[], max_tokens=8, block_size=8)
        for n in PREFIX_LENS:
            _same(reuse, fresh, ids[:n], **opts)
            _, st = _same(reuse, fresh, ids[:n + N_NEW], **opts)
            assert st["n_prompt_reused"] % CHUNK == 0 and st["n_prompt_reused"] < n, n
        assert st["n_prompt_reused"] == 4 * CHUNK  # A's prefill saved at its last chunk boundary


def test_reuse_of_the_cached_prompt_and_not_of_decoded_tokens(paths):
    """The caches after a generation that wrote only its prompt's prefill (one token, a
    chunk-multiple prompt) are continued as they are; decoded tokens, which ran as 1-token
    steps, are not reused: the next prompt restarts from the saved chunk boundary. Both equal a
    fresh model's answers."""
    reuse, fresh = _pair(paths["q8_0"])
    with reuse, fresh:
        ids = _ids(reuse, 4 * CHUNK + N_NEW)
        opts = dict(mode="ar", end_ids=[], max_tokens=8)
        _same(reuse, fresh, ids[:2 * CHUNK], mode="ar", end_ids=[], max_tokens=1)
        got, st = _same(reuse, fresh, ids[:3 * CHUNK + 5], **opts)
        assert st["n_prompt_reused"] == 2 * CHUNK  # the whole cached prompt
        _, st = _same(reuse, fresh, ids[:3 * CHUNK + 5] + got + ids[-N_NEW:], **opts)
        assert st["n_prompt_reused"] == 3 * CHUNK  # the saved prefix, not the decoded answer


def test_rerendered_chat_turn_reuses_the_history_up_to_a_chunk_boundary(paths):
    """A chat turn whose template rewrites the previous reply: the history saved at the last
    <|im_start|>, rounded down to a chunk multiple, is restored; the answer equals a fresh one."""
    reuse, fresh = _pair(paths["f32"])
    with reuse, fresh:
        ims = reuse.tokenizer.token_to_id("<|im_start|>")
        history = [ims] + reuse.tokenize("system\nYou are terse.\n") + [ims] + reuse.tokenize("user\n" + TEXT * 3)
        first = history + [ims] + reuse.tokenize("assistant\n")
        opts = dict(mode="ar", end_ids=[], max_tokens=8)
        _same(reuse, fresh, first, **opts)
        second = history + [ims] + reuse.tokenize("assistant\nA short answer.") + [ims] + \
            reuse.tokenize("user\nAnd then?") + [ims] + reuse.tokenize("assistant\n")
        _, st = _same(reuse, fresh, second, **opts)
        assert st["n_prompt_reused"] == len(history) // CHUNK * CHUNK > 0
