"""Fused LAMB step (reference: ``optim.lamb.lamb_math``, ColossalAI semantics) in two passes::

    m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2;   r = m / (sqrt(v) + eps) + wd p
    trust = ||p|| / ||r|| (1 if either is 0, or adam=True);        p <- p - lr * lr_scale * trust * r

Pass 1 sums p^2 and r^2 per tensor; pass 2 recomputes m', v', r bit-identically and applies (docs/kernels.md#kernels).
FusedLAMB's flags (Apex's multi_tensor_lamb): ``CLIP`` divides g by the global-norm clip read on the device; ``L2``
adds ``wd p`` to the gradient instead of ``r``; ``BIAS``: ``(m / bc1) / (sqrt(v / bc2) + eps)``.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param, store_slot, tensor_scalar, tile_coords
from .launch import Bucket, Unsupported, Update, scalar
from .registry import Kernel

__all__ = ["TRITON", "lamb_direction", "launch", "slots"]


@triton.jit
def lamb_direction(
    p,
    g,
    m,
    v,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    DECAY: tl.constexpr,
    clip=1.0,
    bc1=1.0,
    bc2=1.0,
    CLIP: tl.constexpr = False,
    L2: tl.constexpr = False,
    BIAS: tl.constexpr = False,
):
    """fp32 LAMB math on a tile -> (m, v, r), the update before the trust ratio."""
    if CLIP:
        g = tl.math.div_rn(g, clip)
    if L2:
        g = tl.fma(p, weight_decay, g)
    m = tl.fma(g, one_minus_beta1, m * beta1)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # torch's addcmul: fma(value * t1, t2, self)
    if BIAS:
        r = tl.math.div_rn(tl.math.div_rn(m, bc1), tl.sqrt_rn(tl.math.div_rn(v, bc2)) + eps)
    else:
        r = tl.math.div_rn(m, tl.sqrt_rn(v) + eps)
    if DECAY:
        r = tl.fma(p, weight_decay, r)
    return m, v, r


@triton.jit
def _lamb_tile(
    t,
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    book_u,
    lut_u,
    sums,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    neg_lr,
    clip,
    bc1,
    bc2,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    DECAY: tl.constexpr,
    TRUST: tl.constexpr,
    APPLY: tl.constexpr,
    WEIGHT: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
    CLIP: tl.constexpr,
    L2: tl.constexpr,
    BIAS: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """Pass 1 (``APPLY=False``): the tensor's sum(p^2), sum(r^2); pass 2: update p, m, v."""
    p = load_param(row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    g = load_grad(row, offs, mask, G_DTYPE, ALIGNED, MASKED, gmul, G_MULT)
    m = load_slot(row, 3, offs, mask, blocks, bmask, book_s, True, FMT, ALIGNED, MASKED, COLS)
    v = load_slot(row, 5, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, COLS)
    m, v, r = lamb_direction(
        p,
        g,
        m,
        v,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        weight_decay,
        DECAY,
        clip,
        bc1,
        bc2,
        CLIP,
        L2,
        BIAS,
    )
    if APPLY:
        coef = neg_lr
        if TRUST:
            if WEIGHT:
                w_norm = tl.load(sums + 2 * t)
            else:
                w_norm = tl.sqrt_rn(tl.load(sums + 2 * t))
            r_norm = tl.sqrt_rn(tl.load(sums + 2 * t + 1))
            usable = (w_norm > 0) & (r_norm > 0)
            trust = tl.where(usable, tl.math.div_rn(w_norm, tl.where(usable, r_norm, 1.0)), 1.0)
            coef = trust * neg_lr
        store_slot(m, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
        store_slot(v, row, 5, offs, mask, blocks, bmask, book_u, lut_u, False, FMT, ALIGNED, MASKED, COLS)
        store_param(p + r * coef, row, offs, mask, P_DTYPE, ALIGNED, MASKED)
    else:
        if MASKED:
            r = tl.where(mask, r, 0.0)
        if not WEIGHT:
            tl.atomic_add(sums + 2 * t, tl.sum(tl.sum(p * p, axis=1), axis=0))
        tl.atomic_add(sums + 2 * t + 1, tl.sum(tl.sum(r * r, axis=1), axis=0))


@triton.jit
def _lamb_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    sums,
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    neg_lr,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    DECAY: tl.constexpr,
    TRUST: tl.constexpr,
    APPLY: tl.constexpr,
    WEIGHT: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    COLS: tl.constexpr = False,
    clip_ptr=None,
    bc1=1.0,
    bc2=1.0,
    CLIP: tl.constexpr = False,
    L2: tl.constexpr = False,
    BIAS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    clip = 1.0
    if CLIP:  # FusedLAMB: the step's global-norm clip, a device scalar
        clip = tl.load(clip_ptr)
    if DEVICE_SCALARS:  # a capturable step: -lr (bias corrections folded in) from the device
        neg_lr = tensor_scalar(scal, t, 1, 0)
    if full:
        _lamb_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            sums,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            neg_lr,
            clip,
            bc1,
            bc2,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            DECAY,
            TRUST,
            APPLY,
            WEIGHT,
            False,
            COLS,
            CLIP,
            L2,
            BIAS,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _lamb_tile(
            t,
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            sums,
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            neg_lr,
            clip,
            bc1,
            bc2,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            DECAY,
            TRUST,
            APPLY,
            WEIGHT,
            True,
            COLS,
            CLIP,
            L2,
            BIAS,
            gmul=gmul,
            G_MULT=G_MULT,
        )


def _fused_lamb_flags(kw: dict, l2: bool, device_steps: bool, bucket: Bucket) -> dict:
    """FusedLAMB's launch keywords: the clip divisor's device scalar, L2 mode, Apex's bias corrections."""
    out = {}
    clip = kw.get("grad_divisor", 1.0)
    if not isinstance(clip, (int, float)) or clip != 1.0:
        if not isinstance(clip, torch.Tensor):
            clip = torch.tensor(float(clip), dtype=torch.float32, device=bucket.device)
        out.update(clip_ptr=clip.to(device=bucket.device, dtype=torch.float32), CLIP=True)
    if l2:
        out["L2"] = True
    bc1, bc2 = kw.get("bias_correction1", 1.0), kw.get("bias_correction2", 1.0)
    if bc1 != 1.0 or bc2 != 1.0:
        if device_steps or isinstance(bc1, torch.Tensor):
            raise Unsupported("FusedLAMB's bias corrections are host scalars (not a capturable step)")
        out.update(bc1=float(bc1), bc2=float(bc2), BIAS=True)
    return out


def slots(hyper: Mapping[str, Any]) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq")


def launch(u: Update, bucket: Bucket) -> None:
    kw = u.kwargs
    beta1, beta2 = kw["betas"]
    wd = scalar(kw["weight_decay"])
    if u.steps is None:
        neg_lr, scal = -(scalar(kw["lr"]) * kw["lr_scale"]), None
    else:  # a capturable step: read from scal
        neg_lr, scal = 0.0, bucket.scalars(-(kw["lr"] * kw["lr_scale"]))
    sums = bucket.accumulators(2)
    weight = bucket.weights is not None
    if weight:
        sums[:, 0] = bucket.weights
    averaging = kw.get("grad_averaging", True)
    args = (sums, beta1, 1.0 - beta1 if averaging else 1.0, beta2, 1.0 - beta2, scalar(kw["eps"]), wd, neg_lr)
    trust = not kw["adam"]
    decoupled = kw.get("adam_w_mode", True)
    flags = dict(DECAY=wd != 0 and decoupled, WEIGHT=weight, scal=scal)
    flags.update(_fused_lamb_flags(kw, wd != 0 and not decoupled, u.steps is not None, bucket))
    if trust:
        bucket.tile_launch(_lamb_kernel, slots(u.record.hyper), args, writes=False, TRUST=True, APPLY=False, **flags)
    bucket.tile_launch(_lamb_kernel, slots(u.record.hyper), args, writes=True, TRUST=trust, APPLY=True, **flags)


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="lamb:TRITON")``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("lamb-cols", _lamb_kernel, v.tile(DECAY=True, TRUST=True, APPLY=True, COLS=True)),
        v.Variant("lamb", _lamb_kernel, v.tile(DECAY=True, TRUST=True, APPLY=True)),
        v.Variant("lamb-capturable", _lamb_kernel, v.tile(DECAY=True, TRUST=True, APPLY=True, DEVICE_SCALARS=True)),
    ]
