#!/usr/bin/env python3
"""Train the embedded default model: a small Clover (clover-spec v1, sections 1-3) on Python's own sources.

One command, from a clean checkout (torch, tokenizers, safetensors and gguf: ``pip install ".[test]"``)::

    python bench/train/train_tiny.py --out /tmp/clover-tiny-train      # from scratch (stages 1 to 4)
    python bench/train/train_tiny.py --out /tmp/clover-tiny-ft \
        --init-gguf clover_gguf/models/clover-tiny-q8_0.gguf --finetune  # from a shipped trunk
    python bench/train/train_tiny.py --out DIR --smoke                  # seconds: small vocab, a few steps

Data. The ``.py`` files of the running Python's standard library (``sysconfig.get_paths()
["stdlib"]``): present on every machine that runs this package, freely licensed (PSF License
Version 2), real text of one kind (code, comments and docstrings in English), about 10 MB.
Left out: ``site-packages`` (third-party licences), the test suites (``test/``, ``*/tests/``,
``idle_test``: huge, repetitive, generated cases), ``encodings/`` (generated code-page
tables), and files over 400 kB (``pydoc_data/topics.py``: one giant string). The files are
sorted by path; ``crc32(path) % 16 == 0`` (about 6%) is the held-out set, the rest is
training text. Files are joined with ``<|endoftext|>``. The data therefore depends on the
Python version (the committed model: CPython 3.11.7).

Tokenizer. A byte-level BPE like ``tests/reference/checkpoint.py``'s (qwen35 pre-tokenizer regex,
Qwen's added tokens and ``<|mask|>`` after the BPE vocabulary, Qwen3.5 chat template), trained
on the training files only; 1024 tokens (2.6 characters per token on the held-out files).
At this model size the LM head dominates the cost of a token, and short tokens make more of
the text predictable with high confidence (the rest of a word, of an indentation run), which
is what lets threshold decoding fill several slots per pass. With ``--init-gguf`` the
tokenizer is rebuilt from the GGUF's tokens and merges (the same vocabulary, id for id).

Model. Clover's architecture (spec 1-3) with every part present: ``make_checkpoint``'s tiny
text config (hidden 256, 4 layers = 3 Gated DeltaNet + 1 gated attention, 4/2 heads of 64,
GDN 2 key / 4 value heads of 64, 8 experts of 256 with top-2 routing and a shared expert of
256), vocab 1024, and Clover's four block tensors per GDN layer (spec 3.3: the conv's right
taps ``conv_right_weight`` and the block softmax's ``bd_softmax_logit_scale`` (lambda),
``bd_softmax_history_bias`` (beta0), ``bd_softmax_history_c`` (c)): 8.7 M parameters, about
9 MB as Q8_0. The HF checkpoint is ``CloverMoeModelLM`` / ``clover_moe`` with the decoding
record of spec 3.4; ``clover-gguf convert`` makes the complete ``clover_moe`` GGUF of it.

Training. Each step takes ``batch`` windows of ``seq`` tokens from the training stream.
One network, two losses (spec 3.2-3.5):

- ``ar``: next-token cross-entropy of the prefix (causal) mode on every position;
- ``diffusion``: every window is cut into aligned blocks of ``block`` tokens (spec 3.1:
  blocks at multiples of B from the window's start). Slots are replaced by ``<|mask|>`` with
  probability t ~ U(0, 1) drawn per block (at least one masked), and the block runs in block
  mode against the clean prefix of its window: attention rows see the clean prefix plus every
  row of the block; GDN layers run spec 3.3 (the conv over [last K-1 clean inputs | block
  rows] plus right taps over the block rows ahead, zero past the block's end; the block
  softmax over the block rows and the history slot, whose value is the clean state's read
  ``S^T q_i`` and whose logit is ``beta0 + c ln(1 + P)``, P = the clean tokens before the
  block). Each masked slot is predicted by its own row (spec 3.5, ``shift_logits = false``):
  the loss is the cross-entropy of every masked slot j on row j. All blocks of a batch run
  at once: one causal pass over the clean windows gives every block's prefix state (the GDN
  chunk states with chunk = B, i.e. at block boundaries, the attention keys and values), then
  one block-mode pass over all noisy blocks.
- cut blocks (stages 2 on): with probability ``--stageN-cut`` a block is instead cut like a
  block in the middle of threshold decoding: a random c in 0..B-1, slots before c clean (the
  filled slots, or an aligned first block's prompt tail), slots c.. masked, loss on slots
  c..c+near-1 only. c = 0 is a block's first pass. Filling two or more slots per pass needs
  confident predictions two and more tokens ahead of the filled prefix.

Stages. From scratch: stage 1 (``--steps``): the first ``--ar-frac`` of its steps ``ar``
only, the rest ``ar + diffusion``; stage 2 (``--stage2-steps``, fresh optimizer and
schedule): ``ar + diffusion`` with ``--stage2-cut`` of the blocks cut; stage 3
(``--stage3-steps``): the same with more blocks cut and a lower rate; stage 4
(``--stage4-steps`` per round, ``--stage4-rounds`` rounds): self-distillation, the recipe of
consistency distillation for parallel decoders (CLLMs, Kou et al. 2024; dParallel's certainty
forcing, Chen et al. 2025): the model as it stands is exported to Q8_0 and the engine decodes
``--stage4-windows`` greedy ``ar`` continuations (no penalties) of real prompts
(``distill_windows``); each step then trains on ``--stage4-frac`` of such windows (losses on
the continuation only) and the rest real text. The target is then a deterministic function of
the prefix (the model's own greedy choice), so the diffusion rows can learn to be confident
several slots ahead, which threshold decoding needs; the noisy blocks are routed with the
coreset (spec 5.6, the record's ``moe_block_coreset_top_p``) as the decoder routes them.
Each round decodes its data with the model the previous round left. ``--stage4-source
diffusion`` decodes it with the block decoder instead (threshold decoding at the record's
defaults: the text the block decoder itself converges to, as CLLMs train on the fixed points
of their own parallel decoder); the ar loss then covers the real windows only.

Fine-tuning (``--init-gguf FILE``, Clover's own path: a trained trunk plus the new block
parameters, then block-diffusion training): the trunk is read from a GGUF (``read_trunk_gguf``:
dequantised, the converter's transforms undone, tensors the trunk does not need dropped), the
four block tensors start from ``init_block_params`` (right taps 0, so the block conv starts as
the causal one; lambda ln 10, beta0 0, c 1), and ``--finetune`` runs the real-text stage
(stage 3's recipe, ``--stage3-*``) then the distillation rounds. Every stage adds a small
Switch-style load-balancing loss on the routers; AdamW, linear warm-up then cosine decay to
10% in each stage (and round).

Decoding defaults written into the checkpoint: block 32, threshold 0.95, coreset top-p 0.9
(as the card), but no presence or repetition penalty (the card's 0.9 / 1.05 are
``--presence-penalty 0.9 --repetition-penalty 1.05``): stage 4 trains the model toward its
own unpenalised greedy choices, and code repeats its tokens, so penalties lower exactly the
confidences that let a pass fill several slots.

The training forward is a batched restatement of ``reference.model`` (the chunked GDN
form of spec 2.1 step 6, blocks batched): it uses the reference's config class, parameter
names and kernels (``rmsnorm``, ``l2norm``, the N1p norm, the GDN gates), and
tests/oracles/test_train.py checks its logits and gradients against ``CloverReference`` itself.

Outputs under ``--out``: ``hf/`` (the HF checkpoint: config.json with the Clover keys,
tokenizer files, model.safetensors), ``clover-tiny-q8_0.gguf`` (``clover-gguf convert hf
--outtype q8_0``), ``log.jsonl`` (one line per logged step and per evaluation), ``loss.png``
(loss curves), ``report.json`` (settings, timings, held-out losses and perplexities of the
trained model and of the same shape at initialisation), ``ckpt.pt`` (the last evaluated
parameters).
"""
from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import sysconfig
import time
import zlib

