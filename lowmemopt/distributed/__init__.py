"""torch.distributed support: FSDP2 / DTensor parameters, DDP, torch.distributed.checkpoint (docs/distributed.md);
recipes on DDP and model averagers, imported on first use (docs/distributed_recipes.md).
"""

import importlib
from typing import Any

from .files import process_rank, rank_path
from .reduction import LOCAL, Reduction, ShardedReduction
from .sharding import dense_state_dict, is_dtensor, local_tensor

_RECIPES = {
    "GossipAverager": "gossip",
    "mixing_weights": "gossip",
    "ring": "gossip",
    "torus": "gossip",
    "SparsifiedState": "sparsified",
    "sparsified_hook": "sparsified",
}

__all__ = [
    "GossipAverager",
    "LOCAL",
    "Reduction",
    "ShardedReduction",
    "SparsifiedState",
    "dense_state_dict",
    "is_dtensor",
    "local_tensor",
    "mixing_weights",
    "process_rank",
    "rank_path",
    "ring",
    "sparsified_hook",
    "torus",
]


def __getattr__(name: str) -> Any:
    if name in _RECIPES:
        return getattr(importlib.import_module(f".{_RECIPES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
