"""Loopback load test of ``clover-gguf serve``.

Starts the server in a subprocess (so its RSS is read from ``/proc/PID/status``) on a free
127.0.0.1 port, sends one greedy reference request, then runs ``--clients`` concurrent
clients for ``--duration`` seconds. Each client picks a request kind at random:

- ``completion``: a non-streamed ``/v1/completions`` (greedy or sampled), expects 200;
- ``chat_stream``: a streamed ``/v1/chat/completions`` read to ``data: [DONE]``;
- ``stream_disconnect``: a long streamed completion dropped after its first chunk;
- ``whole_disconnect``: a long non-streamed completion dropped before the answer;
- ``malformed_json``: a truncated JSON body, expects 400;
- ``bad_param``: one impossible field value (NaN temperature, negative max_tokens, top_k,
  block_size 0, threshold 0, token id >= n_vocab, ...), expects 400 naming the field;
- ``greedy_check``: the reference request again, beside the others: the same text expected.

Afterwards: the server must answer the reference request with the same text, /metrics must
show no active or queued request (no stuck slot), and the RSS before (after the reference
request) and after the load is reported. Prints one JSON summary; exit code 1 if a check
failed. Only the standard library is used on the client side.

    python bench/load_test.py                      # the embedded model, 8 clients, 10 s
    python bench/load_test.py --clients 32 --duration 60
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

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KINDS = ("completion", "chat_stream", "stream_disconnect", "whole_disconnect", "malformed_json",
         "bad_param", "greedy_check")
WEIGHTS = (4, 3, 2, 1, 1, 2, 1)
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
                 timeout: float = 120.0):
    """``(process, base_url)`` of ``clover-gguf serve`` once /health answers 200."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "clover_gguf.cli", "serve", "-m", model, "--port", str(port),
                             "-c", str(n_ctx), "-t", str(threads)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_ROOT)
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


def request(base: str, method: str, path: str, body=None, timeout: float = 120.0) -> tuple[int, bytes]:
    """``(status, body bytes)``; ``body``: bytes as they are, anything else as JSON (NaN allowed,
    as Python's json writes it and the server's json reads it)."""
    c = _conn(base, timeout)
    try:
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        c.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


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


