"""``clover-gguf`` command line: run, chat, compare, info, logits, bench, serve, convert.

A thin shell over :class:`clover_gguf.Model` (flags map one to one onto API arguments) and
over ``convert.convert.main`` (imported only by ``convert``). Never imports torch.
Exit codes: 0 ok, 1 runtime error, 2 bad arguments or unreadable/invalid files, 130 on
Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from .cli_chat import DIM, MODEL_HELP, OFF, _logit_bias, add_chat_parser, add_compare_parser, add_device_args, \
    gpu_layers, model_stats_timings, note_no_block, placement_kwargs, print_plan, stats_line, stream_interruptibly, \
    warn_to_stderr

_EXIT_OK, _EXIT_RUNTIME, _EXIT_USAGE = 0, 1, 2


class _UsageError(Exception):
    """A bad argument or file: printed as ``error: ...``, exit 2."""


def _err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def _check_model_path(path: str) -> None:
    if not os.path.exists(path):
        raise _UsageError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise _UsageError(f"model path is not a file: {path}")


def _load(path: str, n_ctx: int, n_threads, placement: dict | None = None):
    _check_model_path(path)
    from ._ffi import CloverError
    from .api import Model

    from .preload import preload

    preload(path)  # a progress bar while a large file is read (terminal only)
    try:
        m = warn_to_stderr(Model, path, n_ctx=n_ctx, n_threads=n_threads, **(placement or {}))
        print_plan(m)
        note_no_block(m)
        return m
    except (CloverError, ValueError) as e:
        raise _UsageError(str(e)) from None


# ---------------------------------------------------------------------------- run
class _BlockView:
    """`run --visual`: the diffusion block being denoised is drawn right after the committed
    text, on the rest of the current terminal line (masked slots as a dim dot, slots filled by
    the last pass highlighted, newlines as \u23ce), and redrawn in place: the cursor always goes
    back to the end of the committed text, so that text is written exactly as without --visual."""

    DIM, NEW, OFF, CLEAR = "\033[2m", "\033[1;32m", "\033[0m", "\033[K"

    def __init__(self, model, out) -> None:
        self.tok, self.out = model.tokenizer, out
        self.block, self.prev = None, None
        self.width = max(shutil.get_terminal_size((80, 24)).columns, 20)
        self.col = 0  # column of the cursor at the end of the committed text

    def _slot(self, t: int) -> str:
        s = self.tok.token_bytes(t).decode("utf-8", "replace")
        return s.replace("\n", "\u23ce").replace("\r", "").replace("\t", " ")

    def _draw(self) -> None:
        """Clear to the end of the line, draw the block into the room left, step back."""
        self.out.write(self.CLEAR)
        room, n, parts = self.width - self.col - 2, 0, []
        if self.block and room > 0:
            ids, filled = self.block
            for j, (t, f) in enumerate(zip(ids, filled)):
                s = self._slot(t) if f else "\u00b7"
                if n + len(s) > room:
                    break
                n += len(s)
                if not f:
                    parts.append(self.DIM + s + self.OFF)
                elif not (self.prev and self.prev[1][j]):
                    parts.append(self.NEW + s + self.OFF)
                else:
                    parts.append(s)
        if n:
            self.out.write(" " + "".join(parts) + f"\033[{n + 1}D")
        self.out.flush()

    def step(self, new_ids, block) -> None:
        self.prev, self.block = self.block, block
        self._draw()

    def text(self, piece: str) -> None:
        self.out.write(self.CLEAR + piece)
        tail = piece.rsplit("\n", 1)
        self.col = (len(tail[-1]) if len(tail) > 1 else self.col + len(piece)) % self.width
        self._draw()

    def finish(self) -> None:
        self.out.write(self.CLEAR)
        self.out.flush()


def cmd_run(a) -> int:
    if a.prompt is None:  # `echo PROMPT | clover-gguf run`: the prompt from stdin
        if sys.stdin is None or sys.stdin.isatty():
            raise _UsageError("--prompt: required (or pipe the prompt on stdin)")
        a.prompt = sys.stdin.read()
        if a.prompt.endswith("\n"):  # the newline echo and editors add, as $(...) drops it
            a.prompt = a.prompt[:-1]
    m = _load(a.model, a.ctx_size, a.threads, placement_kwargs(a))
    with m:
        kw = dict(max_tokens=m.n_ctx if a.n_predict == -1 else a.n_predict, mode=a.mode, temperature=a.temp,
                  top_k=a.top_k, top_p=a.top_p, seed=a.seed, block_size=a.block_size, threshold=a.threshold,
                  coreset_top_p=a.coreset_top_p, min_p=a.min_p, presence_penalty=a.presence_penalty,
                  repeat_penalty=a.repeat_penalty, frequency_penalty=a.frequency_penalty,
                  logit_bias=dict(a.logit_bias or []) or None, think_close_bias_start=a.think_close_bias_start,
                  eos_bias_start=a.eos_bias_start, bias_slope=a.bias_slope, bias_max=a.bias_max,
                  stop=a.stop)
        view = _BlockView(m, sys.stdout) if a.visual and not a.json and sys.stdout.isatty() else None
        try:
            stream = m.generate_stream(a.prompt, on_step=view.step if view else None, **kw)
        except ValueError as e:
            raise _UsageError(str(e)) from None
        pieces = []

        def show(piece):
            pieces.append(piece)
            if view:
                view.text(piece)
            elif not a.json:
                sys.stdout.write(piece)
                sys.stdout.flush()

        # the first Ctrl+C stops the answer (the text final so far is kept), a second exits 130
        interrupted = stream_interruptibly(lambda: stream, m.cancel, show)
        if view:
            view.finish()
        st = m.last_stats
        text = "".join(pieces)
        if a.json:
            obj = {
                "text": text,
                "tokens": st["tokens"],
                "n_tokens": len(st["tokens"]),  # the answer's tokens
                "n_decoded": st["n_generated"],  # the decoder's: a stop string's whole block in diffusion
                "n_prompt": st["n_prompt"],
                "n_forward": st["n_forward"],
                "tokens_per_forward": st["tokens_per_forward"],
                "seconds": st["seconds"],
                "tokens_per_second": st["tokens_per_second"],
                "mode": st["mode"],
                "finish_reason": st["finish_reason"],
                "stop_string": st.get("stop_string"),
            }
            print(json.dumps(obj, ensure_ascii=False))
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            line = stats_line(model_stats_timings(st))
            print(DIM + line + OFF if sys.stderr.isatty() else line, file=sys.stderr)
            print(
                f"[{st['mode']}] {st['n_generated']} tokens in {st['seconds']:.3f} s "
                f"({st['tokens_per_second']:.2f} tokens/s), {st['n_forward']} forward passes, "
                f"{st['tokens_per_forward']:.2f} tokens/forward, finish: {st['finish_reason']}",
                file=sys.stderr,
            )
        room = m.n_ctx - st["n_prompt"] - st["n_generated"]
        if st["mode"] == "diffusion" and st["finish_reason"] == "length" and room > 0 and \
                st["n_generated"] < kw["max_tokens"]:
            print(f"note: the next diffusion block did not fit in the context ({room} of n_ctx {m.n_ctx} "
                  "positions left); raise -c, or use --mode ar or spec, which fill it to the end", file=sys.stderr)
    return 130 if interrupted else _EXIT_OK


# ---------------------------------------------------------------------------- info
def _summarise(v, max_items: int = 8) -> str:
    if isinstance(v, (list, tuple)):
        if len(v) <= max_items:
            return "[" + ", ".join(_summarise(x) for x in v) + "]"
        head = ", ".join(_summarise(x) for x in v[:max_items])
        return f"[{head}, ...] ({len(v)} items)"
    if isinstance(v, str):
        s = v if len(v) <= 80 else v[:77] + "..."
        return json.dumps(s, ensure_ascii=False) + (f" ({len(v)} chars)" if len(v) > 80 else "")
    if isinstance(v, float):
        return f"{v:.7g}"  # float32 values: 7 significant digits
    return str(v)


def _tensor_field(t: dict, *names, default=None):
    for n in names:
        if n in t:
            return t[n]
    return default


def cmd_info(a) -> int:
    from ._ffi import CloverError
    from .gguf import GGUFFile

    _check_model_path(a.model)
    try:
        f = GGUFFile(a.model)
    except (CloverError, ValueError) as e:
        msg = str(e)
        raise _UsageError(msg if a.model in msg else f"{a.model}: {msg}") from None
    with f:
        md = f.metadata
        out = sys.stdout
        print(f"file: {a.model}", file=out)
        print(f"metadata: {len(md)} keys", file=out)
        width = max((len(k) for k in md), default=0)
        for k, v in md.items():
            print(f"  {k:<{width}}  {_summarise(v)}", file=out)
        tensors = f.tensors
        print(f"tensors: {len(tensors)}", file=out)
        rows = []
        total = 0
        for t in tensors:
            shape = _tensor_field(t, "shape", "ne", default=())
            typ = _tensor_field(t, "type_name", "type", default="?")
            nbytes = int(_tensor_field(t, "nbytes", "n_bytes", default=0))
            off = _tensor_field(t, "offset", default="")
            total += nbytes
            rows.append((str(t.get("name")), str(typ), "{" + ", ".join(str(int(x)) for x in shape) + "}",
                         str(nbytes), str(off)))
        hdr = ("name", "type", "shape (ne)", "bytes", "offset")
        w = [max(len(r[i]) for r in rows + [hdr]) for i in range(5)]
        print("  " + "  ".join(h.ljust(w[i]) for i, h in enumerate(hdr)), file=out)
        for r in rows:
            print("  " + "  ".join(c.ljust(w[i]) for i, c in enumerate(r)), file=out)
        print(f"total tensor bytes: {total}", file=out)
    return _EXIT_OK


# ---------------------------------------------------------------------------- logits
def _parse_tokens(s: str) -> list[int]:
    try:
        ids = [int(x) for x in s.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise _UsageError(f"--tokens: expected comma-separated integers, got {s!r}") from None
    if not ids:
        raise _UsageError("--tokens: empty")
    return ids


def cmd_logits(a) -> int:
    import numpy as np

    ids = _parse_tokens(a.tokens) if a.tokens is not None else None
    out_dir = os.path.dirname(os.path.abspath(a.output))
    if not os.path.isdir(out_dir):
        raise _UsageError(f"--output: directory does not exist: {out_dir}")
    m = _load(a.model, a.ctx_size, a.threads, placement_kwargs(a))
    with m:
        if ids is None:
            ids = m.tokenize(a.prompt)
            if not ids:
                raise _UsageError("--prompt: empty (no tokens)")
        n_ctx_needed = len(ids)
        if n_ctx_needed > m.n_ctx:
            raise _UsageError(f"{n_ctx_needed} tokens do not fit --ctx-size {m.n_ctx}")
        try:
            logits = m.prefix_logits(ids)
        except ValueError as e:
            raise _UsageError(str(e)) from None
    with open(a.output, "wb") as fh:  # np.save(path) would append .npy to other names
        np.save(fh, logits)
    print(f"wrote {a.output}: float32 {list(logits.shape)} (tokens: {','.join(map(str, ids))})",
          file=sys.stderr)
    return _EXIT_OK


# ---------------------------------------------------------------------------- bench
def cmd_bench(a) -> int:
    from ._ffi import CloverError
    from .bench import format_table, run_bench, to_json

    _check_model_path(a.model)
    if not 0.0 < a.coreset_top_p <= 1.0:
        raise _UsageError(f"--coreset-top-p: {a.coreset_top_p} must be in (0, 1]")
    try:
        rep = run_bench(a.model, n_prompt=a.n_prompt, n_gen=a.n_gen, reps=a.repetitions,
                        n_threads=a.threads, block_size=a.block_size, coreset_top_p=a.coreset_top_p,
                        seed=a.seed, warmup=not a.no_warmup, n_gpu_layers=gpu_layers(a),
                        n_cpu_moe=placement_kwargs(a).get("n_cpu_moe", 0), type_k=a.cache_type_k,
                        type_v=a.cache_type_v, n_depth=a.n_depth, diffusion_path=a.diffusion)
    except (CloverError, ValueError) as e:
        raise _UsageError(str(e)) from None
    print(to_json(rep) if a.json else format_table(rep))
    return _EXIT_OK


# ---------------------------------------------------------------------------- serve
def cmd_serve(a) -> int:
    _check_model_path(a.model)
    try:  # fastapi / uvicorn are imported only here (the "server" extra)
        from .server import serve
    except ImportError as e:
        raise _UsageError(f"serve needs fastapi and uvicorn ({e}): pip install 'clover-gguf[server]'") from None
    return serve(a.model, host=a.host, port=a.port, api_key=a.api_key, n_ctx=a.ctx_size,
                 n_threads=a.threads, mode=a.mode, **placement_kwargs(a))


# ---------------------------------------------------------------------------- fit
def cmd_fit(a) -> int:
    """Print the GPU placement for a budget (or the given -ngl / --n-cpu-moe) without a GPU."""
    from .api import Model
    from .placement import describe, fit, gpu_free_bytes, placement

    _check_model_path(a.model)
    with Model(a.model, n_ctx=16, n_threads=1, type_k=a.cache_type_k, type_v=a.cache_type_v,
               diffusion_path=a.diffusion) as m:
        n_layer = int(m.hparams["n_layer"])
        budget = a.gpu_budget if a.gpu_budget is not None else gpu_free_bytes()
        if a.n_gpu_layers is not None or budget is None:
            n_cpu_moe = 1 << 30 if a.cpu_moe else a.n_cpu_moe
            plan = placement(m, -1 if a.n_gpu_layers is None else a.n_gpu_layers, n_cpu_moe, a.ctx_size)
        else:
            plan = fit(m, budget, a.ctx_size)
        plan["plan"] = describe(plan, n_layer)
        plan["n_gpu_layers_flag"] = "all" if plan["n_gpu_layers"] > n_layer else plan["n_gpu_layers"]
    if a.json:
        print(json.dumps(plan))
    else:
        print(f"{a.model}: {n_layer} layers; -ngl {plan['n_gpu_layers_flag']} --n-cpu-moe "
              f"{min(plan['n_cpu_moe'], n_layer)}")
        print(plan["plan"])
    return 0


# ---------------------------------------------------------------------------- convert
def cmd_convert(argv: list[str]) -> int:
    # Imported lazily: the converter is only needed here.
    from .convert.convert import main as convert_main

    rc = convert_main(argv)
    return 0 if rc is None else int(rc)


# ---------------------------------------------------------------------------- parser
def _n_predict(s: str) -> int:
    """-n: a positive count, or -1 (llama.cpp's "no limit": until an end token or a full context)."""
    if s.strip() == "-1":
        return -1
    try:
        return _positive_int(s)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or -1: no limit)") from None


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{v} must be >= 0")
    return v


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(
        prog="clover-gguf",
        description="Run Clover block-diffusion (and Qwen3.5/3.6-MoE) models from GGUF files.",
    )
    p.add_argument("--version", action="version", version=f"clover-gguf {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{run,chat,compare,info,logits,bench,serve,fit,convert}")
    sub.required = True

    r = sub.add_parser("run", help="generate text from a prompt")
    r.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    r.add_argument("-p", "--prompt", default=None,
                   help="prompt text (special tokens recognised); default: read from stdin when it is piped")
    r.add_argument("-n", "--n-predict", type=_n_predict, default=256,
                   help="max tokens to generate, -1 = until an end token or the context is full (256)")
    r.add_argument("--mode", choices=["diffusion", "ar", "spec"], default=None,
                   help="decoding mode (default: diffusion for clover, ar for qwen35moe; spec: "
                        "self-speculative, the output of greedy ar in fewer forwards)")
    r.add_argument("--temp", type=float, default=0.0, help="temperature, 0 = greedy (0)")
    r.add_argument("--top-k", type=_nonneg_int, default=0, help="top-k, 0 = off (0)")
    r.add_argument("--top-p", type=float, default=1.0, help="top-p, 1 = off (1.0)")
    r.add_argument("--min-p", type=float, default=None, help="min-p, applied after top-p, 0 = off (0)")
    r.add_argument("--presence-penalty", type=float, default=None,
                   help="subtracted from already generated tokens, 0 = off (the GGUF's: 0.9 in a Clover "
                        "conversion, 0 in the embedded model and parent files)")
    r.add_argument("--repeat-penalty", type=float, default=None,
                   help="divides positive / multiplies negative logits of prompt and generated tokens, "
                        "1 = off (the GGUF's: 1.05 in a Clover conversion, 1 in the embedded model and parent files)")
    r.add_argument("--frequency-penalty", type=float, default=None,
                   help="subtracted per occurrence among generated tokens, 0 = off (0)")
    r.add_argument("--logit-bias", type=_logit_bias, action="append", metavar="ID=BIAS",
                   help="add BIAS to the logit of token ID (repeatable; the last value of an ID wins)")
    r.add_argument("--think-close-bias-start", type=_nonneg_int, default=None,
                   help="generated token from which a ramp favours </think> in an open thinking section "
                        "(GGUF default, 4096)")
    r.add_argument("--eos-bias-start", type=_nonneg_int, default=None,
                   help="generated token from which a ramp favours the end tokens (GGUF default, 8192)")
    r.add_argument("--bias-slope", type=float, default=None,
                   help="ramp slope in logits per generated token, 0 = ramps off (0.01)")
    r.add_argument("--bias-max", type=float, default=None, help="ramp cap in logits (10)")
    r.add_argument("--visual", action="store_true",
                   help="diffusion: redraw the block being denoised in place on a terminal (masked slots "
                        "dim, newly filled ones highlighted); plain output when stdout is not a terminal")
    r.add_argument("--stop", action="append", metavar="STR",
                   help="stop string (repeatable, at most 16): generation ends as soon as one appears in "
                        "the text, which is cut right before it")
    r.add_argument("--seed", type=_nonneg_int, default=0, help="sampling seed (0)")
    r.add_argument("--block-size", type=_positive_int, default=None, help="diffusion block size (GGUF default)")
    r.add_argument("--threshold", type=float, default=None, help="diffusion confidence threshold (GGUF default)")
    r.add_argument("--coreset-top-p", type=float, default=None, help="MoE block coreset top-p (GGUF default)")
    r.add_argument("-t", "--threads", type=_nonneg_int, default=None, help="CPU threads (all cores)")
    r.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, help="context length (4096)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_device_args(r)
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("info", help="print GGUF metadata and the tensor table")
    i.add_argument("model", help="GGUF file")
    i.set_defaults(func=cmd_info)

    lg = sub.add_parser("logits", help="write prefix-mode logits [n_tokens, n_vocab] float32 to .npy")
    lg.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    src = lg.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    lg.add_argument("-o", "--output", required=True, help="output .npy file")
    lg.add_argument("-t", "--threads", type=_nonneg_int, default=None, help="CPU threads (all cores)")
    lg.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, help="context length (4096)")
    add_device_args(lg)
    lg.set_defaults(func=cmd_logits)

    add_chat_parser(sub)     # clover_gguf/cli_chat.py
    add_compare_parser(sub)

    b = sub.add_parser("bench", help="llama-bench-style speed table: pp, tg, block and commit forwards")
    b.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    b.add_argument("-p", "--n-prompt", type=_positive_int, default=512, help="prompt tokens of pp and prefix of block/commit (512)")
    b.add_argument("-n", "--n-gen", type=_positive_int, default=128, help="tokens of tg (128)")
    b.add_argument("-d", "--n-depth", type=_nonneg_int, default=0,
                   help="tokens already in the context before each test, untimed (0; llama-bench's -d)")
    b.add_argument("-r", "--repetitions", type=_positive_int, default=5, help="repetitions of each test (5)")
    b.add_argument("-t", "--threads", type=_nonneg_int, default=None, help="CPU threads (all cores)")
    b.add_argument("--block-size", type=_positive_int, default=32, help="rows of the block and commit forwards (32)")
    b.add_argument("--coreset-top-p", type=float, default=0.9, help="coreset top-p of the block forward (0.9)")
    b.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the random tokens (0)")
    b.add_argument("--no-warmup", action="store_true", help="skip the warm-up run")
    b.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_device_args(b)
    b.set_defaults(func=cmd_bench)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                        "/v1/models, /health, /metrics)")
    sv.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    sv.add_argument("--port", type=_nonneg_int, default=8080, help="port (8080)")
    sv.add_argument("--api-key", default=os.environ.get("CLOVER_API_KEY"),
                    help="require Authorization: Bearer KEY on /v1 (default: $CLOVER_API_KEY, else none)")
    sv.add_argument("--mode", choices=["diffusion", "ar", "spec"], default=None,
                    help="default decoding mode of requests (diffusion for clover, ar for qwen35moe)")
    sv.add_argument("-t", "--threads", type=_nonneg_int, default=None, help="CPU threads (all cores)")
    sv.add_argument("-c", "--ctx-size", type=_positive_int, default=4096, help="context length (4096)")
    add_device_args(sv)
    sv.set_defaults(func=cmd_serve)

    ft = sub.add_parser("fit", help="print the GPU placement (bytes on the GPU and on the CPU) for a memory "
                        "budget, or for -ngl / --n-cpu-moe; needs no GPU")
    ft.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    add_device_args(ft)
    ft.add_argument("-c", "--ctx-size", type=_positive_int, default=4096,
                    help="context length whose caches are counted on the GPU (4096)")
    ft.add_argument("--json", action="store_true", help="print one JSON object")
    ft.set_defaults(func=cmd_fit)

    # Parsed by the converter itself (see main); listed here for --help.
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF "
                   "(clover-gguf convert HF_DIR -o OUT.gguf [--outtype TYPE] [--split | --diffusion-only] "
                   "[--arch clover_moe|qwen35moe]; clover-gguf convert --help lists the types and options)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``clover-gguf``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] == "convert":
            try:
                return cmd_convert(argv[1:])
            except (FileNotFoundError, NotADirectoryError, ValueError) as e:
                raise _UsageError(str(e)) from None
        parser = build_parser()
        a = parser.parse_args(argv)
        if getattr(a, "model", "") is None:  # no -m: the small trained Clover shipped in the package
            from . import DEFAULT_MODEL

            a.model = DEFAULT_MODEL
        return a.func(a)
    except _UsageError as e:
        _err(str(e))
        return _EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return 130
    except BrokenPipeError:
        # stdout closed early (e.g. piped into head): not an error of ours.
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return _EXIT_OK
    except Exception as e:  # runtime failure: one line, no traceback (CLOVER_DEBUG=1 shows it)
        if os.environ.get("CLOVER_DEBUG"):
            raise
        _err(f"{type(e).__name__}: {e}" if not str(e).startswith(type(e).__name__) else str(e))
        return _EXIT_RUNTIME


if __name__ == "__main__":
    sys.exit(main())
