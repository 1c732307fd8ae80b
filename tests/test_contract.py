"""The torch.optim contract, run on every entry of ``optim_info.OPTIMIZERS`` (in the spirit of torch's
``common_optimizers.py`` generic checks): the reference's signature, torch's implementation keywords (``foreach``,
``fused``, ``differentiable``, ``capturable``), one-element Tensor hyper-parameters of any shape, torch's generic error
inputs, state dicts that survive a round trip unchanged, and the documented refusal of complex parameters.
Bad hyper-parameters with their messages: ``OptimizerInfo.bad_inputs``, run by tests/test_optimizers.py."""

from __future__ import annotations

import copy
import inspect
import io
import warnings

import pytest
import torch
from helpers import clone_params, make_params, run
from optim_info import OPTIMIZERS, STATEFUL, OptimizerInfo

import lowmemopt

SHAPES = [(6, 5), (7,)]  # small: every test here is about the contract, not the numbers
TORCH_KEYWORDS = [  # torch.optim's implementation keywords: accepted by every optimizer, nothing stored
    dict(foreach=None),
    dict(foreach=False),
    dict(foreach=True),
    dict(fused=None),
    dict(fused=False),
    dict(fused=True),
    dict(differentiable=False),
    dict(capturable=False),
    dict(fused=True, differentiable=False),
]
ALIASES = [(name, getattr(lowmemopt, name)) for name in lowmemopt.aliases.__all__]


def _info_of(cls: type) -> OptimizerInfo:
    """The table entry of ``cls``, or of the class an alias changes the defaults of."""
    return next(info for c in cls.__mro__ for info in OPTIMIZERS if info.cls is c)


def _own_signature(cls: type) -> inspect.Signature:
    """``cls``'s constructor signature; an alias's (``*args, **kwargs``) is its base class's."""
    for c in cls.__mro__:
        sig = inspect.signature(c)
        if not any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values()):
            return sig
    raise AssertionError(cls)


def _run(cls, kwargs, steps=3, shapes=SHAPES):
    params = make_params(shapes)
    opt = cls(params, **kwargs)
    run(opt, params, steps)
    return params, opt


def _assert_same(a, b, where="state_dict"):
    """Equal, as a round trip must give: the same keys, types and values (tensors: dtype, shape and bits)."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ: {set(a) ^ set(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# -- signature -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_signature_matches_reference(info):
    """Positional parameters: the reference's names, order and defaults (code that passes them by position means the
    same thing); every keyword-only parameter of the reference is accepted at its default."""
    ref = inspect.signature(info.reference_cls())
    ours = _own_signature(info.cls)
    positional = [p for p in ref.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    our_positional = [p for p in ours.parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in our_positional[: len(positional)]] == [p.name for p in positional]
    for r, o in zip(positional, our_positional):
        assert r.default == o.default, (r.name, r.default, o.default)
    keyword_only = {p.name: p.default for p in ref.parameters.values() if p.kind is p.KEYWORD_ONLY}
    for name, default in keyword_only.items():
        kwargs = dict(info.lr_variant(), **{name: default})
        info.cls(make_params(SHAPES), **kwargs)  # accepted


# -- torch's implementation keywords ---------------------------------------------------------------------------------


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_torch_keywords_accepted_and_change_nothing(info):
    """foreach / fused / differentiable=False / capturable=False: the same steps, bit for bit, and the same param
    group keys (they are not stored: a state dict does not grow a key per torch flag)."""
    kwargs = STATEFUL[info.name]
    base, base_opt = _run(info.cls, kwargs)
    for flags in TORCH_KEYWORDS:
        params, opt = _run(info.cls, dict(kwargs, **flags))
        for p, q in zip(params, base):
            assert torch.equal(p, q), flags
        assert opt.param_groups[0].keys() == base_opt.param_groups[0].keys(), flags


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.complex_as_real], ids=repr)
def test_torch_fused_training_loop_runs_unchanged(info):
    """Code written for ``torch.optim.AdamW(..., fused=True)`` (with ``torch.amp.GradScaler``, whose fast path
    ``fused`` enables in torch) switches by its class name alone and gives torch's results."""
    kwargs = dict(info.variants[0], fused=True)
    ours, ref = make_params(SHAPES), make_params(SHAPES)
    opts = [info.cls(ours, **kwargs), info.reference_cls()(ref, **kwargs)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=256.0) for _ in opts]
    for step in range(3):
        for opt, scaler, params in zip(opts, scalers, (ours, ref)):
            opt.zero_grad()
            loss = sum((p * (step + 1 + i)).square().sum() for i, p in enumerate(params))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)


