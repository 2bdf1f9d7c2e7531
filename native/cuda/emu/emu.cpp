/* emu.cpp: the CUDA emulator's runtime (see cuda_runtime.h beside it). Device memory is host
 * memory; a launch runs its blocks in order, and the threads of a block as fibers on the
 * calling thread, each on its own stack with a guard page. A fiber runs until it reaches
 * __syncthreads or a warp shuffle, then the next ready one runs; a barrier opens when every
 * live thread of the block (of the warp, for a shuffle) waits at it, and a state where none
 * can open is a deadlock (the emulator aborts with the kernel's block and thread). The
 * context switch saves the callee-saved registers of the x86-64 System V ABI (no signal mask,
 * so a switch costs nanoseconds). CLOVER_EMU_ORDER=reverse runs the threads in the opposite
 * order (see clover_emu_run). */
#include "cuda_runtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <mutex>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulator (CLOVER_CUDA=EMU) has a context switch for x86-64 only"
#endif

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

/* clover_emu_switch(save, to): store this stack pointer in *save, continue on stack `to`. */
extern "C" void clover_emu_switch(void **save, void *to);
asm(R"(
.text
.globl clover_emu_switch
.hidden clover_emu_switch
.type clover_emu_switch,@function
clover_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size clover_emu_switch, .-clover_emu_switch
)");

