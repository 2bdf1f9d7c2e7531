"""llama-cpp-python code runs on Clover: its constructor and call arguments (an effect, or one
warning saying why there is none), its helpers (metadata, tokenizer(), n_embd, set_seed,
from_pretrained) and the embedded model as the default. Reference: llama-cpp-python 0.3.36's
``Llama`` signatures, and llama.cpp's gguf_kv_to_str for ``metadata``."""
from __future__ import annotations

import pathlib
import re
import shutil
import warnings

import pytest

from clover_gguf import DEFAULT_MODEL, Clover, Model, compat
from clover_gguf.gguf import GGUFFile

_ROOT = pathlib.Path(__file__).resolve().parents[2]
N_CTX = 1024

# a value other than llama-cpp-python's default for every argument without an effect
INIT_VALUES = {
    "split_mode": 2, "main_gpu": 1, "tensor_split": [0.5, 0.5], "vocab_only": True,
    "kv_overrides": {"general.name": "x"}, "rope_scaling_type": 2, "rope_freq_base": 1e6,
    "rope_freq_scale": 0.5, "yarn_ext_factor": 1.0, "yarn_attn_factor": 2.0, "yarn_beta_fast": 16.0,
    "yarn_beta_slow": 2.0, "yarn_orig_ctx": 4096, "attention_type": 1, "logits_all": True,
    "offload_kqv": False, "op_offload": True, "swa_full": True, "no_perf": True, "last_n_tokens_size": 128,
    "lora_base": "base.gguf", "lora_path": "lora.gguf", "lora_scale": 0.5, "numa": True,
    "chat_format": "chatml", "chat_handler": object(), "draft_model": object(), "tokenizer": object(),
    "spm_infill": True,
}
CALL_VALUES = {"typical_p": 0.9, "tfs_z": 0.5, "mirostat_mode": 2, "mirostat_tau": 3.0, "mirostat_eta": 0.2,
               "stopping_criteria": [lambda ids, logits: False], "logits_processor": [lambda ids, row: row]}


@pytest.fixture(scope="module")
def llm():
    with Clover(n_ctx=N_CTX, n_threads=1) as c:
        yield c


@pytest.fixture(autouse=True)
def _fresh_warnings():
    compat.reset_warnings()
    yield
    compat.reset_warnings()


def _warned(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, UserWarning)]


def test_tables_cover_llama_cpp_python_and_docs():
    assert set(INIT_VALUES) == set(compat.INIT) and set(CALL_VALUES) == set(compat.CALL)
    doc = (_ROOT / "docs" / "python.md").read_text()
    for name in (*compat.INIT, *compat.CALL, "n_batch", "n_ubatch", "n_threads_batch", "use_mmap", "use_mlock",
                 "flash_attn"):
        assert re.search(rf"`{name}`", doc), f"docs/python.md does not list {name}"


@pytest.mark.parametrize("name", sorted(INIT_VALUES))
def test_constructor_argument_warns_once_with_the_reason(name):
    for _ in range(2):
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            with Clover(n_ctx=64, n_threads=1, **{name: INIT_VALUES[name]}) as c:
                assert c.n_ctx() == 64
        got = [m for m in _warned(rec) if m.startswith(f"{name}=")]
        if _ == 0:
            assert len(got) == 1 and "has no effect: " + compat.INIT[name][1] in got[0], got
        else:
            assert got == []  # one warning per process


def test_constructor_defaults_warn_nothing():
    kwargs = {name: default for name, (default, _) in compat.INIT.items()}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        Clover(n_ctx=64, n_threads=1, **kwargs).close()
    assert _warned(rec) == []


def test_unknown_constructor_argument_is_a_type_error():
    with pytest.raises(TypeError, match="n_gqa"):
        Clover(n_ctx=64, n_gqa=8)


@pytest.mark.parametrize("name", sorted(CALL_VALUES))
def test_call_argument_warns_and_changes_nothing(llm, name):
    ref = llm.create_completion("def f(x):", max_tokens=6, mode="ar")["choices"][0]["text"]
    with pytest.warns(UserWarning, match=rf"^{name}=.*has no effect"):
        out = llm.create_completion("def f(x):", max_tokens=6, mode="ar", **{name: CALL_VALUES[name]})
    assert out["choices"][0]["text"] == ref
    if name != "stopping_criteria":  # llama-cpp-python's chat call has no stopping_criteria
        compat.reset_warnings()
        with pytest.warns(UserWarning, match=rf"^{name}="):
            llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2,
                                       **{name: CALL_VALUES[name]})


def test_call_defaults_warn_nothing(llm):
    kwargs = {name: default for name, (default, _) in compat.CALL.items()}
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        llm.create_completion("def f(x):", max_tokens=2, **kwargs)
    assert _warned(rec) == []


