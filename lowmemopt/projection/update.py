"""GaLore's update stage: which path steps a projected item (a zeroed low-rank stand-in through the fused kernels,
given the full weight's statistics, or the reference core on the full-rank parameter), and the per-tensor step."""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import cpu
from ..distributed.reduction import LOCAL
from ..pipeline.backends import run_update, update_flat
from ..pipeline.plan import Plan
from ..quant.formats import format_of, math_dtype
from ..work.items import Item
from . import projector as pj
from .apply import finish
from .batched import finished_in_batches, fused_apply

__all__ = [
    "param_free",
    "takes_fused",
    "runs_on_stand_in",
    "weight_statistics",
    "device_may_check",
    "update_per_tensor",
    "native_takes_stand_in",
]


def param_free(plan: Plan) -> bool:
    """Can the inner algorithm run on a zeroed stand-in (``param_free_math``: it reads the parameter only for a coupled
    decay)? See docs/galore.md ("How a projected step runs").
    """
    return plan.algorithm.param_free_math and plan.fused is not None


def takes_fused(plan: Plan) -> bool:
    """Can the inner algorithm run on a stand-in through the fused kernels?"""
    return (plan.algorithm.param_free_math or plan.algorithm.weight_stat_math) and plan.fused is not None


def runs_on_stand_in(plan: Plan, it: Item) -> bool:
    """Does this item's update run on a stand-in (:func:`takes_fused`)? Not a row shard of a DTensor whose math reads
    the weight (its statistics would need reductions over the shards): that one takes the reference core."""
    return param_free(plan) or (takes_fused(plan) and it.extra["shards"] is None)


def weight_statistics(plan: Plan, items: list[Item]) -> None:
    """Each stand-in's full-weight statistic (``it.weight``: ``||p||`` or ``RMS(p)``) and its math's decay
    (``extra["math_decay"]``), per shape class: one multi-tensor norm (on the CPU the reference's, bit-identical).
    """
    if not plan.algorithm.weight_stat_math:
        return
    classes: dict[tuple, list[Item]] = {}
    for it in items:
        key = (id(it.extra["outer"]), it.state["step"] + 1, it.param.device, it.param.dtype, it.param.numel())
        classes.setdefault(key, []).append(it)
    for (_, step, _, p_dtype, numel), members in classes.items():
        group = members[0].extra["outer"]
        kind = plan.algorithm.weight_statistic(group)
        stat = None
        if kind is not None:
            stat = torch.stack(torch._foreach_norm([it.param for it in members], 2, dtype=math_dtype(p_dtype)))
            if kind == "rms":
                stat = stat / math.sqrt(numel)  # rms(): the norm over sqrt(numel) rounded to fp32, as for 0-dim
            for it, s in zip(members, stat.unbind(0)):
                it.weight = s
        c = plan.algorithm.math_decay(group, step, stat)
        for i, it in enumerate(members):
            it.extra["math_decay"] = c[i] if isinstance(c, torch.Tensor) and c.dim() else c


def device_may_check(
    plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], memo: dict[Any, bool] | None = None
) -> bool:
    """May projected ``p``'s step leave its non-finite check to the device (no refresh due, stand-in, batched apply)?"""
    if not (
        "step" in state
        and state[pj.REFRESHED_AT] >= 0
        and state["step"] < state[pj.NEXT_REFRESH]
        and finished_in_batches(p, state, plan.record_of(group).rounding)
    ):
        return False
    key = (p.device, p.dtype)
    ok = None if memo is None else memo.get(key)
    if ok is None:
        ok = takes_fused(plan) and fused_apply(p.device, p.dtype)
        if memo is not None:
            memo[key] = ok
    return ok


def update_per_tensor(plan: Plan, it: Item) -> bool:
    """The update stage of one projected item through the per-tensor backends: True where a stand-in took the update
    (then :func:`~.apply.finish`), False where the reference core stepped and finished it.
    """
    state = it.state
    if it.target is not None and param_free(plan):
        state["step"] += 1
        update_flat(
            plan.algorithm,
            it.target,
            it.target.view(-1),
            it.grad.view(-1),
            state,
            it.slots,
            it.record,
            state["step"],
            1.0,
        )
        return True
    if it.target is not None and it.target.device.type == "cpu" and cpu.ENABLED:
        t = state["step"] + 1
        native = None if plan.kernels is None else plan.kernels.native
        if cpu.step_factored(
            native, it.target, it.target.view(-1), it.grad.view(-1), state, it.record, t, 1.0, weight=it.weight
        ):
            state["step"] = t
            return True
    state["step"] += 1
    formats = {name: format_of(state, name) for name in it.slots}
    shards = it.extra["shards"]
    local = it.param if shards is None else shards.param
    p32 = (local if local.is_contiguous() else local.contiguous()).view(it.extra["m_local"], it.extra["n"])
    p32 = p32.to(math_dtype(p32.dtype))
    reduce = LOCAL if shards is None else shards.reduction(p32)
    g_low = it.grad
    delta, alpha = run_update(
        plan.algorithm,
        p32,
        g_low,
        state,
        it.slots,
        formats,
        plan.record_of(it.extra["core"]),
        state["step"],
        0,
        g_low.numel(),
        g_low,
        reduce,
    )
    finish(plan, it, delta, alpha, p32)
    return False


def native_takes_stand_in(plan: Plan, it: Item) -> bool:
    """Is there a native CPU kernel for this stand-in's algorithm (Adafactor, CAME; it still checks the shape)?"""
    if it.grad.device.type != "cpu" or not cpu.ENABLED:
        return False
    from ..cpu.factored import FactoredStep

    return plan.kernels is not None and isinstance(plan.kernels.native, FactoredStep)
