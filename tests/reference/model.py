"""PyTorch reference of the Clover / Qwen3.6-MoE forward pass and decoders (clover-spec 2, 3, 5).

Written to be read next to the spec, not to be fast: one class per block, plain token-by-token
Gated DeltaNet recurrence, every step in the working dtype (float32 by default; float64 works).
This module needs torch; ``import clover_gguf`` never imports it.

- Prefix (causal) mode, spec 3.2: exactly the Qwen3.6 autoregressive computation (checked
  against transformers' Qwen3_5MoeForCausalLM in tests/oracles/test_reference.py).
- Block (denoising) mode, spec 3.2/3.3: the B rows of a block against read-only caches;
  attention rows see the prefix and the whole block; GDN layers run the block operator (the
  conv with right taps, the history slot read from the clean state, the block softmax).
- MoE block coreset routing, spec 5.6, in block mode.
- ``generate_ar`` / ``generate_diffusion`` / ``generate_spec``: the greedy decoders (spec 5.2,
  5.5), with both logit conventions (3.5) and both block placements (3.1).

Main entry points: ``CloverReference.from_pretrained(hf_dir)``, ``.prefix_logits(tokens)``,
``.block_logits(prefix, block, coreset_top_p)``.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "ReferenceConfig", "CloverReference", "State", "generate_ar", "generate_diffusion",
    "generate_spec", "coreset_route", "BLOCK_TENSORS",
]


# ---------------------------------------------------------------------------------------------
# Hyperparameters (spec 1, 3.4)
# ---------------------------------------------------------------------------------------------

@dataclass
class ReferenceConfig:
    """Hyperparameters read from an HF config.json (text config top level or under text_config)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list  # "linear_attention" (GDN) | "full_attention", per layer
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    eos_token_id: int | list | None = None
    # Clover (spec 3.4, docs/gguf-layout.md); clover: the checkpoint has the block tensors
    # (set by CloverReference.from_pretrained), False for a parent (qwen3_5_moe) checkpoint.
    clover: bool = False
    mask_token_id: int | None = None
    block_size: int = 32
    threshold: float = 0.95
    moe_block_coreset_top_p: float = 0.9
    # spec 3.1 / 3.5 defaults of a clover_moe file; the decoders take both values
    shift_logits: bool = False
    block_aligned: bool = True

    @property
    def rotary_dim(self) -> int:
        """Number of rotated dims per head (head_dim * partial_rotary_factor), spec 2.2."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, cfg: dict) -> "ReferenceConfig":
        """Build from a parsed config.json. Raises KeyError naming a missing field."""
        t = cfg.get("text_config", cfg)

        def need(k):
            if k not in t:
                raise KeyError(f"config.json: missing text config field {k!r}")
            return t[k]

        rope = t.get("rope_parameters") or {}
        n_layers = need("num_hidden_layers")
        layer_types = t.get("layer_types")
        if layer_types is None:
            interval = t.get("full_attention_interval", 4)
            layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                           for i in range(n_layers)]
        c = cls(
            vocab_size=need("vocab_size"), hidden_size=need("hidden_size"),
            num_hidden_layers=n_layers, layer_types=list(layer_types)[:n_layers],
            num_attention_heads=need("num_attention_heads"),
            num_key_value_heads=need("num_key_value_heads"), head_dim=need("head_dim"),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            num_experts=need("num_experts"), num_experts_per_tok=need("num_experts_per_tok"),
            moe_intermediate_size=need("moe_intermediate_size"),
            shared_expert_intermediate_size=need("shared_expert_intermediate_size"),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 t.get("partial_rotary_factor", 0.25))),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            eos_token_id=t.get("eos_token_id", cfg.get("eos_token_id")),
        )
        if cfg.get("mask_token_id") is not None:
            c.mask_token_id = int(cfg["mask_token_id"])
        c.block_size = int(cfg.get("block_size", 32))
        c.threshold = float(cfg.get("threshold", 0.95))
        c.moe_block_coreset_top_p = float(cfg.get("moe_block_coreset_top_p", 0.9))
        return c


# ---------------------------------------------------------------------------------------------
# Small kernels
# ---------------------------------------------------------------------------------------------

def _acc(x: torch.Tensor) -> torch.Tensor:
    """Norms and softmaxes run in at least fp32 (spec 2)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def rmsnorm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2, last dim) + eps), in at least fp32; any shape [..., n]."""
    x = _acc(x)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Spec 2.1 step 3, as FLA / transformers: x * rsqrt(sum(x^2, last dim) + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class RMSNorm1p:
    """Spec 2 N1p, zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w)."""

    def __init__(self, weight: torch.Tensor, eps: float):
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (rmsnorm(x, self.eps) * (1.0 + _acc(self.weight))).to(x.dtype)


class _Weights(dict):
    """Tensors by prefix-free HF name; a missing one raises KeyError with its full name."""

    def __init__(self, tensors: dict, where: str = ""):
        super().__init__(tensors)
        self.where = where

    def __missing__(self, key):
        raise KeyError(f"tensor {self.where}{key}: missing from the checkpoint")

    def sub(self, prefix: str) -> "_Weights":
        return _Weights({n[len(prefix):]: t for n, t in self.items() if n.startswith(prefix)},
                        self.where + prefix)


# ---------------------------------------------------------------------------------------------
# Caches
# ---------------------------------------------------------------------------------------------

@dataclass
class GDNCache:
    """GDN layer cache: last K-1 qkv inputs of the conv [K-1, C] and the state S [Hv, dk, dv]."""
    conv: torch.Tensor
    S: torch.Tensor


@dataclass
class KVCache:
    """Attention layer cache: keys and values after norm/RoPE, [nkv, T, hd] each."""
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class State:
    """Prefix-mode state: number of committed positions and one cache per layer."""
    pos: int
    layers: list


# ---------------------------------------------------------------------------------------------
# 2.1 Gated DeltaNet (+ 3.3 BD-GDN, the block operator)
# ---------------------------------------------------------------------------------------------

class GatedDeltaNet:
    """Spec 2.1 (prefix mode) and 3.3 (block mode: right taps, history slot, block softmax)."""

    def __init__(self, w: dict, cfg: ReferenceConfig):
        self.cfg = cfg
        self.Hk, self.Hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.K = cfg.linear_conv_kernel_dim
        self.W_qkv = w["in_proj_qkv.weight"]          # [C, H]
        self.W_z = w["in_proj_z.weight"]              # [Hv*dv, H]
        self.W_b = w["in_proj_b.weight"]              # [Hv, H]
        self.W_a = w["in_proj_a.weight"]              # [Hv, H]
        self.conv_w = w["conv1d.weight"][:, 0, :]     # [C, K]; [:, K-1] multiplies the current token
        self.A_log = w["A_log"]                       # [Hv]
        self.dt_bias = w["dt_bias"]                   # [Hv]
        self.norm_w = w["norm.weight"]                # [dv], plain weight (no +1)
        self.W_out = w["out_proj.weight"]             # [H, Hv*dv]
        self.has_block = cfg.clover
        if self.has_block:                            # spec 3.3 [assumed shapes, docs/gguf-layout.md]
            self.conv_right = w["conv_right_weight"][:, 0, :]    # [C, K-1]; [:, d-1] multiplies row t+d
            self.bd_lambda = w["bd_softmax_logit_scale"]         # [Hv]
            self.bd_beta0 = w["bd_softmax_history_bias"]         # [Hv]
            self.bd_c = w["bd_softmax_history_c"]                # [Hv]

    def new_cache(self, dtype) -> GDNCache:
        C = self.W_qkv.shape[0]
        return GDNCache(conv=torch.zeros(self.K - 1, C, dtype=dtype),
                        S=torch.zeros(self.Hv, self.dk, self.dv,
                                      dtype=torch.float64 if dtype == torch.float64 else torch.float32))

    # 2.1 step 2: causal depthwise conv; hist holds the K-1 previous inputs (zeros at start).
    def _conv_causal(self, qkv, hist):
        xp = torch.cat([hist, qkv], 0)                # [K-1+T, C]
        T = qkv.shape[0]
        return sum(self.conv_w[:, j] * xp[j:j + T] for j in range(self.K))

    # 3.3 step 1: the causal conv over [history | block] plus the right taps over the block rows
    # ahead of each row, zero past the block's last row [assumed]; then SiLU.
    def _conv_block(self, qkv, hist, right=True):
        out = self._conv_causal(qkv, hist)
        if right:
            T, C = qkv.shape
            xr = torch.cat([qkv, qkv.new_zeros(self.K - 1, C)], 0)
            out = out + sum(self.conv_right[:, d - 1] * xr[d:d + T] for d in range(1, self.K))
        return F.silu(out)

    # 2.1 step 3: split, L2-normalise q and k per head (q~, k~), then q = q~ / sqrt(dk).
    def _split(self, c):
        T = c.shape[0]
        kd = self.Hk * self.dk
        qn = l2norm(_acc(c[:, :kd].reshape(T, self.Hk, self.dk)))
        k = l2norm(_acc(c[:, kd:2 * kd].reshape(T, self.Hk, self.dk)))
        v = c[:, 2 * kd:].reshape(T, self.Hv, self.dv)
        return qn / math.sqrt(self.dk), k, _acc(v), qn

    # 2.1 step 4: beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias) (<= 0).
    @staticmethod
    def _gates(x, W_b, W_a, A_log, dt_bias):
        beta = torch.sigmoid(_acc(x @ W_b.T))
        g = -torch.exp(_acc(A_log)) * F.softplus(_acc(x @ W_a.T) + _acc(dt_bias))
        return beta, g

    def _key_head(self):
        return torch.arange(self.Hv) // (self.Hv // self.Hk)   # value head h -> key head h // r (HF order)

    # 2.1 steps 5-6: the delta rule, token by token.
    def _recurrence(self, q, k, v, g, beta, S):
        T = q.shape[0]
        kh = self._key_head()
        o = torch.zeros(T, self.Hv, self.dv, dtype=S.dtype)
        for t in range(T):
            qt, kt = q[t][kh], k[t][kh]                               # [Hv, dk]
            S = S * torch.exp(g[t])[:, None, None]
            kv = torch.einsum("hk,hkv->hv", kt, S)                    # S^T k
            delta = beta[t][:, None] * (v[t] - kv)
            S = S + kt[:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hk,hkv->hv", qt, S)
        return o, S

    # 3.3 steps 3-4 [assumed form]: per value head, a softmax over the B block rows (cosine
    # scores scaled by exp(lambda)) and one history slot (logit beta0 + c ln(1 + P), value the
    # clean state's read S^T q_i).
    def _block_softmax(self, q, qn, k, v, S, P):
        kh = self._key_head()
        o_hist = torch.einsum("thk,hkv->thv", q[:, kh].to(S.dtype), S)          # [B, Hv, dv]
        cos = torch.einsum("ihk,jhk->hij", qn[:, kh], k[:, kh])                  # [Hv, B, B]
        s_blk = torch.exp(_acc(self.bd_lambda))[:, None, None] * cos
        s_hist = _acc(self.bd_beta0) + _acc(self.bd_c) * math.log1p(P)          # [Hv]
        B = q.shape[0]
        s = torch.cat([s_blk, s_hist[:, None, None].expand(-1, B, 1).to(s_blk.dtype)], -1)
        a = torch.softmax(_acc(s), -1)                                           # [Hv, B, B+1]
        o = torch.einsum("hij,jhv->ihv", a[..., :B], v) + a[..., B].transpose(0, 1)[..., None] * o_hist
        return o.to(S.dtype)

    # 2.1 steps 7-8: gated RMSNorm per head (plain weight), then W_out.
    def _output(self, o, x):
        T = o.shape[0]
        z = (x @ self.W_z.T).reshape(T, self.Hv, self.dv)
        y = _acc(self.norm_w) * rmsnorm(o, self.cfg.rms_norm_eps) * F.silu(_acc(z))
        return y.reshape(T, -1).to(x.dtype) @ self.W_out.T

    def prefix(self, x: torch.Tensor, cache: GDNCache) -> torch.Tensor:
        """Prefix mode over x [T, H]; advances ``cache`` (conv history and state)."""
        qkv = x @ self.W_qkv.T
        c = F.silu(self._conv_causal(qkv, cache.conv))
        cache.conv = torch.cat([cache.conv, qkv], 0)[-(self.K - 1):]
        q, k, v, _ = self._split(c)
        beta, g = self._gates(x, self.W_b, self.W_a, self.A_log, self.dt_bias)
        o, cache.S = self._recurrence(q, k, v, g, beta, cache.S)
        return self._output(o, x)

    def block(self, x: torch.Tensor, cache: GDNCache, P: int, right: bool = True) -> torch.Tensor:
        """Block mode (spec 3.3) over the B rows x [B, H] after P clean tokens; ``cache`` (the
        clean conv history and state) is read, not written. ``right=False`` drops the right taps
        (for tests)."""
        qkv = x @ self.W_qkv.T
        q, k, v, qn = self._split(self._conv_block(qkv, cache.conv, right))
        return self._output(self._block_softmax(q, qn, k, v, cache.S, P), x)


# ---------------------------------------------------------------------------------------------
# 2.2 Gated full attention
# ---------------------------------------------------------------------------------------------

class GatedAttention:
    """Spec 2.2: q/gate split per head, q/k N1p norms, partial NEOX RoPE, GQA, sigmoid output gate."""

    def __init__(self, w: dict, cfg: ReferenceConfig):
        self.cfg = cfg
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.W_q = w["q_proj.weight"]      # [nh*2*hd, H], per head [query hd | gate hd]
        self.W_k = w["k_proj.weight"]      # [nkv*hd, H]
        self.W_v = w["v_proj.weight"]      # [nkv*hd, H]
        self.W_o = w["o_proj.weight"]      # [H, nh*hd]
        self.q_norm = RMSNorm1p(w["q_norm.weight"], cfg.rms_norm_eps)
        self.k_norm = RMSNorm1p(w["k_norm.weight"], cfg.rms_norm_eps)
        rd = cfg.rotary_dim
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
        self.kv_round = (None, None)  # dtypes (torch.float16) keys, values are rounded to, as a KV cache's

    def new_cache(self, dtype) -> KVCache:
        return KVCache(k=torch.zeros(self.nkv, 0, self.hd, dtype=dtype),
                       v=torch.zeros(self.nkv, 0, self.hd, dtype=dtype))

    def _rope(self, x, pos):
        # x [n, T, hd]; NEOX pairs (i, i + rd/2) on the first rd dims; angle pos * theta^(-2i/rd).
        # (Qwen's multi-section RoPE reduces to this for text: all position rows are equal.)
        rd = self.cfg.rotary_dim
        ang = pos.to(torch.float64)[:, None] * self.inv_freq[None, :]        # [T, rd/2]
        cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)
        sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)
        xr, xp = x[..., :rd], x[..., rd:]
        rot = torch.cat([-xr[..., rd // 2:], xr[..., :rd // 2]], -1)
        return torch.cat([xr * cos + rot * sin, xp], -1)

    def _project(self, x, pos0):
        T = x.shape[0]
        qg = (x @ self.W_q.T).view(T, self.nh, 2 * self.hd)
        q, gate = qg[..., :self.hd], qg[..., self.hd:].reshape(T, self.nh * self.hd)
        q = self.q_norm(q).transpose(0, 1)                                     # [nh, T, hd]
        k = self.k_norm((x @ self.W_k.T).view(T, self.nkv, self.hd)).transpose(0, 1)
        v = (x @ self.W_v.T).view(T, self.nkv, self.hd).transpose(0, 1)
        pos = torch.arange(pos0, pos0 + T)
        k = self._rope(k, pos)
        kd, vd = self.kv_round  # what a cache of that type holds (round to nearest even)
        k = k if kd is None else k.to(kd).to(k.dtype)
        v = v if vd is None else v.to(vd).to(v.dtype)
        return self._rope(q, pos), k, v, gate

    def _attend(self, q, k, v, gate, mask):
        rep = self.nh // self.nkv                       # query head h uses KV head h // rep
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        scores = _acc(q @ k.transpose(1, 2)) / math.sqrt(self.hd)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores, -1).to(v.dtype)
        a = (p @ v).transpose(0, 1).reshape(q.shape[1], -1)                    # [T, nh*hd]
        return (a * torch.sigmoid(gate)) @ self.W_o.T

    def prefix(self, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        """Causal attention of x [T, H] at positions pos0.. over the cache; appends to it."""
        q, k, v, gate = self._project(x, pos0)
        cache.k = torch.cat([cache.k, k], 1)
        cache.v = torch.cat([cache.v, v], 1)
        T, L = x.shape[0], cache.k.shape[1]
        mask = torch.arange(L)[None, :] <= (L - T + torch.arange(T))[:, None]
        return self._attend(q, cache.k, cache.v, gate, mask)

    def block(self, x: torch.Tensor, cache: KVCache, pos0: int) -> torch.Tensor:
        """Spec 3.2 block mode: every row sees the cached prefix and every block row."""
        q, k, v, gate = self._project(x, pos0)
        return self._attend(q, torch.cat([cache.k, k], 1), torch.cat([cache.v, v], 1), gate, None)


# ---------------------------------------------------------------------------------------------
# 2.3 MoE and 5.6 block coreset
# ---------------------------------------------------------------------------------------------

def coreset_route(probs: torch.Tensor, k: int, top_p: float):
    """Spec 5.6 / contract: coreset routing of a block's rows.

    probs [B, E] (router softmax, float). S = sum over rows of each row's probs masked to its own
    top-k, normalised (float64); experts ordered by S desc, ties lower id first; m = smallest
    count with cumsum >= top_p, clamped to [k, E]; each row takes top-k among the first m and
    renormalises. Returns (weights [B, k] float, ids [B, k] long, m). No special case for 1.0.
    """
    B, E = probs.shape
    topv, topi = torch.topk(probs, k, dim=-1)
    s = torch.zeros(B, E, dtype=torch.float64).scatter(1, topi, topv.to(torch.float64))
    S = s.sum(0)
    S = S / S.sum()
    order = sorted(range(E), key=lambda e: (-S[e].item(), e))
    cum = torch.cumsum(S[order], 0)
    reach = (cum >= top_p).nonzero()
    m = int(reach[0, 0]) + 1 if len(reach) else E
    m = max(k, min(E, m))
    allowed = torch.zeros(E, dtype=torch.bool)
    allowed[order[:m]] = True
    w, ids = torch.topk(probs.masked_fill(~allowed, float("-inf")), k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids, m


class SparseMoE:
    """Spec 2.3: softmax router, top-k renormalised, SwiGLU experts, sigmoid-gated shared expert."""

    def __init__(self, w: dict, cfg: ReferenceConfig):
        self.k = cfg.num_experts_per_tok
        self.W_router = w["gate.weight"]                 # [E, H]
        self.gate_up = w["experts.gate_up_proj"]         # [E, 2I, H] (first I rows gate, next I up)
        self.down = w["experts.down_proj"]               # [E, H, I]
        self.sh_gate = w["shared_expert.gate_proj.weight"]
        self.sh_up = w["shared_expert.up_proj.weight"]
        self.sh_down = w["shared_expert.down_proj.weight"]
        self.sh_gate_inp = w["shared_expert_gate.weight"]  # [1, H]

    def route(self, x: torch.Tensor, coreset_top_p: float | None = None):
        """Top-k routing of x [T, H] -> (weights [T, k], expert ids [T, k]); coreset when a
        top_p is given (block mode, spec 5.6), normal routing when None."""
        probs = torch.softmax(_acc(x @ self.W_router.T), -1)
        if coreset_top_p is not None:
            w, ids, _ = coreset_route(probs, self.k, coreset_top_p)
            return w, ids
        w, ids = torch.topk(probs, self.k, dim=-1)
        return w / w.sum(-1, keepdim=True), ids

    def __call__(self, x: torch.Tensor, coreset_top_p: float | None = None):
        """Returns (out [T, H], expert ids [T, k])."""
        w, ids = self.route(x, coreset_top_p)
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            gu = x[rows] @ self.gate_up[e].T
            g, u = gu.chunk(2, dim=-1)
            y = (F.silu(g) * u) @ self.down[e].T
            out.index_add_(0, rows, y * w[rows, slot, None].to(x.dtype))
        ys = (F.silu(x @ self.sh_gate.T) * (x @ self.sh_up.T)) @ self.sh_down.T
        out = out + torch.sigmoid(x @ self.sh_gate_inp.T) * ys
        return out, ids


# ---------------------------------------------------------------------------------------------
# Decoder layer and model (spec 2)
# ---------------------------------------------------------------------------------------------

class DecoderLayer:
    """Spec 2: h = x + Mixer(N1p(x)); out = h + MoE(N1p(h))."""

    def __init__(self, w: _Weights, cfg: ReferenceConfig, layer_type: str):
        self.is_gdn = layer_type == "linear_attention"
        self.input_norm = RMSNorm1p(w["input_layernorm.weight"], cfg.rms_norm_eps)
        self.post_norm = RMSNorm1p(w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        if self.is_gdn:
            self.mixer = GatedDeltaNet(w.sub("linear_attn."), cfg)
        else:
            self.mixer = GatedAttention(w.sub("self_attn."), cfg)
        self.moe = SparseMoE(w.sub("mlp."), cfg)

    def new_cache(self, dtype):
        return self.mixer.new_cache(dtype)

    def prefix(self, x, cache, pos0):
        a = self.input_norm(x)
        h = x + (self.mixer.prefix(a, cache) if self.is_gdn else self.mixer.prefix(a, cache, pos0))
        m, ids = self.moe(self.post_norm(h))
        return h + m, ids

    def block(self, x, cache, pos0, coreset_top_p, right=True):
        a = self.input_norm(x)
        h = x + (self.mixer.block(a, cache, pos0, right) if self.is_gdn else self.mixer.block(a, cache, pos0))
        m, ids = self.moe(self.post_norm(h), coreset_top_p)
        return h + m, ids


_LM_PREFIXES = ("model.language_model.", "model.")
# Clover's block tensors of a GDN layer (linear_attn.*; spec 0, 3.3)
BLOCK_TENSORS = ("conv_right_weight", "bd_softmax_logit_scale", "bd_softmax_history_bias",
                 "bd_softmax_history_c")


# The decoding record's keys that the reference reads (spec 3.4)
_RECORD_KEYS = ("mask_token_id", "block_size", "threshold", "moe_block_coreset_top_p")


def _with_generation_config(hf_dir: pathlib.Path, cfg: dict) -> dict:
    """config.json's dict with the record keys it lacks taken from generation_config.json (spec 3.4)."""
    path = hf_dir / "generation_config.json"
    if not path.is_file():
        return cfg
    gen = json.loads(path.read_text())
    return dict(cfg, **{k: gen[k] for k in _RECORD_KEYS if k not in cfg and gen.get(k) is not None})


