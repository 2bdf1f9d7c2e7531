/* dot_k.c: dot-product kernels of the K-quant weight types against Q8_K activations (spec 6):
 * Q4_K, Q5_K, Q6_K and IQ4_XS, each as a portable scalar kernel (the
 * reference), an AVX2 kernel and an AVX-512 (BW, VL, VNNI) kernel. The AVX-512 kernels of
 * Q6_K and IQ4_XS work on 512-bit vectors; those of Q4_K and Q5_K on 256-bit vectors with
 * VNNI's vpdpwssd (faster here than the 512-bit variant, whose integer multiplies run on one
 * port only).
 *
 * Semantics are ggml's ggml_vec_dot_*_q8_K: per 256-value block the integer products of the
 * weight levels with the activation int8 values are summed exactly in int32 (per-sub-block
 * scales applied in integers), then scaled by fp16 d(weight) * float d(activation); the
 * asymmetric types (Q4_K, Q5_K) subtract dmin * sum(min_j * sum of the activations of
 * sub-block j), taken from the Q8_K bsums. Every kernel computes the same per-block integers,
 * so the SIMD kernels differ from the scalar one only in the order of the float sums.
 *
 * Preconditions (as in ggml): n is a multiple of 256; xq is a Q8_K row whose bsums are the sums
 * of its qs (as clover_kq_from_f32 / the activation quantiser write them) and whose qs lie in
 * -127..127 (the Q8_K quantiser never writes -128; the AVX2 IQ4_XS kernel, like ggml's, takes
 * |x| with a sign trick that would wrap -128).
 *
 * The SIMD functions are compiled with GCC/Clang target attributes, so the file needs no
 * global -m flags; on non-x86 builds the SIMD getters return NULL. Callers must check the CPU
 * (AVX2+FMA+F16C, or AVX-512 F/BW/VL/VNNI) before calling a SIMD kernel.
 */
#include "quant/dot_k.h"

/* ---------------------------------------------------------------- scalar (reference) */

/* The scalar kernels unpack each block's levels into a byte array first, then take plain
 * byte dot products (simple loops that compilers vectorise on any target). */

static inline int32_t dk_dot_u8(const uint8_t *w, const int8_t *a, int len) {
    int32_t s = 0;
    for (int l = 0; l < len; l++) s += w[l] * a[l];
    return s;
}

static inline int32_t dk_dot_i8(const int8_t *w, const int8_t *a, int len) {
    int32_t s = 0;
    for (int l = 0; l < len; l++) s += w[l] * a[l];
    return s;
}

/* Q4_K / Q5_K block (qh == NULL for Q4_K): d * sum_j sc_j * dot_j - dmin * sum_j m_j * bsum_j */
static inline float dk_q45_block(const uint8_t *scales, const uint8_t *qs, const uint8_t *qh, uint16_t hd,
                                 uint16_t hdmin, const clover_block_q8_K *y) {
    uint32_t u[4];
    dk_unpack_scales(scales, u);
    uint8_t sm[16], L[CLOVER_QK_K];
    memcpy(sm, u, 16);
    for (int j = 0; j < 4; j++) {
        for (int l = 0; l < 32; l++) {
            L[64 * j + l] = qs[32 * j + l] & 0xF;
            L[64 * j + 32 + l] = qs[32 * j + l] >> 4;
        }
        if (qh) {
            for (int l = 0; l < 32; l++) {
                L[64 * j + l] |= ((qh[l] >> (2 * j)) & 1) << 4;
                L[64 * j + 32 + l] |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
        }
    }
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
        isum += sm[j] * dk_dot_u8(L + 32 * j, y->qs + 32 * j, 32);
        msum += sm[8 + j] * (y->bsums[2 * j] + y->bsums[2 * j + 1]);
    }
    const float d = y->d * clover_fp16_to_fp32(hd);
    const float dmin = y->d * clover_fp16_to_fp32(hdmin);
    return d * (float)isum - dmin * (float)msum;
}

