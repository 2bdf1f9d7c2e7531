"""Sampling, penalties and soft biases (clover-spec 5.3-5.4), through ``clover_sample_logits``.

Reference: the formulas of spec 5.3-5.4 written here in numpy on hand-made logits rows:

- penalties (spec 5.4, llama.cpp order): repetition over prompt + generated (logit > 0 divided,
  <= 0 multiplied), then ``- count * frequency - presence`` for generated tokens;
- soft biases: ``logit_bias`` added, then ``min(bias_max, bias_slope * max(0, n - start))`` on
  ``</think>`` while a thinking section is open and on every end token;
- sampler (spec 5.3): temperature, top-k, top-p, min-p; greedy at T = 0 with the softmax
  probability as confidence; ``min(p_argmax, exp((z - z_max) / T))`` above; never the mask.

End-to-end on the tiny model: a greedy loop over ``prefix_logits`` with the numpy penalties
must equal the engine's ``ar`` output, penalties off must equal the plain greedy loop, and the
ramps must bring ``</think>`` / the end token earlier.
"""
import math

import numpy as np
import pytest

from clover_gguf._ffi import err_buf, ffi, lib

V = 12
OFF = dict(presence_penalty=0.0, repetition_penalty=1.0)  # the GGUF defaults are 0.9 / 1.05


def params(**kw):
    """clover_gen_params with everything off (no model: the struct's zeros, then these)."""
    p = ffi.new("clover_gen_params *")
    lib.clover_gen_params_default(ffi.NULL, p)
    p.presence_penalty, p.repetition_penalty = 0.0, 1.0
    p.think_open_id = p.think_close_id = -1
    keep = []
    for k, v in kw.items():
        if k == "end_ids":
            arr = ffi.new("int32_t[]", list(v) or [0])
            keep.append(arr)
            p.end_ids, p.n_end_ids = arr, len(v)
        elif k == "logit_bias":  # list of (id, value) pairs (repeats allowed)
            ids = ffi.new("int32_t[]", [i for i, _ in v] or [0])
            vals = ffi.new("float[]", [b for _, b in v] or [0.0])
            keep += [ids, vals]
            p.logit_bias_ids, p.logit_bias_values, p.n_logit_bias = ids, vals, len(v)
        else:
            setattr(p, k, v)
    return p, keep


