"""The common suite, run on every entry of ``optim_info.OPTIMIZERS``: 32-bit parity with the reference, 8-bit and 16-bit
error bounds against the 32-bit twin, exact state bytes, bad inputs, closures, and the non-finite gradient policy."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from helpers import clone_params, make_params, run, run_with_reference, set_grads, trajectory_error
from optim_info import BY_NAME, OPTIMIZERS, SHAPES, STATEFUL

import lowmemopt
from lowmemopt.registry import needs_process_group

PARITY_CASES = [(info, i) for info in OPTIMIZERS for i in range(len(info.variants))]


@pytest.mark.parametrize("info,variant", PARITY_CASES, ids=[f"{i.name}-v{v}" for i, v in PARITY_CASES])
def test_parity_32bit(info, variant):
    """20 steps on odd 1-D/2-D/3-D shapes equal the reference optimizer to fp32 rounding."""
    kwargs = info.variants[variant]
    params = make_params(SHAPES)
    ref_params = clone_params(params)
    ours = info.cls(params, **kwargs)
    ref = info.reference(ref_params, **kwargs)
    run_with_reference(ours, params, ref, ref_params, 20)
    for p, r in zip(params, ref_params):
        torch.testing.assert_close(p, r, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("info,variant", PARITY_CASES, ids=[f"{i.name}-v{v}" for i, v in PARITY_CASES])
def test_parity_float64(info, variant):
    """float64 parameters step in float64 with float64 state, as torch.optim does: 10 steps equal the reference's
    float64 run to 1e-12 (every reference computes in the parameter's dtype)."""
    kwargs = info.variants[variant]
    params = make_params(SHAPES, dtype=torch.float64)
    ref_params = clone_params(params)
    ours = info.cls(params, **kwargs)
    ref = info.reference(ref_params, **kwargs)
    run_with_reference(ours, params, ref, ref_params, 10)
    for p, r in zip(params, ref_params):
        assert p.dtype == torch.float64
        torch.testing.assert_close(p, r, rtol=0, atol=1e-12)
    for state in ours.state.values():  # full-precision state: float64 (16/8/4-bit state: tests below)
        for key, v in state.items():
            if isinstance(v, torch.Tensor) and not key.startswith("galore."):
                assert v.dtype == torch.float64, key


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_steps_in_every_dtype(info, dtype):
    """Every dtype torch.optim steps steps here, at 32- and 8-bit state: the parameters keep their dtype, move, and
    stay finite; full-precision state is float64 for float64 parameters and fp32 otherwise; 8-bit state is codes
    (decoded to the math's dtype, float64 for float64, and within the entry's bound of the 32-bit twin)."""
    if dtype not in info.dtypes:
        pytest.skip(f"{info.name} does not step {dtype}")
    kwargs = STATEFUL[info.name]
    start = make_params([(96, 128), (300,)], dtype=dtype)
    runs, quantized = {}, False
    for bits in (32, 8):
        params = clone_params(start)
        opt = info.cls(params, state_bits=bits, **kwargs)
        run(opt, params, 5)
        runs[bits] = params
        for p, s in zip(params, start):
            assert p.dtype == dtype and torch.isfinite(p).all() and not torch.equal(p, s)
        full = torch.float64 if dtype == torch.float64 else torch.float32
        for p in params:
            for key, v in opt.state[p].items():
                if not isinstance(v, torch.Tensor) or key.startswith(("galore.", "bf16_update.")):
                    continue
                if key.endswith(".codes"):
                    assert bits == 8 and p.numel() >= 4096, key
                    quantized = True
                else:
                    assert v.dtype == (torch.float32 if key.endswith(".absmax") else full), (key, v.dtype)
    if dtype == torch.float64:
        err = trajectory_error(runs[8], runs[32], start)
        assert err < info.bound8 and (err > 0) == quantized, err


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [16, 8])
def test_low_bit_close_to_32bit_twin(info, bits):
    """50 steps at 16/8-bit state stay within the entry's bound of the 32-bit trajectory (relative to distance
    moved)."""
    kwargs = STATEFUL[info.name]
    shapes = [(96, 128), (4099,), (300,)]  # two quantized (one with a ragged block), one small (fp32 state)
    start = make_params(shapes)
    twin, low = clone_params(start), clone_params(start)
    run(info.cls(twin, **kwargs), twin, 50)
    run(info.cls(low, state_bits=bits, **kwargs), low, 50)
    err = trajectory_error(low, twin, start)
    bound = info.bound8 if bits == 8 else info.bound8 / 4
    assert err < bound, f"{info.name} {bits}-bit error {err:.4f} >= {bound}"
    assert err > 0  # the low-bit path really ran on quantized state


