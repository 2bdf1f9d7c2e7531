/* select_resident.h: the LM head with the sampler's selection (clover-spec 5.3-5.4) on the device, resident forward (gpu/select_resident.c); twin of decode/sampler.c (the host selection) and model/forward.c cpu_forward's LM head. */
#ifndef CLOVER_GPU_SELECT_RESIDENT_H
#define CLOVER_GPU_SELECT_RESIDENT_H

#include "gpu/resident_ops.h"

/* The selection's inputs: the n needed rows' edit ranges into start (host), the edits to ops_dev. */
CLOVER_HIDDEN int res_select_upload(fwd *f, const int32_t *idx, int64_t n, int32_t *start);
/* The LM head and the selection's launches on the n rows of b->idx. */
CLOVER_HIDDEN int res_select_run(fwd *f, const res_bufs *b, int64_t n);
/* The selection's results and the pass's flags ([4 n_layer]) read back in one copy. */
CLOVER_HIDDEN int res_select_read(fwd *f, const res_bufs *b, const int32_t *idx, int64_t n, const uint8_t *rows, int32_t *flags);

#endif
