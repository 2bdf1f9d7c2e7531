"""Load-time checks of a model's tensor layout and vocabulary (native/model/load.c).

- Every tensor of the file is one the architecture reads, as llama.cpp's loader requires
  (done_getting_tensors: "wrong number of tensors"): a tensor beyond block_count, an unknown
  name, Clover's block tensors in a qwen35moe file or a nextn tensor without
  nextn_predict_layers is refused, the error naming the first such tensor in file order.
- MTP (NextN) blocks are checked as llama.cpp's qwen35moe loads them: a full-attention block with
  its MoE plus nextn.eh_proj / enorm / hnorm and the optional embed_tokens, shared_head_head,
  shared_head_norm, each of the right shape.
- tokenizer.ggml.tokens, when present, is an array of strings with one entry per row of
  token_embd.weight (llama.cpp takes n_vocab from it and refuses another token_embd row count);
  a file without it still loads in the engine.
- The diffusion sidecar holds the block tensors of the trunk's GDN layers and nothing else.

Bad files are the embedded model (clover_gguf.DEFAULT_MODEL) or converted test models rewritten
with gguf-py.
"""
from __future__ import annotations

import pathlib
import re
import shutil

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType as VT, GGUFWriter

import clover_gguf
from clover_gguf import CloverError, Model
from clover_gguf._ffi import ERR_SIZE, err_buf, ffi, lib
from conftest import engine_load_error, rewrite_gguf

EMBEDDED = pathlib.Path(clover_gguf.DEFAULT_MODEL)
N_LAYER = 4          # the embedded model's block_count (layers 0-2 Gated DeltaNet, 3 attention)
N_VOCAB = 1024       # its token_embd.weight rows and tokenizer.ggml.tokens entries
BLOCK = ("ssm_conv1d_right.weight", "bd_logit_scale", "bd_history_bias", "bd_history_c")


def _copy(src, dst, add=(), drop=(), arch=None) -> pathlib.Path:
    """A copy of GGUF src at dst with tensors dropped (by name), tensors added ((name, array)
    pairs, after the others) and, with arch, every ``<old arch>.`` key renamed ``<arch>.`` and
    ``clover_moe.expert_shared_count`` left out."""
    r = GGUFReader(str(src))
    old = r.fields["general.architecture"].contents()
    w = GGUFWriter(str(dst), arch or old)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if arch and name == f"{old}.expert_shared_count":
            continue
        key = f"{arch}.{name[len(old) + 1:]}" if arch and name.startswith(old + ".") else name
        v, t = f.contents(), f.types[0]
        if t == VT.ARRAY:
            w.add_array(key, v)
        elif t == VT.STRING:
            w.add_string(key, v)
        else:
            w.add_key_value(key, v, t)
    for t in r.tensors:
        if t.name not in drop:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, a in add:
        w.add_tensor(name, a)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def _refused(path, pattern: str, **kw) -> str:
    with pytest.raises(CloverError, match=pattern) as e:
        Model(str(path), n_ctx=32, n_threads=1, **kw)
    return str(e.value)


def _tokens(path) -> list:
    return list(GGUFReader(str(path)).fields["tokenizer.ggml.tokens"].contents())


# ------------------------------------------------------------------------------- layout
def test_the_embedded_model_loads_and_generates():
    with Model(str(EMBEDDED), n_ctx=64, n_threads=1) as m:
        assert m.hparams["n_layer"] == N_LAYER and m.hparams["n_vocab"] == N_VOCAB and m.has_block
        assert len(m.generate_tokens(m.tokenize("def f(x):"), max_tokens=4, mode="ar")[0]) == 4


@pytest.mark.parametrize("block_count", [1, 2, 3])
def test_block_count_below_the_tensors_present_is_refused(tmp_path, block_count):
    """A 4-layer file with block_count lowered: blk.<block_count>.* are not read, so the file is
    refused naming the first of them (the embedded model's tensors are in layer order)."""
    bad = rewrite_gguf(EMBEDDED, tmp_path / "bc.gguf", {"clover_moe.block_count": (block_count, VT.UINT32)})
    _refused(bad, rf": blk\.{block_count}\.attn_norm\.weight: not part of a clover_moe model with block_count "
                  rf"{block_count} \(the model uses \d+ of the file's 88 tensors\)")


