"""state_dict / load_state_dict: plain types only, bit-exact resume in a fresh process, dtype-safe loading."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import clone_params, make_params, run
from optim_info import BY_NAME, OPTIMIZERS, STATEFUL

import lowmemopt
from lowmemopt import compiled
from lowmemopt.optimizer import FORMAT_VERSION

SHAPES = [(70, 91), (4099,), (300,), (5, 7, 129), (300, 257)]  # the last takes the compiled fast path
RESUME_CASES = (
    [(info.name, bits, dtype) for info in OPTIMIZERS for bits in (32, 16, 8) for dtype in ("float32",)]
    + [  # bf16 params: one elementwise optimizer and every whole-tensor one (they take a different path)
        (info.name, bits, "bfloat16")
        for info in OPTIMIZERS[:1] + [i for i in OPTIMIZERS if not i.cls.algorithm.elementwise]
        for bits in (32, 8)
    ]
)


def _case_id(case):
    return "-".join(map(str, case))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Run every case 10 steps here, 10 more in one fresh subprocess; return {case: (resumed, uninterrupted)}."""
    tmp = tmp_path_factory.mktemp("resume")
    specs, expected = [], {}
    for case in RESUME_CASES:
        name, bits, dtype = case
        cls, kwargs = BY_NAME[name].cls, STATEFUL[name]  # (the table's class, as the worker builds it)
        start = make_params(SHAPES, dtype=getattr(torch, dtype))
        full = clone_params(start)
        run(cls(full, state_bits=bits, **kwargs), full, 20)
        half = clone_params(start)
        opt = cls(half, state_bits=bits, **kwargs)
        run(opt, half, 10)
        stem = tmp / _case_id(case)
        torch.save(opt.state_dict(), f"{stem}.opt.pt")
        torch.save([p.detach() for p in half], f"{stem}.params.pt")
        specs.append(
            dict(
                optimizer=name,
                bits=bits,
                kwargs=kwargs,
                state=f"{stem}.opt.pt",
                params=f"{stem}.params.pt",
                out=f"{stem}.out.pt",
                start=10,
                steps=10,
            )
        )
        expected[case] = ([p.detach() for p in full], f"{stem}.out.pt")
    cases_file = tmp / "cases.json"
    cases_file.write_text(json.dumps(specs))
    worker = os.path.join(os.path.dirname(__file__), "resume_worker.py")
    # the worker takes the path this process takes (compiled or eager: they may differ in the last bit)
    env = dict(os.environ, LOWMEMOPT_COMPILE="1" if compiled.ENABLED else "0")
    proc = subprocess.run(
        [sys.executable, worker, str(cases_file)], capture_output=True, text=True, cwd=str(tmp), env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {case: (torch.load(out, weights_only=True), full) for case, (full, out) in expected.items()}


@pytest.mark.parametrize("case", RESUME_CASES, ids=_case_id)
def test_resume_in_fresh_process_is_bit_exact(resumed, case):
    got, want = resumed[case]
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def _walk(obj, path="state_dict"):
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, (str, int)), f"{path}: key {k!r}"
            yield from _walk(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, obj


@pytest.mark.parametrize("info", OPTIMIZERS, ids=repr)
def test_state_dict_holds_plain_types_and_version(info):
    params = make_params(SHAPES)
    opt = info.cls(params, state_bits=8, **STATEFUL[info.name])
    run(opt, params, 2)
    sd = opt.state_dict()
    assert sd["lowmemopt_format"] == FORMAT_VERSION
    for path, value in _walk(sd):
        assert value is None or isinstance(value, (torch.Tensor, int, float, str, bool)), (path, type(value))


@pytest.mark.parametrize("bits", [32, 16, 8])
def test_load_keeps_dtypes_with_bf16_params_and_makes_no_copies(bits):
    """torch casts floating state to the param dtype on load; ours keeps uint8 codes, fp32 absmax and fp32 state
    exactly, and (same device) loads the very tensors given, so no transient fp32 copy of the state is made."""
    params = make_params(SHAPES, dtype=torch.bfloat16)
    opt = lowmemopt.AdamW(params, state_bits=bits)
    run(opt, params, 3)
    sd = opt.state_dict()
    fresh = lowmemopt.AdamW(clone_params(params), state_bits=bits)
    fresh.load_state_dict(sd)
    for p_old, p_new in zip(opt.param_groups[0]["params"], fresh.param_groups[0]["params"]):
        old, new = opt.state[p_old], fresh.state[p_new]
        assert old.keys() == new.keys()
        for k, v in old.items():
            if isinstance(v, torch.Tensor):
                assert new[k].dtype == v.dtype and torch.equal(new[k], v), k
                assert new[k].data_ptr() == v.data_ptr(), k
            else:
                assert new[k] == v and type(new[k]) is int
    if bits == 8:
        assert any(k.endswith(".absmax") for k in fresh.state[fresh.param_groups[0]["params"][0]])


def test_unknown_format_version_is_rejected_and_state_untouched():
    params = make_params(SHAPES)
    opt = lowmemopt.AdamW(params, state_bits=8)
    run(opt, params, 2)
    before = {k: v.clone() for k, v in opt.state[params[0]].items() if isinstance(v, torch.Tensor)}
    sd = opt.state_dict()
    sd["lowmemopt_format"] = 99
    with pytest.raises(ValueError, match="lowmemopt_format=99"):
        opt.load_state_dict(sd)
    for k, v in before.items():
        assert torch.equal(opt.state[params[0]][k], v)


@pytest.mark.parametrize("bits", [32, 16])
def test_another_models_state_of_equal_size_is_refused_and_changes_nothing(bits):
    """A Linear(64, 128)'s state has as many elements as a Linear(128, 64)'s: refused with both shapes (as
    lowmemopt.load_state refuses it), not reshaped and stepped on; torch.optim's own state too."""
    a, b = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False)
    for src in (lowmemopt.AdamW(a.parameters(), state_bits=bits), torch.optim.AdamW(a.parameters())):
        a(torch.randn(2, 64)).sum().backward()
        src.step()
        opt = lowmemopt.AdamW(b.parameters(), state_bits=bits)
        with pytest.raises(
            ValueError,
            match=r"'exp_avg' has shape \(128, 64\) .* parameter has shape \(64, 128\); "
            "is it the state of another model",
        ):
            opt.load_state_dict(src.state_dict())
        assert len(opt.state) == 0


