"""LAMB (You et al. 2020, "Large Batch Optimization for Deep Learning"), with ColossalAI ``Lamb`` semantics
(``colossalai.nn.optimizer.Lamb``, from cybertronai/pytorch-lamb):

    m = beta1 m + (1 - beta1) g;   v = beta2 v + (1 - beta2) g^2
    r = m / (sqrt(v) + eps) + wd p                                     (no debiasing unless bias_correction=True,
    trust = ||p|| / ||r||  (1 if either norm is 0, or if adam=True)      which scales lr by sqrt(1-beta2^t)/(1-beta1^t))
    p <- p - lr * trust * r

The trust ratio is computed from the fp32 (decoded, updated) moments and the fp32 parameter, so it is the same at every
state format: 8-bit LAMB is still LAMB. (bitsandbytes' LAMB instead caps the Adam update norm at ``max_unorm * ||p||``;
``lowmemopt.LAMB8bit`` is this LAMB with 8-bit state.) Norms stay on the device: no host synchronization.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..checks import check_adam_group, sqrt_of
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, fused
from ..quant.formats import Slot

__all__ = ["LAMB", "lamb_math"]


@fused("lamb")
def lamb_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    adam: bool,
    lr_scale: float,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 LAMB on a whole tensor: updates ``exp_avg`` / ``exp_avg_sq`` in place and returns the delta for ``p``.
    ``||p||`` and ``||r||`` are norms of the whole parameter (``reduce`` sums them over shards)."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    scaled_lr = lr * lr_scale
    r = m / v.sqrt().add_(eps)
    if weight_decay != 0:
        r.add_(p, alpha=weight_decay)
    if adam:
        return r.mul_(-scaled_lr)
    weight_norm = reduce.norm(p)
    r_norm = reduce.norm(r)
    usable = (weight_norm > 0) & (r_norm > 0)
    trust = torch.where(usable, weight_norm / torch.where(usable, r_norm, 1.0), 1.0)
    return r.mul_(trust * -scaled_lr)


class LAMBAlgorithm(Algorithm):
    """LAMB for the step pipeline: its slots, math, step scalars and decay rules."""

    elementwise = False  # the trust ratio needs whole-tensor norms
    weight_stat_math = True  # reads p for ||p|| (and the coupled decay)
    math = staticmethod(lamb_math)
    hyper = ("lr", "betas", "eps", "weight_decay", "adam")

    def step_scalars(self, group, step):
        """Debiasing folded into the learning rate (ColossalAI): sqrt(1 - beta2^t) / (1 - beta1^t), or 1."""
        if not group["bias_correction"]:
            return dict(lr_scale=1.0)
        beta1, beta2 = group["betas"]  # (step: an int, or a capturable step's fp64 tensor of steps on the device)
        return dict(lr_scale=sqrt_of(1 - beta2**step) / (1 - beta1**step))

    def coupled_weight_decay(self, group):
        return True

    def weight_statistic(self, group):
        return None if group["adam"] else "norm"

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}


class LAMB(LowMemOptimizer):
    """LAMB with 32/16/8-bit state; same signature, defaults and 32-bit results as ColossalAI's ``Lamb``."""

    algorithm = LAMBAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        adam: bool = False,
        bias_correction: bool = False,
        **storage: Any,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam=adam, bias_correction=bias_correction)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_adam_group(group)
