"""SignSGD: the direction ``torch.optim.SGD`` computes (momentum, dampening, Nesterov, L2 weight decay), then its sign.

Reference: mlbench-core's ``SignSGD`` (``mlbench_core/optim/pytorch/optim.py``), a ``torch.optim.SGD`` subclass
whose step is, per parameter::

    d = g + wd p                                            (maximize: -g + wd p)
    b = d (first step), else b = mu b + (1 - dampening) d   (momentum != 0; the buffer is the state)
    d = d + mu b (nesterov) or b                            (momentum != 0)
    p <- p - lr sign(d)                                     (sign(0) = 0)

The direction is :func:`lowmemopt.optim.sgd.sgd_math`'s, op for op, so at 32-bit the result equals the reference bit
for bit (``p.add_(sign(d), alpha=-lr)``, as the reference writes it). The momentum buffer takes any ``state_bits``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..checks import check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, fused
from ..quant.formats import Slot
from .sgd import sgd_math

__all__ = ["SignSGD", "signsgd_math"]


@fused("signsgd")
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
    """fp32 SignSGD: SGD's direction ``d`` (updates ``state['momentum_buffer']`` when momentum != 0, as
    :func:`~lowmemopt.optim.sgd.sgd_math`); returns ``(sign(d), -lr)``, delta = -lr sign(d)."""
    d, neg_lr = sgd_math(p, g, state, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                         nesterov=nesterov, maximize=maximize, first_step=first_step)
    return torch.sign(d), neg_lr


class SignSGDAlgorithm(Algorithm):
    """SignSGD for the step pipeline: SGD's slots, step scalars and coupled decay; the sign in the math."""

    param_free_math = True  # reads p only for the L2 / coupled weight decay
    math = staticmethod(signsgd_math)
    hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def step_scalars(self, group, step):
        return dict(first_step=step == 1)

    def coupled_weight_decay(self, group):
        return True

    def slots(self, group, param):
        return {"momentum_buffer": Slot(signed=True)} if group["momentum"] != 0 else {}


class SignSGD(LowMemOptimizer):
    """Sign SGD with 32/16/8/4-bit momentum: ``p -= lr * sign(d)``, ``d`` torch SGD's direction. Same signature as
    ``torch.optim.SGD`` (which mlbench's ``SignSGD`` inherits); at 32-bit the same results as mlbench's step."""

    algorithm = SignSGDAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **storage: Any,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        maximize=maximize)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_nonneg("momentum value", group["momentum"])
        check_nonneg("dampening value", group["dampening"])
        check_nonneg("weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
