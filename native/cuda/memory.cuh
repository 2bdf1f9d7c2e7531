/* memory.cuh: part of cuda.cu (included there, in order, after the parts before it): host side: the call lock, the grown scratch buffers, activation layouts, the tensor-core probe, the product dispatch, copies, device queries, uploads and clover_cuda_matmul. */
/* ------------------------------------------------------------------ host side */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER; /* one call at a time (shared scratch) */

/* Device scratch, grown on demand and kept: activations in and out, the experts' two
 * intermediate products, and the tile list of a grouped product. */
struct scratch {
    void *p;
    size_t cap; /* bytes */
};
static scratch g_x, g_y, g_gate, g_up, g_tiles, g_q, g_gdn; /* g_q: activations' int8 form; g_gdn: chunked GDN */
static scratch g_h; /* activations split for F16/BF16 tensor cores (k_act_split) */
static scratch g_att; /* attention's per-split results (k_attention) */
static int64_t g_epoch; /* scratch reallocations so far (a captured graph holds their addresses) */

static int grow(scratch *s, size_t bytes, char *err, size_t err_size) {
    if (bytes <= s->cap) return CLOVER_OK;
    g_epoch++;
    if (s->p) cudaFree(s->p);
    s->p = NULL;
    s->cap = 0;
    cudaError_t e = cudaMalloc(&s->p, bytes);
    if (e != cudaSuccess) {
        s->p = NULL;
        return alloc_failed(err, err_size, "the products' scratch", bytes, e);
    }
    s->cap = bytes;
    return CLOVER_OK;
}

static int bad_arg(char *err, size_t err_size, const char *what) {
    if (err && err_size) snprintf(err, err_size, "CUDA: %s", what);
    return CLOVER_E_ARG;
}

/* The input of a product: float rows x (float weights) or their int8 form q, with the scale d
 * and d * sum(q) s of every 32 values (block formats; see k_act_q8_0). */
struct act {
    const float *x;
    const int8_t *q;
    const float *d, *s;
};

/* The int8 form of n values (n a multiple of 32) laid out from base: the values, then the scales
 * d and the sums s, each at a 16-byte boundary; fills a's q, d, s when base is not NULL and
 * returns the bytes. */
static size_t act_q_layout(int64_t n, char *base, act *a) {
    const size_t vals = ((size_t)n + 15) / 16 * 16, per32 = ((size_t)n / 32 * sizeof(float) + 15) / 16 * 16;
    if (base) a->q = (const int8_t *)base, a->d = (const float *)(base + vals), a->s = (const float *)(base + vals + per32);
    return vals + 2 * per32;
}

static size_t act_q_bytes(int64_t n) { return act_q_layout(n, NULL, NULL); }

/* a's int8 form of n_rows rows of ne0 activations a.x, as the CPU pairs them with `type`, into
 * g_q (grown by the caller to act_q_bytes(n_rows * ne0)); a float weight type leaves a as is. */
static int round_act(int type, act *a, int64_t n_rows, int64_t ne0, char *err, size_t err_size) {
    const int ab = act_block(type);
    if (!ab || n_rows == 0) return CLOVER_OK;
    if (ne0 % ab) {
        if (err && err_size) snprintf(err, err_size, "CUDA: ne0 %lld not a multiple of %d", (long long)ne0, ab);
        return CLOVER_E_ARG;
    }
    if (n_rows * (ne0 / ab) > INT32_MAX) return bad_arg(err, err_size, "activation rows: too many blocks for one launch");
    if (g_q.cap < act_q_bytes(n_rows * ne0)) return bad_arg(err, err_size, "activation scratch too small");
    const int64_t n = n_rows * ne0;
    act_q_layout(n, (char *)g_q.p, a);
    int8_t *q = (int8_t *)a->q;
    float *d = (float *)a->d, *sum = (float *)a->s;
    if (ab == 32) LAUNCH(k_act_q8_0, dim3((unsigned)(n / 32)), dim3(32))(a->x, q, d, sum);
    else LAUNCH(k_act_q8_k, dim3((unsigned)(n / 256)), dim3(32))(a->x, q, d, sum);
    return CLOVER_OK;
}

/* Whether the block formats' many-row products run on tensor cores (k_matmul_mma): a device of
 * compute capability 8.0 or later (the emulator counts as one) running the kernel compiled for
 * 8.0 or later (a build whose newest code for the device is older PTX has it trap), unless
 * CLOVER_CUDA_MMA=0. */
