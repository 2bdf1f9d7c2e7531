/* offload.c: the placement of weights on the GPU (llama.cpp's n_gpu_layers and n_cpu_moe): the
 * bytes each placement copies, the copies themselves, the float32 vectors of a whole offload
 * (the resident forward), GPU selection and memory queries. */
#include "gpu/offload.h"
#include "quant/matmul.h"

#include <stdlib.h>
#include <string.h>

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

/* Whether the CUDA backend's products take weight type t (native/cuda/dequant.cuh's formats):
 * every engine weight type but Q2_K and Q3_K, which run on the CPU only. */
static int gpu_weight_type(int t) { return t != CLOVER_TYPE_Q2_K && t != CLOVER_TYPE_Q3_K; }

/* CLOVER_OK when every weight the placement (L layers, their routed experts from layer n_cpu_moe
 * on, the output with with_output) would copy has a GPU type; else CLOVER_E_ARG naming the first
 * layer and type that does not. */
static int check_gpu_types(clover_model *m, int32_t L, int32_t n_cpu_moe, int with_output, char *err, size_t err_size) {
    static const char *gpu_types = "F32, F16, BF16, Q8_0, Q4_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS";
    clover_tensor *w[24];
    for (int il = 0; il < L; il++)
        for (int experts = 0; experts < 2; experts++) {
            if (experts && il < n_cpu_moe) continue;
            layer_weights(&m->layers[il], experts, w);
            for (int i = 0; w[i]; i++)
                if (!gpu_weight_type(w[i]->type))
                    return clover_set_err(err, err_size, CLOVER_E_ARG,
                                          "n_gpu_layers: layer %d has %s weights, which the CUDA backend does not run "
                                          "(it runs %s); keep such layers on the CPU", il,
                                          clover_type_name(w[i]->type), gpu_types);
        }
    if (with_output && !gpu_weight_type(m->output.type))
        return clover_set_err(err, err_size, CLOVER_E_ARG,
                              "n_gpu_layers: output.weight is %s, which the CUDA backend does not run (it runs %s); "
                              "offload at most n_layer layers", clover_type_name(m->output.type), gpu_types);
    return CLOVER_OK;
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

void free_gpu(clover_model *m) {
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

/* Whether clover_model_offload(m, n_gpu_layers, ...) makes m resident: every layer and the output
 * on the GPU (n_gpu_layers > n_layer) and resident_wanted. */
int offload_makes_resident(const clover_model *m, int32_t n_gpu_layers) {
    return n_gpu_layers > m->hp.n_layer && resident_wanted(m);
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
    const int types_rc = check_gpu_types(m, L, n_cpu_moe, with_output, err, err_size);
    if (types_rc != CLOVER_OK) return types_rc;
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
