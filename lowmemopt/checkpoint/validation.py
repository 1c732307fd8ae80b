"""Validation: a state file's metadata checked against its tensors, and the load plan (which saved param goes to which
optimizer param, in which formats) checked against the optimizer, before anything is changed."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any, NamedTuple

import torch

from .. import aliases, optim
from ..distributed.sharding import local_tensor, shard_layout
from ..optimizer import LowMemOptimizer
from ..state_dicts import KEPT_ON_LOAD
from ..projection.projector import projector_problem
from ..quant import q4
from ..quant.blockwise import num_blocks
from ..quant.convert import CheckpointError, check_loaded_group, format_numel, remaps, slot_shape, target_format
from ..quant.formats import FORMATS, Q4, Q8, QUANTIZED, Slot, legacy_map_for, map_for
from ..quant.maps import MAP_NAMES
from .layout import (
    DTYPES,
    FILE_FORMAT,
    FILE_VERSION,
    META_CRC_KEY,
    META_KEY,
    READABLE_FILE_VERSIONS,
    StateFile,
    open_state_file,
    param_names,
)


class LoadReport(NamedTuple):
    """What :func:`load_state` did. With ``strict=True`` the first three are always empty (it raises instead)."""

    missing: list[str]  # the optimizer's params absent from the file: their state was left as it was
    unexpected: list[str]  # params in the file that the optimizer does not have
    mismatched: dict[str, str]  # param -> why its state was not loaded (shape, slots, block size)
    converted: list[str]  # "param/slot: fp32 -> q8" for each slot stored in another format than the optimizer's
    hyperparameters_restored: bool  # groups' hyper-parameters taken from the file (only when the group layout matches)


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, LowMemOptimizer):
        raise TypeError(
            f"expected a lowmemopt optimizer, got {type(optimizer).__name__}; to convert a torch.optim or bitsandbytes "
            "state, load its state_dict() into the lowmemopt optimizer with load_state_dict, then save_state"
        )


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The validated JSON header of a state file, with ``"tensors"``: {key: (dtype, shape)}."""
    path = os.fspath(path)
    with open_state_file(path) as f:
        meta = validated_meta(f, path)
        meta["tensors"] = {k: f.dtype_shape(k) for k in f.keys()}
    return meta


