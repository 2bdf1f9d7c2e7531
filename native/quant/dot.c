/* dot.c: kernel dispatch and the portable scalar kernels of the Q8_0-paired weight types
 * (Q8_0, Q4_0, IQ4_NL, MXFP4), the reference every SIMD kernel is tested against.
 * Block layouts are ggml's (see kquants.c); the sums follow ggml's generic vec_dot kernels:
 * per block an exact int32 sum of weight codes times activation quants, then one float
 * multiply by both scales.
 */
#include "quant/dot.h"

#include "clover.h"
#include "quant/quants.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* ---------------------------------------------------------------- scalar kernels */

static float dot_q8_0(int64_t n, const void *w, const void *xq) {
    const uint8_t *wb = w;
    const clover_block_q8_0 *x = xq;
    float sum = 0;
    for (int64_t b = 0; b < n / 32; b++, wb += 34) {
        const int8_t *qw = (const int8_t *)(wb + 2);
        int32_t isum = 0;
        for (int j = 0; j < 32; j++) isum += qw[j] * x[b].qs[j];
        sum += (float)isum * (clover_fp16_to_fp32(load_u16(wb)) * clover_fp16_to_fp32(x[b].d));
    }
    return sum;
}

static float dot_q4_0(int64_t n, const void *w, const void *xq) {
    const uint8_t *wb = w;
    const clover_block_q8_0 *x = xq;
    float sum = 0;
    for (int64_t b = 0; b < n / 32; b++, wb += 18) {
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            isum += ((wb[2 + j] & 15) - 8) * x[b].qs[j];
            isum += ((wb[2 + j] >> 4) - 8) * x[b].qs[j + 16];
        }
        sum += (float)isum * (clover_fp16_to_fp32(load_u16(wb)) * clover_fp16_to_fp32(x[b].d));
    }
    return sum;
}

/* IQ4_NL (fp16 scale) and MXFP4 (E8M0 scale) share the nibble-table form. */
static int32_t table_isum(const uint8_t *qs, const int8_t *table, const int8_t *x) {
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) {
        isum += table[qs[j] & 15] * x[j];
        isum += table[qs[j] >> 4] * x[j + 16];
    }
    return isum;
}

static float dot_iq4_nl(int64_t n, const void *w, const void *xq) {
    const uint8_t *wb = w;
    const clover_block_q8_0 *x = xq;
    float sum = 0;
    for (int64_t b = 0; b < n / 32; b++, wb += 18)
        sum += (float)table_isum(wb + 2, clover_kv_iq4nl, x[b].qs) *
               (clover_fp16_to_fp32(load_u16(wb)) * clover_fp16_to_fp32(x[b].d));
    return sum;
}

static float dot_mxfp4(int64_t n, const void *w, const void *xq) {
    const uint8_t *wb = w;
    const clover_block_q8_0 *x = xq;
    float sum = 0;
    for (int64_t b = 0; b < n / 32; b++, wb += 17)
        sum += (float)table_isum(wb + 1, clover_kv_mxfp4, x[b].qs) *
               (clover_e8m0_half(wb[0]) * clover_fp16_to_fp32(x[b].d));
    return sum;
}

clover_vec_dot_fn clover_dot_scalar(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0: return dot_q8_0;
    case CLOVER_TYPE_Q4_0: return dot_q4_0;
    case CLOVER_TYPE_IQ4_NL: return dot_iq4_nl;
    case CLOVER_TYPE_MXFP4: return dot_mxfp4;
    default: return clover_dot_k_scalar(type);
    }
}

/* ---------------------------------------------------------------- dispatch */

int clover_dot_act_type(int type) {
    switch (type) {
    case CLOVER_TYPE_Q8_0:
    case CLOVER_TYPE_Q4_0:
    case CLOVER_TYPE_IQ4_NL:
    case CLOVER_TYPE_MXFP4: return CLOVER_TYPE_Q8_0;
    case CLOVER_TYPE_Q2_K:
    case CLOVER_TYPE_Q3_K:
    case CLOVER_TYPE_Q4_K:
    case CLOVER_TYPE_Q5_K:
    case CLOVER_TYPE_Q6_K:
    case CLOVER_TYPE_IQ4_XS: return CLOVER_TYPE_Q8_K;
    default: return -1;
    }
}

