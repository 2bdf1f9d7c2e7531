/* kquants23.c: the 2- and 3-bit K-quant weight formats Q2_K and Q3_K (spec 6): quantise,
 * dequantise, and their dot kernels against Q8_K activations (a portable scalar kernel, the
 * reference, and an AVX2 kernel; on AVX-512 CPUs the dispatch falls back to the AVX2 one).
 *
 * Layouts are ggml's (ggml-common.h block_q2_K, block_q3_K), 256 values a block:
 *   Q2_K  84 B: 16 B scales (per 16 values: low nibble scale, high nibble min), 64 B qs of
 *               2-bit levels, fp16 d, fp16 dmin; value = d * (sc & 15) * q - dmin * (sc >> 4).
 *   Q3_K 110 B: 32 B hmask, 64 B qs of the low 2 bits, 12 B of sixteen 6-bit scales, fp16 d;
 *               value = d * (sc - 32) * (q - 4 * !hbit).
 * In both, qs[32 h + l] holds value 128 h + 32 k + l in bits 2k, 2k+1 (k < 4); the high bit of
 * Q3_K value v is bit v / 32 of hmask[v % 32]. The Q3_K scales: scale j takes its low 4 bits
 * from byte j (j < 8, low nibble) or j - 8 (high nibble), its high 2 bits from bits 2 (j / 4)
 * of byte 8 + j % 4.
 *
 * The quantisers follow ggml's quantize_row_q2_K_ref / quantize_row_q3_K_ref (the ones
 * llama-quantize runs without an importance matrix) step by step, in the same float operation
 * order (C11 without -ffast-math: no FMA contraction), so the bytes equal ggml's. The dot
 * kernels follow ggml_vec_dot_q2_K_q8_K / ggml_vec_dot_q3_K_q8_K: exact int32 sums per block
 * (per-16 scales applied in integers; the Q2_K mins from the Q8_K bsums), scaled in float, so
 * the AVX2 kernels differ from the scalar ones in the order of the float sums only.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "clover.h"
#include "quant/dot.h"
#include "quant/quants.h"

#define QK_K 256
#define GROUP_EPS 1e-15f /* ggml GROUP_MAX_EPS: groups with max |x| below this are stored as zeros */

typedef struct {
    uint8_t scales[16]; /* per 16 values: scale (low nibble), min (high nibble) */
    uint8_t qs[64];
    uint16_t d, dmin;
} k2_block;

typedef struct {
    uint8_t hmask[32];
    uint8_t qs[64];
    uint8_t scales[12];
    uint16_t d;
} k3_block;

_Static_assert(sizeof(k2_block) == 84, "q2_K block size");
_Static_assert(sizeof(k3_block) == 110, "q3_K block size");

static inline float h2f(uint16_t h) { return clover_fp16_to_fp32(h); }
static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

/* The 2-bit fields of 256 levels L (each < 4) into qs (layout above). */
static void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; l++)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) | (L[j + l + 96] << 6));
}

/* ---------------------------------------------------------------- Q2_K */

/* The quantisers write o (any alignment) through the fields' offsets. */
void clover_q2_k_quant(const float *x, uint8_t *o) {
    uint8_t L[QK_K];
    float w[16], scales[16], mins[16];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 16; j++) {
        for (int l = 0; l < 16; l++) w[l] = fabsf(x[16 * j + l]);
        scales[j] = clover_fit_scale_min(16, 3, x + 16 * j, w, L + 16 * j, &mins[j], -0.5f, 0.1f, 15, 1);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    uint8_t sc[16] = {0};
    uint16_t d = clover_fp32_to_fp16(0.f), dmin = d;
    if (max_scale > 0) {
        const float iscale = 15.f / max_scale;
        for (int j = 0; j < 16; j++) sc[j] = (uint8_t)clover_round_int(iscale * scales[j]);
        d = clover_fp32_to_fp16(max_scale / 15.f);
    }
    if (max_min > 0) {
        const float iscale = 15.f / max_min;
        for (int j = 0; j < 16; j++) sc[j] = (uint8_t)(sc[j] | (clover_round_int(iscale * mins[j]) << 4));
        dmin = clover_fp32_to_fp16(max_min / 15.f);
    }
    for (int j = 0; j < 16; j++) {
        const float dl = h2f(d) * (sc[j] & 0xF);
        if (dl == 0.0f) continue; /* keep the levels of the fit */
        const float ml = h2f(dmin) * (sc[j] >> 4);
        for (int i = 0; i < 16; i++) L[16 * j + i] = (uint8_t)imax(0, imin(3, clover_round_int((x[16 * j + i] + ml) / dl)));
    }
    memcpy(o + offsetof(k2_block, scales), sc, 16);
    pack_2bit(L, o + offsetof(k2_block, qs));
    memcpy(o + offsetof(k2_block, d), &d, 2);
    memcpy(o + offsetof(k2_block, dmin), &dmin, 2);
}