def test_adamw8bit_no_worse_than_bitsandbytes():
    bnb = pytest.importorskip("bitsandbytes")
    shapes = [(96, 128), (4099,), (300,)]
    start = make_params(shapes)
    twin, ours, theirs = clone_params(start), clone_params(start), clone_params(start)
    kw = dict(lr=1e-2, weight_decay=0.1)
    run(torch.optim.AdamW(twin, **kw), twin, 50)
    run(lowmemopt.AdamW8bit(ours, **kw), ours, 50)
    run(bnb.optim.AdamW8bit(theirs, **kw), theirs, 50)
    err_ours = trajectory_error(ours, twin, start)
    err_bnb = trajectory_error(theirs, twin, start)
    assert err_ours <= err_bnb * 1.05, (err_ours, err_bnb)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [32, 16, 8])
@pytest.mark.parametrize("shape", [(1024, 1024), (1 << 20,)], ids=["matrix", "vector"])
def test_state_bytes_exact(info, bits, shape):
    """State bytes of a 1M-element parameter are exactly what the entry states: full-size slots x format bytes
    (8-bit: 1 + 4/256 B per element), plus fp32 row/column statistics for factored optimizers."""
    kwargs = STATEFUL[info.name]
    p = torch.nn.Parameter(torch.zeros(shape))
    opt = info.cls([p], state_bits=bits, **kwargs)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state_nbytes() == info.expected_state_bytes(shape, bits, kwargs)


def test_adamw8bit_bytes_per_param():
    p = torch.nn.Parameter(torch.zeros(1 << 20))
    opt = lowmemopt.AdamW8bit([p])
    p.grad = torch.ones_like(p)
    opt.step()
    per_param = opt.state_nbytes() / p.numel()
    assert per_param == 2 * (1 + 4 / 256) <= 2.04


def test_small_tensors_keep_fp32_state():
    big, small = torch.nn.Parameter(torch.zeros(4096)), torch.nn.Parameter(torch.zeros(4095))
    opt = lowmemopt.AdamW8bit([big, small])
    big.grad, small.grad = torch.ones_like(big), torch.ones_like(small)
    opt.step()
    assert opt.state[big]["exp_avg.codes"].dtype == torch.uint8
    assert opt.state[small]["exp_avg"].dtype == torch.float32


BAD_CASES = [(info, case) for info in OPTIMIZERS for case in info.bad_inputs]


