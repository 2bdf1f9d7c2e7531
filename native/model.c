/* model.c: the one Clover / qwen35moe graph on the CPU.
 *
 * Loading (hyperparameters from GGUF keys, every tensor checked by name, type and shape), the
 * per-sequence context (KV cache, GDN state, conv history), and the forward passes:
 * prefix (causal) mode and block (denoising) mode, clover-spec sections 2-3 and 5.6.
 * Weights and tensor layout follow spec 4.3 (the converter applied the transforms: norms carry
 * +1, ssm_a = -exp(A_log), value heads in tiled order so value head h reads key head h % Hk).
 */
#define _POSIX_C_SOURCE 200809L
#include "engine.h"
#include "cuda/cuda_backend.h"
#include "dot.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

int clover_set_err(char *err, size_t err_size, int code, const char *fmt, ...) {
    if (err && err_size > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_size, fmt, ap);
        va_end(ap);
    }
    return code;
}

/* ------------------------------------------------------------------ loading */

typedef struct {
    const clover_gguf *g;
    const char *arch;
    char *err;
    size_t err_size;
    int failed;
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

static const char *type_name(int t) {
    switch (t) {
    case CLOVER_TYPE_F32: return "F32";
    case CLOVER_TYPE_F16: return "F16";
    case CLOVER_TYPE_BF16: return "BF16";
    case CLOVER_TYPE_Q8_0: return "Q8_0";
    default: return "?";
    }
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
                       type_name(type));
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

/* MTP layer il (llama.cpp's NextN block after the trunk): its projection and norms must be
 * present with the right shapes; the engine does not run it (self-speculation uses block
 * mode, spec 5.5), so nothing is kept. */
static void check_mtp_layer(loader *L, const clover_hparams *hp, int il) {
    char n[128];
    clover_tensor t;
    const int64_t H = hp->n_embd;
    snprintf(n, sizeof n, "blk.%d.nextn.eh_proj.weight", il);
    get_tensor(L, n, 1, 0, 2 * H, H, 1, &t);
    snprintf(n, sizeof n, "blk.%d.nextn.enorm.weight", il);
    get_f32(L, n, 1, H, 1);
    snprintf(n, sizeof n, "blk.%d.nextn.hnorm.weight", il);
    get_f32(L, n, 1, H, 1);
}

/* Channels of a GDN layer's conv: q and k of Hk key heads, v of Hv value heads (spec 2.1). */
static int64_t conv_channels(const clover_hparams *hp) {
    return 2 * (int64_t)hp->ssm_n_group * hp->ssm_d_state + hp->ssm_d_inner;
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
 * vocabulary (tokenizer.ggml.tokens) must not list more entries than token_embd.weight has rows. */
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
    if (kt >= 0 && clover_gguf_kv_type(g, kt) == CLOVER_GGUF_ARRAY && clover_gguf_arr_n(g, kt) > n_vocab) {
        clover_set_err(err, err_size, CLOVER_E_FORMAT, "key tokenizer.ggml.tokens: %lld entries but token_embd.weight "
                       "has %d rows", (long long)clover_gguf_arr_n(g, kt), n_vocab);
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
    loader L = {g, NULL, err, err_size, 0};
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
    if (L.failed) goto fail;
    return m;
fail:
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
    loader L = {g, "clover_moe", err, err_size, 0};
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

/* The weight tensors of layer il whose products can run on the GPU (NULL-terminated): experts
 * selects the routed experts (gate/up/down_exps) or everything else (attention or GDN
 * projections, router, shared expert). */
static void layer_weights(clover_layer *ly, int experts, clover_tensor **out) {
    clover_tensor *dense[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->wqkv, &ly->wz, &ly->wbeta, &ly->walpha,
                              &ly->wout, &ly->router, &ly->shexp_gate, &ly->gate_sh, &ly->up_sh, &ly->down_sh};
    clover_tensor *routed[] = {&ly->gate_exps, &ly->up_exps, &ly->down_exps};
    clover_tensor **all = experts ? routed : dense;
    const size_t n_all = experts ? sizeof routed / sizeof routed[0] : sizeof dense / sizeof dense[0];
    int n = 0;
    for (size_t i = 0; i < n_all; i++)
        if (all[i]->data) out[n++] = all[i];
    out[n] = NULL;
}

static int64_t tensor_bytes(const clover_tensor *t) {
    return clover_row_nbytes(t->type, t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3];
}

/* A layer's float32 vectors with their device copies (ly->dev) and lengths; NULL-terminated. */
typedef struct {
    const float *host;
    float **dev;
    int64_t n;
} vec_pair;

static void layer_vectors(const clover_hparams *hp, clover_layer *ly, vec_pair *out) {
    const int64_t H = hp->n_embd, hd = hp->head_dim, Hv = hp->ssm_dt_rank, dv = Hv ? hp->ssm_d_inner / Hv : 0;
    const int64_t C = conv_channels(hp), CK = C * hp->ssm_d_conv;
    const vec_pair all[] = {{ly->attn_norm, &ly->dev.attn_norm, H},   {ly->post_norm, &ly->dev.post_norm, H},
                            {ly->q_norm, &ly->dev.q_norm, hd},        {ly->k_norm, &ly->dev.k_norm, hd},
                            {ly->conv, &ly->dev.conv, CK},            {ly->ssm_a, &ly->dev.ssm_a, Hv},
                            {ly->dt_bias, &ly->dev.dt_bias, Hv},      {ly->ssm_norm, &ly->dev.ssm_norm, dv},
                            {ly->conv_right, &ly->dev.conv_right, CK - C}, {ly->bd_lambda, &ly->dev.bd_lambda, Hv},
                            {ly->bd_beta0, &ly->dev.bd_beta0, Hv},    {ly->bd_c, &ly->dev.bd_c, Hv}};
    int n = 0;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (all[i].host) out[n++] = all[i];
    out[n].host = NULL;
}

static void free_gpu(clover_model *m) {
    clover_tensor *w[24];
    vec_pair v[16];
    for (int il = 0; il < m->hp.n_layer; il++) {
        for (int experts = 0; experts < 2; experts++) {
            layer_weights(&m->layers[il], experts, w);
            for (int i = 0; w[i]; i++) clover_cuda_free(w[i]->dev), w[i]->dev = NULL;
        }
        layer_vectors(&m->hp, &m->layers[il], v);
        for (int i = 0; v[i].host; i++) clover_cuda_free(*v[i].dev), *v[i].dev = NULL;
    }
    clover_cuda_free(m->output.dev);
    clover_cuda_free(m->output_norm_dev);
    m->output.dev = NULL;
    m->output_norm_dev = NULL;
    m->n_gpu_layers = 0;
    m->gpu_bytes = 0;
    m->resident = m->cpu_experts = 0;
    m->dev_epoch++;
}

/* Dimensions within the resident forward's kernels (native/cuda/cuda_backend.h). */
static int resident_dims_ok(const clover_hparams *hp) {
    const int64_t hd = hp->head_dim, Hv = hp->ssm_dt_rank, dv = Hv ? hp->ssm_d_inner / Hv : 0;
    return hd % 32 == 0 && hd <= 256 && hp->n_head <= 65535 && hp->n_head_kv > 0 && hp->n_head % hp->n_head_kv == 0 &&
           hp->ssm_d_state <= 256 && dv <= 1024 && hp->n_expert <= 1024 && hp->ssm_d_conv <= 16 &&
           hp->rope_dim % 2 == 0 && hp->rope_dim <= hd;
}

/* Whether a whole offload makes the model resident: not with CLOVER_GPU_RESIDENT=0 (the
 * per-product path, for comparison) or dimensions the resident kernels do not take. */
static int resident_wanted(const clover_model *m) {
    const char *env = getenv("CLOVER_GPU_RESIDENT");
    return !(env && strcmp(env, "0") == 0) && resident_dims_ok(&m->hp);
}

/* After a whole offload (every layer, with or without its routed experts (--n-cpu-moe), and the
 * output): copy the float32 vectors (norms, conv weights, gates) to the device too and mark the
 * model resident, where resident_wanted. */
static int make_resident(clover_model *m, char *err, size_t err_size) {
    if (!resident_wanted(m)) return CLOVER_OK;
    vec_pair v[16];
    int rc = CLOVER_OK;
    for (int il = 0; il < m->hp.n_layer && rc == CLOVER_OK; il++) {
        layer_vectors(&m->hp, &m->layers[il], v);
        for (int i = 0; v[i].host && rc == CLOVER_OK; i++) {
            rc = clover_cuda_upload(v[i].host, sizeof(float) * (size_t)v[i].n, (void **)v[i].dev, err, err_size);
            m->gpu_bytes += rc == CLOVER_OK ? (int64_t)sizeof(float) * v[i].n : 0;
        }
    }
    if (rc == CLOVER_OK)
        rc = clover_cuda_upload(m->output_norm, sizeof(float) * (size_t)m->hp.n_embd, (void **)&m->output_norm_dev, err,
                                err_size);
    m->gpu_bytes += rc == CLOVER_OK ? (int64_t)sizeof(float) * m->hp.n_embd : 0;
    m->resident = rc == CLOVER_OK;
    m->cpu_experts = 0;
    for (int il = 0; il < m->hp.n_layer; il++) m->cpu_experts += !m->layers[il].gate_exps.dev;
    return rc;
}

/* Bytes make_resident copies: the float32 vectors of every layer and the output norm (0 where
 * it does not run). */
static int64_t resident_bytes(const clover_model *m) {
    if (!resident_wanted(m)) return 0;
    vec_pair v[16];
    int64_t n = m->hp.n_embd;
    for (int il = 0; il < m->hp.n_layer; il++) {
        layer_vectors(&m->hp, &m->layers[il], v);
        for (int i = 0; v[i].host; i++) n += v[i].n;
    }
    return (int64_t)sizeof(float) * n;
}

int64_t clover_context_graph_launches(const clover_context *c) { return c ? c->n_graph_launches : 0; }

int64_t clover_context_full_rows(const clover_context *c) { return c ? c->n_full_rows : 0; }

int64_t clover_context_passes(const clover_context *c) { return c ? c->n_passes : 0; }

/* CUDA graphs record every launch on the backend's one stream, so they run only while the process
 * has a single context that uses the GPU (one counts from its first forward on a model with
 * weights there, model.c forward, until it is freed; contexts on the CPU alone never launch):
 * g_graph_mu is held over a graph's pass (record or replay) and over the count's changes, so no
 * other context's launches or copies can fall into a recording, and no other context's forward
 * can move the scratch a graph holds. */
static pthread_mutex_t g_graph_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_n_gpu_contexts;

int clover_gpu_devices(char *info, size_t info_size) { return clover_cuda_devices(info, info_size); }

int clover_gpu_memory(int64_t *free_bytes, int64_t *total_bytes) { return clover_cuda_mem_info(free_bytes, total_bytes); }

int64_t clover_model_placement_bytes(const clover_model *m, int32_t n_gpu_layers, int32_t n_cpu_moe, int32_t part) {
    if (!m || n_gpu_layers < 0 || n_cpu_moe < 0 || part < 0 || part > 5) return -1;
    const int32_t L = n_gpu_layers < m->hp.n_layer ? n_gpu_layers : m->hp.n_layer;
    clover_tensor *w[24];
    /* total, dense, routed experts, output, routed experts left on the CPU, resident vectors */
    int64_t b[6] = {0, 0, 0, 0, 0, 0};
    for (int il = 0; il < m->hp.n_layer; il++)
        for (int experts = 0; experts < 2; experts++) {
            layer_weights(&m->layers[il], experts, w);
            for (int i = 0; w[i]; i++) {
                const int64_t n = tensor_bytes(w[i]);
                if (il < L && !(experts && il < n_cpu_moe)) b[1 + experts] += n;
                else if (experts && il < L) b[4] += n;
            }
        }
    if (n_gpu_layers > m->hp.n_layer) b[3] = tensor_bytes(&m->output), b[5] = resident_bytes(m);
    b[0] = b[1] + b[2] + b[3] + b[5];
    return b[part];
}

int32_t clover_model_offload(clover_model *m, int32_t n_gpu_layers, int32_t n_cpu_moe, char *err, size_t err_size) {
    if (!m) return clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
    if (n_gpu_layers < 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_gpu_layers: %d must be >= 0", n_gpu_layers);
    if (n_cpu_moe < 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_cpu_moe: %d must be >= 0", n_cpu_moe);
    if (m->n_gpu_layers || m->gpu_bytes)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "n_gpu_layers: the model is already offloaded");
    const int32_t L = n_gpu_layers < m->hp.n_layer ? n_gpu_layers : m->hp.n_layer;
    const int with_output = n_gpu_layers > m->hp.n_layer; /* llama.cpp: n_layer + 1 moves the output too */
    if (L == 0 && !with_output) return 0;
    char info[256];
    if (clover_cuda_devices(info, sizeof info) <= 0)
        return clover_set_err(err, err_size, CLOVER_E_DEVICE, "n_gpu_layers: %d, but no GPU can be used: %s", n_gpu_layers,
                              info);
    const int64_t need = clover_model_placement_bytes(m, n_gpu_layers, n_cpu_moe, 0);
    int64_t free_b = 0, total_b = 0;
    if (clover_cuda_mem_info(&free_b, &total_b) == CLOVER_OK && need > free_b)
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_gpu_layers: %d needs %.2f MiB of weights on the GPU; "
                              "%.2f MiB of %.2f MiB is free (offload fewer layers, keep routed experts on the CPU "
                              "with n_cpu_moe, or let fit choose)", n_gpu_layers, (double)need / (1 << 20),
                              (double)free_b / (1 << 20), (double)total_b / (1 << 20));
    clover_tensor *w[24];
    int rc = CLOVER_OK;
    for (int il = 0; il < L && rc == CLOVER_OK; il++)
        for (int experts = 0; experts < 2 && rc == CLOVER_OK; experts++) {
            if (experts && il < n_cpu_moe) continue; /* --n-cpu-moe: this layer's routed experts stay on the CPU */
            layer_weights(&m->layers[il], experts, w);
            for (int i = 0; w[i] && rc == CLOVER_OK; i++) {
                rc = clover_cuda_upload(w[i]->data, (size_t)tensor_bytes(w[i]), &w[i]->dev, err, err_size);
                if (rc == CLOVER_OK) m->gpu_bytes += tensor_bytes(w[i]);
            }
        }
    if (rc == CLOVER_OK && with_output) {
        rc = clover_cuda_upload(m->output.data, (size_t)tensor_bytes(&m->output), &m->output.dev, err, err_size);
        if (rc == CLOVER_OK) m->gpu_bytes += tensor_bytes(&m->output);
    }
    if (rc == CLOVER_OK && with_output && L == m->hp.n_layer) rc = make_resident(m, err, err_size);
    if (rc != CLOVER_OK) {
        free_gpu(m);
        return rc;
    }
    m->n_gpu_layers = L + with_output;
    return m->n_gpu_layers;
}

int64_t clover_model_gpu_bytes(const clover_model *m) { return m ? m->gpu_bytes : 0; }
int32_t clover_model_gpu_resident(const clover_model *m) { return m ? m->resident : 0; }

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

/* ------------------------------------------------------------------ context */

static int64_t gdn_state_floats(const clover_hparams *hp) {
    return (int64_t)hp->ssm_dt_rank * hp->ssm_d_state * (hp->ssm_d_inner / hp->ssm_dt_rank);
}

/* calloc of a*b*c elements of es bytes with overflow check. */
static void *alloc_elems(int64_t a, int64_t b, int64_t c, size_t es) {
    if (a <= 0 || b <= 0 || c <= 0) return calloc(1, es);
    if (a > INT64_MAX / b || a * b > INT64_MAX / c) return NULL;
    uint64_t n = (uint64_t)(a * b * c);
    if (n > SIZE_MAX / es) return NULL;
    return calloc((size_t)n, es);
}

static float *alloc_floats(int64_t a, int64_t b, int64_t c) { return alloc_elems(a, b, c, sizeof(float)); }

/* Bytes of one KV cache element of type t (CLOVER_TYPE_F16 or F32; 0 for another type). */
static size_t kv_elem_bytes(int32_t t) {
    return t == CLOVER_TYPE_F16 ? 2 : t == CLOVER_TYPE_F32 ? 4 : 0;
}

/* Physical cores (distinct package/core id pairs in Linux sysfs), else the online CPU count:
 * the default thread count, as llama.cpp's (SMT siblings share the load/store units and only
 * add contention to bandwidth-bound products). */
static int32_t physical_cores(void) {
    long online = 1;
#ifdef _SC_NPROCESSORS_ONLN
    online = sysconf(_SC_NPROCESSORS_ONLN);
#endif
    if (online < 1) online = 1;
    if (online > 4096) online = 4096;
    long *ids = malloc(sizeof(long) * (size_t)online);
    int32_t n = 0;
    for (long cpu = 0; ids && cpu < online; cpu++) {
        long core = -1, pkg = 0;
        char path[128];
        FILE *fp;
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/core_id", cpu);
        if ((fp = fopen(path, "r"))) {
            if (fscanf(fp, "%ld", &core) != 1) core = -1;
            fclose(fp);
        }
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%ld/topology/physical_package_id", cpu);
        if ((fp = fopen(path, "r"))) {
            if (fscanf(fp, "%ld", &pkg) != 1) pkg = 0;
            fclose(fp);
        }
        if (core < 0) { /* no topology: count every CPU */
            n = 0;
            break;
        }
        long id = pkg * 65536 + core;
        int seen = 0;
        for (int32_t i = 0; i < n && !seen; i++) seen = ids[i] == id;
        if (!seen) ids[n++] = id;
    }
    free(ids);
    return n > 0 ? n : (int32_t)online;
}

int64_t clover_context_mem_required(const clover_model *m, int32_t n_ctx, int32_t type_k, int32_t type_v) {
    if (!m || n_ctx <= 0 || !kv_elem_bytes(type_k) || !kv_elem_bytes(type_v)) return -1;
    const clover_hparams *hp = &m->hp;
    const int64_t kv = (int64_t)hp->n_head_kv * hp->head_dim; /* <= 2^28 by the loader's limits */
    const int64_t per_layer = (int64_t)hp->n_layer * (int64_t)sizeof(int32_t);
    int64_t cache, gdn, total;
    /* n_attn x n_ctx x kv elements of K and of V, checked: the loader's limits alone allow 2^72 */
    const int64_t host_kv = m->resident ? 0 : m->n_attn; /* the resident forward keeps its KV cache on the GPU */
    if (__builtin_mul_overflow(host_kv * n_ctx, kv, &cache) ||
        __builtin_mul_overflow(cache, (int64_t)(kv_elem_bytes(type_k) + kv_elem_bytes(type_v)), &cache) ||
        __builtin_mul_overflow((int64_t)m->n_gdn, gdn_state_floats(hp) + (hp->ssm_d_conv - 1) * conv_channels(hp), &gdn) ||
        __builtin_mul_overflow(gdn, (int64_t)sizeof(float), &gdn) || __builtin_add_overflow(cache, gdn, &total) ||
        __builtin_add_overflow(total, per_layer, &total))
        return INT64_MAX;
    return total;
}

/* Bytes the kernel reports as available (MemAvailable in /proc/meminfo), else physical memory;
 * -1 when neither is known. */
static int64_t available_memory(void) {
    FILE *fp = fopen("/proc/meminfo", "r");
    if (fp) {
        char line[256];
        long long kb;
        while (fgets(line, sizeof line, fp))
            if (sscanf(line, "MemAvailable: %lld kB", &kb) == 1) {
                fclose(fp);
                return (int64_t)kb * 1024;
            }
        fclose(fp);
    }
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
    long pages = sysconf(_SC_PHYS_PAGES), psize = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psize > 0) return (int64_t)pages * psize;
#endif
    return -1;
}

static int gpu_state_reserve(clover_context *c, char *err, size_t err_size);

clover_context *clover_context_new(clover_model *m, int32_t n_ctx, int32_t n_threads, int32_t type_k,
                                   int32_t type_v, char *err, size_t err_size) {
    if (!m) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
        return NULL;
    }
    if (n_ctx <= 0) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "n_ctx: %d must be > 0", n_ctx);
        return NULL;
    }
    const int32_t types[2] = {type_k, type_v};
    for (int i = 0; i < 2; i++)
        if (!kv_elem_bytes(types[i])) {
            clover_set_err(err, err_size, CLOVER_E_ARG, "%s: cache type %d is not supported (F16 = %d or F32 = %d)",
                           i ? "type_v" : "type_k", types[i], CLOVER_TYPE_F16, CLOVER_TYPE_F32);
            return NULL;
        }
    const int64_t need = clover_context_mem_required(m, n_ctx, type_k, type_v), avail = available_memory();
    if (avail > 0 && need > avail) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_ctx: %d needs %.2f GiB for the KV cache and GDN state, "
                       "but only %.2f GiB of memory is available: use a smaller n_ctx", n_ctx,
                       (double)need / (1 << 30), (double)avail / (1 << 30));
        return NULL;
    }
    if (n_threads <= 0) n_threads = physical_cores();
    clover_context *c = calloc(1, sizeof *c);
    if (!c) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        return NULL;
    }
    const clover_hparams *hp = &m->hp;
    c->m = m;
    c->n_ctx = n_ctx;
    c->n_threads = n_threads;
    c->gdn_chunked = 1;
    const char *graphs = getenv("CLOVER_CUDA_GRAPHS");
    c->graphs = !(graphs && strcmp(graphs, "0") == 0);
    atomic_init(&c->abort_req, 0);
    int64_t kv = (int64_t)hp->n_head_kv * hp->head_dim;
    /* a resident model's forwards use the device KV cache only (res_attention) */
    c->type_k = type_k, c->type_v = type_v;
    c->k_cache = alloc_elems(m->resident ? 0 : m->n_attn, n_ctx, kv, kv_elem_bytes(type_k));
    c->v_cache = alloc_elems(m->resident ? 0 : m->n_attn, n_ctx, kv, kv_elem_bytes(type_v));
    c->kv_host = !m->resident;
    c->gdn_state = alloc_floats(m->n_gdn, gdn_state_floats(hp), 1);
    c->conv_state = alloc_floats(m->n_gdn, hp->ssm_d_conv - 1, conv_channels(hp));
    c->nexp_full = calloc((size_t)hp->n_layer, sizeof(int32_t));
    if (!c->k_cache || !c->v_cache || !c->gdn_state || !c->conv_state || !c->nexp_full) {
        clover_context_free(c);
        clover_set_err(err, err_size, CLOVER_E_NOMEM,
                       "n_ctx: %d needs a KV cache of %lld values per layer, allocation failed", n_ctx,
                       (long long)(2 * kv * (int64_t)n_ctx));
        return NULL;
    }
    char why[256] = "";
    const int rc = m->gpu_bytes ? gpu_state_reserve(c, why, sizeof why) : CLOVER_OK;
    if (rc != CLOVER_OK) {
        clover_context_free(c);
        clover_set_err(err, err_size, rc, "n_ctx: %d: the KV cache and GDN state on the GPU: %s", n_ctx, why);
        return NULL;
    }
    return c;
}

