/* gdn_resident.c: the Gated DeltaNet layer (clover-spec 2.1, 3.3) on the device, resident forward, and the replay of its verify record (spec 5.5).
 * Twin: model/gdn.c (the same steps on the CPU path). */
#include "gpu/gdn_resident.h"
#include "gpu/device_state.h"

/* The device verify record of GDN slot g (rec_dev, the layout of rec_qkv, rec_cv, rec_b, rec_a). */
static void rec_dev_slot(const clover_context *c, int g, float **qkv, float **cv, float **b, float **a) {
    const int64_t G = c->m->n_gdn, C = conv_channels(&c->m->hp), Hv = c->m->hp.ssm_dt_rank, cap = c->rec_cap;
    float *base = c->rec_dev;
    *qkv = base + (g * cap) * C;
    *cv = base + (G * cap + g * cap) * C;
    *b = base + 2 * G * cap * C + g * cap * Hv;
    *a = base + 2 * G * cap * C + (G * cap + g * cap) * Hv;
}

/* gdn_layer on the device; a recorded prefill (spec verify) keeps its inputs in rec_dev from
 * row rec_row. */
int res_gdn_layer(fwd *f, const clover_layer *ly, const res_bufs *b, int64_t rec_row) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t T = f->T, C = d.C;
    const int block = f->mode == MODE_BLOCK;
    char *err = f->err;
    const size_t es = f->err_size;
    int rc;
    float *state = (float *)c->gdn_dev + (size_t)ly->slot * (size_t)gdn_state_floats(hp); /* res_prepare put it there */
    float *hist = (float *)c->conv_dev + (size_t)ly->slot * (size_t)((d.K - 1) * C);
    const clover_tensor *w[4] = {&ly->wqkv, &ly->wz, &ly->wbeta, &ly->walpha};
    float *y[4] = {b->qkv, b->z, b->b, b->a};
    /* block mode: no beta and g (spec 3.3 step 4), the right taps */
    if ((rc = mm_n_d(f, block ? 2 : 4, w, b->xn, T, y)) ||
        (rc = clover_cuda_conv_d(ly->dev.conv, block ? ly->dev.conv_right : NULL, hist, b->qkv, T, C, (int32_t)d.K,
                                 b->cv, err, es)) ||
        (rc = clover_cuda_gdn_prep_d(b->cv, T, C, d.Hk, d.dk, 1e-6f, block ? NULL : b->b, block ? NULL : b->a,
                                     ly->dev.ssm_a, ly->dev.dt_bias, d.Hv, err, es)))
        return rc;
    if (block) {
        rc = clover_cuda_gdn_block_d(b->cv, T, d.Hk, d.Hv, d.dk, d.dv, C, state, ly->dev.bd_lambda, ly->dev.bd_beta0,
                                     ly->dev.bd_c, b->pos, b->og, err, es);
    } else {
        if (c->rec_on) {
            float *rq, *rc_, *rb, *ra;
            rec_dev_slot(c, ly->slot, &rq, &rc_, &rb, &ra);
            if ((rc = clover_cuda_copy_d(rq + rec_row * C, b->qkv, C * T, err, es)) ||
                (rc = clover_cuda_copy_d(rc_ + rec_row * C, b->cv, C * T, err, es)) ||
                (rc = clover_cuda_copy_d(rb + rec_row * d.Hv, b->b, d.Hv * T, err, es)) ||
                (rc = clover_cuda_copy_d(ra + rec_row * d.Hv, b->a, d.Hv * T, err, es)))
                return rc;
        }
        if ((rc = clover_cuda_conv_hist_d(hist, b->qkv, T, C, (int32_t)d.K, err, es))) return rc;
        rc = clover_cuda_gdn_d(gpu_gdn_forward(c, T), b->cv, b->b, b->a, T, d.Hk, d.Hv, d.dk, d.dv, C, state, b->og,
                               err, es);
    }
    if (rc || (rc = clover_cuda_gdn_out_d(b->og, b->z, ly->dev.ssm_norm, T, d.Hv, d.dv, hp->rms_eps, err, es)))
        return rc;
    return mm_d(f, &ly->wout, b->og, T, b->o);
}

/* clover_context_rollback of GDN slot g for the resident forward: state and conv history from
 * the device checkpoint (every slot is there, clover_context_checkpoint), then the n_keep
 * recorded rows replayed on the device. */
int res_rollback_slot(clover_context *c, int g, int32_t n_keep, char *err, size_t err_size) {
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const size_t state_bytes = sizeof(float) * (size_t)gdn_state_floats(hp), conv_bytes = conv_slot_bytes(hp);
    float *state = (float *)((char *)c->gdn_dev + state_bytes * (size_t)g);
    float *hist = (float *)((char *)c->conv_dev + conv_bytes * (size_t)g);
    float *rq, *rcv, *rb, *ra;
    rec_dev_slot(c, g, &rq, &rcv, &rb, &ra);
    res_bufs b;
    int rc;
    if ((rc = res_workspace(c, n_keep, &b, err, err_size)) ||
        (rc = clover_cuda_copy(state, (const char *)c->gdn_snap_dev + state_bytes * (size_t)g, state_bytes, err, err_size)) ||
        (rc = clover_cuda_copy(hist, (const char *)c->conv_snap_dev + conv_bytes * (size_t)g, conv_bytes, err, err_size)) ||
        (rc = clover_cuda_conv_hist_d(hist, rq, n_keep, d.C, (int32_t)d.K, err, err_size)))
        return rc;
    c->gdn_on_dev[g] = 1;
    return clover_cuda_gdn_d(CLOVER_GDN_FORWARD, rcv, rb, ra, n_keep, d.Hk, d.Hv, d.dk, d.dv, d.C, state, b.og, err,
                             err_size);
}
