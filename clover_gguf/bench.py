"""llama-bench-style throughput measurement of the native engine.

Tests (all from random valid token ids, seeded):

- ``pp{n_prompt}``: one prefix-mode forward (spec 3.2) of ``n_prompt`` tokens from an empty
  context, last-row logits only (as llama-bench's prompt test); tokens/s = n_prompt / time.
- ``tg{n_gen}``: ``n_gen`` single-token prefix-mode forwards starting from an empty context,
  each with its logits (llama-bench's generation test); tokens/s = n_gen / time.
- ``block{B}``: one B-row block-mode forward (spec 3.3, coreset routing 5.6 at
  ``coreset_top_p``) with all-mask rows, after an ``n_prompt``-token prefix; clover files only.
  Reported in ms and as a multiple of one tg step (1 / tg tokens/s).
- ``commit{B}``: one B-row prefix-mode forward (the commit pass of a diffusion block) right
  after the same ``n_prompt``-token prefix, last-row logits.

Each repetition resets the context, times pp, then (at n_past = D + n_prompt) block and commit;
tg runs separately from an empty context. As llama-bench, ``n_prompt`` and ``n_gen`` may be
lists (a pp, block and commit test per n_prompt, a tg test per n_gen; 0 skips), and
:func:`run_grid` runs the cartesian product of lists of the other parameters. With ``n_depth`` D > 0 (llama-bench's ``-d``), every
test starts instead after an untimed prefix-mode forward of D random tokens: ``pp512 @ d4096``
is then the speed of a 512-token prompt appended to a 4096-token context, ``tg128 @ d4096`` the
speed of decoding there (attention reads D more keys per row). A warm-up (one pp of the first
``n_prompt`` tokens and one tg step, each after the D-token prefix, as llama-bench) runs first
and is not counted. Figures are mean and sample standard deviation over the repetitions.
Nothing here imports torch.
"""
from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ._ffi import err_buf, ffi, lib, raise_error
from .model import CACHE_TYPES, cache_type

__all__ = ["BenchResult", "run_bench", "run_grid", "model_summary", "bytes_per_token", "format_table", "format_rows",
           "bench_rows"]

# llama.cpp's llama_ftype numbering (general.file_type) -> the name llama-bench prints.
_FTYPE_NAMES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
    11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
    17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
    23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M",
    30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4_MOE",
}


@dataclass
class BenchResult:
    """One test row: ``name`` (e.g. ``pp512``), ``n_tokens`` processed per run, ``seconds``
    (one float per repetition), ``extra`` (for block tests the mean distinct experts per MoE
    layer), and llama-bench's ``n_prompt`` / ``n_gen`` of the test (block and commit: the
    n_prompt of their prefix)."""
    name: str
    n_tokens: int
    seconds: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)
    n_prompt: int = 0
    n_gen: int = 0

    @property
    def ms_mean(self) -> float:
        """Mean milliseconds per run."""
        return 1000.0 * float(np.mean(self.seconds))

    @property
    def ms_std(self) -> float:
        """Sample standard deviation of the milliseconds per run (0 for one repetition)."""
        return 1000.0 * (float(np.std(self.seconds, ddof=1)) if len(self.seconds) > 1 else 0.0)

    @property
    def tps(self) -> list:
        """Tokens/s per repetition."""
        return [self.n_tokens / s for s in self.seconds]

    @property
    def tps_mean(self) -> float:
        return float(np.mean(self.tps))

    @property
    def tps_std(self) -> float:
        t = self.tps
        return float(np.std(t, ddof=1)) if len(t) > 1 else 0.0

    def as_dict(self) -> dict:
        d = {"test": self.name, "n_tokens": self.n_tokens, "n_prompt": self.n_prompt, "n_gen": self.n_gen,
             "seconds": list(self.seconds),
             "ms_mean": self.ms_mean, "ms_std": self.ms_std,
             "tokens_per_second_mean": self.tps_mean, "tokens_per_second_std": self.tps_std}
        d.update(self.extra)
        return d