def _mask_from_tokenizer(hf_dir: pathlib.Path):
    """The id of the one added token of tokenizer.json whose content contains "mask", else None."""
    path = hf_dir / "tokenizer.json"
    if not path.is_file():
        return None
    hits = [int(t["id"]) for t in json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
            if "mask" in str(t.get("content", ""))]
    return hits[0] if len(hits) == 1 else None


_SKIP_PREFIXES = ("mtp.", "model.visual.", "visual.", "model.mtp.")


def _load_hf_tensors(hf_dir: pathlib.Path, dtype, tensor_hook):
    from safetensors import safe_open

    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{hf_dir}: no model.safetensors.index.json or model.safetensors")
    out, per_expert = {}, {}
    for fname in files:
        with safe_open(str(hf_dir / fname), framework="pt") as f:
            for full in f.keys():
                if full.startswith(_SKIP_PREFIXES):
                    continue
                if full == "lm_head.weight":
                    name = full
                else:
                    pre = next((p for p in _LM_PREFIXES if full.startswith(p)), None)
                    if pre is None:
                        raise ValueError(f"tensor {full}: unexpected name (no model./model.language_model. prefix)")
                    name = full[len(pre):]
                t = f.get_tensor(full).to(dtype)
                if tensor_hook is not None:
                    t = tensor_hook(full, t)
                parts = name.split(".")
                # per-expert layout: layers.i.mlp.experts.e.{gate,up,down}_proj.weight
                if len(parts) == 7 and parts[3] == "experts" and parts[4].isdigit():
                    per_expert[(int(parts[1]), int(parts[4]), parts[5])] = t
                else:
                    out[name] = t
    if per_expert:
        layers = sorted({l for l, _, _ in per_expert})
        for l in layers:
            E = 1 + max(e for ll, e, _ in per_expert if ll == l)
            try:
                out[f"layers.{l}.mlp.experts.gate_up_proj"] = torch.stack(
                    [torch.cat([per_expert[(l, e, "gate_proj")], per_expert[(l, e, "up_proj")]]) for e in range(E)])
                out[f"layers.{l}.mlp.experts.down_proj"] = torch.stack(
                    [per_expert[(l, e, "down_proj")] for e in range(E)])
            except KeyError as err:
                l_, e_, p_ = err.args[0]
                raise KeyError(f"tensor layers.{l_}.mlp.experts.{e_}.{p_}.weight: missing") from None
    return out


