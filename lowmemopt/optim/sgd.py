"""SGD with momentum, dampening and Nesterov, matching ``torch.optim.SGD``.

    d = g + wd p;   b = d (first step), else b = mu b + (1 - dampening) d;   d = d + mu b (nesterov) or b
    p <- p - lr d
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..checks import check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, fused
from ..quant.formats import Slot

__all__ = ["SGD", "sgd_math"]


@fused("sgd")
def sgd_math(
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
    """fp32 SGD: updates ``state['momentum_buffer']`` (when momentum != 0); returns ``(d, -lr)``, delta = -lr d."""
    d = -g if maximize else g
    if weight_decay != 0:
        d = d.add(p, alpha=weight_decay)
    if momentum != 0:
        buf = state["momentum_buffer"]
        if first_step:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    return d, -lr


class SGDAlgorithm(Algorithm):
    """SGD for the step pipeline: its slots, math, step scalars and decay rules."""

    param_free_math = True  # reads p only for the L2 / coupled weight decay
    math = staticmethod(sgd_math)
    hyper = ("lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize")

    def step_scalars(self, group, step):
        return dict(first_step=step == 1)

    def coupled_weight_decay(self, group):
        return True

    def slots(self, group, param):
        return {"momentum_buffer": Slot(signed=True)} if group["momentum"] != 0 else {}


class SGD(LowMemOptimizer):
    """SGD with 32/16/8-bit momentum; same signature and 32-bit results as ``torch.optim.SGD``."""

    algorithm = SGDAlgorithm()

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
        defaults = dict(
            lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_nonneg("momentum value", group["momentum"])
        check_nonneg("dampening value", group["dampening"])
        check_nonneg("weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
