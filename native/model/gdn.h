/* gdn.h: the Gated DeltaNet layer on the CPU path (model/gdn.c); its GPU-resident twin is
 * gpu/gdn_resident.h. */
#ifndef CLOVER_MODEL_GDN_H
#define CLOVER_MODEL_GDN_H

#include "model/pass.h"

/* A Gated DeltaNet layer (clover-spec 2.1; block mode 3.3) of the f->T rows xn into out. */
CLOVER_HIDDEN int gdn_layer(fwd *f, const clover_layer *ly, const float *xn, float *out);

#endif