void clover_q2_k_dequant(const uint8_t *b, float *y) {
    k2_block x;
    memcpy(&x, b, sizeof x);
    const float d = h2f(x.d), dmin = h2f(x.dmin);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                const uint8_t sc = x.scales[8 * h + 2 * k + half];
                const float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
                const uint8_t *q = x.qs + 32 * h + 16 * half;
                for (int l = 0; l < 16; l++) *y++ = dl * ((q[l] >> (2 * k)) & 3) - ml;
            }
}

/* ---------------------------------------------------------------- Q3_K */

/* Symmetric fit of 16 values to levels -4..3 weighted by x^2 (ggml make_q3_quants with
 * do_rmse): the grid that maps the largest |x| to -4, then up to 5 passes moving single levels
 * while the least-squares fit improves. L gets level + 4; returns the scale. */
static float q3_fit(const float *x, int8_t *L) {
    const int n = 16, nmax = 4;
    float max = 0, amax = 0;
    for (int i = 0; i < n; i++) {
        const float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.f;
    }
    const float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = imax(-nmax, imin(nmax - 1, clover_round_int(iscale * x[i])));
        L[i] = (int8_t)l;
        const float w = x[i] * x[i];
        sumlx += w * x[i] * l;
        suml2 += w * l * l;
    }
    for (int itry = 0; itry < 5; itry++) {
        int n_changed = 0;
        for (int i = 0; i < n; i++) {
            const float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * L[i] * L[i];
                const int new_l = imax(-nmax, imin(nmax - 1, clover_round_int(x[i] * sl2 / slx)));
                if (new_l != L[i]) {
                    slx += w * x[i] * new_l;
                    sl2 += w * new_l * new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed++;
                    }
                }
            }
        }
        if (!n_changed) break;
    }
    for (int i = 0; i < n; i++) L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* The sixteen 6-bit Q3_K scales (0..63, value scale + 32) of the 12-byte field s, as the bytes
 * of aux (ggml's kmask unpacking). */
static inline void k3_scales(const uint8_t *s, uint32_t aux[4]) {
    const uint32_t kmask1 = 0x03030303u, kmask2 = 0x0f0f0f0fu;
    memcpy(aux, s, 12);
    const uint32_t tmp = aux[2];
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
}

void clover_q3_k_quant(const float *x, uint8_t *o) {
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, amax = 0;
    for (int j = 0; j < 16; j++) {
        scales[j] = q3_fit(x + 16 * j, L + 16 * j);
        if (fabsf(scales[j]) > amax) {
            amax = fabsf(scales[j]);
            max_scale = scales[j];
        }
    }
    uint8_t sc[12] = {0};
    uint16_t d = clover_fp32_to_fp16(0.f);
    if (max_scale != 0.0f) {
        const float iscale = -32.f / max_scale;
        for (int j = 0; j < 16; j++) {
            const int l = imax(-32, imin(31, (int8_t)clover_round_int(iscale * scales[j]))) + 32;
            if (j < 8)
                sc[j] = (uint8_t)(l & 0xF);
            else
                sc[j - 8] = (uint8_t)(sc[j - 8] | ((l & 0xF) << 4));
            sc[j % 4 + 8] = (uint8_t)(sc[j % 4 + 8] | ((l >> 4) << (2 * (j / 4))));
        }
        d = clover_fp32_to_fp16(1 / iscale);
    }
    uint32_t aux[4];
    k3_scales(sc, aux);
    const uint8_t *s6 = (const uint8_t *)aux;
    for (int j = 0; j < 16; j++) {
        const float dl = h2f(d) * (s6[j] - 32);
        if (dl == 0.0f) continue; /* keep the levels of the fit */
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = (int8_t)(imax(-4, imin(3, clover_round_int(x[16 * j + i] / dl))) + 4);
    }
    uint8_t Lu[QK_K], hmask[32] = {0};
    for (int j = 0; j < QK_K; j++) {
        const int l = L[j];
        if (l > 3) hmask[j % 32] = (uint8_t)(hmask[j % 32] | (1u << (j / 32)));
        Lu[j] = (uint8_t)(l > 3 ? l - 4 : l);
    }
    memcpy(o + offsetof(k3_block, hmask), hmask, 32);
    pack_2bit(Lu, o + offsetof(k3_block, qs));
    memcpy(o + offsetof(k3_block, scales), sc, 12);
    memcpy(o + offsetof(k3_block, d), &d, 2);
}

void clover_q3_k_dequant(const uint8_t *b, float *y) {
    k3_block x;
    memcpy(&x, b, sizeof x);
    uint32_t aux[4];
    k3_scales(x.scales, aux);
    const uint8_t *s6 = (const uint8_t *)aux;
    const float d = h2f(x.d);
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int half = 0; half < 2; half++) {
                const float dl = d * (s6[8 * h + 2 * k + half] - 32);
                for (int l = 16 * half; l < 16 * half + 16; l++) {
                    const int q = (x.qs[32 * h + l] >> (2 * k)) & 3;
                    *y++ = dl * (q - (((x.hmask[l] >> (4 * h + k)) & 1) ? 0 : 4));
                }
            }
}

