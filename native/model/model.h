/* model.h: the engine's internal structs (not public API): weights, layers, model and context,
 * and the sizes derived from the hyperparameters that every backend uses.
 *
 * Following llama2.c: the hyperparameters (clover_hparams, public), the weights (views into the
 * mapped GGUF) and the run state (caches and scratch) are plain structs passed explicitly.
 * Shapes follow clover-spec sections 2 (layers), 4.3 (tensor layout) and 5.5 (verify record).
 */
#ifndef CLOVER_MODEL_MODEL_H
#define CLOVER_MODEL_MODEL_H

#include "clover.h"
#include "core/errors.h"
#include "cuda/cuda_backend.h"

#include <stdatomic.h>
#include <stddef.h>
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
    /* every layer and the output on the GPU: forwards run device-resident (gpu/forward_resident.c res_forward),
     * the activations staying on the GPU from embedding to logits, except the inputs and outputs
     * of routed experts kept on the CPU (--n-cpu-moe: cpu_experts, the first n layers) */
    int resident, cpu_experts;
    float *output_norm_dev;
    int64_t dev_epoch; /* offloads so far: a CUDA graph of a pass holds the weights' device addresses */
};

struct clover_context {
    clover_model *m;
    int32_t n_ctx, n_threads, n_past;
    int32_t n_threads_1, n_threads_batch; /* n_threads of a forward of one row / of more (forward.c) */
    int32_t n_ubatch;                     /* most rows of a prefix-mode pass; 0: the backend's */
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
     * that reads or writes gdn_state first brings it back (gdn_to_host, gpu/device_state.c) */
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
    /* resident passes through CUDA graphs (gpu/forward_resident.c res_run_graph; graphs: not disabled by
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
    int64_t n_passes;    /* forward passes run (model/forward.c forward) */
    int gpu_counted;     /* counted among the contexts that use the GPU (gpu/forward_resident.c g_n_gpu_contexts) */
    void *conv_dev, *conv_snap_dev;
    void *rec_dev;
    int32_t *nexp_full; /* [n_layer]: distinct experts the last block pass's rows would use
                           without the coreset (the union of their own top-k; spec 5.6) */
    atomic_int abort_req; /* set by clover_context_abort (any thread), consumed by forward() */
    struct clover_batch *batch; /* the batch its forwards run through (clover_context_set_batch), or NULL */
    int in_forward;             /* a forward through the batch is under way (model/batch.c) */
    /* host scratch of the CPU forward, grown on demand and kept until clover_context_free
     * (model/pass.c scratch_carve): [SCRATCH_PASS] a pass's activations, [SCRATCH_LAYER] one
     * layer's buffers (attention, GDN or MoE; the layers run one after another; the LM head's and
     * the selection's host rows after them), [SCRATCH_THREADS] the per-thread buffers of the
     * parallel region running inside a layer, [SCRATCH_CALL] an entry point's own arrays around
     * its passes (clover_prefill_select) */
    struct {
        void *p;
        size_t cap;
    } scratch[4];
};

/* Channels of a GDN layer's conv: q and k of Hk key heads, v of Hv value heads (spec 2.1). */
static inline int64_t conv_channels(const clover_hparams *hp) {
    return 2 * (int64_t)hp->ssm_n_group * hp->ssm_d_state + hp->ssm_d_inner;
}

/* Floats of one GDN layer's state S [Hv][dk][dv] (spec 2.1 step 6). */
static inline int64_t gdn_state_floats(const clover_hparams *hp) {
    return (int64_t)hp->ssm_dt_rank * hp->ssm_d_state * (hp->ssm_d_inner / hp->ssm_dt_rank);
}

/* Bytes of one KV cache element of type t (CLOVER_TYPE_F16 or F32; 0 for another type). */
static inline size_t kv_elem_bytes(int32_t t) {
    return t == CLOVER_TYPE_F16 ? 2 : t == CLOVER_TYPE_F32 ? 4 : 0;
}

/* A GDN layer's dimensions (spec 2.1): key heads Hk, value heads Hv, key and value head sizes,
 * conv channels C and conv kernel K. */
typedef struct {
    int64_t Hk, Hv, dk, dv, C, K; /* K = conv kernel */
} gdn_dims;

static inline gdn_dims gdn_dims_of(const clover_hparams *hp) {
    gdn_dims d;
    d.Hk = hp->ssm_n_group;
    d.Hv = hp->ssm_dt_rank;
    d.dk = hp->ssm_d_state;
    d.dv = hp->ssm_d_inner / hp->ssm_dt_rank;
    d.C = conv_channels(hp);
    d.K = hp->ssm_d_conv;
    return d;
}

#endif
