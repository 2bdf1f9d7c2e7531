/* quants.h: internal weight formats of the CPU engine (not public API); the products over them
 * are quant/matmul.h.
 *
 * Weight matrices are stored as in GGUF/ggml: n_out rows of n_in elements, each row
 * contiguous in its storage type (F32, F16, BF16, Q8_0). Activations are float32.
 * Q8_0 (ggml block_q8_0): blocks of 32 values, one fp16 scale d then 32 int8 q, value = d*q.
 * Q8_0 weights are multiplied against activations quantised once per input row to Q8_0
 * (as llama.cpp pairs them), with int32 block sums.
 */
#ifndef CLOVER_QUANTS_H
#define CLOVER_QUANTS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CLOVER_QK8_0 32

/* Hot float loops (GDN recurrences, attention rows, activation quantisation) get an AVX2+FMA
 * clone chosen at load time where GCC supports it; the default clone stays portable.
 * CLOVER_INLINE helpers are compiled into each clone of their caller. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define CLOVER_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLOVER_CLONES
#endif
#if defined(__GNUC__)
#define CLOVER_INLINE static inline __attribute__((always_inline))
#else
#define CLOVER_INLINE static inline
#endif

/* The internal kernels are exported with default visibility too, so that tests can reach them
 * (clover_matmul, the k-quant tables) through their own cdef even when the library is built
 * with -fvisibility=hidden. */
#if defined(_WIN32)
#define CLOVER_INTERNAL
#else
#define CLOVER_INTERNAL __attribute__((visibility("default")))
#endif

typedef struct {
    uint16_t d; /* fp16 scale */
    int8_t qs[CLOVER_QK8_0];
} clover_block_q8_0;
#define Q8_0_BYTES ((int64_t)sizeof(clover_block_q8_0)) /* 34: fp16 d + 32 int8 */

/* fp16 bits to float, exact for every value (NaN payloads kept); branch-free, so loops over rows
 * vectorise where it is inlined (quants.c's row conversions, dot.c's scalar F16 kernels). */
CLOVER_INLINE float clover_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;                           /* exponent and mantissa */
    const uint32_t normal = (em << 13) + ((127u - 15u) << 23); /* rebias the exponent */
    const uint32_t infnan = (em << 13) | 0x7f800000u;          /* inf, NaN (payload kept) */
    const float subf = (float)(int32_t)em * 0x1p-24f;          /* zero/subnormal: exact */
    uint32_t sub, bits;
    memcpy(&sub, &subf, sizeof sub);
    const uint32_t m_sub = 0u - (uint32_t)(em < 0x0400u);  /* all ones when subnormal */
    const uint32_t m_inf = 0u - (uint32_t)(em >= 0x7c00u); /* all ones when inf/NaN */
    bits = sign | (sub & m_sub) | (infnan & m_inf) | (normal & ~(m_sub | m_inf));
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

float clover_fp16_to_fp32(uint16_t h);
uint16_t clover_fp32_to_fp16(float f);
float clover_bf16_to_fp32(uint16_t h);
uint16_t clover_fp32_to_bf16(float f); /* round to nearest even, NaN kept quiet */

/* Row conversions of n fp16 / bf16 values (IEEE binary16 / bfloat16 bits) to float32, exact
 * (quants.c; used by clover_to_f32 and quant/matmul.c). */
void clover_f16_row_to_f32(const uint8_t *restrict src, float *restrict dst, int64_t n);
void clover_bf16_row_to_f32(const uint8_t *restrict src, float *restrict dst, int64_t n);

/* Block formats of kquants.c (Q4_0, Q4_K, Q5_K, Q6_K, Q8_K, IQ4_NL, IQ4_XS, MXFP4; Q2_K and
 * Q3_K of kquants23.c; ggml layouts and ggml's reference quantisers). n must be a multiple of the block size (32 for
 * Q4_0/IQ4_NL/MXFP4, 256 for the others).
 * clover_kq_nbytes: bytes of n values, -1 for other types or a bad n.
 * clover_kq_to_f32 / clover_kq_from_f32: as clover_to_f32 / clover_from_f32 for these types
 * only (CLOVER_E_ARG for any other type). All but Q8_K (activations only) are engine weight
 * types too: clover_row_nbytes (quant/matmul.h) accepts those that have a dot kernel (quant/dot.h). */
int64_t clover_kq_nbytes(int type, int64_t n);
/* ggml's IQ4_NL and MXFP4 code tables and the MXFP4 block scale (half of 2^(e-127)). */
extern const int8_t clover_kv_iq4nl[16];
extern const int8_t clover_kv_mxfp4[16];
float clover_e8m0_half(uint8_t e);
int clover_kq_to_f32(int type, const void *src, float *dst, int64_t n);
int64_t clover_kq_from_f32(int type, const float *src, void *dst, int64_t n);

/* Round to the nearest integer, ties to even, for |f| <= 2^22 - 1 (ggml nearest_int): adding
 * 1.5 * 2^23 puts the integer part in the low mantissa bits (defined, if meaningless, for other
 * inputs). */
CLOVER_INLINE int clover_round_int(float f) {
    const float v = f + 12582912.0f;
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's make_qkx2_quants (kquants.c): the weighted asymmetric fit of n <= 32 values to levels
 * 0..nmax shared by Q2_K, Q4_K and Q5_K; mad: absolute rather than squared errors. */
float clover_fit_scale_min(int n, int nmax, const float *x, const float *w, uint8_t *L, float *min_out, float rmin,
                           float rdelta, int nstep, int mad);

/* One block of 256 values of Q2_K (84 bytes) or Q3_K (110 bytes) from / to float (kquants23.c). */
void clover_q2_k_quant(const float *x, uint8_t *o);
void clover_q2_k_dequant(const uint8_t *b, float *y);
void clover_q3_k_quant(const float *x, uint8_t *o);
void clover_q3_k_dequant(const uint8_t *b, float *y);

#endif
