"""``clover-gguf serve`` (clover_gguf/server.py) through the official ``openai``
client: a server started in a subprocess on a free loopback port with the tiny random model.

Reference: :class:`clover_gguf.Clover` in this process (the same model, greedy settings), and
for streams the non-streamed answer of the same request. Skipped when fastapi, uvicorn,
or openai are not installed (``pip install -e '.[test]'``).
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

for _mod in ("fastapi", "uvicorn", "openai"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install -e '.[test]')")

import asyncio  # noqa: E402
import http.client  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

import openai  # noqa: E402
from serverproc import HANG, ROOT as _ROOT, http as _http, metrics as _metrics, serving  # noqa: E402

KEY = "test-key-123"
N_CTX = 4096


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return str(make_gguf("f32"))


@pytest.fixture(scope="module")
def server(gguf_path, tmp_path_factory):
    """Base URL of a server with --api-key KEY; the log goes to a file shown on failure."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with serving(gguf_path, ["--api-key", KEY, "-c", N_CTX, "-t", 1], log) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=HANG, max_retries=0)


@pytest.fixture(scope="module")
def local(gguf_path):
    """The same model in this process: the reference answers."""
    from clover_gguf import Clover

    with Clover(gguf_path, n_ctx=N_CTX, n_threads=1) as c:
        yield c


def _model_id(client) -> str:
    return client.models.list().data[0].id


def test_models_and_health(server, client, gguf_path):
    assert _http("GET", f"{server}/health").json() == {"status": "ok"}
    ids = [m.id for m in client.models.list().data]
    assert ids == [os.path.basename(gguf_path)]


