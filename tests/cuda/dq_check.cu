/* dq_check.cu: the GPU kernels' dequantisation (native/cuda/dequant.cuh) run on the host, so
 * tests/native/test_cuda.py can compare it with the CPU engine's on a machine without a GPU.
 *   dq_check TYPE IN OUT [int]   reads whole blocks of ggml type TYPE from file IN, writes float32 to
 *                                OUT: dq(b, j), or with `int` s * q_j + o from qpack and qscale */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../native/cuda/dequant.cuh"

static bool g_int; /* the integer form */

template <int TYPE> static size_t run(const uint8_t *in, size_t nbytes, float *out) {
    constexpr int BN = block_info<TYPE>::n, BB = block_info<TYPE>::bytes;
    const size_t nb = nbytes / BB;
    for (size_t b = 0; b < nb; b++)
        for (int j = 0; j < BN; j++) {
            const uint8_t *blk = in + b * BB;
            if (!g_int) {
                out[b * BN + j] = dq<TYPE>(blk, j);
                continue;
            }
            const qscale_t so = qscale<TYPE>(blk, j);
            const int8_t q = (int8_t)(qpack<TYPE>(blk, j & ~3) >> (8 * (j & 3)));
            out[b * BN + j] = so.s * (float)q + so.o;
        }
    return nb * BN;
}

int main(int argc, char **argv) {
    if (argc != 4 && !(argc == 5 && strcmp(argv[4], "int") == 0))
        return fprintf(stderr, "usage: dq_check TYPE IN OUT [int]\n"), 2;
    g_int = argc == 5;
    FILE *f = fopen(argv[2], "rb");
    if (!f) return perror(argv[2]), 2;
    fseek(f, 0, SEEK_END);
    const long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *in = (uint8_t *)malloc((size_t)n + 1);
    float *out = (float *)malloc(sizeof(float) * ((size_t)n * 2 + 1)); /* >= elements of any format */
    if (!in || !out || fread(in, 1, (size_t)n, f) != (size_t)n) return fprintf(stderr, "read failed\n"), 2;
    fclose(f);
    size_t m = 0;
    switch (atoi(argv[1])) {
    case T_Q8_0: m = run<T_Q8_0>(in, (size_t)n, out); break;
    case T_Q4_0: m = run<T_Q4_0>(in, (size_t)n, out); break;
    case T_IQ4_NL: m = run<T_IQ4_NL>(in, (size_t)n, out); break;
    case T_MXFP4: m = run<T_MXFP4>(in, (size_t)n, out); break;
    case T_Q4_K: m = run<T_Q4_K>(in, (size_t)n, out); break;
    case T_Q5_K: m = run<T_Q5_K>(in, (size_t)n, out); break;
    case T_Q6_K: m = run<T_Q6_K>(in, (size_t)n, out); break;
    case T_IQ4_XS: m = run<T_IQ4_XS>(in, (size_t)n, out); break;
    default: return fprintf(stderr, "type %s not a block format\n", argv[1]), 2;
    }
    FILE *o = fopen(argv[3], "wb");
    if (!o || fwrite(out, sizeof(float), m, o) != m) return fprintf(stderr, "write failed\n"), 2;
    fclose(o);
    free(in), free(out);
    return 0;
}
