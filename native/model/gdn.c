/* gdn.c: the Gated DeltaNet layer (clover-spec 2.1) and, in block mode, the block operator
 * (spec 3.3) on the CPU path: input products, causal conv + SiLU (right taps in block mode), q/k
 * L2 norms, gates, the per-head recurrence or mixing (cpu/gdn_heads.c, or gpu_gdn for an
 * offloaded layer), the gated RMSNorm and the output product.
 * Twin: gpu/gdn_resident.c (the same steps on the device, resident forward). */
#include "model/gdn.h"
#include "cpu/gdn_heads.h"
#include "cpu/kernels.h"
#include "gpu/device_state.h"

#include <stdlib.h>
#include <string.h>

/* Depthwise conv + SiLU over T rows (spec 2.1 step 2, 3.3 step 1). hist: the K-1 previous
 * inputs [K-1][C], oldest first; w[ch*K + j], j = K-1 multiplies the current row. With right taps
 * wr (block mode, else NULL): plus wr[ch*(K-1) + d-1] times row t + d for d = 1..K-1, zero past
 * the last row [assumed]. */
static void conv_silu(const gdn_dims *d, const float *w, const float *wr, const float *hist, const float *in,
                      int64_t T, float *out) {
    const int64_t K = d->K, C = d->C;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t ch = 0; ch < C; ch++) {
            float s = 0;
            for (int64_t j = 0; j < K; j++) {
                int64_t src = t - (K - 1) + j; /* input index */
                float x = src >= 0 ? in[src * C + ch] : hist[(K - 1 + src) * C + ch];
                s += w[ch * K + j] * x;
            }
            for (int64_t j = 1; wr && j < K && t + j < T; j++) s += wr[ch * (K - 1) + j - 1] * in[(t + j) * C + ch];
            out[t * C + ch] = silu(s);
        }
    }
}

/* After the conv: L2-normalise q and k per head, scale q by 1/sqrt(dk) (spec 2.1 step 3). */
static void qk_norm(const gdn_dims *d, float *conv, int64_t T, float eps) {
    const float qs = 1.0f / sqrtf((float)d->dk);
    for (int64_t t = 0; t < T; t++) {
        float *row = conv + t * d->C;
        for (int64_t h = 0; h < d->Hk; h++) {
            float *q = row + h * d->dk, *k = row + d->Hk * d->dk + h * d->dk;
            l2norm(q, d->dk, eps);
            l2norm(k, d->dk, eps);
            for (int64_t i = 0; i < d->dk; i++) q[i] *= qs;
        }
    }
}

/* beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias) with ssm_a = -exp(A_log) (spec 2.1 step 4).
 * b, a: [T, Hv] in place -> beta, g. */
static void gates(const gdn_dims *d, float *b, float *a, const float *ssm_a, const float *dt_bias, int64_t T) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d->Hv; h++) {
            b[t * d->Hv + h] = sigmoidf_(b[t * d->Hv + h]);
            a[t * d->Hv + h] = ssm_a[h] * softplus(a[t * d->Hv + h] + dt_bias[h]);
        }
}

/* One entry's Gated DeltaNet after the input products (f: its context, rows and positions; qkv,
 * z, b, a its rows): in prefix mode the recurrence advances the layer's state and conv history;
 * in block mode (spec 3.3) the conv takes the right taps and the block softmax reads the clean
 * state, both left unchanged. Its heads' outputs into o; lc: the pass's context (threads,
 * thread scratch). */
