/* context.c: the per-sequence context (clover-spec 5): the KV cache of the attention layers,
 * the GDN state and conv history of the GDN layers, their memory estimate, creation (with the
 * GPU's share reserved, gpu/device_state.c), reset and free. */
#define _POSIX_C_SOURCE 200809L
#include "gpu/device_state.h"
#include "gpu/forward_resident.h"
#include "model/model.h"
#include "model/pass.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* calloc of a*b*c elements of es bytes with overflow check. */
static void *alloc_elems(int64_t a, int64_t b, int64_t c, size_t es) {
    if (a <= 0 || b <= 0 || c <= 0) return calloc(1, es);
    if (a > INT64_MAX / b || a * b > INT64_MAX / c) return NULL;
    uint64_t n = (uint64_t)(a * b * c);
    if (n > SIZE_MAX / es) return NULL;
    return calloc((size_t)n, es);
}

static float *alloc_floats(int64_t a, int64_t b, int64_t c) { return alloc_elems(a, b, c, sizeof(float)); }

/* Physical cores (distinct package/core id pairs in Linux sysfs), else the online CPU count:
 * the default thread count, as llama.cpp's (SMT siblings share the load/store units and only
 * add contention to bandwidth-bound products). */
static int32_t physical_cores(void) {
    long online = 1;
#ifdef _SC_NPROCESSORS_ONLN
    online = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (online < 1) online = 1;
    if (online > 4096) online = 4096;
    long *ids = malloc(sizeof(long) * (size_t)online);
    int32_t n = 0;
    for (long cpu = 0; ids && cpu < online; cpu++) {
        long core = -1, pkg = 0;
        char path[128];
        FILE *fp;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/core_id", cpu);
        if ((fp = fopen(path, "r"))) {
            if (fscanf(fp, "%ld", &core) != 1) core = -1;
            fclose(fp);
        }
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/physical_package_id", cpu);
        if ((fp = fopen(path, "r"))) {
            if (fscanf(fp, "%ld", &pkg) != 1) pkg = 0;
            fclose(fp);
        }
        if (core < 0) { /* no topology: count every CPU */
            n = 0;
            break;
        }
        long id = pkg * 65536 + core;
        int seen = 0;
        for (int32_t i = 0; i < n && !seen; i++) seen = ids[i] == id;
        if (!seen) ids[n++] = id;
    }
    free(ids);
    return n > 0 ? n : (int32_t)online;
}

int64_t clover_context_mem_required(const clover_model *m, int32_t n_ctx, int32_t type_k, int32_t type_v) {
    if (!m || n_ctx <= 0 || !kv_elem_bytes(type_k) || !kv_elem_bytes(type_v)) return -1;
    const clover_hparams *hp = &m->hp;
    const int64_t kv = (int64_t)hp->n_head_kv * hp->head_dim; /* <= 2^28 by the loader's limits */
    const int64_t per_layer = (int64_t)hp->n_layer * (int64_t)sizeof(int32_t);
    int64_t cache, gdn, total;
    /* n_attn x n_ctx x kv elements of K and of V, checked: the loader's limits alone allow 2^72 */
    const int64_t host_kv = m->resident ? 0 : m->n_attn; /* the resident forward keeps its KV cache on the GPU */
    if (__builtin_mul_overflow(host_kv * n_ctx, kv, &cache) ||
        __builtin_mul_overflow(cache, (int64_t)(kv_elem_bytes(type_k) + kv_elem_bytes(type_v)), &cache) ||
        __builtin_mul_overflow((int64_t)m->n_gdn, gdn_state_floats(hp) + (hp->ssm_d_conv - 1) * conv_channels(hp), &gdn) ||
        __builtin_mul_overflow(gdn, (int64_t)sizeof(float), &gdn) || __builtin_add_overflow(cache, gdn, &total) ||
        __builtin_add_overflow(total, per_layer, &total))
        return INT64_MAX;
    return total;
}

/* Bytes the kernel reports as available (MemAvailable in /proc/meminfo), else physical memory;
 * -1 when neither is known. */
static int64_t available_memory(void) {
    FILE *fp = fopen("/proc/meminfo", "r");
    if (fp) {
        char line[256];
        long long kb;
        while (fgets(line, sizeof line, fp))
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) {
                fclose(fp);
                return (int64_t)kb * 1024;
            }
        fclose(fp);
    }
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psize > 0) return (int64_t)pages * psize;
#endif
    return -1;
}