/* Free the routed experts' host staging (page-locked or plain, moe_host_pinned). */
static void moe_host_release(clover_context *c) {
    if (c->moe_host_pinned) clover_cuda_host_free(c->moe_host);
    else free(c->moe_host);
    c->moe_host = NULL, c->moe_host_cap = 0;
}

void clover_context_free(clover_context *c) {
    if (!c) return;
    if (c->gpu_counted) { /* the last one gives the backend's shared scratch back */
        pthread_mutex_lock(&g_graph_mu);
        if (--g_n_gpu_contexts == 0) clover_cuda_release_scratch();
        pthread_mutex_unlock(&g_graph_mu);
    }
    for (size_t i = 0; i < sizeof c->graph / sizeof c->graph[0]; i++) clover_cuda_graph_free(c->graph[i].exec);
    free(c->k_cache);
    free(c->v_cache);
    free(c->gdn_state);
    free(c->conv_state);
    free(c->snap_state), free(c->snap_conv);
    free(c->keep_state), free(c->keep_conv);
    free(c->rec_qkv), free(c->rec_cv), free(c->rec_b), free(c->rec_a);
    free(c->nexp_full);
    clover_cuda_free(c->k_dev), clover_cuda_free(c->v_dev);
    free(c->kv_dev_rows);
    clover_cuda_free(c->gdn_dev), clover_cuda_free(c->gdn_snap_dev);
    free(c->gdn_on_dev), free(c->snap_on_dev);
    clover_cuda_free(c->res_ws), clover_cuda_free(c->conv_dev), clover_cuda_free(c->conv_snap_dev);
    clover_cuda_free(c->rec_dev), clover_cuda_free(c->ops_dev), clover_cuda_free(c->pre_dev);
    moe_host_release(c);
    free(c);
}

int32_t clover_context_n_past(const clover_context *c) { return c ? c->n_past : 0; }
int32_t clover_context_n_ctx(const clover_context *c) { return c ? c->n_ctx : 0; }
void clover_context_abort(clover_context *c) {
    if (c) atomic_store(&c->abort_req, 1);
}

void clover_context_set_gdn_chunked(clover_context *c, int chunked) {
    if (c) c->gdn_chunked = chunked != 0;
}

void clover_context_reset(clover_context *c) {
    if (!c) return;
    const clover_hparams *hp = &c->m->hp;
    atomic_store(&c->abort_req, 0);
    c->n_past = 0;
    c->keep_n = 0; /* the KV rows below a saved state are about to be overwritten */
    c->rec_on = 0;
    c->rec_n = 0;
    memset(c->gdn_state, 0, sizeof(float) * (size_t)(c->m->n_gdn * gdn_state_floats(hp)));
    if (c->gdn_on_dev) memset(c->gdn_on_dev, 0, (size_t)c->m->n_gdn); /* the host copy is current */
    memset(c->conv_state, 0,
           sizeof(float) * (size_t)(c->m->n_gdn * (hp->ssm_d_conv - 1) * conv_channels(hp)));
}

/* ------------------------------------------------------------------ small kernels */

