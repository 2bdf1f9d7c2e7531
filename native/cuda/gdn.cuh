/* gdn.cuh: part of cuda.cu (included there, in order, after the parts before it): the Gated DeltaNet recurrence kernel (clover-spec 2.1 step 6) and its launches; the chunked form (gdn_chunk.cuh) and the block operator (gdn_block.cuh). */
/* Gated DeltaNet recurrence (spec 2.1 step 6) of value head h = blockIdx.x: the state S
 * [dk][dv] column by column (the columns are independent), GDN_COLS columns a block
 * (blockIdx.y), GDN_SPLIT threads a column, thread p of a column holding its rows p R .. p R + R - 1
 * in registers (R: the template's, at least dk / GDN_SPLIT). Per row t in order: S <- exp(g) S;
 * S <- S + k (beta (v - S^T k))^T; o = S^T q, the dot products summed per thread, then over
 * the column's threads (the CPU's delta_step and readout in cpu/gdn_heads.c sum in row order, so
 * results differ by that order, FMA contraction and expf); S written back at the end. conv: [T][C]
 * rows of q (Hk dk), k (Hk dk), v (Hv dv); value head h reads key head h % Hk. */
#define DK_MAX 256
enum { GDN_COLS = 32, GDN_SPLIT = 4 };
static_assert(GDN_SPLIT == 4, "k_gdn sums a column over lanes xor 1, 2");
template <int R>
__global__ void __launch_bounds__(GDN_COLS *GDN_SPLIT)
    k_gdn(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
          int64_t dv, int64_t C, float *S, float *O) {
    __shared__ float kq[2 * DK_MAX];
    const int64_t h = blockIdx.x, j = (int64_t)blockIdx.y * GDN_COLS + threadIdx.x / GDN_SPLIT;
    const int p = threadIdx.x % GDN_SPLIT;
    const bool col = j < dv; /* threads past dv take part in the barriers and shuffles only */
    float s[R];
    float *Sh = col ? S + h * dk * dv : NULL;
    UNROLL
    for (int r = 0; r < R; r++) s[r] = Sh && p * R + r < dk ? Sh[(p * R + r) * dv + j] : 0.0f;
    for (int64_t t = 0; t < T; t++) {
        const float *row = conv + t * C, *q = row + (h % Hk) * dk, *k = row + Hk * dk + (h % Hk) * dk;
        const float v = col ? row[2 * Hk * dk + h * dv + j] : 0.0f;
        __syncthreads(); /* the previous row's reads of kq are done */
        for (int64_t i = threadIdx.x; i < GDN_SPLIT * R; i += blockDim.x)
            kq[i] = i < dk ? k[i] : 0.0f, kq[DK_MAX + i] = i < dk ? q[i] : 0.0f;
        __syncthreads();
        const float *kk = kq + p * R, *qq = kq + DK_MAX + p * R;
        float o = 0.0f, tmp = 0.0f;
        const float eg = expf(g[t * Hv + h]);
        UNROLL
        for (int r = 0; r < R; r++) {
            s[r] = s[r] * eg;
            tmp += s[r] * kk[r];
        }
        tmp += __shfl_xor_sync(0xffffffffu, tmp, 1);
        tmp += __shfl_xor_sync(0xffffffffu, tmp, 2);
        const float delta = (v - tmp) * beta[t * Hv + h];
        UNROLL
        for (int r = 0; r < R; r++) s[r] += kk[r] * delta;
        UNROLL
        for (int r = 0; r < R; r++) o += s[r] * qq[r];
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        o += __shfl_xor_sync(0xffffffffu, o, 2);
        if (col && p == 0) O[(t * Hv + h) * dv + j] = o;
    }
    if (Sh) {
        UNROLL
        for (int r = 0; r < R; r++)
            if (p * R + r < dk) Sh[(p * R + r) * dv + j] = s[r];
    }
}

/* k_gdn's launch for dk <= DK_MAX (rows a thread: the least of 8, 16, 32, 64 that covers dk). */
static void gdn_launch(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                       int64_t dk, int64_t dv, int64_t C, float *S, float *O) {
    const dim3 grid((unsigned)Hv, (unsigned)((dv + GDN_COLS - 1) / GDN_COLS)), block(GDN_COLS * GDN_SPLIT);
    if (dk <= GDN_SPLIT * 8) LAUNCH(k_gdn<8>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else if (dk <= GDN_SPLIT * 16) LAUNCH(k_gdn<16>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else if (dk <= GDN_SPLIT * 32) LAUNCH(k_gdn<32>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else LAUNCH(k_gdn<64>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
}

#include "gdn_chunk.cuh"
#include "gdn_block.cuh"
