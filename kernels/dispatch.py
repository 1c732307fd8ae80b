"""The Triton backend of the step pipeline: :func:`step_triton` groups items into buckets (equal param-group values,
format, dtypes, device, step count, layout), steps each with one kernel's launches and returns what no kernel takes
for the per-tensor backends; :func:`plan_buckets` and :func:`launch_buckets` are its halves, which a kept step
program calls apart. Which items a kernel takes, and what a failed launch does: docs/kernels.md#dispatch."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch

from lowmemopt._stacklevel import external_stacklevel
from lowmemopt.work import capture
from lowmemopt.work.items import Item, Update
from lowmemopt.work.record import group_values
from lowmemopt.quant.formats import common_formats

from . import registry, runtime
from .table import select_flags

__all__ = ["step_triton", "plan_buckets", "launch_buckets", "Planned", "group_values", "stats"]

#: buckets stepped by a kernel, per (algorithm, format), since import (tests check that the fused path really ran)
stats: dict[tuple[str, str], int] = {}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def step_triton(
    kernels: Any,
    items: list[Item],
    update_for: Callable[[Item, Any], Update],
    flags: torch.Tensor | None = None,
    device_steps: bool = False,
    grad_mult: Callable[[torch.device], torch.Tensor | None] | None = None,
    planned: list[Planned] | None = None,
) -> list[Item]:
    """Step what the kernels can of ``items`` (one optimizer's, its algorithm declaring ``kernels``); return the rest.
    ``update_for(item, step)``: the bucket's hyper-parameters; ``flags``: device finiteness flags (an item with a
    ``flag`` row is stepped only where it is 1); ``device_steps``: a capturable step (step counts on the device);
    ``grad_mult``: loss scaling per device; ``planned``: a list that receives the buckets (a step program keeps them).
    With ``device_steps`` an item no kernel takes raises ValueError before any launch. :func:`plan_buckets` and
    :func:`launch_buckets` are its two halves (a kept step program calls them apart).
    """
    if not items:
        return items
    usable = {d: runtime.device_ok(d) for d in {it.target.device for it in items}}
    if not any(usable.values()):
        if device_steps:
            raise ValueError("capturable=True needs the fused Triton kernels, which this device does not have")
        return items
    buckets, rest = plan_buckets(kernels, items, device_steps, usable)
    if planned is not None:
        planned += buckets
    return rest + launch_buckets(buckets, update_for, flags, device_steps, grad_mult)


@dataclass(eq=False)
class Planned:
    """One bucket as :func:`plan_buckets` resolved it: kernel, items, their :class:`~.launch.Bucket`."""

    kernel: Any
    members: list[Item]
    step: int | None  # the members' step count before this step (None: a capturable step's, on the device)
    bucket: Any = None
    #: the members' rows in the step's finiteness flags where they follow one another (a slice of the flags), set by
    #: a step program; None: each member's ``flag``
    flag_rows: range | None = None
    rounding: str = "nearest"  # how the kernel stores 16-bit targets (the members' ``bf16_update``)


def plan_buckets(
    kernels: Any, items: list[Item], device_steps: bool = False, usable: dict[torch.device, bool] | None = None
) -> tuple[list[Planned], list[Item]]:
    """``(buckets, rest)``: ``items`` grouped into buckets that one kernel's launches step, and those no kernel takes
    (see :func:`step_triton`; ``rest`` raises ValueError in a capturable step); ``usable``: ``runtime.device_ok``
    per device, where known. Nothing is launched."""
    from .launch import Bucket

    if usable is None:
        usable = {}
    # what each item's own tensors allow, then the formats of the candidates' states, read in one call
    candidates = [it for it in items if _tensors_take(it, usable, device_steps)]
    names: dict[tuple[int, int], tuple[str, ...]] = {}  # (id(slots), numel) -> the full-size quantized slots
    wanted = []
    for it in candidates:
        key = (id(it.slots), it.target.numel())
        found = names.get(key)
        if found is None:
            found = names[key] = _full_size_slots(it.slots, key[1])
        wanted.append(found)
    formats = dict(zip(map(id, candidates), common_formats([it.state for it in candidates], wanted)))
    classes: dict[tuple, tuple | None] = {}  # (format, record, slots, shape, dtype) -> _kernel_of's answer
    rest: list[Item] = []
    buckets: dict[tuple, Planned] = {}
    first = None  # the first record: its values are asked only when a second record comes (a bucket key)
    group_ids: dict[int, int] = {}  # id(record) -> the number of its version (its group's values), one per distinct
    by_values: dict[tuple, int] = {}
    for it in items:
        fmt = formats.get(id(it))
        found = None
        if fmt is not None:
            t, record = it.target, it.record
            key = (fmt, id(record), id(it.slots), t.shape, t.dtype)
            found = classes.get(key, False)
            if found is False:
                found = classes[key] = _kernel_of(kernels, fmt, record, t, it.slots)
            if found is not None and not _state_takes(it.state, t.device):
                found = None
        if found is None:
            if device_steps:
                raise ValueError(
                    f"capturable=True: no fused kernel takes a parameter of shape "
                    f"{tuple(it.target.shape)} ({it.target.dtype}, gradient {it.grad.dtype}, contiguous: "
                    f"{it.target.is_contiguous() and it.grad.is_contiguous()}); a capturable step "
                    "cannot fall back to the per-tensor path"
                )
            rest.append(it)
            continue
        kernel, layout, mode = found
        gid = group_ids.get(id(record))
        if gid is None:  # (once per record and call: per-parameter groups pay it per item)
            if first is None:
                first, gid = record, 0
            else:
                if not by_values:
                    by_values[first.version] = 0
                gid = by_values.setdefault(record.version, len(by_values))
            group_ids[id(record)] = gid
        step = None if device_steps else it.state["step"]
        key = (
            gid,
            it.projected,
            kernel.fmt,
            t.dtype,
            it.grad.dtype,
            t.device,
            step,
            layout,
            it.flag is not None,
            it.weight is not None,
        )
        planned = buckets.get(key)
        if planned is None:
            planned = buckets[key] = Planned(kernel, [], step, rounding=mode)
        planned.members.append(it)
    out = list(buckets.values())
    for planned in out:
        members = planned.members
        planned.bucket = Bucket(
            [it.target for it in members],
            [it.grad for it in members],
            [it.state for it in members],
            planned.kernel.fmt,
            members[0].record.block_size,
            index_bases=[it.index_base for it in members],
            rounding=planned.rounding,
        )
    return out, rest


def launch_buckets(
    planned: list[Planned],
    update_for: Callable[[Item, Any], Update],
    flags: torch.Tensor | None = None,
    device_steps: bool = False,
    grad_mult: Callable[[torch.device], torch.Tensor | None] | None = None,
) -> list[Item]:
    """Launch each bucket of ``planned`` and write its step counts; return the items of buckets whose launch failed."""
    from .launch import Unsupported

    rest: list[Item] = []
    for p in planned:
        kernel, members, bucket = p.kernel, p.members, p.bucket
        if not runtime.ENABLED:  # turned off by a failure in an earlier bucket
            if device_steps:
                raise RuntimeError("capturable=True: the fused Triton kernels were turned off by an earlier failure")
            rest += members
            continue
        if device_steps:  # (the gather stage made each count a device tensor: capture.device_count)
            counters = [it.state["step"] for it in members]
            step = torch.stack(counters).to(torch.float64) + 1  # the step each tensor takes
        else:
            step = p.step + 1
        update = update_for(members[0], step)
        weights = None if members[0].weight is None else torch.stack([it.weight for it in members])
        mult = grad_mult(bucket.device) if grad_mult is not None and not members[0].projected else None
        flagged = flags is not None and members[0].flag is not None  # device-side finiteness (pipeline.finite)
        rows = (p.flag_rows if p.flag_rows is not None else [it.flag for it in members]) if flagged else []
        try:
            bucket.run(kernel.launch, update, flags if flagged else None, rows, weights, mult)
        except Unsupported as exc:
            if device_steps:
                raise ValueError(f"capturable=True: {exc}") from None
            rest += members
            continue
        except Exception as exc:
            if bucket.written or device_steps:
                raise
            runtime.ENABLED = False
            warnings.warn(
                f"lowmemopt: fused Triton kernels unavailable ({type(exc).__name__}: {exc}); using the reference step",
                RuntimeWarning,
                stacklevel=external_stacklevel(),
            )
            rest += members
            continue
        if device_steps:  # a skipped tensor's count stays: it advances by its flag
            capture.advance(
                counters, None if bucket.flags is None else select_flags(flags, bucket.flag_rows, bucket.device)
            )
        else:
            p.step = step
            for it in members:
                it.state["step"] = step
        stats[(kernel.algorithm, kernel.fmt)] = stats.get((kernel.algorithm, kernel.fmt), 0) + 1
    return rest


def _tensors_take(it: Item, usable: dict[torch.device, bool], device_steps: bool) -> bool:
    """May a kernel take this item as its tensors are (device, dtypes, shapes, layout, an int step count)?
    ``usable``: a per-call ``runtime.device_ok`` cache."""
    t, g = it.target, it.grad
    device = t.device
    ok = usable.get(device)
    if ok is None:
        ok = usable[device] = runtime.device_ok(device)
    if not ok or t.dtype not in _DTYPES or g.dtype not in _DTYPES:
        return False
    if g.shape != t.shape or g.device != device or not (t.is_contiguous() and g.is_contiguous()):
        return False
    # (a tensor step: e.g. from a foreign state dict)
    return device_steps or isinstance(it.state.get("step"), int)


def _full_size_slots(slots: dict[str, Any], numel: int) -> tuple[str, ...]:
    """The quantized slots of a target of ``numel`` elements that are its size: their format is the bucket's."""
    return tuple(name for name, s in slots.items() if s.quantize and (s.shape is None or math.prod(s.shape) == numel))


def _kernel_of(kernels: Any, fmt: str, record: Any, t: torch.Tensor, slots: dict[str, Any]) -> tuple | None:
    """``(kernel, layout, rounding mode)`` for targets like ``t`` of ``record``'s bucket, state of format ``fmt`` and
    these ``slots`` (``layout``: part of the bucket key), or None (a per-tensor backend)."""
    kernel = registry.lookup(kernels, fmt)
    if kernel is None or sorted(kernel.slots(record.hyper, t)) != sorted(slots):
        return None
    mode = record.rounding_of(t)
    if mode != "nearest" and not kernel.any_rounding:
        return None  # this kernel writes 16-bit parameters rounded to nearest only: the reference path rounds as asked
    return kernel, kernel.matrices_apart and t.dim() >= 2, mode


def _state_takes(state: dict[str, Any], device: torch.device) -> bool:
    """Is every state tensor on ``device`` and contiguous?"""
    for value in state.values():
        if isinstance(value, torch.Tensor) and (value.device != device or not value.is_contiguous()):
            return False
    return True