static float silu(float x) { return x / (1.0f + expf(-x)); }
static float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y = x * rsqrt(mean(x^2) + eps) * w; w already holds 1 + w_hf for N1p norms (spec 2, 4.3). */
static void rmsnorm(float *y, const float *x, const float *w, int64_t n, float eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = 1.0f / sqrtf((float)(ss / n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = x[i] * s * w[i];
}

/* x * rsqrt(sum(x^2) + eps), the l2norm of spec 2.1 step 3 (as transformers' l2norm). */
static void l2norm(float *x, int64_t n, float eps) {
    double ss = 0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float s = 1.0f / sqrtf((float)ss + eps);
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

/* y = W x for T rows, on the GPU when W was offloaded (clover_model_offload; its error message
 * into err, when given), else on the CPU with n_threads. CLOVER_OK, or the failure's code
 * (CLOVER_E_NOMEM on the CPU). */
static int wmatmul(const clover_tensor *w, const float *x, int64_t T, float *y, int n_threads, char *err,
                   size_t err_size) {
    if (w->dev) return clover_cuda_matmul(w->type, w->dev, w->ne[0], w->ne[1], x, T, y, err, err_size);
    return clover_matmul(w->type, w->data, w->ne[0], w->ne[1], x, T, y, n_threads) ? CLOVER_E_NOMEM : CLOVER_OK;
}

/* Expert e of a 3-D expert tensor as a 2-D view. */
static clover_tensor expert_view(const clover_tensor *w, int64_t e) {
    clover_tensor v = *w;
    int64_t row = clover_row_nbytes(w->type, w->ne[0]);
    v.data = (const char *)w->data + (size_t)(e * w->ne[1] * row);
    if (w->dev) v.dev = (char *)w->dev + (size_t)(e * w->ne[1] * row);
    v.ne[2] = 1;
    return v;
}

/* ------------------------------------------------------------------ forward state */

enum { MODE_PREFIX = 0, MODE_BLOCK = 1 };

typedef struct {
    clover_context *c;
    int mode;
    int64_t T;         /* rows */
    int64_t pos0;      /* position of row 0 */
    float coreset_top_p;
    int32_t *n_experts_out;
    char *err;
    size_t err_size;
    const struct select_req *sreq; /* clover_block_forward_select's request, else NULL */
    int gpu_rc;                     /* the code of a failed GPU product (matmul), else 0 */
} fwd;

/* wmatmul with the context's threads: 0, or non-zero when it failed; a product on the GPU that
 * fails leaves its code in f->gpu_rc and the CUDA error in f->err, which cpu_forward reports
 * instead of its generic out-of-memory code and message. */
static int matmul(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y) {
    const int rc = wmatmul(w, x, T, y, f->c->n_threads, f->err, f->err_size);
    if (rc != CLOVER_OK && w->dev) f->gpu_rc = rc;
    return rc;
}

/* clover_block_forward_select's edits and outputs (see there). */
typedef struct select_req {
    const clover_logit_op *ops;
    const int32_t *ops_start;
    const clover_sampler_params *sp;
    int32_t k;
    int32_t *id;
    float *conf;
    clover_cand *cand;
    float *pre;
    double *total;       /* top-p alone: row t's weight at total[t] (0: its logits went to full) */
    float *full;         /* row t's edited logits at full + (t - full_row0) V, when total[t] is 0 */
    int64_t full_row0;
} select_req;

/* ------------------------------------------------------------------ gated attention (spec 2.2) */

static void rope_neox(float *v, int64_t pos, int rd, float theta) {
    int half = rd / 2;
    for (int i = 0; i < half; i++) {
        double freq = pow((double)theta, -2.0 * i / rd);
        double ang = (double)pos * freq;
        float cs = (float)cos(ang), sn = (float)sin(ang);
        float a = v[i], b = v[i + half];
        v[i] = a * cs - b * sn;
        v[i + half] = b * cs + a * sn;
    }
}

/* Subnormal floats (below 2^-126 in magnitude) read and written as zero by the calling thread
 * from here to flush_subnormals_end(previous state) (x86: MXCSR's DAZ and FTZ bits; elsewhere
 * nothing), in the GDN's and attention's parallel regions. The GDN's decays exp(G) drive chunk
 * products and states into that range (attention's weights of far keys can fall there too), and
 * an x86 multiply or add with a subnormal operand or result takes a microcode assist: dot.h's
 * AVX2 gemm ran at 0.14 GMAC/s on subnormal inputs against 23 on normal ones on the development
 * machine, and a real-dims GDN layer's 512-row prefill took 100 ms with them, 52 ms without. */
static unsigned flush_subnormals_begin(void) {
#if defined(__x86_64__) || defined(__i386__)
    const unsigned prev = _mm_getcsr();
    _mm_setcsr(prev | 0x8040u); /* FTZ (bit 15), DAZ (bit 6) */
    return prev;
#else
    return 0;
#endif
}

static void flush_subnormals_end(unsigned prev) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_setcsr(prev);
#else
    (void)prev;
#endif
}

/* A layer's KV cache as attend_tile reads it: K and V rows kvd elements apart, each fp16 (dot_k,
 * axpy_v: the F16 kernels of dot.h; NULL for float32) or float32 (dot_k32, axpy_v32); where the
 * CPU has them, the several-key forms of the cache's types, equal to those bit for bit. */
typedef struct {
    const char *k, *v;
    int64_t kvd;
    clover_dot_f16_fn dot_k;
    clover_axpy_f16_fn axpy_v;
    clover_dot_f32_fn dot_k32;
    clover_axpy_f32_fn axpy_v32;
    clover_dot_f32x4_fn dot_k32x4;         /* float32 K: 4 keys a call, or NULL */
    clover_axpy_f32_rows_fn axpy_v32_rows; /* float32 V: a run of rows a call, or NULL */
    clover_dot_f16x4_fn dot_k16x4;         /* fp16 K: 4 keys a call, or NULL */
    clover_axpy_f16_rows_fn axpy_v16_rows; /* fp16 V: a run of rows a call, or NULL */
} kv_view;

/* out[i] = q . k_{j+i} * scale for i < 4 (K rows j.. of the cache at offset off; hd values), by
 * the several-key kernel of the cache's K type (kv->dot_k32x4 or kv->dot_k16x4, one of them set). */
static void dot_keys4(const kv_view *kv, const float *q, int64_t j, int64_t off, int64_t hd, float scale, float *out) {
    float s4[4];
    if (kv->dot_k16x4) kv->dot_k16x4(q, (const uint16_t *)kv->k + j * kv->kvd + off, kv->kvd, hd, s4);
    else kv->dot_k32x4(q, (const float *)kv->k + j * kv->kvd + off, kv->kvd, hd, s4);
    for (int i = 0; i < 4; i++) out[i] = s4[i] * scale;
}

/* o += p[i] v_{j0+i} for i < n (V rows j0.. at offset off; hd values), by the several-row kernel of
 * the cache's V type (kv->axpy_v32_rows or kv->axpy_v16_rows, one of them set). */
static void axpy_rows(const kv_view *kv, float *o, const float *p, int64_t j0, int64_t n, int64_t off, int64_t hd) {
    if (kv->axpy_v16_rows) kv->axpy_v16_rows(o, p, (const uint16_t *)kv->v + j0 * kv->kvd + off, kv->kvd, n, hd);
    else kv->axpy_v32_rows(o, p, (const float *)kv->v + j0 * kv->kvd + off, kv->kvd, n, hd);
}

/* ATT_KEY_TILE keys a step (64 KiB of float32 K rows at head_dim 256: L2-resident); tiles of up
 * to ATT_ROWS query rows; ATT_SCRATCH: a thread's score scratch, in floats (8 MiB). */
enum { ATT_KEY_TILE = 64, ATT_ROWS = 16, ATT_SCRATCH = 2 << 20 };
/* One layer's attention call, as attend_tile reads it: off is the KV head's offset in a cache row. */
typedef struct {
    const float *qg;
    float *att;
    int64_t nh, hd, off, pos0, n_keys_max;
    int causal;
    float scale;
} att_job;

/* Keys of query row t: [0, pos0 + t + 1) when causal (prefix mode), else [0, n_keys_max). */
static inline int64_t row_keys(const att_job *a, int64_t t) { return a->causal ? a->pos0 + t + 1 : a->n_keys_max; }

/* The end of key tile [j0, j0 + ATT_KEY_TILE) for a row with nk keys (j0 when it has none there). */
static inline int64_t tile_end(int64_t j0, int64_t nk) {
    return nk < j0 ? j0 : nk < j0 + ATT_KEY_TILE ? nk : j0 + ATT_KEY_TILE;
}

/* Attention (spec 2.2 steps 3-4) of query rows [t0, t0 + nt) and heads [h0, h0 + nhc) of one
 * GQA group (every head reads the same KV head, at offset off in the cache rows): per (row,
 * head) pair, softmax(q K^T * scale) V over the row's keys, times sigmoid of the head's output
 * gate (stored right after q in qg [T][n_head][2 hd]); out: att [T][n_head][hd]. Row t's keys:
 * [0, pos0 + t + 1) when causal (prefix mode), else [0, n_keys_max) (block mode: pos0 + T).
 * Each pair's arithmetic is fixed whatever the tile: scores in key order, their max, exp and a
 * double sum in key order, then o += p_j v_j in key order, so a row's output does not depend
 * on which rows or heads share its tile (spec mode's verify equals ar's decode bit for bit).
 * The loops over keys run outside those over pairs, ATT_KEY_TILE keys at a time, so each K and
 * V row is read from memory once per tile rather than once per pair (a long prompt's keys do
 * not fit the caches). sc: nt nhc n_keys_max floats; sum: nt nhc doubles. */
CLOVER_CLONES static void attend_tile(const att_job *a, const kv_view *kv, int64_t t0, int64_t nt, int64_t h0,
                                      int64_t nhc, float *sc, double *sum) {
    const int64_t hd = a->hd, nv = nt * nhc, ld = a->n_keys_max;
    const size_t ek = kv->dot_k ? 2 : 4, ev = kv->axpy_v ? 2 : 4;
    const int64_t last = row_keys(a, t0 + nt - 1); /* keys of the tile's last row */
    for (int64_t j0 = 0; j0 < last; j0 += ATT_KEY_TILE)
        for (int64_t u = 0; u < nv; u++) {
            const int64_t t = t0 + u / nhc, h = h0 + u % nhc, je = tile_end(j0, row_keys(a, t));
            const float *q = a->qg + (t * a->nh + h) * 2 * hd;
            int64_t j = j0;
            for (; (kv->dot_k32x4 || kv->dot_k16x4) && j + 4 <= je; j += 4)
                dot_keys4(kv, q, j, a->off, hd, a->scale, sc + u * ld + j);
            for (; j < je; j++) {
                const void *kj = kv->k + ek * (size_t)(j * kv->kvd + a->off);
                sc[u * ld + j] = (kv->dot_k ? kv->dot_k(q, kj, hd) : kv->dot_k32(q, kj, hd)) * a->scale;
            }
        }
    for (int64_t u = 0; u < nv; u++) {
        const int64_t t = t0 + u / nhc, nk = row_keys(a, t);
        float *s = sc + u * ld, mx = -FLT_MAX;
        for (int64_t j = 0; j < nk; j++)
            if (s[j] > mx) mx = s[j];
        double z = 0;
        for (int64_t j = 0; j < nk; j++) {
            s[j] = expf(s[j] - mx);
            z += s[j];
        }
        sum[u] = z;
        memset(a->att + (t * a->nh + h0 + u % nhc) * hd, 0, sizeof(float) * (size_t)hd);
    }
    for (int64_t j0 = 0; j0 < last; j0 += ATT_KEY_TILE)
        for (int64_t u = 0; u < nv; u++) {
            const int64_t t = t0 + u / nhc, h = h0 + u % nhc, je = tile_end(j0, row_keys(a, t));
            float *o = a->att + (t * a->nh + h) * hd, *p = sc + u * ld;
            if ((kv->axpy_v32_rows || kv->axpy_v16_rows) && je > j0) { /* the weights in place, one call */
                for (int64_t j = j0; j < je; j++) p[j] = (float)(p[j] / sum[u]);
                axpy_rows(kv, o, p + j0, j0, je - j0, a->off, hd);
                continue;
            }
            for (int64_t j = j0; j < je; j++) {
                const void *vj = kv->v + ev * (size_t)(j * kv->kvd + a->off);
                const float pj = (float)(p[j] / sum[u]);
                if (kv->axpy_v) kv->axpy_v(o, pj, vj, hd);
                else kv->axpy_v32(o, pj, vj, hd);
            }
        }
    for (int64_t u = 0; u < nv; u++) {
        const int64_t t = t0 + u / nhc, h = h0 + u % nhc;
        const float *gate = a->qg + (t * a->nh + h) * 2 * hd + hd;
        float *o = a->att + (t * a->nh + h) * hd;
        for (int64_t d = 0; d < hd; d++) o[d] *= sigmoidf_(gate[d]);
    }
}

/* Element-type bits of the context's KV cache for the CUDA backend (CLOVER_KV_*_F16). */
static int kv_f16_bits(const clover_context *c) {
    return (c->type_k == CLOVER_TYPE_F16 ? CLOVER_KV_K_F16 : 0) | (c->type_v == CLOVER_TYPE_F16 ? CLOVER_KV_V_F16 : 0);
}

/* Offloaded attention layers (their output projection on the GPU) among the first n_slots
 * attention layers: the device KV cache holds one layer's rows per offloaded layer, in order. */
static int64_t offloaded_attn(const clover_model *m, int n_slots) {
    int64_t n = 0;
    for (int il = 0; il < m->hp.n_layer; il++) {
        const clover_layer *ly = &m->layers[il];
        n += ly->is_attn && ly->slot < n_slots && ly->wo.dev != NULL;
    }
    return n;
}

/* The context's device KV cache (the offloaded attention layers only), allocated at the first
 * use. */
static int kv_dev_alloc(clover_context *c, char *err, size_t err_size) {
    if (c->kv_dev_rows) return CLOVER_OK;
    size_t n, kb, vb; /* elements and bytes of each cache, checked (extreme but loadable shapes wrap) */
    if (__builtin_mul_overflow((size_t)c->n_ctx * (size_t)c->m->hp.n_head_kv, (size_t)c->m->hp.head_dim, &n) ||
        __builtin_mul_overflow(n, (size_t)offloaded_attn(c->m, c->m->n_attn), &n) ||
        __builtin_mul_overflow(n, kv_elem_bytes(c->type_k), &kb) || __builtin_mul_overflow(n, kv_elem_bytes(c->type_v), &vb))
        return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_ctx: %d: the GPU's KV cache size overflows", c->n_ctx);
    int rc = clover_cuda_alloc(kb, &c->k_dev, err, err_size);
    if (rc == CLOVER_OK) rc = clover_cuda_alloc(vb, &c->v_dev, err, err_size);
    if (rc == CLOVER_OK && !(c->kv_dev_rows = calloc((size_t)c->m->n_attn, sizeof(int64_t))))
        rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    if (rc != CLOVER_OK) {
        clover_cuda_free(c->k_dev), clover_cuda_free(c->v_dev);
        c->k_dev = c->v_dev = NULL;
    }
    return rc;
}

/* Bring rows [kv_dev_rows[slot], pos) of attention layer slot's device KV cache up to date with
 * the host cache (rows a CPU forward wrote since). */
static int kv_dev_catch_up(clover_context *c, int slot, int64_t pos, char *err, size_t err_size) {
    const int64_t have = c->kv_dev_rows[slot];
    if (have >= pos) return CLOVER_OK;
    const size_t row = (size_t)c->m->hp.n_head_kv * (size_t)c->m->hp.head_dim, layer = row * (size_t)c->n_ctx;
    const size_t host = layer * (size_t)slot, dev = layer * (size_t)offloaded_attn(c->m, slot);
    const size_t off = row * (size_t)have, n = row * (size_t)(pos - have);
    const size_t ek = kv_elem_bytes(c->type_k), ev = kv_elem_bytes(c->type_v);
    int rc = clover_cuda_write(c->k_dev, ek * (dev + off), (const char *)c->k_cache + ek * (host + off), ek * n, err,
                               err_size);
    if (rc == CLOVER_OK)
        rc = clover_cuda_write(c->v_dev, ev * (dev + off), (const char *)c->v_cache + ev * (host + off), ev * n, err,
                               err_size);
    return rc;
}

/* Attention of an offloaded layer on the GPU (clover_cuda_attention): the context's device KV
 * cache (the offloaded layers only) is allocated at the first call and brought up to date with
 * the host cache, which attention_layer wrote the new rows to (rows a CPU forward wrote since
 * and this forward's); qg as attention_layer made it. */
static int gpu_attention(fwd *f, const clover_layer *ly, const float *qg, float scale, float *att) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const size_t layer = (size_t)c->n_ctx * (size_t)hp->n_head_kv * (size_t)hp->head_dim;
    int rc = kv_dev_alloc(c, f->err, f->err_size);
    if (rc != CLOVER_OK) return rc;
    const size_t dev = layer * (size_t)offloaded_attn(c->m, ly->slot);
    const int64_t have = c->kv_dev_rows[ly->slot];
    if (have > f->pos0) c->kv_dev_rows[ly->slot] = f->pos0; /* rows from pos0 on are new */
    if ((rc = kv_dev_catch_up(c, ly->slot, f->pos0 + f->T, f->err, f->err_size)) == CLOVER_OK)
        rc = clover_cuda_attention(qg, (char *)c->k_dev + dev * kv_elem_bytes(c->type_k),
                                   (char *)c->v_dev + dev * kv_elem_bytes(c->type_v), kv_f16_bits(c), c->n_ctx, f->pos0,
                                   f->T, hp->n_head, hp->n_head_kv, hp->head_dim, f->mode == MODE_PREFIX, scale, att,
                                   f->err, f->err_size);
    c->kv_dev_rows[ly->slot] = rc == CLOVER_OK ? f->pos0 + f->T : (have < f->pos0 ? have : f->pos0);
    return rc;
}

/* The largest divisor of n (> 0) that is at most cap, and at least 1. */
static int64_t divisor_at_most(int64_t n, int64_t cap) {
    for (int64_t d = cap < n ? cap : n; d > 1; d--)
        if (n % d == 0) return d;
    return 1;
}

static int attention_layer(fwd *f, const clover_layer *ly, const float *xn, float *out) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, nh = hp->n_head, nkv = hp->n_head_kv, hd = hp->head_dim;
    const int64_t kvd = nkv * hd, group = nh / nkv;
    float *qg = malloc(sizeof(float) * (size_t)(T * nh * 2 * hd));
    float *k = malloc(sizeof(float) * (size_t)(T * kvd));
    float *v = malloc(sizeof(float) * (size_t)(T * kvd));
    float *att = malloc(sizeof(float) * (size_t)(T * nh * hd));
    int rc = CLOVER_E_NOMEM;
    if (!qg || !k || !v || !att) goto done;
    if (matmul(f, &ly->wq, xn, T, qg) || matmul(f, &ly->wk, xn, T, k) || matmul(f, &ly->wv, xn, T, v)) goto done;
    const size_t ek = kv_elem_bytes(c->type_k), ev = kv_elem_bytes(c->type_v);
    char *kc = (char *)c->k_cache + ek * (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd;
    char *vc = (char *)c->v_cache + ev * (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd;
    for (int64_t t = 0; t < T; t++) {
        int64_t pos = f->pos0 + t;
        for (int64_t h = 0; h < nh; h++) {
            float *q = qg + (t * nh + h) * 2 * hd;
            rmsnorm(q, q, ly->q_norm, hd, hp->rms_eps);
            rope_neox(q, pos, hp->rope_dim, hp->rope_theta);
        }
        for (int64_t h = 0; h < nkv; h++) {
            float *kh = k + t * kvd + h * hd;
            rmsnorm(kh, kh, ly->k_norm, hd, hp->rms_eps);
            rope_neox(kh, pos, hp->rope_dim, hp->rope_theta);
        }
        /* Block mode writes the block's K/V past n_past only as scratch: n_past does not move,
         * so the cache is unchanged for every later call (spec 3.2). */
        clover_from_f32(c->type_k, k + t * kvd, kc + ek * (size_t)(pos * kvd), kvd); /* F16: nearest even */
        clover_from_f32(c->type_v, v + t * kvd, vc + ev * (size_t)(pos * kvd), kvd);
    }
    const float scale = 1.0f / sqrtf((float)hd);
    if (ly->wo.dev && hd % 32 == 0 && hd <= 256 && nh <= 65535 && nh % nkv == 0) { /* on the GPU: attention too */
        rc = gpu_attention(f, ly, qg, scale, att);
        if (rc == CLOVER_OK) rc = matmul(f, &ly->wo, att, T, out) ? CLOVER_E_NOMEM : CLOVER_OK;
        goto done;
    }
    if (c->kv_dev_rows && c->kv_dev_rows[ly->slot] > f->pos0) c->kv_dev_rows[ly->slot] = f->pos0; /* stale there */
    const int64_t n_keys_max = f->pos0 + T;
    const kv_view kv = {kc, vc, kvd, c->type_k == CLOVER_TYPE_F16 ? clover_dot_f16_kernel(-1) : NULL,
                        c->type_v == CLOVER_TYPE_F16 ? clover_axpy_f16_kernel(-1) : NULL, clover_dot_f32_kernel(-1),
                        clover_axpy_f32_kernel(-1), c->type_k == CLOVER_TYPE_F16 ? NULL : clover_dot_f32x4_kernel(),
                        c->type_v == CLOVER_TYPE_F16 ? NULL : clover_axpy_f32_rows_kernel(),
                        c->type_k == CLOVER_TYPE_F16 ? clover_dot_f16x4_kernel() : NULL,
                        c->type_v == CLOVER_TYPE_F16 ? clover_axpy_f16_rows_kernel() : NULL};
    const att_job job = {qg, att, nh, hd, 0, f->pos0, n_keys_max, f->mode == MODE_PREFIX, scale};
    /* work items: (KV head, tile of R rows, chunk of hc of its group's heads, hc dividing the
     * group); the tiles' score scratch within ATT_SCRATCH floats a thread where it can, and
     * enough items for the threads */
    const int64_t budget = ATT_SCRATCH, want = c->n_threads > 1 ? 4 * (int64_t)c->n_threads : 1;
    int64_t R = T < ATT_ROWS ? T : ATT_ROWS, hc = divisor_at_most(group, budget / n_keys_max);
    while (R > 1 && R * hc * n_keys_max > budget) R = (R + 1) / 2;
    while (R > 1 && nkv * ((T + R - 1) / R) * (group / hc) < want) R = (R + 1) / 2;
    const int64_t fed = group * nkv * T / want; /* the largest chunk giving want items at R = 1 */
    if (nkv * T * (group / hc) < want) hc = divisor_at_most(group, hc < fed ? hc : fed);
    const int64_t n_tiles = (T + R - 1) / R, n_chunks = group / hc, n_items = nkv * n_tiles * n_chunks;
    int nomem = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(c->n_threads) if (c->n_threads > 1 && T * nh * n_keys_max * hd >= 65536)
#endif
    {
        const unsigned csr = flush_subnormals_begin(); /* weights exp(s - max) of far keys: subnormal */
        float *sc = malloc(sizeof(float) * (size_t)(R * hc * n_keys_max));
        double *sum = malloc(sizeof(double) * (size_t)(R * hc));
        if (!sc || !sum) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            nomem = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t it = 0; it < n_items; it++) { /* the last rows (most keys) first */
            if (!sc || !sum) continue;
            const int64_t r = n_tiles - 1 - it / (nkv * n_chunks), g = it / n_chunks % nkv, ch = it % n_chunks;
            const int64_t t0 = r * R, nt = T - t0 < R ? T - t0 : R;
            att_job a = job;
            a.off = g * hd;
            attend_tile(&a, &kv, t0, nt, g * group + ch * hc, hc, sc, sum);
        }
        free(sc), free(sum);
        flush_subnormals_end(csr);
    }
    if (nomem) goto done;
    rc = matmul(f, &ly->wo, att, T, out) ? CLOVER_E_NOMEM : CLOVER_OK;
done:
    free(qg), free(k), free(v), free(att);
    return rc;
}

/* ------------------------------------------------------------------ Gated DeltaNet (spec 2.1, 3.3) */

typedef struct {
    int64_t Hk, Hv, dk, dv, C, K; /* K = conv kernel */
} gdn_dims;

static gdn_dims gdn_dims_of(const clover_hparams *hp) {
    gdn_dims d;
    d.Hk = hp->ssm_n_group;
    d.Hv = hp->ssm_dt_rank;
    d.dk = hp->ssm_d_state;
    d.dv = hp->ssm_d_inner / hp->ssm_dt_rank;
    d.C = conv_channels(hp);
    d.K = hp->ssm_d_conv;
    return d;
}

/* Depthwise conv + SiLU over T rows (spec 2.1 step 2, 3.3 step 1). hist: the K-1 previous
 * inputs [K-1][C], oldest first; w[ch*K + j], j = K-1 multiplies the current row. With right taps
 * wr (block mode, else NULL): plus wr[ch*(K-1) + d-1] times row t + d for d = 1..K-1, zero past
 * the last row [assumed]. */
static void conv_silu(const gdn_dims *d, const float *w, const float *wr, const float *hist, const float *in,
                      int64_t T, float *out) {
    const int64_t K = d->K, C = d->C;
    for (int64_t t = 0; t < T; t++) {
        for (int64_t ch = 0; ch < C; ch++) {
            float s = 0;
            for (int64_t j = 0; j < K; j++) {
                int64_t src = t - (K - 1) + j; /* input index */
                float x = src >= 0 ? in[src * C + ch] : hist[(K - 1 + src) * C + ch];
                s += w[ch * K + j] * x;
            }
            for (int64_t j = 1; wr && j < K && t + j < T; j++) s += wr[ch * (K - 1) + j - 1] * in[(t + j) * C + ch];
            out[t * C + ch] = silu(s);
        }
    }
}

/* After the conv: L2-normalise q and k per head, scale q by 1/sqrt(dk) (spec 2.1 step 3). */
static void qk_norm(const gdn_dims *d, float *conv, int64_t T, float eps) {
    const float qs = 1.0f / sqrtf((float)d->dk);
    for (int64_t t = 0; t < T; t++) {
        float *row = conv + t * d->C;
        for (int64_t h = 0; h < d->Hk; h++) {
            float *q = row + h * d->dk, *k = row + d->Hk * d->dk + h * d->dk;
            l2norm(q, d->dk, eps);
            l2norm(k, d->dk, eps);
            for (int64_t i = 0; i < d->dk; i++) q[i] *= qs;
        }
    }
}

/* beta = sigmoid(b), g = ssm_a * softplus(a + dt_bias) with ssm_a = -exp(A_log) (spec 2.1 step 4).
 * b, a: [T, Hv] in place -> beta, g. */
static void gates(const gdn_dims *d, float *b, float *a, const float *ssm_a, const float *dt_bias, int64_t T) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d->Hv; h++) {
            b[t * d->Hv + h] = sigmoidf_(b[t * d->Hv + h]);
            a[t * d->Hv + h] = ssm_a[h] * softplus(a[t * d->Hv + h] + dt_bias[h]);
        }
}

/* One delta-rule step for one head (spec 2.1 step 6), S [dk][dv]:
 * S <- exp(g) S; S <- S + k (beta (v - S^T k))^T. tmp: dv floats. */
CLOVER_INLINE void delta_step(float *S, const float *k, const float *v, float g, float beta, int64_t dk,
                              int64_t dv, float *tmp) {
    const float eg = expf(g);
    for (int64_t j = 0; j < dv; j++) tmp[j] = 0;
    for (int64_t i = 0; i < dk; i++) /* decay and S^T k in one pass over S */
        for (int64_t j = 0; j < dv; j++) {
            const float s = S[i * dv + j] * eg;
            S[i * dv + j] = s;
            tmp[j] += s * k[i];
        }
    for (int64_t j = 0; j < dv; j++) tmp[j] = (v[j] - tmp[j]) * beta;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) S[i * dv + j] += k[i] * tmp[j];
}

/* o = S^T q for one head. */
CLOVER_INLINE void readout(const float *S, const float *q, int64_t dk, int64_t dv, float *o) {
    for (int64_t j = 0; j < dv; j++) o[j] = 0;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < dv; j++) o[j] += S[i * dv + j] * q[i];
}

/* Pointers to q, k, v of value head h at row t of the conv output. Value head h reads key
 * head h % Hk (tiled order, spec 4.3). */
#define GDN_Q(d, conv, t, h) ((conv) + (t) * (d)->C + ((h) % (d)->Hk) * (d)->dk)
#define GDN_K(d, conv, t, h) ((conv) + (t) * (d)->C + (d)->Hk * (d)->dk + ((h) % (d)->Hk) * (d)->dk)
#define GDN_V(d, conv, t, h) ((conv) + (t) * (d)->C + 2 * (d)->Hk * (d)->dk + (h) * (d)->dv)

/* Token-by-token recurrence of value head h over T rows, forward in time, from state S
 * [dk][dv]; o: [T, Hv*dv]. tmp: dv floats. */
CLOVER_CLONES static void gdn_recurrent_head(const gdn_dims *d, const float *conv, const float *beta, const float *g, int64_t T,
                               int64_t h, float *S, float *o, float *tmp) {
    for (int64_t t = 0; t < T; t++) {
        delta_step(S, GDN_K(d, conv, t, h), GDN_V(d, conv, t, h), g[t * d->Hv + h], beta[t * d->Hv + h], d->dk,
                   d->dv, tmp);
        readout(S, GDN_Q(d, conv, t, h), d->dk, d->dv, o + (t * d->Hv + h) * d->dv);
    }
}

/* Chunked form of the same recurrence (chunk 64), the WY / UT-transform algorithm used by
 * transformers' torch_chunk_gated_delta_rule (after fla's chunk_gated_delta_rule). Per chunk of
 * L rows with in-chunk cumulative decay G_i = sum_{m<=i} g_m:
 *   A = -(diag(beta) K K^T * exp(G_i - G_j)) strictly lower; forward-substitute A <- (I - A)^-1
 *   U = A diag(beta) V;  W = A diag(beta exp(G)) K
 *   V' = U - W S;  O = diag(exp(G)) Q S + (Q K^T * exp(G_i - G_j), j <= i) V'
 *   S <- exp(G_L) S + (K * exp(G_L - G))^T V'
 * It equals gdn_recurrent_head up to rounding (tested). scratch: gdn_scratch_floats(). */
#define GDN_CHUNK 64
CLOVER_CLONES static void gdn_chunked_head(const gdn_dims *d, const float *conv, const float *beta, const float *g, int64_t T,
                             int64_t h, float *S, float *o, float *scratch) {
    const int64_t dk = d->dk, dv = d->dv, CH = GDN_CHUNK;
    const clover_gemm_f32_fn gemm = clover_gemm_f32_kernel(-1); /* dot.h: C += alpha A B */
    float *A = scratch, *U = A + CH * CH, *W = U + CH * dv, *G = W + CH * dk, *row = G + CH;
    float *Kt = row + CH; /* [dk][L]: the chunk's K^T, at the end K'^T with K'_j = exp(G_L - G_j) k_j */
    float *E = Kt + CH * dk; /* [L][CH]: the decay exp(G_i - G_j) for j <= i, else 0 */
    float *Kc = E + CH * CH, *Vc = Kc + CH * dk; /* the chunk's k and v rows packed: [L][dk], [L][dv] */
    for (int64_t t0 = 0; t0 < T; t0 += CH) {
        const int64_t L = T - t0 < CH ? T - t0 : CH;
        double acc = 0;
        for (int64_t i = 0; i < L; i++) {
            acc += g[(t0 + i) * d->Hv + h];
            G[i] = (float)acc;
        }
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) E[i * CH + j] = j <= i ? expf(G[i] - G[j]) : 0.0f;
        /* Kc, Vc and Kt = K^T [dk][L] (the chunk's keys as gemm's B), then A = K K^T */
        const float *Q0 = GDN_Q(d, conv, t0, h);
        for (int64_t j = 0; j < L; j++) {
            memcpy(Kc + j * dk, GDN_K(d, conv, t0 + j, h), sizeof(float) * (size_t)dk);
            memcpy(Vc + j * dv, GDN_V(d, conv, t0 + j, h), sizeof(float) * (size_t)dv);
            for (int64_t m = 0; m < dk; m++) Kt[m * L + j] = Kc[j * dk + m];
        }
        memset(A, 0, sizeof(float) * (size_t)(L * CH));
        gemm(L, L, dk, 1.0f, Kc, dk, Kt, L, A, CH);
        /* A[i][j] = -beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0 */
        for (int64_t i = 0; i < L; i++) {
            const float bi = beta[(t0 + i) * d->Hv + h];
            for (int64_t j = 0; j < L; j++) A[i * CH + j] = j < i ? -bi * A[i * CH + j] * E[i * CH + j] : 0.0f;
        }
        /* forward substitution, row by row, using the already updated rows above: A[i][j] =
         * row[j] + sum_{j < m < i} row[m] A[m][j] with row = A[i] as it was, each sum in m order,
         * run as axpys over the rows m (contiguous, so vectorised) */
        for (int64_t i = 1; i < L; i++) {
            float *ai = A + i * CH;
            for (int64_t j = 0; j < i; j++) row[j] = ai[j], ai[j] = 0.0f;
            for (int64_t m = 1; m < i; m++) {
                const float r = row[m], *am = A + m * CH;
                for (int64_t j = 0; j < m; j++) ai[j] += r * am[j];
            }
            for (int64_t j = 0; j < i; j++) ai[j] = row[j] + ai[j];
        }
        for (int64_t i = 0; i < L; i++) A[i * CH + i] = 1.0f;
        /* U = (A diag(beta)) V, then W = (A diag(beta) diag(exp(G))) K, A scaled in place */
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j <= i; j++) A[i * CH + j] *= beta[(t0 + j) * d->Hv + h];
        memset(U, 0, sizeof(float) * (size_t)(L * dv));
        gemm(L, dv, L, 1.0f, A, CH, Vc, dv, U, dv);
        for (int64_t j = 0; j < L; j++) row[j] = expf(G[j]);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j <= i; j++) A[i * CH + j] *= row[j];
        memset(W, 0, sizeof(float) * (size_t)(L * dk));
        gemm(L, dk, L, 1.0f, A, CH, Kc, dk, W, dk);
        /* V' = U - W S (in U) */
        gemm(L, dv, dk, -1.0f, W, dk, S, dv, U, dv);
        /* O_i = exp(G_i) q_i S + sum_{j<=i} (q_i . k_j) exp(G_i - G_j) V'_j: P = Q K^T masked and
         * decayed (in A), O = diag(exp(G)) Q S + P V' */
        float *o0 = o + (t0 * d->Hv + h) * dv;
        const int64_t ldo = d->Hv * dv;
        for (int64_t i = 0; i < L; i++) memset(o0 + i * ldo, 0, sizeof(float) * (size_t)dv);
        gemm(L, dv, dk, 1.0f, Q0, d->C, S, dv, o0, ldo);
        for (int64_t i = 0; i < L; i++)
            for (int64_t n = 0; n < dv; n++) o0[i * ldo + n] *= row[i];
        memset(A, 0, sizeof(float) * (size_t)(L * CH));
        gemm(L, L, dk, 1.0f, Q0, d->C, Kt, L, A, CH);
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) A[i * CH + j] *= E[i * CH + j];
        gemm(L, dv, L, 1.0f, A, CH, U, dv, o0, ldo);
        /* S <- exp(G_L) S + sum_j exp(G_L - G_j) k_j V'_j^T, with Kt scaled to K'^T */
        const float egl = expf(G[L - 1]);
        for (int64_t m = 0; m < dk * dv; m++) S[m] *= egl;
        for (int64_t j = 0; j < L; j++) {
            const float e = expf(G[L - 1] - G[j]);
            for (int64_t m = 0; m < dk; m++) Kt[m * L + j] *= e;
        }
        gemm(dk, dv, L, 1.0f, Kt, L, U, dv, S, dv);
    }
}

