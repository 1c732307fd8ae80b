"""The state-dict layer of :class:`~lowmemopt.optimizer.LowMemOptimizer`: the format version a state dict carries,
and the hooks torch's ``state_dict`` / ``load_state_dict`` run. Saving adds ``lowmemopt_format`` and presents a
DTensor parameter's state as DTensors; loading converts each parameter's saved state to this optimizer's formats
(:func:`~lowmemopt.quant.convert.convert_param_state`) *before* torch changes anything, so a state that cannot be
converted raises and leaves the optimizer as it was, and keeps this optimizer's storage options
(:data:`KEPT_ON_LOAD`), not the checkpoint's."""

from __future__ import annotations

from typing import Any

import torch

from . import paging, rounding
from .checks import torch_scalars
from .distributed.sharding import local_tensor, localize_state, present_state, presented_params
from .projection.projector import projector_at, projector_problem, split_projector_state
from .quant.convert import CheckpointError, check_loaded_group, convert_param_state, foreign_state_hint

#: a :class:`~lowmemopt.optimizer.LowMemOptimizer` (not imported: that module imports this one)
LowMemOptimizer = Any

__all__ = [
    "FORMAT_VERSION",
    "READABLE_FORMATS",
    "STORAGE_DEFAULTS",
    "KEPT_ON_LOAD",
    "load_state_dict_post_hook",
    "load_state_dict_pre_hook",
    "state_dict_post_hook",
    "state_dict_pre_hook",
]

#: 2: 8-bit state in the pow2 maps; 1: in bitsandbytes' dynamic maps (still read: re-encoded on load)
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
#: storage and execution options: keyword-only on every optimizer, settable per param group, and this optimizer's
#: own when a state dict is loaded (not the checkpoint's)
STORAGE_DEFAULTS = dict(
    state_bits=32,
    block_size=256,
    min_quant_numel=4096,
    paged=False,
    offload_dir=None,
    page_budget_bytes="auto",
    page_headroom_bytes=None,
    bf16_update="nearest",
    capturable=False,
)
#: the group keys a loaded state dict or file does not change (stored state converts to them instead): the storage
#: options and GaLore's ``proj_bits``
KEPT_ON_LOAD = frozenset(STORAGE_DEFAULTS) | {"proj_bits"}


def state_dict_pre_hook(optimizer: LowMemOptimizer) -> None:
    optimizer._resolve_pending()  # (a skipped loss-scaled step's counts restored first)


