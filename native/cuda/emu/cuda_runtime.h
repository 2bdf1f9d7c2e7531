/* cuda_runtime.h of the CUDA emulator (native/cuda/emu, CLOVER_CUDA=EMU): what the .cu files of native/cuda
 * use of the CUDA runtime and of the device language, for a host C++ compiler, so that the GPU
 * kernels and their host code run on a CPU in tests (tests/native/test_cuda.py through
 * tests/native/test_cuda_emu.py). Not for speed and not a GPU model: device memory is host memory,
 * copies and launches are synchronous, the blocks of a launch run on a few host threads at once
 * (CLOVER_EMU_THREADS, 1 to 8), and the threads of a block run one at a time as fibers on one
 * host thread (emu.cpp), switching only at __syncthreads and warp shuffles. What it checks:
 * index arithmetic, reductions, the order of barriers (a barrier some threads never reach
 * aborts with "deadlock"), shuffles (every lane of the warp must take part), and shared memory
 * reused across the blocks a host thread runs (which blocks those are varies from run to run,
 * so a read of shared memory the block never wrote may pass or fail), and, run a second time
 * with CLOVER_EMU_ORDER=reverse (threads in the opposite order), results that depend on the
 * order threads run between barriers. What it cannot: races
 * that only a GPU's finer interleaving would show, warp-synchronous code without shuffles,
 * launch limits of real hardware, speed. */
#ifndef CLOVER_EMU_CUDA_RUNTIME_H
#define CLOVER_EMU_CUDA_RUNTIME_H
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <type_traits>
#include <tuple>
#include <utility>

#define CLOVER_CUDA_EMU 1
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __constant__
#define __launch_bounds__(...)
/* A block runs whole on one host thread, so each host thread's copy serves the blocks it runs. */
#define __shared__ static __thread

struct uint3 {
    unsigned x, y, z;
};
struct uint2 {
    unsigned x, y;
};
struct uint4 {
    unsigned x, y, z, w;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
/* threadIdx and blockIdx of the running fiber: each fiber's stack lies in its own region of
 * CLOVER_EMU_REGION bytes, aligned to that size, and they lie just above the stack's top
 * (emu.cpp), so they are found from the stack pointer, whatever host thread runs the block,
 * without a thread-local variable (in a dlopen'd library, a call per read). The top lies 64 bytes
 * times the region's number modulo 512 below the region's end: at one offset every fiber's
 * frames would share cache sets, and the emulator switches fibers at every shuffle. */
struct clover_emu_fiber_info {
    uint3 tid, bid;
    void *runner;
};
#define CLOVER_EMU_REGION ((uintptr_t)1 << 19)
/* The info of the fiber whose region starts at base. */
static inline clover_emu_fiber_info *clover_emu_info_at(uintptr_t base) {
    return (clover_emu_fiber_info *)(base + CLOVER_EMU_REGION - 64 * (base / CLOVER_EMU_REGION % 512 + 1));
}
static inline clover_emu_fiber_info *clover_emu_me(void) {
    uintptr_t sp;
    __asm__("movq %%rsp, %0" : "=r"(sp));
    return clover_emu_info_at(sp & ~(CLOVER_EMU_REGION - 1));
}
#define threadIdx (clover_emu_me()->tid)
#define blockIdx (clover_emu_me()->bid)
extern dim3 blockDim, gridDim;

typedef enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
} cudaError_t;
typedef enum { cudaMemcpyHostToHost, cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost, cudaMemcpyDeviceToDevice,
               cudaMemcpyDefault } cudaMemcpyKind;
struct cudaDeviceProp {
    char name[256];
    int major, minor;
    size_t totalGlobalMem;
};

struct cudaFuncAttributes {
    int ptxVersion, binaryVersion;
};
/* the emulator runs every kernel as compiled for compute 9.0 */
template <class F> cudaError_t cudaFuncGetAttributes(cudaFuncAttributes *a, F *) {
    a->ptxVersion = a->binaryVersion = 90;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int dev);
cudaError_t cudaMemGetInfo(size_t *free_b, size_t *total_b);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t n); /* host memory (64-byte aligned) */
/* Device memory for tests of a small or full GPU: the device holds CLOVER_EMU_MEMORY bytes (read
 * at each call; default 4 GiB), and clover_emu_fail_alloc(n) makes the n-th allocation from now
 * (cudaMalloc or cudaMallocHost) fail with cudaErrorMemoryAllocation (n <= 0: none); it returns
 * the allocations made since the library was loaded. */
