"""GaLore's basis refresh: a new basis from the gradient when one is due (the ``update_proj_gap`` schedule, staggered
or not), the moments carried over by the group's ``proj_moments`` policy."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch

from ..pipeline.plan import Plan
from ..quant.formats import format_of
from . import projector as pj
from . import storage

if TYPE_CHECKING:
    from ..quant.formats import Slot

__all__ = ["refresh_basis", "refresh_due"]


def _stagger_offset(plan: Plan, p: torch.Tensor, gap: int) -> int:
    """``floor(i * gap / N)`` for the i-th of the N projected parameters (in param-group order)."""
    projected = [q for g in plan.groups if g.get("rank") is not None for q in g["params"]]
    i = next(i for i, q in enumerate(projected) if q is p)
    return i * gap // len(projected)


def refresh_basis(
    plan: Plan, p: torch.Tensor, g: torch.Tensor, state: dict, slots: dict[str, Slot], group: dict[str, Any], t: int
) -> bool:
    """Recompute the basis from the fp32 matrix ``g`` at step ``t`` (before increment). Returns False if the
    parameter has no usable basis (its first refresh failed): the caller then skips the step."""
    gap = group["update_proj_gap"]
    new = pj.compute_basis(g, group["rank"], state[pj.SIDE], group["proj_svd"], seed=t)
    had_basis = state[pj.REFRESHED_AT] >= 0
    if new is None:
        plan.record.galore_refresh_failures += 1
        pj.warn_refresh_failed(plan.record, f"a parameter of shape {tuple(p.shape)} at step {t}")
        if not had_basis:
            return False
        state[pj.NEXT_REFRESH] = t + gap
        return True
    bits = group.get("proj_bits", 32)
    if had_basis and group["proj_moments"] != "keep":  # into the new basis as stored (rounded at proj_bits < 32)
        m, n = pj.matrix_shape(p.shape)
        old = pj.decoded(state, pj.basis_shapes(m, n, group["rank"], state[pj.SIDE]))
        _carry_moments(state, old, slots, group, {k: storage.round_trip(v, bits) for k, v in new.items()})
    for key, value in new.items():
        storage.encode_basis(state, key, value)
    if not had_basis and group["proj_stagger"]:
        offset = _stagger_offset(plan, p, gap)
        state[pj.NEXT_REFRESH] = t + (offset if offset > 0 else gap)
    else:
        state[pj.NEXT_REFRESH] = t + gap
    state[pj.REFRESHED_AT] = t
    return True


def _carry_moments(
    state: dict, old: dict, slots: dict[str, Slot], group: dict[str, Any], new: dict[str, torch.Tensor]
) -> None:
    """Apply the ``proj_moments`` policy ("reset" or "project") before the basis changes from ``old`` (the state's
    projector with fp32 bases: :func:`~.projector.decoded`) to ``new``."""
    bs = group["block_size"]
    if group["proj_moments"] == "reset":
        for name in slots:
            for key in format_of(state, name).keys(name):
                state[key].zero_()
        return
    left, right = pj.change_of_basis(old, dict(new, **{pj.SIDE: state[pj.SIDE]}))
    for name, slot in slots.items():
        if not slot.signed:
            continue  # non-negative statistics have no linear change of basis
        fmt = format_of(state, name)
        numel = math.prod(slot.shape)
        m = fmt.decode(state, name, 0, numel, True, bs).view(slot.shape)
        if left is not None:
            m = left.to(m.dtype) @ m  # (a float64 parameter's state: the fp32 bases widened)
        if right is not None:
            m = m @ right.to(m.dtype)
        fmt.encode(state, name, 0, numel, m.reshape(-1).contiguous(), True, bs)


def refresh_due(states: list[dict[str, Any]]) -> bool:
    """Is a basis refresh due at this step for any of these projected parameters' states?"""
    return any(map(operator.ge, map(_step_of, states), map(_next_refresh_of, states)))


_step_of, _next_refresh_of = operator.itemgetter("step"), operator.itemgetter(pj.NEXT_REFRESH)
