"""Runtime guards: impossible arguments are refused with an error
naming the field, in the API (:class:`Model`, :class:`Clover`: ValueError), the CLI (exit code 2,
``error: ...`` or argparse's message on stderr) and the server (HTTP 400, OpenAI-shaped error
with the field in ``param``), never a crash, a hang or a 500.

The model is the embedded clover-tiny (no torch, no conversion). Reference for every case: the
field name the issue and OpenAI / HF use (``max_tokens``, ``top_k``, ``temperature``, ...).
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

from clover_gguf import DEFAULT_MODEL, Clover, Model

_ROOT = pathlib.Path(__file__).resolve().parents[2]
N_CTX = 64
NAN, INF = float("nan"), float("inf")

# (keyword arguments, the field the error must name): shared by Model, Clover and the server
GEN_CASES = [
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(temperature=NAN), "temperature"),
    (dict(temperature=INF), "temperature"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(top_p=NAN), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(min_p=NAN), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=-4), "block_size"),
    (dict(threshold=0.0), "threshold"),
    (dict(threshold=-0.5), "threshold"),
    (dict(threshold=1.5), "threshold"),
    (dict(threshold=NAN), "threshold"),
    (dict(coreset_top_p=0.0), "coreset_top_p"),
    (dict(coreset_top_p=1.5), "coreset_top_p"),
    (dict(repeat_penalty=0.0), "repeat_penalty"),
    (dict(repeat_penalty=-1.0), "repeat_penalty"),
    (dict(presence_penalty=NAN), "presence_penalty"),
    (dict(frequency_penalty=INF), "frequency_penalty"),
    (dict(seed=-5), "seed"),
    (dict(mode="beam"), "mode"),
    (dict(logit_bias={5000: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(stop=[""]), "stop"),
]
_IDS = [f"{f}={next(iter(kw.values()))!r}" for kw, f in GEN_CASES]


def _names(msg: str, field: str) -> bool:
    """The message starts with the field (``top_k: ...``, ``prompt[2]: ...``)."""
    return msg.startswith(field + ":") or msg.startswith(field + "[") or msg.startswith(field + " ")


@pytest.fixture(scope="module")
def model():
    with Model(DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def llm():
    with Clover(DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1) as c:
        yield c


# ---------------------------------------------------------------------------- API: Model
@pytest.mark.parametrize("kw, field", GEN_CASES, ids=_IDS)
def test_model_refuses(model, kw, field):
    for call in (lambda: model.generate("def f():", **kw),
                 lambda: model.generate_stream("def f():", **kw),  # at call time, not at next()
                 lambda: model.generate_tokens([1, 2, 3], **kw),
                 lambda: model.check_generate_args(**kw)):
        with pytest.raises(ValueError) as ei:
            call()
        assert _names(str(ei.value), field), str(ei.value)
    assert model.generate("def f():", max_tokens=2) is not None  # still usable


@pytest.mark.parametrize("n", [-1, 0])
def test_model_refuses_max_tokens_below_one(model, n):
    """Model counts tokens (Clover's 0 and -1 mean "until the context is full")."""
    with pytest.raises(ValueError, match="max_tokens"):
        model.generate("def f():", max_tokens=n)


@pytest.mark.parametrize("bad", [-1, 1024, 10**9])
def test_model_token_id_out_of_range(model, bad):
    assert model.n_vocab == 1024
    with pytest.raises(ValueError, match=rf"^prompt\[1\]: token id {bad} out of range \[0, 1024\)"):
        model.generate([5, bad, 7], max_tokens=2)
    with pytest.raises(ValueError, match=rf"^prompt_ids\[0\]: token id {bad} out of range \[0, 1024\)"):
        model.generate_tokens([bad], max_tokens=2)
    with pytest.raises(ValueError, match=rf"^ids\[2\]: token id {bad} out of range \[0, 1024\)"):
        model.detokenize([1, 2, bad])
    with pytest.raises(ValueError, match=rf"^ids\[0\]: token id {bad} out of range"):
        model.prefix_logits([bad])
    with pytest.raises(ValueError, match=rf"^block_ids\[0\]: token id {bad} out of range"):
        model.block_logits([1], [bad])
    with pytest.raises(ValueError, match=rf"^end_ids\[0\]: token id {bad} out of range"):
        model.generate_tokens([1], max_tokens=2, end_ids=[bad])


@pytest.mark.parametrize("bad", [1.5, True, "7", None])
def test_model_token_id_not_an_integer(model, bad):
    with pytest.raises(ValueError, match=r"^prompt\[1\]: expected an integer token id"):
        model.generate([5, bad], max_tokens=2)
    with pytest.raises(ValueError, match=r"^ids\[0\]: expected an integer token id"):
        model.detokenize([bad])


def test_model_empty_prompt(model):
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        model.generate("", max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        model.generate([], max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt_ids: empty"):
        model.generate_tokens([], max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt: not valid Unicode"):
        model.generate("a\ud800", max_tokens=2)


def test_model_prompt_longer_than_context(model):
    with pytest.raises(ValueError, match=rf"^prompt: {N_CTX} tokens leave no room in n_ctx={N_CTX}"):
        model.generate([1] * N_CTX, max_tokens=2)
    with pytest.raises(ValueError, match=rf"^prompt: {N_CTX + 10} tokens .*n_ctx={N_CTX}"):
        model.generate_tokens([1] * (N_CTX + 10), max_tokens=2)
    with pytest.raises(ValueError, match=rf"^ids: {N_CTX + 1} tokens do not fit n_ctx={N_CTX}"):
        model.prefix_logits([1] * (N_CTX + 1))


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_prompt_plus_max_tokens_beyond_context_stops_at_length(model, mode):
    """Not an error: generation ends when the context is full, finish_reason "length"."""
    prompt = model.tokenize("def parse(text):\n")
    ids, st = model.generate_tokens(prompt, max_tokens=1000, mode=mode, end_ids=[])
    assert st["finish_reason"] == "length"
    # the last token is sampled from the logits of position n_ctx - 1 and never stored: +1
    assert 0 < len(ids) and len(prompt) + st["n_generated"] <= N_CTX + 1, (len(prompt), st["n_generated"])


@pytest.mark.parametrize("kw, field", [(dict(n_ctx=-8), "n_ctx"),
                                       (dict(n_ctx=1.5), "n_ctx"), (dict(n_threads=-1), "n_threads"),
                                       (dict(n_threads=2.0), "n_threads")])
def test_model_constructor_refuses(kw, field):
    with pytest.raises(ValueError) as ei:
        Model(DEFAULT_MODEL, **kw)
    assert _names(str(ei.value), field), str(ei.value)
    with pytest.raises(ValueError) as ei:
        Clover(DEFAULT_MODEL, **kw)
    assert _names(str(ei.value), field), str(ei.value)


@pytest.mark.parametrize("kw, field", [(dict(block_size=0), "block_size"), (dict(threshold=1.5), "threshold"),
                                       (dict(threshold=NAN), "threshold"), (dict(coreset_top_p=0.0), "coreset_top_p"),
                                       (dict(mode="beam"), "mode"), (dict(seed=-2), "seed")])
def test_clover_constructor_refuses(kw, field):
    with pytest.raises(ValueError) as ei:
        Clover(DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1, **kw)
    assert _names(str(ei.value), field), str(ei.value)


# ---------------------------------------------------------------------------- API: Clover
@pytest.mark.parametrize("kw, field", GEN_CASES, ids=_IDS)
def test_clover_refuses(llm, kw, field):
    msgs = [{"role": "user", "content": "hi"}]
    for call in (lambda: llm.create_completion("def f():", **kw),
                 lambda: llm.create_completion("def f():", stream=True, **kw),  # at call time
                 lambda: llm("def f():", **kw),
                 lambda: llm.create_chat_completion(msgs, **kw),
                 lambda: llm.create_chat_completion(msgs, stream=True, **kw),
                 lambda: llm.check_args(**kw)):
        with pytest.raises(ValueError) as ei:
            call()
        assert _names(str(ei.value), field), str(ei.value)
    assert llm.create_completion("def f():", max_tokens=2)["choices"][0]["finish_reason"]  # still usable


def test_clover_tokens_and_prompts(llm):
    with pytest.raises(ValueError, match=r"^prompt\[1\]: token id 1024 out of range \[0, 1024\)"):
        llm.create_completion([1, 1024], max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt\[0\]: token id -3 out of range"):
        llm.create_completion([-3], max_tokens=2, stream=True)
    with pytest.raises(ValueError, match=r"^tokens\[1\]: token id 4096 out of range \[0, 1024\)"):
        llm.detokenize([1, 4096])
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        llm.create_completion("", max_tokens=2)
    with pytest.raises(ValueError, match=r"^prompt: empty"):
        llm.create_completion([], max_tokens=2)
    with pytest.raises(ValueError, match=rf"^prompt: \d+ tokens leave no room in n_ctx={N_CTX}"):
        llm.create_completion("x = 1\n" * 100, max_tokens=2)
    with pytest.raises(ValueError, match=rf"^messages \(rendered by the chat template\): \d+ tokens leave no room in n_ctx={N_CTX}"):
        llm.create_chat_completion([{"role": "user", "content": "x = 1\n" * 100}])
    with pytest.raises(ValueError, match=r"^chat_template_kwargs: expected a dict"):
        llm.create_chat_completion([{"role": "user", "content": "a"}], chat_template_kwargs=5)
    # max_tokens 0, -1 / None: until the context is full (llama-cpp-python), not an error
    for n in (0, -1, None):
        r = llm.create_completion("def f():", max_tokens=n, logit_bias={t: -100.0 for t in llm.engine.end_ids})
        assert r["choices"][0]["finish_reason"] == "length"
        assert 16 < r["usage"]["completion_tokens"] and r["usage"]["total_tokens"] <= N_CTX


# ---------------------------------------------------------------------------- CLI
def _cli(*args, stdin: str | None = None):
    """``clover-gguf ARGS`` in a subprocess; ``stdin``: text to pipe in (else /dev/null)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-m", "clover_gguf.cli", *args], input=stdin,
                          stdin=subprocess.DEVNULL if stdin is None else None, capture_output=True,
                          text=True, env=env, cwd=str(_ROOT), timeout=120)


_RUN = ("run", "-p", "def f():", "-c", str(N_CTX), "-t", "1", "-n", "4")
CLI_CASES = [
    # (extra arguments of `run`, a string stderr must hold: the API field or argparse's flag)
    (("--temp", "nan"), "temperature"),
    (("--temp", "inf"), "temperature"),
    (("--temp", "-1"), "temperature"),
    (("--top-k", "-1"), "--top-k"),
    (("--top-p", "1.5"), "top_p"),
    (("--top-p", "nan"), "top_p"),
    (("--min-p", "2"), "min_p"),
    (("--block-size", "0"), "--block-size"),
    (("--threshold", "0"), "threshold"),
    (("--threshold", "1.5"), "threshold"),
    (("--threshold", "nan"), "threshold"),
    (("--coreset-top-p", "0"), "coreset_top_p"),
    (("--repeat-penalty", "0"), "repeat_penalty"),
    (("-n", "-2"), "--n-predict"),  # -1 is "no limit"
    (("-n", "0"), "--n-predict"),
    (("-c", "-1"), "--ctx-size"),
    (("-t", "-1"), "--threads"),
    (("--seed", "-2"), "--seed"),
    (("--logit-bias", "5000=1"), "logit_bias: token id 5000 out of range [0, 1024)"),
    (("--stop", ""), "stop"),
    (("-p", ""), "prompt: empty"),
    (("-p", "x = 1\n" * 100), f"n_ctx={N_CTX}"),
]


@pytest.mark.parametrize("extra, field", CLI_CASES, ids=[" ".join(e)[:30] for e, _ in CLI_CASES])
def test_cli_run_exit_2(extra, field):
    r = _cli(*_RUN, *extra)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert field in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") or last.startswith("clover-gguf run: error:"), last
    assert r.stdout == ""  # nothing generated


@pytest.mark.parametrize("extra, field", [(("--temp", "nan"), "temperature"), (("--top-p", "0"), "top_p"),
                                          (("--threshold", "2"), "threshold"), (("--block-size", "0"), "--block-size"),
                                          (("--min-p", "-1"), "min_p"), (("-c", "-1"), "--ctx-size")])
def test_cli_chat_exit_2_before_first_prompt(extra, field):
    # stdin holds a message: a chat that did not refuse the flags would answer it and exit 0
    r = _cli("chat", "-m", DEFAULT_MODEL, "-t", "1", "-c", str(N_CTX), *extra, stdin="hello\n")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert field in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""


@pytest.mark.parametrize("tokens, msg", [("5,1024", "ids[1]: token id 1024 out of range [0, 1024)"),
                                         ("-1", "ids[0]: token id -1 out of range"),
                                         (",".join(["1"] * (N_CTX + 1)), f"--ctx-size {N_CTX}")])
def test_cli_logits_token_ids(tmp_path, tokens, msg):
    out = tmp_path / "l.npy"
    r = _cli("logits", "-m", DEFAULT_MODEL, "-t", "1", "-c", str(N_CTX), "--tokens", tokens, "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr and not out.exists()


# ---------------------------------------------------------------------------- server
def _load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", _ROOT / "bench" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    lt = _load_test_module()
    log = tmp_path_factory.mktemp("guards") / "server.log"
    proc, base = lt.start_server(DEFAULT_MODEL, n_ctx=N_CTX, threads=1, log_path=str(log))
    try:
        yield lt, base
    finally:
        lt.stop_server(proc)


def _post(server, path, body):
    lt, base = server
    status, raw = lt.request(base, "POST", path, body if isinstance(body, bytes) else
                             json.dumps(body).encode(), timeout=120)
    return status, json.loads(raw) if raw else None


def _assert_400(status, body, field):
    assert status == 400, (status, body)
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == field, err
    assert field in err["message"], err


def _jsonable(kw):
    # JSON has no NaN/Infinity literal in the standard; Python's json (client and server) accepts them
    return {k: ({str(i): v for i, v in val.items()} if k == "logit_bias" else val) for k, val in kw.items()}


@pytest.mark.parametrize("kw, field", GEN_CASES, ids=_IDS)
def test_server_400(server, kw, field):
    kw = _jsonable(kw)
    for stream in (False, True):
        status, body = _post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 4,
                                                         "stream": stream, **kw})
        _assert_400(status, body, field)
        status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 4, "stream": stream, **kw})
        _assert_400(status, body, field)


SERVER_PROMPT_CASES = [
    ({"prompt": [1, 1024]}, "prompt", "prompt[1]: token id 1024 out of range [0, 1024)"),
    ({"prompt": [-1]}, "prompt", "token id -1 out of range"),
    ({"prompt": [[5, 2000]]}, "prompt", "token id 2000"),
    ({"prompt": [1.5]}, "prompt", "token ids"),
    ({"prompt": ""}, "prompt", "empty"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "a\ud800"}, "prompt", "not valid Unicode"),
    ({"prompt": [1] * N_CTX}, "prompt", f"n_ctx={N_CTX}"),
    ({"prompt": "x = 1\n" * 100}, "prompt", f"n_ctx={N_CTX}"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens", "integer"),
    ({"prompt": "a", "mode": []}, "mode", "not one of"),
    ({"prompt": "a", "stop": 5}, "stop", "expected"),
    ({"prompt": "a", "n": 2}, "n", "only 1"),
]


@pytest.mark.parametrize("body, field, msg", SERVER_PROMPT_CASES, ids=[c[2][:25] for c in SERVER_PROMPT_CASES])
def test_server_prompt_400(server, body, field, msg):
    status, out = _post(server, "/v1/completions", body)
    _assert_400(status, out, field)
    assert msg in out["error"]["message"]


def test_server_chat_and_malformed_400(server):
    status, body = _post(server, "/v1/chat/completions",
                         {"messages": [{"role": "user", "content": "x = 1\n" * 100}], "max_tokens": 4})
    _assert_400(status, body, "messages")
    assert body["error"]["code"] == "context_length_exceeded"
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                          "max_completion_tokens": -2})
    _assert_400(status, body, "max_tokens")
    status, body = _post(server, "/v1/completions", {"prompt": "a", "max_tokens": -1})  # OpenAI's rule
    _assert_400(status, body, "max_tokens")
    status, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                          "chat_template_kwargs": 5})
    _assert_400(status, body, "chat_template_kwargs")
    for raw in (b'{"prompt": "a", ', b"not json", b'{"prompt": "\xff"}'):
        status, body = _post(server, "/v1/completions", raw)
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
    # the server is still healthy and answers a valid request after all refusals
    status, body = _post(server, "/v1/completions", {"prompt": "def f():", "max_tokens": 4, "temperature": 0})
    assert status == 200 and isinstance(body["choices"][0]["text"], str)
    lt, base = server
    m = lt.metrics(base)
    assert m["clover_requests_active"] == 0 and m["clover_requests_queued"] == 0
    assert not any(k.startswith("clover_requests_total") and 'status="500"' in k for k in m)
    assert math.isfinite(m["clover_model_loaded"]) and m["clover_model_loaded"] == 1
