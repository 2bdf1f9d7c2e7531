"""Self-speculative decoding (spec 5.5): `spec` mode gives greedy `ar`'s tokens exactly, and
the cache rollback (clover_context_checkpoint / _rollback: truncate KV, replay the GDN and conv
recurrence over the kept tokens) leaves the caches a fresh prefill of the same tokens would."""
import cffi
import numpy as np
import pytest

from clover_gguf import Model
from clover_gguf._ffi import _find_library, err_buf, lib
from clover_gguf._ffi import ffi as _ffi_main

ffi = cffi.FFI()
ffi.cdef("""
int clover_context_checkpoint(void *c, int32_t n_max, char *err, size_t err_size);
int clover_context_rollback(void *c, int32_t n_keep, char *err, size_t err_size);
int clover_prefill(void *c, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits,
                   char *err, size_t err_size);
void clover_context_reset(void *c);
int32_t clover_context_n_past(const void *c);
""")
L = ffi.dlopen(_find_library())

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n", "class Config:\n    ",
           "Once upon a time"]


@pytest.fixture(scope="module")
def files(make_gguf):
    return {"f32": make_gguf("f32"), "q8_0": make_gguf("q8_0")}


@pytest.mark.parametrize("kind,n", [("f32", 256), ("q8_0", 96)])
def test_spec_equals_greedy_ar(files, kind, n):
    """n greedy tokens on 5 prompts: spec == ar token for token (no end-token stop)."""
    with Model(files[kind], n_ctx=1024, n_threads=2) as m:
        for p in PROMPTS:
            ids = m.tokenize(p)
            a, _ = m.generate_tokens(ids, max_tokens=n, mode="ar", end_ids=[])
            b, st = m.generate_tokens(ids, max_tokens=n, mode="spec", end_ids=[])
            assert b == a, p
            assert st["mode"] == "spec" and st["n_forward_verify"] >= 1 and st["n_forward_draft"] >= 1
            assert sum(st["accept_hist"]) == st["n_forward_verify"]
            assert st["n_forward_denoise"] == 0 and st["n_forward_commit"] == 0
            assert st["n_forward"] == (st["n_forward_prefill"] + st["n_forward_draft"] + st["n_forward_verify"]
                                       + st["n_forward_decode"])
            assert st["mean_distinct_experts"] is not None  # drafts are block-mode (coreset) passes
            # the coreset's experts are a subset of the union of the rows' own top-k (spec 5.6)
            assert st["mean_distinct_experts"] <= st["mean_distinct_experts_full"]
            assert st["max_distinct_experts"] <= st["max_distinct_experts_full"]
            # every verify emits 1 + accepted tokens; steps without a draft emit 1 each
            emitted = sum((k + 1) * n for k, n in enumerate(st["accept_hist"])) + st["n_forward_decode"]
            assert emitted >= len(b) and st["finish_reason"] == "length"


def test_spec_with_end_tokens_and_short_context(files):
    """End tokens stop spec at the same place as ar; a context too short for a whole block
    drafts shorter blocks and still matches ar."""
    with Model(files["f32"], n_ctx=64, n_threads=2) as m:
        ids = m.tokenize(PROMPTS[0])
        a, sa = m.generate_tokens(ids, max_tokens=200, mode="ar")
        b, sb = m.generate_tokens(ids, max_tokens=200, mode="spec")
        assert b == a and sb["finish_reason"] == sa["finish_reason"]


def test_spec_refused_for_qwen35moe(make_gguf):
    with Model(make_gguf("f32", arch="qwen35moe", clover=False), n_ctx=128, n_threads=2) as m:
        with pytest.raises(ValueError, match="mode spec needs a Clover model"):
            m.generate_tokens(m.tokenize("hi"), max_tokens=4, mode="spec")


@pytest.mark.parametrize("kind", ["f32", "q8_0"])
@pytest.mark.parametrize("n_keep", [1, 5, 15, 16])
def test_rollback_equals_fresh_prefill(files, kind, n_keep):
    """Partial acceptance forced by hand: after prefix P, verify 16 tokens of which only the
    first n_keep are kept; the next logits after rollback equal those of a fresh prefill of
    P + kept tokens (exactly: the verify runs the GDN token by token like the fresh prefill
    of single tokens below, and replay repeats the same recurrence)."""
    rng = np.random.default_rng(n_keep)
    with Model(files[kind], n_ctx=256, n_threads=2) as m:
        c = ffi.cast("void *", m._ctx)
        lib.clover_context_set_gdn_chunked(m._ctx, 0)  # token-by-token GDN in every prefill below
        V = m.n_vocab
        prefix = rng.integers(0, 1500, 20).tolist()
        block = rng.integers(0, 1500, 16).tolist()
        nxt = int(rng.integers(0, 1500))
        err = err_buf()
        out_a = np.zeros(V, np.float32)
        out_b = np.zeros(V, np.float32)
        scratch = np.zeros(16 * V, np.float32)

        def prefill(toks, out, all_rows=0):
            t = ffi.new("int32_t[]", toks)
            rc = L.clover_prefill(c, t, len(toks), ffi.cast("float *", out.ctypes.data), all_rows, err, len(err))
            assert rc == 0, ffi.string(err)

        L.clover_context_reset(c)
        prefill(prefix, out_a)
        assert L.clover_context_checkpoint(c, 16, err, len(err)) == 0
        prefill(block, scratch, 1)
        assert L.clover_context_n_past(c) == 36
        assert L.clover_context_rollback(c, n_keep, err, len(err)) == 0, ffi.string(err)
        assert L.clover_context_n_past(c) == 20 + n_keep
        prefill([nxt], out_a)
        L.clover_context_reset(c)
        prefill(prefix, out_b)
        for t in block[:n_keep]:
            prefill([t], out_b)
        prefill([nxt], out_b)
        np.testing.assert_array_equal(out_a, out_b)
        # rollback misuse is an error, not a crash
        assert L.clover_context_rollback(c, 1, err, len(err)) != 0
        assert b"rollback without a recorded prefill" in ffi.string(err)


