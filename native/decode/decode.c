/* decode.c: the decoding loops of clover-spec 5.1-5.2 and 5.5: `ar` (autoregressive, prefix
 * mode), `diffusion` (threshold block decoding with a commit pass and end-token stop) and `spec`
 * (self-speculative: block-mode draft, prefix-mode verify, rollback by GDN replay).
 *
 * A decoder advances one forward per clover_decoder_step (ar: one token; diffusion: one
 * denoising forward, plus the commit when the block is complete; spec: one draft + verify)
 * and hands back the tokens that became final, so callers can stream: in diffusion these are
 * the newly filled slots contiguous with the block's already final start (spec 5.2: filled
 * slots are never remasked), not only whole blocks.
 */
#include "core/errors.h"
#include "decode/guide.h"
#include "decode/sampler.h"
#include "model/checkpoint.h"
#include "model/forward.h"
#include "model/load.h"
#include "model/model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

struct clover_decoder {
    clover_context *c;
    clover_gen_params p;
    int32_t *end_ids;
    clover_rng rng;
    clover_sampler_params sp;
    float *causal;     /* [n_vocab] causal logits of the last committed row */
    float *logits;     /* [block_size, n_vocab] */
    int32_t *block;    /* [block_size] */
    unsigned char *filled;
    float *conf;       /* [block_size] */
    int32_t *cand;     /* [block_size] */
    int32_t *nexp;     /* [n_layer] distinct experts per layer of the last denoising pass */
    float *scratch;    /* [n_vocab] */
    float *proc;       /* [n_vocab] a row after penalties and soft biases (spec 5.4) */
    int32_t *bias_ids; /* copies of the caller's logit_bias arrays */
    float *bias_values;
    clover_history hist; /* prompt and generated tokens (spec 5.4) */
    clover_stats st;
    int done;
    int32_t seed_tok; /* spec: the next block's first token, chosen by the last verify */
    int have_seed;
    int in_block;      /* diffusion: a block is being denoised */
    int32_t n_masked;  /* diffusion: its slots still masked */
    int32_t n_fixed;   /* diffusion: its leading slots holding the prompt's tail (spec 3.1), fixed */
    int32_t n_streamed; /* diffusion: its leading slots final so far (the fixed ones included) */
    int32_t *tail;     /* diffusion with aligned blocks: the prompt past the last block boundary, */
    int32_t n_tail;    /* the first block's fixed slots (n_tail < block_size) */
    uint8_t *need;     /* [block_size] LM-head rows the next denoising pass needs */
    clover_logit_op *ops; /* [n_vocab + n_logit_bias + n_end_ids + 2] a row's spec 5.4 edits */
    /* selection on the GPU (select_on_gpu): every needed row's edits (gops, gops_cap entries)
     * and their ranges (gstart [block_size + 1]); sel_k: clover_select_k, and above 0 the rows'
     * candidates (tops [block_size][sel_k]) */
    clover_logit_op *gops;
    int64_t gops_cap;
    int32_t *gstart;
    int32_t sel_k;
    clover_cand *tops; /* [block_size][k] for a selection of k <= tops_k candidates a row */
    int32_t tops_k;
    int32_t draft_k; /* spec's draft with penalties on the GPU: its candidates a row (0: none) */
    float *gpre; /* spec's draft with penalties: the inputs of gops' edits (gpre_cap entries) */
    int64_t gpre_cap;
    int32_t next_tok; /* prefill_next's selection on the GPU: the id (sel_k 0), else tops[0] */
    int have_next;
    /* top-p alone on the GPU (clover_select_total): each selected row's weight (gtotal [block_size],
     * next_total for prefill_next), 0 when the row's edited logits came back instead (into
     * logits, or causal for prefill_next) */
    int sel_total;
    double *gtotal, next_total;
    uint32_t *allowed; /* [(n_vocab + 31) / 32] the constraint's mask (p.constraint) */
    /* logprobs (p.logprobs >= 0): the last step's tokens' (rec, n_rec), the diffusion block's slots'
     * (slot_rec [block_size]) and spec's seed token's (seed_rec) */
    clover_lp_rec *rec, *slot_rec, seed_rec;
    int32_t n_rec;
};

/* Id of the vocabulary entry equal to s (tokenizer.ggml.tokens), or -1. */
static int32_t vocab_id(const clover_model *m, const char *s) {
    const int64_t k = m ? clover_gguf_find_key(m->g, "tokenizer.ggml.tokens") : -1;
    const int64_t n = k >= 0 ? clover_gguf_arr_n(m->g, k) : 0;
    for (int64_t i = 0; i < n && i < m->hp.n_vocab; i++) {
        const char *t = clover_gguf_get_str(m->g, k, i, NULL);
        if (t && strcmp(t, s) == 0) return (int32_t)i;
    }
    return -1;
}

void clover_gen_params_default(const clover_model *m, clover_gen_params *p) {
    memset(p, 0, sizeof *p);
    p->mode = m && m->hp.has_block ? CLOVER_MODE_DIFFUSION : CLOVER_MODE_AR;
    p->max_tokens = 256;
    p->temperature = 0.0f;
    p->top_k = 0;
    p->top_p = 1.0f;
    p->seed = 0;
    p->block_size = m ? m->hp.block_size : 32;
    p->threshold = m ? m->hp.threshold : 0.95f;
    p->coreset_top_p = m ? m->hp.coreset_top_p : 0.9f;
    /* spec 5.3-5.4 */
    p->min_p = 0.0f;
    /* the decoding record's repetition controls (spec 4.2; model/load.c read_record gives a parent's
     * file llama.cpp's: none, over the whole history) */
    p->presence_penalty = m ? m->hp.presence_penalty : 0.0f;
    p->repetition_penalty = m ? m->hp.repetition_penalty : 1.0f;
    p->frequency_penalty = m ? m->hp.frequency_penalty : 0.0f;
    p->penalty_scope = m ? m->hp.penalty_scope : CLOVER_PENALTY_ALL;
    p->think_open_id = vocab_id(m, "<think>");
    p->think_close_id = vocab_id(m, "</think>");
    p->think_close_bias_start = m ? m->hp.think_close_bias_start : 4096;
    p->eos_bias_start = m ? m->hp.eos_bias_start : 8192;
    p->bias_slope = m ? m->hp.bias_slope : 0.01f;
    p->bias_max = m ? m->hp.bias_max : 10.0f;
    p->constraint = NULL;
    p->logprobs = -1;
}