static float dot_q4_K_scalar(int64_t n, const void *w_row, const void *xq) {
    const dk_q4_K *x = (const dk_q4_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++)
        sum += dk_q45_block(x[i].scales, x[i].qs, NULL, x[i].d, x[i].dmin, &y[i]);
    return sum;
}

static float dot_q5_K_scalar(int64_t n, const void *w_row, const void *xq) {
    const dk_q5_K *x = (const dk_q5_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++)
        sum += dk_q45_block(x[i].scales, x[i].qs, x[i].qh, x[i].d, x[i].dmin, &y[i]);
    return sum;
}

static float dot_q6_K_scalar(int64_t n, const void *w_row, const void *xq) {
    const dk_q6_K *x = (const dk_q6_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        int8_t L[CLOVER_QK_K];
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = x[i].ql + 64 * h, *qh = x[i].qh + 32 * h;
            int8_t *o = L + 128 * h;
            for (int l = 0; l < 32; l++) {
                o[l] = (int8_t)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32);
                o[l + 32] = (int8_t)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                o[l + 64] = (int8_t)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                o[l + 96] = (int8_t)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
            }
        }
        int32_t isum = 0;
        for (int g = 0; g < 16; g++) isum += x[i].scales[g] * dk_dot_i8(L + 16 * g, y[i].qs + 16 * g, 16);
        sum += y[i].d * clover_fp16_to_fp32(x[i].d) * (float)isum;
    }
    return sum;
}

static float dot_iq4_xs_scalar(int64_t n, const void *w_row, const void *xq) {
    const dk_iq4_xs *x = (const dk_iq4_xs *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        uint32_t sl;
        memcpy(&sl, x[i].scales_l, 4);
        const uint32_t sh = x[i].scales_h;
        int8_t L[CLOVER_QK_K];
        for (int g = 0; g < 8; g++) {
            for (int l = 0; l < 16; l++) {
                L[32 * g + l] = clover_kv_iq4nl[x[i].qs[16 * g + l] & 0xF];
                L[32 * g + 16 + l] = clover_kv_iq4nl[x[i].qs[16 * g + l] >> 4];
            }
        }
        int32_t isum = 0;
        for (int g = 0; g < 8; g++) {
            const int ls = (int)(((sl >> (4 * g)) & 0xF) | (((sh >> (2 * g)) & 3) << 4)) - 32;
            isum += ls * dk_dot_i8(L + 32 * g, y[i].qs + 32 * g, 32);
        }
        sum += y[i].d * clover_fp16_to_fp32(x[i].d) * (float)isum;
    }
    return sum;
}

DK_EXPORT clover_vec_dot_fn clover_dot_k_scalar(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot_q4_K_scalar;
    case CLOVER_TYPE_Q5_K: return dot_q5_K_scalar;
    case CLOVER_TYPE_Q6_K: return dot_q6_K_scalar;
    case CLOVER_TYPE_IQ4_XS: return dot_iq4_xs_scalar;
    default: return clover_dot_k23_scalar(type);
    }
}

#if defined(__x86_64__) || defined(__i386__)

/* ---------------------------------------------------------------- AVX2 */

DK_AVX2 static float dot_q4_K_avx2(int64_t n, const void *w_row, const void *xq) {
    const dk_q4_K *x = (const dk_q4_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 3);
        const __m256i sm16 = dk_scales_mins16(x[i].scales);
        const __m128i prod = dk_mins_prod(_mm256_extracti128_si256(sm16, 1), y[i].bsums);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm16));
        const uint8_t *q = x[i].qs;
        const int8_t *a = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++, q += 32, a += 64) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q);
            const __m256i lo = _mm256_and_si256(bits, m4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)a));
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 32)));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_shuffle_epi8(sc, DK_BCAST16(2 * j)), pl));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_shuffle_epi8(sc, DK_BCAST16(2 * j + 1)), ph));
        }
        acc = dk_block_float(acc, _mm256_add_epi32(s0, s1), prod, y[i].d, &x[i].d);
    }
    return dk_block_float_end(acc);
}

