"""Tests of the HF -> GGUF converter (clover_gguf/convert/convert.py; clover-spec section 4).

The reference for every tensor is an independent torch implementation of the spec 4.3
transforms applied to the HF checkpoint (``expected_tensors`` below: reshape/permute V-head
reorder as in the spec text, not the converter's index arrays). GGUF files are read back with
``gguf.GGUFReader`` and dequantised with ``gguf.quants.dequantize``.

Tolerances: f32 and bf16 are exact (bf16 compared as bit patterns); f16 must equal torch's
round-to-nearest-even cast of the HF value (so |error| <= 2^-11 relative for normal values,
also asserted); q8_0 must equal gguf.quants quantize -> dequantize of the transformed tensor
exactly, and lie within d * (1/2 + 127/2048) of it (d = max|block|/127: half a step plus the f16
rounding of the scale).
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

from llamacpp import LLAMA_CPP_SRC, llama_python, run_llama_converter
import torch
from safetensors.torch import load_file, save_file

from clover_gguf.convert import convert as C
from reference.checkpoint import QWEN35_PRETOKENIZER_REGEX

ROOT = pathlib.Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType
# Clover's block tensors (docs/gguf-layout.md): HF suffix after layers.N.linear_attn. -> GGUF suffix
BLOCK_SOFTMAX = {"bd_softmax_logit_scale": "bd_logit_scale", "bd_softmax_history_bias": "bd_history_bias",
                 "bd_softmax_history_c": "bd_history_c"}
BLOCK_HF = ("conv_right_weight", *BLOCK_SOFTMAX)
BLOCK_GGUF = ("ssm_conv1d_right.weight", *BLOCK_SOFTMAX.values())
GDN_LAYERS = (0, 1, 2)  # of the tiny checkpoint


# ---------------------------------------------------------------------------------------------
# Fixtures: tiny checkpoints (spec section 1 tiny dims, every parameter random) and conversions
# ---------------------------------------------------------------------------------------------

class _LazyCkpts(dict):
    """name -> checkpoint directory, written on first use (the factories cache per session)."""

    def __init__(self, makers):
        super().__init__()
        self._makers = makers

    def __missing__(self, key):
        self[key] = self._makers[key]()
        return self[key]


@pytest.fixture(scope="module")
def ckpts(make_ckpt, make_hf_ckpt):
    """Tiny checkpoints with the same seed (tests/conftest.py, shared per session), written when a
    test first asks for them: Clover fused/model., Clover nested prefix, Clover per-expert, the
    parent (no Clover tensors or keys), the parent and Clover with one MTP layer (``mtp.*``), the
    MTP parent nested and per-expert, and ``hf_mtp``: the MTP parent as transformers'
    ``save_pretrained`` writes it (reference.checkpoint.make_hf_saved_checkpoint; same values
    as "mtp"). Never modified in place (tests copy them first)."""
    opts = {
        "clover": {},
        "nested": {"prefix": "model.language_model."},
        "perexpert": {"fused_experts": False},
        "parent": {"clover": False},
        "mtp": {"clover": False, "mtp": 1},
        "clover_mtp": {"mtp": 1},
        "mtp_nested_perexpert": {"clover": False, "mtp": 1, "prefix": "model.language_model.",
                                 "fused_experts": False},
    }
    makers = {k: (lambda o=o: make_ckpt(**o)) for k, o in opts.items()}
    makers["hf_mtp"] = lambda: make_hf_ckpt(mtp=1)
    return _LazyCkpts(makers)


@pytest.fixture(scope="module")
def converted(ckpts, tmp_path_factory):
    """convert once per (checkpoint, outtype, arch); returns a function giving (result, reader)."""
    out = tmp_path_factory.mktemp("gguf")
    cache = {}

    def get(which="clover", outtype="bf16", arch=None):
        key = (which, outtype, arch)
        if key not in cache:
            path = out / f"{which}-{outtype}-{arch}.gguf"
            res = C.convert(ckpts[which], path, outtype=outtype, arch=arch, progress=False)
            cache[key] = (res, gguf.GGUFReader(path))
        return cache[key]
    return get


def _copy_ckpt(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _add_tensor(ckpt: pathlib.Path, name: str, t: torch.Tensor) -> None:
    """Add one tensor in a new shard and list it in the index."""
    shard = f"extra-{len(list(ckpt.glob('extra-*.safetensors')))}.safetensors"
    save_file({name: t.contiguous()}, str(ckpt / shard), metadata={"format": "pt"})
    idx_path = ckpt / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    idx["weight_map"][name] = shard
    idx_path.write_text(json.dumps(idx))


# ---------------------------------------------------------------------------------------------
# Reference: spec 4.3 transforms in torch
# ---------------------------------------------------------------------------------------------

def load_hf(ckpt: pathlib.Path) -> dict[str, torch.Tensor]:
    idx = json.loads((ckpt / "model.safetensors.index.json").read_text())
    out = {}
    for shard in sorted(set(idx["weight_map"].values())):
        out.update(load_file(str(ckpt / shard)))
    return out


def reorder_v(t: torch.Tensor, dim: int, hk: int, r: int, hd: int) -> torch.Tensor:
    """Spec 4.3: value head i*r + j (grouped by key head) moves to j*Hk + i (tiled)."""
    shape = list(t.shape)
    t = t.reshape(shape[:dim] + [hk, r, hd] + shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def expected_tensors(ckpt: pathlib.Path, clover: bool = True, mtp: bool = True) -> dict[str, torch.Tensor]:
    """GGUF name -> transformed tensor (numpy-order shape). F32 tensors as float32, the rest in
    the checkpoint dtype (bf16). With ``mtp`` the ``mtp.*`` block (when present) is expected as
    llama.cpp writes it: ``mtp.layers.j`` is block num_hidden_layers + j, plus ``nextn.*``."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    hf = load_hf(ckpt)
    pre = "model.language_model." if any(k.startswith("model.language_model.") for k in hf) else "model."
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    r = hv // hk
    qk = 2 * hk * dk
    E = tc["num_experts"]
    n_layer = tc["num_hidden_layers"]
    f32 = lambda t: t.float()  # noqa: E731
    p1 = lambda t: t.float() + 1.0  # noqa: E731  (zero-centred norm)

    ex = {"token_embd.weight": hf[pre + "embed_tokens.weight"],
          "output_norm.weight": p1(hf[pre + "norm.weight"]),
          "output.weight": hf["lm_head.weight"]}
    blocks = [(f"{pre}layers.{i}.", i, (i + 1) % tc["full_attention_interval"] != 0) for i in range(n_layer)]
    n_mtp = 1 + max((int(k.split(".")[2]) for k in hf if k.startswith("mtp.layers.")), default=-1)
    if mtp and n_mtp:
        blocks += [(f"mtp.layers.{j}.", n_layer + j, False) for j in range(n_mtp)]
        b = f"blk.{n_layer}."
        ex[b + "nextn.eh_proj.weight"] = hf["mtp.fc.weight"]
        ex[b + "nextn.enorm.weight"] = p1(hf["mtp.pre_fc_norm_embedding.weight"])
        ex[b + "nextn.hnorm.weight"] = p1(hf["mtp.pre_fc_norm_hidden.weight"])
        ex[b + "nextn.shared_head_norm.weight"] = p1(hf["mtp.norm.weight"])
    for L, i, gdn in blocks:
        b = f"blk.{i}."
        ex[b + "attn_norm.weight"] = p1(hf[L + "input_layernorm.weight"])
        ex[b + "post_attention_norm.weight"] = p1(hf[L + "post_attention_layernorm.weight"])
        if gdn:
            a = L + "linear_attn."
            qkv = hf[a + "in_proj_qkv.weight"]
            ex[b + "attn_qkv.weight"] = torch.cat([qkv[:qk], reorder_v(qkv[qk:], 0, hk, r, dv)])
            ex[b + "attn_gate.weight"] = reorder_v(hf[a + "in_proj_z.weight"], 0, hk, r, dv)
            ex[b + "ssm_out.weight"] = reorder_v(hf[a + "out_proj.weight"], 1, hk, r, dv)
            ex[b + "ssm_norm.weight"] = f32(hf[a + "norm.weight"])  # no +1
            ex[b + "ssm_beta.weight"] = reorder_v(hf[a + "in_proj_b.weight"], 0, hk, r, 1)
            ex[b + "ssm_alpha.weight"] = reorder_v(hf[a + "in_proj_a.weight"], 0, hk, r, 1)
            c = hf[a + "conv1d.weight"].float().squeeze(1)
            ex[b + "ssm_conv1d.weight"] = torch.cat([c[:qk], reorder_v(c[qk:], 0, hk, r, dv)])
            heads = lambda t: reorder_v(t.float()[:, None], 0, hk, r, 1)[:, 0]  # noqa: E731
            ex[b + "ssm_a"] = (-torch.exp(heads(hf[a + "A_log"]).double())).float()
            ex[b + "ssm_dt.bias"] = heads(hf[a + "dt_bias"])
            if clover:  # spec 4.3: the right taps as ssm_conv1d, the block softmax per V head
                c = hf[a + "conv_right_weight"].float().squeeze(1)
                ex[b + "ssm_conv1d_right.weight"] = torch.cat([c[:qk], reorder_v(c[qk:], 0, hk, r, dv)])
                for hf_name, g in BLOCK_SOFTMAX.items():
                    ex[b + g] = heads(hf[a + hf_name])
        else:
            a = L + "self_attn."
            for h, g in [("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")]:
                ex[b + g + ".weight"] = hf[a + h + ".weight"]
            ex[b + "attn_q_norm.weight"] = p1(hf[a + "q_norm.weight"])
            ex[b + "attn_k_norm.weight"] = p1(hf[a + "k_norm.weight"])
        m = L + "mlp."
        ex[b + "ffn_gate_inp.weight"] = f32(hf[m + "gate.weight"])
        if m + "experts.gate_up_proj" in hf:
            gu = hf[m + "experts.gate_up_proj"]
            I = gu.shape[1] // 2
            ex[b + "ffn_gate_exps.weight"], ex[b + "ffn_up_exps.weight"] = gu[:, :I], gu[:, I:]
            ex[b + "ffn_down_exps.weight"] = hf[m + "experts.down_proj"]
        else:
            for w in ("gate", "up", "down"):
                ex[b + f"ffn_{w}_exps.weight"] = torch.stack(
                    [hf[m + f"experts.{e}.{w}_proj.weight"] for e in range(E)])
        ex[b + "ffn_gate_inp_shexp.weight"] = f32(hf[m + "shared_expert_gate.weight"]).reshape(-1)
        for w in ("gate", "up", "down"):
            ex[b + f"ffn_{w}_shexp.weight"] = hf[m + f"shared_expert.{w}_proj.weight"]
    return ex