def sample(logits, mask=-1, prompt=(), generated=(), **kw):
    """(token, confidence, processed logits) from clover_sample_logits."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    p, _keep = params(**kw)
    out = np.empty_like(logits)
    conf = ffi.new("float *")
    err = err_buf()
    pr = ffi.new("int32_t[]", list(prompt) or [0])
    ge = ffi.new("int32_t[]", list(generated) or [0])
    t = lib.clover_sample_logits(ffi.cast("float *", logits.ctypes.data), logits.size, mask, p, pr, len(prompt),
                                 ge, len(generated), ffi.cast("float *", out.ctypes.data), conf, err, len(err))
    if t < 0:
        raise ValueError(ffi.string(err).decode())
    return int(t), float(conf[0]), out


def ref_process(z, prompt=(), generated=(), mask=-1, presence_penalty=0.0, repetition_penalty=1.0,
                frequency_penalty=0.0, logit_bias=(), think_open_id=-1, think_close_id=-1, end_ids=(),
                think_close_bias_start=0, eos_bias_start=0, bias_slope=0.0, bias_max=0.0, **_):
    """Spec 5.4 in numpy (float32 like the engine)."""
    z = np.array(z, dtype=np.float32)
    f = np.float32
    count = np.bincount(np.array(generated, dtype=np.int64), minlength=z.size)
    seen = count > 0
    seen[list(prompt)] = True
    for i in np.flatnonzero(seen):
        if repetition_penalty != 1.0:
            z[i] = z[i] / f(repetition_penalty) if z[i] > 0 else z[i] * f(repetition_penalty)
        if count[i]:
            z[i] -= f(count[i]) * f(frequency_penalty) + f(presence_penalty)
    for i, b in logit_bias:
        z[i] += f(b)
    n = len(generated)

    def ramp(start):
        return f(min(bias_max, bias_slope * max(0, n - start)))

    state = 0
    for t in list(prompt) + list(generated):
        state = 1 if t == think_open_id else 0 if t == think_close_id else state
    if state and think_close_id >= 0:
        z[think_close_id] += ramp(think_close_bias_start)
    for e in dict.fromkeys(end_ids):
        z[e] += ramp(eos_bias_start)
    if mask >= 0:
        z[mask] = -np.inf
    return z


def ref_dist(z, temperature, top_k=0, top_p=1.0, min_p=0.0, mask=-1):
    """Spec 5.3 probabilities over the processed row z (T > 0)."""
    z = np.asarray(z, dtype=np.float64).copy()
    if mask >= 0:
        z[mask] = -np.inf
    order = sorted(np.flatnonzero(np.isfinite(z)), key=lambda i: (-z[i], i))
    if 0 < top_k < len(order):
        order = order[:top_k]
    w = np.exp((z[order] - z[order[0]]) / temperature)
    if top_p < 1.0:
        c = np.cumsum(w / w.sum())
        order, w = order[: int(np.argmax(c >= top_p)) + 1], w[: int(np.argmax(c >= top_p)) + 1]
    keep = w >= min_p
    order, w = [o for o, k in zip(order, keep) if k], w[keep]
    p = np.zeros(z.size)
    p[order] = w / w.sum()
    return p


ROW = np.array([2.0, -1.5, 0.5, 3.0, -0.25, 0.0, 1.0, -3.0, 2.5, 0.75, -0.5, 1.5], np.float32)


# ---------------------------------------------------------------- penalties and biases (5.4)
def test_defaults_off_leave_the_row_unchanged_and_the_mask_is_minus_inf():
    _, _, out = sample(ROW, mask=3, prompt=[0, 1], generated=[2, 2])
    want = ROW.copy()
    want[3] = -np.inf
    np.testing.assert_array_equal(out, want)


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_generated():
    prompt, gen = [0, 1, 5], [7, 8]  # 2.0, -1.5, 0.0 in the prompt; -3.0, 2.5 generated
    _, _, out = sample(ROW, prompt=prompt, generated=gen, repetition_penalty=1.25)
    want = ROW.copy()
    want[[0, 8]] = ROW[[0, 8]] / np.float32(1.25)
    want[[1, 7]] = ROW[[1, 7]] * np.float32(1.25)  # negative logits become more negative
    np.testing.assert_array_equal(out, want)  # 0.0 stays 0.0; unseen tokens untouched
    np.testing.assert_array_equal(out, ref_process(ROW, prompt, gen, repetition_penalty=1.25))


def test_penalty_scope_response_leaves_the_prompt_out_of_the_repetition_penalty():
    """Spec 5.4: with penalty_scope "response" (Clover's record) the repetition penalty's history
    is the generated tokens only; "all" (llama.cpp's) counts the prompt too."""
    prompt, gen = [0, 1, 5], [7, 8]
    _, _, out = sample(ROW, prompt=prompt, generated=gen, repetition_penalty=1.25,
                       penalty_scope=lib.CLOVER_PENALTY_RESPONSE)
    np.testing.assert_array_equal(out, ref_process(ROW, (), gen, repetition_penalty=1.25))
    assert out[0] == ROW[0] and out[8] == ROW[8] / np.float32(1.25)
    _, _, every = sample(ROW, prompt=prompt, generated=gen, repetition_penalty=1.25,
                         penalty_scope=lib.CLOVER_PENALTY_ALL)
    assert every[0] == ROW[0] / np.float32(1.25)
    with pytest.raises(ValueError, match="penalty_scope: 2"):
        sample(ROW, penalty_scope=2)


def test_presence_counts_generated_tokens_once_and_not_the_prompt():
    _, _, out = sample(ROW, prompt=[0, 4], generated=[2, 2, 2, 4, 9], presence_penalty=0.9)
    want = ROW.copy()
    want[[2, 4, 9]] -= np.float32(0.9)  # once each, however often; token 0 is prompt only
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)
    _, _, neg = sample(ROW, generated=[3], presence_penalty=-0.5)  # negative: encourages
    assert neg[3] == pytest.approx(3.5)


def test_frequency_penalty_counts_occurrences():
    _, _, out = sample(ROW, prompt=[6], generated=[1, 1, 1, 10], frequency_penalty=0.5)
    want = ROW.copy()
    want[1] -= 1.5
    want[10] -= 0.5
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6)


