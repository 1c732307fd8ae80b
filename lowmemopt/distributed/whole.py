"""Functions of whole matrices on sharded parameters (Muon's orthogonalization under FSDP2, after microsoft/dion):
:func:`map_whole` deals the matrices over the ranks of the sharding mesh dim, gathers each on its rank, runs ``fn``
once per rank and scatters the results back; 2-D sharding and ``_StridedShard`` (FSDP2 over tensor parallelism)
gather everything everywhere. Docs: docs/muon.md.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from .reduction import Reduction, contiguous_strides, is_shard

__all__ = ["map_whole", "row_block", "shard_sizes", "whole_tensor"]

Fn = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def shard_sizes(n: int, world: int) -> list[int]:
    """The sizes of the ``world`` slices ``Shard`` cuts ``n`` into (``torch.chunk``'s)."""
    from torch.distributed.tensor import Shard

    return [Shard.local_shard_size_and_offset(n, world, r)[0] for r in range(world)]


def map_whole(
    parts: Sequence[torch.Tensor], reduce: Reduction, fn: Fn, dtype: torch.dtype, first: int = 0
) -> list[torch.Tensor]:
    """``fn`` applied to the whole matrices whose local parts are ``parts``, returned as the results' local parts.

    Args:
        reduce: the parameter's layout (a ``ShardedReduction``, or ``LOCAL``).
        dtype: what the matrices and results travel and ``fn`` computes in.
        first: matrix ``j`` goes to rank ``(first + j) mod W``, so successive calls spread.

    Every rank of the mesh calls it with the same number of parts (collectives).
    """
    parts = [t.to(dtype) for t in parts]
    if not reduce.distributed:
        return [r.to(dtype) for r in fn(parts)] if parts else []
    ndim = len(reduce.shape)
    sharded = [(i, pl.dim % ndim) for i, pl in enumerate(reduce.placements) if is_shard(pl)]
    if any(type(pl).__name__ == "_StridedShard" for pl in reduce.placements):
        return _everywhere(parts, reduce, fn, dtype)  # (FSDP2 over tensor parallelism: no box of the matrix)
    if not sharded:
        return [r.to(dtype) for r in fn(parts)] if parts else []
    if len(sharded) == 1:
        mesh_dim, dim = sharded[0]
        return _spread(parts, reduce, mesh_dim, dim, fn, dtype, first)
    return _everywhere(parts, reduce, fn, dtype)


def _pad(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.size(dim) == size:
        return t.contiguous()
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_zeros(shape)
    out.narrow(dim, 0, t.size(dim)).copy_(t)
    return out


def _spread(
    parts: list[torch.Tensor], reduce: Reduction, mesh_dim: int, dim: int, fn: Fn, dtype: torch.dtype, first: int
) -> list[torch.Tensor]:
    """One sharded mesh dim: matrix ``j`` is whole on rank ``(first + j) mod W`` only."""
    mesh = reduce.mesh
    group = mesh.get_group(mesh_dim)
    world, me = dist.get_world_size(group), mesh.get_local_rank(mesh_dim)
    sizes = shard_sizes(reduce.shape[dim], world)
    chunk = max(sizes)
    offsets = [sum(sizes[:k]) for k in range(world)]
    for t in parts:
        if t.size(dim) != sizes[me]:
            raise ValueError(
                f"a local part {tuple(t.shape)} of a parameter {tuple(reduce.shape)}: expected "
                f"{sizes[me]} along dim {dim} (torch.chunk's slices over {world} ranks)"
            )
    owner = [(first + j) % world for j in range(len(parts))]
    received: dict[int, list[torch.Tensor]] = {}
    works = []
    for j, t in enumerate(parts):  # every slice of matrix j to its owner
        send = _pad(t, dim, chunk)
        bufs = [torch.empty_like(send) for _ in range(world)] if owner[j] == me else None
        if bufs is not None:
            received[j] = bufs
        works.append(dist.gather(send, bufs, group=group, group_dst=owner[j], async_op=True))
    for w in works:
        w.wait()
    mine = sorted(received)
    wholes = [torch.cat([b.narrow(dim, 0, sizes[k]) for k, b in enumerate(received[j])], dim=dim) for j in mine]
    results = dict(zip(mine, (r.to(dtype) for r in fn(wholes)))) if wholes else {}
    out, works = [], []
    for j, t in enumerate(parts):  # each result's slices back to their ranks
        shape = list(t.shape)
        shape[dim] = chunk
        recv = torch.empty(shape, dtype=dtype, device=t.device)
        pieces = None
        if owner[j] == me:
            pieces = [_pad(results[j].narrow(dim, offsets[k], sizes[k]), dim, chunk) for k in range(world)]
        works.append(dist.scatter(recv, pieces, group=group, group_src=owner[j], async_op=True))
        out.append(recv)
    for w in works:
        w.wait()
    return [r.narrow(dim, 0, sizes[me]) for r in out]


def _everywhere(parts: list[torch.Tensor], reduce: Reduction, fn: Fn, dtype: torch.dtype) -> list[torch.Tensor]:
    """Several sharded mesh dims: every rank gathers every matrix, runs ``fn`` on all and keeps its own part (a box;
    a ``_StridedShard``'s strided rows cut as DTensor cuts them)."""
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    wholes = [whole_tensor(t, reduce) for t in parts]
    if any(type(pl).__name__ == "_StridedShard" for pl in reduce.placements):
        return [
            distribute_tensor(r, reduce.mesh, reduce.placements, src_data_rank=None).to_local().to(dtype)
            for r in fn(wholes)
        ]
    local, offset = compute_local_shape_and_global_offset(reduce.shape, reduce.mesh, reduce.placements)
    out = []
    for r in fn(wholes):
        for d, (n, o) in enumerate(zip(local, offset)):
            r = r.narrow(d, o, n)
        out.append(r.to(dtype))
    return out


def whole_tensor(local: torch.Tensor, reduce: Reduction) -> torch.Tensor:
    """The whole tensor of this rank's part ``local``, on every rank (``full_tensor``; ``local`` in one process)."""
    if not reduce.distributed:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        reduce.mesh,
        reduce.placements,
        run_check=False,
        shape=reduce.shape,
        stride=contiguous_strides(reduce.shape),
    ).full_tensor()


def row_block(reduce: Reduction, what: str) -> tuple[int, int]:
    """(first row, rows) of this rank's part of a matrix sharded by rows or replicated; else NotImplementedError."""
    for i, placement in enumerate(reduce.placements):
        if not (placement.is_replicate() or (placement.is_shard() and placement.dim % len(reduce.shape) == 0)):
            raise NotImplementedError(
                f"{what} on a parameter {tuple(reduce.shape)} placed {tuple(reduce.placements)}: only row sharding "
                f"(Shard(0), FSDP2's default) and Replicate are supported (mesh dim {i} is {placement})"
            )
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local, offset = compute_local_shape_and_global_offset(reduce.shape, reduce.mesh, reduce.placements)
    return int(offset[0]), int(local[0])
