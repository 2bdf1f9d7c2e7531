"""Continuous batching in the engine (native/model/batch.c, clover.h clover_batch_*): contexts of
one model attached to one batch, driven from threads at once, give every forward's logits bit for
bit as the same forwards on a context alone (prefills long and short, split into chunks beside
other sequences' rows; one-row steps; block passes with the coreset), and the batch's stats show
passes shared by several contexts. Also the API's checks (another model, freeing while attached,
max_rows rounding) and per-context abort."""
import threading

import numpy as np
import pytest

from clover_gguf import Model
from clover_gguf._ffi import err_buf, ffi, lib


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def model(request, make_gguf):
    with Model(make_gguf(request.param), n_ctx=512, n_threads=2) as m:
        yield m


def _plan(rng, n_vocab, n_ctx):
    """A random sequence of forwards on one context: ("prefill", ids) of 1..300 tokens and
    ("block", ids) of 32 tokens, kept within n_ctx."""
    ops, n_past = [], 0
    while True:
        kind = rng.choice(["prefill", "step", "block"], p=[0.3, 0.5, 0.2])
        n = {"prefill": int(rng.integers(2, 300)), "step": 1, "block": 32}[kind]
        if n_past + n + 32 > n_ctx:
            return ops
        ops.append(("block" if kind == "block" else "prefill", rng.integers(0, n_vocab, n).astype(np.int32)))
        n_past += 0 if kind == "block" else n


def _run(m, ctx, ops):
    """The logits of every forward of ops on ctx (prefills: all rows)."""
    V, out, err = m.n_vocab, [], err_buf()
    lib.clover_context_reset(ctx)
    nexp = ffi.new("int32_t[]", m.hparams["n_layer"])
    for kind, ids in ops:
        lg = np.zeros((len(ids), V), np.float32)
        toks = ffi.from_buffer("int32_t[]", ids)
        buf = ffi.cast("float *", lg.ctypes.data)
        if kind == "prefill":
            rc = lib.clover_prefill(ctx, toks, len(ids), buf, 1, err, len(err))
        else:
            rc = lib.clover_block_forward(ctx, toks, len(ids), 0.9, buf, nexp, err, len(err))
        assert rc == 0, ffi.string(err)
        out.append((lg, list(nexp) if kind == "block" else None))
    return out


def _contexts(m, n):
    err = err_buf()
    cs = [lib.clover_context_new(m._model, m.n_ctx, 2, m.type_k, m.type_v, err, len(err)) for _ in range(n)]
    assert all(c != ffi.NULL for c in cs), ffi.string(err)
    return cs


@pytest.mark.parametrize("n_seq", [2, 3, 5])
def test_batched_forwards_equal_solo(model, n_seq):
    """n_seq threads, each a random plan of forwards on its own context, all attached to one
    batch (max_rows 128, so long prefills run in chunks beside the others' rows): every logits
    row and every block pass's expert count equals the same plan run alone, bit for bit."""
    m = model
    rng = np.random.default_rng(n_seq)
    plans = [_plan(rng, m.n_vocab, m.n_ctx) for _ in range(n_seq)]
    cs = _contexts(m, n_seq)
    err = err_buf()
    b = lib.clover_batch_new(m._model, 128, err, len(err))
    assert b != ffi.NULL
    try:
        solo = [_run(m, cs[0], p) for p in plans]
        got, fails = [None] * n_seq, []
        start = threading.Barrier(n_seq)

        def worker(i):
            try:
                assert lib.clover_context_set_batch(cs[i], b, err_buf(), 256) == 0
                start.wait()
                got[i] = _run(m, cs[i], plans[i])
                assert lib.clover_context_set_batch(cs[i], ffi.NULL, err_buf(), 256) == 0
            except BaseException as e:  # noqa: BLE001 - reported below
                fails.append(e)
                start.abort()

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(n_seq)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not fails, fails
        for i in range(n_seq):
            assert len(got[i]) == len(solo[i])
            for (a, na), (s, ns) in zip(got[i], solo[i]):
                assert np.array_equal(a.view(np.uint32), s.view(np.uint32))
                assert na == ns
        st = ffi.new("clover_batch_stats *")
        lib.clover_batch_get_stats(b, st)
        assert st.n_shared >= 1 and st.max_entries >= 2, (st.n_passes, st.n_shared, st.max_entries)
        assert st.n_entries > st.n_passes
        # no pass over max_rows but by the one row a prefill's chunk may take more (pass_rows)
        assert st.n_rows <= st.n_passes * (128 + 1)
    finally:
        for c in cs:
            lib.clover_context_set_batch(c, ffi.NULL, err_buf(), 256)
            lib.clover_context_free(c)
        assert lib.clover_batch_free(b) == 0


