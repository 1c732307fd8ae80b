/* The elementwise steps (Adam / AdamW, Lion, SGD), one fused pass per row: decode -> fp32 math -> encode, and the
 * parameter write (to nearest, stochastic, Kahan). */
#include "lmo.h"

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
