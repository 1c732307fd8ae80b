"""The non-finite-gradient check decided on the device (lowmemopt.pipeline.finite), under the Triton interpreter.

The policy is unchanged: a parameter with a NaN / Inf gradient keeps its value, state and step count (no state at all
if that was its first step), others step, the skips are counted and warned about. Here every such step must equal the
host-side check's, bit for bit, and the host must not read the flags in the step: they are settled at the next step
(or when ``nonfinite_skips`` or ``state_dict()`` is read), from a copy made without waiting, so the warning about a
step's skips comes one step later than the host check's."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import assert_runs_same, count_device_checks

import lowmemopt
from lowmemopt import optimizer as optimizer_module
from lowmemopt.kernels import dispatch, runtime

pytestmark = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")

SHAPES = [(33, 17), (300,), (8, 8), (5,)]
CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    # multi-pass kernels: per-tensor reductions into scratch, then the update (and the factored statistics' pass)
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1)),  # relative step, RMS(p) scaling
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1)),
]
#: (step, param, what): the gradients made non-finite
BAD = {(0, 3): float("nan"), (1, 0): float("inf"), (2, 1): float("nan"), (2, 2): -float("inf")}


def _steps(opt, params, bad: dict, steps: int, at: int, one_step=None) -> list[int]:
    """``steps`` steps with random gradients, ``bad[(step, i)]`` written at flat index ``at`` of param ``i``'s;
    ``one_step()`` (default ``opt.step``) takes each step. Returns the NaN/Inf warnings of each step (or what
    ``one_step()`` returns, if an int: the skips it counted)."""
    gen = torch.Generator().manual_seed(1)
    caught = []
    with runtime.cpu_interpreter():
        for step in range(steps):
            for i, p in enumerate(params):
                g = torch.randn(p.shape, generator=gen)
                if (step, i) in bad:
                    g.view(-1)[at] = bad[(step, i)]
                p.grad = g
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                skipped = (one_step or opt.step)()
            caught.append(skipped if isinstance(skipped, int) else sum("NaN/Inf" in str(x.message) for x in w))
    return caught


def _run(cls, kw, bits, on_device, monkeypatch):
    """Four steps of ``cls`` with the gradients of ``BAD`` non-finite: (params, optimizer, warnings per step,
    device-side checks made)."""
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    checks = count_device_checks(monkeypatch)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = cls(params, state_bits=bits, min_quant_numel=0, block_size=16 if bits == 4 else 32, **kw)
    return params, opt, _steps(opt, params, BAD, 4, 3), len(checks)


@pytest.mark.parametrize("bits", [32, 8, 4])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_equals_the_host_check(cls, kw, bits, monkeypatch):
    before = sum(dispatch.stats.values())
    a, opt_a, warned_a, checks = _run(cls, kw, bits, True, monkeypatch)
    assert sum(dispatch.stats.values()) > before  # the kernels stepped
    assert checks == 4  # each step checked on the device
    b, opt_b, warned_b, _ = _run(cls, kw, bits, False, monkeypatch)
    assert warned_b == [1, 1, 1, 0] and warned_a == [0, 1, 1, 1]  # the device's: told at the next step
    assert opt_a.nonfinite_skips == opt_b.nonfinite_skips == 4
    assert_runs_same(a, opt_a, b, opt_b)
    steps = [opt_a.state[p]["step"] for p in a]
    assert steps == [3, 3, 3, 3]  # 4 steps, one skipped each (param 3's first: no state then, made at step 2)


@pytest.mark.parametrize("bits", [32, 8])
def test_came_direct_instability_pass_equals_the_host_check(bits, monkeypatch):
    # where fp64 is slow CAME takes the instability's direct pass over g and m (2-D tiles into scratch), then the same
    # statistics pass: a skipped tensor's statistics stay as they were there too
    monkeypatch.setattr(runtime, "INTERPRETER_FAST_FP64", False)
    a, opt_a, warned_a, _ = _run(lowmemopt.CAME, dict(lr=1e-3), bits, True, monkeypatch)
    b, opt_b, warned_b, _ = _run(lowmemopt.CAME, dict(lr=1e-3), bits, False, monkeypatch)
    assert warned_b == [1, 1, 1, 0] and warned_a == [0, 1, 1, 1]
    assert opt_a.nonfinite_skips == opt_b.nonfinite_skips
    assert_runs_same(a, opt_a, b, opt_b)


def test_a_skipped_first_step_leaves_no_state(monkeypatch):
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", True)
    p, q = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(40))
    opt = lowmemopt.AdamW([p, q], lr=1e-2, state_bits=8, min_quant_numel=0, block_size=16)
    p.grad, q.grad = torch.full((40,), float("nan")), torch.ones(40)
    before = p.detach().clone()
    with runtime.cpu_interpreter():
        opt.step()
    with pytest.warns(RuntimeWarning, match="skipped 1 parameter.* in the previous step"):
        assert opt.nonfinite_skips == 1  # (settles the step: its state made provisionally is dropped)
    assert torch.equal(p, before) and not opt.state.get(p)
    assert opt.state[q]["step"] == 1 and not torch.equal(q, torch.ones(40))


def test_the_host_reads_the_flags_at_the_next_step(monkeypatch):
    """The step launches its kernels and copies its flags to the host without waiting; the next step (here the
    skip counter) reads that copy, after the kernels, and restores what a skip provisionally changed."""
    from lowmemopt.kernels import launch
    from lowmemopt.pipeline import finite

    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", True)
    log = []
    real_launch, real_read = launch.Bucket.launch, finite.DeviceFlags.host
    monkeypatch.setattr(
        launch.Bucket, "launch", lambda self, *a, **k: log.append("launch") or real_launch(self, *a, **k)
    )
    monkeypatch.setattr(finite.DeviceFlags, "host", lambda self: log.append("read") or real_read(self))
    real_resolve = finite.PendingSkip.resolve
    monkeypatch.setattr(finite.PendingSkip, "resolve", lambda self: log.append("settle") or real_resolve(self))
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = lowmemopt.AdamW(params, lr=1e-2)
    for p in params:
        p.grad = torch.randn_like(p)
    params[1].grad[0] = float("nan")
    with runtime.cpu_interpreter():
        opt.step()
    assert "launch" in log and "read" not in log and "settle" not in log, log
    assert opt.state[params[1]]["step"] == 1  # provisionally
    with runtime.cpu_interpreter():
        for p in params:
            p.grad = torch.randn_like(p)
        with pytest.warns(RuntimeWarning, match="skipped 1 parameter"):
            opt.step()
    # the first step's launch, then its flags settled before the second step launches anything
    assert log[:2] == ["launch", "settle"] and log.count("settle") == 1, log
    assert [opt.state[p]["step"] for p in params] == [2, 1, 2, 2]


GALORE_SHAPES = [(16, 12), (16, 12), (16, 12), (20, 8), (12,)]  # a class of 3 matrices, one alone, a bias
#: (step, param): non-finite gradients of the GaLore runs (step 3 refreshes the bases: checked on the host)
GALORE_BAD = {
    (1, 0): float("nan"),
    (2, 3): float("inf"),
    (3, 2): float("nan"),
    (4, 4): float("nan"),
    (5, 1): -float("inf"),
}
GALORE_CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1)),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1)),
]


def _galore_run(cls, kw, bits, on_device, monkeypatch, per_layer=False):
    """Six steps with the matrices in a GaLore group (rank 4, bases refreshed at steps 0 and 3) through the batched
    products and the fused apply pass, the gradients of ``GALORE_BAD`` non-finite: (params, optimizer, warnings per
    step, device-side checks made). ``per_layer``: each parameter stepped alone, as step_in_backward's hooks do."""
    from lowmemopt.per_layer import step_one
    from lowmemopt.pipeline import finite
    from lowmemopt.projection import batched as galore_batched

    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    monkeypatch.setattr(galore_batched, "BATCH_ON_CPU", True)
    checks = count_device_checks(monkeypatch)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in GALORE_SHAPES]
    opt = cls(
        [{"params": params[:4], "rank": 4, "update_proj_gap": 3}, {"params": params[4:]}],
        state_bits=bits,
        min_quant_numel=0,
        block_size=32,
        **kw,
    )

    def hooks() -> int:  # every parameter alone, then the end of the backward pass's read
        pending: list = []
        skipped = sum(not step_one(opt, p, group, pending) for group in opt.param_groups for p in group["params"])
        return skipped + finite.resolve(pending)

    caught = _steps(opt, params, GALORE_BAD, 6, 5, one_step=hooks if per_layer else None)
    return params, opt, caught, len(checks)


