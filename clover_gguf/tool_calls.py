"""Tool calls in generated chat text: :class:`ToolCallParser`.

Two forms are recognised inside ``<tool_call>...</tool_call>``:

- the XML-like form of the Qwen3.5 / Qwen3.6 (and Qwen3-Coder) chat templates::

      <tool_call>
      <function=NAME>
      <parameter=PNAME>
      VALUE
      </parameter>
      </function>
      </tool_call>

  each VALUE is text, converted to the type the tool's JSON schema declares for that
  parameter (as llama.cpp's Qwen3-Coder parser does);
- the JSON form of the Qwen2.5 / Qwen3 templates:
  ``<tool_call>\\n{"name": "NAME", "arguments": {...}}\\n</tool_call>``.

A call is valid when it names a declared tool, carries every required parameter and is well
formed; anything else stays text. Whitespace next to a valid call is dropped (trailing
whitespace of the text before it, leading whitespace of the text after it), so that
whitespace-only text between and after calls disappears, as llama.cpp's server does.
"""
from __future__ import annotations

import json
import re
import secrets
from typing import Any

from .stops import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNC, _FUNC_END = "<function=", "</function>"
_PARAM, _PARAM_END = "<parameter=", "</parameter>"
_INTEGER = re.compile(r"-?\d+")
_MISSING = object()  # a value that does not convert to a type


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


def _tool_table(tools: list[dict] | None) -> dict[str, dict]:
    """``{name: parameters schema}`` of an OpenAI ``tools`` list (entries without a str name
    are skipped; a missing schema is ``{}``)."""
    table: dict[str, dict] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function", tool)
        name = fn.get("name") if isinstance(fn, dict) else None
        if isinstance(name, str) and name:
            params = fn.get("parameters")
            table[name] = params if isinstance(params, dict) else {}
    return table


def _schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter schema allows: its ``type`` (a str or a list), those of its
    ``anyOf`` / ``oneOf`` members, or else those of its ``enum`` / ``const`` values; empty
    when the schema says nothing (any type)."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = _schema_types(sub)
            if not sub_types:
                return set()  # a member allows anything
            types |= sub_types
    if not types:
        values = list(schema.get("enum") or ()) + ([schema["const"]] if "const" in schema else [])
        types = {_json_type(v) for v in values}
    return types


def _json_type(value: Any) -> str:
    """The JSON schema type name of a Python value decoded from JSON."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _convert_to(text: str, kind: str) -> Any:
    """``text`` (already stripped) as a value of JSON type ``kind``, or ``_MISSING``."""
    if kind == "null":
        return None if text in ("null", "None") else _MISSING
    if kind == "boolean":
        low = text.lower()
        return True if low == "true" else False if low == "false" else _MISSING
    if kind == "integer":
        return int(text) if _INTEGER.fullmatch(text) else _MISSING
    if kind in ("number", "object", "array"):
        try:
            value = json.loads(text)
        except ValueError:
            return _MISSING
        if kind == "number":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, dict if kind == "object" else list)
        return value if ok else _MISSING
    return _MISSING


def convert_parameter(text: str, schema: Any) -> Any:
    """The value of an XML-form parameter: ``text`` with the single newline the template puts
    at each edge removed, converted to the first type ``schema`` allows that it converts to
    (null, boolean, integer, number, object, array; string last, as the text itself).
    Returns ``_MISSING`` when it converts to none and the schema does not allow a string."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    types = _schema_types(schema)
    for kind in ("null", "boolean", "integer", "number", "object", "array"):
        if kind in types:
            value = _convert_to(text.strip(), kind)
            if value is not _MISSING:
                return value
    return text if not types or "string" in types else _MISSING


