/* moe.c: the MoE layer (clover-spec 2.3) on the CPU path: router softmax, top-k (over the
 * coreset in block mode, spec 5.6), rows bucketed by expert, each used expert's SwiGLU once over
 * its rows (on the GPU when offloaded), the shared expert with its sigmoid gate, and the
 * weighted sum in a fixed order.
 * Twin: gpu/moe_resident.c (the same steps on the device, resident forward). */
#define _POSIX_C_SOURCE 200809L
#include "model/moe.h"
#include "cpu/kernels.h"
#include "quant/matmul.h"

#include <float.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ MoE (spec 2.3, 5.6) */

/* Indices of the k largest p[i] among allowed experts (allowed == NULL: all), largest first,
 * ties to the lower id. */
static void topk(const float *p, int64_t n, const unsigned char *allowed, int64_t k, int32_t *idx) {
    for (int64_t s = 0; s < k; s++) {
        int32_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            if (allowed && !allowed[e]) continue;
            int taken = 0;
            for (int64_t u = 0; u < s; u++) taken |= idx[u] == e;
            if (taken) continue;
            if (best < 0 || p[e] > p[best]) best = (int32_t)e;
        }
        idx[s] = best;
    }
}

/* Coreset C (spec 5.6): allowed[e] = 1 for the first m experts by aggregated top-k mass. */
static void coreset(const float *probs, int64_t T, int64_t E, int64_t k, double top_p, unsigned char *allowed,
                    double *S, int32_t *order, int32_t *idx) {
    if (E <= 0) return; /* the loader guarantees n_expert > 0 */
    for (int64_t e = 0; e < E; e++) S[e] = 0;
    for (int64_t t = 0; t < T; t++) {
        topk(probs + t * E, E, NULL, k, idx);
        for (int64_t s = 0; s < k; s++) S[idx[s]] += probs[t * E + idx[s]];
    }
    double tot = 0;
    for (int64_t e = 0; e < E; e++) tot += S[e];
    for (int64_t e = 0; e < E; e++) {
        S[e] = tot > 0 ? S[e] / tot : 0;
        order[e] = (int32_t)e;
    }
    /* stable insertion sort by S descending (ties: lower id first) */
    for (int64_t i = 1; i < E; i++) {
        int32_t x = order[i];
        int64_t j = i - 1;
        while (j >= 0 && S[order[j]] < S[x]) {
            order[j + 1] = order[j];
            j--;
        }
        order[j + 1] = x;
    }
    int64_t m = E;
    double cum = 0;
    for (int64_t i = 0; i < E; i++) {
        cum += S[order[i]];
        if (cum >= top_p) {
            m = i + 1;
            break;
        }
    }
    if (m < k) m = k;
    memset(allowed, 0, (size_t)E);
    for (int64_t i = 0; i < m; i++) allowed[order[i]] = 1;
}

/* One expert's SwiGLU over its n gathered rows (spec 2.3 step 2), single-threaded:
 * y = W_down (silu(W_gate x) * W_up x). gt, up: scratch [n, I]. */
static int expert_ffn(const clover_layer *ly, int64_t e, int64_t I, const float *x, int64_t n, float *gt, float *up,
                      float *y) {
    clover_tensor wg = expert_view(&ly->gate_exps, e), wu = expert_view(&ly->up_exps, e);
    clover_tensor wd = expert_view(&ly->down_exps, e);
    if (wmatmul(&wg, x, n, gt, 1, NULL, 0) || wmatmul(&wu, x, n, up, 1, NULL, 0)) return CLOVER_E_NOMEM;
    for (int64_t i = 0; i < n * I; i++) gt[i] = silu(gt[i]) * up[i];
    return wmatmul(&wd, gt, n, y, 1, NULL, 0) ? CLOVER_E_NOMEM : CLOVER_OK;
}

/* The shared expert of a layer before its gate (spec 2.3 step 3): ys = W_down (silu(W_gate x) *
 * W_up x) and the gate logits sg[t] = w . x[t], for T rows of xn; gt, up: scratch [T][Is].
 * rc: 0 done, non-zero failed. A pthread start routine, so that it can overlap the routed
 * experts (moe_layer), or a task of their region (experts_tasks). */
