/* What this build and this CPU use, in one line (llama.cpp's llama_print_system_info plays the
 * same part): the kernels' instruction set chosen at run time (quant/dot.c), the x86 features it
 * was chosen from, OpenMP and the CUDA backend. */
#include <stdio.h>

#include "clover.h"
#include "../quant/dot.h"

static const char *isa_name(int isa) {
    return isa == CLOVER_ISA_AVX512 ? "avx512-vnni" : isa == CLOVER_ISA_AVX2 ? "avx2" : "scalar";
}

const char *clover_system_info(void) {
    static char line[256]; /* benign race: every caller writes the same text */
    int avx2 = 0, fma = 0, f16c = 0, avx512f = 0, vnni = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    avx2 = __builtin_cpu_supports("avx2") != 0;
    fma = __builtin_cpu_supports("fma") != 0;
    f16c = __builtin_cpu_supports("f16c") != 0;
    avx512f = __builtin_cpu_supports("avx512f") != 0;
    vnni = __builtin_cpu_supports("avx512vnni") != 0;
#endif
#ifdef _OPENMP
    const int openmp = 1;
#else
    const int openmp = 0;
#endif
#ifdef CLOVER_HAVE_CUDA
    const int cuda = 1;
#else
    const int cuda = 0;
#endif
    snprintf(line, sizeof line,
             "kernels = %s | AVX2 = %d | FMA = %d | F16C = %d | AVX512 = %d | AVX512_VNNI = %d | OPENMP = %d | CUDA = %d",
             isa_name(clover_dot_best_isa()), avx2, fma, f16c, avx512f, vnni, openmp, cuda);
    return line;
}
