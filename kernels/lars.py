"""Fused LARS step (reference: ``optim.lars.lars_math``, ColossalAI semantics) in two passes::

    trust = clamp(eeta ||p|| / (||g|| + wd ||p|| + epsilon), 0, 50)   (1 if ||p|| or ||g|| is 0, or lars=False)
    d = clamp(g + wd p, -10, 10);   b = d (first step) or momentum b + d;   p <- p - lr * trust * b

Pass 1 sums p^2 and g^2 per tensor (skipped with ``lars=False``); pass 2 applies (docs/kernels.md#kernels).
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param, store_slot, tensor_scalar, tile_coords
from .launch import Bucket, Update, scalar
from .registry import Kernel

__all__ = ["TRITON", "lars_update", "launch", "slots"]


@triton.jit
def lars_update(p, g, buf, momentum, weight_decay, first_step, MOMENTUM: tl.constexpr, DECAY: tl.constexpr):
    """fp32 LARS math on a tile (before the trust ratio): returns (direction, momentum buffer)."""
    d = g
    if DECAY:
        d = tl.fma(p, weight_decay, d)
    d = tl.minimum(tl.maximum(d, -10.0), 10.0)
    if MOMENTUM:
        buf = tl.where(first_step != 0, d, buf * momentum + d)
        d = buf
    return d, buf


@triton.jit
def _lars_norms_tile(
    t,
    row,
    offs,
    mask,
    sums,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    WEIGHT: tl.constexpr,
    MASKED: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    if not WEIGHT:
        p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
        tl.atomic_add(sums + 2 * t, tl.sum(tl.sum(p * p, axis=1), axis=0))
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    tl.atomic_add(sums + 2 * t + 1, tl.sum(tl.sum(g * g, axis=1), axis=0))


@triton.jit
def _lars_norms_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    sums,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    WEIGHT: tl.constexpr,
    COLS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if full:
        _lars_norms_tile(t, row, offs, mask, sums, P_DTYPE, G_DTYPE, ALIGNED, WEIGHT, False, gmul=gmul, G_MULT=G_MULT)
    else:
        _lars_norms_tile(t, row, offs, mask, sums, P_DTYPE, G_DTYPE, ALIGNED, WEIGHT, True, gmul=gmul, G_MULT=G_MULT)


@triton.jit
def _lars_apply_tile(
    t,
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    sums,
    neg_lr,
    momentum,
    eeta,
    weight_decay,
    epsilon,
    first_step,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    MOMENTUM: tl.constexpr,
    DECAY: tl.constexpr,
    TRUST: tl.constexpr,
    WEIGHT: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    if MOMENTUM:
        buf = load_slot(row, 3, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    else:
        buf = g
    d, buf = lars_update(p, g, buf, momentum, weight_decay, first_step, MOMENTUM, DECAY)
    scale = neg_lr
    if TRUST:
        if WEIGHT:
            w_norm = tl.load(sums + 2 * t)
        else:
            w_norm = tl.sqrt_rn(tl.load(sums + 2 * t))
        g_norm = tl.sqrt_rn(tl.load(sums + 2 * t + 1))
        usable = (w_norm > 0) & (g_norm > 0)
        ratio = tl.math.div_rn(eeta * w_norm, g_norm + weight_decay * w_norm + epsilon)
        trust = tl.minimum(tl.maximum(tl.where(usable, ratio, 1.0), 0.0), 50.0)
        scale = trust * neg_lr
    if MOMENTUM:
        store_slot(buf, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_param(p + d * scale, row, offs, mask, P_DTYPE, ALIGNED, MASKED)


@triton.jit(do_not_specialize=["first_step"])
def _lars_apply_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    sums,
    neg_lr,
    momentum,
    eeta,
    weight_decay,
    epsilon,
    first_step,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MOMENTUM: tl.constexpr,
    DECAY: tl.constexpr,
    TRUST: tl.constexpr,
    WEIGHT: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    COLS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if DEVICE_SCALARS:  # a capturable step: (-lr, first step of this tensor) from the device
        neg_lr = tensor_scalar(scal, t, 2, 0)
        first_step = tensor_scalar(scal, t, 2, 1)
    if full:
        _lars_apply_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            sums,
            neg_lr,
            momentum,
            eeta,
            weight_decay,
            epsilon,
            first_step,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            MOMENTUM,
            DECAY,
            TRUST,
            WEIGHT,
            False,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _lars_apply_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            sums,
            neg_lr,
            momentum,
            eeta,
            weight_decay,
            epsilon,
            first_step,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            MOMENTUM,
            DECAY,
            TRUST,
            WEIGHT,
            True,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )


def slots(hyper: Mapping[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if hyper["momentum"] != 0 else ()


def launch(u: Update, bucket: Bucket) -> None:
    kw = u.kwargs
    trust = bool(kw["lars"])
    wd = scalar(kw["weight_decay"])
    sums = bucket.accumulators(2)
    weight = bucket.weights is not None
    if weight:
        sums[:, 0] = bucket.weights
    names = slots(u.record.hyper)
    if trust:
        bucket.tile_launch(_lars_norms_kernel, names, (sums,), writes=False, WEIGHT=weight)
    if u.steps is None:
        neg_lr, first, scal = -scalar(kw["lr"]), int(bool(kw["first_step"])), None
    else:  # a capturable step: read from scal
        neg_lr, first, scal = 0.0, 0, bucket.scalars(-kw["lr"], kw["first_step"])
    args = (sums, neg_lr, scalar(kw["momentum"]), scalar(kw["eeta"]), wd, scalar(kw["epsilon"]), first)
    bucket.tile_launch(
        _lars_apply_kernel,
        names,
        args,
        writes=True,
        MOMENTUM=kw["momentum"] != 0,
        DECAY=trust and wd != 0,
        TRUST=trust,
        WEIGHT=weight,
        scal=scal,
    )


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="lars:TRITON")``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("lars-norms", _lars_norms_kernel, v.tile()),
        v.Variant("lars", _lars_apply_kernel, v.tile(MOMENTUM=True, DECAY=True, TRUST=True)),
    ]
