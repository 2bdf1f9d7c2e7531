/* dequant.cuh: element j of one ggml block, for the GPU kernels (native/cuda/cuda.cu) and, compiled
 * for the host, for tests/cuda/dq_check.cu, which compares every format with the CPU engine's
 * dequantisation (native/quant/kquants.c, native/quant/quants.c) on a machine without a GPU. Block layouts
 * and formulas are ggml's (as in native/quant/kquants.c). */
#ifndef CLOVER_DEQUANT_CUH
#define CLOVER_DEQUANT_CUH
#include <cuda_fp16.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define CLOVER_HD __host__ __device__ __forceinline__

/* ggml type numbers (clover.h) */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_IQ4_NL = 20,
       T_IQ4_XS = 23, T_BF16 = 30, T_MXFP4 = 39 };

CLOVER_HD float h2f(const uint8_t *p) {
    return __half2float(__ushort_as_half((unsigned short)(p[0] | (p[1] << 8))));
}

CLOVER_HD float bits_to_float(uint32_t b) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(b);
#else
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
#endif
}

/* ggml's kvalues_iq4nl and the doubled E2M1 codes of MXFP4 (native/quant/kquants.c) */
#define KV_IQ4NL_INIT {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}
#define KV_MXFP4_INIT {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12}
__constant__ int8_t KV_IQ4NL_D[16] = KV_IQ4NL_INIT;
__constant__ int8_t KV_MXFP4_D[16] = KV_MXFP4_INIT;
static const int8_t KV_IQ4NL_H[16] = KV_IQ4NL_INIT;
static const int8_t KV_MXFP4_H[16] = KV_MXFP4_INIT;
#ifdef __CUDA_ARCH__
#define KV_IQ4NL KV_IQ4NL_D
#define KV_MXFP4 KV_MXFP4_D
#else
#define KV_IQ4NL KV_IQ4NL_H
#define KV_MXFP4 KV_MXFP4_H
#endif

CLOVER_HD float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    return bits_to_float(bits);
}