class CloverReference:
    """The reference model (spec 2-3). Build with ``from_pretrained``.

    Runs on the CPU in the load dtype. On a busy 2-core machine call
    ``torch.set_num_threads(1)`` first: torch's thread pool otherwise spin-waits on these small
    tensors (tests/conftest.py does this for the test session)."""

    def __init__(self, config: ReferenceConfig, weights: dict, dtype=torch.float32, kv_cache_dtype=None):
        self.config = config
        self.dtype = dtype
        w = _Weights(weights, "model.")
        self.embed = w["embed_tokens.weight"]           # [V, H]
        self.norm = RMSNorm1p(w["norm.weight"], config.rms_norm_eps)
        self.lm_head = _Weights(weights)["lm_head.weight"]  # [V, H] (top level, no prefix)
        self.layers = [DecoderLayer(w.sub(f"layers.{i}."), config, lt)
                       for i, lt in enumerate(config.layer_types)]
        kv = kv_cache_dtype if isinstance(kv_cache_dtype, tuple) else (kv_cache_dtype, kv_cache_dtype)
        for layer in self.layers:
            if not layer.is_gdn:
                layer.mixer.kv_round = kv

    @classmethod
    def from_pretrained(cls, hf_dir, dtype=torch.float32, tensor_hook=None, kv_cache_dtype=None) -> "CloverReference":
        """Load an HF checkpoint directory (spec 3.4): config.json plus safetensors (sharded with
        an index, or one model.safetensors), tensor prefix ``model.`` or ``model.language_model.``,
        fused 3-D or per-expert experts, any stored dtype (converted to ``dtype``).

        tensor_hook(name, tensor) -> tensor, when given, is applied to every tensor after the
        dtype conversion, with its full HF name (e.g. to feed Q8_0-round-tripped weights).
        kv_cache_dtype (e.g. torch.float16, or a (keys, values) pair of dtypes or None): attention
        keys (after norm and RoPE) and values are rounded to it before attention reads them, as
        the engine's KV cache of that type (clover-spec 6); None keeps them in ``dtype``.
        A checkpoint is Clover when every GDN layer has the four block tensors (spec 3.4); some
        but not all of them raise ValueError naming the first missing one. The decoding record
        (spec 3.4) is read from config.json, then generation_config.json. The mask token is the
        record's ``mask_token_id``, else the one added token of tokenizer.json whose content
        contains ``mask`` (spec 3.1); a Clover checkpoint with neither raises ValueError. Missing
        tensors raise KeyError.
        """
        hf_dir = pathlib.Path(hf_dir)
        cfg_json = _with_generation_config(hf_dir, json.loads((hf_dir / "config.json").read_text()))
        config = ReferenceConfig.from_hf(cfg_json)
        weights = _load_hf_tensors(hf_dir, dtype, tensor_hook)
        gdn = [i for i, t in enumerate(config.layer_types) if t == "linear_attention"]
        want = [f"layers.{i}.linear_attn.{n}" for i in gdn for n in BLOCK_TENSORS]
        have = [n for n in want if n in weights]
        if have and len(have) != len(want):
            missing = next(n for n in want if n not in weights)
            raise ValueError(f"{hf_dir}: the checkpoint has {len(have)} of the {len(want)} Clover block "
                             f"tensors (spec 3.3); missing model.{missing}")
        config.clover = bool(have)
        if config.clover and config.mask_token_id is None:
            config.mask_token_id = _mask_from_tokenizer(hf_dir)
            if config.mask_token_id is None:
                raise ValueError(f"{hf_dir}: no mask token (spec 3.1): no mask_token_id in config.json or "
                                 "generation_config.json, and not exactly one added token of tokenizer.json "
                                 "whose content contains 'mask'")
        return cls(config, weights, dtype, kv_cache_dtype)

    # -- incremental interface (also used by the decoders) ------------------------------------

    def new_state(self) -> State:
        """Empty prefix-mode state (position 0, zero GDN state and conv history, empty KV)."""
        return State(pos=0, layers=[l.new_cache(self.dtype) for l in self.layers])

    def _logits(self, x):
        return self.norm(x) @ self.lm_head.T

    def forward_prefix(self, state: State, tokens: list) -> torch.Tensor:
        """Prefix (causal) mode, spec 3.2: run ``tokens`` after ``state`` and advance it.
        Returns logits [T, V] (row t predicts the token after tokens[t])."""
        if len(tokens) == 0:
            return torch.zeros(0, self.config.vocab_size, dtype=self.dtype)
        x = self.embed[torch.tensor(tokens, dtype=torch.long)]
        for layer, cache in zip(self.layers, state.layers):
            x, _ = layer.prefix(x, cache, state.pos)
        state.pos += len(tokens)
        return self._logits(x)

    def forward_block(self, state: State, block: list, coreset_top_p: float | None = 1.0,
                      right: bool = True):
        """Block (denoising) mode, spec 3.2/3.3/5.6, over the B tokens of ``block`` at positions
        state.pos..state.pos+B-1 (P = state.pos clean tokens before it); ``state`` is not
        modified. coreset_top_p None = normal routing. ``right=False`` drops the conv's right
        taps (for tests). Returns (logits [B, V], distinct experts per layer (list of int)).
        Raises ValueError for a checkpoint without the block tensors."""
        if not self.config.clover:
            raise ValueError("block mode needs a Clover checkpoint (the block tensors of spec 3.3)")
        x = self.embed[torch.tensor(block, dtype=torch.long)]
        distinct = []
        for layer, cache in zip(self.layers, state.layers):
            x, ids = layer.block(x, cache, state.pos, coreset_top_p, right)
            distinct.append(int(ids.unique().numel()))
        return self._logits(x), distinct

    # -- contract API ---------------------------------------------------------------------------

    @torch.no_grad()
    def prefix_logits(self, tokens: list) -> torch.Tensor:
        """Causal logits [T, V] (dtype of the model) for ``tokens``, computed from scratch."""
        return self.forward_prefix(self.new_state(), list(tokens))

    @torch.no_grad()
    def block_logits(self, prefix: list, block: list, coreset_top_p: float | None = 1.0):
        """Block-mode logits of ``block`` (B tokens, masks included) after ``prefix``, from
        scratch: the prefix runs causally to get the caches, then the block runs in block mode.
        coreset_top_p: spec 5.6 coreset (1.0 runs the general coreset path, which equals normal
        routing); None disables the coreset code path. Returns (logits [B, V], distinct experts
        per layer). Raises ValueError for a non-Clover checkpoint."""
        state = self.new_state()
        self.forward_prefix(state, list(prefix))
        return self.forward_block(state, list(block), coreset_top_p)


