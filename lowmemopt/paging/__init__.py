"""Paged optimizer state: between steps, a paged parameter's state lives in host RAM or in files, and comes to the
parameter's device only while that parameter updates.

    opt = lowmemopt.AdamW(model.parameters(), state_bits=8, paged="disk", offload_dir="/scratch/opt")
    opt = lowmemopt.PagedAdamW8bit(model.parameters(), page_budget_bytes=2 << 30)   # paged="cpu", 2 GiB resident

Options (keyword-only on every optimizer, settable per param group): ``paged=False | True | "cpu" | "disk"``,
``offload_dir=`` (for ``"disk"``), ``page_budget_bytes="auto" | int``, ``page_headroom_bytes=None | int``. See
``docs/paging.md``.

Modules: :mod:`.options` (checks), :mod:`.homes` (host and file homes, page handling), :mod:`.schedule` (which buffer
each bucket uses and what each copy waits for), :mod:`.engine` (the schedule carried out: streams and events on CUDA,
I/O threads for files, or the update's threads on a CPU of its own: :mod:`.contention`), :mod:`.residency` (what stays on the device: the budget, ``"auto"``, the report),
:mod:`.placement` (homes and residency of new state), :mod:`.next_pass` (the next pass's first bucket, on its way
when a pass ends), :mod:`.pager` (the residency manager). The functions below are
the hooks the optimizer and the checkpoint code call; each is a no-op for an optimizer without paged groups.
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
    """Bytes of paged state that travel between their homes and the device each step, each way (resident state
    within the budget does not move): what a step's transfers are bounded by."""
    pager = _existing(optimizer)
    if pager is None:
        return 0
    return sum(t.numel() * t.element_size() for e in pager.entries.values() if not e.resident
               for t in e.home_tensors().values())


def where_state_lives(optimizer: StateOwner, p: torch.Tensor) -> str:
    """``"device"``, ``"cpu"`` or ``"disk"``: where ``p``'s optimizer state is kept between steps."""
    pager = _existing(optimizer)
    return "device" if pager is None else pager.where_state_lives(p)


def close(optimizer: StateOwner, keep_files: bool = False) -> None:
    pager = _existing(optimizer)
    if pager is not None:
        pager.close(keep_files=keep_files)


def report(optimizer: StateOwner) -> PagingReport:
    """Where the optimizer's paged state is: per device, what stays resident, what pages to each tier and the
    buffers paging holds; per parameter, where its state is (see :class:`~.residency.PagingReport`)."""
    pager = _existing(optimizer)
    return pager.report() if pager is not None else PagingReport([], [])
