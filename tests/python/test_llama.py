"""clover_gguf.Clover: the llama-cpp-python-style API.

References: :class:`clover_gguf.Model` on the same GGUF (Clover must give its text, tokens and
statistics for the same arguments), the OpenAI response shapes, a fresh object (greedy output
after a cancel), and hand-made answers with ``<think>`` blocks for the reasoning split.
"""
import argparse
import threading
import time
import warnings

import pytest

from clover_gguf import Clover, CloverError, Model
from clover_gguf._ffi import ffi, lib
from clover_gguf.llama import ReasoningSplitter
from clover_gguf.model import Generation, _Run

N_THREADS = 2
PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"
MSGS = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return str(make_gguf("f32"))


@pytest.fixture(scope="module")
def llm(gguf_path):
    with Clover(gguf_path, n_ctx=512, n_threads=N_THREADS) as c:
        yield c


@pytest.fixture(scope="module")
def ref(gguf_path):
    with Model(gguf_path, n_ctx=512, n_threads=N_THREADS) as m:
        yield m


def _text(r):
    return r["choices"][0]["text"]


def _finish(r):
    return r["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------------------- completion
def test_completion_is_openai_shaped_and_equals_model(llm, ref, gguf_path):
    r = llm.create_completion(PROMPT, max_tokens=24)
    assert set(r) == {"id", "object", "created", "model", "choices", "usage", "timings"}
    assert r["id"].startswith("cmpl-") and r["object"] == "text_completion"
    assert isinstance(r["created"], int) and abs(r["created"] - time.time()) < 600
    assert r["model"] == gguf_path
    assert len(r["choices"]) == 1
    ch = r["choices"][0]
    assert set(ch) == {"text", "index", "logprobs", "finish_reason"}
    assert ch["index"] == 0 and ch["logprobs"] is None
    # the same generation through Model (Clover's defaults are the engine's)
    ids = ref.tokenize(PROMPT)
    toks, st = ref.generate_tokens(ids, max_tokens=24)
    assert ch["text"] == ref.generate(PROMPT, max_tokens=24) == ref.detokenize([t for t in toks if t not in ref.end_ids])
    assert ch["finish_reason"] == st["finish_reason"]
    n_completion = len([t for t in toks if t not in ref.end_ids])
    assert r["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n_completion,
                          "total_tokens": len(ids) + n_completion}
    tm = r["timings"]
    for k in ("n_forward", "n_forward_prefill", "n_forward_denoise", "n_forward_commit", "n_blocks",
              "n_generated", "n_forward_decode", "n_forward_draft", "n_forward_verify"):
        assert tm[k] == st[k], k
    assert tm["mode"] == "diffusion" and tm["n_forward_denoise"] > 0
    assert tm["tokens_per_forward"] == pytest.approx(tm["n_generated"] / tm["n_forward"])
    assert tm["seconds"] > 0 and tm["tokens_per_second"] == pytest.approx(tm["n_generated"] / tm["seconds"])
    assert tm["prompt_n"] == len(ids) and tm["predicted_n"] == n_completion
    assert tm["prompt_ms"] > 0 and tm["predicted_ms"] >= 0
    # __call__ is create_completion
    assert _text(llm(PROMPT, max_tokens=24)) == ch["text"]


def test_stream_chunks_concatenate_to_the_text(llm):
    full = llm(PROMPT, max_tokens=40)
    chunks = list(llm(PROMPT, max_tokens=40, stream=True))
    assert len(chunks) > 3  # streamed per denoising pass, not in one piece
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    for c in chunks:
        assert c["object"] == "text_completion" and c["model"] == full["model"]
        assert set(c["choices"][0]) == {"text", "index", "logprobs", "finish_reason"}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert "".join(_text(c) for c in chunks) == _text(full)
    last = chunks[-1]
    assert _text(last) == "" and _finish(last) == _finish(full)
    assert last["usage"] == full["usage"]
    assert last["timings"]["n_forward"] == full["timings"]["n_forward"]


def _ascii_window(text, n=3):
    for i in range(4, len(text) - n):
        w = text[i:i + n]
        if w.isascii() and w.strip() == w and w.isprintable():
            return w
    pytest.skip("no ASCII window in the tiny model's output")


def test_stop_strings(llm):
    text = _text(llm(PROMPT, max_tokens=48))
    stop = _ascii_window(text)
    expected = text[:text.index(stop)]
    r = llm(PROMPT, max_tokens=48, stop=[stop, "\x00never"])
    assert _text(r) == expected and _finish(r) == "stop"
    assert r["usage"]["completion_tokens"] < llm(PROMPT, max_tokens=48)["usage"]["completion_tokens"] or \
        len(expected) == len(text)
    chunks = list(llm(PROMPT, max_tokens=48, stop=stop, stream=True))
    assert "".join(_text(c) for c in chunks) == expected and _finish(chunks[-1]) == "stop"
    assert all(stop not in _text(c) for c in chunks)


def test_openai_parameter_names_map_onto_model(llm, ref):
    kw = dict(temperature=1.3, top_k=7, top_p=0.9, min_p=0.02, seed=123, presence_penalty=0.2,
              frequency_penalty=0.3, repeat_penalty=1.2)
    got = _text(llm(PROMPT, max_tokens=24, **kw))
    assert got == ref.generate(PROMPT, max_tokens=24, **kw)
    other = ref.generate(PROMPT, max_tokens=24, **{**kw, "seed": 124, "top_k": 50})
    assert got != other  # the arguments matter, so the equality above says something
    # logit_bias with OpenAI's string keys forces a token
    tok = ref.tokenize(" dict")[0]
    r = llm(PROMPT, max_tokens=6, mode="ar", logit_bias={str(tok): 100.0})
    assert _text(r) == ref.detokenize([tok] * 6) and r["timings"]["mode"] == "ar"
    # diffusion settings per call: threshold 1.0 fills one slot per denoising pass, a tiny one
    # every masked slot at once
    no_end = {t: -100.0 for t in ref.end_ids}
    loose = llm(PROMPT, max_tokens=16, block_size=8, threshold=1e-6, logit_bias=no_end)["timings"]
    strict = llm(PROMPT, max_tokens=16, block_size=8, threshold=1.0, logit_bias=no_end)["timings"]
    assert loose["n_forward_denoise"] == loose["n_blocks"] < strict["n_forward_denoise"]


@pytest.mark.parametrize("kw, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"max_tokens": "x"}, "max_tokens"),
    ({"stop": [""]}, r"stop\[0\]"), ({"logit_bias": {"x": 1}}, "logit_bias"), ({"mode": "foo"}, "mode"),
    ({"suffix": "x"}, "suffix"), ({"logprobs": 21}, "logprobs"), ({"threshold": 2.0}, "threshold"),
])
def test_bad_arguments_raise_at_call_time(llm, kw, field):
    with pytest.raises(ValueError, match=field):
        llm(PROMPT, **kw)
    with pytest.raises(ValueError, match=field):
        llm(PROMPT, stream=True, **kw)  # before the first chunk is asked for


