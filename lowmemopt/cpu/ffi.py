"""ctypes mirror of the argument structs in ``csrc/lmo.h`` and the helpers that fill them from tensors."""

from __future__ import annotations

import ctypes
import math
from typing import Sequence

import torch

from ..quant.formats import map_for
from ..quant.maps import is_signed_map
from . import build
from .codec import tables, tables4

__all__ = [
    "Slot",
    "Args",
    "DTYPES",
    "MAX_BLOCK",
    "slot_dense",
    "slot_q8",
    "slot_q4",
    "args_for",
    "set_scan",
    "call",
    "call_many",
    "rejected",
    "can_scan",
    "scan_result",
    "scan_is_finite",
    "run_codec",
]

MAX_SLOTS = 4
MAX_BLOCK = 4096  # LMO_MAX_BS
ST_F32, ST_BF16, ST_Q8, ST_Q4 = 0, 1, 2, 3
#: parameter / gradient dtypes the kernels read and write
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class Slot(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("absmax", ctypes.c_void_p),
        ("book", ctypes.c_void_p),
        ("planes", ctypes.c_void_p),
        ("packed", ctypes.c_void_p),
        ("pow2", ctypes.c_void_p),
        ("thr", ctypes.c_void_p),
        ("kind", ctypes.c_int32),
        ("is_signed", ctypes.c_int32),
    ]


