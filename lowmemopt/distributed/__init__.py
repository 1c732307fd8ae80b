"""torch.distributed support: FSDP2 / DTensor parameters (state on the local shard, reductions over the shards),
DDP (plain replicated parameters: nothing to do), torch.distributed.checkpoint. See ``docs/distributed.md``."""

from .files import process_rank, rank_path
from .reduction import LOCAL, Reduction, ShardedReduction
from .sharding import dense_state_dict, is_dtensor, local_tensor

__all__ = [
    "LOCAL",
    "Reduction",
    "ShardedReduction",
    "dense_state_dict",
    "is_dtensor",
    "local_tensor",
    "process_rank",
    "rank_path",
]
