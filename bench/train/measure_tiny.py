#!/usr/bin/env python3
"""Decoding figures of a trained Clover on ten typical prompts.

For each prompt: greedy ``diffusion`` at the GGUF's defaults (threshold, block size, coreset,
penalties): tokens, forwards (prefill excluded: denoise + commit), tokens per forward,
denoising passes per block, and how many of its first tokens equal greedy ``ar``'s (a model
can fill many slots per pass with text of its own: this says whether the text is the one
the causal model would write), and the share of its tokens equal to the token before (runs of
one token, which a collapsing model fills many per pass); ``spec``: drafts accepted per
verify (mean and histogram) and whether its tokens equal greedy ``ar``'s (they must, with
penalties off: spec is lossless against plain greedy decoding only; with penalties on, the
comparison is informative).
Generation stops at the end tokens as ``clover-gguf run`` does, or after ``-n`` tokens.

Usage: CLOVER_LIB=... python bench/train/measure_tiny.py [MODEL.gguf] [-n 128] [-t 2]
       [--threshold X] [--block-size B] [--no-penalties] [--json]
MODEL defaults to the embedded model (clover_gguf.DEFAULT_MODEL).
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import clover_gguf  # noqa: E402
from clover_gguf import Model  # noqa: E402

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Config:\n    def __init__(self",
    "    def __repr__(self):\n",
    "def read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n",
    "try:\n    import json\nexcept ImportError:\n",
    "for i in range(",
    "    if not isinstance(value, str):\n        raise TypeError(",
    "# Copyright (C) 2001 Python Software Foundation\n\"\"\"",
    "    @property\n    def name(self):\n",
]


def measure(path, n=128, threads=2, **kw) -> list[dict]:
    rows = []
    with Model(path, n_ctx=1024, n_threads=threads) as m:
        for p in PROMPTS:
            ids = m.tokenize(p)
            ar, _ = m.generate_tokens(ids, max_tokens=n, mode="ar", **kw)
            dt, sd = m.generate_tokens(ids, max_tokens=n, mode="diffusion", **kw)
            sp, ss = m.generate_tokens(ids, max_tokens=n, mode="spec", **kw)
            h = ss["accept_hist"]
            verifies = sum(h)
            fw = sd["n_forward"] - sd["n_forward_prefill"]
            same = next((i for i, (a, b) in enumerate(zip(dt, ar)) if a != b), min(len(dt), len(ar)))
            rows.append({
                "prompt": p, "diffusion_text": m.detokenize(dt), "ar_text": m.detokenize(ar), "ar_tokens": len(ar),
                "diffusion_tokens": len(dt), "diffusion_forwards": fw,
                "denoise": sd["n_forward_denoise"], "commit": sd["n_forward_commit"],
                "tokens_per_forward": len(dt) / fw if fw else 0.0,
                "fills_per_denoise": len(dt) / sd["n_forward_denoise"] if sd["n_forward_denoise"] else 0.0,
                "diffusion_seconds": sd["seconds"], "diffusion_ar_prefix": same,
                "diffusion_repeats": sum(a == b for a, b in zip(dt, dt[1:])),
                "ar_repeats": sum(a == b for a, b in zip(ar, ar[1:])),
                "spec_tokens": len(sp), "spec_accept_hist": h,
                "spec_accepted_per_verify": sum(i * c for i, c in enumerate(h)) / verifies if verifies else 0.0,
                "spec_tokens_per_forward": ss["tokens_per_forward"], "spec_equals_ar": sp == ar,
            })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=clover_gguf.DEFAULT_MODEL)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--threshold", type=float, default=None)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--no-penalties", action="store_true", help="presence_penalty 0, repeat_penalty 1")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = {k: v for k, v in (("threshold", a.threshold), ("block_size", a.block_size)) if v is not None}
    if a.no_penalties:
        kw.update(presence_penalty=0.0, repeat_penalty=1.0)
    rows = measure(a.model, a.n_gen, a.threads, **kw)
    print(f"{a.model}: {len(rows)} prompts, up to {a.n_gen} greedy tokens, {kw or 'GGUF defaults'}")
    print("| prompt | diffusion tokens | forwards (denoise + commit) | tokens/forward | fills/denoise | "
          "first tokens == ar | spec accepted/verify | spec == ar |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {json.dumps(r['prompt'])[:40]} | {r['diffusion_tokens']} | {r['diffusion_forwards']} "
              f"({r['denoise']} + {r['commit']}) | {r['tokens_per_forward']:.2f} | {r['fills_per_denoise']:.2f} | "
              f"{r['diffusion_ar_prefix']} | {r['spec_accepted_per_verify']:.2f} | {r['spec_equals_ar']} |")
    tok = sum(r["diffusion_tokens"] for r in rows)
    fw = sum(r["diffusion_forwards"] for r in rows)
    hist = [sum(r["spec_accept_hist"][i] if i < len(r["spec_accept_hist"]) else 0 for r in rows)
            for i in range(max(len(r["spec_accept_hist"]) for r in rows))]
    print(f"all prompts: diffusion {tok} tokens in {fw} forwards = {tok / fw:.2f} tokens/forward; "
          f"spec accepted drafts per verify {sum(i * c for i, c in enumerate(hist)) / max(1, sum(hist)):.2f} "
          f"(histogram {hist}); diffusion's first tokens equal ar's: "
          f"{sum(r['diffusion_ar_prefix'] for r in rows) / len(rows):.1f} on average; "
          f"spec == ar on {sum(r['spec_equals_ar'] for r in rows)} of {len(rows)}; tokens equal to the one before: "
          f"diffusion {sum(r['diffusion_repeats'] for r in rows) / max(1, tok - len(rows)):.2f}, "
          f"ar {sum(r['ar_repeats'] for r in rows) / max(1, sum(r['ar_tokens'] - 1 for r in rows)):.2f}")
    if a.json:
        print(json.dumps(rows, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
