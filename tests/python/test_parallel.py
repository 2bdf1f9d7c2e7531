"""Several sequences at once (``n_parallel``): slots of one model whose forwards run through one
continuous batch (clover.h ``clover_batch_new``). The reference of every sequence is its solo
run: the same request on a model with one context, or alone. Greedy decoding, so the outputs
must be equal token for token."""
from __future__ import annotations

import http.client as httpclient
import json
import random
import subprocess
import sys
import threading
import time

import pytest

import clover_gguf
from clover_gguf import Clover, CloverError, Model
from clover_gguf import model as model_mod
from clover_gguf.state import unpack_state

MODES = ("ar", "diffusion", "spec")
N_CTX = 1536


def _requests(rng: random.Random, n: int, n_vocab: int) -> list[dict]:
    """``n`` random greedy requests: a prompt of 3-40 random ids, a mode, 2-16 tokens."""
    return [dict(ids=[rng.randrange(10, n_vocab) for _ in range(rng.randrange(3, 41))], mode=rng.choice(MODES),
                 max_tokens=rng.randrange(2, 17)) for _ in range(n)]


def _generate(m: Model, r: dict) -> list[int]:
    return m.generate_tokens(r["ids"], mode=r["mode"], max_tokens=r["max_tokens"], temperature=0, end_ids=[])[0]


def _at_once(fn, args) -> list:
    """``fn(a)`` for every ``a`` of ``args``, each in its own thread, started together."""
    out, errors = [None] * len(args), []
    start = threading.Barrier(len(args))

    def work(k):
        try:
            start.wait()
            out[k] = fn(args[k])
        except BaseException as e:  # reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)
    return out


@pytest.fixture(scope="module")
def solo():
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1) as m:
        yield m


@pytest.fixture(scope="module")
def slots():
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1, n_parallel=8) as m:
        yield m


def test_concurrent_sequences_equal_their_solo_outputs(solo, slots):
    """N = 1..8 concurrent greedy requests in random mode mixes (seeded prompts, modes and
    lengths) give exactly the tokens each gives alone on a one-context model; the batch's
    stats show passes shared by several sequences (the forwards did run together)."""
    rng = random.Random(37)
    before = slots.batch_stats()
    for n in range(1, 9):
        reqs = _requests(rng, n, solo.n_vocab)
        want = [_generate(solo, r) for r in reqs]
        got = _at_once(lambda r: _generate(slots, r), reqs)
        assert got == want, f"N={n}: {[r['mode'] for r in reqs]}"
    after = slots.batch_stats()
    assert after["n_shared"] > before["n_shared"] and after["max_entries"] >= 2, after
    assert after["n_entries"] > after["n_passes"] >= 1  # more sequence forwards than passes
    assert solo.batch_stats() is None


def test_a_call_takes_the_slot_sharing_its_prefix():
    """With prefix reuse, a prompt extending an earlier one goes to that one's slot
    (llama-server's slot choice) and skips its prefill there."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=N_CTX, n_threads=1, n_parallel=3, prefix_reuse=True) as m:
        rng = random.Random(1)
        base = [[rng.randrange(10, m.n_vocab) for _ in range(130)] for _ in range(3)]
        firsts = [m.generate_tokens(b, mode="ar", max_tokens=2, temperature=0)[1]["id_slot"] for b in base]
        assert sorted(firsts) == [0, 1, 2]  # empty slots first
        for b, slot in reversed(list(zip(base, firsts))):
            _, st = m.generate_tokens(b + [11, 12, 13], mode="ar", max_tokens=2, temperature=0)
            assert st["id_slot"] == slot and st["n_prompt_reused"] == 128, st


def test_cancel_of_one_sequence_leaves_the_others(solo, slots):
    """Generation.cancel() stops its own stream (finish_reason cancelled, a prefix of its solo
    tokens) while three others running beside it give their solo outputs."""
    rng = random.Random(5)
    kw = dict(temperature=0, logit_bias={t: -100.0 for t in solo.end_ids}, max_tokens=40)
    reqs = [([rng.randrange(10, solo.n_vocab) for _ in range(12)], mode) for mode in ("ar", "diffusion", "spec", "ar")]
    want = [solo.generate_tokens(ids, mode=mode, **kw)[0] for ids, mode in reqs]
    gens = [slots.generate_stream(ids, mode=mode, **kw) for ids, mode in reqs]

    def consume(k):
        for n, _ in enumerate(gens[k]):
            if k == 3 and n == 0:
                assert gens[k].cancel()
        return gens[k].stats["tokens"]
    got = _at_once(consume, list(range(4)))
    assert got[:3] == want[:3]
    assert [g.stats["finish_reason"] for g in gens] == ["length"] * 3 + ["cancelled"]
    assert 0 < len(got[3]) < 40 and got[3] == want[3][:len(got[3])]
    assert not gens[3].cancel()  # ended: nothing to cancel


def test_cancel_before_start_runs_no_prefill(slots):
    g = slots.generate_stream([5, 6, 7], mode="ar", max_tokens=4)
    assert g.cancel()
    assert list(g) == [] and g.stats["finish_reason"] == "cancelled" and g.stats["n_forward"] == 0


def test_memory_for_n_contexts_is_checked(monkeypatch):
    """n_parallel contexts must fit the memory available: refused naming n_parallel."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1) as one:
        each = one.context_bytes
    assert each > 0
    monkeypatch.setattr(model_mod, "available_bytes", lambda: int(each * 2.5))
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1, n_parallel=2) as m:
        assert m.n_parallel == 2 and len(m.slot_busy()) == 2
    with pytest.raises(CloverError, match=r"n_parallel: 3 contexts of n_ctx=256 need .*\(3 x "):
        Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1, n_parallel=3)
    with pytest.raises(ValueError, match="n_parallel"):
        Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_parallel=0)


