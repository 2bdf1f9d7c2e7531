"""Constrained decoding and logprobs in every decoding mode (clover.h clover_constraint and
clover_decoder_logprobs; clover_gguf/grammar.py; docs/structured-output.md), on the random tiny
Clover model and on one with the real vocabulary (248,320 ids).

- Output under a JSON schema, a GBNF grammar or a forced tool call is valid, in ar, spec and
  diffusion, greedy and sampled (the schemas bound their strings, numbers and arrays so that a
  random model ends within max_tokens; the check is that every finished output validates).
- spec under a constraint gives constrained ar's tokens (greedy).
- A token's logprob is the log-softmax of the logits that chose it: in ar, the causal row the
  test recomputes with prefix_logits (tolerance 1e-4, float32 weights); in spec, ar's; in every
  mode, greedy and unconstrained, the chosen token is the row's most likely (its logprob equals
  top[0]).
"""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from clover_gguf import Clover
from clover_gguf._ffi import CloverError, ffi
from clover_gguf.model import Model

MODES = ("ar", "spec", "diffusion")
# penalties off, so that a greedy token is the raw row's argmax
PLAIN = dict(presence_penalty=0.0, repeat_penalty=1.0)
BLOCK = 8  # spec and diffusion blocks: small, so that the real-vocabulary model's passes stay quick
SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                     "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "enums": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "size": {"type": "string", "enum": ["S", "M", "L"]},
        "ok": {"type": "boolean"}}, "required": ["color", "size", "ok"], "additionalProperties": False},
    "arrays": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 4}},
        "required": ["tags", "scores"], "additionalProperties": False},
}
PROMPTS = ["Hello", "def main():", "The weather is", "JSON:"]


@pytest.fixture(scope="module", params=["tiny", "real-vocab"])
def model(request, make_gguf):
    path = make_gguf("f32") if request.param == "tiny" else make_gguf("q8_0", vocab_size=248320)
    with Model(str(path), n_ctx=1024, n_threads=2) as m:
        yield m


@pytest.fixture(scope="module")
def f32_model(make_gguf):
    """float32 weights: prefix_logits' batched rows equal the decode steps' to float rounding
    (a quantised file's many-row kernels round activations differently from its one-row ones)."""
    with Model(str(make_gguf("f32")), n_ctx=1024, n_threads=2) as m:
        yield m


def _gen(m, prompt_ids, **kw):
    return m.generate_tokens(prompt_ids, block_size=BLOCK, **kw)


def _text(m, ids):
    return m.detokenize([t for t in ids if t not in m.end_ids])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("schema", sorted(SCHEMAS))
def test_json_schema_output_validates(model, mode, schema):
    for k, prompt in enumerate(PROMPTS):
        temp = 0.0 if k == 0 else 0.9
        ids, st = _gen(model, model.tokenize(prompt), mode=mode, json_schema=SCHEMAS[schema],
                                        max_tokens=160, temperature=temp, seed=k)
        assert st["finish_reason"] == "stop", (prompt, _text(model, ids))
        jsonschema.validate(json.loads(_text(model, ids)), SCHEMAS[schema])


@pytest.mark.parametrize("mode", MODES)
def test_gbnf_and_lark_grammars_hold(model, mode):
    gbnf = 'root ::= ("yes" | "no") " " [0-9] [0-9]?'
    lark = '%llguidance {}\nstart: ("alpha" | "beta") "-" /[a-c]{2,3}/'
    for seed in range(3):
        ids, _ = _gen(model, model.tokenize("Answer:"), mode=mode, grammar=gbnf, max_tokens=20,
                                       temperature=0.9, seed=seed)
        word, num = _text(model, ids).split(" ")
        assert word in ("yes", "no") and num.isdigit() and len(num) <= 2
        ids, _ = _gen(model, model.tokenize("Answer:"), mode=mode, grammar=lark, max_tokens=20,
                                       temperature=0.9, seed=seed)
        head, tail = _text(model, ids).split("-")
        assert head in ("alpha", "beta") and 2 <= len(tail) <= 3 and set(tail) <= set("abc")


def test_constrained_spec_equals_constrained_ar(model):
    for schema in SCHEMAS.values():
        for prompt in PROMPTS[:2]:
            ar, _ = _gen(model, model.tokenize(prompt), mode="ar", json_schema=schema, max_tokens=120)
            spec, st = _gen(model, model.tokenize(prompt), mode="spec", json_schema=schema,
                                             max_tokens=120)
            assert spec == ar
            assert st["n_forward_verify"] > 0


