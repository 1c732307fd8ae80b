"""Drop-in names for users migrating from bitsandbytes, galore-torch, DeepSpeed: each is a change of defaults only
(``AdamW8bit(params, lr=...)`` is ``AdamW(params, lr=..., state_bits=8)``; ``Paged*`` add ``paged=True``). A keyword
that contradicts the name is a ValueError; bitsandbytes' storage keywords (:data:`BNB_KEYWORDS`) are mapped or refused.
What each alias is: ``docs/migrating.md``.
"""

from __future__ import annotations

import inspect
from typing import Any, TypeVar

from .optim import CAME, LAMB, LARS, Adafactor, AdEMAMix, Adam, AdamW, CPUAdam, HFAdamW, Lion
from .optimizer import LowMemOptimizer
from .signature import constructor_signature

T = TypeVar("T", bound=type)

__all__ = [
    "Adafactor4bit",
    "Adam4bit",
    "AdamW4bit",
    "CAME4bit",
    "GaLoreAdamW4bit",
    "LAMB4bit",
    "LARS4bit",
    "Lion4bit",
    "PagedAdamW4bit",
    "Adafactor8bit",
    "Adam8bit",
    "AdamW8bit",
    "CAME8bit",
    "DeepSpeedCPUAdam",
    "GaLoreAdafactor",
    "GaLoreAdamW",
    "GaLoreAdamW8bit",
    "LAMB8bit",
    "LARS8bit",
    "Lion8bit",
    "PagedAdamW",
    "PagedAdamW8bit",
    "AdEMAMix4bit",
    "AdEMAMix8bit",
    "PagedAdEMAMix",
    "PagedAdEMAMix4bit",
    "PagedAdEMAMix8bit",
]


#: bitsandbytes 0.50's storage keywords on its classes' names here: lowmemopt's keyword for each (None: not given)
BNB_KEYWORDS = {"optim_bits": "state_bits", "args": None, "min_8bit_size": "min_quant_numel", "is_paged": "paged"}
#: bitsandbytes keywords with no counterpart here, and what to do instead
BNB_UNSUPPORTED = {
    "percentile_clipping": "clip gradients before step() (torch.nn.utils.clip_grad_norm_)",
    "block_wise": "the state is always block-wise (block_size=)",
    "max_unorm": "clip gradients before step() (torch.nn.utils.clip_grad_norm_)",
}


def _bnb_keywords(name: str, kwargs: dict[str, Any], fixed: dict[str, Any]) -> None:
    """Replace bitsandbytes' keywords in ``kwargs`` by lowmemopt's (in place); a ValueError where one disagrees
    with the lowmemopt keyword given beside it or with the alias's name."""
    for theirs, ours in BNB_KEYWORDS.items():
        if theirs not in kwargs:
            continue
        value = kwargs.pop(theirs)
        if value is None:
            continue  # (the signature's default: not given)
        if theirs == "args":
            raise TypeError(
                f"{name}: args= (bitsandbytes' object of overrides) is not taken here: give its settings "
                "as keywords (state_bits=, min_quant_numel=, block_size=, ...) or as param group keys"
            )
        if theirs == "optim_bits" and value == 32 and "state_bits" in fixed:
            continue  # (bitsandbytes' 8-bit classes take only optim_bits=32, "for compatibility")
        if theirs == "is_paged" and not value:
            value = kwargs.get("paged", fixed.get("paged", False))  # (False: not asked for)
        if ours in kwargs and kwargs[ours] != value:
            raise ValueError(
                f"{name}: {theirs}={value!r} and {ours}={kwargs[ours]!r} disagree ({theirs} is "
                f"bitsandbytes' name for {ours}); give one"
            )
        kwargs[ours] = value


