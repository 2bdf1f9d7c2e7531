/* gdn_block.cuh: the block operator's mixing of a Gated DeltaNet layer on the GPU (spec 3.3 steps
 * 3-4), for native/cuda/cuda.cu (included after k_gdn: DK_MAX, warp_max, warp_sum_d): per value head h
 * and block row i of the T block rows,
 *   a_i = softmax(scale q_i . k_j for j < T, hist),  scale = exp(lambda_h) sqrt(dk),
 *   hist = beta0_h + c_h ln(1 + P),  o_i = a_iH S_h^T q_i + sum_j a_ij v_j,
 * q carrying 1/sqrt(dk) (so scale q . k = exp(lambda) q~ . k~), S_h the clean state [dk][dv],
 * read only. The CPU's bd_constants and bd_head (cpu/gdn_heads.c) in the same operation order:
 * each score a sequential float dot product over dk, then times scale (a product never fused
 * with what follows, nor is c_h's in hist), the maximum from hist, expf(a - max) summed in
 * double with the history's term last, the weights a * (float)(1 / sum), the readout S^T q
 * summed over dk in order and scaled by a_H, then the values added in row order; results differ
 * from the CPU's by FMA contraction elsewhere, expf and the order of the double sum only.
 *
 * One CUDA block per (head blockIdx.x, BD_ROWS block rows from blockIdx.y BD_ROWS, BD_THREADS
 * columns of dv from blockIdx.z BD_THREADS): the rows' q in shared memory; the keys in tiles of
 * BD_KEYS rows, so any T works: a pass for the maxima and one for the sums of exponentials over
 * the tiles, then the readout (thread n: column n of S) and the values, the tiles' weights
 * recomputed per pass when T > BD_KEYS (one tile: its scores computed once and kept). P is *pos
 * when pos is not NULL (read when the kernel runs, so a CUDA graph replays with the new one),
 * else P0. */
#ifndef CLOVER_GDN_BLOCK_CUH
#define CLOVER_GDN_BLOCK_CUH

#define BD_ROWS 8
#define BD_KEYS 32
#define BD_THREADS 128
static_assert(BD_KEYS == 32, "k_gdn_block reduces a row's tile of scores over the lanes of a warp");
static_assert(BD_ROWS * BD_KEYS % BD_THREADS == 0 && BD_THREADS % 32 == 0, "k_gdn_block's thread layout");

#ifdef __CUDA_ARCH__ /* a product nvcc may not fuse with a later add (the CPU rounds it alone) */
#define BD_MUL(a, b) __fmul_rn(a, b)
#else
#define BD_MUL(a, b) ((a) * (b))
#endif

/* Shared memory of one block of k_gdn_block. */
struct bd_smem {
    float q[BD_ROWS][DK_MAX];              /* the rows' q */
    float k[BD_KEYS * (DK_MAX + 1)];       /* a tile of keys, rows (dk | 1) apart (no bank conflicts) */
    float sc[BD_ROWS][BD_KEYS];            /* the tile's scores, or their exponentials */
    float mx[BD_ROWS], inv[BD_ROWS], aH[BD_ROWS];
    double sum[BD_ROWS];
};

/* sm.sc[r][jj] for the keys j0 .. j0 + nk - 1 (nk <= BD_KEYS) of key head kh: scale q_r . k_j,
 * or with ex its exponential less the row's maximum, expf(score - sm.mx[r]); entries past nk or
 * past the nr rows are -inf (ex: 0). Called by every thread; the results are visible on return. */
__device__ void bd_scores(bd_smem &sm, const float *conv, int64_t C, int64_t Hk, int64_t kh, int dk, int64_t j0,
                          int nk, int nr, float scale, bool ex) {
    const int ks = dk | 1;
    __syncthreads(); /* the previous tile's readers are done */
    for (int x = threadIdx.x; x < nk * dk; x += blockDim.x) {
        const int jj = x / dk, m = x % dk;
        sm.k[jj * ks + m] = conv[(j0 + jj) * C + (Hk + kh) * dk + m];
    }
    __syncthreads();
    for (int p = threadIdx.x; p < BD_ROWS * BD_KEYS; p += blockDim.x) {
        const int r = p / BD_KEYS, jj = p % BD_KEYS;
        float a = -INFINITY;
        if (r < nr && jj < nk) {
            const float *q = sm.q[r], *k = sm.k + jj * ks;
            float s = 0.0f;
            for (int m = 0; m < dk; m++) s += q[m] * k[m];
            a = BD_MUL(scale, s);
        }
        sm.sc[r][jj] = ex ? expf(a - sm.mx[r]) : a;
    }
    __syncthreads();
}

