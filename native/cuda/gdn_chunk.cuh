/* gdn_chunk.cuh: the chunked Gated DeltaNet prefill on the GPU, for native/cuda/cuda.cu (included
 * after k_gdn): the algorithm of cpu/gdn_heads.c gdn_chunked_head (the WY / UT-transform form of
 * transformers' torch_chunk_gated_delta_rule, after fla's chunk_gated_delta_rule), chunks of
 * GDN_CH rows. Per chunk of L rows with in-chunk cumulative decay G_i = sum_{m<=i} g_m:
 *   A = (I - A0)^-1, A0 = -(diag(beta) K K^T * exp(G_i - G_j)) strictly lower
 *   U = A diag(beta) V;  W = A diag(beta exp(G)) K
 *   V' = U - W S;  O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), j <= i) V'
 *   S <- exp(G_L) S + (K * exp(G_L - G))^T V'
 * Two kernels: k_gdn_chunk_prep computes every chunk's U, W, the decayed keys and Q K^T of every
 * head at once (nothing there depends on S); k_gdn_chunk_scan then carries S through the chunks
 * in order, a block per head and GDN_COLS columns of S (the columns are independent). Results
 * equal the recurrence (k_gdn) up to rounding. */
#ifndef CLOVER_GDN_CHUNK_CUH
#define CLOVER_GDN_CHUNK_CUH

#define GDN_CH CLOVER_GDN_CHUNK /* clover.h */

/* Floats of one (head, chunk) slot of k_gdn_chunk_prep's output: U [GDN_CH][dv], W [GDN_CH][dk],
 * Kd [GDN_CH][dk] (k_j exp(G_L - G_j)), QK [GDN_CH][GDN_CH], eG [GDN_CH] (exp(G_i)), then exp(G_L)
 * (padded to 4). */
static __host__ __device__ inline int64_t gdn_chunk_slot(int64_t dk, int64_t dv) {
    return GDN_CH * (dv + 2 * dk + GDN_CH) + GDN_CH + 4;
}

/* One chunk blockIdx.y of head blockIdx.x (256 threads): G, A by forward substitution (in the
 * CPU's order), then U, W, Kd, QK, eG into the slot of ws; rows past L are zero. */
__global__ void __launch_bounds__(256) k_gdn_chunk_prep(const float *conv, const float *beta, const float *g,
                                                        int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                                        int64_t C, float *ws) {
    __shared__ float A[GDN_CH][GDN_CH + 1];
    __shared__ float G[GDN_CH], row[GDN_CH], bt[GDN_CH];
    const int64_t h = blockIdx.x, t0 = (int64_t)blockIdx.y * GDN_CH, kh = h % Hk;
    const int L = (int)(T - t0 < GDN_CH ? T - t0 : GDN_CH), tid = threadIdx.x, nt = blockDim.x;
    float *U = ws + ((int64_t)blockIdx.x * gridDim.y + blockIdx.y) * gdn_chunk_slot(dk, dv);
    float *W = U + GDN_CH * dv, *Kd = W + GDN_CH * dk, *QK = Kd + GDN_CH * dk, *eG = QK + GDN_CH * GDN_CH;
    const float *q0 = conv + t0 * C + kh * dk, *k0 = q0 + Hk * dk, *v0 = conv + t0 * C + 2 * Hk * dk + h * dv;
    if (tid == 0) { /* the CPU's cumulative sum: in double, rounded once per row */
        double acc = 0;
        for (int i = 0; i < GDN_CH; i++) {
            if (i < L) acc += g[(t0 + i) * Hv + h];
            G[i] = (float)acc;
        }
    }
    for (int i = tid; i < GDN_CH; i += nt) bt[i] = i < L ? beta[(t0 + i) * Hv + h] : 0.0f;
    __syncthreads();
    for (int e = tid; e < GDN_CH * GDN_CH; e += nt) { /* A0 = -beta_i (k_i . k_j) exp(G_i - G_j), j < i */
        const int i = e / GDN_CH, j = e % GDN_CH;
        float a = 0.0f;
        if (j < i && i < L) {
            float s = 0.0f;
            for (int64_t m = 0; m < dk; m++) s += k0[i * C + m] * k0[j * C + m];
            a = -bt[i] * s * expf(G[i] - G[j]);
        }
        A[i][j] = a;
    }
    __syncthreads();
    for (int i = 1; i < L; i++) { /* forward substitution, row i from the finished rows above */
        if (tid < i) row[tid] = A[i][tid];
        __syncthreads();
        float v = 0.0f;
        if (tid < i) {
            float s = 0.0f;
            for (int m = tid + 1; m < i; m++) s += row[m] * A[m][tid];
            v = row[tid] + s;
        }
        __syncthreads();
        if (tid < i) A[i][tid] = v;
        __syncthreads();
    }
    for (int i = tid; i < GDN_CH; i += nt) A[i][i] = i < L ? 1.0f : 0.0f;
    __syncthreads();
    for (int64_t e = tid; e < GDN_CH * dv; e += nt) { /* U = A diag(beta) V */
        const int i = (int)(e / dv);
        const int64_t n = e % dv;
        float u = 0.0f;
        for (int j = 0; j <= i && i < L; j++)
            if (A[i][j] != 0.0f) u += A[i][j] * bt[j] * v0[j * C + n];
        U[e] = u;
    }
    for (int64_t e = tid; e < GDN_CH * dk; e += nt) { /* W = A diag(beta exp(G)) K; Kd */
        const int i = (int)(e / dk);
        const int64_t m = e % dk;
        float w = 0.0f;
        for (int j = 0; j <= i && i < L; j++)
            if (A[i][j] != 0.0f) w += A[i][j] * bt[j] * expf(G[j]) * k0[j * C + m];
        W[e] = w;
        Kd[e] = i < L ? k0[i * C + m] * expf(G[L - 1] - G[i]) : 0.0f;
    }
    for (int e = tid; e < GDN_CH * GDN_CH; e += nt) { /* QK = (q_i . k_j) exp(G_i - G_j), j <= i */
        const int i = e / GDN_CH, j = e % GDN_CH;
        float s = 0.0f;
        if (j <= i && i < L) {
            for (int64_t m = 0; m < dk; m++) s += q0[i * C + m] * k0[j * C + m];
            s *= expf(G[i] - G[j]);
        }
        QK[e] = s;
    }
    for (int i = tid; i <= GDN_CH; i += nt) eG[i] = i == GDN_CH ? expf(G[L - 1]) : i < L ? expf(G[i]) : 0.0f;
}

