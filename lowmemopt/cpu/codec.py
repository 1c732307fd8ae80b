"""The 8-bit code books in the forms the C kernels use.

lowmemopt's rounding rule (:mod:`lowmemopt.quant.maps`: nearest code in fp32 arithmetic, ties to the lower code, a
positive value never takes ``udynamic``'s zero code) is monotone in the value: between neighbouring codes ``i`` and
``i + 1`` there is one first float that takes ``i + 1``, the decision threshold ``thr[i]``. They are found here by
bisection over the ordered fp32 bit patterns against :func:`~lowmemopt.quant.maps.nearest_code_reference` (the brute
force specification), so they are that rule and nothing else.

The kernels encode with arithmetic instead of a lookup per element (:class:`ArithTables`): the dynamic maps are decades
``10^(k-6) [0.1, 1]`` of ``n_k`` evenly spaced codes, so inside decade ``k`` the code's offset is ``floor(|y| S_k -
A_k)``, and the decade follows from ``|y|``'s binary exponent and one compare with the exact threshold between the two
decades a binade can meet. Values that land within ``eps`` of a boundary are resolved by the exact bucket table of
:mod:`lowmemopt.quant.maps`. The tests compare the kernels' codes with the brute force search on random values and on
every threshold and its neighbours.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from ..quant.formats import map_for
from ..quant.maps import code_book, encode_table, nearest_code_reference

__all__ = ["ArithTables", "Tables", "arith_tables", "decision_thresholds", "tables"]


def _key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys that order fp32 values (bit patterns of negatives mirrored; -0 and +0 share key 0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_key(k: torch.Tensor) -> torch.Tensor:
    bits = torch.where(k >= 0, k, (-k) | 0x80000000)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def decision_thresholds(name: str) -> torch.Tensor:
    """fp32 [256]: ``thr[i]`` is the smallest float whose code is > i (``i < 255``); ``thr[255]`` is NaN (never
    reached). Sorted ascending."""
    book = code_book(name)
    idx = torch.arange(255)

    def code(k: torch.Tensor) -> torch.Tensor:
        return nearest_code_reference(_from_key(k), name)

    lo, hi = _key(book[:-1].clone()), _key(book[1:].clone())
    if not (torch.equal(code(lo), idx) and torch.equal(code(hi), idx + 1)):
        raise AssertionError(f"code book {name!r}: a code does not encode to itself")
    while bool((hi - lo > 1).any()):  # invariant: code(lo) <= i < code(hi)
        mid = (lo + hi) // 2
        high = code(mid) > idx
        hi, lo = torch.where(high, mid, hi), torch.where(high, lo, mid)
    thr = torch.empty(256, dtype=torch.float32)
    thr[:255] = _from_key(hi)
    thr[255] = float("nan")
    return thr


#: a position t within EPS of an integer is near a code boundary: resolved by the exact table (2^-16 still gives the
#: exact codes for every float; 2^-14 leaves a margin and sends ~3% of 256-element blocks to the table)
EPS = 2.0**-14
#: binade class of |y| = biased fp32 exponent - BIN_BIAS, saturated at 0: class 0 holds everything below 2^-30 (below
#: the first decade of both maps), class 31 is [1, 2) (|y| <= 1 after scaling)
BIN_BIAS, BIN_CLASSES = 96, 32


class ArithTables(ctypes.Structure):
    """Mirror of ``struct lmo_arith`` in ``kernels.c``. Decade index ``d``: 0 the zero code, 1..7 the decades
    ``k = d - 1``, 8 the code 1.0."""

    _fields_ = [
        ("bin_decade", ctypes.c_int32 * 32),
        ("bin_bound", ctypes.c_float * 32),
        ("bin_bound_neg", ctypes.c_float * 32),
        ("dec_s", ctypes.c_float * 16),
        ("dec_a", ctypes.c_float * 16),
        ("dec_base", ctypes.c_int32 * 16),
        ("dec_nmax", ctypes.c_int32 * 16),
        ("eps", ctypes.c_float),
        ("mirror", ctypes.c_int32),
    ]


def _next_up(x: float) -> float:
    t = torch.tensor(x, dtype=torch.float32)
    return float(torch.nextafter(t, torch.tensor(float("inf"))))


def arith_tables(name: str) -> ArithTables:
    """The arithmetic encoder's tables for map ``name`` (positive side; a signed map mirrors negatives)."""
    signed = name == "dynamic"
    book, thr = code_book(name), decision_thresholds(name)
    zero = int(torch.nonzero(book == 0)[0])
    t = ArithTables()
    # decades on the positive side: index d = k + 1, codes base .. base + n - 1 = 10^(k-6) mids(linspace(0.1, 1, n+1))
    starts, starts_neg = [], []  # first |y| of decade index d = 1..8, for positive and for negative y
    base = zero + 1
    for d in range(16):
        t.dec_s[d], t.dec_a[d], t.dec_base[d], t.dec_nmax[d] = 0.0, -0.5, zero, 0  # t = 0.5: offset 0, no boundary
    for k in range(7):
        n = 2**k if signed else 2 ** (k + 1)
        scale = 10.0 ** (k - 6)
        t.dec_s[k + 1] = n / (0.9 * scale)
        t.dec_a[k + 1] = 0.1 * n / 0.9
        t.dec_base[k + 1], t.dec_nmax[k + 1] = base, n - 1
        starts.append(float(thr[base - 1]))
        # a negative y < thr[254 - base] takes a code of decade k or below: |y| >= next_up(|thr[254 - base]|)
        starts_neg.append(_next_up(-float(thr[254 - base])) if signed else starts[-1])
        base += n
    if base != 255:
        raise AssertionError(f"code book {name!r} is not a dynamic map")
    t.dec_base[8] = 255
    starts.append(float(thr[254]))
    starts_neg.append(starts[-1])  # no negative code beyond the most negative decade: both give code 0
    for b in range(32):
        low = 0.0 if b == 0 else 2.0 ** (b + BIN_BIAS - 127)
        high = 2.0 ** (b + 1 + BIN_BIAS - 127)
        t.bin_decade[b] = sum(x <= low for x in starts)
        if t.bin_decade[b] != sum(x <= low for x in starts_neg):
            raise AssertionError(f"code book {name!r}: a mirrored decade threshold crosses a binade")
        for bounds, field in ((starts, t.bin_bound), (starts_neg, t.bin_bound_neg)):
            inside = [x for x in bounds if low < x < high]
            if len(inside) > 1:
                raise AssertionError(f"code book {name!r}: binade class {b} meets more than two decades")
            field[b] = inside[0] if inside else float("nan")
    t.eps, t.mirror = EPS, 254 if signed else 0
    return t