static pthread_once_t g_mma_once = PTHREAD_ONCE_INIT;
static bool g_mma_ok; /* the device and the build have the tensor-core kernels (set once) */

static void mma_probe(void) {
    cudaDeviceProp p;
    cudaFuncAttributes a;
    g_mma_ok = cudaGetDeviceProperties(&p, 0) == cudaSuccess && p.major >= 8 &&
               cudaFuncGetAttributes(&a, k_matmul_mma<T_Q4_K, 4>) == cudaSuccess && a.ptxVersion >= 80;
}

static bool use_mma(void) {
    pthread_once(&g_mma_once, mma_probe);
    const char *env = getenv("CLOVER_CUDA_MMA");
    return g_mma_ok && !(env && strcmp(env, "0") == 0);
}

extern "C" int clover_cuda_mma(void) { return use_mma(); }

/* k_matmul_plain_v (vec: the rows allow 16-byte loads) or k_matmul_plain on X (product's
 * arguments). */
template <int TYPE>
static void plain_product(bool vec, dim3 grid, dim3 block, const uint8_t *W, int64_t w_stride, int64_t ne0, int64_t ne1,
                          const float *X, int64_t T, float *Y, const tile *tiles) {
    if (vec) LAUNCH(k_matmul_plain_v<TYPE>, grid, block)(W, w_stride, ne0, ne1, X, T, Y, tiles);
    else LAUNCH(k_matmul_plain<TYPE>, grid, block)(W, w_stride, ne0, ne1, X, T, Y, tiles);
}

/* T rows of ne0 activations x split for F16 / BF16 (`type`) tensor cores (k_act_split) into g_h,
 * grown here: *h the terms (*h_stride values apart), *inv the rows' scales. */
static int split_act(int type, const float *x, int64_t T, int64_t ne0, const uint16_t **h, int64_t *h_stride,
                     const float **inv, char *err, size_t err_size) {
    if (!x) return bad_arg(err, err_size, "product: no activations");
    if (T > INT32_MAX || T * ne0 > INT64_MAX / 8) return bad_arg(err, err_size, "product: too many activation rows");
    const int64_t n = T * ne0; /* a multiple of 32: each term starts 64-byte aligned */
    const int n_terms = type == T_BF16 ? 3 : 2;
    int rc = grow(&g_h, sizeof(uint16_t) * (size_t)(n_terms * n) + sizeof(float) * (size_t)T, err, err_size);
    if (rc != CLOVER_OK) return rc;
    uint16_t *H = (uint16_t *)g_h.p;
    float *I = (float *)(H + n_terms * n);
    if (type == T_F16) LAUNCH(k_act_split<T_F16>, dim3((unsigned)T), dim3(32))(x, ne0, H, n, I);
    else LAUNCH(k_act_split<T_BF16>, dim3((unsigned)T), dim3(32))(x, ne0, H, n, I);
    *h = H, *h_stride = n, *inv = I;
    return CLOVER_OK;
}

/* Y = W X on the device: T rows of one matrix (tiles NULL) or the n_tiles tiles of a grouped
 * product (see block_rows; T is then the tiles' rows in all); X in the form round_act gave it for
 * `type`. Block formats go to int8 tensor cores, and F16 / BF16 ones with ne0 a multiple of 32
 * and 16-byte aligned rows to f16 / bf16 tensor cores (split_act), for groups of 32 rows or
 * tiles holding 2 rows or more on average, where use_mma; else to k_matmul_q / k_matmul_plain
 * (k_matmul_plain_v where the rows allow 16-byte loads). */