def test_echo_and_token_id_prompt(llm):
    plain = _text(llm(PROMPT, max_tokens=8))
    assert _text(llm(PROMPT, max_tokens=8, echo=True)) == PROMPT + plain
    ids = llm.tokenize(PROMPT.encode(), special=True)
    assert _text(llm(ids, max_tokens=8)) == plain


def test_max_tokens_none_runs_to_the_context_end(gguf_path):
    with Clover(gguf_path, n_ctx=48, n_threads=N_THREADS, mode="ar") as c:
        r = c(PROMPT, max_tokens=None, presence_penalty=0, repeat_penalty=1,
              logit_bias={t: -100.0 for t in c._model.end_ids})
        assert _finish(r) == "length"
        assert r["usage"]["total_tokens"] == 48


# ---------------------------------------------------------------------------------- tokens
def test_tokenize_detokenize(llm, ref):
    text = "<|im_start|>user\nhi<|im_end|>"
    assert llm.tokenize(text.encode()) == ref.tokenize(text, special=False) == llm.tokenize(text)
    sp = llm.tokenize(text.encode(), special=True)
    assert sp == ref.tokenize(text, special=True) and len(sp) < len(llm.tokenize(text))
    assert llm.detokenize(sp, special=True) == text.encode()
    assert llm.detokenize(sp) == b"user\nhi"  # control tokens dropped without special
    assert isinstance(llm.detokenize([]), bytes)
    with pytest.raises(ValueError, match="tokens"):
        llm.detokenize([llm.n_vocab()])