def test_block_count_lowered_in_a_converted_file_is_refused(make_gguf, tmp_path):
    bad = rewrite_gguf(make_gguf("f32"), tmp_path / "bc.gguf", {"clover_moe.block_count": (2, VT.UINT32)})
    _refused(bad, r"blk\.2\.attn_norm\.weight: not part of a clover_moe model with block_count 2")


@pytest.mark.parametrize("name,shape", [("blk.0.foo.weight", (8,)), ("bar.weight", (4, 256)),
                                        ("blk.3.bd_logit_scale", (4,)),      # layer 3 is attention
                                        ("blk.4.attn_norm.weight", (256,)),  # one block past block_count
                                        ("blk.0.attn_q.weight", (1024, 256))])  # layer 0 is GDN
def test_unknown_tensors_are_refused_by_name(tmp_path, name, shape):
    bad = _copy(EMBEDDED, tmp_path / "extra.gguf", add=[(name, np.ones(shape, np.float32))])
    _refused(bad, rf": {re.escape(name)}: not part of a clover_moe model with block_count 4 "
                  r"\(the model uses 88 of the file's 89 tensors\)")


def test_block_tensors_in_a_qwen35moe_file_are_refused(tmp_path):
    """The embedded model's keys renamed to qwen35moe: the parent architecture has no block
    tensors, so the first one is named; without them the same file loads."""
    parent = _copy(EMBEDDED, tmp_path / "parent.gguf", arch="qwen35moe")
    _refused(parent, r": blk\.0\.ssm_conv1d_right\.weight: not part of a qwen35moe model with block_count 4")
    block = [f"blk.{il}.{b}" for il in range(3) for b in BLOCK]
    clean = _copy(EMBEDDED, tmp_path / "clean.gguf", drop=block, arch="qwen35moe")
    with Model(str(clean), n_ctx=32, n_threads=1) as m:
        assert m.arch == "qwen35moe" and not m.has_block


def test_tensor_set_is_checked_on_load_from_memory(tmp_path):
    """clover_model_load_memory applies the same check as a file load."""
    bad = _copy(EMBEDDED, tmp_path / "extra.gguf", add=[("bar.weight", np.ones(8, np.float32))])
    for path, want in ((EMBEDDED, ""), (bad, "bar.weight: not part of a clover_moe model")):
        data = np.frombuffer(path.read_bytes(), np.uint8)
        raw = np.zeros(data.size + 64, np.uint8)  # the reader wants the buffer 32-byte aligned
        start = -raw.ctypes.data % 64
        aligned = raw[start:start + data.size]
        aligned[:] = data
        err = err_buf()
        m = lib.clover_model_load_memory(ffi.from_buffer(aligned), data.size, err, ERR_SIZE)
        if m != ffi.NULL:
            lib.clover_model_free(m)
        got = "" if m != ffi.NULL else ffi.string(err).decode()
        assert (want in got) if want else got == "", got


# ---------------------------------------------------------------------------------- MTP
@pytest.fixture(scope="module")
def mtp_file(make_gguf):
    """The tiny Clover with one MTP block (blk.4: attention, MoE and nextn.*), block_count 5."""
    return make_gguf("f32", mtp=1)


def test_nextn_layers_are_accepted(mtp_file, tmp_path):
    with Model(str(mtp_file), n_ctx=32, n_threads=1) as m:
        assert m.hparams["n_layer"] == 4 and m.hparams["n_layer_nextn"] == 1
    # llama.cpp's optional NextN head tensors, of the right shapes, are accepted too
    H, V = 256, 2048
    more = _copy(mtp_file, tmp_path / "head.gguf", add=[("blk.4.nextn.shared_head_head.weight",
                                                         np.zeros((V, H), np.float32)),
                                                        ("blk.4.nextn.embed_tokens.weight",
                                                         np.zeros((V, H), np.float32))])
    assert engine_load_error(more) == ""


