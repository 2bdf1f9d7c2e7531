/* gguf.c: validating, mmap-based reader for GGUF v2/v3 files (spec 4).
 *
 * Format (little-endian; ggml's docs/gguf.md):
 *   header   magic "GGUF", uint32 version, uint64 n_tensors, uint64 n_kv
 *   kv       n_kv times: string key, uint32 value type, value
 *            (string = uint64 length + bytes; array = uint32 element type + uint64 count +
 *            elements)
 *   tensors  n_tensors times: string name, uint32 n_dims, int64 ne[n_dims], uint32 ggml type,
 *            uint64 offset (relative to the data section)
 *   data     starts at the end of the tensor infos rounded up to general.alignment (default 32)
 *
 * The whole file is mapped read-only and kept mapped; tensor data is served straight from the
 * mapping. Every read is checked against the bytes left before it is trusted (as ggml's
 * gguf.cpp does): counts that the remaining bytes could not hold are rejected before any
 * allocation, string lengths and array sizes are overflow-checked against the bytes left,
 * shapes, types, byte sizes, offsets and alignment are validated, and duplicate keys or
 * tensor names are errors. Messages name the field and the value. A file that passes
 * clover_gguf_open() can be walked through the accessors without further checks.
 *
 * Supported tensor types are the ones this engine can run: F32, F16, BF16, Q8_0. Any other
 * ggml type is rejected at open with the tensor name and the type.
 */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "clover.h"
#include "core/ggml_types.h"
#include "quant/quants.h"

#define GGUF_DEFAULT_ALIGNMENT 32
/* Lower bounds on the bytes one entry occupies, used to reject counts the file cannot hold
 * before anything is allocated. KV: key length (8) + a non-empty key (1) + value type (4) +
 * the smallest value (1). Tensor info: name length (8) + a non-empty name (1) + n_dims (4) +
 * one ne (8) + type (4) + offset (8). */
#define GGUF_KV_MIN_BYTES 14u
#define GGUF_TENSOR_MIN_BYTES 33u
#define MAX_DIMS 4

typedef struct {
    char *key;
    int type;             /* CLOVER_GGUF_* */
    int arr_type;         /* element type for arrays, -1 otherwise */
    uint64_t n;           /* element count; 1 for scalars */
    const uint8_t *data;  /* numeric/bool values: their bytes in the mapping */
    char *blob;           /* string values: NUL-terminated copies, back to back in order
                           * (clover_gguf/gguf.py reads a string array in one copy) */
    uint64_t *str_off;    /* string j is blob + str_off[j], length str_off[j+1]-str_off[j]-1 */
} gguf_kv;

typedef struct {
    char *name;
    int type;
    int n_dims;
    int64_t ne[MAX_DIMS];
    uint64_t offset; /* absolute file offset */
    uint64_t nbytes;
} gguf_tensor;

/* open-addressing string -> index table (index + 1 stored; 0 = empty slot) */
typedef struct {
    int64_t *slots;
    uint64_t mask;
} name_table;

struct clover_gguf {
    const uint8_t *map;
    uint64_t size;
    int owns_map; /* 1: map is our mmap of a file (munmap on close); 0: caller's memory */
    uint32_t version;
    uint64_t alignment;
    uint64_t data_start;
    int64_t n_kv;
    int64_t n_tensors;
    gguf_kv *kv;
    gguf_tensor *tensors;
    name_table kv_index;
    name_table tensor_index;
};

/* ---------------------------------------------------------------- errors */

typedef struct {
    const uint8_t *p;
    uint64_t pos, size;
    char *err;
    size_t err_size;
    char where[160]; /* e.g. "kv 3 (key 'general.name')" */
} reader;

