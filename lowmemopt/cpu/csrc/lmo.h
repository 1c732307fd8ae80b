/* lowmemopt CPU kernels: one fused pass per parameter, decode -> fp32 math -> encode, over rows of quantization blocks.
 * This header is what the units share: the ABI (the argument structs lowmemopt/cpu/ffi.py fills, the exported
 * kernels), the 16-lane vectors of each instruction set (vectors_*.h), the state slots as the row loops see them, and
 * the row runner's interface. The units: runner.c (one parameter's rows, a bucket of parameters, the scan),
 * elementwise.c (Adam / AdamW, Lion, SGD and the parameter write), codec.c (the 8- / 4-bit codec alone), factored.c
 * (Adafactor, CAME). library.c includes them, in that order, into one translation unit: the compiler sees one file
 * and inlines across the units, so their internals are static and each unit sees what the ones before it define.
 *
 * Built at first use by lowmemopt/cpu/build.py with the system C compiler (no torch headers) and called through
 * ctypes with raw pointers. Each kernel is a fused implementation of one algorithm for any
 * (parameter dtype, state format) combination; the pure PyTorch composition (StateFormat.decode -> the algorithm's
 * math -> StateFormat.encode) is the reference it is tested against:
 *
 *   - The fp32 math repeats torch's CPU kernels operation for operation, rounding included: torch evaluates
 *     `a.add_(b, alpha=s)` as fma(b, s, a), `lerp` as fma(w, end - start, start) (w < 0.5) or fma(w - 1, end - start,
 *     end), `addcmul_(t, t, value=s)` as fma(s * t, t, a), and casts Python scalars to float first. The build uses
 *     -ffp-contract=off so that the compiler adds no fused multiply-add of its own. One difference: sqrt here is IEEE
 *     (correctly rounded, as in torch's fused AdamW and in inductor); torch's eager CPU Tensor.sqrt is MKL's, within
 *     one ulp. With a correctly rounded sqrt in the eager path, results are identical bit for bit.
 *   - 8-bit codes are the exact rounding rule of lowmemopt.quant.maps (nearest code in fp32, ties to the lower code,
 *     positive values never to upow2's zero code), computed on the float's bits (pow2_code): the state maps' codes
 *     are floats with a few mantissa bits per binade, so the nearest code is a rounding add and a shift.
 *   - 4-bit codes (ST_Q4, lowmemopt.quant.q4: two per byte, element 2i in the low nibble) are q4's encoder's: the
 *     count of the map's decision thresholds <= y, a 4-step binary search in registers (q4_code).
 *   - Block scales: unsigned max(max x, 0); signed max(max x / book[255], min x / book[0]); y = x / scale (IEEE
 *     division, scale 0 -> 1), as lowmemopt.quant.blockwise.block_scale / encode_rows.
 *
 * The 16-lane vectors come in three builds (LMO_ISA, chosen at run time by lowmemopt/cpu/build.py): AVX-512 (zmm
 * registers, the decode table in registers: permutes, no gathers), AVX2 (two ymm halves; the decode table gathered
 * from L1, the encoder's 32-entry tables by 8-entry permutes) and the scalar reference (a 16-float struct, the exact
 * bucket table for encoding). Every kernel is written once over the vector primitives; results are identical in
 * every build.
 */
#ifndef LMO_H
#define LMO_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LMO_ABI_VERSION 18
#define LMO_MAX_BS 4096   /* largest block size a row buffer holds */
#define LMO_MAX_SLOTS 4

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };  /* parameter / gradient dtypes */
enum { ST_F32 = 0, ST_BF16 = 1, ST_Q8 = 2, ST_Q4 = 3 }; /* state slot storage */
enum { LMO_OK = 0, LMO_EBADARG = 1 };

/* The pow2 maps' encoder (see pow2_code). |y|'s bits are clamped to [e_lo << 23, 1.0]; then, per biased exponent e
 * (table entry e & 31), code = (bits + neg + add[e]) >> shift[e]. Built by lowmemopt/cpu/codec.py. */
typedef struct lmo_pow2 {
    uint32_t add[32];   /* rounding addend (half an output step, less one) plus the code offset << shift */
    uint32_t shift[32]; /* 23 - mantissa bits of the binade's codes (24: one code for the whole class) */
    int32_t e_lo;       /* lowest exponent class: everything below it is clamped into it */
    int32_t mirror;     /* signed map: a negative y takes code mirror - code(|y|) (0: unsigned) */
} lmo_pow2;