def test_functions_and_function_call_become_tools(llm):
    fn = {"name": "get_weather", "description": "weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                         "required": ["city"]}}
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    r = llm.create_chat_completion(msgs, functions=[fn], function_call={"name": "get_weather"}, max_tokens=64,
                                   mode="ar")
    call = r["choices"][0]["message"]["tool_calls"][0]
    assert r["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_weather"
    tools = [{"type": "function", "function": fn}]
    same = llm.create_chat_completion(msgs, tools=tools, tool_choice={"type": "function",
                                                                       "function": {"name": "get_weather"}},
                                      max_tokens=64, mode="ar")
    assert same["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]
    with pytest.raises(ValueError, match="^function_call"):
        llm.create_chat_completion(msgs, functions=[fn], function_call=5)
    with pytest.raises(ValueError, match="^functions"):
        llm.create_chat_completion(msgs, functions=[fn], tools=tools)


def test_metadata_strings_as_llama_cpp(llm):
    md = llm.metadata
    with GGUFFile(DEFAULT_MODEL) as f:
        raw = f.metadata
    scalars = {k: v for k, v in raw.items() if not isinstance(v, list)}
    assert list(md) == list(scalars)  # arrays (the vocabulary) left out, file order kept
    for k, v in scalars.items():
        assert isinstance(md[k], str)
        if isinstance(v, bool):
            assert md[k] == ("true" if v else "false")
        elif isinstance(v, float):
            assert md[k] == "%f" % v
        else:
            assert md[k] == str(v)
    assert md["general.architecture"] == "clover_moe"
    assert any(isinstance(v, float) for v in scalars.values())  # the float format is exercised


def test_tokenizer_and_token_helpers(llm):
    tk = llm.tokenizer()
    text = "def fib(n):\n    return n"
    ids = tk.encode(text)
    assert ids == llm.tokenize(text.encode()) and tk.tokenize(text.encode()) == ids
    assert tk.decode(ids) == text and tk.detokenize(ids) == text.encode()
    assert llm.detokenize([llm.token_nl()]) == b"\n"
    assert llm.n_embd() == llm.engine.hparams["n_embd"] > 0
    assert llm.token_bos() == llm.engine.tokenizer.bos_token_id


def test_set_seed_is_the_default_seed(llm):
    kw = dict(max_tokens=8, temperature=1.5, mode="ar")
    want = llm.create_completion("import", seed=7, **kw)["choices"][0]["text"]
    llm.set_seed(7)
    try:
        assert llm.create_completion("import", **kw)["choices"][0]["text"] == want
    finally:
        llm.set_seed(0)
    with pytest.raises(ValueError, match="^seed"):
        llm.set_seed(-2)


def test_llama_default_seed_is_random(llm):
    """llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF) asks for a fresh random seed per call."""
    kw = dict(max_tokens=12, temperature=2.0, mode="ar", seed=0xFFFFFFFF)
    texts = {llm.create_completion("x", **kw)["choices"][0]["text"] for _ in range(4)}
    assert len(texts) > 1


def test_default_model_and_n_ctx_zero():
    with Model(n_ctx=0, n_threads=1) as m:
        assert m.path == DEFAULT_MODEL and m.n_ctx == m.hparams["n_ctx_train"] > 0
    with Clover(n_ctx=64) as c:
        assert c.model_path == DEFAULT_MODEL
        assert c.create_completion("def f():", max_tokens=2)["choices"][0]["finish_reason"]


def test_from_pretrained_finds_local_files(tmp_path):
    d = tmp_path / "repo"
    (d / "sub").mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL, d / "sub" / "clover-Q8_0.gguf")
    (d / "sub" / "clover-Q8_0.diffusion.gguf").write_bytes(b"not chosen")
    with Clover.from_pretrained(str(d), filename="*Q8_0.gguf", n_ctx=64) as c:
        assert c.model_path == str(d / "sub" / "clover-Q8_0.gguf") and c.n_ctx() == 64
    # the Hugging Face cache layout, no download
    snap = tmp_path / "hub" / "models--org--clover" / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    shutil.copy(DEFAULT_MODEL, snap / "clover-q8_0.gguf")
    with Clover.from_pretrained("org/clover", filename="*q8_0.gguf", cache_dir=tmp_path / "hub", n_ctx=64) as c:
        assert c.model_path == str(snap / "clover-q8_0.gguf")
    shutil.copy(DEFAULT_MODEL, d / "clover-Q4_K_M.gguf")
    with pytest.raises(ValueError, match=r"^filename: 2 GGUFs .* match '\*\.gguf'"):
        Clover.from_pretrained(str(d), filename="*.gguf")
    with pytest.raises(ValueError, match=r"^filename: no GGUF match '\*Q2_K\*'"):
        Clover.from_pretrained(str(d), filename="*Q2_K*")
    with pytest.raises(ValueError, match="does not download"):
        Clover.from_pretrained("nobody/nothing", filename="*.gguf", cache_dir=tmp_path / "hub")
