/* pass.c: the helpers of a forward pass shared by the CPU loop (model/forward.c) and its
 * GPU-resident twin (gpu/forward_resident.c): weight products, expert views, token, abort and
 * finiteness checks, the embedding rows (clover-spec 5.1, 5.6). */
#include "model/pass.h"
#include "cpu/kernels.h"
#include "quant/matmul.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* y = W x for T rows, on the GPU when W was offloaded (clover_model_offload; its error message
 * into err, when given), else on the CPU with n_threads. CLOVER_OK, or the failure's code
 * (CLOVER_E_NOMEM on the CPU). */
int wmatmul(const clover_tensor *w, const float *x, int64_t T, float *y, int n_threads, char *err,
                   size_t err_size) {
    if (w->dev) return clover_cuda_matmul(w->type, w->dev, w->ne[0], w->ne[1], x, T, y, err, err_size);
    return clover_matmul(w->type, w->data, w->ne[0], w->ne[1], x, T, y, n_threads) ? CLOVER_E_NOMEM : CLOVER_OK;
}

/* Expert e of a 3-D expert tensor as a 2-D view. */
clover_tensor expert_view(const clover_tensor *w, int64_t e) {
    clover_tensor v = *w;
    int64_t row = clover_row_nbytes(w->type, w->ne[0]);
    v.data = (const char *)w->data + (size_t)(e * w->ne[1] * row);
    if (w->dev) v.dev = (char *)w->dev + (size_t)(e * w->ne[1] * row);
    v.ne[2] = 1;
    return v;
}
/* wmatmul with the context's threads: 0, or non-zero when it failed; a product on the GPU that
 * fails leaves its code in f->gpu_rc and the CUDA error in f->err, which cpu_forward reports
 * instead of its generic out-of-memory code and message. */
int matmul(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y) {
    const int rc = wmatmul(w, x, T, y, f->c->n_threads, f->err, f->err_size);
    if (rc != CLOVER_OK && w->dev) f->gpu_rc = rc;
    return rc;
}

/* A device tensor as clover_cuda_experts takes it (expert matrices stride bytes apart). */
clover_cuda_weight cuda_weight(const clover_tensor *w) {
    const clover_cuda_weight cw = {w->type, w->dev, w->ne[0], w->ne[1], clover_row_nbytes(w->type, w->ne[0]) * w->ne[1]};
    return cw;
}

int check_tokens(const clover_model *m, const int32_t *tokens, int32_t n, char *err, size_t err_size) {
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->hp.n_vocab)
            return clover_set_err(err, err_size, CLOVER_E_ARG, "tokens[%d]: id %d outside [0, %d)", i, tokens[i],
                                  m->hp.n_vocab);
    return CLOVER_OK;
}

/* A clover_context_abort request, checked between layers (on this thread, outside the OpenMP
 * regions inside them): consume it and return CLOVER_E_ABORTED, else CLOVER_OK. */
int check_abort(fwd *f, int il) {
    clover_context *c = f->c;
    const int n_layer = c->m->hp.n_layer;
    if (!atomic_load_explicit(&c->abort_req, memory_order_relaxed) || !atomic_exchange(&c->abort_req, 0))
        return CLOVER_OK;
    if (il < n_layer)
        return clover_set_err(f->err, f->err_size, CLOVER_E_ABORTED, "aborted by clover_context_abort before layer "
                              "%d of %d (%lld rows)", il, n_layer, (long long)f->T);
    return clover_set_err(f->err, f->err_size, CLOVER_E_ABORTED, "aborted by clover_context_abort before the LM head "
                          "(%lld rows)", (long long)f->T);
}

/* CLOVER_E_NUMERIC naming `what` of layer il when one of the n values at x is NaN or Inf (a broken
 * weight or an overflow: generation must stop rather than emit garbage), else CLOVER_OK. */
int check_finite(fwd *f, const float *x, int64_t n, int il, const char *what) {
    int64_t i = 0;
    while (i < n && isfinite(x[i])) i++;
    if (i == n) return CLOVER_OK;
    const int64_t H = f->c->m->hp.n_embd;
    if (il < 0)
        return clover_set_err(f->err, f->err_size, CLOVER_E_NUMERIC, "non-finite logit (%g) from the LM head "
                              "(output.weight), row %lld", x[i], (long long)(i / f->c->m->hp.n_vocab));
    return clover_set_err(f->err, f->err_size, CLOVER_E_NUMERIC, "non-finite value (%g) after layer %d (blk.%d) %s, "
                          "row %lld of %lld", x[i], il, il, what, (long long)(i / H), (long long)f->T);
}

