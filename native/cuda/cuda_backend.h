/* cuda_backend.h: the C interface of native/cuda/cuda.cu (compiled when CMake finds the CUDA
 * toolkit, CLOVER_CUDA=AUTO|ON); native/gpu/cuda_stub.c defines the same functions returning
 * CLOVER_E_DEVICE ("built without CUDA") otherwise. All return CLOVER_* codes (clover.h). */
#ifndef CLOVER_CUDA_BACKEND_H
#define CLOVER_CUDA_BACKEND_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

/* Number of CUDA devices (> 0), 0 when none, or CLOVER_E_DEVICE when the runtime cannot be used
 * (no driver, built without CUDA); info receives a one-line description or the reason. */
int clover_cuda_devices(char *info, size_t info_size);
/* Free and total bytes of device 0. */
int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes);
/* Copy nbytes of host memory into a new device allocation *dev (free with clover_cuda_free). */
int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size);
void clover_cuda_free(void *dev);
/* y[t][r] = sum_j W[r][j] x[t][j] for t < T, r < ne1: W on the device (ne1 rows of ne0 values of
 * ggml type `type`: F32, F16, BF16, Q8_0, Q4_0, IQ4_NL, MXFP4, Q4_K, Q5_K, Q6_K, IQ4_XS), x and y
 * float32 in host memory ([T][ne0], [T][ne1]). Activations are rounded as the CPU engine rounds
 * them for `type` (Q8_0 or Q8_K, quant/dot.h), so y equals clover_matmul's up to float
 * summation order. Thread-safe (calls are serialised). */
int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size);

/* One weight tensor on the device: ne1 rows of ne0 values of ggml type `type` per matrix; for a
 * 3-D expert tensor, matrix e starts stride bytes after matrix e-1 (ggml's [E][ne1][ne0]). */
typedef struct {
    int type;
    const void *dev;
    int64_t ne0, ne1, stride;
} clover_cuda_weight;

/* The routed experts of one MoE layer (spec 2.3 step 2) on the device, for P = start[n_expert]
 * (row, expert) pairs bucketed by expert: pair q in [start[e], start[e+1]) uses expert e, and
 *   yg[q] = down_e (silu(gate_e xg[q]) * (up_e xg[q])),
 * gate and up [I][H] per expert, down [H][I]; xg and yg [P][H] float32 in host memory. Each
 * product rounds its activations as the CPU engine does for the weight type (Q8_0/Q8_K), so
 * results equal the CPU's expert_ffn up to float summation order. start: n_expert + 1
 * non-decreasing values from 0. Errors: CLOVER_E_ARG (shapes, start), CLOVER_E_NOMEM,
 * CLOVER_E_DEVICE. Thread-safe (calls are serialised). */
int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                        int64_t n_expert, const int64_t *start, const float *xg, float *yg, char *err,
                        size_t err_size);

/* A zeroed device allocation of nbytes in *dev (free with clover_cuda_free). */
int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size);
/* nbytes of page-locked host memory in *host (cudaMallocHost: copies to and from it run at the
 * bus's speed, without a staging copy); free with clover_cuda_host_free. CLOVER_E_NOMEM when the
 * driver refuses (callers fall back to plain memory). */
int clover_cuda_host_alloc(size_t nbytes, void **host, char *err, size_t err_size);
void clover_cuda_host_free(void *host);
/* Copy nbytes of host memory to dev + offset bytes. */
int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size);

/* KV cache element types of clover_cuda_attention(_d) and kv_store_d: bit CLOVER_KV_K_F16 set, the
 * K cache holds fp16 values, else float32; CLOVER_KV_V_F16 the same for V. */
enum { CLOVER_KV_K_F16 = 1, CLOVER_KV_V_F16 = 2 };

