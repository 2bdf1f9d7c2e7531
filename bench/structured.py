"""The cost of constrained decoding per mode (docs/structured-output.md): decode tokens/s and
tokens per forward with and without a JSON schema on the same model, prompts and settings in one
run, and llguidance's time per mask (the allowed-token set computed before each choice) and per
accepted token, measured inside the engine's callbacks.

Unconstrained runs suppress the end tokens (logit_bias -100) so that each writes ``-n`` tokens;
constrained runs end where the schema's JSON ends (at most ``-n``). Decode time excludes the
prompt's prefill.

CLI: ``python bench/structured.py MODEL [-t THREADS] [-n TOKENS] [--prompts K] [--block-size B]
[--json]``
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from clover_gguf import grammar  # noqa: E402
from clover_gguf.model import Model  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "tags", "address"], "additionalProperties": False}
PROMPTS = ["Describe a person as JSON:", "def parse(data):", "The capital of France is", "Here is a record:",
           "import json\n", "Q: who are you?\nA:", "Config:", "user ="]


class _Timer:
    """Wall time spent in the constraint's callbacks (llguidance's mask and accept)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds = {"mask": 0.0, "accept": 0.0}
        self.calls = {"mask": 0, "accept": 0}

    def install(self) -> None:
        for name in self.seconds:
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        fn = getattr(grammar.Constraint, "_" + name)

        def timed(c, user, arg):
            t = time.perf_counter()
            try:
                return fn(c, user, arg)
            finally:
                self.seconds[name] += time.perf_counter() - t
                self.calls[name] += 1
        setattr(grammar.Constraint, "_" + name, timed)

    def ms(self, name: str) -> float:
        return 1e3 * self.seconds[name] / max(self.calls[name], 1)


def _run(m: Model, mode: str, prompts, n: int, block_size: int | None, schema) -> dict:
    """Sum over prompts of generated tokens, forwards, decode seconds."""
    tot = {"tokens": 0, "forwards": 0, "seconds": 0.0, "valid": 0}
    no_end = {t: -100.0 for t in m.end_ids}
    for k, p in enumerate(prompts):
        kw = dict(mode=mode, max_tokens=n, seed=k, block_size=block_size)
        if schema is None:
            kw["logit_bias"] = no_end
        else:
            kw["json_schema"] = schema
        ids, st = m.generate_tokens(m.tokenize(p), **kw)
        tot["tokens"] += st["n_generated"]
        tot["forwards"] += st["n_forward"] - st["n_forward_prefill"]
        tot["seconds"] += st["seconds"] - st["prefill_seconds"]
        if schema is not None and st["finish_reason"] == "stop":
            json.loads(m.detokenize([t for t in ids if t not in m.end_ids]))
            tot["valid"] += 1
    return tot


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="tokens/s and tokens per forward with and without a JSON schema")
    ap.add_argument("model")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=None, help="spec / diffusion block (GGUF default)")
    ap.add_argument("--json", action="store_true", help="also print the raw figures as JSON")
    a = ap.parse_args(argv)
    timer = _Timer()
    timer.install()
    m = Model(a.model, n_ctx=2048, n_threads=a.threads)
    prompts = PROMPTS[:a.prompts]
    t = time.perf_counter()
    grammar.ll_tokenizer(m.tokenizer, m.n_vocab, m.end_ids)
    t_tok = time.perf_counter() - t
    modes = ["ar", "spec", "diffusion"] if m.has_block else ["ar"]
    print(f"model {os.path.basename(a.model)}: n_vocab {m.n_vocab}, {a.threads} threads, {platform.processor() or platform.machine()}; "
          f"llguidance tokenizer built in {t_tok:.2f} s; {len(prompts)} prompts x {a.n_gen} tokens")
    print("| mode | free tok/s | free tok/forward | schema tok/s | schema tok/forward | schema tok/s ratio "
          "| valid JSON | mask ms | accept ms | masks per token |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    raw = {}
    _run(m, modes[0], prompts[:1], 8, a.block_size, SCHEMA)  # warm-up (grammar compile paths, caches)
    for mode in modes:
        free = _run(m, mode, prompts, a.n_gen, a.block_size, None)
        timer.reset()
        con = _run(m, mode, prompts, a.n_gen, a.block_size, SCHEMA)
        fs, cs = free["tokens"] / free["seconds"], con["tokens"] / con["seconds"]
        row = {"free": free, "schema": con, "mask_ms": timer.ms("mask"), "accept_ms": timer.ms("accept"),
               "masks_per_token": timer.calls["mask"] / max(con["tokens"], 1)}
        raw[mode] = row
        print(f"| {mode} | {fs:.1f} | {free['tokens'] / free['forwards']:.2f} | {cs:.1f} | "
              f"{con['tokens'] / con['forwards']:.2f} | {cs / fs:.2f} | {con['valid']}/{len(prompts)} | "
              f"{row['mask_ms']:.3f} | {row['accept_ms']:.3f} | {row['masks_per_token']:.2f} |")
    if a.json:
        print(json.dumps(raw, indent=1))
    m.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
