"""``clover-gguf chat`` and ``clover-gguf compare``, plus the
Ctrl+C handling and the stats line shared with ``run``.

Both are thin shells over :class:`clover_gguf.Clover` (``create_chat_completion`` /
``create_completion`` with ``stream=True``): the sampling flags map one to one onto its
arguments, as ``run``'s map onto :class:`~clover_gguf.Model`'s.

Ctrl+C (llama.cpp's ``llama-cli`` behaviour): generation runs in a worker thread while the
main thread prints what it yields, so the first Ctrl+C reaches the main thread at once and
calls ``cancel()`` (the forward pass in progress stops before its next layer); the answer
ends with the text final so far. A second Ctrl+C while that answer is still ending, or a
Ctrl+C at the chat prompt, exits with status 130.

Not done: prefix reuse of the committed conversation across chat turns. Every turn renders
the whole conversation with the chat template and prefills it from an empty context (the
engine resets its context at every call).
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import textwrap
import threading
import unicodedata

DIM, BOLD, OFF = "\033[2m", "\033[1m", "\033[0m"

# -m of every subcommand but compare and convert (the resolution is in cli.main)
MODEL_HELP = "GGUF file (default: the small Clover trained on Python's sources shipped in the package)"


# ---------------------------------------------------------------------------- shared
def stream_interruptibly(make_iter, cancel, handle) -> bool:
    """Iterate ``make_iter()`` in a worker thread and call ``handle(item)`` here, in the main
    thread. The first Ctrl+C calls ``cancel()`` and keeps reading until the iterator ends
    (returns True: interrupted); a second one exits the process with status 130 at once.
    An exception of the iterator is raised here; one of ``handle`` (stdout closed early: a
    BrokenPipeError) cancels the iterator and waits for the worker before it is raised, so that
    the caller may close the model the worker is using."""
    q: queue.Queue = queue.Queue()

    def work():
        try:
            for item in make_iter():
                q.put((0, item))
            q.put((1, None))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            q.put((2, e))

    t = threading.Thread(target=work, name="clover-generate", daemon=True)
    t.start()
    interrupted = False
    while True:
        try:
            try:
                kind, item = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if kind == 0:
                try:
                    handle(item)
                except Exception:
                    cancel()
                    t.join()
                    raise
                continue
        except KeyboardInterrupt:
            if interrupted:
                exit_now(130)
            interrupted = True
            cancel()
            continue
        if kind == 2:
            t.join()
            raise item
        break
    t.join()
    return interrupted


def exit_now(code: int) -> None:
    """Leave at once (a second Ctrl+C): reset the colour on a terminal, flush, _exit."""
    for f in (sys.stdout, sys.stderr):
        try:
            if f.isatty():
                f.write(OFF)
            f.write("\n")
            f.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(code)


def stats_line(timings: dict) -> str:
    """``[ prompt: X t/s | generation: Y t/s | tokens/forward: Z ]`` (llama-cli's form plus
    the diffusion statistic) from a :class:`Clover` response's ``timings``; ``prompt: -``
    when no prefill pass ran (a prompt shorter than an aligned block rides in its first block)."""
    pps = timings.get("prompt_per_second")
    return (f"[ prompt: {'-' if pps is None else f'{pps:.1f}'} t/s | generation: "
            f"{timings.get('predicted_per_second', 0.0):.1f} t/s | tokens/forward: "
            f"{timings.get('tokens_per_forward', 0.0):.2f} ]")


def model_stats_timings(st: dict) -> dict:
    """The ``timings`` fields of :func:`stats_line` from :attr:`Model.last_stats`."""
    t_prompt = float(st.get("prefill_seconds", 0.0))
    t_pred = max(float(st.get("seconds", 0.0)) - t_prompt, 0.0)
    n_gen = int(st.get("n_generated", 0))
    pps = None  # no prefill pass
    if st.get("n_forward_prefill"):
        pps = st.get("n_prompt", 0) / t_prompt if t_prompt > 0 else 0.0
    return {"prompt_per_second": pps,
            "predicted_per_second": n_gen / t_pred if t_pred > 0 else 0.0,
            "tokens_per_forward": st.get("tokens_per_forward", 0.0)}


def _dim(text: str, f) -> str:
    return DIM + text + OFF if f.isatty() else text


def _logit_bias(s: str) -> tuple[int, float]:
    """``ID=BIAS`` (also ``ID:BIAS``), e.g. ``151645=-100`` (the --logit-bias option of run,
    chat and compare)."""
    k, sep, v = s.replace(":", "=", 1).partition("=")
    try:
        if not sep:
            raise ValueError
        return int(k), float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (token id, logit), got {s!r}") from None


def _int_at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v
    return parse


def add_sampling_args(p: argparse.ArgumentParser, n_default: int) -> None:
    """The sampling / engine flags of ``chat`` and ``compare`` (a subset of ``run``'s, named as
    there; each maps onto the :class:`Clover` argument of the same name)."""
    p.add_argument("-n", "--n-predict", type=int, default=n_default,
                   help=f"max tokens per answer, -1 = until an end token or the context is full ({n_default})")
    p.add_argument("--temp", type=float, default=0.0, help="temperature, 0 = greedy (0)")
    p.add_argument("--top-k", type=_int_at_least(0), default=0, help="top-k, 0 = off (0)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p, 1 = off (1.0)")
    p.add_argument("--min-p", type=float, default=None, help="min-p, 0 = off (0)")
    p.add_argument("--presence-penalty", type=float, default=None, help="presence penalty (GGUF default)")
    p.add_argument("--repeat-penalty", type=float, default=None, help="repetition penalty (GGUF default)")
    p.add_argument("--frequency-penalty", type=float, default=None, help="frequency penalty (0)")
    p.add_argument("--logit-bias", type=_logit_bias, action="append", metavar="ID=BIAS",
                   help="add BIAS to the logit of token ID (repeatable)")
    p.add_argument("--stop", action="append", metavar="STR", help="stop string (repeatable)")
    p.add_argument("--seed", type=_int_at_least(0), default=0, help="sampling seed (0)")
    p.add_argument("--block-size", type=_int_at_least(1), default=None, help="diffusion block size (GGUF default)")
    p.add_argument("--threshold", type=float, default=None, help="diffusion confidence threshold (GGUF default)")
    p.add_argument("--coreset-top-p", type=float, default=None, help="MoE block coreset top-p (GGUF default)")
    p.add_argument("-t", "--threads", type=_int_at_least(0), default=None, help="CPU threads (all cores)")
    p.add_argument("-c", "--ctx-size", type=_int_at_least(1), default=4096, help="context length (4096)")
    add_device_args(p)


def _gpu_layers_arg(s: str) -> int:
    if s == "all":
        return -1
    return _int_at_least(0)(s)


def _size_arg(s: str) -> int:
    from .placement import parse_size

    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_device_args(p: argparse.ArgumentParser) -> None:
    """How a model is loaded: llama.cpp's placement flags ``-ngl N|all``, ``--device cpu|cuda``,
    ``--cpu-moe``, ``--n-cpu-moe N``, ``--fit`` and ``--gpu-budget SIZE``, its KV cache types
    ``-ctk``, ``-ctv``, and ``--diffusion FILE``, the sidecar of a clover_moe trunk
    (:func:`placement_kwargs`)."""
    p.add_argument("--diffusion", default=None, metavar="FILE",
                   help="diffusion sidecar of a clover_moe model without the block tensors (default: "
                        "<model stem>.diffusion.gguf beside it, when present; made by convert --diffusion-only)")
    p.add_argument("-ngl", "--n-gpu-layers", type=_gpu_layers_arg, default=None, metavar="N|all",
                   help="layers whose weight products run on the GPU; all = every layer and the output "
                        "(default: all with --device cuda, else 0)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="cpu: no GPU; cuda: the GPU (falls back to the CPU with a warning when none is usable)")
    p.add_argument("--cpu-moe", action="store_true", help="keep every routed expert in system memory")
    p.add_argument("--n-cpu-moe", type=_int_at_least(0), default=0, metavar="N",
                   help="keep the routed experts of the first N layers in system memory")
    p.add_argument("--fit", action="store_true",
                   help="choose the placement from the GPU's free memory (or --gpu-budget) and print the plan")
    p.add_argument("--gpu-budget", type=_size_arg, default=None, metavar="SIZE",
                   help="GPU memory to plan for with --fit, e.g. 12G (default: what the GPU reports free)")
    for flag, name in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        p.add_argument(flag, name, choices=["f32", "f16"], default="f32", type=str.lower,
                       help=f"KV cache type of the {'keys' if flag == '-ctk' else 'values'}: f32 (default, exact) or "
                            "f16 (half the memory, rounded)")


def gpu_layers(a) -> int:
    """n_gpu_layers from :func:`add_device_args`'s flags (-1 = all)."""
    if getattr(a, "device", None) == "cpu":
        return 0
    if getattr(a, "n_gpu_layers", None) is not None:
        return a.n_gpu_layers
    return -1 if getattr(a, "device", None) == "cuda" or getattr(a, "fit", False) else 0


