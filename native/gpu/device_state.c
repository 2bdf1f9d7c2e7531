/* device_state.c: what a context keeps on the GPU: the KV cache of the offloaded attention
 * layers, the GDN state (and, resident, the conv history) of the GDN layers, their checkpoint
 * copies, and the host staging of routed experts; the per-layer GPU calls of the CPU path
 * (gpu_attention, gpu_gdn) that read them. Sizes as clover-spec 2.1-2.2 and 5.5 give them. */
#include "gpu/device_state.h"
#include "gpu/offload.h"

#include <stdlib.h>
#include <string.h>

/* Bytes of each part of a context's state on the GPU (gpu_state_sizes). */
typedef struct {
    size_t k, v, gdn, conv;
} gpu_sizes;

/* Element-type bits of the context's KV cache for the CUDA backend (CLOVER_KV_*_F16). */
int kv_f16_bits(const clover_context *c) {
    return (c->type_k == CLOVER_TYPE_F16 ? CLOVER_KV_K_F16 : 0) | (c->type_v == CLOVER_TYPE_F16 ? CLOVER_KV_V_F16 : 0);
}

/* Offloaded attention layers (their output projection on the GPU) among the first n_slots
 * attention layers: the device KV cache holds one layer's rows per offloaded layer, in order. */
int64_t offloaded_attn(const clover_model *m, int n_slots) {
    int64_t n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const clover_layer *ly = &m->layers[il];
        n += ly->is_attn && ly->slot < n_slots && ly->wo.dev != NULL;
    }
    return n;
}

/* The sizes of a context's state on the GPU (clover-spec 2.1-2.2): K and V caches of n_attn_on
 * offloaded attention layers ([n_ctx][n_head_kv * head_dim] elements of type_k / type_v each),
 * the float32 GDN state [Hv][dk][dv] of every GDN layer and their float32 conv history
 * [d_conv - 1][channels]. The one computation behind kv_dev_alloc, alloc_gdn_states,
 * gdn_dev_alloc and clover_model_gpu_cache_bytes. CLOVER_OK, or CLOVER_E_NOMEM when a size
 * overflows size_t (extreme but loadable shapes). */
static int gpu_state_sizes(const clover_model *m, int64_t n_ctx, int32_t type_k, int32_t type_v, int64_t n_attn_on,
                           gpu_sizes *out) {
    const clover_hparams *hp = &m->hp;
    size_t n, conv;
    if (n_ctx < 0 || n_attn_on < 0 || m->n_gdn < 0 ||
        __builtin_mul_overflow((size_t)n_ctx, (size_t)hp->n_head_kv, &n) ||
        __builtin_mul_overflow(n, (size_t)hp->head_dim, &n) || __builtin_mul_overflow(n, (size_t)n_attn_on, &n) ||
        __builtin_mul_overflow(n, kv_elem_bytes(type_k), &out->k) || __builtin_mul_overflow(n, kv_elem_bytes(type_v), &out->v) ||
        __builtin_mul_overflow(sizeof(float), (size_t)gdn_state_floats(hp), &out->gdn) ||
        __builtin_mul_overflow(out->gdn, (size_t)m->n_gdn, &out->gdn) ||
        __builtin_mul_overflow((size_t)(hp->ssm_d_conv - 1), (size_t)conv_channels(hp), &conv) ||
        __builtin_mul_overflow(conv, sizeof(float) * (size_t)m->n_gdn, &out->conv))
        return CLOVER_E_NOMEM;
    return CLOVER_OK;
}

/* The context's device KV cache (the offloaded attention layers only), allocated at the first
 * use. */
int kv_dev_alloc(clover_context *c, char *err, size_t err_size) {
    if (c->kv_dev_rows) return CLOVER_OK;
    gpu_sizes sz;
    if (gpu_state_sizes(c->m, c->n_ctx, c->type_k, c->type_v, offloaded_attn(c->m, c->m->n_attn), &sz) != CLOVER_OK)
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_ctx: %d: the GPU's KV cache size overflows", c->n_ctx);
    const size_t kb = sz.k, vb = sz.v;
    int rc = clover_cuda_alloc(kb, &c->k_dev, err, err_size);
    if (rc == CLOVER_OK) rc = clover_cuda_alloc(vb, &c->v_dev, err, err_size);
    if (rc == CLOVER_OK && !(c->kv_dev_rows = calloc((size_t)c->m->n_attn, sizeof(int64_t))))
        rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    if (rc != CLOVER_OK) {
        clover_cuda_free(c->k_dev), clover_cuda_free(c->v_dev);
        c->k_dev = c->v_dev = NULL;
    }
    return rc;
}