typedef struct {
    void *data;         /* fp32 / bf16 values, uint8 codes (q8), or uint8 nibbles (q4: element 2i low, 2i + 1 high) */
    float *absmax;      /* q8 / q4: one scale per block row */
    const float *book;  /* q8: the 256 code values, ascending; q4: the 16 */
    const uint8_t *planes; /* q8: the code values' bytes, planes[256 k + i] = byte k of book[i] */
    const int32_t *packed;     /* q8 / q4: the map's 65536-entry bucket table (exact, one lookup; the portable build) */
    const struct lmo_pow2 *pow2; /* q8: the pow2 encoder's tables (lowmemopt/cpu/codec.py) */
    const float *thr;   /* q4: the 15 decision thresholds, ascending, then NaN: code(y) = #{k: thr[k] <= y} */
    int32_t kind;       /* ST_* */
    int32_t is_signed;  /* q8 / q4: signed map (its scale covers both extremes) */
} lmo_slot;

typedef struct {
    void *p;             /* parameter, rows of bs elements, p_dtype */
    const void *g;       /* gradient, same layout, g_dtype */
    int64_t nrows;
    int32_t bs;          /* elements per row (the quantization block size) */
    int32_t p_dtype, g_dtype;
    int32_t nthreads;
    int32_t nslots;
    int32_t flags;       /* algorithm-specific switches */
    int32_t tail;        /* fp32 / bf16 state: elements after the nrows full rows, done too (0 <= tail < bs <= 64) */
    lmo_slot slot[LMO_MAX_SLOTS];
    double h[16];        /* algorithm-specific hyper-parameters (cast to float where torch casts them) */
    /* optional, any kernel that runs on run_rows: the sum of squares of another tensor (the next parameter's
     * gradient), computed in the same parallel loop so that its memory reads overlap this kernel's arithmetic */
    const void *scan;    /* NULL: none */
    int64_t scan_n;      /* its elements */
    int32_t scan_dtype;  /* DT_* */
    int32_t scan_pad;
    float *scan_sumsq;   /* out: fp32 sum of squares (Inf / NaN if it overflows or holds a NaN / Inf) */
    /* how a bf16 / fp16 parameter takes its fp32 result (lowmemopt.rounding; fp32 parameters: always nearest) */
    int32_t p_update;    /* UPD_NEAREST | UPD_STOCHASTIC | UPD_KAHAN */
    uint32_t sr_key;     /* stochastic: the hash key of (seed, step) */
    int64_t p_offset;    /* stochastic: flat index in its parameter of element 0 of p (the hash's counter) */
    uint16_t *kahan;     /* kahan: compensation buffer in p's dtype (bf16 / fp16), laid out as p */
    /* loss scaling (torch.amp.GradScaler's native path): the gradient's multiplier 1 / scale, applied where g is
     * loaded (load_grad); 0 or 1: none */
    float g_mult;
} lmo_args;

enum { UPD_NEAREST = 0, UPD_STOCHASTIC = 1, UPD_KAHAN = 2 };

/* the ABI's other struct: a 2-D parameter's factored step (factored.c) */

#define LMO_NSEG 16 /* fixed row segments: sums do not depend on the thread count */

typedef struct {
    void *p;
    const void *g;
    int64_t R, C;
    int32_t p_dtype, g_dtype, nthreads;
    int32_t bs;                  /* the momentum slot's block size (q8), else 16 */
    int32_t has_m;               /* the full-size first moment is slot m */
    int32_t flags;               /* 1: weight decay; lmo_adafactor_step 2: alpha from RMS(p); the steps 4: check g */
    lmo_slot m;
    float *rf, *cf;              /* factors of V^-1/2: u = (rf[r] cf[c]) g (the steps write them) */
    float *rf2, *cf2;            /* CAME: factors of the instability's U^-1/2 */
    float *u;                    /* lmo_adafactor_torch_u / _apply: the update direction [R, C] */
    float *vr, *vc;              /* the steps: the second moment's row / column EMAs [R], [C], updated in place */
    float *vr2, *vc2;            /* lmo_came_step: the instability's row / column EMAs */
    double *work;                /* LMO_NSEG * (C + 1) doubles: per-segment partial sums */
    double *result;              /* sum of squares (the steps with flag 4: g's, fp32; not finite: nothing written) */
    double h[12];
    float g_mult;                /* the gradient's loss scaling multiplier, as lmo_args.g_mult (0 or 1: none) */
} lmo_fact;

