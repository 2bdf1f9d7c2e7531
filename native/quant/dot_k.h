/* dot_k.h: what the K-quant dot kernels (dot_k.c, dot_k4_avx2.c) share: ggml's block layouts of
 * Q4_K, Q5_K, Q6_K and IQ4_XS, their scale unpacking and the AVX2 helpers. Internal to quant/. */
#ifndef CLOVER_QUANT_DOT_K_H
#define CLOVER_QUANT_DOT_K_H

#include <stdint.h>
#include <string.h>

#include "clover.h"
#include "quant/dot.h"
#include "quant/quants.h"

#if defined(_WIN32)
#define DK_EXPORT
#else
#define DK_EXPORT __attribute__((visibility("default")))
#endif

/* ---------------------------------------------------------------- block layouts (ggml) */

typedef struct {
    uint16_t d, dmin;    /* fp16 super-block scale of the scales / of the mins */
    uint8_t scales[12];  /* eight 6-bit (scale, min) pairs */
    uint8_t qs[128];     /* per 64 values: low nibbles = first 32, high nibbles = next 32 */
} dk_q4_K;

typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];      /* bit 2k / 2k+1 of qh[l]: fifth bit of value 64k+l / 64k+32+l */
    uint8_t qs[128];
} dk_q5_K;

typedef struct {
    uint8_t ql[128];     /* low 4 bits */
    uint8_t qh[64];      /* high 2 bits */
    int8_t scales[16];   /* one per 16 values */
    uint16_t d;
} dk_q6_K;

typedef struct {
    uint16_t d;
    uint16_t scales_h;   /* 2 high bits of each of the eight 6-bit group scales */
    uint8_t scales_l[4]; /* 4 low bits of each group scale (group g at bit 4g) */
    uint8_t qs[128];     /* per 32 values: low nibbles = first 16, high nibbles = next 16 */
} dk_iq4_xs;

_Static_assert(sizeof(dk_q4_K) == 144, "q4_K block size");
_Static_assert(sizeof(dk_q5_K) == 176, "q5_K block size");
_Static_assert(sizeof(dk_q6_K) == 210, "q6_K block size");
_Static_assert(sizeof(dk_iq4_xs) == 136, "iq4_xs block size");
_Static_assert(sizeof(clover_block_q8_K) == 292, "q8_K block size");

/* Unpack the 12-byte Q4_K/Q5_K scale field into u[0..3]: bytes 0..7 = the eight 6-bit scales,
 * bytes 8..15 = the eight 6-bit mins (sub-block j: scale at byte j, min at byte 8+j).
 * Scales 0..3 are the low 6 bits of bytes 0..3, mins 0..3 of bytes 4..7; scales/mins 4..7
 * take their low 4 bits from the nibbles of bytes 8..11 and their high 2 bits from the top
 * bits of bytes 0..3 / 4..7. */
static inline void dk_unpack_scales(const uint8_t *s, uint32_t u[4]) {
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    u[0] = a & 0x3f3f3f3fu;
    u[1] = (c & 0x0f0f0f0fu) | (((a >> 6) & 0x03030303u) << 4);
    u[2] = b & 0x3f3f3f3fu;
    u[3] = ((c >> 4) & 0x0f0f0f0fu) | (((b >> 6) & 0x03030303u) << 4);
}

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/x86/simd_x86.h"

#define DK_AVX2 CLOVER_AVX2
#define DK_AVX512 CLOVER_AVX512

/* The four Q8_K activation rows of a four-row kernel, x_stride bytes apart. */
#define DK_ROWS4(y, xq, x_stride)                                                                  \
    const clover_block_q8_K *y[4];                                                                 \
    for (int r_ = 0; r_ < 4; r_++) y[r_] = (const clover_block_q8_K *)((const uint8_t *)(xq) + r_ * (x_stride))

/* ---------------------------------------------------------------- AVX2 helpers */

DK_AVX2 static inline float dk_hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* pshufb mask that broadcasts int16 element k of each 128-bit lane */
#define DK_BCAST16(k) _mm256_set1_epi16((short)(0x0100 + 0x0202 * (k)))

/* dk_unpack_scales in registers: the 8 scales then the 8 mins of a Q4_K/Q5_K block as 16 int16
 * lanes, from the 12 scale bytes at s (16 bytes are read: the block goes on after them). The
 * 32-bit words a, b, c of s give [a & 3f, (c & 0f) | (a >> 6 & 3) << 4, b & 3f,
 * (c >> 4 & 0f) | (b >> 6 & 3) << 4] bytewise, as the scalar unpack does. */
DK_AVX2 static inline __m256i dk_scales_mins16(const uint8_t *s) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s);
    const __m128i w = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)), _mm_setr_epi32(0, 0, 0, 4));
    const __m128i lo = _mm_and_si128(w, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i z = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(z, 2), _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));
    const __m128i u = _mm_or_si128(lo, hi); /* dk_unpack_scales' u[0..3]: the scales, then the mins */
    return _mm256_cvtepu8_epi16(u);
}