_ROOT = pathlib.Path(__file__).resolve().parents[2]
for _p in (_ROOT, _ROOT / "tests"):  # the checkout's clover_gguf; tests/reference as `reference`
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from reference.model import (CloverReference, GatedDeltaNet, ReferenceConfig,  # noqa: E402
                                   RMSNorm1p, coreset_route, l2norm, rmsnorm)
from reference.checkpoint import build_tokenizer, param_specs, text_config  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Data: the standard library's own sources
# ---------------------------------------------------------------------------------------------

_EXCLUDE_PARTS = ("site-packages", "test", "tests", "idle_test", "encodings")
MAX_FILE_BYTES = 400_000
HELDOUT_MOD = 16


def stdlib_files(root=None) -> list[pathlib.Path]:
    """The training/evaluation files (see module docstring), sorted by relative path."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in _EXCLUDE_PARTS for part in rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        if p.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(p)
    return out


def is_heldout(rel: str) -> bool:
    """Deterministic split by path: crc32(relative path) % HELDOUT_MOD == 0."""
    return zlib.crc32(rel.encode()) % HELDOUT_MOD == 0


def load_texts(root=None, limit_bytes=None):
    """Returns (train_texts, heldout_texts, train_names, heldout_names)."""
    root = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    tr, ho, trn, hon = [], [], [], []
    total = 0
    for p in stdlib_files(root):
        rel = p.relative_to(root).as_posix()
        text = p.read_text(encoding="utf-8", errors="replace")
        if is_heldout(rel):
            ho.append(text)
            hon.append(rel)
        else:
            tr.append(text)
            trn.append(rel)
        total += len(text)
        if limit_bytes and total >= limit_bytes and ho and tr:
            break
    return tr, ho, trn, hon


def encode_stream(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one int64 token stream, each followed by <|endoftext|>."""
    eot = tok.token_to_id("<|endoftext|>")
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Model: HF config, initial parameters
# ---------------------------------------------------------------------------------------------

def model_config(vocab_size: int, mask_id: int, eos_id: int, block_size: int, smoke: bool = False,
                 presence_penalty: float = 0.9, repetition_penalty: float = 1.05) -> dict:
    """config.json of the Clover checkpoint (spec 3.4, docs/gguf-layout.md): make_checkpoint's
    tiny text config (hidden 256, 4 layers, 8 experts top-2) with our vocab, the
    ``CloverMoeModelLM`` / ``clover_moe`` names, ``num_shared_experts`` and the decoding record
    (the penalties are the decoding defaults the GGUF carries)."""
    cfg = text_config("tiny")
    cfg["vocab_size"] = int(vocab_size)
    if smoke:  # the test-suite run: the same architecture, fewer experts
        cfg["num_experts"] = 4
    cfg["eos_token_id"] = int(eos_id)
    cfg["dtype"] = "float32"
    cfg.update(model_type="clover_moe", architectures=["CloverMoeModelLM"], num_shared_experts=1)
    cfg.update({
        "mask_token_id": int(mask_id), "block_size": int(block_size), "threshold": 0.95,
        "moe_block_coreset_top_p": 0.9, "presence_penalty": float(presence_penalty),
        "frequency_penalty": 0.0, "repetition_penalty": float(repetition_penalty),
        "think_close_bias_start": 4096, "eos_bias_start": 8192,
    })
    return cfg


# Block tensors at the start of training (spec 3.3): lambda = ln 10 puts the cosine scores in
# [-10, 10] (a CLIP-style temperature); beta0 = 0, c = 1 give the history slot the logit
# ln(1 + P), the total of P prefix keys at score 0, so it weighs as much as the P tokens it stands for.
BD_INIT = {"bd_logit_scale": math.log(10.0), "bd_history_bias": 0.0, "bd_history_c": 1.0}


