/* gdn.h: the Gated DeltaNet layer on the CPU path (model/gdn.c); its GPU-resident twin is
 * gpu/gdn_resident.h. */
#ifndef CLOVER_MODEL_GDN_H
#define CLOVER_MODEL_GDN_H

#include "model/pass.h"

/* A Gated DeltaNet layer (clover-spec 2.1; block mode 3.3) of a pass's L->T rows xn into out: the
 * rows of entries e[0..n) one after another, each with its own context's state and conv history;
 * the products over all rows with L (its context's threads and scratch). */
CLOVER_HIDDEN int gdn_layer(fwd *L, pass_entry *e, int n, const clover_layer *ly, const float *xn, float *out);

#endif