def placement_kwargs(a) -> dict:
    """``n_gpu_layers``, ``n_cpu_moe``, ``gpu_budget``, ``type_k``, ``type_v`` and ``diffusion_path``
    of :class:`Clover` / ``Model`` from :func:`add_device_args`'s flags, and ``plan_callback``
    (:func:`print_plan_line`: the plan shows before the weights go to the GPU)."""
    cache = dict(type_k=getattr(a, "cache_type_k", "f32"), type_v=getattr(a, "cache_type_v", "f32"),
                 diffusion_path=getattr(a, "diffusion", None))
    if getattr(a, "device", None) == "cpu":
        return dict(n_gpu_layers=0, **cache)
    fit = getattr(a, "fit", False)
    return dict(n_gpu_layers=gpu_layers(a), n_cpu_moe=1 << 30 if getattr(a, "cpu_moe", False) else
                getattr(a, "n_cpu_moe", 0), gpu_budget=(a.gpu_budget or "free") if fit else None,
                plan_callback=print_plan_line, **cache)


def print_plan_line(plan: str) -> None:
    """``placement: PLAN`` on stderr: Model's ``plan_callback``, called before the upload."""
    print(f"placement: {plan}", file=sys.stderr, flush=True)


def print_plan(model) -> None:
    """After a load that fell back to the CPU (a placement was asked for, but no usable GPU:
    nothing offloaded, and the plan line was not printed), say so with the planned one; when
    ``--fit``'s budget holds no layer, say that instead."""
    plan = getattr(model, "placement", None)
    if not plan or getattr(model, "n_gpu_layers", 0):
        return
    if plan["n_gpu_layers"] == 0 and "budget" in plan:
        from .placement import RESERVE
        gib = 1 << 30
        print_plan_line(f"everything on the CPU (a GPU budget of {plan['budget'] / gib:.2f} GiB, less "
                        f"{RESERVE / gib:.2f} GiB kept for the CUDA context and buffers, holds no layer)")
    else:
        print_plan_line(f"everything on the CPU (the plan for a GPU was: {plan['plan']})")


