"""u-μP (unit-scaled maximal update parametrization, graphcore's ``unit_scaling``) with lowmemopt optimizers: the
param groups of ``unit_scaling.optim.scaled_parameters`` carry each parameter's scaled lr and weight decay, and any
lowmemopt optimizer takes them (``docs/distributed_recipes.md``). At 32 bits the result equals unit_scaling's own
Adam, AdamW and SGD (torch's optimizers over the same groups) to fp32 rounding, the tolerance of lowmemopt's parity
suite against torch (tests/test_optimizers.py)."""

from __future__ import annotations

import pytest
import torch

import lowmemopt

uu = pytest.importorskip("unit_scaling")
uo = pytest.importorskip("unit_scaling.optim")

LR, WD = 1e-2, 0.1


def model(seed=0):
    torch.manual_seed(seed)
    m = torch.nn.ModuleList(
        [uu.TransformerDecoder(hidden_size=8, vocab_size=16, layers=2, heads=2), uu.Linear(8, 8, bias=True)]
    )  # a bias: another lr rule
    return m


def run(params, opt, steps=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize(
    "ours,theirs,scale,kw",
    [
        (lowmemopt.AdamW, uo.AdamW, uo.lr_scale_func_adam, dict(betas=(0.9, 0.95), eps=1e-8)),
        (lowmemopt.Adam, uo.Adam, uo.lr_scale_func_adam, dict()),
        (lowmemopt.SGD, uo.SGD, uo.lr_scale_func_sgd(None), dict(momentum=0.9)),
        (lowmemopt.SGD, uo.SGD, uo.lr_scale_func_sgd("to_output_scale"), dict(momentum=0.9)),
    ],
)
def test_scaled_groups_match_unit_scaling(ours, theirs, scale, kw):
    a, b = model(), model()
    pa, pb = list(a.parameters()), list(b.parameters())
    extra = {}
    if theirs is uo.SGD:
        extra["readout_constraint"] = "to_output_scale" if "inner" in scale.__name__ else None
    got = run(pa, ours(uo.scaled_parameters(pa, scale, lr=LR, weight_decay=WD), **kw))
    want = run(pb, theirs(pb, lr=LR, weight_decay=WD, **extra, **kw))
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=2e-6)
    lrs = {g["lr"] for g in ours(uo.scaled_parameters(pa, scale, lr=LR, weight_decay=WD), **kw).param_groups}
    assert len(lrs) > 1  # the groups do scale the lr per parameter


EVERY = [  # every lowmemopt optimizer with an explicit lr (a name this build lacks is left out)
    ("AdamW", dict(state_bits=8, block_size=16, min_quant_numel=0)),
    ("Adam", {}),
    ("SGD", dict(momentum=0.9)),
    ("Lion", {}),
    ("LAMB", {}),
    ("LARS", dict(momentum=0.9)),
    ("CAME", dict(lr=LR)),
    ("AdafactorTorch", {}),
    ("Adafactor", dict(lr=LR, relative_step=False, scale_parameter=False, warmup_init=False)),
    ("SignSGD", {}),
]


@pytest.mark.parametrize("name,kw", EVERY, ids=[n for n, _ in EVERY])
def test_every_optimizer_takes_the_groups(name, kw):
    """One optimizer over the u-μP groups == one optimizer per parameter at that parameter's scaled lr and weight
    decay: each group's lr and weight decay are used, nothing is shared across groups."""
    cls = getattr(lowmemopt, name, None)
    if cls is None:
        pytest.skip(f"lowmemopt.{name} is not in this build")
    a, b = model(), model()
    pa, pb = list(a.parameters()), list(b.parameters())
    groups = uo.scaled_parameters(pa, uo.lr_scale_func_adam, lr=LR, weight_decay=WD)
    got = run(pa, cls(groups, **kw))
    singles = [cls([q], **{**kw, "lr": g["lr"], "weight_decay": g["weight_decay"]}) for q, g in zip(pb, groups)]

    class All:
        def step(self):
            for o in singles:
                o.step()

    want = run(pb, All())
    for i, (x, y) in enumerate(zip(got, want)):
        assert torch.equal(x, y), f"{name} param {i}: max |diff| {float((x - y).abs().max()):.3g}"
