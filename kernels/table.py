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
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

__all__ = ["device_table", "device_tables", "device_index", "unit_map", "aligned", "ceil_div"]

#: entries per cache: more than the tensors of a large model, because the per-layer updates (``step_in_backward``)
#: build one single-row table per parameter per step (a cache smaller than the parameter count would never hit)
_CACHE_SIZE = 2048
_tables: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_pairs: "OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]]" = OrderedDict()
_units: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_indices: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()


def _cached(cache: OrderedDict, key: tuple, make) -> torch.Tensor:
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
        return hit
    value = cache[key] = make()
    if len(cache) > _CACHE_SIZE:
        cache.popitem(last=False)
    return value


def device_table(rows: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """int64 ``[len(rows), W]`` on ``device`` holding ``rows`` (all of the same width W)."""
    key = (device, tuple(map(tuple, rows)))
    return _cached(_tables, key, lambda: torch.tensor(key[1], dtype=torch.int64).to(device))


def device_tables(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`device_table` of ``rows``, and the same table with every element count (column 2) 0: a launch picks
    each row from one or the other by the tensors' finiteness flags (one ``torch.where`` on the device)."""
    key = (device, tuple(map(tuple, rows)))

    def make() -> tuple[torch.Tensor, torch.Tensor]:
        table = torch.tensor(key[1], dtype=torch.int64)
        skipped = table.clone()
        skipped[:, 2] = 0
        return table.to(device), skipped.to(device)

    return _cached(_pairs, key, make)


def device_index(index: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 ``index`` on ``device`` (cached by content, as the tables)."""
    key = (device, tuple(index))
    return _cached(_indices, key, lambda: torch.tensor(key[1], dtype=torch.int64).to(device))


def unit_map(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 ``[2, sum(counts)]``: (tensor index, unit index within the tensor) of every program, tensors in order."""
    key = (device, tuple(counts))

    def make() -> torch.Tensor:
        n = torch.tensor(counts, dtype=torch.int64)
        tensor = torch.repeat_interleave(torch.arange(len(counts)), n)
        first = torch.cumsum(n, 0) - n
        local = torch.arange(int(n.sum())) - torch.repeat_interleave(first, n)
        return torch.stack([tensor, local]).to(torch.int32).to(device)

    return _cached(_units, key, make)


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (host side, per tensor: ``triton.cdiv`` is a constexpr function, 25x slower to call)."""
    return -(-a // b)


def aligned(tensors: Sequence[torch.Tensor | None], nbytes: int = 16) -> bool:
    """True if every tensor's data starts on an ``nbytes`` boundary (lets a kernel promise vectorized accesses)."""
    return all(t is None or t.data_ptr() % nbytes == 0 for t in tensors)
