/* dot_avx512.c: AVX-512 VNNI kernels of the Q8_0-paired weight types (Q8_0, Q4_0, IQ4_NL,
 * MXFP4). Two blocks of 32 per step in one 512-bit register; vpdpbusd sums groups of four
 * unsigned x signed bytes straight into int32 (|w| as unsigned, the sign moved onto x), so
 * each block's int32 sum is exact; then one FMA with the two blocks' scales.
 * Only called after clover_dot_best_isa() found AVX-512 F/BW/VL and VNNI.
 */
#include "quant/dot.h"

#include "clover.h"
#include "quant/quants.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/x86/simd_x86.h"

#define AVX512 CLOVER_AVX512

/* 16 int32: lanes 0-7 sum block a, lanes 8-15 block b (each 32 signed bytes w times x). */
static inline AVX512 __m512i isum16(__m512i w, __m512i x) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const __m512i sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(w), sx);
}

static inline AVX512 __m512i join(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline AVX512 __m512 scales2(float da, float db) {
    return _mm512_castpd_ps(
        _mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(da)), _mm256_castps_pd(_mm256_set1_ps(db)), 1));
}

/* 8 int32 sums of one block (the odd tail block). */
static inline AVX512 __m256i isum8(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

static inline AVX512 __m256i nibbles_table(const uint8_t *qs, __m128i table) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i m = _mm_set1_epi8(15);
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(b, m));
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(b, 4), m));
    return _mm256_set_m128i(hi, lo);
}

static inline AVX512 __m256i load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* The loop shared by the four types: get(wb) unpacks a weight block's 32 codes, scale(wb) its
 * scale; bytes is the block size. Written as a macro so each kernel inlines its unpacking. */
#define DOT_Q8_0_FAMILY(BYTES, GET, SCALE)                                                          \
    const uint8_t *wb = w;                                                                          \
    const clover_block_q8_0 *x = xq;                                                                \
    const int64_t nb = n / 32;                                                                      \
    __m512 acc = _mm512_setzero_ps();                                                               \
    int64_t b = 0;                                                                                  \
    for (; b + 1 < nb; b += 2, wb += 2 * (BYTES)) {                                                 \
        CLOVER_PREFETCH(wb, 2);                                                                     \
        const __m512i qw = join(GET(wb), GET(wb + (BYTES)));                                        \
        const __m512i qx = join(load32(x[b].qs), load32(x[b + 1].qs));                              \
        const __m512 d = scales2(SCALE(wb) * clover_fp16_load(&x[b].d),                             \
                                 SCALE(wb + (BYTES)) * clover_fp16_load(&x[b + 1].d));              \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum16(qw, qx)), d, acc);                          \
    }                                                                                               \
    float sum = _mm512_reduce_add_ps(acc);                                                          \
    if (b < nb) {                                                                                   \
        const __m256i s = isum8(GET(wb), load32(x[b].qs));                                          \
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));      \
        s4 = _mm_hadd_epi32(s4, s4);                                                                \
        s4 = _mm_hadd_epi32(s4, s4);                                                                \
        sum += (float)_mm_cvtsi128_si32(s4) * (SCALE(wb) * clover_fp16_load(&x[b].d));              \
    }                                                                                               \
    return sum;

#define GET_Q8_0(p) load32((p) + 2)
#define SCALE_FP16(p) clover_fp16_load(p)
static AVX512 float dot_q8_0(int64_t n, const void *w, const void *xq) { DOT_Q8_0_FAMILY(34, GET_Q8_0, SCALE_FP16) }

static AVX512 float dot_q4_0(int64_t n, const void *w, const void *xq) {
    const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
#define GET_TABLE2(p) nibbles_table((p) + 2, table)
    DOT_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX512 float dot_iq4_nl(int64_t n, const void *w, const void *xq) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_iq4nl);
    DOT_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX512 float dot_mxfp4(int64_t n, const void *w, const void *xq) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_mxfp4);
#define GET_TABLE1(p) nibbles_table((p) + 1, table)
#define SCALE_E8M0(p) clover_e8m0_half((p)[0])
    DOT_Q8_0_FAMILY(17, GET_TABLE1, SCALE_E8M0)
}

/* Four activation rows per weight row, activations in the packed layout of dot.h
 * (clover_x4_pack_q8_0: q + 128 as unsigned bytes, contiguous; per block pair a vector of the
 * two scales). vpdpbusd(u8 x + 128, s8 w) needs no per-pair sign fix: the accumulator starts at
 * -128 * sum(w) of each group of four (computed once per weight pair for all four rows), so each
 * block's int32 sum equals the single-row kernel's exactly, and the scale products d_w * d_x
 * and the FMA order are the same as there: out[i] equals the single-row kernel bit for bit. */