/* the ABI's file request (fileio.c): nbytes at buf to or from the file fd at offset; err: 0 or the errno it failed with */
typedef struct {
    int32_t fd;
    int32_t write;       /* 1: buf -> file (pwrite), 0: file -> buf (pread) */
    int64_t offset;
    void *buf;
    int64_t nbytes;
    int32_t err;         /* out */
    int32_t pad;
} lmo_io;

/* exported kernels (lowmemopt/cpu/ffi.py calls them through ctypes); 0 (LMO_OK) or LMO_EBADARG */
int lmo_abi_version(void);
int lmo_isa(void);
int lmo_scan(const lmo_args *a);
int lmo_adam(const lmo_args *a);
int lmo_adam_many(const lmo_args *a, int64_t n, uint8_t *ok);
int lmo_file_io(lmo_io *req, int64_t n, int32_t nthreads);
int lmo_lion(const lmo_args *a);
int lmo_lion_many(const lmo_args *a, int64_t n, uint8_t *ok);
int lmo_sgd(const lmo_args *a);
int lmo_sgd_many(const lmo_args *a, int64_t n, uint8_t *ok);
int lmo_encode(const lmo_args *a);
int lmo_decode(const lmo_args *a);
int lmo_adafactor_step(const lmo_fact *f);
int lmo_came_step(const lmo_fact *f);
int lmo_factored_steps(lmo_fact *const *fs, const int32_t *kinds, int32_t *rcs, int64_t n, int32_t nthreads);
int lmo_adafactor_torch_u(const lmo_fact *f);
int lmo_adafactor_torch_apply(const lmo_fact *f);

/* ------------------------------------------------------------------------------------------------------------------ */
/* 16-lane vectors                                                                                                     */

/* LMO_ISA picks the vector code: 2 AVX-512 (F, BW, VL, DQ; VBMI decodes 64 codes at once), 1 AVX2 + FMA + F16C,
 * 0 the scalar reference (plain C on 16-float structs). The build passes -DLMO_ISA=...; without it, the best the
 * compiler targets. */
#ifndef LMO_ISA
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define LMO_ISA 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LMO_ISA 1
#else
#define LMO_ISA 0
#endif
#endif

#if LMO_ISA == 2
#include "vectors_avx512.h"
#elif LMO_ISA == 1
#include "vectors_avx2.h"
#else
#include "vectors_scalar.h"
#endif

/* ------------------------------------------------------------------------------------------------------------------ */
/* parameters, gradients and state slots                                                                              */

static inline vf load_dt(int dt, const void *base, int64_t i) {
    if (dt == DT_F32) return v_load((const float *)base + i);
    if (dt == DT_BF16) return load_bf16((const uint16_t *)base + i);
    return load_f16((const uint16_t *)base + i);
}
static inline void store_dt(int dt, void *base, int64_t i, vf x) {
    if (dt == DT_F32) v_store((float *)base + i, x);
    else if (dt == DT_BF16) store_bf16((uint16_t *)base + i, x);
    else store_f16((uint16_t *)base + i, x);
}

/* The gradient as the step sees it under loss scaling: float(g) * mult rounded to g's dtype and back, as
 * torch.amp.GradScaler's unscale_ stores it in the gradient (fp32: the product). mult 0 or 1: g itself. */
static inline vf load_grad(int dt, const void *base, int64_t i, float mult) {
    uint16_t t[16] __attribute__((aligned(64)));
    vf g = load_dt(dt, base, i);
    if (mult == 0.0f || mult == 1.0f) return g;
    g = v_mul(g, v_set(mult));
    if (dt == DT_F32) return g;
    store_dt(dt, t, 0, g);
    return load_dt(dt, t, 0);
}

/* One slot as a row loop sees it. The kind is a compile-time constant wherever these inline into a specialized row
 * function; the running max / min of a q8 row stay in the caller's registers. */
typedef struct {
    lut256 book;              /* q8: decode table */
    void *data;
    float *absmax;
    const int32_t *packed;
    const lmo_pow2 *pow2;
    q4tab q4;                 /* q4: the values and thresholds */
    float *buf;               /* q8 / q4: the row's new fp32 values, encoded at the end of the row */
    float book_lo, book_hi;   /* q8 / q4: the smallest and largest code value */
    int is_signed;
} slot_rt;

