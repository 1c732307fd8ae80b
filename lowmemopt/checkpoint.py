"""Checkpoints: optimizer state in one safetensors file, validated on load and converted between state formats.

    lowmemopt.save_state(opt, "opt.safetensors", model=model)       # keys: parameter names (positions without a model)
    report = lowmemopt.load_state(opt, "opt.safetensors", model=model)

The file holds every state tensor under ``<param>/<state key>`` (``lm_head.weight/exp_avg.codes``) and a JSON header
under the safetensors metadata key ``lowmemopt`` (format version, param groups' hyper-parameters, each param's shape,
step and per-slot format, and a CRC-32 of every tensor). No pickle is involved anywhere. See ``docs/state_format.md``.

Saving is atomic: the file is written next to its destination, fsynced, then renamed over it, so an interrupted save
leaves the previous checkpoint intact. Loading validates the whole file and plans every parameter before it changes
anything; the new state is built aside (the file memory-mapped and streamed in chunks, checksummed as it is read) and
swapped in at the end, so a bad file raises :class:`CheckpointError` and leaves the optimizer exactly as it was.

Conversion: each slot is loaded into the format the loading optimizer's param group asks for (``state_bits``,
``min_quant_numel``, ``block_size``), decoding and re-encoding with :mod:`lowmemopt.quant.formats`: fp32 / bf16 / q8 /
q4 in any direction. One exception: q8 (q4) state is never re-quantized to q8 (q4) at a different block size (that would
add a second rounding to state that is otherwise exact); it is a mismatch. :func:`convert_param_state` does the same for in-memory state dicts
(lowmemopt, ``torch.optim``, bitsandbytes layouts); ``LowMemOptimizer.load_state_dict`` uses it.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import secrets
import stat
import sys
import zlib
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from . import paging, rounding
from .distributed.files import process_rank, rank_path
from .distributed.sharding import is_dtensor, local_tensor, shard_layout
from .optimizer import STORAGE_DEFAULTS, LowMemOptimizer
from .quant.formats import Slot
from .version import __version__
from .projection.projector import projector_problem, split_projector_state
from .quant.blockwise import num_blocks
from .quant import q4
from .quant.formats import (BF16, FORMATS, FP32, Q4, Q8, QUANTIZED, StateFormat, choose_format, format_of,
                            legacy_map_for, map_for)
from .quant.maps import MAP_NAMES, code_book

__all__ = [
    "CheckpointError",
    "LoadReport",
    "FILE_FORMAT",
    "FILE_VERSION",
    "save_state",
    "load_state",
    "read_metadata",
    "convert_param_state",
]

FILE_FORMAT = "lowmemopt.optimizer_state"
#: 2: 8-bit slots in the pow2 maps; 1: in bitsandbytes' dynamic maps (still read, re-encoded on load). Each slot's
#: metadata names its map either way.
FILE_VERSION = 2
READABLE_FILE_VERSIONS = (1, 2)
META_KEY = "lowmemopt"
CHUNK_NUMEL = 1 << 16  # elements per conversion chunk (rounded to the block sizes): bounds the temporaries
_DTYPES = {FP32: "F32", BF16: "BF16"}  # safetensors dtype names of the dense formats
_BNB_QUANT_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.45 nests its 8-bit tensors under this key
_BNB_SCRATCH = {"unorm_vec", "gnorm_vec"}  # bitsandbytes per-step buffers, recomputed every step


class CheckpointError(ValueError):
    """A state file or state dict that cannot be loaded as asked. The optimizer was not changed."""


class LoadReport(NamedTuple):
    """What :func:`load_state` did. With ``strict=True`` the first three are always empty (it raises instead)."""

    missing: list[str]  # the optimizer's params absent from the file: their state was left as it was
    unexpected: list[str]  # params in the file that the optimizer does not have
    mismatched: dict[str, str]  # param -> why its state was not loaded (shape, slots, block size)
    converted: list[str]  # "param/slot: fp32 -> q8" for each slot stored in another format than the optimizer's
    hyperparameters_restored: bool  # groups' hyper-parameters taken from the file (only when the group layout matches)


# ---------------------------------------------------------------------------------------------------------------------
# slot conversion (shared by load_state and load_state_dict)

Reader = Callable[[str, int, int], torch.Tensor]  # (state key, a, b) -> flat elements [a, b) of that stored tensor


def _reformat(
    read: Reader,
    out: dict[str, torch.Tensor],
    slot: str,
    shape: torch.Size,
    signed: bool,
    src: StateFormat,
    src_bs: int,
    dst: StateFormat,
    dst_bs: int,
    device: torch.device,
    verbatim: bool,
    src_map: str | None = None,
) -> None:
    """Write slot ``slot``, stored as ``src`` (read through ``read``; 8- or 4-bit codes in map ``src_map``, default the
    state map), into ``out``'s tensors for it, already made by ``dst.init``; streamed in block-aligned chunks so no full-size
    fp32 copy is made. ``verbatim``: same format, dtype, block size and map, copy the bytes."""
    n = shape.numel()
    align = max(src_bs, dst_bs)
    step = max(align, CHUNK_NUMEL // align * align)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        if verbatim:
            for key, (a, b) in dst.key_ranges(slot, lo, hi, dst_bs).items():
                out[key].view(-1)[a:b].copy_(read(key, a, b))
        else:
            chunk = {key: read(key, a, b).to(device) for key, (a, b) in src.key_ranges(slot, lo, hi, src_bs).items()}
            value = src.decode(chunk, slot, 0, hi - lo, signed, src_bs, qmap=src_map)
            dst.encode(out, slot, lo, hi, value.contiguous(), signed, dst_bs)


def _remaps(src: StateFormat, src_map: str | None, slot: Slot) -> bool:
    """8-bit state in a map other than the state map (bitsandbytes' dynamic maps, as in bitsandbytes state and
    lowmemopt format 1): it is decoded in its map and encoded into the state map, never copied as it is."""
    return src is Q8 and src_map != map_for(slot.signed)


def _state_map(fmt: StateFormat, slot: Slot) -> str | None:
    """The map a slot of format ``fmt`` is stored in (None: not quantized)."""
    return map_for(slot.signed) if fmt is Q8 else q4.map4_for(slot.signed) if fmt is Q4 else None


def _target_format(group: dict[str, Any], slot: Slot, numel: int) -> StateFormat:
    return choose_format(group["state_bits"], numel, group["min_quant_numel"], slot.quantize)


def _format_numel(slot: Slot, param: torch.Tensor) -> int:
    """The size that picks a slot's format: the whole parameter's (a DTensor's too) for slots shaped like it, as
    :meth:`LowMemOptimizer._init_state` does, so that a shard's format does not depend on the world size."""
    return param.numel() if slot.shape is None else torch.Size(slot.shape).numel()


def _slot_shape(slot: Slot, param: torch.Tensor) -> torch.Size:
    """The stored shape of a slot of ``param`` (a DTensor's: its local shard's)."""
    return local_tensor(param).shape if slot.shape is None else torch.Size(slot.shape)


def _dense_format(t: torch.Tensor) -> StateFormat:
    return BF16 if t.dtype == torch.bfloat16 else FP32  # other floats (torch.optim, fp16 params) decode as fp32


def convert_param_state(
    optimizer: LowMemOptimizer,
    param: torch.Tensor,
    state: dict[str, Any],
    saved_group: dict[str, Any],
    group: dict[str, Any],
    where: str,
    legacy_maps: bool = False,
) -> dict[str, Any]:
    """One parameter's state from a state dict, in the formats ``group`` asks for.

    ``state`` may be lowmemopt state in any format (q8 needs ``saved_group["block_size"]``), ``torch.optim`` state
    (``exp_avg``, tensor ``step``, any float dtype) or bitsandbytes state (``state1``/``state2`` + ``absmax``/``qmap``,
    nested or not), whose N-th state is the optimizer's N-th slot (AdamW: ``exp_avg``, ``exp_avg_sq``). Slots already in
    the target format are returned as they are (no copy); others are decoded and re-encoded. 8-bit state in
    bitsandbytes' dynamic maps (bitsandbytes state, and lowmemopt state with ``legacy_maps``: ``lowmemopt_format`` 1) is
    re-encoded into the state maps (one rounding to the nearest code of the new map). Raises CheckpointError
    naming ``where`` and the problem. A GaLore projector (``galore.*``: fp32 bases and ints) is checked against the
    group and kept as it is."""
    state = {k: v for k, v in state.items() if v is not None}  # torch.optim may store None buffers
    if not state:
        return {}
    projector, state = split_projector_state(state)
    problem = projector_problem(projector, group, param.shape)
    if problem:
        raise CheckpointError(f"{where}: {problem}")
    rounding_state, state = rounding.split_state(state)  # bf16_update: a seed, a Kahan buffer; kept as they are
    slots = optimizer._state_slots(group, param)
    if "state1" in state or _BNB_QUANT_KEY in state:
        sources = _bnb_sources(state, slots, where)
    else:
        sources = _lowmemopt_sources(state, slots, saved_group, where, legacy_maps)
    if "step" not in state:
        raise CheckpointError(f"{where}: the state has slots {sorted(sources)} but no 'step' count")
    step = state["step"]
    out: dict[str, Any] = {"step": int(step.item() if isinstance(step, torch.Tensor) else step)}
    out.update({k: v.float() if isinstance(v, torch.Tensor) else v for k, v in projector.items()})  # fp32: no copy
    out.update(rounding_state)
    dst_bs = group["block_size"]
    for name, slot in slots.items():
        src, src_bs, tensors, src_map = sources[name]
        shape = _slot_shape(slot, param)
        numel = shape.numel()
        _check_source(src, src_bs, tensors, name, shape, where, local_tensor(param).shape)
        dst = _target_format(group, slot, _format_numel(slot, param))
        remap = _remaps(src, src_map, slot)
        if src is dst and src in QUANTIZED and src_bs != dst_bs and not remap:
            raise CheckpointError(
                f"{where}: '{name}' is {src.bits}-bit at block_size {src_bs} but the optimizer uses block_size {dst_bs} "
                "(re-quantizing would add error); construct the optimizer with the saved block_size"
            )
        if src is dst and not remap and all(t.dtype == _storage_dtype(dst, k) for k, t in tensors.items()):
            for key, t in tensors.items():  # already in place: keep the very tensors (views for bitsandbytes codes)
                out[key] = t.reshape(shape) if dst not in QUANTIZED else t.reshape(-1)
            continue
        flat = {k: t.reshape(-1) for k, t in tensors.items()}
        read = lambda key, a, b, flat=flat: flat[key][a:b]  # noqa: E731
        device = next(iter(tensors.values())).device
        dst.init(out, name, shape, device, dst_bs)
        _reformat(read, out, name, shape, slot.signed, src, src_bs, dst, dst_bs, device, verbatim=False,
                  src_map=src_map)
    return out


def _storage_dtype(fmt: StateFormat, key: str) -> torch.dtype:
    if fmt in QUANTIZED:
        return torch.uint8 if key.endswith((".codes", ".nibbles")) else torch.float32
    return torch.bfloat16 if fmt is BF16 else torch.float32


def _check_source(src: StateFormat, bs: int, tensors: dict[str, torch.Tensor], name: str, shape: torch.Size,
                  where: str, param_shape: torch.Size | None = None, source: str = "the state dict"):
    """Raise CheckpointError unless ``tensors`` (from ``source``) hold slot ``name`` of ``shape`` in format ``src``; a
    size mismatch names the shapes: the parameter's (``param_shape``, where the slot's differs: GaLore) and the
    slot's."""
    numel = shape.numel()
    param_shape = shape if param_shape is None else param_shape
    ours = f"the optimizer's parameter has shape {tuple(param_shape)}"
    if tuple(param_shape) != tuple(shape):
        ours += f" and its '{name}' {tuple(shape)}"
    hint = "; is it the state of another model, or of the parameters in another order?"
    if src is Q8 or src is Q4:
        key, stored, unit, kind = ((".codes", numel, "elements", "8-bit codes") if src is Q8 else
                                   (".nibbles", q4.packed_len(numel), "bytes", "4-bit codes, two per byte"))
        codes, absmax = tensors[name + key], tensors[name + ".absmax"]
        if codes.dtype != torch.uint8:
            raise CheckpointError(f"{where}: '{name}{key}' is {codes.dtype} in {source}, expected uint8 {kind}")
        if codes.numel() != stored:
            raise CheckpointError(
                f"{where}: '{name}' has {codes.numel():,} {unit} in {source} ({kind}, stored flat); {ours} "
                f"({numel:,} elements{'' if src is Q8 else f', {stored:,} bytes'}){hint}"
            )
        if absmax.numel() != num_blocks(numel, bs):
            raise CheckpointError(
                f"{where}: '{name}.absmax' has {absmax.numel()} blocks; {numel} elements at block_size {bs} need "
                f"{num_blocks(numel, bs)} (block-size mismatch)"
            )
        return
    t = tensors[name]
    if not t.is_floating_point():
        raise CheckpointError(f"{where}: '{name}' is {t.dtype} in {source}, expected floating-point state")
    if t.numel() != numel:
        raise CheckpointError(f"{where}: '{name}' has shape {tuple(t.shape)} in {source}; {ours}{hint}")


def _lowmemopt_sources(state, slots, saved_group, where, legacy_maps=False):
    """slot -> (format, block size, tensors, 8-bit map or None)"""
    sources, used = {}, {"step"}
    for name, slot in slots.items():
        if name + ".codes" in state:
            keys = Q8.keys(name)
            if keys[1] not in state:
                raise CheckpointError(f"{where}: '{keys[0]}' without '{keys[1]}'")
            bs = saved_group.get("block_size")
            if not isinstance(bs, int):
                raise CheckpointError(f"{where}: 8-bit state '{name}' but the saved param group has no block_size")
            qmap = legacy_map_for(slot.signed) if legacy_maps else map_for(slot.signed)
            sources[name] = (Q8, bs, {k: state[k] for k in keys}, qmap)
        elif name + ".nibbles" in state:
            keys = Q4.keys(name)
            if keys[1] not in state:
                raise CheckpointError(f"{where}: '{keys[0]}' without '{keys[1]}'")
            bs = saved_group.get("block_size")
            if not isinstance(bs, int) or bs < 2 or bs % 2:
                raise CheckpointError(f"{where}: 4-bit state '{name}' but the saved param group has no even block_size")
            sources[name] = (Q4, bs, {k: state[k] for k in keys}, q4.map4_for(slot.signed))
        elif name in state:
            keys = (name,)
            sources[name] = (_dense_format(state[name]), 1, {name: state[name]}, None)
        else:
            raise CheckpointError(f"{where}: the state has no slot '{name}' (has {sorted(state)})")
        used.update(keys)
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{where}: unexpected state {extra}; the optimizer's slots are {sorted(slots)}")
    return sources


def _bnb_sources(state, slots, where):
    state = dict(state)
    state.update(state.pop(_BNB_QUANT_KEY, {}))
    for key in ("max1", "max2", "new_max1", "new_max2"):
        if key in state:
            raise CheckpointError(f"{where}: bitsandbytes non-blockwise 8-bit state ('{key}') is not supported")
    n_states = sum(1 for i in (1, 2, 3) if f"state{i}" in state)
    if n_states != len(slots):
        raise CheckpointError(
            f"{where}: bitsandbytes state has {n_states} state tensor(s), the optimizer has {len(slots)} slot(s) "
            f"{list(slots)}"
        )
    sources, used = {}, {"step"} | _BNB_SCRATCH
    for i, (name, slot) in enumerate(slots.items(), start=1):
        t = state[f"state{i}"]
        used.add(f"state{i}")
        if t.dtype != torch.uint8:
            sources[name] = (_dense_format(t), 1, {name: t}, None)
            continue
        used.update((f"qmap{i}", f"absmax{i}"))
        if f"absmax{i}" not in state or f"qmap{i}" not in state:
            raise CheckpointError(f"{where}: bitsandbytes 8-bit 'state{i}' without 'absmax{i}' / 'qmap{i}'")
        bnb_map = legacy_map_for(slot.signed)
        if not torch.equal(state[f"qmap{i}"].detach().float().cpu().reshape(-1), code_book(bnb_map)):
            raise CheckpointError(
                f"{where}: bitsandbytes 'qmap{i}' is not bitsandbytes' {bnb_map} map, which lowmemopt reads for "
                f"'{name}'"
            )
        tensors = {name + ".codes": t.reshape(-1), name + ".absmax": state[f"absmax{i}"]}
        sources[name] = (Q8, 256, tensors, bnb_map)  # bitsandbytes: blocks of 256
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{where}: unexpected bitsandbytes state {extra}")
    return sources


# ---------------------------------------------------------------------------------------------------------------------
# names and hyper-parameters


def _param_names(optimizer: LowMemOptimizer, model: torch.nn.Module | None) -> list[tuple[str, int, torch.Tensor]]:
    """(name, group index, param) for every param of the optimizer, in group order."""
    names = {}
    if model is not None:
        names = {id(p): n for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if model is None:
                out.append((f"{g}/{i}", g, p))
            elif id(p) in names:
                out.append((names[id(p)], g, p))
            else:
                raise CheckpointError(
                    f"parameter {i} of param group {g} (shape {tuple(p.shape)}) is not in model.named_parameters()"
                )
    return out


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_to_json(v) for v in value]
    return {"__repr__": repr(value)}  # recorded for inspection, never restored


def _from_json(value: Any, current: Any) -> Any:
    if isinstance(current, torch.Tensor) and isinstance(value, (int, float)):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    if isinstance(value, list) and isinstance(current, tuple):
        return tuple(value)
    return value


def _restorable(key: str, value: Any) -> bool:
    return key != "params" and key not in STORAGE_DEFAULTS and not (isinstance(value, dict) and "__repr__" in value)


# ---------------------------------------------------------------------------------------------------------------------
# saving


def save_state(optimizer: LowMemOptimizer, path: str | os.PathLike, model: torch.nn.Module | None = None) -> None:
    """Write ``optimizer``'s state to one safetensors file at ``path``, atomically.

    Tensors are keyed ``<param>/<state key>``, where ``<param>`` is the name in ``model.named_parameters()`` when a
    model is given (the file then survives changes of parameter order and param-group layout), else ``<group>/<index>``.
    State stays in its stored format (8-bit state is written 8-bit); the metadata records formats, shapes, steps,
    hyper-parameters and checksums. On any failure the previous file at ``path`` is left untouched.

    Sharded (DTensor) parameters: every rank writes its own shards' state to its own file,
    ``<path stem>.rank<r>-of-<W><suffix>`` (:func:`lowmemopt.distributed.rank_path`), recording where each shard
    sits; :func:`load_state` reads it back at the same sharding only (``docs/distributed.md``)."""

    _check_optimizer(optimizer)
    paging.settle(optimizer)  # paged state: every write-back has reached its home
    path, sharding = _sharded_path(optimizer, path)
    names = _param_names(optimizer, model)
    tensors: dict[str, torch.Tensor] = {}
    params = {name: _save_entry(optimizer, name, g, p, tensors) for name, g, p in names}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: _to_json(v) for k, v in group.items() if k != "params"}
        hyper["params"] = [n for n, gi, _ in names if gi == g]
        groups.append(hyper)
    meta = {
        "format": FILE_FORMAT,
        "format_version": FILE_VERSION,
        "lowmemopt_version": __version__,
        "optimizer": type(optimizer).__name__,
        "keys": "names" if model is not None else "positions",
        "param_groups": groups,
        "params": params,
        "crc32": {key: _crc32(t) for key, t in tensors.items()},
    }
    if sharding is not None:
        meta["sharding"] = sharding
    _atomic_save_file(tensors, os.fspath(path), {META_KEY: json.dumps(meta)})
    paging.drop_pages(optimizer)  # state files were read whole: hand their pages back


