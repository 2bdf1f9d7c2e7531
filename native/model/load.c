/* load.c: loading a Clover / qwen35moe model (clover-spec 4): hyperparameters from the GGUF keys
 * (spec 4.2), every tensor checked by name, type and shape (spec 4.3; the converter applied the
 * transforms: norms carry +1, ssm_a = -exp(A_log), value heads in tiled order so value head h
 * reads key head h % Hk), the decoding record, and the diffusion sidecar holding the block
 * tensors (docs/gguf-layout.md). */
#define _POSIX_C_SOURCE 200809L
#include "model/load.h"
#include "core/ggml_types.h"
#include "gpu/offload.h"
#include "model/model.h"
#include "quant/matmul.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    const clover_gguf *g;
    const char *arch;
    char *err;
    size_t err_size;
    int failed;
    unsigned char *used; /* per tensor of g: 1 once the loader looked it up (NULL: not tracked) */
} loader;

static int64_t key_index(loader *L, const char *suffix) {
    char key[256];
    snprintf(key, sizeof key, "%s.%s", L->arch, suffix);
    return clover_gguf_find_key(L->g, key);
}

static int is_numeric_type(int t) {
    return t != CLOVER_GGUF_STRING && t != CLOVER_GGUF_ARRAY && t >= 0;
}

/* Index of the numeric key `arch.suffix`; -1 when absent (an error when required) or, with
 * L->failed set, when it holds a string or array. */
static int64_t numeric_key(loader *L, const char *suffix, int required) {
    if (L->failed) return -1;
    int64_t i = key_index(L, suffix);
    if (i < 0) {
        if (required) {
            L->failed = 1;
            clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "missing key %s.%s", L->arch, suffix);
        }
        return -1;
    }
    if (!is_numeric_type(clover_gguf_kv_type(L->g, i))) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "key %s.%s: expected a number (type %d)", L->arch,
                       suffix, clover_gguf_kv_type(L->g, i));
        return -1;
    }
    return i;
}

/* Integer hyperparameter `arch.suffix` in [lo, hi]; def when absent and not required. */
static int32_t get_int(loader *L, const char *suffix, int required, int64_t def, int64_t lo, int64_t hi) {
    int64_t i = numeric_key(L, suffix, required);
    if (i < 0) return L->failed ? 0 : (int32_t)def;
    int t = clover_gguf_kv_type(L->g, i);
    if (t == CLOVER_GGUF_FLOAT32 || t == CLOVER_GGUF_FLOAT64) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "key %s.%s: expected an integer, found a float",
                       L->arch, suffix);
        return 0;
    }
    int64_t v = clover_gguf_get_i64(L->g, i, 0);
    if (t == CLOVER_GGUF_UINT64 && clover_gguf_get_u64(L->g, i, 0) > (uint64_t)INT64_MAX) v = INT64_MAX;
    if (v < lo || v > hi) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "key %s.%s: value %lld outside [%lld, %lld]",
                       L->arch, suffix, (long long)v, (long long)lo, (long long)hi);
        return 0;
    }
    return (int32_t)v;
}

static float get_float(loader *L, const char *suffix, int required, double def, double lo, double hi) {
    int64_t i = numeric_key(L, suffix, required);
    if (i < 0) return L->failed ? 0 : (float)def;
    double v = clover_gguf_get_f64(L->g, i, 0);
    if (!(v >= lo && v <= hi)) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "key %s.%s: value %g outside [%g, %g]", L->arch,
                       suffix, v, lo, hi);
        return 0;
    }
    return (float)v;
}

/* Look up tensor `name` and check its shape against ne (ggml order, trailing dims 1).
 * f32_only: the tensor must be F32 (norms, conv, ssm_a, dt). */
static int get_tensor(loader *L, const char *name, int required, int f32_only, int64_t ne0, int64_t ne1,
                      int64_t ne2, clover_tensor *out) {
    memset(out, 0, sizeof *out);
    if (L->failed) return 0;
    int64_t t = clover_gguf_find_tensor(L->g, name);
    if (t < 0) {
        if (required) {
            L->failed = 1;
            clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "missing tensor %s", name);
        }
        return 0;
    }
    if (L->used) L->used[t] = 1;
    int64_t want[4] = {ne0, ne1, ne2, 1};
    int64_t have[4];
    for (int d = 0; d < 4; d++) have[d] = clover_gguf_tensor_ne(L->g, t, d);
    if (memcmp(want, have, sizeof want) != 0) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT,
                       "tensor %s: shape {%lld, %lld, %lld, %lld} expected {%lld, %lld, %lld, 1}", name,
                       (long long)have[0], (long long)have[1], (long long)have[2], (long long)have[3],
                       (long long)ne0, (long long)ne1, (long long)ne2);
        return 0;
    }
    int type = clover_gguf_tensor_type(L->g, t);
    if (f32_only && type != CLOVER_TYPE_F32) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "tensor %s: type %s, expected F32", name,
                       clover_type_name(type) ? clover_type_name(type) : "?");
        return 0;
    }
    if (clover_row_nbytes(type, ne0) < 0) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "tensor %s: type %d not supported for rows of %lld",
                       name, type, (long long)ne0);
        return 0;
    }
    out->type = type;
    out->data = clover_gguf_tensor_data(L->g, t);
    for (int d = 0; d < 4; d++) out->ne[d] = have[d];
    return 1;
}

