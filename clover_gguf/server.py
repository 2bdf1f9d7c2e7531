"""OpenAI-compatible HTTP server over :class:`~clover_gguf.llama.Clover`.

``clover-gguf serve -m MODEL`` runs :func:`create_app` under uvicorn. Endpoints, as
llama.cpp's ``llama-server`` and OpenAI name them:

- ``GET /v1/models``; ``POST /v1/completions``; ``POST /v1/chat/completions``: the request
  fields are OpenAI's (plus llama.cpp's ``top_k, min_p, repeat_penalty`` and this runtime's
  ``mode, block_size, threshold, coreset_top_p, enable_thinking, chat_template_kwargs``) and
  go one to one to :meth:`Clover.create_completion` / :meth:`Clover.create_chat_completion`;
  ``stream: true`` answers Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``), each
  chunk carrying the text that became final (committed) since the previous one.
- ``POST /v1/embeddings``: OpenAI's request (``input``: a string, a list of strings, a list of
  token ids or a list of such lists; ``encoding_format`` ``"float"`` or ``"base64"``;
  ``dimensions`` only n_embd) answered by :meth:`Clover.create_embedding`, each vector L2
  normalised (as OpenAI's and llama-server's); an input longer than the context is a 400
  ``context_length_exceeded``.
- ``GET /health``: 503 ``{"status": "loading model"}`` while the model loads, 200
  ``{"status": "ok"}`` after (llama.cpp's shape).
- ``GET /metrics``: Prometheus text format (requests, tokens, active and queued requests; per
  slot whether it is busy and the tokens it generated; the continuous batch's passes).
- ``GET /slots``: per slot ``id``, ``n_ctx``, ``is_processing`` (llama-server's fields; with
  ``?fail_on_no_slot=1`` a 503 when every slot is busy). ``POST /slots/{id_slot}?action=save|restore``
  with ``{"filename": NAME}`` and ``POST /slots/{id_slot}?action=erase``: llama-server's slot
  actions (:func:`_slot_action`), enabled by ``slot_save_path`` (``--slot-save-path DIR``).

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``; a malformed
body or a bad field value is 400 with the field in ``param`` (a prompt longer than the context:
code ``context_length_exceeded``), a body over ``max_body`` bytes 413, a missing or wrong API
key 401 (``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open, as in llama.cpp).

Slots: ``n_parallel`` (llama-server's ``-np``; 1 unless given) generations run at once, each on
its own context of the one :class:`Clover` object, their forwards batched together (continuous
batching, :class:`~clover_gguf.model.Model`). A request is read, parsed, rendered (chat template)
and tokenized outside the slots, in a worker thread, then waits in a FIFO queue
(``clover_requests_queued``) for a free slot; past ``max_queue`` waiting requests a new one gets
503 with ``Retry-After``. A request older than ``timeout`` seconds is ended: 408 while its body
is still arriving, 503 while it waits, 504 (or an error event in a stream) once it generates,
its generation cancelled. A client that disconnects (mid-stream or while a non-streamed answer is
computed) gets its generation cancelled (that request's alone: :meth:`Stream.cancel
<clover_gguf.llama.Stream.cancel>`, or :meth:`Clover.cancel` of its worker thread), which stops
its forward pass before its next layer, so the slot is free for the next request within one
forward; the other slots' generations go on unchanged.

Prefix reuse (``Clover(prefix_reuse=True)``): a request whose prompt extends what a slot's
caches hold prefills only the new tokens, and a request goes to the free slot that shares the
most of its prompt (llama-server's slot choice). The caches are kept per client (Clover's
``prompt_cache_key``): a request whose client key (OpenAI's ``prompt_cache_key``, else ``user``;
requests with neither share one anonymous key) differs from the key of the slot's previous request
starts from an empty context, so one client cannot learn from ``timings.n_prompt_reused`` or
from the answer's timing whether another's prompt starts as its guess.

fastapi and uvicorn (the ``server`` extra) are imported only here, i.e. only by ``serve``.
"""
from __future__ import annotations

import asyncio
import base64
import ctypes
import gc
import json
import os
import secrets
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .llama import constrains, embedding_inputs
from .model import ContextLengthExceeded
from .options import REQUEST_FIELDS

__all__ = ["create_app", "serve", "default_max_body"]

# Request limits (create_app's defaults): waiting requests, seconds per request, and the body size
# per context token with its floor (a prompt of n_ctx tokens fits with room for JSON escapes).
MAX_QUEUE = 64
TIMEOUT = 600.0
BODY_BYTES_PER_TOKEN = 64
MIN_MAX_BODY = 1 << 20
# Bodies from this size on are followed by _release_memory once prepared.
BIG_BODY = 1 << 20


