/* attend.c: attend_tile, softmax(q K^T * scale) V times the output gate for a tile of query rows
 * and heads (clover-spec 2.2 steps 3-4), over an fp16 or float32 KV cache with quant/dot.h's
 * kernels. */
#include "cpu/attend.h"
#include "cpu/kernels.h"
#include "quant/quants.h"

#include <float.h>
#include <string.h>

/* out[i] = q . k_{j+i} * scale for i < 4 (K rows j.. of the cache at offset off; hd values), by
 * the several-key kernel of the cache's K type (kv->dot_k32x4 or kv->dot_k16x4, one of them set). */
static void dot_keys4(const kv_view *kv, const float *q, int64_t j, int64_t off, int64_t hd, float scale, float *out) {
    float s4[4];
    if (kv->dot_k16x4) kv->dot_k16x4(q, (const uint16_t *)kv->k + j * kv->kvd + off, kv->kvd, hd, s4);
    else kv->dot_k32x4(q, (const float *)kv->k + j * kv->kvd + off, kv->kvd, hd, s4);
    for (int i = 0; i < 4; i++) out[i] = s4[i] * scale;
}

/* o += p[i] v_{j0+i} for i < n (V rows j0.. at offset off; hd values), by the several-row kernel of
 * the cache's V type (kv->axpy_v32_rows or kv->axpy_v16_rows, one of them set). */
static void axpy_rows(const kv_view *kv, float *o, const float *p, int64_t j0, int64_t n, int64_t off, int64_t hd) {
    if (kv->axpy_v16_rows) kv->axpy_v16_rows(o, p, (const uint16_t *)kv->v + j0 * kv->kvd + off, kv->kvd, n, hd);
    else kv->axpy_v32_rows(o, p, (const float *)kv->v + j0 * kv->kvd + off, kv->kvd, n, hd);
}

/* Keys of query row t: [0, pos0 + t + 1) when causal (prefix mode), else [0, n_keys_max). */
static inline int64_t row_keys(const att_job *a, int64_t t) { return a->causal ? a->pos0 + t + 1 : a->n_keys_max; }

/* The end of key tile [j0, j0 + ATT_KEY_TILE) for a row with nk keys (j0 when it has none there). */
static inline int64_t tile_end(int64_t j0, int64_t nk) {
    return nk < j0 ? j0 : nk < j0 + ATT_KEY_TILE ? nk : j0 + ATT_KEY_TILE;
}

/* Attention (spec 2.2 steps 3-4) of query rows [t0, t0 + nt) and heads [h0, h0 + nhc) of one
 * GQA group (every head reads the same KV head, at offset off in the cache rows): per (row,
 * head) pair, softmax(q K^T * scale) V over the row's keys, times sigmoid of the head's output
 * gate (stored right after q in qg [T][n_head][2 hd]); out: att [T][n_head][hd]. Row t's keys:
 * [0, pos0 + t + 1) when causal (prefix mode), else [0, n_keys_max) (block mode: pos0 + T).
 * Each pair's arithmetic is fixed whatever the tile: scores in key order, their max, exp and a
 * double sum in key order, then o += p_j v_j in key order, so a row's output does not depend
 * on which rows or heads share its tile (spec mode's verify equals ar's decode bit for bit).
 * The loops over keys run outside those over pairs, ATT_KEY_TILE keys at a time, so each K and
 * V row is read from memory once per tile rather than once per pair (a long prompt's keys do
 * not fit the caches). sc: nt nhc n_keys_max floats; sum: nt nhc doubles. */
CLOVER_CLONES void attend_tile(const att_job *a, const kv_view *kv, int64_t t0, int64_t nt, int64_t h0,
                                      int64_t nhc, float *sc, double *sum) {
    const int64_t hd = a->hd, nv = nt * nhc, ld = a->n_keys_max;
    const size_t ek = kv->dot_k ? 2 : 4, ev = kv->axpy_v ? 2 : 4;
    const int64_t last = row_keys(a, t0 + nt - 1); /* keys of the tile's last row */
    for (int64_t j0 = 0; j0 < last; j0 += ATT_KEY_TILE)
        for (int64_t u = 0; u < nv; u++) {
            const int64_t t = t0 + u / nhc, h = h0 + u % nhc, je = tile_end(j0, row_keys(a, t));
            const float *q = a->qg + (t * a->nh + h) * 2 * hd;
            int64_t j = j0;
            for (; (kv->dot_k32x4 || kv->dot_k16x4) && j + 4 <= je; j += 4)
                dot_keys4(kv, q, j, a->off, hd, a->scale, sc + u * ld + j);
            for (; j < je; j++) {
                const void *kj = kv->k + ek * (size_t)(j * kv->kvd + a->off);
                sc[u * ld + j] = (kv->dot_k ? kv->dot_k(q, kj, hd) : kv->dot_k32(q, kj, hd)) * a->scale;
            }
        }
    for (int64_t u = 0; u < nv; u++) {
        const int64_t t = t0 + u / nhc, nk = row_keys(a, t);
        float *s = sc + u * ld, mx = -FLT_MAX;
        for (int64_t j = 0; j < nk; j++)
            if (s[j] > mx) mx = s[j];
        double z = 0;
        for (int64_t j = 0; j < nk; j++) {
            s[j] = expf(s[j] - mx);
            z += s[j];
        }
        sum[u] = z;
        memset(a->att + (t * a->nh + h0 + u % nhc) * hd, 0, sizeof(float) * (size_t)hd);
    }
    for (int64_t j0 = 0; j0 < last; j0 += ATT_KEY_TILE)
        for (int64_t u = 0; u < nv; u++) {
            const int64_t t = t0 + u / nhc, h = h0 + u % nhc, je = tile_end(j0, row_keys(a, t));
            float *o = a->att + (t * a->nh + h) * hd, *p = sc + u * ld;
            if ((kv->axpy_v32_rows || kv->axpy_v16_rows) && je > j0) { /* the weights in place, one call */
                for (int64_t j = j0; j < je; j++) p[j] = (float)(p[j] / sum[u]);
                axpy_rows(kv, o, p + j0, j0, je - j0, a->off, hd);
                continue;
            }
            for (int64_t j = j0; j < je; j++) {
                const void *vj = kv->v + ev * (size_t)(j * kv->kvd + a->off);
                const float pj = (float)(p[j] / sum[u]);
                if (kv->axpy_v) kv->axpy_v(o, pj, vj, hd);
                else kv->axpy_v32(o, pj, vj, hd);
            }
        }
    for (int64_t u = 0; u < nv; u++) {
        const int64_t t = t0 + u / nhc, h = h0 + u % nhc;
        const float *gate = a->qg + (t * a->nh + h) * 2 * hd + hd;
        float *o = a->att + (t * a->nh + h) * hd;
        for (int64_t d = 0; d < hd; d++) o[d] *= sigmoidf_(gate[d]);
    }
}
