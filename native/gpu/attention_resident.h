/* attention_resident.h: the gated attention layer (clover-spec 2.2) on the device, resident forward (gpu/attention_resident.c); twin of model/attention.c. */
#ifndef CLOVER_GPU_ATTENTION_RESIDENT_H
#define CLOVER_GPU_ATTENTION_RESIDENT_H

#include "gpu/resident_ops.h"

/* attention_layer on the device: b->xn in, b->o out; new K and V rows into the device cache at *b->pos. */
CLOVER_HIDDEN int res_attention_layer(fwd *f, const clover_layer *ly, const res_bufs *b);

#endif