def _release_memory() -> None:
    """Give back the memory of a big request now: collect the reference cycles its prompt and ids
    may sit in (an error's frames), which the interpreter would otherwise keep until its next full
    collection, then return the C heap's free pages to the system (glibc's malloc_trim)."""
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc():
    try:
        libc = ctypes.CDLL(None)
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _glibc()


def _limit_malloc_arenas() -> None:
    """glibc gives every thread that allocates its own malloc arena, and a server's worker threads
    each parse and tokenize big bodies: cap the arenas at 2 so that their freed memory is shared
    and returned rather than kept per thread (mallopt M_ARENA_MAX; glibc only)."""
    if _LIBC is not None and hasattr(_LIBC, "mallopt"):
        _LIBC.mallopt(-8, 2)  # M_ARENA_MAX (malloc.h)


def default_max_body(n_ctx: int) -> int:
    """The default request-body limit in bytes for a context of ``n_ctx`` tokens."""
    return max(MIN_MAX_BODY, BODY_BYTES_PER_TOKEN * int(n_ctx))


# Request fields passed through unchanged, per endpoint (OpenAI's, llama.cpp's, ours).
_COMMON = REQUEST_FIELDS + ("logprobs", "response_format", "grammar")
_COMPLETION = _COMMON + ("echo", "suffix")
_CHAT = _COMMON + ("top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "enable_thinking", "chat_template_kwargs")


class _ApiError(Exception):
    """An OpenAI-shaped error answer."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _value_error(e: Exception, prompt_param: str = "prompt") -> _ApiError:
    """400 for a ValueError / TypeError of Clover, whose messages start with the field name
    (``temperature: expected ...``, ``prompt[3]: token id ...``); a prompt that does not fit the
    context is OpenAI's ``context_length_exceeded`` on ``prompt_param``."""
    msg = str(e)
    if isinstance(e, ContextLengthExceeded):
        return _ApiError(400, msg, param=prompt_param, code="context_length_exceeded")
    head = msg.split(":", 1)[0] if ":" in msg else ""
    param = head.split("[", 1)[0].strip() if head and " " not in head.strip() else None
    return _ApiError(400, msg, param=param or None, code="invalid_value")


# What a request handler passes on as raised: interruption and task cancellation; anything else a
# generation or a library raises (a native library's panic included) becomes an error answer.
_PASS_THROUGH = (KeyboardInterrupt, SystemExit, asyncio.CancelledError)


def _failure(e: BaseException, prompt_param: str = "prompt") -> _ApiError:
    """The error answer for what a generation raised: 400 for a bad value, else 500."""
    if isinstance(e, (ValueError, TypeError)):
        return _value_error(e, prompt_param)
    return _ApiError(500, f"{type(e).__name__}: {e}", "server_error")


class _Job:
    """One generation holding a slot: ``done`` is set (on the event loop) when its worker
    thread has finished and the slot is released. Its call is cancelled alone: a stream by its
    :class:`Stream` (``stream``), a whole answer by the thread running it (``thread``, cleared
    under ``lock`` before that thread takes another request)."""

    __slots__ = ("done", "stop", "deadline", "started", "lock", "thread", "stream")

    def __init__(self, deadline: float) -> None:
        self.done = False
        self.stop = threading.Event()
        self.deadline = deadline  # loop.time() past which the request is ended (inf: none)
        self.lock = threading.Lock()
        self.thread: int | None = None
        self.stream = None

    def cancel(self, clover) -> None:
        with self.lock:
            if self.stream is not None:
                self.stream.cancel()
            elif self.thread is not None:
                clover.cancel(thread=self.thread)

    def remaining(self) -> float | None:
        return _seconds_left(self.deadline)


def _seconds_left(deadline: float) -> float | None:
    """Seconds left before ``deadline`` (event-loop time; inf: None, no limit)."""
    if deadline == float("inf"):
        return None
    return max(0.0, deadline - asyncio.get_running_loop().time())


class _State:
    """What the app shares across requests: the model (None while loading), the slot, the
    counters of /metrics."""

    def __init__(self, model_path: str, model_id: str, api_key: str | None, clover_kwargs: dict,
                 max_body: int | None, max_queue: int, timeout: float, slot_save_path: str | None = None) -> None:
        self.model_path, self.model_id, self.api_key = model_path, model_id, api_key
        self.slot_save_path = slot_save_path  # the directory of the slot actions' files (None: disabled)
        self.clover_kwargs = clover_kwargs
        self.max_body = max_body if max_body is not None else default_max_body(clover_kwargs.get("n_ctx", 4096))
        self.max_queue, self.timeout = max_queue, timeout
        self.pending = 0  # admitted requests not yet holding a slot (preparing or queued)
        self.n_parallel = int(clover_kwargs.get("n_parallel", 1))
        self.durations: list[float] = []  # seconds the last requests held a slot (Retry-After)
        self.clover = None
        self.load_error: BaseException | None = None
        self.loaded = threading.Event()
        self.created = int(time.time())
        self.sem: asyncio.Semaphore | None = None
        self.active = 0
        self.queued = 0
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.tokens_generated = 0
        self.slot_tokens: dict[int, int] = {}  # completion tokens per slot (timings["id_slot"])
        self.cancelled = 0
        self.tasks: set = set()  # background tasks (kept referenced until done)

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def add_usage(self, answer: dict) -> None:
        """Count the tokens of a response (or a stream's last chunk): its usage, per slot."""
        usage = answer.get("usage")
        if usage:
            self.prompt_tokens += int(usage.get("prompt_tokens", 0))
            self.tokens_generated += int(usage.get("completion_tokens", 0))
            slot = (answer.get("timings") or {}).get("id_slot")
            if slot is not None:
                self.slot_tokens[slot] = self.slot_tokens.get(slot, 0) + int(usage.get("completion_tokens", 0))

    def load(self) -> None:
        from .llama import Clover
        from .preload import preload

        try:
            preload(self.model_path)  # progress bar on a terminal while /health answers 503
            self.clover = Clover(self.model_path, **{"embedding": True, **self.clover_kwargs})
            m = self.clover.engine
            print(f"context memory: {m.n_parallel} slot{'s' if m.n_parallel > 1 else ''} x "
                  f"{m.context_bytes / 2**20:.1f} MiB (n_ctx {m.n_ctx}) = "
                  f"{m.n_parallel * m.context_bytes / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        except BaseException as e:  # reported by /health and by serve()
            self.load_error = e
            print(f"error: loading {self.model_path}: {e}", file=sys.stderr, flush=True)
        finally:
            self.loaded.set()

    # -------------------------------------------------------------- the slots
    def retry_after(self) -> str:
        """Seconds a refused client should wait: the queue times the mean slot time over the
        slots, 1..60."""
        mean = sum(self.durations) / len(self.durations) if self.durations else 1.0
        return str(int(min(60, max(1, round(mean * (self.queued + self.active) / self.n_parallel)))))

    def admit(self) -> float:
        """Count a new request as pending; 503 when ``max_queue`` requests are pending already.
        Returns its deadline (loop time)."""
        if self.pending >= self.max_queue:
            raise _ApiError(503, f"server busy: {self.pending} requests waiting (max_queue {self.max_queue}); "
                            "retry later", "unavailable_error", code="queue_full")
        self.pending += 1
        now = asyncio.get_running_loop().time()
        return now + self.timeout if self.timeout > 0 else float("inf")

    async def acquire(self, deadline: float) -> _Job:
        """Wait for a slot until ``deadline`` (503 after it)."""
        if self.sem is None:
            self.sem = asyncio.Semaphore(self.n_parallel)
        job = _Job(deadline)
        self.queued += 1
        try:
            await asyncio.wait_for(self.sem.acquire(), job.remaining())
        except asyncio.TimeoutError:
            raise _ApiError(503, f"timed out after {self.timeout:g} s waiting for a slot (timeout)",
                            "unavailable_error", code="timeout") from None
        finally:
            self.queued -= 1
        self.active += 1
        job.started = asyncio.get_running_loop().time()
        return job

    def release(self, job: _Job) -> None:
        """On the event loop: the job's worker thread is over, the next request may start."""
        if not job.done:
            job.done = True
            self.active -= 1
            self.durations = (self.durations + [asyncio.get_running_loop().time() - job.started])[-16:]
            self.sem.release()

    def cancel_until_done(self, job: _Job) -> None:
        """Cancel ``job``'s generation now and again every 50 ms until its thread ends (a
        cancel() that came before the stream registered its call is repeated). ``job.done``
        and the slot change only on the event loop, so the call cancelled is always this
        job's."""
        job.stop.set()
        if job.done:
            return
        self.cancelled += 1

        async def loop():
            while not job.done:
                job.cancel(self.clover)
                await asyncio.sleep(0.05)

        t = asyncio.ensure_future(loop())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)


# ------------------------------------------------------------------------ request parsing
async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    too_big = _ApiError(413, f"request body: larger than the server's limit of {limit} bytes (max_body)",
                        param=None, code="request_too_large")
    if declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def _parse_json(raw: bytes):
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise _ApiError(400, "malformed JSON body: nested too deeply", code="invalid_json") from None


async def _json_body(request: Request, limit: int) -> tuple[dict, int]:
    """The request's JSON object and its size in bytes: read up to ``limit`` bytes, parsed in a
    worker thread."""
    raw = await _read_body(request, limit)
    body = await anyio.to_thread.run_sync(_parse_json, raw)
    if not isinstance(body, dict):
        raise _ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}",
                        code="invalid_json")
    return body, len(raw)