# -- one-element Tensor hyper-parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_tensor_lr_of_any_one_element_shape(info):
    """torch takes a Tensor lr of one element in any shape: [1] and [1, 1] step exactly as a 0-dim tensor (before,
    SGD failed in step with "argument 'alpha' must be Number" and AdamW with a broadcast error). The group holds a
    0-dim view of the given tensor, so a scheduler's in-place fill reaches the step."""
    variant = info.lr_variant()
    lr = variant["lr"]
    expected, _ = _run(info.cls, dict(variant, lr=torch.tensor(lr)))
    for shape in ((1,), (1, 1)):
        given = torch.full(shape, lr)
        params, opt = _run(info.cls, dict(variant, lr=given))
        for p, q in zip(params, expected):
            assert torch.equal(p, q), shape
        group_lr = opt.param_groups[0]["lr"]
        assert group_lr.dim() == 0 and group_lr.data_ptr() == given.data_ptr()
        given.fill_(0.0)  # a scheduler's write: the next step no longer moves anything
        before = [p.detach().clone() for p in params]
        run(opt, params, 1, start=3)
        if variant.get("beta1") is None:  # (Adafactor's momentum holds updates already scaled by lr)
            for p, b in zip(params, before):
                assert torch.equal(p, b), shape


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_tensor_lr_set_on_a_group_later(info):
    """torch also takes a one-element Tensor lr of any shape assigned to a group after construction."""
    variant = info.lr_variant()
    expected, _ = _run(info.cls, dict(variant, lr=torch.tensor(variant["lr"])))
    params = make_params(SHAPES)
    opt = info.cls(params, **variant)
    for group in opt.param_groups:  # (every group: the table's Muon and APOLLO split their tensors into two)
        group["lr"] = torch.tensor([[variant["lr"]]])
    run(opt, params, 3)
    for p, q in zip(params, expected):
        assert torch.equal(p, q)


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.complex_as_real], ids=repr)
def test_scheduler_drives_a_shaped_tensor_lr_as_torch(info):
    """torch's LR schedulers fill a Tensor lr in place: with lr of shape [1], the steps follow the schedule as torch's
    optimizer follows it."""
    variant = info.lr_variant()
    trajectories = []
    for cls in (info.cls, info.reference_cls()):
        params = make_params(SHAPES)
        opt = cls(params, **dict(variant, lr=torch.tensor([variant["lr"]])))
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        for step in range(3):
            run(opt, params, 1, start=step)
            sched.step()
        assert float(opt.param_groups[0]["lr"]) == pytest.approx(variant["lr"] / 8)
        trajectories.append(params)
    for p, q in zip(*trajectories):
        torch.testing.assert_close(p, q)


