"""Fused Triton kernels for lowmemopt (installed as ``lowmemopt.kernels``; see ``docs/kernels.md``).

Each kernel decodes an optimizer's state, runs the algorithm's fp32 math and encodes the state again in one pass per
tile, in registers, for every parameter of the param groups with equal values in one multi-tensor launch (a few passes for LAMB, LARS,
Adafactor and CAME, whose norms and row/column statistics are reductions). The step pipeline (:mod:`lowmemopt.pipeline`)
calls :func:`~lowmemopt.kernels.dispatch.step_items` with the CUDA tensors of a step (plain, paged, FSDP2 shards, GaLore
low-rank updates); everything without a kernel takes the reference path. Nothing here imports the optimizer classes.
Modules:

* ``codec``: block-wise 8- and 4-bit encode/decode device functions (and the parameter loads and stores);
  ``blockwise``: the standalone :func:`quantize_blockwise` / :func:`dequantize_blockwise` and
  :func:`quantize_blockwise4` / :func:`dequantize_blockwise4` kernels built on them (code-for-code twins of
  :mod:`lowmemopt.quant`'s and :mod:`lowmemopt.quant.q4`'s).
* ``pow2``: the state maps' nearest code by integer arithmetic on the float's bits (no table), and its inverse.
* ``adamw``, ``sgd``, ``lion``, ``lamb``, ``lars``, ``factored`` (Adafactor, CAME): kernels and their launchers.
* ``table``, ``launch``: multi-tensor launch tables and buckets; ``registry``: (algorithm, format) -> kernel;
  ``dispatch``: which items take a kernel; ``runtime``: Triton availability, the interpreter, tile sizes.
* ``variants``: every kernel's compile-time variants and their ahead-of-time compile for sm_90 without a GPU (the
  GPU-compile test, ``bench/kernel_resources.py``).

Importing this package does not import Triton; the names below load it on first use.
"""

from __future__ import annotations

from typing import Any

__all__ = ["available", "cpu_interpreter", "dequantize_blockwise", "dequantize_blockwise4", "quantize_blockwise",
           "quantize_blockwise4", "registered"]


def available(device: Any = "cuda") -> bool:
    """Would tensors on ``device`` take the fused kernels (Triton importable, kernels enabled, a CUDA device)?"""
    import torch

    from . import runtime

    return runtime.device_ok(torch.device(device))


def __getattr__(name: str) -> Any:
    if name in ("quantize_blockwise", "dequantize_blockwise", "quantize_blockwise4", "dequantize_blockwise4"):
        from . import blockwise

        return getattr(blockwise, name)
    if name == "registered":
        from .registry import registered

        return registered
    if name == "cpu_interpreter":
        from .runtime import cpu_interpreter

        return cpu_interpreter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