#define DOT4_Q8_0_FAMILY(BYTES, GET, SCALE)                                                         \
    const uint8_t *wb = w;                                                                          \
    const int64_t nb = n / 32;                                                                      \
    const uint8_t *xr[4];                                                                           \
    const float *xd[4];                                                                             \
    for (int i = 0; i < 4; i++) {                                                                   \
        xr[i] = (const uint8_t *)xq + i * x_stride;                                                 \
        xd[i] = (const float *)(xr[i] + n);                                                         \
    }                                                                                               \
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()}; \
    const __m512i c128 = _mm512_set1_epi8((char)0x80);                                              \
    int64_t b = 0;                                                                                  \
    for (; b + 1 < nb; b += 2, wb += 2 * (BYTES)) {                                                 \
        const __m512i qw = join(GET(wb), GET(wb + (BYTES)));                                        \
        const __m512i bias = _mm512_sub_epi32(_mm512_setzero_si512(),                               \
                                              _mm512_dpbusd_epi32(_mm512_setzero_si512(), c128, qw)); \
        const __m512 dw = scales2(SCALE(wb), SCALE(wb + (BYTES)));                                  \
        for (int i = 0; i < 4; i++) {                                                               \
            const __m512i s = _mm512_dpbusd_epi32(bias, _mm512_loadu_si512((const void *)(xr[i] + 32 * b)), qw); \
            const __m512 d = _mm512_mul_ps(dw, _mm512_loadu_ps(xd[i] + 8 * b));                      \
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), d, acc[i]);                             \
        }                                                                                           \
    }                                                                                               \
    for (int i = 0; i < 4; i++) {                                                                   \
        float sum = _mm512_reduce_add_ps(acc[i]);                                                   \
        if (b < nb) {                                                                               \
            const __m256i qw = GET(wb);                                                             \
            const __m256i bias = _mm256_sub_epi32(_mm256_setzero_si256(),                           \
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_set1_epi8((char)0x80), qw));     \
            const __m256i s = _mm256_dpbusd_epi32(bias, load32(xr[i] + 32 * b), qw);                \
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));  \
            s4 = _mm_hadd_epi32(s4, s4);                                                            \
            s4 = _mm_hadd_epi32(s4, s4);                                                            \
            sum += (float)_mm_cvtsi128_si32(s4) * (SCALE(wb) * xd[i][8 * b]);                       \
        }                                                                                           \
        out[i] = sum;                                                                               \
    }

static AVX512 void dot4_q8_0(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    DOT4_Q8_0_FAMILY(34, GET_Q8_0, SCALE_FP16)
}

static AVX512 void dot4_q4_0(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_setr_epi8(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    DOT4_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX512 void dot4_iq4_nl(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_iq4nl);
    DOT4_Q8_0_FAMILY(18, GET_TABLE2, SCALE_FP16)
}

static AVX512 void dot4_mxfp4(int64_t n, const void *w, const void *xq, int64_t x_stride, float *out) {
    const __m128i table = _mm_loadu_si128((const __m128i *)clover_kv_mxfp4);
    DOT4_Q8_0_FAMILY(17, GET_TABLE1, SCALE_E8M0)
}

clover_vec_dot4_fn clover_dot4_avx512(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot4_q8_0;
    case CLOVER_TYPE_Q4_0: return dot4_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot4_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot4_mxfp4;
    default: return NULL;
    }
}

clover_vec_dot_fn clover_dot_avx512(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot_q8_0;
    case CLOVER_TYPE_Q4_0: return dot_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot_mxfp4;
    default: return clover_dot_k_avx512(type);
    }
}

/* The attention kernels over several keys (dot.h), for float32 and fp16 caches (f16), each equal
 * bit for bit to its AVX2 one-key kernel called key by key. kv8 / kv1: 8 cache values, or one,
 * from element i of c, as float. */
static inline __attribute__((always_inline)) AVX512 __m256 kv8(const void *c, int f16, int64_t i) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)c + i)))
               : _mm256_loadu_ps((const float *)c + i);
}

static inline __attribute__((always_inline)) AVX512 float kv1(const void *c, int f16, int64_t i) {
    return f16 ? _cvtsh_ss(((const uint16_t *)c)[i]) : ((const float *)c)[i];
}

/* out[r] = q . k_r for the 4 keys k_r = k + r ks (n values), each summed as the AVX2 one-key
 * kernel sums it: C 8-lane FMA sums over 8 C values a step (dot_f32: C = 4; dot_f16: 2), the last
 * 8s into the first sum, the sums added pairwise, 8 lanes reduced, then the tail in order. Each 8
 * C values of q are loaded once for the four keys (AVX-512VL's 32 ymm registers hold the sums). */
