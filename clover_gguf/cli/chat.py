"""``clover-gguf chat``: interactive multi-turn chat through :class:`~clover_gguf.llama.Clover`
(``create_chat_completion`` with ``stream=True``) on the GGUF's chat template.

Every turn renders the whole conversation with the chat template and prefills it from an empty
context: the committed conversation is not reused as a prefix across turns."""
from __future__ import annotations

import sys

from .. import options
from .common import CLOVER_OPTIONS, DIM, OFF, MODEL_HELP, add_color_arg, add_device_args, add_model_args, \
    add_reasoning_args, add_threads_ctx_args, dim, ignore_eos_bias, open_clover, stats_line, stream_interruptibly, \
    template_kwargs, use_color


class _AnswerPrinter:
    """Prints a streamed chat answer: reasoning dimmed on a terminal (between ``<think>`` and
    ``</think>`` lines otherwise) or hidden; collects content and reasoning."""

    def __init__(self, out, show_thinking: bool) -> None:
        self.out, self.show = out, show_thinking
        self.tty = use_color(out)  # dimmed reasoning, else between <think> lines
        self.content, self.reasoning = [], []
        self.in_reasoning = False
        self.last = None  # the final chunk (finish_reason, usage, timings)

    def __call__(self, chunk: dict) -> None:
        ch = chunk["choices"][0]
        if ch.get("finish_reason") is not None:
            self.last = chunk
        d = ch.get("delta", {})
        if d.get("reasoning_content"):
            self.reasoning.append(d["reasoning_content"])
            if self.show:
                if not self.in_reasoning and not self.tty:
                    self.out.write("<think>\n")
                self.in_reasoning = True
                self.out.write(DIM + d["reasoning_content"] + OFF if self.tty else d["reasoning_content"])
        if d.get("content"):
            self._end_reasoning()
            self.content.append(d["content"])
            self.out.write(d["content"])
        self.out.flush()

    def _end_reasoning(self) -> None:
        if self.in_reasoning:
            self.out.write("\n\n" if self.tty else "\n</think>\n\n")
            self.in_reasoning = False

    def finish(self) -> None:
        if self.in_reasoning:  # an answer that ended inside its reasoning
            self.out.write("\n" if self.tty else "\n</think>\n")
            self.in_reasoning = False
        else:
            self.out.write("\n")
        self.out.flush()


def cmd(a) -> int:
    tkw = template_kwargs(a)  # before the load: a bad --reasoning-budget exits 2 at once
    try:
        llm = open_clover(a.model, a, a.mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = options.from_cli(a, CLOVER_OPTIONS)
    if getattr(a, "ignore_eos", False):
        ignore_eos_bias(kw, llm.engine.end_ids)
    try:  # bad sampling flags exit 2 now, not at the first answer
        llm.check_args(**kw)
    except ValueError as e:
        llm.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    out, err = sys.stdout, sys.stderr
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
    system = [{"role": "system", "content": a.system_prompt}] if a.system_prompt else []
    msgs = list(system)
    first = getattr(a, "prompt", None)  # run -cnv -p TEXT: the first user message
    with llm:
        print(dim(f"clover-gguf chat: {a.model} ({llm.engine.arch}, mode {llm.mode}). "
                   "/clear forgets the conversation, /regen redoes the last answer, /exit quits; "
                   "Ctrl+C stops an answer, Ctrl+C at the prompt exits.", err), file=err, flush=True)
        regen = 0
        while True:
            try:
                if first is not None:
                    line, first = first, None
                    out.write(f"> {line}\n")
                else:
                    line = input("> ")
            except EOFError:
                out.write("\n")
                return 0
            except KeyboardInterrupt:
                out.write("\n")
                out.flush()
                return 130
            cmd = line.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/clear":
                msgs, regen = list(system), 0
                print(dim("(conversation cleared)", err), file=err, flush=True)
                continue
            if cmd == "/regen":
                if msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
                if not msgs or msgs[-1]["role"] != "user":
                    print(dim("(nothing to regenerate)", err), file=err, flush=True)
                    continue
                regen += 1
            elif cmd.startswith("/"):
                print(dim(f"(unknown command {cmd}: /clear, /regen, /exit)", err), file=err, flush=True)
                continue
            else:
                msgs.append({"role": "user", "content": line})
                regen = 0
            # /regen samples anew at temperature > 0 (greedy answers are identical)
            call_kw = dict(kw, seed=kw["seed"] + regen, chat_template_kwargs=tkw)
            printer = _AnswerPrinter(out, a.show_thinking)
            try:
                interrupted = stream_interruptibly(
                    lambda: llm.create_chat_completion(msgs, stream=True, **call_kw), llm.cancel, printer)
            except ValueError as e:  # e.g. the conversation does not fit --ctx-size any more
                print(f"error: {e} (/clear starts a new conversation)", file=err, flush=True)
                msgs.pop()  # the user message that could not be answered
                continue
            printer.finish()
            if interrupted:
                print(dim("[interrupted]", err), file=err, flush=True)
            if printer.last is not None:
                print(dim(stats_line(printer.last["timings"]), err), file=err, flush=True)
            # the committed conversation keeps the answer text (also a cancelled one's)
            msgs.append({"role": "assistant", "content": "".join(printer.content)})


def add_parser(sub) -> None:
    c = sub.add_parser("chat", help="interactive multi-turn chat on the GGUF's chat template")
    c.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    c.add_argument("-sys", "--system-prompt", default=None, help="system prompt")
    c.add_argument("--mode", choices=options.MODES, default=None,
                   help="decoding mode (default: diffusion for clover, ar for qwen35moe)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--show-thinking", dest="show_thinking", action="store_true", default=True,
                   help="print the reasoning (<think>...</think>), dimmed on a terminal (default)")
    g.add_argument("--hide-thinking", dest="show_thinking", action="store_false",
                   help="do not print the reasoning")
    c.add_argument("-i", "--interactive", "-cnv", "--conversation", action="store_true",
                   help="accepted: chat is llama.cpp's conversation mode")
    c.add_argument("--ignore-eos", action="store_true",
                   help="never sample an end token (a -inf logit bias): every answer runs to -n")
    add_reasoning_args(c)
    options.add_cli_args(c, CLOVER_OPTIONS, n_default=-1)
    add_threads_ctx_args(c)
    add_color_arg(c)
    add_device_args(c)
    add_model_args(c)
    c.set_defaults(func=cmd)


