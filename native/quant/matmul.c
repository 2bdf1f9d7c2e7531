/* matmul.c: the matrix products of the CPU engine over every weight format (clover-spec 6), and
 * which formats they take (clover_row_nbytes: those with a dot kernel in quant/dot.h).
 *
 * clover_matmul reads each weight row once for all T activation rows. F16/BF16 rows are
 * converted to float32 into a per-thread scratch buffer first; quantised weights are paired with
 * activations quantised once per call (Q8_0 or Q8_K, quant/dot.h) and multiplied with int32
 * block sums scaled by d_w*d_x, as llama.cpp's ggml_vec_dot_q8_0_q8_0 does. SIMD kernels are
 * tested against the scalar ones (tests/native/test_dot.py).
 *
 * Build without -ffast-math: rounding relies on exact IEEE float arithmetic.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "clover.h"
#include "quant/dot.h"
#include "quant/matmul.h"
#include "quant/quants.h"


/* Bytes of one row of n_in elements of a weight type the products take; -1 otherwise. */
CLOVER_INTERNAL int64_t clover_row_nbytes(int type, int64_t n_in) {
    if (n_in < 0) return -1;
    switch (type) {
    case CLOVER_TYPE_F32:
        return n_in > INT64_MAX / 4 ? -1 : n_in * 4;
    case CLOVER_TYPE_F16:
    case CLOVER_TYPE_BF16:
        return n_in > INT64_MAX / 2 ? -1 : n_in * 2;
    case CLOVER_TYPE_Q8_0:
        if (n_in % CLOVER_QK8_0 != 0) return -1;
        return (n_in / CLOVER_QK8_0) * Q8_0_BYTES; /* no overflow: 34/32 < 4 */
    default:
        /* the other block formats are weight types where this CPU build has a dot kernel */
        if (clover_dot_act_type(type) < 0 || clover_dot_kernel(type, -1) == NULL) return -1;
        return clover_kq_nbytes(type, n_in);
    }
}

/* ---------------------------------------------------------------- matmul kernels
 * Weight rows are processed in tiles of ROWS rows; for each tile every activation row t is
 * dotted against all ROWS rows at once, so each x element loaded serves ROWS products. The
 * last tile repeats its final row to stay full (the duplicate results are not stored). A
 * row's result depends only on that row and x, never on the tile partner or thread split,
 * so any n_threads gives bit-identical output. */
#define ROWS 4
#define LANES 8 /* independent partial sums per row */

/* out[k] = dot(w[k], x) for k < ROWS, float accumulation over LANES partial sums. */
static void dot_rows_f32(const float *const w[ROWS], const float *x, int64_t n, float out[ROWS]) {
    float acc[ROWS][LANES] = {{0}};
    int64_t j = 0;
    for (; j + LANES <= n; j += LANES) {
        for (int k = 0; k < ROWS; k++) {
            const float *wk = w[k] + j;
            for (int l = 0; l < LANES; l++) acc[k][l] += wk[l] * x[j + l];
        }
    }
    for (int k = 0; k < ROWS; k++) {
        float tail = 0.0f;
        for (int64_t i = j; i < n; i++) tail += w[k][i] * x[i];
        float s = tail;
        for (int l = 0; l < LANES; l++) s += acc[k][l];
        out[k] = s;
    }
}

static int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* Threads only pay off above ~64K multiply-adds; below that the fork/join costs more (and
 * oversubscribed cores make it much worse). */
static int worth_threads(int nth, int64_t n_out, int64_t n_in, int64_t T) {
    return nth > 1 && (double)n_out * (double)n_in * (double)T >= 65536.0;
}

/* Quantised weights (dot.h): every activation row is quantised once to the type's paired
 * format; then per group of QROWS weight rows (read from memory once) every activation row is
 * dotted with the group while the group sits in cache. */
#define QROWS 16 /* weight rows per work item */
static int matmul_quantized(int type, int act, const uint8_t *wbytes, int64_t row_bytes, int64_t n_in,
                            int64_t n_out, const float *x, int64_t T, float *y, int nth) {
    const clover_vec_dot_fn dot1 = clover_dot_kernel(type, -1);
    const clover_vec_dot4_fn dot4 = T >= 2 ? clover_dot4_kernel(type) : NULL;
    const int64_t act_bytes = clover_type_nbytes(act, n_in);
    if (dot1 == NULL || act_bytes < 0 || (uint64_t)act_bytes > SIZE_MAX / (uint64_t)T) return -1;
    /* rows [0, T4) go through the 4-row kernel, in its packed layout where it has one; a tail
     * of 2 or 3 rows is padded to 4 with copies of the last row (one 4-row pass costs about
     * what 2 single-row passes do: AVX2, Q4_K and Q6_K, docs/bench.md; the copies' outputs are
     * dropped). Where a one-row kernel reads the 4-row kernel's layout (dot.h
     * clover_dot1_x4_kernel), every row is in that layout. */
    const int64_t T4 = dot4 ? (T % 4 >= 2 ? T + 4 - T % 4 : T - T % 4) : 0;
    const int64_t TA = T4 > T ? T4 : T; /* activation rows incl. padding */
    const clover_vec_dot_fn dotp = clover_dot1_x4_kernel(type);
    const clover_vec_dot_fn dot = dotp ? dotp : dot1;
    /* 1: Q8_0 packed, 2: Q8_K K-permuted, 3: Q8_0 split, 4: Q8_K paired */
    const int packed = dotp || T4 > 0 ? clover_dot4_packed(type) : 0;
    const int64_t n_packed = dotp ? TA : T4; /* rows in the packed layout */
    const int64_t x4_bytes = packed == 1   ? clover_x4_row_bytes(n_in)
                             : packed == 3 ? clover_x4_split_row_bytes(n_in)
                                           : act_bytes;
    if ((packed && (uint64_t)x4_bytes > SIZE_MAX / (uint64_t)n_packed) || (uint64_t)act_bytes > SIZE_MAX / (uint64_t)(T + 3))
        return -1;
    uint8_t *xq = malloc((size_t)(act_bytes * TA));
    uint8_t *xp = packed ? malloc((size_t)(x4_bytes * n_packed)) : NULL;
    if (xq == NULL || (packed && xp == NULL)) {
        free(xq);
        free(xp);
        return -1;
    }
    const uint8_t *x4 = packed ? xp : xq;
    const int64_t n_items = (n_out + QROWS - 1) / QROWS;
    const int parallel = worth_threads(nth, n_out, n_in, T);
    (void)parallel;
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static) if (parallel && T > 1) reduction(| : bad)
#endif
    for (int64_t t = 0; t < TA; t++) {
        const int64_t src = t < T ? t : T - 1;
        bad |= clover_quantize_act(act, x + src * n_in, xq + t * act_bytes, n_in) < 0;
        if (packed == 1 && t < n_packed) clover_x4_pack_q8_0(xq + t * act_bytes, xp + t * x4_bytes, n_in);
        if (packed == 2 && t < n_packed) clover_x4_pack_q8_K(xq + t * act_bytes, xp + t * x4_bytes, n_in);
        if (packed == 3 && t < n_packed) clover_x4_split_q8_0(xq + t * act_bytes, xp + t * x4_bytes, n_in);
        if (packed == 4 && t < n_packed) clover_x4_pair_q8_K(xq + t * act_bytes, xp + t * x4_bytes, n_in);
    }
    if (bad) {
        free(xq);
        free(xp);
        return -1;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static) if (parallel)
