"""save_state / load_state of :class:`Clover` and :class:`Model` (clover_gguf/state.py over
clover.h's clover_state_*): a saved state continues as if it had never left.

Reference: a fresh Clover that saw prompt P first. After P, save_state, unrelated calls and
load_state (on the same object, another on the same file, or a pickled copy), P + more text gives
that object's output and timings (all but the wall-clock ones), and the saved prefix is reused.
"""
import pickle

import numpy as np
import pytest

import clover_gguf
from clover_gguf import Clover, CloverError, Model
from clover_gguf.llama import LlamaState

N_THREADS = 2
TEXT = ("The river wound through the valley, past the mill and the old stone bridge, where the "
        "children of the village fished for trout on summer evenings. def mean(xs):\n    return "
        "sum(xs) / len(xs)\n\nclass Stack:\n    def __init__(self):\n        self.items = []\n")
OTHER = "Lists of numbers: 1, 2, 3, 5, 8, 13, 21, 34. Colours: red, green, blue, cyan. " * 6
CLOCK = {"prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second", "seconds", "prefill_seconds",
         "tokens_per_second"}


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return str(make_gguf("f32"))


def _prompts(c):
    """P (150 tokens: its prefix up to 128 is saved for reuse) and P + 30 tokens."""
    ids = c.tokenize(TEXT * 20)
    return ids[:150], ids[:150] + c.tokenize(OTHER)[:30]


def _complete(c, ids, mode):
    """Greedy text and the timings that do not depend on the clock."""
    r = c.create_completion(ids, max_tokens=12, mode=mode)
    return r["choices"][0]["text"], {k: v for k, v in r["timings"].items() if k not in CLOCK}


@pytest.mark.parametrize("mode", ["ar", "spec", "diffusion"])
def test_loaded_state_continues_as_a_fresh_object(gguf_path, mode):
    """P, save_state, two unrelated prompts, load_state, P + more: the output and timings of a
    fresh object given P then P + more, with the saved prefix reused; the same on a second object
    that loads the state (never having seen P) and from a pickled copy."""
    with Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as c, \
            Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as fresh:
        p, ext = _prompts(c)
        first = _complete(c, p, mode)
        state = c.save_state()
        assert _complete(fresh, p, mode) == first
        want = _complete(fresh, ext, mode)
        assert want[1]["n_prompt_reused"] > 0
        assert isinstance(state.input_ids, np.ndarray) and state.scores is None
        assert state.n_tokens == len(state.input_ids) >= 128  # diffusion: whole blocks only
        assert state.input_ids[:len(p)].tolist() == p[:state.n_tokens]
        assert state.llama_state_size == len(state.llama_state)
        for other in (c.tokenize(OTHER), c.tokenize(OTHER[::-1])):
            _complete(c, other, mode)
        c.load_state(state)
        assert _complete(c, ext, mode) == want
        with Clover(gguf_path, n_ctx=256, n_threads=N_THREADS) as second:  # has never seen P
            second.load_state(pickle.loads(pickle.dumps(state)))
            assert _complete(second, ext, mode) == want


def test_save_load_save_gives_the_same_bytes_and_seed(gguf_path):
    """A loaded state saves to the same bytes; load_state takes the saved seed as the default."""
    with Clover(gguf_path, n_ctx=512, n_threads=N_THREADS, seed=7) as c, \
            Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as d:
        p, _ = _prompts(c)
        _complete(c, p, "ar")
        state = c.save_state()
        d.load_state(state)
        assert d.seed == 7
        again = d.save_state()
        assert again.llama_state == state.llama_state and again.input_ids.tolist() == state.input_ids.tolist()


def _altered(state, **fields):
    f = dict(input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens,
             llama_state=state.llama_state, llama_state_size=state.llama_state_size, seed=state.seed)
    f.update(fields)
    if "llama_state" in fields and "llama_state_size" not in fields:
        f["llama_state_size"] = len(f["llama_state"])
    return LlamaState(**f)