def validated_meta(f: StateFile, path: str) -> dict[str, Any]:
    """Parse the header (its CRC-32 first) and check it against the file's tensors."""
    stored = f.metadata()
    raw = stored.get(META_KEY)
    if raw is None:
        raise CheckpointError(f"{path}: not a lowmemopt state file (no '{META_KEY}' metadata)")
    meta_crc = stored.get(META_CRC_KEY)
    if meta_crc is not None and meta_crc != str(zlib.crc32(raw.encode())):
        raise CheckpointError(f"{path}: the metadata fails its CRC-32 check: the file is corrupt")
    if set(stored) - {META_KEY, META_CRC_KEY}:
        unknown = sorted(set(stored) - {META_KEY, META_CRC_KEY})
        raise CheckpointError(f"{path}: corrupt state file (unknown metadata {unknown[:3]})")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({type(e).__name__}: {e})"[:300]) from None
    if not isinstance(meta, dict):
        raise CheckpointError(
            f"{path}: not a lowmemopt state file (its metadata is a {type(meta).__name__}, not an object)"
        )
    if meta.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path}: not a lowmemopt state file (format {meta.get('format')!r})")
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READABLE_FILE_VERSIONS:
        raise CheckpointError(
            f"{path}: unknown state file format_version {version!r}; this lowmemopt reads format_version "
            f"{', '.join(map(str, READABLE_FILE_VERSIONS))}"
            + (" (the file is newer: upgrade lowmemopt)" if isinstance(version, int) and version > FILE_VERSION else "")
        )
    if meta_crc is None and version >= 3:
        raise CheckpointError(
            f"{path}: the metadata has no CRC-32 (format_version {version} files have one): the file is corrupt"
        )
    try:
        if not isinstance(meta["optimizer"], str) or not isinstance(meta.get("algorithm", ""), str):
            raise TypeError(f"optimizer {meta['optimizer']!r}, algorithm {meta.get('algorithm')!r}")
        if meta["keys"] not in ("names", "positions"):
            raise ValueError(f"keys {meta['keys']!r}")
        expected = {}
        for name, entry in meta["params"].items():
            _ = [int(d) for d in entry["shape"]], entry["group"]
            step = entry["step"]
            if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
                raise ValueError(f"parameter '{name}': step {step!r} (the step count must be a non-negative integer)")
            for slot, info in entry["slots"].items():
                fmt = FORMATS[info["format"]]
                numel = torch.Size(info["shape"]).numel()
                if fmt is Q8:
                    bs = info["block_size"]
                    if not isinstance(bs, int) or bs < 1 or info["map"] not in MAP_NAMES:
                        raise ValueError(f"slot '{slot}': block_size {bs!r}, map {info['map']!r}")
                    expected[f"{name}/{slot}.codes"] = ("U8", [numel])
                    expected[f"{name}/{slot}.absmax"] = ("F32", [num_blocks(numel, bs)])
                elif fmt is Q4:
                    bs = info["block_size"]
                    if not isinstance(bs, int) or bs < 2 or bs % 2 or info["map"] not in q4.MAPS:
                        raise ValueError(f"slot '{slot}': block_size {bs!r}, map {info['map']!r}")
                    expected[f"{name}/{slot}.nibbles"] = ("U8", [q4.packed_len(numel)])
                    expected[f"{name}/{slot}.absmax"] = ("F32", [num_blocks(numel, bs)])
                else:
                    expected[f"{name}/{slot}"] = (DTYPES[fmt], list(info["shape"]))
            for key, value in entry.get("projector", {}).items():
                if isinstance(value, list):  # a basis: fp32, or codes (uint8) and their fp32 scales
                    dtype = "U8" if key.endswith((".codes", ".nibbles")) else "F32"
                    expected[f"{name}/{key}"] = (dtype, [int(d) for d in value])
                elif isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"projector entry {key!r}: {value!r}")
            for key, value in entry.get("bf16_update", {}).items():  # a seed; a Kahan buffer (the param's dtype)
                if isinstance(value, list):
                    kahan_dtype = "F16" if entry.get("dtype") == "float16" else "BF16"
                    expected[f"{name}/{key}"] = (kahan_dtype, [int(d) for d in value])
                elif isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"bf16_update entry {key!r}: {value!r}")
        for key, (dtype, shape) in meta.get("extra", {}).get("tensors", {}).items():  # (file_extra's)
            expected[key] = (dtype, [int(d) for d in shape])
        groups = meta["param_groups"]
        for group in groups:
            for n in group["params"]:
                if n not in meta["params"]:
                    raise KeyError(n)
        crc = {k: int(v) for k, v in meta["crc32"].items()}
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: corrupt metadata ({type(e).__name__}: {e})") from None
    keys = set(f.keys())
    if keys != set(expected) or set(crc) != keys:
        missing, extra = sorted(set(expected) - keys), sorted(keys - set(expected))
        raise CheckpointError(f"{path}: corrupt state file: tensors missing {missing[:5]}, not described {extra[:5]}")
    for key, (dtype, shape) in expected.items():
        got_dtype, got_shape = f.dtype_shape(key)
        if got_dtype != dtype or list(got_shape) != shape:
            param, _, skey = key.rpartition("/")
            raise CheckpointError(
                f"{path}: parameter '{param}': tensor '{skey}' is {got_dtype} {got_shape} in the file, "
                f"the metadata needs {dtype} {shape}" + (" (block-size mismatch)" if skey.endswith(".absmax") else "")
            )
    return meta


def from_json(value: Any, current: Any) -> Any:
    if isinstance(current, torch.Tensor) and isinstance(value, (int, float)):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(value, list) and isinstance(current, tuple):
        return tuple(value)
    return value


def restorable(key: str, value: Any) -> bool:
    return key != "params" and key not in KEPT_ON_LOAD and not (isinstance(value, dict) and "__repr__" in value)


class LoadPlan(NamedTuple):
    name: str
    param: torch.Tensor
    entry: dict[str, Any]
    group: dict[str, Any]  # the effective group (hyper-parameters as they will be after the load)
    slots: dict[str, Slot]


def algorithm_name(cls: type) -> str:
    """The lowmemopt class whose algorithm ``cls`` runs (itself, or the class an alias derives from)."""
    return next((c.__name__ for c in cls.__mro__ if c.__module__.startswith("lowmemopt.optim.")), cls.__name__)


def check_same_optimizer(
    optimizer: LowMemOptimizer, meta: dict[str, Any], path: str, from_optimizer: str | None
) -> bool:
    """Raise unless the file is ``optimizer``'s algorithm's (or ``from_optimizer``'s)."""
    saved = meta.get("algorithm")
    if saved is None:  # files before format 3 name the class only
        cls = getattr(aliases, meta["optimizer"], None) or getattr(optim, meta["optimizer"], None)
        saved = algorithm_name(cls) if isinstance(cls, type) else meta["optimizer"]
    ours = algorithm_name(type(optimizer))
    if saved == ours and from_optimizer in (None, meta["optimizer"], saved):
        return True
    expected = type(optimizer).__name__ if from_optimizer is None else from_optimizer
    if from_optimizer is None or from_optimizer not in (meta["optimizer"], saved):
        raise CheckpointError(
            f"{path}: holds {meta['optimizer']!r} state, not {expected!r}; a state file loads into the optimizer that "
            f"saved it (or an alias of it). To load the slots of {meta['optimizer']!r} state into this "
            f"{type(optimizer).__name__} deliberately, pass from_optimizer={meta['optimizer']!r} (its "
            "hyper-parameters are then not taken)"
        )
    return False


