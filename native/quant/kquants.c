/* kquants.c: ggml block weight formats beyond Q8_0 (spec 6): quantise and dequantise for
 * Q4_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4 and the Q8_K activation format, and the table
 * of every block format (with Q2_K and Q3_K of kquants23.c).
 *
 * Layouts are ggml's (ggml-common.h), little-endian, one block after another:
 *   Q4_0   32 values,  18 B: fp16 d, 16 B nibbles (low nibble: value j, high: value j+16);
 *                           value = d * (q - 8).
 *   Q4_K  256 values, 144 B: fp16 d, fp16 dmin, 12 B of eight 6-bit (scale, min) pairs,
 *                           128 B nibbles; per 64 values the low nibbles hold the first 32,
 *                           the high nibbles the next 32; value = d*sc*q - dmin*m.
 *   Q5_K  256 values, 176 B: as Q4_K plus 32 B qh (bit 2k / 2k+1 of qh[l] is the fifth bit
 *                           of value 64k+l / 64k+32+l) between the scales and the nibbles.
 *   Q6_K  256 values, 210 B: 128 B low nibbles, 64 B 2-bit highs, 16 int8 scales (one per 16
 *                           values), fp16 d; value = d * sc * (q - 32).
 *   IQ4_NL 32 values,  18 B: fp16 d, 16 B nibbles indexing the non-linear table
 *                           kvalues_iq4nl; value = d * table[q].
 *   IQ4_XS 256 values, 136 B: fp16 d, uint16 scales_h, 4 B scales_l, 128 B nibbles; per 32
 *                           values a 6-bit scale ls (4 low bits in scales_l, 2 high bits in
 *                           scales_h), value = d * (ls - 32) * table[q].
 *   MXFP4  32 values,  17 B: one E8M0 exponent byte e, 16 B nibbles of E2M1 codes (doubled
 *                           values 0,1,2,3,4,6,8,12 and negatives); value = 2^(e-128) * code.
 *   Q8_K  256 values, 292 B: float32 d, 256 int8 q, 16 int16 sums of each 16 q; value = d*q.
 *
 * The quantisers follow ggml's scalar reference quantisers (quantize_row_*_ref, no
 * importance matrix) step by step, with the same float operation order, so that they give
 * the same bytes as ggml built without FMA contraction (this file is C11 without
 * -ffast-math: GCC then does not contract a*b+c). Differences from ggml, values unaffected:
 * an IQ4_NL block of all zeros (|x| < 1e-15) stores zero nibbles, where ggml leaves
 * whatever the previous block had (its dequantised values are 0 either way).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "clover.h"
#include "quant/dot.h"
#include "quant/quants.h"

#define QK_K 256
#define GROUP_EPS 1e-15f /* groups with max |x| below this are stored as zeros */

/* ggml's kvalues_iq4nl and kvalues_mxfp4 (doubled E2M1 codes); the dot kernels use them too. */
CLOVER_INTERNAL const int8_t clover_kv_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                    1,    13,   25,  38,  53,  69,  89,  113};
CLOVER_INTERNAL const int8_t clover_kv_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ---------------------------------------------------------------- helpers */

static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return clover_fp16_to_fp32(h);
}

static inline void f2h(uint8_t *p, float f) {
    const uint16_t h = clover_fp32_to_fp16(f);
    memcpy(p, &h, 2);
}

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

/* Index of the table entry nearest to x in an increasing table of n int8 values (binary
 * search; an exact midpoint goes to the upper entry). */
static int nearest_index(int n, const int8_t *tab, float x) {
    if (x <= tab[0]) return 0;
    if (x >= tab[n - 1]) return n - 1;
    int lo = 0, hi = n - 1;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (x < tab[mid])
            hi = mid;
        else
            lo = mid;
    }
    return x - tab[hi - 1] < tab[hi] - x ? hi - 1 : hi;
}

/* ---------------------------------------------------------------- Q4_0 */

