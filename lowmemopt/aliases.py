"""Drop-in names for users migrating from bitsandbytes, galore-torch and friends: each is a change of defaults only.

``AdamW8bit(params, lr=...)`` is exactly ``AdamW(params, lr=..., state_bits=8)``; any keyword may still be overridden.

galore-torch's names: GaLore itself is not a class here but a param-group option (a group with ``rank`` is projected,
in every optimizer; see :mod:`lowmemopt.projection`), so its aliases name the inner algorithm galore-torch uses:
``GaLoreAdamW`` is transformers' legacy AdamW (:class:`~lowmemopt.optim.HFAdamW`: eps added to sqrt(v), weight
decay after the update), ``GaLoreAdafactor`` transformers' Adafactor (its GaLore groups with ``proj_dtype="float32"``
by default: galore-torch's Adafactor projects a bf16 gradient cast to fp32), and ``GaLoreAdamW8bit`` bitsandbytes'
``AdamW8bit``, i.e. torch's AdamW with 8-bit state (its weight decay is applied before the update, as for every
``AdamW``; galore-torch's applies it after the update on projected params, an O(lr^2 wd) difference).

DeepSpeed's ``DeepSpeedCPUAdam`` is :class:`~lowmemopt.CPUAdam` under its own name (ColossalAI's ``CPUAdam`` and
Apex's / DeepSpeed's ``FusedAdam``, ``FusedLAMB``, ``FusedSGD`` are classes of these names: ``docs/migrating.md``).

``PagedAdamW`` / ``PagedAdamW8bit`` (bitsandbytes' names) add ``paged=True``: state in host RAM between steps
(:mod:`lowmemopt.paging`).
"""

from __future__ import annotations

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


def _alias(base: T, name: str, galore: dict[str, Any] | None = None, **fixed: Any) -> T:
    """``base`` under ``name`` with other defaults for the keywords ``fixed``; its signature is the base's, those
    defaults changed (:mod:`lowmemopt.signature`). ``galore``: other defaults for the GaLore keys of its param groups
    with ``rank`` (filled in where a group added to it does not set them)."""

    def __init__(self, params, *args, **kwargs):
        for key, value in fixed.items():
            kwargs.setdefault(key, value)
        base.__init__(self, params, *args, **kwargs)

    __init__.__signature__ = constructor_signature(base.__init__, LowMemOptimizer.__init__, fixed)
    members: dict[str, Any] = {"__init__": __init__, "__module__": __name__}
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


Adam8bit = _alias(Adam, "Adam8bit", state_bits=8)
AdamW8bit = _alias(AdamW, "AdamW8bit", state_bits=8)
LAMB8bit = _alias(LAMB, "LAMB8bit", state_bits=8)
LARS8bit = _alias(LARS, "LARS8bit", state_bits=8)
Lion8bit = _alias(Lion, "Lion8bit", state_bits=8)
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
GaLoreAdamW8bit = _alias(AdamW, "GaLoreAdamW8bit", state_bits=8)
GaLoreAdamW4bit = _alias(AdamW, "GaLoreAdamW4bit", state_bits=4)
# galore-torch's Adafactor casts a bf16 gradient to fp32 before projecting it: fp32 products (its AdamW: bf16 ones)
GaLoreAdafactor = _alias(Adafactor, "GaLoreAdafactor", galore=dict(proj_dtype="float32"))

# DeepSpeed's name for its CPU Adam (deepspeed.ops.adam.DeepSpeedCPUAdam)
DeepSpeedCPUAdam = _alias(CPUAdam, "DeepSpeedCPUAdam")

# bitsandbytes' paged optimizers keep state in CUDA managed memory; ours page it to pinned host RAM (see
# docs/paging.md): paged="disk" with offload_dir= and page_budget_bytes= are available on any optimizer
PagedAdamW = _alias(AdamW, "PagedAdamW", paged=True)
PagedAdamW8bit = _alias(AdamW, "PagedAdamW8bit", state_bits=8, paged=True)
PagedAdamW4bit = _alias(AdamW, "PagedAdamW4bit", state_bits=4, paged=True)

# bitsandbytes' AdEMAMix names (bitsandbytes.optim.AdEMAMix8bit, PagedAdEMAMix, PagedAdEMAMix8bit), and 4-bit
AdEMAMix8bit = _alias(AdEMAMix, "AdEMAMix8bit", state_bits=8)
AdEMAMix4bit = _alias(AdEMAMix, "AdEMAMix4bit", state_bits=4)
PagedAdEMAMix = _alias(AdEMAMix, "PagedAdEMAMix", paged=True)
PagedAdEMAMix8bit = _alias(AdEMAMix, "PagedAdEMAMix8bit", state_bits=8, paged=True)
PagedAdEMAMix4bit = _alias(AdEMAMix, "PagedAdEMAMix4bit", state_bits=4, paged=True)
