/* batch.c: continuous batching (clover.h clover_batch_*): the forwards of the contexts attached
 * to a batch wait in one queue and run together, as llama.cpp's server batches its slots. A
 * pass is run by one of the waiting threads once every attached context has a forward waiting,
 * or when the oldest has waited a quarter of the last pass (0.5 to 50 ms); it takes the queue in
 * arrival order: block passes and recording prefills whole, prefills in chunks of multiples of
 * CLOVER_GDN_CHUNK rows (pass_rows), up to max_rows rows; forwards that cannot share a pass run
 * in a pass of their own. */
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

/* How long the oldest forward waits for a straggler: a quarter of the last pass, 0.5 to 50 ms. */
static double wait_s(const clover_batch *b) {
    const double w = b->last_pass_s / 4;
    return w < 5e-4 ? 5e-4 : w > 5e-2 ? 5e-2 : w;
}

static int ready(const clover_batch *b) {
    return b->head && !b->running && (b->n_waiting >= b->n_attached || now_s() >= b->head->t_arrive + wait_s(b));
}

/* Rows of q that the next pass takes with `room` rows left in it (0: none). */
static int64_t take_rows(const req *q, int64_t room, int first) {
    const int64_t left = q->w.f.T - q->done;
    if (q->whole) return first || left <= room ? left : 0;
    if (left <= room) return left;
    const int64_t chunk = room / CLOVER_GDN_CHUNK * CLOVER_GDN_CHUNK;
    return chunk > 0 ? pass_rows(left, chunk) : 0;
}

/* Choose the next pass's entries from the queue (b->mu held): in arrival order, a forward that
 * runs alone only at the head, the others while rows are left. */
static int choose(clover_batch *b, pass_entry *e, req **who) {
    int n = 0;
    int64_t rows = 0;
    for (req *q = b->head; q && n < BATCH_MAX_ENTRIES; q = q->next) {
        if (q->alone) {
            if (n == 0) e[0] = q->w, who[n++] = q;
            break;
        }
        const int64_t k = take_rows(q, b->max_rows - rows, n == 0);
        if (k <= 0) continue;
        e[n] = q->whole ? q->w : pass_chunk(&q->w, q->done, k);
        who[n++] = q;
        rows += k;
    }
    return n;
}

/* Run one pass on this thread (b->mu held on entry and return; released while it computes) with
 * lead's scratch and threads, then hand each forward its rows' outcome. */
static void run_pass(clover_batch *b, pass_fn run, clover_context *lead) {
    pass_entry e[BATCH_MAX_ENTRIES];
    req *who[BATCH_MAX_ENTRIES];
    const int n = choose(b, e, who);
    int64_t rows = 0;
    for (int i = 0; i < n; i++) rows += e[i].f.T;
    b->running = 1;
    pthread_mutex_unlock(&b->mu);
    const double t0 = now_s();
    run(e, n, lead);
    const double dt = now_s() - t0;
    pthread_mutex_lock(&b->mu);
    b->running = 0;
    b->last_pass_s = dt;
    b->st.n_passes++, b->st.n_rows += rows, b->st.n_entries += n, b->st.n_shared += n > 1;
    if (n > b->st.max_entries) b->st.max_entries = n;
    for (int i = 0; i < n; i++) {
        req *q = who[i];
        q->done += e[i].f.T;
        q->w.rc = e[i].rc;
        q->finished = e[i].rc != CLOVER_OK || q->done >= q->w.f.T || q->alone;
    }
    for (req **p = &b->head; *p;) /* the finished leave the queue */
        if ((*p)->finished) *p = (*p)->next;
        else p = &(*p)->next;
    pthread_cond_broadcast(&b->cv);
}

int batch_forward(clover_batch *b, pass_entry *w, pass_fn run) {
    clover_context *c = w->f.c;
    req r = {*w, 0, w->f.mode == MODE_BLOCK || c->rec_on, 0, 0, 0.0, NULL};
    r.alone = w->f.ereq || w->f.sreq || c->m->gpu_bytes || c->m->resident;
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