def test_lion_decoupled_decay_keeps_the_initial_lr_of_a_tensor_lr():
    """Lion's decoupled decay is ``wd / initial lr``: a scheduler's in-place change of a Tensor lr is not the initial
    lr (it was the same tensor)."""
    kwargs = dict(weight_decay=0.1, decoupled_weight_decay=True)
    ours, twin = make_params(SHAPES), make_params(SHAPES)
    lr = torch.tensor(1e-3)
    opt, opt_twin = lowmemopt.Lion(ours, lr=lr, **kwargs), lowmemopt.Lion(twin, lr=1e-3, **kwargs)
    lr.fill_(5e-4)
    opt_twin.param_groups[0]["lr"] = 5e-4  # (initial_lr stays 1e-3)
    run(opt, ours, 2)
    run(opt_twin, twin, 2)
    for p, q in zip(ours, twin):
        torch.testing.assert_close(p, q)


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if "betas" in _own_signature(i.cls).parameters], ids=repr)
def test_tensor_betas(info):
    """Tensor betas (torch's Adam/AdamW take them, of any one-element shape, as in its OptimizerInfo inputs
    ``(tensor([[[0.9]]]), tensor([[0.99]]))``) step as their values; where the reference is torch's, as torch does."""
    kwargs = (
        next(v for v in info.variants if "betas" in v and v.get("lr") is not None)
        if any("betas" in v for v in info.variants)
        else info.lr_variant()
    )
    betas = kwargs.get("betas", _own_signature(info.cls).parameters["betas"].default)
    shaped = tuple(torch.tensor(b).reshape((1,) * (i + 1)) for i, b in enumerate(betas))  # 0.9: [1], 0.99: [1, 1]
    numbers = tuple(float(b) for b in shaped)  # (the fp32 values)
    expected, _ = _run(info.cls, dict(kwargs, betas=numbers))
    params, opt = _run(info.cls, dict(kwargs, betas=shaped))
    assert opt.param_groups[0]["betas"] == numbers
    for p, q in zip(params, expected):
        assert torch.equal(p, q)
    if info.complex_as_real:
        ref = make_params(SHAPES)
        run(info.reference_cls()(ref, **dict(kwargs, betas=tuple(b.clone() for b in shaped))), ref, 3)
        for p, q in zip(params, ref):
            torch.testing.assert_close(p, q)


#: what torch refuses only because of its own foreach implementation (common_optimizers' error inputs for Adam and
#: AdamW): lowmemopt has one implementation, so code that works with torch works here and these work too. (Tensor
#: betas mixed with floats raise torch's ValueError here too: optim_info's _BAD_BETAS.)
TORCH_ONLY_REFUSALS = [
    dict(
        lr=torch.tensor(1e-3), foreach=True
    ),  # "lr as a Tensor is not supported for capturable=False and foreach=True"
    dict(betas=(torch.tensor(0.9), torch.tensor(0.99)), foreach=True),  # "betas[0] as a Tensor is not supported..."
]


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.name in ("AdamW", "Adam")], ids=repr)
@pytest.mark.parametrize("case", range(len(TORCH_ONLY_REFUSALS)))
def test_what_torch_refuses_for_its_foreach_path_is_taken(info, case):
    kwargs = TORCH_ONLY_REFUSALS[case]
    params, _ = _run(info.cls, kwargs, steps=2)
    expected, _ = _run(info.cls, {k: (tuple(map(float, v)) if k == "betas" else v) for k, v in kwargs.items()}, 2)
    for p, q in zip(params, expected):
        assert torch.equal(p, q)


def test_sgd_tensor_weight_decay_as_torch():
    """torch's SGD signature takes ``weight_decay`` as a Tensor (its step then fails unless the Tensor requires grad:
    "add(): argument 'alpha' must be Number"); here it steps as its value."""
    ours, ref = make_params(SHAPES), make_params(SHAPES)
    wd = torch.tensor([0.1])
    run(lowmemopt.SGD(ours, lr=1e-2, momentum=0.9, weight_decay=wd), ours, 3)
    run(torch.optim.SGD(ref, lr=1e-2, momentum=0.9, weight_decay=float(wd)), ref, 3)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)


# -- torch's generic error inputs ------------------------------------------------------------------------------------