__global__ void __launch_bounds__(BD_THREADS)
    k_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int dk, int64_t dv, int64_t C, const float *S,
                const float *lambda, const float *beta0, const float *cc, const int64_t *pos, int64_t P0, float *O) {
    __shared__ bd_smem sm;
    const int64_t h = blockIdx.x, kh = h % Hk, i0 = (int64_t)blockIdx.y * BD_ROWS;
    const int64_t n = (int64_t)blockIdx.z * BD_THREADS + threadIdx.x; /* this thread's column of dv */
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, n_warps = blockDim.x >> 5;
    const int nr = (int)(T - i0 < BD_ROWS ? T - i0 : BD_ROWS);
    const int64_t n_tiles = (T + BD_KEYS - 1) / BD_KEYS, P = pos ? *pos : P0;
    const float scale = expf(lambda[h]) * sqrtf((float)dk);
    const float hist = beta0[h] + BD_MUL(cc[h], log1pf((float)P));
    for (int x = tid; x < BD_ROWS * dk; x += blockDim.x) {
        const int r = x / dk, m = x % dk;
        sm.q[r][m] = r < nr ? conv[(i0 + r) * C + kh * dk + m] : 0.0f;
    }
    if (tid < BD_ROWS) sm.mx[tid] = hist, sm.sum[tid] = 0.0;
    /* pass 0: each row's maximum (from hist); pass 1: the sum of expf(score - max) */
    for (int pass = 0; pass < 2; pass++)
        for (int64_t t = 0; t < n_tiles; t++) {
            const int64_t j0 = t * BD_KEYS;
            const int nk = (int)(T - j0 < BD_KEYS ? T - j0 : BD_KEYS);
            if (pass == 0 || n_tiles > 1) bd_scores(sm, conv, C, Hk, kh, dk, j0, nk, nr, scale, false);
            for (int r = warp; r < BD_ROWS; r += n_warps) {
                const float a = sm.sc[r][lane];
                if (pass == 0) {
                    const float m = warp_max(a);
                    if (lane == 0) sm.mx[r] = fmaxf(sm.mx[r], m);
                } else {
                    const float e = expf(a - sm.mx[r]);
                    if (n_tiles == 1) sm.sc[r][lane] = e; /* kept for the values below */
                    const double s = warp_sum_d((double)e);
                    if (lane == 0) sm.sum[r] += s;
                }
            }
            __syncthreads();
        }
    if (tid < BD_ROWS) {
        const float aH = expf(hist - sm.mx[tid]);
        sm.aH[tid] = aH;
        sm.inv[tid] = (float)(1.0 / (sm.sum[tid] + aH));
    }
    __syncthreads();
    const bool col = n < dv; /* threads past dv take part in the tiles' loads and barriers only */
    float acc[BD_ROWS];
    UNROLL
    for (int r = 0; r < BD_ROWS; r++) acc[r] = 0.0f;
    if (col) {
        const float *Sh = S + h * dk * dv + n;
        for (int m = 0; m < dk; m++) {
            const float s = Sh[m * dv];
            UNROLL
            for (int r = 0; r < BD_ROWS; r++) acc[r] += s * sm.q[r][m];
        }
    }
    UNROLL
    for (int r = 0; r < BD_ROWS; r++) acc[r] *= sm.aH[r] * sm.inv[r];
    for (int64_t t = 0; t < n_tiles; t++) {
        const int64_t j0 = t * BD_KEYS;
        const int nk = (int)(T - j0 < BD_KEYS ? T - j0 : BD_KEYS);
        if (n_tiles > 1) bd_scores(sm, conv, C, Hk, kh, dk, j0, nk, nr, scale, true);
        if (col) {
            const float *v = conv + j0 * C + 2 * Hk * dk + h * dv + n;
            for (int jj = 0; jj < nk; jj++) {
                const float x = v[jj * C];
                UNROLL
                for (int r = 0; r < BD_ROWS; r++) acc[r] += sm.sc[r][jj] * sm.inv[r] * x;
            }
        }
    }
    UNROLL
    for (int r = 0; r < BD_ROWS; r++) /* a constant index: acc stays in registers */
        if (col && r < nr) O[((i0 + r) * Hv + h) * dv + n] = acc[r];
}

/* Whether k_gdn_block's arguments are out of range (T: the grid's rows of blocks). */
static bool gdn_block_bad_args(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                               const float *state, const float *lambda, const float *beta0, const float *c,
                               const float *o) {
    return !conv || !state || !lambda || !beta0 || !c || !o || T <= 0 || (T + BD_ROWS - 1) / BD_ROWS > 65535 ||
           Hk <= 0 || Hv <= 0 || Hv > INT32_MAX || dk <= 0 || dk > DK_MAX || dv <= 0 || dv > 1024 ||
           C < 2 * Hk * dk + Hv * dv || T > INT64_MAX / 4 / (C > Hv * dv ? C : Hv * dv);
}

static void gdn_block_launch(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                             const float *S, const float *lambda, const float *beta0, const float *c, const int64_t *pos,
                             int64_t P0, float *O) {
    const dim3 grid((unsigned)Hv, (unsigned)((T + BD_ROWS - 1) / BD_ROWS), (unsigned)((dv + BD_THREADS - 1) / BD_THREADS));
    LAUNCH(k_gdn_block, grid, dim3(BD_THREADS))(conv, T, Hk, Hv, (int)dk, dv, C, S, lambda, beta0, c, pos, P0, O);
}

#endif