def _sharded_path(optimizer: LowMemOptimizer, path: str | os.PathLike) -> tuple[str, dict[str, int] | None]:
    """This rank's file for an optimizer with DTensor parameters (and its ``sharding`` record), else ``path``."""
    if not any(is_dtensor(p) for group in optimizer.param_groups for p in group["params"]):
        return os.fspath(path), None
    rank, world = process_rank()
    return rank_path(path, rank, world), {"rank": rank, "world_size": world}


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
        entry["bf16_update"] = {k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in rounding_state.items()}
        for key, t in rounding_state.items():
            if isinstance(t, torch.Tensor):
                tensors[f"{name}/{key}"] = t.detach().cpu().contiguous()
    if projector:  # GaLore: fp32 bases as tensors, the ints in the metadata
        entry["projector"] = {k: (list(v.shape) if isinstance(v, torch.Tensor) else v) for k, v in projector.items()}
        for key, t in projector.items():
            if isinstance(t, torch.Tensor):
                tensors[f"{name}/{key}"] = t.detach().float().cpu().contiguous()
    for slot_name, slot in slots.items():
        if not any(k in state for k in (slot_name, slot_name + ".codes", slot_name + ".nibbles")):
            raise CheckpointError(f"{where}: its state has no slot '{slot_name}'")
        fmt = format_of(state, slot_name)
        shape = _slot_shape(slot, p)
        stored = {k: state[k] for k in fmt.keys(slot_name)}
        for key, t in stored.items():
            if t.dtype != _storage_dtype(fmt, key):
                raise CheckpointError(f"{where}: state '{key}' is {t.dtype}, not a lowmemopt storage format")
        _check_source(fmt, group["block_size"], stored, slot_name, shape, where, local.shape, "its state")
        info: dict[str, Any] = {"format": fmt.name, "shape": list(shape)}
        if fmt in QUANTIZED:
            info.update(block_size=group["block_size"], map=_state_map(fmt, slot))
        entry["slots"][slot_name] = info
        for key, t in stored.items():
            tensors[f"{name}/{key}"] = t.detach().cpu().contiguous()
        used.update(stored)
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{where}: state {extra} is not in the optimizer's slots {list(slots)}")
    entry["step"] = int(state["step"])
    return entry


