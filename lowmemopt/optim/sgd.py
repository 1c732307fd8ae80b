"""SGD with momentum, dampening and Nesterov, matching ``torch.optim.SGD``.

    d = g + wd p;   b = d (first step), else b = mu b + (1 - dampening) d;   d = d + mu b (nesterov) or b
    p <- p - lr d

:class:`FusedSGD` is Apex's / ColossalAI's ``FusedSGD`` by name and signature: the same SGD, plus
``wd_after_momentum=True``, which adds ``wd p`` to the direction after the momentum instead of to the gradient before
it (Apex's ``multi_tensor_sgd``): ``b = mu b + (1 - dampening) g;  d = b (or g + mu b);  d = d + wd p``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch.optim.optimizer import required

from ..checks import check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..cpu.elementwise import NativeKernel
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot
from .adamw import GradNoneOnZero

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["SGD", "FusedSGD", "sgd_math"]


def native_scalars(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    """``lmo_sgd``'s scalars and flags from the math's keyword arguments, in the math's own expressions."""
    flags = (
        int(bool(kw["maximize"]))
        | int(bool(kw["nesterov"])) << 1
        | int(bool(kw["first_step"])) << 2
        | int(kw["momentum"] != 0) << 3
        | int(bool(kw.get("wd_after_momentum", False))) << 4
    )
    return (kw["weight_decay"], kw["momentum"], 1 - kw["dampening"], -kw["lr"], decay), flags


def native_slots(kw: dict[str, Any]) -> tuple[str, ...]:
    """``lmo_sgd``'s slots."""
    return ("momentum_buffer",) if kw["momentum"] != 0 else ()


#: SGD's fused kernels: Triton (``kernels/sgd.py``) and C (``lmo_sgd``, ``csrc/elementwise.c``)
KERNELS = KernelSet(
    "sgd", triton="sgd:TRITON", capturable=True, native=NativeKernel("lmo_sgd", native_scalars, native_slots)
)


@fused(KERNELS)
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
    wd_after_momentum: bool = False,
) -> tuple[torch.Tensor, float]:
    """fp32 SGD: updates ``state['momentum_buffer']`` (when momentum != 0); returns ``(d, -lr)``, delta = -lr d.
    ``wd_after_momentum``: the weight decay term joins ``d`` after the momentum (Apex's ``FusedSGD``)."""
    d = -g if maximize else g
    if weight_decay != 0 and not wd_after_momentum:
        d = d.add(p, alpha=weight_decay)
    if momentum != 0:
        buf = state["momentum_buffer"]
        if first_step:
            buf.copy_(d)
        else:
            buf.mul_(momentum).add_(d, alpha=1 - dampening)
        d = d.add(buf, alpha=momentum) if nesterov else buf
    if weight_decay != 0 and wd_after_momentum:
        d = d.add(p, alpha=weight_decay)
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
    """SGD with 32/16/8/4-bit momentum; same signature and 32-bit results as ``torch.optim.SGD``."""

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
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_nonneg("momentum value", group["momentum"])
        check_nonneg("dampening value", group["dampening"])
        check_nonneg("weight_decay value", group["weight_decay"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")


class FusedSGDAlgorithm(SGDAlgorithm):
    """SGD with Apex's ``wd_after_momentum`` flag (a param group key)."""

    hyper = SGDAlgorithm.hyper + ("wd_after_momentum",)


class FusedSGD(GradNoneOnZero, SGD):
    """Apex's ``FusedSGD`` (``apex.optimizers``; ColossalAI's has the same first seven parameters) by name, signature
    and defaults: :class:`SGD` plus

    * ``wd_after_momentum`` (False): True adds ``wd * p`` to the direction after the momentum (see the module
      docstring) instead of to the gradient. The native CPU kernel and the Triton kernels take it as a flag.
    * ``materialize_master_grads`` (True): Apex's switch for its amp O2 master weights, which have no counterpart here
      (there is one copy of each parameter and its gradient); accepted and ignored.
    * ``set_grad_none`` (False, Apex's default): ``zero_grad()`` zeroes gradients in place; True sets them to None.
      An explicit ``zero_grad(set_to_none=...)`` decides.

    ``lr`` is required, as in Apex (its default is torch's ``required`` marker). Keyword-only: ``maximize`` and the
    storage options (``state_bits``, ``paged``, GaLore groups, ...)."""

    algorithm = FusedSGDAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = required,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        wd_after_momentum: bool = False,
        materialize_master_grads: bool = True,
        set_grad_none: bool = False,
        *,
        maximize: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        if lr is required:
            raise TypeError("FusedSGD: lr is required (as in Apex)")
        for name, value in (
            ("wd_after_momentum", wd_after_momentum),
            ("set_grad_none", set_grad_none),
            ("materialize_master_grads", materialize_master_grads),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"Invalid {name}: expected a bool, got {type(value).__name__}")
        self.set_grad_none = set_grad_none
        defaults = dict(
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            wd_after_momentum=wd_after_momentum,
        )
        LowMemOptimizer.__init__(self, params, defaults, **storage)

    def _check_group(self, group):
        if not isinstance(group["wd_after_momentum"], bool):
            raise TypeError(
                f"Invalid wd_after_momentum: expected a bool, got {type(group['wd_after_momentum']).__name__}"
            )
        super()._check_group(group)
