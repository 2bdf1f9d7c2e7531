/* forward.c: the forward pass (clover-spec 2: embed -> per layer rmsnorm, mixer (attention or
 * Gated DeltaNet), residual, rmsnorm, MoE, residual -> N1p -> LM head) in prefix mode (spec 5.1)
 * and block mode (spec 3.2), on the CPU path (products on the GPU where offloaded), and the
 * public prefill and block-forward entry points.
 * Twin: gpu/forward_resident.c (the same layer loop on the device, resident models). */
#include "model/forward.h"
#include "cpu/kernels.h"
#include "gpu/forward_resident.h"
#include "gpu/resident_ops.h"
#include "model/attention.h"
#include "model/batch.h"
#include "model/gdn.h"
#include "model/load.h"
#include "model/moe.h"
#include "quant/matmul.h"
#include "quant/quants.h"

#include <stdlib.h>
#include <string.h>

/* Rows of one prefill pass on the CPU path (CPU_ROWS; PASS_ROWS_GPU where some weights are on
 * the GPU, whose per-product scratch grows with the rows), as llama.cpp's n_batch: a long
 * prompt's activations, attention and expert buffers stay bounded. */
enum { CPU_ROWS = 2048, PASS_ROWS_GPU = RES_ROWS };

/* Whether entry e computes logits for its row t (pass_entry). */
static int wants_logits(const pass_entry *e, int64_t t) {
    return e->logits && (e->rows ? e->rows[t] != 0 : t >= e->logit_row0);
}

/* The LM head of a pass's entries (x: the final residual [T][n_embd], xn: scratch): N1p and the
 * product on the rows that want logits, each entry's rows written where its pass_entry says and
 * checked; one entry without a row mask writes its rows in place. */
static void lm_head(fwd *L, pass_entry *e, int n, float *x, float *xn) {
    clover_context *lc = L->c;
    const clover_model *m = lc->m;
    const clover_hparams *hp = &m->hp;
    const int64_t H = hp->n_embd, V = hp->n_vocab;
    if (n == 1 && !e[0].rows) {
        const int64_t r0 = e[0].logit_row0, T = e[0].f.T;
        for (int64_t t = r0; t < T; t++) rmsnorm(xn + t * H, x + t * H, m->output_norm, H, hp->rms_eps);
        int rc = matmul(L, &m->output, xn + r0 * H, T - r0, e[0].logits) ? CLOVER_E_NOMEM : CLOVER_OK;
        if (rc == CLOVER_OK) rc = check_finite(L, e[0].logits, (T - r0) * V, -1, NULL);
        e[0].rc = rc;
        return;
    }
    int64_t rows = 0; /* gather the needed rows, one LM head pass, scatter */
    for (int i = 0, r = 0; i < n; r += e[i++].f.T)
        for (int64_t t = 0; t < e[i].f.T; t++)
            if (e[i].rc == CLOVER_OK && wants_logits(&e[i], t))
                rmsnorm(xn + rows++ * H, x + (r + t) * H, m->output_norm, H, hp->rms_eps);
    scratch_plan lp = {0};
    const int ilg = scratch_add(&lp, rows * V, sizeof(float));
    float *lg = rows ? scratch_part(scratch_carve(lc, SCRATCH_LAYER, &lp), &lp, ilg) : NULL;
    const int rc = rows && (!lg || matmul(L, &m->output, xn, rows, lg)) ? CLOVER_E_NOMEM : CLOVER_OK;
    for (int i = 0, q = 0; i < n; i++) {
        pass_entry *p = &e[i];
        const int64_t q0 = q;
        for (int64_t t = 0; t < p->f.T && p->rc == CLOVER_OK; t++)
            if (wants_logits(p, t)) {
                if (rc == CLOVER_OK)
                    memcpy(p->logits + (p->rows ? t : t - p->logit_row0) * V, lg + q * V, sizeof(float) * (size_t)V);
                q++;
            }
        if (p->rc == CLOVER_OK) p->rc = rc != CLOVER_OK ? rc : check_finite(&p->f, lg + q0 * V, (q - q0) * V, -1, NULL);
    }
}