static void set_err(char *err, size_t err_size, const char *fmt, ...) {
    if (err == NULL || err_size == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
}

/* Message "<where>: <text>". */
static void fail(reader *r, const char *fmt, ...) {
    if (r->err == NULL || r->err_size == 0) return;
    char msg[384];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (r->where[0])
        snprintf(r->err, r->err_size, "%s: %s", r->where, msg);
    else
        snprintf(r->err, r->err_size, "%s", msg);
}

/* A printable, bounded copy of a name for messages (names come from the file). */
static void printable(char *dst, size_t cap, const char *s, size_t len) {
    size_t o = 0;
    for (size_t i = 0; i < len && o + 4 < cap; i++) {
        const unsigned char c = (unsigned char)s[i];
        dst[o++] = (c >= 0x20 && c < 0x7f) || c >= 0x80 ? (char)c : '?';
    }
    if (len > 0 && o < len && o + 4 >= cap) {
        memcpy(dst + o, "...", 3);
        o += 3;
    }
    dst[o] = '\0';
}

/* ---------------------------------------------------------------- bounded reads */

static uint64_t left(const reader *r) { return r->size - r->pos; }

static int need(reader *r, uint64_t n, const char *what) {
    if (n > left(r)) {
        fail(r, "%s: unexpected end of file at offset %" PRIu64 " (need %" PRIu64 " bytes, %" PRIu64
                " left)",
             what, r->pos, n, left(r));
        return 0;
    }
    return 1;
}

static int read_u32(reader *r, uint32_t *v, const char *what) {
    if (!need(r, 4, what)) return 0;
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return 1;
}

static int read_u64(reader *r, uint64_t *v, const char *what) {
    if (!need(r, 8, what)) return 0;
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return 1;
}

/* Read a GGUF string (uint64 length + bytes) as a fresh NUL-terminated copy. */
static char *read_string(reader *r, const char *what, uint64_t *len_out) {
    uint64_t len;
    if (!read_u64(r, &len, what)) return NULL;
    if (len > left(r)) {
        fail(r, "%s: string length %" PRIu64 " exceeds remaining %" PRIu64 " bytes", what, len, left(r));
        return NULL;
    }
    char *s = malloc((size_t)len + 1);
    if (s == NULL) {
        fail(r, "%s: out of memory for a string of %" PRIu64 " bytes", what, len);
        return NULL;
    }
    memcpy(s, r->p + r->pos, (size_t)len);
    s[len] = '\0';
    r->pos += len;
    if (len_out) *len_out = len;
    return s;
}

/* ---------------------------------------------------------------- name tables */

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ull;
    }
    return h;
}

static int table_init(name_table *t, int64_t n) {
    uint64_t cap = 8;
    while (cap < (uint64_t)n * 2) cap <<= 1;
    t->slots = calloc((size_t)cap, sizeof(int64_t));
    t->mask = cap - 1;
    return t->slots != NULL;
}

/* Insert names[idx] (names read through get); returns the index of an existing equal name,
 * or -1 after inserting. */
typedef const char *(*name_of)(const clover_gguf *g, int64_t i);

static int64_t table_insert(name_table *t, const clover_gguf *g, name_of get, int64_t idx) {
    const char *name = get(g, idx);
    uint64_t h = hash_str(name) & t->mask;
    while (t->slots[h]) {
        const int64_t other = t->slots[h] - 1;
        if (strcmp(get(g, other), name) == 0) return other;
        h = (h + 1) & t->mask;
    }
    t->slots[h] = idx + 1;
    return -1;
}

static int64_t table_find(const name_table *t, const clover_gguf *g, name_of get, const char *name) {
    if (t->slots == NULL || name == NULL) return -1;
    uint64_t h = hash_str(name) & t->mask;
    while (t->slots[h]) {
        const int64_t idx = t->slots[h] - 1;
        if (strcmp(get(g, idx), name) == 0) return idx;
        h = (h + 1) & t->mask;
    }
    return -1;
}

static const char *kv_name(const clover_gguf *g, int64_t i) { return g->kv[i].key; }
static const char *tensor_name(const clover_gguf *g, int64_t i) { return g->tensors[i].name; }

/* ---------------------------------------------------------------- types */

static const char *value_type_name(uint32_t t) {
    static const char *names[] = {"uint8", "int8",   "uint16", "int16", "uint32", "int32",  "float32",
                                  "bool",  "string", "array",  "uint64", "int64", "float64"};
    return t < sizeof names / sizeof names[0] ? names[t] : "unknown";
}

