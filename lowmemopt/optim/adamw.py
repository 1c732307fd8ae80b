"""Adam and AdamW (Kingma & Ba 2015; Loshchilov & Hutter 2019), matching ``torch.optim.Adam`` / ``AdamW``, and the
same math under the names of Apex's / DeepSpeed's :class:`FusedAdam` and DeepSpeed's :class:`CPUAdam`, in torch's
operation order (how they differ from those classes: docs/migrating.md).

    m = beta1 m + (1 - beta1) g              v = beta2 v + (1 - beta2) g^2          (v_max = max(v_max, v) if amsgrad)
    p <- p (1 - lr wd) [AdamW]  -  lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    Adam adds ``wd * p`` to ``g`` instead (L2 penalty) unless ``decoupled_weight_decay=True``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_adam_group, sqrt_of
from ..optimizer import LowMemOptimizer
from ..cpu.elementwise import NativeKernel
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["Adam", "AdamW", "AdamAlgorithm", "CPUAdam", "FusedAdam", "GradNoneOnZero", "adam_math"]


def _native_scalars(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    """``lmo_adam``'s scalars and flags from the math's keyword arguments, in the math's own expressions."""
    beta1, beta2 = kw["betas"]
    l2 = kw["weight_decay"] if kw["weight_decay"] != 0 and not kw["decoupled_weight_decay"] else 0.0
    h = (
        l2,
        1 - beta1,
        beta2,
        1 - beta2,
        kw["bias_correction2_sqrt"],
        kw["eps"],
        -kw["lr"] / kw["bias_correction1"],
        decay,
    )
    return h, int(bool(kw["maximize"])) | int(bool(kw["amsgrad"])) << 1


#: Adam's fused kernels: Triton (``kernels/adamw.py``) and C (``lmo_adam``, ``csrc/elementwise.c``)
KERNELS = KernelSet(
    "adam",
    triton="adamw:TRITON",
    capturable=True,
    native=NativeKernel(
        "lmo_adam",
        _native_scalars,
        lambda kw: ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if kw["amsgrad"] else ()),
    ),
)


@fused(KERNELS)
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
    """fp32 Adam/AdamW in torch.optim's single-tensor operation order: updates the moments in place and returns the
    delta for ``p``; the caller applies ``p *= 1 - lr wd`` first."""
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
        if not group.get("bias_correction", True):  # (FusedAdam's flag: x / 1.0 is exact, so one math serves)
            return dict(bias_correction1=1.0, bias_correction2_sqrt=1.0)
        beta1, beta2 = group["betas"]  # (step: an int, or a capturable step's fp64 tensor of steps on the device)
        return dict(bias_correction1=1 - beta1**step, bias_correction2_sqrt=sqrt_of(1 - beta2**step))

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"] if group["decoupled_weight_decay"] else 1.0


class Adam(LowMemOptimizer):
    """Adam with 32/16/8/4-bit state; the signature and 32-bit results of ``torch.optim.Adam``.

    Args:
        amsgrad, maximize, decoupled_weight_decay: as torch's.
        state_bits, block_size, paged, ...: the storage options (keyword-only)."""

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
        **storage: Unpack[StorageOptions],
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
    """AdamW (decoupled weight decay) with 32/16/8/4-bit state; same signature, defaults (``weight_decay=1e-2``) and
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
        **storage: Unpack[StorageOptions],
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, decoupled_weight_decay=True, **storage
        )


class GradNoneOnZero:
    """Apex's ``set_grad_none``: what ``zero_grad()`` does without ``set_to_none`` (True: None; False: zeroed,
    as Apex's ``FusedSGD``)."""

    set_grad_none: bool = True

    def zero_grad(self, set_to_none: bool | None = None) -> None:
        super().zero_grad(self.set_grad_none if set_to_none is None else set_to_none)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["set_grad_none"] = self.set_grad_none
        return state


def _check_flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: expected a bool, got {type(value).__name__}")


class FusedAdam(GradNoneOnZero, Adam):
    """Apex's / DeepSpeed's / ColossalAI's ``FusedAdam`` by name, signature and defaults: AdamW
    (``adam_w_mode=True``) or Adam with L2 penalty, with optional bias correction; torch's results with torch's flags.

    Args:
        bias_correction: False: ``p <- p - lr m / (sqrt(v) + eps)``. amsgrad: supported (Apex raises).
        set_grad_none: ``zero_grad()`` sets gradients to None. adamw_mode: ColossalAI's spelling of ``adam_w_mode``.
        maximize, state_bits, ...: as :class:`AdamW`'s."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        adam_w_mode: bool = True,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        set_grad_none: bool = True,
        *,
        adamw_mode: bool | None = None,
        maximize: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        if adamw_mode is not None:
            _check_flag("adamw_mode", adamw_mode)
            if adam_w_mode is not True and adam_w_mode != adamw_mode:
                raise ValueError("FusedAdam: adam_w_mode and adamw_mode (ColossalAI's name) disagree; give one")
            adam_w_mode = adamw_mode
        _check_flag("adam_w_mode", adam_w_mode)
        _check_flag("set_grad_none", set_grad_none)
        self.set_grad_none = set_grad_none
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=adam_w_mode,
        )
        LowMemOptimizer.__init__(self, params, defaults, **storage)

    def _check_group(self, group):
        _check_flag("bias_correction", group["bias_correction"])
        super()._check_group(group)


class CPUAdamAlgorithm(AdamAlgorithm):
    """Adam with DeepSpeed's ``fp32_optimizer_states=False``: the moments stored in the parameter's dtype."""

    def slots(self, group, param):
        slots = super().slots(group, param)
        if group.get("fp32_optimizer_states", True):
            return slots
        return {name: slot._replace(dtype=param.dtype) for name, slot in slots.items()}


class CPUAdam(Adam):
    """DeepSpeed's ``DeepSpeedCPUAdam`` by name, signature and defaults: AdamW (``adamw_mode=True``) or Adam with L2
    penalty, with optional bias correction, on any device; agrees with DeepSpeed to fp32 rounding (docs/migrating.md).

    Args:
        fp32_optimizer_states: False: the moments in the parameter's dtype (excludes ``state_bits`` other than 32).
        amsgrad: supported (DeepSpeed raises). maximize, state_bits, ...: as :class:`AdamW`'s."""

    algorithm = CPUAdamAlgorithm()

    def __init__(
        self,
        model_params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        amsgrad: bool = False,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        *,
        maximize: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        _check_flag("adamw_mode", adamw_mode)
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            decoupled_weight_decay=adamw_mode,
            fp32_optimizer_states=fp32_optimizer_states,
        )
        LowMemOptimizer.__init__(self, model_params, defaults, **storage)

    def _check_group(self, group):
        for key in ("bias_correction", "fp32_optimizer_states"):
            _check_flag(key, group[key])
        if not group["fp32_optimizer_states"] and group["state_bits"] != 32:
            raise ValueError(
                f"Invalid state_bits: {group['state_bits']} with fp32_optimizer_states=False (the state "
                "is kept in the parameter's dtype; leave state_bits at 32)"
            )
        super()._check_group(group)
