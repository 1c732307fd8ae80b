"""Fused Adafactor and CAME steps in multi-tensor passes (references: ``optim.adafactor.adafactor_math``,
``optim.came.came_math``): row/column statistics, factors, the clip's sums, the update.

The passes, their bytes per element, CAME's fp64 moment form (and the direct form where fp64 is slow) and the wide
matrices' factor indexing: docs/kernels.md#kernels.
"""

from __future__ import annotations

from typing import Any, Mapping

import math

import torch
import triton
import triton.language as tl

from lowmemopt.work import capture

from . import runtime
from .codec import (
    FORMAT_CODES,
    load_grad,
    load_param,
    load_slot,
    load_slot_at,
    store_param,
    store_slot,
    tensor_scalar,
    tile_coords,
    typed,
)
from .factored_math import (
    _C,
    _COFF,
    _M,
    _R,
    _RES,
    _ROFF,
    _SQ,
    _V,
    clip_denominator,
    factor_coords,
    factored_precondition,
    full_precondition,
    sqrt_numel,
)
from .launch import TL_DTYPES, Bucket, Update, scalar
from .registry import Kernel
from .table import ceil_div

__all__ = ["ADAFACTOR", "CAME", "adafactor_slots", "came_slots", "layout", "launch_adafactor", "launch_came"]


# ---------------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _matrix_tile(units, table, W: tl.constexpr, TR: tl.constexpr, BC: tl.constexpr):
    """A 2-D tile [TR, BC] of one matrix of a tensor's batch, with its scratch indices and masks."""
    pid = tl.program_id(0)
    t = tl.load(units + pid)
    local = tl.load(units + tl.num_programs(0) + pid)
    row = table + t.to(tl.int64) * W
    R = tl.load(row + _R)
    C = tl.load(row + _C)
    n_rt = tl.cdiv(R, TR)
    n_ct = tl.cdiv(C, BC)
    b = local // (n_rt * n_ct)
    rest = local % (n_rt * n_ct)
    r = (rest // n_ct) * TR + tl.arange(0, TR)
    c = (rest % n_ct) * BC + tl.arange(0, BC)
    r_mask = r < R
    c_mask = c < C
    mask = r_mask[:, None] & c_mask[None, :]
    grow = b * R + r
    offs = grow[:, None] * C + c[None, :]
    return t, row, offs, mask, grow, b * C + c, r_mask, c_mask


@triton.jit
def _matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask):
    """``rfac[row] cfac[col] g`` on a :func:`_matrix_tile`, each factor loaded once per tile row or column."""
    return (
        tl.load(rfac + roff + grow, mask=r_mask, other=0.0)[:, None]
        * tl.load(cfac + coff + cidx, mask=c_mask, other=0.0)[None, :]
    ) * g


@triton.jit
def _stats_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rsum,
    csum,
    rfac,
    cfac,
    sums,
    eps,
    beta1,
    one_minus_beta1,
    clip_threshold,
    W: tl.constexpr,
    FMT: tl.constexpr,
    G_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    TR: tl.constexpr,
    BC: tl.constexpr,
    RESIDUAL: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """Pass 1: row and column sums of ``g^2 + eps`` (``RESIDUAL``, CAME's direct form: ``(u - m')^2 + eps``)."""
    t, row, offs, mask, grow, cidx, r_mask, c_mask = _matrix_tile(units, table, W, TR, BC)
    roff = tl.load(row + _ROFF)
    coff = tl.load(row + _COFF)
    g = load_grad(row, offs, mask, G_DTYPE, False, True, gmul, G_MULT)
    if RESIDUAL:
        u = _matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask)
        u = tl.math.div_rn(u, clip_denominator(sums, t, tl.load(row + 2), clip_threshold))
        m = load_slot_at(row, _M, offs, mask, book_s, True, QBLOCK, FMT)
        d = u - tl.fma(u, one_minus_beta1, m * beta1)
        x = d * d + eps
    else:
        x = g * g + eps
    x = tl.where(mask, x, 0.0)
    tl.atomic_add(rsum + roff + grow, tl.sum(x, axis=1), mask=r_mask)
    tl.atomic_add(csum + coff + cidx, tl.sum(x, axis=0), mask=c_mask)


