"""Measuring the memory a run holds, now and at its peak: on CUDA the caching allocator's counters (exact); on the
CPU with glibc the C heap in use (``mallinfo2().uordblks + hblkhd``: every live tensor, and it falls as soon as memory
is freed, unlike the RSS), whose peak is the maximum of the samples :class:`PeakMemory` is given; elsewhere None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Callable

import torch

__all__ = ["PeakMemory", "live_bytes", "proc_status_bytes", "reset_peak_rss"]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


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
    """Bytes in use on ``device`` now, or None where that cannot be measured."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    if device.type == "cpu" and _heap_in_use is not None:
        return _heap_in_use()
    return None


class PeakMemory:
    """The peak memory in use on ``device`` since construction, above that at construction."""

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
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes (Linux; OSError elsewhere)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset the peak resident set (``VmHWM``) to the current one (``/proc/self/clear_refs``, Linux only)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