@pytest.mark.parametrize(
    "info,case", BAD_CASES, ids=[f"{i.name}-{list(c[0])[0]}={list(c[0].values())[0]}" for i, c in BAD_CASES]
)
def test_bad_hyperparameters(info, case):
    kwargs, exc, match = case
    base = dict(info.variants[0])
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        info.cls([torch.nn.Parameter(torch.zeros(3))], **base)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_bad_param_group_rejected_and_optimizer_unchanged(info):
    opt = info.cls([torch.nn.Parameter(torch.zeros(3))], **info.variants[0])
    with pytest.raises(ValueError, match="Invalid state_bits"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "state_bits": 3})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_complex_and_integer_params_rejected(info):
    with pytest.raises(TypeError, match="complex"):
        info.cls([torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))], **info.variants[0])
    with pytest.raises(TypeError, match="floating-point"):
        info.cls([torch.zeros(3, dtype=torch.int64)], **info.variants[0])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_expanded_params_rejected_before_a_step(info):
    """A parameter whose elements share memory (stride 0: an expanded tensor) is refused when it is given: its step
    would fail half done (torch's in-place error after other parameters were updated)."""
    p = torch.nn.Parameter(torch.randn(1, 6).expand(4, 6))
    with pytest.raises(ValueError, match=r"parameter \d of param group \d \(shape \(4, 6\)\) has stride 0 in dim 0"):
        info.cls([torch.nn.Parameter(torch.randn(5)), p], **info.variants[0])


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_empty_and_0d_params_step_as_torch_steps_them(info):
    """Zero-size parameters (a pruned head, an empty embedding) take steps as in torch, and a 0-d one steps as its
    1-element twin; the other parameters step as they would without them."""
    kwargs = dict(STATEFUL[info.name], min_quant_numel=0, block_size=32)
    start = make_params([(5, 4), (7,)])
    ours, alone = clone_params(start), clone_params(start)
    empty = [
        torch.nn.Parameter(torch.empty(0)),
        torch.nn.Parameter(torch.empty(0, 5)),
        torch.nn.Parameter(torch.empty(0, 5)),
    ]
    scalar, twin = torch.nn.Parameter(torch.tensor(0.5)), torch.nn.Parameter(torch.tensor([0.5]))
    opt = info.cls([*ours, *empty, scalar], **kwargs)  # (after the others: APOLLO seeds by position)
    ref = info.cls([*alone, twin], **kwargs)
    for t in range(2):
        set_grads(ours, t)
        set_grads(alone, t)
        for p in empty:
            p.grad = torch.empty(p.shape)
        scalar.grad, twin.grad = torch.tensor(0.1 * t - 0.3), torch.tensor([0.1 * t - 0.3])
        opt.step()
        ref.step()
    assert all(opt.state[p]["step"] == 2 for p in [*empty, scalar])
    assert torch.equal(scalar.detach().reshape(1), twin.detach())
    for a, b in zip(ours, alone):
        assert torch.equal(a, b)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_sparse_gradients_rejected(info):
    p = torch.nn.Parameter(torch.zeros(4, 3))
    opt = info.cls([p], **STATEFUL[info.name])
    p.grad = torch.eye(4, 3).to_sparse()
    with pytest.raises(TypeError, match=rf"{type(opt).__name__} does not support sparse gradients: .*to_dense"):
        opt.step()
    assert len(opt.state) == 0 and torch.equal(p, torch.zeros(4, 3))


def test_sparse_gradients_the_documented_workaround_is_torchs_sgd_step():
    """docs/torch_optim.md lists the refusal; its workaround (a dense gradient) gives torch's SGD step on a sparse
    Embedding's gradient, at 32 bits."""
    doc = (Path(__file__).parents[1] / "docs" / "torch_optim.md").read_text()
    assert "| a sparse gradient (`nn.Embedding(..., sparse=True)`)" in doc
    torch.manual_seed(0)
    ours, theirs = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Embedding(10, 4, sparse=True)
    theirs.load_state_dict(ours.state_dict())
    opt = lowmemopt.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9)
    for t in range(3):
        idx = torch.tensor([t, 3, 7])
        for emb, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            emb(idx).pow(2).sum().backward()
        ours.weight.grad = ours.weight.grad.to_dense()
        opt.step()
        ref.step()
    assert torch.equal(ours.weight, theirs.weight)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_closure(info):
    p = torch.nn.Parameter(torch.ones(5))
    opt = info.cls([p], **STATEFUL[info.name])
    calls = []

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        calls.append(1)
        return loss

    loss = opt.step(closure)
    assert calls == [1] and float(loss.detach()) == 5.0
    assert not torch.equal(p.detach(), torch.ones(5))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [32, 8])
