"""``clover-gguf serve``: the OpenAI-compatible HTTP server (:mod:`clover_gguf.server`)."""
from __future__ import annotations

import os

from ..options import MODES, int_at_least
from .common import MODEL_HELP, UsageError, add_device_args, add_threads_ctx_args, check_model_path, \
    placement_kwargs


def cmd(a) -> int:
    check_model_path(a.model)
    try:  # fastapi / uvicorn are imported only here (the "server" extra)
        from ..server import serve
    except ImportError as e:
        raise UsageError(f"serve needs fastapi and uvicorn ({e}): pip install 'clover-gguf[server]'") from None
    return serve(a.model, host=a.host, port=a.port, api_key=a.api_key, n_ctx=a.ctx_size,
                 n_threads=a.threads, mode=a.mode, **placement_kwargs(a))


def add_parser(sub) -> None:
    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics)")
    sv.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    sv.add_argument("--port", type=int_at_least(0), default=8080, help="port (8080)")
    sv.add_argument("--api-key", default=os.environ.get("CLOVER_API_KEY"),
                    help="require Authorization: Bearer KEY on /v1 (default: $CLOVER_API_KEY, else none)")
    sv.add_argument("--mode", choices=MODES, default=None,
                    help="default decoding mode of requests (diffusion for clover, ar for qwen35moe)")
    add_threads_ctx_args(sv)
    add_device_args(sv)
    sv.set_defaults(func=cmd)
