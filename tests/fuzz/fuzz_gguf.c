/* fuzz_gguf.c: seeded, structure-aware fuzzing of the GGUF reader and the model loader.
 *
 * Reads valid seed files (any architecture and quant type), maps where each field of each seed
 * lies (header counts, KV keys / value types / values / string lengths / array types and counts,
 * tensor names / dims / types / offsets, general.alignment, padding, tensor data), and feeds
 * mutants of them to clover_gguf_open_memory + every accessor, clover_model_load_memory and, for
 * every FORWARD_EVERY-th mutant that loads, a context and a forward (prefill; block mode on
 * clover files). A mutant is 1-4 operations: an interesting value written into one field, bit
 * flips, random bytes, NaN/Inf written into tensor data, a truncation, bytes inserted into or
 * deleted from the metadata. The same --seed gives the same inputs (xorshift64*, no time or
 * address dependence), so iteration I is reproduced with --only I.
 *
 * Built by CMake with -DCLOVER_FUZZ=ON (with -DCLOVER_SANITIZE=ON for ASan + UBSan: truncated
 * tails are poisoned so any read past the end is reported). A crash (sanitizer report, signal)
 * or an input taking more than --timeout seconds writes the input to OUT/crash-*.gguf and exits
 * non-zero; an error without a message also counts as a finding. Prints one JSON summary line.
 *
 *   fuzz_gguf [--iters N] [--seed S] [--forward-every K] [--timeout SEC] [--out DIR] [--only I]
 *             [--truncate-all] [--replay] FILE...
 *   --truncate-all: every prefix of every FILE up to its data section (every byte; all of a file
 *                   under 64 KiB), then every 4093rd byte of the rest; no mutation.
 *   --replay:       each FILE as it is (the regression corpus).
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "clover.h"

#if defined(__SANITIZE_ADDRESS__)
#define HAVE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HAVE_ASAN 1
#endif
#endif
#ifdef HAVE_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define POISON(p, n) ((void)(p), (void)(n))
#define UNPOISON(p, n) ((void)(p), (void)(n))
#endif

enum { K_MAGIC, K_VERSION, K_NTENSORS, K_NKV, K_KEYLEN, K_KEY, K_VTYPE, K_SCALAR, K_STRLEN, K_STR, K_ARRTYPE,
       K_ARRN, K_TNAMELEN, K_TNAME, K_TNDIMS, K_TDIM, K_TTYPE, K_TOFFSET, K_ALIGN, K_PAD, K_DATA, K_COUNT };
static const char *KIND_NAME[K_COUNT] = {"magic", "version", "n_tensors", "n_kv", "key_len", "key", "value_type",
                                         "scalar", "string_len", "string", "array_type", "array_n",
                                         "tensor_name_len", "tensor_name", "n_dims", "dim", "tensor_type",
                                         "tensor_offset", "alignment", "padding", "data"};

typedef struct {
    uint64_t off, len; /* len: 1/2/4/8 for numbers, else a byte range */
    int kind;
} field;

typedef struct {
    const char *path;
    uint8_t *buf; /* 64-byte aligned copy, cap bytes (tail past size poisoned) */
    uint64_t size, cap, data_start;
    field *f;
    int64_t nf, nf_kind[K_COUNT];
    int64_t *by_kind[K_COUNT];
} seed;

/* ------------------------------------------------------------------ state for crash reports */
static const char *g_out = ".";
static const uint8_t *g_cur;
static uint64_t g_cur_n;
static int64_t g_iter = -1;
static int g_seed_idx = -1;

static void dump_current(const char *why) {
    char path[1024];
    snprintf(path, sizeof path, "%s/crash-%s-s%d-i%" PRId64 ".gguf", g_out, why, g_seed_idx, g_iter);
    FILE *fp = fopen(path, "wb");
    if (fp) {
        if (g_cur && g_cur_n) fwrite(g_cur, 1, (size_t)g_cur_n, fp);
        fclose(fp);
    }
    fprintf(stderr, "fuzz_gguf: %s at iteration %" PRId64 " (seed file %d), input written to %s\n", why, g_iter,
            g_seed_idx, path);
}

