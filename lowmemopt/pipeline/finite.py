"""The non-finite-gradient check with the skip decided on the device: no host synchronization before the kernels.

The policy is the optimizer's (:mod:`lowmemopt.optimizer`): a parameter whose gradient has a NaN / Inf element (or an
fp32 sum of squares that overflows) is skipped this step, its values and state unchanged, and a warning counts the
skips. Deciding that on the host means reading the check back before anything is launched: the host then waits for
the GPU to finish the backward pass, and the GPU waits while the host builds the step (its items and launch tables).

With :class:`DeviceFlags` the check stays on the device. One fused multi-tensor norm per gradient dtype gives a uint8
flag per gradient; each kernel launch multiplies its tensors' element counts in its launch table by their flags (one
``index_select`` and one multiply on the device), so a skipped tensor's programs mask off every load and store and
leave its parameter and state as they were. The host reads the flags once, after every launch of the step: to undo
the step count of the skipped parameters (the dispatcher counts a bucket's step when it launches), to warn, and
before any parameter that no kernel took goes to the per-tensor backends (which need the decision first).

It applies when every value a kernel stores in a parameter or its state is masked by the tensor's element count:
every fused algorithm at every state format. The element-wise passes mask by it; the per-tensor reductions (LAMB's
and LARS's norms, Adafactor's and CAME's row/column sums, clip RMS and moments) write only the launch's scratch; the
per-matrix pass that writes Adafactor's and CAME's row/column statistics runs no iteration for a count of 0. A GaLore
parameter's low-rank update runs on a stand-in through the same kernels and reaches the weight through the batched
apply pass (:mod:`lowmemopt.kernels.unproject`), which reads the flags too; the projections write nothing but
temporaries. It needs one device, nothing moving or sharded (FSDP2: the ranks agree on the flags on the host), and for
a GaLore parameter a basis already made, no refresh due (the SVD would read the gradient) and the batched products
(CUDA): :meth:`~.plan.ProjectionStage.device_may_check`. Elsewhere the check stays on the host, as before.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Iterable, Sequence

import torch

from .. import cpu

__all__ = ["DeviceFlags", "PendingSkip", "CpuFiniteChecks", "finite_norms", "host_flags", "resolve"]


def finite_norms(grads: Sequence[torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """``(order, ok)``: whether each gradient's L2 norm is finite, as a bool tensor on the gradients' (one) device,
    ``ok[k]`` for gradient ``order[k]``. One fused multi-tensor norm per dtype, in fp32 (an fp16 gradient's norm
    past 65504 is finite, as the native CPU check's fp32 sum of squares), float64 gradients' in float64 (their state
    and math are float64: an element past ~1e19 is no overflow there): a few launches, whatever the number of
    gradients. The condition of the optimizer's
    non-finite check (:func:`host_flags` reads it on the host).

    A norm is >= 0, +Inf or NaN, so ``norm < inf`` is ``isfinite(norm)`` in one comparison (``isfinite`` of a float
    tensor is four: ``(x == x) * (x.abs() != inf)``)."""
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
        #: params stepped provisionally: id -> (state, its step count before this step, made by this step)
        self.provisional: dict[int, tuple[dict[str, Any], int, bool]] = {}

    @classmethod
    def from_found_inf(cls, params: Sequence[torch.Tensor], found_inf: torch.Tensor) -> "DeviceFlags":
        """The flags of a loss-scaled step (``torch.amp.GradScaler``'s ``found_inf``, already checked over every
        gradient by the scaler): every row ``found_inf == 0``, made on its device with no norm and nothing read
        back. The kernels mask by them as by the optimizer's own check."""
        self = cls.__new__(cls)
        self.tensor = (found_inf.reshape(1) == 0).view(torch.uint8).repeat(len(params))
        self.position = {id(p): i for i, p in enumerate(params)}
        self._host = None
        self.provisional = {}
        return self

    def deferred(self, counted: bool = False) -> "PendingSkip":
        """This step's undo, decided later (:class:`PendingSkip`): its flags copied to host memory without waiting.
        ``counted``: the optimizer's own check (the skips are counted and warned about); else GradScaler's
        ``found_inf`` (one flag for the whole step)."""
        provisional, self.provisional = self.provisional, {}
        if not counted:
            return PendingSkip(self.tensor[:1], lambda rows: _undo(provisional.values()))
        by_row = {self.position[pid]: record for pid, record in provisional.items()}
        return PendingSkip(self.tensor, lambda rows: _undo(by_row[r] for r in rows if r in by_row), counted=True)

    def note(self, param: torch.Tensor, state: dict[str, Any], fresh: bool) -> None:
        """Record ``param``'s step count before it is stepped provisionally (``fresh``: its state is made now)."""
        self.provisional[id(param)] = (state, state.get("step", 0), fresh)

    @property
    def read(self) -> bool:
        """Have the flags been read on the host (:meth:`host`) in this step?"""
        return self._host is not None

    def host(self) -> list[bool]:
        """The flags on the host, by row (the first call reads them: a synchronization)."""
        if self._host is None:
            self._host = [bool(f) for f in self.tensor.tolist()]
        return self._host

    def finite(self, param: torch.Tensor) -> bool:
        """The host's copy of ``param``'s flag."""
        return self.host()[self.position[id(param)]]

    def undo_skipped(self) -> int:
        """For every provisionally stepped parameter whose gradient was not finite: the step count it had (the
        kernel wrote nothing of it), or no state at all when this step made it (as the host-side check leaves it).
        Returns how many gradients were not finite."""
        flags = self.host()
        _undo(record for pid, record in self.provisional.items() if not flags[self.position[pid]])
        return flags.count(False)


class PendingSkip:
    """A step's skips, read on the host later, so the host never waits for the device: the step's flags (uint8, 1:
    finite) are copied to page-locked host memory by a non-blocking copy with an event recorded after it, and the
    optimizer settles them at its next ``step()`` (or ``state_dict()``, ``load_state_dict()``, ``nonfinite_skips``),
    when the device has long finished that copy: ``undo`` restores what the step changed provisionally of the skipped
    rows' parameters (their step counts: the kernels stored nothing), and for the optimizer's own check (``counted``)
    the optimizer counts and warns about them. Until then the host's step counts of a skipped parameter read one too
    many. ``flags`` of one element (GradScaler's ``found_inf``): the whole step, not counted."""

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
    """Read the flags of several checks with one synchronization (one host copy of all of them), undo their skipped
    parameters' provisional steps, and return how many parameters were skipped: the per-layer updates
    (:mod:`lowmemopt.per_layer`) check each parameter on the device in its hook and resolve once per backward pass."""
    if not pending:
        return 0
    values = torch.cat([f.tensor for f in pending]).tolist()
    at = 0
    for f in pending:
        n = f.tensor.numel()
        f._host = [bool(v) for v in values[at:at + n]]
        at += n
    return sum(f.undo_skipped() for f in pending)


def host_flags(grads: list[torch.Tensor]) -> list[bool]:
    """One bool per gradient: is its L2 norm finite? False for any NaN/Inf element, and for elements so large (~1e19)
    that their square overflows fp32 (they would turn a second moment into Inf). One fused multi-tensor norm (the
    cheapest reduction here: 2.3 ms on 16M elements, against 80 ms for an Inf-norm) and one host sync per device."""
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
    """The non-finite check of plain CPU gradients, pipelined with the native kernels.

    Checking every gradient up front reads all of them once more before the step (on a 148M-parameter model, 20 ms
    against a 70 ms fused AdamW step). Instead, the kernel that steps one CPU parameter also sums the squares of the
    next parameter's gradient, in the same parallel loop, so those reads overlap its arithmetic; a gradient no kernel
    scanned is checked just before its step (:meth:`check`). The condition is the up-front one (the fp32 sum of
    squares is finite), and a parameter is still checked before anything of it changes. Off when a parameter is a
    DTensor (``sharded``: the ranks agree on all flags up front) or without the native kernels."""

    def __init__(self, params: list[torch.Tensor], grads: list[torch.Tensor], sharded: bool):
        self.grads = grads
        self.indices: set[int] = set()
        if cpu.ENABLED and any(p.device.type == "cpu" for p in params) and not sharded:
            runtime = sys.modules.get("lowmemopt.kernels.runtime")
            if cpu.available() and not getattr(runtime, "_cpu_interpreter", False):  # (tests: Triton on CPU)
                from ..cpu import ffi

                self.indices = {i for i, p in enumerate(params) if p.device.type == "cpu" and ffi.can_scan(grads[i])}

    def check(self, i: int) -> bool:
        ok = cpu.grad_is_finite(self.grads[i])
        return host_flags([self.grads[i]])[0] if ok is None else ok