@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("cls,kw", GALORE_CASES, ids=[c.__name__ for c, _ in GALORE_CASES])
def test_galore_equals_the_host_check(cls, kw, bits, monkeypatch):
    # the projected parameters' kernels and their batched apply pass (kernels.unproject) read the flags; a step with a
    # basis refresh due (the first, the fourth) takes the host check, since the SVD would read the gradient
    a, opt_a, warned_a, checks_a = _galore_run(cls, kw, bits, True, monkeypatch)
    b, opt_b, warned_b, checks_b = _galore_run(cls, kw, bits, False, monkeypatch)
    # on the device: steps 1, 2 and 5; the bases refresh at step 3 (params 1, 2) and 4 (0, 2, 3: a skipped step
    # delays a parameter's refresh by one)
    assert checks_a == 3 and checks_b == 0
    # the device's skips are told at the next step (step 3 tells step 2's and its own, checked on the host)
    assert warned_b == [0, 1, 1, 1, 1, 1] and warned_a == [0, 0, 1, 2, 1, 0]
    assert opt_a.nonfinite_skips == opt_b.nonfinite_skips == 5
    assert_runs_same(a, opt_a, b, opt_b)
    assert [opt_a.state[p]["step"] for p in a] == [5] * 5  # each skipped once


def test_galore_per_layer_updates_check_on_the_device(monkeypatch):
    # step_in_backward's hooks: a projected parameter's step is decided on the device too (no refresh due)
    a, opt_a, skipped_a, checks_a = _galore_run(
        lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8, True, monkeypatch, per_layer=True
    )
    b, opt_b, skipped_b, checks_b = _galore_run(
        lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1), 8, False, monkeypatch, per_layer=True
    )
    assert skipped_a == skipped_b == [0, 1, 1, 1, 1, 1]
    # one check per parameter on the device where no refresh is due: step 0 the bias; steps 1, 2, 5 all five; step 3
    # params 0, 3 and the bias (1, 2 refresh); step 4 param 1 and the bias (0, 2, 3 refresh, a skip later)
    assert checks_a == 1 + 5 + 5 + 3 + 2 + 5 and checks_b == 0
    assert_runs_same(a, opt_a, b, opt_b)


