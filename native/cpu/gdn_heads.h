/* gdn_heads.h: the per-head Gated DeltaNet kernels on the CPU (clover-spec 2.1 steps 5-6: the
 * recurrence, token by token or chunked; 3.3 steps 3-4: the block operator's mixing), under
 * model/gdn.c's gdn_layer. */
#ifndef CLOVER_CPU_GDN_HEADS_H
#define CLOVER_CPU_GDN_HEADS_H

#include "core/errors.h"
#include "model/model.h"

enum { GDN_FORWARD, GDN_FORWARD_CHUNKED };

/* Floats of scratch one thread of gdn_recurrence (block 0) or bd_heads (block 1) needs for T rows. */
CLOVER_HIDDEN int64_t gdn_heads_scratch_floats(const gdn_dims *d, int block, int64_t T);
/* The recurrence of kind GDN_FORWARD* over all value heads on nth threads, advancing state
 * [Hv][dk][dv]; o: [T][Hv*dv]; thread i's scratch at ts + i * stride bytes
 * (gdn_heads_scratch_floats). */
CLOVER_HIDDEN int gdn_recurrence(int kind, const gdn_dims *d, const float *conv, const float *beta, const float *g,
                                 int64_t T, float *state, float *o, int nth, char *ts, size_t stride);
/* The block operator's mixing over every value head of layer ly after P clean tokens; state: the
 * layer's clean state [Hv][dk][dv], read only; scratch as gdn_recurrence's. */
CLOVER_HIDDEN int bd_heads(const gdn_dims *d, const clover_layer *ly, const float *conv, const float *state, int64_t T,
                           int64_t P, float *o, int nth, char *ts, size_t stride);

#endif