typedef struct {
    const clover_context *c;
    const clover_layer *ly;
    const float *xn;
    int64_t T, Is;
    float *sg, *gt, *up, *ys;
    int n_threads; /* for products on the CPU */
    int rc;        /* CLOVER_OK, or the code of the product that failed */
    char err[256]; /* and its message, if the GPU gave one */
} shared_job;

/* y = w x for the shared expert's job (wmatmul, a GPU error into j->err). */
static int shared_mm(shared_job *j, const clover_tensor *w, const float *x, float *y) {
    return wmatmul(w, x, j->T, y, j->n_threads, j->err, sizeof j->err);
}

static void *shared_expert(void *arg) {
    shared_job *j = arg;
    const clover_layer *ly = j->ly;
    if ((j->rc = shared_mm(j, &ly->shexp_gate, j->xn, j->sg)) || (j->rc = shared_mm(j, &ly->gate_sh, j->xn, j->gt)) ||
        (j->rc = shared_mm(j, &ly->up_sh, j->xn, j->up)))
        return NULL;
    for (int64_t i = 0; i < j->T * j->Is; i++) j->gt[i] = silu(j->gt[i]) * j->up[i];
    j->rc = shared_mm(j, &ly->down_sh, j->gt, j->ys);
    return NULL;
}

/* The routed experts on the CPU: expert e over its bucket [start[e], start[e+1]) of xg into yg
 * (n_used non-empty buckets), experts spread over the threads, one task per expert, so a pass
 * forks once instead of once per product; sj (may be NULL): the shared expert's job, one more
 * task (the first, on one thread). Non-zero on failure (out of memory). */
static int experts_tasks(clover_context *c, const clover_layer *ly, int64_t I, int64_t H, int64_t E, int32_t n_used,
                         const int64_t *start, const float *xg, float *yg, shared_job *sj) {
    int err_any = 0;
    int64_t n_max = 0;
    for (int64_t e = 0; e < E; e++) n_max = start[e + 1] - start[e] > n_max ? start[e + 1] - start[e] : n_max;
    size_t stride = 0; /* per thread: the gate and up products of the largest bucket, [n_max][I] each */
    int64_t per = 0;
    char *ts = __builtin_mul_overflow(n_max, 2 * I, &per) ? NULL : thread_scratch(c, per, sizeof(float), &stride);
    if (!ts) return 1;
    if (sj) sj->n_threads = 1;
#ifdef _OPENMP
#pragma omp parallel num_threads(c->n_threads) if (c->n_threads > 1 && n_used + (sj != NULL) > 1)
#endif
    {
        float *tg = (float *)(ts + (size_t)thread_index() * stride), *tu = tg + n_max * I;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t e = sj ? -1 : 0; e < E; e++) {
            if (e < 0) {
                shared_expert(sj);
                continue;
            }
            const int64_t n = start[e + 1] - start[e];
            if (n == 0) continue;
            if (expert_ffn(ly, e, I, xg + start[e] * H, n, tg, tu, yg + start[e] * H)) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
                err_any = 1;
            }
        }
    }
    return err_any;
}

int cpu_experts(clover_context *c, const clover_layer *ly, int64_t I, int64_t H, int64_t E, int32_t n_used,
                const int64_t *start, const float *xg, float *yg) {
    return experts_tasks(c, ly, I, H, E, n_used, start, xg, yg, NULL);
}

/* Route the T rows of one entry (probs: their router softmax): top-k over all experts, or over
 * the entry's coreset in block mode (its n_full experts into c->nexp_full[il]), renormalised
 * weights into sel/wsel, bucket sizes counted into start[e + 1]. */
