/* state.c: a context's whole state as bytes and back (clover_state_get_size, clover_state_get_data,
 * clover_state_set_data; after llama.cpp's llama_state_get_size / get_data / set_data): n_past, the
 * KV cache rows below it, the GDN recurrent and conv states (clover-spec 6) and the state saved by
 * clover_context_save_state, behind a header that ties them to the model, the cache types and
 * n_ctx. A resident model's KV cache and the GDN states current on the GPU are copied through the
 * backend's transfers (gpu/device_state.c). */
#include "gpu/device_state.h"
#include "model/model.h"

#include <stdatomic.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#define STATE_MAGIC "CLVSTATE"
#define STATE_VERSION 1u
#define FNV_OFFSET 14695981039346656037ull
#define FNV_PRIME 1099511628211ull

/* The header, in host byte order, followed by the payload: K rows [n_attn][n_past][kv_dim] of
 * type_k, V rows the same of type_v, gdn [n_gdn][gdn_floats] and conv [n_gdn][conv_floats] float32,
 * then, when keep_n > 0, the saved state's gdn and conv in the same layout. checksum covers the
 * header bytes before it and the payload. */
typedef struct {
    char magic[8];
    uint32_t version;
    int32_t n_layer, n_attn, n_gdn;
    int64_t kv_dim, gdn_floats, conv_floats; /* per layer: n_head_kv * head_dim; Hv dk dv; (d_conv - 1) C */
    uint64_t fingerprint;                    /* model_fingerprint */
    int32_t type_k, type_v;
    int32_t n_ctx, n_past, keep_n, reserved; /* n_ctx of the context that saved it (information) */
    uint64_t checksum;
} state_header;
_Static_assert(sizeof(state_header) == 88, "state_header has no padding");

/* Byte counts of the payload's parts and of the whole state. */
typedef struct {
    size_t k, v, gdn, conv, keep, total;
} state_layout;

/* FNV-1a over n bytes, continuing h. */
static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * FNV_PRIME;
    return h;
}

/* The checksum's hash: 8 bytes a step (a rotation carries every bit into the low ones), the tail
 * bytewise; continues h. */
static uint64_t hash_words(uint64_t h, const unsigned char *p, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h = (((h << 23) | (h >> 41)) ^ w) * FNV_PRIME;
    }
    return fnv1a(h, p + i, n - i);
}

/* What ties a state to a model: the trunk's hyperparameters, the layer pattern and the leading
 * bytes of a few weights (the first rows of the token embedding and the output projection, the
 * output norm, each layer's input norm), so a file of other weights with the same shapes (another
 * checkpoint, another quantisation) differs. The block tensors and the decoding record are not
 * included: a sidecar does not change the caches. */
static uint64_t model_fingerprint(const clover_model *m) {
    const clover_hparams *hp = &m->hp;
    const int32_t dims[] = {hp->n_vocab,     hp->n_embd,      hp->n_layer,     hp->n_head,        hp->n_head_kv,
                            hp->head_dim,    hp->rope_dim,    hp->ssm_d_state, hp->ssm_n_group,   hp->ssm_dt_rank,
                            hp->ssm_d_inner, hp->ssm_d_conv,  hp->n_expert,    hp->n_expert_used, hp->n_ff_exp,
                            hp->n_ff_shexp};
    const float eps_theta[2] = {hp->rms_eps, hp->rope_theta};
    uint64_t h = fnv1a(FNV_OFFSET, dims, sizeof dims);
    h = fnv1a(h, eps_theta, sizeof eps_theta);
    const clover_tensor *rows[2] = {&m->tok_embd, &m->output};
    for (int i = 0; i < 2; i++) {
        const int64_t nb = clover_type_nbytes(rows[i]->type, rows[i]->ne[0]);
        h = fnv1a(h, &rows[i]->type, sizeof rows[i]->type);
        if (rows[i]->data && nb > 0) h = fnv1a(h, rows[i]->data, (size_t)nb);
    }
    const size_t norm = sizeof(float) * (size_t)hp->n_embd;
    if (m->output_norm) h = fnv1a(h, m->output_norm, norm);
    for (int il = 0; il < hp->n_layer; il++) {
        const clover_layer *ly = &m->layers[il];
        h = fnv1a(h, &ly->is_attn, sizeof ly->is_attn);
        if (ly->attn_norm) h = fnv1a(h, ly->attn_norm, norm);
    }
    return h;
}

