"""clover_gguf.Model: the Python API over the engine (clover-spec sections 3, 5).

References: the checkpoint's config.json and tokenizer.json, and the engine's own prefix-mode
logits (a greedy AR loop written here over ``prefix_logits`` must give the tokens of
``generate_tokens(mode="ar")``). Engine-versus-PyTorch numerics are in test_engine.py.
"""
import json
import os
import pathlib

import numpy as np
import pytest

from clover_gguf import CloverError, Model
from clover_gguf.options import GenerateOptions

N_THREADS = 2


@pytest.fixture(scope="module")
def ckpt(make_ckpt):
    return pathlib.Path(make_ckpt())


@pytest.fixture(scope="module")
def config(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    return cfg, text


@pytest.fixture(scope="module")
def gguf_path(make_gguf):
    return make_gguf("f32")


@pytest.fixture(scope="module")
def parent_gguf(make_gguf):
    return make_gguf("f32", arch="qwen35moe")


@pytest.fixture(scope="module")
def model(gguf_path):
    with Model(gguf_path, n_ctx=512, n_threads=N_THREADS) as m:
        yield m


PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"


def test_hparams_from_config(model, config):
    cfg, text = config
    hp = model.hparams
    assert hp["has_block"] is True and model.has_block and model.arch == hp["arch"] == "clover_moe"
    assert hp["n_vocab"] == text["vocab_size"] == model.n_vocab
    assert hp["n_embd"] == text["hidden_size"]
    assert hp["n_layer"] == text["num_hidden_layers"]
    assert hp["n_head"] == text["num_attention_heads"]
    assert hp["n_head_kv"] == text["num_key_value_heads"]
    assert hp["n_expert"] == text["num_experts"]
    assert hp["n_expert_used"] == text["num_experts_per_tok"]
    assert hp["mask_token_id"] == cfg["mask_token_id"]
    assert hp["block_size"] == cfg["block_size"]
    assert hp["threshold"] == pytest.approx(cfg["threshold"], rel=1e-6)
    assert hp["coreset_top_p"] == pytest.approx(cfg["moe_block_coreset_top_p"], rel=1e-6)
    # the record's fields the config does not give take spec 4.2's defaults
    assert hp["shift_logits"] is False and hp["block_aligned"] is True and hp["penalty_scope"] == "response"
    assert hp["presence_penalty"] == pytest.approx(cfg["presence_penalty"], rel=1e-6)
    assert hp["repetition_penalty"] == pytest.approx(cfg["repetition_penalty"], rel=1e-6)
    assert hp["bias_slope"] == pytest.approx(0.01, rel=1e-6) and hp["bias_max"] == pytest.approx(10.0, rel=1e-6)


def test_end_ids(model, ckpt):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    assert hf.token_to_id("<|im_end|>") in model.end_ids
    assert hf.token_to_id("<|endoftext|>") in model.end_ids
    assert hf.token_to_id("<|mask|>") not in model.end_ids


def test_tokenize_matches_checkpoint_tokenizer(model, ckpt):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    for s in [PROMPT, "<|im_start|>user\nGrüße 🙂<|im_end|>\n", "  x = [1, 2, 3]  # ünïcode"]:
        ids = model.tokenize(s)
        assert ids == hf.encode(s, add_special_tokens=False).ids
        assert model.detokenize(ids) == s
    plain = model.tokenize("<|im_start|>", special=False)
    assert hf.token_to_id("<|im_start|>") not in plain


def test_prefix_logits_shape_and_causality(model):
    ids = model.tokenize(PROMPT)
    assert len(ids) >= 8
    full = model.prefix_logits(ids)
    assert full.dtype == np.float32 and full.shape == (len(ids), model.n_vocab)
    assert np.isfinite(full).all()
    part = model.prefix_logits(ids[:5])
    # causal: the first rows do not depend on later tokens (chunked vs shorter prefill)
    np.testing.assert_allclose(part, full[:5], rtol=0, atol=1e-4)
    assert np.abs(full).max() > 0


def _greedy_ar(model, prompt, n):
    mask = model.hparams["mask_token_id"]
    ids = list(prompt)
    out = []
    for _ in range(n):
        row = model.prefix_logits(ids)[-1].astype(np.float64)
        if mask >= 0:
            row[mask] = -np.inf  # the mask token is never a candidate
        t = int(np.argmax(row))
        out.append(t)
        if t in model.end_ids:
            break
        ids.append(t)
    return out


def test_generate_tokens_ar_equals_greedy_loop_over_prefix_logits(model):
    prompt = model.tokenize(PROMPT)
    # penalties off (the GGUF defaults 0.9 / 1.05 are on): the plain greedy loop; the loop with
    # penalties is in test_sampler.py
    ids, st = model.generate_tokens(prompt, max_tokens=12, mode="ar", presence_penalty=0.0, repeat_penalty=1.0)
    assert ids == _greedy_ar(model, prompt, 12)
    assert st["mode"] == "ar" and st["tokens"] == ids
    assert st["n_prompt"] == len(prompt) and st["n_generated"] == len(ids)
    assert st["n_forward_prefill"] == 1 and st["n_forward_denoise"] == 0
    assert st["n_forward"] == st["n_forward_prefill"] + st["n_forward_decode"]
    assert st["tokens_per_forward"] == pytest.approx(len(ids) / st["n_forward"])
    if st["finish_reason"] == "length":
        assert len(ids) == 12
    else:
        assert st["finish_reason"] == "stop" and ids[-1] in model.end_ids


def test_generate_diffusion_text_stream_and_stats(model):
    kw = dict(max_tokens=20, block_size=8, threshold=0.3)
    ids, st = model.generate_tokens(model.tokenize(PROMPT), **kw)
    assert st["mode"] == "diffusion"  # the default for a clover GGUF
    assert 1 <= len(ids) <= 20
    assert st["n_forward"] == (st["n_forward_prefill"] + st["n_forward_denoise"]
                               + st["n_forward_commit"] + st["n_forward_decode"])
    assert st["n_forward_denoise"] >= 1 and st["n_blocks"] >= 1
    assert st["seconds"] > 0 and st["tokens_per_second"] > 0
    assert st["finish_reason"] in ("stop", "length")
    if st["finish_reason"] == "length":
        assert len(ids) == 20
    text = model.generate(PROMPT, **kw)
    body = [t for t in ids if t not in model.end_ids]
    assert text == model.detokenize(body)  # deterministic (greedy) and end token dropped
    assert model.last_stats["tokens"] == ids
    pieces = list(model.generate_stream(PROMPT, **kw))
    assert "".join(pieces) == text
    assert all(pieces)  # no empty pieces
    # at most one piece per forward (plus a flushed tail)
    assert len(pieces) <= st["n_forward_denoise"] + st["n_blocks"] + 1


def test_diffusion_streams_final_tokens_before_the_block_ends(model):
    """Filled slots are final (spec 5.2), so a step hands out the newly filled slots contiguous
    with the block's final start as soon as they are filled: with one slot filled per pass
    (threshold 1.0), blocks of 8 arrive in several pieces, and the pieces concatenate to the
    block-at-once result of the same decoding (the tokens are those of full blocks, in order)."""
    p, _, mode, _ = model._params(GenerateOptions(max_tokens=24, mode="diffusion", block_size=8, threshold=1.0), [])
    steps = [new for new, _ in model._steps(model.tokenize(PROMPT), p, mode)]
    st = model.last_stats
    assert sum(len(x) for x in steps) == st["n_generated"] == 24
    assert st["n_blocks"] == 3 and len(steps) > st["n_blocks"]  # pieces smaller than blocks
    assert all(len(x) <= 8 for x in steps)
    ids, _ = model.generate_tokens(model.tokenize(PROMPT), max_tokens=24, block_size=8, threshold=1.0, end_ids=[])
    assert [t for x in steps for t in x] == ids


def test_generate_accepts_token_ids_and_threshold_changes_forwards(model):
    prompt = model.tokenize(PROMPT)
    a = model.generate(prompt, max_tokens=16, block_size=8, threshold=1.0)
    st_strict = dict(model.last_stats)
    b = model.generate(PROMPT, max_tokens=16, block_size=8, threshold=1.0)
    assert a == b
    model.generate(prompt, max_tokens=16, block_size=8, threshold=1e-6)
    st_loose = model.last_stats
    # threshold 1.0 (strict >) fills one slot per denoising step; a tiny threshold fills
    # every masked slot at once
    if st_strict["finish_reason"] == "length" and st_loose["finish_reason"] == "length":
        assert st_loose["n_forward_denoise"] < st_strict["n_forward_denoise"]
        assert st_loose["n_forward_denoise"] == st_loose["n_blocks"]


def test_seeded_sampling_is_reproducible(model):
    kw = dict(max_tokens=10, mode="ar", temperature=0.9, top_k=50, top_p=0.95)
    a, _ = model.generate_tokens(model.tokenize(PROMPT), seed=7, **kw)
    b, _ = model.generate_tokens(model.tokenize(PROMPT), seed=7, **kw)
    assert a == b
    runs = {tuple(model.generate_tokens(model.tokenize(PROMPT), seed=s, **kw)[0]) for s in range(4)}
    assert len(runs) > 1  # the seed matters


def test_sampling_defaults_and_logit_bias_forms(model):
    """None takes clover_gen_params_default (the GGUF's penalties and ramp starts); logit_bias
    accepts OpenAI's string keys; the ramps use the vocabulary's <think> / </think>."""
    hp = model.hparams
    p, _keep, _, _ = model._params(GenerateOptions(max_tokens=4, mode="ar"))
    assert p.presence_penalty == pytest.approx(hp["presence_penalty"])
    assert p.repetition_penalty == pytest.approx(hp["repetition_penalty"])
    assert p.think_close_bias_start == hp["think_close_bias_start"] and p.eos_bias_start == hp["eos_bias_start"]
    assert p.min_p == 0 and p.frequency_penalty == 0 and p.n_logit_bias == 0
    assert p.bias_slope == pytest.approx(0.01) and p.bias_max == pytest.approx(10.0)
    assert p.think_open_id == model.tokenizer.token_to_id("<think>")
    assert p.think_close_id == model.tokenizer.token_to_id("</think>")
    prompt = model.tokenize(PROMPT)
    a, _ = model.generate_tokens(prompt, max_tokens=4, mode="ar", logit_bias={7: 60.0})
    b, _ = model.generate_tokens(prompt, max_tokens=4, mode="ar", logit_bias={"7": 60.0})
    assert a == b and a[0] == 7


def test_block_logits(model):
    hp = model.hparams
    mask = hp["mask_token_id"]
    prefix = model.tokenize(PROMPT)
    block = [mask] * 8
    block[0] = prefix[-1]
    logits, nexp = model.block_logits(prefix, block)
    assert logits.dtype == np.float32 and logits.shape == (8, model.n_vocab)
    assert np.isfinite(logits).all()
    assert len(nexp) == hp["n_layer"]
    assert all(hp["n_expert_used"] <= n <= hp["n_expert"] for n in nexp)
    again, nexp2 = model.block_logits(prefix, block, coreset_top_p=1.0)
    np.testing.assert_array_equal(again, logits)  # default is normal routing (top-p 1)
    assert nexp2 == nexp
    small, nexp_small = model.block_logits(prefix, block, coreset_top_p=0.3)
    # the coreset C has m <= |union of normal routing| experts and every row picks inside C
    assert all(hp["n_expert_used"] <= a <= b for a, b in zip(nexp_small, nexp))
    # the block pass leaves the caches as they were: prefix logits are unaffected
    np.testing.assert_allclose(model.prefix_logits(prefix)[-1], model.prefix_logits(prefix)[-1])


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(block_size=0), "block_size"),
        (dict(threshold=0.0), "threshold"),
        (dict(threshold=1.1), "threshold"),
        (dict(coreset_top_p=0.0), "coreset_top_p"),
        (dict(mode="beam"), "mode"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(presence_penalty=1e39), "presence_penalty"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty"),
        (dict(logit_bias=[1, 2]), "logit_bias"),
        (dict(logit_bias={10**9: 1.0}), "logit_bias"),
        (dict(logit_bias={-1: 1.0}), "logit_bias"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), r"logit_bias\[3\]"),
        (dict(think_close_bias_start=-1), "think_close_bias_start"),
        (dict(eos_bias_start=1.5), "eos_bias_start"),
        (dict(bias_slope=-0.5), "bias_slope"),
        (dict(bias_max=float("nan")), "bias_max"),
    ],
)
def test_argument_errors_name_the_field(model, kw, field):
    with pytest.raises(ValueError, match=field):
        model.generate(PROMPT, **kw)
    with pytest.raises(ValueError, match=field):
        model.generate_stream(PROMPT, **kw)  # validated before the first piece