DK_AVX2 static float dot_q5_K_avx2(int64_t n, const void *w_row, const void *xq) {
    const dk_q5_K *x = (const dk_q5_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m16 = _mm256_set1_epi8(16);
    __m128 acc = _mm_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 3);
        const __m256i sm16 = dk_scales_mins16(x[i].scales);
        const __m128i prod = dk_mins_prod(_mm256_extracti128_si256(sm16, 1), y[i].bsums);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm16));
        const uint8_t *q = x[i].qs;
        const int8_t *a = y[i].qs;
        __m256i hb = _mm256_loadu_si256((const __m256i *)x[i].qh);
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++, q += 32, a += 64) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q);
            /* bit 0 / bit 1 of each byte of hb -> bit 4 (shifts stay inside each byte) */
            const __m256i lo = _mm256_or_si256(_mm256_and_si256(bits, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(hb, 4), m16));
            const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bits, 4), m4),
                                               _mm256_and_si256(_mm256_slli_epi16(hb, 3), m16));
            hb = _mm256_srli_epi16(hb, 2);
            const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)a));
            const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(a + 32)));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_shuffle_epi8(sc, DK_BCAST16(2 * j)), pl));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_shuffle_epi8(sc, DK_BCAST16(2 * j + 1)), ph));
        }
        acc = dk_block_float(acc, _mm256_add_epi32(s0, s1), prod, y[i].d, &x[i].d);
    }
    return dk_block_float_end(acc);
}

DK_AVX2 static float dot_q6_K_avx2(int64_t n, const void *w_row, const void *xq) {
    const dk_q6_K *x = (const dk_q6_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 4);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        /* levels are stored +32: subtract 32 * sum_g sc_g * bsum_g */
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), sc16), 5);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *a = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, a += 128) {
            __m256i q[4];
            dk_q6_levels(_mm256_loadu_si256((const __m256i *)ql), _mm256_loadu_si256((const __m256i *)(ql + 32)),
                         _mm256_loadu_si256((const __m256i *)qh), q);
            const __m256i sh = dk_q6_half_scales(sc16, h);
            const __m256i p0 = _mm256_maddubs_epi16(q[0], _mm256_loadu_si256((const __m256i *)a));
            const __m256i p1 = _mm256_maddubs_epi16(q[1], _mm256_loadu_si256((const __m256i *)(a + 32)));
            const __m256i p2 = _mm256_maddubs_epi16(q[2], _mm256_loadu_si256((const __m256i *)(a + 64)));
            const __m256i p3 = _mm256_maddubs_epi16(q[3], _mm256_loadu_si256((const __m256i *)(a + 96)));
            s0 = _mm256_add_epi32(s0, _mm256_add_epi32(_mm256_madd_epi16(DK_Q6_SCALE(sh, 0), p0),
                                                       _mm256_madd_epi16(DK_Q6_SCALE(sh, 1), p1)));
            s1 = _mm256_add_epi32(s1, _mm256_add_epi32(_mm256_madd_epi16(DK_Q6_SCALE(sh, 2), p2),
                                                       _mm256_madd_epi16(DK_Q6_SCALE(sh, 3), p3)));
        }
        const __m256i sumi = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), corr);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return clover_hsum8(acc);
}

DK_AVX2 static float dot_iq4_xs_avx2(int64_t n, const void *w_row, const void *xq) {
    const dk_iq4_xs *x = (const dk_iq4_xs *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)clover_kv_iq4nl));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 3);
        /* group scales as int16 in the low half of each 32-bit lane: broadcast with pshufb */
        const __m256i ls32 = dk_iq4xs_scales(&x[i]);
        const __m128i ls16 = _mm_packs_epi32(_mm256_castsi256_si128(ls32), _mm256_extracti128_si256(ls32, 1));
        const __m256i lsb = _mm256_broadcastsi128_si256(ls16);
        const uint8_t *q = x[i].qs;
        const int8_t *a = y[i].qs;
        __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2, q += 32, a += 64) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q); /* groups g, g+1 */
            /* group g: [lo nibbles of q[0..15] | hi nibbles of q[0..15]] */
            const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i w0 = _mm256_shuffle_epi8(tab, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i w1 = _mm256_shuffle_epi8(tab, _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256i a0 = _mm256_loadu_si256((const __m256i *)a);
            const __m256i a1 = _mm256_loadu_si256((const __m256i *)(a + 32));
            const __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(a0, w0));
            const __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(a1, w1));
            s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(p0, _mm256_shuffle_epi8(lsb, DK_BCAST16(g))));
            s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(p1, _mm256_shuffle_epi8(lsb, DK_BCAST16(g + 1))));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1)),
                              acc);
    }
    return clover_hsum8(acc);
}

