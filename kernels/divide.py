"""Division by a divisor that many elements share, rounded as IEEE division, in three operations per element
(Markstein's correction of ``x * (1 / b)``). Exactness conditions: docs/kernels.md#numerics.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["reciprocal", "div_by", "row_quotients", "quotient_positive"]


@triton.jit
def reciprocal(b):
    """``RN(1 / b)``, made once per divisor."""
    return tl.math.div_rn(1.0, b)


@triton.jit
def div_by(x, b, r):
    """``RN(x / b)`` with ``r = reciprocal(b)``: exact for normal ``b``, ``r`` and ``|x| >= 2^-102``."""
    q0 = x * r
    return tl.where(tl.abs(q0) < float("inf"), tl.fma(tl.fma(-q0, b, x), r, q0), q0)


@triton.jit
def per_block(v, COLS: tl.constexpr):
    """Per-block values ``v`` [ROWS] broadcastable against a tile ([ROWS, 1]; ``COLS``: [1, ROWS])."""
    if COLS:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def row_quotients(x, s, COLS: tl.constexpr):
    """``x / s[:, None]`` for ``s`` in ``(0, inf]``, ``|x| <= 2 s``: exact where ``|x / s| >= 2^-30``."""
    es = (s.to(tl.int32, bitcast=True) >> 23) & 0xFF
    f = (tl.minimum(318 - es, 254) << 23).to(tl.float32, bitcast=True)
    sn = s * f
    finite = es < 255
    r = tl.where(finite, reciprocal(sn), 0.0)  # an infinite row: q0 = 0, e = x, q = 0 (NaN for infinite x)
    b = tl.where(finite, sn, 0.0)
    xn = x * per_block(f, COLS)
    q0 = xn * per_block(r, COLS)
    return tl.fma(tl.fma(-q0, per_block(b, COLS), xn), per_block(r, COLS), q0)


@triton.jit
def quotient_positive(x, s, COLS: tl.constexpr):
    """Whether ``RN(x / s[:, None]) > 0``, exactly (``x > s 2^-150``)."""
    sb = s.to(tl.int32, bitcast=True)
    es = (sb >> 23) & 0xFF
    t = tl.where(es >= 151, sb - (150 << 23), tl.minimum(s, 16777216.0).to(tl.int32) >> 1)
    t = tl.where(es == 255, 0x7FFFFFFF, t)
    return x.to(tl.int32, bitcast=True) > per_block(t, COLS)
