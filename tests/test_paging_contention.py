"""lowmemopt.paging.contention: whether other processes are busy on this process's CPUs, from the CPUs' busy time
less this process's own, over a window (the disk tier then copies its files on I/O threads)."""

from __future__ import annotations

import sys

import pytest

from lowmemopt.paging import contention
from lowmemopt.paging.contention import BUSY_CORES, WINDOW, CpuShare


class _Sources:
    """A clock, the CPUs' busy seconds and this process's CPU seconds, moved by the test."""

    def __init__(self):
        self.now, self.busy, self.own, self.seen = 100.0, 5000.0, 20.0, []

    def share(self):
        def busy(cpus):
            self.seen.append(cpus)
            return self.busy

        return CpuShare(clock=lambda: self.now, busy=busy, own=lambda: self.own, cpus=lambda: {0, 1})

    def advance(self, seconds, ours, others):
        self.now += seconds
        self.own += ours * seconds
        self.busy += (ours + others) * seconds


def test_others_busy_counts_the_cpus_time_less_our_own():
    src = _Sources()
    share = src.share()
    assert share.others_busy() is False  # (the first sample: nothing to compare with)
    src.advance(1.0, ours=2.0, others=0.1)  # our own two busy threads are not contention
    assert share.others_busy() is False and share.others == pytest.approx(0.1)
    src.advance(1.0, ours=1.5, others=0.9)
    assert share.others_busy() is True and share.others == pytest.approx(0.9)
    src.advance(WINDOW / 2, ours=2.0, others=0.0)  # within the window: the last decision holds, nothing is read
    reads = len(src.seen)
    assert share.others_busy() is True and len(src.seen) == reads
    src.advance(WINDOW, ours=2.0, others=BUSY_CORES / 2)
    assert share.others_busy() is False
    assert src.seen[-1] == {0, 1}


def test_nothing_known_means_not_busy():
    share = CpuShare(busy=lambda cpus: None)
    assert share.others_busy() is False and share.others_busy() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_the_cpus_busy_time_is_read_for_the_cpus_asked():
    every = contention._busy_seconds(contention._cpus())
    assert every is not None and every > 0
    assert contention._busy_seconds({10**6}) is None  # no such CPU
