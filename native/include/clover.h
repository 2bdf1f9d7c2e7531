/* clover.h: public C API of the clover-gguf engine.
 *
 * The engine runs Clover block-diffusion models and their Qwen3.5/3.6-MoE parents from GGUF
 * files (design: clover-spec.md). Everything here is plain C11, callable through cffi in
 * ABI mode (clover_gguf/_ffi.py parses its declarations from this file, so what is declared
 * here is what Python sees).
 *
 * Conventions
 * - Errors: functions that can fail take `char *err, size_t err_size` and write a one-line,
 *   NUL-terminated message naming the field and value there. They return NULL or a negative
 *   CLOVER_E_* code on failure and never abort on bad input.
 * - Token ids are int32. Logits are float32, row-major [rows, n_vocab].
 * - Threads: n_threads <= 0 means "number of physical cores" (online CPUs where the topology
 *   is unknown).
 */
#ifndef CLOVER_H
#define CLOVER_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define CLOVER_API __declspec(dllexport)
#else
#define CLOVER_API __attribute__((visibility("default")))
#endif

enum {
    CLOVER_OK = 0,
    CLOVER_E_IO = -1,        /* open/read/mmap failed */
    CLOVER_E_FORMAT = -2,    /* malformed GGUF or inconsistent model */
    CLOVER_E_ARG = -3,       /* bad argument (token id, size, parameter value) */
    CLOVER_E_NOMEM = -4,     /* allocation failed or size overflow */
    CLOVER_E_STATE = -5,     /* call not valid in the current state (e.g. context full) */
    CLOVER_E_ABORTED = -6,   /* stopped by clover_context_abort */
    CLOVER_E_NUMERIC = -7,   /* NaN or Inf in a hidden state or the logits (the message names the layer) */
    CLOVER_E_DEVICE = -8,    /* GPU backend unavailable or failed (no device, no driver, built without CUDA) */
};

/* ---------------------------------------------------------------- GGUF reader (gguf.c)
 * Validating, mmap-based GGUF v2/v3 reader. Every count, string length, type, n_dims,
 * shape, byte size (overflow-checked), offset and alignment is checked against the file
 * before use; a file that passes open() can be walked without further checks. */
typedef struct clover_gguf clover_gguf;

/* GGUF metadata value types (GGUF spec numbering). */
enum {
    CLOVER_GGUF_UINT8 = 0, CLOVER_GGUF_INT8 = 1, CLOVER_GGUF_UINT16 = 2, CLOVER_GGUF_INT16 = 3,
    CLOVER_GGUF_UINT32 = 4, CLOVER_GGUF_INT32 = 5, CLOVER_GGUF_FLOAT32 = 6, CLOVER_GGUF_BOOL = 7,
    CLOVER_GGUF_STRING = 8, CLOVER_GGUF_ARRAY = 9, CLOVER_GGUF_UINT64 = 10, CLOVER_GGUF_INT64 = 11,
    CLOVER_GGUF_FLOAT64 = 12,
};

/* ggml tensor types understood by this engine (ggml numbering). */
enum {
    CLOVER_TYPE_F32 = 0, CLOVER_TYPE_F16 = 1, CLOVER_TYPE_Q8_0 = 8, CLOVER_TYPE_BF16 = 30,
    /* block formats (native/quant/kquants.c, kquants23.c): weight types of the loader and matmul, except Q8_K,
     * which is the activations' form of the K formats' products only */
    CLOVER_TYPE_Q4_0 = 2, CLOVER_TYPE_Q2_K = 10, CLOVER_TYPE_Q3_K = 11, CLOVER_TYPE_Q4_K = 12,
    CLOVER_TYPE_Q5_K = 13, CLOVER_TYPE_Q6_K = 14, CLOVER_TYPE_Q8_K = 15, CLOVER_TYPE_IQ4_NL = 20, CLOVER_TYPE_IQ4_XS = 23, CLOVER_TYPE_MXFP4 = 39,
};

/* Open and validate `path`. Returns NULL and a message in err on any problem. */
CLOVER_API clover_gguf *clover_gguf_open(const char *path, char *err, size_t err_size);
/* The same checks on GGUF bytes already in memory (size bytes at data, aligned to 32 bytes as a
 * mapping would be; messages say "<memory>" for the path). data is not copied: it must stay
 * valid and unchanged until clover_gguf_close, which does not free it. Used by the fuzz
 * harness (tests/fuzz) and for embedding files in a program. */
CLOVER_API clover_gguf *clover_gguf_open_memory(const void *data, size_t size, char *err, size_t err_size);
CLOVER_API void clover_gguf_close(clover_gguf *g);
/* mlock(2) the file's bytes (the mapping of clover_gguf_open, or the caller's memory), so that
 * they stay in RAM (llama.cpp's --mlock). CLOVER_OK, else CLOVER_E_IO with the byte count and
 * strerror in err (ENOMEM/EPERM: usually RLIMIT_MEMLOCK, `ulimit -l`). */
CLOVER_API int clover_gguf_mlock(const clover_gguf *g, char *err, size_t err_size);
CLOVER_API uint32_t clover_gguf_version(const clover_gguf *g);
CLOVER_API int64_t clover_gguf_n_kv(const clover_gguf *g);
/* Index of `key`, or -1. */
CLOVER_API int64_t clover_gguf_find_key(const clover_gguf *g, const char *key);
/* KV i (0 <= i < n_kv; out of range returns NULL / -1): key, value type, and for arrays the
 * element type and count. */