static int gdn_entry(fwd *f, clover_context *lc, const clover_layer *ly, const gdn_dims *d, float *qkv, float *cv,
                     float *b, float *a, float *o) {
    clover_context *c = f->c;
    const int64_t T = f->T, C = d->C;
    const int block = f->mode == MODE_BLOCK;
    float *state = c->gdn_state + (size_t)ly->slot * gdn_state_floats(&c->m->hp);
    float *hist = c->conv_state + (size_t)ly->slot * (d->K - 1) * C;
    int rc;
    /* the recurrence on the GPU when the layer is offloaded (the conv and norms stay here) */
    const int on_gpu = gdn_on_gpu(ly, d);
    if (!on_gpu && c->gdn_on_dev && c->gdn_on_dev[ly->slot] && (rc = gdn_to_host(c, f->err, f->err_size)) != CLOVER_OK)
        return rc;
    conv_silu(d, ly->conv, block ? ly->conv_right : NULL, hist, qkv, T, cv);
    qk_norm(d, cv, T, 1e-6f);
    size_t stride = 0; /* the heads' per-thread scratch, on the CPU */
    char *ts = on_gpu ? NULL : thread_scratch(lc, gdn_heads_scratch_floats(d, block, T), sizeof(float), &stride);
    if (!on_gpu && !ts) return CLOVER_E_NOMEM;
    if (block)
        return on_gpu ? gpu_gdn(f, ly, 0, d, cv, NULL, NULL, o)
                      : bd_heads(d, ly, cv, state, T, f->pos0, o, lc->n_threads, ts, stride);
    gates(d, b, a, ly->ssm_a, ly->dt_bias, T);
    if (c->rec_on) { /* speculative verify: keep the replay inputs */
        const size_t slot = (size_t)ly->slot * (size_t)c->rec_cap;
        memcpy(c->rec_qkv + slot * C, qkv, sizeof(float) * (size_t)(T * C));
        memcpy(c->rec_cv + slot * C, cv, sizeof(float) * (size_t)(T * C));
        memcpy(c->rec_b + slot * d->Hv, b, sizeof(float) * (size_t)(T * d->Hv));
        memcpy(c->rec_a + slot * d->Hv, a, sizeof(float) * (size_t)(T * d->Hv));
    }
    /* new conv history: the last K-1 inputs of (history ++ qkv rows) */
    for (int64_t j = 0; j < d->K - 1; j++) {
        int64_t src = T - (d->K - 1) + j;
        float *dst = hist + j * C;
        if (src >= 0) memcpy(dst, qkv + src * C, sizeof(float) * (size_t)C);
        else memmove(dst, hist + (d->K - 1 + src) * C, sizeof(float) * (size_t)C);
    }
    return on_gpu ? gpu_gdn(f, ly, gpu_gdn_forward(f->c, T), d, cv, b, a, o)
                  : gdn_recurrence(c->gdn_chunked && T > 1 ? GDN_FORWARD_CHUNKED : GDN_FORWARD, d, cv, b, a, T,
                                   state, o, lc->n_threads, ts, stride);
}

int gdn_layer(fwd *L, pass_entry *e, int n, const clover_layer *ly, const float *xn, float *out) {
    clover_context *lc = L->c;
    const clover_hparams *hp = &lc->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t T = L->T, C = d.C, vdim = d.Hv * d.dv;
    int gated = 0; /* beta and g shape the state only: block mode does not compute them (spec 3.3 step 4) */
    for (int i = 0; i < n; i++) gated |= e[i].f.mode != MODE_BLOCK;
    scratch_plan sp = {0};
    const int iqkv = scratch_add(&sp, T * C, sizeof(float)), icv = scratch_add(&sp, T * C, sizeof(float));
    const int iz = scratch_add(&sp, T * vdim, sizeof(float)), ib = scratch_add(&sp, T * d.Hv, sizeof(float));
    const int ia = scratch_add(&sp, T * d.Hv, sizeof(float)), io = scratch_add(&sp, T * vdim, sizeof(float));
    char *base = scratch_carve(lc, SCRATCH_LAYER, &sp);
    float *qkv = scratch_part(base, &sp, iqkv), *cv = scratch_part(base, &sp, icv), *z = scratch_part(base, &sp, iz);
    float *b = scratch_part(base, &sp, ib), *a = scratch_part(base, &sp, ia), *o = scratch_part(base, &sp, io);
    if (!qkv || !cv || !z || !b || !a || !o) return CLOVER_E_NOMEM;
    if (matmul(L, &ly->wqkv, xn, T, qkv) || matmul(L, &ly->wz, xn, T, z) ||
        (gated && (matmul(L, &ly->wbeta, xn, T, b) || matmul(L, &ly->walpha, xn, T, a))))
        return CLOVER_E_NOMEM;
    int64_t r = 0; /* the entry's first row in the pass */
    for (int i = 0; i < n; r += e[i++].f.T) {
        const int rc = gdn_entry(&e[i].f, lc, ly, &d, qkv + r * C, cv + r * C, b + r * d.Hv, a + r * d.Hv, o + r * vdim);
        if (rc != CLOVER_OK) return rc;
    }
    /* gated RMSNorm per head with a plain weight (spec 2.1 step 7) */
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d.Hv; h++) {
            float *oh = o + (t * d.Hv + h) * d.dv;
            const float *zh = z + (t * d.Hv + h) * d.dv;
            rmsnorm(oh, oh, ly->ssm_norm, d.dv, hp->rms_eps);
            for (int64_t k = 0; k < d.dv; k++) oh[k] *= silu(zh[k]);
        }
    return matmul(L, &ly->wout, o, T, out) ? CLOVER_E_NOMEM : CLOVER_OK;
}
