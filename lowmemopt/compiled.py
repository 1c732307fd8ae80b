"""CPU fallback of the native kernels: ``torch.compile`` of one whole chunk update, decode -> the algorithm's own fp32
math -> encode, equal to the eager path's results. Why the scalars are graph inputs and the constants graph keys:
docs/cpu_kernels.md#the-torchcompile-path.
"""

from __future__ import annotations

import os
import shlex
import shutil
import types
import warnings
from typing import Any, Callable

import torch

from ._stacklevel import external_stacklevel
from .quant.blockwise import decode_rows, encode_rows, register_row_codec
from .quant.maps import code_book, encode_table, is_signed_map

__all__ = [
    "ENABLED",
    "MIN_NUMEL",
    "RUNTIME_SCALARS",
    "applies",
    "step_rows",
    "encode_rows_compiled",
    "decode_rows_compiled",
]

ENABLED = os.environ.get("LOWMEMOPT_COMPILE", "1") != "0"
MIN_NUMEL = 1 << 16
#: math keyword arguments passed to the compiled graph as 0-dim tensors (they change between steps; the math functions
#: only compute with them, never branch on them)
RUNTIME_SCALARS = frozenset(
    {"lr", "bias_correction1", "bias_correction2_sqrt", "lr_scale", "alpha_t", "beta3_t"}
)  # (AdEMAMix's warm-ups)


def applies(param: torch.Tensor) -> bool:
    """CPU parameters of :data:`MIN_NUMEL` elements or more, not float64 (whose math is float64: the eager path),
    where inductor has a C++ compiler (:func:`compiler_found`)."""
    return (
        ENABLED
        and param.device.type == "cpu"
        and param.numel() >= MIN_NUMEL
        and param.dtype != torch.float64
        and compiler_found()
    )


_cxx: bool | None = None  # inductor's C++ compiler found (None: not looked for yet)


def compiler_found() -> bool:
    """Whether inductor finds its C++ compiler (``$CXX``, else g++), looked up once: without one a compile fails only
    after ~10 s of tracing, so lowmemopt stays eager from the start (warning once, unless the native kernels already
    did).
    """
    global _cxx, _warned
    if _cxx is None:
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            _cxx = True
        except Exception as exc:  # noqa: BLE001 - InvalidCxxCompiler, or an inductor that cannot be imported
            _cxx = False
            cc = shlex.split(os.environ.get("CC", "cc")) or ["cc"]
            if shutil.which(cc[0]) is None:
                _warned = True  # (no C compiler: lowmemopt.cpu's warning covers it)
            _disable(RuntimeError(f"no C++ compiler for inductor ({type(exc).__name__}; set $CXX)"))
    return _cxx


# A slot as handed to the compiled function: (name, kind, signed, storage rows, absmax rows or None, book, table).
# kind "q8": rows of codes [nb, bs]; "q4": rows of nibbles [nb, bs / 2] (lowmemopt.quant.q4's layout, the book and
# bucket table of its 4-bit map); "fp32" / "bf16": rows of values.
SlotRows = tuple[str, str, bool, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]
QUANTIZED = ("q8", "q4")


def unpack_nibble_rows(rows: torch.Tensor) -> torch.Tensor:
    """uint8 [nb, bs / 2] -> uint8 codes [nb, bs]: element 2i is the low nibble of byte i, 2i + 1 the high one."""
    return torch.stack((rows & 15, rows >> 4), dim=2).reshape(rows.shape[0], -1)


