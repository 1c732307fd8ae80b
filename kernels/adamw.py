"""Fused Adam / AdamW step (reference: :func:`lowmemopt.optim.adamw.adam_math`), one pass per tile in registers::

    m = lerp(m, g, 1 - beta1);   v = beta2 v + (1 - beta2) g^2   (v_max = max(v_max, v) if amsgrad)
    p <- p * (1 - lr wd) [decoupled]  +  (-lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

Bytes per element (fp32 params): param read + written 8, grad 4, state read + written: fp32 16, bf16 8, q8 4 (+ 16
bytes of absmax per 256-element block): 8-bit AdamW moves 16.06 B/element (18.1 with amsgrad), 32-bit 28.
"""

from __future__ import annotations

from typing import Any, Mapping

import triton
import triton.language as tl

from .codec import load_grad, load_param, load_slot, store_param_as, store_slot, tensor_scalar, tile_coords
from .divide import div_by, reciprocal
from .launch import Bucket, Update, scalars
from .registry import Kernel

__all__ = ["TRITON", "adam_update", "launch", "slots"]


@triton.jit
def lerp(a, b, w):
    """torch.lerp's formula (as its vectorized CPU kernel computes it, with one fused multiply-add)."""
    return tl.where(w < 0.5, tl.fma(w, b - a, a), tl.fma(w - 1.0, b - a, b))


@triton.jit
def adam_update(
    p,
    g,
    m,
    v,
    vmax,
    w1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    step_size,
    bc2_sqrt,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    L2_DECAY: tl.constexpr,
):
    """fp32 Adam math on a tile: returns (m, v, v_max, delta), ``p_new = p * decay + delta``."""
    if MAXIMIZE:
        g = -g
    if L2_DECAY:
        g = tl.fma(p, weight_decay, g)
    m = lerp(m, g, w1)
    v = tl.fma(one_minus_beta2 * g, g, v * beta2)  # torch's addcmul: fma(value * t1, t2, self)
    if AMSGRAD:
        vmax = tl.maximum(vmax, v)
        root = tl.sqrt_rn(vmax)
    else:
        root = tl.sqrt_rn(v)
    # sqrt(v) is 0 or at least 2^-75: div_by is IEEE's division there, with one reciprocal per program
    denom = div_by(root, bc2_sqrt, reciprocal(bc2_sqrt)) + eps
    return m, v, vmax, tl.math.div_rn(m * step_size, denom)


