/* batch.h: continuous batching (model/batch.c): the forwards of the contexts attached to a
 * clover_batch gathered into shared passes. */
#ifndef CLOVER_MODEL_BATCH_H
#define CLOVER_MODEL_BATCH_H

#include "model/pass.h"

/* Run entry w (a forward of w->f.c, attached to b) in b's passes, run(entries, n, lead) computing
 * each: blocks until w's rows are done (a prefill possibly over several passes) and returns its
 * outcome, as a forward alone would. */
CLOVER_HIDDEN int batch_forward(clover_batch *b, pass_entry *w, pass_fn run);

#endif