static const float *get_f32(loader *L, const char *name, int required, int64_t ne0, int64_t ne1) {
    clover_tensor t;
    if (!get_tensor(L, name, required, 1, ne0, ne1, 1, &t)) return NULL;
    return (const float *)t.data;
}

/* The trunk's hyperparameters (spec 4.2, keys prefixed with the architecture; hp->arch set). */
static void read_hparams(loader *L, clover_hparams *hp) {
    hp->n_layer = get_int(L, "block_count", 1, 0, 1, 4096);
    /* llama.cpp keeps MTP layers as extra blocks after the trunk (spec 4.3) */
    hp->n_layer_nextn = get_int(L, "nextn_predict_layers", 0, 0, 0, 4096);
    hp->n_ctx_train = get_int(L, "context_length", 0, 4096, 1, INT32_MAX);
    hp->n_embd = get_int(L, "embedding_length", 1, 0, 1, 1 << 20);
    hp->n_head = get_int(L, "attention.head_count", 1, 0, 1, 4096);
    hp->n_head_kv = get_int(L, "attention.head_count_kv", 1, 0, 1, 4096);
    hp->head_dim = get_int(L, "attention.key_length", 1, 0, 2, 1 << 16);
    int32_t vlen = get_int(L, "attention.value_length", 0, hp->head_dim, 1, 1 << 16);
    hp->rope_dim = get_int(L, "rope.dimension_count", 1, 0, 2, 1 << 16);
    hp->rms_eps = get_float(L, "attention.layer_norm_rms_epsilon", 1, 0, 0, 1);
    hp->rope_theta = get_float(L, "rope.freq_base", 0, 1e7, 1e-3, 1e30);
    hp->n_expert = get_int(L, "expert_count", 1, 0, 1, 1 << 16);
    hp->n_expert_used = get_int(L, "expert_used_count", 1, 0, 1, 1 << 16);
    hp->n_ff_exp = get_int(L, "expert_feed_forward_length", 1, 0, 1, 1 << 24);
    hp->n_ff_shexp = get_int(L, "expert_shared_feed_forward_length", 1, 0, 1, 1 << 24);
    hp->ssm_d_conv = get_int(L, "ssm.conv_kernel", 1, 0, 1, 64);
    hp->ssm_d_state = get_int(L, "ssm.state_size", 1, 0, 1, 1 << 16);
    hp->ssm_n_group = get_int(L, "ssm.group_count", 1, 0, 1, 4096);
    hp->ssm_dt_rank = get_int(L, "ssm.time_step_rank", 1, 0, 1, 4096);
    hp->ssm_d_inner = get_int(L, "ssm.inner_size", 1, 0, 1, 1 << 24);
    hp->full_attention_interval = get_int(L, "full_attention_interval", 0, 4, 1, 4096);
    hp->pooling_type = get_int(L, "pooling_type", 0, CLOVER_POOLING_LAST, CLOVER_POOLING_NONE, CLOVER_POOLING_RANK);
    if (L->failed) return;
    const char *bad = NULL;
    if (hp->n_layer_nextn >= hp->n_layer) bad = "nextn_predict_layers >= block_count (no trunk layer left)";
    else if (vlen != hp->head_dim) bad = "attention.value_length != attention.key_length";
    else if (hp->n_head % hp->n_head_kv) bad = "attention.head_count not a multiple of head_count_kv";
    else if (hp->rope_dim > hp->head_dim || hp->rope_dim % 2) bad = "rope.dimension_count odd or > key_length";
    else if (hp->n_expert_used > hp->n_expert) bad = "expert_used_count > expert_count";
    else if (hp->ssm_dt_rank % hp->ssm_n_group) bad = "ssm.time_step_rank not a multiple of ssm.group_count";
    else if (hp->ssm_d_inner % hp->ssm_dt_rank) bad = "ssm.inner_size not a multiple of ssm.time_step_rank";
    else if (hp->ssm_d_conv < 2) bad = "ssm.conv_kernel < 2";
    if (bad) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "%s: %s", L->arch, bad);
        return;
    }
    hp->n_layer -= hp->n_layer_nextn;
    if (hp->arch == CLOVER_ARCH_CLOVER_MOE) /* llama.cpp's clover_moe; the engine runs one shared expert */
        get_int(L, "expert_shared_count", 0, 1, 1, 1);
}