/* ---------------------------------------------------------------- AVX-512 (BW, VL, VNNI) */

/* int16 index vector for vpermw: lanes 0..15 = element a, lanes 16..31 = element b */
#define DK_IDX2(a, b) _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(a)), _mm256_set1_epi16(b), 1)

DK_AVX512 static inline __m256i dk_fold512(__m512i v) {
    return _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
}

/* Q4_K (x5 == NULL) and Q5_K in sub-block lanes. Step s < 4 of a block is a zmm of weight
 * levels in which qword b holds sub-block b's values 8 s .. 8 s + 7 (dk_q45_step); against the
 * activations in the same order (the K-permuted layout, clover_x4_pack_q8_K), an int32 lane
 * 2 b + h of vpdpbusd sums products of sub-block b only, so after the 4 steps each sub-block's
 * 32 products lie in lanes 2 b and 2 b + 1, and the block's scales apply once, in float (the ymm
 * form took a vpmaddubsw and a vpdpwssd per 32 values, this one vpdpbusd per 64). Lanes are
 * exact int32 (at most 16 * 31 * 128 in magnitude); a block subtracts, lane by lane, yd * dmin
 * times the mins part (dk_mins_prod, lanes 0..3) and then adds (yd * (d * scale)) times the lane. */
DK_AVX512 static inline __m512i dk_q45_step(const uint8_t *qs, const uint8_t *qh, int s) {
    const __m512i a = _mm512_loadu_si512((const void *)qs), b = _mm512_loadu_si512((const void *)(qs + 64));
    /* qword b of step s: bytes 8 s .. of the 32-byte chunk b / 2, its low (b even) or high nibbles */
    const __m512i idx = _mm512_set_epi64(12 + s, 12 + s, 8 + s, 8 + s, 4 + s, 4 + s, s, s);
    const __m512i q = _mm512_permutex2var_epi64(a, idx, b);
    __m512i w = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_set_epi64(4, 0, 4, 0, 4, 0, 4, 0)), _mm512_set1_epi8(0xF));
    if (qh) { /* fifth bit of value l of sub-block b: bit b of qh[l] */
        uint64_t h;
        memcpy(&h, qh + 8 * s, 8);
        const __m512i hb = _mm512_srlv_epi64(_mm512_set1_epi64((long long)h), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
        w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(hb, _mm512_set1_epi8(1)), 4));
    }
    return w;
}

/* The block's 6-bit scales times d as float lanes: lanes 2 b and 2 b + 1 = d * scale of
 * sub-block b (exact: an 11-bit fp16 significand times 6 bits fits a float's 24). */
DK_AVX512 static inline __m512 dk_q45_lane_scales(const uint32_t u[4], float d) {
    const __m128i sc8 = _mm_set_epi32(0, 0, (int)u[1], (int)u[0]);
    return _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc8, sc8))));
}

/* The mins part of a block (dk_mins_prod's 4 lanes) as lanes 0..3 of a zmm, the others 0;
 * from a plain Q8_K block's 16 bsums, or (pairs) from a K-permuted one's 8 sums of 32. */
DK_AVX512 static inline __m512 dk_q45_mins(__m128i mins16, const int16_t *bsums, int pairs) {
    const __m128i p = pairs ? _mm_madd_epi16(mins16, _mm_loadu_si128((const __m128i *)bsums)) : dk_mins_prod(mins16, bsums);
    return _mm512_castps128_ps512(_mm_cvtepi32_ps(p));
}