def _f32_name(name: str) -> bool:
    return name.endswith(("norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "conv1d.weight",
                          "ssm_a", ".bias") + BLOCK_GGUF)


def gguf_tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


def kv(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _numpy_shape(t) -> tuple:
    return tuple(int(x) for x in reversed(list(t.shape)))


# The decoding record (docs/gguf-layout.md): field, GGUF key, type, default; a hand-written copy of
# the table, independent of clover_gguf/convert/record.py
RECORD = [
    ("mask_token_id", "tokenizer.ggml.mask_token_id", gguf.GGUFValueType.UINT32, None),
    ("shift_logits", "diffusion.shift_logits", gguf.GGUFValueType.BOOL, False),
    ("block_size", "diffusion.block_size", gguf.GGUFValueType.UINT32, 32),
    ("block_aligned", "diffusion.block_aligned", gguf.GGUFValueType.BOOL, True),
    ("threshold", "diffusion.threshold", gguf.GGUFValueType.FLOAT32, 0.95),
    ("moe_block_coreset_top_p", "diffusion.moe_block_coreset_top_p", gguf.GGUFValueType.FLOAT32, 0.9),
    ("presence_penalty", "diffusion.presence_penalty", gguf.GGUFValueType.FLOAT32, 0.9),
    ("frequency_penalty", "diffusion.frequency_penalty", gguf.GGUFValueType.FLOAT32, 0.0),
    ("repetition_penalty", "diffusion.repetition_penalty", gguf.GGUFValueType.FLOAT32, 1.05),
    ("penalty_scope", "diffusion.penalty_scope", gguf.GGUFValueType.STRING, "response"),
    ("think_close_bias_start", "diffusion.think_close_bias_start", gguf.GGUFValueType.UINT32, 4096),
    ("eos_bias_start", "diffusion.eos_bias_start", gguf.GGUFValueType.UINT32, 8192),
    ("bias_slope", "diffusion.bias_slope", gguf.GGUFValueType.FLOAT32, 0.01),
    ("bias_max", "diffusion.bias_max", gguf.GGUFValueType.FLOAT32, 10.0),
]
RECORD_KEYS = {key for _, key, _, _ in RECORD}
CONFIG_FIELDS = ("mask_token_id", "block_size", "threshold", "moe_block_coreset_top_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "think_close_bias_start", "eos_bias_start")


def _f32(x: float) -> float:
    return float(np.float32(x))


def expected_record(given: dict) -> dict:
    """GGUF key -> value: ``given`` (field -> value) over the defaults, f32 fields rounded."""
    out = {}
    for name, key, t, default in RECORD:
        v = given.get(name, default)
        out[key] = _f32(v) if t == gguf.GGUFValueType.FLOAT32 else v
    return out


def record_kv(m: dict) -> dict:
    """The record keys of a KV dict (kv()), f32 values as read."""
    return {k: v for k, v in m.items() if k in RECORD_KEYS}


def record_types(reader: gguf.GGUFReader) -> dict:
    return {k: f.types[0] for k, f in reader.fields.items() if k in RECORD_KEYS}


# ---------------------------------------------------------------------------------------------
# Round trip per outtype
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("outtype", ["f32", "bf16", "f16", "q8_0"])
def test_roundtrip_every_tensor(outtype, ckpts, converted):
    res, reader = converted("clover", outtype)
    ex = expected_tensors(ckpts["clover"])
    got = gguf_tensors(reader)
    assert set(got) == set(ex)
    assert res["tensors"] == [t.name for t in reader.tensors]
    assert res["arch"] == "clover_moe" and res["n_tensors"] == len(ex)
    # file order: token_embd, blocks in order, output_norm, output
    names = res["tensors"]
    assert names[0] == "token_embd.weight" and names[-2:] == ["output_norm.weight", "output.weight"]
    blocks = [int(n.split(".")[1]) for n in names[1:-2]]
    assert blocks == sorted(blocks)

    for name, e in ex.items():
        t = got[name]
        assert _numpy_shape(t) == tuple(e.shape), name
        if _f32_name(name):
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(e.shape), e.numpy(), err_msg=name)
            continue
        ef = e.float().numpy()
        if outtype == "f32":
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(e.shape), ef, err_msg=name)
        elif outtype == "bf16":
            assert t.tensor_type == Q.BF16, name
            bits = np.asarray(t.data).view(np.uint16).reshape(e.shape)
            np.testing.assert_array_equal(bits, e.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                          err_msg=name)
        elif outtype == "f16":
            assert t.tensor_type == Q.F16, name
            d = np.asarray(t.data).view(np.float16).reshape(e.shape)
            np.testing.assert_array_equal(d, e.to(torch.float16).numpy(), err_msg=name)
            assert np.all(np.abs(d.astype(np.float32) - ef) <= np.abs(ef) * 2.0**-11 + 2.0**-24), name
        else:
            assert e.shape[-1] % 32 == 0
            assert t.tensor_type == Q.Q8_0, name
            d = gguf.quants.dequantize(np.asarray(t.data), Q.Q8_0).reshape(e.shape)
            ref = gguf.quants.dequantize(gguf.quants.quantize(ef, Q.Q8_0), Q.Q8_0).reshape(e.shape)
            np.testing.assert_array_equal(d, ref, err_msg=name)
            blocks = np.abs(ef.reshape(-1, 32)).max(axis=1, keepdims=True)
            err = np.abs(d.reshape(-1, 32) - ef.reshape(-1, 32))
            # half a step, plus the f16 rounding of the scale d = max/127 (<= 127 * d * 2^-11)
            assert np.all(err <= blocks / 127 * (0.5 + 127 / 2048) + 1e-7), name


@pytest.mark.parametrize("outtype,ftype", [("f32", 0), ("f16", 1), ("bf16", 32), ("q8_0", 7)])
def test_metadata(outtype, ftype, ckpts, converted):
    res, reader = converted("clover", outtype)
    m = kv(reader)
    cfg = json.loads((ckpts["clover"] / "config.json").read_text())
    assert m["general.architecture"] == "clover_moe" and m["general.type"] == "model"
    assert m["general.file_type"] == ftype == res["file_type"]
    assert m["general.quantization_version"] == 2
    p = "clover_moe."
    hd = cfg["head_dim"]
    want = {
        "block_count": cfg["num_hidden_layers"], "context_length": cfg["max_position_embeddings"],
        "embedding_length": cfg["hidden_size"], "feed_forward_length": cfg["moe_intermediate_size"],
        "attention.head_count": cfg["num_attention_heads"], "attention.head_count_kv": cfg["num_key_value_heads"],
        "attention.key_length": hd, "attention.value_length": hd,
        "rope.dimension_count": int(hd * cfg["rope_parameters"]["partial_rotary_factor"]),
        "rope.dimension_sections": cfg["rope_parameters"]["mrope_section"] + [0],
        "expert_count": cfg["num_experts"], "expert_used_count": cfg["num_experts_per_tok"],
        "expert_feed_forward_length": cfg["moe_intermediate_size"],
        "expert_shared_feed_forward_length": cfg["shared_expert_intermediate_size"],
        "ssm.conv_kernel": cfg["linear_conv_kernel_dim"], "ssm.state_size": cfg["linear_key_head_dim"],
        "ssm.group_count": cfg["linear_num_key_heads"], "ssm.time_step_rank": cfg["linear_num_value_heads"],
        "ssm.inner_size": cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"],
        "full_attention_interval": cfg["full_attention_interval"], "expert_shared_count": 1,
    }
    for k, v in want.items():
        assert m[p + k] == v, k
    assert m[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)
    assert m[p + "rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    assert record_kv(m) == expected_record(cfg)
    assert record_types(reader) == {key: t for _, key, t, _ in RECORD}
    tcfg = json.loads((ckpts["clover"] / "tokenizer_config.json").read_text())
    assert m["tokenizer.chat_template"] == tcfg["chat_template"]
    assert m["tokenizer.ggml.add_bos_token"] is False


# ---------------------------------------------------------------------------------------------
# Layout variants and --arch
# ---------------------------------------------------------------------------------------------

def _assert_same_gguf(ra: gguf.GGUFReader, rb: gguf.GGUFReader, rename=lambda k: k, skip=("general.name",)):
    ka = {rename(k): v for k, v in kv(ra).items() if k not in skip}
    kb = {k: v for k, v in kv(rb).items() if k not in skip}
    assert ka == kb
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    for x, y in zip(ra.tensors, rb.tensors):
        assert x.tensor_type == y.tensor_type and list(x.shape) == list(y.shape), x.name
        assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), x.name


@pytest.mark.parametrize("which", ["nested", "perexpert"])
def test_layouts_give_identical_gguf(which, converted):
    _, ra = converted("clover", "bf16")
    _, rb = converted(which, "bf16")
    _assert_same_gguf(ra, rb)


def _trunk_kv_as_qwen35moe(m: dict) -> dict:
    """A clover_moe trunk's KV pairs as the qwen35moe file of the same trunk has them: prefix
    renamed back, expert_shared_count and the record removed (docs/gguf-layout.md)."""
    out = {}
    for k, v in m.items():
        if k in RECORD_KEYS or k == "clover_moe.expert_shared_count":
            continue
        out["qwen35moe." + k[len("clover_moe."):] if k.startswith("clover_moe.") else k] = v
    out["general.architecture"] = "qwen35moe"
    return out


def test_arch_qwen35moe_drops_exactly_the_block_tensors_and_record(ckpts, converted):
    """--arch qwen35moe on a Clover checkpoint: the complete file less the block tensors (listed
    in dropped) and the record, under the qwen35moe prefix without expert_shared_count; the same
    file as the parent checkpoint gives (same seed: same values)."""
    res_c, rc = converted("clover", "bf16")
    res_p, rp = converted("clover", "bf16", "qwen35moe")
    assert res_p["arch"] == "qwen35moe" and res_p["record"] is None
    kept = [n for n in res_c["tensors"] if not n.endswith(BLOCK_GGUF)]
    assert len(kept) == len(res_c["tensors"]) - 4 * len(GDN_LAYERS)
    assert res_p["tensors"] == kept
    tp = gguf_tensors(rp)
    for t in rc.tensors:
        if t.name in tp:
            assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(tp[t.name].data).view(np.uint8))
    assert _trunk_kv_as_qwen35moe(kv(rc)) == kv(rp)
    assert sorted(res_p["dropped"]) == sorted(f"model.layers.{i}.linear_attn.{s}" for i in GDN_LAYERS
                                              for s in BLOCK_HF)
    res_par, rpar = converted("parent", "bf16")
    assert res_par["arch"] == "qwen35moe"
    _assert_same_gguf(rp, rpar)


