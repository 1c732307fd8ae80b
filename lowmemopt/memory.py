"""Measuring the memory a training run holds: bytes in use now, and the peak over a run.

* CUDA: the caching allocator's own counters (``torch.cuda.memory_allocated`` / ``max_memory_allocated``): exact.
* CPU on glibc (Linux): bytes in use in the C heap, ``mallinfo2().uordblks + hblkhd`` (arena chunks in use plus
  mmap-ed chunks; PyTorch's CPU allocator is ``posix_memalign``). It counts every live CPU tensor exactly (plus a small
  header each, and whatever else the process mallocs), and, unlike the resident set size, falls as soon as memory is
  freed, so runs measured one after another in one process do not see each other. There is no allocator hook to catch
  the exact CPU peak, so :class:`PeakMemory` takes the maximum of the samples it is given (the demo samples after
  forward, backward and the optimizer step of every step).
* Elsewhere (macOS, musl): not available; :func:`live_bytes` returns None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable

import torch

__all__ = ["PeakMemory", "live_bytes", "proc_status_bytes", "reset_peak_rss"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _glibc_heap_reader() -> Callable[[], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallinfo2 = libc.mallinfo2  # glibc >= 2.33
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    mallinfo2.argtypes = []

    def read() -> int:
        info = mallinfo2()
        return info.uordblks + info.hblkhd

    return read


_heap_in_use = _glibc_heap_reader()


def live_bytes(device: torch.device | str = "cpu") -> int | None:
    """Bytes in use on ``device`` now (see the module docstring), or None where that cannot be measured."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "cpu" and _heap_in_use is not None:
        return _heap_in_use()
    return None


class PeakMemory:
    """The peak of the memory in use on ``device`` since construction, above what was in use at construction.

    ``sample()`` records the current figure (CPU); on CUDA the allocator tracks the true peak and samples are not
    needed. ``peak`` is None where memory cannot be measured."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = live_bytes(self.device)
        self._max = self.baseline

    def sample(self) -> None:
        if self.device.type == "cuda" or self._max is None:
            return
        self._max = max(self._max, live_bytes(self.device))

    @property
    def peak(self) -> int | None:
        if self.baseline is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return self._max - self.baseline


# ---------------------------------------------------------------------------------------------------------------------
# the process's resident set (Linux /proc): what the paging and checkpoint-loading memory tests and bench/paging.py read


def proc_status_bytes(field: str) -> int:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes. Linux only (OSError elsewhere);
    KeyError if the field is missing."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset the peak resident set (``VmHWM``) to the current one (``/proc/self/clear_refs``, Linux only)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
