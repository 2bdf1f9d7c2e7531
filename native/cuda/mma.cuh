/* mma.cuh: the many-row products of block formats on int8 tensor cores (sm_80 and later), for
 * native/cuda/cuda.cu (included there after dequant.cuh, dp4a, tile and the activations' int8
 * form). The same integer products as k_matmul_q (exact int32 sums of int8 weights times int8
 * activations per group of 32 (Q6_K: 16) values, scaled in float32 per group), so the two
 * differ only in float order; this one shares each weight group's unpacking among 8 NT rows.
 * And those of F16 and BF16 weights on f16/bf16 tensor cores (k_matmul_mma_f), with the float32
 * activations split into 2 f16 (3 bf16) terms whose sum is the value within 2^-22 (2^-27) of it,
 * so that these products, too, differ from the CPU's float32 ones in rounding only. And the
 * tf32 tile product and split (tf32_split, mma_16x8x8_tf32) with which k_attention_mma in
 * cuda.cu makes float32 products of float32 values on tensor cores.
 *
 * Fragment layout of mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 (PTX ISA, "Matrix Fragments
 * for mma.m16n8k16 with integer type"), lane = 4 g + t: A (16 x 16) register a0 holds row g,
 * columns 4t..4t+3, a1 row g + 8, the same columns; B (16 x 8) holds rows 4t..4t+3 of column g;
 * C (16 x 8 int32) c0, c1 are row g, columns 2t, 2t+1, and c2, c3 row g + 8. */
#ifndef CLOVER_MMA_CUH
#define CLOVER_MMA_CUH

/* c += A B for one 16 x 8 x 16 int8 tile (layout above). Off the GPU (the CUDA emulator) the
 * same layout, from every lane's registers at once (clover_emu_gather), so a test there checks
 * the kernel's indexing against it. */
__device__ __forceinline__ void mma_16x8x16(int c[4], uint32_t a0, uint32_t a1, uint32_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5}, {%6}, {%0, %1, %2, %3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b));
#elif !defined(CLOVER_CUDA_EMU)
    __trap(); /* never launched below sm_80 (use_mma) */
#else
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const uint32_t mine[3] = {a0, a1, b};
    uint32_t all[32][3]; /* every lane's registers */
    clover_emu_gather(mine, &all[0][0], 3);
    for (int u = 0; u < 4; u++) { /* lane 4 g + u: A's rows g, g + 8, columns 4u..4u+3; lane 4 n + u: B's
                                   * column n, rows 4u..4u+3 */
        const uint32_t ra = all[4 * g + u][0], rb = all[4 * g + u][1];
        const uint32_t b0 = all[4 * (2 * t) + u][2], b1 = all[4 * (2 * t + 1) + u][2];
        c[0] = dp4a(ra, b0, c[0]), c[1] = dp4a(ra, b1, c[1]), c[2] = dp4a(rb, b0, c[2]), c[3] = dp4a(rb, b1, c[3]);
    }
#endif
}

/* The rows a warp of k_matmul_mma / k_matmul_mma_f takes: weight rows r0 .. r0 + 15 (warp
 * threadIdx.y of block blockIdx.x takes tile WARPS blockIdx.x + threadIdx.y), wa and wb the rows
 * g and g + 8 of lane 4g + t (past ne1: row ne1 - 1, read and not stored), and the nr activation
 * rows from t0 (blockIdx.y: rows 8 NT y.. of one matrix, or tile y of a grouped product, expert
 * e's matrix at W + e w_stride); nr <= 0: none (tiles past ne1, or an unused tile). */
struct mma_rows {
    int64_t r0, t0;
    int nr;
    const uint8_t *wa, *wb;
};

template <int NT>
__device__ __forceinline__ mma_rows mma_rows_of(const uint8_t *W, int64_t w_stride, int64_t row_bytes, int64_t ne1,
                                                int64_t T, const tile *tiles) {
    mma_rows m;
    const int g = threadIdx.x / 4;
    m.r0 = ((int64_t)blockIdx.x * WARPS + threadIdx.y) * 16, m.t0 = 0, m.nr = 0, m.wa = m.wb = W;
    if (m.r0 >= ne1) return m;
    int64_t e = 0;
    if (tiles) {
        const tile tl = tiles[blockIdx.y];
        e = tl.e, m.t0 = tl.t0, m.nr = tl.nr;
    } else {
        m.t0 = (int64_t)blockIdx.y * 8 * NT;
        m.nr = (int)(T - m.t0 < 8 * NT ? T - m.t0 : 8 * NT);
    }
    m.wa = W + e * w_stride + (m.r0 + g < ne1 ? m.r0 + g : ne1 - 1) * row_bytes;
    m.wb = W + e * w_stride + (m.r0 + g + 8 < ne1 ? m.r0 + g + 8 : ne1 - 1) * row_bytes;
    return m;
}

