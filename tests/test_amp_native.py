"""``torch.amp.GradScaler``'s native path (``_step_supports_amp_scaling``): the scaler hands ``step()`` the scale and
``found_inf``, and every backend applies ``1 / scale`` where it loads the gradient. Each step must equal the generic
path (``unscale_`` + ``step()``, skipped on an Inf) bit for bit: parameters, every state tensor, step counts."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_runs_same

import lowmemopt
from lowmemopt.kernels import runtime

CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 32),
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True), 32),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1), 8),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1), 8),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1), 32),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1), 32),
    (lowmemopt.FusedLAMB, dict(lr=1e-2, weight_decay=0.1, max_grad_norm=1.0), 32),
]
IDS = [f"{c.__name__}-{b}" for c, _, b in CASES]
#: CPU: a 256 x 256 matrix takes the native factored kernels (Adafactor, CAME); the native elementwise kernels take
#: any size (and do a ragged tail)
SHAPES = [(256, 256), (300, 64), (37,)]
ELEMENTWISE_SHAPES = [(96, 64), (300,), (37,)]
STEPS = 5
INF_STEPS = {1: 0, 3: 2}  # step -> the parameter whose gradient gets an Inf


def _run(
    cls,
    kw,
    bits,
    dtype,
    native: bool,
    shapes=SHAPES,
    unscale_first=False,
    interpret=False,
    count=None,
    groups=None,
    **extra,
):
    """``STEPS`` GradScaler steps (scale 2^12, growing every 2 clean steps, halved on an Inf)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    opt = cls(
        params if groups is None else groups(params), state_bits=bits, min_quant_numel=0, block_size=32, **kw, **extra
    )
    if not native:
        opt._step_supports_amp_scaling = False  # GradScaler's generic path: unscale_, then step() unless Inf
    if count is not None:
        real_step = opt.step

        def step(*a, **k):
            with count:
                return real_step(*a, **k)

        opt.step = step
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    scaler.scale(torch.ones(()))
    gen = torch.Generator().manual_seed(1)
    context = runtime.cpu_interpreter() if interpret else _Nothing()
    with context:
        for step in range(STEPS):
            scale = scaler.get_scale()
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen) * scale
                if INF_STEPS.get(step) == i:
                    g.view(-1)[5] = float("inf")
                p.grad = g.to(dtype)
            sent = [p.grad.clone() for p in params]
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            if native and not unscale_first and not interpret:  # nothing unscaled the gradients in place
                assert all(torch.equal(p.grad, g) for p, g in zip(params, sent))
        opt.state_dict()  # (settles a deferred skip)
    return params, opt


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_skipped_exactly_the_inf_steps(params, opt) -> None:
    for p in params:
        assert int(opt.state[p]["step"]) == STEPS - len(INF_STEPS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls,kw,bits", CASES, ids=IDS)
def test_native_equals_unscale_then_step(cls, kw, bits, dtype):
    shapes = SHAPES if cls in (lowmemopt.CAME, lowmemopt.Adafactor) else ELEMENTWISE_SHAPES
    native = _run(cls, kw, bits, dtype, True, shapes)
    generic = _run(cls, kw, bits, dtype, False, shapes)
    assert_runs_same(*native, *generic)
    _assert_skipped_exactly_the_inf_steps(*native)
    assert native[1].nonfinite_skips == 0  # the scaler skipped them: not the optimizer's own check


@pytest.mark.parametrize("cls,kw,bits", CASES[:1] + CASES[4:5], ids=IDS[:1] + IDS[4:5])
def test_unscale_called_first(cls, kw, bits):
    """``scaler.unscale_(opt)`` before ``scaler.step(opt)``: the scaler passes ``grad_scale=None``."""
    assert_runs_same(
        *_run(cls, kw, bits, torch.bfloat16, True, unscale_first=True),
        *_run(cls, kw, bits, torch.bfloat16, False, unscale_first=True),
    )


def test_fp16_gradients_take_the_native_path():
    """The generic path refuses fp16 gradients ("Attempting to unscale FP16 gradients"); the native one steps them
    as ``unscale_`` would: ``float(g) / scale`` rounded to fp16, then the step."""
    with pytest.raises(ValueError, match="FP16"):
        _run(lowmemopt.AdamW, dict(lr=1e-2), 32, torch.float16, False)
    params, opt = _run(lowmemopt.AdamW, dict(lr=1e-2), 32, torch.float16, True)
    _assert_skipped_exactly_the_inf_steps(params, opt)
    # the reference: the same gradients unscaled by hand, plain step() without a scaler
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s).half()) for s in SHAPES]
    ropt = lowmemopt.AdamW(ref, lr=1e-2, min_quant_numel=0, block_size=32)
    gen = torch.Generator().manual_seed(1)
    scale = 2.0**12
    clean = 0
    for step in range(STEPS):
        grads = []
        for i, p in enumerate(ref):
            g = torch.randn(p.shape, generator=gen) * scale
            if INF_STEPS.get(step) == i:
                g.view(-1)[5] = float("inf")
            grads.append(g.to(torch.float16))
        if step in INF_STEPS:
            scale, clean = scale / 2, 0
            continue
        inv = torch.tensor(scale, dtype=torch.float32).double().reciprocal().float()
        for p, g in zip(ref, grads):
            p.grad = (g.float() * inv).half()
        ropt.step()
        clean += 1
        if clean == 2:
            scale, clean = scale * 2, 0
    assert_runs_same(params, opt, ref, ropt)


