/* cuda_stub.c: the CUDA backend's functions in a build without CUDA (CMake did not find the
 * toolkit, or CLOVER_CUDA=OFF): every call reports CLOVER_E_DEVICE, so the CPU path is used. */
#include "cuda/cuda_backend.h"

#ifndef CLOVER_HAVE_CUDA
#include <stdio.h>

#include "clover.h"

int clover_cuda_devices(char *info, size_t info_size) {
    if (info && info_size) snprintf(info, info_size, "this libclover was built without CUDA (CLOVER_CUDA=OFF or no nvcc)");
    return CLOVER_E_DEVICE;
}

int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes) {
    (void)free_bytes, (void)total_bytes;
    return CLOVER_E_DEVICE;
}

int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size) {
    (void)host, (void)nbytes;
    *dev = NULL;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

void clover_cuda_free(void *dev) { (void)dev; }

int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T, float *y,
                       char *err, size_t err_size) {
    (void)type, (void)dev_w, (void)ne0, (void)ne1, (void)x, (void)T, (void)y;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                        int64_t n_expert, const int64_t *start, const float *xg, float *yg, char *err,
                        size_t err_size) {
    (void)gate, (void)up, (void)down, (void)n_expert, (void)start, (void)xg, (void)yg;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_host_alloc(size_t nbytes, void **host, char *err, size_t err_size) {
    (void)nbytes;
    *host = NULL;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

void clover_cuda_host_free(void *host) { (void)host; }

int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size) {
    return clover_cuda_upload(NULL, nbytes, dev, err, err_size);
}

int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err, size_t err_size) {
    (void)dev, (void)offset, (void)host, (void)nbytes;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16, int64_t n_ctx,
                          int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale,
                          float *out, char *err, size_t err_size) {
    (void)q, (void)k_cache, (void)v_cache, (void)kv_f16, (void)n_ctx, (void)pos0, (void)T, (void)n_head;
    (void)n_kv, (void)hd, (void)causal, (void)scale, (void)out;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size) {
    return clover_cuda_write((void *)dev, offset, host, nbytes, err, err_size);
}

int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size) {
    return clover_cuda_write(dst, 0, src, nbytes, err, err_size);
}

int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                    int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size) {
    (void)kind, (void)conv, (void)beta, (void)g, (void)T, (void)Hk, (void)Hv, (void)dk, (void)dv, (void)C, (void)state;
    (void)o;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                          const float *state, const float *lambda, const float *beta0, const float *c, int64_t P,
                          float *o, char *err, size_t err_size) {
    (void)conv, (void)T, (void)Hk, (void)Hv, (void)dk, (void)dv, (void)C, (void)state, (void)lambda, (void)beta0;
    (void)c, (void)P, (void)o;
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

/* the device-resident forward's operations: never reached (no model is offloaded without CUDA) */
static int no_cuda(char *err, size_t err_size) {
    if (err && err_size) snprintf(err, err_size, "built without CUDA");
    return CLOVER_E_DEVICE;
}

int clover_cuda_matmul_d(int n, const clover_cuda_weight *w, const float *x, int64_t T, float *const *y,
                         char *err, size_t err_size) {
    (void)n, (void)w, (void)x, (void)T, (void)y;
    return no_cuda(err, err_size);
}

int clover_cuda_rmsnorm_d(const float *x, int64_t x_stride, const int32_t *idx, const float *w, int64_t n,
                          int64_t rows, float eps, float *y, int64_t y_stride, char *err, size_t err_size) {
    (void)x, (void)x_stride, (void)idx, (void)w, (void)n, (void)rows, (void)eps, (void)y, (void)y_stride;
    return no_cuda(err, err_size);
}

int clover_cuda_head_norm_rope_d(float *x, int64_t T, int64_t n_head, int64_t row_stride, int64_t head_stride,
                                 const float *w, int64_t hd, float eps, const int64_t *pos, int32_t rope_dim,
                                 float theta, char *err, size_t err_size) {
    (void)x, (void)T, (void)n_head, (void)row_stride, (void)head_stride, (void)w, (void)hd, (void)eps, (void)pos;
    (void)rope_dim, (void)theta;
    return no_cuda(err, err_size);
}

int clover_cuda_attention_d(const float *q, const void *k_cache, const void *v_cache, int kv_f16, const int64_t *pos,
                            int64_t T, int64_t n_head, int64_t n_kv, int64_t hd, int causal, float scale, float *out,
                            char *err, size_t err_size) {
    (void)q, (void)k_cache, (void)v_cache, (void)kv_f16, (void)pos, (void)T, (void)n_head, (void)n_kv, (void)hd, (void)causal;
    (void)scale, (void)out;
    return no_cuda(err, err_size);
}

int clover_cuda_conv_d(const float *w, const float *wr, const float *hist, const float *in, int64_t T, int64_t C,
                       int32_t K, float *out, char *err, size_t err_size) {
    (void)w, (void)wr, (void)hist, (void)in, (void)T, (void)C, (void)K, (void)out;
    return no_cuda(err, err_size);
}

int clover_cuda_conv_hist_d(float *hist, const float *in, int64_t T, int64_t C, int32_t K, char *err, size_t err_size) {
    (void)hist, (void)in, (void)T, (void)C, (void)K;
    return no_cuda(err, err_size);
}

int clover_cuda_gdn_prep_d(float *conv, int64_t T, int64_t C, int64_t Hk, int64_t dk, float eps, float *b, float *a,
                           const float *ssm_a, const float *dt_bias, int64_t Hv, char *err, size_t err_size) {
    (void)conv, (void)T, (void)C, (void)Hk, (void)dk, (void)eps, (void)b, (void)a, (void)ssm_a, (void)dt_bias, (void)Hv;
    return no_cuda(err, err_size);
}

int clover_cuda_gdn_d(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                      int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size) {
    return clover_cuda_gdn(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o, err, err_size);
}

int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv, int64_t C,
                            const float *state, const float *lambda, const float *beta0, const float *c,
                            const int64_t *pos, float *o, char *err, size_t err_size) {
    (void)conv, (void)T, (void)Hk, (void)Hv, (void)dk, (void)dv, (void)C, (void)state, (void)lambda, (void)beta0;
    (void)c, (void)pos, (void)o;
    return no_cuda(err, err_size);
}

