"""The embedded default model (clover_gguf/models/, made by bench/train/train_tiny.py).

It loads, is a complete clover_moe file (Gated DeltaNet layers with Clover's block tensors,
gated attention, MoE with a shared expert, the decoding record of spec 4.2), greedy ``ar`` text for a fixed prompt is deterministic (and thread-count
independent), and its greedy ``ar`` and ``diffusion`` outputs on fixed prompts equal the
recorded fixture tests/data/default_model.json. After retraining the model, regenerate the
fixture with::

    CLOVER_LIB=... python tests/python/test_default_model.py --write
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import sys

import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[2]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import clover_gguf  # noqa: E402

FIXTURE = _ROOT / "tests" / "data" / "default_model.json"
AR_PROMPT = "def fibonacci(n):"
DIFFUSION_PROMPT = "class Config:\n    def __init__(self"
N_AR, N_DIFFUSION = 48, 64


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _outputs(m) -> dict:
    """Greedy outputs at the GGUF's defaults (threshold, block size, coreset, penalties)."""
    ar, _ = m.generate_tokens(m.tokenize(AR_PROMPT), max_tokens=N_AR, mode="ar")
    dt, st = m.generate_tokens(m.tokenize(DIFFUSION_PROMPT), max_tokens=N_DIFFUSION, mode="diffusion")
    return {
        "ar_prompt": AR_PROMPT, "ar_tokens": ar, "ar_text": m.detokenize(ar),
        "diffusion_prompt": DIFFUSION_PROMPT, "diffusion_tokens": dt, "diffusion_text": m.detokenize(dt),
        "diffusion_n_forward_denoise": st["n_forward_denoise"],
    }


@pytest.fixture(scope="module")
def model():
    if not os.path.isfile(clover_gguf.DEFAULT_MODEL):
        pytest.fail(f"embedded model missing: {clover_gguf.DEFAULT_MODEL}")
    with clover_gguf.Model(clover_gguf.DEFAULT_MODEL, n_ctx=512, n_threads=1) as m:
        yield m


def test_default_model_loads(model):
    assert model.arch == "clover_moe" and model.has_block and model.sidecar_path is None
    hp = model.hparams
    assert hp["block_size"] == 32 and abs(hp["threshold"] - 0.95) < 1e-6 and abs(hp["coreset_top_p"] - 0.9) < 1e-6
    assert not hp["shift_logits"] and hp["block_aligned"] and hp["penalty_scope"] == "response"
    assert model.n_vocab % 256 == 0
    assert os.path.getsize(clover_gguf.DEFAULT_MODEL) < 30 * 2**20
    from clover_gguf.gguf import GGUFFile

    with GGUFFile(clover_gguf.DEFAULT_MODEL) as f:
        md = f.metadata
        names = {t["name"] for t in f.tensors}
    assert md["general.architecture"] == "clover_moe" and md["clover_moe.expert_shared_count"] == 1
    assert md["clover_moe.expert_count"] > md["clover_moe.expert_used_count"] > 1
    assert md["clover_moe.embedding_length"] % 256 == 0
    for part in ("ssm_conv1d_right", "bd_logit_scale", "bd_history_bias", "bd_history_c", "attn_gate", "attn_q",
                 "ffn_gate_exps", "ffn_up_shexp", "ffn_gate_inp_shexp"):
        assert any(f".{part}." in n + "." for n in names), part
    assert "<|mask|>" in md["tokenizer.ggml.tokens"] and "<|im_start|>" in md["tokenizer.ggml.tokens"]
    assert "im_start" in md["tokenizer.chat_template"]


def test_ar_greedy_is_deterministic(model):
    ids = model.tokenize(AR_PROMPT)
    a, _ = model.generate_tokens(ids, max_tokens=N_AR, mode="ar")
    b, _ = model.generate_tokens(ids, max_tokens=N_AR, mode="ar")
    with clover_gguf.Model(clover_gguf.DEFAULT_MODEL, n_ctx=512, n_threads=2) as m2:
        c, _ = m2.generate_tokens(ids, max_tokens=N_AR, mode="ar")
    assert a == b == c
    assert len(model.detokenize(a).strip()) > 0


def test_outputs_equal_fixture(model):
    want = json.loads(FIXTURE.read_text())
    assert want["model_sha256"] == _sha256(clover_gguf.DEFAULT_MODEL), \
        "the fixture was recorded for another model file: python tests/python/test_default_model.py --write"
    got = _outputs(model)
    for k in ("ar_tokens", "ar_text", "diffusion_tokens", "diffusion_text", "diffusion_n_forward_denoise"):
        assert got[k] == want[k], k


def test_cli_run_uses_default_model():
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    env["PYTHONPATH"] = str(pathlib.Path(clover_gguf.__file__).resolve().parents[1]) + os.pathsep \
        + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-m", "clover_gguf", "run", "-p", AR_PROMPT, "-n", "8", "--mode", "ar",
                        "--json", "-t", "1"], capture_output=True, text=True, encoding="utf-8", env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    want = json.loads(FIXTURE.read_text())
    assert out["tokens"] == want["ar_tokens"][:8]


def main(argv=None) -> int:
    """``--write``: record the fixture from the current embedded model."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["--write"]:
        print(__doc__)
        return 2
    with clover_gguf.Model(clover_gguf.DEFAULT_MODEL, n_ctx=512, n_threads=1) as m:
        out = {"model_sha256": _sha256(clover_gguf.DEFAULT_MODEL), **_outputs(m)}
    FIXTURE.write_text("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}"
                                         for k, v in out.items()) + "\n}\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
