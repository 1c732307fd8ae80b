"""State formats: how one named state slot (``exp_avg``, ...) is stored, as plain tensors whose keys and dtype say the
format: ``fp32``, ``fp64``, ``bf16``, ``fp16``, ``q8`` (``.codes``, ``.absmax``), ``q4`` (``.nibbles``, ``.absmax``).

:meth:`StateFormat.decode` / :meth:`StateFormat.encode` work on block-aligned ranges ``[lo, hi)`` of the flat slot.
Layout, maps and float64 parameters: docs/state_format.md#tensors.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from . import q4
from .blockwise import decode_into, encode_into, num_blocks

__all__ = [
    "Slot",
    "math_dtype",
    "StateFormat",
    "FP32",
    "FP64",
    "BF16",
    "FP16",
    "Q8",
    "Q4",
    "QUANTIZED",
    "FORMATS",
    "choose_format",
    "stored_sizes",
    "format_of",
    "common_formats",
    "slot_keys",
    "map_for",
    "legacy_map_for",
    "default_block_size",
]


class Slot(NamedTuple):
    """One named state tensor of an algorithm: what a format needs to know to store it."""

    signed: bool  # may hold negative values (selects the signed or unsigned 8-bit map)
    quantize: bool = True  # eligible for bf16 / q8 storage (factored statistics are not)
    shape: tuple[int, ...] | None = None  # logical shape; None: the parameter's shape
    dims: tuple[int | None, ...] | None = None  # with shape: the parameter dim each dim runs along (sharded layouts)
    #: a floating dtype the slot is stored in whatever ``state_bits`` and ``min_quant_numel`` say (fp32, bf16 or
    #: fp16: DeepSpeed's ``fp32_optimizer_states=False`` keeps the moments in the parameter's dtype); None: chosen by
    #: ``state_bits``
    dtype: torch.dtype | None = None


def math_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter of ``dtype`` is stepped in: float64 for float64, fp32 for every other dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def map_for(signed: bool) -> str:
    """The map 8-bit state of a slot of this signedness is stored in."""
    return "pow2" if signed else "upow2"


def legacy_map_for(signed: bool) -> str:
    """The map of ``lowmemopt_format`` 1 state and of bitsandbytes' 8-bit state (bitsandbytes' dynamic maps)."""
    return "dynamic" if signed else "udynamic"


class StateFormat:
    name: str = ""
    bits: int = 32

    def keys(self, slot: str) -> tuple[str, ...]:
        return (slot,)

    def init(self, state: dict, slot: str, shape: torch.Size, device: torch.device, block_size: int) -> None:
        """Create the slot's zero state (``shape``: the slot's logical shape)."""
        raise NotImplementedError

    def decode(
        self, state: dict, slot: str, lo: int, hi: int, signed: bool, block_size: int, qmap: str | None = None
    ) -> torch.Tensor:
        """fp32 values of elements ``[lo, hi)`` (fp64 storage: fp64); ``qmap``: the codes' map."""
        raise NotImplementedError

    def encode(
        self, state: dict, slot: str, lo: int, hi: int, value: torch.Tensor, signed: bool, block_size: int
    ) -> None:
        """Write ``value`` as elements ``[lo, hi)`` (8-bit: in the state map ``map_for(signed)``)."""
        raise NotImplementedError

    def nbytes(self, numel: int, block_size: int) -> int:
        raise NotImplementedError

    def key_ranges(self, slot: str, lo: int, hi: int, block_size: int) -> dict[str, tuple[int, int]]:
        """The flat range of each stored tensor holding elements ``[lo, hi)``, for streaming a slot."""
        return {slot: (lo, hi)}

    def __repr__(self) -> str:
        return f"StateFormat({self.name})"


