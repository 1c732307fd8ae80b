/* The factored steps (Adafactor, CAME, AdafactorTorch): whole-tensor passes over a 2-D parameter. */
#include "lmo.h"

/* ------------------------------------------------------------------------------------------------------------------ */
/* Factored second moments (lowmemopt.optim.adafactor / came): whole-tensor passes over a 2-D parameter [R, C] with   */
/* C % 16 == 0. Row sums and squared norms are summed in fp64, column sums in fp32 within each of LMO_NSEG fixed row */
/* segments and fp64 across them (torch sums fp32 in its own order: results agree with the eager path to fp32        */
/* rounding); everything elementwise repeats the eager operations exactly.                                            */

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

/* Steps n parameters in one parallel region of nthreads threads, each parameter on one thread (the parameters shared
 * out dynamically; kinds[i]: 0 lmo_adafactor_step, 1 lmo_came_step; rcs[i]: its return code). A bucket's small
 * matrices take this call: one parameter's own region pays a thread wake-up at each of its passes' barriers, which
 * under OMP_WAIT_POLICY=PASSIVE costs more than a second thread saves below ~1M elements (docs/cpu_kernels.md). Each
 * step is the same as alone: its results do not depend on the thread count. */
int lmo_factored_steps(lmo_fact *const *fs, const int32_t *kinds, int32_t *rcs, int64_t n, int32_t nthreads) {
    int64_t i;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (n < 0) return LMO_EBADARG;
    if (nt > n) nt = n > 0 ? (int)n : 1;
    for (i = 0; i < n; i++) fs[i]->nthreads = 1; /* a team of one inside (a nested region would get one anyway) */
#ifdef _OPENMP
#pragma omp parallel for schedule(dynamic, 1) num_threads(nt)
#endif
    for (i = 0; i < n; i++) rcs[i] = kinds[i] ? lmo_came_step(fs[i]) : lmo_adafactor_step(fs[i]);
    return LMO_OK;
}

/* ------------------------------------------------------------------------------------------------------------------ */
/* Adafactor with torch.optim.Adafactor's semantics (lowmemopt.optim.adafactor.adafactor_torch_math), no first moment,
 * bit for bit: the caller takes every reduction in torch, as torch does (their summation orders are torch's), and
 * these two passes the elementwise rest, each operation rounded as torch's CPU kernel rounds it:
 * lmo_adafactor_torch_u:     u = g rsqrt(max((rf[r] cf[c]) / rmean, eps1^2))   (rf = row_var, cf = col_var;
 *                            h: 0 rmean  1 eps1^2; torch's CPU rsqrt is 1 / sqrt, two roundings)
 * lmo_adafactor_torch_apply: p = fma(u, s, p decay)   (h: 2 s  3 decay: torch's mul_(decay), then add_(u, alpha=s),
 *                            one fused multiply-add; both scalars rounded to fp32 from double, as torch's are) */

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

static void adafactor_torch_u_seg(const lmo_fact *f, int s) {
    const int64_t C = f->C;
    const vf rmean = v_set((float)f->h[0]), eps2 = v_set((float)f->h[1]), one = v_set(1.0f);
    int64_t r0, r1, r, c;
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c += 16) {
            const int64_t i = r * C + c;
            const vf var = v_div(v_mul(v_set(f->rf[r]), v_load(f->cf + c)), rmean);
            v_store(f->u + i, v_mul(v_div(one, v_sqrt(v_max(var, eps2))), load_grad(f->g_dtype, f->g, i, f->g_mult)));
        }
}

int lmo_adafactor_torch_u(const lmo_fact *f) {
    if (fact_check(f) || f->has_m) return LMO_EBADARG;
    fact_for_segments(f, adafactor_torch_u_seg);
    return LMO_OK;
}

static void adafactor_torch_apply_seg(const lmo_fact *f, int s) {
    const int64_t C = f->C;
    const vf scale = v_set((float)f->h[2]), decay = v_set((float)f->h[3]);
    const int pdt = f->p_dtype, decays = (float)f->h[3] != 1.0f;
    int64_t r0, r1, r, c;
    fact_segment(f, s, &r0, &r1);
    for (r = r0; r < r1; r++)
        for (c = 0; c < C; c += 16) {
            const int64_t i = r * C + c;
            vf p = load_dt(pdt, f->p, i);
            if (decays) p = v_mul(p, decay);
            store_dt(pdt, f->p, i, v_fma(v_load(f->u + i), scale, p));
        }
}

int lmo_adafactor_torch_apply(const lmo_fact *f) {
    if (fact_check(f) || f->has_m) return LMO_EBADARG;
    fact_for_segments(f, adafactor_torch_apply_seg);
    return LMO_OK;
}
