"""The one HF -> GGUF tensor name table (clover-spec sections 3.3 and 4.3).

Each row maps an HF parameter name suffix (after the ``model.`` / ``model.language_model.``
prefix, and after ``layers.{i}.`` for per-layer rows) to its GGUF name and the transform the
converter applies. A future official Clover checkpoint with other names changes this table
only.

Transforms (implemented in ``convert.convert``):

- ``none``: copied as is.
- ``norm1p``: zero-centred RMSNorm weight, stored as ``1 + w`` (F32).
- ``qkv``: rows of the v part (from channel ``2*Hk*dk``) V-head reordered (head size dv).
- ``vrows``: rows V-head reordered (head size dv).
- ``vheads``: leading axis V-head reordered (head size 1; 2-D rows or 1-D elements).
- ``conv``: ``[C, 1, T] -> [C, T]`` (ggml ``{T, C}``), v channels V-head reordered; T = K taps
  (``conv1d``) or K-1 right taps (``conv_right_weight``, whose ``[c, 0, d-1]`` multiplies block
  row ``t + d``).
- ``negexp``: ``-exp(A_log)`` in F32, V-head reordered.
- ``vcols``: columns (input dimension) V-head reordered (head size dv).
- ``flat``: ``[1, H] -> [H]``.
- ``split_gate_up``: fused ``[E, 2I, H]`` split into gate ``[E, :I]`` and up ``[E, I:]``.
- ``stack``: per-expert 2-D tensors stacked into ``[E, ...]``.

V-head reorder (spec 4.3): with ``r = Hv/Hk``, original value head ``i*r + j`` moves to
``j*Hk + i`` (llama.cpp's tiled order).
"""

from __future__ import annotations

import re

# Layer kinds.
GDN = "linear_attention"
ATTN = "full_attention"
ANY = "any"

# Global tensors: HF name suffix (after the model prefix; lm_head is top level) -> (GGUF, transform).
GLOBAL_MAP = {
    "embed_tokens.weight": ("token_embd.weight", "none"),
    "norm.weight": ("output_norm.weight", "norm1p"),
}
LM_HEAD = ("lm_head.weight", "output.weight", "none")

# Per-layer tensors, in the order they are written inside a block.
# (HF suffix after "layers.{i}.", GGUF suffix after "blk.{i}.", transform, layer kind, block tensor)
LAYER_MAP = [
    ("input_layernorm.weight", "attn_norm.weight", "norm1p", ANY, False),
    # Gated DeltaNet (spec 2.1)
    ("linear_attn.in_proj_qkv.weight", "attn_qkv.weight", "qkv", GDN, False),
    ("linear_attn.in_proj_z.weight", "attn_gate.weight", "vrows", GDN, False),
    ("linear_attn.in_proj_b.weight", "ssm_beta.weight", "vheads", GDN, False),
    ("linear_attn.in_proj_a.weight", "ssm_alpha.weight", "vheads", GDN, False),
    ("linear_attn.conv1d.weight", "ssm_conv1d.weight", "conv", GDN, False),
    ("linear_attn.A_log", "ssm_a", "negexp", GDN, False),
    ("linear_attn.dt_bias", "ssm_dt.bias", "vheads", GDN, False),
    ("linear_attn.norm.weight", "ssm_norm.weight", "none", GDN, False),
    ("linear_attn.out_proj.weight", "ssm_out.weight", "vcols", GDN, False),
    # Clover's block tensors (spec 3.3, 4.3) [assumed shapes]; written after ssm_out
    ("linear_attn.conv_right_weight", "ssm_conv1d_right.weight", "conv", GDN, True),
    ("linear_attn.bd_softmax_logit_scale", "bd_logit_scale", "vheads", GDN, True),
    ("linear_attn.bd_softmax_history_bias", "bd_history_bias", "vheads", GDN, True),
    ("linear_attn.bd_softmax_history_c", "bd_history_c", "vheads", GDN, True),
    # Gated full attention (spec 2.2); q_proj keeps [query | gate] per head
    ("self_attn.q_proj.weight", "attn_q.weight", "none", ATTN, False),
    ("self_attn.k_proj.weight", "attn_k.weight", "none", ATTN, False),
    ("self_attn.v_proj.weight", "attn_v.weight", "none", ATTN, False),
    ("self_attn.o_proj.weight", "attn_output.weight", "none", ATTN, False),
    ("self_attn.q_norm.weight", "attn_q_norm.weight", "norm1p", ATTN, False),
    ("self_attn.k_norm.weight", "attn_k_norm.weight", "norm1p", ATTN, False),
    ("post_attention_layernorm.weight", "post_attention_norm.weight", "norm1p", ANY, False),
    # MoE (spec 2.3)
    ("mlp.gate.weight", "ffn_gate_inp.weight", "none", ANY, False),
    ("mlp.experts.gate_up_proj", ("ffn_gate_exps.weight", "ffn_up_exps.weight"), "split_gate_up", ANY, False),
    ("mlp.experts.down_proj", "ffn_down_exps.weight", "none", ANY, False),
    ("mlp.shared_expert_gate.weight", "ffn_gate_inp_shexp.weight", "flat", ANY, False),
    ("mlp.shared_expert.gate_proj.weight", "ffn_gate_shexp.weight", "none", ANY, False),
    ("mlp.shared_expert.up_proj.weight", "ffn_up_shexp.weight", "none", ANY, False),
    ("mlp.shared_expert.down_proj.weight", "ffn_down_shexp.weight", "none", ANY, False),
]

