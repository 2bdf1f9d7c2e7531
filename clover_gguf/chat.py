"""Chat templates: render ``tokenizer.chat_template`` from GGUF metadata.

A GGUF carries the model's chat template as the Jinja2 string ``tokenizer.chat_template``
(copied by the converter from the checkpoint's ``chat_template.jinja`` or
``tokenizer_config.json``). Those templates are written for Hugging Face transformers, so
:class:`ChatTemplate` renders them with the semantics of transformers 5.23.0
``PreTrainedTokenizerBase.apply_chat_template(..., tokenize=False)``
(``transformers/utils/chat_template_utils.py``), reimplemented here without importing
transformers:

- environment: jinja2 ``ImmutableSandboxedEnvironment(trim_blocks=True,
  lstrip_blocks=True)`` with the ``loopcontrols`` extension (``{% break %}``,
  ``{% continue %}``) and a ``{% generation %}...{% endgeneration %}`` tag that renders its
  body (transformers uses it only to mark assistant tokens for training masks);
- globals ``raise_exception(msg)``, ``strftime_now(fmt)``, a ``dict`` constructor and a
  ``namespace`` that refuses underscore-prefixed attributes; the ``tojson`` filter is
  ``json.dumps`` with ``ensure_ascii=False`` and optional ``indent``, ``separators`` and
  ``sort_keys`` (jinja's own escapes HTML characters);
- inputs: an empty conversation is refused; keys whose value is ``None`` are dropped from
  each message (OpenAI-style ``content=None``); messages, tools, documents and extra
  variables are rebuilt from plain JSON types (rich objects become ``"<TypeName>"``); a
  message's ``reasoning_content`` is filled from ``thinking`` / ``reasoning`` and copied to
  ``thinking``;
- context: ``messages``, ``tools`` (a list of JSON-schema dicts, or None), ``documents``,
  ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ...) and any
  extra keyword (``enable_thinking=False``), extra keywords overriding special tokens.

Not reproduced: tools given as Python functions (transformers builds their schema from type
hints and docstrings), ``continue_final_message`` and the assistant-token masks. Errors are
``ValueError``: a template syntax error, a bad argument (naming it, e.g. ``messages[2].role``),
a template-level error such as ``raise_exception('...')`` (its message) or any other
exception the template raises while rendering (its type and message, e.g.
``tokenizer.chat_template: ZeroDivisionError: division by zero``). Nothing here imports
torch, transformers or the native library.

Limits. A chat template is code written by whoever made the GGUF, so every render runs under
limits set per :class:`ChatTemplate` (``max_seconds``, ``max_chars``, ``max_depth``);
:mod:`clover_gguf.chat_limits` holds the sandbox that enforces them and says what they do and
do not bound. This module checks the inputs against ``max_depth`` and
:data:`RESERVED_VARIABLES`.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np

from .chat_limits import (DEFAULT_MAX_CHARS, DEFAULT_MAX_DEPTH, DEFAULT_MAX_SECONDS,
                          LimitedEnvironment, render_limited)

__all__ = ["ChatTemplate", "CHAT_TEMPLATE_KEY", "RESERVED_VARIABLES", "check_template_kwargs",
           "chat_template_from_metadata"]

#: GGUF metadata key of the default chat template (named ones: ``tokenizer.chat_template.NAME``).
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# Names a message's reasoning may come under; templates read the first (transformers
# _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

#: Template variables that :meth:`ChatTemplate.render` sets itself, never from extra keywords.
RESERVED_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def _version_tuple(v: str) -> tuple[int, ...]:
    parts = []
    for p in v.split(".")[:3]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


# Older jinja2 releases have known sandbox escapes, and chat templates are untrusted code;
# transformers refuses them for the same reason.
if _version_tuple(jinja2.__version__) < (3, 1, 6):
    raise ImportError(f"clover_gguf.chat needs jinja2>=3.1.6, found {jinja2.__version__}")


# ---------------------------------------------------------------------------------------------
# The template environment
# ---------------------------------------------------------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}body{% endgeneration %}``: renders ``body`` unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_render_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateDict:
    """The ``dict`` global: builds plain dicts without exposing the ``dict`` type itself."""

    __name__ = "dict"

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The ``namespace`` global, refusing underscore-prefixed attributes (no route to CPython
    internals through ``ns.__class__``-style names)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"namespace attribute {name!r}: underscore-prefixed names are not allowed")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


class _TemplateEnvironment(LimitedEnvironment):
    """transformers' chat-template sandbox (see the module docstring), under the limits of
    :class:`~clover_gguf.chat_limits.LimitedEnvironment`."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(max_chars, trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols],
                         extra_filters={"tojson": self._tojson},
                         extra_globals={"raise_exception": _raise_exception,
                                        "strftime_now": self._strftime_now,
                                        "dict": _TemplateDict(), "namespace": _TemplateNamespace})

    def _tojson(self, x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        """``json.dumps`` with ``ensure_ascii=False`` (transformers' ``tojson``), within the
        render's limits."""
        encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent,
                                   separators=separators, sort_keys=sort_keys)
        return self.limits().encoded(encoder, x, "the result of filter tojson")

    def _strftime_now(self, fmt):
        if isinstance(fmt, str):  # a directive (2 chars) expands to at most ~30 ("%c")
            self.limits().check(16 * len(fmt), "the result of strftime_now()")
        return datetime.now().strftime(fmt)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

