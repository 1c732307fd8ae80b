"""Fused Lion step (reference: :func:`lowmemopt.optim.lion.lion_math`), one pass per tile in registers::

    p <- p (1 - lr wd)  -  lr sign(beta1 m + (1 - beta1) g);      m = beta2 m + (1 - beta2) g

Bytes per element: param 2x(2|4) + grad (2|4) + m read and written (fp32 8, bf16 4, q8 2 + absmax).
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param_as, store_slot, tensor_scalar, tile_coords
from .launch import Bucket, Update, scalar
from .registry import Kernel

__all__ = ["TRITON", "lion_update", "launch", "slots"]


@triton.jit
def lion_update(g, m, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr):
    """fp32 Lion math on a tile: returns (m, delta). ``1 - beta`` comes from the host (rounded once, as in torch)."""
    c = tl.fma(g, one_minus_beta1, m * beta1)
    sign = tl.where(c > 0, 1.0, tl.where(c < 0, -1.0, 0.0))
    return tl.fma(g, one_minus_beta2, m * beta2), sign * neg_lr


@triton.jit
def _lion_tile(
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    neg_lr,
    decay,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    UPDATE: tl.constexpr,
    W: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    m = load_slot(row, 3, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    m, delta = lion_update(g, m, beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr)
    store_slot(m, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_param_as(p * decay + delta, p, row, offs, mask, P_DTYPE, ALIGNED, MASKED, UPDATE, W)


@triton.jit
def _lion_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    neg_lr,
    decay,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    UPDATE: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    COLS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if DEVICE_SCALARS:  # a capturable step: (-lr, decay) from the device
        neg_lr = tensor_scalar(scal, t, 2, 0)
        decay = tensor_scalar(scal, t, 2, 1)
    if full:
        _lion_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            neg_lr,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            UPDATE,
            W,
            False,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _lion_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            neg_lr,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            UPDATE,
            W,
            True,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )


def slots(hyper: Mapping[str, Any]) -> tuple[str, ...]:
    return ("exp_avg",)


def launch(u: Update, bucket: Bucket) -> None:
    kw = u.kwargs
    beta1, beta2 = kw["betas"]
    if u.steps is None:
        stepping, scal = (-scalar(kw["lr"]), scalar(u.decay)), None
    else:  # a capturable step: read from scal
        stepping, scal = (0.0, 0.0), bucket.scalars(-kw["lr"], u.decay)
    args = (beta1, 1.0 - beta1, beta2, 1.0 - beta2, *stepping)
    bucket.tile_launch(_lion_kernel, slots(u.record.hyper), args, writes=True, update=u, scal=scal)


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="lion:TRITON")``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch, any_rounding=True)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("lion-cols", _lion_kernel, v.tile(UPDATE=v.NEAREST, COLS=True)),
        # fp16 parameters: bf16_update's fp16 stochastic rounding and fp16 Kahan buffer (codec.store_param_as)
        v.Variant("lion-fp16-stochastic", _lion_kernel, v.tile(UPDATE=v.STOCHASTIC, W=17, P_DTYPE=v.tl.float16)),
        v.Variant("lion-fp16-kahan", _lion_kernel, v.tile(UPDATE=v.KAHAN, W=17, P_DTYPE=v.tl.float16)),
        v.Variant("lion", _lion_kernel, v.tile(UPDATE=v.NEAREST)),
    ]
