"""Whole-tensor reductions of the optimizer math (LAMB/LARS norms, Adafactor/CAME means and RMS) for tensors a
process may hold a shard of: :data:`LOCAL` is the single-process torch call, bit for bit; :class:`ShardedReduction`
sums local partials over the mesh dims that shard the reduced parameter dims and divides by the global size.
``pdim`` names the parameter dim a tensor's ``dim`` runs along; :func:`all_reduce` is where every sum goes out (in a
step that :class:`~.rounds.ReductionRounds` runs, in its next round). Docs: docs/distributed.md#whole-tensor-reductions.
"""

from __future__ import annotations

import threading
from typing import Sequence

import torch
import torch.distributed as dist

__all__ = ["Reduction", "ShardedReduction", "LOCAL", "is_shard", "contiguous_strides", "all_reduce", "ROUND"]

#: the calling thread's reduction rounds: ``ROUND.rounds`` is set inside the steps a
#: :class:`~.rounds.ReductionRounds` runs (their sums wait for its next round), absent elsewhere
ROUND = threading.local()


def all_reduce(t: torch.Tensor, groups: Sequence, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``t`` all-reduced in place with ``op`` over each of ``groups`` in turn; returns ``t``. Inside a step that
    :class:`~.rounds.ReductionRounds` runs, it waits for the round that reduces every waiting step's tensors at once."""
    rounds = getattr(ROUND, "rounds", None)
    if rounds is not None:
        return rounds.wait(t, tuple(groups), op)
    for group in groups:
        dist.all_reduce(t, op=op, group=group)
    return t


class Reduction:
    """Single process: every reduction is local (the identity of the interface)."""

    distributed = False

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """``||x||_2`` over the whole (global) tensor, 0-dim."""
        return torch.linalg.vector_norm(x)

    def norm_along(self, x: torch.Tensor, dim: int, pdim: int, keepdim: bool = False) -> torch.Tensor:
        """``||x||_2`` along ``dim`` (which runs along parameter dim ``pdim``)."""
        return torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim)

    def mean(self, x: torch.Tensor, dim: int, pdim: int, keepdim: bool = False) -> torch.Tensor:
        """Mean along ``dim`` (which runs along parameter dim ``pdim``) over the global extent of that dim."""
        return x.mean(dim=dim, keepdim=keepdim)

    def size(self, x: torch.Tensor, dim: int, pdim: int) -> int:
        """Global size of ``x``'s dim ``dim`` (parameter dim ``pdim``)."""
        return x.size(dim)

    def numel(self, x: torch.Tensor) -> int:
        """Global number of elements of a parameter-shaped ``x``."""
        return x.numel()

    def total(self, partial: torch.Tensor) -> torch.Tensor:
        """``partial`` (a sum over this process's elements) summed over every process holding part of the parameter."""
        return partial

    def flat_offset(self) -> int | None:
        """The local first element's flat index in the parameter if contiguous there, else None."""
        return 0

    def element_index(self, lo: int, n: int, device: torch.device | str = "cpu") -> int | torch.Tensor:
        """Where local elements ``lo .. lo + n - 1`` sit in the whole parameter."""
        return lo

    def agree(self, value: int) -> int:
        """``value`` made equal on every process holding part or a copy of the parameter (the largest)."""
        return value

    def __repr__(self) -> str:
        return "Reduction(local)"


LOCAL = Reduction()


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous (row-major) tensor of ``shape`` (a 0-size dim counts as 1)."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def is_shard(placement) -> bool:
    """``Shard(d)`` or ``_StridedShard(d, ...)``: parameter dim ``d`` split over the mesh dim (sums alike)."""
    return placement.is_shard() or (type(placement).__name__ == "_StridedShard" and hasattr(placement, "dim"))


