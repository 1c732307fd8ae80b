/* Driver for bench/cpu_instructions.py: #includes lowmemopt/cpu/csrc/library.c (path in KERNELS), calls one kernel on one
 * parameter of N fp32 elements (N / 1024 rows of 1024 for the factored steps) once to fill its state, then again
 * inside cg_measure (callgrind counts only there); with a third argument, that many more calls, printing the fastest
 * one's time per element. argv: configuration, the tables file the runner wrote, [repeats]. */
#include KERNELS
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static int iters = 1;

static float book8[2][256]; static uint8_t planes8[2][1024]; static int32_t packed8[2][65536]; static lmo_pow2 pw[2];
static float book4[2][16], thr4[2][16]; static int32_t packed4[2][65536];
#ifndef N
#define N (1024 * 1024)
#endif
#define NR (N / 1024)
#define NC 1024

__attribute__((noinline)) int cg_measure(int (*fn)(const void *), const void *a) { return fn(a); }

/* the counted call; with iters > 1, that many, printing the fastest one's time per element */
static int measure(const char *cfg, int (*fn)(const void *), const void *a) {
    double best = 1e30;
    int it;
    for (it = 0; it < iters; it++) {
        double t = now();
        if (cg_measure(fn, a)) return 1;
        t = now() - t;
        if (t < best) best = t;
    }
    if (iters > 1) printf("%s %.4f\n", cfg, best * 1e9 / N);
    return 0;
}

static uint32_t rs = 12345;
static float frand(void) { rs = rs * 1664525u + 1013904223u; return ((rs >> 8) / 16777216.0f) * 2.0f - 1.0f; }