static void q4_0_quant(const float *x, uint8_t *o) {
    float amax = 0.0f, vmax = 0.0f;
    for (int j = 0; j < 32; j++) {
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    }
    const float d = vmax / -8.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    f2h(o, d);
    for (int j = 0; j < 16; j++) {
        /* x*id is in [-8, 8]: +8.5 then truncation rounds half up; 16 clamps to 15 */
        const float a = x[j] * id + 8.5f, b = x[j + 16] * id + 8.5f;
        const int qa = (a >= 0.0f && a < 128.0f) ? (int)a : 0;
        const int qb = (b >= 0.0f && b < 128.0f) ? (int)b : 0;
        o[2 + j] = (uint8_t)(imin(15, qa) | (imin(15, qb) << 4));
    }
}

static void q4_0_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b);
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((b[2 + j] & 15) - 8) * d;
        y[j + 16] = (float)((b[2 + j] >> 4) - 8) * d;
    }
}

/* ---------------------------------------------------------------- Q4_K / Q5_K */

/* Asymmetric fit of n <= 32 values to levels 0..nmax with weights w: x ~ scale*L - min_out
 * (ggml make_qkx2_quants). Starts from the min/max grid, then tries nstep+1 grid spacings
 * (rmin + rdelta*is + nmax levels over the range) with a weighted least-squares (scale, min)
 * fit each, keeping the one with the lowest weighted error: squared, or absolute when mad
 * (Q2_K). Returns scale; *min_out = -min (>= 0). */
float clover_fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *min_out, float rmin,
                           float rdelta, int nstep, int mad) {
    uint8_t Lt[32];
    float lo = x[0], hi = x[0];
    float sw = w[0];
    float sx = sw * x[0];
    for (int i = 1; i < n; i++) {
        if (x[i] < lo) lo = x[i];
        if (x[i] > hi) hi = x[i];
        sw += w[i];
        sx += w[i] * x[i];
    }
    if (lo > 0) lo = 0;
    if (hi == lo) {
        for (int i = 0; i < n; i++) L[i] = 0;
        *min_out = -lo;
        return 0.0f;
    }
    float iscale = nmax / (hi - lo);
    float scale = 1 / iscale;
    float best = 0;
    for (int i = 0; i < n; i++) {
        L[i] = (uint8_t)imax(0, imin(nmax, clover_round_int(iscale * (x[i] - lo))));
        const float diff = scale * L[i] + lo - x[i];
        best += w[i] * (mad ? fabsf(diff) : diff * diff);
    }
    for (int is = 0; is <= nstep; is++) {
        iscale = (rmin + rdelta * is + nmax) / (hi - lo);
        float sl = 0, sl2 = 0, sxl = 0;
        for (int i = 0; i < n; i++) {
            const int l = imax(0, imin(nmax, clover_round_int(iscale * (x[i] - lo))));
            Lt[i] = (uint8_t)l;
            sl += w[i] * l;
            sl2 += w[i] * l * l;
            sxl += w[i] * l * x[i];
        }
        const float D = sw * sl2 - sl * sl;
        if (D > 0) {
            float s = (sw * sxl - sx * sl) / D;
            float m = (sl2 * sx - sl * sxl) / D;
            if (m > 0) {
                m = 0;
                s = sxl / sl2;
            }
            float err = 0;
            for (int i = 0; i < n; i++) {
                const float diff = s * Lt[i] + m - x[i];
                err += w[i] * (mad ? fabsf(diff) : diff * diff);
            }
            if (err < best) {
                memcpy(L, Lt, (size_t)n);
                best = err;
                scale = s;
                lo = m;
            }
        }
    }
    *min_out = -lo;
    return scale;
}

/* 6-bit scale j and min j of the 12-byte Q4_K/Q5_K scale field. */
static inline void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Shared part of Q4_K (nmax 15) and Q5_K (nmax 31): fills d, dmin and the scale field at
 * o[0..15] and the levels L[256]. */
