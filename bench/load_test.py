"""Loopback load test of ``clover-gguf serve``, with hostile clients among the ordinary ones.

Starts the server in a subprocess (so its RSS is read from ``/proc/PID/status``) on a free
127.0.0.1 port with the limits ``--max-body``, ``--max-queue`` and ``--timeout``, sends one
greedy reference request, then runs ``--clients`` concurrent clients for ``--duration``
seconds. Each client picks a request kind at random (the weights keep the well-formed kinds
dominant) and, at random, a client key (``user`` or ``prompt_cache_key``) of its own or none:

- ``completion``: a non-streamed ``/v1/completions`` (greedy or sampled), expects 200;
- ``chat_stream``: a streamed ``/v1/chat/completions`` read to ``data: [DONE]``;
- ``stream_disconnect``: a long streamed completion dropped after its first chunks;
- ``whole_disconnect``: a long non-streamed completion dropped before the answer;
- ``greedy_check``: the reference request again, beside the others: the same text expected;
- ``malformed_json``: a truncated or non-object JSON body, expects 400 ``invalid_json``;
- ``bad_param``: one impossible field value (NaN temperature, negative max_tokens, top_k,
  block_size 0, threshold 0, token id >= n_vocab, ...), expects 400 naming the field;
- ``big_body``: a body over ``--max-body``: declared by Content-Length and not sent (413
  ``request_too_large``), declared and sent at once (413, or the connection closed by the
  server), or sent slowly in chunks without Content-Length (413, or the connection closed once
  past the limit);
- ``big_prompt``: a prompt of 1-2 MB that fits ``--max-body`` (completion or chat), a few KB of
  text with more tokens than the context, or n_ctx token ids: 400 ``context_length_exceeded``;
- ``deep_json``: 5000 nested arrays in a field (400 ``invalid_json``), or 800 nested objects
  inside a chat request's ``tools`` (400);
- ``slow_reader``: a long streamed completion read slowly through a 4 KB receive buffer, then
  closed;
- ``queue_flood``: 10 quick completions at once from one client, each 200 or 503 with
  ``Retry-After``.

Any request to /v1 may also be answered 503 ``queue_full`` with ``Retry-After`` (the server sheds
load past ``--max-queue`` waiting requests: its contract); the long kinds (``stream_disconnect``,
``whole_disconnect``, ``slow_reader``, ``queue_flood``) may also end by the server's timeout (503
or 504 ``timeout``, or a stream's ``timeout`` error event). Every other status or exception is
an unexpected error. After a 503 a client waits its Retry-After (at most 5 s; a queue flood does
not wait). Meanwhile a monitor polls ``/health`` every 0.5 s and samples the server's RSS
every 10 s.

The run passes when there is no unexpected error, every /health answer came (200) in under
1 s, the server's RSS after the load (idle) is at most 1.05 x (``--rss-factor``) its RSS before it (idle, after
``--warmup`` seconds of the same load, which grow the thread pools and allocator arenas once;
the summary also gives the RSS right after the reference request), /metrics shows no active, queued or pending request
and no busy slot afterwards (no stuck slot; ``-np`` slots, the server's default 4), and
the reference request answers the same text after the load. Prints one JSON summary (statuses
per kind); exit code 1 if a check failed. Only the standard library is used on the client side.

    python bench/load_test.py                      # the embedded model, 8 clients, 10 s
    python bench/load_test.py --clients 32 --duration 300
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from typing import NamedTuple

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = ("completion", "chat_stream", "stream_disconnect", "whole_disconnect", "greedy_check",
         "malformed_json", "bad_param", "big_body", "big_prompt", "deep_json", "slow_reader", "queue_flood")
WEIGHTS = (8, 6, 4, 2, 2, 2, 4, 1, 1, 1, 1, 1)
# the forms a hostile kind takes (each picked at random; see the module docstring)
VARIANTS = {"big_body": ("declared", "declared_sent", "chunked_slow"),
            "big_prompt": ("bytes", "bytes_chat", "tokens", "ids"),
            "deep_json": ("deep_field", "deep_tools")}
PROMPTS = ("def main():\n", "import os\n", "class Parser:\n", "# utility functions\n", "for i in range(")
REFERENCE = {"prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0}
# (field, body fields): each must be answered 400 with error.param == field
BAD_PARAMS = (
    ("temperature", {"temperature": float("nan")}),
    ("temperature", {"temperature": -1}),
    ("max_tokens", {"max_tokens": -3}),
    ("top_k", {"top_k": -1}),
    ("top_p", {"top_p": 1.5}),
    ("min_p", {"min_p": float("nan")}),
    ("block_size", {"block_size": 0}),
    ("threshold", {"threshold": 0}),
    ("threshold", {"threshold": 1.5}),
    ("repeat_penalty", {"repeat_penalty": -1}),
    ("prompt", {"prompt": [1, 2, 10 ** 6]}),
    ("prompt", {"prompt": ""}),
    ("logit_bias", {"logit_bias": {"1000000": 1}}),
)

# The test's server limits (passed to serve): a 4 MiB body holds the 1-2 MB prompts; 30 s ends long jobs.
MAX_BODY = 4 << 20
MAX_QUEUE = 64
TIMEOUT = 30.0
CLIENT_GRACE = 60.0        # a client's socket timeout: the server's timeout plus this
FLOOD = 10                 # requests of one queue_flood burst
HEALTH_INTERVAL = 0.5      # seconds between /health polls
HEALTH_LIMIT = 1.0         # a /health answer this slow (s) fails the run
RSS_FACTOR = 1.05          # RSS after the load <= this x RSS before
CHUNK = 64 << 10           # bytes per chunk of a slowly sent body
SLOW_RCVBUF = 4096         # receive buffer of a slow reader's socket
RETRY_CAP = 5.0            # longest Retry-After (s) a client waits before its next request
RSS_EVERY = 10.0           # seconds between RSS samples during the load


# ---------------------------------------------------------------------------- server
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (VmRSS of /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_server(model: str, n_ctx: int = 512, threads: int = 1, log_path: str | None = None,
                 timeout: float = 120.0, max_body: int | None = None, max_queue: int | None = None,
                 request_timeout: float | None = None, prefix_reuse: bool = True, parallel: int | None = None):
    """``(process, base_url)`` of ``clover-gguf serve`` once /health answers 200 (within
    ``timeout`` s); ``max_body, max_queue, request_timeout, parallel``: the server's ``--max-body,
    --max-queue, --timeout, -np`` (None: its defaults)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    cmd = [sys.executable, "-m", "clover_gguf.cli", "serve", "-m", model, "--port", str(port),
           "-c", str(n_ctx), "-t", str(threads)]
    for flag, v in (("--max-body", max_body), ("--max-queue", max_queue), ("--timeout", request_timeout),
                    ("-np", parallel)):
        if v is not None:
            cmd += [flag, str(v)]
    if not prefix_reuse:
        cmd.append("--no-prefix-reuse")
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT)
    if log_path:
        log.close()
    base = f"127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if request(base, "GET", "/health", timeout=5)[0] == 200:
                return proc, base
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"server not healthy after {timeout} s")
        time.sleep(0.2)


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- requests
def _conn(base: str, timeout: float) -> http.client.HTTPConnection:
    host, port = base.rsplit(":", 1)
    return http.client.HTTPConnection(host, int(port), timeout=timeout)