DK_AVX512 static inline float dk_hsum16(__m512 v) {
    return clover_hsum8(_mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
}

/* The activations of step s from a plain Q8_K block's qs: qword b = qs qword 4 b + s. */
DK_AVX512 static inline __m512i dk_q8K_step(const __m512i x[4], int s) {
    const __m512i idx = _mm512_set_epi64(12 + s, 8 + s, 4 + s, s, 12 + s, 8 + s, 4 + s, s);
    return _mm512_mask_blend_epi64(0xF0, _mm512_permutex2var_epi64(x[0], idx, x[1]),
                                   _mm512_permutex2var_epi64(x[2], idx, x[3]));
}

/* Block i of a Q4_K (x5 == NULL) or Q5_K row, prefetched: its levels' bytes (qh: NULL for Q4_K),
 * 6-bit scales (u[0..1]) and mins (u[2..3], and as 8 int16 in mins16), d and dmin. */
typedef struct {
    const uint8_t *q, *qh;
    uint32_t u[4];
    __m128i mins16;
    float d, dmin;
} dk_q45_head_t;
DK_AVX512 static inline __attribute__((always_inline)) dk_q45_head_t dk_q45_head(const dk_q4_K *x4, const dk_q5_K *x5,
                                                                                 int64_t i) {
    dk_q45_head_t b;
    if (x5) CLOVER_PREFETCH(x5 + i, 3); /* 176-byte blocks */
    else CLOVER_PREFETCH(x4 + i, 3);    /* 144-byte blocks */
    dk_unpack_scales(x5 ? x5[i].scales : x4[i].scales, b.u);
    b.q = x5 ? x5[i].qs : x4[i].qs, b.qh = x5 ? x5[i].qh : NULL;
    b.mins16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)b.u[3], (int)b.u[2]));
    b.d = _cvtsh_ss(x5 ? x5[i].d : x4[i].d), b.dmin = _cvtsh_ss(x5 ? x5[i].dmin : x4[i].dmin);
    return b;
}

DK_AVX512 static inline float dk_q45_sub512(int64_t n, const dk_q4_K *x4, const dk_q5_K *x5,
                                            const clover_block_q8_K *y) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        const dk_q45_head_t b = dk_q45_head(x4, x5, i);
        const __m512 ls = dk_q45_lane_scales(b.u, b.d);
        const float yd = y[i].d;
        __m512i x[4];
        for (int k = 0; k < 4; k++) x[k] = _mm512_loadu_si512((const void *)(y[i].qs + 64 * k));
        __m512i sum = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int st = 0; st < 4; st++) sum = _mm512_dpbusd_epi32(sum, dk_q45_step(b.q, b.qh, st), dk_q8K_step(x, st));
        acc = _mm512_fnmadd_ps(_mm512_set1_ps(yd * b.dmin), dk_q45_mins(b.mins16, y[i].bsums, 0), acc);
        acc = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(yd), ls), _mm512_cvtepi32_ps(sum), acc);
    }
    return dk_hsum16(acc);
}

DK_AVX512 static float dot_q4_K_avx512(int64_t n, const void *w_row, const void *xq) {
    return dk_q45_sub512(n, (const dk_q4_K *)w_row, NULL, (const clover_block_q8_K *)xq);
}

DK_AVX512 static float dot_q5_K_avx512(int64_t n, const void *w_row, const void *xq) {
    return dk_q45_sub512(n, NULL, (const dk_q5_K *)w_row, (const clover_block_q8_K *)xq);
}

