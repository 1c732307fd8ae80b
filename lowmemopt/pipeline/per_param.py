"""The per-parameter path (docs/pipeline.md): one parameter through the stages with the per-tensor backends (native
C on the CPU, ``torch.compile``, the eager reference; GaLore through its projection stage). It takes what no bucketed
backend takes, and it is the eager reference that every combination is tested against.

The gather stage makes the parameter an :class:`~lowmemopt.work.items.Item` (its local shard, state made on the
first step, its record), :meth:`.plan.Plan.update_of` its bucket's :class:`~lowmemopt.work.items.Update` from the
record's ``hyper``, and the update stage hands both to :func:`.backends.step_per_tensor`, as the Triton backend takes
them. Parameters whose native factored step is also their gradient's check go as one bucket (:func:`step_checked`);
sharded parameters whose math reduces over their shards go as buckets whose reductions are batched
(:func:`step_batched`)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .. import rounding
from ..cpu import factored
from ..distributed.sharding import is_dtensor, local_view
from ..work import Item, capture
from ..work.items import LOW_RANK
from ..work.record import BucketRecord
from .backends import init_state, step_per_tensor
from .plan import Plan

__all__ = [
    "REDUCTION_BUCKET_NUMEL",
    "REDUCTION_BUCKET_STEPS",
    "BATCHED_DEVICES",
    "batches_reductions",
    "checks_itself",
    "step_batched",
    "step_checked",
    "step_param",
]

Todo = list[tuple[int, torch.Tensor, dict[str, Any]]]

#: a bucket of sharded parameters whose reductions go out together holds at most this many elements per rank (its
#: steps' decoded state and temporaries are alive at once) and this many parameters (a thread each)
REDUCTION_BUCKET_NUMEL = 1 << 24
REDUCTION_BUCKET_STEPS = 256
#: device types whose sharded steps batch their reductions: the CPU's (gloo: each blocking all-reduce a network round
#: trip). CUDA's stay per parameter until measured there: the rounds' thread switches cost host time (measured on the
#: CPU: docs/distributed.md#batched-reductions) that an NCCL launch may not
BATCHED_DEVICES: tuple[str, ...] = ("cpu",)


def step_param(
    plan: Plan,
    p: torch.Tensor,
    grad: torch.Tensor,
    group: dict[str, Any],
    scan: torch.Tensor | None = None,
    check: bool = False,
) -> bool | None:
    """Step one parameter through the per-tensor backends (:func:`.backends.step_per_tensor`; GaLore:
    :meth:`~.plan.ProjectionStage.step_one`). ``scan``: another gradient that a native CPU kernel checks
    for NaN/Inf while it steps this one; returns that check's result (None: not done). ``check``
    (a parameter :func:`step_checked`'s native step does not take): the eager step checks ``grad`` first
    (:func:`.backends.update_checked`); returns whether it was finite (False: nothing changed, the step count
    included)."""
    state = plan.state[p]
    record = plan.record_of(group)
    if record.rank is not None or LOW_RANK in state:
        plan.galore.step_one(plan, p, grad, group)
        return None
    it, local = _gather(plan, p, grad, group, record)
    mult = None if plan.grad_mult is None else plan.mult  # loss scaling: applied as g is loaded
    result = step_per_tensor(plan.algorithm, (it,), plan.update_of, mult, None if scan is None else (scan,), check)[0]
    if check and not result:
        it.state["step"] -= 1
    if it.target is not local:
        local.copy_(it.target)
    return result


def _gather(
    plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], record: BucketRecord
) -> tuple[Item, torch.Tensor]:
    """The gather stage of a full-rank parameter: its item (state made, step count advanced) and its local shard."""
    state = plan.state[p]
    numel = p.numel()  # a DTensor's whole size: it picks the state format
    local, grad, reduce = local_view(p, grad)  # a DTensor steps its local shard; plain tensors pass through
    slots = plan.slots_of(record, local)
    if "step" not in state:
        state = init_state(local, record, slots, state, numel=numel, reduce=reduce)
    else:  # bf16_update changed since: its state made for the whole tensor (a shard's ranks agree on a seed)
        rounding.init_state(state, local, record.rounding, reduce.agree)
    capture.host_count(state)  # (a capturable step's count: back to an int)
    state["step"] += 1
    target = local if local.is_contiguous() else local.contiguous()
    it = Item(param=p, group=group, target=target, grad=grad, state=state, slots=slots, record=record, reduce=reduce)
    return it, local


def batches_reductions(plan: Plan, p: torch.Tensor, record: BucketRecord) -> bool:
    """May ``p`` (``record``: its bucket's) step in a bucket whose reductions are batched (:func:`step_batched`)? A
    full-rank DTensor parameter, on a device of :data:`BATCHED_DEVICES`, of an algorithm that declares
    :attr:`~.algorithm.Algorithm.batched_reductions`."""
    return (
        plan.reductions is not None
        and plan.algorithm.batched_reductions
        and record.rank is None
        and is_dtensor(p)
        and p.device.type in BATCHED_DEVICES
        and LOW_RANK not in plan.state[p]
    )


def step_batched(plan: Plan, todo: Todo, k: int, finite: list[bool | None]) -> int:
    """Step ``todo[k]`` and the finite parameters after it that :func:`batches_reductions` takes, up to
    :data:`REDUCTION_BUCKET_NUMEL` elements per rank and :data:`REDUCTION_BUCKET_STEPS` parameters, as one bucket whose
    whole-tensor reductions go out together (``plan.reductions``); returns the index after them. The results are
    those of :func:`step_param` on each in turn (docs/distributed.md#batched-reductions)."""
    run: Todo = []
    numel = 0
    for i, p, group in todo[k:]:
        size = p.numel() // p.device_mesh.size()  # (the same on every rank: the buckets must be the same)
        if run and (
            not finite[i]
            or len(run) >= REDUCTION_BUCKET_STEPS
            or numel + size > REDUCTION_BUCKET_NUMEL
            or not batches_reductions(plan, p, plan.record_of(group))
        ):
            break
        run.append((i, p, group))
        numel += size
    if len(run) == 1:
        _, p, group = run[0]
        step_param(plan, p, p.grad, group)
        return k + 1
    gathered = [_gather(plan, p, p.grad, group, plan.record_of(group)) for _, p, group in run]
    mult = None if plan.grad_mult is None else plan.mult
    algorithm, update_of = plan.algorithm, plan.update_of
    plan.reductions.run([partial(step_per_tensor, algorithm, (it,), update_of, mult) for it, _ in gathered])
    for it, local in gathered:
        if it.target is not local:
            local.copy_(it.target)
    return k + len(run)


def checks_itself(plan: Plan, p: torch.Tensor, record: BucketRecord) -> bool:
    """Can ``p``'s step (``record``: its bucket's), in a plan whose native factored step can be its gradients'
    non-finite check, be its gradient's check (state made, full rank)?"""
    state = plan.state[p]
    return record.rank is None and "step" in state and LOW_RANK not in state


def step_checked(plan: Plan, todo: Todo, k: int, finite: list[bool | None]) -> int:
    """Step ``todo[k]`` and the parameters after it whose steps check their own gradients (:func:`checks_itself`,
    ``finite[i]`` None: plain CPU tensors left to the pipelined check) with the plan's native factored step, as one
    bucket (:func:`lowmemopt.cpu.factored.step_bucket`), in order; one it does not take goes through
    :func:`step_param` in its place. Fills in ``finite``; returns the index after them."""
    states = plan.state
    run: Todo = []
    items: list[Item] = []
    seen = record = None
    for i, p, group in todo[k:]:
        if group is not seen:  # (the record once per group)
            seen, record = group, plan.record_of(group)
        if run and (finite[i] is not None or not checks_itself(plan, p, record)):
            break
        state = states[p]
        if not isinstance(state["step"], int):
            capture.host_count(state)  # (a capturable step's count: back to an int)
        target = p if p.is_contiguous() else p.contiguous()
        run.append((i, p, group))
        items.append(Item(p, group, target, p.grad, state, {}, record=record))  # (slots: the state's tensors say)
    mult = None if plan.grad_mult is None else plan.mult(torch.device("cpu")).tolist()
    start = 0
    while start < len(items):
        outcomes = factored.step_bucket(plan.kernels.native, items[start:], plan.update_of, mult)
        for (i, p, _), it, outcome in zip(run[start:], items[start:], outcomes):
            finite[i] = outcome == factored.STEPPED  # (False: nothing was written)
            if finite[i] and it.target is not p:
                p.copy_(it.target)
        start += len(outcomes)
        if start < len(items):  # not taken: the eager step, which checks its gradient first
            i, p, group = run[start]
            finite[i] = step_param(plan, p, p.grad, group, check=True)
            start += 1
    return k + len(items)