/* Entries still running (rc CLOVER_OK); each pending clover_context_abort consumed (before layer
 * il; n_layer: before the LM head). */
static int alive(pass_entry *e, int n, int il) {
    int k = 0;
    for (int i = 0; i < n; i++) {
        if (e[i].rc == CLOVER_OK) e[i].rc = check_abort(&e[i].f, il);
        k += e[i].rc == CLOVER_OK;
    }
    return k;
}

/* Each running entry's rows of x checked finite after `what` of layer il. */
static void check_rows(pass_entry *e, int n, const float *x, int64_t H, int il, const char *what) {
    for (int i = 0, r = 0; i < n; r += e[i++].f.T)
        if (e[i].rc == CLOVER_OK) e[i].rc = check_finite(&e[i].f, x + r * H, e[i].f.T * H, il, what);
}

/* One forward pass on the CPU path (products on the GPU where offloaded, one entry) of the rows
 * of entries e[0..n), one after another: embed -> layers -> N1p -> lm_head on the rows each
 * entry asks for (pass_entry), every entry's outcome in its rc. lc: the context whose threads
 * and scratch the pass uses (an entry alone: its own). Every row is computed alone but for its
 * own context's attention and GDN state, so an entry's results do not depend on the others. */
static void cpu_forward(pass_entry *e, int n, clover_context *lc) {
    const clover_model *m = lc->m;
    const clover_hparams *hp = &m->hp;
    fwd lead = e[0].f, *L = n == 1 ? &e[0].f : &lead; /* the products' pass: all rows */
    int64_t T = 0;
    for (int i = 0; i < n; i++) T += e[i].f.T, e[i].rc = CLOVER_OK;
    lead.c = lc, lead.T = T, lead.mode = MODE_PREFIX, lead.n_experts_out = NULL;
    const int64_t H = hp->n_embd;
    scratch_plan sp = {0};
    const int ix = scratch_add(&sp, T * H, sizeof(float)), ixn = scratch_add(&sp, T * H, sizeof(float));
    const int io = scratch_add(&sp, T * H, sizeof(float));
    char *base = scratch_carve(lc, SCRATCH_PASS, &sp);
    float *x = scratch_part(base, &sp, ix), *xn = scratch_part(base, &sp, ixn), *o = scratch_part(base, &sp, io);
    int rc = CLOVER_E_NOMEM;
    L->gpu_rc = 0; /* a step that fails may say why (the GPU's products) */
    for (int i = 0; i < n; i++)
        if (e[i].f.err && e[i].f.err_size) e[i].f.err[0] = '\0';
    if (!x || !xn || !o) goto done;
    const int64_t erow = clover_row_nbytes(m->tok_embd.type, H);
    for (int i = 0, r = 0; i < n; r += e[i++].f.T)
        for (int64_t t = 0; t < e[i].f.T; t++)
            clover_to_f32(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)e[i].tokens[t] * erow,
                          x + (r + t) * H, H);
    rc = CLOVER_OK;
    for (int il = 0; il < hp->n_layer && alive(e, n, il); il++) {
        const clover_layer *ly = &m->layers[il];
        for (int64_t t = 0; t < T; t++) rmsnorm(xn + t * H, x + t * H, ly->attn_norm, H, hp->rms_eps);
        rc = ly->is_attn ? attention_layer(L, e, n, ly, xn, o) : gdn_layer(L, e, n, ly, xn, o);
        if (rc) goto done;
        for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
        check_rows(e, n, x, H, il, ly->is_attn ? "attention" : "gated deltanet");
        for (int64_t t = 0; t < T; t++) rmsnorm(xn + t * H, x + t * H, ly->post_norm, H, hp->rms_eps);
        if ((rc = moe_layer(L, e, n, ly, il, xn, o))) goto done;
        for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
        check_rows(e, n, x, H, il, "moe");
    }
    if (n == 1 && e[0].rc == CLOVER_OK && e[0].f.ereq) embed_rows(&e[0].f, x); /* an embedding pass: no logits */
    int with_logits = 0;
    for (int i = 0; i < n; i++) with_logits |= e[i].logits != NULL;
    if (with_logits && alive(e, n, hp->n_layer)) lm_head(L, e, n, x, xn);