def _crc32(t: torch.Tensor, value: int = 0) -> int:
    if t.numel() == 0:
        return value
    return zlib.crc32(t.reshape(-1).view(torch.uint8).numpy(), value)


def _atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    """save_file to a temporary file beside ``path``, fsync it, rename it over ``path``, fsync the directory. The file
    gets the mode a plain ``open(path, "w")`` would give it (0o666 less the umask), as ``torch.save``'s files do."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # reserve the name; the umask applies
    try:
        mode = stat.S_IMODE(os.fstat(fd).st_mode)  # read here: the umask without os.umask's process-wide race
    finally:
        os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)  # safetensors (0.8) replaces the file with a 0o600 one of its own
        os.chmod(tmp, mode)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise
    with suppress(OSError):  # make the rename durable (not possible on every platform)
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------------------------------
# reading the header


@contextmanager
def _open(path: str) -> Iterator[Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no optimizer state file at {path!r}")
    try:
        handle = safe_open(path, framework="pt", device="cpu")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: truncated or corrupt state file ({e})") from None
    with handle as f:
        yield f


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The validated JSON header of a state file, plus ``"tensors"``: {key: (dtype, shape)} from the safetensors header.
    Reads no tensor data. Raises CheckpointError for a file that is not a readable lowmemopt state file."""
    path = os.fspath(path)
    with _open(path) as f:
        meta = _validated_meta(f, path)
        meta["tensors"] = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    return meta


