"""lowmemopt.memory: bytes in use and their peak (glibc heap on CPU, the caching allocator on CUDA)."""

import pytest
import torch

from lowmemopt.memory import PeakMemory, live_bytes

needs_heap = pytest.mark.skipif(live_bytes("cpu") is None, reason="no glibc mallinfo2 here")


@needs_heap
def test_live_bytes_follow_allocations():
    before = live_bytes()
    x = torch.empty(4_000_000)  # 16 MB
    during = live_bytes()
    del x
    after = live_bytes()
    assert 16_000_000 <= during - before < 16_500_000
    assert abs(after - before) < 500_000  # freed memory stops counting at once (unlike the resident set size)


@needs_heap
def test_peak_is_the_highest_sample_above_the_baseline():
    meter = PeakMemory("cpu")
    x = torch.empty(2_000_000)  # 8 MB
    meter.sample()
    del x
    y = torch.empty(500_000)  # 2 MB
    meter.sample()
    assert 8_000_000 <= meter.peak < 8_500_000
    del y


def test_unmeasurable_device_gives_none():
    assert live_bytes("meta") is None
    assert PeakMemory("meta").peak is None