DK_AVX512 static float dot_q6_K_avx512(int64_t n, const void *w_row, const void *xq) {
    const dk_q6_K *x = (const dk_q6_K *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m512i m4 = _mm512_set1_epi8(0xF);
    /* low half of a zmm takes qh bits 0-1 (lo nibbles) / 4-5 (hi), high half bits 2-3 / 6-7 */
    const __m512i mlo = _mm512_inserti64x4(_mm512_set1_epi8(0x03), _mm256_set1_epi8(0x0C), 1);
    const __m512i mhi = _mm512_inserti64x4(_mm512_set1_epi8(0x30), _mm256_set1_epi8((char)0xC0), 1);
    const __m512i shl = DK_IDX2(4, 2), shr = DK_IDX2(0, 2);
    /* scales of groups 4c..4c+3, each over 8 int16 lanes */
    __m512i gidx[4];
    for (int c = 0; c < 4; c++) {
        int16_t t[32];
        for (int l = 0; l < 32; l++) t[l] = (int16_t)(4 * c + l / 8);
        gidx[c] = _mm512_loadu_si512((const void *)t);
    }
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 4); /* 210-byte blocks */
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), sc16), 5);
        const __m512i sc = _mm512_castsi256_si512(sc16);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *a = y[i].qs;
        __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int h = 0; h < 2; h++, ql += 64, qh += 32, a += 128) {
            const __m512i bits = _mm512_loadu_si512((const void *)ql);
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(bits, m4), _mm512_sllv_epi16(_mm512_and_si512(hb, mlo), shl));
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), m4),
                                               _mm512_srlv_epi16(_mm512_and_si512(hb, mhi), shr));
            const __m512i p0 = _mm512_maddubs_epi16(q0, _mm512_loadu_si512((const void *)a));
            const __m512i p1 = _mm512_maddubs_epi16(q1, _mm512_loadu_si512((const void *)(a + 64)));
            s = _mm512_dpwssd_epi32(s, p0, _mm512_permutexvar_epi16(gidx[2 * h], sc));
            s = _mm512_dpwssd_epi32(s, p1, _mm512_permutexvar_epi16(gidx[2 * h + 1], sc));
        }
        const __m256i sumi = _mm256_sub_epi32(dk_fold512(s), corr);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return clover_hsum8(acc);
}

DK_AVX512 static float dot_iq4_xs_avx512(int64_t n, const void *w_row, const void *xq) {
    const dk_iq4_xs *x = (const dk_iq4_xs *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    /* table + 128 as unsigned bytes: u8 x s8 products with vpdpbusd, then subtract
     * 128 * ls_g * (sum of the activations of group g) */
    int8_t tab_u[16];
    for (int k = 0; k < 16; k++) tab_u[k] = (int8_t)(uint8_t)(clover_kv_iq4nl[k] + 128);
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)tab_u));
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i gi0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i gi1 = _mm512_add_epi32(gi0, _mm512_set1_epi32(4));
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 3); /* 136-byte blocks */
        const __m256i ls = dk_iq4xs_scales(&x[i]);
        const __m512i lsz = _mm512_castsi256_si512(ls);
        const __m256i gsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[i].bsums), ones16);
        const __m256i corr = _mm256_slli_epi32(_mm256_mullo_epi32(ls, gsum), 7);
        const uint8_t *q = x[i].qs;
        const int8_t *a = y[i].qs;
        __m512i s = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int h = 0; h < 2; h++, q += 64, a += 128) {
            const __m512i bits = _mm512_loadu_si512((const void *)q); /* groups 4h..4h+3, 16 B each */
            const __m512i wl = _mm512_shuffle_epi8(tab, _mm512_and_si512(bits, m4));
            const __m512i wh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4));
            const __m512i a0 = _mm512_loadu_si512((const void *)a), a1 = _mm512_loadu_si512((const void *)(a + 64));
            /* first / second 16 activations of each group, one group per 128-bit lane */
            const __m512i al = _mm512_shuffle_i64x2(a0, a1, 0x88), ah = _mm512_shuffle_i64x2(a0, a1, 0xDD);
            const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, al), wh, ah);
            s = _mm512_add_epi32(s, _mm512_mullo_epi32(d, _mm512_permutexvar_epi32(h ? gi1 : gi0, lsz)));
        }
        const __m256i sumi = _mm256_sub_epi32(dk_fold512(s), corr);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return clover_hsum8(acc);
}

/* ---------------------------------------------------------------- AVX-512 four-row kernels */

/* out[r] = dot(w_row, activation row r) for r < 4, rows x_stride bytes apart: each weight
 * block's scales and codes are unpacked once and multiplied with the 4 rows' Q8_K blocks.
 * Per row the integer sums are those of the single-row AVX-512 kernel and the float
 * operations (per-block fmadd into the same lanes, the final horizontal sums) run in the
 * same order, so each out[r] equals that kernel's value bit for bit. */


