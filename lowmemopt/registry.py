"""Optimizers by name, for the Trainer integration and the ``lowmemopt`` command.

Every optimizer class exported by :mod:`lowmemopt` (``AdamW``, ``CAME``, the drop-in aliases such as ``AdamW8bit``...)
is reachable by its name, case-insensitively and ignoring ``_``, ``-`` and spaces: ``"adamw"``, ``"AdamW8bit"``,
``"adamw_8bit"`` and ``"ADAMW-8BIT"`` all name ``lowmemopt.AdamW8bit``. Names that are not a class may carry the
prefixes ``galore`` (the optimizer is to run in GaLore's projected subspace: the caller builds GaLore param groups) and
``paged`` (``paged=True``), in that order: ``"galore_came8bit"`` is ``CAME8bit`` in GaLore groups,
``"paged_lion8bit"`` is ``Lion8bit(paged=True)``. A class name without a drop-in alias for its bits may end in
``32bit``, ``16bit``, ``8bit`` or ``4bit`` (``state_bits``): ``"muon_8bit"`` is ``Muon(state_bits=8)``.

Some classes need ``torch.distributed`` initialized to be built on real parameters (the 1-bit optimizers, whose
class attribute ``requires_process_group`` is True): :func:`needs_process_group` says which, and
:func:`check_process_group` raises a clear error where none is initialized. Built on meta parameters they need none
(a layout: ``lowmemopt estimate``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

__all__ = ["Resolved", "check_process_group", "instantiate", "model_params", "needs_process_group",
           "optimizer_classes", "optimizer_names", "resolve"]


class Resolved(NamedTuple):
    """What a name means: the class, whether it asks for GaLore groups, and keyword defaults the name implies."""

    cls: type[torch.optim.Optimizer]
    galore: bool
    kwargs: dict[str, Any]


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "_- ")


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class in ``lowmemopt.__all__``, by class name."""
    import lowmemopt

    classes = {}
    for name in lowmemopt.__all__:
        obj = getattr(lowmemopt, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
            classes[name] = obj
    return classes


def optimizer_names() -> list[str]:
    """The class names :func:`resolve` accepts (prefixed forms aside), sorted."""
    return sorted(optimizer_classes(), key=str.lower)


def resolve(name: str) -> Resolved:
    """Look ``name`` up (see the module docstring); raises ValueError, listing the known names, if it names nothing."""
    if not isinstance(name, str):
        raise TypeError(f"optimizer name must be a string, got {type(name).__name__}")
    by_key = {_key(n): cls for n, cls in optimizer_classes().items()}
    key = _key(name)
    if key in by_key:
        cls = by_key[key]
        return Resolved(cls, cls.__name__.lower().startswith("galore"), {})
    galore = paged = False
    rest = key
    if rest.startswith("galore"):
        galore, rest = True, rest[len("galore"):]
    if rest.startswith("paged"):
        paged, rest = True, rest[len("paged"):]
    kwargs: dict[str, Any] = {"paged": True} if paged else {}
    if (galore or paged) and rest in by_key:
        return Resolved(by_key[rest], galore or by_key[rest].__name__.lower().startswith("galore"), kwargs)
    for bits in (32, 16, 8, 4):
        base = rest.removesuffix(f"{bits}bit")
        if base != rest and base in by_key:
            cls = by_key[base]
            return Resolved(cls, galore or cls.__name__.lower().startswith("galore"), {**kwargs, "state_bits": bits})
    raise ValueError(
        f"unknown optimizer {name!r}; choose one of {', '.join(optimizer_names())} (case-insensitive; "
        "'_' and '-' are ignored; prefix 'galore_' and/or 'paged_' for GaLore groups / paged state)"
    )


def needs_process_group(cls: type) -> bool:
    """Whether ``cls`` needs an initialized ``torch.distributed`` process group to be built on real parameters (its
    class attribute ``requires_process_group``)."""
    return bool(getattr(cls, "requires_process_group", False))


def check_process_group(cls: type) -> None:
    """Raise RuntimeError, naming what is missing, if ``cls`` needs a process group and none is initialized."""
    if not needs_process_group(cls):
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{cls.__name__} needs torch.distributed initialized before it is built: launch with torchrun (the "
            "Trainer then initializes the process group) or call torch.distributed.init_process_group() first; "
            "it communicates compressed momentum between data-parallel ranks (docs/onebit.md)")


def instantiate(cls: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)`` with a placeholder ``lr=1e-3`` when none is given (CAME requires one; Adafactor with
    ``relative_step=True``, its default, takes none). For validating keywords and laying out state, not training."""
    from .optim import Adafactor

    if "lr" not in kwargs and not (issubclass(cls, Adafactor) and kwargs.get("relative_step", True)):
        kwargs["lr"] = 1e-3
    groups_of = getattr(cls, "model_param_groups", None)
    if groups_of is not None:  # (bare tensors: the class's own split of them)
        params = list(params)
        if not any(isinstance(p, dict) for p in params):
            params = groups_of(params)
    return cls(params, **kwargs)


def model_params(cls: type, model: torch.nn.Module) -> Any:
    """What ``cls`` is built on for ``model``: the param groups the class makes of a model where it needs its own
    (its ``model_param_groups``: Muon's hidden matrices and the rest), else the trainable parameters."""
    groups_of = getattr(cls, "model_param_groups", None)
    if groups_of is not None:
        return groups_of(model)
    return [p for p in model.parameters() if p.requires_grad]
