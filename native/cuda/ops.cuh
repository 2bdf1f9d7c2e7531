/* ops.cuh: part of cuda.cu (included there, in order, after the parts before it): the per-layer operations of the offloaded (non-resident) path: attention launches, reads, the GDN recurrence and block operator, device copies. */
/* Splits of the keys for an attention kernel of n units (blocks or warps) a split: one when those
 * fill the GPU alone, else up to ATT_SPLITS_MAX, about `want` units in all (k_attention: 512
 * blocks; a decode step at 35B-A3B's 2 KV heads takes 64 splits). */
static int att_splits(int64_t n, int64_t want) {
    const int64_t S = (want + n - 1) / n;
    return S < ATT_SPLITS_MAX ? (int)S : ATT_SPLITS_MAX;
}

/* k_attention (and k_attention_merge for several splits, their results in g_att, grown here)
 * over the T rows of Q; caller holds g_lock; launches only. */
static int attention_launch(const float *Q, const void *K, const void *V, int kv_f16, float *O,
                            const int64_t *pos_p, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                            int causal, float scale, char *err, size_t err_size) {
    const int64_t n_rep = n_head / n_kv, n_chunk = (n_rep + ATT_REP - 1) / ATT_REP;
    /* k_attention_mma: a warp per tile of 16 queries, up to ATT_MMA_WARPS of a KV head's tiles a
     * block, per_g blocks a KV head, and splits for about 1024 warps in all (an H200 holds 8 of
     * them an SM); where its vector loads are aligned */
    const bool mma = T >= 2 && T * n_rep >= 16 && (hd == 32 || hd == 64 || hd == 128 || hd == 256) &&
                     ((uintptr_t)Q | (uintptr_t)K | (uintptr_t)V) % 16 == 0 && use_mma();
    const int64_t n_tiles = (T * n_rep + 15) / 16, warps = n_tiles < ATT_MMA_WARPS ? n_tiles : (int64_t)ATT_MMA_WARPS;
    const int64_t per_g = (n_tiles + warps - 1) / warps;
    const int S = mma ? att_splits(n_kv * n_tiles, 1024) : att_splits(T * n_kv * n_chunk, 512);
    float *P = NULL;
    if (S > 1) {
        const int rc = grow(&g_att, sizeof(float) * (size_t)(T * n_head * S * (hd + 2)), err, err_size);
        if (rc != CLOVER_OK) return rc;
        P = (float *)g_att.p;
    }
    if (mma) {
        const dim3 grid((unsigned)(n_kv * per_g), (unsigned)S), block(32, (unsigned)warps);
#define ATT_MMA(HD) LAUNCH(k_attention_mma<HD>, grid, block)(Q, K, V, kv_f16, O, P, pos_p, pos0, T, n_head, n_kv, causal, scale)
        if (hd == 32) ATT_MMA(32);
        else if (hd == 64) ATT_MMA(64);
        else if (hd == 128) ATT_MMA(128);
        else ATT_MMA(256);
#undef ATT_MMA
    }
    const dim3 block(32, (unsigned)(n_rep < (int64_t)ATT_REP ? n_rep : (int64_t)ATT_REP)); /* a warp per query head */
    for (int64_t t0 = 0; t0 < T; t0 += 65535) { /* gridDim.y <= 65535 */
        const unsigned rows = (unsigned)(T - t0 < 65535 ? T - t0 : 65535);
        if (!mma)
            LAUNCH(k_attention, dim3((unsigned)(n_kv * n_chunk), rows, (unsigned)S), block)(
                Q, K, V, kv_f16, O, P, pos_p, pos0, T, t0, n_head, n_kv, hd, causal, scale);
        if (S > 1)
            LAUNCH(k_attention_merge, dim3((unsigned)n_head, rows), dim3(32))(Q, P, O, t0, n_head, hd, S,
                                                                              mma ? n_rep : 0, pos_p, pos0, T, causal);
    }
    return CLOVER_OK;
}