class _SmallBufferConnection(http.client.HTTPConnection):
    """An HTTP connection whose socket has a ``rcvbuf``-byte receive buffer (set before connect,
    so the TCP window stays small and a slow reader pushes back on the server's writes)."""

    def __init__(self, host: str, port: int, timeout: float, rcvbuf: int) -> None:
        super().__init__(host, port, timeout=timeout)
        self.rcvbuf = rcvbuf

    def connect(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        s.settimeout(self.timeout)
        s.connect((self.host, self.port))
        self.sock = s


def _encode(body) -> bytes | None:
    """``body``: bytes as they are, anything else as JSON (NaN allowed, as Python's json writes it
    and the server's json reads it)."""
    return body if body is None or isinstance(body, bytes) else json.dumps(body).encode()


def exchange(base: str, method: str, path: str, body=None, timeout: float = 120.0):
    """``(status, headers, body bytes)`` of one request (``body`` as :func:`_encode`)."""
    c = _conn(base, timeout)
    try:
        c.request(method, path, body=_encode(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.headers, r.read()
    finally:
        c.close()


def request(base: str, method: str, path: str, body=None, timeout: float = 120.0) -> tuple[int, bytes]:
    """``(status, body bytes)`` of one request (``body`` as :func:`_encode`)."""
    status, _, raw = exchange(base, method, path, body, timeout)
    return status, raw


def metrics(base: str) -> dict[str, float]:
    status, raw = request(base, "GET", "/metrics", timeout=30)
    if status != 200:
        raise RuntimeError(f"/metrics: HTTP {status}")
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def reference_text(base: str) -> str:
    status, raw = request(base, "POST", "/v1/completions", REFERENCE)
    if status != 200:
        raise RuntimeError(f"reference request: HTTP {status}: {raw[:300]!r}")
    return json.loads(raw)["choices"][0]["text"]


def _busy_slots(m: dict) -> int:
    """Slots a request holds in /metrics ``m`` (``clover_slot_busy{slot="i"}``)."""
    return int(sum(v for k, v in m.items() if k.startswith("clover_slot_busy")))


def _busy(m: dict) -> float:
    """Requests active, queued or pending and slots held in /metrics ``m`` (a missing gauge counts
    as busy)."""
    return sum(m.get(f"clover_requests_{g}", 1) for g in ("active", "queued", "pending")) + _busy_slots(m)


def wait_idle(base: str, timeout: float = 60.0) -> dict:
    """/metrics once no request is active, queued or pending (or the last one read at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if _busy(m) == 0 or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


# ---------------------------------------------------------------------------- outcomes
class Target(NamedTuple):
    """What a client needs: the server's address, limits and the reference answer."""
    base: str
    reference: str
    n_ctx: int
    max_body: int
    timeout: float  # the client's socket timeout (s)


class Outcome(NamedTuple):
    """One request's outcome: its label (``"200"``, ``"400 invalid_json"``, ``"closed"``), None if
    it is an intended one else why not, the server's error message, the Retry-After seconds."""
    label: str
    why: str | None = None
    detail: str = ""
    retry_after: float = 0.0


def _error(raw: bytes) -> dict:
    """The ``error`` object of an OpenAI-shaped error body ({} if there is none)."""
    try:
        e = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return {}
    return e if isinstance(e, dict) else {}


def _label(status: int, raw: bytes) -> str:
    """``"200"``, or the status and the error code: ``"400 invalid_json"``."""
    code = _error(raw).get("code") if status >= 400 else None
    return f"{status} {code}" if code else str(status)


def _retry_after(headers) -> float:
    try:
        return float(headers.get("Retry-After") or 0)
    except ValueError:
        return 0.0


def _judge(status: int, headers, raw: bytes, expect: int, check=None, timeouts: bool = False) -> Outcome:
    """The outcome of an answer: intended if it is ``expect`` (then ``check(raw)`` says what is
    wrong, or None), or the server shedding load (503 ``queue_full`` with Retry-After), or with
    ``timeouts`` its time limit (503 with Retry-After / 504 ``timeout``)."""
    label = _label(status, raw)
    message = str(_error(raw).get("message", raw[:200])) if status >= 400 else ""
    if status == expect:
        return Outcome(label, check(raw) if check else None, message)
    code = _error(raw).get("code")
    if status == 503 and (code == "queue_full" or (timeouts and code == "timeout")):
        wait = _retry_after(headers)
        return Outcome(label, None if wait > 0 else "503_without_retry_after", message, wait)
    if status == 504 and timeouts and code == "timeout":
        return Outcome(label, None, message)
    return Outcome(label, "http_" + label.replace(" ", "_"), message)


def _code_is(code: str):
    """A check: the error body's code is ``code``."""
    return lambda raw: None if _error(raw).get("code") == code else f"code_{_error(raw).get('code')}_not_{code}"


def _completion_ok(raw: bytes) -> str | None:
    ch = json.loads(raw)["choices"][0]
    return None if isinstance(ch.get("text"), str) and ch.get("finish_reason") else "bad_body"


class Streamed:
    """A streamed request: status, headers, error body (not 200), data events read, whether
    ``[DONE]`` came, the first error event's ``error`` object (None if there was none)."""

    def __init__(self, status: int, headers, raw: bytes = b"") -> None:
        self.status, self.headers, self.raw = status, headers, raw
        self.n, self.done, self.error = 0, False, None


def _stream(t: Target, path: str, body, drop_after=None, delay: float = 0.0, rcvbuf: int | None = None) -> Streamed:
    """A streamed request read to ``[DONE]``, or dropped after ``drop_after`` data events;
    ``delay`` s between reads; ``rcvbuf``: a small receive buffer."""
    host, port = t.base.rsplit(":", 1)
    c = _SmallBufferConnection(host, int(port), t.timeout, rcvbuf) if rcvbuf else _conn(t.base, t.timeout)
    try:
        c.request("POST", path, body=_encode(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return Streamed(r.status, r.headers, r.read())
        out = Streamed(r.status, r.headers)
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                out.done = True
                break
            if b'"error"' in payload and out.error is None:
                out.error = _error(payload) or {"message": payload.decode("utf-8", "replace")}
            out.n += 1
            if drop_after is not None and out.n >= drop_after:
                break  # the client goes away mid-stream
            if delay:
                time.sleep(delay)
        return out
    finally:
        if drop_after is not None and c.sock is not None:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        c.close()


def _stream_outcome(s: Streamed, timeouts: bool, need_done: bool):
    """``(label, why)`` of a streamed answer: 200 without an error event (a ``timeout`` event
    allowed with ``timeouts``) and, with ``need_done``, read to ``[DONE]`` with 2+ events."""
    if s.status != 200:
        return _judge(s.status, s.headers, s.raw, 200, timeouts=timeouts)
    if s.error is not None:
        code = s.error.get("code")
        if timeouts and code == "timeout":
            return Outcome("200 timeout_event")
        return Outcome(f"200 error_event_{code}", f"error_in_stream_{code}", str(s.error.get("message")))
    if need_done and not (s.done and s.n >= 2):
        return Outcome("200", "stream_not_done")
    return Outcome("200")


def _send_body(t: Target, path: str, size: int, declared: bool, send: bool, delay: float = 0.0):
    """POST ``size`` body bytes: with Content-Length (``declared``) or in chunks without it,
    ``delay`` s between chunks; ``send`` False sends the headers only. ``(label, why)``: 413
    ``request_too_large``, or ``"closed"`` when the server closed the connection, intended once
    more than ``max_body`` bytes were sent (or declared)."""
    c = _conn(t.base, t.timeout)
    sent = 0
    chunk = b"a" * CHUNK
    try:
        c.putrequest("POST", path)
        c.putheader("Content-Type", "application/json")
        c.putheader(*(("Content-Length", str(size)) if declared else ("Transfer-Encoding", "chunked")))
        c.endheaders()
        try:
            while send and sent < size:
                part = chunk[:min(CHUNK, size - sent)]
                c.send(part if declared else b"%x\r\n%s\r\n" % (len(part), part))
                sent += len(part)
                if delay:
                    time.sleep(delay)
            if send and not declared:
                c.send(b"0\r\n\r\n")
        except OSError:
            pass  # the server answered early and closed: its answer may still be readable
        try:
            r = c.getresponse()
            status, headers, raw = r.status, r.headers, r.read()
        except (OSError, http.client.HTTPException):
            closed_ok = declared or sent > t.max_body
            return Outcome("closed", None if closed_ok else f"closed_after_{sent}_bytes")
        return _judge(status, headers, raw, 413, _code_is("request_too_large"))
    finally:
        c.close()


# ---------------------------------------------------------------------------- request kinds
def k_completion(t: Target, rng: random.Random, key: dict):
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0, 0.8]),
            "seed": rng.randint(0, 1000), **key}
    status, headers, raw = exchange(t.base, "POST", "/v1/completions", body, t.timeout)
    return [_judge(status, headers, raw, 200, _completion_ok)]


def k_chat_stream(t: Target, rng: random.Random, key: dict):
    body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": rng.randint(4, 32),
            "temperature": 0, "stream": True, **key}
    return [_stream_outcome(_stream(t, "/v1/chat/completions", body), timeouts=False, need_done=True)]


def k_stream_disconnect(t: Target, rng: random.Random, key: dict):
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 400, "temperature": 0, "stream": True, **key}
    s = _stream(t, "/v1/completions", body, drop_after=rng.randint(1, 3))
    return [_stream_outcome(s, timeouts=True, need_done=False)]


