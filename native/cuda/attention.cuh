/* attention.cuh: part of cuda.cu (included there, in order, after the parts before it): the attention kernels (clover-spec 2.2 steps 3-4): one warp per (row, head) with key splits merged, and the tensor-core form. */
/* Gated attention (spec 2.2 steps 3-4) of query row t = t_base + blockIdx.y: o = softmax(q K^T *
 * scale) V over the row's keys, times sigmoid(gate), for the query heads that share one KV head
 * (GQA): block x takes KV head x / n_chunk and up to ATT_REP of its n_rep = n_head / n_kv query
 * heads (chunk x % n_chunk), one warp each (threadIdx.y), so each key is read once for all of
 * them. The keys are cut into gridDim.z splits (blockIdx.z, one contiguous range each) and read
 * in tiles of ATT_KT through shared memory: lane j scores key j of the tile against the warp's
 * q, the tile's max and exponentials update the warp's running max m and sum s (an online
 * softmax, the form of flash attention), and the output (lane l holding dimensions l + 32 i)
 * adds the tile's weighted values. One split writes the gated output; several write their
 * (m, s, output) to P [T][n_head][splits][hd + 2] for k_attention_merge (flash decoding: a
 * decode step's few rows still fill the GPU). The CPU's attend_row takes the max first and sums
 * in key order, which differs only in rounding. Q: [T][n_head][2 hd] (q then gate), K/V: the
 * layer's cache [n_ctx][n_kv hd] (float32, or fp16 where kv_f16 says), O: [T][n_head][hd].
 * Keys of row t: pos0 + t + 1 (causal, prefix mode) or pos0 + T (block mode: the prefix and
 * the whole block). Decode steps, and every pass where k_attention_mma (below) does not apply. */
#define HD_MAX 256
enum { ATT_REP = 8, ATT_KT = 16, ATT_SPLITS_MAX = 64 };
/* Loops over a lane's nd <= ATT_ND output values run to the constant ATT_ND with a guard: nvcc
 * unrolls them and the arrays they index stay in registers (with the runtime bound nd they sat
 * in local memory, 32 bytes of stack in k_attention). */
#define ATT_ND (HD_MAX / 32)
#define FOR_ND(i, nd) for (int i = 0; i < ATT_ND; i++) if (i < (nd))

/* Element i of a KV cache of fp16 (f16) or float32 values, as float. */
__device__ __forceinline__ float kv_load(const void *c, bool f16, int64_t i) {
    return f16 ? __half2float(((const __half *)c)[i]) : ((const float *)c)[i];
}

/* One value of the gated output (spec 2.2 step 4): acc / s * sigmoid(gate). */
__device__ __forceinline__ float gated(float acc, float s, float gate) {
    return acc / s * (1.0f / (1.0f + expf(-gate)));
}

/* The gated output of one (row, head), lane l holding dimensions l + 32 i of acc, the gate and o
 * (nd = head_dim / 32 of them). */
__device__ __forceinline__ void gated_out(const float *acc, float s, const float *gate, float *o, int nd) {
    FOR_ND(i, nd) o[threadIdx.x + 32 * i] = gated(acc[i], s, gate[threadIdx.x + 32 * i]);
}

/* (m, s, acc) and (m2, s2, acc2) merged into the first, n of acc's values held */
__device__ __forceinline__ void softmax_merge(float &m, float &s, float *acc, float m2, float s2, const float *acc2, int n) {
    const float mm = fmaxf(m, m2), c1 = expf(m - mm), c2 = expf(m2 - mm);
    s = s * c1 + s2 * c2;
    FOR_ND(i, n) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mm;
}

