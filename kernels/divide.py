"""Division by a divisor that many elements share, rounded as IEEE division, without a division per element.

``tl.math.div_rn(x, b)`` costs each element a reciprocal (``MUFU.RCP`` and two Newton fmas), a range check (``FCHK``)
and a branch around a slow path: 11 instructions per element on sm_90. Where one divisor serves a whole row of a tile
(a quantization block's scale) or a whole launch (a bias correction, a tensor's clip), its reciprocal is made once and
each quotient is Markstein's correction of ``x r``::

    r = RN(1 / b);   q0 = RN(x r);   e = x - q0 b  (one fma: exact);   q = RN(q0 + e r)  =  RN(x / b)

three operations per element. The identity holds when ``b``, ``r``, ``x`` and ``q`` are normal and the remainder ``e``
(about ``x 2^-24``) is too, i.e. ``|x| >= 2^-102``; checked on 1.3e9 random and worst-case divisors
(``tests/test_divide.py`` runs the same check under the interpreter, whose ``fma`` rounds once).

* :func:`div_by` (one finite divisor per launch or per program): a kernel uses it only where ``x`` stays out of the
  range that could fail (``sqrt(v)`` is 0 or at least ``2^-75``); where ``x r`` is not finite (``x`` infinite or NaN,
  ``b = 0``, an overflowing quotient) it is IEEE's answer, which the correction would turn into NaN.
* :func:`row_quotients` (one divisor per row, any positive value): the row is first scaled by a power of two
  (exact) that brings its divisor to ``[2^64, 2^65)``, so every quotient of magnitude at least ``2^-30`` is exact
  whatever the divisor; smaller ones may differ from IEEE's in their last bits, which no 8-bit state code can see
  (the smallest code boundary is ``2^-25``; that a positive quotient rounds to 0 is decided exactly by
  :func:`quotient_positive`).
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
    """``RN(x / b)`` with ``r = reciprocal(b)``, for a finite ``b >= 0``: exact for normal ``b``, ``r`` and ``|x| >=
    2^-102`` (module docstring); a non-finite ``x``, a quotient that overflows and ``b = 0`` give IEEE's infinity or
    NaN (``x r`` is not finite there, and is the answer)."""
    q0 = x * r
    return tl.where(tl.abs(q0) < float("inf"), tl.fma(tl.fma(-q0, b, x), r, q0), q0)


@triton.jit
def per_block(v, COLS: tl.constexpr):
    """A tile's per-block values ``v`` [ROWS] broadcastable against the tile: ``[ROWS, 1]`` for a tile [ROWS, BLOCK],
    ``[1, ROWS]`` for a column tile [BLOCK, ROWS] (``COLS``, :func:`.codec.tile_coords`)."""
    if COLS:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def row_quotients(x, s, COLS: tl.constexpr):
    """``x / s[:, None]`` for a tile ``x`` [ROWS, BLOCK] (``COLS``: ``x / s[None, :]`` for [BLOCK, ROWS]) and divisors
    ``s`` [ROWS] in ``(0, inf]`` with ``|x| <= 2 s``: exact wherever ``|x / s| >= 2^-30`` (module docstring), 0 for
    finite ``x`` in an infinite row and NaN for infinite ``x``, as IEEE division gives. The row's power of two ``f =
    2^(191 - e_s)`` (at most ``2^127``; ``e_s`` the biased exponent) moves ``s`` to ``[2^64, 2^65)``, or, below
    ``2^-63``, to at least ``2^-22``: ``x f`` and ``s f`` are exact and their quotient is the same."""
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
    """Whether ``RN(x / s[:, None]) > 0`` for ``x`` [ROWS, BLOCK] (``COLS``: [BLOCK, ROWS], :func:`per_block`) and ``s``
    [ROWS] in ``(0, inf]``, exactly: ``x > s 2^-150`` (2^-150 is half the smallest subnormal; a tie rounds to 0),
    compared on the bit patterns. Where ``s 2^-150`` is normal its pattern is ``s``'s less ``150 << 23``; below, a
    positive ``x`` exceeds it iff its pattern (``x / 2^-149`` for a subnormal) exceeds ``floor(s / 2)``. False for ``x
    <= 0`` and in an infinite row (``x / inf`` is 0, ``inf / inf`` NaN); true for a NaN of positive sign, whose quotient
    is NaN: the caller rejects it."""
    sb = s.to(tl.int32, bitcast=True)
    es = (sb >> 23) & 0xFF
    t = tl.where(es >= 151, sb - (150 << 23), tl.minimum(s, 16777216.0).to(tl.int32) >> 1)
    t = tl.where(es == 255, 0x7FFFFFFF, t)
    return x.to(tl.int32, bitcast=True) > per_block(t, COLS)