/* Layer il is a full-attention layer: attention.recurrent_layers when present (false =
 * attention), else every full_attention_interval-th layer (spec 1: i % 4 == 3). */
static int layer_is_attn(loader *L, const clover_hparams *hp, int il) {
    int64_t k = key_index(L, "attention.recurrent_layers");
    if (k >= 0 && clover_gguf_kv_type(L->g, k) == CLOVER_GGUF_ARRAY && clover_gguf_arr_n(L->g, k) > il)
        return clover_gguf_get_i64(L->g, k, il) == 0;
    return (il + 1) % hp->full_attention_interval == 0;
}

static void load_layer(loader *L, const clover_hparams *hp, int il, clover_layer *ly) {
    char n[128];
#define TN(suffix) (snprintf(n, sizeof n, "blk.%d." suffix, il), n)
    const int64_t H = hp->n_embd, E = hp->n_expert;
    ly->attn_norm = get_f32(L, TN("attn_norm.weight"), 1, H, 1);
    ly->post_norm = get_f32(L, TN("post_attention_norm.weight"), 1, H, 1);
    if (ly->is_attn) {
        const int64_t hd = hp->head_dim;
        get_tensor(L, TN("attn_q.weight"), 1, 0, H, hp->n_head * 2 * hd, 1, &ly->wq);
        get_tensor(L, TN("attn_k.weight"), 1, 0, H, hp->n_head_kv * hd, 1, &ly->wk);
        get_tensor(L, TN("attn_v.weight"), 1, 0, H, hp->n_head_kv * hd, 1, &ly->wv);
        get_tensor(L, TN("attn_output.weight"), 1, 0, hp->n_head * hd, H, 1, &ly->wo);
        ly->q_norm = get_f32(L, TN("attn_q_norm.weight"), 1, hd, 1);
        ly->k_norm = get_f32(L, TN("attn_k_norm.weight"), 1, hd, 1);
    } else {
        const int64_t Hv = hp->ssm_dt_rank, dk = hp->ssm_d_state, Hk = hp->ssm_n_group;
        const int64_t vdim = hp->ssm_d_inner, dv = vdim / Hv, C = 2 * Hk * dk + vdim;
        get_tensor(L, TN("attn_qkv.weight"), 1, 0, H, C, 1, &ly->wqkv);
        get_tensor(L, TN("attn_gate.weight"), 1, 0, H, vdim, 1, &ly->wz);
        get_tensor(L, TN("ssm_beta.weight"), 1, 0, H, Hv, 1, &ly->wbeta);
        get_tensor(L, TN("ssm_alpha.weight"), 1, 0, H, Hv, 1, &ly->walpha);
        get_tensor(L, TN("ssm_out.weight"), 1, 0, vdim, H, 1, &ly->wout);
        ly->conv = get_f32(L, TN("ssm_conv1d.weight"), 1, hp->ssm_d_conv, C);
        ly->ssm_a = get_f32(L, TN("ssm_a"), 1, Hv, 1);
        ly->dt_bias = get_f32(L, TN("ssm_dt.bias"), 1, Hv, 1);
        ly->ssm_norm = get_f32(L, TN("ssm_norm.weight"), 1, dv, 1);
    }
    get_tensor(L, TN("ffn_gate_inp.weight"), 1, 0, H, E, 1, &ly->router);
    get_tensor(L, TN("ffn_gate_exps.weight"), 1, 0, H, hp->n_ff_exp, E, &ly->gate_exps);
    get_tensor(L, TN("ffn_up_exps.weight"), 1, 0, H, hp->n_ff_exp, E, &ly->up_exps);
    get_tensor(L, TN("ffn_down_exps.weight"), 1, 0, hp->n_ff_exp, H, E, &ly->down_exps);
    get_tensor(L, TN("ffn_gate_inp_shexp.weight"), 1, 0, H, 1, 1, &ly->shexp_gate);
    get_tensor(L, TN("ffn_gate_shexp.weight"), 1, 0, H, hp->n_ff_shexp, 1, &ly->gate_sh);
    get_tensor(L, TN("ffn_up_shexp.weight"), 1, 0, H, hp->n_ff_shexp, 1, &ly->up_sh);
    get_tensor(L, TN("ffn_down_shexp.weight"), 1, 0, hp->n_ff_shexp, H, 1, &ly->down_sh);
#undef TN
}