def note_no_block(model) -> None:
    """A note on stderr when a clover_moe model loaded without Clover's block tensors (a llama.cpp
    GGUF with no diffusion sidecar beside it): it runs ar only, and how to get the sidecar."""
    if model.arch == "clover_moe" and not model.has_block:
        stem = model.path[:-len(".gguf")] if model.path.endswith(".gguf") else model.path
        print(f"note: {model.path} has no block tensors and no diffusion sidecar ({stem}.diffusion.gguf): "
              f"ar only; `clover-gguf convert HF_DIR --diffusion-only -o {stem}.diffusion.gguf` makes the "
              f"sidecar for diffusion and spec", file=sys.stderr, flush=True)


def warn_to_stderr(fn, *args, **kwargs):
    """fn(*args, **kwargs) with its UserWarnings (e.g. no GPU) printed as ``warning: ...`` lines."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", UserWarning)
        out = fn(*args, **kwargs)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr, flush=True)
    return out


def sampling_kwargs(a) -> dict:
    """Keyword arguments of ``Clover.create_(chat_)completion`` from :func:`add_sampling_args`'s flags."""
    return dict(max_tokens=None if a.n_predict <= 0 else a.n_predict, temperature=a.temp, top_k=a.top_k,
                top_p=a.top_p, min_p=a.min_p, presence_penalty=a.presence_penalty,
                repeat_penalty=a.repeat_penalty, frequency_penalty=a.frequency_penalty,
                logit_bias=dict(a.logit_bias or []) or None, stop=a.stop, seed=a.seed,
                block_size=a.block_size, threshold=a.threshold, coreset_top_p=a.coreset_top_p)


