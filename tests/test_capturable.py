"""Capturable steps (``capturable=True``, lowmemopt.work.capture) under the Triton interpreter.

A capturable step keeps the step counts on the device, computes the step's scalars there and decides non-finite skips
there, so it reads nothing back and a CUDA graph can capture it (tests/test_capturable_gpu.py captures and replays
it). Here it must equal an ordinary step bit for bit (parameters, state, step counts, skips), read no device value on
the host, follow a learning rate tensor changed in place, and refuse what it cannot capture before changing anything."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch

import lowmemopt
from lowmemopt.kernels import dispatch, runtime
from lowmemopt.optim.adamw import AdamAlgorithm

pytestmark = pytest.mark.skipif(not (runtime.HAS_TRITON and runtime.INTERPRET), reason="needs TRITON_INTERPRET=1")

SHAPES = [(33, 17), (300,), (8, 8), (5,)]
CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.Adam, dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),  # L2 decay in the math, a third slot
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-3)),  # the first step per tensor
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    # multi-pass kernels: the trust ratio (bias corrections folded into lr), the first step; the factored passes
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1)),  # relative step, RMS(p) scaling, beta2 by step
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1)),
    (lowmemopt.SignSGD, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),  # SGD's kernel with its SIGN flag
]
#: (step, param): the gradients made non-finite; param 3 is skipped on its first step
BAD = {(0, 3): float("nan"), (1, 0): float("inf"), (2, 1): float("nan")}


def _grads(params, step: int, bad: dict) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen).to(p.dtype)
        if (step, i) in bad:
            g.view(-1)[3] = bad[(step, i)]
        p.grad = g


def _run(cls, kw, capturable: bool, bits: int = 8, steps: int = 4, bad=None, dtype=torch.float32, lrs=None, **opts):
    """``steps`` steps of ``cls`` over :data:`SHAPES`: (params, optimizer, NaN/Inf warnings per step). ``lrs``: the
    learning rate of each step, written into the group before it (in place into a tensor lr)."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in SHAPES]
    opt = cls(
        params,
        state_bits=bits,
        min_quant_numel=0,
        block_size=16 if bits == 4 else 32,
        capturable=capturable,
        **kw,
        **opts,
    )
    caught = []
    with runtime.cpu_interpreter():
        for step in range(steps):
            if lrs is not None:
                group = opt.param_groups[0]
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lrs[step])
                else:
                    group["lr"] = float(torch.tensor(lrs[step], dtype=torch.float32))  # the tensor's value
            _grads(params, step, bad or {})
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                opt.step()
            caught.append(sum("NaN/Inf" in str(x.message) for x in w))
    return params, opt, caught


def _assert_same(a, opt_a, b, opt_b) -> None:
    """Ordinary run ``a`` and capturable run ``b`` ended alike, bit for bit. A parameter skipped on its first step
    has no state after an ordinary step and a zero state at step 0 after a capturable one: both step alike next."""
    for pa, pb in zip(a, b):
        assert torch.equal(pa, pb), tuple(pa.shape)
        sa, sb = opt_a.state.get(pa, {}), opt_b.state[pb]
        step = sb["step"]
        assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.dim() == 0
        assert int(step) == sa.get("step", 0)
        if not sa:
            continue
        assert sorted(sa) == sorted(sb)
        for k in sa:
            if k != "step":
                assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("bits", [32, 16, 8, 4])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_equals_an_ordinary_step(cls, kw, bits):
    before = sum(dispatch.stats.values())
    a, opt_a, warned_a = _run(cls, kw, False, bits, bad=BAD)
    mid = sum(dispatch.stats.values())
    b, opt_b, warned_b = _run(cls, kw, True, bits, bad=BAD)
    # both through the kernels; one bucket per layout (factored matrices and vectors take separate launches) and
    # capturable step (the counts are on the device: tensors whose counts differ share it), one per step count in
    # ordinary steps
    layouts = 2 if cls in (lowmemopt.Adafactor, lowmemopt.CAME) else 1
    assert sum(dispatch.stats.values()) - mid == 4 * layouts and mid - before > 4 * layouts
    _assert_same(a, opt_a, b, opt_b)
    assert opt_a.nonfinite_skips == opt_b.nonfinite_skips == 3
    # an ordinary step's skips are told at the next step; a capturable step counts them, it does not warn
    assert warned_a == [0, 1, 1, 1] and warned_b == [0, 0, 0, 0]


