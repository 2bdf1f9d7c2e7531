"""Python API over the native engine: :class:`Model` (clover-spec sections 3, 5).

A thin, friendly layer over ``clover.h`` (through the cffi binding in ``_ffi``): load a
GGUF, tokenize, generate text in ``diffusion`` (threshold block decoding, spec 5.2) or
``ar`` mode, stream committed text, and read prefix-mode / block-mode logits for tests.
Nothing here imports torch.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np

from . import compat
from ._ffi import CloverError, err_buf, ffi, lib, raise_error
from .chat import ChatTemplate
from .gguf import read_metadata
from .grammar import Constraint, grammar_source, ll_tokenizer
from .options import GenerateOptions
from .paths import DEFAULT_MODEL
from .preload import available_bytes
from .state import pack_state, unpack_state
from .stops import StopFilter, check_stop
from .tokenizer import CloverTokenizer

__all__ = ["Model", "Generation", "CloverError", "ContextLengthExceeded"]

_MODES = {"ar": lib.CLOVER_MODE_AR, "diffusion": lib.CLOVER_MODE_DIFFUSION, "spec": lib.CLOVER_MODE_SPEC}
_FINISH = {
    lib.CLOVER_FINISH_NONE: None,
    lib.CLOVER_FINISH_STOP: "stop",
    lib.CLOVER_FINISH_LENGTH: "length",
}
# clover_hparams.arch and .penalty_scope by their C values (clover.h CLOVER_ARCH_*, CLOVER_PENALTY_*)
_ARCHES = ("qwen35moe", "clover_moe")
_SCOPES = ("response", "all")
# Embedding pooling (clover.h CLOVER_POOLING_*): llama.cpp's enum llama_pooling_type values.
POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
# The most slots (contexts) of one Model.
MAX_PARALLEL = 256
# Tokens that end generation besides the GGUF eos (Qwen chat / document ends).
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


class ContextLengthExceeded(ValueError):
    """A prompt that does not fit the model's context (OpenAI's ``context_length_exceeded``)."""


class _Run:
    """A call in progress: ``cancelled`` is set by :meth:`Model.cancel` or its
    :meth:`Generation.cancel`; ``slot`` is the slot it runs on (None before it has one, and
    after it ended); ``stats`` its :attr:`Model.last_stats` once it ended."""

    __slots__ = ("cancelled", "slot", "stats")

    def __init__(self) -> None:
        self.cancelled = False
        self.slot = None
        self.stats: dict | None = None


class _Slot:
    """One decoding context of a :class:`Model` (llama-server's slot): its call lock, its
    prefix-reuse cache and the call running on it."""

    __slots__ = ("index", "ctx", "lock", "cached", "saved", "ids", "active", "running", "busy", "key", "used")

    def __init__(self, index: int, ctx) -> None:
        self.index, self.ctx = index, ctx
        self.lock = threading.RLock()  # the call lock: native calls on this context
        self.cached: list[int] = []  # the tokens the caches hold after the last generation
        self.saved: list[int] = []  # the prompt prefix whose state clover_context_save_state kept
        self.ids: list[int] = []  # the tokens fed last; the caches hold its first n_past (input_ids)
        self.active = None  # the native decoder of a generation in progress
        self.running: _Run | None = None  # the call running, for cancel(); guarded by Model._cancel_lock
        self.busy = False  # taken by a call (n_parallel > 1); guarded by Model._free
        self.key = None  # the prompt_cache_key of the last generation
        self.used = 0  # when it was last taken (a counter), for least-recently-used choice

    def shared(self, ids) -> int:
        """Tokens at the start of ``ids`` that this slot's cache holds (cached or saved)."""
        return max(_common_prefix(self.cached, ids), _common_prefix(self.saved, ids))


def _common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Generation:
    """A streaming generation (:meth:`Model.generate_stream`, :meth:`Model.generate_pieces`): an
    iterator with :meth:`cancel` (this generation alone) and :attr:`stats`."""

    def __init__(self, model: "Model", run: _Run, it: Iterator) -> None:
        self._model, self._run, self._it = model, run, it

    def __iter__(self) -> "Generation":
        return self

    def __next__(self):
        return next(self._it)

    def close(self) -> None:
        """End the generation now (frees its decoder and its slot)."""
        self._it.close()

    def cancel(self) -> bool:
        """Stop this generation from any thread, as :meth:`Model.cancel` stops all: its forward
        stops before its next layer and it ends with ``finish_reason`` ``"cancelled"``; before it
        started, it ends so without a prefill. Returns False when it had ended already."""
        return self._model._cancel_run(self._run)

    @property
    def stats(self) -> dict | None:
        """This generation's :attr:`Model.last_stats` once it ended, else None."""
        return self._run.stats


def _check_int(name, v, lo=None, hi=None):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: expected an integer, got {v!r}")
    v = int(v)
    if lo is not None and v < lo:
        raise ValueError(f"{name}: {v} must be >= {lo}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: {v} must be <= {hi}")
    return v


# KV cache element types (ggml's type ids, as llama-cpp-python's type_k/type_v): name -> id, and
# id -> bytes a value
CACHE_TYPES = {"f32": 0, "f16": 1}
CACHE_TYPE_BYTES = {0: 4, 1: 2}


def cache_type(name: str, v) -> int:
    """The ggml type id of a KV cache type given as a name (``"f16"``, ``"f32"``, any case) or
    an id (1, 0); ValueError naming ``name`` for anything else."""
    if isinstance(v, str) and v.lower() in CACHE_TYPES:
        return CACHE_TYPES[v.lower()]
    if not isinstance(v, (bool, str)) and isinstance(v, (int, np.integer)) and int(v) in CACHE_TYPE_BYTES:
        return int(v)
    raise ValueError(f"{name}: {v!r} is not a supported KV cache type ({', '.join(CACHE_TYPES)})")


def pooling_type(name: str, v) -> int:
    """llama.cpp's pooling value (:data:`POOLING_TYPES`) of ``v``: a name (``"none"``, ``"mean"``,
    ``"last"``, ...) or its integer; None and -1 (``LLAMA_POOLING_TYPE_UNSPECIFIED``) give -1,
    the model's. Which the engine computes is checked there (CLS and RANK are refused)."""
    if v is None:
        return -1
    if isinstance(v, str) and v.lower() in POOLING_TYPES:
        return POOLING_TYPES[v.lower()]
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool) and -1 <= v <= max(POOLING_TYPES.values()):
        return int(v)
    raise ValueError(f"{name}: expected one of {', '.join(POOLING_TYPES)} (or llama.cpp's 0..4, -1 for the "
                     f"model's), got {v!r}")


def _utf8_size(name: str, text: str) -> int:
    """UTF-8 bytes of ``text``; ValueError naming ``name`` when it is not valid Unicode."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # a lone surrogate (JSON "\ud800")
        raise ValueError(f"{name}: not valid Unicode ({e.reason} at index {e.start})") from None


def _memlock_hint() -> str:
    """How much the process may lock (RLIMIT_MEMLOCK) and how to raise it, for a refused mlock."""
    try:
        import resource
        soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    except (ImportError, OSError, ValueError):
        return ""
    return "" if soft == resource.RLIM_INFINITY else f"; RLIMIT_MEMLOCK is {soft} bytes: raise it with `ulimit -l`"


def _flash_attn(v) -> bool:
    """llama-cpp-python's bool, or llama.cpp's -fa on|off|auto: True when on."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("on", "off", "auto"):
        return v.lower() == "on"
    raise ValueError(f"flash_attn: expected a bool or 'on', 'off', 'auto', got {v!r}")