# ---------------------------------------------------------------------------------- chat
def _split_all(text, think_open):
    s = ReasoningSplitter(think_open)
    parts = s.push(text) + s.flush()
    return ("".join(t for k, t in parts if k == "reasoning"), "".join(t for k, t in parts if k == "content"))


@pytest.mark.parametrize("text, think_open, reasoning, content", [
    ("Let me add.\n</think>\n\nThe answer is 4.", True, "Let me add.", "The answer is 4."),
    ("<think>\nhidden  \n</think>\n\nvisible\n", False, "hidden", "visible\n"),
    ("plain answer", False, "", "plain answer"),
    ("a <thinking> word", False, "", "a <thinking> word"),
    ("still thinking <thi", True, "still thinking <thi", ""),
    ("x</think>y<think>z</think>w", True, "xz", "yw"),
    ("<think></think>\n\nonly content", False, "", "only content"),
])
def test_reasoning_splitter(text, think_open, reasoning, content):
    assert _split_all(text, think_open) == (reasoning, content)
    # any chunking gives the same result: every two-piece split and one character at a time
    for cut in range(len(text) + 1):
        s = ReasoningSplitter(think_open)
        parts = s.push(text[:cut]) + s.push(text[cut:]) + s.flush()
        assert ("".join(t for k, t in parts if k == "reasoning"),
                "".join(t for k, t in parts if k == "content")) == (reasoning, content), cut
    s = ReasoningSplitter(think_open)
    parts = [p for ch in text for p in s.push(ch)] + s.flush()
    assert ("".join(t for k, t in parts if k == "reasoning"),
            "".join(t for k, t in parts if k == "content")) == (reasoning, content)


def _fake_generation(monkeypatch, llm, pieces, seen):
    """Replace the Model's generation by fixed text pieces (the prompt ids are recorded)."""
    m = llm._model

    def fake_stream(ids, **kw):
        seen.append(list(ids))
        run = _Run()

        def gen():
            yield from ((piece, [], None) for piece in pieces)
            run.stats = {"n_prompt": len(ids), "tokens": m.tokenize("".join(pieces)), "seconds": 0.5,
                         "prefill_seconds": 0.1, "finish_reason": "stop", "n_forward": 3,
                         "n_forward_prefill": 1, "tokens_per_forward": 1.0, "mode": kw["mode"]}
        return Generation(m, run, gen())

    monkeypatch.setattr(m, "generate_pieces", fake_stream)