@triton.jit
def _moments_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rfac,
    cfac,
    sums,
    rmom,
    cmom,
    W: tl.constexpr,
    FMT: tl.constexpr,
    G_DTYPE: tl.constexpr,
    QBLOCK: tl.constexpr,
    TR: tl.constexpr,
    BC: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """CAME's pass 3: ``sum(u^2)`` and fp64 row / column sums of ``u^2``, ``u m``, ``m^2``."""
    t, row, offs, mask, grow, cidx, r_mask, c_mask = _matrix_tile(units, table, W, TR, BC)
    roff = tl.load(row + _ROFF)
    coff = tl.load(row + _COFF)
    g = load_grad(row, offs, mask, G_DTYPE, False, True, gmul, G_MULT)
    u = tl.where(mask, _matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask), 0.0).to(tl.float64)
    m = load_slot_at(row, _M, offs, mask, book_s, True, QBLOCK, FMT).to(tl.float64)  # 0 where masked
    uu = u * u
    um = u * m
    mm = m * m
    tl.atomic_add(sums + 2 * t + 1, tl.sum(tl.sum(uu, axis=1), axis=0).to(tl.float32))
    rows = rmom + 3 * (roff + grow)
    cols = cmom + 3 * (coff + cidx)
    tl.atomic_add(rows, tl.sum(uu, axis=1), mask=r_mask)
    tl.atomic_add(rows + 1, tl.sum(um, axis=1), mask=r_mask)
    tl.atomic_add(rows + 2, tl.sum(mm, axis=1), mask=r_mask)
    tl.atomic_add(cols, tl.sum(uu, axis=0), mask=c_mask)
    tl.atomic_add(cols + 1, tl.sum(um, axis=0), mask=c_mask)
    tl.atomic_add(cols + 2, tl.sum(mm, axis=0), mask=c_mask)


@triton.jit
def _residual_sum(mom, i, mask, inv_c, beta1_sq):
    """fp64 ``sum((u/c - m')^2) = b1^2 (S_uu / c^2 - 2 S_um / c + S_mm)`` of a row or column, clamped at 0."""
    uu = tl.load(mom + 3 * i, mask=mask, other=0.0)
    um = tl.load(mom + 3 * i + 1, mask=mask, other=0.0)
    mm = tl.load(mom + 3 * i + 2, mask=mask, other=0.0)
    return tl.maximum((uu * inv_c - 2.0 * um) * inv_c + mm, 0.0) * beta1_sq


@triton.jit
def _mean(sum_ptr, i, mask, n, eps, inv_c, beta1_sq, MOMENTS: tl.constexpr):
    """fp32 mean of row / column ``i`` of the statistic (``MOMENTS``: of the residual, + eps)."""
    if MOMENTS:
        return (_residual_sum(sum_ptr, i, mask, inv_c, beta1_sq) / n.to(tl.float64) + eps).to(tl.float32)
    else:
        return tl.math.div_rn(tl.load(sum_ptr + i, mask=mask, other=1.0), n.to(tl.float32))


