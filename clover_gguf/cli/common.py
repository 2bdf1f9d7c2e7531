"""What the subcommands share: errors and exit codes, loading a model with llama.cpp's
placement flags, Ctrl+C handling (llama.cpp's ``llama-cli`` behaviour: generation runs in a
worker thread while the main thread prints what it yields, so the first Ctrl+C calls
``cancel()`` at once and the answer ends with the text final so far; a second one exits
130) and the stats line."""
from __future__ import annotations

import argparse
import os
import queue
import sys
import threading

from ..options import REQUEST_FIELDS, int_at_least, positive_int

DIM, BOLD, OFF = "\033[2m", "\033[1m", "\033[0m"

# -m of every subcommand but compare and convert (the resolution is in cli.main)
MODEL_HELP = "GGUF file (default: the small Clover trained on Python's sources shipped in the package)"

EXIT_OK, EXIT_RUNTIME, EXIT_USAGE = 0, 1, 2
# the generation options chat and compare take (their modes are flags of their own)
CLOVER_OPTIONS = tuple(n for n in REQUEST_FIELDS if n != "mode")


# --ignore-eos's logit bias on every end token: llama.cpp's -inf as the engine's most negative
# finite bias (it refuses infinities); exp of it is 0 in float32
IGNORE_EOS_BIAS = -1e30


def ignore_eos_bias(kw: dict, end_ids) -> None:
    """llama.cpp's --ignore-eos on the options ``kw``: never sample one of ``end_ids``."""
    kw["logit_bias"] = {**(kw.get("logit_bias") or {}), **{t: IGNORE_EOS_BIAS for t in end_ids}}


class UsageError(Exception):
    """A bad argument or file: printed as ``error: ...``, exit 2."""


def err(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)


def check_model_path(path: str) -> None:
    if not os.path.exists(path):
        raise UsageError(f"model file not found: {path}")
    if not os.path.isfile(path):
        raise UsageError(f"model path is not a file: {path}")


def load_model(path: str, n_ctx: int, n_threads, options: dict | None = None):
    """A :class:`Model` on ``path`` with the keyword ``options`` (placement, batching); its
    warnings on stderr; bad files and arguments raise UsageError."""
    check_model_path(path)
    from .._ffi import CloverError
    from ..model import Model

    from ..preload import preload

    preload(path)  # a progress bar while a large file is read (terminal only)
    try:
        m = warn_to_stderr(Model, path, n_ctx=n_ctx, n_threads=n_threads, **(options or {}))
        print_plan(m)
        note_no_block(m)
        return m
    except (CloverError, ValueError) as e:
        raise UsageError(str(e)) from None


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


_color = "auto"  # -co/--color of the running command (set_color)


def set_color(mode: str) -> None:
    """llama.cpp's ``-co/--color on|off|auto`` for :func:`use_color`."""
    global _color
    _color = mode


def use_color(f) -> bool:
    """Whether to write ANSI colour to ``f``: --color on, or auto (the default) and ``f`` a terminal."""
    return _color == "on" or (_color == "auto" and f.isatty())


def add_color_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-co", "--color", type=_on_off_auto, nargs="?", const="on", default="auto", metavar="on|off|auto",
                   help="ANSI colour (dimmed reasoning and stats, --visual's block): auto (default) on a terminal "
                        "only, on (the flag alone) also when piped, off never")


def dim(text: str, f) -> str:
    """``text`` dimmed when colour is on for ``f`` (:func:`use_color`)."""
    return DIM + text + OFF if use_color(f) else text


def _gpu_layers_arg(s: str) -> int:
    if s == "all":
        return -1
    return int_at_least(0)(s)


def _size_arg(s: str) -> int:
    from ..placement import parse_size

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
    p.add_argument("--n-cpu-moe", type=int_at_least(0), default=0, metavar="N",
                   help="keep the routed experts of the first N layers in system memory")
    p.add_argument("--fit", action="store_true",
                   help="choose the placement from the GPU's free memory (or --gpu-budget) and print the plan")
    p.add_argument("--gpu-budget", type=_size_arg, default=None, metavar="SIZE",
                   help="GPU memory to plan for with --fit, e.g. 12G (default: what the GPU reports free)")
    for flag, name in (("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")):
        p.add_argument(flag, name, default="f32", type=_cache_type_arg, metavar="f32|f16",
                       help=f"KV cache type of the {'keys' if flag == '-ctk' else 'values'}: f32 (default, exact) or "
                            "f16 (half the memory, rounded)")


def _cache_type_arg(s: str) -> str:
    """-ctk/-ctv: f32 or f16; llama.cpp's other types (q8_0, q4_0, bf16, ...) are refused naming these."""
    from ..model import CACHE_TYPES

    if s.lower() in CACHE_TYPES:
        return s.lower()
    raise argparse.ArgumentTypeError(f"{s!r} is not a KV cache type of this runtime: f32 (exact) or f16 (half the "
                                     "memory); quantised caches (q8_0, q4_0, ...) are not implemented")


