"""Capturable steps (``capturable=True``): step counts kept on the device, the step's scalars made there, skips
counted in a device tensor, so a CUDA graph can capture a step and replay it without the host
(docs/pipeline.md#capturable-steps-cuda-graphs). :func:`keep` holds the tensors a captured graph reads by address."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["capturing", "keep", "device_value", "device_count", "host_count", "host_counts", "advance"]

#: tensors a captured graph reads by address (launch tables, index maps, upload buffers): kept for the process
_KEPT: list[torch.Tensor] = []


_cuda: bool | None = None  # torch.cuda.is_available(), asked once (a CPU build cannot ask about capture at all)


def capturing(device: torch.device) -> bool:
    """Is the current stream of ``device`` capturing a CUDA graph?"""
    global _cuda
    if device.type != "cuda":
        return False
    if _cuda is None:
        _cuda = torch.cuda.is_available()
    return _cuda and torch.cuda.is_current_stream_capturing()


def keep(device: torch.device, *tensors: torch.Tensor) -> None:
    """Keep ``tensors`` alive for the process if ``device``'s stream is capturing (a graph may read them at every
    replay); nothing otherwise."""
    if capturing(device):
        _KEPT.extend(tensors)


def device_value(x: Any, device: torch.device) -> Any:
    """A hyper-parameter for a capturable step's device arithmetic: a tensor on ``device`` as fp64 (a device
    operation: a graph replays it, so a scheduler's in-place change counts), a number or a CPU tensor as a Python
    float (a constant of the graph), None as None."""
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and device.type != "cpu":
            return float(x)
        return x.to(device=device, dtype=torch.float64)
    return None if x is None else float(x)  # (None: Adafactor's relative step)


def device_count(state: dict[str, Any], device: torch.device) -> torch.Tensor:
    """``state["step"]`` as a 0-dim fp32 tensor on ``device``, made in place from an int count (a new state, one
    loaded from a checkpoint, or one an ordinary step kept) by a fill on the device (no host copy)."""
    step = state["step"]
    if isinstance(step, torch.Tensor):
        if step.device != device or step.dtype != torch.float32:
            step = state["step"] = step.to(device=device, dtype=torch.float32)
        return step
    if not 0 <= step <= 2**24:
        raise ValueError(f"step count {step!r} cannot be kept exactly in a capturable step (fp32)")
    step = state["step"] = torch.full((), float(step), dtype=torch.float32, device=device)
    return step


def host_count(state: dict[str, Any]) -> None:
    """``state["step"]`` back to an int where a capturable step left a tensor (read once, when an ordinary step
    takes the parameter again)."""
    if isinstance(state["step"], torch.Tensor):
        state["step"] = int(state["step"].item())


def host_counts(states: list[dict[str, Any]]) -> None:
    """:func:`host_count` of each of ``states`` (a bucket's: one call)."""
    for state in states:
        if isinstance(state["step"], torch.Tensor):
            host_count(state)


def advance(steps: list[torch.Tensor], flags: torch.Tensor | None) -> None:
    """Add 1 to each counter of ``steps``, or its finiteness flag (``flags``: uint8 ``[T]`` on the device, 0 for a
    skipped tensor): one multi-tensor add."""
    if flags is None:
        torch._foreach_add_(steps, 1.0)
    else:
        torch._foreach_add_(steps, list(flags.to(torch.float32).unbind()))
