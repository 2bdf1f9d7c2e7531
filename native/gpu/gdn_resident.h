/* gdn_resident.h: the Gated DeltaNet layer (clover-spec 2.1, 3.3) on the device, resident forward, and the replay of its verify record (spec 5.5) (gpu/gdn_resident.c); twin of model/gdn.c. */
#ifndef CLOVER_GPU_GDN_RESIDENT_H
#define CLOVER_GPU_GDN_RESIDENT_H

#include "gpu/resident_ops.h"

/* gdn_layer on the device; a recorded prefill keeps its inputs in rec_dev from row rec_row. */
CLOVER_HIDDEN int res_gdn_layer(fwd *f, const clover_layer *ly, const res_bufs *b, int64_t rec_row);
/* clover_context_rollback of GDN slot g for the resident forward (restore and replay on the device). */
CLOVER_HIDDEN int res_rollback_slot(clover_context *c, int g, int32_t n_keep, char *err, size_t err_size);

#endif