CLOVER_API const char *clover_gguf_key(const clover_gguf *g, int64_t i);
CLOVER_API int clover_gguf_kv_type(const clover_gguf *g, int64_t i);
CLOVER_API int clover_gguf_arr_type(const clover_gguf *g, int64_t i);
CLOVER_API int64_t clover_gguf_arr_n(const clover_gguf *g, int64_t i);
/* Value of KV i; for arrays, element j (use j = 0 for scalars). Numeric getters convert any
 * numeric/bool type; a string getter on a non-string returns NULL. Strings returned are
 * NUL-terminated copies owned by g; *len (if not NULL) receives the byte length. */
CLOVER_API int64_t clover_gguf_get_i64(const clover_gguf *g, int64_t i, int64_t j);
CLOVER_API uint64_t clover_gguf_get_u64(const clover_gguf *g, int64_t i, int64_t j);
CLOVER_API double clover_gguf_get_f64(const clover_gguf *g, int64_t i, int64_t j);
CLOVER_API const char *clover_gguf_get_str(const clover_gguf *g, int64_t i, int64_t j, size_t *len);

CLOVER_API int64_t clover_gguf_n_tensors(const clover_gguf *g);
CLOVER_API int64_t clover_gguf_find_tensor(const clover_gguf *g, const char *name);
CLOVER_API const char *clover_gguf_tensor_name(const clover_gguf *g, int64_t t);
CLOVER_API int clover_gguf_tensor_type(const clover_gguf *g, int64_t t);
CLOVER_API int clover_gguf_tensor_n_dims(const clover_gguf *g, int64_t t);
/* ggml order: ne[0] is the contiguous (row) dimension. d in [0, 4). */
CLOVER_API int64_t clover_gguf_tensor_ne(const clover_gguf *g, int64_t t, int d);
/* Absolute file offset of the tensor data and its byte size. */
CLOVER_API uint64_t clover_gguf_tensor_offset(const clover_gguf *g, int64_t t);
CLOVER_API uint64_t clover_gguf_tensor_nbytes(const clover_gguf *g, int64_t t);
/* Pointer to the mapped tensor data (read-only). */
CLOVER_API const void *clover_gguf_tensor_data(const clover_gguf *g, int64_t t);
/* Dequantise/convert tensor t into out (float32, ne0*ne1*ne2*ne3 elements, n_out the
 * capacity in floats). */
CLOVER_API int clover_gguf_tensor_to_f32(const clover_gguf *g, int64_t t, float *out, int64_t n_out,
                                         char *err, size_t err_size);

/* ---------------------------------------------------------------- quant formats (quant/quants.c) */
/* Convert n values of type `type` (F32, F16, BF16, Q8_0; Q8_0 needs n % 32 == 0) at src to
 * float32. Returns CLOVER_OK or CLOVER_E_ARG. */
CLOVER_API int clover_to_f32(int type, const void *src, float *dst, int64_t n);
/* Quantise n float32 values (n % 32 == 0 for Q8_0) into dst; returns bytes written or < 0. */
CLOVER_API int64_t clover_from_f32(int type, const float *src, void *dst, int64_t n);
/* Bytes needed for n values of `type`, or -1 if n does not fit the block size. */
CLOVER_API int64_t clover_type_nbytes(int type, int64_t n);
/* The ggml name of tensor type id `type` ("F32", "F16", "Q4_0", "Q8_0", "Q4_K", "Q6_K", "BF16",
 * ...: ggml.h's numbering, ids 0..39, computable here or not), NULL for an id ggml does not
 * define (removed or out of range). One table (core/ggml_types.c) serves the C reader and Python. */
CLOVER_API const char *clover_type_name(int32_t type);

/* One line naming what this build uses on this CPU: the kernels' instruction set chosen at run
 * time ("kernels = avx512-vnni | avx2 | scalar", lowered by $CLOVER_ISA), the x86 features it was
 * chosen from, OpenMP and the CUDA backend, as "NAME = value" pairs joined by " | " (llama.cpp's
 * llama_print_system_info). Static storage, never NULL. */
CLOVER_API const char *clover_system_info(void);

/* ---------------------------------------------------------------- model (model/load.c, gpu/offload.c) */
typedef struct clover_model clover_model;

/* Load a `clover_moe` or `qwen35moe` GGUF (docs/gguf-layout.md): reads hyperparameters, checks
 * every tensor's name, type and shape against them (the error names the tensor), and maps the
 * weights. A `clover_moe` file without Clover's block tensors takes them, with the decoding
 * record, from the diffusion sidecar `<stem>.diffusion.gguf` beside it when that file exists
 * (stem: path less a trailing ".gguf"). */
CLOVER_API clover_model *clover_model_load(const char *path, char *err, size_t err_size);
/* clover_model_load with the sidecar named: diffusion_path NULL looks beside the model as
 * clover_model_load does, "" loads none, anything else must be a sidecar matching the model
 * (architecture, general.type "diffusion", layer count, each block tensor's name and shape, the
 * mask id within the vocabulary; the error names the file and the field). A model that holds
 * the block tensors itself refuses a named sidecar. */
CLOVER_API clover_model *clover_model_load_sidecar(const char *path, const char *diffusion_path, char *err,
                                                   size_t err_size);
/* The path of the sidecar a model loaded its block tensors from, or NULL. */
CLOVER_API const char *clover_model_sidecar_path(const clover_model *m);
/* clover_model_load on GGUF bytes in memory (see clover_gguf_open_memory: 32-byte aligned, kept
 * valid and unchanged until clover_model_free, not freed by it). */
CLOVER_API clover_model *clover_model_load_memory(const void *data, size_t size, char *err, size_t err_size);
CLOVER_API void clover_model_free(clover_model *m);
/* The model's GGUF (owned by the model), for metadata lookups. */
CLOVER_API const clover_gguf *clover_model_gguf(const clover_model *m);
/* clover_gguf_mlock of the model's file and of its diffusion sidecar (llama-cpp-python's
 * use_mlock): CLOVER_OK, else the first failure's code and reason in err. */
