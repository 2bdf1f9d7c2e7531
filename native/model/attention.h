/* attention.h: the gated attention layer on the CPU path (model/attention.c); its GPU-resident
 * twin is gpu/attention_resident.h. */
#ifndef CLOVER_MODEL_ATTENTION_H
#define CLOVER_MODEL_ATTENTION_H

#include "model/pass.h"

/* Gated attention (clover-spec 2.2) of the f->T rows xn [T][n_embd] into out [T][n_embd]. */
CLOVER_HIDDEN int attention_layer(fwd *f, const clover_layer *ly, const float *xn, float *out);

#endif