/* Bring rows [kv_dev_rows[slot], pos) of attention layer slot's device KV cache up to date with
 * the host cache (rows a CPU forward wrote since). */
int kv_dev_catch_up(clover_context *c, int slot, int64_t pos, char *err, size_t err_size) {
    const int64_t have = c->kv_dev_rows[slot];
    if (have >= pos) return CLOVER_OK;
    const size_t row = (size_t)c->m->hp.n_head_kv * (size_t)c->m->hp.head_dim, layer = row * (size_t)c->n_ctx;
    const size_t host = layer * (size_t)slot, dev = layer * (size_t)offloaded_attn(c->m, slot);
    const size_t off = row * (size_t)have, n = row * (size_t)(pos - have);
    const size_t ek = kv_elem_bytes(c->type_k), ev = kv_elem_bytes(c->type_v);
    int rc = clover_cuda_write(c->k_dev, ek * (dev + off), (const char *)c->k_cache + ek * (host + off), ek * n, err,
                               err_size);
    if (rc == CLOVER_OK)
        rc = clover_cuda_write(c->v_dev, ev * (dev + off), (const char *)c->v_cache + ev * (host + off), ev * n, err,
                               err_size);
    return rc;
}

/* Attention of an offloaded layer on the GPU (clover_cuda_attention): the context's device KV
 * cache (the offloaded layers only) is allocated at the first call and brought up to date with
 * the host cache, which attention_layer wrote the new rows to (rows a CPU forward wrote since
 * and this forward's); qg as attention_layer made it. */
int gpu_attention(fwd *f, const clover_layer *ly, const float *qg, float scale, float *att) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const size_t layer = (size_t)c->n_ctx * (size_t)hp->n_head_kv * (size_t)hp->head_dim;
    int rc = kv_dev_alloc(c, f->err, f->err_size);
    if (rc != CLOVER_OK) return rc;
    const size_t dev = layer * (size_t)offloaded_attn(c->m, ly->slot);
    const int64_t have = c->kv_dev_rows[ly->slot];
    if (have > f->pos0) c->kv_dev_rows[ly->slot] = f->pos0; /* rows from pos0 on are new */
    if ((rc = kv_dev_catch_up(c, ly->slot, f->pos0 + f->T, f->err, f->err_size)) == CLOVER_OK)
        rc = clover_cuda_attention(qg, (char *)c->k_dev + dev * kv_elem_bytes(c->type_k),
                                   (char *)c->v_dev + dev * kv_elem_bytes(c->type_v), kv_f16_bits(c), c->n_ctx, f->pos0,
                                   f->T, hp->n_head, hp->n_head_kv, hp->head_dim, f->mode == MODE_PREFIX, scale, att,
                                   f->err, f->err_size);
    c->kv_dev_rows[ly->slot] = rc == CLOVER_OK ? f->pos0 + f->T : (have < f->pos0 ? have : f->pos0);
    return rc;
}

/* A zeroed device buffer laid out as gdn_state (*dev) and a zeroed flag per GDN layer (*flags),
 * both or neither. */
static int alloc_gdn_states(const clover_context *c, void **dev, unsigned char **flags, char *err, size_t err_size) {
    gpu_sizes sz;
    if (gpu_state_sizes(c->m, c->n_ctx, c->type_k, c->type_v, 0, &sz) != CLOVER_OK)
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "the GPU's GDN state size overflows");
    int rc = clover_cuda_alloc(sz.gdn, dev, err, err_size);
    if (rc == CLOVER_OK && !(*flags = calloc((size_t)c->m->n_gdn, 1)))
        rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    if (rc != CLOVER_OK) {
        clover_cuda_free(*dev);
        *dev = NULL;
    }
    return rc;
}

/* Bytes of one GDN layer's conv history (conv_state's slot). */
size_t conv_slot_bytes(const clover_hparams *hp) {
    return sizeof(float) * (size_t)(hp->ssm_d_conv - 1) * (size_t)conv_channels(hp);
}

/* Bring the GDN state (and, in the resident forward, the conv history) of the slots whose
 * current copy is on the device back to gdn_state (conv_state). */
int gdn_to_host(clover_context *c, char *err, size_t err_size) {
    if (!c->gdn_on_dev) return CLOVER_OK;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), conv_bytes = conv_slot_bytes(&c->m->hp);
    for (int g = 0; g < c->m->n_gdn; g++) {
        if (!c->gdn_on_dev[g]) continue;
        int rc = clover_cuda_read(c->gdn_dev, slot_bytes * (size_t)g, (char *)c->gdn_state + slot_bytes * (size_t)g,
                                  slot_bytes, err, err_size);
        if (rc == CLOVER_OK && c->conv_dev)
            rc = clover_cuda_read(c->conv_dev, conv_bytes * (size_t)g, (char *)c->conv_state + conv_bytes * (size_t)g,
                                  conv_bytes, err, err_size);
        if (rc != CLOVER_OK) return rc;
        c->gdn_on_dev[g] = 0;
    }
    return CLOVER_OK;
}

