"""Hostile and careless requests to ``clover-gguf serve``: request limits checked before any
expensive work, big prompts tokenized outside the slot and off the event loop, a bounded queue,
a per-request time limit, prefix reuse kept per client, memory returned after big requests.

Timing bounds here are generous on purpose (this machine is shared and noisy): they separate
"answered within a second or two" from "stalled behind a many-second job", nothing finer."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

for _mod in ("fastapi", "uvicorn"):
    pytest.importorskip(_mod, reason=f"the server tests need {_mod} (pip install -e '.[test]')")

from serverproc import HANG, ROOT, Resp, http, metrics, serving  # noqa: E402

N_CTX = 32768
MAX_BODY = 3 << 20
TIMEOUT = 6
MAX_QUEUE = 3
STALL = 3.0  # seconds: the longest /health answer allowed while a big request is handled


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return str(make_gguf("q8_0"))


@pytest.fixture(scope="module")
def served(gguf_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("limits") / "server.log"
    # one slot: a long job holds it, so the queue and its limits are what the requests meet
    args = ["-c", N_CTX, "-t", 1, "--max-body", MAX_BODY, "--max-queue", MAX_QUEUE, "--timeout", TIMEOUT,
            "--mode", "ar", "-np", 1]
    with serving(gguf_path, args, log) as (base, proc):
        yield base, proc


@pytest.fixture(scope="module")
def server(served):
    return served[0]


def _post(base, path, body, timeout=HANG, headers=None):
    return http("POST", f"{base}{path}", body, headers=headers, timeout=timeout)


def _error(r, status, code=None, param=None):
    assert r.status_code == status, (r.status_code, r.text[:500])
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    if code is not None:
        assert e["code"] == code, e
    if param is not None:
        assert e["param"] == param, e
    return e


def _health_gaps(base, until: threading.Event) -> list[float]:
    """Poll /health every 50 ms until ``until`` is set; the answer times."""
    gaps = []
    while not until.is_set():
        t0 = time.monotonic()
        assert http("GET", f"{base}/health", timeout=HANG).status_code == 200
        gaps.append(time.monotonic() - t0)
        time.sleep(0.05)
    return gaps


def _in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _send_raw(base: str, path: str, body: bytes, chunked: bool) -> Resp:
    """POST ``body`` over a plain socket (with Content-Length, or chunked without it), reading the
    answer even when the server answers and closes before the body is all sent."""
    host, port = base.rsplit("/", 1)[1].split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    head += "Transfer-Encoding: chunked\r\n\r\n" if chunked else f"Content-Length: {len(body)}\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=HANG) as sock:
        sock.sendall(head.encode())
        try:
            for k in range(0, len(body), 1 << 16):
                part = body[k:k + (1 << 16)]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
            if chunked:
                sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):  # answered before the body was all sent
            pass
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
                got = sock.recv(1 << 16)
                if not got:
                    break
                data += got
        except ConnectionResetError:
            pass
    head, _, rest = data.partition(b"\r\n\r\n")
    return Resp(int(head.split()[1]), rest[:_length(data)].decode())


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


@pytest.mark.parametrize("chunked", [False, True])
def test_body_over_max_body_is_413_before_the_model_sees_it(server, chunked):
    """Refused from Content-Length at once, or while a chunked body is read, once past the limit."""
    big = json.dumps({"prompt": "x" * (MAX_BODY + 10), "max_tokens": 1}).encode()
    e = _error(_send_raw(server, "/v1/completions", big, chunked), 413, "request_too_large")
    assert "max_body" in e["message"]
    assert metrics(server)['clover_requests_total{endpoint="/v1/completions",status="413"}'] >= 1


@pytest.fixture(scope="module")
def most_bytes(gguf_path) -> int:
    """The UTF-8 size past which a prompt cannot fit N_CTX tokens."""
    from clover_gguf.tokenizer import CloverTokenizer

    most = N_CTX * CloverTokenizer.from_gguf(gguf_path).max_token_bytes
    assert most + 1000 < MAX_BODY, "the tests' prompts must fit max_body"
    return most


def _big_text(size: int) -> str:
    """``size`` bytes of code-like ASCII text."""
    return ("def f(x):\n    return [x * 2 for _ in range(10)]  # a comment\n" * (size // 50 + 1))[:size]


def test_prompt_too_long_in_bytes_is_refused_before_tokenizing(server, most_bytes):
    """More bytes than n_ctx tokens can spell: context_length_exceeded without tokenizing."""
    body = json.dumps({"prompt": "\u00e9" * (most_bytes // 2 + 1), "max_tokens": 1}, ensure_ascii=False)
    e = _error(_post(server, "/v1/completions", body.encode()), 400, "context_length_exceeded", "prompt")
    assert "bytes cannot fit" in e["message"]


def test_a_big_prompt_does_not_stall_other_requests(server, most_bytes):
    """A prompt just under the byte bound (about 1 MB here) is tokenized in a worker thread,
    outside the slot: /health answers within STALL seconds throughout, and a small completion
    started meanwhile finishes."""
    text = _big_text(most_bytes - 100)
    done = threading.Event()
    t, out = _in_thread(lambda: _post(server, "/v1/completions", {"prompt": text, "max_tokens": 1}))
    time.sleep(0.2)
    small, small_out = _in_thread(lambda: _post(server, "/v1/completions", {"prompt": "def g(", "max_tokens": 4}))
    gaps_t, gaps = _in_thread(_health_gaps, server, done)
    t.join(HANG)
    small.join(HANG)
    done.set()
    gaps_t.join(HANG)
    _error(out["value"], 400, "context_length_exceeded", "prompt")  # tokenized: too many tokens
    assert small_out["value"].status_code == 200, small_out["value"].text
    assert gaps["value"] and max(gaps["value"]) < STALL, max(gaps["value"])


def test_deep_json_is_a_400(server):
    deep = b'{"prompt": "x", "max_tokens": 1, "logit_bias": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    _error(_post(server, "/v1/completions", deep), 400, "invalid_json")
    tools = {"a": 1}
    for _ in range(800):
        tools = {"a": tools}
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "tools": [{"type": "function", "function": tools}]})
    assert r.status_code == 400, r.text[:300]
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "chat_template_kwargs": {"x": tools}})
    assert r.status_code == 400, r.text[:300]


def test_template_variables_from_the_request_are_not_overridable(server):
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                               "chat_template_kwargs": {"messages": []}})
    e = _error(r, 400, "invalid_value", "chat_template_kwargs.messages")
    assert e["message"].startswith("chat_template_kwargs.messages: set from the request")


def test_context_overflow_is_context_length_exceeded(server):
    r = _post(server, "/v1/completions", {"prompt": list(range(1, 40)) * 1000, "max_tokens": 1})
    _error(r, 400, "context_length_exceeded", "prompt")
    words = "word " * (N_CTX + 100)
    r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": words}], "max_tokens": 1})
    _error(r, 400, "context_length_exceeded", "messages")


@pytest.fixture(scope="module")
def endless(gguf_path) -> dict:
    """Request fields that keep the model generating: its end tokens biased away."""
    from clover_gguf import Model

    with Model(gguf_path, n_ctx=16) as m:
        return {"max_tokens": 20000, "temperature": 0, "logit_bias": {str(t): -100 for t in m.end_ids}}


def _long_job(server, endless, **extra):
    return _post(server, "/v1/completions", {"prompt": "def f(", **endless, **extra})


def test_a_request_past_timeout_is_ended_and_its_slot_freed(server, endless):
    t0 = time.monotonic()
    e = _error(_long_job(server, endless), 504, "timeout")
    took = time.monotonic() - t0
    assert TIMEOUT - 0.5 <= took < TIMEOUT + 30, took
    assert "timeout" in e["message"]
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_a_stream_past_timeout_ends_with_an_error_event(server, endless):
    t0 = time.monotonic()
    r = _long_job(server, endless, stream=True)
    assert r.status_code == 200
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "timeout"
    assert time.monotonic() - t0 < TIMEOUT + 30


def test_queue_flood_gets_503_with_retry_after(server, endless):
    """One long job holds the slot; of 8 more requests, those past MAX_QUEUE waiting get 503 with
    Retry-After at once; the others wait, then run (or time out); nothing else goes wrong."""
    first, first_out = _in_thread(_long_job, server, endless)
    time.sleep(1.0)
    threads = [_in_thread(_post, server, "/v1/completions", {"prompt": "x", "max_tokens": 2}) for _ in range(8)]
    for t, _ in threads:
        t.join(HANG)
    first.join(HANG)
    statuses = sorted(out["value"].status_code for _, out in threads)
    assert statuses.count(503) >= 8 - MAX_QUEUE, statuses
    assert set(statuses) <= {200, 503}, statuses
    for _, out in threads:
        r = out["value"]
        if r.status_code == 503:
            assert r.json()["error"]["code"] in ("queue_full", "timeout")
            assert int(r.headers["retry-after"]) >= 1
    assert first_out["value"].status_code == 504
    m = metrics(server)
    assert m["clover_requests_pending"] == 0 and m["clover_requests_active"] == 0


def test_prefix_reuse_stays_within_a_client(server):
    """After client A's chat with a secret system prompt, client B's guess of that prefix reuses
    nothing; A's own next turn does reuse it."""
    secret = [{"role": "system", "content": "The password is hunter2. " * 20},
              {"role": "user", "content": "hello"}]
    body = {"messages": secret, "max_tokens": 4, "temperature": 0}
    assert _post(server, "/v1/chat/completions", {**body, "user": "alice"}).status_code == 200
    guess = {**body, "messages": secret + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "?"}]}
    for who in ({"user": "mallory"}, {}, {"prompt_cache_key": "alice"}):
        r = _post(server, "/v1/chat/completions", {**guess, **who})
        assert r.json()["timings"]["n_prompt_reused"] == 0, who
        assert _post(server, "/v1/chat/completions", {**body, "user": "alice"}).status_code == 200
    r = _post(server, "/v1/chat/completions", {**guess, "user": "alice"})
    assert r.json()["timings"]["n_prompt_reused"] > 0
    _error(_post(server, "/v1/chat/completions", {**body, "user": 7}), 400, "invalid_value", "user")


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_memory_returns_after_big_requests(served, most_bytes):
    """Big requests leave no memory behind: RSS after four more prompts just under the byte bound
    is within 10% of RSS after the first three (which warm thread pools and allocator arenas
    once: about 30 MB measured on a random model, where each refused 1 MB prompt kept 14 MB
    until the next full garbage collection)."""
    base, proc = served
    text = _big_text(most_bytes - 100)
    for _ in range(3):
        _post(base, "/v1/completions", {"prompt": text, "max_tokens": 1})
    before = _rss(proc.pid)
    for _ in range(4):
        _post(base, "/v1/completions", {"prompt": text, "max_tokens": 1})
    after = _rss(proc.pid)
    assert after <= before * 1.10, (before, after)


