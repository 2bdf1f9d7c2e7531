"""API misuse from several threads: :class:`Model` calls from many threads at once and
``close()`` from another thread while a generation runs never touch freed memory (run under
AddressSanitizer by tests/native/test_fuzz.py's sanitised child); they serialise, cancel or raise
CloverError."""
from __future__ import annotations

import threading
import time

import pytest

import clover_gguf
from clover_gguf import CloverError, Model

PROMPT = "def parse(value):\n    "
MODES = ("ar", "diffusion", "spec")


@pytest.fixture(scope="module")
def solo():
    """Each mode's greedy answer from a model used by one thread."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1) as m:
        return {mode: m.generate(PROMPT, max_tokens=24, mode=mode) for mode in MODES}


def _close_during(call, delay):
    """Start ``call(model)`` in a thread, close the model from this one after ``delay`` s; return
    what the call returned or raised."""
    m = Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1)
    out = {}

    def work():
        try:
            out["value"] = call(m)
        except CloverError as e:
            out["error"] = e

    t = threading.Thread(target=work)
    t.start()
    time.sleep(delay)
    m.close()
    t.join(60)
    assert not t.is_alive(), "the generation did not end after close()"
    with pytest.raises(CloverError, match="closed"):
        m.generate(PROMPT, max_tokens=2)
    return m, out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_close_from_another_thread_during_generate(mode, delay):
    m, out = _close_during(lambda m: m.generate(PROMPT, max_tokens=200, mode=mode), delay)
    if "value" in out:  # cancelled (or done before the close)
        assert m.last_stats["finish_reason"] in ("cancelled", "length", "stop")
    else:
        assert "closed" in str(out["error"])


@pytest.mark.parametrize("mode", MODES)
def test_close_from_another_thread_during_a_stream(mode):
    pieces = []

    def consume(m):
        for piece in m.generate_stream(PROMPT, max_tokens=200, mode=mode):
            pieces.append(piece)
            time.sleep(0.01)

    m, out = _close_during(consume, 0.2)
    assert "value" in out or "closed" in str(out["error"]) or "interrupted" in str(out["error"])


def test_one_model_from_eight_threads_serialises_calls(solo):
    """Whole calls (generate, generate_tokens, prefix_logits) from 8 threads at once wait for each
    other: every greedy answer equals the single-thread one."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1) as m:
        ids = m.tokenize(PROMPT)
        results, errors = [], []

        def work(k):
            try:
                mode = MODES[k % 3]
                if k % 4 == 3:
                    assert m.prefix_logits(ids).shape == (len(ids), m.n_vocab)
                results.append((mode, m.generate(PROMPT, max_tokens=24, mode=mode)))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert len(results) == 8
        for mode, text in results:
            assert text == solo[mode], mode


def test_streams_from_several_threads_interrupt_each_other_cleanly(solo):
    """Streams of one Model advanced by several threads at once: each either completes with the
    solo answer or raises CloverError naming the interruption; the model stays usable."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1) as m:
        outcomes = []

        def work(k):
            mode = MODES[k % 3]
            try:
                text = "".join(m.generate_stream(PROMPT, max_tokens=24, mode=mode))
                outcomes.append(("ok", mode, text))
            except CloverError as e:
                outcomes.append(("error", mode, str(e)))

        threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert len(outcomes) == 6
        for kind, mode, text in outcomes:
            if kind == "ok":
                assert text == solo[mode]
            else:
                assert "interrupted" in text
        assert m.generate(PROMPT, max_tokens=24, mode="ar") == solo["ar"]
