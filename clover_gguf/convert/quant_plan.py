"""Per-tensor GGML type plan for the converter's outtypes (clover-spec section 4).

``plan_types(arch, hparams, tensors, ftype)`` chooses the type of every GGUF tensor the way
llama.cpp's ``llama-quantize`` does for ``qwen35moe`` (src/llama-quant.cpp of the llama.cpp
vendored in llama-cpp-python 0.3.36: ``tensor_allows_quantization``, ``tensor_get_category``,
``llama_tensor_get_type_impl``, ``tensor_type_fallback``, ``llama_ftype_get_default_type``), for
the file types this project writes. Summary of those rules as they apply here:

- Not quantised (kept as the converter stores them, F32): tensors with fewer than 2 dims
  (after dropping trailing ggml dims of 1), names not ending in ``weight`` (``ssm_a``,
  ``ssm_dt.bias``), ``*_norm.weight``, ``ffn_gate_inp.weight`` (router), and
  anything containing ``ssm_conv1d``. ``ffn_gate_inp_shexp.weight`` is 1-D, hence F32.
- ``output.weight``: Q6_K unless the ftype's type is Q8_0 (then Q8_0); Q8_0 when its row length is
  not a multiple of the default type's block.
- ``attn_v`` and ``attn_qkv`` (GDN) share one counter ``i_attention_wv`` (both count as
  "attn_v-like"); Q4_K_M / Q5_K_M give Q6_K where ``use_more_bits(i, n)``:
  ``i < n/8 or i >= 7n/8 or (i - n/8) % 3 == 2``; IQ4_XS gives Q5_K when n_head/n_head_kv >= 4;
  Q2_K gives Q4_K when n_head/n_head_kv >= 4, else Q3_K; Q3_K_M gives Q5_K for the first two
  (``i_attention_wv < 2``), Q4_K after; Q4_K_S gives Q5_K for the first four.
  (llama.cpp's separate ATTENTION_QKV branch is unreachable since attn_qkv is attn_v-like.)
- ``ffn_down*`` (``ffn_down_exps`` and ``ffn_down_shexp``; layer taken from the name because
  n_expert > 1): Q4_K_M / Q5_K_M give Q6_K on ``use_more_bits(layer, n_layer)``; IQ4_XS gives
  Q5_K for ``layer < n_layer/8`` (no imatrix); Q2_K gives Q3_K; Q3_K_M gives Q5_K for
  ``layer < n_layer/16``, Q4_K after (the Q3_K case is Falcon's only); Q4_K_S gives Q5_K for
  ``layer < n_layer/8``.
- ``attn_output``: with exactly 8 experts Q5_K (Q2_K, Q3_K_M, Q4_K_S, Q4_K_M, IQ4_XS); otherwise
  Q2_K gives Q3_K and Q3_K_M gives Q4_K.
- With exactly 8 experts: attn_v-like and attn_k become Q8_0.
- Everything else that is quantisable (token_embd, attn_q/k, attn_gate, ssm_beta, ssm_alpha,
  ssm_out, ffn_gate/up(_exps/_shexp)) takes the ftype's default type.
- Fallback when the row length ne0 is not a multiple of the block size: Q2_K, Q3_K -> Q4_0,
  Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; 32-block types stay; F16 when even
  the fallback does not divide ne0.

MTP blocks (``nextn_predict_layers``; llama-quantize loads them, ``load_mtp = true``): their layer
tensors take the ordinary rules with the block index from the name, and llama.cpp's layer count
``n_layer_all`` is the GGUF ``block_count``, trunk plus MTP blocks (so the MTP layer's ``ffn_down``
counts in ``use_more_bits`` and its ``attn_v`` in the attn_v-like counter). ``nextn.eh_proj`` is in
no category and takes the default type (llama.cpp's Q8_0 floor for it applies to glm5-next only);
``nextn.enorm`` / ``hnorm`` / ``shared_head_norm`` are 1-D, hence F32.

Clover's block tensors (spec 3.3, 4.3) are F32 under the same rules (``ssm_conv1d_right.weight``
contains ``ssm_conv1d``; ``bd_logit_scale``, ``bd_history_bias``, ``bd_history_c`` are 1-D) and fall
in no counted category, so a ``clover_moe`` file's trunk gets exactly the ``qwen35moe`` types.

Float ftypes (f32, f16, bf16): every quantisable tensor takes that type, no fallback (llama.cpp
does not run the mix logic for non-quantised default types).

No imatrix, no tensor-type overrides, not ``--pure``. Importing this module never imports torch.
"""