static void on_death(void) { dump_current("crash"); }
static void on_signal(int sig) {
    dump_current(sig == SIGALRM ? "timeout" : sig == SIGABRT ? "abort" : "signal");
    _exit(sig == SIGALRM ? 3 : 4);
}

/* ------------------------------------------------------------------ random numbers */
static uint64_t rng_state;
static uint64_t rnd(void) {
    rng_state ^= rng_state >> 12, rng_state ^= rng_state << 25, rng_state ^= rng_state >> 27;
    return rng_state * 0x2545F4914F6CDD1DULL;
}
static uint64_t below(uint64_t n) { return n ? rnd() % n : 0; }

/* ------------------------------------------------------------------ seed structure */
static int add_field(seed *s, uint64_t off, uint64_t len, int kind) {
    if (s->nf % 1024 == 0) {
        field *nf = realloc(s->f, sizeof *nf * (size_t)(s->nf + 1024));
        if (!nf) return 0;
        s->f = nf;
    }
    s->f[s->nf++] = (field){off, len, kind};
    s->nf_kind[kind]++;
    return 1;
}

static uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static const uint64_t VSIZE[13] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};

/* Map the fields of a valid seed (walks the layout; returns 0 if the seed is not well formed). */
static int map_fields(seed *s) {
    const uint8_t *p = s->buf;
    uint64_t pos = 24, n = s->size;
#define NEED(k) do { if ((k) > n - pos || pos > n) return 0; } while (0)
    if (n < 24) return 0;
    add_field(s, 0, 4, K_MAGIC), add_field(s, 4, 4, K_VERSION), add_field(s, 8, 8, K_NTENSORS),
        add_field(s, 16, 8, K_NKV);
    const uint64_t nt = rd64(p + 8), nkv = rd64(p + 16);
    uint64_t align = 32;
    for (uint64_t i = 0; i < nkv; i++) {
        NEED(8);
        uint64_t kl = rd64(p + pos);
        add_field(s, pos, 8, K_KEYLEN), pos += 8;
        NEED(kl);
        add_field(s, pos, kl, K_KEY);
        int is_align = kl == 17 && memcmp(p + pos, "general.alignment", 17) == 0;
        pos += kl;
        NEED(4);
        uint32_t t = rd32(p + pos);
        add_field(s, pos, 4, K_VTYPE), pos += 4;
        uint64_t cnt = 1;
        uint32_t et = t;
        if (t == 9) {
            NEED(12);
            et = rd32(p + pos), add_field(s, pos, 4, K_ARRTYPE), pos += 4;
            cnt = rd64(p + pos), add_field(s, pos, 8, K_ARRN), pos += 8;
        }
        if (et > 12 || et == 9) return 0;
        for (uint64_t j = 0; j < cnt; j++) {
            if (et == 8) {
                NEED(8);
                uint64_t sl = rd64(p + pos);
                add_field(s, pos, 8, K_STRLEN), pos += 8;
                NEED(sl);
                if (sl) add_field(s, pos, sl, K_STR);
                pos += sl;
            } else {
                NEED(VSIZE[et]);
                if (is_align && VSIZE[et] == 4) align = rd32(p + pos);
                if (j < 64 || cnt < 256) add_field(s, pos, VSIZE[et], is_align ? K_ALIGN : K_SCALAR);
                pos += VSIZE[et];
            }
        }
    }
    for (uint64_t i = 0; i < nt; i++) {
        NEED(8);
        uint64_t nl = rd64(p + pos);
        add_field(s, pos, 8, K_TNAMELEN), pos += 8;
        NEED(nl);
        add_field(s, pos, nl, K_TNAME), pos += nl;
        NEED(4);
        uint32_t nd = rd32(p + pos);
        add_field(s, pos, 4, K_TNDIMS), pos += 4;
        if (nd > 4) return 0;
        for (uint32_t d = 0; d < nd; d++) {
            NEED(8);
            add_field(s, pos, 8, K_TDIM), pos += 8;
        }
        NEED(12);
        add_field(s, pos, 4, K_TTYPE), pos += 4;
        add_field(s, pos, 8, K_TOFFSET), pos += 8;
    }
    if (align == 0) return 0;
    uint64_t ds = (pos + align - 1) / align * align;
    if (ds > pos && ds <= n) add_field(s, pos, ds - pos, K_PAD);
    s->data_start = ds <= n ? ds : n;
    if (n > s->data_start) add_field(s, s->data_start, n - s->data_start, K_DATA);
    for (int k = 0; k < K_COUNT; k++) {
        s->by_kind[k] = malloc(sizeof(int64_t) * (size_t)(s->nf_kind[k] + 1));
        if (!s->by_kind[k]) return 0;
        s->nf_kind[k] = 0;
    }
    for (int64_t i = 0; i < s->nf; i++) s->by_kind[s->f[i].kind][s->nf_kind[s->f[i].kind]++] = i;
    return 1;
#undef NEED
}