@pytest.mark.parametrize("enable_thinking, pieces, reasoning, content, prompt_end", [
    (None, ["Two plus", " two.\n</th", "ink>\n\n", "It is 4."], "Two plus two.", "It is 4.", "<think>\n"),
    (True, ["Two plus two.</think>4"], "Two plus two.", "4", "<think>\n"),
    (False, ["<think>\nsecret\n</think>\n\n", "It is 4."], "secret", "It is 4.", "<think>\n\n</think>\n\n"),
    (False, ["It is", " 4."], None, "It is 4.", "<think>\n\n</think>\n\n"),
])
def test_chat_separates_reasoning_content(monkeypatch, llm, enable_thinking, pieces, reasoning, content,
                                          prompt_end):
    seen = []
    _fake_generation(monkeypatch, llm, pieces, seen)
    r = llm.create_chat_completion(MSGS, enable_thinking=enable_thinking)
    assert llm.detokenize(seen[-1], special=True).decode().endswith("<|im_start|>assistant\n" + prompt_end)
    assert set(r) == {"id", "object", "created", "model", "choices", "usage", "timings"}
    assert r["id"].startswith("chatcmpl-") and r["object"] == "chat.completion"
    ch = r["choices"][0]
    assert set(ch) == {"index", "message", "logprobs", "finish_reason"} and ch["finish_reason"] == "stop"
    assert ch["message"] == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    assert r["usage"]["prompt_tokens"] == len(seen[-1])
    chunks = list(llm.create_chat_completion(MSGS, enable_thinking=enable_thinking, stream=True))
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
    assert all(len(d) == 1 and ("content" in d or "reasoning_content" in d) for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == (reasoning or "")
    assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"] == r["usage"]


def test_chat_end_to_end(llm, ref):
    for enable_thinking in (None, False):
        kw = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        prompt = ref.apply_chat_template(MSGS, **kw)
        raw = ref.generate(prompt, max_tokens=24)
        r = llm.create_chat_completion(MSGS, max_tokens=24, enable_thinking=enable_thinking)
        reasoning, content = _split_all(raw, think_open=enable_thinking is None)
        msg = r["choices"][0]["message"]
        assert (msg["reasoning_content"] or "", msg["content"]) == (reasoning, content)
        assert r["usage"]["prompt_tokens"] == len(ref.tokenize(prompt))
        chunks = list(llm.create_chat_completion(MSGS, max_tokens=24, enable_thinking=enable_thinking,
                                                 stream=True))
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content", "") for d in deltas) == msg["content"]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == (msg["reasoning_content"] or "")
        assert chunks[-1]["choices"][0]["finish_reason"] == r["choices"][0]["finish_reason"]


# ---------------------------------------------------------------------------------- cancel
def _long_prompt(c, n):
    ids = c.tokenize(open(argparse.__file__).read().encode())
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def test_cancel_during_a_long_prompt(gguf_path):
    with Clover(gguf_path, n_ctx=4096, n_threads=N_THREADS) as c:
        ids = _long_prompt(c, 3000)
        full = c(ids, max_tokens=1)
        assert _finish(full) == "length"
        answered = []
        timer = threading.Timer(0.05, lambda: answered.append(c.cancel()))
        timer.start()
        r = c(ids[::-1], max_tokens=1)  # shares no prefix with `ids`: nothing to reuse
        timer.join()
        assert answered == [True]
        assert _finish(r) == "cancelled" and _text(r) == ""
        assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == 3000
        assert r["timings"]["n_forward_prefill"] == 0
        # the prefill stopped at a layer boundary: no prefill forward completed (counts, not
        # wall time: no timing asserts on shared machines)
        assert r["timings"]["n_forward"] == 0
        # the object works afterwards, with the output of a fresh object
        after = c(PROMPT, max_tokens=24)
        assert _finish(after) != "cancelled"
        assert c.cancel() is False  # nothing running: nothing happens
        again = c(PROMPT, max_tokens=24)
    with Clover(gguf_path, n_ctx=4096, n_threads=N_THREADS) as fresh:
        assert _text(after) == _text(again) == _text(fresh(PROMPT, max_tokens=24))


def test_cancel_a_stream_between_chunks_keeps_the_text(llm):
    full = _text(llm(PROMPT, max_tokens=48, mode="ar"))
    it = llm(PROMPT, max_tokens=48, mode="ar", stream=True)
    got = [next(it) for _ in range(3)]
    th = threading.Thread(target=lambda: got.append(llm.cancel()))
    th.start()
    th.join()
    assert got.pop() is True
    got += list(it)
    text = "".join(_text(c) for c in got)
    assert _finish(got[-1]) == "cancelled"
    assert 0 < len(text) < len(full) and full.startswith(text)
    assert got[-1]["usage"]["completion_tokens"] < 48
    assert _text(llm(PROMPT, max_tokens=48, mode="ar")) == full


def test_cancel_during_decoding(llm):
    kw = dict(max_tokens=200, mode="ar", logit_bias={t: -100.0 for t in llm._model.end_ids})
    full = llm(PROMPT, **kw)
    assert _finish(full) == "length"
    answered = []

    def cancel_once_decoding():  # (the tiny model decodes 200 tokens in well under a second)
        while llm._model._active is None:  # the prompt prefill is done once the decoder exists
            time.sleep(0.001)
        answered.append(llm.cancel())

    th = threading.Thread(target=cancel_once_decoding)
    th.start()
    r = llm(PROMPT, **kw)
    th.join()
    assert answered == [True]
    assert _finish(r) == "cancelled"
    assert r["usage"]["completion_tokens"] < 200 and r["timings"]["n_forward_prefill"] == 1
    assert _text(full).startswith(_text(r))


# ---------------------------------------------------------------------------------- threads
def test_two_threads_on_one_object(llm):
    prompts = [PROMPT, "class Parser:\n    def __init__(self"]
    expected = [_text(llm(p, max_tokens=24)) for p in prompts]
    results, errors = {}, []
    start = threading.Barrier(2)

    def plain(k):
        try:
            start.wait()
            results[k] = [_text(llm(prompts[0], max_tokens=24)) for _ in range(3)]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def streamed(k):
        try:
            start.wait()
            results[k] = ["".join(_text(c) for c in llm(prompts[1], max_tokens=24, stream=True))
                          for _ in range(3)]
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=plain, args=(0,)), threading.Thread(target=streamed, args=(1,))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(300)
    assert not errors, errors
    assert results == {0: [expected[0]] * 3, 1: [expected[1]] * 3}


