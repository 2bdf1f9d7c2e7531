/* cuda_backend.h: the C interface of native/cuda/cuda.cu (compiled when CMake finds the CUDA
 * toolkit, CLOVER_CUDA=AUTO|ON); native/cuda_stub.c defines the same functions returning
 * CLOVER_E_DEVICE ("built without CUDA") otherwise. All return CLOVER_* codes (clover.h). */
#ifndef CLOVER_CUDA_BACKEND_H
#define CLOVER_CUDA_BACKEND_H
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
 * them for `type` (Q8_0 or Q8_K, native/dot.h), so y equals clover_matmul's up to float
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
/* Copy nbytes of host memory to dev + offset bytes. */
int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size);

/* Gated attention of T query rows at positions pos0.. on the device (spec 2.2 steps 3-4), with the
 * layer's KV cache on the device: k_new/v_new (host, [T][n_kv*hd], normed and rotated) are
 * written to rows pos0.. of k_cache/v_cache (device, [n_ctx][n_kv*hd]), then for each row t and
 * head h, out[t][h] = softmax(q K^T * scale) V * sigmoid(gate) over keys 0 .. pos0+t (causal) or
 * 0 .. pos0+T-1 (block mode), with GQA (head h reads KV head h / (n_head / n_kv)).
 * q: host [T][n_head][2 hd] (q normed and rotated, then the gate); out: host [T][n_head][hd].
 * hd: a multiple of 32, at most 256. Errors: CLOVER_E_ARG, CLOVER_E_NOMEM, CLOVER_E_DEVICE. */
int clover_cuda_attention(const float *q, const float *k_new, const float *v_new, float *k_cache, float *v_cache,
                          int64_t n_ctx, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal,
                          float scale, float *out, char *err, size_t err_size);
/* Copy nbytes from device memory src to device memory dst. */
int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size);
/* Copy nbytes at dev + offset bytes to host memory. */
int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size);

/* Gated DeltaNet recurrence of all Hv value heads over T rows on the device (spec 2.1 step 6; the
 * backward branch spec 3.3), as native/model.c's gdn_recurrent_head / gdn_backward_head:
 * conv [T][C] (q and k of Hk key heads of dk, l2-normed, then v of Hv heads of dv), beta and the
 * log-decay g [T][Hv], all host float32; o: host [T][Hv*dv]. state: device [Hv][dk][dv].
 * kind CLOVER_GDN_FORWARD updates state in place; CLOVER_GDN_FORWARD_COPY starts from it and
 * leaves it unchanged (block mode); CLOVER_GDN_BACKWARD runs the rows in reverse from a zero
 * state with the readout first (state unused, may be NULL). dk <= 256, dv <= 1024. Errors:
 * CLOVER_E_ARG, CLOVER_E_NOMEM, CLOVER_E_DEVICE. */
enum { CLOVER_GDN_FORWARD = 0, CLOVER_GDN_FORWARD_COPY = 1, CLOVER_GDN_BACKWARD = 2 };
int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size);

#ifdef __cplusplus
}
#endif
#endif
