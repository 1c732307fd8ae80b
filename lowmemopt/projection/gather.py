"""GaLore's gather: a projected parameter as an :class:`~lowmemopt.work.items.Item` (state made, basis refreshed when
due, gradient as a matrix), its inner groups and product dtype; and the re-gather of a kept step program."""

from __future__ import annotations

from typing import Any

import torch

from .. import rounding
from ..distributed.galore import row_shards
from ..pipeline.plan import Plan, unscaled
from ..work.items import Item
from . import projector as pj
from . import storage
from .checks import GROUP_DEFAULTS
from .refresh import refresh_basis
from .state import init_projected_state, projected_slots

__all__ = ["proj_dtype", "inner_group", "gather", "regather"]


def proj_dtype(group: dict[str, Any], p: torch.Tensor) -> torch.dtype | None:
    """The dtype of ``p``'s projection products: bf16 for a bf16 parameter with ``proj_dtype="param"``, float64 for
    float64, else None (fp32). See docs/galore.md ("GaLore's projection products").
    """
    if p.dtype == torch.float64:
        return torch.float64
    if group.get("proj_dtype", GROUP_DEFAULTS["proj_dtype"]) == "param" and p.dtype == torch.bfloat16:
        return torch.bfloat16
    return None


def inner_group(plan: Plan, group: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """``(inner group, decay factor)``: a coupled decay is taken out of the inner math and applied as ``1 - lr wd``."""
    if group.get("weight_decay") and plan.algorithm.coupled_weight_decay(group):
        return dict(group, weight_decay=0.0), 1.0 - group["lr"] * group["weight_decay"]
    return group, plan.algorithm.decay_factor(group)


def gather(
    plan: Plan,
    p: torch.Tensor,
    grad: torch.Tensor,
    group: dict[str, Any],
    inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]] | None = None,
) -> Item | None:
    """The pipeline's *gather* for a GaLore parameter: its state (made on the first step), the basis refreshed when due,
    and an :class:`~lowmemopt.work.items.Item` with its gradient not yet projected. None: no basis yet (skipped) or zero
    size (counted). ``inner``: the inner groups by group id, so one param group's items share a bucket.
    """
    state = plan.state[p]
    if group.get("rank") is None:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} has GaLore (low-rank) state but its param group has no 'rank'; "
            "keep the group's GaLore keys, or reset this parameter's state"
        )
    slots = projected_slots(plan, group, p)
    m, n = pj.matrix_shape(p.shape)
    if "step" not in state:
        if state:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has full-rank optimizer state but its param group has "
                f"rank={group['rank']}; reset this parameter's state to project it"
            )
        init_projected_state(plan, p, group, slots)
    if p.numel() == 0:  # nothing to project or update, as for a plain zero-size parameter: the step counts; (the
        state["step"] += 1  # inner math's row / column means over an empty side would store NaN statistics)
        return None

    shapes = pj.basis_shapes(m, n, group["rank"], state[pj.SIDE])
    bits = group.get("proj_bits", 32)
    if not storage.stored_at(state, pj.PROJ, bits):  # proj_bits changed since the basis was stored
        storage.store_at(state, shapes, bits)
    shards = row_shards(p, grad, m, n, state[pj.SIDE], group["rank"])  # a DTensor: its rows (distributed.galore)
    if shards is not None:  # bf16_update changed since: the ranks make the seed together
        rounding.init_state(state, shards.param, plan.record_of(group).rounding, shards.param_reduce.agree)
    m_local, row0 = (m, 0) if shards is None else (shards.m_local, shards.row0)
    g = _matrix(plan, grad if shards is None else shards.grad, m_local, n)  # in its dtype: project() makes it fp32
    t = state["step"]
    if t >= state[pj.NEXT_REFRESH]:
        full = g.float() if shards is None else shards.full_gradient()  # the basis comes from the whole gradient
        if not refresh_basis(plan, p, full, state, slots, group, t):
            return None  # no basis yet: skip this step, as for a non-finite gradient
        del full
    if inner is None:
        inner = {}
    group_in, core, decay = _inner(plan, group, inner)
    return Item(
        param=p,
        group=group_in,
        record=plan.record_of(group_in),
        target=None,
        grad=None,
        state=state,
        slots=slots,
        projected=True,
        extra=dict(
            g=g,
            shards=shards,
            m_local=m_local,
            n=n,
            row0=row0,
            decay=decay,
            outer=group,
            core=core,
            math_decay=None,
            dtype=None if shards is not None else proj_dtype(group, p),
            shapes=shapes,
        ),
    )


def _matrix(plan: Plan, g: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Gradient ``g`` as the ``(m, n)`` matrix the projection reads, in its dtype; under loss scaling the gradient
    ``unscale_`` would leave (once per step)."""
    if plan.grad_mult is not None:
        g = unscaled(g, plan.mult(g.device)).to(g.dtype)
    return g if g.shape == (m, n) else g.reshape(m, n)


def _inner(
    plan: Plan, group: dict[str, Any], inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]]
) -> tuple[dict[str, Any], dict[str, Any], float]:
    """``(stand-in's group, reference core's group, decay factor)`` of a GaLore group, once per step in ``inner``."""
    made = inner.get(id(group))
    if made is None:
        core, decay = inner_group(plan, group)
        group_in = (
            dict(core, weight_decay=0.0) if plan.algorithm.weight_stat_math and core.get("weight_decay") else core
        )
        made = inner[id(group)] = group_in, core, decay
    return made


def regather(plan: Plan, items: list[Item], grads: list[torch.Tensor]) -> None:
    """A kept step program's gather for ``items`` that :func:`gather` made: this step's gradients and inner groups."""
    inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]] = {}
    outer = group_in = core = decay = record = None
    for it, g in zip(items, grads):
        extra = it.extra
        if extra["outer"] is not outer:  # (the group's inner group and record: once per run of its items)
            outer = extra["outer"]
            group_in, core, decay = _inner(plan, outer, inner)
            record = plan.record_of(group_in)
        it.group, it.record, it.target, it.grad, it.weight = group_in, record, None, None, None
        extra["g"] = _matrix(plan, g, extra["m_local"], extra["n"])
        extra["core"], extra["decay"], extra["math_decay"] = core, decay, None
