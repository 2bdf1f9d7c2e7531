/* sampler.h: the sampler of spec 5.3-5.4 (decode/sampler.c; not public API): candidate selection
 * from a logits row, the logit edits of penalties and biases, and the token history they read. */
#ifndef CLOVER_DECODE_SAMPLER_H
#define CLOVER_DECODE_SAMPLER_H

#include "clover.h"
#include "cuda/cuda_backend.h"
#include <stdint.h>

/* sampler.c: one candidate per logits row (spec 5.3) after penalties and soft biases (5.4). */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
    int32_t mask_token_id; /* never a candidate; -1 for none */
    float min_p;
    /* spec 5.4 (borrowed from the clover_gen_params they were made from) */
    float presence_penalty, repetition_penalty, frequency_penalty;
    const int32_t *bias_ids;
    const float *bias_values;
    int32_t n_bias;
    int32_t think_close_id;
    const int32_t *end_ids;
    int32_t n_end_ids;
    int32_t think_close_bias_start, eos_bias_start;
    float bias_slope, bias_max;
} clover_sampler_params;

/* Candidates per row that a selection on the GPU hands back for sp over n_vocab ids: 0 at
 * temperature 0 (an id and a confidence instead); top_k when clover_sample's top-k cuts
 * (0 < top_k <= CLOVER_CUDA_TOP_K_MAX and top_k < the ids other than the mask);
 * CLOVER_CUDA_TOP_K_MAX for top-p alone (clover_select_total); else -1 (the whole row is needed,
 * so it goes to the host). */
int32_t clover_select_k(const clover_sampler_params *sp, int32_t n_vocab);
/* Whether sp samples with top-p alone (temperature > 0, top_p < 1, no top-k cut) over more than
 * CLOVER_CUDA_TOP_K_MAX ids: the GPU then also hands back each row's weight (total). */
int clover_select_total(const clover_sampler_params *sp, int32_t n_vocab);
/* Whether the top-p prefix of a row (clover_sample's: candidates in rank order until their
 * tempered weight over total reaches sp->top_p) ends within cand[0..n); total: the row's weight. */
int clover_top_p_in_cands(const clover_cand *cand, int32_t n, const clover_sampler_params *sp, double total);

/* The sampling fields of p (pointers borrowed, so p's arrays must outlive sp). */
void clover_sampler_params_init(clover_sampler_params *sp, const clover_gen_params *p, int32_t mask_token_id);
/* Validate the sampling fields of p (temperature, top_k, top_p, min_p, penalties, logit_bias,
 * think ids, ramps); the error names the field. */
int clover_check_sampling(const clover_gen_params *p, int32_t n_vocab, char *err, size_t err_size);

/* Token history of spec 5.4: which tokens the prompt holds and how often each was generated.
 * seen lists the distinct ids with in_prompt or count > 0 (first-seen order), so penalties cost
 * O(distinct tokens) per row. */
typedef struct {
    int32_t n_vocab;
    int32_t *count;           /* [n_vocab] generated occurrences */
    unsigned char *in_prompt; /* [n_vocab] */
    int32_t *seen;            /* [n_vocab], n_seen used */
    int32_t n_seen;
    int32_t think_open_id, think_close_id; /* -1 = none */
    int think_open;           /* the last of <think> / </think> in prompt + added tokens is <think> */
} clover_history;

int clover_history_init(clover_history *h, int32_t n_vocab, int32_t think_open_id, int32_t think_close_id);
void clover_history_free(clover_history *h);
/* The prompt's tokens: the think state, and with scope CLOVER_PENALTY_ALL the repetition
 * penalty's history (spec 5.4: "response" counts generated tokens only). */
void clover_history_prompt(clover_history *h, const int32_t *tokens, int32_t n, int32_t scope);
/* A generated token, for good: count and think state. */
void clover_history_add(clover_history *h, int32_t t);
/* Count t as generated / undo the last push of t (strict LIFO); the think state is untouched.
 * The decoder pushes the filled slots of a block for one row and pops them in reverse. */
void clover_history_push(clover_history *h, int32_t t);
void clover_history_pop(clover_history *h, int32_t t);
/* Think state after token t given the state before it. */
int clover_think_state(const clover_history *h, int open, int32_t t);
/* Spec 5.4 as a list of edits of a logits row (clover_logit_op, cuda/cuda_backend.h): penalties
 * over h (may be NULL: none), then logit_bias and the ramps for generated index n (the </think>
 * ramp only if think_open), then -inf for the mask token. ops: clover_logit_ops_max(sp, h)
 * entries; returns how many were written. Only the ids listed change, so the edits can be
 * applied where the logits are (clover_apply_logit_ops here, k_logit_ops on the GPU). */
int32_t clover_logit_ops_max(const clover_sampler_params *sp, const clover_history *h);
int32_t clover_logit_ops(const clover_sampler_params *sp, const clover_history *h, int64_t n, int think_open,
                         clover_logit_op *ops);
/* Apply n_ops edits to the row z[n_vocab] in order (ids outside [0, n_vocab) are skipped). */
void clover_apply_logit_ops(float *z, int32_t n_vocab, const clover_logit_op *ops, int32_t n_ops,
                            const clover_sampler_params *sp);
/* Spec 5.4 on a copy: out = logits edited by clover_logit_ops (ops: its scratch, as sized there).
 * logits is not modified. */
void clover_process_logits(const float *logits, float *out, int32_t n_vocab, const clover_sampler_params *sp,
                           const clover_history *h, int64_t n, int think_open, clover_logit_op *ops);

typedef struct {
    uint64_t s[2];
} clover_rng;

void clover_rng_seed(clover_rng *r, uint64_t seed);
/* Uniform float in [0, 1). */
float clover_rng_uniform(clover_rng *r);
/* Pick a candidate from processed logits[n_vocab] (not modified): temperature, top-k, top-p,
 * min-p (spec 5.3); *confidence in [0, 1] (confidence NULL: not computed, which at
 * temperature 0 skips a pass over the row). Greedy at temperature 0 (confidence = softmax
 * probability of the argmax). scratch: n_vocab floats (caller provides); iscratch unused. */
int32_t clover_sample(const float *logits, int32_t n_vocab, const clover_sampler_params *sp,
                      clover_rng *rng, float *confidence, float *scratch, int32_t *iscratch);
/* Sort cand[0..n) by rank: z descending, then id ascending (clover_sample_top's order). */
void clover_cands_sort(clover_cand *cand, int32_t n);
/* clover_sample above temperature 0 when its candidates are sorted (top_k or top_p set): from
 * cand[0..n) (n >= 1), the best n candidates of the processed row in rank order (z descending,
 * ties by id ascending), the top-k, top-p, min-p cuts, one draw from rng and the confidence
 * (spec 5.3). Either top_k cuts (n >= min(top_k, ids other than the mask); total 0: top-p
 * renormalises over the top-k), or total is the whole row's tempered weight, sum over ids other
 * than the mask of exp((z - z_max) / T), and the top-p prefix ends within the n. scratch: n
 * floats. Lets the candidates come from elsewhere (clover_cuda_top_k_d) with the same result. */
int32_t clover_sample_top(const clover_cand *cand, int32_t n, const clover_sampler_params *sp, clover_rng *rng,
                          float *confidence, float *scratch, double total);


#endif