clover_context *clover_context_new(clover_model *m, int32_t n_ctx, int32_t n_threads, int32_t type_k,
                                   int32_t type_v, char *err, size_t err_size) {
    if (!m) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
        return NULL;
    }
    if (n_ctx <= 0) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "n_ctx: %d must be > 0", n_ctx);
        return NULL;
    }
    const int32_t types[2] = {type_k, type_v};
    for (int i = 0; i < 2; i++)
        if (!kv_elem_bytes(types[i])) {
            clover_set_err(err, err_size, CLOVER_E_ARG, "%s: cache type %d is not supported (F16 = %d or F32 = %d)",
                           i ? "type_v" : "type_k", types[i], CLOVER_TYPE_F16, CLOVER_TYPE_F32);
            return NULL;
        }
    const int64_t need = clover_context_mem_required(m, n_ctx, type_k, type_v), avail = available_memory();
    if (avail > 0 && need > avail) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_ctx: %d needs %.2f GiB for the KV cache and GDN state, "
                       "but only %.2f GiB of memory is available: use a smaller n_ctx", n_ctx,
                       (double)need / (1 << 30), (double)avail / (1 << 30));
        return NULL;
    }
    if (n_threads <= 0) n_threads = physical_cores();
    clover_context *c = calloc(1, sizeof *c);
    if (!c) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        return NULL;
    }
    const clover_hparams *hp = &m->hp;
    c->m = m;
    c->n_ctx = n_ctx;
    c->n_threads = c->n_threads_1 = c->n_threads_batch = n_threads;
    c->gdn_chunked = 1;
    const char *graphs = getenv("CLOVER_CUDA_GRAPHS");
    c->graphs = !(graphs && strcmp(graphs, "0") == 0);
    atomic_init(&c->abort_req, 0);
    int64_t kv = (int64_t)hp->n_head_kv * hp->head_dim;
    /* a resident model's forwards use the device KV cache only (res_attention_layer) */
    c->type_k = type_k, c->type_v = type_v;
    c->k_cache = alloc_elems(m->resident ? 0 : m->n_attn, n_ctx, kv, kv_elem_bytes(type_k));
    c->v_cache = alloc_elems(m->resident ? 0 : m->n_attn, n_ctx, kv, kv_elem_bytes(type_v));
    c->kv_host = !m->resident;
    c->gdn_state = alloc_floats(m->n_gdn, gdn_state_floats(hp), 1);
    c->conv_state = alloc_floats(m->n_gdn, hp->ssm_d_conv - 1, conv_channels(hp));
    c->nexp_full = calloc((size_t)hp->n_layer, sizeof(int32_t));
    if (!c->k_cache || !c->v_cache || !c->gdn_state || !c->conv_state || !c->nexp_full) {
        clover_context_free(c);
        clover_set_err(err, err_size, CLOVER_E_NOMEM,
                       "n_ctx: %d needs a KV cache of %lld values per layer, allocation failed", n_ctx,
                       (long long)(2 * kv * (int64_t)n_ctx));
        return NULL;
    }
    char why[256] = "";
    const int rc = m->gpu_bytes ? gpu_state_reserve(c, why, sizeof why) : CLOVER_OK;
    if (rc != CLOVER_OK) {
        clover_context_free(c);
        clover_set_err(err, err_size, rc, "n_ctx: %d: the KV cache and GDN state on the GPU: %s", n_ctx, why);
        return NULL;
    }
    return c;
}

void clover_context_free(clover_context *c) {
    if (!c) return;
    clover_context_set_batch(c, NULL, NULL, 0); /* detached: its batch waits for it no more */
    gpu_context_uncount(c); /* the last one gives the backend's shared scratch back */
    for (size_t i = 0; i < sizeof c->graph / sizeof c->graph[0]; i++) clover_cuda_graph_free(c->graph[i].exec);
    free(c->k_cache);
    free(c->v_cache);
    free(c->gdn_state);
    free(c->conv_state);
    free(c->snap_state), free(c->snap_conv);
    free(c->keep_state), free(c->keep_conv);
    free(c->rec_qkv), free(c->rec_cv), free(c->rec_b), free(c->rec_a);
    free(c->nexp_full);
    clover_cuda_free(c->k_dev), clover_cuda_free(c->v_dev);
    free(c->kv_dev_rows);
    clover_cuda_free(c->gdn_dev), clover_cuda_free(c->gdn_snap_dev);
    free(c->gdn_on_dev), free(c->snap_on_dev);
    clover_cuda_free(c->res_ws), clover_cuda_free(c->conv_dev), clover_cuda_free(c->conv_snap_dev);
    clover_cuda_free(c->rec_dev), clover_cuda_free(c->ops_dev), clover_cuda_free(c->pre_dev);
    moe_host_release(c);
    for (int s = 0; s < SCRATCH_SLOTS; s++) free(c->scratch[s].p);
    free(c);
}

int32_t clover_context_n_past(const clover_context *c) { return c ? c->n_past : 0; }
int32_t clover_context_n_ctx(const clover_context *c) { return c ? c->n_ctx : 0; }
void clover_context_abort(clover_context *c) {
    if (c) atomic_store(&c->abort_req, 1);
}

void clover_context_set_n_threads(clover_context *c, int32_t n_threads, int32_t n_threads_batch) {
    if (!c) return;
    c->n_threads_1 = n_threads > 0 ? n_threads : physical_cores();
    c->n_threads_batch = n_threads_batch > 0 ? n_threads_batch : physical_cores();
}

int32_t clover_context_set_n_ubatch(clover_context *c, int32_t n_ubatch) {
    if (!c || n_ubatch < 0) return CLOVER_E_ARG;
    c->n_ubatch = n_ubatch == 0 ? 0 : n_ubatch < CLOVER_GDN_CHUNK ? CLOVER_GDN_CHUNK
                                                                 : n_ubatch / CLOVER_GDN_CHUNK * CLOVER_GDN_CHUNK;
    return c->n_ubatch;
}

void clover_context_set_gdn_chunked(clover_context *c, int chunked) {
    if (c) c->gdn_chunked = chunked != 0;
}

void clover_context_reset(clover_context *c) {
    if (!c) return;
    const clover_hparams *hp = &c->m->hp;
    atomic_store(&c->abort_req, 0);
    c->n_past = 0;
    c->keep_n = 0; /* the KV rows below a saved state are about to be overwritten */
    c->rec_on = 0;
    c->rec_n = 0;
    memset(c->gdn_state, 0, sizeof(float) * (size_t)(c->m->n_gdn * gdn_state_floats(hp)));
    if (c->gdn_on_dev) memset(c->gdn_on_dev, 0, (size_t)c->m->n_gdn); /* the host copy is current */
    memset(c->conv_state, 0,
           sizeof(float) * (size_t)(c->m->n_gdn * (hp->ssm_d_conv - 1) * conv_channels(hp)));
}