static void k45_levels(const float *x, uint8_t *o, uint8_t *L, int nmax, float rmin, int nstep) {
    float scales[8], mins[8], w[32];
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; j++) {
        const float *xb = x + 32 * j;
        float sum_x2 = 0;
        for (int l = 0; l < 32; l++) sum_x2 += xb[l] * xb[l];
        const float av = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; l++) w[l] = av + fabsf(xb[l]);
        scales[j] = clover_fit_scale_min(32, nmax, xb, w, L + 32 * j, &mins[j], rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    uint8_t *sc = o + 4;
    memset(sc, 0, 12);
    for (int j = 0; j < 8; j++) {
        const int ls = imin(63, (uint8_t)clover_round_int(inv_scale * scales[j]));
        const int lm = imin(63, (uint8_t)clover_round_int(inv_min * mins[j]));
        if (j < 4) {
            sc[j] = (uint8_t)ls;
            sc[j + 4] = (uint8_t)lm;
        } else {
            sc[j + 4] = (uint8_t)((ls & 0xF) | ((lm & 0xF) << 4));
            sc[j - 4] |= (uint8_t)((ls >> 4) << 6);
            sc[j] |= (uint8_t)((lm >> 4) << 6);
        }
    }
    f2h(o, max_scale / 63.f);
    f2h(o + 2, max_min / 63.f);
    const float d = h2f(o), dmin = h2f(o + 2);
    for (int j = 0; j < 8; j++) {
        int s, m;
        k4_scale_min(j, sc, &s, &m);
        const float dl = d * s;
        if (dl == 0.0f) continue; /* keep the levels of the fit */
        const float ml = dmin * m;
        for (int i = 0; i < 32; i++)
            L[32 * j + i] = (uint8_t)imax(0, imin(nmax, clover_round_int((x[32 * j + i] + ml) / dl)));
    }
}

static void q4_k_quant(const float *x, uint8_t *o) {
    uint8_t L[QK_K];
    k45_levels(x, o, L, 15, -1.0f, 20);
    uint8_t *q = o + 16;
    for (int j = 0; j < QK_K; j += 64, q += 32)
        for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
}

static void q5_k_quant(const float *x, uint8_t *o) {
    uint8_t L[QK_K];
    k45_levels(x, o, L, 31, -0.5f, 15);
    uint8_t *qh = o + 16, *ql = o + 48;
    memset(qh, 0, 32);
    for (int n = 0, k = 0; n < QK_K; n += 64, k++, ql += 32) {
        for (int j = 0; j < 32; j++) {
            const int l1 = L[n + j], l2 = L[n + j + 32];
            qh[j] |= (uint8_t)(((l1 >> 4) << (2 * k)) | ((l2 >> 4) << (2 * k + 1)));
            ql[j] = (uint8_t)((l1 & 15) | ((l2 & 15) << 4));
        }
    }
}

static void q4_k_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *q = b + 16;
    for (int j = 0; j < 8; j += 2, q += 32) {
        int s, m;
        k4_scale_min(j, b + 4, &s, &m);
        const float d1 = d * s, m1 = dmin * m;
        k4_scale_min(j + 1, b + 4, &s, &m);
        const float d2 = d * s, m2 = dmin * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * (q[l] >> 4) - m2;
    }
}

static void q5_k_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b), dmin = h2f(b + 2);
    const uint8_t *qh = b + 16, *ql = b + 48;
    for (int j = 0, k = 0; j < 8; j += 2, k++, ql += 32) {
        int s, m;
        k4_scale_min(j, b + 4, &s, &m);
        const float d1 = d * s, m1 = dmin * m;
        k4_scale_min(j + 1, b + 4, &s, &m);
        const float d2 = d * s, m2 = dmin * m;
        for (int l = 0; l < 32; l++) *y++ = d1 * ((ql[l] & 0xF) | (((qh[l] >> (2 * k)) & 1) << 4)) - m1;
        for (int l = 0; l < 32; l++) *y++ = d2 * ((ql[l] >> 4) | (((qh[l] >> (2 * k + 1)) & 1) << 4)) - m2;
    }
}

