"""GaLore's apply stage after a batched product back (``projection.batched.finish_many``), one multi-tensor pass over
every matrix of a shape class::

    p <- round_p( ((p + c p) * decay) + scale * U )

``U``: the full-size update (fp32, or bf16 with ``proj_dtype="param"``); ``c``: the decay the inner math applies to the
weight (one number, or one per matrix); each operation rounds as the torch path does (docs/kernels.md#kernels).
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import triton
import triton.language as tl

from . import runtime
from .codec import load_grad, load_param, store_param, tile_coords
from .launch import TL_DTYPES
from .table import aligned, masked_table, owned_tables, tile_counts, unit_map

__all__ = ["DTYPES", "apply_updates"]

#: the decay the inner math applies to the weight: none, one number for the batch, one per matrix
NO_DECAY, SCALAR_DECAY, PER_TENSOR_DECAY = 0, 1, 2
_BLOCK = 256
#: parameter dtypes the pass takes (where Triton may run at all: ``lowmemopt.pipeline.triton_usable``)
DTYPES = frozenset(TL_DTYPES)


@triton.jit
def _apply_tile(
    row,
    t,
    offs,
    mask,
    c_ptr,
    c,
    scale,
    decay,
    P_DTYPE: tl.constexpr,
    U_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    MATH: tl.constexpr,
    DECAY: tl.constexpr,
    MASKED: tl.constexpr,
):
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    if MATH == 2:
        p = tl.fma(p, tl.load(c_ptr + t), p)  # _decay_rows: p + c p
    elif MATH == 1:
        p = tl.fma(p, c, p)
    if DECAY:
        p = p * decay
    u = load_grad(row, offs, mask, U_DTYPE, ALIGNED, MASKED)  # the update sits in the table's gradient column
    store_param(p + u * scale, row, offs, mask, P_DTYPE, ALIGNED, MASKED)


@triton.jit
def _apply_kernel(
    units,
    table,
    c_ptr,
    c,
    scale,
    decay,
    W: tl.constexpr,
    P_DTYPE: tl.constexpr,
    U_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MATH: tl.constexpr,
    DECAY: tl.constexpr,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, False)
    if full:
        _apply_tile(row, t, offs, mask, c_ptr, c, scale, decay, P_DTYPE, U_DTYPE, ALIGNED, MATH, DECAY, False)
    else:
        _apply_tile(row, t, offs, mask, c_ptr, c, scale, decay, P_DTYPE, U_DTYPE, ALIGNED, MATH, DECAY, True)


def apply_updates(
    params: Sequence[torch.Tensor],
    updates: torch.Tensor,
    scale: float,
    decay: float,
    math_decay: float | torch.Tensor | None,
    flags: torch.Tensor | None = None,
    flag_rows: Sequence[int] = (),
    memo: dict | None = None,
) -> None:
    """``params[i] <- round(((p + c_i p) * decay) + scale * updates[i])`` in one launch.

    Args:
        params: contiguous matrices of one shape, dtype and device.
        updates: ``[len(params), *shape]``, contiguous, fp32 or bf16.
        math_decay: None, a number, or an fp32 tensor ``[len(params)]``.
        flags, flag_rows: the gradients' finiteness on the device; a parameter whose flag is 0 is left as it is.
        memo: kept by the caller for the same ``params``: the launch tables (an ``updates`` made elsewhere moves the
            table's update column by one add on the device).
    """
    device = updates.device
    p_dtype = params[0].dtype
    if isinstance(math_decay, torch.Tensor):
        math, c_ptr, c = PER_TENSOR_DECAY, math_decay.to(device=device, dtype=torch.float32).contiguous(), 0.0
    elif math_decay is None:
        math, c_ptr, c = NO_DECAY, updates, 0.0
    else:
        math, c_ptr, c = SCALAR_DECAY, updates, float(math_decay)
    updates = updates.contiguous()
    block = _BLOCK
    tile_rows = runtime.rows_per_tile(block, device)
    kept = None if memo is None else memo.get("launch")
    if kept is not None and (
        kept["params"] is not params
        and (len(kept["params"]) != len(params) or not all(map(operator.is_, kept["params"], params)))
        or kept["tile_rows"] != tile_rows
        or kept["shape"] != updates.shape
        or kept["dtype"] != updates.dtype
        or (updates.data_ptr() - kept["base"]) % 16
    ):
        kept = None
    if kept is None:
        each = updates.unbind(0)
        rows = [[p.data_ptr(), u.data_ptr(), p.numel()] for p, u in zip(params, each)]
        counts = tile_counts([p.numel() for p in params], tile_rows * block)
        kept = dict(
            params=list(params),
            tile_rows=tile_rows,
            shape=updates.shape,
            dtype=updates.dtype,
            base=updates.data_ptr(),
            both=owned_tables(rows, device),
            units=unit_map(counts, device),
            programs=sum(counts),
            aligned=aligned([*params, *each]),
        )
        if memo is not None:
            memo["launch"] = kept
    elif updates.data_ptr() != kept["base"]:  # the same layout elsewhere: the update column moves with it
        kept["both"][:, :, 1].add_(updates.data_ptr() - kept["base"])
        kept["base"] = updates.data_ptr()
    table, skipped = kept["both"][0], kept["both"][1]
    if flags is not None:  # a skipped matrix counts 0 elements
        table = masked_table(table, skipped, flags, flag_rows, device)
    _apply_kernel[(kept["programs"],)](
        kept["units"],
        table,
        c_ptr,
        c,
        float(scale),
        float(decay),
        W=3,
        P_DTYPE=TL_DTYPES[p_dtype],
        U_DTYPE=TL_DTYPES[updates.dtype],
        ALIGNED=kept["aligned"],
        ROWS=tile_rows,
        BLOCK=block,
        MATH=math,
        DECAY=decay != 1.0,
        num_warps=runtime.tile_shape(device)[1],
        enable_fp_fusion=False,
    )


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        # GaLore's apply pass after the batched product back: bf16 params, fp32 products, a decay per matrix
        v.Variant(
            "unproject",
            _apply_kernel,
            dict(
                W=3,
                P_DTYPE=v.tl.bfloat16,
                U_DTYPE=v.tl.float32,
                ALIGNED=True,
                ROWS=v.runtime.TILE // 256,
                BLOCK=256,
                MATH=2,
                DECAY=True,
            ),
        ),
    ]
