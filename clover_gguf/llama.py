"""llama-cpp-python-style API: :class:`Clover`.

``Clover`` is to :class:`~clover_gguf.model.Model` what llama-cpp-python's ``Llama`` is to
llama.cpp: keyword arguments named as there (``model_path, n_ctx, n_threads, n_gpu_layers,
seed, verbose``) plus the diffusion settings (``mode, block_size, threshold, coreset_top_p``),
``create_completion`` / ``__call__`` and ``create_chat_completion`` returning OpenAI-shaped
dicts (or, with ``stream=True``, iterators of OpenAI-shaped chunks), ``tokenize`` /
``detokenize``, ``close`` and the context manager. Additions for this runtime:

- ``timings`` in every response (and in the last chunk of a stream): the diffusion statistics
  of :attr:`Model.last_stats <clover_gguf.model.Model.last_stats>` (forward passes by kind,
  tokens per forward, seconds, tokens/s) plus llama.cpp server's ``prompt_n``,
  ``prompt_ms``, ``predicted_n``, ... names;
- chat answers split ``<think>...</think>`` into ``message.reasoning_content`` (streaming:
  ``delta.reasoning_content``) and ``content``;
- :meth:`Clover.cancel` stops the running call from another thread within one layer of the
  forward pass in progress (``clover_context_abort``); that call then ends with
  ``finish_reason`` ``"cancelled"`` and the text final so far;
- one lock per object serialises calls from several threads (a call waits for the one
  running); a streaming iterator holds it from its first ``next()`` until it ends.

Defaults differ from llama-cpp-python's on purpose: sampling parameters left at None take the
engine's defaults (greedy decoding, the GGUF's presence / repetition penalties; clover-spec
4.2, 5.3-5.4), not llama-cpp-python's ``temperature=0.8, top_k=40, ...``.
"""
from __future__ import annotations

import fnmatch
import json
import math
import os
import pathlib
import secrets
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np

from . import compat
from ._ffi import CloverError
from .chat import check_template_kwargs
from .model import POOLING_TYPES, ContextLengthExceeded, Model, pooling_type
from .state import LlamaState, unpack_state
from .paths import DEFAULT_MODEL
from .grammar import JSON_LAYOUT
from .tool_calls import ToolCallParser, forced_tools, tool_call_grammar
from .options import REQUEST_FIELDS
from .stops import partial_suffix

__all__ = ["Clover", "ChatPrompt", "LlamaState", "ReasoningSplitter", "Stream"]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


