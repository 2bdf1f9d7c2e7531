"""``clover-gguf logits``: prefix-mode logits [n_tokens, n_vocab] float32 to a .npy file."""
from __future__ import annotations

import os
import sys

from .common import EXIT_OK, MODEL_HELP, UsageError, add_device_args, add_threads_ctx_args, load_model, \
    placement_kwargs


def _parse_tokens(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise UsageError(f"--tokens: expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise UsageError("--tokens: empty")
    return ids


def cmd(a) -> int:
    import numpy as np

    ids = _parse_tokens(a.tokens) if a.tokens is not None else None
    out_dir = os.path.dirname(os.path.abspath(a.output))
    if not os.path.isdir(out_dir):
        raise UsageError(f"--output: directory does not exist: {out_dir}")
    m = load_model(a.model, a.ctx_size, a.threads, placement_kwargs(a))
    with m:
        if ids is None:
            ids = m.tokenize(a.prompt)
            if not ids:
                raise UsageError("--prompt: empty (no tokens)")
        n_ctx_needed = len(ids)
        if n_ctx_needed > m.n_ctx:
            raise UsageError(f"{n_ctx_needed} tokens do not fit --ctx-size {m.n_ctx}")
        try:
            logits = m.prefix_logits(ids)
        except ValueError as e:
            raise UsageError(str(e)) from None
    with open(a.output, "wb") as fh:  # np.save(path) would append .npy to other names
        np.save(fh, logits)
    print(f"wrote {a.output}: float32 {list(logits.shape)} (tokens: {','.join(map(str, ids))})",
          file=sys.stderr)
    return EXIT_OK


def add_parser(sub) -> None:
    lg = sub.add_parser("logits", help="write prefix-mode logits [n_tokens, n_vocab] float32 to .npy")
    lg.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    src = lg.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    lg.add_argument("-o", "--output", required=True, help="output .npy file")
    add_threads_ctx_args(lg)
    add_device_args(lg)
    lg.set_defaults(func=cmd)