def test_slot_argument_is_checked(solo, slots):
    """save_state / load_state / reset(slot): with n_parallel > 1 the slot is required and in
    0..n_parallel-1; with n_parallel=1 it may be left out or be 0. Refused naming ``slot``."""
    for bad, msg in ((None, r"slot: required with n_parallel=8 \(0..7\)"), (8, "slot: 8 must be <= 7"),
                     (-1, "slot: -1 must be >= 0"), (True, "slot: expected an integer"), (1.0, "slot: expected")):
        with pytest.raises(ValueError, match=msg):
            slots.save_state(slot=bad)
        with pytest.raises(ValueError, match=msg):
            slots.load_state(b"", slot=bad)
        if bad is not None:
            with pytest.raises(ValueError, match=msg):
                slots.reset(slot=bad)
    assert solo.save_state(slot=0) == solo.save_state()
    with pytest.raises(ValueError, match="slot: 1 must be <= 0"):
        solo.save_state(slot=1)


def test_slot_state_loads_into_another_slot():
    """A state saved from one slot and loaded into another (after every slot was emptied) saves
    back to the same bytes, and the next greedy generation, a prompt extending the saved one, runs
    on that slot, reuses the saved prefix and gives the tokens and reuse count of a one-context
    model that saw the saved prompt (the reference, with prefix reuse as well)."""
    rng = random.Random(21)
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=512, n_threads=1, prefix_reuse=True) as one, \
            Model(clover_gguf.DEFAULT_MODEL, n_ctx=512, n_threads=1, prefix_reuse=True, n_parallel=3) as m:
        p = [rng.randrange(10, m.n_vocab) for _ in range(150)]
        ext = p + [rng.randrange(10, m.n_vocab) for _ in range(20)]
        kw = dict(mode="ar", max_tokens=6, temperature=0)
        one.generate_tokens(p, **kw)
        want, wst = one.generate_tokens(ext, **kw)
        assert wst["n_prompt_reused"] == 128
        _, st = m.generate_tokens(p, **kw)
        state = m.save_state(slot=st["id_slot"])
        other = (st["id_slot"] + 2) % 3
        assert m.reset() > len(p)  # every slot emptied: the tokens they held
        m.load_state(state, slot=other)
        assert m.save_state(slot=other) == state
        got, gst = m.generate_tokens(ext, **kw)
        assert (got, gst["id_slot"], gst["n_prompt_reused"]) == (want, other, 128)
        # a state loaded for a prompt_cache_key is reused by that key's calls alone
        m.reset()
        m.load_state(state, slot=1, prompt_cache_key="a")
        assert m.generate_tokens(ext, prompt_cache_key="b", **kw)[1]["n_prompt_reused"] == 0
        _, st = m.generate_tokens(ext, prompt_cache_key="a", **kw)
        assert (st["id_slot"], st["n_prompt_reused"]) == (1, 128)


