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
``ValueError``: a template syntax error, a bad argument (naming it, e.g. ``messages[2].role``)
or a template-level error such as ``raise_exception('...')`` (its message). Nothing here
imports torch, transformers or the native library.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "CHAT_TEMPLATE_KEY", "chat_template_from_metadata"]

#: GGUF metadata key of the default chat template (named ones: ``tokenizer.chat_template.NAME``).
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"

# Names a message's reasoning may come under; templates read the first (transformers
# _REASONING_FIELDS).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


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


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------

def _plain(value: Any) -> Any:
    """``value`` rebuilt from plain JSON-like types (str, int, float, bool, None, dict, list,
    tuple); numpy scalars become Python scalars, dataclasses and pydantic models dicts, and
    anything else the placeholder ``"<TypeName>"``. Rich objects have methods the sandbox
    does not know to be unsafe, so the template never sees them (transformers does the same)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning(message: dict) -> dict:
    """Fill ``reasoning_content`` from ``thinking`` / ``reasoning`` and ``thinking`` from it
    (gpt-oss templates read ``thinking``); key order as transformers builds it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _check_messages(messages) -> list[dict]:
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
        m = _plain({k: v for k, v in m.items() if v is not None})
        role = m.get("role")
        if role is None:
            raise ValueError(f"messages[{i}].role: missing")
        if not isinstance(role, str):
            raise ValueError(f"messages[{i}].role: expected a str, got {role!r}")
        out.append(_alias_reasoning(m))
    return out


def _check_dict_list(name: str, items, what: str) -> list | None:
    """Plain copy of ``items`` (None or a list of dicts); ValueError naming ``name[i]``."""
    if items is None:
        return None
    if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Sequence):
        raise ValueError(f"{name}: expected a list of {what}, got {type(items).__name__}")
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"{name}[{i}]: expected a dict ({what}), got {type(item).__name__}")
    return _plain(list(items))


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------

class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja2 template text (GGUF ``tokenizer.chat_template``).
        special_tokens: template variables such as ``{"bos_token": ..., "eos_token": ...}``
            (transformers passes the tokenizer's ``special_tokens_map``); render keywords of
            the same name override them.

    Raises:
        ValueError: ``source`` is not a string or has a Jinja2 syntax error (with its line).
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        if not isinstance(source, str):
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: expected a str, got {type(source).__name__}")
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: syntax error at line {e.lineno}: {e.message}") from e
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_metadata(cls, md: Mapping[str, object], name: str | None = None,
                      special_tokens: Mapping[str, str] | None = None) -> "ChatTemplate":
        """The template of a GGUF metadata mapping (see :func:`chat_template_from_metadata`)."""
        return cls(chat_template_from_metadata(md, name), special_tokens)

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "ChatTemplate":
        """The template of a :class:`~clover_gguf.tokenizer.CloverTokenizer`, with
        ``bos_token`` / ``eos_token`` / ``pad_token`` set to the text of the GGUF's
        ``tokenizer.ggml.{bos,eos,padding}_token_id`` where present (as llama.cpp does; an HF
        tokenizer may leave ``bos_token`` unset where the GGUF names one).

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
        return cls(source, special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None,
               documents: Sequence[Mapping[str, Any]] | None = None, **kwargs) -> str:
        """The prompt text for ``messages`` (transformers' ``apply_chat_template(...,
        tokenize=False)``).

        Args:
            messages: list of dicts, each with a str ``role`` (``content``: a str, a list of
                parts such as ``{"type": "text", "text": ...}``, or absent); assistant turns
                may carry ``reasoning_content`` and ``tool_calls``.
            add_generation_prompt: append the header that opens an assistant turn.
            tools: None or a list of JSON-schema dicts (``{"type": "function", "function":
                {"name", "description", "parameters"}}``).
            documents: None or a list of dicts (retrieval documents, for templates that use them).
            **kwargs: extra template variables, e.g. ``enable_thinking=False``.

        Raises:
            ValueError: a bad argument (naming the field), or an error raised while rendering
                (``raise_exception`` in the template, an undefined value, a sandbox refusal).
        """
        chat = _check_messages(messages)
        tools = _check_dict_list("tools", tools, "JSON-schema dicts")
        documents = _check_dict_list("documents", documents, "document dicts")
        variables = _plain({**self.special_tokens, **kwargs})
        try:
            return self._template.render(messages=chat, tools=tools, documents=documents,
                                         add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"{CHAT_TEMPLATE_KEY}: {e.message or type(e).__name__}") from e

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"


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