_P = torch.nn.Parameter
#: common_optimizers.get_error_inputs_for_all_optims: (params, kwargs, expected type, message regex)
GENERIC_ERRORS = [
    (
        lambda: _P(torch.randn(2, 2)),
        {},
        TypeError,
        "params argument given to the optimizer should be an iterable of Tensors or dicts",
    ),
    (
        lambda: [{"params": p} for p in [_P(torch.randn(2, 2))] * 2],
        {},
        ValueError,
        "some parameters appear in more than one parameter group",
    ),
    (lambda: [_P(torch.randn(2, 2))], dict(lr=torch.tensor([0.001, 0.001])), ValueError, "Tensor lr must be 1-element"),
    (
        lambda: [("weight", _P(torch.randn(2, 2))), _P(torch.randn(2, 2))],
        {},
        ValueError,
        "all optimizer params should be with/without names. Some param names are missing",
    ),
    (
        lambda: [{"params": [_P(torch.randn(2, 2))], "lr": 1e-2}, {"params": [("weight", _P(torch.randn(2, 2)))]}],
        {},
        ValueError,
        "all optimizer param groups should be with/without names. cannot add param group with names",
    ),
]


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("case", range(len(GENERIC_ERRORS)))
def test_torch_generic_error_inputs(info, case):
    params, kwargs, exc, match = GENERIC_ERRORS[case]
    with pytest.raises(exc, match=match):
        info.cls(params(), **dict(info.lr_variant(), **kwargs))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_duplicate_params_warn_as_torch(info):
    p = _P(torch.randn(2, 2))
    with pytest.warns(UserWarning, match="a parameter group with duplicate parameters"):
        info.cls([p, p], **info.lr_variant())


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_step_without_gradients_changes_nothing_and_prints(info):
    """torch's generic checks: a step with no gradients is a no-op (no state made), and the optimizer prints."""
    params = make_params(SHAPES)
    before = [p.detach().clone() for p in params]
    opt = info.cls(params, **STATEFUL[info.name])
    opt.step()
    assert len(opt.state) == 0 and all(torch.equal(p, b) for p, b in zip(params, before))
    assert repr(opt).startswith(info.cls.__name__ + " (")


# -- state dicts -----------------------------------------------------------------------------------------------------


def _round_trip_stable(cls, kwargs):
    """state_dict -> load_state_dict (a fresh optimizer, and the same one) -> state_dict gives the same dict, and
    ``torch.save`` / ``torch.load(weights_only=True)`` in between changes nothing either."""
    params, opt = _run(cls, kwargs)
    saved = opt.state_dict()
    fresh = cls(clone_params(params), **kwargs)
    fresh.load_state_dict(saved)
    _assert_same(fresh.state_dict(), saved)
    opt.load_state_dict(opt.state_dict())
    _assert_same(opt.state_dict(), saved)
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    again = cls(clone_params(params), **kwargs)
    again.load_state_dict(torch.load(buffer, weights_only=True))
    _assert_same(again.state_dict(), saved)


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("bits", [32, 8])
def test_state_dict_round_trip_is_stable(info, bits):
    """A load adds no key to the param groups (before: torch's ``differentiable``) and changes no value."""
    _round_trip_stable(info.cls, dict(STATEFUL[info.name], state_bits=bits, min_quant_numel=0))


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_state_dict_round_trip_is_stable_with_tensor_lr_and_named_params(info):
    variant = info.lr_variant()
    _round_trip_stable(info.cls, dict(variant, lr=torch.tensor([variant["lr"]])))
    model = torch.nn.Linear(5, 3)
    opt = info.cls(model.named_parameters(), **variant)
    model(torch.randn(4, 5)).square().sum().backward()
    opt.step()
    saved = opt.state_dict()
    # (AdamMini, Muon: 2 groups)
    assert sorted(n for g in saved["param_groups"] for n in g["param_names"]) == ["bias", "weight"]
    fresh = info.cls(torch.nn.Linear(5, 3).named_parameters(), **variant)
    fresh.load_state_dict(saved)
    _assert_same(fresh.state_dict(), saved)


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.complex_as_real], ids=repr)
def test_torch_state_dict_with_shaped_tensor_lr_loads_steps_and_round_trips(info):
    """A torch.optim state dict (its groups carry foreach / fused / differentiable, its lr a [1] tensor) loads, steps
    as torch steps on, and then round-trips unchanged."""
    variant = dict(info.lr_variant(), lr=torch.tensor([info.lr_variant()["lr"]]))
    ref = make_params(SHAPES)
    ref_opt = info.reference_cls()(ref, **variant)
    run(ref_opt, ref, 2)
    ours = clone_params(ref)
    opt = info.cls(ours, **dict(variant, lr=0.5))
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # (torch's state dict holds its live state)
    run(opt, ours, 2, start=2)
    run(ref_opt, ref, 2, start=2)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q)
    saved = opt.state_dict()
    fresh = info.cls(clone_params(ours), **variant)
    fresh.load_state_dict(saved)
    _assert_same(fresh.state_dict(), saved)


