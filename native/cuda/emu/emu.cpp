/* emu.cpp: the CUDA emulator's runtime (see cuda_runtime.h beside it). Device memory is host
 * memory; the blocks of a launch are taken in order by the launching thread and, for launches
 * of 4 blocks or more, by helper host threads (CLOVER_EMU_THREADS in all; see pool), and each
 * block runs whole on one host thread, its threads as fibers, each on its own stack with a
 * guard page. A fiber runs until it reaches __syncthreads or a warp shuffle, then the next
 * ready one runs, switched to directly; a barrier opens when every live thread of the block
 * (of the warp, for a shuffle) waits at it, and a state where none can open is a deadlock (the
 * emulator aborts with the kernel's block and thread). The context switch saves the
 * callee-saved registers of the x86-64 System V ABI (no signal mask, so a switch costs
 * nanoseconds). CLOVER_EMU_ORDER=reverse runs the threads of each block in the opposite order
 * (see next_ready). */
#include "cuda_runtime.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#if !defined(__x86_64__)
#error "the CUDA emulator (CLOVER_CUDA=EMU) has a context switch for x86-64 only"
#endif

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
    uint32_t val, result; /* shuffle: the value offered and the one received */
    int arg, mode;        /* mode 2: a gather (clover_emu_gather) of the gn words at gmine into gall */
    const uint32_t *gmine;
    uint32_t *gall;
    int gn;
};
/* What one host thread needs to run blocks: a fiber per thread of the block, their stacks (each
 * in a region of CLOVER_EMU_REGION bytes aligned to its size: a guard page, the stack, the
 * fiber's clover_emu_fiber_info above the stack's top; see clover_emu_me), and the host
 * thread's own stack while a block runs. */
struct Runner {
    std::vector<Fiber> fibers;
    std::vector<char *> stacks;
    void *sched_sp; /* resumed when the block is done */
    int cur, live;  /* the running fiber, the live ones */
};
/* This host thread's runner, made at its first block; its stacks are unmapped when the thread
 * exits (in tests, threads that launch come and go: kept, their stacks would run the process
 * out of mappings). */
struct RunnerOwner {
    Runner *r = nullptr;
    ~RunnerOwner() {
        if (!r) return;
        for (char *a : r->stacks) munmap(a, CLOVER_EMU_REGION);
        delete r;
    }
};
thread_local RunnerOwner t_run;
/* The running fiber's runner, from its region (on a fiber's stack only). */
Runner &me() { return *(Runner *)clover_emu_me()->runner; }
clover_emu_fiber_info *info(Runner &r, int i) { return clover_emu_info_at((uintptr_t)r.stacks[i]); }

/* The launch now running (one at a time, g_run), the same for every host thread running it. */
std::mutex g_run;
const std::function<void()> *g_body;
int g_n;                        /* threads per block */
bool g_reverse;                 /* CLOVER_EMU_ORDER=reverse */
uint64_t g_blocks;              /* blocks in the grid */
std::atomic<uint64_t> g_next;   /* the next block to take (x fastest, then y, then z) */

size_t g_page;
/* memory accounting for cudaMemGetInfo: a 4 GiB device (CLOVER_EMU_MEMORY bytes), less what is
 * allocated; g_fail_in: the allocation (cudaMalloc, cudaMallocHost) that fails, counted down from
 * clover_emu_fail_alloc's argument (0: none) */
std::mutex g_mem;
size_t g_allocated;
int64_t g_fail_in, g_allocs;
size_t total_bytes() {
    const char *env = getenv("CLOVER_EMU_MEMORY");
    return env && *env ? (size_t)strtoull(env, NULL, 10) : (size_t)4 << 30;
}
/* Whether this allocation is the one clover_emu_fail_alloc armed (under g_mem). */
bool injected_failure() {
    g_allocs++;
    return g_fail_in > 0 && --g_fail_in == 0;
}
/* the last error of a launch or an allocation of this host thread, for cudaGetLastError (as the
 * runtime's: per thread, and a failed cudaMalloc sets it too) */
thread_local cudaError_t g_last = cudaSuccess;
struct clover_emu_graph *g_capture; /* the open capture, else NULL */
bool g_capture_ok;
/* A call a capture does not allow: it invalidates the open capture (true), else is allowed. */
bool capture_forbids() {
    if (!g_capture) return false;
    g_capture_ok = false;
    return true;
}

