"""Many files read into tensors or written from them in one call, on the OpenMP threads the CPU kernels run on
(``csrc/fileio.c``).

The disk tier of paged state (:mod:`lowmemopt.paging`) copies a bucket's state between its files and a working buffer
around the bucket's update. On a CPU device the update keeps every thread torch gives it busy; an I/O thread beside
it competes with the update for those cores (and with the OpenMP workers, which spin for a while at the end of each
parallel region), while these copies, on the same threads between two updates, keep every core busy with one thing
at a time. Requests are cut into 1 MiB pieces, handed out to the threads in turns across the files.
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import build

__all__ = ["Request", "copy_files"]


class Request(ctypes.Structure):
    """``lmo_io`` of ``csrc/lmo.h``."""

    _fields_ = [
        ("fd", ctypes.c_int32),
        ("write", ctypes.c_int32),
        ("offset", ctypes.c_int64),
        ("buf", ctypes.c_void_p),
        ("nbytes", ctypes.c_int64),
        ("err", ctypes.c_int32),
        ("pad", ctypes.c_int32),
    ]


def copy_files(requests: list[tuple[str, torch.Tensor, bool]], nthreads: int | None = None
               ) -> list[OSError | None] | None:
    """For each ``(path, t, write)``: write contiguous CPU tensor ``t``'s bytes to the file at ``path`` from offset 0
    (``write``), or read them from there into ``t``, all at once over ``nthreads`` threads (default: torch's).

    Returns, per request, None or the OSError it failed with (the other requests are carried out all the same); None
    instead of the list when the native library is not available (the caller copies another way)."""
    lib = build.library()
    if lib is None:
        return None
    errors: list[OSError | None] = [None] * len(requests)
    reqs, fds, owners = [], [], []
    try:
        for k, (path, t, write) in enumerate(requests):
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("copy_files() takes contiguous CPU tensors")
            nbytes = t.numel() * t.element_size()
            if nbytes == 0:
                continue
            try:
                fd = os.open(path, os.O_RDWR if write else os.O_RDONLY)
            except OSError as e:
                errors[k] = e
                continue
            fds.append(fd)
            reqs.append(Request(fd, int(write), 0, t.data_ptr(), nbytes, 0, 0))
            owners.append(k)
        if reqs:
            arr = (Request * len(reqs))(*reqs)
            threads = torch.get_num_threads() if nthreads is None else nthreads
            rc = lib.lmo_file_io(arr, ctypes.c_int64(len(reqs)), ctypes.c_int32(threads))
            if rc != 0:
                raise RuntimeError(f"lowmemopt C kernel lmo_file_io rejected its arguments (code {rc})")
            for r, k in zip(arr, owners):
                if r.err:
                    path, _, write = requests[k]
                    what = "writing" if write else "reading"
                    errors[k] = OSError(r.err, f"{os.strerror(r.err)} ({what} {path})", path)
    finally:
        for fd in fds:
            os.close(fd)
    return errors
