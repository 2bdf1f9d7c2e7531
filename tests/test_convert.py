"""Tests of the HF -> GGUF converter (convert/convert.py; clover-spec section 4).

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
import pathlib
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest

from llamacpp import LLAMA_CPP_SRC, llama_python, run_llama_converter
import torch
from safetensors.torch import load_file, save_file

from convert import convert as C
from convert.make_checkpoint import QWEN35_PRETOKENIZER_REGEX

ROOT = pathlib.Path(__file__).resolve().parents[1]
Q = gguf.GGMLQuantizationType


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
    ``save_pretrained`` writes it (convert.make_checkpoint.make_hf_saved_checkpoint; same values
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
            for sfx, (beta, alpha, conv, alog, dt) in {
                "": ("ssm_beta.weight", "ssm_alpha.weight", "ssm_conv1d.weight", "ssm_a", "ssm_dt.bias"),
                "_bwd": ("ssm_beta_bwd.weight", "ssm_alpha_bwd.weight", "ssm_conv1d_bwd.weight", "ssm_a_bwd",
                         "ssm_dt_bwd.bias"),
            }.items():
                if sfx and not clover:
                    continue
                ex[b + beta] = reorder_v(hf[a + f"in_proj_b{sfx}.weight"], 0, hk, r, 1)
                ex[b + alpha] = reorder_v(hf[a + f"in_proj_a{sfx}.weight"], 0, hk, r, 1)
                c = hf[a + f"conv1d{sfx}.weight"].float().squeeze(1)
                ex[b + conv] = torch.cat([c[:qk], reorder_v(c[qk:], 0, hk, r, dv)])
                alog_t = reorder_v(hf[a + f"A_log{sfx}"].float()[:, None], 0, hk, r, 1)[:, 0]
                ex[b + alog] = (-torch.exp(alog_t.double())).float()
                ex[b + dt] = reorder_v(hf[a + f"dt_bias{sfx}"].float()[:, None], 0, hk, r, 1)[:, 0]
            if clover:
                ex[b + "ssm_bwd_mix"] = reorder_v(hf[a + "bwd_mix"].float()[:, None], 0, hk, r, 1)[:, 0]
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
                          "conv1d_bwd.weight", "ssm_a", "ssm_a_bwd", ".bias", "ssm_bwd_mix"))


def gguf_tensors(reader: gguf.GGUFReader) -> dict:
    return {t.name: t for t in reader.tensors}


def kv(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _numpy_shape(t) -> tuple:
    return tuple(int(x) for x in reversed(list(t.shape)))


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
    assert res["arch"] == "clover" and res["n_tensors"] == len(ex)
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
    assert m["general.architecture"] == "clover"
    assert m["general.file_type"] == ftype == res["file_type"]
    assert m["general.quantization_version"] == 2
    p = "clover."
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
        "full_attention_interval": cfg["full_attention_interval"],
    }
    for k, v in want.items():
        assert m[p + k] == v, k
    assert m[p + "attention.layer_norm_rms_epsilon"] == pytest.approx(cfg["rms_norm_eps"], rel=1e-6)
    assert m[p + "rope.freq_base"] == pytest.approx(cfg["rope_parameters"]["rope_theta"])
    for k in ("mask_token_id", "block_size", "think_close_bias_start", "eos_bias_start", "logits_shift"):
        assert m["clover.diffusion." + k] == cfg[k], k
    for k in ("threshold", "moe_block_coreset_top_p", "presence_penalty", "repetition_penalty"):
        assert m["clover.diffusion." + k] == pytest.approx(cfg[k], rel=1e-6), k
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


def test_arch_qwen35moe_drops_exactly_clover_parts(ckpts, converted):
    res_c, rc = converted("clover", "bf16")
    res_p, rp = converted("clover", "bf16", "qwen35moe")
    assert res_p["arch"] == "qwen35moe"
    clover_only = ("ssm_conv1d_bwd.weight", "ssm_a_bwd", "ssm_dt_bwd.bias", "ssm_beta_bwd.weight",
                   "ssm_alpha_bwd.weight", "ssm_bwd_mix")
    kept = [n for n in res_c["tensors"] if not n.endswith(clover_only)]
    assert len(kept) == len(res_c["tensors"]) - 6 * 3  # 3 GDN layers in the tiny model
    assert res_p["tensors"] == kept
    tp = gguf_tensors(rp)
    for t in rc.tensors:
        if t.name in tp:
            assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(tp[t.name].data).view(np.uint8))
    kc, kp = kv(rc), kv(rp)
    assert kp.pop("general.architecture") == "qwen35moe" and kc.pop("general.architecture") == "clover"
    renamed = {("qwen35moe." + k[len("clover."):] if k.startswith("clover.") else k): v
               for k, v in kc.items() if not k.startswith("clover.diffusion.")}
    assert renamed == kp
    assert len(res_p["dropped"]) == 6 * 3 and all("_bwd" in n or "bwd_mix" in n for n in res_p["dropped"])
    # the parent checkpoint converts to the same file (same seed: same values)
    res_par, rpar = converted("parent", "bf16")
    assert res_par["arch"] == "qwen35moe"
    _assert_same_gguf(rp, rpar)


def test_arch_errors(ckpts, tmp_path):
    with pytest.raises(C.ConvertError, match="not a Clover checkpoint"):
        C.convert(ckpts["parent"], tmp_path / "x.gguf", arch="clover", progress=False)
    # mask_token_id without backward tensors
    ck = _copy_ckpt(ckpts["parent"], tmp_path / "half1")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["mask_token_id"] = 5
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ConvertError, match="no Clover backward-branch tensors"):
        C.convert(ck, tmp_path / "x.gguf", progress=False)
    # backward tensors without mask_token_id
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "half2")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["mask_token_id"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(C.ConvertError, match="no mask_token_id"):
        C.convert(ck, tmp_path / "x.gguf", progress=False)
    # one GDN layer lacking one backward tensor: named
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "half3")
    idx = json.loads((ck / "model.safetensors.index.json").read_text())
    victim = "model.layers.1.linear_attn.bwd_mix"
    shard = idx["weight_map"].pop(victim)
    d = load_file(str(ck / shard))
    del d[victim]
    save_file(d, str(ck / shard), metadata={"format": "pt"})
    (ck / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(C.ConvertError, match=r"missing tensor model\.layers\.1\.linear_attn\.bwd_mix"):
        C.convert(ck, tmp_path / "x.gguf", progress=False)
    assert not list(tmp_path.glob("*.gguf*"))


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


def test_unknown_tensor(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _add_tensor(ck, "model.layers.2.linear_attn.mystery.weight", torch.randn(4, 4))
    with pytest.raises(C.ConvertError, match=r"model\.layers\.2\.linear_attn\.mystery\.weight"):
        C.convert(ck, tmp_path / "m.gguf", progress=False)
    assert not (tmp_path / "m.gguf").exists()


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
    --arch clover under the clover. prefix. Every value equals the spec 4.3 reference."""
    res, reader = converted(which, outtype)
    clover = which.startswith("clover")
    arch = "clover" if clover else "qwen35moe"
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
    from convert import quant_plan as QP
    hp = C.read_hparams(json.loads((ckpts[which] / "config.json").read_text()))
    hp.n_mtp = 1
    assert [(n, tuple(s)) for n, s in QP.tensor_shapes(hp, arch)] == [(t.name, _numpy_shape(t)) for t in reader.tensors]


