"""1-bit LAMB (Li et al. 2021, arXiv 2104.06069) with DeepSpeed's ``OnebitLamb`` (v0.16.5) arguments and defaults,
on ``torch.distributed``: LAMB on the averaged gradients for ``freeze_step`` steps (tracking each trust ratio), then
the scaled momentum through the compressed all-reduce, a fresh variance and a frozen trust ratio times a clamped
factor. The per-step math and where it follows the paper: docs/onebit.md ("1-bit LAMB"). The per-parameter numbers
are 0-dim fp32 state tensors on the device: no host synchronisation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_positive
from ..distributed.reduction import LOCAL, Reduction
from ..quant.formats import Slot, format_of
from .onebit import OnebitAdamAlgorithm, OnebitOptimizer, check_step_count, check_unsupported

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["OnebitLAMB", "OnebitLamb", "OnebitLAMBAlgorithm", "onebit_lamb_math"]


def onebit_lamb_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    max_coeff: float,
    min_coeff: float,
    coeff_beta: float,
    factor_max: float,
    factor_min: float,
    factor_threshold: float,
    compressed: bool,
    snapshot: bool,
    bias_correction1: float,
    bias_correction2_sqrt: float,
    fresh_correction_sqrt: float,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 1-bit LAMB on a whole tensor: ``g`` is the averaged gradient (warm-up) or the compressed mean of the
    scaled momentum. Updates the state in place and returns the delta for ``p``."""
    beta1, beta2 = betas
    m, v, fresh = state["exp_avg"], state["exp_avg_sq"], state["exp_avg_sq_fresh"]
    frozen, last = state["lamb_coeff_freeze"], state["last_factor"]
    if not compressed:
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if snapshot:
            fresh.copy_(v)
        update = torch.div(m, v.sqrt().div_(bias_correction2_sqrt).add_(eps))
        update.div_(bias_correction1)  # (exact when 1; a runtime scalar of the compiled step)
        if weight_decay != 0:
            update.add_(p, alpha=weight_decay)
        weight_norm, update_norm = reduce.norm(p), reduce.norm(update)
        usable = (weight_norm > 0) & (update_norm > 0)
        coeff = torch.where(
            usable, (weight_norm / torch.where(usable, update_norm, 1.0)).clamp(min_coeff, max_coeff), 1.0
        )
        frozen.copy_(torch.where(coeff != 1.0, frozen * coeff_beta + coeff * (1 - coeff_beta), frozen))
        return update.mul_(coeff * -lr)
    scaling = state["scaling_coeff"]
    new_m = g / scaling
    rebuilt = new_m.sub(m, alpha=beta1).div_(1 - beta1)
    m.copy_(new_m)
    fresh.mul_(beta2).addcmul_(rebuilt, rebuilt, value=1 - beta2)
    denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    prelim = torch.div(m, denom)
    prelim.div_(bias_correction1)  # (exact when 1; a runtime scalar of the compiled step)
    update = prelim.add(p, alpha=weight_decay) if weight_decay != 0 else prelim.clone()
    real = fresh.sqrt().div_(fresh_correction_sqrt).add_(eps)
    factor = denom.div_(real).max()  # (whole tensors: the optimizer refuses sharded parameters)
    if weight_decay != 0:
        update_norm = reduce.norm(update)
        ratio = torch.where(update_norm > 0, reduce.norm(prelim) / torch.where(update_norm > 0, update_norm, 1.0), 1.0)
        ratio = ratio.clamp(max=1.0)
        factor = factor * ratio + (1.0 - ratio)
    previous = torch.where(last == 0, 1.0, last)  # (0: not set yet, DeepSpeed's 1.0)
    factor = factor.clamp(factor_min, factor_max)
    factor = torch.minimum(factor, previous * (1.0 + factor_threshold))
    factor = torch.maximum(factor, previous * (1.0 - factor_threshold))
    last.copy_(factor)
    return update.mul_(frozen * factor * -lr)