def test_token_and_prompt_errors(model):
    with pytest.raises(ValueError, match="prompt"):
        model.generate("")
    with pytest.raises(ValueError, match=r"prompt_ids\[1\]"):
        model.generate_tokens([1, model.n_vocab])
    with pytest.raises(ValueError, match="ids"):
        model.prefix_logits([])
    with pytest.raises(ValueError, match="ids"):
        model.detokenize([-1])
    with pytest.raises(ValueError, match="block_ids"):
        model.block_logits([1, 2], [])
    with pytest.raises(ValueError, match="coreset_top_p"):
        model.block_logits([1, 2], [3], coreset_top_p=2.0)
    with pytest.raises(ValueError, match="n_ctx"):
        model.prefix_logits([1] * (model.n_ctx + 1))
    with pytest.raises(ValueError, match="n_ctx"):
        Model("whatever.gguf", n_ctx=-1)
    with pytest.raises(ValueError, match="n_threads"):
        Model("whatever.gguf", n_threads=-2)


def test_load_errors_are_clover_errors(tmp_path, gguf_path):
    with pytest.raises(CloverError, match="missing.gguf"):
        Model(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(CloverError):
        Model(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(gguf_path.read_bytes()[: 1 << 16])
    with pytest.raises(CloverError):
        Model(trunc)
    assert issubclass(CloverError, RuntimeError)


def test_unfinished_stream_is_invalidated_not_corrupting(model, gguf_path):
    kw = dict(max_tokens=8, mode="ar")
    want = model.generate(PROMPT, **kw)
    it = model.generate_stream(PROMPT, **kw)
    first = next(it)
    assert want.startswith(first)
    # another call resets the shared context: the old iterator must not continue silently
    assert model.generate(PROMPT, **kw) == want
    with pytest.raises(CloverError, match="interrupted"):
        next(it)
    # closing a model under an open iterator frees the decoder first; resuming raises
    m = Model(gguf_path, n_ctx=64, n_threads=1)
    it = m.generate_stream(PROMPT, **kw)
    next(it)
    m.close()
    with pytest.raises(CloverError):
        next(it)


def test_close_and_context_manager(gguf_path):
    m = Model(gguf_path, n_ctx=64, n_threads=1)
    with m:
        assert len(m.prefix_logits([1, 2, 3])) == 3
    with pytest.raises(CloverError, match="closed"):
        m.prefix_logits([1, 2, 3])
    m.close()  # idempotent


def test_parent_arch_defaults_to_ar(parent_gguf, model):
    with Model(parent_gguf, n_ctx=256, n_threads=N_THREADS) as p:
        assert p.arch == "qwen35moe" and p.hparams["has_block"] is False and p.hparams["penalty_scope"] == "all"
        ids, st = p.generate_tokens(p.tokenize(PROMPT), max_tokens=6)
        assert st["mode"] == "ar"
        # the parent GGUF is the Clover file minus the Clover-only tensors: same AR output
        ids_clover, _ = model.generate_tokens(model.tokenize(PROMPT), max_tokens=6, mode="ar")
        assert ids == ids_clover
        with pytest.raises(ValueError, match="mode"):
            p.generate(PROMPT, mode="diffusion")
        with pytest.raises(ValueError, match="needs a Clover model .this file is qwen35moe"):
            p.block_logits([1], [2])


def test_parent_arch_samples_every_token_as_llama_cpp(parent_gguf, tmp_path):
    """A qwen35moe file whose tokenizer names a mask token (llama.cpp's converter writes
    tokenizer.ggml.mask_token_id) has no mask: ar may emit that token, as llama.cpp does."""
    from gguf import GGUFValueType

    from conftest import rewrite_gguf

    mask = 7
    path = rewrite_gguf(parent_gguf, tmp_path / "parent-mask.gguf",
                        kv={"tokenizer.ggml.mask_token_id": (mask, GGUFValueType.UINT32)})
    with Model(path, n_ctx=256, n_threads=N_THREADS) as p:
        assert p.hparams["mask_token_id"] == -1
        ids, _ = p.generate_tokens(p.tokenize(PROMPT), max_tokens=3, logit_bias={mask: 100.0}, end_ids=[])
        assert ids == [mask] * 3


def test_header_and_library_of_different_builds_are_refused(tmp_path):
    """A library whose struct sizes differ from the clover.h next to it (a stale install, a
    build of other sources) is refused at import with an ImportError naming the struct, instead
    of corrupting memory through mismatched structs."""
    import shutil
    import subprocess
    import sys

    from clover_gguf import _ffi

    lib = tmp_path / pathlib.Path(_ffi._LIB_PATH).name
    shutil.copy(_ffi._LIB_PATH, lib)
    header = pathlib.Path(_ffi.__file__).resolve().parents[1] / "native" / "include" / "clover.h"
    if not header.is_file():
        header = pathlib.Path(_ffi._LIB_PATH).resolve().parent / "clover.h"
    text = header.read_text()
    assert "} clover_hparams;" in text
    (tmp_path / "clover.h").write_text(text.replace("} clover_hparams;", "    int32_t added_field;\n} clover_hparams;"))
    env = dict(os.environ, CLOVER_LIB=str(lib))
    r = subprocess.run([sys.executable, "-c", "import clover_gguf._ffi"], env=env, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and "clover_hparams" in r.stderr and "rebuild or reinstall" in r.stderr
    (tmp_path / "clover.h").write_text(text)  # the matching header loads
    r = subprocess.run([sys.executable, "-c", "import clover_gguf._ffi"], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("arch", ["qwen35moe", None])
def test_mtp_layers_are_loaded_and_not_run(make_gguf, arch):
    """A file with llama.cpp-style MTP (NextN) blocks after the trunk (spec 4.3) loads; the engine
    runs the trunk only (n_layer = block_count - nextn_predict_layers), so its logits equal those
    of the same checkpoint converted without MTP, bit for bit."""
    clover = arch is None
    with_mtp = make_gguf("f32", arch=arch, clover=clover, mtp=1)
    without = make_gguf("f32", arch=arch, clover=clover)
    ids = [5, 17, 300, 42, 1000, 7, 7, 99]
    with Model(with_mtp, n_ctx=64, n_threads=2) as a, Model(without, n_ctx=64, n_threads=2) as b:
        assert a.hparams["n_layer_nextn"] == 1 and b.hparams["n_layer_nextn"] == 0
        assert a.hparams["n_layer"] == b.hparams["n_layer"]
        np.testing.assert_array_equal(a.prefix_logits(ids), b.prefix_logits(ids))
        if clover:
            la, _ = a.block_logits(ids[:3], [a.hparams["mask_token_id"]] * 8)
            lb, _ = b.block_logits(ids[:3], [b.hparams["mask_token_id"]] * 8)
            np.testing.assert_array_equal(la, lb)
