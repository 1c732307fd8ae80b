"""CPU fast path: ``torch.compile`` of one whole chunk update, decode -> the algorithm's own fp32 math -> encode.

The eager step runs each of those as separate ATen ops over the chunk (about 40 passes for AdamW at 8 bits). Compiled,
inductor fuses them into a few vectorized loops over 256-element blocks, with no change to the math: the function
compiled here calls the optimizer's ``math`` (the same pure function the eager path and the tests use) and the same
:func:`~lowmemopt.quant.blockwise.encode_rows` / ``decode_rows`` codec. Inductor keeps IEEE division and square root
and does not contract multiply-adds, so results equal the eager path's.

When it applies: CPU parameters of elementwise algorithms with at least :data:`MIN_NUMEL` elements (smaller tensors
do not repay the compile). Hyper-parameters and step-dependent scalars (bias corrections, computed on the host: inside
the kernel ``beta ** step`` would be re-evaluated for every vector) become symbols after their first change, so LR
schedules do not keep recompiling;
the row count is dynamic, so one graph serves every tensor size. The first step of each (algorithm, formats) pair pays
a one-time compile (seconds). If compiling fails (no C++ compiler, say), lowmemopt warns once and stays eager.
Set ``LOWMEMOPT_COMPILE=0`` to turn it off.
"""

from __future__ import annotations

import os
import types
import warnings
from typing import Any, Callable

import torch

from .quant.blockwise import decode_rows, encode_rows

__all__ = ["ENABLED", "MIN_NUMEL", "applies", "step_rows"]

ENABLED = os.environ.get("LOWMEMOPT_COMPILE", "1") != "0"
MIN_NUMEL = 1 << 16


def applies(param: torch.Tensor) -> bool:
    return ENABLED and param.device.type == "cpu" and param.numel() >= MIN_NUMEL


# A slot as handed to the compiled function: (name, kind, signed, storage rows, absmax rows or None, book, table)
SlotRows = tuple[str, str, bool, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"]


def _rows_update(math: Callable, p: torch.Tensor, g: torch.Tensor, slots: tuple, kwargs: dict, decay: float) -> None:
    p32, g32 = p.float(), g.float()
    state = {}
    for name, kind, signed, rows, absmax, book, table in slots:
        if kind == "q8":
            state[name] = decode_rows(rows, absmax, book)
        else:
            state[name] = rows.float()  # fp32 storage: the rows themselves, updated in place
    out = math(p32, g32, state, **kwargs)
    delta, alpha = out if isinstance(out, tuple) else (out, 1.0)
    for name, kind, signed, rows, absmax, book, table in slots:
        if kind == "q8":
            codes, scale = encode_rows(state[name], book, table, signed)
            rows.copy_(codes)
            absmax.copy_(scale)
        elif kind == "bf16":
            rows.copy_(state[name])
    # no branches on decay / alpha: they change with the LR schedule and must stay symbolic (x * 1.0 is exact)
    p.copy_(p32 * decay + delta * alpha)


_kernels: dict[tuple, Callable] = {}
_warned = False


def _kernel(key: tuple) -> Callable:
    """A compiled copy of :func:`_rows_update` per (algorithm, slot formats): dynamo caches graphs per code object, so
    separate code objects keep one optimizer's graphs from evicting another's (its recompile limit is 8 per code)."""
    if key not in _kernels:
        code = _rows_update.__code__.replace(co_name=f"_rows_update_{len(_kernels)}")
        fn = types.FunctionType(code, _rows_update.__globals__, code.co_name)
        _kernels[key] = torch.compile(fn, fullgraph=True)
    return _kernels[key]


def step_rows(
    math: Callable, p: torch.Tensor, g: torch.Tensor, slots: tuple, kwargs: dict[str, Any], decay: float
) -> bool:
    """Run one compiled chunk update: ``math(p, g, state, **kwargs)`` on rows of blocks, state decoded and encoded
    around it, then ``p = p * decay + delta``. False if the compiled path is unavailable (the caller runs eagerly)."""
    global _warned, ENABLED
    key = (math, tuple((s[1], s[2]) for s in slots), p.dtype, g.dtype)
    for t in (p, g) + tuple(s[3] for s in slots) + tuple(s[4] for s in slots if s[4] is not None):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    try:
        _kernel(key)(math, p, g, slots, kwargs, float(decay))
    except Exception as exc:  # compile failures surface on the first call, before anything is written
        ENABLED = False
        if not _warned:
            _warned = True
            warnings.warn(f"lowmemopt: torch.compile fast path unavailable ({type(exc).__name__}: {exc}); using eager "
                          "steps", RuntimeWarning, stacklevel=3)
        return False
    return True
