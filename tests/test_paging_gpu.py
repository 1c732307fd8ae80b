"""Paged state with CUDA parameters: side-stream prefetch, asynchronous write-back, page-locked homes, the budget.
Skipped without a CUDA device (conftest.py skips the ``gpu`` marker)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import make_params, set_grads
from optim_info import BY_NAME, STATEFUL

import lowmemopt
from lowmemopt import paging

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
    opt = info.cls(paged, state_bits=bits, paged=tier, offload_dir=tmp_path, **kwargs)
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
    at most three matrices' state at once (the one updating, the next arriving, the last being written back)."""
    shapes = [(1024, 4096)] * 8 + [(4096,)] * 4
    params = _cuda_params(shapes)
    budget = 4 * 4096 * 8 + (16 << 20)
    opt = lowmemopt.AdamW(params, lr=1e-3, paged="cpu", page_budget_bytes=budget)
    _run(opt, params, 1)
    where = [paging.where_state_lives(opt, p) for p in params]
    assert where[8:] == ["device"] * 4 and where[:8] == ["cpu"] * 8
    one = 1024 * 4096 * 8  # one matrix's state (exp_avg + exp_avg_sq, fp32)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        assert peak <= 3 * one + (8 << 20), (peak, one)
    assert torch.cuda.memory_allocated() - base < 1 << 20  # between steps: only the resident vectors' state


def test_no_device_synchronize_per_parameter(monkeypatch, tmp_path):
    """The cpu tier waits on nothing on the host during a step (streams wait on events); the disk tier waits only
    when more than MAX_DEFERRED write-backs are outstanding."""
    params = _cuda_params([(512, 512)] * 12)
    opt = lowmemopt.AdamW(params, lr=1e-3, state_bits=8, paged="cpu")
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
    opt.state_dict()  # reading homes on the host waits for the write-backs: events, not the device
    assert counts["device"] == 0 and counts["event"] > 0


def test_cuda_parameter_moved_to_cpu_is_a_clear_error(tmp_path):
    params = _cuda_params()
    opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, paged="disk", offload_dir=tmp_path)
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
    opt = lowmemopt.AdamW(params, lr=1e-2, state_bits=8, paged="disk", offload_dir=tmp_path)
    _run(opt, params, 2)
    sd = opt.state_dict()
    assert all(v.device.type == "cpu" for st in sd["state"].values() for v in st.values() if isinstance(v, torch.Tensor))
    opt.load_state_dict(sd)
    assert all(paging.where_state_lives(opt, p) == "disk" for p in params)
    _run(opt, params, 1, start=2)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base < 1 << 20  # no state stays on the device between steps
    opt.close()
    assert [f for _, _, fs in os.walk(tmp_path) for f in fs] == []
    assert not paging.pager_of(opt).homes._owned
