"""A ``clover-gguf serve`` child process for tests, and plain HTTP requests to it (urllib: no
client library between the test and the server)."""
from __future__ import annotations

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[1]
HANG = 120  # seconds: generous guard against hangs, not a speed check


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Resp:
    def __init__(self, status: int, text: str, headers=None) -> None:
        self.status_code, self.text = status, text
        self.headers = {k.lower(): v for k, v in (headers or {}).items()}  # names in lower case

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body=None, headers=None, timeout: float = 30) -> Resp:
    """A plain HTTP request; ``body``: bytes as they are, anything else as JSON."""
    data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Resp(r.status, r.read().decode(), r.headers)
    except urllib.error.HTTPError as e:
        return Resp(e.code, e.read().decode(), e.headers)


def metrics(base: str) -> dict[str, float]:
    """The server's /metrics as {series: value}."""
    r = http("GET", f"{base}/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


@contextlib.contextmanager
def serving(model: str, args, log: pathlib.Path):
    """Run ``clover-gguf serve -m MODEL ARGS`` on a free loopback port until healthy; yield
    ``(base_url, process)``; the log goes to ``log`` (shown on failure)."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "clover_gguf.cli", "serve", "-m", model,
                                 "--port", str(port), *map(str, args)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + HANG
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()}"
            try:
                if http("GET", f"{base}/health", timeout=5).status_code == 200:
                    break
            except OSError:  # not listening yet
                pass
            assert time.monotonic() < deadline, f"server not healthy after {HANG} s:\n{log.read_text()}"
            time.sleep(0.2)
        yield base, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
