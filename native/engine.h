/* engine.h: internal structs shared by model.c, decode.c and sampler.c (not public API).
 *
 * Following llama2.c: the hyperparameters (clover_hparams, public), the weights (views into the
 * mapped GGUF) and the run state (caches and scratch) are plain structs passed explicitly.
 */
#ifndef CLOVER_ENGINE_H
#define CLOVER_ENGINE_H

#include "clover.h"
#include "cuda/cuda_backend.h"
#include "quants.h"

#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>

/* A weight view: ggml type, mapped data, ne in ggml order. */
typedef struct {
    int type;
    const void *data;
    int64_t ne[4];
    void *dev; /* a copy on the GPU (clover_model_offload), else NULL */
} clover_tensor;

typedef struct {
    int is_attn;
    int slot; /* index among attention layers (KV cache) or GDN layers (state) */
    const float *attn_norm, *post_norm;
    /* gated attention (spec 2.2) */
    clover_tensor wq, wk, wv, wo;
    const float *q_norm, *k_norm;
    /* Gated DeltaNet (spec 2.1) */
    clover_tensor wqkv, wz, wbeta, walpha, wout;
    const float *conv, *ssm_a, *dt_bias, *ssm_norm;
    /* the block operator (spec 3.3): right conv taps [C][K-1], lambda, beta0, c [Hv]; NULL
     * without block tensors (qwen35moe, a clover_moe trunk without its sidecar) */
    const float *conv_right, *bd_lambda, *bd_beta0, *bd_c;
    /* MoE (spec 2.3) */
    clover_tensor router, gate_exps, up_exps, down_exps, shexp_gate, gate_sh, up_sh, down_sh;
    /* device copies of the float32 vectors above, for the resident forward (else NULL) */
    struct {
        float *attn_norm, *post_norm, *q_norm, *k_norm, *conv, *ssm_a, *dt_bias, *ssm_norm, *conv_right, *bd_lambda,
            *bd_beta0, *bd_c;
    } dev;
} clover_layer;

struct clover_model {
    clover_gguf *g;
    clover_gguf *side;  /* the diffusion sidecar holding the block tensors and record, or NULL */
    char *side_path;    /* its path (owned), or NULL */
    char *path;         /* the model file's path (owned; NULL when loaded from memory), for messages */
    clover_hparams hp;
    int n_attn, n_gdn;
    clover_tensor tok_embd, output;
    const float *output_norm;
    clover_layer *layers;
    int32_t n_gpu_layers;  /* layers whose weight products run on the GPU (clover_model_offload) */
    int64_t gpu_bytes;     /* bytes of weights copied to the GPU */
    /* every layer and the output on the GPU: forwards run device-resident (model.c res_forward),
     * the activations staying on the GPU from embedding to logits, except the inputs and outputs
     * of routed experts kept on the CPU (--n-cpu-moe: cpu_experts, the first n layers) */
    int resident, cpu_experts;
    float *output_norm_dev;
    int64_t dev_epoch; /* offloads so far: a CUDA graph of a pass holds the weights' device addresses */
};

