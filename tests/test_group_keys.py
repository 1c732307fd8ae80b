"""Unknown param-group keys are refused (lowmemopt.group_keys): at construction, in add_param_group and at the step
after a key is added; what torch, its LR schedulers, the HF Trainer, GaLore's helpers and loaded state dicts put in
groups passes; ``lowmemopt.allow_group_keys`` is the escape."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import make_params, run
from optim_info import OPTIMIZERS, STATEFUL

import lowmemopt
from lowmemopt import group_keys


@pytest.fixture
def allowed(monkeypatch):
    """``ALLOWED_GROUP_KEYS`` restored after the test (allow_group_keys changes it for the process)."""
    monkeypatch.setattr(group_keys, "ALLOWED_GROUP_KEYS", set(group_keys.ALLOWED_GROUP_KEYS))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_typo_in_a_group_is_refused_with_the_closest_key(info):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"unknown param group key 'state_bit': did you mean 'state_bits'\?"):
        info.cls([{"params": [p], "state_bit": 8}], **info.variants[0])
    with pytest.raises(ValueError, match=r"unknown param group key 'rnak': did you mean 'rank'\?"):
        info.cls([{"params": [p], "rnak": 16}], **info.variants[0])


def test_unknown_key_without_a_close_one_lists_the_known_keys():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(
        ValueError,
        match=r"'zzz': SGD's param groups take bf16_update, .*, momentum, .*weight_decay\. If another "
        r"library puts 'zzz' in param groups, allow it with "
        r"lowmemopt.allow_group_keys\('zzz'\)",
    ):
        lowmemopt.SGD([{"params": [p], "zzz": 1}], lr=0.1)


def test_add_param_group_with_a_typo_changes_nothing():
    p, q = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    opt = lowmemopt.AdamW([p], lr=1e-3)
    with pytest.raises(ValueError, match="'weight_decy': did you mean 'weight_decay'"):
        opt.add_param_group({"params": [q], "weight_decy": 0.1})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [q], "weight_decay": 0.1, "name": "biases"})
    assert len(opt.param_groups) == 2


def test_key_added_later_is_refused_at_the_step_before_anything_changes():
    params = make_params([(8, 6)])
    opt = lowmemopt.AdamW(params, lr=1e-2)
    run(opt, params, 1)
    before = params[0].detach().clone()
    state = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in opt.state[params[0]].items()}
    opt.param_groups[0]["state_bit"] = 8
    with pytest.raises(ValueError, match="'state_bit': did you mean 'state_bits'"):
        run(opt, params, 1, start=1)
    assert torch.equal(params[0], before) and opt.state[params[0]]["step"] == state["step"]
    with pytest.raises(ValueError, match="state_bit"):  # still refused: the key is still there
        opt.step()
    del opt.param_groups[0]["state_bit"]
    opt.param_groups[0]["state_bits"] = 8
    run(opt, params, 1, start=1)


def test_the_step_looks_at_keys_only_when_a_group_changed(monkeypatch):
    """The step's check costs a length comparison per group: the keys are looked at only after a group changed."""
    calls = []
    known = group_keys.known_keys_of
    monkeypatch.setattr(group_keys, "known_keys_of", lambda opt: calls.append(1) or known(opt))
    params = make_params([(8, 6), (5,)])
    opt = lowmemopt.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-2)
    calls.clear()
    run(opt, params, 3)
    assert calls == []
    opt.param_groups[1]["initial_lr"] = 1e-2  # (a scheduler's key: allowed)
    run(opt, params, 2, start=3)
    assert calls == [1]


def test_allow_group_keys(allowed):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="my_tag"):
        lowmemopt.AdamW([{"params": [p], "my_tag": "encoder"}])
    lowmemopt.allow_group_keys("my_tag", "my_other_tag")
    opt = lowmemopt.AdamW([{"params": [p], "my_tag": "encoder"}])
    opt.param_groups[0]["my_other_tag"] = 1
    p.grad = torch.ones(3)
    opt.step()
    with pytest.raises(TypeError, match="a param group key is a str"):
        lowmemopt.allow_group_keys(3)


@pytest.mark.parametrize(
    "make",
    [
        lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10),  # max_lr, min_lr, *_momentum
        lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2),
        lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10),  # initial_lr
        lambda opt: torch.optim.swa_utils.SWALR(opt, swa_lr=0.05),
    ],
    ids=["OneCycleLR", "CyclicLR", "CosineAnnealingLR", "SWALR"],
)
@pytest.mark.parametrize("cls", [lowmemopt.AdamW, lowmemopt.SGD])
def test_torch_schedulers_keys_pass(make, cls):
    params = make_params([(8, 6)])
    opt = cls(params, lr=1e-2, **({"momentum": 0.9} if cls is lowmemopt.SGD else {}))
    sched = make(opt)
    for t in range(3):
        run(opt, params, 1, start=t)
        sched.step()


def test_trainer_and_galore_helper_groups_pass():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    groups = lowmemopt.galore_param_groups(model, target_modules=["0"], rank=4, update_proj_gap=2)
    trainer_style = [  # transformers' Trainer: decay / no-decay groups, its GaLore keys on the target group
        {"params": [model[1].weight], "weight_decay": 0.01},
        {"params": [model[1].bias, model[0].bias], "weight_decay": 0.0},
        {"params": [model[0].weight], "rank": 4, "update_proj_gap": 2, "scale": 0.25, "proj_type": "std"},
    ]
    for g in (groups, trainer_style):
        opt = lowmemopt.AdamW(g, lr=1e-3)
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()


def test_loaded_groups_keep_their_keys():
    """State dicts of torch.optim (``foreach``, ``fused``, ``differentiable`` ...) and groups with another library's
    keys load and step: a loaded state dict's keys are taken as they are."""
    params = make_params([(8, 6)])
    ref = torch.optim.AdamW(copy.deepcopy(params), lr=1e-2)
    opt = lowmemopt.AdamW(params, lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    run(opt, params, 2)
    saved = opt.state_dict()
    saved["param_groups"][0]["other_library_key"] = 1
    fresh = lowmemopt.AdamW(params, lr=1e-2)
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["other_library_key"] == 1
    run(fresh, params, 1, start=2)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_every_optimizers_own_group_keys_pass(info):
    """A group that sets each of the optimizer's own keys (its defaults) is taken."""
    params = make_params([(8, 6)])
    opt = info.cls(params, **STATEFUL[info.name])
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    opt2 = info.cls([{"params": make_params([(8, 6)]), **group}], **STATEFUL[info.name])
    assert set(opt2.param_groups[0]) == set(opt.param_groups[0])
