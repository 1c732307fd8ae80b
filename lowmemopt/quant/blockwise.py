"""Block-wise 8-bit quantization: an fp32 scale (``absmax``) per block of ``block_size`` elements of the flat tensor,
each element the uint8 index of its nearest code in an 8-bit map (:mod:`lowmemopt.quant.maps`)::

    encode:  absmax_b = max(max_b x / book[-1], min_b x / book[0])     (signed map; unsigned: max_b x)
             code_i = nearest(x_i / absmax_b)                           (absmax_b = 0: the block is all 0)
    decode:  x_i ~= book[code_i] * absmax_b

Why the scale keeps both extremes: docs/state_format.md#8-bit-maps. On the CPU full blocks go through the native codec
(:mod:`lowmemopt.cpu`) where it is built; :func:`quantize_blockwise_reference` is the specification.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .maps import code_book, encode_table, is_signed_map, nearest_code_reference

__all__ = [
    "num_blocks",
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_blockwise_reference",
    "encode_into",
    "decode_into",
    "encode_rows",
    "decode_rows",
    "block_scale",
]


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


def _block_views(flat: torch.Tensor, block_size: int) -> list[torch.Tensor]:
    """2-D views [n_blocks, block] of a flat tensor: the full blocks, then the ragged tail (if any)."""
    n = flat.numel()
    full = n // block_size
    views = []
    if full:
        views.append(flat[: full * block_size].view(full, block_size))
    if n - full * block_size:
        views.append(flat[full * block_size :].view(1, -1))
    return views


def block_scale(x: torch.Tensor, book: torch.Tensor, signed: bool) -> torch.Tensor:
    """Per-row scale of fp32 blocks ``x`` [nb, bs] so that both extremes are representable."""
    low, high = torch.aminmax(x, dim=1)
    if not signed:
        return high.clamp_min(0.0)
    return torch.maximum(high / book[-1], low / book[0])


def encode_rows(
    x: torch.Tensor, book: torch.Tensor, packed: torch.Tensor, signed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 blocks [nb, bs] -> (uint8 codes [nb, bs], fp32 scale [nb]): pure tensor ops, a table lookup each."""
    scale = block_scale(x, book, signed)
    y = x / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
    u = y.view(torch.int32)
    entry = packed[torch.bitwise_right_shift(u, 16).bitwise_and(0xFFFF)]
    t = u.bitwise_and(0xFFFF).bitwise_xor(torch.bitwise_right_shift(u, 31).bitwise_and(0xFFFF))
    code = torch.bitwise_right_shift(entry, 17) + (t >= entry.bitwise_and(0x1FFFF)).to(torch.int32)
    return code.to(torch.uint8), scale


def decode_rows(codes: torch.Tensor, scale: torch.Tensor, book: torch.Tensor) -> torch.Tensor:
    """Dequantize codes [nb, bs] with per-row ``scale`` [nb] -> fp32 [nb, bs]. Pure tensor ops."""
    return book[codes.to(torch.int32)] * scale.unsqueeze(1)


class RowCodec(Protocol):
    """A faster row codec for some tensors; returns False where it does not apply (the next one runs)."""

    def encode(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, name: str) -> bool: ...

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, name: str) -> bool: ...


#: the registered row codecs, tried in order of priority: the native CPU kernels (:mod:`lowmemopt.cpu`, priority 0),
#: the ``torch.compile``-d codec (:mod:`lowmemopt.compiled`, 10). They register themselves when imported, so this
#: storage layer imports no backend.
ROW_CODECS: list[tuple[int, RowCodec]] = []


def register_row_codec(codec: RowCodec, priority: int) -> None:
    """Add ``codec`` to :data:`ROW_CODECS` (lower ``priority`` tried first)."""
    ROW_CODECS.append((priority, codec))
    ROW_CODECS.sort(key=lambda pc: pc[0])


def _encode_blocks(x: torch.Tensor, name: str, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    for _, codec in ROW_CODECS:
        if codec.encode(x, codes, absmax, name):
            return
    book, table, signed = code_book(name, x.device), encode_table(name, x.device).packed, is_signed_map(name)
    code, scale = encode_rows(x, book, table, signed)
    codes.copy_(code)
    absmax.copy_(scale)


def encode_into(x: torch.Tensor, name: str, block_size: int, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """Quantize fp32 ``x`` (flat, contiguous) into preallocated flat ``codes`` (uint8) and ``absmax`` (fp32)."""
    first = 0
    for xv, cv in zip(_block_views(x, block_size), _block_views(codes, block_size)):
        _encode_blocks(xv, name, cv, absmax[first : first + xv.shape[0]])
        first += xv.shape[0]


def decode_into(codes: torch.Tensor, absmax: torch.Tensor, name: str, block_size: int, out: torch.Tensor) -> None:
    """Dequantize flat ``codes`` with per-block ``absmax`` into the flat fp32 tensor ``out``."""
    book = code_book(name, codes.device)
    first = 0
    for cv, ov in zip(_block_views(codes, block_size), _block_views(out, block_size)):
        scale = absmax[first : first + ov.shape[0]]
        first += ov.shape[0]
        if ov.shape[1] == block_size and any(codec.decode(cv, scale, ov, name) for _, codec in ROW_CODECS):
            continue
        torch.index_select(book, 0, cv.reshape(-1).int(), out=ov.view(-1))
        ov.mul_(scale.unsqueeze(1))


def quantize_blockwise(x: torch.Tensor, name: str = "pow2", block_size: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any shape, layout, floating dtype) -> (codes uint8 [numel], absmax fp32 [n_blocks])."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    flat = x.detach().reshape(-1).float().contiguous()
    codes = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(flat.numel(), block_size), dtype=torch.float32, device=x.device)
    encode_into(flat, name, block_size, codes, absmax)
    return codes, absmax


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, name: str = "pow2", block_size: int = 256, shape=None
) -> torch.Tensor:
    """Inverse of :func:`quantize_blockwise` (up to rounding); returns fp32 of ``shape`` (default: flat)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if absmax.numel() != num_blocks(codes.numel(), block_size):
        raise ValueError(
            f"absmax has {absmax.numel()} blocks but {codes.numel()} codes at block_size={block_size} "
            f"need {num_blocks(codes.numel(), block_size)}"
        )
    out = torch.empty(codes.numel(), dtype=torch.float32, device=codes.device)
    decode_into(codes.reshape(-1), absmax.float(), name, block_size, out)
    return out if shape is None else out.view(shape)


def quantize_blockwise_reference(
    x: torch.Tensor, name: str = "pow2", block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification: per-block absmax, then a brute-force nearest-code search (slow; for tests)."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    nb = num_blocks(n, block_size)
    padded = torch.zeros(nb * block_size, dtype=torch.float32, device=x.device)
    padded[:n] = flat
    blocks = padded.view(nb, block_size)
    # the padding zeros cannot change a block's scale: it is >= 0 and zeros lie inside [min, max] scaled
    absmax = block_scale(blocks, code_book(name, x.device), is_signed_map(name))
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    y = blocks / scale.unsqueeze(1)
    codes = nearest_code_reference(y, name).to(torch.uint8).reshape(-1)[:n]
    return codes, absmax
