/* attention.c: the gated attention layer (clover-spec 2.2) on the CPU path: Q (with its output
 * gate), K, V products, per-head RMS norms and RoPE (NeoX), the KV cache write, attention over
 * the cache (cpu/attend.c, or gpu_attention for an offloaded layer) and the output product.
 * Twin: gpu/attention_resident.c (the same steps on the device, resident forward). */
#include "model/attention.h"
#include "cpu/attend.h"
#include "cpu/kernels.h"
#include "gpu/device_state.h"
#include "quant/dot.h"
#include "quant/quants.h"

#include <stdlib.h>

/* The largest divisor of n (> 0) that is at most cap, and at least 1. */
static int64_t divisor_at_most(int64_t n, int64_t cap) {
    for (int64_t d = cap < n ? cap : n; d > 1; d--)
        if (n % d == 0) return d;
    return 1;
}

/* One entry's attention (f: its context, rows and positions) after the Q, K, V products: per-head
 * norms and RoPE, its KV cache write, attention over its cache into att; lc: the pass's context
 * (threads, thread scratch). */
static int attend_entry(fwd *f, clover_context *lc, const clover_layer *ly, float *qg, float *k, const float *v,
                        float *att) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, nh = hp->n_head, nkv = hp->n_head_kv, hd = hp->head_dim;
    const int64_t kvd = nkv * hd, group = nh / nkv;
    const size_t ek = kv_elem_bytes(c->type_k), ev = kv_elem_bytes(c->type_v);
    char *kc = (char *)c->k_cache + ek * (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd;
    char *vc = (char *)c->v_cache + ev * (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd;
    for (int64_t t = 0; t < T; t++) {
        int64_t pos = f->pos0 + t;
        for (int64_t h = 0; h < nh; h++) {
            float *q = qg + (t * nh + h) * 2 * hd;
            rmsnorm(q, q, ly->q_norm, hd, hp->rms_eps);
            rope_neox(q, pos, hp->rope_dim, hp->rope_theta);
        }
        for (int64_t h = 0; h < nkv; h++) {
            float *kh = k + t * kvd + h * hd;
            rmsnorm(kh, kh, ly->k_norm, hd, hp->rms_eps);
            rope_neox(kh, pos, hp->rope_dim, hp->rope_theta);
        }
        /* Block mode writes the block's K/V past n_past only as scratch: n_past does not move,
         * so the cache is unchanged for every later call (spec 3.2). */
        clover_from_f32(c->type_k, k + t * kvd, kc + ek * (size_t)(pos * kvd), kvd); /* F16: nearest even */
        clover_from_f32(c->type_v, v + t * kvd, vc + ev * (size_t)(pos * kvd), kvd);
    }
    const float scale = 1.0f / sqrtf((float)hd);
    if (ly->wo.dev && hd % 32 == 0 && hd <= 256 && nh <= 65535 && nh % nkv == 0) /* on the GPU: attention too */
        return gpu_attention(f, ly, qg, scale, att);
    if (c->kv_dev_rows && c->kv_dev_rows[ly->slot] > f->pos0) c->kv_dev_rows[ly->slot] = f->pos0; /* stale there */
    const int64_t n_keys_max = f->pos0 + T;
    const kv_view kv = {kc, vc, kvd, c->type_k == CLOVER_TYPE_F16 ? clover_dot_f16_kernel(-1) : NULL,
                        c->type_v == CLOVER_TYPE_F16 ? clover_axpy_f16_kernel(-1) : NULL, clover_dot_f32_kernel(-1),
                        clover_axpy_f32_kernel(-1), c->type_k == CLOVER_TYPE_F16 ? NULL : clover_dot_f32x4_kernel(),
                        c->type_v == CLOVER_TYPE_F16 ? NULL : clover_axpy_f32_rows_kernel(),
                        c->type_k == CLOVER_TYPE_F16 ? clover_dot_f16x4_kernel() : NULL,
                        c->type_v == CLOVER_TYPE_F16 ? clover_axpy_f16_rows_kernel() : NULL};
    const att_job job = {qg, att, nh, hd, 0, f->pos0, n_keys_max, f->mode == MODE_PREFIX, scale};
    /* work items: (KV head, tile of R rows, chunk of hc of its group's heads, hc dividing the
     * group); the tiles' score scratch within ATT_SCRATCH floats a thread where it can, and
     * enough items for the threads */
    const int64_t budget = ATT_SCRATCH, want = lc->n_threads > 1 ? 4 * (int64_t)lc->n_threads : 1;
    int64_t R = T < ATT_ROWS ? T : ATT_ROWS, hc = divisor_at_most(group, budget / n_keys_max);
    while (R > 1 && R * hc * n_keys_max > budget) R = (R + 1) / 2;
    while (R > 1 && nkv * ((T + R - 1) / R) * (group / hc) < want) R = (R + 1) / 2;
    const int64_t fed = group * nkv * T / want; /* the largest chunk giving want items at R = 1 */
    if (nkv * T * (group / hc) < want) hc = divisor_at_most(group, hc < fed ? hc : fed);
    const int64_t n_tiles = (T + R - 1) / R, n_chunks = group / hc, n_items = nkv * n_tiles * n_chunks;
    /* per thread: the row sums (R * hc doubles), then the scores (R * hc * n_keys_max floats) */
    size_t stride = 0;
    char *ts = thread_scratch(lc, R * hc * (2 + n_keys_max), sizeof(float), &stride);
    if (!ts) return CLOVER_E_NOMEM;
#ifdef _OPENMP
#pragma omp parallel num_threads(lc->n_threads) if (lc->n_threads > 1 && T * nh * n_keys_max * hd >= 65536)
#endif
    {
        const unsigned csr = flush_subnormals_begin(); /* weights exp(s - max) of far keys: subnormal */
        double *sum = (double *)(ts + (size_t)thread_index() * stride);
        float *sc = (float *)(sum + R * hc);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < n_items; it++) { /* the last rows (most keys) first */
            const int64_t r = n_tiles - 1 - it / (nkv * n_chunks), g = it / n_chunks % nkv, ch = it % n_chunks;
            const int64_t t0 = r * R, nt = T - t0 < R ? T - t0 : R;
            att_job a = job;
            a.off = g * hd;
            attend_tile(&a, &kv, t0, nt, g * group + ch * hc, hc, sc, sum);
        }
        flush_subnormals_end(csr);
    }
    return CLOVER_OK;
}