CLOVER_HD void k4_scale_min(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* Element j of one block of type TYPE at b. */
template <int TYPE> CLOVER_HD float dq(const uint8_t *b, int j);

template <> CLOVER_HD float dq<T_Q8_0>(const uint8_t *b, int j) {
    return h2f(b) * (float)(int8_t)b[2 + j];
}
template <> CLOVER_HD float dq<T_Q4_0>(const uint8_t *b, int j) {
    const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return h2f(b) * (float)(q - 8);
}
template <> CLOVER_HD float dq<T_IQ4_NL>(const uint8_t *b, int j) {
    const int q = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
    return h2f(b) * (float)KV_IQ4NL[q];
}
template <> CLOVER_HD float dq<T_MXFP4>(const uint8_t *b, int j) {
    const int q = j < 16 ? (b[1 + j] & 15) : (b[1 + j - 16] >> 4);
    return e8m0_half(b[0]) * (float)KV_MXFP4[q];
}
template <> CLOVER_HD float dq<T_Q4_K>(const uint8_t *b, int j) {
    const int g = j / 32, l = j % 32;
    int s, m;
    k4_scale_min(g, b + 4, &s, &m);
    const uint8_t q = b[16 + 32 * (g / 2) + l];
    return h2f(b) * (float)s * (float)((g & 1) ? (q >> 4) : (q & 0xF)) - h2f(b + 2) * (float)m;
}
template <> CLOVER_HD float dq<T_Q5_K>(const uint8_t *b, int j) {
    const int g = j / 32, l = j % 32;
    int s, m;
    k4_scale_min(g, b + 4, &s, &m);
    const uint8_t lo = b[48 + 32 * (g / 2) + l];
    const int q = ((g & 1) ? (lo >> 4) : (lo & 0xF)) | (((b[16 + l] >> g) & 1) << 4);
    return h2f(b) * (float)s * (float)q - h2f(b + 2) * (float)m;
}
template <> CLOVER_HD float dq<T_Q6_K>(const uint8_t *b, int j) {
    const int n = j / 128, r = j % 128, qd = r / 32, l = r % 32;
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    const int8_t *sc = (const int8_t *)(b + 192 + 8 * n);
    const uint8_t lo = ql[l + ((qd & 1) ? 32 : 0)];
    const int q = ((qd & 2) ? (lo >> 4) : (lo & 0xF)) | (((qh[l] >> (2 * qd)) & 3) << 4);
    return h2f(b + 208) * (float)sc[l / 16 + 2 * qd] * (float)(q - 32);
}
template <> CLOVER_HD float dq<T_IQ4_XS>(const uint8_t *b, int j) {
    const int ib = j / 32, jj = j % 32;
    const int sh = b[2] | (b[3] << 8);
    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
    const uint8_t q = b[8 + 16 * ib + (jj % 16)];
    return h2f(b) * (float)(ls - 32) * (float)KV_IQ4NL[jj < 16 ? (q & 0xF) : (q >> 4)];
}

template <int TYPE> struct block_info;
template <> struct block_info<T_Q8_0> { static constexpr int n = 32, bytes = 34; };
template <> struct block_info<T_Q4_0> { static constexpr int n = 32, bytes = 18; };
template <> struct block_info<T_IQ4_NL> { static constexpr int n = 32, bytes = 18; };
template <> struct block_info<T_MXFP4> { static constexpr int n = 32, bytes = 17; };
template <> struct block_info<T_Q4_K> { static constexpr int n = 256, bytes = 144; };
template <> struct block_info<T_Q5_K> { static constexpr int n = 256, bytes = 176; };
template <> struct block_info<T_Q6_K> { static constexpr int n = 256, bytes = 210; };
template <> struct block_info<T_IQ4_XS> { static constexpr int n = 256, bytes = 136; };

/* The integer form of each block format, for the products' int8 dot products (cuda.cu
 * k_matmul_q): element j of a block is s * q_j + o, with q_j an int8 and (s, o) the float scale
 * and offset of j's group (32 elements; 16 for Q6_K), the same floats dq multiplies (so
 * s * q_j + o == dq(b, j) bit for bit; tests/cuda/dq_check.cu). qpack<TYPE>(b, j): q_j .. q_j+3
 * packed little-endian (j a multiple of 4; the four in one group); qscale<TYPE>(b, j): (s, o)
 * of j's group. Offsets are nonzero for Q4_K and Q5_K only (has_offset). */
struct qscale_t {
    float s, o;
};

/* 4 bytes at p, A the alignment the layout guarantees (4, 2 or 1); off the GPU a wrong claim
 * aborts, so dq_check and the CUDA emulator catch it. */
template <int A> CLOVER_HD uint32_t ld4(const uint8_t *p) {
#ifdef __CUDA_ARCH__
    if (A == 4) return *(const uint32_t *)p;
    if (A == 2) return (uint32_t)((const uint16_t *)p)[0] | ((uint32_t)((const uint16_t *)p)[1] << 16);
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
#else
    if ((uintptr_t)p % A) abort();
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
#endif
}

/* the low (hi = 0) or high nibbles of 4 bytes, one per byte */
CLOVER_HD uint32_t nib4(uint32_t v, int hi) { return (v >> (4 * hi)) & 0x0F0F0F0Fu; }

/* bytes v_i - c_i as int8, for bytes v_i, c_i < 128 (no borrow crosses a byte) */
CLOVER_HD uint32_t sub4(uint32_t v, uint32_t c) { return ((v | 0x80808080u) - c) ^ 0x80808080u; }

/* kv[n_i] for 4 nibbles n_i, one per byte. On the GPU (and in the CUDA emulator, which has
 * __byte_perm) the 16 bytes of kv sit in 4 words and two byte permutations pick entries 0-7 and
 * 8-15, rather than 4 indexed loads (a __constant__ table read at a different index by each lane
 * is read once per distinct index). */
CLOVER_HD uint32_t lut4(uint32_t n, const int8_t *kv) {
#if defined(__CUDA_ARCH__) || defined(CLOVER_CUDA_EMU)
    uint32_t t[4];
    for (int w = 0; w < 4; w++)
        t[w] = (uint32_t)(uint8_t)kv[4 * w] | (uint32_t)(uint8_t)kv[4 * w + 1] << 8 |
               (uint32_t)(uint8_t)kv[4 * w + 2] << 16 | (uint32_t)(uint8_t)kv[4 * w + 3] << 24;
    const uint32_t sel = (n & 7) | (n >> 4 & 0x70) | (n >> 8 & 0x700) | (n >> 12 & 0x7000);
    const uint32_t lo = __byte_perm(t[0], t[1], sel), hi = __byte_perm(t[2], t[3], sel);
    const uint32_t upper = (n >> 3 & 0x01010101u) * 0xFFu; /* bytes whose nibble is 8-15 */
    return (hi & upper) | (lo & ~upper);
#else
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)(uint8_t)kv[(n >> (8 * i)) & 15] << (8 * i);
    return r;
#endif
}