void switch_away(void **save);

void fiber_entry() {
    (*g_body)();
    Runner &r = me();
    r.fibers[r.cur].state = DONE;
    r.live--;
    switch_away(&r.fibers[r.cur].sp);
    abort(); /* never resumed */
}

void fail(const char *what) {
    fprintf(stderr, "CUDA emulator: %s in block (%u,%u,%u) of grid (%u,%u,%u), block (%u,%u,%u)\n", what, blockIdx.x,
            blockIdx.y, blockIdx.z, gridDim.x, gridDim.y, gridDim.z, blockDim.x, blockDim.y, blockDim.z);
    abort();
}

bool ensure_stacks(Runner &r, size_t n) {
    const size_t R = CLOVER_EMU_REGION;
    while (r.stacks.size() < n) { /* map twice the size, keep the aligned region inside */
        char *p = (char *)mmap(NULL, 2 * R, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return false;
        char *a = (char *)(((uintptr_t)p + R - 1) & ~(uintptr_t)(R - 1));
        if (a > p) munmap(p, (size_t)(a - p));
        if (a + R < p + 2 * R) munmap(a + R, (size_t)(p + 2 * R - (a + R)));
        mprotect(a, g_page, PROT_NONE);
        r.stacks.push_back(a);
    }
    return true;
}

void start_fiber(Runner &r, int i) {
    void **sp = (void **)info(r, i); /* 64-byte aligned top, below the fiber's info */
    *--sp = NULL;                                                         /* fake return address: entry sees rsp = 8 mod 16 */
    *--sp = (void *)fiber_entry;
    for (int k = 0; k < 6; k++) *--sp = NULL; /* rbp rbx r12-r15 */
    r.fibers[i].sp = sp;
    r.fibers[i].state = READY;
}

/* Exchange the values of warp w0..w1-1, whose every lane waits at the same shuffle (or gather). */
void exchange(std::vector<Fiber> &f, int w0, int w1) {
    if (f[w0].mode == 2) { /* every lane gets every lane's words, lane by lane */
        for (int i = w0; i < w1; i++)
            if (f[i].mode != 2 || f[i].gn != f[w0].gn) fail("warp gather mixed with a shuffle");
        const size_t bytes = sizeof(uint32_t) * (size_t)f[w0].gn;
        for (int i = w0; i < w1; i++)
            for (int j = w0; j < w1; j++) memcpy(f[i].gall + (size_t)(j - w0) * f[w0].gn, f[j].gmine, bytes);
    } else {
        for (int i = w0; i < w1; i++) {
            if (f[i].mode == 2) fail("warp gather mixed with a shuffle");
            const int lane = i - w0;
            int src = f[i].mode == 0 ? f[i].arg : lane ^ f[i].arg;
            if (src < 0 || src >= w1 - w0) src = lane; /* out of range: own value, as CUDA */
            f[i].result = f[w0 + src].val;
        }
    }
    for (int i = w0; i < w1; i++) f[i].state = READY;
}

/* Open the barriers some waiting fibers can pass, or abort: every warp whose every lane waits
 * at a shuffle exchanges (all such warps at once: a round then runs every warp to its next
 * shuffle, instead of one warp a round), else the block barrier opens when no live fiber is
 * anywhere else. */
void open_barrier(std::vector<Fiber> &f, int n) {
    bool opened = false;
    for (int w0 = 0; w0 < n; w0 += 32) {
        const int w1 = w0 + 32 < n ? w0 + 32 : n;
        int waiting = 0, done = 0;
        for (int i = w0; i < w1; i++) waiting += f[i].state == AT_SHFL, done += f[i].state == DONE;
        if (waiting == 0) continue;
        if (waiting + done < w1 - w0) continue; /* some lanes still elsewhere */
        if (done) fail("warp shuffle with lanes that have exited");
        exchange(f, w0, w1);
        opened = true;
    }
    if (opened) return;
    int sync = 0, shfl = 0;
    for (int i = 0; i < n; i++) sync += f[i].state == AT_SYNC, shfl += f[i].state == AT_SHFL;
    if (shfl) fail("deadlock: a warp shuffle some lanes of the warp never reach (waiting at __syncthreads?)");
    if (sync == 0) fail("scheduler found nothing to run");
    for (int i = 0; i < n; i++)
        if (f[i].state == AT_SYNC) f[i].state = READY;
}

/* The threads of a block run in rounds: each ready one in order (reversed with
 * CLOVER_EMU_ORDER=reverse) runs to its next barrier, shuffle or end; when a round is over the
 * barriers that can open open, and the next round begins. next_ready gives the fiber to run
 * after r.cur stopped, or -1 when every thread of the block is done. */
int fiber_at(int k) { return g_reverse ? g_n - 1 - k : k; }
int next_ready(Runner &r) {
    for (int k = (g_reverse ? g_n - 1 - r.cur : r.cur) + 1; k < g_n; k++)
        if (r.fibers[fiber_at(k)].state == READY) return fiber_at(k);
    if (r.live == 0) return -1;
    open_barrier(r.fibers, g_n);
    for (int k = 0; k < g_n; k++)
        if (r.fibers[fiber_at(k)].state == READY) return fiber_at(k);
    fail("scheduler found nothing to run");
    return -1;
}

/* Leave the stopped fiber r.cur (its stack pointer saved in *save) for the next one directly,
 * without a switch through the host thread's stack (a switch costs a mispredicted return), or
 * for the host thread's stack when the block is done. */
void switch_away(void **save) {
    Runner &r = me();
    const int self = r.cur, next = next_ready(r);
    if (next < 0) {
        clover_emu_switch(save, r.sched_sp);
        return;
    }
    r.cur = next;
    if (next != self) clover_emu_switch(save, r.fibers[next].sp);
}

void wait_here(State s) {
    Runner &r = me();
    r.fibers[r.cur].state = s;
    switch_away(&r.fibers[r.cur].sp);
}

/* Take blocks of the running launch until none is left, each run whole on this host thread;
 * none if this thread's fibers' stacks cannot be mapped (blocks left over fail the launch). */
void run_blocks() {
    if (!t_run.r) t_run.r = new Runner();
    Runner &r = *t_run.r;
    if (!ensure_stacks(r, (size_t)g_n)) return;
    r.fibers.resize((size_t)g_n);
    for (int i = 0; i < g_n; i++) {
        info(r, i)->tid = uint3{(unsigned)i % blockDim.x, (unsigned)i / blockDim.x % blockDim.y,
                                (unsigned)i / (blockDim.x * blockDim.y)};
        info(r, i)->runner = &r;
    }
    for (uint64_t b; (b = g_next.fetch_add(1)) < g_blocks;) {
        const uint3 bid{(unsigned)(b % gridDim.x), (unsigned)(b / gridDim.x % gridDim.y),
                        (unsigned)(b / ((uint64_t)gridDim.x * gridDim.y))};
        for (int i = 0; i < g_n; i++) {
            info(r, i)->bid = bid;
            start_fiber(r, i);
        }
        r.live = g_n;
        r.cur = fiber_at(0);
        clover_emu_switch(&r.sched_sp, r.fibers[r.cur].sp); /* back when the block is done */
    }
}

/* Helper host threads: CLOVER_EMU_THREADS host threads in all (1 to 8; default the online
 * CPUs, at most 8) run the blocks of a launch of at least PAR_BLOCKS blocks; each waits for the next launch
 * (a generation count), takes blocks as the launching thread does, and reports when done.
 * Made at the first such launch, and again in a child after fork (a child has no threads but
 * the one that forked). Never freed: they wait until the process exits. */
const uint64_t PAR_BLOCKS = 4;
struct Pool {
    std::mutex m;
    std::condition_variable go, done;
    uint64_t gen = 0;
    int busy = 0, helpers = 0;
    pid_t pid;
};
Pool *g_pool;

void helper(Pool *p) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(p->m);
    for (;;) {
        p->go.wait(lock, [&] { return p->gen != seen; });
        seen = p->gen;
        lock.unlock();
        run_blocks();
        lock.lock();
        if (--p->busy == 0) p->done.notify_one();
    }
}