/* Floats of one thread's GDN scratch: gdn_chunked_head's A, U, W, G, row, Kt, E, Kc and Vc, and
 * at the end the S and tmp of the token-by-token forms. */
static int64_t gdn_scratch_floats(const gdn_dims *d) {
    return 2 * GDN_CHUNK * GDN_CHUNK + GDN_CHUNK * (2 * d->dv + 3 * d->dk) + 2 * GDN_CHUNK + d->dk * d->dv + d->dv;
}

/* The block softmax's per-head constants (spec 3.3 step 4): *scale = exp(lambda_h) sqrt(dk), the
 * factor of q . k (q carries 1/sqrt(dk), so q~ . k~ = sqrt(dk) q . k), and *hist = beta0_h +
 * c_h ln(1 + P), the history slot's logit after P clean tokens. */
static void bd_constants(const clover_layer *ly, const gdn_dims *d, int64_t h, int64_t P, float *scale, float *hist) {
    *scale = expf(ly->bd_lambda[h]) * sqrtf((float)d->dk);
    *hist = ly->bd_beta0[h] + ly->bd_c[h] * log1pf((float)P);
}

/* The block operator's mixing (spec 3.3 steps 3-4 [assumed form]) for value head h over the T
 * block rows of conv (qk_norm's output): o_i = a_iH S^T q_i + sum_j a_ij v_j with a_i = softmax
 * over (scale q_i . k_j for every block row j, hist), S [dk][dv] the clean state (read only).
 * o: [T, Hv*dv]; a: T + 1 floats of scratch. */
CLOVER_CLONES static void bd_head(const gdn_dims *d, const float *conv, const float *S, int64_t T, int64_t h,
                                  float scale, float hist, float *o, float *a) {
    const int64_t dk = d->dk, dv = d->dv;
    for (int64_t i = 0; i < T; i++) {
        const float *q = GDN_Q(d, conv, i, h);
        float mx = hist;
        for (int64_t j = 0; j < T; j++) {
            const float *k = GDN_K(d, conv, j, h);
            float s = 0;
            for (int64_t m = 0; m < dk; m++) s += q[m] * k[m];
            a[j] = scale * s;
            mx = a[j] > mx ? a[j] : mx;
        }
        a[T] = hist;
        double sum = 0;
        for (int64_t j = 0; j <= T; j++) sum += a[j] = expf(a[j] - mx);
        const float inv = (float)(1.0 / sum);
        float *oi = o + (i * d->Hv + h) * dv;
        readout(S, q, dk, dv, oi);
        for (int64_t n = 0; n < dv; n++) oi[n] *= a[T] * inv;
        for (int64_t j = 0; j < T; j++) {
            const float w = a[j] * inv, *v = GDN_V(d, conv, j, h);
            for (int64_t n = 0; n < dv; n++) oi[n] += w * v[n];
        }
    }
}

enum { GDN_FORWARD, GDN_FORWARD_CHUNKED };

/* What one value head of a GDN layer computes over the T rows of conv (qk_norm's output), given
 * the thread's scratch: the recurrence (kind GDN_FORWARD*, advancing state with beta, g) or the
 * block operator's mixing (block: reading state, after P clean tokens). */
typedef struct {
    const gdn_dims *d;
    int kind, block;
    const clover_layer *ly;
    const float *conv, *beta, *g;
    int64_t T, P;
    float *state, *o;
    int64_t n_scratch;
} gdn_job;

static void gdn_head(const gdn_job *j, int64_t h, float *scratch) {
    const gdn_dims *d = j->d;
    float *S = j->state + h * d->dk * d->dv;
    if (j->block) {
        float scale, hist;
        bd_constants(j->ly, d, h, j->P, &scale, &hist);
        bd_head(d, j->conv, S, j->T, h, scale, hist, j->o, scratch);
    } else if (j->kind == GDN_FORWARD_CHUNKED) {
        gdn_chunked_head(d, j->conv, j->beta, j->g, j->T, h, S, j->o, scratch);
    } else {
        gdn_recurrent_head(d, j->conv, j->beta, j->g, j->T, h, S, j->o, scratch + j->n_scratch - d->dv);
    }
}

/* gdn_head over every value head (independent, so split over threads, each with n_scratch floats
 * of scratch and subnormals flushed). CLOVER_E_NOMEM when a thread's scratch cannot be had. */
static int gdn_heads(const gdn_job *j, int nth) {
    int err = 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) if (nth > 1 && j->d->Hv > 1)
#endif
    {
        const unsigned csr = flush_subnormals_begin(); /* in every thread of the region */
        float *scratch = malloc(sizeof(float) * (size_t)j->n_scratch);
        if (!scratch) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            err = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t h = 0; h < j->d->Hv; h++)
            if (scratch) gdn_head(j, h, scratch);
        free(scratch);
        flush_subnormals_end(csr);
    }
    return err ? CLOVER_E_NOMEM : CLOVER_OK;
}

/* The recurrence of kind GDN_FORWARD* over all value heads, advancing state [Hv][dk][dv]. */
static int gdn_recurrence(int kind, const gdn_dims *d, const float *conv, const float *beta, const float *g,
                          int64_t T, float *state, float *o, int nth) {
    const gdn_job j = {d, kind, 0, NULL, conv, beta, g, T, 0, state, o, gdn_scratch_floats(d)};
    return gdn_heads(&j, nth);
}

/* The block operator's mixing (bd_head) over every value head of layer ly after P clean tokens;
 * state: the layer's clean state [Hv][dk][dv], read only. */
static int bd_heads(const gdn_dims *d, const clover_layer *ly, const float *conv, const float *state, int64_t T,
                    int64_t P, float *o, int nth) {
    const gdn_job j = {d, 0, 1, ly, conv, NULL, NULL, T, P, (float *)state, o, T + 1};
    return gdn_heads(&j, nth);
}

/* A zeroed device buffer laid out as gdn_state (*dev) and a zeroed flag per GDN layer (*flags),
 * both or neither. */
static int alloc_gdn_states(const clover_context *c, void **dev, unsigned char **flags, char *err, size_t err_size) {
    const size_t bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp) * (size_t)c->m->n_gdn;
    int rc = clover_cuda_alloc(bytes, dev, err, err_size);
    if (rc == CLOVER_OK && !(*flags = calloc((size_t)c->m->n_gdn, 1)))
        rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    if (rc != CLOVER_OK) {
        clover_cuda_free(*dev);
        *dev = NULL;
    }
    return rc;
}

/* Bytes of one GDN layer's conv history (conv_state's slot). */
static size_t conv_slot_bytes(const clover_hparams *hp) {
    return sizeof(float) * (size_t)(hp->ssm_d_conv - 1) * (size_t)conv_channels(hp);
}

/* Bring the GDN state (and, in the resident forward, the conv history) of the slots whose
 * current copy is on the device back to gdn_state (conv_state). */
static int gdn_to_host(clover_context *c, char *err, size_t err_size) {
    if (!c->gdn_on_dev) return CLOVER_OK;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), conv_bytes = conv_slot_bytes(&c->m->hp);
    for (int g = 0; g < c->m->n_gdn; g++) {
        if (!c->gdn_on_dev[g]) continue;
        int rc = clover_cuda_read(c->gdn_dev, slot_bytes * (size_t)g, (char *)c->gdn_state + slot_bytes * (size_t)g,
                                  slot_bytes, err, err_size);
        if (rc == CLOVER_OK && c->conv_dev)
            rc = clover_cuda_read(c->conv_dev, conv_bytes * (size_t)g, (char *)c->conv_state + conv_bytes * (size_t)g,
                                  conv_bytes, err, err_size);
        if (rc != CLOVER_OK) return rc;
        c->gdn_on_dev[g] = 0;
    }
    return CLOVER_OK;
}

/* clover_context_checkpoint's copy of the GDN state (and conv history, resident forward) of the
 * slots on the device, kept there (snap_on_dev; clover_context_rollback restores and replays
 * them there). */
static int gdn_snapshot_on_device(clover_context *c, char *err, size_t err_size) {
    if (!c->gdn_on_dev) return CLOVER_OK;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp);
    if (!c->snap_on_dev) {
        const int rc = alloc_gdn_states(c, &c->gdn_snap_dev, &c->snap_on_dev, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    const size_t conv_bytes = conv_slot_bytes(&c->m->hp), conv_all = conv_bytes * (size_t)c->m->n_gdn;
    if (c->conv_dev && !c->conv_snap_dev) {
        const int rc = clover_cuda_alloc(conv_all, &c->conv_snap_dev, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    for (int g = 0; g < c->m->n_gdn; g++) {
        c->snap_on_dev[g] = c->gdn_on_dev[g];
        if (!c->gdn_on_dev[g]) continue;
        int rc = clover_cuda_copy((char *)c->gdn_snap_dev + slot_bytes * (size_t)g,
                                  (const char *)c->gdn_dev + slot_bytes * (size_t)g, slot_bytes, err, err_size);
        if (rc == CLOVER_OK && c->conv_dev)
            rc = clover_cuda_copy((char *)c->conv_snap_dev + conv_bytes * (size_t)g,
                                  (const char *)c->conv_dev + conv_bytes * (size_t)g, conv_bytes, err, err_size);
        if (rc != CLOVER_OK) {
            c->snap_on_dev[g] = 0;
            return rc;
        }
    }
    return CLOVER_OK;
}

/* The device GDN state of every GDN layer and, for the resident forward, their conv history on
 * the device (both zeroed), unless allocated already. */
static int gdn_dev_alloc(clover_context *c, char *err, size_t err_size) {
    int rc = CLOVER_OK;
    if (!c->gdn_on_dev && (rc = alloc_gdn_states(c, &c->gdn_dev, &c->gdn_on_dev, err, err_size)) != CLOVER_OK) return rc;
    if (c->m->resident && !c->conv_dev)
        rc = clover_cuda_alloc(conv_slot_bytes(&c->m->hp) * (size_t)c->m->n_gdn, &c->conv_dev, err, err_size);
    return rc;
}

/* Whether GDN layer ly runs its recurrence on the GPU (its output projection is there and the
 * kernels take its dimensions). */
static int gdn_on_gpu(const clover_layer *ly, const gdn_dims *d) {
    return ly->wout.dev && d->dk <= 256 && d->dv <= 1024;
}

/* At context creation on a model with weights on the GPU: the device KV cache of the offloaded
 * attention layers, and the device GDN state where a GDN layer runs there, as llama.cpp
 * allocates its KV cache with the context: a GPU too small for n_ctx fails there, not at the
 * first forward. */
static int gpu_state_reserve(clover_context *c, char *err, size_t err_size) {
    const clover_model *m = c->m;
    const gdn_dims d = gdn_dims_of(&m->hp);
    int rc = offloaded_attn(m, m->n_attn) > 0 ? kv_dev_alloc(c, err, err_size) : CLOVER_OK;
    for (int il = 0; il < m->hp.n_layer && rc == CLOVER_OK; il++)
        if (!m->layers[il].is_attn && gdn_on_gpu(&m->layers[il], &d)) {
            rc = gdn_dev_alloc(c, err, err_size);
            break;
        }
    return rc;
}

/* Make the device copy of GDN slot g current: the device state (and, for the resident forward,
 * the conv history on the device) allocated unless it is (gpu_state_reserve), the host copy
 * uploaded unless the device one is already current. */
static int gdn_slot_to_device(clover_context *c, int g, char *err, size_t err_size) {
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), at = slot_bytes * (size_t)g;
    const size_t conv_bytes = conv_slot_bytes(&c->m->hp);
    int rc = gdn_dev_alloc(c, err, err_size);
    if (rc != CLOVER_OK) return rc;
    if (c->gdn_on_dev[g]) return CLOVER_OK;
    rc = clover_cuda_write(c->gdn_dev, at, (const char *)c->gdn_state + at, slot_bytes, err, err_size);
    if (rc == CLOVER_OK && c->conv_dev)
        rc = clover_cuda_write(c->conv_dev, conv_bytes * (size_t)g, (const char *)c->conv_state + conv_bytes * (size_t)g,
                               conv_bytes, err, err_size);
    c->gdn_on_dev[g] = rc == CLOVER_OK;
    return rc;
}

/* The GPU's kind for a prefix-mode forward of T rows: the chunked form for prefills past one chunk
 * of 64 rows (unless clover_context_set_gdn_chunked turned it off), else the recurrence (decode
 * steps, spec's verify, short prefills). */
static int gpu_gdn_forward(const clover_context *c, int64_t T) {
    return c->gdn_chunked && T > 64 ? CLOVER_GDN_FORWARD_CHUNKED : CLOVER_GDN_FORWARD;
}

/* One GDN recurrence of an offloaded layer on the GPU (clover_cuda_gdn, kind CLOVER_GDN_FORWARD*),
 * or with b NULL the block operator's mixing (clover_cuda_gdn_block, reading the state): the
 * layer's state is moved to the device at its first use there and stays (gdn_on_dev). */
static int gpu_gdn(fwd *f, const clover_layer *ly, int kind, const gdn_dims *d, const float *cv, const float *b,
                   const float *a, float *o) {
    clover_context *c = f->c;
    const size_t slot_bytes = sizeof(float) * (size_t)gdn_state_floats(&c->m->hp), at = slot_bytes * (size_t)ly->slot;
    const int rc = gdn_slot_to_device(c, ly->slot, f->err, f->err_size);
    if (rc != CLOVER_OK) return rc;
    float *state = (float *)((char *)c->gdn_dev + at);
    if (!b)
        return clover_cuda_gdn_block(cv, f->T, d->Hk, d->Hv, d->dk, d->dv, d->C, state, ly->bd_lambda, ly->bd_beta0,
                                     ly->bd_c, f->pos0, o, f->err, f->err_size);
    return clover_cuda_gdn(kind, cv, b, a, f->T, d->Hk, d->Hv, d->dk, d->dv, d->C, state, o, f->err, f->err_size);
}

/* A Gated DeltaNet layer (spec 2.1) over the T rows xn: in prefix mode the recurrence advances
 * the layer's state and conv history; in block mode (spec 3.3) the conv takes the right taps and
 * the block softmax reads the clean state, both left unchanged. */
static int gdn_layer(fwd *f, const clover_layer *ly, const float *xn, float *out) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t T = f->T, C = d.C, vdim = d.Hv * d.dv;
    const int block = f->mode == MODE_BLOCK;
    float *state = c->gdn_state + (size_t)ly->slot * gdn_state_floats(hp);
    float *hist = c->conv_state + (size_t)ly->slot * (d.K - 1) * C;
    float *qkv = malloc(sizeof(float) * (size_t)(T * C));
    float *cv = malloc(sizeof(float) * (size_t)(T * C));
    float *z = malloc(sizeof(float) * (size_t)(T * vdim));
    float *b = malloc(sizeof(float) * (size_t)(T * d.Hv));
    float *a = malloc(sizeof(float) * (size_t)(T * d.Hv));
    float *o = malloc(sizeof(float) * (size_t)(T * vdim));
    int rc = CLOVER_E_NOMEM;
    /* the recurrence on the GPU when the layer is offloaded (the conv and norms stay here) */
    const int on_gpu = gdn_on_gpu(ly, &d);
    if (!on_gpu && c->gdn_on_dev && c->gdn_on_dev[ly->slot] && (rc = gdn_to_host(c, f->err, f->err_size)) != CLOVER_OK)
        goto done;
    rc = CLOVER_E_NOMEM;
    if (!qkv || !cv || !z || !b || !a || !o) goto done;
    /* beta and g shape the state only: block mode does not compute them (spec 3.3 step 4) */
    if (matmul(f, &ly->wqkv, xn, T, qkv) || matmul(f, &ly->wz, xn, T, z) ||
        (!block && (matmul(f, &ly->wbeta, xn, T, b) || matmul(f, &ly->walpha, xn, T, a))))
        goto done;
    conv_silu(&d, ly->conv, block ? ly->conv_right : NULL, hist, qkv, T, cv);
    qk_norm(&d, cv, T, 1e-6f);
    if (block) {
        rc = on_gpu ? gpu_gdn(f, ly, 0, &d, cv, NULL, NULL, o)
                    : bd_heads(&d, ly, cv, state, T, f->pos0, o, c->n_threads);
        if (rc != CLOVER_OK) goto done;
    } else {
        gates(&d, b, a, ly->ssm_a, ly->dt_bias, T);
        if (c->rec_on) { /* speculative verify: keep the replay inputs */
            const size_t slot = (size_t)ly->slot * (size_t)c->rec_cap;
            memcpy(c->rec_qkv + slot * C, qkv, sizeof(float) * (size_t)(T * C));
            memcpy(c->rec_cv + slot * C, cv, sizeof(float) * (size_t)(T * C));
            memcpy(c->rec_b + slot * d.Hv, b, sizeof(float) * (size_t)(T * d.Hv));
            memcpy(c->rec_a + slot * d.Hv, a, sizeof(float) * (size_t)(T * d.Hv));
        }
        /* new conv history: the last K-1 inputs of (history ++ qkv rows) */
        for (int64_t j = 0; j < d.K - 1; j++) {
            int64_t src = T - (d.K - 1) + j;
            float *dst = hist + j * C;
            if (src >= 0) memcpy(dst, qkv + src * C, sizeof(float) * (size_t)C);
            else memmove(dst, hist + (d.K - 1 + src) * C, sizeof(float) * (size_t)C);
        }
        rc = on_gpu ? gpu_gdn(f, ly, gpu_gdn_forward(f->c, T), &d, cv, b, a, o)
                    : gdn_recurrence(c->gdn_chunked && T > 1 ? GDN_FORWARD_CHUNKED : GDN_FORWARD, &d, cv, b, a, T,
                                     state, o, c->n_threads);
        if (rc != CLOVER_OK) goto done;
    }
    /* gated RMSNorm per head with a plain weight (spec 2.1 step 7) */
    for (int64_t t = 0; t < T; t++)
        for (int64_t h = 0; h < d.Hv; h++) {
            float *oh = o + (t * d.Hv + h) * d.dv;
            const float *zh = z + (t * d.Hv + h) * d.dv;
            rmsnorm(oh, oh, ly->ssm_norm, d.dv, hp->rms_eps);
            for (int64_t n = 0; n < d.dv; n++) oh[n] *= silu(zh[n]);
        }
    rc = matmul(f, &ly->wout, o, T, out) ? CLOVER_E_NOMEM : CLOVER_OK;
done:
    free(qkv), free(cv), free(z), free(b), free(a), free(o);
    return rc;
}

/* ------------------------------------------------------------------ MoE (spec 2.3, 5.6) */

/* Indices of the k largest p[i] among allowed experts (allowed == NULL: all), largest first,
 * ties to the lower id. */
static void topk(const float *p, int64_t n, const unsigned char *allowed, int64_t k, int32_t *idx) {
    for (int64_t s = 0; s < k; s++) {
        int32_t best = -1;
        for (int64_t e = 0; e < n; e++) {
            if (allowed && !allowed[e]) continue;
            int taken = 0;
            for (int64_t u = 0; u < s; u++) taken |= idx[u] == e;
            if (taken) continue;
            if (best < 0 || p[e] > p[best]) best = (int32_t)e;
        }
        idx[s] = best;
    }
}

/* Coreset C (spec 5.6): allowed[e] = 1 for the first m experts by aggregated top-k mass. */
static void coreset(const float *probs, int64_t T, int64_t E, int64_t k, double top_p, unsigned char *allowed,
                    double *S, int32_t *order, int32_t *idx) {
    for (int64_t e = 0; e < E; e++) S[e] = 0;
    for (int64_t t = 0; t < T; t++) {
        topk(probs + t * E, E, NULL, k, idx);
        for (int64_t s = 0; s < k; s++) S[idx[s]] += probs[t * E + idx[s]];
    }
    double tot = 0;
    for (int64_t e = 0; e < E; e++) tot += S[e];
    for (int64_t e = 0; e < E; e++) {
        S[e] = tot > 0 ? S[e] / tot : 0;
        order[e] = (int32_t)e;
    }
    /* stable insertion sort by S descending (ties: lower id first) */
    for (int64_t i = 1; i < E; i++) {
        int32_t x = order[i];
        int64_t j = i - 1;
        while (j >= 0 && S[order[j]] < S[x]) {
            order[j + 1] = order[j];
            j--;
        }
        order[j + 1] = x;
    }
    int64_t m = E;
    double cum = 0;
    for (int64_t i = 0; i < E; i++) {
        cum += S[order[i]];
        if (cum >= top_p) {
            m = i + 1;
            break;
        }
    }
    if (m < k) m = k;
    memset(allowed, 0, (size_t)E);
    for (int64_t i = 0; i < m; i++) allowed[order[i]] = 1;
}

/* One expert's SwiGLU over its n gathered rows (spec 2.3 step 2), single-threaded:
 * y = W_down (silu(W_gate x) * W_up x). gt, up: scratch [n, I]. */
static int expert_ffn(const clover_layer *ly, int64_t e, int64_t I, const float *x, int64_t n, float *gt, float *up,
                      float *y) {
    clover_tensor wg = expert_view(&ly->gate_exps, e), wu = expert_view(&ly->up_exps, e);
    clover_tensor wd = expert_view(&ly->down_exps, e);
    if (wmatmul(&wg, x, n, gt, 1, NULL, 0) || wmatmul(&wu, x, n, up, 1, NULL, 0)) return CLOVER_E_NOMEM;
    for (int64_t i = 0; i < n * I; i++) gt[i] = silu(gt[i]) * up[i];
    return wmatmul(&wd, gt, n, y, 1, NULL, 0) ? CLOVER_E_NOMEM : CLOVER_OK;
}

/* The routed experts on the CPU: expert e over its bucket [start[e], start[e+1]) of xg into yg
 * (n_used non-empty buckets), experts spread over the threads, one task per expert, so a pass
 * forks once instead of once per product. Non-zero on failure (out of memory). */
static int cpu_experts(const clover_context *c, const clover_layer *ly, int64_t I, int64_t H, int64_t E,
                       int32_t n_used, const int64_t *start, const float *xg, float *yg) {
    int err_any = 0;
    int64_t n_max = 0;
    for (int64_t e = 0; e < E; e++) n_max = start[e + 1] - start[e] > n_max ? start[e + 1] - start[e] : n_max;
#ifdef _OPENMP
#pragma omp parallel num_threads(c->n_threads) if (c->n_threads > 1 && n_used > 1)
#endif
    {
        float *tg = malloc(sizeof(float) * (size_t)(n_max * I));
        float *tu = malloc(sizeof(float) * (size_t)(n_max * I));
        if (!tg || !tu) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
            err_any = 1;
        }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (int64_t e = 0; e < E; e++) {
            const int64_t n = start[e + 1] - start[e];
            if (n == 0 || !tg || !tu) continue;
            if (expert_ffn(ly, e, I, xg + start[e] * H, n, tg, tu, yg + start[e] * H)) {
#ifdef _OPENMP
#pragma omp atomic write
#endif
                err_any = 1;
            }
        }
        free(tg), free(tu);
    }
    return err_any;
}