def _validated_meta(f: Any, path: str) -> dict[str, Any]:
    """Parse the header and check it against the tensors in the file: every problem is a CheckpointError."""
    raw = (f.metadata() or {}).get(META_KEY)
    if raw is None:
        raise CheckpointError(f"{path}: not a lowmemopt state file (no '{META_KEY}' metadata)")
    try:
        meta = json.loads(raw)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: corrupt metadata ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FILE_FORMAT:
        raise CheckpointError(f"{path}: not a lowmemopt state file (format {meta.get('format')!r})")
    version = meta.get("format_version")
    if version not in READABLE_FILE_VERSIONS:
        raise CheckpointError(
            f"{path}: unknown state file format_version {version!r}; this lowmemopt reads format_version "
            f"{', '.join(map(str, READABLE_FILE_VERSIONS))}"
            + (" (the file is newer: upgrade lowmemopt)" if isinstance(version, int) and version > FILE_VERSION else "")
        )
    try:
        expected = {}
        for name, entry in meta["params"].items():
            _ = [int(d) for d in entry["shape"]], entry["group"]
            if entry["step"] is not None and not isinstance(entry["step"], int):
                raise TypeError(f"step {entry['step']!r}")
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
                    expected[f"{name}/{slot}"] = (_DTYPES[fmt], list(info["shape"]))
            for key, value in entry.get("projector", {}).items():
                if isinstance(value, list):
                    expected[f"{name}/{key}"] = ("F32", [int(d) for d in value])
                elif isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"projector entry {key!r}: {value!r}")
            for key, value in entry.get("bf16_update", {}).items():  # a seed; a bf16 Kahan buffer
                if isinstance(value, list):
                    expected[f"{name}/{key}"] = ("BF16", [int(d) for d in value])
                elif isinstance(value, bool) or not isinstance(value, int):
                    raise TypeError(f"bf16_update entry {key!r}: {value!r}")
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
        got = f.get_slice(key)
        if got.get_dtype() != dtype or list(got.get_shape()) != shape:
            param, _, skey = key.rpartition("/")
            raise CheckpointError(
                f"{path}: parameter '{param}': tensor '{skey}' is {got.get_dtype()} {got.get_shape()} in the file, "
                f"the metadata needs {dtype} {shape}"
                + (" (block-size mismatch)" if skey.endswith(".absmax") else "")
            )
    return meta


