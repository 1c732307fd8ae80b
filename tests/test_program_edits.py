"""Kept step programs against what users do between steps: seeded random sequences of edits (a scheduler's lr, new
or missing gradients, a gradient buffer kept in place or one flat buffer for all, a NaN, a state dict round trip, a
parameter's state reset, a new param group, ``p.data`` replaced, a storage option changed...) applied alike to a run
whose steady steps take the kept program and to a run checked on the host, which never does. Both must end equal bit
for bit, or raise the same error at the same step (:mod:`lowmemopt.pipeline.program`, :mod:`lowmemopt.pipeline.fits`).
Under the Triton interpreter."""

from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch
from helpers import assert_runs_same

import lowmemopt
from lowmemopt import optimizer as optimizer_module
from lowmemopt.kernels import runtime
from lowmemopt.pipeline import program

pytestmark = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")

SHAPES = [(33, 17), (300,), (8, 8), (5,), (40, 24)]


def _reshape(opt, ps, rnd, gen):  # another shape (a pruned or resized parameter): refused where state exists
    p = ps[rnd.randrange(len(ps))]
    p.data = torch.randn(max(1, p.shape[0] // 2), *p.shape[1:], generator=gen).to(p.dtype)
    p.grad = None


def _flat_grads(opt, ps, rnd, gen):  # every gradient a view into one buffer (DDP's gradient_as_bucket_view)
    live = [p for p in ps if p.requires_grad]
    flat = torch.randn(sum(p.numel() for p in live), generator=gen)
    for p, g in zip(live, flat.split([p.numel() for p in live])):
        p.grad = g.view(p.shape).to(p.dtype)


def _nan(opt, ps, rnd, gen):
    p = ps[rnd.randrange(len(ps))]
    if p.grad is not None:
        p.grad.view(-1)[0] = float("nan")


def _state_tensors_cloned(opt, ps, rnd, gen):
    st = opt.state.get(ps[1])
    for k, v in list((st or {}).items()):
        if isinstance(v, torch.Tensor):
            st[k] = v.clone()


EDITS = {  # name -> edit(opt, params, rnd, gen), between the gradients and the step
    "lr": lambda opt, ps, rnd, gen: opt.param_groups[0].update(lr=opt.param_groups[0]["lr"] * rnd.choice([0.5, 2])),
    "weight decay": lambda opt, ps, rnd, gen: opt.param_groups[0].update(weight_decay=rnd.choice([0.0, 0.2])),
    "betas": lambda opt, ps, rnd, gen: opt.param_groups[0].update(betas=(rnd.choice([0.8, 0.9]), 0.99)),
    "lr tensor": lambda opt, ps, rnd, gen: opt.param_groups[0].update(lr=torch.tensor(0.01)),
    "maximize": lambda opt, ps, rnd, gen: opt.param_groups[0].update(maximize=not opt.param_groups[0]["maximize"]),
    "block size": lambda opt, ps, rnd, gen: opt.param_groups[0].update(block_size=rnd.choice([16, 64])),
    "state bits": lambda opt, ps, rnd, gen: opt.param_groups[0].update(state_bits=rnd.choice([4, 8, 16, 32])),
    "bf16_update": lambda opt, ps, rnd, gen: opt.param_groups[0].update(bf16_update=rnd.choice(["kahan", "nearest"])),
    "no grad": lambda opt, ps, rnd, gen: setattr(ps[rnd.randrange(len(ps))], "grad", None),
    "transposed grad": lambda opt, ps, rnd, gen: setattr(
        ps[0], "grad", torch.randn(tuple(reversed(ps[0].shape)), generator=gen).t().to(ps[0].dtype)
    ),
    "flat grads": _flat_grads,
    "nan": _nan,
    "state dict": lambda opt, ps, rnd, gen: opt.load_state_dict(copy.deepcopy(opt.state_dict())),
    "state tensors": _state_tensors_cloned,
    "state reset": lambda opt, ps, rnd, gen: opt.state.pop(ps[2], None),
    "step count": lambda opt, ps, rnd, gen: (
        opt.state[ps[3]].__setitem__("step", opt.state[ps[3]]["step"] + 1)
        if "step" in opt.state.get(ps[3], {})
        else None
    ),
    "params reversed": lambda opt, ps, rnd, gen: opt.param_groups[0]["params"].reverse(),
    "data cloned": lambda opt, ps, rnd, gen: setattr(ps[1], "data", ps[1].data.clone()),
    "data scaled": lambda opt, ps, rnd, gen: ps[0].data.mul_(0.5),
    "reshaped": _reshape,
    "frozen": lambda opt, ps, rnd, gen: (ps[4].requires_grad_(False), setattr(ps[4], "grad", None)),
}


def _run(on_device: bool, seed: int, dtype: torch.dtype, monkeypatch, steps: int = 8):
    """``steps`` AdamW 8-bit steps with a seeded edit before each; returns (params, optimizer, skips, edits, error)."""
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in SHAPES]
    extra = torch.nn.Parameter(torch.randn(7, 9).to(dtype))
    opt = lowmemopt.AdamW(params, lr=1e-2, weight_decay=0.1, state_bits=8, min_quant_numel=0, block_size=32)
    gen, rnd = torch.Generator().manual_seed(1), random.Random(seed)
    done, in_place = [], False
    with runtime.cpu_interpreter(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(steps):
            for p in params:
                if p.requires_grad:
                    g = torch.randn(p.shape, generator=gen).to(p.dtype)
                    if in_place and p.grad is not None and p.grad.shape == p.shape and p.grad.is_contiguous():
                        p.grad.copy_(g)  # (zero_grad(set_to_none=False): the kept tables' gradient addresses hold)
                    else:
                        p.grad = g
            name = rnd.choice(sorted(EDITS) + ["new group", "grads in place", "none", "none"])
            in_place = in_place or name == "grads in place"
            done.append(name)
            try:
                if name == "new group" and len(params) == len(SHAPES):
                    extra.grad = torch.randn(extra.shape, generator=gen).to(dtype)
                    opt.add_param_group({"params": [extra]})
                    params.append(extra)
                elif name in EDITS:
                    EDITS[name](opt, params, rnd, gen)
                opt.step()
            except ValueError as e:  # (refused state, or a refused load: both runs must refuse it at this step)
                return params, opt, None, done, f"step {step}: {e}"
        skips = opt.nonfinite_skips
    return params, opt, skips, done, None


# seeds whose sequences take the program at two or more steps and cover, among them, every kind of edit and both
# refusals (a reshaped parameter, a block size changed); one in bf16
RUNS = [(s, torch.float32) for s in (4, 13, 20, 22, 35, 44, 53)] + [(43, torch.bfloat16)]


@pytest.mark.parametrize("seed,dtype", RUNS, ids=[f"{s}-{str(d)[6:]}" for s, d in RUNS])
def test_random_edits_between_steps_give_the_host_checked_results(seed, dtype, monkeypatch):
    programmed = [0]
    real = program.StepProgram.step

    def count(self, *a, **k):
        programmed[0] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(program.StepProgram, "step", count)
    a, opt_a, skips_a, edits, error_a = _run(True, seed, dtype, monkeypatch)
    used = programmed[0]
    b, opt_b, skips_b, edits_b, error_b = _run(False, seed, dtype, monkeypatch)
    assert edits == edits_b and programmed[0] == used
    assert error_a == error_b, edits
    assert skips_a == skips_b, edits
    assert_runs_same(a, opt_a, b, opt_b)
    assert used >= 1, edits  # (the kept program took some of the steps)