/* ---------------------------------------------------------------- Q6_K */

/* Symmetric fit of n values to levels -nmax..nmax-1 weighted by x^2: start from the level
 * grid that maps the largest |x| to -nmax, then try 18 nearby grids (nmax +- 0.1*k), keeping
 * the least-squares scale with the best weighted fit. L gets level + nmax. */
static float fit_scale_sym(int n, int nmax, const float *x, int8_t *L) {
    float amax = 0, vmax = 0;
    for (int i = 0; i < n; i++) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            vmax = x[i];
        }
    }
    if (amax < GROUP_EPS) {
        memset(L, 0, (size_t)n);
        return 0.0f;
    }
    float iscale = -nmax / vmax;
    float sx = 0, s2 = 0;
    for (int i = 0; i < n; i++) {
        const int l = imax(-nmax, imin(nmax - 1, clover_round_int(iscale * x[i])));
        L[i] = (int8_t)(l + nmax);
        const float w = x[i] * x[i];
        sx += w * x[i] * l;
        s2 += w * l * l;
    }
    float scale = s2 ? sx / s2 : 0.0f;
    float best = scale * sx;
    for (int k = -9; k <= 9; k++) {
        if (k == 0) continue;
        iscale = -(nmax + 0.1f * k) / vmax;
        sx = s2 = 0;
        for (int i = 0; i < n; i++) {
            const int l = imax(-nmax, imin(nmax - 1, clover_round_int(iscale * x[i])));
            const float w = x[i] * x[i];
            sx += w * x[i] * l;
            s2 += w * l * l;
        }
        if (s2 > 0 && sx * sx > best * s2) {
            for (int i = 0; i < n; i++)
                L[i] = (int8_t)(nmax + imax(-nmax, imin(nmax - 1, clover_round_int(iscale * x[i]))));
            scale = sx / s2;
            best = scale * sx;
        }
    }
    return scale;
}

static void q6_k_quant(const float *x, uint8_t *o) {
    int8_t L[QK_K];
    float scales[16];
    float max_scale = 0, max_abs = 0;
    for (int ib = 0; ib < 16; ib++) {
        scales[ib] = fit_scale_sym(16, 32, x + 16 * ib, L + 16 * ib);
        if (fabsf(scales[ib]) > max_abs) {
            max_abs = fabsf(scales[ib]);
            max_scale = scales[ib];
        }
    }
    uint8_t *ql = o, *qh = o + 128;
    int8_t *sc = (int8_t *)(o + 192);
    if (max_abs < GROUP_EPS) {
        memset(o, 0, 210);
        return;
    }
    const float iscale = -128.f / max_scale;
    f2h(o + 208, 1 / iscale);
    for (int ib = 0; ib < 16; ib++) sc[ib] = (int8_t)imin(127, clover_round_int(iscale * scales[ib]));
    const float d = h2f(o + 208);
    for (int j = 0; j < 16; j++) {
        const float dl = d * sc[j];
        if (dl == 0.0f) continue;
        for (int i = 0; i < 16; i++)
            L[16 * j + i] = (int8_t)(imax(-32, imin(31, clover_round_int(x[16 * j + i] / dl))) + 32);
    }
    for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32) {
        for (int l = 0; l < 32; l++) {
            const uint8_t a = (uint8_t)L[j + l], b = (uint8_t)L[j + l + 32], c = (uint8_t)L[j + l + 64],
                          e = (uint8_t)L[j + l + 96];
            ql[l] = (uint8_t)((a & 0xF) | ((c & 0xF) << 4));
            ql[l + 32] = (uint8_t)((b & 0xF) | ((e & 0xF) << 4));
            qh[l] = (uint8_t)((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6));
        }
    }
}

static void q6_k_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b + 208);
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    for (int n = 0; n < QK_K; n += 128, y += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
            const int is = l / 16;
            const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
            const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
            const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            y[l] = d * sc[is] * q1;
            y[l + 32] = d * sc[is + 2] * q2;
            y[l + 64] = d * sc[is + 4] * q3;
            y[l + 96] = d * sc[is + 6] * q4;
        }
    }
}

