"""Per-rank state files: ``lowmemopt.save_state`` with sharded (DTensor) parameters writes this rank's shards to
``opt.rank{r:05d}-of-{W:05d}.safetensors``, loadable only into the same sharding; to change the world size use
``torch.distributed.checkpoint`` (docs/distributed.md#checkpoints).
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
