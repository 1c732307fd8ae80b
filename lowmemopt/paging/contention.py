"""How much of this process's CPUs other processes are using: where the disk tier copies a CPU bucket's files
(:meth:`~.engine.HostLanes.files_here`).

The update of CPU parameters keeps every thread torch gives it busy. On CPUs of its own, the files are best copied
between the updates on those same threads; on CPUs that other processes share, an OpenMP team waits at the end of each
copy for whichever of its threads was preempted, and a reader and a writer thread beside the update do better (more
threads of ours get more of the CPUs' time). Measured on 2 cores, 148M parameters (``docs/paging.md``): paging's cost
over its read + write floor 1.02-1.05x against 1.30-1.34x idle, 1.76-2.30x against 1.18-1.32x with one busy process
beside it. The share of the CPUs other processes used is sampled from ``/proc/stat`` (the CPUs this process may run
on) less this process's own CPU time, over at least :data:`WINDOW` seconds; elsewhere nothing is known and the files
go on the update's threads.
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
    """CPU time the CPUs ``cpus`` spent busy since boot (user, nice, system, irq, softirq), or None where
    ``/proc/stat`` is not there."""
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
    """Are other processes busy on this process's CPUs (more than :data:`BUSY_CORES` cores' time over the last
    window)? The sources are arguments for tests."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 busy: Callable[[set[int]], float | None] = _busy_seconds, own: Callable[[], float] = _own_seconds,
                 cpus: Callable[[], set[int]] = _cpus) -> None:
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