def k_whole_disconnect(t: Target, rng: random.Random, key: dict):
    c = _conn(t.base, t.timeout)
    try:
        c.request("POST", "/v1/completions", body=_encode({"prompt": rng.choice(PROMPTS), "max_tokens": 400, **key}),
                  headers={"Content-Type": "application/json"})
        time.sleep(rng.uniform(0.0, 0.2))
        c.sock.shutdown(socket.SHUT_RDWR)  # gone before the answer
    finally:
        c.close()
    return [Outcome("dropped")]


def k_greedy_check(t: Target, rng: random.Random, key: dict):
    status, headers, raw = exchange(t.base, "POST", "/v1/completions", {**REFERENCE, **key}, t.timeout)
    same = lambda raw: None if json.loads(raw)["choices"][0]["text"] == t.reference else "output_mismatch"  # noqa: E731
    return [_judge(status, headers, raw, 200, same)]


def k_malformed_json(t: Target, rng: random.Random, key: dict):
    body = rng.choice([b'{"prompt": "a", ', b"not json", b"[1, 2]", b'{"prompt": "\xff"}'])
    status, headers, raw = exchange(t.base, "POST", rng.choice(["/v1/completions", "/v1/chat/completions"]),
                                    body, t.timeout)
    return [_judge(status, headers, raw, 400, _code_is("invalid_json"))]