/* MTP layer il (llama.cpp's NextN block after the trunk, as llama.cpp's qwen35moe loads it): a
 * full-attention decoder block with its MoE, the projection and norms eh_proj, enorm, hnorm, and
 * optionally embed_tokens, shared_head_head and shared_head_norm, each with the right shape. The
 * engine does not run it (self-speculation uses block mode, spec 5.5), so nothing is kept. */
static void check_mtp_layer(loader *L, const clover_hparams *hp, int il) {
    char n[128];
    clover_tensor t;
    clover_layer ly = {.is_attn = 1};
    const int64_t H = hp->n_embd, V = hp->n_vocab;
    load_layer(L, hp, il, &ly);
#define NN(suffix) (snprintf(n, sizeof n, "blk.%d.nextn." suffix, il), n)
    get_tensor(L, NN("eh_proj.weight"), 1, 0, 2 * H, H, 1, &t);
    get_f32(L, NN("enorm.weight"), 1, H, 1);
    get_f32(L, NN("hnorm.weight"), 1, H, 1);
    get_tensor(L, NN("embed_tokens.weight"), 0, 0, H, V, 1, &t);
    get_tensor(L, NN("shared_head_head.weight"), 0, 0, H, V, 1, &t);
    get_f32(L, NN("shared_head_norm.weight"), 0, H, 1);
#undef NN
}

/* Every tensor of L's file is one the model reads (llama.cpp's done_getting_tensors: "wrong
 * number of tensors"): 0 with the error naming the first tensor in file order that no lookup
 * used. */
static int check_all_used(loader *L, const clover_hparams *hp) {
    const int64_t n = clover_gguf_n_tensors(L->g);
    int64_t first = -1, n_used = 0;
    for (int64_t t = 0; t < n; t++) {
        if (L->used[t]) n_used++;
        else if (first < 0) first = t;
    }
    if (first < 0) return 1;
    char nextn[64] = "";
    if (hp->n_layer_nextn)
        snprintf(nextn, sizeof nextn, " and nextn_predict_layers %d", hp->n_layer_nextn);
    clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT,
                   "%s: not part of a %s model with block_count %d%s (the model uses %lld of the file's %lld "
                   "tensors)", clover_gguf_tensor_name(L->g, first), L->arch, hp->n_layer + hp->n_layer_nextn, nextn,
                   (long long)n_used, (long long)n);
    return 0;
}

/* Clover's block tensors of a GDN layer (spec 3.3; names and shapes: docs/gguf-layout.md). */
static const char *const BLOCK_TENSORS[4] = {"ssm_conv1d_right.weight", "bd_logit_scale", "bd_history_bias",
                                              "bd_history_c"};

/* Whether g holds any block tensor of one of m's GDN layers. */
static int has_any_block_tensor(const clover_gguf *g, const clover_model *m) {
    char n[128];
    for (int il = 0; il < m->hp.n_layer; il++)
        for (int j = 0; j < 4 && !m->layers[il].is_attn; j++) {
            snprintf(n, sizeof n, "blk.%d.%s", il, BLOCK_TENSORS[j]);
            if (clover_gguf_find_tensor(g, n) >= 0) return 1;
        }
    return 0;
}

/* The four block tensors of every GDN layer of m from L's file, each required, F32, of the
 * trunk's shapes: the right conv taps {K-1, C} and lambda, beta0, c {Hv}. 0 with the error set
 * (naming the tensor) when one is missing or misshapen. */
static int load_block_tensors(loader *L, clover_model *m) {
    const clover_hparams *hp = &m->hp;
    const int64_t C = conv_channels(hp), Hv = hp->ssm_dt_rank;
    char n[128];
    for (int il = 0; il < hp->n_layer && !L->failed; il++) {
        clover_layer *ly = &m->layers[il];
        if (ly->is_attn) continue;
#define BN(j) (snprintf(n, sizeof n, "blk.%d.%s", il, BLOCK_TENSORS[j]), n)
        ly->conv_right = get_f32(L, BN(0), 1, hp->ssm_d_conv - 1, C);
        ly->bd_lambda = get_f32(L, BN(1), 1, Hv, 1);
        ly->bd_beta0 = get_f32(L, BN(2), 1, Hv, 1);
        ly->bd_c = get_f32(L, BN(3), 1, Hv, 1);
#undef BN
    }
    return !L->failed;
}

/* String value of key `name` of L's file, or NULL when absent; a key of another type fails L. */
static const char *get_str_key(loader *L, const char *name) {
    const int64_t k = clover_gguf_find_key(L->g, name);
    if (k < 0 || L->failed) return NULL;
    const char *v = clover_gguf_kv_type(L->g, k) == CLOVER_GGUF_STRING ? clover_gguf_get_str(L->g, k, 0, NULL) : NULL;
    if (!v) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT, "key %s: expected a string (type %d)", name,
                       clover_gguf_kv_type(L->g, k));
    }
    return v;
}

