"""Optimizers by name, for the Trainer integration and the ``lowmemopt`` command: every class :mod:`lowmemopt`
exports, case-insensitively and ignoring ``_``, ``-`` and spaces (``"adamw_8bit"`` is ``AdamW8bit``). A name may carry
the prefixes ``galore`` (GaLore groups) and ``paged`` (``paged=True``), in that order, and a class without a drop-in
alias a ``32bit`` ... ``4bit`` ending (``"muon_8bit"`` is ``Muon(state_bits=8)``). :func:`needs_process_group`: the
classes that need ``torch.distributed`` on real parameters.
"""

from __future__ import annotations

import ast
import difflib
import importlib.util
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = [
    "Resolved",
    "check_process_group",
    "declared_class_names",
    "instantiate",
    "model_params",
    "needs_process_group",
    "optimizer_classes",
    "optimizer_names",
    "resolve_optimizer",
    "unknown_names",
]


class Resolved(NamedTuple):
    """What a name means: the class, whether it asks for GaLore groups, and keyword defaults the name implies."""

    cls: type[torch.optim.Optimizer]
    galore: bool
    kwargs: dict[str, Any]


def _key(name: str) -> str:
    return "".join(ch for ch in name.lower() if ch not in "_- ")


def optimizer_classes() -> dict[str, type[torch.optim.Optimizer]]:
    """Every optimizer class in ``lowmemopt.__all__``, by class name."""
    import torch

    import lowmemopt

    classes = {}
    for name in lowmemopt.__all__:
        obj = getattr(lowmemopt, name)
        if isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer):
            classes[name] = obj
    return classes


def optimizer_names() -> list[str]:
    """The class names :func:`resolve_optimizer` accepts (prefixed forms aside), sorted."""
    return sorted(optimizer_classes(), key=str.lower)


def _match(name: str, keys: Iterable[str]) -> tuple[str, bool, bool, int | None] | None:
    """The class key ``name`` names, its GaLore and paged prefixes and its ``<bits>bit`` ending; None if none."""
    keys = set(keys)
    key = _key(name)
    if key in keys:
        return key, False, False, None
    galore = paged = False
    rest = key
    if rest.startswith("galore"):
        galore, rest = True, rest[len("galore") :]
    if rest.startswith("paged"):
        paged, rest = True, rest[len("paged") :]
    if (galore or paged) and rest in keys:
        return rest, galore, paged, None
    for bits in (32, 16, 8, 4):
        base = rest.removesuffix(f"{bits}bit")
        if base != rest and base in keys:
            return base, galore, paged, bits
    return None


def _unknown(name: str, class_names: Iterable[str]) -> ValueError:
    class_names = sorted(set(class_names), key=str.lower)
    by_key = {_key(n): n for n in class_names}
    close = difflib.get_close_matches(_key(name), by_key, n=1)
    hint = f" (did you mean {by_key[close[0]]!r}?)" if close else ""
    return ValueError(
        f"unknown optimizer {name!r}{hint}; choose one of {', '.join(class_names)} "
        "(case-insensitive; '_' and '-' are ignored; prefix 'galore_' and/or 'paged_' for GaLore groups / paged state)"
    )


def resolve_optimizer(name: str) -> Resolved:
    """Look ``name`` up; ValueError listing the known names if it names nothing."""
    if not isinstance(name, str):
        raise TypeError(f"optimizer name must be a string, got {type(name).__name__}")
    by_key = {_key(n): cls for n, cls in optimizer_classes().items()}
    found = _match(name, by_key)
    if found is None:
        raise _unknown(name, optimizer_names())
    key, galore, paged, bits = found
    cls = by_key[key]
    kwargs: dict[str, Any] = {"paged": True} if paged else {}
    if bits is not None:
        kwargs["state_bits"] = bits
    return Resolved(cls, galore or cls.__name__.lower().startswith("galore"), kwargs)


def declared_class_names() -> list[str] | None:
    """:func:`optimizer_names` read from the package's sources, without importing torch; None if unreadable."""
    import lowmemopt

    spec = importlib.util.find_spec("lowmemopt.aliases")
    try:
        with open(spec.origin) as f:  # type: ignore[union-attr, arg-type]
            tree = ast.parse(f.read())
        aliases = next(
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        )
        names = [*lowmemopt._CLASSES, *lowmemopt._MODULE_CLASSES, *aliases]
    except (AttributeError, OSError, StopIteration, TypeError, ValueError, SyntaxError):
        return None
    return sorted(names, key=str.lower) if all(isinstance(n, str) for n in names) else None


def unknown_names(names: Iterable[str]) -> ValueError | None:
    """The error :func:`resolve_optimizer` would raise for the first unknown of ``names``, without importing torch."""
    declared = declared_class_names()
    if declared is None:
        return None
    keys = {_key(n) for n in declared}
    return next((_unknown(n, declared) for n in names if _match(n, keys) is None), None)


def needs_process_group(cls: type) -> bool:
    """Whether ``cls`` needs an initialized process group on real parameters (``requires_process_group``)."""
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
            "it communicates compressed momentum between data-parallel ranks (docs/onebit.md)"
        )


def instantiate(cls: type[torch.optim.Optimizer], params: Any, **kwargs: Any) -> torch.optim.Optimizer:
    """``cls(params, **kwargs)``, ``lr=1e-3`` if none is given: for checking keywords and laying out state."""
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
    """What ``cls`` is built on for ``model``: its ``model_param_groups`` (Muon), else the parameters."""
    groups_of = getattr(cls, "model_param_groups", None)
    if groups_of is not None:
        return groups_of(model)
    return [p for p in model.parameters() if p.requires_grad]
