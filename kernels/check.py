"""The non-finite check of a kept program's gradients on the device, one multi-tensor launch per gradient dtype::

    ok[t] = (sum_i float32(g_t[i])^2  <  inf)

the condition of ``pipeline.finite.finite_norms``. The tiles' atomic sums vary in order, which can change a finite
sum's last bits but not whether it is finite; the table is kept from step to step, so no host work per gradient.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton
import triton.language as tl

from . import runtime
from .codec import typed
from .launch import TL_DTYPES
from .table import device_table, tile_counts, unit_map

__all__ = ["GradCheck", "TILE"]

#: elements per program (fp32 sums of 4096 elements: 16 per thread with 8 warps)
TILE = 4096


@triton.jit
def _sumsq_kernel(units, table, acc, W: tl.constexpr, G_DTYPE: tl.constexpr, TILE: tl.constexpr, ALIGNED: tl.constexpr):
    """``acc[t] += sum(float32(g)^2)`` over one tile (table rows ``[0, grad, numel]``)."""
    pid = tl.program_id(0)
    t = tl.load(units + pid)
    tile = tl.load(units + tl.num_programs(0) + pid).to(tl.int64)
    row = table + t.to(tl.int64) * W
    numel = tl.load(row + 2)
    offs = tile * TILE + tl.arange(0, TILE)
    g = tl.load(typed(tl.load(row + 1), G_DTYPE, ALIGNED) + offs, mask=offs < numel, other=0).to(tl.float32)
    tl.atomic_add(acc + t, tl.sum(g * g, axis=0))


class GradCheck:
    """The non-finite check of a fixed list of gradients, launched step after step."""

    def __init__(self, grads: Sequence[torch.Tensor]) -> None:
        self.device = grads[0].device
        self.n = len(grads)
        self.runs: list[tuple[int, int, torch.dtype]] = []  # (first, end, dtype) of each run of one dtype
        for i, g in enumerate(grads):
            if self.runs and self.runs[-1][2] == g.dtype:
                self.runs[-1] = (self.runs[-1][0], i + 1, g.dtype)
            else:
                self.runs.append((i, i + 1, g.dtype))
        self._ptrs: list[int] | None = None
        self._launches: list[tuple] = []

    def _build(self, grads: Sequence[torch.Tensor]) -> None:
        self._launches = []
        for first, end, dtype in self.runs:
            part = grads[first:end]
            rows = [[0, g.data_ptr(), g.numel()] for g in part]
            counts = tile_counts([g.numel() for g in part], TILE)
            self._launches.append(
                (
                    first,
                    end,
                    TL_DTYPES[dtype],
                    device_table(rows, self.device),
                    unit_map(counts, self.device),
                    sum(counts),
                    all(g.data_ptr() % 16 == 0 for g in part),
                )
            )

    def flags(self, grads: Sequence[torch.Tensor], ptrs: list[int]) -> torch.Tensor:
        """uint8 ``[n]`` on the device, 1 where ``grads[i]`` is finite (``ptrs``: their addresses); no host sync."""
        if ptrs != self._ptrs:
            self._build(grads)
            self._ptrs = ptrs
        acc = torch.zeros(self.n, dtype=torch.float32, device=self.device)
        warps = runtime.tile_shape(self.device)[1]
        for first, end, g_dtype, table, units, programs, aligned in self._launches:
            if programs:
                _sumsq_kernel[(programs,)](
                    units, table, acc[first:end], W=3, G_DTYPE=g_dtype, TILE=TILE, ALIGNED=aligned, num_warps=warps
                )
        return (acc < math.inf).view(torch.uint8)
