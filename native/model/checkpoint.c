/* checkpoint.c: the context's saved state (clover_context_save_state / restore_state) and the
 * checkpoint / rollback of speculative verification (clover-spec 5.5): GDN and conv state
 * copied, the recorded prefill's GDN inputs replayed over the kept tokens (on the device for a
 * resident model, gpu/gdn_resident.c res_rollback_slot). */
#include "model/checkpoint.h"
#include "cpu/gdn_heads.h"
#include "gpu/device_state.h"
#include "gpu/gdn_resident.h"
#include "model/model.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

int clover_context_save_state(clover_context *c, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (c->n_past <= 0) return clover_set_err(err, err_size, CLOVER_E_STATE, "save_state: the context is empty");
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn;
    const size_t state_n = (size_t)(G * gdn_state_floats(hp)), conv_n = (size_t)(G * (hp->ssm_d_conv - 1) * conv_channels(hp));
    if (!c->keep_state) c->keep_state = malloc(sizeof(float) * state_n + 1);
    if (!c->keep_conv) c->keep_conv = malloc(sizeof(float) * conv_n + 1);
    if (!c->keep_state || !c->keep_conv) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the saved state");
    int rc = gdn_to_host(c, err, err_size);
    if (rc != CLOVER_OK) return rc;
    memcpy(c->keep_state, c->gdn_state, sizeof(float) * state_n);
    memcpy(c->keep_conv, c->conv_state, sizeof(float) * conv_n);
    c->keep_n = c->n_past;
    return CLOVER_OK;
}

int32_t clover_context_restore_state(clover_context *c, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (c->keep_n <= 0 || c->keep_n > c->n_past)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "restore_state: no saved state (or the context was reset)");
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn;
    memcpy(c->gdn_state, c->keep_state, sizeof(float) * (size_t)(G * gdn_state_floats(hp)));
    if (c->gdn_on_dev) memset(c->gdn_on_dev, 0, (size_t)G); /* the host copy is current */
    memcpy(c->conv_state, c->keep_conv, sizeof(float) * (size_t)(G * (hp->ssm_d_conv - 1) * conv_channels(hp)));
    c->n_past = c->keep_n;
    c->rec_on = 0;
    c->rec_n = 0;
    atomic_store(&c->abort_req, 0);
    return c->keep_n;
}

