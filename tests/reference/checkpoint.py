"""Random test checkpoints in the Hugging Face layout (clover-spec sections 1, 3.3, 3.4).

Writes what ``save_pretrained`` of a Qwen3.5/3.6-MoE text model would write, optionally as
Clover's real layout (``CloverMoeModelLM``: the four block tensors of every GDN layer,
``num_shared_experts`` and the decoding record of docs/gguf-layout.md):

- ``config.json``: the Qwen3.5-MoE text config (top level, or nested under ``text_config`` when
  the tensor prefix is ``model.language_model.``) plus the Clover keys of spec 3.4;
- ``tokenizer.json`` / ``tokenizer_config.json``: a small byte-level BPE trained with
  ``tokenizers`` on a fixed set of Python standard-library sources, with the qwen35
  pre-tokenizer regex and Qwen's special tokens appended after the BPE vocabulary;
- ``model-0000k-of-0000n.safetensors`` (BF16, at least two shards) and
  ``model.safetensors.index.json``.

Every parameter is random with a realistic scale (norm weights, gates, ``A_log``, ``dt_bias``
and conv weights included), so a missing ``+1``, a swapped norm or a wrong head order shows up
in logits. Each tensor is drawn from its own generator seeded by ``(seed, name)``: the values do
not depend on the tensor prefix, on fused vs per-expert storage, or on Clover vs parent.
Generation streams tensor by tensor and flushes a shard when it reaches ``max_shard_bytes``, so
``--dims real`` (3.2B parameters for four layers) runs in a few GB of RAM.

CLI: ``python tests/reference/checkpoint.py OUT [--dims tiny|real] [--layers N] [--parent]
[--prefix model.|model.language_model.] [--per-expert] [--seed S] [--mtp [N]]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sysconfig
import zlib

import torch
from safetensors.torch import save_file

# Qwen3.5 pre-tokenizer regex (llama.cpp LLAMA_VOCAB_PRE_TYPE_QWEN35; shared contract).
QWEN35_PRETOKENIZER_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens, appended after the BPE vocabulary in this order: (content, special).
# As in Qwen's tokenizer.json, <think> and </think> are added tokens that are not special.
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<think>", False),
    ("</think>", False),
    ("<|mask|>", True),
]

# The shared data folder: next to the checkout, inside it (device machines), or the workspace.
_HERE = pathlib.Path(__file__).resolve()
_SHARED = next((p for p in (_HERE.parents[3] / "shared", _HERE.parents[2] / "shared",
                            pathlib.Path("/work/shared")) if (p / "data").is_dir()),
               pathlib.Path("/work/shared"))
CHAT_TEMPLATE_PATH = _SHARED / "data" / "templates" / "Qwen3.5-4B.jinja"
REAL_CONFIG_PATH = _SHARED / "data" / "qwen3.6-35b-a3b.json"
# Used only when CHAT_TEMPLATE_PATH is missing (plain ChatML, as Qwen's template renders text).
_FALLBACK_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)

# Standard-library sources used as tokenizer training text (a fixed list, so that the
# tokenizer is the same on every run; missing files are skipped).
_CORPUS_MODULES = [
    "argparse.py", "textwrap.py", "string.py", "difflib.py", "json/decoder.py",
    "json/encoder.py", "html/parser.py", "calendar.py", "csv.py", "fractions.py",
    "heapq.py", "bisect.py", "shlex.py", "glob.py", "fnmatch.py", "pprint.py",
    "base64.py", "colorsys.py", "this.py", "getopt.py", "gettext.py", "locale.py",
]
# A little non-ASCII text so that multi-byte UTF-8 merges exist.
_UNICODE_TEXT = (
    "Grüße aus München! Ça coûte 5 € — naïve café, déjà vu. Привет, мир! Γειά σου κόσμε. "
    "日本語のテキスト、中文文本，한국어 텍스트. ¿Qué tal? señor niño año. 🙂 👍 ✓ ∑ ∞ π ≈ 3.14159\n"
)

# Tiny dimensions (spec section 1, "tiny test value" column).
TINY_TEXT_CONFIG = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attn_output_gate": True,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "shared_expert_intermediate_size": 256,
    # mrope_section as in the real model: for text all three position rows are equal, so
    # multi-section RoPE reduces to NEOX RoPE on the first 16 dims (spec 2.2); sections that
    # cover more than the rotary dims keep llama.cpp's IMROPE sector lookup on the text rows.
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 4096,
}

# Scales that shape the random model for testing (see module docstring).
# LM head: logits std ~ LM_HEAD_GAIN (hidden states are RMS-normalised), so distributions are
# peaked: the top token probability is often > 0.3 and some positions clear 0.95.
LM_HEAD_GAIN = 7.0
# Router: logits std ~ ROUTER_GAIN. Widened on purpose (a trained router's margins are wide,
# a default-random one's are not), so that tiny numeric differences (bf16 vs f32, summation
# order, Q8_0 round trips) rarely flip the top-k expert choice (clover/notes/oracles.md).
ROUTER_GAIN = 8.0


def text_config(dims: str = "tiny", n_layers: int | None = None) -> dict:
    """Return the Qwen3.5-MoE text hyperparameters (a fresh dict) for ``dims``.

    ``dims`` is "tiny" (spec section 1 test column) or "real" (data/qwen3.6-35b-a3b.json, vocab
    248320, no MTP layers). ``n_layers`` overrides num_hidden_layers. Raises ValueError for an
    unknown ``dims``.
    """
    if dims == "tiny":
        cfg = json.loads(json.dumps(TINY_TEXT_CONFIG))
    elif dims == "real":
        if not REAL_CONFIG_PATH.is_file():
            raise FileNotFoundError(f"dims 'real' needs {REAL_CONFIG_PATH}")
        real = json.loads(REAL_CONFIG_PATH.read_text())
        cfg = {k: v for k, v in real.items()
               if not k.startswith("_") and k not in ("clover_diffusion", "model_type")}
        cfg.pop("eos_token_id", None)
    else:
        raise ValueError(f"dims: {dims!r} (expected 'tiny' or 'real')")
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError(f"n_layers: {n_layers} (expected >= 1)")
        cfg["num_hidden_layers"] = int(n_layers)
    interval = cfg["full_attention_interval"]
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    cfg["mtp_num_hidden_layers"] = 0
    cfg.update({
        "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "bos_token_id": None, "pad_token_id": None,
    })
    return cfg


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def _corpus() -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in _CORPUS_MODULES:
        p = stdlib / rel
        if p.is_file():
            texts.append(p.read_text(encoding="utf-8", errors="replace"))
    texts.append(_UNICODE_TEXT * 20)
    return texts


_TOKENIZER_MEMO: dict[int, str] = {}  # in-process only: vocab_size -> tokenizer JSON


def build_tokenizer(vocab_size: int = 2000, texts=None):
    """Train the test tokenizer (byte-level BPE, qwen35 pre-tokenizer) and append ADDED_TOKENS.

    Returns a ``tokenizers.Tokenizer`` with exactly ``vocab_size`` tokens (BPE vocabulary of
    ``vocab_size - len(ADDED_TOKENS)`` including the 256 byte symbols, then the added tokens).
    ``texts``: the training texts (an iterable of str; default: this module's fixed corpus,
    memoised per vocab_size). Deterministic: single-threaded training. Raises RuntimeError
    when the trained vocabulary comes out smaller than requested.
    """
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # count words single-threaded
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    if texts is None and vocab_size in _TOKENIZER_MEMO:
        return Tokenizer.from_str(_TOKENIZER_MEMO[vocab_size])
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_PRETOKENIZER_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    n_bpe = vocab_size - len(ADDED_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=n_bpe, min_frequency=2, show_progress=False, special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus() if texts is None else texts, trainer)
    if tok.get_vocab_size() != n_bpe:
        raise RuntimeError(f"tokenizer: trained {tok.get_vocab_size()} tokens, expected {n_bpe}")
    for content, special in ADDED_TOKENS:
        at = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False,
                        single_word=False)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer: {tok.get_vocab_size()} tokens, expected {vocab_size}")
    if texts is None:
        _TOKENIZER_MEMO[vocab_size] = tok.to_str()
    return tok


def _write_tokenizer(out: pathlib.Path, tok) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"))
    ids = {c: tok.token_to_id(c) for c, _ in ADDED_TOKENS}
    added_decoder = {
        str(ids[c]): {"content": c, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": s}
        for c, s in ADDED_TOKENS
    }
    tcfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added_decoder,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|mask|>"],
        "bos_token": None,
        "chat_template": (CHAT_TEMPLATE_PATH.read_text() if CHAT_TEMPLATE_PATH.is_file()
                          else _FALLBACK_CHAT_TEMPLATE),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "mask_token": "<|mask|>",
        "model_max_length": 262144,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    return ids


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------

def _layer_specs(cfg: dict, p: str, layer_type: str, clover: bool, fused_experts: bool) -> list:
    """Parameters of one decoder layer whose names start with ``p`` (e.g. ``layers.3.``)."""
    H = cfg["hidden_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    Hk, Hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    K = cfg["linear_conv_kernel_dim"]
    E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    C = 2 * Hk * dk + Hv * dv
    specs = [(p + "input_layernorm.weight", (H,), "norm0")]
    if layer_type == "linear_attention":
        a = p + "linear_attn."
        specs += [
            (a + "in_proj_qkv.weight", (C, H), "linear"),
            (a + "in_proj_z.weight", (Hv * dv, H), "linear"),
            (a + "in_proj_b.weight", (Hv, H), "linear"),
            (a + "in_proj_a.weight", (Hv, H), "linear"),
            (a + "conv1d.weight", (C, 1, K), "conv"),
            (a + "dt_bias", (Hv,), "dt_bias"),
            (a + "A_log", (Hv,), "A_log"),
            (a + "norm.weight", (dv,), "gnorm"),
            (a + "out_proj.weight", (H, Hv * dv), "linear"),
        ]
        if clover:  # spec 3.3: right taps and the block softmax (lambda, beta0, c)
            specs += [
                (a + "conv_right_weight", (C, 1, K - 1), "conv"),
                (a + "bd_softmax_logit_scale", (Hv,), "bd_logit_scale"),
                (a + "bd_softmax_history_bias", (Hv,), "bd_history_bias"),
                (a + "bd_softmax_history_c", (Hv,), "bd_history_c"),
            ]
    else:
        a = p + "self_attn."
        specs += [
            (a + "q_proj.weight", (nh * hd * 2, H), "linear"),
            (a + "k_proj.weight", (nkv * hd, H), "linear"),
            (a + "v_proj.weight", (nkv * hd, H), "linear"),
            (a + "o_proj.weight", (H, nh * hd), "linear"),
            (a + "q_norm.weight", (hd,), "norm0"),
            (a + "k_norm.weight", (hd,), "norm0"),
        ]
    m = p + "mlp."
    specs.append((m + "gate.weight", (E, H), "router"))
    if fused_experts:
        specs += [
            (m + "experts.gate_up_proj", (E, 2 * I, H), "experts_gate_up"),
            (m + "experts.down_proj", (E, H, I), "experts_down"),
        ]
    else:
        for e in range(E):
            specs += [
                (m + f"experts.{e}.gate_proj.weight", (I, H), "linear"),
                (m + f"experts.{e}.up_proj.weight", (I, H), "linear"),
                (m + f"experts.{e}.down_proj.weight", (H, I), "linear"),
            ]
    specs += [
        (m + "shared_expert.gate_proj.weight", (Is, H), "linear"),
        (m + "shared_expert.up_proj.weight", (Is, H), "linear"),
        (m + "shared_expert.down_proj.weight", (H, Is), "linear"),
        (m + "shared_expert_gate.weight", (1, H), "linear"),
        (p + "post_attention_layernorm.weight", (H,), "norm0"),
    ]
    return specs


def param_specs(cfg: dict, clover: bool = True, fused_experts: bool = True):
    """List the HF parameters of a Qwen3.5-MoE text model (names without the ``model.``-style
    prefix; ``lm_head.weight`` and ``mtp.*`` are top level).

    Returns [(name, shape tuple, kind)], kind naming the initialiser. With ``clover`` the four
    block tensors of spec 3.3 are added to every GDN layer. Fused experts are one
    3-D ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj`` [E, H, I] (no
    ``.weight``); otherwise ``mlp.experts.{e}.{gate,up,down}_proj.weight``.

    With ``cfg["mtp_num_hidden_layers"]`` = n > 0, the multi-token-prediction block of
    Qwen3.5/3.6-MoE follows, as their checkpoints store it: ``mtp.fc.weight`` [H, 2H],
    ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.norm.weight``
    (zero-centred norms, [H]) and ``mtp.layers.{j}.*`` (j < n), each a full-attention MoE decoder
    layer (experts fused or not as the trunk's; no Clover tensors: those belong to GDN layers).
    """
    H = cfg["hidden_size"]
    V = cfg["vocab_size"]
    specs = [("embed_tokens.weight", (V, H), "embed")]
    for i, lt in enumerate(cfg["layer_types"]):
        specs += _layer_specs(cfg, f"layers.{i}.", lt, clover, fused_experts)
    specs += [("norm.weight", (H,), "norm0"), ("lm_head.weight", (V, H), "lm_head")]
    n_mtp = int(cfg.get("mtp_num_hidden_layers") or 0)
    if n_mtp:
        specs += [
            ("mtp.fc.weight", (H, 2 * H), "linear"),
            ("mtp.pre_fc_norm_embedding.weight", (H,), "norm0"),
            ("mtp.pre_fc_norm_hidden.weight", (H,), "norm0"),
            ("mtp.norm.weight", (H,), "norm0"),
        ]
        for j in range(n_mtp):
            specs += _layer_specs(cfg, f"mtp.layers.{j}.", "full_attention", False, fused_experts)
    return specs


def _generator(seed: int, name: str) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


_CHUNK = 1 << 24  # elements drawn at a time (64 MiB of fp32) for big tensors


def _randn(shape, g: torch.Generator, std: float, mean: float, dtype) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1)
    for s in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - s)
        flat[s:s + n] = (torch.randn(n, generator=g) * std + mean).to(dtype)
    return out


def make_tensor(name: str, shape: tuple, kind: str, seed: int, dtype=torch.bfloat16,
                lm_head_gain: float = LM_HEAD_GAIN, router_gain: float = ROUTER_GAIN) -> torch.Tensor:
    """Draw one parameter (see module docstring for the scales). ``name`` is the prefix-free HF
    name; the result depends only on (seed, name, kind, shape) and, for the LM head and the
    routers, on the gains."""
    if kind == "experts_gate_up":  # stack of per-expert [gate; up], identical to per-expert files
        base = name[: -len("gate_up_proj")]
        E, I2, H = shape
        out = torch.empty(shape, dtype=dtype)
        for e in range(E):
            out[e, : I2 // 2] = make_tensor(f"{base}{e}.gate_proj.weight", (I2 // 2, H), "linear", seed, dtype)
            out[e, I2 // 2:] = make_tensor(f"{base}{e}.up_proj.weight", (I2 // 2, H), "linear", seed, dtype)
        return out
    if kind == "experts_down":
        base = name[: -len("down_proj")]
        E, H, I = shape
        out = torch.empty(shape, dtype=dtype)
        for e in range(E):
            out[e] = make_tensor(f"{base}{e}.down_proj.weight", (H, I), "linear", seed, dtype)
        return out
    g = _generator(seed, name)
    if kind == "linear":  # N(0, 1/fan_in): unit-variance outputs for unit-variance inputs
        return _randn(shape, g, 1.0 / math.sqrt(shape[-1]), 0.0, dtype)
    if kind == "embed":
        return _randn(shape, g, 1.0, 0.0, dtype)
    if kind == "lm_head":
        return _randn(shape, g, lm_head_gain / math.sqrt(shape[-1]), 0.0, dtype)
    if kind == "router":
        return _randn(shape, g, router_gain / math.sqrt(shape[-1]), 0.0, dtype)
    if kind == "norm0":  # zero-centred RMSNorm weight (the norm uses 1 + w)
        return _randn(shape, g, 0.1, 0.0, dtype)
    if kind == "gnorm":  # GDN gated norm: plain weight around 1
        return _randn(shape, g, 0.1, 1.0, dtype)
    if kind == "conv":
        return _randn(shape, g, 0.3, 0.0, dtype)
    if kind == "dt_bias":
        return _randn(shape, g, 0.5, 0.0, dtype)
    if kind == "bd_logit_scale":  # lambda: exp(lambda) ~ 2..5 on cosine scores
        return _randn(shape, g, 0.3, 1.2, dtype)
    if kind == "bd_history_bias":  # beta0
        return _randn(shape, g, 0.5, 0.0, dtype)
    if kind == "bd_history_c":  # c, the weight of ln(1 + P)
        return _randn(shape, g, 0.3, 0.5, dtype)
    if kind == "A_log":  # A ~ U(1, 16)
        u = torch.rand(shape, generator=g, dtype=torch.float64)
        return torch.log(1.0 + 15.0 * u).to(dtype)
    raise ValueError(f"tensor {name}: unknown init kind {kind!r}")


# ---------------------------------------------------------------------------------------------
# Writer
# ---------------------------------------------------------------------------------------------

def _full_name(name: str, prefix: str) -> str:
    return name if name == "lm_head.weight" or name.startswith("mtp.") else prefix + name


def make_checkpoint(
    out_dir,
    dims: str = "tiny",
    n_layers: int | None = None,
    clover: bool = True,
    prefix: str = "model.",
    fused_experts: bool = True,
    seed: int = 0,
    *,
    tokenizer_vocab: int = 2000,
    vocab_size: int | None = None,
    block_size: int = 32,
    threshold: float = 0.95,
    moe_block_coreset_top_p: float = 0.9,
    max_shard_bytes: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    extra_config: dict | None = None,
    text_overrides: dict | None = None,
    lm_head_gain: float = LM_HEAD_GAIN,
    router_gain: float = ROUTER_GAIN,
    progress: bool = False,
    mtp: int = 0,
) -> pathlib.Path:
    """Write a random HF checkpoint to ``out_dir`` (created if needed) and return its Path.

    dims: "tiny" | "real"; n_layers: override the layer count; clover: Clover's real layout
    (``CloverMoeModelLM``, the four block tensors of every GDN layer, ``num_shared_experts`` and
    the decoding record, spec 3.3-3.4), else a Qwen3.6-style parent; prefix: "model." or
    "model.language_model." (then the text config is nested under "text_config" as HF's
    Qwen3_5MoeForConditionalGeneration writes it); fused_experts: 3-D experts vs per-expert 2-D;
    seed: all values are a function of it. tokenizer_vocab: trained tokenizer size (the config
    vocab_size, default 2048 tiny / 248320 real, may be larger: extra embedding rows are padding).
    max_shard_bytes: shard limit (default 2 GB; always at most half the total, so there are at
    least two shards). Weights are stored as ``dtype`` (bf16 default). lm_head_gain /
    router_gain: std * sqrt(hidden) of the LM head and router weights (defaults LM_HEAD_GAIN,
    ROUTER_GAIN). extra_config: keys merged into config.json last. text_overrides: keys of the text
    config that the tensors' shapes follow too (e.g. ``{"num_attention_heads": 6}``). mtp: number of MTP layers
    (``mtp_num_hidden_layers`` in config.json; True = 1): the ``mtp.*`` tensors of
    ``param_specs`` are written after the trunk (top level, whatever ``prefix``). Adding them
    changes no other tensor's values. Raises ValueError on bad options.
    """
    if prefix not in ("model.", "model.language_model."):
        raise ValueError(f"prefix: {prefix!r} (expected 'model.' or 'model.language_model.')")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = text_config(dims, n_layers)
    cfg.update(text_overrides or {})
    if int(mtp) < 0:
        raise ValueError(f"mtp: {mtp} (expected >= 0)")
    cfg["mtp_num_hidden_layers"] = int(mtp)
    if vocab_size is not None:
        cfg["vocab_size"] = int(vocab_size)
    if cfg["vocab_size"] < tokenizer_vocab:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer_vocab {tokenizer_vocab}")

    ids = _write_tokenizer(out, build_tokenizer(tokenizer_vocab))
    cfg["eos_token_id"] = ids["<|endoftext|>"]  # as the parent's config (generation uses <|im_end|>)
    cfg["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}[dtype]

    if prefix == "model.":
        config = dict(cfg, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"])
    else:
        config = {
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": dict(cfg, model_type="qwen3_5_moe_text"),
            "tie_word_embeddings": False,
            "dtype": cfg["dtype"],
        }
    if clover:  # spec 3.4: CloverMoeModelLM, num_shared_experts, the decoding record
        config["architectures"] = ["CloverMoeModelLM"]
        config["model_type"] = "clover_moe"
        config["num_shared_experts"] = 1
        config.update({
            "mask_token_id": ids["<|mask|>"],
            "block_size": int(block_size),
            "threshold": float(threshold),
            "moe_block_coreset_top_p": float(moe_block_coreset_top_p),
            "presence_penalty": 0.9,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.05,
            "think_close_bias_start": 4096,
            "eos_bias_start": 8192,
        })
    config["transformers_version"] = "5.23.0"
    if extra_config:
        config.update(extra_config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # Stream the tensors into shards.
    specs = param_specs(cfg, clover=clover, fused_experts=fused_experts)
    esize = torch.empty((), dtype=dtype).element_size()
    sizes = [math.prod(s) * esize for _, s, _ in specs]
    total = sum(sizes)
    limit = min(max_shard_bytes or 2 * 10**9, total // 2 + 1)
    for old in [*out.glob("model*.safetensors"), *out.glob(".shard-*.tmp.safetensors")]:
        old.unlink()
    shard, shard_bytes, tmp_files, weight_map_tmp = {}, 0, [], {}

    def flush():
        nonlocal shard, shard_bytes
        if not shard:
            return
        tmp = out / f".shard-{len(tmp_files):05d}.tmp.safetensors"
        save_file(shard, str(tmp), metadata={"format": "pt"})
        for k in shard:
            weight_map_tmp[k] = len(tmp_files)
        tmp_files.append(tmp)
        shard, shard_bytes = {}, 0

    # One torch thread: on a busy 2-core machine torch's thread pool spin-waits and runs ~20x
    # slower; the drawn values do not depend on the thread count.
    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for (name, shape, kind), nbytes in zip(specs, sizes):
            if shard and shard_bytes + nbytes > limit:
                flush()
            if progress:
                print(f"  {_full_name(name, prefix)} {list(shape)}", flush=True)
            shard[_full_name(name, prefix)] = make_tensor(name, shape, kind, seed, dtype, lm_head_gain,
                                                          router_gain).contiguous()
            shard_bytes += nbytes
        flush()
    finally:
        torch.set_num_threads(n_threads)

    n = len(tmp_files)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for tmp, final in zip(tmp_files, names):
        tmp.rename(out / final)
    index = {
        "metadata": {"total_parameters": total // esize, "total_size": total},
        "weight_map": {k: names[v] for k, v in sorted(weight_map_tmp.items())},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def make_hf_saved_checkpoint(
    out_dir,
    seed: int = 0,
    mtp: int = 0,
    *,
    n_layers: int | None = None,
    max_shard_size: int | str = "4MB",
    tokenizer_vocab: int = 2000,
    dtype: torch.dtype = torch.bfloat16,
    lm_head_gain: float = LM_HEAD_GAIN,
    router_gain: float = ROUTER_GAIN,
) -> pathlib.Path:
    """Write a tiny ``Qwen3_5MoeForCausalLM`` checkpoint saved by transformers itself and return
    its Path (``out_dir``, created if needed).

    The model is built by transformers (``Qwen3_5MoeTextConfig`` from ``text_config("tiny",
    n_layers)``), every parameter is overwritten with the value ``make_tensor`` draws for it (same
    kinds and scales as ``make_checkpoint``: zero-centred norms, the GDN gated norm around 1,
    ``A_log``, ``dt_bias``, conv, routers and LM head included), cast to ``dtype`` and written by
    ``save_pretrained(out_dir, max_shard_size=...)``: transformers' own names (prefix ``model.``;
    experts as transformers writes them: 5.23 reverses its load-time fusion and writes per-expert
    ``mlp.experts.{e}.{gate,up,down}_proj.weight``, as the released checkpoints store them),
    sharding, index and config.json. The values therefore equal those of
    ``make_checkpoint(clover=False, seed=seed)``. The tokenizer is ``make_checkpoint``'s
    (``build_tokenizer(tokenizer_vocab)``); config.json's eos_token_id is ``<|endoftext|>`` as there.

    mtp: number of MTP layers (True = 1). transformers has no MTP module (it ignores ``mtp.*`` on
    load), so as in the released Qwen3.5/3.6 checkpoints the ``mtp.*`` tensors of ``param_specs``
    (experts in the layout transformers used for the trunk) go into one more shard listed in the
    index, and config.json gets ``mtp_num_hidden_layers``.

    Raises RuntimeError when transformers' parameters differ from ``param_specs`` (names or
    shapes), ValueError on bad options. Needs torch and transformers (5.x).
    """
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    n_mtp = int(mtp)
    if n_mtp < 0:
        raise ValueError(f"mtp: {mtp} (expected >= 0)")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    cfg = text_config("tiny", n_layers)
    if cfg["vocab_size"] < tokenizer_vocab:
        raise ValueError(f"vocab_size {cfg['vocab_size']} < tokenizer_vocab {tokenizer_vocab}")
    ids = _write_tokenizer(out, build_tokenizer(tokenizer_vocab))
    cfg["eos_token_id"] = ids["<|endoftext|>"]
    cfg["mtp_num_hidden_layers"] = n_mtp
    specs = param_specs(cfg, clover=False, fused_experts=True)

    n_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see make_checkpoint
    try:
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**cfg))
        params = dict(model.named_parameters())
        want = {_full_name(n, "model."): (n, shape, kind) for n, shape, kind in specs if not n.startswith("mtp.")}
        if set(params) != set(want):
            raise RuntimeError(f"transformers parameters differ from param_specs: only in transformers "
                               f"{sorted(set(params) - set(want))[:5]}, only in param_specs "
                               f"{sorted(set(want) - set(params))[:5]}")
        with torch.no_grad():
            for full, p in params.items():
                name, shape, kind = want[full]
                if tuple(p.shape) != tuple(shape):
                    raise RuntimeError(f"{full}: transformers shape {list(p.shape)}, param_specs {list(shape)}")
                p.copy_(make_tensor(name, shape, kind, seed, dtype, lm_head_gain, router_gain).to(p.dtype))
        model.to(dtype)
        model.save_pretrained(str(out), max_shard_size=max_shard_size)
        del model
        saved = set()
        for f in out.glob("model*.safetensors"):
            from safetensors import safe_open
            with safe_open(str(f), "pt") as st:
                saved.update(st.keys())
        fused = "model.layers.0.mlp.experts.gate_up_proj" in saved
        mtp_specs = param_specs(cfg, clover=False, fused_experts=fused)
        mtp_tensors = {n: make_tensor(n, shape, kind, seed, dtype, lm_head_gain, router_gain).contiguous()
                       for n, shape, kind in mtp_specs if n.startswith("mtp.")}
    finally:
        torch.set_num_threads(n_threads)

    if mtp_tensors:
        idx_path = out / "model.safetensors.index.json"
        if idx_path.is_file():
            index = json.loads(idx_path.read_text())
        else:  # one shard: give it a shard name and an index
            (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
            index = {"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in saved}}
        shards = sorted(set(index["weight_map"].values()))
        n = len(shards) + 1
        rename = {s: f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k, s in enumerate(shards)}
        for s in shards:
            (out / s).rename(out / (rename[s] + ".tmp"))
        for s in shards:
            (out / (rename[s] + ".tmp")).rename(out / rename[s])
        last = f"model-{n:05d}-of-{n:05d}.safetensors"
        save_file(mtp_tensors, str(out / last), metadata={"format": "pt"})
        wm = {k: rename[v] for k, v in index["weight_map"].items()}
        wm.update({k: last for k in mtp_tensors})
        index["weight_map"] = dict(sorted(wm.items()))
        meta = index.setdefault("metadata", {})
        if "total_size" in meta:
            meta["total_size"] = int(meta["total_size"]) + sum(t.numel() * t.element_size()
                                                               for t in mtp_tensors.values())
        idx_path.write_text(json.dumps(index, indent=2) + "\n")
        cfg_path = out / "config.json"
        config = json.loads(cfg_path.read_text())
        config["mtp_num_hidden_layers"] = n_mtp
        cfg_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    """CLI entry point (see module docstring). Returns the exit status."""
    ap = argparse.ArgumentParser(prog="python tests/reference/checkpoint.py",
                                 description="Write a random Clover / Qwen3.6-MoE HF checkpoint.")
    ap.add_argument("out_dir")
    ap.add_argument("--dims", choices=["tiny", "real"], default="tiny")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: dims')")
    ap.add_argument("--parent", action="store_true", help="Qwen3.6-style parent, no Clover tensors")
    ap.add_argument("--prefix", choices=["model.", "model.language_model."], default="model.")
    ap.add_argument("--per-expert", action="store_true", help="per-expert 2-D expert tensors")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-shard-bytes", type=int, default=None)
    ap.add_argument("--progress", action="store_true")
    ap.add_argument("--mtp", type=int, nargs="?", const=1, default=0, metavar="N",
                    help="add N multi-token-prediction layers (mtp.*; --mtp alone: 1)")
    a = ap.parse_args(argv)
    out = make_checkpoint(a.out_dir, dims=a.dims, n_layers=a.layers, clover=not a.parent,
                          prefix=a.prefix, fused_experts=not a.per_expert, seed=a.seed,
                          block_size=a.block_size, max_shard_bytes=a.max_shard_bytes,
                          progress=a.progress, mtp=a.mtp)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
