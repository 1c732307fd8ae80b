"""The non-finite check decided on the device (lowmemopt.pipeline.finite) with compiled kernels on a CUDA device: a
parameter whose gradient has a NaN / Inf keeps its value, state and step count, bit for bit, without any host
synchronization before the launches; the others step as with the host-side check. (``test_finite_on_device.py`` runs
the same under the interpreter on the CPU, bit for bit against the host check; here the multi-pass kernels' fp32
atomics may round their sums differently between two runs, and GaLore's batched and single products
(``BATCHED_WITH_A_SKIP``) may too, so those stepped parameters are compared within rounding.)
Skipped without a CUDA device (conftest.py skips the ``gpu`` marker)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import count_device_checks

import lowmemopt
from lowmemopt import optimizer as optimizer_module
from lowmemopt.benchmark import sync_messages

pytestmark = pytest.mark.gpu

SHAPES = [(96, 160), (96, 160), (300,), (40, 72), (5,)]
#: (step, param): the gradients made non-finite; params 0, 1 and 3 are GaLore's matrices in the projected runs
BAD = {(1, 0): float("nan"), (2, 3): float("inf"), (4, 2): float("nan"), (5, 1): -float("inf")}
CASES = [
    (lowmemopt.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.SGD, dict(lr=1e-2, momentum=0.9)),
    (lowmemopt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    (lowmemopt.LAMB, dict(lr=1e-2, weight_decay=0.1)),
    (lowmemopt.LARS, dict(lr=1e-2, momentum=0.9, weight_decay=1e-3)),
    (lowmemopt.Adafactor, dict(beta1=0.9, weight_decay=0.1)),
    (lowmemopt.CAME, dict(lr=1e-3, weight_decay=0.1)),
]
#: kernels without atomics: the device-side run equals the host-side one bit for bit
EXACT = {lowmemopt.AdamW, lowmemopt.SGD, lowmemopt.Lion}


def _groups(params, galore: bool) -> list[dict]:
    """The param groups: all in one, or (``galore``) params 0, 1 and 3 in a rank-8 GaLore group (bases made at the
    first step only)."""
    if not galore:
        return [{"params": params}]
    return [
        {"params": [params[0], params[1], params[3]], "rank": 8, "update_proj_gap": 100},
        {"params": [params[2], params[4]]},
    ]


def _snapshot(opt, p):
    state = opt.state.get(p, {})
    return p.detach().clone(), {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}


def _run(cls, kw, bits, on_device, monkeypatch, galore=False):
    """Six steps on CUDA with the gradients of ``BAD`` non-finite. Checks at each step (its skips settled by reading
    ``nonfinite_skips``) that a skipped parameter and its state are untouched. Returns (params, optimizer, warnings
    per step, device-side checks made)."""
    monkeypatch.setattr(optimizer_module, "DEFER_FINITE_CHECK", on_device)
    checks = count_device_checks(monkeypatch)
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    opt = cls(_groups(params, galore), state_bits=bits, min_quant_numel=0, **kw)
    gen = torch.Generator().manual_seed(1)
    caught = []
    for step in range(6):
        bad = []
        for i, p in enumerate(params):
            g = torch.randn(p.shape, generator=gen)
            if (step, i) in BAD:
                g.view(-1)[7] = BAD[(step, i)]
                bad.append((p, _snapshot(opt, p)))
            p.grad = g.cuda()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
            opt.nonfinite_skips  # noqa: B018 (settles the step's skips, decided on the device, now)
        caught.append(sum("NaN/Inf" in str(x.message) for x in w))
        for p, (value, state) in bad:
            assert torch.equal(p, value), (step, tuple(p.shape))
            now = opt.state.get(p, {})
            assert sorted(now) == sorted(state), (step, tuple(p.shape))
            for k, v in state.items():
                assert torch.equal(now[k], v) if isinstance(v, torch.Tensor) else now[k] == v, (step, k)
    torch.cuda.synchronize()
    return params, opt, caught, len(checks)


#: GaLore's matrices (params 0, 1 and 3 of _groups) that share a shape class with a matrix skipped at some step. On
#: that step the host-checked run leaves the skipped one out, so its classmate is projected and projected back alone
#: (one torch.matmul each way), while the device-decided run keeps both in the batch (one torch.bmm each way, the
#: skipped one masked by its flag). cuBLAS's batched and single products may sum in different orders (on an H100 they
#: do: the two runs differed bitwise on a (96, 160) matrix), so these are compared within rounding; the CPU's products
#: are equal either way (test_finite_on_device.py compares them bit for bit). The skipped parameters and their state
#: are compared bit for bit at each step (_run), and every other parameter here.
BATCHED_WITH_A_SKIP = {
    i for i in (0, 1, 3) for j in (0, 1, 3) if i != j and SHAPES[i] == SHAPES[j] and any(k in (i, j) for _, k in BAD)
}


def _compare(cls, a, opt_a, b, opt_b, rounded=frozenset()):
    """Same step counts; the parameters equal bit for bit where the kernels have no atomics (``EXACT``) and the
    parameter is not in ``rounded``, else within rounding."""
    for i, (pa, pb) in enumerate(zip(a, b)):
        assert opt_a.state[pa]["step"] == opt_b.state[pb]["step"]
        if cls in EXACT and i not in rounded:
            assert torch.equal(pa, pb), (i, tuple(pa.shape))
        else:
            torch.testing.assert_close(pa, pb, rtol=1e-5, atol=1e-6)


#: (cls, kw, bits, galore): every algorithm at 32 and 8 bits; GaLore (AdamW, CAME) at 8
SKIP_CASES = [(cls, kw, bits, False) for cls, kw in CASES for bits in (32, 8)] + [
    (CASES[0][0], CASES[0][1], 8, True),
    (CASES[6][0], CASES[6][1], 8, True),
]


@pytest.mark.parametrize(
    "cls,kw,bits,galore", SKIP_CASES, ids=[f"{c.__name__}-{b}{'-galore' if g else ''}" for c, _, b, g in SKIP_CASES]
)
def test_skipped_parameters_are_untouched_on_cuda(cls, kw, bits, galore, monkeypatch):
    # GaLore: the projected matrices' low-rank kernels and the batched apply pass read the flags; the first step (the
    # bases are made) takes the host check
    a, opt_a, warned_a, checks_a = _run(cls, kw, bits, True, monkeypatch, galore)
    b, opt_b, warned_b, checks_b = _run(cls, kw, bits, False, monkeypatch, galore)
    assert checks_a == (5 if galore else 6) and checks_b == 0  # every step decided on the device (GaLore's first not)
    assert warned_a == warned_b == [0, 1, 1, 0, 1, 1]
    _compare(cls, a, opt_a, b, opt_b, BATCHED_WITH_A_SKIP if galore else frozenset())
    assert [opt_a.state[p]["step"] for p in a] == [5, 5, 5, 5, 6]


def _synchronizations(fn) -> list[str]:
    """The host-device synchronizations ``fn()`` makes (:func:`lowmemopt.benchmark.sync_messages`: only torch's
    per-sync warning counts, not the notice it gives once per process when the mode is first set, which the first
    such test in each pytest-xdist worker saw), after the work queued before it."""
    torch.cuda.synchronize()
    return sync_messages(fn)


@pytest.mark.parametrize("galore", [False, True], ids=["full-rank", "galore"])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_a_steady_step_does_not_synchronize(cls, kw, galore):
    """After the warm-up (state made, kernels compiled, GaLore's bases computed), a step does not synchronize the host
    with the device: its flags are copied to the host without waiting and read at the next step (after an event of
    that step's), and nothing before the launches waits for the GPU, not even a launch table made for new addresses
    (each step's gradients are fresh tensors, as after zero_grad())."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in SHAPES]
    opt = cls(_groups(params, galore), state_bits=8, min_quant_numel=0, **kw)

    def fresh_grads():
        for p in params:
            p.grad = torch.randn_like(p)

    for _ in range(3):
        fresh_grads()
        opt.step()
    fresh_grads()
    syncs = _synchronizations(opt.step)
    assert len(syncs) == 0, syncs


@pytest.mark.parametrize("bucket_bytes", [0, 1 << 20])
@pytest.mark.parametrize("cls,kw", [CASES[0], CASES[6]], ids=["AdamW", "CAME"])
def test_per_layer_updates_synchronize_once_per_backward(cls, kw, bucket_bytes):
    # step_in_backward: the hooks' updates (alone or in buckets) wait for nothing; the flags are read at the end
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()
    opt = cls(model.parameters(), state_bits=8, min_quant_numel=0, **kw)
    lowmemopt.step_in_backward(model, opt, bucket_bytes=bucket_bytes)
    x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 64, device="cuda")
    for _ in range(3):
        torch.nn.functional.mse_loss(model(x), y).backward()
    loss = torch.nn.functional.mse_loss(model(x), y)
    syncs = _synchronizations(loss.backward)
    assert len(syncs) == 1, syncs