/* sum of the mins part of a Q4_K/Q5_K block: 4 int32 lanes summing to sum_j m_j * bsum32_j */
DK_AVX2 static inline __m128i dk_mins_prod(__m128i mins16, const int16_t *bsums) {
    const __m128i b0 = _mm_loadu_si128((const __m128i *)bsums);
    const __m128i b1 = _mm_loadu_si128((const __m128i *)bsums + 1);
    return _mm_madd_epi16(mins16, _mm_hadd_epi16(b0, b1)); /* per-32 sums fit int16 */
}

/* The float steps of one Q4_K / Q5_K block (the 4-row kernels, dot_k4_avx2.c, run the same ones per
 * row): s (8 int32 lanes) and prod (4) reduce exactly to S = sum of levels times scales and M =
 * sum of mins times sub-block sums; lane 0 of acc += (yd * d) * S, lane 1 += (yd * dmin) * M,
 * one FMA each. The row's value is lane 0 - lane 1. dm: the block's fp16 (d, dmin) pair. */
DK_AVX2 static inline __m128 dk_block_float(__m128 acc, __m256i s, __m128i prod, float yd, const uint16_t *dm) {
    const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const __m128i u = _mm_hadd_epi32(t, prod);
    const __m128i sm = _mm_hadd_epi32(u, u); /* S, M, S, M */
    uint32_t pair;
    memcpy(&pair, dm, 4);
    const __m128 scale = _mm_mul_ps(_mm_set1_ps(yd), _mm_cvtph_ps(_mm_cvtsi32_si128((int)pair)));
    return _mm_fmadd_ps(scale, _mm_cvtepi32_ps(sm), acc);
}

DK_AVX2 static inline float dk_block_float_end(__m128 acc) {
    return _mm_cvtss_f32(_mm_sub_ss(acc, _mm_movehdup_ps(acc)));
}

/* The 4 x 32 six-bit Q6_K levels (0..63) of half a block: low nibbles of ql bytes 0..31 (b1) and
 * 32..63 (b2), then their high nibbles, each with its 2 high bits from bits 2c, 2c+1 of the qh
 * bytes (bh), moved to bits 4, 5 by one 16-bit shift (bits crossing a byte are masked off). */
DK_AVX2 static inline void dk_q6_levels(__m256i b1, __m256i b2, __m256i bh, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    q[0] = _mm256_or_si256(_mm256_and_si256(b1, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(b2, m4), _mm256_and_si256(_mm256_slli_epi16(bh, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b1, 4), m4), _mm256_and_si256(bh, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b2, 4), m4), _mm256_and_si256(_mm256_srli_epi16(bh, 2), m30));
}

/* dk_q6_half_scales(sc16, h): the 8 int16 scales of half h of a Q6_K block (groups 8h..8h+7;
 * sc16: the block's 16 scales as int16) in both 128-bit lanes; DK_Q6_SCALE(sh, c): those of its
 * chunk c (values 32c..32c+31 of the half) as int16 lanes, 0..7 group 8h + 2c, 8..15 group
 * 8h + 2c + 1. */
DK_AVX2 static inline __m256i dk_q6_half_scales(__m256i sc16, int h) {
    return h ? _mm256_permute2x128_si256(sc16, sc16, 0x11) : _mm256_permute2x128_si256(sc16, sc16, 0x00);
}
#define DK_Q6_SCALE(sh, c)                                                                          \
    _mm256_shuffle_epi8((sh), _mm256_setr_epi8(4 * (c), 4 * (c) + 1, 4 * (c), 4 * (c) + 1, 4 * (c), 4 * (c) + 1, 4 * (c), \
                                               4 * (c) + 1, 4 * (c), 4 * (c) + 1, 4 * (c), 4 * (c) + 1, 4 * (c), 4 * (c) + 1, \
                                               4 * (c), 4 * (c) + 1, 4 * (c) + 2, 4 * (c) + 3, 4 * (c) + 2, 4 * (c) + 3,     \
                                               4 * (c) + 2, 4 * (c) + 3, 4 * (c) + 2, 4 * (c) + 3, 4 * (c) + 2, 4 * (c) + 3, \
                                               4 * (c) + 2, 4 * (c) + 3, 4 * (c) + 2, 4 * (c) + 3, 4 * (c) + 2, 4 * (c) + 3))

/* The eight signed 6-bit IQ4_XS group scales (ls - 32) as int32 lanes. */
DK_AVX2 static inline __m256i dk_iq4xs_scales(const dk_iq4_xs *b) {
    uint32_t sl;
    memcpy(&sl, b->scales_l, 4);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                        _mm256_set1_epi32(0xF));
    const __m256i hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(b->scales_h), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)), _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
}

#endif

#endif
