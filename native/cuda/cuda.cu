/* cuda.cu: the CUDA part of the engine (issue 7, first installment): device discovery, weight
 * upload, and the weight products (matrix-vector and matrix-matrix) for every weight type the
 * CPU engine accepts. The rest of a forward (norms, RoPE, attention, Gated DeltaNet, routing,
 * sampling) still runs on the CPU; a product moves its activations to the device and back.
 *
 * A product y[t][r] = sum_j W[r][j] * x[t][j] (W: ne1 rows of ne0 values in its ggml type,
 * x: T rows of ne0 float32) runs one warp per weight row and group of ROWS activation rows.
 * Each weight element is dequantised once per group (the formulas of native/kquants.c and
 * native/quants.c, i.e. ggml's block layouts) and multiplied in float32 with float32
 * activations: unlike the CPU kernels, activations are not quantised to Q8_0/Q8_K, so results
 * differ from the CPU path by that rounding (tests/test_cuda.py states the tolerances).
 * Not here yet: tensor cores for the many-row case, GPU attention/GDN/MoE routing/sampler,
 * CUDA graphs (see the issue note).
 *
 * Only the CUDA runtime is used (linked statically: a machine without a driver gets an error
 * code from clover_cuda_devices, not a library that fails to load). */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "cuda_backend.h"

#define CLOVER_OK 0
#define CLOVER_E_ARG (-3)
#define CLOVER_E_NOMEM (-4)
#define CLOVER_E_DEVICE (-8)

#define ROWS 8 /* activation rows per warp */

/* kernel<<<grid, block>>>(args) as LAUNCH(kernel, grid, block)(args), so that the CUDA emulator
 * (native/cuda/emu, CLOVER_CUDA=EMU), which a host compiler builds, can run the same source. */
#ifdef CLOVER_CUDA_EMU
#define LAUNCH(k, grid, block) clover_emu_launch(k, grid, block)
#else
#define LAUNCH(k, grid, block) k<<<grid, block>>>
#endif

static void set_err(char *err, size_t n, const char *what, cudaError_t e) {
    if (err && n) snprintf(err, n, "CUDA: %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

#include "dequant.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Write the ROWS sums of a warp (lane 0). */
__device__ __forceinline__ void store_rows(float *acc, float *Y, int64_t ne1, int64_t r, int64_t t0, int64_t T) {
    for (int k = 0; k < ROWS; k++) {
        const float s = warp_sum(acc[k]);
        if (threadIdx.x == 0 && t0 + k < T) Y[(t0 + k) * ne1 + r] = s;
    }
}

/* Block formats: the warp walks the row's blocks in order, lane l takes elements l, l+32, ... */
template <int TYPE>
__global__ void k_matmul_blocks(const uint8_t *W, int64_t ne0, int64_t ne1, const float *X, int64_t T, float *Y) {
    constexpr int BN = block_info<TYPE>::n, BB = block_info<TYPE>::bytes;
    const int64_t r = blockIdx.x, t0 = (int64_t)blockIdx.y * ROWS;
    const int64_t nb = ne0 / BN;
    const uint8_t *w = W + r * nb * BB;
    float acc[ROWS];
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    const int nr = (int)(T - t0 < ROWS ? T - t0 : ROWS);
    for (int64_t ib = 0; ib < nb; ib++) {
        const uint8_t *blk = w + ib * BB;
        for (int j = threadIdx.x; j < BN; j += 32) {
            const float v = dq<TYPE>(blk, j);
            const float *x = X + t0 * ne0 + ib * BN + j;
            for (int k = 0; k < ROWS; k++)
                if (k < nr) acc[k] += v * x[k * ne0];
        }
    }
    store_rows(acc, Y, ne1, r, t0, T);
}

/* F32 / F16 / BF16 rows: lane l takes elements l, l+32, ... */
template <int TYPE>
__global__ void k_matmul_plain(const uint8_t *W, int64_t ne0, int64_t ne1, const float *X, int64_t T, float *Y) {
    const int64_t r = blockIdx.x, t0 = (int64_t)blockIdx.y * ROWS;
    float acc[ROWS];
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    const int nr = (int)(T - t0 < ROWS ? T - t0 : ROWS);
    for (int64_t j = threadIdx.x; j < ne0; j += 32) {
        float v;
        if (TYPE == T_F32) {
            v = ((const float *)W)[r * ne0 + j];
        } else {
            const uint16_t h = ((const uint16_t *)W)[r * ne0 + j];
            v = TYPE == T_F16 ? __half2float(__ushort_as_half(h)) : __uint_as_float((uint32_t)h << 16);
        }
        const float *x = X + t0 * ne0 + j;
        for (int k = 0; k < ROWS; k++)
            if (k < nr) acc[k] += v * x[k * ne0];
    }
    store_rows(acc, Y, ne1, r, t0, T);
}

/* ------------------------------------------------------------------ host side */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* one product at a time (shared scratch) */
static float *g_x, *g_y;
static size_t g_x_cap, g_y_cap;

static int grow(float **p, size_t *cap, size_t n, char *err, size_t err_size) {
    if (n <= *cap) return CLOVER_OK;
    if (*p) cudaFree(*p);
    *p = NULL;
    *cap = 0;
    cudaError_t e = cudaMalloc((void **)p, n * sizeof(float));
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMalloc of the activations", e);
        *p = NULL;
        return CLOVER_E_NOMEM;
    }
    *cap = n;
    return CLOVER_OK;
}

extern "C" int clover_cuda_devices(char *info, size_t info_size) {
#ifndef CLOVER_CUDA_EMU
    /* no driver library at all: say so (the runtime would report "driver version is insufficient") */
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!driver) {
        if (info && info_size) snprintf(info, info_size, "CUDA: no NVIDIA driver (libcuda.so.1 not found)");
        return CLOVER_E_DEVICE;
    }
    dlclose(driver);
#endif
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        set_err(info, info_size, "no usable device", e);
        cudaGetLastError(); /* clear the sticky error */
        return CLOVER_E_DEVICE;
    }
    if (n == 0) {
        if (info && info_size) snprintf(info, info_size, "CUDA: no device");
        return 0;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess && info && info_size)
        snprintf(info, info_size, "CUDA device 0: %s, compute %d.%d, %.1f GiB, %d of %d device(s)", p.name, p.major,
                 p.minor, (double)p.totalGlobalMem / (1 << 30), 1, n);
    return n;
}