def _kwargs(body: dict, names: tuple) -> dict:
    kw = {k: body[k] for k in names if k in body and body[k] is not None}
    n = body.get("n")
    if n is not None and n != 1:
        raise _ApiError(400, f"n: only 1 choice per request is supported, got {n!r}", param="n",
                        code="invalid_value")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise _ApiError(400, f"stream: expected a boolean, got {stream!r}", param="stream", code="invalid_value")
    kw["stream"] = stream
    if isinstance(kw.get("logit_bias"), dict):  # JSON keys are strings: "151645": -100
        try:
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
        except (TypeError, ValueError):
            raise _ApiError(400, "logit_bias: keys must be token ids", param="logit_bias",
                            code="invalid_value") from None
    return kw


def _check_max_tokens(kw: dict) -> dict:
    """OpenAI's rule: no negative max_tokens (Clover's -1, llama-cpp-python's "no limit", is null
    or 0 here)."""
    n = kw.get("max_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n < 0:
        raise _ApiError(400, f"max_tokens: {n} must be >= 0 (null or 0: until the context is full)",
                        param="max_tokens", code="invalid_value")
    return kw


def _client_key(body: dict) -> str | None:
    """The client a request's prefix reuse belongs to: OpenAI's ``prompt_cache_key``, else
    ``user``; None (the anonymous client) without either."""
    for name in ("prompt_cache_key", "user"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, str):
                raise _ApiError(400, f"{name}: expected a string, got {type(v).__name__}", param=name,
                                code="invalid_value")
            return f"{name}:{v}"
    return None


def _completion_kwargs(body: dict) -> dict:
    kw = _kwargs(body, _COMPLETION)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
        raise _ApiError(400, "prompt: expected a string or a list of token ids (one prompt per request)",
                        param="prompt", code="invalid_value")
    if not isinstance(prompt, (str, list)):
        raise _ApiError(400, "prompt: required, a string or a list of token ids", param="prompt",
                        code="invalid_value")
    kw["prompt"] = prompt
    return _check_max_tokens(kw)


def _chat_kwargs(body: dict) -> dict:
    kw = _kwargs(body, _CHAT)
    if "max_tokens" not in kw and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    _check_max_tokens(kw)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _ApiError(400, "messages: required, a non-empty list of messages", param="messages",
                        code="invalid_value")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _ApiError(400, f"messages[{i}]: expected an object with a string 'role'",
                            param="messages", code="invalid_value")
    kw["messages"] = messages
    return kw


# OpenAI's limit on the inputs of one embeddings request.
MAX_EMBEDDING_INPUTS = 2048


def _embedding_kwargs(body: dict) -> dict:
    """An embeddings request's fields (OpenAI's; ``user`` is only the client key)."""
    if body.get("input") is None:
        raise _ApiError(400, "input: required, a string, a list of strings or a list of token ids", param="input",
                        code="invalid_value")
    fmt = body.get("encoding_format")
    if fmt is not None and fmt not in ("float", "base64"):
        raise _ApiError(400, f'encoding_format: expected "float" or "base64", got {fmt!r}', param="encoding_format",
                        code="invalid_value")
    dims = body.get("dimensions")
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)):
        raise _ApiError(400, f"dimensions: expected an integer, got {dims!r}", param="dimensions", code="invalid_value")
    return {"input": body["input"], "encoding_format": fmt or "float", "dimensions": dims, "stream": False}