int clover_model_check_mode(const clover_model *m, int32_t mode, char *err, size_t err_size) {
    if (!m) return clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
    if (mode != CLOVER_MODE_AR && mode != CLOVER_MODE_DIFFUSION && mode != CLOVER_MODE_SPEC)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "mode: %d is not ar (0), diffusion (1) or spec (2)", mode);
    if (mode != CLOVER_MODE_AR && !m->hp.has_block) {
        clover_no_block(m, mode == CLOVER_MODE_SPEC ? "mode spec" : "mode diffusion", err, err_size);
        return CLOVER_E_ARG;
    }
    return CLOVER_OK;
}

int clover_gen_params_check(const clover_context *c, const clover_gen_params *p, char *err, size_t n) {
    if (!c || !p) return clover_set_err(err, n, CLOVER_E_ARG, "context or params is NULL");
    const clover_model *m = c->m;
    const clover_hparams *hp = &m->hp;
    int rc = clover_model_check_mode(m, p->mode, err, n);
    if (rc) return rc;
    if (p->max_tokens <= 0) return clover_set_err(err, n, CLOVER_E_ARG, "max_tokens: %d must be > 0", p->max_tokens);
    /* temperature, top_k, top_p, min_p, penalties, logit_bias, think ids, ramps (sampler.c,
     * shared with clover_sample_logits) */
    rc = clover_check_sampling(p, hp->n_vocab, err, n);
    if (rc) return rc;
    if (p->block_size <= 0) return clover_set_err(err, n, CLOVER_E_ARG, "block_size: %d must be > 0", p->block_size);
    if (!(p->threshold > 0.0f && p->threshold <= 1.0f))
        return clover_set_err(err, n, CLOVER_E_ARG, "threshold: %g outside (0, 1]", p->threshold);
    if (!(p->coreset_top_p > 0.0f && p->coreset_top_p <= 1.0f))
        return clover_set_err(err, n, CLOVER_E_ARG, "coreset_top_p: %g outside (0, 1]", p->coreset_top_p);
    if (p->n_end_ids < 0 || (p->n_end_ids > 0 && !p->end_ids))
        return clover_set_err(err, n, CLOVER_E_ARG, "end_ids: %d ids but no array", p->n_end_ids);
    for (int32_t i = 0; i < p->n_end_ids; i++)
        if (p->end_ids[i] < 0 || p->end_ids[i] >= hp->n_vocab)
            return clover_set_err(err, n, CLOVER_E_ARG, "end_ids[%d]: id %d outside [0, %d)", i, p->end_ids[i],
                                  hp->n_vocab);
    if (p->logprobs < -1 || p->logprobs > CLOVER_MAX_LOGPROBS)
        return clover_set_err(err, n, CLOVER_E_ARG, "logprobs: %d outside [-1, %d]", p->logprobs, CLOVER_MAX_LOGPROBS);
    if (p->constraint && (!p->constraint->mask || !p->constraint->accept || !p->constraint->rollback))
        return clover_set_err(err, n, CLOVER_E_ARG, "constraint: mask, accept and rollback must all be set");
    return CLOVER_OK;
}

void clover_decoder_free(clover_decoder *d) {
    if (!d) return;
    free(d->end_ids), free(d->causal), free(d->logits), free(d->block), free(d->filled);
    free(d->conf), free(d->cand), free(d->nexp), free(d->scratch), free(d->need);
    free(d->proc), free(d->bias_ids), free(d->bias_values), free(d->ops), free(d->gops), free(d->gstart);
    free(d->tops), free(d->gpre), free(d->gtotal), free(d->tail), free(d->allowed), free(d->rec), free(d->slot_rec);
    clover_history_free(&d->hist);
    free(d);
}

