"""The plan of one step (:class:`Plan`): what an entry hands :func:`lowmemopt.pipeline.run` beside the parameters,
each param group resolved once per step into the record its items carry (:meth:`Plan.record_of`); what a run leaves
(:class:`StepOutcome`, :class:`StepRecord`); and loss scaling's gradient multiplier (:func:`inv_scale`,
:func:`unscaled`: docs/internals.md#mixed-precision-gradscalers-native-path)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..work.items import Item, Update
from ..work.record import BucketRecord
from .algorithm import Algorithm, KernelSet

__all__ = [
    "Plan",
    "ProjectionStage",
    "ReductionStage",
    "StepOutcome",
    "StepRecord",
    "unscaled",
    "inv_scale",
    "update_of",
]


def inv_scale(grad_scale: torch.Tensor) -> torch.Tensor:
    """The gradient multiplier of a loss scale, exactly as ``GradScaler.unscale_`` makes it:
    ``grad_scale.double().reciprocal().float()`` (a 0-dim fp32 tensor on the scale's device)."""
    return grad_scale.double().reciprocal().float()


def unscaled(g: torch.Tensor, mult: torch.Tensor | float | None) -> torch.Tensor:
    """``g`` as the step sees it in fp32 (float64 for float64): ``float(g) * mult`` rounded to ``g``'s dtype and back,
    as ``GradScaler.unscale_`` stores it; ``float(g)`` for ``mult`` None.
    """
    wide = g.dtype in (torch.float32, torch.float64)
    g32 = g if wide else g.float()
    if mult is None:
        return g32
    g32 = g32 * mult
    return g32 if wide else g32.to(g.dtype).float()


def update_of(algorithm: Algorithm, it: Item, step: int) -> Update:
    """The :class:`~lowmemopt.work.items.Update` of full-rank ``it``'s bucket at ``step``, from ``it.record.hyper``."""
    record = it.record
    hyper = record.hyper
    return Update(
        algorithm.fused or "",
        algorithm.math_kwargs(hyper, step),
        record,
        algorithm.decay_factor(hyper),
        step,
        record.block_size,
    )


@dataclass
class StepRecord:
    """What steps tell their optimizer (``owner``: its class name, for warnings): GaLore basis refreshes whose SVD
    failed (the previous basis kept), and whether that was warned about (once per optimizer)."""

    owner: str = "optimizer"
    galore_refresh_failures: int = 0
    galore_refresh_warned: bool = False


@dataclass
class StepOutcome:
    """What a run leaves its optimizer to settle: skips now, a :class:`~.finite.PendingSkip`, a device count."""

    skipped: int = 0
    pending: Any = None
    device_skipped: torch.Tensor | None = None


class ProjectionStage(Protocol):
    """The projection stage of a step: what the pipeline asks of a param group with ``rank`` (GaLore's:
    :class:`lowmemopt.projection.stage.GaLoreStage`; the order of calls: docs/galore.md).
    """

    def check_group_values(self, plan: Plan, group: dict[str, Any], owner: str) -> None:
        """Raise ValueError / TypeError, naming the group, if a GaLore key of ``group`` holds a value it does not
        take (set after the group was added); before the step writes anything."""

    def group_values_valid(self, group: dict[str, Any]) -> bool:
        """Does ``group`` pass :meth:`check_group_values`? (A kept program asks when a value changed.)"""

    def check_low_rank_state(
        self, plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], owner: str
    ) -> None:
        """Raise ValueError unless the low-rank ``state`` of ``p`` fits its shape and its group's rank."""

    def takes_fused(self, plan: Plan) -> bool:
        """May the fused kernels step this plan's projected items (on low-rank stand-ins)?"""

    def device_may_check(
        self,
        plan: Plan,
        p: torch.Tensor,
        group: dict[str, Any],
        state: dict[str, Any],
        memo: dict[Any, bool] | None = None,
    ) -> bool:
        """May this step of ``p`` leave its non-finite check to the device (every stage that writes reads the
        flags; no basis refresh due)? ``memo``: the caller's answers per device and dtype for one step."""

    def gather(
        self,
        plan: Plan,
        p: torch.Tensor,
        grad: torch.Tensor,
        group: dict[str, Any],
        inner: dict[int, Any] | None = None,
    ) -> Item | None:
        """``p``'s item (state made, basis refreshed when due, gradient unprojected); None: skipped or counted only."""

    def regather(self, plan: Plan, items: list[Item], grads: list[torch.Tensor]) -> None:
        """The gather of a later step for ``items`` that :meth:`gather` made (kept by a step program): this step's
        gradients ``grads`` (in the items' order) and inner groups."""

    def refresh_due(self, states: list[dict[str, Any]]) -> bool:
        """Is a basis refresh due at this step for any of these states?"""

    def project_gradients(self, items: list[Item], layout: Any = None) -> Any:
        """Each item's gradient projected to its low-rank shape (``it.grad``); returns the layout, which a later
        call with the same items takes back."""

    def runs_on_stand_in(self, plan: Plan, it: Item) -> bool:
        """Does ``it``'s update run on a zeroed low-rank stand-in (else the reference core steps it alone)?"""

    def make_stand_ins(self, items: list[Item], layout: Any = None) -> Any:
        """Zeroed low-rank stand-ins as the items' targets; returns the layout (as :meth:`project_gradients`)."""

    def weight_statistics(self, plan: Plan, items: list[Item]) -> None:
        """The full weights' statistics the math reads on a stand-in (``it.weight``) and the decay it applies."""

    def update_per_tensor(self, plan: Plan, it: Item) -> bool:
        """Step ``it`` through the per-tensor backends. True: its stand-in holds the low-rank update, which
        :meth:`apply_back` applies; False: the reference core stepped it and applied the update."""

    def apply_back(
        self,
        plan: Plan,
        items: list[Item],
        flags: torch.Tensor | None = None,
        layout: Any = None,
        projected: Any = None,
        stand: Any = None,
    ) -> Any:
        """``p <- p * decay + scale * project_back(target)`` for stand-in items; returns the layout."""

    def release_buffers(self, project_layout: Any, stand_in_layout: Any) -> None:
        """Give back the memory of a step's low-rank gradients and stand-ins (their layouts stay)."""

    def step_one(self, plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """One projected step of ``p``, alone, through the per-tensor backends (the eager reference)."""


class ReductionStage(Protocol):
    """The sharded reductions of a step: runs a bucket's per-parameter steps so that their whole-tensor reductions
    go out together, with the results of calling them one by one (:class:`lowmemopt.distributed.rounds.ReductionRounds`;
    docs/distributed.md#batched-reductions)."""

    def run(self, steps: Sequence[Callable[[], Any]]) -> list[Any]:
        """Call every step and return their results in order (the first error raised)."""


@dataclass(eq=False)
class Plan:
    """One step's plan: the algorithm, its ``state`` and param ``groups``, the fused ``kernels`` (None: reference
    backends only), the projection stage ``galore``, the loss scaling ``grad_mult`` and ``found_inf``, the
    ``communicate`` stage, the sharded ``reductions`` stage.
    """

    algorithm: Algorithm
    state: dict[torch.Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]
    kernels: KernelSet | None
    record: StepRecord = field(default_factory=StepRecord)
    galore: ProjectionStage | None = None
    grad_mult: torch.Tensor | None = None
    found_inf: torch.Tensor | None = None
    communicate: Any = None
    #: the sharded reductions' stage (None: each sharded parameter's reductions go out as its step makes them)
    reductions: ReductionStage | None = None
    # -- how this run steps: set by the entry (step(), the per-layer hook), read by pipeline.run --------------------
    #: the (param, group) pairs with gradients this run steps, in the step's order
    work: list = field(default_factory=list)
    #: a parameter or gradient of ``work`` is a DTensor (set by the run): the stages step local shards
    sharded: bool = False
    #: a capturable step (:mod:`lowmemopt.work.capture`): everything through the kernels, nothing read back
    capturable: bool = False
    #: per-layer updates: the gradients are known to be finite, or ``flags`` (a
    #: :class:`~lowmemopt.pipeline.finite.DeviceFlags`) holds their finiteness on the device
    finite_known: bool = False
    flags: Any = None
    #: decide the non-finite check on the device where the kernels allow it (False: on the host, before the step)
    defer_finite: bool = True
    #: the paging manager (None: nothing paged) and the function that makes a parameter's first state for it
    pager: Any = None
    first_state: Any = None
    #: the launch tables kept from the last steps (a :class:`~lowmemopt.pipeline.program.StepProgram`): a cache the
    #: run uses while it still applies; the run leaves here the program to keep (None: none)
    program: Any = None
    #: where the step keeps its buckets when the kernels took it whole, for a
    #: :class:`~lowmemopt.pipeline.program.StepProgram` (a :class:`~lowmemopt.pipeline.program.Kept`, filled by
    #: :func:`lowmemopt.pipeline.step_buckets`); None: not asked
    keep: Any = None
    _mults: dict = field(default_factory=dict)
    _records: dict = field(default_factory=dict)
    _last: tuple = (None, None)  # the last (group, record) asked for: the next parameter's, mostly
    _updates: dict = field(default_factory=dict)  # (id(record), step) -> its Update (update_of)
    _slots: dict = field(default_factory=dict)  # (id(record), shape, dtype) -> the algorithm's slots (slots_of)
    _layouts: dict = field(default_factory=dict)  # (id(record), shape, dtype, numel) -> stored sizes (.fits)

    @property
    def fused(self) -> str | None:
        """The name of the algorithm's fused kernels (:attr:`kernels`), or None."""
        kernels = self.kernels
        return None if kernels is None else kernels.name

    def record_of(self, group: dict[str, Any]) -> BucketRecord:
        """The options of ``group`` (a param group, or a stage's per-step view of one) for this step, resolved at its
        first item (:class:`~lowmemopt.work.record.BucketRecord`); the stages and backends read them there."""
        last = self._last
        if last[0] is group:
            return last[1]
        made = self._records.get(id(group))
        if made is None or made[0] is not group:  # (the group is kept: its id is not reused within the step)
            made = self._records[id(group)] = (group, BucketRecord.of(group))
        self._last = made
        return made[1]

    def slots_of(self, record: BucketRecord, p: torch.Tensor) -> dict[str, Any]:
        """The algorithm's slots for ``p`` in ``record``'s bucket, once per bucket, shape and dtype (read-only)."""
        key = (id(record), p.shape, p.dtype)
        slots = self._slots.get(key)
        if slots is None:
            slots = self._slots[key] = self.algorithm.slots(record.hyper, p)
        return slots

    def update_of(self, it: Item, step: int) -> Update:
        """:func:`update_of` of ``it`` at ``step``, made once per bucket (record) and step count in this step."""
        key = (id(it.record), step)
        up = self._updates.get(key)
        if up is None:
            up = self._updates[key] = update_of(self.algorithm, it, step)
        return up

    def mult(self, device: torch.device) -> torch.Tensor | None:
        """``grad_mult`` on ``device`` (a non-blocking copy, made once per step and device), or None."""
        m = self.grad_mult
        if m is None or m.device == device:
            return m
        out = self._mults.get(device)
        if out is None:
            out = self._mults[device] = m.to(device, non_blocking=True)
        return out