@triton.jit
def _factors_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rsum,
    csum,
    rfac,
    cfac,
    sums,
    beta,
    one_minus_beta,
    eps,
    beta1,
    clip_threshold,
    W: tl.constexpr,
    STAT: tl.constexpr,
    FB: tl.constexpr,
    MOMENTS: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
):
    """Pass 2 / 4 (a program per matrix): the row / column EMAs and their factors."""
    pid = tl.program_id(0)
    t = tl.load(units + pid)
    b = tl.load(units + tl.num_programs(0) + pid).to(tl.int64)
    if DEVICE_SCALARS:  # a capturable step: this tensor's (beta2, 1 - beta2), columns 2, 3 of _launch's scal
        beta = tensor_scalar(scal, t, 4, 2)
        one_minus_beta = tensor_scalar(scal, t, 4, 3)
    row = table + t.to(tl.int64) * W
    R = tl.load(row + _R)
    C = tl.load(row + _C)
    # a tensor with element count 0 (skipped for a non-finite gradient, pipeline.finite) keeps its statistics: the
    # loops that write them run 0 times (the passes before write only scratch, the flat passes mask by the count)
    numel = tl.load(row + 2)
    live = numel > 0
    R_live = tl.where(live, R, 0)
    C_live = tl.where(live, C, 0)
    roff = tl.load(row + _ROFF) + b * R
    coff = tl.load(row + _COFF) + b * C
    row_stat = typed(tl.load(row + STAT), tl.float32, False) + b * R
    col_stat = typed(tl.load(row + STAT + 1), tl.float32, False) + b * C
    inv_c = 0.0
    beta1_sq = 0.0
    if MOMENTS:
        inv_c = 1.0 / clip_denominator(sums, t, numel, clip_threshold).to(tl.float64)
        beta1_sq = tl.cast(beta1, tl.float64) * tl.cast(beta1, tl.float64)
    acc = tl.zeros([FB], dtype=tl.float32)
    for r0 in range(0, R_live, FB):
        i = r0 + tl.arange(0, FB)
        mask = i < R
        new = tl.fma(
            _mean(rsum, roff + i, mask, C, eps, inv_c, beta1_sq, MOMENTS),
            one_minus_beta,
            tl.load(row_stat + i, mask=mask, other=0.0) * beta,
        )
        tl.store(row_stat + i, new, mask=mask)
        acc += tl.where(mask, new, 0.0)
    mean = tl.math.div_rn(tl.sum(acc, axis=0), R.to(tl.float32))
    for r0 in range(0, R_live, FB):
        i = r0 + tl.arange(0, FB)
        mask = i < R
        new = tl.load(row_stat + i, mask=mask, other=1.0)
        tl.store(rfac + roff + i, tl.math.div_rn(1.0, tl.sqrt_rn(tl.math.div_rn(new, mean))), mask=mask)
    for c0 in range(0, C_live, FB):
        i = c0 + tl.arange(0, FB)
        mask = i < C
        new = tl.fma(
            _mean(csum, coff + i, mask, R, eps, inv_c, beta1_sq, MOMENTS),
            one_minus_beta,
            tl.load(col_stat + i, mask=mask, other=1.0) * beta,
        )
        tl.store(col_stat + i, new, mask=mask)
        tl.store(cfac + coff + i, tl.math.div_rn(1.0, tl.sqrt_rn(new)), mask=mask)


@triton.jit
def _sumsq_tile(
    t,
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_u,
    rfac,
    cfac,
    sums,
    eps1,
    beta2,
    one_minus_beta2,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    FACTORED: tl.constexpr,
    WIDE: tl.constexpr,
    SUM_P: tl.constexpr,
    MASKED: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    if FACTORED:
        rows, wrap, after, cols = factor_coords(row, offs, blocks, bmask, BLOCK, WIDE)
        u = factored_precondition(g, rfac, cfac, rows, wrap, after, cols, mask, bmask, WIDE)
    else:
        v = load_slot(row, _V, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, False)
        v, u = full_precondition(g, v, eps1, beta2, one_minus_beta2)
    if MASKED:
        u = tl.where(mask, u, 0.0)
    tl.atomic_add(sums + 2 * t + 1, tl.sum(tl.sum(u * u, axis=1), axis=0))
    if SUM_P:
        p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
        tl.atomic_add(sums + 2 * t, tl.sum(tl.sum(p * p, axis=1), axis=0))


@triton.jit
def _sumsq_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rfac,
    cfac,
    sums,
    eps1,
    beta2,
    one_minus_beta2,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    FACTORED: tl.constexpr,
    WIDE: tl.constexpr,
    SUM_P: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """Pass 3 / A (flat tiles): sum(u^2) of the preconditioned gradient, and sum(p^2) if ``SUM_P``."""
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, False)
    if DEVICE_SCALARS:  # a capturable step: this tensor's (beta2, 1 - beta2), columns 2, 3 of _launch's scal
        beta2 = tensor_scalar(scal, t, 4, 2)
        one_minus_beta2 = tensor_scalar(scal, t, 4, 3)
    if full:
        _sumsq_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_u,
            rfac,
            cfac,
            sums,
            eps1,
            beta2,
            one_minus_beta2,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            BLOCK,
            FACTORED,
            WIDE,
            SUM_P,
            False,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _sumsq_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_u,
            rfac,
            cfac,
            sums,
            eps1,
            beta2,
            one_minus_beta2,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            BLOCK,
            FACTORED,
            WIDE,
            SUM_P,
            True,
            gmul=gmul,
            G_MULT=G_MULT,
        )


