"""The Triton kernel of an algorithm and a state format: :func:`lookup` reads the algorithm's declaration
(``KernelSet(triton="module:ATTR")`` names a :class:`Kernel` template in this package) and keeps the per-format kernel
it makes. A format (``fp32``, ``bf16``, ``q8``, ``q4``) is that of the full-size state slots (none: ``fp32``); every
kernel takes every format (:mod:`.codec`).
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

__all__ = ["Kernel", "lookup", "FORMATS"]

#: every state format a kernel exists for (:data:`.codec.FORMAT_CODES`)
FORMATS = ("fp32", "bf16", "q8", "q4")


@dataclass(frozen=True)
class Kernel:
    """One algorithm's Triton kernel (a template in its kernel module; :func:`lookup` fills in the name and format).

    Args:
        slots: ``slots(hyper, p)``, the slot names the kernel reads and writes, in launch-table order.
        launch: ``launch(update, bucket)``, the fused step of every tensor of a bucket.
        matrices_apart: parameters of two or more dimensions and 1-D ones take separate launches (the factored
            kernels).
        any_rounding: it writes bf16 / fp16 parameters with any ``bf16_update``; else nearest only (others: reference).
        algorithm: the declaration's name; fmt: the state format."""

    slots: Callable[[Mapping[str, Any], Any], tuple[str, ...]]
    launch: Callable[..., None]
    matrices_apart: bool = False
    any_rounding: bool = False
    algorithm: str = ""
    fmt: str = ""


_MADE: dict[tuple[Any, str], Kernel | None] = {}


def lookup(kernels: Any, fmt: str) -> Kernel | None:
    """The kernel that steps ``kernels``' algorithm on state of format ``fmt``, or None (none declared or taking it)."""
    key = (kernels, fmt)
    made = _MADE.get(key, False)
    if made is not False:
        return made
    made = None
    if kernels.triton is not None and fmt in FORMATS:
        module, attr = kernels.triton.split(":")
        template: Kernel = getattr(importlib.import_module(f".{module}", __package__), attr)
        launch = template.launch
        if kernels.triton_options:
            launch = functools.partial(launch, **dict(kernels.triton_options))
        made = replace(template, launch=launch, algorithm=kernels.name, fmt=fmt)
    _MADE[key] = made
    return made