def test_nonfinite_gradient_skips_param_and_keeps_state(info, bits):
    """Policy: a NaN/Inf gradient leaves that parameter and its (quantized) state untouched; others still step."""
    params = make_params([(80, 64), (80, 64)])
    opt = info.cls(params, state_bits=bits, **STATEFUL[info.name])
    run(opt, params, 3)
    before = [p.detach().clone() for p in params]
    state_before = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[params[0]].items()}
    set_grads(params, 3)
    params[0].grad[3, 5] = float("nan")
    params[0].grad[7, 1] = float("inf")
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        opt.step()
    assert torch.equal(params[0], before[0])
    for k, v in opt.state[params[0]].items():
        assert torch.equal(v, state_before[k]) if isinstance(v, torch.Tensor) else v == state_before[k], k
    assert not torch.equal(params[1], before[1])
    assert opt.nonfinite_skips == 1
    run(opt, params, 2, start=4)
    assert all(torch.isfinite(p).all() for p in params)
    for v in opt.state[params[0]].values():
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            assert torch.isfinite(v).all()


def test_adamw8bit_outlier_block_does_not_explode():
    """A block holding one huge gradient next to tiny ones: the tiny elements' v must not decode to 0 (which would turn
    their step into m/eps). Adam's first step is bounded by lr in every element; it must stay so at 8 bits."""
    g = torch.full((4096,), 1e-6)
    g[0] = 1e3
    g[1::2] *= -1
    p32 = torch.nn.Parameter(torch.zeros(4096))
    p8 = torch.nn.Parameter(torch.zeros(4096))
    lr = 1e-3
    for p, bits in ((p32, 32), (p8, 8)):
        opt = lowmemopt.AdamW([p], lr=lr, weight_decay=0.0, state_bits=bits)
        for _ in range(3):
            p.grad = g.clone()
            opt.step()
    assert p8.abs().max() <= 3 * lr * 1.0001
    dec = opt.state[p8]
    from lowmemopt.quant import dequantize_blockwise

    v = dequantize_blockwise(dec["exp_avg_sq.codes"], dec["exp_avg_sq.absmax"], "upow2", 256)
    assert (v > 0).all(), "a non-zero second moment decoded to 0"


def test_lars8bit_keeps_trust_ratio():
    """bitsandbytes' LARS8bit degenerates to momentum SGD; ours keeps the trust ratio, so at 8 bits it follows LARS
    (32-bit) and not SGD."""
    kw = dict(lr=0.1, momentum=0.9, eeta=1e-3)
    start = make_params([(128, 96)])
    lars32, lars8, sgd = clone_params(start), clone_params(start), clone_params(start)
    run(lowmemopt.LARS(lars32, **kw), lars32, 10)
    run(lowmemopt.LARS8bit(lars8, **kw), lars8, 10)
    run(torch.optim.SGD(sgd, lr=0.1, momentum=0.9), sgd, 10)
    assert trajectory_error(lars8, lars32, start) < 0.05
    moved_lars = float((lars8[0] - start[0]).detach().norm())
    moved_sgd = float((sgd[0] - start[0]).detach().norm())
    assert moved_lars < 0.1 * moved_sgd  # the trust ratio (eeta ||p|| / ||g|| ~ 1e-3) really scales the step


def test_bitsandbytes_lars8bit_is_plain_sgd():
    """Documents the anchor's fault the test above guards against (if bitsandbytes fixes it, this test says so)."""
    bnb = pytest.importorskip("bitsandbytes")
    start = make_params([(128, 96)])
    theirs, sgd = clone_params(start), clone_params(start)
    run(bnb.optim.LARS8bit(theirs, lr=0.1, momentum=0.9), theirs, 5)
    run(torch.optim.SGD(sgd, lr=0.1, momentum=0.9), sgd, 5)
    assert trajectory_error(theirs, sgd, start) < 0.05


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_bf16_params_use_fp32_math(info):
    """bf16 parameters: the update is computed in fp32 and rounded once; the 32-bit state stays fp32."""
    kwargs = STATEFUL[info.name]
    start = make_params([(64, 80)])
    p16 = [torch.nn.Parameter(start[0].detach().bfloat16())]
    p32 = clone_params([p16[0].float()])
    opt16 = info.cls(p16, **kwargs)
    run(opt16, p16, 5)
    run(info.cls(p32, **kwargs), p32, 5)
    assert p16[0].dtype == torch.bfloat16
    for v in opt16.state[p16[0]].values():
        if isinstance(v, torch.Tensor):
            assert v.dtype == torch.float32
    torch.testing.assert_close(p16[0].float(), p32[0], rtol=0.02, atol=0.02)