def test_slot_actions_wait_for_the_call_holding_the_slot():
    """save_state(slot) on a slot a stream holds waits until the stream ends (llama-server defers
    a slot action on a busy slot), while the other slot answers at once; reset(slot) empties that
    slot alone and returns the tokens it held."""
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1, n_parallel=2) as m:
        ban = {t: -100.0 for t in m.end_ids}
        g = m.generate_stream([5, 6, 7], mode="ar", max_tokens=50, temperature=0, logit_bias=ban)
        next(g)
        i = m.slot_busy().index(True)
        saved = []
        t = threading.Thread(target=lambda: saved.append(m.save_state(slot=i)))
        t.start()
        t.join(0.5)
        assert t.is_alive() and not saved
        assert unpack_state(m.save_state(slot=1 - i), m.n_vocab)[0] == []
        g.close()
        t.join(60)
        assert not t.is_alive()
        ids = unpack_state(saved[0], m.n_vocab)[0]
        assert ids[:3] == [5, 6, 7] and len(ids) > 3
        assert m.reset(slot=1 - i) == 0 and m.reset(slot=i) == len(ids) and m.reset(slot=i) == 0


def test_close_with_slots():
    m = Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1, n_parallel=2)
    g = m.generate_stream([5, 6, 7], mode="ar", max_tokens=50)
    next(g)
    m.close()  # with a stream paused on a slot
    with pytest.raises(CloverError, match="closed"):
        list(g)


def test_clover_threads_and_stream_cancel(solo):
    """Clover(n_parallel=3): completions from three threads equal their solo answers, one
    stream cancelled alone by its Stream.cancel()."""
    rng = random.Random(9)
    prompts = [[rng.randrange(10, solo.n_vocab) for _ in range(10)] for _ in range(3)]
    ban = {t: -100.0 for t in solo.end_ids}
    with Clover(n_ctx=N_CTX, n_threads=1, mode="ar", n_parallel=3) as llm:
        want = [llm.create_completion(p, max_tokens=30, logit_bias=ban)["choices"][0]["text"] for p in prompts]

        def call(k):
            if k < 2:
                return llm.create_completion(prompts[k], max_tokens=30, logit_bias=ban)["choices"][0]["text"]
            it = llm.create_completion(prompts[k], max_tokens=30, logit_bias=ban, stream=True)
            chunks = []
            for c in it:
                chunks.append(c)
                it.cancel()
            return chunks
        got = _at_once(call, [0, 1, 2])
        assert got[:2] == want[:2]
        assert got[2][-1]["choices"][0]["finish_reason"] == "cancelled"


def test_clover_state_of_a_slot(solo):
    """Clover(n_parallel=2): save_state / load_state / reset take the slot (required, ValueError
    naming it without); a slot's state loads into the other slot and saves back the same."""
    with Clover(n_ctx=256, n_threads=1, mode="ar", n_parallel=2) as llm:
        llm.create_completion([5, 6, 7, 8], max_tokens=4)
        i = next(k for k in range(2) if unpack_state(llm.engine.save_state(slot=k), llm.engine.n_vocab)[0])
        with pytest.raises(ValueError, match="slot"):
            llm.save_state()
        st = llm.save_state(slot=i)
        assert list(st.input_ids[:4]) == [5, 6, 7, 8] and st.n_tokens > 4
        llm.reset(slot=i)
        assert unpack_state(llm.engine.save_state(slot=i), llm.engine.n_vocab)[0] == []
        llm.load_state(st, slot=1 - i)
        assert llm.save_state(slot=1 - i).llama_state == st.llama_state


def test_long_prompt_does_not_stall_running_streams():
    """A 1536-token prompt arriving while a stream decodes is prefilled in chunks beside the
    stream's steps, at most n_ubatch (128) rows a pass: the largest gap between the stream's
    tokens while it is prefilled stays within 4x the time of one 128-row prefill (the median of
    three, measured alone in this test) plus the batch's longest wait for a straggler (50 ms).
    A gap holds up to two passes (one of the prompt's rows alone while the stream's thread hands
    out its token, one shared), so 4x is generous for a shared, noisy machine; the whole prefill
    alone takes longer than the bound, so a stream stalled for it fails."""
    rng = random.Random(3)
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=2048, n_threads=1, n_parallel=2, n_ubatch=128) as m:
        ban = {t: -100.0 for t in m.end_ids}
        long = [rng.randrange(10, m.n_vocab) for _ in range(1536)]
        short = [rng.randrange(10, m.n_vocab) for _ in range(8)]

        def timed(fn):
            times = []
            for _ in range(3):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return sorted(times)
        t_chunk = timed(lambda: m.generate_tokens(long[:128], mode="ar", max_tokens=1, temperature=0))[1]
        t_whole = timed(lambda: m.generate_tokens(long, mode="ar", max_tokens=1, temperature=0))[0]
        bound = 4 * t_chunk + 0.05
        stamps: list[float] = []
        window: list[float] = []

        def stream():
            for _ in m.generate_stream(short, mode="ar", max_tokens=2000, temperature=0, logit_bias=ban):
                stamps.append(time.perf_counter())
                if window and len(window) == 2:
                    break

        t = threading.Thread(target=stream)
        t.start()
        while len(stamps) < 5:
            time.sleep(0.001)
        window.append(time.perf_counter())
        m.generate_tokens(long, mode="ar", max_tokens=1, temperature=0)
        window.append(time.perf_counter())
        t.join(60)
        inside = [s for s in stamps if window[0] <= s <= window[1]]
        gaps = [b - a for a, b in zip([window[0]] + inside, inside + [window[1]])]
        assert t_whole > bound, (t_whole, t_chunk)  # a stall of the whole prefill fails below
        assert len(inside) >= 3 and max(gaps) <= bound, (max(gaps), bound, len(inside), t_chunk, t_whole)


