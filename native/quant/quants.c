/* quants.c: the weight formats F32, F16, BF16 and Q8_0 of the CPU engine (clover-spec 6):
 * scalar and row conversions to and from float32.
 *
 * Formats are the ggml ones, so bytes written here equal those of gguf-py's
 * gguf.quants.quantize and of ggml's reference quantize_row_q8_0_ref:
 *   F16  IEEE binary16, round to nearest even (subnormals, inf and NaN exact).
 *   BF16 the top 16 bits of binary32, round to nearest even, NaN forced quiet.
 *   Q8_0 blocks of 32: fp16 scale d = amax/127, then 32 int8 q = roundf(x/d); value = d*q.
 * The matrix products over these formats are quant/matmul.c.
 *
 * Build without -ffast-math: the Q8_0 rounding and the fp16/bf16 conversions rely on exact
 * IEEE float arithmetic.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "clover.h"
#include "quant/quants.h"


/* ---------------------------------------------------------------- scalar conversions */

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t fp32_to_fp16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {
        /* NaN: quiet, keep the top payload bits */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    }
    if (ax >= 0x38800000u) {
        /* |f| >= 2^-14 (fp16 normal range or overflow): rebias, round the 13 dropped
         * mantissa bits to nearest even; a carry may move into the exponent, and anything
         * at or above 65520 ends at 0x7c00 (inf). */
        uint32_t m = ax - (112u << 23);
        m += 0x0fffu + ((m >> 13) & 1u);
        m >>= 13;
        return (uint16_t)(sign | (m >= 0x7c00u ? 0x7c00u : m));
    }
    /* fp16 subnormal or zero: |f| * 2^24 < 1024 is exact; round it to an integer, ties to
     * even (the 2^23 trick is exact under the default rounding mode). 1024 is the smallest
     * normal, which is also the right encoding. */
    const float v = bits_f32(ax) * 0x1p24f;
    const float r = (v + 0x1p23f) - 0x1p23f;
    return (uint16_t)(sign | (uint16_t)r);
}

static inline float bf16_to_fp32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

static inline uint16_t fp32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16); /* no overflow: x < 0xff800001 */
}

CLOVER_INTERNAL float clover_fp16_to_fp32(uint16_t h) { return clover_h2f(h); }
CLOVER_INTERNAL uint16_t clover_fp32_to_fp16(float f) { return fp32_to_fp16(f); }
CLOVER_INTERNAL float clover_bf16_to_fp32(uint16_t h) { return bf16_to_fp32(h); }
CLOVER_INTERNAL uint16_t clover_fp32_to_bf16(float f) { return fp32_to_bf16(f); }

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Row conversions in groups of 8 with a constant inner trip count, which GCC vectorises
 * even at -O2 (its "very cheap" cost model rejects loops that need an epilogue). */
void clover_f16_row_to_f32(const uint8_t *restrict src, float *restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16_t h[8];
        memcpy(h, src + 2 * i, sizeof h);
        for (int l = 0; l < 8; l++) dst[i + l] = clover_h2f(h[l]);
    }
    for (; i < n; i++) dst[i] = clover_h2f(load_u16(src + 2 * i));
}

void clover_bf16_row_to_f32(const uint8_t *restrict src, float *restrict dst, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint16_t h[8];
        memcpy(h, src + 2 * i, sizeof h);
        for (int l = 0; l < 8; l++) dst[i + l] = bf16_to_fp32(h[l]);
    }
    for (; i < n; i++) dst[i] = bf16_to_fp32(load_u16(src + 2 * i));
}

/* ---------------------------------------------------------------- Q8_0 (ggml block_q8_0) */

