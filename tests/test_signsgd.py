"""SignSGD (``lowmemopt.SignSGD``) against mlbench's rule, written in ``optim_info.SignSGDReference``: the sign of
torch SGD's direction, bit for bit at 32-bit; which backends step it (the Triton kernel is SGD's with its ``SIGN``
flag; so is the native CPU kernel's, ``lmo_sgd``)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_params_close,
    clone_params,
    interpreter_fma_rounds_once,
    make_params,
    run,
    run_with_reference,
    set_grads,
)
from optim_info import BY_NAME, SignSGDReference

import lowmemopt
from lowmemopt import cpu

VARIANTS = BY_NAME["SignSGD"].variants
SHAPES = [(37, 53), (300,), (5, 7, 9)]  # below compiled.MIN_NUMEL: the eager path on the CPU


@pytest.mark.parametrize("kw", VARIANTS, ids=[str(i) for i in range(len(VARIANTS))])
def test_matches_mlbench_rule_bit_for_bit(kw):
    """12 steps at 32-bit: parameters and momentum buffers equal the reference's exactly."""
    params = make_params(SHAPES)
    ref_params = clone_params(params)
    opt, ref = lowmemopt.SignSGD(params, **kw), SignSGDReference(ref_params, **kw)
    run_with_reference(opt, params, ref, ref_params, 12)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)
        if kw.get("momentum"):
            assert torch.equal(opt.state[p]["momentum_buffer"], ref.state[r]["momentum_buffer"])
        else:
            assert "momentum_buffer" not in opt.state[p]
    # every element moved by a whole number of lr steps: the update is lr * sign(d), never lr * d
    steps = (params[0].detach() - make_params(SHAPES)[0]) / kw["lr"]
    torch.testing.assert_close(steps, steps.round(), rtol=0, atol=1e-3)


def test_direction_is_torch_sgds():
    """One step from equal parameters: the momentum buffer is torch.optim.SGD's, bit for bit, and the parameter moved
    by -lr sign(buffer) (no Nesterov)."""
    kw = dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)
    params = make_params([(64, 33)])
    twin = clone_params(params)
    start = params[0].detach().clone()
    opt, sgd = lowmemopt.SignSGD(params, **kw), torch.optim.SGD(twin, **kw)
    for t in range(3):
        g = torch.randn(64, 33, generator=torch.Generator().manual_seed(t))
        params[0].grad, twin[0].grad = g.clone(), g.clone()
        with torch.no_grad():
            twin[0].copy_(params[0])
        before = params[0].detach().clone()
        opt.step()
        sgd.step()
        buf = sgd.state[twin[0]]["momentum_buffer"]
        assert torch.equal(opt.state[params[0]]["momentum_buffer"], buf)
        assert torch.equal(params[0].detach(), before.add(torch.sign(buf), alpha=-0.1))
    assert not torch.equal(params[0].detach(), start)


def test_zero_direction_leaves_the_element_and_its_sign():
    """sign(0) = 0: elements whose direction is exactly 0 stay put, -0.0 included (p - lr * 0 keeps -0.0 as torch's
    add does)."""
    p = torch.nn.Parameter(torch.tensor([-0.0, 0.0, 1.5, -2.0, 3.0]))
    opt = lowmemopt.SignSGD([p], lr=0.25)
    p.grad = torch.tensor([0.0, -0.0, 0.0, 1e-30, -7.0])
    opt.step()
    expected = torch.tensor([-0.0, 0.0, 1.5, -2.25, 3.25])
    assert torch.equal(p.detach(), expected) and torch.equal(p.detach().signbit(), expected.signbit())


@pytest.mark.skipif(not cpu.available(), reason="native CPU kernels unavailable (no C compiler)")
@pytest.mark.parametrize("bits", [32, 16, 8, 4])
def test_cpu_native_kernel_steps_it_as_the_torch_paths(bits, monkeypatch):
    """The native SGD kernel with its SignSGD flag (SignSGD's declared ``NativeKernel``) steps every parameter (8 / 4
    bits: the full blocks), and the steps equal those taken with the native kernels turned off, bit for bit."""
    from lowmemopt.cpu import elementwise

    seen = []
    real = elementwise.step_many  # (the bucket's one call per step: every parameter here)
    monkeypatch.setattr(
        elementwise,
        "step_many",
        lambda algorithm, batch: (
            seen.extend((algorithm, a.nrows * a.bs + a.tail) for a in batch) or real(algorithm, batch)
        ),
    )
    kw = dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01, state_bits=bits, min_quant_numel=64)
    params, off = make_params(SHAPES), make_params(SHAPES)
    run(lowmemopt.SignSGD(params, **kw), params, 3)
    native = lowmemopt.SignSGD.algorithm.kernels.native  # (lmo_sgd with its sign flag)
    assert len(seen) == 3 * len(SHAPES) and all(alg is native and done > 0 for alg, done in seen), seen
    opt_off = lowmemopt.SignSGD(off, **kw)
    with monkeypatch.context() as m:
        m.setattr(cpu, "ENABLED", False)
        run(opt_off, off, 3)
    assert all(torch.equal(a, b) for a, b in zip(params, off))


