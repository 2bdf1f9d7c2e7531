/* simd_x86.h: x86 pieces shared by the SIMD kernel files (dot_avx2.c, dot_avx512.c, dot_k.c):
 * their function target attributes (no global -m flags: each kernel is called only after
 * clover_dot_best_isa() found its instruction set) and the small helpers they all use.
 * Include only inside #if defined(__x86_64__) || defined(__i386__). */
#ifndef CLOVER_SIMD_X86_H
#define CLOVER_SIMD_X86_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define CLOVER_AVX2 __attribute__((target("avx2,fma,f16c")))
#define CLOVER_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))

/* The sum of v's 8 lanes: the two halves, then lanes 0+2 and 1+3, then those two. Every kernel
 * sums in this one order, so the several-key kernels equal the one-key ones bit for bit. */
static inline CLOVER_AVX2 float clover_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The IEEE binary16 value at p (any alignment) as float. */
static inline CLOVER_AVX2 float clover_fp16_load(const void *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

#endif