/* The decoding record (docs/gguf-layout.md: diffusion.* and tokenizer.ggml.mask_token_id) of L's
 * file into hp; absent keys take spec 4.2's defaults. A qwen35moe file has no record: no
 * penalties, the prompt counted by the repetition penalty, and no mask token even where its
 * tokenizer names one (llama.cpp's converter writes it), so every token is a candidate as in
 * llama.cpp. The mask token is required with the block tensors. 0 with the error set on a
 * bad value. */
static int read_record(loader *L, clover_hparams *hp) {
    const char *arch = L->arch;
    const int clover = hp->arch == CLOVER_ARCH_CLOVER_MOE;
    L->arch = "tokenizer.ggml";
    hp->mask_token_id = clover ? get_int(L, "mask_token_id", hp->has_block, -1, 0, hp->n_vocab - 1) : -1;
    L->arch = "diffusion";
    hp->shift_logits = get_int(L, "shift_logits", 0, 0, 0, 1);
    hp->block_size = get_int(L, "block_size", 0, 32, 1, 1 << 16);
    hp->block_aligned = get_int(L, "block_aligned", 0, 1, 0, 1);
    hp->threshold = get_float(L, "threshold", 0, 0.95, 1e-9, 1.0);
    hp->coreset_top_p = get_float(L, "moe_block_coreset_top_p", 0, 0.9, 1e-9, 1.0);
    hp->presence_penalty = get_float(L, "presence_penalty", 0, clover ? 0.9 : 0.0, -1e9, 1e9);
    hp->frequency_penalty = get_float(L, "frequency_penalty", 0, 0.0, -1e9, 1e9);
    hp->repetition_penalty = get_float(L, "repetition_penalty", 0, clover ? 1.05 : 1.0, 1e-9, 1e9);
    hp->think_close_bias_start = get_int(L, "think_close_bias_start", 0, 4096, 0, INT32_MAX);
    hp->eos_bias_start = get_int(L, "eos_bias_start", 0, 8192, 0, INT32_MAX);
    hp->bias_slope = get_float(L, "bias_slope", 0, 0.01, 0.0, 1e9);
    hp->bias_max = get_float(L, "bias_max", 0, 10.0, 0.0, 1e9);
    const char *scope = get_str_key(L, "diffusion.penalty_scope");
    hp->penalty_scope = clover ? CLOVER_PENALTY_RESPONSE : CLOVER_PENALTY_ALL;
    if (scope && strcmp(scope, "response") == 0) hp->penalty_scope = CLOVER_PENALTY_RESPONSE;
    else if (scope && strcmp(scope, "all") == 0) hp->penalty_scope = CLOVER_PENALTY_ALL;
    else if (scope && !L->failed) {
        L->failed = 1;
        clover_set_err(L->err, L->err_size, CLOVER_E_FORMAT,
                       "key diffusion.penalty_scope: '%s' (expected \"response\" or \"all\")", scope);
    }
    if (!clover) { /* a parent's file: llama.cpp's defaults whatever it holds */
        hp->presence_penalty = hp->frequency_penalty = 0.0f;
        hp->repetition_penalty = 1.0f;
        hp->penalty_scope = CLOVER_PENALTY_ALL;
    }
    L->arch = arch;
    return !L->failed;
}

/* Special token ids (tokenizer.ggml.*_token_id) must be integers in [0, n_vocab), and the
 * vocabulary (tokenizer.ggml.tokens), when present, an array of strings with one entry per row of
 * token_embd.weight, so that every id the engine may emit has a token (llama.cpp takes n_vocab
 * from the token list and refuses a token_embd.weight of another row count). */
