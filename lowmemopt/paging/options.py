"""The paging options of a param group (``paged``, ``offload_dir``, ``page_budget_bytes``, ``page_headroom_bytes``),
checked once when the optimizer or group is created; what they mean: docs/paging.md.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

__all__ = ["tier_of", "check_paging"]

_TIERS = {True: "cpu", "cpu": "cpu", "disk": "disk"}


def tier_of(group: dict[str, Any]) -> str | None:
    """The group's paging tier, ``"cpu"`` or ``"disk"``, or None when its state is not paged."""
    paged = group.get("paged", False)
    if paged is None or paged is False:
        return None
    if not isinstance(paged, (bool, str)) or paged not in _TIERS:  # (set on the group since it was checked)
        raise ValueError(f"Invalid paged: {paged!r} (supported: False, True, 'cpu', 'disk')")
    return _TIERS[paged]


def check_paging(group: dict[str, Any], writable: bool = True) -> None:
    """Raise for bad paging options in ``group``; ``writable``: prove a file can be made there."""
    tier_of(group)  # (ValueError for a bad paged)
    budget = group.get("page_budget_bytes", "auto")
    if not (isinstance(budget, str) and budget == "auto") and (
        isinstance(budget, bool) or not isinstance(budget, int) or budget < 0
    ):
        raise ValueError(f"Invalid page_budget_bytes: {budget!r} (must be an int >= 0, or 'auto')")
    headroom = group.get("page_headroom_bytes")
    if headroom is not None and (isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0):
        raise ValueError(
            f"Invalid page_headroom_bytes: {headroom!r} (must be an int >= 0, or None: 10% of the device's memory)"
        )
    offload_dir = group.get("offload_dir")
    if offload_dir is not None:
        if not isinstance(offload_dir, (str, os.PathLike)):
            raise TypeError(f"Invalid offload_dir: expected a path, got {type(offload_dir).__name__}")
        offload_dir = group["offload_dir"] = os.fspath(offload_dir)
    if tier_of(group) != "disk":
        return
    if offload_dir is None:
        raise ValueError("paged='disk' needs offload_dir=: a directory on a disk with room for the optimizer state")
    if writable:
        check_writable(offload_dir)


def check_writable(path: str) -> None:
    """Create ``path`` if needed and prove that a file can be made in it; PermissionError saying why if not."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".lowmemopt-probe-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"offload_dir {path!r} is not a writable directory ({type(e).__name__}: {e.strerror or e}); "
            "paged='disk' keeps the optimizer state in files there"
        ) from e