from __future__ import annotations

import re
from typing import Mapping

import gguf

from . import tensor_map as TM

Q = gguf.GGMLQuantizationType
F = gguf.LlamaFileType

# outtype -> (llama.cpp LLAMA_FTYPE_* written as general.file_type, default tensor type)
FTYPES = {
    "f32": (F.ALL_F32, Q.F32),
    "f16": (F.MOSTLY_F16, Q.F16),
    "bf16": (F.MOSTLY_BF16, Q.BF16),
    "q8_0": (F.MOSTLY_Q8_0, Q.Q8_0),
    "q4_0": (F.MOSTLY_Q4_0, Q.Q4_0),
    "q2_k": (F.MOSTLY_Q2_K, Q.Q2_K),
    "q3_k_m": (F.MOSTLY_Q3_K_M, Q.Q3_K),
    "q4_k_s": (F.MOSTLY_Q4_K_S, Q.Q4_K),
    "q4_k_m": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "q5_k_m": (F.MOSTLY_Q5_K_M, Q.Q5_K),
    "q6_k": (F.MOSTLY_Q6_K, Q.Q6_K),
    "iq4_xs": (F.MOSTLY_IQ4_XS, Q.IQ4_XS),
}
OUTTYPES = tuple(FTYPES)
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

# llama.cpp tensor_type_fallback (types this plan can produce)
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.IQ4_XS: Q.IQ4_NL}

_LAYER_RE = re.compile(r"^blk\.(\d+)\.")


def outtype_name(outtype: str) -> str:
    """The ``OUTTYPES`` name of ``outtype``, in any letter case (``Q4_K_M`` is ``q4_k_m``, as
    llama-quantize's type names). ValueError naming the choices for anything else."""
    name = outtype.lower() if isinstance(outtype, str) else outtype
    if name not in FTYPES:
        raise ValueError(f"outtype {outtype!r}: expected one of {', '.join(OUTTYPES)} (any letter case)")
    return name


def file_type(ftype: str) -> int:
    """llama.cpp LLAMA_FTYPE value (general.file_type) of outtype ``ftype``. KeyError if unknown."""
    return int(FTYPES[ftype][0])


