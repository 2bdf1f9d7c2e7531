"""Clover files in every layout a user can hold (docs/gguf-layout.md, clover-spec 4.1): a
complete clover_moe file, a trunk (llama.cpp's clover_moe layout) with its diffusion sidecar
found beside it or given explicitly, a trunk alone (ar only), and every sidecar that does not
match its trunk refused with an error naming the file and the field."""
import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from clover_gguf import CloverError, Model

PROMPT = "def fibonacci(n):\n    "
NO_PEN = dict(presence_penalty=0.0, repeat_penalty=1.0, end_ids=[])


@pytest.fixture(scope="module")
def complete(make_gguf):
    return make_gguf("f32")


@pytest.fixture(scope="module")
def split(make_gguf):
    """(trunk, sidecar) as convert --split writes them."""
    trunk = make_gguf("f32", split=True)
    return trunk, trunk.with_name(trunk.name[:-len(".gguf")] + ".diffusion.gguf")


@pytest.fixture
def trunk_alone(split, tmp_path):
    """A copy of the trunk with no sidecar beside it (a llama.cpp clover_moe GGUF)."""
    return shutil.copy(split[0], tmp_path / "clover-f32.gguf")


def _tokens(path, mode, n=24, **kw):
    with Model(str(path), n_ctx=256, n_threads=2, **kw) as m:
        out, st = m.generate_tokens(m.tokenize(PROMPT), max_tokens=n, mode=mode, block_size=8, **NO_PEN)
        return out, st


def test_trunk_with_its_sidecar_beside_it_equals_the_complete_file(complete, split):
    trunk, side = split
    assert side.is_file()
    with Model(str(trunk), n_ctx=64) as m:
        assert m.arch == "clover_moe" and m.has_block and m.sidecar_path == str(side)
    with Model(str(complete), n_ctx=64) as m:
        assert m.has_block and m.sidecar_path is None
    for mode in ("ar", "diffusion", "spec"):
        assert _tokens(trunk, mode)[0] == _tokens(complete, mode)[0], mode


def test_sidecar_given_explicitly(split, trunk_alone, complete):
    _, side = split
    with Model(str(trunk_alone), n_ctx=64, diffusion_path=side) as m:
        assert m.has_block and m.sidecar_path == str(side)
    assert _tokens(trunk_alone, "diffusion", diffusion_path=side)[0] == _tokens(complete, "diffusion")[0]
    # "" loads none, even with the sidecar beside the model
    with Model(str(split[0]), n_ctx=64, diffusion_path="") as m:
        assert not m.has_block


def test_trunk_alone_runs_ar_and_refuses_diffusion_saying_how(trunk_alone, complete):
    with Model(str(trunk_alone), n_ctx=64) as m:
        assert m.arch == "clover_moe" and not m.has_block and m.sidecar_path is None
        assert m.hparams["mask_token_id"] == -1
        side = str(trunk_alone)[:-len(".gguf")] + ".diffusion.gguf"
        for mode in ("diffusion", "spec"):
            with pytest.raises(ValueError, match=f"mode {mode} needs Clover's block tensors") as e:
                m.generate_tokens(m.tokenize(PROMPT), max_tokens=4, mode=mode)
            assert f"clover-gguf convert HF_DIR --diffusion-only -o {side}" in str(e.value)
        with pytest.raises(ValueError, match="block_logits: mode diffusion needs"):
            m.block_logits([1, 2], [3, 4])
        # the card's record defaults (spec 4.2) apply: penalties on, counted over the response
        assert m.hparams["penalty_scope"] == "response" and abs(m.hparams["presence_penalty"] - 0.9) < 1e-6
    out, st = _tokens(trunk_alone, None)
    assert st["mode"] == "ar" and out == _tokens(complete, "ar")[0]


def _rewrite(src, dst, kv=None, drop=(), retype=None, reshape=None, add=None):
    """A copy of GGUF src at dst: KV values replaced (key -> value, type from the value), tensors
    dropped, one tensor stored as F16 (retype) or with another shape (reshape = (name, shape)),
    one tensor added (add = (name, array))."""
    r = GGUFReader(str(src))
    kv = dict(kv or {})
    arch = kv.pop("general.architecture", None) or bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        v = kv.pop(name, f.contents())
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            w.add_array(name, v)
        elif isinstance(v, str):
            w.add_string(name, v)
        else:
            w.add_key_value(name, v, t)
    for name, v in kv.items():
        w.add_key_value(name, v, GGUFValueType.STRING if isinstance(v, str) else GGUFValueType.UINT32)
    for t in r.tensors:
        if t.name in drop:
            continue
        a = np.array(t.data)
        if retype == t.name:
            w.add_tensor(t.name, a.astype(np.float16), raw_dtype=GGMLQuantizationType.F16)
            continue
        if reshape and reshape[0] == t.name:
            a = a.reshape(-1)[:int(np.prod(reshape[1]))].reshape(reshape[1])
        w.add_tensor(t.name, a, raw_dtype=t.tensor_type)
    if add:
        w.add_tensor(add[0], add[1])
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