def test_a_models_weights_given_to_load_state_dict_say_so():
    model = torch.nn.Linear(3, 2)
    opt = lowmemopt.AdamW(model.parameters())
    with pytest.raises(
        ValueError,
        match=r"^AdamW.load_state_dict: expected an optimizer's state_dict\(\) .*got a "
        r"dict with keys 'weight', 'bias'; .* model.load_state_dict\(\)",
    ):
        opt.load_state_dict(model.state_dict())
    with pytest.raises(ValueError, match="got a list"):
        opt.load_state_dict([])
    assert len(opt.state) == 0 and opt.param_groups[0]["lr"] == 1e-3


def test_load_torch_adamw_state_at_32bit_continues_identically():
    start = make_params(SHAPES)
    ref = clone_params(start)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2)
    run(torch_opt, ref, 5)
    ours = clone_params(ref)
    opt = lowmemopt.AdamW(ours, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # in-process loads share tensors, as in torch
    assert isinstance(opt.state[ours[0]]["step"], int) and opt.defaults["state_bits"] == 32
    run(torch_opt, ref, 5, start=5)
    run(opt, ours, 5, start=5)
    for a, b in zip(ours, ref):  # bit-exact on the eager path; the compiled path (last shape) fuses lerp into an FMA
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_lr_scheduler_changes_take_effect():
    p = make_params([(10,)])
    opt = lowmemopt.SGD(p, lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.0 if step >= 1 else 1.0)
    run(opt, p, 1)
    sched.step()
    before = p[0].detach().clone()
    run(opt, p, 1, start=1)
    assert torch.equal(p[0], before)


def _snapshot(opt):
    """The optimizer's state and groups: the objects and their values, to check a failed load changed nothing."""
    state = {
        p: (st, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()})
        for p, st in opt.state.items()
    }
    groups = [(g, {k: (list(v) if k == "params" else v) for k, v in g.items()}) for g in opt.param_groups]
    return state, groups


