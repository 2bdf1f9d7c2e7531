/* sampler.c: one candidate token and its confidence per logits row (clover-spec 5.3).
 *
 * Order: temperature, top-k, top-p (penalties and biases come first, in the decoder; min-p is
 * a later issue). At temperature 0 the candidate is the argmax and its confidence the softmax
 * probability. Above 0 the candidate is drawn from the processed distribution and its
 * confidence is min(p_argmax, exp((z_drawn - z_max) / T)), so an unlikely draw waits.
 * The mask token is never a candidate.
 */
#include "engine.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

/* splitmix64 seeding of xoroshiro128+ (Blackman and Vigna). */
static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

void clover_rng_seed(clover_rng *r, uint64_t seed) {
    r->s[0] = splitmix64(&seed);
    r->s[1] = splitmix64(&seed);
}

static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

float clover_rng_uniform(clover_rng *r) {
    uint64_t s0 = r->s[0], s1 = r->s[1], out = s0 + s1;
    s1 ^= s0;
    r->s[0] = rotl(s0, 24) ^ s1 ^ (s1 << 16);
    r->s[1] = rotl(s1, 37);
    return (float)(out >> 40) * (1.0f / 16777216.0f); /* 24 random bits */
}

typedef struct {
    float z;
    int32_t id;
} zid;

static int by_z_desc(const void *a, const void *b) {
    const zid *x = a, *y = b;
    if (x->z != y->z) return x->z < y->z ? 1 : -1;
    return x->id < y->id ? -1 : x->id > y->id;
}

int32_t clover_sample(const float *logits, int32_t n_vocab, const clover_sampler_params *sp, clover_rng *rng,
                      float *confidence, float *scratch, int32_t *iscratch) {
    (void)iscratch;
    int32_t best = -1;
    float zmax = -FLT_MAX;
    for (int32_t i = 0; i < n_vocab; i++) {
        if (i == sp->mask_token_id) continue;
        if (best < 0 || logits[i] > zmax) {
            zmax = logits[i];
            best = i;
        }
    }
    if (best < 0) {
        *confidence = 0;
        return -1;
    }
    if (!(sp->temperature > 0.0f)) {
        double sum = 0;
        for (int32_t i = 0; i < n_vocab; i++)
            if (i != sp->mask_token_id) sum += exp((double)logits[i] - zmax);
        *confidence = (float)(1.0 / sum);
        return best;
    }
    const float T = sp->temperature;
    const int filter = (sp->top_k > 0 && sp->top_k < n_vocab) || sp->top_p < 1.0f;
    int32_t n = 0;
    zid *cand = NULL;
    if (filter) {
        cand = malloc(sizeof(zid) * (size_t)n_vocab);
        if (!cand) { /* no memory: fall back to the greedy candidate */
            *confidence = 1.0f;
            return best;
        }
        for (int32_t i = 0; i < n_vocab; i++)
            if (i != sp->mask_token_id) cand[n++] = (zid){logits[i], i};
        qsort(cand, (size_t)n, sizeof(zid), by_z_desc);
        if (sp->top_k > 0 && sp->top_k < n) n = sp->top_k;
        /* top-p over the tempered distribution of the kept tokens */
        double sum = 0;
        for (int32_t j = 0; j < n; j++) sum += (scratch[j] = (float)exp((double)(cand[j].z - zmax) / T));
        if (sp->top_p < 1.0f) {
            double cum = 0;
            int32_t keep = n;
            for (int32_t j = 0; j < n; j++) {
                cum += scratch[j] / sum;
                if (cum >= sp->top_p) {
                    keep = j + 1;
                    break;
                }
            }
            n = keep;
        }
    } else {
        for (int32_t i = 0; i < n_vocab; i++)
            scratch[i] = i == sp->mask_token_id ? 0.0f : (float)exp((double)(logits[i] - zmax) / T);
        n = n_vocab;
    }
    double sum = 0;
    for (int32_t j = 0; j < n; j++) sum += scratch[j];
    double u = (double)clover_rng_uniform(rng) * sum, cum = 0;
    int32_t pick = n - 1;
    for (int32_t j = 0; j < n; j++) {
        cum += scratch[j];
        if (u < cum && scratch[j] > 0) {
            pick = j;
            break;
        }
    }
    int32_t id = filter ? cand[pick].id : pick;
    if (!filter && id == sp->mask_token_id) id = best;
    float p_argmax = (float)(1.0 / sum); /* the argmax has weight exp(0) = 1 */
    float ratio = expf((logits[id] - zmax) / T);
    *confidence = ratio < p_argmax ? ratio : p_argmax;
    free(cand);
    return id;
}
