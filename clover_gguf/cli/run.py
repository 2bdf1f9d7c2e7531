"""``clover-gguf run``: generate text from a prompt through :class:`~clover_gguf.model.Model`
(the flags are :mod:`clover_gguf.options`), streaming it, or one JSON object."""
from __future__ import annotations

import json
import shutil
import sys

from .. import options
from . import chat
from .common import DIM, MODEL_HELP, OFF, EXIT_OK, UsageError, add_color_arg, add_device_args, add_model_args, \
    add_reasoning_args, add_threads_ctx_args, ignore_eos_bias, load_model, model_kwargs, model_stats_timings, \
    placement_kwargs, stats_line, stream_interruptibly, use_color

_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "'": "'", '"': '"', "\\": "\\"}


def process_escapes(s: str) -> str:
    """``\\n \\r \\t \\' \\" \\\\`` and ``\\xHH`` of ``s`` as the characters they name; any other
    backslash stays (llama.cpp common.cpp string_process_escapes, the -e of its CLIs)."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):
            e = s[i + 1]
            if e in _ESCAPES:
                out.append(_ESCAPES[e])
                i += 2
                continue
            h = s[i + 2:i + 4]
            if e == "x" and len(h) == 2 and all(ch in "0123456789abcdefABCDEF" for ch in h):
                out.append(chr(int(h, 16)))
                i += 4
                continue
            out.append(s[i:i + 2])
            i += 2
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _read_prompt(a) -> str:
    """The prompt of -p, -f FILE (one trailing newline dropped, as llama.cpp) or piped stdin."""
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--file: cannot read {a.file}: {e}") from None
        return text[:-1] if text.endswith("\n") else text
    if a.prompt is not None:
        return a.prompt
    if sys.stdin is None or sys.stdin.isatty():  # `echo PROMPT | clover-gguf run`: the prompt from stdin
        raise UsageError("--prompt: required (or -f FILE, or pipe the prompt on stdin)")
    text = sys.stdin.read()
    return text[:-1] if text.endswith("\n") else text  # the newline echo and editors add, as $(...) drops it


def _chat(a) -> int:
    """-i, -cnv or -sys: llama.cpp's conversation mode, that is `clover-gguf chat` with these flags
    (-p, when given, is the first user message)."""
    if a.json or a.visual:
        raise UsageError(f"{'--json' if a.json else '--visual'}: not in a conversation (-i, -cnv, -sys)")
    if a.prompt is None and a.file is not None:
        a.prompt = _read_prompt(a)
    if a.prompt is not None and a.escape:
        a.prompt = process_escapes(a.prompt)
    a.show_thinking = True
    return chat.cmd(a)


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


class _StepView:
    """`run --visual` in ar and spec: the text of the tokens the last forward committed (ar: its
    one token; spec: the accepted draft and the verify's own token) highlighted as
    :class:`_BlockView` highlights newly filled slots, and written plain once the next forward's
    text arrives, so the terminal ends with the text as without --visual. The cursor steps back
    over the highlighted text to rewrite it, so only the part after the last line break is
    highlighted, and only when it is printable ASCII and stays on the line (else it is written
    plain; the column is unknown after other characters until the next line break)."""

    NEW, OFF = _BlockView.NEW, _BlockView.OFF

    def __init__(self, out) -> None:
        self.out = out
        self.width = max(shutil.get_terminal_size((80, 24)).columns, 20)
        self.col = 0  # cursor column, None when unknown
        self.lit = ""  # the highlighted text right before the cursor

    def step(self, new_ids, block) -> None:
        """(Model.generate_stream's on_step: the text comes through :meth:`text`.)"""

    def text(self, piece: str) -> None:
        if self.lit:  # back over the last forward's text, written plain
            self.out.write(f"\033[{len(self.lit)}D" + self.lit)
        head, nl, tail = piece.rpartition("\n")
        if nl:
            self.col = 0
        ascii_ = tail.isascii() and tail.isprintable()
        end = None if self.col is None or not ascii_ else self.col + len(tail)
        self.lit = tail if end is not None and end < self.width else ""
        self.out.write(head + nl + (self.NEW + tail + self.OFF if self.lit else tail))
        self.col = None if end is None else end % self.width
        self.out.flush()

    def finish(self) -> None:
        self.text("")


def cmd(a) -> int:
    if a.visual and a.json:
        raise UsageError("--visual, --json: give one (--visual draws the text as it is decoded on a terminal, "
                         "--json prints one object at the end)")
    if a.escape and a.stop:
        a.stop = [process_escapes(x) for x in a.stop]  # llama.cpp escapes its reverse prompts too
    if a.interactive or a.conversation or a.system_prompt is not None:
        if a.max_tokens is None:  # chat's default: until an end token
            a.max_tokens = -1
        return _chat(a)
    if a.reasoning != "auto" or a.reasoning_budget != -1 or a.chat_template_kwargs is not None:
        raise UsageError("--reasoning, --reasoning-budget and --chat-template-kwargs apply to a chat: add -cnv "
                         "(or use `clover-gguf chat`); run completes the prompt as plain text")
    if a.max_tokens is None:
        a.max_tokens = 256
    a.prompt = _read_prompt(a)
    if a.escape:
        a.prompt = process_escapes(a.prompt)
    m = load_model(a.model, a.ctx_size, a.threads, {**placement_kwargs(a), **model_kwargs(a)})
    with m:
        kw = options.from_cli(a)
        if kw["max_tokens"] is None:  # -n -1: until an end token or the context is full
            kw["max_tokens"] = m.n_ctx
        if a.ignore_eos:
            ignore_eos_bias(kw, m.end_ids)
        if a.verbose:
            _print_verbose(m, kw)
        view = None
        if a.visual and not use_color(sys.stdout):
            print("note: --visual draws in colour: stdout is not a terminal (--color on forces it); plain text",
                  file=sys.stderr)
        elif a.visual:  # diffusion: the block being denoised; ar, spec: each forward's tokens
            view = _BlockView(m, sys.stdout) if (kw["mode"] or m.default_mode) == "diffusion" else _StepView(sys.stdout)
        try:
            stream = m.generate_stream(a.prompt, on_step=view.step if view else None, **kw)
        except ValueError as e:
            raise UsageError(str(e)) from None
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
            print(DIM + line + OFF if use_color(sys.stderr) else line, file=sys.stderr)
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
        if a.verbose:
            print("stats: " + json.dumps({k: v for k, v in st.items() if k != "tokens"}), file=sys.stderr)
    return 130 if interrupted else EXIT_OK


def _print_verbose(m, kw: dict) -> None:
    """-v: the model, its context settings and the generation options on stderr."""
    hp = {k: v for k, v in m.hparams.items() if isinstance(v, (int, float, str, bool))}
    ubatch = m.n_ubatch or "the backend's"
    print(f"model: {m.path} ({m.arch}), n_ctx {m.n_ctx}, n_ubatch {ubatch}, sidecar {m.sidecar_path}",
          file=sys.stderr)
    print("hparams: " + json.dumps(hp), file=sys.stderr)
    print("options: " + json.dumps({k: v for k, v in kw.items() if v is not None}, default=str), file=sys.stderr)


def add_parser(sub) -> None:
    r = sub.add_parser("run", help="generate text from a prompt")
    r.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    src = r.add_mutually_exclusive_group()
    src.add_argument("-p", "--prompt", default=None,
                     help="prompt text (special tokens recognised); default: read from stdin when it is piped")
    src.add_argument("-f", "--file", default=None, metavar="FILE",
                     help="read the prompt from FILE (one trailing newline dropped)")
    e = r.add_mutually_exclusive_group()
    e.add_argument("-e", "--escape", action="store_true", default=False,
                   help="process \\n \\r \\t \\' \\\" \\\\ \\xHH in the prompt and --stop (default: off, the "
                        "text is taken as written; llama.cpp's default is on)")
    e.add_argument("--no-escape", dest="escape", action="store_false", help="take the prompt as written (default)")
    r.add_argument("-i", "--interactive", action="store_true",
                   help="a conversation: as `clover-gguf chat` with these flags (-p is the first message)")
    cnv = r.add_mutually_exclusive_group()
    cnv.add_argument("-cnv", "--conversation", action="store_true", help="as -i")
    cnv.add_argument("-no-cnv", "--no-conversation", dest="conversation", action="store_false",
                     help="complete the prompt as plain text (default)")
    r.add_argument("-sys", "--system-prompt", default=None, help="system prompt; makes it a conversation (-cnv)")
    r.add_argument("--ignore-eos", action="store_true",
                   help="never sample an end token (a -inf logit bias): generate until -n")
    r.add_argument("-v", "--verbose", action="store_true",
                   help="print the model, its settings and the generation options before, and every stat after")
    options.add_cli_args(r, n_default=None)
    r.add_argument("--visual", action="store_true",
                   help="on a terminal, diffusion: redraw the block being denoised in place (masked slots "
                        "dim, newly filled ones highlighted); ar and spec: highlight the tokens of the last "
                        "forward; plain output (and a note) when stdout is not a terminal")
    add_threads_ctx_args(r)
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    add_color_arg(r)
    add_reasoning_args(r, "a conversation (-cnv)")
    add_device_args(r)
    add_model_args(r)
    r.set_defaults(func=cmd)
