"""Generation options (clover-spec 5.1-5.4, 5.6), each defined once: its name (Hugging Face /
OpenAI / llama.cpp), default, command-line flag and help. :class:`~clover_gguf.model.Model`
takes them as keyword arguments, :class:`~clover_gguf.llama.Clover` and the server pass the
``request`` ones through, the CLI builds its flags from them (:func:`add_cli_args`).

A default of None means "the engine's": the GGUF's decoding record (spec 4.2) for the diffusion
and penalty fields, the mode's own for ``mode`` (diffusion for clover, ar for qwen35moe). Values
are checked where they are used (:meth:`Model._params <clover_gguf.model.Model._params>` and the
engine), each field in one place, with errors that name it.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

MODES = ("diffusion", "ar", "spec")


def int_at_least(lo: int):
    """An argparse type: an int >= lo."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v
    return parse


def positive_int(s: str) -> int:
    """An argparse type: an int > 0."""
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def _n_predict(s: str) -> int:
    """-n: a positive count, or -1 (llama.cpp's "no limit": until an end token or a full context)."""
    if s.strip() == "-1":
        return -1
    try:
        return positive_int(s)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or -1: no limit)") from None


def _seed(s: str) -> int:
    """-s/--seed: an int >= 0, or -1 (llama.cpp's "random seed"): a random one, drawn here."""
    if s.strip() == "-1":
        import secrets

        return secrets.randbelow(2**32)
    try:
        return int_at_least(0)(s)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or -1: a random seed)") from None


def _logit_bias(s: str) -> tuple[int, float]:
    """``ID=BIAS`` (also ``ID:BIAS``), e.g. ``151645=-100``."""
    k, sep, v = s.replace(":", "=", 1).partition("=")
    try:
        if not sep:
            raise ValueError
        return int(k), float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (token id, logit), got {s!r}") from None


