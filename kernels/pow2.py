"""Nearest code of the ``pow2`` / ``upow2`` state maps by integer arithmetic on the float's bits (Triton; the C twin
is ``pow2_code`` in ``lowmemopt/cpu/csrc/vectors_*.h``)::

    a = |y|'s bits clamped to [e_lo << 23, 1.0];   code = (a + neg + add_c) >> shift_c        (uint32)

``neg``: 1 for a negative ``y`` (ties to the lower code); class ``c``: the run of binades with equal mantissa bits
holding ``a``, its ``(add, shift)`` gathered from :func:`class_table`. Negative signed ``y``: ``mirror - code``;
unsigned ``y <= 0`` and non-finite ``y``: 0. Why and how it is checked: docs/kernels.md#numerics.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowmemopt.quant.maps import POW2_BITS, is_signed_map

__all__ = [
    "encode_classes",
    "decode_classes",
    "class_rows",
    "class_table",
    "pow2_code",
    "pow2_value",
    "codes",
    "values",
    "NCLASSES",
]

_ONE = 127 << 23  # fp32 bits of 1.0
_NEVER = 0x7FFFFFFF  # a class bound that no clamped |y| reaches (padding)
NCLASSES = 6


@functools.lru_cache(maxsize=None)
def encode_classes(name: str) -> tuple[tuple[int, int, int], ...]:
    """The encoder's classes of ``name``, ascending: ``(first bits, add, shift)``, ``add`` a wrapped int32."""
    if name not in POW2_BITS:
        raise ValueError(f"no bit encoder for map {name!r}")
    bits, signed = POW2_BITS[name], is_signed_map(name)
    nb = len(bits)
    e_lo = 125 - nb
    zero = 127 if signed else 0  # index of the zero code: the signed book holds 127 negative codes
    classes: list[tuple[int, int, int]] = []
    sums: list[int] = []  # rounding + first code << shift: the true sum at the class's first float

    def put(e: int, shift: int, rounding: int, first_code: int) -> None:
        # (e << 23 + m + neg + add) >> shift == first_code + ((m + neg + rounding) >> shift), m: bits above e << 23
        add = (rounding + (first_code << shift) - (e << 23)) % 2**32
        classes.append((e << 23, add - 2**32 if add >= 2**31 else add, shift))
        sums.append(rounding + (first_code << shift))

    # e_lo and e_lo + 1: below the smallest code m_1 = 2^(e_lo + 2 - 127). Signed: the zero code up to the mid point
    # 2^(e_lo + 1 - 127) (a tie: 0 for positive y, -m_1 for negative y), m_1 above; unsigned: always m_1.
    put(e_lo, 24, (1 << 23) - 1 if signed else 0, zero if signed else 1)
    code = zero + 1  # the code of the lowest binade's first value
    k = nb - 1
    while k >= 0:  # runs of binades with equal mantissa bits, lowest first (binade k has exponent 126 - k)
        b = bits[k]
        put(126 - k, 23 - b, (1 << (22 - b)) - 1, code)
        while k >= 0 and bits[k] == b:
            code += 2**b
            k -= 1
    if code != 255 or len(classes) > NCLASSES:
        raise AssertionError(f"map {name!r}: 1.0 takes code {code}, {len(classes)} classes")
    # the true sums (a - first bits + neg + rounding + first code << shift, a < next class) stay below 2^32: the
    # wrapped uint32 addition gives them exactly
    for (lo, _, _), hi, first_sum in zip(classes, [c[0] for c in classes[1:]] + [_ONE + 1], sums):
        if first_sum + hi - lo >= 2**32:
            raise AssertionError(f"map {name!r}: class at {lo:#x} overflows")
    return tuple(classes) + ((_NEVER, 0, 0),) * (NCLASSES - len(classes))


