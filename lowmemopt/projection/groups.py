"""``galore_param_groups``: param groups that project chosen ``nn.Linear`` weights, selected by module name as the HF
Trainer's ``optim_target_modules`` selects them."""

from __future__ import annotations

import difflib
import re
from typing import Any, Sequence

import torch

from .checks import check_group

__all__ = ["galore_param_groups"]

_EXTRA_KEYS = {"proj_svd", "proj_moments", "proj_stagger", "proj_dtype", "proj_bits"}


def _matches(target: str | Sequence[str], name: str) -> tuple[bool, bool]:
    """(does module ``name`` match, was it by regex), with ``transformers.trainer_utils.check_target_module_exists``'s
    rules: a str is a regex matched with ``re.fullmatch``; a list matches a name equal to, containing, or
    ``re.fullmatch``-ing one of its entries."""
    if isinstance(target, str):
        return bool(re.fullmatch(target, name)), target != name
    if name in target or any(t in name for t in target):
        return True, False
    return any(re.fullmatch(t, name) for t in target), True


def galore_param_groups(
    model: torch.nn.Module,
    target_modules: str | Sequence[str],
    rank: int,
    update_proj_gap: int = 200,
    scale: float = 0.25,
    proj_type: str = "std",
    weight_decay: float | None = None,
    **projection: Any,
) -> list[dict[str, Any]]:
    """Param groups for a lowmemopt optimizer: the weights of the selected ``nn.Linear`` modules in one group with
    ``rank`` (projected, GaLore), every other trainable parameter in plain groups.

    ``target_modules``: a str is a regex that must match the whole module name (``re.fullmatch``, e.g.
    ``r".*\\.(q|k|v|o)_proj"``); a list selects module names equal to or containing one of its strings (or fully
    matching one as a regex), e.g. ``["attn", "mlp"]``; ``"all-linear"`` selects every ``nn.Linear``. Matched modules
    that are not ``nn.Linear`` (containers, norms) are skipped; no ``nn.Linear`` match raises ValueError.

    ``weight_decay``: None leaves every group without a ``weight_decay`` key (the optimizer's default applies);
    a number sets it on the projected group and on the other parameters of >= 2 dims, and sets 0.0 on the 1-D ones
    (biases, norm weights), as the Trainer does for its decay / no-decay split.

    ``projection``: other GaLore group keys (``proj_svd``, ``proj_moments``, ``proj_stagger``, ``proj_dtype``,
    ``proj_bits``; see :mod:`lowmemopt.projection.checks`). Frozen parameters (``requires_grad=False``) are left out;
    a parameter shared by several modules appears once.
    """
    if isinstance(target_modules, str):
        all_linear = target_modules.replace("_", "-") == "all-linear"
    elif isinstance(target_modules, (list, tuple)) and all(isinstance(t, str) for t in target_modules):
        all_linear = False
    else:
        raise TypeError(
            "target_modules must be a regex string, a list of strings or 'all-linear', got "
            f"{type(target_modules).__name__} {target_modules!r}"
        )
    unknown = sorted(set(projection) - _EXTRA_KEYS)
    if unknown:
        options = ["rank", "update_proj_gap", "scale", "proj_type", "weight_decay", *sorted(_EXTRA_KEYS)]
        close = difflib.get_close_matches(unknown[0], options, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TypeError(
            f"galore_param_groups() got an unexpected keyword argument {unknown[0]!r}: {hint}its GaLore "
            f"options are {', '.join(options)} (target_modules selects the modules)"
        )
    galore = dict(params=[], rank=rank, update_proj_gap=update_proj_gap, scale=scale, proj_type=proj_type)
    galore.update(projection)
    check_group(dict(galore))  # the optimizer checks again; fail here, before walking the model

    targets: set[int] = set()
    skipped = []
    for name, module in model.named_modules():
        found, is_regex = (True, False) if all_linear else _matches(target_modules, name)
        if not found:
            continue
        if not isinstance(module, torch.nn.Linear):
            if not is_regex and not all_linear:
                skipped.append(name)
            continue
        if module.weight.requires_grad:
            targets.add(id(module.weight))
    if not targets:
        also = f"; these matched but are not nn.Linear: {', '.join(skipped[:8])}" if skipped else ""
        raise ValueError(f"galore_param_groups: no nn.Linear module matches target_modules={target_modules!r}{also}")

    projected, decay, no_decay, seen = [], [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if id(p) in targets:
            projected.append(p)
        elif weight_decay is not None and p.dim() < 2:
            no_decay.append(p)
        else:
            decay.append(p)
    galore["params"] = projected
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append(dict(params=decay))
    if no_decay:
        groups.append(dict(params=no_decay, weight_decay=0.0))
    if weight_decay is not None:
        galore["weight_decay"] = weight_decay
        if decay:
            groups[0]["weight_decay"] = weight_decay
    groups.append(galore)
    return groups