typedef struct { vf scale, hi, lo, sum; } rowacc; /* sum: NaN if the block may hold a NaN */

static void slot_rt_init(slot_rt *r, const lmo_slot *s, float *buf) {
    r->data = s->data;
    r->absmax = s->absmax;
    r->packed = s->packed;
    r->pow2 = s->pow2;
    r->buf = buf;
    r->is_signed = s->is_signed;
    if (s->kind == ST_Q8) {
        lut256_init(&r->book, s->book, s->planes);
        r->book_lo = s->book[0];
        r->book_hi = s->book[255];
    } else if (s->kind == ST_Q4) {
        float t[3][16];
        int k;
        for (k = 0; k < 16; k++) {
            t[0][k] = s->thr[k];
            t[1][k] = k + 1 < 16 ? s->thr[k + 1] : NAN;
            t[2][k] = k + 3 < 16 ? s->thr[k + 3] : NAN;
        }
        r->q4.book = v_load(s->book);
        r->q4.t0 = v_load(t[0]);
        r->q4.t1 = v_load(t[1]);
        r->q4.t3 = v_load(t[2]);
        r->q4.t7 = v_set(s->thr[7]);
        r->book_lo = s->book[0];
        r->book_hi = s->book[15];
    }
}
static inline __attribute__((always_inline)) void slot_row_begin(const int kind, const slot_rt *r, int64_t row, rowacc *acc) {
    if (kind == ST_Q8 || kind == ST_Q4) {
        acc->scale = v_set(r->absmax[row]);
        acc->hi = v_set(-INFINITY);
        acc->lo = v_set(INFINITY);
        acc->sum = v_set(0.0f);
    }
}
/* element i of the flattened slot */
static inline __attribute__((always_inline)) vf slot_load(const int kind, const slot_rt *r, int64_t i, const rowacc *acc) {
    if (kind == ST_F32) return v_load((const float *)r->data + i);
    if (kind == ST_BF16) return load_bf16((const uint16_t *)r->data + i);
    if (kind == ST_Q4) return v_mul(q4_decode(&r->q4, q4_load_codes((const uint8_t *)r->data + i / 2)), acc->scale);
    return v_mul(lut256_get(&r->book, load_codes((const uint8_t *)r->data + i)), acc->scale);
}
/* q8: decode n (1..4) consecutive vectors from element i into out (64 codes at once); dense slots load each vector
 * where it is used (slot_get) instead: loading fp32 / bf16 state ahead of the stores to other arrays lets a load
 * alias an in-flight store in the low 12 address bits (4K aliasing), which costs up to 2x on some array offsets. */
