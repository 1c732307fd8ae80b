"""Native CPU kernels: each fuses decode -> an algorithm's fp32 math -> encode for one parameter in one pass, compiled
at first use (:mod:`lowmemopt.cpu.build`): :func:`step_elementwise` (Adam/AdamW, Lion, SGD), :func:`step_factored`
(Adafactor, CAME on large 2-D parameters), the 8-bit codec (:func:`encode_rows_into`, :func:`decode_rows_into`). Without
a compiler, or with ``LOWMEMOPT_CPU_KERNELS=0``, the compiled / eager paths run. Exactness and the build:
``docs/cpu_kernels.md``.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .._stacklevel import external_stacklevel
from ..quant.blockwise import register_row_codec
from . import build

__all__ = [
    "ENABLED",
    "available",
    "applies",
    "step_elementwise",
    "step_factored",
    "grad_is_finite",
    "encode_rows_into",
    "decode_rows_into",
    "copy_files",
]

ENABLED = os.environ.get("LOWMEMOPT_CPU_KERNELS", "1") != "0"
_warned = False


def available() -> bool:
    """True if the native kernels are enabled and built (building them on first call)."""
    return _library() is not None


def _library() -> Any:
    """The kernel library if the kernels are enabled and built (building them on first call; warned once if not)."""
    global _warned
    if not ENABLED:
        return None
    lib = build.library()
    if lib is None and not _warned:
        _warned = True
        warnings.warn(
            f"lowmemopt: native CPU kernels unavailable ({build.build_error}); using the torch paths",
            RuntimeWarning,
            stacklevel=external_stacklevel(),
        )
    return lib


def applies(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and available()


def step_elementwise(kernel: Any, kwargs: dict, pflat: torch.Tensor, *args, **kw) -> tuple[int, bool | None]:
    """See :func:`lowmemopt.cpu.elementwise.step` (``(0, None)``: not done, when the kernels are off or unavailable)."""
    if not applies(pflat):
        return 0, None
    from .elementwise import step

    return step(kernel, kwargs, pflat, *args, **kw)


def step_factored(native: Any, p: torch.Tensor, pflat: torch.Tensor, *args, **kw) -> int:
    """See :func:`lowmemopt.cpu.factored.step` (0, :data:`~lowmemopt.cpu.factored.NOT_APPLIED`, when the kernels are
    off or unavailable)."""
    if not applies(pflat):
        return 0
    from .factored import step

    return step(native, p, pflat, *args, **kw)


def grad_is_finite(g: torch.Tensor) -> bool | None:
    """The optimizer's non-finite gradient check for one CPU tensor, natively: is the fp32 sum of squares of ``g``
    finite? None: not done here (kernels unavailable, or ``g`` is not a contiguous fp32 / bf16 / fp16 CPU tensor)."""
    from . import ffi

    if not ffi.can_scan(g):
        return None
    lib = _library()
    return None if lib is None else ffi.scan_is_finite(lib, g)


def encode_rows_into(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, name: str) -> bool:
    """Quantize fp32 rows ``x`` [nb, bs] into ``codes`` (uint8 [nb, bs]) and ``absmax`` (fp32 [nb]) in map ``name``,
    exactly as :func:`lowmemopt.quant.blockwise.encode_rows`. False: not done (unavailable, a map other than the state
    maps, or an unsupported layout)."""
    from .ffi import run_codec

    return applies(x) and run_codec("lmo_encode", x, codes, absmax, name)


def decode_rows_into(codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, name: str) -> bool:
    """Dequantize ``codes`` [nb, bs] with ``absmax`` [nb] into fp32 ``out`` [nb, bs]; False: not done."""
    from .ffi import run_codec

    return applies(out) and run_codec("lmo_decode", out, codes, absmax, name)


class _NativeCodec:
    """The native codec as a :class:`~lowmemopt.quant.blockwise.RowCodec` (CPU tensors, the state maps)."""

    def encode(self, x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, name: str) -> bool:
        return x.device.type == "cpu" and ENABLED and encode_rows_into(x, codes, absmax, name)

    def decode(self, codes: torch.Tensor, absmax: torch.Tensor, out: torch.Tensor, name: str) -> bool:
        return out.device.type == "cpu" and ENABLED and decode_rows_into(codes, absmax, out, name)


register_row_codec(_NativeCodec(), priority=0)


def copy_files(requests: list[tuple[str, torch.Tensor, bool]]) -> list[OSError | None] | None:
    """See :func:`lowmemopt.cpu.fileio.copy_files` (None: the kernels are off or unavailable)."""
    if not available():
        return None
    from .fileio import copy_files as copy

    return copy(requests)
