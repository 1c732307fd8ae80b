"""Block-wise 4-bit quantization: 16-code maps (``pow2x4`` signed, ``upow2x4`` zero-free), exact nearest-code
encoding, two codes per byte (element ``2i`` in the low nibble of byte ``i``)::

    encode:  absmax_b = max(max_b x / book[-1], min_b x / book[0])      (signed; unsigned: max_b x)
             code_i = nearest(x_i / absmax_b)                            (absmax_b = 0: the block is all 0)
    decode:  x_i ~= book[code_i] * absmax_b

The layout, the maps and how they were chosen: docs/state_format.md#4-bit-maps.
"""

from __future__ import annotations

import functools
import sys

import torch

__all__ = [
    "MAPS",
    "map4_for",
    "code_book",
    "encode_table",
    "thresholds",
    "nearest_code4_reference",
    "packed_len",
    "encode_into",
    "decode_into",
    "quantize",
    "dequantize",
    "quantize_reference",
]


#: mantissa bits per binade, top binade ``[1/2, 1)`` first: binade ``k`` holds ``2^-(k+1) (1 + j / 2^b_k)``. The
#: signed map keeps the top 7 magnitudes of its grid (:func:`pow2_grid`).
POW2X4_BITS = {"pow2x4": (1, 1, 0, 0, 0), "upow2x4": (1, 1, 1, 1, 1, 0, 0, 0, 0, 0)}


def pow2_grid(bits: tuple[int, ...]) -> list[float]:
    """The magnitudes of a pow2 grid, ascending: binade ``k`` holds ``2^-(k+1) (1 + j / 2^bits[k])``."""
    return sorted(2.0 ** -(k + 1) * (1 + j / 2**b) for k, b in enumerate(bits) for j in range(2**b))


def signed_codes(magnitudes: list[float]) -> list[float]:
    """A signed 16-code map from 7 magnitudes below 1: 0, the magnitudes, their negatives, and 1."""
    return [0.0, 1.0] + list(magnitudes) + [-g for g in magnitudes]


#: the 16 codes of each 4-bit map (sorted on registration). The choice: docs/state_format.md#4-bit-maps.
MAPS: dict[str, tuple[float, ...]] = {}
SIGNED_MAPS: set[str] = set()


def register_map(name: str, codes: list[float], signed: bool) -> None:
    """Add a 16-code map (``bench/fourbit.py`` measures candidates this way)."""
    codes = sorted(float(torch.tensor(c, dtype=torch.float32)) for c in codes)
    if len(codes) != 16 or len(set(codes)) != 16 or codes[-1] != 1.0:
        raise ValueError(f"a 4-bit map needs 16 distinct codes ending in 1, got {codes}")
    MAPS[name] = tuple(codes)
    if signed:
        SIGNED_MAPS.add(name)
    else:
        SIGNED_MAPS.discard(name)
    _book.cache_clear()
    _thresholds.cache_clear()
    _table.cache_clear()
    for key in [k for k in _device_cache if k[1] == name]:
        del _device_cache[key]


def is_signed(name: str) -> bool:
    return name in SIGNED_MAPS


def map4_for(signed: bool) -> str:
    """The 4-bit map a slot of this signedness is stored in."""
    return "pow2x4" if signed else "upow2x4"


@functools.lru_cache(maxsize=None)
def _book(name: str) -> torch.Tensor:
    if name not in MAPS:
        raise ValueError(f"unknown 4-bit map {name!r}; expected one of {sorted(MAPS)}")
    return torch.tensor(MAPS[name], dtype=torch.float32)


_device_cache: dict[tuple[str, str, torch.device], torch.Tensor] = {}


def _on(kind: str, name: str, device, make) -> torch.Tensor:
    key = (kind, name, torch.device(device))
    t = _device_cache.get(key)
    if t is None:
        t = _device_cache[key] = make(name).to(key[2])
    return t


