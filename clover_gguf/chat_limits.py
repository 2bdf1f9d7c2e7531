"""Limits on rendering an untrusted chat template: time, size and nesting.

A chat template is code written by whoever made the GGUF, so
:class:`~clover_gguf.chat.ChatTemplate` compiles it in a :class:`LimitedEnvironment` (a jinja
sandbox whose operations check what they build) and renders it with :func:`render_limited`,
under limits set per template (``max_seconds``, ``max_chars``, ``max_depth``):

- time: the deadline is checked at each item of every ``{% for %}`` loop (the code generator
  wraps the loop's iterable), at every call the template makes (a macro calling itself), at
  every size check, and at every line of the filters that loop in Python over a whole text
  or list (``wordwrap``, ``urlize``, ``indent``, ``sort``, ...), through a ``sys.settrace``
  function set only while such a filter runs. (One trace function for the whole render
  would be simpler, but in Python 3.11 any trace function makes every frame of the thread
  about 3x slower, traced or not.)
- size: the output, and every value the template builds, stay within ``max_chars``; each
  operation that could build a large value is checked before it runs: ``*``, ``+``, ``%``,
  ``~``, list / tuple / dict literals, ``{{ }}`` output, macro and ``{% set %}`` buffers,
  ``str.format`` fields, the str / bytes methods that pad, repeat or join (``center``,
  ``ljust``, ``zfill``, ``expandtabs``, ``replace``, ``join``, ``translate``), the filters
  that do (``center``, ``indent``, ``wordwrap``, ``replace``, ``format``, ``join``,
  ``batch``, ``slice``, ``tojson(indent=...)``, ``pprint``, ...) and every filter that turns
  a value into text. A value shared N times counts N times, so nesting a value in itself
  again and again (``[x, x]``, ``dict(a=x, b=x)``) cannot make a small object whose text or
  comparison is huge. Integers that operators, filters and calls give the template stay
  under 16384 bits;
- recursion: Python's recursion limit, reported as ``recursion too deep``; a template
  nested too deeply to compile is refused by the constructor;
- inputs: messages, tools, documents and extra variables nest at most ``max_depth``
  containers deep, and extra variables cannot be named as
  :data:`~clover_gguf.chat.RESERVED_VARIABLES`.

This module holds the time and size checks; :mod:`clover_gguf.chat` reports recursion and
compile-time nesting and checks the inputs.

Exceeding a limit raises ValueError naming it (``tokenizer.chat_template: rendering took
longer than max_seconds=5``). These checks run inside the process; they bound each operation,
not the process:

- a single C-level operation on a max_chars value runs to its end before the clock is read
  again (a regular-expression filter such as ``wordcount``, sorting a max-size list: a few
  tenths of a second);
- memory is bounded per value, not in total: values alive at once add up, e.g. a recursive
  macro holding a new max_chars string at each level reaches several hundred MB before the
  recursion limit stops it;
- a flaw in jinja's sandbox or in CPython is not contained.

A hard bound on memory and time needs a process boundary: render in a worker process with
``RLIMIT_AS`` / ``RLIMIT_CPU`` that can be killed.
"""
from __future__ import annotations

import functools
import inspect
import itertools
import json
import math
import pprint
import re
import sys
import threading
import time
import types
from collections.abc import Mapping

import jinja2
import jinja2.filters
import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.runtime import markup_join, str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from markupsafe import EscapeFormatter, Markup

__all__ = ["DEFAULT_MAX_CHARS", "DEFAULT_MAX_DEPTH", "DEFAULT_MAX_SECONDS", "LimitedEnvironment",
           "render_limited"]

#: Default wall-clock limit of one render, in seconds: a 1400-message, 350 KB Qwen3.5 prompt
#: renders in about 0.05 s, so 5 s leaves room for a loaded machine while a server slot held
#: by a hostile template frees itself within seconds.
DEFAULT_MAX_SECONDS = 5.0
#: Default limit, in characters, of the output and of any one value a template builds: a
#: 256K-token context is about 1 MB of text, so 4 MiB leaves room for dense scripts and JSON.
DEFAULT_MAX_CHARS = 4 << 20
#: Default limit of container nesting in an input (a JSON schema nests a few levels).
DEFAULT_MAX_DEPTH = 100

