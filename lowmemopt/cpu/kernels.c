/* lowmemopt CPU kernels: one fused pass per parameter, decode -> fp32 math -> encode, over rows of quantization blocks.
 *
 * Built at first use by lowmemopt/cpu/build.py with the system C compiler (no torch headers) and called through ctypes
 * with raw pointers. Each kernel is a fused implementation of one algorithm for any (parameter dtype, state format)
 * combination; the pure PyTorch composition (StateFormat.decode -> the algorithm's math -> StateFormat.encode) is the
 * reference it is tested against:
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
 * bucket table for encoding). Every kernel below is written once over the vector primitives; results are identical
 * in every build.
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LMO_ABI_VERSION 15
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

int lmo_abi_version(void) { return LMO_ABI_VERSION; }

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

int lmo_isa(void) { return LMO_ISA; }

#if LMO_ISA == 2
#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__))
#error "LMO_ISA=2 (avx512) needs a compiler target with AVX-512 F, BW, VL and DQ"
#endif
#define LMO_AVX512 1
#include <immintrin.h>

typedef __m512 vf;
typedef __m512i vi;
typedef __mmask16 vm;

static inline vf v_set(float x) { return _mm512_set1_ps(x); }
static inline vf v_load(const float *x) { return _mm512_loadu_ps(x); }
static inline void v_store(float *x, vf a) { _mm512_storeu_ps(x, a); }
static inline vf v_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf v_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf v_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf v_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf v_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf v_sqrt(vf a) { return _mm512_sqrt_ps(a); }
static inline vf v_neg(vf a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32((int)0x80000000))); }
/* max / min (vrangeps; a NaN operand is not propagated: see slot_store for the NaN check) */
static inline vf v_max(vf a, vf b) { return _mm512_range_ps(a, b, 0x05); }
static inline vf v_min(vf a, vf b) { return _mm512_range_ps(a, b, 0x04); }
static inline int v_anynan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
/* a block's running max / min (slot_store): NaN need not propagate, slot_block_end redoes a block that holds one */
static inline vf v_acc_max(vf a, vf b) { return v_max(a, b); }
static inline vf v_acc_min(vf a, vf b) { return v_min(a, b); }
/* horizontal max / min of vectors that hold no NaN (v_max / v_min drop them; slot_store checks separately) */
static inline float v_hmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline float v_hmin(vf a) { return _mm512_reduce_min_ps(a); }
/* torch.sign: (0 < x) - (x < 0), so +-0 -> +0 */
static inline vf v_sign(vf a) {
    vf z = _mm512_setzero_ps();
    vf pos = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(z, a, _CMP_LT_OQ), z, v_set(1.0f));
    vf neg = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(a, z, _CMP_LT_OQ), z, v_set(1.0f));
    return _mm512_sub_ps(pos, neg);
}

static inline vf load_bf16(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}
static inline void store_bf16(uint16_t *x, vf a) {
    /* round to nearest even; NaN -> 0x7FC0 (c10::BFloat16) */
    vi u = _mm512_castps_si512(a);
    vi lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    vi r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256((__m256i *)x, _mm512_cvtepi32_epi16(r));
}
static inline vf load_f16(const uint16_t *x) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)x)); }
static inline void store_f16(uint16_t *x, vf a) {
    _mm256_storeu_si256((__m256i *)x, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* A 256-entry fp32 table held as 16 registers; lookups are register permutes (no memory gathers). With VBMI, 64
 * codes at a time go through the table's four byte planes (two 128-entry byte permutes each), which the unpacks
 * reassemble into floats; the codes are permuted first so that the floats come out in order. */
typedef struct {
    vf r[16];
#ifdef __AVX512VBMI__
    vi plane[4][4]; /* plane[k][q]: byte k of book[64 q .. 64 q + 63] */
#endif
} lut256;
static inline void lut256_init(lut256 *t, const float *x, const uint8_t *planes) {
    int i;
    for (i = 0; i < 16; i++) t->r[i] = _mm512_loadu_ps(x + 16 * i);
#ifdef __AVX512VBMI__
    for (i = 0; i < 16; i++) t->plane[i / 4][i % 4] = _mm512_loadu_si512(planes + 64 * i);
#else
    (void)planes;
#endif
}
static inline vf lut256_get(const lut256 *t, vi idx) {
    vf a0 = _mm512_permutex2var_ps(t->r[0], idx, t->r[1]);
    vf a1 = _mm512_permutex2var_ps(t->r[2], idx, t->r[3]);
    vf a2 = _mm512_permutex2var_ps(t->r[4], idx, t->r[5]);
    vf a3 = _mm512_permutex2var_ps(t->r[6], idx, t->r[7]);
    vf a4 = _mm512_permutex2var_ps(t->r[8], idx, t->r[9]);
    vf a5 = _mm512_permutex2var_ps(t->r[10], idx, t->r[11]);
    vf a6 = _mm512_permutex2var_ps(t->r[12], idx, t->r[13]);
    vf a7 = _mm512_permutex2var_ps(t->r[14], idx, t->r[15]);
    vm b5 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
    vm b6 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(64));
    vm b7 = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(128));
    vf c0 = _mm512_mask_blend_ps(b5, a0, a1), c1 = _mm512_mask_blend_ps(b5, a2, a3);
    vf c2 = _mm512_mask_blend_ps(b5, a4, a5), c3 = _mm512_mask_blend_ps(b5, a6, a7);
    vf d0 = _mm512_mask_blend_ps(b6, c0, c1), d1 = _mm512_mask_blend_ps(b6, c2, c3);
    return _mm512_mask_blend_ps(b7, d0, d1);
}
/* out[q] = table[codes[16 q .. 16 q + 15]] for q < 4 */
static inline void lut256_get64(const lut256 *t, const uint8_t *codes, vf out[4]) {
#ifdef __AVX512VBMI__
    /* position 16 L + 4 q + s of the permuted codes holds code 16 q + 4 L + s: the in-lane unpacks below then put
     * codes 16 q .. 16 q + 15 in order into out[q] */
    static const uint8_t order[64] = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
        52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
        44, 45, 46, 47, 60, 61, 62, 63};
    const vi c = _mm512_permutexvar_epi8(_mm512_loadu_si512(order), _mm512_loadu_si512(codes));
    const __mmask64 high = _mm512_movepi8_mask(c);
    vi p[4], lo01, hi01, lo23, hi23;
    int k;
    for (k = 0; k < 4; k++)
        p[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(t->plane[k][0], c, t->plane[k][1]),
                                      _mm512_permutex2var_epi8(t->plane[k][2], c, t->plane[k][3]));
    lo01 = _mm512_unpacklo_epi8(p[0], p[1]);
    hi01 = _mm512_unpackhi_epi8(p[0], p[1]);
    lo23 = _mm512_unpacklo_epi8(p[2], p[3]);
    hi23 = _mm512_unpackhi_epi8(p[2], p[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
#else
    int q;
    for (q = 0; q < 4; q++) out[q] = lut256_get(t, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * q))));
#endif
}

static inline vi load_codes(const uint8_t *c) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)c)); }
static inline void store_codes(uint8_t *c, vi code) { _mm_storeu_si128((__m128i *)c, _mm512_cvtepi32_epi8(code)); }
/* 64 codes (each 0..255) at once: two packs (in-lane) and one permute back to order */
static inline void store_codes4(uint8_t *c, vi c0, vi c1, vi c2, vi c3) {
    const vi order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    vi w = _mm512_packus_epi16(_mm512_packus_epi32(c0, c1), _mm512_packus_epi32(c2, c3));
    _mm512_storeu_si512(c, _mm512_permutexvar_epi32(order, w));
}

/* t[c & 31] per lane (a two-register permute; the tables stay in registers across a block) */
static inline vi lookup32(const uint32_t *t, vi c) {
    return _mm512_permutex2var_epi32(_mm512_loadu_si512(t), c, _mm512_loadu_si512(t + 16));
}
/* Nearest code of a pow2 map without a table lookup per element. The codes of binade [2^e, 2^(e+1)) are the floats
 * there with b_e mantissa bits, so the nearest one is the float rounded to b_e bits: add half an output step to the
 * bit pattern and shift (a carry out of the mantissa lands on the next binade's first code, as it should); the code
 * of the binade's first value, shifted up, is folded into the addend. Both distances to the neighbouring codes are
 * exact in fp32 (Sterbenz), so this is the fp32 nearest-code rule itself; the "- 1" in the addend makes ties go to the
 * lower magnitude, and + neg (1 for negative y) to the larger one, which is the lower code. |y| is first clamped to
 * [2^(e_lo - 127), 1]: the class e_lo then holds every value that takes the zero code (unsigned: the smallest code;
 * y <= 0 takes 0 after), the class above it decides between 0 and the smallest code, and 1.0 is the top code. The
 * clamped exponents span at most 32 classes, so e & 31 indexes the tables. The tests check every threshold, its
 * neighbours and every binade edge against the brute force rule (and an offline run checked every float in
 * [book[0], 1]). */
static inline vi pow2_code(const lmo_pow2 *T, vf y, const int is_signed) {
    const vi u = _mm512_castps_si512(y), lo = _mm512_set1_epi32(T->e_lo << 23), one = _mm512_set1_epi32(127 << 23);
    vi a, e, code;
    if (is_signed) {
        const vm neg = _mm512_movepi32_mask(u); /* sign bit: -0 encodes like +0 */
        const vi mag = _mm512_andnot_si512(_mm512_set1_epi32((int)0x80000000), u);
        const vm finite = _mm512_cmplt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000)); /* NaN and +-inf take code 0 */
        a = _mm512_min_epu32(_mm512_max_epu32(mag, lo), one);
        e = _mm512_srli_epi32(a, 23);
        a = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_srli_epi32(u, 31)), lookup32(T->add, e));
        code = _mm512_srlv_epi32(a, lookup32(T->shift, e));
        code = _mm512_max_epi32(_mm512_mask_sub_epi32(code, neg, _mm512_set1_epi32(T->mirror), code),
                                _mm512_setzero_si512());
        return _mm512_maskz_mov_epi32(finite, code);
    }
    a = _mm512_min_epu32(_mm512_max_epu32(u, lo), one); /* negative y (sign bit set) clamps to 1.0, masked below */
    e = _mm512_srli_epi32(a, 23);
    code = _mm512_srlv_epi32(_mm512_add_epi32(a, lookup32(T->add, e)), lookup32(T->shift, e));
    /* only 0 < y < inf keeps its code: y <= 0 (-0 too), NaN and +inf take 0, as the bucket table gives */
    return _mm512_maskz_mov_epi32(_mm512_cmplt_epu32_mask(_mm512_sub_epi32(u, _mm512_set1_epi32(1)),
                                                          _mm512_set1_epi32(0x7F7FFFFF)), code);
}

/* codes[0, len) <- nearest codes of buf[j] / div, four vectors per iteration */
#define LMO_ENC4(SIGNED)                                                                                              \
    for (j = 0; j + 64 <= len; j += 64) {                                                                             \
        vi c0 = pow2_code(T, v_div(v_load(buf + j), div), SIGNED);                                                    \
        vi c1 = pow2_code(T, v_div(v_load(buf + j + 16), div), SIGNED);                                               \
        vi c2 = pow2_code(T, v_div(v_load(buf + j + 32), div), SIGNED);                                               \
        vi c3 = pow2_code(T, v_div(v_load(buf + j + 48), div), SIGNED);                                               \
        store_codes4(codes + j, c0, c1, c2, c3);                                                                      \
    }                                                                                                                 \
    for (; j < len; j += 16) store_codes(codes + j, pow2_code(T, v_div(v_load(buf + j), div), SIGNED))
static inline void encode_block(const lmo_pow2 *T_, const int32_t *packed, int is_signed, const float *buf, int len,
                                vf div, uint8_t *codes) {
    const lmo_pow2 L = *T_, *T = &L; /* a local copy: the code stores cannot alias it, so the tables stay in registers */
    int j;
    (void)packed;
    if (is_signed) {
        LMO_ENC4(1);
    } else {
        LMO_ENC4(0);
    }
}
#undef LMO_ENC4

/* 4-bit codes. A q4 map's 16 values and its 15 decision thresholds live in registers (lowmemopt.quant.q4.thresholds:
 * code(y) = #{k: thr[k] <= y}, exact for every float): decoding is one permute, encoding a 4-step binary search over
 * the thresholds, each step a permute and a compare (t1, t3: thr shifted by 1 and 3 places, NaN beyond the end, so the
 * running code indexes them directly). +inf takes code 0 as in the reference's bucket table (it cannot occur: a block
 * holding +inf has scale inf, and inf / inf is NaN, which takes code 0 in both). */
