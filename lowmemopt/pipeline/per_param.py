"""The per-parameter path (docs/pipeline.md): one parameter through the stages with the per-tensor backends (native
C on the CPU, ``torch.compile``, the eager reference; GaLore through its projection stage). It takes what no bucketed
backend takes, and it is the eager reference that every combination is tested against.

The gather stage makes the parameter an :class:`~lowmemopt.work.items.Item` (its local shard, state made on the
first step, its record), :meth:`.plan.Plan.update_of` its bucket's :class:`~lowmemopt.work.items.Update` from the
record's ``hyper``, and the update stage hands both to :func:`.backends.step_per_tensor`, as the Triton backend takes
them."""

from __future__ import annotations

from typing import Any

import torch

from .. import rounding
from ..distributed.sharding import local_view
from ..work import Item, capture
from ..work.items import LOW_RANK
from .backends import init_state, step_per_tensor
from .plan import Plan

__all__ = ["step_param"]


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
    (:func:`checks_itself`): the step checks ``grad`` itself (:func:`.backends.update_checked`); returns whether it
    was finite (False: nothing changed, the step count included)."""
    state = plan.state[p]
    if plan.record_of(group).rank is not None or LOW_RANK in state:
        plan.galore.step_one(plan, p, grad, group)
        return None
    numel = p.numel()  # a DTensor's whole size: it picks the state format
    local, grad, reduce = local_view(p, grad)  # a DTensor steps its local shard; plain tensors pass through
    record = plan.record_of(group)
    slots = plan.slots_of(record, local)
    if "step" not in state:
        state = init_state(local, record, slots, state, numel=numel, reduce=reduce)
    else:  # bf16_update changed since: its state made for the whole tensor (a shard's ranks agree on a seed)
        rounding.init_state(state, local, record.rounding, reduce.agree)
    capture.host_count(state)  # (a capturable step's count: back to an int)
    state["step"] += 1
    target = local if local.is_contiguous() else local.contiguous()
    it = Item(param=p, group=group, target=target, grad=grad, state=state, slots=slots, record=record, reduce=reduce)
    mult = None if plan.grad_mult is None else plan.mult  # loss scaling: applied as g is loaded
    result = step_per_tensor(plan.algorithm, (it,), plan.update_of, mult, None if scan is None else (scan,), check)[0]
    if check and not result:
        state["step"] -= 1
    if target is not local:
        local.copy_(target)
    return result
