/* dot.h: per-type dot-product kernels of quantised weight rows against quantised activations
 * (internal). As in ggml, each weight type is paired with an activation format that the
 * activation row is quantised to once per product call:
 *   Q8_0, Q4_0, IQ4_NL, MXFP4  x  Q8_0 activations (blocks of 32)
 *   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS   x  Q8_K activations (blocks of 256)
 * Every type has a portable scalar kernel (dot.c clover_dot_scalar, the reference) and optional AVX2
 * (dot_avx2.c) and AVX-512 VNNI (dot_avx512.c) kernels, chosen at run time from the CPU's
 * features; every SIMD kernel is tested against the scalar one (tests/native/test_dot.py).
 */
#ifndef CLOVER_DOT_H
#define CLOVER_DOT_H

#include <stdint.h>

#define CLOVER_QK_K 256

/* ggml block_q8_K: the activation format of the K-quants. */
typedef struct {
    float d;
    int8_t qs[CLOVER_QK_K];
    int16_t bsums[CLOVER_QK_K / 16]; /* sums of qs in groups of 16 */
} clover_block_q8_K;

/* dot(w_row, x) for n elements (n a multiple of the type's block size): w_row in the weight
 * type's blocks, xq the activation row in the paired format. */
typedef float (*clover_vec_dot_fn)(int64_t n, const void *w_row, const void *xq);

/* Software prefetch of the weight stream, CLOVER_PF_AHEAD bytes ahead of p, `lines` cache
 * lines (at least the bytes one loop step consumes). A single-row mat-vec streams each weight
 * byte once; one core's hardware prefetchers alone kept it at ~60% of the read bandwidth on the
 * development machine (Q6_K LM head, 2 threads: 23.0 ms without, 16.3 ms = 25.6 of 30.1 GB/s
 * at 2 KiB ahead). Distance from a sweep of the real-dims 4-layer tg step (1, 2, 4, 8 KiB:
 * Q4_K_M 32.6, 29.8, 28.9, 28.8 ms; Q8_0 -, 42.0, 39.1, 39.6 ms). */
#ifndef CLOVER_PF_AHEAD
#define CLOVER_PF_AHEAD 4096
#endif
#define CLOVER_PREFETCH(p, lines)                                                                  \
    do {                                                                                           \
        const char *pf_ = (const char *)(p) + CLOVER_PF_AHEAD;                                     \
        for (int l_ = 0; l_ < (lines); l_++) __builtin_prefetch(pf_ + 64 * l_, 0, 3);              \
    } while (0)

enum { CLOVER_ISA_SCALAR = 0, CLOVER_ISA_AVX2 = 1, CLOVER_ISA_AVX512 = 2 };

/* Activation format paired with weight type `type` (CLOVER_TYPE_Q8_0 or CLOVER_TYPE_Q8_K), or
 * -1 when the type has no quantised kernel (F32, F16, BF16 use float kernels). */
int clover_dot_act_type(int type);

/* The kernel for `type` at instruction set `isa`; NULL when this build or CPU lacks it.
 * isa < 0 means the best one this CPU supports. */
clover_vec_dot_fn clover_dot_kernel(int type, int isa);

/* Best instruction set this CPU supports (CLOVER_ISA_*); CLOVER_ISA env var can lower it. */
int clover_dot_best_isa(void);

/* Quantise one activation row of n floats to `act_type` (Q8_0: n % 32 == 0; Q8_K:
 * n % 256 == 0) into dst; returns bytes written or -1. */
int64_t clover_quantize_act(int act_type, const float *x, void *dst, int64_t n);

/* Per-ISA tables (NULL entries where a type has no kernel for that ISA). */
clover_vec_dot_fn clover_dot_scalar(int type);
clover_vec_dot_fn clover_dot_avx2(int type);
clover_vec_dot_fn clover_dot_avx512(int type);

/* Multi-row kernels: out[i] = dot(w_row, xq + i * x_stride bytes) for i < 4, the same value as
 * 4 calls of the single-row kernel of the same ISA up to float summation order. One weight row's
 * unpacking and loads serve 4 activation rows (the many-row case: prefill, block forwards).
 * NULL where a type has none; matmul then uses the single-row kernel. */
typedef void (*clover_vec_dot4_fn)(int64_t n, const void *w_row, const void *xq, int64_t x_stride, float *out);

/* Best multi-row kernel for `type` on this CPU, or NULL: the AVX-512 one where the best ISA
 * (CLOVER_ISA lowers it) is AVX-512, the AVX2 one where it is AVX2. */
clover_vec_dot4_fn clover_dot4_kernel(int type);
/* AVX2 multi-row kernels (dot_avx2.c: Q8_0, Q4_0, IQ4_NL, MXFP4 on split Q8_0 rows;
 * dot_k4_avx2.c through clover_dot4_k_avx2: Q4_K, Q5_K on paired Q8_K rows, Q6_K, IQ4_XS on plain
 * ones): each out[i] equals, bit for bit, the one-row kernel on that layout (clover_dot1_x4_avx2;
 * Q6_K, IQ4_XS: the single-row AVX2 kernel). NULL for other types and on non-x86 builds. */