def test_galore_on_the_cpu_keeps_the_host_check(monkeypatch):
    # the CPU's GaLore products are per matrix (galore-torch's, bit for bit) and its apply is not the flagged pass
    made = count_device_checks(monkeypatch)
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", True)
    w, b = torch.nn.Parameter(torch.randn(16, 12)), torch.nn.Parameter(torch.randn(12))
    opt = lowmemopt.AdamW([{"params": [w], "rank": 4}, {"params": [b]}], lr=1e-2)
    with runtime.cpu_interpreter():
        for _ in range(2):
            w.grad, b.grad = torch.randn(16, 12), torch.randn(12)
            opt.step()
    assert not made
    opt = lowmemopt.AdamW([b], lr=1e-2)
    with runtime.cpu_interpreter():
        opt.step()
    assert made == [1]  # (the same step without the projected group checks on the device)


def _per_layer_run(monkeypatch, on_device: bool, bits: int, bucket_bytes: int = 0, **paging):
    """Three backward passes of a small MLP with step_in_backward (a NaN gradient in the second), recording the
    end-of-backward flag reads (their sizes) and the host-side checks: (model, optimizer, reads, host checks)."""
    from lowmemopt import per_layer
    from lowmemopt.pipeline import finite

    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2, state_bits=bits, min_quant_numel=0, block_size=32, **paging)
    lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
    reads, host_checks = [], []
    real_resolve, real_flags = finite.resolve, finite.host_flags
    monkeypatch.setattr(per_layer, "resolve", lambda pending: reads.append(len(pending)) or real_resolve(pending))
    monkeypatch.setattr(per_layer, "_finite_flags", lambda g: host_checks.append(1) or real_flags(g))
    gen = torch.Generator().manual_seed(3)
    with runtime.cpu_interpreter():
        for step in range(3):
            x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
            handle = model[2].weight.register_hook(lambda g: g * float("nan")) if step == 1 else None
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                torch.nn.functional.mse_loss(model(x), y).backward()
            if handle is not None:
                handle.remove()
    return model, opt, reads, host_checks


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20], ids=["alone", "bucketed"])
@pytest.mark.parametrize("bits", [32, 8])
def test_per_layer_updates_check_on_the_device_and_read_once_per_backward(bits, bucket_bytes, monkeypatch):
    # step_in_backward: each hook (or bucket: here all four parameters) launches its kernels with its flags; the flags
    # of a backward pass are read in one go at its end (not one synchronization per parameter), and the result is the
    # host check's (and, in buckets, the per-parameter hooks'), bit for bit
    a, opt_a, reads, host_checks = _per_layer_run(monkeypatch, True, bits, bucket_bytes)
    assert not host_checks and [n for n in reads if n] == [1 if bucket_bytes else 4] * 3  # one read per backward
    for on_device, bucket in [(False, bucket_bytes)] + ([(True, 0)] if bucket_bytes else []):
        b, opt_b, _, _ = _per_layer_run(monkeypatch, on_device, bits, bucket)
        assert opt_a.nonfinite_skips == opt_b.nonfinite_skips == 1
        assert_runs_same(list(a.parameters()), opt_a, list(b.parameters()), opt_b)
    assert opt_a.state[a[2].weight]["step"] == 2