/* Gated attention of T query rows at positions pos0.. on the device (spec 2.2 steps 3-4), with the
 * layer's KV cache on the device (k_cache/v_cache [n_ctx][n_kv*hd], element types kv_f16, rows
 * up to pos0+T written, normed and rotated): for each row t and head h, out[t][h] =
 * softmax(q K^T * scale) V * sigmoid(gate) over keys 0 .. pos0+t (causal) or 0 .. pos0+T-1
 * (block mode), with GQA (head h reads KV head h / (n_head / n_kv)).
 * q: host [T][n_head][2 hd] (q normed and rotated, then the gate); out: host [T][n_head][hd].
 * hd: a multiple of 32, at most 256. Errors: CLOVER_E_ARG, CLOVER_E_NOMEM, CLOVER_E_DEVICE. */
int clover_cuda_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16, int64_t n_ctx,
                          int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale,
                          float *out, char *err, size_t err_size);
/* Copy nbytes from device memory src to device memory dst. */
int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size);
/* Copy nbytes at dev + offset bytes to host memory. */
int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size);

/* Gated DeltaNet recurrence of all Hv value heads over T rows on the device (spec 2.1 step 6), as
 * cpu/gdn_heads.c's gdn_recurrent_head: conv [T][C] (q and k of Hk key heads of dk, l2-normed, then
 * v of Hv heads of dv), beta and the log-decay g [T][Hv], all host float32; o: host [T][Hv*dv].
 * state: device [Hv][dk][dv], updated in place; kind CLOVER_GDN_FORWARD token by token,
 * CLOVER_GDN_FORWARD_CHUNKED in the chunked form (chunks of 64 rows, cpu/gdn_heads.c
 * gdn_chunked_head; for prefills). dk <= 256, dv <= 1024.
 * Errors: CLOVER_E_ARG, CLOVER_E_NOMEM, CLOVER_E_DEVICE. */
enum { CLOVER_GDN_FORWARD = 0, CLOVER_GDN_FORWARD_CHUNKED = 1 };
int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size);
/* The block operator's mixing of a Gated DeltaNet layer (spec 3.3 steps 3-4), as cpu/gdn_heads.c's
 * bd_heads: for each value head h and block row i < T of conv (host [T][C], as clover_cuda_gdn's,
 * q carrying 1/sqrt(dk)), o[i][h] (host [T][Hv*dv]) = a_iH S_h^T q_i + sum_j a_ij v_j with
 * a_i = softmax(exp(lambda[h]) sqrt(dk) q_i . k_j for j < T, beta0[h] + c[h] log1p(P)); state:
 * device [Hv][dk][dv], read only; lambda, beta0, c: host [Hv]; P: the clean tokens before the
 * block. dk <= 256, dv <= 1024. Errors: CLOVER_E_ARG, CLOVER_E_NOMEM, CLOVER_E_DEVICE. */
int clover_cuda_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                          const float *state, const float *lambda, const float *beta0, const float *c, int64_t P,
                          float *o, char *err, size_t err_size);

/* ---- the device-resident forward (gpu/forward_resident.c, every layer and the output on the GPU).
 * Every pointer is device memory; float32 unless said; calls queue their kernels in stream
 * order and return without waiting (results are seen by a later clover_cuda_read). Errors:
 * CLOVER_E_ARG (arguments, named in err), CLOVER_E_NOMEM (scratch), CLOVER_E_DEVICE (a launch,
 * or an earlier asynchronous failure). Each mirrors the CPU function named (model/, cpu/). */

/* clover_cuda_matmul of n weights w[i] (one matrix each, the same ne0) on device x [T][ne0] into
 * y[i] [T][w[i].ne1] (x is not modified): x is rounded once per activation format the types
 * need (Q8_0 or Q8_K), not once per product, so q/k/v and the like cost one rounding. */
int clover_cuda_matmul_d(int n, const clover_cuda_weight *w, const float *x, int64_t T, float *const *y, char *err,
                         size_t err_size);
/* rmsnorm: row r of y (y_stride floats apart) = row idx[r] (r when idx is NULL) of x
 * (x_stride apart) * rsqrt(mean(x^2) + eps) * w, n values per row, for rows rows; idx: int32. */
int clover_cuda_rmsnorm_d(const float *x, int64_t x_stride, const int32_t *idx, const float *w, int64_t n,
                          int64_t rows, float eps, float *y, int64_t y_stride, char *err, size_t err_size);