def test_unfinished_stream_in_the_same_thread_raises_instead_of_deadlocking(llm):
    it = llm(PROMPT, max_tokens=24, stream=True)
    first = next(it)
    assert first["choices"][0]["finish_reason"] is None
    with pytest.raises(RuntimeError, match="stream"):
        llm(PROMPT, max_tokens=4)
    it.close()  # releases the lock
    assert _finish(llm(PROMPT, max_tokens=4)) in ("stop", "length")


def test_waiting_call_runs_after_a_stream_of_another_thread(llm):
    it = llm(PROMPT, max_tokens=24, stream=True)
    next(it)
    out = []
    th = threading.Thread(target=lambda: out.append(_text(llm(PROMPT, max_tokens=8))))
    th.start()
    time.sleep(0.3)
    assert th.is_alive() and not out  # waits for the stream holding the lock
    rest = list(it)
    th.join(60)
    assert out == [_text(llm(PROMPT, max_tokens=8))] and rest


# ---------------------------------------------------------------------------------- lifetime
def test_close_twice_and_calls_after_close(gguf_path):
    c = Clover(gguf_path, n_ctx=256, n_threads=N_THREADS)
    pending = c(PROMPT, max_tokens=8, stream=True)  # created, not started
    running = c(PROMPT, max_tokens=24, stream=True)
    next(running)
    c.close()  # ends the running stream, frees the model
    c.close()
    assert list(running) == []
    assert c.cancel() is False
    for call in (lambda: c(PROMPT), lambda: c.create_chat_completion(MSGS), lambda: c.tokenize(b"x"),
                 lambda: c.detokenize([1]), lambda: next(pending),
                 lambda: c.create_completion(PROMPT, stream=True)):
        with pytest.raises(CloverError, match="closed"):
            call()
    assert "closed" in repr(c)
    with Clover(gguf_path, n_ctx=256, n_threads=N_THREADS) as d:
        assert _finish(d(PROMPT, max_tokens=4)) in ("stop", "length")
    with pytest.raises(CloverError, match="closed"):
        d(PROMPT)


def test_close_from_another_thread_cancels_the_running_call(gguf_path):
    c = Clover(gguf_path, n_ctx=4096, n_threads=N_THREADS)
    ids = _long_prompt(c, 3000)
    out = []
    th = threading.Thread(target=lambda: out.append(c(ids, max_tokens=1)))
    th.start()
    time.sleep(0.1)
    c.close()
    th.join(60)
    assert not th.is_alive()  # a hang guard, not a timing measurement
    assert len(out) == 1 and _finish(out[0]) == "cancelled"