def test_mtp_quant_plan():
    """The type plan counts MTP blocks in llama.cpp's n_layer_all (block_count): with 4 trunk layers
    and one MTP block, Q4_K_M puts Q6_K on ffn_down of layers 2 and 4 (use_more_bits(i, 5)), not 2
    and 3 (use_more_bits(i, 4)); nextn.eh_proj takes the default type, the nextn norms stay F32.
    (test_mtp_quantized_matches_llama_quantize checks the whole file against llama-quantize.)"""
    from convert import quant_plan as QP
    from convert.make_checkpoint import text_config
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
    """main() converts with exit status 0 and never imports torch (the CLI must not)."""
    out = tmp_path / "cli.gguf"
    code = (
        "import sys; from convert.convert import main; "
        f"rc = main([{str(ckpts['clover'])!r}, '-o', {str(out)!r}, '--outtype', 'q8_0', '--no-progress']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "wrote" in p.stdout
    m = kv(gguf.GGUFReader(out))
    assert m["general.file_type"] == 7


# ---------------------------------------------------------------------------------------------
# Quantised outtypes (issue 3 item 2): llama.cpp's type plan, native quantisers, threads
# ---------------------------------------------------------------------------------------------

# Relative RMSE bound of quantise -> dequantise on the tiny checkpoint's (roughly Gaussian)
# weights; ggml's reference quantisers reach about 0.07 (Q4_0/Q4_K/IQ4_XS), 0.035 (Q5_K),
# 0.018 (Q6_K) and 0.004 (Q8_0) on such data.
QUANT_RMSE = {Q.Q4_0: 0.11, Q.Q4_K: 0.10, Q.Q5_K: 0.05, Q.Q6_K: 0.025, Q.IQ4_XS: 0.10, Q.Q8_0: 0.01}


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
                                           ("iq4_xs", 30)])
def test_quantized_outtypes(outtype, ftype, ckpts, converted):
    from convert import quant_plan as QP
    res, reader = converted("clover", outtype)
    m = kv(reader)
    assert res["file_type"] == ftype and m["general.file_type"] == ftype
    assert m["general.quantization_version"] == 2
    got = gguf_tensors(reader)
    ex = expected_tensors(ckpts["clover"])
    assert set(got) == set(ex)
    hp = C.read_hparams(json.loads((ckpts["clover"] / "config.json").read_text()))
    plan = QP.plan_types("clover", hp, {n: tuple(e.shape) for n, e in ex.items()}, outtype)
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
    # llama.cpp's rules (tests/test_quant_plan.py has the full table): output.weight Q6_K
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
    """`clover-gguf convert ... --outtype q4_k_m` (the CLI passes argv to convert.main) without torch."""
    out = tmp_path / "cli-q4km.gguf"
    code = (
        "import sys; from clover_gguf.cli import main; "
        f"rc = main(['convert', {str(ckpts['parent'])!r}, '-o', {str(out)!r}, '--outtype', 'q4_k_m', "
        "'--no-progress', '--threads', '2']); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    r = gguf.GGUFReader(out)
    assert kv(r)["general.file_type"] == 15 and kv(r)["general.architecture"] == "qwen35moe"
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == Q.Q4_K and types["output.weight"] == Q.Q6_K
    p = subprocess.run([sys.executable, "-m", "convert.convert", str(ckpts["parent"]), "-o", str(tmp_path / "x.gguf"),
                        "--outtype", "q3_k_m"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "q4_k_m" in p.stderr


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
    assert m["clover.diffusion.mask_token_id"] == ov["<|mask|>"]

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
@pytest.mark.parametrize("outtype", ["q4_k_m", "iq4_xs"])
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