static int check_vocab_keys(const clover_gguf *g, int32_t n_vocab, char *err, size_t err_size) {
    static const char *ids[] = {"bos", "eos", "eot", "eom", "padding", "unknown", "seperator", "mask"};
    char key[64];
    for (size_t j = 0; j < sizeof ids / sizeof ids[0]; j++) {
        snprintf(key, sizeof key, "tokenizer.ggml.%s_token_id", ids[j]);
        const int64_t k = clover_gguf_find_key(g, key);
        if (k < 0) continue;
        const int t = clover_gguf_kv_type(g, k);
        if (t == CLOVER_GGUF_STRING || t == CLOVER_GGUF_ARRAY || t == CLOVER_GGUF_FLOAT32 || t == CLOVER_GGUF_FLOAT64 ||
            t == CLOVER_GGUF_BOOL) {
            clover_set_err(err, err_size, CLOVER_E_FORMAT, "key %s: expected an integer token id (type %d)", key, t);
            return 0;
        }
        const int64_t v = clover_gguf_get_i64(g, k, 0);
        if (v < 0 || v >= n_vocab || (t == CLOVER_GGUF_UINT64 && clover_gguf_get_u64(g, k, 0) > (uint64_t)INT64_MAX)) {
            clover_set_err(err, err_size, CLOVER_E_FORMAT, "key %s: token id %lld outside [0, %d) (token_embd.weight rows)",
                           key, (long long)v, n_vocab);
            return 0;
        }
    }
    const int64_t kt = clover_gguf_find_key(g, "tokenizer.ggml.tokens");
    if (kt < 0) return 1;
    if (clover_gguf_kv_type(g, kt) != CLOVER_GGUF_ARRAY || clover_gguf_arr_type(g, kt) != CLOVER_GGUF_STRING) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "key tokenizer.ggml.tokens: expected an array of strings "
                       "(type %d)", clover_gguf_kv_type(g, kt));
        return 0;
    }
    const int64_t n_tokens = clover_gguf_arr_n(g, kt);
    if (n_tokens != n_vocab) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "key tokenizer.ggml.tokens: %lld entries, but token_embd.weight "
                       "has %d rows (n_vocab): the vocabulary must name every id the model can emit, and no more",
                       (long long)n_tokens, n_vocab);
        return 0;
    }
    return 1;
}

/* The model of an opened GGUF (taken over: closed on failure and by clover_model_free). */
static clover_model *load_from(clover_gguf *g, char *err, size_t err_size) {
    if (!g) return NULL;
    clover_model *m = calloc(1, sizeof *m);
    if (!m) {
        clover_gguf_close(g);
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        return NULL;
    }
    m->g = g;
    loader L = {g, NULL, err, err_size, 0, NULL};
    int64_t ka = clover_gguf_find_key(g, "general.architecture");
    const char *arch = ka >= 0 ? clover_gguf_get_str(g, ka, 0, NULL) : NULL;
    if (!arch) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "missing key general.architecture");
        goto fail;
    }
    clover_hparams *hp = &m->hp;
    const int64_t kt = clover_gguf_find_key(g, "general.type");
    const char *type = kt >= 0 ? clover_gguf_get_str(g, kt, 0, NULL) : NULL;
    if (type && strcmp(type, "diffusion") == 0) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "general.type: this is a diffusion sidecar (block tensors and "
                       "decoding record only): load its clover_moe model, with the sidecar beside it or passed as "
                       "--diffusion / diffusion_path");
        goto fail;
    }
    if (strcmp(arch, "clover_moe") == 0) hp->arch = CLOVER_ARCH_CLOVER_MOE;
    else if (strcmp(arch, "qwen35moe") == 0) hp->arch = CLOVER_ARCH_QWEN35MOE;
    else {
        clover_set_err(err, err_size, CLOVER_E_FORMAT,
                       "general.architecture: '%s' is not supported (expected clover_moe or qwen35moe)", arch);
        goto fail;
    }
    L.arch = arch;
    read_hparams(&L, hp);
    if (L.failed) goto fail;

    int64_t t_emb = clover_gguf_find_tensor(g, "token_embd.weight");
    if (t_emb < 0) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "missing tensor token_embd.weight");
        goto fail;
    }
    int64_t V = clover_gguf_tensor_ne(g, t_emb, 1);
    if (V < 1 || V > INT32_MAX) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "token_embd.weight: vocab size %lld", (long long)V);
        goto fail;
    }
    hp->n_vocab = (int32_t)V;
    if (!check_vocab_keys(g, hp->n_vocab, err, err_size)) goto fail;
    L.used = calloc((size_t)clover_gguf_n_tensors(g) + 1, 1);
    if (!L.used) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        goto fail;
    }
    get_tensor(&L, "token_embd.weight", 1, 0, hp->n_embd, V, 1, &m->tok_embd);
    get_tensor(&L, "output.weight", 1, 0, hp->n_embd, V, 1, &m->output);
    m->output_norm = get_f32(&L, "output_norm.weight", 1, hp->n_embd, 1);
    m->layers = calloc((size_t)hp->n_layer, sizeof *m->layers);
    if (!m->layers) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        goto fail;
    }
    for (int il = 0; il < hp->n_layer && !L.failed; il++) {
        clover_layer *ly = &m->layers[il];
        ly->is_attn = layer_is_attn(&L, hp, il);
        ly->slot = ly->is_attn ? m->n_attn++ : m->n_gdn++;
        load_layer(&L, hp, il, ly);
    }
    if (L.failed) goto fail;
    /* Clover's block tensors in the file itself (a complete file), and the decoding record */
    if (hp->arch == CLOVER_ARCH_CLOVER_MOE && has_any_block_tensor(g, m)) {
        if (!load_block_tensors(&L, m)) goto fail;
        hp->has_block = 1;
    }
    if (!read_record(&L, hp)) goto fail;
    for (int il = hp->n_layer; il < hp->n_layer + hp->n_layer_nextn && !L.failed; il++) check_mtp_layer(&L, hp, il);
    if (L.failed || !check_all_used(&L, hp)) goto fail;
    free(L.used);
    return m;