/* The shared expert of a layer before its gate (spec 2.3 step 3): ys = W_down (silu(W_gate x) *
 * W_up x) and the gate logits sg[t] = w . x[t], for T rows of xn; gt, up: scratch [T][Is].
 * rc: 0 done, non-zero failed. A pthread start routine, so that it can overlap the routed
 * experts (moe_layer). */
typedef struct {
    const clover_context *c;
    const clover_layer *ly;
    const float *xn;
    int64_t T, Is;
    float *sg, *gt, *up, *ys;
    int n_threads; /* for products on the CPU */
    int rc;        /* CLOVER_OK, or the code of the product that failed */
    char err[256]; /* and its message, if the GPU gave one */
} shared_job;

/* y = w x for the shared expert's job (wmatmul, a GPU error into j->err). */
static int shared_mm(shared_job *j, const clover_tensor *w, const float *x, float *y) {
    return wmatmul(w, x, j->T, y, j->n_threads, j->err, sizeof j->err);
}

static void *shared_expert(void *arg) {
    shared_job *j = arg;
    const clover_layer *ly = j->ly;
    if ((j->rc = shared_mm(j, &ly->shexp_gate, j->xn, j->sg)) || (j->rc = shared_mm(j, &ly->gate_sh, j->xn, j->gt)) ||
        (j->rc = shared_mm(j, &ly->up_sh, j->xn, j->up)))
        return NULL;
    for (int64_t i = 0; i < j->T * j->Is; i++) j->gt[i] = silu(j->gt[i]) * j->up[i];
    j->rc = shared_mm(j, &ly->down_sh, j->gt, j->ys);
    return NULL;
}

/* A device tensor as clover_cuda_experts takes it (expert matrices stride bytes apart). */
static clover_cuda_weight cuda_weight(const clover_tensor *w) {
    const clover_cuda_weight cw = {w->type, w->dev, w->ne[0], w->ne[1], clover_row_nbytes(w->type, w->ne[0]) * w->ne[1]};
    return cw;
}

static int moe_layer(fwd *f, const clover_layer *ly, int il, const float *xn, float *out) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, H = hp->n_embd, E = hp->n_expert, k = hp->n_expert_used, I = hp->n_ff_exp;
    const int64_t Is = hp->n_ff_shexp, P = T * k; /* P (row, expert) pairs */
    float *probs = malloc(sizeof(float) * (size_t)(T * E));
    int32_t *sel = malloc(sizeof(int32_t) * (size_t)P);
    float *wsel = malloc(sizeof(float) * (size_t)P);
    unsigned char *allowed = malloc((size_t)E);
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t)); /* bucket of expert e: [start[e], start[e+1]) */
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    double *S = malloc(sizeof(double) * (size_t)E);
    int32_t *order = malloc(sizeof(int32_t) * (size_t)E);
    int32_t *prow = malloc(sizeof(int32_t) * (size_t)P); /* token row of each bucketed pair */
    float *pw = malloc(sizeof(float) * (size_t)P);
    float *xg = malloc(sizeof(float) * (size_t)(P * H));
    float *yg = malloc(sizeof(float) * (size_t)(P * H));
    float *gt = malloc(sizeof(float) * (size_t)(T * Is));
    float *up = malloc(sizeof(float) * (size_t)(T * Is));
    float *ys = malloc(sizeof(float) * (size_t)(T * H));
    float *sg = malloc(sizeof(float) * (size_t)T);
    int rc = CLOVER_E_NOMEM;
    if (!probs || !sel || !wsel || !allowed || !start || !fill || !S || !order || !prow || !pw || !xg || !yg || !gt || !up ||
        !ys || !sg)
        goto done;
    /* router: softmax in fp32 over all experts, top-k, renormalise (spec 2.3 step 1) */
    if (matmul(f, &ly->router, xn, T, probs)) goto done;
    for (int64_t t = 0; t < T; t++) {
        float *p = probs + t * E, mx = -FLT_MAX;
        for (int64_t e = 0; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        double sum = 0;
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - mx));
        for (int64_t e = 0; e < E; e++) p[e] = (float)(p[e] / sum);
    }
    const int use_coreset = f->mode == MODE_BLOCK;
    if (use_coreset) {
        coreset(probs, T, E, k, f->coreset_top_p, allowed, S, order, sel);
        int32_t n_full = 0; /* S[e] > 0: e is in some row's own top-k */
        for (int64_t e = 0; e < E; e++) n_full += S[e] > 0;
        c->nexp_full[il] = n_full;
    }
    for (int64_t t = 0; t < T; t++) {
        int32_t *st = sel + t * k;
        topk(probs + t * E, E, use_coreset ? allowed : NULL, k, st);
        double sum = 0;
        for (int64_t s = 0; s < k; s++) sum += probs[t * E + st[s]];
        for (int64_t s = 0; s < k; s++) {
            wsel[t * k + s] = (float)(probs[t * E + st[s]] / sum);
            start[st[s] + 1]++;
        }
    }
    /* bucket the pairs by expert (counting sort, rows ascending within a bucket) */
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int32_t n_used = 0;
    for (int64_t e = 0; e < E; e++) n_used += start[e + 1] > start[e];
    memcpy(fill, start, sizeof(int64_t) * (size_t)E);
    for (int64_t t = 0; t < T; t++)
        for (int64_t s = 0; s < k; s++) {
            int64_t q = fill[sel[t * k + s]]++;
            prow[q] = (int32_t)t;
            pw[q] = wsel[t * k + s];
            memcpy(xg + q * H, xn + t * H, sizeof(float) * (size_t)H);
        }
    /* each used expert runs once over the rows routed to it (spec 5.6): on the GPU as one
     * grouped product per projection when the layer's experts were offloaded, else on the CPU,
     * while a helper thread runs the shared expert's products on the GPU if they are there
     * (--cpu-moe: CPU and GPU work overlap) */
    const int gpu_experts = ly->gate_exps.dev && ly->up_exps.dev && ly->down_exps.dev;
    shared_job sj = {c, ly, xn, T, Is, sg, gt, up, ys, 1, 1, ""};
    pthread_t helper;
    const int overlap = !gpu_experts && ly->gate_sh.dev && ly->up_sh.dev && ly->down_sh.dev &&
                        pthread_create(&helper, NULL, shared_expert, &sj) == 0;
    int rc_experts = CLOVER_OK;
    if (gpu_experts) {
        const clover_cuda_weight g = cuda_weight(&ly->gate_exps), u = cuda_weight(&ly->up_exps),
                                 d = cuda_weight(&ly->down_exps);
        rc_experts = clover_cuda_experts(&g, &u, &d, E, start, xg, yg, f->err, f->err_size);
    } else if (cpu_experts(c, ly, I, H, E, n_used, start, xg, yg)) {
        rc_experts = CLOVER_E_NOMEM;
    }
    if (overlap) {
        pthread_join(helper, NULL);
    } else if (rc_experts == CLOVER_OK) {
        sj.n_threads = c->n_threads;
        shared_expert(&sj);
    }
    if (rc_experts != CLOVER_OK) {
        rc = rc_experts;
        goto done;
    }
    if (sj.rc) {
        rc = sj.rc;
        if (sj.err[0]) clover_set_err(f->err, f->err_size, rc, "%s", sj.err);
        goto done;
    }
    /* weighted sum in a fixed order, so the result does not depend on the thread count */
    memset(out, 0, sizeof(float) * (size_t)(T * H));
    for (int64_t q = 0; q < P; q++)
        for (int64_t j = 0; j < H; j++) out[prow[q] * H + j] += pw[q] * yg[q * H + j];
    if (f->n_experts_out) f->n_experts_out[il] = n_used;
    /* plus the shared expert, gated per token by sigmoid(w . x) (spec 2.3 step 3) */
    for (int64_t t = 0; t < T; t++) {
        float s = sigmoidf_(sg[t]);
        for (int64_t j = 0; j < H; j++) out[t * H + j] += s * ys[t * H + j];
    }
    rc = CLOVER_OK;
done:
    free(probs), free(sel), free(wsel), free(allowed), free(start), free(fill), free(S), free(order), free(prow);
    free(pw), free(xg), free(yg), free(gt), free(up), free(ys), free(sg);
    return rc;
}

/* ------------------------------------------------------------------ whole model */

static int check_tokens(const clover_model *m, const int32_t *tokens, int32_t n, char *err, size_t err_size) {
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->hp.n_vocab)
            return clover_set_err(err, err_size, CLOVER_E_ARG, "tokens[%d]: id %d outside [0, %d)", i, tokens[i],
                                  m->hp.n_vocab);
    return CLOVER_OK;
}

/* A clover_context_abort request, checked between layers (on this thread, outside the OpenMP
 * regions inside them): consume it and return CLOVER_E_ABORTED, else CLOVER_OK. */
static int check_abort(fwd *f, int il) {
    clover_context *c = f->c;
    const int n_layer = c->m->hp.n_layer;
    if (!atomic_load_explicit(&c->abort_req, memory_order_relaxed) || !atomic_exchange(&c->abort_req, 0))
        return CLOVER_OK;
    if (il < n_layer)
        return clover_set_err(f->err, f->err_size, CLOVER_E_ABORTED, "aborted by clover_context_abort before layer "
                              "%d of %d (%lld rows)", il, n_layer, (long long)f->T);
    return clover_set_err(f->err, f->err_size, CLOVER_E_ABORTED, "aborted by clover_context_abort before the LM head "
                          "(%lld rows)", (long long)f->T);
}

/* CLOVER_E_NUMERIC naming `what` of layer il when one of the n values at x is NaN or Inf (a broken
 * weight or an overflow: generation must stop rather than emit garbage), else CLOVER_OK. */
static int check_finite(fwd *f, const float *x, int64_t n, int il, const char *what) {
    int64_t i = 0;
    while (i < n && isfinite(x[i])) i++;
    if (i == n) return CLOVER_OK;
    const int64_t H = f->c->m->hp.n_embd;
    if (il < 0)
        return clover_set_err(f->err, f->err_size, CLOVER_E_NUMERIC, "non-finite logit (%g) from the LM head "
                              "(output.weight), row %lld", x[i], (long long)(i / f->c->m->hp.n_vocab));
    return clover_set_err(f->err, f->err_size, CLOVER_E_NUMERIC, "non-finite value (%g) after layer %d (blk.%d) %s, "
                          "row %lld of %lld", x[i], il, il, what, (long long)(i / H), (long long)f->T);
}

/* ------------------------------------------------------------------ the resident forward */

/* Every layer and the output on the GPU (model->resident): forward() with the activations on
 * the device from the embedding to the logits. The host embeds the tokens, queues the
 * clover_cuda_*_d operations (native/cuda/cuda_backend.h, each the GPU form of the CPU function
 * named there) and reads back, once per pass, the non-finite flags and expert counts and then
 * the logits rows it needs. The KV cache, GDN state and conv history stay on the device (the
 * host copies are brought up to date by save_state only). Prefill runs in passes of at most
 * RES_ROWS rows (causal, so several passes equal one); the LM head in groups of RES_LM rows. */
enum { RES_ROWS = CLOVER_SELECT_MAX_ROWS, RES_LM = 32 };
/* a top-p selection's rows are read back from the LM head's one group of RES_LM rows */
_Static_assert((int)CLOVER_SELECT_TOTAL_MAX_ROWS <= (int)RES_LM, "top-p selections must fit one LM-head group");

typedef struct {
    float *x, *xn, *o, *qg, *att, *qkv, *cv, *z, *b, *a, *og, *probs, *wsel, *pw, *xg, *yg;
    float *gt, *up, *ys, *sg, *logits;
    int32_t *sel, *prow, *pair, *idx, *gstart, *gid; /* gstart, gid, gconf, gcand: selection */
    float *gconf;
    double *gtotal;
    clover_cand *gcand;
    int32_t *flags; /* [n_layer][2] non-finite after the mixer / the MoE, then [n_layer][2] clover_cuda_route_d stats */
    void *tiles;
    float *kn, *vn; /* the new K, V rows before they go into the cache at *pos */
    int64_t *pos;   /* [1] the pass's first position (read by the kernels, so a graph can replay) */
} res_bufs;

/* n elements of elem bytes at base + *off (NULL when base is NULL), *off moved past them. */
static void *take(char *base, size_t *off, int64_t n, size_t elem) {
    void *p = base ? base + *off : NULL;
    *off += ((size_t)n * elem + 255) & ~(size_t)255;
    return p;
}

/* The buffers of a pass of T rows laid out from base (NULL: only measured); returns the bytes. */
static size_t res_layout(const clover_model *m, int64_t T, char *base, res_bufs *b) {
    const clover_hparams *hp = &m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t H = hp->n_embd, nh = hp->n_head, hd = hp->head_dim, E = hp->n_expert, P = T * hp->n_expert_used;
    const int64_t vdim = d.Hv * d.dv, Is = hp->n_ff_shexp, LM = T < RES_LM ? T : RES_LM;
    size_t off = 0;
    const size_t F = sizeof(float), I = sizeof(int32_t);
    /* what a pass uploads (res_pass: one copy from x to the end of flags), then what it reads
     * back (res_pass / res_select_read: one copy from flags on) */
    b->x = take(base, &off, T * H, F), b->idx = take(base, &off, T, I), b->gstart = take(base, &off, T + 1, I);
    b->pos = take(base, &off, 1, sizeof(int64_t)), b->flags = take(base, &off, 4 * (int64_t)hp->n_layer, I);
    b->gconf = take(base, &off, T, F), b->gid = take(base, &off, T, I), b->gtotal = take(base, &off, T, sizeof(double));
    b->gcand = take(base, &off, T * CLOVER_CUDA_TOP_K_MAX, sizeof(clover_cand));
    b->xn = take(base, &off, T * H, F), b->o = take(base, &off, T * H, F);
    b->qg = take(base, &off, T * nh * 2 * hd, F), b->att = take(base, &off, T * nh * hd, F);
    b->qkv = take(base, &off, T * d.C, F), b->cv = take(base, &off, T * d.C, F);
    b->z = take(base, &off, T * vdim, F), b->og = take(base, &off, T * vdim, F);
    b->b = take(base, &off, T * d.Hv, F), b->a = take(base, &off, T * d.Hv, F);
    b->probs = take(base, &off, T * E, F), b->wsel = take(base, &off, P, F), b->pw = take(base, &off, P, F);
    b->xg = take(base, &off, P * H, F), b->yg = take(base, &off, P * H, F);
    b->gt = take(base, &off, T * Is, F), b->up = take(base, &off, T * Is, F), b->ys = take(base, &off, T * H, F);
    b->sg = take(base, &off, T, F), b->logits = take(base, &off, LM * hp->n_vocab, F);
    b->sel = take(base, &off, P, I), b->prow = take(base, &off, P, I);
    b->pair = take(base, &off, P, I);
    b->tiles = take(base, &off, 3 * clover_cuda_route_tiles(P, E), I);
    b->kn = take(base, &off, T * hp->n_head_kv * hd, F), b->vn = take(base, &off, T * hp->n_head_kv * hd, F);
    return off;
}

