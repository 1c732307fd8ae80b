"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), matching ``torch.optim.Adam`` / ``torch.optim.AdamW``.

    m = beta1 m + (1 - beta1) g              v = beta2 v + (1 - beta2) g^2          (v_max = max(v_max, v) if amsgrad)
    p <- p (1 - lr wd) [AdamW]  -  lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    Adam adds ``wd * p`` to ``g`` instead (L2 penalty) unless ``decoupled_weight_decay=True``.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..checks import check_adam_group, sqrt_of
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, fused
from ..quant.formats import Slot

__all__ = ["Adam", "AdamW", "AdamAlgorithm", "adam_math"]


@fused("adam")
def adam_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    amsgrad: bool,
    maximize: bool,
    bias_correction1: float,
    bias_correction2_sqrt: float,
) -> torch.Tensor:
    """fp32 Adam/AdamW: updates ``state['exp_avg']``, ``state['exp_avg_sq']`` (and ``max_exp_avg_sq``) in place and
    returns the delta for ``p``; decoupled decay (``p *= 1 - lr wd``) is applied by the caller before adding it.
    Operation order follows torch.optim's single-tensor implementation, so 32-bit results are bit-identical."""
    beta1, beta2 = betas
    if maximize:
        g = -g
    if weight_decay != 0 and not decoupled_weight_decay:
        g = g.add(p, alpha=weight_decay)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if amsgrad:
        v_max = state["max_exp_avg_sq"]
        v_max.copy_(torch.maximum(v_max, v))
        v = v_max
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    return torch.mul(m, -lr / bias_correction1).div_(denom)


class AdamAlgorithm(Algorithm):
    """Adam / AdamW for the step pipeline: :func:`adam_math`, its bias corrections and the decoupled decay."""

    param_free_math = True  # reads p only for the L2 / coupled weight decay
    math = staticmethod(adam_math)
    hyper = ("lr", "betas", "eps", "weight_decay", "decoupled_weight_decay", "amsgrad", "maximize")

    def coupled_weight_decay(self, group):
        return not group.get("decoupled_weight_decay", True)

    def slots(self, group, param):
        slots = {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}
        if group["amsgrad"]:
            slots["max_exp_avg_sq"] = Slot(signed=False)
        return slots

    def step_scalars(self, group, step):
        beta1, beta2 = group["betas"]  # (step: an int, or a capturable step's fp64 tensor of steps on the device)
        return dict(bias_correction1=1 - beta1**step, bias_correction2_sqrt=sqrt_of(1 - beta2**step))

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"] if group["decoupled_weight_decay"] else 1.0


class Adam(LowMemOptimizer):
    """Adam with 32/16/8-bit state; same signature and 32-bit results as ``torch.optim.Adam``.

    Storage keywords: ``state_bits``, ``block_size``, ``min_quant_numel`` (see :class:`~lowmemopt.LowMemOptimizer`).
    At 8 bits ``exp_avg`` uses the signed ``pow2`` map and ``exp_avg_sq`` / ``max_exp_avg_sq`` the unsigned one.
    """

    algorithm = AdamAlgorithm()
    _decoupled_default = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        **storage: Any,
    ) -> None:
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self._decoupled_default
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_adam_group(group)


class AdamW(Adam):
    """AdamW (decoupled weight decay) with 32/16/8-bit state; same signature, defaults (``weight_decay=1e-2``) and
    32-bit results as ``torch.optim.AdamW``."""

    _decoupled_default = True

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        **storage: Any,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, decoupled_weight_decay=True, **storage)