def code_book(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 codes of map ``name``, ascending (fp32, cached on ``device``; do not modify)."""
    return _on("book", name, device, _book)


def _rule(y: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """The rounding rule on a batch: the lower code of the bracketing pair unless the upper one is strictly nearer."""
    hi = torch.searchsorted(book, y).clamp(1, book.numel() - 1)
    lo = hi - 1
    idx = torch.where((y - book[hi]).abs() < (y - book[lo]).abs(), hi, lo)
    return torch.where(y < book[0], torch.zeros_like(idx), idx)


def _key(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64, monotone in the value (-0 and +0 both 0)."""
    i = x.view(torch.int32).to(torch.int64)
    return torch.where(i >= 0, i, -(i & 0x7FFFFFFF))


def _unkey(k: torch.Tensor) -> torch.Tensor:
    i = torch.where(k >= 0, k, (-k) | 0x80000000)
    i = torch.where(i >= 2**31, i - 2**32, i)
    return i.to(torch.int32).view(torch.float32)


@functools.lru_cache(maxsize=None)
def _thresholds(name: str) -> torch.Tensor:
    book = _book(name)
    lo, hi = _key(book[:-1].clone()), _key(book[1:].clone())  # rule(book[j]) = j, rule(book[j + 1]) = j + 1
    target = torch.arange(1, 16)
    for _ in range(34):  # bisection over bit patterns: the first float whose code is >= j + 1
        mid = (lo + hi) // 2
        up = _rule(_unkey(mid), book) >= target
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    return _unkey(hi)


def thresholds(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 15 floats ``t_j`` where the rule switches from code ``j`` to ``j + 1``: ``code(y) = #{t_j <= y}``, exact."""
    return _on("thr", name, device, _thresholds)


def nearest_code4_reference(y: torch.Tensor, name: str) -> torch.Tensor:
    """Brute force (the specification): argmin of ``|y - code|`` in fp32, ties to the lower code."""
    book = code_book(name, y.device)
    dist = (y.reshape(-1, 1).float() - book.reshape(1, -1)).abs()
    return dist.argmin(dim=1).reshape(y.shape)  # argmin returns the first minimum: the lower code on a tie


def packed_len(numel: int) -> int:
    return (numel + 1) // 2


def _scale(x: torch.Tensor, book: torch.Tensor, signed: bool) -> torch.Tensor:
    low, high = torch.aminmax(x, dim=1)
    if not signed:
        return high.clamp_min(0.0)
    return torch.maximum(high / book[-1], low / book[0])


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes -> uint8 [ceil(n / 2)], element 2i in the low nibble of byte i.

    As little-endian int16 pairs ``v``, the byte is ``(v | v >> 4) & 0xFF``: 2.5x faster on the CPU than strided
    gathers."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    if sys.byteorder != "little":  # (no big-endian machine runs torch today; the plain form, for completeness)
        pairs = codes.view(-1, 2)
        return pairs[:, 0] | (pairs[:, 1] << 4)
    v = codes.view(torch.int16)
    return (v | (v >> 4)).to(torch.uint8)  # int16 -> uint8 keeps the low byte


def _pair_table(name: str) -> torch.Tensor:
    book = _book(name)
    b = torch.arange(256)
    return torch.stack((book[b & 15], book[b >> 4]), dim=1).contiguous()


def _unpack(nibbles: torch.Tensor, n: int) -> torch.Tensor:
    """uint8 [ceil(n / 2)] -> int64 codes [n] (tests and converters; decoding uses :func:`_pair_table`)."""
    both = torch.stack((nibbles & 15, nibbles >> 4), dim=1).view(-1)
    return both[:n].to(torch.int64)


@functools.lru_cache(maxsize=None)
def _table(name: str) -> torch.Tensor:
    """The 8-bit codec's bucket table for a 4-bit map (one threshold per bucket at most)."""
    from .maps import EncodeTable

    thr = _thresholds(name)
    b = torch.arange(65536, dtype=torch.int64)
    negative = b >= 32768
    first, last = b << 16, (b << 16) | 0xFFFF
    to_i32 = lambda v: torch.where(v >= 2**31, v - 2**32, v).to(torch.int32)  # noqa: E731
    y_low = to_i32(torch.where(negative, last, first)).view(torch.float32)  # the bucket's smallest value
    y_high = to_i32(torch.where(negative, first, last)).view(torch.float32)
    finite = torch.isfinite(y_low) & torch.isfinite(y_high)
    c_low = torch.bucketize(torch.where(finite, y_low, 0.0), thr, right=True)
    c_high = torch.bucketize(torch.where(finite, y_high, 0.0), thr, right=True)
    if bool((c_high - c_low > 1).any()):
        raise AssertionError(f"4-bit map {name!r}: a bucket holds two thresholds; the table does not apply")
    inside = finite & (c_high > c_low)
    threshold = torch.where(inside, thr[c_low.clamp(max=14)], torch.tensor(float("inf")))
    return EncodeTable(name, torch.where(finite, c_low, 0).to(torch.uint8), threshold).packed


def encode_table(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`_table` of map ``name`` on ``device`` (int32 [65536], cached; do not modify)."""
    return _on("table", name, device, _table)


def _encode_rows(
    x: torch.Tensor, book: torch.Tensor, table: torch.Tensor, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    from .blockwise import encode_rows

    codes, scale = encode_rows(x, book, table, signed)
    return codes.view(-1), scale


def encode_into(x: torch.Tensor, name: str, block_size: int, nibbles: torch.Tensor, absmax: torch.Tensor) -> None:
    """Quantize flat fp32 ``x`` (from a block boundary) into ``nibbles`` and ``absmax``."""
    n = x.numel()
    if n == 0:
        return
    book, thr, signed = code_book(name, x.device), encode_table(name, x.device), is_signed(name)
    full = n // block_size
    parts, scales = [], []
    if full:
        codes, scale = _encode_rows(x[: full * block_size].view(full, block_size), book, thr, signed)
        parts.append(codes)
        scales.append(scale)
    if n > full * block_size:  # ragged last block: its scale from its own elements
        codes, scale = _encode_rows(x[full * block_size :].view(1, -1), book, thr, signed)
        parts.append(codes)
        scales.append(scale)
    codes = parts[0] if len(parts) == 1 else torch.cat(parts)
    nibbles.copy_(_pack(codes))
    absmax.copy_(scales[0] if len(scales) == 1 else torch.cat(scales))


def decode_into(nibbles: torch.Tensor, absmax: torch.Tensor, name: str, block_size: int, out: torch.Tensor) -> None:
    """Dequantize ``nibbles`` and ``absmax`` into the flat fp32 ``out``."""
    n = out.numel()
    if n == 0:
        return
    pairs = _on("pairs", name, out.device, _pair_table)
    full = n // block_size
    if n % 2 == 0:
        torch.index_select(pairs, 0, nibbles.to(torch.int32), out=out.view(-1, 2))
    else:
        out.copy_(pairs[nibbles.to(torch.int32)].view(-1)[:n])
    if full:
        out[: full * block_size].view(full, block_size).mul_(absmax[:full].unsqueeze(1))
    if n > full * block_size:
        out[full * block_size :].mul_(absmax[full])


def _check_block(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"4-bit block_size must be an even int >= 2, got {block_size!r}")


def quantize(x: torch.Tensor, name: str = "pow2x4", block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape or dtype) -> (nibbles uint8 [ceil(numel / 2)], absmax fp32 [n_blocks])."""
    _check_block(block_size)
    flat = x.detach().reshape(-1).float().contiguous()
    nibbles = torch.empty(packed_len(flat.numel()), dtype=torch.uint8, device=x.device)
    absmax = torch.empty((flat.numel() + block_size - 1) // block_size, dtype=torch.float32, device=x.device)
    encode_into(flat, name, block_size, nibbles, absmax)
    return nibbles, absmax


def dequantize(
    nibbles: torch.Tensor, absmax: torch.Tensor, numel: int, name: str = "pow2x4", block_size: int = 128
) -> torch.Tensor:
    """Inverse of :func:`quantize` (up to rounding): fp32 [numel]."""
    _check_block(block_size)
    if nibbles.dtype != torch.uint8 or nibbles.numel() != packed_len(numel):
        raise ValueError(
            f"nibbles must be uint8 with {packed_len(numel)} bytes for {numel} elements, got "
            f"{nibbles.dtype} with {nibbles.numel()}"
        )
    if absmax.numel() != (numel + block_size - 1) // block_size:
        raise ValueError(
            f"absmax has {absmax.numel()} blocks; {numel} elements at block_size {block_size} need "
            f"{(numel + block_size - 1) // block_size}"
        )
    out = torch.empty(numel, dtype=torch.float32, device=nibbles.device)
    decode_into(nibbles.reshape(-1), absmax.float(), name, block_size, out)
    return out


def quantize_reference(
    x: torch.Tensor, name: str = "pow2x4", block_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: per-block scale, brute-force nearest codes (int64, unpacked); tests only."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = (n + block_size - 1) // block_size
    book = code_book(name, x.device)
    scale = (
        torch.stack(
            [
                _scale(flat[b * block_size : (b + 1) * block_size].view(1, -1), book, is_signed(name))[0]
                for b in range(nb)
            ]
        )
        if nb
        else torch.zeros(0)
    )
    div = torch.where(scale > 0, scale, torch.ones_like(scale)).repeat_interleave(block_size)[:n]
    return nearest_code4_reference(flat / div, name), scale


# the state maps (docs/state_format.md#4-bit-maps)
register_map("pow2x4", signed_codes(pow2_grid(POW2X4_BITS["pow2x4"])[-7:]), signed=True)
register_map("upow2x4", pow2_grid(POW2X4_BITS["upow2x4"]) + [1.0], signed=False)
