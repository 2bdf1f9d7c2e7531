"""clover_gguf.bench and ``clover-gguf bench`` on the tiny random models."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from clover_gguf.bench import bytes_per_token, format_table, model_summary, run_bench, to_json
from clover_gguf.cli import main

SMALL = dict(n_prompt=12, n_gen=5, reps=2, n_threads=1, block_size=8)


@pytest.fixture(scope="module")
def clover_gguf_path(make_gguf):
    return make_gguf("f32")


@pytest.fixture(scope="module")
def parent_gguf_path(make_gguf):
    return make_gguf("q8_0", arch="qwen35moe")


def _independent_bytes_per_token(path) -> tuple[int, int]:
    """Bytes per decoded token and total bytes, from gguf-py's reader (not our GGUF code)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    n_exp = int(r.fields[f"{arch}.expert_count"].parts[-1][0])
    n_used = int(r.fields[f"{arch}.expert_used_count"].parts[-1][0])
    names = [t.name for t in r.tensors]
    per_tok = total = 0
    for t in r.tensors:
        nb = int(t.n_bytes)
        total += nb
        if t.name.endswith("_exps.weight"):
            assert nb % n_exp == 0
            per_tok += nb // n_exp * n_used
        elif t.name == "token_embd.weight":
            per_tok += nb // int(t.shape[1])  # ggml order: shape[1] = n_vocab rows
            if "output.weight" not in names:
                per_tok += nb
        else:
            per_tok += nb
    return per_tok, total


def test_run_bench_clover(clover_gguf_path):
    rep = run_bench(clover_gguf_path, **SMALL)
    names = [r.name for r in rep["results"]]
    assert names == ["pp12", "tg5", "block8", "commit8"]
    assert rep["threads"] == 1
    for r in rep["results"]:
        assert len(r.seconds) == 2 and all(s > 0 for s in r.seconds)
        assert r.tps == pytest.approx([r.n_tokens / s for s in r.seconds])
        assert r.tps_mean == pytest.approx(np.mean(r.tps))
        assert r.ms_mean == pytest.approx(1000 * np.mean(r.seconds))
    pp, tg, blk, com = rep["results"]
    assert (pp.n_tokens, tg.n_tokens, blk.n_tokens, com.n_tokens) == (12, 5, 8, 8)
    # block time as a multiple of one tg step (mean ms per token)
    step_ms = 1000.0 / tg.tps_mean
    assert rep["block_vs_tg"] == pytest.approx(blk.ms_mean / step_ms)
    assert blk.extra["vs_tg_step"] == rep["block_vs_tg"]
    n_expert = None
    from clover_gguf.gguf import GGUFFile
    with GGUFFile(clover_gguf_path) as f:
        n_expert = f.metadata["clover_moe.expert_count"]
    assert 1 <= blk.extra["mean_distinct_experts"] <= n_expert
    assert blk.extra["coreset_top_p"] == pytest.approx(0.9)


def test_run_bench_parent_has_no_block_row(parent_gguf_path):
    rep = run_bench(parent_gguf_path, **SMALL)
    assert [r.name for r in rep["results"]] == ["pp12", "tg5", "commit8"]
    assert rep["block_vs_tg"] is None
    assert rep["model"]["arch"] == "qwen35moe"
    assert rep["model"]["type"] == "Q8_0"
    rep = run_bench(parent_gguf_path, **dict(SMALL, reps=1), commit=False, warmup=False)
    assert [r.name for r in rep["results"]] == ["pp12", "tg5"]


@pytest.mark.parametrize("which", ["clover", "parent"])
def test_model_summary_against_gguf_py(which, clover_gguf_path, parent_gguf_path):
    path = clover_gguf_path if which == "clover" else parent_gguf_path
    s = model_summary(path)
    per_tok, total = _independent_bytes_per_token(path)
    assert s["size_bytes"] == total
    assert s["bytes_per_token"] == per_tok == bytes_per_token(path)
    # experts dominate: a token reads far less than the whole file, but more than the LM head
    assert s["bytes_per_token"] < total
    from gguf import GGUFReader
    r = GGUFReader(str(path))
    assert s["n_params"] == sum(int(t.n_elements) for t in r.tensors)
    head = [t for t in r.tensors if t.name == "output.weight"][0]
    assert s["bytes_per_token"] > int(head.n_bytes)


