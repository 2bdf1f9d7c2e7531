/* dot_k4_avx2.c: the AVX2 four-row dot kernels of Q4_K, Q5_K, Q6_K and IQ4_XS against Q8_K
 * activation rows (dot_k.c has the one-row kernels and the semantics they share). */
#include "quant/dot_k.h"

#if defined(__x86_64__) || defined(__i386__)

/* ---------------------------------------------------------------- AVX2 four-row kernels */

/* out[r] = dot(w_row, Q8_K row r) for r < 4, rows x_stride bytes apart: each weight block's
 * scales and levels are unpacked once for the 4 rows. Per row the int32 block sums are the
 * single-row AVX2 kernel's (int32 sums are exact in any order) and the float operations run as
 * there, so each out[r] equals that kernel's value bit for bit. Q6_K and IQ4_XS read the rows as
 * they are, Q4_K and Q5_K in the paired layout (dot.h clover_x4_pair_q8_K). */

/* An empty asm that takes v in a register and gives it back: it keeps a running sum in one
 * register (the compiler would otherwise reassociate the terms of the 4 rows' sums into trees
 * and spill them). */
#define DK_IN_REG(v) __asm__("" : "+x"(v))

/* Q4_K (x5 == NULL) and Q5_K: dot_q4_K_avx2 / dot_q5_K_avx2 over R (1 or 4) rows in the paired layout.
 * The 128 level bytes are transposed in 8-byte pieces so that register s holds bytes 8s..8s+7 of
 * each 32-byte chunk j: its low nibbles are values 8s..8s+7 of sub-blocks 0, 2, 4, 6, its high
 * nibbles those of sub-blocks 1, 3, 5, 7, the order of the paired rows' two 32-byte halves. Each
 * int16 lane of maddubs then stays in one sub-block for all s, so the 4 products of a lane are
 * summed in int16 (at most 4 * 2 * 31 * 127 = 31496) and scaled with one madd per half block,
 * not one per 32 values. Per block and row the int32 sums S (levels times scales) and M (mins
 * times the sub-block sums) reduce to one lane each; the floats run as in dk_block_float. */