# ---------------------------------------------------------------------------------------------------------------------
# loading


class _Plan(NamedTuple):
    name: str
    param: torch.Tensor
    entry: dict[str, Any]
    group: dict[str, Any]  # the effective group (hyper-parameters as they will be after the load)
    slots: dict[str, Slot]


def load_state(
    optimizer: LowMemOptimizer,
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    strict: bool = True,
) -> LoadReport:
    """Load a state file written by :func:`save_state` into ``optimizer``, converting formats as needed.

    Everything is validated before the optimizer is touched; a problem raises :class:`CheckpointError` naming the
    parameter and leaves the optimizer unchanged. ``strict=True`` also raises for missing / unexpected params and
    mismatched ones (shape, slots, block size); ``strict=False`` loads what matches and reports the rest. Unreadable,
    corrupt or unknown-version files always raise. Param groups' hyper-parameters are restored from the file when the
    optimizer's group layout is the file's (same groups, same params); storage options (``state_bits``, ``block_size``,
    ...) are always the optimizer's own, and state is converted to them."""
    _check_optimizer(optimizer)
    path, sharding = _sharded_path(optimizer, path)
    if sharding is not None and not os.path.exists(path):
        raise FileNotFoundError(
            f"no per-rank optimizer state file at {path!r} for rank {sharding['rank']} of world size "
            f"{sharding['world_size']}; per-rank files load only at the world size that saved them (to change it, "
            "use torch.distributed.checkpoint: docs/distributed.md)"
        )
    with _open(path) as f:
        meta = _validated_meta(f, path)
        if meta.get("sharding", sharding) != sharding:
            raise CheckpointError(
                f"{path}: saved by rank/world size {meta.get('sharding')}, loading at {sharding} (per-rank files load "
                "only at the same sharding; to change it use torch.distributed.checkpoint: docs/distributed.md)"
            )
        plans, report = _plan(optimizer, meta, model, path)
        if strict and (report.missing or report.unexpected or report.mismatched):
            raise CheckpointError(_describe_problems(path, report, meta, model))
        release = _page_releaser(f, path)
        # allocate all the new state first, then stream the file into it: chunk temporaries then reuse one small
        # region instead of fragmenting the heap between state tensors. Paged params' state goes to new homes.
        new_states = {plan.param: _allocate(plan) for plan in plans}
        new_states.update(paging.stage(optimizer, [(plan.param, plan.group, new_states[plan.param]) for plan in plans]))
        try:
            for plan in plans:
                _read_param(f, plan, new_states[plan.param], meta["crc32"], path, release, report.converted)
                paging.drop_pages(optimizer, new_states[plan.param])
        except BaseException:
            paging.discard_staged(optimizer)
            raise
    # everything is read and checked: swap it in
    for plan in plans:
        if new_states[plan.param]:
            optimizer.state[plan.param] = new_states[plan.param]
        else:
            optimizer.state.pop(plan.param, None)
    paging.reconcile(optimizer)  # paged: adopt the new homes, free the replaced ones
    if report.hyperparameters_restored:
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                if _restorable(k, v):
                    group[k] = _from_json(v, group.get(k))
    return report


