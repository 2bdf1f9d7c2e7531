/* resident_kernels.cuh: part of cuda.cu (included there, in order, after the parts before it): the kernels of the device-resident forward (norms, RoPE, conv, GDN gates and output, routing, gather, combine, residual add). */
/* ------------------------------------------------------------------ device-resident forward
 * The operations of gpu/forward_resident.c's resident forward (every layer and the output on the GPU):
 * all pointers are device memory, launches are queued in stream order and return at once (a
 * launch error is reported by that call, a later asynchronous one by a later call or by the copy
 * that brings the logits back). Each kernel follows the CPU function named in its comment, in
 * the same operation order, so results differ from the CPU's only in float rounding (expf, FMA
 * contraction, the order of parallel sums). */

/* rmsnorm (cpu/kernels.h) of row idx[r] (r without idx) of X into row r of Y, one warp per row:
 * y = x * rsqrt(mean(x^2) + eps) * w, the sum of squares in double. In place when X == Y. */
__global__ void k_rmsnorm(const float *X, int64_t xs, const int32_t *idx, const float *w, int64_t n, float eps, float *Y,
                          int64_t ys) {
    const int64_t r = blockIdx.x;
    const float *x = X + (idx ? idx[r] : r) * xs;
    float *y = Y + r * ys;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = threadIdx.x; i < n; i += 32) y[i] = x[i] * s * w[i];
}

/* attention_layer's per-head rmsnorm then rope_neox (cpu/kernels.h; spec 2.2 step 2) on head
 * blockIdx.x of row t = blockIdx.y (hd floats at X + t ts + h hs) at position *pos_p + t: the
 * first rd dimensions rotate, angles in double as on the CPU. One warp per head. */
__global__ void k_head_norm_rope(float *X, int64_t ts, int64_t hs, const float *w, int64_t hd, float eps,
                                 const int64_t *pos_p, int rd, float theta) {
    const int64_t pos0 = *pos_p; /* on the device: a graph replays with a new one */
    __shared__ float v[HD_MAX];
    float *x = X + (int64_t)blockIdx.y * ts + (int64_t)blockIdx.x * hs;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < hd; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (int64_t i = threadIdx.x; i < hd; i += 32) v[i] = x[i] * s * w[i];
    __syncthreads();
    const int half = rd / 2;
    const int64_t pos = pos0 + blockIdx.y;
    for (int i = threadIdx.x; i < hd; i += 32) {
        float r = v[i];
        if (i < rd) {
            const int j = i < half ? i : i - half;
            const double ang = (double)pos * pow((double)theta, -2.0 * j / rd);
            const float cs = (float)cos(ang), sn = (float)sin(ang);
            r = i < half ? v[i] * cs - v[i + half] * sn : v[i] * cs + v[i - half] * sn;
        }
        x[i] = r;
    }
}

/* conv_silu (model/gdn.c; spec 2.1 step 2, 3.3 step 1), one thread per (row, channel): the K taps w
 * over hist (the K-1 previous inputs) ++ in, w[ch K + K-1] on the row itself, then, with wr (block
 * mode), the right taps wr[ch (K-1) + d-1] on rows t + d < T (d = 1..K-1); SiLU. */
__global__ void k_conv(const float *w, const float *wr, const float *hist, const float *in, int64_t T, int64_t C, int K,
                       float *out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    const int64_t t = i / C, ch = i % C;
    float s = 0;
    for (int j = 0; j < K; j++) {
        const int64_t src = t - (K - 1) + j;
        s += w[ch * K + j] * (src >= 0 ? in[src * C + ch] : hist[(K - 1 + src) * C + ch]);
    }
    for (int j = 1; wr && j < K && t + j < T; j++) s += wr[ch * (K - 1) + j - 1] * in[(t + j) * C + ch];
    out[i] = s / (1.0f + expf(-s));
}

/* gdn_layer's new conv history: hist (K-1 rows of C, oldest first) <- the last K-1 rows of
 * hist ++ in[0..T), one thread per channel. */
#define CONV_K_MAX 16
__global__ void k_conv_hist(float *hist, const float *in, int64_t T, int64_t C, int K) {
    const int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float old[CONV_K_MAX];
    for (int j = 0; j < K - 1; j++) old[j] = hist[j * C + ch];
    for (int j = 0; j < K - 1; j++) {
        const int64_t src = T - (K - 1) + j;
        hist[j * C + ch] = src >= 0 ? in[src * C + ch] : old[K - 1 + src];
    }
}

/* qk_norm (model/gdn.c; spec 2.1 step 3): q (blockIdx.x < Hk) and k heads of row blockIdx.y
 * l2-normed, q then times 1/sqrt(dk); one warp per head. */
__global__ void k_gdn_qk_norm(float *conv, int64_t C, int64_t Hk, int64_t dk, float eps) {
    const int is_q = blockIdx.x < Hk;
    float *x = conv + (int64_t)blockIdx.y * C + (int64_t)blockIdx.x * dk;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < dk; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)ss + eps), qs = 1.0f / sqrtf((float)dk);
    for (int64_t i = threadIdx.x; i < dk; i += 32) {
        const float y = x[i] * s;
        x[i] = is_q ? y * qs : y;
    }
}