def _parse_xml(body: str, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """``(name, arguments)`` of an XML-form call body (the text between the tags), or None
    when it is malformed, names an undeclared tool or has a value its schema rejects."""
    rest = body.strip()
    if not rest.startswith(_FUNC) or ">" not in rest:
        return None
    k = rest.index(">")
    name, rest = rest[len(_FUNC):k], rest[k + 1:]
    if name not in tools:
        return None
    props = tools[name].get("properties")
    props = props if isinstance(props, dict) else {}
    args: dict[str, Any] = {}
    while True:
        rest = rest.lstrip()
        if rest.startswith(_FUNC_END):
            return (name, args) if not rest[len(_FUNC_END):].strip() else None
        if not rest.startswith(_PARAM) or ">" not in rest:
            return None
        k = rest.index(">")
        pname = rest[len(_PARAM):k]
        end = rest.find(_PARAM_END, k)
        if not pname or "\n" in pname or pname in args or end < 0:
            return None
        value = convert_parameter(rest[k + 1:end], props.get(pname))
        if value is _MISSING:
            return None
        args[pname] = value
        rest = rest[end + len(_PARAM_END):]


def _parse_json(body: str, tools: dict[str, dict]) -> tuple[str, dict] | None:
    """``(name, arguments)`` of a JSON-form call body, or None when it is not a JSON object
    with a declared ``name`` and an object ``arguments`` (absent: ``{}``; a str holding a
    JSON object is decoded)."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    args = call.get("arguments", {})
    if isinstance(args, str):  # arguments sent as a JSON string, as OpenAI messages carry them
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (call["name"], args) if isinstance(args, dict) else None


def parse_call(body: str, tools: dict[str, dict]) -> dict | None:
    """The OpenAI tool call of a ``<tool_call>`` body (XML or JSON form), or None when it is
    not a valid call (see the module docstring)."""
    text = body.strip()
    parsed = _parse_json(text, tools) if text.startswith("{") else _parse_xml(text, tools)
    if parsed is None:
        return None
    name, args = parsed
    required = tools[name].get("required")
    if isinstance(required, list) and any(r not in args for r in required):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


def _viability(head: str, tools: dict[str, dict]) -> str:
    """Whether a ``<tool_call>`` body that begins with ``head`` may still be a valid call:
    ``"yes"`` (whatever follows), ``"maybe"`` or ``"no"``. It answers ``"no"`` only when no
    continuation of ``head`` is valid, so the answer for a prefix never contradicts the one
    for the whole body: streamed and whole-text parsing agree."""
    text = head.lstrip()
    if text.startswith("{"):
        return "yes"
    if not text.startswith(_FUNC):
        return "maybe" if _FUNC.startswith(text) else "no"
    name = text[len(_FUNC):]
    if ">" in name:
        return "yes" if name[:name.index(">")] in tools else "no"
    return "maybe" if any(t.startswith(name) for t in tools) else "no"


class ToolCallParser:
    """Incremental parser of an assistant answer's content (the text outside <think>) into text and
    OpenAI tool calls.

    ``push(text)`` and ``flush()`` return events ``("content", text)`` and ``("tool_call",
    call)``, ``call`` being ``{"id": "call_<24 hex>", "type": "function", "function": {"name",
    "arguments": JSON str}}``. ``tools``: the request's OpenAI tools list; None or ``[]``: no
    parsing (every push returns its text as content).

    Text that may be the start of ``<tool_call>`` is held back until it cannot be; a call's
    markup is held until its ``</tool_call>`` (then it is a call, or its whole markup is
    content) or until it can no longer be a valid call (its ``<tool_call>`` is content and
    parsing resumes right after it). An unclosed call at ``flush()`` is content. The events
    are the same, content concatenated, for any split of the text into pushes.
    """

    def __init__(self, tools: list[dict] | None) -> None:
        self.enabled = bool(tools)
        self._tools = _tool_table(tools)
        self._reset()

    def _reset(self) -> None:
        self._buf = ""
        self._in_call = False  # _buf is the body of an open <tool_call>
        self._sure = False     # the open call's body can no longer become invalid before its end
        self._ws = ""          # trailing whitespace of the content, held back (dropped before a call)
        self._after_call = False  # drop leading whitespace of the next content

    def _content(self, text: str, out: list) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._ws + text
        core = text.rstrip()
        self._ws = text[len(core):]
        if core:
            out.append(("content", core))

    def _abandon(self, out: list) -> None:
        """The open call cannot be valid: its ``<tool_call>`` is content, parse the rest again."""
        self._content(OPEN, out)
        self._in_call, self._sure = False, False

    def _close(self, j: int, out: list) -> None:
        """The open call's ``</tool_call>`` is at ``_buf[j]``: emit the call or its markup."""
        body = self._buf[:j]
        if not self._sure and _viability(body, self._tools) == "no":
            self._abandon(out)
            return
        call = parse_call(body, self._tools)
        if call is None:
            self._content(OPEN + body + CLOSE, out)
        else:
            self._ws, self._after_call = "", True
            out.append(("tool_call", call))
        self._buf = self._buf[j + len(CLOSE):]
        self._in_call, self._sure = False, False

    def _scan(self, final: bool) -> list[tuple]:
        out: list[tuple] = []
        while True:
            if not self._in_call:
                i = self._buf.find(OPEN)
                if i >= 0:
                    self._content(self._buf[:i], out)
                    self._buf, self._in_call = self._buf[i + len(OPEN):], True
                    continue
                cut = len(self._buf) - (0 if final else partial_suffix(self._buf, OPEN))
                self._content(self._buf[:cut], out)
                self._buf = self._buf[cut:]
                return out
            j = self._buf.find(CLOSE)
            if j >= 0:
                self._close(j, out)
                continue
            if not self._sure:
                head = self._buf[:len(self._buf) - partial_suffix(self._buf, CLOSE)]
                verdict = _viability(head, self._tools)
                if verdict == "no":
                    self._abandon(out)
                    continue
                self._sure = verdict == "yes"
            if not final:
                return out
            self._content(OPEN + self._buf, out)  # unclosed at the end: text
            self._buf, self._in_call, self._sure = "", False, False

    def push(self, text: str) -> list[tuple]:
        """Events for ``text``, the next piece of the answer (see the class docstring)."""
        if not self.enabled:
            return [("content", text)] if text else []
        self._buf += text
        return self._scan(final=False)

    def flush(self) -> list[tuple]:
        """Events for the text held back, at the end of the answer; the parser is then reset."""
        if not self.enabled:
            return []
        out = self._scan(final=True)
        if self._ws:
            out.append(("content", self._ws))
        self._reset()
        return out


def forced_tools(tools: list[dict] | None, tool_choice) -> dict[str, dict] | None:
    """``{name: parameters schema}`` of the tools ``tool_choice`` forces a call to (``"required"``:
    every declared tool; ``{"type": "function", "function": {"name": NAME}}``: that one), None
    for ``"auto"``, ``"none"`` and None; ValueError naming the field otherwise."""
    if tool_choice is None or tool_choice in ("auto", "none"):
        return None
    table = _tool_table(tools)
    if tool_choice == "required":
        if not table:
            raise ValueError("tool_choice: \"required\" needs tools")
        return table
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or tool_choice.get("type", "function") != "function":
        raise ValueError(f"tool_choice: expected \"auto\", \"none\", \"required\" or {{\"type\": \"function\", "
                         f"\"function\": {{\"name\": ...}}}}, got {tool_choice!r}")
    if name not in table:
        raise ValueError(f"tool_choice: function {name!r} is not among the declared tools")
    return {name: table[name]}


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a Lark string literal: JSON's escapes


def _json_rule(schema: Any, layout: dict) -> str:
    """An inline ``%json`` of ``schema`` with the output ``layout`` (grammar.JSON_LAYOUT)."""
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema.setdefault("x-guidance", layout)
    return "%json " + json.dumps(schema)


def _xml_value(schema: Any, layout: dict, lengths: set) -> str:
    """The grammar of an XML-form parameter's value followed by its closing markup: free text for
    a string (or untyped) parameter (at most ``maxLength`` characters: rule ``text_N``, N added to
    ``lengths``), its literals for a string enum, else JSON of the schema (what
    :func:`convert_parameter` reads back)."""
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
        return "(" + " | ".join(_lark_str(e) for e in enum) + ") \"\\n</parameter>\\n\""
    types = _schema_types(schema)
    if not types or "string" in types:
        n = schema.get("maxLength") if isinstance(schema, dict) else None
        if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
            lengths.add(n)
            return f"text_{n}"
        return "free_text"
    return _json_rule(schema, layout) + " \"\\n</parameter>\\n\""


def tool_call_grammar(tools: dict[str, dict], xml: bool, several: bool, layout: dict) -> str:
    """A Lark grammar (llguidance's, grammar.grammar_source) of the answer that calls one of
    ``tools`` (``{name: parameters schema}``, :func:`forced_tools`), or one or more calls when
    ``several``: in the XML form of the Qwen3.5 template when ``xml`` (each parameter the schema
    declares in its order, the required ones always, each value as :func:`_xml_value`), else the
    JSON form with ``arguments`` valid against the schema. JSON is laid out as ``layout``."""
    lengths: set[int] = set()
    lines = ["%llguidance {}", "start: call" + (" (\"\\n\" call)*" if several else ""),
             "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, schema) in enumerate(tools.items()):
        if not xml:
            args = {"type": "object", "additionalProperties": False, **schema}  # no undeclared arguments
            body = {"type": "object", "properties": {"name": {"const": name}, "arguments": args},
                    "required": ["name", "arguments"], "additionalProperties": False}
            lines.append(f"call_{i}: \"<tool_call>\\n\" {_json_rule(body, layout)} \"\\n</tool_call>\"")
            continue
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        params = []
        for k, (pname, pschema) in enumerate(props.items()):
            lines.append(f"p_{i}_{k}: {_lark_str(_PARAM + pname + '>' + chr(10))} {_xml_value(pschema, layout, lengths)}")
            params.append(f"p_{i}_{k}" + ("" if pname in required else "?"))
        lines.append(f"call_{i}: {_lark_str(OPEN + chr(10) + _FUNC + name + '>' + chr(10))} {' '.join(params)} "
                     f"{_lark_str(_FUNC_END + chr(10) + CLOSE)}")
    if xml:  # a string value: any text (at most n characters) up to its closing markup
        lines.append("free_text[lazy]: /(?s:.*)\\n<\\/parameter>\\n/")
        for n in sorted(lengths):
            lines.append(f"text_{n}[lazy]: /(?s:.{{0,{n}}})\\n<\\/parameter>\\n/")
    return "\n".join(lines) + "\n"