clover_vec_dot4_fn clover_dot4_avx2(int type);
clover_vec_dot4_fn clover_dot4_k_avx2(int type);

/* Float kernels of attention over an F16 or F32 KV cache (cpu/attend.c attend_tile): q . k for n
 * float32 values q and n fp16 (float32) values k, and o[i] += p * v[i] for n fp16 (float32)
 * values v (fp16 as IEEE binary16 bits). The AVX2 ones convert 8 values an instruction (F16C,
 * part of this file's AVX2 level) and sum the dot in 16 lanes (F32: 32 lanes); the scalar ones
 * convert with clover_h2f and sum in order. clover_*_f16_kernel(isa), clover_*_f32_kernel(isa):
 * the AVX2 kernel when isa (< 0 or past this CPU's: its best) is AVX2 or wider, else the scalar
 * one. */
typedef float (*clover_dot_f16_fn)(const float *q, const uint16_t *k, int64_t n);
typedef void (*clover_axpy_f16_fn)(float *o, float p, const uint16_t *v, int64_t n);
clover_dot_f16_fn clover_dot_f16_kernel(int isa);
clover_axpy_f16_fn clover_axpy_f16_kernel(int isa);
clover_dot_f16_fn clover_dot_f16_avx2(void); /* NULL where this build has no AVX2 code */
clover_axpy_f16_fn clover_axpy_f16_avx2(void);
typedef float (*clover_dot_f32_fn)(const float *q, const float *k, int64_t n);
typedef void (*clover_axpy_f32_fn)(float *o, float p, const float *v, int64_t n);
clover_dot_f32_fn clover_dot_f32_kernel(int isa);
clover_axpy_f32_fn clover_axpy_f32_kernel(int isa);
clover_dot_f32_fn clover_dot_f32_avx2(void);
clover_axpy_f32_fn clover_axpy_f32_avx2(void);
/* The F32 kernels over several keys at once, equal bit for bit to the AVX2 ones above called key
 * by key (AVX-512VL: more registers, fewer loads). dot_f32x4: out[r] = q . k_r for the 4 keys
 * k_r = k + r k_stride (n values each); axpy_f32_rows: o[i] += p[j] v_j[i] for the rows
 * v_j = v + j v_stride, j < n_rows in order. clover_*_kernel(): NULL unless this CPU's best ISA
 * (CLOVER_ISA lowers it) is AVX-512. */
typedef void (*clover_dot_f32x4_fn)(const float *q, const float *k, int64_t k_stride, int64_t n, float *out);
typedef void (*clover_axpy_f32_rows_fn)(float *o, const float *p, const float *v, int64_t v_stride, int64_t n_rows,
                                        int64_t n);
clover_dot_f32x4_fn clover_dot_f32x4_kernel(void);
clover_axpy_f32_rows_fn clover_axpy_f32_rows_kernel(void);
clover_dot_f32x4_fn clover_dot_f32x4_avx512(void);
clover_axpy_f32_rows_fn clover_axpy_f32_rows_avx512(void);
/* The same over fp16 keys and values, equal bit for bit to the AVX2 F16 kernels key by key. */
typedef void (*clover_dot_f16x4_fn)(const float *q, const uint16_t *k, int64_t k_stride, int64_t n, float *out);
typedef void (*clover_axpy_f16_rows_fn)(float *o, const float *p, const uint16_t *v, int64_t v_stride,
                                        int64_t n_rows, int64_t n);
clover_dot_f16x4_fn clover_dot_f16x4_kernel(void);
clover_axpy_f16_rows_fn clover_axpy_f16_rows_kernel(void);
clover_dot_f16x4_fn clover_dot_f16x4_avx512(void);
clover_axpy_f16_rows_fn clover_axpy_f16_rows_avx512(void);

/* A float32 matrix product, the chunk-level products of the chunked GDN (cpu/gdn_heads.c
 * gdn_chunked_head): C[i][n] += alpha * sum_m A[i lda + m] B[m ldb + n] for i < M, n < N, m < K
 * (row-major, leading dimensions lda, ldb, ldc in floats; C must not overlap A or B). Blocks of
 * 4 rows x 16 (portable: 8) columns keep their sums in registers while B streams once per block;
 * each sum runs over m in order. clover_gemm_f32_kernel(isa): the AVX2 + FMA kernel when isa (< 0
 * or past this CPU's: its best) is AVX2 or wider, else the portable one (GCC vector extensions;
 * multiplies and adds, fused only where the compiler contracts them), never NULL. */
typedef void (*clover_gemm_f32_fn)(int64_t M, int64_t N, int64_t K, float alpha, const float *A, int64_t lda,
                                   const float *B, int64_t ldb, float *C, int64_t ldc);
clover_gemm_f32_fn clover_gemm_f32_kernel(int isa);
clover_gemm_f32_fn clover_gemm_f32_avx2(void); /* NULL where this build has no AVX2 code */