__global__ void __launch_bounds__(32 * ATT_REP)
    k_attention(const float *Q, const void *K, const void *V, int kv_f16, float *O, float *P, const int64_t *pos_p,
                int64_t pos0, int64_t T, int64_t t_base, int64_t n_head, int64_t n_kv, int64_t hd, int causal,
                float scale) {
    __shared__ float ks[ATT_KT][HD_MAX + 1], vs[ATT_KT][HD_MAX], qs[ATT_REP][HD_MAX]; /* ks padded: no bank conflicts */
    if (pos_p) pos0 = *pos_p; /* the position on the device (a graph replays with a new one) */
    const int64_t n_rep = n_head / n_kv, n_chunk = (n_rep + ATT_REP - 1) / ATT_REP, kvd = n_kv * hd;
    const int64_t g = blockIdx.x / n_chunk, t = t_base + blockIdx.y;
    const int lane = threadIdx.x, w = threadIdx.y, nd = (int)(hd / 32), nthr = 32 * blockDim.y;
    const int64_t rep = (blockIdx.x % n_chunk) * ATT_REP + w, h = g * n_rep + rep; /* this warp's query head */
    const bool head = rep < n_rep; /* warps past n_rep load tiles only */
    const bool k16 = kv_f16 & CLOVER_KV_K_F16, v16 = kv_f16 & CLOVER_KV_V_F16;
    const float *q = Q + (t * n_head + (head ? h : 0)) * 2 * hd;
    FOR_ND(i, nd) qs[w][lane + 32 * i] = q[lane + 32 * i];
    float acc[ATT_ND];
    for (int i = 0; i < ATT_ND; i++) acc[i] = 0.0f;
    const int64_t n_keys = causal ? pos0 + t + 1 : pos0 + T, per = (n_keys + gridDim.z - 1) / gridDim.z;
    const int64_t k0 = blockIdx.z * per, k1 = k0 + per < n_keys ? k0 + per : n_keys;
    float m = -FLT_MAX, s = 0.0f;
    for (int64_t kt = k0; kt < k1; kt += ATT_KT) {
        const int nk = (int)(k1 - kt < (int64_t)ATT_KT ? k1 - kt : (int64_t)ATT_KT);
        __syncthreads(); /* the previous tile (and qs) done with */
        for (int idx = w * 32 + lane; idx < nk * (int)hd; idx += nthr) {
            const int j = idx / (int)hd, d = idx % (int)hd;
            const int64_t at = (kt + j) * kvd + g * hd + d;
            ks[j][d] = kv_load(K, k16, at), vs[j][d] = kv_load(V, v16, at);
        }
        __syncthreads();
        float sc = -FLT_MAX;
        if (lane < nk) {
            float dot = 0.0f;
            for (int d = 0; d < (int)hd; d++) dot += qs[w][d] * ks[lane][d];
            sc = dot * scale;
        }
        const float m2 = fmaxf(m, warp_max(sc)), corr = expf(m - m2), p = lane < nk ? expf(sc - m2) : 0.0f;
        s = s * corr + warp_sum(p);
        FOR_ND(i, nd) acc[i] *= corr;
        for (int j = 0; j < nk; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            FOR_ND(i, nd) acc[i] += pj * vs[j][lane + 32 * i];
        }
        m = m2;
    }
    if (!head) return;
    if (gridDim.z == 1) {
        gated_out(acc, s, q + hd, O + (t * n_head + h) * hd, nd);
        return;
    }
    float *pp = P + ((t * n_head + h) * gridDim.z + blockIdx.z) * (hd + 2);
    if (lane == 0) pp[0] = m, pp[1] = s;
    FOR_ND(i, nd) pp[2 + lane + 32 * i] = acc[i];
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The keys [k0, k1) that split z of n_splits takes for k_attention_mma's tile of 16 queries
 * `tile` (of T n_rep), and how many splits hold keys (used): splits of ATT_MMA_SPLIT_KEYS keys
 * or more, from the largest key count of the tile's queries, so that a short context fills
 * few of them (the position may be known on the device only, so the grid cannot shrink). */
enum { ATT_MMA_WARPS = 4, ATT_MMA_KT = 16, ATT_CHUNK = 128, ATT_MMA_SPLIT_KEYS = 64 };
struct key_split {
    int64_t k0, k1;
    int used;
};
__device__ __forceinline__ key_split att_mma_keys(int64_t pos0, int64_t T, int64_t n_rep, int causal, int64_t tile,
                                                  int n_splits, int z) {
    const int64_t n_keys = causal ? pos0 + min64(tile * 16 + 15, T * n_rep - 1) / n_rep + 1 : pos0 + T;
    int64_t per = (n_keys + n_splits - 1) / n_splits;
    if (per < ATT_MMA_SPLIT_KEYS) per = ATT_MMA_SPLIT_KEYS;
    return {z * per, min64(z * per + per, n_keys), (int)((n_keys + per - 1) / per)};
}

/* The splits' (m, s, output) of k_attention merged in split order (grid (n_head, rows), one
 * warp), the gated output to O: all n_splits of them, or, after k_attention_mma (mma_rep, its
 * n_rep, non-zero), those att_mma_keys says hold keys. */
__global__ void k_attention_merge(const float *Q, const float *P, float *O, int64_t t_base, int64_t n_head, int64_t hd,
                                  int n_splits, int64_t mma_rep, const int64_t *pos_p, int64_t pos0, int64_t T,
                                  int causal) {
    const int64_t h = blockIdx.x, t = t_base + blockIdx.y;
    const int lane = threadIdx.x, nd = (int)(hd / 32);
    const float *p = P + (t * n_head + h) * n_splits * (hd + 2);
    float m = p[0], s = p[1], acc[ATT_ND] = {};
    FOR_ND(i, nd) acc[i] = p[2 + lane + 32 * i];
    int used = n_splits;
    if (mma_rep)
        used = att_mma_keys(pos_p ? *pos_p : pos0, T, mma_rep, causal, (t * mma_rep + h % mma_rep) / 16, n_splits, 0)
                   .used;
    for (int u = 1; u < used; u++) {
        const float *pu = p + u * (hd + 2);
        float a2[ATT_ND] = {};
        FOR_ND(i, nd) a2[i] = pu[2 + lane + 32 * i];
        softmax_merge(m, s, acc, pu[0], pu[1], a2, nd);
    }
    gated_out(acc, s, Q + (t * n_head + h) * 2 * hd + hd, O + (t * n_head + h) * hd, nd);
}

/* N (2 or 4) consecutive values from element i of an array of fp16 (f16) or float32 values into v,
 * in one load (i a multiple of N and the array aligned to it; off the GPU a misaligned load
 * aborts, so that a test there checks the indexing). */
template <int N> __device__ __forceinline__ void load_n(const void *c, bool f16, int64_t i, float v[N]) {
    static_assert(N == 2 || N == 4, "one 4, 8 or 16-byte load");
    uint32_t w[N];
    const char *p = (const char *)c + i * (f16 ? 2 : 4);
#ifdef __CUDA_ARCH__
    if (f16 && N == 2) w[0] = *(const uint32_t *)p;
    else if (f16 || N == 2) {
        const uint2 u = *(const uint2 *)p;
        w[0] = u.x, w[1] = u.y;
    } else {
        const uint4 u = *(const uint4 *)p;
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    }
#else
    if ((uintptr_t)p % (N * (f16 ? 2 : 4))) abort();
    memcpy(w, p, (size_t)N * (f16 ? 2 : 4));
#endif
    for (int j = 0; j < N; j++)
        v[j] = f16 ? __half2float(__ushort_as_half((unsigned short)(w[j / 2] >> 16 * (j % 2))))
                   : __uint_as_float(w[j]);
}

/* Gated attention as k_attention, on tf32 tensor cores, for many rows (prefill, block forwards,
 * verify). Warp threadIdx.y of block x (blockDim.y <= ATT_MMA_WARPS warps) takes 16 queries of
 * KV head x / per_g (per_g blocks a KV head): that head's query heads row after row (query i:
 * row i / n_rep, head x / per_g n_rep + i % n_rep), so each key is read once for 16 of them;
 * blockIdx.y takes split y of the keys (att_mma_keys: of the largest key count of the 16, each
 * query masking the keys past its own), in tiles of 16. Every product is a float32 one made of
 * tf32 ones (tf32_split: q k = qh kh + qh kl + ql kh; the values of an fp16 cache are tf32
 * values, so two), summed on the tensor cores in fresh tiles (scores: the first term's apart
 * from the others', per ATT_CHUNK dimensions; weighted values: per 8 keys) and in float32
 * across them, since tensor cores truncate as they add (see k_matmul_mma_f); the online softmax
 * as k_attention's, masked keys scoring -Inf. The mma's k index takes dimensions (scores) or keys
 * (weighted values) in pairs: column u and u + 4 of a k-step are values 2u and 2u + 1 of its 8,
 * for Q and K alike and for the weights and V alike; and the n index of the value tiles is
 * permuted so that a lane's values of one key lie together: lane 4g + t loads dimensions
 * g ND .. g ND + ND - 1 of V's rows (ND = HD / 8) and holds, of queries g and g + 8, the output
 * dimensions n ND + d for n = 2t, 2t + 1 and d < ND (acc[d][2 r + n - 2t] for query g + 8 r).
 * Writes as k_attention: O, or (m, s, output) to P for k_attention_merge. Caller: HD / 8 a
 * multiple of 4 (HD 32, 64, 128 or 256 here); Q, K and V 16-byte aligned (vector loads). */
template <int HD>
__global__ void __launch_bounds__(32 * ATT_MMA_WARPS)
    k_attention_mma(const float *Q, const void *K, const void *V, int kv_f16, float *O, float *P,
                    const int64_t *pos_p, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int causal,
                    float scale) {
    constexpr int ND = HD / 8;
    static_assert(ND % 4 == 0, "V rows in 4-value loads");
    if (pos_p) pos0 = *pos_p;
    const int64_t n_rep = n_head / n_kv, nq = T * n_rep, n_tiles = (nq + 15) / 16;
    const int64_t per_g = (n_tiles + blockDim.y - 1) / blockDim.y, gk = blockIdx.x / per_g;
    const int64_t tile = (blockIdx.x % per_g) * blockDim.y + threadIdx.y, kvd = n_kv * HD;
    if (tile >= n_tiles) return; /* the whole warp (no block barriers here) */
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const bool k16 = kv_f16 & CLOVER_KV_K_F16, v16 = kv_f16 & CLOVER_KV_V_F16;
    const key_split sp = att_mma_keys(pos0, T, n_rep, causal, tile, gridDim.y, blockIdx.y);
    const int64_t k0 = sp.k0, k1 = sp.k1;
    if (k0 >= k1) return; /* a split past the keys: k_attention_merge skips it */
    const float *q[2]; /* queries g and g + 8 of the tile (past nq: the last, not written) */
    int64_t lim[2];    /* their keys in the split end before lim */
    UNROLL
    for (int r = 0; r < 2; r++) {
        const int64_t qi = min64(tile * 16 + g + 8 * r, nq - 1), row = qi / n_rep;
        q[r] = Q + (row * n_head + gk * n_rep + qi % n_rep) * 2 * HD;
        lim[r] = min64(k1, causal ? pos0 + row + 1 : pos0 + T);
    }
    float acc[ND][4], m[2] = {-FLT_MAX, -FLT_MAX}, s[2] = {0.0f, 0.0f};
    UNROLL
    for (int d = 0; d < ND; d++)
        UNROLL
        for (int i = 0; i < 4; i++) acc[d][i] = 0.0f;
    for (int64_t kt = k0; kt < k1; kt += ATT_MMA_KT) {
        /* scores of the tile's 16 keys (two n-tiles of 8), key kt + 8 n + g's row of K in B's column g */
        float sc[2][4], sm[2][4], ss[2][4]; /* the total, the first term's and the others' sums of a chunk */
        const float *kr[2];
        UNROLL
        for (int n = 0; n < 2; n++) {
            const int64_t key = min64(kt + 8 * n + g, k1 - 1);
            kr[n] = (const float *)((const char *)K + (key * kvd + gk * HD) * (k16 ? 2 : 4));
            UNROLL
            for (int i = 0; i < 4; i++) sc[n][i] = sm[n][i] = ss[n][i] = 0.0f;
        }
        for (int ks = 0; ks < ND; ks++) {
            float qa[2], qb[2], ah[4], al[4];
            load_n<2>(q[0], false, 8 * ks + 2 * t, qa);
            load_n<2>(q[1], false, 8 * ks + 2 * t, qb);
            const float a[4] = {qa[0], qb[0], qa[1], qb[1]};
            UNROLL
            for (int i = 0; i < 4; i++) {
                const tf32_pair x = tf32_split(a[i]);
                ah[i] = x.hi, al[i] = x.lo;
            }
            UNROLL
            for (int n = 0; n < 2; n++) {
                float b[2];
                load_n<2>(kr[n], k16, 8 * ks + 2 * t, b);
                const tf32_pair b0 = tf32_split(b[0]), b1 = tf32_split(b[1]); /* fp16: lo = 0 */
                mma_16x8x8_tf32(sm[n], ah, b0.hi, b1.hi);
                mma_16x8x8_tf32(ss[n], al, b0.hi, b1.hi);
                if (!k16) mma_16x8x8_tf32(ss[n], ah, b0.lo, b1.lo);
            }
            if ((ks + 1) % (ATT_CHUNK / 8) == 0 || ks == ND - 1) {
                UNROLL
                for (int n = 0; n < 2; n++)
                    UNROLL
                    for (int i = 0; i < 4; i++) sc[n][i] += sm[n][i] + ss[n][i], sm[n][i] = ss[n][i] = 0.0f;
            }
        }
        /* the online softmax: c[i] of n-tile n is key kt + 8 n + 2 t + (i & 1) of query g + 8 (i >> 1) */
        float mx[2] = {-FLT_MAX, -FLT_MAX}, corr[2]; /* masked keys' scores: -Inf, their weights 0 */
        UNROLL
        for (int n = 0; n < 2; n++)
            UNROLL
            for (int i = 0; i < 4; i++) {
                sc[n][i] = kt + 8 * n + 2 * t + (i & 1) < lim[i >> 1] ? sc[n][i] * scale : -INFINITY;
                mx[i >> 1] = fmaxf(mx[i >> 1], sc[n][i]);
            }
        UNROLL
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m2 = fmaxf(m[r], mx[r]);
            corr[r] = expf(m[r] - m2), s[r] *= corr[r], m[r] = m2;
        }
        UNROLL
        for (int d = 0; d < ND; d++)
            UNROLL
            for (int i = 0; i < 4; i++) acc[d][i] *= corr[i >> 1];
        /* acc += P V, a k-step of 8 keys per n-tile: keys j, j + 1 (j = kt + 8 n + 2 t) in A's
         * columns t, t + 4 and B's rows t, t + 4 */
        UNROLL
        for (int n = 0; n < 2; n++) {
            float p[4], ph[4], pl[4];
            UNROLL
            for (int i = 0; i < 4; i++) {
                p[i] = expf(sc[n][i] - m[i >> 1]);
                s[i >> 1] += p[i];
            }
            const float pa[4] = {p[0], p[2], p[1], p[3]}; /* A: rows g, g + 8 of columns t, then t + 4 */
            UNROLL
            for (int i = 0; i < 4; i++) {
                const tf32_pair x = tf32_split(pa[i]);
                ph[i] = x.hi, pl[i] = x.lo;
            }
            const int64_t j = kt + 8 * n + 2 * t;
            const int64_t j0 = min64(j, k1 - 1), j1 = min64(j + 1, k1 - 1);
            const int64_t v0 = j0 * kvd + gk * HD + g * ND, v1 = j1 * kvd + gk * HD + g * ND;
            UNROLL
            for (int d4 = 0; d4 < ND; d4 += 4) {
                float b0[4], b1[4];
                load_n<4>(V, v16, v0 + d4, b0);
                load_n<4>(V, v16, v1 + d4, b1);
                UNROLL
                for (int e = 0; e < 4; e++) {
                    const tf32_pair x0 = tf32_split(b0[e]), x1 = tf32_split(b1[e]);
                    float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_16x8x8_tf32(cm, ph, x0.hi, x1.hi);
                    mma_16x8x8_tf32(cs, pl, x0.hi, x1.hi);
                    if (!v16) mma_16x8x8_tf32(cs, ph, x0.lo, x1.lo);
                    UNROLL
                    for (int i = 0; i < 4; i++) acc[d4 + e][i] += cm[i] + cs[i];
                }
            }
        }
    }
    UNROLL
    for (int r = 0; r < 2; r++) { /* the sums over the lanes of a query */
        s[r] += __shfl_xor_sync(0xffffffffu, s[r], 1);
        s[r] += __shfl_xor_sync(0xffffffffu, s[r], 2);
    }
    UNROLL
    for (int r = 0; r < 2; r++) {
        const int64_t qi = tile * 16 + g + 8 * r, th = qi / n_rep * n_head + gk * n_rep + qi % n_rep;
        if (qi >= nq) continue;
        float *pp = gridDim.y > 1 ? P + (th * gridDim.y + blockIdx.y) * (HD + 2) : NULL;
        if (pp && t == 0) pp[0] = m[r], pp[1] = s[r];
        UNROLL
        for (int c = 0; c < 2; c++) {
            UNROLL
            for (int d = 0; d < ND; d++) {
                const int64_t dim = (2 * t + c) * ND + d;
                const float a = acc[d][2 * r + c];
                if (pp) pp[2 + dim] = a;
                else O[th * HD + dim] = gated(a, s[r], q[r][HD + dim]);
            }
        }
    }
}
