/* gdn_heads.c: the Gated DeltaNet's per-head work on the CPU: the delta rule token by token and in
 * its chunked (WY / UT-transform) form (clover-spec 2.1 steps 5-6; transformers'
 * torch_chunk_gated_delta_rule, after fla), and the block operator's softmax mixing (spec 3.3
 * steps 3-4), split over threads by value head. */
#include "cpu/gdn_heads.h"
#include "cpu/kernels.h"
#include "quant/dot.h"
#include "quant/quants.h"

#include <stdlib.h>
#include <string.h>

/* One delta-rule step for one head (spec 2.1 step 6), S [dk][dv]:
 * S <- exp(g) S; S <- S + k (beta (v - S^T k))^T. tmp: dv floats. */
CLOVER_INLINE void delta_step(float *S, const float *k, const float *v, float g, float beta, int64_t dk,
                              int64_t dv, float *tmp) {
    const float eg = expf(g);
    for (int64_t j = 0; j < dv; j++) tmp[j] = 0;
    for (int64_t i = 0; i < dk; i++) /* decay and S^T k in one pass over S */
        for (int64_t j = 0; j < dv; j++) {
            const float s = S[i * dv + j] * eg;
            S[i * dv + j] = s;
            tmp[j] += s * k[i];
        }
    for (int64_t j = 0; j < dv; j++) tmp[j] = (v[j] - tmp[j]) * beta;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) S[i * dv + j] += k[i] * tmp[j];
}

/* o = S^T q for one head. */
CLOVER_INLINE void readout(const float *S, const float *q, int64_t dk, int64_t dv, float *o) {
    for (int64_t j = 0; j < dv; j++) o[j] = 0;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) o[j] += S[i * dv + j] * q[i];
}

/* Pointers to q, k, v of value head h at row t of the conv output. Value head h reads key
 * head h % Hk (tiled order, spec 4.3). */
#define GDN_Q(d, conv, t, h) ((conv) + (t) * (d)->C + ((h) % (d)->Hk) * (d)->dk)
#define GDN_K(d, conv, t, h) ((conv) + (t) * (d)->C + (d)->Hk * (d)->dk + ((h) % (d)->Hk) * (d)->dk)
#define GDN_V(d, conv, t, h) ((conv) + (t) * (d)->C + 2 * (d)->Hk * (d)->dk + (h) * (d)->dv)

/* Token-by-token recurrence of value head h over T rows, forward in time, from state S
 * [dk][dv]; o: [T, Hv*dv]. tmp: dv floats. */
CLOVER_CLONES static void gdn_recurrent_head(const gdn_dims *d, const float *conv, const float *beta, const float *g, int64_t T,
                               int64_t h, float *S, float *o, float *tmp) {
    for (int64_t t = 0; t < T; t++) {
        delta_step(S, GDN_K(d, conv, t, h), GDN_V(d, conv, t, h), g[t * d->Hv + h], beta[t * d->Hv + h], d->dk,
                   d->dv, tmp);
        readout(S, GDN_Q(d, conv, t, h), d->dk, d->dv, o + (t * d->Hv + h) * d->dv);
    }
}

/* Chunked form of the same recurrence (chunk 64), the WY / UT-transform algorithm used by
 * transformers' torch_chunk_gated_delta_rule (after fla's chunk_gated_delta_rule). Per chunk of
 * L rows with in-chunk cumulative decay G_i = sum_{m<=i} g_m:
 *   A = -(diag(beta) K K^T * exp(G_i - G_j)) strictly lower; forward-substitute A <- (I - A)^-1
 *   U = A diag(beta) V;  W = A diag(beta exp(G)) K
 *   V' = U - W S;  O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), j <= i) V'
 *   S <- exp(G_L) S + (K * exp(G_L - G))^T V'
 * It equals gdn_recurrent_head up to rounding (tested). scratch: gdn_scratch_floats(). */
