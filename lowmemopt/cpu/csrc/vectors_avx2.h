/* 16-lane vectors on AVX2 + FMA + F16C (LMO_ISA 1): two 8-lane ymm halves; the codec's primitives.
 * Included by lmo.h for its LMO_ISA. */
#ifndef LMO_VECTORS_AVX2_H
#define LMO_VECTORS_AVX2_H

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

#endif /* LMO_VECTORS_AVX2_H */
