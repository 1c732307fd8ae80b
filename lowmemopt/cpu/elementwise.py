"""The native C kernels of the elementwise algorithms (``csrc/elementwise.c``): a parameter's kernel arguments
(:func:`prepare`, :func:`refresh`) and the calls (:func:`step`, :func:`step_many`). Each algorithm declares its
:class:`NativeKernel` in ``optim/X.py``: the C function and how the math's keyword arguments become its scalars (the
math's own expressions, so results equal the eager path's; docs/cpu_kernels.md)."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .. import rounding
from ..quant import q4
from ..quant.formats import BF16, FP32, Q4, Q8, StateFormat
from ..work.record import BucketRecord
from . import build, ffi

__all__ = ["NativeKernel", "prepare", "refresh", "step", "step_many"]

#: rows of this many elements for fp32 / bf16 state (any size works; q8 / q4 rows are the quantization blocks); the
#: kernel also does the last partial row, so every element of a parameter takes the same arithmetic (a sharded
#: parameter's local shards step exactly as the whole one)
DENSE_ROW = 64


class NativeKernel(NamedTuple):
    """An elementwise algorithm's C kernel, declared in its own module
    (:class:`lowmemopt.work.kernel_set.KernelSet`)."""

    name: str  # exported C function (its ``_many`` twin steps a bucket)
    scalars: Callable[[dict[str, Any], float], tuple[tuple[float, ...], int]]  # (math kwargs, decay) -> (h, flags)
    slots: Callable[[dict[str, Any]], tuple[str, ...]]  # the slots, in the kernel's order


_SCALARS = (float, int, bool)


def _is_number(v: Any) -> bool:
    t = type(v)
    return t in _SCALARS or ((t is tuple or t is list) and all(type(x) in _SCALARS for x in v))


def _same_slots(names: tuple[str, ...], slots: dict[str, Any]) -> bool:
    return len(names) == len(slots) and all(k in slots for k in names)


def _derived(
    kernel: NativeKernel, kwargs: dict[str, Any], decay: float, memo: dict | None
) -> tuple[bool, tuple[str, ...], tuple[float, ...], int]:
    key = (kernel, id(kwargs), decay)
    derived = None if memo is None else memo.get(key)
    if derived is None:
        numbers = all(map(_is_number, kwargs.values())) and _is_number(decay)
        h, flags = kernel.scalars(kwargs, decay) if numbers else ((), 0)
        derived = (numbers, kernel.slots(kwargs) if numbers else (), h, flags)
        if memo is not None:
            memo[key] = derived
    return derived


def prepare(
    kernel: NativeKernel | None,
    kwargs: dict[str, Any],
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Any],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    decay: float,
    scan: torch.Tensor | None = None,
    index_base: int | None = 0,
    memo: dict | None = None,
    grad_mult: float | None = None,
) -> tuple[ffi.Args | None, int]:
    """The fused kernel's arguments for one parameter (see :func:`step`) and how many leading elements it will do;
    ``(None, 0)``: the kernel does not apply. ``memo``: kept while ``kwargs`` and ``decay`` stay the same objects."""
    if not isinstance(kernel, NativeKernel) or not ffi.usable(pflat) or gflat.device != pflat.device:
        return None, 0
    if pflat.dtype not in ffi.DTYPES or gflat.dtype not in ffi.DTYPES or not gflat.is_contiguous():
        return None, 0
    numbers, names, h, flags = _derived(kernel, kwargs, decay, memo)
    if not numbers:
        return None, 0
    if not _same_slots(names, slots):
        return None, 0
    kinds = {formats[k] for k in names}
    if len(kinds) > 1:
        return None, 0
    fmt = kinds.pop() if kinds else FP32
    quantized = fmt is Q8 or fmt is Q4
    if quantized:
        block_size = record.block_size
        rows, bs = pflat.numel() // block_size, block_size
        if not (16 <= bs <= ffi.MAX_BLOCK and bs % 16 == 0):
            return None, 0
    elif fmt in (FP32, BF16):
        rows, bs = pflat.numel() // DENSE_ROW, DENSE_ROW
    else:
        return None, 0
    tail = pflat.numel() - rows * bs if not quantized else 0
    if rows == 0 and tail == 0:
        return None, 0
    cslots = []
    for k in names:
        signed = slots[k].signed
        if fmt is Q8:
            codes, absmax = state[k + ".codes"], state[k + ".absmax"]
            if not (codes.is_contiguous() and absmax.is_contiguous() and absmax.dtype == torch.float32):
                return None, 0
            cslots.append(ffi.slot_q8(codes, absmax, signed))
        elif fmt is Q4:
            nibbles, absmax = state[k + ".nibbles"], state[k + ".absmax"]
            if not (
                nibbles.is_contiguous()
                and nibbles.dtype == torch.uint8
                and absmax.is_contiguous()
                and absmax.dtype == torch.float32
                and nibbles.numel() >= q4.packed_len(rows * bs)
                and absmax.numel() >= rows
            ):
                return None, 0
            cslots.append(ffi.slot_q4(nibbles, absmax, signed))
        else:
            t = state[k]
            if not t.is_contiguous() or t.dtype != (torch.float32 if fmt is FP32 else torch.bfloat16):
                return None, 0
            cslots.append(ffi.slot_dense(t))
    if scan is not None and not ffi.can_scan(scan):
        scan = None
    args = ffi.args_for(pflat, gflat, rows, bs, cslots, h, flags, tail, scan)
    if grad_mult is not None:
        args.g_mult = grad_mult
    mode = record.rounding_of(pflat)  # bf16 / fp16 parameters: nearest / stochastic / Kahan, as the eager path
    if mode != "nearest":
        rounding.init_state(state, pflat, mode)
        kahan = state.get(rounding.KAHAN) if mode == "kahan" else None
        if kahan is not None and not (
            kahan.is_contiguous()
            and kahan.dtype == pflat.dtype
            and kahan.numel() == pflat.numel()
            and kahan.device == pflat.device
        ):
            return None, 0
        if mode == "stochastic" and index_base is None:
            return None, 0
        key = rounding.step_key(state[rounding.SEED], step) if mode == "stochastic" else 0
        ffi.set_update(args, mode, key, index_base or 0, kahan)
    return args, rows * bs + tail


def refresh(
    args: ffi.Args,
    kernel: NativeKernel,
    kwargs: dict[str, Any],
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Any],
    step: int,
    decay: float,
    scan: torch.Tensor | None = None,
    memo: dict | None = None,
    grad_mult: float | None = None,
    set_scan: bool = True,
) -> bool:
    """Make ``args`` (from :func:`prepare` on an earlier step) this step's: gradient, scalars, check (unless not
    ``set_scan``), rounding key, loss-scaling multiplier; the caller vouches nothing else changed. False: call
    :func:`prepare` again."""
    numbers, names, h, flags = _derived(kernel, kwargs, decay, memo)
    if not numbers or not _same_slots(names, slots):
        return False
    args.g = gflat.data_ptr()
    args.h[: len(h)] = h
    args.flags = flags
    args.nthreads = torch.get_num_threads()
    if set_scan:
        ffi.set_scan(args, scan)
    if args.p_update == ffi.UPDATES["stochastic"]:
        args.sr_key = rounding.step_key(state[rounding.SEED], step)
    args.g_mult = 0.0 if grad_mult is None else grad_mult
    return True


def refresh_many(
    kernel: NativeKernel, entries: list[tuple], memo: dict | None = None, grad_mult: float | None = None
) -> list[bool]:
    """:func:`refresh` of each ``(args, kwargs, gflat, state, slots, step, decay, scan)`` of ``entries``, the checks
    set in one pass: True where ``args`` now hold this step's."""
    done = [
        refresh(a, kernel, kw, g, st, sl, n, d, sc, memo, grad_mult, False) for a, kw, g, st, sl, n, d, sc in entries
    ]
    ffi.set_scans([(e[0], e[7]) for e, ok in zip(entries, done) if ok])
    return done


