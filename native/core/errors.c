/* errors.c: clover_set_err (core/errors.h). */
#include "core/errors.h"

#include <stdarg.h>
#include <stdio.h>

/* Format the message into err when there is room for one; return code unchanged. */
int clover_set_err(char *err, size_t err_size, int code, const char *fmt, ...) {
    if (err && err_size > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, err_size, fmt, ap);
        va_end(ap);
    }
    return code;
}
