"""``clover-gguf bench``: the llama-bench-style speed table (:mod:`clover_gguf.bench`). As
llama-bench, the test flags take comma lists (and may repeat), integers also ranges
``FIRST-LAST[+STEP|*STEP]``, and one row is printed per test of each combination; ``-o`` picks
llama-bench's output formats."""
from __future__ import annotations

import argparse
import re
import sys

from ..options import int_at_least, positive_int
from .common import EXIT_OK, MODEL_HELP, UsageError, _gpu_layers_arg, add_device_args, check_model_path, gpu_layers

_RANGE = re.compile(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?")


def _int_range(lo: int):
    """One list element: an int >= lo or llama-bench's range FIRST-LAST[+STEP|*STEP] (its
    parse_int_range: FIRST, FIRST+STEP, ... up to LAST; * multiplies)."""
    def parse(s: str) -> list[int]:
        m = _RANGE.fullmatch(s.strip())
        if not m:
            raise argparse.ArgumentTypeError("expected an integer or FIRST-LAST[+STEP|*STEP]")
        first = int(m[1])
        last = first if m[2] is None else int(m[2])
        op, step = m[3] or "+", int(m[4] or 1)
        if first < lo:
            raise argparse.ArgumentTypeError(f"{first} must be >= {lo}")
        if last < first or (op == "+" and step < 1) or (op == "*" and (step < 2 or first < 1)):
            raise argparse.ArgumentTypeError("the range does not increase")
        out, i = [], first
        while i <= last:
            out.append(i)
            i = i + step if op == "+" else i * step
        return out
    return parse


def _one(parse):
    """A parser of one value as a list element parser."""
    def parse_list(s: str) -> list:
        return [parse(s)]
    return parse_list


def _top_p(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError("expected a number") from None
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"{v} must be in (0, 1]")
    return v


def _cache_type(s: str) -> str:
    if s.lower() not in ("f32", "f16"):
        raise argparse.ArgumentTypeError("expected f32 or f16")
    return s.lower()


def comma_list(parse_element):
    """An argparse type: a comma list, each element through ``parse_element`` (which returns a
    list: a range gives several); a bad element is named in the error (argparse adds the flag)."""
    def parse(s: str) -> list:
        out = []
        for elem in s.split(","):
            try:
                out.extend(parse_element(elem))
            except (argparse.ArgumentTypeError, ValueError) as e:
                raise argparse.ArgumentTypeError(f"element {elem!r} of {s!r}: {e}") from None
        return out
    return parse


def _flat(v, default) -> list:
    """A repeated list flag's values (argparse's append of lists) in order, else ``default``."""
    return [x for part in v for x in part] if v else list(default)


def cmd(a) -> int:
    from .._ffi import CloverError
    from ..bench import format_rows, run_grid, to_json

    models = [a.model] if isinstance(a.model, str) else _flat(a.model, [])
    for m in models:
        check_model_path(m)
    if a.json and a.output is not None:
        raise UsageError("--json, -o: give one (--json: the report object of each configuration; -o: "
                         "llama-bench's formats)")
    fmt = a.output or "md"
    ngl = [gpu_layers(argparse.Namespace(**dict(vars(a), n_gpu_layers=v))) for v in _flat(a.n_gpu_layers, [None])]
    ncmoe = [1 << 30] if a.cpu_moe else _flat(a.n_cpu_moe, [0])
    first = [True]

    def stream(rep):  # jsonl, csv and sql: each configuration's rows as it is done (as llama-bench)
        if a.json:
            print(to_json(rep), flush=True)
        elif fmt in ("jsonl", "csv", "sql"):
            print(format_rows(rep, fmt, header=first[0]), flush=True)
        first[0] = False

    try:
        reports = run_grid(models, n_prompt=_flat(a.n_prompt, [512]), n_gen=_flat(a.n_gen, [128]),
                           reps=a.repetitions, n_threads=_flat(a.threads, [0]),
                           block_size=_flat(a.block_size, [32]), coreset_top_p=_flat(a.coreset_top_p, [0.9]),
                           seed=a.seed, warmup=not a.no_warmup, n_gpu_layers=ngl, n_cpu_moe=ncmoe,
                           type_k=_flat(a.cache_type_k, ["f32"]), type_v=_flat(a.cache_type_v, ["f32"]),
                           n_depth=_flat(a.n_depth, [0]), diffusion_path=a.diffusion, on_report=stream)
    except (CloverError, ValueError) as e:
        raise UsageError(str(e)) from None
    if not a.json and fmt in ("md", "json"):
        print(format_rows(reports, fmt))
    sys.stdout.flush()
    return EXIT_OK


def add_parser(sub) -> None:
    # conflict_handler: bench's list forms of -ngl, --n-cpu-moe, -ctk and -ctv replace add_device_args' ones
    b = sub.add_parser("bench", conflict_handler="resolve",
                       help="llama-bench-style speed table: pp, tg, block and commit forwards")
    lst = "comma list, repeatable"
    b.add_argument("-m", "--model", action="append", type=comma_list(lambda s: [s]), default=None,
                   help=f"{MODEL_HELP}; {lst}")
    b.add_argument("-p", "--n-prompt", action="append", type=comma_list(_int_range(0)), default=None,
                   help=f"prompt tokens of pp and prefix of block/commit, 0 = none ({lst}; 512)")
    b.add_argument("-n", "--n-gen", action="append", type=comma_list(_int_range(0)), default=None,
                   help=f"tokens of tg, 0 = none ({lst}; 128)")
    b.add_argument("-d", "--n-depth", action="append", type=comma_list(_int_range(0)), default=None,
                   help=f"tokens already in the context before each test, untimed ({lst}; 0; llama-bench's -d)")
    b.add_argument("-r", "--repetitions", type=positive_int, default=5, help="repetitions of each test (5)")
    b.add_argument("-t", "--threads", action="append", type=comma_list(_int_range(0)), default=None,
                   help=f"CPU threads, 0 = all cores ({lst}; all cores)")
    b.add_argument("--block-size", action="append", type=comma_list(_int_range(1)), default=None,
                   help=f"rows of the block and commit forwards ({lst}; 32)")
    b.add_argument("--coreset-top-p", action="append", type=comma_list(_one(_top_p)), default=None,
                   help=f"coreset top-p of the block forward ({lst}; 0.9)")
    b.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the random tokens (0)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
    b.add_argument("-o", "--output", choices=["md", "json", "jsonl", "csv", "sql"], default=None,
                   help="output format (md, the table): llama-bench's, with its field names (docs/bench.md)")
    b.add_argument("--json", action="store_true", help="print each configuration's report as one JSON object "
                   "(a line each) instead of the table")
    add_device_args(b)
    b.add_argument("-ngl", "--n-gpu-layers", action="append", type=comma_list(_one(_gpu_layers_arg)), default=None,
                   metavar="N|all", help="layers whose weight products run on the GPU; all = every layer and the "
                   f"output ({lst}; default: all with --device cuda, else 0)")
    b.add_argument("-ncmoe", "--n-cpu-moe", action="append", type=comma_list(_int_range(0)), default=None,
                   metavar="N", help=f"keep the routed experts of the first N layers in system memory ({lst})")
    for flag, name in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        b.add_argument(flag, name, action="append", type=comma_list(_one(_cache_type)), default=None,
                       help=f"KV cache type of the {'keys' if flag == '-ctk' else 'values'}: f32 (default) or f16 "
                            f"({lst})")
    b.set_defaults(func=cmd)