def _galore(params):
    return [dict(params=params[:2], rank=8, update_proj_gap=2, scale=0.25, proj_type="std"), dict(params=params[2:])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_galore(dtype):
    """GaLore (CPU): the basis refresh and the projection see the unscaled gradient, as after ``unscale_``."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    shapes = [(64, 48), (40, 24), (37,)]
    assert_runs_same(
        *_run(lowmemopt.AdamW, kw, 32, dtype, True, shapes, groups=_galore),
        *_run(lowmemopt.AdamW, kw, 32, dtype, False, shapes, groups=_galore),
    )


@pytest.mark.slow
@pytest.mark.parametrize("bits", [32, 8])
def test_compiled_path(bits, monkeypatch):
    """The ``torch.compile`` chunk path (native kernels off): the multiplier is a graph input, one graph per step."""
    from lowmemopt import compiled, cpu

    monkeypatch.setattr(cpu, "ENABLED", False)
    monkeypatch.setattr(compiled, "MIN_NUMEL", 0)
    calls = []
    real = compiled.step_rows
    monkeypatch.setattr(compiled, "step_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    for dtype in (torch.float32, torch.bfloat16):
        assert_runs_same(
            *_run(lowmemopt.AdamW, dict(lr=1e-2), bits, dtype, True, [(64, 64)]),
            *_run(lowmemopt.AdamW, dict(lr=1e-2), bits, dtype, False, [(64, 64)]),
        )
    assert calls and compiled.ENABLED


class _Syncs:
    """Counts ``Tensor.item``, ``Tensor.cpu`` and ``Tensor.__bool__`` calls while entered."""

    def __init__(self, monkeypatch):
        self.n = 0
        self.on = False
        for name in ("item", "cpu", "__bool__"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(real))

    def _wrap(self, real):
        def counted(t, *a, **k):
            if self.on:
                self.n += 1
            return real(t, *a, **k)

        return counted

    def __enter__(self):
        self.on = True

    def __exit__(self, *exc):
        self.on = False


def test_no_host_reads_in_the_native_step_on_cpu(monkeypatch):
    count = _Syncs(monkeypatch)
    _run(lowmemopt.AdamW, dict(lr=1e-2), 8, torch.bfloat16, True, count=count)
    assert count.n == 0


interpreted = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")
SMALL = [(33, 17), (300,), (8, 8)]
TRITON_CASES = CASES[:6] + CASES[7:] + [(lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3), 8)]


@interpreted
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # (numpy, on the masked Inf step's scratch reductions)
@pytest.mark.parametrize("cls,kw,bits", TRITON_CASES, ids=[f"{c.__name__}-{b}" for c, _, b in TRITON_CASES])
def test_triton_native_equals_unscale_then_step(cls, kw, bits, monkeypatch):
    """The Triton buckets (interpreted, CPU tensors): ``found_inf`` masks the launches on the device (the Inf steps
    are launched too), the host step counts of a skipped step are restored at the next step, and nothing is read back
    during the step."""
    count = _Syncs(monkeypatch)
    native = _run(cls, kw, bits, torch.bfloat16, True, SMALL, interpret=True, count=count)
    generic = _run(cls, kw, bits, torch.bfloat16, False, SMALL, interpret=True)
    assert_runs_same(*native, *generic)
    assert count.n == 0


@interpreted
def test_capturable_under_the_interpreter():
    native = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, torch.float32, True, SMALL, interpret=True, capturable=True)
    generic = _run(lowmemopt.AdamW, dict(lr=1e-2), 8, torch.float32, False, SMALL, interpret=True, capturable=True)
    assert_runs_same(*native, *generic)
    _assert_skipped_exactly_the_inf_steps(*native)


def test_onebit_optimizers_keep_the_generic_path():
    from lowmemopt.optim.onebit import OnebitOptimizer

    assert lowmemopt.AdamW._step_supports_amp_scaling
    assert not OnebitOptimizer._step_supports_amp_scaling