static void route_entry(fwd *f, int il, int64_t T, const float *probs, unsigned char *allowed, double *S,
                        int32_t *order, int32_t *sel, float *wsel, int64_t *start) {
    clover_context *c = f->c;
    const int64_t E = c->m->hp.n_expert, k = c->m->hp.n_expert_used;
    const int use_coreset = f->mode == MODE_BLOCK;
    if (use_coreset) {
        coreset(probs, T, E, k, f->coreset_top_p, allowed, S, order, sel);
        int32_t n_full = 0; /* S[e] > 0: e is in some row's own top-k */
        for (int64_t e = 0; e < E; e++) n_full += S[e] > 0;
        c->nexp_full[il] = n_full;
    }
    for (int64_t t = 0; t < T; t++) {
        int32_t *st = sel + t * k;
        topk(probs + t * E, E, use_coreset ? allowed : NULL, k, st);
        double sum = 0;
        for (int64_t s = 0; s < k; s++) sum += probs[t * E + st[s]];
        for (int64_t s = 0; s < k; s++) {
            wsel[t * k + s] = (float)(probs[t * E + st[s]] / sum);
            start[st[s] + 1]++;
        }
    }
}

/* Distinct experts among the P selections sel (mark: E bytes of scratch). */
static int32_t distinct_experts(const int32_t *sel, int64_t P, int64_t E, unsigned char *mark) {
    int32_t n = 0;
    memset(mark, 0, (size_t)E);
    for (int64_t q = 0; q < P; q++)
        if (!mark[sel[q]]) mark[sel[q]] = 1, n++;
    return n;
}

