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
import torch
from safetensors.torch import load_file, save_file

from convert import convert as C
from convert.make_checkpoint import QWEN35_PRETOKENIZER_REGEX

ROOT = pathlib.Path(__file__).resolve().parents[1]
Q = gguf.GGMLQuantizationType


# ---------------------------------------------------------------------------------------------
# Fixtures: tiny checkpoints (spec section 1 tiny dims, every parameter random) and conversions
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(make_ckpt):
    """Four tiny checkpoints with the same seed (tests/conftest.py, shared per session): Clover
    fused/model., Clover nested prefix, Clover per-expert, and the parent (no Clover tensors or
    keys). Never modified in place (tests copy them first)."""
    return {
        "clover": make_ckpt(),
        "nested": make_ckpt(prefix="model.language_model."),
        "perexpert": make_ckpt(fused_experts=False),
        "parent": make_ckpt(clover=False),
    }


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


def expected_tensors(ckpt: pathlib.Path, clover: bool = True) -> dict[str, torch.Tensor]:
    """GGUF name -> transformed tensor (numpy-order shape). F32 tensors as float32, the rest in
    the checkpoint dtype (bf16)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    tc = cfg.get("text_config", cfg)
    hf = load_hf(ckpt)
    pre = "model.language_model." if any(k.startswith("model.language_model.") for k in hf) else "model."
    hk, hv = tc["linear_num_key_heads"], tc["linear_num_value_heads"]
    dk, dv = tc["linear_key_head_dim"], tc["linear_value_head_dim"]
    r = hv // hk
    qk = 2 * hk * dk
    E = tc["num_experts"]
    f32 = lambda t: t.float()  # noqa: E731
    p1 = lambda t: t.float() + 1.0  # noqa: E731  (zero-centred norm)

    ex = {"token_embd.weight": hf[pre + "embed_tokens.weight"],
          "output_norm.weight": p1(hf[pre + "norm.weight"]),
          "output.weight": hf["lm_head.weight"]}
    for i in range(tc["num_hidden_layers"]):
        L = f"{pre}layers.{i}."
        b = f"blk.{i}."
        ex[b + "attn_norm.weight"] = p1(hf[L + "input_layernorm.weight"])
        ex[b + "post_attention_norm.weight"] = p1(hf[L + "post_attention_layernorm.weight"])
        if (i + 1) % tc["full_attention_interval"]:
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


def test_mtp_and_visual(ckpts, tmp_path):
    ck = _copy_ckpt(ckpts["clover"], tmp_path / "ck")
    _add_tensor(ck, "mtp.fc.weight", torch.randn(4, 8))
    _add_tensor(ck, "model.visual.patch_embed.proj.weight", torch.randn(4, 4))
    with pytest.raises(C.ConvertError, match=r"MTP tensors \(mtp\.fc\.weight.*--no-mtp"):
        C.convert(ck, tmp_path / "m.gguf", progress=False)
    res = C.convert(ck, tmp_path / "m.gguf", progress=False, no_mtp=True)
    assert sorted(res["dropped"]) == ["model.visual.patch_embed.proj.weight", "mtp.fc.weight"]
    ref = C.convert(ckpts["clover"], tmp_path / "ref.gguf", progress=False)
    _assert_same_gguf(gguf.GGUFReader(res["path"]), gguf.GGUFReader(ref["path"]))


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

LLAMA_CPP = pathlib.Path("/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp")


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(), reason="llama.cpp source not present")
@pytest.mark.parametrize("outtype", ["bf16", "q8_0"])
def test_matches_llama_cpp_converter(outtype, ckpts, converted, tmp_path):
    """On the parent checkpoint, every tensor equals llama.cpp's convert_hf_to_gguf.py output
    (qwen35moe) bit for bit. Known, intended differences: ffn_gate_inp_shexp is {H} here
    (contract) and {H, 1} there; llama.cpp adds general.size_label, attention.recurrent_layers
    and tokenizer.ggml.mask_token_id and omits feed_forward_length."""
    out = tmp_path / "ll.gguf"
    runner = (
        "import sys, runpy; LL = sys.argv[1]; sys.path.insert(0, LL); sys.path.insert(1, LL + '/gguf-py'); "
        "import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tok: 'qwen35'; "
        "sys.argv = [LL + '/convert_hf_to_gguf.py'] + sys.argv[2:]; "
        "runpy.run_path(LL + '/convert_hf_to_gguf.py', run_name='__main__')"
    )
    p = subprocess.run([sys.executable, "-c", runner, str(LLAMA_CPP), str(ckpts["parent"]), "--outfile", str(out),
                        "--outtype", outtype, "--no-mtp"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    ll = gguf.GGUFReader(out)
    _, me = converted("parent", outtype)
    tl, tm = gguf_tensors(ll), gguf_tensors(me)
    assert set(tl) == set(tm)
    for name, x in tl.items():
        y = tm[name]
        assert x.tensor_type == y.tensor_type, name
        if name.endswith("ffn_gate_inp_shexp.weight"):
            assert list(x.shape) == list(y.shape) + [1]
        else:
            assert list(x.shape) == list(y.shape), name
        assert np.array_equal(np.asarray(x.data).view(np.uint8).reshape(-1),
                              np.asarray(y.data).view(np.uint8).reshape(-1)), name
    kl, km = kv(ll), kv(me)
    for k in ("general.name", "general.size_label", "qwen35moe.attention.recurrent_layers",
              "tokenizer.ggml.mask_token_id"):
        kl.pop(k, None)
    km.pop("general.name")
    assert km.pop("qwen35moe.feed_forward_length") == km["qwen35moe.expert_feed_forward_length"]
    assert kl == km
