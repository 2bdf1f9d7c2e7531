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
tg runs separately from an empty context. With ``n_depth`` D > 0 (llama-bench's ``-d``), every
test starts instead after an untimed prefix-mode forward of D random tokens: ``pp512 @ d4096``
is then the speed of a 512-token prompt appended to a 4096-token context, ``tg128 @ d4096`` the
speed of decoding there (attention reads D more keys per row). A warm-up (one pp of
``n_prompt`` tokens and one tg step, each after the D-token prefix, as llama-bench) runs first
and is not counted. Figures are mean and sample standard deviation over the repetitions.
Nothing here imports torch.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ._ffi import err_buf, ffi, lib, raise_error
from .model import cache_type

__all__ = ["BenchResult", "run_bench", "model_summary", "bytes_per_token", "format_table"]

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
    (one float per repetition), and for block tests the mean distinct experts per MoE layer."""
    name: str
    n_tokens: int
    seconds: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)

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
        d = {"test": self.name, "n_tokens": self.n_tokens, "seconds": list(self.seconds),
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
    """A loaded model and one context, freed by close()."""

    def __init__(self, path: str, n_ctx: int, n_threads: int, n_gpu_layers: int = 0, n_cpu_moe: int = 0,
                 type_k: int = 0, type_v: int = 0, diffusion_path=None) -> None:
        err = err_buf()
        side = ffi.NULL if diffusion_path is None else os.fsencode(diffusion_path)
        self.m = lib.clover_model_load_sidecar(os.fsencode(path), side, err, len(err))
        if self.m == ffi.NULL:
            raise_error(err, f"loading {path}")
        self.c = ffi.NULL
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
        self.c = lib.clover_context_new(self.m, n_ctx, n_threads, type_k, type_v, err, len(err))
        if self.c == ffi.NULL:
            self.close()
            raise_error(err, "creating the context")
        self.err = err

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


def run_bench(path, n_prompt: int = 512, n_gen: int = 128, reps: int = 5, n_threads: int | None = None,
              block_size: int = 32, coreset_top_p: float = 0.9, seed: int = 0, warmup: bool = True,
              block: bool | None = None, commit: bool = True, n_gpu_layers: int = 0,
              n_cpu_moe: int = 0, type_k: str | int = "f32", type_v: str | int = "f32", n_depth: int = 0,
              diffusion_path=None) -> dict:
    """Run the pp / tg / block / commit tests on the GGUF at ``path`` (module docstring).

    Args:
        n_prompt, n_gen, reps, block_size: positive ints (the prefix of block/commit is
            ``n_prompt`` tokens); n_threads: None or 0 = the engine's default (all cores);
        coreset_top_p: in (0, 1]; block: None = only for clover files, False = skip;
        commit: False skips the commit test; n_gpu_layers: layers whose weight products run on
            the GPU (-1 = all and the output; CloverError without a usable GPU); n_cpu_moe: the
            routed experts of the first n_cpu_moe layers stay on the CPU; type_k, type_v: the KV
            cache types (``"f16"``, ``"f32"``; :func:`clover_gguf.model.cache_type`); n_depth: tokens
            in the context before every test (int >= 0, untimed; module docstring).

    Returns a dict: ``model`` (:func:`model_summary`), ``threads`` (int, the resolved
    count), ``params`` (the arguments), ``results`` (list of :class:`BenchResult`, in order
    pp, tg, block (clover only), commit (unless skipped)) and ``block_vs_tg`` (block ms / one
    tg step ms, or None). Raises ValueError for a bad argument, CloverError for an engine error.
    """
    path = os.fspath(path)
    n_prompt, n_gen, reps, B = (_check_pos(k, v) for k, v in
                                (("n_prompt", n_prompt), ("n_gen", n_gen), ("reps", reps), ("block_size", block_size)))
    if isinstance(coreset_top_p, bool) or not (isinstance(coreset_top_p, (int, float)) and 0 < coreset_top_p <= 1):
        raise ValueError(f"coreset_top_p: {coreset_top_p!r} must be in (0, 1]")
    if isinstance(n_depth, bool) or not isinstance(n_depth, (int, np.integer)) or n_depth < 0:
        raise ValueError(f"n_depth: {n_depth!r} must be an integer >= 0")
    D = int(n_depth)
    threads = 0 if n_threads is None else int(n_threads)
    if threads < 0:
        raise ValueError(f"n_threads: {threads} must be >= 0")
    summary = model_summary(path)
    type_k, type_v = cache_type("type_k", type_k), cache_type("type_v", type_v)
    eng = _Engine(path, D + max(n_prompt + B, n_gen), threads, n_gpu_layers, n_cpu_moe, type_k, type_v,
                  diffusion_path)
    gpu_layers = eng.n_gpu_layers
    try:
        hp = eng.hp
        V = int(hp.n_vocab)
        do_block = bool(hp.has_block) if block is None else (bool(block) and bool(hp.has_block))
        rng = np.random.default_rng(seed)
        last = ffi.new("float[]", V)
        at = f" @ d{D}" if D else ""
        pp = BenchResult(f"pp{n_prompt}{at}", n_prompt)
        tg = BenchResult(f"tg{n_gen}{at}", n_gen)
        blk = BenchResult(f"block{B}{at}", B, extra={"coreset_top_p": float(coreset_top_p), "prefix": D + n_prompt})
        com = BenchResult(f"commit{B}{at}", B, extra={"prefix": D + n_prompt})
        blk_logits = ffi.new("float[]", B * V) if do_block else ffi.NULL
        n_exp = ffi.new("int32_t[]", max(int(hp.n_layer), 1))
        mask = int(hp.mask_token_id)
        blk_toks = ffi.new("int32_t[]", [mask if 0 <= mask < V else int(x) for x in rng.integers(0, V, B)])
        distinct = []

        def toks(n):
            return ffi.new("int32_t[]", rng.integers(0, V, n).tolist())

        def reset():  # an empty context, then the D-token prefix (untimed)
            lib.clover_context_reset(eng.c)
            if D:
                eng.prefill(toks(D), D, last)

        if warmup:  # (each after the D-token prefix, so the token stream is bench/compare.py's llama.cpp one)
            reset()
            eng.prefill(toks(n_prompt), n_prompt, last)
            reset()
            eng.prefill(toks(1), 1, last)
        for _ in range(reps):
            reset()
            pp.seconds.append(eng.prefill(toks(n_prompt), n_prompt, last))
            if do_block:  # read-only on the caches: n_past stays D + n_prompt
                blk.seconds.append(eng.block(blk_toks, B, float(coreset_top_p), blk_logits, n_exp))
                distinct.append(float(np.mean([n_exp[i] for i in range(int(hp.n_layer))])))
            if commit:
                com.seconds.append(eng.prefill(toks(B), B, last))
        for _ in range(reps):
            reset()
            ids = toks(n_gen)
            total = 0.0
            for i in range(n_gen):
                total += eng.prefill(ids + i, 1, last)
            tg.seconds.append(total)
    finally:
        eng.close()
    results = [pp, tg]
    ratio = None
    if do_block:
        blk.extra["mean_distinct_experts"] = float(np.mean(distinct))
        ratio = blk.ms_mean / (1000.0 / tg.tps_mean)
        blk.extra["vs_tg_step"] = ratio
        results.append(blk)
    if commit:
        results.append(com)
    if threads == 0:
        try:
            threads = len(os.sched_getaffinity(0))
        except AttributeError:  # not Linux
            threads = os.cpu_count() or 1
    return {"model": summary, "threads": threads, "results": results, "block_vs_tg": ratio,
            "params": {"n_prompt": n_prompt, "n_gen": n_gen, "reps": reps, "block_size": B,
                       "coreset_top_p": float(coreset_top_p), "seed": seed, "warmup": warmup,
                       "type_k": type_k, "type_v": type_v, "n_depth": D},
            "n_gpu_layers": gpu_layers}


# ---------------------------------------------------------------------------- output
def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def _params(n: int) -> str:
    for div, suf in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f} {suf}"
    return str(n)


def format_table(report: dict) -> str:
    """The llama-bench-style markdown table of a :func:`run_bench` report (str, no trailing
    newline): model | size | params | type | threads | test | t/s | ms/forward | vs tg step.
    t/s and ms are ``mean ± std`` over the repetitions; t/s is blank for block and commit
    rows, ms is per forward pass (for tg: per token)."""
    s = report["model"]
    head = ["model", "size", "params", "type", "threads", "test", "t/s", "ms/forward", "vs tg step"]
    rows = []
    for r in report["results"]:
        if r.name.startswith(("pp", "tg")):
            tps = f"{r.tps_mean:.2f} ± {r.tps_std:.2f}"
        else:
            tps = ""
        if r.name.startswith("tg"):  # per token
            per = [1000.0 * x / r.n_tokens for x in r.seconds]
            ms = f"{np.mean(per):.2f} ± {(np.std(per, ddof=1) if len(per) > 1 else 0.0):.2f}"
        else:
            ms = f"{r.ms_mean:.2f} ± {r.ms_std:.2f}"
        vs = f"{r.extra['vs_tg_step']:.2f}x" if "vs_tg_step" in r.extra else ""
        rows.append([f"{s['file']} ({s['arch']})", _size(s["size_bytes"]), _params(s["n_params"]), s["type"],
                     str(report["threads"]), r.name, tps, ms, vs])
    w = [max(len(x[i]) for x in rows + [head]) for i in range(len(head))]
    right = {1, 2, 4, 6, 7, 8}

    def line(cells):
        return "| " + " | ".join(c.rjust(w[i]) if i in right else c.ljust(w[i]) for i, c in enumerate(cells)) + " |"

    sep = "| " + " | ".join(("-" * (w[i] - 1) + ":") if i in right else "-" * w[i] for i in range(len(head))) + " |"
    return "\n".join([line(head), sep] + [line(r) for r in rows])


def to_json(report: dict) -> str:
    """The report as one JSON object (str): model, threads, params, block_vs_tg and one
    entry per test with the per-repetition seconds and the summary figures."""
    obj = {k: v for k, v in report.items() if k != "results"}
    obj["results"] = [r.as_dict() for r in report["results"]]
    return json.dumps(obj, allow_nan=False, default=lambda o: None if isinstance(o, float) and not math.isfinite(o) else o)