/* The context's device scratch for a pass of T rows (grown when needed). */
static int res_workspace(clover_context *c, int64_t T, res_bufs *b, char *err, size_t err_size) {
    const size_t need = res_layout(c->m, T, NULL, b);
    if (need > c->res_cap) {
        clover_cuda_free(c->res_ws);
        c->res_ws = NULL;
        c->res_cap = 0;
        const int rc = clover_cuda_alloc(need, &c->res_ws, err, err_size);
        if (rc != CLOVER_OK) return rc;
        c->res_cap = need;
    }
    res_layout(c->m, T, c->res_ws, b);
    return CLOVER_OK;
}

/* y[i] [T][ne1] = w[i] x on the device for n <= 4 weights on the same input (rounded once). */
static int mm_n_d(fwd *f, int n, const clover_tensor *const *w, const float *x, int64_t T, float *const *y) {
    clover_cuda_weight cw[4];
    for (int i = 0; i < n; i++) cw[i] = cuda_weight(w[i]);
    return clover_cuda_matmul_d(n, cw, x, T, y, f->err, f->err_size);
}

/* y [T][ne1] = w x on the device. */
static int mm_d(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y) { return mm_n_d(f, 1, &w, x, T, &y); }

/* attention_layer on the device: the new K and V rows go into the device cache at *b->pos
 * (res_prepare made the cache ready). */
static int res_attention(fwd *f, const clover_layer *ly, const res_bufs *b) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t T = f->T, nh = hp->n_head, nkv = hp->n_head_kv, hd = hp->head_dim, kvd = nkv * hd;
    char *err = f->err;
    const size_t es = f->err_size;
    const size_t at = (size_t)ly->slot * (size_t)c->n_ctx * (size_t)kvd; /* every layer offloaded */
    char *kc = (char *)c->k_dev + at * kv_elem_bytes(c->type_k), *vc = (char *)c->v_dev + at * kv_elem_bytes(c->type_v);
    const clover_tensor *w[3] = {&ly->wq, &ly->wk, &ly->wv};
    float *y[3] = {b->qg, b->kn, b->vn};
    int rc;
    if ((rc = mm_n_d(f, 3, w, b->xn, T, y)) ||
        (rc = clover_cuda_head_norm_rope_d(b->qg, T, nh, nh * 2 * hd, 2 * hd, ly->dev.q_norm, hd, hp->rms_eps, b->pos,
                                           hp->rope_dim, hp->rope_theta, err, es)) ||
        (rc = clover_cuda_head_norm_rope_d(b->kn, T, nkv, kvd, hd, ly->dev.k_norm, hd, hp->rms_eps, b->pos, hp->rope_dim,
                                           hp->rope_theta, err, es)) ||
        (rc = clover_cuda_kv_store_d(kc, vc, kv_f16_bits(c), c->n_ctx, kvd, b->pos, b->kn, b->vn, T, err, es)) ||
        (rc = clover_cuda_attention_d(b->qg, kc, vc, kv_f16_bits(c), b->pos, T, nh, nkv, hd, f->mode == MODE_PREFIX,
                                      1.0f / sqrtf((float)hd), b->att, err, es)))
        return rc;
    return mm_d(f, &ly->wo, b->att, T, b->o);
}

/* The device verify record of GDN slot g (rec_dev, the layout of rec_qkv, rec_cv, rec_b, rec_a). */
static void rec_dev_slot(const clover_context *c, int g, float **qkv, float **cv, float **b, float **a) {
    const int64_t G = c->m->n_gdn, C = conv_channels(&c->m->hp), Hv = c->m->hp.ssm_dt_rank, cap = c->rec_cap;
    float *base = c->rec_dev;
    *qkv = base + (g * cap) * C;
    *cv = base + (G * cap + g * cap) * C;
    *b = base + 2 * G * cap * C + g * cap * Hv;
    *a = base + 2 * G * cap * C + (G * cap + g * cap) * Hv;
}

/* gdn_layer on the device; a recorded prefill (spec verify) keeps its inputs in rec_dev from
 * row rec_row. */
static int res_gdn(fwd *f, const clover_layer *ly, const res_bufs *b, int64_t rec_row) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t T = f->T, C = d.C;
    const int block = f->mode == MODE_BLOCK;
    char *err = f->err;
    const size_t es = f->err_size;
    int rc;
    float *state = (float *)c->gdn_dev + (size_t)ly->slot * (size_t)gdn_state_floats(hp); /* res_prepare put it there */
    float *hist = (float *)c->conv_dev + (size_t)ly->slot * (size_t)((d.K - 1) * C);
    const clover_tensor *w[4] = {&ly->wqkv, &ly->wz, &ly->wbeta, &ly->walpha};
    float *y[4] = {b->qkv, b->z, b->b, b->a};
    /* block mode: no beta and g (spec 3.3 step 4), the right taps */
    if ((rc = mm_n_d(f, block ? 2 : 4, w, b->xn, T, y)) ||
        (rc = clover_cuda_conv_d(ly->dev.conv, block ? ly->dev.conv_right : NULL, hist, b->qkv, T, C, (int32_t)d.K,
                                 b->cv, err, es)) ||
        (rc = clover_cuda_gdn_prep_d(b->cv, T, C, d.Hk, d.dk, 1e-6f, block ? NULL : b->b, block ? NULL : b->a,
                                     ly->dev.ssm_a, ly->dev.dt_bias, d.Hv, err, es)))
        return rc;
    if (block) {
        rc = clover_cuda_gdn_block_d(b->cv, T, d.Hk, d.Hv, d.dk, d.dv, C, state, ly->dev.bd_lambda, ly->dev.bd_beta0,
                                     ly->dev.bd_c, b->pos, b->og, err, es);
    } else {
        if (c->rec_on) {
            float *rq, *rc_, *rb, *ra;
            rec_dev_slot(c, ly->slot, &rq, &rc_, &rb, &ra);
            if ((rc = clover_cuda_copy_d(rq + rec_row * C, b->qkv, C * T, err, es)) ||
                (rc = clover_cuda_copy_d(rc_ + rec_row * C, b->cv, C * T, err, es)) ||
                (rc = clover_cuda_copy_d(rb + rec_row * d.Hv, b->b, d.Hv * T, err, es)) ||
                (rc = clover_cuda_copy_d(ra + rec_row * d.Hv, b->a, d.Hv * T, err, es)))
                return rc;
        }
        if ((rc = clover_cuda_conv_hist_d(hist, b->qkv, T, C, (int32_t)d.K, err, es))) return rc;
        rc = clover_cuda_gdn_d(gpu_gdn_forward(c, T), b->cv, b->b, b->a, T, d.Hk, d.Hv, d.dk, d.dv, C, state, b->og,
                               err, es);
    }
    if (rc || (rc = clover_cuda_gdn_out_d(b->og, b->z, ly->dev.ssm_norm, T, d.Hv, d.dv, hp->rms_eps, err, es)))
        return rc;
    return mm_d(f, &ly->wout, b->og, T, b->o);
}

/* The shared expert's products after its input products (on the GPU): gt = silu(gt) * up, ys =
 * down_sh gt. */
static int res_shared_rest(fwd *f, const clover_layer *ly, const res_bufs *b) {
    const int rc = clover_cuda_swiglu_d(b->gt, b->up, f->T * f->c->m->hp.n_ff_shexp, f->err, f->err_size);
    return rc ? rc : mm_d(f, &ly->down_sh, b->gt, f->T, b->ys);
}

/* The routed experts of a layer kept on the CPU (--n-cpu-moe) in a resident pass: the routed
 * pairs' inputs (b->xg, bucketed by expert) and the buckets (b->tiles) come down, the shared
 * expert's last launches (res_shared_rest) are queued so that the GPU runs them meanwhile, the
 * CPU runs each used expert over its bucket (cpu_experts, as moe_layer), and the outputs go up
 * to b->yg: two reads and one write a layer, the rest of the layer on the GPU. */
static int res_cpu_experts(fwd *f, const clover_layer *ly, const res_bufs *b) {
    clover_context *c = f->c;
    const clover_hparams *hp = &c->m->hp;
    const int64_t H = hp->n_embd, E = hp->n_expert, P = f->T * hp->n_expert_used, n_tiles = clover_cuda_route_tiles(P, E);
    char *err = f->err;
    const size_t es = f->err_size;
    const size_t rows_bytes = sizeof(float) * (size_t)(P * H);
    const size_t need = 2 * rows_bytes + sizeof(int32_t) * (size_t)(3 * n_tiles); /* xg, yg, tiles */
    int rc = CLOVER_OK;
    if (need > c->moe_host_cap) { /* page-locked staging, kept by the context (else plain memory) */
        moe_host_release(c);
        c->moe_host_pinned = clover_cuda_host_alloc(need, &c->moe_host, NULL, 0) == CLOVER_OK;
        if (!c->moe_host_pinned) c->moe_host = malloc(need);
        if (c->moe_host) c->moe_host_cap = need;
        else rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory (experts on the CPU: %zu bytes)", need);
    }
    float *xg = c->moe_host, *yg = xg ? xg + P * H : NULL;
    int32_t *tl = yg ? (int32_t *)(yg + P * H) : NULL;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    if (rc == CLOVER_OK && !start) rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory (experts on the CPU)");
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->tiles, 0, tl, sizeof(int32_t) * (size_t)(3 * n_tiles), err, es);
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->xg, 0, xg, rows_bytes, err, es);
    if (rc == CLOVER_OK) rc = res_shared_rest(f, ly, b);
    int32_t n_used = 0;
    for (int64_t i = 0; i < n_tiles && rc == CLOVER_OK; i++) { /* tiles (e, t0, nr): every bucket in expert order */
        const int32_t e = tl[3 * i], nr = tl[3 * i + 2];
        if (nr <= 0) continue;
        if (e < 0 || e >= E) {
            rc = clover_set_err(err, es, CLOVER_E_DEVICE, "routing on the GPU gave expert %d of %lld", e, (long long)E);
            break;
        }
        n_used += start[e + 1] == 0;
        start[e + 1] += nr;
    }
    for (int64_t e = 0; e < E && rc == CLOVER_OK; e++) start[e + 1] += start[e];
    if (rc == CLOVER_OK && start[E] != P)
        rc = clover_set_err(err, es, CLOVER_E_DEVICE, "routing on the GPU gave %lld pairs, not %lld", (long long)start[E],
                            (long long)P);
    if (rc == CLOVER_OK && cpu_experts(c, ly, hp->n_ff_exp, H, E, n_used, start, xg, yg))
        rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory in the routed experts (on the CPU)");
    if (rc == CLOVER_OK) rc = clover_cuda_write(b->yg, 0, yg, rows_bytes, err, es);
    free(start);
    return rc;
}

/* moe_layer on the device, its result added to x (flags: this layer's slots); routed experts
 * kept on the CPU through res_cpu_experts. */
static int res_moe(fwd *f, const clover_layer *ly, int il, const res_bufs *b) {
    const clover_hparams *hp = &f->c->m->hp;
    const int64_t T = f->T, H = hp->n_embd, E = hp->n_expert, k = hp->n_expert_used, P = T * k;
    char *err = f->err;
    const size_t es = f->err_size;
    const clover_cuda_weight g = cuda_weight(&ly->gate_exps), u = cuda_weight(&ly->up_exps),
                             dn = cuda_weight(&ly->down_exps);
    const clover_tensor *w[4] = {&ly->router, &ly->shexp_gate, &ly->gate_sh, &ly->up_sh};
    float *y[4] = {b->probs, b->sg, b->gt, b->up};
    int rc;
    if ((rc = mm_n_d(f, 4, w, b->xn, T, y)) || /* the router and the shared expert's input products */
        (rc = clover_cuda_route_d(b->probs, T, E, (int32_t)k, f->mode == MODE_BLOCK ? f->coreset_top_p : 0.0f, b->sel,
                                  b->wsel, b->prow, b->pw, b->pair, b->tiles,
                                  b->flags + 2 * hp->n_layer + 2 * il, err, es)) ||
        (rc = clover_cuda_gather_d(b->xn, b->prow, P, H, b->xg, err, es)))
        return rc;
    if (!ly->gate_exps.dev) rc = res_cpu_experts(f, ly, b);
    else if (!(rc = clover_cuda_experts_d(&g, &u, &dn, b->tiles, clover_cuda_route_tiles(P, E), P, b->xg, b->yg, err, es)))
        rc = res_shared_rest(f, ly, b);
    if (rc) return rc;
    return clover_cuda_moe_combine_d(b->x, b->yg, b->pw, b->pair, (int32_t)k, b->ys, b->sg, T, H, b->flags + 2 * il + 1,
                                     err, es);
}

/* The LM head of forward() on the device for the n rows whose indices res_pass uploaded to
 * b->idx (idx: the same on the host), groups of RES_LM rows; rows != NULL: row idx[i] of logits
 * is written, else rows from 0. */
static int res_lm_head(fwd *f, const res_bufs *b, const int32_t *idx, int64_t n, float *logits, const uint8_t *rows) {
    const clover_model *m = f->c->m;
    const int64_t H = m->hp.n_embd, V = m->hp.n_vocab;
    float *lg = rows ? malloc(sizeof(float) * (size_t)(RES_LM * V)) : NULL;
    int rc = lg || !rows ? CLOVER_OK : clover_set_err(f->err, f->err_size, CLOVER_E_NOMEM, "out of memory");
    for (int64_t g0 = 0; g0 < n && rc == CLOVER_OK; g0 += RES_LM) {
        const int64_t ng = n - g0 < RES_LM ? n - g0 : RES_LM;
        float *dst = rows ? lg : logits + g0 * V;
        if ((rc = clover_cuda_rmsnorm_d(b->x, H, b->idx + g0, m->output_norm_dev, H, ng, m->hp.rms_eps, b->xn, H, f->err,
                                        f->err_size)) ||
            (rc = mm_d(f, &m->output, b->xn, ng, b->logits)) ||
            (rc = clover_cuda_read(b->logits, 0, dst, sizeof(float) * (size_t)(ng * V), f->err, f->err_size)))
            break;
        for (int64_t i = 0; rows && i < ng; i++)
            memcpy(logits + (int64_t)idx[g0 + i] * V, lg + i * V, sizeof(float) * (size_t)V);
    }
    free(lg);
    return rc;
}

/* The selection's inputs (clover_block_forward_select): the n needed rows' ranges of edits into
 * start (n + 1, host: res_pass uploads them with the pass's other inputs), and the edits
 * themselves to ops_dev (grown as needed). */
static int res_select_upload(fwd *f, const int32_t *idx, int64_t n, int32_t *start) {
    clover_context *c = f->c;
    const select_req *g = f->sreq;
    const int64_t n_ops = g->ops_start[f->T];
    char *err = f->err;
    const size_t es = f->err_size;
    int rc = CLOVER_OK;
    for (int64_t i = 0; i < n; i++) start[i] = g->ops_start[idx[i]];
    start[n] = (int32_t)n_ops;
    if (n_ops > c->ops_cap) { /* doubling from 4096: a graph holds the address (graph_key) */
        const int64_t cap = n_ops > 2048 ? 2 * n_ops : 4096;
        clover_cuda_free(c->ops_dev), clover_cuda_free(c->pre_dev);
        c->ops_dev = c->pre_dev = NULL;
        c->ops_cap = 0;
        if ((rc = clover_cuda_alloc(sizeof(clover_logit_op) * (size_t)cap, &c->ops_dev, err, es)) == CLOVER_OK &&
            (rc = clover_cuda_alloc(sizeof(float) * (size_t)cap, &c->pre_dev, err, es)) == CLOVER_OK)
            c->ops_cap = cap;
    }
    if (rc == CLOVER_OK && n_ops) rc = clover_cuda_write(c->ops_dev, 0, g->ops, sizeof(clover_logit_op) * (size_t)n_ops, err, es);
    return rc;
}

/* res_lm_head with the selection on the GPU, the launches only (res_select_upload before,
 * res_select_read after): per needed row an id and a confidence (k 0) or k candidates, and for
 * top-p alone the row's weight (the edited logits stay in b->logits: n <= RES_LM). */
static int res_select_run(fwd *f, const res_bufs *b, int64_t n) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    const select_req *g = f->sreq;
    const clover_sampler_params *sp = g->sp;
    const int64_t H = m->hp.n_embd, K = g->k, V = m->hp.n_vocab;
    const float rp = sp->repetition_penalty, fp = sp->frequency_penalty, pp = sp->presence_penalty;
    int rc = CLOVER_OK;
    for (int64_t g0 = 0; g0 < n && rc == CLOVER_OK; g0 += RES_LM) {
        const int64_t ng = n - g0 < RES_LM ? n - g0 : RES_LM;
        if ((rc = clover_cuda_rmsnorm_d(b->x, H, b->idx + g0, m->output_norm_dev, H, ng, m->hp.rms_eps, b->xn, H, f->err,
                                        f->err_size)) ||
            (rc = mm_d(f, &m->output, b->xn, ng, b->logits)))
            break;
        rc = K ? clover_cuda_top_k_d(b->logits, ng, V, c->ops_dev, b->gstart + g0, rp, fp, pp, sp->mask_token_id,
                                     (int32_t)K, b->gcand + g0 * K, b->gconf + g0, g->pre ? c->pre_dev : NULL, f->err,
                                     f->err_size)
               : clover_cuda_greedy_d(b->logits, ng, V, c->ops_dev, b->gstart + g0, rp, fp, pp, sp->mask_token_id,
                                      b->gid + g0, b->gconf + g0, f->err, f->err_size);
        if (rc == CLOVER_OK && g->total)
            rc = clover_cuda_row_total_d(b->logits, ng, V, sp->mask_token_id, b->gcand + g0 * K, (int32_t)K,
                                         sp->temperature, b->gtotal + g0, f->err, f->err_size);
    }
    return rc;
}

/* The selection's results into the request's id / conf or cand rows (and pre), and the pass's
 * flags ([4 n_layer]) into flags, in one read; rows (when not
 * NULL): only the rows t with rows[t] != 0 are wanted (a graph's pass selects on every row). For
 * top-p alone, a row whose top-p prefix does not end within its candidates gets total 0 and its
 * edited logits from b->logits instead (the CPU sampler then takes the whole row). */