CLOVER_API int clover_model_mlock(const clover_model *m, char *err, size_t err_size);

/* GPU backend (native/cuda, CUDA builds only). clover_gpu_devices: the number of usable CUDA
 * devices (> 0), 0 when none, CLOVER_E_DEVICE when none can be used (no driver, or a library built
 * without CUDA); info receives a one-line description or the reason. */
CLOVER_API int clover_gpu_devices(char *info, size_t info_size);
/* Free and total bytes of GPU 0; CLOVER_E_DEVICE without a usable GPU. */
CLOVER_API int clover_gpu_memory(int64_t *free_bytes, int64_t *total_bytes);
/* Copy the weights of the first n_gpu_layers layers to GPU 0 (n_layer + 1 or more: the output
 * projection too, as llama.cpp's -ngl), except the routed experts of the first n_cpu_moe layers
 * (llama.cpp's --n-cpu-moe; n_layer or more = --cpu-moe), which stay in system memory; the
 * products of what was copied (attention and GDN projections, router, experts, shared expert,
 * LM head) then run there, everything else on the CPU. Call once, before generating. Returns
 * the layers offloaded (output counted as one), or CLOVER_E_DEVICE (no GPU), CLOVER_E_NOMEM
 * (naming the bytes needed and free), CLOVER_E_STATE (already offloaded), CLOVER_E_ARG. */
CLOVER_API int32_t clover_model_offload(clover_model *m, int32_t n_gpu_layers, int32_t n_cpu_moe, char *err,
                                        size_t err_size);
/* Bytes of weights a clover_model_offload(m, n_gpu_layers, n_cpu_moe) would place, by part:
 * 0 all on the GPU, 1 the offloaded layers' dense weights (attention/GDN projections, router,
 * shared expert), 2 their routed experts on the GPU, 3 the output projection, 4 the offloaded
 * layers' routed experts kept on the CPU, 5 the float32 vectors (norms, conv weights, gates)
 * copied for the resident forward when every layer and the output are offloaded (unless
 * CLOVER_GPU_RESIDENT=0). -1 for bad arguments. Needs no GPU (for --fit plans). */
CLOVER_API int64_t clover_model_placement_bytes(const clover_model *m, int32_t n_gpu_layers, int32_t n_cpu_moe,
                                                int32_t part);
/* 1 when layer il of m is a full-attention layer, 0 a Gated DeltaNet layer (the loader's rule:
 * attention.recurrent_layers when present, else every full_attention_interval-th layer; spec 1),
 * -1 for a NULL model or il outside [0, n_layer). */
CLOVER_API int32_t clover_model_layer_is_attn(const clover_model *m, int32_t il);
/* Bytes a context of n_ctx tokens with KV cache types type_k, type_v keeps on the GPU when
 * clover_model_offload(m, n_gpu_layers, ...) placed the weights (computed by the sizing the
 * context's allocations use, gpu/device_state.c): the K and V cache of each offloaded attention
 * layer (n_ctx x n_head_kv x head_dim elements of type_k and of type_v); once any GDN layer runs
 * on the GPU, the float32 state [Hv][dk][dv] of every GDN layer; and when the placement makes the
 * model resident (n_gpu_layers > n_layer, clover_model_gpu_resident) their float32 conv history
 * [d_conv-1][channels] too. Needs no GPU. -1 for a NULL model, n_ctx <= 0, n_gpu_layers < 0 or
 * another cache type; INT64_MAX when the size overflows. */
CLOVER_API int64_t clover_model_gpu_cache_bytes(const clover_model *m, int32_t n_ctx, int32_t n_gpu_layers,
                                                int32_t type_k, int32_t type_v);
/* Bytes of weights on the GPU (0 when none). */
CLOVER_API int64_t clover_model_gpu_bytes(const clover_model *m);
/* 1 when forwards run device-resident: every layer with its experts and the output offloaded
 * (and CLOVER_GPU_RESIDENT is not "0"), so activations stay on the GPU from the embedding to the
 * logits and the host sees only tokens, logits and a few flags per forward; 0 otherwise (each
 * offloaded product or kernel then moves its activations to the GPU and back). */
CLOVER_API int32_t clover_model_gpu_resident(const clover_model *m);

/* GGUF architectures (general.architecture). */
enum { CLOVER_ARCH_QWEN35MOE = 0, CLOVER_ARCH_CLOVER_MOE = 1 };
/* Whose tokens the repetition penalty counts (diffusion.penalty_scope, spec 5.4). */
enum { CLOVER_PENALTY_RESPONSE = 0, CLOVER_PENALTY_ALL = 1 };
/* Pooling of clover_embed: llama.cpp's enum llama_pooling_type values ({arch}.pooling_type). */
enum {
    CLOVER_POOLING_UNSPECIFIED = -1, /* the model's: hparams.pooling_type */
    CLOVER_POOLING_NONE = 0,         /* every row */
    CLOVER_POOLING_MEAN = 1,         /* the mean of the rows */
    CLOVER_POOLING_CLS = 2,          /* refused: a causal decoder has no CLS token */
    CLOVER_POOLING_LAST = 3,         /* the last row (the one that has seen every token) */
    CLOVER_POOLING_RANK = 4          /* refused: no ranking head */
};

