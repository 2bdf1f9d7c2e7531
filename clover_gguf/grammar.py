"""Constrained decoding (docs/structured-output.md): grammars compiled by llguidance over the
model's tokenizer and handed to the engine as a ``clover_constraint`` (clover.h), which asks
for the allowed tokens before each choice and reports each token it makes final.

A grammar is given as one of llguidance's inputs: a JSON schema, a GBNF grammar (llama.cpp's
``grammar``) or a Lark grammar (text starting with ``%llguidance``, as vLLM and SGLang take
it). :class:`Constraint` is one generation's matcher, compiled over the tokenizer (a ValueError
naming the field when llguidance cannot compile it).
"""
from __future__ import annotations

import json
import threading

from ._ffi import ffi

_LOCK = threading.Lock()
# JSON output's layout: json.dumps' separators and no other whitespace, so a schema's output has
# one spelling and no whitespace runs (a schema's "x-guidance" options override it)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def ll_tokenizer(tokenizer, n_vocab: int, end_ids):
    """llguidance's tokenizer for ``tokenizer`` (a CloverTokenizer) padded to ``n_vocab`` ids, whose
    end-of-sequence tokens are ``end_ids`` (the grammar allows them once it is complete). Built once
    per tokenizer and end ids (about a second at 150K tokens) and kept on the tokenizer."""
    import llguidance

    key = (n_vocab, tuple(sorted(end_ids)))
    with _LOCK:
        cache = tokenizer.__dict__.setdefault("_ll_tokenizers", {})
        if key not in cache:
            cache[key] = llguidance.LLTokenizer(tokenizer.hf_tokenizer.to_str(), n_vocab=n_vocab,
                                                eos_token=list(key[1]) or None)
        return cache[key]


def grammar_source(grammar=None, json_schema=None) -> tuple[str, str]:
    """(field, llguidance grammar) of a generation's ``grammar`` (GBNF, or Lark when it starts with
    ``%llguidance``) or ``json_schema`` (a dict, or its JSON text); ValueError naming the field when
    both are given or one has the wrong type or does not parse."""
    import llguidance

    if grammar is not None and json_schema is not None:
        raise ValueError("grammar: give grammar or json_schema, not both")
    if grammar is not None:
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"grammar: expected non-empty GBNF or Lark text, got {_kind(grammar)}")
        fmt = "lark" if grammar.lstrip().startswith("%llguidance") else "gbnf"
        return "grammar", _from("grammar", llguidance.grammar_from, fmt, grammar)
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except ValueError as e:
            raise ValueError(f"json_schema: not JSON ({e})") from None
    if not isinstance(json_schema, (dict, bool)):
        raise ValueError(f"json_schema: expected a JSON schema object, got {_kind(json_schema)}")
    return "json_schema", _from("json_schema", llguidance.LLMatcher.grammar_from_json_schema,
                                json.dumps(json_schema), JSON_LAYOUT)


def _kind(v) -> str:
    return type(v).__name__


def _from(field, fn, *args) -> str:
    try:
        return fn(*args)
    except Exception as e:  # llguidance raises ValueError / RuntimeError with the parser's message
        raise ValueError(f"{field}: {e}") from None


class Constraint:
    """One generation's grammar state (an llguidance matcher) as the engine's ``clover_constraint``:
    :attr:`c` points to the struct; it lives as long as this object. A failure inside a callback
    is kept in :attr:`error` (the engine then stops with a "constraint: ..." error)."""

    def __init__(self, field: str, source: str, tokenizer, n_vocab: int) -> None:
        import llguidance

        self.matcher = llguidance.LLMatcher(tokenizer, source)
        if self.matcher.is_error():  # the grammar did not compile; ``field`` names it
            raise ValueError(f"{field}: the grammar does not compile: {self.matcher.get_error().strip()}")
        self.error: str | None = None
        self._nbytes = (n_vocab + 31) // 32 * 4
        self._callbacks = (ffi.callback("int(void *, uint32_t *)", self._mask, error=1),
                           ffi.callback("int(void *, int32_t)", self._accept, error=1),
                           ffi.callback("int(void *, int32_t)", self._rollback, error=1))
        self.c = ffi.new("clover_constraint *")
        self.c.mask, self.c.accept, self.c.rollback = self._callbacks

    def _fail(self) -> int:
        self.error = self.matcher.get_error() or "the grammar refused the state"
        return 1

    def _mask(self, _user, allowed) -> int:
        try:
            self.matcher.unsafe_compute_mask_ptr(int(ffi.cast("uintptr_t", allowed)), self._nbytes)
        except Exception as e:  # reported through the engine's error
            self.error = str(e)
            return 1
        return self._fail() if self.matcher.is_error() else 0

    def _accept(self, _user, token) -> int:
        return 0 if self.matcher.consume_token(int(token)) else self._fail()

    def _rollback(self, _user, n) -> int:
        return 0 if self.matcher.rollback(int(n)) else self._fail()
