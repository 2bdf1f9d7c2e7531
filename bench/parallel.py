#!/usr/bin/env python3
"""Aggregate decoding speed of concurrent streams through a server: ours (``clover-gguf serve
-np N``) and, where given, llama.cpp's ``llama-server -np N`` (continuous batching) on the same
GGUF file and load.

For each server: start it on a free 127.0.0.1 port with ``-np max(--clients)`` slots and
``--threads`` threads, wait for ``/health``, send one warm-up request, then for each N in
``--clients`` send N concurrent ``/v1/completions`` requests (one prompt, PROMPT, greedy,
``max_tokens`` = ``-n``, not streamed; ours with ``mode`` = ``--mode``) and time from the first
send to the last answer. Aggregate tokens/s = the answers' ``usage.completion_tokens`` summed over
that time; the table shows it per N and as a multiple of N = 1 (the batching gain), for each
server, and the ratio ours / llama.cpp.

Usage: python bench/parallel.py MODEL.gguf [--clients 1,2,4,8] [-n 64] [--mode ar|diffusion|spec]
       [--threads 2] [--ctx 1024] [--llama-server /path/to/llama-server] [--json] [--log PREFIX]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

_ROOT = pathlib.Path(__file__).resolve().parents[1]
# One prompt for every stream: a stream's tokens per forward (diffusion, spec) depend on its text,
# so with one text the aggregate speeds of 1..N streams differ by the batching alone.
PROMPT = "The history of the city begins"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 1800) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_health(url: str, proc: subprocess.Popen, limit: float = 600) -> None:
    t_end = time.time() + limit
    while time.time() < t_end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become healthy")


def _load(url: str, n: int, max_tokens: int, extra: dict) -> tuple[float, int]:
    """n concurrent greedy completions: (seconds from first send to last answer, tokens)."""
    tokens, errors = [0] * n, []

    def one(i):
        try:
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
            tokens[i] = int(_post(url + "/v1/completions", body)["usage"]["completion_tokens"])
        except Exception as e:  # noqa: BLE001 - reported after the run
            errors.append(repr(e))

    ts = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    dt = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
    return dt, sum(tokens)


def run_server(cmd: list[str], port: int, clients: list[int], max_tokens: int, extra: dict, log: str) -> dict:
    """The loads of ``clients`` against the server ``cmd`` (its output into the file ``log``)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_health(url, proc)
        _load(url, 1, 8, extra)  # warm-up
        out = {}
        for n in clients:
            dt, tok = _load(url, n, max_tokens, extra)
            out[n] = {"seconds": dt, "tokens": tok, "tps": tok / dt}
            print(f"  {n} streams: {tok} tokens in {dt:.1f} s = {tok / dt:.2f} t/s", file=sys.stderr, flush=True)
        return out
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--mode", choices=("ar", "diffusion", "spec"), default="ar")
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=1024, help="context tokens per slot")
    ap.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary (a peer in the same run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--log", default="/tmp/parallel-server.log", help="the servers' output: LOG.ours, LOG.llama")
    a = ap.parse_args(argv)
    clients = [int(x) for x in a.clients.split(",")]
    npar = max(clients)
    res = {}
    port = _free_port()
    print(f"[ours, mode {a.mode}]", file=sys.stderr, flush=True)
    res["ours"] = run_server([sys.executable, "-m", "clover_gguf", "serve", "-m", a.model, "--port", str(port),
                              "-np", str(npar), "-c", str(a.ctx), "-t", str(a.threads), "--mode", a.mode,
                              "--no-prefix-reuse"], port, clients, a.max_tokens, {"mode": a.mode}, a.log + ".ours")
    if a.llama_server:
        port = _free_port()
        print("[llama.cpp llama-server]", file=sys.stderr, flush=True)
        res["llama.cpp"] = run_server([a.llama_server, "-m", a.model, "--port", str(port), "-np", str(npar),
                                       "-c", str(a.ctx * npar), "-t", str(a.threads), "-tb", str(a.threads),
                                       "--no-warmup"], port, clients, a.max_tokens, {"ignore_eos": True},
                                      a.log + ".llama")
    if a.json:
        print(json.dumps(res))
        return 0
    names = list(res)
    head = "| streams | " + " | ".join(f"{k} t/s | {k} vs 1 stream" for k in names)
    head += " | ours / llama.cpp |" if len(names) == 2 else " |"
    print(f"model: {os.path.basename(a.model)}, mode {a.mode}, {a.threads} threads, {a.max_tokens} tokens a request")
    print(head)
    print("|" + "---:|" * (1 + 2 * len(names) + (len(names) == 2)))
    for n in clients:
        row = f"| {n} | " + " | ".join(f"{res[k][n]['tps']:.2f} | {res[k][n]['tps'] / res[k][clients[0]]['tps']:.2f}x"
                                        for k in names)
        row += f" | {res['ours'][n]['tps'] / res['llama.cpp'][n]['tps']:.2f}x |" if len(names) == 2 else " |"
        print(row)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(_ROOT))
    sys.exit(main())