/* gates (model/gdn.c; spec 2.1 step 4): beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias). */
__global__ void k_gdn_gates(float *b, float *a, const float *ssm_a, const float *dt_bias, int64_t n, int64_t Hv) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t h = i % Hv;
    b[i] = 1.0f / (1.0f + expf(-b[i]));
    const float x = a[i] + dt_bias[h];
    a[i] = ssm_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
}

/* The end of gdn_layer (spec 2.1 step 7) for head blockIdx.x of row blockIdx.y, one warp: rmsnorm
 * with w, times silu(z). */
__global__ void k_gdn_out(float *O, const float *Z, const float *w, int64_t Hv, int64_t dv, float eps) {
    const int64_t at = ((int64_t)blockIdx.y * Hv + blockIdx.x) * dv;
    float *o = O + at;
    const float *z = Z + at;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < dv; i += 32) ss += (double)o[i] * o[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / dv) + eps);
    for (int64_t i = threadIdx.x; i < dv; i += 32) o[i] = o[i] * s * w[i] * (z[i] / (1.0f + expf(-z[i])));
}

/* model/moe.c's topk for one row, by one warp: the k largest p[e] among allowed experts (all when
 * NULL), ties to the lower id (E <= 1024: lane l owns experts l + 32 j). Each lane finds its own
 * best untaken candidate, then the warp the best of those (larger p, else lower id): the CPU's
 * choice. idx is written by lane 0. */
__device__ void topk_warp(const float *p, int64_t E, const unsigned char *allowed, int k, int32_t *idx) {
    const int lane = threadIdx.x & 31;
    uint32_t taken = 0; /* bit j: expert lane + 32 j */
    for (int s = 0; s < k; s++) {
        float bv = 0.0f;
        int be = -1;
        for (int j = 0; lane + 32 * j < E; j++) {
            const int e = lane + 32 * j;
            if (((taken >> j) & 1) || (allowed && !allowed[e])) continue;
            if (be < 0 || p[e] > bv) bv = p[e], be = e;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
        }
        /* lane 0's pick for every lane: with NaN probabilities (a non-finite layer, reported
         * after the pass) the lanes' reductions may disagree, and ids must stay valid */
        be = __shfl_sync(0xffffffffu, be, 0);
        if (be < 0) be = 0;
        if (lane == 0) idx[s] = be;
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
    }
}

/* MoE routing (spec 2.3 step 1; the coreset of spec 5.6 when coreset != 0), as moe_layer and
 * coreset in model/moe.c, in one block of 32 warps: rows of P (logits [T][E]) become softmax
 * probabilities; sel/wsel [T][k] scratch; out: prow and pw [T k] (row and weight of each pair,
 * bucketed by expert, rows ascending within a bucket), pair [T][k] (row t's pair indices
 * ascending), tiles (n_tiles; those past the used ones get nr = 0), stats[0] experts used,
 * stats[1] experts in some row's own top-k (coreset only). A warp per row for the softmax and top-k, a thread per expert for the coreset's mass
 * (in double, in the CPU's order), its sort (as ranks) and the bucketing; the O(E) prefix sums
 * and tile list on one thread. */