def _base64_floats(v: list[float]) -> str:
    """OpenAI's base64 encoding of an embedding: its float32 values, little-endian."""
    return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")


# ------------------------------------------------------------------------ slot actions
_SLOT_ACTIONS = ("save", "restore", "erase")
# llama-server's answer when the slot actions are off (ERROR_TYPE_NOT_SUPPORTED: 501)
_NO_SLOT_ACTIONS = "This server does not support slots action. Start it with `--slot-save-path`"


def _slot_file(directory: str, body: dict) -> tuple[str, str]:
    """``(filename, path)`` of a slot action's ``filename``: a plain file name inside ``directory``
    (no path separator, no ``..``, no control character, no surrounding space, at most 255 UTF-8
    bytes, as llama.cpp's fs_validate_filename), else a 400 naming ``filename``."""
    name = body.get("filename")
    if not isinstance(name, str) or not name:
        raise _ApiError(400, "filename: required, the name of a file in the server's --slot-save-path",
                        param="filename", code="invalid_value")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        size = -1
    if not 0 < size <= 255 or ".." in name or name == "." or name != name.strip() or \
            any(c in "/\\" or ord(c) < 32 or ord(c) == 127 for c in name):
        raise _ApiError(400, f"filename: {name!r} is not a plain file name in the server's --slot-save-path (no "
                        "path separator, '..', control character or surrounding space; at most 255 bytes)",
                        param="filename", code="invalid_value")
    return name, os.path.join(directory, name)


