"""``clover-gguf chat``, ``run`` from stdin / Ctrl+C / stats line, and ``compare``, run
in subprocesses, the interactive ones through a pseudo-terminal
(``pexpect``).

References: :class:`clover_gguf.Clover` on the same GGUF with the same messages (greedy, so
the CLI's answers must equal the API's), ``clover-gguf run -p`` for the stdin prompt. Long
answers for the Ctrl+C tests: every end token gets a -100 logit bias and ``-n`` is far beyond
what the tiny model generates before the interrupt; the tests wait for text of the answer
before sending Ctrl+C and never assert on timings.
"""
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

import clover_gguf

pexpect = pytest.importorskip("pexpect")

PKG_PARENT = str(pathlib.Path(clover_gguf.__file__).resolve().parent.parent)
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
STATS = r"\[ prompt: [0-9.]+ t/s \| generation: [0-9.]+ t/s \| tokens/forward: [0-9.]+ \]"
TIMEOUT = 240


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONIOENCODING"] = "utf-8"
    env.update(extra)
    return env


def cli(*args, input=None, timeout=300, **env):
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", input=input, env=_env(**env), timeout=timeout,
                          stdin=None if input is not None else subprocess.DEVNULL)


_CHILDREN = []


def spawn(*args):
    # SIGINT back to the default in the child: a test run started from a non-interactive shell in
    # the background inherits SIGINT ignored, and Python then installs no KeyboardInterrupt
    ch = pexpect.spawn(sys.executable, ["-m", "clover_gguf", *map(str, args)], env=_env(), encoding="utf-8",
                       codec_errors="replace", timeout=TIMEOUT, dimensions=(24, 200),
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _CHILDREN.append(ch)
    return ch


@pytest.fixture(autouse=True)
def _kill_children():
    """A failed expectation must not leave a 60000-token answer running on the machine."""
    yield
    while _CHILDREN:
        ch = _CHILDREN.pop()
        if ch.isalive():
            ch.terminate(force=True)


@pytest.fixture(scope="module")
def clover_path(make_gguf):
    return str(make_gguf("f32"))


@pytest.fixture(scope="module")
def parent_path(make_gguf):
    return str(make_gguf("f32", arch="qwen35moe", clover=False))


@pytest.fixture(scope="module")
def llm(clover_path):
    from clover_gguf import Clover

    with Clover(clover_path, n_threads=2) as c:
        yield c


@pytest.fixture(scope="module")
def no_end(llm):
    """--logit-bias flags that forbid every end token (answers run until -n or Ctrl+C)."""
    out = []
    for t in llm._model.end_ids:
        out += ["--logit-bias", f"{t}=-100"]
    return out


def _answer_of(text: str, sent: str) -> str:
    """The answer printed after the echo of ``sent`` (ANSI codes and the pty's \\r removed)."""
    text = ANSI.sub("", text).replace("\r\n", "\n")
    i = text.rfind(sent + "\n")
    assert i >= 0, text
    return text[i + len(sent) + 1:].rstrip("\n")


def test_two_turn_chat_and_regen_match_the_api(clover_path, llm):
    args = ["chat", "-m", clover_path, "-n", 12, "--mode", "ar", "-t", 2, "-sys", "You are terse."]
    ch = spawn(*args)
    ch.expect_exact("> ")
    ch.sendline("hello")
    ch.expect(STATS)
    a1 = _answer_of(ch.before, "hello")
    ch.expect_exact("> ")
    ch.sendline("and then?")
    ch.expect(STATS)
    a2 = _answer_of(ch.before, "and then?")
    ch.expect_exact("> ")
    ch.sendline("/regen")
    ch.expect(STATS)
    a3 = _answer_of(ch.before, "/regen")
    ch.expect_exact("> ")
    ch.sendline("/exit")
    ch.expect(pexpect.EOF)
    ch.close()
    assert ch.exitstatus == 0

    kw = dict(max_tokens=12, mode="ar")
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    r1 = llm.create_chat_completion(msgs, **kw)["choices"][0]["message"]
    msgs += [{"role": "assistant", "content": r1["content"]}, {"role": "user", "content": "and then?"}]
    r2 = llm.create_chat_completion(msgs, **kw)["choices"][0]["message"]
    # the tiny model's template opens <think>: its answers are reasoning, shown (dimmed)
    want1 = "\n\n".join(x for x in (r1["reasoning_content"], r1["content"]) if x)
    want2 = "\n\n".join(x for x in (r2["reasoning_content"], r2["content"]) if x)
    assert a1 == want1 and a1
    assert a2 == want2 and a2
    assert a1 != a2  # the second turn saw the first
    assert a3 == a2  # greedy: /regen gives the same answer again


def test_chat_thinking_dimmed_on_a_terminal_and_hidden_by_flag(clover_path):
    ch = spawn("chat", "-m", clover_path, "-n", 6, "--mode", "ar", "-t", 2)
    ch.expect_exact("> ")
    ch.sendline("hi")
    ch.expect(STATS)
    assert "\x1b[2m" in ch.before  # reasoning drawn dim
    ch.sendeof()
    ch.expect(pexpect.EOF)
    ch.close()
    assert ch.exitstatus == 0
    ch = spawn("chat", "-m", clover_path, "-n", 6, "--mode", "ar", "-t", 2, "--hide-thinking")
    ch.expect_exact("> ")
    ch.sendline("hi")
    ch.expect(STATS)
    assert _answer_of(ch.before, "hi").strip() == ""  # all reasoning, hidden
    ch.sendline("/exit")
    ch.expect(pexpect.EOF)


def test_chat_ctrl_c_stops_the_answer_then_exits_130(clover_path, no_end):
    ch = spawn("chat", "-m", clover_path, "-n", 60000, "-c", 65536, "--mode", "ar", "-t", 2, *no_end)
    ch.expect_exact("> ")
    for turn in ("hello", "more"):
        ch.sendline(turn)
        ch.expect(r"\x1b\[2m\S")  # some reasoning text of the answer is out
        ch.sendintr()
        ch.expect_exact("[interrupted]")
        ch.expect(STATS)
        ch.expect_exact("> ")  # the chat goes on
    ch.sendintr()  # at the prompt: exit
    ch.expect(pexpect.EOF)
    ch.close()
    assert ch.exitstatus == 130


def test_chat_two_quick_ctrl_c_exit_130(clover_path, no_end):
    ch = spawn("chat", "-m", clover_path, "-n", 60000, "-c", 65536, "--mode", "ar", "-t", 2, *no_end)
    ch.expect_exact("> ")
    ch.sendline("hello")
    ch.expect(r"\x1b\[2m\S")
    ch.sendintr()
    # a person's second press: two SIGINTs within microseconds reach Python as one
    time.sleep(0.3)
    ch.sendintr()
    ch.expect(pexpect.EOF)
    ch.close()
    assert ch.exitstatus == 130


def test_chat_piped_has_no_ansi_codes(clover_path, llm):
    r = cli("chat", "-m", clover_path, "-n", 8, "--mode", "ar", "-t", 2, input="hello\n/clear\nhello\n")
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout and "\x1b" not in r.stderr
    assert len(re.findall(STATS, r.stderr)) == 2
    want = llm.create_chat_completion([{"role": "user", "content": "hello"}], max_tokens=8, mode="ar")
    block = f"<think>\n{want['choices'][0]['message']['reasoning_content']}\n</think>"
    assert r.stdout.count(block) == 2  # /clear: the second answer is the first one again


def test_run_prompt_from_piped_stdin(clover_path):
    ref = cli("run", "-m", clover_path, "-p", "def fib(n):", "-n", 8, "--mode", "ar", "-t", 2)
    assert ref.returncode == 0, ref.stderr
    r = cli("run", "-m", clover_path, "-n", 8, "--mode", "ar", "-t", 2, input="def fib(n):\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ref.stdout and r.stdout.strip()
    assert "\x1b" not in r.stdout and "\x1b" not in r.stderr  # piped: no ANSI codes
    assert re.search(STATS, r.stderr)
    other = cli("run", "-m", clover_path, "-n", 8, "--mode", "ar", "-t", 2, input="class A:\n")
    assert other.stdout != r.stdout  # the stdin text is the prompt
    none = cli("run", "-m", clover_path, "-n", 8)  # stdin /dev/null: empty prompt
    assert none.returncode == 2 and "prompt" in none.stderr


def test_run_ctrl_c_stops_the_answer(clover_path, no_end):
    ch = spawn("run", "-m", clover_path, "-p", "def fib(n):", "-n", 60000, "-c", 65536, "--mode", "ar", "-t", 2,
               *no_end)
    ch.expect(r"\S")  # text is being written
    ch.sendintr()
    ch.expect(STATS)
    ch.expect(r"finish: (\w+)")
    assert ch.match.group(1) == "cancelled"
    ch.expect(pexpect.EOF)
    ch.close()
    assert ch.exitstatus == 130


def _cells(out: str, col: int):
    left, right = [], []
    for ln in out.splitlines():
        if ln[col:col + 2] == " |":  # a row whose right cell is empty ends at the bar
            left.append(ln[:col].rstrip())
            right.append(ln[col + 3:])
    return left, right


def test_compare_side_by_side_and_json_report(clover_path, parent_path, tmp_path):
    from clover_gguf import Clover

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n\nwrite a loop\n", encoding="utf-8")
    rep = tmp_path / "report.json"
    width = 100
    r = cli("compare", "-m", clover_path, "-m", parent_path, "-f", prompts, "-n", 10, "-t", 2, "--json", rep,
            COLUMNS=str(width))
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout
    report = json.loads(rep.read_text(encoding="utf-8"))
    assert [m["arch"] for m in report["models"]] == ["clover_moe", "qwen35moe"]
    assert [m["mode"] for m in report["models"]] == ["diffusion", "ar"]  # each model's default
    assert report["settings"]["max_tokens"] == 10 and report["settings"]["temperature"] == 0.0
    assert [x["prompt"] for x in report["results"]] == ["hello", "write a loop"]
    for i, (path, mode) in enumerate([(clover_path, "diffusion"), (parent_path, "ar")]):
        with Clover(path, n_threads=2) as c:
            for res in report["results"]:
                a = res["answers"][i]
                want = c.create_chat_completion([{"role": "user", "content": res["prompt"]}], max_tokens=10,
                                                mode=mode)
                msg = want["choices"][0]["message"]
                assert a["text"] == msg["content"] and a["reasoning_content"] == msg["reasoning_content"]
                assert a["mode"] == mode and a["n_tokens"] == want["timings"]["n_generated"] > 0
                assert a["n_forward"] == want["timings"]["n_forward"]
                assert a["tokens_per_forward"] == pytest.approx(a["n_tokens"] / a["n_forward"])
                assert a["tokens_per_second"] > 0 and a["finish_reason"] in ("stop", "length")
        s = report["summary"][i]
        assert s["n_tokens"] == sum(x["answers"][i]["n_tokens"] for x in report["results"])
    assert report["summary"][1]["tokens_per_forward"] == pytest.approx(1.0)  # ar

    lines = r.stdout.splitlines()
    assert all(len(ln) <= width for ln in lines)
    col = (width - 3) // 2
    left, right = _cells(r.stdout, col)
    assert any(ln.startswith("A: ") and "clover_moe" in ln for ln in left)
    assert any(ln.startswith("B: ") and "qwen35moe" in ln for ln in right)
    for i in range(2):
        cells = "".join(left if i == 0 else right).replace(" ", "")
        for res in report["results"]:
            body = res["answers"][i]["text"] or res["answers"][i]["reasoning_content"]
            assert body.replace(" ", "").replace("\n", "") in cells  # the whole answer, wrapped into its column
        assert "tokens/forward" in cells


def test_compare_same_mode_of_clover_and_parent_gives_the_same_answers(clover_path, parent_path, tmp_path):
    """The test Clover shares every parent tensor (see test_cli's parent comparison): in ar
    mode both columns hold the same greedy answer."""
    rep = tmp_path / "r.json"
    r = cli("compare", "-m", clover_path, "-m", parent_path, "-p", "def fib(n):", "--raw", "--mode-a", "ar",
            "-n", 12, "-t", 2, "--json", rep)
    assert r.returncode == 0, r.stderr
    res = json.loads(rep.read_text())["results"][0]["answers"]
    assert res[0]["mode"] == res[1]["mode"] == "ar"
    assert res[0]["text"] == res[1]["text"] and res[0]["text"]
    bad = cli("compare", "-m", clover_path, "-p", "x")
    assert bad.returncode == 2 and "two" in bad.stderr


def test_chat_message_that_does_not_fit_is_refused_and_the_chat_goes_on(clover_path):
    r = cli("chat", "-m", clover_path, "-n", 4, "-c", 96, "--mode", "ar", "-t", 2,
            input="hello\n" + "word " * 200 + "\nhi\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "error:" in r.stderr and "/clear" in r.stderr and "Traceback" not in r.stderr
    assert len(re.findall(STATS, r.stderr)) == 2  # hello and hi answered, the long one refused


def test_help_lists_chat_and_compare():
    r = cli("--help")
    assert r.returncode == 0
    assert "chat" in r.stdout and "compare" in r.stdout
    r = cli("chat", "--help")
    assert r.returncode == 0 and "--hide-thinking" in r.stdout and "-sys" in r.stdout
    r = cli("compare", "--help")
    assert r.returncode == 0 and "--mode-a" in r.stdout and "--json" in r.stdout
