/* ggml_types.c: the ggml type table (ggml.h enum ggml_type and ggml.c type_traits: names, block
 * sizes, block bytes), for every id ggml numbers, computable here or not. */
#include "core/ggml_types.h"

#define T(name, block, bytes) {name, block, bytes, 0}
#define GONE(name) {name, 0, 0, 1}

static const clover_ggml_type TYPES[40] = {
    T("F32", 1, 4),         T("F16", 1, 2),         T("Q4_0", 32, 18),      T("Q4_1", 32, 20),
    GONE("Q4_2"),           GONE("Q4_3"),           T("Q5_0", 32, 22),      T("Q5_1", 32, 24),
    T("Q8_0", 32, 34),      T("Q8_1", 32, 36),      T("Q2_K", 256, 84),     T("Q3_K", 256, 110),
    T("Q4_K", 256, 144),    T("Q5_K", 256, 176),    T("Q6_K", 256, 210),    T("Q8_K", 256, 292),
    T("IQ2_XXS", 256, 66),  T("IQ2_XS", 256, 74),   T("IQ3_XXS", 256, 98),  T("IQ1_S", 256, 50),
    T("IQ4_NL", 32, 18),    T("IQ3_S", 256, 110),   T("IQ2_S", 256, 82),    T("IQ4_XS", 256, 136),
    T("I8", 1, 1),          T("I16", 1, 2),         T("I32", 1, 4),         T("I64", 1, 8),
    T("F64", 1, 8),         T("IQ1_M", 256, 56),    T("BF16", 1, 2),        GONE("Q4_0_4_4"),
    GONE("Q4_0_4_8"),       GONE("Q4_0_8_8"),       T("TQ1_0", 256, 54),    T("TQ2_0", 256, 66),
    GONE("IQ4_NL_4_4"),     GONE("IQ4_NL_4_8"),     GONE("IQ4_NL_8_8"),     T("MXFP4", 32, 17),
};

/* The table's entry for id t, NULL past its end. */
const clover_ggml_type *clover_ggml_type_of(uint32_t t) {
    return t < sizeof TYPES / sizeof TYPES[0] ? &TYPES[t] : 0;
}

/* The name for messages (core/ggml_types.h). */
const char *clover_ggml_type_label(uint32_t t) {
    static const char *const gone[40] = {[4] = "Q4_2 (removed)", [5] = "Q4_3 (removed)",
                                         [31] = "Q4_0_4_4 (removed)", [32] = "Q4_0_4_8 (removed)",
                                         [33] = "Q4_0_8_8 (removed)", [36] = "IQ4_NL_4_4 (removed)",
                                         [37] = "IQ4_NL_4_8 (removed)", [38] = "IQ4_NL_8_8 (removed)"};
    const clover_ggml_type *e = clover_ggml_type_of(t);
    if (!e) return "unknown";
    return e->removed ? gone[t] : e->name;
}

/* The ggml name of type id `type` (clover.h), NULL for an id ggml does not define. */
const char *clover_type_name(int32_t type) {
    const clover_ggml_type *e = type >= 0 ? clover_ggml_type_of((uint32_t)type) : 0;
    return e && !e->removed ? e->name : 0;
}