@triton.jit
def _apply_tile(
    t,
    row,
    numel,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rfac,
    cfac,
    rfac2,
    cfac2,
    sums,
    eps1,
    eps2,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    clip_threshold,
    lr,
    neg_wd,
    neg_wd_lr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    BLOCK: tl.constexpr,
    FACTORED: tl.constexpr,
    WIDE: tl.constexpr,
    CAME: tl.constexpr,
    HAS_M: tl.constexpr,
    SCALE_PARAM: tl.constexpr,
    DECAY: tl.constexpr,
    WEIGHT: tl.constexpr,
    MASKED: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    if FACTORED:
        rows, wrap, after, cols = factor_coords(row, offs, blocks, bmask, BLOCK, WIDE)
        u = factored_precondition(g, rfac, cfac, rows, wrap, after, cols, mask, bmask, WIDE)
    else:
        v = load_slot(row, _V, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, False)
        v, u = full_precondition(g, v, eps1, beta2, one_minus_beta2)
        store_slot(v, row, _V, offs, mask, blocks, bmask, book_u, lut_u, False, FMT, ALIGNED, MASKED, False)
    u = tl.math.div_rn(u, clip_denominator(sums, t, numel, clip_threshold))
    if CAME:
        m = load_slot(row, _M, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, False)
        m = tl.fma(u, one_minus_beta1, m * beta1)
        store_slot(m, row, _M, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, False)
        if FACTORED:
            u = factored_precondition(m, rfac2, cfac2, rows, wrap, after, cols, mask, bmask, WIDE)
        else:
            u = m
        if DECAY:
            p = tl.fma(p, neg_wd_lr, p)
        p = p - u * lr
    else:
        if SCALE_PARAM:
            if WEIGHT:
                rms_p = tl.load(sums + 2 * t)
            else:
                rms_p = tl.math.div_rn(tl.sqrt_rn(tl.load(sums + 2 * t)), sqrt_numel(numel))
            alpha = tl.maximum(rms_p, eps2) * lr
        else:
            alpha = lr
        u = u * alpha
        if HAS_M:
            m = load_slot(row, _M, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, False)
            u = tl.fma(u, one_minus_beta1, m * beta1)
            store_slot(u, row, _M, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, False)
        if DECAY:
            if SCALE_PARAM:
                p = tl.fma(p, neg_wd * alpha, p)
            else:
                p = tl.fma(p, neg_wd_lr, p)
        p = p - u
    store_param(p, row, offs, mask, P_DTYPE, ALIGNED, MASKED)


@triton.jit
def _apply_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    rfac,
    cfac,
    rfac2,
    cfac2,
    sums,
    eps1,
    eps2,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    clip_threshold,
    lr,
    neg_wd,
    neg_wd_lr,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    FACTORED: tl.constexpr,
    WIDE: tl.constexpr,
    CAME: tl.constexpr,
    HAS_M: tl.constexpr,
    SCALE_PARAM: tl.constexpr,
    DECAY: tl.constexpr,
    WEIGHT: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """Last pass: recompute u, clip, (m), update p; write p, m and (1-D) v.

    Adafactor: ``a = max(eps2, RMS(p)) * lr`` if SCALE_PARAM else lr; ``u *= a``; ``m = b1 m + (1-b1) u; u = m`` if
    HAS_M; ``p += p * (-wd a)``; ``p -= u``. CAME: ``m = b1 m + (1-b1) u``; ``u = rfac2 cfac2 m`` (1-D: m);
    ``p += p (-wd lr)``; ``p -= lr u``."""
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, False)
    if DEVICE_SCALARS:  # a capturable step: (lr, -wd lr, beta2, 1 - beta2) of this tensor from the device
        lr = tensor_scalar(scal, t, 4, 0)
        neg_wd_lr = tensor_scalar(scal, t, 4, 1)
        beta2 = tensor_scalar(scal, t, 4, 2)
        one_minus_beta2 = tensor_scalar(scal, t, 4, 3)
    if full:
        _apply_tile(
            t,
            row,
            numel,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            rfac,
            cfac,
            rfac2,
            cfac2,
            sums,
            eps1,
            eps2,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            clip_threshold,
            lr,
            neg_wd,
            neg_wd_lr,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            BLOCK,
            FACTORED,
            WIDE,
            CAME,
            HAS_M,
            SCALE_PARAM,
            DECAY,
            WEIGHT,
            False,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _apply_tile(
            t,
            row,
            numel,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            rfac,
            cfac,
            rfac2,
            cfac2,
            sums,
            eps1,
            eps2,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            clip_threshold,
            lr,
            neg_wd,
            neg_wd_lr,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            BLOCK,
            FACTORED,
            WIDE,
            CAME,
            HAS_M,
            SCALE_PARAM,
            DECAY,
            WEIGHT,
            True,
            gmul=gmul,
            G_MULT=G_MULT,
        )


# ---------------------------------------------------------------------------------------------------------------------
# host side


def adafactor_slots(hyper: Mapping[str, Any], p: torch.Tensor) -> tuple[str, ...]:
    first = ("exp_avg",) if hyper["beta1"] is not None else ()
    return first + (("exp_avg_sq_row", "exp_avg_sq_col") if p.dim() >= 2 else ("exp_avg_sq",))


def came_slots(hyper: Mapping[str, Any], p: torch.Tensor) -> tuple[str, ...]:
    if p.dim() >= 2:
        return ("exp_avg", "exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_res_row", "exp_avg_res_col")
    return ("exp_avg", "exp_avg_sq")


def layout(p: torch.Tensor) -> bool:
    """Factored (>= 2 dims) and 1-D parameters take separate launches."""
    return p.dim() >= 2


def wide(params: list[torch.Tensor], block: int) -> bool:
    """Whether every matrix's rows hold at least ``block`` elements (:func:`factor_coords`'s ``WIDE``)."""
    return all(p.shape[-1] >= block for p in params)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _rows(bucket: Bucket, factored: bool) -> tuple[list[list[int]], list[tuple[int, int, int]], int, int]:
    """Launch-table rows (columns ``_M`` ... ``_COFF``), (batch, R, C) per tensor, and the scratch sizes."""
    rows, shapes = [], []
    n_rows = n_cols = 0
    for p, g, st in zip(bucket.params, bucket.grads, bucket.states):

        def slot(name):
            if name + ".codes" in st:
                return [st[name + ".codes"].data_ptr(), st[name + ".absmax"].data_ptr()]
            if name + ".nibbles" in st:
                return [st[name + ".nibbles"].data_ptr(), st[name + ".absmax"].data_ptr()]
            return [_ptr(st.get(name)), 0]

        row = [p.data_ptr(), g.data_ptr(), p.numel()] + slot("exp_avg")
        if factored:
            batch, R, C = math.prod(p.shape[:-2]), p.shape[-2], p.shape[-1]
            row += [
                0,
                0,
                R,
                C,
                _ptr(st["exp_avg_sq_row"]),
                _ptr(st["exp_avg_sq_col"]),
                _ptr(st.get("exp_avg_res_row")),
                _ptr(st.get("exp_avg_res_col")),
                n_rows,
                n_cols,
            ]
            shapes.append((batch, R, C))
            n_rows += batch * R
            n_cols += batch * C
        else:
            row += slot("exp_avg_sq") + [0] * 8
            shapes.append((1, 1, p.numel()))
        rows.append(row)
    return rows, shapes, n_rows, n_cols


def _layout(bucket: Bucket, factored: bool) -> tuple:
    """A bucket's launch layout, kept in ``Bucket.memo``."""
    rows, shapes, n_rows, n_cols = _rows(bucket, factored)
    bucket.keep_rows(rows)
    flat = bucket.constexprs(())
    flat["ALIGNED"] = bucket.aligned(()) and all(
        t.data_ptr() % 16 == 0 for st in bucket.states for t in st.values() if isinstance(t, torch.Tensor)
    )
    tile = flat["ROWS"] * flat["BLOCK"]
    flat_counts = [ceil_div(p.numel(), tile) for p in bucket.params]
    flat["WIDE"] = factored and wide(bucket.params, flat["BLOCK"])
    tr, bc = runtime.TILE_2D
    counts_2d = [b * ceil_div(R, tr) * ceil_div(C, bc) for b, R, C in shapes]
    counts_mat = [b for b, _, _ in shapes]
    return rows, n_rows, n_cols, flat, flat_counts, counts_2d, counts_mat


def _launch(
    bucket: Bucket,
    *,
    came: bool,
    has_m: bool,
    scale_param: bool,
    decay: bool,
    eps1: float,
    eps2: float,
    beta1: float,
    beta2: float,
    beta3: float,
    clip: float,
    lr: float,
    neg_wd: float,
    neg_wd_lr: float,
    scal: torch.Tensor | None = None,
) -> None:
    """The passes of one bucket; ``scal`` (capturable): per-tensor step scalars on the device."""
    device = bucket.scalar_args(scal)
    dev = bucket.device
    factored = bucket.params[0].dim() >= 2
    tr, bc = runtime.TILE_2D
    lay = ("factored", runtime.rows_per_tile(bucket.block_size, dev), tr, bc)  # (the tables are kept by this key too)
    rows, n_rows, n_cols, flat, flat_counts, counts_2d, counts_mat = bucket._memo(
        lay, lambda: _layout(bucket, factored)
    )
    sums = bucket.accumulators(2)
    weight = bucket.weights is not None and scale_param and not came
    if weight:
        sums[:, 0] = bucket.weights
    n = n_rows + n_cols
    # CAME's instability from fp64 moments in the clip pass (one pass over g and m fewer), where fp64 is fast
    moments = factored and came and runtime.fast_fp64(dev)
    scratch = torch.zeros((2 if came and not moments else 1) * n, dtype=torch.float32, device=dev)  # row/col sums
    factors = torch.empty((2 if came else 1) * n, dtype=torch.float32, device=dev)
    rsum, csum = scratch[:n_rows], scratch[n_rows:n]
    rsum2, csum2 = (scratch[n : n + n_rows], scratch[n + n_rows :]) if came and not moments else (rsum, csum)
    rfac, cfac = factors[:n_rows], factors[n_rows:n]
    rfac2, cfac2 = (factors[n : n + n_rows], factors[n + n_rows :]) if came else (rfac, cfac)
    if not factored:  # the scratch pointers are unused; any valid tensor will do
        rsum = csum = rsum2 = csum2 = rfac = cfac = rfac2 = cfac2 = sums
    g_dtype = TL_DTYPES[bucket.grads[0].dtype]
    fmt = FORMAT_CODES[bucket.fmt]
    tiles_2d = dict(FMT=fmt, G_DTYPE=g_dtype, QBLOCK=bucket.block_size, TR=tr, BC=bc)
    by_matrix = dict(FB=runtime.STATS_BLOCK)

    def stats(rs, cs, eps, residual):  # pass 1, or CAME's direct instability pass
        bucket.launch(
            _stats_kernel,
            rows,
            counts_2d,
            (rs, cs, rfac, cfac, sums, eps, beta1, 1.0 - beta1, clip),
            writes=False,
            memo_key=lay + ("2-D",),
            RESIDUAL=residual,
            **tiles_2d,
        )

    def factors_of(rs, cs, rf, cf, stat, beta, eps=0.0, from_moments=False):  # pass 2 / 4
        step_beta = device if stat == _SQ.value else bucket.scalar_args(None)  # (CAME's beta3: a constant)
        bucket.launch(
            _factors_kernel,
            rows,
            counts_mat,
            (rs, cs, rf, cf, sums, beta, 1.0 - beta, eps, beta1, clip),
            writes=True,
            memo_key=lay + ("matrices",),
            STAT=stat,
            MOMENTS=from_moments,
            **by_matrix,
            **step_beta,
        )

    if factored:
        stats(rsum, csum, eps1, False)
        factors_of(rsum, csum, rfac, cfac, _SQ.value, beta2)
    if moments:
        sums_64 = torch.zeros(3 * n, dtype=torch.float64, device=dev)  # [row or column, (u^2, u m, m^2)]
        rmom, cmom = sums_64[: 3 * n_rows], sums_64[3 * n_rows :]
        bucket.launch(
            _moments_kernel,
            rows,
            counts_2d,
            (rfac, cfac, sums, rmom, cmom),
            writes=False,
            memo_key=lay + ("2-D",),
            **tiles_2d,
        )
        factors_of(rmom, cmom, rfac2, cfac2, _RES.value, beta3, eps2, True)
    else:
        bucket.launch(
            _sumsq_kernel,
            rows,
            flat_counts,
            (rfac, cfac, sums, eps1, beta2, 1.0 - beta2),
            writes=False,
            memo_key=lay + ("flat",),
            FACTORED=factored,
            SUM_P=scale_param and not came and not weight,
            **flat,
            **device,
        )
        if factored and came:
            stats(rsum2, csum2, eps2, True)
            factors_of(rsum2, csum2, rfac2, cfac2, _RES.value, beta3)
    args = (
        rfac,
        cfac,
        rfac2,
        cfac2,
        sums,
        eps1,
        eps2,
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        clip,
        lr,
        neg_wd,
        neg_wd_lr,
    )
    bucket.launch(
        _apply_kernel,
        rows,
        flat_counts,
        args,
        writes=True,
        memo_key=lay + ("flat",),
        FACTORED=factored,
        CAME=came,
        HAS_M=has_m,
        SCALE_PARAM=scale_param and not came,
        DECAY=decay,
        WEIGHT=weight,
        **flat,
        **device,
    )


def launch_adafactor(u: Update, bucket: Bucket) -> None:
    """Adafactor (transformers semantics); step scalars as ``adafactor_math``'s."""
    hyper, step = u.hyper, u.step
    eps1, eps2 = hyper["eps"]
    wd = scalar(hyper["weight_decay"])
    beta1 = hyper["beta1"]
    scal = None
    if u.steps is None:
        rho = hyper["lr"]
        if hyper["relative_step"]:
            rho = min(1e-6 * step if hyper["warmup_init"] else 1e-2, 1.0 / math.sqrt(step))
        rho = scalar(rho)
        beta2 = 1.0 - math.pow(step, hyper["decay_rate"])
    else:
        steps = u.steps
        rho = capture.device_value(hyper["lr"], bucket.device)
        if hyper["relative_step"]:
            rho = (
                torch.minimum(1e-6 * steps, 1.0 / steps.sqrt())
                if hyper["warmup_init"]
                else (1.0 / steps.sqrt()).clamp(max=1e-2)
            )
        beta2_t = 1.0 - steps.pow(hyper["decay_rate"])
        scal = bucket.scalars(rho, -wd * rho, beta2_t, 1.0 - beta2_t)
        rho = beta2 = 0.0  # read from scal
    _launch(
        bucket,
        came=False,
        has_m=beta1 is not None,
        scale_param=bool(hyper["scale_parameter"]),
        decay=wd != 0,
        eps1=eps1,
        eps2=eps2,
        beta1=0.0 if beta1 is None else beta1,
        beta2=beta2,
        beta3=0.0,
        clip=scalar(hyper["clip_threshold"]),
        lr=rho,
        neg_wd=-wd,
        neg_wd_lr=-wd * rho,
        scal=scal,
    )


def launch_came(u: Update, bucket: Bucket) -> None:
    """CAME (came_pytorch semantics)."""
    hyper = u.hyper
    eps1, eps2 = hyper["eps"]
    beta1, beta2, beta3 = hyper["betas"]
    wd = scalar(hyper["weight_decay"])
    if u.steps is None:
        lr, scal = scalar(hyper["lr"]), None
    else:  # a capturable step: the lr from the device (CAME's other scalars do not change with the step)
        lr = capture.device_value(hyper["lr"], bucket.device)
        scal = bucket.scalars(lr, -wd * lr, beta2, 1.0 - beta2)
        lr = 0.0
    _launch(
        bucket,
        came=True,
        has_m=True,
        scale_param=False,
        decay=wd != 0,
        eps1=eps1,
        eps2=eps2,
        beta1=beta1,
        beta2=beta2,
        beta3=beta3,
        clip=scalar(hyper["clip_threshold"]),
        lr=lr,
        neg_wd=-wd,
        neg_wd_lr=-wd * lr,
        scal=scal,
    )


#: the kernels as :func:`.registry.lookup` finds them (``KernelSet(triton="factored:ADAFACTOR")``, ``"factored:CAME"``)
ADAFACTOR = Kernel(adafactor_slots, launch_adafactor, layout)
CAME = Kernel(came_slots, launch_came, layout)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("stats", _stats_kernel, v.stats(v.Q8, 256, G_DTYPE=v.tl.bfloat16, RESIDUAL=False)),
        v.Variant("stats-residual", _stats_kernel, v.stats(v.Q8, 256, RESIDUAL=True)),
        v.Variant("moments", _moments_kernel, v.stats(v.Q8, 256)),
        v.Variant("factors", _factors_kernel, dict(W=15, STAT=9, FB=v.runtime.STATS_BLOCK, MOMENTS=False)),
        v.Variant("factors-moments", _factors_kernel, dict(W=15, STAT=11, FB=v.runtime.STATS_BLOCK, MOMENTS=True)),
        v.Variant(
            "factors-capturable",
            _factors_kernel,
            dict(W=15, STAT=9, FB=v.runtime.STATS_BLOCK, MOMENTS=False, DEVICE_SCALARS=True),
        ),
        v.Variant("sumsq", _sumsq_kernel, v.tile(FACTORED=False, WIDE=False, SUM_P=True)),
        v.Variant("sumsq-factored", _sumsq_kernel, v.tile(FACTORED=True, WIDE=True, SUM_P=True)),
        # matrices of rows >= the tile's row (WIDE: the factor indices per segment), and narrower ones
        v.Variant(
            "apply-came",
            _apply_kernel,
            v.tile(FACTORED=True, WIDE=True, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
        v.Variant(
            "apply-came-narrow",
            _apply_kernel,
            v.tile(FACTORED=True, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor",
            _apply_kernel,
            v.tile(FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor-factored",
            _apply_kernel,
            v.tile(FACTORED=True, WIDE=True, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True),
        ),
        v.Variant(
            "apply-adafactor-capturable",
            _apply_kernel,
            v.tile(
                FACTORED=False, WIDE=False, CAME=False, HAS_M=True, SCALE_PARAM=True, DECAY=True, DEVICE_SCALARS=True
            ),
        ),
        v.Variant("stats-q4", _stats_kernel, v.stats(v.Q4, v.Q4_BLOCK, RESIDUAL=True)),
        v.Variant("moments-q4", _moments_kernel, v.stats(v.Q4, v.Q4_BLOCK)),
        v.Variant(
            "apply-came-q4",
            _apply_kernel,
            v.tile4(FACTORED=False, WIDE=False, CAME=True, HAS_M=True, SCALE_PARAM=False, DECAY=True),
        ),
    ]
