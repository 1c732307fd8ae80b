"""Every public optimizer class and alias shows its real keyword arguments (``lowmemopt.signature``): what
``inspect.signature`` and ``help()`` show names the storage options and has no ``*args`` / ``**kwargs``; an alias shows
the defaults it changes, and those are what it does; editors see the same options (``Unpack[StorageOptions]``)."""

from __future__ import annotations

import inspect
import pydoc
import typing

import pytest
import torch

import lowmemopt
from lowmemopt.optimizer import LowMemOptimizer
from lowmemopt.registry import needs_process_group
from lowmemopt.signature import StorageOptions

#: the storage options: the base class's keyword-only parameters
STORAGE = [p.name for p in inspect.signature(LowMemOptimizer.__init__).parameters.values() if p.kind is p.KEYWORD_ONLY]
PUBLIC = [
    n
    for n in lowmemopt.__all__
    if isinstance(getattr(lowmemopt, n), type) and issubclass(getattr(lowmemopt, n), torch.optim.Optimizer)
]


def test_every_public_optimizer_is_covered():
    assert len(PUBLIC) >= 40 and {"AdamW", "AdamW8bit", "DeepSpeedCPUAdam", "OnebitAdam", "CAME4bit"} <= set(PUBLIC)
    assert {"state_bits", "block_size", "paged", "bf16_update", "foreach", "differentiable"} <= set(STORAGE)


@pytest.mark.parametrize("name", PUBLIC)
def test_signature_names_every_keyword(name):
    cls = getattr(lowmemopt, name)
    params = inspect.signature(cls).parameters
    kinds = {p.kind for p in params.values()}
    assert inspect.Parameter.VAR_KEYWORD not in kinds and inspect.Parameter.VAR_POSITIONAL not in kinds, params
    assert next(iter(params)) in ("params", "model_params", "named_parameters")
    for key in STORAGE:
        assert params[key].kind is inspect.Parameter.KEYWORD_ONLY, key
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert (
        f"{cls.__name__}(" in text
        and "state_bits: 'int' = " in text
        and "**storage" not in text
        and "*args" not in text
    )


@pytest.mark.parametrize("name", [n for n in PUBLIC if not needs_process_group(getattr(lowmemopt, n))])
def test_the_defaults_shown_are_the_defaults_taken(name):
    """Every storage option's default in the signature is the one the optimizer stores (an alias's too:
    ``AdamW8bit``'s ``state_bits=8``, ``PagedAdamW``'s ``paged=True``)."""
    cls = getattr(lowmemopt, name)
    params = inspect.signature(cls).parameters
    try:  # (a matrix: Muon's groups take 2-D parameters only)
        opt = cls([torch.nn.Parameter(torch.zeros(3, 3))])
    except (TypeError, ValueError):  # (an optimizer whose lr is required: CAME, FusedSGD)
        opt = cls([torch.nn.Parameter(torch.zeros(3, 3))], lr=1e-3)
    for key in (
        "state_bits",
        "min_quant_numel",
        "paged",
        "page_budget_bytes",
        "page_headroom_bytes",
        "bf16_update",
        "capturable",
    ):
        assert opt.defaults[key] == params[key].default, key


def test_an_alias_shows_its_own_defaults():
    sig = inspect.signature(lowmemopt.PagedAdamW4bit).parameters
    assert sig["state_bits"].default == 4 and sig["paged"].default is True
    assert inspect.signature(lowmemopt.AdamW8bit).parameters["state_bits"].default == 8
    assert inspect.signature(lowmemopt.AdamW).parameters["state_bits"].default == 32
    assert list(inspect.signature(lowmemopt.DeepSpeedCPUAdam).parameters)[:3] == [
        "model_params",
        "lr",
        "bias_correction",
    ]


def test_editors_see_the_same_storage_options():
    """``StorageOptions`` (what ``**storage: Unpack[StorageOptions]`` tells static tools) is the base class's
    keyword-only parameters, and every optimizer class annotates its ``**storage`` with it."""
    assert list(typing.get_type_hints(StorageOptions, include_extras=False)) == STORAGE
    annotated = 0
    for name in PUBLIC:
        for c in getattr(lowmemopt, name).__mro__:
            init = c.__dict__.get("__init__")
            if init is not None and "storage" in getattr(init, "__annotations__", {}):
                assert init.__annotations__["storage"] == "Unpack[StorageOptions]", c
                annotated += 1
    assert annotated >= len(set(PUBLIC)) // 2


