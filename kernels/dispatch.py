"""Which parameters of a step take a fused kernel, and the launches that step them.

:func:`step_fused` is called by ``LowMemOptimizer.step()`` after the non-finite gradient check, with the parameters
that will be stepped. It returns the ones it did not take; the optimizer steps those on the reference path
(``_step_param``). A parameter takes the kernel path when all of these hold:

* Triton imports, ``LOWMEMOPT_KERNELS`` is not ``0``, and the parameter is a CUDA tensor (or a CPU tensor while a
  test runs the Triton interpreter, see :class:`~lowmemopt.kernels.runtime.cpu_interpreter`);
* the optimizer runs a registered algorithm (:func:`~lowmemopt.kernels.registry.algorithm_of`) and the base class's
  ``_step_param`` (a subclass that replaces it, e.g. to project gradients, keeps it);
* it is not a GaLore parameter (its group has a ``rank``, or its state a projector: the projected path steps it) and
  its group is not paged;
* parameter and gradient are contiguous, of the same shape and device, in fp32, bf16 or fp16;
* its state has exactly the slots the kernel expects, contiguous on the parameter's device, and its full-size slots
  share one format that the registry has a kernel for.

Parameters that qualify are grouped into *buckets* (param group, format, dtypes, step count, layout) and each bucket is
stepped by one kernel's launches (one to four passes, each a single multi-tensor launch). The step count is written only
after the launches. A launch that fails before writing anything (a Triton compile error, say) turns the kernel path off
for the process with a warning and its bucket takes the reference path; a failure after writing is raised.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch

from lowmemopt.optimizer import LowMemOptimizer
from lowmemopt.quant.formats import choose_format, format_of

from .launch import UPDATE_ALGORITHMS

__all__ = ["step_fused", "stats"]

#: buckets stepped by a kernel, per (algorithm, format), since import (tests check that the fused path really ran)
stats: dict[tuple[str, str], int] = {}

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def step_fused(optimizer: LowMemOptimizer, todo: list[tuple[torch.Tensor, dict[str, Any]]]) -> list:
    """Step what the kernels can in ``todo`` ((param, group) pairs with finite gradients); return the rest."""
    if not any(p.is_cuda for p, _ in todo):  # CPU-only steps never import Triton (unless a test asked for it)
        rt = sys.modules.get(__package__ + ".runtime")
        if rt is None or not rt._cpu_interpreter:
            return todo
    from . import runtime

    if not (runtime.HAS_TRITON and runtime.ENABLED) or not any(runtime.device_ok(p.device) for p, _ in todo):
        return todo
    if type(optimizer)._step_param is not LowMemOptimizer._step_param:
        return todo
    from . import registry
    from .launch import Bucket, Unsupported

    algorithm = registry.algorithm_of(optimizer)
    if algorithm is None:
        return todo
    rest = []
    buckets: dict[tuple, tuple[Any, dict, list[torch.Tensor]]] = {}
    for p, group in todo:
        found = _kernel_for(optimizer, registry, algorithm, p, group)
        if found is None:
            rest.append((p, group))
            continue
        kernel, fmt = found
        key = (id(group), fmt, p.dtype, p.grad.dtype, p.device, optimizer.state[p]["step"], kernel.layout(p))
        buckets.setdefault(key, (kernel, group, []))[2].append(p)

    for key, (kernel, group, params) in buckets.items():
        if not runtime.ENABLED:  # turned off by a failure in an earlier bucket
            rest += [(p, group) for p in params]
            continue
        step = key[5] + 1
        bucket = Bucket(params, [optimizer.state[p] for p in params], key[1], group["block_size"])
        try:
            kernel.launch(optimizer, group, bucket, step)
        except Unsupported:
            rest += [(p, group) for p in params]
            continue
        except Exception as exc:
            if bucket.written:
                raise
            runtime.ENABLED = False
            warnings.warn(f"lowmemopt: fused Triton kernels unavailable ({type(exc).__name__}: {exc}); "
                          "using the reference step", RuntimeWarning, stacklevel=3)
            rest += [(p, group) for p in params]
            continue
        for p in params:
            optimizer.state[p]["step"] = step
        stats[(kernel.algorithm, kernel.fmt)] = stats.get((kernel.algorithm, kernel.fmt), 0) + 1
    return rest


def _kernel_for(optimizer, registry, algorithm: str, p: torch.Tensor, group: dict[str, Any]):
    """(kernel, format) for this parameter, or None: it takes the reference path."""
    from . import runtime

    g = p.grad
    if group.get("rank") is not None or "galore.side" in optimizer.state.get(p, ()):  # GaLore: projected steps
        return None
    if group.get("paged") not in (False, None):
        return None
    if not runtime.device_ok(p.device) or p.dtype not in _DTYPES or g.dtype not in _DTYPES:
        return None
    if g.shape != p.shape or g.device != p.device or not (p.is_contiguous() and g.is_contiguous()):
        return None
    slots = optimizer._slots(group, p)
    # the format the full-size slots have (or will get): a param without any counts as fp32
    full = [name for name, s in slots.items() if s.quantize and s.shape is None]
    state = optimizer.state[p]
    if not isinstance(state.get("step", 0), int):  # e.g. a tensor step from a foreign state dict
        return None
    if "step" in state:
        try:
            formats = {format_of(state, name).name for name in full}
        except KeyError:  # a slot is missing: the reference path reports it
            return None
    else:
        formats = {choose_format(group["state_bits"], p.numel(), group["min_quant_numel"]).name} if full else set()
    if len(formats) > 1:
        return None
    kernel = registry.lookup(algorithm, formats.pop() if formats else "fp32")
    if kernel is None or tuple(sorted(kernel.slots(group, p))) != tuple(sorted(slots)):
        return None
    if group.get("bf16_update", "nearest") != "nearest" and p.dtype == torch.bfloat16 and algorithm not in UPDATE_ALGORITHMS:
        return None  # this kernel writes bf16 parameters rounded to nearest only: the reference path rounds as asked
    if "step" not in state:
        state = optimizer._init_state(p, group, slots)
    for value in state.values():
        if isinstance(value, torch.Tensor) and (value.device != p.device or not value.is_contiguous()):
            return None
    return kernel, kernel.fmt