def _slot_action(engine, directory: str, slot: int, action: str, body: dict, client) -> dict:
    """Run llama-server's slot ``action`` on slot ``slot`` of ``engine`` (a
    :class:`~clover_gguf.model.Model`; it waits while a request holds the slot) and return
    llama-server's answer: ``save`` writes :meth:`Model.save_state` to ``filename`` in
    ``directory`` (``n_saved`` tokens, ``n_written`` bytes), ``restore`` loads such a file into the
    slot for the requests of client key ``client`` (``n_restored``, ``n_read``), ``erase`` empties
    the slot (``n_erased`` tokens)."""
    from .state import unpack_state

    t0 = time.perf_counter()
    if action == "erase":
        return {"id_slot": slot, "n_erased": engine.reset(slot)}
    name, path = _slot_file(directory, body)
    if action == "save":
        blob = engine.save_state(slot)
        with open(path, "wb") as f:
            f.write(blob)
        n, what = "n_saved", "n_written"
    else:
        try:
            with open(path, "rb") as f:
                blob = f.read()
        except (FileNotFoundError, IsADirectoryError):
            raise _ApiError(400, f"filename: no file {name!r} in the server's --slot-save-path", param="filename",
                            code="invalid_value") from None
        engine.load_state(blob, slot, prompt_cache_key=client)
        n, what = "n_restored", "n_read"
    ms = (time.perf_counter() - t0) * 1000.0
    return {"id_slot": slot, "filename": name, n: len(unpack_state(blob, engine.n_vocab)[0]), what: len(blob),
            "timings": {f"{action}_ms": ms}}


