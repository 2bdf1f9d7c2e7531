"""bench/make_bench_model.py: random-weight GGUFs written directly in quantised form.

Tiny dims only (fast); the real-dims path differs only in shapes, checked through the piece plan.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest

from clover_gguf.convert import convert as C
from clover_gguf.convert import quant_plan as QP

ROOT = pathlib.Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType


def _load_module():
    spec = importlib.util.spec_from_file_location("make_bench_model", ROOT / "bench" / "make_bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


MB = _load_module()


@pytest.fixture(scope="module")
def bench_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cache = {}

    def get(outtype, arch="qwen35moe", threads=None, name=None):
        key = (outtype, arch, threads)
        if key not in cache:
            p = out / (name or f"{outtype}-{arch}-{threads}.gguf")
            cache[key] = MB.make_bench_model(p, dims="tiny", outtype=outtype, arch=arch, threads=threads,
                                             progress=False)
        return cache[key]
    return get


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_layout_types_and_values(bench_files, outtype):
    res = bench_files(outtype)
    r = gguf.GGUFReader(res["path"])
    hp = C.read_hparams(MB.bench_config("tiny"))
    shapes = QP.tensor_shapes(hp, "qwen35moe")
    plan = QP.plan_types("qwen35moe", hp, dict(shapes), outtype)
    assert [(t.name, tuple(int(x) for x in reversed(list(t.shape)))) for t in r.tensors] == shapes
    assert {t.name: t.tensor_type for t in r.tensors} == plan
    m = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert m["general.architecture"] == "qwen35moe"
    assert m["general.file_type"] == QP.file_type(outtype) and m["general.quantization_version"] == 2
    assert m["qwen35moe.block_count"] == 4 and m["qwen35moe.expert_count"] == hp.E
    assert len(m["tokenizer.ggml.tokens"]) == hp.V and m["tokenizer.ggml.pre"] == "qwen35"
    assert m["tokenizer.ggml.tokens"][m["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    if outtype == "q4_k_m":
        assert plan["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and plan["output.weight"] == Q.Q6_K
    t = {x.name: x for x in r.tensors}

    def deq(name):
        x = t[name]
        return gguf.quants.dequantize(np.asarray(x.data), x.tensor_type).reshape(-1)

    # sensible scales: norms ~ 1, ssm_a in [-16, -1], linear weights ~ N(0, 1/ne0), pieces differ
    assert abs(deq("blk.0.attn_norm.weight").mean() - 1) < 0.05
    a = deq("blk.0.ssm_a")
    assert a.min() >= -16 and a.max() <= -1
    w = deq("blk.1.ffn_gate_exps.weight").reshape(hp.E, -1)
    assert abs(w.std() * np.sqrt(hp.H) - 1) < 0.1
    assert not np.allclose(w[0], w[1])
    assert abs(deq("token_embd.weight").std() - 0.05) < 0.01


def test_deterministic_across_threads(bench_files):
    a = pathlib.Path(bench_files("q4_k_m", threads=None)["path"]).read_bytes()
    b = pathlib.Path(bench_files("q4_k_m", threads=1)["path"]).read_bytes()
    assert a == b


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_loads_and_generates_in_engine(bench_files, outtype):
    import clover_gguf
    path = bench_files(outtype)["path"]
    with clover_gguf.Model(path) as m:
        assert m.arch == "qwen35moe"
        ids = m.tokenize("Hello world")
        out, stats = m.generate_tokens(ids, max_tokens=4, mode="ar")
        assert 1 <= len(out) <= 4 and all(0 <= i < 2048 for i in out)
        assert stats["n_forward"] >= 1


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_clover_moe_layout_record_and_block_tensors(bench_files, outtype):
    """--arch clover_moe: the complete Clover file of docs/gguf-layout.md: the qwen35moe trunk's
    tensors, types and bytes under the clover_moe. prefix plus expert_shared_count, the block
    tensors after each GDN layer's ssm_out (F32, random, non-zero, at the stated scales) and the
    decoding record at its defaults with the <|mask|> token."""
    from clover_gguf.convert import record as R
    res = bench_files(outtype, arch="clover_moe")
    r = gguf.GGUFReader(res["path"])
    parent = {x.name: x for x in gguf.GGUFReader(bench_files(outtype)["path"]).tensors}
    hp = C.read_hparams(MB.bench_config("tiny"))
    assert [(t.name, tuple(int(x) for x in reversed(list(t.shape)))) for t in r.tensors] == \
        QP.tensor_shapes(hp, "clover_moe")
    block = [t for t in r.tensors if t.name not in parent]
    assert [t.name for t in block] == [f"blk.{i}.{g}" for i in (0, 1, 2) for g in
                                       ("ssm_conv1d_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")]
    for t in r.tensors:
        if t.name in parent:
            assert t.tensor_type == parent[t.name].tensor_type, t.name
            assert np.array_equal(np.asarray(t.data), np.asarray(parent[t.name].data)), t.name
    for t in block:
        a = np.asarray(t.data)
        assert t.tensor_type == Q.F32 and np.all(a != 0) and np.all(np.isfinite(a)), t.name
    t = {x.name: np.asarray(x.data) for x in block}
    assert abs(t["blk.0.ssm_conv1d_right.weight"].std() - 0.5) < 0.05
    assert 0.6 < t["blk.1.bd_logit_scale"].mean() < 1.8
    m = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert m["general.architecture"] == "clover_moe" and m["clover_moe.expert_shared_count"] == 1
    assert m["clover_moe.block_count"] == 4 and m["clover_moe.expert_count"] == 8
    mask = m["tokenizer.ggml.mask_token_id"]
    assert m["tokenizer.ggml.tokens"][mask] == "<|mask|>"
    for f in R.FIELDS[1:]:
        want = np.float32(f.default) if f.gtype == "f32" else f.default
        assert m[f.key] == want, f.key


def test_clover_moe_runs_every_mode_in_engine(bench_files):
    """Depends on the engine's clover_moe loader: the complete file runs diffusion by default,
    spec and ar, with the record's defaults."""
    import clover_gguf
    res = bench_files("q8_0", arch="clover_moe")
    with clover_gguf.Model(res["path"]) as m:
        assert m.arch == "clover_moe" and m.has_block
        ids = m.tokenize("Hi")
        out, stats = m.generate_tokens(ids, max_tokens=4, block_size=4)
        assert 1 <= len(out) <= 4 and stats["mode"] == "diffusion"
        ar, _ = m.generate_tokens(ids, max_tokens=4, mode="ar")
        spec, _ = m.generate_tokens(ids, max_tokens=4, mode="spec", block_size=4)
        assert spec == ar