/* Q8_0 activation quantisation as llama.cpp runs it on x86 (ggml-cpu arch/x86/quants.c
 * quantize_row_q8_0): d = amax/127 stored as fp16, q = rint(x * (127/amax)), ties to even.
 * It differs from the reference quantiser (roundf(x * (1/d)), used for weights, where bytes
 * must equal gguf-py's) in the last bit of x*id and in ties, which is enough to move an
 * activation across a rounding boundary; matching it keeps us comparable with llama.cpp. */
CLOVER_CLONES static int64_t quantize_act_q8_0(const float *x, void *dst, int64_t n) {
    if (n % CLOVER_QK8_0) return -1;
    uint8_t *o = (uint8_t *)dst;
    for (int64_t b = 0; b < n / CLOVER_QK8_0; b++, x += CLOVER_QK8_0, o += 34) {
        float amax = 0.0f;
        int bad = 0;
        for (int j = 0; j < CLOVER_QK8_0; j++) {
            const float v = fabsf(x[j]);
            bad |= !(v <= FLT_MAX);
            amax = amax > v ? amax : v;
        }
        if (bad) { /* NaN/Inf in: a NaN scale (fp16 0x7e00), so products come out NaN for the guard */
            const uint16_t nan16 = 0x7e00;
            memcpy(o, &nan16, 2);
            memset(o + 2, 0, CLOVER_QK8_0);
            continue;
        }
        const uint16_t dh = clover_fp32_to_fp16(amax / 127.0f);
        memcpy(o, &dh, 2);
        const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int8_t *q = (int8_t *)(o + 2);
        for (int j = 0; j < CLOVER_QK8_0; j++) {
            const float r = rintf(x[j] * id);
            q[j] = (r >= -128.0f && r <= 127.0f) ? (int8_t)r : 0;
        }
    }
    return (n / CLOVER_QK8_0) * 34;
}

int64_t clover_quantize_act(int act_type, const float *x, void *dst, int64_t n) {
    if (act_type == CLOVER_TYPE_Q8_0) return quantize_act_q8_0(x, dst, n);
    if (act_type == CLOVER_TYPE_Q8_K) return clover_kq_from_f32(CLOVER_TYPE_Q8_K, x, dst, n);
    return -1;
}

static int detect_isa(void) {
    int isa = CLOVER_ISA_SCALAR;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        isa = CLOVER_ISA_AVX2;
    if (isa == CLOVER_ISA_AVX2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
        isa = CLOVER_ISA_AVX512;
#endif
    const char *env = getenv("CLOVER_ISA"); /* lower it for tests and comparisons */
    if (env) {
        int want = strcmp(env, "scalar") == 0 ? CLOVER_ISA_SCALAR
                   : strcmp(env, "avx2") == 0 ? CLOVER_ISA_AVX2
                                              : CLOVER_ISA_AVX512;
        if (want < isa) isa = want;
    }
    return isa;
}

int clover_dot_best_isa(void) {
    static int cached = -1; /* benign race: every thread computes the same value */
    if (cached < 0) cached = detect_isa();
    return cached;
}

clover_vec_dot_fn clover_dot_kernel(int type, int isa) {
    const int best = clover_dot_best_isa();
    if (isa < 0) isa = best;
    if (isa > best) return NULL;
    clover_vec_dot_fn f = NULL;
    /* fall back to the next narrower ISA where a type has no kernel at the asked one */
    if (isa >= CLOVER_ISA_AVX512) f = clover_dot_avx512(type);
    if (!f && isa >= CLOVER_ISA_AVX2) f = clover_dot_avx2(type);
    if (!f) f = clover_dot_scalar(type);
    return f;
}

int clover_dot4_packed(int type) {
    if (clover_dot_best_isa() < CLOVER_ISA_AVX512) /* the AVX2 kernels: split Q8_0, paired or plain Q8_K */
        return clover_dot_act_type(type) == CLOVER_TYPE_Q8_0                ? 3
               : type == CLOVER_TYPE_Q4_K || type == CLOVER_TYPE_Q5_K ? 4
                                                                            : 0;
    if (clover_dot_act_type(type) == CLOVER_TYPE_Q8_0) return 1;
    return type == CLOVER_TYPE_Q4_K || type == CLOVER_TYPE_Q5_K ? 2 : 0;
}

/* The scale and the sums of 32 values (at most 32 * 128, an int16) of a Q8_K block in a
 * reordered layout (the sums of 16 of the block pairwise, the upper 8 zero). */
static void q8_K_sums32(const clover_block_q8_K *in, clover_block_q8_K *out) {
    out->d = in->d;
    for (int k = 0; k < 16; k++) out->bsums[k] = k < 8 ? (int16_t)(in->bsums[2 * k] + in->bsums[2 * k + 1]) : 0;
}

void clover_x4_pack_q8_K(const void *xq, void *dst, int64_t n) {
    const clover_block_q8_K *in = (const clover_block_q8_K *)xq;
    clover_block_q8_K *out = (clover_block_q8_K *)dst;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        q8_K_sums32(&in[i], &out[i]);
        for (int s = 0; s < 4; s++)
            for (int b = 0; b < 8; b++) memcpy(out[i].qs + 64 * s + 8 * b, in[i].qs + 32 * b + 8 * s, 8);
    }
}