typedef struct { vf book, t0, t1, t3, t7; } q4tab;
static inline vf q4_decode(const q4tab *t, vi code) { return _mm512_permutexvar_ps(code, t->book); }
static inline vi q4_code(const q4tab *t, const int32_t *packed, vf y) {
    vi c = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(y, t->t7, _CMP_GE_OQ), _mm512_set1_epi32(8));
    (void)packed;
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(c, t->t3), _CMP_GE_OQ), c, _mm512_set1_epi32(4));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(c, t->t1), _CMP_GE_OQ), c, _mm512_set1_epi32(2));
    c = _mm512_mask_add_epi32(c, _mm512_cmp_ps_mask(y, _mm512_permutexvar_ps(c, t->t0), _CMP_GE_OQ), c, _mm512_set1_epi32(1));
    return _mm512_mask_mov_epi32(c, _mm512_cmp_ps_mask(y, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ), _mm512_setzero_si512());
}
/* 16 codes from 8 bytes: element 2i is the low nibble of byte i, 2i + 1 the high one */
static inline vi q4_load_codes(const uint8_t *b) {
    const __m128i x = _mm_loadl_epi64((const __m128i *)b), m = _mm_set1_epi8(0x0F);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m)));
}
/* each 64-bit lane holds (c_2i, c_2i+1): c_2i | c_2i+1 << 4 in its low byte, which vpmovqb keeps */
static inline void q4_store_codes(uint8_t *b, vi c) {
    _mm_storel_epi64((__m128i *)b, _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28))));
}

/* 16 fp64 lanes: sums of fp32 values (row / column statistics, squared norms) */
typedef struct { __m512d lo, hi; } vd;
static inline __m512d lo_pd(vf x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
static inline __m512d hi_pd(vf x) { return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))); }
static inline vd vd_zero(void) { vd r; r.lo = r.hi = _mm512_setzero_pd(); return r; }
static inline vd vd_add(vd a, vf x) { a.lo = _mm512_add_pd(a.lo, lo_pd(x)); a.hi = _mm512_add_pd(a.hi, hi_pd(x)); return a; }
static inline vd vd_add_sq(vd a, vf x) {
    __m512d l = lo_pd(x), h = hi_pd(x);
    a.lo = _mm512_fmadd_pd(l, l, a.lo);
    a.hi = _mm512_fmadd_pd(h, h, a.hi);
    return a;
}
static inline double vd_sum(vd a) {
    double t[16], r = 0.0; int i;
    _mm512_storeu_pd(t, a.lo); _mm512_storeu_pd(t + 8, a.hi);
    for (i = 0; i < 16; i++) r += t[i];
    return r;
}

#elif LMO_ISA == 1 /* AVX2 + FMA + F16C: a 16-lane vector is two 8-lane ymm halves */
#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "LMO_ISA=1 (avx2) needs a compiler target with AVX2, FMA and F16C"
#endif
#define LMO_AVX512 0
#include <immintrin.h>

typedef struct { __m256 a, b; } vf;
typedef struct { __m256i a, b; } vi;

#define LMO_V2(expr_a, expr_b) do { vf r_; r_.a = (expr_a); r_.b = (expr_b); return r_; } while (0)
#define LMO_I2(expr_a, expr_b) do { vi r_; r_.a = (expr_a); r_.b = (expr_b); return r_; } while (0)
static inline vf v_set(float x) { LMO_V2(_mm256_set1_ps(x), _mm256_set1_ps(x)); }
static inline vf v_load(const float *x) { LMO_V2(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 8)); }
static inline void v_store(float *x, vf v) { _mm256_storeu_ps(x, v.a); _mm256_storeu_ps(x + 8, v.b); }
static inline vf v_add(vf x, vf y) { LMO_V2(_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)); }
static inline vf v_sub(vf x, vf y) { LMO_V2(_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)); }
static inline vf v_mul(vf x, vf y) { LMO_V2(_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)); }
static inline vf v_div(vf x, vf y) { LMO_V2(_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)); }
static inline vf v_fma(vf x, vf y, vf z) { LMO_V2(_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)); }
static inline vf v_sqrt(vf x) { LMO_V2(_mm256_sqrt_ps(x.a), _mm256_sqrt_ps(x.b)); }
static inline vf v_neg(vf x) {
    const __m256 s = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000));
    LMO_V2(_mm256_xor_ps(x.a, s), _mm256_xor_ps(x.b, s));
}
/* max / min as the portable s_max / s_min: a NaN operand gives x + y (a NaN) */
static inline __m256 h_max(__m256 x, __m256 y) {
    return _mm256_blendv_ps(_mm256_max_ps(x, y), _mm256_add_ps(x, y), _mm256_cmp_ps(x, y, _CMP_UNORD_Q));
}
static inline __m256 h_min(__m256 x, __m256 y) {
    return _mm256_blendv_ps(_mm256_min_ps(x, y), _mm256_add_ps(x, y), _mm256_cmp_ps(x, y, _CMP_UNORD_Q));
}
static inline vf v_max(vf x, vf y) { LMO_V2(h_max(x.a, y.a), h_max(x.b, y.b)); }
static inline vf v_min(vf x, vf y) { LMO_V2(h_min(x.a, y.a), h_min(x.b, y.b)); }
/* a block's running max / min (slot_store): x > y ? x : y as s_max without NaN (slot_block_end redoes a block that
 * holds one) */
static inline vf v_acc_max(vf x, vf y) { LMO_V2(_mm256_max_ps(x.a, y.a), _mm256_max_ps(x.b, y.b)); }
static inline vf v_acc_min(vf x, vf y) { LMO_V2(_mm256_min_ps(x.a, y.a), _mm256_min_ps(x.b, y.b)); }
static inline int v_anynan(vf x) {
    return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q))) != 0;
}
/* horizontal max / min of vectors that hold no NaN (slot_block_end checks separately) */
static inline float h_reduce(__m256 x, int want_max) {
    __m128 l = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    if (!want_max) l = _mm_min_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    l = want_max ? _mm_max_ps(l, _mm_movehl_ps(l, l)) : _mm_min_ps(l, _mm_movehl_ps(l, l));
    l = want_max ? _mm_max_ss(l, _mm_shuffle_ps(l, l, 1)) : _mm_min_ss(l, _mm_shuffle_ps(l, l, 1));
    return _mm_cvtss_f32(l);
}
static inline float v_hmax(vf x) { return h_reduce(_mm256_max_ps(x.a, x.b), 1); }
static inline float v_hmin(vf x) { return h_reduce(_mm256_min_ps(x.a, x.b), 0); }
/* torch.sign: (0 < x) - (x < 0), so +-0 -> +0 */
static inline __m256 h_sign(__m256 x) {
    const __m256 z = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
    return _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(z, x, _CMP_LT_OQ), one), _mm256_and_ps(_mm256_cmp_ps(x, z, _CMP_LT_OQ), one));
}
static inline vf v_sign(vf x) { LMO_V2(h_sign(x.a), h_sign(x.b)); }

static inline __m256 h_load_bf16(const uint16_t *x) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}
static inline vf load_bf16(const uint16_t *x) { LMO_V2(h_load_bf16(x), h_load_bf16(x + 8)); }
static inline __m256i h_bf16_bits(__m256 x) { /* round to nearest even; NaN -> 0x7FC0 (c10::BFloat16) */
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)),
                                                _mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
}
/* 16 values <= 0xFFFF in two int32 halves -> 16 uint16 in order */
static inline __m256i pack16(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}
static inline void store_bf16(uint16_t *x, vf v) {
    _mm256_storeu_si256((__m256i *)x, pack16(h_bf16_bits(v.a), h_bf16_bits(v.b)));
}
static inline vf load_f16(const uint16_t *x) {
    LMO_V2(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)x)), _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + 8))));
}
static inline void store_f16(uint16_t *x, vf v) {
    _mm_storeu_si128((__m128i *)x, _mm256_cvtps_ph(v.a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128((__m128i *)(x + 8), _mm256_cvtps_ph(v.b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

/* The 256-entry decode table: an L1-resident gather per 8 codes (32 ymm registers would be needed to hold it). */
typedef struct { const float *t; } lut256;
static inline void lut256_init(lut256 *t, const float *x, const uint8_t *planes) { (void)planes; t->t = x; }
static inline vf lut256_get(const lut256 *t, vi idx) {
    LMO_V2(_mm256_i32gather_ps(t->t, idx.a, 4), _mm256_i32gather_ps(t->t, idx.b, 4));
}
static inline vi load_codes(const uint8_t *c) {
    LMO_I2(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)c)), _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(c + 8))));
}
static inline void lut256_get64(const lut256 *t, const uint8_t *codes, vf out[4]) {
    int q;
    for (q = 0; q < 4; q++) out[q] = lut256_get(t, load_codes(codes + 16 * q));
}
/* 16 codes (each 0..255) -> 16 bytes in order */
static inline __m128i pack_codes(vi c) {
    const __m256i w = pack16(c.a, c.b);
    return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
static inline void store_codes(uint8_t *c, vi code) { _mm_storeu_si128((__m128i *)c, pack_codes(code)); }

/* t[c & 31] per lane: four 8-entry permutes, selected by bits 3 and 4 of the index */
static inline __m256i h_lookup32(const uint32_t *t, __m256i c) {
    const __m256i a0 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)t), c);
    const __m256i a1 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(t + 8)), c);
    const __m256i a2 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(t + 16)), c);
    const __m256i a3 = _mm256_permutevar8x32_epi32(_mm256_loadu_si256((const __m256i *)(t + 24)), c);
    const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)), b4 = _mm256_castsi256_ps(_mm256_slli_epi32(c, 27));
    const __m256 lo = _mm256_blendv_ps(_mm256_castsi256_ps(a0), _mm256_castsi256_ps(a1), b3);
    const __m256 hi = _mm256_blendv_ps(_mm256_castsi256_ps(a2), _mm256_castsi256_ps(a3), b3);
    return _mm256_castps_si256(_mm256_blendv_ps(lo, hi, b4));
}
/* unsigned a < b per lane (all ones / zero) */
static inline __m256i h_ltu(__m256i a, __m256i b) {
    const __m256i s = _mm256_set1_epi32((int)0x80000000);
    return _mm256_cmpgt_epi32(_mm256_xor_si256(b, s), _mm256_xor_si256(a, s));
}
/* pow2_code (the AVX-512 version below documents the rule), on 8 lanes */
static inline __m256i h_pow2_code(const lmo_pow2 *T, __m256 y, const int is_signed) {
    const __m256i u = _mm256_castps_si256(y), lo = _mm256_set1_epi32(T->e_lo << 23), one = _mm256_set1_epi32(127 << 23);
    __m256i a, e, code;
    if (is_signed) {
        const __m256i neg = _mm256_srai_epi32(u, 31);
        const __m256i mag = _mm256_andnot_si256(_mm256_set1_epi32((int)0x80000000), u);
        const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), mag); /* NaN and +-inf: code 0 */
        a = _mm256_min_epu32(_mm256_max_epu32(mag, lo), one);
        e = _mm256_srli_epi32(a, 23);
        a = _mm256_add_epi32(_mm256_add_epi32(a, _mm256_srli_epi32(u, 31)), h_lookup32(T->add, e));
        code = _mm256_srlv_epi32(a, h_lookup32(T->shift, e));
        code = _mm256_blendv_epi8(code, _mm256_sub_epi32(_mm256_set1_epi32(T->mirror), code), neg);
        code = _mm256_max_epi32(code, _mm256_setzero_si256());
        return _mm256_and_si256(finite, code);
    }
    a = _mm256_min_epu32(_mm256_max_epu32(u, lo), one);
    e = _mm256_srli_epi32(a, 23);
    code = _mm256_srlv_epi32(_mm256_add_epi32(a, h_lookup32(T->add, e)), h_lookup32(T->shift, e));
    return _mm256_and_si256(h_ltu(_mm256_sub_epi32(u, _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7F7FFFFF)), code);
}
static inline vi pow2_code(const lmo_pow2 *T, vf y, const int is_signed) {
    LMO_I2(h_pow2_code(T, y.a, is_signed), h_pow2_code(T, y.b, is_signed));
}
static inline void encode_block(const lmo_pow2 *T_, const int32_t *packed, int is_signed, const float *buf, int len,
                                vf div, uint8_t *codes) {
    const lmo_pow2 L = *T_, *T = &L; /* a local copy: the code stores cannot alias it, so the tables stay in registers */
    int j;
    (void)packed;
    if (is_signed) {
        for (j = 0; j < len; j += 16) store_codes(codes + j, pow2_code(T, v_div(v_load(buf + j), div), 1));
    } else {
        for (j = 0; j < len; j += 16) store_codes(codes + j, pow2_code(T, v_div(v_load(buf + j), div), 0));
    }
}

/* 4-bit codes: the 16 values and thresholds as two 8-entry halves each; decoding is a 16-entry permute, encoding the
 * same 4-step binary search over the thresholds as the AVX-512 build */
