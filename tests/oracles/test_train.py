"""The training script of the embedded model (bench/train/train_tiny.py).

- its batched training forward equals reference.model (logits and gradients, prefix
  mode and block mode with the block operator of spec 3.3), so training and inference share
  one definition; its diffusion loss reads each masked slot's own row (spec 3.5, in place);
- a short run (a few steps, small vocabulary) goes through data, tokenizer, training,
  evaluation, HF export and ``convert`` to a complete ``clover_moe`` Q8_0 GGUF, and the engine
  runs the result (its logits against the reference's);
- ``--init-gguf``: the embedded model's trunk read back from its GGUF predicts held-out text
  as it did, and a short fine-tuning run from it gives a GGUF that runs in every mode.
"""
from __future__ import annotations

import importlib.util
import json
import pathlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

_SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "train" / "train_tiny.py"


@pytest.fixture(scope="module")
def tt():
    spec = importlib.util.spec_from_file_location("train_tiny", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _random_model(tt, seed=0):
    """Small vocab; norms and the block softmax's parameters (constant at initialisation)
    randomised, so every parameter differs per channel or head."""
    cfg = tt.model_config(300, 299, 294, block_size=8)
    P = tt.init_params(cfg, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for n in P:
        if n.endswith(("norm.weight", "layernorm.weight", "bd_softmax_logit_scale", "bd_softmax_history_bias",
                       "bd_softmax_history_c")):
            P[n] = P[n] + 0.3 * torch.randn(P[n].shape, generator=g)
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
    from reference.model import CloverReference

    cfg, P0 = _random_model(tt, seed=5)
    tok, noisy, _ = _batch(tt, N=1, T=16, seed=7)
    B = 8
    wc = torch.randn(16, 300, generator=torch.Generator().manual_seed(9))

    P = {n: t.clone().requires_grad_() for n, t in P0.items()}
    fw = tt.TrainForward(P, cfg)
    hc, hn, _ = fw.hidden(tok, noisy, B)
    ((fw.logits(hc[0]) * wc).sum() + (fw.logits(hn[0]) * wc.flip(0)).sum()).backward()

    R = {n: t.clone().requires_grad_() for n, t in P0.items()}
    ref = CloverReference(tt.reference_config(cfg), R)
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
    tok = torch.arange(8 * 64).reshape(8, 64) % 290
    noisy, m, sel = tt.mask_blocks(tok, 16, 299, g)
    mb = m.reshape(8, 4, 16)
    assert mb.any(-1).all() and (sel == m).all()
    assert mb[..., 0].any() and not mb[..., 0].all()          # slot 0 is masked like any other
    assert ((noisy == 299) == m).all() and (noisy[~m] == tok[~m]).all()
    full = tt.mask_blocks(tok, 16, 299, g, t=1.0)[1]
    assert full.all()
    # Cut blocks: a clean prefix of c in 0..B-1 slots, masks after it, loss on the first
    # `near` masked slots (c = 0: a block's first pass; c > 0: filled slots or a prompt tail).
    noisy, m, sel = tt.mask_blocks(tok, 16, 299, g, p_cut=1.0, near=4)
    cuts = []
    for row_m, row_s in zip(m.reshape(-1, 16), sel.reshape(-1, 16)):
        c = int(row_m.int().argmax())
        assert row_m[c:].all() and not row_m[:c].any()
        assert row_s.nonzero().flatten().tolist() == list(range(c, min(c + 4, 16)))
        cuts.append(c)
    assert min(cuts) == 0 and max(cuts) >= 12
    _, m2, sel2 = tt.mask_blocks(tok, 16, 299, g, p_cut=1.0, skip=1, near=2)
    for row_m, row_s in zip(m2.reshape(-1, 16), sel2.reshape(-1, 16)):
        c = int(row_m.int().argmax())
        assert row_s.nonzero().flatten().tolist() == ([c + 1] if c + 1 < 16 else [])


def test_diffusion_loss_reads_each_slot_in_place(tt):
    """Spec 3.5 (shift_logits = false): the diffusion loss is the cross-entropy of every
    selected masked slot j on the reference's block row j, blocks aligned at multiples of B."""
    cfg, P = _random_model(tt, seed=11)
    fw = tt.TrainForward(P, cfg)
    tok = torch.randint(0, 290, (2, 24), generator=torch.Generator().manual_seed(12))
    B = 8
    for cut in ({}, {"p_cut": 1.0, "near": 3}):
        with torch.no_grad():
            _, dl, _ = tt.losses(fw, tok, B, 299, torch.Generator().manual_seed(13), **cut)
        noisy, m, sel = tt.mask_blocks(tok, B, 299, torch.Generator().manual_seed(13), **cut)
        ref = tt.to_reference(P, cfg)
        nll = []
        for n in range(2):
            for b in range(3):
                rows, _ = ref.block_logits(tok[n, :b * B].tolist(), noisy[n, b * B:(b + 1) * B].tolist(), None)
                for j in sel[n, b * B:(b + 1) * B].nonzero().flatten().tolist():
                    nll.append(-torch.log_softmax(rows[j], -1)[tok[n, b * B + j]])
        assert abs(dl.item() - torch.stack(nll).mean().item()) < 1e-4, cut
    # ar_rows: the ar loss over the chosen windows only
    with torch.no_grad():
        ar1, _, _ = tt.losses(fw, tok, B, 299, torch.Generator().manual_seed(13), ar_rows=torch.tensor([False, True]))
        want = torch.nn.functional.cross_entropy(fw.logits(fw.hidden(tok[1:])[0])[0, :-1], tok[1, 1:])
    assert abs(ar1.item() - want.item()) < 1e-5


def test_heldout_split_is_deterministic(tt):
    files = tt.stdlib_files()
    assert len(files) > 50
    rels = [f.name for f in files]
    assert [tt.is_heldout(r) for r in rels] == [tt.is_heldout(r) for r in rels]
    assert any(tt.is_heldout(r) for r in rels) and not all(tt.is_heldout(r) for r in rels)
    assert not any("site-packages" in str(f) or "/test/" in str(f) for f in files)


RECORD_KEYS = ("mask_token_id", "block_size", "threshold", "moe_block_coreset_top_p", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "think_close_bias_start", "eos_bias_start")


def _engine_agrees(tt, m, P, cfg, ids):
    """The Q8_0 engine against the float reference on the trained weights: prefix logits, and
    block logits of an aligned first block (prompt tail fixed, the rest masked)."""
    ref = tt.to_reference(P, cfg)
    want = ref.prefix_logits(ids).numpy()
    assert abs(m.prefix_logits(ids) - want).max() < 0.05 * abs(want).max() + 0.02
    B, mask = cfg["block_size"], cfg["mask_token_id"]
    block = ids[:B] + [mask] * max(0, B - len(ids))
    want, _ = ref.block_logits([], block, 0.9)
    got, _ = m.block_logits([], block, 0.9)
    assert abs(got - want.numpy()).max() < 0.1 * abs(want).max().item() + 0.02


def test_short_training_run(tt, tmp_path):
    rep = tt.train(tmp_path, tt.SMOKE, smoke=True, log=lambda m: None)
    assert rep["trained"]["ar_loss"] < rep["random_init"]["ar_loss"]
    assert rep["trained"]["diffusion_loss"] < rep["random_init"]["diffusion_loss"] + 0.5
    rows = [json.loads(l) for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    n_steps = tt.SMOKE["steps"] + tt.SMOKE["stage2_steps"] + tt.SMOKE["stage4_steps"] * tt.SMOKE["stage4_rounds"]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, n_steps + 1))
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["architectures"] == ["CloverMoeModelLM"] and cfg["model_type"] == "clover_moe"
    assert cfg["num_shared_experts"] == 1 and all(k in cfg for k in RECORD_KEYS)
    gguf_path = tmp_path / "clover-tiny-q8_0.gguf"
    assert gguf_path.stat().st_size == rep["gguf"]["bytes"]

    from clover_gguf import Model
    with Model(gguf_path, n_ctx=256, n_threads=1) as m:
        assert m.arch == "clover_moe" and m.has_block and m.n_vocab == tt.SMOKE["vocab"]
        assert m.hparams["block_size"] == tt.SMOKE["block"]
        assert not m.hparams["shift_logits"] and m.hparams["block_aligned"]     # spec 4.2 defaults
        ids = m.tokenize("def f(x):")
        _engine_agrees(tt, m, torch.load(tmp_path / "ckpt.pt")["params"], cfg, ids)
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
        # --stage4-source diffusion: the block decoder's own continuations
        win, plen = tt.distill_windows(gguf_path, stream, 2, 64, 16, seed=6, log=lambda msg: None, mode="diffusion")
        for w, P in zip(win.tolist(), plen.tolist()):
            cont, _ = m.generate_tokens(w[:P], max_tokens=64 - P, mode="diffusion", presence_penalty=0.0,
                                        repeat_penalty=1.0, end_ids=[])
            assert w[P:] == cont
    assert (tmp_path / "distill-source-q8_0.gguf").is_file()


_SHIPPED = pathlib.Path(__file__).resolve().parents[2] / "clover_gguf" / "models" / "clover-tiny-q8_0.gguf"


@pytest.fixture(scope="module")
def shipped_trunk(tt):
    if not _SHIPPED.is_file():
        pytest.skip(f"{_SHIPPED} not present")
    pytest.importorskip("gguf")
    s = dict(tt.FINETUNE, init_gguf=str(_SHIPPED))
    tok, cfg, P = tt.initial_model(s, [], smoke=False)
    return tok, cfg, P


def test_trunk_from_gguf(tt, shipped_trunk):
    """--init-gguf: the embedded model's trunk and block tensors, the converter's transforms
    undone (spec 4.3), predict held-out text as well as the model did (ar loss 2.49 nats on
    48 windows when it was trained; random init 7.06), and the rebuilt tokenizer has the
    GGUF's ids."""
    from gguf import GGUFReader

    tok, cfg, P = shipped_trunk
    r = GGUFReader(str(_SHIPPED))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert tok.get_vocab(with_added_tokens=True) == {t: i for i, t in enumerate(tokens)}
    assert tok.token_to_id("<|mask|>") == cfg["mask_token_id"]
    assert tok.decode(tok.encode("def f(x):\n    return x  # ü").ids) == "def f(x):\n    return x  # ü"
    want = {n: tuple(shape) for n, shape, _ in tt.param_specs(cfg, clover=True, fused_experts=True)}
    assert {n: tuple(t.shape) for n, t in P.items()} == want
    # block tensors (F32 in the file) come from the file, not from init_block_params (c = 1):
    # the same values per layer, in Hugging Face's head order (the converter permutes V heads)
    gg = {t.name: np.asarray(t.data) for t in r.tensors}
    for n, t in P.items():
        if n.endswith("bd_softmax_history_c"):
            li = int(n.split("layers.")[1].split(".")[0])
            np.testing.assert_array_equal(np.sort(t.numpy()), np.sort(gg[f"blk.{li}.bd_history_c"].reshape(-1)))
            assert (t != 1).all()
        if n.endswith("conv_right_weight"):
            assert t.any()
    _, ho, _, _ = tt.load_texts()
    held = tt.encode_stream(tok, ho[:12])
    fw = tt.TrainForward(P, cfg)
    with torch.no_grad():
        ar, _, _ = tt.losses(fw, tt.eval_windows(held, 128, 8), 32, cfg["mask_token_id"],
                             torch.Generator().manual_seed(0), diffusion=False)
    assert ar.item() < 3.2, ar.item()


def test_finetune_from_gguf(tt, tmp_path):
    """The fine-tuning path end to end: the shipped trunk, a few steps of the real-text stage,
    export to a complete clover_moe GGUF that the engine runs in every mode."""
    if not _SHIPPED.is_file():
        pytest.skip(f"{_SHIPPED} not present")
    s = dict(tt.SMOKE, init_gguf=str(_SHIPPED), steps=0, stage2_steps=0, stage3_steps=2, stage3_warmup=1,
             stage4_steps=0, start_stage=1)
    rep = tt.train(tmp_path, s, smoke=True, log=lambda m: None)
    assert rep["settings"]["vocab"] == 1024 and rep["config"]["num_experts"] == 8
    assert rep["evals"][0]["ar_loss"] < rep["random_init"]["ar_loss"] - 2     # a trained trunk from step 0
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    from clover_gguf import Model
    with Model(tmp_path / "clover-tiny-q8_0.gguf", n_ctx=256, n_threads=1) as m:
        assert m.has_block and m.n_vocab == 1024
        ids = m.tokenize("class Config:\n    def __init__(self")
        _engine_agrees(tt, m, torch.load(tmp_path / "ckpt.pt")["params"], cfg, ids)
        ar, _ = m.generate_tokens(ids, max_tokens=12, mode="ar", end_ids=[], presence_penalty=0.0,
                                  repeat_penalty=1.0)
        sp, _ = m.generate_tokens(ids, max_tokens=12, mode="spec", end_ids=[], presence_penalty=0.0,
                                  repeat_penalty=1.0)
        assert sp == ar
        dt, _ = m.generate_tokens(ids, max_tokens=12, mode="diffusion", end_ids=[])
        assert len(dt) == 12