Pool *pool() {
    if (g_pool && g_pool->pid == getpid()) return g_pool;
    Pool *p = new Pool(); /* a pool from before a fork is left as it is: its threads are not here */
    p->pid = getpid();
    const char *env = getenv("CLOVER_EMU_THREADS");
    long n = env ? strtol(env, NULL, 10) : sysconf(_SC_NPROCESSORS_ONLN);
    n = n < 1 ? 1 : n > 8 ? 8 : n;
    for (long i = 1; i < n; i++) {
        try {
            std::thread(helper, p).detach();
            p->helpers++;
        } catch (const std::system_error &) {
            break; /* fewer helpers */
        }
    }
    return g_pool = p;
}
} // namespace

void __syncthreads(void) { wait_here(AT_SYNC); }

uint32_t clover_emu_shfl(uint32_t v, int arg, int mode) {
    Runner &r = me();
    Fiber &f = r.fibers[r.cur];
    f.val = v, f.arg = arg, f.mode = mode;
    wait_here(AT_SHFL);
    return r.fibers[r.cur].result;
}

void clover_emu_gather(const uint32_t *mine, uint32_t *all, int n) {
    Runner &r = me();
    Fiber &f = r.fibers[r.cur];
    f.gmine = mine, f.gall = all, f.gn = n, f.mode = 2;
    wait_here(AT_SHFL);
}