/* A warp's tile of Y from its accumulators (lane 4g + t: weight rows g, g + 8 from mr.r0 and
 * activation rows 8n + 2t, 8n + 2t + 1 from mr.t0; those past ne1 or mr.nr not stored), each
 * activation row's result times inv[row] (inv NULL: as is). */
template <int NT>
__device__ __forceinline__ void mma_store(const float (*acc)[4], const mma_rows &mr, int64_t ne1, float *Y,
                                          const float *inv) {
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    for (int n = 0; n < NT; n++)
        for (int i = 0; i < 4; i++) {
            const int64_t r = mr.r0 + g + 8 * (i >> 1);
            const int cn = 8 * n + 2 * t + (i & 1);
            if (r < ne1 && cn < mr.nr) Y[(mr.t0 + cn) * ne1 + r] = inv ? acc[n][i] * inv[mr.t0 + cn] : acc[n][i];
        }
}

/* Y = W X for a block format: one warp per 16 weight rows and per 8 NT activation rows
 * (mma_rows_of; a grouped product's tiles take NT = 1), X in its int8 form (Q values, D scale and S =
 * D * sum(Q) per 32). For each group of 32 values: the int32 tile sums (two mma per 8 rows),
 * then y += d_x * (s_w * sum) + o_w * S_x with the weight group's scale s_w and offset o_w
 * (dequant.cuh qscale). Lane 4g + t accumulates rows g, g + 8 and columns 8n + 2t, 8n + 2t + 1. */
template <int TYPE, int NT>
__global__ void k_matmul_mma(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const int8_t *Q,
                             const float *D, const float *S, int64_t T, float *Y, const tile *tiles) {
    constexpr int BN = block_info<TYPE>::n, BB = block_info<TYPE>::bytes, G = TYPE == T_Q6_K ? 16 : 32;
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const int64_t ng = ne0 / 32;
    const mma_rows mr = mma_rows_of<NT>(W, w_stride, ne0 / BN * BB, ne1, T, tiles);
    if (mr.nr <= 0) return; /* the whole warp */
    const int64_t t0 = mr.t0;
    const int nr = mr.nr;
    const uint8_t *wa = mr.wa, *wb = mr.wb;
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
    mma_store<NT>(acc, mr, ne1, Y, NULL);
}

/* ---- F16 and BF16 weights ---- */

/* The float value of 16 bits of TYPE's format (T_F16: IEEE binary16, T_BF16: bfloat16). */
template <int TYPE> __device__ __forceinline__ float half_bits(uint32_t h) {
    return TYPE == T_F16 ? __half2float(__ushort_as_half((unsigned short)h)) : __uint_as_float(h << 16);
}

/* c += A B for one 16 x 8 x 16 tile of TYPE (T_F16 or T_BF16) values with float32 sums:
 * mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 (PTX ISA, "Matrix Fragments
 * for mma.m16n8k16 with floating point type"), lane = 4 g + t, two values a register (the lower
 * column or row in the low half): a[0] is row g, columns 2t, 2t + 1; a[1] row g + 8, the same
 * columns; a[2] and a[3] rows g and g + 8, columns 2t + 8, 2t + 9; b0 is rows 2t, 2t + 1 of
 * column g, b1 rows 2t + 8, 2t + 9; c as in mma_16x8x16. Off the GPU the same layout, from every
 * lane's registers (clover_emu_gather), summed in k order. */