# ---------------------------------------------------------------------------------------------
# Greedy decoders (spec 5.2; the shared contract's "Decoding semantics")
# ---------------------------------------------------------------------------------------------

def _masked(logits: torch.Tensor, mask_id) -> torch.Tensor:
    """The mask token is never a candidate: its logit becomes -inf."""
    if mask_id is None:
        return logits
    logits = logits.clone()
    logits[..., mask_id] = float("-inf")
    return logits


def _argmax_conf(logits: torch.Tensor, mask_id):
    """Greedy candidate and confidence (softmax probability of the argmax), spec 5.3."""
    p = torch.softmax(_acc(_masked(logits, mask_id)), -1)
    t = int(torch.argmax(p))
    return t, float(p[t])


@torch.no_grad()
def generate_ar(ref: CloverReference, prompt: list, max_tokens: int, end_ids):
    """Greedy autoregressive decoding in prefix mode (spec 5.1 ``ar``).

    prompt: token ids (non-empty); end_ids: iterable of ids that stop generation (emitted).
    Returns (tokens, n_forward) with n_forward = prefill 1 + one per decode forward.
    max_tokens <= 0 returns ([], 0).
    """
    if max_tokens <= 0:
        return [], 0
    end_ids = set(end_ids or ())
    mask_id = ref.config.mask_token_id
    state = ref.new_state()
    L = ref.forward_prefix(state, list(prompt))[-1]
    n_forward, out = 1, []
    while True:
        t, _ = _argmax_conf(L, mask_id)
        out.append(t)
        if t in end_ids or len(out) >= max_tokens:
            break
        L = ref.forward_prefix(state, [t])[-1]
        n_forward += 1
    return out, n_forward


