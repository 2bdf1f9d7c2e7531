/* sampler.c: one candidate token and its confidence per logits row (clover-spec 5.3-5.4).
 *
 * Processing order (spec 5.3): penalties, soft biases (clover_process_logits, on a copy of the
 * row), then temperature, top-k, top-p, min-p (clover_sample). At temperature 0 the candidate
 * is the argmax and its confidence its softmax probability. Above 0 the candidate is drawn from
 * the processed distribution and its confidence is min(p_argmax, exp((z_drawn - z_max) / T)),
 * so an unlikely draw waits. The mask token is never a candidate. A seeded RNG makes every run
 * reproducible.
 */
#include "core/errors.h"
#include "decode/sampler.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* splitmix64 seeding of xoroshiro128+ (Blackman and Vigna). */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

void clover_rng_seed(clover_rng *r, uint64_t seed) {
    r->s[0] = splitmix64(&seed);
    r->s[1] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

float clover_rng_uniform(clover_rng *r) {
    uint64_t s0 = r->s[0], s1 = r->s[1], out = s0 + s1;
    s1 ^= s0;
    r->s[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
    r->s[1] = rotl(s1, 37);
    return (float)(out >> 40) * (1.0f / 16777216.0f); /* 24 random bits */
}

/* ---------------------------------------------------------------- parameters */

void clover_sampler_params_init(clover_sampler_params *sp, const clover_gen_params *p, int32_t mask_token_id) {
    memset(sp, 0, sizeof *sp);
    sp->temperature = p->temperature;
    sp->top_k = p->top_k;
    sp->top_p = p->top_p;
    sp->mask_token_id = mask_token_id;
    sp->min_p = p->min_p;
    sp->presence_penalty = p->presence_penalty;
    sp->repetition_penalty = p->repetition_penalty;
    sp->frequency_penalty = p->frequency_penalty;
    sp->bias_ids = p->logit_bias_ids;
    sp->bias_values = p->logit_bias_values;
    sp->n_bias = p->n_logit_bias;
    sp->think_close_id = p->think_close_id;
    sp->end_ids = p->end_ids;
    sp->n_end_ids = p->n_end_ids;
    sp->think_close_bias_start = p->think_close_bias_start;
    sp->eos_bias_start = p->eos_bias_start;
    sp->bias_slope = p->bias_slope;
    sp->bias_max = p->bias_max;
}

#define BAD(...) return clover_set_err(err, n, CLOVER_E_ARG, __VA_ARGS__)

int clover_check_sampling(const clover_gen_params *p, int32_t n_vocab, char *err, size_t n) {
    if (!(p->temperature >= 0.0f) || isinf(p->temperature))
        BAD("temperature: %g must be finite and >= 0", p->temperature);
    if (p->top_k < 0) BAD("top_k: %d must be >= 0", p->top_k);
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f)) BAD("top_p: %g outside (0, 1]", p->top_p);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f)) BAD("min_p: %g outside [0, 1]", p->min_p);
    if (!isfinite(p->presence_penalty)) BAD("presence_penalty: %g must be finite", p->presence_penalty);
    if (!(p->repetition_penalty > 0.0f) || isinf(p->repetition_penalty))
        BAD("repeat_penalty: %g must be finite and > 0 (1 = off; repetition_penalty)", p->repetition_penalty);
    if (!isfinite(p->frequency_penalty)) BAD("frequency_penalty: %g must be finite", p->frequency_penalty);
    if (p->n_logit_bias < 0) BAD("n_logit_bias: %d must be >= 0", p->n_logit_bias);
    if (p->n_logit_bias > 0 && (!p->logit_bias_ids || !p->logit_bias_values))
        BAD("logit_bias: %d entries but no ids or values array", p->n_logit_bias);
    for (int32_t i = 0; i < p->n_logit_bias; i++) {
        if (p->logit_bias_ids[i] < 0 || p->logit_bias_ids[i] >= n_vocab)
            BAD("logit_bias: token id %d out of range [0, %d) (logit_bias_ids[%d])", p->logit_bias_ids[i], n_vocab, i);
        if (!isfinite(p->logit_bias_values[i]))
            BAD("logit_bias[%d] (logit_bias_values[%d]): %g must be finite", p->logit_bias_ids[i], i,
                p->logit_bias_values[i]);
    }
    if (p->think_open_id < -1 || p->think_open_id >= n_vocab)
        BAD("think_open_id: %d outside [-1, %d)", p->think_open_id, n_vocab);
    if (p->think_close_id < -1 || p->think_close_id >= n_vocab)
        BAD("think_close_id: %d outside [-1, %d)", p->think_close_id, n_vocab);
    if (p->think_close_bias_start < 0) BAD("think_close_bias_start: %d must be >= 0", p->think_close_bias_start);
    if (p->eos_bias_start < 0) BAD("eos_bias_start: %d must be >= 0", p->eos_bias_start);
    if (!(p->bias_slope >= 0.0f) || isinf(p->bias_slope)) BAD("bias_slope: %g must be finite and >= 0", p->bias_slope);
    if (!(p->bias_max >= 0.0f) || isinf(p->bias_max)) BAD("bias_max: %g must be finite and >= 0", p->bias_max);
    if (p->penalty_scope != CLOVER_PENALTY_RESPONSE && p->penalty_scope != CLOVER_PENALTY_ALL)
        BAD("penalty_scope: %d is not response (0) or all (1)", p->penalty_scope);
    return CLOVER_OK;
}