/* Part offsets in order, each rounded up to 64 bytes; an overflow marks the plan unusable. */
int scratch_add(scratch_plan *p, int64_t count, size_t elem) {
    size_t bytes, end;
    const int i = p->n < SCRATCH_PARTS ? p->n++ : (p->overflow = 1, SCRATCH_PARTS - 1);
    if (count < 0 || __builtin_mul_overflow((size_t)count, elem, &bytes) || __builtin_add_overflow(bytes, 63, &bytes) ||
        __builtin_add_overflow(p->total, bytes & ~(size_t)63, &end))
        p->overflow = 1;
    else
        p->off[i] = p->total, p->total = end;
    return i;
}

void *thread_scratch(clover_context *c, int64_t per, size_t elem, size_t *stride) {
    scratch_plan p = {0};
    scratch_add(&p, per, elem); /* one block, rounded up to 64 bytes: the stride */
    *stride = p.total;
    scratch_plan all = {0};
    scratch_add(&all, c->n_threads > 0 ? c->n_threads : 1, p.total);
    return p.overflow ? NULL : scratch_carve(c, SCRATCH_THREADS, &all);
}

/* Grow the slot to the plan's total when needed (the old contents are not kept: every user
 * writes its parts before it reads them) and return its base. */
char *scratch_carve(clover_context *c, int slot, const scratch_plan *p) {
    if (p->overflow) return NULL;
    if (p->total > c->scratch[slot].cap || !c->scratch[slot].p) {
        free(c->scratch[slot].p);
        c->scratch[slot].p = malloc(p->total ? p->total : 1);
        c->scratch[slot].cap = c->scratch[slot].p ? p->total : 0;
    }
    return c->scratch[slot].p;
}

void embed_rows(const fwd *f, float *x) {
    const embed_req *e = f->ereq;
    const clover_model *m = f->c->m;
    const int64_t H = m->hp.n_embd;
    for (int64_t t = 0; t < f->T; t++) {
        const int64_t p = f->pos0 + t; /* the token's index */
        float *row = x + t * H;
        if (e->pooling == CLOVER_POOLING_LAST && p != e->n - 1) continue;
        rmsnorm(row, row, m->output_norm, H, m->hp.rms_eps);
        if (e->pooling == CLOVER_POOLING_MEAN)
            for (int64_t i = 0; i < H; i++) e->sum[i] += row[i];
        else
            memcpy(e->out + (e->pooling == CLOVER_POOLING_NONE ? p * H : 0), row, sizeof(float) * (size_t)H);
    }
}

/* Rows of the next pass of a split prefill with `left` rows to go and passes of at most max_rows
 * (a multiple of CLOVER_GDN_CHUNK): max_rows, one chunk less when the rest would be a chunk or
 * shorter (it would run the GDN recurrence, gpu_gdn_forward, where one pass runs the chunked
 * form); with max_rows a single chunk, a rest of one row joins the pass (a 1-row pass on the CPU
 * runs the recurrence). */
int64_t pass_rows(int64_t left, int64_t max_rows) {
    if (left <= max_rows) return left;
    if (left - max_rows > CLOVER_GDN_CHUNK) return max_rows;
    if (max_rows > CLOVER_GDN_CHUNK) return max_rows - CLOVER_GDN_CHUNK;
    return left - max_rows >= 2 ? max_rows : left;
}

pass_entry pass_chunk(const pass_entry *w, int64_t r0, int64_t n) {
    pass_entry g = *w;
    const int64_t V = w->f.c->m->hp.n_vocab;
    g.f.T = n;
    g.f.pos0 = w->f.pos0 + r0;
    g.tokens = w->tokens + r0;
    const int with_logits = w->logits && w->logit_row0 < r0 + n;
    g.logit_row0 = w->logit_row0 > r0 ? w->logit_row0 - r0 : 0; /* the chunk's first logits row */
    g.logits = with_logits ? w->logits + (r0 + g.logit_row0 - w->logit_row0) * V : NULL;
    g.rows = NULL;
    return g;
}