# ------------------------------------------------------------------------ the app
def create_app(model_path: str, *, api_key: str | None = None, model_id: str | None = None,
               max_body: int | None = None, max_queue: int = MAX_QUEUE, timeout: float = TIMEOUT,
               chat_template_kwargs: dict | None = None, slot_save_path: str | None = None,
               **clover_kwargs: Any) -> FastAPI:
    """The FastAPI app serving ``model_path``; ``clover_kwargs`` go to :class:`Clover`
    (``n_ctx, n_threads, mode, ...``). The model loads in a background thread when the app
    starts (``/health`` answers 503 until it is loaded).

    ``chat_template_kwargs``: the default template variables of chat requests (llama.cpp's
    --chat-template-kwargs, and --reasoning as ``enable_thinking``); a request's own
    ``chat_template_kwargs`` win key by key, its ``enable_thinking`` over both; a constrained
    request (response_format, grammar, a forced tool) drops the default ``enable_thinking``.

    Limits: ``max_body`` bytes per request body (None: :func:`default_max_body` of ``n_ctx``),
    ``max_queue`` requests waiting for the slot, ``timeout`` seconds per request (0: none).
    ``api_key`` None serves without a key; an empty key is refused (ValueError).

    ``slot_save_path``: an existing directory enabling llama-server's slot actions (``POST
    /slots/{id_slot}?action=save|restore|erase``), whose files live there (None: they answer 501,
    as llama-server without --slot-save-path). Whoever may call the API may then save any slot's
    caches and restore them for any client key: the per-client prefix-reuse separation does not
    hold against them."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key: empty (it would accept an empty bearer token); give a key or None")
    for name, v in (("max_queue", max_queue), ("max_body", 1 if max_body is None else max_body)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout < float("inf"):
        raise ValueError(f"timeout: expected a finite number of seconds >= 0, got {timeout!r}")
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs: expected a dict, got {type(chat_template_kwargs).__name__}")
    if slot_save_path is not None:
        slot_save_path = os.fspath(slot_save_path)
        if not os.path.isdir(slot_save_path):
            raise ValueError(f"slot_save_path: {slot_save_path!r} is not a directory")
    default_tkw = dict(chat_template_kwargs or {})
    st = _State(str(model_path), model_id or os.path.basename(str(model_path)), api_key, clover_kwargs,
                max_body, max_queue, float(timeout), slot_save_path)

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=st.load, name="clover-load", daemon=True).start()
        yield
        if st.clover is not None:
            await anyio.to_thread.run_sync(st.clover.close)

    app = FastAPI(title="clover-gguf", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.clover = st

    @app.exception_handler(_ApiError)
    async def _api_error(request, e: _ApiError):
        resp = e.response()
        if e.status == 503 and e.code in ("queue_full", "timeout"):
            resp.headers["Retry-After"] = st.retry_after()
        return resp

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        code = "unknown_url" if e.status_code == 404 else None
        return _ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                         param=None, code=code).response()

    @app.exception_handler(Exception)
    async def _server_error(request, e: Exception):
        return _ApiError(500, f"{type(e).__name__}: {e}", "server_error").response()

    def check_key(request: Request) -> None:
        if st.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), st.api_key.encode()):
            raise _ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                            param=None, code="invalid_api_key")

    def check_loaded() -> None:
        if st.clover is None:
            msg = "loading model" if st.load_error is None else f"model failed to load: {st.load_error}"
            raise _ApiError(503, msg, "unavailable_error", code="model_not_ready")

    @app.get("/health")
    async def health():
        if st.clover is None:
            status = "loading model" if st.load_error is None else "error"
            return JSONResponse({"status": status}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        lines = ["# HELP clover_requests_total HTTP requests to the /v1 endpoints by endpoint and status.",
                 "# TYPE clover_requests_total counter"]
        for (ep, code), n in sorted(st.requests.items()):
            lines.append(f'clover_requests_total{{endpoint="{ep}",status="{code}"}} {n}')
        for name, kind, help_, v in (
                ("clover_prompt_tokens_total", "counter", "Prompt tokens prefilled.", st.prompt_tokens),
                ("clover_tokens_generated_total", "counter", "Tokens generated (completion tokens).",
                 st.tokens_generated),
                ("clover_requests_cancelled_total", "counter",
                 "Generations cancelled because the client disconnected or the request timed out.",
                 st.cancelled),
                ("clover_requests_active", "gauge", "Requests holding a slot (generating).", st.active),
                ("clover_requests_queued", "gauge", "Requests waiting for a slot.", st.queued),
                ("clover_requests_pending", "gauge",
                 "Requests admitted and not yet generating (preparing their prompt or queued).", st.pending),
                ("clover_slots_total", "gauge", "Generation slots (n_parallel).", st.n_parallel),
                ("clover_model_loaded", "gauge", "1 once the model is loaded.", int(st.clover is not None))):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {v}"]
        if st.clover is not None:
            lines += _slot_metrics(st)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/slots")
    async def slots(request: Request):
        """llama-server's slot list: ``id``, ``n_ctx``, ``is_processing`` per slot."""
        check_key(request)
        check_loaded()
        engine = st.clover.engine
        busy = engine.slot_busy()
        if request.query_params.get("fail_on_no_slot") and all(busy):
            raise _ApiError(503, "no slot available", "unavailable_error", code="no_slot_available")
        return [{"id": i, "n_ctx": engine.n_ctx, "is_processing": b} for i, b in enumerate(busy)]

    @app.post("/slots/{id_slot}")
    async def slot_action(request: Request, id_slot: str):
        """llama-server's slot actions: ``?action=save|restore|erase`` (:func:`_slot_action`)."""
        check_key(request)
        if st.slot_save_path is None:
            raise _ApiError(501, _NO_SLOT_ACTIONS, "not_supported_error", code=501)
        check_loaded()
        n = st.clover.engine.n_parallel
        if not (id_slot.isascii() and id_slot.isdigit() and int(id_slot) < n):
            raise _ApiError(400, f"id_slot: {id_slot!r} is not a slot of this server (0..{n - 1})", param="id_slot",
                            code="invalid_value")
        action = request.query_params.get("action")
        if action not in _SLOT_ACTIONS:
            raise _ApiError(400, f"action: expected one of {', '.join(_SLOT_ACTIONS)}, got {action!r}",
                            param="action", code="invalid_value")
        body = (await _json_body(request, st.max_body))[0] if action != "erase" else {}
        client = _client_key(body)
        try:
            return await anyio.to_thread.run_sync(_slot_action, st.clover.engine, st.slot_save_path, int(id_slot),
                                                  action, body, client)
        except (_ApiError, *_PASS_THROUGH):
            raise
        except BaseException as e:
            raise _failure(e, "state") from None

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        st.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": st.model_id, "object": "model", "created": st.created,
                                            "owned_by": "clover-gguf"}]}

    async def generate(request: Request, endpoint: str, parse, prepare, call, prompt_param: str):
        """Check, parse and prepare (render, tokenize: ``prepare(kw)`` in a worker thread, outside
        the slots) a request, then run ``call(client key, **kw)`` in a slot."""
        try:
            check_key(request)
            check_loaded()
            deadline = st.admit()
        except _ApiError as e:
            st.count(endpoint, e.status)
            raise
        size = 0
        try:
            try:
                body, size = await _read_in_time(st, _json_body(request, st.max_body), deadline)
                kw = parse(body)
                client = _client_key(body)
                kw = await anyio.to_thread.run_sync(prepare, kw)
            except (_ApiError, *_PASS_THROUGH):
                raise
            except BaseException as e:  # a bad value, or a native library's panic: an answer
                raise _failure(e, prompt_param) from None
            kw["model"] = st.model_id
            stream = kw.pop("stream")
            job = await st.acquire(deadline)
        except _ApiError as e:
            st.count(endpoint, e.status)
            raise
        finally:
            st.pending -= 1
            if size >= BIG_BODY:
                _release_memory()

        try:
            if stream:
                resp = await _start_stream(st, job, request, lambda: call(client, stream=True, **kw), prompt_param)
            else:
                resp = await _run_whole(st, job, request, lambda: call(client, **kw), prompt_param)
        except _ApiError as e:
            st.count(endpoint, e.status)
            raise
        st.count(endpoint, 200)
        return resp

    def prepare_completion(kw: dict) -> dict:
        if isinstance(kw["prompt"], str):  # tokenized here, outside the slot
            kw["prompt"] = st.clover.engine.check_prompt_fits(st.clover.engine.prompt_ids(kw["prompt"]))
        return kw

    def prepare_chat(kw: dict) -> dict:
        constrained = constrains(kw.get("response_format"), kw.get("grammar"), kw.get("tool_choice"))
        kw["messages"] = st.clover.prepare_chat(
            kw.pop("messages"), tools=kw.pop("tools", None), enable_thinking=kw.pop("enable_thinking", None),
            chat_template_kwargs=template_defaults(kw.pop("chat_template_kwargs", None), constrained),
            constrained=constrained)
        return kw

    def prepare_embedding(kw: dict) -> dict:
        """Check the fields that need the model and tokenize the inputs (outside the slot)."""
        clover = st.clover
        if kw["dimensions"] is not None and kw["dimensions"] != clover.n_embd():
            raise _ApiError(400, f"dimensions: {kw['dimensions']} not supported: this model's embeddings have "
                            f"{clover.n_embd()} (n_embd)", param="dimensions", code="invalid_value")
        if clover.pooling_type() == 0:
            raise _ApiError(400, "input: the server's pooling is none (one vector per token), which OpenAI's "
                            "embeddings response cannot carry; serve with pooling mean or last", param="input",
                            code="invalid_value")
        given = kw["input"]
        texts = [given] if isinstance(given, str) else given if isinstance(given, list) else []
        for i, t in enumerate(texts):
            if isinstance(t, str):  # refused before tokenizing, as a prompt
                clover.engine.check_text_fits("input" if isinstance(given, str) else f"input[{i}]", t)
        inputs, single = embedding_inputs(clover.engine, given)
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise _ApiError(400, f"input: {len(inputs)} inputs, at most {MAX_EMBEDDING_INPUTS} per request",
                            param="input", code="invalid_value")
        for i, ids in enumerate(inputs):
            if len(ids) > clover.n_ctx():
                raise ContextLengthExceeded(f"input{'' if single else f'[{i}]'}: {len(ids)} tokens do not fit "
                                            f"n_ctx={clover.n_ctx()}")
        kw["input"] = inputs
        return kw

    def embed(client, input, encoding_format, dimensions, model):
        out = st.clover.create_embedding(input, model, normalize=True, truncate=False)
        if encoding_format == "base64":
            for d in out["data"]:
                d["embedding"] = _base64_floats(d["embedding"])
        return out

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await generate(request, "/v1/embeddings", _embedding_kwargs, prepare_embedding, embed, "input")

    def template_defaults(asked, constrained: bool):
        """The request's chat_template_kwargs over the server's defaults (a non-dict goes to
        Clover as it is, which names it)."""
        base = {k: v for k, v in default_tkw.items() if not (constrained and k == "enable_thinking")}
        if not base or (asked is not None and not isinstance(asked, dict)):
            return asked
        return {**base, **(asked or {})}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", _completion_kwargs, prepare_completion,
                              lambda client, **kw: st.clover.create_completion(
                                  kw.pop("prompt"), prompt_cache_key=client, **kw), "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", _chat_kwargs, prepare_chat,
                              lambda client, **kw: st.clover.create_chat_completion(
                                  kw.pop("messages"), prompt_cache_key=client, **kw), "messages")

    return app