/* ---------------------------------------------------------------- token history (spec 5.4) */

int clover_history_init(clover_history *h, int32_t n_vocab, int32_t think_open_id, int32_t think_close_id) {
    memset(h, 0, sizeof *h);
    h->n_vocab = n_vocab;
    h->think_open_id = think_open_id;
    h->think_close_id = think_close_id;
    h->count = calloc((size_t)n_vocab, sizeof(int32_t));
    h->in_prompt = calloc((size_t)n_vocab, 1);
    h->seen = malloc(sizeof(int32_t) * (size_t)n_vocab);
    if (!h->count || !h->in_prompt || !h->seen) {
        clover_history_free(h);
        return CLOVER_E_NOMEM;
    }
    return CLOVER_OK;
}

void clover_history_free(clover_history *h) {
    free(h->count), free(h->in_prompt), free(h->seen);
    h->count = NULL, h->in_prompt = NULL, h->seen = NULL;
}

int clover_think_state(const clover_history *h, int open, int32_t t) {
    if (t >= 0 && t == h->think_close_id) return 0;
    if (t >= 0 && t == h->think_open_id) return 1;
    return open;
}

void clover_history_prompt(clover_history *h, const int32_t *tokens, int32_t n, int32_t scope) {
    for (int32_t i = 0; i < n; i++) {
        const int32_t t = tokens[i];
        if (t < 0 || t >= h->n_vocab) continue;
        if (scope == CLOVER_PENALTY_ALL) {
            if (!h->in_prompt[t] && !h->count[t]) h->seen[h->n_seen++] = t;
            h->in_prompt[t] = 1;
        }
        h->think_open = clover_think_state(h, h->think_open, t);
    }
}

void clover_history_push(clover_history *h, int32_t t) {
    if (t < 0 || t >= h->n_vocab) return;
    if (!h->in_prompt[t] && !h->count[t]) h->seen[h->n_seen++] = t;
    h->count[t]++;
}

void clover_history_pop(clover_history *h, int32_t t) {
    if (t < 0 || t >= h->n_vocab || h->count[t] <= 0) return;
    if (--h->count[t] == 0 && !h->in_prompt[t]) h->n_seen--; /* LIFO: t was the last one seen */
}

void clover_history_add(clover_history *h, int32_t t) {
    clover_history_push(h, t);
    h->think_open = clover_think_state(h, h->think_open, t);
}

/* ---------------------------------------------------------------- penalties and biases */

