/* load.h: the model loader's internal entry points (model/load.c). */
#ifndef CLOVER_MODEL_LOAD_H
#define CLOVER_MODEL_LOAD_H

#include "clover.h"
#include <stddef.h>

/* CLOVER_E_STATE with the message that `what` (block mode, a decoding mode) needs the block
 * tensors, saying how to get them (the diffusion sidecar of docs/gguf-layout.md). */
int clover_no_block(const clover_model *m, const char *what, char *err, size_t err_size);


#endif