static uint8_t *aligned_copy(const uint8_t *src, uint64_t n, uint64_t *cap_out) {
    uint64_t cap = (n + 63) / 64 * 64;
    if (cap == 0) cap = 64;
    uint8_t *b = aligned_alloc(64, (size_t)cap);
    if (!b) return NULL;
    if (n) memcpy(b, src, (size_t)n);
    memset(b + n, 0, (size_t)(cap - n));
    POISON(b + n, cap - n);
    *cap_out = cap;
    return b;
}

static void free_aligned(uint8_t *b, uint64_t cap) {
    if (!b) return;
    UNPOISON(b, cap);
    free(b);
}

static int load_seed(seed *s, const char *path, int need_fields) {
    memset(s, 0, sizeof *s);
    s->path = path;
    FILE *fp = fopen(path, "rb");
    if (!fp) return fprintf(stderr, "fuzz_gguf: %s: %s\n", path, strerror(errno)), 0;
    struct stat st;
    if (fstat(fileno(fp), &st) != 0 || st.st_size < 0) return fclose(fp), 0;
    uint8_t *tmp = malloc((size_t)st.st_size + 1);
    size_t got = tmp ? fread(tmp, 1, (size_t)st.st_size, fp) : 0;
    fclose(fp);
    if (!tmp || got != (size_t)st.st_size) return free(tmp), 0;
    s->size = got;
    s->buf = aligned_copy(tmp, got, &s->cap);
    free(tmp);
    if (!s->buf) return 0;
    if (need_fields && !map_fields(s))
        return fprintf(stderr, "fuzz_gguf: %s: not a well-formed seed\n", path), 0;
    return 1;
}

/* ------------------------------------------------------------------ one input */
typedef struct {
    int64_t inputs, gguf_ok, model_ok, forwards, forward_errors, nan_errors;
    int64_t ops[8], kinds[K_COUNT];
    int64_t findings;
} stats;

static int g_forward_every = 16;

static void check_msg(stats *st, const char *err, const char *what) {
    if (err[0] == '\0') {
        st->findings++;
        fprintf(stderr, "fuzz_gguf: finding at iteration %" PRId64 ": %s failed without a message\n", g_iter, what);
        dump_current("nomessage");
    }
}

