"""Triton device functions of the state formats (fp32, bf16, 8-bit ``Q8``, 4-bit ``Q4``) that the optimizer
kernels call in registers: block scale, encode, decode, nibble packing, parameter loads and stores.

They reproduce :mod:`lowmemopt.quant.blockwise` and :mod:`lowmemopt.quant.q4` code for code; the standalone codec
kernels are in :mod:`.blockwise`. Numerics and the 4-bit layout: docs/kernels.md#numerics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lowmemopt.quant import q4
from lowmemopt.quant.formats import map_for
from lowmemopt.quant.maps import code_book

from . import runtime
from .divide import per_block, quotient_positive, row_quotients
from .pow2 import class_table, pow2_code, pow2_value

__all__ = ["FP32", "BF16", "Q8", "Q4", "FORMAT_CODES", "NEAREST", "STOCHASTIC", "KAHAN", "maps"]

FP32, BF16, Q8, Q4 = 0, 1, 2, 3
#: ``bf16_update`` codes of :func:`store_param_as` (:mod:`lowmemopt.rounding`)
NEAREST, STOCHASTIC, KAHAN = 0, 1, 2
FORMAT_CODES = {"fp32": FP32, "bf16": BF16, "q8": Q8, "q4": Q4}


def maps(
    device: torch.device, fmt: str = "q8"
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """(signed book, signed table, unsigned book, unsigned table) of ``fmt``'s state maps on ``device``."""
    if fmt == "q4":
        signed, unsigned = q4.map4_for(True), q4.map4_for(False)
        return (
            q4.code_book(signed, device),
            q4.encode_table(signed, device),
            q4.code_book(unsigned, device),
            q4.encode_table(unsigned, device),
        )
    signed, unsigned = map_for(True), map_for(False)
    tables = class_table(signed, device), class_table(unsigned, device)
    if fmt == "q8" and runtime.q8_decode(device) == "arithmetic":
        return None, tables[0], None, tables[1]  # codes decoded from their bits (code_values)
    return code_book(signed, device), tables[0], code_book(unsigned, device), tables[1]


# ---------------------------------------------------------------------------------------------------------------------
# device functions


