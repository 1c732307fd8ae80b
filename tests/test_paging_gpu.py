"""Paged state with CUDA parameters: side-stream prefetch, asynchronous write-back on another stream (both copy
engines at once), page-locked homes, the slots and staging buffers, the budget and ``page_budget_bytes="auto"``.
Skipped without a CUDA device (conftest.py skips the ``gpu`` marker). Tests of paging pass ``page_budget_bytes=0``:
the default ("auto") keeps everything resident on a GPU with room."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_params, set_grads
from optim_info import BY_NAME, STATEFUL

import lowmemopt
from lowmemopt import paging
from lowmemopt.paging.schedule import N_SLOTS
from lowmemopt.pipeline import PAGE_BUCKET_BYTES

pytestmark = pytest.mark.gpu

SHAPES = [(300,), (37, 53), (5, 7, 129), (256, 300), (70, 91)]


def _cuda_params(shapes=SHAPES, seed=0):
    return [torch.nn.Parameter(p.detach().cuda()) for p in make_params(shapes, seed=seed)]


def _run(opt, params, steps, start=0):
    for t in range(start, start + steps):
        cpu = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        set_grads(cpu, t)
        for p, c in zip(params, cpu):
            p.grad = c.grad.cuda()
        opt.step()


def _same(opt_a, pa, opt_b, pb):
    torch.cuda.synchronize()
    for a, b in zip(pa, pb):
        assert torch.equal(a, b)
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert sa.keys() == sb.keys()
        for k, v in sb.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(sa[k].cpu(), v.cpu()), k
            else:
                assert sa[k] == v


@pytest.mark.parametrize("tier", ["cpu", "disk"])
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "LAMB", "Adafactor", "CAME"])
def test_cuda_paged_steps_are_bit_identical(name, bits, tier, tmp_path):
    info, kwargs = BY_NAME[name], STATEFUL[name]
    paged, plain = _cuda_params(), _cuda_params()
    opt = info.cls(paged, state_bits=bits, paged=tier, offload_dir=tmp_path, page_budget_bytes=0, **kwargs)
    ref = info.cls(plain, state_bits=bits, **kwargs)
    _run(opt, paged, 4)
    _run(ref, plain, 4)
    _same(opt, paged, ref, plain)
    for p in paged:
        assert paging.where_state_lives(opt, p) == tier
        homes = [v for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
        assert all(v.device.type == "cpu" for v in homes)
        if tier == "cpu":
            assert all(v.is_pinned() for v in homes if v.numel())


def test_budget_keeps_small_state_resident_and_bounds_device_memory(tmp_path):
    """AdamW 32-bit over 8 matrices of 4M elements (256 MiB of state) and 4 vectors: with a budget of the vectors'
    state plus 16 MiB, the vectors stay resident (smallest first) and no matrix fits. During a step the device holds
    at most its slots (a bucket each: the one updating, the next arriving, the last being written back) beyond the
    resident state; between steps the slots stay (reused by the next step, the first one already on its way)."""
    shapes = [(1024, 4096)] * 8 + [(4096,)] * 4
    params = _cuda_params(shapes)
    budget = 4 * 4096 * 8 + (16 << 20)
    opt = lowmemopt.AdamW(params, lr=1e-3, paged="cpu", page_budget_bytes=budget)
    _run(opt, params, 1)
    where = [paging.where_state_lives(opt, p) for p in params]
    assert where[8:] == ["device"] * 4 and where[:8] == ["cpu"] * 8
    mover = paging.pager_of(opt).movers[params[0].device]
    slots = N_SLOTS * mover.slot_bytes
    assert mover.slot_bytes <= max(PAGE_BUCKET_BYTES, 1024 * 4096 * 8) + (1 << 20)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated() - mover.pool_bytes()
        ptrs = [s.data_ptr() for s in mover.slots if s is not None]
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= slots + (8 << 20), (peak, slots)
        assert [s.data_ptr() for s in mover.slots if s is not None][: len(ptrs)] == ptrs  # reused, never grown
    assert torch.cuda.memory_allocated() - base <= slots + (1 << 20)  # between steps: the slots


def test_no_device_synchronize_in_a_paged_step(monkeypatch, tmp_path):
    """The cpu tier waits on nothing on the host during a step (streams wait on events); reading the state waits for
    the write-backs' events, never for the whole device."""
    params = _cuda_params([(512, 512)] * 12)
    opt = lowmemopt.AdamW(params, lr=1e-3, state_bits=8, paged="cpu", page_budget_bytes=0)
    _run(opt, params, 1)
    counts = {"device": 0, "event": 0, "stream": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: counts.__setitem__("device", counts["device"] + 1))
    real_event_sync, real_stream_sync = torch.cuda.Event.synchronize, torch.cuda.Stream.synchronize

    def event_sync(self):
        counts["event"] += 1
        return real_event_sync(self)

    def stream_sync(self):
        counts["stream"] += 1
        return real_stream_sync(self)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", event_sync)
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", stream_sync)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert counts == {"device": 0, "event": 0, "stream": 0}
    opt.state_dict()
    assert counts["device"] == 0


