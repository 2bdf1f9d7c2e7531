/* dot_avx2.c: AVX2 + FMA kernels of the Q8_0-paired weight types (Q8_0, Q4_0, IQ4_NL, MXFP4).
 * Compiled with function target attributes (no global -m flags) and only called after
 * clover_dot_best_isa() found AVX2 and FMA. Each block of 32 gives an exact int32 sum (the
 * sign trick turns the signed x signed product into maddubs' unsigned x signed form; |w| <= 128,
 * |x| <= 127 keeps each pair sum inside int16), then one FMA with both scales.
 */
#include "quant/dot.h"

#include "clover.h"
#include "quant/quants.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/x86/simd_x86.h"

#define AVX2 CLOVER_AVX2

/* 8 int32 partial sums of w[i] * x[i] over 32 signed bytes each. */
static inline AVX2 __m256i isum8(__m256i w, __m256i x) {
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
}

/* 32 signed bytes from 16 nibble bytes: low nibbles -> elements 0..15, high -> 16..31, each
 * code mapped through a 16-entry table (pshufb). */
static inline AVX2 __m256i nibbles_table(const uint8_t *qs, __m128i table) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(15);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, m));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm256_set_m128i(hi, lo);
}

/* The loop shared by the four types: GET(wb) unpacks a weight block's 32 codes, SCALE(wb) its
 * scale, BYTES is the block size (a macro so each kernel inlines its own unpacking). */
#define DOT_Q8_0_FAMILY(BYTES, GET, SCALE)                                                   \
    const uint8_t *wb = w;                                                                   \
    const clover_block_q8_0 *x = xq;                                                         \
    __m256 acc = _mm256_setzero_ps();                                                        \
    for (int64_t b = 0; b < n / 32; b++, wb += (BYTES)) {                                    \
        CLOVER_PREFETCH(wb, 1);                                                               \
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);                     \
        const __m256 d = _mm256_set1_ps(SCALE(wb) * clover_fp16_load(&x[b].d));              \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum8(GET(wb), qx)), d, acc);              \
    }                                                                                        \
    return clover_hsum8(acc);

#define GET_Q8_0(p) _mm256_loadu_si256((const __m256i *)((p) + 2))
#define GET_TABLE2(p) nibbles_table((p) + 2, table)
#define GET_TABLE1(p) nibbles_table((p) + 1, table)
#define SCALE_FP16(p) clover_fp16_load(p)
#define SCALE_E8M0(p) clover_e8m0_half((p)[0])

static AVX2 float dot_q8_0(int64_t n, const void *w, const void *xq) { DOT_Q8_0_FAMILY(34, GET_Q8_0, SCALE_FP16) }

static AVX2 float dot_q4_0(int64_t n, const void *w, const void *xq) {
    /* table mapping code c to c - 8 */
    const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    DOT_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX2 float dot_iq4_nl(int64_t n, const void *w, const void *xq) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_iq4nl);
    DOT_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX2 float dot_mxfp4(int64_t n, const void *w, const void *xq) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_mxfp4);
    DOT_Q8_0_FAMILY(17, GET_TABLE1, SCALE_E8M0)
}

/* R (1 or 4) activation rows (split Q8_0 rows, x_stride bytes apart: dot.h clover_x4_split_q8_0) per
 * weight row (dot.h clover_vec_dot4_fn): each weight block is unpacked once for the R rows, and
 * the rows' scales are read as float. Blocks go 4 at a time: the 4 weight blocks' codes are
 * transposed in 8-byte pieces (piece m: bytes 8m..8m+7 of each block), the order of the split
 * rows' groups, so that int32 lanes 2k, 2k+1 of the 4 pieces' pair sums hold block k only; the
 * 4 pieces' sums add up in int32 and one FMA with the scale products d_w * d_x of the 4 blocks
 * (each in 2 lanes) takes them into 8 float lanes. The last n / 32 % 4 blocks go one at a time
 * into the same lanes. Every row runs the same float steps, so a row's value does not depend on
 * R or on the other rows. */