typedef struct { vf book, t0, t1, t3, t7; } q4tab;
static inline __m256 perm16(vf t, __m256i c) {
    return _mm256_blendv_ps(_mm256_permutevar8x32_ps(t.a, c), _mm256_permutevar8x32_ps(t.b, c),
                            _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
}
static inline vf q4_decode(const q4tab *t, vi code) { LMO_V2(perm16(t->book, code.a), perm16(t->book, code.b)); }
static inline __m256i h_q4_step(const q4tab *t, vf tk, __m256 y, __m256i c, int add) {
    const __m256 ge = _mm256_cmp_ps(y, perm16(tk, c), _CMP_GE_OQ);
    (void)t;
    return _mm256_add_epi32(c, _mm256_and_si256(_mm256_castps_si256(ge), _mm256_set1_epi32(add)));
}
static inline __m256i h_q4_code(const q4tab *t, __m256 y) {
    __m256i c = _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(y, t->t7.a, _CMP_GE_OQ)), _mm256_set1_epi32(8));
    c = h_q4_step(t, t->t3, y, c, 4);
    c = h_q4_step(t, t->t1, y, c, 2);
    c = h_q4_step(t, t->t0, y, c, 1);
    return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(y, _mm256_set1_ps(INFINITY), _CMP_EQ_OQ)), c);
}
static inline vi q4_code(const q4tab *t, const int32_t *packed, vf y) {
    (void)packed;
    LMO_I2(h_q4_code(t, y.a), h_q4_code(t, y.b));
}
/* 16 codes from 8 bytes: element 2i is the low nibble of byte i, 2i + 1 the high one */
static inline vi q4_load_codes(const uint8_t *b) {
    const __m128i x = _mm_loadl_epi64((const __m128i *)b), m = _mm_set1_epi8(0x0F);
    const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(x, m), _mm_and_si128(_mm_srli_epi16(x, 4), m));
    LMO_I2(_mm256_cvtepu8_epi32(c), _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8)));
}
/* each 64-bit lane holds (c_2i, c_2i+1): c_2i | c_2i+1 << 4 in its low byte; gather those 8 bytes in order */
static inline void q4_store_codes(uint8_t *b, vi c) {
    const __m256i ta = _mm256_or_si256(c.a, _mm256_srli_epi64(c.a, 28)), tb = _mm256_or_si256(c.b, _mm256_srli_epi64(c.b, 28));
    const __m256i sa = _mm256_shuffle_epi8(ta, _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i sb = _mm256_shuffle_epi8(tb, _mm256_setr_epi8(-1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                                                -1, -1, -1, -1, -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1));
    const __m256i s = _mm256_or_si256(sa, sb);
    _mm_storel_epi64((__m128i *)b, _mm_or_si128(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
}

/* 16 fp64 lanes: sums of fp32 values (row / column statistics, squared norms), lane k accumulates element k */
typedef struct { __m256d x[4]; } vd;
static inline vd vd_zero(void) { vd r; r.x[0] = r.x[1] = r.x[2] = r.x[3] = _mm256_setzero_pd(); return r; }
static inline vd vd_add(vd s, vf x) {
    s.x[0] = _mm256_add_pd(s.x[0], _mm256_cvtps_pd(_mm256_castps256_ps128(x.a)));
    s.x[1] = _mm256_add_pd(s.x[1], _mm256_cvtps_pd(_mm256_extractf128_ps(x.a, 1)));
    s.x[2] = _mm256_add_pd(s.x[2], _mm256_cvtps_pd(_mm256_castps256_ps128(x.b)));
    s.x[3] = _mm256_add_pd(s.x[3], _mm256_cvtps_pd(_mm256_extractf128_ps(x.b, 1)));
    return s;
}
static inline vd vd_add_sq(vd s, vf x) {
    const __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x.a)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x.a, 1));
    const __m256d d2 = _mm256_cvtps_pd(_mm256_castps256_ps128(x.b)), d3 = _mm256_cvtps_pd(_mm256_extractf128_ps(x.b, 1));
    s.x[0] = _mm256_fmadd_pd(d0, d0, s.x[0]);
    s.x[1] = _mm256_fmadd_pd(d1, d1, s.x[1]);
    s.x[2] = _mm256_fmadd_pd(d2, d2, s.x[2]);
    s.x[3] = _mm256_fmadd_pd(d3, d3, s.x[3]);
    return s;
}
static inline double vd_sum(vd s) {
    double t[16], r = 0.0; int i;
    for (i = 0; i < 4; i++) _mm256_storeu_pd(t + 4 * i, s.x[i]);
    for (i = 0; i < 16; i++) r += t[i];
    return r;
}
#undef LMO_V2
#undef LMO_I2

#else /* LMO_ISA == 0, the scalar reference: plain C on a 16-float struct (encoding with the exact bucket table) */
#define LMO_AVX512 0

typedef struct { float x[16]; } vf;
typedef struct { int32_t x[16]; } vi;
#define LMO_MAP1(expr) vf r; int i; for (i = 0; i < 16; i++) r.x[i] = (expr); return r
static inline vf v_set(float s) { LMO_MAP1(s); }
static inline vf v_load(const float *p) { LMO_MAP1(p[i]); }
static inline void v_store(float *p, vf a) { int i; for (i = 0; i < 16; i++) p[i] = a.x[i]; }
static inline vf v_add(vf a, vf b) { LMO_MAP1(a.x[i] + b.x[i]); }
static inline vf v_sub(vf a, vf b) { LMO_MAP1(a.x[i] - b.x[i]); }
static inline vf v_mul(vf a, vf b) { LMO_MAP1(a.x[i] * b.x[i]); }
static inline vf v_div(vf a, vf b) { LMO_MAP1(a.x[i] / b.x[i]); }
static inline vf v_fma(vf a, vf b, vf c) { LMO_MAP1(fmaf(a.x[i], b.x[i], c.x[i])); }
static inline vf v_sqrt(vf a) { LMO_MAP1(sqrtf(a.x[i])); }
static inline vf v_neg(vf a) { LMO_MAP1(-a.x[i]); }
static inline float s_max(float a, float b) { return (a != a || b != b) ? a + b : (a > b ? a : b); }
static inline float s_min(float a, float b) { return (a != a || b != b) ? a + b : (a < b ? a : b); }
static inline vf v_max(vf a, vf b) { LMO_MAP1(s_max(a.x[i], b.x[i])); }
static inline vf v_min(vf a, vf b) { LMO_MAP1(s_min(a.x[i], b.x[i])); }
static inline vf v_acc_max(vf a, vf b) { return v_max(a, b); }
static inline vf v_acc_min(vf a, vf b) { return v_min(a, b); }
static inline vf v_sign(vf a) { LMO_MAP1((float)(0.0f < a.x[i]) - (float)(a.x[i] < 0.0f)); }
static inline int v_anynan(vf a) { int i, r = 0; for (i = 0; i < 16; i++) r |= a.x[i] != a.x[i]; return r; }
static inline float v_hmax(vf a) { float r = a.x[0]; int i; for (i = 1; i < 16; i++) r = s_max(r, a.x[i]); return r; }
static inline float v_hmin(vf a) { float r = a.x[0]; int i; for (i = 1; i < 16; i++) r = s_min(r, a.x[i]); return r; }

static inline float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t bits_of_f32(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline vf load_bf16(const uint16_t *x) { LMO_MAP1(f32_of_bits((uint32_t)x[i] << 16)); }
static inline void store_bf16(uint16_t *x, vf a) {
    int i;
    for (i = 0; i < 16; i++) {
        uint32_t u = bits_of_f32(a.x[i]);
        x[i] = (a.x[i] != a.x[i]) ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
    }
}
/* IEEE half <-> float, round to nearest even (as c10::Half) */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return f32_of_bits(sign | 0x7F800000 | (man << 13));
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* man * 2^-24, exact */
        return sign ? -f : f;
    }
    return f32_of_bits(sign | ((exp + 112) << 23) | (man << 13));
}
static inline uint16_t float_to_half(float f) {
    uint32_t u = bits_of_f32(f), sign = (u >> 16) & 0x8000, au = u & 0x7FFFFFFF;
    if (au > 0x7F800000) return (uint16_t)(sign | 0x7E00);           /* NaN */
    if (au >= 0x477FF000) return (uint16_t)(sign | 0x7C00);           /* rounds to >= 65520: Inf */
    if (au < 0x38800000) {                                            /* below 2^-14: subnormal half */
        float a = f32_of_bits(au) + 0.5f;                             /* the FPU rounds to a multiple of 2^-24 */
        return (uint16_t)(sign | (bits_of_f32(a) - bits_of_f32(0.5f)));
    }
    {
        uint32_t r = au + 0xFFF + ((au >> 13) & 1) - (112u << 23);
        return (uint16_t)(sign | (r >> 13));
    }
}
static inline vf load_f16(const uint16_t *x) { LMO_MAP1(half_to_float(x[i])); }
static inline void store_f16(uint16_t *x, vf a) { int i; for (i = 0; i < 16; i++) x[i] = float_to_half(a.x[i]); }

typedef struct { float t[256]; } lut256;
static inline void lut256_init(lut256 *t, const float *x, const uint8_t *planes) { (void)planes; memcpy(t->t, x, sizeof t->t); }
static inline vf lut256_get(const lut256 *t, vi idx) { LMO_MAP1(t->t[idx.x[i] & 255]); }
static inline void lut256_get64(const lut256 *t, const uint8_t *codes, vf out[4]) {
    int q, i;
    for (q = 0; q < 4; q++)
        for (i = 0; i < 16; i++) out[q].x[i] = t->t[codes[16 * q + i]];
}

static inline vi packed_code(const int32_t *packed, vf y) {
    vi r; int i;
    for (i = 0; i < 16; i++) {
        uint32_t u = bits_of_f32(y.x[i]), t = (u & 0xFFFF) ^ ((u >> 31) ? 0xFFFF : 0);
        int32_t e = packed[u >> 16];
        r.x[i] = (e >> 17) + ((int32_t)t >= (e & 0x1FFFF));
    }
    return r;
}
static inline vi load_codes(const uint8_t *c) { vi r; int i; for (i = 0; i < 16; i++) r.x[i] = c[i]; return r; }

/* 4-bit codes (see the AVX-512 versions): decoding indexes the 16 values, encoding is the exact bucket table */
typedef struct { vf book, t0, t1, t3, t7; } q4tab;
static inline vf q4_decode(const q4tab *t, vi code) { LMO_MAP1(t->book.x[code.x[i] & 15]); }
static inline vi q4_code(const q4tab *t, const int32_t *packed, vf y) { (void)t; return packed_code(packed, y); }
static inline vi q4_load_codes(const uint8_t *b) {
    vi r; int i;
    for (i = 0; i < 8; i++) { r.x[2 * i] = b[i] & 15; r.x[2 * i + 1] = b[i] >> 4; }
    return r;
}
static inline void q4_store_codes(uint8_t *b, vi c) {
    int i;
    for (i = 0; i < 8; i++) b[i] = (uint8_t)(c.x[2 * i] | c.x[2 * i + 1] << 4);
}
static inline void store_codes(uint8_t *c, vi code) { int i; for (i = 0; i < 16; i++) c[i] = (uint8_t)code.x[i]; }
static inline void encode_block(const struct lmo_pow2 *T, const int32_t *packed, int is_signed, const float *buf,
                                int len, vf div, uint8_t *codes) {
    int j;
    (void)T; (void)is_signed;
    for (j = 0; j < len; j += 16) store_codes(codes + j, packed_code(packed, v_div(v_load(buf + j), div)));
}

typedef struct { double x[16]; } vd;
static inline vd vd_zero(void) { vd r; memset(&r, 0, sizeof r); return r; }
static inline vd vd_add(vd a, vf x) { int i; for (i = 0; i < 16; i++) a.x[i] += (double)x.x[i]; return a; }
static inline vd vd_add_sq(vd a, vf x) { int i; for (i = 0; i < 16; i++) a.x[i] = fma((double)x.x[i], (double)x.x[i], a.x[i]); return a; }
static inline double vd_sum(vd a) { double r = 0.0; int i; for (i = 0; i < 16; i++) r += a.x[i]; return r; }
#undef LMO_MAP1
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

/* Run rows(args, rt, r0, r1) over [0, nrows) split into one contiguous range per thread. */
typedef void (*rows_fn)(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1);

static size_t dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

/* The tail (fewer than bs <= 64 elements, dense state only): copied into zero-padded row buffers, stepped as one row,
 * copied back. Elementwise math, so the padding does not touch the real elements. */