extern "C" int clover_cuda_attention(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                                     int64_t n_ctx, int64_t pos0, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                                     int causal, float scale, float *out, char *err, size_t err_size) {
    if (!q || !k_cache || !v_cache || !out || T <= 0 || pos0 < 0 || n_ctx <= 0 ||
        pos0 + T > n_ctx || n_head <= 0 || n_head > 65535 || n_kv <= 0 || n_head % n_kv || hd <= 0 ||
        hd % 32 || hd > HD_MAX || n_ctx > INT64_MAX / 4 / (n_kv * hd))
        return bad_arg(err, err_size, "attention: bad arguments (T, pos0, n_ctx, heads or head_dim out of range; "
                                      "head_dim must be a multiple of 32 up to 256)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * n_head * 2 * hd), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * n_head * hd), err, err_size);
    float *Q = (float *)g_x.p, *O = (float *)g_y.p;
    if (rc == CLOVER_OK)
        rc = copy(Q, q, sizeof(float) * (size_t)(T * n_head * 2 * hd), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) {
        rc = attention_launch(Q, k_cache, v_cache, kv_f16, O, NULL, pos0, T, n_head, n_kv, hd, causal, scale, err,
                              err_size);
        rc = launched(rc, "attention", err, err_size);
    }
    if (rc == CLOVER_OK)
        rc = copy(out, O, sizeof(float) * (size_t)(T * n_head * hd), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_read(const void *dev, size_t offset, void *host, size_t nbytes, char *err, size_t err_size) {
    if (!dev || (!host && nbytes)) return bad_arg(err, err_size, "read: no buffer");
    return nbytes ? copy(host, (const char *)dev + offset, nbytes, cudaMemcpyDeviceToHost, err, err_size) : CLOVER_OK;
}

/* The chunked forward (gdn_chunk.cuh) of T rows from the device state S [Hv][dk][dv] (updated)
 * into O, in windows of GDN_WINDOW rows (the state carries from one to the next), so its per-chunk
 * products in g_gdn take at most Hv * GDN_WINDOW / 64 slots (about 29 MB at the real model's
 * heads) however long the prompt. Caller holds g_lock; launches only. */
enum { GDN_WINDOW = 8 * GDN_CH };
static int gdn_chunked(const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                       int64_t dk, int64_t dv, int64_t C, float *S, float *O, char *err, size_t err_size) {
    const int64_t W = GDN_WINDOW, max_chunks = (T < W ? T + GDN_CH - 1 : W) / GDN_CH;
    int rc = grow(&g_gdn, sizeof(float) * (size_t)(Hv * max_chunks * gdn_chunk_slot(dk, dv)), err, err_size);
    for (int64_t t0 = 0; t0 < T && rc == CLOVER_OK; t0 += W) {
        const int64_t Tw = T - t0 < W ? T - t0 : W, n_chunks = (Tw + GDN_CH - 1) / GDN_CH;
        const float *cw = conv + t0 * C;
        LAUNCH(k_gdn_chunk_prep, dim3((unsigned)Hv, (unsigned)n_chunks), dim3(256))(cw, beta + t0 * Hv, g + t0 * Hv, Tw, Hk,
                                                                                     Hv, dk, dv, C, (float *)g_gdn.p);
        LAUNCH(k_gdn_chunk_scan, dim3((unsigned)Hv, (unsigned)((dv + GDN_COLS - 1) / GDN_COLS)), dim3(256))(
            cw, Tw, Hk, Hv, dk, dv, C, (const float *)g_gdn.p, S, O + t0 * Hv * dv);
    }
    return rc;
}

/* clover_cuda_gdn's and clover_cuda_gdn_d's arguments: whether they are out of range. */
static bool gdn_bad_args(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                         int64_t Hv, int64_t dk, int64_t dv, int64_t C, const float *state, const float *o) {
    return !conv || !beta || !g || !o || !state || kind < CLOVER_GDN_FORWARD ||
           kind > CLOVER_GDN_FORWARD_CHUNKED || T <= 0 || Hk <= 0 || Hv <= 0 || Hv > INT32_MAX || dk <= 0 ||
           dk > DK_MAX || dv <= 0 || dv > 1024 || C < 2 * Hk * dk + Hv * dv ||
           T > INT64_MAX / 4 / (C > Hv * dv ? C : Hv * dv);
}

/* The GDN of `kind` on device arrays. Caller holds g_lock. */
static int gdn_run(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk, int64_t Hv,
                   int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err, size_t err_size) {
    if (kind == CLOVER_GDN_FORWARD_CHUNKED) return gdn_chunked(conv, beta, g, T, Hk, Hv, dk, dv, C, state, o, err, err_size);
    gdn_launch(conv, beta, g, T, Hk, Hv, dk, dv, C, state, o);
    return CLOVER_OK;
}

extern "C" int clover_cuda_gdn(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                               int64_t Hv, int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err,
                               size_t err_size) {
    if (gdn_bad_args(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o))
        return bad_arg(err, err_size, "gdn: bad arguments (kind, T, heads, dk <= 256, dv <= 1024 or C out of range)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * C), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_gate, sizeof(float) * (size_t)(T * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_up, sizeof(float) * (size_t)(T * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * Hv * dv), err, err_size);
    float *X = (float *)g_x.p, *B = (float *)g_gate.p, *G = (float *)g_up.p, *O = (float *)g_y.p;
    if (rc == CLOVER_OK) rc = copy(X, conv, sizeof(float) * (size_t)(T * C), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(B, beta, sizeof(float) * (size_t)(T * Hv), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(G, g, sizeof(float) * (size_t)(T * Hv), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = gdn_run(kind, X, B, G, T, Hk, Hv, dk, dv, C, state, O, err, err_size);
    rc = launched(rc, "gdn", err, err_size);
    if (rc == CLOVER_OK) rc = copy(o, O, sizeof(float) * (size_t)(T * Hv * dv), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_gdn_block(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                     int64_t C, const float *state, const float *lambda, const float *beta0,
                                     const float *c, int64_t P, float *o, char *err, size_t err_size) {
    if (gdn_block_bad_args(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, o) || P < 0)
        return bad_arg(err, err_size,
                       "gdn_block: bad arguments (T, heads, dk <= 256, dv <= 1024, C or P out of range)");
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * C), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_gate, sizeof(float) * (size_t)(3 * Hv), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * Hv * dv), err, err_size);
    float *X = (float *)g_x.p, *L = (float *)g_gate.p, *O = (float *)g_y.p; /* L: lambda, beta0, c */
    const size_t hb = sizeof(float) * (size_t)Hv;
    if (rc == CLOVER_OK) rc = copy(X, conv, sizeof(float) * (size_t)(T * C), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L, lambda, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L + Hv, beta0, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(L + 2 * Hv, c, hb, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) gdn_block_launch(X, T, Hk, Hv, dk, dv, C, state, L, L + Hv, L + 2 * Hv, NULL, P, O);
    rc = launched(rc, "gdn_block", err, err_size);
    if (rc == CLOVER_OK) rc = copy(o, O, sizeof(float) * (size_t)(T * Hv * dv), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_copy(void *dst, const void *src, size_t nbytes, char *err, size_t err_size) {
    if (!dst || (!src && nbytes)) return bad_arg(err, err_size, "copy: no buffer");
    return nbytes ? copy(dst, src, nbytes, cudaMemcpyDeviceToDevice, err, err_size) : CLOVER_OK;
}
