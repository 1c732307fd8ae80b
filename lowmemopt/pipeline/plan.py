"""The plan of one step: what the optimizer hands the pipeline beside the parameters.

The optimizer (the torch.optim contract) builds a :class:`Plan` per ``step()`` and the stages read it; none of them
receives the optimizer or calls back into it. Per bucket a stage reads the algorithm (its slots, math, step scalars
and decay rules: :class:`~lowmemopt.pipeline.algorithm.Algorithm`), the bucketed backend it may use (``fused``), the
state dict that holds each parameter's slots in their formats, and the param groups (storage options and
hyper-parameters). What a step reports back (GaLore refresh failures) goes into :class:`StepRecord`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .algorithm import Algorithm

__all__ = ["Plan", "StepRecord"]


@dataclass
class StepRecord:
    """What steps tell their optimizer (``owner``: its class name, for warnings): GaLore basis refreshes whose SVD
    failed (the previous basis kept), and whether that was warned about (once per optimizer)."""

    owner: str = "optimizer"
    galore_refresh_failures: int = 0
    galore_refresh_warned: bool = False


@dataclass(eq=False)
class Plan:
    """One step's plan. ``state``: parameter -> its state dict (plain named tensors and ints; the optimizer's
    ``state``); ``groups``: the param groups; ``fused``: the algorithm's name in the fused backends' registries, or
    None (no bucketed backend: the per-tensor reference backends only); ``galore``: the projection stage
    (:mod:`lowmemopt.projection.step`), given where a group may be projected, else None; ``communicate``: the
    communicate stage of the communication-compressed optimizers (:class:`lowmemopt.distributed.onebit.OnebitStage`),
    which :func:`lowmemopt.pipeline.communicating` runs around the update, else None."""

    algorithm: Algorithm
    state: dict[torch.Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]
    fused: str | None
    record: StepRecord = field(default_factory=StepRecord)
    galore: Any = None
    communicate: Any = None