static void run_tail(const lmo_args *a, rows_fn fn) {
    unsigned char pb[64 * 4] __attribute__((aligned(64))), gb[64 * 4] __attribute__((aligned(64)));
    unsigned char sb[LMO_MAX_SLOTS][64 * 4] __attribute__((aligned(64)));
    uint16_t kb[64] __attribute__((aligned(64)));
    const int64_t at = a->nrows * a->bs;
    const size_t pe = dt_size(a->p_dtype), ge = dt_size(a->g_dtype);
    lmo_args t = *a;
    slot_rt rt[LMO_MAX_SLOTS];
    int k;
    memset(pb, 0, sizeof pb);
    memset(gb, 0, sizeof gb);
    memset(sb, 0, sizeof sb);
    memcpy(pb, (const char *)a->p + at * pe, a->tail * pe);
    memcpy(gb, (const char *)a->g + at * ge, a->tail * ge);
    t.p = pb;
    t.g = gb;
    t.nrows = 1;
    t.tail = 0;
    t.p_offset = a->p_offset + at;
    if (a->kahan) {
        memset(kb, 0, sizeof kb);
        memcpy(kb, a->kahan + at, a->tail * 2);
        t.kahan = kb;
    }
    for (k = 0; k < a->nslots; k++) {
        const size_t se = a->slot[k].kind == ST_F32 ? 4 : 2;
        memcpy(sb[k], (const char *)a->slot[k].data + at * se, a->tail * se);
        t.slot[k].data = sb[k];
        slot_rt_init(&rt[k], &t.slot[k], NULL);
    }
    fn(&t, rt, 0, 1);
    memcpy((char *)a->p + at * pe, pb, a->tail * pe);
    if (a->kahan) memcpy(a->kahan + at, kb, a->tail * 2);
    for (k = 0; k < a->nslots; k++) {
        const size_t se = a->slot[k].kind == ST_F32 ? 4 : 2;
        memcpy((char *)a->slot[k].data + at * se, sb[k], a->tail * se);
    }
}

/* Sum of squares of x[lo, hi) in fp32, 16 lanes of fused multiply-adds: Inf / NaN iff an element is Inf / NaN or
 * the sum overflows fp32 (as torch's fp32 norm does, up to summation order). */
static float sumsq_range1(int dt, const void *x, int64_t lo, int64_t hi) {
    vf acc0 = v_set(0.0f), acc1 = v_set(0.0f);
    float r = 0.0f, lanes[16];
    int64_t i = lo;
    int k;
    for (; i + 32 <= hi; i += 32) {
        vf a = load_dt(dt, x, i), b = load_dt(dt, x, i + 16);
        acc0 = v_fma(a, a, acc0);
        acc1 = v_fma(b, b, acc1);
    }
    v_store(lanes, v_add(acc0, acc1));
    for (k = 0; k < 16; k++) r += lanes[k];
    if (i < hi) { /* the last < 32 elements, zero-padded */
        unsigned char tmp[32 * 4] __attribute__((aligned(64)));
        const size_t es = dt == DT_F32 ? 4 : 2;
        vf a, b;
        memset(tmp, 0, sizeof tmp);
        memcpy(tmp, (const char *)x + i * es, (size_t)(hi - i) * es);
        a = load_dt(dt, tmp, 0);
        b = load_dt(dt, tmp, 16);
        v_store(lanes, v_fma(b, b, v_mul(a, a)));
        for (k = 0; k < 16; k++) r += lanes[k];
    }
    return r;
}

/* The fp32 sum of squares of x[lo, hi): NaN or Inf when x holds a NaN / Inf or the sum overflows. Four quarters of
 * the range are read side by side, then the rest (sumsq_range1): four streams of reads keep more memory requests in
 * flight than one. The order of the additions depends on lo and hi alone. */
static float sumsq_range(int dt, const void *x, int64_t lo, int64_t hi) {
    const int64_t q = ((hi - lo) / 4) & ~(int64_t)15;
    vf a0 = v_set(0.0f), a1 = a0, a2 = a0, a3 = a0;
    float lanes[16], r = 0.0f;
    int64_t i;
    int k;
    if (q < 64) return sumsq_range1(dt, x, lo, hi);
    for (i = lo; i < lo + q; i += 16) {
        const vf b0 = load_dt(dt, x, i), b1 = load_dt(dt, x, i + q), b2 = load_dt(dt, x, i + 2 * q);
        const vf b3 = load_dt(dt, x, i + 3 * q);
        a0 = v_fma(b0, b0, a0);
        a1 = v_fma(b1, b1, a1);
        a2 = v_fma(b2, b2, a2);
        a3 = v_fma(b3, b3, a3);
    }
    v_store(lanes, v_add(v_add(a0, a1), v_add(a2, a3)));
    for (k = 0; k < 16; k++) r += lanes[k];
    return lo + 4 * q < hi ? r + sumsq_range1(dt, x, lo + 4 * q, hi) : r;
}

#define LMO_ROW_CHUNK 16384  /* elements per dynamically scheduled task */
#define LMO_SCAN_PIECE 65536 /* gradient elements per piece of a non-finite check (a scan) */
#define LMO_MAX_CHUNK 1048576 /* the largest row chunk (chunk_end), in elements */

/* The end of the row chunk from row r when `left` row elements remain from it on (this chunk's included; in a bucket,
 * the bucket's): an eighth of what is left per thread pair, between LMO_ROW_CHUNK and LMO_MAX_CHUNK elements. Large chunks keep each thread's
 * reads contiguous over megabytes (the memory-bound fp32 update ran 1.2x faster in 1M-element chunks than in 16K ones,
 * whose alternation between the threads restarted every stream each 64 KB); chunks that shrink towards the end leave
 * no thread idle long while another finishes. */
static inline int64_t chunk_end(const lmo_args *a, int64_t r, int64_t left, int nt) {
    int64_t e = left / (4 * (int64_t)nt), end;
    if (e < LMO_ROW_CHUNK) e = LMO_ROW_CHUNK;
    if (e > LMO_MAX_CHUNK) e = LMO_MAX_CHUNK;
    end = r + (e + a->bs - 1) / a->bs;
    return end < a->nrows ? end : a->nrows;
}
/* How many row chunks (chunk_end) a's rows take when `left` row elements remain from its first row on. */
static int64_t n_chunks(const lmo_args *a, int64_t left, int nt) {
    int64_t r = 0, end, n = 0;
    for (; r < a->nrows; r = end, n++) {
        end = chunk_end(a, r, left, nt);
        left -= (end - r) * a->bs;
    }
    return n;
}

/* Run fn over rows [0, nrows) in chunks (chunk_end: 16K-1M elements, shrinking towards the end) handed out dynamically
 * (a thread that the OS preempts holds up the others for one chunk at most), then the tail; with a->scan, also the
 * scan's sum of squares in pieces of LMO_SCAN_PIECE elements, spread evenly over the chunks' tasks. */
static int args_ok(const lmo_args *a) {
    int k;
    if (a->bs < 16 || a->bs % 16 || a->bs > LMO_MAX_BS || a->nslots < 0 || a->nslots > LMO_MAX_SLOTS) return 0;
    if (a->nrows < 0 || a->tail < 0 || a->tail >= a->bs || (a->tail && a->bs > 64)) return 0;
    if (a->p_update < UPD_NEAREST || a->p_update > UPD_KAHAN || (a->p_update == UPD_KAHAN && !a->kahan)) return 0;
    if (a->scan && (a->scan_n < 0 || !a->scan_sumsq || a->scan_dtype < DT_F32 || a->scan_dtype > DT_F16)) return 0;
    for (k = 0; k < a->nslots; k++)
        if (a->tail && (a->slot[k].kind == ST_Q8 || a->slot[k].kind == ST_Q4)) return 0;
    return 1;
}

static int run_rows(const lmo_args *a, rows_fn fn) {
    int nt = a->nthreads < 1 ? 1 : a->nthreads;
    const int64_t scan_n = a->scan ? a->scan_n : 0, npieces = (scan_n + LMO_SCAN_PIECE - 1) / LMO_SCAN_PIECE;
    const int64_t work = a->nrows * a->bs + scan_n;
    int64_t nchunks, ntasks, r, left = a->nrows * a->bs, k, *ends = NULL;
    float sumsq = 0.0f;
    if (!args_ok(a)) return LMO_EBADARG;
    if ((int64_t)nt * 65536 > work) nt = work / 65536 > 0 ? (int)(work / 65536) : 1; /* below ~64K elements per thread, threads do not pay */
    nchunks = n_chunks(a, left, nt);
    if (nchunks > 0) {
        ends = malloc(sizeof *ends * nchunks);
        if (!ends) return LMO_EBADARG;
        for (r = 0, k = 0; k < nchunks; r = ends[k++]) {
            ends[k] = chunk_end(a, r, left, nt);
            left -= (ends[k] - r) * a->bs;
        }
    }
    ntasks = nchunks > 0 ? nchunks : npieces;
    if (ntasks > 0) {
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
        {
            float bufs[LMO_MAX_SLOTS * a->bs] __attribute__((aligned(64))); /* <= 64 KiB of stack */
            slot_rt rt[LMO_MAX_SLOTS];
            float part = 0.0f;
            int j;
            int64_t c, k;
            for (j = 0; j < a->nslots; j++) slot_rt_init(&rt[j], &a->slot[j], bufs + j * a->bs);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (c = 0; c < ntasks; c++) {
                if (c < nchunks) fn(a, rt, c > 0 ? ends[c - 1] : 0, ends[c]);
                for (k = npieces * c / ntasks; k < npieces * (c + 1) / ntasks; k++) { /* the scan's pieces, spread */
                    const int64_t lo = k * LMO_SCAN_PIECE;
                    part += sumsq_range(a->scan_dtype, a->scan, lo, lo + LMO_SCAN_PIECE < scan_n ? lo + LMO_SCAN_PIECE : scan_n);
                }
            }
            if (a->scan) {
#ifdef _OPENMP
#pragma omp critical(lmo_scan)
#endif
                sumsq += part;
            }
        }
    }
    free(ends);
    if (a->scan) *a->scan_sumsq = sumsq;
    if (a->tail) run_tail(a, fn);
    return LMO_OK;
}

static void no_rows(const lmo_args *a, const slot_rt *rt, int64_t r0, int64_t r1) { (void)a; (void)rt; (void)r0; (void)r1; }

/* Only the scan (nrows 0, no slots): the sum of squares of a->scan, for a gradient no kernel steps with it. */
int lmo_scan(const lmo_args *a) {
    if (!a->scan || a->nrows != 0 || a->nslots != 0 || a->tail != 0) return LMO_EBADARG;
    return run_rows(a, no_rows);
}

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

/* ------------------------------------------------------------------------------------------------------------------ */
/* Many parameters of one algorithm in one parallel region (the step's CPU bucket): one fork/join per step instead of */
/* one per parameter, and each gradient's non-finite check read while the previous parameter is updated.             */
/*                                                                                                                    */
/* The work is one list of tasks, handed out in order from a shared counter: the scan pieces of tensor 0 (pieces of  */
/* LMO_SCAN_PIECE elements of a[t].scan: its own gradient, when the caller asks for the check), then for each tensor  */
/* t its row chunks (chunk_end: up to 1M elements, shrinking towards the bucket's end) with the scan pieces of       */
/* tensor t + 1 spread evenly among them, then its tail. A row chunk or tail */
/* of t waits until every scan piece of t is summed (the thread that finishes the last piece adds the pieces up in    */
/* their order, so the sum does not depend on the threads), and does nothing if the sum is not finite. Every piece   */
/* of t is handed out before any chunk of t, and a piece waits for nothing: no deadlock. A row chunk seldom waits:   */
/* the pieces of t were handed out among the rows of t - 1.                                                          */
/*                                                                                                                    */
/* Why not each gradient's check just before its own update, so that the update reads the gradient from the cache?   */
/* Measured on the 148M LLaMA (bench/README.md), that order was the slower one: a thread that scans waits for memory */
/* with nothing to compute, while a scan beside the previous tensor's rows hides behind the compute of the 8- and    */
/* 4-bit kernels; and the update of all but the smallest tensors found little of the gradient left in the cache.     */

typedef rows_fn (*pick_fn)(const lmo_args *a);
typedef struct { int32_t t, kind; int64_t c, end; } lmo_task; /* kind: TASK_*; c: the piece, or rows [c, end) */
enum { TASK_SCAN = 0, TASK_ROWS = 1, TASK_TAIL = 2 };
enum { VERDICT_PENDING = 0, VERDICT_FINITE = 1, VERDICT_SKIP = 2 };

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static uint8_t wait_verdict(const uint8_t *v) {
    uint8_t r;
    int spins = 0;
    while ((r = __atomic_load_n(v, __ATOMIC_ACQUIRE)) == VERDICT_PENDING) {
        if (++spins < 2048) cpu_relax();
        else sched_yield(); /* the other thread was preempted: give its core back */
    }
    return r;
}

static inline int64_t rows_per_task(int bs) { return (LMO_ROW_CHUNK + bs - 1) / bs; }
static inline int64_t n_pieces(const lmo_args *a) { return a->scan ? (a->scan_n + LMO_SCAN_PIECE - 1) / LMO_SCAN_PIECE : 0; }
static inline void put_task(lmo_task *tasks, int64_t *at, int64_t t, int kind, int64_t c, int64_t end) {
    tasks[*at].t = (int32_t)t;
    tasks[*at].kind = kind;
    tasks[*at].c = c;
    tasks[*at].end = end;
    ++*at;
}

