/* offload.h: weights on the GPU (gpu/offload.c). */
#ifndef CLOVER_GPU_OFFLOAD_H
#define CLOVER_GPU_OFFLOAD_H

#include "model/model.h"

/* Free every device copy of m's weights and vectors; m is then on the CPU alone. */
CLOVER_HIDDEN void free_gpu(clover_model *m);
/* Whether clover_model_offload(m, n_gpu_layers, ...) makes m resident (every layer and the output
 * on the GPU, and the resident kernels take m's dimensions, unless CLOVER_GPU_RESIDENT=0). */
CLOVER_HIDDEN int offload_makes_resident(const clover_model *m, int32_t n_gpu_layers);

#endif