/* ---------------------------------------------------------------- scalar dot kernels */

/* The 256 levels of a block as bytes in value order: the 2-bit fields, minus 4 where the high
 * bit (hmask; NULL for Q2_K) is clear. */
static void k23_levels(const uint8_t *qs, const uint8_t *hmask, int8_t *L) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) {
                int q = (qs[32 * h + l] >> (2 * k)) & 3;
                if (hmask) q -= ((hmask[l] >> (4 * h + k)) & 1) ? 0 : 4;
                L[128 * h + 32 * k + l] = (int8_t)q;
            }
}

static inline int32_t dot16(const int8_t *w, const int8_t *a) {
    int32_t s = 0;
    for (int l = 0; l < 16; l++) s += w[l] * a[l];
    return s;
}

static float dot_q2_K_scalar(int64_t n, const void *w_row, const void *xq) {
    const k2_block *x = (const k2_block *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t L[QK_K];
        k23_levels(x[i].qs, NULL, L);
        int32_t isum = 0, msum = 0;
        for (int g = 0; g < 16; g++) {
            isum += (x[i].scales[g] & 0xF) * dot16(L + 16 * g, y[i].qs + 16 * g);
            msum += (x[i].scales[g] >> 4) * y[i].bsums[g];
        }
        sum += y[i].d * h2f(x[i].d) * (float)isum - y[i].d * h2f(x[i].dmin) * (float)msum;
    }
    return sum;
}

static float dot_q3_K_scalar(int64_t n, const void *w_row, const void *xq) {
    const k3_block *x = (const k3_block *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    float sum = 0.0f;
    for (int64_t i = 0; i < n / QK_K; i++) {
        int8_t L[QK_K];
        k23_levels(x[i].qs, x[i].hmask, L);
        uint32_t aux[4];
        k3_scales(x[i].scales, aux);
        const uint8_t *s6 = (const uint8_t *)aux;
        int32_t isum = 0;
        for (int g = 0; g < 16; g++) isum += (s6[g] - 32) * dot16(L + 16 * g, y[i].qs + 16 * g);
        sum += y[i].d * h2f(x[i].d) * (float)isum;
    }
    return sum;
}

clover_vec_dot_fn clover_dot_k23_scalar(int type) {
    switch (type) {
    case CLOVER_TYPE_Q2_K: return dot_q2_K_scalar;
    case CLOVER_TYPE_Q3_K: return dot_q3_K_scalar;
    default: return NULL;
    }
}

/* ---------------------------------------------------------------- AVX2 dot kernels */

#if defined(__x86_64__) || defined(__i386__)
#include "cpu/x86/simd_x86.h"

#define K23_AVX2 CLOVER_AVX2

/* pshufb mask for the 32 values of step k of a 128-value half: the low 16 bytes pick int16
 * scale 2k of each 128-bit lane, the high 16 bytes scale 2k + 1 (one scale per 16 values). */
K23_AVX2 static inline __m256i k23_scale_mask(int k) {
    return _mm256_set_m128i(_mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * k + 1))),
                            _mm_set1_epi16((short)(0x0100 + 0x0202 * (2 * k))));
}