class Args(ctypes.Structure):
    _fields_ = [
        ("p", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("nrows", ctypes.c_int64),
        ("bs", ctypes.c_int32),
        ("p_dtype", ctypes.c_int32),
        ("g_dtype", ctypes.c_int32),
        ("nthreads", ctypes.c_int32),
        ("nslots", ctypes.c_int32),
        ("flags", ctypes.c_int32),
        ("tail", ctypes.c_int32),
        ("slot", Slot * MAX_SLOTS),
        ("h", ctypes.c_double * 16),
        ("scan", ctypes.c_void_p),
        ("scan_n", ctypes.c_int64),
        ("scan_dtype", ctypes.c_int32),
        ("scan_pad", ctypes.c_int32),
        ("scan_sumsq", ctypes.c_void_p),
        ("p_update", ctypes.c_int32),
        ("sr_key", ctypes.c_uint32),
        ("p_offset", ctypes.c_int64),
        ("kahan", ctypes.c_void_p),
        ("g_mult", ctypes.c_float),  # loss scaling: the gradient's multiplier (0 or 1: none)
    ]


def slot_dense(values: torch.Tensor) -> Slot:
    """An fp32 or bf16 slot (contiguous, any shape)."""
    kind = ST_F32 if values.dtype == torch.float32 else ST_BF16
    return Slot(values.data_ptr(), None, None, None, None, None, None, kind, 0)


def slot_q8(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> Slot:
    t = tables(signed)
    return Slot(
        codes.data_ptr(),
        absmax.data_ptr(),
        t.book.data_ptr(),
        t.planes.data_ptr(),
        t.packed.data_ptr(),
        ctypes.addressof(t.pow2),
        None,
        ST_Q8,
        int(signed),
    )


def slot_q4(nibbles: torch.Tensor, absmax: torch.Tensor, signed: bool) -> Slot:
    """A 4-bit slot: ``nibbles`` uint8 and an fp32 ``absmax`` per block row, in ``q4.map4_for(signed)``."""
    t = tables4(signed)
    return Slot(
        nibbles.data_ptr(),
        absmax.data_ptr(),
        t.book.data_ptr(),
        None,
        t.packed.data_ptr(),
        None,
        t.thr.data_ptr(),
        ST_Q4,
        int(signed),
    )


def args_for(
    p: torch.Tensor | None,
    g: torch.Tensor | None,
    nrows: int,
    bs: int,
    slots: list[Slot],
    hyper: tuple[float, ...] = (),
    flags: int = 0,
    tail: int = 0,
    scan: torch.Tensor | None = None,
) -> Args:
    """The kernel arguments; ``scan``: a tensor whose sum of squares the kernel also checks."""
    a = Args()
    a.p = None if p is None else p.data_ptr()
    a.g = None if g is None else g.data_ptr()
    a.nrows, a.bs = nrows, bs
    a.p_dtype = DTYPES[p.dtype] if p is not None else 0
    a.g_dtype = DTYPES[g.dtype] if g is not None else 0
    a.nthreads = torch.get_num_threads()
    a.nslots = len(slots)
    for i, s in enumerate(slots):
        a.slot[i] = s
    for i, h in enumerate(hyper):
        a.h[i] = h
    a.flags, a.tail = flags, tail
    set_scan(a, scan)
    return a


def set_scan(a: Args, scan: torch.Tensor | None) -> None:
    """Point ``a``'s non-finite check at ``scan`` (None: no check); see :func:`args_for`."""
    if scan is None:
        a.scan, a.scan_n, a.scan_sumsq = None, 0, None
        return
    if getattr(a, "_sumsq", None) is None:
        a._sumsq = ctypes.c_float(0.0)  # kept alive with the struct
    a._sumsq.value = 0.0
    a.scan, a.scan_n, a.scan_dtype = scan.data_ptr(), scan.numel(), DTYPES[scan.dtype]
    a.scan_sumsq = ctypes.addressof(a._sumsq)


def set_scans(pairs: Sequence[tuple[Args, torch.Tensor | None]]) -> None:
    """:func:`set_scan` of each ``(args, scan)``."""
    for a, scan in pairs:
        set_scan(a, scan)


#: ``bf16_update`` -> the kernels' UPD_* code
UPDATES = {"nearest": 0, "stochastic": 1, "kahan": 2}


def set_update(a: Args, mode: str, key: int = 0, offset: int = 0, kahan: torch.Tensor | None = None) -> Args:
    """How the kernel writes a bf16 / fp16 parameter: stochastic ``key``, ``offset``, ``kahan`` buffer."""
    a.p_update, a.sr_key, a.p_offset = UPDATES[mode], key, offset
    a.kahan = None if kahan is None else kahan.data_ptr()
    return a


def can_scan(t: torch.Tensor) -> bool:
    """Whether a kernel can scan ``t`` (a contiguous CPU tensor of a supported dtype)."""
    return not t.is_sparse and t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous()


def scannable(tensors: Sequence[torch.Tensor]) -> list[int]:
    """The indices of the ``tensors`` that :func:`can_scan` takes."""
    return [i for i, t in enumerate(tensors) if can_scan(t)]


def scan_result(args: Args) -> bool:
    """After a call with ``scan``: whether its fp32 sum of squares is finite."""
    return math.isfinite(args._sumsq.value)


def scan_is_finite(lib, g: torch.Tensor) -> bool:
    """Whether the fp32 sum of squares of ``g`` (:func:`can_scan`) is finite, by ``lib``'s ``lmo_scan``."""
    if not g.numel():  # (nothing to scan: its data pointer is null, which the kernel refuses)
        return True
    args = args_for(None, None, 0, 16, [], scan=g)
    call(lib.lmo_scan, args)
    return scan_result(args)


def call(fn, args: Args) -> None:
    rc = fn(ctypes.byref(args))
    if rc != 0:
        raise rejected(fn, rc)


def rejected(fn, rc: int) -> RuntimeError:
    """The error of kernel ``fn`` returning ``rc`` (not 0: it refused its arguments)."""
    return RuntimeError(f"lowmemopt C kernel {fn.__name__} rejected its arguments (code {rc})")


def call_many(fn, batch: list[Args]) -> list[bool]:
    """``fn`` over the argument sets ``batch`` in one call; per set: stepped, or skipped (False)."""
    n = len(batch)
    if n == 0:
        return []
    arr = (Args * n)(*batch)
    ok = (ctypes.c_uint8 * n)()
    rc = fn(arr, ctypes.c_int64(n), ok)
    if rc != 0:
        raise rejected(fn, rc)
    return [bool(v) for v in ok]


def usable(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CPU tensor and the library is built."""
    return t.device.type == "cpu" and build.library() is not None


def run_codec(fn: str, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, name: str) -> bool:
    """``lmo_encode`` / ``lmo_decode`` of rows ``x`` in map ``name``; False where not done."""
    signed = is_signed_map(name)
    ok = (
        name == map_for(signed)
        and usable(x)
        and x.dim() == 2
        and x.dtype == torch.float32
        and codes.dtype == torch.uint8
        and absmax.dtype == torch.float32
        and x.shape == codes.shape
        and absmax.shape == x.shape[:1]
        and 16 <= x.shape[1] <= MAX_BLOCK
        and x.shape[1] % 16 == 0
        and all(t.is_contiguous() and t.device.type == "cpu" for t in (x, codes, absmax))
    )
    if not ok:
        return False
    p, g = (None, x) if fn == "lmo_encode" else (x, None)
    call(getattr(build.library(), fn), args_for(p, g, x.shape[0], x.shape[1], [slot_q8(codes, absmax, signed)]))
    return True
