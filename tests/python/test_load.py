"""Load and faults, short versions that fit the default test run.

- the server under a loopback load (bench/load_test.py: 8 concurrent clients for 10 s, with
  streams dropped mid-way, malformed JSON, impossible parameters and hostile clients) gives
  every request an intended answer, keeps answering /health, has no stuck slot afterwards,
  gives the greedy reference answer unchanged, and its RSS stays near the level before the load;
- each hostile request of bench/load_test.py, alone, gets its intended answer: bodies over
  ``--max-body`` 413 (or a closed connection once past the limit), 1-2 MB prompts and prompts
  of more tokens than the context 400 ``context_length_exceeded``, deeply nested JSON 400, a
  slow reader's stream 200, and a burst over ``--max-queue`` 503 with Retry-After;
- repeated load/close cycles of a Model keep this process's RSS near its level after the
  first cycle;
- greedy (and seeded sampled) output is identical for a request run alone, after another
  request, beside another generation in a second thread, and for 1 or 2 threads, in ar,
  diffusion and spec modes.

The model is the embedded clover-tiny (no torch). The bounds on RSS are generous on purpose
(allocator arenas and caches grow a little); a leak of the model per cycle or of a decoder per
request would exceed them. No timing is asserted.
"""
from __future__ import annotations

import gc
import importlib.util
import pathlib
import random
import threading

import pytest

from clover_gguf import DEFAULT_MODEL, Clover, Model

_ROOT = pathlib.Path(__file__).resolve().parents[2]
SERVER_RSS_BOUND_MB = 100.0   # server RSS after the load <= before + this
HEALTH_BOUND_S = 10.0         # the slowest /health answer under load (the bench's own check: 1 s)
CYCLE_RSS_BOUND_MB = 40.0     # RSS after 30 load/close cycles <= after the first + this (model: 9.3 MB)
PROMPT = "def parse(text):\n"
OTHER = "class Config:\n    def __init__(self):\n"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS")


def _load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", _ROOT / "bench" / "load_test.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------- server
def test_server_under_load(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    lt = _load_test_module()
    log = tmp_path / "server.log"
    out = lt.load_test(DEFAULT_MODEL, clients=8, duration=10.0, n_ctx=512, threads=1, seed=1, log_path=str(log))
    print(out)
    assert out["server_alive"], log.read_text()[-3000:]
    assert out["http_500"] == 0 and out["unexpected_errors"] == 0, (out["error_examples"], log.read_text()[-3000:])
    assert out["ok"] == out["requests"]
    for kind in ("completion", "chat_stream", "stream_disconnect", "malformed_json", "bad_param"):
        assert out["requests"].get(kind, 0) > 0, (kind, out["requests"])  # every kind was exercised
    assert out["server_cancelled"] > 0  # dropped streams were cancelled on the server
    assert out["checks"]["idle_after"]  # no active, queued or pending request: no stuck slot
    assert out["reference_identical_after"]
    assert out["health"]["polls"] > 0 and out["health"]["failures"] == 0, out["health"]
    assert out["health"]["max_s"] < HEALTH_BOUND_S, out["health"]
    assert out["rss_after_mb"] <= out["rss_before_mb"] + SERVER_RSS_BOUND_MB, out


@pytest.fixture(scope="module")
def limited_server(tmp_path_factory):
    """A server with small limits: 2 MiB bodies, 2 waiting requests."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    lt = _load_test_module()
    log = tmp_path_factory.mktemp("load") / "server.log"
    proc, base = lt.start_server(DEFAULT_MODEL, n_ctx=512, threads=1, log_path=str(log), max_body=2 << 20,
                                 max_queue=2, request_timeout=30)
    try:
        t = lt.Target(base, lt.reference_text(base), n_ctx=512, max_body=2 << 20, timeout=120.0)
        yield lt, t, log
    finally:
        lt.stop_server(proc)


class _Low(random.Random):
    """Picks the low end of every range: the shortest slow read, the smallest excess body."""

    def randint(self, a, b):
        return a

    def uniform(self, a, b):
        return a


@pytest.mark.parametrize("kind, variant", [(k, v) for k, vs in
                                           [("big_body", ("declared", "declared_sent", "chunked_slow")),
                                            ("big_prompt", ("bytes", "bytes_chat", "tokens", "ids")),
                                            ("deep_json", ("deep_field", "deep_tools"))] for v in vs])
def test_hostile_request(limited_server, kind, variant):
    lt, t, log = limited_server
    assert variant in lt.VARIANTS[kind]
    [(label, why, *detail)] = lt.KIND_FUNCS[kind](t, _Low(0), {"user": "hostile"}, variant=variant)
    assert why is None, (label, why, detail, log.read_text()[-2000:])
    want = {"big_body": ("413 request_too_large", "closed"), "big_prompt": ("400 context_length_exceeded",),
            "deep_json": ("400 invalid_json", "400 invalid_value")}[kind]
    assert label in want, (label, detail)


def test_slow_reader_and_queue_flood(limited_server):
    lt, t, log = limited_server
    [(label, why, *_)] = lt.KIND_FUNCS["slow_reader"](t, _Low(0), {})
    assert (label, why) == ("200", None)
    flood = lt.KIND_FUNCS["queue_flood"](t, _Low(0), {})
    assert len(flood) == lt.FLOOD and all(r[1] is None for r in flood), flood
    labels = [r[0] for r in flood]
    assert "200" in labels and "503 queue_full" in labels, labels  # 2 waiting at most: the rest shed
    m = lt.wait_idle(t.base)
    assert lt._busy(m) == 0, m


# ---------------------------------------------------------------------------- load / close
def test_model_load_close_cycles_rss():
    def cycle():
        with Model(DEFAULT_MODEL, n_ctx=256, n_threads=1) as m:
            assert m.generate(PROMPT, max_tokens=8, mode="ar")
        with Clover(DEFAULT_MODEL, n_ctx=256, n_threads=1) as c:
            assert c.create_completion(PROMPT, max_tokens=8)["choices"][0]["finish_reason"]
        gc.collect()

    cycle()
    base = _rss_mb()
    for _ in range(30):
        cycle()
    after = _rss_mb()
    assert after <= base + CYCLE_RSS_BOUND_MB, (base, after)


# ---------------------------------------------------------------------------- identical output
def _gen(m: Model, mode: str, sampled: bool, prompt: str = PROMPT) -> list[int]:
    kw = dict(temperature=0.8, top_k=40, seed=7) if sampled else {}
    ids, st = m.generate_tokens(m.tokenize(prompt), max_tokens=40, mode=mode, **kw)
    assert st["n_generated"] > 0
    return ids


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_output_independent_of_history_neighbours_and_threads(mode, sampled):
    with Model(DEFAULT_MODEL, n_ctx=256, n_threads=1) as m:
        alone = _gen(m, mode, sampled)
        _gen(m, mode, sampled, OTHER)  # another request first
        after = _gen(m, mode, sampled)
        assert after == alone
        # beside another generation running in a second thread (its own Model)
        with Model(DEFAULT_MODEL, n_ctx=256, n_threads=1) as other:
            box = {}
            t = threading.Thread(target=lambda: box.update(ids=_gen(other, mode, sampled, OTHER)))
            t.start()
            beside = _gen(m, mode, sampled)
            t.join()
            assert beside == alone and box["ids"]
    with Model(DEFAULT_MODEL, n_ctx=256, n_threads=2) as m2:
        assert _gen(m2, mode, sampled) == alone  # thread count does not change the output
