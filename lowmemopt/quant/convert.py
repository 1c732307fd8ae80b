"""State-format conversion: one parameter's state, in any format, into the formats a param group asks for, and the
value checks that keep a load from poisoning the next step.

Used by :mod:`lowmemopt.checkpoint` (files, streamed by :func:`reformat`) and the optimizer's ``load_state_dict``
pre-hook (:func:`convert_param_state`); it takes plain data and imports nothing above :mod:`lowmemopt.quant`. Policy:
docs/state_format.md#conversion and #loading.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from . import q4
from .blockwise import num_blocks
from .formats import (
    BF16,
    FP16,
    FP32,
    FP64,
    Q4,
    Q8,
    QUANTIZED,
    Slot,
    StateFormat,
    choose_format,
    legacy_map_for,
    map_for,
)
from .maps import code_book

__all__ = [
    "CheckpointError",
    "convert_param_state",
    "reformat",
    "check_source",
    "check_state_values",
    "check_step",
    "check_loaded_group",
    "slot_names",
    "state_origin",
    "foreign_state_hint",
]

CHUNK_NUMEL = 1 << 16  # elements per conversion chunk (rounded to the block sizes): bounds the temporaries
_BNB_QUANT_KEY = "__bnb_optimizer_quant_state__"  # bitsandbytes >= 0.45 nests its 8-bit tensors under this key
_BNB_SCRATCH = {"unorm_vec", "gnorm_vec"}  # bitsandbytes per-step buffers, recomputed every step


class CheckpointError(ValueError):
    """A state file or state dict that cannot be loaded as asked. The optimizer was not changed."""


Reader = Callable[[str, int, int], torch.Tensor]  # (state key, a, b) -> flat elements [a, b) of that stored tensor


def reformat(
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
    """Write slot ``slot``, stored as ``src``, into ``out``'s tensors in block-aligned chunks (``verbatim``: bytes)."""
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


def remaps(src: StateFormat, src_map: str | None, slot: Slot) -> bool:
    """Whether 8-bit state is in a map other than the state map (bitsandbytes' dynamic maps): re-encoded, not copied."""
    return src is Q8 and src_map != map_for(slot.signed)


def state_map(fmt: StateFormat, slot: Slot) -> str | None:
    """The map a slot of format ``fmt`` is stored in (None: not quantized)."""
    return map_for(slot.signed) if fmt is Q8 else q4.map4_for(slot.signed) if fmt is Q4 else None


def target_format(group: dict[str, Any], slot: Slot, numel: int, param_dtype: torch.dtype | None = None) -> StateFormat:
    """The format ``group`` stores a slot of ``numel`` elements in, for a parameter of ``param_dtype``."""
    return choose_format(group["state_bits"], numel, group["min_quant_numel"], slot.quantize, slot.dtype, param_dtype)


def format_numel(slot: Slot, numel: int) -> int:
    """The size that picks a slot's format: the whole parameter's, so a shard's format is the world's."""
    return numel if slot.shape is None else torch.Size(slot.shape).numel()


def slot_shape(slot: Slot, shape: torch.Size) -> torch.Size:
    """The stored shape of a slot of a parameter of ``shape`` (a DTensor's: its local shard's)."""
    return shape if slot.shape is None else torch.Size(slot.shape)


def dense_format(t: torch.Tensor) -> StateFormat:
    if t.dtype == torch.float16:  # torch.optim's state of fp16 params, or fp16 state (Slot.dtype)
        return FP16
    if t.dtype == torch.float64:  # a float64 parameter's state (torch.optim's or ours): decodes without rounding
        return FP64
    return BF16 if t.dtype == torch.bfloat16 else FP32  # other floats decode as fp32


