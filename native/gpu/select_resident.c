/* select_resident.c: the LM head with the sampler's selection (clover-spec 5.3-5.4) on the device, resident forward.
 * Twin: decode/sampler.c (the host selection) and model/forward.c cpu_forward's LM head (the same steps on the CPU path). */
#include "gpu/select_resident.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The selection's inputs (clover_block_forward_select): the n needed rows' ranges of edits into
 * start (n + 1, host: res_forward uploads them with the pass's other inputs), and the edits
 * themselves to ops_dev (grown as needed). */
int res_select_upload(fwd *f, const int32_t *idx, int64_t n, int32_t *start) {
    clover_context *c = f->c;
    const select_req *g = f->sreq;
    const int64_t n_ops = g->ops_start[f->T];
    char *err = f->err;
    const size_t es = f->err_size;
    int rc = CLOVER_OK;
    for (int64_t i = 0; i < n; i++) start[i] = g->ops_start[idx[i]];
    start[n] = (int32_t)n_ops;
    if (n_ops > c->ops_cap) { /* doubling from 4096: a graph holds the address (graph_key) */
        const int64_t cap = n_ops > 2048 ? 2 * n_ops : 4096;
        clover_cuda_free(c->ops_dev), clover_cuda_free(c->pre_dev);
        c->ops_dev = c->pre_dev = NULL;
        c->ops_cap = 0;
        if ((rc = clover_cuda_alloc(sizeof(clover_logit_op) * (size_t)cap, &c->ops_dev, err, es)) == CLOVER_OK &&
            (rc = clover_cuda_alloc(sizeof(float) * (size_t)cap, &c->pre_dev, err, es)) == CLOVER_OK)
            c->ops_cap = cap;
    }
    if (rc == CLOVER_OK && n_ops) rc = clover_cuda_write(c->ops_dev, 0, g->ops, sizeof(clover_logit_op) * (size_t)n_ops, err, es);
    return rc;
}

/* res_lm_head with the selection on the GPU, the launches only (res_select_upload before,
 * res_select_read after): per needed row an id and a confidence (k 0) or k candidates, and for
 * top-p alone the row's weight (the edited logits stay in b->logits: n <= RES_LM). */
int res_select_run(fwd *f, const res_bufs *b, int64_t n) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    const select_req *g = f->sreq;
    const clover_sampler_params *sp = g->sp;
    const int64_t H = m->hp.n_embd, K = g->k, V = m->hp.n_vocab;
    const float rp = sp->repetition_penalty, fp = sp->frequency_penalty, pp = sp->presence_penalty;
    int rc = CLOVER_OK;
    for (int64_t g0 = 0; g0 < n && rc == CLOVER_OK; g0 += RES_LM) {
        const int64_t ng = n - g0 < RES_LM ? n - g0 : RES_LM;
        if ((rc = clover_cuda_rmsnorm_d(b->x, H, b->idx + g0, m->output_norm_dev, H, ng, m->hp.rms_eps, b->xn, H, f->err,
                                        f->err_size)) ||
            (rc = mm_d(f, &m->output, b->xn, ng, b->logits)))
            break;
        rc = K ? clover_cuda_top_k_d(b->logits, ng, V, c->ops_dev, b->gstart + g0, rp, fp, pp, sp->mask_token_id,
                                     (int32_t)K, b->gcand + g0 * K, b->gconf + g0, g->pre ? c->pre_dev : NULL, f->err,
                                     f->err_size)
               : clover_cuda_greedy_d(b->logits, ng, V, c->ops_dev, b->gstart + g0, rp, fp, pp, sp->mask_token_id,
                                      b->gid + g0, b->gconf + g0, f->err, f->err_size);
        if (rc == CLOVER_OK && g->total)
            rc = clover_cuda_row_total_d(b->logits, ng, V, sp->mask_token_id, b->gcand + g0 * K, (int32_t)K,
                                         sp->temperature, b->gtotal + g0, f->err, f->err_size);
    }
    return rc;
}

