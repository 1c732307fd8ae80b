"""The fused kernels an algorithm has, as its own module declares them (:class:`KernelSet`); the backends read the
declaration from the step's plan and keep no table of algorithm names. docs/architecture.md draws where it is read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KernelSet"]


@dataclass(frozen=True, eq=False)  # (compared and hashed by identity: one declaration per algorithm)
class KernelSet:
    """One algorithm's fused backends, declared beside its math (``@fused(KernelSet(...))`` in ``optim/X.py``).

    Args:
        name: what launches, launch tables and kernel statistics call it (``"adam"``).
        triton: ``"module:ATTR"``, the :class:`lowmemopt.kernels.registry.Kernel` template in ``lowmemopt.kernels``
            that steps it (``"adamw:TRITON"``), or None. An algorithm with one decides its non-finite skips on the
            device (its kernels store nothing of a flagged tensor).
        triton_options: keyword arguments that kernel's launcher takes (SignSGD: SGD's kernel with ``sign=True``).
        native: its native CPU step, a :class:`lowmemopt.cpu.elementwise.NativeKernel` (elementwise, bucketed) or a
            :class:`lowmemopt.cpu.factored.FactoredStep` (one parameter at a time), or None.
        capturable: its Triton kernels read the step's scalars on the device (``capturable=True`` steps).
    """

    name: str
    triton: str | None = None
    triton_options: tuple[tuple[str, Any], ...] = ()
    native: Any = None
    capturable: bool = False