def block_size(t) -> int:
    """Elements per block of GGML type ``t`` (1 for float types)."""
    return gguf.GGML_QUANT_SIZES[Q(t)][0]


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's layer pattern for the _M mixes: first eighth, last eighth, every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def category(name: str) -> str:
    """llama.cpp tensor_get_category (first match wins, substring tests as in the C++)."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for sub, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                     ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if sub in name:
            return cat
    return "other"


def _is_attn_v_like(cat: str) -> bool:
    return cat in ("attn_v", "attn_qkv", "attn_kv_b")


def _n_dims(ne: tuple) -> int:
    """ggml_n_dims: number of dims after dropping trailing ne == 1 (at least 1)."""
    n = len(ne)
    while n > 1 and ne[n - 1] == 1:
        n -= 1
    return max(n, 1)


def allows_quantization(name: str, ne: tuple) -> bool:
    """llama.cpp tensor_allows_quantization, restricted to the names a qwen35moe/clover_moe file has.

    ``ne`` is the ggml shape (ne0 first)."""
    if _n_dims(ne) < 2:
        return False
    return (name.endswith("weight") and "_norm.weight" not in name
            and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name)


def _layer_of(name: str) -> int:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else -1


def _hp(hparams, *keys):
    for k in keys:
        if isinstance(hparams, Mapping):
            if k in hparams:
                return hparams[k]
        elif hasattr(hparams, k):
            return getattr(hparams, k)
    raise KeyError(f"hparams: none of {keys}")


def plan_types(arch: str, hparams, tensors, ftype: str) -> dict:
    """Per-tensor GGML type for outtype ``ftype`` (llama.cpp's qwen35moe rules; module docstring).

    arch: "qwen35moe" or "clover_moe" (same rules). hparams: ``convert.convert.HParams`` or a dict
    / object with block_count (trunk + MTP blocks; else n_layer plus an optional n_mtp),
    E (experts), nh (attention heads), nkv (KV heads); the HF config names num_hidden_layers,
    num_experts, num_attention_heads, num_key_value_heads are accepted too. tensors: mapping (or
    iterable of pairs) GGUF name -> shape in numpy order (last entry = row length ne0). ftype: one
    of ``OUTTYPES`` (any letter case).

    Returns {name: gguf.GGMLQuantizationType}. Raises ValueError for an unknown ftype.
    """
    ftype = outtype_name(ftype)
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    ne = {name: tuple(reversed(tuple(int(s) for s in shape))) or (1,) for name, shape in items}
    default = FTYPES[ftype][1]
    try:  # llama.cpp's n_layer_all = GGUF block_count (trunk + MTP blocks)
        n_layer = int(_hp(hparams, "block_count"))
    except KeyError:
        n_layer = int(_hp(hparams, "n_layer", "num_hidden_layers"))
        try:
            n_layer += int(_hp(hparams, "n_mtp"))
        except KeyError:
            pass
    n_expert = max(1, int(_hp(hparams, "E", "num_experts", "expert_count")))
    n_head = int(_hp(hparams, "nh", "num_attention_heads"))
    n_head_kv = int(_hp(hparams, "nkv", "num_key_value_heads"))
    n_gqa = n_head // n_head_kv if n_head_kv else 0

    cats = {name: category(name) for name in ne}
    n_attention_wv = sum(1 for c in cats.values() if _is_attn_v_like(c))  # init_quantize_state_counters
    tied = "output.weight" not in ne
    # llama.cpp visits weights in its loader's order: by layer (non-layer tensors first), then name
    order = sorted(ne, key=lambda n: (_layer_of(n), n))
    i_attention_wv = 0
    i_ffn_down = 0
    out = {}
    for name in order:
        shape = ne[name]
        if not allows_quantization(name, shape):
            out[name] = Q.F32  # the converter stores all of these as F32; llama.cpp keeps them
            continue
        t = default
        if t in FLOAT_TYPES:
            out[name] = t
            continue
        cat = cats[name]
        ne0 = shape[0]
        # --- llama_tensor_get_type_impl, branches reachable for FTYPES ---
        if cat == "output" or (tied and cat == "token_embd"):
            if ne0 % block_size(t) != 0:
                t = Q.Q8_0
            elif t != Q.Q8_0:
                t = Q.Q6_K
        elif cat == "token_embd":
            pass  # only the IQ1/IQ2/IQ3/TQ mixes change token_embd
        elif _is_attn_v_like(cat):
            if ftype == "q2_k":
                t = Q.Q4_K if n_gqa >= 4 else Q.Q3_K
            elif ftype == "q3_k_m":
                t = Q.Q5_K if i_attention_wv < 2 else Q.Q4_K
            elif ftype == "iq4_xs" and n_gqa >= 4:
                t = Q.Q5_K
            elif ftype in ("q4_k_m", "q5_k_m") and use_more_bits(i_attention_wv, n_attention_wv):
                t = Q.Q6_K
            elif ftype == "q4_k_s" and i_attention_wv < 4:
                t = Q.Q5_K
            if n_expert == 8:
                t = Q.Q8_0
            i_attention_wv += 1
        elif cat == "attn_k":
            if n_expert == 8:
                t = Q.Q8_0
        elif cat == "ffn_down":
            if n_expert > 1:
                i_layer = _layer_of(name)
                if not 0 <= i_layer < n_layer:
                    raise ValueError(f"tensor {name}: bad layer for n_layer {n_layer}")
            else:
                i_layer = i_ffn_down
            if ftype == "q2_k":
                t = Q.Q3_K
            elif ftype == "q3_k_m":  # not Falcon: Q4_K from n_layer/16 on
                t = Q.Q5_K if i_layer < n_layer // 16 else Q.Q4_K
            elif ftype == "q4_k_m":
                if use_more_bits(i_layer, n_layer):
                    t = Q.Q6_K
            elif ftype == "iq4_xs" and i_layer < n_layer // 8:  # no imatrix
                t = Q.Q5_K
            elif ftype == "q5_k_m" and use_more_bits(i_layer, n_layer):
                t = Q.Q6_K
            elif ftype == "q4_k_s" and i_layer < n_layer // 8:
                t = Q.Q5_K
            i_ffn_down += 1
        elif cat == "attn_output":
            if n_expert == 8:
                if ftype in ("q2_k", "q3_k_m", "q4_k_s", "q4_k_m", "iq4_xs"):
                    t = Q.Q5_K
            elif ftype == "q2_k":
                t = Q.Q3_K
            elif ftype == "q3_k_m":
                t = Q.Q4_K
        # --- tensor_type_fallback ---
        if ne0 % block_size(t) != 0:
            if t in _FALLBACK:
                t = _FALLBACK[t]
            if ne0 % block_size(t) != 0:
                t = Q.F16
        out[name] = t
    return {name: out[name] for name, _ in items}


def tensor_shapes(hparams, arch: str = "qwen35moe") -> list:
    """The GGUF tensors of a qwen35moe / clover_moe model in the converter's file order (contract
    layout), as [(name, numpy-order shape)], from hyperparameters alone (no weights).

    hparams: ``convert.convert.HParams`` (attributes H, n_layer, nh, nkv, hd, Hk, Hv, dk, dv, K,
    E, I, Is, V, layer_types, optional n_mtp). arch "clover_moe" adds the block tensors of spec
    3.3 after each GDN layer's ssm_out (the complete file); n_mtp > 0 adds the MTP blocks (full
    attention, then the ``nextn.*`` tensors in the first one) after the trunk, as the converter
    writes them.
    """
    h = hparams
    C = 2 * h.Hk * h.dk + h.Hv * h.dv
    n_mtp = int(getattr(h, "n_mtp", 0) or 0)
    out = [("token_embd.weight", (h.V, h.H))]
    for i in range(h.n_layer + n_mtp):
        b = f"blk.{i}."
        out.append((b + "attn_norm.weight", (h.H,)))
        if i < h.n_layer and h.layer_types[i] == "linear_attention":
            out += [(b + "attn_qkv.weight", (C, h.H)), (b + "attn_gate.weight", (h.Hv * h.dv, h.H)),
                    (b + "ssm_beta.weight", (h.Hv, h.H)), (b + "ssm_alpha.weight", (h.Hv, h.H)),
                    (b + "ssm_conv1d.weight", (C, h.K)), (b + "ssm_a", (h.Hv,)),
                    (b + "ssm_dt.bias", (h.Hv,)), (b + "ssm_norm.weight", (h.dv,)),
                    (b + "ssm_out.weight", (h.H, h.Hv * h.dv))]
            if arch == "clover_moe":
                out += block_shapes(h, i)
        else:
            out += [(b + "attn_q.weight", (h.nh * 2 * h.hd, h.H)), (b + "attn_k.weight", (h.nkv * h.hd, h.H)),
                    (b + "attn_v.weight", (h.nkv * h.hd, h.H)), (b + "attn_output.weight", (h.H, h.nh * h.hd)),
                    (b + "attn_q_norm.weight", (h.hd,)), (b + "attn_k_norm.weight", (h.hd,))]
        out += [(b + "post_attention_norm.weight", (h.H,)), (b + "ffn_gate_inp.weight", (h.E, h.H)),
                (b + "ffn_gate_exps.weight", (h.E, h.I, h.H)), (b + "ffn_up_exps.weight", (h.E, h.I, h.H)),
                (b + "ffn_down_exps.weight", (h.E, h.H, h.I)), (b + "ffn_gate_inp_shexp.weight", (h.H,)),
                (b + "ffn_gate_shexp.weight", (h.Is, h.H)), (b + "ffn_up_shexp.weight", (h.Is, h.H)),
                (b + "ffn_down_shexp.weight", (h.H, h.Is))]
        if i == h.n_layer:
            out += [(b + "nextn.eh_proj.weight", (h.H, 2 * h.H)), (b + "nextn.enorm.weight", (h.H,)),
                    (b + "nextn.hnorm.weight", (h.H,)), (b + "nextn.shared_head_norm.weight", (h.H,))]
    out += [("output_norm.weight", (h.H,)), ("output.weight", (h.V, h.H))]
    return out


def block_shapes(hparams, i: int) -> list:
    """Clover's block tensors of GDN layer ``i`` (spec 4.3), [(name, numpy-order shape)], in file
    order: ``ssm_conv1d_right.weight`` {K-1, C}, then ``bd_logit_scale``, ``bd_history_bias``,
    ``bd_history_c`` {Hv}; all F32."""
    h = hparams
    shapes = {"ssm_conv1d_right.weight": (2 * h.Hk * h.dk + h.Hv * h.dv, h.K - 1)}
    return [(f"blk.{i}.{g}", shapes.get(g, (h.Hv,))) for g in TM.BLOCK_GGUF]
