"""LARS (You et al. 2017) with ColossalAI ``Lars`` semantics; the trust ratio is kept at every state format
(docs/migrating.md#lamb-and-lars).

    trust = clamp(eeta ||p|| / (||g|| + wd ||p|| + epsilon), 0, 50)    (1 if ||p|| or ||g|| is 0, or group lars=False)
    d = clamp(g + wd p, -10, 10);   b = d (first step), else b = momentum b + d   (when momentum != 0)
    p <- p - lr * trust * b
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..checks import check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["LARS", "lars_math"]


#: LARS's fused kernels: Triton (``kernels/lars.py``)
KERNELS = KernelSet("lars", triton="lars:TRITON", capturable=True)


@fused(KERNELS)
def lars_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    momentum: float,
    eeta: float,
    weight_decay: float,
    epsilon: float,
    lars: bool,
    first_step: bool,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 LARS on a whole tensor: updates ``momentum_buffer`` (momentum != 0) and returns the delta for ``p``
    (``reduce`` sums the norms over shards)."""
    scale: torch.Tensor | float = -lr
    d = g
    if lars:
        w_norm = reduce.norm(p)
        g_norm = reduce.norm(g)
        usable = (w_norm > 0) & (g_norm > 0)
        trust = torch.where(usable, eeta * w_norm / (g_norm + weight_decay * w_norm + epsilon), 1.0).clamp_(0.0, 50.0)
        scale = trust * -lr
        if weight_decay != 0:
            d = d.add(p, alpha=weight_decay)
    d = torch.clamp(d, -10.0, 10.0)
    if momentum != 0:
        buf = state["momentum_buffer"]
        if first_step:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d)
        d = buf
    return d.mul(scale)


class LARSAlgorithm(Algorithm):
    elementwise = False  # the trust ratio needs whole-tensor norms
    batched_reductions = True  # (its math communicates through reduce only)
    weight_stat_math = True  # reads p for ||p|| (and the coupled decay)
    math = staticmethod(lars_math)
    hyper = ("lr", "momentum", "eeta", "weight_decay", "epsilon", "lars")

    def step_scalars(self, group, step):
        return dict(first_step=step == 1)

    def coupled_weight_decay(self, group):
        return True

    def weight_statistic(self, group):
        return "norm" if group["lars"] else None

    def slots(self, group, param):
        return {"momentum_buffer": Slot(signed=True)} if group["momentum"] != 0 else {}


class LARS(LowMemOptimizer):
    """LARS with 32/16/8/4-bit momentum; the signature, defaults and 32-bit results of ColossalAI's ``Lars``.

    Args:
        eeta: the trust coefficient. epsilon: added to the trust ratio's denominator.
        state_bits, ...: the storage options. A param group with ``lars=False`` (biases, norms) has trust 1."""

    algorithm = LARSAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        momentum: float = 0.0,
        eeta: float = 1e-3,
        weight_decay: float = 0.0,
        epsilon: float = 0.0,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, eeta=eeta, weight_decay=weight_decay, epsilon=epsilon, lars=True)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_nonneg("momentum value", group["momentum"])
        check_nonneg("weight_decay value", group["weight_decay"])
        check_nonneg("epsilon value", group["epsilon"])
        if not 0 < group["eeta"] <= 1:
            raise ValueError(f"Invalid eeta value: {group['eeta']} (must be in (0, 1])")
