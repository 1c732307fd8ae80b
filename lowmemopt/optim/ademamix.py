"""AdEMAMix (Pagliardini et al. 2024) matching ``bitsandbytes.optim.AdEMAMix`` (32-bit results bit for bit): Adam with
a second, slow momentum mixed into the numerator. The warm-ups and the state: docs/ademamix.md.

    m1 = beta1 m1 + (1 - beta1) g;   m2 = beta3_t m2 + (1 - beta3_t) g;   nu = beta2 nu + (1 - beta2) g^2
    p <- p (1 - lr wd)  -  lr (m1 / (1 - beta1^t) + alpha_t m2) / (sqrt(nu) / sqrt(1 - beta2^t) + eps)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_betas, check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["AdEMAMix", "AdEMAMixAlgorithm", "ademamix_math", "alpha_schedule", "beta3_schedule"]


def alpha_schedule(step: int, alpha: float, t_alpha: int | None) -> float:
    """``alpha_t``: ``alpha`` ramped linearly over ``t_alpha`` steps (bitsandbytes' scheduler; None / 0: none)."""
    return min(step * alpha / t_alpha, alpha) if t_alpha else alpha


def beta3_schedule(step: int, beta1: float, beta3: float, t_beta3: int | None) -> float:
    """``beta3_t``: from ``beta1`` at step 0 to ``beta3`` at ``t_beta3``, the half-life growing linearly (None / 0:
    ``beta3``)."""
    if not t_beta3:
        return beta3
    ln_beta1, ln_beta3 = math.log(beta1), math.log(beta3)
    s = step / t_beta3
    return min(math.exp((ln_beta1 * ln_beta3) / ((1 - s) * ln_beta3 + s * ln_beta1)), beta3)


#: AdEMAMix's fused kernels: Triton (``kernels/ademamix.py``)
KERNELS = KernelSet("ademamix", triton="ademamix:TRITON")


@fused(KERNELS)
def ademamix_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float, float],
    eps: float,
    alpha_t: float,
    beta3_t: float,
    bias_correction1: float,
    bias_correction2_sqrt: float,
) -> tuple[torch.Tensor, float]:
    """fp32 AdEMAMix in bitsandbytes' operation order: updates the three slots in place and returns
    ``(direction, -lr)``; the caller applies ``p *= 1 - lr wd`` first."""
    beta1, beta2 = betas[0], betas[1]
    m1, m2, nu = state["exp_avg"], state["exp_avg_slow"], state["exp_avg_sq"]
    m1.mul_(beta1).add_(g, alpha=1 - beta1)
    m2.mul_(beta3_t).add_(g, alpha=1 - beta3_t)
    nu.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    mixed = torch.div(m1, bias_correction1).add_(torch.mul(m2, alpha_t))
    denom = nu.sqrt().div_(bias_correction2_sqrt).add_(eps)
    return mixed.div_(denom), -lr


class AdEMAMixAlgorithm(Algorithm):
    """AdEMAMix for the step pipeline: :func:`ademamix_math`, its schedules, bias corrections and decoupled decay."""

    param_free_math = True  # never reads p (the decay is decoupled)
    math = staticmethod(ademamix_math)
    hyper = ("lr", "betas", "eps")

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_slow": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}

    def step_scalars(self, group, step):
        beta1, beta2, beta3 = group["betas"]
        return dict(
            alpha_t=alpha_schedule(step, group["alpha"], group["t_alpha"]),
            beta3_t=beta3_schedule(step, beta1, beta3, group["t_beta3"]),
            bias_correction1=1 - beta1**step,
            bias_correction2_sqrt=math.sqrt(1 - beta2**step),
        )

    def decay_factor(self, group):
        wd = group["weight_decay"]
        return 1 - group["lr"] * wd if wd > 0 else 1.0  # (bitsandbytes decays only for wd > 0)


def _check_warmup(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Invalid {name}: expected an int number of steps or None, got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"Invalid {name}: {value} (must be >= 0 steps; None or 0: no warm-up)")


class AdEMAMix(LowMemOptimizer):
    """AdEMAMix with 32/16/8/4-bit state; the signature, defaults and 32-bit results of ``bitsandbytes.optim.AdEMAMix``.

    Args:
        betas: (fast EMA, second moment, slow EMA). alpha: the slow EMA's weight.
        t_alpha, t_beta3: the warm-ups of ``alpha`` and ``beta3``, in steps (None: none).
        optim_bits, min_8bit_size, is_paged: bitsandbytes' names of ``state_bits``, ``min_quant_numel``, ``paged``.
        state_bits, ...: the storage options."""

    algorithm = AdEMAMixAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        optim_bits: int = 32,
        min_8bit_size: int = 4096,
        is_paged: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        for theirs, ours, value, default in (
            ("optim_bits", "state_bits", optim_bits, 32),
            ("min_8bit_size", "min_quant_numel", min_8bit_size, 4096),
            ("is_paged", "paged", is_paged, False),
        ):
            if value is default or value == default and type(value) is type(default):
                continue  # (not given: the storage keyword, or its default, decides)
            if ours in storage and storage[ours] != value:
                raise ValueError(
                    f"AdEMAMix: {theirs}={value!r} and {ours}={storage[ours]!r} disagree "
                    f"({theirs} is bitsandbytes' name for {ours}); give one"
                )
            storage[ours] = value
        defaults = dict(
            lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps, weight_decay=weight_decay
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_nonneg("epsilon value", group["eps"])
        check_betas(group["betas"], 3)
        check_nonneg("weight_decay value", group["weight_decay"])
        check_nonneg("alpha", group["alpha"])
        _check_warmup("t_alpha", group["t_alpha"])
        _check_warmup("t_beta3", group["t_beta3"])
        beta1, _, beta3 = group["betas"]
        if group["t_beta3"] and not (beta1 > 0 and beta3 > 0):
            raise ValueError(
                f"Invalid betas {tuple(group['betas'])} for t_beta3={group['t_beta3']}: the beta3 "
                "warm-up interpolates log(beta1) and log(beta3), so both must be > 0"
            )
