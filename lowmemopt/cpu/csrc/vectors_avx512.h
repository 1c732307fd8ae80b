/* 16-lane vectors on AVX-512 (LMO_ISA 2): zmm registers, the decode table in registers; the codec's primitives.
 * Included by lmo.h for its LMO_ISA. */
#ifndef LMO_VECTORS_AVX512_H
#define LMO_VECTORS_AVX512_H

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

#endif /* LMO_VECTORS_AVX512_H */