class ReasoningSplitter:
    """Split generated chat text into reasoning (inside ``<think>...</think>``) and content,
    incrementally, so that streamed and whole-text results are identical.

    ``push(text)`` and ``flush()`` return ``[(kind, text), ...]`` with kind ``"reasoning"`` or
    ``"content"``. ``think_open=True`` means the prompt's generation header already opened
    ``<think>`` (Qwen3.5's template does unless ``enable_thinking=False``), so the answer starts
    inside the thinking section. Every ``<think>...</think>`` block is reasoning (an unclosed
    one runs to the end); the tags themselves are dropped. Whitespace at the edges of a
    reasoning block and at the start of the content (and after each ``</think>``) is dropped,
    as llama.cpp's server trims them. Text that may be the start of a tag is held back until
    it cannot be one any more.
    """

    def __init__(self, think_open: bool = False) -> None:
        self.in_think = bool(think_open)
        self._buf = ""
        self._lead = True   # strip leading whitespace of the current section
        self._ws = ""       # reasoning: trailing whitespace held back (dropped before </think>)

    def _emit(self, text: str, out: list) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        if self.in_think:
            text = self._ws + text
            core = text.rstrip()
            self._ws = text[len(core):]
            if core:
                out.append(("reasoning", core))
        else:
            out.append(("content", text))

    def push(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        self._buf += text
        while True:
            tag = _THINK_CLOSE if self.in_think else _THINK_OPEN
            i = self._buf.find(tag)
            if i >= 0:
                self._emit(self._buf[:i], out)
                self._buf = self._buf[i + len(tag):]
                self.in_think = not self.in_think
                self._ws, self._lead = "", True
                continue
            cut = len(self._buf) - partial_suffix(self._buf, tag)
            if cut:
                self._emit(self._buf[:cut], out)
                self._buf = self._buf[cut:]
            return out

    def flush(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self._buf:
            self._emit(self._buf, out)
            self._buf = ""
        self._ws = ""  # trailing whitespace of an unclosed reasoning block
        return out


@dataclass(frozen=True)
class ChatPrompt:
    """A chat rendered and tokenized ahead of its call (:meth:`Clover.prepare_chat`): the prompt's
    token ids, whether its generation header left a ``<think>`` section open, and the tools it
    declares (the answer's tool calls are parsed against them)."""

    ids: list[int]
    think_open: bool
    tools: list | None = None


def _template_messages(messages):
    """``messages`` with each assistant tool call's ``function.arguments`` given as a JSON string
    (OpenAI's form, which clients send back) turned into the object chat templates iterate over
    (Qwen3.5's template reads ``arguments|items``); anything else as given."""
    if not isinstance(messages, (list, tuple)):
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if isinstance(calls, list) and any(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                           and isinstance(c["function"].get("arguments"), str) for c in calls):
            m = {**m, "tool_calls": [_parsed_arguments(c) for c in calls]}
        out.append(m)
    return out


def _parsed_arguments(call):
    f = call.get("function") if isinstance(call, dict) else None
    if not isinstance(f, dict) or not isinstance(f.get("arguments"), str):
        return call
    try:
        args = json.loads(f["arguments"])
    except ValueError:
        return call  # not JSON: the template gets the string
    return {**call, "function": {**f, "arguments": args}} if isinstance(args, dict) else call


def _constraint(response_format, grammar) -> dict:
    """The Model options (``json_schema`` / ``grammar``, :mod:`clover_gguf.grammar`) of OpenAI's
    ``response_format`` (``{"type": "text"}``, ``{"type": "json_object"}`` with llama-cpp-python's
    optional ``schema``, ``{"type": "json_schema", "json_schema": {"schema": ...}}``) and llama.cpp's
    ``grammar``; ValueError naming the field."""
    if grammar is not None and response_format not in (None, {"type": "text"}):
        raise ValueError("grammar: give grammar or response_format, not both")
    if grammar is not None:
        return {"grammar": grammar}
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return {}
    if kind == "json_object":
        schema = response_format.get("schema")
        return {"json_schema": {"type": "object"} if schema is None else schema}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format.json_schema: expected {\"name\": ..., \"schema\": {...}}")
        return {"json_schema": spec["schema"]}
    raise ValueError(f"response_format: expected type \"text\", \"json_object\" or \"json_schema\", got "
                     f"{response_format!r}")


def _legacy_functions(functions, function_call, tools, tool_choice) -> tuple:
    """OpenAI's ``functions`` / ``function_call`` as ``tools`` / ``tool_choice``."""
    if tools is not None or tool_choice is not None:
        raise ValueError("functions: give tools/tool_choice or functions/function_call, not both")
    if functions is not None and (not isinstance(functions, (list, tuple))
                                  or not all(isinstance(f, dict) for f in functions)):
        raise ValueError("functions: expected a list of function objects")
    tools = None if functions is None else [{"type": "function", "function": f} for f in functions]
    if function_call is None or function_call in ("none", "auto"):
        return tools, function_call
    if isinstance(function_call, dict) and isinstance(function_call.get("name"), str):
        return tools, {"type": "function", "function": {"name": function_call["name"]}}
    raise ValueError(f'function_call: expected "none", "auto" or {{"name": ...}}, got {function_call!r}')


def constrains(response_format=None, grammar=None, tool_choice=None) -> bool:
    """Whether a chat call with these arguments constrains its answer (so its prompt is rendered
    with thinking off: :meth:`Clover.prepare_chat`'s ``constrained``)."""
    return grammar is not None or response_format not in (None, {"type": "text"}) \
        or tool_choice not in (None, "auto", "none")


def _field_error(e: ValueError, names: dict) -> ValueError:
    """``e`` with its leading field name renamed by ``names`` (the Model option -> the caller's)."""
    msg = str(e)
    for inner, outer in names.items():
        if msg.startswith(inner + ":"):
            return type(e)(outer + msg[len(inner):])
    return e


def _check_logprobs(name: str, n) -> int | None:
    """The number of alternatives ``n`` asks for (None: off); ValueError naming ``name``."""
    if n is None or n is False:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 20:
        raise ValueError(f"{name}: expected an integer in [0, 20], got {n!r}")
    return n


def _token_text(tk, i: int) -> tuple[str, list[int]]:
    b = tk.token_bytes(i)
    return b.decode("utf-8", "replace"), list(b)


def _completion_logprobs(tk, entries, offset: int) -> dict:
    """OpenAI's completion ``logprobs`` of ``entries`` ((id, logprob, [(id, logprob)])), the first
    token's text starting at ``offset`` in the answer."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, lp, top in entries:
        text = _token_text(tk, t)[0]
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append({_token_text(tk, i)[0]: v for i, v in top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _chat_logprobs(tk, entries) -> dict:
    """OpenAI's chat ``logprobs`` of ``entries`` ((id, logprob, [(id, logprob)]))."""
    def item(t, lp):
        text, b = _token_text(tk, t)
        return {"token": text, "logprob": lp, "bytes": b}
    return {"content": [{**item(t, lp), "top_logprobs": [item(i, v) for i, v in top]} for t, lp, top in entries],
            "refusal": None}


class _Holder:
    """A call: the thread that last ran it, whether it is running now, for a streaming iterator
    a weak reference to it (so close() can end it), whether cancel() was called for it
    (``cancellable``: a generation, not argument checking), its Model generation (``pieces``,
    to cancel it alone) and that generation's stats once it ended."""

    __slots__ = ("thread", "executing", "gen", "cancellable", "cancelled", "pieces", "stats")

    def __init__(self, stream: bool = False, cancellable: bool = True) -> None:
        self.thread = threading.get_ident()
        self.executing = True
        self.gen = None if not stream else (lambda: None)
        self.cancellable = cancellable
        self.cancelled = False
        self.pieces = None
        self.stats: dict | None = None


class Stream:
    """The iterator of a ``stream=True`` call: its chunks, :meth:`close`, and :meth:`cancel` for
    this call alone."""

    def __init__(self, clover: "Clover", holder: _Holder, it: Iterator[dict]) -> None:
        self._clover, self._holder, self._it = clover, holder, it

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> dict:
        return next(self._it)

    def close(self) -> None:
        self._it.close()

    def cancel(self) -> bool:
        """Stop this call (as :meth:`Clover.cancel` stops all): it ends with ``finish_reason``
        ``"cancelled"``. False when it is not running (not started, or ended)."""
        return self._clover._cancel_holders([self._holder])


def _chat_fits(fn):
    """``fn()``, its ContextLengthExceeded (about the prompt) restated about the messages."""
    try:
        return fn()
    except ContextLengthExceeded as e:
        raise ContextLengthExceeded(f"messages (rendered by the chat template): {str(e).split(': ', 1)[-1]}") \
            from None


def _pooling_arg(v) -> int:
    """Clover's ``pooling_type`` argument as llama.cpp's value; CLS and RANK refused."""
    pool = pooling_type("pooling_type", v)
    if pool in (POOLING_TYPES["cls"], POOLING_TYPES["rank"]):
        raise ValueError(f"pooling_type: {v!r} is not supported by a causal decoder (no CLS token or ranking "
                         "head); use 0 (none), 1 (mean), 3 (last) or -1 (the model's)")
    return pool


def _single_input(input) -> bool:
    """Whether ``input`` of :meth:`Clover.embed` is one input: a str or a non-empty list of ints."""
    return isinstance(input, str) or (isinstance(input, (list, tuple)) and bool(input) and
                                      all(isinstance(t, int) and not isinstance(t, bool) for t in input))


def embedding_inputs(model: Model, input) -> tuple[list[list[int]], bool]:
    """The token ids of each input of :meth:`Clover.embed` and whether ``input`` is a single one:
    a str (tokenized, control tokens recognised) or a list of ints is one input; a list of str
    or of lists of ints is several. ValueError naming ``input`` (``input[i]``) otherwise."""
    if _single_input(input):
        return [_input_ids(model, "input", input)], True
    if not isinstance(input, (list, tuple)) or not input:
        raise ValueError("input: expected a non-empty string, list of strings, list of token ids or list of "
                         f"lists of token ids, got {type(input).__name__ if input else repr(input)}")
    return [_input_ids(model, f"input[{i}]", x) for i, x in enumerate(input)], False


def _input_ids(model: Model, name: str, x) -> list[int]:
    if not isinstance(x, (str, list, tuple)):
        raise ValueError(f"{name}: expected a string or a list of token ids, got {type(x).__name__}")
    return model.prompt_ids(x, name, bounded=False)  # embed truncates long inputs


def _normalized(v: list[float]) -> list[float]:
    """``v`` / its L2 norm (llama-cpp-python's normalize_embedding; a zero vector unchanged)."""
    norm = math.sqrt(math.fsum(x * x for x in v))
    return v if norm == 0.0 else [x / norm for x in v]


def _usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion}


RANDOM_SEEDS = (-1, 0xFFFFFFFF)  # llama.cpp's LLAMA_DEFAULT_SEED asks for a random seed


def _hub_cache(cache_dir) -> pathlib.Path:
    if cache_dir is not None:
        return pathlib.Path(cache_dir)
    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return pathlib.Path(home) / "hub"


def find_pretrained(repo_id: str, filename: str | None, local_dir=None, cache_dir=None) -> str:
    """The one GGUF matching the glob ``filename`` (against the path relative to the directory,
    or the file name) in the directory ``repo_id``, ``local_dir``, or the newest Hugging Face cache
    snapshot of ``repo_id`` (see :meth:`Clover.from_pretrained`)."""
    if not isinstance(repo_id, str) or not repo_id:
        raise ValueError(f"repo_id: expected a directory or a repository id, got {repo_id!r}")
    pattern = filename or "*.gguf"
    roots = [pathlib.Path(d) for d in (repo_id, local_dir) if d is not None and os.path.isdir(d)]
    if not roots and "/" in repo_id:
        snapshots = (_hub_cache(cache_dir) / ("models--" + repo_id.replace("/", "--")) / "snapshots").glob("*")
        roots = sorted(snapshots, key=lambda d: d.stat().st_mtime)[-1:]  # the newest snapshot
    if not roots:
        raise ValueError(f"repo_id: {repo_id!r} is neither a directory nor a repository in the Hugging Face cache "
                         f"({_hub_cache(cache_dir)}); clover-gguf does not download models")
    found = sorted({str(p) for root in roots for p in root.rglob("*.gguf")
                    if not p.name.endswith(".diffusion.gguf")
                    and (fnmatch.fnmatch(p.name, pattern) or fnmatch.fnmatch(str(p.relative_to(root)), pattern))})
    if len(found) != 1:
        what = "no GGUF" if not found else f"{len(found)} GGUFs ({', '.join(found)})"
        raise ValueError(f"filename: {what} match {pattern!r} in {', '.join(str(r) for r in roots)}")
    return found[0]


def _check_seed(seed, name: str = "seed") -> int:
    """``seed``, or a ValueError naming ``name`` unless it is -1 or an integer in [0, 2**64)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not -1 <= seed < 2**64:
        raise ValueError(f"{name}: expected -1 or an integer in [0, 2**64), got {seed!r}")
    return seed


def _kv_str(v) -> str:
    """A GGUF scalar as llama.cpp's gguf_kv_to_str writes it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    return f"{v:f}" if isinstance(v, float) else str(v)


class CloverTokenizerView:
    """llama-cpp-python's ``LlamaTokenizer`` over a :class:`Clover`: ``tokenize(bytes)``,
    ``detokenize(ids) -> bytes``, ``encode(str)``, ``decode(ids) -> str``."""

    def __init__(self, llama: "Clover") -> None:
        self._llama = llama

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = True) -> list[int]:
        return self._llama.tokenize(text, add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        return self._llama.detokenize(tokens, prev_tokens=prev_tokens, special=special)

    def encode(self, text: str, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.tokenize(text.encode("utf-8", errors="ignore"), add_bos=add_bos, special=special)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.detokenize(tokens).decode("utf-8", errors="ignore")


class Clover:
    """A Clover (or Qwen3.5/3.6-MoE parent) GGUF with a llama-cpp-python-style API.

    Args:
        model_path: the GGUF file; None = the small Clover inside the package
            (:data:`clover_gguf.DEFAULT_MODEL`).
        n_ctx: context length in tokens (prompt + generated + one diffusion block); 0 = the
            model's training context (``n_ctx_train``), as llama-cpp-python.
        n_threads: CPU threads; None or 0 = the physical cores.
        n_batch, n_ubatch, n_threads_batch, use_mmap, use_mlock, flash_attn: llama-cpp-python's,
            with the meaning :class:`~clover_gguf.model.Model` gives them; n_batch and n_ubatch
            None (not llama-cpp-python's 512) keep the engine's prefill passes (2048 rows on
            the CPU).
        **llama_cpp_args: llama-cpp-python's other constructor arguments (``chat_format``,
            ``logits_all``, ``lora_path``, the RoPE overrides, ...) are accepted; a value other
            than llama-cpp-python's default has no effect here and raises one ``UserWarning``
            saying why (:data:`clover_gguf.compat.INIT`, docs/python.md).
        n_gpu_layers: layers whose weight products run on the GPU (-1: all, and the output
            projection), as llama-cpp-python's; needs a CUDA build and a GPU, else a
            ``UserWarning`` naming the reason and the CPU (:class:`~clover_gguf.model.Model`).
        n_cpu_moe, gpu_budget: routed experts of the first layers kept on the CPU, and a GPU
            memory budget that chooses the placement (--fit); see :class:`~clover_gguf.model.Model`.
        type_k, type_v: KV cache element types, ``"f32"`` (default, exact) or ``"f16"`` (half
            the memory, llama.cpp's default; see :class:`~clover_gguf.model.Model`); ggml type ids
            0 and 1 as llama-cpp-python's also work.
        seed: default sampling seed of calls without ``seed`` (it only matters at
            ``temperature > 0``); -1 or 0xFFFFFFFF (llama.cpp's ``LLAMA_DEFAULT_SEED``) draws a
            fresh random seed for every call.
        verbose: print a load line and, after every call, a timings line to stderr.
        mode: ``"diffusion"`` (the default for Clover files with the block tensors), ``"ar"``
            (the default, and the only mode, for qwen35moe files and clover_moe trunks without
            their sidecar) or ``"spec"``.
        block_size, threshold, coreset_top_p: diffusion settings; None = the GGUF's
            (clover-spec 4.2). Calls may override all four.
        prefix_reuse: when a prompt starts with the last call's prompt (the next chat turn),
            skip prefilling it up to a 64-token boundary (``timings["n_prompt_reused"]``; see
            :class:`~clover_gguf.model.Model`). True by default; the output stays bit-identical to
            a full prefill's on the CPU.
        plan_callback: called with the GPU placement's plan line before the weights go to the
            GPU (see :class:`~clover_gguf.model.Model`).
        diffusion_path: the diffusion sidecar of a clover_moe trunk (None: ``<stem>.diffusion.gguf``
            beside the model when it exists; see :class:`~clover_gguf.model.Model`).
        embedding: allow :meth:`embed` and :meth:`create_embedding` (llama-cpp-python's flag;
            generation works either way here).
        pooling_type: the embeddings' pooling, llama.cpp's ``LLAMA_POOLING_TYPE_*`` value or name:
            0 / ``"none"``, 1 / ``"mean"``, 3 / ``"last"``; -1 (default, unspecified) = the GGUF's
            ``{arch}.pooling_type``, else last (see :meth:`Model.embed
            <clover_gguf.model.Model.embed>`). CLS (2) and RANK (4) raise ValueError.
        n_parallel: sequences at once (llama-server's -np; not a llama-cpp-python argument):
            with N > 1 the methods may be called from N threads at once, each call a sequence on
            its own context, their forwards batched together (:class:`~clover_gguf.model.Model`);
            each sequence's output is the one it has alone.

    Raises:
        CloverError: the native loader's message (bad file, missing tensor, ...).
        ValueError: a bad argument, naming it.

    Thread safety: with n_parallel=1 calls on one object are serialised by a lock (a call from
    another thread waits for the running one); :meth:`cancel` does not take it. A
    ``stream=True`` iterator holds the lock from its first ``next()`` until it is exhausted,
    closed or garbage collected; a call from the thread that last advanced such an unfinished
    iterator raises ``RuntimeError`` instead of waiting for it forever. With n_parallel > 1 up
    to N calls run at once (a stream holds its context from its first ``next()`` until it is
    exhausted or closed) and the next waits for one to end. ``stream=True`` iterators are
    :class:`Stream` objects: ``cancel()`` stops that call alone.
    """

    def __init__(self, model_path=None, *, n_ctx: int = 4096, n_threads: int | None = None,
                 n_gpu_layers: int = 0, n_cpu_moe: int = 0, gpu_budget: int | str | None = None,
                 type_k: str | int | None = "f32", type_v: str | int | None = "f32", seed: int = 0,
                 verbose: bool = False, mode: str | None = None, block_size: int | None = None,
                 threshold: float | None = None, coreset_top_p: float | None = None,
                 prefix_reuse: bool = True, plan_callback=None, diffusion_path=None, embedding: bool = False,
                 pooling_type: int | str = -1, n_batch: int | None = None, n_ubatch: int | None = None,
                 n_threads_batch: int | None = None, use_mmap: bool = True, use_mlock: bool = False,
                 flash_attn: bool | str | None = None, n_parallel: int = 1, **llama_cpp_args) -> None:
        self._closed = True  # until loaded (close() and __del__ of a failed init are no-ops)
        self._state = threading.Lock()  # guards _closed, _holder and _holders
        self._lock = threading.Lock()   # the call lock (n_parallel=1)
        self._holder: _Holder | None = None  # the call holding the lock (n_parallel=1)
        self._holders: set[_Holder] = set()  # the calls running (n_parallel > 1)
        unknown = sorted(set(llama_cpp_args) - set(compat.INIT))
        if unknown:
            raise TypeError(f"Clover() got an unexpected keyword argument {unknown[0]!r}")
        compat.warn_ignored(compat.INIT, llama_cpp_args)
        if isinstance(n_gpu_layers, bool) or not isinstance(n_gpu_layers, int):
            raise ValueError(f"n_gpu_layers: expected an integer, got {n_gpu_layers!r}")
        if model_path is None:
            model_path = DEFAULT_MODEL
        self.seed = _check_seed(seed)
        pool = _pooling_arg(pooling_type)
        self.model_path = str(model_path)
        self.n_gpu_layers = n_gpu_layers
        self.embedding = bool(embedding)
        self.verbose = bool(verbose)
        t0 = time.perf_counter()
        self._model = Model(model_path, n_ctx=n_ctx, n_threads=n_threads, prefix_reuse=prefix_reuse,
                            n_gpu_layers=n_gpu_layers, n_cpu_moe=n_cpu_moe, gpu_budget=gpu_budget,
                            type_k="f32" if type_k is None else type_k,
                            type_v="f32" if type_v is None else type_v, plan_callback=plan_callback,
                            diffusion_path=diffusion_path, n_batch=n_batch, n_ubatch=n_ubatch,
                            n_threads_batch=n_threads_batch, use_mmap=use_mmap, use_mlock=use_mlock,
                            flash_attn=flash_attn, n_parallel=n_parallel)
        self._parallel = self._model.n_parallel > 1
        try:
            self.mode = mode if mode is not None else self._model.default_mode
            self.block_size, self.threshold, self.coreset_top_p = block_size, threshold, coreset_top_p
            self._pooling = pool if pool >= 0 else int(self._model.hparams["pooling_type"])
            # validate the diffusion settings now (the same checks as every call's)
            self._model.check_generate_args(mode=self.mode, block_size=block_size, threshold=threshold,
                                            coreset_top_p=coreset_top_p)
        except BaseException:
            self._model.close()
            raise
        self._closed = False
        if self.verbose:
            hp = self._model.hparams
            print(f"clover: loaded {self.model_path} ({self._model.arch}, {hp['n_layer']} layers, "
                  f"n_vocab {hp['n_vocab']}, n_ctx {self._model.n_ctx}, mode {self.mode}) in "
                  f"{time.perf_counter() - t0:.2f} s", file=sys.stderr)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the model. A second call does nothing. The call running in another thread is
        cancelled and waited for; an unfinished streaming iterator is closed (it ends without
        more chunks). Every later call raises :class:`CloverError`."""
        with self._state:
            if self._closed:
                return
            self._closed = True
        self._cancel_current()
        while not self._lock.acquire(timeout=0.05):
            self._close_streams([self._holder])
            self._cancel_current()
        try:
            if self._parallel:
                with self._state:
                    held = list(self._holders)
                self._close_streams(held)
            self._model.close()
        finally:
            self._lock.release()

    @staticmethod
    def _close_streams(holders) -> None:
        """Close the unfinished streaming iterators of ``holders`` that no thread runs now."""
        for h in holders:
            g = h.gen() if h is not None and h.gen is not None and not h.executing else None
            if g is not None:
                try:
                    g.close()  # runs its finally: frees the decoder, releases the lock
                except ValueError:  # it is running in another thread right now: wait
                    pass

    def __enter__(self) -> "Clover":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @classmethod
    def from_pretrained(cls, repo_id: str, filename: str | None = "*.gguf", additional_files=None,
                        local_dir=None, local_dir_use_symlinks="auto", cache_dir=None, **kwargs) -> "Clover":
        """llama-cpp-python's ``from_pretrained`` without the download: the GGUF matching the glob
        ``filename`` in the directory ``repo_id``, in ``local_dir``, or in the Hugging Face cache's
        snapshot of the repository ``repo_id`` (``cache_dir``, else ``$HF_HUB_CACHE``, else
        ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``). Diffusion sidecars
        (``*.diffusion.gguf``) are found beside their trunk, never chosen. ``kwargs`` go to the
        constructor. Raises ValueError when no file or several files match, naming them."""
        path = find_pretrained(repo_id, filename, local_dir, cache_dir)
        return cls(model_path=path, **kwargs)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"n_ctx={self._model.n_ctx}, mode={self.mode!r}"
        return f"Clover({self.model_path!r}, {state})"

    def _check_open(self) -> None:
        if self._closed:
            raise CloverError(f"{self.model_path}: this Clover object is closed (close() was called); "
                              "create a new one")

    def _acquire(self, holder: _Holder) -> None:
        self._check_open()
        if self._parallel:  # the Model's slots take the calls
            with self._state:
                self._check_open()
                self._holders.add(holder)
            return
        if not self._lock.acquire(blocking=False):
            h = self._holder
            if (h is not None and h.gen is not None and not h.executing
                    and h.thread == threading.get_ident()):
                raise RuntimeError("Clover: an unfinished stream=True iterator of this object, last advanced "
                                   "by this thread, holds its lock: exhaust or close() it before another call")
            self._lock.acquire()
        if self._closed:
            self._lock.release()
            self._check_open()
        with self._state:
            self._holder = holder

    def _release(self, holder: _Holder) -> None:
        with self._state:
            if self._parallel:
                self._holders.discard(holder)
                return
            self._holder = None
        self._lock.release()

    def _cancel_current(self) -> bool:
        with self._state:
            held = list(self._holders) if self._parallel else [self._holder]
        return self._cancel_holders(held)

    def _cancel_holders(self, holders) -> bool:
        """Cancel the calls of ``holders`` that are running; whether there was one. Under _state a
        call's holder cannot change: its Model generation (``pieces``) is cancelled alone; without
        one (an embedding), with n_parallel=1 model.cancel() reaches this holder's call only."""
        with self._state:
            running = self._holders if self._parallel else {self._holder}
            hs = [h for h in holders if h is not None and h.cancellable and h in running]
            for h in hs:
                h.cancelled = True
                if h.pieces is not None:
                    h.pieces.cancel()
                elif not self._parallel:
                    self._model.cancel()
            return bool(hs)

    def cancel(self, thread: int | None = None) -> bool:
        """Stop the call in progress (prompt prefill or decoding) from any thread, without
        waiting for the call lock.

        The forward pass running now stops before its next layer (``clover_context_abort``);
        the call returns normally with ``finish_reason`` ``"cancelled"`` and the text that was
        final before it (a stream yields its last chunk with that reason; a call cancelled
        while it was still rendering or tokenizing its prompt does not start the prefill). The
        object stays usable: the next call starts from a clean context. Returns True if a call
        was running (a started streaming iterator counts, also between chunks), False
        otherwise (then nothing happens: it never cancels a later call, nor a call still
        waiting for the lock, nor a streaming iterator not yet started).

        With n_parallel > 1 every running call is cancelled (an embedding call between its
        inputs); ``thread`` (a ``threading.get_ident()``): only the calls running on that thread
        (a non-streamed call runs on its caller's thread; a stream's ``cancel()`` stops it
        alone)."""
        if self._closed:
            return False
        if thread is None:
            return self._cancel_current()
        with self._state:
            held = list(self._holders) if self._parallel else [self._holder]
        return self._cancel_holders([h for h in held if h is not None and h.thread == thread and h.executing])

    # ------------------------------------------------------------------ info
    @property
    def engine(self) -> Model:
        """The :class:`~clover_gguf.model.Model` this object drives (arch, placement, hparams)."""
        return self._model

    def n_ctx(self) -> int:
        return self._model.n_ctx

    def reset(self, slot=None) -> None:
        """Empty the context's caches (waits for the running call): the next call prefills its
        whole prompt; prefix reuse starts over from it. ``slot``: with n_parallel > 1 that slot's
        alone (:meth:`Model.reset <clover_gguf.model.Model.reset>`; None: every slot's)."""
        self._prepare(lambda: self._model.reset(slot))

    def save_state(self, slot=None) -> LlamaState:
        """The state of the context (waits for the running call), as llama-cpp-python's
        ``save_state``: a picklable :class:`~clover_gguf.state.LlamaState` whose ``llama_state``
        is :meth:`Model.save_state <clover_gguf.model.Model.save_state>`'s bytes. After
        :meth:`load_state` (on this object or another on the same file, with the same cache types
        and an n_ctx that holds the tokens) the next call runs as it would have run after the
        save: a prompt that extends the saved one reuses its prefix (``timings["n_prompt_reused"]``).
        ``slot``: required with n_parallel > 1 (0..n_parallel-1), as :meth:`Model.save_state
        <clover_gguf.model.Model.save_state>`'s."""
        def save():
            blob = self._model.save_state(slot)
            ids = unpack_state(blob, self._model.n_vocab)[0]
            return LlamaState(input_ids=np.array(ids, dtype=np.intc), scores=None, n_tokens=len(ids),
                              llama_state=blob, llama_state_size=len(blob), seed=self.seed)
        return self._prepare(save)

    def load_state(self, state: LlamaState, slot=None) -> None:
        """Restore a :meth:`save_state` result (waits for the running call), and its ``seed`` as
        this object's default seed. ValueError naming ``state`` for another type, fields that do
        not agree with ``llama_state``, or a state that does not fit this model (another model
        file, other cache types, more tokens than ``n_ctx``, truncated or corrupted bytes); the
        context is then unchanged. ``slot``: as :meth:`save_state`'s (the state of any slot loads
        into any slot)."""
        if not isinstance(state, LlamaState):
            raise ValueError(f"state: expected the LlamaState of Clover.save_state, got {type(state).__name__}")
        blob = state.llama_state
        if not isinstance(blob, (bytes, bytearray)):
            raise ValueError(f"state.llama_state: expected bytes, got {type(blob).__name__}")
        if state.llama_state_size != len(blob):
            raise ValueError(f"state.llama_state_size: {state.llama_state_size!r}, llama_state holds {len(blob)} bytes")
        _check_seed(state.seed, "state.seed")

        def load():
            ids = unpack_state(blob, self._model.n_vocab)[0]
            try:
                given = np.asarray(state.input_ids).tolist()
            except (TypeError, ValueError):
                given = None
            if given != ids:
                raise ValueError("state.input_ids: not the tokens of state.llama_state")
            if state.n_tokens != len(ids):
                raise ValueError(f"state.n_tokens: {state.n_tokens!r}, input_ids holds {len(ids)}")
            self._model.load_state(blob, slot)
            self.seed = state.seed
        self._prepare(load)

    def n_vocab(self) -> int:
        return self._model.n_vocab

    def n_embd(self) -> int:
        return self._model.n_embd

    def pooling_type(self) -> int:
        """The embeddings' pooling, llama.cpp's value: 0 none, 1 mean, 3 last."""
        return self._pooling

    def token_eos(self) -> int | None:
        return self._model.tokenizer.eos_token_id

    def token_bos(self) -> int | None:
        """The GGUF's ``tokenizer.ggml.bos_token_id`` (Qwen vocabularies add none to prompts)."""
        return self._model.tokenizer.bos_token_id

    def token_nl(self) -> int:
        """The id of the token for "\\n"."""
        return self._model.tokenize("\n", special=False)[0]

    def set_seed(self, seed: int) -> None:
        """The default seed of later calls without ``seed`` (as the constructor's)."""
        self.seed = _check_seed(seed)

    @property
    def metadata(self) -> dict[str, str]:
        """The GGUF's scalar metadata as strings, as llama-cpp-python's ``metadata`` (llama.cpp's
        ``gguf_kv_to_str``: arrays left out, floats as C's ``%f``, bools ``true``/``false``)."""
        self._check_open()
        return {k: _kv_str(v) for k, v in self._prepare(self._model.metadata).items()}

    def tokenizer(self) -> "CloverTokenizerView":
        """llama-cpp-python's ``LlamaTokenizer`` for this model (``tokenize``, ``detokenize``,
        ``encode``, ``decode``)."""
        return CloverTokenizerView(self)

    # ------------------------------------------------------------------ tokens
    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text`` (bytes as UTF-8, or str), as llama-cpp-python's ``tokenize``:
        ``special=True`` recognises control tokens such as ``<|im_start|>`` written in the text.
        ``add_bos`` is accepted for compatibility: Clover / Qwen vocabularies add no BOS token
        (their GGUFs say ``tokenizer.ggml.add_bos_token = false``), so it changes nothing."""
        if isinstance(text, (bytes, bytearray)):
            text = bytes(text).decode("utf-8", errors="replace")
        if not isinstance(text, str):
            raise ValueError(f"text: expected bytes or str, got {type(text).__name__}")
        self._check_open()
        return self._model.tokenize(text, special=bool(special))

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of ``tokens`` (llama-cpp-python returns bytes too: a token may end inside a
        UTF-8 character). Control tokens are written only with ``special=True``.
        ``prev_tokens`` is accepted for compatibility and ignored (byte-level BPE pieces do not
        depend on the previous tokens)."""
        self._check_open()
        ids = self._model.check_ids("tokens", tokens, allow_empty=True)
        return self._model.tokenizer.decode_bytes(ids, skip_special=not special)

    # ------------------------------------------------------------------ generation core
    def _gen_kwargs(self, n_prompt_max: int, max_tokens, temperature, top_p, top_k, min_p, seed,
                    presence_penalty, frequency_penalty, repeat_penalty, logit_bias, stop, mode,
                    block_size, threshold, coreset_top_p) -> dict:
        is_int = isinstance(max_tokens, int) and not isinstance(max_tokens, bool)
        if max_tokens is None or (is_int and max_tokens <= 0):  # llama-cpp-python's "no limit"
            max_tokens = max(1, self._model.n_ctx - n_prompt_max)  # until the context is full
        if seed is None:
            seed = self.seed
        if seed in RANDOM_SEEDS:
            seed = secrets.randbits(63)
        return dict(max_tokens=max_tokens,
                    mode=self.mode if mode is None else mode,
                    temperature=0.0 if temperature is None else temperature,
                    top_k=0 if top_k is None else top_k,
                    top_p=1.0 if top_p is None else top_p,
                    seed=seed,
                    block_size=self.block_size if block_size is None else block_size,
                    threshold=self.threshold if threshold is None else threshold,
                    coreset_top_p=self.coreset_top_p if coreset_top_p is None else coreset_top_p,
                    min_p=min_p, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                    repeat_penalty=repeat_penalty, logit_bias=logit_bias, stop=stop)

    def check_args(self, max_tokens: int | None = 16, **kwargs) -> None:
        """Validate the generation arguments of :meth:`create_completion` /
        :meth:`create_chat_completion` (``max_tokens, temperature, top_p, top_k, min_p, seed,
        presence_penalty, frequency_penalty, repeat_penalty, logit_bias, stop, mode, block_size,
        threshold, coreset_top_p``; None = the default) without generating, as a call would.
        Raises ValueError naming the field (``clover-gguf chat`` checks its flags with it)."""
        names = tuple(n for n in REQUEST_FIELDS if n != "max_tokens")
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise TypeError(f"check_args: unexpected argument {unknown[0]!r}")
        kw = {k: kwargs.get(k) for k in names}

        def check():
            self._model.check_generate_args(**self._gen_kwargs(1, max_tokens=max_tokens, **kw))
        self._prepare(check)

    def _start(self, prompt, kw: dict, extra: dict | None = None) -> tuple[Iterator, int, str]:
        """Validate and tokenize (under the lock): (a Model piece stream not yet started,
        prompt tokens, mode). ``extra``: Model options beyond :meth:`_gen_kwargs`' (``grammar``,
        ``json_schema``, ``logprobs``)."""
        if not isinstance(prompt, (str, list, tuple)):
            raise ValueError(f"prompt: expected a str or a list of token ids, got {type(prompt).__name__}")
        ids = self._model.prompt_ids(prompt)
        kw = {**self._gen_kwargs(len(ids), **kw), **(extra or {})}
        return self._model.generate_pieces(ids, **kw), len(ids), kw["mode"]

    def _pieces(self, holder: _Holder, started) -> Iterator[tuple[str, list]]:
        """``(text piece, logprob entries)`` of a generation's steps (``started``: :meth:`_start`'s
        result; entries ``(id, logprob, [(id, logprob)])`` of its tokens other than end tokens,
        empty without logprobs), honouring a cancel() that came before the generation started (no
        prefill then) or in the moment before the Model registered it (it is repeated at the next
        piece)."""
        pieces, n_prompt, mode = started
        ends = set(self._model.end_ids)
        with self._state:
            holder.pieces = pieces
        try:
            if holder.cancelled:
                holder.stats = self._model.record_cancelled(n_prompt, mode)
                return
            for piece, tokens, lps in pieces:
                entries = [(t, lp, top) for t, (lp, top) in zip(tokens, lps) if t not in ends] if lps else []
                if piece or entries:
                    yield piece, entries
                if holder.cancelled:
                    pieces.cancel()
        finally:
            pieces.close()  # an abandoned stream frees its decoder now
            if holder.stats is None:
                holder.stats = pieces.stats

    def _finish(self, end_ids, stats: dict | None) -> tuple[str, dict, dict]:
        """finish_reason, usage and timings of a generation that ended with ``stats``."""
        st = stats or {}
        ends = set(end_ids)
        n_completion = sum(1 for t in st.get("tokens", []) if t not in ends)
        usage = _usage(int(st.get("n_prompt", 0)), n_completion)
        seconds = float(st.get("seconds", 0.0))
        t_prompt = float(st.get("prefill_seconds", 0.0))
        t_pred = max(seconds - t_prompt, 0.0)
        prefilled = st.get("n_forward_prefill", 0) > 0  # not when a cancel stopped the prefill
        timings = {
            # llama.cpp server's names
            "prompt_n": usage["prompt_tokens"],
            "prompt_ms": t_prompt * 1e3,
            "prompt_per_second": usage["prompt_tokens"] / t_prompt if prefilled and t_prompt > 0 else 0.0,
            "predicted_n": n_completion,
            "predicted_ms": t_pred * 1e3,
            "predicted_per_second": n_completion / t_pred if t_pred > 0 else 0.0,
        }
        # the diffusion statistics (Model.last_stats): forwards by kind, tokens per forward, ...
        timings.update({k: v for k, v in st.items() if k not in ("tokens", "finish_reason", "stop_string")})
        finish = st.get("finish_reason") or "stop"
        if self.verbose:
            print(f"clover: [ prompt: {timings['prompt_per_second']:.1f} t/s | generation: "
                  f"{timings['predicted_per_second']:.1f} t/s | tokens/forward: "
                  f"{timings.get('tokens_per_forward', 0.0):.2f} ] {usage['prompt_tokens']} + "
                  f"{n_completion} tokens, {timings.get('n_forward', 0)} forwards, finish {finish}",
                  file=sys.stderr)
        return finish, usage, timings

    def _locked_iter(self, holder: _Holder, make_inner) -> Iterator[dict]:
        """Run ``make_inner()`` (a generator of chunks whose return value is the list of final
        chunks) holding the call lock; the final chunks are yielded after the lock is
        released, so a finished stream never blocks other calls."""
        holder.thread = threading.get_ident()
        holder.executing = True
        self._acquire(holder)
        tail: list = []
        try:
            inner = make_inner(holder)
            try:
                while True:
                    try:
                        chunk = next(inner)
                    except StopIteration as e:
                        tail = e.value or []
                        break
                    holder.executing = False
                    yield chunk
                    holder.executing = True
                    holder.thread = threading.get_ident()
            finally:
                inner.close()  # an abandoned stream frees its decoder now (see _pieces)
        finally:
            self._release(holder)
        yield from tail

    def _stream(self, make_inner) -> Stream:
        holder = _Holder(stream=True)
        g = self._locked_iter(holder, make_inner)
        holder.gen = weakref.ref(g)
        return Stream(self, holder, g)

    def _run_locked(self, make_inner) -> list[dict]:
        """All chunks of ``make_inner()`` (non-streaming calls), under the lock."""
        holder = _Holder()
        self._acquire(holder)
        try:
            inner = make_inner(holder)
            chunks = []
            try:
                while True:
                    chunks.append(next(inner))
            except StopIteration as e:
                chunks.extend(e.value or [])
            return chunks
        finally:
            self._release(holder)

    def _prepare(self, fn):
        """Run ``fn`` (argument validation, tokenizing) under the call lock."""
        holder = _Holder(cancellable=False)
        self._acquire(holder)
        try:
            return fn()
        finally:
            self._release(holder)

    # ------------------------------------------------------------------ embeddings
    def embed(self, input, normalize: bool = False, truncate: bool = True, return_count: bool = False):
        """Embeddings as llama-cpp-python's ``embed``: the final hidden state after the final norm
        (the LM head's input) of a causal prefill of each input, pooled by :meth:`pooling_type`
        (:meth:`Model.embed <clover_gguf.model.Model.embed>`).

        ``input``: a str or a list of str (or, beyond llama-cpp-python, a list of token ids or
        a list of such lists). Returns one embedding (a list of n_embd floats; with pooling
        none a list of such rows, one per token) for a str or one list of ids, else a list of
        them, in order; with ``return_count`` the pair ``(embeddings, total tokens)``.
        ``normalize``: divide each vector (each row with pooling none) by its L2 norm.
        ``truncate``: keep the first ``n_ctx`` tokens of a longer input (llama-cpp-python keeps
        ``n_batch``); False: ContextLengthExceeded (a ValueError) naming the input.
        Needs ``embedding=True`` (RuntimeError otherwise, as llama-cpp-python). Each call
        resets the context (the next completion prefills its whole prompt); :meth:`cancel`
        stops it with CloverError."""
        if not self.embedding:
            raise RuntimeError("Clover must be created with embedding=True to call this method")
        self._check_open()
        inputs, single = embedding_inputs(self._model, input)
        n_ctx = self._model.n_ctx
        for i, ids in enumerate(inputs):
            if len(ids) > n_ctx and not truncate:
                name = "input" if single else f"input[{i}]"
                raise ContextLengthExceeded(f"{name}: {len(ids)} tokens do not fit n_ctx={n_ctx} (truncate=False)")
        inputs = [ids[:n_ctx] for ids in inputs]

        holder = _Holder()  # cancel() stops it: CloverError
        self._acquire(holder)
        try:
            data = []
            for ids in inputs:
                if holder.cancelled:
                    raise CloverError("embed: cancelled")
                data.append(self._model.embed(ids, pooling=self._pooling).tolist())
        finally:
            self._release(holder)
        if normalize:
            data = [[_normalized(r) for r in e] if self._pooling == POOLING_TYPES["none"] else _normalized(e)
                    for e in data]
        out = data[0] if single else data
        return (out, sum(map(len, inputs))) if return_count else out

    def create_embedding(self, input, model: str | None = None, *, normalize: bool = False,
                         truncate: bool = True) -> dict:
        """OpenAI's ``/v1/embeddings`` response for ``input`` (as :meth:`embed`), as
        llama-cpp-python's ``create_embedding``: ``{"object": "list", "data": [{"object":
        "embedding", "embedding", "index"}], "model", "usage": {"prompt_tokens",
        "total_tokens"}}``, one entry per input. ``model``: the name reported (None: the model
        path). ``normalize``, ``truncate``: as :meth:`embed` (llama-cpp-python's defaults: raw
        vectors, truncated)."""
        embeds, total = self.embed([input] if _single_input(input) else input, normalize=normalize, truncate=truncate,
                                   return_count=True)
        return {"object": "list",
                "data": [{"object": "embedding", "embedding": e, "index": i} for i, e in enumerate(embeds)],
                "model": model if model is not None else self.model_path,
                "usage": {"prompt_tokens": total, "total_tokens": total}}

    # ------------------------------------------------------------------ completion
    def create_completion(self, prompt: str | Sequence[int], *, suffix: str | None = None,
                          max_tokens: int | None = 16, temperature: float | None = None,
                          top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                          echo: bool = False, stop: str | Sequence[str] | None = None,
                          seed: int | None = None, presence_penalty: float | None = None,
                          frequency_penalty: float | None = None, repeat_penalty: float | None = None,
                          logit_bias: dict | None = None, logprobs: int | None = None,
                          response_format: dict | None = None, grammar: str | None = None,
                          stream: bool = False, model: str | None = None, mode: str | None = None,
                          block_size: int | None = None, threshold: float | None = None,
                          coreset_top_p: float | None = None, prompt_cache_key=None,
                          typical_p: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                          mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, stopping_criteria=None,
                          logits_processor=None):
        """Complete ``prompt`` (a str, tokenized with control tokens recognised, or a list of
        token ids) as OpenAI's ``/v1/completions`` / llama-cpp-python's ``create_completion``.

        Returns ``{"id", "object": "text_completion", "created", "model", "choices": [{"text",
        "index", "logprobs", "finish_reason"}], "usage": {"prompt_tokens",
        "completion_tokens", "total_tokens"}, "timings": {...}}``; with ``stream=True`` an
        iterator of chunks of the same shape, each ``choices[0]["text"]`` a piece of final
        text (``finish_reason`` None), the last one with ``text`` "" and the
        ``finish_reason``, ``usage`` and ``timings``. The pieces concatenate to the
        non-streamed text.

        ``finish_reason``: ``"stop"`` (an end token or a ``stop`` string), ``"length"``
        (``max_tokens`` or the context) or ``"cancelled"`` (:meth:`cancel`).
        ``max_tokens``: default 16 as llama-cpp-python; None, 0 or a negative value (-1) = until
        the context is full.
        ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``presence_penalty``,
        ``frequency_penalty``, ``repeat_penalty``, ``logit_bias`` (``{token id: bias}``, keys
        may be str as in OpenAI's JSON), ``stop``, ``seed``: as :meth:`Model.generate
        <clover_gguf.model.Model.generate>`; None = the engine default (greedy, GGUF penalties).
        ``mode``, ``block_size``, ``threshold``, ``coreset_top_p``: None = the constructor's.
        ``echo``: prepend the prompt text. ``suffix`` is not supported (a value other than None
        raises ValueError). ``model``: the name written in the response (default: ``model_path``).
        ``logprobs`` N (0-20): each choice (each chunk) carries OpenAI's ``logprobs``
        (``tokens``, ``token_logprobs``, ``top_logprobs`` with the N most likely, ``text_offset``),
        from the row that chose each token (clover.h ``clover_decoder_logprobs``).
        ``response_format`` (``json_object``, ``json_schema``) or ``grammar`` (GBNF, or Lark
        starting with ``%llguidance``): constrained decoding, the output valid by construction
        unless ``max_tokens`` cuts it (docs/structured-output.md).
        ``prompt_cache_key`` (OpenAI's field): prefix reuse stays among the calls of one key; a
        call of another key than the context's previous call starts from an empty context
        (:meth:`Model.generate <clover_gguf.model.Model.generate>`).

        ``typical_p``, ``tfs_z``, ``mirostat_*``, ``stopping_criteria``, ``logits_processor``:
        llama-cpp-python's, accepted; a value other than its default has no effect and raises one
        ``UserWarning`` saying why (:data:`clover_gguf.compat.CALL`).

        Raises ValueError for a bad argument (naming it, at call time also for streams),
        CloverError for an engine error or a closed object.
        """
        compat.warn_ignored(compat.CALL, dict(
            typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, stopping_criteria=stopping_criteria, logits_processor=logits_processor))
        if suffix is not None:
            raise ValueError("suffix: not supported (no fill-in-the-middle)")
        n_top = _check_logprobs("logprobs", logprobs)
        extra = {**_constraint(response_format, grammar), "logprobs": n_top, "prompt_cache_key": prompt_cache_key}
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  seed=seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                  repeat_penalty=repeat_penalty, logit_bias=logit_bias, stop=stop, mode=mode,
                  block_size=block_size, threshold=threshold, coreset_top_p=coreset_top_p)
        meta = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": model if model is not None else self.model_path}
        end_ids = list(self._model.end_ids)

        tk = self._model.tokenizer

        def chunk(text, finish=None, logprobs=None):
            return {**meta, "choices": [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]}

        def inner(holder, started, echo_text):
            if echo_text:
                yield chunk(echo_text)
            offset = len(echo_text)
            for piece, entries in self._pieces(holder, started):
                yield chunk(piece, logprobs=_completion_logprobs(tk, entries, offset) if n_top is not None else None)
                offset += len(piece)
            finish, usage, timings = self._finish(end_ids, holder.stats)
            return [{**chunk("", finish), "usage": usage, "timings": timings}]

        def prepare():
            try:
                started = self._start(prompt, kw, extra)
            except ValueError as e:
                raise _field_error(e, {"json_schema": "response_format"}) from None
            echo_text = ""
            if echo:
                echo_text = prompt if isinstance(prompt, str) else self._model.detokenize(prompt)
            return started, echo_text

        if stream:
            started, echo_text = self._prepare(prepare)
            return self._stream(lambda holder: inner(holder, started, echo_text))
        chunks = self._run_locked(lambda holder: inner(holder, *prepare()))
        last = chunks[-1]
        text = "".join(c["choices"][0]["text"] for c in chunks)
        lps = None
        if n_top is not None:  # the chunks' logprobs joined (text_offset already counts from the start)
            lps = {k: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]]
                   for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        return {**meta, "choices": [{"text": text, "index": 0, "logprobs": lps,
                                     "finish_reason": last["choices"][0]["finish_reason"]}],
                "usage": last["usage"], "timings": last["timings"]}

    def __call__(self, prompt, **kwargs):
        """Same as :meth:`create_completion`."""
        return self.create_completion(prompt, **kwargs)

    # ------------------------------------------------------------------ chat
    def _chat_prompt(self, messages, tools, enable_thinking, chat_template_kwargs,
                     constrained: bool = False) -> tuple[str, bool]:
        """(prompt text, whether its generation header left a <think> section open). A
        ``constrained`` answer (docs/structured-output.md) is rendered with thinking off."""
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise ValueError(f"chat_template_kwargs: expected a dict, got {type(chat_template_kwargs).__name__}")
        extra = dict(chat_template_kwargs or {})
        check_template_kwargs(extra)  # messages, tools, ... come from the call's own arguments
        if enable_thinking is not None:
            extra["enable_thinking"] = bool(enable_thinking)
        if constrained:
            if extra.get("enable_thinking"):
                raise ValueError("enable_thinking: constrained output (response_format, grammar or a forced "
                                 "tool_choice) is generated with thinking off")
            extra["enable_thinking"] = False
        messages = _template_messages(messages)
        full = self._model.apply_chat_template(messages, add_generation_prompt=True, tools=tools, **extra)
        base = self._model.apply_chat_template(messages, add_generation_prompt=False, tools=tools, **extra)
        header = full[len(base):] if full.startswith(base) else full
        return full, header.rfind(_THINK_OPEN) > header.rfind(_THINK_CLOSE)

    def prepare_chat(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None,
                     enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None,
                     constrained: bool = False) -> ChatPrompt:
        """Render ``messages`` with the chat template and tokenize them, without the call lock
        (safe while another thread generates): the result, given as ``messages`` to
        :meth:`create_chat_completion`, skips that work there. A server prepares requests this way
        while the slot is busy. ``constrained``: the call will constrain the answer (then thinking
        is off, see :meth:`create_chat_completion`). Raises ValueError as
        :meth:`create_chat_completion` would (ContextLengthExceeded when the prompt leaves no room
        in the context)."""
        self._check_open()
        text, think_open = self._chat_prompt(messages, tools, enable_thinking, chat_template_kwargs, constrained)
        return ChatPrompt(_chat_fits(lambda: self._model.check_prompt_fits(self._model.prompt_ids(text))),
                          think_open, list(tools) if tools else None)

    def create_chat_completion(self, messages: Sequence[dict] | ChatPrompt, *, tools: Sequence[dict] | None = None,
                               tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
                               enable_thinking: bool | None = None, chat_template_kwargs: dict | None = None,
                               max_tokens: int | None = None, temperature: float | None = None,
                               top_p: float | None = None, top_k: int | None = None, min_p: float | None = None,
                               stop: str | Sequence[str] | None = None, seed: int | None = None,
                               presence_penalty: float | None = None, frequency_penalty: float | None = None,
                               repeat_penalty: float | None = None, logit_bias: dict | None = None,
                               logprobs: bool | None = None, top_logprobs: int | None = None,
                               response_format: dict | None = None,
                               grammar: str | None = None, stream: bool = False, model: str | None = None,
                               mode: str | None = None, block_size: int | None = None,
                               threshold: float | None = None, coreset_top_p: float | None = None,
                               prompt_cache_key=None,
                               functions: Sequence[dict] | None = None, function_call: str | dict | None = None,
                               typical_p: float = 1.0, tfs_z: float = 1.0, mirostat_mode: int = 0,
                               mirostat_tau: float = 5.0, mirostat_eta: float = 0.1, logits_processor=None):
        """Answer ``messages`` (OpenAI chat messages) as ``/v1/chat/completions`` /
        llama-cpp-python's ``create_chat_completion``.

        The prompt is the GGUF's ``tokenizer.chat_template`` rendered with
        ``add_generation_prompt=True`` (:meth:`Model.apply_chat_template
        <clover_gguf.model.Model.apply_chat_template>`; ``tools`` and ``chat_template_kwargs``
        reach the template). ``enable_thinking``: None leaves the template's default (Qwen3.5's
        template thinks unless told ``False``); True / False is passed to the template.

        Returns ``{"id", "object": "chat.completion", "created", "model", "choices": [{"index",
        "message": {"role": "assistant", "content", "reasoning_content"}, "logprobs",
        "finish_reason"}], "usage", "timings"}``: ``reasoning_content`` is the text inside
        ``<think>...</think>`` of the answer (also when the template's generation header already
        opened ``<think>``), None if there is none; ``content`` the rest (see
        :class:`ReasoningSplitter` for the whitespace rules). With ``stream=True``: an iterator
        of ``chat.completion.chunk`` dicts, the first with ``delta`` ``{"role": "assistant",
        "content": ""}``, then ``delta`` ``{"reasoning_content": ...}`` or ``{"content": ...}``,
        the last with ``delta`` {} and the ``finish_reason``, ``usage`` and ``timings``; the
        deltas concatenate to the non-streamed fields.
        ``max_tokens``: None = until the context is full (generation normally ends at
        ``<|im_end|>``). The other arguments are those of :meth:`create_completion`.
        ``messages`` may be a :class:`ChatPrompt` from :meth:`prepare_chat` (then ``tools``,
        ``enable_thinking`` and ``chat_template_kwargs`` went there and must be None here).

        Tool calls: with ``tools`` declared and ``tool_choice`` None or ``"auto"``, the calls the
        answer writes in the template's markup (Qwen3.5's ``<tool_call><function=NAME>...`` or the
        JSON-in-``<tool_call>`` form; :mod:`clover_gguf.tool_calls`) become ``message.tool_calls``
        (OpenAI-shaped, arguments typed by the tool's schema; ``content`` None when only calls
        remain) and ``finish_reason`` ``"tool_calls"``; streamed, once a call's markup closes, one
        ``delta.tool_calls`` chunk brings its index, id, type and name (``arguments`` "") and the
        next its ``arguments``, as OpenAI streams calls; no markup reaches ``delta.content``.
        A call to an undeclared tool or without a required parameter stays text. ``"none"``
        leaves the markup as text; ``"required"`` and a named function (``{"type": "function",
        "function": {"name": ...}}``) are enforced by constrained decoding in the template's call
        form: one call, or one or more with ``parallel_tool_calls`` True (default False, as
        llama-server). Assistant messages' ``tool_calls`` may carry
        ``arguments`` as a JSON string (OpenAI's form): the template gets the object.

        ``response_format`` and ``grammar`` as :meth:`create_completion`. A constrained answer
        (those, or a forced ``tool_choice``) is generated with thinking off (``enable_thinking``
        True is refused). ``logprobs`` True with ``top_logprobs`` N (0-20): OpenAI's
        ``logprobs.content`` per token (reasoning tokens included), per chunk when streamed.

        ``prompt_cache_key``: as :meth:`create_completion`.

        ``functions`` / ``function_call``: OpenAI's older form of ``tools`` / ``tool_choice``,
        translated to them (the answer carries ``tool_calls``). ``typical_p``, ``tfs_z``,
        ``mirostat_*``, ``logits_processor``: as :meth:`create_completion`.
        """
        compat.warn_ignored(compat.CALL, dict(
            typical_p=typical_p, tfs_z=tfs_z, mirostat_mode=mirostat_mode, mirostat_tau=mirostat_tau,
            mirostat_eta=mirostat_eta, logits_processor=logits_processor))
        if functions is not None or function_call is not None:
            tools, tool_choice = _legacy_functions(functions, function_call, tools, tool_choice)
        n_top = (0 if top_logprobs is None else _check_logprobs("top_logprobs", top_logprobs)) if logprobs else None
        if top_logprobs is not None and not logprobs:
            raise ValueError("top_logprobs: needs logprobs true")
        declared = messages.tools if isinstance(messages, ChatPrompt) else tools
        forced = forced_tools(declared, tool_choice)
        extra = _constraint(response_format, grammar)
        if forced is not None:
            if extra:
                raise ValueError("tool_choice: a forced tool call cannot be combined with response_format or grammar")
            xml = "<function=" in (getattr(self._model.tokenizer, "chat_template", None) or "")
            extra = {"grammar": tool_call_grammar(forced, xml, bool(parallel_tool_calls), JSON_LAYOUT)}
        constrained = bool(extra)
        extra["logprobs"] = n_top
        extra["prompt_cache_key"] = prompt_cache_key
        kw = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                  seed=seed, presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                  repeat_penalty=repeat_penalty, logit_bias=logit_bias, stop=stop, mode=mode,
                  block_size=block_size, threshold=threshold, coreset_top_p=coreset_top_p)
        meta = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": model if model is not None else self.model_path}
        end_ids = list(self._model.end_ids)

        tk = self._model.tokenizer

        def chunk(delta, finish=None):
            return {**meta, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        parser = ToolCallParser(declared) if declared and tool_choice != "none" else None
        calls: list[dict] = []

        def deltas(parts):
            for kind, text in parts:
                if kind == "reasoning":
                    yield chunk({"reasoning_content": text})
                elif parser is None:
                    yield chunk({"content": text})
                else:
                    yield from tool_deltas(parser.push(text))

        def tool_deltas(events):
            for kind, item in events:
                if kind == "content":
                    yield chunk({"content": item})
                else:  # as OpenAI streams a call: index, id, type and name, then the arguments
                    calls.append(item)
                    head = {**item, "function": {"name": item["function"]["name"], "arguments": ""}}
                    yield chunk({"tool_calls": [{"index": len(calls) - 1, **head}]})
                    yield chunk({"tool_calls": [{"index": len(calls) - 1,
                                                 "function": {"arguments": item["function"]["arguments"]}}]})

        def inner(holder, started, think_open):
            split = ReasoningSplitter(think_open)
            pending: list = []  # logprob entries not yet carried by a chunk

            def carry(chunks):
                for c in chunks:
                    if pending:
                        c["choices"][0]["logprobs"] = _chat_logprobs(tk, pending)
                        pending.clear()
                    yield c
            yield chunk({"role": "assistant", "content": ""})
            for piece, entries in self._pieces(holder, started):
                pending.extend(entries)
                yield from carry(deltas(split.push(piece)))
            yield from carry(deltas(split.flush()))
            if parser is not None:
                yield from carry(tool_deltas(parser.flush()))
            finish, usage, timings = self._finish(end_ids, holder.stats)
            if calls and finish == "stop":
                finish = "tool_calls"
            return list(carry([{**chunk({}, finish), "usage": usage, "timings": timings}]))

        def start(ids):
            try:
                return self._start(ids, kw, extra)
            except ValueError as e:
                raise _field_error(e, {"json_schema": "response_format",
                                       "grammar": "tool_choice" if forced is not None else "grammar"}) from None

        def prepare():
            if isinstance(messages, ChatPrompt):
                for name, v in (("tools", tools), ("enable_thinking", enable_thinking),
                                ("chat_template_kwargs", chat_template_kwargs)):
                    if v is not None:
                        raise ValueError(f"{name}: give it to prepare_chat with the messages")
                if constrained and messages.think_open:
                    raise ValueError("messages: constrained output needs the prompt prepared with constrained=True "
                                     "(thinking off)")
                return start(messages.ids), messages.think_open
            text, think_open = self._chat_prompt(messages, tools, enable_thinking, chat_template_kwargs, constrained)
            return _chat_fits(lambda: start(text)), think_open

        if stream:
            started, think_open = self._prepare(prepare)
            return self._stream(lambda holder: inner(holder, started, think_open))
        chunks = self._run_locked(lambda holder: inner(holder, *prepare()))
        last = chunks[-1]
        content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None,
                                   "reasoning_content": reasoning or None}
        if calls:
            message["tool_calls"] = calls
        lps = None
        if n_top is not None:
            lps = {"content": [e for c in chunks if c["choices"][0]["logprobs"]
                               for e in c["choices"][0]["logprobs"]["content"]], "refusal": None}
        return {**meta, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "logprobs": lps,
                             "finish_reason": last["choices"][0]["finish_reason"]}],
                "usage": last["usage"], "timings": last["timings"]}