/* ok[t] (out): 1 if tensor t was stepped, 0 if its scan found a non-finite sum of squares (nothing of it written).
 * Each a[t] is what run_rows takes, with scan either NULL (no check) or its own gradient (scan_sumsq: where the sum
 * goes); a[0].nthreads threads at most. */
static int run_many(const lmo_args *a, int64_t n, uint8_t *ok, pick_fn pick) {
    int64_t t, ntasks = 0, work = 0, at = 0, maxbs = 16;
    int nt = n > 0 && a[0].nthreads > 1 ? a[0].nthreads : 1;
    lmo_task *tasks;
    int64_t *piece_base, *pending, next = 0, c, left = 0;
    float *parts;
    uint8_t *verdict;
    rows_fn *fns;
    for (t = 0; t < n; t++) {
        const int64_t chunks = (a[t].nrows + rows_per_task(a[t].bs) - 1) / rows_per_task(a[t].bs); /* at most */
        if (!args_ok(&a[t]) || !pick(&a[t])) return LMO_EBADARG;
        ntasks += chunks + (a[t].tail ? 1 : 0) + n_pieces(&a[t]);
        work += a[t].nrows * a[t].bs + a[t].tail + (a[t].scan ? a[t].scan_n : 0);
        if (a[t].bs > maxbs) maxbs = a[t].bs;
    }
    if (n == 0) return LMO_OK;
    tasks = malloc(sizeof *tasks * (ntasks ? ntasks : 1));
    piece_base = malloc(sizeof *piece_base * n);
    pending = malloc(sizeof *pending * n);
    verdict = malloc(n);
    fns = malloc(sizeof *fns * n);
    parts = malloc(sizeof *parts * (ntasks ? ntasks : 1));
    if (!tasks || !piece_base || !pending || !verdict || !fns || !parts) {
        free(tasks); free(piece_base); free(pending); free(verdict); free(fns); free(parts);
        return LMO_EBADARG;
    }
    for (t = 0; t < n; t++) {
        const int64_t pieces = n_pieces(&a[t]);
        fns[t] = pick(&a[t]);
        piece_base[t] = at; /* the pieces' partial sums: parts[at, at + pieces) */
        at += pieces;
        pending[t] = pieces;
        verdict[t] = VERDICT_FINITE;
        if (a[t].scan) {
            verdict[t] = VERDICT_PENDING;
            if (pieces == 0) { /* an empty gradient: a sum of 0 */
                *a[t].scan_sumsq = 0.0f;
                verdict[t] = VERDICT_FINITE;
            }
        }
    }
    if ((int64_t)nt * 65536 > work) nt = work / 65536 > 0 ? (int)(work / 65536) : 1;
    for (t = 0; t < n; t++) left += a[t].nrows * a[t].bs;
    at = 0;
    for (c = 0; c < n_pieces(&a[0]); c++) put_task(tasks, &at, 0, TASK_SCAN, c, 0);
    for (t = 0; t < n; t++) { /* t's row chunks, with the next tensor's scan pieces spread evenly among them */
        const int64_t later = t + 1 < n ? n_pieces(&a[t + 1]) : 0;
        const int64_t chunks = n_chunks(&a[t], left, nt);
        int64_t done = 0, r, end;
        for (r = 0, c = 0; r < a[t].nrows; r = end, c++) {
            end = chunk_end(&a[t], r, left, nt);
            put_task(tasks, &at, t, TASK_ROWS, r, end);
            left -= (end - r) * a[t].bs;
            for (; done < later * (c + 1) / chunks; done++) put_task(tasks, &at, t + 1, TASK_SCAN, done, 0);
        }
        if (a[t].tail) put_task(tasks, &at, t, TASK_TAIL, 0, 0);
        for (; done < later; done++) put_task(tasks, &at, t + 1, TASK_SCAN, done, 0);
    }
    ntasks = at;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        float bufs[LMO_MAX_SLOTS * maxbs] __attribute__((aligned(64))); /* <= 64 KiB of stack */
        slot_rt rt[LMO_MAX_SLOTS];
        int64_t k, mine = -1; /* the tensor whose slots rt holds */
        for (;;) {
            const int64_t i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED);
            const lmo_task *task;
            const lmo_args *x;
            if (i >= ntasks) break;
            task = &tasks[i];
            x = &a[task->t];
            if (task->kind == TASK_SCAN) {
                const int64_t lo = task->c * LMO_SCAN_PIECE;
                parts[piece_base[task->t] + task->c] =
                    sumsq_range(x->scan_dtype, x->scan, lo, lo + LMO_SCAN_PIECE < x->scan_n ? lo + LMO_SCAN_PIECE : x->scan_n);
                if (__atomic_sub_fetch(&pending[task->t], 1, __ATOMIC_ACQ_REL) == 0) { /* the last piece: add them up */
                    const int64_t pieces = n_pieces(x);
                    float sumsq = 0.0f;
                    for (k = 0; k < pieces; k++) sumsq += parts[piece_base[task->t] + k];
                    *x->scan_sumsq = sumsq;
                    __atomic_store_n(&verdict[task->t], isfinite(sumsq) ? VERDICT_FINITE : VERDICT_SKIP, __ATOMIC_RELEASE);
                }
                continue;
            }
            if (wait_verdict(&verdict[task->t]) != VERDICT_FINITE) continue;
            if (task->kind == TASK_TAIL) {
                run_tail(x, fns[task->t]);
                continue;
            }
            if (mine != task->t) {
                for (k = 0; k < x->nslots; k++) slot_rt_init(&rt[k], &x->slot[k], bufs + k * x->bs);
                mine = task->t;
            }
            {
                fns[task->t](x, rt, task->c, task->end);
            }
        }
    }
    for (t = 0; t < n; t++) ok[t] = verdict[t] == VERDICT_FINITE;
    free(tasks); free(piece_base); free(pending); free(verdict); free(fns); free(parts);
    return LMO_OK;
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* the parameter write: round to nearest, stochastically, or with Kahan compensation (lowmemopt.rounding)            */

static inline uint32_t lmo_f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float lmo_u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint16_t lmo_bf16_rne(float f) {
    const uint32_t u = lmo_f2u(f);
    return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
/* murmur3's fmix32 */
static inline uint32_t lmo_mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x85EBCA6Bu;
    x ^= x >> 13;
    x *= 0xC2B2AE35u;
    return x ^ (x >> 16);
}

/* float -> IEEE half by integer arithmetic: round to nearest even, subnormals exact, >= 65520 -> Inf, NaN ->
 * sign | 0x7E00 (as c10::Half; the vector builds' store_f16 gives the same for every non-NaN value) */
static inline uint16_t lmo_f16_rne(float f) {
    const uint32_t u = lmo_f2u(f), sign = (u >> 16) & 0x8000, au = u & 0x7FFFFFFF;
    uint32_t e, m, s, q, rem, half;
    if (au > 0x7F800000) return (uint16_t)(sign | 0x7E00);
    if (au >= 0x477FF000) return (uint16_t)(sign | 0x7C00);
    if (au >= 0x38800000) return (uint16_t)(sign | ((au + 0xFFF + ((au >> 13) & 1) - (112u << 23)) >> 13));
    if (au < 0x33000000) return (uint16_t)sign; /* below 2^-25: 0 */
    e = au >> 23;                               /* a = m * 2^(e - 150); in units of 2^-24: m >> (126 - e) */
    m = (au & 0x7FFFFF) | 0x800000;
    s = 126 - e;                                /* 14 .. 24 */
    q = m >> s;
    rem = m & ((1u << s) - 1);
    half = 1u << (s - 1);
    return (uint16_t)(sign | (q + (rem > half || (rem == half && (q & 1)))));
}
/* fp16 stochastic rounding of x with 16 random bits r (lowmemopt.rounding: normal, subnormal, past 65504 as
 * lmo_f16_rne), without branches so that a loop of it vectorizes */
static inline uint16_t lmo_f16_sr(float x, uint32_t r) {
    const uint32_t u = lmo_f2u(x), sign = (u >> 16) & 0x8000, au = u & 0x7FFFFFFF;
    const uint32_t normal = ((au + (r >> 3)) >> 13) - (112u << 10);
    const float small = lmo_u2f(au < 0x38800000 ? au : 0x38800000);                  /* the subnormal lanes' |x| */
    const uint32_t sub = ((uint32_t)(int32_t)(small * 1099511627776.0f) + r) >> 16;  /* |x| * 2^40 <= 2^26 */
    const uint32_t big = au > 0x7F800000 ? 0x7E00 : au >= 0x477FF000 ? 0x7C00 : 0x7BFF; /* past 65504 */
    return (uint16_t)(sign | (au > 0x477FE000 ? big : au < 0x38800000 ? sub : normal));
}

/* p[i .. i + 15] <- x (fp32 result); p_old: the parameter's values before the step, as fp32. A bf16 or fp16
 * parameter with UPD_STOCHASTIC / UPD_KAHAN: lowmemopt.rounding's rules, lane by lane. */