DK_AVX2 static inline __attribute__((always_inline)) void dk_q45_avx2_rows(int R, int64_t n, const dk_q4_K *x4,
                                                                           const dk_q5_K *x5, const void *xq,
                                                                           int64_t x_stride, float *out) {
    DK_ROWS4(y, xq, R > 1 ? x_stride : 0);
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i m16 = _mm256_set1_epi8(16);
    const __m256i hshift = _mm256_setr_epi64x(0, 2, 4, 6);
    /* pshufb masks taking int16 scales (0, 2 | 4, 6) and (1, 3 | 5, 7), each into 4 lanes */
    const __m256i even = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 4, 5, 4, 5, 4, 5, 4, 5, 8, 9, 8, 9, 8, 9, 8, 9, 12, 13,
                                          12, 13, 12, 13, 12, 13);
    const __m256i odd = _mm256_add_epi8(even, _mm256_set1_epi8(2));
    __m128 acc = _mm_setzero_ps(), accm = _mm_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        const uint8_t *scales = x5 ? x5[i].scales : x4[i].scales;
        const uint8_t *q = x5 ? x5[i].qs : x4[i].qs;
        const float d = _cvtsh_ss(x5 ? x5[i].d : x4[i].d), dmin = _cvtsh_ss(x5 ? x5[i].dmin : x4[i].dmin);
        if (x5)
            CLOVER_PREFETCH(x5 + i, 3);
        else
            CLOVER_PREFETCH(x4 + i, 3);
        const __m256i sm16 = dk_scales_mins16(scales);
        const __m256i sc = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(sm16));
        const __m256i sce = _mm256_shuffle_epi8(sc, even), sco = _mm256_shuffle_epi8(sc, odd);
        const __m128i mins = _mm256_extracti128_si256(sm16, 1);
        /* transpose the 4 chunks' 8-byte pieces: w[s] = piece s of chunks 0, 1, 2, 3 */
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)q), c1 = _mm256_loadu_si256((const __m256i *)(q + 32));
        const __m256i c2 = _mm256_loadu_si256((const __m256i *)(q + 64)), c3 = _mm256_loadu_si256((const __m256i *)(q + 96));
        const __m256i t0 = _mm256_unpacklo_epi64(c0, c1), t1 = _mm256_unpackhi_epi64(c0, c1);
        const __m256i t2 = _mm256_unpacklo_epi64(c2, c3), t3 = _mm256_unpackhi_epi64(c2, c3);
        const __m256i w[4] = {_mm256_permute2x128_si256(t0, t2, 0x20), _mm256_permute2x128_si256(t1, t3, 0x20),
                              _mm256_permute2x128_si256(t0, t2, 0x31), _mm256_permute2x128_si256(t1, t3, 0x31)};
        __m256i lo[4], hi[4]; /* the levels of piece k: even and odd sub-blocks */
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            lo[k] = _mm256_and_si256(w[k], m4);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(w[k], 4), m4);
            if (x5) { /* bits 2j / 2j+1 of qh[8k + b] -> bit 4 of chunk j's piece, byte b */
                uint64_t h;
                memcpy(&h, x5[i].qh + 8 * k, 8);
                const __m256i hb = _mm256_srlv_epi64(_mm256_set1_epi64x((long long)h), hshift);
                lo[k] = _mm256_or_si256(lo[k], _mm256_and_si256(_mm256_slli_epi16(hb, 4), m16));
                hi[k] = _mm256_or_si256(hi[k], _mm256_and_si256(_mm256_slli_epi16(hb, 3), m16));
            }
        }
        /* row by row (the levels stay in registers): int16 sums of the even and the odd
         * sub-blocks over the 4 pieces, then one madd with the scales each; the mins part after */
        __m256i sr[4];
        __m128i mr[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const int8_t *a = y[r][i].qs;
            __m256i se = _mm256_maddubs_epi16(lo[0], _mm256_loadu_si256((const __m256i *)a));
            __m256i so = _mm256_maddubs_epi16(hi[0], _mm256_loadu_si256((const __m256i *)(a + 32)));
#pragma GCC unroll 3
            for (int k = 1; k < 4; k++) {
                se = _mm256_add_epi16(se, _mm256_maddubs_epi16(lo[k], _mm256_loadu_si256((const __m256i *)(a + 64 * k))));
                so = _mm256_add_epi16(so, _mm256_maddubs_epi16(hi[k], _mm256_loadu_si256((const __m256i *)(a + 64 * k + 32))));
                DK_IN_REG(se);
                DK_IN_REG(so);
            }
            sr[r] = _mm256_add_epi32(_mm256_madd_epi16(se, sce), _mm256_madd_epi16(so, sco));
            if (r & 1) { /* rows r - 1, r pairwise added: one register for the two */
                sr[r - 1] = _mm256_hadd_epi32(sr[r - 1], sr[r]);
                DK_IN_REG(sr[r - 1]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) mr[r] = _mm_madd_epi16(mins, _mm_loadu_si128((const __m128i *)y[r][i].bsums));
        if (R == 1) {
            acc = dk_block_float(acc, sr[0], mr[0], y[0][i].d, x5 ? &x5[i].d : &x4[i].d);
            continue;
        }
        /* lane r: row r's S (two levels of pairwise adds, then the two halves) and M */
        const __m256i h = _mm256_hadd_epi32(sr[0], sr[2]);
        const __m128i S = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
        const __m128i M = _mm_hadd_epi32(_mm_hadd_epi32(mr[0], mr[1]), _mm_hadd_epi32(mr[2], mr[3]));
        const __m128 yd = _mm_setr_ps(y[0][i].d, y[1][i].d, y[2][i].d, y[3][i].d);
        acc = _mm_fmadd_ps(_mm_mul_ps(yd, _mm_set1_ps(d)), _mm_cvtepi32_ps(S), acc);
        accm = _mm_fmadd_ps(_mm_mul_ps(yd, _mm_set1_ps(dmin)), _mm_cvtepi32_ps(M), accm);
    }
    if (R == 1)
        out[0] = dk_block_float_end(acc);
    else
        _mm_storeu_ps(out, _mm_sub_ps(acc, accm));
}

DK_AVX2 static void dot4_q4_K_avx2(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    dk_q45_avx2_rows(4, n, (const dk_q4_K *)w_row, NULL, xq, x_stride, out);
}

DK_AVX2 static void dot4_q5_K_avx2(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    dk_q45_avx2_rows(4, n, NULL, (const dk_q5_K *)w_row, xq, x_stride, out);
}

/* One paired row (dot.h clover_dot1_x4_avx2): the same value as dot_q4_K_avx2 / dot_q5_K_avx2
 * on the plain row, bit for bit. */
DK_AVX2 static float dot1p_q4_K_avx2(int64_t n, const void *w_row, const void *xq) {
    float out;
    dk_q45_avx2_rows(1, n, (const dk_q4_K *)w_row, NULL, xq, 0, &out);
    return out;
}

DK_AVX2 static float dot1p_q5_K_avx2(int64_t n, const void *w_row, const void *xq) {
    float out;
    dk_q45_avx2_rows(1, n, NULL, (const dk_q5_K *)w_row, xq, 0, &out);
    return out;
}

/* Q6_K: the levels of one chunk c (32 values) of a half block at a time, from its ql and qh
 * bytes (dk_q6_levels' q[c]), so that the 4 rows' sums and accumulators stay in registers. */
