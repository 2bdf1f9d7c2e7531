/* checkpoint.h: speculative verification's checkpoint and rollback (model/checkpoint.c). */
#ifndef CLOVER_MODEL_CHECKPOINT_H
#define CLOVER_MODEL_CHECKPOINT_H

#include "clover.h"

/* Checkpoint for speculative verification (spec 5.5): remember the GDN and conv state and
 * make the next clover_prefill of at most n_max tokens record its per-token GDN inputs.
 * Returns CLOVER_OK or CLOVER_E_NOMEM / CLOVER_E_ARG. */
int clover_context_checkpoint(clover_context *c, int32_t n_max, char *err, size_t err_size);
/* After the recorded prefill of n tokens at position P, keep its first n_keep (1 <= n_keep <=
 * n): n_past = P + n_keep, KV entries beyond are dropped (overwritten later), GDN and conv
 * state are restored from the checkpoint and the recurrence is replayed over the n_keep
 * recorded tokens (token by token, as a decode step computes it). Ends the recording. */
int clover_context_rollback(clover_context *c, int32_t n_keep, char *err, size_t err_size);


#endif