template <int TYPE>
__device__ __forceinline__ void mma_16x8x16_f(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    if (TYPE == T_F16)
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#elif !defined(CLOVER_CUDA_EMU)
    __trap(); /* never launched below sm_80 (use_mma) */
#else
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
    uint32_t all[32][6]; /* every lane's registers */
    clover_emu_gather(mine, &all[0][0], 6);
    for (int hi = 0; hi < 2; hi++)     /* k = 8 hi + 2 u + j */
        for (int u = 0; u < 4; u++) { /* lane 4 g + u holds A's columns 2u, 2u + 1 (+ 8 hi) of rows g, g + 8 */
            const uint32_t r0 = all[4 * g + u][2 * hi], r1 = all[4 * g + u][2 * hi + 1];
            const uint32_t c0 = all[4 * (2 * t) + u][4 + hi], c1 = all[4 * (2 * t + 1) + u][4 + hi]; /* B's columns */
            for (int j = 0; j < 2; j++) {
                const float x0 = half_bits<TYPE>(r0 >> 16 * j & 0xFFFFu), x1 = half_bits<TYPE>(r1 >> 16 * j & 0xFFFFu);
                const float y0 = half_bits<TYPE>(c0 >> 16 * j & 0xFFFFu), y1 = half_bits<TYPE>(c1 >> 16 * j & 0xFFFFu);
                c[0] += x0 * y0, c[1] += x0 * y1, c[2] += x1 * y0, c[3] += x1 * y1;
            }
        }
#endif
}

/* 16 bytes at p (8 values), which must be 16-byte aligned; off the GPU a misaligned p aborts. */
__device__ __forceinline__ uint4 ld16(const uint16_t *p) {
#ifdef __CUDA_ARCH__
    return *(const uint4 *)p;
#else
    if ((uintptr_t)p % 16) abort();
    uint4 v;
    memcpy(&v, p, 16);
    return v;
#endif
}

__device__ __forceinline__ uint32_t word(uint4 v, int i) { return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w; }

/* Y = W X for F16 / BF16 weights W (rows 16-byte aligned, ne0 a multiple of 32), tiled as
 * k_matmul_mma: one warp per 16 weight rows and 8 NT activation rows. X comes split
 * (k_act_split): NTERM = 2 (F16) or 3 (BF16) arrays of 16-bit values h_stride apart, whose sum
 * is X times the row's power of two 1 / inv, so Y = inv * sum over the terms of W H. Lane
 * 4g + t reads values 8t..8t+7 of each 32 (one 16-byte load per row and term) and feeds them as
 * two k-slices of 16 (a bijection of k that A and B share: slice s takes 4s..4s+3 of the 8,
 * a[0]/b0 the first two, a[2]/b1 the other two). The tensor cores' running sums restart every
 * F_CHUNK values, and the first term's products sum apart from the smaller terms': tensor cores
 * add into their float32 sums with truncation (A100 measurements), so fewer additions into each
 * sum keep the error near the CPU's float32 sums. */
#define F_CHUNK 128 /* values summed in one run of mma before the float32 sum across runs */
template <int TYPE, int NT>
__global__ void k_matmul_mma_f(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const uint16_t *H,
                               int64_t h_stride, const float *inv, int64_t T, float *Y, const tile *tiles) {
    constexpr int NTERM = TYPE == T_BF16 ? 3 : 2;
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const mma_rows mr = mma_rows_of<NT>(W, w_stride, 2 * ne0, ne1, T, tiles);
    if (mr.nr <= 0) return; /* the whole warp */
    const int64_t t0 = mr.t0;
    const int nr = mr.nr;
    const uint16_t *wa = (const uint16_t *)mr.wa, *wb = (const uint16_t *)mr.wb;
    const uint16_t *hb[NT]; /* B's column g of each n: activation row 8n + g (past nr: the last row) */
    for (int n = 0; n < NT; n++) hb[n] = H + (t0 + min(8 * n + g, nr - 1)) * ne0;
    float acc[NT][4], c[NT][4], cl[NT][4]; /* cl: the terms after the first */
    for (int n = 0; n < NT; n++)
        for (int i = 0; i < 4; i++) acc[n][i] = 0.0f;
    for (int64_t k0 = 0; k0 < ne0; k0 += F_CHUNK) { /* tile sums per F_CHUNK values, added up in acc */
        for (int n = 0; n < NT; n++)
            for (int i = 0; i < 4; i++) c[n][i] = cl[n][i] = 0.0f;
        const int64_t k1 = k0 + F_CHUNK < ne0 ? k0 + F_CHUNK : ne0;
        for (int64_t k = k0 + 8 * t; k < k1; k += 32) {
            const uint4 pa = ld16(wa + k), pb = ld16(wb + k);
            const uint32_t a[2][4] = {{pa.x, pb.x, pa.y, pb.y}, {pa.z, pb.z, pa.w, pb.w}};
            for (int n = 0; n < NT; n++)
                for (int m = 0; m < NTERM; m++) {
                    const uint4 x = ld16(hb[n] + m * h_stride + k);
                    for (int s = 0; s < 2; s++)
                        mma_16x8x16_f<TYPE>(m ? cl[n] : c[n], a[s], word(x, 2 * s), word(x, 2 * s + 1));
                }
        }
        for (int n = 0; n < NT; n++)
            for (int i = 0; i < 4; i++) acc[n][i] += c[n][i] + cl[n][i];
    }
    mma_store<NT>(acc, mr, ne1, Y, inv);
}

