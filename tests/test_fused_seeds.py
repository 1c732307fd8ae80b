"""The seeds' fused optimizers by name: FusedAdam, CPUAdam (DeepSpeedCPUAdam), FusedSGD and FusedLAMB against their
seeds (DeepSpeed's CPU Adam itself), torch.optim where the flags coincide, and references written here from the
published algorithms (Apex's multi_tensor_sgd / multi_tensor_lamb)."""

from __future__ import annotations

import itertools

import pytest
import torch

import lowmemopt


def _params(dtype=torch.float32, shapes=((1000,), (37, 53), (7,)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _twins(values):
    return ([torch.nn.Parameter(v.clone()) for v in values], [torch.nn.Parameter(v.clone()) for v in values])


def _same_grads(a, b, seed):
    g = torch.Generator().manual_seed(seed)
    for x, y in zip(a, b):
        grad = torch.randn(x.shape, generator=g).to(x.dtype)
        x.grad, y.grad = grad.clone(), grad.clone()


# -- CPUAdam vs DeepSpeed's DeepSpeedCPUAdam -----------------------------------------------------------------------


def _deepspeed_cpu_adam():
    """DeepSpeed's CPU Adam class with its op built (a JIT C++ build at first use), or skip."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()
    except Exception as exc:  # not installed, no compiler, no ninja, ...: the comparison cannot run here
        pytest.skip(f"DeepSpeed's cpu_adam op is unavailable ({type(exc).__name__}: {exc})")
    return DeepSpeedCPUAdam


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpu_adam_matches_deepspeed(dtype, monkeypatch):
    """Every combination of adamw_mode, bias_correction, weight decay and fp32_optimizer_states, each step taken from
    the same parameters and state on both sides (DeepSpeed's values copied back after each comparison, so the bound is
    one step's rounding, not a drift). DeepSpeed works in fp32 throughout: ``1 - beta`` of the fp32 betas, ``beta^t``
    by repeated fp32 products, ``1 / sqrt(1 - beta2^t)`` multiplied in, fused multiply-adds. The largest difference is
    ``1 - float32(beta2)``, ``rel2`` away from ``1 - beta2`` (1.3e-5 for 0.999): v differs by that relatively, the
    update by half of it, plus a few ulps of rounding (fp32 parameters and state: 2-3 ulps; bf16: one bf16 ulp)."""
    DeepSpeedCPUAdam = _deepspeed_cpu_adam()
    import functools

    import cpuinfo  # (DeepSpeed's constructor asks for the CPU's description each time: subprocesses, ~1 s)

    monkeypatch.setattr(cpuinfo, "get_cpu_info", functools.lru_cache(maxsize=None)(cpuinfo.get_cpu_info))
    lr, betas = 1e-2, (0.9, 0.999)
    rel2 = abs((1 - _f32(betas[1])) - (1 - betas[1])) / (1 - betas[1])
    ulp = 2.0**-23 if dtype == torch.float32 else 2.0**-7
    for adamw, bc, wd, fp32_states in itertools.product([True, False], [True, False], [0.0, 0.1], [True, False]):
        kw = dict(
            lr=lr, betas=betas, bias_correction=bc, weight_decay=wd, adamw_mode=adamw, fp32_optimizer_states=fp32_states
        )
        ours, theirs = _twins(_params(dtype))
        opt, ref = lowmemopt.CPUAdam(ours, **kw), DeepSpeedCPUAdam(theirs, **kw)
        state_ulp = ulp if not fp32_states else 2.0**-23
        for step in range(4):
            _same_grads(ours, theirs, step)
            before = [y.detach().float().clone() for y in theirs]
            opt.step()
            ref.step()
            for x, y, y0 in zip(ours, theirs, before):
                sx, sy = opt.state[x], ref.state[y]
                where = f"{kw} step {step + 1}"
                assert sx["exp_avg"].dtype == sy["exp_avg"].dtype, where
                # p: the update off by rel2 / 2 (and the decay's few ulps), plus the rounding of p itself
                moved = (y.detach().float() - y0).abs().max().item()
                torch.testing.assert_close(
                    x.detach(), y.detach(), rtol=2 * ulp, atol=moved * (rel2 + 16 * 2.0**-23), msg=where
                )
                torch.testing.assert_close(sx["exp_avg"], sy["exp_avg"], rtol=3 * state_ulp, atol=1e-7, msg=where)
                torch.testing.assert_close(
                    sx["exp_avg_sq"], sy["exp_avg_sq"], rtol=rel2 + 3 * state_ulp, atol=1e-12, msg=where
                )
                with torch.no_grad():
                    x.copy_(y)
                    sx["exp_avg"].copy_(sy["exp_avg"])
                    sx["exp_avg_sq"].copy_(sy["exp_avg_sq"])


def test_cpu_adam_state_in_parameter_dtype():
    """fp32_optimizer_states=False: the moments in the parameter's dtype at any size (fp16 parameters: fp16 state,
    stepped by the torch paths), and it survives a state-dict round trip unchanged."""
    params = [torch.nn.Parameter(torch.randn(5000, dtype=dt)) for dt in (torch.float16, torch.bfloat16, torch.float32)]
    params.append(torch.nn.Parameter(torch.randn(7, dtype=torch.float16)))  # small: still fp16
    opt = lowmemopt.DeepSpeedCPUAdam(params, lr=1e-3, fp32_optimizer_states=False)
    for step in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    for p in params:
        assert opt.state[p]["exp_avg"].dtype == opt.state[p]["exp_avg_sq"].dtype == p.dtype
        assert torch.isfinite(p).all()
    twin = lowmemopt.CPUAdam([torch.nn.Parameter(p.detach().clone()) for p in params], fp32_optimizer_states=False)
    twin.load_state_dict(opt.state_dict())
    for a, b in zip(opt.state.values(), twin.state.values()):
        assert a["exp_avg"].dtype == b["exp_avg"].dtype and torch.equal(a["exp_avg"], b["exp_avg"])
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        lowmemopt.CPUAdam(params, fp32_optimizer_states=False, state_bits=8)


def test_cpu_adam_fp16_state_matches_the_eager_reference():
    """fp16 state: the math in fp32, the moments rounded to fp16 after each step (DeepSpeed's layout)."""
    p = torch.nn.Parameter(torch.randn(300, dtype=torch.float16))
    opt = lowmemopt.CPUAdam([p], lr=1e-2, weight_decay=0.1, fp32_optimizer_states=False)
    w, m, v = p.detach().float().clone(), torch.zeros(300), torch.zeros(300)
    for t in range(1, 4):
        g = torch.randn(300, generator=torch.Generator().manual_seed(t)).half()
        p.grad = g
        opt.step()
        gf = g.float()
        m = m.lerp(gf, 0.1)
        v = v * 0.999 + 0.001 * gf * gf
        denom = v.sqrt() / (1 - 0.999**t) ** 0.5 + 1e-8
        w = (w * (1 - 1e-2 * 0.1) - 1e-2 / (1 - 0.9**t) * m / denom).half().float()
        m, v = m.half().float(), v.half().float()
        torch.testing.assert_close(opt.state[p]["exp_avg"].float(), m, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(p.detach().float(), w, rtol=1e-3, atol=1e-3)


# -- FusedAdam ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_is_torch_adam_where_flags_coincide(adam_w_mode):
    ours, theirs = _twins(_params())
    opt = lowmemopt.FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(5):
        _same_grads(ours, theirs, step)
        opt.step()
        ref.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)  # (the common suite's parity bound for AdamW)


def test_fused_adam_without_bias_correction():
    ours, _ = _twins(_params())
    ref = [p.detach().clone() for p in ours]
    opt = lowmemopt.FusedAdam(ours, lr=1e-2, bias_correction=False, weight_decay=0.1, betas=(0.8, 0.99), eps=1e-6)
    ms = [torch.zeros_like(r) for r in ref]
    vs = [torch.zeros_like(r) for r in ref]
    for step in range(5):
        _same_grads(ours, ref, step)
        opt.step()
        for r, m, v in zip(ref, ms, vs):
            m.lerp_(r.grad, 0.2)
            v.mul_(0.99).addcmul_(r.grad, r.grad, value=0.01)
            r.mul_(1 - 1e-2 * 0.1).add_(-1e-2 * m / (v.sqrt() + 1e-6))
    for x, r in zip(ours, ref):
        torch.testing.assert_close(x.detach(), r, rtol=1e-6, atol=1e-6)


def test_fused_adam_names_and_flags():
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert lowmemopt.FusedAdam(p, adamw_mode=False).defaults["decoupled_weight_decay"] is False  # ColossalAI's name
    with pytest.raises(ValueError, match="disagree"):
        lowmemopt.FusedAdam(p, adam_w_mode=False, adamw_mode=True)
    with pytest.raises(TypeError, match="bias_correction"):
        lowmemopt.FusedAdam(p, bias_correction=None)
    opt = lowmemopt.FusedAdam(p, set_grad_none=False)
    p[0].grad = torch.ones(3)
    opt.zero_grad()
    assert p[0].grad is not None and not p[0].grad.any()  # set_grad_none=False: zeroed, kept
    opt.zero_grad(set_to_none=True)
    assert p[0].grad is None
    import copy

    assert copy.deepcopy(opt).set_grad_none is False
    assert lowmemopt.registry.resolve_optimizer("fused_adam").cls is lowmemopt.FusedAdam
    assert lowmemopt.registry.resolve_optimizer("deepspeedcpuadam").cls is lowmemopt.DeepSpeedCPUAdam


# -- FusedSGD --------------------------------------------------------------------------------------------------------


def test_fused_sgd_weight_decay_after_momentum_on_every_cpu_path(monkeypatch):
    """wd_after_momentum against Apex's step written out (optim_info.ApexSGDReference), on a tensor large enough for
    the CPU fast paths: the native C kernel (its flag 16, where it builds) or the compiled / eager paths."""
    from optim_info import ApexSGDReference

    kw = dict(lr=1e-2, momentum=0.9, weight_decay=0.05, wd_after_momentum=True)
    h, flags = lowmemopt.FusedSGD.algorithm.kernels.native.scalars(
        dict(kw, dampening=0.0, nesterov=False, maximize=False, first_step=False), 1.0
    )
    assert flags & 16
    ours, theirs = _twins(_params(shapes=((70000,), (33,))))
    opt, ref = lowmemopt.FusedSGD(ours, **kw), ApexSGDReference(theirs, **kw)
    for step in range(4):
        _same_grads(ours, theirs, step)
        opt.step()
        ref.step()
    for x, y in zip(ours, theirs):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)
    with pytest.raises(TypeError, match="lr is required"):
        lowmemopt.FusedSGD(ours)
    sgd = lowmemopt.FusedSGD(ours, lr=0.1)
    ours[0].grad = torch.ones_like(ours[0])
    sgd.zero_grad()  # Apex's default set_grad_none=False: zeroed in place
    assert ours[0].grad is not None and not ours[0].grad.any()


# -- FusedLAMB -------------------------------------------------------------------------------------------------------


def apex_lamb_reference(
    params,
    grads,
    states,
    step,
    *,
    lr,
    betas,
    eps,
    weight_decay,
    bias_correction=True,
    adam_w_mode=True,
    grad_averaging=True,
    max_grad_norm=1.0,
    use_nvlamb=False,
):
    """Apex's multi_tensor_lamb written out, in float64 (the published algorithm, not its rounding): the global norm of
    all gradients; phase 1 per element; phase 2 the per-tensor trust ratio. Updates ``params`` and ``states``."""
    beta1, beta2 = betas
    beta3 = 1 - beta1 if grad_averaging else 1.0
    bc1, bc2 = (1 - beta1**step, 1 - beta2**step) if bias_correction else (1.0, 1.0)
    norm = torch.cat([g.double().reshape(-1) for g in grads]).norm()
    clip = norm / max_grad_norm if max_grad_norm and norm > max_grad_norm else 1.0
    for p, g, st in zip(params, grads, states):
        p64 = p.double()
        d = p64 if weight_decay != 0 else torch.zeros_like(p64)
        g = g.double() / clip
        if not adam_w_mode:
            g = g + weight_decay * d
        st["m"] = st["m"] * beta1 + beta3 * g
        st["v"] = st["v"] * beta2 + (1 - beta2) * g * g
        update = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + eps)
        if adam_w_mode:
            update = update + weight_decay * d
        ratio = lr
        if use_nvlamb or weight_decay != 0:
            pn, un = p64.norm(), update.norm()
            ratio = lr * (pn / un) if pn != 0 and un != 0 else lr
        with torch.no_grad():
            p.copy_(p64 - ratio * update)


LAMB_CASES = [
    dict(),  # Apex's defaults: wd 0.01, bias correction, decoupled, clip at 1.0
    dict(weight_decay=0.0),  # no trust ratio
    dict(weight_decay=0.0, use_nvlamb=True),
    dict(adam_w_mode=False, weight_decay=0.1, grad_averaging=False),
    dict(bias_correction=False, max_grad_norm=0.0, betas=(0.8, 0.99)),
    dict(max_grad_norm=1e3),  # the norm below it: no clipping
]


@pytest.mark.parametrize(
    "case", LAMB_CASES, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "defaults" for c in LAMB_CASES]
)
def test_fused_lamb_matches_apex_algorithm(case):
    kw = dict(dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01), **case)
    params = [torch.nn.Parameter(v) for v in _params(shapes=((300,), (37, 53), (7,)))]
    ref = [p.detach().double().clone() for p in params]
    states = [dict(m=torch.zeros_like(r), v=torch.zeros_like(r)) for r in ref]
    opt = lowmemopt.FusedLAMB(params, **kw)
    for step in range(1, 6):
        g = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=g) * 3 for p in params]  # global norm ~ 130: clipped at 1.0
        for p, gr in zip(params, grads):
            p.grad = gr.clone()
        opt.step()
        apex_lamb_reference(ref, grads, states, step, **kw)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach().double(), r, rtol=1e-5, atol=1e-6)