# ---------------------------------------------------------------------------------------------
# Split trunk, sidecar and the sidecar alone (docs/gguf-layout.md)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def split(ckpts, tmp_path_factory):
    """convert(split=True) once per (checkpoint, outtype); returns (result, trunk reader, sidecar
    reader)."""
    out = tmp_path_factory.mktemp("split")
    cache = {}

    def get(which="clover", outtype="bf16"):
        if (which, outtype) not in cache:
            res = C.convert(ckpts[which], out / f"{which}-{outtype}.gguf", outtype=outtype, split=True,
                            progress=False)
            assert res["diffusion_path"] == str(out / f"{which}-{outtype}.diffusion.gguf")
            cache[which, outtype] = (res, gguf.GGUFReader(res["path"]), gguf.GGUFReader(res["diffusion_path"]))
        return cache[which, outtype]
    return get


@pytest.mark.parametrize("which,outtype", [("clover", "bf16"), ("clover", "q8_0"), ("nested", "bf16"),
                                           ("nested", "q8_0"), ("clover", "q4_k_m"), ("clover_mtp", "bf16")])
def test_split_trunk_equals_qwen35moe_output(which, outtype, split, converted):
    """The split trunk is our qwen35moe output of the same trunk: every tensor's name, type, shape
    and bytes in the same order, every key's value under the clover_moe. prefix, plus
    clover_moe.expert_shared_count = 1; general.architecture clover_moe, no record, no block
    tensor (the layout of llama.cpp's clover_moe converter)."""
    res, trunk, _ = split(which, outtype)
    _, parent = converted(which, outtype, "qwen35moe")
    m = kv(trunk)
    assert m["general.architecture"] == "clover_moe" and m["clover_moe.expert_shared_count"] == 1
    assert not record_kv(m) and not [t for t in trunk.tensors if t.name.endswith(BLOCK_GGUF)]
    assert _trunk_kv_as_qwen35moe(m) == kv(parent)
    assert [(k[len("clover_moe."):] if k.startswith("clover_moe.") else k) for k in m
            if k != "clover_moe.expert_shared_count"] == \
        [(k[len("qwen35moe."):] if k.startswith("qwen35moe.") else k) for k in kv(parent)]  # same key order
    assert [t.name for t in trunk.tensors] == [t.name for t in parent.tensors] == res["tensors"]
    for x, y in zip(trunk.tensors, parent.tensors):
        assert x.tensor_type == y.tensor_type and list(x.shape) == list(y.shape), x.name
        assert np.array_equal(np.asarray(x.data).view(np.uint8), np.asarray(y.data).view(np.uint8)), x.name


@pytest.mark.parametrize("which", ["clover", "nested"])
def test_complete_file_is_trunk_plus_block_tensors_plus_record(which, split, converted):
    """The complete file = the split trunk with the block tensors after each GDN layer's ssm_out
    and the record's keys added; the sidecar = those block tensors and that record, with
    general.type "diffusion" and clover_moe.block_count, nothing else."""
    _, trunk, side = split(which, "bf16")
    res, complete = converted(which, "bf16")
    names = [t.name for t in complete.tensors]
    want = []
    for t in trunk.tensors:
        want.append(t.name)
        i = t.name.split(".")[1]
        if t.name.endswith("ssm_out.weight"):
            want += [f"blk.{i}.{g}" for g in BLOCK_GGUF]
    assert names == want == res["tensors"]
    mc, mt, ms = kv(complete), kv(trunk), kv(side)
    assert {k: v for k, v in mc.items() if k not in RECORD_KEYS and not k.startswith("GGUF.")} == \
        {k: v for k, v in mt.items() if not k.startswith("GGUF.")}
    assert record_kv(mc) == record_kv(ms) and len(record_kv(mc)) == len(RECORD)
    assert set(ms) == {"general.architecture", "general.type", "clover_moe.block_count"} | RECORD_KEYS
    assert ms["general.architecture"] == "clover_moe" and ms["general.type"] == "diffusion"
    assert ms["clover_moe.block_count"] == 4
    assert record_types(side) == record_types(complete)
    tc = gguf_tensors(complete)
    assert [t.name for t in side.tensors] == [n for n in names if n.endswith(BLOCK_GGUF)]
    for t in side.tensors:
        assert t.tensor_type == tc[t.name].tensor_type == Q.F32 and list(t.shape) == list(tc[t.name].shape)
        assert np.array_equal(np.asarray(t.data), np.asarray(tc[t.name].data)), t.name


def test_sidecar_block_count_excludes_mtp(split):
    """With an MTP block the trunk's block_count is 5, the sidecar's the 4 decoder layers."""
    _, trunk, side = split("clover_mtp", "bf16")
    assert kv(trunk)["clover_moe.block_count"] == 5 and kv(side)["clover_moe.block_count"] == 4


@pytest.mark.parametrize("which", ["clover", "nested", "perexpert"])
def test_diffusion_only_equals_the_split_sidecar(which, ckpts, split, tmp_path):
    """--diffusion-only writes the split's sidecar byte for byte, whatever the outtype."""
    res = C.convert(ckpts[which], tmp_path / "d.gguf", outtype="q4_k_m", diffusion_only=True, progress=False)
    assert res["arch"] == "clover_moe" and res["tensors"] == [f"blk.{i}.{g}" for i in GDN_LAYERS for g in BLOCK_GGUF]
    side = split("clover", "bf16")[0]["diffusion_path"]
    assert (tmp_path / "d.gguf").read_bytes() == pathlib.Path(side).read_bytes()


def _shard_of(ck: pathlib.Path) -> dict:
    return json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]


def _is_block(name: str) -> bool:
    return name.endswith(tuple("linear_attn." + s for s in BLOCK_HF))


def test_diffusion_only_reads_only_the_block_tensors(ckpts, split, tmp_path, monkeypatch):
    """--diffusion-only reads the data of the block tensors only: (1) instrumented reader; (2)
    every other tensor's bytes overwritten with garbage (bf16 NaN) gives the same sidecar; (3)
    the block tensors moved to a shard of their own, every other shard deleted: still the same
    sidecar (a partial download serves), while a full conversion names the missing shard."""
    want = pathlib.Path(split("clover", "bf16")[0]["diffusion_path"]).read_bytes()
    read = []
    orig = C.SourceTensor.read_rows
    monkeypatch.setattr(C.SourceTensor, "read_rows", lambda self, r0, r1: read.append(self.name) or orig(self, r0, r1))
    C.convert(ckpts["clover"], tmp_path / "a.gguf", diffusion_only=True, progress=False)
    assert sorted(read) == sorted(n for n in _shard_of(ckpts["clover"]) if _is_block(n))
    assert (tmp_path / "a.gguf").read_bytes() == want
    monkeypatch.undo()

    ck = _copy_ckpt(ckpts["clover"], tmp_path / "garbage")
    for shard in sorted(set(_shard_of(ck).values())):
        for name, t in C.read_safetensors_header(ck / shard).items():
            if not _is_block(name):
                with open(ck / shard, "r+b") as f:
                    f.seek(t.offset)
                    f.write(b"\xff" * (math.prod(t.shape) * t.np_dtype.itemsize))
    C.convert(ck, tmp_path / "b.gguf", diffusion_only=True, progress=False)
    assert (tmp_path / "b.gguf").read_bytes() == want

    ck = _copy_ckpt(ckpts["clover"], tmp_path / "partial")
    hf = load_hf(ck)
    save_file({n: t for n, t in hf.items() if _is_block(n)}, str(ck / "blocks.safetensors"), metadata={"format": "pt"})
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {n: ("blocks.safetensors" if _is_block(n) else s) for n, s in idx["weight_map"].items()}
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    for shard in ck.glob("model-*.safetensors"):
        shard.unlink()
    C.convert(ck, tmp_path / "c.gguf", diffusion_only=True, progress=False)
    assert (tmp_path / "c.gguf").read_bytes() == want
    with pytest.raises(C.MissingShardError, match=r"model-00001-of-0000\d\.safetensors"):
        C.convert(ck, tmp_path / "x.gguf", progress=False)