clover_vec_dot_fn clover_dot1_x4_kernel(int type) {
    return clover_dot_best_isa() == CLOVER_ISA_AVX2 ? clover_dot1_x4_avx2(type) : NULL;
}

void clover_x4_pair_q8_K(const void *xq, void *dst, int64_t n) {
    const clover_block_q8_K *in = (const clover_block_q8_K *)xq;
    clover_block_q8_K *out = (clover_block_q8_K *)dst;
    for (int64_t i = 0; i < n / CLOVER_QK_K; i++) {
        q8_K_sums32(&in[i], &out[i]);
        for (int s = 0; s < 4; s++)
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 4; k++)
                    memcpy(out[i].qs + 64 * s + 32 * h + 8 * k, in[i].qs + 32 * (2 * k + h) + 8 * s, 8);
    }
}

int64_t clover_x4_split_row_bytes(int64_t n) { return n + 4 * (n / 32); }

void clover_x4_split_q8_0(const void *xq, void *dst, int64_t n) {
    const uint8_t *in = (const uint8_t *)xq;
    uint8_t *q = (uint8_t *)dst;
    float *d = (float *)(q + n);
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = in + 34 * b;
        if (b < nb - nb % 4) /* groups of 4 blocks: byte 32 m + 8 k + i = value 8 m + i of block k */
            for (int m = 0; m < 4; m++) memcpy(q + 32 * (b - b % 4) + 32 * m + 8 * (b % 4), blk + 2 + 8 * m, 8);
        else
            memcpy(q + 32 * b, blk + 2, 32);
        uint16_t h;
        memcpy(&h, blk, 2);
        const float s = clover_fp16_to_fp32(h);
        memcpy(d + b, &s, sizeof s);
    }
}

int64_t clover_x4_row_bytes(int64_t n) { return n + 64 * ((n / 32 + 1) / 2); }

void clover_x4_pack_q8_0(const void *xq, void *dst, int64_t n) {
    const uint8_t *in = (const uint8_t *)xq;
    uint8_t *q = (uint8_t *)dst;
    float *d = (float *)(q + n);
    const int64_t nb = n / 32;
    for (int64_t b = 0; b < nb; b++, in += 34) {
        for (int j = 0; j < 32; j++) q[32 * b + j] = (uint8_t)(in[2 + j] ^ 0x80);
        uint16_t h;
        memcpy(&h, in, 2);
        const float s = clover_fp16_to_fp32(h);
        for (int j = 0; j < 8; j++) d[8 * b + j] = s;
    }
    if (nb % 2)
        for (int j = 0; j < 8; j++) d[8 * nb + j] = 0.0f;
}

clover_vec_dot4_fn clover_dot4_kernel(int type) {
    const int isa = clover_dot_best_isa();
    if (isa == CLOVER_ISA_AVX2) return clover_dot4_avx2(type);
    if (isa < CLOVER_ISA_AVX512) return NULL;
    const clover_vec_dot4_fn f = clover_dot4_avx512(type);
    return f ? f : clover_dot4_k_avx512(type);
}

static float dot_f16_scalar(const float *q, const uint16_t *k, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += q[i] * clover_h2f(k[i]);
    return s;
}

static void axpy_f16_scalar(float *o, float p, const uint16_t *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] += p * clover_h2f(v[i]);
}

/* The F16 and F32 attention kernels' ISA: isa (< 0 or past this CPU's: the best it has) is AVX2 or wider. */
static int f16_wide(int isa) {
    const int best = clover_dot_best_isa();
    return (isa < 0 || isa > best ? best : isa) >= CLOVER_ISA_AVX2;
}

