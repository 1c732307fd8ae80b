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
    """An elementwise algorithm's C kernel, declared in its own module (:class:`lowmemopt.work.kernel_set.KernelSet`)."""

    name: str  # exported C function (its ``_many`` twin steps a bucket)
    scalars: Callable[[dict[str, Any], float], tuple[tuple[float, ...], int]]  # (math kwargs, decay) -> (h, flags)
    slots: Callable[[dict[str, Any]], tuple[str, ...]]  # the slots, in the kernel's order


_SCALARS = (float, int, bool)


def _is_number(v: Any) -> bool:
    """A Python number, or a tuple / list of them (betas): what the kernels take as runtime scalars."""
    t = type(v)
    return t in _SCALARS or ((t is tuple or t is list) and all(type(x) in _SCALARS for x in v))


def _same_slots(names: tuple[str, ...], slots: dict[str, Any]) -> bool:
    """Are ``names`` (the kernel's slots) exactly the parameter's ``slots``?"""
    return len(names) == len(slots) and all(k in slots for k in names)


def _derived(kernel: NativeKernel, kwargs: dict[str, Any], decay: float,
             memo: dict | None) -> tuple[bool, tuple[str, ...], tuple[float, ...], int]:
    """``(numbers, slot names, h, flags)``: whether the hyper-parameters are plain numbers (a tensor is not taken),
    the kernel's slots and its scalars; from ``memo`` where this ``kwargs`` object was seen (see :func:`prepare`)."""
    key = (kernel, id(kwargs), decay)
    derived = None if memo is None else memo.get(key)
    if derived is None:
        numbers = all(map(_is_number, kwargs.values())) and _is_number(decay)
        h, flags = kernel.scalars(kwargs, decay) if numbers else ((), 0)
        derived = (numbers, kernel.slots(kwargs) if numbers else (), h, flags)
        if memo is not None:
            memo[key] = derived
    return derived


def prepare(kernel: NativeKernel | None, kwargs: dict[str, Any], pflat: torch.Tensor, gflat: torch.Tensor,
            state: dict[str, Any], slots: dict[str, Any], formats: dict[str, StateFormat], record: BucketRecord,
            step: int, decay: float, scan: torch.Tensor | None = None,
            index_base: int | None = 0, memo: dict | None = None,
            grad_mult: float | None = None) -> tuple[ffi.Args | None, int]:
    """The fused kernel's arguments for one parameter (see :func:`step`), and how many leading elements the kernel
    will do; ``(None, 0)`` where the kernel does not apply (the caller runs the torch paths). ``memo``: a dict kept
    while ``kwargs`` and ``decay`` stay the same objects (a bucket's parameters of one group and step), which holds
    what is derived from them alone."""
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
            if not (nibbles.is_contiguous() and nibbles.dtype == torch.uint8 and absmax.is_contiguous()
                    and absmax.dtype == torch.float32 and nibbles.numel() >= q4.packed_len(rows * bs)
                    and absmax.numel() >= rows):
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
        if kahan is not None and not (kahan.is_contiguous() and kahan.dtype == pflat.dtype
                                      and kahan.numel() == pflat.numel() and kahan.device == pflat.device):
            return None, 0
        if mode == "stochastic" and index_base is None:
            return None, 0
        key = rounding.step_key(state[rounding.SEED], step) if mode == "stochastic" else 0
        ffi.set_update(args, mode, key, index_base or 0, kahan)
    return args, rows * bs + tail


def refresh(args: ffi.Args, kernel: NativeKernel, kwargs: dict[str, Any], gflat: torch.Tensor, state: dict[str, Any],
            slots: dict[str, Any], step: int, decay: float, scan: torch.Tensor | None = None, memo: dict | None = None,
            grad_mult: float | None = None) -> bool:
    """Make ``args``, which :func:`prepare` made for this parameter on an earlier step, this step's: the gradient, the
    scalars, the check, the stochastic rounding key, the loss scaling multiplier. The caller vouches that nothing else
    changed (the parameter, its state tensors and their formats, the storage options). False: the hyper-parameters
    now ask for another kernel setup (call :func:`prepare`)."""
    numbers, names, h, flags = _derived(kernel, kwargs, decay, memo)
    if not numbers or not _same_slots(names, slots):
        return False
    args.g = gflat.data_ptr()
    args.h[:len(h)] = h
    args.flags = flags
    args.nthreads = torch.get_num_threads()
    ffi.set_scan(args, scan)
    if args.p_update == ffi.UPDATES["stochastic"]:
        args.sr_key = rounding.step_key(state[rounding.SEED], step)
    args.g_mult = 0.0 if grad_mult is None else grad_mult
    return True


def step(kernel: NativeKernel | None, kwargs: dict[str, Any], pflat: torch.Tensor, gflat: torch.Tensor,
         state: dict[str, Any], slots: dict[str, Any], formats: dict[str, StateFormat], record: BucketRecord,
         step: int, decay: float, scan: torch.Tensor | None = None,
         index_base: int | None = 0, grad_mult: float | None = None) -> tuple[int, bool | None]:
    """Run the fused kernel ``kernel`` (with the math's keyword arguments ``kwargs``; ``record``: the bucket's
    options, its block size and rounding mode; ``step``: the step being taken) over the flat tensor
    ``pflat`` (contiguous; updated in place) with gradient ``gflat``, state slots decoded and encoded around it,
    ``p = p * decay + delta``: all of it for fp32 / bf16 state, the full blocks for 8- and 4-bit state (a ragged
    last block is the caller's, as on the eager path).

    ``scan``: another gradient (the next parameter's) whose finiteness the kernel checks in the same parallel loop
    (:func:`lowmemopt.cpu.ffi.scan_result`), its reads overlapping this kernel's arithmetic.

    ``index_base``: the flat index of ``pflat``'s first element in its whole parameter (a shard's offset), which
    stochastic rounding hashes; None: the elements are not one range of it (the kernel declines stochastic rounding).

    ``grad_mult``: the loss scaling multiplier (``1 / scale``, an fp32 value), applied where the kernel loads the
    gradient and rounded to its dtype as ``GradScaler.unscale_`` stores it; None: none.

    Returns ``(done, scanned)``: how many leading elements it did (0: the kernel does not apply here; the caller runs
    the rest), and whether ``scan`` is finite (None: not scanned)."""
    args, done = prepare(kernel, kwargs, pflat, gflat, state, slots, formats, record, step, decay, scan, index_base,
                         grad_mult=grad_mult)
    if args is None:
        return 0, None
    ffi.call(getattr(build.library(), kernel.name), args)
    return done, (None if args.scan is None else ffi.scan_result(args))


def step_many(kernel: NativeKernel, batch: list[ffi.Args]) -> list[bool]:
    """Run the fused kernel ``kernel`` over many parameters (each one's arguments from :func:`prepare`) in one
    parallel region: one fork/join of the threads per bucket instead of one per parameter. An argument set with a
    ``scan`` of its own gradient is checked before its update (read while the previous parameter is updated);
    returns per parameter whether it was stepped (False: that check found a NaN / Inf or an overflowing sum
    of squares, and nothing of the parameter or its state was written)."""
    return ffi.call_many(getattr(build.library(), kernel.name + "_many"), batch)
