"""``clover-gguf serve``: the OpenAI-compatible HTTP server (:mod:`clover_gguf.server`)."""
from __future__ import annotations

import argparse
import math
import os

from ..options import MODES, int_at_least
from .common import MODEL_HELP, UsageError, _size_arg, add_device_args, add_model_args, add_reasoning_args, \
    add_threads_ctx_args, check_model_path, model_kwargs, placement_kwargs, template_kwargs


def _seconds(s: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {s!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"{s} must be a finite number >= 0")
    return v


def cmd(a) -> int:
    if a.api_key is not None and not a.api_key.strip():
        raise UsageError("--api-key: empty (from the flag or CLOVER_API_KEY): it would accept an empty bearer "
                         "token; give a key, or unset CLOVER_API_KEY to serve without one")
    if a.slot_save_path is not None and not os.path.isdir(a.slot_save_path):
        raise UsageError(f"--slot-save-path: {a.slot_save_path!r} is not a directory")
    check_model_path(a.model)
    tkw = template_kwargs(a)
    try:  # fastapi / uvicorn are imported only here (the "server" extra)
        from ..server import serve
    except ImportError as e:
        raise UsageError(f"serve needs fastapi and uvicorn ({e}): pip install fastapi uvicorn "
                         "(from a clone: pip install '.[server]')") from None
    return serve(a.model, host=a.host, port=a.port, api_key=a.api_key, max_body=a.max_body,
                 max_queue=a.max_queue, timeout=a.timeout, n_parallel=a.parallel, n_ctx=a.ctx_size,
                 n_threads=a.threads, mode=a.mode,
                 prefix_reuse=not a.no_prefix_reuse, pooling_type=-1 if a.pooling is None else a.pooling,
                 chat_template_kwargs=tkw, slot_save_path=a.slot_save_path, **placement_kwargs(a),
                 **model_kwargs(a))


def add_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                        "/v1/embeddings, /v1/models, /health, /metrics)")
    sv.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int_at_least(0), default=8080, help="port (8080)")
    sv.add_argument("--api-key", default=os.environ.get("CLOVER_API_KEY"),
                    help="require Authorization: Bearer KEY on /v1 (default: $CLOVER_API_KEY, else none)")
    sv.add_argument("--mode", choices=MODES, default=None,
                    help="default decoding mode of requests (diffusion for clover, ar for qwen35moe)")
    sv.add_argument("--max-body", type=_size_arg, default=None,
                    help="largest request body, bytes or a size such as 4M (default: 64 bytes per context "
                         "token, at least 1M); larger ones get 413")
    sv.add_argument("-np", "--parallel", type=int_at_least(1), default=4,
                    help="slots: generations at once, batched together (llama-server's flag; 4); memory for "
                         "this many contexts of --ctx-size is needed")
    sv.add_argument("--slot-save-path", default=None, metavar="DIR",
                    help="enable llama-server's slot actions (POST /slots/ID?action=save|restore|erase), their "
                         "files in this existing directory (default: disabled, 501)")
    sv.add_argument("--max-queue", type=int_at_least(1), default=64,
                    help="requests waiting for a slot before new ones get 503 with Retry-After (64)")
    sv.add_argument("--timeout", type=_seconds, default=600.0,
                    help="seconds a request may take, waiting included; then it is cancelled (600; 0: none)")
    sv.add_argument("--pooling", choices=("mean", "last"), default=None,
                    help="pooling of /v1/embeddings (llama-server's flag; default: the GGUF's pooling_type, "
                         "else last)")
    sv.add_argument("--no-prefix-reuse", action="store_true",
                    help="prefill every prompt in full (by default a request extending its client's previous "
                         "one prefills only the new tokens)")
    add_reasoning_args(sv, "answers to chat requests that set neither enable_thinking nor it in their "
                       "chat_template_kwargs")
    add_threads_ctx_args(sv)
    add_device_args(sv)
    add_model_args(sv)
    sv.set_defaults(func=cmd)