def _open(path: str, a, mode=None):
    """A :class:`Clover` on ``path``; bad files and arguments raise ValueError (exit 2)."""
    from ._ffi import CloverError
    from .llama import Clover

    from .preload import preload

    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    preload(path)  # a progress bar while a large file is read (terminal only)
    try:
        llm = warn_to_stderr(Clover, path, n_ctx=a.ctx_size, n_threads=a.threads, mode=mode, seed=a.seed,
                             **placement_kwargs(a))
        print_plan(llm._model)
        note_no_block(llm._model)
        return llm
    except CloverError as e:
        raise ValueError(str(e)) from None


# ---------------------------------------------------------------------------- chat
class _AnswerPrinter:
    """Prints a streamed chat answer: reasoning dimmed on a terminal (between ``<think>`` and
    ``</think>`` lines otherwise) or hidden; collects content and reasoning."""

    def __init__(self, out, show_thinking: bool) -> None:
        self.out, self.show = out, show_thinking
        self.tty = out.isatty()
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


def cmd_chat(a) -> int:
    try:
        llm = _open(a.model, a, a.mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kw = sampling_kwargs(a)
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
    with llm:
        print(_dim(f"clover-gguf chat: {a.model} ({llm._model.arch}, mode {llm.mode}). "
                   "/clear forgets the conversation, /regen redoes the last answer, /exit quits; "
                   "Ctrl+C stops an answer, Ctrl+C at the prompt exits.", err), file=err, flush=True)
        regen = 0
        while True:
            try:
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
                print(_dim("(conversation cleared)", err), file=err, flush=True)
                continue
            if cmd == "/regen":
                if msgs and msgs[-1]["role"] == "assistant":
                    msgs.pop()
                if not msgs or msgs[-1]["role"] != "user":
                    print(_dim("(nothing to regenerate)", err), file=err, flush=True)
                    continue
                regen += 1
            elif cmd.startswith("/"):
                print(_dim(f"(unknown command {cmd}: /clear, /regen, /exit)", err), file=err, flush=True)
                continue
            else:
                msgs.append({"role": "user", "content": line})
                regen = 0
            # /regen samples anew at temperature > 0 (greedy answers are identical)
            call_kw = dict(kw, seed=kw["seed"] + regen)
            printer = _AnswerPrinter(out, a.show_thinking)
            try:
                interrupted = stream_interruptibly(
                    lambda: llm.create_chat_completion(msgs, stream=True, **call_kw), llm.cancel, printer)
            except ValueError as e:  # e.g. the conversation no longer fits --ctx-size
                print(f"error: {e} (/clear starts a new conversation)", file=err, flush=True)
                msgs.pop()  # the user message that could not be answered
                continue
            printer.finish()
            if interrupted:
                print(_dim("[interrupted]", err), file=err, flush=True)
            if printer.last is not None:
                print(_dim(stats_line(printer.last["timings"]), err), file=err, flush=True)
            # the committed conversation keeps the answer text (also a cancelled one's)
            msgs.append({"role": "assistant", "content": "".join(printer.content)})


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="interactive multi-turn chat on the GGUF's chat template")
    c.add_argument("-m", "--model", default=None, help=MODEL_HELP)
    c.add_argument("-sys", "--system-prompt", default=None, help="system prompt")
    c.add_argument("--mode", choices=["diffusion", "ar", "spec"], default=None,
                   help="decoding mode (default: diffusion for clover, ar for qwen35moe)")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--show-thinking", dest="show_thinking", action="store_true", default=True,
                   help="print the reasoning (<think>...</think>), dimmed on a terminal (default)")
    g.add_argument("--hide-thinking", dest="show_thinking", action="store_false",
                   help="do not print the reasoning")
    add_sampling_args(c, -1)
    c.set_defaults(func=cmd_chat)