def test_both_copy_directions_run_at_once(tmp_path):
    """A profiled paged step (AdamW 8-bit, 24 matrices of 4M elements, buckets of about PAGE_BUCKET_BYTES): the
    write-back of a bucket (device to host) overlaps the prefetch of a later one (host to device), so the two copy
    engines work at the same time; copies are coalesced (about one per bucket each way, not one per tensor)."""
    params = _cuda_params([(2048, 2048)] * 24)
    opt = lowmemopt.AdamW(params, lr=1e-3, state_bits=8, paged="cpu", page_budget_bytes=0)
    _run(opt, params, 2)
    for p in params:
        p.grad = torch.randn_like(p)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    copies = {"HtoD": [], "DtoH": []}
    for e in prof.events():
        for way in copies:
            if way in e.name:
                copies[way].append((e.time_range.start, e.time_range.end))
    assert copies["HtoD"] and copies["DtoH"], [e.name for e in prof.events()][:50]
    overlap = sum(max(0, min(a1, b1) - max(a0, b0)) for a0, a1 in copies["HtoD"] for b0, b1 in copies["DtoH"])
    assert overlap > 0, copies
    moved = paging.moving_bytes(opt)
    buckets = -(-moved // PAGE_BUCKET_BYTES)
    assert len(copies["HtoD"]) <= 2 * buckets + 2 and len(copies["DtoH"]) <= 2 * buckets + 2, (copies, buckets)


def test_auto_budget_keeps_the_state_resident_when_it_fits_and_pages_under_a_large_headroom(tmp_path):
    """page_budget_bytes="auto" (the default): on a GPU with room the whole state stays resident and the step is the
    unpaged one (bit-identical, nothing moves); with a headroom as large as the device, everything pages."""
    info, kwargs = BY_NAME["AdamW"], STATEFUL["AdamW"]
    roomy, tight, plain = _cuda_params(), _cuda_params(), _cuda_params()
    total = torch.cuda.get_device_properties(0).total_memory
    opt = info.cls(roomy, state_bits=8, paged="cpu", **kwargs)
    small = info.cls(tight, state_bits=8, paged="disk", offload_dir=tmp_path, page_headroom_bytes=total, **kwargs)
    ref = info.cls(plain, state_bits=8, **kwargs)
    for o, ps in ((opt, roomy), (small, tight), (ref, plain)):
        _run(o, ps, 3)
    _same(opt, roomy, ref, plain)
    _same(small, tight, ref, plain)
    assert all(paging.where_state_lives(opt, p) == "device" for p in roomy) and paging.moving_bytes(opt) == 0
    assert all(paging.where_state_lives(small, p) == "disk" for p in tight)
    report = opt.paging_report().devices[0]
    assert report.budget == "auto" and report.paged_params == 0 and report.headroom_bytes == int(0.1 * total)


def test_cuda_parameter_moved_to_cpu_is_a_clear_error(tmp_path):
    params = _cuda_params()
    opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, paged="disk", offload_dir=tmp_path, page_budget_bytes=0)
    _run(opt, params, 2)
    before = {k: v.clone() for k, v in opt.state_dict()["state"][1].items() if isinstance(v, torch.Tensor)}
    params[1].data = params[1].data.cpu()
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="moved from cuda:0 to cpu"):
        opt.step()
    params[1].data = params[1].data.cuda()
    after = opt.state_dict()["state"][1]
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_load_state_dict_keeps_cuda_state_paged_and_close_frees_everything(tmp_path):
    params = _cuda_params()
    base = torch.cuda.memory_allocated()
    opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, paged="disk", offload_dir=tmp_path, page_budget_bytes=0)
    _run(opt, params, 2)
    sd = opt.state_dict()
    assert all(
        v.device.type == "cpu" for st in sd["state"].values() for v in st.values() if isinstance(v, torch.Tensor)
    )
    opt.load_state_dict(sd)
    assert all(paging.where_state_lives(opt, p) == "disk" for p in params)
    _run(opt, params, 1, start=2)
    torch.cuda.synchronize()
    pool = paging.pager_of(opt).movers[params[0].device].pool_bytes()  # (slots; staging is pinned host memory)
    staging = sum(b.numel() for b in paging.pager_of(opt).movers[params[0].device].stagings if b is not None)
    assert torch.cuda.memory_allocated() - base < pool - staging + (1 << 20)  # between steps: the slots only
    opt.close()
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []
    assert not paging.pager_of(opt).homes._owned