/* One block of 32 values, exactly as ggml's quantize_row_q8_0_ref (and gguf-py's Q8_0). */
static void quantize_block_q8_0(const float *x, uint8_t *out) {
    float amax = 0.0f;
    for (int j = 0; j < CLOVER_QK8_0; j++) {
        const float v = fabsf(x[j]);
        amax = amax > v ? amax : v;
    }
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = fp32_to_fp16(d);
    memcpy(out, &dh, sizeof dh);
    int8_t *qs = (int8_t *)(out + 2);
    for (int j = 0; j < CLOVER_QK8_0; j++) {
        /* |x*id| <= 127 for finite input; a subnormal d makes id = inf and x*id inf/NaN, which
         * ggml leaves to the float->int conversion (x86 yields 0): keep that, but defined. */
        const float r = roundf(x[j] * id);
        qs[j] = (r >= -128.0f && r <= 127.0f) ? (int8_t)r : 0;
    }
}

static void dequantize_block_q8_0(const uint8_t *in, float *y) {
    const float d = clover_h2f(load_u16(in));
    const int8_t *qs = (const int8_t *)(in + 2);
    for (int j = 0; j < CLOVER_QK8_0; j++) y[j] = (float)qs[j] * d;
}

/* ---------------------------------------------------------------- public conversions */

/* Bytes of n values of a storage format: F32, F16, BF16, Q8_0 here, the block formats of
 * kquants.c otherwise; -1 for another type, a negative n or a Q8_0 row not a multiple of 32. */
static int64_t format_nbytes(int type, int64_t n_in) {
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
        return clover_kq_nbytes(type, n_in);
    }
}

/* Bytes of n values of `type` in its storage format (clover.h). */
int64_t clover_type_nbytes(int type, int64_t n) { return format_nbytes(type, n); }

int clover_to_f32(int type, const void *src, float *dst, int64_t n) {
    if (n < 0 || (n > 0 && (src == NULL || dst == NULL))) return CLOVER_E_ARG;
    const uint8_t *s = (const uint8_t *)src;
    switch (type) {
    case CLOVER_TYPE_F32:
        if (n > 0) memmove(dst, src, (size_t)n * sizeof(float));
        return CLOVER_OK;
    case CLOVER_TYPE_F16:
        clover_f16_row_to_f32(s, dst, n);
        return CLOVER_OK;
    case CLOVER_TYPE_BF16:
        clover_bf16_row_to_f32(s, dst, n);
        return CLOVER_OK;
    case CLOVER_TYPE_Q8_0:
        if (n % CLOVER_QK8_0 != 0) return CLOVER_E_ARG;
        for (int64_t b = 0; b < n / CLOVER_QK8_0; b++)
            dequantize_block_q8_0(s + b * Q8_0_BYTES, dst + b * CLOVER_QK8_0);
        return CLOVER_OK;
    default:
        return clover_kq_to_f32(type, src, dst, n); /* kquants.c; CLOVER_E_ARG if unknown */
    }
}

int64_t clover_from_f32(int type, const float *src, void *dst, int64_t n) {
    if (clover_kq_nbytes(type, 0) >= 0) return clover_kq_from_f32(type, src, dst, n); /* kquants.c */
    const int64_t nbytes = format_nbytes(type, n);
    if (nbytes < 0 || (n > 0 && (src == NULL || dst == NULL))) return CLOVER_E_ARG;
    uint8_t *d = (uint8_t *)dst;
    switch (type) {
    case CLOVER_TYPE_F32:
        if (n > 0) memmove(dst, src, (size_t)n * sizeof(float));
        break;
    case CLOVER_TYPE_F16:
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = fp32_to_fp16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
        break;
    case CLOVER_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = fp32_to_bf16(src[i]);
            memcpy(d + 2 * i, &h, 2);
        }
        break;
    case CLOVER_TYPE_Q8_0:
        for (int64_t b = 0; b < n / CLOVER_QK8_0; b++)
            quantize_block_q8_0(src + b * CLOVER_QK8_0, d + b * Q8_0_BYTES);
        break;
    default:
        return CLOVER_E_ARG;
    }
    return nbytes;
}