def test_constrained_diffusion_fills_several_slots_per_pass(model):
    """The in-order rule still fills contiguous confident slots together: fewer forwards than
    tokens over the runs (a random model is rarely confident, so the bound is loose)."""
    n_tok = n_fwd = 0
    for prompt in PROMPTS:
        ids, st = _gen(model, model.tokenize(prompt), mode="diffusion", json_schema=SCHEMAS["enums"],
                                        max_tokens=120, threshold=0.5)
        n_tok += st["n_generated"]
        n_fwd += st["n_forward_denoise"]
    assert n_fwd < n_tok


def _log_softmax(row, mask_id):
    row = row.astype(np.float64).copy()
    if mask_id is not None and mask_id >= 0:
        row[mask_id] = -np.inf
    mx = row.max()
    return row - (mx + np.log(np.exp(row - mx).sum()))


def test_ar_logprobs_equal_log_softmax_of_the_choosing_row(f32_model):
    model = f32_model
    prompt = model.tokenize("def fibonacci(n):")
    for temp, schema in ((0.0, None), (0.8, None), (0.0, SCHEMAS["enums"])):
        ids, st = _gen(model, prompt, mode="ar", max_tokens=12, temperature=temp, seed=3, logprobs=5,
                                        json_schema=schema, **PLAIN)
        lps = st["logprobs"]
        assert len(lps) == len(ids) and ids
        rows = model.prefix_logits(prompt + ids[:-1])[len(prompt) - 1:]
        mask_id = model.hparams.get("mask_token_id")
        for t, (lp, top), row in zip(ids, lps, rows):
            ref = _log_softmax(row, mask_id)
            assert abs(lp - ref[t]) < 1e-4
            want = sorted(range(len(ref)), key=lambda i: (-ref[i], i))[:5]
            assert [i for i, _ in top] == want
            assert np.allclose([v for _, v in top], ref[want], atol=1e-4)


@pytest.mark.parametrize("mode", MODES)
def test_greedy_logprobs_name_the_chosen_token_first(model, mode):
    ids, st = _gen(model, model.tokenize("class Config:"), mode=mode, max_tokens=40, logprobs=3, **PLAIN)
    assert len(st["logprobs"]) == len(ids)
    for t, (lp, top) in zip(ids, st["logprobs"]):
        assert lp <= 0.0 and len(top) == 3
        assert top[0][0] == t and abs(top[0][1] - lp) < 1e-6
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_spec_logprobs_equal_ar_logprobs(model):
    prompt = model.tokenize("import os")
    ar, st_ar = _gen(model, prompt, mode="ar", max_tokens=24, logprobs=2, **PLAIN)
    spec, st_spec = _gen(model, prompt, mode="spec", max_tokens=24, logprobs=2, **PLAIN)
    assert spec == ar
    for (a, ta), (b, tb) in zip(st_ar["logprobs"], st_spec["logprobs"]):
        assert abs(a - b) < 1e-4 and [i for i, _ in ta] == [i for i, _ in tb]


def test_bad_options_are_refused_by_name(model):
    with pytest.raises(ValueError, match="^logprobs: "):
        model.generate("x", logprobs=21)
    with pytest.raises(ValueError, match="^json_schema: "):
        model.generate("x", json_schema={"type": "frob"})
    with pytest.raises(ValueError, match="^json_schema: "):
        model.generate("x", json_schema="{not json")
    with pytest.raises(ValueError, match="^grammar: "):
        model.generate("x", grammar="root ::= (")
    with pytest.raises(ValueError, match="^grammar: "):
        model.generate("x", grammar="root ::= \"a\"", json_schema={})


