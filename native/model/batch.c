/* batch.c: continuous batching (clover.h clover_batch_*): the forwards of the contexts attached
 * to a batch wait in one queue and run together, as llama.cpp's server batches its slots. A
 * pass is run by one of the waiting threads once every attached context has a forward waiting,
 * or when the oldest has waited twice the last pass (0.5 to 50 ms); choose() says which
 * forwards (and which rows of a long prefill) it takes; forwards that cannot share a pass run in
 * a pass of their own. */
#define _POSIX_C_SOURCE 200809L
#include "model/batch.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

enum { BATCH_ROWS = 512, BATCH_MAX_ENTRIES = 64 };

/* One waiting forward: the whole request, the rows done, how it may be cut. */
typedef struct req {
    pass_entry w;
    int64_t done;
    int whole, alone, finished;
    double t_arrive;
    struct req *next;
} req;

struct clover_batch {
    clover_model *m;
    int32_t max_rows;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n_attached, n_waiting, running;
    req *head;
    double last_pass_s;
    clover_batch_stats st;
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* How long the oldest forward waits for a straggler: twice the last pass, 0.5 to 50 ms (an
 * attached context is generating: between two forwards it samples and hands out its token; on a
 * busy 2-core machine 8 sequences' threads took longer than one pass to come back). */
static double wait_s(const clover_batch *b) {
    const double w = 2 * b->last_pass_s;
    return w < 5e-4 ? 5e-4 : w > 5e-2 ? 5e-2 : w;
}

static int ready(const clover_batch *b) {
    return b->head && !b->running && (b->n_waiting >= b->n_attached || now_s() >= b->head->t_arrive + wait_s(b));
}

/* Rows of q to go. */
static int64_t left_of(const req *q) { return q->w.f.T - q->done; }

/* Rows of a chunk of q's prefill with `room` rows left in the pass: a multiple of
 * CLOVER_GDN_CHUNK (pass_rows; 0: none fits). */
static int64_t chunk_rows(const req *q, int64_t room) {
    const int64_t chunk = room / CLOVER_GDN_CHUNK * CLOVER_GDN_CHUNK;
    return chunk > 0 ? pass_rows(left_of(q), chunk) : 0;
}

/* Choose the next pass's entries from the queue at head, in arrival order up to the first forward
 * that runs alone (which runs alone when it heads the queue): first every forward that fits whole
 * (decode rows, block passes, short prefills), keeping CLOVER_GDN_CHUNK rows for the long
 * prefills when there are any, then the long prefills in chunks in the rows left (llama.cpp's
 * server puts its slots' decode tokens first, then prompt chunks): a long prompt delays the
 * running sequences by one chunk a pass and still advances every pass. A forward at the head
 * always goes. */
static int choose(req *head, int32_t max_rows, pass_entry *e, req **who) {
    if (head && head->alone) {
        e[0] = head->w, who[0] = head;
        return 1;
    }
    int n = 0, any_long = 0;
    int64_t rows = 0;
    for (req *q = head; q && !q->alone; q = q->next) any_long |= !q->whole && left_of(q) > max_rows;
    const int64_t keep = any_long ? CLOVER_GDN_CHUNK : 0;
    for (req *q = head; q && !q->alone && n < BATCH_MAX_ENTRIES; q = q->next) {
        const int64_t k = left_of(q);
        if ((q->whole || k + keep <= max_rows) && (q == head || rows + k + keep <= max_rows)) {
            e[n] = q->done ? pass_chunk(&q->w, q->done, k) : q->w;
            who[n++] = q;
            rows += k;
        }
    }
    for (req *q = head; q && !q->alone && n < BATCH_MAX_ENTRIES; q = q->next) {
        int taken = 0;
        for (int i = 0; i < n; i++) taken |= who[i] == q;
        const int64_t k = taken || q->whole ? 0 : chunk_rows(q, max_rows - rows);
        if (k <= 0) continue;
        e[n] = pass_chunk(&q->w, q->done, k);
        who[n++] = q;
        rows += k;
    }
    return n;
}

/* After a pass of the n entries e of forwards who: each forward's rows done and outcome; the
 * finished leave the queue at *head. */
static void finish(req **head, pass_entry *e, req **who, int n) {
    for (int i = 0; i < n; i++) {
        req *q = who[i];
        q->done += e[i].f.T;
        q->w.rc = e[i].rc;
        q->finished = e[i].rc != CLOVER_OK || q->done >= q->w.f.T || q->alone;
    }
    for (req **p = head; *p;)
        if ((*p)->finished) *p = (*p)->next;
        else p = &(*p)->next;
}

/* Rows of the n entries e. */
static int64_t rows_of(const pass_entry *e, int n) {
    int64_t rows = 0;
    for (int i = 0; i < n; i++) rows += e[i].f.T;
    return rows;
}

/* Run one pass on this thread (b->mu held on entry and return; released while it computes) with
 * lead's scratch and threads, then hand each forward its rows' outcome. */
static void run_pass(clover_batch *b, pass_fn run, clover_context *lead) {
    pass_entry e[BATCH_MAX_ENTRIES];
    req *who[BATCH_MAX_ENTRIES];
    const int n = choose(b->head, b->max_rows, e, who);
    b->running = 1;
    pthread_mutex_unlock(&b->mu);
    const double t0 = now_s();
    run(e, n, lead);
    const double dt = now_s() - t0;
    pthread_mutex_lock(&b->mu);
    b->running = 0;
    b->last_pass_s = dt;
    b->st.n_passes++, b->st.n_rows += rows_of(e, n), b->st.n_entries += n, b->st.n_shared += n > 1;
    if (n > b->st.max_entries) b->st.max_entries = n;
    finish(&b->head, e, who, n);
    pthread_cond_broadcast(&b->cv);
}

/* A forward of w as a queued request: whole (a block pass, a recording prefill) or alone (what
 * cannot share a pass: an embedding, a selection, a model with weights on the GPU). */
static req request(const pass_entry *w) {
    const clover_context *c = w->f.c;
    req r = {*w, 0, w->f.mode == MODE_BLOCK || c->rec_on, 0, 0, 0.0, NULL};
    r.alone = w->f.ereq || w->f.sreq || c->m->gpu_bytes || c->m->resident;
    return r;
}

void batch_run(pass_entry *w, int n, int32_t max_rows, pass_fn run) {
    req *q = calloc((size_t)n, sizeof *q), *head = NULL;
    if (!q) {
        for (int i = 0; i < n; i++) w[i].rc = clover_set_err(w[i].f.err, w[i].f.err_size, CLOVER_E_NOMEM, "out of memory");
        return;
    }
    for (int i = n - 1; i >= 0; i--) q[i] = request(&w[i]), q[i].next = head, head = &q[i];
    pass_entry e[BATCH_MAX_ENTRIES];
    req *who[BATCH_MAX_ENTRIES];
    while (head) {
        const int k = choose(head, max_rows, e, who);
        run(e, k, w[0].f.c);
        finish(&head, e, who, k);
    }
    for (int i = 0; i < n; i++) w[i].rc = q[i].w.rc;
    free(q);
}

int batch_forward(clover_batch *b, pass_entry *w, pass_fn run) {
    clover_context *c = w->f.c;
    req r = request(w);
    pthread_mutex_lock(&b->mu);
    r.t_arrive = now_s();
    req **tail = &b->head;
    while (*tail) tail = &(*tail)->next;
    *tail = &r;
    b->n_waiting++;
    c->in_forward = 1;
    while (!r.finished) {
        if (ready(b)) {
            run_pass(b, run, c);
            continue;
        }
        if (b->running || b->n_waiting >= b->n_attached) {
            pthread_cond_wait(&b->cv, &b->mu);
        } else { /* a straggler: wait for it until the oldest forward's time is up */
            const double until = b->head->t_arrive + wait_s(b);
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            const double d = until - now_s();
            if (d > 0) {
                const long long ns = (long long)ts.tv_nsec + (long long)(d * 1e9);
                ts.tv_sec += (time_t)(ns / 1000000000LL);
                ts.tv_nsec = (long)(ns % 1000000000LL);
                pthread_cond_timedwait(&b->cv, &b->mu, &ts);
            }
        }
    }
    b->n_waiting--;
    c->in_forward = 0;
    pthread_mutex_unlock(&b->mu);
    return w->rc = r.w.rc;
}

clover_batch *clover_batch_new(clover_model *m, int32_t max_rows, char *err, size_t err_size) {
    if (!m) {
        clover_set_err(err, err_size, CLOVER_E_ARG, "model is NULL");
        return NULL;
    }
    clover_batch *b = calloc(1, sizeof *b);
    if (!b) {
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "out of memory");
        return NULL;
    }
    b->m = m;
    b->max_rows = max_rows <= 0 ? BATCH_ROWS
                  : max_rows < CLOVER_GDN_CHUNK ? CLOVER_GDN_CHUNK
                                                : max_rows / CLOVER_GDN_CHUNK * CLOVER_GDN_CHUNK;
    if (pthread_mutex_init(&b->mu, NULL) != 0) {
        free(b);
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "pthread_mutex_init failed");
        return NULL;
    }
    if (pthread_cond_init(&b->cv, NULL) != 0) {
        pthread_mutex_destroy(&b->mu);
        free(b);
        clover_set_err(err, err_size, CLOVER_E_NOMEM, "pthread_cond_init failed");
        return NULL;
    }
    return b;
}