/* ---------------------------------------------------------------- IQ4_NL / IQ4_XS */

/* Scale of one 32-value group against the non-linear table (weights x^2). ntry < 0: one
 * least-squares refit of the grid that maps the largest |x| onto table[0] (IQ4_NL reference);
 * ntry > 0: also try the 2*ntry+1 grids (table[0] + k)/max and keep the best. L gets the
 * indices of the first grid. Returns the group scale (0 for an all-zero group). */
static float iq4_group(const float *xb, uint8_t *Lb, int ntry) {
    float amax = 0, vmax = 0;
    for (int j = 0; j < 32; j++) {
        if (fabsf(xb[j]) > amax) {
            amax = fabsf(xb[j]);
            vmax = xb[j];
        }
    }
    if (amax < GROUP_EPS) return 0.0f;
    float d = ntry > 0 ? -vmax / clover_kv_iq4nl[0] : vmax / clover_kv_iq4nl[0];
    float id = 1 / d;
    float sqx = 0, sq2 = 0;
    for (int j = 0; j < 32; j++) {
        const int l = nearest_index(16, clover_kv_iq4nl, id * xb[j]);
        Lb[j] = (uint8_t)l;
        const float q = clover_kv_iq4nl[l], w = xb[j] * xb[j];
        sqx += w * q * xb[j];
        sq2 += w * q * q;
    }
    d = sq2 > 0 ? sqx / sq2 : 0.f;
    float best = d * sqx;
    for (int t = -ntry; t <= ntry; t++) {
        id = (t + clover_kv_iq4nl[0]) / vmax;
        sqx = sq2 = 0;
        for (int j = 0; j < 32; j++) {
            const float q = clover_kv_iq4nl[nearest_index(16, clover_kv_iq4nl, id * xb[j])], w = xb[j] * xb[j];
            sqx += w * q * xb[j];
            sq2 += w * q * q;
        }
        if (sq2 > 0 && sqx * sqx > best * sq2) {
            d = sqx / sq2;
            best = d * sqx;
        }
    }
    return d;
}

static void pack_nibbles32(const uint8_t *L, uint8_t *q, int nsub) {
    for (int i = 0; i < nsub; i++)
        for (int j = 0; j < 16; j++) q[16 * i + j] = (uint8_t)(L[32 * i + j] | (L[32 * i + 16 + j] << 4));
}

static void iq4_nl_quant(const float *x, uint8_t *o) {
    uint8_t L[32] = {0};
    const float d = iq4_group(x, L, -1);
    f2h(o, d);
    pack_nibbles32(L, o + 2, 1);
}

static void iq4_nl_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * clover_kv_iq4nl[b[2 + j] & 0xF];
        y[j + 16] = d * clover_kv_iq4nl[b[2 + j] >> 4];
    }
}

static void iq4_xs_quant(const float *x, uint8_t *o) {
    uint8_t L[QK_K] = {0};
    float scales[8];
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < 8; ib++) {
        scales[ib] = iq4_group(x + 32 * ib, L + 32 * ib, 7);
        if (fabsf(scales[ib]) > amax_scale) {
            amax_scale = fabsf(scales[ib]);
            max_scale = scales[ib];
        }
    }
    const float d = -max_scale / 32;
    f2h(o, d);
    const float id = d != 0.0f ? 1 / d : 0.f;
    uint16_t sh = 0;
    uint8_t *sl = o + 4;
    memset(sl, 0, 4);
    for (int ib = 0; ib < 8; ib++) {
        const int l = imax(-32, imin(31, clover_round_int(id * scales[ib])));
        const float dl = d * l;
        const float idl = dl != 0.0f ? 1 / dl : 0.f;
        for (int j = 0; j < 32; j++) L[32 * ib + j] = (uint8_t)nearest_index(16, clover_kv_iq4nl, idl * x[32 * ib + j]);
        const int u = l + 32;
        sl[ib / 2] |= (uint8_t)((u & 0xF) << (4 * (ib % 2)));
        sh |= (uint16_t)((u >> 4) << (2 * ib));
    }
    memcpy(o + 2, &sh, 2);
    pack_nibbles32(L, o + 8, 8);
}