def state_dict_post_hook(optimizer: LowMemOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    state_dict["lowmemopt_format"] = FORMAT_VERSION
    paging.detach_files(optimizer, state_dict)  # copies, not views of state files that the next step rewrites
    presented = presented_params(optimizer)  # DTensor params: state as DTensors (lowmemopt.distributed.sharding)
    if presented:
        state = state_dict["state"] = dict(state_dict["state"])
        group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
        for index, p in presented:
            if index in state:
                group = group_of[id(p)]
                state[index] = present_state(p, state[index], group, optimizer._state_slots(group, p))
    return state_dict


def load_state_dict_pre_hook(optimizer: LowMemOptimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """Set the state's tensors aside, converted to this optimizer's formats, before torch casts anything."""
    optimizer._resolve_pending()
    optimizer._load_stash = None
    _check_is_optimizer_state(optimizer, state_dict)
    version = state_dict.get("lowmemopt_format", FORMAT_VERSION)
    if version not in READABLE_FORMATS:
        raise ValueError(
            f"optimizer state has lowmemopt_format={version!r}; this version of lowmemopt reads formats "
            f"{', '.join(map(str, READABLE_FORMATS))}"
            + (
                " (the state is newer: upgrade lowmemopt)"
                if isinstance(version, int) and version > FORMAT_VERSION
                else ""
            )
        )
    state_dict = dict(state_dict)
    state_dict.pop("lowmemopt_format", None)
    saved_groups = state_dict["param_groups"]
    groups = optimizer.param_groups
    sizes_differ = any(len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups))
    if len(saved_groups) != len(groups) or sizes_differ:
        return state_dict  # torch raises its own, clear error for this
    id_map, converted, targets = {}, {}, {}
    try:
        for gi, (saved, group) in enumerate(zip(saved_groups, groups)):
            target = dict(group)  # hyper-parameters as torch will load them; storage options stay this optimizer's
            target.update({k: v for k, v in saved.items() if k != "params" and k not in KEPT_ON_LOAD})
            check_loaded_group(optimizer._check_group, target, f"load_state_dict: param group {gi}'s hyper-parameters")
            for i, (key, p) in enumerate(zip(saved["params"], group["params"])):
                id_map[key] = p
                value = state_dict["state"].get(key)
                where = f"load_state_dict: parameter {i} of param group {gi}"
                if value is not None and not isinstance(value, dict):
                    raise CheckpointError(f"{where}: its state is a {type(value).__name__}, not a dict of named state")
                if isinstance(value, dict):
                    _, value = localize_state(p, value)  # DTensor state -> the local shard's
                    converted[key] = _convert_state(optimizer, p, value, saved, target, where, legacy_maps=version == 1)
                    targets[key] = group
    except CheckpointError as e:  # another optimizer's state dict: say whose it looks like
        slots = lambda: {k for g in groups for p in g["params"] for k in optimizer._state_slots(g, p)}  # noqa: E731
        hint = foreign_state_hint(state_dict["state"], slots, type(optimizer).__name__)
        raise CheckpointError(f"{e}{hint}") from None
    # paged params: the state goes straight to new homes now (a failure here leaves the optimizer as it was)
    staged = paging.stage(optimizer, [(id_map[k], targets[k], st) for k, st in converted.items()])
    converted = {k: staged.get(id_map[k], st) for k, st in converted.items()}
    state_dict["state"] = {k: v for k, v in state_dict["state"].items() if k not in converted}
    storage = [{k: g[k] for k in KEPT_ON_LOAD if k in g} for g in groups]
    optimizer._load_stash = (converted, id_map, storage)
    return state_dict


def _check_is_optimizer_state(optimizer: LowMemOptimizer, state_dict: Any) -> None:
    """Raise ValueError, before anything changes, for what is no optimizer state dict (torch: ``KeyError:
    'param_groups'``): a model's ``state_dict()`` is the usual one."""
    if isinstance(state_dict, dict) and "param_groups" in state_dict and "state" in state_dict:
        return
    what = (
        f"a dict with keys {', '.join(map(repr, list(state_dict)[:4]))}{', ...' if len(state_dict) > 4 else ''}"
        if isinstance(state_dict, dict)
        else f"a {type(state_dict).__name__}"
    )
    model = (
        isinstance(state_dict, dict) and state_dict and all(isinstance(v, torch.Tensor) for v in state_dict.values())
    )
    raise ValueError(
        f"{type(optimizer).__name__}.load_state_dict: expected an optimizer's state_dict() (with 'state' "
        f"and 'param_groups'), got {what}"
        + ("; that looks like a model's weights: load them with model.load_state_dict()" if model else "")
        + ". Nothing was changed"
    )


def _convert_state(
    optimizer: LowMemOptimizer,
    p: torch.Tensor,
    value: dict[str, Any],
    saved: dict[str, Any],
    target: dict[str, Any],
    where: str,
    legacy_maps: bool,
) -> dict[str, Any]:
    """One parameter's state dict entry in this optimizer's formats (:func:`convert_param_state`); a GaLore projector
    (``galore.*``: bases and ints) is checked against the group and kept, its bases at the group's ``proj_bits``, as
    are bf16_update's entries."""
    value = {k: v for k, v in value.items() if v is not None}  # torch.optim may store None buffers
    if not value:
        return {}
    projector, value = split_projector_state(value)
    problem = projector_problem(projector, target, p.shape)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    rounding_state, value = rounding.split_state(value)  # bf16_update: a seed, a Kahan buffer; kept as they are
    kept = projector_at(projector, target, p.shape) if projector else {}  # at the group's proj_bits
    kept.update(rounding_state)
    return convert_param_state(
        value,
        optimizer._state_slots(target, p),
        saved,
        target,
        local_tensor(p),
        where,
        legacy_maps,
        numel=p.numel(),
        kept=kept,
    )


def load_state_dict_post_hook(optimizer: LowMemOptimizer) -> None:
    stash, optimizer._load_stash = optimizer._load_stash, None
    if stash is not None:
        converted, id_map, storage = stash
        for group, options in zip(optimizer.param_groups, storage):
            group.update(options)
    for group in optimizer.param_groups:  # groups from torch.optim optimizers lack our keys
        for k, v in optimizer.defaults.items():
            group.setdefault(k, v)
        torch_scalars(group)  # (a torch.optim state dict's lr of shape [1], say)
    if stash is None:
        return
    for key, state in converted.items():
        p = id_map[key]
        if paging.is_staged(optimizer, p, state):  # already where it lives (home or device)
            optimizer.state[p] = state
        else:
            optimizer.state[p] = {
                k: v.to(device=p.device) if isinstance(v, torch.Tensor) else v for k, v in state.items()
            }
    paging.reconcile(optimizer)  # adopt the staged homes, free the replaced ones
