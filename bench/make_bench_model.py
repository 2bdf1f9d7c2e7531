"""Benchmark GGUF models generated directly in quantised form from random weights.

No HF checkpoint, no BF16 detour, no torch: every tensor piece is drawn from its own numpy
generator (seeded by seed, tensor name and piece index, so the file does not depend on the
thread count), scaled, quantised by the native quantisers (``clover_from_f32``) and streamed to
disk. Per-tensor types follow ``convert.quant_plan.plan_types`` (llama.cpp's llama-quantize rules
for qwen35moe), the layout and metadata are the converter's (``convert.convert.add_trunk_metadata``,
``convert.record``), so llama.cpp loads the ``qwen35moe`` files. ``--arch clover_moe`` writes the
complete Clover file of docs/gguf-layout.md: the same trunk under the ``clover_moe.`` prefix, the
block tensors after each GDN layer's ssm_out (F32, random and non-zero) and the decoding record at
its defaults (mask token ``<|mask|>``).

Dimensions: ``--dims real`` is Qwen3.6-35B-A3B (shared/data/qwen3.6-35b-a3b.json) with
``--layers N`` (4 or 40 for the benchmarks); ``--dims tiny`` is the test model of clover-spec
section 1 (fast, for tests). Tokenizer: a small byte-level BPE (qwen35 pre-tokenizer, Qwen's
special tokens) trained here with ``tokenizers`` and padded to the model's vocabulary (248320
for real dims) by the converter's ``read_vocab``.

Memory: at most ``2 * threads`` pieces of <= 4 Mi values (16 MiB as float32) are in flight, so
the 40-layer Q4_K_M model (~21 GB) is written with a few hundred MB of RAM (measured: real dims,
1 layer, Q4_K_M, ``--unique-experts 8``: 139 MB peak RSS, 82 s CPU, 1.17 GiB file).

Values (sensible scales; the model is random, only its speed matters): linear weights
N(0, 1/ne0) (ne0 = input width); token_embd N(0, 0.05^2); norm weights stored as 1 + N(0, 0.1^2);
ssm_a = -U(1, 16); ssm_dt.bias = softplus^-1(U(0.001, 0.1)); conv1d and the right taps N(0, 0.5^2);
router N(0, 1/H); block softmax (spec 3.3) bd_logit_scale N(1.2, 0.3^2), bd_history_bias
N(0, 0.5^2), bd_history_c N(0.5, 0.3^2) (tests/reference/checkpoint.py's scales).

CLI: ``python bench/make_bench_model.py OUT.gguf [--dims real|tiny] [--layers N]
[--outtype q4_k_m|q4_k_s|q3_k_m|q2_k|q8_0|q4_0|q5_k_m|q6_k|iq4_xs|f32|f16|bf16 (any letter case)]
[--arch qwen35moe|clover_moe] [--seed S]
[--threads T] [--unique-experts K] [--no-progress]``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

_ROOT = pathlib.Path(__file__).resolve().parents[1]
for _p in (_ROOT, _ROOT / "tests"):  # the checkout's clover_gguf; tests/reference as `reference`
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from clover_gguf.convert import convert as C  # noqa: E402
from clover_gguf.convert import quant_plan as QP  # noqa: E402
from clover_gguf.convert import record as R  # noqa: E402

_SHARED = next((p for p in (_ROOT.parent / "shared", _ROOT / "shared", pathlib.Path("/work/shared"))
                if (p / "data").is_dir()), pathlib.Path("/work/shared"))
REAL_CONFIG_PATH = _SHARED / "data" / "qwen3.6-35b-a3b.json"
CHAT_TEMPLATE_PATH = _SHARED / "data" / "templates" / "Qwen3.5-4B.jinja"

# clover-spec section 1 test dims (the same as tests/reference/checkpoint.py's tiny config)
TINY_CONFIG = {
    "vocab_size": 2048, "hidden_size": 256, "num_hidden_layers": 4, "full_attention_interval": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "attn_output_gate": True,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 256, "shared_expert_intermediate_size": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "rms_norm_eps": 1e-06, "max_position_embeddings": 4096,
}

# Added tokens after the BPE vocabulary (content, special), as in Qwen's tokenizer.json.
ADDED_TOKENS = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
                ("<think>", False), ("</think>", False), ("<|mask|>", True)]
_CORPUS_MODULES = ["argparse.py", "textwrap.py", "string.py", "difflib.py", "json/decoder.py", "csv.py"]
_CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content']"
           " + '<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
           "{{- '<|im_start|>assistant\\n' }}{%- endif %}")

PIECE_VALUES = 1 << 22  # values per generated piece (whole rows; one expert matrix at most)


def bench_config(dims: str = "real", n_layers: int | None = None) -> dict:
    """The HF-style text config for ``dims`` ("real" or "tiny") with ``n_layers`` layers.
    Raises ValueError for an unknown dims, FileNotFoundError when the real config is missing."""
    if dims == "tiny":
        cfg = json.loads(json.dumps(TINY_CONFIG))
    elif dims == "real":
        if not REAL_CONFIG_PATH.is_file():
            raise FileNotFoundError(f"--dims real needs {REAL_CONFIG_PATH}")
        cfg = {k: v for k, v in json.loads(REAL_CONFIG_PATH.read_text()).items()
               if not k.startswith("_") and k != "clover_diffusion"}
    else:
        raise ValueError(f"dims {dims!r}: expected 'real' or 'tiny'")
    if n_layers is not None:
        if n_layers < 1:
            raise ValueError(f"layers {n_layers}: expected >= 1")
        cfg["num_hidden_layers"] = int(n_layers)
    cfg.pop("layer_types", None)
    cfg["tie_word_embeddings"] = False
    return cfg


def build_tokenizer_dir(out_dir: pathlib.Path, n_tokens: int = 1024) -> None:
    """Train a small byte-level BPE (qwen35 pre-tokenizer regex) of ``n_tokens`` tokens incl. the
    added tokens, and write tokenizer.json / tokenizer_config.json into ``out_dir``."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import sysconfig

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(C.QWEN35_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    corpus = [(stdlib / m).read_text(encoding="utf-8", errors="replace") for m in _CORPUS_MODULES
              if (stdlib / m).is_file()] + ["Hello world! The quick brown fox jumps over the lazy dog. " * 50]
    trainer = trainers.BpeTrainer(vocab_size=n_tokens - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    for content, special in ADDED_TOKENS:
        at = AddedToken(content, special=special, normalized=False)
        (tok.add_special_tokens if special else tok.add_tokens)([at])
    tok.save(str(out_dir / "tokenizer.json"))
    template = CHAT_TEMPLATE_PATH.read_text() if CHAT_TEMPLATE_PATH.is_file() else _CHATML
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
        "chat_template": template, "add_bos_token": False}))


