"""clover_state_get_size / get_data / set_data (native/model/state.c): a context's state as bytes.

Reference: the context the state was taken from. Loaded into another context, the state gives
the next prefill's logits of the original context continuing with the same tokens, bit for bit
(the same computation on the same caches), and clover_context_restore_state returns to the
saved state as it would there. Every malformed or incompatible state is an error naming the field
(never a crash), after which the context is unchanged.
"""
import numpy as np
import pytest

import clover_gguf
from clover_gguf import Model
from clover_gguf._ffi import err_buf, ffi, lib

TEXT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 8
HEADER = 88  # bytes of state.c's state_header
NEXT = [11, 12, 13]


@pytest.fixture(scope="module")
def path(make_gguf):
    return make_gguf("f32")


def _model(path, **kw):
    return Model(path, **dict(dict(n_ctx=256, n_threads=2), **kw))


def _prefill(m, ids, logits=False):
    out = np.empty((len(ids), m.n_vocab), np.float32) if logits else None
    err = err_buf()
    rc = lib.clover_prefill(m._ctx, ffi.new("int32_t[]", ids), len(ids),
                            ffi.NULL if out is None else ffi.cast("float *", out.ctypes.data), 1, err, len(err))
    assert rc == 0, ffi.string(err)
    return out


def _get(m) -> bytes:
    size = lib.clover_state_get_size(m._ctx)
    assert size > 0
    buf = bytearray(size)
    err = err_buf()
    assert lib.clover_state_get_data(m._ctx, ffi.from_buffer("uint8_t[]", buf), size, err, len(err)) == size, \
        ffi.string(err)
    return bytes(buf)


def _set(m, state: bytes) -> tuple[int, str]:
    err = err_buf()
    rc = lib.clover_state_set_data(m._ctx, ffi.from_buffer("uint8_t[]", state), len(state), err, len(err))
    return int(rc), ffi.string(err).decode()


def _saved_context(m, ids):
    """m's context with ids prefilled and clover_context_save_state taken after the first 64."""
    lib.clover_context_reset(m._ctx)
    _prefill(m, ids[:64])
    err = err_buf()
    assert lib.clover_context_save_state(m._ctx, err, len(err)) == 0
    _prefill(m, ids[64:])


@pytest.mark.parametrize("cache", ["f32", "f16"])
def test_loaded_state_continues_bit_for_bit(path, cache):
    """A state loaded into a second context (with other tokens in it) continues as the first:
    n_past, the next tokens' logits, then restore_state to the saved 64 tokens and the logits
    after it, all equal; the loaded context saves to the same bytes."""
    with _model(path, type_k=cache, type_v=cache) as a, _model(path, type_k=cache, type_v=cache) as b:
        ids = a.tokenize(TEXT)[:100]
        _saved_context(a, ids)
        state = _get(a)
        assert len(state) == lib.clover_state_get_size(a._ctx)
        _prefill(b, b.tokenize("class Stack:\n    def push(self, item):\n" * 6)[:80])
        assert _set(b, state) == (len(state), "")
        assert lib.clover_context_n_past(b._ctx) == 100
        assert _get(b) == state
        np.testing.assert_array_equal(_prefill(b, NEXT, True), _prefill(a, NEXT, True))
        err = err_buf()
        for m in (a, b):
            assert lib.clover_context_restore_state(m._ctx, err, len(err)) == 64
        np.testing.assert_array_equal(_prefill(b, NEXT, True), _prefill(a, NEXT, True))


def test_empty_context_round_trip(path):
    """An empty context's state (header only) loads and leaves the other context empty."""
    with _model(path) as a, _model(path) as b:
        state = _get(a)
        assert len(state) > HEADER
        _prefill(b, [1, 2, 3])
        assert _set(b, state)[0] == len(state)
        assert lib.clover_context_n_past(b._ctx) == 0


def test_get_data_needs_the_whole_size(path):
    with _model(path) as a:
        _prefill(a, [1, 2, 3])
        size = lib.clover_state_get_size(a._ctx)
        err = err_buf()
        buf = ffi.new("uint8_t[]", size)
        assert lib.clover_state_get_data(a._ctx, buf, size - 1, err, len(err)) == lib.CLOVER_E_ARG
        assert ffi.string(err).decode().startswith(f"size: {size - 1} bytes, the state needs {size}")
        assert lib.clover_state_get_data(a._ctx, ffi.NULL, size, err, len(err)) == lib.CLOVER_E_ARG
        assert lib.clover_state_get_size(ffi.NULL) == lib.CLOVER_E_ARG


def test_truncated_and_corrupted_states_are_errors(path):
    """Every truncation, one extra byte, and a flipped bit in every header byte and across the
    payload: CLOVER_E_ARG or CLOVER_E_STATE with a "state: " message, and the context unchanged
    (its state's bytes and its next logits)."""
    with _model(path) as a, _model(path) as b:
        ids = a.tokenize(TEXT)[:100]
        _saved_context(a, ids)
        state = _get(a)
        _prefill(b, ids[:20])
        before = _get(b)
        bad = [state[:n] for n in list(range(0, HEADER + 2)) + [len(state) // 2, len(state) - 1]]
        bad.append(state + b"\0")
        flips = list(range(HEADER)) + list(range(HEADER, len(state), max(1, len(state) // 97)))
        bad += [state[:i] + bytes([state[i] ^ (1 << (i % 8))]) + state[i + 1:] for i in flips]
        for s in bad:
            rc, msg = _set(b, s)
            assert rc in (lib.CLOVER_E_ARG, lib.CLOVER_E_STATE) and msg.startswith("state: "), (len(s), rc, msg)
        assert _get(b) == before
        want = f"state: {HEADER + 1} bytes, its header describes {len(state)}"
        assert _set(b, state[:HEADER + 1])[1].startswith(want)
        assert _set(b, state[:10])[1] == f"state: 10 bytes, shorter than its header ({HEADER})"
        assert _set(b, b"X" + state[1:])[1] == "state: not a clover context state (magic)"
        mid = len(state) // 2
        flipped = state[:mid] + bytes([state[mid] ^ 1]) + state[mid + 1:]
        assert _set(b, flipped)[1] == "state: checksum mismatch (corrupted)"


def test_incompatible_states_are_refused(path, make_gguf):
    """CLOVER_E_STATE naming what differs: another file of the same shapes (q8_0 of the same
    checkpoint: the fingerprint), a model of other shapes (the embedded one), other cache types, an
    n_ctx below the state's n_past."""
    with _model(path) as a:
        _prefill(a, a.tokenize(TEXT)[:100])
        state = _get(a)
    cases = [(make_gguf("q8_0"), {}, "state: saved from another model (fingerprint "),
             (clover_gguf.DEFAULT_MODEL, {}, "state: "),
             (path, dict(type_k="f16"), "state: type_k F32, this context's F16"),
             (path, dict(type_v="f16"), "state: type_v F32, this context's F16"),
             (path, dict(n_ctx=99), "state: n_past 100 tokens do not fit this context's n_ctx 99")]
    for p, kw, want in cases:
        with _model(p, **kw) as b:
            rc, msg = _set(b, state)
            assert rc == lib.CLOVER_E_STATE and msg.startswith(want), (p, kw, msg)
            assert "another model" in msg or kw, msg
            assert lib.clover_context_n_past(b._ctx) == 0
    with _model(path, n_ctx=100) as b:  # exactly n_past fits
        assert _set(b, state)[0] == len(state)