# ---------------------------------------------------------------------------- GGUF table
def model_summary(path) -> dict:
    """Static facts about a GGUF from its header and tensor table (no weights read).

    Returns a dict: ``file`` (basename), ``arch`` (general.architecture), ``type`` (the
    llama.cpp file-type name from ``general.file_type``, else the ggml type holding the most
    bytes), ``size_bytes`` (sum of tensor bytes), ``n_params`` (sum of tensor elements),
    ``bytes_per_token`` (see :func:`bytes_per_token`). Raises CloverError for a bad file.
    """
    from .gguf import GGUFFile

    with GGUFFile(path) as f:
        md = f.metadata
        tensors = f.tensors
    arch = str(md.get("general.architecture", "?"))
    by_type: dict[str, int] = {}
    for t in tensors:
        by_type[t["type"]] = by_type.get(t["type"], 0) + int(t["nbytes"])
    ft = md.get("general.file_type")
    if isinstance(ft, int) and ft in _FTYPE_NAMES:
        typ = _FTYPE_NAMES[ft]
    else:
        typ = max(by_type, key=by_type.get) if by_type else "?"
    return {
        "file": os.path.basename(os.fspath(path)),
        "arch": arch,
        "type": typ,
        "size_bytes": sum(int(t["nbytes"]) for t in tensors),
        "n_params": sum(int(np.prod(t["shape"], dtype=np.int64)) for t in tensors),
        "bytes_per_token": _bytes_per_token(md, tensors, arch),
    }


def _bytes_per_token(md: dict, tensors: list, arch: str) -> int:
    n_exp = md.get(f"{arch}.expert_count")
    n_used = md.get(f"{arch}.expert_used_count")
    names = {t["name"] for t in tensors}
    total = 0
    for t in tensors:
        name, nb, shape = t["name"], int(t["nbytes"]), t["shape"]
        if "_exps." in name and len(shape) == 3 and n_exp and n_used:
            total += nb * int(n_used) // int(n_exp)  # n_expert_used of n_expert slices
        elif name == "token_embd.weight":
            total += nb // int(shape[1]) if len(shape) == 2 else nb  # one row is looked up
            if "output.weight" not in names:  # tied embeddings: the LM head reads all of it
                total += nb
        else:
            total += nb
    return total


def bytes_per_token(path) -> int:
    """Weight bytes read to decode one token of the GGUF at ``path`` (int): every non-expert
    tensor whole, ``expert_used_count / expert_count`` of each ``*_exps`` tensor (shape
    [n_expert, rows, cols]), one row of ``token_embd`` (a lookup) and the whole LM head
    (``output.weight``, or ``token_embd`` when tied). Divide a bandwidth by it for the decode
    speed limit. Raises CloverError for a bad file."""
    return model_summary(path)["bytes_per_token"]


# ---------------------------------------------------------------------------- timing
class _Engine:
    """A loaded model (with its GPU placement) and one context at a time (:meth:`open`), freed by
    close()."""

    def __init__(self, path: str, n_gpu_layers: int = 0, n_cpu_moe: int = 0, diffusion_path=None) -> None:
        err = err_buf()
        self.err = err
        self.c = ffi.NULL
        side = ffi.NULL if diffusion_path is None else os.fsencode(diffusion_path)
        self.m = lib.clover_model_load_sidecar(os.fsencode(path), side, err, len(err))
        if self.m == ffi.NULL:
            raise_error(err, f"loading {path}")
        hp = ffi.new("clover_hparams *")
        lib.clover_model_hparams(self.m, hp)
        self.hp = hp[0]
        self.n_gpu_layers = 0
        if n_gpu_layers:  # (no GPU: the caller asked for one, so this is an error here)
            n = int(self.hp.n_layer) + 1 if n_gpu_layers < 0 else n_gpu_layers
            rc = lib.clover_model_offload(self.m, n, n_cpu_moe, err, len(err))
            if rc < 0:
                self.close()
                raise_error(err, "n_gpu_layers")
            self.n_gpu_layers = int(rc)

    def open(self, n_ctx: int, n_threads: int, type_k: int, type_v: int) -> None:
        """A fresh context on the model (the previous one freed)."""
        if self.c != ffi.NULL:
            lib.clover_context_free(self.c)
        self.c = lib.clover_context_new(self.m, n_ctx, n_threads, type_k, type_v, self.err, len(self.err))
        if self.c == ffi.NULL:
            raise_error(self.err, "creating the context")

    def close(self) -> None:
        if self.c != ffi.NULL:
            lib.clover_context_free(self.c)
            self.c = ffi.NULL
        if self.m != ffi.NULL:
            lib.clover_model_free(self.m)
            self.m = ffi.NULL

    def prefill(self, toks, n: int, logits) -> float:
        t0 = time.perf_counter()
        rc = lib.clover_prefill(self.c, toks, n, logits, 0, self.err, len(self.err))
        dt = time.perf_counter() - t0
        if rc < 0:
            raise_error(self.err, "bench prefill")
        return dt

    def block(self, toks, B: int, top_p: float, logits, n_exp) -> float:
        t0 = time.perf_counter()
        rc = lib.clover_block_forward(self.c, toks, B, top_p, logits, n_exp, self.err, len(self.err))
        dt = time.perf_counter() - t0
        if rc < 0:
            raise_error(self.err, "bench block forward")
        return dt