int clover_cuda_gdn_out_d(float *o, const float *z, const float *w, int64_t T, int64_t Hv, int64_t dv, float eps,
                          char *err, size_t err_size) {
    (void)o, (void)z, (void)w, (void)T, (void)Hv, (void)dv, (void)eps;
    return no_cuda(err, err_size);
}

int clover_cuda_route_d(float *probs, int64_t T, int64_t E, int32_t k, float coreset_top_p, int32_t *sel, float *wsel,
                        int32_t *prow, float *pw, int32_t *pair, void *tiles, int32_t *stats, char *err,
                        size_t err_size) {
    (void)probs, (void)T, (void)E, (void)k, (void)coreset_top_p, (void)sel, (void)wsel, (void)prow;
    (void)pw, (void)pair, (void)tiles, (void)stats;
    return no_cuda(err, err_size);
}

int clover_cuda_gather_d(const float *x, const int32_t *rows, int64_t n, int64_t H, float *y, char *err,
                         size_t err_size) {
    (void)x, (void)rows, (void)n, (void)H, (void)y;
    return no_cuda(err, err_size);
}

int clover_cuda_experts_d(const clover_cuda_weight *gate, const clover_cuda_weight *up, const clover_cuda_weight *down,
                          const void *tiles, int64_t n_tiles, int64_t P, const float *xg, float *yg, char *err,
                          size_t err_size) {
    (void)gate, (void)up, (void)down, (void)tiles, (void)n_tiles, (void)P, (void)xg, (void)yg;
    return no_cuda(err, err_size);
}

int clover_cuda_swiglu_d(float *g, const float *u, int64_t n, char *err, size_t err_size) {
    (void)g, (void)u, (void)n;
    return no_cuda(err, err_size);
}

int clover_cuda_moe_combine_d(float *x, const float *yg, const float *pw, const int32_t *pair, int32_t k,
                              const float *ys, const float *sg, int64_t T, int64_t H, int32_t *bad, char *err,
                              size_t err_size) {
    (void)x, (void)yg, (void)pw, (void)pair, (void)k, (void)ys, (void)sg, (void)T, (void)H, (void)bad;
    return no_cuda(err, err_size);
}

int clover_cuda_add_d(float *x, const float *o, int64_t n, int32_t *bad, char *err, size_t err_size) {
    (void)x, (void)o, (void)n, (void)bad;
    return no_cuda(err, err_size);
}

int clover_cuda_greedy_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                         float repetition, float frequency, float presence, int32_t mask_id, int32_t *id, float *conf,
                         char *err, size_t err_size) {
    (void)z, (void)n, (void)V, (void)ops, (void)start, (void)repetition, (void)frequency, (void)presence, (void)mask_id;
    (void)id, (void)conf;
    return no_cuda(err, err_size);
}
int clover_cuda_top_k_d(float *z, int64_t n, int64_t V, const clover_logit_op *ops, const int32_t *start,
                        float repetition, float frequency, float presence, int32_t mask_id, int32_t k,
                        clover_cand *cand, float *bad, float *pre, char *err, size_t err_size) {
    (void)z, (void)n, (void)V, (void)ops, (void)start, (void)repetition, (void)frequency, (void)presence, (void)mask_id;
    (void)k, (void)cand, (void)bad, (void)pre;
    return no_cuda(err, err_size);
}
int clover_cuda_row_total_d(const float *z, int64_t n, int64_t V, int32_t mask_id, const clover_cand *cand,
                            int32_t k, float temperature, double *total, char *err, size_t err_size) {
    (void)z, (void)n, (void)V, (void)mask_id, (void)cand, (void)k, (void)temperature, (void)total;
    return no_cuda(err, err_size);
}
int clover_cuda_mma(void) { return 0; }
int clover_cuda_capture_begin(char *err, size_t err_size) { return no_cuda(err, err_size); }
int clover_cuda_capture_end(void **graph, char *err, size_t err_size) {
    *graph = NULL;
    return no_cuda(err, err_size);
}
int clover_cuda_graph_launch(void *graph, char *err, size_t err_size) {
    (void)graph;
    return no_cuda(err, err_size);
}
void clover_cuda_graph_free(void *graph) { (void)graph; }
int64_t clover_cuda_scratch_epoch(void) { return 0; }
void clover_cuda_release_scratch(void) {}
int clover_cuda_kv_store_d(void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t kvd, const int64_t *pos,
                           const float *k_new, const float *v_new, int64_t T, char *err, size_t err_size) {
    (void)k_cache, (void)v_cache, (void)kv_f16, (void)n_ctx, (void)kvd, (void)pos, (void)k_new, (void)v_new, (void)T;
    return no_cuda(err, err_size);
}
int clover_cuda_copy_d(float *dst, const float *src, int64_t n, char *err, size_t err_size) {
    (void)dst, (void)src, (void)n;
    return no_cuda(err, err_size);
}
#endif