int main(int argc, char **argv) {
    FILE *f = fopen(argv[2], "rb");
    int s;
    for (s = 0; s < 2; s++) {
        if (fread(book8[s], 4, 256, f) != 256 || fread(planes8[s], 1, 1024, f) != 1024 ||
            fread(packed8[s], 4, 65536, f) != 65536 || fread(&pw[s], sizeof(lmo_pow2), 1, f) != 1) return 2;
    }
    for (s = 0; s < 2; s++) {
        if (fread(book4[s], 4, 16, f) != 16 || fread(thr4[s], 4, 16, f) != 16 || fread(packed4[s], 4, 65536, f) != 65536) return 2;
    }
    fclose(f);
    const char *cfg = argv[1];
    if (argc > 3) iters = atoi(argv[3]);
    float *p = malloc(4 * N), *g = malloc(4 * N);
    uint16_t *pb = malloc(2 * N), *gb = malloc(2 * N);
    int i;
    for (i = 0; i < N; i++) { p[i] = frand() * 0.02f; g[i] = frand() * 1e-3f; pb[i] = (uint16_t)(*(uint32_t *)&p[i] >> 16); gb[i] = (uint16_t)(*(uint32_t *)&g[i] >> 16); }
    int bits = strstr(cfg, "q8") ? 8 : strstr(cfg, "q4") ? 4 : 32;
    int bs = bits == 8 ? 256 : bits == 4 ? 128 : 64;
    lmo_slot sl[3];
    memset(sl, 0, sizeof sl);
    for (s = 0; s < 3; s++) {
        int sg = s == 0; /* exp_avg signed, exp_avg_sq unsigned */
        if (strncmp(cfg, "lion", 4) == 0 || strncmp(cfg, "sgd", 3) == 0) sg = 1;
        if (bits == 32) {
            float *d = malloc(4 * N); for (i = 0; i < N; i++) d[i] = sg ? frand() * 1e-3f : 1e-7f * (1.5f + frand());
            sl[s].data = d; sl[s].kind = ST_F32;
        } else {
            uint8_t *d = calloc(bits == 8 ? N : N / 2, 1); float *am = calloc(N / bs, 4);
            sl[s].data = d; sl[s].absmax = am; sl[s].is_signed = sg;
            if (bits == 8) { sl[s].kind = ST_Q8; sl[s].book = book8[sg]; sl[s].planes = planes8[sg]; sl[s].packed = packed8[sg]; sl[s].pow2 = &pw[sg]; }
            else { sl[s].kind = ST_Q4; sl[s].book = book4[sg]; sl[s].thr = thr4[sg]; sl[s].packed = packed4[sg]; }
        }
    }
    if (strcmp(cfg, "scan") == 0) { /* the non-finite check alone: the fp32 sum of squares of g */
        static float ss;
        lmo_args a;
        memset(&a, 0, sizeof a);
        a.bs = 16; a.nthreads = 1; a.scan = g; a.scan_n = N; a.scan_dtype = DT_F32; a.scan_sumsq = &ss;
        if (lmo_scan(&a)) return 3;
        return measure(cfg, (int (*)(const void *))lmo_scan, &a) ? 3 : 0;
    }
    if (strncmp(cfg, "adam", 4) == 0 || strncmp(cfg, "lion", 4) == 0 || strncmp(cfg, "sgd", 3) == 0) {
        lmo_args a; memset(&a, 0, sizeof a);
        int bf = strstr(cfg, "bf16") != NULL;
        a.p = bf ? (void *)pb : (void *)p; a.g = bf ? (void *)gb : (void *)g; a.p_dtype = a.g_dtype = bf ? DT_BF16 : DT_F32;
        a.nrows = N / bs; a.bs = bs; a.nthreads = 1;
        int (*fn)(const lmo_args *);
        if (cfg[0] == 'a') {
            double h[8] = {0, 0.1, 0.999, 0.001, 0.0316, 1e-8, -1e-3 / 0.19, 1 - 1e-5};
            memcpy(a.h, h, sizeof h); a.nslots = 2; fn = lmo_adam;
        } else if (cfg[0] == 'l') {
            double h[6] = {0.9, 0.1, 0.99, 0.01, -1e-4, 1 - 1e-5};
            memcpy(a.h, h, sizeof h); a.nslots = 1; fn = lmo_lion;
        } else {
            double h[5] = {0, 0.9, 1.0, -1e-2, 1.0};
            memcpy(a.h, h, sizeof h); a.nslots = 1; a.flags = 8; fn = lmo_sgd;
        }
        for (s = 0; s < a.nslots; s++) a.slot[s] = sl[s];
        if (strstr(cfg, "scan")) { static float ss; a.scan = g; a.scan_n = N; a.scan_dtype = DT_F32; a.scan_sumsq = &ss; }
        if (fn(&a)) return 3;
        if (measure(cfg, (int (*)(const void *))fn, &a)) return 3;
    } else {
        lmo_fact fa; memset(&fa, 0, sizeof fa);
        float *rf = malloc(4 * NR), *cf = malloc(4 * NC), *u = malloc(4 * (size_t)N);
        float *vr = malloc(4 * NR), *vc = malloc(4 * NC), *vr2 = malloc(4 * NR), *vc2 = malloc(4 * NC);
        float *rf2 = malloc(4 * NR), *cf2 = malloc(4 * NC);
        double *work = malloc(8 * LMO_NSEG * (NC + 1)), res[1];
        for (i = 0; i < NR; i++) { vr[i] = 1e-6f * (1.5f + frand()); vr2[i] = 1e-9f * (1.5f + frand()); }
        for (i = 0; i < NC; i++) { vc[i] = 1e-6f * (1.5f + frand()); vc2[i] = 1e-9f * (1.5f + frand()); }
        fa.p = p; fa.g = g; fa.R = NR; fa.C = NC; fa.p_dtype = fa.g_dtype = DT_F32; fa.nthreads = 1; fa.bs = bits == 32 ? 16 : bs;
        fa.rf = rf; fa.cf = cf; fa.rf2 = rf2; fa.cf2 = cf2; fa.u = u; fa.work = work; fa.result = res;
        fa.vr = vr; fa.vc = vc; fa.vr2 = vr2; fa.vc2 = vc2;
        /* eps1, beta2, beta1, 1 - beta1, decay (-wd lr; Adafactor: -wd with flag 2), clip, lr (Adafactor: rho), eps2, beta3 */
        double h[12] = {1e-30, 0.999, 0.9, 0.1, -1e-6, 1.0, 1e-4, 1e-3, 0.9999, 0, 0, 0};
        memcpy(fa.h, h, sizeof h);
        int (*fn)(const lmo_fact *);
        if (strstr(cfg, "torch")) { /* AdafactorTorch's passes: rf, cf its row / column EMAs; rmean, eps1^2, s, decay */
            memcpy(rf, vr, 4 * NR); memcpy(cf, vc, 4 * NC);
            fa.h[0] = 1e-6; fa.h[1] = 1.4e-14; fa.h[2] = -1e-4; fa.h[3] = 1 - 1e-6;
            if (lmo_adafactor_torch_u(&fa)) return 3;
            fn = strstr(cfg, "apply") ? lmo_adafactor_torch_apply : lmo_adafactor_torch_u;
        } else if (strstr(cfg, "afstep")) { fn = lmo_adafactor_step; fa.flags = 2; fa.h[4] = -1e-2; }
        else fn = lmo_came_step;
        if (bits != 32 || strstr(cfg, "came")) { fa.has_m = 1; fa.m = sl[0]; if (bits == 32) fa.m.kind = ST_F32; }
        if (strstr(cfg, "check")) fa.flags |= 4; /* the step's own non-finite check in pass 1 */
        if (fn(&fa)) return 3;
        if (measure(cfg, (int (*)(const void *))fn, &fa)) return 3;
    }
    return 0;
}
