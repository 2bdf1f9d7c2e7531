"""Embeddings through Model.embed and Clover's llama-cpp-python API (embed, create_embedding).

References: Model.embed on the same GGUF (the engine's rows; their relation to transformers and to
the LM head is tested in tests/oracles/test_embed_oracle.py and tests/native/test_embed_engine.py),
numpy's L2 norm, llama-cpp-python 0.3.36's shapes and defaults, and a model that never embedded
(the next generation's tokens).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from clover_gguf import Clover, CloverError, Model
from clover_gguf.model import ContextLengthExceeded

N_CTX = 64
TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "x"]


@pytest.fixture(scope="module")
def path(make_gguf):
    return str(make_gguf("f32"))


@pytest.fixture(scope="module")
def llm(path):
    with Clover(path, n_ctx=N_CTX, n_threads=2, embedding=True) as c:
        yield c


def test_embed_of_a_string_and_of_a_list(llm):
    m = llm.engine
    assert llm.pooling_type() == 3 and m.pooling == "last" and llm.n_embd() == m.n_embd
    one = llm.embed(TEXTS[0])
    assert isinstance(one, list) and len(one) == m.n_embd and all(isinstance(v, float) for v in one)
    assert np.array_equal(np.float32(one), m.embed(m.tokenize(TEXTS[0]), pooling="last"))
    many, count = llm.embed(TEXTS, return_count=True)
    assert len(many) == 3 and count == sum(len(m.tokenize(t)) for t in TEXTS)
    for t, e in zip(TEXTS, many):
        assert e == llm.embed(t)
    assert llm.embed(TEXTS[:1]) == [one]  # a list of one: a list
    ids = m.tokenize(TEXTS[1])
    assert llm.embed(ids) == many[1] and llm.embed([ids, m.tokenize("x")]) == many[1:]


def test_normalize(llm):
    raw = np.float64(llm.embed(TEXTS[1]))
    unit = np.float64(llm.embed(TEXTS[1], normalize=True))
    assert abs(np.linalg.norm(unit) - 1) <= 1e-5 and np.linalg.norm(raw) > 1.5
    assert np.allclose(unit, raw / np.linalg.norm(raw), rtol=0, atol=1e-7)
    for e in llm.embed(TEXTS, normalize=True):
        assert abs(np.linalg.norm(e) - 1) <= 1e-5


def test_pooling_none_and_mean(path):
    with Clover(path, n_ctx=N_CTX, n_threads=2, embedding=True, pooling_type=0) as none, \
            Clover(path, n_ctx=N_CTX, n_threads=2, embedding=True, pooling_type="mean") as mean:
        assert none.pooling_type() == 0 and mean.pooling_type() == 1
        rows = none.embed(TEXTS[0])
        n = len(none.tokenize(TEXTS[0]))
        assert len(rows) == n and all(len(r) == none.n_embd() for r in rows)
        assert np.allclose(mean.embed(TEXTS[0]), np.float64(rows).mean(0), rtol=0, atol=1e-6)
        unit = none.embed(TEXTS[0], normalize=True)
        assert all(abs(np.linalg.norm(r) - 1) <= 1e-5 for r in unit)
        both = none.embed(TEXTS[:2])
        assert len(both) == 2 and both[0] == rows and len(both[1]) == len(none.tokenize(TEXTS[1]))
        d = none.create_embedding(TEXTS[0])["data"][0]["embedding"]
        assert d == rows


def test_create_embedding_shape(llm, path):
    r = llm.create_embedding(TEXTS[0])
    n = len(llm.tokenize(TEXTS[0]))
    assert r == {"object": "list", "model": path,
                 "data": [{"object": "embedding", "embedding": llm.embed(TEXTS[0]), "index": 0}],
                 "usage": {"prompt_tokens": n, "total_tokens": n}}
    r = llm.create_embedding(TEXTS, model="named")
    assert r["model"] == "named" and [d["index"] for d in r["data"]] == [0, 1, 2]
    assert [d["embedding"] for d in r["data"]] == llm.embed(TEXTS)
    assert r["usage"]["prompt_tokens"] == r["usage"]["total_tokens"] == llm.embed(TEXTS, return_count=True)[1]
    unit = llm.create_embedding(TEXTS[1], normalize=True)["data"][0]["embedding"]
    assert abs(np.linalg.norm(unit) - 1) <= 1e-5


def test_truncate_at_n_ctx(llm):
    ids = llm.tokenize("alpha beta gamma delta " * 40)
    assert len(ids) > N_CTX
    e, count = llm.embed(ids, return_count=True)
    assert count == N_CTX and e == llm.embed(ids[:N_CTX])
    with pytest.raises(ContextLengthExceeded, match=rf"^input: {len(ids)} tokens do not fit n_ctx={N_CTX}"):
        llm.embed(ids, truncate=False)
    with pytest.raises(ContextLengthExceeded, match=r"^input\[1\]: "):
        llm.embed([[1, 2], ids], truncate=False)


def test_bad_input_names_the_field(llm, path):
    V = llm.n_vocab()
    cases = [("", "input: empty"), ([], "input: expected a non-empty"), (None, "input: expected"),
             (["a", ""], r"input\[1\]: empty"), (["a", 3], r"input\[1\]: expected a string or a list"),
             ([[1], [2, V]], rf"input\[1\]\[1\]: token id {V} out of range"), ([True], r"input\[0\]: expected"),
             ([1.5], r"input\[0\]: expected"), ("a\ud800", "input: not valid Unicode"),
             (["a", "\udfff"], r"input\[1\]: not valid Unicode")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=f"^{msg}"):
            llm.embed(bad)
    with Clover(path, n_ctx=N_CTX, n_threads=1) as plain:
        with pytest.raises(RuntimeError, match="embedding=True"):
            plain.embed("a")
        with pytest.raises(RuntimeError, match="embedding=True"):
            plain.create_embedding("a")
    for bad in (2, "cls", 4, "rank", 5, "max", True):
        with pytest.raises(ValueError, match="^pooling_type: "):
            Clover(path, n_ctx=N_CTX, embedding=True, pooling_type=bad)


def _ids(m, n):
    ids = m.tokenize("class Stack:\n    def push(self, x):\n        self.items.append(x)\n" * 20)[:n]
    assert len(ids) == n
    return ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_generation_after_embed_equals_one_without(path, mode):
    """A prefix-reuse model that generated from prompt A, embedded, then generates from A + more
    gives a fresh model's tokens: the embedding reset the caches and the reuse records (nothing
    of A is reused), and left no state behind."""
    opts = dict(mode=mode, end_ids=[], max_tokens=8, block_size=8)
    with Model(path, n_ctx=512, n_threads=2, prefix_reuse=True) as m, \
            Model(path, n_ctx=512, n_threads=2, prefix_reuse=True) as fresh:
        ids = _ids(m, 170)
        m.generate_tokens(ids[:140], **opts)
        e = m.embed(ids[:100], pooling="mean")
        got = m.generate_tokens(ids, **opts)[0]
        assert m.last_stats["n_prompt_reused"] == 0
        want = fresh.generate_tokens(ids, **opts)[0]
        assert got == want
        # without the embedding, the same model would have reused A's saved prefix
        fresh.generate_tokens(ids[:140], **opts)
        assert fresh.generate_tokens(ids, **opts)[0] == want and fresh.last_stats["n_prompt_reused"] == 128
        assert np.array_equal(m.embed(ids[:100], pooling="mean"), e)  # generations leave no trace in embed


def test_cancel_stops_an_embedding(path):
    """Clover.cancel() from another thread ends a running embed with CloverError (the forward
    in progress stops before its next layer, or the next input does not start); the object
    stays usable."""
    with Clover(path, n_ctx=2048, n_threads=1, embedding=True) as c:
        inputs = [[(7 * i + k) % 2000 for k in range(2000)] for i in range(30)]
        box = {}

        def run():
            try:
                box["out"] = c.embed(inputs)
            except CloverError as e:
                box["err"] = e

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while not c.cancel():  # True once the call holds the lock
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.005)
        t.join(120)
        assert not t.is_alive() and "out" not in box and isinstance(box["err"], CloverError), box
        assert np.float32(c.embed("x")).shape == (c.n_embd(),)