/* clover_context_checkpoint's copy of the GDN state (and conv history, resident forward) of the
 * slots on the device, kept there (snap_on_dev; clover_context_rollback restores and replays
 * them there). */
int gdn_snapshot_on_device(clover_context *c, char *err, size_t err_size) {
    if (!c->gdn_on_dev) return CLOVER_OK;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp);
    if (!c->snap_on_dev) {
        const int rc = alloc_gdn_states(c, &c->gdn_snap_dev, &c->snap_on_dev, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    const size_t conv_bytes = conv_slot_bytes(&c->m->hp), conv_all = conv_bytes * (size_t)c->m->n_gdn;
    if (c->conv_dev && !c->conv_snap_dev) {
        const int rc = clover_cuda_alloc(conv_all, &c->conv_snap_dev, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    for (int g = 0; g < c->m->n_gdn; g++) {
        c->snap_on_dev[g] = c->gdn_on_dev[g];
        if (!c->gdn_on_dev[g]) continue;
        int rc = clover_cuda_copy((char *)c->gdn_snap_dev + slot_bytes * (size_t)g,
                                  (const char *)c->gdn_dev + slot_bytes * (size_t)g, slot_bytes, err, err_size);
        if (rc == CLOVER_OK && c->conv_dev)
            rc = clover_cuda_copy((char *)c->conv_snap_dev + conv_bytes * (size_t)g,
                                  (const char *)c->conv_dev + conv_bytes * (size_t)g, conv_bytes, err, err_size);
        if (rc != CLOVER_OK) {
            c->snap_on_dev[g] = 0;
            return rc;
        }
    }
    return CLOVER_OK;
}

/* The device GDN state of every GDN layer and, for the resident forward, their conv history on
 * the device (both zeroed), unless allocated already. */
int gdn_dev_alloc(clover_context *c, char *err, size_t err_size) {
    int rc = CLOVER_OK;
    if (!c->gdn_on_dev && (rc = alloc_gdn_states(c, &c->gdn_dev, &c->gdn_on_dev, err, err_size)) != CLOVER_OK) return rc;
    if (c->m->resident && !c->conv_dev) {
        gpu_sizes sz;
        if (gpu_state_sizes(c->m, c->n_ctx, c->type_k, c->type_v, 0, &sz) != CLOVER_OK)
            return clover_set_err(err, err_size, CLOVER_E_NOMEM, "the GPU's conv history size overflows");
        rc = clover_cuda_alloc(sz.conv, &c->conv_dev, err, err_size);
    }
    return rc;
}

/* Whether GDN layer ly runs its recurrence on the GPU (its output projection is there and the
 * kernels take its dimensions). */
int gdn_on_gpu(const clover_layer *ly, const gdn_dims *d) {
    return ly->wout.dev && d->dk <= 256 && d->dv <= 1024;
}

/* At context creation on a model with weights on the GPU: the device KV cache of the offloaded
 * attention layers, and the device GDN state where a GDN layer runs there, as llama.cpp
 * allocates its KV cache with the context: a GPU too small for n_ctx fails there, not at the
 * first forward. */
int gpu_state_reserve(clover_context *c, char *err, size_t err_size) {
    const clover_model *m = c->m;
    const gdn_dims d = gdn_dims_of(&m->hp);
    int rc = offloaded_attn(m, m->n_attn) > 0 ? kv_dev_alloc(c, err, err_size) : CLOVER_OK;
    for (int il = 0; il < m->hp.n_layer && rc == CLOVER_OK; il++)
        if (!m->layers[il].is_attn && gdn_on_gpu(&m->layers[il], &d)) {
            rc = gdn_dev_alloc(c, err, err_size);
            break;
        }
    return rc;
}

/* What gpu_state_reserve allocates for a context of n_ctx tokens when clover_model_offload(m,
 * n_gpu_layers, ...) places the weights: the KV cache of the attention layers below n_gpu_layers
 * (whose output projection is then on the GPU), the GDN states once a GDN layer below it runs
 * there (gdn_on_gpu's dimension rule), and the conv history too when the placement makes the
 * model resident (offload_makes_resident). */
int64_t clover_model_gpu_cache_bytes(const clover_model *m, int32_t n_ctx, int32_t n_gpu_layers, int32_t type_k,
                                     int32_t type_v) {
    if (!m || n_ctx <= 0 || n_gpu_layers < 0 || !kv_elem_bytes(type_k) || !kv_elem_bytes(type_v)) return -1;
    const int32_t L = n_gpu_layers < m->hp.n_layer ? n_gpu_layers : m->hp.n_layer;
    const gdn_dims d = gdn_dims_of(&m->hp);
    int64_t n_attn_on = 0;
    int gdn_on = 0;
    for (int il = 0; il < L; il++) {
        const clover_layer *ly = &m->layers[il];
        n_attn_on += ly->is_attn;
        gdn_on |= !ly->is_attn && d.dk <= 256 && d.dv <= 1024; /* gdn_on_gpu with wout on the GPU */
    }
    gpu_sizes sz;
    if (gpu_state_sizes(m, n_ctx, type_k, type_v, n_attn_on, &sz) != CLOVER_OK) return INT64_MAX;
    size_t total = n_attn_on > 0 ? sz.k + sz.v : 0;
    if (n_attn_on > 0 && total < sz.k) return INT64_MAX;
    if (gdn_on && __builtin_add_overflow(total, sz.gdn, &total)) return INT64_MAX;
    if (gdn_on && offload_makes_resident(m, n_gpu_layers) && __builtin_add_overflow(total, sz.conv, &total))
        return INT64_MAX;
    return total > (size_t)INT64_MAX ? INT64_MAX : (int64_t)total;
}

/* Make the device copy of GDN slot g current: the device state (and, for the resident forward,
 * the conv history on the device) allocated unless it is (gpu_state_reserve), the host copy
 * uploaded unless the device one is already current. */
int gdn_slot_to_device(clover_context *c, int g, char *err, size_t err_size) {
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), at = slot_bytes * (size_t)g;
    const size_t conv_bytes = conv_slot_bytes(&c->m->hp);
    int rc = gdn_dev_alloc(c, err, err_size);
    if (rc != CLOVER_OK) return rc;
    if (c->gdn_on_dev[g]) return CLOVER_OK;
    rc = clover_cuda_write(c->gdn_dev, at, (const char *)c->gdn_state + at, slot_bytes, err, err_size);
    if (rc == CLOVER_OK && c->conv_dev)
        rc = clover_cuda_write(c->conv_dev, conv_bytes * (size_t)g, (const char *)c->conv_state + conv_bytes * (size_t)g,
                               conv_bytes, err, err_size);
    c->gdn_on_dev[g] = rc == CLOVER_OK;
    return rc;
}

/* The GPU's kind for a prefix-mode forward of T rows: the chunked form for prefills past one chunk
 * of 64 rows (unless clover_context_set_gdn_chunked turned it off), else the recurrence (decode
 * steps, spec's verify, short prefills). */
int gpu_gdn_forward(const clover_context *c, int64_t T) {
    return c->gdn_chunked && T > 64 ? CLOVER_GDN_FORWARD_CHUNKED : CLOVER_GDN_FORWARD;
}

/* One GDN recurrence of an offloaded layer on the GPU (clover_cuda_gdn, kind CLOVER_GDN_FORWARD*),
 * or with b NULL the block operator's mixing (clover_cuda_gdn_block, reading the state): the
 * layer's state is moved to the device at its first use there and stays (gdn_on_dev). */
int gpu_gdn(fwd *f, const clover_layer *ly, int kind, const gdn_dims *d, const float *cv, const float *b,
                   const float *a, float *o) {
    clover_context *c = f->c;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), at = slot_bytes * (size_t)ly->slot;
    const int rc = gdn_slot_to_device(c, ly->slot, f->err, f->err_size);
    if (rc != CLOVER_OK) return rc;
    float *state = (float *)((char *)c->gdn_dev + at);
    if (!b)
        return clover_cuda_gdn_block(cv, f->T, d->Hk, d->Hv, d->dk, d->dv, d->C, state, ly->bd_lambda, ly->bd_beta0,
                                     ly->bd_c, f->pos0, o, f->err, f->err_size);
    return clover_cuda_gdn(kind, cv, b, a, f->T, d->Hk, d->Hv, d->dk, d->dv, d->C, state, o, f->err, f->err_size);
}

/* Free the routed experts' host staging (page-locked or plain, moe_host_pinned). */
void moe_host_release(clover_context *c) {
    if (c->moe_host_pinned) clover_cuda_host_free(c->moe_host);
    else free(c->moe_host);
    c->moe_host = NULL, c->moe_host_cap = 0;
}