# block softmax parameters (spec 3.3): (mean, std) as tests/reference/checkpoint.py draws them
_BLOCK_SOFTMAX = {"bd_logit_scale": (1.2, 0.3), "bd_history_bias": (0.0, 0.5), "bd_history_c": (0.5, 0.3)}


def _init_kind(name: str) -> str:
    suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
    if suffix == "token_embd.weight":
        return "embd"
    if suffix.endswith("norm.weight"):
        return "ssm_norm" if suffix == "ssm_norm.weight" else "norm"
    if suffix == "ssm_a":
        return "ssm_a"
    if suffix == "ssm_dt.bias":
        return "dt"
    if suffix.startswith("ssm_conv1d"):
        return "conv"
    if suffix.startswith("bd_"):
        return suffix
    return "linear"  # std 1/sqrt(row length), incl. the router and ffn_gate_inp_shexp


def _values(kind: str, rng: np.random.Generator, n_rows: int, ne0: int) -> np.ndarray:
    n = n_rows * ne0
    if kind == "embd":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(0.05)
    elif kind == "linear":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(1.0 / np.sqrt(ne0))
    elif kind == "norm":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(0.1) + np.float32(1.0)
    elif kind == "ssm_norm":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(0.1) + np.float32(1.0)
    elif kind == "ssm_a":
        a = -rng.uniform(1.0, 16.0, n).astype(np.float32)
    elif kind == "dt":
        dt = rng.uniform(0.001, 0.1, n)
        a = np.log(np.expm1(dt)).astype(np.float32)
    elif kind == "conv":
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(0.5)
    elif kind in _BLOCK_SOFTMAX:
        mean, std = _BLOCK_SOFTMAX[kind]
        a = rng.standard_normal(n, dtype=np.float32) * np.float32(std) + np.float32(mean)
    else:
        raise ValueError(f"init kind {kind!r}")
    return a.reshape(n_rows, ne0)


