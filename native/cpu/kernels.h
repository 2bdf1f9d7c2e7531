/* kernels.h: the small float kernels of the CPU forward (activations, norms, RoPE; clover-spec
 * sections 2.1-2.3), inline so that each caller compiles them in place, and the subnormal flush
 * of the parallel regions. */
#ifndef CLOVER_CPU_KERNELS_H
#define CLOVER_CPU_KERNELS_H

#include <math.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

/* The calling thread's index in the enclosing parallel region (0 outside one): which block of a
 * per-thread scratch it owns. */
static inline int thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y = x * rsqrt(mean(x^2) + eps) * w; w already holds 1 + w_hf for N1p norms (spec 2, 4.3). */
static inline void rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * s * w[i];
}

/* x * rsqrt(sum(x^2) + eps), the l2norm of spec 2.1 step 3 (as transformers' l2norm). */
static inline void l2norm(float *x, int64_t n, float eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = 1.0f / sqrtf((float)ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

static inline void rope_neox(float *v, int64_t pos, int rd, float theta) {
    int half = rd / 2;
    for (int i = 0; i < half; i++) {
        double freq = pow((double)theta, -2.0 * i / rd);
        double ang = (double)pos * freq;
        float cs = (float)cos(ang), sn = (float)sin(ang);
        float a = v[i], b = v[i + half];
        v[i] = a * cs - b * sn;
        v[i + half] = b * cs + a * sn;
    }
}

/* Subnormal floats (below 2^-126 in magnitude) read and written as zero by the calling thread
 * from here to flush_subnormals_end(previous state) (x86: MXCSR's DAZ and FTZ bits; elsewhere
 * nothing), in the GDN's and attention's parallel regions. The GDN's decays exp(G) drive chunk
 * products and states into that range (attention's weights of far keys can fall there too), and
 * an x86 multiply or add with a subnormal operand or result takes a microcode assist: dot.h's
 * AVX2 gemm ran at 0.14 GMAC/s on subnormal inputs against 23 on normal ones on the development
 * machine, and a real-dims GDN layer's 512-row prefill took 100 ms with them, 52 ms without. */
static inline unsigned flush_subnormals_begin(void) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned prev = _mm_getcsr();
    _mm_setcsr(prev | 0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    return prev;
#else
    return 0;
#endif
}

static inline void flush_subnormals_end(unsigned prev) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(prev);
#else
    (void)prev;
#endif
}

#endif