int clover_batch_free(clover_batch *b) {
    if (!b) return CLOVER_OK;
    pthread_mutex_lock(&b->mu);
    const int attached = b->n_attached;
    pthread_mutex_unlock(&b->mu);
    if (attached) return CLOVER_E_STATE;
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free(b);
    return CLOVER_OK;
}

/* Add d to b's attached count (a leaving context may complete the waiting set). */
static void attach(clover_batch *b, int d) {
    pthread_mutex_lock(&b->mu);
    b->n_attached += d;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

int clover_context_set_batch(clover_context *c, clover_batch *b, char *err, size_t err_size) {
    if (!c) return clover_set_err(err, err_size, CLOVER_E_ARG, "context is NULL");
    if (b && b->m != c->m)
        return clover_set_err(err, err_size, CLOVER_E_ARG, "batch: made for another model than the context's");
    if (c->in_forward)
        return clover_set_err(err, err_size, CLOVER_E_STATE, "batch: the context's forward is running");
    if (c->batch == b) return CLOVER_OK;
    if (c->batch) attach(c->batch, -1);
    if (b) attach(b, 1);
    c->batch = b;
    return CLOVER_OK;
}

void clover_batch_get_stats(const clover_batch *b, clover_batch_stats *out) {
    if (!out) return;
    clover_batch_stats s = {0};
    if (b) {
        pthread_mutex_lock((pthread_mutex_t *)&b->mu);
        s = b->st;
        pthread_mutex_unlock((pthread_mutex_t *)&b->mu);
    }
    *out = s;
}