/* Q4_K / Q5_K, four rows in the K-permuted layout (clover_x4_pack_q8_K): dk_q45_sub512 with each
 * step's weights made once for the 4 rows and each row's step a plain 64-byte load. */
DK_AVX512 static inline __attribute__((always_inline)) void dk_q45_sub512_4(int64_t n, const dk_q4_K *x4, const dk_q5_K *x5, const void *xq,
                                               int64_t x_stride, float *out) {
    DK_ROWS4(y, xq, x_stride);
    __m512 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        const dk_q45_head_t b = dk_q45_head(x4, x5, i);
        __m512i sum[4];
        for (int r = 0; r < 4; r++) sum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int st = 0; st < 4; st++) {
            const __m512i w = dk_q45_step(b.q, b.qh, st);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                sum[r] = _mm512_dpbusd_epi32(sum[r], w, _mm512_loadu_si512((const void *)(y[r][i].qs + 64 * st)));
        }
        const __m512 ls = dk_q45_lane_scales(b.u, b.d);
        for (int r = 0; r < 4; r++) {
            const float yd = y[r][i].d;
            acc[r] = _mm512_fnmadd_ps(_mm512_set1_ps(yd * b.dmin), dk_q45_mins(b.mins16, y[r][i].bsums, 1), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(yd), ls), _mm512_cvtepi32_ps(sum[r]), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = dk_hsum16(acc[r]);
}

DK_AVX512 static void dot4_q4_K_avx512(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    dk_q45_sub512_4(n, (const dk_q4_K *)w_row, NULL, xq, x_stride, out);
}

DK_AVX512 static void dot4_q5_K_avx512(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    dk_q45_sub512_4(n, NULL, (const dk_q5_K *)w_row, xq, x_stride, out);
}

DK_AVX512 static void dot4_q6_K_avx512(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    const dk_q6_K *x = (const dk_q6_K *)w_row;
    DK_ROWS4(y, xq, x_stride);
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i mlo = _mm512_inserti64x4(_mm512_set1_epi8(0x03), _mm256_set1_epi8(0x0C), 1);
    const __m512i mhi = _mm512_inserti64x4(_mm512_set1_epi8(0x30), _mm256_set1_epi8((char)0xC0), 1);
    const __m512i shl = DK_IDX2(4, 2), shr = DK_IDX2(0, 2);
    __m512i gidx[4];
    for (int c = 0; c < 4; c++) {
        int16_t t[32];
        for (int l = 0; l < 32; l++) t[l] = (int16_t)(4 * c + l / 8);
        gidx[c] = _mm512_loadu_si512((const void *)t);
    }
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        const __m512i sc = _mm512_castsi256_si512(sc16);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        __m512i s[4];
        for (int r = 0; r < 4; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++, ql += 64, qh += 32) {
            const __m512i bits = _mm512_loadu_si512((const void *)ql);
            const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
            const __m512i q0 = _mm512_or_si512(_mm512_and_si512(bits, m4), _mm512_sllv_epi16(_mm512_and_si512(hb, mlo), shl));
            const __m512i q1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(bits, 4), m4),
                                               _mm512_srlv_epi16(_mm512_and_si512(hb, mhi), shr));
            const __m512i g0 = _mm512_permutexvar_epi16(gidx[2 * h], sc);
            const __m512i g1 = _mm512_permutexvar_epi16(gidx[2 * h + 1], sc);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const int8_t *a = y[r][i].qs + 128 * h;
                const __m512i p0 = _mm512_maddubs_epi16(q0, _mm512_loadu_si512((const void *)a));
                const __m512i p1 = _mm512_maddubs_epi16(q1, _mm512_loadu_si512((const void *)(a + 64)));
                s[r] = _mm512_dpwssd_epi32(s[r], p0, g0);
                s[r] = _mm512_dpwssd_epi32(s[r], p1, g1);
            }
        }
        const float wd = _cvtsh_ss(x[i].d);
        for (int r = 0; r < 4; r++) {
            const __m256i corr =
                _mm256_slli_epi32(_mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[r][i].bsums), sc16), 5);
            const __m256i sumi = _mm256_sub_epi32(dk_fold512(s[r]), corr);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r][i].d * wd), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = clover_hsum8(acc[r]);
}