/* Hyperparameters and the decoding record read from the GGUF (spec 1, 4.2). */
typedef struct {
    int32_t arch;               /* CLOVER_ARCH_* */
    int32_t has_block;          /* 1 when the block tensors are loaded (from the file or its sidecar):
                                   block mode, `diffusion` and `spec` run */
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;            /* decoder layers run by the engine: block_count - n_layer_nextn */
    int32_t n_layer_nextn;      /* MTP (NextN) layers stored after them (nextn_predict_layers);
                                   checked at load, not run */
    int32_t n_ctx_train;
    int32_t n_head, n_head_kv, head_dim, rope_dim;
    int32_t ssm_d_state, ssm_n_group, ssm_dt_rank, ssm_d_inner, ssm_d_conv;
    int32_t n_expert, n_expert_used, n_ff_exp, n_ff_shexp;
    int32_t full_attention_interval;
    float rms_eps, rope_theta;
    /* the decoding record (diffusion.*, docs/gguf-layout.md); absent keys take spec 4.2's
     * defaults; a qwen35moe file decodes without penalties over the whole history (llama.cpp) */
    int32_t mask_token_id;      /* tokenizer.ggml.mask_token_id, -1 when absent */
    int32_t block_size;
    float threshold;
    float coreset_top_p;
    int32_t shift_logits;       /* block mode: slot j predicted by row j - 1 (1) or row j (0) */
    int32_t block_aligned;      /* blocks cover [kB, (k+1)B) (1) or start after the prompt (0) */
    int32_t penalty_scope;      /* CLOVER_PENALTY_* */
    float presence_penalty, frequency_penalty, repetition_penalty;
    int32_t think_close_bias_start, eos_bias_start;
    float bias_slope, bias_max;
    int32_t pooling_type;       /* {arch}.pooling_type (CLOVER_POOLING_*), CLOVER_POOLING_LAST when
                                   absent: clover_embed's default */
} clover_hparams;

CLOVER_API void clover_model_hparams(const clover_model *m, clover_hparams *out);

/* sizeof of the public struct `name` ("clover_hparams", "clover_gen_params", "clover_stats")
 * as this library was compiled, or 0 for another name. Bindings compare it with their own
 * declarations so that a header and a library from different builds are refused at load
 * instead of corrupting memory. */
CLOVER_API size_t clover_struct_size(const char *name);

/* ---------------------------------------------------------------- context (model/context.c, model/forward.c)
 * A context holds the per-sequence caches of spec 6: KV cache for attention layers (F16 or
 * F32), GDN state (fp32, per value head dk x dv) and conv history (last 3 qkv inputs) per GDN
 * layer, and the scratch buffers. */
typedef struct clover_context clover_context;

/* Bytes of the per-context state in system memory for n_ctx tokens: the KV cache of the
 * attention layers (n_attn x n_ctx x n_head_kv x head_dim elements each for K and V, 2 bytes
 * an element for CLOVER_TYPE_F16, 4 for CLOVER_TYPE_F32; none for a model whose forwards are
 * resident on the GPU, clover_model_gpu_resident, whose cache is on the device) plus the GDN
 * recurrent and conv states; -1 for a NULL model, n_ctx <= 0 or another cache type, INT64_MAX
 * when the size overflows. clover_context_new refuses (CLOVER_E_NOMEM, "n_ctx: ...") a context
 * that exceeds the memory the kernel reports as available. Per-forward scratch is not
 * included. */
CLOVER_API int64_t clover_context_mem_required(const clover_model *m, int32_t n_ctx, int32_t type_k, int32_t type_v);
/* A context of n_ctx tokens on m, n_threads CPU threads (<= 0: the physical cores). type_k,
 * type_v: the element type of the K and V caches, CLOVER_TYPE_F16 (spec 6, llama.cpp's
 * default: keys and values are rounded to fp16, round to nearest even, when they are written)
 * or CLOVER_TYPE_F32 (exact); the same on the CPU and the GPU. NULL with err set on a bad
 * argument (CLOVER_E_ARG, naming n_ctx, type_k or type_v) or too little memory. */
CLOVER_API clover_context *clover_context_new(clover_model *m, int32_t n_ctx, int32_t n_threads, int32_t type_k,
                                              int32_t type_v, char *err, size_t err_size);
CLOVER_API void clover_context_free(clover_context *c);
/* Number of tokens committed to the caches. */
CLOVER_API int32_t clover_context_n_past(const clover_context *c);
CLOVER_API int32_t clover_context_n_ctx(const clover_context *c);
/* Drop all cached tokens (and a pending clover_context_abort request). */
CLOVER_API void clover_context_reset(clover_context *c);
/* Prompt-state reuse across generations (chat turns re-rendered by a template): save the GDN
 * recurrent and conv states and n_past (the KV cache rows below n_past are never rewritten by
 * later calls); restore_state puts them back and sets n_past to the saved length, so a prompt that
 * starts with the saved tokens prefills only the rest (clover_prefill, then a decoder with n_reuse).
 * One saved state per context; clover_context_reset (a decoder with n_reuse = 0) drops it.
 * save: CLOVER_E_STATE on an empty context; restore: the restored n_past, or CLOVER_E_STATE when
 * nothing valid is saved. Memory: one copy of the GDN and conv states. */
CLOVER_API int clover_context_save_state(clover_context *c, char *err, size_t err_size);
CLOVER_API int32_t clover_context_restore_state(clover_context *c, char *err, size_t err_size);
/* A context's whole state as bytes and back (model/state.c), as llama.cpp's llama_state_get_size,
 * llama_state_get_data and llama_state_set_data: n_past, rows [0, n_past) of every attention
 * layer's K and V cache (in the cache's element types), the GDN recurrent and conv states of every
 * GDN layer, and the state clover_context_save_state kept (so clover_context_restore_state works
 * after a load as before the save). A header leads: magic "CLVSTATE", format version, the model's
 * layer counts and cache dimensions, a fingerprint of the model (its trunk hyperparameters, layer
 * pattern and the leading bytes of a few weights: another checkpoint or quantisation of the same
 * shapes differs; a diffusion sidecar does not count), type_k, type_v, n_ctx, n_past, and a
 * checksum of the rest. Host byte order: a state moves between machines of the same byte order.
 * get_size: the bytes get_data writes now (CLOVER_E_ARG for a NULL context, CLOVER_E_NOMEM when the
 * size overflows). get_data: writes them to dst (size: its capacity, CLOVER_E_ARG when smaller) and
 * returns their count. set_data: reads a state of exactly size bytes and returns size; nothing is
 * changed unless all of it checks: CLOVER_E_ARG for bytes that are not a whole state (magic,
 * version, a size that differs from the one the header describes, a checksum mismatch),
 * CLOVER_E_STATE for a state of another model, other cache types (type_k, type_v) or more tokens
 * than this context's n_ctx; the message names the field. States move between placements: on a
 * model whose forwards are GPU-resident (clover_model_gpu_resident) the KV cache is copied from and
 * to the device and the GDN states current there are brought back first (the next forward uploads
 * the loaded ones), so a state saved on the GPU loads on the CPU and back. A device transfer that
 * fails inside set_data leaves the context reset (empty). */
