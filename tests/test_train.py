"""The training script of the embedded model (bench/train/train_tiny.py).

- its batched training forward equals clover_gguf.reference (logits and gradients, prefix
  mode and block mode with the backward GDN branch), so training and inference share one
  definition;
- a short run (a few steps, small vocabulary) goes through data, tokenizer, training,
  evaluation, HF export and ``convert`` to Q8_0, and the engine runs the result.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

_SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "bench" / "train" / "train_tiny.py"


@pytest.fixture(scope="module")
def tt():
    spec = importlib.util.spec_from_file_location("train_tiny", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _random_model(tt, seed=0):
    """Small vocab, non-trivial norms and mix (the initial values are 0 or 1)."""
    cfg = tt.model_config(300, 299, 294, block_size=8)
    P = tt.init_params(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for n in P:
        if n.endswith(("norm.weight", "layernorm.weight", "bwd_mix")):
            P[n] = P[n] + 0.2 * torch.randn(P[n].shape, generator=g)
    P["lm_head.weight"] = P["lm_head.weight"] * 5
    return cfg, P


def _batch(tt, N=2, T=24, B=8, seed=3):
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, 290, (N, T), generator=g)
    noisy, m, _ = tt.mask_blocks(tok, B, 299, g)
    return tok, noisy, m


def test_train_forward_equals_reference(tt):
    cfg, P = _random_model(tt)
    fw = tt.TrainForward(P, cfg)
    tok, noisy, _ = _batch(tt)
    B = 8
    with torch.no_grad():
        hc, hn, _ = fw.hidden(tok, noisy, B)
        lc, ln = fw.logits(hc), fw.logits(hn)
        lc_ar = fw.logits(fw.hidden(tok)[0])   # prefix mode alone (chunk 64 instead of B)
    ref = tt.to_reference(P, cfg)
    assert torch.allclose(lc_ar, lc, atol=1e-4)
    for n in range(tok.shape[0]):
        assert torch.allclose(ref.prefix_logits(tok[n].tolist()), lc[n], atol=1e-4)
        for b in range(tok.shape[1] // B):
            rl, _ = ref.block_logits(tok[n, :b * B].tolist(), noisy[n, b * B:(b + 1) * B].tolist(),
                                     coreset_top_p=None)
            assert torch.allclose(rl, ln[n, b * B:(b + 1) * B], atol=1e-4), (n, b)


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 1.0])
def test_train_forward_coreset_equals_reference(tt, top_p):
    """Stage 4 trains the noisy blocks with coreset routing (spec 5.6) as decoding runs them:
    the block logits equal the reference's block_logits with the same top_p."""
    cfg, P = _random_model(tt, seed=2)
    fw = tt.TrainForward(P, cfg)
    tok, noisy, _ = _batch(tt, seed=4)
    B = 8
    with torch.no_grad():
        hc, hn, _ = fw.hidden(tok, noisy, B, coreset_top_p=top_p)
        ln, lc = fw.logits(hn), fw.logits(hc)
        hc0, hn0, _ = fw.hidden(tok, noisy, B)
        ln0 = fw.logits(hn0)
    assert torch.allclose(lc, fw.logits(hc0), atol=1e-5)  # the clean (prefix-mode) rows keep plain top-k
    ref = tt.to_reference(P, cfg)
    n_differ = 0
    for n in range(tok.shape[0]):
        for b in range(tok.shape[1] // B):
            rl, _ = ref.block_logits(tok[n, :b * B].tolist(), noisy[n, b * B:(b + 1) * B].tolist(),
                                     coreset_top_p=top_p)
            assert torch.allclose(rl, ln[n, b * B:(b + 1) * B], atol=1e-4), (n, b)
            n_differ += not torch.allclose(ln[n, b * B:(b + 1) * B], ln0[n, b * B:(b + 1) * B], atol=1e-4)
    assert (n_differ > 0) == (top_p < 1.0), n_differ  # the restriction bites below 1 on these blocks


def test_train_gradients_equal_reference(tt):
    """The reference's own forward is differentiable and gives the same gradients."""
    from clover_gguf.reference import CloverReference, ReferenceConfig

    cfg, P0 = _random_model(tt, seed=5)
    tok, noisy, _ = _batch(tt, N=1, T=16, seed=7)
    B = 8
    wc = torch.randn(16, 300, generator=torch.Generator().manual_seed(9))

    P = {n: t.clone().requires_grad_() for n, t in P0.items()}
    fw = tt.TrainForward(P, cfg)
    hc, hn, _ = fw.hidden(tok, noisy, B)
    ((fw.logits(hc[0]) * wc).sum() + (fw.logits(hn[0]) * wc.flip(0)).sum()).backward()

    R = {n: t.clone().requires_grad_() for n, t in P0.items()}
    ref = CloverReference(ReferenceConfig.from_hf(cfg), R)
    loss = (ref.forward_prefix(ref.new_state(), tok[0].tolist()) * wc).sum()
    blocks = []
    for b in range(2):
        st = ref.new_state()
        ref.forward_prefix(st, tok[0, :b * B].tolist())
        blocks.append(ref.forward_block(st, noisy[0, b * B:(b + 1) * B].tolist(), coreset_top_p=None)[0])
    (loss + (torch.cat(blocks) * wc.flip(0)).sum()).backward()
    for n in P:
        assert R[n].grad is not None, n
        torch.testing.assert_close(P[n].grad, R[n].grad, rtol=1e-3, atol=1e-4, msg=n)


def test_mask_blocks(tt):
    g = torch.Generator().manual_seed(0)
    tok = torch.arange(2 * 64).reshape(2, 64) % 290
    noisy, m, sel = tt.mask_blocks(tok, 16, 299, g)
    mb = m.reshape(2, 4, 16)
    assert not mb[..., 0].any() and mb[..., 1:].any(-1).all() and (sel == m).all()
    assert ((noisy == 299) == m).all() and (noisy[~m] == tok[~m]).all()
    # Cut blocks: a clean prefix, masks after it, loss on the first `near` masked slots.
    noisy, m, sel = tt.mask_blocks(tok, 16, 299, g, p_cut=1.0, near=4)
    for row_m, row_s in zip(m.reshape(-1, 16), sel.reshape(-1, 16)):
        c = int(row_m.int().argmax())
        assert c >= 1 and row_m[c:].all() and not row_m[:c].any()
        assert row_s.nonzero().flatten().tolist() == list(range(c, min(c + 4, 16)))


def test_heldout_split_is_deterministic(tt):
    files = tt.stdlib_files()
    assert len(files) > 50
    rels = [f.name for f in files]
    assert [tt.is_heldout(r) for r in rels] == [tt.is_heldout(r) for r in rels]
    assert any(tt.is_heldout(r) for r in rels) and not all(tt.is_heldout(r) for r in rels)
    assert not any("site-packages" in str(f) or "/test/" in str(f) for f in files)


def test_short_training_run(tt, tmp_path):
    rep = tt.train(tmp_path, tt.SMOKE, smoke=True, log=lambda m: None)
    assert rep["trained"]["ar_loss"] < rep["random_init"]["ar_loss"]
    assert rep["trained"]["diffusion_loss"] < rep["random_init"]["diffusion_loss"] + 0.5
    rows = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    n_steps = tt.SMOKE["steps"] + tt.SMOKE["stage2_steps"] + tt.SMOKE["stage4_steps"] * tt.SMOKE["stage4_rounds"]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, n_steps + 1))
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["CloverForDiffusionLM"] and cfg["logits_shift"] is True
    gguf_path = tmp_path / "clover-tiny-q8_0.gguf"
    assert gguf_path.stat().st_size == rep["gguf"]["bytes"]

    from clover_gguf import Model
    with Model(gguf_path, n_ctx=256, n_threads=1) as m:
        assert m.is_clover and m.n_vocab == tt.SMOKE["vocab"]
        assert m.hparams["block_size"] == tt.SMOKE["block"]
        ids = m.tokenize("def f(x):")
        # The Q8_0 engine agrees with the float reference on the trained weights.
        ref = tt.to_reference(torch.load(tmp_path / "ckpt.pt")["params"], cfg)
        want = ref.prefix_logits(ids).numpy()
        got = m.prefix_logits(ids)
        assert abs(got - want).max() < 0.05 * abs(want).max() + 0.02
        toks, st = m.generate_tokens(ids, max_tokens=8, mode="diffusion", end_ids=[])
        assert len(toks) == 8 and st["n_forward"] >= 1
        # Stage 4's data: a real prompt of a multiple of B tokens, then the engine's greedy ar
        # continuation without penalties, to T tokens.
        stream = torch.arange(1000) % 200 + 7
        win, plen = tt.distill_windows(gguf_path, stream, 3, 64, 16, seed=5, log=lambda msg: None)
        assert win.shape == (3, 64) and set(plen.tolist()) <= {16, 32}
        for w, P in zip(win.tolist(), plen.tolist()):
            assert w[0] >= 7 and w[:P] == [(w[0] - 7 + i) % 200 + 7 for i in range(P)]
            cont, _ = m.generate_tokens(w[:P], max_tokens=64 - P, mode="ar", presence_penalty=0.0,
                                        repeat_penalty=1.0, end_ids=[])
            assert w[P:] == cont
    assert (tmp_path / "distill-source-q8_0.gguf").is_file()