/* Soft bias ramp of spec 5.4 at generated index n: min(b_max, alpha * max(0, n - start)). */
static float ramp(const clover_sampler_params *sp, int64_t n, int32_t start) {
    const double x = (double)sp->bias_slope * (double)(n > start ? n - start : 0);
    return (float)(x < sp->bias_max ? x : sp->bias_max);
}

int32_t clover_logit_ops_max(const clover_sampler_params *sp, const clover_history *h) {
    return (h ? h->n_seen : 0) + sp->n_bias + 1 + sp->n_end_ids + 1;
}

int32_t clover_logit_ops(const clover_sampler_params *sp, const clover_history *h, int64_t n, int think_open,
                         clover_logit_op *ops) {
    int32_t n_ops = 0;
    /* penalties (spec 5.4), in llama.cpp's order: repetition (CTRL: over prompt + generated,
     * positive logits divided, others multiplied), then frequency and presence over the generated
     * tokens (committed plus filled in the current block); frequency is OpenAI's, the spec is
     * silent on it, and counts the same history as presence. */
    const float rep = sp->repetition_penalty, pres = sp->presence_penalty, freq = sp->frequency_penalty;
    if (h && (rep != 1.0f || pres != 0.0f || freq != 0.0f))
        for (int32_t k = 0; k < h->n_seen; k++)
            ops[n_ops++] = (clover_logit_op){CLOVER_OP_PENALTY, h->seen[k], h->count[h->seen[k]], 0.0f};
    /* soft biases: the caller's logit_bias (repeated ids add up), then the ramps of spec 5.4 */
    for (int32_t k = 0; k < sp->n_bias; k++)
        ops[n_ops++] = (clover_logit_op){CLOVER_OP_ADD, sp->bias_ids[k], 0, sp->bias_values[k]};
    if (sp->bias_slope > 0.0f && sp->bias_max > 0.0f) {
        if (think_open && sp->think_close_id >= 0)
            ops[n_ops++] = (clover_logit_op){CLOVER_OP_ADD, sp->think_close_id, 0, ramp(sp, n, sp->think_close_bias_start)};
        const float b = ramp(sp, n, sp->eos_bias_start);
        for (int32_t k = 0; k < sp->n_end_ids && b > 0.0f; k++) {
            int dup = 0; /* an id listed twice gets the ramp once */
            for (int32_t q = 0; q < k && !dup; q++) dup = sp->end_ids[q] == sp->end_ids[k];
            if (!dup) ops[n_ops++] = (clover_logit_op){CLOVER_OP_ADD, sp->end_ids[k], 0, b};
        }
    }
    if (sp->mask_token_id >= 0) ops[n_ops++] = (clover_logit_op){CLOVER_OP_MASK, sp->mask_token_id, 0, 0.0f};
    return n_ops;
}

void clover_apply_logit_ops(float *z, int32_t n_vocab, const clover_logit_op *ops, int32_t n_ops,
                            const clover_sampler_params *sp) {
    for (int32_t k = 0; k < n_ops; k++)
        clover_logit_op_apply(z, n_vocab, ops[k], sp->repetition_penalty, sp->frequency_penalty, sp->presence_penalty);
}

void clover_process_logits(const float *logits, float *out, int32_t n_vocab, const clover_sampler_params *sp,
                           const clover_history *h, int64_t n, int think_open, clover_logit_op *ops) {
    memcpy(out, logits, sizeof(float) * (size_t)n_vocab);
    clover_apply_logit_ops(out, n_vocab, ops, clover_logit_ops(sp, h, n, think_open, ops), sp);
}

/* ---------------------------------------------------------------- sampling (spec 5.3) */

/* Candidate a ranks before b: larger z, then smaller id (a total order on distinct ids). */
static int cand_before(clover_cand a, clover_cand b) { return a.z > b.z || (a.z == b.z && a.id < b.id); }

static int by_rank(const void *a, const void *b) {
    const clover_cand *x = a, *y = b;
    return cand_before(*x, *y) ? -1 : cand_before(*y, *x);
}

/* The k best candidates of logits[n_vocab] other than mask (1 <= k <= their count) into h,
 * sorted: a heap rooted at the worst one kept, O(n_vocab log k), then a sort of the k; all of
 * them (k = their count) by one sort. */