clover_dot_f16_fn clover_dot_f16_kernel(int isa) {
    const clover_dot_f16_fn f = f16_wide(isa) ? clover_dot_f16_avx2() : NULL;
    return f ? f : dot_f16_scalar;
}

clover_axpy_f16_fn clover_axpy_f16_kernel(int isa) {
    const clover_axpy_f16_fn f = f16_wide(isa) ? clover_axpy_f16_avx2() : NULL;
    return f ? f : axpy_f16_scalar;
}

static float dot_f32_scalar(const float *q, const float *k, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; i++) s += q[i] * k[i];
    return s;
}

static void axpy_f32_scalar(float *o, float p, const float *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] += p * v[i];
}

clover_dot_f32_fn clover_dot_f32_kernel(int isa) {
    const clover_dot_f32_fn f = f16_wide(isa) ? clover_dot_f32_avx2() : NULL;
    return f ? f : dot_f32_scalar;
}

clover_axpy_f32_fn clover_axpy_f32_kernel(int isa) {
    const clover_axpy_f32_fn f = f16_wide(isa) ? clover_axpy_f32_avx2() : NULL;
    return f ? f : axpy_f32_scalar;
}

typedef float gemm_v4 __attribute__((vector_size(16), aligned(4))); /* GCC/Clang vector extension */

/* The portable float32 product (dot.h clover_gemm_f32_kernel): 4 rows x 8 columns a block, in
 * 4-lane vectors (SSE2 on any x86-64, NEON on arm64; wider vectors on a target without them
 * fall apart into scalar code). */
static void gemm_f32_portable(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                              const float *B, int64_t ldb, float *C, int64_t ldc) {
    int64_t i0 = 0;
    for (; i0 + 4 <= M; i0 += 4) {
        int64_t n0 = 0;
        for (; n0 + 8 <= N; n0 += 8) {
            gemm_v4 c[4][2] = {{{0}}};
            for (int64_t m = 0; m < K; m++) {
                const gemm_v4 b0 = *(const gemm_v4 *)(B + m * ldb + n0), b1 = *(const gemm_v4 *)(B + m * ldb + n0 + 4);
                for (int r = 0; r < 4; r++) {
                    const float a = A[(i0 + r) * lda + m];
                    c[r][0] += a * b0, c[r][1] += a * b1;
                }
            }
            for (int r = 0; r < 4; r++)
                for (int x = 0; x < 2; x++) *(gemm_v4 *)(C + (i0 + r) * ldc + n0 + 4 * x) += alpha * c[r][x];
        }
        for (; n0 < N; n0++)
            for (int r = 0; r < 4; r++) {
                float acc = 0;
                for (int64_t m = 0; m < K; m++) acc += A[(i0 + r) * lda + m] * B[m * ldb + n0];
                C[(i0 + r) * ldc + n0] += alpha * acc;
            }
    }
    for (; i0 < M; i0++)
        for (int64_t n = 0; n < N; n++) {
            float acc = 0;
            for (int64_t m = 0; m < K; m++) acc += A[i0 * lda + m] * B[m * ldb + n];
            C[i0 * ldc + n] += alpha * acc;
        }
}

clover_gemm_f32_fn clover_gemm_f32_kernel(int isa) {
    const clover_gemm_f32_fn f = f16_wide(isa) ? clover_gemm_f32_avx2() : NULL;
    return f ? f : gemm_f32_portable;
}

clover_dot_f32x4_fn clover_dot_f32x4_kernel(void) {
    return clover_dot_best_isa() >= CLOVER_ISA_AVX512 ? clover_dot_f32x4_avx512() : NULL;
}

clover_axpy_f32_rows_fn clover_axpy_f32_rows_kernel(void) {
    return clover_dot_best_isa() >= CLOVER_ISA_AVX512 ? clover_axpy_f32_rows_avx512() : NULL;
}

clover_dot_f16x4_fn clover_dot_f16x4_kernel(void) {
    return clover_dot_best_isa() >= CLOVER_ISA_AVX512 ? clover_dot_f16x4_avx512() : NULL;
}

clover_axpy_f16_rows_fn clover_axpy_f16_rows_kernel(void) {
    return clover_dot_best_isa() >= CLOVER_ISA_AVX512 ? clover_axpy_f16_rows_avx512() : NULL;
}
