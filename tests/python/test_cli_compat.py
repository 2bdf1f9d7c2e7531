"""llama.cpp's flags on ``clover-gguf run``, ``chat`` and ``serve`` (docs/cli.md, "llama.cpp's
flags") and the :class:`Model` options behind them (llama-cpp-python's constructor names).

References: the same Model without the option (prefill logits bit for bit, tokens), the Python
API for the prompt a flag should produce (``-f``, ``-e``), :class:`Clover` with
``enable_thinking=False`` for ``--reasoning off``, /proc for threads and locked memory. The CLI
runs in this process (``cli.main``) unless a test needs a fresh process.
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import clover_gguf
from clover_gguf import DEFAULT_MODEL, Model, compat
from clover_gguf import model as model_mod
from clover_gguf.cli import build_parser, main
from clover_gguf.cli.common import model_kwargs, template_kwargs
from clover_gguf.cli.run import process_escapes

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PKG_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(clover_gguf.__file__)))
SOURCE = open(model_mod.__file__, encoding="utf-8").read()


def run_cli(capsys, *args, stdin: str | None = None, monkeypatch=None) -> tuple[int, str, str]:
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = main([str(x) for x in args])
    out, err = capsys.readouterr()
    return rc, out, err


def child(code: str, **kw) -> subprocess.CompletedProcess:
    """``code`` in a fresh Python process that imports this checkout's package."""
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=PKG_PARENT, timeout=300, **kw)


@pytest.fixture(scope="module")
def ids():
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2) as m:
        return m.tokenize(SOURCE)[:300]


# ------------------------------------------------------------------ Model options


def test_n_ubatch_prefills_in_passes_with_the_same_logits(ids):
    """n_ubatch / n_batch: passes of at most min(n_batch, n_ubatch) rows rounded down to 64; the
    logits equal one pass's bit for bit (CPU), and the stats count the passes."""
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2) as whole:
        ref = whole.prefix_logits(ids)
        ref129 = whole.prefix_logits(ids[:129])
        toks = whole.generate_tokens(ids, max_tokens=6, mode="ar")[0]
        assert whole.last_stats["n_forward_prefill"] == 1 and whole.n_ubatch == 0
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2, n_batch=512, n_ubatch=100) as m:
        assert m.n_ubatch == 64
        assert np.array_equal(m.prefix_logits(ids), ref)
        assert np.array_equal(m.prefix_logits(ids[:129]), ref129)  # 64 + 65: no 1-row pass
        assert m.generate_tokens(ids, max_tokens=6, mode="ar")[0] == toks
        assert m.last_stats["n_forward_prefill"] == 5  # 64 * 4 + 44 rows
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2, n_batch=200) as m:
        assert m.n_ubatch == 192
        assert m.generate_tokens(ids, max_tokens=6, mode="ar")[0] == toks
        assert m.last_stats["n_forward_prefill"] == 2
    for bad in ({"n_batch": 0}, {"n_ubatch": -64}, {"n_ubatch": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Model(DEFAULT_MODEL, n_ctx=64, **bad)


def test_n_ubatch_keeps_diffusion_output(ids):
    kw = dict(max_tokens=40, mode="diffusion")
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2) as m:
        ref = m.generate_tokens(ids[:260], **kw)[0]
    with Model(DEFAULT_MODEL, n_ctx=1024, n_threads=2, n_ubatch=64) as m:
        assert m.generate_tokens(ids[:260], **kw)[0] == ref
        assert m.last_stats["n_forward_prefill"] > 1


def test_n_threads_batch_runs_prefill_on_its_threads():
    """n_threads 1 with n_threads_batch 3: a prefill starts two more OpenMP workers than with
    n_threads_batch 1."""
    code = """
        import os, sys
        from clover_gguf import Model, DEFAULT_MODEL
        tb = int(sys.argv[1])
        with Model(DEFAULT_MODEL, n_ctx=512, n_threads=1, n_threads_batch=tb) as m:
            before = len(os.listdir("/proc/self/task"))
            m.prefix_logits(m.tokenize(open(m.path.replace("models/clover-tiny-q8_0.gguf", "model.py")).read())[:200])
            print(len(os.listdir("/proc/self/task")) - before)
    """
    grown = {}
    for tb in (1, 3):
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code), str(tb)], capture_output=True, text=True,
                           cwd=PKG_PARENT, timeout=300)
        assert r.returncode == 0, r.stderr
        grown[tb] = int(r.stdout.split()[-1])
    assert grown[3] - grown[1] >= 2, grown
    with pytest.raises(ValueError, match="n_threads_batch"):
        Model(DEFAULT_MODEL, n_ctx=64, n_threads_batch=-1)


