"""The Triton bodies of the fused Adafactor and CAME passes (launched by ``kernels/factored.py``): row/column
statistics, factors, the clip's sums, the update (docs/kernels.md#kernels).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .codec import (
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
    _ROFF,
    _V,
    clip_denominator,
    factor_coords,
    factored_precondition,
    full_precondition,
    matrix_precondition,
    matrix_tile,
    sqrt_numel,
)

__all__ = ["apply_kernel", "factors_kernel", "moments_kernel", "stats_kernel", "sumsq_kernel"]

# ---------------------------------------------------------------------------------------------------------------------
# kernels


@triton.jit
def stats_kernel(
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
    t, row, offs, mask, grow, cidx, r_mask, c_mask = matrix_tile(units, table, W, TR, BC)
    roff = tl.load(row + _ROFF)
    coff = tl.load(row + _COFF)
    g = load_grad(row, offs, mask, G_DTYPE, False, True, gmul, G_MULT)
    if RESIDUAL:
        u = matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask)
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
def moments_kernel(
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
    t, row, offs, mask, grow, cidx, r_mask, c_mask = matrix_tile(units, table, W, TR, BC)
    roff = tl.load(row + _ROFF)
    coff = tl.load(row + _COFF)
    g = load_grad(row, offs, mask, G_DTYPE, False, True, gmul, G_MULT)
    u = tl.where(mask, matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask), 0.0).to(tl.float64)
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
def factors_kernel(
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
def sumsq_kernel(
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
def apply_kernel(
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
