/* 16-lane vectors in plain C (LMO_ISA 0), the scalar reference: a 16-float struct, encoding with the exact bucket
 * table. Included by lmo.h for its LMO_ISA. */
#ifndef LMO_VECTORS_SCALAR_H
#define LMO_VECTORS_SCALAR_H

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

#endif /* LMO_VECTORS_SCALAR_H */
