"""Embeddings (clover_embed, Model.embed) against transformers 5.23's Qwen3_5MoeForCausalLM.

Oracle: the parent's ``model.model(ids).last_hidden_state``, the hidden state after the final
norm, on a random parent checkpoint and its GGUF (the converter's); pooled here (mean of the
rows, the last row) for MEAN and LAST.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402

from clover_gguf.model import Model  # noqa: E402

# Gains lowered as in tests/oracles/test_reference.py's transformers comparison (wide router
# margins amplify fp32 rounding of either implementation); the same architecture at any scale.
OPTS = dict(clover=False, lm_head_gain=2.0, router_gain=4.0)


@pytest.fixture(scope="module")
def parent(make_ckpt, make_gguf):
    d = make_ckpt(**OPTS)
    cfg = json.loads((d / "config.json").read_text())
    hf = Qwen3_5MoeForCausalLM.from_pretrained(str(d), config=Qwen3_5MoeTextConfig(**cfg.get("text_config", cfg)),
                                               dtype=torch.float32).eval()
    with Model(str(make_gguf("f32", **OPTS)), n_ctx=256, n_threads=2) as m:
        yield hf, m


def test_hidden_state_matches_transformers_last_hidden_state(parent):
    hf, m = parent
    assert m.arch == "qwen35moe"
    tokens = np.random.default_rng(11).integers(0, 2000, 37).tolist()
    with torch.no_grad():
        want = hf.model(torch.tensor([tokens])).last_hidden_state[0].double().numpy()
    scale = float(np.abs(want).max())
    got = {p: m.embed(tokens, pooling=p).astype(np.float64) for p in ("none", "mean", "last")}
    assert got["none"].shape == (37, m.n_embd) and got["mean"].shape == got["last"].shape == (m.n_embd,)
    for p, ref in (("none", want), ("mean", want.mean(0)), ("last", want[-1])):
        diff = float(np.abs(got[p] - ref).max())
        print(f"\n[{p}] max |hidden diff| = {diff:.3e} (max |hidden| {scale:.2f})")
        assert diff <= 1e-5 * scale, p
    # the default of a GGUF without {arch}.pooling_type: last
    assert m.pooling == "last" and np.array_equal(m.embed(tokens), got["last"].astype(np.float32))
