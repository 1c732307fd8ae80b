"""Many files read into tensors or written from them in one call on the OpenMP threads the CPU kernels run on
(``csrc/fileio.c``, 1 MiB pieces in turns across the files): the disk tier of paged CPU state, between two updates
(why: docs/paging.md#how-a-step-runs).
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


def copy_files(
    requests: list[tuple[str, torch.Tensor, bool]], nthreads: int | None = None
) -> list[OSError | None] | None:
    """For each ``(path, t, write)``: write contiguous CPU ``t``'s bytes to ``path`` from offset 0, or read them into
    ``t``, all at once over ``nthreads`` threads (default: torch's).

    Returns:
        Per request None or its OSError (the others still run); None instead of the list without the native library.
    """
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