static void top_k_cands(const float *logits, int32_t n_vocab, int32_t mask, int32_t k, clover_cand *h) {
    const int all = k == clover_cand_ids(n_vocab, mask);
    int32_t n = 0;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (i == mask) continue;
        const clover_cand c = {logits[i], i};
        if (all) {
            h[n++] = c;
            continue;
        }
        int32_t j;
        if (n < k) { /* sift up past the parents that rank before c */
            for (j = n++; j > 0 && cand_before(h[(j - 1) / 2], c); j = (j - 1) / 2) h[j] = h[(j - 1) / 2];
        } else if (cand_before(c, h[0])) { /* c replaces the root and sinks below the children it ranks before */
            for (j = 0; 2 * j + 1 < k;) {
                const int32_t l = 2 * j + 1, w = l + 1 < k && cand_before(h[l], h[l + 1]) ? l + 1 : l;
                if (!cand_before(c, h[w])) break;
                h[j] = h[w];
                j = w;
            }
        } else {
            continue;
        }
        h[j] = c;
    }
    qsort(h, (size_t)k, sizeof *h, by_rank);
}

/* Index j of weights w[0..n) drawn with probability w[j] / sum (u uniform in [0, 1)); -1 if
 * rounding leaves none. *sum receives the total. */
static int32_t draw(const float *w, int32_t n, clover_rng *rng, double *sum) {
    double s = 0, cum = 0;
    for (int32_t j = 0; j < n; j++) s += w[j];
    const double u = (double)clover_rng_uniform(rng) * s;
    *sum = s;
    for (int32_t j = 0; j < n; j++) {
        cum += w[j];
        if (u < cum && w[j] > 0) return j;
    }
    return -1;
}

/* Tempered weight of logit z relative to the argmax's zmax (weight 1), spec 5.3. */
static float weight(float z, float zmax, float T) { return (float)exp((double)(z - zmax) / T); }

/* Confidence of a drawn logit z (spec 5.3): min(p_argmax, exp((z - z_max) / T)), p_argmax = 1 /
 * sum, the argmax having weight 1. */
static float drawn_confidence(float z, float zmax, float T, double sum) {
    const float p_argmax = (float)(1.0 / sum), ratio = expf((z - zmax) / T);
    return ratio < p_argmax ? ratio : p_argmax;
}

/* Whether the top-p prefix (mass over total reaching top_p) ends within cand[0..n). */
static int top_p_within(const clover_cand *cand, int32_t n, float T, double total, float top_p) {
    double cum = 0;
    for (int32_t j = 0; j < n; j++)
        if ((cum += weight(cand[j].z, cand[0].z, T) / total) >= top_p) return 1;
    return 0;
}

void clover_cands_sort(clover_cand *cand, int32_t n) { qsort(cand, (size_t)n, sizeof *cand, by_rank); }

int32_t clover_sample_top(const clover_cand *cand, int32_t n, const clover_sampler_params *sp, clover_rng *rng,
                          float *confidence, float *scratch, double total) {
    const float T = sp->temperature, zmax = cand[0].z;
    /* top-k */
    if (sp->top_k > 0 && sp->top_k < n) n = sp->top_k;
    /* tempered weights relative to the argmax (cand[0], weight 1); top-p renormalises over the
     * top-k, or over the whole row (total) when top-k keeps it all */
    double sum = 0;
    for (int32_t j = 0; j < n; j++) sum += (scratch[j] = weight(cand[j].z, zmax, T));
    if (total > 0) sum = total;
    /* top-p: the shortest prefix whose mass (renormalised over the top-k) reaches top_p */
    if (sp->top_p < 1.0f) {
        double cum = 0;
        for (int32_t j = 0; j < n; j++) {
            cum += scratch[j] / sum;
            if (cum >= sp->top_p) {
                n = j + 1;
                break;
            }
        }
    }
    /* min-p: keep p_j >= min_p * p_max; p_j / p_max is the weight, so the kept set is a prefix */
    if (sp->min_p > 0.0f)
        for (int32_t j = 1; j < n; j++)
            if (scratch[j] < (double)sp->min_p) {
                n = j;
                break;
            }
    const int32_t pick = draw(scratch, n, rng, &sum);
    const clover_cand c = cand[pick < 0 ? 0 : pick]; /* rounding at the end: the argmax */
    if (confidence) *confidence = drawn_confidence(c.z, zmax, T, sum);
    return c.id;
}