clover_decoder *clover_decoder_new(clover_context *c, const clover_gen_params *p, const int32_t *prompt,
                                   int32_t n_prompt, char *err, size_t err_size) {
    if (!c || !p || !prompt) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "context, params or prompt is NULL");
        return NULL;
    }
    if (n_prompt <= 0) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "prompt: empty (n_prompt %d)", n_prompt);
        return NULL;
    }
    const clover_model *m = c->m;
    if (clover_gen_params_check(c, p, err, err_size)) return NULL;
    if (n_prompt > c->n_ctx) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "prompt: %d tokens exceed n_ctx %d", n_prompt, c->n_ctx);
        return NULL;
    }
    const int64_t V = m->hp.n_vocab, B = p->mode == CLOVER_MODE_AR ? 1 : p->block_size;
    clover_decoder *d = calloc(1, sizeof *d);
    if (!d) goto nomem;
    d->c = c;
    d->p = *p;
    if (p->n_end_ids > 0) {
        d->end_ids = malloc(sizeof(int32_t) * (size_t)p->n_end_ids);
        if (!d->end_ids) goto nomem;
        memcpy(d->end_ids, p->end_ids, sizeof(int32_t) * (size_t)p->n_end_ids);
    }
    d->p.end_ids = d->end_ids;
    if (p->n_logit_bias > 0) {
        d->bias_ids = malloc(sizeof(int32_t) * (size_t)p->n_logit_bias);
        d->bias_values = malloc(sizeof(float) * (size_t)p->n_logit_bias);
        if (!d->bias_ids || !d->bias_values) goto nomem;
        memcpy(d->bias_ids, p->logit_bias_ids, sizeof(int32_t) * (size_t)p->n_logit_bias);
        memcpy(d->bias_values, p->logit_bias_values, sizeof(float) * (size_t)p->n_logit_bias);
    }
    d->p.logit_bias_ids = d->bias_ids;
    d->p.logit_bias_values = d->bias_values;
    if ((uint64_t)B * (uint64_t)V > SIZE_MAX / sizeof(float)) goto nomem;
    d->causal = malloc(sizeof(float) * (size_t)V);
    d->logits = malloc(sizeof(float) * (size_t)(B * V));
    d->block = malloc(sizeof(int32_t) * (size_t)B);
    d->filled = malloc((size_t)B);
    d->conf = malloc(sizeof(float) * (size_t)B);
    d->cand = malloc(sizeof(int32_t) * (size_t)B);
    d->nexp = calloc((size_t)m->hp.n_layer, sizeof(int32_t));
    d->scratch = malloc(sizeof(float) * (size_t)V);
    d->proc = malloc(sizeof(float) * (size_t)V);
    d->need = malloc((size_t)B);
    d->ops = malloc(sizeof(clover_logit_op) * ((size_t)V + (size_t)d->p.n_logit_bias + (size_t)d->p.n_end_ids + 2));
    d->gstart = malloc(sizeof(int32_t) * ((size_t)B + 1));
    if (!d->causal || !d->logits || !d->block || !d->filled || !d->conf || !d->cand || !d->nexp || !d->scratch ||
        !d->proc || !d->need || !d->ops || !d->gstart ||
        clover_history_init(&d->hist, (int32_t)V, p->think_open_id, p->think_close_id))
        goto nomem;
    clover_history_prompt(&d->hist, prompt, n_prompt, p->penalty_scope);
    clover_rng_seed(&d->rng, p->seed);
    clover_sampler_params_init(&d->sp, &d->p, m->hp.mask_token_id);
    d->sel_k = clover_select_k(&d->sp, (int32_t)V);
    d->sel_total = clover_select_total(&d->sp, (int32_t)V);
    if (d->sel_total && B > CLOVER_SELECT_TOTAL_MAX_ROWS) d->sel_k = -1, d->sel_total = 0; /* rows to the host */
    if (d->sel_total && !(d->gtotal = malloc(sizeof(double) * (size_t)B))) goto nomem;
    /* spec's draft with penalties on the GPU (draft_pick) takes min(B, ids) candidates a row at
     * temperature 0, min(top_k + B - 1, ids) for a top-k draw; none (the CPU drafts) for top-p
     * alone or past CLOVER_CUDA_TOP_K_MAX */
    const int32_t ids = clover_cand_ids(V, m->hp.mask_token_id);
    const int64_t want = d->sel_k > 0 ? (int64_t)d->sel_k + B - 1 : B;
    d->draft_k = p->mode == CLOVER_MODE_SPEC && d->sel_k >= 0 && !d->sel_total && want <= CLOVER_CUDA_TOP_K_MAX
                     ? (int32_t)(want < ids ? want : ids)
                     : 0;
    if (p->constraint || p->logprobs >= 0) d->sel_k = -1, d->sel_total = 0, d->draft_k = 0; /* rows to the host */
    d->tops_k = d->sel_k > d->draft_k ? d->sel_k : d->draft_k;
    if (d->tops_k > 0 && !(d->tops = malloc(sizeof(clover_cand) * (size_t)(B * d->tops_k)))) goto nomem;
    if (p->constraint && !(d->allowed = malloc(sizeof(uint32_t) * (size_t)((V + 31) / 32)))) goto nomem;
    if (p->logprobs >= 0 && (!(d->rec = malloc(sizeof(clover_lp_rec) * (size_t)B)) ||
                             !(d->slot_rec = malloc(sizeof(clover_lp_rec) * (size_t)B))))
        goto nomem;
    if (p->n_reuse != 0 && (p->n_reuse < 0 || p->n_reuse != c->n_past || p->n_reuse >= n_prompt)) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "n_reuse: %d must be 0 or the %d cached tokens (< n_prompt %d)",
                       p->n_reuse, c->n_past, n_prompt);
        clover_decoder_free(d);
        return NULL;
    }
    /* aligned diffusion blocks (spec 3.1): the prompt up to its last block boundary is prefilled and
     * its tail fills the first block's leading slots; a cache past that boundary cannot be rewound */
    const int32_t p0 = p->mode == CLOVER_MODE_DIFFUSION && m->hp.block_aligned ? n_prompt / (int32_t)B * (int32_t)B
                                                                              : n_prompt;
    const int32_t reuse = p->n_reuse <= p0 ? p->n_reuse : 0;
    d->n_tail = n_prompt - p0;
    if (d->n_tail > 0) {
        if (!(d->tail = malloc(sizeof(int32_t) * (size_t)d->n_tail))) goto nomem;
        memcpy(d->tail, prompt + p0, sizeof(int32_t) * (size_t)d->n_tail);
    }
    if (reuse == 0) clover_context_reset(c);
    else atomic_store(&c->abort_req, 0); /* as the reset would: no stale cancel */
    const int64_t passes = c->n_passes;
    if (p0 > reuse && clover_prefill(c, prompt + reuse, p0 - reuse, d->causal, 0, err, err_size)) {
        clover_decoder_free(d);
        return NULL;
    }
    d->st.n_prompt = n_prompt;
    d->st.n_prompt_reused = reuse;
    d->st.n_forward_prefill = c->n_passes - passes; /* one per pass of at most n_ubatch rows */
    return d;
nomem:
    clover_decoder_free(d);
    clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory allocating the decoder");
    return NULL;
}

static int is_end(const clover_decoder *d, int32_t t) {
    for (int32_t i = 0; i < d->p.n_end_ids; i++)
        if (d->end_ids[i] == t) return 1;
    return 0;
}

/* Emit tokens[0..n) within the max_tokens budget; sets finish_reason = LENGTH and returns the
 * count written when the budget cuts it. */
static int32_t emit(clover_decoder *d, const int32_t *tokens, int32_t n, int32_t *out) {
    int64_t left = d->p.max_tokens - d->st.n_generated;
    if (n >= left) {
        n = (int32_t)left;
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_LENGTH;
    }
    memcpy(out, tokens, sizeof(int32_t) * (size_t)n);
    d->st.n_generated += n;
    for (int32_t i = 0; i < n; i++) clover_history_add(&d->hist, tokens[i]); /* spec 5.4 history */
    return n;
}

/* Candidate and confidence for the slot at generated index n_generated + j (spec 5.3-5.4): the
 * penalties count the emitted tokens plus pend[k] (k < n_pend, where on[k] when on is given:
 * the tokens already in the current block), the </think> ramp applies while a thinking section
 * is open at the slot (emitted tokens, then pend[k] for k < j), then the sampler. */
static int slot_push(clover_decoder *d, int32_t j, const int32_t *pend, const unsigned char *on, int32_t n_pend) {
    clover_history *h = &d->hist;
    int think = h->think_open;
    for (int32_t k = 0; k < n_pend; k++) {
        if (on && !on[k]) continue;
        clover_history_push(h, pend[k]);
        if (k < j) think = clover_think_state(h, think, pend[k]);
    }
    return think; /* the think state at slot j */
}

