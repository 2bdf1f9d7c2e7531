/* moe_resident.h: the MoE layer (clover-spec 2.3, 5.6) on the device, resident forward; routed experts kept on the CPU through model/moe.c cpu_experts (gpu/moe_resident.c); twin of model/moe.c. */
#ifndef CLOVER_GPU_MOE_RESIDENT_H
#define CLOVER_GPU_MOE_RESIDENT_H

#include "gpu/resident_ops.h"

/* moe_layer on the device, its result added to b->x (b->flags: this layer's slots). */
CLOVER_HIDDEN int res_moe_layer(fwd *f, const clover_layer *ly, int il, const res_bufs *b);

#endif
