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

__all__ = ["param_free", "takes_fused", "runs_on_stand_in", "weight_statistics", "device_may_check",
           "update_per_tensor", "native_takes_stand_in"]


def param_free(plan: Plan) -> bool:
    """Can the inner algorithm run on a zeroed stand-in for the parameter (the low-rank update then lands in it)?
    True for a fused algorithm (``plan.fused``) whose math reads the parameter only for a coupled weight decay,
    which :func:`~.gather.inner_group` takes out (``param_free_math``: AdamW / Adam, SGD, Lion).
    Algorithms that read statistics of the full parameter (LAMB's and LARS's ``||p||``, Adafactor's ``RMS(p)``) or
    decay it inside their math (Adafactor, CAME) take the reference core instead."""
    return plan.algorithm.param_free_math and plan.fused is not None


def takes_fused(plan: Plan) -> bool:
    """Can the inner algorithm run on a stand-in through the fused kernels? :func:`param_free` algorithms through
    every backend; ``weight_stat_math`` ones (LAMB, LARS, Adafactor, CAME), given the full weight's statistic
    (:func:`weight_statistics`), through the kernels that take it: Triton, and the native CPU kernels of Adafactor
    and CAME (the per-tensor eager path would read the stand-in: those take the reference core)."""
    return (plan.algorithm.param_free_math or plan.algorithm.weight_stat_math) and plan.fused is not None


def runs_on_stand_in(plan: Plan, it: Item) -> bool:
    """Does this item's update run on a stand-in (:func:`takes_fused`)? Not a row shard of a DTensor whose math reads
    the weight (its statistics would need reductions over the shards): that one takes the reference core."""
    return param_free(plan) or (takes_fused(plan) and it.extra["shards"] is None)


def weight_statistics(plan: Plan, items: list[Item]) -> None:
    """For an algorithm whose math reads the weight (``weight_stat_math``): each stand-in's full-weight statistic
    (``it.weight``: ``||p||`` or ``RMS(p) = ||p|| / sqrt(numel)``, :meth:`~lowmemopt.pipeline.algorithm.Algorithm.weight_statistic`)
    and the decay its math applies to the weight (``extra["math_decay"]``: ``c`` of ``p <- p + c p``), per shape class
    of a param group: one multi-tensor norm (``torch._foreach_norm``: one launch on CUDA; on the CPU the reference's
    ``vector_norm`` per tensor, so the statistic is bit-identical to the reference core's), one stack, one division."""
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


def device_may_check(plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any],
                     memo: dict[Any, bool] | None = None) -> bool:
    """May this step of projected parameter ``p`` leave its non-finite check to the device
    (:mod:`lowmemopt.pipeline.finite`)? Where every stage that writes is masked by the flags: no basis refresh due
    (it would take the SVD of the gradient), the update on a stand-in through the kernels, and the apply through the
    batched fused pass (:func:`~.batched.finish_many`). Elsewhere the host decides first. ``memo``: the answers that
    depend on the plan, device and dtype only, kept by the caller for the parameters of one step."""
    if not ("step" in state and state[pj.REFRESHED_AT] >= 0 and state["step"] < state[pj.NEXT_REFRESH]
            and finished_in_batches(p, state, plan.record_of(group).rounding)):
        return False
    key = (p.device, p.dtype)
    ok = None if memo is None else memo.get(key)
    if ok is None:
        ok = takes_fused(plan) and fused_apply(p.device, p.dtype)
        if memo is not None:
            memo[key] = ok
    return ok


def update_per_tensor(plan: Plan, it: Item) -> bool:
    """The update stage of one projected item (after :func:`~.batched.project`) through the per-tensor backends.
    With a stand-in (:func:`runs_on_stand_in`): the backends of :func:`~lowmemopt.pipeline.backends.update_flat` for
    a :func:`param_free` algorithm, the native factored CPU kernels (:func:`lowmemopt.cpu.step_factored`, given the
    weight's statistic) for the others; returns True, and :func:`~.apply.finish` then applies the stand-in's update.
    Else the reference core steps the item and finishes it (the math sees the full-rank fp32 parameter): False."""
    state = it.state
    if it.target is not None and param_free(plan):
        state["step"] += 1
        update_flat(plan.algorithm, it.target, it.target.view(-1), it.grad.view(-1), state, it.slots, it.record,
                               state["step"], 1.0)
        return True
    if it.target is not None and it.target.device.type == "cpu" and cpu.ENABLED:
        formats = {name: format_of(state, name) for name in it.slots}
        t = state["step"] + 1
        native = None if plan.kernels is None else plan.kernels.native
        if cpu.step_factored(native, it.target, it.target.view(-1), it.grad.view(-1), state,
                             formats, it.record, t, 1.0, weight=it.weight):
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
    delta, alpha = run_update(plan.algorithm, p32, g_low, state, it.slots, formats, plan.record_of(it.extra["core"]),
                              state["step"], 0,
                                         g_low.numel(), g_low, reduce)
    finish(plan, it, delta, alpha, p32)
    return False


def native_takes_stand_in(plan: Plan, it: Item) -> bool:
    """Is there a native CPU kernel for this stand-in's algorithm (Adafactor, CAME; it still checks the shape)?"""
    if it.grad.device.type != "cpu" or not cpu.ENABLED:
        return False
    from ..cpu.factored import FactoredStep

    return plan.kernels is not None and isinstance(plan.kernels.native, FactoredStep)