class Tables(NamedTuple):
    book: torch.Tensor  # fp32 [256]: decode
    planes: torch.Tensor  # uint8 [4, 256]: the book's bytes, plane k = byte k (little-endian) of each value
    packed: torch.Tensor  # int32 [65536]: exact encode (lowmemopt.quant.maps)
    arith: ArithTables  # fast encode


@functools.lru_cache(maxsize=None)
def tables(signed: bool) -> Tables:
    """The tables of the map a slot of this signedness uses, kept alive here (the kernels receive their addresses)."""
    name = map_for(signed)
    book = code_book(name).contiguous()
    planes = book.view(torch.uint8).view(256, 4).t().contiguous()
    return Tables(book, planes, encode_table(name).packed.contiguous(), arith_tables(name))


def run_codec(fn: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> bool:
    """``lmo_encode`` (fp32 rows ``x`` -> codes, absmax) or ``lmo_decode`` (codes, absmax -> fp32 rows ``x``)."""
    from . import applies, build, ffi

    ok = (
        applies(x)
        and x.dim() == 2
        and x.dtype == torch.float32
        and codes.dtype == torch.uint8
        and absmax.dtype == torch.float32
        and x.shape == codes.shape
        and absmax.shape == x.shape[:1]
        and 16 <= x.shape[1] <= ffi.MAX_BLOCK
        and x.shape[1] % 16 == 0
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (x, codes, absmax))
    )
    if not ok:
        return False
    p, g = (None, x) if fn == "lmo_encode" else (x, None)
    ffi.call(getattr(build.library(), fn), ffi.args_for(p, g, x.shape[0], x.shape[1], [ffi.slot_q8(codes, absmax, signed)]))
    return True
