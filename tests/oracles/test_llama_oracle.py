"""llama.cpp as a second oracle for everything Clover shares with its parent.

Runs whenever llama-cpp-python can be run: importable here, or a Python that has it named by
``CLOVER_LLAMA_PYTHON`` (``bench/llama_oracle.sh`` builds llama-cpp-python 0.3.36 from source
into its own venv and sets it). llama.cpp runs in a subprocess (tests/llama_runner.py), so its
ggml and our engine never share a process.

Two sources of ``qwen35moe`` files, each at F32, Q8_0 and Q4_K_M:
- ours: our converter (``--arch qwen35moe``) on the random tiny parent checkpoint;
- llama.cpp's: its ``convert_hf_to_gguf.py`` (F32, Q8_0) and ``llama_model_quantize`` (Q4_K_M
  from its F32 file) on the same checkpoint (needs the llama.cpp source tree,
  ``CLOVER_LLAMA_CPP_SRC``, default the sdist unpacked under /tmp/llsrc).
On each file both engines compute the logits of every position of 3 prompts and 64 greedy
tokens per prompt. Quantized files are compared like with like (shared/notes/oracles.md): the
same bytes, activations quantised to Q8_0 / Q8_K by both engines.
"""
from __future__ import annotations

import json
import pathlib
import subprocess

import numpy as np
import pytest

from llamacpp import LLAMA_CPP_SRC, llama_python, run_llama_converter

HERE = pathlib.Path(__file__).resolve().parents[1]  # tests/: llama_runner.py
PROMPTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The quick brown fox jumps over the lazy dog. Block diffusion fills many tokens at once.",
    "import os\nimport sys\n\nclass Config:\n    \"\"\"Settings read from the environment.\"\"\"\n",
]
N_GREEDY = 64
# F32: strict. Max |logit difference| 1e-3 (oracles.md measured 5.6e-4 between llama.cpp and
# transformers), top-1 equal at every position, 64 greedy tokens identical.
F32_TOL = 1e-3
# Q8_0 / Q4_K_M: the same weight bytes and the same activation quantisation in both engines,
# but float summation order differs (1e-6 relative), and with ~1e4 quantised activations per
# position that moves a few of them across a Q8 rounding boundary (a step of amax/127) at
# almost every position; the random tiny model amplifies those steps through the GDN state and
# routing. Identity is therefore out of reach; the checks are: max |logit diff| <= 1.5 (logits
# reach ~30; measured up to 1.2), top-1 equal at >= 95% of positions, and greedy tokens equal
# until the first step where llama.cpp's own margin between its token and ours is < 0.5 (a
# near tie that such a difference can flip). Figures are printed and recorded in the issue note.
Q_TOL, Q_TOP1, Q_TIE = 1.5, 0.95, 0.5


LLAMA_PY = llama_python()
pytestmark = pytest.mark.skipif(
    LLAMA_PY is None, reason="llama-cpp-python not importable and CLOVER_LLAMA_PYTHON not set "
                             "(bench/llama_oracle.sh builds it and runs these tests)")


