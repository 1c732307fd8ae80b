"""Multi-tensor launch tables: one launch covers every tensor of a bucket (as Apex's FusedAdam).

``table``: int64 ``[T, W]``, a row per tensor of addresses (parameter, gradient, state) and sizes; ``units``: int32
``[2, N]``, each program's (tensor row, unit within it). Both are cached by content and uploaded from page-locked
memory without blocking (docs/kernels.md#dispatch).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Sequence

import torch

from lowmemopt.work import capture

__all__ = [
    "upload",
    "device_tables",
    "owned_tables",
    "device_table",
    "flagged_table",
    "select_flags",
    "masked_table",
    "launch_tables",
    "device_index",
    "unit_map",
    "aligned",
    "ceil_div",
    "tile_counts",
]


class _Cache:
    """A least-recently-used cache of device tensors by content, bounded by entries and by their bytes."""

    def __init__(self, entries: int, nbytes: int | None = None) -> None:
        self.limit, self.byte_limit = entries, nbytes
        self.entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: tuple, make, keep: bool = True):
        """The entry of ``key``, made by ``make()`` if missing (kept for good during a graph capture; ``keep``
        False: by the caller)."""
        hit = self.entries.get(key)
        if hit is not None:
            self.entries.move_to_end(key)
            value = hit[0]
            tensors = value if isinstance(value, tuple) else (value,)
        else:
            value = make()
            tensors = value if isinstance(value, tuple) else (value,)
            size = sum(t.numel() * t.element_size() for t in tensors)
            self.entries[key] = (value, size)
            self.nbytes += size
            while len(self.entries) > self.limit or (
                self.byte_limit is not None and self.nbytes > self.byte_limit and len(self.entries) > 1
            ):
                self.nbytes -= self.entries.popitem(last=False)[1][1]
        if keep:
            capture.keep(tensors[0].device, *tensors)
        return value


_CACHE_SIZE = 64
#: tables: more entries than the tensors of a large model, because the per-layer updates (``step_in_backward``) build
#: a one-row table per parameter per step (a cache smaller than the parameter count would never hit), and a byte
#: bound for steps whose buckets change from step to step (a table is a row of ~10 int64 per tensor)
_TABLE_CACHE_SIZE = 2048
_TABLE_CACHE_BYTES = 64 << 20
_tables = _Cache(_TABLE_CACHE_SIZE, _TABLE_CACHE_BYTES)
_units = _Cache(_CACHE_SIZE)  # (a unit map has an entry per tile: a few per bucket)
_indices = _Cache(_CACHE_SIZE)


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, to CUDA from page-locked memory without blocking."""
    if device.type == "cuda":
        try:
            t = t.pin_memory()
        except RuntimeError:  # (no page-locked memory to be had: the blocking copy)
            return t.to(device)
        capture.keep(device, t)
        return t.to(device, non_blocking=True)
    return t.to(device)