extern "C" int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes) {
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) != cudaSuccess) {
        cudaGetLastError();
        return CLOVER_E_DEVICE;
    }
    if (free_bytes) *free_bytes = (int64_t)f;
    if (total_bytes) *total_bytes = (int64_t)t;
    return CLOVER_OK;
}

extern "C" int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size) {
    *dev = NULL;
    cudaError_t e = cudaMalloc(dev, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMalloc of a weight", e);
        *dev = NULL;
        return CLOVER_E_NOMEM;
    }
    e = cudaMemcpy(*dev, host, nbytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMemcpy of a weight", e);
        cudaFree(*dev);
        *dev = NULL;
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

extern "C" void clover_cuda_free(void *dev) {
    if (dev) cudaFree(dev);
}

extern "C" int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T,
                                  float *y, char *err, size_t err_size) {
    if (!dev_w || !x || !y || ne0 <= 0 || ne1 <= 0 || T <= 0 || ne1 > INT32_MAX) {
        if (err && err_size) snprintf(err, err_size, "CUDA matmul: bad arguments (ne0 %lld, ne1 %lld, T %lld)",
                                      (long long)ne0, (long long)ne1, (long long)T);
        return CLOVER_E_ARG;
    }
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, &g_x_cap, (size_t)(T * ne0), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, &g_y_cap, (size_t)(T * ne1), err, err_size);
    cudaError_t e = cudaSuccess;
    if (rc == CLOVER_OK) e = cudaMemcpy(g_x, x, sizeof(float) * (size_t)(T * ne0), cudaMemcpyHostToDevice);
    if (rc == CLOVER_OK && e == cudaSuccess) {
        const uint8_t *W = (const uint8_t *)dev_w;
        for (int64_t t0 = 0; t0 < T && e == cudaSuccess && rc == CLOVER_OK; t0 += (int64_t)65535 * ROWS) {
            const int64_t tn = T - t0 < (int64_t)65535 * ROWS ? T - t0 : (int64_t)65535 * ROWS;
            const dim3 grid((unsigned)ne1, (unsigned)((tn + ROWS - 1) / ROWS)), block(32);
            const float *X = g_x + t0 * ne0;
            float *Y = g_y + t0 * ne1;
            switch (type) {
#define CASE(TY, K) case TY: LAUNCH(K<TY>, grid, block)(W, ne0, ne1, X, tn, Y); break;
                CASE(T_F32, k_matmul_plain)
                CASE(T_F16, k_matmul_plain)
                CASE(T_BF16, k_matmul_plain)
                CASE(T_Q8_0, k_matmul_blocks)
                CASE(T_Q4_0, k_matmul_blocks)
                CASE(T_IQ4_NL, k_matmul_blocks)
                CASE(T_MXFP4, k_matmul_blocks)
                CASE(T_Q4_K, k_matmul_blocks)
                CASE(T_Q5_K, k_matmul_blocks)
                CASE(T_Q6_K, k_matmul_blocks)
                CASE(T_IQ4_XS, k_matmul_blocks)
#undef CASE
            default:
                if (err && err_size) snprintf(err, err_size, "CUDA matmul: ggml type %d not supported", type);
                rc = CLOVER_E_ARG;
            }
            if (rc == CLOVER_OK) e = cudaGetLastError();
        }
        if (rc == CLOVER_OK && e == cudaSuccess)
            e = cudaMemcpy(y, g_y, sizeof(float) * (size_t)(T * ne1), cudaMemcpyDeviceToHost);
    }
    if (rc == CLOVER_OK && e != cudaSuccess) {
        set_err(err, err_size, "matmul", e);
        rc = CLOVER_E_DEVICE;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}