@functools.lru_cache(maxsize=None)
def decode_classes(name: str) -> tuple[tuple[int, int, int], ...]:
    """The inverse's classes ``(first magnitude index, bits offset, shift)``."""
    out = []
    for lo, add, shift in encode_classes(name)[1:]:
        if lo == _NEVER:
            out.append((1 << 30, 0, 0))
            continue
        first = ((lo + add % 2**32) % 2**32) >> shift  # the code of the class's first float, a code value
        i = first - (2**7 - 1 if is_signed_map(name) else 0)
        out.append((i, lo - (i << shift), shift))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def class_rows(name: str) -> tuple[int, ...]:
    """Per binade of a clamped ``|y|``, its class as one int64: ``add`` low, ``shift`` high."""
    classes = [c for c in encode_classes(name) if c[0] != _NEVER]
    e_lo = classes[0][0] >> 23
    rows = []
    for e in range(e_lo, 128):
        _, add, shift = [c for c in classes if c[0] <= e << 23][-1]
        rows.append((shift << 32) | (add % 2**32))
    return tuple(rows)


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def class_table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`class_rows` of map ``name`` as an int64 tensor on ``device`` (cached; do not modify)."""
    key = (name, torch.device(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(class_rows(name), dtype=torch.int64, device=device)
    return _TABLES[key]


E_LO_S: tl.constexpr = tl.constexpr(encode_classes("pow2")[0][0])
E_LO_U: tl.constexpr = tl.constexpr(encode_classes("upow2")[0][0])
ENC_S: tl.constexpr = tl.constexpr(encode_classes("pow2"))
ENC_U: tl.constexpr = tl.constexpr(encode_classes("upow2"))
DEC_S: tl.constexpr = tl.constexpr(decode_classes("pow2"))
DEC_U: tl.constexpr = tl.constexpr(decode_classes("upow2"))
NCLS: tl.constexpr = tl.constexpr(NCLASSES)


@triton.jit
def _class_of(a, CLASSES: tl.constexpr, N: tl.constexpr):
    """(add, shift) of the last class of ``CLASSES[:N]`` starting at or below ``a``."""
    add = tl.full(a.shape, CLASSES[0][1], tl.int32)
    shift = tl.full(a.shape, CLASSES[0][2], tl.int32)
    for i in tl.static_range(1, N):
        hit = a >= CLASSES[i][0]
        add = tl.where(hit, CLASSES[i][1], add)
        shift = tl.where(hit, CLASSES[i][2], shift)
    return add, shift


@triton.jit
def _class(c, table, CLASSES: tl.constexpr, E_LO: tl.constexpr):
    """(add, shift) of clamped bits ``c``: from ``table``, or (None) by compares (:func:`_class_of`)."""
    if table is None:
        add, shift = _class_of(c, CLASSES, NCLS)
    else:
        entry = tl.load(table + ((c >> 23) - (E_LO >> 23)))
        add, shift = entry.to(tl.int32), (entry >> 32).to(tl.int32)
    return add, shift


@triton.jit
def pow2_code(y, SIGNED: tl.constexpr, positive, table):
    """int32 nearest code of fp32 ``y`` in ``pow2`` (``SIGNED``) or ``upow2``, as :mod:`lowmemopt.quant.maps` rounds.

    ``positive`` (unsigned; None: ``y > 0``): whether ``y`` counts as positive (:func:`.divide.quotient_positive`);
    ``table``: the :func:`class_table`, or None (compares)."""
    u = y.to(tl.int32, bitcast=True)
    a = u & 0x7FFFFFFF
    if SIGNED:
        neg = (u >> 31) & 1
        c = tl.minimum(tl.maximum(a, E_LO_S), 0x3F800000)  # 1.0
        add, shift = _class(c, table, ENC_S, E_LO_S)
    else:
        neg = u & 0  # y <= 0 is masked below
        c = tl.minimum(tl.maximum(a, E_LO_U), 0x3F800000)
        add, shift = _class(c, table, ENC_U, E_LO_U)
    s = (c + neg).to(tl.uint32, bitcast=True) + add.to(tl.uint32, bitcast=True)
    code = (s >> shift.to(tl.uint32)).to(tl.int32, bitcast=True)
    if SIGNED:
        code = tl.where(neg != 0, tl.maximum(254 - code, 0), code)
        code = tl.where(a < 0x7F800000, code, 0)
    else:
        if positive is None:
            positive = u > 0
        code = tl.where(positive & (u < 0x7F800000), code, 0)
    return code


@triton.jit
def pow2_value(code, SIGNED: tl.constexpr):
    """fp32 value of int32 ``code`` (0..255) in ``pow2`` (``SIGNED``) or ``upow2``, built from its bits."""
    if SIGNED:
        i = tl.abs(code - 127)
        off, shift = _class_of(i, DEC_S, NCLS - 1)
        bits = tl.where(i > 0, off + (i << shift), 0) | ((code < 127).to(tl.int32) << 31)
    else:
        off, shift = _class_of(code, DEC_U, NCLS - 1)
        bits = tl.where(code > 0, off + (code << shift), 0)
    return bits.to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------------------------------
# standalone launchers (tests, the exhaustive check)


@triton.jit
def _code_kernel(y_ptr, out_ptr, n, table, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, pow2_code(tl.load(y_ptr + offs, mask=mask, other=0.0), SIGNED, None, table), mask=mask)


@triton.jit
def _value_kernel(code_ptr, out_ptr, n, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, pow2_value(tl.load(code_ptr + offs, mask=mask, other=0), SIGNED), mask=mask)


def codes(y: torch.Tensor, name: str, block: int = 1024, table: bool = True) -> torch.Tensor:
    """int32 codes of flat fp32 ``y`` by :func:`pow2_code` (``table=False``: by compares)."""
    y = y.reshape(-1).contiguous()
    if y.dtype != torch.float32:
        raise TypeError(f"pow2 codes need fp32 values, got {y.dtype}")
    out = torch.empty(y.numel(), dtype=torch.int32, device=y.device)
    if y.numel():
        tab = class_table(name, y.device) if table else None
        _code_kernel[(triton.cdiv(y.numel(), block),)](y, out, y.numel(), tab, SIGNED=_signed(name), BLOCK=block)
    return out


def values(c: torch.Tensor, name: str) -> torch.Tensor:
    """fp32 values of int32 codes ``c`` (flat) by :func:`pow2_value`."""
    c = c.reshape(-1).to(torch.int32).contiguous()
    out = torch.empty(c.numel(), dtype=torch.float32, device=c.device)
    if c.numel():
        _value_kernel[(triton.cdiv(c.numel(), 256),)](c, out, c.numel(), SIGNED=_signed(name), BLOCK=256)
    return out


def _signed(name: str) -> bool:
    if name not in POW2_BITS:
        raise ValueError(f"no bit encoder for map {name!r}")
    return is_signed_map(name)