#define E_MAX 1024
__global__ void __launch_bounds__(1024)
    k_route(float *P, int64_t T, int64_t E, int k, float top_p, int coreset, int32_t *sel, float *wsel, int32_t *prow,
            float *pw, int32_t *pair, tile *tiles, int64_t n_tiles, int32_t *stats) {
    __shared__ double S[E_MAX];
    __shared__ int32_t order[E_MAX], fill[E_MAX], bstart[E_MAX + 1];
    __shared__ unsigned char allowed[E_MAX];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, n_warps = nt >> 5;
    for (int64_t t = warp; t < T; t += n_warps) {
        float *p = P + t * E, mx = -FLT_MAX;
        for (int64_t e = lane; e < E; e += 32) mx = p[e] > mx ? p[e] : mx;
        mx = warp_max(mx);
        double sum = 0;
        for (int64_t e = lane; e < E; e += 32) sum += (p[e] = expf(p[e] - mx));
        sum = warp_sum_d(sum);
        for (int64_t e = lane; e < E; e += 32) p[e] = (float)(p[e] / sum);
    }
    __syncthreads();
    if (coreset) {
        for (int64_t t = warp; t < T; t += n_warps) topk_warp(P + t * E, E, NULL, k, sel + t * k);
        __syncthreads();
        for (int64_t e = tid; e < E; e += nt) { /* expert e's mass over the rows, in row order as the CPU adds it */
            double acc = 0;
            for (int64_t i = 0; i < T * k; i++)
                if (sel[i] == e) acc += P[(i / k) * E + e];
            S[e] = acc;
        }
        __syncthreads();
        if (tid == 0) {
            double tot = 0;
            for (int64_t e = 0; e < E; e++) tot += S[e];
            for (int64_t e = 0; e < E; e++) S[e] = tot > 0 ? S[e] / tot : 0;
        }
        __syncthreads();
        for (int64_t e = tid; e < E; e += nt) { /* the CPU's stable sort by S descending, as ranks */
            int64_t rank = 0;
            for (int64_t j = 0; j < E; j++) rank += S[j] > S[e] || (S[j] == S[e] && j < e);
            order[rank] = (int32_t)e;
        }
        __syncthreads();
        if (tid == 0) {
            int64_t m = E;
            double cum = 0;
            for (int64_t i = 0; i < E; i++) {
                cum += S[order[i]];
                if (cum >= (double)top_p) {
                    m = i + 1;
                    break;
                }
            }
            if (m < k) m = k;
            int32_t n_full = 0;
            for (int64_t e = 0; e < E; e++) allowed[e] = 0, n_full += S[e] > 0;
            for (int64_t i = 0; i < m; i++) allowed[order[i]] = 1;
            stats[1] = n_full;
        }
        __syncthreads();
    }
    for (int64_t t = warp; t < T; t += n_warps) {
        int32_t *st = sel + t * k;
        topk_warp(P + t * E, E, coreset ? allowed : NULL, k, st);
        if (lane == 0) {
            double sum = 0;
            for (int s = 0; s < k; s++) sum += P[t * E + st[s]];
            for (int s = 0; s < k; s++) wsel[t * k + s] = (float)(P[t * E + st[s]] / sum);
        }
    }
    __syncthreads();
    /* bucketing by expert, a thread per expert walking the pairs in order (so rows ascend
     * within a bucket, as the CPU's counting sort puts them) */
    for (int64_t e = tid; e < E; e += nt) {
        int32_t c = 0;
        for (int64_t i = 0; i < T * k; i++) c += sel[i] == e;
        fill[e] = c;
    }
    __syncthreads();
    if (tid == 0) {
        int32_t n_used = 0;
        int64_t n = 0;
        bstart[0] = 0;
        for (int64_t e = 0; e < E; e++) {
            bstart[e + 1] = bstart[e] + fill[e], n_used += fill[e] > 0;
            for (int32_t t0 = bstart[e]; t0 < bstart[e + 1]; t0 += ROWS)
                tiles[n++] = tile{(int32_t)e, t0, bstart[e + 1] - t0 < ROWS ? bstart[e + 1] - t0 : ROWS};
        }
        for (; n < n_tiles; n++) tiles[n] = tile{0, 0, 0};
        stats[0] = n_used;
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += nt) {
        int32_t q = bstart[e];
        for (int64_t i = 0; i < T * k; i++)
            if (sel[i] == e) prow[q] = (int32_t)(i / k), pw[q] = wsel[i], pair[i] = q++;
    }
    __syncthreads();
    for (int64_t t = tid; t < T; t += nt) { /* row t's pair indices ascending (the CPU's summation order) */
        int32_t *pr = pair + t * k;
        for (int s = 1; s < k; s++) {
            const int32_t q = pr[s];
            int u = s;
            for (; u > 0 && pr[u - 1] > q; u--) pr[u] = pr[u - 1];
            pr[u] = q;
        }
    }
}

/* Y[q] = X[rows[q]] for n rows of H. */
__global__ void k_gather(const float *X, const int32_t *rows, int64_t n, int64_t H, float *Y) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * H) Y[i] = X[rows[i / H] * H + i % H];
}

/* The end of moe_layer plus the residual (spec 2.3 steps 2-3): per row t and column j,
 * o = sum of pw[q] YG[q] over row t's pairs q (ascending) + sigmoid(SG[t]) YS[t], X += o;
 * *bad = 1 when the result is not finite. */
__global__ void k_moe_combine(float *X, const float *YG, const float *pw, const int32_t *pair, int k, const float *YS,
                              const float *SG, int64_t T, int64_t H, int32_t *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * H) return;
    const int64_t t = i / H, j = i % H;
    float o = 0.0f;
    for (int s = 0; s < k; s++) {
        const int64_t q = pair[t * k + s];
        o += pw[q] * YG[q * H + j];
    }
    o += 1.0f / (1.0f + expf(-SG[t])) * YS[i];
    X[i] += o;
    if (!(fabsf(X[i]) <= FLT_MAX)) *bad = 1;
}

/* X += O over n values; *bad = 1 when a result is not finite. */
__global__ void k_add(float *X, const float *O, int64_t n, int32_t *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    X[i] += O[i];
    if (!(fabsf(X[i]) <= FLT_MAX)) *bad = 1;
}

/* Blocks of 256 threads covering n (grid.x <= 2^31 - 1). */
static dim3 cover(int64_t n) { return dim3((unsigned)((n + 255) / 256)); }

static bool too_big(int64_t n) { return n <= 0 || (n + 255) / 256 > INT32_MAX; }