static void slot_pop(clover_decoder *d, const int32_t *pend, const unsigned char *on, int32_t n_pend) {
    for (int32_t k = n_pend - 1; k >= 0; k--)
        if (!on || on[k]) clover_history_pop(&d->hist, pend[k]);
}

/* allowed (NULL = all): the constraint's mask (constraint_mask); the other ids are never drawn.
 * conf NULL: the confidence is not wanted (clover_sample skips it). */
static int32_t sample_slot(clover_decoder *d, const float *row, int32_t j, const int32_t *pend,
                           const unsigned char *on, int32_t n_pend, const uint32_t *allowed, float *conf) {
    clover_history *h = &d->hist;
    const int think = slot_push(d, j, pend, on, n_pend);
    clover_process_logits(row, d->proc, h->n_vocab, &d->sp, h, d->st.n_generated + j, think, d->ops);
    slot_pop(d, pend, on, n_pend);
    if (allowed) clover_guide_apply(d->proc, h->n_vocab, allowed);
    return clover_sample(d->proc, h->n_vocab, &d->sp, &d->rng, conf, d->scratch, NULL);
}

/* The constraint's allowed next tokens into d->allowed; its accept and rollback (decode/guide.c). */
static int constraint_mask(clover_decoder *d, char *err, size_t err_size) {
    const clover_hparams *hp = &d->c->m->hp;
    return clover_guide_mask(d->p.constraint, d->allowed, hp->n_vocab, hp->mask_token_id, err, err_size);
}

static int constraint_accept(clover_decoder *d, int32_t t, char *err, size_t err_size) {
    return clover_guide_accept(d->p.constraint, t, err, err_size);
}

/* The logprobs record of token t chosen from the raw logits row z (clover_decoder_logprobs). */
static void lp_make(const clover_decoder *d, const float *z, int32_t t, clover_lp_rec *r) {
    clover_guide_logprobs(z, d->c->m->hp.n_vocab, d->c->m->hp.mask_token_id, t, d->p.logprobs, r);
}

/* Append to gops (grown as needed) the spec 5.4 edits sample_slot would apply to slot j with
 * those pending tokens; *n_ops: the entries so far. */
static int row_ops(clover_decoder *d, int64_t *n_ops, int32_t j, const int32_t *pend, const unsigned char *on,
                   int32_t n_pend, char *err, size_t err_size) {
    const int think = slot_push(d, j, pend, on, n_pend);
    const int64_t need = *n_ops + clover_logit_ops_max(&d->sp, &d->hist);
    if (need > d->gops_cap) {
        clover_logit_op *g = realloc(d->gops, sizeof(clover_logit_op) * (size_t)(2 * need));
        if (!g) {
            slot_pop(d, pend, on, n_pend);
            return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the sampler's edits");
        }
        d->gops = g, d->gops_cap = 2 * need;
    }
    *n_ops += clover_logit_ops(&d->sp, &d->hist, d->st.n_generated + j, think, d->gops + *n_ops);
    slot_pop(d, pend, on, n_pend);
    return CLOVER_OK;
}

/* Whether the selection runs on the GPU (clover_block_forward_select): a resident model at
 * temperature 0, or above it with a top_k that cuts or top-p alone (clover_select_k). */
static int select_on_gpu(const clover_decoder *d) { return d->c->m->resident && d->sel_k >= 0; }

/* A draw from the GPU's candidates cand of a row (sel_k > 0), as sample_slot would draw from the
 * row: for top-p alone with the row's weight total, or from the row's edited logits full when
 * total is 0 (its top-p prefix does not end within the candidates). */
static int32_t draw_cands(clover_decoder *d, const clover_cand *cand, double total, const float *full, float *conf) {
    if (d->sel_total && total == 0.0)
        return clover_sample(full, d->c->m->hp.n_vocab, &d->sp, &d->rng, conf, d->scratch, NULL);
    return clover_sample_top(cand, d->sel_k, &d->sp, &d->rng, conf, d->scratch, d->sel_total ? total : 0.0);
}

/* draw_cands for row r of a block pass's selection (tops, gtotal, logits). */
static int32_t top_draw(clover_decoder *d, int64_t r, float *conf) {
    return draw_cands(d, d->tops + r * d->sel_k, d->sel_total ? d->gtotal[r] : 0.0,
                      d->logits + r * d->c->m->hp.n_vocab, conf);
}

/* denoise's forward and candidates for select_on_gpu: each needed row's spec 5.4 edits (those
 * sample_slot would apply) go to the GPU with the block, which selects there
 * (clover_block_forward_select): an id and a confidence per row, or its top-k candidates, come
 * back, not logits. */
static int denoise_on_gpu(clover_decoder *d, char *err, size_t err_size) {
    const int32_t B = d->p.block_size, shift = d->c->m->hp.shift_logits, nf = d->n_fixed;
    int64_t n_ops = 0;
    int rc = CLOVER_OK;
    for (int32_t r = 0; r < B && rc == CLOVER_OK; r++) {
        d->gstart[r] = (int32_t)n_ops;
        if (d->need[r]) rc = row_ops(d, &n_ops, r + shift - nf, d->block + nf, d->filled + nf, B - nf, err, err_size);
    }
    d->gstart[B] = (int32_t)n_ops;
    /* row r predicts slot r + shift: its id and confidence land in cand, conf of that slot */
    if (rc == CLOVER_OK)
        rc = clover_block_forward_select(d->c, d->block, B, d->p.coreset_top_p, d->need, d->gops, d->gstart, &d->sp,
                                         d->sel_k, d->cand + shift, d->conf + shift, d->tops, NULL, d->gtotal,
                                         d->sel_total ? d->logits : NULL, d->nexp, err, err_size);
    return rc;
}

/* Prefill tokens[0..n) (the prefix-mode forward of a decode step or a diffusion commit) and take
 * the causal prediction of the next slot: selected on the GPU when select_on_gpu (its edits
 * are known at this point: the history already holds the tokens), for next_token; else its logits go to
 * causal for sample_slot. */
