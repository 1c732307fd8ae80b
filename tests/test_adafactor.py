"""Adafactor: every flag combination against transformers on 1-D..4-D shapes, low-precision params, exact state bytes,
and the torch.optim.Adafactor variant (AdafactorTorch). The common suite (tests/optim_info.py) covers the rest."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import clone_params, make_params, run, set_grads

import lowmemopt

transformers_optimization = pytest.importorskip("transformers.optimization")

#: 1-D (unfactored), 2-D, 3-D (a batch of matrices), 4-D (a conv weight: factored over the kernel's last two dims)
SHAPES = [(300,), (37, 53), (5, 7, 129), (8, 3, 5, 5)]

FLAGS = [
    dict(scale_parameter=sp, beta1=b1, weight_decay=wd, **step)
    for step in (dict(), dict(warmup_init=True), dict(lr=1e-2, relative_step=False))
    for sp in (True, False)
    for b1 in (None, 0.9)
    for wd in (0.0, 0.01)
]


def _same_trajectory(ours_cls, ref_cls, kwargs, params, steps=20):
    ref_params = clone_params(params)
    ours, ref = ours_cls(params, **kwargs), ref_cls(ref_params, **kwargs)
    for t in range(steps):
        set_grads(params, t)
        for p, r in zip(params, ref_params):
            r.grad = p.grad.clone()
        ours.step()
        ref.step()
    return ours, ref, ref_params


@pytest.mark.parametrize("kwargs", FLAGS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_transformers_for_every_flag_combination(kwargs):
    params = make_params(SHAPES)
    ours, ref, ref_params = _same_trajectory(lowmemopt.Adafactor, transformers_optimization.Adafactor, kwargs, params)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)  # bit-identical: same operations in the same order
        # same state names and shapes as transformers; with warmup_init the params barely move, the state does
        ours_state, ref_state = ours.state[p], ref.state[r]
        assert set(ours_state) == set(ref_state) - {"RMS"}
        for key, value in ours_state.items():
            if key != "step":
                assert torch.equal(value, ref_state[key]), key


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_match_transformers_fp32_math(dtype):
    """transformers upcasts fp16/bf16 params and gradients to fp32 for the math and rounds once: so do we."""
    kwargs = dict(beta1=0.9, weight_decay=0.01)
    params = make_params(SHAPES, dtype=dtype)
    ours, ref, ref_params = _same_trajectory(lowmemopt.Adafactor, transformers_optimization.Adafactor, kwargs, params)
    for p, r in zip(params, ref_params):
        assert p.dtype == dtype
        assert torch.equal(p, r)


def test_manual_lr_schedule_and_tensor_lr():
    """relative_step=False follows the group's lr (a scheduler's change takes effect); a 0-dim tensor lr works too."""
    params = make_params([(20, 30)])
    twin = clone_params(params)
    opt = lowmemopt.Adafactor(params, lr=1e-2, relative_step=False, scale_parameter=False)
    opt_t = lowmemopt.Adafactor(twin, lr=torch.tensor(1e-2), relative_step=False, scale_parameter=False)
    run(opt, params, 3)
    run(opt_t, twin, 3)
    torch.testing.assert_close(params[0], twin[0])
    opt.param_groups[0]["lr"] = 0.0
    before = params[0].detach().clone()
    run(opt, params, 1, start=3)
    assert torch.equal(params[0], before)


# ---------------------------------------------------------------------------------------------------------------------
# state bytes per parameter (fp32 row/column statistics; 8-bit applies to the full-size slots)


@pytest.mark.parametrize(
    "shape,beta1,bits,expected",
    [
        ((1024, 1024), None, 8, 4 * 2048),  # row + col only: 0.0078 B/param at every state_bits
        ((1024, 1024), None, 32, 4 * 2048),
        ((1024, 1024), 0.9, 8, (1 << 20) + 4 * 4096 + 4 * 2048),  # 1.0234 B/param
        ((1024, 1024), 0.9, 32, 4 * (1 << 20) + 4 * 2048),
        ((1 << 20,), None, 8, (1 << 20) + 4 * 4096),  # 1-D: the unfactored second moment is quantized
        ((1 << 20,), 0.9, 8, 2 * ((1 << 20) + 4 * 4096)),
    ],
)
def test_state_bytes_per_param(shape, beta1, bits, expected):
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = lowmemopt.Adafactor([p], beta1=beta1, state_bits=bits)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_nbytes() == expected
    for key in ("exp_avg_sq_row", "exp_avg_sq_col"):
        if key in opt.state[p]:
            assert opt.state[p][key].dtype == torch.float32


def test_bytes_per_param_8bit_on_a_1m_matrix():
    """Adafactor(beta1=0.9) at 8 bits: <= 1.03 B/param; Adafactor(beta1=None): ~0 (row + column statistics only)."""
    per_param = {}
    for beta1 in (0.9, None):
        p = torch.nn.Parameter(torch.zeros(1024, 1024))
        opt = lowmemopt.Adafactor8bit([p], beta1=beta1)
        p.grad = torch.ones_like(p)
        opt.step()
        per_param[beta1] = opt.state_nbytes() / p.numel()
    assert per_param == {0.9: 1 + 4 / 256 + 8 / 1024, None: 8 / 1024}
    assert per_param[0.9] <= 1.03 and per_param[None] < 0.01


def test_adafactor8bit_alias():
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = lowmemopt.Adafactor8bit(p, beta1=0.9)
    assert isinstance(opt, lowmemopt.Adafactor) and opt.defaults["state_bits"] == 8
    assert opt.defaults["relative_step"] and opt.defaults["lr"] is None
    with pytest.raises(ValueError, match=r"Adafactor8bit has state_bits=8 \(its name\): state_bits=32 contradicts"):
        lowmemopt.Adafactor8bit(p, state_bits=32)


# ---------------------------------------------------------------------------------------------------------------------
# AdafactorTorch: torch.optim.Adafactor semantics


@pytest.mark.parametrize(
    "kwargs",
    [dict(), dict(lr=3e-2, weight_decay=0.1), dict(beta2_decay=-0.5, d=2.0, eps=(1e-3, 1e-2)), dict(maximize=True)],
    ids=["defaults", "weight_decay", "decay-d-eps", "maximize"],
)
def test_adafactor_torch_matches_torch_on_all_ranks(kwargs):
    """Bit for bit (docs/torch_optim.md says so): the step's scalars in float64 from the same norms as torch's, kept on
    the device, and the update added in one rounding, as torch's ``add_(u, alpha=-alpha / denom)``."""
    doc = (Path(__file__).parents[1] / "docs" / "torch_optim.md").read_text()
    assert "**`AdafactorTorch`'s step**" in doc and "bit for bit" in doc
    params = make_params(SHAPES)
    ours, ref, ref_params = _same_trajectory(lowmemopt.AdafactorTorch, torch.optim.Adafactor, kwargs, params)
    for p, r in zip(params, ref_params):
        assert torch.equal(p, r)