#define DOTR_Q8_0_FAMILY(R, BYTES, GET, SCALE)                                               \
    const uint8_t *wb = w;                                                                   \
    const int64_t nb = n / 32;                                                               \
    const int8_t *xs[4];                                                                     \
    const float *xd[4];                                                                      \
    __m256 acc[4];                                                                           \
    for (int i = 0; i < (R); i++) {                                                          \
        xs[i] = (const int8_t *)xq + i * x_stride;                                           \
        xd[i] = (const float *)(xs[i] + n);                                                  \
        acc[i] = _mm256_setzero_ps();                                                        \
    }                                                                                        \
    const __m256i ones = _mm256_set1_epi16(1);                                               \
    const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);                         \
    int64_t b = 0;                                                                           \
    for (; b + 4 <= nb; b += 4, wb += 4 * (BYTES)) {                                         \
        CLOVER_PREFETCH(wb, (4 * (BYTES) + 63) / 64);                                        \
        const __m256i c0 = GET(wb), c1 = GET(wb + (BYTES));                                  \
        const __m256i c2 = GET(wb + 2 * (BYTES)), c3 = GET(wb + 3 * (BYTES));                \
        const __m256i t0 = _mm256_unpacklo_epi64(c0, c1), t1 = _mm256_unpackhi_epi64(c0, c1); \
        const __m256i t2 = _mm256_unpacklo_epi64(c2, c3), t3 = _mm256_unpackhi_epi64(c2, c3); \
        const __m256i qw[4] = {_mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20), \
                               _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)}; \
        __m256i uw[4];                                                                       \
        for (int m = 0; m < 4; m++) uw[m] = _mm256_sign_epi8(qw[m], qw[m]);                  \
        const __m128 dw = _mm_setr_ps(SCALE(wb), SCALE(wb + (BYTES)), SCALE(wb + 2 * (BYTES)),   \
                                      SCALE(wb + 3 * (BYTES)));                              \
        for (int i = 0; i < (R); i++) {                                                      \
            __m256i s = _mm256_setzero_si256();                                              \
            for (int m = 0; m < 4; m++) {                                                    \
                const __m256i qx = _mm256_loadu_si256((const __m256i *)(xs[i] + 32 * (b + m))); \
                s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(uw[m], _mm256_sign_epi8(qx, qw[m])), ones)); \
            }                                                                                \
            const __m128 d4 = _mm_mul_ps(dw, _mm_loadu_ps(xd[i] + b));                       \
            const __m256 d8 = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), pairs);   \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d8, acc[i]);                     \
        }                                                                                    \
    }                                                                                        \
    for (; b < nb; b++, wb += (BYTES)) {                                                     \
        CLOVER_PREFETCH(wb, 1);                                                              \
        const __m256i qw = GET(wb);                                                          \
        const __m256i uw = _mm256_sign_epi8(qw, qw);                                         \
        const __m256 dw = _mm256_set1_ps(SCALE(wb));                                         \
        for (int i = 0; i < (R); i++) {                                                      \
            const __m256i qx = _mm256_loadu_si256((const __m256i *)(xs[i] + 32 * b));        \
            const __m256i p16 = _mm256_maddubs_epi16(uw, _mm256_sign_epi8(qx, qw));          \
            const __m256i s = _mm256_madd_epi16(p16, ones);                                  \
            const __m256 d = _mm256_mul_ps(dw, _mm256_broadcast_ss(xd[i] + b));              \
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[i]);                      \
        }                                                                                    \
    }                                                                                        \
    for (int i = 0; i < (R); i++) out[i] = clover_hsum8(acc[i]);

static AVX2 void dot4_q8_0(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    DOTR_Q8_0_FAMILY(4, 34, GET_Q8_0, SCALE_FP16)
}

