"""The pipeline's *unproject* and *apply* of one projected parameter (:mod:`.stage`), and the decay rule it shares
with the batched pass (:mod:`.batched`)::

    p <- p * decay + alpha * scale * project_back(delta_low)        (row blocks on the CPU, whole on CUDA)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .. import rounding
from ..pipeline.backends import CHUNK_NUMEL
from ..quant.formats import math_dtype
from . import projector as pj

if TYPE_CHECKING:
    from ..pipeline.plan import Plan
    from ..work.items import Item

__all__ = ["finish"]


def _decay_rows(rows: torch.Tensor, c: Any) -> None:
    """``rows += c * rows`` rounded as the math's ``add_scaled_`` (:mod:`lowmemopt.optim.adafactor`)."""
    if isinstance(c, torch.Tensor):
        rows.addcmul_(rows, c)
    else:
        rows.add_(rows, alpha=c)


def finish(
    plan: Plan, it: Item, delta: torch.Tensor | None = None, alpha: float = 1.0, p32: torch.Tensor | None = None
) -> None:
    """The pipeline's *unproject* and *apply*: ``p <- p * decay + alpha * scale * project_back(delta)`` on the full
    parameter (``delta``: the low-rank update, by default the item's target), in row blocks on the CPU (no
    full-size temporary) and whole on CUDA. ``p32``: the fp32 working copy the reference core already used. The
    stand-in's update (no ``delta``) first takes the decay its math would have applied (``p <- p + c p``,
    :func:`~.update.weight_statistics`); the reference core's math has applied it already."""
    math_decay = it.extra["math_decay"] if delta is None else None
    delta = it.target if delta is None else delta
    group, state, shards = it.extra["outer"], it.state, it.extra["shards"]
    m_local, n, row0, decay = it.extra["m_local"], it.extra["n"], it.extra["row0"], it.extra["decay"]
    local = it.param if shards is None else shards.param
    target = local if local.is_contiguous() else local.contiguous()
    p2d = target.view(m_local, n)
    if p32 is None:
        p32 = p2d.to(math_dtype(p2d.dtype))  # fp32 (float64) params: p itself
    rows = m_local if p32.is_cuda else max(1, CHUNK_NUMEL // max(n, 1))
    scale = group["scale"]
    basis = pj.decoded(state, it.extra["shapes"])  # (proj_bits < 32: decoded once for the row blocks)
    for r0 in range(0, m_local, rows):
        r1 = min(m_local, r0 + rows)
        update = pj.project_back_rows(delta, basis, r0, r1, row0, it.extra["dtype"]).to(p32.dtype).mul_(scale)
        if math_decay is not None:
            _decay_rows(p32[r0:r1], math_decay)
        plan.algorithm.apply_update(p32[r0:r1], update, alpha, decay, group)
    # bf16 params: the group's bf16_update (a copy unless fp32); a shard of rows hashes its elements' global indices
    rounding.store(p2d, p32, state, plan.record_of(group).rounding, index=None if shards is None else row0 * n)
    if target is not local:
        local.copy_(target)