/* The header of m's states with these cache types and counts (checksum 0). */
static state_header header_of(const clover_model *m, int32_t type_k, int32_t type_v, int32_t n_ctx, int32_t n_past,
                              int32_t keep_n) {
    const clover_hparams *hp = &m->hp;
    state_header h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, STATE_MAGIC, sizeof h.magic);
    h.version = STATE_VERSION;
    h.n_layer = hp->n_layer, h.n_attn = m->n_attn, h.n_gdn = m->n_gdn;
    h.kv_dim = (int64_t)hp->n_head_kv * hp->head_dim;
    h.gdn_floats = gdn_state_floats(hp);
    h.conv_floats = (int64_t)(hp->ssm_d_conv - 1) * conv_channels(hp);
    h.fingerprint = model_fingerprint(m);
    h.type_k = type_k, h.type_v = type_v;
    h.n_ctx = n_ctx, h.n_past = n_past, h.keep_n = keep_n;
    return h;
}

/* The byte counts of a state with header h (its dimensions checked against the model before):
 * CLOVER_OK, or CLOVER_E_NOMEM when a size overflows size_t. */
static int layout_of(const state_header *h, state_layout *out) {
    size_t rows, gdn_one, conv_one;
    if (h->n_past < 0 || h->kv_dim < 0 || h->n_attn < 0 || h->n_gdn < 0 || h->gdn_floats < 0 || h->conv_floats < 0 ||
        __builtin_mul_overflow((size_t)h->n_attn, (size_t)h->n_past, &rows) ||
        __builtin_mul_overflow(rows, (size_t)h->kv_dim, &rows) ||
        __builtin_mul_overflow(rows, kv_elem_bytes(h->type_k), &out->k) ||
        __builtin_mul_overflow(rows, kv_elem_bytes(h->type_v), &out->v) ||
        __builtin_mul_overflow((size_t)h->gdn_floats, sizeof(float), &gdn_one) ||
        __builtin_mul_overflow(gdn_one, (size_t)h->n_gdn, &out->gdn) ||
        __builtin_mul_overflow((size_t)h->conv_floats, sizeof(float), &conv_one) ||
        __builtin_mul_overflow(conv_one, (size_t)h->n_gdn, &out->conv) ||
        __builtin_add_overflow(out->gdn, out->conv, &out->keep))
        return CLOVER_E_NOMEM;
    if (h->keep_n <= 0) out->keep = 0;
    size_t t = sizeof(state_header);
    if (__builtin_add_overflow(t, out->k, &t) || __builtin_add_overflow(t, out->v, &t) ||
        __builtin_add_overflow(t, out->gdn, &t) || __builtin_add_overflow(t, out->conv, &t) ||
        __builtin_add_overflow(t, out->keep, &t))
        return CLOVER_E_NOMEM;
    out->total = t;
    return CLOVER_OK;
}

/* The saved state (clover_context_save_state) as the context would restore it: its n_past, or 0. */
static int32_t keep_of(const clover_context *c) {
    return c->keep_n > 0 && c->keep_n <= c->n_past && c->keep_state && c->keep_conv ? c->keep_n : 0;
}

static uint64_t checksum_of(const unsigned char *state, size_t total) {
    const size_t at = offsetof(state_header, checksum);
    const uint64_t h = hash_words(FNV_OFFSET, state, at);
    return hash_words(h, state + sizeof(state_header), total - sizeof(state_header));
}

int64_t clover_state_get_size(const clover_context *c) {
    if (!c) return CLOVER_E_ARG;
    const state_header h = header_of(c->m, c->type_k, c->type_v, c->n_ctx, c->n_past, keep_of(c));
    state_layout lay = {0};
    if (layout_of(&h, &lay) != CLOVER_OK || lay.total > (size_t)INT64_MAX) return CLOVER_E_NOMEM;
    return (int64_t)lay.total;
}

