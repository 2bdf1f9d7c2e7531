/* select.cuh: part of cuda.cu (included there, in order, after the parts before it): the sampler's selection on the device (clover-spec 5.3-5.4): logit edits, greedy, top-k candidates, row totals. */
/* decode/sampler.c clover_apply_logit_ops on row blockIdx.x of Z, by one thread, in order. */
__global__ void k_logit_ops(float *Z, int64_t V, const clover_logit_op *ops, const int32_t *start, float rep, float freq,
                            float pres, float *pre) {
    float *z = Z + (int64_t)blockIdx.x * V;
    for (int32_t k = start[blockIdx.x]; k < start[blockIdx.x + 1]; k++) {
        if (pre && ops[k].id >= 0 && ops[k].id < V) pre[k] = z[ops[k].id];
        clover_logit_op_apply(z, V, ops[k], rep, freq, pres);
    }
}

/* clover_sample at temperature 0 (decode/sampler.c) on row blockIdx.x of Z, 256 threads: the
 * argmax over ids other than mask (the lowest id among equal maxima, the CPU's first strict
 * maximum), then 1 / sum of exp(z - z_max) in double, as tree reductions. */
__global__ void k_greedy(const float *Z, int64_t V, int32_t mask, int32_t *ids, float *conf) {
    __shared__ float sv[256];
    __shared__ int32_t si[256];
    __shared__ double ss[256];
    const float *z = Z + (int64_t)blockIdx.x * V;
    const int tid = threadIdx.x;
    float bv = -FLT_MAX;
    int32_t bi = -1;
    for (int64_t i = tid; i < V; i += 256) {
        if (i == mask) continue;
        if (bi < 0 || z[i] > bv) bv = z[i], bi = (int32_t)i;
    }
    sv[tid] = bv, si[tid] = bi;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (tid < s) {
            const float ov = sv[tid + s];
            const int32_t oi = si[tid + s];
            if (oi >= 0 && (si[tid] < 0 || ov > sv[tid] || (ov == sv[tid] && oi < si[tid]))) sv[tid] = ov, si[tid] = oi;
        }
        __syncthreads();
    }
    const float zmax = sv[0];
    const int32_t best = si[0];
    double sum = 0;
    for (int64_t i = tid; i < V && best >= 0; i += 256)
        if (i != mask) sum += exp((double)z[i] - zmax);
    __syncthreads(); /* every thread has read sv[0] and si[0] */
    ss[tid] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (tid < s) ss[tid] += ss[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        ids[blockIdx.x] = best;
        conf[blockIdx.x] = best < 0 ? 0.0f : (float)(1.0 / ss[0]);
    }
}

extern "C" int clover_cuda_greedy_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                                    float repetition, float frequency, float presence, int32_t mask_id, int32_t *id,
                                    float *conf, char *err, size_t err_size) {
    if (!z || !start || !id || !conf || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX)
        return bad_arg(err, err_size, "greedy_d: bad arguments");
    LAUNCH(k_logit_ops, dim3((unsigned)n), dim3(1))(z, V, ops, start, repetition, frequency, presence, (float *)NULL);
    LAUNCH(k_greedy, dim3((unsigned)n), dim3(256))(z, V, mask_id, id, conf);
    return launched(CLOVER_OK, "greedy_d", err, err_size);
}

/* Rank key of candidate (z, id) for k_top_k: larger z first (IEEE bits mapped to an unsigned
 * order, -0 as +0 so equal floats tie as on the CPU), then smaller id; distinct per id. */
__device__ __forceinline__ uint64_t cand_key(float z, int64_t i) {
    uint32_t b = 0;
    if (z != 0.0f) memcpy(&b, &z, 4);
    b = b & 0x80000000u ? ~b : b | 0x80000000u;
    return (uint64_t)b << 32 | (uint32_t) ~(uint32_t)i;
}

enum { TOP_K_THREADS = 1024 };

/* clover_sample's top-k candidates (decode/sampler.c top_k_cands) of row blockIdx.x of Z: a radix
 * select over the 64-bit rank keys, 8 bits a pass from the top (a 256-bin histogram of the keys
 * that share the prefix chosen so far), until the bin holding the k-th key is taken whole; then
 * the keys at or above that bin (exactly k) are gathered and placed by rank. Usually 3-4 passes
 * over the row: the float's top bits, then mantissa bits, separate the candidates. */