@pytest.mark.parametrize("name", PUBLIC)
def test_a_misspelt_keyword_names_the_class_and_the_closest_keyword(name):
    """``state_bit=8`` is a TypeError in Python's words, naming the class (not ``LowMemOptimizer.__init__``, where
    ``**storage`` lands) and ``state_bits``."""
    cls = getattr(lowmemopt, name)
    with pytest.raises(
        TypeError,
        match=rf"^{cls.__name__}\.__init__\(\) got an unexpected keyword argument 'state_bit': "
        r"did you mean 'state_bits'\?",
    ):
        cls([torch.nn.Parameter(torch.zeros(3, 3))], lr=1e-3, state_bit=8)


def test_misspelt_algorithm_keywords():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(TypeError, match=r"^AdamW\.__init__\(\) got .* 'weight_decy': did you mean 'weight_decay'\?"):
        lowmemopt.AdamW(p, lr=1e-3, weight_decy=0.01)
    with pytest.raises(TypeError, match=r"^CAME\.__init__\(\) got .* 'beta': did you mean 'betas'\?"):
        lowmemopt.CAME(p, lr=1e-3, beta=(0.9, 0.999, 0.9999))
    with pytest.raises(TypeError, match=r"^SGD\.__init__\(\) got .* 'zzz': SGD takes lr, momentum, "):
        lowmemopt.SGD(p, lr=1e-3, zzz=1)


def test_a_users_subclass_keeps_its_own_keywords():
    """Only lowmemopt's own classes check keywords at their door: a user's subclass that forwards ``**kwargs``
    still gets to the class it subclasses, which names itself."""

    class Mine(lowmemopt.AdamW):
        def __init__(self, params, extra=1, **kwargs):
            self.extra = extra
            super().__init__(params, **kwargs)

    p = [torch.nn.Parameter(torch.zeros(3))]
    assert Mine(p, extra=2, lr=1e-2, state_bits=8).defaults["lr"] == 1e-2
    with pytest.raises(TypeError, match=r"^AdamW\.__init__\(\) got .* 'state_bit'"):
        Mine(p, state_bit=8)


BNB_ALIASES = [
    "Adam8bit",
    "AdamW8bit",
    "LAMB8bit",
    "LARS8bit",
    "Lion8bit",
    "GaLoreAdamW8bit",
    "PagedAdamW",
    "PagedAdamW8bit",
]


@pytest.mark.parametrize("name", BNB_ALIASES)
def test_bitsandbytes_names_take_bitsandbytes_keywords(name):
    """``min_8bit_size``, ``is_paged``, ``optim_bits`` (32 on the 8-bit names, as bitsandbytes: "for
    compatibility") and ``args=None`` of bitsandbytes 0.50's classes are lowmemopt's ``min_quant_numel``, ``paged``,
    ``state_bits``; the keywords it lacks say so."""
    cls = getattr(lowmemopt, name)
    p = [torch.nn.Parameter(torch.zeros(3, 3))]
    opt = cls(p, lr=1e-3, min_8bit_size=100, is_paged=True, optim_bits=32, args=None)
    bits = 8 if "8bit" in name else 32
    assert (opt.defaults["min_quant_numel"], opt.defaults["paged"], opt.defaults["state_bits"]) == (100, True, bits)
    assert type(opt) is cls
    with pytest.raises(ValueError, match="min_8bit_size=100 and min_quant_numel=50 disagree"):
        cls(p, lr=1e-3, min_8bit_size=100, min_quant_numel=50)
    with pytest.raises(TypeError, match=rf"^{name}: percentile_clipping is a bitsandbytes keyword .*clip_grad_norm_"):
        cls(p, lr=1e-3, percentile_clipping=5)
    with pytest.raises(TypeError, match=rf"^{name}: args= .*not taken"):
        cls(p, lr=1e-3, args=object())
    if bits == 32:
        assert cls(p, lr=1e-3, optim_bits=8).defaults["state_bits"] == 8


@pytest.mark.parametrize(
    "name, given",
    [
        ("AdamW8bit", dict(state_bits=4)),
        ("AdamW8bit", dict(optim_bits=4)),
        ("AdamW4bit", dict(state_bits=8)),
        ("PagedAdamW", dict(paged=False)),
        ("PagedAdamW8bit", dict(is_paged=True, paged=False)),
    ],
)
def test_an_alias_refuses_what_contradicts_its_name(name, given):
    with pytest.raises(ValueError, match=rf"^{name}(: .* disagree| has (state_bits|paged)=.*\(its name\))"):
        getattr(lowmemopt, name)([torch.nn.Parameter(torch.zeros(3, 3))], lr=1e-3, **given)
    opt = getattr(lowmemopt, name)([{"params": [torch.nn.Parameter(torch.zeros(3, 3))], "state_bits": 32}], lr=1e-3)
    assert opt.param_groups[0]["state_bits"] == 32  # (a param group may choose its own)