def test_fused_lamb_is_colossalai_lamb_where_flags_coincide():
    from optim_info import _colossalai_module

    Lamb = _colossalai_module("lamb").Lamb
    for wd in (0.0, 0.1):
        ours, theirs = _twins(_params())
        opt = lowmemopt.FusedLAMB(
            ours, lr=1e-2, weight_decay=wd, bias_correction=False, max_grad_norm=0, use_nvlamb=True
        )
        ref = Lamb(theirs, lr=1e-2, weight_decay=wd, eps=1e-6)
        for step in range(5):
            _same_grads(ours, theirs, step)
            opt.step()
            ref.step()
        for x, y in zip(ours, theirs):
            torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)


def test_fused_lamb_global_norm_reads_nothing_on_the_host():
    """max_grad_norm on: the global norm and the clip stay device tensors; no ``.item()`` inside step()."""
    from test_optimizers import _NoScalarReads

    params = [torch.nn.Parameter(v) for v in _params()]
    opt = lowmemopt.FusedLAMB(params, lr=1e-2, max_grad_norm=1.0)
    _same_grads(params, params, 0)
    opt.step()
    _same_grads(params, params, 1)
    before = [p.detach().clone() for p in params]
    with _NoScalarReads():
        opt.step()
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_fused_lamb_skips_nonfinite_gradients_out_of_the_norm():
    """A NaN gradient's parameter is skipped (the policy) and its gradient is left out of the global norm: the others
    step as if it had no gradient."""
    a = [torch.nn.Parameter(v) for v in _params()]
    b = [torch.nn.Parameter(v.clone()) for v in _params()]
    opt_a, opt_b = lowmemopt.FusedLAMB(a, lr=1e-2), lowmemopt.FusedLAMB(b[:2], lr=1e-2)
    _same_grads(a, b, 0)
    a[2].grad = torch.full_like(a[2], float("nan"))
    b[2].grad = None
    with pytest.warns(RuntimeWarning, match="NaN/Inf"):
        opt_a.step()
    opt_b.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fused_lamb_arguments():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        lowmemopt.FusedLAMB(p, amsgrad=True)
    with pytest.raises(ValueError, match="max_grad_norm"):
        lowmemopt.FusedLAMB(p, max_grad_norm=-1.0)
    assert lowmemopt.FusedLAMB(p, max_grad_norm=None).defaults["max_grad_norm"] == 0.0
    with pytest.raises(ValueError, match="bias_correction=False"):
        lowmemopt.FusedLAMB(p, capturable=True)
    model = torch.nn.Linear(4, 4)
    opt = lowmemopt.FusedLAMB(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt)
    with pytest.raises(ValueError, match="per-layer updates"):
        model(torch.randn(2, 4)).sum().backward()
