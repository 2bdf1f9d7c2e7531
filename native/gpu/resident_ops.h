/* resident_ops.h: the device scratch of a resident pass (res_bufs) and the product helpers that
 * the resident layers share (gpu/resident_ops.c). */
#ifndef CLOVER_GPU_RESIDENT_OPS_H
#define CLOVER_GPU_RESIDENT_OPS_H

#include "core/errors.h"
#include "model/pass.h"

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


/* The context's device scratch for a pass of T rows (grown when needed), laid out into b. */
CLOVER_HIDDEN int res_workspace(clover_context *c, int64_t T, res_bufs *b, char *err, size_t err_size);
/* y[i] [T][ne1] = w[i] x on the device for n <= 4 weights on the same input (rounded once). */
CLOVER_HIDDEN int mm_n_d(fwd *f, int n, const clover_tensor *const *w, const float *x, int64_t T, float *const *y);
/* y [T][ne1] = w x on the device. */
CLOVER_HIDDEN int mm_d(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y);

#endif