def _plan(optimizer, meta, model, path):
    names = _param_names(optimizer, model)
    saved = meta["params"]
    current = {n for n, _, _ in names}
    missing = [n for n, _, _ in names if n not in saved]
    unexpected = [n for n in saved if n not in current]
    groups = meta["param_groups"]
    same_layout = len(groups) == len(optimizer.param_groups) and all(
        set(sg["params"]) == {n for n, gi, _ in names if gi == g} for g, sg in enumerate(groups)
    )
    effective = []
    for g, group in enumerate(optimizer.param_groups):
        eff = dict(group)
        if same_layout:
            eff.update({k: _from_json(v, group.get(k)) for k, v in groups[g].items() if _restorable(k, v)})
            try:
                optimizer._check_group(eff)
            except (ValueError, TypeError) as e:
                raise CheckpointError(f"{path}: param group {g}'s saved hyper-parameters are invalid: {e}") from None
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
            plans.append(_Plan(name, p, entry, group, slots))
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
        shape = _slot_shape(slot, p)
        if tuple(info["shape"]) != tuple(shape):
            return f"slot '{name}' has shape {tuple(info['shape'])} in the file, expected {tuple(shape)}"
        src = FORMATS[info["format"]]
        if src is Q8 and info["map"] not in (map_for(slot.signed), legacy_map_for(slot.signed)):
            return f"slot '{name}' uses the {info['map']} map in the file, expected {map_for(slot.signed)}"
        if src is Q4 and info["map"] != q4.map4_for(slot.signed):
            return f"slot '{name}' uses the {info['map']} map in the file, expected {q4.map4_for(slot.signed)}"
        dst = _target_format(group, slot, _format_numel(slot, p))
        remap = _remaps(src, info["map"] if src is Q8 else None, slot)
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


