#!/usr/bin/env python3
"""Decoding modes side by side: ar, diffusion and spec on the same model and prompts.

For each mode: tokens/s, tokens per forward, forwards by kind (prefill, denoise, commit,
decode, draft, verify), spec's acceptance histogram, and the distinct experts per MoE layer of
the block-mode passes (mean and max) with and without the coreset (spec 5.6). Greedy, no
end-token stop (``end_ids=[]``), so every mode produces the same number of tokens; spec's
tokens are checked equal to ar's: on the CPU a difference is an error (the engine keeps the two
bit for bit equal), on the GPU (``-ngl``) it is recorded (``spec_equals_ar``, per prompt) since
spec's verify is one multi-row pass there, whose sums run in another order than ar's steps.

Usage: CLOVER_LIB=... python bench/modes.py MODEL.gguf [-n 128] [-t 2] [--block-size B]
       [--threshold X] [--coreset-top-p P] [--json] [-ngl N] [--prompts K]
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from clover_gguf import Model  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n", "class Config:\n    ",
           "Once upon a time"]
KINDS = ("prefill", "denoise", "commit", "decode", "draft", "verify")


def run(path: str, n: int, threads: int, n_gpu_layers: int = 0, n_prompts: int = len(PROMPTS), **kw) -> dict:
    out = {}
    with Model(path, n_ctx=max(1024, n + 64), n_threads=threads, n_gpu_layers=n_gpu_layers) as m:
        modes = ["ar", "diffusion", "spec"] if m.has_block else ["ar"]
        ar_tokens = []
        for mode in modes:
            agg = {"tokens": 0, "seconds": 0.0, "forwards": 0, **{k: 0 for k in KINDS}, "accept_hist": [],
                   "experts": [], "experts_full": [], "max_experts": 0, "max_experts_full": 0, "ids": [],
                   "spec_equals_ar": []}
            for i, p in enumerate(PROMPTS[:n_prompts]):
                ids, st = m.generate_tokens(m.tokenize(p), max_tokens=n, mode=mode, end_ids=[], **kw)
                if mode == "ar":
                    ar_tokens.append(ids)
                elif mode == "spec":
                    agg["spec_equals_ar"].append(ids == ar_tokens[i])
                    if ids != ar_tokens[i] and not n_gpu_layers:
                        raise SystemExit(f"spec differs from ar on prompt {i}")
                agg["ids"].append(ids)
                agg["tokens"] += len(ids)
                agg["seconds"] += st["seconds"] - st["prefill_seconds"]
                agg["forwards"] += st["n_forward"] - st["n_forward_prefill"]
                for k in KINDS:
                    agg[k] += st[f"n_forward_{k}"]
                h, acc = st["accept_hist"], agg["accept_hist"]
                n_b = max(len(h), len(acc))
                agg["accept_hist"] = [(acc[i] if i < len(acc) else 0) + (h[i] if i < len(h) else 0) for i in range(n_b)]
                if st["mean_distinct_experts"] is not None:
                    agg["experts"].append(st["mean_distinct_experts"])
                    agg["experts_full"].append(st["mean_distinct_experts_full"])
                    agg["max_experts"] = max(agg["max_experts"], st["max_distinct_experts"])
                    agg["max_experts_full"] = max(agg["max_experts_full"], st["max_distinct_experts_full"])
            agg["tokens_per_second"] = agg["tokens"] / agg["seconds"] if agg["seconds"] else 0.0
            agg["tokens_per_forward"] = agg["tokens"] / agg["forwards"] if agg["forwards"] else 0.0
            out[mode] = agg
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--coreset-top-p", type=float, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first K prompts (default all)")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (-1 = all)")
    a = ap.parse_args(argv)
    kw = {k: v for k, v in (("block_size", a.block_size), ("threshold", a.threshold),
                            ("coreset_top_p", a.coreset_top_p)) if v is not None}
    if not 1 <= a.prompts <= len(PROMPTS):
        ap.error(f"--prompts: {a.prompts} is not in 1..{len(PROMPTS)}")
    res = run(a.model, a.n_gen, a.threads, a.n_gpu_layers, a.prompts, **kw)
    print(f"{a.model}: {a.prompts} prompts x {a.n_gen} greedy tokens, {a.threads} threads, {kw or 'GGUF defaults'}")
    print("| mode | tokens/s | tokens/forward | forwards (prefill excluded) | experts/layer mean (max), coreset | without coreset | spec accepted drafts histogram |")
    print("| --- | ---: | ---: | --- | ---: | ---: | --- |")
    for mode, r in res.items():
        kinds = ", ".join(f"{k} {r[k]}" for k in KINDS[1:] if r[k])
        ex = f"{sum(r['experts']) / len(r['experts']):.1f} ({r['max_experts']})" if r["experts"] else ""
        exf = f"{sum(r['experts_full']) / len(r['experts_full']):.1f} ({r['max_experts_full']})" if r["experts"] else ""
        print(f"| {mode} | {r['tokens_per_second']:.2f} | {r['tokens_per_forward']:.3f} | {kinds} | {ex} | {exf} | "
              f"{r['accept_hist'] if mode == 'spec' else ''} |")
    if a.json:
        print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