/* Copy (to_dev 0: from the caches to buf; 1: from buf to the caches) rows [0, n_past) of every
 * attention layer's K and V cache: the host cache, or a resident model's device cache. */
static int copy_kv(clover_context *c, unsigned char *buf, const state_layout *lay, int to_dev, char *err,
                   size_t err_size) {
    const size_t kv = (size_t)c->m->hp.n_head_kv * (size_t)c->m->hp.head_dim;
    const size_t es[2] = {kv_elem_bytes(c->type_k), kv_elem_bytes(c->type_v)};
    void *caches[2] = {c->kv_host ? c->k_cache : c->k_dev, c->kv_host ? c->v_cache : c->v_dev};
    unsigned char *part[2] = {buf, buf + lay->k};
    for (int kvi = 0; kvi < 2; kvi++) {
        const size_t layer = kv * (size_t)c->n_ctx * es[kvi], rows = kv * (size_t)c->n_past * es[kvi];
        for (int a = 0; a < c->m->n_attn && rows > 0; a++) {
            unsigned char *p = part[kvi] + rows * (size_t)a;
            int rc = CLOVER_OK;
            if (c->kv_host && to_dev) memcpy((char *)caches[kvi] + layer * (size_t)a, p, rows);
            else if (c->kv_host) memcpy(p, (const char *)caches[kvi] + layer * (size_t)a, rows);
            else if (to_dev) rc = clover_cuda_write(caches[kvi], layer * (size_t)a, p, rows, err, err_size);
            else rc = clover_cuda_read(caches[kvi], layer * (size_t)a, p, rows, err, err_size);
            if (rc != CLOVER_OK) return rc;
        }
    }
    return CLOVER_OK;
}

int64_t clover_state_get_data(clover_context *c, uint8_t *dst, size_t size, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (!dst) return clover_set_err(err, err_size, CLOVER_E_ARG, "dst is NULL");
    state_header h = header_of(c->m, c->type_k, c->type_v, c->n_ctx, c->n_past, keep_of(c));
    state_layout lay = {0};
    if (layout_of(&h, &lay) != CLOVER_OK || lay.total > (size_t)INT64_MAX)
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_past: %d: the state's size overflows", c->n_past);
    if (size < lay.total)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "size: %zu bytes, the state needs %zu (clover_state_get_size)",
                              size, lay.total);
    int rc = gdn_to_host(c, err, err_size); /* the GDN states current on the GPU */
    unsigned char *p = dst + sizeof h;
    if (rc == CLOVER_OK) rc = copy_kv(c, p, &lay, 0, err, err_size);
    if (rc != CLOVER_OK) return rc;
    p += lay.k + lay.v;
    memcpy(p, c->gdn_state, lay.gdn), p += lay.gdn;
    memcpy(p, c->conv_state, lay.conv), p += lay.conv;
    if (lay.keep) {
        memcpy(p, c->keep_state, lay.gdn), p += lay.gdn;
        memcpy(p, c->keep_conv, lay.conv);
    }
    memcpy(dst, &h, sizeof h);
    h.checksum = checksum_of(dst, lay.total);
    memcpy(dst, &h, sizeof h);
    return (int64_t)lay.total;
}

/* CLOVER_OK when the header h read from size bytes can be loaded into c (then *lay is its layout),
 * else the error naming the field: CLOVER_E_ARG for bytes that are not a whole state, CLOVER_E_STATE
 * for a state of another model, other cache types or more tokens than c's n_ctx. */