static void exercise_gguf(const clover_gguf *g) {
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < clover_gguf_n_kv(g); i++) {
        const char *k = clover_gguf_key(g, i);
        sink += k ? (uint64_t)strlen(k) : 0;
        int t = clover_gguf_kv_type(g, i);
        int64_t n = t == CLOVER_GGUF_ARRAY ? clover_gguf_arr_n(g, i) : 1;
        for (int64_t j = 0; j < n && j < 64; j++) {
            size_t len = 0;
            const char *s = clover_gguf_get_str(g, i, j, &len);
            sink += s ? len : (uint64_t)clover_gguf_get_i64(g, i, j) + (uint64_t)clover_gguf_get_f64(g, i, j);
        }
        sink += (uint64_t)clover_gguf_get_i64(g, i, n); /* one past the end: must be refused quietly */
    }
    for (int64_t t = 0; t < clover_gguf_n_tensors(g); t++) {
        int64_t ne = 1;
        for (int d = 0; d < 4; d++) ne *= clover_gguf_tensor_ne(g, t, d);
        sink += clover_gguf_tensor_nbytes(g, t) + (uint64_t)clover_gguf_tensor_type(g, t);
        if (clover_gguf_tensor_nbytes(g, t) <= 16384 && ne > 0 && ne <= 65536) {
            float *out = malloc(sizeof(float) * (size_t)ne);
            char err[256];
            if (out) clover_gguf_tensor_to_f32(g, t, out, ne, err, sizeof err);
            free(out);
        }
    }
    (void)sink;
}

static void exercise_model(clover_model *m, stats *st) {
    clover_hparams hp;
    clover_model_hparams(m, &hp);
    char err[512];
    clover_context *c = clover_context_new(m, 16, 1, CLOVER_TYPE_F16, CLOVER_TYPE_F16, err, sizeof err);
    if (!c) return check_msg(st, err, "clover_context_new");
    float *logits = malloc(sizeof(float) * (size_t)hp.n_vocab * 4);
    int32_t tok[4] = {0, hp.n_vocab - 1, hp.n_vocab / 2, 1 % hp.n_vocab};
    if (logits) {
        st->forwards++;
        err[0] = '\0';
        int rc = clover_prefill(c, tok, 2, logits, 1, err, sizeof err);
        if (rc == CLOVER_OK && hp.has_block) {
            for (int j = 0; j < 4; j++) tok[j] = hp.mask_token_id >= 0 ? hp.mask_token_id : 0;
            rc = clover_block_forward(c, tok, 4, 0.9f, logits, NULL, err, sizeof err);
        }
        if (rc != CLOVER_OK) {
            st->forward_errors++;
            if (strstr(err, "non-finite")) st->nan_errors++;
            check_msg(st, err, "forward");
        }
    }
    free(logits);
    clover_context_free(c);
}

static void run_input(const uint8_t *buf, uint64_t n, stats *st, int allow_forward) {
    char err[512];
    g_cur = buf, g_cur_n = n;
    st->inputs++;
    clover_gguf *g = clover_gguf_open_memory(buf, (size_t)n, err, sizeof err);
    if (g) {
        st->gguf_ok++;
        exercise_gguf(g);
        clover_gguf_close(g);
    } else {
        check_msg(st, err, "clover_gguf_open_memory");
    }
    clover_model *m = clover_model_load_memory(buf, (size_t)n, err, sizeof err);
    if (m) {
        st->model_ok++;
        if (allow_forward && g_forward_every > 0 && st->model_ok % g_forward_every == 1) exercise_model(m, st);
        clover_model_free(m);
    } else if (g) {
        check_msg(st, err, "clover_model_load_memory");
    }
}

/* ------------------------------------------------------------------ mutations */
typedef struct {
    uint64_t off;
    uint8_t old[16];
    uint64_t len;
} undo;

