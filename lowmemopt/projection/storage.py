"""How GaLore's bases are stored, by the group key ``proj_bits``: 32 (fp32, the default), 16 (bf16), 8 or 4 (block-wise
codes and an fp32 scale per block: :mod:`lowmemopt.quant.formats`' ``q8`` / ``q4`` under the basis' key, signed maps,
:data:`BLOCK_SIZE`). A product decodes the basis it needs to fp32 and drops it; at 32 bits the stored tensor serves
as it is. Numbers and the default: docs/galore.md#the-basis-stored-smaller.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..quant.formats import BF16, FP32, Q4, Q8, StateFormat, default_block_size, format_of

__all__ = [
    "PROJ_BITS",
    "BLOCK_SIZE",
    "format_for",
    "stored_bits",
    "stored_at",
    "fits",
    "init_basis",
    "decode_basis",
    "decode_basis_into",
    "encode_basis",
    "round_trip",
    "stored_entries",
    "store_at",
]

PROJ_BITS = (32, 16, 8, 4)
_FORMATS: dict[int, StateFormat] = {32: FP32, 16: BF16, 8: Q8, 4: Q4}
#: elements per scale of a quantized basis, by ``proj_bits`` (the state's defaults: 256 at 8 bits, 128 at 4)
BLOCK_SIZE = {8: default_block_size(8), 4: default_block_size(4)}


def format_for(bits: int) -> StateFormat:
    """The format a basis of ``proj_bits=bits`` is stored in."""
    return _FORMATS[bits]


def _block(fmt: StateFormat) -> int:
    return BLOCK_SIZE.get(fmt.bits, 1)


def stored_bits(state: dict[str, Any], key: str) -> int:
    """The ``proj_bits`` basis ``key`` of ``state`` is stored at (read from its keys and dtype)."""
    return format_of(state, key).bits


def stored_at(state: dict[str, Any], key: str, bits: int) -> bool:
    """Is basis ``key`` of ``state`` stored as ``proj_bits=bits`` stores it?"""
    return format_of(state, key) is _FORMATS[bits]


def fits(state: dict[str, Any], key: str, shape: tuple[int, int]) -> bool:
    """Are basis ``key``'s stored tensors in ``state`` the sizes a basis of ``shape`` has in its format?"""
    try:
        fmt = format_of(state, key)
    except KeyError:
        return False
    if fmt in (FP32, BF16):
        return tuple(state[key].shape) == tuple(shape)
    ranges = fmt.key_ranges(key, 0, math.prod(shape), _block(fmt))
    return all(k in state and state[k].numel() == hi - lo for k, (lo, hi) in ranges.items())


def init_basis(state: dict[str, Any], key: str, shape: tuple[int, int], bits: int, device: torch.device) -> None:
    """A zero basis ``key`` of ``shape`` in ``state``, stored at ``bits``."""
    fmt = format_for(bits)
    fmt.init(state, key, torch.Size(shape), device, _block(fmt))


def decode_basis(state: dict[str, Any], key: str, shape: tuple[int, int]) -> torch.Tensor:
    """Basis ``key`` as an fp32 tensor of ``shape``: the stored tensor itself at 32 bits, else a decoded copy."""
    fmt = format_of(state, key)
    if fmt is FP32:
        return state[key]
    if fmt is BF16:
        return state[key].float()
    return fmt.decode(state, key, 0, math.prod(shape), True, _block(fmt)).view(shape)


def decode_basis_into(state: dict[str, Any], key: str, out: torch.Tensor) -> None:
    """Decode basis ``key`` into the contiguous tensor ``out`` of its shape (any floating dtype)."""
    fmt = format_of(state, key)
    if fmt in (FP32, BF16):
        out.copy_(state[key])
    elif out.dtype == torch.float32:
        out.view(-1).copy_(fmt.decode(state, key, 0, out.numel(), True, _block(fmt)))
    else:
        out.copy_(decode_basis(state, key, tuple(out.shape)))


def encode_basis(state: dict[str, Any], key: str, value: torch.Tensor) -> None:
    """Store the fp32 matrix ``value`` (any strides) as basis ``key``, in the format it is stored in."""
    fmt = format_of(state, key)
    if fmt in (FP32, BF16):
        state[key].copy_(value)
    else:
        fmt.encode(state, key, 0, value.numel(), value.reshape(-1).contiguous(), True, _block(fmt))


def round_trip(value: torch.Tensor, bits: int) -> torch.Tensor:
    """What a basis ``value`` (fp32) decodes to once stored at ``bits`` (``value`` itself at 32)."""
    if bits == 32:
        return value
    probe: dict[str, Any] = {}
    init_basis(probe, "b", tuple(value.shape), bits, value.device)
    encode_basis(probe, "b", value)
    return decode_basis(probe, "b", tuple(value.shape))


def stored_entries(key: str, shape: tuple[int, int], bits: int) -> dict[str, tuple[str, list[int]]]:
    """The tensors basis ``key`` of ``shape`` is stored as at ``bits``: ``{stored key: (safetensors dtype, shape)}``
    (a file keeps a 16-bit basis as fp32: lossless)."""
    fmt = format_for(bits)
    if fmt in (FP32, BF16):
        return {key: ("F32", list(shape))}
    numel = math.prod(shape)
    return {
        k: ("U8" if k.endswith((".codes", ".nibbles")) else "F32", [hi - lo])
        for k, (lo, hi) in fmt.key_ranges(key, 0, numel, _block(fmt)).items()
    }


def store_at(state: dict[str, Any], shapes: dict[str, tuple[int, int]], bits: int) -> None:
    """Store the bases of ``shapes`` in ``state`` (a parameter's state or its ``galore.*`` entries) at ``bits``, in
    place: a basis stored otherwise is decoded and re-encoded (its old tensors dropped); one at ``bits`` is kept."""
    for key, shape in shapes.items():
        fmt = format_of(state, key)
        if fmt is _FORMATS[bits]:
            continue
        value = decode_basis(state, key, shape).float()
        for k in fmt.keys(key):
            del state[k]
        init_basis(state, key, shape, bits, value.device)
        encode_basis(state, key, value)