int clover_context_checkpoint(clover_context *c, int32_t n_max, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (n_max <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_max: %d must be > 0", n_max);
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn, C = conv_channels(hp), Hv = hp->ssm_dt_rank;
    const int64_t state_n = G * gdn_state_floats(hp), conv_n = G * (hp->ssm_d_conv - 1) * C;
    if (n_max > c->rec_cap || (c->m->resident && !c->rec_dev)) {
        if ((uint64_t)n_max * (uint64_t)(G ? G : 1) * (uint64_t)C > SIZE_MAX / sizeof(float) / 4)
            return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_max: %d tokens of recording overflow", n_max);
        free(c->rec_qkv), free(c->rec_cv), free(c->rec_b), free(c->rec_a);
        clover_cuda_free(c->rec_dev);
        c->rec_qkv = c->rec_cv = c->rec_b = c->rec_a = NULL;
        c->rec_dev = NULL;
        c->rec_cap = 0;
        if (c->m->resident) { /* the resident forward records on the device (rec_dev_slot) */
            int rc = clover_cuda_alloc(sizeof(float) * (size_t)(G * n_max * 2 * (C + Hv)), &c->rec_dev, err, err_size);
            if (rc != CLOVER_OK) return rc;
            c->rec_cap = n_max;
        } else {
            c->rec_qkv = malloc(sizeof(float) * (size_t)(G * n_max * C) + 1);
            c->rec_cv = malloc(sizeof(float) * (size_t)(G * n_max * C) + 1);
            c->rec_b = malloc(sizeof(float) * (size_t)(G * n_max * Hv) + 1);
            c->rec_a = malloc(sizeof(float) * (size_t)(G * n_max * Hv) + 1);
            c->rec_cap = c->rec_qkv && c->rec_cv && c->rec_b && c->rec_a ? n_max : 0;
            if (!c->rec_cap) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the verify record");
        }
    }
    if (!c->snap_state) c->snap_state = malloc(sizeof(float) * (size_t)state_n + 1);
    if (!c->snap_conv) c->snap_conv = malloc(sizeof(float) * (size_t)conv_n + 1);
    if (!c->snap_state || !c->snap_conv) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the checkpoint");
    int rc = CLOVER_OK;
    for (int g = 0; g < G && c->m->resident && rc == CLOVER_OK; g++) rc = gdn_slot_to_device(c, g, err, err_size);
    if (rc == CLOVER_OK) rc = gdn_snapshot_on_device(c, err, err_size); /* resident: every slot */
    if (rc != CLOVER_OK) return rc;
    memcpy(c->snap_state, c->gdn_state, sizeof(float) * (size_t)state_n); /* the slots on the host */
    memcpy(c->snap_conv, c->conv_state, sizeof(float) * (size_t)conv_n);
    c->rec_on = 1;
    c->rec_n = 0;
    c->rec_p0 = c->n_past;
    return CLOVER_OK;
}

int clover_context_rollback(clover_context *c, int32_t n_keep, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (!c->rec_on || c->rec_n == 0)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "rollback without a recorded prefill after a checkpoint");
    if (n_keep < 1 || n_keep > c->rec_n)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "n_keep: %d outside [1, %d]", n_keep, c->rec_n);
    c->rec_on = 0;
    if (n_keep == c->rec_n) return CLOVER_OK; /* everything accepted: the caches are right */
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t C = d.C, K1 = d.K - 1, S_n = gdn_state_floats(hp);
    float *o = malloc(sizeof(float) * (size_t)(n_keep * d.Hv * d.dv) + 1);
    float *cat = malloc(sizeof(float) * (size_t)((K1 + n_keep) * C) + 1);
    int rc = o && cat ? CLOVER_OK : clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory in rollback");
    for (int64_t g = 0; g < c->m->n_gdn && rc == CLOVER_OK; g++) {
        if (c->rec_dev) { /* the resident forward recorded on the device: replay there */
            rc = res_rollback_slot(c, (int)g, n_keep, err, err_size);
            continue;
        }
        float *state = c->gdn_state + g * S_n, *hist = c->conv_state + g * K1 * C;
        const size_t slot = (size_t)g * (size_t)c->rec_cap;
        /* conv history: the last K-1 rows of (checkpoint history ++ kept inputs) */
        memcpy(cat, c->snap_conv + g * K1 * C, sizeof(float) * (size_t)(K1 * C));
        memcpy(cat + K1 * C, c->rec_qkv + slot * C, sizeof(float) * (size_t)(n_keep * C));
        memcpy(hist, cat + n_keep * C, sizeof(float) * (size_t)(K1 * C));
        const float *cv = c->rec_cv + slot * C, *b = c->rec_b + slot * d.Hv, *a = c->rec_a + slot * d.Hv;
        if (c->snap_on_dev && c->snap_on_dev[g]) { /* the checkpoint is on the GPU: replay there */
            const size_t bytes = sizeof(float) * (size_t)S_n;
            float *dev = (float *)((char *)c->gdn_dev + bytes * (size_t)g);
            rc = clover_cuda_copy(dev, (const char *)c->gdn_snap_dev + bytes * (size_t)g, bytes, err, err_size);
            if (rc == CLOVER_OK)
                rc = clover_cuda_gdn(CLOVER_GDN_FORWARD, cv, b, a, n_keep, d.Hk, d.Hv, d.dk, d.dv, C, dev, o, err,
                                     err_size);
            c->gdn_on_dev[g] = 1;
            continue;
        }
        if (c->gdn_on_dev) c->gdn_on_dev[g] = 0; /* the host copy is rewritten */
        memcpy(state, c->snap_state + g * S_n, sizeof(float) * (size_t)S_n);
        size_t stride = 0;
        char *ts = thread_scratch(c, gdn_heads_scratch_floats(&d, 0, n_keep), sizeof(float), &stride);
        if (!ts || gdn_recurrence(GDN_FORWARD, &d, cv, b, a, n_keep, state, o, c->n_threads, ts, stride))
            rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory in rollback");
    }
    free(o), free(cat);
    if (rc == CLOVER_OK) c->n_past = c->rec_p0 + n_keep;
    else clover_context_reset(c);
    return rc;
}
