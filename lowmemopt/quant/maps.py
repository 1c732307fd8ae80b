"""8-bit code books (``pow2`` / ``upow2`` for state; bitsandbytes' ``dynamic`` / ``udynamic`` to read old state) and
their exact nearest-code bucket tables. The maps, the rounding rule and the table: docs/state_format.md#8-bit-maps.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "dynamic_map",
    "pow2_map",
    "pow2_magnitudes",
    "code_book",
    "EncodeTable",
    "encode_table",
    "nearest_code_reference",
    "is_signed_map",
    "MAP_NAMES",
    "POW2_BITS",
]

MAP_NAMES = ("pow2", "upow2", "dynamic", "udynamic")
_SIGNED = ("pow2", "dynamic")

#: mantissa bits per binade of the ``pow2`` maps, top binade ``[0.5, 1)`` first (docs/state_format.md#8-bit-maps).
#: Chosen on measured Adam state for the least error in ``m / sqrt(v)``, keeping the smallest code near the dynamic
#: maps' (5.5e-7, 3.3e-7).
POW2_BITS = {
    "pow2": (5, 4, 4, 4, 4, 3, 3, 1, 1) + (0,) * 11,
    "upow2": (5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 3, 3, 1, 1, 1) + (0,) * 8,
}


def is_signed_map(name: str) -> bool:
    """Whether map ``name`` holds negative codes (its block scale covers both extremes)."""
    return name in _SIGNED


def pow2_magnitudes(bits: tuple[int, ...]) -> list[float]:
    """The positive grid codes of a ``pow2`` map, ascending: binade ``k`` holds ``2^-(k+1) (1 + j / 2^bits[k])``."""
    mags = []
    for k, b in enumerate(bits):
        mags += [2.0 ** -(k + 1) * (1 + j / 2**b) for j in range(2**b)]
    return sorted(mags)


def pow2_map(signed: bool) -> torch.Tensor:
    """The 256-entry ``pow2`` (signed) or ``upow2`` code book, sorted ascending (fp32, CPU)."""
    grid = pow2_magnitudes(POW2_BITS["pow2" if signed else "upow2"])
    values = ([-x for x in grid] if signed else []) + [0.0] + grid + [1.0]
    assert len(values) == 256 and len(set(values)) == 256, len(values)
    return torch.tensor(sorted(values), dtype=torch.float32)


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256-entry dynamic code book, sorted ascending (fp32, CPU)."""
    values: list[float] = [0.0, 1.0]
    for k in range(7):  # decade 10**(k - 6)
        n = 2**k if signed else 2 ** (k + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scaled = ((10.0 ** (k - 6)) * mids).tolist()
        values += scaled
        if signed:
            values += [-v for v in scaled]
    assert len(values) == 256, len(values)
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.lru_cache(maxsize=None)
def _cpu_code_book(name: str) -> torch.Tensor:
    if name not in MAP_NAMES:
        raise ValueError(f"unknown quantization map {name!r}; expected one of {MAP_NAMES}")
    if name in POW2_BITS:
        return pow2_map(signed=is_signed_map(name))
    return dynamic_map(signed=is_signed_map(name))


_device_cache: dict[tuple[str, torch.device], object] = {}


def code_book(name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """The code book ``name`` on ``device`` (cached; do not modify)."""
    device = torch.device(device)
    key = ("book:" + name, device)
    if key not in _device_cache:
        _device_cache[key] = _cpu_code_book(name).to(device)
    return _device_cache[key]  # type: ignore[return-value]


def _never_zero(name: str) -> bool:
    return not is_signed_map(name)


def nearest_code_reference(y: torch.Tensor, name: str) -> torch.Tensor:
    """Brute-force nearest code (the specification, tests only): argmin of ``|y - code|`` in fp32."""
    book = code_book(name, y.device)
    flat = y.reshape(-1, 1).float()
    dist = (flat - book.reshape(1, -1)).abs()
    if _never_zero(name):
        zero_idx = int(torch.nonzero(book == 0)[0])
        dist[(flat[:, 0] > 0), zero_idx] = float("inf")
    return dist.argmin(dim=1).reshape(y.shape)


class EncodeTable:
    """Bucket tables for exact nearest-code encoding of fp32 values."""

    def __init__(self, name: str, lo: torch.Tensor, threshold: torch.Tensor):
        self.name = name
        self.lo = lo  # uint8 [65536]: code chosen below the threshold
        self.threshold = threshold  # fp32 [65536]: first float that takes code lo + 1 (+inf: none, -inf: all)
        self.packed = _pack(lo, threshold)  # int32 [65536]: lo << 17 | threshold's position in its bucket

    def to(self, device: torch.device) -> "EncodeTable":
        return EncodeTable(self.name, self.lo.to(device), self.threshold.to(device))


def _pack(lo: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    bits = threshold.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    negative = torch.arange(65536, device=lo.device) >= 32768
    t = bits & 0xFFFF
    t = torch.where(negative, t ^ 0xFFFF, t)
    t = torch.where(torch.isposinf(threshold), torch.full_like(t, 0x10000), t)
    t = torch.where(torch.isneginf(threshold), torch.zeros_like(t), t)
    return ((lo.to(torch.int64) << 17) | t).to(torch.int32)


def _choose(y: torch.Tensor, name: str) -> torch.Tensor:
    """The rounding rule on a batch: sorted search, then the nearer of the two bracketing codes."""
    book = _cpu_code_book(name)
    hi = torch.searchsorted(book, y).clamp(1, 255)
    lo = hi - 1
    d_lo = (y - book[lo]).abs()
    d_hi = (y - book[hi]).abs()
    idx = torch.where(d_hi < d_lo, hi, lo)
    below = y < book[0]
    idx = torch.where(below, torch.zeros_like(idx), idx)
    if _never_zero(name):
        zero_idx = int(torch.nonzero(book == 0)[0])
        idx = torch.where((y > 0) & (idx == zero_idx), torch.full_like(idx, zero_idx + 1), idx)
    return idx


def _bits_to_float(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _build_table(name: str) -> EncodeTable:
    # Each bucket b covers the fp32 bit patterns [b << 16, (b << 16) | 0xFFFF]. Within a bucket the float values are
    # monotone in the bit pattern (increasing for sign 0, decreasing for sign 1). Order each bucket's patterns by value.
    buckets = torch.arange(65536, dtype=torch.int64)
    negative = buckets >= 32768
    first = buckets << 16
    last = first | 0xFFFF
    # The bit patterns of each bucket's smallest and largest value.
    low_bits = torch.where(negative, last, first)
    high_bits = torch.where(negative, first, last)
    to_i32 = lambda b: torch.where(b >= 2**31, b - 2**32, b)  # noqa: E731
    y_low = _bits_to_float(to_i32(low_bits))
    y_high = _bits_to_float(to_i32(high_bits))
    finite = torch.isfinite(y_low) & torch.isfinite(y_high)
    y_low = torch.where(finite, y_low, torch.zeros_like(y_low))
    y_high = torch.where(finite, y_high, torch.zeros_like(y_high))
    c_low = _choose(y_low, name)
    c_high = _choose(y_high, name)
    steps = c_high - c_low
    if bool((steps > 1).any()):
        raise AssertionError(f"map {name!r}: a bucket spans more than one rounding boundary; tables do not apply")
    # Bisect (in "value order" offsets 0..65535) for the first float that takes c_high.
    lo_off = torch.zeros(65536, dtype=torch.int64)  # takes c_low
    hi_off = torch.full((65536,), 65535, dtype=torch.int64)  # takes c_high (when steps == 1)

    def value_at(off: torch.Tensor) -> torch.Tensor:
        bits = torch.where(negative, last - off, first + off)
        return _bits_to_float(to_i32(bits))

    for _ in range(17):
        mid = (lo_off + hi_off) // 2
        takes_high = _choose(value_at(mid), name) == c_high
        hi_off = torch.where(takes_high, mid, hi_off)
        lo_off = torch.where(takes_high, lo_off, mid)
    threshold = value_at(hi_off)
    threshold = torch.where(steps == 1, threshold, torch.full_like(threshold, float("inf")))
    # A bucket whose low end already takes the higher code (possible only if lo_off never moved).
    starts_high = (steps == 1) & (_choose(y_low, name) == c_high)
    threshold = torch.where(starts_high, torch.full_like(threshold, float("-inf")), threshold)
    lo = torch.where(finite, c_low, torch.zeros_like(c_low)).to(torch.uint8)
    threshold = torch.where(finite, threshold, torch.full_like(threshold, float("inf")))
    return EncodeTable(name, lo, threshold)


@functools.lru_cache(maxsize=None)
def _cpu_encode_table(name: str) -> EncodeTable:
    _cpu_code_book(name)  # validates the name
    return _build_table(name)


def encode_table(name: str, device: torch.device | str = "cpu") -> EncodeTable:
    """Nearest-code bucket tables for ``name`` on ``device`` (built once, ~0.1 s, then cached)."""
    device = torch.device(device)
    key = ("table:" + name, device)
    if key not in _device_cache:
        _device_cache[key] = _cpu_encode_table(name).to(device)
    return _device_cache[key]  # type: ignore[return-value]