def _flip(b: bytes, at: int) -> bytes:
    return b[:at] + bytes([b[at] ^ 0x10]) + b[at + 1:]


def test_bad_states_are_refused_and_leave_the_context_unchanged(gguf_path):
    """Another type, fields that disagree with llama_state, truncated or corrupted bytes: a
    ValueError naming the field, and the object's state stays what it was."""
    with Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as c:
        p, _ = _prompts(c)
        _complete(c, p, "ar")
        state = c.save_state()
        blob = state.llama_state
        bad = [
            ("x", r"^state: expected the LlamaState"),
            (None, r"^state: expected the LlamaState"),
            (_altered(state, input_ids=state.input_ids[:-1]), r"^state\.input_ids"),
            (_altered(state, n_tokens=state.n_tokens + 1), r"^state\.n_tokens"),
            (_altered(state, llama_state_size=len(blob) - 1), r"^state\.llama_state_size"),
            (_altered(state, llama_state="text"), r"^state\.llama_state: expected bytes"),
            (_altered(state, seed=-2), r"^state\.seed"),
            (_altered(state, llama_state=blob[:-7]), r"^state: .*truncated"),
            (_altered(state, llama_state=blob[:40]), r"^state: its token lists are truncated"),
            (_altered(state, llama_state=blob + b"\0"), r"^state: .*truncated or corrupted"),
            (_altered(state, llama_state=_flip(blob, len(blob) // 2)), r"^state: checksum mismatch"),
            (_altered(state, llama_state=_flip(blob, 30)), r"^state: its token lists are .*corrupted"),
            (_altered(state, llama_state=b"GGUF" + blob[4:]), r"^state: not a saved clover-gguf state"),
        ]
        _complete(c, c.tokenize(OTHER), "ar")
        before = c.save_state().llama_state
        for s, match in bad:
            with pytest.raises(ValueError, match=match):
                c.load_state(s)
        assert c.save_state().llama_state == before


def test_states_of_other_models_cache_types_and_shorter_contexts_are_refused(gguf_path, make_gguf):
    """A state is refused, naming the reason, by a model of another file with the same shapes
    (q8_0 of the same checkpoint), of other shapes (the embedded model), by other cache types
    and by an n_ctx shorter than its tokens."""
    with Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as c:
        p, _ = _prompts(c)
        _complete(c, p, "ar")
        state = c.save_state()
    cases = [
        (dict(model_path=str(make_gguf("q8_0"))), r"^state: saved from another model \(fingerprint"),
        (dict(model_path=clover_gguf.DEFAULT_MODEL), r"^state: "),
        (dict(type_k="f16"), r"^state: type_k F32, this context's F16"),
        (dict(type_v="f16"), r"^state: type_v F32, this context's F16"),
        (dict(n_ctx=state.n_tokens - 1), rf"^state: n_past {state.n_tokens} tokens do not fit this context's n_ctx"),
    ]
    for kw, match in cases:
        kw = dict(dict(model_path=gguf_path, n_ctx=512, n_threads=N_THREADS), **kw)
        with Clover(kw.pop("model_path"), **kw) as d:
            with pytest.raises(ValueError, match=match):
                d.load_state(state)
            assert d.save_state().n_tokens == 0


def test_model_save_state_refuses_an_unfinished_stream(gguf_path):
    """Model.save_state during an unfinished generation iterator: CloverError (the context is
    mid-generation); after the iterator ends, it saves."""
    with Model(gguf_path, n_ctx=256, n_threads=N_THREADS, prefix_reuse=True) as m:
        it = m.generate_pieces("def f(x):", mode="ar", max_tokens=4)
        next(it)
        with pytest.raises(CloverError, match="save_state: a generation is in progress"):
            m.save_state()
        list(it)
        m.load_state(m.save_state())