static inline __attribute__((always_inline)) void store_param(const lmo_args *a, int64_t i, vf p_old, vf x) {
    float xs[16], ps[16];
    uint16_t *dst;
    int k;
    if (a->p_update == UPD_NEAREST || a->p_dtype == DT_F32) {
        store_dt(a->p_dtype, a->p, i, x);
        return;
    }
    dst = (uint16_t *)a->p + i;
    v_store(xs, x);
    if (a->p_update == UPD_STOCHASTIC) {
        const uint32_t key = a->sr_key, base = (uint32_t)(a->p_offset + i); /* indices mod 2^32 */
        for (k = 0; k < 16; k++) {
            const uint32_t r = lmo_mix32((base + (uint32_t)k) ^ key) >> 16;
            if (a->p_dtype == DT_BF16)
                dst[k] = xs[k] != xs[k] ? 0x7FC0 : (uint16_t)((lmo_f2u(xs[k]) + r) >> 16);
            else
                dst[k] = lmo_f16_sr(xs[k], r);
        }
        return;
    }
    /* Kahan: y = (p32 - p) + c; p' = R(p + y); c = R(y - (p' - p)), 0 if not finite */
    if (a->p_dtype == DT_F16) { /* the build's fp16 conversions, 16 lanes at a time */
        uint16_t *c = a->kahan + i;
        const vf y = v_add(v_sub(x, p_old), load_f16(c));
        float comp[16];
        store_f16(dst, v_add(p_old, y));
        v_store(comp, v_sub(y, v_sub(load_f16(dst), p_old)));
        for (k = 0; k < 16; k++) comp[k] = comp[k] - comp[k] == 0.0f ? comp[k] : 0.0f;
        store_f16(c, v_load(comp));
        return;
    }
    v_store(ps, p_old);
    for (k = 0; k < 16; k++) {
        uint16_t *c = a->kahan + i + k;
        const float y = (xs[k] - ps[k]) + lmo_u2f((uint32_t)*c << 16);
        const uint16_t nb = lmo_bf16_rne(ps[k] + y);
        float comp = y - (lmo_u2f((uint32_t)nb << 16) - ps[k]);
        if (!(comp - comp == 0.0f)) comp = 0.0f;
        dst[k] = nb;
        *c = lmo_bf16_rne(comp);
    }
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* Adam / AdamW (lowmemopt.optim.adamw.adam_math), slots: exp_avg, exp_avg_sq[, max_exp_avg_sq]                        */

/* h: 0 weight_decay (L2, added to g; 0: none)  1 1 - beta1  2 beta2  3 1 - beta2  4 bias_correction2_sqrt  5 eps
 *    6 -lr / bias_correction1  7 decay factor (p *= decay)          flags: 1 maximize  2 amsgrad */
static inline __attribute__((always_inline)) void adam_rows(const lmo_args *a, const slot_rt *rt, int64_t r0,
                                                              int64_t r1, const int K) {
    const float w1 = (float)a->h[1];
    const int l2 = a->h[0] != 0.0, maximize = a->flags & 1, amsgrad = a->flags & 2, small = fabsf(w1) < 0.5f;
    const vf wd = v_set((float)a->h[0]), coef = v_set(small ? w1 : w1 - 1.0f), beta2 = v_set((float)a->h[2]);
    const vf omb2 = v_set((float)a->h[3]), bc2s = v_set((float)a->h[4]), eps = v_set((float)a->h[5]);
    const vf step = v_set((float)a->h[6]), decay = v_set((float)a->h[7]);
    const int bs = a->bs, pdt = a->p_dtype, gdt = a->g_dtype;
    slot_rt sm = rt[0], sv = rt[1], sx = rt[amsgrad ? 2 : 1];
    int64_t row;
    int j;
    for (row = r0; row < r1; row++) {
        rowacc am, av, ax;
        slot_row_begin(K, &sm, row, &am);
        slot_row_begin(K, &sv, row, &av);
        slot_row_begin(K, &sx, row, &ax); /* without amsgrad: an unused copy of exp_avg_sq's */
        for (j = 0; j < bs; j += 64) { /* groups of 4 vectors: 64 codes decode at once */
            const int n = bs - j >= 64 ? 4 : (bs - j) / 16;
            vf M[4], V[4], X[4];
            int u;
            slot_loadn(K, &sm, row * bs + j, n, &am, M);
            slot_loadn(K, &sv, row * bs + j, n, &av, V);
            if (amsgrad) slot_loadn(K, &sx, row * bs + j, n, &ax, X);
            for (u = 0; u < n; u++) {
                const int64_t i = row * bs + j + 16 * u;
                vf p = load_dt(pdt, a->p, i), g = load_grad(gdt, a->g, i, a->g_mult), d;
                vf m = slot_get(K, &sm, i, &am, M, u), v = slot_get(K, &sv, i, &av, V, u);
                if (maximize) g = v_neg(g);
                if (l2) g = v_fma(p, wd, g);                                  /* g.add(p, alpha=wd) */
                d = v_sub(g, m);                                               /* m.lerp_(g, 1 - beta1) */
                m = v_fma(coef, d, small ? m : g);
                v = v_fma(v_mul(omb2, g), g, v_mul(v, beta2));                 /* v.mul_(b2).addcmul_(g, g, 1 - b2) */
                slot_store(K, &sm, i, j + 16 * u, m, &am);
                slot_store(K, &sv, i, j + 16 * u, v, &av);
                if (amsgrad) {                                                 /* v_max = maximum(v_max, v) */
                    v = v_max(slot_get(K, &sx, i, &ax, X, u), v);
                    slot_store(K, &sx, i, j + 16 * u, v, &ax);
                }
                d = v_div(v_mul(m, step), v_add(v_div(v_sqrt(v), bc2s), eps)); /* m (-lr / bc1) / (sqrt(v) / bc2s + eps) */
                store_param(a, i, p, v_add(v_mul(p, decay), d));              /* p * decay + delta */
            }
        }
        slot_row_end(K, &sm, row, bs, &am);
        slot_row_end(K, &sv, row, bs, &av);
        if (amsgrad) slot_row_end(K, &sx, row, bs, &ax);
    }
}
LMO_SPECIALIZE(adam_rows)

int lmo_adam(const lmo_args *a) {
    if (a->nslots != ((a->flags & 2) ? 3 : 2)) return LMO_EBADARG;
    return adam_rows_run(a);
}

/* n parameters in one parallel region (run_many) */
int lmo_adam_many(const lmo_args *a, int64_t n, uint8_t *ok) {
    int64_t t;
    for (t = 0; t < n; t++)
        if (a[t].nslots != ((a[t].flags & 2) ? 3 : 2)) return LMO_EBADARG;
    return run_many(a, n, ok, adam_rows_pick);
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* Lion (lowmemopt.optim.lion.lion_math), slot: exp_avg                                                                */

/* h: 0 beta1  1 1 - beta1  2 beta2  3 1 - beta2  4 -lr  5 decay factor */
static inline __attribute__((always_inline)) void lion_rows(const lmo_args *a, const slot_rt *rt, int64_t r0,
                                                              int64_t r1, const int K) {
    const vf b1 = v_set((float)a->h[0]), omb1 = v_set((float)a->h[1]), b2 = v_set((float)a->h[2]);
    const vf omb2 = v_set((float)a->h[3]), nlr = v_set((float)a->h[4]), decay = v_set((float)a->h[5]);
    const int bs = a->bs, pdt = a->p_dtype, gdt = a->g_dtype;
    slot_rt sm = rt[0];
    int64_t row;
    int j;
    for (row = r0; row < r1; row++) {
        rowacc am;
        slot_row_begin(K, &sm, row, &am);
        for (j = 0; j < bs; j += 64) {
            const int n = bs - j >= 64 ? 4 : (bs - j) / 16;
            vf M[4];
            int u;
            slot_loadn(K, &sm, row * bs + j, n, &am, M);
            for (u = 0; u < n; u++) {
                const int64_t i = row * bs + j + 16 * u;
                vf p = load_dt(pdt, a->p, i), g = load_grad(gdt, a->g, i, a->g_mult), m = slot_get(K, &sm, i, &am, M, u);
                vf d = v_mul(v_sign(v_fma(g, omb1, v_mul(m, b1))), nlr);      /* sign(m b1 + (1 - b1) g) * -lr */
                slot_store(K, &sm, i, j + 16 * u, v_fma(g, omb2, v_mul(m, b2)), &am); /* m.mul_(b2).add_(g, 1 - b2) */
                store_param(a, i, p, v_add(v_mul(p, decay), d));
            }
        }
        slot_row_end(K, &sm, row, bs, &am);
    }
}
LMO_SPECIALIZE(lion_rows)

int lmo_lion(const lmo_args *a) {
    if (a->nslots != 1) return LMO_EBADARG;
    return lion_rows_run(a);
}

/* n parameters in one parallel region (run_many) */
int lmo_lion_many(const lmo_args *a, int64_t n, uint8_t *ok) {
    int64_t t;
    for (t = 0; t < n; t++)
        if (a[t].nslots != 1) return LMO_EBADARG;
    return run_many(a, n, ok, lion_rows_pick);
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* SGD (lowmemopt.optim.sgd.sgd_math) and SignSGD (lowmemopt.optim.signsgd.signsgd_math), slot: momentum_buffer    */
/* (when momentum != 0)                                                                                               */

/* h: 0 weight_decay  1 momentum  2 1 - dampening  3 -lr  4 decay factor
 * flags: 1 maximize  2 nesterov  4 first step (buf = d)  8 momentum != 0
 *        16 weight decay after the momentum (FusedSGD's wd_after_momentum: d + wd p, not g + wd p)
 *        32 SignSGD: p += -lr sign(d) (sign(+-0) = sign(NaN) = +0; -lr * +-1 is exact, so the fma rounds as
 *           p.add_(sign(d), alpha=-lr)) */
static inline __attribute__((always_inline)) void sgd_rows(const lmo_args *a, const slot_rt *rt, int64_t r0,
                                                             int64_t r1, const int K) {
    const vf wd = v_set((float)a->h[0]), mom = v_set((float)a->h[1]), omd = v_set((float)a->h[2]);
    const vf nlr = v_set((float)a->h[3]), decay = v_set((float)a->h[4]);
    const int l2 = a->h[0] != 0.0, maximize = a->flags & 1, nesterov = a->flags & 2, first = a->flags & 4;
    const int has_buf = a->flags & 8, wd_after = a->flags & 16, sign = a->flags & 32;
    const int bs = a->bs, pdt = a->p_dtype, gdt = a->g_dtype;
    slot_rt sb;
    int64_t row;
    int j;
    memset(&sb, 0, sizeof sb);
    if (has_buf) sb = rt[0];
    for (row = r0; row < r1; row++) {
        rowacc ab;
        memset(&ab, 0, sizeof ab);
        if (has_buf) slot_row_begin(K, &sb, row, &ab);
        for (j = 0; j < bs; j += 64) {
            const int n = bs - j >= 64 ? 4 : (bs - j) / 16;
            vf B[4];
            int u;
            if (has_buf && !first) slot_loadn(K, &sb, row * bs + j, n, &ab, B);
            for (u = 0; u < n; u++) {
                const int64_t i = row * bs + j + 16 * u;
                vf p = load_dt(pdt, a->p, i), d = load_grad(gdt, a->g, i, a->g_mult);
                if (maximize) d = v_neg(d);
                if (l2 && !wd_after) d = v_fma(p, wd, d);                      /* d.add(p, alpha=wd) */
                if (has_buf) {                                                  /* buf.mul_(mom).add_(d, alpha=1 - damp) */
                    vf buf = first ? d : v_fma(d, omd, v_mul(slot_get(K, &sb, i, &ab, B, u), mom));
                    slot_store(K, &sb, i, j + 16 * u, buf, &ab);
                    d = nesterov ? v_fma(buf, mom, d) : buf;
                }
                if (l2 && wd_after) d = v_fma(p, wd, d);                       /* after the momentum */
                if (sign) d = v_sign(d);
                store_param(a, i, p, v_fma(d, nlr, v_mul(p, decay)));         /* p.add_(d, alpha=-lr) */
            }
        }
        if (has_buf) slot_row_end(K, &sb, row, bs, &ab);
    }
}
LMO_SPECIALIZE(sgd_rows)

int lmo_sgd(const lmo_args *a) {
    if (a->nslots != ((a->flags & 8) ? 1 : 0)) return LMO_EBADARG;
    return sgd_rows_run(a);
}

/* n parameters in one parallel region (run_many) */
int lmo_sgd_many(const lmo_args *a, int64_t n, uint8_t *ok) {
    int64_t t;
    for (t = 0; t < n; t++)
        if (a[t].nslots != ((a[t].flags & 8) ? 1 : 0)) return LMO_EBADARG;
    return run_many(a, n, ok, sgd_rows_pick);
}

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

/* ------------------------------------------------------------------------------------------------------------------ */
/* Factored second moments (lowmemopt.optim.adafactor / came): whole-tensor passes over a 2-D parameter [R, C] with   */
/* C % 16 == 0. Row sums and squared norms are summed in fp64, column sums in fp32 within each of LMO_NSEG fixed row */
/* segments and fp64 across them (torch sums fp32 in its own order: results agree with the eager path to fp32        */
/* rounding); everything elementwise repeats the eager operations exactly.                                            */

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
    float *row_out, *col_out;    /* lmo_fact_sq_means: means [R], [C] */
    float *vr, *vc;              /* the steps: the second moment's row / column EMAs [R], [C], updated in place */
    float *vr2, *vc2;            /* lmo_came_step: the instability's row / column EMAs */
    double *work;                /* LMO_NSEG * (C + 1) doubles: per-segment partial sums */
    double *result;              /* sum of squares (the steps with flag 4: g's, fp32; not finite: nothing written) */
    double h[12];
    float g_mult;                /* the gradient's loss scaling multiplier, as lmo_args.g_mult (0 or 1: none) */
} lmo_fact;

static int64_t gcd64(int64_t a, int64_t b) { while (b) { int64_t t = a % b; a = b; b = t; } return a; }

/* Segment s of the rows: whole rows and whole blocks (boundaries at multiples of lcm(C, bs) elements). */
static void fact_segment(const lmo_fact *f, int s, int64_t *r0, int64_t *r1) {
    const int64_t unit = f->bs / gcd64(f->C, f->bs); /* rows per lcm(C, bs) */
    const int64_t units = (f->R + unit - 1) / unit;
    int64_t a = units * s / LMO_NSEG * unit, b = units * (s + 1) / LMO_NSEG * unit;
    *r0 = a < f->R ? a : f->R;
    *r1 = b < f->R ? b : f->R;
}

static int fact_check(const lmo_fact *f) {
    if (f->C <= 0 || f->C % 16 || f->R <= 0 || f->bs < 16 || f->bs % 16 || f->bs > LMO_MAX_BS) return LMO_EBADARG;
    return LMO_OK;
}

static int fact_threads(const lmo_fact *f) {
    int nt = f->nthreads < 1 ? 1 : f->nthreads;
    int64_t most = f->R * f->C / 65536 + 1;
    return nt > most ? (int)most : nt;
}

/* Walk segment s in blocks of bs elements (whole rows per segment, C % 16 == 0), in groups of up to 4 vectors (64
 * codes decode at once): GROUP runs first for each group (i_ + g_: its first element, n: its vectors), then the body
 * (the last argument) for each of its vectors, which sees q_ (the vector's index in the group), i (its flat index),
 * r, c (row and column of its 16 lanes) and j (its offset in the block); BLOCK_BEGIN / BLOCK_END bracket each block
 * (len: its length). */
#define LMO_FACT_WALK(f, s, BLOCK_BEGIN, GROUP, BLOCK_END, ...)                                                 \
    do {                                                                                                              \
        int64_t r0_, r1_, i_, end_, r, c;                                                                             \
        fact_segment((f), (s), &r0_, &r1_);                                                                           \
        r = r0_;                                                                                                      \
        c = 0;                                                                                                        \
        end_ = r1_ * (f)->C;                                                                                          \
        for (i_ = r0_ * (f)->C; i_ < end_; i_ += (f)->bs) {                                                           \
            const int64_t blk = i_ / (f)->bs;                                                                         \
            const int len = (int)((end_ - i_) < (f)->bs ? (end_ - i_) : (f)->bs);                                    \
            int g_;                                                                                                   \
            (void)blk;                                                                                                \
            BLOCK_BEGIN;                                                                                              \
            for (g_ = 0; g_ < len; g_ += 64) {                                                                        \
                const int n = len - g_ >= 64 ? 4 : (len - g_) / 16;                                                   \
                int q_;                                                                                               \
                GROUP;                                                                                                \
                for (q_ = 0; q_ < n; q_++) {                                                                          \
                    const int j = g_ + 16 * q_;                                                                       \
                    const int64_t i = i_ + j;                                                                         \
                    __VA_ARGS__;                                                                                      \
                    c += 16;                                                                                          \
                    if (c == (f)->C) { c = 0; r++; }                                                                  \
                }                                                                                                     \
            }                                                                                                         \
            BLOCK_END;                                                                                                \
        }                                                                                                             \
    } while (0)

/* (rf[r] cf[c]) g: approx_rsqrt's factor product, then the multiply by g (two roundings, as the eager math) */
static inline vf v_rc(const float *rf, const float *cf, int64_t r, int64_t c, vf g) {
    return v_mul(v_mul(v_set(rf[r]), v_load(cf + c)), g);
}

/* ---- the one-region steps of Adafactor and CAME (lmo_adafactor_step, lmo_came_step) ------------------------------ */
/* One parallel region per parameter: each pass is an `omp for` over the LMO_NSEG row segments (its end is the barrier
 * before the next pass), and whatever depends on a whole-tensor sum (the row / column EMAs and the factors of
 * approx_rsqrt, the clipping denominator, Adafactor's RMS(p)) is computed between passes from per-segment partial sums
 * added in segment order, by every thread alike: results do not depend on the thread count or the schedule.
 * work (doubles): [0, LMO_NSEG C / 2) the segments' column sums (fp32), then LMO_NSEG doubles for each of
 * FW_ROW (sum of a row statistic's new EMA), FW_PSQ (sum of p^2), FW_USQ (sum of u^2), FW_RES (CAME: like FW_ROW),
 * FW_GSQ (the non-finite check's fp32 sum of g^2). */

#define FW_COL(f) ((float *)(f)->work)
#define FW_ROW 0
#define FW_PSQ 1
#define FW_USQ 2
#define FW_RES 3
#define FW_GSQ 4
#define FW_SEG(f, k) ((f)->work + (int64_t)LMO_NSEG * (f)->C / 2 + (int64_t)(k) * LMO_NSEG)

typedef struct {
    float denom, alpha, b1, omb1, sdecay, eps2, lr;
} fact_sc;

/* Adds the per-segment sums seg[0..LMO_NSEG) in order. */
static inline double seg_total(const double *seg) {
    double t = 0.0;
    int s;
    for (s = 0; s < LMO_NSEG; s++) t += seg[s];
    return t;
}

/* Pass 1 on segment s: x = g^2 + eps1; each row's mean (fp64 sum / C) into mean[r] (the steps: rf, scratch until
 * fact_factors), the segment's column sums of x into FW_COL; with psq, the sum of p^2 (RMS(p)) into FW_PSQ[s]; with
 * check, the fp32 sum of the rows' sums into FW_GSQ[s]: not finite iff an element of g is not, or g's sum of squares
 * overflows fp32 (the check's condition; eps1, ~1e-30, adds nothing to it). Nothing of the parameter's state is
 * written: a step that checks its gradient here can still leave everything as it was. */
static void fact_sq_seg(const lmo_fact *f, int s, float eps1, float *mean, int psq, int check) {
    const int64_t C = f->C;
    const vf veps1 = v_set(eps1);
    float *colp = FW_COL(f) + (int64_t)s * C;
    float gsq = 0.0f;
    int64_t r0, r1, r, c;
    vd pacc = vd_zero();
    fact_segment(f, s, &r0, &r1);
    memset(colp, 0, sizeof(float) * C);
    for (r = r0; r < r1; r++) {
        vd acc = vd_zero();
        for (c = 0; c < C; c += 16) {
            vf g = load_grad(f->g_dtype, f->g, r * C + c, f->g_mult);
            vf x = v_add(v_mul(g, g), veps1);
            acc = vd_add(acc, x);
            v_store(colp + c, v_add(v_load(colp + c), x));
            if (psq) pacc = vd_add_sq(pacc, load_dt(f->p_dtype, f->p, r * C + c));
        }
        {
            const double sum = vd_sum(acc);
            mean[r] = (float)(sum / (double)C);
            gsq += (float)sum;
        }
    }
    if (psq) FW_SEG(f, FW_PSQ)[s] = vd_sum(pacc);
    if (check) FW_SEG(f, FW_GSQ)[s] = gsq;
}

/* Row and column means of x(g) = g^2 + eps1 (h[0] = eps1) into row_out / col_out (AdafactorTorch's first pass). */
int lmo_fact_sq_means(const lmo_fact *f) {
    const int64_t R = f->R, C = f->C;
    if (fact_check(f)) return LMO_EBADARG;
#ifdef _OPENMP
#pragma omp parallel num_threads(fact_threads(f))
#endif
    {
        int s;
        int64_t c;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (s = 0; s < LMO_NSEG; s++) fact_sq_seg(f, s, (float)f->h[0], f->row_out, 0, 0);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (c = 0; c < C; c++) {
            double t = 0.0;
            for (s = 0; s < LMO_NSEG; s++) t += FW_COL(f)[(int64_t)s * C + c];
            f->col_out[c] = (float)(t / (double)R);
        }
    }
    return LMO_OK;
}

/* The non-finite check of pass 1 (flag 4): the fp32 sum of g^2 over the segments, in their order. */
static float fact_gsq(const lmo_fact *f) {
    float t = 0.0f;
    int s;
    for (s = 0; s < LMO_NSEG; s++) t += (float)FW_SEG(f, FW_GSQ)[s];
    return t;
}

/* After pass 1, segment s: each row's mean (rf[r]) folds into the row EMA row[r] = beta row[r] + (1 - beta) mean
 * (ema_factored_: mul_, then add_ with alpha, one fma), the new row values' sum into FW_ROW[s]. */
static void fact_row_ema_seg(const lmo_fact *f, int s, float beta, float omb, float *row) {
    int64_t r0, r1, r;
    double rows = 0.0;
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++) {
        row[r] = fmaf(f->rf[r], omb, row[r] * beta);
        rows += (double)row[r];
    }
    FW_SEG(f, FW_ROW)[s] = rows;
}

/* Between passes (every thread; ends with a barrier): the column means (the segments' sums in fp64, in segment order,
 * / R) fold into the column EMA col[c] as the rows did, then approx_rsqrt's factors cf[c] = 1 / sqrt(col[c]) and
 * rf[r] = 1 / sqrt(row[r] / mean(row)) (torch's rsqrt: two roundings; mean(row): FW seg sums / R). */
static void fact_factors(const lmo_fact *f, int rowk, float beta, float omb, const float *row, float *col, float *rf,
                         float *cf) {
    const int64_t R = f->R, C = f->C;
    const float rmean = (float)(seg_total(FW_SEG(f, rowk)) / (double)R);
    const float *colp = FW_COL(f);
    int64_t c, r;
#ifdef _OPENMP
#pragma omp for schedule(static) nowait
#endif
    for (c = 0; c < C; c++) {
        double t = 0.0;
        float mean;
        int s;
        for (s = 0; s < LMO_NSEG; s++) t += colp[(int64_t)s * C + c];
        mean = (float)(t / (double)R);
        col[c] = fmaf(mean, omb, col[c] * beta);
        cf[c] = 1.0f / sqrtf(col[c]);
    }
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (r = 0; r < R; r++) rf[r] = 1.0f / sqrtf(row[r] / rmean);
}

/* Pass 2 on segment s: the sum of u^2, u = (rf[r] cf[c]) g, into FW_USQ[s] (fp64). */
static void fact_usq_seg(const lmo_fact *f, int s) {
    const int64_t C = f->C;
    int64_t r0, r1, r, c;
    vd acc = vd_zero();
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c += 16) acc = vd_add_sq(acc, v_rc(f->rf, f->cf, r, c, load_grad(f->g_dtype, f->g, r * C + c, f->g_mult)));
    FW_SEG(f, FW_USQ)[s] = vd_sum(acc);
}

