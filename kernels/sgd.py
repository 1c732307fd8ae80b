"""Fused SGD step (reference: :func:`lowmemopt.optim.sgd.sgd_math`), one pass per tile in registers::

    d = g + wd p;   b = d (first step) or momentum b + (1 - dampening) d;   d = d + momentum b (nesterov) or b
    p <- p - lr d                       (SignSGD, the ``SIGN`` flag: p <- p - lr sign(d))
    (``wd_after_momentum``, FusedSGD: ``d + wd p`` after the momentum instead of ``g + wd p`` before it)

Bytes per element: param 2x(2|4) + grad (2|4) + momentum read and written (fp32 8, bf16 4, q8 2 + absmax).
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param_as, store_slot, tensor_scalar, tile_coords
from .launch import Bucket, Update, scalar
from .registry import Kernel

__all__ = ["TRITON", "sgd_update", "launch", "slots"]


@triton.jit
def sgd_update(
    p,
    g,
    buf,
    momentum,
    one_minus_dampening,
    weight_decay,
    first_step,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,
    WD_AFTER: tl.constexpr = False,
):
    """fp32 SGD math on a tile -> (direction, momentum); ``WD_AFTER``: FusedSGD's decay."""
    d = g
    if MAXIMIZE:
        d = -g
    if DECAY and not WD_AFTER:
        d = tl.fma(p, weight_decay, d)
    if MOMENTUM:
        buf = tl.where(first_step != 0, d, tl.fma(d, one_minus_dampening, buf * momentum))
        if NESTEROV:
            d = tl.fma(buf, momentum, d)
        else:
            d = buf
    if DECAY and WD_AFTER:
        d = tl.fma(p, weight_decay, d)
    return d, buf


@triton.jit
def _sgd_tile(
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    neg_lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    first_step,
    decay,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,
    UPDATE: tl.constexpr,
    W: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
    WD_AFTER: tl.constexpr,
    SIGN: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    if MOMENTUM:
        buf = load_slot(row, 3, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    else:
        buf = g
    d, buf = sgd_update(
        p,
        g,
        buf,
        momentum,
        one_minus_dampening,
        weight_decay,
        first_step,
        MOMENTUM,
        NESTEROV,
        MAXIMIZE,
        DECAY,
        WD_AFTER,
    )
    if SIGN:  # SignSGD: torch.sign(d) (+0 for +-0 and NaN); -lr * sign is exact, so the fma rounds as p.add_ does
        d = (d > 0).to(tl.float32) - (d < 0).to(tl.float32)
    if MOMENTUM:
        store_slot(buf, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_param_as(tl.fma(d, neg_lr, p * decay), p, row, offs, mask, P_DTYPE, ALIGNED, MASKED, UPDATE, W)


@triton.jit(do_not_specialize=["first_step"])  # a runtime flag: step 1 and later steps share one compiled kernel
def _sgd_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    neg_lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    first_step,
    decay,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    UPDATE: tl.constexpr,
    MOMENTUM: tl.constexpr,
    NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    DECAY: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    COLS: tl.constexpr = False,
    WD_AFTER: tl.constexpr = False,
    SIGN: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if DEVICE_SCALARS:  # a capturable step: (-lr, first step of this tensor, decay) from the device
        neg_lr = tensor_scalar(scal, t, 3, 0)
        first_step = tensor_scalar(scal, t, 3, 1)
        decay = tensor_scalar(scal, t, 3, 2)
    if full:
        _sgd_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            neg_lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            first_step,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            MOMENTUM,
            NESTEROV,
            MAXIMIZE,
            DECAY,
            UPDATE,
            W,
            False,
            COLS,
            WD_AFTER,
            SIGN,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _sgd_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            neg_lr,
            momentum,
            one_minus_dampening,
            weight_decay,
            first_step,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            MOMENTUM,
            NESTEROV,
            MAXIMIZE,
            DECAY,
            UPDATE,
            W,
            True,
            COLS,
            WD_AFTER,
            SIGN,
            gmul=gmul,
            G_MULT=G_MULT,
        )


def slots(hyper: Mapping[str, Any]) -> tuple[str, ...]:
    return ("momentum_buffer",) if hyper["momentum"] != 0 else ()


def launch(u: Update, bucket: Bucket, sign: bool = False) -> None:
    """Step a bucket; ``sign``: SignSGD, ``p += -lr sign(d)``."""
    kw = u.kwargs
    wd = scalar(kw["weight_decay"])
    if u.steps is None:
        neg_lr, first, decay, scal = -scalar(kw["lr"]), int(bool(kw["first_step"])), scalar(u.decay), None
    else:  # a capturable step: read from scal
        neg_lr, first, decay = 0.0, 0, 0.0
        scal = bucket.scalars(-kw["lr"], kw["first_step"], u.decay)
    args = (neg_lr, scalar(kw["momentum"]), 1.0 - scalar(kw["dampening"]), wd, first, decay)
    bucket.tile_launch(
        _sgd_kernel,
        slots(u.record.hyper),
        args,
        writes=True,
        update=u,
        MOMENTUM=kw["momentum"] != 0,
        NESTEROV=bool(kw["nesterov"]),
        MAXIMIZE=bool(kw["maximize"]),
        DECAY=wd != 0,
        WD_AFTER=bool(kw.get("wd_after_momentum", False)),
        SIGN=sign,
        scal=scal,
    )


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="sgd:TRITON")``; SignSGD: ``sign=True``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch, any_rounding=True)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant(
            "sgd",
            _sgd_kernel,
            v.tile(MOMENTUM=True, NESTEROV=True, MAXIMIZE=False, DECAY=True, UPDATE=v.KAHAN, W=17, FMT=v.BF16),
        ),
    ]