namespace {
enum State { READY, AT_SYNC, AT_SHFL, DONE };
struct Fiber {
    void *sp;
    State state;
    uint3 tid;
    uint32_t val, result; /* shuffle: the value offered and the one received */
    int arg, mode;        /* mode 2: a gather (clover_emu_gather) of the gn words at gmine into gall */
    const uint32_t *gmine;
    uint32_t *gall;
    int gn;
};
const size_t STACK = 256 * 1024;
std::mutex g_run;                /* one launch at a time */
std::vector<Fiber> g_fibers;
std::vector<char *> g_stacks;    /* mmap'd, a guard page below each */
void *g_sched_sp;
const std::function<void()> *g_body;
int g_cur, g_live;
size_t g_page;
/* memory accounting for cudaMemGetInfo: a 4 GiB device, less what is allocated */
std::mutex g_mem;
size_t g_allocated;
const size_t TOTAL = (size_t)4 << 30;
cudaError_t g_last = cudaSuccess; /* the last launch's error, for cudaGetLastError */
struct clover_emu_graph *g_capture; /* the open capture, else NULL */
bool g_capture_ok;
/* A call a capture does not allow: it invalidates the open capture (true), else is allowed. */
bool capture_forbids() {
    if (!g_capture) return false;
    g_capture_ok = false;
    return true;
}

void fiber_entry() {
    (*g_body)();
    g_fibers[g_cur].state = DONE;
    g_live--;
    clover_emu_switch(&g_fibers[g_cur].sp, g_sched_sp);
    abort(); /* never resumed */
}

void fail(const char *what) {
    fprintf(stderr, "CUDA emulator: %s in block (%u,%u,%u) of grid (%u,%u,%u), block (%u,%u,%u)\n", what, blockIdx.x,
            blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y, blockDim.z);
    abort();
}

bool ensure_stacks(size_t n) {
    if (!g_page) g_page = (size_t)sysconf(_SC_PAGESIZE);
    while (g_stacks.size() < n) {
        void *p = mmap(NULL, STACK + g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, g_page, PROT_NONE);
        g_stacks.push_back((char *)p);
    }
    return true;
}

void start_fiber(int i) {
    void **sp = (void **)(g_stacks[i] + g_page + STACK); /* 16-byte aligned top */
    *--sp = NULL;                                          /* fake return address: entry sees rsp = 8 mod 16 */
    *--sp = (void *)fiber_entry;
    for (int r = 0; r < 6; r++) *--sp = NULL; /* rbp rbx r12-r15 */
    g_fibers[i].sp = sp;
    g_fibers[i].state = READY;
}

/* Open the barrier some waiting fibers can pass, or abort: a warp whose every lane waits at a
 * shuffle exchanges, else the block barrier opens when no live fiber is anywhere else. */
void open_barrier(int n) {
    for (int w0 = 0; w0 < n; w0 += 32) {
        const int w1 = w0 + 32 < n ? w0 + 32 : n;
        int waiting = 0, done = 0;
        for (int i = w0; i < w1; i++) waiting += g_fibers[i].state == AT_SHFL, done += g_fibers[i].state == DONE;
        if (waiting == 0) continue;
        if (waiting + done < w1 - w0) continue; /* some lanes still elsewhere */
        if (done) fail("warp shuffle with lanes that have exited");
        if (g_fibers[w0].mode == 2) { /* every lane gets every lane's words, lane by lane */
            for (int i = w0; i < w1; i++)
                if (g_fibers[i].mode != 2 || g_fibers[i].gn != g_fibers[w0].gn) fail("warp gather mixed with a shuffle");
            const size_t bytes = sizeof(uint32_t) * (size_t)g_fibers[w0].gn;
            for (int i = w0; i < w1; i++)
                for (int j = w0; j < w1; j++)
                    memcpy(g_fibers[i].gall + (size_t)(j - w0) * g_fibers[w0].gn, g_fibers[j].gmine, bytes);
            for (int i = w0; i < w1; i++) g_fibers[i].state = READY;
            return;
        }
        for (int i = w0; i < w1; i++) {
            if (g_fibers[i].mode == 2) fail("warp gather mixed with a shuffle");
            Fiber &f = g_fibers[i];
            const int lane = i - w0;
            int src = f.mode == 0 ? f.arg : lane ^ f.arg;
            if (src < 0 || src >= w1 - w0) src = lane; /* out of range: own value, as CUDA */
            f.result = g_fibers[w0 + src].val;
        }
        for (int i = w0; i < w1; i++) g_fibers[i].state = READY;
        return;
    }
    int sync = 0, shfl = 0;
    for (int i = 0; i < n; i++) sync += g_fibers[i].state == AT_SYNC, shfl += g_fibers[i].state == AT_SHFL;
    if (shfl) fail("deadlock: a warp shuffle some lanes of the warp never reach (waiting at __syncthreads?)");
    if (sync == 0) fail("scheduler found nothing to run");
    for (int i = 0; i < n; i++)
        if (g_fibers[i].state == AT_SYNC) g_fibers[i].state = READY;
}

void wait_here(State s) {
    Fiber &f = g_fibers[g_cur];
    f.state = s;
    clover_emu_switch(&f.sp, g_sched_sp);
    threadIdx = g_fibers[g_cur].tid; /* the scheduler set g_cur back to this fiber */
}
} // namespace

void __syncthreads(void) { wait_here(AT_SYNC); }

uint32_t clover_emu_shfl(uint32_t v, int arg, int mode) {
    Fiber &f = g_fibers[g_cur];
    f.val = v, f.arg = arg, f.mode = mode;
    wait_here(AT_SHFL);
    return g_fibers[g_cur].result;
}

void clover_emu_gather(const uint32_t *mine, uint32_t *all, int n) {
    Fiber &f = g_fibers[g_cur];
    f.gmine = mine, f.gall = all, f.gn = n, f.mode = 2;
    wait_here(AT_SHFL);
}

