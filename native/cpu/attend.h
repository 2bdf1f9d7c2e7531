/* attend.h: attention of query rows over a KV cache on the CPU (clover-spec 2.2 steps 3-4), the
 * kernel under model/attention.c's attention_layer. */
#ifndef CLOVER_CPU_ATTEND_H
#define CLOVER_CPU_ATTEND_H

#include "core/errors.h"
#include "quant/dot.h"
#include <stdint.h>

/* A layer's KV cache as attend_tile reads it: K and V rows kvd elements apart, each fp16 (dot_k,
 * axpy_v: the F16 kernels of dot.h; NULL for float32) or float32 (dot_k32, axpy_v32); where the
 * CPU has them, the several-key forms of the cache's types, equal to those bit for bit. */
typedef struct {
    const char *k, *v;
    int64_t kvd;
    clover_dot_f16_fn dot_k;
    clover_axpy_f16_fn axpy_v;
    clover_dot_f32_fn dot_k32;
    clover_axpy_f32_fn axpy_v32;
    clover_dot_f32x4_fn dot_k32x4;         /* float32 K: 4 keys a call, or NULL */
    clover_axpy_f32_rows_fn axpy_v32_rows; /* float32 V: a run of rows a call, or NULL */
    clover_dot_f16x4_fn dot_k16x4;         /* fp16 K: 4 keys a call, or NULL */
    clover_axpy_f16_rows_fn axpy_v16_rows; /* fp16 V: a run of rows a call, or NULL */
} kv_view;

/* ATT_KEY_TILE keys a step (64 KiB of float32 K rows at head_dim 256: L2-resident); tiles of up
 * to ATT_ROWS query rows; ATT_SCRATCH: a thread's score scratch, in floats (8 MiB). */
enum { ATT_KEY_TILE = 64, ATT_ROWS = 16, ATT_SCRATCH = 2 << 20 };
/* One layer's attention call, as attend_tile reads it: off is the KV head's offset in a cache row. */
typedef struct {
    const float *qg;
    float *att;
    int64_t nh, hd, off, pos0, n_keys_max;
    int causal;
    float scale;
} att_job;

/* Attention of query rows [t0, t0 + nt) and heads [h0, h0 + nhc) of one GQA group (attend.c). */
CLOVER_HIDDEN void attend_tile(const att_job *a, const kv_view *kv, int64_t t0, int64_t nt, int64_t h0, int64_t nhc, float *sc,
                 double *sum);

#endif