# Per-expert HF layout: mlp.experts.{e}.{gate,up,down}_proj.weight -> stacked GGUF tensor.
PER_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
PER_EXPERT_MAP = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight",
                  "down": "ffn_down_exps.weight"}

# Fused expert tensors are also seen with a ".weight" suffix in some exports.
FUSED_ALIASES = {
    "mlp.experts.gate_up_proj.weight": "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj.weight": "mlp.experts.down_proj",
}

# Multi-token prediction (MTP) block, kept as llama.cpp's converter keeps it (conversion/qwen.py
# _QwenMtpMixin). HF stores it at the top level under ``mtp.`` (also seen as ``model.mtp.`` and
# ``model.language_model.mtp.``). ``mtp.layers.{j}.*`` is an ordinary full-attention MoE decoder
# layer, written as block ``num_hidden_layers + j`` with the LAYER_MAP names and transforms; the
# four tensors below belong to the first MTP block (``blk.{num_hidden_layers}.``). All four
# norms are zero-centred (llama.cpp adds 1 to every ``*norm.weight`` but the GDN gated norm).
MTP_PREFIXES = ("mtp.", "model.mtp.", "model.language_model.mtp.")
# HF suffix after the MTP prefix -> (GGUF suffix after "blk.{n_layer}.", transform, required)
MTP_GLOBAL_MAP = {
    "fc.weight": ("nextn.eh_proj.weight", "none", True),  # [H, 2H]
    "pre_fc_norm_embedding.weight": ("nextn.enorm.weight", "norm1p", True),
    "pre_fc_norm_hidden.weight": ("nextn.hnorm.weight", "norm1p", True),
    # llama.cpp's loader does not require it (TENSOR_NOT_REQUIRED); Qwen3.5/3.6 checkpoints have it
    "norm.weight": ("nextn.shared_head_norm.weight", "norm1p", False),
}

# Per-tensor GGML types (which tensors stay F32, the quantised mixes) are decided by
# clover_gguf/convert/quant_plan.py, which follows llama.cpp's llama-quantize rules by tensor name.

# Clover's block tensors of every GDN layer (spec 3.3): all four in every GDN layer make a Clover
# checkpoint, none a parent. They are F32 in every output, dropped by --arch qwen35moe, and alone
# in the diffusion sidecar.
BLOCK_HF = tuple(r[0] for r in LAYER_MAP if r[4])
BLOCK_GGUF = tuple(r[1] for r in LAYER_MAP if r[4])
LAYER_BY_HF = {row[0]: row for row in LAYER_MAP}