/* attention_layer's q/k heads: head h of row t (hd floats at x + t row_stride + h head_stride)
 * rmsnormed with w, then NeoX RoPE on its first rope_dim values at position *pos + t (spec 2.2
 * step 2; pos: device int64, read when the kernel runs). T <= 65535, hd <= 256. */
int clover_cuda_head_norm_rope_d(float *x, int64_t T, int64_t n_head, int64_t row_stride, int64_t head_stride,
                                 const float *w, int64_t hd, float eps, const int64_t *pos, int32_t rope_dim,
                                 float theta, char *err, size_t err_size);
/* clover_cuda_attention on device q [T][n_head][2 hd] against the layer's cache rows
 * [0, *pos + T) (pos: device int64; the new rows already written), out [T][n_head][hd]. */
int clover_cuda_attention_d(const float *q, const void *k_cache, const void *v_cache, int kv_f16, const int64_t *pos,
                            int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale, float *out,
                            char *err, size_t err_size);
/* conv_silu (model/gdn.c; spec 2.1 step 2, 3.3 step 1) of in [T][C] after hist (the K-1 previous rows
 * [K-1][C]) with weights w [C][K] and, when wr is not NULL, the right taps wr [C][K-1], SiLU, into
 * out [T][C]. K <= 16. */
int clover_cuda_conv_d(const float *w, const float *wr, const float *hist, const float *in, int64_t T, int64_t C,
                       int32_t K, float *out, char *err, size_t err_size);
/* hist [K-1][C] <- the last K-1 rows of hist ++ in [T][C] (the conv history after T inputs). */
int clover_cuda_conv_hist_d(float *hist, const float *in, int64_t T, int64_t C, int32_t K, char *err, size_t err_size);
/* qk_norm then gates (spec 2.1 steps 3-4): conv [T][C] q and k heads l2-normed (q times
 * 1/sqrt(dk)); b, a [T][Hv] in place to beta = sigmoid(b), g = ssm_a softplus(a + dt_bias), unless
 * both are NULL (block mode: no gates). */
int clover_cuda_gdn_prep_d(float *conv, int64_t T, int64_t C, int64_t Hk, int64_t dk, float eps, float *b, float *a,
                           const float *ssm_a, const float *dt_bias, int64_t Hv, char *err, size_t err_size);
/* clover_cuda_gdn with every array on the device. */
int clover_cuda_gdn_d(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                      int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size);
/* clover_cuda_gdn_block with every array on the device and P = *pos (device int64, read when the
 * kernel runs, so a graph can replay). */
int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                            const float *state, const float *lambda, const float *beta0, const float *c,
                            const int64_t *pos, float *o, char *err, size_t err_size);
/* The end of gdn_layer (spec 2.1 step 7) on o [T][Hv][dv] in place: per head rmsnorm with w [dv]
 * times silu(z) (z [T][Hv][dv]). */
int clover_cuda_gdn_out_d(float *o, const float *z, const float *w, int64_t T, int64_t Hv, int64_t dv, float eps,
                          char *err, size_t err_size);
/* Tiles of ROWS (8) pairs that a grouped product of P (row, expert) pairs over E experts may
 * need: clover_cuda_route_d writes this many (unused ones empty). */
static inline int64_t clover_cuda_route_tiles(int64_t P, int64_t E) { return P / 8 + 1 + (E < P ? E : P); }
/* MoE routing of moe_layer (spec 2.3 step 1; coreset_top_p > 0: the block-mode coreset of
 * spec 5.6, else none): probs [T][E] router logits -> softmax; sel [T k] int32 and wsel [T k]
 * scratch; out: prow [T k] int32 and pw [T k] (each pair's row and weight, bucketed by expert:
 * expert by expert, rows ascending), pair [T][k] int32 (row t's pairs, ascending),
 * tiles (clover_cuda_route_tiles(T k, E) of 3 int32), stats [2] int32 (experts used; experts in
 * some row's own top-k, written only with the coreset). E <= 1024. */
int clover_cuda_route_d(float *probs, int64_t T, int64_t E, int32_t k, float coreset_top_p, int32_t *sel, float *wsel,
                        int32_t *prow, float *pw, int32_t *pair, void *tiles, int32_t *stats, char *err,
                        size_t err_size);