static AVX2 void dot4_q4_0(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    DOTR_Q8_0_FAMILY(4, 18, GET_TABLE2, SCALE_FP16)
}

static AVX2 void dot4_iq4_nl(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_iq4nl);
    DOTR_Q8_0_FAMILY(4, 18, GET_TABLE2, SCALE_FP16)
}

static AVX2 void dot4_mxfp4(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_mxfp4);
    DOTR_Q8_0_FAMILY(4, 17, GET_TABLE1, SCALE_E8M0)
}

/* One split row (dot.h clover_dot1_x4_avx2): the 4-row kernels' steps for one row. */
#define DOT1_SPLIT(NAME, BYTES, GET, SCALE, ...)                                           \
    static AVX2 float NAME(int64_t n, const void *w, const void *xq) {                       \
        __VA_ARGS__;                                                                         \
        const int64_t x_stride = 0;                                                          \
        float out[1];                                                                        \
        DOTR_Q8_0_FAMILY(1, BYTES, GET, SCALE)                                               \
        return out[0];                                                                       \
    }
DOT1_SPLIT(dot1s_q8_0, 34, GET_Q8_0, SCALE_FP16, (void)0)
DOT1_SPLIT(dot1s_q4_0, 18, GET_TABLE2, SCALE_FP16,
           const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7))
DOT1_SPLIT(dot1s_iq4_nl, 18, GET_TABLE2, SCALE_FP16, const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_iq4nl))
DOT1_SPLIT(dot1s_mxfp4, 17, GET_TABLE1, SCALE_E8M0, const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_mxfp4))

/* q . k over n values, k fp16 (dot.h): two 8-lane FMA sums, then the tail in order. */
static AVX2 float dot_f16(const float *q, const uint16_t *k, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i))), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i + 8))),
                             a1);
    }
    for (; i + 8 <= n; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i))), a0);
    float s = clover_hsum8(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += q[i] * _cvtsh_ss(k[i]);
    return s;
}

/* o += p v over n values, v fp16 (dot.h). */
static AVX2 void axpy_f16(float *o, float p, const uint16_t *v, int64_t n) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + i))),
                                                _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] += p * _cvtsh_ss(v[i]);
}

/* q . k over n float32 values (dot.h): four 8-lane FMA sums (loads, not the FMA latency, bound
 * it), then 8 lanes, then the tail in order. */
static AVX2 float dot_f32(const float *q, const float *k, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 16), _mm256_loadu_ps(k + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 24), _mm256_loadu_ps(k + i + 24), a3);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
    float s = clover_hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; i < n; i++) s += q[i] * k[i];
    return s;
}

/* o += p v over n float32 values (dot.h). */
static AVX2 void axpy_f32(float *o, float p, const float *v, int64_t n) {
    const __m256 pv = _mm256_set1_ps(p);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(o + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(o + i)));
    for (; i < n; i++) o[i] += p * v[i];
}

/* R (<= 4) rows of the float32 product (dot.h clover_gemm_f32_kernel): per 16 columns, 2R
 * 8-lane sums over m in order by FMA, then C += alpha * sum by FMA; the last columns 8 and then
 * 1 at a time. */