def test_non_contiguous_param():
    base = torch.randn(40, 60)
    p = torch.nn.Parameter(base.t())  # non-contiguous view
    ref = torch.nn.Parameter(p.detach().clone())
    opt, ref_opt = lowmemopt.AdamW([p], lr=1e-2), torch.optim.AdamW([ref], lr=1e-2)
    for t in range(3):
        g = torch.randn(60, 40)
        p.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    # to fp32 rounding: torch's CPU Tensor.sqrt (MKL) is not correctly rounded, lowmemopt's native kernel's sqrt is
    torch.testing.assert_close(p, ref, rtol=2e-6, atol=2e-6)


def test_aliases_are_default_changes():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for alias, base in [
        (lowmemopt.AdamW8bit, lowmemopt.AdamW),
        (lowmemopt.Adam8bit, lowmemopt.Adam),
        (lowmemopt.LAMB8bit, lowmemopt.LAMB),
        (lowmemopt.LARS8bit, lowmemopt.LARS),
        (lowmemopt.Lion8bit, lowmemopt.Lion),
    ]:
        opt = alias(p)
        assert isinstance(opt, base) and opt.defaults["state_bits"] == 8
        assert alias(p, state_bits=8).defaults["state_bits"] == 8
        with pytest.raises(ValueError, match=rf"{alias.__name__} has state_bits=8 \(its name\)"):
            alias(p, state_bits=32)  # (the name is the format: lowmemopt.aliases)
    assert math.isclose(lowmemopt.AdamW8bit(p, lr=0.5).defaults["lr"], 0.5)


def test_lamb_trust_ratio_is_a_tensor_without_sync():
    """LAMB/LARS norms stay on the device (no .item()): the step works under a mode that forbids syncs on CUDA; on CPU
    we check the math directly against the definition."""
    p = torch.nn.Parameter(torch.randn(50, 40))
    p0 = p.detach().clone()
    g = torch.randn(50, 40)
    opt = lowmemopt.LAMB([p], lr=0.1, weight_decay=0.0)
    p.grad = g
    opt.step()
    m, v = 0.1 * g, 0.001 * g * g
    r = m / (v.sqrt() + 1e-6)
    expected = p0 - 0.1 * p0.norm() / r.norm() * r
    torch.testing.assert_close(p.detach(), expected)


def test_info_table_covers_every_public_optimizer():
    classes = {n for n in lowmemopt.__all__ if isinstance(getattr(lowmemopt, n), type)}
    aliases = set(lowmemopt.aliases.__all__)  # drop-in names: a change of defaults of a class in the table
    public = {
        n
        for n in classes
        if issubclass(getattr(lowmemopt, n), torch.optim.Optimizer)
        and n not in aliases
        and not needs_process_group(getattr(lowmemopt, n))
    }  # 1-bit optimizers: tests/test_onebit.py
    assert {"AdamW", "SGD", "Lion"} <= public
    assert public <= set(BY_NAME), public - set(BY_NAME)


class _NoScalarReads(TorchDispatchMode):
    """Fails on ``aten._local_scalar_dense``, which ``.item()``, ``float(t)``, ``bool(t)`` and a tensor passed as a
    Python scalar (``alpha=t``) all run: each is a host synchronization on a GPU."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            raise AssertionError("a tensor value was read on the host inside step()")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [32, 8])
def test_step_reads_no_tensor_values_on_the_host(info, bits):
    """No per-parameter host sync in ``step()``: the one allowed read per step is the batched finite check
    (``tolist``, which this mode does not see)."""
    params = make_params([(80, 64), (4099,), (7,)])
    opt = info.cls(params, state_bits=bits, **STATEFUL[info.name])
    run(opt, params, 1)
    set_grads(params, 1)
    before = [p.detach().clone() for p in params]
    with _NoScalarReads():
        opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
