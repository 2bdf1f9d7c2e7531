/* cuda.cu: the CUDA part of the engine: device discovery, weight upload, the weight
 * products (matrix-vector and matrix-matrix) for every weight type the CPU engine accepts, the
 * routed experts of a layer as grouped products, gated attention against a KV cache on the
 * device, the Gated DeltaNet recurrence and the block operator's mixing (spec 3.3) with the
 * state on the device, each call moving its
 * activations to the device and back; and, at the end, the operations of the resident forward
 * (native/model.c res_forward: norms, RoPE, the GDN convolution and gates, routing, ...) on
 * activations that stay on the device.
 *
 * A product y[t][r] = sum_j W[r][j] * x[t][j] (W: ne1 rows of ne0 values in its ggml type,
 * x: T rows of ne0 float32) runs one warp per weight row and group of ROWS activation rows.
 * Block formats multiply their int8 values (dequant.cuh qpack, ggml's block layouts) with the
 * activations quantised as the CPU engine quantises them (Q8_0 or Q8_K, k_act_* below) in exact
 * integer dot products (dp4a; int8 tensor cores for many rows, mma.cuh), scaled per group of 32
 * (16) values in float32; float formats multiply in float32 (F16 and BF16 on f16/bf16 tensor
 * cores for many rows, the activations split into 16-bit terms, mma.cuh). Results differ from the
 * CPU path only in float rounding (tests/test_cuda.py states the tolerances). The GDN of long
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

#define CLOVER_OK 0
#define CLOVER_E_ARG (-3)
#define CLOVER_E_NOMEM (-4)
#define CLOVER_E_DEVICE (-8)

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

#include "dequant.cuh"

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Halve the values a lane holds: lanes whose bit `o` is clear keep the first n/2 sums, the
 * others the last n/2, each adding its partner's half (n/2 shuffles). */