def test_format_and_json(clover_gguf_path):
    rep = run_bench(clover_gguf_path, **SMALL)
    table = format_table(rep).splitlines()
    assert len(table) == 2 + 4
    assert [c.strip() for c in table[0].strip("|").split("|")][:6] == \
        ["model", "size", "params", "type", "threads", "test"]
    assert set(table[1].replace("|", "").replace(" ", "")) <= {"-", ":"}
    for line, r in zip(table[2:], rep["results"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[5] == r.name and cells[4] == "1"
        if r.name.startswith(("pp", "tg")):
            assert cells[6].startswith(f"{r.tps_mean:.2f} ± ")
    obj = json.loads(to_json(rep))
    assert [x["test"] for x in obj["results"]] == [r.name for r in rep["results"]]
    assert obj["results"][0]["seconds"] == rep["results"][0].seconds


def test_depth_prefills_before_every_test(clover_gguf_path, monkeypatch):
    """n_depth (llama-bench's -d): every pp, block/commit and tg repetition starts after an
    untimed forward of D tokens into a fresh context, and the names carry llama-bench's "@ dD"."""
    from clover_gguf import bench

    calls = []
    real = bench._Engine.prefill

    def spy(self, toks, n, logits):
        calls.append(n)
        return real(self, toks, n, logits)

    monkeypatch.setattr(bench._Engine, "prefill", spy)
    rep = run_bench(clover_gguf_path, **SMALL, n_depth=7, warmup=False)
    assert [r.name for r in rep["results"]] == ["pp12 @ d7", "tg5 @ d7", "block8 @ d7", "commit8 @ d7"]
    assert rep["params"]["n_depth"] == 7 and rep["results"][2].extra["prefix"] == 7 + 12
    # per repetition: depth, pp, commit; then per repetition: depth, then 5 single-token steps
    assert calls == [7, 12, 8] * 2 + ([7] + [1] * 5) * 2
    with pytest.raises(ValueError, match="n_depth"):
        run_bench(clover_gguf_path, **SMALL, n_depth=-1)


def test_bad_arguments(clover_gguf_path):
    with pytest.raises(ValueError, match="n_prompt"):
        run_bench(clover_gguf_path, n_prompt=-1)
    with pytest.raises(ValueError, match="coreset_top_p"):
        run_bench(clover_gguf_path, coreset_top_p=1.5)


def test_cli_bench(clover_gguf_path, capsys, tmp_path):
    rc = main(["bench", "-m", str(clover_gguf_path), "-p", "8", "-n", "3", "-r", "1", "-t", "1",
               "--block-size", "4", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert [x["test"] for x in obj["results"]] == ["pp8", "tg3", "block4", "commit4"]
    assert obj["threads"] == 1 and obj["params"]["n_prompt"] == [8]
    rc = main(["bench", "-m", str(clover_gguf_path), "-p", "8", "-n", "3", "-r", "1", "-t", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| pp8 " in out and "| tg3 " in out and "| block32 " in out
    rc = main(["bench", "-m", str(clover_gguf_path), "-p", "4", "-n", "2", "-d", "5", "-r", "1", "-t", "1",
               "--block-size", "4", "--json"])
    assert rc == 0
    obj = json.loads(capsys.readouterr().out)
    assert [x["test"] for x in obj["results"]] == ["pp4 @ d5", "tg2 @ d5", "block4 @ d5", "commit4 @ d5"]
    assert obj["params"]["n_depth"] == 5
    assert main(["bench", "-m", str(tmp_path / "missing.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", str(clover_gguf_path), "--coreset-top-p", "0"])
    assert e.value.code == 2 and "--coreset-top-p: element '0'" in capsys.readouterr().err


def test_grid_is_llama_bench_cartesian_product(clover_gguf_path, monkeypatch):
    """run_grid: one report per combination of the list arguments in GRID_ORDER (the first
    varying slowest), a model loaded once per (n_gpu_layers, n_cpu_moe) and a context per
    combination; inside each, a pp (and block, commit after that prefix) per n_prompt and a tg
    per n_gen, 0 skipping, with llama-bench's n_prompt / n_gen on every row."""
    from clover_gguf import bench

    loads, opens = [], []
    real_init, real_open = bench._Engine.__init__, bench._Engine.open
    monkeypatch.setattr(bench._Engine, "__init__", lambda self, *a: loads.append(a) or real_init(self, *a))
    monkeypatch.setattr(bench._Engine, "open", lambda self, *a: opens.append(a) or real_open(self, *a))
    done = []
    reps = bench.run_grid(clover_gguf_path, n_prompt=[4, 0, 6], n_gen=[2, 3], reps=1, n_threads=[1, 2],
                          block_size=4, type_k=["f32", "f16"], warmup=False, on_report=done.append)
    assert done == reps and len(loads) == 1
    assert [(r["params"]["type_k"], r["threads"]) for r in reps] == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert [(o[1], o[2]) for o in opens] == [(1, 0), (2, 0), (1, 1), (2, 1)]  # (threads, type_k)
    for r in reps:
        assert [x.name for x in r["results"]] == ["pp4", "pp6", "tg2", "tg3", "block4 @ p4", "commit4 @ p4",
                                                  "block4 @ p6", "commit4 @ p6"]
        assert [(x.n_prompt, x.n_gen) for x in r["results"]] == [(4, 0), (6, 0), (0, 2), (0, 3), (4, 0), (4, 0),
                                                                   (6, 0), (6, 0)]
        tg_step_ms = 1000.0 / r["results"][2].tps_mean  # against the first tg
        assert r["results"][6].extra["vs_tg_step"] == pytest.approx(r["results"][6].ms_mean / tg_step_ms)
    only_tg = bench.run_grid(clover_gguf_path, n_prompt=0, n_gen=2, reps=1, n_threads=1, warmup=False)
    assert [x.name for x in only_tg[0]["results"]] == ["tg2"] and only_tg[0]["block_vs_tg"] is None
    for kw, field in ((dict(n_prompt=0, n_gen=[0]), "n_prompt, n_gen"), (dict(n_threads=[1, -1]), "n_threads: -1"),
                      (dict(block_size=[4, 0]), "block_size: 0"), (dict(coreset_top_p=[0.5, 2.0]), "coreset_top_p: 2.0"),
                      (dict(type_k=["f32", "q8"]), "type_k: 'q8'"), (dict(n_depth=[]), "n_depth: an empty list")):
        with pytest.raises(ValueError, match=field):
            bench.run_grid(clover_gguf_path, **kw)
    with pytest.raises(ValueError, match="n_threads: one value in run_bench"):
        run_bench(clover_gguf_path, n_threads=[1, 2])
    assert len(loads) == 2  # nothing loaded for the bad arguments


def test_cli_bench_lists_and_output_formats(clover_gguf_path, parent_gguf_path, capsys):
    """-m/-p/-t lists (commas and a repeated -m) run the cartesian product; -o jsonl, json, csv
    and sql print the same rows with llama-bench's field names (sql loads into sqlite), and
    each row's avg_ns / avg_ts are the mean of its samples."""
    import csv
    import io
    import sqlite3

    from clover_gguf.bench import FIELDS

    base = ["bench", "-m", str(clover_gguf_path), "-m", str(parent_gguf_path), "-p", "4,6", "-n", "2", "-r", "2",
            "-t", "1,2", "--block-size", "4", "--no-warmup"]
    assert main(base + ["-o", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert all(list(r) == list(FIELDS) + ["samples_ns", "samples_ts"] for r in rows)
    got = [(r["model_filename"], r["n_threads"], r["test"], r["n_prompt"], r["n_gen"]) for r in rows]
    want = []
    for m, tests in ((clover_gguf_path, ["pp4", "pp6", "tg2", "block4 @ p4", "commit4 @ p4", "block4 @ p6",
                                         "commit4 @ p6"]), (parent_gguf_path, ["pp4", "pp6", "tg2", "commit4 @ p4",
                                                                               "commit4 @ p6"])):
        for t in (1, 2):
            for name in tests:
                p = 0 if name.startswith("tg") else int(name.split("p")[-1])
                want.append((str(m), t, name, p, 2 if name.startswith("tg") else 0))
    assert got == want
    for r in rows:
        assert len(r["samples_ns"]) == 2 and r["avg_ns"] == pytest.approx(np.mean(r["samples_ns"]), abs=1)
        assert r["avg_ts"] == pytest.approx(np.mean(r["samples_ts"]))
        n = r["n_prompt"] + r["n_gen"] if r["block_size"] is None else r["block_size"]
        assert r["samples_ts"] == pytest.approx([n / (x * 1e-9) for x in r["samples_ns"]], rel=1e-6)
        assert r["backends"] == "CPU" and r["type_k"] == "f32" and r["n_depth"] == 0
        assert (r["vs_tg_step"] is not None) == r["test"].startswith("block")
    assert main(base + ["-o", "json"]) == 0
    arr = json.loads(capsys.readouterr().out)
    assert [(r["model_filename"], r["n_threads"], r["test"]) for r in arr] == [g[:3] for g in want]
    assert main(base + ["-o", "csv"]) == 0
    table = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert [(r["model_filename"], int(r["n_threads"]), r["test"]) for r in table] == [g[:3] for g in want]
    assert list(table[0]) == list(FIELDS) and table[0]["coreset_top_p"] == "" and float(table[0]["avg_ts"]) > 0
    assert main(base + ["-o", "sql"]) == 0
    db = sqlite3.connect(":memory:")
    db.executescript(capsys.readouterr().out)
    assert db.execute("SELECT model_filename, n_threads, test FROM clover_bench").fetchall() == [g[:3] for g in want]
    assert db.execute("SELECT COUNT(*) FROM clover_bench WHERE coreset_top_p = 0.9").fetchone()[0] == 2 * 2
    # md: a column for a list that is not the default (llama-bench's type_k), one row per test
    assert main(["bench", "-m", str(clover_gguf_path), "-p", "4", "-n", "2", "-r", "1", "-t", "1",
                 "--block-size", "4", "-ctk", "f32,f16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[4:7] == ["threads", "type_k", "test"] and len(lines) == 2 + 2 * 4
    assert [line.split("|")[6].strip() for line in lines[2:]] == ["f32"] * 4 + ["f16"] * 4


@pytest.mark.parametrize("args, flag, elem", [
    (["-p", "64,x"], "-p/--n-prompt", "'x'"), (["-n", "32,,64"], "-n/--n-gen", "''"),
    (["-t", "1,-2"], "-t/--threads", "'-2'"), (["-ctk", "f32,q8"], "-ctk/--cache-type-k", "'q8'"),
    (["--block-size", "4,0"], "--block-size", "'0'"), (["--coreset-top-p", "0.5,1.5"], "--coreset-top-p", "'1.5'"),
    (["-d", "8-2"], "-d/--n-depth", "'8-2'"), (["-ngl", "all,some"], "-ngl/--n-gpu-layers", "'some'")])
def test_cli_bench_refuses_a_bad_list_element(args, flag, elem, clover_gguf_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "-m", str(clover_gguf_path), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: element {elem}" in err, err


def test_cli_bench_ranges_and_refusals(clover_gguf_path, capsys):
    """llama-bench's ranges FIRST-LAST[+STEP|*STEP]; -p 0 -n 0 (nothing to run) and --json with -o
    are refused naming the flags."""
    from clover_gguf.cli.bench import _int_range

    assert _int_range(0)("4-16*2") == [4, 8, 16] and _int_range(0)("1-7+3") == [1, 4, 7]
    assert _int_range(0)("0-2") == [0, 1, 2] and _int_range(1)("5") == [5]
    assert main(["bench", "-m", str(clover_gguf_path), "-p", "1-3", "-n", "0", "-r", "1", "-t", "1",
                 "--block-size", "2", "-o", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["test"] for r in rows if r["n_gen"] == 0 and r["block_size"] is None] == ["pp1", "pp2", "pp3"]
    assert main(["bench", "-m", str(clover_gguf_path), "-p", "0", "-n", "0"]) == 2
    assert "n_prompt, n_gen: no test to run" in capsys.readouterr().err
    assert main(["bench", "-m", str(clover_gguf_path), "--json", "-o", "csv"]) == 2
    assert "--json, -o" in capsys.readouterr().err


def test_bench_does_not_import_torch():
    code = "import sys, clover_gguf.bench, clover_gguf.cli; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_modes_script_json(clover_gguf_path):
    """bench/modes.py (bench/device_check.sh reads its JSON line): every mode generates the asked
    tokens per prompt and reports the figures the device script prints (tokens/s, tokens per
    forward, the ids it compares across backends); a forward count per kind adds up."""
    import pathlib

    script = pathlib.Path(__file__).resolve().parents[2] / "bench" / "modes.py"
    r = subprocess.run([sys.executable, str(script), str(clover_gguf_path), "-n", "6", "-t", "1", "--json",
                        "--prompts", "3"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(out) == ["ar", "diffusion", "spec"]
    for mode, v in out.items():
        assert len(v["ids"]) == 3 and all(len(ids) == 6 for ids in v["ids"]), mode
        assert v["tokens"] == 6 * len(v["ids"]) and v["tokens_per_second"] > 0, mode
        kinds = sum(v[k] for k in ("decode", "denoise", "commit", "draft", "verify"))
        assert v["forwards"] == kinds and v["tokens_per_forward"] == pytest.approx(v["tokens"] / kinds), mode
    assert out["spec"]["spec_equals_ar"] == [True] * len(out["ar"]["ids"])  # on the CPU, else the script exits
    r = subprocess.run([sys.executable, str(script), str(clover_gguf_path), "--prompts", "9"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "--prompts: 9 is not in 1..5" in r.stderr


def test_logits_check_script(clover_gguf_path, tmp_path):
    """bench/logits_check.py (device_check.sh's logits step): it saves the prefix and block
    logits of each prompt with the model's shapes, and its comparison reports the largest
    difference, the argmax disagreements and the expert counts: a file against itself differs
    nowhere; against the CPU's scalar path (CLOVER_ISA=scalar) it prints a finite figure."""
    import os
    import pathlib

    from clover_gguf import Model

    script = str(pathlib.Path(__file__).resolve().parents[2] / "bench" / "logits_check.py")
    simd, scalar = tmp_path / "simd.npz", tmp_path / "scalar.npz"
    for out, env in ((simd, {}), (scalar, {"CLOVER_ISA": "scalar"})):
        r = subprocess.run([sys.executable, script, str(clover_gguf_path), str(out), "-t", "1", "--prompts", "2"],
                           capture_output=True, text=True, timeout=600, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
    with Model(str(clover_gguf_path)) as m:
        n_vocab, n_layer, block = m.n_vocab, m.hparams["n_layer"], m.hparams["block_size"]
        n_pre = [len(m.tokenize(p)) for p in ("def fibonacci(n):", "The quick brown fox")]
    z = np.load(simd)
    assert sorted(z.files) == sorted(f"{k}{i}{s}" for i in range(2) for k, s in
                                     (("pre", ""), ("blk", ""), ("full", ""), ("blk", "_experts"), ("full", "_experts")))
    assert [z[f"pre{i}"].shape for i in range(2)] == [(n, n_vocab) for n in n_pre]
    assert z["blk0"].shape == (block, n_vocab) and z["full1_experts"].shape == (n_layer,)
    assert all(np.all(np.isfinite(z[k])) for k in z.files)
    assert np.all(z["blk0_experts"] <= z["full0_experts"])  # the coreset is a subset of the experts
    r = subprocess.run([sys.executable, script, "--compare", str(simd), str(simd), str(scalar)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"{simd} against {simd}:" and lines[4] == f"{scalar} against {simd}:"
    for line in lines[1:4]:
        assert "max |diff| / std 0.00e+00, argmax differs in 0 of " in line, line
    assert "prefix" in lines[1] and "layers whose expert count differs 0" in lines[2]
    worst = [float(line.split("max |diff| / std ")[1].split(",")[0]) for line in lines[5:8]]
    assert all(np.isfinite(w) and w >= 0 for w in worst)