DK_AVX2 static inline __m256i dk_q6_chunk(const uint8_t *ql, const uint8_t *qh, int c) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(ql + 32 * (c & 1)));
    const __m256i bh = _mm256_loadu_si256((const __m256i *)qh);
    const __m256i lo = c < 2 ? _mm256_and_si256(b, m4) : _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    const __m256i hi = c == 0   ? _mm256_slli_epi16(bh, 4)
                       : c == 1 ? _mm256_slli_epi16(bh, 2)
                       : c == 2 ? bh
                                : _mm256_srli_epi16(bh, 2);
    return _mm256_or_si256(lo, _mm256_and_si256(hi, m30));
}

DK_AVX2 static void dot4_q6_K_avx2(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    const dk_q6_K *x = (const dk_q6_K *)w_row;
    DK_ROWS4(y, xq, x_stride);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 4);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)x[i].scales));
        /* levels are stored +32: the sums start at -32 * sum_g sc_g * bsum_g */
        __m256i s[4];
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            const __m256i bsums = _mm256_loadu_si256((const __m256i *)y[r][i].bsums);
            s[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(bsums, sc16), 5));
        }
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i sh = dk_q6_half_scales(sc16, h);
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++) {
                /* 32 values = two groups of 16: int16 lanes 0..7 take scale 2k, lanes 8..15 2k+1 */
                const int k = 4 * h + c;
                const __m256i qv = dk_q6_chunk(x[i].ql + 64 * h, x[i].qh + 32 * h, c);
                const __m256i scv = DK_Q6_SCALE(sh, c);
#pragma GCC unroll 4
                for (int r = 0; r < 4; r++) {
                    const __m256i p = _mm256_maddubs_epi16(qv, _mm256_loadu_si256((const __m256i *)(y[r][i].qs + 32 * k)));
                    s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(scv, p));
                    DK_IN_REG(s[r]);
                }
            }
        }
        const float d = _cvtsh_ss(x[i].d);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r][i].d * d), _mm256_cvtepi32_ps(s[r]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = clover_hsum8(acc[r]);
}

DK_AVX2 static void dot4_iq4_xs_avx2(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out) {
    const dk_iq4_xs *x = (const dk_iq4_xs *)w_row;
    DK_ROWS4(y, xq, x_stride);
    const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)clover_kv_iq4nl));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc[4];
    for (int r = 0; r < 4; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        CLOVER_PREFETCH(x + i, 3);
        const __m256i ls32 = dk_iq4xs_scales(&x[i]);
        const __m128i ls16 = _mm_packs_epi32(_mm256_castsi256_si128(ls32), _mm256_extracti128_si256(ls32, 1));
        const __m256i lsb = _mm256_broadcastsi128_si256(ls16);
        const uint8_t *q = x[i].qs;
        __m256i s[4];
        for (int r = 0; r < 4; r++) s[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int g = 0; g < 8; g += 2, q += 32) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)q);
            const __m256i lo = _mm256_and_si256(bits, m4), hi = _mm256_and_si256(_mm256_srli_epi16(bits, 4), m4);
            const __m256i w0 = _mm256_shuffle_epi8(tab, _mm256_permute2x128_si256(lo, hi, 0x20));
            const __m256i w1 = _mm256_shuffle_epi8(tab, _mm256_permute2x128_si256(lo, hi, 0x31));
            const __m256i u0 = _mm256_sign_epi8(w0, w0), u1 = _mm256_sign_epi8(w1, w1);
            const __m256i l0 = _mm256_shuffle_epi8(lsb, DK_BCAST16(g)), l1 = _mm256_shuffle_epi8(lsb, DK_BCAST16(g + 1));
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                const int8_t *a = y[r][i].qs + 32 * g;
                const __m256i p0 = _mm256_maddubs_epi16(u0, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a), w0));
                const __m256i p1 =
                    _mm256_maddubs_epi16(u1, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(a + 32)), w1));
                s[r] = _mm256_add_epi32(s[r], _mm256_add_epi32(_mm256_madd_epi16(p0, l0), _mm256_madd_epi16(p1, l1)));
            }
        }
        for (int r = 0; r < 4; r++)
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(y[r][i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(s[r]), acc[r]);
    }
    for (int r = 0; r < 4; r++) out[r] = clover_hsum8(acc[r]);
}

DK_EXPORT clover_vec_dot4_fn clover_dot4_k_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot4_q4_K_avx2;
    case CLOVER_TYPE_Q5_K: return dot4_q5_K_avx2;
    case CLOVER_TYPE_Q6_K: return dot4_q6_K_avx2;
    case CLOVER_TYPE_IQ4_XS: return dot4_iq4_xs_avx2;
    default: return NULL;
    }
}

DK_EXPORT clover_vec_dot_fn clover_dot_paired_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q4_K: return dot1p_q4_K_avx2;
    case CLOVER_TYPE_Q5_K: return dot1p_q5_K_avx2;
    default: return NULL;
    }
}

#else /* not x86 */

DK_EXPORT clover_vec_dot_fn clover_dot_paired_avx2(int type) {
    (void)type;
    return NULL;
}

DK_EXPORT clover_vec_dot4_fn clover_dot4_k_avx2(int type) {
    (void)type;
    return NULL;
}

#endif
