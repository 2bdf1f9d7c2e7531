/* guide.h: what the decoder asks of and reports to its caller per token (decode/guide.c; not
 * public API): the caller's grammar (clover_constraint, clover.h) and each token's logprobs. */
#ifndef CLOVER_DECODE_GUIDE_H
#define CLOVER_DECODE_GUIDE_H

#include "clover.h"
#include <stddef.h>
#include <stdint.h>

/* The constraint's allowed next tokens into allowed[(n_vocab + 31) / 32], without ids past the
 * vocabulary or the mask token (-1: none); CLOVER_E_ARG naming the constraint when it fails or
 * allows no id. */
int clover_guide_mask(const clover_constraint *k, uint32_t *allowed, int32_t n_vocab, int32_t mask_token_id,
                      char *err, size_t err_size);
/* Tell the constraint token t / make it forget its last n tokens (n <= 0: nothing); CLOVER_E_ARG
 * naming the constraint when it refuses. */
int clover_guide_accept(const clover_constraint *k, int32_t t, char *err, size_t err_size);
int clover_guide_rollback(const clover_constraint *k, int32_t n, char *err, size_t err_size);
/* -inf into z[t] for every t not set in allowed. */
void clover_guide_apply(float *z, int32_t n_vocab, const uint32_t *allowed);

/* A token's log-probability and its most likely alternatives (clover_decoder_logprobs). */
typedef struct {
    float lp;
    int32_t id[CLOVER_MAX_LOGPROBS];
    float top[CLOVER_MAX_LOGPROBS];
} clover_lp_rec;

/* The record of token t chosen from the raw logits row z[n_vocab]: log-softmax (in double) over
 * the ids other than the mask token, and the n_top <= CLOVER_MAX_LOGPROBS most likely ids (by
 * logit, ties by lower id). */
void clover_guide_logprobs(const float *z, int32_t n_vocab, int32_t mask_token_id, int32_t t, int32_t n_top,
                           clover_lp_rec *r);

#endif