/* Byte size of a fixed-size value type; 0 for string/array/unknown. */
static uint64_t value_type_size(uint32_t t) {
    switch (t) {
    case CLOVER_GGUF_UINT8: case CLOVER_GGUF_INT8: case CLOVER_GGUF_BOOL: return 1;
    case CLOVER_GGUF_UINT16: case CLOVER_GGUF_INT16: return 2;
    case CLOVER_GGUF_UINT32: case CLOVER_GGUF_INT32: case CLOVER_GGUF_FLOAT32: return 4;
    case CLOVER_GGUF_UINT64: case CLOVER_GGUF_INT64: case CLOVER_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* Whether ggml type t is one this engine runs, with its block size and bytes (the ggml type
 * table, core/ggml_types.c) and the alignment its elements need. */
static int engine_type(uint32_t t, int64_t *block, uint64_t *block_bytes, uint64_t *elem_align) {
    switch (t) {
    case CLOVER_TYPE_F32: *elem_align = 4; break;
    case CLOVER_TYPE_MXFP4: *elem_align = 1; break;
    case CLOVER_TYPE_F16: case CLOVER_TYPE_BF16: case CLOVER_TYPE_Q8_0: case CLOVER_TYPE_Q4_0: case CLOVER_TYPE_IQ4_NL:
    case CLOVER_TYPE_Q2_K: case CLOVER_TYPE_Q3_K: case CLOVER_TYPE_Q4_K: case CLOVER_TYPE_Q5_K: case CLOVER_TYPE_Q6_K:
    case CLOVER_TYPE_IQ4_XS: *elem_align = 2; break;
    default: return 0;
    }
    const clover_ggml_type *e = clover_ggml_type_of(t);
    *block = e->block;
    *block_bytes = (uint64_t)e->block_bytes;
    return 1;
}

/* ---------------------------------------------------------------- parsing */

static void free_contents(clover_gguf *g) {
    if (g->kv) {
        for (int64_t i = 0; i < g->n_kv; i++) {
            free(g->kv[i].key);
            free(g->kv[i].blob);
            free(g->kv[i].str_off);
        }
        free(g->kv);
    }
    if (g->tensors) {
        for (int64_t i = 0; i < g->n_tensors; i++) free(g->tensors[i].name);
        free(g->tensors);
    }
    free(g->kv_index.slots);
    free(g->tensor_index.slots);
}

/* Strings of one KV value (a scalar string or an array of n strings): validate every length
 * against the bytes left, then copy them all into one blob. */
static int read_strings(reader *r, gguf_kv *kv, uint64_t n) {
    const uint64_t start = r->pos;
    uint64_t total = 0; /* sum of lengths; bounded by the file size */
    char what[64];
    for (uint64_t j = 0; j < n; j++) {
        uint64_t len;
        if (n > 1 || kv->type == CLOVER_GGUF_ARRAY)
            snprintf(what, sizeof what, "string %" PRIu64, j);
        else
            snprintf(what, sizeof what, "string value");
        if (!read_u64(r, &len, what)) return 0;
        if (len > left(r)) {
            fail(r, "%s: string length %" PRIu64 " exceeds remaining %" PRIu64 " bytes", what, len, left(r));
            return 0;
        }
        r->pos += len;
        total += len;
    }
    /* n <= bytes / 8 and total <= bytes, so these sizes cannot overflow */
    kv->blob = malloc((size_t)(total + n) + 1);
    kv->str_off = malloc((size_t)(n + 1) * sizeof(uint64_t));
    if (kv->blob == NULL || kv->str_off == NULL) {
        fail(r, "out of memory for %" PRIu64 " strings (%" PRIu64 " bytes)", n, total);
        return 0;
    }
    uint64_t pos = start, o = 0;
    for (uint64_t j = 0; j < n; j++) {
        uint64_t len;
        memcpy(&len, r->p + pos, 8);
        pos += 8;
        kv->str_off[j] = o;
        memcpy(kv->blob + o, r->p + pos, (size_t)len);
        kv->blob[o + len] = '\0';
        o += len + 1;
        pos += len;
    }
    kv->str_off[n] = o;
    return 1;
}

static int parse_kv(reader *r, clover_gguf *g, int64_t i) {
    gguf_kv *kv = &g->kv[i];
    kv->arr_type = -1;
    kv->n = 1;
    snprintf(r->where, sizeof r->where, "kv %" PRId64, i);

    uint64_t key_len;
    kv->key = read_string(r, "key", &key_len);
    if (kv->key == NULL) return 0;
    char shown[96];
    printable(shown, sizeof shown, kv->key, (size_t)key_len);
    snprintf(r->where, sizeof r->where, "kv %" PRId64 " (key '%s')", i, shown);
    if (key_len == 0) {
        fail(r, "empty key");
        return 0;
    }
    if (strlen(kv->key) != key_len) {
        fail(r, "key contains a NUL byte");
        return 0;
    }
    const int64_t dup = table_insert(&g->kv_index, g, kv_name, i);
    if (dup >= 0) {
        fail(r, "duplicate key (first defined by kv %" PRId64 ")", dup);
        return 0;
    }

    uint32_t type;
    if (!read_u32(r, &type, "value type")) return 0;
    if (type > CLOVER_GGUF_FLOAT64) {
        fail(r, "value type %" PRIu32 " is not a GGUF type (0..12)", type);
        return 0;
    }
    kv->type = (int)type;
    uint32_t elem = type;
    uint64_t n = 1;
    if (type == CLOVER_GGUF_ARRAY) {
        if (!read_u32(r, &elem, "array element type")) return 0;
        if (elem > CLOVER_GGUF_FLOAT64) {
            fail(r, "array element type %" PRIu32 " is not a GGUF type (0..12)", elem);
            return 0;
        }
        if (elem == CLOVER_GGUF_ARRAY) {
            fail(r, "nested arrays are not supported");
            return 0;
        }
        if (!read_u64(r, &n, "array count")) return 0;
        kv->arr_type = (int)elem;
        kv->n = n;
    }

    if (elem == CLOVER_GGUF_STRING) {
        if (n > left(r) / 8) { /* every string needs at least its 8-byte length */
            fail(r, "array of %" PRIu64 " strings exceeds remaining %" PRIu64 " bytes", n, left(r));
            return 0;
        }
        return read_strings(r, kv, n);
    }
    const uint64_t esize = value_type_size(elem);
    if (n > left(r) / esize) {
        if (type == CLOVER_GGUF_ARRAY)
            fail(r, "array of %" PRIu64 " %s values (%" PRIu64 " bytes each) exceeds remaining %" PRIu64 " bytes",
                 n, value_type_name(elem), esize, left(r));
        else
            fail(r, "%s value: unexpected end of file at offset %" PRIu64 " (need %" PRIu64 " bytes, %" PRIu64
                    " left)",
                 value_type_name(elem), r->pos, esize, left(r));
        return 0;
    }
    kv->data = r->p + r->pos;
    r->pos += n * esize;
    return 1;
}

static int parse_tensor(reader *r, clover_gguf *g, int64_t i) {
    gguf_tensor *t = &g->tensors[i];
    snprintf(r->where, sizeof r->where, "tensor %" PRId64, i);

    uint64_t name_len;
    t->name = read_string(r, "name", &name_len);
    if (t->name == NULL) return 0;
    char shown[96];
    printable(shown, sizeof shown, t->name, (size_t)name_len);
    snprintf(r->where, sizeof r->where, "tensor %s", shown);
    if (name_len == 0) {
        snprintf(r->where, sizeof r->where, "tensor %" PRId64, i);
        fail(r, "empty name");
        return 0;
    }
    if (strlen(t->name) != name_len) {
        fail(r, "name contains a NUL byte");
        return 0;
    }
    const int64_t dup = table_insert(&g->tensor_index, g, tensor_name, i);
    if (dup >= 0) {
        fail(r, "duplicate tensor name (first defined by tensor info %" PRId64 ", again by %" PRId64 ")", dup, i);
        return 0;
    }

    uint32_t n_dims;
    if (!read_u32(r, &n_dims, "n_dims")) return 0;
    if (n_dims < 1 || n_dims > MAX_DIMS) {
        fail(r, "n_dims %" PRIu32 " not in 1..%d", n_dims, MAX_DIMS);
        return 0;
    }
    t->n_dims = (int)n_dims;
    int64_t nelem = 1;
    for (int d = 0; d < MAX_DIMS; d++) t->ne[d] = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        uint64_t v;
        char what[16];
        snprintf(what, sizeof what, "ne[%" PRIu32 "]", d);
        if (!read_u64(r, &v, what)) return 0;
        if (v > (uint64_t)INT64_MAX) {
            fail(r, "ne[%" PRIu32 "] = %" PRId64 " is negative", d, (int64_t)v);
            return 0;
        }
        t->ne[d] = (int64_t)v;
    }
    for (int d = 0; d < MAX_DIMS; d++) {
        if (t->ne[d] > 0 && nelem > INT64_MAX / t->ne[d]) {
            fail(r, "shape {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "}: element count overflows int64",
                 t->ne[0], t->ne[1], t->ne[2], t->ne[3]);
            return 0;
        }
        nelem *= t->ne[d];
    }

    uint32_t type;
    if (!read_u32(r, &type, "type")) return 0;
    int64_t block;
    uint64_t block_bytes, elem_align;
    if (!engine_type(type, &block, &block_bytes, &elem_align)) {
        fail(r, "ggml type %" PRIu32 " (%s) is not supported by this engine (supported: F32, F16, BF16, Q8_0, Q4_0, "
             "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4)",
             type, clover_ggml_type_label(type));
        return 0;
    }
    t->type = (int)type;
    if (t->ne[0] % block != 0) {
        fail(r, "row length ne[0] = %" PRId64 " is not a multiple of the %s block size %" PRId64, t->ne[0],
             clover_ggml_type_label(type), block);
        return 0;
    }
    const uint64_t n_blocks = (uint64_t)(nelem / block);
    if (n_blocks > UINT64_MAX / block_bytes) {
        fail(r, "byte size of shape {%" PRId64 ", %" PRId64 ", %" PRId64 ", %" PRId64 "} (%s) overflows", t->ne[0],
             t->ne[1], t->ne[2], t->ne[3], clover_ggml_type_label(type));
        return 0;
    }
    t->nbytes = n_blocks * block_bytes;

    uint64_t offset;
    if (!read_u64(r, &offset, "offset")) return 0;
    if (offset % g->alignment != 0) {
        fail(r, "data offset %" PRIu64 " is not a multiple of the alignment %" PRIu64, offset, g->alignment);
        return 0;
    }
    t->offset = offset; /* relative to the data section; made absolute once its start is known */
    (void)elem_align;
    return 1;
}

