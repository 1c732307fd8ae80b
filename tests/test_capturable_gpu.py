"""Capturable steps on a CUDA device: ``opt.step()`` captured in a CUDA graph and replayed equals the same steps taken
eagerly, bit for bit (parameters, state, step counts, skips), with a learning-rate tensor changed between replays and
NaN gradients in some of them; an eager capturable step synchronizes nowhere. (``test_capturable.py`` checks the same
arithmetic under the interpreter on the CPU.) Skipped without a CUDA device (conftest.py skips the ``gpu`` marker)."""

from __future__ import annotations

import pytest
import torch

import lowmemopt

pytestmark = pytest.mark.gpu

SHAPES = [(96, 160), (300,), (40, 72), (5,), (1000,)]
CASES = [
    (lowmemopt.AdamW, dict(weight_decay=0.1)),
    (lowmemopt.SGD, dict(momentum=0.9, nesterov=True)),
    (lowmemopt.Lion, dict(weight_decay=0.1)),
    (lowmemopt.LAMB, dict(weight_decay=0.1)),
    (lowmemopt.LARS, dict(momentum=0.9, weight_decay=1e-3)),
    (
        lowmemopt.Adafactor,
        dict(beta1=0.9, relative_step=False, scale_parameter=True, warmup_init=False, weight_decay=0.1),
    ),
    (lowmemopt.CAME, dict(weight_decay=0.1)),
]
#: kernels without atomics: a replay equals the eager step bit for bit (the others' fp32 atomic sums may round
#: differently from one run to the next: within rounding)
EXACT = {lowmemopt.AdamW, lowmemopt.SGD, lowmemopt.Lion}
LRS = [1e-2, 5e-3, 2e-3, 1e-3, 3e-3, 8e-3]
#: (replay, param): gradients made non-finite
BAD = {(1, 0): float("nan"), (3, 2): float("inf"), (4, 0): float("nan")}


def _grads(shapes, k: int, dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + k)
    out = []
    for i, s in enumerate(shapes):
        g = torch.randn(s, generator=gen)
        if (k, i) in BAD:
            g.view(-1)[7] = BAD[(k, i)]
        out.append(g.to(dtype))
    return out


def _make(cls, kw, bits, dtype):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device="cuda", dtype=dtype)) for s in SHAPES]
    opt = cls(params, lr=torch.tensor(LRS[0], device="cuda"), state_bits=bits, min_quant_numel=0, capturable=True, **kw)
    for p in params:  # static gradient buffers: a graph reads them by address
        p.grad = torch.zeros_like(p)
    return params, opt


def _set(params, opt, k: int, dtype) -> None:
    for p, g in zip(params, _grads(SHAPES, k, dtype)):
        p.grad.copy_(g)
    opt.param_groups[0]["lr"].fill_(LRS[k])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bits", [32, 8])
@pytest.mark.parametrize("cls,kw", CASES, ids=[c.__name__ for c, _ in CASES])
def test_a_captured_step_replays_as_eager_steps(cls, kw, bits, dtype):
    eager, opt_e = _make(cls, kw, bits, dtype)
    graphed, opt_g = _make(cls, kw, bits, dtype)
    # warm-up (state, compiled kernels, cached launch tables), then capture: the torch.cuda.graphs recipe
    _set(graphed, opt_g, 0, dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        opt_g.step()
    torch.cuda.current_stream().wait_stream(side)
    _set(eager, opt_e, 0, dtype)
    opt_e.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_g.step()
    # the capture ran nothing: replays take steps 2..6
    for k in range(1, len(LRS)):
        _set(graphed, opt_g, k, dtype)
        graph.replay()
        _set(eager, opt_e, k, dtype)
        opt_e.step()
    torch.cuda.synchronize()
    for a, b in zip(eager, graphed):
        sa, sb = opt_e.state[a], opt_g.state[b]
        assert sorted(sa) == sorted(sb)
        if cls in EXACT:
            assert torch.equal(a, b), tuple(a.shape)
            for key in sa:
                assert torch.equal(sa[key], sb[key]), key
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-3 if dtype == torch.float32 else 2e-2)
            assert torch.equal(sa["step"], sb["step"])
    assert [int(opt_g.state[p]["step"]) for p in graphed] == [4, 6, 5, 6, 6]
    assert opt_g.nonfinite_skips == opt_e.nonfinite_skips == 3


def test_an_eager_capturable_step_does_not_synchronize():
    params, opt = _make(lowmemopt.AdamW, dict(weight_decay=0.1), 8, torch.bfloat16)
    _set(params, opt, 0, torch.bfloat16)
    opt.step()  # the first step makes the state and compiles
    _set(params, opt, 1, torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.nonfinite_skips == 1