def _opt(default, flags: tuple[str, ...], help: str, cli_type=None, request: bool = True, **cli):
    """A field of :class:`GenerateOptions`: its CLI ``flags``/``help``/``cli_type`` (extra argparse
    keywords in ``cli``) and whether it is a request field of Clover and the server."""
    meta = dict(flags=flags, help=help, cli_type=cli_type, request=request, cli=cli)
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class GenerateOptions:
    """Every option of a generation; see the module docstring."""

    max_tokens: int = _opt(256, ("-n", "--n-predict"), "max tokens to generate, -1 = until an end token or the "
                           "context is full", _n_predict)
    mode: str | None = _opt(None, ("--mode",), "decoding mode (default: diffusion for clover, ar for qwen35moe; "
                            "spec: self-speculative, the output of greedy ar in fewer forwards)", choices=MODES)
    temperature: float = _opt(0.0, ("--temp",), "temperature, 0 = greedy (0)", float)
    top_k: int = _opt(0, ("--top-k",), "top-k, 0 = off (0)", int_at_least(0))
    top_p: float = _opt(1.0, ("--top-p",), "top-p, 1 = off (1.0)", float)
    min_p: float | None = _opt(None, ("--min-p",), "min-p, applied after top-p, 0 = off (0)", float)
    presence_penalty: float | None = _opt(
        None, ("--presence-penalty",), "subtracted from already generated tokens, 0 = off (the GGUF's: 0.9 in a "
        "Clover conversion, 0 in the embedded model and parent files)", float)
    repeat_penalty: float | None = _opt(
        None, ("--repeat-penalty",), "divides positive / multiplies negative logits of prompt and generated "
        "tokens, 1 = off (the GGUF's: 1.05 in a Clover conversion, 1 in the embedded model and parent files)",
        float)
    frequency_penalty: float | None = _opt(None, ("--frequency-penalty",),
                                           "subtracted per occurrence among generated tokens, 0 = off (0)", float)
    logit_bias: dict | None = _opt(None, ("--logit-bias",), "add BIAS to the logit of token ID (repeatable; the "
                                   "last value of an ID wins)", _logit_bias, action="append", metavar="ID=BIAS")
    think_close_bias_start: int | None = _opt(
        None, ("--think-close-bias-start",), "generated token from which a ramp favours </think> in an open "
        "thinking section (GGUF default, 4096)", int_at_least(0), request=False)
    eos_bias_start: int | None = _opt(None, ("--eos-bias-start",), "generated token from which a ramp favours "
                                      "the end tokens (GGUF default, 8192)", int_at_least(0), request=False)
    bias_slope: float | None = _opt(None, ("--bias-slope",), "ramp slope in logits per generated token, 0 = "
                                    "ramps off (0.01)", float, request=False)
    bias_max: float | None = _opt(None, ("--bias-max",), "ramp cap in logits (10)", float, request=False)
    stop: str | Sequence[str] | None = _opt(None, ("--stop",), "stop string (repeatable, at most 16): generation "
                                            "ends as soon as one appears in the text, which is cut right before "
                                            "it", action="append", metavar="STR")
    seed: int = _opt(0, ("-s", "--seed"), "sampling seed (0; -1: a random one)", _seed)
    block_size: int | None = _opt(None, ("--block-size",), "diffusion block size (GGUF default)", positive_int)
    threshold: float | None = _opt(None, ("--threshold",), "diffusion confidence threshold (GGUF default)", float)
    coreset_top_p: float | None = _opt(None, ("--coreset-top-p",), "MoE block coreset top-p (GGUF default)",
                                       float)
    # constrained decoding (docs/structured-output.md); Clover and the server take OpenAI's
    # response_format and llama.cpp's grammar and give these
    grammar: str | None = _opt(None, ("--grammar",), "constrain the output to a GBNF grammar (or a Lark grammar "
                               "starting with %%llguidance)", request=False)
    json_schema: dict | str | None = _opt(None, ("-j", "--json-schema"), "constrain the output to JSON valid "
                                          "against this schema (JSON text; {} = any JSON)", request=False)
    # per generated token: its log-probability and this many most likely alternatives (0-20;
    # None = off); no flag: Clover and the server give it from OpenAI's logprobs / top_logprobs
    logprobs: int | None = _opt(None, (), "", request=False)

    @classmethod
    def of(cls, kwargs: dict) -> "GenerateOptions":
        """The options from keyword arguments; an unknown name raises TypeError naming it."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unexpected generation option {unknown[0]!r}")
        return cls(**kwargs)


FIELDS = {f.name: f for f in dataclasses.fields(GenerateOptions)}
# the options Clover's create_(chat_)completion and the server's requests carry
REQUEST_FIELDS = tuple(name for name, f in FIELDS.items() if f.metadata["request"])


def add_cli_args(p: argparse.ArgumentParser, names: Sequence[str] = tuple(FIELDS), n_default: int = 256) -> None:
    """Add the flags of the options ``names`` to ``p`` (``-n`` defaults to ``n_default``)."""
    for name in names:
        f = FIELDS[name]
        if not f.metadata["flags"]:
            continue
        default = n_default if name == "max_tokens" else f.default
        meta = f.metadata
        kw = dict(meta["cli"], help=meta["help"], default=default, dest=name)
        if meta["cli_type"] is not None:
            kw["type"] = meta["cli_type"]
        if "choices" not in kw:  # named after the flag (--temp TEMP), as argparse would without dest
            kw.setdefault("metavar", meta["flags"][-1].lstrip("-").replace("-", "_").upper())
        p.add_argument(*meta["flags"], **kw)


def from_cli(a: argparse.Namespace, names: Sequence[str] = tuple(FIELDS)) -> dict:
    """The keyword arguments of the options ``names`` from :func:`add_cli_args`'s flags; -n -1
    becomes ``max_tokens=None`` (until an end token or the context is full)."""
    kw = {name: getattr(a, name) for name in names if FIELDS[name].metadata["flags"]}
    if "max_tokens" in kw and kw["max_tokens"] <= 0:
        kw["max_tokens"] = None
    if kw.get("logit_bias") is not None:
        kw["logit_bias"] = dict(kw["logit_bias"]) or None
    return kw