fail:
    free(L.used);
    clover_model_free(m);
    return NULL;
}

/* Whether name is the block tensor of one of m's GDN layers. */
static int is_block_tensor(const clover_model *m, const char *name) {
    char n[128];
    for (int il = 0; il < m->hp.n_layer; il++)
        for (int j = 0; j < 4 && !m->layers[il].is_attn; j++) {
            snprintf(n, sizeof n, "blk.%d.%s", il, BLOCK_TENSORS[j]);
            if (strcmp(n, name) == 0) return 1;
        }
    return 0;
}

/* Check the opened sidecar g against m and take its block tensors and record (docs/gguf-layout.md:
 * general.architecture clover_moe, general.type "diffusion", clover_moe.block_count the trunk's
 * decoder layers, the four block tensors of each GDN layer and nothing else). 0 with the error
 * (without the file name) in err. */
static int take_sidecar(clover_model *m, clover_gguf *g, char *err, size_t err_size) {
    loader L = {g, "clover_moe", err, err_size, 0, NULL};
    const char *arch = get_str_key(&L, "general.architecture"), *type = get_str_key(&L, "general.type");
    if (L.failed) return 0;
    if (!arch || strcmp(arch, "clover_moe") != 0)
        return !clover_set_err(err, err_size, CLOVER_E_FORMAT, "general.architecture '%s' (expected clover_moe)",
                               arch ? arch : "(missing)");
    if (!type || strcmp(type, "diffusion") != 0)
        return !clover_set_err(err, err_size, CLOVER_E_FORMAT, "general.type '%s' (expected diffusion)",
                               type ? type : "(missing)");
    const int32_t n = get_int(&L, "block_count", 1, 0, 0, INT32_MAX);
    if (L.failed) return 0;
    if (n != m->hp.n_layer)
        return !clover_set_err(err, err_size, CLOVER_E_FORMAT,
                               "clover_moe.block_count %d, but the model has %d decoder layers", n, m->hp.n_layer);
    for (int64_t t = 0; t < clover_gguf_n_tensors(g); t++)
        if (!is_block_tensor(m, clover_gguf_tensor_name(g, t)))
            return !clover_set_err(err, err_size, CLOVER_E_FORMAT,
                                   "tensor %s is not a block tensor of one of the model's Gated DeltaNet layers",
                                   clover_gguf_tensor_name(g, t));
    m->hp.has_block = 1;
    if (!load_block_tensors(&L, m) || !read_record(&L, &m->hp)) return 0;
    return 1;
}

/* Attach the sidecar at path to m (a clover_moe model without block tensors). */
static int attach_sidecar(clover_model *m, const char *path, char *err, size_t err_size) {
    if (m->hp.arch != CLOVER_ARCH_CLOVER_MOE)
        return clover_set_err(err, err_size, CLOVER_E_ARG,
                              "diffusion sidecar %s: the model is qwen35moe; a sidecar goes with a clover_moe model",
                              path);
    if (m->hp.has_block)
        return clover_set_err(err, err_size, CLOVER_E_ARG,
                              "diffusion sidecar %s: the model holds the block tensors itself (a complete file)", path);
    char why[512];
    clover_gguf *g = clover_gguf_open(path, why, sizeof why);
    if (!g) return clover_set_err(err, err_size, CLOVER_E_FORMAT, "diffusion sidecar: %s", why);
    const clover_hparams trunk = m->hp;
    if (!take_sidecar(m, g, why, sizeof why)) {
        m->hp = trunk;
        for (int il = 0; il < m->hp.n_layer; il++) {
            clover_layer *ly = &m->layers[il];
            ly->conv_right = ly->bd_lambda = ly->bd_beta0 = ly->bd_c = NULL;
        }
        clover_gguf_close(g);
        return clover_set_err(err, err_size, CLOVER_E_FORMAT, "diffusion sidecar %s: %s", path, why);
    }
    m->side = g;
    m->side_path = strdup(path);
    if (!m->side_path) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    return CLOVER_OK;
}