static void iq4_xs_dequant(const uint8_t *b, float *y) {
    const float d = h2f(b);
    uint16_t sh;
    memcpy(&sh, b + 2, 2);
    const uint8_t *q = b + 8;
    for (int ib = 0; ib < 8; ib++, y += 32, q += 16) {
        const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
        const float dl = d * (ls - 32);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * clover_kv_iq4nl[q[j] & 0xF];
            y[j + 16] = dl * clover_kv_iq4nl[q[j] >> 4];
        }
    }
}

/* ---------------------------------------------------------------- MXFP4 */

/* Half of 2^(e-127) (the codes are doubled E2M1 values), subnormal for e < 2. */
CLOVER_INTERNAL float clover_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static void mxfp4_quant(const float *x, uint8_t *o) {
    float amax = 0;
    for (int j = 0; j < 32; j++)
        if (fabsf(x[j]) > amax) amax = fabsf(x[j]);
    /* exponent so that amax lands in the top code range; ggml casts the float to uint8 */
    const uint8_t e = amax > 0.0f ? (uint8_t)(int)(floorf(log2f(amax)) - 2 + 127) : 0;
    const float d = clover_e8m0_half(e);
    o[0] = e;
    for (int j = 0; j < 16; j++) {
        int q[2];
        for (int h = 0; h < 2; h++) {
            const float v = x[j + 16 * h];
            int bi = 0;
            float be = fabsf(clover_kv_mxfp4[0] * d - v);
            for (int i = 1; i < 16; i++) {
                const float err = fabsf(clover_kv_mxfp4[i] * d - v);
                if (err < be) {
                    bi = i;
                    be = err;
                }
            }
            q[h] = bi;
        }
        o[1 + j] = (uint8_t)(q[0] | (q[1] << 4));
    }
}

static void mxfp4_dequant(const uint8_t *b, float *y) {
    const float d = clover_e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = clover_kv_mxfp4[b[1 + j] & 0xF] * d;
        y[j + 16] = clover_kv_mxfp4[b[1 + j] >> 4] * d;
    }
}

/* ---------------------------------------------------------------- Q8_K */

static void q8_k_quant_scalar(const float *x, uint8_t *o) {
    float amax = 0, vmax = 0;
    int bad = 0;
    for (int j = 0; j < QK_K; j++) {
        bad |= !isfinite(x[j]);
        if (fabsf(x[j]) > amax) {
            amax = fabsf(x[j]);
            vmax = x[j];
        }
    }
    int8_t *qs = (int8_t *)(o + 4);
    if (bad) { /* NaN/Inf in: a NaN scale, so products come out NaN and the forward's guard sees them */
        const float d = NAN;
        memset(o, 0, 292);
        memcpy(o, &d, 4);
        return;
    }
    if (amax == 0.0f) {
        memset(o, 0, 292);
        return;
    }
    const float iscale = -127.f / vmax;
    for (int j = 0; j < QK_K; j++) qs[j] = (int8_t)imin(127, clover_round_int(iscale * x[j]));
    for (int j = 0; j < 16; j++) {
        int16_t s = 0;
        for (int i = 0; i < 16; i++) s = (int16_t)(s + qs[16 * j + i]);
        memcpy(o + 260 + 2 * j, &s, 2);
    }
    const float d = 1 / iscale;
    memcpy(o, &d, 4);
}

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
/* The same bytes with AVX-512: the first element of largest |x| (vmax) found by a compare on
 * the vector maximum; cvtps rounds to nearest, ties to even, as round_int; |q| <= 127 by
 * construction, so the saturating narrow is exact; one 16-lane vector is one bsums group. */
