"""HF safetensors checkpoint -> GGUF converter for Clover and Qwen3.5/3.6-MoE (clover-spec section 4).

``convert(hf_dir, out_path, outtype="bf16", arch=None, ...)`` reads a Hugging Face checkpoint
(config.json, optional generation_config.json, tokenizer.json, tokenizer_config.json, one or
more safetensors shards) and writes GGUF files in the layouts of docs/gguf-layout.md: llama.cpp's
``qwen35moe`` for a parent, ``clover_moe`` for Clover (the same trunk under the ``clover_moe.``
prefix plus ``expert_shared_count``), with Clover's block tensors and decoding record
(``convert.record``) in one complete file, or split into a llama.cpp-compatible trunk and a
diffusion sidecar, or the sidecar alone. Tensor names come from one table, ``convert.tensor_map``.

Layouts (detected from config.json and the tensor names): ``Qwen3_5MoeForCausalLM`` (prefix
``model.``), ``Qwen3_5MoeForConditionalGeneration`` (prefix ``model.language_model.``, text config
under ``text_config``; ``visual.*`` / ``model.visual.*`` dropped), ``CloverMoeModelLM`` (either
prefix; spec 3.4), fused 3-D experts or per-expert 2-D tensors, and the ``mtp.*``
multi-token-prediction block (kept as llama.cpp keeps it, see ``convert``; ``--no-mtp`` drops it).

Design:

- Everything is checked before any output is opened: the shard set against
  ``model.safetensors.index.json``, every shard header, every tensor name (unknown ones are an
  error naming them), every tensor shape against the config, the completeness of every layer,
  the block tensors (all four in every GDN layer, or none: spec 3.4), the decoding record and
  the tokenizer. Each output is written to ``OUT.part`` and renamed when every output is
  complete, so a failed run leaves no output file.
- Streaming: tensor infos are registered with ``gguf.GGUFWriter.add_tensor_info`` first; the
  data are then produced and written one piece at a time (one expert, or up to 16 MiB of rows),
  read straight from the shard files with ``numpy.fromfile`` at each tensor's offset. Peak
  memory is a few pieces plus the tokenizer metadata, independent of the model size. The
  sidecar alone (``diffusion_only``) opens only the shards holding block tensors and reads only
  those tensors' bytes.
- No torch: safetensors headers are parsed here; BF16 data are handled as uint16 bit patterns
  and stay bit-exact for ``outtype="bf16"``.
- Quantised outtypes (q8_0, q4_0, q2_k, q3_k_m, q4_k_s, q4_k_m, q5_k_m, q6_k, iq4_xs; any letter
  case): the per-tensor types come
  from ``convert.quant_plan`` (llama.cpp's llama-quantize rules for qwen35moe); each piece is
  quantised by the native quantisers (``clover_from_f32``, byte-equal to ggml's reference
  quantisers) over row chunks on ``threads`` threads (cffi releases the GIL).

Everything here is numpy, json, gguf and tqdm; importing it never imports torch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import struct
import sys
import warnings
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from . import quant_plan as QP
from . import record as R
from . import tensor_map as TM

ARCH_CLOVER = "clover_moe"
ARCH_PARENT = "qwen35moe"
ARCHES = (ARCH_CLOVER, ARCH_PARENT)
OUTTYPES = QP.OUTTYPES  # f32 f16 bf16 q8_0 q4_0 q2_k q3_k_m q4_k_s q4_k_m q5_k_m q6_k iq4_xs

# Pre-tokenizer regexes (contract: llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35 / QWEN2), as they appear
# in tokenizer.json's Split pre-tokenizer.
QWEN35_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_BY_REGEX = {QWEN35_REGEX: "qwen35", QWEN2_REGEX: "qwen2"}

# gguf TokenType values (contract).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

PIECE_BYTES = 16 << 20  # rows of a large unpermuted tensor are read and written in pieces of this size


class ConvertError(ValueError):
    """A checkpoint the converter cannot convert; the message names the file, tensor or key."""


class MissingShardError(ConvertError, FileNotFoundError):
    """A safetensors shard listed in model.safetensors.index.json does not exist."""


class ConvertWarning(UserWarning):
    """Something converted as transformers / llama.cpp would, but worth telling the user: a
    safetensors file the checkpoint does not use (ignored), or f16 output overflowing to inf."""


# ---------------------------------------------------------------------------------------------
# Safetensors (read lazily, without torch)
# ---------------------------------------------------------------------------------------------

# safetensors dtype -> numpy dtype used to hold the raw data (BF16 kept as uint16 bit patterns).
_ST_DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}


@dataclass
class SourceTensor:
    """One tensor inside a safetensors file: name, file, absolute data offset, shape, dtype."""

    name: str
    path: pathlib.Path
    offset: int
    shape: tuple
    dtype: str  # safetensors dtype string ("BF16", "F16", "F32")

    @property
    def np_dtype(self) -> np.dtype:
        return _ST_DTYPES[self.dtype]

    @property
    def row_len(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return math.prod(self.shape[:-1]) if len(self.shape) > 1 else 1

    def read_rows(self, r0: int, r1: int) -> np.ndarray:
        """Rows r0..r1-1 of the tensor viewed as 2-D [prod(shape[:-1]), shape[-1]]."""
        n = self.row_len
        dt = self.np_dtype
        with open(self.path, "rb") as f:
            a = np.fromfile(f, dtype=dt, count=(r1 - r0) * n, offset=self.offset + r0 * n * dt.itemsize)
        if a.size != (r1 - r0) * n:
            raise ConvertError(f"{self.path.name}: tensor {self.name} is truncated")
        return a.reshape(r1 - r0, n)

    def read(self) -> np.ndarray:
        """The whole tensor with its HF shape (raw dtype; BF16 as uint16)."""
        return self.read_rows(0, self.n_rows).reshape(self.shape)


def read_safetensors_header(path: pathlib.Path) -> dict[str, SourceTensor]:
    """Parse a safetensors file's JSON header. Returns name -> SourceTensor.

    Raises ConvertError on a malformed header, an unsupported dtype, or data outside the file.
    """
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConvertError(f"{path.name}: not a safetensors file (shorter than 8 bytes)")
        (hlen,) = struct.unpack("<Q", raw)
        if 8 + hlen > size:
            raise ConvertError(f"{path.name}: safetensors header length {hlen} exceeds the file size {size}")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConvertError(f"{path.name}: bad safetensors header: {e}") from None
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = meta.get("dtype")
        shape = tuple(int(s) for s in meta.get("shape", ()))
        b0, b1 = (int(x) for x in meta.get("data_offsets", (0, 0)))
        if dtype not in _ST_DTYPES:
            raise ConvertError(f"tensor {name} ({path.name}): dtype {dtype} not supported "
                               f"(expected one of {', '.join(_ST_DTYPES)})")
        if b1 - b0 != math.prod(shape) * _ST_DTYPES[dtype].itemsize or base + b1 > size:
            raise ConvertError(f"tensor {name} ({path.name}): data_offsets {[b0, b1]} do not match "
                               f"shape {list(shape)} {dtype} within a file of {size} bytes")
        out[name] = SourceTensor(name, path, base + b0, shape, dtype)
    return out


INDEX_NAME = "model.safetensors.index.json"


def _read_weight_map(index_path: pathlib.Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConvertError(f"{index_path.name}: cannot read weight_map: {e}") from None
    if not isinstance(weight_map, dict):
        raise ConvertError(f"{index_path.name}: weight_map is not an object")
    return weight_map


def load_tensor_index(hf_dir: pathlib.Path, ignored: list | None = None) -> dict[str, SourceTensor]:
    """Find every tensor of the checkpoint without reading any data (spec 4.3).

    With ``model.safetensors.index.json``, every shard it lists must exist (MissingShardError
    naming the first missing one) and hold the tensors the index assigns to it. Without an index,
    ``model.safetensors`` or else every ``*.safetensors`` file is used. Raises ConvertError when
    no weights are found or a tensor appears twice.

    Stray files: a ``*.safetensors`` file in ``hf_dir`` that the index does not list (or, without
    an index, any other ``*.safetensors`` next to ``model.safetensors``) is not read, as
    transformers (``from_pretrained`` loads the index's shards only) and llama.cpp's converter
    (the index's ``weight_map`` values) do; never merged. Each one gets a ConvertWarning naming
    it, and its name is appended to ``ignored`` when a list is given.
    """
    index_path = hf_dir / INDEX_NAME
    tensors: dict[str, SourceTensor] = {}

    def warn_unused(used):
        why = (f"not listed in {index_path.name}" if index_path.is_file()
               else "no index, and model.safetensors is the checkpoint")
        for p in sorted(hf_dir.glob("*.safetensors")):
            if p.name not in used:
                warnings.warn(f"{p.name}: {why}; ignored, not merged (as transformers and llama.cpp do)",
                              ConvertWarning, stacklevel=3)
                if ignored is not None:
                    ignored.append(p.name)

    if index_path.is_file():
        weight_map = _read_weight_map(index_path)
        shards = sorted(set(weight_map.values()))
        for s in shards:  # check the whole shard set before reading any header
            if not (hf_dir / s).is_file():
                raise MissingShardError(f"missing shard {s} (listed in {index_path.name})")
        headers = {s: read_safetensors_header(hf_dir / s) for s in shards}
        warn_unused(set(shards))
        for name, s in weight_map.items():
            if name not in headers[s]:
                raise ConvertError(f"tensor {name}: {index_path.name} places it in {s}, which does not contain it")
        for s, hdr in headers.items():
            for name, t in hdr.items():
                if weight_map.get(name) != s:
                    raise ConvertError(f"tensor {name} in {s} is not listed for that shard in {index_path.name}")
                tensors[name] = t
        return tensors
    files = [hf_dir / "model.safetensors"] if (hf_dir / "model.safetensors").is_file() \
        else sorted(hf_dir.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{hf_dir}: no model.safetensors.index.json and no *.safetensors files")
    warn_unused({p.name for p in files})
    for p in files:
        for name, t in read_safetensors_header(p).items():
            if name in tensors:
                raise ConvertError(f"tensor {name} appears in both {tensors[name].path.name} and {p.name}")
            tensors[name] = t
    return tensors


def is_block_name(name: str) -> bool:
    """Whether an HF tensor name ends in one of Clover's block-tensor suffixes (spec 3.3)."""
    return any(name.endswith("." + s) for s in TM.BLOCK_HF)


def load_block_sources(hf_dir: pathlib.Path) -> dict[str, SourceTensor]:
    """The tensors named like Clover's block tensors, reading no tensor data and, with an index,
    only the headers of the shards that hold them: the other shards need not be present
    (``--diffusion-only`` from a partial download). Raises MissingShardError for a needed shard
    that is absent, ConvertError for an index that places a tensor in a shard without it."""
    index_path = hf_dir / INDEX_NAME
    if not index_path.is_file():
        return {n: t for n, t in load_tensor_index(hf_dir).items() if is_block_name(n)}
    weight_map = _read_weight_map(index_path)
    headers: dict[str, dict] = {}
    out = {}
    for name in sorted(n for n in weight_map if is_block_name(n)):
        shard = weight_map[name]
        if shard not in headers:
            if not (hf_dir / shard).is_file():
                raise MissingShardError(f"missing shard {shard} (listed in {index_path.name} for tensor {name})")
            headers[shard] = read_safetensors_header(hf_dir / shard)
        if name not in headers[shard]:
            raise ConvertError(f"tensor {name}: {index_path.name} places it in {shard}, which does not contain it")
        out[name] = headers[shard][name]
    return out


# ---------------------------------------------------------------------------------------------
# Hyperparameters
# ---------------------------------------------------------------------------------------------

@dataclass
class HParams:
    """Text-model hyperparameters (spec section 1) read from config.json."""

    H: int
    n_layer: int
    nh: int
    nkv: int
    hd: int
    Hk: int
    Hv: int
    dk: int
    dv: int
    K: int
    E: int
    k_used: int
    I: int
    Is: int
    V: int
    eps: float
    rope_theta: float
    rot_dims: int
    sections: list
    ctx: int
    interval: int
    layer_types: list
    tie: bool
    eos_token_id: int | None = None
    n_shared: int = 1  # num_shared_experts (spec 3.4; the engine runs exactly one)
    mtp_config: int = 0  # mtp_num_hidden_layers in config.json (0 when absent)
    n_mtp: int = 0  # MTP blocks written (set by build_plan from the tensors; 0 with --no-mtp)

    @property
    def C(self) -> int:
        return 2 * self.Hk * self.dk + self.Hv * self.dv

    @property
    def block_count(self) -> int:
        """GGUF block_count: the trunk layers plus the MTP blocks (llama.cpp's n_layer_all)."""
        return self.n_layer + self.n_mtp

    def layer_type(self, i: int) -> str:
        """Kind of block i; MTP blocks (i >= n_layer) are full-attention layers."""
        return self.layer_types[i] if i < self.n_layer else TM.ATTN


def read_hparams(config: dict) -> HParams:
    """Read the Qwen3.5-MoE text config (top level, or under "text_config"). Raises ConvertError
    naming a missing or inconsistent key."""
    tc = config.get("text_config") or config

    def req(key):
        if key in tc and tc[key] is not None:
            return tc[key]
        if key in config and config[key] is not None:
            return config[key]
        raise ConvertError(f"config.json: missing {key}")

    n_layer = int(req("num_hidden_layers"))
    nh = int(req("num_attention_heads"))
    H = int(req("hidden_size"))
    hd = int(tc.get("head_dim") or H // nh)
    Hk, Hv = int(req("linear_num_key_heads")), int(req("linear_num_value_heads"))
    if Hv % Hk:
        raise ConvertError(f"config.json: linear_num_value_heads {Hv} is not a multiple of linear_num_key_heads {Hk}")
    if tc.get("attn_output_gate", True) is False:
        raise ConvertError("config.json: attn_output_gate false is not supported (Qwen3.5 gated attention)")
    rp = dict(tc.get("rope_parameters") or {})
    rs = tc.get("rope_scaling") or {}
    theta = rp.get("rope_theta", tc.get("rope_theta", 10000.0))
    prf = rp.get("partial_rotary_factor", tc.get("partial_rotary_factor", 0.25))
    sections = list(rp.get("mrope_section") or rs.get("mrope_section") or [11, 11, 10])
    sections = (sections + [0, 0, 0, 0])[:4]

    interval = tc.get("full_attention_interval")
    lt = tc.get("layer_types")
    if lt is None:
        interval = int(interval or 4)
        lt = [TM.ATTN if (i + 1) % interval == 0 else TM.GDN for i in range(n_layer)]
    else:
        lt = list(lt)
        if len(lt) != n_layer or any(t not in (TM.ATTN, TM.GDN) for t in lt):
            raise ConvertError(f"config.json: layer_types must list {n_layer} entries of "
                               f"'{TM.GDN}'/'{TM.ATTN}', got {lt}")
        if interval is None:
            interval = (lt.index(TM.ATTN) + 1) if TM.ATTN in lt else n_layer + 1
        interval = int(interval)
        want = [TM.ATTN if (i + 1) % interval == 0 else TM.GDN for i in range(n_layer)]
        if lt != want:
            raise ConvertError(f"config.json: layer_types {lt} do not follow full_attention_interval "
                               f"{interval} (layer i is full attention when (i+1) % interval == 0)")
    eos = tc.get("eos_token_id", config.get("eos_token_id"))
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    n_shared = tc.get("num_shared_experts", config.get("num_shared_experts", 1))
    if n_shared != 1 or isinstance(n_shared, bool):
        raise ConvertError(f"config.json: num_shared_experts {n_shared!r}: expected 1 (the engine and "
                           f"llama.cpp's clover_moe run one shared expert)")
    return HParams(
        H=H, n_layer=n_layer, nh=nh, nkv=int(req("num_key_value_heads")), hd=hd, Hk=Hk, Hv=Hv,
        dk=int(req("linear_key_head_dim")), dv=int(req("linear_value_head_dim")),
        K=int(tc.get("linear_conv_kernel_dim", 4)), E=int(req("num_experts")),
        k_used=int(req("num_experts_per_tok")), I=int(req("moe_intermediate_size")),
        Is=int(req("shared_expert_intermediate_size")), V=int(req("vocab_size")),
        eps=float(tc.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
        rot_dims=int(hd * float(prf)), sections=[int(s) for s in sections],
        ctx=int(tc.get("max_position_embeddings", 262144)), interval=interval, layer_types=lt,
        tie=bool(tc.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        eos_token_id=None if eos is None else int(eos), n_shared=1,
        mtp_config=int(tc.get("mtp_num_hidden_layers", config.get("mtp_num_hidden_layers")) or 0),
    )


# config.json "architectures" this converter reads (spec 3.4 and 4.3); the tensor prefix is found
# from the tensor names, so any of these may use either prefix.
CLOVER_ARCHITECTURE = "CloverMoeModelLM"
KNOWN_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", CLOVER_ARCHITECTURE)


def _check_architecture(config: dict) -> None:
    """Raise ConvertError when config.json names an architecture this converter cannot read
    (absent "architectures" is accepted)."""
    archs = config.get("architectures")
    if not archs:
        return
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"config.json: architectures {archs!r} is not a list of names")
    if not any(a in KNOWN_ARCHITECTURES for a in archs):
        raise ConvertError(f"config.json: architectures {archs} not supported (expected one of "
                           f"{', '.join(KNOWN_ARCHITECTURES)})")


def _hf_shapes(hp: HParams) -> dict[str, list[tuple]]:
    """Accepted HF shapes per name suffix (the first is the canonical one)."""
    H, C, Hv, dv, K = hp.H, hp.C, hp.Hv, hp.dv, hp.K
    return {
        "embed_tokens.weight": [(hp.V, H)], "norm.weight": [(H,)], "lm_head.weight": [(hp.V, H)],
        "input_layernorm.weight": [(H,)], "post_attention_layernorm.weight": [(H,)],
        "linear_attn.in_proj_qkv.weight": [(C, H)],
        "linear_attn.in_proj_z.weight": [(Hv * dv, H)],
        "linear_attn.in_proj_b.weight": [(Hv, H)], "linear_attn.in_proj_a.weight": [(Hv, H)],
        "linear_attn.conv1d.weight": [(C, 1, K), (C, K)],
        "linear_attn.A_log": [(Hv,)], "linear_attn.dt_bias": [(Hv,)],
        "linear_attn.norm.weight": [(dv,)],
        # block tensors (spec 3.3, 4.3) [assumed shapes]
        "linear_attn.conv_right_weight": [(C, 1, K - 1), (C, K - 1)],
        "linear_attn.bd_softmax_logit_scale": [(Hv,)], "linear_attn.bd_softmax_history_bias": [(Hv,)],
        "linear_attn.bd_softmax_history_c": [(Hv,)],
        "linear_attn.out_proj.weight": [(H, Hv * dv)],
        "self_attn.q_proj.weight": [(hp.nh * 2 * hp.hd, H)],
        "self_attn.k_proj.weight": [(hp.nkv * hp.hd, H)],
        "self_attn.v_proj.weight": [(hp.nkv * hp.hd, H)],
        "self_attn.o_proj.weight": [(H, hp.nh * hp.hd)],
        "self_attn.q_norm.weight": [(hp.hd,)], "self_attn.k_norm.weight": [(hp.hd,)],
        "mlp.gate.weight": [(hp.E, H)],
        "mlp.experts.gate_up_proj": [(hp.E, 2 * hp.I, H)],
        "mlp.experts.down_proj": [(hp.E, H, hp.I)],
        "mlp.experts.gate": [(hp.I, H)], "mlp.experts.up": [(hp.I, H)], "mlp.experts.down": [(H, hp.I)],
        "mlp.shared_expert_gate.weight": [(1, H), (H,)],
        "mlp.shared_expert.gate_proj.weight": [(hp.Is, H)],
        "mlp.shared_expert.up_proj.weight": [(hp.Is, H)],
        "mlp.shared_expert.down_proj.weight": [(H, hp.Is)],
        # MTP block globals (tensor_map.MTP_GLOBAL_MAP)
        "mtp.fc.weight": [(H, 2 * H)], "mtp.pre_fc_norm_embedding.weight": [(H,)],
        "mtp.pre_fc_norm_hidden.weight": [(H,)], "mtp.norm.weight": [(H,)],
    }


# ---------------------------------------------------------------------------------------------
# Transforms (spec 4.3)
# ---------------------------------------------------------------------------------------------

def v_head_perm(n_k_heads: int, n_v_per_k: int, head_dim: int) -> np.ndarray:
    """Index array ``idx`` with ``out[p] = src[idx[p]]`` that moves value head ``i*r + j`` to
    ``j*Hk + i`` (r = n_v_per_k, Hk = n_k_heads), keeping ``head_dim`` entries per head
    (spec 4.3). Returns int64 [Hk*r*head_dim]."""
    n = n_k_heads * n_v_per_k * head_dim
    return np.arange(n).reshape(n_k_heads, n_v_per_k, head_dim).transpose(1, 0, 2).reshape(n)


def to_f32(a: np.ndarray) -> np.ndarray:
    """Raw safetensors data (uint16 = BF16 bits, float16, float32) -> float32, exactly."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def apply_transform(kind: str, a: np.ndarray, hp: HParams) -> np.ndarray:
    """Apply one whole-tensor transform of ``convert.tensor_map`` to raw data ``a`` (HF shape).

    Permutations keep the raw dtype (so BF16 stays bit-exact); ``norm1p``, ``conv``, ``negexp``
    return float32 (these tensors are F32 in the GGUF). Returns the array in GGUF numpy order.
    """
    r = hp.Hv // hp.Hk
    if kind == "none":
        return a
    if kind == "norm1p":  # zero-centred RMSNorm: the engine multiplies by the stored 1 + w
        return to_f32(a) + np.float32(1.0)
    if kind == "flat":
        return a.reshape(-1)
    if kind == "qkv":
        qk = 2 * hp.Hk * hp.dk
        return np.concatenate([a[:qk], a[qk:][v_head_perm(hp.Hk, r, hp.dv)]], axis=0)
    if kind == "vrows":
        return a[v_head_perm(hp.Hk, r, hp.dv)]
    if kind == "vheads":
        return a[v_head_perm(hp.Hk, r, 1)]
    if kind == "vcols":
        return a[:, v_head_perm(hp.Hk, r, hp.dv)]
    if kind == "conv":  # [C, 1, T] -> [C, T] (ggml {T, C}); conv1d: w[ch, K-1] multiplies the current
        a = to_f32(a).reshape(hp.C, -1)  # token; conv_right_weight: r[ch, d-1] the block row t + d
        qk = 2 * hp.Hk * hp.dk
        return np.concatenate([a[:qk], a[qk:][v_head_perm(hp.Hk, r, hp.dv)]], axis=0)
    if kind == "negexp":  # ssm_a = -exp(A_log), computed in float64 and rounded once to float32
        a = to_f32(a)[v_head_perm(hp.Hk, r, 1)]
        return (-np.exp(a.astype(np.float64))).astype(np.float32)
    raise ConvertError(f"internal: unknown transform {kind!r}")


# ---------------------------------------------------------------------------------------------
# Output plan
# ---------------------------------------------------------------------------------------------

@dataclass
class OutTensor:
    """One GGUF tensor to write: name, numpy-order shape, GGML type, and a producer of pieces
    (arrays whose rows, concatenated, form the tensor viewed as [-1, shape[-1]])."""

    name: str
    shape: tuple
    qtype: object  # gguf.GGMLQuantizationType
    pieces: Callable[[], Iterator[np.ndarray]]
    sources: list = field(default_factory=list)
    block: bool = False  # one of Clover's block tensors (tensor_map.BLOCK_GGUF)

    @property
    def nbytes(self) -> int:
        import gguf
        block, tsize = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * tsize


def _whole(src: SourceTensor, kind: str, hp: HParams):
    return lambda: iter([apply_transform(kind, src.read(), hp)])


def _row_pieces(src: SourceTensor, r0: int = 0, r1: int | None = None, step: int | None = None):
    """Pieces of rows [r0, r1) of src (as 2-D), each at most PIECE_BYTES (or ``step`` rows)."""
    r1 = src.n_rows if r1 is None else r1
    step = step or max(1, PIECE_BYTES // (src.row_len * src.np_dtype.itemsize))

    def gen():
        for s in range(r0, r1, step):
            yield src.read_rows(s, min(r1, s + step))
    return gen


def _expert_half_pieces(src: SourceTensor, E: int, I: int, half: int):
    """gate (half 0) or up (half 1) of fused gate_up [E, 2I, H]: one piece per expert."""
    def gen():
        for e in range(E):
            base = e * 2 * I + half * I
            yield src.read_rows(base, base + I)
    return gen


def _stack_pieces(srcs: list):
    def gen():
        for s in srcs:
            yield from _row_pieces(s)()
    return gen


_NATIVE_OK = {"Q8_0", "Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}


def _quantize_native(a: np.ndarray, qtype, pool=None) -> np.ndarray:
    """Quantise float32 rows ``a`` [n, ne0] with ``clover_from_f32`` (row chunks on ``pool``)."""
    import gguf
    from clover_gguf._ffi import ffi, lib
    n, ne0 = a.shape
    block, tsize = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = ne0 // block * tsize
    out = np.empty((n, row_bytes), dtype=np.uint8)
    if n == 0:
        return out
    src_p = ffi.cast("float *", a.ctypes.data)
    dst_p = ffi.cast("uint8_t *", out.ctypes.data)
    t = int(qtype)

    def run(r0, r1):
        k = lib.clover_from_f32(t, src_p + r0 * ne0, dst_p + r0 * row_bytes, (r1 - r0) * ne0)
        if k != (r1 - r0) * row_bytes:
            raise ConvertError(f"internal: clover_from_f32({qtype.name}) returned {k}")

    workers = getattr(pool, "_max_workers", 1) if pool is not None else 1
    if workers <= 1 or n < 2:
        run(0, n)
    else:
        step = max(1, -(-n // (4 * workers)))
        for f in [pool.submit(run, r, min(n, r + step)) for r in range(0, n, step)]:
            f.result()
    return out


def encode(a: np.ndarray, qtype, pool=None) -> np.ndarray:
    """Encode raw/float data ``a`` [rows, ne0] (uint16 = BF16 bits) as GGML ``qtype`` bytes (a
    C-contiguous array). BF16 input stays bit-exact for BF16; F32 -> BF16 rounds to nearest
    even (ggml's rule); Q8_0, Q4_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS use the native quantisers
    (``pool``: an optional ThreadPoolExecutor for row chunks); Q5_0/Q5_1 (llama.cpp's fallback
    for Q4_K/Q5_K rows that are not a multiple of 256) use gguf.quants. Raises ConvertError for
    any other type."""
    import gguf
    Q = gguf.GGMLQuantizationType
    qtype = Q(qtype)
    if qtype == Q.F32:
        out = to_f32(a)
    elif qtype == Q.BF16:
        out = a if a.dtype == np.uint16 else gguf.quants.quantize(to_f32(a), Q.BF16)
    elif qtype == Q.F16:  # beyond +-65504 rounds to +-inf, as numpy's cast in llama.cpp's converter does
        if a.dtype == np.float16:
            out = a
        else:
            with np.errstate(over="ignore"):
                out = to_f32(a).astype(np.float16)
    elif qtype.name in _NATIVE_OK:
        out = _quantize_native(np.ascontiguousarray(to_f32(a)), qtype, pool)
    elif qtype in (Q.Q5_0, Q.Q5_1):
        out = gguf.quants.quantize(np.ascontiguousarray(to_f32(a)), qtype)
    else:
        raise ConvertError(f"internal: unsupported output type {qtype.name}")
    return np.ascontiguousarray(out)


@dataclass
class Plan:
    """Everything needed to write the GGUF files, all checked before writing: the output arch,
    the hyperparameters, the output tensors in file order (block tensors, ``OutTensor.block``,
    after each GDN layer's ssm_out), the HF tensors not converted, and the HF tensor prefix."""

    arch: str
    hp: HParams
    tensors: list
    dropped: list = field(default_factory=list)
    prefix: str = "model."

    @property
    def trunk(self) -> list:
        return [t for t in self.tensors if not t.block]

    @property
    def block_tensors(self) -> list:
        return [t for t in self.tensors if t.block]


def _layer_and_suffix(rest: str):
    """"layers.{i}.{suffix}" -> (i, suffix) or None."""
    if not rest.startswith("layers."):
        return None
    i, _, suffix = rest[len("layers."):].partition(".")
    if not i.isdecimal() or not suffix:
        return None
    return int(i), suffix


def _names(names: list, n: int = 12) -> str:
    """Names for an error message: the first n, then how many more."""
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def _prefix_of(names) -> str:
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


@dataclass
class _Sorted:
    """HF tensors sorted by where they go (``build_plan``)."""

    glob: dict = field(default_factory=dict)  # GLOBAL_MAP key or "lm_head.weight" -> source
    mtp_glob: dict = field(default_factory=dict)  # MTP_GLOBAL_MAP key -> source
    mtp_prefix: str | None = None
    entries: list = field(default_factory=list)  # (HF name, block index, suffix, source)
    dropped: list = field(default_factory=list)
    unknown: list = field(default_factory=list)  # "name (why)"


class _Shapes:
    """Shape check of HF tensors against the config (``_hf_shapes``)."""

    def __init__(self, hp: HParams):
        self.ok = _hf_shapes(hp)

    def __call__(self, name: str, key: str, shape) -> None:
        ok = self.ok[key]
        if tuple(shape) not in ok:
            raise ConvertError(f"tensor {name}: shape {list(shape)} expected {list(ok[0])}")


def _sort_sources(sources: dict, hp: HParams, prefix: str, no_mtp: bool, check) -> _Sorted:
    """Sort every HF tensor into globals, MTP globals and layer entries (trunk layer i, MTP
    layer j as block n_layer + j); unknown names are collected, not raised."""
    s = _Sorted()
    for n in sorted(sources):
        src = sources[n]
        if n.startswith(("visual.", "model.visual.")):
            s.dropped.append(n)  # spec 4.3: the vision tower is not converted
            continue
        mp = next((p for p in TM.MTP_PREFIXES if n.startswith(p)), None)
        if mp is not None:  # multi-token prediction block (tensor_map.MTP_GLOBAL_MAP)
            if no_mtp:
                s.dropped.append(n)
                continue
            if s.mtp_prefix not in (None, mp):
                raise ConvertError(f"tensor {n}: MTP tensors under two prefixes ({s.mtp_prefix!r} and {mp!r})")
            s.mtp_prefix = mp
            rest = n[len(mp):]
            ls = _layer_and_suffix(rest)
            if rest in TM.MTP_GLOBAL_MAP:
                check(n, "mtp." + rest, src.shape)
                s.mtp_glob[rest] = src
            elif ls is None:
                s.unknown.append(f"{n} (MTP tensors are {mp}layers.N.*, "
                                 f"{', '.join(mp + k for k in TM.MTP_GLOBAL_MAP)})")
            else:
                s.entries.append((n, hp.n_layer + ls[0], ls[1], src))
            continue
        if n == TM.LM_HEAD[0]:
            check(n, "lm_head.weight", src.shape)
            s.glob["lm_head.weight"] = src
            continue
        if not n.startswith(prefix):
            s.unknown.append(f"{n} (expected prefix {prefix!r}, lm_head.weight, mtp.*, visual.*)")
            continue
        rest = n[len(prefix):]
        ls = _layer_and_suffix(rest)
        if rest in TM.GLOBAL_MAP:
            check(n, rest, src.shape)
            s.glob[rest] = src
        elif ls is None:
            s.unknown.append(n)
        elif ls[0] >= hp.n_layer:
            raise ConvertError(f"tensor {n}: layer {ls[0]} >= num_hidden_layers {hp.n_layer}")
        else:
            s.entries.append((n, ls[0], ls[1], src))
    return s


def _check_mtp(s: _Sorted, hp: HParams, no_mtp: bool) -> None:
    """Set hp.n_mtp from the tensors and check it against the config (llama.cpp _QwenMtpMixin)."""
    mtp_layers = sorted({i - hp.n_layer for _, i, _, _ in s.entries if i >= hp.n_layer})
    hp.n_mtp = mtp_layers[-1] + 1 if mtp_layers else 0
    if no_mtp:
        return
    p = s.mtp_prefix
    if hp.n_mtp and mtp_layers != list(range(hp.n_mtp)):
        missing = sorted(set(range(hp.n_mtp)) - set(mtp_layers))
        raise ConvertError(f"missing tensors {p}layers.{missing[0]}.* (MTP layers {mtp_layers} found)")
    if s.mtp_glob and not hp.n_mtp:
        raise ConvertError(f"tensor {p}{next(iter(s.mtp_glob))}: MTP tensors without any {p}layers.N.* layer")
    if hp.mtp_config and hp.n_mtp != hp.mtp_config:
        have = f"{hp.n_mtp} MTP layers ({p}layers.N.*)" if hp.n_mtp else "no mtp.* tensors"
        raise ConvertError(f"config.json: mtp_num_hidden_layers {hp.mtp_config} but the checkpoint has "
                           f"{have}; pass --no-mtp (no_mtp=True) to convert without MTP")
    if hp.n_mtp:
        for key, (gname, _, required) in TM.MTP_GLOBAL_MAP.items():
            if required and key not in s.mtp_glob:
                raise ConvertError(f"missing tensor {p}{key} (blk.{hp.n_layer}.{gname})")


def _layer_sources(entries: list, hp: HParams, check, unknown: list) -> tuple[list, list]:
    """Per block: {HF suffix: source} and {(gate|up|down, expert): source}. Raises ConvertError
    for a tensor in a layer of the wrong kind, a duplicate or a bad shape; unknown suffixes are
    appended to ``unknown``."""
    layer_src: list[dict] = [dict() for _ in range(hp.block_count)]
    experts: list[dict] = [dict() for _ in range(hp.block_count)]
    for n, i, suffix, src in entries:
        suffix = TM.FUSED_ALIASES.get(suffix, suffix)
        m = TM.PER_EXPERT_RE.match(suffix)
        if m:
            e, which = int(m.group(1)), m.group(2)
            if e >= hp.E:
                raise ConvertError(f"tensor {n}: expert {e} >= num_experts {hp.E}")
            if (which, e) in experts[i]:
                raise ConvertError(f"tensor {n} appears twice")
            check(n, f"mlp.experts.{which}", src.shape)
            experts[i][(which, e)] = src
            continue
        row = TM.LAYER_BY_HF.get(suffix)
        if row is None:
            unknown.append(n)
            continue
        _check_layer_kind(n, i, row[3], hp)
        if suffix in layer_src[i]:
            raise ConvertError(f"tensor {n} appears twice")
        check(n, suffix, src.shape)
        layer_src[i][suffix] = src
    return layer_src, experts


def _check_layer_kind(name: str, i: int, kind: str, hp: HParams) -> None:
    lt = hp.layer_type(i)
    if kind != TM.ANY and kind != lt:
        where = (f"layer {i} is a {lt} layer (full_attention_interval {hp.interval})" if i < hp.n_layer
                 else f"MTP layer {i - hp.n_layer} is a {lt} layer")
        raise ConvertError(f"tensor {name}: {where}, not {kind}")


def _is_clover(layer_src: list, hp: HParams, prefix: str) -> bool:
    """True when every GDN layer has the four block tensors, False when none has any; anything
    else raises ConvertError naming the missing ones (spec 3.4)."""
    gdn = [i for i in range(hp.n_layer) if hp.layer_types[i] == TM.GDN]
    want = [(i, s) for i in gdn for s in TM.BLOCK_HF]
    missing = [(i, s) for i, s in want if s not in layer_src[i]]
    if len(missing) == len(want):
        return False
    if missing:
        names = [f"{prefix}layers.{i}.{s} (blk.{i}.{TM.LAYER_BY_HF[s][1]})" for i, s in missing]
        raise ConvertError(f"Clover block tensors incomplete (all four in every GDN layer, or none: spec 3.4): "
                           f"missing {_names(names)}")
    return True


def _block_names(prefix: str) -> str:
    return ", ".join(f"{prefix}layers.N.{s}" for s in TM.BLOCK_HF)


def _choose_arch(arch: str | None, clover: bool, config: dict, prefix: str) -> str:
    """The output arch: ``arch`` when given and possible, else clover_moe for a Clover checkpoint
    and qwen35moe for a parent."""
    if arch not in (None,) + ARCHES:
        raise ConvertError(f"arch {arch!r}: expected one of {', '.join(ARCHES)}")
    expected = _block_names(prefix)
    if arch == ARCH_CLOVER and not clover:
        raise ConvertError(f"--arch {ARCH_CLOVER}: the checkpoint is a parent, with none of Clover's block "
                           f"tensors ({expected})")
    if arch is None and not clover and CLOVER_ARCHITECTURE in (config.get("architectures") or []):
        raise ConvertError(f"config.json: architectures [{CLOVER_ARCHITECTURE!r}] but no GDN layer has Clover's "
                           f"block tensors ({expected}); --arch {ARCH_PARENT} converts the trunk alone")
    return arch or (ARCH_CLOVER if clover else ARCH_PARENT)


def build_plan(config: dict, sources: dict, outtype: str, arch: str | None, no_mtp: bool = False) -> Plan:
    """Map every HF tensor to its GGUF tensor and check names, shapes and completeness; decide
    the output arch (``_choose_arch``).

    Raises ConvertError naming the unknown tensors, or the first misplaced, duplicated, missing
    or misshapen tensor, or the missing block tensors of a partial Clover checkpoint (spec 3.4).
    """
    hp = read_hparams(config)
    _check_architecture(config)
    prefix = _prefix_of(sources)
    check = _Shapes(hp)
    s = _sort_sources(sources, hp, prefix, no_mtp, check)
    _check_mtp(s, hp, no_mtp)
    layer_src, experts = _layer_sources(s.entries, hp, check, s.unknown)
    if s.unknown:
        raise ConvertError(f"unrecognised tensor{'s' if len(s.unknown) > 1 else ''} {_names(s.unknown)}")
    arch = _choose_arch(arch, _is_clover(layer_src, hp, prefix), config, prefix)
    plan = Plan(arch, hp, [], s.dropped, prefix)
    out = plan.tensors

    def need_global(key, gname):
        if key not in s.glob:
            raise ConvertError(f"missing tensor {prefix if key != 'lm_head.weight' else ''}{key} ({gname})")
        return s.glob[key]

    emb = need_global("embed_tokens.weight", "token_embd.weight")
    out.append(_out("token_embd.weight", emb.shape, _row_pieces(emb), [emb]))
    for i in range(hp.block_count):
        hf_layer = f"{prefix}layers.{i}." if i < hp.n_layer else f"{s.mtp_prefix}layers.{i - hp.n_layer}."
        out += _layer_tensors(plan, i, hf_layer, layer_src[i], experts[i])
        if i == hp.n_layer:  # the MTP block's own tensors (llama.cpp nextn.*), after its layer tensors
            out += _nextn_tensors(s.mtp_glob, i, hp)
    onorm = need_global("norm.weight", "output_norm.weight")
    out.append(_out("output_norm.weight", onorm.shape, _whole(onorm, "norm1p", hp), [onorm]))
    if "lm_head.weight" in s.glob:
        head = s.glob["lm_head.weight"]
    elif hp.tie:
        head = emb  # tied embeddings: written as an explicit output.weight (same values)
    else:
        raise ConvertError("missing tensor lm_head.weight (output.weight)")
    out.append(_out("output.weight", head.shape, _row_pieces(head), [head]))
    _set_types(plan, outtype)
    return plan


def _set_types(plan: Plan, outtype: str) -> None:
    """The trunk's types as the qwen35moe plan of the same trunk (convert.quant_plan); block
    tensors F32 (docs/gguf-layout.md)."""
    import gguf
    types = QP.plan_types(plan.arch, plan.hp, {t.name: t.shape for t in plan.trunk}, outtype)
    for t in plan.tensors:
        t.qtype = gguf.GGMLQuantizationType.F32 if t.block else types[t.name]


def _out(gname: str, shape, pieces, srcs, block: bool = False) -> OutTensor:
    return OutTensor(gname, tuple(shape), None, pieces, [s.name for s in srcs], block)


def _layer_tensors(plan: Plan, i: int, hf_layer: str, ls: dict, exp: dict) -> list:
    """The GGUF tensors of block i in file order (tensor_map.LAYER_MAP); block tensors only for
    a clover_moe output (dropped otherwise). Raises ConvertError naming a missing tensor."""
    hp = plan.hp
    lt = hp.layer_type(i)
    fused = "mlp.experts.gate_up_proj" in ls or "mlp.experts.down_proj" in ls
    if fused and exp:
        raise ConvertError(f"{hf_layer}mlp.experts: both fused (gate_up_proj / down_proj) and per-expert "
                           f"({{e}}.gate_proj.weight ...) expert tensors")
    out = []
    for hf_suffix, gsuffix, kind, lkind, block in TM.LAYER_MAP:
        hf_name = hf_layer + hf_suffix
        if lkind != TM.ANY and lkind != lt:
            continue
        if block and plan.arch != ARCH_CLOVER:
            if hf_suffix in ls:
                plan.dropped.append(hf_name)
            continue
        if not fused and kind == "split_gate_up":
            out += _per_expert_tensors(hp, i, hf_layer, exp)
            continue
        if not fused and hf_suffix == "mlp.experts.down_proj":
            continue
        if hf_suffix not in ls:
            g = gsuffix if isinstance(gsuffix, str) else "/".join(gsuffix)
            raise ConvertError(f"missing tensor {hf_name} (blk.{i}.{g})")
        src = ls[hf_suffix]
        if kind == "split_gate_up":
            shape = (hp.E, hp.I, hp.H)
            out.append(_out(f"blk.{i}.{gsuffix[0]}", shape, _expert_half_pieces(src, hp.E, hp.I, 0), [src]))
            out.append(_out(f"blk.{i}.{gsuffix[1]}", shape, _expert_half_pieces(src, hp.E, hp.I, 1), [src]))
        elif kind == "none":  # streamed in row pieces (one expert or <= PIECE_BYTES at a time)
            out.append(_out(f"blk.{i}.{gsuffix}", src.shape, _row_pieces(src), [src]))
        else:
            out.append(_out(f"blk.{i}.{gsuffix}", _out_shape(kind, src.shape, hp), _whole(src, kind, hp), [src],
                            block))
    return out


def _nextn_tensors(mtp_glob: dict, i: int, hp: HParams) -> list:
    out = []
    for key, (gsuffix, kind, _) in TM.MTP_GLOBAL_MAP.items():
        if key in mtp_glob:
            src = mtp_glob[key]
            pieces = _row_pieces(src) if kind == "none" else _whole(src, kind, hp)
            out.append(_out(f"blk.{i}.{gsuffix}", src.shape, pieces, [src]))
    return out


def _per_expert_tensors(hp: HParams, i: int, hf_layer: str, exp: dict) -> list:
    """ffn_{gate,up,down}_exps of block i stacked from per-expert 2-D tensors."""
    out = []
    for which in ("gate", "up", "down"):
        srcs = []
        for e in range(hp.E):
            if (which, e) not in exp:
                raise ConvertError(f"missing tensor {hf_layer}mlp.experts.{e}.{which}_proj.weight "
                                   f"(blk.{i}.{TM.PER_EXPERT_MAP[which]})")
            srcs.append(exp[(which, e)])
        out.append(_out(f"blk.{i}.{TM.PER_EXPERT_MAP[which]}", (hp.E,) + srcs[0].shape, _stack_pieces(srcs), srcs))
    return out


def build_sidecar_plan(hf_dir: pathlib.Path, config: dict) -> Plan:
    """The block tensors alone (the diffusion sidecar, docs/gguf-layout.md), from the block
    tensors' shard headers only (``load_block_sources``). Raises ConvertError for a block tensor
    outside a GDN layer, a bad shape, a partial set (naming the missing ones) or none at all."""
    hp = read_hparams(config)
    _check_architecture(config)
    sources = load_block_sources(hf_dir)
    prefix = _prefix_of(sources)
    check = _Shapes(hp)
    layer_src: list[dict] = [dict() for _ in range(hp.n_layer)]
    for n, src in sorted(sources.items()):
        ls = _layer_and_suffix(n[len(prefix):]) if n.startswith(prefix) else None
        if ls is None or ls[1] not in TM.BLOCK_HF or ls[0] >= hp.n_layer:
            raise ConvertError(f"tensor {n}: a block tensor outside {prefix}layers.0-{hp.n_layer - 1}.linear_attn")
        _check_layer_kind(n, ls[0], TM.GDN, hp)
        check(n, ls[1], src.shape)
        layer_src[ls[0]][ls[1]] = src
    if not _is_clover(layer_src, hp, prefix):
        raise ConvertError(f"{hf_dir}: no Clover block tensors ({_block_names(prefix)}): not a Clover checkpoint, "
                           f"no diffusion sidecar to make")
    plan = Plan(ARCH_CLOVER, hp, [], [], prefix)
    for i in range(hp.n_layer):
        for hf_suffix, gsuffix, kind, _, block in TM.LAYER_MAP:
            if block and hf_suffix in layer_src[i]:
                src = layer_src[i][hf_suffix]
                plan.tensors.append(_out(f"blk.{i}.{gsuffix}", _out_shape(kind, src.shape, hp),
                                         _whole(src, kind, hp), [src], True))
    _set_types(plan, "f32")
    return plan


def _out_shape(kind: str, shape: tuple, hp: HParams) -> tuple:
    if kind == "flat":
        return (math.prod(shape),)
    if kind == "conv":
        return (hp.C, shape[-1])
    return tuple(shape)


# ---------------------------------------------------------------------------------------------
# Tokenizer (spec 4.2)
# ---------------------------------------------------------------------------------------------

@dataclass
class Vocab:
    tokens: list
    types: list
    merges: list
    pre: str
    eos: int | None
    pad: int | None
    bos: int | None
    chat_template: str | None


def _token_content(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def read_vocab(hf_dir: pathlib.Path, hp: HParams) -> Vocab:
    """Read tokenizer.json (byte-level BPE) and tokenizer_config.json.

    Tokens are listed in id order (BPE vocabulary and added tokens), padded to vocab_size with
    ``[PAD{i}]`` (UNUSED). Added special tokens are CONTROL, other added tokens USER_DEFINED.
    Raises ConvertError when tokenizer.json is missing, is not BPE, uses an unknown
    pre-tokenizer regex, or has a token id >= vocab_size.
    """
    tj = hf_dir / "tokenizer.json"
    if not tj.is_file():
        raise ConvertError(f"{hf_dir}: missing tokenizer.json")
    tok = json.loads(tj.read_text(encoding="utf-8"))
    tcfg_path = hf_dir / "tokenizer_config.json"
    tcfg = json.loads(tcfg_path.read_text(encoding="utf-8")) if tcfg_path.is_file() else {}
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise ConvertError(f"tokenizer.json: model type {model.get('type')!r} (expected BPE)")

    # pre-tokenizer: find the Split regex
    regexes = []

    def walk(pt):
        if not isinstance(pt, dict):
            return
        if pt.get("type") == "Split":
            pat = pt.get("pattern") or {}
            regexes.append(pat.get("Regex", pat.get("String")))
        for sub in pt.get("pretokenizers") or []:
            walk(sub)
    walk(tok.get("pre_tokenizer"))
    pres = {PRE_BY_REGEX.get(r) for r in regexes}
    if len(regexes) != 1 or None in pres:
        raise ConvertError(f"tokenizer.json: pre-tokenizer Split regex {regexes} is not the qwen35 (or qwen2) regex")
    pre = pres.pop()

    by_id: dict[int, tuple] = {}
    for t, i in model.get("vocab", {}).items():
        by_id[int(i)] = (t, TOKEN_NORMAL)
    for at in tok.get("added_tokens") or []:
        by_id[int(at["id"])] = (at["content"], TOKEN_CONTROL if at.get("special") else TOKEN_USER_DEFINED)
    if by_id and max(by_id) >= hp.V:
        raise ConvertError(f"tokenizer.json: token id {max(by_id)} >= vocab_size {hp.V} (config.json)")
    tokens, types = [], []
    for i in range(hp.V):
        t, ty = by_id.get(i, (f"[PAD{i}]", TOKEN_UNUSED))
        tokens.append(t)
        types.append(ty)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]

    ids = {t: i for i, t in reversed(list(enumerate(tokens)))}

    def tid(content):
        c = _token_content(content)
        return ids.get(c) if isinstance(c, str) else None

    eos = ids.get("<|im_end|>")
    if eos is None:
        eos = hp.eos_token_id if hp.eos_token_id is not None else tid(tcfg.get("eos_token"))
    pad = ids.get("<|endoftext|>")
    if pad is None:
        pad = tid(tcfg.get("pad_token"))
    bos = tid(tcfg.get("bos_token"))

    chat_template = None
    if (hf_dir / "chat_template.jinja").is_file():
        chat_template = (hf_dir / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        ct = tcfg.get("chat_template")
        if ct is None and (hf_dir / "chat_template.json").is_file():
            ct = json.loads((hf_dir / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
        if isinstance(ct, list):  # [{"name": ..., "template": ...}]
            named = {d.get("name"): d.get("template") for d in ct if isinstance(d, dict)}
            ct = named.get("default", next(iter(named.values()), None))
        chat_template = ct if isinstance(ct, str) and ct else None
    return Vocab(tokens, types, merges, pre, eos, pad, bos, chat_template)


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------

def _file_type(outtype: str) -> int:
    return QP.file_type(outtype)


def add_trunk_metadata(w, hp: HParams, vocab: Vocab, outtype: str, name: str) -> None:
    """The trunk's KV pairs (spec 4.2) under ``w.arch``: llama.cpp's qwen35moe keys, plus
    ``clover_moe.expert_shared_count`` for arch clover_moe (docs/gguf-layout.md)."""
    import gguf
    w.add_type("model")
    w.add_name(name)
    w.add_file_type(_file_type(outtype))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(hp.block_count)  # trunk + MTP blocks, as llama.cpp's converter writes it
    w.add_context_length(hp.ctx)
    w.add_embedding_length(hp.H)
    w.add_feed_forward_length(hp.I)
    w.add_head_count(hp.nh)
    w.add_head_count_kv(hp.nkv)
    w.add_key_length(hp.hd)
    w.add_value_length(hp.hd)
    w.add_layer_norm_rms_eps(hp.eps)
    w.add_rope_freq_base(hp.rope_theta)
    w.add_rope_dimension_count(hp.rot_dims)
    w.add_rope_dimension_sections(hp.sections)
    w.add_expert_count(hp.E)
    w.add_expert_used_count(hp.k_used)
    w.add_expert_feed_forward_length(hp.I)
    w.add_expert_shared_feed_forward_length(hp.Is)
    if w.arch == ARCH_CLOVER:
        w.add_expert_shared_count(hp.n_shared)
    w.add_ssm_conv_kernel(hp.K)
    w.add_ssm_state_size(hp.dk)
    w.add_ssm_group_count(hp.Hk)
    w.add_ssm_time_step_rank(hp.Hv)
    w.add_ssm_inner_size(hp.Hv * hp.dv)
    # llama.cpp (Qwen3NextModel.set_gguf_parameters): one bool per block, false for attention and
    # for the MTP blocks (gguf-py 0.19 has no add_recurrent_layers; same key and BOOL array type)
    w.add_array(f"{w.arch}.attention.recurrent_layers",
                [hp.layer_type(i) == TM.GDN for i in range(hp.block_count)])
    w.add_full_attention_interval(hp.interval)
    if hp.n_mtp:
        w.add_nextn_predict_layers(hp.n_mtp)
    add_tokenizer_metadata(w, vocab)


def add_tokenizer_metadata(w, vocab: Vocab) -> None:
    """tokenizer.ggml.* and the chat template (spec 4.2)."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    if vocab.merges:
        w.add_token_merges(vocab.merges)
    if vocab.bos is not None:
        w.add_bos_token_id(vocab.bos)
    if vocab.eos is not None:
        w.add_eos_token_id(vocab.eos)
    if vocab.pad is not None:
        w.add_pad_token_id(vocab.pad)
    w.add_add_bos_token(False)
    if vocab.chat_template:
        w.add_chat_template(vocab.chat_template)


def add_sidecar_metadata(w, hp: HParams, record: dict) -> None:
    """The diffusion sidecar's KV pairs (docs/gguf-layout.md): general.type "diffusion", the
    trunk's decoder layer count (MTP blocks not counted) and the decoding record; nothing else."""
    w.add_type("diffusion")
    w.add_block_count(hp.n_layer)
    R.add_to_writer(w, record)


@dataclass
class Output:
    """One GGUF file to write: its path, arch, KV writer (``metadata(w)``) and tensors."""

    path: pathlib.Path
    arch: str
    metadata: Callable
    tensors: list

    @property
    def part(self) -> pathlib.Path:
        return self.path.with_name(self.path.name + ".part")


def _write_output(o: Output, pool, bar) -> None:
    """Write ``o`` to ``o.part``: header, KV pairs, tensor infos, then the data piece by piece."""
    import gguf
    w = gguf.GGUFWriter(path=None, arch=o.arch)
    try:
        o.metadata(w)
        for t in o.tensors:
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
        w.write_header_to_file(path=o.part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        for t in o.tensors:
            w.write_padding(fout, fout.tell())
            _write_tensor(fout, t, pool, bar)
            w.write_padding(fout, t.nbytes)
    finally:
        w.close()


def _write_tensor(fout, t: OutTensor, pool, bar) -> None:
    import gguf
    n = n_inf = 0
    for piece in t.pieces():
        b = encode(piece.reshape(-1, t.shape[-1]), t.qtype, pool)
        if t.qtype == gguf.GGMLQuantizationType.F16 and piece.dtype != np.float16:
            n_inf += int(np.count_nonzero(np.isinf(b) & np.isfinite(to_f32(piece).reshape(b.shape))))
        fout.write(b.reshape(-1).view(np.uint8).data)
        n += b.nbytes
        if bar is not None:
            bar.update(b.nbytes)
    if n != t.nbytes:
        raise ConvertError(f"internal: tensor {t.name} wrote {n} bytes, expected {t.nbytes}")
    if n_inf:
        warnings.warn(f"tensor {t.name}: {n_inf} values beyond the f16 range (|x| > 65504) written "
                      f"as inf (as llama.cpp's converter does); --outtype bf16 or f32 keeps them",
                      ConvertWarning, stacklevel=4)


def write_outputs(outputs: list, outtype: str, progress: bool, threads: int | None) -> None:
    """Write every output as ``.part`` and rename them all once every one is complete; on any
    failure no ``.part`` and no new output is left."""
    tensors = [t for o in outputs for t in o.tensors]
    nthreads = max(1, int(threads or os.cpu_count() or 1))
    pool = bar = None
    if nthreads > 1 and any(t.qtype.name in _NATIVE_OK for t in tensors):
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(nthreads)
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(t.nbytes for t in tensors), unit="B", unit_scale=True, desc=f"convert {outtype}",
                   file=sys.stderr)
    try:
        for o in outputs:
            o.path.parent.mkdir(parents=True, exist_ok=True)
            _write_output(o, pool, bar)
        for o in outputs:
            os.replace(o.part, o.path)
    except BaseException:
        for o in outputs:
            o.part.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
        if pool is not None:
            pool.shutdown()


def sidecar_path(out_path) -> pathlib.Path:
    """``<stem>.diffusion.gguf`` beside ``out_path`` (stem = the name without ``.gguf``)."""
    p = pathlib.Path(out_path)
    stem = p.name[:-len(".gguf")] if p.name.endswith(".gguf") else p.name
    return p.with_name(stem + ".diffusion.gguf")


def _read_config(hf_dir: pathlib.Path) -> dict:
    cfg_path = hf_dir / "config.json"
    if not cfg_path.is_file():
        raise ConvertError(f"{hf_dir}: missing config.json")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConvertError(f"config.json: {e}") from None
    if not isinstance(config, dict):
        raise ConvertError("config.json: not a JSON object")
    return config


def resolve_record(hf_dir: pathlib.Path, config: dict, options: dict | None, vocab_size: int) -> tuple[dict, dict]:
    """record.resolve, its errors as ConvertError; prints (stderr, one line) the fields
    that took the default."""
    try:
        values, sources = R.resolve(hf_dir, config, options, vocab_size)
    except R.RecordError as e:
        raise ConvertError(str(e)) from None
    line = R.defaulted_line(values, sources)
    if line:
        print(line, file=sys.stderr)
    return values, sources


def _check_options(arch: str | None, split: bool, diffusion_only: bool, record: dict | None, outtype: str) -> str:
    """Checks the options before any file is read; returns the ``OUTTYPES`` name of ``outtype``."""
    try:
        outtype = QP.outtype_name(outtype)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    if arch not in (None,) + ARCHES:
        raise ConvertError(f"arch {arch!r}: expected one of {', '.join(ARCHES)}")
    if split and diffusion_only:
        raise ConvertError("--split and --diffusion-only: choose one")
    unknown = sorted(set(record or {}) - set(R.BY_NAME))
    if unknown:
        raise ConvertError(f"record option {unknown[0]!r}: expected one of {', '.join(R.BY_NAME)}")
    if diffusion_only and arch == ARCH_PARENT:
        _refuse_parent("--diffusion-only")
    return outtype


def _refuse_parent(what: str) -> None:
    raise ConvertError(f"{what}: a {ARCH_PARENT} output (a parent checkpoint, or --arch {ARCH_PARENT}) has no "
                       f"block tensors and no decoding record")


def convert(hf_dir, out_path, outtype: str = "bf16", arch: str | None = None, progress: bool = True,
            no_mtp: bool = False, threads: int | None = None, *, split: bool = False,
            diffusion_only: bool = False, record: dict | None = None) -> dict:
    """Convert an HF Clover / Qwen3.5-3.6-MoE checkpoint to GGUF (clover-spec section 4,
    docs/gguf-layout.md).

    hf_dir: directory with config.json (optional generation_config.json), tokenizer.json (+
    tokenizer_config.json, optional chat_template.jinja) and safetensors weights (sharded with
    model.safetensors.index.json, or a single file). out_path: the GGUF to write (each output is
    written as ``.part`` and renamed when all are complete; an existing file is replaced).

    Outputs: by default one file: ``qwen35moe`` for a parent; for Clover the complete
    ``clover_moe`` file (trunk, block tensors after each GDN layer's ssm_out, decoding record).
    ``split=True`` (Clover only): ``out_path`` is the trunk, exactly the ``qwen35moe`` output of
    the same trunk under the ``clover_moe.`` prefix plus ``clover_moe.expert_shared_count``, and
    the sidecar goes to ``sidecar_path(out_path)``. ``diffusion_only=True``: the sidecar alone
    at ``out_path`` (general.type "diffusion", block_count, the record, the block tensors F32),
    reading only the config, the tokenizer and the block tensors (``load_block_sources``);
    outtype, no_mtp and threads do not apply to it.

    arch: None (clover_moe for a Clover checkpoint, qwen35moe for a parent), "clover_moe"
    (refused for a parent) or "qwen35moe" (a Clover checkpoint's trunk alone: block tensors
    listed in ``dropped``, no record). record: decoding-record options {field: value}
    (``convert.record.FIELDS``; None values ignored), which win over the checkpoint's config;
    the fields that took the default are printed on stderr in one line. outtype: "f32" | "f16"
    | "bf16" | "q8_0" | "q4_0" | "q2_k" | "q3_k_m" | "q4_k_s" | "q4_k_m" | "q5_k_m" | "q6_k" | "iq4_xs"
    (any letter case: "Q4_K_M" is "q4_k_m"); each tensor's type
    follows ``convert.quant_plan.plan_types`` (llama.cpp's llama-quantize rules for qwen35moe:
    norms, routers, conv, ssm_a/dt and 1-D tensors stay F32; the _M mixes, output.weight Q6_K,
    the fallback for rows that are not a multiple of the block size); block tensors are F32.
    general.file_type is the llama.cpp LLAMA_FTYPE value, general.quantization_version 2.
    threads: quantiser threads (default os.cpu_count()). progress: tqdm bar on stderr.

    MTP (multi-token prediction, ``mtp.*``): kept as llama.cpp's converter keeps it, for both
    arches. ``mtp.layers.j.*`` becomes block ``num_hidden_layers + j`` (a full-attention MoE layer,
    same names and transforms as the trunk); ``mtp.fc`` -> ``blk.N.nextn.eh_proj.weight``,
    ``mtp.pre_fc_norm_embedding`` -> ``nextn.enorm``, ``mtp.pre_fc_norm_hidden`` -> ``nextn.hnorm``,
    ``mtp.norm`` -> ``nextn.shared_head_norm`` (N = num_hidden_layers; the three norms +1, F32);
    ``{arch}.block_count`` counts the MTP blocks, ``{arch}.nextn_predict_layers`` is their number and
    ``{arch}.attention.recurrent_layers`` (written for every file) is false for them. The MTP block
    count comes from the tensors; a config ``mtp_num_hidden_layers`` that disagrees is an error.
    no_mtp: drop the ``mtp.*`` tensors (listed in ``dropped``) and write no MTP block.
    With f16 output, values beyond the f16 range become +-inf (llama.cpp's converter does the same),
    with a ConvertWarning naming the tensor. A ``*.safetensors`` file the index does not list is
    ignored with a ConvertWarning (``load_tensor_index``).

    Returns a dict: path, arch, outtype, file_type (None for the sidecar alone), n_tensors,
    tensors (GGUF names in file order), n_bytes (file size), dropped (HF tensor names not
    converted), ignored (safetensors files not read), n_mtp (MTP blocks written), record (the
    decoding record written, or None), record_sources ({field: "option" | a config file |
    "tokenizer.json" | "default"}), diffusion_path (the sidecar of ``split``, else None).

    Raises MissingShardError (a ConvertError) for a shard listed in the index but absent, and
    ConvertError for anything else the converter cannot map; in both cases before any output
    file is created.
    """
    hf_dir = pathlib.Path(hf_dir)
    out_path = pathlib.Path(out_path)
    outtype = _check_options(arch, split, diffusion_only, record, outtype)
    config = _read_config(hf_dir)
    if diffusion_only:
        return _convert_sidecar(hf_dir, out_path, config, record, progress)
    ignored: list[str] = []
    plan = build_plan(config, load_tensor_index(hf_dir, ignored), outtype, arch, no_mtp=no_mtp)
    clover = plan.arch == ARCH_CLOVER
    given = [R.BY_NAME[k].option for k, v in (record or {}).items() if v is not None]
    if not clover and (split or given):
        _refuse_parent("--split" if split else given[0])
    values, sources = resolve_record(hf_dir, config, record, plan.hp.V) if clover else (None, {})
    vocab = read_vocab(hf_dir, plan.hp)
    name = hf_dir.resolve().name

    def trunk_kv(w):
        add_trunk_metadata(w, plan.hp, vocab, outtype, name)
        if clover and not split:
            R.add_to_writer(w, values)

    outputs = [Output(out_path, plan.arch, trunk_kv, plan.trunk if split else plan.tensors)]
    if split:
        outputs.append(Output(sidecar_path(out_path), ARCH_CLOVER,
                              lambda w: add_sidecar_metadata(w, plan.hp, values), plan.block_tensors))
    write_outputs(outputs, outtype, progress, threads)
    return {
        "path": str(out_path),
        "arch": plan.arch,
        "outtype": outtype,
        "file_type": _file_type(outtype),
        "n_tensors": len(outputs[0].tensors),
        "tensors": [t.name for t in outputs[0].tensors],
        "n_bytes": out_path.stat().st_size,
        "dropped": plan.dropped,
        "ignored": ignored,
        "n_mtp": plan.hp.n_mtp,
        "record": values,
        "record_sources": sources,
        "diffusion_path": str(outputs[1].path) if split else None,
    }


def _convert_sidecar(hf_dir: pathlib.Path, out_path: pathlib.Path, config: dict, record: dict | None,
                     progress: bool) -> dict:
    """``convert(..., diffusion_only=True)``: the sidecar alone."""
    plan = build_sidecar_plan(hf_dir, config)
    values, sources = resolve_record(hf_dir, config, record, plan.hp.V)
    o = Output(out_path, ARCH_CLOVER, lambda w: add_sidecar_metadata(w, plan.hp, values), plan.tensors)
    write_outputs([o], "f32", progress, 1)
    return {"path": str(out_path), "arch": ARCH_CLOVER, "outtype": "f32", "file_type": None,
            "n_tensors": len(plan.tensors), "tensors": [t.name for t in plan.tensors],
            "n_bytes": out_path.stat().st_size, "dropped": [], "ignored": [], "n_mtp": 0,
            "record": values, "record_sources": sources, "diffusion_path": None}


def _add_record_options(ap) -> None:
    g = ap.add_argument_group("decoding record (clover_moe outputs; each wins over the checkpoint's config)")
    for f in R.FIELDS:
        kw = {"u32": {"type": int}, "f32": {"type": float},
              "bool": {"type": R.parse_bool, "metavar": "{true,false}"},
              "str": {"choices": f.choices}}[f.gtype]
        default = "required" if f.default is None else R.format_value(f.default)
        g.add_argument(f.option, dest=f.name, default=None, help=f"{f.help} (GGUF {f.key}; default {default})", **kw)


def main(argv=None) -> int:
    """CLI: ``clover-gguf convert HF_DIR -o OUT [--outtype TYPE] [--arch clover_moe|qwen35moe]
    [--split | --diffusion-only] [record options] [--no-mtp] [--no-progress] [--threads N]``
    (``convert``'s arguments, one flag each). Returns 0; on a conversion error prints
    ``error: ...`` to stderr and exits with status 2."""
    ap = argparse.ArgumentParser(prog="clover-gguf convert",
                                 description="Convert a Hugging Face Clover / Qwen3.5-MoE checkpoint to GGUF.")
    ap.add_argument("hf_dir", metavar="HF_DIR", help="checkpoint directory (config.json, tokenizer.json, safetensors)")
    ap.add_argument("-o", "--outfile", "--out", dest="out_path", required=True, metavar="OUT", help="output .gguf path")
    ap.add_argument("--outtype", type=str.lower, choices=OUTTYPES, default="bf16",
                    help="type of the 2-D/3-D weights, any letter case (default bf16; norms, routers, conv, "
                         "ssm_a/dt and block tensors stay f32; quantised types follow llama.cpp's llama-quantize "
                         "mixes)")
    ap.add_argument("--arch", choices=ARCHES, default=None,
                    help=f"default: {ARCH_CLOVER} for a Clover checkpoint, else {ARCH_PARENT}; {ARCH_PARENT} on a "
                         f"Clover checkpoint converts the trunk alone")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--split", action="store_true",
                     help="OUT is the llama.cpp-compatible trunk; the block tensors and decoding record go to "
                          "<stem>.diffusion.gguf beside it")
    out.add_argument("--diffusion-only", action="store_true",
                     help="OUT is the diffusion sidecar alone, read from the block tensors' shards, the config "
                          "and the tokenizer (pairs with a published clover_moe GGUF)")
    ap.add_argument("--no-mtp", action="store_true",
                    help="drop mtp.* (multi-token prediction) tensors (default: kept as llama.cpp keeps them, "
                         "as block num_hidden_layers with nextn.* tensors)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    ap.add_argument("--threads", "-t", type=int, default=None, help="quantiser threads (default: all CPUs)")
    _add_record_options(ap)
    a = ap.parse_args(argv)
    record = {f.name: getattr(a, f.name) for f in R.FIELDS if getattr(a, f.name) is not None}
    try:
        r = convert(a.hf_dir, a.out_path, outtype=a.outtype, arch=a.arch, progress=not a.no_progress,
                    no_mtp=a.no_mtp, threads=a.threads, split=a.split, diffusion_only=a.diffusion_only,
                    record=record)
    except (ConvertError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    what = "diffusion sidecar" if a.diffusion_only else f"{r['outtype']}"
    print(f"wrote {r['path']}: arch {r['arch']}, {what}, {r['n_tensors']} tensors, "
          f"{r['n_bytes'] / 2**20:.1f} MiB" + (f", {r['n_mtp']} MTP block(s)" if r["n_mtp"] else "")
          + (f", dropped {len(r['dropped'])} tensors" if r["dropped"] else ""))
    if r["diffusion_path"]:
        print(f"wrote {r['diffusion_path']}: diffusion sidecar")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
