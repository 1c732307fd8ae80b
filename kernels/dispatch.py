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
from lowmemopt.quant.formats import format_of

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
) -> list[Item]:
    """Step what the kernels can of ``items`` (one optimizer's, its algorithm declaring ``kernels``); return the rest.
    ``update_for(item, step)``: the bucket's hyper-parameters; ``flags``: device finiteness flags (an item with a
    ``flag`` row is stepped only where it is 1); ``device_steps``: a capturable step (step counts on the device);
    ``grad_mult``: loss scaling per device. With ``device_steps`` an item no kernel takes raises ValueError before any
    launch. :func:`plan_buckets` and :func:`launch_buckets` are its two halves (a kept step program calls them apart).
    """
    if not items or not _usable({it.target.device for it in items}):
        if device_steps and items:
            raise ValueError("capturable=True needs the fused Triton kernels, which this device does not have")
        return items
    planned, rest = plan_buckets(kernels, items, device_steps)
    return rest + launch_buckets(planned, update_for, flags, device_steps, grad_mult)


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


def plan_buckets(kernels: Any, items: list[Item], device_steps: bool = False) -> tuple[list[Planned], list[Item]]:
    """``(buckets, rest)``: ``items`` grouped into buckets that one kernel's launches step, and those no kernel takes
    (see :func:`step_triton`; ``rest`` raises ValueError in a capturable step). Nothing is launched."""
    from .launch import Bucket

    rest: list[Item] = []
    buckets: dict[tuple, Planned] = {}
    usable: dict[torch.device, bool] = {}  # runtime.device_ok per device
    group_ids: dict[int, int] = {}  # id(record) -> the number of its version (its group's values), one per distinct
    by_values: dict[tuple, int] = {}
    for it in items:
        kernel = _kernel_for(kernels, it, usable, device_steps)
        if kernel is None:
            if device_steps:
                raise ValueError(
                    f"capturable=True: no fused kernel takes a parameter of shape "
                    f"{tuple(it.target.shape)} ({it.target.dtype}, gradient {it.grad.dtype}, contiguous: "
                    f"{it.target.is_contiguous() and it.grad.is_contiguous()}); a capturable step "
                    "cannot fall back to the per-tensor path"
                )
            rest.append(it)
            continue
        t, record = it.target, it.record
        gid = group_ids.get(id(record))
        if gid is None:  # (once per record and call: per-parameter groups pay it per item)
            gid = group_ids[id(record)] = by_values.setdefault(record.version, len(by_values))
        step = None if device_steps else it.state["step"]
        key = (
            gid,
            it.projected,
            kernel.fmt,
            t.dtype,
            it.grad.dtype,
            t.device,
            step,
            kernel.layout(t),
            it.flag is not None,
            it.weight is not None,
        )
        planned = buckets.get(key)
        if planned is None:
            planned = buckets[key] = Planned(kernel, [], step)
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
        bucket.written = False
        bucket.weights = None if members[0].weight is None else torch.stack([it.weight for it in members])
        bucket.grad_mult = grad_mult(bucket.device) if grad_mult is not None and not members[0].projected else None
        if flags is not None and members[0].flag is not None:  # device-side finiteness (pipeline.finite)
            bucket.set_flags(flags, p.flag_rows if p.flag_rows is not None else [it.flag for it in members])
        else:
            bucket.set_flags(None, [])
        try:
            kernel.launch(update, bucket)
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


def _kernel_for(kernels: Any, it: Item, usable: dict[torch.device, bool], device_steps: bool = False):
    """The kernel for this item, or None (a per-tensor backend); ``usable``: a per-call ``runtime.device_ok`` cache."""
    t, g, state = it.target, it.grad, it.state
    device = t.device
    ok = usable.get(device)
    if ok is None:
        ok = usable[device] = runtime.device_ok(device)
    if not ok or t.dtype not in _DTYPES or g.dtype not in _DTYPES:
        return None
    if g.shape != t.shape or g.device != device or not (t.is_contiguous() and g.is_contiguous()):
        return None
    if not device_steps and not isinstance(state.get("step"), int):  # e.g. a tensor step from a foreign state dict
        return None
    # the format of the target-sized slots, all one (a target without any counts as fp32)
    numel, fmt = t.numel(), None
    for name, s in it.slots.items():
        if s.quantize and (s.shape is None or math.prod(s.shape) == numel):
            try:
                slot_fmt = format_of(state, name).name
            except KeyError:  # a slot is missing: the reference path reports it
                return None
            if fmt is None:
                fmt = slot_fmt
            elif slot_fmt != fmt:
                return None
    kernel = registry.lookup(kernels, fmt or "fp32")
    record = it.record
    if kernel is None or sorted(kernel.slots(record.hyper, t)) != sorted(it.slots):
        return None
    if record.rounding_of(t) != "nearest" and not kernel.any_rounding:
        return None  # this kernel writes 16-bit parameters rounded to nearest only: the reference path rounds as asked
    for value in state.values():
        if isinstance(value, torch.Tensor) and (value.device != device or not value.is_contiguous()):
            return None
    return kernel


def _usable(devices: set[torch.device]) -> bool:
    """May these kernels take tensors on ``devices``? Triton enabled and one device it runs on (a CUDA device, or the
    CPU under the interpreter: :func:`~lowmemopt.kernels.runtime.device_ok`)."""
    return any(runtime.device_ok(d) for d in devices)