def test_penalty_order_repetition_then_frequency_and_presence():
    # llama.cpp: z / r (or z * r) first, then - count * f - presence
    _, _, out = sample(ROW, generated=[3, 7, 7], repetition_penalty=2.0, presence_penalty=1.0,
                       frequency_penalty=0.25)
    assert out[3] == pytest.approx(3.0 / 2 - 0.25 - 1.0)
    assert out[7] == pytest.approx(-3.0 * 2 - 0.5 - 1.0)
    kw = dict(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.25)
    np.testing.assert_allclose(out, ref_process(ROW, (), [3, 7, 7], **kw), rtol=0, atol=1e-6)


def test_logit_bias_adds_after_penalties_and_repeats_sum():
    _, _, out = sample(ROW, prompt=[3], repetition_penalty=2.0,
                       logit_bias=[(3, 1.0), (5, -100.0), (5, 2.0), (11, 0.5)])
    assert out[3] == pytest.approx(3.0 / 2 + 1.0)  # (3 / 2) + 1, not (3 + 1) / 2
    assert out[5] == pytest.approx(-98.0)
    assert out[11] == pytest.approx(2.0)
    tok, _, _ = sample(ROW, logit_bias=[(7, 50.0)])
    assert tok == 7  # a bias can make any token the greedy choice


THINK_OPEN, THINK_CLOSE, END_A, END_B = 9, 10, 11, 4
RAMP = dict(think_open_id=THINK_OPEN, think_close_id=THINK_CLOSE, end_ids=[END_A, END_B, END_A],
            think_close_bias_start=3, eos_bias_start=5, bias_slope=0.5, bias_max=2.0)


@pytest.mark.parametrize("n_gen", [0, 3, 4, 5, 6, 7, 8, 12, 40])
def test_ramps_start_positions_slope_and_cap(n_gen):
    gen = [0] * n_gen  # the row predicts generated index n = n_gen
    _, _, out = sample(ROW, prompt=[2, THINK_OPEN, 1], generated=gen, **RAMP)
    think = min(2.0, 0.5 * max(0, n_gen - 3))
    eos = min(2.0, 0.5 * max(0, n_gen - 5))
    assert out[THINK_CLOSE] == pytest.approx(ROW[THINK_CLOSE] + think)
    assert out[END_A] == pytest.approx(ROW[END_A] + eos)  # listed twice, ramped once
    assert out[END_B] == pytest.approx(ROW[END_B] + eos)
    np.testing.assert_allclose(out, ref_process(ROW, [2, THINK_OPEN, 1], gen, **RAMP), rtol=0, atol=1e-6)
    if n_gen <= 3:
        assert out[THINK_CLOSE] == ROW[THINK_CLOSE]  # the ramp is 0 at its start index


def test_think_ramp_only_while_a_thinking_section_is_open():
    gen = [0] * 10
    closed_in_prompt = sample(ROW, prompt=[THINK_OPEN, 1, THINK_CLOSE], generated=gen, **RAMP)[2]
    never_opened = sample(ROW, prompt=[1], generated=gen, **RAMP)[2]
    closed_in_gen = sample(ROW, prompt=[THINK_OPEN], generated=gen[:-1] + [THINK_CLOSE], **RAMP)[2]
    opened_in_gen = sample(ROW, prompt=[1], generated=[THINK_OPEN] + gen[1:], **RAMP)[2]
    assert closed_in_prompt[THINK_CLOSE] == never_opened[THINK_CLOSE] == ROW[THINK_CLOSE]
    # closed by a generated </think>: no think ramp (its presence penalty is off here)
    assert closed_in_gen[THINK_CLOSE] == ROW[THINK_CLOSE]
    assert opened_in_gen[THINK_CLOSE] == pytest.approx(ROW[THINK_CLOSE] + 2.0)
    off = dict(RAMP, bias_slope=0.0)
    assert sample(ROW, prompt=[THINK_OPEN], generated=gen, **off)[2][THINK_CLOSE] == ROW[THINK_CLOSE]


