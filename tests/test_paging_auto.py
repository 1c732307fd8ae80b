"""page_budget_bytes="auto" (lowmemopt.paging.residency): the resident state chosen from the device's memory (a
mocked reading: torch.cuda.mem_get_info and the allocator's counters), evictions when the peak grows or free memory
falls under the headroom, and the report. CPU parameters stand in for a CUDA device's: the reading is mocked."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from helpers import make_params, run

import lowmemopt
from lowmemopt import paging
from lowmemopt.paging import residency
from lowmemopt.paging.schedule import N_SLOTS_HOST

SHAPES = [(1000,), (300, 100), (64,), (300, 100), (300, 100), (300, 100)]
STATE = [8000, 240000, 512, 240000, 240000, 240000]  # AdamW fp32 state: bytes
MiB = 1 << 20


class FakeDevice:
    """A device's memory as torch.cuda reports it, set by the test."""

    def __init__(self, monkeypatch, total=4 << 30, free=1 << 30, reserved=0, allocated=50 * MiB, peak=100 * MiB):
        self.total, self.free, self.reserved, self.allocated, self.peak = total, free, reserved, allocated, peak
        monkeypatch.setattr(residency, "MEASURED", ("cuda", "cpu"))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (self.free, self.total))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)

    def room(self, nbytes, headroom):
        """Set free memory so that ``nbytes`` are left at the peak beyond ``headroom``."""
        self.free = self.peak - self.reserved + headroom + nbytes


def _pair(**kwargs):
    paged, plain = make_params(SHAPES), make_params(SHAPES)
    return paged, lowmemopt.AdamW(paged, lr=1e-2, paged="cpu", **kwargs), plain, lowmemopt.AdamW(plain, lr=1e-2)


def _same(opt, paged, ref, plain):
    for a, b in zip(paged, plain):
        assert torch.equal(a, b)
        sa, sb = opt.state[a], ref.state[b]
        assert all(torch.equal(sa[k], v) if isinstance(v, torch.Tensor) else sa[k] == v for k, v in sb.items())


def test_auto_keeps_everything_resident_when_it_fits(monkeypatch):
    device = FakeDevice(monkeypatch)
    device.room(sum(STATE), headroom=int(0.1 * device.total))  # exactly the state, at the default headroom
    paged, opt, plain, ref = _pair()
    assert opt.param_groups[0]["page_budget_bytes"] == "auto"
    run(opt, paged, 3)
    run(ref, plain, 3)
    _same(opt, paged, ref, plain)
    assert [paging.where_state_lives(opt, p) for p in paged] == ["device"] * 6
    assert paging.moving_bytes(opt) == 0
    report = opt.paging_report()
    (cpu,) = report.devices
    assert (cpu.resident_bytes, cpu.resident_params, cpu.paged_params, cpu.budget) == (sum(STATE), 6, 0, "auto")
    assert cpu.headroom_bytes == int(0.1 * device.total) and cpu.spare_bytes == 0 and cpu.pool_bytes == 0
    assert "resident 0.9 MiB (6 params)" in str(report)


def test_auto_keeps_the_smallest_states_that_fit_beside_the_in_flight_buffers(monkeypatch):
    """Not everything fits: paging the rest needs the in-flight buffers (a slot per bucket, one parameter each here),
    and the smallest states that fit the room left are kept; one byte less and the third smallest pages too."""
    device = FakeDevice(monkeypatch)
    monkeypatch.setattr(lowmemopt.paging.pager, "_DEFAULT_BUCKET_BYTES", 0)  # one parameter per bucket
    in_flight = N_SLOTS_HOST * 240000
    for spare, resident in [(8000 + 512 + 240000, [0, 1, 2]), (8000 + 512 + 240000 - 1, [0, 2])]:
        device.room(in_flight + spare, headroom=12345)
        paged, opt, plain, ref = _pair(page_headroom_bytes=12345)
        run(opt, paged, 3)
        run(ref, plain, 3)
        _same(opt, paged, ref, plain)
        where = [paging.where_state_lives(opt, p) for p in paged]
        assert where == ["device" if i in resident else "cpu" for i in range(6)], spare
        assert paging.moving_bytes(opt) == sum(STATE) - sum(STATE[i] for i in resident)
        assert opt.paging_report().devices[0].spare_bytes == spare - sum(STATE[i] for i in resident)
        opt.close()