# ---------------------------------------------------------------------------------- constructor
def test_constructor_settings_and_n_gpu_layers(gguf_path, ref):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # n_gpu_layers=0 (the default) warns nothing
        with Clover(gguf_path, n_ctx=256, n_threads=N_THREADS, n_gpu_layers=0, mode="ar", seed=5) as c:
            r = c(PROMPT, max_tokens=8)
            assert r["timings"]["mode"] == "ar" and c.n_ctx() == 256 and c.n_vocab() == ref.n_vocab
            assert _text(r) == ref.generate(PROMPT, max_tokens=8, mode="ar")
            s = c(PROMPT, max_tokens=8, temperature=1.0)  # constructor seed 5 by default
            assert _text(s) == ref.generate(PROMPT, max_tokens=8, mode="ar", temperature=1.0, seed=5)
            assert c(PROMPT, max_tokens=8, mode="diffusion")["timings"]["mode"] == "diffusion"
    info = ffi.new("char[]", 256)
    if lib.clover_gpu_devices(info, 256) <= 0:  # no GPU (or a build without CUDA): a warning, the CPU
        with pytest.warns(UserWarning, match="running on the CPU"):
            c = Clover(gguf_path, n_ctx=256, n_threads=N_THREADS, n_gpu_layers=-1, block_size=8, threshold=0.5)
        assert c._model.n_gpu_layers == 0
    else:  # (tests/native/test_cuda.py compares the GPU path with the CPU)
        c = Clover(gguf_path, n_ctx=256, n_threads=N_THREADS, n_gpu_layers=-1, block_size=8, threshold=0.5)
        assert c._model.n_gpu_layers == c._model.hparams["n_layer"] + 1
    with c:
        assert c.n_gpu_layers == -1
        r = c(PROMPT, max_tokens=16)
        if c._model.n_gpu_layers == 0:
            assert _text(r) == ref.generate(PROMPT, max_tokens=16, block_size=8, threshold=0.5)
    with pytest.raises(ValueError, match="n_gpu_layers"):
        Clover(gguf_path, n_gpu_layers="all")
    with pytest.raises(ValueError, match="threshold"):
        Clover(gguf_path, n_ctx=64, threshold=1.5)
    with pytest.raises(ValueError, match="seed"):
        Clover(gguf_path, n_ctx=64, seed=-2)
    with pytest.raises(CloverError):
        Clover(gguf_path + ".missing")


# ---------------------------------------------------------------------------------- native abort
def test_native_abort_is_one_shot_and_reset_discards_it(ref):
    """clover_context_abort (clover.h): the next forward stops with CLOVER_E_ABORTED and
    consumes the request; an aborted prefill leaves empty caches; clover_context_reset (and so
    clover_decoder_new) discards a pending request; the logits afterwards are unchanged."""
    from clover_gguf._ffi import err_buf, ffi, lib

    ids = ref.tokenize(PROMPT)
    want = ref.prefix_logits(ids)
    ctx = ref._ctx
    toks = ffi.new("int32_t[]", ids)
    err = err_buf()
    lib.clover_context_reset(ctx)
    assert lib.clover_prefill(ctx, toks, 4, ffi.NULL, 0, err, len(err)) == 0
    assert lib.clover_context_n_past(ctx) == 4
    lib.clover_context_abort(ctx)
    rc = lib.clover_prefill(ctx, toks + 4, len(ids) - 4, ffi.NULL, 0, err, len(err))
    assert rc == lib.CLOVER_E_ABORTED == -6
    assert ffi.string(err).decode().startswith("aborted by clover_context_abort before layer 0 of")
    assert lib.clover_context_n_past(ctx) == 0  # a failed prefill leaves no cache
    # consumed: the next forward runs
    assert lib.clover_prefill(ctx, toks, len(ids), ffi.NULL, 0, err, len(err)) == 0
    # a block forward stops too and leaves the caches as they were
    lib.clover_context_abort(ctx)
    mask = ffi.new("int32_t[]", [ref.hparams["mask_token_id"]] * 4)
    out = ffi.new("float[]", 4 * ref.n_vocab)
    assert lib.clover_block_forward(ctx, mask, 4, 1.0, out, ffi.NULL, err, len(err)) == lib.CLOVER_E_ABORTED
    assert lib.clover_context_n_past(ctx) == len(ids)
    # reset discards a pending request
    lib.clover_context_abort(ctx)
    lib.clover_context_reset(ctx)
    assert (ref.prefix_logits(ids) == want).all()