/* The 16 per-16 scales (int16) as two vectors holding scales 0..7 / 8..15 in both lanes. */
K23_AVX2 static inline void k23_scale_halves(__m128i sc8, int is_signed, __m256i out[2]) {
    const __m256i s16 = is_signed ? _mm256_cvtepi8_epi16(sc8) : _mm256_cvtepu8_epi16(sc8);
    out[0] = _mm256_broadcastsi128_si256(_mm256_castsi256_si128(s16));
    out[1] = _mm256_broadcastsi128_si256(_mm256_extracti128_si256(s16, 1));
}

K23_AVX2 static float dot_q2_K_avx2(int64_t n, const void *w_row, const void *xq) {
    const k2_block *x = (const k2_block *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m256i m3 = _mm256_set1_epi8(3);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        CLOVER_PREFETCH(x + i, 2); /* 84-byte blocks */
        const __m128i ms = _mm_loadu_si128((const __m128i *)x[i].scales);
        const __m128i mins8 = _mm_and_si128(_mm_srli_epi16(ms, 4), m4);
        const __m256i prod = _mm256_madd_epi16(_mm256_cvtepu8_epi16(mins8), _mm256_loadu_si256((const __m256i *)y[i].bsums));
        accm = _mm256_fmadd_ps(_mm256_set1_ps(-y[i].d * _cvtsh_ss(x[i].dmin)), _mm256_cvtepi32_ps(prod), accm);
        __m256i sc[2];
        k23_scale_halves(_mm_and_si128(ms, m4), 0, sc);
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i *)(y[i].qs + 128 * h + 32 * k)));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_shuffle_epi8(sc[h], k23_scale_mask(k)), p));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return clover_hsum8(acc) + clover_hsum8(accm);
}

/* Q3_K: level = low 2 bits - 4 * (high bit clear), so each 32-value product is
 * maddubs(low, a) - maddubs(4 * !hbit, a) (both within int16: 3 * 127 * 2). */
K23_AVX2 static float dot_q3_K_avx2(int64_t n, const void *w_row, const void *xq) {
    const k3_block *x = (const k3_block *)w_row;
    const clover_block_q8_K *y = (const clover_block_q8_K *)xq;
    const __m256i m3 = _mm256_set1_epi8(3);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n / QK_K; i++) {
        CLOVER_PREFETCH(x + i, 2); /* 110-byte blocks */
        uint32_t aux[4];
        k3_scales(x[i].scales, aux);
        __m256i sc[2];
        k23_scale_halves(_mm_sub_epi8(_mm_loadu_si128((const __m128i *)aux), _mm_set1_epi8(32)), 1, sc);
        const __m256i hbits = _mm256_loadu_si256((const __m256i *)x[i].hmask);
        __m256i sumi = _mm256_setzero_si256();
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
            const __m256i bits = _mm256_loadu_si256((const __m256i *)(x[i].qs + 32 * h));
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                const int b = 4 * h + k; /* hmask bit of these 32 values */
                const __m256i ql = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * k), m3);
                /* bit b of each byte, inverted, moved to bit 2 (shifts by b stay inside each byte) */
                const __m256i qh = _mm256_slli_epi16(
                    _mm256_srli_epi16(_mm256_andnot_si256(hbits, _mm256_set1_epi8((char)(1 << b))), b), 2);
                const __m256i a = _mm256_loadu_si256((const __m256i *)(y[i].qs + 128 * h + 32 * k));
                const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(ql, a), _mm256_maddubs_epi16(qh, a));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_shuffle_epi8(sc[h], k23_scale_mask(k)), p));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(y[i].d * _cvtsh_ss(x[i].d)), _mm256_cvtepi32_ps(sumi), acc);
    }
    return clover_hsum8(acc);
}

clover_vec_dot_fn clover_dot_k23_avx2(int type) {
    switch (type) {
    case CLOVER_TYPE_Q2_K: return dot_q2_K_avx2;
    case CLOVER_TYPE_Q3_K: return dot_q3_K_avx2;
    default: return NULL;
    }
}

#else
clover_vec_dot_fn clover_dot_k23_avx2(int type) {
    (void)type;
    return NULL;
}
#endif