# clover_batch_get_stats' fields as /metrics names: (field, name, kind, help)
_BATCH_METRICS = (
    ("n_passes", "clover_batch_passes_total", "counter", "Forward passes of the continuous batch."),
    ("n_shared", "clover_batch_shared_passes_total", "counter", "Passes that ran two or more sequences."),
    ("n_entries", "clover_batch_sequence_forwards_total", "counter", "Sequence forwards over all passes."),
    ("n_rows", "clover_batch_rows_total", "counter", "Rows over all passes."),
    ("max_entries", "clover_batch_max_sequences", "gauge", "The most sequences in one pass."),
)


def _slot_metrics(st: _State) -> list[str]:
    """/metrics lines per slot (busy, tokens generated) and of the slots' batch."""
    busy = st.clover.engine.slot_busy()
    lines = ["# HELP clover_slot_busy 1 while a generation holds the slot.", "# TYPE clover_slot_busy gauge"]
    lines += [f'clover_slot_busy{{slot="{i}"}} {int(b)}' for i, b in enumerate(busy)]
    lines += ["# HELP clover_slot_tokens_generated_total Completion tokens generated per slot.",
              "# TYPE clover_slot_tokens_generated_total counter"]
    lines += [f'clover_slot_tokens_generated_total{{slot="{i}"}} {st.slot_tokens.get(i, 0)}' for i in range(len(busy))]
    batch = st.clover.engine.batch_stats()
    for field, name, kind, help_ in _BATCH_METRICS if batch is not None else ():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {batch[field]}"]
    return lines


