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
 * float32 in host memory ([T][ne0], [T][ne1]). Thread-safe (calls are serialised). */
int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size);

#ifdef __cplusplus
}
#endif
#endif