def _on_off_auto(s: str) -> str:
    """llama.cpp's [on|off|auto] values (is_truthy / is_falsey / is_autoy)."""
    v = s.lower()
    for name, words in (("on", ("on", "enabled", "true", "1")), ("off", ("off", "disabled", "false", "0")),
                        ("auto", ("auto", "-1"))):
        if v in words:
            return name
    raise argparse.ArgumentTypeError(f"expected on, off or auto, got {s!r}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """llama.cpp's loading and batching flags, as :class:`Model` options named as
    llama-cpp-python's constructor arguments (:func:`model_kwargs`): ``-b``, ``-ub``, ``-tb``,
    ``--mlock``, ``--no-mmap``, ``-fa``, and ``--jinja`` (accepted: chat templates are always Jinja)."""
    p.add_argument("-b", "--batch-size", dest="n_batch", type=positive_int, default=None, metavar="N",
                   help="most prompt rows of one prefill pass, with -ub the smaller (rounded down to a multiple "
                        "of 64, at least 64; default: 2048 on the CPU)")
    p.add_argument("-ub", "--ubatch-size", dest="n_ubatch", type=positive_int, default=None, metavar="N",
                   help="as -b (llama.cpp's physical batch)")
    p.add_argument("-tb", "--threads-batch", dest="n_threads_batch", type=int_at_least(0), default=None,
                   metavar="N", help="CPU threads of prefill and block passes (default: -t's)")
    p.add_argument("--mlock", dest="use_mlock", action="store_true",
                   help="keep the weights in RAM (mlock; a warning when the limit refuses it: ulimit -l)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mmap", dest="use_mmap", action="store_true", default=True,
                   help="map the file (default; the only way this runtime reads weights)")
    g.add_argument("--no-mmap", dest="use_mmap", action="store_false",
                   help="accepted; changes nothing (a warning says why)")
    p.add_argument("-fa", "--flash-attn", dest="flash_attn", type=_on_off_auto, nargs="?", const="on",
                   default=None, metavar="on|off|auto",
                   help="accepted; attention is always fused (on: a warning says so)")
    p.add_argument("--jinja", action="store_true", help="accepted: chat templates are always rendered with Jinja")


def model_kwargs(a) -> dict:
    """The :class:`Model` options of :func:`add_model_args`'s flags that were given."""
    kw = {name: getattr(a, name, None) for name in ("n_batch", "n_ubatch", "n_threads_batch", "flash_attn")}
    kw = {k: v for k, v in kw.items() if v is not None}
    if getattr(a, "use_mlock", False):
        kw["use_mlock"] = True
    if not getattr(a, "use_mmap", True):
        kw["use_mmap"] = False
    return kw


def add_reasoning_args(p: argparse.ArgumentParser, what: str = "the chat") -> None:
    """llama.cpp's ``-rea/--reasoning on|off|auto``, ``--reasoning-budget N`` and
    ``--chat-template-kwargs JSON`` (:func:`template_kwargs`)."""
    p.add_argument("-rea", "--reasoning", type=_on_off_auto, default="auto", metavar="on|off|auto",
                   help=f"thinking in {what}: off renders the template with enable_thinking=False, so answers are "
                        "content; on sets it True; auto (default): the template's default")
    p.add_argument("--reasoning-budget", type=int_at_least(-1), default=-1, metavar="N",
                   help="-1: unrestricted (default); 0: no thinking (as --reasoning off); N > 0 is refused "
                        "(--think-close-bias-start N ramps toward </think> from N tokens)")
    p.add_argument("--chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='extra variables of the chat template, a JSON object, e.g. \'{"enable_thinking": false}\'')


def _json_object(s: str) -> dict:
    import json

    from ..chat import check_template_kwargs

    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {s!r}")
    try:
        check_template_kwargs(v, "--chat-template-kwargs")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return v


def template_kwargs(a) -> dict | None:
    """The chat template's extra variables of :func:`add_reasoning_args`'s flags (None: none):
    ``--chat-template-kwargs`` with ``enable_thinking`` set by ``--reasoning`` (or
    ``--reasoning-budget 0``, which is ``--reasoning off``), as llama.cpp's default_template_kwargs."""
    budget, reasoning = getattr(a, "reasoning_budget", -1), getattr(a, "reasoning", "auto")
    if budget > 0:
        raise UsageError(f"--reasoning-budget: {budget}: a hard thinking budget is not implemented; 0 turns "
                         f"thinking off, and --think-close-bias-start {budget} ramps toward </think> from "
                         f"{budget} generated tokens")
    if budget == 0:
        if reasoning == "on":
            raise UsageError("--reasoning-budget 0 turns thinking off, but --reasoning is on")
        reasoning = "off"
    kw = dict(getattr(a, "chat_template_kwargs", None) or {})
    if reasoning != "auto":
        kw["enable_thinking"] = reasoning == "on"
    return kw or None


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
        from ..placement import RESERVE
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


def open_clover(path: str, a, mode=None):
    """A :class:`Clover` on ``path``; bad files and arguments raise ValueError (exit 2)."""
    from .._ffi import CloverError
    from ..llama import Clover

    from ..preload import preload

    if not os.path.isfile(path):
        raise ValueError(f"model file not found: {path}")
    preload(path)  # a progress bar while a large file is read (terminal only)
    try:
        llm = warn_to_stderr(Clover, path, n_ctx=a.ctx_size, n_threads=a.threads, mode=mode, seed=a.seed,
                             **placement_kwargs(a), **model_kwargs(a))
        print_plan(llm.engine)
        note_no_block(llm.engine)
        return llm
    except CloverError as e:
        raise ValueError(str(e)) from None


def add_threads_ctx_args(p: argparse.ArgumentParser) -> None:
    """``-t/--threads`` and ``-c/--ctx-size``."""
    p.add_argument("-t", "--threads", type=int_at_least(0), default=None, help="CPU threads (all cores)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(0), default=4096,
                   help="context length (4096; 0 = the model's training context, as llama.cpp)")
