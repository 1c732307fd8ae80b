"""Standalone block-wise quantize / dequantize kernels, 8-bit and 4-bit: code-for-code twins of
:mod:`lowmemopt.quant.blockwise` and :mod:`lowmemopt.quant.q4` on :mod:`.codec`'s device functions.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from lowmemopt.quant import q4
from lowmemopt.quant.blockwise import num_blocks
from lowmemopt.quant.maps import MAP_NAMES, POW2_BITS, code_book, encode_table, is_signed_map

from . import runtime
from .codec import block_scaled, decode_q4, decode_q8, encode_q8, encode_store_q4, table_code
from .pow2 import class_table

__all__ = ["quantize_blockwise_triton", "dequantize_blockwise_triton", "quantize_blockwise4", "dequantize_blockwise4"]


@triton.jit
def block_tile(numel, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """This program's ``ROWS`` blocks: block indices [ROWS], offsets [ROWS, BLOCK] and their mask."""
    blocks = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return blocks, offs, offs < numel


@triton.jit
def _quantize_kernel(
    x_ptr,
    codes_ptr,
    absmax_ptr,
    numel,
    book,
    lut,
    SIGNED: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    POW2: tl.constexpr,
):
    """``POW2``: a state map, ``lut`` its class table; otherwise ``lut`` is the map's bucket table."""
    blocks, offs, mask = block_tile(numel, ROWS, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if POW2:
        codes, scale = encode_q8(x, book, lut, SIGNED, False)
    else:
        y, scale = block_scaled(x, book, 255, SIGNED)
        codes = table_code(y, lut).to(tl.uint8)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(absmax_ptr + blocks, scale, mask=blocks * BLOCK < numel)


@triton.jit
def _dequantize_kernel(codes_ptr, absmax_ptr, out_ptr, numel, book, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    blocks, offs, mask = block_tile(numel, ROWS, BLOCK)
    # any map, always through its book (SIGNED only matters without one)
    x = decode_q8(codes_ptr, absmax_ptr, offs, mask, blocks, blocks * BLOCK < numel, book, True, True, False)
    tl.store(out_ptr + offs, x, mask=mask)


@triton.jit
def _quantize4_kernel(
    x_ptr, nibbles_ptr, absmax_ptr, numel, book, lut, SIGNED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    blocks, offs, mask = block_tile(numel, ROWS, BLOCK)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    encode_store_q4(x, nibbles_ptr, absmax_ptr, offs, mask, blocks, blocks * BLOCK < numel, book, lut, SIGNED, True)


@triton.jit
def _dequantize4_kernel(nibbles_ptr, absmax_ptr, out_ptr, numel, book, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    blocks, offs, mask = block_tile(numel, ROWS, BLOCK)
    x = decode_q4(nibbles_ptr, absmax_ptr, offs, mask, blocks, blocks * BLOCK < numel, book, True)
    tl.store(out_ptr + offs, x, mask=mask)


def _check_block(block_size: int) -> None:
    ok = isinstance(block_size, int) and not isinstance(block_size, bool)
    if not ok or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size!r}")


def _check_map(name: str) -> bool:
    if name not in MAP_NAMES:
        raise ValueError(f"unknown quantization map {name!r}; expected one of {MAP_NAMES}")
    return is_signed_map(name)


def _check_device(t: torch.Tensor, what: str) -> None:
    if not (t.device.type == "cuda" or (t.device.type == "cpu" and runtime.INTERPRET)):
        raise ValueError(f"{what} must be a CUDA tensor (or a CPU tensor under TRITON_INTERPRET=1), got {t.device}")


def _values(x: torch.Tensor, block_size: int, fn: str) -> torch.Tensor:
    _check_block(block_size)
    if not x.is_floating_point():
        raise TypeError(f"{fn} needs a floating-point tensor, got {x.dtype}")
    _check_device(x, "x")
    return x.detach().reshape(-1).contiguous()


def _check_absmax(absmax: torch.Tensor, data: torch.Tensor, what: str, blocks: int, of: str) -> None:
    if absmax.dtype != torch.float32:
        raise TypeError(f"absmax must be float32, got {absmax.dtype}")
    if absmax.numel() != blocks:
        raise ValueError(f"absmax has {absmax.numel()} blocks but {of} need {blocks}")
    _check_device(data, what)
    if absmax.device != data.device:
        raise ValueError(f"{what} and absmax must be on one device, got {data.device} and {absmax.device}")


def quantize_blockwise_triton(
    x: torch.Tensor, name: str = "pow2", block_size: int = 256
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowmemopt.quant.quantize_blockwise`."""
    signed = _check_map(name)
    flat = _values(x, block_size, "quantize_blockwise_triton")
    n = flat.numel()
    codes = torch.empty(n, dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    if n:
        book = code_book(name, x.device)
        # pow2 maps: the arithmetic encoder and its class table
        lut = class_table(name, x.device) if name in POW2_BITS else encode_table(name, x.device).packed
        rows = runtime.rows_per_tile(block_size, x.device)
        grid = (triton.cdiv(absmax.numel(), rows),)
        _quantize_kernel[grid](
            flat,
            codes,
            absmax,
            n,
            book,
            lut,
            SIGNED=signed,
            ROWS=rows,
            BLOCK=block_size,
            POW2=name in POW2_BITS,
            num_warps=runtime.tile_shape(x.device)[1],
        )
    return codes, absmax


def dequantize_blockwise_triton(
    codes: torch.Tensor, absmax: torch.Tensor, name: str = "pow2", block_size: int = 256, shape=None
) -> torch.Tensor:
    """Triton twin of :func:`lowmemopt.quant.dequantize_blockwise`: fp32 values ``book[code] * absmax[block]``."""
    _check_map(name)
    _check_block(block_size)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    _check_absmax(
        absmax,
        codes,
        "codes",
        num_blocks(codes.numel(), block_size),
        f"{codes.numel()} codes at block_size={block_size}",
    )
    flat = codes.reshape(-1).contiguous()
    out = torch.empty(flat.numel(), dtype=torch.float32, device=codes.device)
    if flat.numel():
        book = code_book(name, codes.device)
        rows = runtime.rows_per_tile(block_size, codes.device)
        grid = (triton.cdiv(absmax.numel(), rows),)
        _dequantize_kernel[grid](
            flat,
            absmax.contiguous(),
            out,
            flat.numel(),
            book,
            ROWS=rows,
            BLOCK=block_size,
            num_warps=runtime.tile_shape(codes.device)[1],
        )
    return out if shape is None else out.view(shape)


def _check_map4(name: str) -> bool:
    if name not in q4.MAPS:
        raise ValueError(f"unknown 4-bit map {name!r}; expected one of {sorted(q4.MAPS)}")
    return q4.is_signed(name)


def quantize_blockwise4(
    x: torch.Tensor, name: str = "pow2x4", block_size: int = 128
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`lowmemopt.quant.q4.quantize`."""
    signed = _check_map4(name)
    flat = _values(x, block_size, "quantize_blockwise4")
    n = flat.numel()
    nibbles = torch.empty(q4.packed_len(n), dtype=torch.uint8, device=x.device)
    absmax = torch.empty(num_blocks(n, block_size), dtype=torch.float32, device=x.device)
    if n:
        rows = runtime.rows_per_tile(block_size)
        _quantize4_kernel[(triton.cdiv(absmax.numel(), rows),)](
            flat,
            nibbles,
            absmax,
            n,
            q4.code_book(name, x.device),
            q4.encode_table(name, x.device),
            SIGNED=signed,
            ROWS=rows,
            BLOCK=block_size,
            num_warps=runtime.NUM_WARPS,
        )
    return nibbles, absmax


def dequantize_blockwise4(
    nibbles: torch.Tensor, absmax: torch.Tensor, numel: int, name: str = "pow2x4", block_size: int = 128
) -> torch.Tensor:
    """Triton twin of :func:`lowmemopt.quant.q4.dequantize`: fp32 [numel], ``book[code] * absmax[block]``."""
    _check_map4(name)
    _check_block(block_size)
    if nibbles.dtype != torch.uint8 or nibbles.numel() != q4.packed_len(numel):
        raise ValueError(
            f"nibbles must be uint8 with {q4.packed_len(numel)} bytes for {numel} elements, got "
            f"{nibbles.dtype} with {nibbles.numel()}"
        )
    _check_absmax(
        absmax, nibbles, "nibbles", num_blocks(numel, block_size), f"{numel} elements at block_size={block_size}"
    )
    out = torch.empty(numel, dtype=torch.float32, device=nibbles.device)
    if numel:
        rows = runtime.rows_per_tile(block_size)
        _dequantize4_kernel[(triton.cdiv(absmax.numel(), rows),)](
            nibbles.reshape(-1).contiguous(),
            absmax.contiguous(),
            out,
            numel,
            q4.code_book(name, nibbles.device),
            ROWS=rows,
            BLOCK=block_size,
            num_warps=runtime.NUM_WARPS,
        )
    return out


def compile_variants(v: Any) -> list[Any]:
    """This module's kernels in the ahead-of-time compile table (:data:`.variants.VARIANTS`; ``v``: that module,
    whose ``Variant`` and tile helpers it uses)."""
    return [
        v.Variant("quantize", _quantize_kernel, dict(SIGNED=False, ROWS=v.runtime.TILE // 256, BLOCK=256, POW2=True)),
        v.Variant(
            "quantize-table", _quantize_kernel, dict(SIGNED=True, ROWS=v.runtime.TILE // 256, BLOCK=256, POW2=False)
        ),
        v.Variant("dequantize", _dequantize_kernel, dict(ROWS=v.runtime.TILE // 256, BLOCK=256)),
        v.Variant(
            "quantize4", _quantize4_kernel, dict(SIGNED=True, ROWS=v.runtime.TILE // v.Q4_BLOCK, BLOCK=v.Q4_BLOCK)
        ),
        v.Variant("dequantize4", _dequantize4_kernel, dict(ROWS=v.runtime.TILE // v.Q4_BLOCK, BLOCK=v.Q4_BLOCK)),
    ]
