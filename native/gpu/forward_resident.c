/* forward_resident.c: the GPU-resident forward (every layer and the output on the GPU): the same
 * layer loop as model/forward.c's cpu_forward (clover-spec 2: rmsnorm -> mixer -> residual ->
 * rmsnorm -> MoE -> residual per layer, then N1p and the LM head), its steps queued on the device
 * (gpu/attention_resident.c, gpu/gdn_resident.c, gpu/moe_resident.c), optionally replayed
 * through CUDA graphs.
 * Twin: model/forward.c (the CPU path). */
#define _POSIX_C_SOURCE 200809L
#include "gpu/forward_resident.h"
#include "gpu/attention_resident.h"
#include "gpu/device_state.h"
#include "gpu/gdn_resident.h"
#include "gpu/moe_resident.h"
#include "gpu/select_resident.h"
#include "quant/matmul.h"
#include "quant/quants.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

int64_t clover_context_graph_launches(const clover_context *c) { return c ? c->n_graph_launches : 0; }

int64_t clover_context_full_rows(const clover_context *c) { return c ? c->n_full_rows : 0; }

int64_t clover_context_passes(const clover_context *c) { return c ? c->n_passes : 0; }

/* CUDA graphs record every launch on the backend's one stream, so they run only while the process
 * has a single context that uses the GPU (one counts from its first forward on a model with
 * weights there, model/forward.c forward, until it is freed; contexts on the CPU alone never launch):
 * g_graph_mu is held over a graph's pass (record or replay) and over the count's changes, so no
 * other context's launches or copies can fall into a recording, and no other context's forward
 * can move the scratch a graph holds. */
static pthread_mutex_t g_graph_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_n_gpu_contexts;

/* The LM head of forward() on the device for the n rows whose indices res_forward uploaded to
 * b->idx (idx: the same on the host), groups of RES_LM rows; rows != NULL: row idx[i] of logits
 * is written, else rows from 0. */