cudaError_t clover_emu_run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body) {
    const size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
        shared_bytes > 48 * 1024)
        return g_last = cudaErrorInvalidConfiguration;
    std::lock_guard<std::mutex> lock(g_run);
    if (!ensure_stacks(n)) return g_last = cudaErrorMemoryAllocation;
    g_fibers.resize(n);
    for (size_t i = 0; i < n; i++)
        g_fibers[i].tid = uint3{(unsigned)(i % block.x), (unsigned)(i / block.x % block.y),
                                (unsigned)(i / ((size_t)block.x * block.y))};
    g_body = &body;
    gridDim = grid, blockDim = block;
    /* CLOVER_EMU_ORDER=reverse runs the ready threads last to first: code whose result depends on
     * the order threads run between barriers (a race on a GPU) then gives other results */
    const char *order = getenv("CLOVER_EMU_ORDER");
    const bool reverse = order && strcmp(order, "reverse") == 0;
    for (unsigned bz = 0; bz < grid.z; bz++)
        for (unsigned by = 0; by < grid.y; by++)
            for (unsigned bx = 0; bx < grid.x; bx++) {
                blockIdx = uint3{bx, by, bz};
                for (size_t i = 0; i < n; i++) start_fiber((int)i);
                g_live = (int)n;
                while (g_live > 0) {
                    bool ran = false;
                    for (size_t k = 0; k < n; k++) {
                        const size_t i = reverse ? n - 1 - k : k;
                        if (g_fibers[i].state == READY) {
                            g_cur = (int)i;
                            threadIdx = g_fibers[i].tid;
                            clover_emu_switch(&g_sched_sp, g_fibers[i].sp);
                            ran = true;
                        }
                    }
                    if (!ran && g_live > 0) open_barrier((int)n);
                }
            }
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 1;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev) {
    if (dev != 0) return cudaErrorInvalidValue;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulator on the CPU (tests only)");
    p->major = 9, p->minor = 0;
    p->totalGlobalMem = TOTAL;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    std::lock_guard<std::mutex> lock(g_mem);
    *free_b = TOTAL > g_allocated ? TOTAL - g_allocated : 0;
    *total_b = TOTAL;
    return cudaSuccess;
}
/* Each allocation carries its size in a 256-byte header (kept 256-aligned, as cudaMalloc's). */
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = NULL;
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    std::lock_guard<std::mutex> lock(g_mem);
    if (n > TOTAL - g_allocated) return cudaErrorMemoryAllocation;
    char *b = (char *)aligned_alloc(256, 256 + ((n + 255) & ~(size_t)255));
    if (!b) return cudaErrorMemoryAllocation;
    memcpy(b, &n, sizeof n);
    g_allocated += n;
    *p = b + 256;
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
    return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFreeHost(void *p) {
    free(p);
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    if (!p) return cudaSuccess;
    std::lock_guard<std::mutex> lock(g_mem);
    char *b = (char *)p - 256;
    size_t n;
    memcpy(&n, b, sizeof n);
    g_allocated -= n;
    free(b);
    return cudaSuccess;
}
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind) {
    (void)kind;
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    if (n) memmove(dst, src, n);
    return cudaSuccess;
}
cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    if (n) memset(p, v, n);
    return cudaSuccess;
}

struct clover_emu_stream {
    int unused;
};
struct clover_emu_graph {
    std::vector<std::function<void()>> launches;
};
cudaError_t cudaStreamCreate(cudaStream_t *s) {
    static clover_emu_stream the_stream;
    *s = &the_stream;
    return cudaSuccess;
}
bool clover_emu_record(const std::function<void()> &launch) {
    if (!g_capture) return false;
    g_capture->launches.push_back(launch);
    return true;
}
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    (void)mode;
    if (!s || g_capture) return cudaErrorInvalidValue;
    g_capture = new clover_emu_graph;
    g_capture_ok = true;
    return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g) {
    if (!s || !g_capture) return cudaErrorInvalidValue;
    *g = g_capture;
    g_capture = NULL;
    if (g_capture_ok) return cudaSuccess;
    delete *g;
    *g = NULL;
    return cudaErrorStreamCaptureInvalidated;
}
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags) {
    (void)flags;
    if (!g) return cudaErrorInvalidValue;
    *x = new clover_emu_graph(*g);
    return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s) {
    (void)s;
    if (!x || g_capture) return cudaErrorInvalidValue;
    for (const auto &launch : x->launches) launch();
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t g) {
    delete g;
    return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x) {
    delete x;
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
    std::lock_guard<std::mutex> lock(g_run);
    const cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
    default: return "unknown error";
    }
}
const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    default: return "cudaErrorUnknown";
    }
}