struct clover_context {
    clover_model *m;
    int32_t n_ctx, n_threads, n_past;
    int gdn_chunked;
    int32_t type_k, type_v;    /* KV cache element types: CLOVER_TYPE_F16 or CLOVER_TYPE_F32 */
    void *k_cache, *v_cache;   /* [n_attn][n_ctx][n_head_kv*head_dim] of type_k/type_v (kv_host; else
                                  unused: resident model) */
    int kv_host;
    /* the KV cache of the attention layers offloaded to the GPU, on the device (allocated at
     * their first forward; one [n_ctx][n_head_kv*head_dim] block per offloaded layer, in layer
     * order); rows [0, kv_dev_rows[slot]) equal the host cache's */
    void *k_dev, *v_dev;
    int64_t *kv_dev_rows;      /* [n_attn] */
    /* the GDN state of offloaded GDN layers lives on the device between forwards: gdn_dev has
     * gdn_state's layout, gdn_on_dev[slot] says the device copy is the current one; host code
     * that reads or writes gdn_state first brings it back (gdn_to_host in model.c) */
    void *gdn_dev;
    unsigned char *gdn_on_dev; /* [n_gdn] */
    void *gdn_snap_dev;         /* clover_context_checkpoint's copy of gdn_dev, on the device */
    unsigned char *snap_on_dev; /* [n_gdn]: the checkpoint of the slot is in gdn_snap_dev */
    float *gdn_state;          /* [n_gdn][Hv][dk][dv] */
    float *conv_state;         /* [n_gdn][d_conv-1][conv channels], oldest first */
    /* speculative verify (spec 5.5): GDN and conv state at the checkpoint and the per-token GDN
     * inputs of the recorded prefill, so that clover_context_rollback can replay them */
    int rec_on;                /* the next prefill records (set by clover_context_checkpoint) */
    int32_t rec_cap, rec_n, rec_p0; /* capacity (tokens), tokens recorded, n_past at the checkpoint */
    float *snap_state, *snap_conv;  /* copies of gdn_state, conv_state */
    int32_t keep_n;                 /* clover_context_save_state: n_past saved (0 = none) */
    float *keep_state, *keep_conv;  /* its copies of gdn_state, conv_state */
    float *rec_qkv, *rec_cv;        /* [n_gdn][rec_cap][conv channels]: conv inputs, conv outputs */
    float *rec_b, *rec_a;           /* [n_gdn][rec_cap][Hv]: beta and log-decay g */
    /* the resident forward (model->resident): device scratch for one pass (res_cap bytes), the
     * conv history of the GDN layers and its checkpoint copy on the device (conv_state's layout;
     * gdn_on_dev[slot] covers it too), and the verify record on the device (rec_*'s layout) */
    void *res_ws;
    size_t res_cap;
    void *ops_dev, *pre_dev; /* clover_block_forward_select's edits and their inputs on the device (ops_cap each) */
    int64_t ops_cap;
    void *moe_host;          /* host staging of routed experts on the CPU (moe_host_cap bytes) */
    size_t moe_host_cap;
    int moe_host_pinned;     /* moe_host is page-locked (clover_cuda_host_alloc), else malloc'd */
    /* resident passes through CUDA graphs (model.c res_run_graph; graphs: not disabled by
     * CLOVER_CUDA_GRAPHS=0): a few recorded graphs (exec, NULL until recorded) by the key of the
     * pass they replay (a key is seen once plainly first), least recently used out; replays so far */
    int graphs;
    struct {
        void *exec;
        unsigned char key[160];
        int64_t used;
    } graph[4];
    int64_t graph_clock, n_graph_launches;
    int64_t n_full_rows; /* top-p selections whose row came back whole (res_select_read) */
    int64_t n_passes;    /* forward passes run (model.c forward) */
    int gpu_counted;     /* counted among the contexts that use the GPU (model.c g_n_gpu_contexts) */
    void *conv_dev, *conv_snap_dev;
    void *rec_dev;
    int32_t *nexp_full; /* [n_layer]: distinct experts the last block pass's rows would use
                           without the coreset (the union of their own top-k; spec 5.6) */
    atomic_int abort_req; /* set by clover_context_abort (any thread), consumed by forward() */
};

/* Checkpoint for speculative verification (spec 5.5): remember the GDN and conv state and
 * make the next clover_prefill of at most n_max tokens record its per-token GDN inputs.
 * Returns CLOVER_OK or CLOVER_E_NOMEM / CLOVER_E_ARG. */
int clover_context_checkpoint(clover_context *c, int32_t n_max, char *err, size_t err_size);
/* After the recorded prefill of n tokens at position P, keep its first n_keep (1 <= n_keep <=
 * n): n_past = P + n_keep, KV entries beyond are dropped (overwritten later), GDN and conv
 * state are restored from the checkpoint and the recurrence is replayed over the n_keep
 * recorded tokens (token by token, as a decode step computes it). Ends the recording. */
int clover_context_rollback(clover_context *c, int32_t n_keep, char *err, size_t err_size);

/* CLOVER_E_STATE with the message that `what` (block mode, a decoding mode) needs the block
 * tensors, saying how to get them (the diffusion sidecar of docs/gguf-layout.md). */
int clover_no_block(const clover_model *m, const char *what, char *err, size_t err_size);

/* Write a formatted message into err (may be NULL) and return code. */
int clover_set_err(char *err, size_t err_size, int code, const char *fmt, ...);

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
enum { CLOVER_SELECT_MAX_ROWS = 512 }; /* clover_prefill_select's n (one resident pass, model.c RES_ROWS) */
enum { CLOVER_SELECT_TOTAL_MAX_ROWS = 32 }; /* rows of a selection with total (model.c RES_LM) */
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
/* How many passes of c replayed a CUDA graph (model.c res_run_graph), for tests. */
int64_t clover_context_graph_launches(const clover_context *c);
/* How many forward passes c ran (a long prefill takes several: model.c forward), for tests. */
int64_t clover_context_passes(const clover_context *c);
/* How many rows of c's top-p selections on the GPU came back whole (their top-p prefix did not end
 * within the candidates), for tests. */
int64_t clover_context_full_rows(const clover_context *c);
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
 * min-p (spec 5.3); *confidence in [0, 1]. Greedy at temperature 0 (confidence = softmax
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