def test_batch_api_checks(model, make_gguf):
    m = model
    err = err_buf()
    b = lib.clover_batch_new(m._model, 100, err, len(err))
    c = _contexts(m, 1)[0]
    try:
        assert lib.clover_context_set_batch(c, b, err, len(err)) == 0
        assert lib.clover_batch_free(b) == lib.CLOVER_E_STATE  # a context is attached
        with Model(make_gguf("f32"), n_ctx=64, n_threads=1) as other:
            b2 = lib.clover_batch_new(other._model, 0, err, len(err))
            other_ctx = other._ctx
            assert lib.clover_context_set_batch(other_ctx, b, err, len(err)) == lib.CLOVER_E_ARG
            assert b"another model" in ffi.string(err)
            assert lib.clover_batch_free(b2) == 0
        # alone on its batch: a forward runs at once (nobody to wait for) and gives the solo logits
        ids = np.arange(70, dtype=np.int32) % m.n_vocab
        lg = np.zeros((1, m.n_vocab), np.float32)
        assert lib.clover_prefill(c, ffi.from_buffer("int32_t[]", ids), 70, ffi.cast("float *", lg.ctypes.data), 0,
                                  err, len(err)) == 0
        want = m.prefix_logits(ids.tolist())[-1]
        assert np.array_equal(lg[0], want)
        st = ffi.new("clover_batch_stats *")
        lib.clover_batch_get_stats(b, st)
        assert st.n_passes == 2 and st.n_rows == 70 and st.n_shared == 0  # 100 rounds to 64: 64 + 6 rows
        # a pending abort stops the context's next batched forward, and only that one
        lib.clover_context_abort(c)
        rc = lib.clover_prefill(c, ffi.from_buffer("int32_t[]", ids), 3, ffi.NULL, 0, err, len(err))
        assert rc == lib.CLOVER_E_ABORTED and b"aborted" in ffi.string(err)
        assert lib.clover_prefill(c, ffi.from_buffer("int32_t[]", ids), 3, ffi.NULL, 0, err, len(err)) == 0
        assert lib.clover_context_set_batch(ffi.NULL, b, err, len(err)) == lib.CLOVER_E_ARG
        # freeing an attached context detaches it: the batch can be freed after
        other = _contexts(m, 1)[0]
        assert lib.clover_context_set_batch(other, b, err, len(err)) == 0
        lib.clover_context_free(other)
        lib.clover_context_set_batch(c, ffi.NULL, err, len(err))
        assert lib.clover_batch_free(b) == 0
        b = lib.clover_batch_new(m._model, 0, err, len(err))
    finally:
        lib.clover_context_set_batch(c, ffi.NULL, err, len(err))
        lib.clover_context_free(c)
        assert lib.clover_batch_free(b) == 0


def _entries(m, ctxs, kinds, rng):
    """One clover_forward_entry per context: a prefill of 1..200 random tokens (all logits) or a
    block of 32 (coreset 0.9, every row); with the arrays that keep them alive."""
    keep, es = [], ffi.new("clover_forward_entry[]", len(ctxs))
    for i, (c, kind) in enumerate(zip(ctxs, kinds)):
        n = 32 if kind == "block" else int(rng.integers(1, 200))
        ids = rng.integers(0, m.n_vocab, n).astype(np.int32)
        lg = np.zeros((n, m.n_vocab), np.float32)
        nexp = ffi.new("int32_t[]", m.hparams["n_layer"])
        keep += [ids, lg, nexp]
        e = es[i]
        e.ctx, e.tokens, e.n_tokens = c, ffi.from_buffer("int32_t[]", ids), n
        e.mode = lib.CLOVER_FORWARD_BLOCK if kind == "block" else lib.CLOVER_FORWARD_PREFIX
        e.logits, e.all_logits, e.coreset_top_p = ffi.cast("float *", lg.ctypes.data), 1, 0.9
        e.n_experts_out = nexp
    return es, keep


