"""AdamW as transformers' legacy ``transformers.AdamW`` (and galore-torch's ``GaLoreAdamW``) defined it; how it
differs from ``torch.optim.AdamW``: docs/torch_optim.md#hfadamw-transformers-legacy-adamw.

    m = beta1 m + (1 - beta1) g;    v = beta2 v + (1 - beta2) g^2
    p <- p - lr sqrt(1 - beta2^t) / (1 - beta1^t) * m / (sqrt(v) + eps);   p <- p - lr wd p
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_adam_group
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["HFAdamW", "hf_adamw_math"]


def hf_adamw_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    betas: tuple[float, float],
    eps: float,
    step_size: float,
) -> tuple[torch.Tensor, float]:
    """fp32 AdamW (transformers semantics, galore-torch's operation order): updates the moments in place and
    returns ``(m / (sqrt(v) + eps), -step_size)``; the caller adds it, then applies the decay."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    m.mul_(beta1).add_(g, alpha=1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    denom = v.sqrt().add_(eps)
    return m / denom, -step_size


class HFAdamWAlgorithm(Algorithm):
    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}

    def update(self, p, g, state, group, step):
        beta1, beta2 = group["betas"]
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        return hf_adamw_math(p, g, state, betas=group["betas"], eps=group["eps"], step_size=step_size)

    def apply_update(self, p32, delta, alpha, decay, group):
        p32.add_(delta, alpha=alpha)
        if group["weight_decay"] > 0.0:
            p32.add_(p32, alpha=-group["lr"] * group["weight_decay"])


class HFAdamW(LowMemOptimizer):
    """AdamW with transformers' legacy semantics and 32/16/8/4-bit state; the signature, defaults and 32-bit results
    of galore-torch's ``GaLoreAdamW``.

    Args:
        correct_bias: the step size's ``sqrt(1 - beta2^t) / (1 - beta1^t)``. no_deprecation_warning: accepted, ignored.
        state_bits, ...: the storage options."""

    algorithm = HFAdamWAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        no_deprecation_warning: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, correct_bias=correct_bias)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_adam_group(group)
