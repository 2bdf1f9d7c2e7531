/* resident_ops.c: the layout of a resident pass's device scratch and the weight products on the
 * device (clover_cuda_matmul_d) shared by the resident layers. */
#include "gpu/resident_ops.h"

/* n elements of elem bytes at base + *off (NULL when base is NULL), *off moved past them. */
static void *take(char *base, size_t *off, int64_t n, size_t elem) {
    void *p = base ? base + *off : NULL;
    *off += ((size_t)n * elem + 255) & ~(size_t)255;
    return p;
}

/* The buffers of a pass of T rows laid out from base (NULL: only measured); returns the bytes. */
static size_t res_layout(const clover_model *m, int64_t T, char *base, res_bufs *b) {
    const clover_hparams *hp = &m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t H = hp->n_embd, nh = hp->n_head, hd = hp->head_dim, E = hp->n_expert, P = T * hp->n_expert_used;
    const int64_t vdim = d.Hv * d.dv, Is = hp->n_ff_shexp, LM = T < RES_LM ? T : RES_LM;
    size_t off = 0;
    const size_t F = sizeof(float), I = sizeof(int32_t);
    /* what a pass uploads (res_forward: one copy from x to the end of flags), then what it reads
     * back (res_forward / res_select_read: one copy from flags on) */
    b->x = take(base, &off, T * H, F), b->idx = take(base, &off, T, I), b->gstart = take(base, &off, T + 1, I);
    b->pos = take(base, &off, 1, sizeof(int64_t)), b->flags = take(base, &off, 4 * (int64_t)hp->n_layer, I);
    b->gconf = take(base, &off, T, F), b->gid = take(base, &off, T, I), b->gtotal = take(base, &off, T, sizeof(double));
    b->gcand = take(base, &off, T * CLOVER_CUDA_TOP_K_MAX, sizeof(clover_cand));
    b->xn = take(base, &off, T * H, F), b->o = take(base, &off, T * H, F);
    b->qg = take(base, &off, T * nh * 2 * hd, F), b->att = take(base, &off, T * nh * hd, F);
    b->qkv = take(base, &off, T * d.C, F), b->cv = take(base, &off, T * d.C, F);
    b->z = take(base, &off, T * vdim, F), b->og = take(base, &off, T * vdim, F);
    b->b = take(base, &off, T * d.Hv, F), b->a = take(base, &off, T * d.Hv, F);
    b->probs = take(base, &off, T * E, F), b->wsel = take(base, &off, P, F), b->pw = take(base, &off, P, F);
    b->xg = take(base, &off, P * H, F), b->yg = take(base, &off, P * H, F);
    b->gt = take(base, &off, T * Is, F), b->up = take(base, &off, T * Is, F), b->ys = take(base, &off, T * H, F);
    b->sg = take(base, &off, T, F), b->logits = take(base, &off, LM * hp->n_vocab, F);
    b->sel = take(base, &off, P, I), b->prow = take(base, &off, P, I);
    b->pair = take(base, &off, P, I);
    b->tiles = take(base, &off, 3 * clover_cuda_route_tiles(P, E), I);
    b->kn = take(base, &off, T * hp->n_head_kv * hd, F), b->vn = take(base, &off, T * hp->n_head_kv * hd, F);
    return off;
}

/* The context's device scratch for a pass of T rows (grown when needed). */
int res_workspace(clover_context *c, int64_t T, res_bufs *b, char *err, size_t err_size) {
    const size_t need = res_layout(c->m, T, NULL, b);
    if (need > c->res_cap) {
        clover_cuda_free(c->res_ws);
        c->res_ws = NULL;
        c->res_cap = 0;
        const int rc = clover_cuda_alloc(need, &c->res_ws, err, err_size);
        if (rc != CLOVER_OK) return rc;
        c->res_cap = need;
    }
    res_layout(c->m, T, c->res_ws, b);
    return CLOVER_OK;
}

/* y[i] [T][ne1] = w[i] x on the device for n <= 4 weights on the same input (rounded once). */
int mm_n_d(fwd *f, int n, const clover_tensor *const *w, const float *x, int64_t T, float *const *y) {
    clover_cuda_weight cw[4];
    for (int i = 0; i < n; i++) cw[i] = cuda_weight(w[i]);
    return clover_cuda_matmul_d(n, cw, x, T, y, f->err, f->err_size);
}

/* y [T][ne1] = w x on the device. */
int mm_d(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y) { return mm_n_d(f, 1, &w, x, T, &y); }