# Integers a template gets from operators, filters and calls stay below this size, so that
# arithmetic on them stays at microseconds (a count or a length needs under 64 bits).
_MAX_INT_BITS = 1 << 14
# How many of the containers a template built last keep their measured size (see _Render.keep).
_RECENT = 8
_CONTAINERS = (list, tuple, dict, type({}.keys()), type({}.values()), type({}.items()),
               jinja2.utils.Namespace)
_local = threading.local()  # .render: the _Render running on this thread, if any


# ---------------------------------------------------------------------------------------------
# The limits of one render
# ---------------------------------------------------------------------------------------------

class _LimitError(jinja2.exceptions.TemplateError):
    """A render went past one of its limits (the message names the limit)."""


def _check_int_bits(bits: float, what: str) -> None:
    if bits > _MAX_INT_BITS:
        raise _LimitError(f"{what} is an integer of about {bits:.0f} bits, over the "
                          f"{_MAX_INT_BITS}-bit limit")


def _checked_result(st: "_Render", result, what: str):
    """``result`` of an operator, filter or call, refused if it is text past max_chars or
    an integer past _MAX_INT_BITS (``int('f' * 10**6, 16)``, ``int.from_bytes``)."""
    if isinstance(result, (str, bytes)):
        if len(result) > st.max_chars:
            st.check(len(result), what)
    elif type(result) is int and result.bit_length() > _MAX_INT_BITS:
        _check_int_bits(result.bit_length(), what)
    return result