DK_AVX512 static void dot4_iq4_xs_avx512(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    const dk_iq4_xs *x = (const dk_iq4_xs *)w_row;
    DK_ROWS4(y, xq, x_stride);
    int8_t tab_u[16];
    for (int k = 0; k < 16; k++) tab_u[k] = (int8_t)(uint8_t)(clover_kv_iq4nl[k] + 128);
    const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)tab_u));
    const __m512i m4 = _mm512_set1_epi8(0xF);
    const __m512i gi0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i gi1 = _mm512_add_epi32(gi0, _mm512_set1_epi32(4));
    const __m256i ones16 = _mm256_set1_epi16(1);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        const __m256i ls = dk_iq4xs_scales(&x[i]);
        const __m512i lsz = _mm512_castsi256_si512(ls);
        const uint8_t *q = x[i].qs;
        __m512i s[4];
        for (int r = 0; r < 4; r++) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++, q += 64) {
            const __m512i bits = _mm512_loadu_si512((const void *)q);
            const __m512i wl = _mm512_shuffle_epi8(tab, _mm512_and_si512(bits, m4));
            const __m512i wh = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(bits, 4), m4));
            const __m512i lsg = _mm512_permutexvar_epi32(h ? gi1 : gi0, lsz);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const int8_t *a = y[r][i].qs + 128 * h;
                const __m512i a0 = _mm512_loadu_si512((const void *)a), a1 = _mm512_loadu_si512((const void *)(a + 64));
                const __m512i al = _mm512_shuffle_i64x2(a0, a1, 0x88), ah = _mm512_shuffle_i64x2(a0, a1, 0xDD);
                const __m512i d = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, al), wh, ah);
                s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(d, lsg));
            }
        }
        const float wd = _cvtsh_ss(x[i].d);
        for (int r = 0; r < 4; r++) {
            const __m256i gsum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y[r][i].bsums), ones16);
            const __m256i corr = _mm256_slli_epi32(_mm256_mullo_epi32(ls, gsum), 7);
            const __m256i sumi = _mm256_sub_epi32(dk_fold512(s[r]), corr);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r][i].d * wd), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < 4; r++) out[r] = clover_hsum8(acc[r]);
}

DK_EXPORT clover_vec_dot_fn clover_dot_k_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot_q4_K_avx2;
    case CLOVER_TYPE_Q5_K: return dot_q5_K_avx2;
    case CLOVER_TYPE_Q6_K: return dot_q6_K_avx2;
    case CLOVER_TYPE_IQ4_XS: return dot_iq4_xs_avx2;
    default: return clover_dot_k23_avx2(type);
    }
}

DK_EXPORT clover_vec_dot_fn clover_dot_k_avx512(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot_q4_K_avx512;
    case CLOVER_TYPE_Q5_K: return dot_q5_K_avx512;
    case CLOVER_TYPE_Q6_K: return dot_q6_K_avx512;
    case CLOVER_TYPE_IQ4_XS: return dot_iq4_xs_avx512;
    default: return NULL;
    }
}

DK_EXPORT clover_vec_dot4_fn clover_dot4_k_avx512(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot4_q4_K_avx512;
    case CLOVER_TYPE_Q5_K: return dot4_q5_K_avx512;
    case CLOVER_TYPE_Q6_K: return dot4_q6_K_avx512;
    case CLOVER_TYPE_IQ4_XS: return dot4_iq4_xs_avx512;
    default: return NULL;
    }
}

#else /* not x86 */

DK_EXPORT clover_vec_dot_fn clover_dot_k_avx2(int type) { return clover_dot_k23_avx2(type); }

DK_EXPORT clover_vec_dot_fn clover_dot_k_avx512(int type) {
    (void)type;
    return NULL;
}

DK_EXPORT clover_vec_dot4_fn clover_dot4_k_avx512(int type) {
    (void)type;
    return NULL;
}

#endif
