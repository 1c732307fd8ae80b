"""Paged optimizer state: between steps a paged parameter's state lives in host RAM or in files, and comes to its
device only while it updates (``paged=True | "cpu" | "disk"``, ``offload_dir=``, ``page_budget_bytes=``,
``page_headroom_bytes=`` on every optimizer; docs/paging.md).

The functions below are the hooks the optimizer and the checkpoint code call (no-ops without paged groups); the
residency manager is :mod:`.pager`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .options import check_paging, tier_of
from .entry import Entry
from .pager import Pager, StateOwner
from .residency import PagingReport

if TYPE_CHECKING:
    import torch

__all__ = [
    "Entry",
    "Pager",
    "PagingReport",
    "StateOwner",
    "check_paging",
    "close",
    "detach_files",
    "discard_staged",
    "drop_pages",
    "is_staged",
    "moving_bytes",
    "pager_of",
    "reconcile",
    "report",
    "settle",
    "stage",
    "tier_of",
    "where_state_lives",
]


def pager_of(optimizer: StateOwner) -> Pager | None:
    """The optimizer's residency manager, made on first use; None if no param group is paged."""
    pager = optimizer.__dict__.get("_pager")
    if pager is None and any(tier_of(g) for g in optimizer.param_groups):
        pager = optimizer.__dict__["_pager"] = Pager(optimizer)
    return pager


def _existing(optimizer: Any) -> Pager | None:
    return getattr(optimizer, "__dict__", {}).get("_pager")


def stage(optimizer: StateOwner, items: list[tuple[torch.Tensor, dict, dict]]) -> dict[torch.Tensor, dict]:
    """Loaded state of paged params placed in new homes (see :meth:`Pager.stage`); {} when nothing is paged."""
    pager = pager_of(optimizer)
    return pager.stage(items) if pager is not None else {}


def is_staged(optimizer: StateOwner, p: torch.Tensor, state: Any) -> bool:
    pager = _existing(optimizer)
    return pager is not None and pager.is_staged(p, state)


def reconcile(optimizer: StateOwner) -> None:
    """After a load swapped the state: adopt staged homes, free replaced ones."""
    pager = _existing(optimizer)
    if pager is not None:
        pager.reconcile()


def discard_staged(optimizer: StateOwner) -> None:
    pager = _existing(optimizer)
    if pager is not None:
        pager.discard_staged()


def settle(optimizer: StateOwner) -> None:
    """Wait for every write-back to reach its home, so host code can read the state (CUDA; no-op on CPU)."""
    pager = _existing(optimizer)
    if pager is not None:
        pager.settle()


def detach_files(optimizer: StateOwner, state_dict: dict[str, Any]) -> None:
    """In ``state_dict()``'s output: ordinary tensors instead of views of state files."""
    pager = _existing(optimizer)
    if pager is not None:
        pager.detach_files(state_dict)


def drop_pages(optimizer: StateOwner, state: dict | None = None) -> None:
    """Unmap state files' pages from the process (after reading them in bulk, e.g. to save a checkpoint)."""
    pager = _existing(optimizer)
    if pager is not None:
        pager.drop_pages(state)


def moving_bytes(optimizer: StateOwner) -> int:
    """Bytes of paged state that travel each way per step (resident state does not move)."""
    pager = _existing(optimizer)
    if pager is None:
        return 0
    return sum(
        t.numel() * t.element_size()
        for e in pager.entries.values()
        if not e.resident
        for t in e.home_tensors().values()
    )


def where_state_lives(optimizer: StateOwner, p: torch.Tensor) -> str:
    """``"device"``, ``"cpu"`` or ``"disk"``: where ``p``'s optimizer state is kept between steps."""
    pager = _existing(optimizer)
    return "device" if pager is None else pager.where_state_lives(p)


def close(optimizer: StateOwner, keep_files: bool = False) -> None:
    pager = _existing(optimizer)
    if pager is not None:
        pager.close(keep_files=keep_files)


def report(optimizer: StateOwner) -> PagingReport:
    """Where the optimizer's paged state is, per device and per parameter (:class:`~.residency.PagingReport`)."""
    pager = _existing(optimizer)
    return pager.report() if pager is not None else PagingReport([], [])