static int res_select_read(fwd *f, const res_bufs *b, const int32_t *idx, int64_t n, const uint8_t *rows,
                           int32_t *flags) {
    const select_req *g = f->sreq;
    const int64_t K = g->k, n_ops = g->ops_start[f->T], V = f->c->m->hp.n_vocab, L = f->c->m->hp.n_layer;
    char *err = f->err;
    const size_t es = f->err_size;
    /* one read from flags to the end of the last field needed (res_layout's order) */
    const char *end = K          ? (const char *)(b->gcand + n * K)
                      : g->total ? (const char *)(b->gtotal + n)
                                 : (const char *)(b->gid + n);
    const size_t bytes = (size_t)(end - (const char *)b->flags);
    char *down = malloc(bytes);
    int rc = down ? CLOVER_OK : clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory");
    if (rc == CLOVER_OK && g->total && n > RES_LM) /* the callers keep to this (CLOVER_SELECT_TOTAL_MAX_ROWS) */
        rc = clover_set_err(err, es, CLOVER_E_ARG, "top-p selection of %lld rows: at most %d", (long long)n, (int)RES_LM);
    if (rc == CLOVER_OK) rc = clover_cuda_read(b->flags, 0, down, bytes, err, es);
#define AT(field, type) ((type *)(down + ((const char *)b->field - (const char *)b->flags)))
    const float *conf = down ? AT(gconf, float) : NULL;
    const int32_t *id = down ? AT(gid, int32_t) : NULL;
    const clover_cand *cand = down && K ? AT(gcand, clover_cand) : NULL;
    const double *total = down && g->total ? AT(gtotal, double) : NULL;
#undef AT
    if (rc == CLOVER_OK) memcpy(flags, down, sizeof(int32_t) * (size_t)(4 * L));
    for (int64_t il = 0; il < L && rc == CLOVER_OK; il++)
        if (flags[2 * il] || flags[2 * il + 1]) { /* a non-finite layer output: res_pass names it */
            free(down);
            return CLOVER_OK;
        }
    if (rc == CLOVER_OK && K && g->pre && n_ops)
        rc = clover_cuda_read(f->c->pre_dev, 0, g->pre, sizeof(float) * (size_t)n_ops, err, es);
    for (int64_t i = 0; i < n && rc == CLOVER_OK; i++) {
        if (rows && !rows[idx[i]]) continue;
        if (!isfinite(conf[i])) /* a NaN or infinite logit: a non-finite softmax sum, or k_top_k's flag */
            rc = clover_set_err(err, es, CLOVER_E_NUMERIC, "non-finite logit from the LM head (output.weight), row "
                                "%lld (on the GPU)", (long long)idx[i]);
        else if (K)
            memcpy(g->cand + (int64_t)idx[i] * K, cand + i * K, sizeof(clover_cand) * (size_t)K);
        else
            g->id[idx[i]] = id[i], g->conf[idx[i]] = conf[i];
        if (rc != CLOVER_OK || !total) continue;
        g->total[idx[i]] = clover_top_p_in_cands(cand + i * K, (int32_t)K, g->sp, total[i]) ? total[i] : 0.0;
        if (g->total[idx[i]] == 0.0) {
            f->c->n_full_rows++;
            rc = clover_cuda_read(b->logits, sizeof(float) * (size_t)(i * V), g->full + (idx[i] - g->full_row0) * V,
                                  sizeof(float) * (size_t)V, err, es);
        }
    }
    free(down);
    return rc;
}

/* The host side of a resident pass before its launches: the device KV cache allocated and (for a
 * context used on the CPU before residency) caught up, the GDN states and conv history on the
 * device, the attention layers' row counts. */
static int res_prepare(fwd *f) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    int rc = kv_dev_alloc(c, f->err, f->err_size);
    for (int il = 0; il < m->hp.n_layer && rc == CLOVER_OK; il++) {
        const clover_layer *ly = &m->layers[il];
        if (!ly->is_attn) {
            rc = gdn_slot_to_device(c, ly->slot, f->err, f->err_size);
            continue;
        }
        if (c->kv_host) rc = kv_dev_catch_up(c, ly->slot, f->pos0, f->err, f->err_size);
        if (rc == CLOVER_OK) c->kv_dev_rows[ly->slot] = f->pos0 + f->T;
    }
    return rc;
}

/* The launches of a resident pass: the layers, then with a selection request the LM head and the
 * selection on the n rows of b->idx (else res_lm_head follows, reading its logits back). */
static int res_run(fwd *f, const res_bufs *b, int64_t rec_row, int64_t n) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    const clover_hparams *hp = &m->hp;
    const int64_t T = f->T, H = hp->n_embd, L = hp->n_layer;
    char *err = f->err;
    const size_t es = f->err_size;
    int rc = CLOVER_OK;
    for (int il = 0; il < L && rc == CLOVER_OK; il++) {
        const clover_layer *ly = &m->layers[il];
        if ((rc = check_abort(f, il)) ||
            (rc = clover_cuda_rmsnorm_d(b->x, H, NULL, ly->dev.attn_norm, H, T, hp->rms_eps, b->xn, H, err, es)) ||
            (rc = ly->is_attn ? res_attention(f, ly, b) : res_gdn(f, ly, b, rec_row)) ||
            (rc = clover_cuda_add_d(b->x, b->o, T * H, b->flags + 2 * il, err, es)) ||
            (rc = clover_cuda_rmsnorm_d(b->x, H, NULL, ly->dev.post_norm, H, T, hp->rms_eps, b->xn, H, err, es)))
            break;
        rc = res_moe(f, ly, il, b);
    }
    if (rc == CLOVER_OK && n && f->sreq && !(rc = check_abort(f, (int)L))) rc = res_select_run(f, b, n);
    return rc;
}

/* What a CUDA graph of a pass depends on beyond the device memory it reads: when any of it
 * changes, the graph is recorded again. */
typedef struct {
    const void *ws, *ops, *pre, *k, *v, *gdn, *conv, *rec;
    int64_t scratch_epoch, model_epoch, T, n;
    int32_t sel, k_cand, mask, mode, rec_on, rec_cap, total, mma;
    float rp, fp, pp, coreset_top_p, temperature;
} graph_key;
_Static_assert(sizeof(graph_key) <= sizeof(((clover_context *)0)->graph[0].key), "clover_context.graph key too small");

static graph_key graph_key_of(const fwd *f, int64_t n) {
    const clover_context *c = f->c;
    graph_key k;
    memset(&k, 0, sizeof k); /* padding too: keys are compared with memcmp */
    k.ws = c->res_ws, k.k = c->k_dev, k.v = c->v_dev, k.gdn = c->gdn_dev, k.conv = c->conv_dev;
    k.rec = c->rec_on ? c->rec_dev : NULL, k.rec_on = c->rec_on, k.rec_cap = c->rec_on ? c->rec_cap : 0;
    k.scratch_epoch = clover_cuda_scratch_epoch(), k.model_epoch = c->m->dev_epoch, k.T = f->T;
    k.mode = f->mode, k.mma = clover_cuda_mma(), k.coreset_top_p = f->coreset_top_p;
    if (!f->sreq) return k; /* the layers only (whatever rows want logits): the LM head runs after the graph */
    const clover_sampler_params *sp = f->sreq->sp;
    k.sel = 1, k.n = n, k.ops = c->ops_dev, k.pre = f->sreq->pre ? c->pre_dev : NULL;
    k.k_cand = f->sreq->k, k.mask = sp->mask_token_id;
    k.rp = sp->repetition_penalty, k.fp = sp->frequency_penalty, k.pp = sp->presence_penalty;
    k.total = f->sreq->total != NULL, k.temperature = f->sreq->total ? sp->temperature : 0.0f;
    return k;
}

/* res_run through a CUDA graph (passes of at most RES_LM rows with the selection on the GPU: ar's
 * decode steps, diffusion's denoising passes and commits, spec's drafts and verifies; and
 * one-row passes that return logits, as llama.cpp's decode of one token, the LM head then
 * running after the graph): the
 * first pass with a new key runs plainly (its scratch grows then), the next one records a graph,
 * and the following ones replay it. The context keeps the graphs of its last four keys, so a
 * diffusion block's commit and denoising passes keep theirs. CLOVER_CUDA_GRAPHS=0 turns this
 * off. */
static int res_run_graph(fwd *f, const res_bufs *b, int64_t n) {
    clover_context *c = f->c;
    const int N = (int)(sizeof c->graph / sizeof c->graph[0]);
    graph_key key = graph_key_of(f, n);
    int i = 0, rc;
    while (i < N && !(c->graph[i].used && memcmp(&key, c->graph[i].key, sizeof key) == 0)) i++;
    if (i < N) { /* seen before: record it if not yet, then replay */
        c->graph[i].used = ++c->graph_clock;
        if (!c->graph[i].exec) {
            rc = clover_cuda_capture_begin(f->err, f->err_size);
            if (rc == CLOVER_OK) {
                rc = res_run(f, b, 0, n);
                const int rc2 = clover_cuda_capture_end(&c->graph[i].exec, f->err, f->err_size);
                if (rc == CLOVER_OK) rc = rc2;
            }
            if (rc != CLOVER_OK) {
                clover_cuda_graph_free(c->graph[i].exec);
                c->graph[i].exec = NULL;
                if (rc == CLOVER_E_ABORTED) return rc;
                c->graphs = 0; /* the device cannot record this: plain passes from now on */
                return res_run(f, b, 0, n);
            }
        }
        if ((rc = check_abort(f, 0)) == CLOVER_OK &&
            (rc = clover_cuda_graph_launch(c->graph[i].exec, f->err, f->err_size)) == CLOVER_OK)
            c->n_graph_launches++;
        return rc;
    }
    rc = res_run(f, b, 0, n); /* first seen: plainly, then its key (with the scratch it grew) in the oldest slot */
    if (rc != CLOVER_OK) return rc;
    for (int j = i = 0; j < N; j++)
        if (c->graph[j].used < c->graph[i].used) i = j;
    clover_cuda_graph_free(c->graph[i].exec);
    c->graph[i].exec = NULL;
    key = graph_key_of(f, n);
    memcpy(c->graph[i].key, &key, sizeof key);
    c->graph[i].used = ++c->graph_clock;
    return CLOVER_OK;
}

/* One resident pass over f->T rows (a prefill's rows from rec_row of its recording). */
static int res_pass(fwd *f, const int32_t *tokens, int64_t rec_row, float *logits, int64_t logit_row0,
                    const uint8_t *rows) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    const clover_hparams *hp = &m->hp;
    const int64_t T = f->T, H = hp->n_embd, L = hp->n_layer, V = hp->n_vocab;
    char *err = f->err;
    const size_t es = f->err_size;
    res_bufs b;
    int rc = res_workspace(c, T, &b, err, es);
    if (rc == CLOVER_OK) rc = res_prepare(f);
    if (rc) return rc;
    /* the upload first, in one copy (it waits for the device) laid out as b from x to the end of
     * flags: the embedding rows (dequantised here, a row each, as the CPU), the LM head's row
     * list, the selection's ranges of sampler edits per row, the position, cleared flags */
    const size_t up_bytes = (size_t)((char *)(b.flags + 4 * L) - (char *)b.x);
    char *up = calloc(1, up_bytes);
    float *x = (float *)up;
    int32_t *flags = up ? (int32_t *)(up + ((char *)b.flags - (char *)b.x)) : NULL;
    int32_t *idx = up ? (int32_t *)(up + ((char *)b.idx - (char *)b.x)) : NULL;
    int64_t n = 0;
    if (!up) rc = clover_set_err(err, es, CLOVER_E_NOMEM, "out of memory in forward (%lld rows)", (long long)T);
    else memcpy(up + ((char *)b.pos - (char *)b.x), &f->pos0, sizeof(int64_t));
    /* through a graph, a block pass selects on every row (the same launches each time), and only
     * the rows asked for are read; without a selection only one-row passes (a decode step that
     * returns logits) and passes without logits (a diffusion commit) take one: a prompt's length
     * varies, and its graph would push out the decoders' */
    const int graph = c->graphs && (f->sreq || T == 1 || !logits) && T <= RES_LM && rec_row == 0 &&
                      !m->cpu_experts; /* no host work inside */
    const int64_t erow = clover_row_nbytes(m->tok_embd.type, H);
    const int all_rows = graph && f->sreq && f->mode == MODE_BLOCK;
    for (int64_t t = 0; t < T && rc == CLOVER_OK; t++) {
        clover_to_f32(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)tokens[t] * erow, x + t * H, H);
        if ((logits || f->sreq) && (rows && !all_rows ? rows[t] != 0 : t >= logit_row0))
            idx[n++] = (int32_t)t;
    }
    if (rc == CLOVER_OK && n && f->sreq)
        rc = res_select_upload(f, idx, n, (int32_t *)(up + ((char *)b.gstart - (char *)b.x)));
    if (rc == CLOVER_OK) rc = clover_cuda_write(b.x, 0, up, up_bytes, err, es);
    if (rc == CLOVER_OK && graph) {
        pthread_mutex_lock(&g_graph_mu);
        rc = g_n_gpu_contexts == 1 ? res_run_graph(f, &b, n) : res_run(f, &b, rec_row, n);
        pthread_mutex_unlock(&g_graph_mu);
    } else if (rc == CLOVER_OK) {
        rc = res_run(f, &b, rec_row, n);
    }
    if (rc == CLOVER_OK && n && !f->sreq && !(rc = check_abort(f, (int)L))) rc = res_lm_head(f, &b, idx, n, logits, rows);
    /* the flags after the logits, or with the selection (no wait in between); a non-finite layer
     * output is named first */
    if (rc == CLOVER_OK && n && f->sreq) rc = res_select_read(f, &b, idx, n, rows, flags);
    else if (rc == CLOVER_OK) rc = clover_cuda_read(b.flags, 0, flags, sizeof(int32_t) * (size_t)(4 * L), err, es);
    for (int il = 0; il < L && rc == CLOVER_OK; il++)
        if (flags[2 * il] || flags[2 * il + 1])
            rc = clover_set_err(err, es, CLOVER_E_NUMERIC, "non-finite value after layer %d (blk.%d) %s (on the GPU, "
                                "%lld rows)", il, il, flags[2 * il] ? (m->layers[il].is_attn ? "attention" : "gated deltanet")
                                                                   : "moe", (long long)T);
    if (rc == CLOVER_OK && logits && !rows && n) rc = check_finite(f, logits, n * V, -1, NULL);
    for (int64_t i = 0; logits && rows && i < n && rc == CLOVER_OK; i++)
        rc = check_finite(f, logits + idx[i] * V, V, -1, NULL);
    for (int il = 0; il < L && rc == CLOVER_OK; il++) {
        if (f->n_experts_out) f->n_experts_out[il] = flags[2 * L + 2 * il];
        if (f->mode == MODE_BLOCK) c->nexp_full[il] = flags[2 * L + 2 * il + 1];
    }
    free(up);
    return rc;
}

/* Rows of one prefill pass on the CPU path (CPU_ROWS; PASS_ROWS_GPU where some weights are on
 * the GPU, whose per-product scratch grows with the rows), as llama.cpp's n_batch: a long
 * prompt's activations, attention and expert buffers stay bounded. */
enum { CPU_ROWS = 2048, PASS_ROWS_GPU = RES_ROWS };

/* One forward pass on the CPU path (products on the GPU where offloaded): embed -> layers ->
 * N1p -> lm_head on rows [logit_row0, T). rows: when not NULL, the LM head runs only on rows t
 * with rows[t] != 0 (row t of logits is written, others are left as they are); else on rows
 * logit_row0.. (written from row 0). */
static int cpu_forward(fwd *f, const int32_t *tokens, float *logits, int64_t logit_row0, const uint8_t *rows) {
    clover_context *c = f->c;
    const clover_model *m = c->m;
    const clover_hparams *hp = &m->hp;
    const int64_t T = f->T, H = hp->n_embd;
    float *x = malloc(sizeof(float) * (size_t)(T * H));
    float *xn = malloc(sizeof(float) * (size_t)(T * H));
    float *o = malloc(sizeof(float) * (size_t)(T * H));
    int rc = CLOVER_E_NOMEM;
    f->gpu_rc = 0; /* a step that fails may say why (the GPU's products) */
    if (f->err && f->err_size) f->err[0] = '\0';
    if (!x || !xn || !o) goto done;
    const int64_t erow = clover_row_nbytes(m->tok_embd.type, H);
    for (int64_t t = 0; t < T; t++)
        clover_to_f32(m->tok_embd.type, (const char *)m->tok_embd.data + (size_t)tokens[t] * erow, x + t * H, H);
    for (int il = 0; il < hp->n_layer; il++) {
        const clover_layer *ly = &m->layers[il];
        if ((rc = check_abort(f, il))) goto done;
        for (int64_t t = 0; t < T; t++) rmsnorm(xn + t * H, x + t * H, ly->attn_norm, H, hp->rms_eps);
        rc = ly->is_attn ? attention_layer(f, ly, xn, o) : gdn_layer(f, ly, xn, o);
        if (rc) goto done;
        for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
        if ((rc = check_finite(f, x, T * H, il, ly->is_attn ? "attention" : "gated deltanet"))) goto done;
        for (int64_t t = 0; t < T; t++) rmsnorm(xn + t * H, x + t * H, ly->post_norm, H, hp->rms_eps);
        if ((rc = moe_layer(f, ly, il, xn, o))) goto done;
        for (int64_t i = 0; i < T * H; i++) x[i] += o[i];
        if ((rc = check_finite(f, x, T * H, il, "moe"))) goto done;
    }
    if (logits && (rc = check_abort(f, hp->n_layer))) goto done;
    if (logits && rows) { /* gather the needed rows, one LM head pass, scatter */
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            if (rows[t]) rmsnorm(xn + n++ * H, x + t * H, m->output_norm, H, hp->rms_eps);
        float *lg = n ? malloc(sizeof(float) * (size_t)(n * hp->n_vocab)) : NULL;
        rc = n && !lg ? CLOVER_E_NOMEM : CLOVER_OK;
        if (n && lg && matmul(f, &m->output, xn, n, lg)) rc = CLOVER_E_NOMEM;
        for (int64_t t = 0, k = 0; t < T && rc == CLOVER_OK; t++)
            if (rows[t]) memcpy(logits + t * hp->n_vocab, lg + k++ * hp->n_vocab, sizeof(float) * (size_t)hp->n_vocab);
        if (rc == CLOVER_OK && n) rc = check_finite(f, lg, n * hp->n_vocab, -1, NULL);
        free(lg);
    } else if (logits) {
        for (int64_t t = logit_row0; t < T; t++) rmsnorm(xn + t * H, x + t * H, m->output_norm, H, hp->rms_eps);
        rc = matmul(f, &m->output, xn + logit_row0 * H, T - logit_row0, logits) ? CLOVER_E_NOMEM : CLOVER_OK;
        if (rc == CLOVER_OK) rc = check_finite(f, logits, (T - logit_row0) * hp->n_vocab, -1, NULL);
    }
done:
    if (rc == CLOVER_E_NOMEM && f->gpu_rc) rc = f->gpu_rc;
    if (rc == CLOVER_E_NOMEM && !(f->err && f->err_size && f->err[0]))
        clover_set_err(f->err, f->err_size, rc, "out of memory in forward (%lld rows)", (long long)T);
    free(x), free(xn), free(o);
    return rc;
}

/* embed -> layers -> N1p -> lm_head on rows [logit_row0, T) (rows: as cpu_forward's). Block
 * passes run whole; a prefill (causal, so consecutive passes equal one) in passes of at most
 * RES_ROWS rows on a resident model (its verify record from row r0 of each), CPU_ROWS or
 * PASS_ROWS_GPU on the CPU path (one pass while recording: the record starts at row 0). */
