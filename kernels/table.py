"""Multi-tensor launch tables: one kernel launch covers every tensor of a bucket (as Apex's, DeepSpeed's and
ColossalAI's FusedAdam do), so a model with hundreds of small tensors pays one launch per pass, not hundreds.

A launch gets two device tensors:

* ``table``: int64 ``[T, W]``, one row per tensor: raw addresses (``data_ptr()``) of the parameter, its gradient and
  each state tensor, and integers (sizes). A kernel turns an address back into a typed pointer with
  ``tl.load(table + t * W + col).to(tl.pointer_type(dtype))``.
* ``units``: int32 ``[2, N]``: for program ``pid``, ``units[0, pid]`` is its tensor's row in ``table`` and
  ``units[1, pid]`` the index of its unit (tile, row block, ...) inside that tensor.

Both are built on the host and copied to the device with one small transfer each; they are cached by content (the
addresses), so a training loop whose gradients keep their storage reuses them without any host work beyond the key.
A transfer to a CUDA device goes from page-locked memory, asynchronously (:func:`upload`): a table made in the middle
of a step (new addresses: fresh gradients, GaLore's stand-ins and products) never makes the host wait for the GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from lowmemopt.work import capture

__all__ = ["upload", "device_tables", "owned_tables", "device_table", "flagged_table", "select_flags", "device_index", "unit_map",
           "aligned", "ceil_div"]


class _Cache:
    """A least-recently-used cache of device tensors by content, bounded by entries and by their bytes."""

    def __init__(self, entries: int, nbytes: int | None = None) -> None:
        self.limit, self.byte_limit = entries, nbytes
        self.entries: OrderedDict[tuple, tuple[object, int]] = OrderedDict()
        self.nbytes = 0

    def get(self, key: tuple, make):
        """The entry of ``key``, made by ``make()`` if missing. An entry returned while its device's stream captures a
        CUDA graph is kept for the process (:func:`lowmemopt.work.capture.keep`): the graph reads it by address
        at every replay, after this cache may have dropped it."""
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
                    self.byte_limit is not None and self.nbytes > self.byte_limit and len(self.entries) > 1):
                self.nbytes -= self.entries.popitem(last=False)[1][1]
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
    """Host tensor ``t`` on ``device``. To a CUDA device from page-locked memory and ``non_blocking``: a copy from
    pageable memory synchronizes the host with the stream (the host would wait for every kernel queued before it).
    The page-locked block is not reused before the copy has run (torch's caching host allocator records it), and
    during a graph capture it is kept for the process: every replay copies from it again."""
    if device.type == "cuda":
        try:
            t = t.pin_memory()
        except RuntimeError:  # (no page-locked memory to be had: the blocking copy)
            return t.to(device)
        capture.keep(device, t)
        return t.to(device, non_blocking=True)
    return t.to(device)


def device_tables(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``[len(rows), W]`` on ``device`` holding ``rows`` (all of the same width W), and the same table with
    every element count (column 2) 0: a launch with finiteness flags picks each row from one or the other (one
    ``torch.where`` on the device, :func:`flagged_table`). Both in one copy to the device, cached by content."""
    key = (device, tuple(map(tuple, rows)))
    return _tables.get(key, lambda: tuple(owned_tables(key[1], device)))


def owned_tables(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """:func:`device_tables`' two tables as one int64 ``[2, len(rows), W]`` tensor of the caller's own (not cached:
    the caller may change it in place, e.g. move its addresses with their tensors)."""
    both = torch.tensor(rows, dtype=torch.int64).expand(2, -1, -1).clone()
    both[1, :, 2] = 0
    return upload(both, device)


def device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 ``[len(rows), W]`` on ``device`` holding ``rows`` (:func:`device_tables`' first)."""
    return device_tables(rows, device)[0]


def flagged_table(rows: Sequence[Sequence[int]], device: torch.device, flags: torch.Tensor,
                  flag_rows: Sequence[int], memo: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
                  ) -> torch.Tensor:
    """:func:`device_table` of ``rows`` with the element count (column 2) of row ``i`` multiplied by
    ``flags[flag_rows[i]]`` (uint8 on ``device``, 0 or 1: a gradient's finiteness, :mod:`lowmemopt.pipeline.finite`):
    a kernel then masks off every access of a skipped tensor. One ``torch.where`` on the device (and an
    ``index_select`` unless the rows are the flags in order): no host synchronization. ``memo``: the results of one
    set of flags so far, by table, so that the passes of one bucket (the same rows) make it once."""
    table, skipped = device_tables(rows, device)
    hit = None if memo is None else memo.get(id(table))
    if hit is not None:
        return hit[1]
    out = torch.where(select_flags(flags, flag_rows, device).view(torch.bool).unsqueeze(1), table, skipped)
    if memo is not None:
        memo[id(table)] = (table, out)  # (the table kept alive with its id)
    return out


def select_flags(flags: torch.Tensor, flag_rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``flags[flag_rows]`` on the device: one ``index_select``; a slice where ``flag_rows`` is a ``range`` of
    consecutive rows, and the flags themselves where the rows are the flags in order (a per-layer hook's one tensor:
    row 0 of 1)."""
    n = len(flag_rows)
    if isinstance(flag_rows, range) and flag_rows.step == 1 and flag_rows.stop <= len(flags):
        return flags[flag_rows.start:flag_rows.stop]
    if n == len(flags) and list(flag_rows) == list(range(n)):
        return flags
    return flags.index_select(0, device_index(flag_rows, device))


def device_index(index: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``index`` on ``device`` (cached by content, as the tables)."""
    key = (device, tuple(index))
    return _indices.get(key, lambda: upload(torch.tensor(key[1], dtype=torch.int64), device))


def unit_map(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 ``[2, sum(counts)]``: (tensor index, unit index within the tensor) of every program, tensors in order."""
    key = (device, tuple(counts))

    def make() -> torch.Tensor:
        n = torch.tensor(counts, dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(counts)), n)
        first = torch.cumsum(n, 0) - n
        local = torch.arange(sum(counts)) - torch.repeat_interleave(first, n)
        return upload(torch.stack([tensor, local]).to(torch.int32), device)

    return _units.get(key, make)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (host side, per tensor: ``triton.cdiv`` is a constexpr function, 25x slower to call)."""
    return -(-a // b)


def aligned(tensors: Sequence[torch.Tensor | None], nbytes: int = 16) -> bool:
    """True if every tensor's data starts on an ``nbytes`` boundary (lets a kernel promise vectorized accesses)."""
    return all(t is None or t.data_ptr() % nbytes == 0 for t in tensors)