static int prefill_next(clover_decoder *d, const int32_t *tokens, int32_t n, char *err, size_t err_size) {
    d->have_next = 0;
    if (!select_on_gpu(d) || n > CLOVER_SELECT_MAX_ROWS)
        return clover_prefill(d->c, tokens, n, d->causal, 0, err, err_size);
    int64_t n_ops = 0;
    for (int32_t t = 0; t < n; t++) d->gstart[t] = 0; /* the edits are the last row's */
    int rc = row_ops(d, &n_ops, 0, NULL, NULL, 0, err, err_size);
    d->gstart[n] = (int32_t)n_ops;
    float conf;
    if (rc == CLOVER_OK)
        rc = clover_prefill_select(d->c, tokens, n, 0, d->gops, d->gstart, &d->sp, d->sel_k, &d->next_tok, &conf,
                                   d->tops, d->sel_total ? &d->next_total : NULL, d->sel_total ? d->causal : NULL,
                                   err, err_size);
    d->have_next = rc == CLOVER_OK;
    return rc;
}

/* The next slot's token: prefill_next's selection when it made one, else drawn from causal. */
static int32_t next_token(clover_decoder *d) {
    const int have = d->have_next;
    d->have_next = 0;
    if (!have) return sample_slot(d, d->causal, 0, NULL, NULL, 0, NULL, NULL);
    return d->sel_k ? draw_cands(d, d->tops, d->next_total, d->causal, NULL) : d->next_tok;
}

/* next_token, from the constraint's allowed ids and accepted by it when there is one; its
 * logprobs record into rec (may be NULL). */
static int choose_next(clover_decoder *d, int32_t *t, clover_lp_rec *rec, char *err, size_t err_size) {
    if (d->p.constraint) {
        int rc = constraint_mask(d, err, err_size);
        if (rc) return rc;
        *t = sample_slot(d, d->causal, 0, NULL, NULL, 0, d->allowed, NULL);
        rc = constraint_accept(d, *t, err, err_size);
        if (rc) return rc;
    } else {
        *t = next_token(d);
    }
    if (rec) lp_make(d, d->causal, *t, rec);
    return CLOVER_OK;
}

static int step_ar(clover_decoder *d, int32_t *out, int32_t *n_out, char *err, size_t err_size) {
    int32_t t;
    int rc = choose_next(d, &t, d->rec, err, err_size);
    if (rc) return rc;
    *n_out = emit(d, &t, 1, out);
    if (is_end(d, t) && *n_out == 1) {
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_STOP;
    }
    if (d->done) return 0;
    if (d->c->n_past + 1 > d->c->n_ctx) {
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_LENGTH;
        return 0;
    }
    rc = prefill_next(d, &t, 1, err, err_size);
    if (rc) return rc;
    d->st.n_forward_decode++;
    return 1;
}

/* Per-layer distinct experts of the last block-mode pass, with and without the coreset. */
static void count_experts(clover_decoder *d) {
    const clover_context *c = d->c;
    for (int il = 0; il < c->m->hp.n_layer; il++) {
        const int64_t n = d->nexp[il], nf = c->nexp_full[il];
        d->st.sum_distinct_experts += n;
        d->st.sum_distinct_experts_full += nf;
        if (n > d->st.max_distinct_experts) d->st.max_distinct_experts = n;
        if (nf > d->st.max_distinct_experts_full) d->st.max_distinct_experts_full = nf;
    }
}

/* Start a diffusion block (spec 5.2): the prompt's tail in the first aligned block's leading
 * slots (fixed), the other slots masked; with shift_logits a block without fixed slots takes
 * slot 0 from the causal prediction of the last committed row (spec 3.5). */
static int start_block(clover_decoder *d, char *err, size_t err_size) {
    const clover_hparams *hp = &d->c->m->hp;
    const int32_t B = d->p.block_size, nf = d->n_tail;
    for (int32_t j = 0; j < B; j++) {
        d->block[j] = j < nf ? d->tail[j] : hp->mask_token_id;
        d->filled[j] = j < nf;
    }
    d->n_tail = 0;
    d->n_fixed = d->n_streamed = nf;
    d->n_masked = B - nf;
    d->in_block = 1;
    if (hp->shift_logits && nf == 0) {
        int rc = choose_next(d, &d->block[0], d->slot_rec, err, err_size);
        if (rc) return rc;
        d->filled[0] = 1;
        d->n_masked--;
    }
    return CLOVER_OK;
}

/* denoise's fill under a constraint (docs/structured-output.md): from the first masked slot on,
 * in order, each slot drawn from its row restricted to the constraint's allowed ids and accepted
 * by it; the first always, each next while its confidence clears the threshold, none after an end
 * token. */
static int fill_in_order(clover_decoder *d, char *err, size_t err_size) {
    const clover_hparams *hp = &d->c->m->hp;
    const int32_t B = d->p.block_size, V = hp->n_vocab, shift = hp->shift_logits, nf = d->n_fixed;
    int32_t j = 0, n_fill = 0;
    while (j < B && d->filled[j]) j++;
    for (; j < B; j++) {
        const int64_t r = shift ? j - 1 : j; /* the row predicting slot j */
        float conf;
        int rc = constraint_mask(d, err, err_size);
        if (rc) return rc;
        const int32_t t = sample_slot(d, d->logits + r * V, j - nf, d->block + nf, d->filled + nf, B - nf, d->allowed,
                                      &conf);
        if (n_fill > 0 && !(conf > d->p.threshold)) break;
        rc = constraint_accept(d, t, err, err_size);
        if (rc) return rc;
        d->block[j] = t, d->filled[j] = 1, n_fill++;
        if (d->slot_rec) lp_make(d, d->logits + r * V, t, &d->slot_rec[j]);
        if (is_end(d, t)) break;
    }
    d->n_masked -= n_fill;
    return CLOVER_OK;
}

/* One denoising pass over the current block (spec 5.2): the LM head only on the rows that
 * predict masked slots, then fill every slot above the threshold, else the most confident. */
