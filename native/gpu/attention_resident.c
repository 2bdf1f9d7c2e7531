/* attention_resident.c: the gated attention layer (clover-spec 2.2) on the device, resident forward.
 * Twin: model/attention.c (the same steps on the CPU path). */
#include "gpu/attention_resident.h"
#include "gpu/device_state.h"
#include <math.h>

/* attention_layer on the device: the new K and V rows go into the device cache at *b->pos
 * (res_prepare made the cache ready). */
int res_attention_layer(fwd *f, const clover_layer *ly, const res_bufs *b) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, nh = hp->n_head, nkv = hp->n_head_kv, hd = hp->head_dim, kvd = nkv * hd;
    char *err = f->err;
    const size_t es = f->err_size;
    const size_t at = (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd; /* every layer offloaded */
    char *kc = (char *)c->k_dev + at * kv_elem_bytes(c->type_k), *vc = (char *)c->v_dev + at * kv_elem_bytes(c->type_v);
    const clover_tensor *w[3] = {&ly->wq, &ly->wk, &ly->wv};
    float *y[3] = {b->qg, b->kn, b->vn};
    int rc;
    if ((rc = mm_n_d(f, 3, w, b->xn, T, y)) ||
        (rc = clover_cuda_head_norm_rope_d(b->qg, T, nh, nh * 2 * hd, 2 * hd, ly->dev.q_norm, hd, hp->rms_eps, b->pos,
                                           hp->rope_dim, hp->rope_theta, err, es)) ||
        (rc = clover_cuda_head_norm_rope_d(b->kn, T, nkv, kvd, hd, ly->dev.k_norm, hd, hp->rms_eps, b->pos, hp->rope_dim,
                                           hp->rope_theta, err, es)) ||
        (rc = clover_cuda_kv_store_d(kc, vc, kv_f16_bits(c), c->n_ctx, kvd, b->pos, b->kn, b->vn, T, err, es)) ||
        (rc = clover_cuda_attention_d(b->qg, kc, vc, kv_f16_bits(c), b->pos, T, nh, nkv, hd, f->mode == MODE_PREFIX,
                                      1.0f / sqrtf((float)hd), b->att, err, es)))
        return rc;
    return mm_d(f, &ly->wo, b->att, T, b->o);
}
