/* cuda.cu: the CUDA part of the engine: device discovery, weight upload, the weight
 * products (matrix-vector and matrix-matrix) for every weight type the CPU engine accepts, the
 * routed experts of a layer as grouped products, gated attention against a KV cache on the
 * device, the Gated DeltaNet recurrence and the block operator's mixing (spec 3.3) with the
 * state on the device, each call moving its
 * activations to the device and back; and, at the end, the operations of the resident forward
 * (gpu/forward_resident.c res_forward: norms, RoPE, the GDN convolution and gates, routing, ...) on
 * activations that stay on the device.
 *
 * A product y[t][r] = sum_j W[r][j] * x[t][j] (W: ne1 rows of ne0 values in its ggml type,
 * x: T rows of ne0 float32) runs one warp per weight row and group of ROWS activation rows.
 * Block formats multiply their int8 values (dequant.cuh qpack, ggml's block layouts) with the
 * activations quantised as the CPU engine quantises them (Q8_0 or Q8_K, k_act_* below) in exact
 * integer dot products (dp4a; int8 tensor cores for many rows, mma.cuh), scaled per group of 32
 * (16) values in float32; float formats multiply in float32 (F16 and BF16 on f16/bf16 tensor
 * cores for many rows, the activations split into 16-bit terms, mma.cuh). Results differ from the
 * CPU path only in float rounding (tests/native/test_cuda.py states the tolerances). The GDN of long
 * prefills runs chunked (gdn_chunk.cuh); the block operator's mixing is gdn_block.cuh.
 *
 * Only the CUDA runtime is used (linked statically: a machine without a driver gets an error
 * code from clover_cuda_devices, not a library that fails to load). */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_backend.h"

#include "core/errors.h" /* CLOVER_OK and the CLOVER_E_* codes (clover.h) */

#define ROWS 8 /* activation rows per warp */

/* kernel<<<grid, block>>>(args) as LAUNCH(kernel, grid, block)(args), so that the CUDA emulator
 * (native/cuda/emu, CLOVER_CUDA=EMU), which a host compiler builds, can run the same source. */
#ifdef CLOVER_CUDA_EMU
#define LAUNCH(k, grid, block) clover_emu_launch(k, grid, block)
#define UNROLL
#define UNROLL_4
#else
#define LAUNCH(k, grid, block) k<<<grid, block, 0, stream()>>>
#define UNROLL _Pragma("unroll")
#define UNROLL_4 _Pragma("unroll 4")
#endif

/* The stream every kernel runs on: a blocking stream, so the synchronous copies (legacy stream)
 * stay ordered with it, and one that can be captured into a CUDA graph (clover_cuda_capture_*).
 * Created at the first launch (once, from any thread). */
static cudaStream_t g_stream;
static pthread_once_t g_stream_once = PTHREAD_ONCE_INIT;
static void stream_create(void) {
    if (cudaStreamCreate(&g_stream) != cudaSuccess) g_stream = 0; /* the legacy stream: no graphs */
}
static cudaStream_t stream(void) {
    pthread_once(&g_stream_once, stream_create);
    return g_stream;
}

/* The message of a failed runtime call, and the runtime's last error cleared (a failed call sets
 * it; left there, the next launch check would report it again: see alloc_failed). */
static void set_err(char *err, size_t n, const char *what, cudaError_t e) {
    cudaGetLastError();
    if (err && n) snprintf(err, n, "CUDA: %s: %s (%s)", what, cudaGetErrorString(e), cudaGetErrorName(e));
}

/* A failed cudaMalloc of nbytes for `what`: the message (the size, and on a full GPU what to
 * change), and the runtime's last error cleared, which the failure also set: else the next
 * launch check (launched) would report it for a launch that succeeded. Returns CLOVER_E_NOMEM
 * when the GPU's memory is full, else CLOVER_E_DEVICE. */
static int alloc_failed(char *err, size_t n, const char *what, size_t nbytes, cudaError_t e) {
    cudaGetLastError();
    char size[32];
    if (nbytes < (1 << 20)) snprintf(size, sizeof size, "%zu bytes", nbytes);
    else snprintf(size, sizeof size, "%.2f MiB", (double)nbytes / (1 << 20));
    if (err && n)
        snprintf(err, n, "CUDA: cudaMalloc of %s (%s): %s (%s)%s", size, what, cudaGetErrorString(e), cudaGetErrorName(e),
                 e == cudaErrorMemoryAllocation ? "; the GPU's memory is full: offload fewer layers (n_gpu_layers), "
                                                  "keep routed experts on the CPU (n_cpu_moe), use a smaller n_ctx, "
                                                  "or let fit choose the placement"
                                                : "");
    return e == cudaErrorMemoryAllocation ? CLOVER_E_NOMEM : CLOVER_E_DEVICE;
}

/* The parts of this one translation unit, in order (each uses what the earlier ones define). */
#include "matmul.cuh"
#include "attention.cuh"
#include "gdn.cuh"
#include "memory.cuh"
#include "experts.cuh"
#include "ops.cuh"
#include "resident_kernels.cuh"
#include "resident.cuh"
#include "select.cuh"
#include "graphs.cuh"