def convert_param_state(
    state: dict[str, Any],
    slots: dict[str, Slot],
    saved_group: dict[str, Any],
    group: dict[str, Any],
    param: torch.Tensor,
    where: str,
    legacy_maps: bool = False,
    numel: int | None = None,
    kept: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One parameter's state from a state dict, in the formats ``group`` asks for ``slots``.

    Args:
        param: the parameter (a DTensor's local shard).
        numel: the whole parameter's size, which picks the formats (default ``param.numel()``).
        state: lowmemopt state in any format (q8 needs ``saved_group["block_size"]``), ``torch.optim`` state, or
            bitsandbytes state (``state1``/``state2`` + ``absmax``/``qmap``), whose N-th state is the N-th slot.
        legacy_maps: the 8-bit state is in the dynamic maps (``lowmemopt_format`` 1); re-encoded into the state maps.
        kept: entries the caller checked (a GaLore projector, bf16_update's), placed after ``step`` as they are.

    Returns:
        The new state; slots already in the target format are not copied.

    Raises:
        CheckpointError: naming ``where`` and the problem.
    """
    numel = param.numel() if numel is None else numel
    if "state1" in state or _BNB_QUANT_KEY in state:
        sources = _bnb_sources(state, slots, where)
    else:
        sources = _lowmemopt_sources(state, slots, saved_group, where, legacy_maps)
    if "step" not in state:
        raise CheckpointError(f"{where}: the state has slots {sorted(sources)} but no 'step' count")
    out: dict[str, Any] = {"step": check_step(state["step"], where)}
    for key, value in (kept or {}).items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            check_state_values(key, value, True, where)
        out[key] = value
    dst_bs = group["block_size"]
    for name, slot in slots.items():
        src, src_bs, tensors, src_map = sources[name]
        shape = slot_shape(slot, param.shape)
        check_source(src, src_bs, tensors, name, shape, where, param.shape)
        for key, t in tensors.items():
            check_state_values(key, t, slot.signed, where)
        dst = target_format(group, slot, format_numel(slot, numel), param.dtype)
        remap = remaps(src, src_map, slot)
        if src is dst and src in QUANTIZED and src_bs != dst_bs and not remap:
            raise CheckpointError(
                f"{where}: '{name}' is {src.bits}-bit at block_size {src_bs} but the optimizer uses block_size "
                f"{dst_bs} (re-quantizing would add error); construct the optimizer with the saved block_size"
            )
        if src is dst and not remap and all(t.dtype == storage_dtype(dst, k) for k, t in tensors.items()):
            for key, t in tensors.items():  # already in place: keep the very tensors (views for bitsandbytes codes)
                out[key] = t.reshape(shape) if dst not in QUANTIZED else t.reshape(-1)
            continue
        flat = {k: t.reshape(-1) for k, t in tensors.items()}
        read = lambda key, a, b, flat=flat: flat[key][a:b]  # noqa: E731
        device = next(iter(tensors.values())).device
        dst.init(out, name, shape, device, dst_bs)
        reformat(read, out, name, shape, slot.signed, src, src_bs, dst, dst_bs, device, verbatim=False, src_map=src_map)
    return out


#: the optimizer a state dict's slots show, by a slot name only it uses (first match), for errors that name it
_ORIGINS = (
    (("state1", _BNB_QUANT_KEY), "bitsandbytes (slots state1, state2)"),
    (("exp_avg_res_row", "exp_avg_res"), "CAME"),
    (("exp_avg_sq_row",), "Adafactor (transformers' or lowmemopt's)"),
    (("row_var", "variance"), "torch.optim.Adafactor (lowmemopt.AdafactorTorch)"),
    (("mu_product",), "torch.optim.NAdam"),
    (("exp_inf",), "torch.optim.Adamax"),
    (("acc_delta",), "torch.optim.Adadelta"),
    (("square_avg",), "torch.optim.RMSprop"),
    (("sum",), "torch.optim.Adagrad"),
    (("step_size",), "torch.optim.Rprop"),
    (("ax",), "torch.optim.ASGD"),
    (("max_exp_avg_sq",), "Adam or AdamW with amsgrad=True"),
    (("exp_avg_sq",), "Adam, AdamW or LAMB (slots exp_avg, exp_avg_sq)"),
    (("momentum_buffer",), "SGD with momentum (torch.optim's or lowmemopt's SGD, SignSGD, FusedSGD, LARS)"),
    (("exp_avg",), "Lion (one slot, exp_avg)"),
)


def slot_names(states: Any) -> set[str]:
    """The slot names in a state dict's ``"state"``, without storage suffixes, ``step`` and kept entries."""
    names: set[str] = set()
    for state in states.values() if isinstance(states, dict) else ():
        for key in state if isinstance(state, dict) else ():
            key = str(key)
            if key == "step" or key.startswith(("galore.", "bf16_update.")):
                continue
            names.add(key.rsplit(".", 1)[0] if key.endswith((".codes", ".absmax", ".nibbles")) else key)
    return names


def state_origin(states: Any) -> str | None:
    """The optimizer whose state ``states`` looks like, in words (``"CAME"``), or None."""
    names = slot_names(states)
    for keys, origin in _ORIGINS:
        if names & set(keys):
            return origin
    if not names and any(isinstance(s, dict) and s for s in (states.values() if isinstance(states, dict) else ())):
        return "an optimizer that keeps no state per parameter (SGD or LARS without momentum)"
    return None


def foreign_state_hint(states: Any, slots: Callable[[], set[str]], owner: str) -> str:
    """``". It looks like the state of <optimizer>, not of <owner> ..."``, or ``""``."""
    origin = state_origin(states)
    if origin is None:
        return ""
    try:
        ours = slots()
    except Exception:  # (a group this optimizer cannot describe: the error as it is)
        return ""
    if slot_names(states) == ours:
        return ""
    return (
        f". It looks like the state of {origin}, not of {owner} (slots {', '.join(sorted(ours)) or 'none'}): a "
        f"state dict loads into the optimizer that saved it"
    )


def check_state_values(key: str, t: torch.Tensor, signed: bool, where: str) -> None:
    """Raise CheckpointError unless ``t`` is finite and, for ``absmax`` or unsigned slots, not negative."""
    if not t.is_floating_point() or t.numel() == 0:
        return
    lo, hi = (float(x) for x in torch.aminmax(t.detach().reshape(-1)))  # NaN propagates to both
    if math.isnan(lo) or math.isnan(hi):
        problem = "NaN"
    elif math.isinf(lo) or math.isinf(hi):
        problem = "Inf"
    elif lo < 0 and (key.endswith(".absmax") or not signed):
        problem = f"negative values (min {lo:g}) where every value is >= 0"
    else:
        return
    raise CheckpointError(f"{where}: state '{key}' holds {problem}; it would poison the next step")


def check_step(step: Any, where: str) -> int:
    """A state's step count as an int; raise CheckpointError unless it is a non-negative integer."""
    value = step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
        or value != int(value)
    ):
        shown = value if isinstance(value, (int, float)) else f"of type {type(step).__name__}"
        raise CheckpointError(f"{where}: step {shown} (the step count must be a non-negative integer)")
    return int(value)


def check_loaded_group(check: Callable[[dict[str, Any]], None], group: dict[str, Any], where: str) -> None:
    """Run the optimizer's ``_check_group`` on a param group to load; its error becomes a CheckpointError."""
    try:
        check(group)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where} are invalid: {e}") from None


def storage_dtype(fmt: StateFormat, key: str) -> torch.dtype:
    if fmt in QUANTIZED:
        return torch.uint8 if key.endswith((".codes", ".nibbles")) else torch.float32
    return {BF16: torch.bfloat16, FP16: torch.float16, FP64: torch.float64}.get(fmt, torch.float32)


def check_source(
    src: StateFormat,
    bs: int,
    tensors: dict[str, torch.Tensor],
    name: str,
    shape: torch.Size,
    where: str,
    param_shape: torch.Size | None = None,
    source: str = "the state dict",
):
    """Raise CheckpointError unless ``tensors`` hold slot ``name`` of ``shape`` in format ``src``."""
    numel = shape.numel()
    param_shape = shape if param_shape is None else param_shape
    ours = f"the optimizer's parameter has shape {tuple(param_shape)}"
    if tuple(param_shape) != tuple(shape):
        ours += f" and its '{name}' {tuple(shape)}"
    hint = "; is it the state of another model, or of the parameters in another order?"
    if src is Q8 or src is Q4:
        key, stored, unit, kind = (
            (".codes", numel, "elements", "8-bit codes")
            if src is Q8
            else (".nibbles", q4.packed_len(numel), "bytes", "4-bit codes, two per byte")
        )
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
    if t.numel() != numel or t.dim() == len(shape) > 1 and t.shape != shape:  # (same size, other dims: refused too)
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
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 1:
                raise CheckpointError(
                    f"{where}: 8-bit state '{name}' but the saved param group has no block_size (block_size {bs!r})"
                )
            qmap = legacy_map_for(slot.signed) if legacy_maps else map_for(slot.signed)
            sources[name] = (Q8, bs, {k: state[k] for k in keys}, qmap)
        elif name + ".nibbles" in state:
            keys = Q4.keys(name)
            if keys[1] not in state:
                raise CheckpointError(f"{where}: '{keys[0]}' without '{keys[1]}'")
            bs = saved_group.get("block_size")
            if isinstance(bs, bool) or not isinstance(bs, int) or bs < 2 or bs % 2:
                raise CheckpointError(
                    f"{where}: 4-bit state '{name}' but the saved param group has no even block_size "
                    f"(block_size {bs!r})"
                )
            sources[name] = (Q4, bs, {k: state[k] for k in keys}, q4.map4_for(slot.signed))
        elif name in state:
            keys = (name,)
            _check_tensors(state, keys, where)
            sources[name] = (dense_format(state[name]), 1, {name: state[name]}, None)
        else:
            raise CheckpointError(f"{where}: the state has no slot '{name}' (has {sorted(state)})")
        _check_tensors(state, keys, where)
        used.update(keys)
    extra = sorted(set(state) - used)
    if extra:
        raise CheckpointError(f"{where}: unexpected state {extra}; the optimizer's slots are {sorted(slots)}")
    return sources


def _check_tensors(state: dict[str, Any], keys: Any, where: str) -> None:
    for key in keys:
        if not isinstance(state[key], torch.Tensor):
            raise CheckpointError(f"{where}: state '{key}' is a {type(state[key]).__name__}, not a tensor")


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
        _check_tensors(state, [f"state{i}"] + [k for k in (f"absmax{i}", f"qmap{i}") if k in state], where)
        t = state[f"state{i}"]
        used.add(f"state{i}")
        if t.dtype != torch.uint8:
            sources[name] = (dense_format(t), 1, {name: t}, None)
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