def _check_pos(name: str, v: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}: {v!r} must be a positive integer")
    return int(v)


def _values(name: str, v) -> list:
    """``v`` as a list (a list or tuple as given, anything else as its one element)."""
    vals = list(v) if isinstance(v, (list, tuple)) else [v]
    if not vals:
        raise ValueError(f"{name}: an empty list")
    return vals


def _ints(name: str, v, lo: int) -> list[int]:
    """The integers of ``v`` (one or a list), each >= lo; ValueError naming the field and element."""
    out = []
    for x in _values(name, v):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo:
            raise ValueError(f"{name}: {x!r} must be an integer >= {lo}")
        out.append(int(x))
    return out


def _top_ps(v) -> list[float]:
    out = []
    for x in _values("coreset_top_p", v):
        if isinstance(x, bool) or not (isinstance(x, (int, float)) and 0 < x <= 1):
            raise ValueError(f"coreset_top_p: {x!r} must be in (0, 1]")
        out.append(float(x))
    return out


# The list arguments of run_grid in the order of its cartesian product (llama-bench's order for
# the ones it shares: a model is loaded once per model, n_gpu_layers and n_cpu_moe), and the
# names of run_bench's one-value arguments among them.
GRID_ORDER = ("model", "n_gpu_layers", "n_cpu_moe", "type_k", "type_v", "n_threads", "n_depth", "block_size",
              "coreset_top_p")


def run_bench(path, n_prompt=512, n_gen=128, reps: int = 5, n_threads: int | None = None,
              block_size: int = 32, coreset_top_p: float = 0.9, seed: int = 0, warmup: bool = True,
              block: bool | None = None, commit: bool = True, n_gpu_layers: int = 0,
              n_cpu_moe: int = 0, type_k: str | int = "f32", type_v: str | int = "f32", n_depth: int = 0,
              diffusion_path=None) -> dict:
    """Run the pp / tg / block / commit tests of one configuration on the GGUF at ``path``
    (module docstring); :func:`run_grid` runs the cartesian product of lists of them.

    Args:
        n_prompt, n_gen: an int >= 0 or a list of them (llama-bench's ``-p``, ``-n``): a pp test
            (and block/commit after that prefix) per n_prompt, a tg test per n_gen, 0 skips;
        reps, block_size: positive ints; n_threads: None or 0 = the engine's default (all cores);
        coreset_top_p: in (0, 1]; block: None = only for clover files, False = skip;
        commit: False skips the commit test; n_gpu_layers: layers whose weight products run on
            the GPU (-1 = all and the output; CloverError without a usable GPU); n_cpu_moe: the
            routed experts of the first n_cpu_moe layers stay on the CPU; type_k, type_v: the KV
            cache types (``"f16"``, ``"f32"``; :func:`clover_gguf.model.cache_type`); n_depth: tokens
            in the context before every test (int >= 0, untimed; module docstring).

    Returns a dict: ``model`` (:func:`model_summary`), ``path`` (the file as given), ``threads``
    (int, the resolved count), ``params`` (the arguments; ``n_prompt``, ``n_gen`` as lists),
    ``n_gpu_layers`` (offloaded), ``n_cpu_moe``, ``test_time`` (RFC 3339, UTC), ``results`` (list of
    :class:`BenchResult`: pp per n_prompt, tg per n_gen, then per n_prompt block (clover only)
    and commit (unless skipped)) and ``block_vs_tg`` (the first block's ms / one step of the
    first tg, or None). Raises ValueError for a bad argument, CloverError for an engine error.
    """
    for name, v in (("n_threads", n_threads), ("block_size", block_size), ("coreset_top_p", coreset_top_p),
                    ("n_gpu_layers", n_gpu_layers), ("n_cpu_moe", n_cpu_moe), ("type_k", type_k),
                    ("type_v", type_v), ("n_depth", n_depth)):
        if isinstance(v, (list, tuple)):
            raise ValueError(f"{name}: one value in run_bench ({list(v)!r}; run_grid takes lists)")
    return run_grid(path, n_prompt=n_prompt, n_gen=n_gen, reps=reps, n_threads=n_threads, block_size=block_size,
                    coreset_top_p=coreset_top_p, seed=seed, warmup=warmup, block=block, commit=commit,
                    n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, type_k=type_k, type_v=type_v,
                    n_depth=n_depth, diffusion_path=diffusion_path)[0]