def test_negative_logits_all_rules_match_the_reference():
    rng = np.random.default_rng(3)
    z = (rng.standard_normal(V) * 3 - 2).astype(np.float32)  # mostly negative
    z[0] = -0.0
    prompt, gen = [0, 1, 2, THINK_OPEN, 5], [2, 3, 3, 6, 1, 1, 1, 8]
    kw = dict(RAMP, presence_penalty=0.7, repetition_penalty=1.3, frequency_penalty=0.2,
              logit_bias=[(4, -1.0), (6, 0.25)])
    _, _, out = sample(z, mask=7, prompt=prompt, generated=gen, **kw)
    np.testing.assert_allclose(out, ref_process(z, prompt, gen, mask=7, **kw), rtol=0, atol=1e-6)


# ---------------------------------------------------------------- sampler (5.3)
def test_temperature_zero_is_argmax_with_softmax_confidence():
    rng = np.random.default_rng(0)
    for _ in range(20):
        z = (rng.standard_normal(V) * 2).astype(np.float32)
        t, c, _ = sample(z, generated=[int(np.argmax(z))], presence_penalty=0.4, temperature=0.0, top_k=3,
                         min_p=0.5)
        zp = ref_process(z, (), [int(np.argmax(z))], presence_penalty=0.4)
        assert t == int(np.argmax(zp))  # the argmax of the penalised row
        p = np.exp(zp.astype(np.float64) - zp.max())
        assert c == pytest.approx(1.0 / p.sum(), rel=1e-5)


def test_top_k_1_equals_greedy_at_any_temperature():
    for seed in range(50):
        t, c, _ = sample(ROW, temperature=2.0, top_k=1, seed=seed)
        assert t == 3 and c == pytest.approx(1.0)


@pytest.mark.parametrize("top_k", [1, 5, 17, 64])
def test_top_k_keeps_the_k_best_by_rank_with_ties_and_the_mask(top_k):
    """The top-k set is the first k of (z descending, id ascending) without the mask token: rows
    of many tied values (ints in [0, 6)), drawn at a high temperature so every kept id shows."""
    rng = np.random.default_rng(top_k)
    z = rng.integers(0, 6, 500).astype(np.float32)
    mask = int(np.argmax(z))  # a top value, which must not count
    order = sorted((i for i in range(z.size) if i != mask), key=lambda i: (-z[i], i))
    drawn = {sample(z, mask=mask, seed=s, temperature=1e4, top_k=top_k)[0] for s in range(40 * top_k)}
    assert drawn == set(order[:top_k])


@pytest.mark.parametrize("span", [40, 1000, 6000])
def test_top_p_alone_cuts_where_the_reference_does_on_a_large_row(span):
    """top_p without top_k on 20000 ids: the sampler takes the best 256, 4096 or all candidates,
    whichever holds the top-p prefix, so prefixes of about 40, 1000 and 6000 ids exercise each
    size. The draws stay inside ref_dist's support and reach its far end (the cut is not early)."""
    V = 20000
    rng = np.random.default_rng(span)
    z = np.full(V, -20.0, np.float32)  # a tail of negligible mass
    z[:span] = 2.0 + np.linspace(0.0, 0.05, span)[::-1]  # a near-flat head of span ids
    perm = rng.permutation(V)
    zp = np.empty_like(z)
    zp[perm] = z
    T, top_p = 1.0, 0.9
    support = np.flatnonzero(ref_dist(zp, T, top_p=top_p) > 0)
    assert 0.8 * span < support.size <= span
    rank = {int(i): r for r, i in enumerate(sorted(support, key=lambda i: (-zp[i], i)))}
    drawn = [sample(zp, seed=s, temperature=T, top_p=top_p)[0] for s in range(800)]
    assert set(drawn) <= set(rank), "drawn outside the top-p prefix"
    assert max(rank[t] for t in drawn) >= 0.9 * support.size - 1


def test_fixed_seed_is_reproducible_and_the_seed_matters():
    kw = dict(temperature=1.5, top_k=8, top_p=0.9, min_p=0.05, presence_penalty=0.5, generated=[3, 8])
    a = [sample(ROW, seed=s, **kw)[:2] for s in range(30)]
    b = [sample(ROW, seed=s, **kw)[:2] for s in range(30)]
    assert a == b
    assert len({t for t, _ in a}) > 1


