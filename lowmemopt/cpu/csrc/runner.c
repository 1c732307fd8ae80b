/* The row runner: one parameter's rows in parallel chunks (run_rows, its tail, the scan of another gradient beside
 * them) and a bucket of parameters in one parallel region (run_many); the library's ABI and ISA. */
#include "lmo.h"

int lmo_abi_version(void) { return LMO_ABI_VERSION; }

int lmo_isa(void) { return LMO_ISA; }

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