def _torch_problem(i: int):
    """Problem ``i``: a parameter (1-D; 2-D with 16 | columns, the native kernel's; any 2-D; 3-D), its dtype,
    ``torch.optim.Adafactor``'s keywords and six gradients, all of a scale drawn from 1e-3 to 10."""
    gen = torch.Generator().manual_seed(i)

    def pick(options):
        return options[int(torch.randint(len(options), (), generator=gen))]

    def scale():
        return 10.0 ** float(torch.empty(()).uniform_(-3, 1, generator=gen))

    r, c, b = (int(x) for x in torch.randint(1, 40, (3,), generator=gen))
    shape = pick([(r * c,), (r, 16 * c), (r, 16 * c), (r, c), (b % 4 + 1, r, c)])
    dtype = pick([torch.float32, torch.float32, torch.float64])
    kwargs = dict(
        lr=pick([1e-2, 3e-2, 1e-3, 0.3]),
        beta2_decay=pick([-0.8, -0.5, -1.0, -0.3]),
        eps=pick([(None, 1e-3), (1e-3, 1e-3), (1e-30, 1e-2), (None, 1e-5)]),
        d=pick([1.0, 1.5, 4.0]),
        weight_decay=pick([0.0, 0.0, 0.01, 0.1]),
        maximize=pick([False, True]),
    )
    start = (torch.randn(shape, generator=gen) * scale()).to(dtype)
    grads = [(torch.randn(shape, generator=gen) * scale()).to(dtype) for _ in range(6)]
    return start, kwargs, grads