/* y[q] = x[rows[q]] for n rows of H floats (rows: int32). */
int clover_cuda_gather_d(const float *x, const int32_t *rows, int64_t n, int64_t H, float *y, char *err,
                         size_t err_size);
/* clover_cuda_experts on device xg/yg [P][H] with clover_cuda_route_d's tiles (n_tiles). */
int clover_cuda_experts_d(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                          const void *tiles, int64_t n_tiles, int64_t P, const float *xg, float *yg, char *err,
                          size_t err_size);
/* g = silu(g) * u over n values. */
int clover_cuda_swiglu_d(float *g, const float *u, int64_t n, char *err, size_t err_size);
/* The end of moe_layer plus the residual: x[t] += sum over row t's pairs q of pw[q] yg[q] +
 * sigmoid(sg[t]) ys[t] (x, ys [T][H]); *bad (int32) = 1 when a result is not finite. */
int clover_cuda_moe_combine_d(float *x, const float *yg, const float *pw, const int32_t *pair, int32_t k,
                              const float *ys, const float *sg, int64_t T, int64_t H, int32_t *bad, char *err,
                              size_t err_size);
/* One edit of a logits row by the sampler's processing (spec 5.4; decode/sampler.c
 * clover_logit_ops): PENALTY: z[id] through the repetition penalty, then minus count * frequency
 * + presence when count > 0; ADD: z[id] += value; MASK: z[id] = -inf. */
typedef struct {
    int32_t kind, id, count;
    float value;
} clover_logit_op;
enum { CLOVER_OP_PENALTY = 0, CLOVER_OP_ADD = 1, CLOVER_OP_MASK = 2 };
#ifdef __CUDACC__
#define CLOVER_OP_HD __host__ __device__
#else
#define CLOVER_OP_HD
#endif
/* Apply edit o to the row z[V] (ids outside [0, V) are skipped): one definition for the CPU
 * (decode/sampler.c clover_apply_logit_ops) and the GPU (cuda.cu k_logit_ops). */
static inline CLOVER_OP_HD void clover_logit_op_apply(float *z, int64_t V, clover_logit_op o, float repetition,
                                                      float frequency, float presence) {
    if (o.id < 0 || o.id >= V) return;
    if (o.kind == CLOVER_OP_PENALTY) {
        float v = z[o.id];
        if (repetition != 1.0f) v = v > 0.0f ? v / repetition : v * repetition;
#ifdef __CUDA_ARCH__ /* nvcc contracts a * b + c into an FMA; C11 does not: the product rounded alone */
        if (o.count > 0) v -= __fmul_rn((float)o.count, frequency) + presence;
#else
        if (o.count > 0) v -= (float)o.count * frequency + presence;
#endif
        z[o.id] = v;
    } else if (o.kind == CLOVER_OP_ADD) {
        z[o.id] += o.value;
    } else {
        z[o.id] = -INFINITY;
    }
}
/* A sampling candidate (spec 5.3): a processed logit and its token id. Candidate lists are sorted
 * by z descending, ties by id ascending (decode/sampler.c clover_sample_top). */
typedef struct {
    float z;
    int32_t id;
} clover_cand;
/* The ids that can be candidates: n_vocab, less the mask token when it is one of them. */
static inline int32_t clover_cand_ids(int64_t n_vocab, int32_t mask_id) {
    return (int32_t)(n_vocab - (mask_id >= 0 && mask_id < n_vocab));
}
/* The most candidates per row clover_cuda_top_k_d selects (top_k of the GPU path). */
enum { CLOVER_CUDA_TOP_K_MAX = 256 };
/* Greedy selection on the GPU (spec 5.3 at temperature 0, as clover_sample): for each of the n
 * rows of z [n][V] (device, edited in place), the edits ops[start[r] .. start[r+1]) (device;
 * start: n + 1 int32) with the penalties repetition, frequency, presence, then id[r] = the argmax
 * (lowest id on ties, never mask_id) and conf[r] = its softmax probability, 1 / sum over ids
 * other than mask_id of exp(z - z_max) in double (id and conf: device, n each; id -1 and conf 0
 * when no id is left). */