def device_tables(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` as an int64 device table, and the same with every element count 0 (cached)."""
    key = (device, tuple(map(tuple, rows)))
    return _tables.get(key, lambda: tuple(owned_tables(key[1], device)))


def owned_tables(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """:func:`device_tables`' two tables as one ``[2, len(rows), W]`` tensor the caller owns (not cached)."""
    both = torch.tensor(rows, dtype=torch.int64).expand(2, -1, -1).clone()
    both[1, :, 2] = 0
    return upload(both, device)


def device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """:func:`device_tables`' first table."""
    return device_tables(rows, device)[0]


def flagged_table(
    rows: Sequence[Sequence[int]],
    device: torch.device,
    flags: torch.Tensor,
    flag_rows: Sequence[int],
    memo: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> torch.Tensor:
    """:func:`device_table` with each row's element count times its gradient's finiteness flag."""
    table, skipped = device_tables(rows, device)
    hit = None if memo is None else memo.get(id(table))
    if hit is not None:
        return hit[1]
    out = masked_table(table, skipped, flags, flag_rows, device)
    if memo is not None:
        memo[id(table)] = (table, out)  # (the table kept alive with its id)
    return out


def masked_table(
    table: torch.Tensor, skipped: torch.Tensor, flags: torch.Tensor, flag_rows: Sequence[int], device: torch.device
) -> torch.Tensor:
    """``table`` with each row's element count times its gradient's finiteness flag (``skipped``: the table with
    every count 0): one device op."""
    return torch.where(select_flags(flags, flag_rows, device).view(torch.bool).unsqueeze(1), table, skipped)


def launch_tables(
    rows: Sequence[Sequence[int]],
    device: torch.device,
    passes: Sequence[tuple[Sequence[Any], Any]],
    flags: torch.Tensor | None = None,
    flag_rows: Sequence[int] = (),
) -> tuple[list[list[int]], torch.Tensor, list[torch.Tensor], torch.Tensor | None]:
    """A bucket's own tables for its passes over ``rows``, in one call: ``(counts, both, units, masked)``, each
    pass's programs per tensor, the table (:func:`owned_tables`), each pass's :func:`unit_map` and, with ``flags``,
    the :func:`masked_table`. ``passes``: per pass, ``(sizes, tile)``: each tensor's elements and a program's
    (:func:`tile_counts`), or its ``(batch, R, C)`` and a ``(rows, cols)`` tile of its matrices."""
    counts = [tile_counts(sizes, tile) if type(tile) is int else _grid_counts(sizes, *tile) for sizes, tile in passes]
    both = owned_tables(rows, device)
    units = [unit_map(c, device, keep=False) for c in counts]
    capture.keep(device, *units)
    masked = None if flags is None else masked_table(both[0], both[1], flags, flag_rows, device)
    return counts, both, units, masked


def select_flags(flags: torch.Tensor, flag_rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``flags[flag_rows]`` on the device (a slice, or the flags themselves, where the rows allow)."""
    n = len(flag_rows)
    if isinstance(flag_rows, range) and flag_rows.step == 1 and flag_rows.stop <= len(flags):
        return flags[flag_rows.start : flag_rows.stop]
    if n == len(flags) and list(flag_rows) == list(range(n)):
        return flags
    return flags.index_select(0, device_index(flag_rows, device))


def device_index(index: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``index`` on ``device`` (cached by content, as the tables)."""
    key = (device, tuple(index))
    return _indices.get(key, lambda: upload(torch.tensor(key[1], dtype=torch.int64), device))


def unit_map(counts: Sequence[int], device: torch.device, keep: bool = True) -> torch.Tensor:
    """int32 ``[2, sum(counts)]``: (tensor index, unit index within the tensor) of every program, tensors in order
    (``keep``: :func:`~lowmemopt.work.capture.keep` it here; False: the caller does)."""
    key = (device, tuple(counts))

    def make() -> torch.Tensor:
        n = torch.tensor(counts, dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(counts)), n)
        first = torch.cumsum(n, 0) - n
        local = torch.arange(sum(counts)) - torch.repeat_interleave(first, n)
        return upload(torch.stack([tensor, local]).to(torch.int32), device)

    return _units.get(key, make, keep)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` on the host (``triton.cdiv`` is 25x slower to call)."""
    return -(-a // b)


def tile_counts(sizes: Sequence[int], tile: int) -> list[int]:
    """Programs per tensor of ``sizes[i]`` elements, ``tile`` per program (:func:`ceil_div` of each)."""
    return [ceil_div(n, tile) for n in sizes]


def _grid_counts(shapes: Sequence[tuple[int, int, int]], rows: int, cols: int) -> list[int]:
    """Programs per ``(batch, R, C)`` stack of matrices in tiles of ``rows`` x ``cols``."""
    return [b * ceil_div(r, rows) * ceil_div(c, cols) for b, r, c in shapes]


def aligned(tensors: Sequence[torch.Tensor | None], nbytes: int = 16) -> bool:
    """Whether every tensor's data starts on an ``nbytes`` boundary (vectorized accesses)."""
    return all(t is None or t.data_ptr() % nbytes == 0 for t in tensors)