done:
    for (int i = 0; i < n; i++) {
        fwd *f = &e[i].f;
        if (rc != CLOVER_OK && e[i].rc == CLOVER_OK) e[i].rc = rc;
        if (e[i].rc == CLOVER_E_NOMEM && L->gpu_rc) e[i].rc = L->gpu_rc;
        if (e[i].rc == CLOVER_E_NOMEM && !(f->err && f->err_size && f->err[0]))
            clover_set_err(f->err, f->err_size, CLOVER_E_NOMEM, "out of memory in forward (%lld rows)", (long long)T);
    }
}

/* An entry's forward alone, as clover_prefill and clover_block_forward run it: embed -> layers ->
 * N1p -> lm_head, with the context's n_threads_1 threads for one row, else n_threads_batch. Block
 * passes run whole; a prefill (causal, so consecutive passes equal one) in passes of pass_rows:
 * at most the context's n_ubatch rows (not a clover_prefill_select, whose at most
 * CLOVER_SELECT_MAX_ROWS rows select in one pass), and RES_ROWS rows on a resident model (its
 * verify record from row r0 of each), CPU_ROWS or PASS_ROWS_GPU on the CPU path (one pass while
 * recording: the record starts at row 0). */
static int forward_alone(pass_entry *w) {
    fwd *f = &w->f;
    clover_context *c = f->c;
    if (c->m->gpu_bytes) gpu_context_count(c); /* its first launches: count it (CUDA graphs) */
    c->n_threads = f->T == 1 ? c->n_threads_1 : c->n_threads_batch; /* llama.cpp's rule */
    const int res = c->m->resident;
    int64_t max_rows = res ? RES_ROWS : c->m->gpu_bytes ? PASS_ROWS_GPU : CPU_ROWS;
    if (c->n_ubatch > 0 && c->n_ubatch < max_rows && !f->sreq) max_rows = c->n_ubatch; /* a selection: one pass */
    if (f->mode == MODE_BLOCK || f->T <= max_rows || (!res && c->rec_on)) {
        c->n_passes++;
        if (res) return w->rc = res_forward(f, w->tokens, 0, w->logits, w->logit_row0, w->rows);
        cpu_forward(w, 1, c);
        return w->rc;
    }
    int rc = CLOVER_OK;
    for (int64_t r0 = 0, n = 0; r0 < f->T && rc == CLOVER_OK; r0 += n) {
        n = pass_rows(f->T - r0, max_rows);
        pass_entry g = pass_chunk(w, r0, n);
        c->n_passes++;
        if (res) {
            rc = res_forward(&g.f, g.tokens, r0, g.logits, g.logit_row0, NULL);
        } else {
            cpu_forward(&g, 1, c);
            rc = g.rc;
        }
    }
    return w->rc = rc;
}

/* A batched pass (pass_fn): an entry alone as forward_alone runs it, else one cpu_forward of all
 * with lead's n_threads_batch threads. */
static void batched_pass(pass_entry *e, int n, clover_context *lead) {
    if (n == 1) {
        forward_alone(&e[0]);
        return;
    }
    lead->n_threads = lead->n_threads_batch;
    for (int i = 0; i < n; i++) e[i].f.c->n_passes++;
    cpu_forward(e, n, lead);
}

/* A forward of context f->c (tokens, logits rows as pass_entry says): through its batch when it
 * is attached to one (model/batch.c), else alone. */
static int forward(fwd *f, const int32_t *tokens, float *logits, int64_t logit_row0, const uint8_t *rows) {
    pass_entry w = {*f, tokens, logits, logit_row0, rows, CLOVER_OK};
    if (f->c->batch) return batch_forward(f->c->batch, &w, batched_pass);
    return forward_alone(&w);
}

