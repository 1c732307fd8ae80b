"""The 8- and 4-bit code books in the forms the C kernels use: decision thresholds found by bisection against
``quant.maps.nearest_code_reference`` (so they are that rule and nothing else), and the ``pow2`` / ``upow2`` bit
encoder's tables (``pow2_code`` in ``csrc/vectors_*.h``). How the kernels encode: docs/cpu_kernels.md#exactness.
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple

import torch

from ..quant import q4
from ..quant.formats import map_for
from ..quant.maps import POW2_BITS, code_book, encode_table, is_signed_map, nearest_code_reference

__all__ = ["Pow2Tables", "Tables", "Tables4", "pow2_tables", "decision_thresholds", "tables", "tables4"]


def _key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys that order fp32 values (-0 and +0 share key 0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_key(k: torch.Tensor) -> torch.Tensor:
    bits = torch.where(k >= 0, k, (-k) | 0x80000000)
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)
    return bits.to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def decision_thresholds(name: str) -> torch.Tensor:
    """fp32 [256]: ``thr[i]`` the smallest float whose code is > i; ``thr[255]`` NaN. Ascending."""
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


class Pow2Tables(ctypes.Structure):
    """Mirror of ``struct lmo_pow2`` (``csrc/lmo.h``): the bit encoder's addends and shifts."""

    _fields_ = [
        ("add", ctypes.c_uint32 * 32),
        ("shift", ctypes.c_uint32 * 32),
        ("e_lo", ctypes.c_int32),
        ("mirror", ctypes.c_int32),
    ]


def pow2_tables(name: str) -> Pow2Tables:
    """The bit encoder's tables for ``pow2`` / ``upow2``.

    With ``nb`` binades of codes the exponent classes are ``e_lo = 125 - nb`` (everything that takes the zero or
    smallest code), ``e_lo + 1`` (split at the mid point of 0 and the smallest code), the binades, and 127 (code 1.0).
    Each addend folds its class's first code in, so ``(bits + add) >> shift`` is the code (mod 2^32).
    """
    if name not in POW2_BITS:
        raise ValueError(f"no bit encoder for map {name!r}")
    bits = POW2_BITS[name]
    signed = is_signed_map(name)
    nb = len(bits)
    e_lo = 125 - nb
    if 127 - e_lo >= 32:
        raise AssertionError(f"map {name!r}: {nb} binades do not fit 32 exponent classes")
    zero = int(torch.nonzero(code_book(name) == 0)[0])  # signed: magnitude m has code zero + m
    t = Pow2Tables()
    t.e_lo, t.mirror = e_lo, 2 * zero if signed else 0

    def put(e: int, shift: int, rounding: int, first_code: int) -> None:
        # (e << 23 + mantissa + neg + add) >> shift == first_code + ((mantissa + neg + rounding) >> shift)
        t.add[e & 31] = (rounding + (first_code << shift) - (e << 23)) % 2**32
        t.shift[e & 31] = shift

    put(e_lo, 24, 0, zero if signed else 1)  # (mantissa + neg) < 2^24: one code
    # the smallest code m_1 = 2^(e_lo + 2 - 127): its class's first float is the mid point of 0 and m_1 (a tie: the
    # lower code, 0 for positive y, -m_1 for negative y); unsigned: always m_1
    put(e_lo + 1, 23, (1 << 23) - 1 if signed else 1 << 23, zero)
    base = 1  # magnitude index of the lowest binade's first code
    for k in range(nb - 1, -1, -1):
        b = bits[k]
        put(126 - k, 23 - b, (1 << (22 - b)) - 1, zero + base)
        base += 2**b
    put(127, 24, 0, zero + base)  # 1.0 (base: its magnitude index)
    return t


class Tables(NamedTuple):
    book: torch.Tensor  # fp32 [256]: decode
    planes: torch.Tensor  # uint8 [4, 256]: the book's bytes, plane k = byte k (little-endian) of each value
    packed: torch.Tensor  # int32 [65536]: exact encode (lowmemopt.quant.maps; the portable build)
    pow2: Pow2Tables  # the bit encoder (the AVX-512 build)


@functools.lru_cache(maxsize=None)
def tables(signed: bool) -> Tables:
    """The tables of the map of a slot of this signedness, kept alive here (the kernels get their addresses)."""
    name = map_for(signed)
    book = code_book(name).contiguous()
    planes = book.view(torch.uint8).view(256, 4).t().contiguous()
    return Tables(book, planes, encode_table(name).packed.contiguous(), pow2_tables(name))


class Tables4(NamedTuple):
    book: torch.Tensor  # fp32 [16]: decode
    thr: torch.Tensor  # fp32 [16]: q4.thresholds (code(y) = #{thr <= y}), then NaN (the AVX-512 encoder)
    packed: torch.Tensor  # int32 [65536]: q4's exact bucket table (the portable build's encoder)


@functools.lru_cache(maxsize=None)
def tables4(signed: bool) -> Tables4:
    """The 4-bit map of a slot of this signedness in the kernels' forms, kept alive here."""
    name = q4.map4_for(signed)
    thr = torch.cat([q4.thresholds(name), torch.tensor([float("nan")])]).contiguous()
    return Tables4(q4.code_book(name).clone().contiguous(), thr, q4.encode_table(name).contiguous())
