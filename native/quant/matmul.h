/* matmul.h: the CPU engine's matrix products over the weight formats (quant/matmul.c; not public
 * API, but exported for tests, which reach clover_matmul through their own cdef). */
#ifndef CLOVER_QUANT_MATMUL_H
#define CLOVER_QUANT_MATMUL_H

#include <stdint.h>

/* Bytes of one row of n_in elements of `type`; -1 for unsupported types or a Q8_0 row whose
 * length is not a multiple of 32. */
int64_t clover_row_nbytes(int type, int64_t n_in);

/* y[t*n_out + r] = sum_i W[r, i] * x[t*n_in + i] for t < T, r < n_out.
 * W: n_out rows of `type` (row r at (const char*)W + r*row_nbytes). x: float32 [T, n_in].
 * y: float32 [T, n_out]. Each weight row is read once for all T rows. Work is split over
 * n_threads (<= 1: current thread only). Returns 0, or -1 on unsupported type / allocation
 * failure. */
int clover_matmul(int type, const void *W, int64_t n_in, int64_t n_out, const float *x, int64_t T,
                  float *y, int n_threads);

#endif