/* A selection request's model and outputs: resident, and id and conf (k 0) or cand (k > 0). */
static int check_select(const clover_context *c, const clover_sampler_params *sp, int32_t k, const int32_t *id,
                        const float *conf, const clover_cand *cand, const char *what, char *err, size_t err_size) {
    if (!c->m->resident)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "%s: the model's forwards are not resident on the GPU", what);
    const int32_t ids = clover_cand_ids(c->m->hp.n_vocab, sp->mask_token_id);
    if (k < 0 || k > CLOVER_CUDA_TOP_K_MAX || k > ids || (k == 0 && sp->temperature > 0.0f))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "k: %d candidates at temperature %g: needs 0 (temperature "
                              "0) or [1, %d] and at most the %d ids other than the mask (%s)", k, sp->temperature,
                              (int)CLOVER_CUDA_TOP_K_MAX, ids, what);
    if (k ? !cand : !id || !conf) return clover_set_err(err, err_size, CLOVER_E_ARG, "%s: NULL output", what);
    return CLOVER_OK;
}

/* A top-p selection's extra outputs (total, full; both or neither): k candidates a row above
 * temperature 0, on at most CLOVER_SELECT_TOTAL_MAX_ROWS rows (n_rows: those the pass selects). */
static int check_total(const clover_sampler_params *sp, int32_t k, const double *total, const float *full,
                       int64_t n_rows, const char *what, char *err, size_t err_size) {
    if (!total && !full) return CLOVER_OK;
    if (!total || !full || k < 1 || !(sp->temperature > 0.0f) || n_rows > CLOVER_SELECT_TOTAL_MAX_ROWS)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "%s: total and logits need each other, k > 0 candidates, "
                              "temperature > 0 and at most %d rows (%lld)", what, (int)CLOVER_SELECT_TOTAL_MAX_ROWS,
                              (long long)n_rows);
    return CLOVER_OK;
}

/* ops_start of a selection request: non-decreasing from 0, empty ranges for the rows not selected
 * (rows[t] == 0; rows NULL: all but the last). */
static int check_ops_start(const int32_t *ops_start, const uint8_t *rows, int32_t n, char *err, size_t err_size) {
    if (n <= 0) return CLOVER_OK;
    if (ops_start[0] != 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "ops_start[0]: %d must be 0", ops_start[0]);
    for (int32_t t = 0; t < n; t++) {
        const int selected = rows ? rows[t] != 0 : t == n - 1;
        if (ops_start[t + 1] < ops_start[t] || (!selected && ops_start[t + 1] != ops_start[t]))
            return clover_set_err(err, err_size, CLOVER_E_ARG, "ops_start[%d]: %d after %d (must not decrease, and "
                                  "rows without selection have no edits)", t + 1, ops_start[t + 1], ops_start[t]);
    }
    return CLOVER_OK;
}

static int prefill(clover_context *c, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits,
                   const select_req *sreq, char *err, size_t err_size) {
    if (!c || !tokens) return clover_set_err(err, err_size, CLOVER_E_ARG, "context or tokens is NULL");
    if (n <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_tokens: %d must be > 0", n);
    if ((int64_t)c->n_past + n > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "n_tokens: %d past %d cached exceeds n_ctx %d", n,
                              c->n_past, c->n_ctx);
    int rc = check_tokens(c->m, tokens, n, err, err_size);
    if (rc) return rc;
    if (c->rec_on && (c->rec_n > 0 || n > c->rec_cap))
        return clover_set_err(err, err_size, CLOVER_E_STATE, "n_tokens: %d, but the checkpoint records one prefill of "
                              "at most %d tokens", n, c->rec_cap);
    fwd f = {c, MODE_PREFIX, n, c->n_past, 1.0f, NULL, err, err_size, sreq, 0, NULL};
    rc = forward(&f, tokens, logits, all_logits ? 0 : n - 1, NULL);
    if (rc == CLOVER_OK) {
        c->n_past += n;
        if (c->rec_on) c->rec_n = n;
    } else {
        clover_context_reset(c); /* caches are partly written: a failed prefill leaves none */
    }
    return rc;
}

/* clover_embed's checks (clover.h): a NULL argument, n, the pooling, out_size. */
static int check_embed(const clover_context *c, const int32_t *tokens, int32_t n, int32_t pooling,
                       const float *out, int64_t out_size, char *err, size_t err_size) {
    if (!c || !tokens || !out) return clover_set_err(err, err_size, CLOVER_E_ARG, "embed: context, tokens or out is NULL");
    if (pooling == CLOVER_POOLING_CLS || pooling == CLOVER_POOLING_RANK)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "pooling: %s (%d) is not supported by a causal decoder "
                              "(no %s); use NONE (0), MEAN (1) or LAST (3)", pooling == CLOVER_POOLING_CLS ? "CLS" : "RANK",
                              pooling, pooling == CLOVER_POOLING_CLS ? "CLS token" : "ranking head");
    if (pooling != CLOVER_POOLING_NONE && pooling != CLOVER_POOLING_MEAN && pooling != CLOVER_POOLING_LAST)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "pooling: %d unknown (NONE 0, MEAN 1, LAST 3)", pooling);
    if (n <= 0 || n > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "n_tokens: %d outside [1, n_ctx %d]", n, c->n_ctx);
    /* n <= INT32_MAX and n_embd <= 2^20: the product fits int64_t */
    const int64_t need = (pooling == CLOVER_POOLING_NONE ? (int64_t)n : 1) * c->m->hp.n_embd;
    if (out_size < need)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "out_size: %lld floats, the pooling writes %lld",
                              (long long)out_size, (long long)need);
    return check_tokens(c->m, tokens, n, err, err_size);
}