static uint64_t interesting(uint64_t cur, int width, uint64_t fsize) {
    const uint64_t mx = width >= 8 ? UINT64_MAX : ((1ULL << (8 * width)) - 1);
    switch (below(22)) {
    case 0: return 0;
    case 1: return 1;
    case 2: return 2 + below(15);
    case 3: return mx;
    case 4: return mx - 1 - below(4);
    case 5: return mx / 2;
    case 6: return mx / 2 + 1;
    case 7: return 0x7fffffffULL + below(3);
    case 8: return 0xffffffffULL - 1 + below(3);
    case 9: return fsize;
    case 10: return fsize + 1;
    case 11: return fsize - 1 - below(64);
    case 12: return cur + 1;
    case 13: return cur - 1;
    case 14: return cur * 2;
    case 15: return cur / 2;
    case 16: return cur ^ (1ULL << below(8 * (uint64_t)width));
    case 17: return 1ULL << below(8 * (uint64_t)width);
    case 18: return (uint64_t)(int64_t)-(int64_t)(1 + below(8));
    case 19: return 13 + below(40); /* just past known types / ids */
    case 20: return cur + 32 * (1 + below(8));
    default: return rnd();
    }
}

static void save(undo *u, int *nu, uint8_t *buf, uint64_t off, uint64_t len) {
    u[*nu].off = off, u[*nu].len = len;
    memcpy(u[*nu].old, buf + off, (size_t)len);
    (*nu)++;
}

/* One in-place operation (size unchanged); records what it overwrote in u. */
static void mutate_in_place(seed *s, undo *u, int *nu, stats *st) {
    uint8_t *b = s->buf;
    int op = (int)below(4);
    st->ops[op]++;
    if (op == 0) { /* an interesting value into one numeric field of a random kind */
        int kind;
        do kind = (int)below(K_COUNT); while (s->nf_kind[kind] == 0);
        const field *f = &s->f[s->by_kind[kind][below((uint64_t)s->nf_kind[kind])]];
        st->kinds[kind]++;
        if (f->len == 1 || f->len == 2 || f->len == 4 || f->len == 8) {
            uint64_t cur = 0;
            memcpy(&cur, b + f->off, (size_t)f->len);
            uint64_t v = interesting(cur, (int)f->len, s->size);
            save(u, nu, b, f->off, f->len);
            memcpy(b + f->off, &v, (size_t)f->len);
        } else { /* byte ranges (names, strings, padding, data): overwrite a few bytes inside */
            uint64_t k = 1 + below(f->len < 8 ? f->len : 8), o = f->off + below(f->len - k + 1);
            save(u, nu, b, o, k);
            static const uint8_t special[] = {0, '.', 0xff, 0x80, '%', '\n'};
            for (uint64_t j = 0; j < k; j++) b[o + j] = below(2) ? special[below(sizeof special)] : (uint8_t)rnd();
        }
    } else if (op == 1) { /* bit flips, 80% inside the metadata */
        uint64_t lim = below(5) ? s->data_start : s->size;
        if (!lim) lim = s->size;
        for (int j = 0, nb = 1 + (int)below(4); j < nb; j++) {
            uint64_t o = below(lim);
            save(u, nu, b, o, 1);
            b[o] ^= (uint8_t)(1u << below(8));
        }
    } else if (op == 2) { /* random bytes */
        uint64_t k = 1 + below(8);
        if (k > s->size) k = s->size;
        uint64_t lim = (below(5) ? s->data_start : s->size);
        if (lim < k) lim = s->size;
        uint64_t o = below(lim - k + 1);
        save(u, nu, b, o, k);
        for (uint64_t j = 0; j < k; j++) b[o + j] = (uint8_t)rnd();
    } else { /* NaN / Inf / huge float into the data section (norms, scales, weights) */
        if (s->size < s->data_start + 4) return;
        uint64_t o = s->data_start + below(s->size - s->data_start - 3);
        o -= (o - s->data_start) % 2;
        uint64_t k = (o + 4 <= s->size) ? 4 : 2;
        save(u, nu, b, o, k);
        static const uint32_t f32[] = {0x7fc00000u, 0x7f800000u, 0xff800000u, 0x7f7fffffu};
        static const uint16_t f16[] = {0x7e00u, 0x7c00u, 0xfc00u, 0x7bffu};
        if (k == 4 && below(2)) memcpy(b + o, &f32[below(4)], 4);
        else memcpy(b + o, &f16[below(4)], 2);
    }
}