def test_triton_kernel_zero_direction_and_sign():
    """The SGD kernel with its SIGN flag (under the interpreter): exact zeros, -0.0, a tiny and a huge direction give
    torch.sign's steps, bit for bit (``-lr * sign`` is exact, so the kernel's fma rounds as ``p.add_`` does); the
    ``signsgd`` kernel really ran."""
    from lowmemopt.kernels import dispatch, runtime

    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs Triton and TRITON_INTERPRET=1 before lowmemopt.kernels is imported")
    values = torch.tensor([-0.0, 0.0, 1.5, -2.0, 3.0, 0.0, 1e-3, -1e30])
    grads = torch.tensor([0.0, -0.0, 0.0, 1e-30, -7.0, 1e-45, 3e38, 2e30])
    for bits in (32, 8):
        p, ref = torch.nn.Parameter(values.clone()), torch.nn.Parameter(values.clone())
        kw = dict(lr=0.25, momentum=0.5, state_bits=bits, min_quant_numel=0, block_size=16)
        opt, twin = lowmemopt.SignSGD([p], **kw), lowmemopt.SignSGD([ref], **kw)
        for _ in range(2):
            p.grad, ref.grad = grads.clone(), grads.clone()
            before = sum(n for (alg, _), n in dispatch.stats.items() if alg == "signsgd")
            with runtime.cpu_interpreter():
                opt.step()
            assert sum(n for (alg, _), n in dispatch.stats.items() if alg == "signsgd") == before + 1
            twin.step()
            assert torch.equal(p.detach(), ref.detach()) and torch.equal(p.detach().signbit(), ref.detach().signbit())
    assert torch.equal(p.detach()[:3], values[:3])  # a zero direction: -0.0, 0.0 and 1.5 stay as they were


@pytest.mark.parametrize("bits", [32, 8])
def test_galore_signsgd_through_the_kernel_equals_the_reference_core(bits, monkeypatch):
    """GaLore groups: the low-rank step runs on a stand-in through the SGD kernel with its SIGN flag (under the
    interpreter), the stand-in holding ``-lr sign(d)`` of the low-rank direction, projected back: the reference core's
    step (eager, one matrix at a time) to fp32 rounding of the projection."""
    from lowmemopt.kernels import runtime

    if not (runtime.HAS_TRITON and runtime.INTERPRET):
        pytest.skip("needs Triton and TRITON_INTERPRET=1 before lowmemopt.kernels is imported")
    if not interpreter_fma_rounds_once():
        pytest.skip("this Triton's interpreter rounds tl.fma twice: parameters drift by an ulp from the reference")
    kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.01, state_bits=bits, min_quant_numel=64)

    def run_steps(kernels):
        params = make_params([(24, 40), (40, 24), (300,)])
        opt = lowmemopt.SignSGD([dict(params=params[:2], rank=4, update_proj_gap=10), dict(params=params[2:])], **kw)
        for t in range(3):
            set_grads(params, t)
            if kernels:
                with runtime.cpu_interpreter():
                    opt.step()
            else:
                with monkeypatch.context() as m:
                    m.setattr(cpu, "ENABLED", False)
                    opt.step()
        return params

    from lowmemopt.kernels.launch import Bucket

    rows, real = [], Bucket.launch
    monkeypatch.setattr(Bucket, "launch", lambda self, k, r, *a, **m: rows.append(len(r)) or real(self, k, r, *a, **m))
    fused = run_steps(True)
    assert rows.count(2) == 3, rows  # the two stand-ins' launch at every step (the vector's takes another)
    assert_params_close(fused, run_steps(False), 1e-2, bits < 32, f"GaLore SignSGD {bits}-bit")
