/* graphs.cuh: part of cuda.cu (included there, in order, after the parts before it): CUDA graphs of a resident pass: capture, launch, free, and the scratch epoch they depend on. */
/* ---- CUDA graphs (cuda_backend.h) */

extern "C" int64_t clover_cuda_scratch_epoch(void) {
    pthread_mutex_lock(&g_lock);
    const int64_t e = g_epoch;
    pthread_mutex_unlock(&g_lock);
    return e;
}

extern "C" void clover_cuda_release_scratch(void) {
    pthread_mutex_lock(&g_lock);
    scratch *all[] = {&g_x, &g_y, &g_gate, &g_up, &g_tiles, &g_q, &g_gdn, &g_h, &g_att};
    for (scratch *s : all) {
        if (s->p) cudaFree(s->p);
        s->p = NULL;
        s->cap = 0;
    }
    g_epoch++;
    pthread_mutex_unlock(&g_lock);
}

extern "C" int clover_cuda_capture_begin(char *err, size_t err_size) {
    cudaStream_t s = stream();
    if (!s) {
        if (err && err_size) snprintf(err, err_size, "CUDA: no stream to capture");
        return CLOVER_E_DEVICE;
    }
    const cudaError_t e = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    if (e == cudaSuccess) return CLOVER_OK;
    set_err(err, err_size, "cudaStreamBeginCapture", e);
    return CLOVER_E_DEVICE;
}

extern "C" int clover_cuda_capture_end(void **graph, char *err, size_t err_size) {
    cudaGraph_t g = NULL;
    cudaGraphExec_t x = NULL;
    *graph = NULL;
    cudaError_t e = cudaStreamEndCapture(stream(), &g);
    if (e == cudaSuccess) {
        e = cudaGraphInstantiateWithFlags(&x, g, 0);
        cudaGraphDestroy(g);
    }
    (void)cudaGetLastError(); /* a failed capture leaves its error: reported here, not at the next launch */
    if (e != cudaSuccess) {
        set_err(err, err_size, "capturing a CUDA graph", e);
        return CLOVER_E_DEVICE;
    }
    *graph = (void *)x;
    return CLOVER_OK;
}

extern "C" int clover_cuda_graph_launch(void *graph, char *err, size_t err_size) {
    if (!graph) return bad_arg(err, err_size, "graph_launch: no graph");
    const cudaError_t e = cudaGraphLaunch((cudaGraphExec_t)graph, stream());
    if (e != cudaSuccess) {
        set_err(err, err_size, "cudaGraphLaunch", e);
        return CLOVER_E_DEVICE;
    }
    return launched(CLOVER_OK, "graph_launch", err, err_size);
}

extern "C" void clover_cuda_graph_free(void *graph) {
    if (graph) cudaGraphExecDestroy((cudaGraphExec_t)graph);
}