#endif
    for (int64_t item = 0; item < n_items; item++) {
        /* the item's QROWS weight rows stay in L1/L2 while each activation row passes once */
        const int64_t r0 = item * QROWS, r1 = r0 + QROWS < n_out ? r0 + QROWS : n_out;
        for (int64_t t = 0; t < T4; t += 4) /* four activation rows per weight-row pass */
            for (int64_t r = r0; r < r1; r++) {
                float o4[4];
                dot4(n_in, wbytes + r * row_bytes, x4 + t * x4_bytes, x4_bytes, o4);
                for (int i = 0; i < 4 && t + i < T; i++) y[(t + i) * n_out + r] = o4[i];
            }
        for (int64_t t = T4; t < T; t++) {
            const uint8_t *xt = dotp ? xp + t * x4_bytes : xq + t * act_bytes;
            float *yt = y + t * n_out;
            for (int64_t r = r0; r < r1; r++) yt[r] = dot(n_in, wbytes + r * row_bytes, xt);
        }
    }
    free(xq);
    free(xp);
    return 0;
}

CLOVER_INTERNAL int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x,
                                  int64_t T, float *y, int n_threads) {
    const int64_t row_bytes = clover_row_nbytes(type, n_in);
    if (row_bytes < 0 || n_in <= 0 || n_out < 0 || T < 0) return -1;
    if (n_out == 0 || T == 0) return 0;
    if (W == NULL || x == NULL || y == NULL) return -1;
    const int nth = n_threads > 1 ? n_threads : 1;
    const int64_t n_tiles = (n_out + ROWS - 1) / ROWS;
    const uint8_t *wbytes = (const uint8_t *)W;
    const int act = clover_dot_act_type(type);
    if (act >= 0) return matmul_quantized(type, act, wbytes, row_bytes, n_in, n_out, x, T, y, nth);

    /* scratch: F16/BF16 -> float rows per thread; sizes are checked for overflow. */
    float *scratch = NULL;
    if (type == CLOVER_TYPE_F16 || type == CLOVER_TYPE_BF16) {
        if ((uint64_t)n_in > SIZE_MAX / sizeof(float) / ROWS / (uint64_t)nth) return -1;
        scratch = malloc((size_t)nth * ROWS * (size_t)n_in * sizeof(float));
        if (scratch == NULL) return -1;
    }

    const int parallel = worth_threads(nth, n_out, n_in, T);
    (void)parallel;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static) if (parallel)
#endif
    for (int64_t tile = 0; tile < n_tiles; tile++) {
        const int64_t r0 = tile * ROWS;
        int64_t rows[ROWS];
        for (int k = 0; k < ROWS; k++) rows[k] = r0 + k < n_out ? r0 + k : n_out - 1;
        const int n_valid = (int)(n_out - r0 < ROWS ? n_out - r0 : ROWS);
        float out[ROWS];

        const float *w[ROWS];
        if (type == CLOVER_TYPE_F32) {
            for (int k = 0; k < ROWS; k++) w[k] = (const float *)(wbytes + rows[k] * row_bytes);
        } else {
            float *sc = scratch + (size_t)thread_index() * ROWS * (size_t)n_in;
            for (int k = 0; k < ROWS; k++) {
                const uint8_t *src = wbytes + rows[k] * row_bytes;
                float *dst = sc + (size_t)k * (size_t)n_in;
                if (k > 0 && rows[k] == rows[k - 1]) {
                    w[k] = w[k - 1]; /* duplicated last row of a partial tile */
                    continue;
                }
                if (type == CLOVER_TYPE_F16)
                    clover_f16_row_to_f32(src, dst, n_in);
                else
                    clover_bf16_row_to_f32(src, dst, n_in);
                w[k] = dst;
            }
        }
        for (int64_t t = 0; t < T; t++) {
            dot_rows_f32(w, x + t * n_in, n_in, out);
            for (int k = 0; k < n_valid; k++) y[t * n_out + r0 + k] = out[k];
        }
    }

    free(scratch);
    return 0;
}