static int forward(fwd *f, const int32_t *tokens, float *logits, int64_t logit_row0, const uint8_t *rows) {
    clover_context *c = f->c;
    if (c->m->gpu_bytes && !c->gpu_counted) { /* its first launches: count it (g_graph_mu) */
        pthread_mutex_lock(&g_graph_mu);
        g_n_gpu_contexts++;
        c->gpu_counted = 1;
        pthread_mutex_unlock(&g_graph_mu);
    }
    const int res = c->m->resident;
    const int64_t max_rows = res ? RES_ROWS : c->m->gpu_bytes ? PASS_ROWS_GPU : CPU_ROWS;
    if (f->mode == MODE_BLOCK || f->T <= max_rows || (!res && c->rec_on)) {
        c->n_passes++;
        return res ? res_pass(f, tokens, 0, logits, logit_row0, rows) : cpu_forward(f, tokens, logits, logit_row0, rows);
    }
    const int64_t T = f->T, V = c->m->hp.n_vocab;
    int rc = CLOVER_OK;
    for (int64_t r0 = 0; r0 < T && rc == CLOVER_OK; r0 += max_rows) {
        fwd g = *f;
        g.T = T - r0 < max_rows ? T - r0 : max_rows;
        g.pos0 = f->pos0 + r0;
        const int with_logits = logits && logit_row0 < r0 + g.T;
        const int64_t row0 = logit_row0 > r0 ? logit_row0 - r0 : 0; /* the pass's first logits row */
        float *lg = with_logits ? logits + (r0 + row0 - logit_row0) * V : NULL;
        c->n_passes++;
        rc = res ? res_pass(&g, tokens + r0, r0, lg, row0, NULL) : cpu_forward(&g, tokens + r0, lg, row0, NULL);
    }
    return rc;
}

/* A selection request's model and outputs: resident, and id and conf (k 0) or cand (k > 0). */
static int check_select(const clover_context *c, const clover_sampler_params *sp, int32_t k, const int32_t *id,
                        const float *conf, const clover_cand *cand, const char *what, char *err, size_t err_size) {
    if (!c->m->resident)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "%s: the model's forwards are not resident on the GPU", what);
    const int32_t ids = clover_cand_ids(c->m->hp.n_vocab, sp->mask_token_id);
    if (k < 0 || k > CLOVER_CUDA_TOP_K_MAX || k > ids || (k == 0 && sp->temperature > 0.0f))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "k: %d candidates at temperature %g: needs 0 (temperature "
                              "0) or [1, %d] and at most the %d ids other than the mask (%s)", k, sp->temperature,
                              (int)CLOVER_CUDA_TOP_K_MAX, ids, what);
    if (k ? !cand : !id || !conf) return clover_set_err(err, err_size, CLOVER_E_ARG, "%s: NULL output", what);
    return CLOVER_OK;
}

/* A top-p selection's extra outputs (total, full; both or neither): k candidates a row above
 * temperature 0, on at most CLOVER_SELECT_TOTAL_MAX_ROWS rows (n_rows: those the pass selects). */
static int check_total(const clover_sampler_params *sp, int32_t k, const double *total, const float *full,
                       int64_t n_rows, const char *what, char *err, size_t err_size) {
    if (!total && !full) return CLOVER_OK;
    if (!total || !full || k < 1 || !(sp->temperature > 0.0f) || n_rows > CLOVER_SELECT_TOTAL_MAX_ROWS)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "%s: total and logits need each other, k > 0 candidates, "
                              "temperature > 0 and at most %d rows (%lld)", what, (int)CLOVER_SELECT_TOTAL_MAX_ROWS,
                              (long long)n_rows);
    return CLOVER_OK;
}

/* ops_start of a selection request: non-decreasing from 0, empty ranges for the rows not selected
 * (rows[t] == 0; rows NULL: all but the last). */
static int check_ops_start(const int32_t *ops_start, const uint8_t *rows, int32_t n, char *err, size_t err_size) {
    if (n <= 0) return CLOVER_OK;
    if (ops_start[0] != 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "ops_start[0]: %d must be 0", ops_start[0]);
    for (int32_t t = 0; t < n; t++) {
        const int selected = rows ? rows[t] != 0 : t == n - 1;
        if (ops_start[t + 1] < ops_start[t] || (!selected && ops_start[t + 1] != ops_start[t]))
            return clover_set_err(err, err_size, CLOVER_E_ARG, "ops_start[%d]: %d after %d (must not decrease, and "
                                  "rows without selection have no edits)", t + 1, ops_start[t + 1], ops_start[t]);
    }
    return CLOVER_OK;
}

static int prefill(clover_context *c, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits,
                   const select_req *sreq, char *err, size_t err_size) {
    if (!c || !tokens) return clover_set_err(err, err_size, CLOVER_E_ARG, "context or tokens is NULL");
    if (n <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_tokens: %d must be > 0", n);
    if ((int64_t)c->n_past + n > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "n_tokens: %d past %d cached exceeds n_ctx %d", n,
                              c->n_past, c->n_ctx);
    int rc = check_tokens(c->m, tokens, n, err, err_size);
    if (rc) return rc;
    if (c->rec_on && (c->rec_n > 0 || n > c->rec_cap))
        return clover_set_err(err, err_size, CLOVER_E_STATE, "n_tokens: %d, but the checkpoint records one prefill of "
                              "at most %d tokens", n, c->rec_cap);
    fwd f = {c, MODE_PREFIX, n, c->n_past, 1.0f, NULL, err, err_size, sreq, 0};
    rc = forward(&f, tokens, logits, all_logits ? 0 : n - 1, NULL);
    if (rc == CLOVER_OK) {
        c->n_past += n;
        if (c->rec_on) c->rec_n = n;
    } else {
        clover_context_reset(c); /* caches are partly written: a failed prefill leaves none */
    }
    return rc;
}

int clover_prefill(clover_context *c, const int32_t *tokens, int32_t n, float *logits, int32_t all_logits,
                   char *err, size_t err_size) {
    return prefill(c, tokens, n, logits, all_logits, NULL, err, err_size);
}

int clover_prefill_select(clover_context *c, const int32_t *tokens, int32_t n, int32_t all_rows,
                          const clover_logit_op *ops, const int32_t *ops_start, const clover_sampler_params *sp,
                          int32_t K, int32_t *id, float *conf, clover_cand *cand, double *total, float *logits,
                          char *err, size_t err_size) {
    if (!c || !ops_start || !sp || (n > 0 && ops_start[n] > 0 && !ops))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "prefill_select: NULL argument");
    int rc = check_select(c, sp, K, id, conf, cand, "prefill_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_total(sp, K, total, logits, all_rows ? n : 1, "prefill_select", err, err_size);
    if (rc) return rc;
    if (n <= 0 || n > RES_ROWS)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "n_tokens: %d outside [1, %d] for prefill_select", n,
                              (int)RES_ROWS);
    uint8_t *rows = malloc((size_t)n);
    int32_t *ids = malloc(sizeof(int32_t) * (size_t)n);
    float *confs = malloc(sizeof(float) * (size_t)n);
    clover_cand *cands = K ? malloc(sizeof(clover_cand) * (size_t)n * (size_t)K) : NULL;
    double *totals = total ? malloc(sizeof(double) * (size_t)n) : NULL;
    rc = rows && ids && confs && (cands || !K) && (totals || !total)
             ? CLOVER_OK
             : clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
    for (int32_t t = 0; t < n && rc == CLOVER_OK; t++) rows[t] = all_rows || t == n - 1;
    if (rc == CLOVER_OK) rc = check_ops_start(ops_start, rows, n, err, err_size);
    const int32_t t0 = all_rows ? 0 : n - 1; /* the rows handed back, from row t0 */
    if (rc == CLOVER_OK) {
        const select_req g = {ops, ops_start, sp, K, ids, confs, cands, NULL, totals, logits, t0};
        rc = prefill(c, tokens, n, NULL, all_rows, &g, err, err_size);
    }
    if (rc == CLOVER_OK && K) memcpy(cand, cands + (int64_t)t0 * K, sizeof(clover_cand) * (size_t)(n - t0) * (size_t)K);
    if (rc == CLOVER_OK && total) memcpy(total, totals + t0, sizeof(double) * (size_t)(n - t0));
    for (int32_t t = t0; t < n && rc == CLOVER_OK && !K; t++) id[t - t0] = ids[t], conf[t - t0] = confs[t];
    free(rows), free(ids), free(confs), free(cands), free(totals);
    return rc;
}

int clover_context_save_state(clover_context *c, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (c->n_past <= 0) return clover_set_err(err, err_size, CLOVER_E_STATE, "save_state: the context is empty");
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn;
    const size_t state_n = (size_t)(G * gdn_state_floats(hp)), conv_n = (size_t)(G * (hp->ssm_d_conv - 1) * conv_channels(hp));
    if (!c->keep_state) c->keep_state = malloc(sizeof(float) * state_n + 1);
    if (!c->keep_conv) c->keep_conv = malloc(sizeof(float) * conv_n + 1);
    if (!c->keep_state || !c->keep_conv) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the saved state");
    int rc = gdn_to_host(c, err, err_size);
    if (rc != CLOVER_OK) return rc;
    memcpy(c->keep_state, c->gdn_state, sizeof(float) * state_n);
    memcpy(c->keep_conv, c->conv_state, sizeof(float) * conv_n);
    c->keep_n = c->n_past;
    return CLOVER_OK;
}

int32_t clover_context_restore_state(clover_context *c, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (c->keep_n <= 0 || c->keep_n > c->n_past)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "restore_state: no saved state (or the context was reset)");
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn;
    memcpy(c->gdn_state, c->keep_state, sizeof(float) * (size_t)(G * gdn_state_floats(hp)));
    if (c->gdn_on_dev) memset(c->gdn_on_dev, 0, (size_t)G); /* the host copy is current */
    memcpy(c->conv_state, c->keep_conv, sizeof(float) * (size_t)(G * (hp->ssm_d_conv - 1) * conv_channels(hp)));
    c->n_past = c->keep_n;
    c->rec_on = 0;
    c->rec_n = 0;
    atomic_store(&c->abort_req, 0);
    return c->keep_n;
}

int clover_context_checkpoint(clover_context *c, int32_t n_max, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (n_max <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "n_max: %d must be > 0", n_max);
    const clover_hparams *hp = &c->m->hp;
    const int64_t G = c->m->n_gdn, C = conv_channels(hp), Hv = hp->ssm_dt_rank;
    const int64_t state_n = G * gdn_state_floats(hp), conv_n = G * (hp->ssm_d_conv - 1) * C;
    if (n_max > c->rec_cap || (c->m->resident && !c->rec_dev)) {
        if ((uint64_t)n_max * (uint64_t)(G ? G : 1) * (uint64_t)C > SIZE_MAX / sizeof(float) / 4)
            return clover_set_err(err, err_size, CLOVER_E_NOMEM, "n_max: %d tokens of recording overflow", n_max);
        free(c->rec_qkv), free(c->rec_cv), free(c->rec_b), free(c->rec_a);
        clover_cuda_free(c->rec_dev);
        c->rec_qkv = c->rec_cv = c->rec_b = c->rec_a = NULL;
        c->rec_dev = NULL;
        c->rec_cap = 0;
        if (c->m->resident) { /* the resident forward records on the device (rec_dev_slot) */
            int rc = clover_cuda_alloc(sizeof(float) * (size_t)(G * n_max * 2 * (C + Hv)), &c->rec_dev, err, err_size);
            if (rc != CLOVER_OK) return rc;
            c->rec_cap = n_max;
        } else {
            c->rec_qkv = malloc(sizeof(float) * (size_t)(G * n_max * C) + 1);
            c->rec_cv = malloc(sizeof(float) * (size_t)(G * n_max * C) + 1);
            c->rec_b = malloc(sizeof(float) * (size_t)(G * n_max * Hv) + 1);
            c->rec_a = malloc(sizeof(float) * (size_t)(G * n_max * Hv) + 1);
            c->rec_cap = c->rec_qkv && c->rec_cv && c->rec_b && c->rec_a ? n_max : 0;
            if (!c->rec_cap) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the verify record");
        }
    }
    if (!c->snap_state) c->snap_state = malloc(sizeof(float) * (size_t)state_n + 1);
    if (!c->snap_conv) c->snap_conv = malloc(sizeof(float) * (size_t)conv_n + 1);
    if (!c->snap_state || !c->snap_conv) return clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory for the checkpoint");
    int rc = CLOVER_OK;
    for (int g = 0; g < G && c->m->resident && rc == CLOVER_OK; g++) rc = gdn_slot_to_device(c, g, err, err_size);
    if (rc == CLOVER_OK) rc = gdn_snapshot_on_device(c, err, err_size); /* resident: every slot */
    if (rc != CLOVER_OK) return rc;
    memcpy(c->snap_state, c->gdn_state, sizeof(float) * (size_t)state_n); /* the slots on the host */
    memcpy(c->snap_conv, c->conv_state, sizeof(float) * (size_t)conv_n);
    c->rec_on = 1;
    c->rec_n = 0;
    c->rec_p0 = c->n_past;
    return CLOVER_OK;
}

/* clover_context_rollback of GDN slot g for the resident forward: state and conv history from
 * the device checkpoint (every slot is there, clover_context_checkpoint), then the n_keep
 * recorded rows replayed on the device. */
static int res_rollback_slot(clover_context *c, int g, int32_t n_keep, char *err, size_t err_size) {
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const size_t state_bytes = sizeof(float) * (size_t)gdn_state_floats(hp), conv_bytes = conv_slot_bytes(hp);
    float *state = (float *)((char *)c->gdn_dev + state_bytes * (size_t)g);
    float *hist = (float *)((char *)c->conv_dev + conv_bytes * (size_t)g);
    float *rq, *rcv, *rb, *ra;
    rec_dev_slot(c, g, &rq, &rcv, &rb, &ra);
    res_bufs b;
    int rc;
    if ((rc = res_workspace(c, n_keep, &b, err, err_size)) ||
        (rc = clover_cuda_copy(state, (const char *)c->gdn_snap_dev + state_bytes * (size_t)g, state_bytes, err, err_size)) ||
        (rc = clover_cuda_copy(hist, (const char *)c->conv_snap_dev + conv_bytes * (size_t)g, conv_bytes, err, err_size)) ||
        (rc = clover_cuda_conv_hist_d(hist, rq, n_keep, d.C, (int32_t)d.K, err, err_size)))
        return rc;
    c->gdn_on_dev[g] = 1;
    return clover_cuda_gdn_d(CLOVER_GDN_FORWARD, rcv, rb, ra, n_keep, d.Hk, d.Hv, d.dk, d.dv, d.C, state, b.og, err,
                             err_size);
}

int clover_context_rollback(clover_context *c, int32_t n_keep, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (!c->rec_on || c->rec_n == 0)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "rollback without a recorded prefill after a checkpoint");
    if (n_keep < 1 || n_keep > c->rec_n)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "n_keep: %d outside [1, %d]", n_keep, c->rec_n);
    c->rec_on = 0;
    if (n_keep == c->rec_n) return CLOVER_OK; /* everything accepted: the caches are right */
    const clover_hparams *hp = &c->m->hp;
    const gdn_dims d = gdn_dims_of(hp);
    const int64_t C = d.C, K1 = d.K - 1, S_n = gdn_state_floats(hp);
    float *o = malloc(sizeof(float) * (size_t)(n_keep * d.Hv * d.dv) + 1);
    float *cat = malloc(sizeof(float) * (size_t)((K1 + n_keep) * C) + 1);
    int rc = o && cat ? CLOVER_OK : clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory in rollback");
    for (int64_t g = 0; g < c->m->n_gdn && rc == CLOVER_OK; g++) {
        if (c->rec_dev) { /* the resident forward recorded on the device: replay there */
            rc = res_rollback_slot(c, (int)g, n_keep, err, err_size);
            continue;
        }
        float *state = c->gdn_state + g * S_n, *hist = c->conv_state + g * K1 * C;
        const size_t slot = (size_t)g * (size_t)c->rec_cap;
        /* conv history: the last K-1 rows of (checkpoint history ++ kept inputs) */
        memcpy(cat, c->snap_conv + g * K1 * C, sizeof(float) * (size_t)(K1 * C));
        memcpy(cat + K1 * C, c->rec_qkv + slot * C, sizeof(float) * (size_t)(n_keep * C));
        memcpy(hist, cat + n_keep * C, sizeof(float) * (size_t)(K1 * C));
        const float *cv = c->rec_cv + slot * C, *b = c->rec_b + slot * d.Hv, *a = c->rec_a + slot * d.Hv;
        if (c->snap_on_dev && c->snap_on_dev[g]) { /* the checkpoint is on the GPU: replay there */
            const size_t bytes = sizeof(float) * (size_t)S_n;
            float *dev = (float *)((char *)c->gdn_dev + bytes * (size_t)g);
            rc = clover_cuda_copy(dev, (const char *)c->gdn_snap_dev + bytes * (size_t)g, bytes, err, err_size);
            if (rc == CLOVER_OK)
                rc = clover_cuda_gdn(CLOVER_GDN_FORWARD, cv, b, a, n_keep, d.Hk, d.Hv, d.dk, d.dv, C, dev, o, err,
                                     err_size);
            c->gdn_on_dev[g] = 1;
            continue;
        }
        if (c->gdn_on_dev) c->gdn_on_dev[g] = 0; /* the host copy is rewritten */
        memcpy(state, c->snap_state + g * S_n, sizeof(float) * (size_t)S_n);
        if (gdn_recurrence(GDN_FORWARD, &d, cv, b, a, n_keep, state, o, c->n_threads))
            rc = clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory in rollback");
    }
    free(o), free(cat);
    if (rc == CLOVER_OK) c->n_past = c->rec_p0 + n_keep;
    else clover_context_reset(c);
    return rc;
}

static int block_forward(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p, float *logits,
                         const uint8_t *rows, const select_req *sreq, int32_t *n_experts_out, char *err,
                         size_t err_size) {
    if (!c || !tokens) return clover_set_err(err, err_size, CLOVER_E_ARG, "context or tokens is NULL");
    if (!c->m->hp.has_block) return clover_no_block(c->m, "block mode", err, err_size);
    if (B <= 0) return clover_set_err(err, err_size, CLOVER_E_ARG, "block_size: %d must be > 0", B);
    if (!(coreset_top_p > 0.0f && coreset_top_p <= 1.0f))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "coreset_top_p: %g outside (0, 1]", coreset_top_p);
    if ((int64_t)c->n_past + B > c->n_ctx)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "block_size: %d past %d cached exceeds n_ctx %d", B,
                              c->n_past, c->n_ctx);
    int rc = check_tokens(c->m, tokens, B, err, err_size);
    if (rc) return rc;
    fwd f = {c, MODE_BLOCK, B, c->n_past, coreset_top_p, n_experts_out, err, err_size, sreq, 0};
    return forward(&f, tokens, logits, 0, rows);
}

int clover_block_forward_rows(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p,
                              float *logits, const uint8_t *rows, int32_t *n_experts_out, char *err,
                              size_t err_size) {
    return block_forward(c, tokens, B, coreset_top_p, logits, rows, NULL, n_experts_out, err, err_size);
}

int clover_block_forward_select(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p,
                                const uint8_t *rows, const clover_logit_op *ops, const int32_t *ops_start,
                                const clover_sampler_params *sp, int32_t k, int32_t *id, float *conf,
                                clover_cand *cand, float *pre, double *total, float *logits, int32_t *n_experts_out,
                                char *err, size_t err_size) {
    if (!c || !rows || !ops_start || !sp || (!ops && B > 0 && ops_start[B] > 0))
        return clover_set_err(err, err_size, CLOVER_E_ARG, "block_forward_select: NULL argument");
    int rc = check_select(c, sp, k, id, conf, cand, "block_forward_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_total(sp, k, total, logits, B, "block_forward_select", err, err_size);
    if (rc == CLOVER_OK) rc = check_ops_start(ops_start, rows, B, err, err_size);
    if (rc) return rc;
    const select_req g = {ops, ops_start, sp, k, id, conf, cand, pre, total, logits, 0};
    return block_forward(c, tokens, B, coreset_top_p, NULL, rows, &g, n_experts_out, err, err_size);
}

int clover_block_forward(clover_context *c, const int32_t *tokens, int32_t B, float coreset_top_p, float *logits,
                         int32_t *n_experts_out, char *err, size_t err_size) {
    return clover_block_forward_rows(c, tokens, B, coreset_top_p, logits, NULL, n_experts_out, err, err_size);
}