def _describe_problems(path, report, meta, model) -> str:
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


def _allocate(plan: _Plan) -> dict[str, Any]:
    """The param's new state in the target formats, zero-filled (empty if the file holds no state for it). Paged
    params get meta tensors here: :func:`lowmemopt.paging.stage` then puts them in new homes."""
    if plan.entry["step"] is None:
        return {}
    state: dict[str, Any] = {"step": plan.entry["step"]}
    device = torch.device("meta") if paging.tier_of(plan.group) else plan.param.device
    for key, value in plan.entry.get("projector", {}).items():  # GaLore: ints as they are, fp32 bases to fill
        state[key] = torch.zeros(value, dtype=torch.float32, device=device) if isinstance(value, list) else value
    for key, value in plan.entry.get("bf16_update", {}).items():  # a seed; a bf16 Kahan buffer to fill
        state[key] = torch.zeros(value, dtype=torch.bfloat16, device=device) if isinstance(value, list) else value
    for name, slot in plan.slots.items():
        shape = _slot_shape(slot, plan.param)
        fmt = _target_format(plan.group, slot, _format_numel(slot, plan.param))
        fmt.init(state, name, shape, device, plan.group["block_size"])
    return state


def _read_param(f, plan: _Plan, state: dict[str, Any], crcs, path, release, converted: list[str]) -> None:
    """Fill ``state`` (from :func:`_allocate`) from the file, converting formats; checks every tensor's CRC-32."""
    entry, p, group = plan.entry, local_tensor(plan.param), plan.group
    device = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), p.device)  # paged: the home's
    for name, slot in plan.slots.items():
        info = entry["slots"][name]
        shape = _slot_shape(slot, p)
        src = FORMATS[info["format"]]
        src_bs = info.get("block_size", 1)
        dst = _target_format(group, slot, _format_numel(slot, p))
        dst_bs = group["block_size"]
        sources = {}
        for key in src.keys(name):
            fkey = f"{plan.name}/{key}"
            sources[key] = _FileTensor(f.get_tensor(fkey), fkey, crcs[fkey], path, release)
        read = lambda key, a, b, sources=sources: sources[key].read(a, b)  # noqa: E731
        src_map = info.get("map")  # 8-bit: the file's map (files before format 2 of the state: the dynamic maps)
        remap = _remaps(src, src_map, slot)
        _reformat(read, state, name, shape, slot.signed, src, src_bs, dst, dst_bs, device,
                  verbatim=src is dst and not remap, src_map=src_map)
        for source in sources.values():
            source.finish()
        if src is not dst or remap:
            where = f" ({src_map} map)" if remap else ""
            converted.append(f"{plan.name}/{name}: {src.name}{where} -> {dst.name}")
    for key, value in list(entry.get("projector", {}).items()) + list(entry.get("bf16_update", {}).items()):
        if isinstance(value, list):
            fkey = f"{plan.name}/{key}"
            source = _FileTensor(f.get_tensor(fkey), fkey, crcs[fkey], path, release)
            state[key].view(-1).copy_(source.read(0, state[key].numel()))
            source.finish()


