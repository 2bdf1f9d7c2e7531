/* cuda_stub.c: the CUDA backend's functions in a build without CUDA (CMake did not find the
 * toolkit, or CLOVER_CUDA=OFF): every call reports CLOVER_E_DEVICE, so the CPU path is used. */
#include "cuda/cuda_backend.h"

#ifndef CLOVER_HAVE_CUDA
#include <stdio.h>

#include "clover.h"

int clover_cuda_devices(char *info, size_t info_size) {
    if (info && info_size) snprintf(info, info_size, "this libclover was built without CUDA (CLOVER_CUDA=OFF or no nvcc)");
    return CLOVER_E_DEVICE;
}

int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes) {
    (void)free_bytes, (void)total_bytes;
    return CLOVER_E_DEVICE;
}

int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size) {
    (void)host, (void)nbytes;
    *dev = NULL;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

void clover_cuda_free(void *dev) { (void)dev; }

int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size) {
    (void)type, (void)dev_w, (void)ne0, (void)ne1, (void)x, (void)T, (void)y;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                        int64_t n_expert, const int64_t *start, const float *xg, float *yg, char *err,
                        size_t err_size) {
    (void)gate, (void)up, (void)down, (void)n_expert, (void)start, (void)xg, (void)yg;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size) {
    return clover_cuda_upload(NULL, nbytes, dev, err, err_size);
}

int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size) {
    (void)dev, (void)offset, (void)host, (void)nbytes;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_attention(const float *q, const float *k_new, const float *v_new, float *k_cache, float *v_cache,
                          int64_t n_ctx, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal,
                          float scale, float *out, char *err, size_t err_size) {
    (void)q, (void)k_new, (void)v_new, (void)k_cache, (void)v_cache, (void)n_ctx, (void)pos0, (void)T, (void)n_head;
    (void)n_kv, (void)hd, (void)causal, (void)scale, (void)out;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size) {
    return clover_cuda_write((void *)dev, offset, host, nbytes, err, err_size);
}

int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size) {
    return clover_cuda_write(dst, 0, src, nbytes, err, err_size);
}

int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size) {
    (void)kind, (void)conv, (void)beta, (void)g, (void)T, (void)Hk, (void)Hv, (void)dk, (void)dv, (void)C, (void)state;
    (void)o;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}
#endif