def test_empty_api_key_is_refused_at_start(gguf_path):
    for args, env in ((["--api-key", ""], {}), ([], {"CLOVER_API_KEY": ""})):
        r = subprocess.run([sys.executable, "-m", "clover_gguf", "serve", "-m", gguf_path, *args],
                           capture_output=True, text=True, timeout=HANG, cwd=str(ROOT),
                           env={**os.environ, **env})
        assert r.returncode == 2 and "--api-key: empty" in r.stderr, r.stderr
    from clover_gguf.server import create_app
    with pytest.raises(ValueError, match="api_key: empty"):
        create_app(gguf_path, api_key="")


def test_a_body_sent_too_slowly_is_408_and_frees_its_queue_place(server):
    """A client that declares a body and never finishes it gets 408 at the request's time limit
    (it does not keep a place in the queue)."""
    host, port = server.rsplit("/", 1)[1].split(":")
    t0 = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=HANG) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 100\r\n\r\n{\"prompt\": ".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            got = sock.recv(1 << 16)
            if not got:
                break
            data += got
    assert data.startswith(b"HTTP/1.1 408"), data[:200]
    assert TIMEOUT - 0.5 <= time.monotonic() - t0 < TIMEOUT + 30
    assert metrics(server)["clover_requests_pending"] == 0