def _assert_unchanged(opt, snapshot):
    state, groups = snapshot
    assert set(opt.state) == set(state)
    for p, (st, values) in state.items():
        assert opt.state[p] is st and st.keys() == values.keys()
        for k, v in values.items():
            assert torch.equal(st[k], v) if isinstance(v, torch.Tensor) else st[k] == v
    assert [g for g in opt.param_groups] == [g for g, _ in groups]
    for (g, values), now in zip(groups, opt.param_groups):
        assert now is g and {k: (list(v) if k == "params" else v) for k, v in now.items()} == values


def _state_dict_of(make, steps=1):
    params = make_params([(40, 30), (30,)])
    opt = make(params)
    run(opt, params, steps)
    return opt.state_dict()


FOREIGN = {  # (state dict, what the error calls it)
    "torch SGD": (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "SGD with momentum"),
    "SGD": (lambda p: lowmemopt.SGD(p, lr=0.1, momentum=0.9), "SGD with momentum"),
    "SGD without momentum": (lambda p: lowmemopt.SGD(p, lr=0.1), "an optimizer that keeps no state per parameter"),
    "Lion": (lambda p: lowmemopt.Lion(p, lr=1e-3), "Lion"),
    "Lion 8-bit": (lambda p: lowmemopt.Lion(p, lr=1e-3, state_bits=8, min_quant_numel=0), "Lion"),
    "torch Adafactor": (lambda p: torch.optim.Adafactor(p), r"torch.optim.Adafactor \(lowmemopt.AdafactorTorch\)"),
    "CAME": (lambda p: lowmemopt.CAME(p, lr=1e-3), "CAME"),
    "torch RMSprop": (lambda p: torch.optim.RMSprop(p), "torch.optim.RMSprop"),
}


@pytest.mark.parametrize("name", FOREIGN)
def test_another_optimizers_state_dict_is_named_and_changes_nothing(name):
    """An SGD, Lion, Adafactor, ... state dict given to AdamW: a ValueError naming the optimizer it looks like; the
    AdamW is left exactly as it was (its state and groups the same objects, with the same values)."""
    make, origin = FOREIGN[name]
    saved = _state_dict_of(make)
    params = make_params([(40, 30), (30,)])
    opt = lowmemopt.AdamW(params, lr=1e-2)
    run(opt, params, 2)
    snapshot = _snapshot(opt)
    with pytest.raises(
        ValueError,
        match=rf"It looks like the state of {origin}.*, not of AdamW \(slots exp_avg, "
        r"exp_avg_sq\): a state dict loads into the optimizer that saved it",
    ):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, snapshot)


@pytest.mark.parametrize("slot", ["exp_avg", "exp_avg_sq", "step"])
def test_a_slot_that_is_not_a_tensor_is_a_value_error_and_changes_nothing(slot):
    """A Python list where a tensor belongs (a hand-edited or JSON round-tripped state dict): a ValueError naming the
    parameter and the slot, not an AttributeError; the optimizer unchanged."""
    saved = _state_dict_of(lambda p: lowmemopt.AdamW(p, lr=1e-2))
    saved["state"][1][slot] = saved["state"][1][slot].tolist() if slot != "step" else [3]
    params = make_params([(40, 30), (30,)])
    opt = lowmemopt.AdamW(params, lr=1e-2)
    run(opt, params, 2)
    snapshot = _snapshot(opt)
    match = (
        "parameter 1 of param group 0: step"
        if slot == "step"
        else f"parameter 1 of param group 0: state '{slot}' is a list, not a tensor"
    )
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(saved)
    _assert_unchanged(opt, snapshot)
    saved["state"][1][slot] = torch.tensor([1.0, 2.0]) if slot != "step" else 3  # (a tensor of the wrong size: named)
    if slot != "step":
        with pytest.raises(ValueError, match=f"'{slot}' has shape"):
            opt.load_state_dict(saved)
        _assert_unchanged(opt, snapshot)
