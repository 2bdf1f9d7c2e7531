#!/usr/bin/env python3
"""Our engine against llama.cpp on the same GGUF files, and against the bandwidth limit.

For each GGUF (arch ``qwen35moe`` so llama.cpp loads it):
- ours: ``clover_gguf.bench.run_bench`` (pp{P} from an empty context, tg{N} single-token steps
  from an empty context, warm-up first), ``--threads`` threads, ``--reps`` repetitions; with
  ``--n-depth D`` both tests start after an untimed forward of D tokens (llama-bench's ``-d``);
- llama.cpp: llama-cpp-python in its own virtual environment (bench/build_llama_cpp.sh), in a
  subprocess: ``Llama(path, n_ctx=max(1024, D + P + 1, D + N + 1), n_threads=T,
  n_threads_batch=T, n_batch=512, n_ubatch=512)`` (an fp16 KV cache, llama.cpp's default);
  pp = one ``eval()`` of P random tokens after ``reset()`` (and an untimed ``eval()`` of D),
  tg = N single-token ``eval()`` calls after the same; the same warm-up and repetitions;
- the bandwidth limit: bench/bandwidth.py's read bandwidth with ``--threads`` threads divided
  by the weight bytes read per decoded token (``clover_gguf.bench.bytes_per_token``; the KV
  cache's reads, which grow with ``--n-depth``, are not counted, so at depth it overstates the
  share of the limit).

Prints one markdown table (``--json`` for the raw figures). Tokens are random ids in
[0, n_vocab), seeded, the same for both engines.

Usage: CLOVER_LIB=... python bench/compare.py MODEL.gguf [...] [-p 512] [-n 128] [-d 0] [-r 3]
       [-t 2] [--cache-type f32|f16] [--llama-python /tmp/llama-venv/bin/python] [--bandwidth GBPS]
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys

_ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))
sys.path.insert(0, str(_ROOT / "bench"))

# Runs inside the llama.cpp venv: argv = path p n reps threads seed warmup depth; prints one JSON line.
_LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
path, P, N, reps, T, seed, warm, D = sys.argv[1], *map(int, sys.argv[2:9])
llm = Llama(model_path=path, n_ctx=max(1024, D + P + 1, D + N + 1), n_threads=T, n_threads_batch=T,
            n_batch=512, n_ubatch=512, verbose=False)
V = llm.n_vocab()
rng = np.random.default_rng(seed)
def toks(n):
    return rng.integers(0, V, n).tolist()
def reset():
    llm.reset()
    if D:
        llm.eval(toks(D))
def pp():
    reset(); t = toks(P); t0 = time.perf_counter(); llm.eval(t); return time.perf_counter() - t0
def tg(n):
    reset(); t = toks(n); s = 0.0
    for x in t:
        t0 = time.perf_counter(); llm.eval([x]); s += time.perf_counter() - t0
    return s
if warm:
    pp(); tg(1)  # warm-up, as llama-bench
out = {"pp": [pp() for _ in range(reps)], "tg": [tg(N) for _ in range(reps)],
       "system_info": __import__("llama_cpp").llama_print_system_info().decode()}
print(json.dumps(out))
"""