def test_mask_token_is_never_sampled():
    z = ROW.copy()
    z[5] = 20.0  # the mask has by far the largest logit
    assert sample(z, mask=5)[0] != 5
    for seed in range(300):
        for kw in (dict(temperature=1.0), dict(temperature=5.0, top_k=3), dict(temperature=3.0, min_p=0.01),
                   dict(temperature=3.0, logit_bias=[(5, 10.0)], top_p=0.99)):
            assert sample(z, mask=5, seed=seed, **kw)[0] != 5


def test_confidence_rule_above_zero_temperature():
    T = 0.8
    kw = dict(temperature=T, top_k=6, top_p=0.95, min_p=0.02)
    p = ref_dist(ROW, T, 6, 0.95, 0.02)
    for seed in range(200):
        t, c, out = sample(ROW, seed=seed, **kw)
        assert p[t] > 0
        z = out.astype(np.float64)
        assert c == pytest.approx(min(p.max(), math.exp((z[t] - z.max()) / T)), rel=1e-5)


def test_min_p_keeps_tokens_within_a_factor_of_the_most_likely():
    T = 1.0
    w = np.exp(ROW.astype(np.float64) - ROW.max())
    for min_p in (0.1, 0.3, 0.6):
        drawn = {sample(ROW, seed=s, temperature=T, min_p=min_p)[0] for s in range(400)}
        assert drawn == set(np.flatnonzero(w >= min_p))
    assert {sample(ROW, seed=s, temperature=T, min_p=1.0)[0] for s in range(50)} == {3}


@pytest.mark.parametrize("kw", [
    dict(temperature=0.7, top_k=9, top_p=0.9, min_p=0.05),  # sorted path, all filters bind
    dict(temperature=1.6, min_p=0.08),                       # min-p without sorting
    dict(temperature=1.2),                                   # plain softmax
])
def test_one_step_distribution_matches_the_processed_softmax(kw):
    """Chi-square over 10k seeds: the draw follows ref_dist(ref_process(row)) (spec 5.3-5.4)."""
    from scipy import stats

    hist = dict(prompt=[0, 2], generated=[8, 8, 6], mask=11)
    pen = dict(presence_penalty=0.3, repetition_penalty=1.2, frequency_penalty=0.1, logit_bias=[(1, 1.0)])
    n = 10000
    draws = np.array([sample(ROW, seed=s, **hist, **pen, **kw)[0] for s in range(n)])
    z = ref_process(ROW, hist["prompt"], hist["generated"], mask=11, **pen)
    p = ref_dist(z, kw["temperature"], kw.get("top_k", 0), kw.get("top_p", 1.0), kw.get("min_p", 0.0), mask=11)
    counts = np.bincount(draws, minlength=V)
    assert counts[p == 0].sum() == 0, f"drawn outside the support: {counts} vs {p}"
    support = p > 0
    chi2, pval = stats.chisquare(counts[support], n * p[support])
    assert pval > 1e-3, f"chi2 {chi2:.1f} p {pval:.2g}: counts {counts[support]} expected {n * p[support]}"