static int res_lm_head(fwd *f, const res_bufs *b, const int32_t *idx, int64_t n, float *logits, const uint8_t *rows) {
    const clover_model *m = f->c->m;
    const int64_t H = m->hp.n_embd, V = m->hp.n_vocab;
    scratch_plan p = {0};
    const int ilg = scratch_add(&p, RES_LM * V, sizeof(float));
    float *lg = rows ? scratch_part(scratch_carve(f->c, SCRATCH_LAYER, &p), &p, ilg) : NULL;
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
static int res_layer_loop(fwd *f, const res_bufs *b, int64_t rec_row, int64_t n) {
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
            (rc = ly->is_attn ? res_attention_layer(f, ly, b) : res_gdn_layer(f, ly, b, rec_row)) ||
            (rc = clover_cuda_add_d(b->x, b->o, T * H, b->flags + 2 * il, err, es)) ||
            (rc = clover_cuda_rmsnorm_d(b->x, H, NULL, ly->dev.post_norm, H, T, hp->rms_eps, b->xn, H, err, es)))
            break;
        rc = res_moe_layer(f, ly, il, b);
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

/* res_layer_loop through a CUDA graph (passes of at most RES_LM rows with the selection on the GPU: ar's
 * decode steps, diffusion's denoising passes and commits, spec's drafts and verifies; and
 * one-row passes that return logits, as llama.cpp's decode of one token, the LM head then
 * running after the graph): the
 * first pass with a new key runs plainly (its scratch grows then), the next one records a graph,
 * and the following ones replay it. The context keeps the graphs of its last four keys, so a
 * diffusion block's commit and denoising passes keep theirs. CLOVER_CUDA_GRAPHS=0 turns this
 * off. */
static int res_layer_loop_graph(fwd *f, const res_bufs *b, int64_t n) {
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
                rc = res_layer_loop(f, b, 0, n);
                const int rc2 = clover_cuda_capture_end(&c->graph[i].exec, f->err, f->err_size);
                if (rc == CLOVER_OK) rc = rc2;
            }
            if (rc != CLOVER_OK) {
                clover_cuda_graph_free(c->graph[i].exec);
                c->graph[i].exec = NULL;
                if (rc == CLOVER_E_ABORTED) return rc;
                c->graphs = 0; /* the device cannot record this: plain passes for this context */
                return res_layer_loop(f, b, 0, n);
            }
        }
        if ((rc = check_abort(f, 0)) == CLOVER_OK &&
            (rc = clover_cuda_graph_launch(c->graph[i].exec, f->err, f->err_size)) == CLOVER_OK)
            c->n_graph_launches++;
        return rc;
    }
    rc = res_layer_loop(f, b, 0, n); /* first seen: plainly, then its key (with the scratch it grew) in the oldest slot */
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
int res_forward(fwd *f, const int32_t *tokens, int64_t rec_row, float *logits, int64_t logit_row0,
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
    scratch_plan up_plan = {0};
    scratch_add(&up_plan, (int64_t)up_bytes, 1);
    char *up = scratch_carve(c, SCRATCH_PASS, &up_plan);
    if (up) memset(up, 0, up_bytes); /* cleared flags */
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
                      !m->cpu_experts && !f->ereq; /* no host work inside; an embedding's length varies */
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
        rc = g_n_gpu_contexts == 1 ? res_layer_loop_graph(f, &b, n) : res_layer_loop(f, &b, rec_row, n);
        pthread_mutex_unlock(&g_graph_mu);
    } else if (rc == CLOVER_OK) {
        rc = res_layer_loop(f, &b, rec_row, n);
    }
    if (rc == CLOVER_OK && n && !f->sreq && !(rc = check_abort(f, (int)L))) rc = res_lm_head(f, &b, idx, n, logits, rows);
    /* an embedding pass: the final residual back into the upload's rows, output_norm on the host */
    if (rc == CLOVER_OK && f->ereq) rc = clover_cuda_read(b.x, 0, x, sizeof(float) * (size_t)(T * H), err, es);
    /* the flags after the logits, or with the selection (no wait in between); a non-finite layer
     * output is named first */
    if (rc == CLOVER_OK && n && f->sreq) rc = res_select_read(f, &b, idx, n, rows, flags);
    else if (rc == CLOVER_OK) rc = clover_cuda_read(b.flags, 0, flags, sizeof(int32_t) * (size_t)(4 * L), err, es);
    for (int il = 0; il < L && rc == CLOVER_OK; il++)
        if (flags[2 * il] || flags[2 * il + 1])
            rc = clover_set_err(err, es, CLOVER_E_NUMERIC, "non-finite value after layer %d (blk.%d) %s (on the GPU, "
                                "%lld rows)", il, il, flags[2 * il] ? (m->layers[il].is_attn ? "attention" : "gated deltanet")
                                                                   : "moe", (long long)T);
    if (rc == CLOVER_OK && f->ereq) embed_rows(f, x);
    if (rc == CLOVER_OK && logits && !rows && n) rc = check_finite(f, logits, n * V, -1, NULL);
    for (int64_t i = 0; logits && rows && i < n && rc == CLOVER_OK; i++)
        rc = check_finite(f, logits + idx[i] * V, V, -1, NULL);
    for (int il = 0; il < L && rc == CLOVER_OK; il++) {
        if (f->n_experts_out) f->n_experts_out[il] = flags[2 * L + 2 * il];
        if (f->mode == MODE_BLOCK) c->nexp_full[il] = flags[2 * L + 2 * il + 1];
    }
    return rc;
}

/* Count c among the contexts that use the GPU (once, at its first forward on a model with weights
 * there): CUDA graphs run only while there is one. */
void gpu_context_count(clover_context *c) {
    if (c->gpu_counted) return;
    pthread_mutex_lock(&g_graph_mu);
    g_n_gpu_contexts++;
    c->gpu_counted = 1;
    pthread_mutex_unlock(&g_graph_mu);
}

/* Undo gpu_context_count at clover_context_free; the last such context gives the backend's shared
 * scratch back. */
void gpu_context_uncount(clover_context *c) {
    if (!c->gpu_counted) return;
    pthread_mutex_lock(&g_graph_mu);
    if (--g_n_gpu_contexts == 0) clover_cuda_release_scratch();
    pthread_mutex_unlock(&g_graph_mu);
    c->gpu_counted = 0;
}
