"""GaLore on DTensor parameters sharded by rows (FSDP2's ``Shard(0)``, HSDP's ``(Replicate, Shard(0))``): the basis
from the all-gathered gradient on refresh steps; side right keeps the low-rank state sharded by rows, left and both
replicate it; :class:`SplitReduction` routes the inner math's reductions. The math: docs/distributed.md#galore.
"""

from __future__ import annotations

from typing import Any

import torch

from .reduction import LOCAL, Reduction, ShardedReduction
from .sharding import is_dtensor, local_view

__all__ = ["RowShards", "SplitReduction", "row_shards", "low_rank_layout"]

LEFT, RIGHT, BOTH = 0, 1, 2  # lowmemopt.projection.projector's side codes


def _check_placements(p) -> None:
    for i, placement in enumerate(p.placements):
        if placement.is_replicate() or (placement.is_shard() and placement.dim % p.dim() == 0):
            continue
        raise NotImplementedError(
            f"GaLore on a DTensor parameter {tuple(p.shape)} placed {tuple(p.placements)}: only row sharding "
            "(Shard(0), FSDP2's default) and Replicate are supported; keep this parameter out of the rank group "
            f"(mesh dim {i} is {placement})"
        )


def _local_rows(p) -> tuple[int, int]:
    """(first global row, number of rows) of this rank's shard."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]), int(shape[0])


def low_rank_layout(p, low: tuple[int, int], side: int) -> tuple[tuple[int, int], tuple[int | None, int | None]]:
    """``(local shape, dims)`` of ``p``'s low-rank state (side right sharded by rows)."""
    dims = (0, None) if side == RIGHT else (None, None)
    if not is_dtensor(p) or side != RIGHT:
        return low, dims
    _check_placements(p)
    return (_local_rows(p)[1], low[1]), dims


class SplitReduction(Reduction):
    """A GaLore step's reductions: those of the full-rank ``param`` over its shards, every other one by ``low``."""

    distributed = True

    def __init__(self, param: torch.Tensor, param_reduce: Reduction, low: Reduction) -> None:
        self.param, self.param_reduce, self.low = param, param_reduce, low

    def _of(self, x: torch.Tensor) -> Reduction:
        return self.param_reduce if x is self.param else self.low

    def norm(self, x):
        return self._of(x).norm(x)

    def norm_along(self, x, dim, pdim, keepdim=False):
        return self._of(x).norm_along(x, dim, pdim, keepdim)

    def mean(self, x, dim, pdim, keepdim=False):
        return self._of(x).mean(x, dim, pdim, keepdim)

    def size(self, x, dim, pdim):
        return self._of(x).size(x, dim, pdim)

    def numel(self, x):
        return self._of(x).numel(x)


class RowShards:
    """One GaLore step's view of a row-sharded DTensor parameter."""

    def __init__(self, p, grad, m: int, n: int, side: int, rank: int) -> None:
        _check_placements(p)
        self.dtensor_grad = grad
        self.param, self.grad, self.param_reduce = local_view(p, grad)
        self.row0, self.m_local = _local_rows(p)
        self.m, self.n, self.side = m, n, side
        k = min(rank, m, n)
        self.rows = ShardedReduction(p.device_mesh, p.placements, torch.Size((m, k)))  # low-rank (m, k), side right

    def full_gradient(self) -> torch.Tensor:
        """The whole gradient as fp32 (m, n) on every rank (an all-gather; refresh steps only)."""
        return self.dtensor_grad.full_tensor().reshape(self.m, self.n).float()

    def project(self, g: torch.Tensor, state: dict[str, Any], bases) -> torch.Tensor:
        """The low-rank gradient of local rows ``g``: local rows for side right, the replicated ``G_low`` otherwise."""
        p, q = bases(state)
        if p is None:
            return torch.matmul(g, q.t())
        low = torch.matmul(p[self.row0 : self.row0 + self.m_local].t(), g)
        self.rows.sum_over(low, 0)
        return low if q is None else low @ q.t()

    def reduction(self, p32: torch.Tensor) -> Reduction:
        """Reductions for the inner math, given the fp32 working copy ``p32`` of the local rows it will be passed."""
        return SplitReduction(p32, self.param_reduce, self.rows if self.side == RIGHT else LOCAL)


def row_shards(p, grad, m: int, n: int, side: int, rank: int) -> RowShards | None:
    """:class:`RowShards` for a DTensor parameter, None for a plain tensor."""
    if not is_dtensor(p):
        return None
    return RowShards(p, grad, m, n, side, rank)
