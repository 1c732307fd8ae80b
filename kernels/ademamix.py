"""Fused AdEMAMix step (reference: ``optim.ademamix.ademamix_math``), one pass per tile in registers::

    m1 = beta1 m1 + (1 - beta1) g;   m2 = beta3_t m2 + (1 - beta3_t) g;   nu = beta2 nu + (1 - beta2) g^2
    p <- p (1 - lr wd)  -  lr (m1 / (1 - beta1^t) + alpha_t m2) / (sqrt(nu) / sqrt(1 - beta2^t) + eps)

``alpha_t``, ``beta3_t`` and the bias corrections come from the host. Bytes per element (fp32 params): 8-bit 18.1,
32-bit 36.
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param_as, store_slot, tile_coords
from .divide import div_by, reciprocal
from .launch import Bucket, Unsupported, Update, scalar
from .registry import Kernel

__all__ = ["TRITON", "ademamix_update", "launch", "slots"]


@triton.jit
def ademamix_update(
    g, m1, m2, nu, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3, alpha, eps, bc1, bc2_sqrt
):
    """fp32 AdEMAMix math on a tile: returns (m1, m2, nu, direction); ``p_new = p * decay - lr * direction``."""
    m1 = tl.fma(g, one_minus_beta1, m1 * beta1)
    m2 = tl.fma(g, one_minus_beta3, m2 * beta3)
    nu = tl.fma(one_minus_beta2 * g, g, nu * beta2)  # torch's addcmul: fma(value * t1, t2, self)
    mixed = tl.math.div_rn(m1, bc1) + m2 * alpha
    # sqrt(nu) is 0 or at least 2^-75: div_by is IEEE's division there, with one reciprocal per program
    denom = div_by(tl.sqrt_rn(nu), bc2_sqrt, reciprocal(bc2_sqrt)) + eps
    return m1, m2, nu, tl.math.div_rn(mixed, denom)


@triton.jit
def _ademamix_tile(
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    book_u,
    lut_u,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    beta3,
    one_minus_beta3,
    alpha,
    eps,
    bc1,
    bc2_sqrt,
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
    m1 = load_slot(row, 3, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    m2 = load_slot(row, 5, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    nu = load_slot(row, 7, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, COLS)
    m1, m2, nu, d = ademamix_update(
        g, m1, m2, nu, beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3, alpha, eps, bc1, bc2_sqrt
    )
    store_slot(m1, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_slot(m2, row, 5, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_slot(nu, row, 7, offs, mask, blocks, bmask, book_u, lut_u, False, FMT, ALIGNED, MASKED, COLS)
    # p.add_(d, alpha=-lr) after p.mul_(decay): one fma, as torch's add with alpha on the CPU
    store_param_as(tl.fma(d, neg_lr, p * decay), p, row, offs, mask, P_DTYPE, ALIGNED, MASKED, UPDATE, W)


@triton.jit
def _ademamix_kernel(
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
    beta3,
    one_minus_beta3,
    alpha,
    eps,
    bc1,
    bc2_sqrt,
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
    COLS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if full:
        _ademamix_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            beta3,
            one_minus_beta3,
            alpha,
            eps,
            bc1,
            bc2_sqrt,
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
        _ademamix_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            beta3,
            one_minus_beta3,
            alpha,
            eps,
            bc1,
            bc2_sqrt,
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
    return ("exp_avg", "exp_avg_slow", "exp_avg_sq")


def launch(u: Update, bucket: Bucket) -> None:
    """One multi-tensor launch over the bucket (the step's scalars from the host: AdEMAMix is not capturable)."""
    if u.steps is not None:
        raise Unsupported("AdEMAMix's warm-ups are made on the host (no capturable step)")
    kw = u.kwargs
    beta1, beta2 = kw["betas"][0], kw["betas"][1]
    beta3 = kw["beta3_t"]
    args = (
        beta1,
        1.0 - beta1,
        beta2,
        1.0 - beta2,
        beta3,
        1.0 - beta3,
        scalar(kw["alpha_t"]),
        scalar(kw["eps"]),
        kw["bias_correction1"],
        kw["bias_correction2_sqrt"],
        -scalar(kw["lr"]),
        scalar(u.decay),
    )
    bucket.tile_launch(_ademamix_kernel, slots(u.record.hyper), args, writes=True, update=u)


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="ademamix:TRITON")``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch, any_rounding=True)