def test_real_dims_pieces_bounded():
    """The real 40-layer plan streams in pieces of <= PIECE_VALUES values (bounded memory), the
    pieces tile every tensor exactly and never cross an expert matrix."""
    hp = C.read_hparams(MB.bench_config("real", 40))
    shapes = QP.tensor_shapes(hp)
    assert hp.V == 248320 and hp.n_layer == 40
    total = 0
    for name, shape in shapes:
        rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        pieces = MB._pieces(shape)
        assert pieces[0][0] == 0 and pieces[-1][1] == rows
        assert all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
        assert max((r1 - r0) * shape[-1] for r0, r1 in pieces) <= MB.PIECE_VALUES
        if len(shape) == 3:
            assert all(r0 // shape[1] == (r1 - 1) // shape[1] for r0, r1 in pieces), name
        total += int(np.prod(shape))
    plan = QP.plan_types("qwen35moe", hp, dict(shapes), "q4_k_m")
    size = sum(int(np.prod(s)) // gguf.GGML_QUANT_SIZES[plan[n]][0] * gguf.GGML_QUANT_SIZES[plan[n]][1]
               for n, s in shapes)
    assert 34e9 < total < 36e9  # 35B-A3B
    assert 19e9 < size < 23e9  # "about 21 GB"


def test_cli_tiny(tmp_path):
    out = tmp_path / "cli.gguf"
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "make_bench_model.py"), str(out), "--dims", "tiny",
                        "--layers", "2", "--outtype", "iq4_xs", "--no-progress", "--threads", "2"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = gguf.GGUFReader(out)
    assert r.fields["qwen35moe.block_count"].contents() == 2
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.1.ffn_up_exps.weight"] == Q.IQ4_XS and types["blk.0.attn_qkv.weight"] == Q.Q8_0


def test_unique_experts_repeats_expert_bytes(tmp_path):
    res = MB.make_bench_model(tmp_path / "u.gguf", dims="tiny", n_layers=1, outtype="q4_k_m", threads=2,
                              progress=False, unique_experts=3)
    r = gguf.GGUFReader(res["path"])
    t = {x.name: x for x in r.tensors}
    for name in ("blk.0.ffn_gate_exps.weight", "blk.0.ffn_down_exps.weight"):
        e = np.asarray(t[name].data).reshape(8, -1)  # 8 experts in the tiny dims
        assert np.array_equal(e[3], e[0]) and np.array_equal(e[7], e[1]) and np.array_equal(e[5], e[2])
        assert not np.array_equal(e[1], e[0]) and not np.array_equal(e[2], e[1])
    # 2-D tensors are still drawn in full
    full = gguf.GGUFReader(MB.make_bench_model(tmp_path / "f.gguf", dims="tiny", n_layers=1, outtype="q4_k_m",
                                               progress=False)["path"])
    f = {x.name: x for x in full.tensors}
    assert np.array_equal(np.asarray(f["output.weight"].data), np.asarray(t["output.weight"].data))
    e_full = np.asarray(f["blk.0.ffn_gate_exps.weight"].data).reshape(8, -1)
    e_u = np.asarray(t["blk.0.ffn_gate_exps.weight"].data).reshape(8, -1)
    assert np.array_equal(e_full[:3], e_u[:3]) and not np.array_equal(e_full[3], e_u[3])