/* The clipping denominator (RMS(u) / clip).clamp(min=1) in fp32 as the eager math's 0-dim tensors: the norm rounded
 * to fp32, divided by sqrt(numel) and by the threshold, each cast to fp32 (NaN stays NaN). */
static float fact_denom(const lmo_fact *f, double clip) {
    float x = (float)sqrt(seg_total(FW_SEG(f, FW_USQ)));
    x = x / (float)sqrt((double)(f->R * f->C));
    x = x / (float)clip;
    return x < 1.0f ? 1.0f : x;
}

/* Adafactor's update (lowmemopt.optim.adafactor.adafactor_math after the statistics):
 *   u = (rf[r] cf[c]) g / denom * alpha;  [m = beta1 m + (1 - beta1) u; u = m];  [p += sdecay p];  p -= u
 * A denom of exactly 1 (no clipping) divides by nothing. */
static inline __attribute__((always_inline)) void adafactor_apply_seg(const lmo_fact *f, const slot_rt *rt, int s,
                                                                       const fact_sc *sc, const int K) {
    const vf denom = v_set(sc->denom), alpha = v_set(sc->alpha), b1 = v_set(sc->b1);
    const vf omb1 = v_set(sc->omb1), sdecay = v_set(sc->sdecay);
    const int has_m = f->has_m, wd = f->flags & 1, pdt = f->p_dtype, gdt = f->g_dtype, clip = sc->denom != 1.0f;
    slot_rt sm;
    rowacc am;
    vf M[4];
    if (has_m) sm = rt[0];
    else memset(&sm, 0, sizeof sm);
    memset(&am, 0, sizeof am);
    memset(M, 0, sizeof M);
    LMO_FACT_WALK(f, s, if (has_m) slot_row_begin(K, &sm, blk, &am), if (has_m) slot_loadn(K, &sm, i_ + g_, n, &am, M),
                  if (has_m) slot_block_end(K, &sm, blk, i_, len, &am), {
        vf u = v_rc(f->rf, f->cf, r, c, load_grad(gdt, f->g, i, f->g_mult));
        vf p = load_dt(pdt, f->p, i);
        if (clip) u = v_div(u, denom);
        u = v_mul(u, alpha);
        if (has_m) {
            u = v_fma(u, omb1, v_mul(slot_get(K, &sm, i, &am, M, q_), b1));
            slot_store(K, &sm, i, j, u, &am);
        }
        if (wd) p = v_fma(p, sdecay, p);
        store_dt(pdt, f->p, i, v_sub(p, u));
    });
}

/* CAME's pass 3 (lowmemopt.optim.came.came_math): with u = (rf[r] cf[c]) g / denom and the new first moment
 * m' = beta1 m + (1 - beta1) u (not stored here), x = (u - m')^2 + eps2; its row means fold into the EMA vr2 (as
 * fact_sq_seg), its column sums into FW_COL (fp32 within the segment). */
static inline __attribute__((always_inline)) void came_res_seg(const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc,
                                                                float beta, float omb, const int K) {
    const vf denom = v_set(sc->denom), b1 = v_set(sc->b1), omb1 = v_set(sc->omb1), eps2 = v_set(sc->eps2);
    const int gdt = f->g_dtype, clip = sc->denom != 1.0f;
    const int64_t C = f->C;
    float *colp = FW_COL(f) + (int64_t)s * C;
    float *row = f->vr2;
    double rows = 0.0;
    slot_rt sm = rt[0];
    rowacc am;
    vf M[4];
    vd racc = vd_zero();
    memset(&am, 0, sizeof am);
    memset(colp, 0, sizeof(float) * C);
    LMO_FACT_WALK(f, s, slot_row_begin(K, &sm, blk, &am), slot_loadn(K, &sm, i_ + g_, n, &am, M), (void)0, {
        vf u = v_rc(f->rf, f->cf, r, c, load_grad(gdt, f->g, i, f->g_mult));
        vf m, d, x;
        if (clip) u = v_div(u, denom);
        m = v_fma(u, omb1, v_mul(slot_get(K, &sm, i, &am, M, q_), b1));
        d = v_sub(u, m);
        x = v_add(v_mul(d, d), eps2);
        racc = vd_add(racc, x);
        v_store(colp + c, v_add(v_load(colp + c), x));
        if (c + 16 == C) {
            const float mean = (float)(vd_sum(racc) / (double)C);
            row[r] = fmaf(mean, omb, row[r] * beta);
            rows += (double)row[r];
            racc = vd_zero();
        }
    });
    FW_SEG(f, FW_RES)[s] = rows;
}

/* CAME's update: m' as above (stored), u2 = (rf2[r] cf2[c]) m';  [p += sdecay p];  p -= u2 lr */
static inline __attribute__((always_inline)) void came_apply_seg(const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc,
                                                                  const int K) {
    const vf denom = v_set(sc->denom), b1 = v_set(sc->b1), omb1 = v_set(sc->omb1);
    const vf sdecay = v_set(sc->sdecay), lr = v_set(sc->lr);
    const int wd = f->flags & 1, pdt = f->p_dtype, gdt = f->g_dtype, clip = sc->denom != 1.0f;
    slot_rt sm = rt[0];
    rowacc am;
    vf M[4];
    memset(&am, 0, sizeof am);
    LMO_FACT_WALK(f, s, slot_row_begin(K, &sm, blk, &am), slot_loadn(K, &sm, i_ + g_, n, &am, M),
                  slot_block_end(K, &sm, blk, i_, len, &am), {
        vf u = v_rc(f->rf, f->cf, r, c, load_grad(gdt, f->g, i, f->g_mult));
        vf m, p = load_dt(pdt, f->p, i);
        if (clip) u = v_div(u, denom);
        m = v_fma(u, omb1, v_mul(slot_get(K, &sm, i, &am, M, q_), b1));
        slot_store(K, &sm, i, j, m, &am);
        u = v_rc(f->rf2, f->cf2, r, c, m);
        if (wd) p = v_fma(p, sdecay, p);
        store_dt(pdt, f->p, i, v_sub(p, v_mul(u, lr)));
    });
}