def test_forward_batch_equals_each_entry_alone(model):
    """clover_forward_batch of 4 contexts (each first given a random prefix, then a mix of
    prefills and blocks) gives each entry's logits, experts, n_past and later forwards bit for bit
    as clover_prefill / clover_block_forward on a context alone."""
    m = model
    rng = np.random.default_rng(7)
    cs = _contexts(m, 5)
    err = err_buf()
    try:
        for rnd in range(3):
            kinds = list(rng.choice(["prefill", "block"], 4))
            for c in cs[:4]:
                if lib.clover_context_n_past(c) + 232 > m.n_ctx:
                    lib.clover_context_reset(c)
            es, keep = _entries(m, cs[:4], kinds, rng)
            want = []
            for i in range(4):  # the same forward alone, on cs[4] holding the same prefix
                pre = lib.clover_context_n_past(cs[i])
                st = np.zeros(lib.clover_state_get_size(cs[i]), np.uint8)
                assert lib.clover_state_get_data(cs[i], ffi.from_buffer("uint8_t[]", st), st.size, err, len(err)) >= 0
                assert lib.clover_state_set_data(cs[4], ffi.from_buffer("uint8_t[]", st), st.size, err, len(err)) >= 0
                assert lib.clover_context_n_past(cs[4]) == pre
                e = es[i]
                lg = np.zeros((e.n_tokens, m.n_vocab), np.float32)
                nexp = ffi.new("int32_t[]", m.hparams["n_layer"])
                if kinds[i] == "block":
                    rc = lib.clover_block_forward(cs[4], e.tokens, e.n_tokens, 0.9, ffi.cast("float *", lg.ctypes.data),
                                                  nexp, err, len(err))
                else:
                    rc = lib.clover_prefill(cs[4], e.tokens, e.n_tokens, ffi.cast("float *", lg.ctypes.data), 1,
                                            err, len(err))
                assert rc == 0
                want.append((lg, list(nexp), lib.clover_context_n_past(cs[4])))
            assert lib.clover_forward_batch(es, 4, err, len(err)) == 0, ffi.string(err)
            for i in range(4):
                lg = keep[3 * i + 1]
                assert es[i].rc == 0
                assert np.array_equal(lg.view(np.uint32), want[i][0].view(np.uint32)), (rnd, i, kinds[i])
                if kinds[i] == "block":
                    assert list(es[i].n_experts_out[0:m.hparams["n_layer"]]) == want[i][1]
                assert lib.clover_context_n_past(cs[i]) == want[i][2]
    finally:
        for c in cs:
            lib.clover_context_free(c)


def test_forward_batch_checks_each_entry(model):
    """A bad entry (out-of-range token, a context given twice, an unknown mode, a context past its
    n_ctx) fails alone, named, while the good entries run; n outside [1, 256] is refused."""
    m = model
    rng = np.random.default_rng(3)
    cs = _contexts(m, 3)
    err = err_buf()
    try:
        es, keep = _entries(m, cs, ["prefill", "prefill", "prefill"], rng)
        es[1].tokens[0] = m.n_vocab
        assert lib.clover_forward_batch(es, 3, err, len(err)) == lib.CLOVER_E_ARG
        assert b"tokens[0]" in ffi.string(err)
        assert es[0].rc == 0 and es[1].rc == lib.CLOVER_E_ARG and es[2].rc == 0
        assert lib.clover_context_n_past(cs[0]) == es[0].n_tokens and lib.clover_context_n_past(cs[1]) == 0
        es, keep = _entries(m, [cs[0], cs[0]], ["prefill", "prefill"], rng)
        assert lib.clover_forward_batch(es, 2, err, len(err)) == lib.CLOVER_E_ARG
        assert b"entries[1].ctx" in ffi.string(err) and es[0].rc == 0
        es, keep = _entries(m, [cs[2]], ["prefill"], rng)
        es[0].mode = 7
        assert lib.clover_forward_batch(es, 1, err, len(err)) == lib.CLOVER_E_ARG and b"entries[0].mode" in ffi.string(err)
        assert lib.clover_forward_batch(es, 0, err, len(err)) == lib.CLOVER_E_ARG
        assert lib.clover_forward_batch(es, 257, err, len(err)) == lib.CLOVER_E_ARG
        b = lib.clover_batch_new(m._model, 0, err, len(err))
        assert lib.clover_context_set_batch(cs[2], b, err, len(err)) == 0
        es, keep = _entries(m, [cs[2]], ["prefill"], rng)
        assert lib.clover_forward_batch(es, 1, err, len(err)) == lib.CLOVER_E_STATE and b"clover_batch" in ffi.string(err)
        assert lib.clover_context_set_batch(cs[2], ffi.NULL, err, len(err)) == 0
        assert lib.clover_batch_free(b) == 0
    finally:
        for c in cs:
            lib.clover_context_free(c)
