"""How much of this process's CPUs other processes use (``/proc/stat`` less our own CPU time, over :data:`WINDOW`
seconds): it decides where the disk tier copies a CPU bucket's files (:meth:`~.engine.HostLanes.files_here`). On CPUs
of its own, the update's threads copy best; beside a busy process, an OpenMP team waits for its preempted threads, and
reader and writer threads do better (measured: docs/paging.md#measurements).
"""

from __future__ import annotations

import os
import time
from typing import Callable

__all__ = ["CpuShare", "BUSY_CORES", "WINDOW"]

#: other processes using more than this many cores' time make the disk tier copy its files on I/O threads
BUSY_CORES = 0.25
#: seconds between two samples (a decision holds until the next one)
WINDOW = 0.5


def _busy_seconds(cpus: set[int]) -> float | None:
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    ticks, total, found = os.sysconf("SC_CLK_TCK"), 0, False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in rest.split()[:7])
        total += user + nice + system + irq + softirq
        found = True
    return total / ticks if found else None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def _cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


class CpuShare:
    """Whether other processes are busy on this process's CPUs (over :data:`BUSY_CORES` cores' time)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        busy: Callable[[set[int]], float | None] = _busy_seconds,
        own: Callable[[], float] = _own_seconds,
        cpus: Callable[[], set[int]] = _cpus,
    ) -> None:
        self._clock, self._busy, self._own, self._cpus = clock, busy, own, cpus
        self._last: tuple[float, float, float] | None = None  # (clock, busy, own) at the last sample
        self.others = 0.0  # cores' time other processes used over the last window
        self.busy = False

    def others_busy(self) -> bool:
        now = self._clock()
        if self._last is not None and now - self._last[0] < WINDOW:
            return self.busy
        busy = self._busy(self._cpus())
        if busy is None:  # (nothing known: not Linux)
            return False
        own = self._own()
        if self._last is not None:
            then, busy_then, own_then = self._last
            self.others = max(0.0, (busy - busy_then) - (own - own_then)) / (now - then)
            self.busy = self.others > BUSY_CORES
        self._last = (now, busy, own)
        return self.busy
