"""``clover-gguf compare``: the same prompts through two models side by side (speed,
tokens/forward), through :class:`~clover_gguf.llama.Clover`."""
from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import unicodedata

from .. import options
from .common import BOLD, CLOVER_OPTIONS, OFF, add_device_args, add_threads_ctx_args, open_clover


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


def cmd(a) -> int:
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
    kw = options.from_cli(a, CLOVER_OPTIONS)
    chat = not a.raw
    models, answers = [], []
    # one model in memory at a time: both may be large
    for path, mode in zip(a.model, (a.mode_a, a.mode_b)):
        try:
            llm = open_clover(path, a, mode)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        with llm:
            models.append({"path": path, "arch": llm.engine.arch, "mode": llm.mode})
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


def add_parser(sub) -> None:
    c = sub.add_parser("compare", help="the same prompts through two models side by side (speed, tokens/forward)")
    c.add_argument("-m", "--model", action="append", required=True,
                   help="GGUF file, given twice: -m CLOVER.gguf -m PARENT.gguf")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", action="append", help="prompt (repeatable)")
    src.add_argument("-f", "--file", help="text file with one prompt per line")
    c.add_argument("--mode-a", choices=options.MODES, default=None,
                   help="mode of the first model (default: its own: diffusion for clover, ar for qwen35moe)")
    c.add_argument("--mode-b", choices=options.MODES, default=None,
                   help="mode of the second model (default: its own)")
    c.add_argument("--raw", action="store_true",
                   help="complete the prompt text as is instead of sending it as a chat user message")
    c.add_argument("--hide-thinking", action="store_true",
                   help="leave a column empty when its answer is all reasoning (default: show the reasoning "
                        "there, marked (thinking))")
    c.add_argument("--json", metavar="FILE", help="also write the JSON report to FILE")
    options.add_cli_args(c, CLOVER_OPTIONS, n_default=256)
    add_threads_ctx_args(c)
    add_device_args(c)
    c.set_defaults(func=cmd)
