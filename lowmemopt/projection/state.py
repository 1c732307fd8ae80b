"""GaLore's state set-up: the inner algorithm's slots shaped for a parameter's low-rank gradient, and its first
state (those slots and an empty projector)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..distributed.galore import low_rank_layout
from ..distributed.reduction import LOCAL
from ..distributed.sharding import reduction_of
from ..pipeline.backends import init_state
from ..pipeline.plan import Plan
from . import projector as pj

if TYPE_CHECKING:
    from ..quant.formats import Slot

__all__ = ["projected_slots", "init_projected_state"]


def _side(plan: Plan, group: dict[str, Any], p: torch.Tensor) -> int:
    state = plan.state.get(p)
    if state and pj.SIDE in state:
        return state[pj.SIDE]
    return pj.choose_side(group["proj_type"], *pj.matrix_shape(p.shape))


def projected_slots(plan: Plan, group: dict[str, Any], p: torch.Tensor) -> dict[str, Slot]:
    """The inner algorithm's slots for ``p``'s low-rank gradient, every one with an explicit shape (the algorithm's
    ``_slots`` asked about a tensor of the low-rank shape)."""
    m, n = pj.matrix_shape(p.shape)
    side = _side(plan, group, p)
    low, dims = low_rank_layout(p, pj.low_rank_shape(m, n, group["rank"], side), side)  # a DTensor: its local rows
    slots = plan.algorithm.slots(group, _meta(low, p.dtype))
    return {k: _low_rank_slot(s, low, dims) for k, s in slots.items()}


_METAS: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
_LOW_RANK_SLOTS: dict[tuple, Any] = {}


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of this shape and dtype (no storage: what ``_slots`` is asked about), one per shape and dtype
    (a step asks for every projected matrix; making one costs more than the rest of the question)."""
    t = _METAS.get((shape, dtype))
    if t is None:
        t = _METAS[(shape, dtype)] = torch.empty(shape, dtype=dtype, device="meta")
    return t


def _low_rank_slot(s: Slot, low: tuple[int, ...], dims: tuple[int | None, ...]) -> Slot:
    """Slot ``s`` of the low-rank state: shaped ``low`` if it had the parameter's shape, its dims mapped by ``dims``
    (memoized by value: a few slots x shapes)."""
    key = (s, low, dims)
    try:
        shaped = _LOW_RANK_SLOTS.get(key)
    except TypeError:  # an algorithm's slot with unhashable fields (a list shape): not memoized
        key = shaped = None
    if shaped is None:
        shaped = (
            s._replace(shape=low, dims=dims)
            if s.shape is None
            else s._replace(dims=None if s.dims is None else tuple(None if d is None else dims[d] for d in s.dims))
        )
        if key is not None:
            _LOW_RANK_SLOTS[key] = shaped
    return shaped


def init_projected_state(
    plan: Plan, p: torch.Tensor, group: dict[str, Any], slots: dict[str, Slot] | None = None
) -> dict[str, Any]:
    """Make ``p``'s first GaLore state in ``plan.state[p]``: the inner algorithm's low-rank slots and an empty
    projector (also used, on a meta twin of ``p``, by :mod:`lowmemopt.paging` to learn the layout ahead)."""
    slots = projected_slots(plan, group, p) if slots is None else slots
    m, n = pj.matrix_shape(p.shape)
    # a DTensor's ranks agree on its stochastic-rounding seed (not the paging layout probe's meta twin)
    state = init_state(
        p, plan.record_of(group), slots, plan.state[p], reduce=LOCAL if p.device.type == "meta" else reduction_of(p)
    )
    side = pj.choose_side(group["proj_type"], m, n)
    pj.init_projector(state, m, n, group["rank"], side, p.device, group.get("proj_bits", 32))
    return state