@pytest.mark.parametrize("update", ["nearest", "kahan"])
def test_bf16_parameters(update):
    kw = dict(lr=1e-2, weight_decay=0.1, bf16_update=update)
    a, opt_a, _ = _run(lowmemopt.AdamW, kw, False, dtype=torch.bfloat16)
    b, opt_b, _ = _run(lowmemopt.AdamW, kw, True, dtype=torch.bfloat16)
    _assert_same(a, opt_a, b, opt_b)


LR_CASES = [
    CASES[0],
    CASES[2],
    CASES[3],
    CASES[4],
    CASES[5],
    (
        lowmemopt.Adafactor,
        dict(lr=1e-2, relative_step=False, scale_parameter=False, warmup_init=False, weight_decay=0.1),
    ),
    CASES[7],
]


@pytest.mark.parametrize("cls,kw", LR_CASES, ids=[c.__name__ for c, _ in LR_CASES])
def test_a_learning_rate_tensor_changed_in_place(cls, kw):
    """A scheduler writes a tensor lr in place (a captured graph reads it at every replay): the steps follow it as
    ordinary steps follow a number, bit for bit."""
    lrs = [1e-2, 3e-3, 7e-4, 2e-2]
    a, opt_a, _ = _run(cls, kw, False, lrs=lrs)
    b, opt_b, _ = _run(cls, dict(kw, lr=torch.tensor(kw["lr"])), True, lrs=lrs)
    _assert_same(a, opt_a, b, opt_b)