def _run_llama(cfg: dict) -> None:
    p = subprocess.run([LLAMA_PY, str(HERE / "llama_runner.py"), json.dumps(cfg)], capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, f"llama.cpp runner failed ({p.returncode}): {p.stderr[-3000:]}"


def _llama_outputs(path: pathlib.Path, prompts: list[list[int]]) -> dict:
    out = path.with_suffix(".llama.npz")
    _run_llama({"model": str(path), "prompts": prompts, "n_greedy": N_GREEDY, "out": str(out), "threads": 2})
    return dict(np.load(out))


def _llama_convert(hf_dir: pathlib.Path, out: pathlib.Path, outtype: str) -> pathlib.Path:
    """llama.cpp's own converter (tests/llamacpp.py)."""
    return run_llama_converter(hf_dir, out, outtype)


@pytest.fixture(scope="module")
def parent_ckpt(make_ckpt):
    return make_ckpt(clover=False)


@pytest.fixture(scope="module")
def llama_files(parent_ckpt, tmp_path_factory):
    """llama.cpp's converter output of the parent checkpoint: {outtype: path}."""
    if not (LLAMA_CPP_SRC / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp source not found at {LLAMA_CPP_SRC} (set CLOVER_LLAMA_CPP_SRC)")
    d = tmp_path_factory.mktemp("llconv")
    files = {t: _llama_convert(parent_ckpt, d / f"ll-{t}.gguf", t) for t in ("f32", "q8_0")}
    files["q4_k_m"] = d / "ll-q4_k_m.gguf"
    _run_llama({"quantize": [str(files["f32"]), str(files["q4_k_m"]), "Q4_K_M"]})
    return files


def _greedy_check(ours: list, ref_tokens: list, ref_rows: np.ndarray, strict: bool) -> int:
    """Number of leading greedy tokens equal to llama.cpp's; asserts the rule of the type."""
    n = next((i for i, (a, b) in enumerate(zip(ours, ref_tokens)) if a != b), len(ref_tokens))
    margin = float(ref_rows[n][ref_tokens[n]] - ref_rows[n][ours[n]]) if n < min(len(ours), len(ref_tokens)) else 0.0
    if strict:
        assert n == len(ref_tokens) == len(ours), \
            f"greedy tokens differ from step {n} (llama.cpp prefers its token {ref_tokens[n:n + 1]} by {margin:.3f})"
    elif n < len(ref_tokens):
        assert margin < Q_TIE, f"greedy step {n}: llama.cpp prefers its token by {margin:.3f} (not a near tie)"
    return n


def _compare(path: pathlib.Path, outtype: str) -> dict:
    from clover_gguf.model import Model

    strict = outtype == "f32"
    # F32 KV caches on both sides (llama_runner.py): with an F16 cache llama.cpp's CPU code also
    # rounds q to fp16 for the K product (F16's vec_dot_type) and the softmax weights (or, with
    # flash attention, the running output sums) to fp16; ours keeps those float32
    with Model(str(path), n_ctx=512, n_threads=2, type_k="f32", type_v="f32") as m:
        assert m.arch == "qwen35moe"
        prompts = [m.tokenize(p) for p in PROMPTS]
        ref = _llama_outputs(path, prompts)
        diffs, agree, same = [], 0, []
        for k, ids in enumerate(prompts):
            ours = m.prefix_logits(ids)
            theirs = ref[f"logits{k}"]
            assert ours.shape == theirs.shape
            diffs.append(np.abs(ours - theirs).max(1))
            a = ours.argmax(1) == theirs.argmax(1)
            agree += int(a.sum())
            if strict:
                assert a.all(), f"prompt {k}: top-1 differs at positions {np.flatnonzero(~a).tolist()}"
            # llama.cpp's greedy run has no penalties; ours are on by default (spec 5.4)
            gen, _ = m.generate_tokens(ids, max_tokens=N_GREEDY, mode="ar", temperature=0.0, end_ids=[],
                                       presence_penalty=0.0, repeat_penalty=1.0)
            same.append(_greedy_check(gen, ref[f"greedy{k}"].tolist(), ref[f"glogits{k}"], strict))
    d = np.concatenate(diffs)
    n = d.size
    print(f"\n{path.name}: {n} positions, top-1 {agree}/{n}, max |logit diff| {d.max():.3g} "
          f"(median per position {np.median(d):.3g}), greedy tokens equal before divergence {same} of {N_GREEDY}")
    if strict:
        assert d.max() <= F32_TOL, f"max |logit diff| {d.max()} > {F32_TOL}"
    else:
        assert d.max() <= Q_TOL, f"max |logit diff| {d.max()} > {Q_TOL}"
        assert agree >= Q_TOP1 * n, f"top-1 agreement {agree}/{n} < {Q_TOP1:.0%}"
    return {"max_abs": float(d.max()), "positions": n}


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_k_m"])
def test_our_converter_files(outtype, make_gguf):
    """Our converter's qwen35moe file: our engine == llama.cpp on the same file."""
    _compare(make_gguf(outtype, arch="qwen35moe", clover=False), outtype)


@pytest.mark.parametrize("outtype", ["f32", "q8_0", "q4_k_m"])
def test_llama_converter_files(outtype, llama_files):
    """llama.cpp's converter (and quantizer) output loads in our engine and agrees."""
    _compare(llama_files[outtype], outtype)


def _as_qwen35moe(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    """A copy of a clover_moe trunk with llama.cpp 0.3.36's parent architecture: every
    ``clover_moe.`` key renamed ``qwen35moe.``, ``expert_shared_count`` dropped, tensors unchanged."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), "qwen35moe")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "clover_moe.expert_shared_count"):
            continue
        key = "qwen35moe." + name[len("clover_moe."):] if name.startswith("clover_moe.") else name
        v, t = f.contents(), f.types[0]
        if t == GGUFValueType.ARRAY:
            w.add_array(key, v)
        elif t == GGUFValueType.STRING:
            w.add_string(key, v)
        else:
            w.add_key_value(key, v, t)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_clover_split_trunk_against_llama_cpp_and_transformers(make_ckpt, make_gguf, tmp_path):
    """The trunk of a Clover checkpoint as ``convert --split`` writes it (llama.cpp's clover_moe
    layout), renamed to qwen35moe for llama-cpp-python 0.3.36 (which predates clover_moe): F32
    logits of every position of 3 prompts, ours on the trunk itself, llama.cpp's on the renamed
    copy and transformers' Qwen3_5MoeForCausalLM on the same checkpoint's trunk, pairwise within
    1e-3."""
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    from clover_gguf.model import Model

    ckpt = make_ckpt()
    trunk = make_gguf("f32", split=True)
    renamed = _as_qwen35moe(trunk, tmp_path / "trunk-qwen35moe.gguf")
    cfg = json.loads((ckpt / "config.json").read_text())
    hf = Qwen3_5MoeForCausalLM.from_pretrained(str(ckpt), config=Qwen3_5MoeTextConfig(**cfg.get("text_config", cfg)),
                                               dtype=torch.float32).eval()
    with Model(str(trunk), n_ctx=512, n_threads=2, diffusion_path="") as m:
        assert m.arch == "clover_moe" and not m.has_block
        prompts = [m.tokenize(p) for p in PROMPTS]
        ours = [m.prefix_logits(ids) for ids in prompts]
    theirs = _llama_outputs(renamed, prompts)
    worst = {"llama.cpp": 0.0, "transformers": 0.0, "llama.cpp vs transformers": 0.0}
    for k, ids in enumerate(prompts):
        with torch.no_grad():
            t = hf(torch.tensor([ids])).logits[0].float().numpy()
        ll = theirs[f"logits{k}"]
        for name, (a, b) in {"llama.cpp": (ours[k], ll), "transformers": (ours[k], t),
                             "llama.cpp vs transformers": (ll, t)}.items():
            worst[name] = max(worst[name], float(np.abs(a - b).max()))
        assert (ours[k].argmax(1) == ll.argmax(1)).all()
    print(f"\nclover_moe trunk F32, max |logit diff|: {worst}")
    assert max(worst.values()) <= F32_TOL