@pytest.mark.parametrize("name,alias", ALIASES, ids=[n for n, _ in ALIASES])
def test_aliases_keep_the_contract(name, alias, tmp_path):
    """Each drop-in alias takes torch's keywords and round-trips its state dict unchanged."""
    kwargs = dict(STATEFUL[_info_of(alias).name], min_quant_numel=0, fused=True, foreach=False, differentiable=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (paged aliases on a CPU-only machine may warn)
        _round_trip_stable(alias, kwargs)


def test_deepcopy_keeps_defaults_clean():
    """torch's ``__setstate__`` (load_state_dict, unpickling, deepcopy) adds ``differentiable`` to the defaults; a
    param group added afterwards must not inherit it."""
    opt = copy.deepcopy(lowmemopt.AdamW(make_params(SHAPES[:1])))
    opt.add_param_group({"params": make_params(SHAPES[1:])})
    assert "differentiable" not in opt.defaults and "differentiable" not in opt.param_groups[1]


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_contract(info, how):
    """A deep-copied or unpickled optimizer (torch restores it without hooks) keeps lowmemopt's: its state dict has
    the format version, a load keeps 8-bit codes uint8 (before: cast to float32), and it steps as the original."""
    import pickle

    kwargs = dict(STATEFUL[info.name], state_bits=8, min_quant_numel=0)
    params, opt = _run(info.cls, kwargs)
    twin = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    twin_params = [p for group in twin.param_groups for p in group["params"]]
    assert twin.nonfinite_skips == opt.nonfinite_skips and twin.defaults == opt.defaults
    _assert_same(twin.state_dict(), opt.state_dict())
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    _assert_same(twin.state_dict(), opt.state_dict())
    run(opt, params, 1, start=3)
    run(twin, twin_params, 1, start=3)
    for p, q in zip(params, twin_params):
        assert torch.equal(p, q)


# -- complex parameters ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_complex_params_refused_with_what_to_do(info):
    with pytest.raises(TypeError, match=r"complex parameters \(got torch.complex64\).*torch.view_as_real"):
        info.cls([_P(torch.zeros(3, dtype=torch.complex64))], **info.lr_variant())


@pytest.mark.parametrize("info", [i for i in OPTIMIZERS if i.complex_as_real], ids=repr)
def test_view_as_real_steps_as_torch_steps_complex(info):
    """The refusal's advice holds: a ``view_as_real`` parameter steps as torch.optim steps the complex one."""
    torch.manual_seed(0)
    z = torch.randn(4, 3, dtype=torch.complex64)
    target = torch.randn(4, 3, dtype=torch.complex64)
    ref = _P(z.clone())
    ours = _P(torch.view_as_real(z.clone()))
    ref_opt = info.reference_cls()([ref], **info.variants[-1])
    our_opt = info.cls([ours], **info.variants[-1])
    for _ in range(3):
        for opt, w in ((ref_opt, ref), (our_opt, torch.view_as_complex(ours))):
            opt.zero_grad()
            (w - target).abs().square().sum().backward()
            opt.step()
    torch.testing.assert_close(torch.view_as_complex(ours.detach()), ref.detach())