class OnebitLAMBAlgorithm(OnebitAdamAlgorithm):
    """1-bit LAMB for the step pipeline: 1-bit Adam's phases, the scaled momentum as the message."""

    elementwise = False
    math = staticmethod(onebit_lamb_math)
    hyper = (
        "lr",
        "betas",
        "eps",
        "weight_decay",
        "max_coeff",
        "min_coeff",
        "coeff_beta",
        "factor_max",
        "factor_min",
        "factor_threshold",
    )

    def slots(self, group, param):
        scalar = Slot(signed=True, quantize=False, shape=())
        return {
            "exp_avg": Slot(signed=True),
            "exp_avg_sq": Slot(signed=False),
            "exp_avg_sq_fresh": Slot(signed=False),
            "lamb_coeff_freeze": scalar,
            "last_factor": scalar,
            "scaling_coeff": scalar,
        }

    def step_scalars(self, group, step):
        compressed = self.phase(group, step) == "compressed"
        out = dict(compressed=compressed, snapshot=step == group["freeze_step"])
        if not group["bias_correction"]:
            return dict(out, bias_correction1=1.0, bias_correction2_sqrt=1.0, fresh_correction_sqrt=1.0)
        beta1, beta2 = group["betas"]
        return dict(
            out,
            bias_correction1=1 - beta1**step,
            bias_correction2_sqrt=math.sqrt(
                1 - beta2 ** (step if group.get("non_freeze") else min(step, group["freeze_step"]))
            ),
            fresh_correction_sqrt=math.sqrt(1 - beta2**step),
        )

    def decay_factor(self, group):
        return 1.0

    def message(self, p, g, state, group):
        """The local momentum times the parameter's scaling coefficient."""
        return super().message(p, g, state, group).mul_(state["scaling_coeff"])

    def comm_begin(self, stage, plan, index, group, phase):
        """At the first compressed step: scale each momentum towards the mean RMS of all (the paper's coefficients)."""
        if phase != "compressed" or stage.counters.get("scaled", False):
            return
        entries = []
        for g in plan.groups:
            for p in g["params"]:
                st = plan.state.get(p)
                if st and "scaling_coeff" in st:
                    m = format_of(st, "exp_avg").decode(st, "exp_avg", 0, p.numel(), True, g["block_size"])
                    entries.append((st, torch.linalg.vector_norm(m) / math.sqrt(max(p.numel(), 1))))
        if entries:
            united = torch.stack([rms for _, rms in entries]).mean()
            for st, rms in entries:
                st["scaling_coeff"].copy_(torch.where(rms > 0, united / torch.where(rms > 0, rms, 1.0), 1.0))
        stage.counters["scaled"] = True


class OnebitLAMB(OnebitOptimizer):
    """1-bit LAMB with 32/16/8/4-bit m and v; DeepSpeed's ``OnebitLamb`` signature and defaults (docs/onebit.md).

    Args:
        freeze_step: the warm-up's length. max_coeff, min_coeff: the trust ratio's clamp; coeff_beta: its average.
        factor_max, factor_min, factor_threshold: the compressed steps' factor's clamp, and its change per step.
        eps_inside_sqrt: True raises. process_group: the ranks (default: the world).
        state_bits, ...: the storage options.

    The same requirements as :class:`~lowmemopt.optim.onebit.OnebitAdam`."""

    algorithm = OnebitLAMBAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        freeze_step: int = 100000,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        max_coeff: float = 10.0,
        min_coeff: float = 0.01,
        amsgrad: bool = False,
        coeff_beta: float = 0.9,
        factor_max: float = 4.0,
        factor_min: float = 0.5,
        factor_threshold: float = 0.1,
        *,
        process_group: Any = None,
        **storage: Unpack[StorageOptions],
    ) -> None:
        check_unsupported(type(self).__name__, amsgrad, max_grad_norm)
        if eps_inside_sqrt:
            raise ValueError("OnebitLAMB does not support eps_inside_sqrt=True (DeepSpeed accepted and ignored it)")
        defaults = dict(
            lr=lr,
            freeze_step=freeze_step,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            max_coeff=max_coeff,
            min_coeff=min_coeff,
            coeff_beta=coeff_beta,
            factor_max=factor_max,
            factor_min=factor_min,
            factor_threshold=factor_threshold,
        )
        super().__init__(params, defaults, process_group, **storage)

    def _check_group(self, group):
        super()._check_group(group)
        check_step_count("freeze_step", group["freeze_step"])
        for name in ("max_coeff", "min_coeff", "factor_max", "factor_min"):
            check_positive(name, group[name])
        if group["min_coeff"] > group["max_coeff"] or group["factor_min"] > group["factor_max"]:
            raise ValueError("OnebitLAMB: min_coeff must be <= max_coeff and factor_min <= factor_max")
        if not 0.0 <= group["coeff_beta"] < 1.0:
            raise ValueError(f"Invalid coeff_beta: {group['coeff_beta']} (must be in [0, 1))")
        if not 0.0 <= group["factor_threshold"] < 1.0:
            raise ValueError(f"Invalid factor_threshold: {group['factor_threshold']} (must be in [0, 1))")


#: DeepSpeed's spelling
OnebitLamb = OnebitLAMB