template <int N> __device__ __forceinline__ void fold(float *acc, int o) {
    const bool hi = threadIdx.x & o;
    for (int i = 0; i < N / 2; i++) {
        const float send = hi ? acc[i] : acc[i + N / 2], keep = hi ? acc[i + N / 2] : acc[i];
        acc[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
}

/* Write the nr (<= ROWS, the same on every lane) warp sums of acc. One row: a plain warp sum
 * (5 shuffles); more: folds over lane bits 4, 3, 2 then sums over bits 1, 0 (9 shuffles for
 * the 8 rows, not 40), after which lane 4k (k = bits 4..2 of the lane) holds row k's sum. */
static_assert(ROWS == 8, "store_rows folds 8 rows");
__device__ __forceinline__ void store_rows(float *acc, int nr, float *Y, int64_t ne1, int64_t r, int64_t t0) {
    if (nr == 1) {
        const float s = warp_sum(acc[0]);
        if (threadIdx.x == 0) Y[t0 * ne1 + r] = s;
        return;
    }
    fold<8>(acc, 16);
    fold<4>(acc, 8);
    fold<2>(acc, 4);
    float s = acc[0];
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    const int lane = threadIdx.x, k = ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
    if ((lane & 3) == 0 && k < nr) Y[(t0 + k) * ne1 + r] = s;
}

/* Which weight rows and activation rows a warp of a product takes: a block holds WARPS warps
 * (threadIdx.y), warp y of block x takes weight row r = WARPS x + y (none past ne1: nr = 0);
 * blockIdx.y is a group of up to ROWS activation rows, t0 = ROWS * blockIdx.y of one matrix
 * (tiles == NULL), or tiles[blockIdx.y] of a grouped product (expert e's matrix at
 * W + e * w_stride bytes, rows t0 .. t0 + nr - 1 of X and Y; nr = 0: an unused tile). */
#define WARPS 4
struct tile {
    int32_t e, t0, nr;
};

struct rows_of_block {
    const uint8_t *w; /* weight row r */
    int64_t t0, r;
    int nr;
};

__device__ __forceinline__ rows_of_block block_rows(const uint8_t *W, int64_t row_bytes, int64_t w_stride, int64_t ne1,
                                                    int64_t T, const tile *tiles) {
    rows_of_block b;
    b.r = (int64_t)blockIdx.x * WARPS + threadIdx.y;
    int64_t e = 0;
    if (tiles) {
        const tile tl = tiles[blockIdx.y];
        e = tl.e, b.t0 = tl.t0, b.nr = tl.nr;
    } else {
        b.t0 = (int64_t)blockIdx.y * ROWS;
        b.nr = (int)(T - b.t0 < ROWS ? T - b.t0 : ROWS);
    }
    if (b.r >= ne1) b.nr = 0, b.r = 0;
    b.w = W + e * w_stride + b.r * row_bytes;
    return b;
}

/* a.b as 4 signed bytes each, plus c (__dp4a, sm_61 and later) */
__device__ __forceinline__ int dp4a(uint32_t a, uint32_t b, int c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 610
    return __dp4a((int)a, (int)b, c);
#else
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
#endif
}

/* Block formats against activations in their int8 form (Q: [T][ne0] int8, D: [T][ne0 / 32]
 * float, the scale of each 32 values; act_q8_* below): lane l takes the pieces of 8 elements
 * p = l, l + 32, ...; a piece's 8 weight values are two qpack words of one group with scale s and
 * offset o (dequant.cuh), so it adds d_a * (s * sum(q_w q_a) + o * sum(q_a)) to each activation
 * row, the integer sums exact (dp4a), as the CPU's dot products form them (native/dot.h) up to
 * the float order. */
template <int TYPE>
__global__ void k_matmul_q(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const int8_t *Q,
                           const float *D, int64_t T, float *Y, const tile *tiles) {
    constexpr int BN = block_info<TYPE>::n, BB = block_info<TYPE>::bytes;
    const rows_of_block b = block_rows(W, ne0 / BN * BB, w_stride, ne1, T, tiles);
    if (b.nr <= 0) return; /* past ne1, or an unused tile of a device-routed grouped product (the whole warp) */
    const int8_t *q = Q + b.t0 * ne0;
    const float *d = D + b.t0 * (ne0 / 32);
    float acc[ROWS];
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    UNROLL_4 /* several weight loads in flight per lane */
    for (int64_t j = 8 * (int64_t)threadIdx.x; j < ne0; j += 8 * 32) {
        const uint8_t *blk = b.w + j / BN * BB;
        const int jj = (int)(j % BN);
        const uint32_t w0 = qpack<TYPE>(blk, jj), w1 = qpack<TYPE>(blk, jj + 4);
        const qscale_t so = qscale<TYPE>(blk, jj);
        for (int k = 0; k < ROWS; k++) {
            if (k >= b.nr) break;
            const uint2 a = *(const uint2 *)(q + k * ne0 + j);
            float v = so.s * (float)dp4a(w1, a.y, dp4a(w0, a.x, 0));
            if (has_offset<TYPE>::v) v += so.o * (float)dp4a(0x01010101u, a.y, dp4a(0x01010101u, a.x, 0));
            acc[k] += d[k * (ne0 / 32) + j / 32] * v;
        }
    }
    store_rows(acc, b.nr, Y, ne1, b.r, b.t0);
}

#include "mma.cuh"

/* F32 / F16 / BF16 rows: lane l takes elements l, l+32, ... */
template <int TYPE>
__global__ void k_matmul_plain(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const float *X, int64_t T,
                               float *Y, const tile *tiles) {
    const rows_of_block b = block_rows(W, ne0 * (TYPE == T_F32 ? 4 : 2), w_stride, ne1, T, tiles);
    if (b.nr <= 0) return;
    const float *bx = X + b.t0 * ne0;
    float acc[ROWS];
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    for (int64_t j = threadIdx.x; j < ne0; j += 32) {
        float v;
        if (TYPE == T_F32) {
            v = ((const float *)b.w)[j];
        } else {
            const uint16_t h = ((const uint16_t *)b.w)[j];
            v = TYPE == T_F16 ? __half2float(__ushort_as_half(h)) : __uint_as_float((uint32_t)h << 16);
        }
        const float *x = bx + j;
        for (int k = 0; k < ROWS; k++)
            if (k < b.nr) acc[k] += v * x[k * ne0];
    }
    store_rows(acc, b.nr, Y, ne1, b.r, b.t0);
}

/* The same with 16-byte loads (weight rows and X's rows 16-byte aligned, ne0 a multiple of VW):
 * lane l takes the VW = 16 / (bytes per value) values from VW l + 32 VW i on. */
template <int TYPE>
__global__ void k_matmul_plain_v(const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1, const float *X,
                                 int64_t T, float *Y, const tile *tiles) {
    constexpr int EB = TYPE == T_F32 ? 4 : 2, VW = 16 / EB;
    const rows_of_block b = block_rows(W, ne0 * EB, w_stride, ne1, T, tiles);
    if (b.nr <= 0) return;
    const float *bx = X + b.t0 * ne0;
    float acc[ROWS];
    for (int k = 0; k < ROWS; k++) acc[k] = 0.0f;
    UNROLL_4
    for (int64_t j = VW * (int64_t)threadIdx.x; j < ne0; j += VW * 32) {
        const uint4 p = ld16((const uint16_t *)(b.w + j * EB));
        float v[VW];
        for (int i = 0; i < VW; i++) {
            const uint32_t u = word(p, i * EB / 4);
            if (TYPE == T_F32) v[i] = __uint_as_float(u);
            else v[i] = half_bits<TYPE>(i & 1 ? u >> 16 : u & 0xFFFFu);
        }
        for (int k = 0; k < ROWS; k++) {
            if (k >= b.nr) break;
            const uint16_t *x = (const uint16_t *)(bx + k * ne0 + j);
            for (int q = 0; q < VW / 4; q++) {
                const uint4 a = ld16(x + 8 * q);
                acc[k] += v[4 * q] * __uint_as_float(a.x) + v[4 * q + 1] * __uint_as_float(a.y) +
                          v[4 * q + 2] * __uint_as_float(a.z) + v[4 * q + 3] * __uint_as_float(a.w);
            }
        }
    }
    store_rows(acc, b.nr, Y, ne1, b.r, b.t0);
}

/* SwiGLU of the experts (spec 2.3 step 2), as the CPU's: g = silu(g) * u, silu(x) = x / (1 + e^-x). */
__global__ void k_swiglu(float *g, const float *u, int64_t n) {
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

/* Activations as the CPU engine multiplies them with quantised weights (native/dot.h): each
 * block of X quantised to Q8_0 (32 values) or Q8_K (256 values) with the CPU's rounding, as int8
 * values Q (same layout as X) and the scale D of every 32 values (a Q8_K block's scale
 * repeated 8 times), so that a GPU product differs from the CPU's only in the float order of its
 * sums (llama.cpp's CUDA backend quantises activations too, to Q8_1). One warp per block; a block
 * holding NaN or Inf gets the scale NaN, as the CPU's NaN scale makes it. */
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ int warp_or(int v) {
    for (int o = 16; o > 0; o >>= 1) v |= __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int warp_isum(int v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Q8_0 (native/dot.c quantize_act_q8_0): d = fp16(amax/127), q = rint(x * (127/amax)). */
__global__ void k_act_q8_0(const float *X, int8_t *Q, float *D, float *S) {
    const int64_t i = (int64_t)blockIdx.x * 32 + threadIdx.x;
    const float v = X[i], a = fabsf(v);
    const float amax = warp_max(a);
    const bool bad = warp_or(!(a <= FLT_MAX));
    const float d = __half2float(__float2half_rn(amax / 127.0f));
    const float r = rintf(v * (amax != 0.0f ? 127.0f / amax : 0.0f));
    const int q = !bad && r >= -128.0f && r <= 127.0f ? (int)r : 0;
    Q[i] = (int8_t)q;
    const int sum = warp_isum(q);
    if (threadIdx.x == 0) D[blockIdx.x] = bad ? NAN : d, S[blockIdx.x] = bad ? NAN : d * (float)sum;
}

/* Q8_K (native/kquants.c q8_k_quant, ggml's quantize_row_q8_K_ref): vmax = the first element
 * of largest |x|, q = min(127, rint(x * -127/vmax)), d = 1 / (-127/vmax). Lane l holds
 * elements l + 32 i. */
__global__ void k_act_q8_k(const float *X, int8_t *Q, float *D, float *S) {
    const int64_t base = (int64_t)blockIdx.x * 256;
    const int lane = threadIdx.x;
    float v[8], a = 0.0f;
    int bad = 0;
    for (int i = 0; i < 8; i++) {
        v[i] = X[base + lane + 32 * i];
        bad |= !(fabsf(v[i]) <= FLT_MAX);
        a = fmaxf(a, fabsf(v[i]));
    }
    const float amax = warp_max(a);
    int first = 256;
    for (int i = 7; i >= 0; i--)
        if (fabsf(v[i]) == amax) first = lane + 32 * i;
    for (int o = 16; o > 0; o >>= 1) first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    const float vmax = __shfl_sync(0xffffffffu, v[(first & 255) / 32], first & 31);
    const int any_bad = warp_or(bad);
    const bool zero = any_bad || amax == 0.0f;
    const float iscale = zero ? 0.0f : -127.f / vmax, d = zero ? (any_bad ? NAN : 0.0f) : 1 / iscale;
    for (int i = 0; i < 8; i++) { /* group i (elements 32i .. 32i + 31): v[i] of every lane */
        const int q = zero ? 0 : (int)fminf(127.0f, rintf(iscale * v[i]));
        Q[base + lane + 32 * i] = (int8_t)q;
        const int sum = warp_isum(q);
        if (lane == i) D[(int64_t)blockIdx.x * 8 + i] = d, S[(int64_t)blockIdx.x * 8 + i] = any_bad ? NAN : d * (float)sum;
    }
}

/* bfloat16 bits of f rounded to nearest even (a NaN stays a NaN). */
__device__ __forceinline__ uint32_t bf16_rn(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return u >> 16 | 0x40u;
    return (u + 0x7FFFu + (u >> 16 & 1u)) >> 16;
}

/* Activations as F16 (TYPE T_F16) or BF16 weights meet them on tensor cores (mma.cuh
 * k_matmul_mma_f): row blockIdx.x of X (ne0 values, one warp) times a power of two p, written as
 * the terms H[m * h_stride + i] (m < 2 for F16, 3 for BF16), each the 16-bit rounding of what the
 * earlier ones left, and inv[row] = 1 / p. F16 takes p so that the row's largest finite |x| p
 * lies in [2^14, 2^15) (p within 2^-126..2^126; 1 for a row of zeros or one holding Inf; a NaN
 * stays a NaN), which keeps the terms finite and the remainder below 2^-22 of |x| (f16
 * subnormals: 2^-38 of the row's largest); BF16 has float32's range, p = 1, remainder below
 * 2^-27 of |x| (|x| above 3.39e38 rounds to Inf and gives NaN, where the CPU's product would
 * not). */
template <int TYPE>
__global__ void k_act_split(const float *X, int64_t ne0, uint16_t *H, int64_t h_stride, float *inv) {
    constexpr int NTERM = TYPE == T_BF16 ? 3 : 2;
    const float *x = X + (int64_t)blockIdx.x * ne0;
    uint16_t *h = H + (int64_t)blockIdx.x * ne0;
    float p = 1.0f;
    if (TYPE == T_F16) {
        float m = 0.0f;
        for (int64_t i = threadIdx.x; i < ne0; i += 32) m = fmaxf(m, fabsf(x[i]));
        m = warp_max(m);
        if (m > 0.0f && m <= FLT_MAX) {
            int e;
            frexpf(m, &e); /* m in [2^(e-1), 2^e) */
            p = ldexpf(1.0f, max(-126, min(126, 15 - e)));
        }
    }
    if (threadIdx.x == 0) inv[blockIdx.x] = 1.0f / p;
    for (int64_t i = threadIdx.x; i < ne0; i += 32) {
        float v = x[i] * p;
        for (int m = 0; m < NTERM; m++) {
            uint32_t b;
            float back;
            if (TYPE == T_F16) {
                const __half hv = __float2half_rn(v);
                b = __half_as_ushort(hv), back = __half2float(hv);
            } else {
                b = bf16_rn(v), back = __uint_as_float(b << 16);
            }
            h[m * h_stride + i] = (uint16_t)b;
            v -= back;
        }
    }
}

/* Values per block of the activation format paired with weight type `type` (0: float32). */
static int act_block(int type) {
    switch (type) {
    case T_Q8_0: case T_Q4_0: case T_IQ4_NL: case T_MXFP4: return 32;
    case T_Q4_K: case T_Q5_K: case T_Q6_K: case T_IQ4_XS: return 256;
    default: return 0;
    }
}

/* Gated attention (spec 2.2 steps 3-4) of query row t = t_base + blockIdx.y: o = softmax(q K^T *
 * scale) V over the row's keys, times sigmoid(gate), for the query heads that share one KV head
 * (GQA): block x takes KV head x / n_chunk and up to ATT_REP of its n_rep = n_head / n_kv query
 * heads (chunk x % n_chunk), one warp each (threadIdx.y), so each key is read once for all of
 * them. The keys are cut into gridDim.z splits (blockIdx.z, one contiguous range each) and read
 * in tiles of ATT_KT through shared memory: lane j scores key j of the tile against the warp's
 * q, the tile's max and exponentials update the warp's running max m and sum s (an online
 * softmax, the form of flash attention), and the output (lane l holding dimensions l + 32 i)
 * adds the tile's weighted values. One split writes the gated output; several write their
 * (m, s, output) to P [T][n_head][splits][hd + 2] for k_attention_merge (flash decoding: a
 * decode step's few rows still fill the GPU). The CPU's attend_row takes the max first and sums
 * in key order, which differs only in rounding. Q: [T][n_head][2 hd] (q then gate), K/V: the
 * layer's cache [n_ctx][n_kv hd] (float32, or fp16 where kv_f16 says), O: [T][n_head][hd].
 * Keys of row t: pos0 + t + 1 (causal, prefix mode) or pos0 + T (block mode: the prefix and
 * the whole block). Decode steps, and every pass where k_attention_mma (below) does not apply. */
#define HD_MAX 256
enum { ATT_REP = 8, ATT_KT = 16, ATT_SPLITS_MAX = 64 };
/* Loops over a lane's nd <= ATT_ND output values run to the constant ATT_ND with a guard: nvcc
 * unrolls them and the arrays they index stay in registers (with the runtime bound nd they sat
 * in local memory, 32 bytes of stack in k_attention). */
#define ATT_ND (HD_MAX / 32)
#define FOR_ND(i, nd) for (int i = 0; i < ATT_ND; i++) if (i < (nd))

/* Element i of a KV cache of fp16 (f16) or float32 values, as float. */
__device__ __forceinline__ float kv_load(const void *c, bool f16, int64_t i) {
    return f16 ? __half2float(((const __half *)c)[i]) : ((const float *)c)[i];
}

/* One value of the gated output (spec 2.2 step 4): acc / s * sigmoid(gate). */
__device__ __forceinline__ float gated(float acc, float s, float gate) {
    return acc / s * (1.0f / (1.0f + expf(-gate)));
}

/* The gated output of one (row, head), lane l holding dimensions l + 32 i of acc, the gate and o
 * (nd = head_dim / 32 of them). */
__device__ __forceinline__ void gated_out(const float *acc, float s, const float *gate, float *o, int nd) {
    FOR_ND(i, nd) o[threadIdx.x + 32 * i] = gated(acc[i], s, gate[threadIdx.x + 32 * i]);
}

/* (m, s, acc) and (m2, s2, acc2) merged into the first, n of acc's values held */
__device__ __forceinline__ void softmax_merge(float &m, float &s, float *acc, float m2, float s2, const float *acc2, int n) {
    const float mm = fmaxf(m, m2), c1 = expf(m - mm), c2 = expf(m2 - mm);
    s = s * c1 + s2 * c2;
    FOR_ND(i, n) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mm;
}

__global__ void __launch_bounds__(32 * ATT_REP)
    k_attention(const float *Q, const void *K, const void *V, int kv_f16, float *O, float *P, const int64_t *pos_p,
                int64_t pos0, int64_t T, int64_t t_base, int64_t n_head, int64_t n_kv, int64_t hd, int causal,
                float scale) {
    __shared__ float ks[ATT_KT][HD_MAX + 1], vs[ATT_KT][HD_MAX], qs[ATT_REP][HD_MAX]; /* ks padded: no bank conflicts */
    if (pos_p) pos0 = *pos_p; /* the position on the device (a graph replays with a new one) */
    const int64_t n_rep = n_head / n_kv, n_chunk = (n_rep + ATT_REP - 1) / ATT_REP, kvd = n_kv * hd;
    const int64_t g = blockIdx.x / n_chunk, t = t_base + blockIdx.y;
    const int lane = threadIdx.x, w = threadIdx.y, nd = (int)(hd / 32), nthr = 32 * blockDim.y;
    const int64_t rep = (blockIdx.x % n_chunk) * ATT_REP + w, h = g * n_rep + rep; /* this warp's query head */
    const bool head = rep < n_rep; /* warps past n_rep load tiles only */
    const bool k16 = kv_f16 & CLOVER_KV_K_F16, v16 = kv_f16 & CLOVER_KV_V_F16;
    const float *q = Q + (t * n_head + (head ? h : 0)) * 2 * hd;
    FOR_ND(i, nd) qs[w][lane + 32 * i] = q[lane + 32 * i];
    float acc[ATT_ND];
    for (int i = 0; i < ATT_ND; i++) acc[i] = 0.0f;
    const int64_t n_keys = causal ? pos0 + t + 1 : pos0 + T, per = (n_keys + gridDim.z - 1) / gridDim.z;
    const int64_t k0 = blockIdx.z * per, k1 = k0 + per < n_keys ? k0 + per : n_keys;
    float m = -FLT_MAX, s = 0.0f;
    for (int64_t kt = k0; kt < k1; kt += ATT_KT) {
        const int nk = (int)(k1 - kt < (int64_t)ATT_KT ? k1 - kt : (int64_t)ATT_KT);
        __syncthreads(); /* the previous tile (and qs) done with */
        for (int idx = w * 32 + lane; idx < nk * (int)hd; idx += nthr) {
            const int j = idx / (int)hd, d = idx % (int)hd;
            const int64_t at = (kt + j) * kvd + g * hd + d;
            ks[j][d] = kv_load(K, k16, at), vs[j][d] = kv_load(V, v16, at);
        }
        __syncthreads();
        float sc = -FLT_MAX;
        if (lane < nk) {
            float dot = 0.0f;
            for (int d = 0; d < (int)hd; d++) dot += qs[w][d] * ks[lane][d];
            sc = dot * scale;
        }
        const float m2 = fmaxf(m, warp_max(sc)), corr = expf(m - m2), p = lane < nk ? expf(sc - m2) : 0.0f;
        s = s * corr + warp_sum(p);
        FOR_ND(i, nd) acc[i] *= corr;
        for (int j = 0; j < nk; j++) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            FOR_ND(i, nd) acc[i] += pj * vs[j][lane + 32 * i];
        }
        m = m2;
    }
    if (!head) return;
    if (gridDim.z == 1) {
        gated_out(acc, s, q + hd, O + (t * n_head + h) * hd, nd);
        return;
    }
    float *pp = P + ((t * n_head + h) * gridDim.z + blockIdx.z) * (hd + 2);
    if (lane == 0) pp[0] = m, pp[1] = s;
    FOR_ND(i, nd) pp[2 + lane + 32 * i] = acc[i];
}

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* The keys [k0, k1) that split z of n_splits takes for k_attention_mma's tile of 16 queries
 * `tile` (of T n_rep), and how many splits hold keys (used): splits of ATT_MMA_SPLIT_KEYS keys
 * or more, from the largest key count of the tile's queries, so that a short context fills
 * few of them (the position may be known on the device only, so the grid cannot shrink). */
enum { ATT_MMA_WARPS = 4, ATT_MMA_KT = 16, ATT_CHUNK = 128, ATT_MMA_SPLIT_KEYS = 64 };
struct key_split {
    int64_t k0, k1;
    int used;
};
__device__ __forceinline__ key_split att_mma_keys(int64_t pos0, int64_t T, int64_t n_rep, int causal, int64_t tile,
                                                  int n_splits, int z) {
    const int64_t n_keys = causal ? pos0 + min64(tile * 16 + 15, T * n_rep - 1) / n_rep + 1 : pos0 + T;
    int64_t per = (n_keys + n_splits - 1) / n_splits;
    if (per < ATT_MMA_SPLIT_KEYS) per = ATT_MMA_SPLIT_KEYS;
    return {z * per, min64(z * per + per, n_keys), (int)((n_keys + per - 1) / per)};
}

/* The splits' (m, s, output) of k_attention merged in split order (grid (n_head, rows), one
 * warp), the gated output to O: all n_splits of them, or, after k_attention_mma (mma_rep, its
 * n_rep, non-zero), those att_mma_keys says hold keys. */
__global__ void k_attention_merge(const float *Q, const float *P, float *O, int64_t t_base, int64_t n_head, int64_t hd,
                                  int n_splits, int64_t mma_rep, const int64_t *pos_p, int64_t pos0, int64_t T,
                                  int causal) {
    const int64_t h = blockIdx.x, t = t_base + blockIdx.y;
    const int lane = threadIdx.x, nd = (int)(hd / 32);
    const float *p = P + (t * n_head + h) * n_splits * (hd + 2);
    float m = p[0], s = p[1], acc[ATT_ND] = {};
    FOR_ND(i, nd) acc[i] = p[2 + lane + 32 * i];
    int used = n_splits;
    if (mma_rep)
        used = att_mma_keys(pos_p ? *pos_p : pos0, T, mma_rep, causal, (t * mma_rep + h % mma_rep) / 16, n_splits, 0)
                   .used;
    for (int u = 1; u < used; u++) {
        const float *pu = p + u * (hd + 2);
        float a2[ATT_ND] = {};
        FOR_ND(i, nd) a2[i] = pu[2 + lane + 32 * i];
        softmax_merge(m, s, acc, pu[0], pu[1], a2, nd);
    }
    gated_out(acc, s, Q + (t * n_head + h) * 2 * hd + hd, O + (t * n_head + h) * hd, nd);
}

/* N (2 or 4) consecutive values from element i of an array of fp16 (f16) or float32 values into v,
 * in one load (i a multiple of N and the array aligned to it; off the GPU a misaligned load
 * aborts, so that a test there checks the indexing). */
template <int N> __device__ __forceinline__ void load_n(const void *c, bool f16, int64_t i, float v[N]) {
    static_assert(N == 2 || N == 4, "one 4, 8 or 16-byte load");
    uint32_t w[N];
    const char *p = (const char *)c + i * (f16 ? 2 : 4);
#ifdef __CUDA_ARCH__
    if (f16 && N == 2) w[0] = *(const uint32_t *)p;
    else if (f16 || N == 2) {
        const uint2 u = *(const uint2 *)p;
        w[0] = u.x, w[1] = u.y;
    } else {
        const uint4 u = *(const uint4 *)p;
        w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    }
#else
    if ((uintptr_t)p % (N * (f16 ? 2 : 4))) abort();
    memcpy(w, p, (size_t)N * (f16 ? 2 : 4));
#endif
    for (int j = 0; j < N; j++)
        v[j] = f16 ? __half2float(__ushort_as_half((unsigned short)(w[j / 2] >> 16 * (j % 2))))
                   : __uint_as_float(w[j]);
}

/* Gated attention as k_attention, on tf32 tensor cores, for many rows (prefill, block forwards,
 * verify). Warp threadIdx.y of block x (blockDim.y <= ATT_MMA_WARPS warps) takes 16 queries of
 * KV head x / per_g (per_g blocks a KV head): that head's query heads row after row (query i:
 * row i / n_rep, head x / per_g n_rep + i % n_rep), so each key is read once for 16 of them;
 * blockIdx.y takes split y of the keys (att_mma_keys: of the largest key count of the 16, each
 * query masking the keys past its own), in tiles of 16. Every product is a float32 one made of
 * tf32 ones (tf32_split: q k = qh kh + qh kl + ql kh; the values of an fp16 cache are tf32
 * values, so two), summed on the tensor cores in fresh tiles (scores: the first term's apart
 * from the others', per ATT_CHUNK dimensions; weighted values: per 8 keys) and in float32
 * across them, since tensor cores truncate as they add (see k_matmul_mma_f); the online softmax
 * as k_attention's, masked keys scoring -Inf. The mma's k index takes dimensions (scores) or keys
 * (weighted values) in pairs: column u and u + 4 of a k-step are values 2u and 2u + 1 of its 8,
 * for Q and K alike and for the weights and V alike; and the n index of the value tiles is
 * permuted so that a lane's values of one key lie together: lane 4g + t loads dimensions
 * g ND .. g ND + ND - 1 of V's rows (ND = HD / 8) and holds, of queries g and g + 8, the output
 * dimensions n ND + d for n = 2t, 2t + 1 and d < ND (acc[d][2 r + n - 2t] for query g + 8 r).
 * Writes as k_attention: O, or (m, s, output) to P for k_attention_merge. Caller: HD / 8 a
 * multiple of 4 (HD 32, 64, 128 or 256 here); Q, K and V 16-byte aligned (vector loads). */
template <int HD>
__global__ void __launch_bounds__(32 * ATT_MMA_WARPS)
    k_attention_mma(const float *Q, const void *K, const void *V, int kv_f16, float *O, float *P,
                    const int64_t *pos_p, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int causal,
                    float scale) {
    constexpr int ND = HD / 8;
    static_assert(ND % 4 == 0, "V rows in 4-value loads");
    if (pos_p) pos0 = *pos_p;
    const int64_t n_rep = n_head / n_kv, nq = T * n_rep, n_tiles = (nq + 15) / 16;
    const int64_t per_g = (n_tiles + blockDim.y - 1) / blockDim.y, gk = blockIdx.x / per_g;
    const int64_t tile = (blockIdx.x % per_g) * blockDim.y + threadIdx.y, kvd = n_kv * HD;
    if (tile >= n_tiles) return; /* the whole warp (no block barriers here) */
    const int g = threadIdx.x / 4, t = threadIdx.x % 4;
    const bool k16 = kv_f16 & CLOVER_KV_K_F16, v16 = kv_f16 & CLOVER_KV_V_F16;
    const key_split sp = att_mma_keys(pos0, T, n_rep, causal, tile, gridDim.y, blockIdx.y);
    const int64_t k0 = sp.k0, k1 = sp.k1;
    if (k0 >= k1) return; /* a split past the keys: k_attention_merge skips it */
    const float *q[2]; /* queries g and g + 8 of the tile (past nq: the last, not written) */
    int64_t lim[2];    /* their keys in the split end before lim */
    UNROLL
    for (int r = 0; r < 2; r++) {
        const int64_t qi = min64(tile * 16 + g + 8 * r, nq - 1), row = qi / n_rep;
        q[r] = Q + (row * n_head + gk * n_rep + qi % n_rep) * 2 * HD;
        lim[r] = min64(k1, causal ? pos0 + row + 1 : pos0 + T);
    }
    float acc[ND][4], m[2] = {-FLT_MAX, -FLT_MAX}, s[2] = {0.0f, 0.0f};
    UNROLL
    for (int d = 0; d < ND; d++)
        UNROLL
        for (int i = 0; i < 4; i++) acc[d][i] = 0.0f;
    for (int64_t kt = k0; kt < k1; kt += ATT_MMA_KT) {
        /* scores of the tile's 16 keys (two n-tiles of 8), key kt + 8 n + g's row of K in B's column g */
        float sc[2][4], sm[2][4], ss[2][4]; /* the total, the first term's and the others' sums of a chunk */
        const float *kr[2];
        UNROLL
        for (int n = 0; n < 2; n++) {
            const int64_t key = min64(kt + 8 * n + g, k1 - 1);
            kr[n] = (const float *)((const char *)K + (key * kvd + gk * HD) * (k16 ? 2 : 4));
            UNROLL
            for (int i = 0; i < 4; i++) sc[n][i] = sm[n][i] = ss[n][i] = 0.0f;
        }
        for (int ks = 0; ks < ND; ks++) {
            float qa[2], qb[2], ah[4], al[4];
            load_n<2>(q[0], false, 8 * ks + 2 * t, qa);
            load_n<2>(q[1], false, 8 * ks + 2 * t, qb);
            const float a[4] = {qa[0], qb[0], qa[1], qb[1]};
            UNROLL
            for (int i = 0; i < 4; i++) {
                const tf32_pair x = tf32_split(a[i]);
                ah[i] = x.hi, al[i] = x.lo;
            }
            UNROLL
            for (int n = 0; n < 2; n++) {
                float b[2];
                load_n<2>(kr[n], k16, 8 * ks + 2 * t, b);
                const tf32_pair b0 = tf32_split(b[0]), b1 = tf32_split(b[1]); /* fp16: lo = 0 */
                mma_16x8x8_tf32(sm[n], ah, b0.hi, b1.hi);
                mma_16x8x8_tf32(ss[n], al, b0.hi, b1.hi);
                if (!k16) mma_16x8x8_tf32(ss[n], ah, b0.lo, b1.lo);
            }
            if ((ks + 1) % (ATT_CHUNK / 8) == 0 || ks == ND - 1) {
                UNROLL
                for (int n = 0; n < 2; n++)
                    UNROLL
                    for (int i = 0; i < 4; i++) sc[n][i] += sm[n][i] + ss[n][i], sm[n][i] = ss[n][i] = 0.0f;
            }
        }
        /* the online softmax: c[i] of n-tile n is key kt + 8 n + 2 t + (i & 1) of query g + 8 (i >> 1) */
        float mx[2] = {-FLT_MAX, -FLT_MAX}, corr[2]; /* masked keys' scores: -Inf, their weights 0 */
        UNROLL
        for (int n = 0; n < 2; n++)
            UNROLL
            for (int i = 0; i < 4; i++) {
                sc[n][i] = kt + 8 * n + 2 * t + (i & 1) < lim[i >> 1] ? sc[n][i] * scale : -INFINITY;
                mx[i >> 1] = fmaxf(mx[i >> 1], sc[n][i]);
            }
        UNROLL
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            const float m2 = fmaxf(m[r], mx[r]);
            corr[r] = expf(m[r] - m2), s[r] *= corr[r], m[r] = m2;
        }
        UNROLL
        for (int d = 0; d < ND; d++)
            UNROLL
            for (int i = 0; i < 4; i++) acc[d][i] *= corr[i >> 1];
        /* acc += P V, a k-step of 8 keys per n-tile: keys j, j + 1 (j = kt + 8 n + 2 t) in A's
         * columns t, t + 4 and B's rows t, t + 4 */
        UNROLL
        for (int n = 0; n < 2; n++) {
            float p[4], ph[4], pl[4];
            UNROLL
            for (int i = 0; i < 4; i++) {
                p[i] = expf(sc[n][i] - m[i >> 1]);
                s[i >> 1] += p[i];
            }
            const float pa[4] = {p[0], p[2], p[1], p[3]}; /* A: rows g, g + 8 of columns t, then t + 4 */
            UNROLL
            for (int i = 0; i < 4; i++) {
                const tf32_pair x = tf32_split(pa[i]);
                ph[i] = x.hi, pl[i] = x.lo;
            }
            const int64_t j = kt + 8 * n + 2 * t;
            const int64_t j0 = min64(j, k1 - 1), j1 = min64(j + 1, k1 - 1);
            const int64_t v0 = j0 * kvd + gk * HD + g * ND, v1 = j1 * kvd + gk * HD + g * ND;
            UNROLL
            for (int d4 = 0; d4 < ND; d4 += 4) {
                float b0[4], b1[4];
                load_n<4>(V, v16, v0 + d4, b0);
                load_n<4>(V, v16, v1 + d4, b1);
                UNROLL
                for (int e = 0; e < 4; e++) {
                    const tf32_pair x0 = tf32_split(b0[e]), x1 = tf32_split(b1[e]);
                    float cm[4] = {0.0f, 0.0f, 0.0f, 0.0f}, cs[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    mma_16x8x8_tf32(cm, ph, x0.hi, x1.hi);
                    mma_16x8x8_tf32(cs, pl, x0.hi, x1.hi);
                    if (!v16) mma_16x8x8_tf32(cs, ph, x0.lo, x1.lo);
                    UNROLL
                    for (int i = 0; i < 4; i++) acc[d4 + e][i] += cm[i] + cs[i];
                }
            }
        }
    }
    UNROLL
    for (int r = 0; r < 2; r++) { /* the sums over the lanes of a query */
        s[r] += __shfl_xor_sync(0xffffffffu, s[r], 1);
        s[r] += __shfl_xor_sync(0xffffffffu, s[r], 2);
    }
    UNROLL
    for (int r = 0; r < 2; r++) {
        const int64_t qi = tile * 16 + g + 8 * r, th = qi / n_rep * n_head + gk * n_rep + qi % n_rep;
        if (qi >= nq) continue;
        float *pp = gridDim.y > 1 ? P + (th * gridDim.y + blockIdx.y) * (HD + 2) : NULL;
        if (pp && t == 0) pp[0] = m[r], pp[1] = s[r];
        UNROLL
        for (int c = 0; c < 2; c++) {
            UNROLL
            for (int d = 0; d < ND; d++) {
                const int64_t dim = (2 * t + c) * ND + d;
                const float a = acc[d][2 * r + c];
                if (pp) pp[2 + dim] = a;
                else O[th * HD + dim] = gated(a, s[r], q[r][HD + dim]);
            }
        }
    }
}

/* Gated DeltaNet recurrence (spec 2.1 step 6) of value head h = blockIdx.x: the state S
 * [dk][dv] column by column (the columns are independent), GDN_COLS columns a block
 * (blockIdx.y), GDN_SPLIT threads a column, thread p of a column holding its rows p R .. p R + R - 1
 * in registers (R: the template's, at least dk / GDN_SPLIT). Per row t in order: S <- exp(g) S;
 * S <- S + k (beta (v - S^T k))^T; o = S^T q, the dot products summed per thread, then over
 * the column's threads (the CPU's delta_step and readout in native/model.c sum in row order, so
 * results differ by that order, FMA contraction and expf); S written back at the end. conv: [T][C]
 * rows of q (Hk dk), k (Hk dk), v (Hv dv); value head h reads key head h % Hk. */
#define DK_MAX 256
enum { GDN_COLS = 32, GDN_SPLIT = 4 };
static_assert(GDN_SPLIT == 4, "k_gdn sums a column over lanes xor 1, 2");
template <int R>
__global__ void __launch_bounds__(GDN_COLS *GDN_SPLIT)
    k_gdn(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv, int64_t dk,
          int64_t dv, int64_t C, float *S, float *O) {
    __shared__ float kq[2 * DK_MAX];
    const int64_t h = blockIdx.x, j = (int64_t)blockIdx.y * GDN_COLS + threadIdx.x / GDN_SPLIT;
    const int p = threadIdx.x % GDN_SPLIT;
    const bool col = j < dv; /* threads past dv take part in the barriers and shuffles only */
    float s[R];
    float *Sh = col ? S + h * dk * dv : NULL;
    UNROLL
    for (int r = 0; r < R; r++) s[r] = Sh && p * R + r < dk ? Sh[(p * R + r) * dv + j] : 0.0f;
    for (int64_t t = 0; t < T; t++) {
        const float *row = conv + t * C, *q = row + (h % Hk) * dk, *k = row + Hk * dk + (h % Hk) * dk;
        const float v = col ? row[2 * Hk * dk + h * dv + j] : 0.0f;
        __syncthreads(); /* the previous row's reads of kq are done */
        for (int64_t i = threadIdx.x; i < GDN_SPLIT * R; i += blockDim.x)
            kq[i] = i < dk ? k[i] : 0.0f, kq[DK_MAX + i] = i < dk ? q[i] : 0.0f;
        __syncthreads();
        const float *kk = kq + p * R, *qq = kq + DK_MAX + p * R;
        float o = 0.0f, tmp = 0.0f;
        const float eg = expf(g[t * Hv + h]);
        UNROLL
        for (int r = 0; r < R; r++) {
            s[r] = s[r] * eg;
            tmp += s[r] * kk[r];
        }
        tmp += __shfl_xor_sync(0xffffffffu, tmp, 1);
        tmp += __shfl_xor_sync(0xffffffffu, tmp, 2);
        const float delta = (v - tmp) * beta[t * Hv + h];
        UNROLL
        for (int r = 0; r < R; r++) s[r] += kk[r] * delta;
        UNROLL
        for (int r = 0; r < R; r++) o += s[r] * qq[r];
        o += __shfl_xor_sync(0xffffffffu, o, 1);
        o += __shfl_xor_sync(0xffffffffu, o, 2);
        if (col && p == 0) O[(t * Hv + h) * dv + j] = o;
    }
    if (Sh) {
        UNROLL
        for (int r = 0; r < R; r++)
            if (p * R + r < dk) Sh[(p * R + r) * dv + j] = s[r];
    }
}

/* k_gdn's launch for dk <= DK_MAX (rows a thread: the least of 8, 16, 32, 64 that covers dk). */
static void gdn_launch(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                       int64_t dk, int64_t dv, int64_t C, float *S, float *O) {
    const dim3 grid((unsigned)Hv, (unsigned)((dv + GDN_COLS - 1) / GDN_COLS)), block(GDN_COLS * GDN_SPLIT);
    if (dk <= GDN_SPLIT * 8) LAUNCH(k_gdn<8>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else if (dk <= GDN_SPLIT * 16) LAUNCH(k_gdn<16>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else if (dk <= GDN_SPLIT * 32) LAUNCH(k_gdn<32>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
    else LAUNCH(k_gdn<64>, grid, block)(conv, beta, g, T, Hk, Hv, dk, dv, C, S, O);
}

#include "gdn_chunk.cuh"
#include "gdn_block.cuh"

/* ------------------------------------------------------------------ host side */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time (shared scratch) */

/* Device scratch, grown on demand and kept: activations in and out, the experts' two
 * intermediate products, and the tile list of a grouped product. */
struct scratch {
    void *p;
    size_t cap; /* bytes */
};
static scratch g_x, g_y, g_gate, g_up, g_tiles, g_q, g_gdn; /* g_q: activations' int8 form; g_gdn: chunked GDN */
static scratch g_h; /* activations split for F16/BF16 tensor cores (k_act_split) */
static scratch g_att; /* attention's per-split results (k_attention) */
static int64_t g_epoch; /* scratch reallocations so far (a captured graph holds their addresses) */

static int grow(scratch *s, size_t bytes, char *err, size_t err_size) {
    if (bytes <= s->cap) return CLOVER_OK;
    g_epoch++;
    if (s->p) cudaFree(s->p);
    s->p = NULL;
    s->cap = 0;
    cudaError_t e = cudaMalloc(&s->p, bytes);
    if (e != cudaSuccess) {
        s->p = NULL;
        return alloc_failed(err, err_size, "the products' scratch", bytes, e);
    }
    s->cap = bytes;
    return CLOVER_OK;
}

static int bad_arg(char *err, size_t err_size, const char *what) {
    if (err && err_size) snprintf(err, err_size, "CUDA: %s", what);
    return CLOVER_E_ARG;
}

/* The input of a product: float rows x (float weights) or their int8 form q, with the scale d
 * and d * sum(q) s of every 32 values (block formats; see k_act_q8_0). */
struct act {
    const float *x;
    const int8_t *q;
    const float *d, *s;
};

/* The int8 form of n values (n a multiple of 32) laid out from base: the values, then the scales
 * d and the sums s, each at a 16-byte boundary; fills a's q, d, s when base is not NULL and
 * returns the bytes. */
static size_t act_q_layout(int64_t n, char *base, act *a) {
    const size_t vals = ((size_t)n + 15) / 16 * 16, per32 = ((size_t)n / 32 * sizeof(float) + 15) / 16 * 16;
    if (base) a->q = (const int8_t *)base, a->d = (const float *)(base + vals), a->s = (const float *)(base + vals + per32);
    return vals + 2 * per32;
}

static size_t act_q_bytes(int64_t n) { return act_q_layout(n, NULL, NULL); }

/* a's int8 form of n_rows rows of ne0 activations a.x, as the CPU pairs them with `type`, into
 * g_q (grown by the caller to act_q_bytes(n_rows * ne0)); a float weight type leaves a as is. */
static int round_act(int type, act *a, int64_t n_rows, int64_t ne0, char *err, size_t err_size) {
    const int ab = act_block(type);
    if (!ab || n_rows == 0) return CLOVER_OK;
    if (ne0 % ab) {
        if (err && err_size) snprintf(err, err_size, "CUDA: ne0 %lld not a multiple of %d", (long long)ne0, ab);
        return CLOVER_E_ARG;
    }
    if (n_rows * (ne0 / ab) > INT32_MAX) return bad_arg(err, err_size, "activation rows: too many blocks for one launch");
    if (g_q.cap < act_q_bytes(n_rows * ne0)) return bad_arg(err, err_size, "activation scratch too small");
    const int64_t n = n_rows * ne0;
    act_q_layout(n, (char *)g_q.p, a);
    int8_t *q = (int8_t *)a->q;
    float *d = (float *)a->d, *sum = (float *)a->s;
    if (ab == 32) LAUNCH(k_act_q8_0, dim3((unsigned)(n / 32)), dim3(32))(a->x, q, d, sum);
    else LAUNCH(k_act_q8_k, dim3((unsigned)(n / 256)), dim3(32))(a->x, q, d, sum);
    return CLOVER_OK;
}

/* Whether the block formats' many-row products run on tensor cores (k_matmul_mma): a device of
 * compute capability 8.0 or later (the emulator counts as one) running the kernel compiled for
 * 8.0 or later (a build whose newest code for the device is older PTX has it trap), unless
 * CLOVER_CUDA_MMA=0. */
static pthread_once_t g_mma_once = PTHREAD_ONCE_INIT;
static bool g_mma_ok; /* the device and the build have the tensor-core kernels (set once) */

static void mma_probe(void) {
    cudaDeviceProp p;
    cudaFuncAttributes a;
    g_mma_ok = cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.major >= 8 &&
               cudaFuncGetAttributes(&a, k_matmul_mma<T_Q4_K, 4>) == cudaSuccess && a.ptxVersion >= 80;
}

static bool use_mma(void) {
    pthread_once(&g_mma_once, mma_probe);
    const char *env = getenv("CLOVER_CUDA_MMA");
    return g_mma_ok && !(env && strcmp(env, "0") == 0);
}

extern "C" int clover_cuda_mma(void) { return use_mma(); }

/* k_matmul_plain_v (vec: the rows allow 16-byte loads) or k_matmul_plain on X (product's
 * arguments). */
template <int TYPE>
static void plain_product(bool vec, dim3 grid, dim3 block, const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1,
                          const float *X, int64_t T, float *Y, const tile *tiles) {
    if (vec) LAUNCH(k_matmul_plain_v<TYPE>, grid, block)(W, w_stride, ne0, ne1, X, T, Y, tiles);
    else LAUNCH(k_matmul_plain<TYPE>, grid, block)(W, w_stride, ne0, ne1, X, T, Y, tiles);
}

/* T rows of ne0 activations x split for F16 / BF16 (`type`) tensor cores (k_act_split) into g_h,
 * grown here: *h the terms (*h_stride values apart), *inv the rows' scales. */
static int split_act(int type, const float *x, int64_t T, int64_t ne0, const uint16_t **h, int64_t *h_stride,
                     const float **inv, char *err, size_t err_size) {
    if (!x) return bad_arg(err, err_size, "product: no activations");
    if (T > INT32_MAX || T * ne0 > INT64_MAX / 8) return bad_arg(err, err_size, "product: too many activation rows");
    const int64_t n = T * ne0; /* a multiple of 32: each term starts 64-byte aligned */
    const int n_terms = type == T_BF16 ? 3 : 2;
    int rc = grow(&g_h, sizeof(uint16_t) * (size_t)(n_terms * n) + sizeof(float) * (size_t)T, err, err_size);
    if (rc != CLOVER_OK) return rc;
    uint16_t *H = (uint16_t *)g_h.p;
    float *I = (float *)(H + n_terms * n);
    if (type == T_F16) LAUNCH(k_act_split<T_F16>, dim3((unsigned)T), dim3(32))(x, ne0, H, n, I);
    else LAUNCH(k_act_split<T_BF16>, dim3((unsigned)T), dim3(32))(x, ne0, H, n, I);
    *h = H, *h_stride = n, *inv = I;
    return CLOVER_OK;
}

/* Y = W X on the device: T rows of one matrix (tiles NULL) or the n_tiles tiles of a grouped
 * product (see block_rows; T is then the tiles' rows in all); X in the form round_act gave it for
 * `type`. Block formats go to int8 tensor cores, and F16 / BF16 ones with ne0 a multiple of 32
 * and 16-byte aligned rows to f16 / bf16 tensor cores (split_act), for groups of 32 rows or
 * tiles holding 2 rows or more on average, where use_mma; else to k_matmul_q / k_matmul_plain
 * (k_matmul_plain_v where the rows allow 16-byte loads). */
static int product(int type, const void *W, int64_t w_stride, int64_t ne0, int64_t ne1, act X, int64_t T,
                   float *Y, const tile *tiles, int64_t n_tiles, char *err, size_t err_size) {
    const uint8_t *w = (const uint8_t *)W;
    if (act_block(type) && !X.q) return bad_arg(err, err_size, "product: activations not rounded");
    const bool half = type == T_F16 || type == T_BF16;
    const bool aligned = (uintptr_t)w % 16 == 0 && w_stride % 16 == 0; /* also each row, for ne0 as below */
    const bool mma = (tiles ? T >= 2 * n_tiles : T >= 16) && use_mma() &&
                     (act_block(type) || (half && ne0 % 32 == 0 && aligned));
    /* float weights off tensor cores: 16-byte loads where the rows allow */
    const bool vec = aligned && ne0 % (type == T_F32 ? 4 : 8) == 0 && (uintptr_t)X.x % 16 == 0;
    const uint16_t *H = NULL;
    const float *inv = NULL;
    int64_t h_stride = 0;
    if (mma && half) {
        const int rc = split_act(type, X.x, T, ne0, &H, &h_stride, &inv, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    const int per = tiles ? 1 : mma ? 32 : ROWS; /* activation rows (tiles) per blockIdx.y */
    const int64_t n_groups = tiles ? n_tiles : (T + per - 1) / per;
    for (int64_t g0 = 0; g0 < n_groups; g0 += 65535) { /* gridDim.y <= 65535 */
        const int64_t ng = n_groups - g0 < 65535 ? n_groups - g0 : 65535;
        const int64_t rows_a_block = (mma ? 16 : 1) * WARPS; /* weight rows */
        const dim3 grid((unsigned)((ne1 + rows_a_block - 1) / rows_a_block), (unsigned)ng), block(32, WARPS);
        const int64_t t0 = tiles ? 0 : g0 * per;
        const float *x = X.x ? X.x + t0 * ne0 : NULL;
        const float *d = X.d ? X.d + t0 * (ne0 / 32) : NULL, *sum = X.s ? X.s + t0 * (ne0 / 32) : NULL;
        const int8_t *q = X.q ? X.q + t0 * ne0 : NULL;
        const uint16_t *h = H ? H + t0 * ne0 : NULL;
        const float *iv = inv ? inv + t0 : NULL;
        float *y = Y + t0 * ne1;
        const int64_t t = T - t0;
        const tile *tl = tiles ? tiles + g0 : NULL;
        switch (type) {
#define PLAIN(TY) case TY: plain_product<TY>(vec, grid, block, w, w_stride, ne0, ne1, x, t, y, tl); break;
#define HALF(TY)                                                                                                   \
    case TY:                                                                                                       \
        if (!mma) plain_product<TY>(vec, grid, block, w, w_stride, ne0, ne1, x, t, y, tl);                         \
        else if (tiles) LAUNCH((k_matmul_mma_f<TY, 1>), grid, block)(w, w_stride, ne0, ne1, h, h_stride, iv, t, y,  \
                                                                      tl);                                         \
        else LAUNCH((k_matmul_mma_f<TY, 4>), grid, block)(w, w_stride, ne0, ne1, h, h_stride, iv, t, y, tl);      \
        break;
#define QUANT(TY)                                                                                                  \
    case TY:                                                                                                       \
        if (!mma) LAUNCH(k_matmul_q<TY>, grid, block)(w, w_stride, ne0, ne1, q, d, t, y, tl);                      \
        else if (tiles) LAUNCH((k_matmul_mma<TY, 1>), grid, block)(w, w_stride, ne0, ne1, q, d, sum, t, y, tl);    \
        else LAUNCH((k_matmul_mma<TY, 4>), grid, block)(w, w_stride, ne0, ne1, q, d, sum, t, y, tl);               \
        break;
            PLAIN(T_F32)
            HALF(T_F16)
            HALF(T_BF16)
            QUANT(T_Q8_0)
            QUANT(T_Q4_0)
            QUANT(T_IQ4_NL)
            QUANT(T_MXFP4)
            QUANT(T_Q4_K)
            QUANT(T_Q5_K)
            QUANT(T_Q6_K)
            QUANT(T_IQ4_XS)
#undef PLAIN
#undef HALF
#undef QUANT
        default:
            if (err && err_size) snprintf(err, err_size, "CUDA matmul: ggml type %d not supported", type);
            return CLOVER_E_ARG;
        }
    }
    return CLOVER_OK;
}

/* The launches' status (a launch error or an earlier asynchronous one) as a CLOVER_* code. */
static int launched(int rc, const char *what, char *err, size_t err_size) {
    const cudaError_t e = cudaGetLastError();
    if (rc != CLOVER_OK) return rc;
    if (e != cudaSuccess) {
        set_err(err, err_size, what, e);
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

static int copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind, char *err, size_t err_size) {
    const cudaError_t e = cudaMemcpy(dst, src, n, kind);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaMemcpy", e);
    return CLOVER_E_DEVICE;
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
        *dev = NULL;
        return alloc_failed(err, err_size, "a weight", nbytes, e);
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
    if (!dev_w || !x || !y || ne0 <= 0 || ne1 <= 0 || T <= 0 || ne1 > INT32_MAX || ne0 > INT64_MAX / 4 / T ||
        ne1 > INT64_MAX / 4 / T) {
        if (err && err_size) snprintf(err, err_size, "CUDA matmul: bad arguments (ne0 %lld, ne1 %lld, T %lld)",
                                      (long long)ne0, (long long)ne1, (long long)T);
        return CLOVER_E_ARG;
    }
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * ne0), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * ne1), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_q, act_q_bytes(T * ne0), err, err_size);
    float *X = (float *)g_x.p, *Y = (float *)g_y.p;
    if (rc == CLOVER_OK) rc = copy(X, x, sizeof(float) * (size_t)(T * ne0), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) {
        act a = {X, NULL, NULL, NULL};
        rc = round_act(type, &a, T, ne0, err, err_size);
        if (rc == CLOVER_OK) rc = product(type, dev_w, 0, ne0, ne1, a, T, Y, NULL, 0, err, err_size);
        rc = launched(rc, "matmul", err, err_size);
    }
    if (rc == CLOVER_OK) rc = copy(y, Y, sizeof(float) * (size_t)(T * ne1), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* The routed experts of clover_cuda_experts / clover_cuda_experts_d on device xg [P][H] into yg
 * [P][H] over the n_tiles tiles TL (device): gate and up from xg's int8 form for their types
 * (once when both round alike), SwiGLU, down. xg is not read after the down product starts, so
 * yg may be xg. Caller holds g_lock; launches only (no launched()). */
static int experts_on_device(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                             const clover_cuda_weight *down, const tile *TL, int64_t n_tiles, int64_t P, const float *xg,
                             float *yg, char *err, size_t err_size) {
    const int64_t H = gate->ne0, I = gate->ne1;
    int rc = grow(&g_gate, sizeof(float) * (size_t)(P * I), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_up, sizeof(float) * (size_t)(P * I), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_q, act_q_bytes(P * (H > I ? H : I)), err, err_size);
    float *G = (float *)g_gate.p, *U = (float *)g_up.p;
    act a = {xg, NULL, NULL, NULL};
    if (rc == CLOVER_OK) rc = round_act(gate->type, &a, P, H, err, err_size);
    if (rc == CLOVER_OK) rc = product(gate->type, gate->dev, gate->stride, H, I, a, P, G, TL, n_tiles, err, err_size);
    if (rc == CLOVER_OK && act_block(up->type) != act_block(gate->type)) rc = round_act(up->type, &a, P, H, err, err_size);
    if (rc == CLOVER_OK) rc = product(up->type, up->dev, up->stride, H, I, a, P, U, TL, n_tiles, err, err_size);
    act g = {G, NULL, NULL, NULL};
    if (rc == CLOVER_OK) {
        const int64_t nb = (P * I + 255) / 256;
        LAUNCH(k_swiglu, dim3((unsigned)(nb < 65535 ? nb : 65535)), dim3(256))(G, U, P * I);
        rc = round_act(down->type, &g, P, I, err, err_size);
    }
    if (rc == CLOVER_OK) rc = product(down->type, down->dev, down->stride, I, H, g, P, yg, TL, n_tiles, err, err_size);
    return rc;
}

/* Checks of clover_cuda_experts' arguments; NULL when they are usable. */
static const char *experts_args_error(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                      const clover_cuda_weight *down, int64_t n_expert, const int64_t *start,
                                      const float *xg, const float *yg) {
    if (!gate || !up || !down || !start || !gate->dev || !up->dev || !down->dev || n_expert <= 0 || n_expert > INT32_MAX)
        return "experts: missing weights or start, or n_expert out of range";
    const int64_t H = gate->ne0, I = gate->ne1;
    if (H <= 0 || I <= 0 || I > INT32_MAX || H > INT32_MAX || up->ne0 != H || up->ne1 != I || down->ne0 != I ||
        down->ne1 != H)
        return "experts: gate/up must be [I][H] and down [H][I] with the same H and I";
    if (start[0] != 0) return "experts: start[0] must be 0";
    for (int64_t e = 0; e < n_expert; e++)
        if (start[e + 1] < start[e]) return "experts: start must not decrease";
    const int64_t P = start[n_expert];
    if (P > INT32_MAX / 2 || (P && (!xg || !yg)) || P > INT64_MAX / 4 / (H > I ? H : I))
        return "experts: too many rows, or no xg/yg";
    return NULL;
}

extern "C" int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                   const clover_cuda_weight *down, int64_t n_expert, const int64_t *start,
                                   const float *xg, float *yg, char *err, size_t err_size) {
    const char *bad = experts_args_error(gate, up, down, n_expert, start, xg, yg);
    if (bad) return bad_arg(err, err_size, bad);
    const int64_t H = gate->ne0, P = start[n_expert];
    if (P == 0) return CLOVER_OK;
    /* tiles: ROWS pairs at a time within each expert's bucket */
    int64_t n_tiles = 0;
    for (int64_t e = 0; e < n_expert; e++) n_tiles += (start[e + 1] - start[e] + ROWS - 1) / ROWS;
    tile *tiles = (tile *)malloc(sizeof(tile) * (size_t)n_tiles);
    if (!tiles) {
        if (err && err_size) snprintf(err, err_size, "CUDA: experts: out of host memory for the tile list");
        return CLOVER_E_NOMEM;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < n_expert; e++)
        for (int64_t t0 = start[e]; t0 < start[e + 1]; t0 += ROWS)
            tiles[n++] = tile{(int32_t)e, (int32_t)t0, (int32_t)(start[e + 1] - t0 < ROWS ? start[e + 1] - t0 : ROWS)};
    pthread_mutex_lock(&g_lock);
    /* xg goes up into g_y, which also takes the result: experts_on_device reads xg only before
     * the down product writes yg */
    int rc = grow(&g_y, sizeof(float) * (size_t)(P * H), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_tiles, sizeof(tile) * (size_t)n_tiles, err, err_size);
    float *Y = (float *)g_y.p;
    const size_t x_bytes = sizeof(float) * (size_t)(P * H);
    if (rc == CLOVER_OK) rc = copy(g_tiles.p, tiles, sizeof(tile) * (size_t)n_tiles, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(Y, xg, x_bytes, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = experts_on_device(gate, up, down, (const tile *)g_tiles.p, n_tiles, P, Y, Y, err, err_size);
    rc = launched(rc, "experts", err, err_size);
    if (rc == CLOVER_OK) rc = copy(yg, Y, x_bytes, cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    free(tiles);
    return rc;
}

extern "C" int clover_cuda_host_alloc(size_t nbytes, void **host, char *err, size_t err_size) {
    *host = NULL;
    const cudaError_t e = cudaMallocHost(host, nbytes ? nbytes : 1);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaMallocHost", e);
    cudaGetLastError(); /* not left for the next launch check */
    *host = NULL;
    return CLOVER_E_NOMEM;
}

extern "C" void clover_cuda_host_free(void *host) {
    if (host) cudaFreeHost(host);
}

extern "C" int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size) {
    *dev = NULL;
    cudaError_t e = cudaMalloc(dev, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        *dev = NULL;
        return alloc_failed(err, err_size, "a context buffer", nbytes, e);
    }
    e = cudaMemset(*dev, 0, nbytes);
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMemset", e);
        cudaFree(*dev);
        *dev = NULL;
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

extern "C" int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err,
                                 size_t err_size) {
    if (!dev || (!host && nbytes)) return bad_arg(err, err_size, "write: no buffer");
    return nbytes ? copy((char *)dev + offset, host, nbytes, cudaMemcpyHostToDevice, err, err_size) : CLOVER_OK;
}

/* Splits of the keys for an attention kernel of n units (blocks or warps) a split: one when those
 * fill the GPU alone, else up to ATT_SPLITS_MAX, about `want` units in all (k_attention: 512
 * blocks; a decode step at 35B-A3B's 2 KV heads takes 64 splits). */
static int att_splits(int64_t n, int64_t want) {
    const int64_t S = (want + n - 1) / n;
    return S < ATT_SPLITS_MAX ? (int)S : ATT_SPLITS_MAX;
}

/* k_attention (and k_attention_merge for several splits, their results in g_att, grown here)
 * over the T rows of Q; caller holds g_lock; launches only. */
static int attention_launch(const float *Q, const void *K, const void *V, int kv_f16, float *O,
                            const int64_t *pos_p, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                            int causal, float scale, char *err, size_t err_size) {
    const int64_t n_rep = n_head / n_kv, n_chunk = (n_rep + ATT_REP - 1) / ATT_REP;
    /* k_attention_mma: a warp per tile of 16 queries, up to ATT_MMA_WARPS of a KV head's tiles a
     * block, per_g blocks a KV head, and splits for about 1024 warps in all (an H200 holds 8 of
     * them an SM); where its vector loads are aligned */
    const bool mma = T >= 2 && T * n_rep >= 16 && (hd == 32 || hd == 64 || hd == 128 || hd == 256) &&
                     ((uintptr_t)Q | (uintptr_t)K | (uintptr_t)V) % 16 == 0 && use_mma();
    const int64_t n_tiles = (T * n_rep + 15) / 16, warps = n_tiles < ATT_MMA_WARPS ? n_tiles : (int64_t)ATT_MMA_WARPS;
    const int64_t per_g = (n_tiles + warps - 1) / warps;
    const int S = mma ? att_splits(n_kv * n_tiles, 1024) : att_splits(T * n_kv * n_chunk, 512);
    float *P = NULL;
    if (S > 1) {
        const int rc = grow(&g_att, sizeof(float) * (size_t)(T * n_head * S * (hd + 2)), err, err_size);
        if (rc != CLOVER_OK) return rc;
        P = (float *)g_att.p;
    }
    if (mma) {
        const dim3 grid((unsigned)(n_kv * per_g), (unsigned)S), block(32, (unsigned)warps);
#define ATT_MMA(HD) LAUNCH(k_attention_mma<HD>, grid, block)(Q, K, V, kv_f16, O, P, pos_p, pos0, T, n_head, n_kv, causal, scale)
        if (hd == 32) ATT_MMA(32);
        else if (hd == 64) ATT_MMA(64);
        else if (hd == 128) ATT_MMA(128);
        else ATT_MMA(256);
#undef ATT_MMA
    }
    const dim3 block(32, (unsigned)(n_rep < (int64_t)ATT_REP ? n_rep : (int64_t)ATT_REP)); /* a warp per query head */
    for (int64_t t0 = 0; t0 < T; t0 += 65535) { /* gridDim.y <= 65535 */
        const unsigned rows = (unsigned)(T - t0 < 65535 ? T - t0 : 65535);
        if (!mma)
            LAUNCH(k_attention, dim3((unsigned)(n_kv * n_chunk), rows, (unsigned)S), block)(
                Q, K, V, kv_f16, O, P, pos_p, pos0, T, t0, n_head, n_kv, hd, causal, scale);
        if (S > 1)
            LAUNCH(k_attention_merge, dim3((unsigned)n_head, rows), dim3(32))(Q, P, O, t0, n_head, hd, S,
                                                                              mma ? n_rep : 0, pos_p, pos0, T, causal);
    }
    return CLOVER_OK;
}

extern "C" int clover_cuda_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                                     int64_t n_ctx, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                                     int causal, float scale, float *out, char *err, size_t err_size) {
    if (!q || !k_cache || !v_cache || !out || T <= 0 || pos0 < 0 || n_ctx <= 0 ||
        pos0 + T > n_ctx || n_head <= 0 || n_head > 65535 || n_kv <= 0 || n_head % n_kv || hd <= 0 ||
        hd % 32 || hd > HD_MAX || n_ctx > INT64_MAX / 4 / (n_kv * hd))
        return bad_arg(err, err_size, "attention: bad arguments (T, pos0, n_ctx, heads or head_dim out of range; "
                                      "head_dim must be a multiple of 32 up to 256)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * n_head * 2 * hd), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * n_head * hd), err, err_size);
    float *Q = (float *)g_x.p, *O = (float *)g_y.p;
    if (rc == CLOVER_OK)
        rc = copy(Q, q, sizeof(float) * (size_t)(T * n_head * 2 * hd), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) {
        rc = attention_launch(Q, k_cache, v_cache, kv_f16, O, NULL, pos0, T, n_head, n_kv, hd, causal, scale, err,
                              err_size);
        rc = launched(rc, "attention", err, err_size);
    }
    if (rc == CLOVER_OK)
        rc = copy(out, O, sizeof(float) * (size_t)(T * n_head * hd), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size) {
    if (!dev || (!host && nbytes)) return bad_arg(err, err_size, "read: no buffer");
    return nbytes ? copy(host, (const char *)dev + offset, nbytes, cudaMemcpyDeviceToHost, err, err_size) : CLOVER_OK;
}

/* The chunked forward (gdn_chunk.cuh) of T rows from the device state S [Hv][dk][dv] (updated)
 * into O, in windows of GDN_WINDOW rows (the state carries from one to the next), so its per-chunk
 * products in g_gdn take at most Hv * GDN_WINDOW / 64 slots (about 29 MB at the real model's
 * heads) however long the prompt. Caller holds g_lock; launches only. */
enum { GDN_WINDOW = 8 * GDN_CH };
static int gdn_chunked(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                       int64_t dk, int64_t dv, int64_t C, float *S, float *O, char *err, size_t err_size) {
    const int64_t W = GDN_WINDOW, max_chunks = (T < W ? T + GDN_CH - 1 : W) / GDN_CH;
    int rc = grow(&g_gdn, sizeof(float) * (size_t)(Hv * max_chunks * gdn_chunk_slot(dk, dv)), err, err_size);
    for (int64_t t0 = 0; t0 < T && rc == CLOVER_OK; t0 += W) {
        const int64_t Tw = T - t0 < W ? T - t0 : W, n_chunks = (Tw + GDN_CH - 1) / GDN_CH;
        const float *cw = conv + t0 * C;
        LAUNCH(k_gdn_chunk_prep, dim3((unsigned)Hv, (unsigned)n_chunks), dim3(256))(cw, beta + t0 * Hv, g + t0 * Hv, Tw, Hk,
                                                                                     Hv, dk, dv, C, (float *)g_gdn.p);
        LAUNCH(k_gdn_chunk_scan, dim3((unsigned)Hv, (unsigned)((dv + GDN_COLS - 1) / GDN_COLS)), dim3(256))(
            cw, Tw, Hk, Hv, dk, dv, C, (const float *)g_gdn.p, S, O + t0 * Hv * dv);
    }
    return rc;
}

/* clover_cuda_gdn's and clover_cuda_gdn_d's arguments: whether they are out of range. */
static bool gdn_bad_args(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                         int64_t Hv, int64_t dk, int64_t dv, int64_t C, const float *state, const float *o) {
    return !conv || !beta || !g || !o || !state || kind < CLOVER_GDN_FORWARD ||
           kind > CLOVER_GDN_FORWARD_CHUNKED || T <= 0 || Hk <= 0 || Hv <= 0 || Hv > INT32_MAX || dk <= 0 ||
           dk > DK_MAX || dv <= 0 || dv > 1024 || C < 2 * Hk * dk + Hv * dv ||
           T > INT64_MAX / 4 / (C > Hv * dv ? C : Hv * dv);
}

/* The GDN of `kind` on device arrays. Caller holds g_lock. */
static int gdn_run(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                   int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size) {
    if (kind == CLOVER_GDN_FORWARD_CHUNKED) return gdn_chunked(conv, beta, g, T, Hk, Hv, dk, dv, C, state, o, err, err_size);
    gdn_launch(conv, beta, g, T, Hk, Hv, dk, dv, C, state, o);
    return CLOVER_OK;
}

extern "C" int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                               int64_t Hv, int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err,
                               size_t err_size) {
    if (gdn_bad_args(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o))
        return bad_arg(err, err_size, "gdn: bad arguments (kind, T, heads, dk <= 256, dv <= 1024 or C out of range)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * C), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_gate, sizeof(float) * (size_t)(T * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_up, sizeof(float) * (size_t)(T * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * Hv * dv), err, err_size);
    float *X = (float *)g_x.p, *B = (float *)g_gate.p, *G = (float *)g_up.p, *O = (float *)g_y.p;
    if (rc == CLOVER_OK) rc = copy(X, conv, sizeof(float) * (size_t)(T * C), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(B, beta, sizeof(float) * (size_t)(T * Hv), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(G, g, sizeof(float) * (size_t)(T * Hv), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = gdn_run(kind, X, B, G, T, Hk, Hv, dk, dv, C, state, O, err, err_size);
    rc = launched(rc, "gdn", err, err_size);
    if (rc == CLOVER_OK) rc = copy(o, O, sizeof(float) * (size_t)(T * Hv * dv), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                     int64_t C, const float *state, const float *lambda, const float *beta0,
                                     const float *c, int64_t P, float *o, char *err, size_t err_size) {
    if (gdn_block_bad_args(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, o) || P < 0)
        return bad_arg(err, err_size,
                       "gdn_block: bad arguments (T, heads, dk <= 256, dv <= 1024, C or P out of range)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * C), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_gate, sizeof(float) * (size_t)(3 * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * Hv * dv), err, err_size);
    float *X = (float *)g_x.p, *L = (float *)g_gate.p, *O = (float *)g_y.p; /* L: lambda, beta0, c */
    const size_t hb = sizeof(float) * (size_t)Hv;
    if (rc == CLOVER_OK) rc = copy(X, conv, sizeof(float) * (size_t)(T * C), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L, lambda, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L + Hv, beta0, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L + 2 * Hv, c, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) gdn_block_launch(X, T, Hk, Hv, dk, dv, C, state, L, L + Hv, L + 2 * Hv, NULL, P, O);
    rc = launched(rc, "gdn_block", err, err_size);
    if (rc == CLOVER_OK) rc = copy(o, O, sizeof(float) * (size_t)(T * Hv * dv), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size) {
    if (!dst || (!src && nbytes)) return bad_arg(err, err_size, "copy: no buffer");
    return nbytes ? copy(dst, src, nbytes, cudaMemcpyDeviceToDevice, err, err_size) : CLOVER_OK;
}

/* ------------------------------------------------------------------ device-resident forward
 * The operations of native/model.c's resident forward (every layer and the output on the GPU):
 * all pointers are device memory, launches are queued in stream order and return at once (a
 * launch error is reported by that call, a later asynchronous one by a later call or by the copy
 * that brings the logits back). Each kernel follows the CPU function named in its comment, in
 * the same operation order, so results differ from the CPU's only in float rounding (expf, FMA
 * contraction, the order of parallel sums). */

/* rmsnorm (model.c) of row idx[r] (r without idx) of X into row r of Y, one warp per row:
 * y = x * rsqrt(mean(x^2) + eps) * w, the sum of squares in double. In place when X == Y. */
__global__ void k_rmsnorm(const float *X, int64_t xs, const int32_t *idx, const float *w, int64_t n, float eps, float *Y,
                          int64_t ys) {
    const int64_t r = blockIdx.x;
    const float *x = X + (idx ? idx[r] : r) * xs;
    float *y = Y + r * ys;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < n; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = threadIdx.x; i < n; i += 32) y[i] = x[i] * s * w[i];
}

/* attention_layer's per-head rmsnorm then rope_neox (model.c; spec 2.2 step 2) on head
 * blockIdx.x of row t = blockIdx.y (hd floats at X + t ts + h hs) at position *pos_p + t: the
 * first rd dimensions rotate, angles in double as on the CPU. One warp per head. */
__global__ void k_head_norm_rope(float *X, int64_t ts, int64_t hs, const float *w, int64_t hd, float eps,
                                 const int64_t *pos_p, int rd, float theta) {
    const int64_t pos0 = *pos_p; /* on the device: a graph replays with a new one */
    __shared__ float v[HD_MAX];
    float *x = X + (int64_t)blockIdx.y * ts + (int64_t)blockIdx.x * hs;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < hd; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / hd) + eps);
    for (int64_t i = threadIdx.x; i < hd; i += 32) v[i] = x[i] * s * w[i];
    __syncthreads();
    const int half = rd / 2;
    const int64_t pos = pos0 + blockIdx.y;
    for (int i = threadIdx.x; i < hd; i += 32) {
        float r = v[i];
        if (i < rd) {
            const int j = i < half ? i : i - half;
            const double ang = (double)pos * pow((double)theta, -2.0 * j / rd);
            const float cs = (float)cos(ang), sn = (float)sin(ang);
            r = i < half ? v[i] * cs - v[i + half] * sn : v[i] * cs + v[i - half] * sn;
        }
        x[i] = r;
    }
}

/* conv_silu (model.c; spec 2.1 step 2, 3.3 step 1), one thread per (row, channel): the K taps w
 * over hist (the K-1 previous inputs) ++ in, w[ch K + K-1] on the row itself, then, with wr (block
 * mode), the right taps wr[ch (K-1) + d-1] on rows t + d < T (d = 1..K-1); SiLU. */
__global__ void k_conv(const float *w, const float *wr, const float *hist, const float *in, int64_t T, int64_t C, int K,
                       float *out) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    const int64_t t = i / C, ch = i % C;
    float s = 0;
    for (int j = 0; j < K; j++) {
        const int64_t src = t - (K - 1) + j;
        s += w[ch * K + j] * (src >= 0 ? in[src * C + ch] : hist[(K - 1 + src) * C + ch]);
    }
    for (int j = 1; wr && j < K && t + j < T; j++) s += wr[ch * (K - 1) + j - 1] * in[(t + j) * C + ch];
    out[i] = s / (1.0f + expf(-s));
}

/* gdn_layer's new conv history: hist (K-1 rows of C, oldest first) <- the last K-1 rows of
 * hist ++ in[0..T), one thread per channel. */
#define CONV_K_MAX 16
__global__ void k_conv_hist(float *hist, const float *in, int64_t T, int64_t C, int K) {
    const int64_t ch = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C) return;
    float old[CONV_K_MAX];
    for (int j = 0; j < K - 1; j++) old[j] = hist[j * C + ch];
    for (int j = 0; j < K - 1; j++) {
        const int64_t src = T - (K - 1) + j;
        hist[j * C + ch] = src >= 0 ? in[src * C + ch] : old[K - 1 + src];
    }
}

/* qk_norm (model.c; spec 2.1 step 3): q (blockIdx.x < Hk) and k heads of row blockIdx.y
 * l2-normed, q then times 1/sqrt(dk); one warp per head. */
__global__ void k_gdn_qk_norm(float *conv, int64_t C, int64_t Hk, int64_t dk, float eps) {
    const int is_q = blockIdx.x < Hk;
    float *x = conv + (int64_t)blockIdx.y * C + (int64_t)blockIdx.x * dk;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < dk; i += 32) ss += (double)x[i] * x[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)ss + eps), qs = 1.0f / sqrtf((float)dk);
    for (int64_t i = threadIdx.x; i < dk; i += 32) {
        const float y = x[i] * s;
        x[i] = is_q ? y * qs : y;
    }
}

/* gates (model.c; spec 2.1 step 4): beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias). */
__global__ void k_gdn_gates(float *b, float *a, const float *ssm_a, const float *dt_bias, int64_t n, int64_t Hv) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int64_t h = i % Hv;
    b[i] = 1.0f / (1.0f + expf(-b[i]));
    const float x = a[i] + dt_bias[h];
    a[i] = ssm_a[h] * (x > 20.0f ? x : log1pf(expf(x)));
}

/* The end of gdn_layer (spec 2.1 step 7) for head blockIdx.x of row blockIdx.y, one warp: rmsnorm
 * with w, times silu(z). */
__global__ void k_gdn_out(float *O, const float *Z, const float *w, int64_t Hv, int64_t dv, float eps) {
    const int64_t at = ((int64_t)blockIdx.y * Hv + blockIdx.x) * dv;
    float *o = O + at;
    const float *z = Z + at;
    double ss = 0;
    for (int64_t i = threadIdx.x; i < dv; i += 32) ss += (double)o[i] * o[i];
    ss = warp_sum_d(ss);
    const float s = 1.0f / sqrtf((float)(ss / dv) + eps);
    for (int64_t i = threadIdx.x; i < dv; i += 32) o[i] = o[i] * s * w[i] * (z[i] / (1.0f + expf(-z[i])));
}

/* model.c's topk for one row, by one warp: the k largest p[e] among allowed experts (all when
 * NULL), ties to the lower id (E <= 1024: lane l owns experts l + 32 j). Each lane finds its own
 * best untaken candidate, then the warp the best of those (larger p, else lower id): the CPU's
 * choice. idx is written by lane 0. */
__device__ void topk_warp(const float *p, int64_t E, const unsigned char *allowed, int k, int32_t *idx) {
    const int lane = threadIdx.x & 31;
    uint32_t taken = 0; /* bit j: expert lane + 32 j */
    for (int s = 0; s < k; s++) {
        float bv = 0.0f;
        int be = -1;
        for (int j = 0; lane + 32 * j < E; j++) {
            const int e = lane + 32 * j;
            if (((taken >> j) & 1) || (allowed && !allowed[e])) continue;
            if (be < 0 || p[e] > bv) bv = p[e], be = e;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oe = __shfl_xor_sync(0xffffffffu, be, o);
            if (oe >= 0 && (be < 0 || ov > bv || (ov == bv && oe < be))) bv = ov, be = oe;
        }
        /* lane 0's pick for every lane: with NaN probabilities (a non-finite layer, reported
         * after the pass) the lanes' reductions may disagree, and ids must stay valid */
        be = __shfl_sync(0xffffffffu, be, 0);
        if (be < 0) be = 0;
        if (lane == 0) idx[s] = be;
        if ((be & 31) == lane) taken |= 1u << (be >> 5);
    }
}

/* MoE routing (spec 2.3 step 1; the coreset of spec 5.6 when coreset != 0), as moe_layer and
 * coreset in model.c, in one block of 32 warps: rows of P (logits [T][E]) become softmax
 * probabilities; sel/wsel [T][k] scratch; out: prow and pw [T k] (row and weight of each pair,
 * bucketed by expert, rows ascending within a bucket), pair [T][k] (row t's pair indices
 * ascending), tiles (n_tiles; those past the used ones get nr = 0), stats[0] experts used,
 * stats[1] experts in some row's own top-k (coreset only). A warp per row for the softmax and top-k, a thread per expert for the coreset's mass
 * (in double, in the CPU's order), its sort (as ranks) and the bucketing; the O(E) prefix sums
 * and tile list on one thread. */
#define E_MAX 1024
__global__ void __launch_bounds__(1024)
    k_route(float *P, int64_t T, int64_t E, int k, float top_p, int coreset, int32_t *sel, float *wsel, int32_t *prow,
            float *pw, int32_t *pair, tile *tiles, int64_t n_tiles, int32_t *stats) {
    __shared__ double S[E_MAX];
    __shared__ int32_t order[E_MAX], fill[E_MAX], bstart[E_MAX + 1];
    __shared__ unsigned char allowed[E_MAX];
    const int tid = threadIdx.x, nt = blockDim.x, lane = tid & 31, warp = tid >> 5, n_warps = nt >> 5;
    for (int64_t t = warp; t < T; t += n_warps) {
        float *p = P + t * E, mx = -FLT_MAX;
        for (int64_t e = lane; e < E; e += 32) mx = p[e] > mx ? p[e] : mx;
        mx = warp_max(mx);
        double sum = 0;
        for (int64_t e = lane; e < E; e += 32) sum += (p[e] = expf(p[e] - mx));
        sum = warp_sum_d(sum);
        for (int64_t e = lane; e < E; e += 32) p[e] = (float)(p[e] / sum);
    }
    __syncthreads();
    if (coreset) {
        for (int64_t t = warp; t < T; t += n_warps) topk_warp(P + t * E, E, NULL, k, sel + t * k);
        __syncthreads();
        for (int64_t e = tid; e < E; e += nt) { /* expert e's mass over the rows, in row order as the CPU adds it */
            double acc = 0;
            for (int64_t i = 0; i < T * k; i++)
                if (sel[i] == e) acc += P[(i / k) * E + e];
            S[e] = acc;
        }
        __syncthreads();
        if (tid == 0) {
            double tot = 0;
            for (int64_t e = 0; e < E; e++) tot += S[e];
            for (int64_t e = 0; e < E; e++) S[e] = tot > 0 ? S[e] / tot : 0;
        }
        __syncthreads();
        for (int64_t e = tid; e < E; e += nt) { /* the CPU's stable sort by S descending, as ranks */
            int64_t rank = 0;
            for (int64_t j = 0; j < E; j++) rank += S[j] > S[e] || (S[j] == S[e] && j < e);
            order[rank] = (int32_t)e;
        }
        __syncthreads();
        if (tid == 0) {
            int64_t m = E;
            double cum = 0;
            for (int64_t i = 0; i < E; i++) {
                cum += S[order[i]];
                if (cum >= (double)top_p) {
                    m = i + 1;
                    break;
                }
            }
            if (m < k) m = k;
            int32_t n_full = 0;
            for (int64_t e = 0; e < E; e++) allowed[e] = 0, n_full += S[e] > 0;
            for (int64_t i = 0; i < m; i++) allowed[order[i]] = 1;
            stats[1] = n_full;
        }
        __syncthreads();
    }
    for (int64_t t = warp; t < T; t += n_warps) {
        int32_t *st = sel + t * k;
        topk_warp(P + t * E, E, coreset ? allowed : NULL, k, st);
        if (lane == 0) {
            double sum = 0;
            for (int s = 0; s < k; s++) sum += P[t * E + st[s]];
            for (int s = 0; s < k; s++) wsel[t * k + s] = (float)(P[t * E + st[s]] / sum);
        }
    }
    __syncthreads();
    /* bucketing by expert, a thread per expert walking the pairs in order (so rows ascend
     * within a bucket, as the CPU's counting sort puts them) */
    for (int64_t e = tid; e < E; e += nt) {
        int32_t c = 0;
        for (int64_t i = 0; i < T * k; i++) c += sel[i] == e;
        fill[e] = c;
    }
    __syncthreads();
    if (tid == 0) {
        int32_t n_used = 0;
        int64_t n = 0;
        bstart[0] = 0;
        for (int64_t e = 0; e < E; e++) {
            bstart[e + 1] = bstart[e] + fill[e], n_used += fill[e] > 0;
            for (int32_t t0 = bstart[e]; t0 < bstart[e + 1]; t0 += ROWS)
                tiles[n++] = tile{(int32_t)e, t0, bstart[e + 1] - t0 < ROWS ? bstart[e + 1] - t0 : ROWS};
        }
        for (; n < n_tiles; n++) tiles[n] = tile{0, 0, 0};
        stats[0] = n_used;
    }
    __syncthreads();
    for (int64_t e = tid; e < E; e += nt) {
        int32_t q = bstart[e];
        for (int64_t i = 0; i < T * k; i++)
            if (sel[i] == e) prow[q] = (int32_t)(i / k), pw[q] = wsel[i], pair[i] = q++;
    }
    __syncthreads();
    for (int64_t t = tid; t < T; t += nt) { /* row t's pair indices ascending (the CPU's summation order) */
        int32_t *pr = pair + t * k;
        for (int s = 1; s < k; s++) {
            const int32_t q = pr[s];
            int u = s;
            for (; u > 0 && pr[u - 1] > q; u--) pr[u] = pr[u - 1];
            pr[u] = q;
        }
    }
}

/* Y[q] = X[rows[q]] for n rows of H. */
__global__ void k_gather(const float *X, const int32_t *rows, int64_t n, int64_t H, float *Y) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n * H) Y[i] = X[rows[i / H] * H + i % H];
}

/* The end of moe_layer plus the residual (spec 2.3 steps 2-3): per row t and column j,
 * o = sum of pw[q] YG[q] over row t's pairs q (ascending) + sigmoid(SG[t]) YS[t], X += o;
 * *bad = 1 when the result is not finite. */
__global__ void k_moe_combine(float *X, const float *YG, const float *pw, const int32_t *pair, int k, const float *YS,
                              const float *SG, int64_t T, int64_t H, int32_t *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * H) return;
    const int64_t t = i / H, j = i % H;
    float o = 0.0f;
    for (int s = 0; s < k; s++) {
        const int64_t q = pair[t * k + s];
        o += pw[q] * YG[q * H + j];
    }
    o += 1.0f / (1.0f + expf(-SG[t])) * YS[i];
    X[i] += o;
    if (!(fabsf(X[i]) <= FLT_MAX)) *bad = 1;
}

/* X += O over n values; *bad = 1 when a result is not finite. */
__global__ void k_add(float *X, const float *O, int64_t n, int32_t *bad) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    X[i] += O[i];
    if (!(fabsf(X[i]) <= FLT_MAX)) *bad = 1;
}

/* Blocks of 256 threads covering n (grid.x <= 2^31 - 1). */
static dim3 cover(int64_t n) { return dim3((unsigned)((n + 255) / 256)); }

static bool too_big(int64_t n) { return n <= 0 || (n + 255) / 256 > INT32_MAX; }

extern "C" int clover_cuda_matmul_d(int n, const clover_cuda_weight *w, const float *x, int64_t T, float *const *y,
                                    char *err, size_t err_size) {
    const int64_t ne0 = n > 0 && w ? w[0].ne0 : 0;
    if (n <= 0 || !w || !x || !y || ne0 <= 0 || T <= 0 || ne0 > INT64_MAX / 4 / T)
        return bad_arg(err, err_size, "matmul_d: bad arguments");
    for (int i = 0; i < n; i++)
        if (!w[i].dev || !y[i] || w[i].ne0 != ne0 || w[i].ne1 <= 0 || w[i].ne1 > INT32_MAX)
            return bad_arg(err, err_size, "matmul_d: bad weight (one matrix each, the same ne0)");
    pthread_mutex_lock(&g_lock);
    int rc = CLOVER_OK;
    /* by activation format: none, Q8_0 (32), Q8_K (256); the int8 form in scratch */
    for (int ab = 0; ab <= 256 && rc == CLOVER_OK; ab = ab ? ab * 8 : 32) {
        act a = {x, NULL, NULL, NULL};
        for (int i = 0; i < n && rc == CLOVER_OK; i++) {
            if (act_block(w[i].type) != ab) continue;
            if (ab && !a.q) {
                rc = grow(&g_q, act_q_bytes(T * ne0), err, err_size);
                if (rc == CLOVER_OK) rc = round_act(w[i].type, &a, T, ne0, err, err_size);
            }
            if (rc == CLOVER_OK) rc = product(w[i].type, w[i].dev, 0, ne0, w[i].ne1, a, T, y[i], NULL, 0, err, err_size);
        }
    }
    rc = launched(rc, "matmul_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_rmsnorm_d(const float *x, int64_t x_stride, const int32_t *idx, const float *w, int64_t n,
                                     int64_t rows, float eps, float *y, int64_t y_stride, char *err, size_t err_size) {
    if (!x || !w || !y || n <= 0 || rows <= 0 || rows > INT32_MAX) return bad_arg(err, err_size, "rmsnorm_d: bad arguments");
    LAUNCH(k_rmsnorm, dim3((unsigned)rows), dim3(32))(x, x_stride, idx, w, n, eps, y, y_stride);
    return launched(CLOVER_OK, "rmsnorm_d", err, err_size);
}

extern "C" int clover_cuda_head_norm_rope_d(float *x, int64_t T, int64_t n_head, int64_t row_stride, int64_t head_stride,
                                            const float *w, int64_t hd, float eps, const int64_t *pos, int32_t rope_dim,
                                            float theta, char *err, size_t err_size) {
    if (!x || !w || !pos || T <= 0 || T > 65535 || n_head <= 0 || n_head > INT32_MAX || hd <= 0 || hd > HD_MAX ||
        rope_dim < 0 || rope_dim > hd || rope_dim % 2)
        return bad_arg(err, err_size, "head_norm_rope_d: bad arguments (T <= 65535, head_dim <= 256, even rope_dim)");
    LAUNCH(k_head_norm_rope, dim3((unsigned)n_head, (unsigned)T), dim3(32))(x, row_stride, head_stride, w, hd, eps, pos,
                                                                           rope_dim, theta);
    return launched(CLOVER_OK, "head_norm_rope_d", err, err_size);
}

extern "C" int clover_cuda_attention_d(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                                       const int64_t *pos, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                                       int causal, float scale, float *out, char *err, size_t err_size) {
    if (!q || !k_cache || !v_cache || !out || !pos || T <= 0 || n_head <= 0 || n_head > 65535 || n_kv <= 0 ||
        n_head % n_kv || hd <= 0 || hd % 32 || hd > HD_MAX)
        return bad_arg(err, err_size, "attention_d: bad arguments");
    pthread_mutex_lock(&g_lock);
    int rc = attention_launch(q, k_cache, v_cache, kv_f16, out, pos, 0, T, n_head, n_kv, hd, causal, scale, err,
                              err_size);
    rc = launched(rc, "attention_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Element i of a KV cache of fp16 (f16: rounded to nearest even, as the CPU's) or float32 values
 * set to v. */
__device__ __forceinline__ void kv_put(void *c, bool f16, int64_t i, float v) {
    if (f16)
        ((__half *)c)[i] = __float2half_rn(v);
    else
        ((float *)c)[i] = v;
}

/* Rows t < T of kn, vn ([T][kvd]) into rows *pos + t of the caches ([n_ctx][kvd], element types
 * kv_f16). */
__global__ void k_kv_store(void *kc, void *vc, int kv_f16, const float *kn, const float *vn, const int64_t *pos,
                           int64_t n_ctx, int64_t T, int64_t kvd) {
    const int64_t t = blockIdx.x, p = *pos + t;
    if (p < 0 || p >= n_ctx) return; /* the host checked n_ctx; never past the cache */
    for (int64_t i = threadIdx.x; i < kvd; i += blockDim.x) {
        kv_put(kc, kv_f16 & CLOVER_KV_K_F16, p * kvd + i, kn[t * kvd + i]);
        kv_put(vc, kv_f16 & CLOVER_KV_V_F16, p * kvd + i, vn[t * kvd + i]);
    }
}

extern "C" int clover_cuda_kv_store_d(void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t kvd,
                                      const int64_t *pos, const float *k_new, const float *v_new, int64_t T, char *err,
                                      size_t err_size) {
    if (!k_cache || !v_cache || !pos || !k_new || !v_new || T <= 0 || T > INT32_MAX || kvd <= 0 || n_ctx < T)
        return bad_arg(err, err_size, "kv_store_d: bad arguments");
    LAUNCH(k_kv_store, dim3((unsigned)T), dim3(256))(k_cache, v_cache, kv_f16, k_new, v_new, pos, n_ctx, T, kvd);
    return launched(CLOVER_OK, "kv_store_d", err, err_size);
}

extern "C" int clover_cuda_conv_d(const float *w, const float *wr, const float *hist, const float *in, int64_t T,
                                  int64_t C, int32_t K, float *out, char *err, size_t err_size) {
    if (!w || !hist || !in || !out || T <= 0 || C <= 0 || K < 1 || K > CONV_K_MAX || T > INT64_MAX / C ||
        too_big(T * C))
        return bad_arg(err, err_size, "conv_d: bad arguments (d_conv <= 16)");
    LAUNCH(k_conv, cover(T * C), dim3(256))(w, wr, hist, in, T, C, K, out);
    return launched(CLOVER_OK, "conv_d", err, err_size);
}

extern "C" int clover_cuda_conv_hist_d(float *hist, const float *in, int64_t T, int64_t C, int32_t K, char *err,
                                       size_t err_size) {
    if (!hist || !in || T <= 0 || C <= 0 || K < 1 || K > CONV_K_MAX || too_big(C))
        return bad_arg(err, err_size, "conv_hist_d: bad arguments (d_conv <= 16)");
    if (K > 1) LAUNCH(k_conv_hist, cover(C), dim3(256))(hist, in, T, C, K);
    return launched(CLOVER_OK, "conv_hist_d", err, err_size);
}

extern "C" int clover_cuda_gdn_prep_d(float *conv, int64_t T, int64_t C, int64_t Hk, int64_t dk, float eps, float *b,
                                      float *a, const float *ssm_a, const float *dt_bias, int64_t Hv, char *err,
                                      size_t err_size) {
    const bool gated = b || a;
    if (!conv || T <= 0 || T > 65535 || Hk <= 0 || 2 * Hk > INT32_MAX || dk <= 0 || C < 2 * Hk * dk ||
        (gated && (!b || !a || !ssm_a || !dt_bias || Hv <= 0 || T > INT64_MAX / Hv || too_big(T * Hv))))
        return bad_arg(err, err_size, "gdn_prep_d: bad arguments (b and a: both or neither)");
    LAUNCH(k_gdn_qk_norm, dim3((unsigned)(2 * Hk), (unsigned)T), dim3(32))(conv, C, Hk, dk, eps);
    if (gated) LAUNCH(k_gdn_gates, cover(T * Hv), dim3(256))(b, a, ssm_a, dt_bias, T * Hv, Hv);
    return launched(CLOVER_OK, "gdn_prep_d", err, err_size);
}

extern "C" int clover_cuda_gdn_d(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                                 int64_t Hv, int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err,
                                 size_t err_size) {
    if (gdn_bad_args(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o))
        return bad_arg(err, err_size, "gdn_d: bad arguments");
    pthread_mutex_lock(&g_lock);
    const int rc = gdn_run(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return launched(rc, "gdn_d", err, err_size);
}

extern "C" int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                       int64_t C, const float *state, const float *lambda, const float *beta0,
                                       const float *c, const int64_t *pos, float *o, char *err, size_t err_size) {
    if (gdn_block_bad_args(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, o) || !pos)
        return bad_arg(err, err_size, "gdn_block_d: bad arguments (T, heads, dk <= 256, dv <= 1024 or C out of range)");
    gdn_block_launch(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, pos, 0, o);
    return launched(CLOVER_OK, "gdn_block_d", err, err_size);
}

extern "C" int clover_cuda_gdn_out_d(float *o, const float *z, const float *w, int64_t T, int64_t Hv, int64_t dv,
                                     float eps, char *err, size_t err_size) {
    if (!o || !z || !w || T <= 0 || T > 65535 || Hv <= 0 || Hv > INT32_MAX || dv <= 0)
        return bad_arg(err, err_size, "gdn_out_d: bad arguments");
    LAUNCH(k_gdn_out, dim3((unsigned)Hv, (unsigned)T), dim3(32))(o, z, w, Hv, dv, eps);
    return launched(CLOVER_OK, "gdn_out_d", err, err_size);
}

extern "C" int clover_cuda_route_d(float *probs, int64_t T, int64_t E, int32_t k, float coreset_top_p, int32_t *sel,
                                   float *wsel, int32_t *prow, float *pw, int32_t *pair, void *tiles, int32_t *stats,
                                   char *err, size_t err_size) {
    if (!probs || !sel || !wsel || !prow || !pw || !pair || !tiles || !stats || T <= 0 || E <= 0 ||
        E > E_MAX || k <= 0 || k > E || T > INT32_MAX / k / 2)
        return bad_arg(err, err_size, "route_d: bad arguments (n_expert <= 1024)");
    LAUNCH(k_route, dim3(1), dim3(1024))(probs, T, E, k, coreset_top_p, coreset_top_p > 0.0f, sel, wsel, prow, pw,
                                        pair, (tile *)tiles, clover_cuda_route_tiles(T * k, E), stats);
    return launched(CLOVER_OK, "route_d", err, err_size);
}

extern "C" int clover_cuda_gather_d(const float *x, const int32_t *rows, int64_t n, int64_t H, float *y, char *err,
                                    size_t err_size) {
    if (!x || !rows || !y || n <= 0 || H <= 0 || n > INT64_MAX / H || too_big(n * H))
        return bad_arg(err, err_size, "gather_d: bad arguments");
    LAUNCH(k_gather, cover(n * H), dim3(256))(x, rows, n, H, y);
    return launched(CLOVER_OK, "gather_d", err, err_size);
}

extern "C" int clover_cuda_experts_d(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                     const clover_cuda_weight *down, const void *tiles, int64_t n_tiles, int64_t P,
                                     const float *xg, float *yg, char *err, size_t err_size) {
    if (!gate || !up || !down || !gate->dev || !up->dev || !down->dev || !tiles || n_tiles <= 0 || P <= 0 || !xg || !yg)
        return bad_arg(err, err_size, "experts_d: bad arguments");
    const int64_t H = gate->ne0, I = gate->ne1;
    if (H <= 0 || I <= 0 || I > INT32_MAX || H > INT32_MAX || up->ne0 != H || up->ne1 != I || down->ne0 != I ||
        down->ne1 != H || P > INT64_MAX / 4 / (H > I ? H : I))
        return bad_arg(err, err_size, "experts_d: gate/up must be [I][H] and down [H][I]");
    pthread_mutex_lock(&g_lock);
    int rc = experts_on_device(gate, up, down, (const tile *)tiles, n_tiles, P, xg, yg, err, err_size);
    rc = launched(rc, "experts_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_swiglu_d(float *g, const float *u, int64_t n, char *err, size_t err_size) {
    if (!g || !u || too_big(n)) return bad_arg(err, err_size, "swiglu_d: bad arguments");
    LAUNCH(k_swiglu, cover(n), dim3(256))(g, u, n);
    return launched(CLOVER_OK, "swiglu_d", err, err_size);
}

extern "C" int clover_cuda_moe_combine_d(float *x, const float *yg, const float *pw, const int32_t *pair, int32_t k,
                                         const float *ys, const float *sg, int64_t T, int64_t H, int32_t *bad, char *err,
                                         size_t err_size) {
    if (!x || !yg || !pw || !pair || k <= 0 || !ys || !sg || !bad || T <= 0 || H <= 0 || T > INT64_MAX / H ||
        too_big(T * H))
        return bad_arg(err, err_size, "moe_combine_d: bad arguments");
    LAUNCH(k_moe_combine, cover(T * H), dim3(256))(x, yg, pw, pair, k, ys, sg, T, H, bad);
    return launched(CLOVER_OK, "moe_combine_d", err, err_size);
}

extern "C" int clover_cuda_add_d(float *x, const float *o, int64_t n, int32_t *bad, char *err, size_t err_size) {
    if (!x || !o || !bad || too_big(n)) return bad_arg(err, err_size, "add_d: bad arguments");
    LAUNCH(k_add, cover(n), dim3(256))(x, o, n, bad);
    return launched(CLOVER_OK, "add_d", err, err_size);
}

/* native/sampler.c clover_apply_logit_ops on row blockIdx.x of Z, by one thread, in order. */
__global__ void k_logit_ops(float *Z, int64_t V, const clover_logit_op *ops, const int32_t *start, float rep, float freq,
                            float pres, float *pre) {
    float *z = Z + (int64_t)blockIdx.x * V;
    for (int32_t k = start[blockIdx.x]; k < start[blockIdx.x + 1]; k++) {
        if (pre && ops[k].id >= 0 && ops[k].id < V) pre[k] = z[ops[k].id];
        clover_logit_op_apply(z, V, ops[k], rep, freq, pres);
    }
}

/* clover_sample at temperature 0 (native/sampler.c) on row blockIdx.x of Z, 256 threads: the
 * argmax over ids other than mask (the lowest id among equal maxima, the CPU's first strict
 * maximum), then 1 / sum of exp(z - z_max) in double, as tree reductions. */
__global__ void k_greedy(const float *Z, int64_t V, int32_t mask, int32_t *ids, float *conf) {
    __shared__ float sv[256];
    __shared__ int32_t si[256];
    __shared__ double ss[256];
    const float *z = Z + (int64_t)blockIdx.x * V;
    const int tid = threadIdx.x;
    float bv = -FLT_MAX;
    int32_t bi = -1;
    for (int64_t i = tid; i < V; i += 256) {
        if (i == mask) continue;
        if (bi < 0 || z[i] > bv) bv = z[i], bi = (int32_t)i;
    }
    sv[tid] = bv, si[tid] = bi;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (tid < s) {
            const float ov = sv[tid + s];
            const int32_t oi = si[tid + s];
            if (oi >= 0 && (si[tid] < 0 || ov > sv[tid] || (ov == sv[tid] && oi < si[tid]))) sv[tid] = ov, si[tid] = oi;
        }
        __syncthreads();
    }
    const float zmax = sv[0];
    const int32_t best = si[0];
    double sum = 0;
    for (int64_t i = tid; i < V && best >= 0; i += 256)
        if (i != mask) sum += exp((double)z[i] - zmax);
    __syncthreads(); /* every thread has read sv[0] and si[0] */
    ss[tid] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (tid < s) ss[tid] += ss[tid + s];
        __syncthreads();
    }
    if (tid == 0) {
        ids[blockIdx.x] = best;
        conf[blockIdx.x] = best < 0 ? 0.0f : (float)(1.0 / ss[0]);
    }
}

extern "C" int clover_cuda_greedy_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                                    float repetition, float frequency, float presence, int32_t mask_id, int32_t *id,
                                    float *conf, char *err, size_t err_size) {
    if (!z || !start || !id || !conf || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX)
        return bad_arg(err, err_size, "greedy_d: bad arguments");
    LAUNCH(k_logit_ops, dim3((unsigned)n), dim3(1))(z, V, ops, start, repetition, frequency, presence, (float *)NULL);
    LAUNCH(k_greedy, dim3((unsigned)n), dim3(256))(z, V, mask_id, id, conf);
    return launched(CLOVER_OK, "greedy_d", err, err_size);
}

/* Rank key of candidate (z, id) for k_top_k: larger z first (IEEE bits mapped to an unsigned
 * order, -0 as +0 so equal floats tie as on the CPU), then smaller id; distinct per id. */
__device__ __forceinline__ uint64_t cand_key(float z, int64_t i) {
    uint32_t b = 0;
    if (z != 0.0f) memcpy(&b, &z, 4);
    b = b & 0x80000000u ? ~b : b | 0x80000000u;
    return (uint64_t)b << 32 | (uint32_t) ~(uint32_t)i;
}

enum { TOP_K_THREADS = 1024 };

/* clover_sample's top-k candidates (native/sampler.c top_k_cands) of row blockIdx.x of Z: a radix
 * select over the 64-bit rank keys, 8 bits a pass from the top (a 256-bin histogram of the keys
 * that share the prefix chosen so far), until the bin holding the k-th key is taken whole; then
 * the keys at or above that bin (exactly k) are gathered and placed by rank. Usually 3-4 passes
 * over the row: the float's top bits, then mantissa bits, separate the candidates. */
__global__ void __launch_bounds__(TOP_K_THREADS) k_top_k(const float *Z, int64_t V, int32_t mask, int32_t k,
                                                          clover_cand *out, float *bad) {
    __shared__ uint32_t hist[256];
    __shared__ uint64_t sel[CLOVER_CUDA_TOP_K_MAX];
    __shared__ uint64_t s_prefix;
    __shared__ int32_t s_need, s_done, s_bad;
    __shared__ uint32_t s_n;
    const float *z = Z + (int64_t)blockIdx.x * V;
    const int tid = threadIdx.x;
    if (tid == 0) s_bad = 0, s_n = 0;
    uint64_t prefix = 0;
    int32_t need = k;
    int shift = 56;
    for (;; shift -= 8) {
        for (int i = tid; i < 256; i += TOP_K_THREADS) hist[i] = 0;
        __syncthreads();
        const uint64_t hi = shift == 56 ? 0 : ~0ull << (shift + 8);
        int nonfinite = 0;
        for (int64_t i = tid; i < V; i += TOP_K_THREADS) {
            if (i == mask) continue; /* -inf by its edit */
            const float v = z[i];
            if (shift == 56 && (isnan(v) || v == INFINITY)) nonfinite = 1; /* -inf: an edit's, as greedy */
            const uint64_t key = cand_key(v, i);
            if ((key & hi) == prefix) atomicAdd(&hist[(key >> shift) & 255], 1u);
        }
        if (nonfinite) s_bad = 1;
        __syncthreads();
        if (tid == 0) { /* the bin, from the top, where the count reaches need */
            uint32_t cum = 0;
            int d = 255;
            while (d > 0 && cum + hist[d] < (uint32_t)need) cum += hist[d--];
            s_need = need - (int32_t)cum;
            s_prefix = prefix | (uint64_t)d << shift;
            s_done = hist[d] == (uint32_t)s_need;
        }
        __syncthreads();
        prefix = s_prefix, need = s_need;
        if (s_done || shift == 0) break;
    }
    const uint64_t top = prefix >> shift;
    for (int64_t i = tid; i < V; i += TOP_K_THREADS) {
        if (i == mask) continue;
        const uint64_t key = cand_key(z[i], i);
        if (key >> shift >= top) {
            const uint32_t slot = atomicAdd(&s_n, 1u);
            if (slot < CLOVER_CUDA_TOP_K_MAX) sel[slot] = key;
        }
    }
    __syncthreads();
    for (int j = tid; j < k; j += TOP_K_THREADS) {
        int r = 0;
        for (int q = 0; q < k; q++) r += sel[q] > sel[j];
        const int32_t id = (int32_t) ~(uint32_t)sel[j];
        out[(int64_t)blockIdx.x * k + r] = clover_cand{z[id], id};
    }
    if (tid == 0) bad[blockIdx.x] = s_bad ? NAN : 0.0f;
}

extern "C" int clover_cuda_top_k_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                                   float repetition, float frequency, float presence, int32_t mask_id, int32_t k,
                                   clover_cand *cand, float *bad, float *pre, char *err, size_t err_size) {
    const int64_t ids = clover_cand_ids(V, mask_id);
    if (!z || !start || !cand || !bad || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX || k < 1 ||
        k > CLOVER_CUDA_TOP_K_MAX || k > ids)
        return bad_arg(err, err_size, "top_k_d: bad arguments");
    LAUNCH(k_logit_ops, dim3((unsigned)n), dim3(1))(z, V, ops, start, repetition, frequency, presence, pre);
    LAUNCH(k_top_k, dim3((unsigned)n), dim3(TOP_K_THREADS))(z, V, mask_id, k, cand, bad);
    return launched(CLOVER_OK, "top_k_d", err, err_size);
}

/* The tempered weight of row blockIdx.x of Z (edited) for top-p alone (native/sampler.c
 * clover_sample): total = sum over ids other than mask of (float)exp((double)(z - zmax) / T) in
 * double, zmax the row's first candidate (cand[row][0]); 256 threads, a fixed reduction order (not
 * the CPU's vocabulary order). */
__global__ void k_row_total(const float *Z, int64_t V, int32_t mask, const clover_cand *cand, int32_t k, float T,
                            double *total) {
    __shared__ double ss[256];
    const float *z = Z + (int64_t)blockIdx.x * V;
    const float zmax = cand[(int64_t)blockIdx.x * k].z;
    double sum = 0;
    for (int64_t i = threadIdx.x; i < V; i += 256)
        if (i != mask) sum += (float)exp((double)(z[i] - zmax) / T);
    ss[threadIdx.x] = sum;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) ss[threadIdx.x] += ss[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) total[blockIdx.x] = ss[0];
}

extern "C" int clover_cuda_row_total_d(const float *z, int64_t n, int64_t V, int32_t mask_id, const clover_cand *cand,
                                       int32_t k, float temperature, double *total, char *err, size_t err_size) {
    if (!z || !cand || !total || n <= 0 || n > INT32_MAX || V <= 0 || V > INT32_MAX || k < 1 ||
        !(temperature > 0.0f))
        return bad_arg(err, err_size, "row_total_d: bad arguments");
    LAUNCH(k_row_total, dim3((unsigned)n), dim3(256))(z, V, mask_id, cand, k, temperature, total);
    return launched(CLOVER_OK, "row_total_d", err, err_size);
}

__global__ void k_copy(float *dst, const float *src, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[i];
}

extern "C" int clover_cuda_copy_d(float *dst, const float *src, int64_t n, char *err, size_t err_size) {
    if (n == 0) return CLOVER_OK;
    if (!dst || !src || too_big(n)) return bad_arg(err, err_size, "copy_d: bad arguments");
    LAUNCH(k_copy, cover(n), dim3(256))(dst, src, n);
    return launched(CLOVER_OK, "copy_d", err, err_size);
}

/* ---- CUDA graphs (cuda_backend.h) */

extern "C" int64_t clover_cuda_scratch_epoch(void) {
    pthread_mutex_lock(&g_lock);
    const int64_t e = g_epoch;
    pthread_mutex_unlock(&g_lock);
    return e;
}

extern "C" void clover_cuda_release_scratch(void) {
    pthread_mutex_lock(&g_lock);
    scratch *all[] = {&g_x, &g_y, &g_gate, &g_up, &g_tiles, &g_q, &g_gdn, &g_h, &g_att};
    for (scratch *s : all) {
        if (s->p) cudaFree(s->p);
        s->p = NULL;
        s->cap = 0;
    }
    g_epoch++;
    pthread_mutex_unlock(&g_lock);
}

extern "C" int clover_cuda_capture_begin(char *err, size_t err_size) {
    cudaStream_t s = stream();
    if (!s) {
        if (err && err_size) snprintf(err, err_size, "CUDA: no stream to capture");
        return CLOVER_E_DEVICE;
    }
    const cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaStreamBeginCapture", e);
    return CLOVER_E_DEVICE;
}

extern "C" int clover_cuda_capture_end(void **graph, char *err, size_t err_size) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    *graph = NULL;
    cudaError_t e = cudaStreamEndCapture(stream(), &g);
    if (e == cudaSuccess) {
        e = cudaGraphInstantiateWithFlags(&x, g, 0);
        cudaGraphDestroy(g);
    }
    (void)cudaGetLastError(); /* a failed capture leaves its error: reported here, not at the next launch */
    if (e != cudaSuccess) {
        set_err(err, err_size, "capturing a CUDA graph", e);
        return CLOVER_E_DEVICE;
    }
    *graph = (void *)x;
    return CLOVER_OK;
}

extern "C" int clover_cuda_graph_launch(void *graph, char *err, size_t err_size) {
    if (!graph) return bad_arg(err, err_size, "graph_launch: no graph");
    const cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, stream());
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaGraphLaunch", e);
        return CLOVER_E_DEVICE;
    }
    return launched(CLOVER_OK, "graph_launch", err, err_size);
}

extern "C" void clover_cuda_graph_free(void *graph) {
    if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}
