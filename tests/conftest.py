"""Shared pytest fixtures: random HF test checkpoints (tests/reference/checkpoint.py).

- ``make_ckpt(**opts) -> pathlib.Path``: session-scoped factory; ``opts`` are keyword
  arguments of ``reference.checkpoint.make_checkpoint`` (dims, n_layers, clover, prefix,
  fused_experts, seed, block_size, lm_head_gain, router_gain, extra_config, ...).
  Each distinct option set is written once per session under pytest's tmp dir and reused.
- ``tiny_ckpt``: the default tiny Clover checkpoint (prefix ``model.``, fused experts, seed 0).
- ``make_gguf(outtype, arch, split, record, **ckpt_opts)``: that checkpoint converted (complete
  ``clover_moe`` file, ``qwen35moe``, or with ``split`` the trunk with its sidecar
  ``<stem>.diffusion.gguf`` beside it), cached per argument set.
- ``rewrite_gguf(src, dst, kv, tensor_fn)``: a copy of a GGUF with KV values or tensors changed
  (malformed-input and non-finite tests); ``engine_load_error(path)``: the native loader's message
  ('' when it loads); ``nan_model``: the tiny f32 model with a NaN in blk.2.
- ``make_hf_ckpt(**opts) -> pathlib.Path``: session-scoped factory of tiny
  ``Qwen3_5MoeForCausalLM`` checkpoints written by transformers' own ``save_pretrained``
  (sharded, index, transformers' config.json; every parameter random with make_checkpoint's
  scales, so the values equal ``make_ckpt(clover=False, seed=...)``); ``opts`` are keyword
  arguments of ``reference.checkpoint.make_hf_saved_checkpoint`` (seed, mtp, n_layers,
  max_shard_size, ...). Cached per option set (do not modify the returned directory).
"""

from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import pytest

_ROOT = pathlib.Path(__file__).resolve().parents[1]
try:  # use the checkout when the package is not installed
    import clover_gguf  # noqa: F401
except ImportError:
    sys.path.insert(0, str(_ROOT))
# tests/reference (the PyTorch reference and the checkpoint generator) as the package `reference`
if str(_ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(_ROOT / "tests"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")


def pytest_runtest_setup(item):
    # torch on a busy 2-core machine: its 2-thread pool spin-waits and small-tensor work (the
    # reference, transformers, the checkpoint generator) runs up to ~20x slower. Use one thread
    # once some test has imported torch; torch itself is never imported here.
    torch = sys.modules.get("torch")
    if torch is not None and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture(scope="session")
def make_ckpt(tmp_path_factory):
    """Factory fixture: ``make_ckpt(**opts)`` returns the directory of a random HF checkpoint
    written by ``reference.checkpoint.make_checkpoint(out_dir, **opts)``, cached per option
    set for the whole session (do not modify the returned directory)."""
    from reference.checkpoint import make_checkpoint

    cache: dict[str, pathlib.Path] = {}

    def _make(**opts) -> pathlib.Path:
        key = json.dumps(opts, sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp("ckpt")
            cache[key] = make_checkpoint(out, **opts)
        return cache[key]

    return _make


@pytest.fixture(scope="session")
def tiny_ckpt(make_ckpt) -> pathlib.Path:
    """Tiny Clover checkpoint: spec section 1 tiny dims, prefix model., fused experts, seed 0."""
    return make_ckpt()


@pytest.fixture(scope="session")
def make_gguf(make_ckpt, tmp_path_factory):
    """Factory fixture: ``make_gguf(outtype="f32", arch=None, split=False, record=None,
    **ckpt_opts)`` converts the ``make_ckpt(**ckpt_opts)`` checkpoint with
    ``convert.convert.convert(..., split=split, record=record)`` and returns the GGUF path (with
    ``split``: the trunk; its sidecar is ``<stem>.diffusion.gguf`` in the same directory), cached
    per argument set for the session (do not modify the files)."""
    from clover_gguf.convert.convert import convert

    cache: dict[str, pathlib.Path] = {}

    def _make(outtype: str = "f32", arch: str | None = None, split: bool = False, record: dict | None = None,
              **ckpt_opts) -> pathlib.Path:
        key = json.dumps([outtype, arch, split, record, ckpt_opts], sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{outtype}-{arch or 'auto'}{'-trunk' if split else ''}.gguf"
            convert(make_ckpt(**ckpt_opts), out, outtype=outtype, arch=arch, split=split, record=record,
                    progress=False)
            cache[key] = out
        return cache[key]

    return _make


@pytest.fixture(scope="session")
def make_hf_ckpt(tmp_path_factory):
    """Factory fixture: ``make_hf_ckpt(**opts)`` returns the directory of a tiny
    Qwen3_5MoeForCausalLM checkpoint saved by transformers
    (``reference.checkpoint.make_hf_saved_checkpoint(out_dir, **opts)``), cached per option set
    for the whole session (do not modify the returned directory)."""
    from reference.checkpoint import make_hf_saved_checkpoint

    cache: dict[str, pathlib.Path] = {}

    def _make(**opts) -> pathlib.Path:
        key = json.dumps(opts, sort_keys=True, default=str)
        if key not in cache:
            out = tmp_path_factory.mktemp("hfckpt")
            cache[key] = make_hf_saved_checkpoint(out, **opts)
        return cache[key]

    return _make


def engine_load_error(path) -> str:
    """The native loader's message for ``path`` (clover_model_load, no tokenizer): '' when it loads."""
    from clover_gguf._ffi import err_buf, ffi, lib

    err = err_buf()
    m = lib.clover_model_load(str(path).encode(), err, len(err))
    if m != ffi.NULL:
        lib.clover_model_free(m)
        return ""
    return ffi.string(err).decode()


def rewrite_gguf(src: pathlib.Path, dst: pathlib.Path, kv: dict | None = None, tensor_fn=None) -> pathlib.Path:
    """Copy GGUF src to dst with the KV values in kv replaced (key -> (value, GGUFValueType)), or
    removed (value None), and each tensor's data passed through tensor_fn(name, array)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(str(src))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    w = GGUFWriter(str(dst), arch)
    kv = kv or {}
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if name in kv:
            continue
        t = f.types[0]
        if t == GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [bytes(f.parts[i]).decode() if sub == GGUFValueType.STRING else f.parts[i].tolist()[0]
                    for i in f.data]
            w.add_key_value(name, vals, t, sub_type=sub)
        elif t == GGUFValueType.STRING:
            w.add_key_value(name, bytes(f.parts[-1]).decode(), t)
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], t)
    for name, (v, t) in kv.items():
        if v is not None:
            w.add_key_value(name, v, t)
    for t in r.tensors:
        data = np.array(t.data)
        if tensor_fn:
            data = tensor_fn(t.name, data)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


@pytest.fixture(scope="session")
def nan_model(make_gguf, tmp_path_factory):
    """The tiny f32 model with one NaN in blk.2's post-attention norm."""
    def fn(name, a):
        if name == "blk.2.post_attention_norm.weight":
            a = a.copy()
            a.reshape(-1)[3] = np.nan
        return a
    return rewrite_gguf(make_gguf("f32"), tmp_path_factory.mktemp("nan") / "nan.gguf", tensor_fn=fn)