def plan_load(optimizer, meta, model, path, restore=True):
    names = param_names(optimizer, model)
    saved = meta["params"]
    current = {n for n, _, _ in names}
    missing = [n for n, _, _ in names if n not in saved]
    unexpected = [n for n in saved if n not in current]
    groups = meta["param_groups"]
    same_layout = (
        restore
        and len(groups) == len(optimizer.param_groups)
        and all(set(sg["params"]) == {n for n, gi, _ in names if gi == g} for g, sg in enumerate(groups))
    )
    effective = []
    for g, group in enumerate(optimizer.param_groups):
        eff = dict(group)
        if same_layout:
            eff.update({k: from_json(v, group.get(k)) for k, v in groups[g].items() if restorable(k, v)})
            check_loaded_group(optimizer._check_group, eff, f"{path}: param group {g}'s saved hyper-parameters")
        effective.append(eff)
    plans, mismatched = [], {}
    for name, g, p in names:
        if name not in saved:
            continue
        entry, group = saved[name], effective[g]
        problem = _check_entry(optimizer, entry, group, p)
        if problem:
            mismatched[name] = problem
        else:
            slots = optimizer._state_slots(group, p) if entry["step"] is not None else {}
            plans.append(LoadPlan(name, p, entry, group, slots))
    return plans, LoadReport(missing, unexpected, mismatched, [], same_layout)


def _check_entry(optimizer, entry, group, p) -> str | None:
    """Why this saved param's state cannot load into ``p`` (None: it can)."""
    layout = shard_layout(p)
    if entry.get("layout") != layout:
        saved = entry.get("layout")
        return (
            f"sharded differently: shard {_describe_layout(saved)} in the file, {_describe_layout(layout)} here (a "
            "per-rank file loads only at the same sharding; to reshard use torch.distributed.checkpoint)"
        )
    local = local_tensor(p)
    if tuple(entry["shape"]) != tuple(local.shape):
        return f"shape {tuple(entry['shape'])} in the file, {tuple(local.shape)} in the optimizer"
    if entry["step"] is None:
        return None
    problem = projector_problem(entry.get("projector", {}), group, p.shape)
    if problem:
        return problem
    slots = optimizer._state_slots(group, p)
    if set(entry["slots"]) != set(slots):
        return f"state slots {sorted(entry['slots'])} in the file, {type(optimizer).__name__} needs {sorted(slots)}"
    for name, slot in slots.items():
        info = entry["slots"][name]
        shape = slot_shape(slot, local.shape)
        if tuple(info["shape"]) != tuple(shape):
            return f"slot '{name}' has shape {tuple(info['shape'])} in the file, expected {tuple(shape)}"
        src = FORMATS[info["format"]]
        if src is Q8 and info["map"] not in (map_for(slot.signed), legacy_map_for(slot.signed)):
            return f"slot '{name}' uses the {info['map']} map in the file, expected {map_for(slot.signed)}"
        if src is Q4 and info["map"] != q4.map4_for(slot.signed):
            return f"slot '{name}' uses the {info['map']} map in the file, expected {q4.map4_for(slot.signed)}"
        dst = target_format(group, slot, format_numel(slot, p.numel()), p.dtype)
        remap = remaps(src, info["map"] if src is Q8 else None, slot)
        if src is dst and src in QUANTIZED and info["block_size"] != group["block_size"] and not remap:
            return (
                f"block-size mismatch: slot '{name}' is {src.bits}-bit at block_size {info['block_size']} in the "
                f"file, the optimizer uses block_size {group['block_size']}"
            )
    return None


def _describe_layout(layout: dict[str, Any] | None) -> str:
    if layout is None:
        return "none (a whole, unsharded tensor)"
    return (
        f"{layout['local_shape']} at offset {layout['offset']} of {layout['global_shape']} "
        f"({', '.join(layout['placements'])} on a mesh of shape {layout['mesh']})"
    )


def describe_problems(path, report, meta, model) -> str:
    lines = [f"{path}: cannot load the optimizer state (strict=True; the optimizer is unchanged):"]

    def some(names):
        return ", ".join(repr(n) for n in names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")

    if report.missing:
        lines.append(f"  missing from the file: {some(report.missing)}")
    if report.unexpected:
        lines.append(f"  in the file but not in the optimizer: {some(report.unexpected)}")
    for name, why in list(report.mismatched.items())[:8]:
        lines.append(f"  '{name}': {why}")
    if report.missing and report.unexpected:
        if meta.get("keys") == "names" and model is None:
            lines.append("  (the file is keyed by parameter names: pass model=)")
        elif meta.get("keys") == "positions" and model is not None:
            lines.append("  (the file is keyed by positions: it was saved without a model; pass model=None)")
    lines.append("  load_state(..., strict=False) loads what matches and reports the rest")
    return "\n".join(lines)