static int product(int type, const void *W, int64_t w_stride, int64_t ne0, int64_t ne1, act X, int64_t T,
                   float *Y, const tile *tiles, int64_t n_tiles, char *err, size_t err_size) {
    const uint8_t *w = (const uint8_t *)W;
    if (act_block(type) && !X.q) return bad_arg(err, err_size, "product: activations not rounded");
    const bool half = type == T_F16 || type == T_BF16;
    const bool aligned = (uintptr_t)w % 16 == 0 && w_stride % 16 == 0; /* also each row, for ne0 as below */
    const bool mma = (tiles ? T >= 2 * n_tiles : T >= 16) && use_mma() &&
                     (act_block(type) || (half && ne0 % 32 == 0 && aligned));
    /* float weights off tensor cores: 16-byte loads where the rows allow */
    const bool vec = aligned && ne0 % (type == T_F32 ? 4 : 8) == 0 && (uintptr_t)X.x % 16 == 0;
    const uint16_t *H = NULL;
    const float *inv = NULL;
    int64_t h_stride = 0;
    if (mma && half) {
        const int rc = split_act(type, X.x, T, ne0, &H, &h_stride, &inv, err, err_size);
        if (rc != CLOVER_OK) return rc;
    }
    const int per = tiles ? 1 : mma ? 32 : ROWS; /* activation rows (tiles) per blockIdx.y */
    const int64_t n_groups = tiles ? n_tiles : (T + per - 1) / per;
    for (int64_t g0 = 0; g0 < n_groups; g0 += 65535) { /* gridDim.y <= 65535 */
        const int64_t ng = n_groups - g0 < 65535 ? n_groups - g0 : 65535;
        const int64_t rows_a_block = (mma ? 16 : 1) * WARPS; /* weight rows */
        const dim3 grid((unsigned)((ne1 + rows_a_block - 1) / rows_a_block), (unsigned)ng), block(32, WARPS);
        const int64_t t0 = tiles ? 0 : g0 * per;
        const float *x = X.x ? X.x + t0 * ne0 : NULL;
        const float *d = X.d ? X.d + t0 * (ne0 / 32) : NULL, *sum = X.s ? X.s + t0 * (ne0 / 32) : NULL;
        const int8_t *q = X.q ? X.q + t0 * ne0 : NULL;
        const uint16_t *h = H ? H + t0 * ne0 : NULL;
        const float *iv = inv ? inv + t0 : NULL;
        float *y = Y + t0 * ne1;
        const int64_t t = T - t0;
        const tile *tl = tiles ? tiles + g0 : NULL;
        switch (type) {
#define PLAIN(TY) case TY: plain_product<TY>(vec, grid, block, w, w_stride, ne0, ne1, x, t, y, tl); break;
#define HALF(TY)                                                                                                   \
    case TY:                                                                                                       \
        if (!mma) plain_product<TY>(vec, grid, block, w, w_stride, ne0, ne1, x, t, y, tl);                         \
        else if (tiles) LAUNCH((k_matmul_mma_f<TY, 1>), grid, block)(w, w_stride, ne0, ne1, h, h_stride, iv, t, y,  \
                                                                      tl);                                         \
        else LAUNCH((k_matmul_mma_f<TY, 4>), grid, block)(w, w_stride, ne0, ne1, h, h_stride, iv, t, y, tl);      \
        break;
#define QUANT(TY)                                                                                                  \
    case TY:                                                                                                       \
        if (!mma) LAUNCH(k_matmul_q<TY>, grid, block)(w, w_stride, ne0, ne1, q, d, t, y, tl);                      \
        else if (tiles) LAUNCH((k_matmul_mma<TY, 1>), grid, block)(w, w_stride, ne0, ne1, q, d, sum, t, y, tl);    \
        else LAUNCH((k_matmul_mma<TY, 4>), grid, block)(w, w_stride, ne0, ne1, q, d, sum, t, y, tl);               \
        break;
            PLAIN(T_F32)
            HALF(T_F16)
            HALF(T_BF16)
            QUANT(T_Q8_0)
            QUANT(T_Q4_0)
            QUANT(T_IQ4_NL)
            QUANT(T_MXFP4)
            QUANT(T_Q4_K)
            QUANT(T_Q5_K)
            QUANT(T_Q6_K)
            QUANT(T_IQ4_XS)
#undef PLAIN
#undef HALF
#undef QUANT
        default:
            if (err && err_size) snprintf(err, err_size, "CUDA matmul: ggml type %d not supported", type);
            return CLOVER_E_ARG;
        }
    }
    return CLOVER_OK;
}

