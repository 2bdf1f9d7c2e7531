"""Saved states: the bytes of :meth:`Model.save_state <clover_gguf.model.Model.save_state>` and
:class:`LlamaState`, the object of :meth:`Clover.save_state <clover_gguf.llama.Clover.save_state>`.

The bytes hold the engine's state (clover.h ``clover_state_get_data``: the caches, checked there
against the model, the cache types and n_ctx) behind the token lists prefix reuse needs, so that
after a load the next call behaves as if the state had never left:

    magic b"CLOVERPY", then little-endian uint32 version, n_ids, n_cached, n_saved, crc32 (zlib's,
    of the three lists' bytes), then int32 ids [n_ids] (the tokens the caches hold), cached
    [n_cached], saved [n_saved] (Model._cached, Model._saved), then the engine's state.
"""
from __future__ import annotations

import struct
import zlib

import numpy as np

__all__ = ["LlamaState", "pack_state", "unpack_state"]

_MAGIC = b"CLOVERPY"
_VERSION = 1
_HEAD = struct.Struct("<8s5I")


def pack_state(ids, cached, saved, engine: bytes) -> bytes:
    """The saved-state bytes of token lists ``ids``, ``cached``, ``saved`` and the engine's state."""
    lists = b"".join(np.asarray(x, dtype="<i4").tobytes() for x in (ids, cached, saved))
    return _HEAD.pack(_MAGIC, _VERSION, len(ids), len(cached), len(saved), zlib.crc32(lists)) + lists + engine


def unpack_state(state, n_vocab: int) -> tuple[list[int], list[int], list[int], memoryview]:
    """``(ids, cached, saved, engine state)`` of :func:`pack_state`'s bytes; ValueError naming
    ``state`` for anything else (another type, another format, a truncated or corrupted list,
    a token id outside [0, n_vocab)). The engine's state is checked by the engine when loaded."""
    if not isinstance(state, (bytes, bytearray, memoryview)):
        raise ValueError(f"state: expected the bytes of Model.save_state, got {type(state).__name__}")
    view = memoryview(state).cast("B")
    if len(view) < _HEAD.size or bytes(view[:8]) != _MAGIC:
        raise ValueError("state: not a saved clover-gguf state (Model.save_state)")
    _, version, *counts, crc = _HEAD.unpack_from(view)
    if version != _VERSION:
        raise ValueError(f"state: format version {version}, this clover-gguf reads {_VERSION}")
    end = _HEAD.size + 4 * sum(counts)
    if len(view) < end or zlib.crc32(view[_HEAD.size:end]) != crc:
        raise ValueError("state: its token lists are truncated or corrupted")
    lists, at = [], _HEAD.size
    for n in counts:
        a = np.frombuffer(view, dtype="<i4", count=n, offset=at)
        if n and (a.min() < 0 or a.max() >= n_vocab):
            raise ValueError(f"state: a token id outside [0, {n_vocab})")
        lists.append(a.tolist())
        at += 4 * n
    return lists[0], lists[1], lists[2], view[end:]


class LlamaState:
    """A saved state of a :class:`~clover_gguf.llama.Clover` (``save_state()``), with the fields
    of llama-cpp-python's ``LlamaState``; picklable.

    Attributes:
        input_ids: the tokens whose state the caches hold (numpy ``intc`` array).
        scores: None: the engine samples inside the decoder and keeps no logits between calls
            (llama-cpp-python keeps a logits row per token there).
        n_tokens: ``len(input_ids)``.
        llama_state: the state's bytes (:meth:`Model.save_state
            <clover_gguf.model.Model.save_state>`: the caches and the prefix-reuse token lists).
        llama_state_size: ``len(llama_state)``.
        seed: the object's default sampling seed (``Clover.seed``) when it was saved.
    """

    def __init__(self, input_ids, scores, n_tokens: int, llama_state: bytes, llama_state_size: int,
                 seed: int) -> None:
        self.input_ids = input_ids
        self.scores = scores
        self.n_tokens = n_tokens
        self.llama_state = llama_state
        self.llama_state_size = llama_state_size
        self.seed = seed

    def __repr__(self) -> str:
        return f"LlamaState(n_tokens={self.n_tokens}, llama_state_size={self.llama_state_size}, seed={self.seed})"