def test_completion_equals_api(client, local):
    r = client.completions.create(model=_model_id(client), prompt="def f(", max_tokens=24, temperature=0)
    ref = local.create_completion("def f(", max_tokens=24, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["choices"][0]["text"]
    assert r.choices[0].text  # the tiny model writes something in 24 tokens
    assert r.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    assert r.usage.prompt_tokens == ref["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == ref["usage"]["completion_tokens"]


def test_chat_equals_api(client, local):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
    r = client.chat.completions.create(model=_model_id(client), messages=msgs, max_tokens=24, temperature=0,
                                       extra_body={"enable_thinking": False})
    ref = local.create_chat_completion(msgs, max_tokens=24, temperature=0, enable_thinking=False)
    assert r.object == "chat.completion"
    m = r.choices[0].message
    assert m.role == "assistant"
    assert m.content == ref["choices"][0]["message"]["content"]
    assert getattr(m, "reasoning_content", None) == ref["choices"][0]["message"]["reasoning_content"]
    assert r.choices[0].finish_reason == ref["choices"][0]["finish_reason"]
    assert r.usage.completion_tokens == ref["usage"]["completion_tokens"] > 0


def test_completion_stream(client):
    kw = dict(model=_model_id(client), prompt="import os\n", max_tokens=64, temperature=0)
    whole = client.completions.create(**kw)
    pieces, finish, usage = [], None, None
    for chunk in client.completions.create(stream=True, **kw):
        c = chunk.choices[0]
        if c.text:
            pieces.append(c.text)
        if c.finish_reason is not None:
            finish = c.finish_reason
            usage = chunk.usage
    assert len(pieces) >= 2, pieces  # committed text arrives in several chunks before the end
    assert "".join(pieces) == whole.choices[0].text
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream(client):
    kw = dict(model=_model_id(client), messages=[{"role": "user", "content": "Write a loop."}],
              max_tokens=64, temperature=0)
    whole = client.chat.completions.create(**kw)
    content, reasoning, n_text, finish = [], [], 0, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        d = chunk.choices[0].delta
        content.append(d.content or "")
        reasoning.append(getattr(d, "reasoning_content", None) or "")
        n_text += bool(d.content or getattr(d, "reasoning_content", None))
        finish = chunk.choices[0].finish_reason or finish
    m = whole.choices[0].message
    assert n_text >= 2
    assert "".join(content) == m.content
    assert "".join(reasoning) == (getattr(m, "reasoning_content", None) or "")
    assert finish == whole.choices[0].finish_reason


def test_stop_string(client):
    kw = dict(model=_model_id(client), prompt="class A:\n", max_tokens=48, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    # a printable 3-character substring from inside the greedy answer (not its start)
    i = next((i for i in range(1, len(text) - 2) if text[i:i + 3].isascii() and text[i:i + 3].isprintable()), None)
    assert i is not None, text
    stop = text[i:i + 3]
    cut = text[:text.find(stop)]
    r = client.completions.create(stop=[stop], **kw)
    assert r.choices[0].text == cut
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=stop, stream=True, **kw))
    assert streamed == cut


def test_api_key_rejected(server, client):
    bad = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", timeout=HANG, max_retries=0)
    with pytest.raises(openai.AuthenticationError) as ei:
        bad.completions.create(model="x", prompt="a", max_tokens=2)
    assert ei.value.status_code == 401
    r = _http("POST", f"{server}/v1/chat/completions",
              {"messages": [{"role": "user", "content": "a"}]})  # no key at all
    assert r.status_code == 401
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert _http("GET", f"{server}/v1/models").status_code == 401
    # the slot endpoints need the key too (llama-server's public ones are health and models alone)
    assert _http("GET", f"{server}/slots").status_code == 401
    assert _http("POST", f"{server}/slots/0?action=erase").status_code == 401
    assert _http("GET", f"{server}/slots", headers={"Authorization": f"Bearer {KEY}"}).json()[0]["id"] == 0
    # health and metrics stay open (as llama.cpp's server)
    assert _http("GET", f"{server}/health").status_code == 200


def test_malformed_requests_400(server, client):
    h = {"Authorization": f"Bearer {KEY}"}
    r = _http("POST", f"{server}/v1/completions", b'{"prompt": "a", ', h)
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]

    cases = [("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
             ("/v1/completions", {"prompt": "a", "max_tokens": 4, "top_p": 7}, "top_p"),
             ("/v1/completions", {"max_tokens": 4}, "prompt"),
             ("/v1/completions", {"prompt": [1, 2, 10**9], "max_tokens": 4}, "prompt"),
             ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
             ("/v1/chat/completions", {"messages": "hi"}, "messages"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 3}, "n")]
    for path, body, field in cases:
        r = _http("POST", f"{server}{path}", body, h)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
        assert field in r.json()["error"]["message"]
    # a bad value in a streamed request is still a plain 400, not a broken stream
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="x", prompt="a", max_tokens=4, stream=True, temperature=-1)
    assert ei.value.status_code == 400
    r = _http("GET", f"{server}/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()


def test_disconnect_mid_stream_frees_slot(server, client):
    before = _metrics(server)
    body = {"model": "x", "prompt": "def main():\n", "max_tokens": N_CTX - 64, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{server}/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    got = []
    with urllib.request.urlopen(req, timeout=HANG) as r:
        assert r.status == 200
        for line in r:
            if line.startswith(b"data: "):
                got.append(json.loads(line[6:]))
                if len(got) == 2:
                    break
        assert len(got) == 2 and got[0]["object"] == "text_completion"
        assert _metrics(server)["clover_requests_active"] == 1  # still generating
    # leaving the block closed the connection mid-stream
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(server)
        if m["clover_requests_active"] == 0:
            break
        assert time.monotonic() < deadline, f"slot still busy 30 s after the disconnect: {m}"
        time.sleep(0.1)
    assert m["clover_requests_cancelled_total"] == before.get("clover_requests_cancelled_total", 0) + 1
    # the generation stopped early: far fewer tokens than the ~4000 it was allowed
    assert m["clover_tokens_generated_total"] - before["clover_tokens_generated_total"] < N_CTX // 2
    r = client.completions.create(model="x", prompt="a", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0


def test_disconnect_while_waiting_for_whole_answer(server, client):
    """A non-streamed request whose client leaves before the answer: cancelled too."""
    before = _metrics(server)
    host, port = server.rsplit("/", 1)[1].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=HANG)
    body = {"model": "x", "prompt": "def main():\n", "max_tokens": N_CTX - 64, "temperature": 0}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while _metrics(server)["clover_requests_active"] != 1:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)
    time.sleep(0.5)  # into the generation
    conn.close()
    deadline = time.monotonic() + 30
    while (m := _metrics(server))["clover_requests_active"] != 0:
        assert time.monotonic() < deadline, f"slot still busy 30 s after the disconnect: {m}"
        time.sleep(0.1)
    assert m["clover_requests_cancelled_total"] == before["clover_requests_cancelled_total"] + 1
    assert m["clover_tokens_generated_total"] - before["clover_tokens_generated_total"] < N_CTX // 2
    r = client.completions.create(model="x", prompt="a", max_tokens=8, temperature=0)
    assert r.usage.completion_tokens > 0


def test_requests_queue(client, local):
    ref = local.create_completion("x = ", max_tokens=16, temperature=0)["choices"][0]["text"]
    out, errs = [None] * 3, []

    def go(i):
        try:
            out[i] = client.completions.create(model="x", prompt="x = ", max_tokens=16, temperature=0)
        except Exception as e:  # reported below
            errs.append(e)

    ts = [threading.Thread(target=go, args=(i,)) for i in range(3)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(HANG)
    assert not errs, errs
    assert [r.choices[0].text for r in out] == [ref] * 3


def test_metrics_counts(server):
    m = _metrics(server)
    assert m['clover_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m['clover_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    assert m["clover_tokens_generated_total"] > 0
    assert m["clover_requests_queued"] == 0 and m["clover_slots_total"] == 4  # serve's default -np


def test_health_503_while_loading(gguf_path):
    """Before the lifespan has loaded the model: /health 503, /v1 503 OpenAI-shaped."""
    from clover_gguf.server import create_app

    app = create_app(gguf_path)  # called as plain ASGI: the lifespan (the loader) does not run

    def call(method, path, body=b""):
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        msgs = [{"type": "http.request", "body": body, "more_body": False}]
        sent = []

        async def receive():
            return msgs.pop(0) if msgs else {"type": "http.disconnect"}

        async def send(m):
            sent.append(m)

        asyncio.run(app(scope, receive, send))
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))

    status, obj = call("GET", "/health")
    assert status == 503 and obj["status"] == "loading model"
    status, obj = call("POST", "/v1/completions", b'{"prompt": "a"}')
    assert status == 503 and obj["error"]["type"] == "unavailable_error"


def test_cli_imports_no_fastapi_no_torch():
    code = ("import sys, clover_gguf, clover_gguf.cli, clover_gguf.llama; clover_gguf.cli.build_parser(); "
            "bad = [m for m in ('fastapi', 'uvicorn', 'starlette', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=str(_ROOT))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 0, r.stderr


def test_tools_history_and_tool_choice(client):
    """A tool round trip's history (assistant tool_calls with JSON-string arguments, a tool
    result) renders and answers; tool_choice values that need constrained decoding are a 400."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
               {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}]
    r = client.chat.completions.create(model=_model_id(client), messages=history, tools=tools, max_tokens=4,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model_id(client), messages=history, tools=tools, max_tokens=4,
                                       tool_choice={"type": "function", "function": {"name": "undeclared"}})
    assert e.value.body["param"] == "tool_choice", e.value.body


def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frob"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=_model_id(client), messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, response_format=bad)
    assert e.value.body["param"] == "response_format", e.value.body


# ---------------------------------------------------------------------------------- embeddings
EMBED_TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox"]


def _unit(v):
    v = np.asarray(v, np.float64)
    return v / np.linalg.norm(v)


def test_embeddings_float_and_base64(client, local):
    """/v1/embeddings through the openai client: each vector is the engine's (last pooling, the
    GGUF has no pooling key) L2-normalised, as float lists, as base64 float32 (decoded here), and
    as the client's default (it asks for base64 and decodes); token-id inputs too."""
    m = local.engine
    want = [_unit(m.embed(m.tokenize(t))) for t in EMBED_TEXTS]
    n_tokens = sum(len(m.tokenize(t)) for t in EMBED_TEXTS)
    r = client.embeddings.create(model="x", input=EMBED_TEXTS, encoding_format="float")
    assert r.object == "list" and r.model == _model_id(client) and [d.index for d in r.data] == [0, 1]
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    for d, w in zip(r.data, want):
        assert d.object == "embedding" and len(d.embedding) == m.n_embd
        assert np.allclose(d.embedding, w, rtol=0, atol=1e-6) and abs(np.linalg.norm(d.embedding) - 1) <= 1e-5
    b = client.embeddings.create(model="x", input=EMBED_TEXTS, encoding_format="base64")
    for d, f in zip(b.data, r.data):
        assert isinstance(d.embedding, str)
        assert np.array_equal(np.frombuffer(base64.b64decode(d.embedding), "<f4"), np.float32(f.embedding))
    default = client.embeddings.create(model="x", input=EMBED_TEXTS[1])
    assert len(default.data) == 1 and np.array_equal(np.float32(default.data[0].embedding), np.float32(r.data[1].embedding))
    ids = [m.tokenize(t) for t in EMBED_TEXTS]
    by_ids = client.embeddings.create(model="x", input=ids, encoding_format="float", dimensions=m.n_embd)
    assert [d.embedding for d in by_ids.data] == [d.embedding for d in r.data]
    one = client.embeddings.create(model="x", input=ids[0], encoding_format="float", user="someone")
    assert len(one.data) == 1 and one.data[0].embedding == r.data[0].embedding
    assert one.usage.prompt_tokens == len(ids[0])


def test_embeddings_bad_input_is_a_400_naming_the_field(server, client, local):
    h = {"Authorization": f"Bearer {KEY}"}
    n_embd, V = local.engine.n_embd, local.n_vocab()
    cases = [({}, "input", "invalid_value"), ({"input": ""}, "input", "invalid_value"),
             ({"input": []}, "input", "invalid_value"), ({"input": ["a", 3]}, "input", "invalid_value"),
             ({"input": [[1, 2], [3, V]]}, "input", "invalid_value"), ({"input": [1.5]}, "input", "invalid_value"),
             ({"input": "a", "encoding_format": "hex"}, "encoding_format", "invalid_value"),
             ({"input": "a", "dimensions": n_embd // 2}, "dimensions", "invalid_value"),
             ({"input": "a", "dimensions": "all"}, "dimensions", "invalid_value"),
             ({"input": [1] * (N_CTX + 1)}, "input", "context_length_exceeded"),
             ({"input": ["a", [1] * (N_CTX + 1)]}, "input", "context_length_exceeded"),
             ({"input": "a\ud800"}, "input", "invalid_value"),
             ({"input": ["a"] * 2049}, "input", "invalid_value"),
             ({"input": ["a", "b" * (N_CTX * local.engine.tokenizer.max_token_bytes + 1)]}, "input",
              "context_length_exceeded")]
    for body, field, code in cases:
        r = _http("POST", f"{server}/v1/embeddings", body, h)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == code and field in err["message"], (body, err)
    with pytest.raises(openai.BadRequestError) as ei:
        client.embeddings.create(model="x", input="a", dimensions=3)
    assert ei.value.status_code == 400 and "dimensions" in str(ei.value)
    r = _http("POST", f"{server}/v1/embeddings", {"input": "a"})
    assert r.status_code == 401
    m = _metrics(server)
    assert m['clover_requests_total{endpoint="/v1/embeddings",status="400"}'] >= len(cases)


def test_embeddings_pooling_flag(gguf_path, local, tmp_path):
    """serve --pooling mean: the vectors are the normalised mean of the rows."""
    m = local.engine
    with serving(gguf_path, ["--pooling", "mean", "-c", 256, "-t", 1], tmp_path / "server.log") as (base, _):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=HANG, max_retries=0)
        r = c.embeddings.create(model="x", input=EMBED_TEXTS[0], encoding_format="float")
    want = _unit(m.embed(m.tokenize(EMBED_TEXTS[0]), pooling="mean"))
    assert np.allclose(r.data[0].embedding, want, rtol=0, atol=1e-6)
    assert not np.allclose(want, _unit(m.embed(m.tokenize(EMBED_TEXTS[0]), pooling="last")), atol=1e-3)
