"""Saving: the optimizer's state, in its stored formats, to one safetensors file (:func:`save_state`)."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch

from .. import paging, rounding
from ..distributed.sharding import local_tensor, shard_layout
from ..optimizer import LowMemOptimizer
from ..projection.projector import projector_problem, split_projector_state
from ..quant.convert import CheckpointError, check_source, check_step, slot_shape, state_map, storage_dtype
from ..quant.formats import QUANTIZED, format_of
from ..version import __version__
from .layout import (
    FILE_FORMAT,
    FILE_VERSION,
    META_CRC_KEY,
    META_KEY,
    atomic_save_file,
    crc32,
    param_names,
    sharded_path,
)
from .validation import algorithm_name, check_optimizer


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return {"__repr__": repr(value)}  # recorded for inspection, never restored


def save_state(optimizer: LowMemOptimizer, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
    """Write ``optimizer``'s state, in its stored formats, to one safetensors file at ``path``, atomically (on any
    failure the previous file is untouched).

    Args:
        model: key tensors by ``model.named_parameters()`` names (the file then survives a change of parameter order
            and group layout); else ``<group>/<index>``.

    Sharded (DTensor) parameters: each rank writes its own file, ``<stem>.rank<r>-of-<W><suffix>``
    (docs/distributed.md#lowmemoptsave_state-one-file-per-rank).
    """

    check_optimizer(optimizer)
    paging.settle(optimizer)  # paged state: every write-back has reached its home
    path, sharding = sharded_path(optimizer, path)
    names = param_names(optimizer, model)
    tensors: dict[str, torch.Tensor] = {}
    params = {name: _save_entry(optimizer, name, g, p, tensors) for name, g, p in names}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: _to_json(v) for k, v in group.items() if k != "params"}
        hyper["params"] = [n for n, gi, _ in names if gi == g]
        groups.append(hyper)
    extra = getattr(optimizer, "file_extra", None)  # what an optimizer keeps beside its params' state
    extra_meta = None
    if extra is not None:
        info, extra_tensors = extra()
        extra_meta = dict(info=info, tensors={})
        for key, t in extra_tensors.items():
            tensors[key] = t.detach().float().cpu().contiguous()
            extra_meta["tensors"][key] = ["F32", list(t.shape)]
    meta = {
        "format": FILE_FORMAT,
        "format_version": FILE_VERSION,
        "lowmemopt_version": __version__,
        "optimizer": type(optimizer).__name__,
        "algorithm": algorithm_name(type(optimizer)),
        "keys": "names" if model is not None else "positions",
        "param_groups": groups,
        "params": params,
        "crc32": {key: crc32(t) for key, t in tensors.items()},
    }
    if sharding is not None:
        meta["sharding"] = sharding
    if extra_meta is not None:
        meta["extra"] = extra_meta
    raw = json.dumps(meta)
    atomic_save_file(tensors, os.fspath(path), {META_KEY: raw, META_CRC_KEY: str(zlib.crc32(raw.encode()))})
    paging.drop_pages(optimizer)  # state files were read whole: hand their pages back


def _save_entry(optimizer: LowMemOptimizer, name: str, g: int, p: torch.Tensor, tensors: dict) -> dict[str, Any]:
    """The metadata entry of one param; adds its state tensors (on the CPU) to ``tensors``."""
    group = optimizer.param_groups[g]
    local = local_tensor(p)  # a DTensor's state is its local shard's
    entry: dict[str, Any] = {"group": g, "shape": list(local.shape), "dtype": str(p.dtype).replace("torch.", "")}
    layout = shard_layout(p)
    if layout is not None:
        entry["layout"] = layout
    entry.update(step=None, slots={})
    state = optimizer.state.get(p) or {}
    if not state:
        return entry
    where = f"cannot save '{name}'"
    slots = optimizer._state_slots(group, p)
    projector, _ = split_projector_state(state)
    problem = projector_problem(projector, group, p.shape)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    used = {"step"} | set(projector)
    rounding_state, _ = rounding.split_state(state)  # bf16_update: ints in the metadata, the Kahan buffer as a tensor
    if rounding_state:
        used |= set(rounding_state)
        entry["bf16_update"] = {
            k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in rounding_state.items()
        }
        for key, t in rounding_state.items():
            if isinstance(t, torch.Tensor):
                tensors[f"{name}/{key}"] = t.detach().cpu().contiguous()
    if projector:  # GaLore: bases as tensors (fp32, or 8 / 4-bit codes and scales), the ints in the metadata
        entry["projector"] = {k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in projector.items()}
        for key, t in projector.items():
            if isinstance(t, torch.Tensor):
                t = t.detach()
                tensors[f"{name}/{key}"] = (t.float() if t.is_floating_point() else t).cpu().contiguous()
    for slot_name, slot in slots.items():
        if not any(k in state for k in (slot_name, slot_name + ".codes", slot_name + ".nibbles")):
            raise CheckpointError(f"{where}: its state has no slot '{slot_name}'")
        fmt = format_of(state, slot_name)
        shape = slot_shape(slot, local.shape)
        stored = {k: state[k] for k in fmt.keys(slot_name)}
        for key, t in stored.items():
            if t.dtype != storage_dtype(fmt, key):
                raise CheckpointError(f"{where}: state '{key}' is {t.dtype}, not a lowmemopt storage format")
        check_source(fmt, group["block_size"], stored, slot_name, shape, where, local.shape, "its state")
        info: dict[str, Any] = {"format": fmt.name, "shape": list(shape)}
        if fmt in QUANTIZED:
            info.update(block_size=group["block_size"], map=state_map(fmt, slot))
        entry["slots"][slot_name] = info
        for key, t in stored.items():
            tensors[f"{name}/{key}"] = t.detach().cpu().contiguous()
        used.update(stored)
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{where}: state {extra} is not in the optimizer's slots {list(slots)}")
    entry["step"] = check_step(state["step"], where)
    return entry