def test_use_mlock_locks_the_weights_or_warns():
    """use_mlock: VmLck grows by the file's size; with RLIMIT_MEMLOCK 0 (as an unprivileged
    user) a UserWarning gives the reason and the model still loads."""
    code = """
        import warnings
        from clover_gguf import Model, DEFAULT_MODEL
        def locked():
            return int(open("/proc/self/status").read().split("VmLck:")[1].split()[0]) * 1024
        before = locked()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            m = Model(DEFAULT_MODEL, n_ctx=64, use_mlock=True)
        print(locked() - before)
        print("|".join(str(x.message) for x in w))
        print(len(m.tokenize("hello")))
    """
    import resource

    size = os.path.getsize(DEFAULT_MODEL)
    r = child(code)
    assert r.returncode == 0, r.stderr
    grown, warned, n = r.stdout.splitlines()
    assert int(grown) >= size and warned == ""

    def limited():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (0, 0))
        if os.geteuid() == 0:  # root ignores the limit with CAP_IPC_LOCK (14): drop it from the bounding set
            import ctypes

            if ctypes.CDLL(None, use_errno=True).prctl(24, 14, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
                raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP CAP_IPC_LOCK")

    r = child(code, preexec_fn=limited)
    assert r.returncode == 0, r.stderr
    grown, warned, n = r.stdout.splitlines()
    assert int(grown) == 0 and int(n) > 0
    assert warned.startswith("use_mlock: ") and "mlock of" in warned and "ulimit -l" in warned


@pytest.mark.parametrize("kw, name", [({"flash_attn": True}, "flash_attn"), ({"flash_attn": "on"}, "flash_attn"),
                                      ({"use_mmap": False}, "use_mmap")])
def test_options_without_effect_warn_once(kw, name):
    compat.reset_warnings()
    with pytest.warns(UserWarning, match=f"^{name}=.*has no effect: " + re.escape(compat.MODEL[name][1])) as w:
        Model(DEFAULT_MODEL, n_ctx=64, **kw).close()
    assert len(w) == 1
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: silent
        Model(DEFAULT_MODEL, n_ctx=64, **kw).close()
        Model(DEFAULT_MODEL, n_ctx=64, flash_attn="auto").close()
        Model(DEFAULT_MODEL, n_ctx=64, flash_attn=False).close()
    with pytest.raises(ValueError, match="flash_attn"):
        Model(DEFAULT_MODEL, n_ctx=64, flash_attn="maybe")


# ------------------------------------------------------------------ flags


def test_llama_flags_parse_as_llama_cpp():
    p = build_parser()
    a = p.parse_args(["run", "-cnv", "-sys", "S", "-s", "5", "-ctk", "F16", "-b", "128", "-ub", "64", "-tb", "3",
                      "--mlock", "--no-mmap", "-fa", "--jinja", "-co", "-rea", "off"])
    assert a.conversation and a.system_prompt == "S" and a.seed == 5 and a.ctx_size == 4096
    assert a.cache_type_k == "f16" and a.color == "on" and a.reasoning == "off"
    assert model_kwargs(a) == {"n_batch": 128, "n_ubatch": 64, "n_threads_batch": 3, "flash_attn": "on",
                               "use_mlock": True, "use_mmap": False}
    assert model_kwargs(p.parse_args(["chat"])) == {} and model_kwargs(p.parse_args(["serve", "-fa", "off"])) == \
        {"flash_attn": "off"}
    assert p.parse_args(["run", "-i"]).interactive and p.parse_args(["run", "-e"]).escape
    assert not p.parse_args(["run", "-no-cnv"]).conversation and p.parse_args(["chat", "-cnv"]).interactive
    assert 0 <= p.parse_args(["run", "-s", "-1"]).seed < 2**32
    assert template_kwargs(p.parse_args(["chat", "--reasoning-budget", "0"])) == {"enable_thinking": False}
    assert template_kwargs(p.parse_args(["serve", "--chat-template-kwargs", '{"a": 1}', "--reasoning", "on"])) == \
        {"a": 1, "enable_thinking": True}
    assert template_kwargs(p.parse_args(["chat"])) is None


@pytest.mark.parametrize("args, field", [
    (["run", "-p", "x", "-ctk", "q8_0"], "q8_0.*f32.*f16"),
    (["chat", "--reasoning-budget", "100"], "--reasoning-budget: 100.*--think-close-bias-start"),
    (["chat", "--chat-template-kwargs", "{bad"], "--chat-template-kwargs.*not JSON"),
    (["chat", "--chat-template-kwargs", "[1]"], "--chat-template-kwargs.*JSON object"),
    (["run", "-p", "x", "--reasoning", "off"], "--reasoning.*-cnv"),
    (["run", "-p", "x", "-f", "y"], "-f/--file: not allowed with argument -p/--prompt"),
    (["run", "-p", "x", "-fa", "maybe"], "-fa/--flash-attn.*on, off or auto"),
    (["run", "-cnv", "--json"], "--json: not in a conversation"),
    (["serve", "-cnv"], r"-cnv: not a flag of `clover-gguf serve` \(nor -c nv\)"),
    (["run", "-p", "x", "-ot", "exps=CPU"], "-ot: not a flag of `clover-gguf run`"),
])
def test_refused_flags_say_what_to_use(capsys, args, field):
    try:
        rc = main(args)
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2
    assert re.search(field, capsys.readouterr().err)


def test_process_escapes_as_llama_cpp():
    assert process_escapes(r"a\nb\tc\\d\'\"\x41\q\x4") == "a\nb\tc\\d'\"A\\q\\x4"


def _json_run(capsys, *args):
    rc, out, err = run_cli(capsys, "run", "-n", 4, "--mode", "ar", "-t", 2, "--json", *args)
    assert rc == 0, err
    return json.loads(out)


def test_file_and_escape_give_the_prompt(capsys, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("def f(x):\n    return x\n", encoding="utf-8")
    literal = r"def f(x):\n    return x"
    with Model(DEFAULT_MODEL, n_ctx=64) as m:
        n_real, n_literal = len(m.tokenize("def f(x):\n    return x")), len(m.tokenize(literal))
    from_file = _json_run(capsys, "-f", f)
    assert from_file["n_prompt"] == n_real != n_literal
    assert _json_run(capsys, "-p", literal, "-e") == {**from_file, "seconds": _ANY, "tokens_per_second": _ANY}
    assert _json_run(capsys, "-p", literal)["n_prompt"] == n_literal  # default: as written


class _Any:
    def __eq__(self, other):
        return True


_ANY = _Any()


def test_ignore_eos_generates_until_n(capsys, monkeypatch):
    with Model(DEFAULT_MODEL, n_ctx=64) as m:
        end = m.end_ids[0]
    pulled = ("-p", "def f(x):", "--logit-bias", f"{end}=30")
    assert _json_run(capsys, *pulled)["finish_reason"] == "stop"
    r = _json_run(capsys, *pulled, "--ignore-eos")
    assert r["finish_reason"] == "length" and r["n_tokens"] == 4 and end not in r["tokens"]
    rc, out, err = run_cli(capsys, "chat", "-n", 4, "--mode", "ar", "-t", 2, "--logit-bias", f"{end}=30",
                           "--ignore-eos", "-rea", "off", stdin="hi\n", monkeypatch=monkeypatch)
    assert rc == 0 and len(out.split("\n", 1)[0]) > len("> ") and "<|im_end|>" not in out


def test_verbose_and_color(capsys):
    rc, out, err = run_cli(capsys, "run", "-p", "def f(x):", "-n", 4, "-t", 2, "-v")
    assert rc == 0 and "hparams: " in err and "options: " in err
    stats = json.loads(err.split("stats: ", 1)[1].splitlines()[0])
    assert stats["n_generated"] == 4 and not ANSI.search(out + err)
    rc, out, err = run_cli(capsys, "run", "-p", "def f(x):", "-n", 4, "-t", 2, "--visual", "--color", "--jinja")
    assert rc == 0 and ANSI.search(out) and ANSI.search(err)  # forced although captured (not a tty)
    rc, out, err = run_cli(capsys, "run", "-p", "def f(x):", "-n", 4, "-t", 2, "--visual", "-co", "off")
    assert rc == 0 and not ANSI.search(out + err)


def test_batch_flags_reach_the_model(capsys):
    prompt = SOURCE[:1500]
    rc, out, err = run_cli(capsys, "run", "-p", prompt, "-n", 2, "--mode", "ar", "-t", 2, "-v", "-ub", 64, "-tb", 1,
                           "--mlock")
    assert rc == 0, err
    stats = json.loads(err.split("stats: ", 1)[1].splitlines()[0])
    n = stats["n_prompt"]
    assert "n_ubatch 64" in err and n > 128
    assert stats["n_forward_prefill"] == math.ceil(n / 64) - (n % 64 == 1)  # a 1-row rest joins the last pass


# ------------------------------------------------------------------ chat and reasoning


def _answer_api(enable_thinking):
    from clover_gguf import Clover

    with Clover(DEFAULT_MODEL, n_threads=2) as c:
        r = c.create_chat_completion([{"role": "user", "content": "def add(a, b):"}], max_tokens=24, mode="ar",
                                     enable_thinking=enable_thinking)
    return r["choices"][0]["message"]


@pytest.mark.parametrize("how", [("chat", "--reasoning", "off"), ("chat", "--reasoning-budget", "0"),
                                 ("chat", "--chat-template-kwargs", '{"enable_thinking": false}'),
                                 ("run", "-cnv", "-rea", "off")])
def test_reasoning_off_answers_in_content(capsys, monkeypatch, how):
    """With the embedded model's template every answer is reasoning; --reasoning off (and its
    spellings) renders it with enable_thinking=False: the answer is content, as the API's."""
    ref = _answer_api(False)
    assert ref["content"] and not ref.get("reasoning_content")
    rc, out, err = run_cli(capsys, *how, "-n", 24, "--mode", "ar", "-t", 2, stdin="def add(a, b):\n",
                           monkeypatch=monkeypatch)
    assert rc == 0, err
    assert "<think>" not in out and ref["content"].strip() in out


def test_chat_default_is_reasoning(capsys, monkeypatch):
    ref = _answer_api(None)
    assert ref.get("reasoning_content") and not ref["content"]
    rc, out, err = run_cli(capsys, "chat", "-n", 24, "--mode", "ar", "-t", 2, stdin="def add(a, b):\n",
                           monkeypatch=monkeypatch)
    assert rc == 0 and "<think>" in out


def test_run_conversation_takes_p_as_first_message(capsys, monkeypatch):
    ref = _answer_api(False)
    rc, out, err = run_cli(capsys, "run", "-cnv", "-p", "def add(a, b):", "-rea", "off", "-n", 24, "--mode", "ar",
                           "-t", 2, stdin="", monkeypatch=monkeypatch)
    assert rc == 0, err
    assert "> def add(a, b):" in out and ref["content"].strip() in out


def test_serve_reasoning_off_is_the_default_of_requests(tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from serverproc import http, serving

    ref = _answer_api(False)
    body = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 24, "mode": "ar"}
    with serving(DEFAULT_MODEL, ["--reasoning", "off", "-t", 1, "-c", 1024], tmp_path / "log") as (base, _):
        r = http("POST", f"{base}/v1/chat/completions", body, timeout=120)
        assert r.status_code == 200, r.text
        assert json.loads(r.text)["choices"][0]["message"]["content"] == ref["content"]
        asked = {**body, "chat_template_kwargs": {"enable_thinking": True}}  # the request's own wins
        msg = json.loads(http("POST", f"{base}/v1/chat/completions", asked, timeout=120).text)["choices"][0]["message"]
        assert msg.get("reasoning_content") and not msg["content"]


def test_ctx_size_zero_is_the_training_context():
    """llama.cpp's -c 0: the context length the GGUF was trained with."""
    r = subprocess.run([sys.executable, "-m", "clover_gguf", "run", "-c", "0", "-v", "-t", "1", "-p", "def f():",
                        "-n", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    with Model(DEFAULT_MODEL, n_ctx=64, n_threads=1) as m:
        train = m.hparams["n_ctx_train"]
    assert f"n_ctx {train}," in r.stderr.splitlines()[0]