def test_penalty_defaults_by_architecture(make_gguf):
    """The model card's repetition controls (presence 0.9, repetition 1.05, over the response;
    spec 4.2) are the defaults for clover_moe files, or the record's values; parent qwen35moe
    files decode without penalties over the whole history, as llama.cpp does."""
    from clover_gguf._ffi import ffi as cffi_ffi
    record = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.2, "penalty_scope": "all",
              "bias_slope": 0.5, "bias_max": 3.0}
    cases = ((make_gguf("f32"), (0.9, 0.0, 1.05, lib.CLOVER_PENALTY_RESPONSE, 0.01, 10.0)),
             (make_gguf("f32", record=record), (0.5, 0.25, 1.2, lib.CLOVER_PENALTY_ALL, 0.5, 3.0)),
             (make_gguf("f32", arch="qwen35moe", clover=False), (0.0, 0.0, 1.0, lib.CLOVER_PENALTY_ALL, 0.01, 10.0)))
    for path, want in cases:
        with Model(path, n_ctx=64, n_threads=2) as m:
            p = cffi_ffi.new("clover_gen_params *")
            lib.clover_gen_params_default(m._model, p)
            got = (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.penalty_scope, p.bias_slope,
                   p.bias_max)
            assert tuple(round(x, 6) for x in got) == want, path


def test_block_forward_rows_equals_full_on_chosen_rows(files):
    """clover_block_forward_rows (the LM head only on rows whose logits are used, spec 5.2
    cost saver) writes exactly clover_block_forward's values on the chosen rows, leaves the
    others untouched, and reports the same experts per layer."""
    with Model(files["q8_0"], n_ctx=128, n_threads=2) as m:
        mask = m.hparams["mask_token_id"]
        full, nexp = m.block_logits(m.tokenize("def fib(n):"), [5, 9] + [mask] * 6, coreset_top_p=0.9)
        lib.clover_context_reset(m._ctx)
        prefix = m.tokenize("def fib(n):")
        err = err_buf()
        assert lib.clover_prefill(m._ctx, _ffi_main.new("int32_t[]", prefix), len(prefix), _ffi_main.NULL, 0, err, len(err)) == 0
        rows = np.array([0, 1, 0, 0, 1, 1, 0, 1], np.uint8)
        out = np.full((8, m.n_vocab), 7.0, np.float32)
        ne = _ffi_main.new("int32_t[]", m.hparams["n_layer"])
        toks = _ffi_main.new("int32_t[]", [5, 9] + [mask] * 6)
        rc = lib.clover_block_forward_rows(m._ctx, toks, 8, 0.9, _ffi_main.cast("float *", out.ctypes.data),
                                           _ffi_main.cast("uint8_t *", rows.ctypes.data), ne, err, len(err))
        assert rc == 0, _ffi_main.string(err)
        np.testing.assert_array_equal(out[rows == 1], full[rows == 1])
        assert (out[rows == 0] == 7.0).all()
        assert list(ne) == list(nexp)


@pytest.mark.parametrize("mode", ["ar", "diffusion", "spec"])
def test_prefix_reuse_of_a_rerendered_history(files, mode):
    """A chat turn whose template rewrites the previous reply (e.g. drops its reasoning) does not
    extend the cache exactly; with prefix_reuse the state saved at the previous prompt's last
    <|im_start|> (rounded down to the 64-token GDN chunk) is restored, only the rest is
    prefilled, and the answer equals a fresh one (tests/python/test_prefix_reuse.py checks the
    split property itself)."""
    with Model(files["f32"], n_ctx=512, n_threads=2, prefix_reuse=True) as m, \
            Model(files["f32"], n_ctx=512, n_threads=2) as fresh:
        ims = m.tokenizer.token_to_id("<|im_start|>")
        assert ims is not None
        history = [ims] + m.tokenize("system\nYou are terse. " * 12 + "\n") + [ims] + m.tokenize(PROMPTS[0])
        assert len(history) >= 70
        first = history + [ims] + m.tokenize("assistant\n<think>\n")
        a, st = m.generate_tokens(first, max_tokens=16, mode=mode, end_ids=[])
        assert st["n_prompt_reused"] == 0
        second = history + [ims] + m.tokenize("assistant\nAn answer without its reasoning.") + \
            [ims] + m.tokenize("user\nAnd then?") + [ims] + m.tokenize("assistant\n")
        assert second[:len(first)] != first + a  # not an exact extension
        b, st2 = m.generate_tokens(second, max_tokens=16, mode=mode, end_ids=[])
        assert st2["n_prompt_reused"] == len(history) // 64 * 64
        want, _ = fresh.generate_tokens(second, max_tokens=16, mode=mode, end_ids=[])
        assert b == want
        # the state saved for `second` (at its last <|im_start|>) serves a third turn too
        split2 = max(i for i, t in enumerate(second) if t == ims)
        third = second[:split2] + m.tokenize("A different reply.") + [ims] + m.tokenize("assistant\n")
        c, st3 = m.generate_tokens(third, max_tokens=8, mode=mode, end_ids=[])
        assert 0 < st3["n_prompt_reused"] <= split2 and st3["n_prompt_reused"] % 64 == 0
        assert c == fresh.generate_tokens(third, max_tokens=8, mode=mode, end_ids=[])[0]