# ------------------------------------------------------------------------------ the server
fastapi = pytest.importorskip("fastapi", reason="the server tests need fastapi")
from serverproc import HANG, http, metrics, serving  # noqa: E402


def _complete(base, body):
    r = http("POST", f"{base}/v1/completions", body, timeout=HANG)
    assert r.status_code == 200, r.text[:500]
    return r.json()


def _stream_then_leave(base, body) -> str:
    """Start a streamed completion, read its first event, then disconnect."""
    host, port = base.removeprefix("http://").split(":")
    c = httpclient.HTTPConnection(host, int(port), timeout=HANG)
    c.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
              {"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    first = r.readline().decode()
    c.close()
    return first


def test_server_slots(tmp_path, solo):
    """``serve -np 4``: four concurrent requests in mixed modes give their solo answers while a
    fifth client disconnects mid-stream (its generation alone is cancelled); /metrics shows the
    slots and the batch's shared passes."""
    rng = random.Random(11)
    ban = {str(t): -100.0 for t in solo.end_ids}
    bodies = [dict(prompt=[rng.randrange(10, solo.n_vocab) for _ in range(rng.randrange(4, 30))], mode=mode,
                   max_tokens=24, temperature=0, logit_bias=ban) for mode in ("ar", "diffusion", "spec", "ar")]
    with serving(clover_gguf.DEFAULT_MODEL, ["-np", 4, "-c", N_CTX, "-t", 1], tmp_path / "server.log") as (base, _):
        want = [_complete(base, b)["choices"][0]["text"] for b in bodies]
        leaving = dict(prompt=[7, 8, 9], mode="ar", max_tokens=1000, temperature=0, logit_bias=ban)
        got = _at_once(lambda b: _complete(base, b) if b is not leaving else _stream_then_leave(base, b),
                       bodies + [leaving])
        assert [g["choices"][0]["text"] for g in got[:4]] == want
        assert got[4].startswith("data: ")
        deadline = time.monotonic() + 30
        while (mt := metrics(base))["clover_requests_active"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mt["clover_requests_cancelled_total"] == 1 and mt["clover_slots_total"] == 4
        assert [mt[f'clover_slot_busy{{slot="{i}"}}'] for i in range(4)] == [0] * 4
        assert sum(mt[f'clover_slot_tokens_generated_total{{slot="{i}"}}'] for i in range(4)) >= 8 * 24
        assert mt["clover_batch_shared_passes_total"] > 0 and mt["clover_batch_max_sequences"] >= 2
        r = http("GET", f"{base}/slots")
        assert r.status_code == 200 and r.json() == [{"id": i, "n_ctx": N_CTX, "is_processing": False} for i in range(4)]
        # without --slot-save-path the slot actions are off: llama-server's 501
        r = http("POST", f"{base}/slots/0?action=save", {"filename": "a.bin"})
        assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", r.text
        assert r.json()["error"]["message"] == \
            "This server does not support slots action. Start it with `--slot-save-path`"
    assert "context memory: 4 slots x " in (tmp_path / "server.log").read_text()


def test_server_plans_the_slots_memory(monkeypatch, capsys):
    """The server's load prints the N contexts' memory in one line, and refuses N contexts that
    do not fit the memory available with the engine's message naming n_parallel."""
    from clover_gguf.server import create_app
    with Model(clover_gguf.DEFAULT_MODEL, n_ctx=256, n_threads=1) as one:
        each = one.context_bytes
    monkeypatch.setattr(model_mod, "available_bytes", lambda: int(each * 2.5))
    ok = create_app(clover_gguf.DEFAULT_MODEL, n_parallel=2, n_ctx=256, n_threads=1).state.clover
    ok.load()
    try:
        assert ok.load_error is None
        line = f"context memory: 2 slots x {each / 2**20:.1f} MiB (n_ctx 256) = {2 * each / 2**20:.1f} MiB"
        assert line in capsys.readouterr().err
    finally:
        ok.clover.close()
    bad = create_app(clover_gguf.DEFAULT_MODEL, n_parallel=3, n_ctx=256, n_threads=1).state.clover
    bad.load()
    assert bad.clover is None and "n_parallel: 3 contexts of n_ctx=256 need" in str(bad.load_error)
    assert "n_parallel: 3 contexts" in capsys.readouterr().err


def test_server_slot_actions(tmp_path):
    """``serve -np 2 --slot-save-path DIR``: llama-server's slot actions. A slot saved to a file,
    erased, and restored into the other slot serves a prompt extending the saved one there with
    the saved prefix reused and the answer it gave from the original cache; file names stay inside
    DIR; bad slot ids, actions, names and files are 400s naming the field."""
    rng = random.Random(13)
    save_dir = tmp_path / "slots"
    save_dir.mkdir()
    p = [rng.randrange(10, 1000) for _ in range(150)]
    ext = dict(prompt=p + [rng.randrange(10, 1000) for _ in range(20)], mode="ar", max_tokens=6, temperature=0)
    with serving(clover_gguf.DEFAULT_MODEL, ["-np", 2, "-c", 512, "-t", 1, "--slot-save-path", save_dir],
                 tmp_path / "server.log") as (base, _):
        def act(slot, action, body=None):
            return http("POST", f"{base}/slots/{slot}?action={action}", body, timeout=HANG)

        a = _complete(base, dict(ext, prompt=p))["timings"]["id_slot"]
        r = act(a, "save", {"filename": "p.bin"})
        size = (save_dir / "p.bin").stat().st_size
        assert r.status_code == 200 and size > 0, r.text
        saved = r.json()
        assert {k: saved[k] for k in ("id_slot", "filename", "n_written")} == dict(id_slot=a, filename="p.bin",
                                                                                 n_written=size)
        assert saved["n_saved"] > len(p) and saved["timings"]["save_ms"] >= 0
        want = _complete(base, ext)
        assert want["timings"]["id_slot"] == a and want["timings"]["n_prompt_reused"] == 128
        r = act(a, "erase")
        assert r.status_code == 200 and r.json()["id_slot"] == a and r.json()["n_erased"] > len(p), r.text
        assert act(1 - a, "erase").json() == {"id_slot": 1 - a, "n_erased": 0}
        r = act(1 - a, "restore", {"filename": "p.bin"})
        assert r.status_code == 200, r.text
        assert {k: r.json()[k] for k in ("id_slot", "filename", "n_restored", "n_read")} == \
            dict(id_slot=1 - a, filename="p.bin", n_restored=saved["n_saved"], n_read=size)
        got = _complete(base, ext)
        assert got["timings"]["id_slot"] == 1 - a and got["timings"]["n_prompt_reused"] == 128
        assert got["choices"][0]["text"] == want["choices"][0]["text"]
        (save_dir / "junk.bin").write_bytes(b"not a state")
        for slot, action, body, param in ((2, "save", {"filename": "x"}, "id_slot"), ("x", "save", {}, "id_slot"),
                                          (0, "bogus", {}, "action"), (0, "save", {}, "filename"),
                                          (0, "save", {"filename": "../x"}, "filename"),
                                          (0, "save", {"filename": "a/b"}, "filename"),
                                          (0, "save", {"filename": ".."}, "filename"),
                                          (0, "restore", {"filename": "none.bin"}, "filename"),
                                          (0, "restore", {"filename": "junk.bin"}, "state")):
            r = act(slot, action, body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (slot, action, body, r.text)
        assert sorted(x.name for x in tmp_path.iterdir()) == ["server.log", "slots"]
        assert sorted(x.name for x in save_dir.iterdir()) == ["junk.bin", "p.bin"]
        assert http("GET", f"{base}/slots?fail_on_no_slot=1").status_code == 200
    r = subprocess.run([sys.executable, "-m", "clover_gguf.cli", "serve", "--slot-save-path", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=HANG)
    assert r.returncode == 2 and "--slot-save-path: " in r.stderr and "is not a directory" in r.stderr, r.stderr
