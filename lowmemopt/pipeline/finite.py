"""The non-finite-gradient check: :class:`DeviceFlags` (the skip decided on the device: the kernels mask a flagged
tensor's loads and stores, the host reads the flags after every launch), :class:`PendingSkip` (a step's skips settled
at the next step), :class:`CpuFiniteChecks` (CPU gradients checked by the kernel that steps the one before) and the
host's check (:func:`host_flags`). Policy and when each applies: docs/internals.md#non-finite-gradients."""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import cpu

__all__ = ["DeviceFlags", "PendingSkip", "CpuFiniteChecks", "finite_norms", "host_flags", "resolve"]


def finite_norms(grads: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """``(order, ok)``: whether each gradient's L2 norm is finite, on the gradients' device, ``ok[k]`` for ``order[k]``:
    one fused norm per dtype (docs/internals.md#non-finite-gradients).
    """
    if len(grads) == 1:  # one gradient (a per-layer hook's): no stack, no cat
        return [0], (torch._foreach_norm(list(grads), 2, dtype=_norm_dtype(grads[0].dtype))[0] < math.inf).view(1)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, g in enumerate(grads):
        by_dtype.setdefault(g.dtype, []).append(i)
    order: list[int] = []
    checks = []
    for dtype, members in by_dtype.items():
        norms = torch._foreach_norm([grads[i] for i in members], 2, dtype=_norm_dtype(dtype))
        checks.append(torch.stack(norms) < math.inf)
        order += members
    return order, checks[0] if len(checks) == 1 else torch.cat(checks)


def _norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a gradient's norm in the check: float64 for float64 gradients, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class DeviceFlags:
    """Per-gradient finiteness on the device: ``tensor`` (uint8 [n], 1: finite), ``position[id(param)]`` its row."""

    def __init__(self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        order, ok = finite_norms(grads)
        self.tensor = ok.view(torch.uint8)  # bool is one byte, 0 or 1: a view, no copy
        self.position = {id(params[i]): pos for pos, i in enumerate(order)}
        self._host: list[bool] | None = None
        #: have the flags been read on the host (:meth:`host`) in this step?
        self.read = False
        #: no parameter of the step and no gradient is a DTensor (``pipeline.device_flags`` checked: the gather
        #: takes each tensor as its own local view)
        self.whole = False
        #: params stepped provisionally: id -> (state, its step count before this step, made by this step)
        self.provisional: dict[int, tuple[dict[str, Any], int, bool]] = {}

    @classmethod
    def from_found_inf(cls, params: Sequence[torch.Tensor], found_inf: torch.Tensor) -> "DeviceFlags":
        """The flags of a loss-scaled step: every row ``found_inf == 0``, made on its device."""
        self = cls.__new__(cls)
        self.tensor = (found_inf.reshape(1) == 0).view(torch.uint8).repeat(len(params))
        self.position = {id(p): i for i, p in enumerate(params)}
        self._host = None
        self.read = self.whole = False
        self.provisional = {}
        return self

    def deferred(self, counted: bool = False) -> "PendingSkip":
        """This step's undo, decided later (:class:`PendingSkip`); ``counted``: the optimizer's own check."""
        provisional, self.provisional = self.provisional, {}
        if not counted:
            return PendingSkip(self.tensor[:1], lambda rows: _undo(provisional.values()))
        by_row = {self.position[pid]: record for pid, record in provisional.items()}
        return PendingSkip(self.tensor, lambda rows: _undo(by_row[r] for r in rows if r in by_row), counted=True)

    def note(self, param: torch.Tensor, state: dict[str, Any], fresh: bool) -> None:
        """Record ``param``'s step count before it is stepped provisionally (``fresh``: its state is made now)."""
        self.provisional[id(param)] = (state, state.get("step", 0), fresh)

    def note_all(self, items: Sequence[Any], fresh: Sequence[bool]) -> None:
        """:meth:`note` of each item (``param``, ``state``) of a bucket, ``fresh[i]`` for ``items[i]``."""
        note = self.note
        for it, made in zip(items, fresh):
            note(it.param, it.state, made)

    def host(self) -> list[bool]:
        """The flags on the host, by row (the first call reads them: a synchronization)."""
        if self._host is None:
            self._host = [bool(f) for f in self.tensor.tolist()]
            self.read = True
        return self._host

    def finite(self, param: torch.Tensor) -> bool:
        """The host's copy of ``param``'s flag."""
        return self.host()[self.position[id(param)]]

    def undo_skipped(self) -> int:
        """Restore each skipped parameter's step count (or drop state this step made); returns how many were skipped."""
        flags = self.host()
        _undo(record for pid, record in self.provisional.items() if not flags[self.position[pid]])
        return flags.count(False)


class PendingSkip:
    """A step's skips, copied to pinned host memory without waiting and settled at the optimizer's next ``step()``
    (docs/internals.md#non-finite-gradients); ``flags`` of one element: GradScaler's ``found_inf``, not counted.
    """

    def __init__(self, flags: torch.Tensor, undo: Callable[[list[int]], None], counted: bool = False) -> None:
        self.undo = undo
        self.counted = counted
        self.event = None
        if flags.device.type == "cuda":
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:  # (CPU tensors: the interpreter's tests) already on the host
            self.host = flags.clone()

    def resolve(self) -> int:
        """Wait for the copy (long done by now: a step after the one it belongs to), undo the skipped rows'
        provisional changes; returns how many rows were skipped."""
        if self.event is not None:
            self.event.synchronize()
        values = self.host.tolist()  # (host memory: a copy the device finished, nothing to wait for)
        if 0 not in values:
            return 0
        rows = [i for i, v in enumerate(values) if v == 0]
        self.undo(rows)
        return len(rows)


def _undo(records: Iterable[tuple[dict[str, Any], int, bool]]) -> None:
    """Restore provisionally stepped parameters' ``(state, step count before, made by the step)``: the step count
    it had, or no state at all when the step made it (as the host-side check leaves it)."""
    for state, step, fresh in records:
        if fresh:
            state.clear()
        else:
            state["step"] = step


def resolve(pending: list[DeviceFlags]) -> int:
    """Read several checks' flags with one synchronization, undo their skipped steps, return how many were skipped."""
    if not pending:
        return 0
    values = torch.cat([f.tensor for f in pending]).tolist()
    at = 0
    for f in pending:
        n = f.tensor.numel()
        f._host = [bool(v) for v in values[at : at + n]]
        f.read = True
        at += n
    return sum(f.undo_skipped() for f in pending)


def host_flags(grads: list[torch.Tensor]) -> list[bool]:
    """One bool per gradient: is its L2 norm finite? One fused norm and one host sync per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, g in enumerate(grads):
        by_device.setdefault(g.device, []).append(i)
    flags = [True] * len(grads)
    for idx in by_device.values():
        order, ok = finite_norms([grads[i] for i in idx])
        for k, f in zip(order, ok.tolist()):
            flags[idx[k]] = f
    return flags


class CpuFiniteChecks:
    """The non-finite check of plain CPU gradients, pipelined with the native kernels: the kernel stepping one parameter
    sums the squares of the next one's gradient; an unscanned gradient is checked just before its step. Off for
    DTensors.
    """

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], sharded: bool):
        self.grads = grads
        self.indices: set[int] = set()
        if cpu.ENABLED and any(p.device.type == "cpu" for p in params) and not sharded:
            runtime = sys.modules.get("lowmemopt.kernels.runtime")
            if cpu.available() and not getattr(runtime, "_cpu_interpreter", False):  # (tests: Triton on CPU)
                from ..cpu import ffi

                self.indices = {i for i in ffi.scannable(grads) if params[i].device.type == "cpu"}

    def check(self, i: int) -> bool:
        ok = cpu.grad_is_finite(self.grads[i])
        return host_flags([self.grads[i]])[0] if ok is None else ok