extern "C" int64_t clover_emu_fail_alloc(int64_t n);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, cudaMemcpyKind kind);
cudaError_t cudaMemset(void *p, int v, size_t n);
cudaError_t cudaGetLastError(void);
const char *cudaGetErrorString(cudaError_t e);
const char *cudaGetErrorName(cudaError_t e);

/* Streams and graphs: one stream (launches run at once, in order); between
 * cudaStreamBeginCapture and cudaStreamEndCapture launches are recorded instead, and
 * cudaGraphLaunch replays them with the arguments they were given. What a real capture forbids
 * fails here too: cudaMalloc, cudaFree, cudaMemcpy and cudaMemset while capturing return
 * cudaErrorStreamCaptureUnsupported and invalidate the capture. */
typedef struct clover_emu_stream *cudaStream_t;
typedef struct clover_emu_graph *cudaGraph_t;
typedef struct clover_emu_graph *cudaGraphExec_t;
typedef enum { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed }
    cudaStreamCaptureMode;
cudaError_t cudaStreamCreate(cudaStream_t *s);
cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t *g);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *x, cudaGraph_t g, unsigned long long flags);
cudaError_t cudaGraphLaunch(cudaGraphExec_t x, cudaStream_t s);
cudaError_t cudaGraphDestroy(cudaGraph_t g);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t x);
/* While a capture is open: record the launch instead of running it. */
bool clover_emu_record(const std::function<void()> &launch);

/* device-side intrinsics */
void __syncthreads(void);
uint32_t clover_emu_shfl(uint32_t v, int src_lane, int mode); /* mode 0: index, 1: xor */
/* all[n l + i] = word i of lane l's mine (n words each), for every lane of the warp at once: the
 * operands of a warp-wide instruction (mma) in one exchange rather than a shuffle per word */
void clover_emu_gather(const uint32_t *mine, uint32_t *all, int n);
/* 32-bit values in one exchange, 64-bit ones (double) in two, as the hardware does */
template <class V> static inline V clover_emu_shfl_t(V v, int arg, int mode) {
    static_assert(sizeof(V) == 4 || sizeof(V) == 8, "32- and 64-bit shuffles only");
    uint32_t b[2] = {0, 0};
    memcpy(b, &v, sizeof(V));
    for (size_t i = 0; i < sizeof(V) / 4; i++) b[i] = clover_emu_shfl(b[i], arg, mode);
    memcpy(&v, b, sizeof(V));
    return v;
}
template <class V> static inline V __shfl_xor_sync(unsigned mask, V v, int m, int width = 32) {
    (void)mask, (void)width;
    return clover_emu_shfl_t(v, m, 1);
}
template <class V> static inline V __shfl_sync(unsigned mask, V v, int src, int width = 32) {
    (void)mask, (void)width;
    return clover_emu_shfl_t(v, src, 0);
}
static inline float __uint_as_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
static inline uint32_t __float_as_uint(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
/* byte i of the result: byte (s >> 4 i) & 7 of the 8 bytes y:x (x the low word); a GPU's default
 * mode reads bit 3 of each selector nibble as "replicate the sign", which this ignores: keep it 0 */
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; i++) r |= (unsigned)(v >> (8 * ((s >> (4 * i)) & 7)) & 0xFF) << (8 * i);
    return r;
}
/* Fibers switch only at barriers and shuffles, but blocks run on several host threads: a real
 * atomic (integers here; the kernels add only to counters). */
template <class V> static inline V atomicAdd(V *p, V v) {
    static_assert(std::is_integral<V>::value, "integer atomicAdd only");
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}

/* Run body on every thread of every block of the grid (blocks on up to CLOVER_EMU_THREADS host
 * threads); returns cudaErrorInvalidConfiguration for an empty grid or more than 1024 threads
 * per block, cudaErrorMemoryAllocation when no host thread could map the fibers' stacks. */
cudaError_t clover_emu_run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body);

template <class... P> struct clover_emu_launcher {
    void (*k)(P...);
    dim3 grid, block;
    size_t smem;
    template <class... A> void operator()(A &&...a) const {
        std::tuple<P...> args(std::forward<A>(a)...);
        const clover_emu_launcher self = *this;
        const auto replay = [self, args] {
            clover_emu_run(self.grid, self.block, self.smem, [&] { std::apply(self.k, args); });
        };
        if (clover_emu_record(replay)) return;
        clover_emu_run(grid, block, smem, [&] { std::apply(k, args); });
    }
};
template <class... P> clover_emu_launcher<P...> clover_emu_launch(void (*k)(P...), dim3 g, dim3 b, size_t smem = 0) {
    return clover_emu_launcher<P...>{k, g, b, smem};
}
#endif