def run_grid(models, n_prompt=512, n_gen=128, reps: int = 5, n_threads=None, block_size=32, coreset_top_p=0.9,
             seed: int = 0, warmup: bool = True, block: bool | None = None, commit: bool = True, n_gpu_layers=0,
             n_cpu_moe=0, type_k="f32", type_v="f32", n_depth=0, diffusion_path=None, on_report=None) -> list[dict]:
    """llama-bench's sweep: :func:`run_bench` for every combination of the values of the
    arguments named in :data:`GRID_ORDER` (``models``: a path or a list; each of the others one
    value or a list), in that order, the first varying slowest; ``n_prompt`` and ``n_gen`` lists
    run inside each combination. Every value is checked before anything loads (ValueError
    naming the argument and the value). Each model loads once per (n_gpu_layers, n_cpu_moe);
    each combination gets a fresh context and the same random tokens (``seed``). Returns the
    reports in order; ``on_report(report)``, when given, is called as each one is done."""
    paths = [os.fspath(m) for m in _values("model", models)]
    P, G = _ints("n_prompt", n_prompt, 0), _ints("n_gen", n_gen, 0)
    if not any(P) and not any(G):
        raise ValueError(f"n_prompt, n_gen: no test to run ({P}, {G}: every value is 0)")
    reps = _check_pos("reps", reps)
    grid = {"n_gpu_layers": _ints("n_gpu_layers", n_gpu_layers, -1), "n_cpu_moe": _ints("n_cpu_moe", n_cpu_moe, 0),
            "type_k": [cache_type("type_k", x) for x in _values("type_k", type_k)],
            "type_v": [cache_type("type_v", x) for x in _values("type_v", type_v)],
            "n_threads": _ints("n_threads", [0 if x is None else x for x in _values("n_threads", n_threads)], 0),
            "n_depth": _ints("n_depth", n_depth, 0), "block_size": _ints("block_size", block_size, 1),
            "coreset_top_p": _top_ps(coreset_top_p)}
    reports = []
    for path in paths:
        summary = model_summary(path)
        for ngl, ncmoe in itertools.product(grid["n_gpu_layers"], grid["n_cpu_moe"]):
            eng = _Engine(path, ngl, ncmoe, diffusion_path)
            try:
                for tk, tv, nt, D, B, top_p in itertools.product(*(grid[k] for k in GRID_ORDER[3:])):
                    rep = _measure(eng, P, G, reps, nt, D, B, top_p, tk, tv, seed, warmup, block, commit)
                    rep.update(model=summary, path=path, n_gpu_layers=eng.n_gpu_layers, n_cpu_moe=ncmoe)
                    reports.append(rep)
                    if on_report is not None:
                        on_report(rep)
            finally:
                eng.close()
    return reports