__global__ void __launch_bounds__(TOP_K_THREADS) k_top_k(const float *Z, int64_t V, int32_t mask, int32_t k,
                                                          clover_cand *out, float *bad) {
    __shared__ uint32_t hist[256];
    __shared__ uint64_t sel[CLOVER_CUDA_TOP_K_MAX];
    __shared__ uint64_t s_prefix;
    __shared__ int32_t s_need, s_done, s_bad;
    __shared__ uint32_t s_n;
    const float *z = Z + (int64_t)blockIdx.x * V;
    const int tid = threadIdx.x;
    if (tid == 0) s_bad = 0, s_n = 0;
    uint64_t prefix = 0;
    int32_t need = k;
    int shift = 56;
    for (;; shift -= 8) {
        for (int i = tid; i < 256; i += TOP_K_THREADS) hist[i] = 0;
        __syncthreads();
        const uint64_t hi = shift == 56 ? 0 : ~0ull << (shift + 8);
        int nonfinite = 0;
        for (int64_t i = tid; i < V; i += TOP_K_THREADS) {
            if (i == mask) continue; /* -inf by its edit */
            const float v = z[i];
            if (shift == 56 && (isnan(v) || v == INFINITY)) nonfinite = 1; /* -inf: an edit's, as greedy */
            const uint64_t key = cand_key(v, i);
            if ((key & hi) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        if (nonfinite) s_bad = 1;
        __syncthreads();
        if (tid == 0) { /* the bin, from the top, where the count reaches need */
            uint32_t cum = 0;
            int d = 255;
            while (d > 0 && cum + hist[d] < (uint32_t)need) cum += hist[d--];
            s_need = need - (int32_t)cum;
            s_prefix = prefix | (uint64_t)d << shift;
            s_done = hist[d] == (uint32_t)s_need;
        }
        __syncthreads();
        prefix = s_prefix, need = s_need;
        if (s_done || shift == 0) break;
    }
    const uint64_t top = prefix >> shift;
    for (int64_t i = tid; i < V; i += TOP_K_THREADS) {
        if (i == mask) continue;
        const uint64_t key = cand_key(z[i], i);
        if (key >> shift >= top) {
            const uint32_t slot = atomicAdd(&s_n, 1u);
            if (slot < CLOVER_CUDA_TOP_K_MAX) sel[slot] = key;
        }
    }
    __syncthreads();
    for (int j = tid; j < k; j += TOP_K_THREADS) {
        int r = 0;
        for (int q = 0; q < k; q++) r += sel[q] > sel[j];
        const int32_t id = (int32_t) ~(uint32_t)sel[j];
        out[(int64_t)blockIdx.x * k + r] = clover_cand{z[id], id};
    }
    if (tid == 0) bad[blockIdx.x] = s_bad ? NAN : 0.0f;
}

extern "C" int clover_cuda_top_k_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                                   float repetition, float frequency, float presence, int32_t mask_id, int32_t k,
                                   clover_cand *cand, float *bad, float *pre, char *err, size_t err_size) {
    const int64_t ids = clover_cand_ids(V, mask_id);
    if (!z || !start || !cand || !bad || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX || k < 1 ||
        k > CLOVER_CUDA_TOP_K_MAX || k > ids)
        return bad_arg(err, err_size, "top_k_d: bad arguments");
    LAUNCH(k_logit_ops, dim3((unsigned)n), dim3(1))(z, V, ops, start, repetition, frequency, presence, pre);
    LAUNCH(k_top_k, dim3((unsigned)n), dim3(TOP_K_THREADS))(z, V, mask_id, k, cand, bad);
    return launched(CLOVER_OK, "top_k_d", err, err_size);
}

/* The tempered weight of row blockIdx.x of Z (edited) for top-p alone (decode/sampler.c
 * clover_sample): total = sum over ids other than mask of (float)exp((double)(z - zmax) / T) in
 * double, zmax the row's first candidate (cand[row][0]); 256 threads, a fixed reduction order (not
 * the CPU's vocabulary order). */
__global__ void k_row_total(const float *Z, int64_t V, int32_t mask, const clover_cand *cand, int32_t k, float T,
                            double *total) {
    __shared__ double ss[256];
    const float *z = Z + (int64_t)blockIdx.x * V;
    const float zmax = cand[(int64_t)blockIdx.x * k].z;
    double sum = 0;
    for (int64_t i = threadIdx.x; i < V; i += 256)
        if (i != mask) sum += (float)exp((double)(z[i] - zmax) / T);
    ss[threadIdx.x] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) ss[threadIdx.x] += ss[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) total[blockIdx.x] = ss[0];
}

extern "C" int clover_cuda_row_total_d(const float *z, int64_t n, int64_t V, int32_t mask_id, const clover_cand *cand,
                                       int32_t k, float temperature, double *total, char *err, size_t err_size) {
    if (!z || !cand || !total || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX || k < 1 ||
        !(temperature > 0.0f))
        return bad_arg(err, err_size, "row_total_d: bad arguments");
    LAUNCH(k_row_total, dim3((unsigned)n), dim3(256))(z, V, mask_id, cand, k, temperature, total);
    return launched(CLOVER_OK, "row_total_d", err, err_size);
}

__global__ void k_copy(float *dst, const float *src, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

extern "C" int clover_cuda_copy_d(float *dst, const float *src, int64_t n, char *err, size_t err_size) {
    if (n == 0) return CLOVER_OK;
    if (!dst || !src || too_big(n)) return bad_arg(err, err_size, "copy_d: bad arguments");
    LAUNCH(k_copy, cover(n), dim3(256))(dst, src, n);
    return launched(CLOVER_OK, "copy_d", err, err_size);
}