static int denoise(clover_decoder *d, char *err, size_t err_size) {
    clover_context *c = d->c;
    const clover_hparams *hp = &c->m->hp;
    const int32_t B = d->p.block_size, V = hp->n_vocab, shift = hp->shift_logits, nf = d->n_fixed;
    for (int32_t r = 0; r < B; r++) d->need[r] = 0;
    for (int32_t j = 0; j < B; j++)
        if (!d->filled[j]) d->need[shift ? j - 1 : j] = 1; /* shift: slot 0 is filled (fixed, or causal) */
    const int on_gpu = select_on_gpu(d);
    int rc = on_gpu ? denoise_on_gpu(d, err, err_size)
                    : clover_block_forward_rows(c, d->block, B, d->p.coreset_top_p, d->logits, d->need, d->nexp, err,
                                                err_size);
    if (rc) return rc;
    d->st.n_forward_denoise++;
    count_experts(d);
    if (d->p.constraint) return fill_in_order(d, err, err_size);
    int32_t best = -1, n_fill = 0;
    for (int32_t j = 0; j < B; j++) {
        if (d->filled[j]) continue;
        const int64_t r = shift ? j - 1 : j; /* the row predicting slot j */
        if (!on_gpu)
            d->cand[j] = sample_slot(d, d->logits + r * V, j - nf, d->block + nf, d->filled + nf, B - nf, NULL,
                                     &d->conf[j]);
        else if (d->sel_k) d->cand[j] = top_draw(d, r, &d->conf[j]);
        if (best < 0 || d->conf[j] > d->conf[best]) best = j;
    }
    for (int32_t j = 0; j < B; j++) {
        if (!d->filled[j] && d->conf[j] > d->p.threshold) {
            d->block[j] = d->cand[j];
            d->filled[j] = 1;
            n_fill++;
        }
    }
    if (n_fill == 0) { /* none clears the threshold: the single most confident */
        d->block[best] = d->cand[best];
        d->filled[best] = 1;
        n_fill = 1;
    }
    for (int32_t j = shift; j < B && d->slot_rec; j++) /* the logprobs of the slots just filled */
        if (d->filled[j] && d->need[j - shift]) lp_make(d, d->logits + (int64_t)(j - shift) * V, d->block[j], &d->slot_rec[j]);
    d->n_masked -= n_fill;
    return CLOVER_OK;
}

/* Hand out the block's filled slots contiguous with what was already handed out, within the
 * max_tokens budget and up to the first end token; finishing the block (end token, budget)
 * sets done. The handed-out slots join the history (emit) when the block ends. */
static int32_t stream_block(clover_decoder *d, int32_t *out) {
    const int32_t B = d->p.block_size;
    int32_t n = 0, e = -1;
    for (int32_t j = d->n_streamed; j < B && d->filled[j] && e < 0; j++, n++)
        if (is_end(d, d->block[j])) e = j;
    const int64_t left = d->p.max_tokens - d->st.n_generated - (d->n_streamed - d->n_fixed);
    if (n >= left) {
        n = (int32_t)left;
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_LENGTH;
    }
    memcpy(out, d->block + d->n_streamed, sizeof(int32_t) * (size_t)n);
    if (d->rec) memcpy(d->rec + d->n_rec, d->slot_rec + d->n_streamed, sizeof(clover_lp_rec) * (size_t)n);
    d->n_rec += n;
    d->n_streamed += n;
    if (e >= 0 && d->n_streamed == e + 1) {
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_STOP;
    }
    return n;
}

/* diffusion (spec 5.2): one denoising pass per call; when the block is complete (or generation
 * ends in it) its tokens join the history and, unless done, a commit pass writes the caches. */
static int step_diffusion(clover_decoder *d, int32_t *out, int32_t *n_out, char *err, size_t err_size) {
    clover_context *c = d->c;
    const int32_t B = d->p.block_size;
    if (!d->in_block) {
        if ((int64_t)c->n_past + B > c->n_ctx) {
            d->done = 1;
            d->st.finish_reason = CLOVER_FINISH_LENGTH;
            return 0;
        }
        int rc = start_block(d, err, err_size);
        if (rc) return rc;
    }
    *n_out = stream_block(d, out); /* slot 0 may already be final, or end the generation */
    if (!d->done && d->n_masked > 0) {
        int rc = denoise(d, err, err_size);
        if (rc) return rc;
        *n_out += stream_block(d, out + *n_out);
    }
    if (!d->done && d->n_masked > 0) return 1;
    /* the block is complete or generation ended inside it */
    d->in_block = 0;
    d->st.n_blocks++;
    for (int32_t i = d->n_fixed; i < d->n_streamed; i++) clover_history_add(&d->hist, d->block[i]); /* spec 5.4 */
    d->st.n_generated += d->n_streamed - d->n_fixed;
    if (d->done) return 0;
    /* commit: prefix-mode forward of the block writes the caches (and with shift_logits gives the
     * next block's slot 0) */
    int rc = c->m->hp.shift_logits ? prefill_next(d, d->block, B, err, err_size)
                                   : clover_prefill(c, d->block, B, NULL, 0, err, err_size);
    if (rc) return rc;
    d->st.n_forward_commit++;
    return 1;
}

/* Emit block[0..n) (cut after the first end token, which stops generation). */
static int32_t emit_until_end(clover_decoder *d, const int32_t *block, int32_t n, int32_t *out) {
    int32_t e = -1;
    for (int32_t j = 0; j < n && e < 0; j++)
        if (is_end(d, block[j])) e = j;
    const int32_t want = e >= 0 ? e + 1 : n;
    const int32_t got = emit(d, block, want, out);
    if (e >= 0 && got == want) {
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_STOP;
    }
    return got;
}

/* Spec's draft of slot j on the GPU with penalties (step_spec): the best draft_k candidates of
 * slot j's row (row j, or j - 1 with shift_logits) under the history's edits only, with the inputs
 * of those edits in gpre. Slot j's penalties also count the drafted block[0..j); being >= 0
 * (repetition >= 1) they only lower those tokens' logits. A drafted candidate's logit is redone
 * from its raw value with slot j's edits for it, in the CPU's order (clover_logit_ops). At
 * temperature 0 the argmax (spec 5.3) is among the candidates up to the first one not drafted
 * (draft_k > j, so there is one, unless the candidates are every id); for a top-k draw the
 * candidates, re-ranked, begin with the row's top_k (at most j < B of them were lowered, draft_k
 * >= top_k + B - 1), drawn as clover_sample would. Either way the pick equals sample_slot's. The
 * row's candidates are edited in place. */