static inline __attribute__((always_inline)) AVX512 void kv_dot4(int C, int f16, const float *q, const void *k,
                                                                 int64_t ks, int64_t n, float *out) {
    __m256 a[4][4];
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < C; c++) a[r][c] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 * C <= n; i += 8 * C)
        for (int c = 0; c < C; c++) {
            const __m256 qc = _mm256_loadu_ps(q + i + 8 * c);
            for (int r = 0; r < 4; r++) a[r][c] = _mm256_fmadd_ps(qc, kv8(k, f16, r * ks + i + 8 * c), a[r][c]);
        }
    for (; i + 8 <= n; i += 8) {
        const __m256 qc = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 4; r++) a[r][0] = _mm256_fmadd_ps(qc, kv8(k, f16, r * ks + i), a[r][0]);
    }
    for (int r = 0; r < 4; r++) {
        __m256 t = _mm256_add_ps(a[r][0], a[r][1]);
        for (int c = 2; c < C; c += 2) t = _mm256_add_ps(t, _mm256_add_ps(a[r][c], a[r][c + 1]));
        float s = clover_hsum8(t);
        for (int64_t j = i; j < n; j++) s += q[j] * kv1(k, f16, r * ks + j);
        out[r] = s;
    }
}

/* o += p[j] v_j for the rows j < nv in order (v_j = v + j vs), n values: per value the same
 * fused multiply-adds in the same order as nv calls of the AVX2 axpy kernel (and its tail's
 * plain ones), with 128 values of o held in 16 ymm registers across the rows: one load a
 * multiply-add, instead of two loads and a store. */
static inline __attribute__((always_inline)) AVX512 void kv_axpy_rows(int f16, float *o, const float *p,
                                                                      const void *v, int64_t vs, int64_t nv, int64_t n) {
    int64_t i = 0;
    for (; i + 128 <= n; i += 128) {
        __m256 r[16];
        for (int c = 0; c < 16; c++) r[c] = _mm256_loadu_ps(o + i + 8 * c);
        for (int64_t j = 0; j < nv; j++) {
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 16; c++) r[c] = _mm256_fmadd_ps(pj, kv8(v, f16, j * vs + i + 8 * c), r[c]);
        }
        for (int c = 0; c < 16; c++) _mm256_storeu_ps(o + i + 8 * c, r[c]);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 r = _mm256_loadu_ps(o + i);
        for (int64_t j = 0; j < nv; j++) r = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), kv8(v, f16, j * vs + i), r);
        _mm256_storeu_ps(o + i, r);
    }
    for (; i < n; i++)
        for (int64_t j = 0; j < nv; j++) o[i] += p[j] * kv1(v, f16, j * vs + i);
}

static AVX512 void dot_f32x4(const float *q, const float *k, int64_t ks, int64_t n, float *out) {
    kv_dot4(4, 0, q, k, ks, n, out);
}

static AVX512 void dot_f16x4(const float *q, const uint16_t *k, int64_t ks, int64_t n, float *out) {
    kv_dot4(2, 1, q, k, ks, n, out);
}

static AVX512 void axpy_f32_rows(float *o, const float *p, const float *v, int64_t vs, int64_t nv, int64_t n) {
    kv_axpy_rows(0, o, p, v, vs, nv, n);
}

static AVX512 void axpy_f16_rows(float *o, const float *p, const uint16_t *v, int64_t vs, int64_t nv, int64_t n) {
    kv_axpy_rows(1, o, p, v, vs, nv, n);
}

clover_dot_f32x4_fn clover_dot_f32x4_avx512(void) { return dot_f32x4; }
clover_dot_f16x4_fn clover_dot_f16x4_avx512(void) { return dot_f16x4; }
clover_axpy_f16_rows_fn clover_axpy_f16_rows_avx512(void) { return axpy_f16_rows; }
clover_axpy_f32_rows_fn clover_axpy_f32_rows_avx512(void) { return axpy_f32_rows; }

#else
clover_vec_dot_fn clover_dot_avx512(int type) {
    (void)type;
    return NULL;
}
clover_vec_dot4_fn clover_dot4_avx512(int type) {
    (void)type;
    return NULL;
}
clover_dot_f32x4_fn clover_dot_f32x4_avx512(void) { return NULL; }
clover_dot_f16x4_fn clover_dot_f16x4_avx512(void) { return NULL; }
clover_axpy_f16_rows_fn clover_axpy_f16_rows_avx512(void) { return NULL; }
clover_axpy_f32_rows_fn clover_axpy_f32_rows_avx512(void) { return NULL; }
#endif