# ---------------------------------------------------------------------------- compare
def _width(s: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 0 if unicodedata.combining(ch) else 1
               for ch in s)


def _wrap(text: str, width: int) -> list[str]:
    lines: list[str] = []
    for para in text.replace("\t", "    ").split("\n"):
        para = "".join(ch if ch.isprintable() else "\ufffd" for ch in para)
        lines.extend(textwrap.wrap(para, width, replace_whitespace=False, drop_whitespace=False) or [""])
    return lines


def side_by_side(left: str, right: str, width: int) -> str:
    """Two columns of ``width`` total characters separated by `` | ``, each text wrapped."""
    col = max((width - 3) // 2, 10)
    a, b = _wrap(left, col), _wrap(right, col)
    rows = []
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else ""
        y = b[i] if i < len(b) else ""
        rows.append((x + " " * max(col - _width(x), 0) + " | " + y).rstrip())
    return "\n".join(rows)


def _answer(llm, prompt: str, kw: dict, chat: bool) -> dict:
    if chat:
        r = llm.create_chat_completion([{"role": "user", "content": prompt}], **kw)
        msg = r["choices"][0]["message"]
        text, reasoning = msg["content"], msg.get("reasoning_content")
    else:
        r = llm.create_completion(prompt, **kw)
        text, reasoning = r["choices"][0]["text"], None
    t = r["timings"]
    return {"text": text, "reasoning_content": reasoning, "finish_reason": r["choices"][0]["finish_reason"],
            "mode": t.get("mode"), "n_prompt": r["usage"]["prompt_tokens"],
            "n_tokens": t.get("n_generated", r["usage"]["completion_tokens"]),
            "n_forward": t.get("n_forward"), "tokens_per_forward": t.get("tokens_per_forward"),
            "seconds": t.get("seconds"), "tokens_per_second": t.get("tokens_per_second"),
            "prompt_per_second": t.get("prompt_per_second"), "generation_per_second": t.get("predicted_per_second")}


def cmd_compare(a) -> int:
    if not a.model or len(a.model) != 2:
        print("error: -m/--model: give exactly two GGUF files (-m A.gguf -m B.gguf)", file=sys.stderr)
        return 2
    if a.diffusion is not None:
        print("error: --diffusion: compare loads two models; put each sidecar beside its model as "
              "<stem>.diffusion.gguf", file=sys.stderr)
        return 2
    if a.file is not None:
        try:
            with open(a.file, encoding="utf-8") as fh:
                prompts = [ln.rstrip("\n") for ln in fh if ln.strip()]
        except OSError as e:
            print(f"error: -f/--file: {e}", file=sys.stderr)
            return 2
    else:
        prompts = list(a.prompt)
    if not prompts:
        print("error: no prompts (-p PROMPT or -f FILE with one prompt per line)", file=sys.stderr)
        return 2
    kw = sampling_kwargs(a)
    chat = not a.raw
    models, answers = [], []
    # one model in memory at a time: both may be large
    for path, mode in zip(a.model, (a.mode_a, a.mode_b)):
        try:
            llm = _open(path, a, mode)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with llm:
            models.append({"path": path, "arch": llm._model.arch, "mode": llm.mode})
            res = []
            for i, p in enumerate(prompts):
                print(f"[{os.path.basename(path)} {llm.mode}] prompt {i + 1}/{len(prompts)}",
                      file=sys.stderr, flush=True)
                try:
                    res.append(_answer(llm, p, kw, chat))
                except ValueError as e:
                    print(f"error: {e}", file=sys.stderr)
                    return 2
            answers.append(res)

    def summary(res):
        n = sum(r["n_tokens"] for r in res)
        fw = sum(r["n_forward"] or 0 for r in res)
        s = sum(r["seconds"] or 0.0 for r in res)
        return {"n_tokens": n, "n_forward": fw, "seconds": s, "tokens_per_forward": n / fw if fw else 0.0,
                "tokens_per_second": n / s if s > 0 else 0.0}

    settings = {k: v for k, v in kw.items()}
    settings.update(chat_template=chat, n_ctx=a.ctx_size)
    report = {"settings": settings, "models": models,
              "results": [{"prompt": p, "answers": [answers[0][i], answers[1][i]]} for i, p in enumerate(prompts)],
              "summary": [summary(answers[0]), summary(answers[1])]}
    width = shutil.get_terminal_size((120, 24)).columns if sys.stdout.isatty() else int(
        os.environ.get("COLUMNS", 120))
    width = max(width, 40)
    tty = sys.stdout.isatty()
    heads = [f"A: {os.path.basename(m['path'])} ({m['arch']}, {m['mode']})" for m in models]
    heads[1] = "B" + heads[1][1:]
    out = []
    for i, r in enumerate(report["results"]):
        title = f"=== prompt {i + 1}: {r['prompt']}"
        out.append(BOLD + title + OFF if tty else title)
        out.append(side_by_side(heads[0], heads[1], width))
        out.append("-" * width)

        def body(x):
            t = x["text"]
            if not t and x.get("reasoning_content") and not a.hide_thinking:
                t = "(thinking) " + x["reasoning_content"]
            return t

        out.append(side_by_side(body(r["answers"][0]), body(r["answers"][1]), width))
        out.append("-" * width)
        st = [f"{x['n_tokens']} tokens, finish {x['finish_reason']}\n{x['tokens_per_second']:.1f} t/s, "
              f"{x['tokens_per_forward']:.2f} tokens/forward" for x in r["answers"]]
        out.append(side_by_side(st[0], st[1], width))
        out.append("")
    sm = [f"total: {s['n_tokens']} tokens\n{s['tokens_per_second']:.1f} t/s, {s['tokens_per_forward']:.2f} "
          f"tokens/forward" for s in report["summary"]]
    out.append(side_by_side(sm[0], sm[1], width))
    print("\n".join(out), flush=True)
    if a.json:
        with open(a.json, "w", encoding="utf-8") as fh:
            json.dump(report, fh, ensure_ascii=False, indent=1)
        print(f"wrote {a.json}", file=sys.stderr)
    return 0


def add_compare_parser(sub) -> None:
    c = sub.add_parser("compare", help="the same prompts through two models side by side (speed, tokens/forward)")
    c.add_argument("-m", "--model", action="append", required=True,
                   help="GGUF file, given twice: -m CLOVER.gguf -m PARENT.gguf")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", action="append", help="prompt (repeatable)")
    src.add_argument("-f", "--file", help="text file with one prompt per line")
    c.add_argument("--mode-a", choices=["diffusion", "ar", "spec"], default=None,
                   help="mode of the first model (default: its own: diffusion for clover, ar for qwen35moe)")
    c.add_argument("--mode-b", choices=["diffusion", "ar", "spec"], default=None,
                   help="mode of the second model (default: its own)")
    c.add_argument("--raw", action="store_true",
                   help="complete the prompt text as is instead of sending it as a chat user message")
    c.add_argument("--hide-thinking", action="store_true",
                   help="leave a column empty when its answer is all reasoning (default: show the reasoning "
                        "there, marked (thinking))")
    c.add_argument("--json", metavar="FILE", help="also write the JSON report to FILE")
    add_sampling_args(c, 256)
    c.set_defaults(func=cmd_compare)