/* The AVX-512 4-row kernels of the Q8_0 family (Q8_0, Q4_0, IQ4_NL, MXFP4) read activation
 * rows in a packed layout made from Q8_0 rows by clover_x4_pack_q8_0, those of Q4_K and Q5_K
 * Q8_K rows in the K-permuted layout made by clover_x4_pack_q8_K, and the other K-quant ones
 * Q8_K rows as they are. The AVX2 4-row kernels read Q8_0 rows in the split layout made by
 * clover_x4_split_q8_0, Q8_K rows of Q4_K and Q5_K in the paired layout made by clover_x4_pair_q8_K
 * and the others' as they are. clover_dot4_packed(type) says which layout clover_dot4_kernel(type)
 * reads (1: Q8_0 packed, 2: K-permuted, 3: Q8_0 split, 4: paired, 0: as they are). Packed row of n values (n % 32 == 0, nb = n / 32 blocks): n bytes q + 128
 * (uint8, block after block), then per pair of blocks 16 floats, 8 copies of each block's
 * scale (a lone last block fills 8 of them): clover_x4_row_bytes(n) = n + 64 * ceil(nb / 2)
 * bytes. K-permuted row of n values (n % 256 == 0): the Q8_K blocks with the same d, qs
 * reordered so that byte 64 s + 8 b + i holds value 8 s + i of sub-block b (values 32 b ..
 * 32 b + 31) for s < 4, b < 8, i < 8 (dot_k.c's sub-block lanes), and bsums[b] the sum of
 * sub-block b (bsums[8..15] = 0); the same size. */
/* Split row of n values (n % 32 == 0, nb = n / 32 blocks): the n int8 q, in groups of 4 blocks
 * (128 bytes: byte 32 m + 8 k + i holds value 8 m + i of the group's block k, m, k < 4, i < 8),
 * the last nb % 4 blocks as they are, then the nb block scales as float (the fp16 ones
 * converted, exactly): clover_x4_split_row_bytes(n) = n + 4 nb bytes. Paired row of n values (n % 256 == 0; the
 * AVX2 Q4_K and Q5_K 4-row kernels, dot_k4_avx2.c): the Q8_K blocks with the same d, qs reordered
 * so that byte 64 s + 32 h + 8 k + i holds value 8 s + i of sub-block 2 k + h (the even
 * sub-blocks' pieces s in the first 32 bytes of each 64, the odd ones' in the second) for s < 4,
 * h < 2, k < 4, i < 8, and bsums as in the K-permuted layout; made by clover_x4_pair_q8_K,
 * clover_dot4_packed 4; the same size. */
int clover_dot4_packed(int type);
void clover_x4_pair_q8_K(const void *xq, void *dst, int64_t n);
/* One-row kernels on the AVX2 4-row kernels' layouts (split Q8_0 rows for Q8_0, Q4_0, IQ4_NL,
 * MXFP4, in cpu/x86/dot_avx2.c; paired Q8_K rows for Q4_K and Q5_K, in dot_k4_avx2.c): each runs
 * the 4-row kernel's steps for one row, so a row's value is the same alone or in a 4-row pass.
 * clover_dot1_x4_kernel(type): that kernel where the best ISA (CLOVER_ISA lowering it) is AVX2,
 * else NULL; matmul then gives every row the layout clover_dot4_packed names. clover_dot1_x4_avx2,
 * clover_dot_paired_avx2 (Q4_K and Q5_K only): NULL for other types and on non-x86 builds. */
clover_vec_dot_fn clover_dot1_x4_kernel(int type);
clover_vec_dot_fn clover_dot1_x4_avx2(int type);
clover_vec_dot_fn clover_dot_paired_avx2(int type);
int64_t clover_x4_split_row_bytes(int64_t n);
void clover_x4_split_q8_0(const void *xq, void *dst, int64_t n);
int64_t clover_x4_row_bytes(int64_t n);
void clover_x4_pack_q8_0(const void *xq, void *dst, int64_t n);
void clover_x4_pack_q8_K(const void *xq, void *dst, int64_t n);
clover_vec_dot4_fn clover_dot4_avx512(int type);

/* K-quant kernels against Q8_K (dot_k.c: Q4_K, Q5_K, Q6_K, IQ4_XS, and through the k23 getters
 * Q2_K, Q3_K); NULL for other types. */
clover_vec_dot_fn clover_dot_k_scalar(int type);
clover_vec_dot_fn clover_dot_k_avx2(int type);
clover_vec_dot_fn clover_dot_k_avx512(int type);
/* Q2_K and Q3_K (kquants23.c): scalar and AVX2 only (no AVX-512 kernel: clover_dot_kernel falls
 * back to the AVX2 one); NULL for other types. */
clover_vec_dot_fn clover_dot_k23_scalar(int type);
clover_vec_dot_fn clover_dot_k23_avx2(int type);
/* Four-row AVX-512 K-quant kernels (dot_k.c; see clover_vec_dot4_fn): each out[i] equals the
 * single-row AVX-512 kernel's value bit for bit. NULL for other types and on non-x86 builds. */
clover_vec_dot4_fn clover_dot4_k_avx512(int type);

#endif
