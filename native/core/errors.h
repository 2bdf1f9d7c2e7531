/* errors.h: the engine's error reporting, for every C and CUDA file (not public API).
 *
 * The codes themselves are clover.h's CLOVER_OK / CLOVER_E_* (the one definition, public);
 * clover_set_err writes a message for them. CLOVER_HIDDEN marks functions shared between the
 * engine's files but not part of the library's interface (hidden from the dynamic symbol table,
 * so no other library's symbol of the same name can interpose them).
 */
#ifndef CLOVER_CORE_ERRORS_H
#define CLOVER_CORE_ERRORS_H

#include "clover.h"

#include <stddef.h>

#if defined(__GNUC__)
#define CLOVER_HIDDEN __attribute__((visibility("hidden")))
#else
#define CLOVER_HIDDEN
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Write a printf-formatted message into err (may be NULL or err_size 0: nothing written) and
 * return code, so that a failure reads `return clover_set_err(err, n, CLOVER_E_ARG, ...)`. */
int clover_set_err(char *err, size_t err_size, int code, const char *fmt, ...);

#ifdef __cplusplus
}
#endif

#endif
