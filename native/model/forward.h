/* forward.h: the forward passes' internal entry points (model/forward.c), for the decoders. */
#ifndef CLOVER_MODEL_FORWARD_H
#define CLOVER_MODEL_FORWARD_H

#include "decode/sampler.h"
#include "model/pass.h"

/* The denoising pass of a resident model (clover_model_gpu_resident) with the selection of spec
 * 5.3-5.4 on the GPU: clover_block_forward_rows, but for each row t with rows[t] != 0 the LM
 * head's row is edited on the GPU by ops[ops_start[t] .. ops_start[t+1]) (clover_logit_ops, with
 * sp's penalties; ops_start: B + 1 values, empty ranges for the other rows) and reduced there;
 * no logits rows cross to the host:
 *   k == 0 (temperature 0 only): id[t], conf[t] as clover_sample gives them (id, conf [B]);
 *   k in [1, CLOVER_CUDA_TOP_K_MAX]: cand[t][0..k), the row's best k candidates in rank order
 *          (cand [B][k]), e.g. for clover_sample_top with k = clover_select_k, which then draws
 *          as clover_sample would from the whole row; pre (NULL, or ops_start[B] floats): the
 *          value each edit found before it applied (clover_cuda_top_k_d).
 * total, logits (NULL, or both, for top-p alone: clover_select_total; B <=
 * CLOVER_SELECT_TOTAL_MAX_ROWS): total[t] (double [B]) = the row's tempered weight over every id
 * but the mask (clover_cuda_row_total_d) when its top-p prefix ends within its k candidates
 * (clover_top_p_in_cands), else 0, and then the row's edited logits are in logits[t][0..V) (float
 * [B][n_vocab]) for clover_sample.
 * CLOVER_E_STATE when the model is not resident, CLOVER_E_ARG for a bad k; else as
 * clover_block_forward_rows. */
int clover_block_forward_select(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p,
                                const uint8_t *rows, const clover_logit_op *ops, const int32_t *ops_start,
                                const clover_sampler_params *sp, int32_t k, int32_t *id, float *conf,
                                clover_cand *cand, float *pre, double *total, float *logits, int32_t *n_experts_out,
                                char *err, size_t err_size);
/* clover_prefill of n <= 512 tokens on a resident model with the selection on the GPU (as
 * clover_block_forward_select, k candidates per row, the edits of row t in
 * ops[ops_start[t] .. ops_start[t+1]), ops_start: n + 1 values) of every row (all_rows: id, conf
 * [n] or cand [n][k], total [n], logits [n][V]) or of the last (id, conf [1] or cand [1][k],
 * total [1], logits [1][V]) instead of logits; all_rows with total: n <= 32.
 * CLOVER_E_STATE when the model is not resident. */
int clover_prefill_select(clover_context *c, const int32_t *tokens, int32_t n, int32_t all_rows,
                          const clover_logit_op *ops, const int32_t *ops_start, const clover_sampler_params *sp,
                          int32_t k, int32_t *id, float *conf, clover_cand *cand, double *total, float *logits,
                          char *err, size_t err_size);

#endif