def _measure(eng: _Engine, P: list, G: list, reps: int, threads: int, D: int, B: int, top_p: float, type_k: int,
             type_v: int, seed: int, warmup: bool, block, commit: bool) -> dict:
    """One configuration's tests on a fresh context of ``eng`` (run_bench's report, less the
    model fields)."""
    Pp, Gg = [p for p in P if p], [g for g in G if g]
    eng.open(D + max(max(P) + B, max(G)), threads, type_k, type_v)
    hp = eng.hp
    V = int(hp.n_vocab)
    do_block = bool(Pp) and (bool(hp.has_block) if block is None else (bool(block) and bool(hp.has_block)))
    commit = bool(commit) and bool(Pp)
    rng = np.random.default_rng(seed)
    last = ffi.new("float[]", V)
    at = f" @ d{D}" if D else ""
    blk_logits = ffi.new("float[]", B * V) if do_block else ffi.NULL
    n_exp = ffi.new("int32_t[]", max(int(hp.n_layer), 1))
    mask = int(hp.mask_token_id)
    blk_toks = ffi.new("int32_t[]", [mask if 0 <= mask < V else int(x) for x in rng.integers(0, V, B)])
    test_time = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())

    def toks(n):
        return ffi.new("int32_t[]", rng.integers(0, V, n).tolist())

    def reset():  # an empty context, then the D-token prefix (untimed)
        lib.clover_context_reset(eng.c)
        if D:
            eng.prefill(toks(D), D, last)

    if warmup:  # (each after the D-token prefix, so the token stream is bench/compare.py's llama.cpp one)
        if Pp:
            reset()
            eng.prefill(toks(Pp[0]), Pp[0], last)
        if Gg:
            reset()
            eng.prefill(toks(1), 1, last)
    pps, tgs, after = [], [], []
    for p in Pp:
        pre = f" @ p{p}" if len(Pp) > 1 else ""  # several prefixes: the block and commit rows name theirs
        pp = BenchResult(f"pp{p}{at}", p, n_prompt=p)
        blk = BenchResult(f"block{B}{pre}{at}", B, n_prompt=p,
                          extra={"block_size": B, "coreset_top_p": top_p, "prefix": D + p})
        com = BenchResult(f"commit{B}{pre}{at}", B, n_prompt=p, extra={"block_size": B, "prefix": D + p})
        distinct = []
        for _ in range(reps):
            reset()
            pp.seconds.append(eng.prefill(toks(p), p, last))
            if do_block:  # read-only on the caches: n_past stays D + p
                blk.seconds.append(eng.block(blk_toks, B, top_p, blk_logits, n_exp))
                distinct.append(float(np.mean([n_exp[i] for i in range(int(hp.n_layer))])))
            if commit:
                com.seconds.append(eng.prefill(toks(B), B, last))
        pps.append(pp)
        if do_block:
            blk.extra["mean_distinct_experts"] = float(np.mean(distinct))
            after.append(blk)
        if commit:
            after.append(com)
    for g in Gg:
        tg = BenchResult(f"tg{g}{at}", g, n_gen=g)
        for _ in range(reps):
            reset()
            ids = toks(g)
            total = 0.0
            for i in range(g):
                total += eng.prefill(ids + i, 1, last)
            tg.seconds.append(total)
        tgs.append(tg)
    ratio = None
    blocks = [r for r in after if "coreset_top_p" in r.extra]
    if blocks and tgs:  # block time as a multiple of one step of the first tg
        step_ms = 1000.0 / tgs[0].tps_mean
        for r in blocks:
            r.extra["vs_tg_step"] = r.ms_mean / step_ms
        ratio = blocks[0].extra["vs_tg_step"]
    if threads == 0:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            threads = os.cpu_count() or 1
    return {"threads": threads, "results": pps + tgs + after, "block_vs_tg": ratio, "test_time": test_time,
            "params": {"n_prompt": P, "n_gen": G, "reps": reps, "block_size": B, "coreset_top_p": top_p,
                       "seed": seed, "warmup": warmup, "type_k": type_k, "type_v": type_v, "n_depth": D}}


# ---------------------------------------------------------------------------- output
def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def _params(n: int) -> str:
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return str(n)