def _alias(base: T, name: str, galore: dict[str, Any] | None = None, bnb: bool = False, **fixed: Any) -> T:
    """``base`` under ``name`` with other defaults for the keywords ``fixed`` (a keyword that contradicts them is a
    ValueError: they are the name); its signature is the base's, those defaults changed (:mod:`lowmemopt.signature`).
    ``galore``: other defaults for the GaLore keys of its param groups with ``rank`` (filled in where a group added
    to it does not set them). ``bnb``: a bitsandbytes name, which also takes bitsandbytes' storage keywords."""

    def __init__(self, params, *args, **kwargs):
        if bnb:
            _bnb_keywords(name, kwargs, fixed)
        for key, value in fixed.items():
            given = kwargs.setdefault(key, value)
            if key == "state_bits" and given != value or key == "paged" and not given:
                other = {
                    "state_bits": f"{base.__name__}(..., state_bits={given!r})",
                    "paged": f"{base.__name__}(..., state_bits={fixed.get('state_bits', 32)}, paged={given!r})",
                }[key]
                raise ValueError(
                    f"{name} has {key}={value!r} (its name): {key}={given!r} contradicts it; use "
                    f"{other}, or set {key} in a param group for some parameters"
                )
        base.__init__(self, params, *args, **kwargs)

    sig = constructor_signature(base.__init__, LowMemOptimizer.__init__, fixed)
    if bnb:
        sig = sig.replace(
            parameters=[
                *sig.parameters.values(),
                *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=None) for k in BNB_KEYWORDS),
            ]
        )
    __init__.__signature__ = sig
    members: dict[str, Any] = {"__init__": __init__, "__module__": __name__}
    if bnb:
        members["_keyword_hints"] = {
            k: f"{k} is a bitsandbytes keyword that lowmemopt does not have: {v}" for k, v in BNB_UNSUPPORTED.items()
        }
    if galore:

        def add_param_group(self, param_group):
            if isinstance(param_group, dict) and param_group.get("rank") is not None:
                param_group = {**galore, **param_group}
            base.add_param_group(self, param_group)

        members["add_param_group"] = add_param_group

    settings = ", ".join(f"{k}={v!r}" for k, v in fixed.items())
    what = f"``{base.__name__}`` with ``{settings}`` by default" if fixed else f"``{base.__name__}`` under another name"
    if galore:
        what += ", its GaLore groups with " + ", ".join(f"``{k}={v!r}``" for k, v in galore.items()) + " by default"
    members["__doc__"] = f"{what} (a drop-in alias).\n\n{base.__doc__}"
    return type(name, (base,), members)


Adam8bit = _alias(Adam, "Adam8bit", bnb=True, state_bits=8)
AdamW8bit = _alias(AdamW, "AdamW8bit", bnb=True, state_bits=8)
LAMB8bit = _alias(LAMB, "LAMB8bit", bnb=True, state_bits=8)
LARS8bit = _alias(LARS, "LARS8bit", bnb=True, state_bits=8)
Lion8bit = _alias(Lion, "Lion8bit", bnb=True, state_bits=8)
Adafactor8bit = _alias(Adafactor, "Adafactor8bit", state_bits=8)
CAME8bit = _alias(CAME, "CAME8bit", state_bits=8)

# 4-bit state (lowmemopt.quant.q4; block 128 by default)
Adam4bit = _alias(Adam, "Adam4bit", state_bits=4)
AdamW4bit = _alias(AdamW, "AdamW4bit", state_bits=4)
LAMB4bit = _alias(LAMB, "LAMB4bit", state_bits=4)
LARS4bit = _alias(LARS, "LARS4bit", state_bits=4)
Lion4bit = _alias(Lion, "Lion4bit", state_bits=4)
Adafactor4bit = _alias(Adafactor, "Adafactor4bit", state_bits=4)
CAME4bit = _alias(CAME, "CAME4bit", state_bits=4)

# galore-torch's names (projection: a param group with ``rank``, in any optimizer)
GaLoreAdamW = _alias(HFAdamW, "GaLoreAdamW")
GaLoreAdamW8bit = _alias(AdamW, "GaLoreAdamW8bit", bnb=True, state_bits=8)
GaLoreAdamW4bit = _alias(AdamW, "GaLoreAdamW4bit", state_bits=4)
# galore-torch's Adafactor casts a bf16 gradient to fp32 before projecting it: fp32 products (its AdamW: bf16 ones)
GaLoreAdafactor = _alias(Adafactor, "GaLoreAdafactor", galore=dict(proj_dtype="float32"))

# DeepSpeed's name for its CPU Adam (deepspeed.ops.adam.DeepSpeedCPUAdam)
DeepSpeedCPUAdam = _alias(CPUAdam, "DeepSpeedCPUAdam")

# bitsandbytes' paged optimizers keep state in CUDA managed memory; ours page it to pinned host RAM (see
# docs/paging.md): paged="disk" with offload_dir= and page_budget_bytes= are available on any optimizer
PagedAdamW = _alias(AdamW, "PagedAdamW", bnb=True, paged=True)
PagedAdamW8bit = _alias(AdamW, "PagedAdamW8bit", bnb=True, state_bits=8, paged=True)
PagedAdamW4bit = _alias(AdamW, "PagedAdamW4bit", state_bits=4, paged=True)

# bitsandbytes' AdEMAMix names (bitsandbytes.optim.AdEMAMix8bit, PagedAdEMAMix, PagedAdEMAMix8bit), and 4-bit
AdEMAMix8bit = _alias(AdEMAMix, "AdEMAMix8bit", state_bits=8)
AdEMAMix4bit = _alias(AdEMAMix, "AdEMAMix4bit", state_bits=4)
PagedAdEMAMix = _alias(AdEMAMix, "PagedAdEMAMix", paged=True)
PagedAdEMAMix8bit = _alias(AdEMAMix, "PagedAdEMAMix8bit", state_bits=8, paged=True)
PagedAdEMAMix4bit = _alias(AdEMAMix, "PagedAdEMAMix4bit", state_bits=4, paged=True)