int32_t clover_sample(const float *logits, int32_t n_vocab, const clover_sampler_params *sp, clover_rng *rng,
                      float *confidence, float *scratch, int32_t *iscratch) {
    (void)iscratch;
    int32_t best = -1;
    float zmax = -FLT_MAX;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (i == sp->mask_token_id) continue;
        if (best < 0 || logits[i] > zmax) {
            zmax = logits[i];
            best = i;
        }
    }
    if (best < 0) {
        if (confidence) *confidence = 0;
        return -1;
    }
    if (!(sp->temperature > 0.0f)) { /* greedy: top-k, top-p and min-p cannot change the argmax */
        if (!confidence) return best;
        double sum = 0;
        for (int32_t i = 0; i < n_vocab; i++)
            if (i != sp->mask_token_id) sum += exp((double)logits[i] - zmax);
        *confidence = (float)(1.0 / sum);
        return best;
    }
    const float T = sp->temperature;
    if ((sp->top_k > 0 && sp->top_k < n_vocab) || sp->top_p < 1.0f) { /* candidates sorted by rank */
        const int32_t n = clover_cand_ids(n_vocab, sp->mask_token_id);
        const int cut = sp->top_k > 0 && sp->top_k < n;
        clover_cand *cand = malloc(sizeof(clover_cand) * (size_t)(cut ? sp->top_k : n));
        if (!cand) { /* no memory: fall back to the greedy candidate */
            if (confidence) *confidence = 1.0f;
            return best;
        }
        /* top-p alone: the whole row's weight, then the best 256, 4096 or all candidates, the
         * fewest among which the top-p prefix ends (rather than sorting the vocabulary) */
        double total = 0;
        for (int32_t i = 0; i < n_vocab && !cut; i++)
            if (i != sp->mask_token_id) total += weight(logits[i], zmax, T);
        int32_t k = cut ? sp->top_k : n < 256 ? n : 256;
        for (;; k = k * 16 > n / 4 ? n : k * 16) {
            top_k_cands(logits, n_vocab, sp->mask_token_id, k, cand);
            if (cut || k == n || top_p_within(cand, k, T, total, sp->top_p)) break;
        }
        const int32_t id = clover_sample_top(cand, k, sp, rng, confidence, scratch, cut ? 0.0 : total);
        free(cand);
        return id;
    }
    /* no top-k or top-p: weights in vocabulary order, min-p without sorting */
    const double min_p = sp->min_p > 0.0f ? sp->min_p : 0.0;
    for (int32_t i = 0; i < n_vocab; i++) {
        float w = i == sp->mask_token_id ? 0.0f : weight(logits[i], zmax, T);
        scratch[i] = w < min_p && i != best ? 0.0f : w;
    }
    double sum;
    const int32_t pick = draw(scratch, n_vocab, rng, &sum), id = pick < 0 ? best : pick;
    if (confidence) *confidence = drawn_confidence(logits[id], zmax, T, sum);
    return id;
}

int32_t clover_select_k(const clover_sampler_params *sp, int32_t n_vocab) {
    if (!(sp->temperature > 0.0f)) return 0;
    const int32_t ids = clover_cand_ids(n_vocab, sp->mask_token_id);
    if (sp->top_k > 0 && sp->top_k < ids) return sp->top_k <= CLOVER_CUDA_TOP_K_MAX ? sp->top_k : -1;
    return clover_select_total(sp, n_vocab) ? CLOVER_CUDA_TOP_K_MAX : -1;
}