static inline __attribute__((always_inline)) AVX2 void gemm_rows(int R, int64_t N, int64_t K, float alpha,
                                                                 const float *A, int64_t lda, const float *B,
                                                                 int64_t ldb, float *C, int64_t ldc) {
    const __m256 al = _mm256_set1_ps(alpha);
    int64_t n0 = 0;
    for (; n0 + 16 <= N; n0 += 16) {
        __m256 c[4][2];
        for (int r = 0; r < R; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
        for (int64_t m = 0; m < K; m++) {
            const __m256 b0 = _mm256_loadu_ps(B + m * ldb + n0), b1 = _mm256_loadu_ps(B + m * ldb + n0 + 8);
            for (int r = 0; r < R; r++) {
                const __m256 a = _mm256_broadcast_ss(A + r * lda + m);
                c[r][0] = _mm256_fmadd_ps(a, b0, c[r][0]), c[r][1] = _mm256_fmadd_ps(a, b1, c[r][1]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int x = 0; x < 2; x++) {
                float *cp = C + r * ldc + n0 + 8 * x;
                _mm256_storeu_ps(cp, _mm256_fmadd_ps(al, c[r][x], _mm256_loadu_ps(cp)));
            }
    }
    for (; n0 + 8 <= N; n0 += 8) {
        __m256 c[4];
        for (int r = 0; r < R; r++) c[r] = _mm256_setzero_ps();
        for (int64_t m = 0; m < K; m++) {
            const __m256 b0 = _mm256_loadu_ps(B + m * ldb + n0);
            for (int r = 0; r < R; r++) c[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(A + r * lda + m), b0, c[r]);
        }
        for (int r = 0; r < R; r++) {
            float *cp = C + r * ldc + n0;
            _mm256_storeu_ps(cp, _mm256_fmadd_ps(al, c[r], _mm256_loadu_ps(cp)));
        }
    }
    for (; n0 < N; n0++)
        for (int r = 0; r < R; r++) {
            float acc = 0.0f;
            for (int64_t m = 0; m < K; m++) acc = __builtin_fmaf(A[r * lda + m], B[m * ldb + n0], acc);
            C[r * ldc + n0] = __builtin_fmaf(alpha, acc, C[r * ldc + n0]);
        }
}

static AVX2 void gemm_f32(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda, const float *B,
                          int64_t ldb, float *C, int64_t ldc) {
    int64_t i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) gemm_rows(4, N, K, alpha, A + i0 * lda, lda, B, ldb, C + i0 * ldc, ldc);
    for (; i0 < M; i0++) gemm_rows(1, N, K, alpha, A + i0 * lda, lda, B, ldb, C + i0 * ldc, ldc);
}

clover_dot_f16_fn clover_dot_f16_avx2(void) { return dot_f16; }
clover_gemm_f32_fn clover_gemm_f32_avx2(void) { return gemm_f32; }
clover_axpy_f16_fn clover_axpy_f16_avx2(void) { return axpy_f16; }
clover_dot_f32_fn clover_dot_f32_avx2(void) { return dot_f32; }
clover_axpy_f32_fn clover_axpy_f32_avx2(void) { return axpy_f32; }

clover_vec_dot_fn clover_dot_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot_q8_0;
    case CLOVER_TYPE_Q4_0: return dot_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot_mxfp4;
    default: return clover_dot_k_avx2(type);
    }
}

clover_vec_dot4_fn clover_dot4_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot4_q8_0;
    case CLOVER_TYPE_Q4_0: return dot4_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot4_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot4_mxfp4;
    default: return clover_dot4_k_avx2(type);
    }
}

clover_vec_dot_fn clover_dot1_x4_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot1s_q8_0;
    case CLOVER_TYPE_Q4_0: return dot1s_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot1s_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot1s_mxfp4;
    default: return clover_dot_paired_avx2(type);
    }
}

#else
clover_vec_dot_fn clover_dot1_x4_avx2(int type) {
    (void)type;
    return NULL;
}
clover_vec_dot_fn clover_dot_avx2(int type) {
    (void)type;
    return NULL;
}
clover_vec_dot4_fn clover_dot4_avx2(int type) {
    (void)type;
    return NULL;
}
clover_dot_f16_fn clover_dot_f16_avx2(void) { return NULL; }
clover_gemm_f32_fn clover_gemm_f32_avx2(void) { return NULL; }
clover_axpy_f16_fn clover_axpy_f16_avx2(void) { return NULL; }
clover_dot_f32_fn clover_dot_f32_avx2(void) { return NULL; }
clover_axpy_f32_fn clover_axpy_f32_avx2(void) { return NULL; }
#endif