def step(
    kernel: NativeKernel | None,
    kwargs: dict[str, Any],
    pflat: torch.Tensor,
    gflat: torch.Tensor,
    state: dict[str, Any],
    slots: dict[str, Any],
    formats: dict[str, StateFormat],
    record: BucketRecord,
    step: int,
    decay: float,
    scan: torch.Tensor | None = None,
    index_base: int | None = 0,
    grad_mult: float | None = None,
) -> tuple[int, bool | None]:
    """Run ``kernel`` over the flat, contiguous ``pflat`` (in place) with gradient ``gflat``, the slots decoded and
    encoded around ``p = p * decay + delta``; 8- and 4-bit state: the full blocks only (a ragged last one is the
    caller's).

    Args:
        kwargs: the math's keyword arguments. record: the bucket's options. step: the step being taken.
        scan: the next parameter's gradient, whose finiteness the kernel checks in the same parallel loop.
        index_base: ``pflat[0]``'s flat index in its whole parameter (stochastic rounding's hash); None: not one range.
        grad_mult: the loss-scaling multiplier ``1 / scale`` applied as the gradient is loaded; None: none.

    Returns:
        ``(done, scanned)``: the leading elements done (0: the caller runs them), whether ``scan`` is finite (None)."""
    args, done = prepare(
        kernel, kwargs, pflat, gflat, state, slots, formats, record, step, decay, scan, index_base, grad_mult=grad_mult
    )
    if args is None:
        return 0, None
    ffi.call(getattr(build.library(), kernel.name), args)
    return done, (None if args.scan is None else ffi.scan_result(args))


def step_many(kernel: NativeKernel, batch: list[ffi.Args]) -> list[bool]:
    """Run ``kernel`` over many parameters (arguments from :func:`prepare`) in one parallel region (one fork/join per
    bucket). Returns per parameter whether it stepped (False: its ``scan`` found a NaN / Inf or an overflowing sum
    of squares; nothing written)."""
    return ffi.call_many(getattr(build.library(), kernel.name + "_many"), batch)