def test_clover_shapes(make_gguf):
    """Clover's OpenAI shapes: completion logprobs (tokens, token_logprobs, top_logprobs,
    text_offset), chat logprobs.content, streamed chunks adding up to the whole answer's."""
    with Clover(str(make_gguf("f32")), n_ctx=1024, n_threads=2, mode="ar") as c:
        r = c.create_completion("Hello", max_tokens=6, logprobs=3, **PLAIN)
        lp = r["choices"][0]["logprobs"]
        assert "".join(lp["tokens"]) == r["choices"][0]["text"]
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
        assert lp["text_offset"][0] == 0 and all(len(d) == 3 for d in lp["top_logprobs"])
        msgs = [{"role": "user", "content": "hi"}]
        kw = dict(max_tokens=40, logprobs=True, top_logprobs=2, response_format={"type": "json_object"}, **PLAIN)
        whole = c.create_chat_completion(msgs, **kw)
        content = whole["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == whole["choices"][0]["message"]["content"]
        assert all(len(e["top_logprobs"]) == 2 and e["bytes"] == list(e["token"].encode()) for e in content)
        chunks = list(c.create_chat_completion(msgs, stream=True, **kw))
        streamed = [e for ch in chunks if ch["choices"][0]["logprobs"] for e in ch["choices"][0]["logprobs"]["content"]]
        assert streamed == content
        json.loads(whole["choices"][0]["message"]["content"])
        with pytest.raises(ValueError, match="^top_logprobs: "):
            c.create_chat_completion(msgs, top_logprobs=2)
        with pytest.raises(ValueError, match="^enable_thinking: "):
            c.create_chat_completion(msgs, enable_thinking=True, response_format={"type": "json_object"})


class _Forced:
    """A clover_constraint written here (not llguidance): it allows exactly ``seq[pos]`` next (the
    sequence repeats), accept checks and advances pos, rollback moves it back. ``fail``: the mask reports a failure;
    ``empty``: it allows nothing."""

    def __init__(self, seq, fail=False, empty=False):
        self.seq, self.pos, self.fail, self.empty, self.log = list(seq), 0, fail, empty, []
        self.cbs = (ffi.callback("int(void *, uint32_t *)", self._mask),
                    ffi.callback("int(void *, int32_t)", self._accept),
                    ffi.callback("int(void *, int32_t)", self._rollback))
        self.c = ffi.new("clover_constraint *")
        self.c.mask, self.c.accept, self.c.rollback = self.cbs

    def _mask(self, _u, allowed):
        if self.fail:
            return 1
        if not self.empty:
            t = self.seq[self.pos % len(self.seq)]
            allowed[t >> 5] |= 1 << (t & 31)
        return 0

    def _accept(self, _u, t):
        self.log.append(("accept", t))
        if t != self.seq[self.pos % len(self.seq)]:
            return 1
        self.pos += 1
        return 0

    def _rollback(self, _u, n):
        self.log.append(("rollback", n))
        self.pos -= n
        return 0 if self.pos >= 0 else 1


def _forced_run(m, cons, mode, n):
    from clover_gguf.options import GenerateOptions

    p, keep, mode, ends = m._params(GenerateOptions(max_tokens=n, mode=mode, block_size=BLOCK, threshold=0.5), [])
    p.constraint = cons.c
    return [t for _, new, _ in m._run(m.tokenize("Hello there"), p, keep, mode, set(ends), (), text=False)
            for t in new]


@pytest.mark.parametrize("mode", MODES)
def test_the_engine_follows_any_constraint_and_rolls_it_back(f32_model, mode):
    """A constraint that allows one token at a time (a fixed random sequence) is followed exactly
    in every mode; spec rolls it back after each draft. It is told every final token in order (and
    in spec and diffusion possibly a few past max_tokens, in the last verify or block, which the
    output then cuts)."""
    rng = np.random.default_rng(7)
    mask_id = f32_model.hparams.get("mask_token_id")
    seq = [int(t) for t in rng.integers(0, f32_model.n_vocab, 40) if t != mask_id][:30]
    cons = _Forced(seq)
    assert _forced_run(f32_model, cons, mode, len(seq)) == seq
    assert cons.pos >= len(seq)
    assert (mode == "spec") == any(kind == "rollback" for kind, _ in cons.log)


@pytest.mark.parametrize("mode", MODES)
def test_a_failing_or_empty_constraint_is_an_error_naming_it(f32_model, mode):
    for cons, msg in ((_Forced([5], fail=True), "computing the allowed tokens failed"),
                      (_Forced([5], empty=True), "no token is allowed next")):
        with pytest.raises(CloverError, match=f"constraint: {msg}"):
            _forced_run(f32_model, cons, mode, 8)
    ids, _ = _gen(f32_model, f32_model.tokenize("x"), mode=mode, max_tokens=4)  # the model stays usable
    assert ids
