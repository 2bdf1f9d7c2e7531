"""OpenAI-compatible HTTP server over :class:`~clover_gguf.llama.Clover`.

``clover-gguf serve -m MODEL`` runs :func:`create_app` under uvicorn. Endpoints, as
llama.cpp's ``llama-server`` and OpenAI name them:

- ``GET /v1/models``; ``POST /v1/completions``; ``POST /v1/chat/completions``: the request
  fields are OpenAI's (plus llama.cpp's ``top_k, min_p, repeat_penalty`` and this runtime's
  ``mode, block_size, threshold, coreset_top_p, enable_thinking, chat_template_kwargs``) and
  go one to one to :meth:`Clover.create_completion` / :meth:`Clover.create_chat_completion`;
  ``stream: true`` answers Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``), each
  chunk carrying the text that became final (committed) since the previous one.
- ``GET /health``: 503 ``{"status": "loading model"}`` while the model loads, 200
  ``{"status": "ok"}`` after (llama.cpp's shape).
- ``GET /metrics``: Prometheus text format (requests, tokens, active and queued requests).

Errors are OpenAI-shaped: ``{"error": {"message", "type", "param", "code"}}``; a malformed
body or a bad field value is 400 with the field in ``param``, a missing or wrong API key 401
(``Authorization: Bearer KEY``; ``/health`` and ``/metrics`` stay open, as in llama.cpp).

One slot: the single :class:`Clover` object runs one generation at a time; further requests
wait in a FIFO queue (``clover_requests_queued``). A client that disconnects (mid-stream or
while a non-streamed answer is computed) gets its generation cancelled with
:meth:`Clover.cancel`, which stops the forward pass in progress before its next layer, so the
slot is free for the next request within one forward. Not done: reuse of a slot's KV/GDN state
for a request that extends the previous conversation (every request prefills its whole prompt).

fastapi and uvicorn (the ``server`` extra) are imported only here, i.e. only by ``serve``.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .options import REQUEST_FIELDS

__all__ = ["create_app", "serve"]

# Request fields passed through unchanged, per endpoint (OpenAI's, llama.cpp's, ours): the
# generation options, and logprobs, which Clover refuses by name.
_COMMON = REQUEST_FIELDS + ("logprobs",)
_COMPLETION = _COMMON + ("echo", "suffix")
_CHAT = _COMMON + ("tools", "enable_thinking", "chat_template_kwargs")


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


def _value_error(e: Exception) -> _ApiError:
    """400 for a ValueError / TypeError of Clover, whose messages start with the field name
    (``temperature: expected ...``, ``prompt[3]: token id ...``)."""
    msg = str(e)
    head = msg.split(":", 1)[0] if ":" in msg else ""
    param = head.split("[", 1)[0].strip() if head and " " not in head.strip() else None
    return _ApiError(400, msg, param=param or None, code="invalid_value")


class _Job:
    """One generation holding the slot: ``done`` is set (on the event loop) when its worker
    thread has finished and the slot is released."""

    __slots__ = ("done", "stop")

    def __init__(self) -> None:
        self.done = False
        self.stop = threading.Event()


class _State:
    """What the app shares across requests: the model (None while loading), the slot, the
    counters of /metrics."""

    def __init__(self, model_path: str, model_id: str, api_key: str | None, clover_kwargs: dict) -> None:
        self.model_path, self.model_id, self.api_key = model_path, model_id, api_key
        self.clover_kwargs = clover_kwargs
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
        self.cancelled = 0
        self.tasks: set = set()  # background tasks (kept referenced until done)

    def count(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] = self.requests.get((endpoint, status), 0) + 1

    def add_usage(self, usage: dict | None) -> None:
        if usage:
            self.prompt_tokens += int(usage.get("prompt_tokens", 0))
            self.tokens_generated += int(usage.get("completion_tokens", 0))

    def load(self) -> None:
        from .llama import Clover
        from .preload import preload

        try:
            preload(self.model_path)  # progress bar on a terminal while /health answers 503
            self.clover = Clover(self.model_path, **self.clover_kwargs)
        except BaseException as e:  # reported by /health and by serve()
            self.load_error = e
            print(f"error: loading {self.model_path}: {e}", file=sys.stderr, flush=True)
        finally:
            self.loaded.set()

    # -------------------------------------------------------------- the slot
    async def acquire(self) -> _Job:
        if self.sem is None:
            self.sem = asyncio.Semaphore(1)
        self.queued += 1
        try:
            await self.sem.acquire()
        finally:
            self.queued -= 1
        self.active += 1
        return _Job()

    def release(self, job: _Job) -> None:
        """On the event loop: the job's worker thread is over, the next request may start."""
        if not job.done:
            job.done = True
            self.active -= 1
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
                self.clover.cancel()
                await asyncio.sleep(0.05)

        t = asyncio.ensure_future(loop())
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)


