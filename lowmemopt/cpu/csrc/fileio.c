/* ------------------------------------------------------------------------------------------------------------------ */
/* Files read into memory and written from it, many requests at once, on the OpenMP threads (lowmemopt/cpu/fileio.py):*/
/* the disk tier of paged state on a CPU device whose cores the update's threads all take (lowmemopt/paging/engine).  */
/* A bucket's update and its files' copies take turns on the same threads, so no I/O thread competes with the update  */
/* for the cores, nor with the OpenMP workers, which spin for a while at the end of each parallel region.             */
/*                                                                                                                    */
/* Each request is cut into pieces of LMO_IO_PIECE bytes, handed out from a shared counter (a thread that the OS      */
/* preempts holds up the others for one piece at most), the requests' pieces in turns: piece 0 of every request,     */
/* then piece 1, ..., so that the threads write different files where they can (a buffered write locks its file:      */
/* measured, two threads writing pieces of the same files in order took 1.4x the time of these turns). A piece loops  */
/* over short transfers and EINTR. A failed piece keeps its errno in its request (the first failure of the request    */
/* wins; EIO where a read finds the file ending before the piece); the other requests go on.                          */

#include <errno.h>
#include <unistd.h>

#define LMO_IO_PIECE ((int64_t)1 << 20)

static int io_piece(const lmo_io *r, int64_t lo, int64_t hi) {
    char *buf = (char *)r->buf;
    while (lo < hi) {
        const size_t n = (size_t)(hi - lo);
        const ssize_t got = r->write ? pwrite(r->fd, buf + lo, n, (off_t)(r->offset + lo))
                                     : pread(r->fd, buf + lo, n, (off_t)(r->offset + lo));
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        if (got == 0) return EIO; /* a read past the end of the file; a write that wrote nothing */
        lo += got;
    }
    return 0;
}

int lmo_file_io(lmo_io *req, int64_t n, int32_t nthreads) {
    int64_t k, j, total = 0, most = 0, at = 0, next = 0, *order;
    int nt = nthreads < 1 ? 1 : nthreads;
    if (n < 0) return LMO_EBADARG;
    for (k = 0; k < n; k++) {
        if (req[k].nbytes < 0 || req[k].offset < 0 || (req[k].nbytes && !req[k].buf)) return LMO_EBADARG;
        req[k].err = 0;
        j = (req[k].nbytes + LMO_IO_PIECE - 1) / LMO_IO_PIECE;
        total += j;
        if (j > most) most = j;
    }
    if (total == 0) return LMO_OK;
    /* the pieces in turns (see above); each entry is request * most + piece */
    order = malloc(sizeof *order * total);
    if (!order) return LMO_EBADARG;
    for (j = 0; j < most; j++)
        for (k = 0; k < n; k++)
            if (j * LMO_IO_PIECE < req[k].nbytes) order[at++] = k * most + j;
    if (total < nt) nt = (int)total;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
        int64_t i;
        while ((i = __atomic_fetch_add(&next, 1, __ATOMIC_RELAXED)) < total) {
            const int64_t r = order[i] / most, lo = order[i] % most * LMO_IO_PIECE;
            const int64_t hi = lo + LMO_IO_PIECE < req[r].nbytes ? lo + LMO_IO_PIECE : req[r].nbytes;
            const int e = io_piece(&req[r], lo, hi);
            if (e) {
                int32_t none = 0;
                __atomic_compare_exchange_n(&req[r].err, &none, (int32_t)e, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            }
        }
    }
    free(order);
    return LMO_OK;
}
