#!/usr/bin/env python3
"""GPU logits against the CPU's on a benchmark model (whole-model logits at real
dimensions), with the CPU engine's own spread between its instruction sets as the yardstick.

Greedy tokens of two backends can part on a random model for a reason other than a defect:
a quantised model rounds each activation to int8 steps (Q8_0/Q8_K, as llama.cpp), so a last-bit
difference in float summation order can cross a step, move a router near a tie and choose another
expert, which changes the logits by a large amount. The CPU engine shows it on its own: its
scalar and SIMD paths (same weights, other float orders) differ on such models too. This script
puts a number on both, so that a token difference in ``device_check.sh`` can be read: GPU-CPU
differences of the size of the CPU's own scalar-SIMD ones are float order; much larger ones, or
differences at F32 weights, are not.

For each of bench/modes.py's prompts: the prefix-mode logits of the prompt, and one block
forward after it (all mask ids; the GGUF's coreset top-p, then 1.0: every routed expert).

  python bench/logits_check.py MODEL OUT.npz [-ngl N] [-t T] [--prompts K]   # one backend's logits
                                                  # (the first K prompts; CLOVER_ISA lowers the CPU's ISA)
  python bench/logits_check.py --compare REF.npz A.npz [B.npz ...]

``--compare`` prints, per other file and per kind (prefix, block, block without coreset), the
largest |difference| over all rows as a multiple of REF's standard deviation, the rows whose
argmax differs, and the smallest top-2 gap of REF's rows (in the same unit), and the distinct
experts per layer that each block pass used.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from modes import PROMPTS  # noqa: E402

KINDS = (("pre", "prefix"), ("blk", "block, coreset"), ("full", "block, every expert"))


def collect(path: str, out: str, n_gpu_layers: int, threads: int, n_prompts: int) -> None:
    """Writes OUT.npz: for prompt i < n_prompts, pre{i} [len(prompt), n_vocab], blk{i} and full{i} [B, n_vocab]
    (float32 logits) and blk{i}_experts, full{i}_experts (int, distinct experts per layer)."""
    from clover_gguf import Model

    res = {}
    with Model(path, n_ctx=1024, n_threads=threads, n_gpu_layers=n_gpu_layers) as m:
        if not m.has_block:
            raise SystemExit(f"{path}: not a clover model (no block mode)")
        block = [m.hparams["mask_token_id"]] * m.hparams["block_size"]
        for i, p in enumerate(PROMPTS[:n_prompts]):
            ids = m.tokenize(p)
            res[f"pre{i}"] = m.prefix_logits(ids)
            for key, top_p in (("blk", m.hparams["coreset_top_p"]), ("full", 1.0)):
                res[f"{key}{i}"], ne = m.block_logits(ids, block, coreset_top_p=top_p)
                res[f"{key}{i}_experts"] = np.array(ne)
    np.savez(out, **res)


def compare(ref_path: str, others: list[str]) -> None:
    """Prints the comparison of --compare (module docstring)."""
    ref = np.load(ref_path)
    for path in others:
        o = np.load(path)
        print(f"{path} against {ref_path}:")
        for key, label in KINDS:
            worst, flips, rows, gap, experts = 0.0, 0, 0, np.inf, 0
            for i in range(len(PROMPTS)):
                if f"{key}{i}" not in ref or f"{key}{i}" not in o:
                    continue
                a, b = ref[f"{key}{i}"], o[f"{key}{i}"]
                std = float(np.std(a))
                worst = max(worst, float(np.max(np.abs(a - b))) / std)
                flips += int(np.sum(np.argmax(a, -1) != np.argmax(b, -1)))
                rows += a.shape[0]
                top2 = np.sort(a, axis=-1)[:, -2:]
                gap = min(gap, float(np.min(top2[:, 1] - top2[:, 0])) / std)
                if key != "pre":
                    experts += int(np.sum(ref[f"{key}{i}_experts"] != o[f"{key}{i}_experts"]))
            ex = f", layers whose expert count differs {experts}" if key != "pre" else ""
            print(f"  {label:20s} max |diff| / std {worst:.2e}, argmax differs in {flips} of {rows} rows, "
                  f"smallest top-2 gap / std {gap:.2e}{ex}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="MODEL OUT.npz, or with --compare: REF.npz A.npz ...")
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (-1 = all)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="the first K prompts (default all)")
    a = ap.parse_args(argv)
    if a.compare:
        if len(a.files) < 2:
            ap.error("--compare needs REF.npz and at least one other file")
        compare(a.files[0], a.files[1:])
    else:
        if len(a.files) != 2:
            ap.error("give MODEL and OUT.npz")
        collect(a.files[0], a.files[1], a.n_gpu_layers, a.threads, a.prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
