"""Lion (Chen et al. 2023), matching ``lion_pytorch.Lion``.

p <- p (1 - lr wd)  -  lr sign(beta1 m + (1 - beta1) g);      m = beta2 m + (1 - beta2) g
With ``decoupled_weight_decay=True`` the decay is ``wd / initial lr`` (lion-pytorch's convention).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_betas, check_lr, check_nonneg
from ..optimizer import LowMemOptimizer
from ..cpu.elementwise import NativeKernel
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["Lion", "lion_math"]


def _native_scalars(kw: dict[str, Any], decay: float) -> tuple[tuple[float, ...], int]:
    """``lmo_lion``'s scalars from the math's keyword arguments, in the math's own expressions."""
    beta1, beta2 = kw["betas"]
    return (beta1, 1 - beta1, beta2, 1 - beta2, -kw["lr"], decay), 0


#: Lion's fused kernels: Triton (``kernels/lion.py``) and C (``lmo_lion``, ``csrc/elementwise.c``)
KERNELS = KernelSet(
    "lion",
    triton="lion:TRITON",
    capturable=True,
    native=NativeKernel("lmo_lion", _native_scalars, lambda kw: ("exp_avg",)),
)


@fused(KERNELS)
def lion_math(
    p: torch.Tensor, g: torch.Tensor, state: dict[str, torch.Tensor], *, lr: float, betas: tuple[float, float]
) -> torch.Tensor:
    """fp32 Lion: updates ``exp_avg`` in place and returns the delta (the caller applies ``p *= 1 - lr wd`` first)."""
    beta1, beta2 = betas
    m = state["exp_avg"]
    delta = torch.mul(m, beta1).add_(g, alpha=1 - beta1).sign_().mul_(-lr)
    m.mul_(beta2).add_(g, alpha=1 - beta2)
    return delta


class LionAlgorithm(Algorithm):
    param_free_math = True  # decay is decoupled (``_decay_factor``)
    math = staticmethod(lion_math)
    hyper = ("lr", "betas")

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True)}

    def decay_factor(self, group):
        wd = group["weight_decay"]
        if group["decoupled_weight_decay"]:
            wd = wd / group["initial_lr"]
        return 1.0 - group["lr"] * wd


class Lion(LowMemOptimizer):
    """Lion with 32/16/8/4-bit momentum; the signature, defaults and 32-bit results of ``lion_pytorch.Lion``.

    Args:
        betas: (the update's interpolation, the momentum's decay). decoupled_weight_decay: decay by ``wd / initial lr``.
        use_triton: accepted, as torch's ``fused``: the fused kernels run wherever the device has them.
        state_bits, ...: the storage options."""

    algorithm = LionAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        use_triton: bool = False,
        decoupled_weight_decay: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        if not isinstance(use_triton, bool):
            raise TypeError(f"Invalid use_triton: expected a bool, got {type(use_triton).__name__}")
        initial_lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr  # (not a scheduler's later lr)
        defaults = dict(
            lr=lr,
            betas=betas,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            initial_lr=initial_lr,
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        check_betas(group["betas"])
        check_nonneg("weight_decay value", group["weight_decay"])
        if group["decoupled_weight_decay"] and not group["initial_lr"] > 0:
            raise ValueError("decoupled_weight_decay needs a positive initial learning rate")
