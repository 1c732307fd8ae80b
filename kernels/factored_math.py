"""Device functions of the fused Adafactor and CAME passes (:mod:`.factored`): the launch table's columns, where an
element's row and column factors are, the factored and full-size preconditioning, and the update clip's denominator.
"""

from __future__ import annotations

import triton
import triton.language as tl

# launch-table columns (one row per tensor); constexpr so that kernels may read them
_M, _V, _R, _C, _SQ, _RES, _ROFF, _COFF = (tl.constexpr(i) for i in (3, 5, 7, 8, 9, 11, 13, 14))
_W = 15


@triton.jit
def sqrt_numel(numel):
    """fp32(sqrt(numel)) computed in fp64, as the reference's ``math.sqrt(t.numel())``."""
    return tl.sqrt(numel.to(tl.float64)).to(tl.float32)  # fp64 sqrt is correctly rounded


@triton.jit
def clip_denominator(sums, t, numel, clip_threshold):
    """``max(RMS(u) / clip_threshold, 1)`` from the tensor's sum(u^2)."""
    rms = tl.math.div_rn(tl.sqrt_rn(tl.load(sums + 2 * t + 1)), sqrt_numel(numel))
    return tl.maximum(tl.math.div_rn(rms, clip_threshold), 1.0)


@triton.jit
def factor_coords(row, offs, blocks, bmask, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Where the row and column factors of flat offsets ``offs`` of a ``[..., R, C]`` tensor are (row index
    ``roff + offs // C``, column ``coff + (offs // (R C)) C + offs % C``), per ``BLOCK``-element segment.

    ``WIDE`` (``C >= BLOCK``): a segment crosses at most one row, so the divisions are made once per segment
    (``rows`` [ROWS], ``wrap`` [ROWS, BLOCK]: on the next row, ``after`` [ROWS]: it exists); else ``rows`` per element.
    """
    roff = tl.load(row + _ROFF)
    coff = tl.load(row + _COFF)
    R = tl.load(row + _R)
    C = tl.load(row + _C)
    if WIDE:
        start = blocks.to(tl.int64) * BLOCK  # [ROWS]: each segment's first flat offset
        q = start // C  # its row in the whole batch of matrices
        mi = q // R  # its matrix
        c = (start - q * C)[:, None] + tl.arange(0, BLOCK)[None, :]
        wrap = c >= C  # past the row's end: the next row (of the next matrix after row R - 1)
        c = tl.where(wrap, c - C, c)
        nxt = (q - mi * R)[:, None] + wrap.to(tl.int64) >= R
        rows = roff + q
        after = bmask & (q + 1 < tl.load(row + 2) // C)
        cols = coff + (mi[:, None] + nxt.to(tl.int64)) * C + c
    else:
        rows = roff + offs // C
        wrap = offs < 0  # (unused)
        after = bmask
        cols = coff + (offs // (R * C)) * C + offs % C
    return rows, wrap, after, cols


@triton.jit
def factored_precondition(x, rfac, cfac, rows, wrap, after, cols, mask, bmask, WIDE: tl.constexpr):
    """``rfac[row(i)] * cfac[col(i)] * x``: the factored ``x / sqrt(V)`` at :func:`factor_coords`' places."""
    if WIDE:
        here = tl.load(rfac + rows, mask=bmask, other=0.0)
        nxt = tl.load(rfac + rows + 1, mask=after, other=0.0)
        r = tl.where(wrap, nxt[:, None], here[:, None])
    else:
        r = tl.load(rfac + rows, mask=mask, other=0.0)
    return (r * tl.load(cfac + cols, mask=mask, other=0.0)) * x


@triton.jit
def full_precondition(g, v, eps1, beta2, one_minus_beta2):
    """1-D params: ``v' = beta2 v + (1 - beta2)(g^2 + eps1)``; returns (v', g / sqrt(v'))."""
    v = tl.fma(g * g + eps1, one_minus_beta2, v * beta2)
    return v, tl.math.div_rn(1.0, tl.sqrt_rn(v)) * g


@triton.jit
def matrix_tile(units, table, W: tl.constexpr, TR: tl.constexpr, BC: tl.constexpr):
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
def matrix_precondition(g, rfac, cfac, roff, coff, grow, cidx, r_mask, c_mask):
    """``rfac[row] cfac[col] g`` on a :func:`matrix_tile`, each factor loaded once per tile row or column."""
    return (
        tl.load(rfac + roff + grow, mask=r_mask, other=0.0)[:, None]
        * tl.load(cfac + coff + cidx, mask=c_mask, other=0.0)[None, :]
    ) * g