/* The selection's results into the request's id / conf or cand rows (and pre), and the pass's
 * flags ([4 n_layer]) into flags, in one read; rows (when not
 * NULL): only the rows t with rows[t] != 0 are wanted (a graph's pass selects on every row). For
 * top-p alone, a row whose top-p prefix does not end within its candidates gets total 0 and its
 * edited logits from b->logits instead (the CPU sampler then takes the whole row). */
int res_select_read(fwd *f, const res_bufs *b, const int32_t *idx, int64_t n, const uint8_t *rows,
                           int32_t *flags) {
    const select_req *g = f->sreq;
    const int64_t K = g->k, n_ops = g->ops_start[f->T], V = f->c->m->hp.n_vocab, L = f->c->m->hp.n_layer;
    char *err = f->err;
    const size_t es = f->err_size;
    /* one read from flags to the end of the last field needed (res_layout's order) */
    const char *end = K          ? (const char *)(b->gcand + n * K)
                      : g->total ? (const char *)(b->gtotal + n)
                                 : (const char *)(b->gid + n);
    const size_t bytes = (size_t)(end - (const char *)b->flags);
    scratch_plan p = {0};
    scratch_add(&p, (int64_t)bytes, 1);
    char *down = scratch_carve(f->c, SCRATCH_LAYER, &p);
    int rc = down ? CLOVER_OK : clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory");
    if (rc == CLOVER_OK && g->total && n > RES_LM) /* the callers keep to this (CLOVER_SELECT_TOTAL_MAX_ROWS) */
        rc = clover_set_err(err, es, CLOVER_E_ARG, "top-p selection of %lld rows: at most %d", (long long)n, (int)RES_LM);
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->flags, 0, down, bytes, err, es);
#define AT(field, type) ((type *)(down + ((const char *)b->field - (const char *)b->flags)))
    const float *conf = down ? AT(gconf, float) : NULL;
    const int32_t *id = down ? AT(gid, int32_t) : NULL;
    const clover_cand *cand = down && K ? AT(gcand, clover_cand) : NULL;
    const double *total = down && g->total ? AT(gtotal, double) : NULL;
#undef AT
    if (rc == CLOVER_OK) memcpy(flags, down, sizeof(int32_t) * (size_t)(4 * L));
    for (int64_t il = 0; il < L && rc == CLOVER_OK; il++)
        if (flags[2 * il] || flags[2 * il + 1]) { /* a non-finite layer output: res_forward names it */
            return CLOVER_OK;
        }
    if (rc == CLOVER_OK && K && g->pre && n_ops)
        rc = clover_cuda_read(f->c->pre_dev, 0, g->pre, sizeof(float) * (size_t)n_ops, err, es);
    for (int64_t i = 0; i < n && rc == CLOVER_OK; i++) {
        if (rows && !rows[idx[i]]) continue;
        if (!isfinite(conf[i])) /* a NaN or infinite logit: a non-finite softmax sum, or k_top_k's flag */
            rc = clover_set_err(err, es, CLOVER_E_NUMERIC, "non-finite logit from the LM head (output.weight), row "
                                "%lld (on the GPU)", (long long)idx[i]);
        else if (K)
            memcpy(g->cand + (int64_t)idx[i] * K, cand + i * K, sizeof(clover_cand) * (size_t)K);
        else
            g->id[idx[i]] = id[i], g->conf[idx[i]] = conf[i];
        if (rc != CLOVER_OK || !total) continue;
        g->total[idx[i]] = clover_top_p_in_cands(cand + i * K, (int32_t)K, g->sp, total[i]) ? total[i] : 0.0;
        if (g->total[idx[i]] == 0.0) {
            f->c->n_full_rows++;
            rc = clover_cuda_read(b->logits, sizeof(float) * (size_t)(i * V), g->full + (idx[i] - g->full_row0) * V,
                                  sizeof(float) * (size_t)V, err, es);
        }
    }
    return rc;
}
