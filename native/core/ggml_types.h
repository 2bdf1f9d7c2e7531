/* ggml_types.h: the one table of ggml tensor types (ggml.h's numbering, ids 0..39): name, values
 * per block and bytes per block (core/ggml_types.c). clover_type_name (clover.h) reads it; the
 * GGUF reader (core/gguf.c) takes block sizes and names for its messages from it. */
#ifndef CLOVER_CORE_GGML_TYPES_H
#define CLOVER_CORE_GGML_TYPES_H

#include "core/errors.h"

#include <stdint.h>

/* One ggml type: its name (ggml's type_name), values per block and bytes per block; a type that
 * ggml removed keeps its old name with removed set (block sizes 0). */
typedef struct {
    const char *name;
    int32_t block;
    int32_t block_bytes;
    int removed;
} clover_ggml_type;

/* The entry of ggml type id t, or NULL for an id outside the table. */
CLOVER_HIDDEN const clover_ggml_type *clover_ggml_type_of(uint32_t t);
/* A type's name for messages: the name, "NAME (removed)" for a removed id, "unknown" else. */
CLOVER_HIDDEN const char *clover_ggml_type_label(uint32_t t);

#endif