class ShardedReduction(Reduction):
    """Reductions over a tensor laid out like a DTensor parameter (``mesh``, ``placements``, ``shape``)."""

    distributed = True

    def __init__(self, mesh, placements: Sequence, shape: torch.Size) -> None:
        self.shape = torch.Size(shape)
        self.mesh, self.placements = mesh, tuple(placements)
        self._box: tuple[list[int], list[int]] | None = None  # (local shape, global offset), made when asked
        ndim = len(self.shape)
        self._by_dim: dict[int, list] = {}  # parameter dim -> the process groups that shard it
        for i, placement in enumerate(placements):
            if is_shard(placement):
                d = placement.dim % ndim
                self._by_dim.setdefault(d, []).append(mesh.get_group(i))
            elif not placement.is_replicate():
                raise ValueError(
                    f"cannot optimize a DTensor parameter with placement {placement} on mesh dim {i}: parameters "
                    "must be Shard or Replicate (a Partial tensor is an unreduced sum)"
                )
        self._all = [g for groups in self._by_dim.values() for g in groups]

    def _groups(self, pdim: int | None) -> list:
        if pdim is None:
            return self._all
        return self._by_dim.get(pdim % len(self.shape), [])

    @staticmethod
    def _sum(t: torch.Tensor, groups: list) -> torch.Tensor:
        return all_reduce(t, groups)

    def sum_over(self, t: torch.Tensor, pdim: int) -> torch.Tensor:
        """All-reduce (sum, in place) a partial sum ``t`` over the process groups that shard parameter dim ``pdim``."""
        return self._sum(t, self._groups(pdim))

    def norm(self, x):
        if not self._all:
            return torch.linalg.vector_norm(x)
        return self._sum(torch.linalg.vector_norm(x).square_(), self._all).sqrt_()

    def norm_along(self, x, dim, pdim, keepdim=False):
        groups = self._groups(pdim)
        if not groups:
            return torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim)
        return self._sum(torch.linalg.vector_norm(x, dim=dim, keepdim=keepdim).square_(), groups).sqrt_()

    def mean(self, x, dim, pdim, keepdim=False):
        groups = self._groups(pdim)
        if not groups:
            return x.mean(dim=dim, keepdim=keepdim)
        return self._sum(x.sum(dim=dim, keepdim=keepdim), groups).div_(self.shape[pdim])

    def size(self, x, dim, pdim):
        return self.shape[pdim]

    def numel(self, x):
        return self.shape.numel()

    def total(self, partial):
        return self._sum(partial, self._all)

    def _local_box(self) -> tuple[list[int], list[int]] | None:
        """(local shape, offset) of this rank's shard; None for a strided shard."""
        if any(type(pl).__name__ == "_StridedShard" for pl in self.placements):
            return None
        if self._box is None:
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            local, offset = compute_local_shape_and_global_offset(self.shape, self.mesh, self.placements)
            self._box = (list(local), list(offset))
        return self._box

    def flat_offset(self):
        box = self._local_box()
        if box is None:
            return None
        local, offset = box
        if 0 in local:
            return 0
        # a box is a contiguous range iff the dims after the first split one are whole and the ones before it single
        split = [d for d in range(len(local)) if local[d] != self.shape[d]]
        if split and (any(local[d] != 1 for d in range(split[0])) or split[1:]):
            return None
        return sum(o * s for o, s in zip(offset, contiguous_strides(self.shape)))

    def element_index(self, lo, n, device="cpu"):
        base = self.flat_offset()
        if base is not None:
            return base + lo
        box = self._local_box()
        if box is None:  # a strided shard: the whole parameter's flat indices, cut as DTensor cuts the parameter
            from torch.distributed.tensor import distribute_tensor

            whole = torch.arange(self.shape.numel(), dtype=torch.int64, device=device).view(self.shape)
            cut = distribute_tensor(whole, self.mesh, self.placements, src_data_rank=None).to_local()
            return cut.reshape(-1)[lo : lo + n]
        local, offset = box
        flat = torch.arange(lo, lo + n, dtype=torch.int64, device=device)
        index = torch.zeros_like(flat)
        for size, off, stride in reversed(list(zip(local, offset, contiguous_strides(self.shape)))):
            index += (flat % size + off) * stride
            flat = flat // size
        return index

    def agree(self, value):
        t = torch.tensor([value], dtype=torch.int64, device=self.mesh.device_type)
        all_reduce(t, [self.mesh.get_group(i) for i in range(self.mesh.ndim)], dist.ReduceOp.MAX)
        return int(t.item())

    def __repr__(self) -> str:
        sharded = {d: [dist.get_world_size(g) for g in gs] for d, gs in self._by_dim.items()}
        return f"ShardedReduction(shape={tuple(self.shape)}, sharded dims -> group sizes {sharded})"