@pytest.mark.parametrize("tier", ["cpu", "disk"])
def test_paged_state_resident_within_the_budget_checks_on_the_device(tier, tmp_path, monkeypatch):
    """Paged state that the budget keeps resident moves nowhere, so its step is the unpaged one: the finiteness check
    stays on the device (no synchronization before the launches), with the host check's results bit for bit. A budget
    below the state moves it, and the host decides first. (Issue 15: budget >= state at unpaged speed.)"""
    paging = dict(paged=tier, offload_dir=str(tmp_path)) if tier == "disk" else dict(paged=True)
    runs = {}
    for name, budget in (("resident", 1 << 30), ("moving", 0), ("unpaged", None)):
        extra = {} if budget is None else dict(paging, page_budget_bytes=budget)
        runs[name] = _run(lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1, **extra), 8, True, monkeypatch)
        if budget is not None:
            runs[name][1].close()
    assert runs["resident"][3] == runs["unpaged"][3] == 4 and runs["moving"][3] == 0  # DeviceFlags per step
    for name in ("resident", "moving"):
        params, _, warned, _ = runs[name]
        # the device's skips are told at the next step; moving state is checked on the host first
        assert runs["unpaged"][2] == [0, 1, 1, 1] and warned == ([0, 1, 1, 1] if name == "resident" else [1, 1, 1, 0])
        for a, b in zip(params, runs["unpaged"][0]):
            assert torch.equal(a, b), name


def test_per_layer_updates_of_resident_paged_state_check_on_the_device(monkeypatch):
    """step_in_backward with paged state that the budget keeps resident: the first backward places the state (host
    check: residency is decided then), later ones check on the device with one read per backward, and the run equals
    the unpaged one bit for bit (a NaN gradient in the second backward)."""
    a, opt_a, reads, host_checks = _per_layer_run(monkeypatch, True, 8, paged=True, page_budget_bytes=1 << 30)
    assert len(host_checks) == 4 and [n for n in reads if n] == [4, 4]  # backward 1 on the host, then the device
    assert all(
        opt_a._pager_for([(p, g)]).where_state_lives(p) == "device" for g in opt_a.param_groups for p in g["params"]
    )
    b, opt_b, _, _ = _per_layer_run(monkeypatch, True, 8)
    assert opt_a.nonfinite_skips == opt_b.nonfinite_skips == 1
    assert_runs_same(list(a.parameters()), opt_a, list(b.parameters()), opt_b)
    opt_a.close()
