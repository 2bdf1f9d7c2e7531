/* mma.cuh: the many-row products of block formats on int8 tensor cores (sm_80 and later), for
 * native/cuda/cuda.cu (included there after dequant.cuh, dp4a, tile and the activations' int8
 * form). The same integer products as k_matmul_q (exact int32 sums of int8 weights times int8
 * activations per group of 32 (Q6_K: 16) values, scaled in float32 per group), so the two
 * differ only in float order; this one shares each weight group's unpacking among 8 NT rows.
 *
 * Fragment layout of mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 (PTX ISA, "Matrix Fragments
 * for mma.m16n8k16 with integer type"), lane = 4 g + t: A (16 x 16) register a0 holds row g,
 * columns 4t..4t+3, a1 row g + 8, the same columns; B (16 x 8) holds rows 4t..4t+3 of column g;
 * C (16 x 8 int32) c0, c1 are row g, columns 2t, 2t+1, and c2, c3 row g + 8. */
#ifndef CLOVER_MMA_CUH
#define CLOVER_MMA_CUH

/* c += A B for one 16 x 8 x 16 int8 tile (layout above). Off the GPU (the CUDA emulator) the
 * same layout, gathered with shuffles, so a test there checks the kernel's indexing against it. */
__device__ __forceinline__ void mma_16x8x16(int c[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
#elif defined(__CUDA_ARCH__)
    __trap(); /* never launched below sm_80 (use_mma) */
#else
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    for (int u = 0; u < 4; u++) { /* columns 4u..4u+3 of A's rows, rows 4u..4u+3 of B's columns */
        const uint32_t ra = __shfl_sync(0xffffffffu, a0, 4 * g + u), rb = __shfl_sync(0xffffffffu, a1, 4 * g + u);
        const uint32_t b0 = __shfl_sync(0xffffffffu, b, 8 * t + u), b1 = __shfl_sync(0xffffffffu, b, 8 * t + 4 + u);
        c[0] = dp4a(ra, b0, c[0]), c[1] = dp4a(ra, b1, c[1]), c[2] = dp4a(rb, b0, c[2]), c[3] = dp4a(rb, b1, c[3]);
    }
#endif
}

/* Y = W X for a block format: one warp per 16 weight rows (warp threadIdx.y of block blockIdx.x
 * takes tile WARPS blockIdx.x + threadIdx.y; rows past ne1 are read as row ne1 - 1 and not stored,
 * a tile past them returns) and per 8 NT activation rows (blockIdx.y: rows 8 NT y.. of one
 * matrix, or tile y of a grouped product, NT = 1), X in its int8 form (Q values, D scale and S =
 * D * sum(Q) per 32). For each group of 32 values: the int32 tile sums (two mma per 8 rows),
 * then y += d_x * (s_w * sum) + o_w * S_x with the weight group's scale s_w and offset o_w
 * (dequant.cuh qscale). Lane 4g + t accumulates rows g, g + 8 and columns 8n + 2t, 8n + 2t + 1. */
template <int TYPE, int NT>
__global__ void k_matmul_mma(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const int8_t *Q,
                             const float *D, const float *S, int64_t T, float *Y, const tile *tiles) {
    constexpr int BN = block_info<TYPE>::n, BB = block_info<TYPE>::bytes, G = TYPE == T_Q6_K ? 16 : 32;
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const int64_t r0 = ((int64_t)blockIdx.x * WARPS + threadIdx.y) * 16, ng = ne0 / 32, row_bytes = ne0 / BN * BB;
    if (r0 >= ne1) return; /* the whole warp */
    int64_t e = 0, t0;
    int nr;
    if (tiles) {
        const tile tl = tiles[blockIdx.y];
        e = tl.e, t0 = tl.t0, nr = tl.nr;
    } else {
        t0 = (int64_t)blockIdx.y * 8 * NT;
        nr = (int)(T - t0 < 8 * NT ? T - t0 : 8 * NT);
    }
    if (nr <= 0) return; /* an unused tile (the whole warp) */
    const uint8_t *wa = W + e * w_stride + (r0 + g < ne1 ? r0 + g : ne1 - 1) * row_bytes;
    const uint8_t *wb = W + e * w_stride + (r0 + g + 8 < ne1 ? r0 + g + 8 : ne1 - 1) * row_bytes;
    const int8_t *qb[NT]; /* B's column g of each n: activation row 8n + g (past nr: the last row) */
    int64_t col[NT][2];   /* the activation rows of this lane's accumulators (clamped likewise) */
    for (int n = 0; n < NT; n++) {
        qb[n] = Q + (t0 + min(8 * n + g, nr - 1)) * ne0;
        for (int i = 0; i < 2; i++) col[n][i] = t0 + min(8 * n + 2 * t + i, nr - 1);
    }
    float acc[NT][4];
    int c[NT][4];
    for (int n = 0; n < NT; n++)
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f, c[n][i] = 0;
    for (int64_t gi = 0; gi < ng; gi++) {
        const int64_t j = gi * 32;
        const uint8_t *ba = wa + j / BN * BB, *bb = wb + j / BN * BB;
        const int jj = (int)(j % BN);
        for (int h = 0; h < 2; h++) {
            const uint32_t a0 = qpack<TYPE>(ba, jj + 16 * h + 4 * t), a1 = qpack<TYPE>(bb, jj + 16 * h + 4 * t);
            for (int n = 0; n < NT; n++) mma_16x8x16(c[n], a0, a1, *(const uint32_t *)(qb[n] + j + 16 * h + 4 * t));
            if (G == 32 && h == 0) continue;
            const qscale_t sw[2] = {qscale<TYPE>(ba, jj + 16 * h), qscale<TYPE>(bb, jj + 16 * h)};
            for (int n = 0; n < NT; n++)
                for (int i = 0; i < 4; i++) {
                    const int64_t x = col[n][i & 1] * ng + gi;
                    float v = D[x] * (sw[i >> 1].s * (float)c[n][i]);
                    if (has_offset<TYPE>::v) v += sw[i >> 1].o * S[x];
                    acc[n][i] += v;
                    c[n][i] = 0;
                }
        }
    }
    for (int n = 0; n < NT; n++)
        for (int i = 0; i < 4; i++) {
            const int64_t r = r0 + g + 8 * (i >> 1);
            const int cn = 8 * n + 2 * t + (i & 1);
            if (r < ne1 && cn < nr) Y[(t0 + cn) * ne1 + r] = acc[n][i];
        }
}

#endif
