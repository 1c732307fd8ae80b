"""What the pipeline knows of an algorithm (:class:`Algorithm`): its slots, its pure fp32 math
``delta = math(p, g, state, **hyper, **step_scalars)`` and the decay around it (``p <- p * decay + delta``), and the
fused kernels that reproduce exactly that composition, declared on the math with :func:`fused` (docs/architecture.md).
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..quant.formats import Slot
from ..work.kernel_set import KernelSet

__all__ = ["Algorithm", "KernelSet", "fused", "fused_name", "kernel_set"]


def fused(kernels: KernelSet | str) -> Callable[[Callable], Callable]:
    """Decorator: ``fn`` (an algorithm's ``math`` or ``update`` override) runs on the fused ``kernels``."""
    if isinstance(kernels, str):
        kernels = KernelSet(kernels)

    def mark(fn: Callable) -> Callable:
        fn.fused_algorithm = kernels
        return fn

    return mark


class Algorithm:
    """One algorithm as the stages see it (stateless): subclasses set :attr:`math`, :attr:`hyper`, :meth:`slots`, and
    their reference's step scalars and decay rules.
    """

    #: True: the update of element i depends only on element i of p, g and state (chunked execution is exact)
    elementwise: bool = True
    #: True: the math reads the parameter only for a coupled weight decay (``g + wd * p``), so a GaLore step can run
    #: it on a zeroed low-rank stand-in through the fused backends (:func:`lowmemopt.projection.update.param_free`)
    param_free_math: bool = False
    #: True: the math reads the parameter only through one statistic of it (:meth:`weight_statistic`), a decay it
    #: applies to it in place (:meth:`math_decay`) and a coupled weight decay, so a GaLore step can run it on a zeroed
    #: stand-in through the fused kernels, given the full weight's statistic (LAMB, LARS, Adafactor, CAME)
    weight_stat_math: bool = False
    #: True: the math communicates only through its ``reduce`` argument, so a bucket of sharded parameters may step
    #: together with their reductions batched (:class:`~.plan.ReductionStage`; LAMB, LARS, Adafactor, CAME, Adam-mini)
    batched_reductions: bool = False
    #: the pure fp32 function ``math(p, g, state, **hyper, **step_scalars)`` and the group keys it takes
    math: Callable[..., Any] | None = None
    hyper: tuple[str, ...] = ()

    def slots(self, group: dict[str, Any], param: torch.Tensor) -> dict[str, Slot]:
        """The state slots ``param`` needs, by name (``param``: the tensor the state is shaped for: a shard, a
        low-rank stand-in, a meta twin)."""
        raise NotImplementedError

    def update(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        state: dict[str, torch.Tensor],
        group: dict[str, Any],
        step: Any,
        reduce: Reduction = LOCAL,
    ) -> torch.Tensor | tuple[torch.Tensor, float]:
        """fp32 math: update ``state`` in place; return the delta, or ``(direction, alpha)``. ``p``: the fp32 working
        copy; ``reduce``: a sharded parameter's whole-tensor reductions.
        """
        if self.elementwise:
            return self.math(p, g, state, **self.math_kwargs(group, step))
        return self.math(p, g, state, **self.math_kwargs(group, step), reduce=reduce)

    def math_kwargs(self, group: dict[str, Any], step: Any) -> dict[str, Any]:
        """Keyword arguments of :attr:`math`: the group's :attr:`hyper` entries plus :meth:`step_scalars`."""
        kwargs = {k: group[k] for k in self.hyper}
        kwargs.update(self.step_scalars(group, step))
        return kwargs

    def step_scalars(self, group: dict[str, Any], step: Any) -> dict[str, Any]:
        """Scalars of the step count (bias corrections, first-step flags) for the kernels, from ``step`` (an int, or
        a capturable step's fp64 device tensor)."""
        return {}

    def step_work(
        self, work: list[tuple[torch.Tensor, dict[str, Any]]], grad_mult: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The step's ``(param, group)`` pairs, with per-step values of every gradient (FusedLAMB's global norm);
        default ``work``.
        """
        return work

    def decay_factor(self, group: dict[str, Any]) -> Any:
        """Decoupled weight decay: ``p`` is multiplied by this before the delta is added (1.0: none)."""
        return 1.0

    def coupled_weight_decay(self, group: dict[str, Any]) -> bool:
        """Does the math add ``wd * p`` to the gradient (L2)? A GaLore step decouples it on the full parameter."""
        return False

    def weight_statistic(self, group: dict[str, Any]) -> str | None:
        """The statistic of the parameter that the math reads (:attr:`weight_stat_math`): ``"norm"`` (``||p||``),
        ``"rms"`` (``||p|| / sqrt(numel)``) or None."""
        return None

    def math_decay(self, group: dict[str, Any], step: Any, stat: torch.Tensor | None) -> Any:
        """``c`` of the in-place decay ``p <- p + c p`` the math applies before its update (:attr:`weight_stat_math`),
        rounded as the math rounds it: a number, or one per parameter of the stacked ``stat``; None: none."""
        return None

    def apply_update(
        self, p32: torch.Tensor, delta: torch.Tensor, alpha: Any, decay: Any, group: dict[str, Any]
    ) -> None:
        """``p = p * decay + alpha * delta`` (decay first, as torch), ``alpha`` a number or a 0-dim tensor (one rounding
        either way: ``addcmul_`` rounds as ``add_(alpha=)``, no host read); an override has no fused kernels."""
        if decay != 1.0:
            p32.mul_(decay)
        if isinstance(alpha, torch.Tensor):
            p32.addcmul_(delta, alpha)
        else:
            p32.add_(delta, alpha=alpha)

    @property
    def fused(self) -> str | None:
        """:func:`fused_name` of this algorithm."""
        return fused_name(self)

    @property
    def kernels(self) -> KernelSet | None:
        """:func:`kernel_set` of this algorithm."""
        return kernel_set(self)


def kernel_set(algorithm: Algorithm) -> KernelSet | None:
    """The fused kernels ``algorithm`` runs (its :func:`fused` declaration), or None if it overrides update or apply."""
    cls = type(algorithm)
    if cls.apply_update is not Algorithm.apply_update:
        return None
    fn = cls.update
    if fn is Algorithm.update:
        fn = algorithm.math
    return getattr(fn, "fused_algorithm", None)


def fused_name(algorithm: Algorithm) -> str | None:
    """The name of the fused algorithm ``algorithm`` runs (:attr:`KernelSet.name` of :func:`kernel_set`), or None."""
    kernels = kernel_set(algorithm)
    return None if kernels is None else kernels.name