async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _read_in_time(st: _State, reading, deadline: float):
    """Await ``reading`` (the request body) until ``deadline``: a client that sends its body too
    slowly gets 408 rather than keeping a queue place."""
    try:
        return await asyncio.wait_for(reading, _seconds_left(deadline))
    except asyncio.TimeoutError:
        raise _ApiError(408, f"request body: not received within the server's time limit of {st.timeout:g} s "
                        "(timeout)", param=None, code="timeout") from None


def _timed_out(st: _State) -> _ApiError:
    return _ApiError(504, f"request exceeded the server's time limit of {st.timeout:g} s (timeout); "
                     "its generation was cancelled", "timeout_error", code="timeout")


async def _run_whole(st: _State, job: _Job, request: Request, call, prompt_param: str) -> JSONResponse:
    """A non-streamed answer: ``call()`` in a worker thread holding the slot; cancelled if the
    client disconnects meanwhile or the request's deadline passes (504)."""
    loop = asyncio.get_running_loop()
    result: dict = {}

    def work():
        job.thread = threading.get_ident()
        try:
            result["value"] = call()
        except BaseException as e:
            result["error"] = e
        finally:
            with job.lock:
                job.thread = None
            loop.call_soon_threadsafe(st.release, job)

    worker = asyncio.ensure_future(anyio.to_thread.run_sync(work))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({worker, watch}, timeout=job.remaining(), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not worker.done():  # the client left, the deadline passed (or this handler was cancelled)
            st.cancel_until_done(job)
        watch.cancel()
    timed_out = not done
    await asyncio.shield(worker)
    if timed_out:
        raise _timed_out(st)
    if "error" in result:
        raise _failure(result["error"], prompt_param)
    st.add_usage(result["value"])
    return JSONResponse(result["value"])


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _start_stream(st: _State, job: _Job, request: Request, call, prompt_param: str) -> StreamingResponse:
    """A streamed answer: ``call()`` (argument checking: a bad value is still a 400) then a
    worker thread advancing the iterator and handing the chunks to the SSE response through a
    queue. When the response ends early (the client disconnected: starlette cancels it; or the
    deadline passed: an error event), the generation is cancelled and the worker closes the
    iterator, which frees the slot."""
    loop = asyncio.get_running_loop()
    try:
        it = await anyio.to_thread.run_sync(call)
    except _PASS_THROUGH:
        st.release(job)
        raise
    except BaseException as e:
        st.release(job)
        raise _failure(e, prompt_param) from None
    job.stream = it
    q: asyncio.Queue = asyncio.Queue()

    def work():
        try:
            for chunk in it:
                if "usage" in chunk:
                    st_usage.append(chunk)
                if not job.stop.is_set():
                    loop.call_soon_threadsafe(q.put_nowait, ("chunk", chunk))
        except BaseException as e:
            loop.call_soon_threadsafe(q.put_nowait, ("error", e))
        finally:
            it.close()  # frees the decoder and Clover's lock
            loop.call_soon_threadsafe(finish)

    st_usage: list = []

    def finish():
        for u in st_usage:
            st.add_usage(u)
        st.release(job)
        q.put_nowait(("end", None))

    threading.Thread(target=work, name="clover-stream", daemon=True).start()

    async def body():
        try:
            while True:
                try:
                    kind, item = await asyncio.wait_for(q.get(), job.remaining())
                except asyncio.TimeoutError:
                    st.cancel_until_done(job)
                    yield _sse(_timed_out(st).body())
                    yield b"data: [DONE]\n\n"
                    return
                if kind == "chunk":
                    yield _sse(item)
                elif kind == "error":
                    yield _sse(_failure(item, prompt_param).body())
                else:
                    yield b"data: [DONE]\n\n"
                    return
        finally:
            if not job.done:  # ended early: the client disconnected
                st.cancel_until_done(job)

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 8080, api_key: str | None = None,
          log_level: str = "info", **clover_kwargs: Any) -> int:
    """Run the server until interrupted; returns the exit code (1 if the model failed to load)."""
    import uvicorn

    _limit_malloc_arenas()
    app = create_app(model_path, api_key=api_key, **clover_kwargs)
    st: _State = app.state.clover
    # Ctrl+C: open streams get 5 s, then the lifespan's close() cancels the running generation
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)

    def stop_on_load_error():
        st.loaded.wait()
        if st.load_error is not None:
            server.should_exit = True

    threading.Thread(target=stop_on_load_error, daemon=True).start()
    server.run()
    return 1 if st.load_error is not None else 0
