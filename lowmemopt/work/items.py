"""What the stages of a step pass to each other: plain tensors and plain numbers, never the optimizer.

An :class:`Item` is one tensor to update: the tensor a backend writes (a parameter's local storage, or for a
GaLore-projected parameter a low-rank buffer that receives the update), its gradient, its state dict and the slots the
algorithm declares for it, and its bucket's options resolved once (:class:`~.record.BucketRecord`). An :class:`Update`
is everything a backend needs to know about the algorithm for one bucket: its registered name, its hyper-parameters
(the record's, plus the step-dependent scalars) and the decay factor the parameter is multiplied by before the update
is added. No backend reads a param group dict. In a capturable step (``capturable=True``) the step counts
live on the device, so the step-dependent values are tensors there (:attr:`Update.steps`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .record import BucketRecord

__all__ = ["Item", "Update", "LOW_RANK"]

#: the key every projected (GaLore) parameter's state holds, its basis's side: how a stage tells low-rank state
#: from full-rank state before it has an item (an item says it in :attr:`Item.projected`); a group that lost its
#: ``rank`` keeps such state, which the projection stage refuses (``lowmemopt.projection.projector.SIDE``)
LOW_RANK = "galore.side"


@dataclass(eq=False)
class Item:
    """One tensor a backend updates in place: ``target <- target * decay + delta(grad, state)``; for a GaLore parameter
    ``target`` is a zeroed low-rank stand-in and ``grad`` the projected gradient.
    """

    param: torch.Tensor
    group: dict[str, Any]  # the param group, for the stages above the backends (GaLore); backends read ``record``
    target: torch.Tensor
    grad: torch.Tensor
    state: dict[str, Any]  # initialized: has "step" and every slot
    slots: dict[str, Any]  # name -> Slot (signed, quantize, shape, dims)
    projected: bool = False  # the item's kind: a GaLore item, whose target is the low-rank update buffer
    #: flat index in the whole parameter of ``target``'s first element (an FSDP2 shard's offset; stochastic rounding
    #: hashes it), or None when the target's elements are not one range of the parameter's
    index_base: int | None = 0
    #: the row of this item's gradient in the step's device-side finiteness flags (:mod:`.finite`), or None (the
    #: host checked it)
    flag: int | None = None
    #: a GaLore stand-in whose math reads a statistic of the weight (LAMB's ||p||, Adafactor's RMS(p)): that of the
    #: full weight, a 0-dim fp32 tensor on the target's device, which the backends read in place of the stand-in's
    weight: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # stage-private data (GaLore: projector views, shards)
    #: the bucket's options (hyper-parameters, storage options, rounding), resolved from ``group`` once per step
    record: BucketRecord | None = None
    #: a shard's reductions (:class:`lowmemopt.distributed.reduction.Reduction`) for the per-tensor backends, which
    #: step a sharded parameter's math across its ranks; None: a whole tensor
    reduce: Any = None


@dataclass(frozen=True)
class Update:
    """The algorithm's side of one bucket: the math's ``kwargs``, the ``record``, the ``decay`` factor, the ``step``; in
    a capturable step ``steps`` (fp64 ``[T]`` on the device), with ``step`` 0 and per-tensor scalars.
    """

    algorithm: str
    kwargs: dict[str, Any]
    record: BucketRecord
    decay: float
    step: int
    block_size: int
    steps: torch.Tensor | None = None

    @property
    def hyper(self) -> Mapping[str, Any]:
        """The bucket's hyper-parameters (:attr:`BucketRecord.hyper`, read-only)."""
        return self.record.hyper