def test_mtp_block_tensors_are_checked(mtp_file, tmp_path):
    """The MTP block's tensors are checked as a full-attention block: shapes and names."""
    no_nextn_key = rewrite_gguf(mtp_file, tmp_path / "nokey.gguf", {"clover_moe.nextn_predict_layers": (None, None)})
    _refused(no_nextn_key, r": blk\.4\.nextn\.eh_proj\.weight: not part of a clover_moe model with block_count 5 ")
    foo = _copy(mtp_file, tmp_path / "foo.gguf", add=[("blk.4.nextn.foo.weight", np.ones(8, np.float32))])
    _refused(foo, r": blk\.4\.nextn\.foo\.weight: not part of a clover_moe model with block_count 5 and "
                  r"nextn_predict_layers 1")
    head = _copy(mtp_file, tmp_path / "head.gguf", add=[("blk.4.nextn.shared_head_head.weight",
                                                         np.zeros((8, 256), np.float32))])
    _refused(head, r"tensor blk\.4\.nextn\.shared_head_head\.weight: shape \{256, 8, 1, 1\} expected \{256, 2048")
    norm = rewrite_gguf(mtp_file, tmp_path / "norm.gguf",
                        tensor_fn=lambda n, a: a[:-1] if n == "blk.4.attn_norm.weight" else a)
    _refused(norm, r"tensor blk\.4\.attn_norm\.weight: shape \{255, 1, 1, 1\} expected \{256, 1, 1, 1\}")


# ------------------------------------------------------------------------------ sidecar
@pytest.fixture(scope="module")
def split(make_gguf):
    trunk = make_gguf("f32", split=True)
    return trunk, trunk.with_name(trunk.name[:-len(".gguf")] + ".diffusion.gguf")


def test_the_sidecar_case_loads_and_its_tensors_must_all_be_block_tensors(split, tmp_path):
    trunk, side = split
    with Model(str(trunk), n_ctx=32, n_threads=1) as m:
        assert m.has_block and m.sidecar_path == str(side)
    alone = shutil.copy(trunk, tmp_path / "trunk.gguf")
    bad = _copy(side, tmp_path / "bad.diffusion.gguf", add=[("blk.0.foo.weight", np.ones(4, np.float32))])
    _refused(alone, rf"diffusion sidecar {re.escape(str(bad))}: tensor blk\.0\.foo\.weight is not a block tensor",
             diffusion_path=bad)


# ---------------------------------------------------------------------------- vocabulary
@pytest.mark.parametrize("n", [N_VOCAB - 1, 1, N_VOCAB + 1])
def test_tokens_must_match_the_embedding_rows(tmp_path, n):
    """Fewer tokens than token_embd.weight rows would leave ids the engine can emit without a
    token; more name ids it cannot emit. Both are refused, naming the key and both counts."""
    toks = _tokens(EMBEDDED)
    toks = toks[:n] if n <= N_VOCAB else toks + [f"[EXTRA{i}]" for i in range(n - N_VOCAB)]
    bad = rewrite_gguf(EMBEDDED, tmp_path / "tok.gguf", {"tokenizer.ggml.tokens": (toks, VT.ARRAY)})
    want = rf"key tokenizer\.ggml\.tokens: {n} entries, but token_embd\.weight has {N_VOCAB} rows \(n_vocab\)"
    _refused(bad, want)
    assert re.search(want, engine_load_error(bad))


@pytest.mark.parametrize("value,vtype", [("abc", VT.STRING), ([1] * N_VOCAB, VT.ARRAY)])
def test_tokens_of_another_type_are_refused(tmp_path, value, vtype):
    bad = rewrite_gguf(EMBEDDED, tmp_path / "tok.gguf", {"tokenizer.ggml.tokens": (value, vtype)})
    _refused(bad, r"key tokenizer\.ggml\.tokens: expected an array of strings")


def test_a_file_without_tokens_loads_in_the_engine(tmp_path):
    """No tokenizer.ggml.tokens: the engine loads the model (token ids only; the Python Model
    needs the tokenizer and says so)."""
    bare = rewrite_gguf(EMBEDDED, tmp_path / "bare.gguf", {"tokenizer.ggml.tokens": (None, None)})
    assert engine_load_error(bare) == ""