template <int TYPE> CLOVER_HD uint32_t qpack(const uint8_t *b, int j);
template <int TYPE> CLOVER_HD qscale_t qscale(const uint8_t *b, int j);
template <int TYPE> struct has_offset { static constexpr bool v = TYPE == T_Q4_K || TYPE == T_Q5_K; };

template <> CLOVER_HD uint32_t qpack<T_Q8_0>(const uint8_t *b, int j) { return ld4<2>(b + 2 + j); }
template <> CLOVER_HD uint32_t qpack<T_Q4_0>(const uint8_t *b, int j) {
    return sub4(nib4(ld4<2>(b + 2 + (j & 15)), j >= 16), 0x08080808u);
}
template <> CLOVER_HD uint32_t qpack<T_IQ4_NL>(const uint8_t *b, int j) {
    return lut4(nib4(ld4<2>(b + 2 + (j & 15)), j >= 16), KV_IQ4NL);
}
template <> CLOVER_HD uint32_t qpack<T_MXFP4>(const uint8_t *b, int j) {
    return lut4(nib4(ld4<1>(b + 1 + (j & 15)), j >= 16), KV_MXFP4);
}
template <> CLOVER_HD uint32_t qpack<T_Q4_K>(const uint8_t *b, int j) {
    const int g = j / 32, l = j % 32;
    return nib4(ld4<4>(b + 16 + 32 * (g / 2) + l), g & 1);
}
template <> CLOVER_HD uint32_t qpack<T_Q5_K>(const uint8_t *b, int j) {
    const int g = j / 32, l = j % 32;
    return nib4(ld4<4>(b + 48 + 32 * (g / 2) + l), g & 1) | (((ld4<4>(b + 16 + l) >> g) & 0x01010101u) << 4);
}
template <> CLOVER_HD uint32_t qpack<T_Q6_K>(const uint8_t *b, int j) {
    const int n = j / 128, r = j % 128, qd = r / 32, l = r % 32;
    const uint32_t lo = nib4(ld4<2>(b + 64 * n + l + ((qd & 1) ? 32 : 0)), qd >> 1);
    const uint32_t hi = (ld4<2>(b + 128 + 32 * n + l) >> (2 * qd)) & 0x03030303u;
    return sub4(lo | (hi << 4), 0x20202020u);
}
template <> CLOVER_HD uint32_t qpack<T_IQ4_XS>(const uint8_t *b, int j) {
    const int ib = j / 32, jj = j % 32;
    return lut4(nib4(ld4<4>(b + 8 + 16 * ib + (jj & 15)), jj >= 16), KV_IQ4NL);
}

template <> CLOVER_HD qscale_t qscale<T_Q8_0>(const uint8_t *b, int) { return {h2f(b), 0.0f}; }
template <> CLOVER_HD qscale_t qscale<T_Q4_0>(const uint8_t *b, int) { return {h2f(b), 0.0f}; }
template <> CLOVER_HD qscale_t qscale<T_IQ4_NL>(const uint8_t *b, int) { return {h2f(b), 0.0f}; }
template <> CLOVER_HD qscale_t qscale<T_MXFP4>(const uint8_t *b, int) { return {e8m0_half(b[0]), 0.0f}; }
template <> CLOVER_HD qscale_t qscale<T_Q4_K>(const uint8_t *b, int j) {
    int s, m;
    k4_scale_min(j / 32, b + 4, &s, &m);
    return {h2f(b) * (float)s, -(h2f(b + 2) * (float)m)};
}
template <> CLOVER_HD qscale_t qscale<T_Q5_K>(const uint8_t *b, int j) { return qscale<T_Q4_K>(b, j); }
template <> CLOVER_HD qscale_t qscale<T_Q6_K>(const uint8_t *b, int j) {
    const int n = j / 128, r = j % 128;
    return {h2f(b + 208) * (float)((const int8_t *)(b + 192 + 8 * n))[(r % 32) / 16 + 2 * (r / 32)], 0.0f};
}
template <> CLOVER_HD qscale_t qscale<T_IQ4_XS>(const uint8_t *b, int j) {
    const int ib = j / 32, sh = b[2] | (b[3] << 8);
    const int ls = ((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | (((sh >> (2 * ib)) & 3) << 4);
    return {h2f(b) * (float)(ls - 32), 0.0f};
}

#endif