/* Each pass specialized for the first moment's storage, a function of its own (the scalar build's 16-float structs
 * stay in registers only in functions of moderate size). */
#define LMO_FACT_SPECIALIZE(name, PARAMS, ...)                                                                      \
    static void name##_f32 PARAMS { name(__VA_ARGS__, ST_F32); }                                                    \
    static void name##_bf16 PARAMS { name(__VA_ARGS__, ST_BF16); }                                                  \
    static void name##_q8 PARAMS { name(__VA_ARGS__, ST_Q8); }                                                      \
    static void name##_q4 PARAMS { name(__VA_ARGS__, ST_Q4); }

typedef void (*fact_af_fn)(const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc);
typedef void (*fact_res_fn)(const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc, float beta, float omb);
typedef void (*fact_came_fn)(const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc);
LMO_FACT_SPECIALIZE(adafactor_apply_seg, (const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc), f, rt, s, sc)
LMO_FACT_SPECIALIZE(came_res_seg, (const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc, float beta, float omb),
                    f, rt, s, sc, beta, omb)
LMO_FACT_SPECIALIZE(came_apply_seg, (const lmo_fact *f, const slot_rt *rt, int s, const fact_sc *sc), f, rt, s, sc)

/* Passes alternate their direction over the segments (forward, backward, ...): a pass starts on the rows the previous
 * one read last, which a tensor larger than the last-level cache still finds there. */
#define LMO_SEG_FWD(s) (s)
#define LMO_SEG_BWD(s) (LMO_NSEG - 1 - (s))

static int fact_step_check(const lmo_fact *f, int came) {
    if (fact_check(f)) return LMO_EBADARG;
    if (!f->vr || !f->vc || !f->rf || !f->cf || !f->work) return LMO_EBADARG;
    if (came && (!f->has_m || !f->vr2 || !f->vc2 || !f->rf2 || !f->cf2)) return LMO_EBADARG;
    if ((f->flags & 4) && !f->result) return LMO_EBADARG;
    return LMO_OK;
}


/* Passes 1 and 2 of a factored step, called inside its parallel region (the loops share out the segments): 1 g ->
 * the second moment's EMAs vr, vc and the factors rf, cf (scale: also the sum of squares of p, for RMS(p)); 2 g -> the
 * clipping denominator. Then sc holds the denominator and beta1's two scalars (h[2], h[3]), the rest zero.
 * With flag 4 the optimizer's non-finite gradient check is pass 1's too: if the fp32 sum of g^2 is not finite, it
 * returns 1 (every thread alike) before anything of the parameter's state is written, and the step ends there; the
 * gradient is read once for both (a separate check read it once more: ~20 ms a step on the 148M LLaMA). */
static int fact_v_passes(const lmo_fact *f, float eps1, float beta, float omb, int scale, fact_sc *sc) {
    const int check = (f->flags & 4) != 0;
    int s;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (s = 0; s < LMO_NSEG; s++) fact_sq_seg(f, LMO_SEG_FWD(s), eps1, f->rf, scale, check);
    if (check && !isfinite(fact_gsq(f))) return 1; /* every thread alike, after the loop's barrier */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
    for (s = 0; s < LMO_NSEG; s++) fact_row_ema_seg(f, s, beta, omb, f->vr);
    fact_factors(f, FW_ROW, beta, omb, f->vr, f->vc, f->rf, f->cf);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
    for (s = 0; s < LMO_NSEG; s++) fact_usq_seg(f, LMO_SEG_BWD(s));
    memset(sc, 0, sizeof *sc);
    sc->denom = fact_denom(f, f->h[5]);
    sc->b1 = (float)f->h[2];
    sc->omb1 = (float)f->h[3];
    return 0;
}

/* Adafactor, the whole step of one parameter (h: 0 eps1  1 beta2t  2 beta1  3 1 - beta1  4 sdecay (flag 2: -wd)
 * 5 clip threshold  6 alpha (flag 2: rho)  7 eps2; flags: 1 weight decay, 2 alpha = max(RMS(p), eps2) rho with
 * RMS(p) from pass 1, 4 check g as in fact_v_passes). Passes: 1 g (+ p with flag 2) -> row / column EMAs vr, vc and
 * factors rf, cf;
 * 2 g -> denom;  3 g, m, p -> m, p. */
static int adafactor_step_run(const lmo_fact *f, fact_af_fn apply) {
    const float eps1 = (float)f->h[0], beta = (float)f->h[1], omb = (float)(1.0 - f->h[1]);
    const int scale = (f->flags & 2) != 0;
#ifdef _OPENMP
#pragma omp parallel num_threads(fact_threads(f))
#endif
    {
        float buf[f->bs] __attribute__((aligned(64)));
        slot_rt rt[1];
        fact_sc sc;
        int s;
        if (f->has_m) slot_rt_init(&rt[0], &f->m, buf);
        if (!fact_v_passes(f, eps1, beta, omb, scale, &sc)) { /* else a non-finite g (flag 4): nothing written */
            if (scale) { /* step_size: rms_p.clamp(min=eps2) * rho; the decay -wd * alpha, in fp32 as 0-dim tensors */
                float rms = (float)sqrt(seg_total(FW_SEG(f, FW_PSQ))) / (float)sqrt((double)(f->R * f->C));
                const float eps2 = (float)f->h[7];
                rms = rms < eps2 ? eps2 : rms;
                sc.alpha = rms * (float)f->h[6];
                sc.sdecay = sc.alpha * (float)f->h[4];
            } else {
                sc.alpha = (float)f->h[6];
                sc.sdecay = (float)f->h[4];
            }
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (s = 0; s < LMO_NSEG; s++) apply(f, rt, LMO_SEG_FWD(s), &sc);
        }
    }
    if (f->flags & 4) *f->result = fact_gsq(f);
    return LMO_OK;
}

/* CAME, the whole step of one parameter (h: 0 eps1  1 beta2  2 beta1  3 1 - beta1  4 sdecay = -wd lr  5 clip
 * threshold  6 lr  7 eps2  8 beta3; flags: 1 weight decay, 4 check g as in fact_v_passes). Passes: 1 g -> vr, vc, rf, cf;  2 g -> denom;
 * 3 g, m -> the instability's EMAs vr2, vc2 and factors rf2, cf2;  4 g, m, p -> m, p. */
static int came_step_run(const lmo_fact *f, fact_res_fn res, fact_came_fn apply) {
    const float eps1 = (float)f->h[0], beta2 = (float)f->h[1], omb2 = (float)(1.0 - f->h[1]);
    const float beta3 = (float)f->h[8], omb3 = (float)(1.0 - f->h[8]);
#ifdef _OPENMP
#pragma omp parallel num_threads(fact_threads(f))
#endif
    {
        float buf[f->bs] __attribute__((aligned(64)));
        slot_rt rt[1];
        fact_sc sc;
        int s;
        slot_rt_init(&rt[0], &f->m, buf);
        if (!fact_v_passes(f, eps1, beta2, omb2, 0, &sc)) { /* else a non-finite g (flag 4): nothing written */
            sc.sdecay = (float)f->h[4];
            sc.lr = (float)f->h[6];
            sc.eps2 = (float)f->h[7];
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (s = 0; s < LMO_NSEG; s++) res(f, rt, LMO_SEG_FWD(s), &sc, beta3, omb3);
            fact_factors(f, FW_RES, beta3, omb3, f->vr2, f->vc2, f->rf2, f->cf2);
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
            for (s = 0; s < LMO_NSEG; s++) apply(f, rt, LMO_SEG_BWD(s), &sc);
        }
    }
    if (f->flags & 4) *f->result = fact_gsq(f);
    return LMO_OK;
}

int lmo_adafactor_step(const lmo_fact *f) {
    if (fact_step_check(f, 0)) return LMO_EBADARG;
    switch (f->has_m ? f->m.kind : ST_F32) {
    case ST_F32: return adafactor_step_run(f, adafactor_apply_seg_f32);
    case ST_BF16: return adafactor_step_run(f, adafactor_apply_seg_bf16);
    case ST_Q8: return adafactor_step_run(f, adafactor_apply_seg_q8);
    case ST_Q4: return adafactor_step_run(f, adafactor_apply_seg_q4);
    default: return LMO_EBADARG;
    }
}

int lmo_came_step(const lmo_fact *f) {
    if (fact_step_check(f, 1)) return LMO_EBADARG;
    switch (f->m.kind) {
    case ST_F32: return came_step_run(f, came_res_seg_f32, came_apply_seg_f32);
    case ST_BF16: return came_step_run(f, came_res_seg_bf16, came_apply_seg_bf16);
    case ST_Q8: return came_step_run(f, came_res_seg_q8, came_apply_seg_q8);
    case ST_Q4: return came_step_run(f, came_res_seg_q4, came_apply_seg_q4);
    default: return LMO_EBADARG;
    }
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* Adafactor with torch.optim.Adafactor's semantics (lowmemopt.optim.adafactor.adafactor_torch_math), no first moment:
 *   u = g rsqrt(max((rv[r] cv[c]) / rmean, eps1^2))        (rf = row_var, cf = col_var; h: 0 rmean  1 eps1^2)
 * lmo_adafactor_torch_sumsq: result[0] = sum of u^2.
 * lmo_adafactor_torch_apply: p = p decay - u scale         (h: 2 scale = +-alpha / denom  3 decay)
 * torch's CPU rsqrt is 1 / sqrt (two roundings), repeated here. */

static inline vf torch_u(const lmo_fact *f, int64_t r, int64_t c, vf g, vf rmean, vf eps2) {
    const vf var = v_div(v_mul(v_set(f->rf[r]), v_load(f->cf + c)), rmean);
    return v_mul(v_div(v_set(1.0f), v_sqrt(v_max(var, eps2))), g);
}

/* Run fn(f, s) for every row segment s, in one parallel region (the segments shared out dynamically). */
typedef void (*fact_seg_fn)(const lmo_fact *f, int s);
static void fact_for_segments(const lmo_fact *f, fact_seg_fn fn) {
#ifdef _OPENMP
#pragma omp parallel num_threads(fact_threads(f))
#endif
    {
        int s;
#ifdef _OPENMP
#pragma omp for schedule(dynamic, 1)
#endif
        for (s = 0; s < LMO_NSEG; s++) fn(f, s);
    }
}

/* work[s] = segment s's sum of u^2 in fp64, u = torch_u (h: 0 rmean, 1 eps1^2) */
static void adafactor_torch_usq_seg(const lmo_fact *f, int s) {
    const int64_t C = f->C;
    const vf rmean = v_set((float)f->h[0]), eps2 = v_set((float)f->h[1]);
    int64_t r0, r1, r, c;
    vd acc = vd_zero();
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c += 16) acc = vd_add_sq(acc, torch_u(f, r, c, load_grad(f->g_dtype, f->g, r * C + c, f->g_mult), rmean, eps2));
    f->work[s] = vd_sum(acc);
}

/* result[0] = sum of u^2 over the whole tensor: per segment in fp64, then across segments in order. */
int lmo_adafactor_torch_sumsq(const lmo_fact *f) {
    if (fact_check(f) || f->has_m) return LMO_EBADARG;
    fact_for_segments(f, adafactor_torch_usq_seg);
    f->result[0] = seg_total(f->work);
    return LMO_OK;
}

static void adafactor_torch_apply_seg(const lmo_fact *f, int s) {
    const int64_t C = f->C;
    const vf rmean = v_set((float)f->h[0]), eps2 = v_set((float)f->h[1]), scale = v_set((float)f->h[2]);
    const vf decay = v_set((float)f->h[3]);
    const int pdt = f->p_dtype, gdt = f->g_dtype, decays = (float)f->h[3] != 1.0f;
    int64_t r0, r1, r, c;
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c += 16) {
            const int64_t i = r * C + c;
            const vf u = v_mul(torch_u(f, r, c, load_grad(gdt, f->g, i, f->g_mult), rmean, eps2), scale);
            vf p = load_dt(pdt, f->p, i);
            if (decays) p = v_mul(p, decay);
            store_dt(pdt, f->p, i, v_sub(p, u));
        }
}

int lmo_adafactor_torch_apply(const lmo_fact *f) {
    if (fact_check(f) || f->has_m) return LMO_EBADARG;
    fact_for_segments(f, adafactor_torch_apply_seg);
    return LMO_OK;
}