static int parse(reader *r, clover_gguf *g) {
    snprintf(r->where, sizeof r->where, "header");
    uint8_t magic[4];
    if (!need(r, 4, "magic")) return 0;
    memcpy(magic, r->p, 4);
    r->pos = 4;
    if (memcmp(magic, "GGUF", 4) != 0) {
        char shown[8];
        printable(shown, sizeof shown, (const char *)magic, 4);
        fail(r, "bad magic '%s' (bytes %02x %02x %02x %02x), expected 'GGUF'", shown, magic[0], magic[1], magic[2],
             magic[3]);
        return 0;
    }
    if (!read_u32(r, &g->version, "version")) return 0;
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xffffu) == 0)
            fail(r, "version 0x%08" PRIx32 " looks byte-swapped: big-endian GGUF files are not supported",
                 g->version);
        else
            fail(r, "unsupported GGUF version %" PRIu32 " (supported: 2, 3)", g->version);
        return 0;
    }
    uint64_t n_tensors, n_kv;
    if (!read_u64(r, &n_tensors, "tensor count")) return 0;
    if (!read_u64(r, &n_kv, "kv count")) return 0;
    const uint64_t rest = left(r);
    if (n_tensors > rest / GGUF_TENSOR_MIN_BYTES) {
        fail(r, "tensor count %" PRIu64 " too large: the remaining %" PRIu64 " bytes hold at most %" PRIu64
                " tensor infos",
             n_tensors, rest, rest / GGUF_TENSOR_MIN_BYTES);
        return 0;
    }
    if (n_kv > rest / GGUF_KV_MIN_BYTES) {
        fail(r, "kv count %" PRIu64 " too large: the remaining %" PRIu64 " bytes hold at most %" PRIu64 " kv pairs",
             n_kv, rest, rest / GGUF_KV_MIN_BYTES);
        return 0;
    }
    if (n_kv * GGUF_KV_MIN_BYTES > rest - n_tensors * GGUF_TENSOR_MIN_BYTES) {
        fail(r, "kv count %" PRIu64 " and tensor count %" PRIu64 " too large for the remaining %" PRIu64 " bytes",
             n_kv, n_tensors, rest);
        return 0;
    }

    g->kv = calloc((size_t)n_kv + 1, sizeof(gguf_kv));
    g->tensors = calloc((size_t)n_tensors + 1, sizeof(gguf_tensor));
    if (g->kv == NULL || g->tensors == NULL || !table_init(&g->kv_index, (int64_t)n_kv) ||
        !table_init(&g->tensor_index, (int64_t)n_tensors)) {
        fail(r, "out of memory for %" PRIu64 " kv pairs and %" PRIu64 " tensors", n_kv, n_tensors);
        return 0;
    }

    for (uint64_t i = 0; i < n_kv; i++) {
        g->n_kv = (int64_t)i + 1; /* entries so far, for cleanup and the name table */
        if (!parse_kv(r, g, (int64_t)i)) return 0;
    }
    g->n_kv = (int64_t)n_kv;

    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    const int64_t ai = table_find(&g->kv_index, g, kv_name, "general.alignment");
    if (ai >= 0) {
        snprintf(r->where, sizeof r->where, "kv %" PRId64 " (key 'general.alignment')", ai);
        if (g->kv[ai].type != CLOVER_GGUF_UINT32) {
            fail(r, "type %s, expected uint32", value_type_name((uint32_t)g->kv[ai].type));
            return 0;
        }
        uint32_t a;
        memcpy(&a, g->kv[ai].data, 4);
        if (a == 0 || (a & (a - 1)) != 0) {
            fail(r, "alignment %" PRIu32 " is not a power of two", a);
            return 0;
        }
        g->alignment = a;
    }

    for (uint64_t i = 0; i < n_tensors; i++) {
        g->n_tensors = (int64_t)i + 1;
        if (!parse_tensor(r, g, (int64_t)i)) return 0;
    }
    g->n_tensors = (int64_t)n_tensors;

    /* data section: the end of the tensor infos rounded up to the alignment (pos <= size and
     * alignment <= 2^31, so this cannot overflow) */
    snprintf(r->where, sizeof r->where, "data section");
    g->data_start = (r->pos + g->alignment - 1) / g->alignment * g->alignment;
    if (n_tensors > 0 && g->data_start > g->size) {
        fail(r, "start %" PRIu64 " (tensor infos end at %" PRIu64 ", alignment %" PRIu64
                ") is past end of file (%" PRIu64 " bytes)",
             g->data_start, r->pos, g->alignment, g->size);
        return 0;
    }
    const uint64_t data_size = g->data_start <= g->size ? g->size - g->data_start : 0;
    for (int64_t i = 0; i < g->n_tensors; i++) {
        gguf_tensor *t = &g->tensors[i];
        char shown[96];
        printable(shown, sizeof shown, t->name, strlen(t->name));
        snprintf(r->where, sizeof r->where, "tensor %s", shown);
        if (t->offset > data_size || t->nbytes > data_size - t->offset) {
            fail(r, "offset %" PRIu64 " + size %" PRIu64 " past end of file (%" PRIu64
                    " bytes; data section starts at %" PRIu64 ")",
                 t->offset, t->nbytes, g->size, g->data_start);
            return 0;
        }
        t->offset += g->data_start;
        int64_t block = 1;
        uint64_t block_bytes = 1, elem_align = 1;
        engine_type((uint32_t)t->type, &block, &block_bytes, &elem_align);
        if (t->offset % elem_align != 0) { /* only possible with general.alignment < 4 */
            fail(r, "file offset %" PRIu64 " is not aligned to %" PRIu64 " bytes as %s data needs", t->offset,
                 elem_align, clover_ggml_type_label((uint32_t)t->type));
            return 0;
        }
    }
    return 1;
}