def k_bad_param(t: Target, rng: random.Random, key: dict):
    field, extra = rng.choice(BAD_PARAMS)
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 8, **extra, "stream": rng.random() < 0.5, **key}
    status, headers, raw = exchange(t.base, "POST", "/v1/completions", body, t.timeout)
    param = lambda raw: None if _error(raw).get("param") == field else f"param_{_error(raw).get('param')}_not_{field}"  # noqa: E731
    return [_judge(status, headers, raw, 400, param)]


def k_big_body(t: Target, rng: random.Random, key: dict, variant: str | None = None):
    variant = variant or rng.choice(VARIANTS["big_body"])
    size = t.max_body + rng.randint(1, 4 * CHUNK)
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    if variant == "declared":
        return [_send_body(t, path, size, declared=True, send=False)]
    if variant == "declared_sent":
        return [_send_body(t, path, size, declared=True, send=True)]
    return [_send_body(t, path, size, declared=False, send=True, delay=rng.uniform(0.005, 0.03))]


def k_big_prompt(t: Target, rng: random.Random, key: dict, variant: str | None = None):
    variant = variant or rng.choice(VARIANTS["big_prompt"])
    if variant in ("bytes", "bytes_chat"):  # 1-2 MB of text, within max_body
        size = min(rng.randint(1_000_000, 2_000_000), t.max_body - 4096)
        text = ("x = 1\n" * (size // 6 + 1))[:size]
    elif variant == "tokens":  # a few KB: under the byte bound of most vocabularies, over n_ctx tokens
        text = " ".join(rng.choice(["x", "(", ")", "=", "1", ":", ",", "+"]) for _ in range(2 * t.n_ctx))
    if variant == "bytes_chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path = "/v1/completions"
        body = {"prompt": [rng.randrange(3, 200) for _ in range(t.n_ctx)] if variant == "ids" else text}
    body.update(max_tokens=4, stream=rng.random() < 0.5, **key)
    status, headers, raw = exchange(t.base, "POST", path, body, t.timeout)
    return [_judge(status, headers, raw, 400, _code_is("context_length_exceeded"))]


def k_deep_json(t: Target, rng: random.Random, key: dict, variant: str | None = None):
    variant = variant or rng.choice(VARIANTS["deep_json"])
    if variant == "deep_field":  # 5000 nested arrays in a field: refused by the JSON parser
        field = rng.choice(["logit_bias", "stop", "user", "prompt", "messages"])
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = (b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "%s": '
                % field.encode() + b"[" * 5000 + b"]" * 5000 + b"}")
        status, headers, raw = exchange(t.base, "POST", path, body, t.timeout)
        return [_judge(status, headers, raw, 400, _code_is("invalid_json"))]
    nested = b'{"a": ' * 800 + b"{}" + b"}" * 800  # 800 levels inside tools[0].function.parameters
    body = (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "tools": [{"type": "function", '
            b'"function": {"name": "f", "description": "d", "parameters": ' + nested + b"}}]}")
    status, headers, raw = exchange(t.base, "POST", "/v1/chat/completions", body, t.timeout)
    return [_judge(status, headers, raw, 400)]


def k_slow_reader(t: Target, rng: random.Random, key: dict):
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 400, "temperature": 0, "stream": True, **key}
    s = _stream(t, "/v1/completions", body, drop_after=rng.randint(10, 40), delay=rng.uniform(0.1, 0.3),
                rcvbuf=SLOW_RCVBUF)
    return [_stream_outcome(s, timeouts=True, need_done=False)]


def k_queue_flood(t: Target, rng: random.Random, key: dict):
    """``FLOOD`` quick completions sent at once (threads released together)."""
    results: list = [None] * FLOOD
    gate = threading.Barrier(FLOOD)

    def one(i: int) -> None:
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 1 + i % 4, "temperature": 0, **key}
        gate.wait()
        try:
            status, headers, raw = exchange(t.base, "POST", "/v1/completions", body, t.timeout)
            results[i] = _judge(status, headers, raw, 200, _completion_ok, timeouts=True)
        except (OSError, http.client.HTTPException, ValueError) as e:
            results[i] = Outcome(type(e).__name__, type(e).__name__, str(e))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(FLOOD)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results


KIND_FUNCS = {k: globals()[f"k_{k}"] for k in KINDS}


def one_request(t: Target, kind: str, rng: random.Random, key: dict) -> list[Outcome]:
    """Send one request of ``kind`` (``queue_flood``: ``FLOOD`` of them); the outcome of each."""
    return KIND_FUNCS[kind](t, rng, key)


# ---------------------------------------------------------------------------- the load
def monitor_health(base: str, stop: threading.Event, out: dict, pid: int | None = None) -> None:
    """Poll /health every ``HEALTH_INTERVAL`` s until ``stop``; ``out``: polls, the longest
    answer time, failures (non-200 answers or exceptions) and, with the server's ``pid``, its RSS
    (MB) every ``RSS_EVERY`` s."""
    out.update(polls=0, max_s=0.0, failures=0, failure_examples=[], rss_mb=[])
    next_rss = time.monotonic()
    while not stop.is_set():
        t0 = time.monotonic()
        if pid is not None and t0 >= next_rss:
            out["rss_mb"].append(round(rss_mb(pid), 1))
            next_rss = t0 + RSS_EVERY
        try:
            status, raw = request(base, "GET", "/health", timeout=30)
            why = None if status == 200 else f"HTTP {status}: {raw[:100]!r}"
        except (OSError, http.client.HTTPException) as e:
            why = f"{type(e).__name__}: {e}"
        dt = time.monotonic() - t0
        out["polls"] += 1
        out["max_s"] = max(out["max_s"], round(dt, 3))
        if why:
            out["failures"] += 1
            out["failure_examples"] = (out["failure_examples"] + [why])[:5]
        stop.wait(max(0.0, HEALTH_INTERVAL - dt))


def _client_keys(k: int) -> list[dict]:
    """The client keys client ``k`` picks from: none, its ``user``, its ``prompt_cache_key``."""
    return [{}, {"user": f"client-{k}"}, {"prompt_cache_key": f"cache-{k}"}]


def run_load(t: Target, clients: int, duration: float, seed: int = 0, pid: int | None = None) -> dict:
    """``clients`` threads sending requests for ``duration`` seconds, /health polled beside them
    (and the RSS of the server's ``pid`` sampled); counts by kind and outcome."""
    lock = threading.Lock()
    sent, ok = Counter(), Counter()
    statuses: dict[str, Counter] = {}
    errors: dict[str, Counter] = {}
    examples: dict[str, list] = {}  # kind -> the first unexpected outcomes with the server's message
    deadline = time.monotonic() + duration

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        keys = _client_keys(k)
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                results = one_request(t, kind, rng, rng.choice(keys))
            except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                results = [Outcome(type(e).__name__, type(e).__name__, str(e))]
            with lock:
                for r in results:
                    sent[kind] += 1
                    statuses.setdefault(kind, Counter())[r.label] += 1
                    if r.why is None:
                        ok[kind] += 1
                    else:
                        errors.setdefault(kind, Counter())[r.why] += 1
                        if len(examples.setdefault(kind, [])) < 3:
                            examples[kind].append(f"{r.label}: {r.detail[:300]}")
            wait = max(r.retry_after for r in results)
            if wait and kind != "queue_flood":  # an ordinary client honours Retry-After (capped)
                time.sleep(min(wait, RETRY_CAP) * rng.uniform(0.5, 1.0))

    health: dict = {}
    stop = threading.Event()
    monitor = threading.Thread(target=monitor_health, args=(t.base, stop, health, pid), daemon=True)
    t0 = time.monotonic()
    monitor.start()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    monitor.join()
    by_status = Counter()
    for c in statuses.values():
        for label, n in c.items():
            by_status[label.split(" ", 1)[0]] += n
    return {"wall_s": round(time.monotonic() - t0, 2), "requests": dict(sent), "ok": dict(ok),
            "statuses": {k: dict(sorted(v.items())) for k, v in statuses.items()},
            "http_status": dict(sorted(by_status.items())),
            "errors": {k: dict(v) for k, v in errors.items()}, "error_examples": examples,
            "unexpected_errors": sum(sum(v.values()) for v in errors.values()),
            "http_500": by_status.get("500", 0), "health": health}


def _served(m: dict) -> dict:
    """/metrics' ``clover_requests_total`` as {"/v1/completions 200": n}."""
    out = {}
    for k, v in m.items():
        if k.startswith("clover_requests_total{"):
            labels = dict(x.split("=", 1) for x in k[k.index("{") + 1:-1].split(","))
            out[f"{labels['endpoint'].strip(chr(34))} {labels['status'].strip(chr(34))}"] = int(v)
    return out


def load_test(model: str, clients: int = 8, duration: float = 10.0, n_ctx: int = 512, threads: int = 1,
              seed: int = 0, log_path: str | None = None, max_body: int = MAX_BODY, max_queue: int = MAX_QUEUE,
              timeout: float = TIMEOUT, prefix_reuse: bool = True, warmup: float = 0.0, parallel: int | None = None,
              rss_factor: float = RSS_FACTOR) -> dict:
    """Start a server, run the load, check it afterwards; the JSON summary (``checks``: each
    check and whether it held; ``passed``: all held; ``rss_start_mb``: the server's RSS after
    the reference request; ``rss_before_mb``: after ``warmup`` seconds of the same load, idle,
    which have grown the thread pools and allocator arenas once; ``rss_after_mb``: after the
    load, idle; the RSS check compares the last two)."""
    proc, base = start_server(model, n_ctx=n_ctx, threads=threads, log_path=log_path, max_body=max_body,
                              max_queue=max_queue, request_timeout=timeout, prefix_reuse=prefix_reuse,
                              parallel=parallel)
    try:
        reference = reference_text(base)
        rss_start = rss_mb(proc.pid)
        t = Target(base, reference, n_ctx, max_body, (timeout or 600.0) + CLIENT_GRACE)
        if warmup > 0:
            run_load(t, clients, warmup, seed=seed + 1, pid=proc.pid)
            wait_idle(base)
        rss_before = rss_mb(proc.pid)
        load = run_load(t, clients, duration, seed=seed, pid=proc.pid)
        wait_idle(base)
        after = reference_text(base)
        m = wait_idle(base)
        rss_after = rss_mb(proc.pid)
        out = {"model": os.path.basename(model), "clients": clients, "duration_s": duration, "n_ctx": n_ctx,
               "threads": threads, "max_body": max_body, "max_queue": max_queue, "timeout_s": timeout, **load,
               "server_requests": _served(m),
               "server_cancelled": int(m.get("clover_requests_cancelled_total", 0)),
               "slots_active_after": int(m.get("clover_requests_active", -1)),
               "queued_after": int(m.get("clover_requests_queued", -1)),
               "pending_after": int(m.get("clover_requests_pending", -1)),
               "slots": int(m.get("clover_slots_total", -1)), "slots_busy_after": _busy_slots(m),
               "reference_identical_after": after == reference,
               "server_alive": proc.poll() is None,
               "warmup_s": warmup, "rss_start_mb": round(rss_start, 1),
               "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1),
               "rss_ratio": round(rss_after / rss_before, 3)}
        out["checks"] = {
            "no_unexpected_errors": out["unexpected_errors"] == 0,
            "health_fast": load["health"]["failures"] == 0 and load["health"]["max_s"] < HEALTH_LIMIT,
            "rss_bounded": rss_after <= rss_factor * rss_before,
            "idle_after": out["slots_active_after"] == 0 and out["queued_after"] == 0 and out["pending_after"] == 0
            and out["slots_busy_after"] == 0,
            "reference_identical_after": out["reference_identical_after"],
            "server_alive": out["server_alive"]}
        out["passed"] = all(out["checks"].values())
        return out
    finally:
        stop_server(proc)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded clover-tiny model)")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients (8)")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of load (10)")
    ap.add_argument("-c", "--ctx-size", type=int, default=512, help="server context length (512)")
    ap.add_argument("-t", "--threads", type=int, default=1, help="server CPU threads (1)")
    ap.add_argument("--max-body", type=int, default=MAX_BODY,
                    help=f"server's --max-body in bytes ({MAX_BODY}: the 1-2 MB prompts fit)")
    ap.add_argument("--max-queue", type=int, default=MAX_QUEUE, help=f"server's --max-queue ({MAX_QUEUE})")
    ap.add_argument("--timeout", type=float, default=TIMEOUT,
                    help=f"server's --timeout in seconds ({TIMEOUT:g}: long jobs end)")
    ap.add_argument("--no-prefix-reuse", action="store_true", help="server's --no-prefix-reuse")
    ap.add_argument("-np", "--parallel", type=int, default=None, help="server's -np (its default: 4 slots)")
    ap.add_argument("--rss-factor", type=float, default=RSS_FACTOR,
                    help=f"the RSS check: idle RSS after the load <= this x before it ({RSS_FACTOR})")
    ap.add_argument("--warmup", type=float, default=20.0,
                    help="seconds of the same load before RSS is read for the RSS check (20)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (0)")
    ap.add_argument("--log", default=None, help="write the server's log to this file")
    a = ap.parse_args(argv)
    if a.model is None:
        sys.path.insert(0, _ROOT)
        from clover_gguf import DEFAULT_MODEL

        a.model = DEFAULT_MODEL
    out = load_test(a.model, a.clients, a.duration, a.ctx_size, a.threads, a.seed, a.log, max_body=a.max_body,
                    max_queue=a.max_queue, timeout=a.timeout, prefix_reuse=not a.no_prefix_reuse,
                    warmup=a.warmup, parallel=a.parallel, rss_factor=a.rss_factor)
    print(json.dumps(out, indent=1))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