class _FileTensor:
    """A memory-mapped tensor of the file, read front to back: checksummed as it goes, and the pages already read are
    dropped from the process (``release``) so a load never holds the file's pages and the new state at once."""

    def __init__(self, view: torch.Tensor, key: str, crc: int, path: str, release: Callable[[int, int], None]):
        self.flat, self.key, self.expected, self.path, self.release = view.reshape(-1), key, crc, path, release
        self.crc = 0
        self.pos = 0

    def read(self, a: int, b: int) -> torch.Tensor:
        assert a == self.pos, (self.key, a, self.pos)  # consumed strictly in order
        self._release_until(a)
        chunk = self.flat[a:b]
        self.crc = _crc32(chunk, self.crc)
        self.pos = b
        return chunk

    def finish(self) -> None:
        assert self.pos == self.flat.numel(), (self.key, self.pos)
        self._release_until(self.pos)
        if self.crc != self.expected:
            param, _, key = self.key.rpartition("/")
            raise CheckpointError(
                f"{self.path}: parameter '{param}': tensor '{key}' fails its CRC-32 check: the file is corrupt"
            )

    def _release_until(self, end: int) -> None:
        if end and self.flat.numel():
            self.release(self.flat.data_ptr(), self.flat.data_ptr() + end * self.flat.element_size())


def _page_releaser(f: Any, path: str) -> Callable[[int, int], None]:
    """madvise(MADV_DONTNEED) for pages of the file's private read-only mapping, Linux only (elsewhere a no-op).

    Only enabled after checking that safe_open's tensors really are views of a mapping of this file, so it can only
    ever drop clean file pages, which the kernel re-reads from the file if they are touched again."""
    if not sys.platform.startswith("linux"):
        return lambda a, b: None
    keys = [k for k in f.keys() if 0 not in f.get_slice(k).get_shape()]
    if not keys:
        return lambda a, b: None
    ptr = f.get_tensor(keys[0]).data_ptr()
    inode = os.stat(path).st_ino
    try:
        with open("/proc/self/maps") as maps:
            mapped = any(_maps_line_covers(line, ptr, inode) for line in maps)
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return lambda a, b: None
    if not mapped:
        return lambda a, b: None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, dontneed = mmap.PAGESIZE, 4  # MADV_DONTNEED

    def release(a: int, b: int) -> None:
        a, b = -(-a // page) * page, b // page * page  # whole pages inside [a, b) only
        if b > a:
            madvise(a, b - a, dontneed)

    return release


def _maps_line_covers(line: str, ptr: int, inode: int) -> bool:
    fields = line.split()
    if len(fields) < 6 or fields[4] != str(inode):
        return False
    lo, hi = (int(x, 16) for x in fields[0].split("-"))
    return lo <= ptr < hi


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, LowMemOptimizer):
        raise TypeError(
            f"expected a lowmemopt optimizer, got {type(optimizer).__name__}; to convert a torch.optim or bitsandbytes "
            "state, load its state_dict() into the lowmemopt optimizer with load_state_dict, then save_state"
        )