class _Dense(StateFormat):
    dtype: torch.dtype = torch.float32

    def init(self, state, slot, shape, device, block_size):
        state[slot] = torch.zeros(shape, dtype=self.dtype, device=device)

    def decode(self, state, slot, lo, hi, signed, block_size, qmap=None):
        return state[slot].view(-1)[lo:hi].float()  # fp32 storage: a view, updated in place

    def encode(self, state, slot, lo, hi, value, signed, block_size):
        dst = state[slot].view(-1)[lo:hi]
        if dst.data_ptr() != value.data_ptr():
            dst.copy_(value)

    def nbytes(self, numel, block_size):
        return numel * torch.empty((), dtype=self.dtype).element_size()


class _FP32(_Dense):
    name, bits, dtype = "fp32", 32, torch.float32


class _FP64(_Dense):
    name, bits, dtype = "fp64", 64, torch.float64

    def decode(self, state, slot, lo, hi, signed, block_size, qmap=None):
        return state[slot].view(-1)[lo:hi]  # a view, updated in place by a float64 parameter's math


class _BF16(_Dense):
    name, bits, dtype = "bf16", 16, torch.bfloat16


class _FP16(_Dense):
    name, bits, dtype = "fp16", 16, torch.float16


class _Q8(StateFormat):
    name, bits = "q8", 8

    def keys(self, slot):
        return (slot + ".codes", slot + ".absmax")

    def init(self, state, slot, shape, device, block_size):
        n = torch.Size(shape).numel()
        state[slot + ".codes"] = torch.zeros(n, dtype=torch.uint8, device=device)
        state[slot + ".absmax"] = torch.zeros(num_blocks(n, block_size), dtype=torch.float32, device=device)

    def decode(self, state, slot, lo, hi, signed, block_size, qmap=None):
        out = torch.empty(hi - lo, dtype=torch.float32, device=state[slot + ".codes"].device)
        b0, b1 = lo // block_size, num_blocks(hi, block_size)
        codes, absmax = state[slot + ".codes"][lo:hi], state[slot + ".absmax"][b0:b1]
        decode_into(codes, absmax, qmap or map_for(signed), block_size, out)
        return out

    def encode(self, state, slot, lo, hi, value, signed, block_size):
        b0, b1 = lo // block_size, num_blocks(hi, block_size)
        codes, absmax = state[slot + ".codes"][lo:hi], state[slot + ".absmax"][b0:b1]
        encode_into(value.float(), map_for(signed), block_size, codes, absmax)  # (float64 values: to fp32 first)

    def nbytes(self, numel, block_size):
        return numel + 4 * num_blocks(numel, block_size)

    def key_ranges(self, slot, lo, hi, block_size):
        return {slot + ".codes": (lo, hi), slot + ".absmax": (lo // block_size, num_blocks(hi, block_size))}


class _Q4(StateFormat):
    """Two 4-bit codes per byte and an fp32 scale per block (:mod:`lowmemopt.quant.q4`)."""

    name, bits = "q4", 4

    def keys(self, slot):
        return (slot + ".nibbles", slot + ".absmax")

    def init(self, state, slot, shape, device, block_size):
        n = torch.Size(shape).numel()
        state[slot + ".nibbles"] = torch.zeros(q4.packed_len(n), dtype=torch.uint8, device=device)
        state[slot + ".absmax"] = torch.zeros(num_blocks(n, block_size), dtype=torch.float32, device=device)

    def decode(self, state, slot, lo, hi, signed, block_size, qmap=None):
        out = torch.empty(hi - lo, dtype=torch.float32, device=state[slot + ".nibbles"].device)
        ranges = self.key_ranges(slot, lo, hi, block_size)
        (a, b), (c, d) = ranges[slot + ".nibbles"], ranges[slot + ".absmax"]
        q4.decode_into(
            state[slot + ".nibbles"][a:b], state[slot + ".absmax"][c:d], qmap or q4.map4_for(signed), block_size, out
        )
        return out

    def encode(self, state, slot, lo, hi, value, signed, block_size):
        ranges = self.key_ranges(slot, lo, hi, block_size)
        (a, b), (c, d) = ranges[slot + ".nibbles"], ranges[slot + ".absmax"]
        q4.encode_into(
            value.float(), q4.map4_for(signed), block_size, state[slot + ".nibbles"][a:b], state[slot + ".absmax"][c:d]
        )

    def nbytes(self, numel, block_size):
        return q4.packed_len(numel) + 4 * num_blocks(numel, block_size)

    def key_ranges(self, slot, lo, hi, block_size):
        if lo % 2:
            raise ValueError(f"a 4-bit range must start on a byte (an even element), got {lo}")
        return {
            slot + ".nibbles": (lo // 2, q4.packed_len(hi)),
            slot + ".absmax": (lo // block_size, num_blocks(hi, block_size)),
        }


FP32, FP64, BF16, FP16, Q8, Q4 = _FP32(), _FP64(), _BF16(), _FP16(), _Q8(), _Q4()
FORMATS = {f.name: f for f in (FP32, FP64, BF16, FP16, Q8, Q4)}
#: the dense format of each floating dtype a slot may ask for (:attr:`Slot.dtype`)
DENSE = {torch.float32: FP32, torch.float64: FP64, torch.bfloat16: BF16, torch.float16: FP16}
#: the block-wise quantized formats (codes + per-block absmax)
QUANTIZED = (Q8, Q4)


def default_block_size(state_bits: int) -> int:
    """The block size when none is given: 128 for 4-bit state, 256 otherwise."""
    return 128 if state_bits == 4 else 256


def choose_format(
    state_bits: int,
    numel: int,
    min_quant_numel: int,
    quantizable: bool = True,
    dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
) -> StateFormat:
    """The format a new slot gets (fp32 / fp64 below ``min_quant_numel``; a slot's own ``dtype``)."""
    if dtype is not None and quantizable:
        if dtype not in DENSE:
            raise ValueError(f"a state slot cannot be stored in {dtype} (fp32, fp64, bf16 or fp16)")
        return DENSE[dtype]
    if not quantizable or state_bits == 32 or numel < min_quant_numel:
        return FP64 if param_dtype == torch.float64 else FP32
    return {16: BF16, 8: Q8, 4: Q4}[state_bits]


def stored_sizes(
    slots: dict[str, Slot],
    shape: torch.Size,
    numel: int,
    dtype: torch.dtype,
    state_bits: int,
    min_quant_numel: int,
    block_size: int,
) -> tuple[tuple[str, int], ...]:
    """``((stored key, its numel), ...)`` of new state of ``slots`` for a ``dtype`` tensor of ``shape`` (``numel``:
    the whole parameter's, which picks a shard's formats), in the formats :func:`choose_format` gives them."""
    out: list[tuple[str, int]] = []
    for name, slot in slots.items():
        size = shape.numel() if slot.shape is None else torch.Size(slot.shape).numel()
        fmt = choose_format(
            state_bits, numel if slot.shape is None else size, min_quant_numel, slot.quantize, slot.dtype, dtype
        )
        out += [(k, hi) for k, (_, hi) in fmt.key_ranges(name, 0, size, block_size).items()]
    return tuple(out)


def format_of(state: dict, slot: str) -> StateFormat:
    """The format a stored slot is in, read from its keys and dtype."""
    if slot + ".codes" in state:
        return Q8
    if slot + ".nibbles" in state:
        return Q4
    t = state[slot]
    if t.dtype == torch.bfloat16:
        return BF16
    if t.dtype == torch.float16:
        return FP16
    return FP64 if t.dtype == torch.float64 else FP32


def common_formats(states: Sequence[dict], slots: Sequence[Sequence[str]]) -> list[str | None]:
    """Per state, the name of the one format its ``slots[i]`` are stored in: ``"fp32"`` for no slots, None where a
    slot is missing or two differ (a bucket's states read in one call)."""
    out: list[str | None] = []
    for state, names in zip(states, slots):
        fmt = None
        for name in names:
            try:
                name_fmt = format_of(state, name).name
            except KeyError:  # a slot is missing
                fmt = None
                break
            if fmt is None:
                fmt = name_fmt
            elif name_fmt != fmt:
                fmt = None
                break
        else:
            fmt = fmt or "fp32"
        out.append(fmt)
    return out


def slot_keys(state: dict, slot: str) -> tuple[str, ...]:
    return format_of(state, slot).keys(slot)