@pytest.mark.parametrize("cls", [lowmemopt.AdamW, lowmemopt.LAMB, lowmemopt.Adafactor, lowmemopt.CAME])
def test_reads_nothing_back(cls, monkeypatch):
    """No host read of a tensor's value from lowmemopt's code during a capturable step (on a GPU each would be a
    synchronization, and is not allowed in a capture): ``item``, ``tolist``, ``bool``, ``float``, ``int``."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
    kw = {} if cls is lowmemopt.Adafactor else dict(lr=torch.tensor(1e-2))
    opt = cls(params, state_bits=8, min_quant_numel=0, block_size=32, capturable=True, **kw)
    reads = []

    def guard(name):
        real = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("lowmemopt"):
                reads.append(f"{name} from {caller}")
            return real(self, *args, **kwargs)

        return read

    with runtime.cpu_interpreter():
        for step in range(3):
            _grads(params, step, BAD)
            with monkeypatch.context() as m:
                for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
                    m.setattr(torch.Tensor, name, guard(name))
                opt.step()
    assert reads == []
    assert opt.nonfinite_skips == 3  # (read after the steps: this one waits for the device)
    opt.nonfinite_skips = 0
    assert opt.nonfinite_skips == 0


def test_state_dict_round_trip_and_back_to_ordinary_steps():
    """A capturable run's state dict loads into an ordinary optimizer (and the counts come back to the host), and an
    ordinary run's into a capturable one: each continues as one run would."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    whole, opt_whole, _ = _run(lowmemopt.AdamW, kw, False, steps=4, bad=BAD)

    first, opt_first, _ = _run(lowmemopt.AdamW, kw, True, steps=2, bad=BAD)
    sd = opt_first.state_dict()
    assert all(isinstance(st["step"], torch.Tensor) for st in sd["state"].values())
    for flip in (False, True):  # continue ordinary, or capturable again
        params = [torch.nn.Parameter(p.detach().clone()) for p in first]
        opt = lowmemopt.AdamW(params, state_bits=8, min_quant_numel=0, block_size=32, capturable=flip, **kw)
        opt.load_state_dict(copy.deepcopy(sd))  # (loaded slots are the state dict's tensors, not copies)
        assert all(g["capturable"] is flip for g in opt.param_groups)  # the option stays this optimizer's
        with runtime.cpu_interpreter(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in (2, 3):
                _grads(params, step, BAD)
                opt.step()
        for p, q in zip(whole, params):
            assert torch.equal(p, q)
            if p in opt_whole.state:
                assert int(opt.state[q]["step"]) == opt_whole.state[p]["step"]
                assert isinstance(opt.state[q]["step"], torch.Tensor) is flip

    # an ordinary optimizer's int counts, turned capturable in place
    a, opt_a, _ = _run(lowmemopt.AdamW, kw, False, steps=2)
    opt_a.param_groups[0]["capturable"] = True
    with runtime.cpu_interpreter():
        for step in (2, 3):
            _grads(a, step, {})
            opt_a.step()
    b, opt_b, _ = _run(lowmemopt.AdamW, kw, False, steps=4)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert int(opt_a.state[p]["step"]) == opt_b.state[q]["step"] == 4


def test_adafactor_warmup_init():
    kw = dict(beta1=None, warmup_init=True)  # rho = min(1e-6 t, 1 / sqrt(t)); no first moment
    a, opt_a, _ = _run(lowmemopt.Adafactor, kw, False, bad=BAD)
    b, opt_b, _ = _run(lowmemopt.Adafactor, kw, True, bad=BAD)
    _assert_same(a, opt_a, b, opt_b)


def test_optimizers_without_such_kernels_refuse_at_construction():
    with pytest.raises(ValueError, match="does not support capturable=True"):
        lowmemopt.AdafactorTorch([torch.nn.Parameter(torch.zeros(4))], capturable=True)

    class CustomMath(AdamAlgorithm):  # computes its update itself: no fused kernel
        def update(self, p, g, state, group, step, reduce=None):
            return super().update(p, g, state, group, step)

    class Custom(lowmemopt.AdamW):
        algorithm = CustomMath()

    with pytest.raises(ValueError, match="does not support capturable=True"):
        Custom([torch.nn.Parameter(torch.zeros(4))], capturable=True)


@pytest.mark.parametrize(
    "opts,match",
    [
        (dict(paged="cpu"), "cannot page state"),
        (dict(bf16_update="stochastic"), "stochastically"),
        (dict(capturable=1), "expected a bool"),
    ],
)
def test_bad_options(opts, match):
    kw = {"capturable": True, **opts}
    with pytest.raises((ValueError, TypeError), match=match):
        lowmemopt.AdamW([torch.nn.Parameter(torch.zeros(4))], **kw)


def test_galore_groups_refuse():
    w = torch.nn.Parameter(torch.randn(16, 8))
    with pytest.raises(ValueError, match="GaLore"):
        lowmemopt.AdamW([{"params": [w], "rank": 2}], capturable=True)


def _unchanged_after(opt, params, match):
    """``opt.step()`` raises ValueError(``match``) and leaves every parameter and state as they were."""
    before = [p.detach().clone() for p in params]
    states = {
        id(p): {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state.get(p, {}).items()}
        for p in params
    }
    with runtime.cpu_interpreter(), pytest.raises(ValueError, match=match):
        opt.step()
    for p, b in zip(params, before):
        assert torch.equal(p, b)
        for k, v in states[id(p)].items():
            now = opt.state[p][k]
            assert torch.equal(now, v) if isinstance(v, torch.Tensor) else now == v, k


def test_mixed_groups_and_cpu_without_kernels_refuse():
    a, b = torch.nn.Parameter(torch.randn(40)), torch.nn.Parameter(torch.randn(40))
    opt = lowmemopt.AdamW([{"params": [a], "capturable": True}, {"params": [b]}], lr=1e-2)
    a.grad, b.grad = torch.randn(40), torch.randn(40)
    _unchanged_after(opt, [a, b], "some param groups and not in others")

    opt = lowmemopt.AdamW([a], lr=1e-2, capturable=True)
    with pytest.raises(ValueError, match="one CUDA device"):  # no interpreter: the CPU has no Triton kernels
        opt.step()


def test_a_parameter_no_kernel_takes_refuses():
    """A non-contiguous parameter has no fused kernel: the step raises (a capturable step cannot fall back to the
    per-tensor path), and nothing is written."""
    ok = torch.nn.Parameter(torch.randn(64))
    odd = torch.nn.Parameter(torch.randn(16, 8).t())
    opt = lowmemopt.AdamW([ok, odd], lr=1e-2, state_bits=8, min_quant_numel=0, block_size=32, capturable=True)
    ok.grad, odd.grad = torch.randn(64), torch.randn(8, 16)
    _unchanged_after(opt, [ok, odd], "cannot take the fused kernels")


def test_per_layer_updates_refuse():
    model = torch.nn.Linear(4, 4)
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2, capturable=True)
    with pytest.raises(ValueError, match="capturable"):
        lowmemopt.step_in_backward(model, opt)