__attribute__((target("avx512f,avx512bw"))) static void q8_k_quant_avx512(const float *x, uint8_t *o) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 bad = 0; /* lanes holding NaN or Inf (x * 0 is NaN exactly for those) */
    for (int c = 0; c < 16; c++) {
        const __m512 v = _mm512_loadu_ps(x + 16 * c);
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
        bad |= _mm512_cmp_ps_mask(_mm512_mul_ps(v, _mm512_setzero_ps()), _mm512_setzero_ps(), _CMP_NEQ_UQ);
    }
    const float amax = _mm512_reduce_max_ps(m);
    /* zero block, or NaN/Inf input: the scalar path's bytes (converting NaN to int32 here gives
     * INT_MIN lanes whose sum overflows; found by the fuzz harness) */
    if (!(amax > 0.0f) || bad) {
        q8_k_quant_scalar(x, o);
        return;
    }
    float vmax = 0;
    const __m512 va = _mm512_set1_ps(amax);
    for (int c = 0; c < 16; c++) {
        const __mmask16 k = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_loadu_ps(x + 16 * c)), va, _CMP_EQ_OQ);
        if (k) {
            vmax = x[16 * c + __builtin_ctz(k)];
            break;
        }
    }
    const float iscale = -127.f / vmax;
    const __m512 vs = _mm512_set1_ps(iscale);
    int8_t *qs = (int8_t *)(o + 4);
    for (int c = 0; c < 16; c++) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(vs, _mm512_loadu_ps(x + 16 * c)));
        _mm_storeu_si128((__m128i *)(qs + 16 * c), _mm512_cvtsepi32_epi8(_mm512_min_epi32(q, _mm512_set1_epi32(127))));
        const int16_t bs = (int16_t)_mm512_reduce_add_epi32(q);
        memcpy(o + 260 + 2 * c, &bs, 2);
    }
    const float d = 1 / iscale;
    memcpy(o, &d, 4);
}
/* The same bytes with AVX2: as the AVX-512 one above, 8 lanes a vector; the int32 q of 16
 * values (two vectors, one bsums group) narrow with packs (exact: |q| <= 127) and are summed. */
__attribute__((target("avx2,fma"))) static void q8_k_quant_avx2(const float *x, uint8_t *o) {
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    __m256 m = zero;
    int bad = 0; /* lanes holding NaN or Inf (x * 0 is NaN exactly for those) */
    for (int c = 0; c < 32; c++) {
        const __m256 v = _mm256_loadu_ps(x + 8 * c);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
        bad |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_mul_ps(v, zero), zero, _CMP_NEQ_UQ));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
    if (!(amax > 0.0f) || bad) { /* zero block, or NaN/Inf input: the scalar path's bytes */
        q8_k_quant_scalar(x, o);
        return;
    }
    float vmax = 0;
    const __m256 va = _mm256_set1_ps(amax);
    for (int c = 0; c < 32; c++) {
        const int k = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * c)), va, _CMP_EQ_OQ));
        if (k) {
            vmax = x[8 * c + __builtin_ctz((unsigned)k)];
            break;
        }
    }
    const float iscale = -127.f / vmax;
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127);
    int8_t *qs = (int8_t *)(o + 4);
    for (int g = 0; g < 16; g++) {
        const __m256i q0 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 16 * g))), cap);
        const __m256i q1 = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(x + 16 * g + 8))), cap);
        const __m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
        const __m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));
        _mm_storeu_si128((__m128i *)(qs + 16 * g), _mm_packs_epi16(w0, w1));
        __m128i t = _mm_add_epi32(_mm_add_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1)),
                                  _mm_add_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1)));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4e));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xb1));
        const int16_t bs = (int16_t)_mm_cvtsi128_si32(t);
        memcpy(o + 260 + 2 * g, &bs, 2);
    }
    const float d = 1 / iscale;
    memcpy(o, &d, 4);
}
#endif

/* Q8_K (ggml quantize_row_q8_K_ref, which llama.cpp also runs on x86): d = max / -127 of the
 * first element of largest |x|, q = nearest-even(x * -127 / max), bsums per 16. */