cudaError_t clover_emu_run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body) {
    const size_t n = (size_t)block.x * block.y * block.z;
    if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535 ||
        shared_bytes > 48 * 1024)
        return g_last = cudaErrorInvalidConfiguration;
    std::lock_guard<std::mutex> lock(g_run);
    if (!g_page) g_page = (size_t)sysconf(_SC_PAGESIZE);
    g_body = &body;
    gridDim = grid, blockDim = block;
    g_n = (int)n;
    /* CLOVER_EMU_ORDER=reverse runs the ready threads last to first: code whose result depends on
     * the order threads run between barriers (a race on a GPU) then gives other results */
    const char *order = getenv("CLOVER_EMU_ORDER");
    g_reverse = order && strcmp(order, "reverse") == 0;
    g_blocks = (uint64_t)grid.x * grid.y * grid.z;
    g_next = 0;
    Pool *p = g_blocks >= PAR_BLOCKS ? pool() : NULL;
    if (p && p->helpers) {
        std::unique_lock<std::mutex> plock(p->m);
        p->busy = p->helpers;
        p->gen++;
        p->go.notify_all();
        plock.unlock();
        run_blocks();
        plock.lock();
        p->done.wait(plock, [&] { return p->busy == 0; });
    } else {
        run_blocks();
    }
    return g_next.load() < g_blocks ? (g_last = cudaErrorMemoryAllocation) : cudaSuccess;
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
    p->totalGlobalMem = total_bytes();
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b) {
    std::lock_guard<std::mutex> lock(g_mem);
    const size_t total = total_bytes();
    *free_b = total > g_allocated ? total - g_allocated : 0;
    *total_b = total;
    return cudaSuccess;
}
/* Each allocation carries its size in a 256-byte header (kept 256-aligned, as cudaMalloc's). */
cudaError_t cudaMalloc(void **p, size_t n) {
    *p = NULL;
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    std::lock_guard<std::mutex> lock(g_mem);
    const size_t total = total_bytes();
    if (injected_failure() || g_allocated > total || n > total - g_allocated) return g_last = cudaErrorMemoryAllocation;
    char *b = (char *)aligned_alloc(256, 256 + ((n + 255) & ~(size_t)255));
    if (!b) return g_last = cudaErrorMemoryAllocation;
    memcpy(b, &n, sizeof n);
    g_allocated += n;
    *p = b + 256;
    return cudaSuccess;
}
cudaError_t cudaMallocHost(void **p, size_t n) {
    *p = NULL;
    {
        std::lock_guard<std::mutex> lock(g_mem);
        if (injected_failure()) return g_last = cudaErrorMemoryAllocation;
    }
    *p = aligned_alloc(64, (n + 63) & ~(size_t)63);
    return *p ? cudaSuccess : g_last = cudaErrorMemoryAllocation;
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

extern "C" int64_t clover_emu_fail_alloc(int64_t n) {
    std::lock_guard<std::mutex> lock(g_mem);
    const int64_t done = g_allocs;
    g_fail_in = n > 0 ? n : 0;
    return done;
}