_CACHE_NAMES = {v: k for k, v in CACHE_TYPES.items()}
# the table's columns shown only when a report's value is not this default (llama-bench's rule)
_OPTIONAL_COLUMNS = (("ngl", "n_gpu_layers", 0), ("n_cpu_moe", "n_cpu_moe", 0))
_OPTIONAL_PARAMS = (("type_k", "type_k", 0), ("type_v", "type_v", 0), ("coreset_top_p", "coreset_top_p", 0.9))


def _reports(reports) -> list:
    return [reports] if isinstance(reports, dict) else list(reports)


def format_table(reports) -> str:
    """The llama-bench-style markdown table of :func:`run_bench` reports (one or a list; str, no
    trailing newline): model | size | params | type | [ngl] | [n_cpu_moe] | threads | [type_k] |
    [type_v] | [coreset_top_p] | test | t/s | ms/forward | vs tg step, the bracketed columns
    only when a report differs from the default there, as llama-bench. t/s and ms are ``mean ±
    std`` over the repetitions; t/s is blank for block and commit rows, ms is per forward pass
    (for tg: per token)."""
    reports = _reports(reports)
    before = [c for c in _OPTIONAL_COLUMNS if any(r[c[1]] != c[2] for r in reports)]
    after = [c for c in _OPTIONAL_PARAMS if any(r["params"][c[1]] != c[2] for r in reports)]
    head = ["model", "size", "params", "type"] + [c[0] for c in before] + ["threads"] + [c[0] for c in after] + \
        ["test", "t/s", "ms/forward", "vs tg step"]
    rows = []
    for rep in reports:
        s = rep["model"]
        cells = [f"{s['file']} ({s['arch']})", _size(s["size_bytes"]), _params(s["n_params"]), s["type"]]
        cells += [str(rep[c[1]]) for c in before] + [str(rep["threads"])]
        cells += [_CACHE_NAMES.get(v, str(v)) if c[0].startswith("type") else f"{v:g}"
                  for c in after for v in [rep["params"][c[1]]]]
        for r in rep["results"]:
            tps = f"{r.tps_mean:.2f} ± {r.tps_std:.2f}" if r.name.startswith(("pp", "tg")) else ""
            if r.name.startswith("tg"):  # per token
                per = [1000.0 * x / r.n_tokens for x in r.seconds]
                ms = f"{np.mean(per):.2f} ± {(np.std(per, ddof=1) if len(per) > 1 else 0.0):.2f}"
            else:
                ms = f"{r.ms_mean:.2f} ± {r.ms_std:.2f}"
            vs = f"{r.extra['vs_tg_step']:.2f}x" if "vs_tg_step" in r.extra else ""
            rows.append(cells + [r.name, tps, ms, vs])
    w = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    left = {0, 3, head.index("test")} | {i for i, h in enumerate(head) if h in ("type_k", "type_v")}

    def line(cells):
        return "| " + " | ".join(c.ljust(w[i]) if i in left else c.rjust(w[i]) for i, c in enumerate(cells)) + " |"

    sep = "| " + " | ".join("-" * w[i] if i in left else ("-" * (w[i] - 1) + ":") for i in range(len(head))) + " |"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def to_json(report: dict) -> str:
    """The report as one JSON object (str): model, threads, params, block_vs_tg and one
    entry per test with the per-repetition seconds and the summary figures."""
    obj = {k: v for k, v in report.items() if k != "results"}
    obj["results"] = [r.as_dict() for r in report["results"]]
    return json.dumps(obj, allow_nan=False, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o)


# llama-bench's fields where the concept is the same (its ``-o json|jsonl|csv|sql`` rows: the
# model, the configuration, the test as n_prompt / n_gen / n_depth, the timing), then clover's
# (the test's name, the block forward's figures); SQL types as llama-bench's.
FIELDS = {"backends": "TEXT", "model_filename": "TEXT", "model_type": "TEXT", "model_size": "INTEGER",
          "model_n_params": "INTEGER", "n_threads": "INTEGER", "type_k": "TEXT", "type_v": "TEXT",
          "n_gpu_layers": "INTEGER", "n_cpu_moe": "INTEGER", "n_prompt": "INTEGER", "n_gen": "INTEGER",
          "n_depth": "INTEGER", "test_time": "TEXT", "avg_ns": "INTEGER", "stddev_ns": "INTEGER", "avg_ts": "REAL",
          "stddev_ts": "REAL", "test": "TEXT", "block_size": "INTEGER", "coreset_top_p": "REAL",
          "mean_distinct_experts": "REAL", "vs_tg_step": "REAL"}
