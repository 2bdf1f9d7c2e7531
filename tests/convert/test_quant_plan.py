"""Per-tensor type plan (clover_gguf/convert/quant_plan.py) against llama.cpp's llama-quantize rules.

Table test for the REAL 40-layer Qwen3.6-35B-A3B shapes (shared/data/qwen3.6-35b-a3b.json, no
weights). The expectations below were derived by reading src/llama-quant.cpp of the llama.cpp
vendored in llama-cpp-python 0.3.36 (llama_tensor_get_type_impl and friends); each rule is cited
next to the entries it produces. Real dims: H 2048, 16 heads / 2 KV heads (n_gqa 8), 256
experts (so none of the "n_expert == 8" rules apply), every row length a multiple of 256.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess

import gguf
import numpy as np
import pytest

from clover_gguf.convert import quant_plan as QP
from clover_gguf.convert.convert import read_hparams

Q = gguf.GGMLQuantizationType
REAL = next((p for p in (pathlib.Path(__file__).resolve().parents[3] / "shared" / "data" / "qwen3.6-35b-a3b.json",
                         pathlib.Path("/work/shared/data/qwen3.6-35b-a3b.json")) if p.is_file()), None)

# use_more_bits(i, 40): i < 40/8 = 5, or i >= 7*40/8 = 35, or (i - 5) % 3 == 2  (llama-quant.cpp,
# llama_tensor_get_type_impl: `i_layer < n_layers/8 || i_layer >= 7*n_layers/8 || (i_layer - n_layers/8)%3 == 2`)
MORE_BITS_40 = {0, 1, 2, 3, 4, 7, 10, 13, 16, 19, 22, 25, 28, 31, 34, 35, 36, 37, 38, 39}
# Representative layers: GDN 0, 5, 6, 34; attention 3, 7, 11, 35, 39 (layer i is attention when (i+1) % 4 == 0).
LAYERS = (0, 3, 5, 6, 7, 11, 34, 35, 39)

# Tensors never quantised (tensor_allows_quantization): 1-D, names not ending in "weight",
# "_norm.weight", "ffn_gate_inp.weight" (router), "ssm_conv1d". The converter stores them as F32.
ALWAYS_F32 = ("attn_norm.weight", "post_attention_norm.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias",
              "ssm_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight", "ffn_gate_inp.weight",
              "ffn_gate_inp_shexp.weight")
# Clover's block tensors (docs/gguf-layout.md): F32 in every output ("ssm_conv1d" in the name, or 1-D)
BLOCK = ("ssm_conv1d_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")

GDN_W = ("attn_qkv.weight", "attn_gate.weight", "ssm_beta.weight", "ssm_alpha.weight", "ssm_out.weight")
ATTN_W = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight")
FFN_W = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_shexp.weight",
         "ffn_up_shexp.weight", "ffn_down_shexp.weight")


def expected(ftype: str, layer: int, suffix: str):
    """Hand-written llama-quant.cpp rules for the real 40-layer model (see comments)."""
    if suffix in ALWAYS_F32:
        return Q.F32
    base = {"q4_k_m": Q.Q4_K, "q5_k_m": Q.Q5_K, "q6_k": Q.Q6_K, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0,
            "iq4_xs": Q.IQ4_XS, "q2_k": Q.Q2_K, "q3_k_m": Q.Q3_K, "q4_k_s": Q.Q4_K}[ftype]  # llama_ftype_get_default_type
    more = layer in MORE_BITS_40
    if suffix in ("attn_qkv.weight", "attn_v.weight"):
        # category_is_attn_v() covers ATTENTION_V and ATTENTION_QKV; one per layer, so the
        # counter i_attention_wv equals the layer index and n_attention_wv = 40.
        if ftype == "iq4_xs":
            return Q.Q5_K  # "(IQ4_NL || IQ4_XS) && n_gqa() >= 4 -> Q5_K" (n_gqa = 16/2 = 8)
        if ftype in ("q4_k_m", "q5_k_m") and more:
            return Q.Q6_K  # "(Q4_K_M || Q5_K_M) && use_more_bits(i_attention_wv, n_attention_wv) -> Q6_K"
        if ftype == "q2_k":
            return Q.Q4_K  # "Q2_K: n_gqa() >= 4 ? Q4_K : Q3_K"
        if ftype == "q3_k_m":
            return Q.Q5_K if layer < 2 else Q.Q4_K  # "Q3_K_M: i_attention_wv < 2 ? Q5_K : Q4_K"
        if ftype == "q4_k_s" and layer < 4:
            return Q.Q5_K  # "Q4_K_S && i_attention_wv < 4 -> Q5_K"
        return base
    if suffix in ("ffn_down_exps.weight", "ffn_down_shexp.weight"):
        # FFN_DOWN category ("ffn_down" substring); layer parsed from the name (n_expert > 1)
        if ftype in ("q4_k_m", "q5_k_m") and more:
            return Q.Q6_K  # "Q4_K_M: use_more_bits -> Q6_K"; "Q5_K_M && use_more_bits -> Q6_K"
        if ftype == "iq4_xs" and layer < 5:
            return Q.Q5_K  # "i_layer < n_layer/8 && IQ4_XS && !has_imatrix -> Q5_K"
        if ftype == "q2_k":
            return Q.Q3_K  # "Q2_K -> Q3_K"
        if ftype == "q3_k_m":
            return Q.Q5_K if layer < 2 else Q.Q4_K  # "i_layer < n_layer/16 ? Q5_K : arch != FALCON || ... ? Q4_K"
        if ftype == "q4_k_s" and layer < 5:
            return Q.Q5_K  # "Q4_K_S && arch != FALCON && i_layer < n_layer/8 -> Q5_K"
        return base
    if suffix == "attn_output.weight":
        # ATTENTION_OUTPUT, n_expert != 8, not Falcon: "Q2_K -> Q3_K", "Q3_K_M -> Q4_K"
        return {"q2_k": Q.Q3_K, "q3_k_m": Q.Q4_K}.get(ftype, base)
    return base  # attn_q/k, attn_gate, ssm_beta/alpha/out, ffn gate/up: no rule for these ftypes


@pytest.fixture(scope="module")
def real_hp():
    if REAL is None:
        pytest.skip("shared/data/qwen3.6-35b-a3b.json not found")
    return read_hparams(json.loads(REAL.read_text()))


@pytest.mark.parametrize("arch", ["qwen35moe", "clover_moe"])
@pytest.mark.parametrize("ftype", ["q4_k_m", "q5_k_m", "q6_k", "q8_0", "q4_0", "iq4_xs", "q2_k", "q3_k_m", "q4_k_s"])
def test_real_40_layer_table(real_hp, ftype, arch):
    hp = real_hp
    assert hp.n_layer == 40 and hp.E == 256 and hp.nh // hp.nkv == 8
    shapes = QP.tensor_shapes(hp, arch)
    plan = QP.plan_types(arch, hp, dict(shapes), ftype)
    assert set(plan) == {n for n, _ in shapes}
    checked = 0
    for layer in LAYERS:
        kind = hp.layer_types[layer]
        suffixes = ("attn_norm.weight", "post_attention_norm.weight") + FFN_W + (
            "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")
        if kind == "linear_attention":
            suffixes += GDN_W + ("ssm_conv1d.weight", "ssm_a", "ssm_dt.bias", "ssm_norm.weight")
            if arch == "clover_moe":
                suffixes += BLOCK
        else:
            suffixes += ATTN_W + ("attn_q_norm.weight", "attn_k_norm.weight")
        for s in suffixes:
            name = f"blk.{layer}.{s}"
            assert name in plan, name
            want = Q.F32 if s in ALWAYS_F32 + BLOCK else expected(ftype, layer, s)
            assert plan[name] == want, (name, ftype, plan[name].name, want.name)
            checked += 1
    assert checked > 150
    # the block tensors change no trunk tensor's type: the clover_moe plan is the qwen35moe plan plus F32
    trunk = QP.plan_types("qwen35moe", hp, dict(QP.tensor_shapes(hp)), ftype)
    assert {n: t for n, t in plan.items() if not n.endswith(BLOCK)} == trunk
    assert len(plan) - len(trunk) == (4 * 30 if arch == "clover_moe" else 0)
    # output.weight -> Q6_K unless the default type is Q8_0 (OUTPUT branch: "new_type != Q8_0 -> Q6_K")
    assert plan["output.weight"] == (Q.Q8_0 if ftype == "q8_0" else Q.Q6_K)
    # token_embd: untied model (output.weight exists) -> TOKEN_EMBD branch, unchanged for these ftypes
    assert plan["token_embd.weight"] == expected(ftype, -1, "token_embd.weight")
    assert plan["output_norm.weight"] == Q.F32
    # whole-model count of the bumped tensors
    if ftype in ("q4_k_m", "q5_k_m"):
        assert sum(plan[f"blk.{i}.{s}"] == Q.Q6_K for i in range(40)
                   for s in ("attn_qkv.weight", "attn_v.weight") if f"blk.{i}.{s}" in plan) == len(MORE_BITS_40)
        assert sum(plan[f"blk.{i}.ffn_down_exps.weight"] == Q.Q6_K for i in range(40)) == len(MORE_BITS_40)
    # every layer, not only LAYERS: the counted rules of the new mixes
    for i in range(40):
        v = f"blk.{i}.attn_qkv.weight" if hp.layer_types[i] == "linear_attention" else f"blk.{i}.attn_v.weight"
        assert plan[v] == expected(ftype, i, v.split(".", 2)[-1]), v
        for s in ("ffn_down_exps.weight", "ffn_down_shexp.weight"):
            assert plan[f"blk.{i}.{s}"] == expected(ftype, i, s), (i, s)


@pytest.mark.parametrize("ftype,want", [("f32", Q.F32), ("f16", Q.F16), ("bf16", Q.BF16)])
def test_float_ftypes(real_hp, ftype, want):
    # llama.cpp runs the mix rules only when the default type is quantised; non-quantisable
    # tensors keep F32
    shapes = QP.tensor_shapes(real_hp)
    plan = QP.plan_types("qwen35moe", real_hp, shapes, ftype)
    for name, shape in shapes:
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        if len(shape) == 1 or suffix in ALWAYS_F32 or name == "output_norm.weight":
            assert plan[name] == Q.F32, name
        else:
            assert plan[name] == want, name


def _small(E=16, nh=4, nkv=2, n_layer=8):
    return {"n_layer": n_layer, "E": E, "nh": nh, "nkv": nkv}


@pytest.mark.parametrize("ftype,ne0,want", [
    # tensor_type_fallback: ncols % block != 0
    ("q4_k_m", 128, Q.Q5_0), ("q5_k_m", 128, Q.Q5_1), ("q6_k", 128, Q.Q8_0), ("iq4_xs", 128, Q.IQ4_NL),
    ("q4_k_m", 48, Q.F16), ("iq4_xs", 48, Q.F16), ("q8_0", 48, Q.F16), ("q4_0", 48, Q.F16),
    ("q8_0", 96, Q.Q8_0), ("q4_0", 96, Q.Q4_0), ("q4_k_m", 512, Q.Q4_K),
])
def test_fallback_row_length(ftype, ne0, want):
    plan = QP.plan_types("qwen35moe", _small(), {"blk.5.attn_gate.weight": (64, ne0)}, ftype)
    assert plan["blk.5.attn_gate.weight"] == want


def test_output_fallback_and_more_bits_fallback():
    # OUTPUT: "nx % qk_k != 0 -> Q8_0"; a bumped Q6_K ffn_down with 128-wide rows falls back to Q8_0
    t = {"output.weight": (100, 128), "token_embd.weight": (100, 128), "blk.0.ffn_down_exps.weight": (16, 64, 128)}
    plan = QP.plan_types("qwen35moe", _small(), t, "q4_k_m")
    assert plan["output.weight"] == Q.Q8_0
    assert plan["token_embd.weight"] == Q.Q5_0
    assert plan["blk.0.ffn_down_exps.weight"] == Q.Q8_0


def test_eight_experts_rules():
    # n_expert == 8: attn_v-like and attn_k -> Q8_0; attn_output -> Q5_K (Q4_K_M, IQ4_XS)
    t = {"blk.3.attn_v.weight": (128, 256), "blk.3.attn_k.weight": (128, 256), "blk.3.attn_q.weight": (512, 256),
         "blk.3.attn_output.weight": (256, 256), "blk.0.attn_qkv.weight": (512, 256)}
    for ftype in ("q4_k_m", "iq4_xs"):
        plan = QP.plan_types("qwen35moe", _small(E=8), t, ftype)
        assert plan["blk.3.attn_v.weight"] == plan["blk.0.attn_qkv.weight"] == plan["blk.3.attn_k.weight"] == Q.Q8_0
        assert plan["blk.3.attn_output.weight"] == Q.Q5_K
        assert plan["blk.3.attn_q.weight"] == QP.FTYPES[ftype][1]
    plan = QP.plan_types("qwen35moe", _small(E=16), t, "q4_k_m")
    assert plan["blk.3.attn_output.weight"] == Q.Q4_K and plan["blk.3.attn_k.weight"] == Q.Q4_K


def test_attn_v_counter_follows_loader_order():
    # i_attention_wv counts attn_v-like tensors in llama.cpp's loader order (layer number, then
    # name), not in file order: with 16 layers, use_more_bits(i, 16) is true for i in {0, 1, 4, 7, 10, 13, 14, 15}
    n = 16
    t = {f"blk.{i}.attn_qkv.weight": (512, 256) for i in reversed(range(n))}
    plan = QP.plan_types("qwen35moe", _small(n_layer=n), t, "q4_k_m")
    bumped = {i for i in range(n) if plan[f"blk.{i}.attn_qkv.weight"] == Q.Q6_K}
    assert bumped == {0, 1, 4, 7, 10, 13, 14, 15}


def test_file_types_and_errors():
    F = gguf.LlamaFileType
    assert [QP.file_type(f) for f in ("q4_0", "q8_0", "q4_k_m", "q5_k_m", "q6_k", "iq4_xs")] == [2, 7, 15, 17, 18, 30]
    # LLAMA_FTYPE_MOSTLY_Q2_K = 10, Q3_K_M = 12, Q4_K_S = 14 (include/llama.h)
    assert [QP.file_type(f) for f in ("q2_k", "q3_k_m", "q4_k_s")] == [10, 12, 14]
    assert QP.file_type("bf16") == int(F.MOSTLY_BF16) and QP.file_type("f32") == int(F.ALL_F32)
    with pytest.raises(ValueError, match=r"outtype 'q3_k_l': expected one of .*q2_k, q3_k_m, q4_k_s, q4_k_m"):
        QP.plan_types("qwen35moe", _small(), {}, "q3_k_l")
    # any letter case, as llama-quantize's type names
    assert QP.outtype_name("Q4_K_M") == "q4_k_m" and QP.outtype_name("Q3_K_m") == "q3_k_m"
    t = {"blk.3.attn_v.weight": (128, 256), "blk.3.ffn_down_exps.weight": (16, 256, 256)}
    assert QP.plan_types("qwen35moe", _small(), t, "Q2_K") == QP.plan_types("qwen35moe", _small(), t, "q2_k")
    for bad in ("q4_k", "", None):
        with pytest.raises(ValueError, match="expected one of"):
            QP.outtype_name(bad)


@pytest.mark.parametrize("ftype,ne0,want", [
    # tensor_type_fallback: "Q2_K, Q3_K -> Q4_0"
    ("q2_k", 128, Q.Q4_0), ("q3_k_m", 128, Q.Q4_0), ("q4_k_s", 128, Q.Q5_0), ("q2_k", 48, Q.F16),
])
def test_fallback_row_length_low_bit_mixes(ftype, ne0, want):
    plan = QP.plan_types("qwen35moe", _small(), {"blk.5.attn_gate.weight": (64, ne0)}, ftype)
    assert plan["blk.5.attn_gate.weight"] == want


def test_low_bit_mixes_small_gqa_and_eight_experts():
    t = {"blk.3.attn_v.weight": (128, 256), "blk.3.attn_k.weight": (128, 256), "blk.3.attn_output.weight": (256, 256),
         "blk.0.attn_qkv.weight": (512, 256), "blk.1.attn_qkv.weight": (512, 256), "blk.2.attn_qkv.weight": (512, 256),
         "blk.4.attn_qkv.weight": (512, 256), "blk.5.attn_qkv.weight": (512, 256)}
    # n_gqa = 4 / 2 = 2 < 4: Q2_K gives attn_v-like Q3_K
    plan = QP.plan_types("qwen35moe", _small(), t, "q2_k")
    assert {plan[n] for n in t if "attn_v" in n or "attn_qkv" in n} == {Q.Q3_K}
    assert plan["blk.3.attn_output.weight"] == Q.Q3_K and plan["blk.3.attn_k.weight"] == Q.Q2_K
    # loader order: layers 0, 1, 2, 3 (attn_v), 4, 5 -> i_attention_wv 0..5
    plan = QP.plan_types("qwen35moe", _small(), t, "q3_k_m")
    assert [plan[n] for n in ("blk.0.attn_qkv.weight", "blk.1.attn_qkv.weight", "blk.2.attn_qkv.weight",
                              "blk.3.attn_v.weight")] == [Q.Q5_K, Q.Q5_K, Q.Q4_K, Q.Q4_K]
    plan = QP.plan_types("qwen35moe", _small(), t, "q4_k_s")
    assert [plan[n] for n in ("blk.2.attn_qkv.weight", "blk.3.attn_v.weight", "blk.4.attn_qkv.weight")] == \
        [Q.Q5_K, Q.Q5_K, Q.Q4_K]
    assert plan["blk.3.attn_output.weight"] == Q.Q4_K
    # n_expert == 8: attn_v-like and attn_k Q8_0, attn_output Q5_K for all three
    for ftype in ("q2_k", "q3_k_m", "q4_k_s"):
        plan = QP.plan_types("qwen35moe", _small(E=8), t, ftype)
        assert plan["blk.3.attn_v.weight"] == plan["blk.0.attn_qkv.weight"] == plan["blk.3.attn_k.weight"] == Q.Q8_0
        assert plan["blk.3.attn_output.weight"] == Q.Q5_K


# ---------------------------------------------------------------------------------------------
# Against llama.cpp's own llama-quantize (skipped unless the binary is available: set
# LLAMA_QUANTIZE, or build it under /tmp/lq-build from llama-cpp-python 0.3.36's llama.cpp)
# ---------------------------------------------------------------------------------------------

LLAMA_QUANTIZE = next((p for p in (os.environ.get("LLAMA_QUANTIZE"), "/tmp/lq-build/bin/llama-quantize")
                       if p and os.access(p, os.X_OK)), None)
needs_lq = pytest.mark.skipif(LLAMA_QUANTIZE is None, reason="llama-quantize not built (set LLAMA_QUANTIZE)")
LQ_FTYPES = {"q4_k_m": "Q4_K_M", "q5_k_m": "Q5_K_M", "q6_k": "Q6_K", "q8_0": "Q8_0", "q4_0": "Q4_0",
             "iq4_xs": "IQ4_XS", "q2_k": "Q2_K", "q3_k_m": "Q3_K_M", "q4_k_s": "Q4_K_S"}
_DRY_LINE = re.compile(r"\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+),\s*size =.*?(?:\((\S+)\))?\s*$")


def _bench_module():
    import importlib.util
    root = pathlib.Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("make_bench_model", root / "bench" / "make_bench_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _sparse_bf16_skeleton(path, cfg):
    """A BF16 qwen35moe GGUF with the converter's layout and zero data (a sparse file: ~69 GB
    apparent size for the real 40 layers, a few MB on disk); llama-quantize --dry-run needs the
    shapes only."""
    from clover_gguf.convert import convert as C
    MB = _bench_module()
    hp = read_hparams(cfg)
    vdir = path.parent / "vocab"
    vdir.mkdir(exist_ok=True)
    MB.build_tokenizer_dir(vdir, n_tokens=512)
    vocab = C.read_vocab(vdir, hp)
    shapes = QP.tensor_shapes(hp)
    types = QP.plan_types("qwen35moe", hp, dict(shapes), "bf16")
    w = gguf.GGUFWriter(path=None, arch="qwen35moe")
    C.add_trunk_metadata(w, hp, vocab, "bf16", "skeleton")
    sizes = [int(np.prod(s)) * (4 if types[n] == Q.F32 else 2) for n, s in shapes]
    for (n, s), nb in zip(shapes, sizes):
        w.add_tensor_info(n, s, np.dtype(np.float32), nb, raw_dtype=types[n])
    w.write_header_to_file(path=path)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    off = f.tell()
    for nb in sizes:
        off += (-off) % 32 + nb
    f.flush()
    f.truncate(off)
    w.close()
    return hp, shapes


@needs_lq
def test_llama_quantize_dry_run_real_40_layers(real_hp, tmp_path):
    """llama-quantize --dry-run on the real 40-layer shapes picks our type for every tensor."""
    cfg = json.loads(REAL.read_text())
    hp, shapes = _sparse_bf16_skeleton(tmp_path / "real40-bf16.gguf", cfg)
    for ftype, name in LQ_FTYPES.items():
        p = subprocess.run([LLAMA_QUANTIZE, "--dry-run", str(tmp_path / "real40-bf16.gguf"), name, "1"],
                           capture_output=True, text=True, timeout=120)
        theirs = {}
        for line in (p.stdout + p.stderr).splitlines():
            m = _DRY_LINE.search(line)
            if m:
                theirs[m.group(1)] = (m.group(3) or m.group(2)).upper()
        assert p.returncode == 0 and len(theirs) == len(shapes), (p.stdout + p.stderr)[-2000:]
        ours = {n: t.name for n, t in QP.plan_types("qwen35moe", hp, dict(shapes), ftype).items()}
        assert ours == theirs, ftype


@needs_lq
def test_llama_quantize_on_our_bf16_equals_our_output(make_gguf, tmp_path):
    """Acceptance check: llama-quantize on our BF16 file gives the same per-tensor types as our
    own quantised output of the same checkpoint (and the same bytes: both use ggml's reference
    quantisers without an imatrix)."""
    bf16 = make_gguf("bf16", arch="qwen35moe", clover=False)
    for ftype, name in LQ_FTYPES.items():
        ours = gguf.GGUFReader(make_gguf(ftype, arch="qwen35moe", clover=False))
        out = tmp_path / f"lq-{ftype}.gguf"
        p = subprocess.run([LLAMA_QUANTIZE, str(bf16), str(out), name, "2"], capture_output=True, text=True,
                           timeout=300)
        assert p.returncode == 0, (p.stdout + p.stderr)[-2000:]
        theirs = {t.name: t for t in gguf.GGUFReader(out).tensors}
        assert {t.name: t.tensor_type for t in ours.tensors} == {n: t.tensor_type for n, t in theirs.items()}, ftype
        for t in ours.tensors:
            assert np.array_equal(np.asarray(t.data).view(np.uint8),
                                  np.asarray(theirs[t.name].data).view(np.uint8)), (ftype, t.name)