CLOVER_API int64_t clover_state_get_size(const clover_context *c);
CLOVER_API int64_t clover_state_get_data(clover_context *c, uint8_t *dst, size_t size, char *err, size_t err_size);
CLOVER_API int64_t clover_state_set_data(clover_context *c, const uint8_t *src, size_t size, char *err,
                                         size_t err_size);
/* Ask the forward pass running on c to stop: the one thread-safe call on a context, meant to be
 * made from another thread while clover_prefill, clover_block_forward(_rows), clover_decoder_new
 * or clover_decoder_step runs. The forward checks the request before each layer and before the
 * LM head, so it stops within one layer (no layer is interrupted halfway), and returns
 * CLOVER_E_ABORTED with a message in err. The request is one-shot: the forward that stops
 * consumes it; if none is running it stops the next one, unless clover_context_reset (which
 * clover_decoder_new starts with) discards it first. An aborted prefill leaves empty caches (as
 * any failed prefill); an aborted block forward leaves them unchanged; a decoder whose step or
 * prefill was aborted is finished (free it). c must stay valid during the call: do not race it
 * with clover_context_free. */
CLOVER_API void clover_context_abort(clover_context *c);
/* Threads of a forward of one row (n_threads: an ar decode step) and of several rows
 * (n_threads_batch: a prefill, a block pass, a commit or verify), as llama.cpp's
 * llama_set_n_threads; <= 0: the physical cores. Takes effect from the next forward. */
CLOVER_API void clover_context_set_n_threads(clover_context *c, int32_t n_threads, int32_t n_threads_batch);
/* The most rows of one prefix-mode pass (llama.cpp's n_ubatch): a longer clover_prefill runs in
 * passes of at most that many rows, which bounds the activations and scratch. 0: the backend's
 * own bound (2048 rows on the CPU, fewer with weights on the GPU). Else rounded down to a
 * multiple of CLOVER_GDN_CHUNK, at least CLOVER_GDN_CHUNK, so that on the CPU the passes give
 * one pass's caches and logits bit for bit; a pass may take one row more (n_ubatch 64 and a
 * rest of one row, which would run the GDN recurrence alone). Returns the rows in effect (0: the
 * backend's), or CLOVER_E_ARG for a negative value. The GPU-resident decoder's selecting
 * passes (commits, verifies: at most 512 rows) run whole. */
CLOVER_API int32_t clover_context_set_n_ubatch(clover_context *c, int32_t n_ubatch);
/* Continuous batching (batch.c): contexts of one model attached to one clover_batch run their
 * forwards together. A forward of an attached context waits until every attached context is
 * waiting for one too (or, for a straggler, twice the last pass's time, at least 0.5 ms and at
 * most 50 ms), then one pass computes the rows of all of them: each weight product
 * (projections, router, routed and shared experts, LM head) once over every sequence's rows;
 * the caches, attention, the GDN recurrence, the block coreset and the abort request per
 * context. Each sequence's caches and logits equal those of its forwards run alone, bit for bit
 * (on the CPU path every product computes each row alone; prefills are cut only at multiples of
 * CLOVER_GDN_CHUNK). A pass holds at most max_rows rows (<= 0: 512; else rounded down to a
 * multiple of CLOVER_GDN_CHUNK, at least one): every forward that fits whole goes first (decode
 * rows, block passes, short prefills), then long prefills in chunks in the rows left (at least
 * CLOVER_GDN_CHUNK of them), so a long prompt delays the running sequences by one chunk a pass
 * and advances every pass (a chunk may take one row more, as clover_context_set_n_ubatch says);
 * block passes and checkpoint-recording prefills run whole; the oldest forward always goes. Forwards
 * that cannot share a pass (a model with weights on the GPU, embeddings, selections) run alone,
 * in turn. Any number of contexts may be attached; a pass runs on one of the waiting threads,
 * with that thread's context's scratch and n_threads_batch threads (a forward alone in its pass
 * runs as it would unbatched). A context's clover_context_abort stops its own forward only. */
/* Several sequences' forwards in shared passes, run on this thread (as llama_decode of a batch of
 * several sequences): entry i on its own context as clover_prefill (mode CLOVER_FORWARD_PREFIX:
 * tokens appended, logits of every row with all_logits, else of the last) or as
 * clover_block_forward_rows (CLOVER_FORWARD_BLOCK: coreset_top_p, rows, n_experts_out) would run
 * it alone, with the same checks and the same results bit for bit; each weight product once over
 * every entry's rows, passes of at most 2048 rows (a long prefill in chunks beside the others).
 * The contexts: given, of one model, each in one entry, none attached to a clover_batch. Each
 * entry's outcome in its rc, an entry that fails (its checks, an abort) leaving the others
 * running (a failed prefill leaves its context empty, as clover_prefill); returns CLOVER_OK, or
 * the first failed entry's code with its message in err. The first entry's context lends its
 * scratch and n_threads_batch threads. */