def _pieces(shape: tuple) -> list:
    """Row ranges [(r0, r1)] of a tensor viewed as [rows, ne0], each <= PIECE_VALUES values and
    never crossing an expert matrix (3-D tensors)."""
    ne0 = shape[-1]
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    per = rows if len(shape) < 3 else shape[-2]  # rows of one expert
    step = max(1, min(per, PIECE_VALUES // ne0))
    out = []
    for base in range(0, rows, per):
        for r in range(base, min(rows, base + per), step):
            out.append((r, min(base + per, r + step)))
    return out


def make_bench_model(out_path, dims: str = "real", n_layers: int | None = None, outtype: str = "q4_k_m",
                     arch: str = "qwen35moe", seed: int = 0, threads: int | None = None,
                     progress: bool = True, unique_experts: int | None = None) -> dict:
    """Write a random-weight GGUF of ``dims``/``n_layers`` in ``outtype`` to ``out_path``.

    out_path: written as ``out_path.part`` and renamed when complete. dims: "real" (Qwen3.6-35B-A3B)
    or "tiny". outtype: one of ``convert.quant_plan.OUTTYPES`` (any letter case). arch: "qwen35moe" (llama.cpp
    loads it) or "clover_moe" (the complete Clover file: block tensors and the decoding record at
    its defaults; module docstring). threads:
    generator/quantiser threads (default os.cpu_count()). unique_experts: None (every expert
    matrix drawn fresh) or K: expert e of each 3-D expert tensor repeats the bytes of expert
    e % K (speed does not depend on the values; experts are ~90% of the 35B values, and ggml's
    reference K-quant quantisers run at only ~10 M values/s per thread).

    Returns a dict: path, arch, outtype, file_type, n_tensors, n_bytes, types ({name: type name}).
    Raises ValueError for a bad outtype/arch/dims.
    """
    import gguf

    outtype = QP.outtype_name(outtype)
    if arch not in C.ARCHES:
        raise ValueError(f"arch {arch!r}: expected one of {', '.join(C.ARCHES)}")
    out_path = pathlib.Path(out_path)
    hp = C.read_hparams(bench_config(dims, n_layers))
    with tempfile.TemporaryDirectory() as td:
        build_tokenizer_dir(pathlib.Path(td), n_tokens=min(1024, hp.V))
        vocab = C.read_vocab(pathlib.Path(td), hp)
    record = R.defaults(vocab.tokens.index("<|mask|>")) if arch == C.ARCH_CLOVER else None
    shapes = QP.tensor_shapes(hp, arch)
    types = QP.plan_types(arch, hp, dict(shapes), outtype)

    def nbytes(shape, qt):
        block, tsize = gguf.GGML_QUANT_SIZES[qt]
        return int(np.prod(shape)) // block * tsize

    nthreads = max(1, int(threads or os.cpu_count() or 1))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    part = out_path.with_name(out_path.name + ".part")
    w = gguf.GGUFWriter(path=None, arch=arch)
    total = sum(nbytes(s, types[n]) for n, s in shapes)
    bar = None
    try:
        C.add_trunk_metadata(w, hp, vocab, outtype, f"random-{dims}-{hp.n_layer}L")
        if record is not None:
            R.add_to_writer(w, record)
        for name, shape in shapes:
            w.add_tensor_info(name, shape, np.dtype(np.float32), nbytes(shape, types[name]), raw_dtype=types[name])
        w.write_header_to_file(path=part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"bench {outtype}", file=sys.stderr)

        def job(name, shape, qt, i, r0, r1):
            rng = np.random.default_rng([seed, zlib.crc32(name.encode()), i])
            a = _values(_init_kind(name), rng, r1 - r0, shape[-1])
            return C.encode(a, qt)

        with ThreadPoolExecutor(nthreads) as pool:
            for name, shape in shapes:
                qt = types[name]
                w.write_padding(fout, fout.tell())
                n = 0
                pending = deque()
                first = {}  # (expert % K, row offset in the expert) -> future of its bytes
                per = shape[-2] if len(shape) == 3 else None
                for i, (r0, r1) in enumerate(_pieces(shape)):
                    key = None
                    if unique_experts and per is not None:
                        key = ((r0 // per) % unique_experts, r0 % per)
                    if key is not None and key in first:
                        fut = first[key]
                    else:
                        fut = pool.submit(job, name, shape, qt, i, r0, r1)
                        if key is not None:
                            first[key] = fut
                    pending.append(fut)
                    if len(pending) >= 2 * nthreads:
                        b = pending.popleft().result()
                        fout.write(b.reshape(-1).view(np.uint8).data)
                        n += b.nbytes
                        if bar is not None:
                            bar.update(b.nbytes)
                while pending:
                    b = pending.popleft().result()
                    fout.write(b.reshape(-1).view(np.uint8).data)
                    n += b.nbytes
                    if bar is not None:
                        bar.update(b.nbytes)
                if n != nbytes(shape, qt):
                    raise RuntimeError(f"internal: tensor {name} wrote {n} bytes, expected {nbytes(shape, qt)}")
                w.write_padding(fout, n)
        w.close()
        os.replace(part, out_path)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return {"path": str(out_path), "arch": arch, "outtype": outtype, "file_type": QP.file_type(outtype),
            "n_tensors": len(shapes), "n_bytes": out_path.stat().st_size,
            "types": {n: gguf.GGMLQuantizationType(t).name for n, t in types.items()}}


def main(argv=None) -> int:
    """CLI (module docstring). Prints the written path and size; returns 0."""
    ap = argparse.ArgumentParser(description="Random-weight benchmark GGUF (qwen35moe or clover_moe), written "
                                             "directly quantised.")
    ap.add_argument("out", metavar="OUT.gguf")
    ap.add_argument("--dims", choices=("real", "tiny"), default="real")
    ap.add_argument("--layers", type=int, default=None, help="number of layers (default: 40 real, 4 tiny)")
    ap.add_argument("--outtype", type=str.lower, choices=QP.OUTTYPES, default="q4_k_m")
    ap.add_argument("--arch", choices=C.ARCHES, default="qwen35moe")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", "-t", type=int, default=None)
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--unique-experts", type=int, default=None, metavar="K",
                    help="draw only K distinct expert matrices per expert tensor and repeat them (faster; "
                         "default: every expert drawn)")
    a = ap.parse_args(argv)
    r = make_bench_model(a.out, dims=a.dims, n_layers=a.layers, outtype=a.outtype, arch=a.arch, seed=a.seed,
                         threads=a.threads, progress=not a.no_progress, unique_experts=a.unique_experts)
    print(f"wrote {r['path']}: {r['arch']} {r['outtype']}, {r['n_tensors']} tensors, {r['n_bytes'] / 2**30:.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
