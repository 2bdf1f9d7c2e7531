/* guide.c: the caller's grammar as the decoder consults it (clover_constraint, clover.h) and the
 * logprobs of the tokens it emits (clover_decoder_logprobs). Decoding rules per mode: decode.c and
 * docs/structured-output.md. */
#include "core/errors.h"
#include "decode/guide.h"

#include <math.h>
#include <string.h>

int clover_guide_mask(const clover_constraint *k, uint32_t *allowed, int32_t n_vocab, int32_t mask_token_id,
                      char *err, size_t err_size) {
    const int32_t W = (n_vocab + 31) / 32;
    memset(allowed, 0, sizeof(uint32_t) * (size_t)W);
    if (k->mask(k->user, allowed))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "constraint: computing the allowed tokens failed");
    if (n_vocab % 32) allowed[W - 1] &= (1u << (n_vocab % 32)) - 1u;
    if (mask_token_id >= 0 && mask_token_id < n_vocab) allowed[mask_token_id >> 5] &= ~(1u << (mask_token_id & 31));
    for (int32_t w = 0; w < W; w++)
        if (allowed[w]) return CLOVER_OK;
    return clover_set_err(err, err_size, CLOVER_E_ARG, "constraint: no token is allowed next");
}

int clover_guide_accept(const clover_constraint *k, int32_t t, char *err, size_t err_size) {
    if (k->accept(k->user, t)) return clover_set_err(err, err_size, CLOVER_E_ARG, "constraint: token %d was refused", t);
    return CLOVER_OK;
}

int clover_guide_rollback(const clover_constraint *k, int32_t n, char *err, size_t err_size) {
    if (n > 0 && k->rollback(k->user, n))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "constraint: rolling back %d tokens failed", n);
    return CLOVER_OK;
}

void clover_guide_apply(float *z, int32_t n_vocab, const uint32_t *allowed) {
    for (int32_t t = 0; t < n_vocab; t++)
        if (!(allowed[t >> 5] >> (t & 31) & 1u)) z[t] = -INFINITY;
}

void clover_guide_logprobs(const float *z, int32_t n_vocab, int32_t mask_token_id, int32_t t, int32_t n_top,
                           clover_lp_rec *r) {
    float mx = -INFINITY;
    for (int32_t i = 0; i < n_vocab; i++)
        if (i != mask_token_id && z[i] > mx) mx = z[i];
    double s = 0.0;
    for (int32_t i = 0; i < n_vocab; i++)
        if (i != mask_token_id) s += exp((double)z[i] - (double)mx);
    const double lse = (double)mx + log(s);
    r->lp = (float)((double)z[t] - lse);
    int32_t k = 0;
    for (int32_t i = 0; i < n_vocab && n_top > 0; i++) {
        if (i == mask_token_id || (k == n_top && !(z[i] > z[r->id[k - 1]]))) continue;
        int32_t q = k < n_top ? k++ : k - 1; /* insert i, dropping the last when full */
        while (q > 0 && z[i] > z[r->id[q - 1]]) r->id[q] = r->id[q - 1], q--;
        r->id[q] = i;
    }
    for (int32_t q = 0; q < k; q++) r->top[q] = (float)((double)z[r->id[q]] - lse);
}