enum { CLOVER_FORWARD_PREFIX = 0, CLOVER_FORWARD_BLOCK = 1, CLOVER_FORWARD_BATCH_MAX = 256 };
typedef struct {
    clover_context *ctx;
    int32_t mode;           /* CLOVER_FORWARD_PREFIX or CLOVER_FORWARD_BLOCK */
    const int32_t *tokens;
    int32_t n_tokens;
    float *logits;          /* NULL: none; prefix: [n_tokens][n_vocab] with all_logits, else [n_vocab];
                               block: row j of [n_tokens][n_vocab] where rows[j] (rows NULL: all) */
    int32_t all_logits;     /* prefix mode */
    float coreset_top_p;    /* block mode, (0, 1] */
    const uint8_t *rows;    /* block mode: n_tokens bytes or NULL */
    int32_t *n_experts_out; /* block mode: [n_layer] or NULL */
    int32_t rc;             /* out: CLOVER_OK or the entry's error code */
} clover_forward_entry;
CLOVER_API int clover_forward_batch(clover_forward_entry *entries, int32_t n, char *err, size_t err_size);
typedef struct clover_batch clover_batch;
CLOVER_API clover_batch *clover_batch_new(clover_model *m, int32_t max_rows, char *err, size_t err_size);
/* Free a batch no context is attached to (CLOVER_E_STATE, and nothing freed, while one is). */
CLOVER_API int clover_batch_free(clover_batch *b);
/* Attach c to b (b NULL: detach it from its batch). A context joins a batch for a sequence's
 * requests and leaves it when idle, since the batch waits for every attached context; attaching
 * to another model's batch, or while c's forward runs, is CLOVER_E_ARG / CLOVER_E_STATE.
 * clover_context_free detaches the context it frees. */
CLOVER_API int clover_context_set_batch(clover_context *c, clover_batch *b, char *err, size_t err_size);
/* What a batch has run: passes, rows over all passes, the (context, forward) entries over all
 * passes, passes with two or more contexts, and the most contexts in one pass. */
typedef struct {
    int64_t n_passes, n_rows, n_entries, n_shared;
    int32_t max_entries;
} clover_batch_stats;
CLOVER_API void clover_batch_get_stats(const clover_batch *b, clover_batch_stats *out);
/* GDN prefill algorithm: 1 = chunked (chunks of CLOVER_GDN_CHUNK rows, default), 0 = token-by-token
 * recurrence. Both compute spec 2.1 step 6; the switch exists for tests. */
CLOVER_API void clover_context_set_gdn_chunked(clover_context *c, int chunked);
/* Rows of one chunk of the chunked GDN prefill (cpu/gdn_heads.c, cuda/gdn_chunk.cuh), counted
 * from each clover_prefill call's first token; a 1-token call runs the recurrence. On the CPU
 * path the other layers compute each row alone, so a prefill stopped at a multiple of it and
 * continued by a call of 2 or more tokens gives one prefill's caches and logits bit for bit.
 * Split elsewhere, or on the GPU (whose calls of up to 64 rows run the recurrence and whose
 * kernels depend on the row count), the result differs in float rounding. */
#define CLOVER_GDN_CHUNK 64

/* Prefix (causal) mode, spec 3.2: append tokens[0..n) at positions n_past.. and write the
 * caches. If logits != NULL it receives float32 [n, n_vocab] when all_logits, else the last
 * row only [n_vocab]. Errors: token id out of range, n <= 0, n_past + n > n_ctx. */
CLOVER_API int clover_prefill(clover_context *c, const int32_t *tokens, int32_t n, float *logits,
                              int32_t all_logits, char *err, size_t err_size);

/* Embeddings (llama.cpp's llama_get_embeddings_ith / _seq): a causal (prefix mode) prefill of
 * tokens[0..n) from position 0, its final hidden state after output_norm (the LM head's input;
 * the LM head is not computed), pooled (CLOVER_POOLING_*): NONE writes out[n][n_embd] (row t:
 * token t), MEAN out[n_embd] (the mean of the n rows), LAST out[n_embd] (row n - 1);
 * UNSPECIFIED takes hparams.pooling_type. out_size: the floats out holds, at least what the
 * pooling writes. The context is reset before the pass and after it (clover_context_reset): on
 * return it holds no tokens and no saved state, whatever the outcome. On a model whose forwards
 * are resident on the GPU the rows are read back from the device. Errors: CLOVER_E_ARG for a NULL
 * argument, n outside [1, n_ctx], a token id out of range, CLS, RANK or another pooling,
 * out_size too small; else as clover_prefill. */
CLOVER_API int clover_embed(clover_context *c, const int32_t *tokens, int32_t n, int32_t pooling, float *out,
                            int64_t out_size, char *err, size_t err_size);

/* Block (denoising) mode, spec 3.2-3.3 and 5.6: run the B rows of tokens (mask ids allowed)
 * at positions n_past..n_past+B-1 against read-only caches. logits: float32 [B, n_vocab] (row j is
 * the LM head on row j; the caller applies the logit convention, hparams.shift_logits); P = n_past
 * clean tokens precede the block (spec 3.3 step 4). coreset_top_p in (0, 1]; 1 means normal
 * routing. n_experts_out (may be NULL) receives, per layer, the number of distinct experts used
 * by the pass [n_layer]. Requires the block tensors (hparams.has_block). */
CLOVER_API int clover_block_forward(clover_context *c, const int32_t *tokens, int32_t B,
                                    float coreset_top_p, float *logits, int32_t *n_experts_out,
                                    char *err, size_t err_size);
/* As clover_block_forward, with the LM head only on rows j where rows[j] != 0 (rows: B bytes,
 * NULL = all): logits row j is written for those rows and left untouched for the others, the
 * rest of the pass is unchanged, so the written rows equal clover_block_forward's (spec 5.2:
 * "logits only for masked rows"). */