static int32_t draft_pick(clover_decoder *d, int32_t j) {
    const int32_t r = j - d->c->m->hp.shift_logits; /* the row predicting slot j (spec 3.5) */
    clover_cand *c = d->tops + (int64_t)r * d->draft_k;
    const int draw = d->sp.temperature > 0.0f;
    const clover_sampler_params *sp = &d->sp;
    const int32_t q0 = d->gstart[r], q1 = d->gstart[r + 1];
    const int think = slot_push(d, j, d->block, NULL, j);
    const int32_t n_ops = clover_logit_ops(sp, &d->hist, d->st.n_generated + j, think, d->ops);
    slot_pop(d, d->block, NULL, j);
    int32_t best = -1;
    float bz = 0.0f;
    for (int32_t q = 0; q < d->draft_k; q++) {
        const int32_t t = c[q].id;
        int drafted = 0;
        for (int32_t i = 0; i < j && !drafted; i++) drafted = d->block[i] == t;
        float z = c[q].z;
        for (int32_t e = q0; e < q1 && drafted; e++) /* the raw logit: what its first edit found */
            if (d->gops[e].id == t) {
                z = d->gpre[e];
                break;
            }
        for (int32_t e = 0; e < n_ops && drafted; e++)
            if (d->ops[e].id == t) {
                clover_logit_op o = d->ops[e];
                o.id = 0;
                clover_logit_op_apply(&z, 1, o, sp->repetition_penalty, sp->frequency_penalty, sp->presence_penalty);
            }
        c[q].z = z;
        if (draw) continue;
        if (best < 0 || z > bz || (z == bz && t < best)) best = t, bz = z;
        if (!drafted) break;
    }
    if (!draw) return best;
    clover_cands_sort(c, d->draft_k);
    return clover_sample_top(c, d->sel_k, sp, &d->rng, NULL, d->scratch, 0.0);
}

/* spec mode (spec 5.5): seed s, draft d_1..d_{B-1} from one block forward on [s, MASK...]
 * (d_j from slot j's row, read in place or shifted by the logit convention, spec 3.5), verify
 * [s, d_1..] in one prefix-mode forward giving a_0..a_{B-1}; accept the longest run d_i ==
 * a_{i-1}, emit s, d_1..d_c, roll the caches back to the kept tokens and seed the next block with
 * a_c. The verify runs the GDN token by token (as ar's decode steps do) so its logits,
 * and hence the output, equal ar's; rollback replays the recurrence over the kept tokens. */
static int step_spec(clover_decoder *d, int32_t *out, int32_t *n_out, char *err, size_t err_size) {
    clover_context *c = d->c;
    const clover_hparams *hp = &c->m->hp;
    const int32_t V = hp->n_vocab;
    int32_t B = d->p.block_size;
    if ((int64_t)c->n_past + B > c->n_ctx) B = c->n_ctx - c->n_past;
    if (B < 1) {
        d->done = 1;
        d->st.finish_reason = CLOVER_FINISH_LENGTH;
        return 0;
    }
    int rc = CLOVER_OK;
    const uint32_t *allowed = d->p.constraint ? d->allowed : NULL;
    if (d->have_seed) { /* chosen by the last verify (from the constraint's allowed ids) */
        d->block[0] = d->seed_tok;
        if (d->rec) d->rec[0] = d->seed_rec;
        if (allowed) rc = constraint_accept(d, d->block[0], err, err_size);
    } else {
        rc = choose_next(d, &d->block[0], d->rec, err, err_size);
    }
    if (rc) return rc;
    d->have_seed = 0;
    if (B == 1 || is_end(d, d->block[0])) { /* nothing to draft: one ar step */
        *n_out = emit_until_end(d, d->block, 1, out);
        if (d->done) return 0;
        rc = clover_prefill(c, d->block, 1, d->causal, 0, err, err_size);
        if (rc) return rc;
        d->st.n_forward_decode++;
        return 1;
    }
    for (int32_t j = 1; j < B; j++) d->block[j] = hp->mask_token_id;
    /* on the GPU, the draft's edits must not depend on the drafted tokens (no </think> ramp above
     * 0 in this block, which a drafted think token could switch), or only through penalties
     * that lower their logits, at temperature 0 (draft_pick) */
    const clover_sampler_params *sp = &d->sp;
    const int gpu = select_on_gpu(d),
              pens = sp->repetition_penalty != 1.0f || sp->presence_penalty != 0.0f || sp->frequency_penalty != 0.0f,
              lowering = sp->repetition_penalty >= 1.0f && sp->presence_penalty >= 0.0f && sp->frequency_penalty >= 0.0f,
              think_ramp = sp->bias_slope > 0.0f && sp->bias_max > 0.0f && sp->think_close_id >= 0 &&
                           d->st.n_generated + B - 1 > sp->think_close_bias_start,
              draft_gpu = gpu && !think_ramp && (!pens || (lowering && d->draft_k > 0));
    const int32_t k = pens ? d->draft_k : d->sel_k; /* draft_gpu: candidates a row */
    const int32_t sh = hp->shift_logits; /* slot j is predicted by row j - sh (spec 3.5) */
    if (draft_gpu) { /* with penalties, the history's edits only */
        int64_t n_ops = 0;
        for (int32_t r = 0; r < B && rc == CLOVER_OK; r++) {
            const int32_t j = r + sh;
            d->gstart[r] = (int32_t)n_ops, d->need[r] = j >= 1 && j < B;
            if (d->need[r]) rc = row_ops(d, &n_ops, j, d->block, NULL, pens ? 0 : j, err, err_size);
        }
        d->gstart[B] = (int32_t)n_ops;
        if (rc == CLOVER_OK && pens && n_ops > d->gpre_cap) {
            float *g = realloc(d->gpre, sizeof(float) * (size_t)n_ops);
            if (g) d->gpre = g, d->gpre_cap = n_ops;
            else rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the sampler's edits");
        }
        if (rc == CLOVER_OK)
            rc = clover_block_forward_select(c, d->block, B, d->p.coreset_top_p, d->need, d->gops, d->gstart, sp, k,
                                             d->block + sh, d->conf + sh, d->tops, pens ? d->gpre : NULL,
                                             pens ? NULL : d->gtotal, !pens && d->sel_total ? d->logits : NULL, d->nexp,
                                             err, err_size);
    } else {
        rc = clover_block_forward(c, d->block, B, d->p.coreset_top_p, d->logits, d->nexp, err, err_size);
    }
    if (rc) return rc;
    d->st.n_forward_draft++;
    count_experts(d);
    int32_t n_told = 0; /* drafted tokens the constraint accepted */
    for (int32_t j = 1; j < B && (!draft_gpu || k); j++) {
        if (allowed && (rc = constraint_mask(d, err, err_size))) return rc;
        d->block[j] = !draft_gpu ? sample_slot(d, d->logits + (int64_t)(j - sh) * V, j, d->block, NULL, j, allowed, NULL)
                      : pens     ? draft_pick(d, j)
                                 : top_draw(d, j - sh, NULL);
        if (allowed && is_end(d, d->block[j])) B = j + 1; /* the draft ends at an end token (never told: an
                                                            end token stops the grammar for good) */
        else if (allowed && (rc = constraint_accept(d, d->block[j], err, err_size))) return rc;
        else n_told += allowed != NULL;
    }
    if (allowed && (rc = clover_guide_rollback(d->p.constraint, n_told, err, err_size))) return rc; /* to after the seed */
    rc = clover_context_checkpoint(c, B, err, err_size);
    if (rc) return rc;
    if (gpu && B <= CLOVER_SELECT_MAX_ROWS) { /* a_i's edits: after block[0..i], known at this point */
        int64_t n_ops = 0;
        for (int32_t i = 0; i < B && rc == CLOVER_OK; i++) {
            d->gstart[i] = (int32_t)n_ops;
            rc = row_ops(d, &n_ops, i + 1, d->block, NULL, i + 1, err, err_size);
        }
        d->gstart[B] = (int32_t)n_ops;
        if (rc == CLOVER_OK)
            rc = clover_prefill_select(c, d->block, B, 1, d->gops, d->gstart, sp, d->sel_k, d->cand, d->conf, d->tops,
                                       d->gtotal, d->sel_total ? d->logits : NULL, err, err_size);
    } else {
        const int chunked = c->gdn_chunked;
        c->gdn_chunked = 0;
        rc = clover_prefill(c, d->block, B, d->logits, 1, err, err_size);
        c->gdn_chunked = chunked;
    }
    if (rc) return rc;
    d->st.n_forward_verify++;
    int32_t acc = 0, next = -1;
    for (int32_t i = 0; i < B; i++) {
        if (i > 0 && is_end(d, d->block[i])) break; /* accepted up to an end token: nothing follows */
        /* a_i predicts slot i + 1 after block[0..i] (spec 5.4 history as ar would have it) */
        if (allowed && (rc = constraint_mask(d, err, err_size))) return rc;
        const float *row = d->logits + (int64_t)i * V;
        const int32_t a = !gpu || B > CLOVER_SELECT_MAX_ROWS ? sample_slot(d, row, i + 1, d->block, NULL, i + 1, allowed, NULL)
                          : d->sel_k                         ? top_draw(d, i, NULL)
                                                             : d->cand[i];
        if (i + 1 < B && d->block[i + 1] == a) {
            if (allowed && (rc = constraint_accept(d, a, err, err_size))) return rc;
            if (d->rec) lp_make(d, row, a, &d->rec[i + 1]);
            acc++;
            continue;
        }
        if (d->rec) lp_make(d, row, a, &d->seed_rec);
        next = a;
        break;
    }
    d->st.accept_hist[acc < CLOVER_ACCEPT_HIST - 1 ? acc : CLOVER_ACCEPT_HIST - 1]++;
    rc = clover_context_rollback(c, acc + 1, err, err_size);
    if (rc) return rc;
    *n_out = emit_until_end(d, d->block, acc + 1, out);
    d->st.n_blocks++;
    if (d->done) return 0;
    d->seed_tok = next;
    d->have_seed = 1;
    return 1;
}

