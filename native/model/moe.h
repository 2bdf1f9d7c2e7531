/* moe.h: the MoE layer on the CPU path (model/moe.c); its GPU-resident twin is
 * gpu/moe_resident.h. */
#ifndef CLOVER_MODEL_MOE_H
#define CLOVER_MODEL_MOE_H

#include "model/pass.h"

/* The routed experts on the CPU: expert e over its bucket [start[e], start[e+1]) of xg into yg.
 * Non-zero on failure (out of memory). */
CLOVER_HIDDEN int cpu_experts(clover_context *c, const clover_layer *ly, int64_t I, int64_t H, int64_t E, int32_t n_used,
                const int64_t *start, const float *xg, float *yg);
/* The MoE layer (clover-spec 2.3; coreset in block mode, 5.6) of layer il over a pass's L->T rows
 * xn into out: every row routed alone, the coreset of each block-mode entry e[i] over its rows,
 * each used expert once over the rows of every entry routed to it. */
CLOVER_HIDDEN int moe_layer(fwd *L, pass_entry *e, int n, const clover_layer *ly, int il, const float *xn, float *out);

#endif