@pytest.mark.parametrize("field, value, msg", [
    ("min_p", float("nan"), "min_p"),
    ("min_p", 1.5, "min_p"),
    ("presence_penalty", float("nan"), "presence_penalty"),
    ("presence_penalty", float("inf"), "presence_penalty"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", -1.0, "repetition_penalty"),
    ("frequency_penalty", float("nan"), "frequency_penalty"),
    ("logit_bias", [(V, 1.0)], r"logit_bias_ids\[0\]"),
    ("logit_bias", [(0, 1.0), (-1, 1.0)], r"logit_bias_ids\[1\]"),
    ("logit_bias", [(2, float("nan"))], r"logit_bias_values\[0\]"),
    ("think_open_id", V, "think_open_id"),
    ("think_close_id", -2, "think_close_id"),
    ("think_close_bias_start", -1, "think_close_bias_start"),
    ("eos_bias_start", -5, "eos_bias_start"),
    ("bias_slope", -0.1, "bias_slope"),
    ("bias_max", float("nan"), "bias_max"),
    ("temperature", -1.0, "temperature"),
])
def test_bad_fields_are_errors_naming_the_field(field, value, msg):
    with pytest.raises(ValueError, match=msg):
        sample(ROW, **{field: value})


def test_bad_rows_and_histories_are_errors():
    with pytest.raises(ValueError, match="generated"):
        sample(ROW, generated=[V])
    with pytest.raises(ValueError, match="prompt"):
        sample(ROW, prompt=[-1])
    with pytest.raises(ValueError, match="mask_token_id"):
        sample(ROW, mask=V)
    with pytest.raises(ValueError, match="no candidate"):
        sample(np.zeros(1, np.float32), mask=0)


# ---------------------------------------------------------------- end to end (tiny model)
@pytest.fixture(scope="module")
def model(make_gguf):
    from clover_gguf import Model

    with Model(make_gguf("f32"), n_ctx=512, n_threads=2) as m:
        yield m


PROMPT = "def fib(n):\n    if n < 2:\n        return n\n"
NO_PEN = dict(presence_penalty=0.0, repeat_penalty=1.0)


def _greedy_ar(model, prompt, n, **kw):
    """Greedy ar over prefix_logits with the numpy processing of spec 5.4 (kw: ref_process's)."""
    mask = model.hparams["mask_token_id"]
    gen = []
    for _ in range(n):
        row = model.prefix_logits(list(prompt) + gen)[-1]
        t = int(np.argmax(ref_process(row, prompt, gen, mask=mask, **kw)))
        gen.append(t)
        if t in model.end_ids:
            break
    return gen


def test_penalties_off_reproduce_plain_greedy_and_defaults_match_the_numpy_loop(model):
    hp = model.hparams
    assert hp["presence_penalty"] == pytest.approx(0.9) and hp["repetition_penalty"] == pytest.approx(1.05)
    prompt = model.tokenize(PROMPT)
    plain, _ = model.generate_tokens(prompt, max_tokens=24, mode="ar", **NO_PEN)
    assert plain == _greedy_ar(model, prompt, 24)
    dflt, _ = model.generate_tokens(prompt, max_tokens=24, mode="ar")  # GGUF 0.9 / 1.05
    assert dflt == _greedy_ar(model, prompt, 24, presence_penalty=0.9, repetition_penalty=1.05,
                              end_ids=model.end_ids)
    strong = dict(presence_penalty=1.5, repeat_penalty=1.3, frequency_penalty=0.4)
    pen, _ = model.generate_tokens(prompt, max_tokens=24, mode="ar", **strong)
    assert pen == _greedy_ar(model, prompt, 24, presence_penalty=1.5, repetition_penalty=1.3,
                             frequency_penalty=0.4, end_ids=model.end_ids)


def test_penalties_change_a_repetitive_output(model):
    """The random tiny model never repeats on its own: a logit_bias makes plain greedy repeat one
    token, and the presence penalty breaks the loop; a negative presence penalty makes a loop."""
    prompt = model.tokenize(PROMPT)
    plain, _ = model.generate_tokens(prompt, max_tokens=16, mode="ar", **NO_PEN)
    x = plain[3]
    loop, _ = model.generate_tokens(prompt, max_tokens=16, mode="ar", logit_bias={x: 40.0}, **NO_PEN)
    assert loop == [x] * 16
    broken, _ = model.generate_tokens(prompt, max_tokens=16, mode="ar", logit_bias={x: 40.0},
                                      presence_penalty=60.0, repeat_penalty=1.0)
    assert broken[0] == x and broken.count(x) == 1
    assert broken == _greedy_ar(model, prompt, 16, presence_penalty=60.0, logit_bias=[(x, 40.0)],
                                end_ids=model.end_ids)
    stuck, _ = model.generate_tokens(prompt, max_tokens=16, mode="ar", presence_penalty=-40.0, repeat_penalty=1.0)
    assert stuck == [plain[0]] * 16 and stuck != plain


def test_diffusion_penalties_change_the_output_and_off_is_deterministic(model):
    kw = dict(max_tokens=32, block_size=8, threshold=0.3)
    a = model.generate_tokens(model.tokenize(PROMPT), **kw, **NO_PEN)[0]
    b = model.generate_tokens(model.tokenize(PROMPT), **kw, **NO_PEN)[0]
    c = model.generate_tokens(model.tokenize(PROMPT), **kw, presence_penalty=-40.0, repeat_penalty=1.0)[0]
    assert a == b and a != c
    assert len(set(c)) < len(set(a))  # counted from the filled slots of each block on (spec 5.4)


def test_json_like_repeats_are_reweighted_never_stopped(model):
    """A JSON-ish answer with many repeated "0.0" values: penalties reweight logits, they never
    stop or truncate generation (spec 5.4); only the budget ends this run."""
    body = model.tokenize("0.0, ")
    bias = {t: 40.0 for t in body}  # the model is pushed to write "0.0, 0.0, ..."
    prompt = model.tokenize('{"values": [')
    for mode in ("ar", "diffusion"):
        ids, st = model.generate_tokens(prompt, max_tokens=48, mode=mode, block_size=8, logit_bias=bias,
                                        presence_penalty=0.9, repeat_penalty=1.05, frequency_penalty=0.5)
        assert st["finish_reason"] == "length" and len(ids) == 48, (mode, st["finish_reason"], len(ids))
        assert set(ids) <= set(body)
        text = model.detokenize(ids)
        assert set(text) <= set("0., ") and len(text) >= 48 and "0" in text


def test_repeated_values_keep_their_token_under_the_default_penalties():
    """Unit form of the JSON case: after "0.0, " x 40 generated, a token the model prefers by a
    few logits still wins under the GGUF defaults (presence 0.9 once, repetition 1.05), and the
    end token is not pushed up by any repetition rule (only its ramp, from eos_bias_start)."""
    zero, dot, comma, space, end = 0, 1, 2, 3, 4
    gen = [zero, dot, zero, comma, space] * 40
    z = np.array([5.0, 1.0, 1.0, 1.0, 2.0, -1, -2, 0.5, 0.2, -0.3, 0.1, 0.0], np.float32)
    kw = dict(presence_penalty=0.9, repetition_penalty=1.05, end_ids=[end], eos_bias_start=8192,
              bias_slope=0.01, bias_max=10.0)
    t, _, out = sample(z, generated=gen, **kw)
    assert t == zero
    assert out[end] == z[end]
    assert out[zero] == pytest.approx(5.0 / 1.05 - 0.9, rel=1e-6)


def _first(ids, t):
    return ids.index(t) if t in ids else math.inf


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_think_close_ramp_brings_think_close_earlier(model, mode):
    close = model.tokenizer.token_to_id("</think>")
    opened = model.tokenizer.token_to_id("<think>")
    assert close is not None and opened is not None
    prompt = model.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert opened in prompt
    kw = dict(max_tokens=40, mode=mode, block_size=8, threshold=0.5, end_ids=[])
    base, _ = model.generate_tokens(prompt, **kw)
    ramp, _ = model.generate_tokens(prompt, think_close_bias_start=4, bias_slope=2.0, bias_max=60.0, **kw)
    assert _first(ramp, close) < _first(base, close)
    assert _first(ramp, close) > 4  # the ramp is 0 up to its start index
    # no open thinking section: the same ramp does nothing
    plain = model.tokenize("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    a, _ = model.generate_tokens(plain, **kw)
    b, _ = model.generate_tokens(plain, think_close_bias_start=4, bias_slope=2.0, bias_max=60.0, **kw)
    assert a == b


def test_eos_ramp_ends_generation_after_its_start(model):
    prompt = model.tokenize(PROMPT)
    base, st0 = model.generate_tokens(prompt, max_tokens=40, mode="ar")
    ids, st = model.generate_tokens(prompt, max_tokens=40, mode="ar", eos_bias_start=6, bias_slope=5.0,
                                    bias_max=80.0)
    assert st["finish_reason"] == "stop" and ids[-1] in model.end_ids
    assert 6 < len(ids) < len(base) or st0["finish_reason"] == "stop"
    assert ids[:6] == base[:6]  # nothing changes before the start index