BAD_SIDECARS = [
    (dict(kv={"general.architecture": "qwen35moe"}), r"general\.architecture 'qwen35moe' \(expected clover_moe\)"),
    (dict(kv={"general.type": "model"}), r"general\.type 'model' \(expected diffusion\)"),
    (dict(kv={"clover_moe.block_count": 3}), r"clover_moe\.block_count 3, but the model has 4 decoder layers"),
    (dict(drop=("blk.1.bd_history_c",)), r"missing tensor blk\.1\.bd_history_c"),
    (dict(reshape=("blk.0.bd_logit_scale", (2,))), r"tensor blk\.0\.bd_logit_scale: shape \{2, 1, 1, 1\} expected"),
    (dict(reshape=("blk.2.ssm_conv1d_right.weight", (512, 2))),
     r"tensor blk\.2\.ssm_conv1d_right\.weight: shape \{2, 512, 1, 1\} expected \{3, 512, 1, 1\}"),
    (dict(retype="blk.0.bd_history_bias"), r"tensor blk\.0\.bd_history_bias: type F16, expected F32"),
    (dict(add=("blk.3.bd_logit_scale", np.ones(4, np.float32))),
     r"tensor blk\.3\.bd_logit_scale is not a block tensor of one of the model's Gated DeltaNet layers"),
    (dict(add=("token_embd.weight", np.ones((8, 256), np.float32))),
     r"tensor token_embd\.weight is not a block tensor"),
    (dict(kv={"tokenizer.ggml.mask_token_id": 5000}),
     r"tokenizer\.ggml\.mask_token_id: value 5000 outside \[0, 2047\]"),
    (dict(kv={"diffusion.penalty_scope": "prompt"}), r"diffusion\.penalty_scope: 'prompt'"),
]


@pytest.mark.parametrize("bad,pattern", BAD_SIDECARS, ids=[p for _, p in BAD_SIDECARS])
def test_mismatched_sidecars_are_refused_naming_file_and_field(split, trunk_alone, tmp_path, bad, pattern):
    side = _rewrite(split[1], tmp_path / "bad.diffusion.gguf", **bad)
    with pytest.raises(CloverError, match=f"diffusion sidecar {side}: .*{pattern}"):
        Model(str(trunk_alone), n_ctx=64, diffusion_path=side)
    # found beside the model, the same file is refused the same way
    beside = shutil.copy(side, str(trunk_alone)[:-len(".gguf")] + ".diffusion.gguf")
    with pytest.raises(CloverError, match=f"diffusion sidecar {beside}: .*{pattern}"):
        Model(str(trunk_alone), n_ctx=64)


def test_sidecar_without_a_mask_token_is_refused(split, trunk_alone, tmp_path):
    r = GGUFReader(str(split[1]))
    w = GGUFWriter(str(tmp_path / "nomask.diffusion.gguf"), "clover_moe")
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name not in ("general.architecture", "tokenizer.ggml.mask_token_id"):
            v = f.contents()
            (w.add_string(name, v) if isinstance(v, str) else w.add_key_value(name, v, f.types[0]))
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(CloverError, match="missing key tokenizer.ggml.mask_token_id"):
        Model(str(trunk_alone), n_ctx=64, diffusion_path=tmp_path / "nomask.diffusion.gguf")


def test_sidecar_refused_by_a_complete_file_a_parent_and_a_missing_path(complete, split, make_gguf, tmp_path):
    side = split[1]
    with pytest.raises(CloverError, match=f"diffusion sidecar {side}: the model holds the block tensors itself"):
        Model(str(complete), n_ctx=64, diffusion_path=side)
    parent = make_gguf("f32", arch="qwen35moe", clover=False)
    with pytest.raises(CloverError, match=f"diffusion sidecar {side}: the model is qwen35moe"):
        Model(str(parent), n_ctx=64, diffusion_path=side)
    missing = tmp_path / "none.diffusion.gguf"
    with pytest.raises(CloverError, match=f"diffusion sidecar: {missing}: cannot open"):
        Model(str(split[0]), n_ctx=64, diffusion_path=missing)


def test_record_keys_come_from_the_sidecar(make_gguf):
    """The decoding record travels with the block tensors: a trunk takes its sidecar's."""
    trunk = make_gguf("f32", split=True, record={"shift_logits": True, "block_aligned": False, "threshold": 0.5,
                                                  "penalty_scope": "all"})
    with Model(str(trunk), n_ctx=64) as m:
        hp = m.hparams
        assert hp["shift_logits"] and not hp["block_aligned"] and hp["penalty_scope"] == "all"
        assert abs(hp["threshold"] - 0.5) < 1e-6


def test_a_sidecar_loaded_as_the_model_says_what_it_is(split):
    with pytest.raises(CloverError, match="this is a diffusion sidecar .* load its clover_moe model"):
        Model(str(split[1]), n_ctx=64)