/* A mutant of s whose size differs: truncated (in place, tail poisoned) or with bytes inserted
 * into / deleted from the metadata (a new buffer). Returns the buffer to run and its size. */
static uint8_t *mutate_size(seed *s, uint64_t *n_out, uint64_t *cap_out, int *fresh, stats *st) {
    if (below(2)) { /* truncation */
        st->ops[4]++;
        uint64_t n = below(3) ? below(s->data_start + 1) : below(s->size);
        POISON(s->buf + n, s->cap - n);
        *n_out = n, *fresh = 0;
        return s->buf;
    }
    uint64_t meta = s->data_start ? s->data_start : s->size;
    uint64_t at = below(meta), k = 1 + below(below(4) ? 8 : 256);
    int ins = (int)below(2);
    st->ops[ins ? 5 : 6]++;
    if (!ins && at + k > s->size) k = s->size - at;
    uint64_t n = ins ? s->size + k : s->size - k;
    uint8_t *tmp = malloc((size_t)n + 1);
    if (!tmp) return NULL;
    memcpy(tmp, s->buf, (size_t)at);
    if (ins) {
        for (uint64_t j = 0; j < k; j++) tmp[at + j] = below(2) ? (uint8_t)rnd() : s->buf[below(meta)];
        memcpy(tmp + at + k, s->buf + at, (size_t)(s->size - at));
    } else {
        memcpy(tmp + at, s->buf + at + k, (size_t)(s->size - at - k));
    }
    uint8_t *b = aligned_copy(tmp, n, cap_out);
    free(tmp);
    *n_out = n, *fresh = 1;
    return b;
}

/* ------------------------------------------------------------------ main */
static void usage(void) {
    fprintf(stderr, "usage: fuzz_gguf [--iters N] [--seed S] [--forward-every K] [--timeout SEC] [--out DIR] "
                    "[--only I] [--truncate-all] [--replay] FILE...\n");
    exit(2);
}

int main(int argc, char **argv) {
    int64_t iters = 100000, only = -1;
    uint64_t seed0 = 1;
    unsigned timeout = 10;
    int mode_trunc = 0, mode_replay = 0, nfiles = 0;
    const char **files = calloc((size_t)argc, sizeof *files);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--iters") && i + 1 < argc) iters = atoll(argv[++i]);
        else if (!strcmp(a, "--seed") && i + 1 < argc) seed0 = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(a, "--forward-every") && i + 1 < argc) g_forward_every = atoi(argv[++i]);
        else if (!strcmp(a, "--timeout") && i + 1 < argc) timeout = (unsigned)atoi(argv[++i]);
        else if (!strcmp(a, "--out") && i + 1 < argc) g_out = argv[++i];
        else if (!strcmp(a, "--only") && i + 1 < argc) only = atoll(argv[++i]);
        else if (!strcmp(a, "--truncate-all")) mode_trunc = 1;
        else if (!strcmp(a, "--replay")) mode_replay = 1;
        else if (a[0] == '-') usage();
        else files[nfiles++] = a;
    }
    if (!nfiles || iters < 0) usage();
    if (only >= iters) iters = only + 1;
#ifdef HAVE_ASAN
    __sanitizer_set_death_callback(on_death);
