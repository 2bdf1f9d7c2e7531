/* experts.cuh: part of cuda.cu (included there, in order, after the parts before it): the routed experts on the device (clover_cuda_experts), page-locked host memory and device allocation and writes. */
/* The routed experts of clover_cuda_experts / clover_cuda_experts_d on device xg [P][H] into yg
 * [P][H] over the n_tiles tiles TL (device): gate and up from xg's int8 form for their types
 * (once when both round alike), SwiGLU, down. xg is not read after the down product starts, so
 * yg may be xg. Caller holds g_lock; launches only (no launched()). */
static int experts_on_device(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                             const clover_cuda_weight *down, const tile *TL, int64_t n_tiles, int64_t P, const float *xg,
                             float *yg, char *err, size_t err_size) {
    const int64_t H = gate->ne0, I = gate->ne1;
    int rc = grow(&g_gate, sizeof(float) * (size_t)(P * I), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_up, sizeof(float) * (size_t)(P * I), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_q, act_q_bytes(P * (H > I ? H : I)), err, err_size);
    float *G = (float *)g_gate.p, *U = (float *)g_up.p;
    act a = {xg, NULL, NULL, NULL};
    if (rc == CLOVER_OK) rc = round_act(gate->type, &a, P, H, err, err_size);
    if (rc == CLOVER_OK) rc = product(gate->type, gate->dev, gate->stride, H, I, a, P, G, TL, n_tiles, err, err_size);
    if (rc == CLOVER_OK && act_block(up->type) != act_block(gate->type)) rc = round_act(up->type, &a, P, H, err, err_size);
    if (rc == CLOVER_OK) rc = product(up->type, up->dev, up->stride, H, I, a, P, U, TL, n_tiles, err, err_size);
    act g = {G, NULL, NULL, NULL};
    if (rc == CLOVER_OK) {
        const int64_t nb = (P * I + 255) / 256;
        LAUNCH(k_swiglu, dim3((unsigned)(nb < 65535 ? nb : 65535)), dim3(256))(G, U, P * I);
        rc = round_act(down->type, &g, P, I, err, err_size);
    }
    if (rc == CLOVER_OK) rc = product(down->type, down->dev, down->stride, I, H, g, P, yg, TL, n_tiles, err, err_size);
    return rc;
}

/* Checks of clover_cuda_experts' arguments; NULL when they are usable. */
static const char *experts_args_error(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                      const clover_cuda_weight *down, int64_t n_expert, const int64_t *start,
                                      const float *xg, const float *yg) {
    if (!gate || !up || !down || !start || !gate->dev || !up->dev || !down->dev || n_expert <= 0 || n_expert > INT32_MAX)
        return "experts: missing weights or start, or n_expert out of range";
    const int64_t H = gate->ne0, I = gate->ne1;
    if (H <= 0 || I <= 0 || I > INT32_MAX || H > INT32_MAX || up->ne0 != H || up->ne1 != I || down->ne0 != I ||
        down->ne1 != H)
        return "experts: gate/up must be [I][H] and down [H][I] with the same H and I";
    if (start[0] != 0) return "experts: start[0] must be 0";
    for (int64_t e = 0; e < n_expert; e++)
        if (start[e + 1] < start[e]) return "experts: start must not decrease";
    const int64_t P = start[n_expert];
    if (P > INT32_MAX / 2 || (P && (!xg || !yg)) || P > INT64_MAX / 4 / (H > I ? H : I))
        return "experts: too many rows, or no xg/yg";
    return NULL;
}

extern "C" int clover_cuda_experts(const clover_cuda_weight *gate, const clover_cuda_weight *up,
                                   const clover_cuda_weight *down, int64_t n_expert, const int64_t *start,
                                   const float *xg, float *yg, char *err, size_t err_size) {
    const char *bad = experts_args_error(gate, up, down, n_expert, start, xg, yg);
    if (bad) return bad_arg(err, err_size, bad);
    const int64_t H = gate->ne0, P = start[n_expert];
    if (P == 0) return CLOVER_OK;
    /* tiles: ROWS pairs at a time within each expert's bucket */
    int64_t n_tiles = 0;
    for (int64_t e = 0; e < n_expert; e++) n_tiles += (start[e + 1] - start[e] + ROWS - 1) / ROWS;
    tile *tiles = (tile *)malloc(sizeof(tile) * (size_t)n_tiles);
    if (!tiles) {
        if (err && err_size) snprintf(err, err_size, "CUDA: experts: out of host memory for the tile list");
        return CLOVER_E_NOMEM;
    }
    int64_t n = 0;
    for (int64_t e = 0; e < n_expert; e++)
        for (int64_t t0 = start[e]; t0 < start[e + 1]; t0 += ROWS)
            tiles[n++] = tile{(int32_t)e, (int32_t)t0, (int32_t)(start[e + 1] - t0 < ROWS ? start[e + 1] - t0 : ROWS)};
    pthread_mutex_lock(&g_lock);
    /* xg goes up into g_y, which also takes the result: experts_on_device reads xg only before
     * the down product writes yg */
    int rc = grow(&g_y, sizeof(float) * (size_t)(P * H), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_tiles, sizeof(tile) * (size_t)n_tiles, err, err_size);
    float *Y = (float *)g_y.p;
    const size_t x_bytes = sizeof(float) * (size_t)(P * H);
    if (rc == CLOVER_OK) rc = copy(g_tiles.p, tiles, sizeof(tile) * (size_t)n_tiles, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = copy(Y, xg, x_bytes, cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) rc = experts_on_device(gate, up, down, (const tile *)g_tiles.p, n_tiles, P, Y, Y, err, err_size);
    rc = launched(rc, "experts", err, err_size);
    if (rc == CLOVER_OK) rc = copy(yg, Y, x_bytes, cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    free(tiles);
    return rc;
}

extern "C" int clover_cuda_host_alloc(size_t nbytes, void **host, char *err, size_t err_size) {
    *host = NULL;
    const cudaError_t e = cudaMallocHost(host, nbytes ? nbytes : 1);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaMallocHost", e);
    cudaGetLastError(); /* not left for the next launch check */
    *host = NULL;
    return CLOVER_E_NOMEM;
}

extern "C" void clover_cuda_host_free(void *host) {
    if (host) cudaFreeHost(host);
}

extern "C" int clover_cuda_alloc(size_t nbytes, void **dev, char *err, size_t err_size) {
    *dev = NULL;
    cudaError_t e = cudaMalloc(dev, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        *dev = NULL;
        return alloc_failed(err, err_size, "a context buffer", nbytes, e);
    }
    e = cudaMemset(*dev, 0, nbytes);
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMemset", e);
        cudaFree(*dev);
        *dev = NULL;
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

extern "C" int clover_cuda_write(void *dev, size_t offset, const void *host, size_t nbytes, char *err,
                                 size_t err_size) {
    if (!dev || (!host && nbytes)) return bad_arg(err, err_size, "write: no buffer");
    return nbytes ? copy((char *)dev + offset, host, nbytes, cudaMemcpyHostToDevice, err, err_size) : CLOVER_OK;
}