@torch.no_grad()
def generate_diffusion(ref: CloverReference, prompt: list, max_tokens: int, block_size: int,
                       threshold: float, coreset_top_p: float | None, end_ids,
                       shift_logits: bool | None = None, block_aligned: bool | None = None):
    """Greedy threshold block decoding (spec 5.2) with the engine's exact semantics.

    Placement (spec 3.1): aligned blocks cover [kB, (k+1)B): the prompt up to the last block
    boundary at or before its end is prefilled and its tail fills the first block's leading
    slots, fixed (never masked or predicted; not emitted); unaligned, the whole prompt is
    prefilled and every block starts all masked. Logit convention (spec 3.5): slot j is
    predicted by row j (in place) or, with shift_logits, by row j-1, where a block with no
    fixed slot takes slot 0 from the causal logits of the last committed row (no forward; an
    end id there is emitted and stops). While a slot is masked: one block forward (coreset
    top-p); every masked slot whose confidence > threshold is filled, else the single most
    confident (ties: lowest slot); an end id at slot e with no mask before it, or a budget that
    the filled slots before the first mask cover, emits the generated slots up to e and stops.
    A finished block's generated slots are emitted (truncated to the budget); unless the budget
    is spent, the whole block is committed by a prefix-mode forward. shift_logits / block_aligned None: the config's (spec 4.2 defaults).
    Returns (tokens, n_forward): prefill (when anything is prefilled) + denoise + commit
    forwards. max_tokens <= 0 returns ([], 0).
    """
    if max_tokens <= 0:
        return [], 0
    cfg = ref.config
    if not cfg.clover:
        raise ValueError("diffusion decoding needs a Clover checkpoint")
    B, mask_id = int(block_size), cfg.mask_token_id
    shift = cfg.shift_logits if shift_logits is None else bool(shift_logits)
    aligned = cfg.block_aligned if block_aligned is None else bool(block_aligned)
    if B < 1:
        raise ValueError(f"block_size: {B} (expected >= 1)")
    end_ids = set(end_ids or ())
    state = ref.new_state()
    p0 = len(prompt) // B * B if aligned else len(prompt)
    tail = list(prompt[p0:])
    L = ref.forward_prefix(state, list(prompt[:p0]))[-1] if p0 else None
    n_forward, out = (1 if p0 else 0), []
    while True:
        budget = max_tokens - len(out)
        nf = len(tail)
        blk = tail + [mask_id] * (B - nf)
        masked = [False] * nf + [True] * (B - nf)
        tail = []
        if shift and nf == 0:
            t0, _ = _argmax_conf(L, mask_id)
            blk[0], masked[0] = t0, False
            if t0 in end_ids:
                out.append(t0)
                return out, n_forward
        stop_at = None
        while any(masked):
            rows, _ = ref.forward_block(state, blk, coreset_top_p)
            n_forward += 1
            cand = {j: _argmax_conf(rows[j - 1] if shift else rows[j], mask_id) for j in range(B) if masked[j]}
            fill = [j for j, (_, c) in cand.items() if c > threshold]
            if not fill:
                best = None
                for j in sorted(cand):
                    if best is None or cand[j][1] > cand[best][1]:
                        best = j
                fill = [best]
            for j in fill:
                blk[j], masked[j] = cand[j][0], False
            for e in range(nf, B):
                if masked[e] or e - nf + 1 > budget:
                    break
                if blk[e] in end_ids or e - nf + 1 == budget:
                    stop_at = e
                    break
            if stop_at is not None:
                break
        if stop_at is not None:
            out.extend(blk[nf:stop_at + 1][:budget])
            return out, n_forward
        out.extend(blk[nf:][:budget])
        if len(out) >= max_tokens:
            return out, n_forward
        L = ref.forward_prefix(state, blk)[-1]
        n_forward += 1


