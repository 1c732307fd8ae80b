/* The 8- / 4-bit codec alone (lmo_encode, lmo_decode). */
#include "lmo.h"

/* ------------------------------------------------------------------------------------------------------------------ */
/* The 8- / 4-bit codec alone: slot[0] <-> fp32 rows (tests; the full-size slots of non-elementwise optimizers)       */

static inline __attribute__((always_inline)) void encode_rows(const lmo_args *a, const slot_rt *rt, int64_t r0,
                                                                int64_t r1, const int K) {
    const float *x = (const float *)a->g;
    const int bs = a->bs;
    slot_rt s = rt[0];
    int64_t row;
    int j;
    for (row = r0; row < r1; row++) {
        rowacc acc;
        slot_row_begin(K, &s, row, &acc);
        for (j = 0; j < bs; j += 16) slot_store(K, &s, row * bs + j, j, v_load(x + row * bs + j), &acc);
        slot_row_end(K, &s, row, bs, &acc);
    }
}
LMO_SPECIALIZE(encode_rows)

static inline __attribute__((always_inline)) void decode_rows(const lmo_args *a, const slot_rt *rt, int64_t r0,
                                                                int64_t r1, const int K) {
    float *x = (float *)a->p;
    const int bs = a->bs;
    slot_rt s = rt[0];
    int64_t row;
    int j;
    for (row = r0; row < r1; row++) {
        rowacc acc;
        slot_row_begin(K, &s, row, &acc);
        for (j = 0; j < bs; j += 16) v_store(x + row * bs + j, slot_load(K, &s, row * bs + j, &acc));
    }
}
LMO_SPECIALIZE(decode_rows)

/* slot[0] <- encode(g as fp32 rows) */
int lmo_encode(const lmo_args *a) {
    if (a->nslots != 1) return LMO_EBADARG;
    return encode_rows_run(a);
}

/* p as fp32 rows <- decode(slot[0]) */
int lmo_decode(const lmo_args *a) {
    if (a->nslots != 1) return LMO_EBADARG;
    return decode_rows_run(a);
}