def test_safetensors_save_and_load(tmp_path):
    """``save_state`` of a capturable optimizer (device counts written as ints) and ``load_state`` into another
    capturable optimizer continue as one run."""
    kw = dict(lr=1e-2, weight_decay=0.1)
    whole, opt_whole, _ = _run(lowmemopt.CAME, kw, True, steps=4, bad=BAD)
    first, opt_first, _ = _run(lowmemopt.CAME, kw, True, steps=2, bad=BAD)
    lowmemopt.save_state(opt_first, tmp_path / "opt.safetensors")
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt = lowmemopt.CAME(params, state_bits=8, min_quant_numel=0, block_size=32, capturable=True, **kw)
    lowmemopt.load_state(opt, tmp_path / "opt.safetensors")
    with runtime.cpu_interpreter():
        for step in (2, 3):
            _grads(params, step, BAD)
            opt.step()
    for p, q in zip(whole, params):
        assert torch.equal(p, q)
        assert torch.equal(opt_whole.state[p]["step"], opt.state[q]["step"])


def test_an_lr_scheduler_fills_the_tensor_in_place():
    """torch's schedulers write a tensor lr in place (``fill_``), which a captured graph reads at every replay: a
    capturable run under ``LambdaLR`` equals an ordinary one under it, bit for bit."""
    runs = []
    for capturable in (False, True):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]
        opt = lowmemopt.AdamW(
            params,
            lr=torch.tensor(1e-2),
            weight_decay=0.1,
            state_bits=8,
            min_quant_numel=0,
            block_size=32,
            capturable=capturable,
        )
        lr = opt.param_groups[0]["lr"]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.7**epoch)
        with runtime.cpu_interpreter():
            for step in range(4):
                _grads(params, step, {})
                opt.step()
                sched.step()
        assert opt.param_groups[0]["lr"] is lr  # the same tensor, changed in place
        runs.append(params)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_a_number_lr_warns_when_captured(monkeypatch):
    """While a stream captures, a learning rate that is not a tensor on the device would be a constant of the graph:
    the step warns. (Capture stood in for: no GPU here.)"""
    from lowmemopt.work import capture

    params = [torch.nn.Parameter(torch.randn(64))]
    for lr, warns in ((1e-2, True), (torch.tensor(1e-2), False)):
        opt = lowmemopt.AdamW(params, lr=lr, state_bits=8, min_quant_numel=0, block_size=32, capturable=True)
        params[0].grad = torch.randn(64)
        with runtime.cpu_interpreter():
            opt.step()  # (not capturing: no warning either way)
            monkeypatch.setattr(capture, "capturing", lambda device: True)
            monkeypatch.setattr(capture, "_KEPT", [])
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.step()
            monkeypatch.undo()
        assert any("keeps this value at every replay" in str(w.message) for w in caught) is warns
