/* cuda_backend.h: the C interface of native/cuda/cuda.cu (compiled when CMake finds the CUDA
 * toolkit, CLOVER_CUDA=AUTO|ON); native/cuda_stub.c defines the same functions returning
 * CLOVER_E_DEVICE ("built without CUDA") otherwise. All return CLOVER_* codes (clover.h). */
#ifndef CLOVER_CUDA_BACKEND_H
#define CLOVER_CUDA_BACKEND_H
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices (> 0), 0 when none, or CLOVER_E_DEVICE when the runtime cannot be used
 * (no driver, built without CUDA); info receives a one-line description or the reason. */
int clover_cuda_devices(char *info, size_t info_size);
/* Free and total bytes of device 0. */
int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes);
/* Copy nbytes of host memory into a new device allocation *dev (free with clover_cuda_free). */
int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size);
void clover_cuda_free(void *dev);
/* y[t][r] = sum_j W[r][j] x[t][j] for t < T, r < ne1: W on the device (ne1 rows of ne0 values of
 * ggml type `type`: F32, F16, BF16, Q8_0, Q4_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS), x and y
 * float32 in host memory ([T][ne0], [T][ne1]). Activations are rounded as the CPU engine rounds
 * them for `type` (Q8_0 or Q8_K, native/dot.h), so y equals clover_matmul's up to float
 * summation order. Thread-safe (calls are serialised). */
int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size);

/* One weight tensor on the device: ne1 rows of ne0 values of ggml type `type` per matrix; for a
 * 3-D expert tensor, matrix e starts stride bytes after matrix e-1 (ggml's [E][ne1][ne0]). */
typedef struct {
    int type;
    const void *dev;
    int64_t ne0, ne1, stride;
} clover_cuda_weight;

/* The routed experts of one MoE layer (spec 2.3 step 2) on the device, for P = start[n_expert]
 * (row, expert) pairs bucketed by expert: pair q in [start[e], start[e+1]) uses expert e, and
 *   yg[q] = down_e (silu(gate_e xg[q]) * (up_e xg[q])),
 * gate and up [I][H] per expert, down [H][I]; xg and yg [P][H] float32 in host memory. Each
 * product rounds its activations as the CPU engine does for the weight type (Q8_0/Q8_K), so
 * results equal the CPU's expert_ffn up to float summation order. start: n_expert + 1
 * non-decreasing values from 0. Errors: CLOVER_E_ARG (shapes, start), CLOVER_E_NOMEM,
 * CLOVER_E_DEVICE. Thread-safe (calls are serialised). */
int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                        int64_t n_expert, const int64_t *start, const float *xg, float *yg, char *err,
                        size_t err_size);

#ifdef __cplusplus
}
#endif
#endif