def init_params(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Initial float32 parameters by prefix-free HF name (the names of make_checkpoint's
    param_specs, fused experts): N(0, 1/fan_in) matrices with the residual-output projections
    scaled by 1/sqrt(2 * layers), zero-centred norms at 0, the GDN gated norm at 1, A_log and
    dt_bias as FLA / Mamba-2 (A ~ U(1, 16), dt ~ logU(1e-3, 1e-1)), both convs N(0, 0.3^2),
    the block softmax's parameters at BD_INIT."""
    g = torch.Generator().manual_seed(seed)
    L = config["num_hidden_layers"]
    out_scale = 1.0 / math.sqrt(2 * L)
    P = {}
    for name, shape, kind in param_specs(config, clover=True, fused_experts=True):
        fan_in = shape[-1]
        if kind in ("linear", "experts_gate_up", "experts_down"):
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std *= out_scale
            t = torch.randn(shape, generator=g) * std
        elif kind == "embed":
            t = torch.randn(shape, generator=g)
        elif kind == "lm_head":
            t = torch.randn(shape, generator=g) * (0.5 / math.sqrt(fan_in))
        elif kind == "router":
            t = torch.randn(shape, generator=g) * (0.1 / math.sqrt(fan_in))
        elif kind == "norm0":
            t = torch.zeros(shape)
        elif kind == "gnorm":
            t = torch.ones(shape)
        elif kind == "conv":
            t = torch.randn(shape, generator=g) * 0.3
        elif kind == "A_log":
            t = torch.log(1.0 + 15.0 * torch.rand(shape, generator=g))
        elif kind == "dt_bias":
            dt = torch.exp(torch.rand(shape, generator=g) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            t = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        elif kind in BD_INIT:
            t = torch.full(shape, BD_INIT[kind])
        else:
            raise ValueError(f"tensor {name}: unknown init kind {kind!r}")
        P[name] = t.float().contiguous()
    return P


def init_block_params(config: dict) -> dict[str, torch.Tensor]:
    """The four block tensors of every GDN layer (spec 3.3) for a trained trunk: right taps 0
    (the block conv starts as the trunk's causal conv), the block softmax at BD_INIT."""
    out = {}
    for name, shape, kind in param_specs(config, clover=True, fused_experts=True):
        if name.rsplit(".", 1)[-1] == "conv_right_weight":
            out[name] = torch.zeros(shape)
        elif kind in BD_INIT:
            out[name] = torch.full(shape, BD_INIT[kind])
    return out


# ---------------------------------------------------------------------------------------------
# Batched training forward (a restatement of reference.model; tests/oracles/test_train.py)
# ---------------------------------------------------------------------------------------------

def gdn_chunked(q, k, v, g, beta, S0, C: int):
    """Chunked gated delta rule (spec 2.1 step 6; the WY form of FLA / transformers'
    torch_chunk_gated_delta_rule) with chunk C.

    q, k [N, Hv, T, dk] (q already scaled, heads already expanded to value heads), v
    [N, Hv, T, dv], g, beta [N, Hv, T], S0 [N, Hv, dk, dv]; T a multiple of C; o_t reads the
    state after token t. Returns (o [N, Hv, T, dv], state before each chunk [N, T // C, Hv,
    dk, dv]: with C = B, the clean state at every block's start)."""
    N, Hh, T, dk = k.shape
    nc = T // C
    q, k, v = (t.reshape(N, Hh, nc, C, t.shape[-1]) for t in (q, k, v))
    g = g.reshape(N, Hh, nc, C)
    G = g.cumsum(-1)                                  # G_t = g_0 + ... + g_t inside the chunk
    beta = beta.reshape(N, Hh, nc, C)
    incl = torch.ones(C, C, dtype=torch.bool).tril()
    strict = torch.ones(C, C, dtype=torch.bool).tril(-1)
    D = (G[..., :, None] - G[..., None, :]).masked_fill(~incl, 0.0).exp() * incl   # e^(G_i - G_j), j <= i
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * D * strict
    eye = torch.eye(C, dtype=q.dtype)
    Tm = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    u = Tm @ (v * beta[..., None])                    # delta = u - w S0
    w = Tm @ (kb * G.exp()[..., None])
    qk = (q @ k.transpose(-1, -2)) * D
    q_in = q * G.exp()[..., None]
    k_end = k * (G[..., -1:] - G).exp()[..., None]    # e^(G_last - G_s) k_s
    S, outs, starts = S0, [], []
    for c in range(nc):
        starts.append(S)
        delta = u[:, :, c] - w[:, :, c] @ S
        outs.append(q_in[:, :, c] @ S + qk[:, :, c] @ delta)
        S = S * G[:, :, c, -1].exp()[..., None, None] + k_end[:, :, c].transpose(-1, -2) @ delta
    return torch.stack(outs, 2).reshape(N, Hh, T, -1), torch.stack(starts, 1)


class TrainForward:
    """Batched prefix mode and block mode over the parameters ``P`` (HF names)."""

    def __init__(self, P: dict, config: dict):
        self.P = P
        self.cfg = ReferenceConfig.from_hf(config)
        c = self.cfg
        self.eps = c.rms_norm_eps
        rd = c.rotary_dim
        self.inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))

    def n1p(self, name, x):
        return RMSNorm1p(self.P[name], self.eps)(x)

    # -- 2.1 / 3.3 Gated DeltaNet -------------------------------------------------------------
    def _qkv_heads(self, c, lead):
        """Conv output c [..., T, C] -> q, k (expanded to value heads), v, q~ as [*lead, Hv, T, d]
        (q~ the L2-normalised query before the 1/sqrt(dk) scale, spec 3.3 step 4)."""
        cf = self.cfg
        Hk, Hv, dk, dv = cf.linear_num_key_heads, cf.linear_num_value_heads, cf.linear_key_head_dim, cf.linear_value_head_dim
        T = c.shape[-2]
        kd = Hk * dk
        qn = l2norm(c[..., :kd].reshape(*lead, T, Hk, dk))
        k = l2norm(c[..., kd:2 * kd].reshape(*lead, T, Hk, dk))
        v = c[..., 2 * kd:].reshape(*lead, T, Hv, dv)
        key_head = torch.arange(Hv) // (Hv // Hk)    # value head h reads key head h // r (HF order)
        qn, k = qn[..., key_head, :].transpose(-2, -3), k[..., key_head, :].transpose(-2, -3)
        return qn / math.sqrt(dk), k, v.transpose(-2, -3), qn

    def _gdn_out(self, p, o, x):
        """Gated RMSNorm per head (plain weight) and W_out; o [N, Hv, T, dv], x [N, T, H]."""
        cf = self.cfg
        N, T = x.shape[:2]
        z = (x @ self.P[p + "in_proj_z.weight"].T).reshape(N, T, cf.linear_num_value_heads, -1)
        y = self.P[p + "norm.weight"] * rmsnorm(o.transpose(1, 2), self.eps) * F.silu(z)
        return y.reshape(N, T, -1) @ self.P[p + "out_proj.weight"].T

    def _conv_block(self, p, qkv, hist):
        """Spec 3.3 step 1 for every block at once: qkv [N, nb, B, C] the block rows' conv
        inputs, hist [N, nb, K-1, C] the clean inputs before each block. Causal taps over
        [hist | block], right taps over the block rows ahead (zero past the block's end), SiLU."""
        K, B = self.cfg.linear_conv_kernel_dim, qkv.shape[2]
        w, r = self.P[p + "conv1d.weight"][:, 0, :], self.P[p + "conv_right_weight"][:, 0, :]
        xb = torch.cat([hist, qkv], 2)
        u = sum(w[:, j] * xb[:, :, j:j + B] for j in range(K))
        xr = F.pad(qkv, (0, 0, 0, K - 1))
        return F.silu(u + sum(r[:, d - 1] * xr[:, :, d:d + B] for d in range(1, K)))

    def _block_softmax(self, p, q, qn, k, v, S, n_clean):
        """Spec 3.3 steps 3-4 for M blocks: q, qn (q~), k [M, Hv, B, dk], v [M, Hv, B, dv], S [M,
        Hv, dk, dv] the clean state at each block's start, n_clean [M] the clean tokens before
        each block (P). Returns o [M, Hv, B, dv]."""
        P = self.P
        B = q.shape[2]
        o_hist = q @ S                                                   # S^T q_i
        s_blk = torch.exp(P[p + "bd_softmax_logit_scale"])[:, None, None] * (qn @ k.transpose(-1, -2))
        s_hist = P[p + "bd_softmax_history_bias"] + P[p + "bd_softmax_history_c"] * \
            torch.log1p(n_clean.to(q.dtype))[:, None]                   # [M, Hv]
        a = torch.softmax(torch.cat([s_blk, s_hist[..., None, None].expand(-1, -1, B, 1)], -1), -1)
        return a[..., :B] @ v + a[..., B:] * o_hist

    def gdn(self, p, x, xn, B):
        """x [N, T, H] clean rows (prefix mode from an empty state); xn [N, T, H] noisy rows run
        as T // B aligned blocks in block mode (spec 3.3) after the clean prefix of their
        window, or None. Returns (clean output, noisy output or None)."""
        P, cf = self.P, self.cfg
        K = cf.linear_conv_kernel_dim
        N, T, _ = x.shape
        w = P[p + "conv1d.weight"][:, 0, :]
        qkv = x @ P[p + "in_proj_qkv.weight"].T
        xp = F.pad(qkv, (0, 0, K - 1, 0))
        c = F.silu(sum(w[:, j] * xp[:, j:j + T] for j in range(K)))
        q, k, v, _ = self._qkv_heads(c, (N,))
        beta, g = GatedDeltaNet._gates(x, P[p + "in_proj_b.weight"], P[p + "in_proj_a.weight"],
                                       P[p + "A_log"], P[p + "dt_bias"])
        S0 = q.new_zeros(N, cf.linear_num_value_heads, cf.linear_key_head_dim, cf.linear_value_head_dim)
        C = B if xn is not None else min(T, 64)
        o, starts = gdn_chunked(q, k, v, g.transpose(1, 2), beta.transpose(1, 2), S0, C)
        y = self._gdn_out(p, o, x)
        if xn is None:
            return y, None
        nb = T // B
        qkv_n = (xn @ P[p + "in_proj_qkv.weight"].T).reshape(N, nb, B, -1)
        hist = xp[:, (torch.arange(nb)[:, None] * B + torch.arange(K - 1)[None, :])]  # [N, nb, K-1, C]
        qb, kb, vb, qnb = (t.reshape(N * nb, *t.shape[2:])
                           for t in self._qkv_heads(self._conv_block(p, qkv_n, hist), (N, nb)))
        n_clean = (torch.arange(nb) * B).repeat(N)                       # P of block b: b * B
        o_n = self._block_softmax(p, qb, qnb, kb, vb, starts.reshape(N * nb, *starts.shape[2:]), n_clean)
        o_n = o_n.reshape(N, nb, *o_n.shape[1:]).permute(0, 2, 1, 3, 4).reshape(N, o_n.shape[1], T, -1)
        return y, self._gdn_out(p, o_n, xn)

    # -- 2.2 gated attention --------------------------------------------------------------------
    def _rope(self, x, pos):
        rd = self.cfg.rotary_dim
        ang = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
        xr, xp = x[..., :rd], x[..., rd:]
        rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
        return torch.cat([xr * cos + rot * sin, xp], -1)

    def _project(self, p, x):
        cf, P = self.cfg, self.P
        N, T, _ = x.shape
        nh, nkv, hd = cf.num_attention_heads, cf.num_key_value_heads, cf.head_dim
        qg = (x @ P[p + "q_proj.weight"].T).view(N, T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(N, T, nh * hd)
        q = self.n1p(p + "q_norm.weight", q).transpose(1, 2)
        k = self.n1p(p + "k_norm.weight", (x @ P[p + "k_proj.weight"].T).view(N, T, nkv, hd)).transpose(1, 2)
        v = (x @ P[p + "v_proj.weight"].T).view(N, T, nkv, hd).transpose(1, 2)
        pos = torch.arange(T)
        rep = nh // nkv                              # query head h uses KV head h // rep
        return (self._rope(q, pos), self._rope(k, pos).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1), gate)

    def _attend(self, p, q, k, v, gate, mask):
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        N, _, T, _ = q.shape
        a = a.transpose(1, 2).reshape(N, T, -1)
        return (a * torch.sigmoid(gate)) @ self.P[p + "o_proj.weight"].T

    def attn(self, p, x, xn, B):
        T = x.shape[1]
        q, k, v, gate = self._project(p, x)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        y = self._attend(p, q, k, v, gate, causal)
        if xn is None:
            return y, None
        # Noisy row i of block b sees clean keys before the block and every noisy key of b.
        qn, kn, vn, gn = self._project(p, xn)
        blk = torch.arange(T) // B
        mask = torch.cat([torch.arange(T)[None, :] < (blk * B)[:, None], blk[None, :] == blk[:, None]], 1)
        return y, self._attend(p, qn, torch.cat([k, kn], 2), torch.cat([v, vn], 2), gn, mask)

    # -- 2.3 MoE ----------------------------------------------------------------------------------
    def moe(self, p, x, coreset=None):
        """x [M, H] -> (out [M, H], load-balancing loss). ``coreset`` (r0, B, top_p): rows r0..
        are blocks of B rows routed with the block coreset (spec 5.6) as in a denoising pass."""
        P, cf = self.P, self.cfg
        probs = torch.softmax(x @ P[p + "gate.weight"].T, -1)
        k = cf.num_experts_per_tok
        w, ids = torch.topk(probs, k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        if coreset is not None:  # the reference's own routing, block by block
            r0, B, top_p = coreset
            routed = [coreset_route(probs[b:b + B], k, top_p) for b in range(r0, probs.shape[0], B)]
            w = torch.cat([w[:r0]] + [r[0] for r in routed])
            ids = torch.cat([ids[:r0]] + [r[1] for r in routed])
        out = torch.zeros_like(x)
        gu_all, dn_all = P[p + "experts.gate_up_proj"], P[p + "experts.down_proj"]
        for e in range(cf.num_experts):
            rows, slot = (ids == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            gg, uu = (x[rows] @ gu_all[e].T).chunk(2, dim=-1)
            out = out.index_add(0, rows, ((F.silu(gg) * uu) @ dn_all[e].T) * w[rows, slot, None])
        ys = (F.silu(x @ P[p + "shared_expert.gate_proj.weight"].T) * (x @ P[p + "shared_expert.up_proj.weight"].T)) \
            @ P[p + "shared_expert.down_proj.weight"].T
        out = out + torch.sigmoid(x @ P[p + "shared_expert_gate.weight"].T) * ys
        frac = torch.bincount(ids.reshape(-1), minlength=cf.num_experts).to(x.dtype) / ids.numel()
        aux = cf.num_experts * (frac * probs.mean(0)).sum()
        return out, aux

    # -- model --------------------------------------------------------------------------------
    def hidden(self, tokens, noisy=None, B=None, coreset_top_p=None):
        """tokens [N, T] clean; noisy [N, T] (blocks of B, masks included) or None;
        ``coreset_top_p``: route each noisy block with the coreset (spec 5.6) as decoding does.
        Returns (final-normed clean rows [N, T, H], noisy rows or None, mean router loss)."""
        P, cf = self.P, self.cfg
        x = P["embed_tokens.weight"][tokens]
        xn = None if noisy is None else P["embed_tokens.weight"][noisy]
        aux = 0.0
        for i, lt in enumerate(cf.layer_types):
            p = f"layers.{i}."
            a = self.n1p(p + "input_layernorm.weight", x)
            an = None if xn is None else self.n1p(p + "input_layernorm.weight", xn)
            if lt == "linear_attention":
                m, mn = self.gdn(p + "linear_attn.", a, an, B)
            else:
                m, mn = self.attn(p + "self_attn.", a, an, B)
            h = x + m
            hn = None if xn is None else xn + mn
            both = h if hn is None else torch.cat([h, hn], 0)
            N, T, H = both.shape
            cs = None if hn is None or coreset_top_p is None else (h.shape[0] * T, B, coreset_top_p)
            mo, la = self.moe(p + "mlp.", self.n1p(p + "post_attention_layernorm.weight", both).reshape(-1, H), cs)
            both = both + mo.reshape(N, T, H)
            aux = aux + la
            x, xn = (both, None) if hn is None else (both[:h.shape[0]], both[h.shape[0]:])
        fx = self.n1p("norm.weight", x)
        return fx, None if xn is None else self.n1p("norm.weight", xn), aux / len(cf.layer_types)

    def logits(self, h):
        return h @ self.P["lm_head.weight"].T


def reference_config(config: dict) -> ReferenceConfig:
    """The reference's config of our checkpoint: a Clover one (the block tensors are present)."""
    rc = ReferenceConfig.from_hf(config)
    rc.clover = True
    return rc


def to_reference(P: dict, config: dict) -> CloverReference:
    """The reference model (reference.model) on a detached copy of the parameters."""
    return CloverReference(reference_config(config), {n: t.detach().clone() for n, t in P.items()})


# ---------------------------------------------------------------------------------------------
# Losses, batches, evaluation
# ---------------------------------------------------------------------------------------------

def mask_blocks(tok: torch.Tensor, B: int, mask_id: int, g: torch.Generator, t=None, p_cut=0.0,
                skip=0, near=4):
    """Noisy copy of tok [N, T] in aligned blocks of B (spec 3.1).

    Random masking: per block t ~ U(0, 1) (or the given t), every slot masked with probability
    t, at least one per block. With probability ``p_cut`` a block is instead cut like a block
    in the middle of threshold decoding: a random c in 0..B-1, slots c..B-1 masked, slots
    before c clean (filled slots, or an aligned first block's prompt tail; c = 0: a block's
    first pass); its loss covers slots c+skip..c+near-1 only (predicting 1 to ``near`` tokens
    ahead of the filled prefix, which is what lets decoding fill several slots per pass).
    Returns (noisy [N, T], masked [N, T], slots in the loss [N, T])."""
    N, T = tok.shape
    nb = T // B
    tt_ = torch.rand(N, nb, 1, generator=g) if t is None else torch.full((N, nb, 1), float(t))
    m = torch.rand(N, nb, B, generator=g) < tt_
    none = ~m.any(-1)
    pick = torch.randint(0, B, (N, nb), generator=g)
    m[none, pick[none]] = True
    sel = m
    if p_cut > 0:  # (no extra draws otherwise)
        cut = torch.randint(0, B, (N, nb, 1), generator=g)
        use = torch.rand(N, nb, 1, generator=g) < p_cut
        pos = torch.arange(B)[None, None, :]
        mc = pos >= cut
        sel = torch.where(use, mc & (pos >= cut + skip) & (pos < cut + near), m)
        m = torch.where(use, mc, m)
    m, sel = m.reshape(N, T), sel.reshape(N, T)
    return tok.masked_fill(m, mask_id), m, sel


def losses(fw: TrainForward, tok, B, mask_id, g, diffusion=True, t=None, keep=None, coreset_top_p=None,
           ar_rows=None, **cut):
    """(ar loss, diffusion loss or None, router loss) on the windows tok [N, T]; ``cut``:
    mask_blocks' p_cut, skip, near; ``keep`` [N, T] bool: only these slots enter the
    diffusion loss (the masking itself is unchanged); ``coreset_top_p``: coreset routing of
    the noisy blocks (None: plain top-k); ``ar_rows`` [N] bool: the windows in the ar loss
    (None: all)."""
    V = fw.cfg.vocab_size
    if diffusion:
        noisy, m, sel = mask_blocks(tok, B, mask_id, g, t, **cut)
        if keep is not None:
            sel = sel & keep
        hc, hn, aux = fw.hidden(tok, noisy, B, coreset_top_p)
    else:
        hc, hn, aux = fw.hidden(tok)
    rows = slice(None) if ar_rows is None else ar_rows
    ar = F.cross_entropy(fw.logits(hc[rows, :-1]).reshape(-1, V), tok[rows, 1:].reshape(-1)) \
        if ar_rows is None or ar_rows.any() else hc.sum() * 0.0
    if not diffusion:
        return ar, None, aux
    n, j = sel.nonzero(as_tuple=True)            # masked slot j is predicted by row j (spec 3.5, in place)
    dl = F.cross_entropy(fw.logits(hn[n, j]), tok[n, j])
    return ar, dl, aux


def eval_windows(stream: torch.Tensor, T: int, n: int) -> torch.Tensor:
    """n fixed windows of T tokens spread evenly over the stream."""
    starts = torch.linspace(0, len(stream) - T - 1, n).long()
    return torch.stack([stream[s:s + T] for s in starts])


@torch.no_grad()
def evaluate(fw: TrainForward, windows, B, mask_id, batch=8) -> dict:
    """Held-out losses with perplexities (fixed seeds): ``ar``; ``diffusion`` (random masking,
    t ~ U(0,1) per block); ``diffusion_all_masked`` (every slot masked: a block's first
    denoising pass); ``diffusion_next2`` (blocks cut at a random c, slots c.. masked: loss of
    slot c+1, the token two ahead of the filled prefix, on which filling two slots per pass
    depends)."""
    g = torch.Generator().manual_seed(1234)
    g2 = torch.Generator().manual_seed(4321)
    sums = {"ar": 0.0, "diffusion": 0.0, "diffusion_all_masked": 0.0, "diffusion_next2": 0.0}
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        ar, dl, _ = losses(fw, w, B, mask_id, g)
        _, dl1, _ = losses(fw, w, B, mask_id, g, t=1.0)
        _, dl2, _ = losses(fw, w, B, mask_id, g2, p_cut=1.0, skip=1, near=2)
        k = len(w) / len(windows)
        sums["ar"] += ar.item() * k
        sums["diffusion"] += dl.item() * k
        sums["diffusion_all_masked"] += dl1.item() * k
        sums["diffusion_next2"] += dl2.item() * k
    out = {}
    for name, v in sums.items():
        out[f"{name}_loss"] = round(v, 4)
        out[f"{name}_ppl"] = round(math.exp(v), 2)
    return out


def distill_windows(gguf_path, train_ids: torch.Tensor, n: int, T: int, B: int, seed: int,
                    threads: int = 1, log=print, mode: str = "ar") -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 4's data: n windows of T tokens, each a prompt of P real training tokens (P a
    random multiple of B in [B, T/2]) followed by the model's own greedy continuation of T - P
    tokens (no penalties, no end tokens), decoded by the engine from ``gguf_path`` in ``mode``
    (``ar``; or ``diffusion``: the block decoder's own text, at the GGUF's threshold, block
    size and coreset). Returns (windows [n, T] int64, P [n] int64)."""
    from clover_gguf import Model
    g = torch.Generator().manual_seed(seed)
    out, plen = torch.empty(n, T, dtype=torch.long), torch.empty(n, dtype=torch.long)
    t0 = time.time()
    with Model(gguf_path, n_ctx=T + B, n_threads=threads) as m:
        for i in range(n):
            P = B * int(torch.randint(1, max(2, T // (2 * B) + 1), (1,), generator=g))
            s0 = int(torch.randint(0, len(train_ids) - P, (1,), generator=g))
            prompt = train_ids[s0:s0 + P].tolist()
            cont, _ = m.generate_tokens(prompt, max_tokens=T - P, mode=mode, presence_penalty=0.0,
                                        repeat_penalty=1.0, end_ids=[])
            out[i] = torch.tensor(prompt + cont)
            plen[i] = P
            if (i + 1) % 500 == 0:
                log(f"distill data: {i + 1}/{n} windows, {time.time() - t0:.0f} s")
    return out, plen


# ---------------------------------------------------------------------------------------------
# A trained trunk from a GGUF (--init-gguf): the converter's transforms undone (spec 4.3)
# ---------------------------------------------------------------------------------------------

# GGUF suffix (after "blk.N.", or global) -> (HF suffix (after "layers.N."), inverse transform).
_GGUF_GLOBAL = {"token_embd.weight": ("embed_tokens.weight", "none"),
                "output_norm.weight": ("norm.weight", "norm1p"),
                "output.weight": ("lm_head.weight", "none")}
_GGUF_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", "norm1p"),
    "post_attention_norm.weight": ("post_attention_layernorm.weight", "norm1p"),
    "attn_qkv.weight": ("linear_attn.in_proj_qkv.weight", "qkv"),
    "attn_gate.weight": ("linear_attn.in_proj_z.weight", "vrows"),
    "ssm_beta.weight": ("linear_attn.in_proj_b.weight", "vheads"),
    "ssm_alpha.weight": ("linear_attn.in_proj_a.weight", "vheads"),
    "ssm_conv1d.weight": ("linear_attn.conv1d.weight", "conv"),
    "ssm_a": ("linear_attn.A_log", "negexp"),
    "ssm_dt.bias": ("linear_attn.dt_bias", "vheads"),
    "ssm_norm.weight": ("linear_attn.norm.weight", "none"),
    "ssm_out.weight": ("linear_attn.out_proj.weight", "vcols"),
    "ssm_conv1d_right.weight": ("linear_attn.conv_right_weight", "conv"),
    "bd_logit_scale": ("linear_attn.bd_softmax_logit_scale", "vheads"),
    "bd_history_bias": ("linear_attn.bd_softmax_history_bias", "vheads"),
    "bd_history_c": ("linear_attn.bd_softmax_history_c", "vheads"),
    "attn_q.weight": ("self_attn.q_proj.weight", "none"),
    "attn_k.weight": ("self_attn.k_proj.weight", "none"),
    "attn_v.weight": ("self_attn.v_proj.weight", "none"),
    "attn_output.weight": ("self_attn.o_proj.weight", "none"),
    "attn_q_norm.weight": ("self_attn.q_norm.weight", "norm1p"),
    "attn_k_norm.weight": ("self_attn.k_norm.weight", "norm1p"),
    "ffn_gate_inp.weight": ("mlp.gate.weight", "none"),
    "ffn_down_exps.weight": ("mlp.experts.down_proj", "none"),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", "row"),
    "ffn_gate_shexp.weight": ("mlp.shared_expert.gate_proj.weight", "none"),
    "ffn_up_shexp.weight": ("mlp.shared_expert.up_proj.weight", "none"),
    "ffn_down_shexp.weight": ("mlp.shared_expert.down_proj.weight", "none"),
}
_GGUF_EXPERT_HALVES = ("ffn_gate_exps.weight", "ffn_up_exps.weight")  # -> mlp.experts.gate_up_proj
# Arch "clover" (the earlier embedded model) stores the same trunk plus tensors of another block
# operator, which a trunk does not use: layer tensors outside _GGUF_LAYER are skipped there.
_GGUF_SKIP_EXTRA_ARCH = "clover"
# GGUF key (after the arch prefix) -> the text config field it must equal
_GGUF_HPARAMS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
                 "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                 "attention.key_length": "head_dim", "expert_count": "num_experts",
                 "expert_used_count": "num_experts_per_tok", "expert_feed_forward_length": "moe_intermediate_size",
                 "ssm.conv_kernel": "linear_conv_kernel_dim", "ssm.state_size": "linear_key_head_dim",
                 "ssm.group_count": "linear_num_key_heads", "ssm.time_step_rank": "linear_num_value_heads"}


def _v_head_inverse(Hk: int, r: int, d: int) -> torch.Tensor:
    """Index ``inv`` with ``hf = gguf[inv]`` undoing the tiled V-head order of spec 4.3
    (original value head ``i*r + j`` is stored at ``j*Hk + i``), ``d`` entries per head."""
    stored = torch.arange(Hk * r * d).reshape(Hk, r, d).transpose(0, 1).reshape(-1)  # gguf[p] = hf[stored[p]]
    return torch.argsort(stored)


def _untransform(kind: str, a: torch.Tensor, cfg: dict) -> torch.Tensor:
    """Undo one converter transform (spec 4.3) of tensor ``a`` (numpy order = HF order)."""
    Hk, Hv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    r, qk = Hv // Hk, 2 * Hk * dk
    if kind == "none":
        return a
    if kind == "norm1p":                       # stored as 1 + w
        return a - 1.0
    if kind == "row":                          # [H] -> [1, H]
        return a.reshape(1, -1)
    if kind == "negexp":                       # ssm_a = -exp(A_log), V-head order
        return torch.log(-a.double()).float()[_v_head_inverse(Hk, r, 1)]
    if kind == "vheads":
        return a[_v_head_inverse(Hk, r, 1)]
    if kind == "vrows":
        return a[_v_head_inverse(Hk, r, dv)]
    if kind == "vcols":
        return a[:, _v_head_inverse(Hk, r, dv)]
    if kind in ("qkv", "conv"):                # v channels (from 2*Hk*dk) in V-head order
        a = torch.cat([a[:qk], a[qk:][_v_head_inverse(Hk, r, dv)]])
        return a[:, None, :] if kind == "conv" else a   # conv: {K, C} -> HF [C, 1, K]
    raise ValueError(f"internal: unknown transform {kind!r}")


def tokenizer_from_gguf(path):
    """The byte-level BPE of a GGUF (``tokenizer.ggml.tokens`` / ``merges`` / ``token_type``)
    as a ``tokenizers.Tokenizer`` with the same ids: BPE vocabulary and merges in their order,
    the pre-tokenizer and decoder of make_checkpoint's tokenizer, then the added tokens (types
    other than normal) with make_checkpoint's special flags."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from gguf import GGUFReader

    from reference.checkpoint import ADDED_TOKENS, QWEN35_PRETOKENIZER_REGEX

    reader = GGUFReader(str(path))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in reader.fields["tokenizer.ggml.merges"].contents()]
    n_bpe = next((i for i, t in enumerate(types) if t != 1), len(tokens))   # 1 = normal token
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens[:n_bpe])}, merges=merges,
                               unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    special = dict(ADDED_TOKENS)
    for content in tokens[n_bpe:]:
        at = AddedToken(content, special=special.get(content, True), normalized=False, lstrip=False,
                        rstrip=False, single_word=False)
        (tok.add_special_tokens if at.special else tok.add_tokens)([at])
    if tok.get_vocab(with_added_tokens=True) != {t: i for i, t in enumerate(tokens)}:
        raise ValueError(f"{path}: tokenizer.ggml.tokens: the rebuilt tokenizer's ids differ from the GGUF's")
    return tok


