"""The ``clover-gguf`` command line (run, info, logits, convert), run in subprocesses.

References: the Python API on the same GGUF (``Model.generate_tokens``, ``prefix_logits``),
``GGUFFile`` for the metadata/tensor table, and the converter's index check for a missing
shard. Also: importing clover_gguf and its CLI never imports torch.
"""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import clover_gguf

PKG_PARENT = str(pathlib.Path(clover_gguf.__file__).resolve().parent.parent)
PROMPT = "def fib(n):"


def cli_env() -> dict:
    """The environment of a ``python -m clover_gguf`` child that imports this process's package."""
    return dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                PYTHONIOENCODING="utf-8")


def cli(*args, timeout=300, input=None):
    """Run ``python -m clover_gguf ARGS`` with the same clover_gguf package as this process (run in
    that package's parent folder: ``-m`` puts the working folder first on the child's path, so a
    source tree there would shadow an installed package)."""
    return subprocess.run([sys.executable, "-m", "clover_gguf", *map(str, args)], capture_output=True,
                          text=True, encoding="utf-8", env=cli_env(), timeout=timeout, input=input,
                          cwd=PKG_PARENT)


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return pathlib.Path(make_ckpt())


@pytest.fixture(scope="module")
def gguf_path(ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-bf16.gguf"
    r = cli("convert", ckpt, "-o", out, "--outtype", "bf16", "--no-progress")
    assert r.returncode == 0, r.stderr
    assert out.is_file() and out.stat().st_size > 0
    return out


@pytest.fixture(scope="module")
def model(gguf_path):
    from clover_gguf import Model

    with Model(gguf_path, n_ctx=512, n_threads=2) as m:
        yield m


def test_import_does_not_import_torch():
    code = "import sys, clover_gguf, clover_gguf.cli, clover_gguf.model, clover_gguf.tokenizer; " \
           "print('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=PKG_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_help_and_version():
    r = cli("--help")
    assert r.returncode == 0
    for sub in ("run", "info", "logits", "convert"):
        assert sub in r.stdout
    r = cli("--version")
    assert r.returncode == 0 and clover_gguf.__version__ in r.stdout


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_run_json_matches_api(gguf_path, model, mode):
    r = cli("run", "-m", gguf_path, "-p", PROMPT, "-n", 12, "--mode", mode, "--block-size", 8,
            "--threshold", 0.5, "-t", 2, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    for key in ("text", "tokens", "n_tokens", "n_forward", "tokens_per_forward", "seconds", "tokens_per_second"):
        assert key in obj
    ids, st = model.generate_tokens(model.tokenize(PROMPT), max_tokens=12, mode=mode, block_size=8, threshold=0.5)
    assert obj["tokens"] == ids  # greedy: the CLI and the API agree token for token
    assert obj["n_tokens"] == len(ids) <= 12
    assert obj["n_forward"] == st["n_forward"]
    assert obj["tokens_per_forward"] == pytest.approx(len(ids) / obj["n_forward"])
    assert obj["text"] == model.detokenize([t for t in ids if t not in model.end_ids])
    assert obj["seconds"] > 0 and obj["tokens_per_second"] > 0
    if mode == "ar":
        assert obj["tokens_per_forward"] == pytest.approx(1.0)


def test_run_json_counts_the_answer_when_a_stop_string_ends_a_block_early():
    """--json with a stop string that ends diffusion inside the first block (the embedded model,
    greedy): n_tokens is the answer's token count (len(tokens)), n_decoded the decoder's (the
    slots it handed out, the stop string's and any after it included; an unfinished block's
    count), and the speeds come from the latter."""
    r = cli("run", "-p", "import os", "--stop", "if", "-t", 2, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    assert obj["finish_reason"] == "stop" and obj["stop_string"] == "if"
    assert obj["n_tokens"] == len(obj["tokens"]) < obj["n_decoded"]
    assert obj["tokens_per_forward"] == pytest.approx(obj["n_decoded"] / obj["n_forward"])


def test_run_sampling_and_penalty_flags_map_to_the_api(gguf_path, model):
    """--min-p, --presence-penalty, --repeat-penalty, --frequency-penalty, --logit-bias ID=BIAS
    (repeatable) and the ramp flags reach the API arguments of the same names."""
    flags = ["--temp", 0.9, "--top-k", 40, "--min-p", 0.05, "--seed", 3, "--presence-penalty", 0.5,
             "--repeat-penalty", 1.2, "--frequency-penalty", 0.3, "--logit-bias", "7=4.5",
             "--logit-bias", "11:-2", "--eos-bias-start", 3, "--bias-slope", 0.5, "--bias-max", 6,
             "--think-close-bias-start", 2]
    r = cli("run", "-m", gguf_path, "-p", PROMPT, "-n", 10, "--mode", "ar", "-t", 2, "--json", *flags)
    assert r.returncode == 0, r.stderr
    kw = dict(temperature=0.9, top_k=40, min_p=0.05, seed=3, presence_penalty=0.5, repeat_penalty=1.2,
              frequency_penalty=0.3, logit_bias={7: 4.5, 11: -2.0}, eos_bias_start=3, bias_slope=0.5, bias_max=6.0,
              think_close_bias_start=2)
    ids, _ = model.generate_tokens(model.tokenize(PROMPT), max_tokens=10, mode="ar", **kw)
    assert json.loads(r.stdout)["tokens"] == ids
    other, _ = model.generate_tokens(model.tokenize(PROMPT), max_tokens=10, mode="ar", temperature=0.9, top_k=40,
                                     seed=3)
    assert other != ids  # the flags did something


def test_run_streams_text_then_stats(gguf_path, model):
    r = cli("run", "-m", gguf_path, "-p", PROMPT, "-n", 8, "--mode", "ar")
    assert r.returncode == 0, r.stderr
    want = model.generate(PROMPT, max_tokens=8, mode="ar")
    assert r.stdout == want + "\n"
    assert "tokens/s" in r.stderr and "forward passes" in r.stderr and "tokens/forward" in r.stderr
    assert re.search(r"\[ prompt: [0-9.]+ t/s \| generation: [0-9.]+ t/s", r.stderr), r.stderr


def test_run_stats_without_a_prefill_pass_show_no_prompt_speed(gguf_path, model):
    # aligned blocks: a prompt shorter than a block has no prefill pass (spec 5.2)
    assert len(model.tokenize(PROMPT)) < model.hparams["block_size"]
    r = cli("run", "-m", gguf_path, "-p", PROMPT, "-n", 8, "--mode", "diffusion")
    assert r.returncode == 0, r.stderr
    assert "[ prompt: - t/s | generation: " in r.stderr, r.stderr


def test_info_prints_metadata_and_tensor_table(gguf_path):
    from clover_gguf.gguf import GGUFFile

    r = cli("info", gguf_path)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    with GGUFFile(gguf_path) as f:
        md, tensors = f.metadata, f.tensors
    assert f"metadata: {len(md)} keys" in out and f"tensors: {len(tensors)}" in out
    for key in md:
        assert key in out
    assert '"clover_moe"' in out  # general.architecture
    n_tok = len(md["tokenizer.ggml.tokens"])
    assert f"({n_tok} items)" in out  # long arrays are summarised, not dumped
    assert len(out) < 200_000
    for t in tensors:
        line = next(ln for ln in out.splitlines() if ln.split()[:1] == [t["name"]])
        assert t["type"] in line and "{" + ", ".join(map(str, t["shape"])) + "}" in line
    assert f"total tensor bytes: {sum(t['nbytes'] for t in tensors)}" in out


def test_info_takes_the_file_as_llama_cpp_m_or_positional(tmp_path, capsys):
    """`info -m FILE` (llama.cpp's flag) prints what `info FILE` does; two different files, no
    file, or a missing -m file exit 2 naming the argument."""
    from clover_gguf.cli import main

    path = str(clover_gguf.DEFAULT_MODEL)
    assert main(["info", path]) == 0
    positional = capsys.readouterr().out
    assert positional.startswith(f"file: {path}\n") and "tensors: " in positional
    for argv in (["info", "-m", path], ["info", "--model", path], ["info", path, "-m", path]):
        assert main(argv) == 0
        assert capsys.readouterr().out == positional
    other = str(tmp_path / "other.gguf")
    for argv, msg in ((["info", path, "-m", other], "FILE, -m/--model: two files"),
                      (["info"], "-m/--model: required"), (["info", "-m", other], f"not found: {other}")):
        assert main(argv) == 2
        assert msg in capsys.readouterr().err


def test_info_names_every_tensor_type(make_gguf):
    """A Q4_K_M file's table names its types as ggml does (Q4_K, Q6_K, Q8_0, F32, ...): no
    tensor's type column is a bare number. The names are checked against gguf-py's reader."""
    from gguf import GGUFReader

    path = make_gguf("q4_k_m")
    r = cli("info", path)
    assert r.returncode == 0, r.stderr
    want = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert {"Q4_K", "Q6_K", "F32"} <= set(want.values())
    seen = {}
    for ln in r.stdout.splitlines():
        cols = ln.split()
        if cols and cols[0] in want:
            seen[cols[0]] = cols[1]
    assert seen == want


def test_logits_writes_prefix_logits(gguf_path, model, tmp_path):
    out = tmp_path / "logits.npy"
    r = cli("logits", "-m", gguf_path, "--tokens", "5,17,300,42", "-o", out)
    assert r.returncode == 0, r.stderr
    a = np.load(out)
    assert a.dtype == np.float32 and a.shape == (4, model.n_vocab)
    np.testing.assert_allclose(a, model.prefix_logits([5, 17, 300, 42]), rtol=0, atol=1e-5)
    out2 = tmp_path / "prompt.logits"  # any name: written as given
    r = cli("logits", "-m", gguf_path, "-p", PROMPT, "-o", out2)
    assert r.returncode == 0, r.stderr
    b = np.load(out2)
    assert b.shape == (len(model.tokenize(PROMPT)), model.n_vocab)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["run", "-m", "{missing}", "-p", "x"], "not found"),
        (["run", "-m", "{gguf}", "-p", "x", "--temp", "-1"], "temperature"),
        (["run", "-m", "{gguf}", "-p", "x", "--threshold", "2"], "threshold"),
        (["run", "-m", "{gguf}", "-p", "x", "-n", "0"], "n-predict"),
        (["run", "-m", "{gguf}", "-p", "x", "--min-p", "2"], "min_p"),
        (["run", "-m", "{gguf}", "-p", "x", "--repeat-penalty", "0"], "repeat_penalty"),
        (["run", "-m", "{gguf}", "-p", "x", "--presence-penalty", "nan"], "presence_penalty"),
        (["run", "-m", "{gguf}", "-p", "x", "--logit-bias", "7"], "ID=BIAS"),
        (["run", "-m", "{gguf}", "-p", "x", "--logit-bias", "x=1"], "ID=BIAS"),
        (["run", "-m", "{gguf}", "-p", "x", "--logit-bias", "999999=1"], "logit_bias"),
        (["run", "-m", "{gguf}", "-p", "x", "--bias-slope", "-1"], "bias_slope"),
        (["run", "-m", "{gguf}", "-p", ""], "prompt"),
        (["run", "-m", "{garbage}", "-p", "x"], "garbage.gguf"),
        (["info", "{garbage}"], "garbage.gguf"),
        (["logits", "-m", "{gguf}", "--tokens", "1,x", "-o", "{tmp}/a.npy"], "--tokens"),
        (["logits", "-m", "{gguf}", "--tokens", "1,999999", "-o", "{tmp}/a.npy"], "999999"),
        (["logits", "-m", "{gguf}", "--tokens", "1", "-o", "{tmp}/no/such/dir/a.npy"], "directory"),
        (["logits", "-m", "{gguf}", "-o", "{tmp}/a.npy"], "--prompt"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_bad_arguments_and_files_exit_2(gguf_path, tmp_path, args, msg):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    subs = {"{missing}": str(tmp_path / "missing.gguf"), "{gguf}": str(gguf_path),
            "{garbage}": str(garbage), "{tmp}": str(tmp_path)}
    argv = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        argv.append(a)
    r = cli(*argv)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert msg in r.stderr
    assert "Traceback" not in r.stderr


def test_convert_missing_shard_is_a_one_line_error(ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (broken / shard).unlink()
    out = tmp_path / "out.gguf"
    r = cli("convert", broken, "-o", out, "--outtype", "f32")
    assert r.returncode == 2
    err_lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(err_lines) == 1 and err_lines[0].startswith("error:") and shard in err_lines[0]
    assert not out.exists()  # checked before anything is written


def test_installed_entry_point_if_present(gguf_path):
    exe = shutil.which("clover-gguf")
    if exe is None:
        pytest.skip("clover-gguf is not installed on PATH (pip install .)")
    r = subprocess.run([exe, "run", "-m", str(gguf_path), "-p", PROMPT, "-n", "4", "--mode", "ar", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_tokens"] >= 1


def test_parent_comparison_under_identical_prompts(make_gguf):
    """A qwen35moe file runs in ar mode by default, and a Clover file runs in
    ar mode on request, so the two can be compared under identical prompts. The test Clover
    checkpoint shares every parent tensor with the parent checkpoint of the same seed (values
    are seeded by name) and the block tensors are block-mode only (spec 3.3), so their greedy
    ar outputs must be identical (the Clover file's record penalties turned off)."""
    parent = make_gguf("f32", arch="qwen35moe", clover=False)
    clover = make_gguf("f32")
    rp = cli("run", "-m", parent, "-p", PROMPT, "-n", 16, "-t", 2, "--json")
    rc = cli("run", "-m", clover, "-p", PROMPT, "-n", 16, "-t", 2, "--json", "--mode", "ar", "--presence-penalty", 0,
             "--repeat-penalty", 1)
    assert rp.returncode == 0 and rc.returncode == 0, rp.stderr + rc.stderr
    a, b = json.loads(rp.stdout), json.loads(rc.stdout)
    assert a["mode"] == "ar" and b["mode"] == "ar"
    assert a["tokens"] == b["tokens"] and a["text"] == b["text"] and len(a["tokens"]) > 0
    rd = cli("run", "-m", clover, "-p", PROMPT, "-n", 16, "-t", 2, "--json")
    assert json.loads(rd.stdout)["mode"] == "diffusion"  # a Clover file's default


def test_run_visual_on_a_terminal_and_plain_otherwise(gguf_path):
    """--visual redraws the block in place on a terminal (ANSI sequences, a dim dot for masked
    slots) and prints plain text when stdout is not a terminal; the text is the same."""
    import pty
    import re

    args = ["run", "-m", str(gguf_path), "-p", PROMPT, "-n", 24, "--mode", "diffusion", "--block-size", 8,
            "--threshold", 1.0, "-t", 2]
    plain = cli(*args)
    assert plain.returncode == 0, plain.stderr
    piped = cli(*args, "--visual")
    assert piped.returncode == 0 and piped.stdout == plain.stdout and "\x1b[" not in piped.stdout
    exe = [sys.executable, "-m", "clover_gguf"] + [str(x) for x in args] + ["--visual"]
    out = []

    def read(fd):
        data = os.read(fd, 65536)
        out.append(data)
        return data

    status = pty.spawn(exe, read)
    assert os.waitstatus_to_exitcode(status) == 0
    tty = b"".join(out).decode("utf-8", "replace")
    assert "\x1b[2m\u00b7" in tty and "\x1b[1;32m" in tty  # masked slots and newly filled slots drawn
    # without the cursor moves and the drawn blocks, the terminal shows the plain text
    text_written = re.sub(r"\x1b\[K|\x1b\[\d+D", "", re.sub(r" (?:\x1b\[[0-9;]*m|[^\x1b\r\n])*?\x1b\[\d+D", "", tty))
    assert text_written.replace("\r\n", "\n").startswith(plain.stdout.rstrip("\n"))


def _screen(data: str, width: int) -> list[str]:
    """The lines a terminal ``width`` columns wide shows after ``data``, as xterm: a character
    written in the last column wraps before the next one, ``\\r`` goes to column 0, ``\\n`` to
    the next line's column 0 (a pty's onlcr), ``ESC[nD`` moves n columns left within the line,
    ``ESC[K`` clears to its end, ``ESC[...m`` (colours) changes no character."""
    lines, row, col, wrap = [[]], 0, 0, False
    i = 0
    while i < len(data):
        m = re.match(r"\x1b\[([0-9;]*)([A-Za-z])", data[i:])
        if m:
            if m[2] == "D":
                col, wrap = max(col - int(m[1] or 1), 0), False
            elif m[2] == "K":
                del lines[row][col:]
            i += m.end()
            continue
        ch, i = data[i], i + 1
        if ch in "\r\n":
            col, wrap = 0, False
            if ch == "\n":
                row += 1
                lines += [[]] if row == len(lines) else []
            continue
        if wrap:
            row, col, wrap = row + 1, 0, False
            lines += [[]] if row == len(lines) else []
        line = lines[row]
        line += [" "] * (col + 1 - len(line))
        line[col] = ch
        col, wrap = (col, True) if col == width - 1 else (col + 1, False)
    return ["".join(x).rstrip() for x in lines]


def test_step_view_highlights_the_last_forward_and_leaves_the_plain_text():
    """run --visual's ar/spec view: each piece's text after its last line break is written
    highlighted (the block view's colour) and rewritten plain when the next piece arrives, so the
    screen ends as the plain text's, wrapped lines and non-ASCII text included."""
    import io

    from clover_gguf.cli.run import _BlockView, _StepView

    pieces = ["def", " fib", "(n):\n", "    return", " n" * 9, " +", " caf\u00e9", " x", "\nif", "\n\n", "ok"]
    out = io.StringIO()
    view = _StepView(out)
    view.width = 20
    lit = []
    for piece in pieces:
        before = len(out.getvalue())
        view.text(piece)
        written = out.getvalue()[before:]
        lit.append(view.lit)
        if view.lit:
            assert written.endswith(_BlockView.NEW + view.lit + _BlockView.OFF)
    view.finish()
    # "    return" ends at column 10; " n" * 9 crosses column 20 (plain), " +" then fits on the
    # wrapped line; after "é" the column is unknown until the next line break
    assert lit == ["def", " fib", "", "    return", "", " +", "", "", "if", "", "ok"]
    assert out.getvalue().count("\x1b[1;32m") == 6 and not out.getvalue().endswith(_BlockView.OFF)
    assert _screen(out.getvalue(), 20) == _screen("".join(pieces), 20)


@pytest.mark.parametrize("mode", ["ar", "spec"])
def test_run_visual_in_ar_and_spec_highlights_each_forward(gguf_path, mode):
    """--visual in ar and spec on a terminal: each forward's tokens are drawn highlighted and the
    screen then shows the plain text; piped, the text is plain and a note says --visual drew
    nothing; with --json it is refused."""
    import pty

    args = ["run", "-m", str(gguf_path), "-p", PROMPT, "-n", 16, "--mode", mode, "-t", 2]
    plain = cli(*args)
    assert plain.returncode == 0, plain.stderr
    if mode == "ar":  # (the same path in spec)
        piped = cli(*args, "--visual")
        assert piped.returncode == 0 and piped.stdout == plain.stdout and "\x1b[" not in piped.stdout
        assert "note: --visual draws in colour" in piped.stderr
        bad = cli(*args, "--visual", "--json")
        assert bad.returncode == 2 and "--visual, --json: give one" in bad.stderr
    out = []

    def read(fd):
        data = os.read(fd, 65536)
        out.append(data)
        return data

    status = pty.spawn([sys.executable, "-m", "clover_gguf"] + [str(x) for x in args] + ["--visual"], read)
    assert os.waitstatus_to_exitcode(status) == 0
    tty = b"".join(out).decode("utf-8", "replace")
    assert "\x1b[1;32m" in tty and re.search(r"\x1b\[\d+D", tty)  # highlighted, then stepped back over
    want = _screen(plain.stdout, 80)[:-1]  # (its last line is the empty one after the final newline)
    assert _screen(tty, 80)[:len(want)] == want


def test_preload_reads_the_file_with_a_progress_bar(tmp_path):
    """`clover_gguf.preload`: the model file is read once with a tqdm bar (forced here: by
    default only on a terminal and for files of 256 MiB or more); skipped for a small file."""
    import io

    from clover_gguf.preload import preload

    f = tmp_path / "m.bin"
    f.write_bytes(bytes(range(256)) * 70_000)  # 17.9 MB: two reads
    out = io.StringIO()
    assert preload(f, force=True, file=out) == f.stat().st_size
    assert "loading model:" in out.getvalue() and "17.1M" in out.getvalue()  # (cleared when done)
    assert preload(f, file=io.StringIO()) == 0  # not a terminal, small: skipped
    assert preload(tmp_path / "missing.gguf", force=True, file=io.StringIO()) == 0


def test_stdout_closed_early_cancels_the_worker_before_the_model_closes():
    """``stream_interruptibly`` (run's and chat's streaming): an exception of the handler, as
    printing to a closed pipe raises, cancels the generation and waits for the worker thread
    before it is raised, so the caller's ``with model:`` never closes a model the worker is
    still decoding on (that was a segfault of ``clover-gguf run ... | head -1``)."""
    import threading
    import time

    from clover_gguf.cli.common import stream_interruptibly

    stop = threading.Event()
    finished = []

    def items():
        try:
            for i in range(1000):
                if stop.is_set():
                    return
                time.sleep(0.005)
                yield i
        finally:
            finished.append(True)

    def handle(item):
        raise BrokenPipeError(32, "Broken pipe")

    with pytest.raises(BrokenPipeError):
        stream_interruptibly(items, stop.set, handle)
    assert stop.is_set() and finished == [True]
    assert not any(t.name == "clover-generate" for t in threading.enumerate())


def test_run_piped_into_a_reader_that_closes_early_exits_0():
    """``clover-gguf run ... | head -1`` on the embedded model: exit 0 and nothing on stderr,
    each of 5 times (before the fix, 1 to 3 of 5 such runs died with SIGSEGV)."""
    for _ in range(5):
        p = subprocess.Popen([sys.executable, "-m", "clover_gguf", "run", "-p", "import os", "-n", "200", "-t", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
        p.stdout.readline()
        p.stdout.close()
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == 0 and err == "", (p.returncode, err)


def test_run_n_minus_1_fills_the_context_and_a_block_that_does_not_fit_is_explained():
    """``-n -1`` (llama.cpp's no limit) generates until the context is full: in ar mode every
    position of ``-c 64`` is used (the embedded model writes no end token here). In diffusion
    mode a block that does not fit any more ends the generation early, and a note on stderr says so
    (``-c 10`` with a 32-row block: no tokens, before, silently)."""
    r = cli("run", "-p", "import os", "-n", -1, "-c", 64, "--mode", "ar", "-t", 2, "--json")
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    # 64 positions written (the prompt and every token but the last, which needs none)
    assert obj["finish_reason"] == "length" and obj["n_prompt"] + obj["n_tokens"] == 64 + 1
    r = cli("run", "-p", "hi", "-c", 10, "-t", 2)
    assert r.returncode == 0 and "note: the next diffusion block did not fit in the context" in r.stderr, r.stderr
    r = cli("run", "-p", "hi", "-n", -2)
    assert r.returncode == 2 and "-n/--n-predict: -2 must be > 0 (or -1: no limit)" in r.stderr, r.stderr


def test_gpu_options_without_a_gpu_say_everything_runs_on_the_cpu():
    """``-ngl all`` (and ``--device cuda``) where no GPU is usable: the warning, then a placement
    line that says the CPU runs everything (it printed the GPU plan alone, as if it were in
    effect); ``--device cpu`` overrides ``-ngl``: no GPU, no warning; ``--fit`` with a budget too
    small for any layer says so; the same text each time."""
    from clover_gguf._ffi import ffi, lib
    info = ffi.new("char[]", 256)
    if lib.clover_gpu_devices(info, 256) > 0:
        pytest.skip("a GPU is present (tests/native/test_cuda.py covers placements there)")
    r = cli("run", "-p", "import os", "-n", 4, "-ngl", "all", "-t", 1)
    assert r.returncode == 0, r.stderr
    assert "running on the CPU" in r.stderr
    assert "placement: everything on the CPU (the plan for a GPU was: GPU:" in r.stderr, r.stderr
    # --device cuda is -ngl all; --device cpu asks for no GPU, so nothing is said of one
    r2 = cli("run", "-p", "import os", "-n", 4, "--device", "cuda", "-t", 1)
    assert r2.returncode == 0 and r2.stdout == r.stdout, r2.stderr
    assert "running on the CPU" in r2.stderr and "placement: everything on the CPU" in r2.stderr, r2.stderr
    r3 = cli("run", "-p", "import os", "-n", 4, "--device", "cpu", "-ngl", "all", "-t", 1)
    assert r3.returncode == 0 and r3.stdout == r.stdout, r3.stderr
    assert "GPU" not in r3.stderr and "placement" not in r3.stderr, r3.stderr
    # --fit with a budget below the reserve: no layer fits, so the line says that, not an empty GPU plan
    r4 = cli("run", "-p", "import os", "-n", 4, "--fit", "--gpu-budget", "100M", "-t", 1)
    assert r4.returncode == 0 and r4.stdout == r.stdout, r4.stderr
    assert ("placement: everything on the CPU (a GPU budget of 0.10 GiB, less 0.50 GiB kept for the CUDA context"
            " and buffers, holds no layer)") in r4.stderr, r4.stderr


def test_subcommands_without_m_take_the_embedded_model():
    """As ``run``, ``fit``, ``chat``, ``logits``, ``bench`` and ``serve`` default to the GGUF
    shipped in the package (they required -m); ``compare`` still needs its two."""
    r = cli("fit", "--gpu-budget", "1G")
    assert r.returncode == 0 and r.stdout.startswith(str(clover_gguf.DEFAULT_MODEL)), r.stdout + r.stderr
    r = cli("chat", "-n", 8, "-t", 1, input="def add(a, b):\n", timeout=120)
    assert r.returncode == 0 and "tokens/forward" in r.stderr, r.stderr
    r = cli("compare", "-p", "x")
    assert r.returncode == 2 and "-m/--model" in r.stderr


def test_a_base_exception_from_a_library_is_one_line(monkeypatch, capsys):
    """A native library's panic (pyo3's PanicException derives from BaseException, not
    Exception) ends the command with one error line and the runtime exit code, no traceback."""
    from clover_gguf.cli import info as info_cmd
    from clover_gguf.cli import main

    class Panic(BaseException):
        pass

    def boom(a):
        raise Panic("regex engine gave up")

    monkeypatch.setattr(info_cmd, "cmd", boom)
    assert main(["info", str(clover_gguf.DEFAULT_MODEL)]) == 1
    err = capsys.readouterr().err
    assert err.strip().endswith("Panic: regex engine gave up") and "Traceback" not in err
