/* moe_resident.c: the MoE layer (clover-spec 2.3, 5.6) on the device, resident forward; routed experts kept on the CPU through model/moe.c cpu_experts.
 * Twin: model/moe.c (the same steps on the CPU path). */
#include "gpu/moe_resident.h"
#include "gpu/device_state.h"
#include "model/moe.h"
#include <stdlib.h>
#include <string.h>

/* The shared expert's products after its input products (on the GPU): gt = silu(gt) * up, ys =
 * down_sh gt. */
static int res_shared_rest(fwd *f, const clover_layer *ly, const res_bufs *b) {
    const int rc = clover_cuda_swiglu_d(b->gt, b->up, f->T * f->c->m->hp.n_ff_shexp, f->err, f->err_size);
    return rc ? rc : mm_d(f, &ly->down_sh, b->gt, f->T, b->ys);
}

/* The routed experts of a layer kept on the CPU (--n-cpu-moe) in a resident pass: the routed
 * pairs' inputs (b->xg, bucketed by expert) and the buckets (b->tiles) come down, the shared
 * expert's last launches (res_shared_rest) are queued so that the GPU runs them meanwhile, the
 * CPU runs each used expert over its bucket (cpu_experts, as moe_layer), and the outputs go up
 * to b->yg: two reads and one write a layer, the rest of the layer on the GPU. */
static int res_cpu_experts(fwd *f, const clover_layer *ly, const res_bufs *b) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t H = hp->n_embd, E = hp->n_expert, P = f->T * hp->n_expert_used, n_tiles = clover_cuda_route_tiles(P, E);
    char *err = f->err;
    const size_t es = f->err_size;
    const size_t rows_bytes = sizeof(float) * (size_t)(P * H);
    const size_t need = 2 * rows_bytes + sizeof(int32_t) * (size_t)(3 * n_tiles); /* xg, yg, tiles */
    int rc = CLOVER_OK;
    if (need > c->moe_host_cap) { /* page-locked staging, kept by the context (else plain memory) */
        moe_host_release(c);
        c->moe_host_pinned = clover_cuda_host_alloc(need, &c->moe_host, NULL, 0) == CLOVER_OK;
        if (!c->moe_host_pinned) c->moe_host = malloc(need);
        if (c->moe_host) c->moe_host_cap = need;
        else rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory (experts on the CPU: %zu bytes)", need);
    }
    float *xg = c->moe_host, *yg = xg ? xg + P * H : NULL;
    int32_t *tl = yg ? (int32_t *)(yg + P * H) : NULL;
    scratch_plan sp = {0};
    const int istart = scratch_add(&sp, E + 1, sizeof(int64_t));
    int64_t *start = scratch_part(scratch_carve(c, SCRATCH_LAYER, &sp), &sp, istart);
    if (start) memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
    if (rc == CLOVER_OK && !start) rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory (experts on the CPU)");
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->tiles, 0, tl, sizeof(int32_t) * (size_t)(3 * n_tiles), err, es);
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->xg, 0, xg, rows_bytes, err, es);
    if (rc == CLOVER_OK) rc = res_shared_rest(f, ly, b);
    int32_t n_used = 0;
    for (int64_t i = 0; i < n_tiles && rc == CLOVER_OK; i++) { /* tiles (e, t0, nr): every bucket in expert order */
        const int32_t e = tl[3 * i], nr = tl[3 * i + 2];
        if (nr <= 0) continue;
        if (e < 0 || e >= E) {
            rc = clover_set_err(err, es, CLOVER_E_DEVICE, "routing on the GPU gave expert %d of %lld", e, (long long)E);
            break;
        }
        n_used += start[e + 1] == 0;
        start[e + 1] += nr;
    }
    for (int64_t e = 0; e < E && rc == CLOVER_OK; e++) start[e + 1] += start[e];
    if (rc == CLOVER_OK && start[E] != P)
        rc = clover_set_err(err, es, CLOVER_E_DEVICE, "routing on the GPU gave %lld pairs, not %lld", (long long)start[E],
                            (long long)P);
    if (rc == CLOVER_OK && cpu_experts(c, ly, hp->n_ff_exp, H, E, n_used, start, xg, yg))
        rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory in the routed experts (on the CPU)");
    if (rc == CLOVER_OK) rc = clover_cuda_write(b->yg, 0, yg, rows_bytes, err, es);
    return rc;
}

/* moe_layer on the device, its result added to x (flags: this layer's slots); routed experts
 * kept on the CPU through res_cpu_experts. */
int res_moe_layer(fwd *f, const clover_layer *ly, int il, const res_bufs *b) {
    const clover_hparams *hp = &f->c->m->hp;
    const int64_t T = f->T, H = hp->n_embd, E = hp->n_expert, k = hp->n_expert_used, P = T * k;
    char *err = f->err;
    const size_t es = f->err_size;
    const clover_cuda_weight g = cuda_weight(&ly->gate_exps), u = cuda_weight(&ly->up_exps),
                             dn = cuda_weight(&ly->down_exps);
    const clover_tensor *w[4] = {&ly->router, &ly->shexp_gate, &ly->gate_sh, &ly->up_sh};
    float *y[4] = {b->probs, b->sg, b->gt, b->up};
    int rc;
    if ((rc = mm_n_d(f, 4, w, b->xn, T, y)) || /* the router and the shared expert's input products */
        (rc = clover_cuda_route_d(b->probs, T, E, (int32_t)k, f->mode == MODE_BLOCK ? f->coreset_top_p : 0.0f, b->sel,
                                  b->wsel, b->prow, b->pw, b->pair, b->tiles,
                                  b->flags + 2 * hp->n_layer + 2 * il, err, es)) ||
        (rc = clover_cuda_gather_d(b->xn, b->prow, P, H, b->xg, err, es)))
        return rc;
    if (!ly->gate_exps.dev) rc = res_cpu_experts(f, ly, b);
    else if (!(rc = clover_cuda_experts_d(&g, &u, &dn, b->tiles, clover_cuda_route_tiles(P, E), P, b->xg, b->yg, err, es)))
        rc = res_shared_rest(f, ly, b);
    if (rc) return rc;
    return clover_cuda_moe_combine_d(b->x, b->yg, b->pw, b->pair, (int32_t)k, b->ys, b->sg, T, H, b->flags + 2 * il + 1,
                                     err, es);
}