CLOVER_CLONES static void gdn_chunked_head(const gdn_dims *d, const float *conv, const float *beta, const float *g, int64_t T,
                             int64_t h, float *S, float *o, float *scratch) {
    const int64_t dk = d->dk, dv = d->dv, CH = CLOVER_GDN_CHUNK;
    const clover_gemm_f32_fn gemm = clover_gemm_f32_kernel(-1); /* dot.h: C += alpha A B */
    float *A = scratch, *U = A + CH * CH, *W = U + CH * dv, *G = W + CH * dk, *row = G + CH;
    float *Kt = row + CH; /* [dk][L]: the chunk's K^T, at the end K'^T with K'_j = exp(G_L - G_j) k_j */
    float *E = Kt + CH * dk; /* [L][CH]: the decay exp(G_i - G_j) for j <= i, else 0 */
    float *Kc = E + CH * CH, *Vc = Kc + CH * dk; /* the chunk's k and v rows packed: [L][dk], [L][dv] */
    for (int64_t t0 = 0; t0 < T; t0 += CH) {
        const int64_t L = T - t0 < CH ? T - t0 : CH;
        double acc = 0;
        for (int64_t i = 0; i < L; i++) {
            acc += g[(t0 + i) * d->Hv + h];
            G[i] = (float)acc;
        }
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) E[i * CH + j] = j <= i ? expf(G[i] - G[j]) : 0.0f;
        /* Kc, Vc and Kt = K^T [dk][L] (the chunk's keys as gemm's B), then A = K K^T */
        const float *Q0 = GDN_Q(d, conv, t0, h);
        for (int64_t j = 0; j < L; j++) {
            memcpy(Kc + j * dk, GDN_K(d, conv, t0 + j, h), sizeof(float) * (size_t)dk);
            memcpy(Vc + j * dv, GDN_V(d, conv, t0 + j, h), sizeof(float) * (size_t)dv);
            for (int64_t m = 0; m < dk; m++) Kt[m * L + j] = Kc[j * dk + m];
        }
        memset(A, 0, sizeof(float) * (size_t)(L * CH));
        gemm(L, L, dk, 1.0f, Kc, dk, Kt, L, A, CH);
        /* A[i][j] = -beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0 */
        for (int64_t i = 0; i < L; i++) {
            const float bi = beta[(t0 + i) * d->Hv + h];
            for (int64_t j = 0; j < L; j++) A[i * CH + j] = j < i ? -bi * A[i * CH + j] * E[i * CH + j] : 0.0f;
        }
        /* forward substitution, row by row, using the already updated rows above: A[i][j] =
         * row[j] + sum_{j < m < i} row[m] A[m][j] with row = A[i] as it was, each sum in m order,
         * run as axpys over the rows m (contiguous, so vectorised) */
        for (int64_t i = 1; i < L; i++) {
            float *ai = A + i * CH;
            for (int64_t j = 0; j < i; j++) row[j] = ai[j], ai[j] = 0.0f;
            for (int64_t m = 1; m < i; m++) {
                const float r = row[m], *am = A + m * CH;
                for (int64_t j = 0; j < m; j++) ai[j] += r * am[j];
            }
            for (int64_t j = 0; j < i; j++) ai[j] = row[j] + ai[j];
        }
        for (int64_t i = 0; i < L; i++) A[i * CH + i] = 1.0f;
        /* U = (A diag(beta)) V, then W = (A diag(beta) diag(exp(G))) K, A scaled in place */
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j <= i; j++) A[i * CH + j] *= beta[(t0 + j) * d->Hv + h];
        memset(U, 0, sizeof(float) * (size_t)(L * dv));
        gemm(L, dv, L, 1.0f, A, CH, Vc, dv, U, dv);
        for (int64_t j = 0; j < L; j++) row[j] = expf(G[j]);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j <= i; j++) A[i * CH + j] *= row[j];
        memset(W, 0, sizeof(float) * (size_t)(L * dk));
        gemm(L, dk, L, 1.0f, A, CH, Kc, dk, W, dk);
        /* V' = U - W S (in U) */
        gemm(L, dv, dk, -1.0f, W, dk, S, dv, U, dv);
        /* O_i = exp(G_i) q_i S + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) V'_j: P = Q K^T masked and
         * decayed (in A), O = diag(exp(G)) Q S + P V' */
        float *o0 = o + (t0 * d->Hv + h) * dv;
        const int64_t ldo = d->Hv * dv;
        for (int64_t i = 0; i < L; i++) memset(o0 + i * ldo, 0, sizeof(float) * (size_t)dv);
        gemm(L, dv, dk, 1.0f, Q0, d->C, S, dv, o0, ldo);
        for (int64_t i = 0; i < L; i++)
            for (int64_t n = 0; n < dv; n++) o0[i * ldo + n] *= row[i];
        memset(A, 0, sizeof(float) * (size_t)(L * CH));
        gemm(L, L, dk, 1.0f, Q0, d->C, Kt, L, A, CH);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) A[i * CH + j] *= E[i * CH + j];
        gemm(L, dv, L, 1.0f, A, CH, U, dv, o0, ldo);
        /* S <- exp(G_L) S + sum_j exp(G_L - G_j) k_j V'_j^T, with Kt scaled to K'^T */
        const float egl = expf(G[L - 1]);
        for (int64_t m = 0; m < dk * dv; m++) S[m] *= egl;
        for (int64_t j = 0; j < L; j++) {
            const float e = expf(G[L - 1] - G[j]);
            for (int64_t m = 0; m < dk; m++) Kt[m * L + j] *= e;
        }
        gemm(dk, dv, L, 1.0f, Kt, L, U, dv, S, dv);
    }
}

