"""CAME (Luo et al. 2023), matching ``came_pytorch.CAME``; row and column statistics stay unquantized at
every ``state_bits`` (fp32; float64 for float64 parameters); the first moment and a 1-D parameter's full second
moment take it.

    V = b2 V + (1 - b2)(g^2 + eps1)   (factored over the last two dims: V ~ R C / mean(R));   u = g / sqrt(V)
    u /= max(1, RMS(u) / clip_threshold);   m = b1 m + (1 - b1) u
    factored: U = b3 U + (1 - b3)((u - m)^2 + eps2) (factored likewise);  p <- p - lr wd p - lr m / sqrt(U)
    1-D:      p <- p - lr wd p - lr m                                       (the confidence term needs factoring)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..checks import check_betas, check_eps_pair, check_lr, check_nonneg, check_positive
from ..optimizer import LowMemOptimizer
from ..cpu import factored as native
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot
from .adafactor import add_scaled_, approx_rsqrt, clipped_preconditioned, ema_factored_, factored_slots

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["CAME", "came_math"]


def came_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float | torch.Tensor,
    eps1: float,
    eps2: float,
    clip_threshold: float,
    beta1: float,
    beta2: float,
    beta3: float,
    weight_decay: float,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 CAME on a whole tensor in ``came_pytorch``'s operation order: updates the state in place, applies
    ``p -= lr wd p`` to the fp32 working copy, and returns ``u`` with ``p_new = p - u``. Factored iff ``state`` has
    ``exp_avg_sq_row``."""
    factored = "exp_avg_sq_row" in state
    u = clipped_preconditioned(g, state, eps1, beta2, clip_threshold, reduce)

    m = state["exp_avg"]
    m.mul_(beta1).add_(u, alpha=1 - beta1)
    if factored:
        res = u.sub_(m).square_().add_(eps2)  # instability (u - m)^2 + eps2
        res_row, res_col = state["exp_avg_res_row"], state["exp_avg_res_col"]
        ema_factored_(res_row, res_col, res, beta3, reduce)
        approx_rsqrt(res_row, res_col, u, reduce).mul_(m)
    else:
        u.copy_(m)
    if weight_decay != 0:
        add_scaled_(p, p, -weight_decay * lr)
    return u.mul_(lr)


#: CAME's fused kernels: Triton (``kernels/factored.py``) and C (``csrc/factored.c``, a step that can be its gradient's
#: non-finite check)
KERNELS = KernelSet("came", triton="factored:CAME", capturable=True, native=native.CAME)


class CAMEAlgorithm(Algorithm):
    elementwise = False  # row/column means and RMS clipping need the whole tensor
    batched_reductions = True  # (its math communicates through reduce only)
    weight_stat_math = True  # reads p only for its decay p -= lr wd p

    def math_decay(self, group, step, stat):
        wd = group["weight_decay"]
        return None if wd == 0 else -wd * group["lr"]

    def slots(self, group, param):
        slots = {"exp_avg": Slot(signed=True)}
        if param.dim() >= 2:
            slots.update(factored_slots(param.shape, "exp_avg_sq", "exp_avg_res"))
        else:
            slots["exp_avg_sq"] = Slot(signed=False)
        return slots

    @fused(KERNELS)
    def update(self, p, g, state, group, step, reduce=LOCAL):
        eps1, eps2 = group["eps"]
        beta1, beta2, beta3 = group["betas"]
        u = came_math(
            p,
            g,
            state,
            lr=group["lr"],
            eps1=eps1,
            eps2=eps2,
            clip_threshold=group["clip_threshold"],
            beta1=beta1,
            beta2=beta2,
            beta3=beta3,
            weight_decay=group["weight_decay"],
            reduce=reduce,
        )
        return u, -1.0


class CAME(LowMemOptimizer):
    """CAME with 32/16/8/4-bit state; the signature, defaults and 32-bit results of ``came_pytorch.CAME``.

    Args:
        lr: required (a missing one is a TypeError). eps: (eps1, eps2). betas: (b1, b2, b3).
        clip_threshold: the RMS clip of ``u``. weight_decay: ``p -= lr wd p`` before the update.
        state_bits, ...: the storage options."""

    algorithm = CAMEAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor | None = None,
        eps: tuple[float, float] = (1e-30, 1e-16),
        clip_threshold: float = 1.0,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        weight_decay: float = 0.0,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(lr=lr, eps=eps, clip_threshold=clip_threshold, betas=betas, weight_decay=weight_decay)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        if group["lr"] is None:
            raise TypeError("CAME: lr is required (came_pytorch.CAME has no default learning rate), e.g. lr=2e-4")
        check_lr(group["lr"])
        check_eps_pair(group["eps"])
        check_positive("clip_threshold", group["clip_threshold"])
        check_betas(group["betas"], n=3)
        check_nonneg("weight_decay value", group["weight_decay"])