#endif
    signal(SIGALRM, on_signal);
    signal(SIGSEGV, on_signal);
    signal(SIGBUS, on_signal);
    signal(SIGFPE, on_signal);
    signal(SIGILL, on_signal);
    signal(SIGABRT, on_signal); /* UBSan reports end in abort() with UBSAN_OPTIONS=abort_on_error=1 */

    seed *seeds = calloc((size_t)nfiles, sizeof *seeds);
    stats st;
    memset(&st, 0, sizeof st);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < nfiles; i++)
        if (!load_seed(&seeds[i], files[i], !mode_replay)) return 2;

    if (mode_replay) {
        for (int i = 0; i < nfiles; i++) {
            g_seed_idx = i, g_iter = 0;
            alarm(timeout);
            run_input(seeds[i].buf, seeds[i].size, &st, 1);
            alarm(0);
        }
    } else if (mode_trunc) {
        for (int i = 0; i < nfiles; i++) {
            seed *s = &seeds[i];
            g_seed_idx = i;
            uint64_t every = s->size < 65536 ? s->size : s->data_start;
            for (uint64_t n = 0; n < s->size; n += n < every ? 1 : 4093) {
                g_iter = (int64_t)n;
                POISON(s->buf + n, s->cap - n);
                alarm(timeout);
                run_input(s->buf, n, &st, 0);
                alarm(0);
                UNPOISON(s->buf, s->size);
            }
        }
    } else {
        rng_state = seed0 * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL;
        undo u[8];
        for (int64_t it = 0; it < iters; it++) {
            /* every iteration draws from its own stream so --only I reproduces iteration I */
            rng_state = (seed0 + 1) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)(it + 1) * 0xD1B54A32D192ED03ULL;
            rnd(), rnd();
            const int si = (int)below((uint64_t)nfiles);
            seed *s = &seeds[si];
            int nops = 1 + (int)below(below(2) ? 1 : 4), nu = 0;
            int sized = below(8) == 0;
            if (only >= 0 && it != only) continue;
            g_seed_idx = si, g_iter = it;
            for (int k = 0; k < nops && nu < 4; k++) mutate_in_place(s, u, &nu, &st);
            uint64_t n = s->size, cap = s->cap;
            int fresh = 0;
            uint8_t *b = s->buf;
            if (sized) b = mutate_size(s, &n, &cap, &fresh, &st);
            if (b) {
                alarm(timeout);
                run_input(b, n, &st, 1);
                alarm(0);
            }
            if (fresh) free_aligned(b, cap);
            else if (n != s->size) UNPOISON(s->buf, s->size);
            for (int k = nu - 1; k >= 0; k--) memcpy(s->buf + u[k].off, u[k].old, (size_t)u[k].len);
        }
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double secs = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
    printf("{\"mode\": \"%s\", \"files\": %d, \"inputs\": %" PRId64 ", \"gguf_ok\": %" PRId64 ", \"model_ok\": %" PRId64
           ", \"forwards\": %" PRId64 ", \"forward_errors\": %" PRId64 ", \"nonfinite_errors\": %" PRId64
           ", \"findings\": %" PRId64 ", \"seconds\": %.1f, \"seed\": %" PRIu64 ", \"ops\": {\"value\": %" PRId64
           ", \"bitflip\": %" PRId64 ", \"bytes\": %" PRId64 ", \"nan\": %" PRId64 ", \"truncate\": %" PRId64
           ", \"insert\": %" PRId64 ", \"delete\": %" PRId64 "}, \"fields\": {",
           mode_replay ? "replay" : mode_trunc ? "truncate-all" : "mutate", nfiles, st.inputs, st.gguf_ok, st.model_ok,
           st.forwards, st.forward_errors, st.nan_errors, st.findings, secs, seed0, st.ops[0], st.ops[1], st.ops[2],
           st.ops[3], st.ops[4], st.ops[5], st.ops[6]);
    for (int k = 0; k < K_COUNT; k++) printf("%s\"%s\": %" PRId64, k ? ", " : "", KIND_NAME[k], st.kinds[k]);
    printf("}}\n");
    for (int i = 0; i < nfiles; i++) {
        free_aligned(seeds[i].buf, seeds[i].cap);
        free(seeds[i].f);
        for (int k = 0; k < K_COUNT; k++) free(seeds[i].by_kind[k]);
    }
    free(seeds);
    free(files);
    return st.findings ? 1 : 0;
}