static void q8_k_quant(const float *x, uint8_t *o) {
#if defined(__x86_64__) || defined(__i386__)
    static int isa = -1; /* benign race: every thread computes the same value */
    if (isa < 0) isa = clover_dot_best_isa();
    if (isa >= CLOVER_ISA_AVX512) {
        q8_k_quant_avx512(x, o);
        return;
    }
    if (isa == CLOVER_ISA_AVX2) {
        q8_k_quant_avx2(x, o);
        return;
    }
#endif
    q8_k_quant_scalar(x, o);
}

static void q8_k_dequant(const uint8_t *b, float *y) {
    float d;
    memcpy(&d, b, 4);
    const int8_t *qs = (const int8_t *)(b + 4);
    for (int j = 0; j < QK_K; j++) y[j] = d * qs[j];
}

/* ---------------------------------------------------------------- dispatch */

typedef struct {
    int type, block, bytes;
    void (*quant)(const float *, uint8_t *);
    void (*dequant)(const uint8_t *, float *);
} kq_format;

static const kq_format FORMATS[] = {
    {CLOVER_TYPE_Q4_0, 32, 18, q4_0_quant, q4_0_dequant},
    {CLOVER_TYPE_Q2_K, QK_K, 84, clover_q2_k_quant, clover_q2_k_dequant},
    {CLOVER_TYPE_Q3_K, QK_K, 110, clover_q3_k_quant, clover_q3_k_dequant},
    {CLOVER_TYPE_Q4_K, QK_K, 144, q4_k_quant, q4_k_dequant},
    {CLOVER_TYPE_Q5_K, QK_K, 176, q5_k_quant, q5_k_dequant},
    {CLOVER_TYPE_Q6_K, QK_K, 210, q6_k_quant, q6_k_dequant},
    {CLOVER_TYPE_Q8_K, QK_K, 292, q8_k_quant, q8_k_dequant},
    {CLOVER_TYPE_IQ4_NL, 32, 18, iq4_nl_quant, iq4_nl_dequant},
    {CLOVER_TYPE_IQ4_XS, QK_K, 136, iq4_xs_quant, iq4_xs_dequant},
    {CLOVER_TYPE_MXFP4, 32, 17, mxfp4_quant, mxfp4_dequant},
};

static const kq_format *find_format(int type) {
    for (size_t i = 0; i < sizeof FORMATS / sizeof FORMATS[0]; i++)
        if (FORMATS[i].type == type) return &FORMATS[i];
    return NULL;
}

CLOVER_INTERNAL int64_t clover_kq_nbytes(int type, int64_t n) {
    const kq_format *f = find_format(type);
    if (f == NULL || n < 0 || n % f->block != 0) return -1;
    return (n / f->block) * f->bytes; /* bytes/values <= 292/256 < 2: no overflow */
}

CLOVER_INTERNAL int clover_kq_to_f32(int type, const void *src, float *dst, int64_t n) {
    const kq_format *f = find_format(type);
    if (f == NULL || n < 0 || n % f->block != 0) return CLOVER_E_ARG;
    if (n > 0 && (src == NULL || dst == NULL)) return CLOVER_E_ARG;
    const uint8_t *s = (const uint8_t *)src;
    for (int64_t b = 0; b < n / f->block; b++) f->dequant(s + b * f->bytes, dst + b * f->block);
    return CLOVER_OK;
}

CLOVER_INTERNAL int64_t clover_kq_from_f32(int type, const float *src, void *dst, int64_t n) {
    const int64_t nbytes = clover_kq_nbytes(type, n);
    if (nbytes < 0 || (n > 0 && (src == NULL || dst == NULL))) return CLOVER_E_ARG;
    const kq_format *f = find_format(type);
    uint8_t *d = (uint8_t *)dst;
    for (int64_t b = 0; b < n / f->block; b++) f->quant(src + b * f->block, d + b * f->bytes);
    return nbytes;
}
