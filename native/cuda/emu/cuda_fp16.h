/* cuda_fp16.h of the CUDA emulator (see cuda_runtime.h beside it): __half as IEEE binary16
 * bits, with the conversions the kernels use (round to nearest even, as the hardware's). */
#ifndef CLOVER_EMU_CUDA_FP16_H
#define CLOVER_EMU_CUDA_FP16_H
#include "cuda_runtime.h"

struct __half {
    unsigned short x;
};
static inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
static inline unsigned short __half_as_ushort(__half h) { return h.x; }
static inline float __half2float(__half h) {
    const uint32_t s = (uint32_t)(h.x & 0x8000) << 16, e = (h.x >> 10) & 31, m = h.x & 1023;
    if (e == 31) return __uint_as_float(s | 0x7F800000u | (m << 13));
    if (e) return __uint_as_float(s | ((e + 112) << 23) | (m << 13));
    return (s ? -1.0f : 1.0f) * (float)m * 5.9604644775390625e-8f; /* m * 2^-24 */
}
static inline __half __float2half(float f) { /* via _Float16 (GCC >= 12, Clang on x86-64) */
    _Float16 h = (_Float16)f;
    unsigned short b;
    memcpy(&b, &h, 2);
    return __half{b};
}
static inline __half __float2half_rn(float f) { return __float2half(f); }
#endif