int clover_decoder_step(clover_decoder *d, int32_t *out, int32_t cap, int32_t *n_out, char *err,
                        size_t err_size) {
    if (!d || !out || !n_out) return clover_set_err(err, err_size, CLOVER_E_ARG, "decoder, out or n_out is NULL");
    *n_out = 0;
    d->n_rec = 0;
    if (d->done) return 0;
    int32_t need = d->p.mode == CLOVER_MODE_AR ? 1 : d->p.block_size;
    if (cap < need) return clover_set_err(err, err_size, CLOVER_E_ARG, "cap: %d < %d tokens per step", cap, need);
    int rc = d->p.mode == CLOVER_MODE_AR    ? step_ar(d, out, n_out, err, err_size)
             : d->p.mode == CLOVER_MODE_SPEC ? step_spec(d, out, n_out, err, err_size)
                                             : step_diffusion(d, out, n_out, err, err_size);
    if (rc < 0) d->done = 1;
    if (d->p.mode != CLOVER_MODE_DIFFUSION) d->n_rec = *n_out; /* rec[k]: out[k]'s (diffusion: stream_block) */
    return rc;
}

int32_t clover_decoder_logprobs(const clover_decoder *d, float *logprob, int32_t *top_ids, float *top_logprobs,
                                int32_t cap) {
    if (!d || !d->rec || !logprob || d->n_rec > cap) return 0;
    const int32_t n = d->p.logprobs;
    if (n > 0 && (!top_ids || !top_logprobs)) return 0;
    for (int32_t k = 0; k < d->n_rec; k++) {
        logprob[k] = d->rec[k].lp;
        for (int32_t i = 0; i < n; i++) {
            top_ids[(int64_t)k * n + i] = d->rec[k].id[i];
            top_logprobs[(int64_t)k * n + i] = d->rec[k].top[i];
        }
    }
    return d->n_rec;
}

int32_t clover_decoder_block(const clover_decoder *d, int32_t *tokens, uint8_t *filled, int32_t cap) {
    if (!d || !tokens || !filled || !d->in_block || d->p.mode != CLOVER_MODE_DIFFUSION) return 0;
    const int32_t B = d->p.block_size;
    if (cap < B) return 0;
    memcpy(tokens, d->block, sizeof(int32_t) * (size_t)B);
    for (int32_t j = 0; j < B; j++) filled[j] = d->filled[j] != 0;
    return B;
}

/* The statistics so far; n_generated also counts the slots of an unfinished block already
 * handed out (a caller that stops mid-block, e.g. on a stop string, has emitted them). */
void clover_decoder_stats(const clover_decoder *d, clover_stats *out) {
    if (!d || !out) return;
    *out = d->st;
    if (d->in_block) out->n_generated += d->n_streamed - d->n_fixed;
}