/* ---- float32 values on tf32 tensor cores ---- */

/* x rounded to tf32 (float32 with 10 fraction bits; to nearest, ties away from zero, as PTX's
 * cvt.rna.tf32.f32), in a float32; Inf and NaN as they are. The same integer steps on the GPU
 * and off it. */
__device__ __forceinline__ float tf32_round(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7F800000u) != 0x7F800000u) u = (u + 0x1000u) & 0xFFFFE000u;
    return __uint_as_float(u);
}

/* x as hi + lo, both tf32 values: hi = x rounded, lo = the rest rounded, so hi + lo is x within
 * 2^-22 of |x| (the split of CUTLASS's "3xTF32" float32 products: hi hi' + hi lo' + lo hi'). */
struct tf32_pair {
    float hi, lo;
};
__device__ __forceinline__ tf32_pair tf32_split(float x) {
    const float hi = tf32_round(x);
    return {hi, tf32_round(x - hi)};
}

/* c += A B for one 16 x 8 x 8 tile of tf32 values (float32 registers whose low 13 bits are zero)
 * with float32 sums: mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 (PTX ISA, "Matrix
 * Fragments for mma.m16n8k8", .tf32), lane = 4 g + t: a[0] is A's row g, column t, a[1] row
 * g + 8, column t, a[2] and a[3] the same rows, column t + 4; b0 is B's row t, column g, b1 row
 * t + 4; c as in mma_16x8x16. Off the GPU the same layout, from every lane's registers
 * (clover_emu_gather), summed in k order; an operand that is not a tf32 value aborts there (the
 * tensor cores ignore its low 13 bits). */
__device__ __forceinline__ void mma_16x8x8_tf32(float c[4], const float a[4], float b0, float b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(__float_as_uint(a[0])), "r"(__float_as_uint(a[1])), "r"(__float_as_uint(a[2])),
          "r"(__float_as_uint(a[3])), "r"(__float_as_uint(b0)), "r"(__float_as_uint(b1)));
#elif !defined(CLOVER_CUDA_EMU)
    __trap(); /* never launched below sm_80 (use_mma) */
#else
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const uint32_t mine[6] = {__float_as_uint(a[0]), __float_as_uint(a[1]), __float_as_uint(a[2]),
                              __float_as_uint(a[3]), __float_as_uint(b0),   __float_as_uint(b1)};
    for (int i = 0; i < 6; i++)
        if (mine[i] & 0x1FFFu) abort(); /* not a tf32 value: the GPU would drop bits the sums here keep */
    uint32_t all[32][6]; /* every lane's registers */
    clover_emu_gather(mine, &all[0][0], 6);
    for (int k = 0; k < 8; k++) { /* lane 4 g + u holds A's columns u (a[0], a[1]) and u + 4 (a[2], a[3]) of rows
                                   * g, g + 8, and B's rows u (b0) and u + 4 (b1) of column g */
        const int u = k % 4, h = k / 4;
        const float x0 = __uint_as_float(all[4 * g + u][2 * h]), x1 = __uint_as_float(all[4 * g + u][2 * h + 1]);
        const float y0 = __uint_as_float(all[4 * (2 * t) + u][4 + h]);
        const float y1 = __uint_as_float(all[4 * (2 * t + 1) + u][4 + h]);
        c[0] += x0 * y0, c[1] += x0 * y1, c[2] += x1 * y0, c[3] += x1 * y1;
    }
#endif
}

#endif