int clover_embed(clover_context *c, const int32_t *tokens, int32_t n, int32_t pooling, float *out, int64_t out_size,
                 char *err, size_t err_size) {
    if (c && pooling == CLOVER_POOLING_UNSPECIFIED) pooling = c->m->hp.pooling_type;
    int rc = check_embed(c, tokens, n, pooling, out, out_size, err, err_size);
    if (rc) return rc;
    const int64_t H = c->m->hp.n_embd;
    double *sum = NULL; /* MEAN: the rows' sum */
    if (pooling == CLOVER_POOLING_MEAN) {
        scratch_plan p = {0};
        const int isum = scratch_add(&p, H, sizeof(double));
        if (!(sum = scratch_part(scratch_carve(c, SCRATCH_CALL, &p), &p, isum)))
            return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        memset(sum, 0, sizeof(double) * (size_t)H);
    }
    const embed_req e = {pooling, n, out, sum};
    clover_context_reset(c);
    fwd f = {c, MODE_PREFIX, n, 0, 1.0f, NULL, err, err_size, NULL, 0, &e};
    rc = forward(&f, tokens, NULL, 0, NULL);
    clover_context_reset(c);
    for (int64_t i = 0; rc == CLOVER_OK && sum && i < H; i++) out[i] = (float)(sum[i] / (double)n);
    return rc;
}

int clover_prefill(clover_context *c, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits,
                   char *err, size_t err_size) {
    return prefill(c, tokens, n, logits, all_logits, NULL, err, err_size);
}

