/* matmul.cuh: part of cuda.cu (included there, in order, after the parts before it): the weight products: dequantisation (dequant.cuh), the per-type product kernels (tensor-core ones: mma.cuh), SwiGLU and the activation quantisers. */
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
 * row, the integer sums exact (dp4a), as the CPU's dot products form them (quant/dot.h) up to
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

/* Activations as the CPU engine multiplies them with quantised weights (quant/dot.h): each
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

/* Q8_0 (quant/dot.c quantize_act_q8_0): d = fp16(amax/127), q = rint(x * (127/amax)). */
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

/* Q8_K (native/quant/kquants.c q8_k_quant, ggml's quantize_row_q8_K_ref): vmax = the first element
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
