"""SignSGD: the direction ``torch.optim.SGD`` computes (:func:`lowmemopt.optim.sgd.sgd_math`'s, op for op), then its
sign, matching mlbench-core's ``SignSGD`` (a ``torch.optim.SGD`` subclass) bit for bit at 32 bits.

    d = g + wd p  (maximize: -g + wd p);   b = d (first step), else b = mu b + (1 - dampening) d   (momentum != 0)
    d = d + mu b (nesterov) or b  (momentum != 0);   p <- p - lr sign(d)   (sign(0) = 0)
"""

from __future__ import annotations

import torch

from typing import Any

from ..cpu.elementwise import NativeKernel
from ..pipeline.algorithm import KernelSet, fused
from .sgd import SGD, SGDAlgorithm, native_scalars, native_slots, sgd_math

__all__ = ["SignSGD", "signsgd_math"]


def _native_scalars(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    """SGD's scalars, with ``lmo_sgd``'s sign flag: ``p += -lr sign(d)``."""
    h, flags = native_scalars(kw, decay)
    return h, flags | 32


#: SignSGD's fused kernels: SGD's Triton kernel with its sign flag, ``lmo_sgd`` with its sign flag
KERNELS = KernelSet(
    "signsgd",
    triton="sgd:TRITON",
    triton_options=(("sign", True),),
    capturable=True,
    native=NativeKernel("lmo_sgd", _native_scalars, native_slots),
)


@fused(KERNELS)
def signsgd_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    maximize: bool,
    first_step: bool,
) -> tuple[torch.Tensor, float]:
    """fp32 SignSGD: SGD's direction ``d`` (updating ``momentum_buffer``); returns ``(sign(d), -lr)``."""
    d, neg_lr = sgd_math(
        p,
        g,
        state,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=nesterov,
        maximize=maximize,
        first_step=first_step,
    )
    return torch.sign(d), neg_lr


class SignSGDAlgorithm(SGDAlgorithm):
    """SignSGD for the step pipeline: SGD's slots, step scalars and coupled decay; the sign in the math."""

    math = staticmethod(signsgd_math)


class SignSGD(SGD):
    """SignSGD with 32/16/8/4-bit momentum: ``p -= lr sign(d)``, ``d`` torch SGD's direction; ``torch.optim.SGD``'s
    signature and checks (see :class:`~lowmemopt.optim.sgd.SGD`), mlbench's results at 32 bits."""

    algorithm = SignSGDAlgorithm()