@triton.jit
def typed(addr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 launch-table address as a pointer to ``DTYPE``; ``ALIGNED``: checked 16-byte aligned."""
    ptr = addr.to(tl.pointer_type(DTYPE))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16, nearest even, on the bits (the interpreter's own cast truncates)."""
    u = x.to(tl.uint32, bitcast=True)
    u = u + 0x7FFF + ((u >> 16) & 1)
    return (u >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def rounded(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``DTYPE`` (nearest even), as torch's ``copy_`` rounds."""
    if DTYPE == tl.bfloat16:
        y = bf16_rne(x)
    else:
        y = x.to(DTYPE)
    return y


@triton.jit
def encode_q8(x, book, lut, SIGNED: tl.constexpr, COLS: tl.constexpr):
    """fp32 tile of a ``pow2`` / ``upow2`` map -> (uint8 codes, scale [ROWS]); ``lut``: class table or None."""
    scale = tile_scale(x, book, 255, SIGNED, COLS)
    s = tl.where(scale > 0, scale, 1.0)
    y = row_quotients(x, s, COLS)
    if SIGNED:
        code = pow2_code(y, True, None, lut)
    else:
        code = pow2_code(y, False, quotient_positive(x, s, COLS), lut)
    return code.to(tl.uint8), scale


@triton.jit
def block_scaled(x, book, LAST: tl.constexpr, SIGNED: tl.constexpr):
    """(``x / scale``, ``scale`` [ROWS]) of a tile whose rows are blocks; an all-zero row divides by 1."""
    scale = tile_scale(x, book, LAST, SIGNED, False)
    return tl.math.div_rn(x, tl.where(scale > 0, scale, 1.0)[:, None]), scale


@triton.jit
def tile_scale(x, book, LAST: tl.constexpr, SIGNED: tl.constexpr, COLS: tl.constexpr):
    """The scale [ROWS] making each block's extremes representable."""
    if SIGNED:
        if book is None:  # the pow2 map (8-bit state, arithmetic codes)
            first = pow2_value(tl.full([], 0, tl.int32), True)
            last = pow2_value(tl.full([], LAST, tl.int32), True)
        else:
            first = tl.load(book)
            last = tl.load(book + LAST)
        scale = tl.maximum(
            tl.math.div_rn(block_extreme(x, COLS, True), last), tl.math.div_rn(block_extreme(x, COLS, False), first)
        )
    else:
        scale = tl.maximum(block_extreme(x, COLS, True), 0.0)
    return scale


@triton.jit
def block_extreme(x, COLS: tl.constexpr, MAX: tl.constexpr):
    """Each block's maximum (``MAX``) or minimum [ROWS] of a tile."""
    AXIS: tl.constexpr = 0 if COLS else 1
    if MAX:
        m = tl.max(x, axis=AXIS)
    else:
        m = tl.min(x, axis=AXIS)
    return m


@triton.jit
def table_code(y, lut):
    """The nearest code of scaled ``y`` from a packed bucket table (top 16 bits of its pattern pick the bucket)."""
    u = y.to(tl.int32, bitcast=True)
    entry = tl.load(lut + ((u >> 16) & 0xFFFF))
    t = (u & 0xFFFF) ^ ((u >> 31) & 0xFFFF)
    return (entry >> 17) + (t >= (entry & 0x1FFFF)).to(tl.int32)


@triton.jit
def ld(ptrs, mask, MASKED: tl.constexpr):
    """Load, masked lanes 0; ``MASKED=False`` drops the mask so the accesses vectorize."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def st(ptrs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, x, mask=mask)
    else:
        tl.store(ptrs, x)


@triton.jit
def code_values(codes, book, SIGNED: tl.constexpr):
    """fp32 values of 8-bit ``codes``: from ``book``, or (``book=None``) from the code's bits."""
    if book is None:
        x = pow2_value(codes, SIGNED)
    else:
        x = tl.load(book + codes)
    return x


@triton.jit
def decode_q8(
    codes_ptr,
    absmax_ptr,
    offs,
    mask,
    blocks,
    block_mask,
    book,
    SIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
):
    """fp32 values of the 8-bit codes at ``offs`` (block indices ``blocks``); 0 where masked."""
    codes = ld(codes_ptr + offs, mask, MASKED)
    scale = ld(absmax_ptr + blocks, block_mask, MASKED)
    x = code_values(codes.to(tl.int32), book, SIGNED) * per_block(scale, COLS)
    if MASKED:
        x = tl.where(mask, x, 0.0)
    return x


@triton.jit
def encode_q4(x, book, lut, SIGNED: tl.constexpr):
    """fp32 tile -> (int32 4-bit codes, fp32 scale [ROWS]) with a 16-code ``book`` and its table ``lut``."""
    y, scale = block_scaled(x, book, 15, SIGNED)
    return table_code(y, lut), scale


@triton.jit
def pairs(x):
    """A tile's (even, odd) columns: the two elements of each byte."""
    return tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))


@triton.jit
def evens(x):
    """A tile's even columns (the first element of each byte)."""
    lo, hi = pairs(x)
    return lo


@triton.jit
def pack_nibbles(codes):
    """int32 codes [ROWS, BLOCK] -> uint8 [ROWS, BLOCK / 2]: byte i = ``codes[2i] | codes[2i + 1] << 4``."""
    lo, hi = pairs(codes)
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def unpack_nibbles(packed):
    """Inverse of :func:`pack_nibbles`."""
    b = packed.to(tl.int32)
    return tl.reshape(tl.join(b & 15, b >> 4), [b.shape[0], b.shape[1] * 2])


@triton.jit
def byte_offsets(blocks, BLOCK: tl.constexpr):
    """Byte offsets [ROWS, BLOCK / 2] of blocks ``blocks`` (a block starts on a byte)."""
    return blocks[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]


@triton.jit
def decode_q4(nibbles_ptr, absmax_ptr, offs, mask, blocks, block_mask, book, MASKED: tl.constexpr):
    """fp32 values of the 4-bit codes at ``offs``; 0 where masked."""
    ptrs = nibbles_ptr + byte_offsets(blocks, offs.shape[1])
    if MASKED:
        packed = tl.load(ptrs, mask=evens(mask), other=0)
    else:
        packed = tl.load(ptrs)
    scale = ld(absmax_ptr + blocks, block_mask, MASKED)
    x = tl.load(book + unpack_nibbles(packed)) * scale[:, None]
    if MASKED:
        x = tl.where(mask, x, 0.0)
    return x


@triton.jit
def encode_store_q4(
    x, nibbles_ptr, absmax_ptr, offs, mask, blocks, block_mask, book, lut, SIGNED: tl.constexpr, MASKED: tl.constexpr
):
    """Encode ``x`` (a block per row), write nibbles and scales; a byte is written iff its even element is."""
    if MASKED:
        x = tl.where(mask, x, 0.0)
    codes, scale = encode_q4(x, book, lut, SIGNED)
    ptrs = nibbles_ptr + byte_offsets(blocks, offs.shape[1])
    if MASKED:
        tl.store(ptrs, pack_nibbles(tl.where(mask, codes, 0)), mask=evens(mask))
    else:
        tl.store(ptrs, pack_nibbles(codes))
    st(absmax_ptr + blocks, scale, block_mask, MASKED)


@triton.jit
def load_slot(
    row,
    COL: tl.constexpr,
    offs,
    mask,
    blocks,
    block_mask,
    book,
    SIGNED: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
):
    """A state slot's fp32 values at ``offs`` from column ``COL`` of ``row``; 0 where masked."""
    if FMT == 3:
        x = decode_q4(
            typed(tl.load(row + COL), tl.uint8, ALIGNED),
            typed(tl.load(row + COL + 1), tl.float32, False),
            offs,
            mask,
            blocks,
            block_mask,
            book,
            MASKED,
        )
    elif FMT == 2:
        x = decode_q8(
            typed(tl.load(row + COL), tl.uint8, ALIGNED),
            typed(tl.load(row + COL + 1), tl.float32, False),
            offs,
            mask,
            blocks,
            block_mask,
            book,
            SIGNED,
            MASKED,
            COLS,
        )
    elif FMT == 1:
        x = ld(typed(tl.load(row + COL), tl.bfloat16, ALIGNED) + offs, mask, MASKED).to(tl.float32)
    else:
        x = ld(typed(tl.load(row + COL), tl.float32, ALIGNED) + offs, mask, MASKED)
    return x


@triton.jit
def load_slot_at(
    row, COL: tl.constexpr, offs, mask, book, SIGNED: tl.constexpr, QBLOCK: tl.constexpr, FMT: tl.constexpr
):
    """:func:`load_slot` for a tile not aligned with blocks (absmax gathered at ``offs // QBLOCK``)."""
    if FMT == 3:
        packed = tl.load(typed(tl.load(row + COL), tl.uint8, False) + offs // 2, mask=mask, other=0).to(tl.int32)
        codes = (packed >> ((offs & 1) * 4).to(tl.int32)) & 15
        scale = tl.load(typed(tl.load(row + COL + 1), tl.float32, False) + offs // QBLOCK, mask=mask, other=0)
        x = tl.where(mask, tl.load(book + codes) * scale, 0.0)
    elif FMT == 2:
        codes = tl.load(typed(tl.load(row + COL), tl.uint8, False) + offs, mask=mask, other=0)
        scale = tl.load(typed(tl.load(row + COL + 1), tl.float32, False) + offs // QBLOCK, mask=mask, other=0.0)
        x = tl.where(mask, code_values(codes.to(tl.int32), book, SIGNED) * scale, 0.0)
    elif FMT == 1:
        x = tl.load(typed(tl.load(row + COL), tl.bfloat16, False) + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(typed(tl.load(row + COL), tl.float32, False) + offs, mask=mask, other=0.0)
    return x


@triton.jit
def store_slot(
    x,
    row,
    COL: tl.constexpr,
    offs,
    mask,
    blocks,
    block_mask,
    book,
    lut,
    SIGNED: tl.constexpr,
    FMT: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    COLS: tl.constexpr,
):
    """Write fp32 ``x`` to a state slot (bf16: nearest even; q8, q4: encode each row)."""
    if FMT == 3:
        encode_store_q4(
            x,
            typed(tl.load(row + COL), tl.uint8, ALIGNED),
            typed(tl.load(row + COL + 1), tl.float32, False),
            offs,
            mask,
            blocks,
            block_mask,
            book,
            lut,
            SIGNED,
            MASKED,
        )
    elif FMT == 2:
        if MASKED:
            x = tl.where(mask, x, 0.0)
        codes, scale = encode_q8(x, book, lut, SIGNED, COLS)
        st(typed(tl.load(row + COL), tl.uint8, ALIGNED) + offs, codes, mask, MASKED)
        st(typed(tl.load(row + COL + 1), tl.float32, False) + blocks, scale, block_mask, MASKED)
    elif FMT == 1:
        st(typed(tl.load(row + COL), tl.bfloat16, ALIGNED) + offs, bf16_rne(x), mask, MASKED)
    else:
        st(typed(tl.load(row + COL), tl.float32, ALIGNED) + offs, x, mask, MASKED)


@triton.jit
def tile_coords(units, table, W: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, COLS: tl.constexpr):
    """This program's tensor (``t``, ``row``, ``numel``) and tile: offsets, masks, blocks, ``full``."""
    pid = tl.program_id(0)
    t = tl.load(units + pid)
    tile = tl.load(units + tl.num_programs(0) + pid).to(tl.int64)
    row = table + t.to(tl.int64) * W
    numel = tl.load(row + 2)
    blocks = tile * ROWS + tl.arange(0, ROWS)
    if COLS:
        offs = blocks[None, :] * BLOCK + tl.arange(0, BLOCK)[:, None]
    else:
        offs = blocks[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    return t, row, numel, offs, offs < numel, blocks, blocks * BLOCK < numel, (tile + 1) * (ROWS * BLOCK) <= numel


@triton.jit
def tensor_scalar(scal, t, K: tl.constexpr, I: tl.constexpr):  # noqa: E741 (I: the scalar's index)
    """Scalar ``I`` of tensor ``t`` in the device scalars ``scal`` (fp32 ``[T, K]``, ``launch.Bucket.scalars``)."""
    return tl.load(scal + t.to(tl.int64) * K + I)


@triton.jit
def load_param(row, offs, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """The parameter (column 0) as fp32."""
    return ld(typed(tl.load(row), DTYPE, ALIGNED) + offs, mask, MASKED).to(tl.float32)


@triton.jit
def load_grad(
    row,
    offs,
    mask,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    gmul=None,
    G_MULT: tl.constexpr = False,
):
    """The gradient as fp32; ``G_MULT``: times GradScaler's multiplier, as ``unscale_`` rounds it."""
    g = ld(typed(tl.load(row + 1), DTYPE, ALIGNED) + offs, mask, MASKED).to(tl.float32)
    if G_MULT:
        g = (g * tl.load(gmul)).to(DTYPE).to(tl.float32)
    return g


@triton.jit
def store_param(p, row, offs, mask, DTYPE: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
    """Write the fp32 result to the parameter, nearest even."""
    st(typed(tl.load(row), DTYPE, ALIGNED) + offs, rounded(p, DTYPE), mask, MASKED)


@triton.jit
def mix32(x):
    """murmur3's fmix32 on uint32, as :mod:`lowmemopt.rounding`."""
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def bf16_bits_rne(x):
    """fp32 -> bf16 pattern, nearest even; NaN -> 0x7FC0."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where(x != x, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@triton.jit
def f16_bits_rne(x):
    """fp32 -> fp16 pattern, nearest even, as the cast (NaN -> 0x7E00 with its sign)."""
    return x.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@triton.jit
def f16_value(h):
    """fp16 pattern -> fp32, exact."""
    return h.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def f16_bits_stochastic(x, r):
    """fp32 -> fp16 pattern rounded stochastically with 16 random bits ``r`` (docs/rounding.md#fp16)."""
    u = x.to(tl.uint32, bitcast=True)
    sign = (u >> 16) & 0x8000
    au = u & 0x7FFFFFFF
    normal = ((au + (r >> 3)) >> 13) - (112 << 10)
    small = tl.minimum(au, 0x38800000).to(tl.float32, bitcast=True)  # the subnormal lanes' |x|, others clamped
    t = (small * 1099511627776.0).to(tl.uint32)  # |x| * 2^40 <= 2^26: exact
    sub = (t + r) >> 16
    out = tl.where(au < 0x38800000, sub, normal) | sign
    return tl.where(au > 0x477FE000, f16_bits_rne(x), out)


@triton.jit
def store_param_as(
    p_new,
    p_old,
    row,
    offs,
    mask,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    UPDATE: tl.constexpr,
    W: tl.constexpr,
):
    """:func:`store_param` with ``bf16_update``: ``STOCHASTIC`` hashes (key at column ``W - 2``, the element's
    index in the whole parameter: offset + column ``W - 1``); ``KAHAN``: buffer at column ``W - 1``. ``p_old``: the
    parameter before the step (fp32)."""
    if UPDATE == 0 or DTYPE == tl.float32:  # NEAREST (module globals are not constexpr inside a kernel)
        store_param(p_new, row, offs, mask, DTYPE, ALIGNED, MASKED)
    else:
        dst = typed(tl.load(row), tl.uint16, ALIGNED) + offs
        if UPDATE == 1:  # STOCHASTIC
            key = tl.load(row + W - 2).to(tl.uint32)
            r = mix32((offs + tl.load(row + W - 1)).to(tl.uint32) ^ key) >> 16
            if DTYPE == tl.bfloat16:
                u = p_new.to(tl.uint32, bitcast=True)
                out = tl.where(p_new != p_new, 0x7FC0, (u + r) >> 16)
            else:
                out = f16_bits_stochastic(p_new, r)
        else:
            cptr = typed(tl.load(row + W - 1), tl.uint16, False) + offs
            if DTYPE == tl.bfloat16:
                c = (ld(cptr, mask, MASKED).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
                y = (p_new - p_old) + c
                out = bf16_bits_rne(p_old + y)
                comp = y - ((out << 16).to(tl.float32, bitcast=True) - p_old)
                comp = tl.where(comp - comp == 0.0, comp, 0.0)
                st(cptr, bf16_bits_rne(comp).to(tl.uint16), mask, MASKED)
            else:
                y = (p_new - p_old) + f16_value(ld(cptr, mask, MASKED))
                out = f16_bits_rne(p_old + y)
                comp = y - (f16_value(out) - p_old)
                comp = tl.where(comp - comp == 0.0, comp, 0.0)
                st(cptr, f16_bits_rne(comp).to(tl.uint16), mask, MASKED)
        st(dst, out.to(tl.uint16), mask, MASKED)
