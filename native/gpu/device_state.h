/* device_state.h: the context's state on the GPU (gpu/device_state.c). */
#ifndef CLOVER_GPU_DEVICE_STATE_H
#define CLOVER_GPU_DEVICE_STATE_H

#include "core/errors.h"
#include "model/model.h"
#include "model/pass.h"

/* Element-type bits of the context's KV cache for the CUDA backend (CLOVER_KV_*_F16). */
CLOVER_HIDDEN int kv_f16_bits(const clover_context *c);
/* Offloaded attention layers among the first n_slots attention layers. */
CLOVER_HIDDEN int64_t offloaded_attn(const clover_model *m, int n_slots);
/* The context's device KV cache (the offloaded attention layers only), allocated at the first use. */
CLOVER_HIDDEN int kv_dev_alloc(clover_context *c, char *err, size_t err_size);
/* Rows [kv_dev_rows[slot], pos) of attention layer slot's device cache brought up to date with the host's. */
CLOVER_HIDDEN int kv_dev_catch_up(clover_context *c, int slot, int64_t pos, char *err, size_t err_size);
/* Attention of an offloaded layer on the GPU over the device KV cache (the CPU path's). */
CLOVER_HIDDEN int gpu_attention(fwd *f, const clover_layer *ly, const float *qg, float scale, float *att);
/* Bytes of one GDN layer's conv history (conv_state's slot). */
CLOVER_HIDDEN size_t conv_slot_bytes(const clover_hparams *hp);
/* The GDN state (and conv history) of the slots current on the device brought back to the host. */
CLOVER_HIDDEN int gdn_to_host(clover_context *c, char *err, size_t err_size);
/* clover_context_checkpoint's copy of the device slots, kept on the device. */
CLOVER_HIDDEN int gdn_snapshot_on_device(clover_context *c, char *err, size_t err_size);
/* The device GDN state (and, resident, conv history) of every GDN layer, unless allocated. */
CLOVER_HIDDEN int gdn_dev_alloc(clover_context *c, char *err, size_t err_size);
/* Whether GDN layer ly runs its recurrence on the GPU. */
CLOVER_HIDDEN int gdn_on_gpu(const clover_layer *ly, const gdn_dims *d);
/* At context creation on a model with weights on the GPU: the device KV cache and GDN state. */
CLOVER_HIDDEN int gpu_state_reserve(clover_context *c, char *err, size_t err_size);
/* Make the device copy of GDN slot g current. */
CLOVER_HIDDEN int gdn_slot_to_device(clover_context *c, int g, char *err, size_t err_size);
/* The GPU's GDN kind for a prefix-mode forward of T rows. */
CLOVER_HIDDEN int gpu_gdn_forward(const clover_context *c, int64_t T);
/* One GDN recurrence (or, b NULL, the block operator's mixing) of an offloaded layer on the GPU. */
CLOVER_HIDDEN int gpu_gdn(fwd *f, const clover_layer *ly, int kind, const gdn_dims *d, const float *cv, const float *b,
            const float *a, float *o);
/* Free the routed experts' host staging. */
CLOVER_HIDDEN void moe_host_release(clover_context *c);

#endif
