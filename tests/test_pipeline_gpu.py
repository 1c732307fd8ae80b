"""The step pipeline on a CUDA device: kernel launches per step grow with the buckets, not with the parameters, for
plain, paged and GaLore-projected parameters. Skipped without CUDA (conftest.py skips the ``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_params, set_grads

import lowmemopt

pytestmark = pytest.mark.gpu


def _cuda_params(n: int, shape=(96, 160)):
    return [torch.nn.Parameter(p.detach().cuda()) for p in make_params([shape] * n)]


def _step(opt, params, t):
    cpu = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    set_grads(cpu, t)
    for p, c in zip(params, cpu):
        p.grad = c.grad.cuda()
    opt.step()


def _device_kernels(opt, params) -> int:
    """Kernels the device runs for one step (copies and memsets not counted: paged state moves one copy per tensor,
    which is bandwidth, not launch overhead), after two warm-up steps (state made, projector computed)."""
    for t in range(2):
        _step(opt, params, t)
    cpu = [torch.nn.Parameter(p.detach().cpu()) for p in params]
    set_grads(cpu, 2)
    for p, c in zip(params, cpu):
        p.grad = c.grad.cuda()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        opt.step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(1 for n in names if not n.startswith(("Memcpy", "Memset")))


@pytest.mark.parametrize("mode", ["plain", "paged", "galore"])
@pytest.mark.parametrize("name", ["AdamW", "Lion", "SGD"])
def test_launches_grow_with_buckets_not_parameters(name, mode, tmp_path):
    cls = getattr(lowmemopt, name)
    counts = []
    for n in (6, 24):
        params = _cuda_params(n)
        group = dict(params=params, rank=16) if mode == "galore" else dict(params=params)
        storage = dict(paged="cpu", page_budget_bytes=0) if mode == "paged" else {}  # (all of it moves)
        kwargs = dict(momentum=0.9) if name == "SGD" else {}
        opt = cls([group], lr=1e-3, state_bits=8, **kwargs, **storage)
        counts.append(_device_kernels(opt, params))
    assert counts[1] <= counts[0] + 4, f"{name} {mode}: {counts[0]} kernels for 6 parameters, {counts[1]} for 24"