def wait_idle(base: str, timeout: float = 60.0) -> dict:
    """/metrics once no request is active or queued (or the last one read at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        if (m.get("clover_requests_active", 1) == 0 and m.get("clover_requests_queued", 1) == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _stream(base, path, body, timeout, drop_after=None) -> tuple[int, int, bool, str]:
    """A streamed request: (status, data lines read, whether [DONE] came, first error body)."""
    c = _conn(base, timeout)
    try:
        c.request("POST", path, body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            return r.status, 0, False, r.read().decode("utf-8", "replace")
        n, done, err = 0, False, ""
        while True:
            line = r.readline()
            if not line:
                break
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                done = True
                break
            if b'"error"' in payload and not err:
                err = payload.decode("utf-8", "replace")
            n += 1
            if drop_after is not None and n >= drop_after:
                break  # the client goes away mid-stream
        return r.status, n, done, err
    finally:
        if drop_after is not None and c.sock is not None:
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        c.close()


def one_request(base: str, kind: str, rng: random.Random, reference: str, timeout: float) -> tuple[int | None, str | None]:
    """Send one request of ``kind``; ``(HTTP status or None, None if the outcome was the
    expected one else a short reason)``."""
    prompt = rng.choice(PROMPTS)
    if kind == "completion":
        body = {"prompt": prompt, "max_tokens": rng.randint(4, 32), "temperature": rng.choice([0, 0.8]),
                "seed": rng.randint(0, 1000)}
        status, raw = request(base, "POST", "/v1/completions", body, timeout)
        if status != 200:
            return status, f"http_{status}"
        ch = json.loads(raw)["choices"][0]
        return status, None if isinstance(ch.get("text"), str) and ch.get("finish_reason") else "bad_body"
    if kind == "chat_stream":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": rng.randint(4, 32),
                "temperature": 0, "stream": True}
        status, n, done, err = _stream(base, "/v1/chat/completions", body, timeout)
        if status != 200:
            return status, f"http_{status}"
        if err:
            return status, "error_in_stream"
        return status, None if done and n >= 2 else "stream_not_done"
    if kind == "stream_disconnect":
        body = {"prompt": prompt, "max_tokens": 400, "temperature": 0, "stream": True}
        status, n, _, err = _stream(base, "/v1/completions", body, timeout, drop_after=rng.randint(1, 3))
        if status != 200:
            return status, f"http_{status}"
        return status, "error_in_stream" if err else None
    if kind == "whole_disconnect":
        c = _conn(base, timeout)
        try:
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": prompt, "max_tokens": 400}).encode(),
                      headers={"Content-Type": "application/json"})
            time.sleep(rng.uniform(0.0, 0.2))
            c.sock.shutdown(socket.SHUT_RDWR)  # gone before the answer
        finally:
            c.close()
        return None, None
    if kind == "malformed_json":
        status, raw = request(base, "POST", rng.choice(["/v1/completions", "/v1/chat/completions"]),
                              rng.choice([b'{"prompt": "a", ', b"not json", b"[1, 2]", b'{"prompt": "\xff"}']),
                              timeout)
        if status != 400:
            return status, f"http_{status}"
        err = json.loads(raw).get("error", {})
        return status, None if err.get("type") == "invalid_request_error" else "bad_error_body"
    if kind == "bad_param":
        field, extra = rng.choice(BAD_PARAMS)
        body = {"prompt": prompt, "max_tokens": 8, **extra, "stream": rng.random() < 0.5}
        status, raw = request(base, "POST", "/v1/completions", body, timeout)
        if status != 400:
            return status, f"http_{status}"
        err = json.loads(raw).get("error", {})
        return status, None if err.get("param") == field else f"param_{err.get('param')}_not_{field}"
    if kind == "greedy_check":
        status, raw = request(base, "POST", "/v1/completions", REFERENCE, timeout)
        if status != 200:
            return status, f"http_{status}"
        return status, None if json.loads(raw)["choices"][0]["text"] == reference else "output_mismatch"
    raise ValueError(f"kind: {kind!r}")


def run_load(base: str, clients: int, duration: float, reference: str, seed: int = 0,
             timeout: float = 300.0) -> dict:
    """``clients`` threads sending requests for ``duration`` seconds; counts by kind."""
    lock = threading.Lock()
    sent, ok, statuses = Counter(), Counter(), Counter()
    errors: dict[str, Counter] = {}
    deadline = time.monotonic() + duration

    def client(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while time.monotonic() < deadline:
            kind = rng.choices(KINDS, WEIGHTS)[0]
            try:
                status, why = one_request(base, kind, rng, reference, timeout)
            except (OSError, http.client.HTTPException, ValueError) as e:
                status, why = None, type(e).__name__
            with lock:
                sent[kind] += 1
                if status is not None:
                    statuses[str(status)] += 1
                if why is None:
                    ok[kind] += 1
                else:
                    errors.setdefault(kind, Counter())[why] += 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"wall_s": round(time.monotonic() - t0, 2), "requests": dict(sent), "ok": dict(ok),
            "http_status": dict(statuses), "errors": {k: dict(v) for k, v in errors.items()},
            "unexpected_errors": sum(sum(v.values()) for v in errors.values()),
            "http_5xx": sum(n for s, n in statuses.items() if s.startswith("5"))}


def load_test(model: str, clients: int = 8, duration: float = 10.0, n_ctx: int = 512, threads: int = 1,
              seed: int = 0, log_path: str | None = None) -> dict:
    """Start a server, run the load, check it afterwards; the JSON summary (``passed``: all
    checks held; ``rss_*_mb``: the server's RSS after the reference request and after the load)."""
    proc, base = start_server(model, n_ctx=n_ctx, threads=threads, log_path=log_path)
    try:
        reference = reference_text(base)
        rss_before = rss_mb(proc.pid)
        load = run_load(base, clients, duration, reference, seed=seed)
        m = wait_idle(base)
        after = reference_text(base)
        m = wait_idle(base)
        rss_after = rss_mb(proc.pid)
        served = {}  # 'clover_requests_total{endpoint="/v1/completions",status="200"}' -> "/v1/completions 200"
        for k, v in m.items():
            if k.startswith("clover_requests_total{"):
                labels = dict(x.split("=", 1) for x in k[k.index("{") + 1:-1].split(","))
                served[f"{labels['endpoint'].strip(chr(34))} {labels['status'].strip(chr(34))}"] = int(v)
        out = {"model": os.path.basename(model), "clients": clients, "duration_s": duration, "n_ctx": n_ctx,
               "threads": threads, **load,
               "server_requests": served,
               "server_cancelled": int(m.get("clover_requests_cancelled_total", 0)),
               "slots_active_after": int(m.get("clover_requests_active", -1)),
               "queued_after": int(m.get("clover_requests_queued", -1)),
               "reference_identical_after": after == reference,
               "server_alive": proc.poll() is None,
               "rss_before_mb": round(rss_before, 1), "rss_after_mb": round(rss_after, 1)}
        out["passed"] = (out["unexpected_errors"] == 0 and out["http_5xx"] == 0 and out["slots_active_after"] == 0
                         and out["queued_after"] == 0 and out["reference_identical_after"] and out["server_alive"])
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
    ap.add_argument("--seed", type=int, default=0, help="seed of the clients' choices (0)")
    ap.add_argument("--log", default=None, help="write the server's log to this file")
    a = ap.parse_args(argv)
    if a.model is None:
        sys.path.insert(0, _ROOT)
        from clover_gguf import DEFAULT_MODEL

        a.model = DEFAULT_MODEL
    out = load_test(a.model, a.clients, a.duration, a.ctx_size, a.threads, a.seed, a.log)
    print(json.dumps(out, indent=1))
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