/* The sidecar's name beside a model (path less a trailing ".gguf", then ".diffusion.gguf") in
 * out; 0 when it does not fit. */
static int sidecar_name(const char *path, char *out, size_t out_size) {
    size_t n = strlen(path);
    if (n >= 5 && strcmp(path + n - 5, ".gguf") == 0) n -= 5;
    const int k = snprintf(out, out_size, "%.*s.diffusion.gguf", (int)n, path);
    return k > 0 && (size_t)k < out_size;
}

/* sidecar_name when that file exists. */
static int sidecar_beside(const char *path, char *out, size_t out_size) {
    return sidecar_name(path, out, out_size) && access(out, F_OK) == 0;
}

clover_model *clover_model_load_sidecar(const char *path, const char *diffusion_path, char *err, size_t err_size) {
    if (!path) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "path is NULL");
        return NULL;
    }
    clover_model *m = load_from(clover_gguf_open(path, err, err_size), err, err_size);
    if (!m) return NULL;
    if (!(m->path = strdup(path))) {
        clover_model_free(m);
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        return NULL;
    }
    char beside[4096];
    const char *side = diffusion_path;
    const int bare_trunk = m->hp.arch == CLOVER_ARCH_CLOVER_MOE && !m->hp.has_block;
    if (!side && bare_trunk && sidecar_beside(path, beside, sizeof beside)) side = beside;
    if (side && *side && attach_sidecar(m, side, err, err_size) != CLOVER_OK) {
        clover_model_free(m);
        return NULL;
    }
    return m;
}

clover_model *clover_model_load(const char *path, char *err, size_t err_size) {
    return clover_model_load_sidecar(path, NULL, err, err_size);
}

const char *clover_model_sidecar_path(const clover_model *m) { return m ? m->side_path : NULL; }

int clover_no_block(const clover_model *m, const char *what, char *err, size_t err_size) {
    if (m->hp.arch != CLOVER_ARCH_CLOVER_MOE)
        return clover_set_err(err, err_size, CLOVER_E_STATE,
                              "%s needs a Clover model (this file is qwen35moe: use mode ar)", what);
    char side[4096] = "MODEL.diffusion.gguf";
    if (m->path) sidecar_name(m->path, side, sizeof side);
    return clover_set_err(err, err_size, CLOVER_E_STATE,
                          "%s needs Clover's block tensors (blk.N.ssm_conv1d_right.weight, blk.N.bd_*), which this "
                          "clover_moe file lacks (llama.cpp's converter drops them): make the diffusion sidecar with "
                          "`clover-gguf convert HF_DIR --diffusion-only -o %s` (HF_DIR: the Hugging Face checkpoint) "
                          "or pass --diffusion FILE; mode ar runs without it", what, side);
}

clover_model *clover_model_load_memory(const void *data, size_t size, char *err, size_t err_size) {
    return load_from(clover_gguf_open_memory(data, size, err, err_size), err, err_size);
}

void clover_model_free(clover_model *m) {
    if (!m) return;
    if (m->layers) free_gpu(m);
    free(m->layers);
    clover_gguf_close(m->side);
    free(m->side_path);
    free(m->path);
    clover_gguf_close(m->g);
    free(m);
}

const clover_gguf *clover_model_gguf(const clover_model *m) { return m ? m->g : NULL; }

int clover_model_mlock(const clover_model *m, char *err, size_t err_size) {
    if (!m) return clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
    char why[400];
    const clover_gguf *files[2] = {m->g, m->side};
    const char *names[2] = {m->path ? m->path : "<memory>", m->side_path};
    for (int i = 0; i < 2; i++)
        if (files[i] && clover_gguf_mlock(files[i], why, sizeof why) != CLOVER_OK)
            return clover_set_err(err, err_size, CLOVER_E_IO, "%s: %s", names[i], why);
    return CLOVER_OK;
}

size_t clover_struct_size(const char *name) {
    if (!name) return 0;
    if (strcmp(name, "clover_hparams") == 0) return sizeof(clover_hparams);
    if (strcmp(name, "clover_gen_params") == 0) return sizeof(clover_gen_params);
    if (strcmp(name, "clover_stats") == 0) return sizeof(clover_stats);
    return 0;
}

void clover_model_hparams(const clover_model *m, clover_hparams *out) {
    if (m && out) *out = m->hp;
}

/* 1 when layer il of m is a full-attention layer, 0 a Gated DeltaNet layer (layer_is_attn's rule,
 * stored by the loader), -1 for a NULL model or il outside [0, n_layer). */
int32_t clover_model_layer_is_attn(const clover_model *m, int32_t il) {
    if (!m || il < 0 || il >= m->hp.n_layer) return -1;
    return m->layers[il].is_attn ? 1 : 0;
}
