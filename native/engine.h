/* engine.h: internal structs shared by model.c, decode.c and sampler.c (not public API).
 *
 * Following llama2.c: the hyperparameters (clover_hparams, public), the weights (views into the
 * mapped GGUF) and the run state (caches and scratch) are plain structs passed explicitly.
 */
#ifndef CLOVER_ENGINE_H
#define CLOVER_ENGINE_H

#include "clover.h"
#include "quants.h"

#include <stdarg.h>
#include <stdint.h>

/* A weight view: ggml type, mapped data, ne in ggml order. */
typedef struct {
    int type;
    const void *data;
    int64_t ne[4];
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
    /* backward branch (spec 3.3), NULL/zero for qwen35moe */
    clover_tensor wbeta_bwd, walpha_bwd;
    const float *conv_bwd, *ssm_a_bwd, *dt_bias_bwd, *bwd_mix;
    /* MoE (spec 2.3) */
    clover_tensor router, gate_exps, up_exps, down_exps, shexp_gate, gate_sh, up_sh, down_sh;
} clover_layer;

struct clover_model {
    clover_gguf *g;
    clover_hparams hp;
    int n_attn, n_gdn;
    clover_tensor tok_embd, output;
    const float *output_norm;
    clover_layer *layers;
};

struct clover_context {
    clover_model *m;
    int32_t n_ctx, n_threads, n_past;
    int gdn_chunked;
    float *k_cache, *v_cache;  /* [n_attn][n_ctx][n_head_kv*head_dim] */
    float *gdn_state;          /* [n_gdn][Hv][dk][dv] */
    float *conv_state;         /* [n_gdn][d_conv-1][conv channels], oldest first */
};

/* Write a formatted message into err (may be NULL) and return code. */
int clover_set_err(char *err, size_t err_size, int code, const char *fmt, ...);

/* sampler.c: one candidate per logits row (spec 5.3). */
typedef struct {
    float temperature;
    int32_t top_k;
    float top_p;
    int32_t mask_token_id; /* never a candidate; -1 for none */
} clover_sampler_params;

typedef struct {
    uint64_t s[2];
} clover_rng;

void clover_rng_seed(clover_rng *r, uint64_t seed);
/* Uniform float in [0, 1). */
float clover_rng_uniform(clover_rng *r);
/* Pick a candidate from logits[n_vocab] (not modified); *confidence in [0, 1]. Greedy at
 * temperature 0 (confidence = softmax probability of the argmax). scratch: n_vocab floats
 * plus n_vocab ints (caller provides). */
int32_t clover_sample(const float *logits, int32_t n_vocab, const clover_sampler_params *sp,
                      clover_rng *rng, float *confidence, float *scratch, int32_t *iscratch);

#endif
