"""A bucket's small factored steps (Adafactor, CAME) in one native call, ``lmo_factored_steps``, each matrix on one
thread: bit for bit what one call per matrix gives, through non-finite gradients, beside a matrix large enough to keep
its own parallel region."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import clone_params, make_params

import lowmemopt
import lowmemopt.compiled as compiled
import lowmemopt.cpu as cpu
from lowmemopt.cpu import build, factored


@pytest.fixture(autouse=True)
def two_threads():
    if not cpu.available():
        pytest.skip(f"native CPU kernels unavailable: {build.build_error}")
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # (the call shares the matrices out among the threads)
    yield
    torch.set_num_threads(before)


CASES = [
    ("CAME", 8, {}),
    ("CAME", 32, {}),
    ("CAME", 4, {}),
    ("Adafactor", 8, dict(beta1=0.9, relative_step=False, lr=1e-2)),
    ("Adafactor", 32, dict(relative_step=False, lr=1e-2, weight_decay=0.1)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}")
def test_one_call_equals_one_call_per_matrix(case, monkeypatch):
    name, bits, kw = case
    monkeypatch.setattr(compiled, "ENABLED", False)
    # the 32-bit native path starts at MIN_NUMEL (65536), the quantized one at QUANT_MIN_NUMEL (4096)
    small = [(256, 256), (128, 512), (512, 160)] if bits == 32 else [(64, 64), (96, 128), (48, 256), (64, 80)]
    shapes = [*small, (96,), (1024, 1024)]  # a 1-D parameter (the eager path) and one of ALONE_NUMEL elements
    start = make_params(shapes)
    runs = []
    for together in (True, False):
        calls: list[int] = []
        real = factored._run_deferred
        monkeypatch.setattr(factored, "_run_deferred", lambda d: calls.append(len(d)) or real(d))
        monkeypatch.setattr(factored, "ALONE_NUMEL", factored.ALONE_NUMEL if together else 0)
        params = clone_params(start)
        kwargs = dict(lr=1e-3, weight_decay=0.01, state_bits=bits, min_quant_numel=64) | kw
        opt = getattr(lowmemopt, name)(params, **kwargs)
        skipped = []
        for step in range(4):
            for i, p in enumerate(params):
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            if step in (1, 2):
                params[step].grad.view(-1)[7] = float("inf") if step == 1 else float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                opt.step()
            skipped.append(opt.nonfinite_skips)
        assert skipped == [0, 1, 2, 2]
        assert [opt.state[p]["step"] for p in params] == [4, 3, 3] + [4] * (len(shapes) - 3)
        assert calls == ([len(small)] * 3 if together else []), calls  # (a first step makes the state first)
        runs.append((params, opt))
    (a, opt_a), (b, opt_b) = runs
    for x, y in zip(a, b):
        assert torch.equal(x, y)
        sa, sb = opt_a.state[x], opt_b.state[y]
        assert sa.keys() == sb.keys()
        for k, v in sa.items():
            assert torch.equal(v, sb[k]) if isinstance(v, torch.Tensor) else v == sb[k], k


def test_a_refused_step_raises_after_the_others_counted(monkeypatch):
    """A matrix the kernel refuses writes nothing and raises; the steps taken beside it in the same call count."""
    monkeypatch.setattr(compiled, "ENABLED", False)
    params = make_params([(64, 64), (96, 128), (48, 256)])
    opt = lowmemopt.CAME(params, lr=1e-3, state_bits=8, min_quant_numel=64)
    for p in params:
        p.grad = torch.randn(p.shape)
    opt.step()
    real = factored._run_deferred

    def refuse_second(deferred):
        deferred[1][0].f.bs = 8  # (lmo_fact's check refuses a block size under 16)
        return real(deferred)

    monkeypatch.setattr(factored, "_run_deferred", refuse_second)
    before = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match="lmo_came_step rejected its arguments"):
        opt.step()
    assert [opt.state[p]["step"] for p in params] == [2, 1, 2]
    assert torch.equal(params[1], before[1]) and not torch.equal(params[0], before[0])
