"""Per-rank state files: ``lowmemopt.save_state`` on an optimizer with sharded (DTensor) parameters.

Each process writes its own shards' state, in the stored formats (8-bit stays 8-bit), to its own file::

    save_state(opt, "ckpt/opt.safetensors", model)   # rank r of W writes ckpt/opt.rank{r:05d}-of-{W:05d}.safetensors

and ``load_state(opt, "ckpt/opt.safetensors", model)`` reads this rank's file back. The file records where each shard
sits (global shape, offset, placements, mesh): it loads only into the same sharding. To change the world size, save
and load through ``torch.distributed.checkpoint`` instead (``docs/distributed.md``), which reshards.
"""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["rank_path", "process_rank"]


def process_rank() -> tuple[int, int]:
    """``(rank, world size)`` of this process in the default process group (``(0, 1)`` without one)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_path(path: str | os.PathLike, rank: int, world_size: int) -> str:
    """``opt.safetensors`` -> ``opt.rank00001-of-00002.safetensors`` (the suffix is kept; none: appended)."""
    path = os.fspath(path)
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank:05d}-of-{world_size:05d}{ext}"