/* Parse the GGUF bytes [map, map + size) into a new clover_gguf that keeps map (owns_map: munmap
 * it on close). NULL with "what: message" in err on any problem (map is then not released). */
static clover_gguf *open_bytes(const void *map, size_t size, int owns_map, const char *what, char *err,
                               size_t err_size) {
    clover_gguf *g = calloc(1, sizeof *g);
    if (g == NULL) {
        set_err(err, err_size, "%s: out of memory", what);
        return NULL;
    }
    g->map = map;
    g->size = size;
    char msg[480];
    msg[0] = '\0';
    reader r = {.p = g->map, .pos = 0, .size = g->size, .err = msg, .err_size = sizeof msg};
    if (!parse(&r, g)) {
        set_err(err, err_size, "%s: %s", what, msg);
        g->map = NULL; /* the caller releases it */
        clover_gguf_close(g);
        return NULL;
    }
    g->owns_map = owns_map;
    return g;
}

clover_gguf *clover_gguf_open(const char *path, char *err, size_t err_size) {
    if (err && err_size) err[0] = '\0';
    {
        const uint16_t one = 1;
        uint8_t low;
        memcpy(&low, &one, 1);
        if (low != 1) {
            set_err(err, err_size, "GGUF reader: big-endian hosts are not supported");
            return NULL;
        }
    }
    if (path == NULL) {
        set_err(err, err_size, "GGUF path is NULL");
        return NULL;
    }
    const int fd = open(path, O_RDONLY);
    if (fd < 0) {
        set_err(err, err_size, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        set_err(err, err_size, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return NULL;
    }
    if (!S_ISREG(st.st_mode)) {
        set_err(err, err_size, "%s: not a regular file", path);
        close(fd);
        return NULL;
    }
    if (st.st_size <= 0) {
        set_err(err, err_size, "%s: header: file is empty (0 bytes)", path);
        close(fd);
        return NULL;
    }
    if ((uint64_t)st.st_size > SIZE_MAX) {
        set_err(err, err_size, "%s: file of %lld bytes cannot be mapped", path, (long long)st.st_size);
        close(fd);
        return NULL;
    }
    const size_t size = (size_t)st.st_size;
    void *map = mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    const int map_errno = errno;
    close(fd); /* the mapping stays valid */
    if (map == MAP_FAILED) {
        set_err(err, err_size, "%s: mmap of %zu bytes failed: %s", path, size, strerror(map_errno));
        return NULL;
    }

    clover_gguf *g = open_bytes(map, size, 1, path, err, err_size);
    if (g == NULL) munmap(map, size);
    return g;
}

clover_gguf *clover_gguf_open_memory(const void *data, size_t size, char *err, size_t err_size) {
    if (err && err_size) err[0] = '\0';
    if (data == NULL) {
        set_err(err, err_size, "GGUF buffer is NULL");
        return NULL;
    }
    if ((uintptr_t)data % GGUF_DEFAULT_ALIGNMENT != 0) {
        set_err(err, err_size, "GGUF buffer at %p is not aligned to %d bytes", data, GGUF_DEFAULT_ALIGNMENT);
        return NULL;
    }
    if (size == 0) {
        set_err(err, err_size, "<memory>: header: buffer is empty (0 bytes)");
        return NULL;
    }
    return open_bytes(data, size, 0, "<memory>", err, err_size);
}

void clover_gguf_close(clover_gguf *g) {
    if (g == NULL) return;
    free_contents(g);
    if (g->map && g->owns_map) munmap((void *)g->map, (size_t)g->size);
    free(g);
}

int clover_gguf_mlock(const clover_gguf *g, char *err, size_t err_size) {
    if (g == NULL || g->map == NULL) {
        set_err(err, err_size, "GGUF is NULL");
        return CLOVER_E_ARG;
    }
    if (mlock(g->map, (size_t)g->size) == 0) return CLOVER_OK;
    set_err(err, err_size, "mlock of %llu bytes failed: %s", (unsigned long long)g->size, strerror(errno));
    return CLOVER_E_IO;
}

/* ---------------------------------------------------------------- KV accessors */

uint32_t clover_gguf_version(const clover_gguf *g) { return g ? g->version : 0; }
int64_t clover_gguf_n_kv(const clover_gguf *g) { return g ? g->n_kv : -1; }

int64_t clover_gguf_find_key(const clover_gguf *g, const char *key) {
    if (g == NULL) return -1;
    return table_find(&g->kv_index, g, kv_name, key);
}

static const gguf_kv *get_kv(const clover_gguf *g, int64_t i) {
    return (g == NULL || i < 0 || i >= g->n_kv) ? NULL : &g->kv[i];
}

const char *clover_gguf_key(const clover_gguf *g, int64_t i) {
    const gguf_kv *kv = get_kv(g, i);
    return kv ? kv->key : NULL;
}

int clover_gguf_kv_type(const clover_gguf *g, int64_t i) {
    const gguf_kv *kv = get_kv(g, i);
    return kv ? kv->type : -1;
}

/* -1 for a scalar (not an array) or an index out of range. */
int clover_gguf_arr_type(const clover_gguf *g, int64_t i) {
    const gguf_kv *kv = get_kv(g, i);
    return kv ? kv->arr_type : -1;
}

/* -1 for a scalar (not an array) or an index out of range. */
int64_t clover_gguf_arr_n(const clover_gguf *g, int64_t i) {
    const gguf_kv *kv = get_kv(g, i);
    return kv && kv->type == CLOVER_GGUF_ARRAY ? (int64_t)kv->n : -1;
}

/* Element j of KV i as a number: *kind 0 = signed (s), 1 = unsigned (u), 2 = float (f).
 * Returns 0 if i/j are out of range or the value is a string. */
typedef struct {
    int kind;
    int64_t s;
    uint64_t u;
    double f;
} num;

static int get_num(const clover_gguf *g, int64_t i, int64_t j, num *out) {
    const gguf_kv *kv = get_kv(g, i);
    if (kv == NULL || j < 0 || (uint64_t)j >= kv->n || kv->data == NULL) return 0;
    const int t = kv->type == CLOVER_GGUF_ARRAY ? kv->arr_type : kv->type;
    const uint8_t *p = kv->data + (uint64_t)j * value_type_size((uint32_t)t);
    memset(out, 0, sizeof *out);
    switch (t) {
    case CLOVER_GGUF_UINT8: { uint8_t v; memcpy(&v, p, 1); out->kind = 1; out->u = v; break; }
    case CLOVER_GGUF_INT8: { int8_t v; memcpy(&v, p, 1); out->s = v; break; }
    case CLOVER_GGUF_UINT16: { uint16_t v; memcpy(&v, p, 2); out->kind = 1; out->u = v; break; }
    case CLOVER_GGUF_INT16: { int16_t v; memcpy(&v, p, 2); out->s = v; break; }
    case CLOVER_GGUF_UINT32: { uint32_t v; memcpy(&v, p, 4); out->kind = 1; out->u = v; break; }
    case CLOVER_GGUF_INT32: { int32_t v; memcpy(&v, p, 4); out->s = v; break; }
    case CLOVER_GGUF_UINT64: { uint64_t v; memcpy(&v, p, 8); out->kind = 1; out->u = v; break; }
    case CLOVER_GGUF_INT64: { int64_t v; memcpy(&v, p, 8); out->s = v; break; }
    case CLOVER_GGUF_BOOL: { uint8_t v; memcpy(&v, p, 1); out->kind = 1; out->u = v != 0; break; }
    case CLOVER_GGUF_FLOAT32: { float v; memcpy(&v, p, 4); out->kind = 2; out->f = v; break; }
    case CLOVER_GGUF_FLOAT64: { double v; memcpy(&v, p, 8); out->kind = 2; out->f = v; break; }
    default: return 0;
    }
    return 1;
}

/* Numeric getters convert between kinds; out-of-range values saturate (NaN -> 0, negative ->
 * 0 for the unsigned getter), floats truncate toward zero. Strings and bad indices give 0. */
int64_t clover_gguf_get_i64(const clover_gguf *g, int64_t i, int64_t j) {
    num v;
    if (!get_num(g, i, j, &v)) return 0;
    if (v.kind == 0) return v.s;
    if (v.kind == 1) return v.u > (uint64_t)INT64_MAX ? INT64_MAX : (int64_t)v.u;
    if (isnan(v.f)) return 0;
    if (v.f >= 9223372036854775808.0) return INT64_MAX;
    if (v.f <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v.f;
}

uint64_t clover_gguf_get_u64(const clover_gguf *g, int64_t i, int64_t j) {
    num v;
    if (!get_num(g, i, j, &v)) return 0;
    if (v.kind == 0) return v.s < 0 ? 0 : (uint64_t)v.s;
    if (v.kind == 1) return v.u;
    if (isnan(v.f) || v.f <= 0.0) return 0;
    if (v.f >= 18446744073709551616.0) return UINT64_MAX;
    return (uint64_t)v.f;
}

double clover_gguf_get_f64(const clover_gguf *g, int64_t i, int64_t j) {
    num v;
    if (!get_num(g, i, j, &v)) return 0.0;
    if (v.kind == 0) return (double)v.s;
    if (v.kind == 1) return (double)v.u;
    return v.f;
}

const char *clover_gguf_get_str(const clover_gguf *g, int64_t i, int64_t j, size_t *len) {
    const gguf_kv *kv = get_kv(g, i);
    if (kv == NULL || kv->blob == NULL || j < 0 || (uint64_t)j >= kv->n) return NULL;
    const uint64_t o = kv->str_off[j];
    if (len) *len = (size_t)(kv->str_off[j + 1] - o - 1);
    return kv->blob + o;
}

/* ---------------------------------------------------------------- tensor accessors */

int64_t clover_gguf_n_tensors(const clover_gguf *g) { return g ? g->n_tensors : -1; }

int64_t clover_gguf_find_tensor(const clover_gguf *g, const char *name) {
    if (g == NULL) return -1;
    return table_find(&g->tensor_index, g, tensor_name, name);
}

static const gguf_tensor *get_tensor(const clover_gguf *g, int64_t t) {
    return (g == NULL || t < 0 || t >= g->n_tensors) ? NULL : &g->tensors[t];
}

const char *clover_gguf_tensor_name(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? x->name : NULL;
}

int clover_gguf_tensor_type(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? x->type : -1;
}

int clover_gguf_tensor_n_dims(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? x->n_dims : -1;
}

/* ne[d] for d in [0, 4) (1 beyond n_dims); -1 for a bad t or d. */
int64_t clover_gguf_tensor_ne(const clover_gguf *g, int64_t t, int d) {
    const gguf_tensor *x = get_tensor(g, t);
    return x && d >= 0 && d < MAX_DIMS ? x->ne[d] : -1;
}

uint64_t clover_gguf_tensor_offset(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? x->offset : 0;
}

uint64_t clover_gguf_tensor_nbytes(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? x->nbytes : 0;
}

const void *clover_gguf_tensor_data(const clover_gguf *g, int64_t t) {
    const gguf_tensor *x = get_tensor(g, t);
    return x ? g->map + x->offset : NULL;
}

int clover_gguf_tensor_to_f32(const clover_gguf *g, int64_t t, float *out, int64_t n_out, char *err,
                              size_t err_size) {
    const gguf_tensor *x = get_tensor(g, t);
    if (x == NULL) {
        set_err(err, err_size, "tensor index %" PRId64 " out of range [0, %" PRId64 ")", t, g ? g->n_tensors : 0);
        return CLOVER_E_ARG;
    }
    const int64_t n = x->ne[0] * x->ne[1] * x->ne[2] * x->ne[3]; /* checked at open */
    if ((out == NULL && n > 0) || n_out < n) {
        set_err(err, err_size, "tensor %s: output capacity %" PRId64 " floats < %" PRId64 " elements", x->name,
                out == NULL ? 0 : n_out, n);
        return CLOVER_E_ARG;
    }
    const int rc = clover_to_f32(x->type, g->map + x->offset, out, n);
    if (rc != CLOVER_OK) set_err(err, err_size, "tensor %s: cannot convert type %d to f32", x->name, x->type);
    return rc;
}