/* The chunks of head blockIdx.x in order for columns GDN_COLS blockIdx.y .. of its state S
 * [Hv][dk][dv] (device, updated in place; 256 threads, the columns' rows in shared memory):
 * V' = U - W S, the readout into O [T][Hv][dv], then the state update. */
__global__ void __launch_bounds__(256) k_gdn_chunk_scan(const float *conv, int64_t T, int64_t Hk, int64_t Hv,
                                                        int64_t dk, int64_t dv, int64_t C, const float *ws, float *S,
                                                        float *O) {
    __shared__ float Ss[DK_MAX][GDN_COLS + 1];
    __shared__ float Vp[GDN_CH][GDN_COLS + 1];
    const int64_t h = blockIdx.x, n0 = (int64_t)blockIdx.y * GDN_COLS, n_chunks = (T + GDN_CH - 1) / GDN_CH;
    const int nc = (int)(dv - n0 < (int64_t)GDN_COLS ? dv - n0 : (int64_t)GDN_COLS), tid = threadIdx.x, nt = blockDim.x;
    float *Sh = S + h * dk * dv + n0;
    for (int64_t e = tid; e < dk * GDN_COLS; e += nt) {
        const int64_t m = e / GDN_COLS;
        const int n = (int)(e % GDN_COLS);
        Ss[m][n] = n < nc ? Sh[m * dv + n] : 0.0f;
    }
    __syncthreads();
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t t0 = c * GDN_CH;
        const int L = (int)(T - t0 < GDN_CH ? T - t0 : GDN_CH);
        const float *U = ws + (h * n_chunks + c) * gdn_chunk_slot(dk, dv), *W = U + GDN_CH * dv, *Kd = W + GDN_CH * dk;
        const float *QK = Kd + GDN_CH * dk, *eG = QK + GDN_CH * GDN_CH;
        const float *q0 = conv + t0 * C + (h % Hk) * dk;
        for (int e = tid; e < GDN_CH * GDN_COLS; e += nt) { /* V' = U - W S */
            const int i = e / GDN_COLS, n = e % GDN_COLS;
            float v = 0.0f;
            if (i < L && n < nc) {
                float s = 0.0f;
                for (int64_t m = 0; m < dk; m++) s += W[i * dk + m] * Ss[m][n];
                v = U[i * dv + n0 + n] - s;
            }
            Vp[i][n] = v;
        }
        __syncthreads();
        for (int e = tid; e < GDN_CH * GDN_COLS; e += nt) { /* O = exp(G_i) q_i S + sum_{j<=i} QK_ij V'_j */
            const int i = e / GDN_COLS, n = e % GDN_COLS;
            if (i >= L || n >= nc) continue;
            float s = 0.0f;
            for (int64_t m = 0; m < dk; m++) s += q0[i * C + m] * Ss[m][n];
            s *= eG[i];
            for (int j = 0; j <= i; j++) s += QK[i * GDN_CH + j] * Vp[j][n];
            O[((t0 + i) * Hv + h) * dv + n0 + n] = s;
        }
        __syncthreads(); /* the readout has read S */
        for (int64_t e = tid; e < dk * GDN_COLS; e += nt) { /* S <- exp(G_L) S + Kd^T V' */
            const int64_t m = e / GDN_COLS;
            const int n = (int)(e % GDN_COLS);
            float s = 0.0f;
            for (int j = 0; j < L; j++) s += Kd[j * dk + m] * Vp[j][n];
            Ss[m][n] = eG[GDN_CH] * Ss[m][n] + s;
        }
        __syncthreads();
    }
    for (int64_t e = tid; e < dk * GDN_COLS; e += nt) {
        const int64_t m = e / GDN_COLS;
        const int n = (int)(e % GDN_COLS);
        if (n < nc) Sh[m * dv + n] = Ss[m][n];
    }
}

#endif