def _convert_cli_without_torch(*argvs):
    """Run ``clover-gguf convert`` once per argument list (``clover_gguf.cli.main(['convert', *argv])``)
    in a fresh Python that must not import torch; returns the CompletedProcess."""
    calls = " or ".join(f"main(['convert', *{list(map(str, a))!r}])" for a in argvs)
    code = (f"import sys; from clover_gguf.cli import main; rc = {calls}; "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_cli_split_and_diffusion_only_without_torch(ckpts, split, tmp_path):
    """`clover-gguf convert --split` and `--diffusion-only` through the CLI, without torch: the same
    files as the Python API."""
    p = _convert_cli_without_torch([ckpts["clover"], "-o", tmp_path / "s.gguf", "--split", "--no-progress"],
                                   [ckpts["clover"], "-o", tmp_path / "d.gguf", "--diffusion-only", "--no-progress"])
    assert p.returncode == 0, p.stderr
    assert "s.diffusion.gguf: diffusion sidecar" in p.stdout
    res, _, _ = split("clover", "bf16")
    assert (tmp_path / "s.gguf").stat().st_size == pathlib.Path(res["path"]).stat().st_size
    assert (tmp_path / "s.diffusion.gguf").read_bytes() == pathlib.Path(res["diffusion_path"]).read_bytes()
    assert (tmp_path / "d.gguf").read_bytes() == pathlib.Path(res["diffusion_path"]).read_bytes()


def test_split_failure_leaves_no_output(ckpts, tmp_path, monkeypatch):
    """A failure while writing the sidecar (the last file) leaves neither file nor any .part."""
    orig = C._write_tensor

    def fail_on_block(fout, t, pool, bar):
        if t.block:
            raise OSError("disk full (test)")
        return orig(fout, t, pool, bar)
    monkeypatch.setattr(C, "_write_tensor", fail_on_block)
    with pytest.raises(OSError, match="disk full"):
        C.convert(ckpts["clover"], tmp_path / "s.gguf", split=True, progress=False)
    assert not list(tmp_path.iterdir())


def test_engine_runs_the_complete_file_and_the_split_alike(make_gguf, tmp_path):
    """The engine (clover_gguf.Model) on the complete file, the trunk with its sidecar found
    beside it, and the trunk given the sidecar explicitly: the same greedy tokens in ar,
    diffusion and spec, spec == ar; the trunk alone runs ar and refuses diffusion, naming the
    command that makes the sidecar."""
    import clover_gguf
    complete, trunk = make_gguf("f32"), make_gguf("f32", split=True)
    assert C.sidecar_path(trunk).is_file()
    lone = tmp_path / "lone.gguf"
    shutil.copy(trunk, lone)
    outs = {}
    for name, path, kw in (("complete", complete, {}), ("beside", trunk, {}),
                           ("explicit", lone, {"diffusion_path": str(C.sidecar_path(trunk))})):
        with clover_gguf.Model(str(path), n_ctx=128, n_threads=2, **kw) as m:
            ids = m.tokenize("def parse_args(argv=None):")
            outs[name] = {mode: m.generate_tokens(ids, max_tokens=8, mode=mode)[0]
                          for mode in ("ar", "diffusion", "spec")}
    assert outs["complete"] == outs["beside"] == outs["explicit"]
    assert outs["complete"]["spec"] == outs["complete"]["ar"]
    with clover_gguf.Model(str(lone), n_ctx=128, n_threads=2) as m:
        assert m.generate_tokens(ids, max_tokens=8, mode="ar")[0] == outs["complete"]["ar"]
        with pytest.raises(Exception, match="--diffusion-only"):
            m.generate_tokens(ids, max_tokens=8, mode="diffusion")


# ---------------------------------------------------------------------------------------------
# Refusals: each names what it refuses, before anything is written
# ---------------------------------------------------------------------------------------------

def _refused(ck, tmp_path, pattern, **kw):
    out = tmp_path / "out"
    with pytest.raises(C.ConvertError, match=pattern):
        C.convert(ck, out / "x.gguf", progress=False, **kw)
    assert not out.exists()


def _edit_config(ck: pathlib.Path, **changes) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (ck / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("drop,missing", [
    (["model.layers.1.linear_attn.bd_softmax_history_c"], ["model.layers.1.linear_attn.bd_softmax_history_c"]),
    ([f"model.layers.2.linear_attn.{s}" for s in BLOCK_HF], [f"model.layers.2.linear_attn.{s}" for s in BLOCK_HF]),
    ([f"model.layers.{i}.linear_attn.conv_right_weight" for i in (0, 1)],
     [f"model.layers.{i}.linear_attn.conv_right_weight" for i in (0, 1)]),
])
@pytest.mark.parametrize("mode", ["complete", "split", "diffusion_only", "qwen35moe"])
def test_partial_block_tensors_refused(drop, missing, mode, ckpts, tmp_path):
    """Some but not all of the four block tensors (within a layer, a whole layer, one kind across
    layers): refused in every mode, naming each missing tensor and its GGUF name."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    for n in drop:
        _drop_tensor(ck, n)
    kw = {"complete": {}, "split": {"split": True}, "diffusion_only": {"diffusion_only": True},
          "qwen35moe": {"arch": "qwen35moe"}}[mode]
    with pytest.raises(C.ConvertError, match="Clover block tensors incomplete") as ei:
        C.convert(ck, tmp_path / "out" / "x.gguf", progress=False, **kw)
    for n in missing:
        i, s = n.split(".")[2], n.split(".")[-1]
        assert f"{n} (blk.{i}.{dict(zip(BLOCK_HF, BLOCK_GGUF))[s]})" in str(ei.value)
    assert str(ei.value).count("model.layers.") == len(missing)
    assert not (tmp_path / "out").exists()


def test_block_tensor_misplaced_or_misshapen_refused(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "a")
    _add_tensor(ck, "model.layers.3.linear_attn.bd_softmax_logit_scale", torch.randn(4))
    for kw in ({}, {"diffusion_only": True}):
        _refused(ck, tmp_path, r"model\.layers\.3\.linear_attn\.bd_softmax_logit_scale: layer 3 is a "
                               r"full_attention layer", **kw)
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "b")
    _drop_tensor(ck, "model.layers.0.linear_attn.conv_right_weight")
    _add_tensor(ck, "model.layers.0.linear_attn.conv_right_weight", torch.randn(512, 1, 4))
    for kw in ({}, {"diffusion_only": True}):
        _refused(ck, tmp_path, r"model\.layers\.0\.linear_attn\.conv_right_weight: shape \[512, 1, 4\] "
                               r"expected \[512, 1, 3\]", **kw)


def test_arch_clover_moe_on_parent_refused(ckpts, tmp_path):
    _refused(ckpts["parent"], tmp_path, r"--arch clover_moe: the checkpoint is a parent, with none of Clover's "
                                        r"block tensors \(model\.layers\.N\.linear_attn\.conv_right_weight",
             arch="clover_moe")
    _refused(ckpts["parent"], tmp_path, r"--split: a qwen35moe output", split=True)
    _refused(ckpts["parent"], tmp_path, r"no Clover block tensors .*not a Clover checkpoint", diffusion_only=True)
    _refused(ckpts["parent"], tmp_path, r"--block-size: a qwen35moe output .* no decoding record",
             record={"block_size": 16})
    _refused(ckpts["clover"], tmp_path, r"--diffusion-only: a qwen35moe output", arch="qwen35moe",
             diffusion_only=True)
    _refused(ckpts["clover"], tmp_path, r"--threshold: a qwen35moe output", arch="qwen35moe",
             record={"threshold": 0.5})
    _refused(ckpts["clover"], tmp_path, r"arch 'clover': expected one of clover_moe, qwen35moe", arch="clover")


def test_clover_architecture_without_block_tensors_refused(ckpts, tmp_path):
    """config.json says CloverMoeModelLM but no GDN layer has a block tensor: refused, naming the
    tensors; --arch qwen35moe converts the trunk alone."""
    ck = _copy_ckpt(ckpts["parent"], tmp_path / "ck")
    _edit_config(ck, architectures=["CloverMoeModelLM"])
    _refused(ck, tmp_path, r"CloverMoeModelLM.*no GDN layer has Clover's block tensors "
                           r"\(model\.layers\.N\.linear_attn\.conv_right_weight.*--arch qwen35moe")
    assert C.convert(ck, tmp_path / "p.gguf", arch="qwen35moe", progress=False)["arch"] == "qwen35moe"


@pytest.mark.parametrize("value", [2, 0, True, "1"])
@pytest.mark.parametrize("mode", ["complete", "diffusion_only"])
def test_num_shared_experts_refused(value, mode, ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _edit_config(ck, num_shared_experts=value)
    _refused(ck, tmp_path, rf"config\.json: num_shared_experts {re.escape(repr(value))}: expected 1",
             **({"diffusion_only": True} if mode == "diffusion_only" else {}))


def _nested_with(ckpts, tmp_path, key, value):
    """A copy of the nested-config checkpoint whose config.json has ``key`` under text_config only."""
    ck = _copy_ckpt(ckpts["nested"], tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg.pop(key)
    cfg["text_config"][key] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def test_num_shared_experts_read_from_text_config(ckpts, tmp_path):
    _refused(_nested_with(ckpts, tmp_path, "num_shared_experts", 3), tmp_path, r"num_shared_experts 3: expected 1")


# ---------------------------------------------------------------------------------------------
# Errors before writing
# ---------------------------------------------------------------------------------------------

def test_missing_shard(ckpts, tmp_path, capsys):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    shards = sorted(ck.glob("model-*.safetensors"))
    assert len(shards) >= 2
    shards[1].unlink()
    out = tmp_path / "out" / "m.gguf"
    with pytest.raises(C.MissingShardError, match=shards[1].name):
        C.convert(ck, out, progress=False)
    assert not out.exists() and not out.with_name(out.name + ".part").exists()
    with pytest.raises(SystemExit) as ei:
        C.main([str(ck), "-o", str(out), "--no-progress"])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and shards[1].name in err[0]
    assert not out.exists()


@pytest.mark.parametrize("mode", [{}, {"split": True}, {"arch": "qwen35moe"}])
def test_unknown_tensor(mode, ckpts, tmp_path):
    """Unknown tensors are refused, each named (a misspelt block tensor among them)."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _add_tensor(ck, "model.layers.2.linear_attn.mystery.weight", torch.randn(4, 4))
    _add_tensor(ck, "model.layers.1.linear_attn.conv_right_weights", torch.randn(4, 4))
    _add_tensor(ck, "model.extra_norm.weight", torch.randn(4))
    with pytest.raises(C.ConvertError, match=r"unrecognised tensors ") as ei:
        C.convert(ck, tmp_path / "out" / "m.gguf", progress=False, **mode)
    for n in ("model.layers.2.linear_attn.mystery.weight", "model.layers.1.linear_attn.conv_right_weights",
              "model.extra_norm.weight"):
        assert n in str(ei.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------
# Decoding record (spec 3.4, docs/gguf-layout.md)
# ---------------------------------------------------------------------------------------------

def _record_of(path) -> dict:
    return record_kv(kv(gguf.GGUFReader(path)))


def _defaulted_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("decoding record: default for ")]
    assert len(lines) == 1, err
    return lines[0]


def test_record_from_config_then_generation_config(ckpts, tmp_path, capsys):
    """config.json gives a field first, generation_config.json where config.json does not; the
    fields nothing gives take the default, and one stderr line names exactly those."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    _edit_config(ck, presence_penalty=None, eos_bias_start=None, threshold=0.8)
    (ck / "generation_config.json").write_text(json.dumps(
        {"presence_penalty": 0.5, "threshold": 0.6, "frequency_penalty": None, "do_sample": False}))
    capsys.readouterr()
    res = C.convert(ck, tmp_path / "m.gguf", progress=False)
    given = {k: cfg[k] for k in CONFIG_FIELDS}
    given.update(presence_penalty=0.5, threshold=0.8)
    del given["eos_bias_start"]
    assert _record_of(res["path"]) == expected_record(given)
    src = res["record_sources"]
    assert src["presence_penalty"] == "generation_config.json" and src["threshold"] == "config.json"
    assert src["eos_bias_start"] == "default" and src["shift_logits"] == "default"
    line = _defaulted_line(capsys.readouterr().err)
    assert line == ("decoding record: default for shift_logits false, block_aligned true, penalty_scope response, "
                    "eos_bias_start 8192, bias_slope 0.01, bias_max 10 (docs/gguf-layout.md)")


def test_record_under_text_config(ckpts, tmp_path):
    """Record fields nested under text_config are read when the top level lacks them."""
    res = C.convert(_nested_with(ckpts, tmp_path, "block_size", 8), tmp_path / "m.gguf", diffusion_only=True,
                    progress=False)
    assert res["record"]["block_size"] == 8 and res["record_sources"]["block_size"] == "config.json text_config"


OPTIONS = {"mask_token_id": 7, "shift_logits": True, "block_size": 16, "block_aligned": False, "threshold": 0.5,
           "moe_block_coreset_top_p": 0.75, "presence_penalty": 0.25, "frequency_penalty": 0.125,
           "repetition_penalty": 1.5, "penalty_scope": "all", "think_close_bias_start": 100, "eos_bias_start": 200,
           "bias_slope": 0.5, "bias_max": 3.0}


@pytest.mark.parametrize("mode", ["complete", "split", "diffusion_only"])
def test_record_options_win(mode, ckpts, tmp_path, capsys):
    """Every one of the 14 fields as a Python option wins over config.json and
    generation_config.json, in every output; no field is then defaulted (no line)."""
    assert set(OPTIONS) == {f for f, _, _, _ in RECORD}
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    (ck / "generation_config.json").write_text(json.dumps({"threshold": 0.9, "repetition_penalty": 1.2}))
    capsys.readouterr()
    kw = {"split": {"split": True}, "diffusion_only": {"diffusion_only": True}}.get(mode, {})
    res = C.convert(ck, tmp_path / "m.gguf", record=dict(OPTIONS), progress=False, **kw)
    assert set(res["record_sources"].values()) == {"option"} and res["record"] == OPTIONS
    path = res["diffusion_path"] or res["path"]
    assert _record_of(path) == expected_record(OPTIONS)
    assert "decoding record: default" not in capsys.readouterr().err


def test_record_cli_options(ckpts, tmp_path):
    """The 14 command-line options (--name-with-dashes; bools as true/false) give the same record
    as the Python options, without torch; a bad value is an argparse error (status 2)."""
    args = []
    for name, v in OPTIONS.items():
        args += [f"--{name.replace('_', '-')}", str(v).lower() if isinstance(v, bool) else str(v)]
    p = _convert_cli_without_torch([ckpts["clover"], "-o", tmp_path / "d.gguf", "--diffusion-only", "--no-progress",
                                    *args])
    assert p.returncode == 0, p.stderr
    assert _record_of(tmp_path / "d.gguf") == expected_record(OPTIONS)
    for bad in (["--shift-logits", "yes"], ["--penalty-scope", "prompt"], ["--block-size", "1.5"]):
        p = subprocess.run([sys.executable, "-m", "clover_gguf.convert.convert", str(ckpts["clover"]), "-o",
                            str(tmp_path / "x.gguf"), "--diffusion-only", *bad], cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2 and bad[0] in p.stderr, p.stderr
        assert not (tmp_path / "x.gguf").exists()


@pytest.mark.parametrize("field,value,where", [
    ("block_size", 0, "option"), ("block_size", 65537, "option"), ("block_size", 2.5, "option"),
    ("threshold", 0.0, "option"), ("threshold", 1.5, "config.json"), ("threshold", "high", "config.json"),
    ("moe_block_coreset_top_p", 0.0, "generation_config.json"), ("moe_block_coreset_top_p", 1.01, "option"),
    ("repetition_penalty", 0.0, "config.json"), ("repetition_penalty", -1.0, "option"),
    ("presence_penalty", float("inf"), "option"), ("frequency_penalty", float("nan"), "option"),
    ("think_close_bias_start", -1, "config.json"), ("eos_bias_start", 2**31, "option"),
    ("bias_slope", -0.1, "option"), ("bias_max", -1.0, "option"), ("shift_logits", 1, "option"),
    ("block_aligned", "true", "option"), ("penalty_scope", "prompt", "option"),
    ("mask_token_id", 2048, "option"), ("mask_token_id", 5000, "config.json"), ("mask_token_id", -1, "option"),
    ("mask_token_id", True, "config.json"),
])
def test_bad_record_value_refused(field, value, where, ckpts, tmp_path):
    """Every record value is checked (types, ranges, the mask id below vocab_size 2048); the error
    names the field, the value and where it came from, before anything is written."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    kw = {}
    if where == "option":
        kw["record"] = {field: value}
    elif where == "config.json":
        _edit_config(ck, **{field: value})
    else:
        _edit_config(ck, **{field: None})
        (ck / "generation_config.json").write_text(json.dumps({field: value}))
    src = f"option --{field.replace('_', '-')}" if where == "option" else where
    for mode in ({}, {"diffusion_only": True}):
        _refused(ck, tmp_path, rf"^{field} {re.escape(repr(value))} \({re.escape(src)}\): ", **kw, **mode)


def test_unknown_record_option_refused(ckpts, tmp_path):
    _refused(ckpts["clover"], tmp_path, r"record option 'logit_shift': expected one of mask_token_id, ",
             record={"logit_shift": True})


# ---------------------------------------------------------------------------------------------
# Mask token (spec 3.1): option, else the config, else tokenizer.json's one added "mask" token
# ---------------------------------------------------------------------------------------------

def _rename_added_token(ck: pathlib.Path, old: str, new: str) -> None:
    tj = json.loads((ck / "tokenizer.json").read_text(encoding="utf-8"))
    for t in tj["added_tokens"]:
        if t["content"] == old:
            t["content"] = new
    (ck / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")


def test_mask_token_from_each_source(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    mask = json.loads((ck / "config.json").read_text())["mask_token_id"]
    tok = json.loads((ck / "tokenizer.json").read_text(encoding="utf-8"))
    assert [t["id"] for t in tok["added_tokens"] if t["content"] == "<|mask|>"] == [mask]

    def conv(**kw):
        return C.convert(ck, tmp_path / "m.gguf", diffusion_only=True, progress=False, **kw)

    r = conv()  # config.json
    assert (r["record"]["mask_token_id"], r["record_sources"]["mask_token_id"]) == (mask, "config.json")
    r = conv(record={"mask_token_id": 3})  # the option wins over the config
    assert (r["record"]["mask_token_id"], r["record_sources"]["mask_token_id"]) == (3, "option")
    _edit_config(ck, mask_token_id=None)
    r = conv()  # tokenizer.json's one added token containing "mask"
    assert (r["record"]["mask_token_id"], r["record_sources"]["mask_token_id"]) == (mask, "tokenizer.json")
    assert _record_of(r["path"])["tokenizer.ggml.mask_token_id"] == mask
    (ck / "generation_config.json").write_text(json.dumps({"mask_token_id": 5}))
    r = conv()  # generation_config.json is a config too, before the tokenizer
    assert (r["record"]["mask_token_id"], r["record_sources"]["mask_token_id"]) == (5, "generation_config.json")
    (ck / "generation_config.json").unlink()
    r = C.convert(ck, tmp_path / "c.gguf", progress=False)  # the complete file, with its vocabulary
    assert kv(gguf.GGUFReader(r["path"]))["tokenizer.ggml.tokens"][r["record"]["mask_token_id"]] == "<|mask|>"


def test_mask_token_missing_refused(ckpts, tmp_path):
    """No option, no config key and no (or two) added tokens containing "mask": the error names all
    three sources and what tokenizer.json holds."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _edit_config(ck, mask_token_id=None)
    _rename_added_token(ck, "<|mask|>", "<|blank|>")
    three = (r"mask_token_id: none of the --mask-token-id option; mask_token_id in config\.json / "
             r"generation_config\.json; one added token of tokenizer\.json whose content contains 'mask' gives it")
    for mode in ({}, {"split": True}, {"diffusion_only": True}):
        _refused(ck, tmp_path, three + r" \(tokenizer\.json has no added token containing 'mask'\)", **mode)
    _rename_added_token(ck, "<think>", "<mask_a>")
    _rename_added_token(ck, "<|blank|>", "<|MASK|>")
    _refused(ck, tmp_path, three + r" \(tokenizer\.json has 2 added tokens containing 'mask' "
                                   r"\(\['<mask_a>', '<\|MASK\|>'\]\)\)")
    r = C.convert(ck, tmp_path / "ok.gguf", record={"mask_token_id": 9}, diffusion_only=True, progress=False)
    assert r["record"]["mask_token_id"] == 9
    (ck / "tokenizer.json").unlink()
    _refused(ck, tmp_path, three + r" \(no tokenizer\.json\)", diffusion_only=True)


def test_misplaced_and_misshapen_tensor(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _add_tensor(ck, "model.layers.3.linear_attn.A_log", torch.randn(4))  # layer 3 is full attention
    with pytest.raises(C.ConvertError, match=r"model\.layers\.3\.linear_attn\.A_log: layer 3 is a full_attention"):
        C.convert(ck, tmp_path / "m.gguf", progress=False)
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck2")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["linear_num_value_heads"] = 8  # every GDN tensor now has the wrong shape
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ConvertError, match=r"shape \[\d+(, \d+)*\] expected"):
        C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_visual_dropped(ckpts, converted, tmp_path):
    """The vision tower (``model.visual.*`` and ``visual.*``) is dropped; nothing else changes
    (nested-prefix checkpoint, as Qwen3_5MoeForConditionalGeneration saves it)."""
    ck = _copy_ckpt(ckpts["nested"], tmp_path / "ck")
    _add_tensor(ck, "model.visual.patch_embed.proj.weight", torch.randn(4, 4))
    _add_tensor(ck, "visual.blocks.0.attn.qkv.weight", torch.randn(4, 4))
    res = C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert sorted(res["dropped"]) == ["model.visual.patch_embed.proj.weight", "visual.blocks.0.attn.qkv.weight"]
    _assert_same_gguf(gguf.GGUFReader(res["path"]), converted("clover", "bf16")[1])


def test_unknown_architecture(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["parent"], tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["architectures"] = ["Qwen3NextForCausalLM"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ConvertError, match=r"architectures \['Qwen3NextForCausalLM'\] not supported"):
        C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


def test_stray_shard_ignored_with_warning(ckpts, converted, tmp_path):
    """A ``*.safetensors`` file that model.safetensors.index.json does not list is ignored with a
    ConvertWarning naming it, never merged: transformers' from_pretrained loads only the index's
    shards and llama.cpp's convert_hf_to_gguf.py reads only the index's weight_map files, both
    silently. Here the stray file holds a different copy of a real tensor and an unknown tensor;
    the output is byte-identical to the clean checkpoint's. Without an index, files next to
    model.safetensors are ignored the same way."""
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    stray = "model-00099-of-00099.safetensors"
    save_file({"model.layers.0.input_layernorm.weight": torch.full((256,), 5.0, dtype=torch.bfloat16),
               "model.layers.0.mystery.weight": torch.zeros(4, 4)}, str(ck / stray), metadata={"format": "pt"})
    with pytest.warns(C.ConvertWarning, match=stray):
        res = C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert res["ignored"] == [stray]
    _assert_same_gguf(gguf.GGUFReader(res["path"]), converted("clover", "bf16")[1])

    # no index: model.safetensors is the checkpoint; another *.safetensors next to it is ignored
    one = tmp_path / "one"
    one.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ck / f, one / f)
    save_file(load_hf(ckpts["clover"]), str(one / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(ck / stray, one / "extra.safetensors")
    with pytest.warns(C.ConvertWarning, match="extra.safetensors"):
        res = C.convert(one, tmp_path / "one.gguf", progress=False)
    assert res["ignored"] == ["extra.safetensors"]
    _assert_same_gguf(gguf.GGUFReader(res["path"]), converted("clover", "bf16")[1])


def test_bf16_beyond_f16_range(ckpts, tmp_path):
    """BF16 values beyond the f16 range (1e5, -3e38) stay exact in bf16 (same bits) and f32 (exact
    widening) outputs. f16 output writes them as +inf / -inf, which is what llama.cpp's converter
    does (bf16 -> f32 -> numpy float16 cast; checked against it when its source is present), with a
    ConvertWarning naming the tensor; every other value is the round-to-nearest-even cast."""
    ck = _copy_ckpt(ckpts["parent"], tmp_path / "ck")
    name = "model.layers.1.mlp.shared_expert.up_proj.weight"
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = ck / idx["weight_map"][name]
    d = load_file(str(shard))
    w = d[name].clone()
    w[0, 0], w[0, 1], w[5, 7] = 1e5, -3e38, 6e4  # 6e4 is inside the f16 range
    d[name] = w
    save_file(d, str(shard), metadata={"format": "pt"})
    gname = "blk.1.ffn_up_shexp.weight"
    bits = w.view(torch.int16).numpy().view(np.uint16)
    outs = {}
    for outtype in ("bf16", "f32", "f16"):
        if outtype == "f16":
            with pytest.warns(C.ConvertWarning, match=rf"{gname}: 2 values beyond the f16 range"):
                res = C.convert(ck, tmp_path / f"{outtype}.gguf", outtype=outtype, progress=False)
        else:
            res = C.convert(ck, tmp_path / f"{outtype}.gguf", outtype=outtype, progress=False)
        outs[outtype] = gguf_tensors(gguf.GGUFReader(res["path"]))[gname]
    np.testing.assert_array_equal(np.asarray(outs["bf16"].data).view(np.uint16).reshape(w.shape), bits)
    f32 = np.asarray(outs["f32"].data).reshape(w.shape)
    np.testing.assert_array_equal(f32, w.float().numpy())
    assert f32[0, 0] == w[0, 0].item() and f32[0, 1] == w[0, 1].item() < -1e38
    f16 = np.asarray(outs["f16"].data).view(np.float16).reshape(w.shape)
    assert f16[0, 0] == np.inf and f16[0, 1] == -np.inf and np.isfinite(f16[5, 7])
    np.testing.assert_array_equal(f16, w.to(torch.float16).numpy())  # torch saturates to inf too
    assert np.isfinite(f16).sum() == f16.size - 2
    if _HAVE_LLAMA_CPP:
        ll = _llama_convert(ck, tmp_path / "ll-f16.gguf", "f16", no_mtp=True)
        x = gguf_tensors(ll)[gname]
        assert x.tensor_type == Q.F16
        assert np.array_equal(np.asarray(x.data).view(np.uint8).reshape(-1),
                              np.asarray(outs["f16"].data).view(np.uint8).reshape(-1))


# ---------------------------------------------------------------------------------------------
# MTP (multi-token prediction) kept as llama.cpp keeps it
# ---------------------------------------------------------------------------------------------

MTP_NEXTN = ("nextn.eh_proj.weight", "nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


@pytest.mark.parametrize("which,outtype", [("mtp", "f32"), ("mtp", "bf16"), ("clover_mtp", "bf16")])
def test_mtp_kept(which, outtype, ckpts, converted):
    """mtp.layers.0 becomes blk.4 (num_hidden_layers + 0), a full-attention MoE block with the
    trunk's names and transforms; mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm become
    blk.4.nextn.eh_proj / enorm / hnorm / shared_head_norm (norms +1, F32). block_count 5,
    nextn_predict_layers 1, attention.recurrent_layers false for the MTP block; the same for
    Clover under the clover_moe. prefix. Every value equals the spec 4.3 reference."""
    res, reader = converted(which, outtype)
    clover = which.startswith("clover")
    arch = "clover_moe" if clover else "qwen35moe"
    ex = expected_tensors(ckpts[which], clover=clover)
    got = gguf_tensors(reader)
    assert res["arch"] == arch and res["n_mtp"] == 1
    assert set(got) == set(ex)
    blk4 = sorted(n[len("blk.4."):] for n in ex if n.startswith("blk.4."))
    assert blk4 == sorted(["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight",
                           "attn_output.weight", "attn_q_norm.weight", "attn_k_norm.weight",
                           "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_exps.weight",
                           "ffn_up_exps.weight", "ffn_down_exps.weight", "ffn_gate_inp_shexp.weight",
                           "ffn_gate_shexp.weight", "ffn_up_shexp.weight", "ffn_down_shexp.weight", *MTP_NEXTN])
    H = 256
    assert _numpy_shape(got["blk.4.nextn.eh_proj.weight"]) == (H, 2 * H)
    names = res["tensors"]
    assert names[-2:] == ["output_norm.weight", "output.weight"]
    assert [int(n.split(".")[1]) for n in names[1:-2]] == sorted(int(n.split(".")[1]) for n in names[1:-2])
    for name, e in ex.items():
        t = got[name]
        assert _numpy_shape(t) == tuple(e.shape), name
        if _f32_name(name) or outtype == "f32":
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(e.shape), e.float().numpy(), err_msg=name)
        else:
            assert t.tensor_type == Q.BF16, name
            np.testing.assert_array_equal(np.asarray(t.data).view(np.uint16).reshape(e.shape),
                                          e.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                                          err_msg=name)
    m = kv(reader)
    assert m[f"{arch}.block_count"] == 5
    assert m[f"{arch}.nextn_predict_layers"] == 1
    assert m[f"{arch}.attention.recurrent_layers"] == [True, True, True, False, False]
    f = reader.fields[f"{arch}.attention.recurrent_layers"]
    assert f.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
    # the layout the other tools derive from hyperparameters alone (convert.quant_plan.tensor_shapes)
    from clover_gguf.convert import quant_plan as QP
    hp = C.read_hparams(json.loads((ckpts[which] / "config.json").read_text()))
    hp.n_mtp = 1
    assert [(n, tuple(s)) for n, s in QP.tensor_shapes(hp, arch)] == [(t.name, _numpy_shape(t)) for t in reader.tensors]


def test_mtp_quant_plan():
    """The type plan counts MTP blocks in llama.cpp's n_layer_all (block_count): with 4 trunk layers
    and one MTP block, Q4_K_M puts Q6_K on ffn_down of layers 2 and 4 (use_more_bits(i, 5)), not 2
    and 3 (use_more_bits(i, 4)); nextn.eh_proj takes the default type, the nextn norms stay F32.
    (test_mtp_quantized_matches_llama_quantize checks the whole file against llama-quantize.)"""
    from clover_gguf.convert import quant_plan as QP
    from reference.checkpoint import text_config
    hp = C.read_hparams(text_config("tiny"))
    plain = QP.plan_types("qwen35moe", hp, dict(QP.tensor_shapes(hp)), "q4_k_m")
    hp.n_mtp = 1
    shapes = dict(QP.tensor_shapes(hp))
    plan = QP.plan_types("qwen35moe", hp, shapes, "q4_k_m")
    assert [plain[f"blk.{i}.ffn_down_exps.weight"] for i in range(4)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K]
    assert [plan[f"blk.{i}.ffn_down_exps.weight"] for i in range(5)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q6_K]
    assert plan["blk.4.nextn.eh_proj.weight"] == Q.Q4_K and shapes["blk.4.nextn.eh_proj.weight"] == (256, 512)
    assert all(plan[f"blk.4.{n}"] == Q.F32 for n in MTP_NEXTN[1:])
    assert plan["blk.4.attn_v.weight"] == Q.Q8_0  # 8 experts: attn_v-like -> Q8_0, MTP block included
    assert QP.plan_types("qwen35moe", {"block_count": 5, "E": 8, "nh": 4, "nkv": 2}, shapes, "q4_k_m") == plan


def test_mtp_layouts_give_identical_gguf(ckpts, converted, tmp_path):
    """MTP with the nested prefix (mtp.* stays top level) and per-expert tensors, and MTP under
    ``model.mtp.``: the same file."""
    _, ref = converted("mtp", "bf16")
    _, other = converted("mtp_nested_perexpert", "bf16")
    _assert_same_gguf(ref, other)
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "ck")
    idx_path = ck / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for shard in sorted(set(idx["weight_map"].values())):
        d = load_file(str(ck / shard))
        if any(k.startswith("mtp.") for k in d):
            d = {("model." + k if k.startswith("mtp.") else k): v for k, v in d.items()}
            save_file(d, str(ck / shard), metadata={"format": "pt"})
    idx["weight_map"] = {("model." + k if k.startswith("mtp.") else k): v for k, v in idx["weight_map"].items()}
    idx_path.write_text(json.dumps(idx))
    res = C.convert(ck, tmp_path / "m.gguf", progress=False)
    _assert_same_gguf(gguf.GGUFReader(res["path"]), ref)


def test_no_mtp_drops_mtp(ckpts, converted, tmp_path):
    """--no-mtp (no_mtp=True): every mtp.* tensor dropped, no nextn key, block_count 4: the same
    file as the checkpoint without MTP (same seed), also through the CLI."""
    res = C.convert(ckpts["mtp"], tmp_path / "m.gguf", progress=False, no_mtp=True)
    assert res["n_mtp"] == 0
    mtp_names = sorted(json.loads((ckpts["mtp"] / "model.safetensors.index.json").read_text())["weight_map"])
    mtp_names = [n for n in mtp_names if n.startswith("mtp.")]
    assert len(mtp_names) == 4 + 15 and sorted(res["dropped"]) == mtp_names  # fc + 3 norms, one layer
    _assert_same_gguf(gguf.GGUFReader(res["path"]), converted("parent", "bf16")[1])
    C.main([str(ckpts["mtp"]), "-o", str(tmp_path / "cli.gguf"), "--no-mtp", "--no-progress"])
    _assert_same_gguf(gguf.GGUFReader(tmp_path / "cli.gguf"), converted("parent", "bf16")[1])


def _drop_tensor(ck: pathlib.Path, name: str) -> None:
    idx_path = ck / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    shard = idx["weight_map"].pop(name)
    d = load_file(str(ck / shard))
    del d[name]
    save_file(d, str(ck / shard), metadata={"format": "pt"})
    idx_path.write_text(json.dumps(idx))


def test_mtp_errors(ckpts, tmp_path):
    """Errors name the tensor or key, before any output: MTP tensors in the wrong place, a tensor
    the MTP block does not have, a missing one, and config.json's mtp_num_hidden_layers against
    the tensors (--no-mtp converts without MTP)."""
    def fails(ck, pattern):
        with pytest.raises(C.ConvertError, match=pattern):
            C.convert(ck, tmp_path / "x.gguf", progress=False)
        assert not list(tmp_path.glob("x.gguf*"))

    # the MTP layer is a full-attention layer
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "a")
    _add_tensor(ck, "mtp.layers.0.linear_attn.A_log", torch.randn(4))
    fails(ck, r"mtp\.layers\.0\.linear_attn\.A_log: MTP layer 0 is a full_attention layer")
    # not part of a Qwen3.5 MTP block (no dedicated embeddings / head)
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "b")
    _add_tensor(ck, "mtp.embed_tokens.weight", torch.randn(2048, 256))
    fails(ck, r"unrecognised tensor mtp\.embed_tokens\.weight")
    # missing pieces
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "c")
    _drop_tensor(ck, "mtp.fc.weight")
    fails(ck, r"missing tensor mtp\.fc\.weight \(blk\.4\.nextn\.eh_proj\.weight\)")
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "d")
    _drop_tensor(ck, "mtp.layers.0.self_attn.k_norm.weight")
    fails(ck, r"missing tensor mtp\.layers\.0\.self_attn\.k_norm\.weight \(blk\.4\.attn_k_norm\.weight\)")
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "e")
    _add_tensor(ck, "mtp.fc.weight.extra", torch.randn(4))
    fails(ck, r"unrecognised tensor mtp\.fc\.weight\.extra")
    # config says one MTP layer, the checkpoint has none (and the other way round is fine: the
    # count comes from the tensors when config.json has no mtp_num_hidden_layers, as in llama.cpp)
    ck = _copy_ckpt(ckpts["parent"], tmp_path / "f")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (ck / "config.json").write_text(json.dumps(cfg))
    fails(ck, r"mtp_num_hidden_layers 1 but the checkpoint has no mtp\.\* tensors; pass --no-mtp")
    assert C.convert(ck, tmp_path / "f.gguf", progress=False, no_mtp=True)["n_mtp"] == 0
    ck = _copy_ckpt(ckpts["mtp"], tmp_path / "g")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 2
    (ck / "config.json").write_text(json.dumps(cfg))
    fails(ck, r"mtp_num_hidden_layers 2 but the checkpoint has 1 MTP layers")
    del cfg["mtp_num_hidden_layers"]
    (ck / "config.json").write_text(json.dumps(cfg))
    assert C.convert(ck, tmp_path / "g.gguf", progress=False)["n_mtp"] == 1


# ---------------------------------------------------------------------------------------------
# A checkpoint written by transformers itself
# ---------------------------------------------------------------------------------------------

def test_transformers_saved_checkpoint(ckpts, converted, tmp_path):
    """A tiny Qwen3_5MoeForCausalLM built by transformers 5.x, every parameter random (norms,
    gates, A_log, dt_bias included), saved with save_pretrained (sharded; its own names and expert
    layout) plus an mtp.* shard as released checkpoints have: every GGUF tensor equals the
    safetensors values after the spec 4.3 transforms (f32: exact), and the bf16 file is
    byte-identical to make_checkpoint's (same values). test_matches_llama_cpp_converter["hf_mtp"]
    compares this checkpoint with llama.cpp's converter directly."""
    ck = ckpts["hf_mtp"]
    cfg = json.loads((ck / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3_5MoeForCausalLM"] and cfg["mtp_num_hidden_layers"] == 1
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) >= 3
    hf = load_hf(ck)
    # transformers 5.23 writes per-expert tensors (it reverses its load-time fusion); either is read
    assert ("model.layers.0.mlp.experts.0.gate_proj.weight" in hf) != ("model.layers.0.mlp.experts.gate_up_proj" in hf)
    assert all(t.dtype == torch.bfloat16 for t in hf.values())
    for k in ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.dt_bias", "model.norm.weight",
              "model.layers.3.self_attn.q_norm.weight", "model.layers.0.linear_attn.norm.weight"):
        assert hf[k].float().std() > 0.05, k  # random, not transformers' constant initialisation
    res = C.convert(ck, tmp_path / "f32.gguf", outtype="f32", progress=False)
    got = gguf_tensors(gguf.GGUFReader(res["path"]))
    ex = expected_tensors(ck, clover=False)
    assert set(got) == set(ex) and res["n_mtp"] == 1
    for name, e in ex.items():
        np.testing.assert_array_equal(np.asarray(got[name].data).reshape(e.shape), e.float().numpy(), err_msg=name)
    _, a = converted("hf_mtp", "bf16")
    _, b = converted("mtp", "bf16")
    _assert_same_gguf(a, b)


# ---------------------------------------------------------------------------------------------
# Streaming and CLI
# ---------------------------------------------------------------------------------------------

def test_small_pieces_same_bytes(ckpts, converted, tmp_path, monkeypatch):
    """Writing in tiny row pieces (many pieces per tensor) gives the same file."""
    monkeypatch.setattr(C, "PIECE_BYTES", 4096)
    for outtype in ("bf16", "q8_0"):
        res = C.convert(ckpts["clover"], tmp_path / f"{outtype}.gguf", outtype=outtype, progress=False)
        _, ref = converted("clover", outtype)
        _assert_same_gguf(gguf.GGUFReader(res["path"]), ref)


def test_defaults_bf16_with_progress(ckpts, tmp_path, capsys):
    """Default outtype keeps BF16 (no silent downcast) and progress=True draws a tqdm bar."""
    res = C.convert(ckpts["clover"], tmp_path / "d.gguf")
    assert res["outtype"] == "bf16" and res["file_type"] == 32
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(res["path"]).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q.BF16 and types["token_embd.weight"] == Q.BF16
    assert "100%" in capsys.readouterr().err


def test_cli_without_torch(ckpts, tmp_path):
    """The convert command converts with exit status 0 and never imports torch (the CLI must not)."""
    out = tmp_path / "cli.gguf"
    p = _convert_cli_without_torch([ckpts["clover"], "-o", out, "--outtype", "q8_0", "--no-progress"])
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    m = kv(gguf.GGUFReader(out))
    assert m["general.file_type"] == 7


# ---------------------------------------------------------------------------------------------
# Quantised outtypes: llama.cpp's type plan, native quantisers, threads
# ---------------------------------------------------------------------------------------------

# Relative RMSE bound of quantise -> dequantise on the tiny checkpoint's (roughly Gaussian)
# weights; ggml's reference quantisers reach about 0.30 (Q2_K), 0.15 (Q3_K), 0.07
# (Q4_0/Q4_K/IQ4_XS), 0.035 (Q5_K), 0.018 (Q6_K) and 0.004 (Q8_0) on such data.
QUANT_RMSE = {Q.Q2_K: 0.36, Q.Q3_K: 0.19, Q.Q4_0: 0.11, Q.Q4_K: 0.10, Q.Q5_K: 0.05, Q.Q6_K: 0.025, Q.IQ4_XS: 0.10,
              Q.Q8_0: 0.01}


def _native_bytes(a: np.ndarray, qtype) -> np.ndarray:
    """The whole tensor quantised in one clover_from_f32 call (no pieces, no threads)."""
    from clover_gguf._ffi import ffi, lib
    a = np.ascontiguousarray(a, dtype=np.float32)
    block, tsize = gguf.GGML_QUANT_SIZES[qtype]
    out = np.empty(a.size // block * tsize, np.uint8)
    n = lib.clover_from_f32(int(qtype), ffi.cast("float *", a.ctypes.data), ffi.cast("void *", out.ctypes.data), a.size)
    assert n == out.size
    return out


@pytest.mark.parametrize("outtype,ftype", [("q4_0", 2), ("q4_k_m", 15), ("q5_k_m", 17), ("q6_k", 18),
                                           ("iq4_xs", 30), ("q2_k", 10), ("q3_k_m", 12), ("q4_k_s", 14)])
def test_quantized_outtypes(outtype, ftype, ckpts, converted):
    from clover_gguf.convert import quant_plan as QP
    res, reader = converted("clover", outtype)
    m = kv(reader)
    assert res["file_type"] == ftype and m["general.file_type"] == ftype
    assert m["general.quantization_version"] == 2
    got = gguf_tensors(reader)
    ex = expected_tensors(ckpts["clover"])
    assert set(got) == set(ex)
    hp = C.read_hparams(json.loads((ckpts["clover"] / "config.json").read_text()))
    plan = QP.plan_types("clover_moe", hp, {n: tuple(e.shape) for n, e in ex.items()}, outtype)
    default = QP.FTYPES[outtype][1]
    seen = set()
    for name, e in ex.items():
        t = got[name]
        assert t.tensor_type == plan[name], name
        if _f32_name(name):
            assert t.tensor_type == Q.F32, name
            np.testing.assert_array_equal(np.asarray(t.data).reshape(e.shape), e.numpy(), err_msg=name)
            continue
        seen.add(t.tensor_type)
        ef = e.float().numpy()
        raw = np.asarray(t.data).view(np.uint8).reshape(-1)
        # byte-equal to one whole-tensor native quantisation: pieces and threads change nothing
        np.testing.assert_array_equal(raw, _native_bytes(ef, t.tensor_type), err_msg=name)
        d = gguf.quants.dequantize(raw.reshape(-1, gguf.GGML_QUANT_SIZES[t.tensor_type][1]), t.tensor_type)
        d = d.reshape(e.shape)
        rel = float(np.sqrt(np.mean((d - ef) ** 2) / np.mean(ef ** 2)))
        assert rel < QUANT_RMSE[t.tensor_type], (name, t.tensor_type.name, rel)
    assert default in seen
    # llama.cpp's rules (tests/convert/test_quant_plan.py has the full table): output.weight Q6_K
    assert got["output.weight"].tensor_type == Q.Q6_K
    if outtype == "q4_k_m":
        # the tiny model has 8 experts: llama.cpp's n_expert == 8 rules give attn_v/qkv/k Q8_0,
        # attn_output Q5_K; ffn_down gets Q6_K where use_more_bits(i, 4): i >= 3 or i % 3 == 2
        assert got["blk.0.attn_qkv.weight"].tensor_type == Q.Q8_0
        assert got["blk.3.attn_output.weight"].tensor_type == Q.Q5_K
        assert [got[f"blk.{i}.ffn_down_exps.weight"].tensor_type for i in range(4)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q6_K]
        assert got["blk.2.ffn_down_shexp.weight"].tensor_type == Q.Q6_K
        assert got["blk.1.ffn_gate_exps.weight"].tensor_type == Q.Q4_K


def test_quantized_threads_and_pieces_same_bytes(ckpts, converted, tmp_path, monkeypatch):
    """q4_k_m with one thread and tiny pieces equals the default (all threads, 16 MiB pieces)."""
    monkeypatch.setattr(C, "PIECE_BYTES", 4096)
    res = C.convert(ckpts["clover"], tmp_path / "t1.gguf", outtype="q4_k_m", progress=False, threads=1)
    _, ref = converted("clover", "q4_k_m")
    _assert_same_gguf(gguf.GGUFReader(res["path"]), ref)


def test_cli_quantized_outtype(ckpts, tmp_path):
    """`clover-gguf convert ... --outtype Q4_K_M` (the CLI passes argv to convert.main; any letter
    case, as llama-quantize's names) without torch; an unknown type is an error listing the choices."""
    out = tmp_path / "cli-q4km.gguf"
    p = _convert_cli_without_torch([ckpts["parent"], "-o", out, "--outtype", "Q4_K_M", "--no-progress", "--threads", 2])
    assert p.returncode == 0, p.stderr
    r = gguf.GGUFReader(out)
    assert kv(r)["general.file_type"] == 15 and kv(r)["general.architecture"] == "qwen35moe"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and types["output.weight"] == Q.Q6_K
    p = subprocess.run([sys.executable, "-m", "clover_gguf.convert.convert", str(ckpts["parent"]), "-o", str(tmp_path / "x.gguf"),
                        "--outtype", "Q3_K_L"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--outtype: invalid choice: 'q3_k_l'" in p.stderr
    assert "'q2_k', 'q3_k_m', 'q4_k_s', 'q4_k_m'" in p.stderr
    # the Python API takes any letter case too, and names the choices for anything else
    with pytest.raises(C.ConvertError, match=r"outtype 'Q3_K_L': expected one of .*q3_k_m"):
        C.convert(ckpts["parent"], tmp_path / "y.gguf", outtype="Q3_K_L", progress=False)


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def test_tokenizer_roundtrip(ckpts, converted):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    _, reader = converted("clover", "bf16")
    m = kv(reader)
    tokens, types, merges = m["tokenizer.ggml.tokens"], m["tokenizer.ggml.token_type"], m["tokenizer.ggml.merges"]
    cfg = json.loads((ckpts["clover"] / "config.json").read_text())
    assert len(tokens) == len(types) == cfg["vocab_size"]
    assert m["tokenizer.ggml.model"] == "gpt2" and m["tokenizer.ggml.pre"] == "qwen35"

    orig = Tokenizer.from_file(str(ckpts["clover"] / "tokenizer.json"))
    ov = orig.get_vocab(with_added_tokens=True)
    added = {a.content: a for a in orig.get_added_tokens_decoder().values()}
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if i >= orig.get_vocab_size(with_added_tokens=True):
            assert (t, ty) == (f"[PAD{i}]", 5)
            continue
        assert ov[t] == i
        want = (3 if added[t].special else 4) if t in added else 1
        assert ty == want, t
    assert types[ov["<think>"]] == 4 and types[ov["<|im_end|>"]] == 3
    assert m["tokenizer.ggml.eos_token_id"] == ov["<|im_end|>"]
    assert m["tokenizer.ggml.padding_token_id"] == ov["<|endoftext|>"]
    assert m["tokenizer.ggml.mask_token_id"] == ov["<|mask|>"]

    vocab = {t: i for i, (t, ty) in enumerate(zip(tokens, types)) if ty != 5}  # added tokens keep their ids
    bpe = models.BPE(vocab=vocab, merges=[tuple(s.split(" ")) for s in merges], unk_token=None)
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == 4])
    texts = [
        "def parse_args(argv=None):\n    return argparse.ArgumentParser().parse_args(argv)\n",
        "<|im_start|>user\nGrüße aus München! Ça coûte 5 €, 日本語 🙂<|im_end|>\n<think>\n\n</think>\n\n",
        "  multiple   spaces\t\ttabs\r\n  and 12345 numbers, I'll we've THEY'RE",
    ]
    for text in texts:
        ids = orig.encode(text, add_special_tokens=False).ids
        assert tok.encode(text, add_special_tokens=False).ids == ids
        assert tok.decode(ids, skip_special_tokens=False) == orig.decode(ids, skip_special_tokens=False)


def test_chat_template_jinja_file_preferred(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    (ck / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    res = C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert kv(gguf.GGUFReader(res["path"]))["tokenizer.chat_template"] == "{{ messages[0]['content'] }}"


# ---------------------------------------------------------------------------------------------
# Transform helpers
# ---------------------------------------------------------------------------------------------

def test_v_head_perm_matches_spec():
    """Original value head i*r + j lands at j*Hk + i (spec 4.3)."""
    hk, r, hd = 3, 4, 2
    src = np.arange(hk * r * hd)
    out = src[C.v_head_perm(hk, r, hd)].reshape(hk * r, hd)
    for i in range(hk):
        for j in range(r):
            np.testing.assert_array_equal(out[j * hk + i], src.reshape(hk * r, hd)[i * r + j])


# ---------------------------------------------------------------------------------------------
# llama.cpp's own converter as an oracle (when its source is present; read only)
# ---------------------------------------------------------------------------------------------

LLAMA_CPP = LLAMA_CPP_SRC
_HAVE_LLAMA_CPP = (LLAMA_CPP / "convert_hf_to_gguf.py").is_file()
# a Python with llama-cpp-python (its llama_model_quantize): CLOVER_LLAMA_PYTHON, else the venv
# that clover/notes/oracles.md builds
LLAMA_PYTHON = llama_python() or "/tmp/llama-venv/bin/python"


def _llama_convert(ckpt: pathlib.Path, out: pathlib.Path, outtype: str, no_mtp: bool) -> gguf.GGUFReader:
    """llama.cpp's convert_hf_to_gguf.py on ``ckpt`` (tests/llamacpp.py), read back."""
    return gguf.GGUFReader(run_llama_converter(ckpt, out, outtype, no_mtp=no_mtp, timeout=300))


def _assert_same_tensors_as_llama(ll: gguf.GGUFReader, me: gguf.GGUFReader) -> None:
    tl, tm = gguf_tensors(ll), gguf_tensors(me)
    assert set(tl) == set(tm)
    for name, x in tl.items():
        y = tm[name]
        assert x.tensor_type == y.tensor_type, (name, x.tensor_type.name, y.tensor_type.name)
        if name.endswith("ffn_gate_inp_shexp.weight"):  # {H, 1} from the converter, {H} after llama-quantize
            assert list(x.shape) in (list(y.shape), list(y.shape) + [1]), name
        else:
            assert list(x.shape) == list(y.shape), name
        assert np.array_equal(np.asarray(x.data).view(np.uint8).reshape(-1),
                              np.asarray(y.data).view(np.uint8).reshape(-1)), name


@pytest.mark.skipif(not _HAVE_LLAMA_CPP, reason="llama.cpp source not present")
@pytest.mark.parametrize("which,outtype", [("parent", "bf16"), ("parent", "q8_0"), ("mtp", "bf16"), ("mtp", "q8_0"),
                                           ("hf_mtp", "f32")])
def test_matches_llama_cpp_converter(which, outtype, ckpts, converted, tmp_path):
    """Every tensor equals llama.cpp's convert_hf_to_gguf.py output (qwen35moe) bit for bit, and
    so do the KV pairs but the known, intended differences: ffn_gate_inp_shexp is {H} here
    (contract) and {H, 1} there; llama.cpp adds general.size_label and tokenizer.ggml.mask_token_id
    and omits feed_forward_length. "parent" runs llama.cpp with --no-mtp (it needs it without MTP
    layers); "mtp" and "hf_mtp" (transformers-saved) keep the MTP block on both sides: block_count,
    nextn_predict_layers, attention.recurrent_layers and the blk.4 tensors agree."""
    ll = _llama_convert(ckpts[which], tmp_path / "ll.gguf", outtype, no_mtp=which == "parent")
    _, me = converted(which, outtype)
    _assert_same_tensors_as_llama(ll, me)
    kl, km = kv(ll), kv(me)
    for k in ("general.name", "general.size_label", "tokenizer.ggml.mask_token_id"):
        kl.pop(k, None)
    km.pop("general.name")
    assert km.pop("qwen35moe.feed_forward_length") == km["qwen35moe.expert_feed_forward_length"]
    assert kl == km
    if which != "parent":
        assert km["qwen35moe.nextn_predict_layers"] == 1 and km["qwen35moe.block_count"] == 5


def _llama_quantize(src: pathlib.Path, dst: pathlib.Path, ftype: str) -> gguf.GGUFReader:
    code = ("import ctypes, sys, llama_cpp; p = llama_cpp.llama_model_quantize_default_params(); "
            "p.ftype = getattr(llama_cpp, 'LLAMA_FTYPE_MOSTLY_' + sys.argv[3]); p.nthread = 2; "
            "sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(p)))")
    p = subprocess.run([LLAMA_PYTHON, "-c", code, str(src), str(dst), ftype], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return gguf.GGUFReader(dst)


@pytest.mark.skipif(not (_HAVE_LLAMA_CPP and pathlib.Path(LLAMA_PYTHON).is_file()),
                    reason="llama.cpp source or a Python with llama-cpp-python not present")
@pytest.mark.parametrize("outtype", ["q4_k_m", "iq4_xs", "q2_k", "q3_k_m", "q4_k_s"])
def test_mtp_quantized_matches_llama_quantize(outtype, ckpts, converted, tmp_path):
    """With an MTP block, our quantised file equals llama.cpp's llama_model_quantize of its own
    bf16 conversion bit for bit (types and bytes): the MTP tensors follow the ordinary rules with
    llama.cpp's layer count n_layer_all = block_count (5 here, so ffn_down of layers 2 and 4 is Q6_K
    in Q4_K_M, not 2 and 3 as without MTP), nextn.eh_proj takes the default type."""
    if subprocess.run([LLAMA_PYTHON, "-c", "import llama_cpp"], capture_output=True).returncode:
        pytest.skip(f"{LLAMA_PYTHON} cannot import llama_cpp")
    _llama_convert(ckpts["mtp"], tmp_path / "ll-bf16.gguf", "bf16", no_mtp=False)
    ll = _llama_quantize(tmp_path / "ll-bf16.gguf", tmp_path / "ll-q.gguf", outtype.upper())
    _, me = converted("mtp", outtype)
    _assert_same_tensors_as_llama(ll, me)
    types = {t.name: t.tensor_type for t in me.tensors}
    if outtype == "q4_k_m":
        assert [types[f"blk.{i}.ffn_down_exps.weight"] for i in range(5)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q6_K]
        assert types["blk.4.nextn.eh_proj.weight"] == Q.Q4_K