OUTPUTS = ("md", "json", "jsonl", "csv", "sql")


def _finite(x):
    return x if math.isfinite(x) else None


def bench_rows(report: dict) -> list[dict]:
    """One dict per test of a :func:`run_bench` report, keyed by :data:`FIELDS` in that order,
    plus llama-bench's ``samples_ns`` and ``samples_ts``. As llama-bench: a pp row has
    n_gen 0, a tg row n_prompt 0, the samples are each repetition's time (tg: of all n_gen
    steps) and tokens/s; a block or commit row has the n_prompt of its prefix and ``avg_ts`` in
    rows (block_size) per second. ``block_size``, ``coreset_top_p``, ``mean_distinct_experts``
    and ``vs_tg_step`` are None where a test has no such figure."""
    s, p = report["model"], report["params"]
    out = []
    for r in report["results"]:
        ns = [int(round(x * 1e9)) for x in r.seconds]
        row = {"backends": "CUDA" if report["n_gpu_layers"] else "CPU", "model_filename": report["path"],
               "model_type": f"{s['arch']} {s['type']}", "model_size": s["size_bytes"], "model_n_params": s["n_params"],
               "n_threads": report["threads"], "type_k": _CACHE_NAMES[p["type_k"]],
               "type_v": _CACHE_NAMES[p["type_v"]], "n_gpu_layers": report["n_gpu_layers"],
               "n_cpu_moe": report["n_cpu_moe"], "n_prompt": r.n_prompt, "n_gen": r.n_gen, "n_depth": p["n_depth"],
               "test_time": report["test_time"], "avg_ns": int(round(np.mean(ns))),
               "stddev_ns": int(round(np.std(ns, ddof=1))) if len(ns) > 1 else 0, "avg_ts": _finite(r.tps_mean),
               "stddev_ts": _finite(r.tps_std), "test": r.name}
        row.update({k: r.extra.get(k) for k in ("block_size", "coreset_top_p", "mean_distinct_experts", "vs_tg_step")})
        row["samples_ns"], row["samples_ts"] = ns, [_finite(x) for x in r.tps]
        out.append(row)
    return out


def _sql(v) -> str:
    if v is None:
        return "NULL"
    return str(v) if isinstance(v, (int, float)) else "'" + str(v).replace("'", "''") + "'"


def format_rows(reports, fmt: str, header: bool = True) -> str:
    """:func:`bench_rows` of reports (one or a list) in llama-bench's output format ``fmt``
    (str, no trailing newline): ``json`` (an array of objects), ``jsonl`` (an object per line),
    ``csv`` (with its header line when ``header``), ``sql`` (``INSERT INTO clover_bench``
    statements, after the ``CREATE TABLE IF NOT EXISTS`` when ``header``; clover's table: its
    columns are not llama_bench's). ``md`` is :func:`format_table`. ValueError for another fmt."""
    if fmt == "md":
        return format_table(reports)
    rows = [row for rep in _reports(reports) for row in bench_rows(rep)]
    if fmt == "json":
        return json.dumps(rows, indent=2, allow_nan=False)
    if fmt == "jsonl":
        return "\n".join(json.dumps(row, allow_nan=False) for row in rows)
    if fmt == "csv":
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        if header:
            w.writerow(FIELDS)
        w.writerows([["" if row[k] is None else row[k] for k in FIELDS] for row in rows])
        return buf.getvalue().rstrip("\n")
    if fmt == "sql":
        lines = ["CREATE TABLE IF NOT EXISTS clover_bench (" + ", ".join(f"{k} {t}" for k, t in FIELDS.items()) + ");"] \
            if header else []
        lines += [f"INSERT INTO clover_bench ({', '.join(FIELDS)}) VALUES ({', '.join(_sql(row[k]) for k in FIELDS)});"
                  for row in rows]
        return "\n".join(lines)
    raise ValueError(f"output: {fmt!r} is not one of {', '.join(OUTPUTS)}")