int clover_cuda_greedy_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                         float repetition, float frequency, float presence, int32_t mask_id, int32_t *id, float *conf,
                         char *err, size_t err_size);
/* Top-k selection on the GPU (spec 5.3, the candidates clover_sample keeps after top-k): for each
 * of the n rows of z [n][V] (device, edited in place by ops as clover_cuda_greedy_d), the k
 * largest logits of ids other than mask_id, sorted by z descending then id ascending, into
 * cand[r][0..k) (device; 1 <= k <= CLOVER_CUDA_TOP_K_MAX and k <= the ids other than mask_id),
 * and bad[r] (device float) = 0, or NaN when a value other than mask_id's is NaN or +inf (-inf can
 * be an edit's, and is a weight of 0 as in the greedy sum).
 * pre (device, as many floats as ops; NULL: not kept): pre[q] = the value edit q found, before it
 * applied, so the host can redo a row's edits for an id from its raw logit. */
int clover_cuda_top_k_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                        float repetition, float frequency, float presence, int32_t mask_id, int32_t k,
                        clover_cand *cand, float *bad, float *pre, char *err, size_t err_size);
/* The row weight that top-p alone needs (decode/sampler.c clover_sample): for each of the n rows
 * of z [n][V] (device, already edited by clover_cuda_top_k_d, whose k candidates a row cand
 * [n][k] (device) give the row's maximum cand[r][0].z), total[r] (device double) = the sum over
 * ids other than mask_id of (float)exp((double)(z - zmax) / temperature), temperature > 0; summed
 * in another order than the CPU's. */
int clover_cuda_row_total_d(const float *z, int64_t n, int64_t V, int32_t mask_id, const clover_cand *cand,
                            int32_t k, float temperature, double *total, char *err, size_t err_size);
/* Whether the block formats' many-row products run on int8 tensor cores in this process (compute 8.0 or
 * later, not CLOVER_CUDA_MMA=0; read at each product, so a CUDA graph's key holds it). */
int clover_cuda_mma(void);
/* CUDA graphs of the device-resident forward: between clover_cuda_capture_begin and
 * clover_cuda_capture_end the kernels that this thread's clover_cuda_*_d calls queue are recorded
 * (not run) into *graph, which clover_cuda_graph_launch then runs, each launch with the arguments
 * it was recorded with, so what changes between runs must sit in device memory (a position: the
 * pos arguments below). Nothing but launches may happen while capturing: no allocation, copy or
 * memset (the capture fails with CLOVER_E_DEVICE at its end). A graph holds the device addresses
 * it saw: clover_cuda_scratch_epoch changes whenever the backend's own scratch moves, and a
 * graph recorded before must not run after. */
int clover_cuda_capture_begin(char *err, size_t err_size);
int clover_cuda_capture_end(void **graph, char *err, size_t err_size);
int clover_cuda_graph_launch(void *graph, char *err, size_t err_size);
void clover_cuda_graph_free(void *graph);
int64_t clover_cuda_scratch_epoch(void);
/* Free the backend's own scratch (the products' activations and partial results; it grows to the
 * largest pass so far and is shared by every context): called when the last context that used
 * the GPU is freed, so that closing every model gives all the GPU memory back. The epoch changes. */
void clover_cuda_release_scratch(void);
/* dst[i] = src[i] for n floats, as a kernel (stream-ordered, so a graph can hold it). */
int clover_cuda_copy_d(float *dst, const float *src, int64_t n, char *err, size_t err_size);
/* Rows t < T of k_new, v_new [T][kvd] into rows *pos + t of k_cache, v_cache [n_ctx][kvd] (pos:
 * device int64; rows at or past n_ctx are not written). */
int clover_cuda_kv_store_d(void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t kvd, const int64_t *pos,
                           const float *k_new, const float *v_new, int64_t T, char *err, size_t err_size);
/* x += o over n values; *bad (int32) = 1 when a result is not finite. */
int clover_cuda_add_d(float *x, const float *o, int64_t n, int32_t *bad, char *err, size_t err_size);

#ifdef __cplusplus
}
#endif
#endif