def pack_nibble_rows(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [nb, bs] (each < 16) -> uint8 [nb, bs / 2], the inverse of :func:`unpack_nibble_rows`."""
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[:, :, 0] | (pairs[:, :, 1] << 4)


def _rows_math(
    math: Callable,
    p: torch.Tensor,
    g: torch.Tensor,
    slots: tuple,
    kwargs: dict,
    decay: float,
    mult: torch.Tensor | None = None,
) -> None:
    """Phase 1: decode, math (gradient times ``mult``), write ``p`` and dense slots."""
    p32, g32 = p.float(), g.float()
    if mult is not None:
        g32 = g32 * mult
        if g.dtype != torch.float32:
            g32 = g32.to(g.dtype).float()
    state = {}
    for name, kind, signed, rows, absmax, book, table, scratch in slots:
        if kind in QUANTIZED:
            state[name] = decode_rows(rows if kind == "q8" else unpack_nibble_rows(rows), absmax, book)
        else:
            state[name] = rows.float()
    out = math(p32, g32, state, **kwargs)
    delta, alpha = out if isinstance(out, tuple) else (out, 1.0)
    for name, kind, signed, rows, absmax, book, table, scratch in slots:
        if kind in QUANTIZED:
            scratch.copy_(state[name])
        elif kind != "fp32":  # bf16, fp16
            rows.copy_(state[name])  # fp32 storage: the rows themselves were updated in place
    # no branches on decay / alpha: they change with the LR schedule and must stay symbolic (x * 1.0 is exact)
    p.copy_(p32 * decay + delta * alpha)


def _rows_encode(slots: tuple) -> None:
    """Phase 2: encode the q8 / q4 slots from scratch (a separate graph, so phase 1's decode is not recomputed)."""
    for name, kind, signed, rows, absmax, book, table, scratch in slots:
        if kind in QUANTIZED:
            codes, scale = encode_rows(scratch, book, table, signed)
            rows.copy_(codes if kind == "q8" else pack_nibble_rows(codes))
            absmax.copy_(scale)


_kernels: dict[tuple, tuple[Callable, Callable]] = {}
_scratch: dict[tuple, torch.Tensor] = {}
_warned = False


def _fresh(fn: Callable, name: str) -> Callable:
    """A copy of ``fn`` with its own code object (dynamo keeps at most 8 graphs per code object)."""
    code = fn.__code__.replace(co_name=name)
    return types.FunctionType(code, fn.__globals__, name)


def _kernel(key: tuple) -> tuple[Callable, Callable]:
    if key not in _kernels:
        n = len(_kernels)
        _kernels[key] = (
            torch.compile(_fresh(_rows_math, f"_rows_math_{n}"), fullgraph=True),
            torch.compile(_fresh(_rows_encode, f"_rows_encode_{n}"), fullgraph=True),
        )
    return _kernels[key]


def scratch_rows(index: int, like: torch.Tensor) -> torch.Tensor:
    """A reused fp32 buffer shaped like ``like`` for the ``index``-th quantized slot, one per size."""
    key = (index, like.device)
    buf = _scratch.get(key)
    if buf is None or buf.numel() < like.numel():
        buf = _scratch[key] = torch.empty(like.numel(), dtype=torch.float32, device=like.device)
    return buf[: like.numel()].view(like.shape)


def _constant_key(x: Any) -> Any:
    """A graph constant (beta, eps, weight decay, a flag) as part of the compiled function's key."""
    try:
        hash(x)
    except TypeError:
        return ("id", id(x))
    return x


def _runtime_scalar(x: Any) -> Any:
    """A Python number as a 0-dim float64 CPU tensor (a graph input, not a guarded constant); tensors unchanged."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    return torch.tensor(float(x), dtype=torch.float64)


def step_rows(
    math: Callable,
    p: torch.Tensor,
    g: torch.Tensor,
    slots: tuple,
    kwargs: dict[str, Any],
    decay: float,
    mult: torch.Tensor | None = None,
) -> bool:
    """Run one compiled chunk update: ``math(p, g, state, **kwargs)`` on rows of blocks, state decoded and encoded
    around it, then ``p = p * decay + delta``.

    Args:
        slots: (name, kind, signed, rows, absmax, book, table) per slot.
        mult: the gradient's loss-scaling multiplier (0-dim fp32), or None.

    Returns:
        False if the compiled path is unavailable (the caller runs eagerly).
    """
    constants = tuple(
        (k, _constant_key(v)) for k, v in sorted(kwargs.items()) if k not in RUNTIME_SCALARS and not isinstance(v, bool)
    )  # (a flag's branch: a guard, as usual)
    key = (math, tuple((s[1], s[2]) for s in slots), p.dtype, g.dtype, constants, mult is not None)
    kwargs = {k: _runtime_scalar(v) if k in RUNTIME_SCALARS else v for k, v in kwargs.items()}
    slots = tuple(s + (scratch_rows(i, p) if s[1] in QUANTIZED else None,) for i, s in enumerate(slots))
    for t in (p, g) + tuple(t for s in slots for t in (s[3], s[4], s[7]) if t is not None):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    run_math, run_encode = _kernel(key)
    try:
        run_math(math, p, g, slots, kwargs, _runtime_scalar(decay), mult)
    except Exception as exc:  # compile failures surface on the first call, before anything is written
        _disable(exc)
        return False
    try:
        run_encode(slots)
    except Exception as exc:  # p is already updated: finish this chunk eagerly from the scratch values
        _disable(exc)
        _rows_encode(slots)
    return True


# -- the 8-bit codec alone, for algorithms that are not elementwise (LAMB, LARS, Adafactor, CAME): their math runs
# eagerly on whole tensors, but decoding and encoding their full-size slots is one fused pass each instead of ~20 ops.


def _encode_into(
    x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, book: torch.Tensor, table: torch.Tensor, signed: bool
) -> None:
    c, scale = encode_rows(x, book, table, signed)
    codes.copy_(c)
    absmax.copy_(scale)


def _decode_into(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, book: torch.Tensor) -> None:
    out.copy_(decode_rows(codes, absmax, book))


_codec: dict[Callable, Callable] = {}


def _run_codec(fn: Callable, rows: tuple[torch.Tensor, ...], *rest: Any) -> bool:
    if fn not in _codec:
        _codec[fn] = torch.compile(_fresh(fn, fn.__name__ + "_compiled"), fullgraph=True)
    for t in rows:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        _codec[fn](*rows, *rest)
    except Exception as exc:  # compile failures surface before anything is written
        _disable(exc)
        return False
    return True


def encode_rows_compiled(
    x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, book: torch.Tensor, table: torch.Tensor, signed: bool
) -> bool:
    """Compiled ``encode_rows`` of ``x`` [nb, bs] into ``codes`` / ``absmax``; False: not done."""
    return _run_codec(_encode_into, (x, codes, absmax), book, table, signed)


def decode_rows_compiled(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, book: torch.Tensor) -> bool:
    """Compiled :func:`~lowmemopt.quant.blockwise.decode_rows` into ``out`` [nb, bs]; False: not done."""
    return _run_codec(_decode_into, (codes, absmax, out), book)


def _disable(exc: Exception) -> None:
    global _warned, ENABLED
    ENABLED = False
    if not _warned:
        _warned = True
        warnings.warn(
            f"lowmemopt: torch.compile fast path unavailable ({type(exc).__name__}: {exc}); using eager steps",
            RuntimeWarning,
            stacklevel=external_stacklevel(),
        )


class _CompiledCodec:
    """The compiled codec as a :class:`~lowmemopt.quant.blockwise.RowCodec` (large CPU tensors)."""

    def encode(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, name: str) -> bool:
        if not applies(x):
            return False
        return encode_rows_compiled(
            x, codes, absmax, code_book(name, x.device), encode_table(name, x.device).packed, is_signed_map(name)
        )

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, name: str) -> bool:
        return applies(out) and decode_rows_compiled(codes, absmax, out, code_book(name, out.device))


register_row_codec(_CompiledCodec(), priority=10)