@pytest.mark.parametrize("native", [False, True], ids=["eager", "native"])
def test_adafactor_torch_is_torch_bit_for_bit(native, monkeypatch):
    """200 random problems (shapes, fp32 / float64, every keyword), six steps each: parameters and state equal
    ``torch.optim.Adafactor``'s after every step, on the eager path and (fp32 matrices with 16 | columns, the size
    threshold lowered) on the native C kernel."""
    import lowmemopt.compiled as compiled
    import lowmemopt.cpu as cpu
    from lowmemopt.cpu import factored

    monkeypatch.setattr(compiled, "ENABLED", False)
    monkeypatch.setattr(cpu, "ENABLED", native)
    monkeypatch.setattr(factored, "MIN_NUMEL", 1)
    stepped = []
    real = cpu.step_factored
    monkeypatch.setattr(cpu, "step_factored", lambda *a, **k: stepped.append(real(*a, **k)) or stepped[-1])
    bad, native_problems = [], 0
    for i in range(200):
        start, kwargs, grads = _torch_problem(i)
        native_problems += start.dim() == 2 and start.shape[1] % 16 == 0 and start.dtype == torch.float32
        ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
        opt, ref_opt = lowmemopt.AdafactorTorch([ours], **kwargs), torch.optim.Adafactor([ref], **kwargs)
        for t, g in enumerate(grads):
            ours.grad, ref.grad = g.clone(), g.clone()
            opt.step()
            ref_opt.step()
            state, ref_state = opt.state[ours], ref_opt.state[ref]
            if not torch.equal(ours, ref) or any(
                not torch.equal(v, ref_state[k]) for k, v in state.items() if k != "step"
            ):
                bad.append((i, t, tuple(start.shape), start.dtype, kwargs))
                break
    assert not bad, f"{len(bad)} of 200 problems differ from torch, first: {bad[0]}"
    assert stepped.count(factored.STEPPED) == (6 * native_problems if native else 0) and native_problems > 40


def test_adafactor_torch_loads_torch_state_and_continues():
    start = make_params(SHAPES)
    ref = clone_params(start)
    torch_opt = torch.optim.Adafactor(ref, lr=1e-2, weight_decay=0.01)
    run(torch_opt, ref, 5)
    ours = clone_params(ref)
    opt = lowmemopt.AdafactorTorch(ours, lr=1e-2, weight_decay=0.01)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    assert opt.state[ours[0]]["step"] == 5 and opt.state[ours[1]]["row_var"].shape == (37, 1)
    run(torch_opt, ref, 5, start=5)
    run(opt, ours, 5, start=5)
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_the_two_variants_differ():
    """Documents why both exist: with the same lr and weight decay, transformers decays by ``lr RMS(p) wd`` and torch
    by ``lr wd``, so on parameters of RMS ~0.1 the two trajectories part."""
    start = [torch.nn.Parameter(0.1 * p.detach()) for p in make_params([(37, 53)])]
    hf, th = clone_params(start), clone_params(start)
    run(lowmemopt.Adafactor(hf, lr=1e-2, relative_step=False, weight_decay=1.0), hf, 10)
    run(lowmemopt.AdafactorTorch(th, lr=1e-2, weight_decay=1.0), th, 10)
    gap = float((hf[0] - th[0]).detach().norm())
    moved = float((th[0] - start[0]).detach().norm())
    assert gap > 0.05 * moved, (gap, moved)