/* Floats of one thread's GDN scratch: gdn_chunked_head's A, U, W, G, row, Kt, E, Kc and Vc, and
 * at the end the S and tmp of the token-by-token forms. */
static int64_t gdn_scratch_floats(const gdn_dims *d) {
    return 2 * CLOVER_GDN_CHUNK * CLOVER_GDN_CHUNK + CLOVER_GDN_CHUNK * (2 * d->dv + 3 * d->dk) + 2 * CLOVER_GDN_CHUNK + d->dk * d->dv + d->dv;
}

/* The block softmax's per-head constants (spec 3.3 step 4): *scale = exp(lambda_h) sqrt(dk), the
 * factor of q . k (q carries 1/sqrt(dk), so q~ . k~ = sqrt(dk) q . k), and *hist = beta0_h +
 * c_h ln(1 + P), the history slot's logit after P clean tokens. */
static void bd_constants(const clover_layer *ly, const gdn_dims *d, int64_t h, int64_t P, float *scale, float *hist) {
    *scale = expf(ly->bd_lambda[h]) * sqrtf((float)d->dk);
    *hist = ly->bd_beta0[h] + ly->bd_c[h] * log1pf((float)P);
}

/* The block operator's mixing (spec 3.3 steps 3-4 [assumed form]) for value head h over the T
 * block rows of conv (qk_norm's output): o_i = a_iH S^T q_i + sum_j a_ij v_j with a_i = softmax
 * over (scale q_i . k_j for every block row j, hist), S [dk][dv] the clean state (read only).
 * o: [T, Hv*dv]; a: T + 1 floats of scratch. */