def run_llama(python: str, path: str, P: int, N: int, reps: int, threads: int, seed: int,
              warmup: bool = True, depth: int = 0) -> dict:
    """llama.cpp's pp/tg seconds per repetition on ``path``: ``{"pp": [s...], "tg": [s...]}``,
    each test after an untimed forward of ``depth`` tokens. Raises RuntimeError with llama.cpp's
    stderr tail when the subprocess fails."""
    r = subprocess.run([python, "-c", _LLAMA_SCRIPT, path, str(P), str(N), str(reps), str(threads), str(seed),
                        str(int(warmup)), str(depth)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed (exit {r.returncode}): {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def machine() -> dict:
    """The CPU model (/proc/cpuinfo's "model name") and what each engine uses on it (our
    clover_system_info, llama.cpp's system info once it ran), so tables from different machines
    are never mixed up."""
    from clover_gguf._ffi import ffi, lib
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ours": ffi.string(lib.clover_system_info()).decode()}


def _ms(vals):
    import numpy as np
    m = float(np.mean(vals))
    s = float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0
    return m, s


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="ours vs llama.cpp: pp/tg tokens/s and the bandwidth limit")
    ap.add_argument("models", nargs="+", help="GGUF files (arch qwen35moe)")
    ap.add_argument("-p", "--n-prompt", type=int, default=512)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-d", "--n-depth", type=int, default=0, help="tokens in the context before each test (0)")
    ap.add_argument("--cache-type", choices=("f32", "f16"), default="f32",
                    help="our KV cache type (f32, our default; llama.cpp's is f16)")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-python", default="/tmp/llama-venv/bin/python",
                    help="python of the llama-cpp-python venv (bench/build_llama_cpp.sh)")
    ap.add_argument("--bandwidth", type=float, default=None, help="read bandwidth in GB/s (measured if absent)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up run of both engines")
    ap.add_argument("--skip-llama", action="store_true", help="only our engine")
    ap.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    a = ap.parse_args(argv)
    if a.n_depth < 0:
        ap.error(f"--n-depth: {a.n_depth} must be >= 0")

    import numpy as np

    from clover_gguf.bench import run_bench

    if a.bandwidth is None:
        import bandwidth
        bw = bandwidth.measure(threads=(a.threads,))["gbps"][a.threads]
        print(f"read bandwidth ({a.threads} threads): {bw:.1f} GB/s", file=sys.stderr)
    else:
        bw = a.bandwidth
    rows, raw = [], []
    for path in a.models:
        print(f"[{path}] ours ...", file=sys.stderr, flush=True)
        rep = run_bench(path, n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.reps, n_threads=a.threads,
                        seed=a.seed, block=False, commit=False, warmup=not a.no_warmup, n_depth=a.n_depth,
                        type_k=a.cache_type, type_v=a.cache_type)
        s = rep["model"]
        ours_pp, ours_tg = rep["results"][0], rep["results"][1]
        entry = {"model": s, "ours": {"pp": ours_pp.seconds, "tg": ours_tg.seconds}}
        if not a.skip_llama:
            print(f"[{path}] llama.cpp ...", file=sys.stderr, flush=True)
            entry["llama"] = run_llama(a.llama_python, os.fspath(path), a.n_prompt, a.n_gen, a.reps,
                                       a.threads, a.seed, not a.no_warmup, a.n_depth)
        raw.append(entry)
        limit = bw * 1e9 / s["bytes_per_token"]  # tokens/s if decode only streamed the weights
        o_pp = _ms([a.n_prompt / x for x in ours_pp.seconds])
        o_tg = _ms([a.n_gen / x for x in ours_tg.seconds])
        if "llama" in entry:
            l_pp = _ms([a.n_prompt / x for x in entry["llama"]["pp"]])
            l_tg = _ms([a.n_gen / x for x in entry["llama"]["tg"]])
        else:
            l_pp = l_tg = (float("nan"), 0.0)
        rows.append([s["file"], s["type"], f"{o_pp[0]:.2f} ± {o_pp[1]:.2f}", f"{l_pp[0]:.2f} ± {l_pp[1]:.2f}",
                     f"{o_pp[0] / l_pp[0]:.2f}x", f"{o_tg[0]:.2f} ± {o_tg[1]:.2f}", f"{l_tg[0]:.2f} ± {l_tg[1]:.2f}",
                     f"{o_tg[0] / l_tg[0]:.2f}x", f"{100 * o_tg[0] / limit:.0f}%", f"{100 * l_tg[0] / limit:.0f}%",
                     f"{s['bytes_per_token'] / 1e6:.0f} MB / {limit:.1f} t/s"])
    at = f" @ d{a.n_depth}" if a.n_depth else ""  # llama-bench's label
    P, N = f"{a.n_prompt}{at}", f"{a.n_gen}{at}"
    head = ["model", "type", f"ours pp{P}", f"llama.cpp pp{P}", "ratio", f"ours tg{N}", f"llama.cpp tg{N}",
            "ratio", f"ours tg{N} % BW limit", f"llama.cpp % BW limit", "bytes/token / limit"]
    w = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    mach = machine()
    llama_info = next((e["llama"].get("system_info") for e in raw if "llama" in e), None)
    print(f"cpu: {mach['cpu']} ({mach['cores']} cores visible); ours: {mach['ours']}"
          + (f"; llama.cpp: {llama_info.strip()}" if llama_info else ""))
    print(f"threads: {a.threads}, repetitions: {a.reps}, warm-up: {not a.no_warmup}, our KV cache: {a.cache_type}, "
          f"read bandwidth: {bw:.1f} GB/s; t/s mean ± std")
    print("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    print("| " + " | ".join("-" * w[i] if i < 2 else "-" * (w[i] - 1) + ":" for i in range(len(head))) + " |")
    for r in rows:
        print("| " + " | ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(r)) + " |")
    if a.json:
        print(json.dumps({"machine": mach, "bandwidth_gbps": bw, "threads": a.threads, "reps": a.reps, "n_depth": a.n_depth,
                          "cache_type": a.cache_type, "runs": raw},
                         default=lambda o: None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