int clover_select_total(const clover_sampler_params *sp, int32_t n_vocab) {
    const int32_t ids = clover_cand_ids(n_vocab, sp->mask_token_id);
    return sp->temperature > 0.0f && !(sp->top_k > 0 && sp->top_k < ids) && sp->top_p < 1.0f &&
           ids > CLOVER_CUDA_TOP_K_MAX;
}

int clover_top_p_in_cands(const clover_cand *cand, int32_t n, const clover_sampler_params *sp, double total) {
    return top_p_within(cand, n, sp->temperature, total, sp->top_p);
}

/* ---------------------------------------------------------------- one row, public (clover.h) */

int32_t clover_sample_logits(const float *logits, int32_t n_vocab, int32_t mask_token_id, const clover_gen_params *p,
                             const int32_t *prompt, int32_t n_prompt, const int32_t *generated, int32_t n_generated,
                             float *processed, float *confidence, char *err, size_t err_size) {
    if (!logits || !p || !confidence)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "logits, params or confidence is NULL");
    if (n_vocab <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_vocab: %d must be > 0", n_vocab);
    if (mask_token_id < -1 || mask_token_id >= n_vocab)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "mask_token_id: %d outside [-1, %d)", mask_token_id, n_vocab);
    if (n_prompt < 0 || (n_prompt > 0 && !prompt))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "prompt: %d tokens but no array", n_prompt);
    if (n_generated < 0 || (n_generated > 0 && !generated))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "generated: %d tokens but no array", n_generated);
    int rc = clover_check_sampling(p, n_vocab, err, err_size);
    if (rc) return rc;
    if (p->n_end_ids < 0 || (p->n_end_ids > 0 && !p->end_ids))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "end_ids: %d ids but no array", p->n_end_ids);
    for (int32_t i = 0; i < p->n_end_ids; i++)
        if (p->end_ids[i] < 0 || p->end_ids[i] >= n_vocab)
            return clover_set_err(err, err_size, CLOVER_E_ARG, "end_ids[%d]: id %d outside [0, %d)", i, p->end_ids[i],
                                  n_vocab);
    for (int32_t i = 0; i < n_prompt; i++)
        if (prompt[i] < 0 || prompt[i] >= n_vocab)
            return clover_set_err(err, err_size, CLOVER_E_ARG, "prompt[%d]: id %d outside [0, %d)", i, prompt[i], n_vocab);
    for (int32_t i = 0; i < n_generated; i++)
        if (generated[i] < 0 || generated[i] >= n_vocab)
            return clover_set_err(err, err_size, CLOVER_E_ARG, "generated[%d]: id %d outside [0, %d)", i,
                                  generated[i], n_vocab);
    clover_history h;
    float *out = malloc(sizeof(float) * (size_t)n_vocab), *scratch = malloc(sizeof(float) * (size_t)n_vocab);
    if (!out || !scratch || clover_history_init(&h, n_vocab, p->think_open_id, p->think_close_id)) {
        free(out), free(scratch);
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for %d logits", n_vocab);
    }
    clover_history_prompt(&h, prompt, n_prompt, p->penalty_scope);
    for (int32_t i = 0; i < n_generated; i++) clover_history_add(&h, generated[i]);
    clover_sampler_params sp;
    clover_sampler_params_init(&sp, p, mask_token_id);
    clover_logit_op *ops = malloc(sizeof(clover_logit_op) * (size_t)clover_logit_ops_max(&sp, &h));
    if (!ops) {
        clover_history_free(&h);
        free(out), free(scratch);
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for %d logits", n_vocab);
    }
    clover_process_logits(logits, out, n_vocab, &sp, &h, n_generated, h.think_open, ops);
    free(ops);
    if (processed) memcpy(processed, out, sizeof(float) * (size_t)n_vocab);
    clover_rng rng;
    clover_rng_seed(&rng, p->seed);
    int32_t t = clover_sample(out, n_vocab, &sp, &rng, confidence, scratch, NULL);
    clover_history_free(&h);
    free(out), free(scratch);
    if (t < 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "no candidate: every token is the mask token");
    return t;
}
