/* pass.h: one forward pass's state (fwd), shared by the CPU layer loop (model/forward.c) and its
 * GPU-resident twin (gpu/forward_resident.c), and the helpers both call: products by weight,
 * input and output checks (clover-spec 5.1 prefix mode, 3.2 block mode). */
#ifndef CLOVER_MODEL_PASS_H
#define CLOVER_MODEL_PASS_H

#include "clover.h"
#include "core/errors.h"
#include "decode/sampler.h"
#include "model/model.h"

enum { CLOVER_SELECT_MAX_ROWS = 512 }; /* clover_prefill_select's n (one resident pass, gpu/resident_ops.h RES_ROWS) */
enum { CLOVER_SELECT_TOTAL_MAX_ROWS = 32 }; /* rows of a selection with total (gpu/resident_ops.h RES_LM) */

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
    const struct embed_req *ereq;   /* clover_embed's request (the pass computes no logits), else NULL */
} fwd;

/* One context's forward in a pass: its fwd (context, mode, rows, positions), its tokens, and its
 * logits: with rows (a mask of f.T bytes) the rows t with rows[t] != 0 at logits + t V, else
 * rows logit_row0.. from logits (NULL: no LM head); rc: the entry's outcome (set by the pass). */
typedef struct {
    fwd f;
    const int32_t *tokens;
    float *logits;
    int64_t logit_row0;
    const uint8_t *rows;
    int rc;
} pass_entry;
/* Run the forwards of n entries of one model as one pass (model/forward.c batched_pass) with lead's
 * scratch and threads (n > 1), each entry's rc set; an entry alone (n == 1) runs as
 * clover_prefill / clover_block_forward run it unbatched, split as they split it. */
typedef void (*pass_fn)(pass_entry *e, int n, clover_context *lead);
/* Rows of the next pass of a split prefill with `left` rows to go and passes of at most max_rows
 * (a multiple of CLOVER_GDN_CHUNK); see pass.c. */
CLOVER_HIDDEN int64_t pass_rows(int64_t left, int64_t max_rows);
/* The entry of rows [r0, r0 + n) of a prefix-mode entry w (positions, tokens, its logits rows). */
CLOVER_HIDDEN pass_entry pass_chunk(const pass_entry *w, int64_t r0, int64_t n);

/* clover_embed's pooling and outputs: NONE: out[n][n_embd]; MEAN: the rows' sum in sum[n_embd]
 * (zeroed by the caller, divided after the last pass); LAST: row n - 1 in out[n_embd]. */
typedef struct embed_req {
    int32_t pooling; /* CLOVER_POOLING_NONE, _MEAN or _LAST */
    int64_t n;       /* the tokens of the whole prefill (its passes start at position 0) */
    float *out;
    double *sum;
} embed_req;

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

/* The context's host scratch (clover_context.scratch): a plan of up to SCRATCH_PARTS parts, each
 * count elements of elem bytes (64-byte aligned), with every size computation overflow-checked. */
enum { SCRATCH_PASS = 0, SCRATCH_LAYER = 1, SCRATCH_THREADS = 2, SCRATCH_CALL = 3, SCRATCH_SLOTS = 4, SCRATCH_PARTS = 24 };
typedef struct {
    size_t off[SCRATCH_PARTS];
    size_t total;
    int n, overflow;
} scratch_plan;
/* Add a part of count elements of elem bytes to p; returns its index. */
CLOVER_HIDDEN int scratch_add(scratch_plan *p, int64_t count, size_t elem);
/* The base of slot `slot` of c's scratch holding p's parts (grown when smaller, kept), or NULL
 * when a size overflowed or the allocation failed. */
CLOVER_HIDDEN char *scratch_carve(clover_context *c, int slot, const scratch_plan *p);
/* n_threads blocks of `per` elements of elem bytes each (64-byte aligned) in c's SCRATCH_THREADS
 * slot: thread i of a parallel region (thread_index) owns base + i * *stride bytes. NULL when a
 * size overflows or memory is short. */
CLOVER_HIDDEN void *thread_scratch(clover_context *c, int64_t per, size_t elem, size_t *stride);
/* Part i of a carved plan (NULL when base is NULL). */
static inline void *scratch_part(char *base, const scratch_plan *p, int i) { return base ? base + p->off[i] : NULL; }

/* y = W x for T rows, on the GPU when W was offloaded (clover_model_offload; its error message
 * into err, when given), else on the CPU with n_threads. CLOVER_OK, or the failure's code
 * (CLOVER_E_NOMEM on the CPU). */
CLOVER_HIDDEN int wmatmul(const clover_tensor *w, const float *x, int64_t T, float *y, int n_threads, char *err, size_t err_size);
/* Expert e of a 3-D expert tensor as a 2-D view. */
CLOVER_HIDDEN clover_tensor expert_view(const clover_tensor *w, int64_t e);
/* wmatmul with the pass's threads; a failed GPU product's code into f->gpu_rc (see pass.c). */
CLOVER_HIDDEN int matmul(fwd *f, const clover_tensor *w, const float *x, int64_t T, float *y);
/* A device tensor as the clover_cuda_* products take it (expert matrices stride bytes apart). */
CLOVER_HIDDEN clover_cuda_weight cuda_weight(const clover_tensor *w);
/* CLOVER_E_ARG naming the first token id outside [0, n_vocab). */
CLOVER_HIDDEN int check_tokens(const clover_model *m, const int32_t *tokens, int32_t n, char *err, size_t err_size);
/* A pending clover_context_abort, consumed: CLOVER_E_ABORTED naming layer il, else CLOVER_OK. */
CLOVER_HIDDEN int check_abort(fwd *f, int il);
/* A pass's final residual x [f->T][n_embd] (rows at positions f->pos0..) through output_norm, in
 * place, into f->ereq's pooling. */
CLOVER_HIDDEN void embed_rows(const fwd *f, float *x);
/* CLOVER_E_NUMERIC naming `what` of layer il (il < 0: the LM head) when x[0..n) is not finite. */
CLOVER_HIDDEN int check_finite(fwd *f, const float *x, int64_t n, int il, const char *what);

#endif