/* The launches' status (a launch error or an earlier asynchronous one) as a CLOVER_* code. */
static int launched(int rc, const char *what, char *err, size_t err_size) {
    const cudaError_t e = cudaGetLastError();
    if (rc != CLOVER_OK) return rc;
    if (e != cudaSuccess) {
        set_err(err, err_size, what, e);
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

static int copy(void *dst, const void *src, size_t n, cudaMemcpyKind kind, char *err, size_t err_size) {
    const cudaError_t e = cudaMemcpy(dst, src, n, kind);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaMemcpy", e);
    return CLOVER_E_DEVICE;
}

extern "C" int clover_cuda_devices(char *info, size_t info_size) {
#ifndef CLOVER_CUDA_EMU
    /* no driver library at all: say so (the runtime would report "driver version is insufficient") */
    void *driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
    if (!driver) {
        if (info && info_size) snprintf(info, info_size, "CUDA: no NVIDIA driver (libcuda.so.1 not found)");
        return CLOVER_E_DEVICE;
    }
    dlclose(driver);
#endif
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        set_err(info, info_size, "no usable device", e);
        cudaGetLastError(); /* clear the sticky error */
        return CLOVER_E_DEVICE;
    }
    if (n == 0) {
        if (info && info_size) snprintf(info, info_size, "CUDA: no device");
        return 0;
    }
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess && info && info_size)
        snprintf(info, info_size, "CUDA device 0: %s, compute %d.%d, %.1f GiB, %d of %d device(s)", p.name, p.major,
                 p.minor, (double)p.totalGlobalMem / (1 << 30), 1, n);
    return n;
}

extern "C" int clover_cuda_mem_info(int64_t *free_bytes, int64_t *total_bytes) {
    size_t f = 0, t = 0;
    if (cudaMemGetInfo(&f, &t) != cudaSuccess) {
        cudaGetLastError();
        return CLOVER_E_DEVICE;
    }
    if (free_bytes) *free_bytes = (int64_t)f;
    if (total_bytes) *total_bytes = (int64_t)t;
    return CLOVER_OK;
}

extern "C" int clover_cuda_upload(const void *host, size_t nbytes, void **dev, char *err, size_t err_size) {
    *dev = NULL;
    cudaError_t e = cudaMalloc(dev, nbytes ? nbytes : 1);
    if (e != cudaSuccess) {
        *dev = NULL;
        return alloc_failed(err, err_size, "a weight", nbytes, e);
    }
    e = cudaMemcpy(*dev, host, nbytes, cudaMemcpyHostToDevice);
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaMemcpy of a weight", e);
        cudaFree(*dev);
        *dev = NULL;
        return CLOVER_E_DEVICE;
    }
    return CLOVER_OK;
}

extern "C" void clover_cuda_free(void *dev) {
    if (dev) cudaFree(dev);
}

extern "C" int clover_cuda_matmul(int type, const void *dev_w, int64_t ne0, int64_t ne1, const float *x, int64_t T,
                                  float *y, char *err, size_t err_size) {
    if (!dev_w || !x || !y || ne0 <= 0 || ne1 <= 0 || T <= 0 || ne1 > INT32_MAX || ne0 > INT64_MAX / 4 / T ||
        ne1 > INT64_MAX / 4 / T) {
        if (err && err_size) snprintf(err, err_size, "CUDA matmul: bad arguments (ne0 %lld, ne1 %lld, T %lld)",
                                      (long long)ne0, (long long)ne1, (long long)T);
        return CLOVER_E_ARG;
    }
    pthread_mutex_lock(&g_lock);
    int rc = grow(&g_x, sizeof(float) * (size_t)(T * ne0), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_y, sizeof(float) * (size_t)(T * ne1), err, err_size);
    if (rc == CLOVER_OK) rc = grow(&g_q, act_q_bytes(T * ne0), err, err_size);
    float *X = (float *)g_x.p, *Y = (float *)g_y.p;
    if (rc == CLOVER_OK) rc = copy(X, x, sizeof(float) * (size_t)(T * ne0), cudaMemcpyHostToDevice, err, err_size);
    if (rc == CLOVER_OK) {
        act a = {X, NULL, NULL, NULL};
        rc = round_act(type, &a, T, ne0, err, err_size);
        if (rc == CLOVER_OK) rc = product(type, dev_w, 0, ne0, ne1, a, T, Y, NULL, 0, err, err_size);
        rc = launched(rc, "matmul", err, err_size);
    }
    if (rc == CLOVER_OK) rc = copy(y, Y, sizeof(float) * (size_t)(T * ne1), cudaMemcpyDeviceToHost, err, err_size);
    pthread_mutex_unlock(&g_lock);
    return rc;
}