CLOVER_API int clover_block_forward_rows(clover_context *c, const int32_t *tokens, int32_t B,
                                         float coreset_top_p, float *logits, const uint8_t *rows,
                                         int32_t *n_experts_out, char *err, size_t err_size);

/* ---------------------------------------------------------------- decoding (decode.c, sampler.c) */
/* ar: one token per prefix-mode forward; diffusion: threshold block decoding (spec 5.2);
 * spec: self-speculative, a block-mode draft verified by one prefix-mode forward, output
 * identical to greedy ar (spec 5.5). diffusion and spec need the block tensors (hparams.has_block). */
enum { CLOVER_MODE_AR = 0, CLOVER_MODE_DIFFUSION = 1, CLOVER_MODE_SPEC = 2 };
/* Buckets of clover_stats.accept_hist: accepted draft tokens 0 .. CLOVER_ACCEPT_HIST - 2, the
 * last bucket counts CLOVER_ACCEPT_HIST - 1 or more. */
#define CLOVER_ACCEPT_HIST 65
enum { CLOVER_FINISH_NONE = 0, CLOVER_FINISH_STOP = 1, CLOVER_FINISH_LENGTH = 2 };
/* Most alternatives clover_gen_params.logprobs may ask for (OpenAI's top_logprobs bound). */
#define CLOVER_MAX_LOGPROBS 20

/* Constrained decoding (structured output): the caller's grammar, told every token the decoder
 * makes final, in order. mask fills allowed[(n_vocab + 31) / 32] (bit t % 32 of word t / 32 set:
 * token t may follow the tokens accepted so far); accept takes the next token; rollback forgets
 * the last n accepted. Each returns 0, or nonzero to end the generation with an error. */
typedef struct {
    void *user;
    int (*mask)(void *user, uint32_t *allowed);
    int (*accept)(void *user, int32_t token);
    int (*rollback)(void *user, int32_t n);
} clover_constraint;

typedef struct {
    int32_t mode;            /* CLOVER_MODE_* */
    int32_t max_tokens;      /* > 0 */
    float temperature;       /* >= 0; 0 = greedy */
    int32_t top_k;           /* 0 = off */
    float top_p;             /* (0, 1]; 1 = off */
    uint64_t seed;
    int32_t block_size;      /* diffusion: > 0 */
    float threshold;         /* diffusion: (0, 1] */
    float coreset_top_p;     /* diffusion: (0, 1] */
    const int32_t *end_ids;  /* tokens that end generation (e.g. <|im_end|>, <|endoftext|>) */
    int32_t n_end_ids;
    /* Sampling and penalties (spec 5.3-5.4). Each logits row is processed in this order:
     * penalties, soft biases, temperature, top-k, top-p, min-p. Penalties only reweight logits;
     * they never stop generation. */
    float min_p;             /* [0, 1]; after top-p keep tokens with p >= min_p * p_max; 0 = off */
    float presence_penalty;  /* logits, finite (may be < 0): subtracted once from every token
                                already generated (committed or filled in the current block);
                                0 = off; default: the GGUF's (0.9) */
    float repetition_penalty;/* > 0: over the tokens penalty_scope names, a logit > 0 is divided
                                by it, one <= 0 multiplied (CTRL, as llama.cpp); 1 = off; default:
                                the GGUF's (1.05). Applied before presence and frequency. */
    float frequency_penalty; /* logits per occurrence among generated tokens, finite; 0 = off */
    const int32_t *logit_bias_ids;   /* [n_logit_bias] token ids in [0, n_vocab); a repeated id
                                        gets the sum of its values */
    const float *logit_bias_values;  /* [n_logit_bias] finite logits added after the penalties */
    int32_t n_logit_bias;            /* >= 0 */
    /* Soft bias ramps (spec 5.4): at generated index n (0 = the first generated token) add
     * min(bias_max, bias_slope * max(0, n - start)) to think_close_id while a thinking section
     * is open (the last of think_open_id / think_close_id in prompt + generated tokens is
     * think_open_id), and the same ramp from eos_bias_start to every end_ids token. */
    int32_t think_open_id, think_close_id; /* <think>, </think> in [0, n_vocab), -1 = none;
                                              default: looked up in the GGUF vocabulary */
    int32_t think_close_bias_start;  /* >= 0, generated tokens; default: the GGUF's (4096) */
    int32_t eos_bias_start;          /* >= 0, generated tokens; default: the GGUF's (8192) */
    float bias_slope;        /* alpha, logits per generated token, >= 0; 0 = ramps off; default 0.01 */
    float bias_max;          /* b_max, cap in logits, >= 0; default 10 */
    /* Prefix reuse: the context's cached tokens are prompt[0..n_reuse) (the caller knows what it
     * put there): 0 = reset the context and prefill the whole prompt (default); else n_reuse must
     * equal the context's n_past and be < n_prompt, and only prompt[n_reuse..] is prefilled
     * (GDN and conv state cannot be rewound, so only the whole cache can be reused). */
    int32_t n_reuse;
    int32_t penalty_scope;   /* CLOVER_PENALTY_RESPONSE: the repetition penalty counts generated
                                tokens only; CLOVER_PENALTY_ALL: the prompt's too (spec 5.4);
                                default: the GGUF's */
    /* Constrained decoding (NULL = none; decoding rules: docs/structured-output.md): ar and spec
     * choose every token from the constraint's allowed ones (spec's draft too, so the output is
     * constrained ar's); diffusion fills a block's slots left to right, each from the allowed
     * ones, several per pass while contiguous and above the threshold. */
    const clover_constraint *constraint;
    int32_t logprobs;        /* -1 = off (default); 0..CLOVER_MAX_LOGPROBS: record each emitted
                                token's log-probability and that many most likely alternatives
                                (clover_decoder_logprobs) */
} clover_gen_params;