int clover_prefill_select(clover_context *c, const int32_t *tokens, int32_t n, int32_t all_rows,
                          const clover_logit_op *ops, const int32_t *ops_start, const clover_sampler_params *sp,
                          int32_t K, int32_t *id, float *conf, clover_cand *cand, double *total, float *logits,
                          char *err, size_t err_size) {
    if (!c || !ops_start || !sp || (n > 0 && ops_start[n] > 0 && !ops))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "prefill_select: NULL argument");
    int rc = check_select(c, sp, K, id, conf, cand, "prefill_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_total(sp, K, total, logits, all_rows ? n : 1, "prefill_select", err, err_size);
    if (rc) return rc;
    if (n <= 0 || n > RES_ROWS)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "n_tokens: %d outside [1, %d] for prefill_select", n,
                              (int)RES_ROWS);
    scratch_plan p = {0};
    const int irows = scratch_add(&p, n, 1), iids = scratch_add(&p, n, sizeof(int32_t));
    const int iconfs = scratch_add(&p, n, sizeof(float)), icands = scratch_add(&p, (int64_t)n * K, sizeof(clover_cand));
    const int itotals = scratch_add(&p, total ? n : 0, sizeof(double));
    char *base = scratch_carve(c, SCRATCH_CALL, &p);
    uint8_t *rows = scratch_part(base, &p, irows);
    int32_t *ids = scratch_part(base, &p, iids);
    float *confs = scratch_part(base, &p, iconfs);
    clover_cand *cands = scratch_part(base, &p, icands);
    double *totals = total ? scratch_part(base, &p, itotals) : NULL;
    rc = base ? CLOVER_OK : clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    for (int32_t t = 0; t < n && rc == CLOVER_OK; t++) rows[t] = all_rows || t == n - 1;
    if (rc == CLOVER_OK) rc = check_ops_start(ops_start, rows, n, err, err_size);
    const int32_t t0 = all_rows ? 0 : n - 1; /* the rows handed back, from row t0 */
    if (rc == CLOVER_OK) {
        const select_req g = {ops, ops_start, sp, K, ids, confs, cands, NULL, totals, logits, t0};
        rc = prefill(c, tokens, n, NULL, all_rows, &g, err, err_size);
    }
    if (rc == CLOVER_OK && K) memcpy(cand, cands + (int64_t)t0 * K, sizeof(clover_cand) * (size_t)(n - t0) * (size_t)K);
    if (rc == CLOVER_OK && total) memcpy(total, totals + t0, sizeof(double) * (size_t)(n - t0));
    for (int32_t t = t0; t < n && rc == CLOVER_OK && !K; t++) id[t - t0] = ids[t], conf[t - t0] = confs[t];
    return rc;
}

static int block_forward(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p, float *logits,
                         const uint8_t *rows, const select_req *sreq, int32_t *n_experts_out, char *err,
                         size_t err_size) {
    if (!c || !tokens) return clover_set_err(err, err_size, CLOVER_E_ARG, "context or tokens is NULL");
    if (!c->m->hp.has_block) return clover_no_block(c->m, "block mode", err, err_size);
    if (B <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "block_size: %d must be > 0", B);
    if (!(coreset_top_p > 0.0f && coreset_top_p <= 1.0f))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "coreset_top_p: %g outside (0, 1]", coreset_top_p);
    if ((int64_t)c->n_past + B > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "block_size: %d past %d cached exceeds n_ctx %d", B,
                              c->n_past, c->n_ctx);
    int rc = check_tokens(c->m, tokens, B, err, err_size);
    if (rc) return rc;
    fwd f = {c, MODE_BLOCK, B, c->n_past, coreset_top_p, n_experts_out, err, err_size, sreq, 0, NULL};
    return forward(&f, tokens, logits, 0, rows);
}

int clover_block_forward_rows(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p,
                              float *logits, const uint8_t *rows, int32_t *n_experts_out, char *err,
                              size_t err_size) {
    return block_forward(c, tokens, B, coreset_top_p, logits, rows, NULL, n_experts_out, err, err_size);
}

int clover_block_forward_select(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p,
                                const uint8_t *rows, const clover_logit_op *ops, const int32_t *ops_start,
                                const clover_sampler_params *sp, int32_t k, int32_t *id, float *conf,
                                clover_cand *cand, float *pre, double *total, float *logits, int32_t *n_experts_out,
                                char *err, size_t err_size) {
    if (!c || !rows || !ops_start || !sp || (!ops && B > 0 && ops_start[B] > 0))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "block_forward_select: NULL argument");
    int rc = check_select(c, sp, k, id, conf, cand, "block_forward_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_total(sp, k, total, logits, B, "block_forward_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_ops_start(ops_start, rows, B, err, err_size);
    if (rc) return rc;
    const select_req g = {ops, ops_start, sp, k, id, conf, cand, pre, total, logits, 0};
    return block_forward(c, tokens, B, coreset_top_p, NULL, rows, &g, n_experts_out, err, err_size);
}

int clover_block_forward(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p, float *logits,
                         int32_t *n_experts_out, char *err, size_t err_size) {
    return clover_block_forward_rows(c, tokens, B, coreset_top_p, logits, NULL, n_experts_out, err, err_size);
}
