"""Fused Triton kernels (installed as ``lowmemopt.kernels``): decode the state, run the fp32 math, encode, in
registers, one multi-tensor launch per bucket and pass. The pipeline calls ``dispatch.step_triton``; what has no kernel
takes the reference path. Importing this package does not import Triton. Docs: docs/kernels.md.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "cpu_interpreter",
    "dequantize_blockwise4",
    "dequantize_blockwise_triton",
    "fused_available",
    "quantize_blockwise4",
    "quantize_blockwise_triton",
    "registered",
]


def fused_available(device: Any = "cuda") -> bool:
    """Would tensors on ``device`` take the fused kernels (Triton importable, kernels enabled, a CUDA device)?"""
    import torch

    from . import runtime

    return runtime.device_ok(torch.device(device))


def __getattr__(name: str) -> Any:
    if name in (
        "quantize_blockwise_triton",
        "dequantize_blockwise_triton",
        "quantize_blockwise4",
        "dequantize_blockwise4",
    ):
        from . import blockwise

        return getattr(blockwise, name)
    if name == "registered":
        from .registry import registered

        return registered
    if name == "cpu_interpreter":
        from .runtime import cpu_interpreter

        return cpu_interpreter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