/* CLOVER_OK when m can decode in mode (CLOVER_MODE_*), else CLOVER_E_ARG with the reason in err:
 * diffusion and spec need the block tensors, and the message says how to get them. */
CLOVER_API int clover_model_check_mode(const clover_model *m, int32_t mode, char *err, size_t err_size);

/* CLOVER_OK when p is valid for a decoder on c (clover_decoder_new makes the same check), else
 * CLOVER_E_ARG with the first bad field named in err: the mode (clover_model_check_mode),
 * max_tokens > 0, the sampling fields (temperature finite >= 0, top_k >= 0, top_p in (0, 1],
 * min_p in [0, 1], finite penalties with repetition_penalty > 0, logit_bias ids in [0, n_vocab)
 * with finite values, ramps >= 0), block_size > 0 (a block that does not fit the context ends
 * the generation), threshold and coreset_top_p in (0, 1], end_ids in [0, n_vocab), logprobs in
 * [-1, CLOVER_MAX_LOGPROBS], a constraint with its three functions. */
CLOVER_API int clover_gen_params_check(const clover_context *c, const clover_gen_params *p, char *err,
                                       size_t err_size);

/* Fill p with the model's defaults (spec 4.2 values from the GGUF; ramp slope and cap: the
 * engine's defaults above). */
CLOVER_API void clover_gen_params_default(const clover_model *m, clover_gen_params *p);

/* One sampling decision of spec 5.3-5.4 on a caller's logits row, made as the decoder makes
 * it: the row predicts generated index n_generated after prompt[0..n_prompt) and
 * generated[0..n_generated) (the penalty history and the think state), the sampler's RNG is
 * seeded with p->seed and draws once. mask_token_id (-1 = none) is never a candidate. p's
 * sampling fields and end_ids are used (mode, max_tokens and the diffusion fields are not).
 * processed (may be NULL) receives [n_vocab] logits after penalties and soft biases, before
 * temperature (the mask token -inf). Returns the token id and *confidence (in [0, 1]), or a
 * negative CLOVER_E_* code with the field named in err. */
CLOVER_API int32_t clover_sample_logits(const float *logits, int32_t n_vocab, int32_t mask_token_id,
                                        const clover_gen_params *p, const int32_t *prompt, int32_t n_prompt,
                                        const int32_t *generated, int32_t n_generated, float *processed,
                                        float *confidence, char *err, size_t err_size);

typedef struct {
    int64_t n_prompt;
    int64_t n_prompt_reused; /* prompt tokens taken from the cache instead of prefilled */
    int64_t n_generated;     /* tokens emitted so far (end token included when it stopped) */
    int64_t n_forward_prefill, n_forward_denoise, n_forward_commit, n_forward_decode;
    int64_t n_forward_draft, n_forward_verify; /* spec mode */
    int64_t accept_hist[CLOVER_ACCEPT_HIST];    /* spec mode: drafts accepted per verify */
    int64_t n_blocks;
    int64_t sum_distinct_experts; /* over block-mode passes (denoise, draft) and MoE layers */
    int64_t max_distinct_experts; /* largest per-layer count of one block-mode pass */
    /* the same without the coreset: the union of the rows' own top-k (spec 5.6) */
    int64_t sum_distinct_experts_full, max_distinct_experts_full;
    int32_t finish_reason;   /* CLOVER_FINISH_* */
} clover_stats;

typedef struct clover_decoder clover_decoder;

/* Reset the context, validate params, prefill the prompt (n_prompt >= 1). */
CLOVER_API clover_decoder *clover_decoder_new(clover_context *c, const clover_gen_params *p,
                                              const int32_t *prompt, int32_t n_prompt,
                                              char *err, size_t err_size);
/* Advance by one forward (ar: one token; diffusion: one denoising pass, plus the commit pass
 * when the block is complete; spec: one draft and one verify) and write the tokens that became
 * final to out (capacity cap >= block_size): in diffusion the newly filled slots contiguous with
 * the block's final start, possibly none. Returns 1 while more can follow, 0 when finished
 * (finish_reason set), < 0 on error. */
CLOVER_API int clover_decoder_step(clover_decoder *d, int32_t *out, int32_t cap, int32_t *n_out,
                                   char *err, size_t err_size);
CLOVER_API void clover_decoder_stats(const clover_decoder *d, clover_stats *out);
/* Log-probabilities of the tokens the last clover_decoder_step wrote (p.logprobs >= 0): for its
 * k-th token, logprob[k] and the n = p.logprobs most likely ids and their log-probabilities at
 * top_ids[k * n + i], top_logprobs[k * n + i], most likely first. Each is a log-softmax of the raw
 * logits row that chose the token (ar: the decode step's, spec: the verify's, diffusion: the
 * denoising pass's that filled the slot), over the ids other than the mask token, before
 * penalties, biases, the constraint and temperature. Returns that token count when cap covers it
 * (cap >= it; top arrays cap * n), else 0; 0 when logprobs are off. */
CLOVER_API int32_t clover_decoder_logprobs(const clover_decoder *d, float *logprob, int32_t *top_ids,
                                           float *top_logprobs, int32_t cap);
/* The diffusion block being denoised, for display: copies its block_size slots to tokens and
 * filled (1 = final, 0 = still the mask token) when cap >= block_size and returns block_size;
 * returns 0 between blocks and in the other modes. */
CLOVER_API int32_t clover_decoder_block(const clover_decoder *d, int32_t *tokens, uint8_t *filled, int32_t cap);
CLOVER_API void clover_decoder_free(clover_decoder *d);

#ifdef __cplusplus
}
#endif
#endif /* CLOVER_H */
