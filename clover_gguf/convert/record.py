"""The decoding record of a Clover GGUF (clover-spec 3.1, 3.4, 4.2; docs/gguf-layout.md).

One definition of each record field: its name (the HF config key where the checkpoint may give
it, and the ``convert`` option: ``record={name: value}`` in Python, ``--name-with-dashes`` on the
command line), its GGUF key and type, its default and its valid range. ``clover_gguf/convert/convert.py`` and
``bench/make_bench_model.py`` read, check and write the record through this module only.

Sources, first that gives a field wins: the convert option; ``config.json`` (top level, then
under ``text_config``); ``generation_config.json``; for the mask token only, the one added token
of ``tokenizer.json`` whose content contains ``mask`` (spec 3.1); the default. The config key
names are [assumed] (spec 7); fields with ``config=False`` have no config key and come from the
option or the default. Importing this module never imports torch or gguf.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

U32_MAX_ENGINE = 2**31 - 1  # the engine reads u32 record keys into int32


class RecordError(ValueError):
    """A record value out of range, of the wrong type, or a mask token nothing gives; the message
    names the field and where the value came from."""


@dataclass(frozen=True)
class Field:
    """One record field. ``gtype``: "u32" | "f32" | "bool" | "str"; ``default`` None = required;
    ``lo``/``hi`` and ``lo_open`` bound numbers (hi None = unbounded); ``choices`` for strings."""

    name: str
    key: str
    gtype: str
    default: object
    config: bool
    help: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple = ()

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


FIELDS = (
    Field("mask_token_id", "tokenizer.ggml.mask_token_id", "u32", None, True,
          "the mask token (spec 3.1); below vocab_size", lo=0),
    Field("shift_logits", "diffusion.shift_logits", "bool", False, False,
          "block mode: slot j predicted by row j-1 (true) or row j (false) (spec 3.5)"),
    Field("block_size", "diffusion.block_size", "u32", 32, True, "tokens per block", lo=1, hi=1 << 16),
    Field("block_aligned", "diffusion.block_aligned", "bool", True, False,
          "blocks cover [kB, (k+1)B) (spec 3.1)"),
    Field("threshold", "diffusion.threshold", "f32", 0.95, True, "confidence threshold (spec 5.2)",
          lo=0.0, hi=1.0, lo_open=True),
    Field("moe_block_coreset_top_p", "diffusion.moe_block_coreset_top_p", "f32", 0.9, True,
          "block expert coreset routing mass (spec 5.6)", lo=0.0, hi=1.0, lo_open=True),
    Field("presence_penalty", "diffusion.presence_penalty", "f32", 0.9, True, "spec 5.4"),
    Field("frequency_penalty", "diffusion.frequency_penalty", "f32", 0.0, True, "spec 5.4"),
    Field("repetition_penalty", "diffusion.repetition_penalty", "f32", 1.05, True, "spec 5.4; > 0",
          lo=0.0, lo_open=True),
    Field("penalty_scope", "diffusion.penalty_scope", "str", "response", False,
          "response: generated tokens only; all: the prompt too (spec 5.4)", choices=("response", "all")),
    Field("think_close_bias_start", "diffusion.think_close_bias_start", "u32", 4096, True,
          "generated tokens before the </think> bias starts (spec 5.4)", lo=0, hi=U32_MAX_ENGINE),
    Field("eos_bias_start", "diffusion.eos_bias_start", "u32", 8192, True,
          "generated tokens before the end-of-text bias starts (spec 5.4)", lo=0, hi=U32_MAX_ENGINE),
    Field("bias_slope", "diffusion.bias_slope", "f32", 0.01, False, "soft-bias ramp slope [assumed]", lo=0.0),
    Field("bias_max", "diffusion.bias_max", "f32", 10.0, False, "soft-bias cap [assumed]", lo=0.0),
)
BY_NAME = {f.name: f for f in FIELDS}
MASK_SOURCES = ("the --mask-token-id option", "mask_token_id in config.json / generation_config.json",
                "one added token of tokenizer.json whose content contains 'mask'")


def parse_bool(text: str) -> bool:
    """Command-line bool: "true" or "false" (argparse type)."""
    if text in ("true", "false"):
        return text == "true"
    raise ValueError(f"{text!r} (expected true or false)")


def check(field: Field, value, source: str, vocab_size: int | None = None):
    """Return ``value`` as the field's Python type, or raise RecordError naming the field, the
    value and ``source``. The mask token must also be below ``vocab_size`` when it is given."""
    where = f"{field.name} {value!r} ({source})"
    if field.gtype == "bool":
        if not isinstance(value, bool):
            raise RecordError(f"{where}: expected true or false")
        return value
    if field.gtype == "str":
        if value not in field.choices:
            raise RecordError(f"{where}: expected one of {', '.join(field.choices)}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where}: expected a number")
    if field.gtype == "u32":
        if isinstance(value, float) and not value.is_integer():
            raise RecordError(f"{where}: expected an integer")
        value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise RecordError(f"{where}: expected a finite number")
    lo_bad = field.lo is not None and (value <= field.lo if field.lo_open else value < field.lo)
    if lo_bad or (field.hi is not None and value > field.hi):
        lo = "-inf" if field.lo is None else field.lo
        hi = "inf" if field.hi is None else field.hi
        raise RecordError(f"{where}: outside {'(' if field.lo_open else '['}{lo}, {hi}]")
    if field.name == "mask_token_id" and vocab_size is not None and value >= vocab_size:
        raise RecordError(f"{where}: not below vocab_size {vocab_size}")
    return value


def _has(d: dict, key: str) -> bool:
    return isinstance(d, dict) and d.get(key) is not None


def _read_json(path: pathlib.Path) -> dict:
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError(f"{path.name}: {e}") from None
    return d if isinstance(d, dict) else {}


def config_sources(hf_dir: pathlib.Path, config: dict) -> list[tuple[str, dict]]:
    """The places a checkpoint may give record fields, in order of precedence (module docstring)."""
    out = [("config.json", config)]
    if isinstance(config.get("text_config"), dict):
        out.append(("config.json text_config", config["text_config"]))
    out.append(("generation_config.json", _read_json(hf_dir / "generation_config.json")))
    return out


def mask_from_tokenizer(hf_dir: pathlib.Path) -> tuple[int | None, str]:
    """The id of the one added token of tokenizer.json whose content contains "mask" (spec 3.1),
    and a description of what was found (for errors)."""
    if not (hf_dir / "tokenizer.json").is_file():
        return None, "no tokenizer.json"
    tok = _read_json(hf_dir / "tokenizer.json")
    found = [(int(t["id"]), t.get("content")) for t in tok.get("added_tokens") or []
             if isinstance(t, dict) and "mask" in str(t.get("content", "")).lower()]
    if len(found) == 1:
        return found[0][0], f"tokenizer.json's added token {found[0][1]!r}"
    if not found:
        return None, "tokenizer.json has no added token containing 'mask'"
    return None, f"tokenizer.json has {len(found)} added tokens containing 'mask' ({[c for _, c in found]})"


def resolve(hf_dir, config: dict, options: dict | None, vocab_size: int) -> tuple[dict, dict]:
    """The checked record of a checkpoint: ({field: value}, {field: source}); a source is
    "option", a config file name, "tokenizer.json" or "default". Raises RecordError for an
    unknown option, a bad value (naming field and source), or no mask token (naming all three
    sources of spec 3.1)."""
    hf_dir = pathlib.Path(hf_dir)
    options = dict(options or {})
    unknown = sorted(set(options) - set(BY_NAME))
    if unknown:
        raise RecordError(f"record option {unknown[0]!r}: expected one of {', '.join(BY_NAME)}")
    places = config_sources(hf_dir, config)
    values, sources = {}, {}
    for f in FIELDS:
        if options.get(f.name) is not None:
            values[f.name], sources[f.name] = check(f, options[f.name], f"option {f.option}", vocab_size), "option"
            continue
        place = next((p for p in places if _has(p[1], f.name)), None) if f.config else None
        if place is not None:
            values[f.name] = check(f, place[1][f.name], place[0], vocab_size)
            sources[f.name] = place[0]
        elif f.name == "mask_token_id":
            mid, what = mask_from_tokenizer(hf_dir)
            if mid is None:
                raise RecordError(f"mask_token_id: none of {'; '.join(MASK_SOURCES)} gives it ({what})")
            values[f.name], sources[f.name] = check(f, mid, what, vocab_size), "tokenizer.json"
        else:
            values[f.name], sources[f.name] = f.default, "default"
    return values, sources


def defaults(mask_token_id: int) -> dict:
    """Every field at its default, with the given mask token (random benchmark models)."""
    return {f.name: (mask_token_id if f.name == "mask_token_id" else f.default) for f in FIELDS}


def format_value(v) -> str:
    return str(v).lower() if isinstance(v, bool) else f"{v:g}" if isinstance(v, float) else str(v)


def defaulted_line(values: dict, sources: dict) -> str | None:
    """One line naming the fields that took the default, or None when none did."""
    names = [f"{n} {format_value(values[n])}" for n in BY_NAME if sources.get(n) == "default"]
    return f"decoding record: default for {', '.join(names)} (docs/gguf-layout.md)" if names else None


def add_to_writer(w, values: dict) -> None:
    """Write every record field as its global GGUF key (a gguf.GGUFWriter ``w``)."""
    for f in FIELDS:
        v = values[f.name]
        {"u32": w.add_uint32, "f32": w.add_float32, "bool": w.add_bool, "str": w.add_string}[f.gtype](f.key, v)
