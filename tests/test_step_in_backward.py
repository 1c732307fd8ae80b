"""lowmemopt.step_in_backward: per-layer updates in post-accumulate-grad hooks, against ordinary backward + step."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import lowmemopt


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))


def _loss(model, t, micro=0):
    gen = torch.Generator().manual_seed(1000 * t + micro)
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
    return torch.nn.functional.mse_loss(model(x), y)


OPTIMIZERS = {
    "GaLoreAdamW": lambda m: lowmemopt.GaLoreAdamW(
        lowmemopt.galore_param_groups(m, "all-linear", rank=4, update_proj_gap=3, weight_decay=0.1), lr=1e-2),
    "CAME8bit-galore": lambda m: lowmemopt.CAME(
        lowmemopt.galore_param_groups(m, ["0"], rank=4, update_proj_gap=2), lr=1e-2, state_bits=8, min_quant_numel=32),
    "AdamW8bit": lambda m: lowmemopt.AdamW8bit(m.parameters(), lr=1e-2, min_quant_numel=32),
}


def _reference(make, steps, accumulation=1, seed=0):
    model = _model(seed)
    opt = make(model)
    for t in range(steps):
        for micro in range(accumulation):
            (_loss(model, t, micro) / accumulation).backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_equals_ordinary_steps_and_frees_gradients(name):
    """7 steps (two GaLore refreshes) of per-layer updates equal backward() + step() bit for bit; after each backward
    every gradient is freed, and the first layer's gradient is completed after the last layer was already updated
    and its gradient freed."""
    make = OPTIMIZERS[name]
    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(model[2].weight.grad is None))
    for t in range(7):
        _loss(model, t).backward()
        assert all(p.grad is None for p in model.parameters())
    assert seen == [True] * 7 and stepper.steps == 7
    ref = _reference(make, 7)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_gradient_accumulation_steps_on_the_last_micro_batch():
    make = OPTIMIZERS["GaLoreAdamW"]
    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt, accumulation_steps=3)
    for t in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(3):
            (_loss(model, t, micro) / 3).backward()
            if micro < 2:
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
                assert all(p.grad is not None for p in model.parameters()) and stepper.micro_step == micro + 1
        assert all(p.grad is None for p in model.parameters()) and stepper.micro_step == 0
    ref = _reference(make, 4, accumulation=3)
    for p, r in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, r)


def test_checkpoint_and_resume_is_bit_exact():
    """Save the optimizer and stepper state (weights_only-safe) after 3 steps with accumulation 2, resume in a fresh
    model / optimizer / stepper: 3 more steps equal 6 uninterrupted ones (across the GaLore refresh at step 3)."""
    make = OPTIMIZERS["GaLoreAdamW"]

    def train(model, stepper, start, stop):
        for t in range(start, stop):
            for micro in range(2):
                (_loss(model, t, micro) / 2).backward()

    model = _model()
    opt = make(model)
    stepper = lowmemopt.step_in_backward(model, opt, accumulation_steps=2)
    train(model, stepper, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "stepper": stepper.state_dict()}, buf)
    (_loss(model, 3, 0) / 2).backward()
    with pytest.raises(RuntimeError, match="save at a step boundary"):
        stepper.state_dict()

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    resumed = _model(seed=1)
    resumed.load_state_dict(ckpt["model"])
    resumed_opt = make(resumed)
    resumed_opt.load_state_dict(ckpt["opt"])
    resumed_stepper = lowmemopt.step_in_backward(resumed, resumed_opt, accumulation_steps=2)
    resumed_stepper.load_state_dict(ckpt["stepper"])
    assert resumed_stepper.steps == 3
    train(resumed, resumed_stepper, 3, 6)

    full = _model()
    full_stepper = lowmemopt.step_in_backward(full, make(full), accumulation_steps=2)
    train(full, full_stepper, 0, 6)
    for p, r in zip(resumed.parameters(), full.parameters()):
        assert torch.equal(p, r)
    with pytest.raises(ValueError, match="accumulation_steps=2"):
        lowmemopt.step_in_backward(resumed, resumed_opt, accumulation_steps=4).load_state_dict(ckpt["stepper"])
    with pytest.raises(ValueError, match="'steps' must be an int"):
        resumed_stepper.load_state_dict(dict(ckpt["stepper"], steps=-1))


def test_gradient_clipping_is_refused_clearly():
    model = _model()
    opt = OPTIMIZERS["GaLoreAdamW"](model)
    with pytest.raises(ValueError, match="cannot clip gradients by global norm"):
        lowmemopt.step_in_backward(model, opt, max_grad_norm=1.0)
    lowmemopt.step_in_backward(model, opt, max_grad_norm=None).remove()
    lowmemopt.step_in_backward(model, opt, max_grad_norm=0.0).remove()


def test_bad_arguments():
    model = _model()
    with pytest.raises(TypeError, match="needs a lowmemopt optimizer"):
        lowmemopt.step_in_backward(model, torch.optim.AdamW(model.parameters()))
    opt = lowmemopt.AdamW(model.parameters())
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="Invalid accumulation_steps"):
            lowmemopt.step_in_backward(model, opt, accumulation_steps=bad)
    with pytest.raises(ValueError, match="is not a parameter of the model"):
        lowmemopt.step_in_backward(model, lowmemopt.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    with pytest.warns(UserWarning, match="not in the optimizer keep their gradients"):
        lowmemopt.step_in_backward(model, lowmemopt.AdamW(model[0].parameters())).remove()


def test_optimizer_step_between_micro_batches_raises_and_is_a_noop_at_boundaries():
    model = _model()
    opt = OPTIMIZERS["GaLoreAdamW"](model)
    lowmemopt.step_in_backward(model, opt, accumulation_steps=2)
    _loss(model, 0).backward()
    with pytest.raises(RuntimeError, match="between micro-batches"):
        opt.step()
    _loss(model, 0, 1).backward()
    after = [p.detach().clone() for p in model.parameters()]
    opt.step()  # boundary: no gradients left, nothing happens
    assert all(torch.equal(p, a) for p, a in zip(model.parameters(), after))


def test_nonfinite_gradient_is_skipped():
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt)
    _loss(model, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    state = {k: v.clone() for k, v in opt.state[model[2].weight].items() if isinstance(v, torch.Tensor)}
    handle = model[2].weight.register_hook(lambda g: g * float("nan"))
    with pytest.warns(RuntimeWarning, match="skipped 1 parameter"):
        _loss(model, 1).backward()
    handle.remove()
    assert torch.equal(model[2].weight, before[2]) and opt.nonfinite_skips == 1
    assert all(torch.equal(opt.state[model[2].weight][k], v) for k, v in state.items())
    assert not torch.equal(model[0].weight, before[0]) and model[2].weight.grad is None


def test_remove_restores_ordinary_training():
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    stepper = lowmemopt.step_in_backward(model, opt)
    stepper.remove()
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    assert not torch.equal(model[0].weight, before[0])


def test_group_dicts_replaced_by_load_state_dict_are_followed():
    """load_state_dict (a resume, accelerate's prepare) replaces the optimizer's group dicts and an LR scheduler then
    updates the new ones: the hooks must step with the current groups, not the ones seen at attach time."""
    model = _model()
    opt = lowmemopt.AdamW(model.parameters(), lr=1e-2)
    lowmemopt.step_in_backward(model, opt)
    opt.load_state_dict(opt.state_dict())  # new group dicts
    opt.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 0).backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # lr 0: nothing moved
    opt.param_groups[0]["lr"] = 1e-2
    _loss(model, 1).backward()
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))