int attention_layer(fwd *L, pass_entry *e, int n, const clover_layer *ly, const float *xn, float *out) {
    clover_context *lc = L->c;
    const clover_hparams *hp = &lc->m->hp;
    const int64_t T = L->T, nh = hp->n_head, kvd = hp->n_head_kv * hp->head_dim, hd = hp->head_dim;
    scratch_plan sp = {0};
    const int iqg = scratch_add(&sp, T * nh * 2 * hd, sizeof(float)), ik = scratch_add(&sp, T * kvd, sizeof(float));
    const int iv = scratch_add(&sp, T * kvd, sizeof(float)), iatt = scratch_add(&sp, T * nh * hd, sizeof(float));
    char *base = scratch_carve(lc, SCRATCH_LAYER, &sp);
    float *qg = scratch_part(base, &sp, iqg), *k = scratch_part(base, &sp, ik), *v = scratch_part(base, &sp, iv);
    float *att = scratch_part(base, &sp, iatt);
    if (!qg || !k || !v || !att) return CLOVER_E_NOMEM;
    if (matmul(L, &ly->wq, xn, T, qg) || matmul(L, &ly->wk, xn, T, k) || matmul(L, &ly->wv, xn, T, v))
        return CLOVER_E_NOMEM;
    int64_t r = 0; /* the entry's first row in the pass */
    for (int i = 0; i < n; r += e[i++].f.T) {
        const int rc = attend_entry(&e[i].f, lc, ly, qg + r * nh * 2 * hd, k + r * kvd, v + r * kvd, att + r * nh * hd);
        if (rc != CLOVER_OK) return rc;
    }
    return matmul(L, &ly->wo, att, T, out) ? CLOVER_E_NOMEM : CLOVER_OK;
}
