"""One paged parameter's record in the residency manager (:mod:`.pager`): where its state lives between steps."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Entry"]


@dataclass(eq=False)
class Entry:
    """What the manager knows of one paged parameter."""

    tier: str  # "cpu" | "disk"
    device: torch.device  # the parameter's device when its state was made
    resident: bool  # state kept on the device (within the budget): never moved
    offload_dir: str | None
    label: str  # "g0.p3": param group and position, for file names and messages
    nbytes: int = 0  # bytes of its state when placed (what a resident entry takes of the budget)
    weight: int | None = None  # a DTensor's: what it weighs in a batch on every rank (placement.mesh_weight)
    state: dict[str, Any] | None = None  # the home state installed in optimizer.state (None before the first step)
    reserved: dict[str, torch.Tensor] | None = None  # homes made ahead of the state's first write-back
    #: the dict its working state is installed in while it steps: the same object every step (launch arguments
    #: cached by the state's identity stay valid), emptied after each write-back
    working: dict[str, Any] | None = None

    def home_tensors(self) -> dict[str, torch.Tensor]:
        if self.state is None:
            return dict(self.reserved or {})
        return {k: v for k, v in self.state.items() if isinstance(v, torch.Tensor)}