class _Render:
    """The limits of one render on one thread (``with``: the thread's current render): its
    deadline, which every check reads, and the size of values (:meth:`measure`)."""

    def __init__(self, env: "LimitedEnvironment", max_seconds: float = math.inf) -> None:
        self.env = env
        self.max_chars = env.max_chars
        self.max_seconds = max_seconds
        self.deadline = time.monotonic() + max_seconds
        self._recent: dict[int, tuple] = {}

    def __enter__(self) -> "_Render":
        self._outer = getattr(_local, "render", None)
        _local.render = self
        return self

    def __exit__(self, *exc) -> None:
        _local.render = self._outer

    def expired(self):
        raise _LimitError(f"rendering took longer than max_seconds={self.max_seconds:g}")

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            self.expired()

    def traced(self, func, args, kwargs):
        """``func(*args, **kwargs)`` with the deadline checked at every line of Python it runs,
        by a ``sys.settrace`` function set for this call only: in Python 3.11 any trace
        function slows every frame of the thread about 3x, so it is kept to the filters that
        loop in Python over a whole text (see :data:`_TRACED_FILTERS`)."""
        if self.deadline == math.inf:
            return func(*args, **kwargs)
        deadline, clock, expired = self.deadline, time.monotonic, self.expired

        def on_line(frame, event, arg):
            if clock() > deadline:
                expired()
            return on_line

        outer = sys.gettrace()
        sys.settrace(on_line)
        try:
            return func(*args, **kwargs)
        finally:
            sys.settrace(outer)

    def check(self, size: int, what: str) -> None:
        """Refuse ``what`` (a noun: "the output") of ``size`` chars past max_chars, and any
        work past the deadline."""
        if size > self.max_chars:
            raise _LimitError(f"{what} is longer than max_chars={self.max_chars} "
                              f"(about {size} chars)")
        if time.monotonic() > self.deadline:
            self.expired()

    def joined(self, chunks, what: str) -> str:
        """``"".join(chunks)``, stopping once they pass max_chars."""
        out, n, limit = [], 0, self.max_chars
        append = out.append
        for chunk in chunks:
            n += len(chunk)
            if n > limit:
                self.check(n, what)
            append(chunk)
        return "".join(out)

    def encoded(self, encoder: json.JSONEncoder, value, what: str) -> str:
        """``encoder.encode(value)``, its size checked first; with an indent, its chunks are
        joined up to max_chars."""
        size, depth, _ = self.measure(value)
        indent = encoder.indent
        if indent is None:  # C encoder: separators repeat once per element (8 size units each)
            seps = sum(len(s) for s in (encoder.item_separator, encoder.key_separator)
                       if isinstance(s, str))
            self.check(size + max(0, seps - 4) * (size // 8), what)
            return encoder.encode(value)
        pad = len(indent) if isinstance(indent, str) else _int(indent)
        self.check(size + pad * max(depth, 1), what)  # the longest line prefix is pad * depth
        return self.traced(self.joined, (encoder.iterencode(value), what), {})  # Python's encoder

    def text(self, value) -> str:
        """``str(value)`` once its size is checked."""
        if not isinstance(value, str):
            self.check(self.size(value), "a value turned into text")
            value = str(value)
        return value

    def size(self, value) -> int:
        return self.measure(value)[0]

    def measure(self, value, seen: dict | None = None) -> tuple[int, int, bool]:
        """(size, depth, frozen) of ``value``. ``size`` bounds ``len(str(value))`` from above
        up to escapes, counting each container element as at least 8 (a pointer), so a shared
        sub-value counts once per reference; ``depth``: container nesting; ``frozen``: no
        namespace (the one mutable container) is reachable. Each distinct container is
        walked once, and a walk stops adding past max_chars."""
        if isinstance(value, (str, bytes)):
            return len(value), 0, True
        if isinstance(value, int):
            return value.bit_length() // 3 + 2, 0, True
        if isinstance(value, types.MethodType):  # its str shows its object's repr
            size, depth, frozen = self.measure(value.__self__, seen)
            return size + 64, depth, frozen
        if not isinstance(value, _CONTAINERS):
            return 24, 0, True  # a float, None, or an object with a short str (Undefined, loop)
        seen = {} if seen is None else seen
        key = id(value)
        hit = seen.get(key) or self._recent.get(key)
        if hit is not None:
            return hit[:3]
        seen[key] = (16, 0, False, value)  # a namespace met again inside itself
        frozen = not isinstance(value, jinja2.utils.Namespace)
        if not frozen:
            value = value._Namespace__attrs
        children = itertools.chain.from_iterable(value.items()) if isinstance(value, dict) else value
        size, depth = 2, 0
        for child in children:
            if type(child) is str:  # most leaves, measured here rather than by a call
                size += len(child) + 8
            else:
                n, d, f = self.measure(child, seen)
                size, depth, frozen = size + n + 8, max(depth, d), frozen and f
            if size > self.max_chars:
                break
        seen[key] = (size, depth + 1, frozen, value)
        return size, depth + 1, frozen

    def keep(self, value, size: int, depth: int, frozen: bool) -> None:
        """Remember the measured size of a container the template just built, so that building
        on it (``ns.items + [x]`` in a loop) does not walk it again. Only the last few are
        kept: each pins its container until the render ends."""
        if frozen:
            recent = self._recent
            recent[id(value)] = (size, depth, frozen, value)
            if len(recent) > _RECENT:
                del recent[next(iter(recent))]

    def built(self, value, what: str):
        """``value``, a container the template just built, once its size is checked."""
        size, depth, frozen = self.measure(value)
        self.check(size, what)
        self.keep(value, size, depth, frozen)
        return value


def _state(env: "LimitedEnvironment") -> _Render:
    """The render running on this thread, or limits without a deadline (jinja folding
    constants while it compiles)."""
    render = getattr(_local, "render", None)
    return render if render is not None and render.env is env else _Render(env)


def _int(x) -> int:
    """``x`` where it is an int, else 0 (a bad argument fails in the call itself)."""
    return x if isinstance(x, int) else 0


def _arg(args, kwargs, i: int, name: str, default=None):
    return args[i] if len(args) > i else kwargs.get(name, default)


def _occurrences(text, old, count) -> int:
    """How many replacements ``text.replace(old, new, count)`` makes."""
    n = text.count(old) if old else len(text) + 1
    return min(n, count) if isinstance(count, int) and count >= 0 else n


_PRINTF_SPEC = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _percent_bound(st: _Render, fmt, values) -> int:
    """Upper bound on ``len(fmt % values)``: the format, every width and precision, and
    the arguments: each once, or with ``%(key)s`` each key's value once per use."""
    text = fmt if isinstance(fmt, str) else fmt.decode("latin-1")
    specs = _PRINTF_SPEC.findall(text)
    total = len(text) + sum(32 + _number(w) + _number(p) for _, w, p in specs)  # 32: digits
    if any(key for key, _, _ in specs) and isinstance(values, Mapping | jinja2.utils.Namespace):
        for key, _, _ in specs:
            try:
                total += st.size(values[key])
            except Exception:  # a missing key fails in the formatting itself
                pass
        return total
    positional = values if isinstance(values, tuple) else (values,)
    if any("*" in (w, p) for _, w, p in specs):  # widths taken from the arguments
        total += sum(abs(v) for v in positional if isinstance(v, int))
    return total + st.size(positional)


def _number(digits: str) -> int:
    """A width or precision from a format spec (0 for none or ``*``; 10**18 for more than 18
    digits, which no format accepts)."""
    if not digits.isdigit():
        return 0
    return int(digits) if len(digits) < 19 else 10 ** 18


def _spec_width(spec: str) -> int:
    """The largest width or precision in a ``str.format`` spec."""
    return max(map(_number, re.findall(r"\d+", spec)), default=0)


def _method_bound(st: _Render, owner, name, args, kwargs) -> int:
    """Upper bound on the size of ``owner.name(*args, **kwargs)`` for the str, bytes and int
    methods whose result can be much larger than their inputs; 0 for any other call."""
    if isinstance(owner, (str, bytes)):
        n = len(owner)
        if name in ("ljust", "rjust", "center", "zfill"):
            return max(n, _int(_arg(args, kwargs, 0, "width")))
        if name == "expandtabs":
            tabs = owner.count("\t" if isinstance(owner, str) else b"\t")
            return n + tabs * _int(_arg(args, kwargs, 0, "tabsize", 8))
        if name == "replace" and len(args) >= 2 and all(isinstance(x, (str, bytes)) for x in args[:2]):
            old, new = args[0], args[1]
            count = _occurrences(owner, old, _arg(args, kwargs, 2, "count"))
            return n + count * max(0, len(new) - len(old))
        if name == "join" and args and isinstance(args[0], list):
            return sum(len(x) for x in args[0] if isinstance(x, (str, bytes))) + n * len(args[0])
        if name == "translate" and args and isinstance(args[0], (dict, list, tuple)):
            table = args[0].values() if isinstance(args[0], dict) else args[0]
            return n * max((len(v) for v in table if isinstance(v, (str, bytes))), default=1)
    if isinstance(owner, int) and name == "to_bytes":
        return _int(_arg(args, kwargs, 0, "length", 1))
    return 0


class _BoundedStream:
    """A text stream that refuses to grow past max_chars (for ``pprint``)."""

    def __init__(self, st: _Render, what: str) -> None:
        self._st, self._what, self._parts, self._n = st, what, [], 0

    def write(self, text: str) -> None:
        self._n += len(text)
        self._st.check(self._n, self._what)
        self._parts.append(text)

    def getvalue(self) -> str:
        return "".join(self._parts)

# ---------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------

class _LimitedCodeGenerator(CodeGenerator):
    """jinja's code generator, with the template's list, tuple and dict literals and its ``~``
    concatenations passed through the environment, which checks their size, and every
    ``{% for %}`` loop's items through ``environment.ticking``, which checks the deadline
    (a loop whose body calls nothing reaches no other check)."""

    def visit_For(self, node, frame) -> None:
        ticking = jinja2.nodes.EnvironmentAttribute("ticking", lineno=node.iter.lineno)
        node.iter = jinja2.nodes.Call(ticking, [node.iter], [], None, None, lineno=node.iter.lineno)
        super().visit_For(node, frame)

    def visit_Call(self, node, frame, forward_caller=False) -> None:
        # the iterable wrapped by visit_For (templates cannot name environment attributes),
        # called directly rather than through the sandbox's environment.call
        if isinstance(node.node, jinja2.nodes.EnvironmentAttribute) and node.node.name == "ticking":
            self.write("environment.ticking(")
            self.visit(node.args[0], frame)
            self.write(")")
        else:
            super().visit_Call(node, frame, forward_caller=forward_caller)

    def _built(self, visit, node, frame) -> None:
        self.write("environment.built(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame) -> None:
        self._built(super().visit_List, node, frame)

    def visit_Dict(self, node, frame) -> None:
        self._built(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame) -> None:
        if node.ctx == "load":
            self._built(super().visit_Tuple, node, frame)
        else:  # an assignment target: {% for k, v in ... %}
            super().visit_Tuple(node, frame)

    @optimizeconst
    def visit_Concat(self, node, frame) -> None:
        # jinja joins with markup_join where autoescaping is on, str_join elsewhere
        if frame.eval_ctx.volatile:
            markup = "context.eval_ctx.autoescape"
        else:
            markup = repr(bool(frame.eval_ctx.autoescape))
        self.write("environment.concat_values((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write(f"), {markup})")


class _LimitedFormatter(SandboxedFormatter):
    """jinja's sandboxed ``str.format``, checking each field before it is formatted (a width
    such as ``{:>9999999999}``) and the running total (``{0}{0}{0}...`` of one large value)."""

    def vformat(self, format_string, args, kwargs):
        self._total = len(format_string)
        return super().vformat(format_string, args, kwargs)

    def convert_field(self, value, conversion):
        st = _state(self._env)
        st.check(self._total + st.size(value), "the result of str.format()")
        return super().convert_field(value, conversion)

    def format_field(self, value, format_spec):
        st = _state(self._env)
        st.check(self._total + max(_spec_width(format_spec), st.size(value)),
                 "the result of str.format()")
        text = super().format_field(value, format_spec)
        self._total += len(text)
        st.check(self._total, "the result of str.format()")
        return text


class _LimitedEscapeFormatter(_LimitedFormatter, EscapeFormatter):
    """:class:`_LimitedFormatter` for ``Markup.format`` (escaping its arguments)."""


@jinja2.pass_eval_context
def _join(eval_ctx, value, d="", attribute=None):
    """jinja's ``join`` filter, given ``value`` as a list so that its size is known first."""
    items = list(value)
    st = _state(eval_ctx.environment)
    st.check(st.size(items) + len(st.text(d)) * len(items), "the result of filter join")
    return jinja2.filters.sync_do_join(eval_ctx, items, d, attribute)


@jinja2.pass_environment
def _sum(environment, iterable, attribute=None, start=0):
    """jinja's ``sum`` filter; lists and tuples are added in linear time (Python's ``sum``
    copies the running total at every step)."""
    if attribute is not None:
        iterable = map(jinja2.filters.make_attrgetter(environment, attribute), iterable)
    kind = type(start)
    if kind not in (list, tuple):
        return sum(iterable, start)
    items = list(iterable)
    for item in items:
        if type(item) is not kind:
            raise TypeError(f'can only concatenate {kind.__name__} (not "{type(item).__name__}") '
                            f"to {kind.__name__}")
    st = _state(environment)
    st.check(st.size([start, *items]), "the result of filter sum")
    return kind(itertools.chain(start, *items))


# Filters that loop in Python over a whole text or list (a second or more on a max_chars
# input), run under _Render.traced.
_TRACED_FILTERS = frozenset({
    "batch", "dictsort", "groupby", "indent", "pprint", "slice", "sort", "striptags", "title",
    "unique", "urlencode", "urlize", "wordwrap", "xmlattr"})

# Filters that turn their value into text (so its size is checked first).
_STRINGIFYING = frozenset({
    "capitalize", "e", "escape", "forceescape", "lower", "safe", "string", "striptags", "title",
    "trim", "truncate", "upper", "urlencode", "urlize", "wordcount", "xmlattr", "pprint"})

def _replace_bound(st: _Render, s, old, new, count) -> int:
    """Upper bound on the size of jinja's ``replace`` filter (``str(s).replace(...)``)."""
    text, old, new = st.text(s), st.text(old), st.text(new)
    return len(text) + _occurrences(text, old, count) * max(0, len(new) - len(old))


# Filters whose result can be much larger than their inputs: name -> upper bound on the size
# of the result, from (state, the call's bound arguments).
_FILTER_BOUNDS = {
    "center": lambda st, a: max(st.size(a["value"]), _int(a["width"])),
    "indent": lambda st, a: (len(st.text(a["s"])) + (st.text(a["s"]).count("\n") + 1)
                             * (len(a["width"]) if isinstance(a["width"], str) else _int(a["width"]))),
    "wordwrap": lambda st, a: (st.size(a["s"]) * max(1, len(a["wrapstring"])
                                                     if isinstance(a["wrapstring"], str) else 1)),
    "replace": lambda st, a: _replace_bound(st, a["s"], a["old"], a["new"], a["count"]),
    "format": lambda st, a: _percent_bound(st, st.text(a["value"]), a["kwargs"] or a["args"]),
    "batch": lambda st, a: (st.size(a["value"]) + (0 if a["fill_with"] is None else
                                                   _int(a["linecount"]) * (8 + st.size(a["fill_with"])))),
    "slice": lambda st, a: (st.size(a["value"]) + _int(a["slices"])
                            * (16 + (0 if a["fill_with"] is None else 8 + st.size(a["fill_with"])))),
}


def _pass_arg(func):
    """What jinja passes a filter before its value (``@pass_context`` and the like), as a
    function of the context; None for nothing."""
    pass_arg = getattr(getattr(func, "jinja_pass_arg", None), "name", None)
    return {None: None, "context": lambda c: c, "eval_context": lambda c: c.eval_ctx,
            "environment": lambda c: c.environment}[pass_arg]


def _user_signature(func) -> inspect.Signature:
    """The signature of filter ``func`` as a template calls it: from its value on (jinja's
    async-variant filters wrap the sync function, which has the documented signature)."""
    inner = inspect.unwrap(func)
    signature = inspect.signature(inner)
    params = list(signature.parameters.values())
    if _pass_arg(inner) is not None:
        params = params[1:]
    return signature.replace(parameters=params)


def _guarded_filter(env: "LimitedEnvironment", name: str, func):
    """Filter ``func`` with its size checked: before the call, the bound of
    :data:`_FILTER_BOUNDS` or the size of a value it turns into text; after, a text result's
    length. It becomes a context filter, which jinja never runs while compiling (where
    constant folding would run it before any check could refuse it)."""
    first = _pass_arg(func)
    bound = _FILTER_BOUNDS.get(name)
    signature = _user_signature(func) if bound is not None else None
    stringifies = name in _STRINGIFYING
    traced = name in _TRACED_FILTERS
    what = f"the result of filter {name}"

    def guarded(context, *args, **kwargs):
        if bound is not None:
            st = _state(env)
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            st.check(bound(st, arguments.arguments), what)
        elif stringifies and not isinstance(args[0], str):
            st = _state(env)
            st.check(st.size(args[0]), what)
        if first is not None:
            args = (first(context), *args)
        result = _state(env).traced(func, args, kwargs) if traced else func(*args, **kwargs)
        if type(result) is str:  # the common case, checked here rather than by a call
            if len(result) > env.max_chars:
                _state(env).check(len(result), what)
            return result
        return _checked_result(_state(env), result, what)

    functools.update_wrapper(guarded, func)
    return jinja2.pass_context(guarded)


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """jinja's immutable sandbox whose operations check the size of what they build against
    ``max_chars`` before building it: the ``*``, ``+``, ``**`` and ``%`` operators, ``~``,
    literals, ``{{ }}`` output, joined output buffers (macros, ``{% set %}`` blocks), filters,
    ``str.format`` and the str / bytes methods that pad, repeat or join. The deadline is
    :class:`_Render`'s (see :func:`render_limited`).

    Args:
        max_chars: limit of the output and of any one value a template builds.
        extra_filters, extra_globals: filters and globals added to jinja's own; every filter
            is wrapped by :func:`_guarded_filter`.
        **options: jinja ``Environment`` options (``trim_blocks``, ``extensions``, ...).
    """

    code_generator_class = _LimitedCodeGenerator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, max_chars: int, *, extra_filters: Mapping | None = None,
                 extra_globals: Mapping | None = None, **options) -> None:
        super().__init__(finalize=self._finalize, **options)
        self.max_chars = max_chars
        self.filters.update(extra_filters or {}, pprint=self._pprint, join=_join, sum=_sum)
        for name, func in list(self.filters.items()):
            self.filters[name] = _guarded_filter(self, name, func)
        self.globals.update(extra_globals or {}, lipsum=self._lipsum)

    def limits(self) -> _Render:
        """The limits of the render running on this thread (see :func:`_state`)."""
        return _state(self)

    # -- what the compiled template calls
    def concat(self, parts) -> str:
        """Join of an output buffer (a macro's result, a ``{% set %}`` block, ``caller()``)."""
        parts = parts if isinstance(parts, list) else list(parts)
        _state(self).check(sum(map(len, parts)), "joined template output")
        return "".join(parts)

    def concat_values(self, values: tuple, markup: bool) -> str:
        """``a ~ b ~ ...``."""
        st = _state(self)
        size = 0
        for v in values:
            size += len(v) if isinstance(v, str) else st.size(v)
        st.check(size, "the result of '~'")
        return (markup_join if markup else str_join)(values)

    def built(self, value):
        """A list, tuple or dict literal's value."""
        return _state(self).built(value, f"a {type(value).__name__} literal")

    def ticking(self, iterable):
        """A ``{% for %}`` loop's items, the deadline checked before each."""
        st = _state(self)
        deadline, clock = st.deadline, time.monotonic
        for item in iterable:
            if clock() > deadline:
                st.expired()
            yield item

    def _finalize(self, value):
        """A ``{{ }}`` value, before jinja turns it into text."""
        if type(value) is not str:
            st = _state(self)
            st.check(st.size(value), "a {{ }} value")
        return value

    def call_binop(self, context, operator, left, right):
        if operator == "+" and type(left) is str and type(right) is str:  # the common case
            if len(left) + len(right) > self.max_chars:
                _state(self).check(len(left) + len(right), "the result of '+'")
            return left + right
        st = _state(self)
        what = f"the result of {operator!r}"
        kept = None
        if operator == "**":
            if type(left) is int and type(right) is int and right > 0 and abs(left) > 1:
                _check_int_bits(right * math.log2(abs(left)), what)
        elif operator == "*":
            kept = self._check_mul(st, left, right, what)
        elif operator == "+":
            if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
                st.check(len(left) + len(right), what)
            elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
                (a, da, fa), (b, db, fb) = st.measure(left), st.measure(right)
                st.check(a + b, what)
                kept = (a + b, max(da, db), fa and fb)
        elif operator == "%" and isinstance(left, (str, bytes)):
            st.check(_percent_bound(st, left, right), what)
        result = self.binop_table[operator](left, right)
        if kept is not None:
            st.keep(result, *kept)
            return result
        return _checked_result(st, result, what)

    @staticmethod
    def _check_mul(st: _Render, left, right, what: str):
        """Check ``left * right`` before it runs; (size, depth, frozen) of a list or tuple result."""
        if type(left) is int and type(right) is int:
            _check_int_bits(left.bit_length() + right.bit_length(), what)
            return None
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if not isinstance(n, int) or not isinstance(seq, (str, bytes, list, tuple)):
            return None
        size, depth, frozen = st.measure(seq)
        st.check(size * max(n, 0), what)
        return (size * max(n, 0), depth, frozen) if isinstance(seq, (list, tuple)) else None

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        """A call from the template (the deadline checked: a macro calling itself reaches no
        loop), with the str / bytes / int methods that pad, repeat or join checked before
        they run, and the result measured after (a text's length; a list, tuple or dict that
        may hold one value many times, as ``dict.fromkeys`` does)."""
        st = _state(__self)
        st.tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, bytes, int)):
            name = __obj.__name__
            if name == "join" and not isinstance(owner, int) and len(args) == 1 and not kwargs:
                args = (list(args[0]),)  # measured, then joined
            st.check(_method_bound(st, owner, name, args, kwargs), f"the result of {name}()")
        result = super().call(__context, __obj, *args, **kwargs)
        if type(result) in (list, tuple, dict):  # dict(a=x, b=x), fromkeys(keys, x): shared x
            return st.built(result, f"the result of {getattr(__obj, '__name__', 'a call')}()")
        return _checked_result(st, result, "the result of a call")

    def wrap_str_format(self, value):
        """jinja's sandboxed ``str.format`` / ``format_map`` (as in SandboxedEnvironment),
        formatting with :class:`_LimitedFormatter`."""
        if (not isinstance(value, (types.MethodType, types.BuiltinMethodType))
                or value.__name__ not in ("format", "format_map")
                or not isinstance(value.__self__, str)):
            return None
        f_self = value.__self__
        str_type = type(f_self)
        is_format_map = value.__name__ == "format_map"
        if isinstance(f_self, Markup):
            formatter = _LimitedEscapeFormatter(self, escape=f_self.escape)
        else:
            formatter = _LimitedFormatter(self)

        def wrapper(*args, **kwargs):
            if is_format_map:
                if kwargs:
                    raise TypeError("format_map() takes no keyword arguments")
                if len(args) != 1:
                    raise TypeError(f"format_map() takes exactly one argument ({len(args)} given)")
                kwargs, args = args[0], ()
            return str_type(formatter.vformat(f_self, args, kwargs))

        return functools.update_wrapper(wrapper, value)

    # -- filters and globals bounded in place of jinja's own
    def _pprint(self, value):
        """``pprint.pformat(value)`` (jinja's ``pprint``), written to a bounded stream."""
        stream = _BoundedStream(_state(self), "the result of filter pprint")
        pprint.PrettyPrinter(stream=stream).pprint(value)
        return stream.getvalue()[:-1]

    def _lipsum(self, n=5, html=True, min=20, max=100):  # noqa: A002 - jinja's names
        """jinja's ``lipsum`` global, with its word count checked first."""
        st = _state(self)
        st.check(_int(n) * _int(max) * 16, "the result of lipsum()")
        return st.traced(jinja2.utils.generate_lorem_ipsum, (n, html, min, max), {})


def render_limited(template: jinja2.Template, variables: dict, max_seconds: float) -> str:
    """The output of ``template`` (compiled in a :class:`LimitedEnvironment`) for
    ``variables``, as jinja's ``Template.render``, within ``max_seconds`` from now and the
    environment's ``max_chars``."""
    chunks = template.root_render_func(template.new_context(variables))
    try:
        with _Render(template.environment, max_seconds) as render:
            return render.joined(chunks, "the output")
    finally:
        chunks.close()