static int check_header(const clover_context *c, const state_header *h, size_t size, state_layout *lay, char *err,
                        size_t err_size) {
    if (memcmp(h->magic, STATE_MAGIC, sizeof h->magic) != 0)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: not a clover context state (magic)");
    if (h->version != STATE_VERSION)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: format version %u, this library reads %u",
                              h->version, STATE_VERSION);
    const state_header want = header_of(c->m, c->type_k, c->type_v, c->n_ctx, 0, 0);
    const struct {
        const char *name;
        int64_t got, want;
    } dims[] = {{"n_layer", h->n_layer, want.n_layer},       {"attention layers", h->n_attn, want.n_attn},
                {"GDN layers", h->n_gdn, want.n_gdn},         {"n_head_kv * head_dim", h->kv_dim, want.kv_dim},
                {"GDN state floats", h->gdn_floats, want.gdn_floats}, {"conv floats", h->conv_floats, want.conv_floats}};
    for (size_t i = 0; i < sizeof dims / sizeof dims[0]; i++)
        if (dims[i].got != dims[i].want)
            return clover_set_err(err, err_size, CLOVER_E_STATE, "state: %s %lld, this model's %lld (a state of another model)",
                                  dims[i].name, (long long)dims[i].got, (long long)dims[i].want);
    if (h->fingerprint != want.fingerprint)
        return clover_set_err(err, err_size, CLOVER_E_STATE,
                              "state: saved from another model (fingerprint %016llx, this model's %016llx)",
                              (unsigned long long)h->fingerprint, (unsigned long long)want.fingerprint);
    if (h->type_k != c->type_k || h->type_v != c->type_v) {
        const int k = h->type_k != c->type_k;
        const int32_t got = k ? h->type_k : h->type_v, have = k ? c->type_k : c->type_v;
        const char *gn = clover_type_name(got);
        return clover_set_err(err, err_size, CLOVER_E_STATE, "state: %s %s, this context's %s", k ? "type_k" : "type_v",
                              gn ? gn : "?", clover_type_name(have));
    }
    if (h->n_past < 0 || h->keep_n < 0 || h->keep_n > h->n_past)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: n_past %d, saved %d (corrupted)", h->n_past, h->keep_n);
    if (h->n_past > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "state: n_past %d tokens do not fit this context's n_ctx %d",
                              h->n_past, c->n_ctx);
    if (layout_of(h, lay) != CLOVER_OK)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: n_past %d: the size overflows", h->n_past);
    if (size != lay->total)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: %zu bytes, its header describes %zu (truncated or "
                              "corrupted)", size, lay->total);
    return CLOVER_OK;
}

int64_t clover_state_set_data(clover_context *c, const uint8_t *src, size_t size, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (!src) return clover_set_err(err, err_size, CLOVER_E_ARG, "src is NULL");
    state_header h;
    if (size < sizeof h)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: %zu bytes, shorter than its header (%zu)", size,
                              sizeof h);
    memcpy(&h, src, sizeof h);
    state_layout lay = {0};
    int rc = check_header(c, &h, size, &lay, err, err_size);
    if (rc != CLOVER_OK) return rc;
    if (checksum_of(src, size) != h.checksum)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "state: checksum mismatch (corrupted)");
    if (lay.keep && !c->keep_state) c->keep_state = malloc(lay.gdn + 1);
    if (lay.keep && !c->keep_conv) c->keep_conv = malloc(lay.conv + 1);
    if (lay.keep && (!c->keep_state || !c->keep_conv))
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the saved state");
    /* from here on the context changes: a failed device transfer leaves it reset */
    clover_context_reset(c);
    const unsigned char *p = src + sizeof h;
    c->n_past = h.n_past;
    if (!c->kv_host) rc = kv_dev_alloc(c, err, err_size);
    if (rc == CLOVER_OK) rc = copy_kv(c, (unsigned char *)p, &lay, 1, err, err_size);
    if (rc != CLOVER_OK) {
        clover_context_reset(c);
        return rc;
    }
    if (c->kv_dev_rows) /* the device copies of host rows are stale; a resident cache holds them all */
        for (int a = 0; a < c->m->n_attn; a++) c->kv_dev_rows[a] = c->kv_host ? 0 : h.n_past;
    p += lay.k + lay.v;
    memcpy(c->gdn_state, p, lay.gdn), p += lay.gdn; /* clover_context_reset marked the host copy current */
    memcpy(c->conv_state, p, lay.conv), p += lay.conv;
    if (lay.keep) {
        memcpy(c->keep_state, p, lay.gdn), p += lay.gdn;
        memcpy(c->keep_conv, p, lay.conv);
        c->keep_n = h.keep_n;
    }
    atomic_store(&c->abort_req, 0);
    return (int64_t)size;
}
