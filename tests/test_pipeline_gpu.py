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


def test_galore_kept_step_holds_no_buffers_between_steps(monkeypatch):
    """A steady GaLore step (the kept program) on CUDA: its low-rank gradients, stand-ins and bf16 bases live in
    buffers given device memory for the step and giving it back after it (``projection.batched.Scratch``): after a
    programmed step the allocator holds less, by at least those buffers' bytes, than with the buffers kept; and the
    steps equal the host-checked pipeline's bit for bit."""
    from lowmemopt import optimizer as optimizer_module
    from lowmemopt.projection import batched
    from helpers import assert_runs_same

    def run(on_device, keep=False):
        monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
        if keep:
            monkeypatch.setattr(batched.Scratch, "give_back", lambda self: None)
        base = torch.cuda.memory_allocated()
        torch.manual_seed(0)
        shapes = [(96, 160)] * 3 + [(64, 160), (160,)]
        params = [torch.nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in shapes]
        opt = lowmemopt.AdamW(
            [{"params": params[:4], "rank": 8}, {"params": params[4:]}],
            lr=1e-2,
            weight_decay=0.1,
            state_bits=8,
            min_quant_numel=0,
        )
        gen = torch.Generator(device="cuda").manual_seed(1)
        for _ in range(6):
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
            opt.step()
        torch.cuda.synchronize()
        monkeypatch.undo()
        return params, opt, torch.cuda.memory_allocated() - base  # (what this run holds between steps)

    a, opt_a, held_a = run(True)
    program = opt_a._program
    assert program is not None and program.projected  # steps 2-5 took the kept program
    project, stand = program.layouts[0], program.layouts[1]
    scratch = [*project.scratch, *(c[0] for c in project.cast_bases.values()), *(c[0] for c in stand.carved)]
    assert scratch and all(s.tensor.untyped_storage().nbytes() == 0 for s in scratch)
    del program, project, stand, scratch
    kept, opt_kept, held_kept = run(True, keep=True)
    layouts = opt_kept._program.layouts
    nbytes = sum(
        s.nbytes
        for s in [
            *layouts[0].scratch,
            *(c[0] for c in layouts[0].cast_bases.values()),
            *(c[0] for c in layouts[1].carved),
        ]
    )
    del layouts, kept, opt_kept
    assert held_kept - held_a >= nbytes > 0  # (the same parameters, gradients and state in both)
    b, opt_b, _ = run(False)
    assert_runs_same(a, opt_a, b, opt_b)