@triton.jit
def _adam_tile(
    row,
    offs,
    mask,
    blocks,
    bmask,
    book_s,
    lut_s,
    book_u,
    lut_u,
    w1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    step_size,
    bc2_sqrt,
    decay,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    L2_DECAY: tl.constexpr,
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
    v = load_slot(row, 5, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, COLS)
    if AMSGRAD:
        vmax = load_slot(row, 7, offs, mask, blocks, bmask, book_u, False, FMT, ALIGNED, MASKED, COLS)
    else:
        vmax = v
    m, v, vmax, delta = adam_update(
        p,
        g,
        m,
        v,
        vmax,
        w1,
        beta2,
        one_minus_beta2,
        eps,
        weight_decay,
        step_size,
        bc2_sqrt,
        AMSGRAD,
        MAXIMIZE,
        L2_DECAY,
    )
    store_slot(m, row, 3, offs, mask, blocks, bmask, book_s, lut_s, True, FMT, ALIGNED, MASKED, COLS)
    store_slot(v, row, 5, offs, mask, blocks, bmask, book_u, lut_u, False, FMT, ALIGNED, MASKED, COLS)
    if AMSGRAD:
        store_slot(vmax, row, 7, offs, mask, blocks, bmask, book_u, lut_u, False, FMT, ALIGNED, MASKED, COLS)
    store_param_as(p * decay + delta, p, row, offs, mask, P_DTYPE, ALIGNED, MASKED, UPDATE, W)


@triton.jit
def _adam_kernel(
    units,
    table,
    book_s,
    lut_s,
    book_u,
    lut_u,
    w1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,
    step_size,
    bc2_sqrt,
    decay,
    W: tl.constexpr,
    FMT: tl.constexpr,
    P_DTYPE: tl.constexpr,
    G_DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    UPDATE: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    L2_DECAY: tl.constexpr,
    scal=None,
    DEVICE_SCALARS: tl.constexpr = False,
    COLS: tl.constexpr = False,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    t, row, numel, offs, mask, blocks, bmask, full = tile_coords(units, table, W, ROWS, BLOCK, COLS)
    if DEVICE_SCALARS:  # a capturable step: each tensor's (step size, bias correction, decay) from the device
        step_size = tensor_scalar(scal, t, 3, 0)
        bc2_sqrt = tensor_scalar(scal, t, 3, 1)
        decay = tensor_scalar(scal, t, 3, 2)
    if full:
        _adam_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            w1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            step_size,
            bc2_sqrt,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            AMSGRAD,
            MAXIMIZE,
            L2_DECAY,
            UPDATE,
            W,
            False,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )
    else:
        _adam_tile(
            row,
            offs,
            mask,
            blocks,
            bmask,
            book_s,
            lut_s,
            book_u,
            lut_u,
            w1,
            beta2,
            one_minus_beta2,
            eps,
            weight_decay,
            step_size,
            bc2_sqrt,
            decay,
            FMT,
            P_DTYPE,
            G_DTYPE,
            ALIGNED,
            AMSGRAD,
            MAXIMIZE,
            L2_DECAY,
            UPDATE,
            W,
            True,
            COLS,
            gmul=gmul,
            G_MULT=G_MULT,
        )


def slots(hyper: Mapping[str, Any]) -> tuple[str, ...]:
    return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if hyper["amsgrad"] else ("exp_avg", "exp_avg_sq")


def launch(u: Update, bucket: Bucket) -> None:
    """One multi-tensor launch over the bucket (capturable: step scalars made on the device)."""
    kw = u.kwargs
    beta1, beta2 = kw["betas"]
    if u.steps is None:
        wd, lr, eps, decay = scalars(kw["weight_decay"], kw["lr"], kw["eps"], u.decay)
        stepping = (-lr / kw["bias_correction1"], kw["bias_correction2_sqrt"], decay)
        scal = None
    else:
        wd, eps = scalars(kw["weight_decay"], kw["eps"])
        stepping = (0.0, 0.0, 0.0)  # read from scal
        scal = bucket.scalars(-kw["lr"] / kw["bias_correction1"], kw["bias_correction2_sqrt"], u.decay)
    args = (1.0 - beta1, beta2, 1.0 - beta2, eps, wd, *stepping)
    bucket.tile_launch(
        _adam_kernel,
        slots(u.record.hyper),
        args,
        writes=True,
        update=u,
        AMSGRAD=bool(kw["amsgrad"]),
        scal=scal,
        MAXIMIZE=bool(kw["maximize"]),
        L2_DECAY=wd != 0 and not kw["decoupled_weight_decay"],
    )


#: the kernel as :func:`.registry.lookup` finds it (``KernelSet(triton="adamw:TRITON")``)
TRITON = Kernel(lambda hyper, p: slots(hyper), launch, any_rounding=True)


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("adam", _adam_kernel, v.tile(AMSGRAD=True, MAXIMIZE=True, L2_DECAY=True, UPDATE=v.NEAREST)),
        v.Variant(
            "adam-stochastic",
            _adam_kernel,
            v.tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.STOCHASTIC, W=17),
        ),
        v.Variant(
            "adam-arith",
            _adam_kernel,  # v.runtime.Q8_DECODE = "arithmetic": no code books
            v.tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.NEAREST, book_s=None, book_u=None),
        ),
        # a capturable step: the step's scalars read per tensor from the device (lowmemopt.work.capture)
        v.Variant(
            "adam-capturable",
            _adam_kernel,
            v.tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.NEAREST, DEVICE_SCALARS=True),
        ),
        # 8-bit tiles laid out [BLOCK, ROWS] (v.runtime.column_tiles: the default before Triton 3.7)
        v.Variant(
            "adam-cols",
            _adam_kernel,
            v.tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.NEAREST, COLS=True),
        ),
        v.Variant(
            "adam-fp32-state",
            _adam_kernel,
            v.tile(AMSGRAD=False, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.NEAREST, FMT=v.FP32),
        ),
        # 4-bit state (block 128): nibble packing (reshape / split / join) and the 2-D nibble gathers
        v.Variant("adam-q4", _adam_kernel, v.tile4(AMSGRAD=True, MAXIMIZE=False, L2_DECAY=False, UPDATE=v.NEAREST)),
    ]
