"""The per-parameter path (``DESIGN.md`` §1.1): one parameter through the stages with the per-tensor backends (native
C on the CPU, ``torch.compile``, the eager reference; GaLore through its projection stage). It takes what no bucketed
backend takes, and it is the eager reference that every combination is tested against."""

from __future__ import annotations

from typing import Any

import torch

from .. import rounding
from ..distributed.sharding import local_view
from ..work import capture
from .backends import init_state, update_checked, update_flat
from .plan import Plan

__all__ = ["step_param"]


def step_param(plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any],
               scan: torch.Tensor | None = None, check: bool = False) -> bool | None:
    """Step one parameter through the per-tensor backends (:func:`.backends.update_flat`; GaLore:
    :func:`~lowmemopt.projection.step.step_projected`). ``scan``: another gradient that a native CPU kernel checks
    for NaN/Inf while it steps this one; returns that check's result (None: not done). ``check``
    (:func:`checks_itself`): the step checks ``grad`` itself (:func:`.backends.update_checked`); returns whether it
    was finite (False: nothing changed, the step count included)."""
    state = plan.state[p]
    if group.get("rank") is not None or "galore.side" in state:
        plan.galore.step_projected(plan, p, grad, group)
        return None
    numel = p.numel()  # a DTensor's whole size: it picks the state format
    p, grad, reduce = local_view(p, grad)  # a DTensor steps its local shard; plain tensors pass through
    mult = None if plan.grad_mult is None else plan.mult(grad.device)  # loss scaling: applied as g is loaded
    slots = plan.algorithm.slots(group, p)
    record = plan.record_of(group)
    if "step" not in state:
        state = init_state(p, record, slots, state, numel=numel, reduce=reduce)
    elif reduce.distributed:  # bf16_update changed since: the shard's ranks make its seed together
        rounding.init_state(state, p, record.rounding, reduce.agree)
    capture.host_count(state)  # (a capturable step's count: back to an int)
    state["step"] += 1
    target = p if p.is_contiguous() else p.contiguous()
    if check:
        result = update_checked(plan.algorithm, p, target.view(-1), grad.reshape(-1), state, slots, record,
                                state["step"], plan.algorithm.decay_factor(group), mult)
        if not result:
            state["step"] -= 1
    else:
        result = update_flat(plan.algorithm, p, target.view(-1), grad.reshape(-1), state, slots, record,
                             state["step"], plan.algorithm.decay_factor(group), reduce, scan, mult)
    if target is not p:
        p.copy_(target)
    return result