def ubatch_rows(n_batch, n_ubatch) -> int:
    """The most prompt rows of one prefill pass for llama.cpp's n_batch and n_ubatch (None: not
    set; 0 when neither is): the smaller, rounded down to a multiple of CLOVER_GDN_CHUNK (64),
    at least 64 (clover.h clover_context_set_n_ubatch)."""
    given = [_check_int(name, v, lo=1, hi=2**31 - 1) for name, v in (("n_batch", n_batch), ("n_ubatch", n_ubatch))
             if v is not None]
    if not given:
        return 0
    chunk = lib.CLOVER_GDN_CHUNK
    return max(min(given) // chunk * chunk, chunk)


def _check_float(name, v, lo=None, hi=None, lo_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected a number, got {v!r}")
    v = float(v)
    if not math.isfinite(v):
        raise ValueError(f"{name}: {v} is not finite")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{name}: {v} must be {'>' if lo_open else '>='} {lo}")
    if hi is not None and v > hi:
        raise ValueError(f"{name}: {v} must be <= {hi}")
    return v


_INT32 = (-2**31, 2**31 - 1)


def _as_int(name, v, lo=_INT32[0], hi=_INT32[1]):
    """``v`` as an int for an engine field holding [lo, hi] (an int32 unless said): the type and
    the representable range only; the engine checks the value (clover_gen_params_check)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name}: expected an integer, got {v!r}")
    if not lo <= int(v) <= hi:
        raise ValueError(f"{name}: {int(v)} is outside the engine's range [{lo}, {hi}]")
    return int(v)


def _as_number(name, v):
    """``v`` as a float for an engine float field: the type only; the engine checks the value
    (NaN, infinities and numbers beyond float32, which become infinities, included)."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name}: expected a number, got {v!r}")
    return float(v)


class Model:
    """A loaded GGUF model (arch ``clover_moe`` or ``qwen35moe``) with one decoding context.

    Args:
        path: GGUF file; None = the small Clover inside the package
            (:data:`clover_gguf.DEFAULT_MODEL`).
        diffusion_path: the diffusion sidecar holding Clover's block tensors for a ``clover_moe``
            trunk without them (docs/gguf-layout.md); None: ``<stem>.diffusion.gguf`` beside
            ``path`` when it exists; ``""``: none. Without block tensors a model runs ``ar``.
        n_ctx: context length in tokens (prompt + generated + one block); 0 = the model's
            training context (``hparams["n_ctx_train"]``), as llama.cpp's ``-c 0``.
        n_threads: CPU threads; None or 0 = all available cores.
        n_gpu_layers: layers whose weight products run on the GPU in a CUDA build (-1: all, and
            the output projection; llama.cpp's -ngl). Without a usable GPU: a UserWarning naming
            the reason, and the CPU. The rest of each layer runs on the CPU (docs/gpu.md).
        n_cpu_moe: the routed experts of the first n_cpu_moe offloaded layers stay in system
            memory (llama.cpp's --n-cpu-moe; >= n_layer: --cpu-moe).
        type_k, type_v: element type of the KV cache's keys and values: ``"f32"`` (default:
            exact; the CPU and GPU backends' greedy tokens matched in every placement test) or
            ``"f16"`` (clover-spec section 6's and llama.cpp's default: half the memory, values
            rounded to nearest even when written; last-bit differences between the backends can
            then become fp16 steps, so their tokens can part at a near-tie); ggml type ids 0 and
            1 also work.
        gpu_budget: bytes of GPU memory, a size such as ``"12G"`` (binary units, as the CLI's
            --gpu-budget), or "free" (what the GPU reports free): choose
            n_gpu_layers and n_cpu_moe to fit it beside the GPU caches of the n_parallel
            contexts (:func:`clover_gguf.placement.fit`); the plan is in :attr:`placement`
            (``placement["plan"]``).
        plan_callback: called with the placement's plan line (str: bytes per part) once a
            usable GPU is found, before any weight goes to it (the CLI prints it, so --fit's
            plan shows before the upload, and also when the upload is refused); not called
            when nothing is offloaded.
        n_batch, n_ubatch: llama.cpp's logical and physical batch: a prompt is prefilled in
            passes of at most min(n_batch, n_ubatch) rows (bounding the activations and scratch),
            rounded down to a multiple of 64 (the Gated DeltaNet chunk, ``CLOVER_GDN_CHUNK``), at
            least 64, so that on the CPU the output equals one pass's bit for bit
            (:attr:`n_ubatch`; ``last_stats["n_forward_prefill"]`` counts the passes). None: the
            backend's bound (2048 rows on the CPU).
        n_threads_batch: CPU threads of the forwards of several rows (prefill, diffusion blocks,
            commits, spec verifies); ``n_threads`` then runs the one-row forwards (ar decode
            steps), as llama.cpp. None: ``n_threads``; 0: all available cores.
        use_mlock: lock the weights' file mapping (and the sidecar's) in RAM with mlock(2); when
            that fails (``ulimit -l``), a UserWarning with the reason, and the model loads.
        use_mmap: accepted for llama-cpp-python's signature; False warns once that it changes
            nothing (:data:`clover_gguf.compat.MODEL`).
        flash_attn: accepted (a bool, or ``"on"``, ``"off"``, ``"auto"``); on warns once that it
            changes nothing: attention is always fused (:data:`clover_gguf.compat.MODEL`).
        prefix_reuse: a generation whose prompt starts with the previous generation's prompt
            skips prefilling it up to the last multiple of 64 tokens (the Gated DeltaNet chunk,
            ``CLOVER_GDN_CHUNK``) at or before that prompt's last ``<|im_start|>``, else its
            last token (``last_stats["n_prompt_reused"]``); the previous answer's tokens are
            prefilled again. Splitting the prefill only there keeps the output bit-identical to a
            full prefill's on the CPU. Off by default.
        n_parallel: decoding contexts ("slots", llama-server's -np) on the one loaded model, so
            that calls from several threads run at once, each a sequence. Each slot has its own
            caches and prefix-reuse cache; a call takes a free slot (waiting for one when all are
            taken), the one whose cache shares the most tokens with its prompt, else an empty one,
            else the least recently used. With n_parallel > 1 the slots' forwards run together
            through one continuous batch (clover.h ``clover_batch_new``, at most n_ubatch rows a
            pass, 512 when not set): each weight product once over every running sequence's rows,
            each sequence's output bit-identical to its run alone; a long prompt is prefilled in
            chunks beside the others' steps. Memory for n_parallel contexts
            (:attr:`context_bytes` each) must fit what the kernel reports available.

    Raises:
        CloverError: the native loader's message (bad file, missing/mis-shaped tensor, ...).
        ValueError: a bad argument, naming it.

    Use as a context manager or call :meth:`close` to free the native memory.

    Thread safety: with n_parallel=1 one lock serialises the calls that use the native context
    (a call from another thread waits for the running one; ``generate_stream`` holds it while it
    computes a piece, not between pieces, so another call in between interrupts that stream with
    a CloverError). With n_parallel > 1 each call holds its slot from its start to its end (a
    streaming iterator: from its first piece until it is exhausted or closed), so up to
    n_parallel calls run at once and the next waits; a thread that holds n_parallel unfinished
    streams and starts another call waits forever. :meth:`reset` and :meth:`close` wait for the
    running pieces; :meth:`cancel` (every call), :meth:`Generation.cancel` (one) and
    :meth:`close` may come from any thread at any time. :attr:`last_stats` is per thread.
    """

    def __init__(self, path=None, n_ctx: int = 4096, n_threads: int | None = None, prefix_reuse: bool = False,
                 n_gpu_layers: int = 0, n_cpu_moe: int = 0, gpu_budget: int | str | None = None,
                 type_k: str | int = "f32", type_v: str | int = "f32", plan_callback=None,
                 diffusion_path=None, n_batch: int | None = None, n_ubatch: int | None = None,
                 n_threads_batch: int | None = None, use_mlock: bool = False, use_mmap: bool = True,
                 flash_attn: bool | str | None = None, n_parallel: int = 1) -> None:
        self._model = ffi.NULL
        self._batch = ffi.NULL  # the continuous batch of the slots (n_parallel > 1)
        self._slots: list[_Slot] = []
        self._free = threading.Condition()  # guards the slots' busy flags and _uses
        self._uses = 0
        self._closing = False
        self._tls = threading.local()  # last_stats per thread
        self._last_stats: dict | None = None
        # prefix reuse (opt-in): a prompt that extends what a slot's caches hold after its last
        # generation prefills only its new tokens (chat turns, server requests)
        self.prefix_reuse = bool(prefix_reuse)
        self._cancel_lock = threading.Lock()  # guards the slots' running calls and contexts
        self._users = 0  # calls using the model and first context outside a slot (_using)
        self._unused = threading.Condition(self._cancel_lock)  # notified when _users drops to 0
        self.n_parallel = _check_int("n_parallel", n_parallel, lo=1, hi=MAX_PARALLEL)
        if path is None:
            path = DEFAULT_MODEL
        path = os.fspath(path)
        if diffusion_path is not None:
            diffusion_path = os.fspath(diffusion_path)
        n_ctx = _check_int("n_ctx", n_ctx, lo=0, hi=2**31 - 1)
        n_threads = 0 if n_threads is None else _check_int("n_threads", n_threads, lo=0, hi=4096)
        n_threads_batch = n_threads if n_threads_batch is None else \
            _check_int("n_threads_batch", n_threads_batch, lo=0, hi=4096)
        self.n_ubatch = ubatch_rows(n_batch, n_ubatch)
        if not isinstance(use_mlock, bool):
            raise ValueError(f"use_mlock: expected a bool, got {use_mlock!r}")
        if not isinstance(use_mmap, bool):
            raise ValueError(f"use_mmap: expected a bool, got {use_mmap!r}")
        compat.warn_ignored(compat.MODEL, {"use_mmap": use_mmap,
                                           "flash_attn": flash_attn is not None and _flash_attn(flash_attn)})
        n_gpu_layers = _check_int("n_gpu_layers", n_gpu_layers, lo=-1, hi=2**31 - 1)
        n_cpu_moe = _check_int("n_cpu_moe", n_cpu_moe, lo=0, hi=2**31 - 1)
        if isinstance(gpu_budget, str) and gpu_budget != "free":
            from .placement import parse_size  # "12G", as the CLI's --gpu-budget
            try:
                gpu_budget = parse_size(gpu_budget)
            except ValueError:
                raise ValueError(f'gpu_budget: {gpu_budget!r} is not "free", a byte count or a size such as 12G') \
                    from None
        if gpu_budget is not None and gpu_budget != "free":
            gpu_budget = _check_int("gpu_budget", gpu_budget, lo=1, hi=2**62)
        if plan_callback is not None and not callable(plan_callback):
            raise ValueError(f"plan_callback: expected a callable or None, got {plan_callback!r}")
        self._plan_callback = plan_callback
        self.n_ctx = n_ctx  # 0 until the model's training context is known
        self.type_k, self.type_v = cache_type("type_k", type_k), cache_type("type_v", type_v)
        self.n_gpu_layers = 0  # layers whose products run on the GPU (the output counts as one)
        self.placement: dict | None = None  # bytes per part of the GPU placement (placement.py)
        self.path = path
        err = err_buf()
        m = lib.clover_model_load_sidecar(os.fsencode(path),
                                          ffi.NULL if diffusion_path is None else os.fsencode(diffusion_path),
                                          err, len(err))
        if m == ffi.NULL:
            msg = ffi.string(err).decode("utf-8", "replace")
            raise CloverError(msg if msg.startswith(path) else f"{path}: {msg}")
        self._model = m
        if use_mlock and lib.clover_model_mlock(m, err, len(err)) != 0:
            warnings.warn(f"use_mlock: {ffi.string(err).decode('utf-8', 'replace')}{_memlock_hint()}", UserWarning,
                          stacklevel=2)
        try:
            hp = ffi.new("clover_hparams *")
            lib.clover_model_hparams(m, hp)
            self._hp = hp[0]
            self.hparams = {name: getattr(hp, name) for name, _ in ffi.typeof("clover_hparams").fields}
            for name in ("has_block", "shift_logits", "block_aligned"):
                self.hparams[name] = bool(self.hparams[name])
            self.hparams["arch"] = _ARCHES[self.hparams["arch"]]
            self.hparams["penalty_scope"] = _SCOPES[self.hparams["penalty_scope"]]
            side = lib.clover_model_sidecar_path(m)
            self.sidecar_path = None if side == ffi.NULL else os.fsdecode(ffi.string(side))
            self.n_ctx = n_ctx if n_ctx > 0 else int(self.hparams["n_ctx_train"])
            if n_gpu_layers or gpu_budget is not None:
                self.n_gpu_layers = self._offload(n_gpu_layers, n_cpu_moe, gpu_budget)
            self._new_contexts(n_threads, n_threads_batch)
            self.tokenizer = CloverTokenizer.from_handle(lib.clover_model_gguf(m))
        except BaseException:
            self.close()
            raise
        self.n_vocab = int(self.hparams["n_vocab"])
        self.end_ids = self._end_ids()
        self._chat: ChatTemplate | None = None  # compiled on first apply_chat_template

    # ------------------------------------------------------------------ basics
    @property
    def arch(self) -> str:
        """``"clover_moe"`` or ``"qwen35moe"``."""
        return self.hparams["arch"]

    @property
    def has_block(self) -> bool:
        """Whether Clover's block tensors are loaded (from the file or its sidecar): block mode,
        ``diffusion`` and ``spec`` run."""
        return self.hparams["has_block"]

    @property
    def default_mode(self) -> str:
        """The decoding mode when none is given: ``"diffusion"`` with the block tensors, else ``"ar"``."""
        return "diffusion" if self.has_block else "ar"

    def _end_ids(self) -> list[int]:
        ids = []
        for t in _END_TOKENS:
            i = self.tokenizer.token_to_id(t)
            if i is not None and i not in ids:
                ids.append(int(i))
        eos = self.tokenizer.eos_token_id
        if eos is not None and 0 <= eos < self.n_vocab and eos not in ids:
            ids.append(int(eos))
        return ids

    def _live(self):
        if self._closing or self._ctx == ffi.NULL:
            raise CloverError("model is closed")

    # ------------------------------------------------------------------ slots
    def _new_contexts(self, n_threads: int, n_threads_batch: int) -> None:
        """Create the n_parallel contexts (after :meth:`_check_memory` when there are several)
        and, for several, their batch."""
        err = err_buf()
        self.context_bytes = int(lib.clover_context_mem_required(self._model, self.n_ctx, self.type_k, self.type_v))
        if self.n_parallel > 1:
            self._check_memory()
        for i in range(self.n_parallel):
            c = lib.clover_context_new(self._model, self.n_ctx, n_threads, self.type_k, self.type_v, err, len(err))
            if c == ffi.NULL:
                raise_error(err, "creating the context" if self.n_parallel == 1
                            else f"creating context {i} of n_parallel={self.n_parallel}")
            self._slots.append(_Slot(i, c))
            lib.clover_context_set_n_threads(c, n_threads, n_threads_batch)
            lib.clover_context_set_n_ubatch(c, self.n_ubatch)
        if self.n_parallel > 1:
            b = lib.clover_batch_new(self._model, self.n_ubatch, err, len(err))
            if b == ffi.NULL:
                raise_error(err, "creating the batch")
            self._batch = b

    def _check_memory(self) -> None:
        """CloverError naming n_parallel when n_parallel contexts of :attr:`context_bytes` each
        exceed the memory the kernel reports available (clover_context_new checks one)."""
        avail = available_bytes()
        need = self.context_bytes * self.n_parallel
        if avail is not None and need > avail:
            raise CloverError(f"n_parallel: {self.n_parallel} contexts of n_ctx={self.n_ctx} need {need} bytes "
                              f"({self.n_parallel} x {self.context_bytes}), more than the {avail} bytes available; "
                              "lower n_parallel or n_ctx")

    @property
    def _ctx(self):
        """The first slot's context (the only one with n_parallel=1)."""
        return self._slots[0].ctx if self._slots else ffi.NULL

    @property
    def _active(self):
        return self._slots[0].active if self._slots else None

    def batch_stats(self) -> dict | None:
        """What the slots' batch has run (clover.h clover_batch_get_stats): ``n_passes``,
        ``n_rows``, ``n_entries`` (sequence forwards over all passes), ``n_shared`` (passes
        with two or more sequences), ``max_entries`` (most sequences in one pass); None with
        n_parallel=1."""
        with self._cancel_lock:
            if self._batch == ffi.NULL:
                return None
            st = ffi.new("clover_batch_stats *")
            lib.clover_batch_get_stats(self._batch, st)
        return {name: int(getattr(st, name)) for name, _ in ffi.typeof("clover_batch_stats").fields}

    def slot_busy(self) -> list[bool]:
        """Per slot, whether a call holds it now (a snapshot)."""
        if len(self._slots) == 1:
            return [self._slots[0].running is not None]
        with self._free:
            return [s.busy for s in self._slots]

    def _take(self, ids, key) -> _Slot:
        """A slot for a call on prompt ``ids`` of ``prompt_cache_key`` ``key``: with n_parallel=1
        the one slot (its lock serialises the calls); else a free one (waiting for one), by
        llama-server's choice: the most tokens shared with the slot's cache of the same key, then
        an empty one, then the least recently used."""
        if len(self._slots) == 1:
            return self._slots[0]
        with self._free:
            while True:
                self._live()
                free = [s for s in self._slots if not s.busy]
                if free:
                    break
                self._free.wait()
            s = max(free, key=lambda s: (s.key == key, s.shared(ids) if s.key == key else 0,
                                         not (s.cached or s.saved), -s.used))
            self._uses += 1
            s.busy, s.used = True, self._uses
            return s

    def _put(self, s: _Slot) -> None:
        if len(self._slots) > 1:
            with self._free:
                s.busy = False
                self._free.notify_all()  # a call waiting for any slot, or one waiting for this one (_hold)

    def _slot_index(self, slot) -> int:
        """The index of the slot ``slot`` names: None only with n_parallel=1 (its one slot);
        ValueError naming ``slot`` otherwise."""
        if slot is None:
            if len(self._slots) == 1:
                return 0
            raise ValueError(f"slot: required with n_parallel={self.n_parallel} (0..{self.n_parallel - 1})")
        return _check_int("slot", slot, lo=0, hi=self.n_parallel - 1)

    @contextmanager
    def _hold(self, slot) -> Iterator[_Slot]:
        """Hold the slot ``slot`` names (:meth:`_slot_index`) and its call lock, outside the batch:
        with n_parallel > 1 a call holding it is waited for, as llama-server defers a slot action
        on a busy slot."""
        s = self._slots[self._slot_index(slot)]
        if len(self._slots) > 1:
            with self._free:
                while True:
                    self._live()
                    if not s.busy:
                        break
                    self._free.wait()
                s.busy = True
        try:
            with s.lock:
                self._live()
                yield s
        finally:
            self._put(s)

    def _set_batch(self, s: _Slot, batch) -> None:
        """Attach ``s`` to the batch (NULL: detach it); nothing with n_parallel=1 or a freed context."""
        if self._batch == ffi.NULL or s.ctx == ffi.NULL:
            return
        err = err_buf()
        if lib.clover_context_set_batch(s.ctx, batch, err, len(err)) != 0:
            raise_error(err, "attaching the context to the batch" if batch != ffi.NULL else "leaving the batch")

    @contextmanager
    def _slot(self, ids=(), key=None):
        """Hold a slot (:meth:`_take`) and its call lock, attached to the batch, for a call."""
        s = self._take(ids, key)
        try:
            with s.lock:
                self._live()
                self._set_batch(s, self._batch)
                try:
                    yield s
                finally:
                    self._set_batch(s, ffi.NULL)
        finally:
            self._put(s)

    @contextmanager
    def _unlocked(self, s: _Slot):
        """Release the slot's call lock for a moment (a stream between two pieces)."""
        s.lock.release()
        try:
            yield
        finally:
            s.lock.acquire()

    @staticmethod
    def _abort_active(s: _Slot) -> None:
        """Free an unfinished decoder (a generate_stream iterator left open): every call
        that uses the slot's context resets it, so that iterator cannot continue."""
        d = s.active
        if d is not None:
            s.active = None
            lib.clover_decoder_free(d)

    @property
    def last_stats(self) -> dict | None:
        """Statistics of the last generation that ended on the calling thread (else on any
        thread): see :meth:`generate`. A streaming call's own are its :attr:`Generation.stats`."""
        st = getattr(self._tls, "stats", None)
        return st if st is not None else self._last_stats

    @last_stats.setter
    def last_stats(self, st: dict | None) -> None:
        self._tls.stats = st
        self._last_stats = st

    def close(self) -> None:
        """Free the contexts and the model (idempotent; from any thread). Calls running in
        other threads are cancelled and waited for; calls after it raise CloverError, and so
        does an unfinished generate_stream iterator of this model when resumed."""
        if not hasattr(self, "_free"):  # __init__ failed before the slots existed
            return
        self._closing = True
        with self._cancel_lock:  # the calls checking their arguments on the model finish first
            while self._users:
                self._unused.wait()
        with self._free:
            self._free.notify_all()  # calls waiting for a slot raise CloverError
        for s in self._slots:
            while not s.lock.acquire(timeout=0.05):
                self.cancel()
            try:
                self._abort_active(s)
                if s.ctx != ffi.NULL:
                    with self._cancel_lock:  # cancel() never aborts a freed context
                        if self._batch != ffi.NULL:
                            lib.clover_context_set_batch(s.ctx, ffi.NULL, ffi.NULL, 0)
                        lib.clover_context_free(s.ctx)
                        s.ctx = ffi.NULL
            finally:
                s.lock.release()
        with self._cancel_lock:
            if self._batch != ffi.NULL:
                lib.clover_batch_free(self._batch)
                self._batch = ffi.NULL
            if self._model != ffi.NULL:
                lib.clover_model_free(self._model)
                self._model = ffi.NULL

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _offload(self, n_gpu_layers: int, n_cpu_moe: int, gpu_budget) -> int:
        """Move the weight products of the first ``n_gpu_layers`` layers (-1 or more than
        n_layer: all, and the output projection) to the GPU, less the routed experts of the first
        ``n_cpu_moe`` layers; with ``gpu_budget`` the placement is :func:`placement.fit`'s.
        Without a usable GPU: a warning, the CPU. Sets :attr:`placement` (bytes per part and the
        plan line) and, with a usable GPU, passes the plan line to plan_callback before the upload;
        returns the layers offloaded; raises CloverError when the GPU cannot hold them."""
        from . import placement as P

        budget = None
        if gpu_budget is not None:
            budget = P.gpu_free_bytes() if gpu_budget == "free" else int(gpu_budget)
            if budget is None:
                warnings.warn("gpu_budget: no usable GPU reports its free memory; running on the CPU",
                              UserWarning, stacklevel=3)
                return 0
            plan = P.fit(self, budget, n_parallel=self.n_parallel)
            n_gpu_layers, n_cpu_moe = plan["n_gpu_layers"], plan["n_cpu_moe"]
        n = int(self.hparams["n_layer"]) + 1 if n_gpu_layers < 0 else n_gpu_layers
        self.placement = P.placement(self, n, n_cpu_moe, n_parallel=self.n_parallel)
        if budget is not None:
            self.placement["budget"] = budget
        self.placement["plan"] = P.describe(self.placement, int(self.hparams["n_layer"]))
        info = ffi.new("char[]", 256)
        if n == 0 or lib.clover_gpu_devices(info, len(info)) <= 0:
            if n:
                asked = f"gpu_budget's plan, n_gpu_layers={n}" if budget is not None else f"n_gpu_layers={n_gpu_layers}"
                if n > int(self.hparams["n_layer"]):
                    asked += " (every layer and the output)"
                warnings.warn(f"{asked}: {ffi.string(info).decode('utf-8', 'replace')}; running on the CPU",
                              UserWarning, stacklevel=3)
            return 0
        if self._plan_callback is not None:
            self._plan_callback(self.placement["plan"])
        err = err_buf()
        rc = lib.clover_model_offload(self._model, n, n_cpu_moe, err, len(err))
        if rc < 0:
            raise_error(err, "offloading to the GPU")
        return int(rc)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"Model({self.path!r}, arch={self.arch}, n_ctx={self.n_ctx})"

    # ------------------------------------------------------------------ tokens
    def metadata(self, arrays: bool = False) -> dict:
        """The GGUF's key-value metadata in file order (arrays such as the vocabulary only with
        ``arrays=True``)."""
        with self._cancel_lock:  # close() frees the model under it
            self._live()
            return read_metadata(lib.clover_model_gguf(self._model), arrays=arrays)

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        """Token ids of ``text`` (list of int, no BOS). ``special=True`` recognises control
        tokens such as ``<|im_start|>`` written in the text."""
        return self.tokenizer.encode(text, special=special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of ``ids`` (invalid UTF-8 becomes U+FFFD). Raises ValueError for an id out
        of range."""
        return self.tokenizer.decode(self.check_ids("ids", ids, allow_empty=True), skip_special)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None,
                            **kwargs) -> str:
        """Prompt text for ``messages`` from the GGUF's ``tokenizer.chat_template``, rendered
        as transformers' ``apply_chat_template(..., tokenize=False)`` does (see
        :mod:`clover_gguf.chat`; unlike transformers, ``add_generation_prompt`` defaults to
        True). ``tools``: list of JSON-schema dicts; extra keywords (``enable_thinking=False``)
        reach the template. Raises ValueError if the GGUF has no template, for a bad message
        (naming the field) or for an error the template raises."""
        if self._chat is None:
            self._chat = ChatTemplate.for_tokenizer(self.tokenizer)
        return self._chat.render(messages, add_generation_prompt=add_generation_prompt,
                                 tools=tools, **kwargs)

    def check_ids(self, name, ids, allow_empty=False) -> list[int]:
        """``ids`` as a list of ints, each a token id in [0, n_vocab); ValueError naming ``name``
        (and the index) otherwise, or when empty unless ``allow_empty``."""
        if isinstance(ids, (str, bytes)):
            raise ValueError(f"{name}: expected a sequence of token ids, got {type(ids).__name__}")
        try:
            out = list(ids)
        except TypeError:
            raise ValueError(f"{name}: expected a sequence of integer token ids") from None
        for k, i in enumerate(out):  # no silent int() of 1.5, "7" or True
            if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer)):
                raise ValueError(f"{name}[{k}]: expected an integer token id, got {i!r}")
        out = [int(i) for i in out]
        if not out and not allow_empty:
            raise ValueError(f"{name}: empty")
        for k, i in enumerate(out):
            if not 0 <= i < self.n_vocab:
                raise ValueError(f"{name}[{k}]: token id {i} out of range [0, {self.n_vocab})")
        return out

    def check_text_fits(self, name: str, text: str) -> None:
        """ValueError naming ``name`` when ``text`` is not valid Unicode, ContextLengthExceeded
        when it has more UTF-8 bytes than n_ctx tokens can spell: refused before tokenizing."""
        size = _utf8_size(name, text)
        most = self.n_ctx * self.tokenizer.max_token_bytes
        if size > most:
            raise ContextLengthExceeded(
                f"{name}: {size} bytes cannot fit n_ctx={self.n_ctx} tokens (the longest token is "
                f"{self.tokenizer.max_token_bytes} bytes)")

    def prompt_ids(self, prompt, name: str = "prompt", bounded: bool = True) -> list[int]:
        """The token ids of ``prompt``: a str tokenized (special tokens recognised) or a sequence
        of ids checked by :meth:`check_ids`; ValueError naming ``name`` when empty or not valid
        Unicode. ``bounded``: a text longer than n_ctx tokens can spell is refused before
        tokenizing (:meth:`check_text_fits`); False for callers that truncate."""
        if isinstance(prompt, str):
            if bounded:
                self.check_text_fits(name, prompt)
            else:
                _utf8_size(name, prompt)
            ids = self.tokenize(prompt)
            if not ids:
                raise ValueError(f"{name}: empty (at least one token is needed)")
            return ids
        return self.check_ids(name, prompt)

    # ------------------------------------------------------------------ generation
    def check_prompt_fits(self, ids: list[int]) -> list[int]:
        """``ids`` if they leave room for generation in the context, else ContextLengthExceeded."""
        self._live()
        if len(ids) >= self.n_ctx:
            raise ContextLengthExceeded(f"prompt: {len(ids)} tokens leave no room in n_ctx={self.n_ctx}")
        return ids

    @contextlib.contextmanager
    def _using(self):
        """Use the model and the first context outside a slot (the engine's argument checks):
        CloverError once closed; :meth:`close` frees them only after."""
        with self._cancel_lock:
            self._live()
            self._users += 1
        try:
            yield
        finally:
            with self._cancel_lock:
                self._users -= 1
                if self._users == 0:
                    self._unused.notify_all()

    def _params(self, o: GenerateOptions, end_ids=None):
        """The engine's parameters for options ``o`` (each field checked here, naming it);
        ``end_ids`` None: :attr:`end_ids`. Returns (params, arrays they point to, mode, end ids)."""
        with self._using():
            return self._params_of(o, end_ids)

    def _params_of(self, o: GenerateOptions, end_ids):
        p = ffi.new("clover_gen_params *")
        lib.clover_gen_params_default(self._model, p)
        mode = o.mode
        if mode is None:
            mode = self.default_mode
        if not isinstance(mode, str) or mode not in _MODES:
            raise ValueError(f"mode: {mode!r} not one of {sorted(_MODES)}")
        err = err_buf()
        if lib.clover_model_check_mode(self._model, _MODES[mode], err, len(err)) != 0:
            raise ValueError(ffi.string(err).decode("utf-8", "replace"))
        p.mode = _MODES[mode]
        p.max_tokens = _as_int("max_tokens", o.max_tokens)
        p.temperature = _as_number("temperature", o.temperature)
        p.top_k = _as_int("top_k", o.top_k)
        p.top_p = _as_number("top_p", o.top_p)
        p.seed = _as_int("seed", o.seed, 0, 2**64 - 1)
        if o.block_size is not None:
            p.block_size = _as_int("block_size", o.block_size)
        if o.threshold is not None:
            p.threshold = _as_number("threshold", o.threshold)
        if o.coreset_top_p is not None:
            p.coreset_top_p = _as_number("coreset_top_p", o.coreset_top_p)
        ends = self.end_ids if end_ids is None else self.check_ids("end_ids", end_ids, allow_empty=True)
        keep = ffi.new("int32_t[]", max(len(ends), 1))
        for k, t in enumerate(ends):
            keep[k] = t
        p.end_ids = keep
        p.n_end_ids = len(ends)
        if o.logprobs is not None:
            p.logprobs = _as_int("logprobs", o.logprobs)
        keep = (keep, self._set_sampling(p, o), self._constraint(p, o, ends))
        if lib.clover_gen_params_check(self._ctx, p, err, len(err)) != 0:  # every value, by name
            raise ValueError(ffi.string(err).decode("utf-8", "replace"))
        return p, keep, mode, ends

    def _constraint(self, p, o: GenerateOptions, ends) -> Constraint | None:
        """Point ``p`` at the constraint of ``o.grammar`` / ``o.json_schema`` (None: none), compiled
        over the tokenizer with ``ends`` as its end tokens; ValueError naming the field that does
        not compile."""
        if o.grammar is None and o.json_schema is None:
            return None
        field, source = grammar_source(o.grammar, o.json_schema)
        cons = Constraint(field, source, ll_tokenizer(self.tokenizer, self.n_vocab, ends), self.n_vocab)
        p.constraint = cons.c
        return cons

    def _set_sampling(self, p, o: GenerateOptions):
        """Set the spec 5.3-5.4 fields of ``p`` (converted; the engine checks their values); None
        keeps clover_gen_params_default's value (the GGUF's decoding record). Returns the arrays
        ``p`` points to (they must live as long as ``p``)."""
        fields = (("min_p", "min_p", _as_number), ("presence_penalty", "presence_penalty", _as_number),
                  ("repeat_penalty", "repetition_penalty", _as_number),
                  ("frequency_penalty", "frequency_penalty", _as_number),
                  ("think_close_bias_start", "think_close_bias_start", _as_int),
                  ("eos_bias_start", "eos_bias_start", _as_int), ("bias_slope", "bias_slope", _as_number),
                  ("bias_max", "bias_max", _as_number))
        for name, c_name, conv in fields:
            if getattr(o, name) is not None:
                setattr(p, c_name, conv(name, getattr(o, name)))
        logit_bias = {} if o.logit_bias is None else o.logit_bias
        if not hasattr(logit_bias, "items"):
            raise ValueError(f"logit_bias: expected a dict {{token id: bias}}, got {type(logit_bias).__name__}")
        ids, vals = [], []
        for k, v in logit_bias.items():
            if isinstance(k, str):  # OpenAI's JSON form: {"50256": -100}
                try:
                    k = int(k)
                except ValueError:
                    raise ValueError(f"logit_bias: key {k!r} is not a token id") from None
            t = _as_int("logit_bias key", k)
            ids.append(t)
            vals.append(_as_number(f"logit_bias[{t}]", v))
        bias_ids = ffi.new("int32_t[]", ids or [0])
        bias_vals = ffi.new("float[]", vals or [0.0])
        p.logit_bias_ids = bias_ids
        p.logit_bias_values = bias_vals
        p.n_logit_bias = len(ids)
        return bias_ids, bias_vals

    def check_generate_args(self, end_ids: Sequence[int] | None = None, **options) -> None:
        """Validate the options of :meth:`generate` / :meth:`generate_tokens` (all but the
        prompt; :class:`~clover_gguf.options.GenerateOptions`) without generating: the same
        checks a call makes, so a front end (``chat``) can refuse bad settings before its first
        prompt. Raises ValueError naming the field, TypeError for an unknown option."""
        self._live()
        o = GenerateOptions.of(options)
        check_stop(o.stop)
        self._params(o, end_ids)

    @staticmethod
    def _block_state(d, cap):
        """(block_ids, filled) of the diffusion block being denoised, or None."""
        bt = ffi.new("int32_t[]", cap)
        bf = ffi.new("uint8_t[]", cap)
        n = lib.clover_decoder_block(d, bt, bf, cap)
        return ([int(bt[k]) for k in range(n)], [bool(bf[k]) for k in range(n)]) if n else None

    def _steps(self, prompt_ids, p, mode, run: _Run | None = None, key=None, on_step=None, hold=False) \
            -> Iterator[tuple[list[int], list | None]]:
        """:meth:`_decode` on a slot (:meth:`_slot`), holding its call lock except while a step's
        tokens are handed out (``hold``: also then, for a whole call such as :meth:`generate`)."""
        with self._slot(prompt_ids, key) as s:
            yield from self._decode(s, prompt_ids, p, mode, run or _Run(), key, on_step, hold)

    def _end(self, run: _Run, stats: dict) -> None:
        """Record ``stats`` as ``run``'s and as :attr:`last_stats`."""
        run.stats = stats
        self.last_stats = stats

    def _decode(self, s: _Slot, prompt_ids, p, mode, run: _Run, key=None, on_step=None, hold=False) \
            -> Iterator[tuple[list[int], list | None]]:
        """Run the native decoder on slot ``s``; yield each step's newly final tokens and, with
        ``p.logprobs`` >= 0, their :meth:`_logprobs` (else None); set ``run.stats`` and
        last_stats. A slot last used with another ``key`` starts from an empty context.
        A :meth:`cancel` (or an aborted forward) ends it early with ``finish_reason``
        ``"cancelled"``; the tokens final by then stay in the stats."""
        n = len(prompt_ids)
        err = err_buf()
        prompt = ffi.new("int32_t[]", prompt_ids)
        self._live()
        self._abort_active(s)
        if key != s.key:  # prefix reuse stays within a key
            lib.clover_context_reset(s.ctx)
            s.cached, s.saved, s.key = [], [], key
        cached, s.cached = s.cached, []
        s.ids = list(prompt_ids)
        with self._cancel_lock:
            s.running, run.slot = run, s
        try:
            t0 = time.perf_counter()
            if run.cancelled:  # Generation.cancel() before the start: no prefill
                self.record_cancelled(n, mode, run)
                return
            limit = n // p.block_size * p.block_size if mode == "diffusion" and self.hparams["block_aligned"] else n
            p.n_reuse, reused = self._reuse_prefix(s, prompt_ids, cached, limit, err) if self.prefix_reuse else (0, 0)
            d = ffi.NULL if p.n_reuse < 0 else lib.clover_decoder_new(s.ctx, p, prompt, n, err, len(err))
            if d == ffi.NULL:
                if run.cancelled or p.n_reuse < 0:  # the prefill was aborted: no forward completed
                    st = ffi.new("clover_stats *")
                    st.n_prompt = n
                    seconds = time.perf_counter() - t0
                    self._end(run, self._stats_dict(st, mode, seconds, seconds, []))
                    run.stats["finish_reason"] = "cancelled"
                    return
                raise_error(err, "generate")
            s.active = d
            t_prefill = time.perf_counter() - t0
            cap = max(int(p.block_size), 1)  # a step yields at most one block
            out = ffi.new("int32_t[]", cap)
            n_out = ffi.new("int32_t *")
            lp_bufs = self._logprob_buffers(cap, int(p.logprobs))
            tokens: list[int] = []
            cancelled = False
            try:
                while True:
                    if s.active is not d:
                        self._live()
                        raise CloverError("generation interrupted: another call on this model "
                                          "(generate, prefix_logits, block_logits or close) reset its context")
                    if run.cancelled:
                        cancelled = True
                        break
                    n_out[0] = 0
                    rc = lib.clover_decoder_step(d, out, cap, n_out, err, len(err))
                    if rc < 0:
                        if rc == lib.CLOVER_E_ABORTED or run.cancelled:
                            cancelled = True  # the step's tokens are dropped with the decoder
                            break
                        raise_error(err, "generate")
                    new = [int(out[k]) for k in range(n_out[0])]
                    tokens.extend(new)
                    lps = self._logprobs(d, lp_bufs, cap, len(new)) if lp_bufs else None
                    if on_step is not None:
                        on_step(new, self._block_state(d, cap))
                    if new and hold:
                        yield new, lps
                    elif new:
                        with self._unlocked(s):
                            yield new, lps
                    if rc == 0:
                        break
            finally:
                if s.active is d:
                    seconds = time.perf_counter() - t0
                    st = ffi.new("clover_stats *")
                    lib.clover_decoder_stats(d, st)
                    s.active = None
                    lib.clover_decoder_free(d)
                    s.ids = list(prompt_ids) + tokens
                    # the caches hold the prompt's prefill alone (a committed token ran as a decode
                    # step or block commit, which a prefill does not reproduce bit for bit)
                    if not cancelled and lib.clover_context_n_past(s.ctx) == limit:
                        s.cached = list(prompt_ids[:limit])
                    stats = self._stats_dict(st, mode, seconds, t_prefill, tokens)
                    stats["n_prompt_reused"] = reused
                    stats["id_slot"] = s.index  # llama-server's name
                    if cancelled:
                        stats["finish_reason"] = "cancelled"
                    self._end(run, stats)
        finally:
            with self._cancel_lock:
                if s.running is run:
                    s.running, run.slot = None, None

    @staticmethod
    def _logprob_buffers(cap: int, n_top: int):
        """clover_decoder_logprobs' arrays for steps of up to ``cap`` tokens (None: logprobs off)."""
        if n_top < 0:
            return None
        return ffi.new("float[]", cap), ffi.new("int32_t[]", max(cap * n_top, 1)), \
            ffi.new("float[]", max(cap * n_top, 1)), n_top

    @staticmethod
    def _logprobs(d, bufs, cap: int, n: int) -> list[tuple[float, list[tuple[int, float]]]]:
        """The last step's ``n`` tokens' (logprob, [(id, logprob) of the most likely ids]) (clover.h
        clover_decoder_logprobs)."""
        lp, ids, top, k = bufs
        got = lib.clover_decoder_logprobs(d, lp, ids, top, cap)
        if got != n:
            raise CloverError(f"logprobs: the decoder recorded {got} tokens for a step of {n}")
        return [(float(lp[i]), [(int(ids[i * k + q]), float(top[i * k + q])) for q in range(k)]) for i in range(n)]

    def _reuse_prefix(self, s: _Slot, ids, cached, limit, err) -> tuple[int, int]:
        """Prefix reuse (``prefix_reuse=True``): put the caches in the state of a prefix of ``ids``
        of at most ``limit`` tokens (what the decoder prefills: with aligned diffusion blocks the
        prompt up to its last block boundary, spec 3.1) and return ``(n_reuse for the decoder,
        prompt tokens not prefilled)``; ``(-1, 0)`` when a cancel() stopped the prefill here.

        Reuse is invisible: the prefill is only ever split where the result equals one prefill
        bit for bit (clover.h CLOVER_GDN_CHUNK): at a multiple of the GDN chunk, leaving the
        decoder's call none or at least 2 tokens (``aligned`` below). Reused: the prompt tokens
        the caches hold after the last generation (``cached``: its prefill alone, set by _steps)
        when ``ids`` extends them and their end is such a point; else the prompt prefix saved at
        the last generation's split point when ``ids`` starts with it
        (clover_context_restore_state: the GDN state cannot be rewound, so it is saved there).
        The split point of a prompt is its last ``<|im_start|>`` (where a chat template starts
        the reply; the rendered history before it stays the same in the next turn even when the
        template rewrites the reply, e.g. drops its reasoning), else its last token, moved down
        to the nearest such point. The tokens up to it are prefilled here and the state saved."""
        def aligned(pos: int) -> int:  # the largest invisible split <= pos
            s = pos // lib.CLOVER_GDN_CHUNK * lib.CLOVER_GDN_CHUNK
            return s - lib.CLOVER_GDN_CHUNK if limit - s == 1 and s > 0 else s

        n, k, saved = len(ids), len(cached), len(s.saved)
        start = 0
        if 0 < k <= limit and k < n and aligned(k) == k and lib.clover_context_n_past(s.ctx) == k \
                and list(ids[:k]) == cached:
            start = k
        elif 0 < saved <= limit and saved < n and aligned(saved) == saved and list(ids[:saved]) == s.saved:
            start = max(0, int(lib.clover_context_restore_state(s.ctx, err, len(err))))
        if start == 0:
            lib.clover_context_reset(s.ctx)
            s.saved = []
        im_start = self.tokenizer.token_to_id("<|im_start|>")
        split = aligned(min(max((i for i, t in enumerate(ids) if t == im_start), default=0) or n - 1, limit))
        if split <= start:
            return start, start
        toks = ffi.new("int32_t[]", list(ids[start:split]))
        rc = lib.clover_prefill(s.ctx, toks, split - start, ffi.NULL, 0, err, len(err))
        if rc != 0:
            s.saved = []
            if rc == lib.CLOVER_E_ABORTED:
                return -1, 0
            raise_error(err, "generate")
        s.saved = list(ids[:split]) if lib.clover_context_save_state(s.ctx, err, len(err)) == 0 else []
        return split, start

    def cancel(self) -> bool:
        """Stop the generations in progress (``generate``, ``generate_tokens``, started
        ``generate_stream`` iterators, ``embed``; every slot's) from another thread.

        The native forward running now (prompt prefill, denoising pass, commit or decode step)
        stops before its next layer (``clover_context_abort``), and the generation returns
        what was final before it, with ``last_stats["finish_reason"]`` ``"cancelled"``. The
        context is left clean for the next call. Returns True if a generation was running,
        False (and does nothing) otherwise: it never affects a later call. One generation
        alone: :meth:`Generation.cancel`."""
        with self._cancel_lock:
            runs = [s.running for s in self._slots if s.running is not None]
        return any([self._cancel_run(r) for r in runs])

    def _cancel_run(self, run: _Run) -> bool:
        """Cancel ``run`` (abort its slot's forward); False when it has ended."""
        with self._cancel_lock:
            if run.stats is not None:
                return False
            run.cancelled = True
            s = run.slot
            if s is not None and s.running is run and s.ctx != ffi.NULL:
                lib.clover_context_abort(s.ctx)
            return True

    def reset(self, slot=None) -> int:
        """Empty the caches: every slot's (``slot`` None), or slot ``slot``'s alone (0..n_parallel-1;
        waited for while a call holds it, as :meth:`save_state`). The next generations there
        prefill their whole prompts (prefix reuse starts over). Waits for each slot's running piece;
        interrupts unfinished ``generate_stream`` iterators. Returns the tokens the emptied caches
        held (llama-server's ``n_erased``)."""
        if slot is not None:
            with self._hold(slot) as s:
                return self._reset(s)
        n = 0
        for s in self._slots:
            with s.lock:
                self._live()
                n += self._reset(s)
        return n

    def _reset(self, s: _Slot) -> int:
        n = int(lib.clover_context_n_past(s.ctx))
        self._abort_active(s)
        lib.clover_context_reset(s.ctx)
        s.cached, s.saved, s.ids = [], [], []
        return n

    def save_state(self, slot=None) -> bytes:
        """A slot's state as bytes (llama-cpp-python's ``save_state``; format:
        :mod:`clover_gguf.state`): the caches (clover.h ``clover_state_get_data``: KV rows, GDN
        and conv states, the state saved at the last prompt's split point) and the tokens prefix
        reuse compares prompts with, so that after :meth:`load_state`, into any slot of this object
        or of another ``Model`` of the same file, cache types and an n_ctx that holds them, the
        next generation there runs as it would have run here (a prompt that extends the saved one
        reuses its prefix).

        ``slot``: the slot (0..n_parallel-1); with n_parallel=1 it may be left out, with more it is
        required (ValueError naming ``slot``). While a call holds the slot (n_parallel > 1) this
        waits for it to end, as llama-server defers a slot action on a busy slot; a thread that
        holds the slot's unfinished ``generate_stream`` iterator itself therefore waits forever.
        With n_parallel=1 an unfinished iterator raises CloverError instead."""
        with self._hold(slot) as s:
            return self._save_state(s)

    def _save_state(self, s: _Slot) -> bytes:
        if s.active is not None:
            raise CloverError("save_state: a generation is in progress on this model (an unfinished "
                              "generate_stream iterator): exhaust or close it first")
        n_past = int(lib.clover_context_n_past(s.ctx))
        ids = s.ids[:n_past]
        if len(ids) != n_past:
            raise CloverError(f"save_state: the context holds {n_past} tokens, {len(ids)} of them known here "
                              "(the engine was driven directly)")
        size = int(lib.clover_state_get_size(s.ctx))
        if size < 0:
            raise CloverError(f"save_state: the state's size overflows (code {size})")
        engine = bytearray(size)
        err = err_buf()
        if lib.clover_state_get_data(s.ctx, ffi.from_buffer("uint8_t[]", engine), size, err, len(err)) < 0:
            raise_error(err, "save_state")
        return pack_state(ids, s.cached, s.saved, engine)

    def load_state(self, state: bytes, slot=None, prompt_cache_key=None) -> None:
        """Put a slot in the state of :meth:`save_state`'s bytes (saved from any slot). ValueError
        naming ``state`` when they are not such bytes (truncated, corrupted) or do not fit this
        model (another model file, other ``type_k``/``type_v``, more tokens than ``n_ctx``); the
        slot is then unchanged. Interrupts an unfinished ``generate_stream`` iterator (n_parallel=1).
        ``slot``: as :meth:`save_state` (required with n_parallel > 1; a call holding it is waited
        for). ``prompt_cache_key``: the key whose calls reuse the loaded prefix (as
        :meth:`generate`'s; None: calls without one); with n_parallel > 1 a call of that key whose
        prompt extends the saved one takes this slot."""
        with self._hold(slot) as s:
            self._load_state(s, state)
            s.key = prompt_cache_key

    def _load_state(self, s: _Slot, state) -> None:
        ids, cached, saved, engine = unpack_state(state, self.n_vocab)
        self._abort_active(s)
        err = err_buf()
        rc = lib.clover_state_set_data(s.ctx, ffi.from_buffer("uint8_t[]", engine), len(engine), err, len(err))
        if rc in (lib.CLOVER_E_ARG, lib.CLOVER_E_STATE):
            msg = ffi.string(err).decode("utf-8", "replace")
            raise ValueError(msg if msg.startswith("state") else f"state: {msg}")
        if rc < 0:
            raise_error(err, "load_state")
        n_past = int(lib.clover_context_n_past(s.ctx))
        if n_past != len(ids):
            lib.clover_context_reset(s.ctx)
            s.cached, s.saved, s.ids = [], [], []
            raise ValueError(f"state: {len(ids)} token ids for {n_past} cached tokens (the context is reset)")
        s.ids, s.cached, s.saved = ids, cached, saved

    def record_cancelled(self, n_prompt: int, mode: str, run: _Run | None = None) -> dict:
        """Set :attr:`last_stats` (and ``run``'s) for a generation cancelled before its prefill
        started; returns them."""
        st = ffi.new("clover_stats *")
        st.n_prompt = n_prompt
        stats = self._stats_dict(st, mode, 0.0, 0.0, [])
        stats.update(finish_reason="cancelled", stop_string=None)
        self._end(run or _Run(), stats)
        return stats

    def _stats_dict(self, st, mode, seconds, t_prefill, tokens) -> dict:
        n_forward = int(st.n_forward_prefill + st.n_forward_denoise + st.n_forward_commit
                        + st.n_forward_decode + st.n_forward_draft + st.n_forward_verify)
        n_gen = int(st.n_generated)
        n_layer = int(self.hparams["n_layer"])
        den = int(st.n_forward_denoise + st.n_forward_draft)  # block-mode (coreset) passes
        hist = [int(st.accept_hist[i]) for i in range(lib.CLOVER_ACCEPT_HIST)]
        while hist and hist[-1] == 0:
            hist.pop()
        return {
            "mode": mode,
            "n_prompt": int(st.n_prompt),
            "n_prompt_reused": int(st.n_prompt_reused),  # prefix reuse: prompt tokens not prefilled
            "n_generated": n_gen,
            "n_forward": n_forward,
            "n_forward_prefill": int(st.n_forward_prefill),
            "n_forward_denoise": int(st.n_forward_denoise),
            "n_forward_commit": int(st.n_forward_commit),
            "n_forward_decode": int(st.n_forward_decode),
            "n_forward_draft": int(st.n_forward_draft),
            "n_forward_verify": int(st.n_forward_verify),
            "accept_hist": hist,  # spec: verifies that accepted 0, 1, 2, ... drafted tokens
            "n_blocks": int(st.n_blocks),
            "sum_distinct_experts": int(st.sum_distinct_experts),
            "mean_distinct_experts": (st.sum_distinct_experts / (den * n_layer)) if den and n_layer else None,
            "max_distinct_experts": int(st.max_distinct_experts) if den else None,
            # the same passes without the coreset restriction (spec 5.6)
            "mean_distinct_experts_full": (st.sum_distinct_experts_full / (den * n_layer)) if den and n_layer else None,
            "max_distinct_experts_full": int(st.max_distinct_experts_full) if den else None,
            "tokens_per_forward": n_gen / n_forward if n_forward else 0.0,
            "seconds": seconds,
            "prefill_seconds": t_prefill,
            "tokens_per_second": n_gen / seconds if seconds > 0 else 0.0,
            "finish_reason": _FINISH.get(int(st.finish_reason), None),
            "tokens": list(tokens),
        }

    def generate_tokens(self, prompt_ids: Sequence[int], end_ids: Sequence[int] | None = None,
                        prompt_cache_key=None, **options):
        """Generate from token ids (spec 5.1-5.3, 5.6).

        Returns ``(ids, stats)``: the generated token ids (the end token included when
        generation stopped on one) and the stats dict of :attr:`last_stats`.
        ``mode`` None means ``"diffusion"`` for a clover GGUF, ``"ar"`` for qwen35moe;
        ``block_size``/``threshold``/``coreset_top_p`` None take the GGUF defaults (spec 4.2);
        ``end_ids`` None means ``<|im_end|>``, ``<|endoftext|>`` and the GGUF eos.
        ``options``: as :meth:`generate`.
        ``stop``: stop strings as in :meth:`generate`, matched on the text of the ids (end
        tokens not written). Tokens cannot be cut inside, so on a match ``ids`` end with the
        token that completes the stop string: ``detokenize(ids)`` is the text :meth:`generate`
        returns, then the stop string, then whatever else that last token spells;
        ``stats["stop_string"]`` is the matched string, ``stats["finish_reason"]`` ``"stop"``
        and ``stats["tokens"]`` equals ``ids`` (``stats["n_generated"]`` stays the decoder's
        own count of committed tokens: in diffusion mode it may include the rest of the
        block that holds the stop string).
        ``prompt_cache_key``: as :meth:`generate`.
        Raises ValueError for a bad argument (naming it), CloverError for an engine error.
        """
        ids = self.check_prompt_fits(self.check_ids("prompt_ids", prompt_ids))
        o = GenerateOptions.of(options)
        stops = check_stop(o.stop)
        p, keep, mode, ends = self._params(o, end_ids)
        out: list[int] = []
        lps: list = []
        run = _Run()
        for _, new, lp in self._run(ids, p, keep, mode, set(ends), stops, run, prompt_cache_key, text=bool(stops),
                                    hold=True):
            out.extend(new)
            lps.extend(lp or ())
        stats = dict(run.stats)
        if o.logprobs is not None:
            stats["logprobs"] = lps
        return out, stats

    def generate_stream(self, prompt, on_step=None, prompt_cache_key=None, **options) -> Generation:
        """Like :meth:`generate`, but yields text as tokens become final (per AR token, per
        diffusion denoising pass: the filled slots contiguous with the block's final start, per
        spec verify). Pieces never split a UTF-8 character; end tokens
        are not written. With ``stop``, text that could still be the start of a stop string
        is held back until it cannot match any more, so no piece ever holds any part of the
        stop string; the pieces concatenate to what :meth:`generate` returns.
        :attr:`last_stats` is set when the iterator ends (or is closed); the returned
        :class:`Generation` has them as ``stats`` and cancels this generation alone with ``cancel()``.
        ``on_step`` (optional) is called after every decoder step with ``(new_ids, block)``:
        the step's final token ids and, in diffusion mode while a block is being denoised,
        ``(block_ids, filled)`` (lists of block_size; unfilled slots hold the mask id), else
        None; it is how ``clover-gguf run --visual`` draws the block.
        Arguments are validated before the first piece is requested; the slot is taken at the
        first piece."""
        ids = self.check_prompt_fits(self.prompt_ids(prompt))
        o = GenerateOptions.of(options)
        stops = check_stop(o.stop)
        p, keep, mode, ends = self._params(o)
        run = _Run()
        return Generation(self, run, self._stream(ids, p, keep, mode, set(ends), stops, run, prompt_cache_key,
                                                  on_step))

    def _stream(self, ids, p, keep, mode, ends, stops, run, key, on_step=None, hold=False) -> Iterator[str]:
        for piece, _, _ in self._run(ids, p, keep, mode, ends, stops, run, key, on_step=on_step, hold=hold):
            if piece:
                yield piece

    def generate_pieces(self, prompt, prompt_cache_key=None, **options) -> Generation:
        """Like :meth:`generate_stream`, yielding ``(piece, tokens, logprobs)`` per decoder step:
        the text piece ("" when text is held back), the step's tokens (end tokens included) and,
        with the ``logprobs`` option (N >= 0), per token ``(logprob, [(id, logprob)] * N)`` (clover.h
        clover_decoder_logprobs), else None."""
        ids = self.check_prompt_fits(self.prompt_ids(prompt))
        o = GenerateOptions.of(options)
        stops = check_stop(o.stop)
        p, keep, mode, ends = self._params(o)
        run = _Run()
        return Generation(self, run, self._run(ids, p, keep, mode, set(ends), stops, run, prompt_cache_key))

    def _run(self, ids, p, keep, mode, ends, stops, run: _Run | None = None, key=None, text=True, on_step=None,
             hold=False) -> Iterator[tuple[str, list[int], list | None]]:
        """Drive :meth:`_steps` and apply the stop strings (see :mod:`clover_gguf.stops`).

        Yields ``(piece, tokens, logprobs)`` per decoder step (``piece`` is "" when ``text`` is
        False and there are no stops; ``logprobs`` as :meth:`generate_pieces`) and a last
        ``(tail, tokens, logprobs)`` for text held back until the end (and, on a stop string, the
        tokens of the step that completed it). A constraint's failure is raised as a CloverError
        with the grammar's message.
        On a stop string the decoder is freed at once (no further blocks or tokens) and
        ``tokens`` end with the token that completed it. Afterwards :attr:`last_stats` has
        ``stop_string`` (the matched string or None); on a match ``finish_reason`` is
        ``"stop"`` and ``tokens`` the kept ids."""
        det = self.tokenizer.stream() if (text or stops) else None
        filt = StopFilter(stops) if stops else None
        kept: list[int] = []
        run = run or _Run()
        steps = self._steps(ids, p, mode, run, key, on_step, hold)
        tail, tail_ids, tail_lps = "", [], None
        cons = keep[2]
        try:
            for new, lps in steps:
                if filt is None:
                    piece = det.add([t for t in new if t not in ends]) if det is not None else ""
                else:
                    # token by token, so that the token completing a stop string is known
                    for k, t in enumerate(new):
                        if t not in ends and filt.push(det.add([t])):
                            new = new[:k + 1]
                            lps = lps[:k + 1] if lps is not None else None
                            break
                    piece = filt.take()
                kept.extend(new)
                if filt is not None and filt.matched is not None:
                    tail, tail_ids, tail_lps = piece, new, lps  # handed out once the decoder is freed
                    break
                yield piece, new, lps
            else:
                if det is not None:
                    tail = det.flush()
                if filt is not None:
                    filt.push(tail)
                    tail = filt.flush()
        except CloverError as e:
            if cons is not None and cons.error:
                raise CloverError(f"{e} ({cons.error})") from None
            raise
        finally:
            steps.close()  # frees the decoder now when a stop string ended generation
            st = run.stats
            if st is not None:
                matched = filt.matched if filt is not None else None
                st["stop_string"] = matched
                if matched is not None:
                    st["finish_reason"] = "stop"
                    st["tokens"] = list(kept)
        if tail or tail_ids:
            yield tail, tail_ids, tail_lps
        del keep  # the end-id and bias arrays must live as long as the decoder

    def generate(self, prompt, prompt_cache_key=None, **options) -> str:
        """Generate text after ``prompt`` (a str, tokenized with special tokens recognised,
        or a sequence of token ids) and return it, without the end token.

        Spec 5.2 (diffusion) / 5.1 (ar); greedy at ``temperature=0``; a ``seed`` makes
        sampling reproducible. Statistics of the run are in :attr:`last_stats`
        (``n_forward``, ``tokens_per_forward``, ``seconds``, ``tokens_per_second``,
        ``finish_reason`` ``"stop"``/``"length"``, ``stop_string``, ``tokens``...).
        ``options``: the fields of :class:`~clover_gguf.options.GenerateOptions` as keyword
        arguments (``max_tokens`` 256, ``mode`` None: diffusion for clover, ar for qwen35moe,
        ``temperature``, ``top_k``, ``top_p``, ``seed``; ``block_size``, ``threshold``,
        ``coreset_top_p`` None: the GGUF defaults, spec 4.2; an unknown name raises TypeError).
        Sampling and penalties (spec 5.3-5.4; None = the engine default): ``min_p`` (0 = off),
        ``presence_penalty`` (GGUF default, 0.9; 0 = off), ``repeat_penalty`` (GGUF default,
        1.05; 1 = off), ``frequency_penalty`` (0 = off), ``logit_bias`` (dict token id ->
        additive logit), and the soft-bias ramps ``min(bias_max, bias_slope * max(0, n -
        start))`` toward ``</think>`` (from ``think_close_bias_start``, while a thinking section
        is open) and the end tokens (from ``eos_bias_start``) at generated index n (starts:
        GGUF defaults 4096 / 8192; ``bias_slope`` 0.01, ``bias_max`` 10). Penalties only
        reweight logits, they never stop generation.
        ``stop``: a str or a list of at most 16 non-empty str (OpenAI / llama-cpp-python
        semantics). Matched on the final text only, across decoder steps (a stop string may
        span two diffusion blocks); generation ends as soon as one is complete (the decoder
        stops, no further block is generated) and the text is cut right before it. The
        first stop string to be completed wins (on a tie, the longer one). Then
        ``last_stats["finish_reason"]`` is ``"stop"`` and ``last_stats["stop_string"]`` the
        matched string (None otherwise); ``"length"`` means max_tokens or the context ended
        it; an end token also gives ``"stop"``; ``"cancelled"`` means :meth:`cancel` stopped it
        (the text is what was final before).
        ``prompt_cache_key`` (OpenAI's field; any hashable, None included): prefix reuse stays
        among calls of the same key: a slot whose cache a call of another key left starts from an
        empty context, and a call prefers the slots of its own key.
        Raises ValueError for a bad argument (naming it), CloverError for an engine error.
        """
        ids = self.check_prompt_fits(self.prompt_ids(prompt))
        o = GenerateOptions.of(options)
        stops = check_stop(o.stop)
        p, keep, mode, ends = self._params(o)
        return "".join(self._stream(ids, p, keep, mode, set(ends), stops, _Run(), prompt_cache_key, hold=True))

    # ------------------------------------------------------------------ embeddings
    @property
    def n_embd(self) -> int:
        """The hidden size: the length of an embedding."""
        return int(self.hparams["n_embd"])

    @property
    def pooling(self) -> str:
        """The pooling :meth:`embed` applies by default: the GGUF's ``{arch}.pooling_type``, else
        ``"last"``."""
        return {v: k for k, v in POOLING_TYPES.items()}[int(self.hparams["pooling_type"])]

    def embed(self, input, pooling=None) -> np.ndarray:
        """The embedding of ``input`` (a str, tokenized with control tokens recognised, or a
        sequence of token ids; at most ``n_ctx`` tokens): the final hidden state of a causal
        (prefix mode) prefill after the final norm ``output_norm``, the LM head's input (what
        transformers returns as ``last_hidden_state``; the LM head is not computed), pooled:

        - ``"none"``: every token's row, float32 [n_tokens, n_embd];
        - ``"mean"``: the mean of the rows, float32 [n_embd];
        - ``"last"``: the last token's row, float32 [n_embd] (the one row that has seen every
          token of a causal model; Qwen3-Embedding pools so);
        - None: :attr:`pooling` (the GGUF's ``{arch}.pooling_type``, else ``"last"``).

        llama.cpp's values 0 (none), 1 (mean), 3 (last) work too; ``"cls"`` and ``"rank"``
        raise ValueError (a causal decoder has no CLS token or ranking head). Not normalised.
        Resets the context: the next generation prefills its whole prompt (prefix reuse starts
        over). :meth:`cancel` stops it (CloverError). Raises ValueError naming the argument."""
        self._live()
        pool = pooling_type("pooling", pooling)
        if pool in (POOLING_TYPES["cls"], POOLING_TYPES["rank"]):
            raise ValueError(f"pooling: {pooling!r} is not supported by a causal decoder (no CLS token or ranking "
                             "head); use none, mean or last")
        if isinstance(input, str):
            ids = self.tokenize(input)
            if not ids:
                raise ValueError("input: empty (at least one token is needed)")
        else:
            ids = self.check_ids("input", input)
        if len(ids) > self.n_ctx:
            raise ContextLengthExceeded(f"input: {len(ids)} tokens do not fit n_ctx={self.n_ctx}")
        if pool < 0:
            pool = int(self.hparams["pooling_type"])
        n, h = len(ids), self.n_embd
        out = np.empty((n, h) if pool == POOLING_TYPES["none"] else (h,), dtype=np.float32)
        err = err_buf()
        run = _Run()
        with self._slot() as s:
            self._abort_active(s)
            s.cached, s.saved = [], []  # clover_embed resets the context, the saved state with it
            with self._cancel_lock:
                s.running, run.slot = run, s
            try:
                rc = lib.clover_embed(s.ctx, ffi.new("int32_t[]", ids), n, pool,
                                      ffi.cast("float *", out.ctypes.data), out.size, err, len(err))
            finally:
                with self._cancel_lock:
                    s.running, run.slot = None, None
        if rc < 0:
            raise_error(err, "embed")
        return out

    # ------------------------------------------------------------------ logits (tests)
    def prefix_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Prefix (causal) mode logits of ``ids`` from an empty cache (spec 3.2):
        float32 array [len(ids), n_vocab]; row t predicts the token after ids[t].
        Resets the context. Raises ValueError / CloverError."""
        self._live()
        ids = self.check_ids("ids", ids)
        if len(ids) > self.n_ctx:
            raise ValueError(f"ids: {len(ids)} tokens do not fit n_ctx={self.n_ctx}")
        out = np.empty((len(ids), self.n_vocab), dtype=np.float32)
        err = err_buf()
        toks = ffi.new("int32_t[]", ids)
        with self._slot() as s:
            self._abort_active(s)
            lib.clover_context_reset(s.ctx)
            s.cached, s.ids = [], list(ids)
            rc = lib.clover_prefill(s.ctx, toks, len(ids), ffi.cast("float *", out.ctypes.data), 1,
                                    err, len(err))
        if rc < 0:
            raise_error(err, "prefix_logits")
        return out

    def block_logits(self, prefix_ids: Sequence[int], block_ids: Sequence[int],
                     coreset_top_p: float = 1.0):
        """Block (denoising) mode logits (spec 3.2-3.3, coreset 5.6): reset, prefill
        ``prefix_ids`` (may be empty), then one block forward over ``block_ids`` (mask ids
        allowed) at positions len(prefix)..len(prefix)+B-1; the caches are not changed by
        the block pass.

        Returns ``(logits, n_experts)``: float32 [B, n_vocab] (row j = LM head on row j, no
        shift applied) and a list of n_layer ints, the distinct experts used per layer.
        Requires the block tensors (:attr:`has_block`). Raises ValueError / CloverError."""
        self._live()
        err = err_buf()
        if lib.clover_model_check_mode(self._model, lib.CLOVER_MODE_DIFFUSION, err, len(err)) != 0:
            raise ValueError("block_logits: " + ffi.string(err).decode("utf-8", "replace"))
        prefix = self.check_ids("prefix_ids", prefix_ids, allow_empty=True)
        block = self.check_ids("block_ids", block_ids)
        cp = _check_float("coreset_top_p", coreset_top_p, lo=0.0, hi=1.0, lo_open=True)
        if len(prefix) + len(block) > self.n_ctx:
            raise ValueError(f"prefix_ids + block_ids: {len(prefix) + len(block)} tokens do not fit n_ctx={self.n_ctx}")
        err = err_buf()
        out = np.empty((len(block), self.n_vocab), dtype=np.float32)
        n_layer = int(self.hparams["n_layer"])
        nexp = ffi.new("int32_t[]", max(n_layer, 1))
        btoks = ffi.new("int32_t[]", block)
        with self._slot() as s:
            self._abort_active(s)
            lib.clover_context_reset(s.ctx)
            s.cached, s.ids = [], list(prefix)
            if prefix:
                toks = ffi.new("int32_t[]", prefix)
                if lib.clover_prefill(s.ctx, toks, len(prefix), ffi.NULL, 0, err, len(err)) < 0:
                    raise_error(err, "block_logits prefill")
            rc = lib.clover_block_forward(s.ctx, btoks, len(block), cp,
                                          ffi.cast("float *", out.ctypes.data), nexp, err, len(err))
        if rc < 0:
            raise_error(err, "block_logits")
        return out, [int(nexp[k]) for k in range(n_layer)]
