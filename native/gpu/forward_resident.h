/* forward_resident.h: the GPU-resident forward pass (gpu/forward_resident.c); twin of
 * model/forward.c's cpu_forward. */
#ifndef CLOVER_GPU_FORWARD_RESIDENT_H
#define CLOVER_GPU_FORWARD_RESIDENT_H

#include "model/pass.h"

/* How many passes of c replayed a CUDA graph (gpu/forward_resident.c res_layer_loop_graph), for tests. */
int64_t clover_context_graph_launches(const clover_context *c);
/* How many forward passes c ran (a long prefill takes several: model/forward.c forward), for tests. */
int64_t clover_context_passes(const clover_context *c);
/* How many rows of c's top-p selections on the GPU came back whole (their top-p prefix did not end
 * within the candidates), for tests. */
int64_t clover_context_full_rows(const clover_context *c);
/* One resident pass over f->T rows (a prefill's rows from rec_row of its recording). */
CLOVER_HIDDEN int res_forward(fwd *f, const int32_t *tokens, int64_t rec_row, float *logits, int64_t logit_row0, const uint8_t *rows);
/* Count c among the contexts that use the GPU (CUDA graphs need it to be the only one). */
CLOVER_HIDDEN void gpu_context_count(clover_context *c);
/* Uncount c (clover_context_free); the last one releases the backend's shared scratch. */
CLOVER_HIDDEN void gpu_context_uncount(clover_context *c);

#endif