def read_trunk_gguf(path, config: dict):
    """A trained trunk from a GGUF of arch ``clover_moe``, ``qwen35moe`` or ``clover`` (the
    earlier embedded model) whose hyperparameters are ``config``'s: its parameters by
    prefix-free HF name, float32, dequantised with gguf's reader and the converter's transforms
    undone. Block tensors of spec 3.3 are returned when the file has them; arch ``clover``'s
    layer tensors outside the trunk are skipped. Raises ValueError naming a mismatched key or
    an unknown tensor."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(str(path))
    arch = r.fields["general.architecture"].contents()
    for key, field in _GGUF_HPARAMS.items():
        got = r.fields[f"{arch}.{key}"].contents()
        if got != config[field]:
            raise ValueError(f"{path}: {arch}.{key} = {got}, the training config's {field} is {config[field]}")
    out, halves = {}, {}
    for t in r.tensors:
        a = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        parts = t.name.split(".", 2)
        layer, rest = (int(parts[1]), parts[2]) if parts[0] == "blk" and len(parts) == 3 else (None, None)
        if t.name in _GGUF_GLOBAL:
            name, kind = _GGUF_GLOBAL[t.name]
        elif rest in _GGUF_EXPERT_HALVES:
            halves[(layer, rest)] = a
            continue
        elif rest in _GGUF_LAYER:
            suffix, kind = _GGUF_LAYER[rest]
            name = f"layers.{layer}.{suffix}"
        elif rest is not None and arch == _GGUF_SKIP_EXTRA_ARCH:
            continue
        else:
            raise ValueError(f"{path}: tensor {t.name}: not a trunk or block tensor of spec 4.3")
        out[name] = _untransform(kind, a, config).contiguous()
    for i in sorted({i for i, _ in halves}):
        out[f"layers.{i}.mlp.experts.gate_up_proj"] = torch.cat(
            [halves[(i, h)] for h in _GGUF_EXPERT_HALVES], 1).contiguous()      # [E, 2I, H]
    return out


# ---------------------------------------------------------------------------------------------
# Export: HF checkpoint -> GGUF (the real path)
# ---------------------------------------------------------------------------------------------

CHAT_TEMPLATE = _ROOT / "tests" / "data" / "templates" / "Qwen3.5-4B.jinja"


def export_hf(out_dir, P: dict, config: dict, tok) -> pathlib.Path:
    """Write the HF checkpoint: config.json, tokenizer.json, tokenizer_config.json (Qwen3.5
    chat template), model.safetensors (float32, prefix ``model.``)."""
    from safetensors.torch import save_file

    from reference.checkpoint import _write_tokenizer

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, tok)
    if CHAT_TEMPLATE.is_file():  # the copy in this repository, so a clean checkout gives the same file
        tc = json.loads((out / "tokenizer_config.json").read_text())
        tc["chat_template"] = CHAT_TEMPLATE.read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    cfg = dict(config, transformers_version="5.23.0")
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    tensors = {(n if n == "lm_head.weight" else "model." + n): t.detach().float().contiguous()
               for n, t in P.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def export_gguf(hf_dir, gguf_path, outtype="q8_0") -> pathlib.Path:
    """``clover-gguf convert HF_DIR -o GGUF --outtype q8_0``."""
    from clover_gguf.convert.convert import main as convert_main

    rc = convert_main([str(hf_dir), "-o", str(gguf_path), "--outtype", outtype, "--no-progress"])
    if rc not in (0, None):
        raise RuntimeError(f"convert {hf_dir}: exit status {rc}")
    return pathlib.Path(gguf_path)


# ---------------------------------------------------------------------------------------------
# Loss curves as a PNG (no plotting library needed)
# ---------------------------------------------------------------------------------------------

_DIGITS = {  # 3x5 bitmap font for axis labels
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "k": "100101110101101",
}


def write_png(path, series, width=800, height=480):
    """Line plot: series = [(points [(x, y)], (r, g, b), dots?)]; y axis from 0, labelled ticks."""
    import struct

    img = [[(255, 255, 255)] * width for _ in range(height)]
    L, R, Tm, Bm = 50, 15, 15, 30
    xs = [x for s in series for x, _ in s[0]] or [0, 1]
    ys = [y for s in series for _, y in s[0]] or [0, 1]
    x0, x1 = min(xs), max(max(xs), min(xs) + 1)
    y1 = max(ys) * 1.05 or 1.0

    def px(x, y):
        return (L + (x - x0) / (x1 - x0) * (width - L - R), height - Bm - y / y1 * (height - Tm - Bm))

    def put(x, y, c):
        if 0 <= x < width and 0 <= y < height:
            img[int(y)][int(x)] = c

    def line(a, b, c):
        n = int(max(abs(b[0] - a[0]), abs(b[1] - a[1]))) + 1
        for i in range(n + 1):
            put(a[0] + (b[0] - a[0]) * i / n, a[1] + (b[1] - a[1]) * i / n, c)

    def text(s, x, y, c=(0, 0, 0)):
        for k, ch in enumerate(s):
            bits = _DIGITS.get(ch)
            for i, b in enumerate(bits or ""):
                if b == "1":
                    for dy in range(2):
                        for dx in range(2):
                            put(x + k * 8 + (i % 3) * 2 + dx, y + (i // 3) * 2 + dy, c)

    grey = (200, 200, 200)
    for i in range(6):  # y ticks
        yv = y1 * i / 5
        a, b = px(x0, yv), px(x1, yv)
        line(a, b, grey)
        text(f"{yv:.1f}", 4, a[1] - 5)
    for i in range(6):  # x ticks
        xv = x0 + (x1 - x0) * i / 5
        a = px(xv, 0)
        line(a, px(xv, y1), grey)
        text(f"{xv / 1000:.1f}k" if x1 >= 1000 else f"{xv:.0f}", a[0] - 12, height - Bm + 8)
    for pts, c, dots in series:
        q = [px(x, y) for x, y in pts]
        if dots:
            for x, y in q:
                for dx in range(-3, 4):
                    for dy in range(-3, 4):
                        put(x + dx, y + dy, c)
        else:
            for a, b in zip(q, q[1:]):
                line(a, b, c)
    raw = b"".join(b"\x00" + bytes(v for p in row for v in p) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) \
        + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")
    pathlib.Path(path).write_bytes(png)


def _smooth(pts, k=20):
    out = []
    for i in range(len(pts)):
        w = pts[max(0, i - k + 1):i + 1]
        out.append((pts[i][0], sum(y for _, y in w) / len(w)))
    return out


def plot_log(log_path, png_path):
    """Loss curves from log.jsonl: train ar (blue) and diffusion (red; from stage 2 on, cut
    blocks count only the slots after their cut; in stage 4 most windows are the model's own
    greedy continuations, so its training losses drop while the held-out ones do not),
    smoothed over 20 steps; held-out ar (blue dots), diffusion (red dots) and diffusion_next2
    (green dots)."""
    rows = [json.loads(l) for l in pathlib.Path(log_path).read_text().splitlines() if l.strip()]
    tr = [r for r in rows if r.get("kind") == "train"]
    ev = [r for r in rows if r.get("kind") == "eval"]
    blue, red = (30, 90, 200), (210, 40, 40)
    series = [
        (_smooth([(r["step"], r["ar"]) for r in tr]), blue, False),
        (_smooth([(r["step"], r["diffusion"]) for r in tr if r.get("diffusion") is not None]), red, False),
        ([(r["step"], r["ar_loss"]) for r in ev], blue, True),
        ([(r["step"], r["diffusion_loss"]) for r in ev], red, True),
        ([(r["step"], r["diffusion_next2_loss"]) for r in ev if "diffusion_next2_loss" in r], (40, 160, 60), True),
    ]
    write_png(png_path, [s for s in series if s[0]])


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

FULL = dict(vocab=1024, steps=1500, ar_frac=0.2, batch=8, seq=256, block=32, lr=2e-3, warmup=50,
            eval_every=200, n_eval=48, seed=0, aux_coef=0.01, weight_decay=0.1, limit_bytes=None,
            presence_penalty=0.0, repetition_penalty=1.0,
            stage2_steps=900, stage2_lr=1e-3, stage2_warmup=30, stage2_cut=0.5, stage2_near=4,
            stage3_steps=1700, stage3_lr=6e-4, stage3_warmup=30, stage3_cut=0.75, stage3_near=4,
            stage4_steps=700, stage4_lr=5e-4, stage4_warmup=30, stage4_cut=0.75, stage4_near=8,
            stage4_windows=3000, stage4_frac=0.75, stage4_rounds=3, stage4_source="ar", start_stage=2)
# From a trained trunk (--init-gguf): the real-text stage (stage 3's recipe), then distillation.
FINETUNE = dict(FULL, steps=0, stage2_steps=0, stage3_steps=900, stage3_lr=1e-3, stage3_warmup=50,
                stage4_steps=400, stage4_rounds=2, stage4_windows=2000, eval_every=300, start_stage=1)
SMOKE = dict(FULL, vocab=512, steps=6, ar_frac=0.5, batch=2, seq=64, block=16, warmup=2, eval_every=3,
             n_eval=4, limit_bytes=300_000, stage2_steps=2, stage2_warmup=1, stage3_steps=0,
             stage4_steps=2, stage4_warmup=1, stage4_windows=4)


def plan_stages(s: dict, config: dict) -> list[dict]:
    """The stages with steps, in order: number (1, 2, 3, then 4, 5, ... for the distillation
    rounds), first step (numbered from 1 over all stages), steps, ar-only steps, rate, warm-up,
    cut blocks (mask_blocks' p_cut, near), data seed, distillation and its coreset."""
    stages = [dict(steps=s["steps"], n_ar=int(s["ar_frac"] * s["steps"]), lr=s["lr"], warmup=s["warmup"],
                   cut={}, seed=s["seed"] + 1)]
    for k in (2, 3):  # stage 3 continues stage 2's recipe (and its batch stream) with more cut blocks
        stages.append(dict(steps=s[f"stage{k}_steps"], lr=s[f"stage{k}_lr"], warmup=s[f"stage{k}_warmup"],
                           cut=dict(p_cut=s[f"stage{k}_cut"], near=s[f"stage{k}_near"]), seed=s["seed"] + 2))
    for r in range(s["stage4_rounds"]):
        # self-distillation on the model's own greedy continuations; each round decodes its
        # data with the model as the previous round left it
        stages.append(dict(steps=s["stage4_steps"], lr=s["stage4_lr"], warmup=s["stage4_warmup"],
                           cut=dict(p_cut=s["stage4_cut"], near=s["stage4_near"]), seed=s["seed"] + 4 + 10 * r,
                           distill=True, coreset_top_p=config["moe_block_coreset_top_p"]))
    first = 1
    for number, st in enumerate(stages, 1):
        st.update(number=number, first=first)
        st.setdefault("n_ar", 0)
        first += st["steps"]
    return [st for st in stages if st["steps"] > 0]


def initial_model(s: dict, tr: list, smoke: bool):
    """(tokenizer, config, initial parameters): a tokenizer trained on ``tr`` and init_params;
    or, with ``init_gguf``, the GGUF's tokenizer and trunk with the block tensors of
    init_block_params where the file has none (``s["vocab"]`` is set to its vocabulary)."""
    gguf_path = s.get("init_gguf")
    tok = tokenizer_from_gguf(gguf_path) if gguf_path else build_tokenizer(s["vocab"], tr)
    s["vocab"] = tok.get_vocab_size()
    config = model_config(s["vocab"], tok.token_to_id("<|mask|>"), tok.token_to_id("<|endoftext|>"), s["block"],
                          smoke=smoke and not gguf_path, presence_penalty=s["presence_penalty"],
                          repetition_penalty=s["repetition_penalty"])
    if not gguf_path:
        return tok, config, init_params(config, s["seed"])
    P0 = dict(init_block_params(config), **read_trunk_gguf(gguf_path, config))
    want = {n for n, _, _ in param_specs(config, clover=True, fused_experts=True)}
    if set(P0) != want:
        raise ValueError(f"{gguf_path}: missing {sorted(want - set(P0))[:4]}, unexpected {sorted(set(P0) - want)[:4]}")
    return tok, config, P0


def train(out_dir, settings: dict, smoke=False, log=print) -> dict:
    """Run the whole recipe (data, tokenizer, training, evaluation, export); returns the report."""
    s = dict(settings)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(s["seed"])
    t_start = time.time()
    tr, ho, trn, hon = load_texts(limit_bytes=s["limit_bytes"])
    tok, config, P0 = initial_model(s, tr, smoke)
    train_ids, held_ids = encode_stream(tok, tr), encode_stream(tok, ho)
    mask_id = config["mask_token_id"]
    log(f"data: {len(tr)} train files ({len(train_ids)} tokens), {len(ho)} held-out ({len(held_ids)} tokens), "
        f"{time.time() - t_start:.1f} s")
    if s.get("init_from"):  # continue from a checkpoint's parameters (fresh optimizer and schedule)
        P0 = {n: t.clone() for n, t in torch.load(s["init_from"])["params"].items()}
    P = {n: t.requires_grad_() for n, t in P0.items()}
    fw = TrainForward(P, config)
    B, T, N = s["block"], s["seq"], s["batch"]
    windows = eval_windows(held_ids, T, s["n_eval"])
    stages = plan_stages(s, config)
    log_path = out / "log.jsonl"
    logf = open(log_path, "w")
    if s.get("stage1_ckpt"):  # stages before start_stage were run before (same settings): resume
        ck = pathlib.Path(s["stage1_ckpt"])
        with torch.no_grad():
            for n, t in torch.load(ck)["params"].items():
                P[n].copy_(t)
        if (ck.parent / "log.jsonl").is_file():
            logf.write((ck.parent / "log.jsonl").read_text())
        stages = [st for st in stages if st["number"] >= s.get("start_stage", 2)]
    ev0 = evaluate(fw, windows, B, mask_id)
    step0 = stages[0]["first"] - 1
    logf.write(json.dumps({"kind": "eval", "step": step0, **ev0}) + "\n")
    log(f"eval step {step0}: {ev0}")
    ev_random = ev0 if step0 == 0 and not (s.get("init_from") or s.get("init_gguf")) else \
        evaluate(TrainForward(init_params(config, s["seed"]), config), windows, B, mask_id)
    t_train = time.time()
    evals = [{"step": step0, **ev0}]
    for st in stages:
        decay = [t for n, t in P.items() if t.ndim >= 2 and "embed" not in n]
        no_decay = [t for n, t in P.items() if not (t.ndim >= 2 and "embed" not in n)]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": s["weight_decay"]},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=st["lr"], betas=(0.9, 0.95))

        def lr_at(k, st=st):  # k = 0.. within the stage: linear warm-up, cosine decay to 10%
            if k < st["warmup"]:
                return st["lr"] * (k + 1) / st["warmup"]
            f = (k - st["warmup"]) / max(1, st["steps"] - st["warmup"])
            return st["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * f)))

        if st.get("distill"):
            dpath = out / "distill-source-q8_0.gguf"
            export_gguf(export_hf(out / "distill-source-hf", P, config, tok), dpath)
            n_d = max(1, round(N * s["stage4_frac"]))
            pool, plen = distill_windows(dpath, train_ids, s["stage4_windows"], T, B, st["seed"] + 100,
                                         log=log, mode=s["stage4_source"])
            log(f"distill data: {len(pool)} windows from {dpath.name}")
        g = torch.Generator().manual_seed(st["seed"])
        last = st["first"] + st["steps"] - 1
        for k in range(st["steps"]):
            step = st["first"] + k
            for grp in opt.param_groups:
                grp["lr"] = lr_at(k)
            keep = ar_rows = None
            if st.get("distill"):  # N - n_d real windows, then n_d distilled ones (loss on the continuation)
                starts = torch.randint(0, len(train_ids) - T, (N - n_d,), generator=g)
                pick = torch.randint(0, len(pool), (n_d,), generator=g)
                batch = torch.stack([train_ids[i:i + T] for i in starts] + list(pool[pick]))
                keep = torch.cat([torch.ones(N - n_d, T, dtype=torch.bool),
                                  torch.arange(T)[None, :] >= plen[pick][:, None]])
                if s["stage4_source"] != "ar":  # the causal model learns from real text only
                    ar_rows = torch.arange(N) < N - n_d
            else:
                starts = torch.randint(0, len(train_ids) - T, (N,), generator=g)
                batch = torch.stack([train_ids[i:i + T] for i in starts])
            diffusion = k >= st["n_ar"]
            ar, dl, aux = losses(fw, batch, B, mask_id, g, diffusion=diffusion, keep=keep,
                                 coreset_top_p=st.get("coreset_top_p"), ar_rows=ar_rows, **st["cut"])
            loss = ar + (dl if dl is not None else 0.0) + s["aux_coef"] * aux
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(P.values(), 1.0)
            opt.step()
            rec = {"kind": "train", "step": step, "ar": round(ar.item(), 4),
                   "diffusion": None if dl is None else round(dl.item(), 4), "aux": round(float(aux.detach()), 4),
                   "grad_norm": round(gn.item(), 3), "lr": lr_at(k), "seconds": round(time.time() - t_train, 1)}
            logf.write(json.dumps(rec) + "\n")
            if step % 10 == 0 or k == 0:
                logf.flush()
                log(f"step {step}/{last} ar {rec['ar']:.3f} diffusion {rec['diffusion']} aux {rec['aux']:.3f} "
                    f"|g| {rec['grad_norm']:.2f} lr {rec['lr']:.2e} {rec['seconds']:.0f} s")
            if step % s["eval_every"] == 0 or step == last:
                ev = evaluate(fw, windows, B, mask_id)
                evals.append({"step": step, **ev})
                logf.write(json.dumps({"kind": "eval", "step": step, **ev}) + "\n")
                logf.flush()
                log(f"eval step {step}: {ev}")
                torch.save({"step": step, "params": {n: t.detach() for n, t in P.items()}, "config": config},
                           out / "ckpt.pt")
    logf.close()
    train_seconds = time.time() - t_train
    hf = export_hf(out / "hf", P, config, tok)
    gguf_path = export_gguf(hf, out / "clover-tiny-q8_0.gguf")
    plot_log(log_path, out / "loss.png")
    report = {
        "settings": s, "config": {k: config[k] for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "layer_types", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim", "num_experts", "num_experts_per_tok",
            "moe_intermediate_size", "shared_expert_intermediate_size", "block_size", "mask_token_id")},
        "n_params": sum(t.numel() for t in P.values()),
        "data": {"stdlib": sysconfig.get_paths()["stdlib"], "python": sys.version.split()[0],
                 "train_files": len(tr), "train_tokens": len(train_ids), "heldout_files": hon,
                 "heldout_tokens": len(held_ids), "eval_windows": len(windows), "eval_tokens": windows.numel()},
        "train_seconds": round(train_seconds, 1), "total_seconds": round(time.time() - t_start, 1),
        "torch_threads": torch.get_num_threads(),
        "random_init": ev_random, "trained": evals[-1], "evals": evals,
        "gguf": {"path": str(gguf_path), "bytes": gguf_path.stat().st_size},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def export_only(out_dir, settings: dict, log=print) -> dict:
    """Re-export ``out_dir/ckpt.pt`` (the last evaluated parameters) with the decoding defaults of
    ``settings`` (penalties): HF checkpoint and GGUF; updates report.json when present."""
    s = settings
    out = pathlib.Path(out_dir)
    ck = torch.load(out / "ckpt.pt")
    if s.get("init_gguf"):
        tok = tokenizer_from_gguf(s["init_gguf"])
    else:
        tok = build_tokenizer(s["vocab"], load_texts(limit_bytes=s["limit_bytes"])[0])
    config = dict(ck["config"], presence_penalty=float(s["presence_penalty"]),
                  repetition_penalty=float(s["repetition_penalty"]))
    gguf_path = export_gguf(export_hf(out / "hf", ck["params"], config, tok), out / "clover-tiny-q8_0.gguf")
    rep_path = out / "report.json"
    rep = json.loads(rep_path.read_text()) if rep_path.is_file() else {}
    rep.setdefault("settings", {}).update(presence_penalty=s["presence_penalty"],
                                          repetition_penalty=s["repetition_penalty"])
    rep["gguf"] = {"path": str(gguf_path), "bytes": gguf_path.stat().st_size, "from_step": ck["step"]}
    rep_path.write_text(json.dumps(rep, indent=2) + "\n")
    log(f"exported step {ck['step']} to {gguf_path}")
    return rep


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--smoke", action="store_true", help="a few steps on a small vocabulary (tests)")
    ap.add_argument("--init-from", default=None, metavar="CKPT",
                    help="start from the parameters of a ckpt.pt (a continued run) instead of the initialisation")
    ap.add_argument("--stage1-ckpt", default=None, metavar="CKPT",
                    help="resume: start stage --start-stage (default 2) from this ckpt.pt of a run of the stages before it "
                         "(its log.jsonl, when next to it, is copied to the start of the new log)")
    ap.add_argument("--init-gguf", default=None, metavar="GGUF",
                    help="start from the trunk (and tokenizer) of this GGUF, e.g. the embedded model; the block "
                         "tensors it lacks start from init_block_params")
    ap.add_argument("--finetune", action="store_true",
                    help="the fine-tuning recipe (FINETUNE: the real-text stage, then distillation); with --init-gguf")
    ap.add_argument("--export-only", action="store_true",
                    help="no training: export OUT/ckpt.pt again (e.g. with other --presence-penalty)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: on a busy 2-core machine torch's pool spin-waits)")
    for k, v in FULL.items():
        if k != "limit_bytes":
            ap.add_argument("--" + k.replace("_", "-"), type=type(v), default=None, help=f"(full run: {v})")
    # (penalties: the decoding defaults written into config.json / the GGUF)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = SMOKE if a.smoke else FINETUNE if a.finetune else FULL
    s = dict(base, init_from=a.init_from, stage1_ckpt=a.stage1_ckpt, init_gguf=a.init_gguf)
    for k in FULL:
        v = getattr(a, k, None)
        if v is not None:
            s[k] = v

    def log(msg):
        print(msg, flush=True)

    if a.export_only:
        export_only(a.out, s, log=log)
        return 0
    rep = train(a.out, s, smoke=a.smoke, log=log)
    log(json.dumps({k: rep[k] for k in ("random_init", "trained", "train_seconds", "gguf")}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
