/* resident.cuh: part of cuda.cu (included there, in order, after the parts before it): the device-resident operations (clover_cuda_*_d of cuda_backend.h), each the GPU form of the CPU function named there. */
extern "C" int clover_cuda_matmul_d(int n, const clover_cuda_weight *w, const float *x, int64_t T, float *const *y,
                                    char *err, size_t err_size) {
    const int64_t ne0 = n > 0 && w ? w[0].ne0 : 0;
    if (n <= 0 || !w || !x || !y || ne0 <= 0 || T <= 0 || ne0 > INT64_MAX / 4 / T)
        return bad_arg(err, err_size, "matmul_d: bad arguments");
    for (int i = 0; i < n; i++)
        if (!w[i].dev || !y[i] || w[i].ne0 != ne0 || w[i].ne1 <= 0 || w[i].ne1 > INT32_MAX)
            return bad_arg(err, err_size, "matmul_d: bad weight (one matrix each, the same ne0)");
    pthread_mutex_lock(&g_lock);
    int rc = CLOVER_OK;
    /* by activation format: none, Q8_0 (32), Q8_K (256); the int8 form in scratch */
    for (int ab = 0; ab <= 256 && rc == CLOVER_OK; ab = ab ? ab * 8 : 32) {
        act a = {x, NULL, NULL, NULL};
        for (int i = 0; i < n && rc == CLOVER_OK; i++) {
            if (act_block(w[i].type) != ab) continue;
            if (ab && !a.q) {
                rc = grow(&g_q, act_q_bytes(T * ne0), err, err_size);
                if (rc == CLOVER_OK) rc = round_act(w[i].type, &a, T, ne0, err, err_size);
            }
            if (rc == CLOVER_OK) rc = product(w[i].type, w[i].dev, 0, ne0, w[i].ne1, a, T, y[i], NULL, 0, err, err_size);
        }
    }
    rc = launched(rc, "matmul_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_rmsnorm_d(const float *x, int64_t x_stride, const int32_t *idx, const float *w, int64_t n,
                                     int64_t rows, float eps, float *y, int64_t y_stride, char *err, size_t err_size) {
    if (!x || !w || !y || n <= 0 || rows <= 0 || rows > INT32_MAX) return bad_arg(err, err_size, "rmsnorm_d: bad arguments");
    LAUNCH(k_rmsnorm, dim3((unsigned)rows), dim3(32))(x, x_stride, idx, w, n, eps, y, y_stride);
    return launched(CLOVER_OK, "rmsnorm_d", err, err_size);
}

extern "C" int clover_cuda_head_norm_rope_d(float *x, int64_t T, int64_t n_head, int64_t row_stride, int64_t head_stride,
                                            const float *w, int64_t hd, float eps, const int64_t *pos, int32_t rope_dim,
                                            float theta, char *err, size_t err_size) {
    if (!x || !w || !pos || T <= 0 || T > 65535 || n_head <= 0 || n_head > INT32_MAX || hd <= 0 || hd > HD_MAX ||
        rope_dim < 0 || rope_dim > hd || rope_dim % 2)
        return bad_arg(err, err_size, "head_norm_rope_d: bad arguments (T <= 65535, head_dim <= 256, even rope_dim)");
    LAUNCH(k_head_norm_rope, dim3((unsigned)n_head, (unsigned)T), dim3(32))(x, row_stride, head_stride, w, hd, eps, pos,
                                                                           rope_dim, theta);
    return launched(CLOVER_OK, "head_norm_rope_d", err, err_size);
}

extern "C" int clover_cuda_attention_d(const float *q, const void *k_cache, const void *v_cache, int kv_f16,
                                       const int64_t *pos, int64_t T, int64_t n_head, int64_t n_kv, int64_t hd,
                                       int causal, float scale, float *out, char *err, size_t err_size) {
    if (!q || !k_cache || !v_cache || !out || !pos || T <= 0 || n_head <= 0 || n_head > 65535 || n_kv <= 0 ||
        n_head % n_kv || hd <= 0 || hd % 32 || hd > HD_MAX)
        return bad_arg(err, err_size, "attention_d: bad arguments");
    pthread_mutex_lock(&g_lock);
    int rc = attention_launch(q, k_cache, v_cache, kv_f16, out, pos, 0, T, n_head, n_kv, hd, causal, scale, err,
                              err_size);
    rc = launched(rc, "attention_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* Element i of a KV cache of fp16 (f16: rounded to nearest even, as the CPU's) or float32 values
 * set to v. */
__device__ __forceinline__ void kv_put(void *c, bool f16, int64_t i, float v) {
    if (f16)
        ((__half *)c)[i] = __float2half_rn(v);
    else
        ((float *)c)[i] = v;
}

/* Rows t < T of kn, vn ([T][kvd]) into rows *pos + t of the caches ([n_ctx][kvd], element types
 * kv_f16). */
__global__ void k_kv_store(void *kc, void *vc, int kv_f16, const float *kn, const float *vn, const int64_t *pos,
                           int64_t n_ctx, int64_t T, int64_t kvd) {
    const int64_t t = blockIdx.x, p = *pos + t;
    if (p < 0 || p >= n_ctx) return; /* the host checked n_ctx; never past the cache */
    for (int64_t i = threadIdx.x; i < kvd; i += blockDim.x) {
        kv_put(kc, kv_f16 & CLOVER_KV_K_F16, p * kvd + i, kn[t * kvd + i]);
        kv_put(vc, kv_f16 & CLOVER_KV_V_F16, p * kvd + i, vn[t * kvd + i]);
    }
}

extern "C" int clover_cuda_kv_store_d(void *k_cache, void *v_cache, int kv_f16, int64_t n_ctx, int64_t kvd,
                                      const int64_t *pos, const float *k_new, const float *v_new, int64_t T, char *err,
                                      size_t err_size) {
    if (!k_cache || !v_cache || !pos || !k_new || !v_new || T <= 0 || T > INT32_MAX || kvd <= 0 || n_ctx < T)
        return bad_arg(err, err_size, "kv_store_d: bad arguments");
    LAUNCH(k_kv_store, dim3((unsigned)T), dim3(256))(k_cache, v_cache, kv_f16, k_new, v_new, pos, n_ctx, T, kvd);
    return launched(CLOVER_OK, "kv_store_d", err, err_size);
}

extern "C" int clover_cuda_conv_d(const float *w, const float *wr, const float *hist, const float *in, int64_t T,
                                  int64_t C, int32_t K, float *out, char *err, size_t err_size) {
    if (!w || !hist || !in || !out || T <= 0 || C <= 0 || K < 1 || K > CONV_K_MAX || T > INT64_MAX / C ||
        too_big(T * C))
        return bad_arg(err, err_size, "conv_d: bad arguments (d_conv <= 16)");
    LAUNCH(k_conv, cover(T * C), dim3(256))(w, wr, hist, in, T, C, K, out);
    return launched(CLOVER_OK, "conv_d", err, err_size);
}

extern "C" int clover_cuda_conv_hist_d(float *hist, const float *in, int64_t T, int64_t C, int32_t K, char *err,
                                       size_t err_size) {
    if (!hist || !in || T <= 0 || C <= 0 || K < 1 || K > CONV_K_MAX || too_big(C))
        return bad_arg(err, err_size, "conv_hist_d: bad arguments (d_conv <= 16)");
    if (K > 1) LAUNCH(k_conv_hist, cover(C), dim3(256))(hist, in, T, C, K);
    return launched(CLOVER_OK, "conv_hist_d", err, err_size);
}

extern "C" int clover_cuda_gdn_prep_d(float *conv, int64_t T, int64_t C, int64_t Hk, int64_t dk, float eps, float *b,
                                      float *a, const float *ssm_a, const float *dt_bias, int64_t Hv, char *err,
                                      size_t err_size) {
    const bool gated = b || a;
    if (!conv || T <= 0 || T > 65535 || Hk <= 0 || 2 * Hk > INT32_MAX || dk <= 0 || C < 2 * Hk * dk ||
        (gated && (!b || !a || !ssm_a || !dt_bias || Hv <= 0 || T > INT64_MAX / Hv || too_big(T * Hv))))
        return bad_arg(err, err_size, "gdn_prep_d: bad arguments (b and a: both or neither)");
    LAUNCH(k_gdn_qk_norm, dim3((unsigned)(2 * Hk), (unsigned)T), dim3(32))(conv, C, Hk, dk, eps);
    if (gated) LAUNCH(k_gdn_gates, cover(T * Hv), dim3(256))(b, a, ssm_a, dt_bias, T * Hv, Hv);
    return launched(CLOVER_OK, "gdn_prep_d", err, err_size);
}

extern "C" int clover_cuda_gdn_d(int kind, const float *conv, const float *beta, const float *g, int64_t T, int64_t Hk,
                                 int64_t Hv, int64_t dk, int64_t dv, int64_t C, float *state, float *o, char *err,
                                 size_t err_size) {
    if (gdn_bad_args(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o))
        return bad_arg(err, err_size, "gdn_d: bad arguments");
    pthread_mutex_lock(&g_lock);
    const int rc = gdn_run(kind, conv, beta, g, T, Hk, Hv, dk, dv, C, state, o, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return launched(rc, "gdn_d", err, err_size);
}

extern "C" int clover_cuda_gdn_block_d(const float *conv, int64_t T, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                                       int64_t C, const float *state, const float *lambda, const float *beta0,
                                       const float *c, const int64_t *pos, float *o, char *err, size_t err_size) {
    if (gdn_block_bad_args(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, o) || !pos)
        return bad_arg(err, err_size, "gdn_block_d: bad arguments (T, heads, dk <= 256, dv <= 1024 or C out of range)");
    gdn_block_launch(conv, T, Hk, Hv, dk, dv, C, state, lambda, beta0, c, pos, 0, o);
    return launched(CLOVER_OK, "gdn_block_d", err, err_size);
}

extern "C" int clover_cuda_gdn_out_d(float *o, const float *z, const float *w, int64_t T, int64_t Hv, int64_t dv,
                                     float eps, char *err, size_t err_size) {
    if (!o || !z || !w || T <= 0 || T > 65535 || Hv <= 0 || Hv > INT32_MAX || dv <= 0)
        return bad_arg(err, err_size, "gdn_out_d: bad arguments");
    LAUNCH(k_gdn_out, dim3((unsigned)Hv, (unsigned)T), dim3(32))(o, z, w, Hv, dv, eps);
    return launched(CLOVER_OK, "gdn_out_d", err, err_size);
}

extern "C" int clover_cuda_route_d(float *probs, int64_t T, int64_t E, int32_t k, float coreset_top_p, int32_t *sel,
                                   float *wsel, int32_t *prow, float *pw, int32_t *pair, void *tiles, int32_t *stats,
                                   char *err, size_t err_size) {
    if (!probs || !sel || !wsel || !prow || !pw || !pair || !tiles || !stats || T <= 0 || E <= 0 ||
        E > E_MAX || k <= 0 || k > E || T > INT32_MAX / k / 2)
        return bad_arg(err, err_size, "route_d: bad arguments (n_expert <= 1024)");
    LAUNCH(k_route, dim3(1), dim3(1024))(probs, T, E, k, coreset_top_p, coreset_top_p > 0.0f, sel, wsel, prow, pw,
                                        pair, (tile *)tiles, clover_cuda_route_tiles(T * k, E), stats);
    return launched(CLOVER_OK, "route_d", err, err_size);
}

extern "C" int clover_cuda_gather_d(const float *x, const int32_t *rows, int64_t n, int64_t H, float *y, char *err,
                                    size_t err_size) {
    if (!x || !rows || !y || n <= 0 || H <= 0 || n > INT64_MAX / H || too_big(n * H))
        return bad_arg(err, err_size, "gather_d: bad arguments");
    LAUNCH(k_gather, cover(n * H), dim3(256))(x, rows, n, H, y);
    return launched(CLOVER_OK, "gather_d", err, err_size);
}

extern "C" int clover_cuda_experts_d(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                     const clover_cuda_weight *down, const void *tiles, int64_t n_tiles, int64_t P,
                                     const float *xg, float *yg, char *err, size_t err_size) {
    if (!gate || !up || !down || !gate->dev || !up->dev || !down->dev || !tiles || n_tiles <= 0 || P <= 0 || !xg || !yg)
        return bad_arg(err, err_size, "experts_d: bad arguments");
    const int64_t H = gate->ne0, I = gate->ne1;
    if (H <= 0 || I <= 0 || I > INT32_MAX || H > INT32_MAX || up->ne0 != H || up->ne1 != I || down->ne0 != I ||
        down->ne1 != H || P > INT64_MAX / 4 / (H > I ? H : I))
        return bad_arg(err, err_size, "experts_d: gate/up must be [I][H] and down [H][I]");
    pthread_mutex_lock(&g_lock);
    int rc = experts_on_device(gate, up, down, (const tile *)tiles, n_tiles, P, xg, yg, err, err_size);
    rc = launched(rc, "experts_d", err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}

extern "C" int clover_cuda_swiglu_d(float *g, const float *u, int64_t n, char *err, size_t err_size) {
    if (!g || !u || too_big(n)) return bad_arg(err, err_size, "swiglu_d: bad arguments");
    LAUNCH(k_swiglu, cover(n), dim3(256))(g, u, n);
    return launched(CLOVER_OK, "swiglu_d", err, err_size);
}

extern "C" int clover_cuda_moe_combine_d(float *x, const float *yg, const float *pw, const int32_t *pair, int32_t k,
                                         const float *ys, const float *sg, int64_t T, int64_t H, int32_t *bad, char *err,
                                         size_t err_size) {
    if (!x || !yg || !pw || !pair || k <= 0 || !ys || !sg || !bad || T <= 0 || H <= 0 || T > INT64_MAX / H ||
        too_big(T * H))
        return bad_arg(err, err_size, "moe_combine_d: bad arguments");
    LAUNCH(k_moe_combine, cover(T * H), dim3(256))(x, yg, pw, pair, k, ys, sg, T, H, bad);
    return launched(CLOVER_OK, "moe_combine_d", err, err_size);
}

extern "C" int clover_cuda_add_d(float *x, const float *o, int64_t n, int32_t *bad, char *err, size_t err_size) {
    if (!x || !o || !bad || too_big(n)) return bad_arg(err, err_size, "add_d: bad arguments");
    LAUNCH(k_add, cover(n), dim3(256))(x, o, n, bad);
    return launched(CLOVER_OK, "add_d", err, err_size);
}