static inline __attribute__((always_inline)) void slot_loadn(const int kind, const slot_rt *r, int64_t i, int n,
                                                               const rowacc *acc, vf out[4]) {
    int u;
    if (kind != ST_Q8 && kind != ST_Q4) return;
    if (kind == ST_Q8 && n == 4) {
        lut256_get64(&r->book, (const uint8_t *)r->data + i, out);
        for (u = 0; u < 4; u++) out[u] = v_mul(out[u], acc->scale);
        return;
    }
    for (u = 0; u < n; u++) out[u] = slot_load(kind, r, i + 16 * u, acc);
}
/* vector u of a group that starts at element i - 16 u (q8: from slot_loadn's out) */
static inline __attribute__((always_inline)) vf slot_get(const int kind, const slot_rt *r, int64_t i, const rowacc *acc,
                                                          const vf out[4], int u) {
    return kind == ST_Q8 || kind == ST_Q4 ? out[u] : slot_load(kind, r, i, acc);
}
/* element i of the flattened slot, j its position in the row */
static inline __attribute__((always_inline)) void slot_store(const int kind, const slot_rt *r, int64_t i, int j, vf x, rowacc *acc) {
    if (kind == ST_F32) {
        v_store((float *)r->data + i, x);
    } else if (kind == ST_BF16) {
        store_bf16((uint16_t *)r->data + i, x);
    } else {
        v_store(r->buf + j, x);
        acc->hi = v_acc_max(acc->hi, x);
        acc->lo = v_acc_min(acc->lo, x);
        acc->sum = v_add(acc->sum, x);
    }
}
/* q8: the row's scale, then every value's code */
static inline __attribute__((always_inline)) void slot_block_end(const int kind, const slot_rt *r, int64_t row, int64_t start,
                                                                   int len, const rowacc *acc) {
    float hi, lo, scale;
    uint8_t *codes;
    vf div;
    if (kind != ST_Q8 && kind != ST_Q4) return;
    hi = v_hmax(acc->hi);
    lo = v_hmin(acc->lo);
    if (__builtin_expect(v_anynan(acc->sum), 0)) { /* a NaN (or +inf and -inf): exact aminmax */
        int j;
        hi = -INFINITY;
        lo = INFINITY;
        for (j = 0; j < len; j++) {
            float x = r->buf[j];
            hi = (hi != hi || x != x) ? hi + x : (x > hi ? x : hi);
            lo = (lo != lo || x != x) ? lo + x : (x < lo ? x : lo);
        }
    }
    if (r->is_signed) {
        float a = hi / r->book_hi, b = lo / r->book_lo;
        scale = (a != a || b != b) ? a + b : (a > b ? a : b);
    } else {
        scale = (hi != hi) ? hi : (hi > 0.0f ? hi : 0.0f);
    }
    div = v_set(scale > 0.0f ? scale : 1.0f);
    if (kind == ST_Q4) { /* start and len are even (multiples of 16): whole bytes */
        int j;
        codes = (uint8_t *)r->data + start / 2;
        for (j = 0; j < len; j += 16) q4_store_codes(codes + j / 2, q4_code(&r->q4, r->packed, v_div(v_load(r->buf + j), div)));
    } else {
        codes = (uint8_t *)r->data + start;
        encode_block(r->pow2, r->packed, r->is_signed, r->buf, len, div, codes);
    }
    r->absmax[row] = scale;
}
/* q8: block `row` of a tensor cut into rows of bs elements */
static inline __attribute__((always_inline)) void slot_row_end(const int kind, const slot_rt *r, int64_t row, int bs,
                                                                 const rowacc *acc) {
    slot_block_end(kind, r, row, row * (int64_t)bs, bs, acc);
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* the row runner (runner.c), shared by the row kernels (elementwise.c, codec.c)                                       */

/* Run rows(args, rt, r0, r1) over [0, nrows) split into one contiguous range per thread. */
typedef void (*rows_fn)(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1);
typedef rows_fn (*pick_fn)(const lmo_args *a);

/* fn over a's rows in parallel chunks, then its tail; with a->scan, that sum of squares too (runner.c) */
static int run_rows(const lmo_args *a, rows_fn fn);
/* n parameters of one algorithm (pick: its rows function per storage kind) in one parallel region (runner.c) */
static int run_many(const lmo_args *a, int64_t n, uint8_t *ok, pick_fn pick);

/* The slots' storage kind (all slots of a parameter share one: they are chosen by the same rule), or -1. */
static int common_kind(const lmo_args *a) {
    int k;
    for (k = 1; k < a->nslots; k++)
        if (a->slot[k].kind != a->slot[0].kind) return -1;
    return a->nslots ? a->slot[0].kind : ST_F32;
}

/* Instantiate rows function BODY(a, rt, r0, r1, KIND) for each storage kind; dispatch on the slots' kind. The body
 * sees a local copy of the arguments: no store to the parameter or the state can alias it, so its fields (pointers,
 * dtypes, modes) stay in registers instead of being reloaded after every store. */
#define LMO_SPECIALIZE(name)                                                                                          \
    static void name##_f32(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1) { const lmo_args A = *a; name(&A, rt, r0, r1, ST_F32); } \
    static void name##_bf16(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1) { const lmo_args A = *a; name(&A, rt, r0, r1, ST_BF16); } \
    static void name##_q8(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1) { const lmo_args A = *a; name(&A, rt, r0, r1, ST_Q8); } \
    static void name##_q4(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1) { const lmo_args A = *a; name(&A, rt, r0, r1, ST_Q4); } \
    static rows_fn name##_pick(const lmo_args *a) {                                                                    \
        switch (common_kind(a)) {                                                                                      \
        case ST_F32: return name##_f32;                                                                                \
        case ST_BF16: return name##_bf16;                                                                              \
        case ST_Q8: return name##_q8;                                                                                  \
        case ST_Q4: return name##_q4;                                                                                  \
        default: return NULL;                                                                                          \
        }                                                                                                              \
    }                                                                                                                  \
    static int name##_run(const lmo_args *a) {                                                                         \
        rows_fn fn = name##_pick(a);                                                                                   \
        return fn ? run_rows(a, fn) : LMO_EBADARG;                                                                     \
    }

#endif /* LMO_H */