int moe_layer(fwd *L, pass_entry *en, int n_en, const clover_layer *ly, int il, const float *xn, float *out) {
    fwd *f = L;
    clover_context *c = L->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, H = hp->n_embd, E = hp->n_expert, k = hp->n_expert_used, I = hp->n_ff_exp;
    const int64_t Is = hp->n_ff_shexp, P = T * k; /* P (row, expert) pairs */
    const size_t F = sizeof(float), I32 = sizeof(int32_t), I64 = sizeof(int64_t);
    scratch_plan sp = {0};
    const int i_probs = scratch_add(&sp, T * E, F), i_sel = scratch_add(&sp, P, I32), i_wsel = scratch_add(&sp, P, F);
    const int i_allowed = scratch_add(&sp, E, 1), i_start = scratch_add(&sp, E + 1, I64), i_fill = scratch_add(&sp, E, I64);
    const int i_S = scratch_add(&sp, E, sizeof(double)), i_order = scratch_add(&sp, E, I32), i_prow = scratch_add(&sp, P, I32);
    const int i_pw = scratch_add(&sp, P, F), i_xg = scratch_add(&sp, P * H, F), i_yg = scratch_add(&sp, P * H, F);
    const int i_gt = scratch_add(&sp, T * Is, F), i_up = scratch_add(&sp, T * Is, F), i_ys = scratch_add(&sp, T * H, F);
    const int i_sg = scratch_add(&sp, T, F);
    char *base = scratch_carve(c, SCRATCH_LAYER, &sp);
    float *probs = scratch_part(base, &sp, i_probs);
    int32_t *sel = scratch_part(base, &sp, i_sel);
    float *wsel = scratch_part(base, &sp, i_wsel);
    unsigned char *allowed = scratch_part(base, &sp, i_allowed);
    int64_t *start = scratch_part(base, &sp, i_start); /* bucket of expert e: [start[e], start[e+1]) */
    int64_t *fill = scratch_part(base, &sp, i_fill);
    double *S = scratch_part(base, &sp, i_S);
    int32_t *order = scratch_part(base, &sp, i_order);
    int32_t *prow = scratch_part(base, &sp, i_prow); /* token row of each bucketed pair */
    float *pw = scratch_part(base, &sp, i_pw), *xg = scratch_part(base, &sp, i_xg), *yg = scratch_part(base, &sp, i_yg);
    float *gt = scratch_part(base, &sp, i_gt), *up = scratch_part(base, &sp, i_up), *ys = scratch_part(base, &sp, i_ys);
    float *sg = scratch_part(base, &sp, i_sg);
    if (start) memset(start, 0, sizeof(int64_t) * ((size_t)E + 1));
    int rc = CLOVER_E_NOMEM;
    if (!probs || !sel || !wsel || !allowed || !start || !fill || !S || !order || !prow || !pw || !xg || !yg || !gt || !up ||
        !ys || !sg)
        goto done;
    /* router: softmax in fp32 over all experts, top-k, renormalise (spec 2.3 step 1) */
    if (matmul(f, &ly->router, xn, T, probs)) goto done;
    for (int64_t t = 0; t < T; t++) {
        float *p = probs + t * E, mx = -FLT_MAX;
        for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        double sum = 0;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] = (float)(p[e] / sum);
    }
    int64_t r = 0; /* the entry's first row in the pass */
    for (int i = 0; i < n_en; r += en[i++].f.T)
        route_entry(&en[i].f, il, en[i].f.T, probs + r * E, allowed, S, order, sel + r * k, wsel + r * k, start);
    /* bucket the pairs by expert (counting sort, rows ascending within a bucket) */
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int32_t n_used = 0;
    for (int64_t e = 0; e < E; e++) n_used += start[e + 1] > start[e];
    memcpy(fill, start, sizeof(int64_t) * (size_t)E);
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < k; s++) {
            int64_t q = fill[sel[t * k + s]]++;
            prow[q] = (int32_t)t;
            pw[q] = wsel[t * k + s];
            memcpy(xg + q * H, xn + t * H, sizeof(float) * (size_t)H);
        }
    /* each used expert runs once over the rows routed to it (spec 5.6): on the GPU as one
     * grouped product per projection when the layer's experts were offloaded, else on the CPU,
     * while a helper thread runs the shared expert's products on the GPU if they are there
     * (--cpu-moe: CPU and GPU work overlap), or, with all of it on the CPU, the shared expert as
     * the first task of the routed experts' region (one fork a layer) */
    const int gpu_experts = ly->gate_exps.dev && ly->up_exps.dev && ly->down_exps.dev;
    const int gpu_shared = ly->gate_sh.dev || ly->up_sh.dev || ly->down_sh.dev || ly->shexp_gate.dev;
    shared_job sj = {c, ly, xn, T, Is, sg, gt, up, ys, 1, 1, ""};
    pthread_t helper;
    const int overlap = !gpu_experts && ly->gate_sh.dev && ly->up_sh.dev && ly->down_sh.dev &&
                        pthread_create(&helper, NULL, shared_expert, &sj) == 0;
    const int shared_task = !gpu_experts && !gpu_shared; /* all on the CPU: one more task of the region */
    int rc_experts = CLOVER_OK;
    if (gpu_experts) {
        const clover_cuda_weight g = cuda_weight(&ly->gate_exps), u = cuda_weight(&ly->up_exps),
                                 d = cuda_weight(&ly->down_exps);
        rc_experts = clover_cuda_experts(&g, &u, &d, E, start, xg, yg, f->err, f->err_size);
    } else if (experts_tasks(c, ly, I, H, E, n_used, start, xg, yg, shared_task ? &sj : NULL)) {
        rc_experts = CLOVER_E_NOMEM;
    }
    if (overlap) {
        pthread_join(helper, NULL);
    } else if (rc_experts == CLOVER_OK && !shared_task) {
        sj.n_threads = c->n_threads;
        shared_expert(&sj);
    }
    if (rc_experts != CLOVER_OK) {
        rc = rc_experts;
        goto done;
    }
    if (sj.rc) {
        rc = sj.rc;
        if (sj.err[0]) clover_set_err(f->err, f->err_size, rc, "%s", sj.err);
        goto done;
    }
    /* weighted sum in a fixed order, so the result does not depend on the thread count */
    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t q = 0; q < P; q++)
        for (int64_t j = 0; j < H; j++) out[prow[q] * H + j] += pw[q] * yg[q * H + j];
    r = 0;
    for (int i = 0; i < n_en; r += en[i++].f.T)
        if (en[i].f.n_experts_out)
            en[i].f.n_experts_out[il] = distinct_experts(sel + r * k, en[i].f.T * k, E, allowed);
    /* plus the shared expert, gated per token by sigmoid(w . x) (spec 2.3 step 3) */
    for (int64_t t = 0; t < T; t++) {
        float s = sigmoidf_(sg[t]);
        for (int64_t j = 0; j < H; j++) out[t * H + j] += s * ys[t * H + j];
    }
    rc = CLOVER_OK;
done:
    return rc;
}