@torch.no_grad()
def generate_spec(ref: CloverReference, prompt: list, max_tokens: int, block_size: int,
                  coreset_top_p: float | None, end_ids, shift_logits: bool | None = None):
    """Greedy self-speculative decoding (spec 5.5): seed s = the argmax of the last causal row;
    one block forward on [s, MASK x (B-1)] drafts d_j = the argmax of slot j's row (row j in
    place, row j-1 with shift_logits); one prefix-mode forward on [s, d_1..] verifies; the
    longest run of d_j equal to the verify's greedy prediction is accepted, s and the accepted
    drafts are emitted (up to and including an end id, within the budget), and the state is
    rebuilt by a prefix-mode forward of the kept tokens from a copy taken before the verify (the
    engine's rollback replays them). Its tokens equal ``generate_ar``'s. Returns (tokens,
    n_forward, accepted drafts per verify (list)). max_tokens <= 0 returns ([], 0, [])."""
    import copy
    if max_tokens <= 0:
        return [], 0, []
    cfg = ref.config
    if not cfg.clover:
        raise ValueError("spec decoding needs a Clover checkpoint")
    B, mask_id = int(block_size), cfg.mask_token_id
    shift = cfg.shift_logits if shift_logits is None else bool(shift_logits)
    end_ids = set(end_ids or ())
    state = ref.new_state()
    seed, _ = _argmax_conf(ref.forward_prefix(state, list(prompt))[-1], mask_id)
    n_forward, out, accepted = 1, [], []
    while True:
        if seed in end_ids:
            return out + [seed], n_forward, accepted
        blk = [seed] + [mask_id] * (B - 1)
        if B > 1:
            rows, _ = ref.forward_block(state, blk, coreset_top_p)
            n_forward += 1
            for j in range(1, B):
                blk[j], _ = _argmax_conf(rows[j - 1] if shift else rows[j], mask_id)
        before = copy.deepcopy(state)
        verify = ref.forward_prefix(state, blk)
        n_forward += 1
        a = [_argmax_conf(r, mask_id)[0] for r in verify]
        c = 0
        while c + 1 < B and blk[c + 1] == a[c]:
            c += 1
        accepted.append(c)
        keep = blk[:c + 1]
        for t in keep:
            out.append(t)
            if t in end_ids or len(out) >= max_tokens:
                return out, n_forward, accepted
        state = before
        ref.forward_prefix(state, keep)
        seed = a[c]