def test_auto_evicts_the_largest_resident_state_when_the_peak_grows(monkeypatch):
    device = FakeDevice(monkeypatch)
    device.room(sum(STATE) + 1000, headroom=0)
    paged, opt, plain, ref = _pair(page_headroom_bytes=0)
    run(opt, paged, 1)
    run(ref, plain, 1)
    room = paging.pager_of(opt).rooms[torch.device("cpu")]
    assert room.spare == 1000 and paging.moving_bytes(opt) == 0
    device.peak = room.peak + 1000 + 200_000  # the workload's peak grew: 200 kB more than the spare
    run(opt, paged, 1, start=1)
    run(ref, plain, 1, start=1)
    _same(opt, paged, ref, plain)
    assert [paging.where_state_lives(opt, p) for p in paged] == ["device", "cpu"] + ["device"] * 4
    report = opt.paging_report().devices[0]
    assert (report.evictions, report.evicted_bytes, report.paged_params) == (1, 240000, 1)
    run(opt, paged, 2, start=2)  # paged from now on, still the same results
    run(ref, plain, 2, start=2)
    _same(opt, paged, ref, plain)
    assert paging.moving_bytes(opt) == 240000


def test_auto_evicts_when_free_memory_falls_under_the_headroom(monkeypatch):
    device = FakeDevice(monkeypatch)
    device.room(sum(STATE), headroom=1 << 20)
    paged, opt, plain, ref = _pair(page_headroom_bytes=1 << 20)
    run(opt, paged, 1)
    run(ref, plain, 1)
    device.free = device.allocated - device.reserved + (1 << 20) - 5000  # another user took memory: 5000 bytes short
    run(opt, paged, 1, start=1)
    run(ref, plain, 1, start=1)
    _same(opt, paged, ref, plain)
    assert [paging.where_state_lives(opt, p) for p in paged] == ["device", "cpu"] + ["device"] * 4


def test_an_eviction_that_fails_is_tried_again_at_the_next_step(monkeypatch, tmp_path):
    """An eviction whose files cannot be made (a full disk) raises from the step before anything changed, and is not
    counted: the next step, with room on the disk again, evicts."""
    device = FakeDevice(monkeypatch)
    device.room(sum(STATE) + 1000, headroom=0)
    paged, plain = make_params(SHAPES), make_params(SHAPES)
    opt = lowmemopt.AdamW(paged, lr=1e-2, paged="disk", offload_dir=tmp_path, page_headroom_bytes=0)
    ref = lowmemopt.AdamW(plain, lr=1e-2)
    run(opt, paged, 1)
    run(ref, plain, 1)
    device.peak = paging.pager_of(opt).rooms[torch.device("cpu")].peak + 1000 + 200_000
    full, reserve = [True], os.posix_fallocate

    def fallocate(fd, offset, length):
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")
        reserve(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)
    with pytest.raises(OSError, match="no space left on the disk"):
        run(opt, paged, 1, start=1)
    assert opt.paging_report().devices[0].evictions == 0 and paging.moving_bytes(opt) == 0
    full[0] = False
    run(opt, paged, 2, start=1)
    run(ref, plain, 2, start=1)
    _same(opt, paged, ref, plain)
    assert [paging.where_state_lives(opt, p) for p in paged] == ["device", "disk"] + ["device"] * 4
    assert opt.paging_report().devices[0].evictions == 1


def test_auto_on_a_device_without_a_reading_pages_everything():
    paged, opt, plain, ref = _pair()
    run(opt, paged, 2)
    assert [paging.where_state_lives(opt, p) for p in paged] == ["cpu"] * 6
    assert opt.paging_report().devices[0].headroom_bytes is None
    assert str(lowmemopt.AdamW(make_params(SHAPES)).paging_report()) == "no paged state"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(page_budget_bytes="all"), "Invalid page_budget_bytes"),
        (dict(page_headroom_bytes=-1), "Invalid page_headroom_bytes"),
        (dict(page_headroom_bytes=0.5), "Invalid page_headroom_bytes"),
        (dict(page_headroom_bytes=True), "Invalid page_headroom_bytes"),
    ],
)
def test_bad_auto_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lowmemopt.AdamW(make_params(SHAPES), paged=True, **kwargs)