class _TooDeep(Exception):
    """Containers in an input nest deeper than allowed (see _plain)."""


def _plain(value: Any, levels: int) -> Any:
    """``value`` rebuilt from plain JSON-like types (str, int, float, bool, None, dict, list,
    tuple); numpy scalars become Python scalars, dataclasses and pydantic models dicts, and
    anything else the placeholder ``"<TypeName>"``. Rich objects have methods the sandbox
    does not know to be unsafe, so the template never sees them (transformers does the same).
    Raises _TooDeep where containers nest more than ``levels`` deep."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, (Mapping, list, tuple)):
        if levels <= 0:
            raise _TooDeep
        if isinstance(value, list):
            return [_plain(v, levels - 1) for v in value]
        if isinstance(value, tuple):
            return tuple(_plain(v, levels - 1) for v in value)
        return {_plain(k, levels - 1): _plain(v, levels - 1) for k, v in value.items()}
    if isinstance(value, np.generic):
        return _plain(value.item(), levels)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if levels <= 0:
            raise _TooDeep
        return {f.name: _plain(getattr(value, f.name), levels - 1) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump(), levels)
    return f"<{type(value).__name__}>"


def _plain_arg(value: Any, name: str, max_depth: int) -> Any:
    """:func:`_plain` of argument ``name``; ValueError naming it past ``max_depth`` levels."""
    try:
        return _plain(value, max_depth)
    except _TooDeep:
        raise ValueError(f"{name}: nested deeper than {max_depth} levels") from None


def _too_deep(value: Any, max_depth: int) -> bool:
    try:
        _plain(value, max_depth)
    except _TooDeep:
        return True
    return False


def _alias_reasoning(message: dict) -> dict:
    """Fill ``reasoning_content`` from ``thinking`` / ``reasoning`` and ``thinking`` from it
    (gpt-oss templates read ``thinking``); key order as transformers builds it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _check_messages(messages, max_depth: int) -> list[dict]:
    """Validated, plain copies of ``messages`` (list of dicts, each with a str ``role``;
    None-valued keys dropped). Raises ValueError naming the bad field."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages: expected a list of message dicts, got {type(messages).__name__}")
    if len(messages) == 0:
        raise ValueError("messages: empty conversation, give at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}]: expected a dict, got {type(m).__name__}")
        try:
            m = {_plain(k, max_depth): _plain(v, max_depth) for k, v in m.items() if v is not None}
        except _TooDeep:
            key = next(k for k, v in m.items() if _too_deep(v, max_depth) or _too_deep(k, max_depth))
            raise ValueError(f"messages[{i}].{key}: nested deeper than {max_depth} levels") from None
        role = m.get("role")
        if role is None:
            raise ValueError(f"messages[{i}].role: missing")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role: expected a str, got {role!r}")
        out.append(_alias_reasoning(m))
    return out


def _check_dict_list(name: str, items, what: str, max_depth: int) -> list | None:
    """Plain copy of ``items`` (None or a list of dicts); ValueError naming ``name[i]``."""
    if items is None:
        return None
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence):
        raise ValueError(f"{name}: expected a list of {what}, got {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"{name}[{i}]: expected a dict ({what}), got {type(item).__name__}")
    return _plain_arg(list(items), name, max_depth)


def check_template_kwargs(kwargs: Mapping[str, Any], name: str = "chat_template_kwargs") -> None:
    """Raise ValueError if ``kwargs`` (extra template variables, such as a request's
    ``chat_template_kwargs``) sets one of :data:`RESERVED_VARIABLES`."""
    for key in RESERVED_VARIABLES:
        if key in kwargs:
            raise ValueError(f"{name}.{key}: set from the request, not a template variable a "
                             "caller may override")


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

class ChatTemplate:
    """A compiled chat template, rendered under limits (see :mod:`clover_gguf.chat_limits`).

    Args:
        source: the Jinja2 template text (GGUF ``tokenizer.chat_template``).
        special_tokens: template variables such as ``{"bos_token": ..., "eos_token": ...}``
            (transformers passes the tokenizer's ``special_tokens_map``); render keywords of
            the same name override them.
        max_seconds: wall-clock limit of one render (default :data:`DEFAULT_MAX_SECONDS`).
        max_chars: limit of the output and of any one value the template builds, in
            characters (default :data:`DEFAULT_MAX_CHARS`).
        max_depth: limit of container nesting in each input: a message's field, ``tools``,
            ``documents``, an extra variable (default :data:`DEFAULT_MAX_DEPTH`).

    Raises:
        ValueError: ``source`` is not a string or has a Jinja2 syntax error (with its line),
            or a limit is not a positive number.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, *,
                 max_seconds: float = DEFAULT_MAX_SECONDS, max_chars: int = DEFAULT_MAX_CHARS,
                 max_depth: int = DEFAULT_MAX_DEPTH) -> None:
        if not isinstance(source, str):
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: expected a str, got {type(source).__name__}")
        for name, value, kinds in (("max_seconds", max_seconds, (int, float)),
                                   ("max_chars", max_chars, int), ("max_depth", max_depth, int)):
            if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        env = _TemplateEnvironment(max_chars)
        try:
            code = env.compile(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: syntax error at line {e.lineno}: {e.message}") from e
        except (RecursionError, SyntaxError) as e:  # Python's own limits on nesting
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: nested too deeply to compile ({e})") from e
        self._template = env.template_class.from_code(env, code, env.make_globals(None))
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.max_seconds, self.max_chars, self.max_depth = max_seconds, max_chars, max_depth

    @classmethod
    def from_metadata(cls, md: Mapping[str, object], name: str | None = None,
                      special_tokens: Mapping[str, str] | None = None, **limits) -> "ChatTemplate":
        """The template of a GGUF metadata mapping (see :func:`chat_template_from_metadata`);
        ``limits``: the constructor's ``max_seconds`` / ``max_chars`` / ``max_depth``."""
        return cls(chat_template_from_metadata(md, name), special_tokens, **limits)

    @classmethod
    def for_tokenizer(cls, tokenizer, **limits) -> "ChatTemplate":
        """The template of a :class:`~clover_gguf.tokenizer.CloverTokenizer`, with
        ``bos_token`` / ``eos_token`` / ``pad_token`` set to the text of the GGUF's
        ``tokenizer.ggml.{bos,eos,padding}_token_id`` where present (as llama.cpp does; an HF
        tokenizer may leave ``bos_token`` unset where the GGUF names one). ``limits``: the
        constructor's ``max_seconds`` / ``max_chars`` / ``max_depth``.

        Raises:
            ValueError: the tokenizer has no chat template.
        """
        source = getattr(tokenizer, "chat_template", None)
        if source is None:
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: missing from the GGUF (no chat template)")
        special = {}
        for var, attr in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("pad_token", "padding_token_id")):
            i = getattr(tokenizer, attr, None)
            if i is not None and 0 <= i < tokenizer.n_vocab:
                special[var] = tokenizer.decode([i])
        return cls(source, special, **limits)

    def render(self, messages: Sequence[Mapping[str, Any]], /, add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs) -> str:
        """The prompt text for ``messages`` (transformers' ``apply_chat_template(...,
        tokenize=False)``), rendered within the template's limits.

        Args:
            messages: list of dicts, each with a str ``role`` (``content``: a str, a list of
                parts such as ``{"type": "text", "text": ...}``, or absent); assistant turns
                may carry ``reasoning_content`` and ``tool_calls``.
            add_generation_prompt: append the header that opens an assistant turn.
            tools: None or a list of JSON-schema dicts (``{"type": "function", "function":
                {"name", "description", "parameters"}}``).
            documents: None or a list of dicts (retrieval documents, for templates that use them).
            **kwargs: extra template variables, e.g. ``enable_thinking=False``; not one of
                :data:`RESERVED_VARIABLES`.

        Raises:
            ValueError: a bad argument (naming the field), an error raised while rendering
                (``raise_exception`` in the template, an undefined value, a sandbox refusal,
                or any other exception, named with its type and message), or a limit
                exceeded (naming it).
        """
        check_template_kwargs(kwargs)
        depth = self.max_depth
        variables = {
            "messages": _check_messages(messages, depth),
            "tools": _check_dict_list("tools", tools, "JSON-schema dicts", depth),
            "documents": _check_dict_list("documents", documents, "document dicts", depth),
            "add_generation_prompt": add_generation_prompt,
        }
        variables.update((k, _plain_arg(v, k, depth))
                         for k, v in {**self.special_tokens, **kwargs}.items())
        try:
            return render_limited(self._template, variables, self.max_seconds)
        except Exception as e:
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: {_template_error(e)}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"


def _template_error(e: Exception) -> str:
    """What went wrong in a render that raised ``e``: a template error's message (such as
    ``raise_exception``'s or a limit's), else the exception's type and message."""
    if isinstance(e, jinja2.exceptions.TemplateError):
        return e.message or type(e).__name__
    if isinstance(e, RecursionError):
        return f"recursion too deep (past Python's limit of {sys.getrecursionlimit()} frames)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def chat_template_from_metadata(md: Mapping[str, object], name: str | None = None) -> str:
    """The chat template text of GGUF metadata ``md``: ``tokenizer.chat_template``, or the
    named one ``tokenizer.chat_template.NAME`` (llama.cpp's layout for e.g. ``tool_use``).

    Raises:
        ValueError: the key is missing or not a string.
    """
    key = CHAT_TEMPLATE_KEY if name is None else f"{CHAT_TEMPLATE_KEY}.{name}"
    v = md.get(key)
    if v is None:
        raise ValueError(f"{key}: missing from the GGUF (no chat template)")
    if not isinstance(v, str):
        raise ValueError(f"{key}: expected a str, got {type(v).__name__}")
    return v
