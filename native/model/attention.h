/* attention.h: the gated attention layer on the CPU path (model/attention.c); its GPU-resident
 * twin is gpu/attention_resident.h. */
#ifndef CLOVER_MODEL_ATTENTION_H
#define CLOVER_MODEL_ATTENTION_H

#include "model/pass.h"

/* Gated attention (clover-spec 2.2) of a pass's L->T rows xn [T][n_embd] into out [T][n_embd]:
 * the rows of entries e[0..n) one after another, each with its own context's KV cache; the
 * products over all rows with L (its context's threads and scratch). */
CLOVER_HIDDEN int attention_layer(fwd *L, pass_entry *e, int n, const clover_layer *ly, const float *xn,
                                  float *out);

#endif