# ------------------------------------------------------------------------ request parsing
async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _ApiError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise _ApiError(400, f"request body: expected a JSON object, got {type(body).__name__}",
                        code="invalid_json")
    return body


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
    return kw


def _chat_kwargs(body: dict) -> dict:
    kw = _kwargs(body, _CHAT)
    if "max_tokens" not in kw and body.get("max_completion_tokens") is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
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


# ------------------------------------------------------------------------ the app
def create_app(model_path: str, *, api_key: str | None = None, model_id: str | None = None,
               **clover_kwargs: Any) -> FastAPI:
    """The FastAPI app serving ``model_path``; ``clover_kwargs`` go to :class:`Clover`
    (``n_ctx, n_threads, mode, ...``). The model loads in a background thread when the app
    starts (``/health`` answers 503 until it is loaded)."""
    st = _State(str(model_path), model_id or os.path.basename(str(model_path)), api_key, clover_kwargs)

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
        return e.response()

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
                 "Generations cancelled because the client disconnected.", st.cancelled),
                ("clover_requests_active", "gauge", "Requests holding a slot (generating).", st.active),
                ("clover_requests_queued", "gauge", "Requests waiting for a slot.", st.queued),
                ("clover_slots_total", "gauge", "Generation slots.", 1),
                ("clover_model_loaded", "gauge", "1 once the model is loaded.", int(st.clover is not None))):
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {v}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: Request):
        check_key(request)
        st.count("/v1/models", 200)
        return {"object": "list", "data": [{"id": st.model_id, "object": "model", "created": st.created,
                                            "owned_by": "clover-gguf"}]}

    async def generate(request: Request, endpoint: str, parse, call):
        try:
            check_key(request)
            check_loaded()
            kw = parse(await _json_body(request))
        except _ApiError as e:
            st.count(endpoint, e.status)
            raise
        kw["model"] = st.model_id
        stream = kw.pop("stream")
        job = await st.acquire()
        try:
            if stream:
                resp = await _start_stream(st, job, request, lambda: call(stream=True, **kw))
            else:
                resp = await _run_whole(st, job, request, lambda: call(**kw))
        except _ApiError as e:
            st.count(endpoint, e.status)
            raise
        st.count(endpoint, 200)
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "/v1/completions", _completion_kwargs,
                              lambda **kw: st.clover.create_completion(kw.pop("prompt"), **kw))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "/v1/chat/completions", _chat_kwargs,
                              lambda **kw: st.clover.create_chat_completion(kw.pop("messages"), **kw))

    return app



async def _wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


async def _run_whole(st: _State, job: _Job, request: Request, call) -> JSONResponse:
    """A non-streamed answer: ``call()`` in a worker thread holding the slot; cancelled if the
    client disconnects meanwhile."""
    loop = asyncio.get_running_loop()
    result: dict = {}

    def work():
        try:
            result["value"] = call()
        except BaseException as e:
            result["error"] = e
        finally:
            loop.call_soon_threadsafe(st.release, job)

    worker = asyncio.ensure_future(anyio.to_thread.run_sync(work))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({worker, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not worker.done():  # the client left (or this handler was cancelled)
            st.cancel_until_done(job)
        watch.cancel()
    await asyncio.shield(worker)
    if "error" in result:
        e = result["error"]
        if isinstance(e, (ValueError, TypeError)):
            raise _value_error(e)
        raise e
    st.add_usage(result["value"].get("usage"))
    return JSONResponse(result["value"])


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


async def _start_stream(st: _State, job: _Job, request: Request, call) -> StreamingResponse:
    """A streamed answer: ``call()`` (argument checking: a bad value is still a 400) then a
    worker thread advancing the iterator and handing the chunks to the SSE response through a
    queue. When the response ends early (the client disconnected: starlette cancels it), the
    generation is cancelled and the worker closes the iterator, which frees the slot."""
    loop = asyncio.get_running_loop()
    try:
        it = await anyio.to_thread.run_sync(call)
    except (ValueError, TypeError) as e:
        st.release(job)
        raise _value_error(e) from None
    except BaseException:
        st.release(job)
        raise
    q: asyncio.Queue = asyncio.Queue()

    def work():
        try:
            for chunk in it:
                if "usage" in chunk:
                    st_usage.append(chunk["usage"])
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
                kind, item = await q.get()
                if kind == "chunk":
                    yield _sse(item)
                elif kind == "error":
                    err = _value_error(item) if isinstance(item, (ValueError, TypeError)) else \
                        _ApiError(500, f"{type(item).__name__}: {item}", "server_error")
                    yield _sse(err.body())
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