CLOVER_CLONES static void bd_head(const gdn_dims *d, const float *conv, const float *S, int64_t T, int64_t h,
                                  float scale, float hist, float *o, float *a) {
    const int64_t dk = d->dk, dv = d->dv;
    for (int64_t i = 0; i < T; i++) {
        const float *q = GDN_Q(d, conv, i, h);
        float mx = hist;
        for (int64_t j = 0; j < T; j++) {
            const float *k = GDN_K(d, conv, j, h);
            float s = 0;
            for (int64_t m = 0; m < dk; m++) s += q[m] * k[m];
            a[j] = scale * s;
            mx = a[j] > mx ? a[j] : mx;
        }
        a[T] = hist;
        double sum = 0;
        for (int64_t j = 0; j <= T; j++) sum += a[j] = expf(a[j] - mx);
        const float inv = (float)(1.0 / sum);
        float *oi = o + (i * d->Hv + h) * dv;
        readout(S, q, dk, dv, oi);
        for (int64_t n = 0; n < dv; n++) oi[n] *= a[T] * inv;
        for (int64_t j = 0; j < T; j++) {
            const float w = a[j] * inv, *v = GDN_V(d, conv, j, h);
            for (int64_t n = 0; n < dv; n++) oi[n] += w * v[n];
        }
    }
}


/* What one value head of a GDN layer computes over the T rows of conv (qk_norm's output), given
 * the thread's scratch: the recurrence (kind GDN_FORWARD*, advancing state with beta, g) or the
 * block operator's mixing (block: reading state, after P clean tokens). */
typedef struct {
    const gdn_dims *d;
    int kind, block;
    const clover_layer *ly;
    const float *conv, *beta, *g;
    int64_t T, P;
    float *state, *o;
    int64_t n_scratch;
} gdn_job;

static void gdn_head(const gdn_job *j, int64_t h, float *scratch) {
    const gdn_dims *d = j->d;
    float *S = j->state + h * d->dk * d->dv;
    if (j->block) {
        float scale, hist;
        bd_constants(j->ly, d, h, j->P, &scale, &hist);
        bd_head(d, j->conv, S, j->T, h, scale, hist, j->o, scratch);
    } else if (j->kind == GDN_FORWARD_CHUNKED) {
        gdn_chunked_head(d, j->conv, j->beta, j->g, j->T, h, S, j->o, scratch);
    } else {
        gdn_recurrent_head(d, j->conv, j->beta, j->g, j->T, h, S, j->o, scratch + j->n_scratch - d->dv);
    }
}

/* gdn_head over every value head (independent, so split over nth threads, thread i with the
 * n_scratch floats at ts + i * stride bytes, subnormals flushed). */
static int gdn_heads(const gdn_job *j, int nth, char *ts, size_t stride) {
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) if (nth > 1 && j->d->Hv > 1)
#endif
    {
        const unsigned csr = flush_subnormals_begin(); /* in every thread of the region */
        float *scratch = (float *)(ts + (size_t)thread_index() * stride);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t h = 0; h < j->d->Hv; h++) gdn_head(j, h, scratch);
        flush_subnormals_end(csr);
    }
    return CLOVER_OK;
}

int64_t gdn_heads_scratch_floats(const gdn_dims *d, int block, int64_t T) {
    return block ? T + 1 : gdn_scratch_floats(d);
}

/* The recurrence of kind GDN_FORWARD* over all value heads, advancing state [Hv][dk][dv]. */
int gdn_recurrence(int kind, const gdn_dims *d, const float *conv, const float *beta, const float *g,
                   int64_t T, float *state, float *o, int nth, char *ts, size_t stride) {
    const gdn_job j = {d, kind, 0, NULL, conv, beta, g, T, 0, state, o, gdn_heads_scratch_floats(d, 0, T)};
    return gdn_heads(&j, nth, ts, stride);
}

/* The block operator's mixing (bd_head) over every value head of layer ly after P clean tokens;
 * state: the layer's clean state [Hv][dk][dv], read only. */
int bd_heads(const gdn_dims *d, const clover_layer *ly, const float *conv, const float *state, int64_t T,
             int64_t P, float *o, int nth, char *ts, size_t stride) {
    const gdn_job j = {d, 0, 1, ly, conv, NULL, NULL, T, P, (float *)state, o, gdn_heads_scratch_floats(d, 1, T)};
    return gdn_heads(&j, nth, ts, stride);
}
