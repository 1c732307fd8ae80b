"""LAMB (You et al. 2020) with ColossalAI ``Lamb`` semantics, and Apex's :class:`FusedLAMB`; the math is
:func:`lamb_math`, the kernels ``kernels/lamb.py``. Why the trust ratio is computed at every state format, and the
FusedLAMB clip: docs/migrating.md#lamb-and-lars.

    m = beta1 m + (1 - beta1) g;  v = beta2 v + (1 - beta2) g^2;  r = m / (sqrt(v) + eps) + wd p
    p <- p - lr * trust * r,  trust = ||p|| / ||r||  (1 if either norm is 0, or if adam=True)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..checks import check_adam_group, sqrt_of
from ..distributed.sharding import is_dtensor
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..pipeline.plan import unscaled
from ..quant.formats import Slot
from .adamw import GradNoneOnZero

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["LAMB", "FusedLAMB", "lamb_math", "GRAD_DIVISOR"]

#: the key under which a step's view of a FusedLAMB param group carries the clip divisor ``c`` (a device scalar)
GRAD_DIVISOR = "grad_divisor"


#: LAMB's fused kernels: Triton (``kernels/lamb.py``)
KERNELS = KernelSet("lamb", triton="lamb:TRITON", capturable=True)


@fused(KERNELS)
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
    grad_averaging: bool = True,
    adam_w_mode: bool = True,
    bias_correction1: Any = 1.0,
    bias_correction2: Any = 1.0,
    grad_divisor: Any = 1.0,
) -> torch.Tensor:
    """fp32 LAMB on a whole tensor: updates ``exp_avg`` / ``exp_avg_sq`` in place and returns the delta for ``p``
    (``reduce`` sums the norms over shards). The other keywords are FusedLAMB's flags; their defaults are LAMB's."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if isinstance(grad_divisor, torch.Tensor) or grad_divisor != 1.0:
        g = g / grad_divisor
    if weight_decay != 0 and not adam_w_mode:
        g = g.add(p, alpha=weight_decay)
    m.mul_(beta1).add_(g, alpha=1 - beta1 if grad_averaging else 1.0)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    scaled_lr = lr * lr_scale
    if isinstance(bias_correction1, torch.Tensor) or bias_correction1 != 1.0 or bias_correction2 != 1.0:
        r = (m / bias_correction1) / (v / bias_correction2).sqrt_().add_(eps)
    else:
        r = m / v.sqrt().add_(eps)
    if weight_decay != 0 and adam_w_mode:
        r.add_(p, alpha=weight_decay)
    if adam:
        return r.mul_(-scaled_lr)
    weight_norm = reduce.norm(p)
    r_norm = reduce.norm(r)
    usable = (weight_norm > 0) & (r_norm > 0)
    trust = torch.where(usable, weight_norm / torch.where(usable, r_norm, 1.0), 1.0)
    return r.mul_(trust * -scaled_lr)


class LAMBAlgorithm(Algorithm):
    elementwise = False  # the trust ratio needs whole-tensor norms
    batched_reductions = True  # (its math communicates through reduce only)
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
    """LAMB with 32/16/8/4-bit state; same signature, defaults and 32-bit results as ColossalAI's ``Lamb``.

    Args:
        adam: no trust ratio (trust = 1). bias_correction: scale lr by ``sqrt(1 - beta2^t) / (1 - beta1^t)``.
        state_bits, paged, ...: the storage options (keyword-only)."""

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
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam=adam, bias_correction=bias_correction
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_adam_group(group)


class FusedLAMBAlgorithm(LAMBAlgorithm):
    """Apex's LAMB for the step pipeline: :func:`lamb_math` with FusedLAMB's flags, the bias corrections inside the
    moments, the trust ratio where ``wd != 0`` or ``use_nvlamb``, and the global gradient-norm clip
    (:meth:`step_work`)."""

    hyper = ("lr", "betas", "eps", "weight_decay", "grad_averaging", "adam_w_mode")

    def step_scalars(self, group, step):
        beta1, beta2 = group["betas"]
        if group["bias_correction"]:
            bc = dict(bias_correction1=1 - beta1**step, bias_correction2=1 - beta2**step)
        else:
            bc = dict(bias_correction1=1.0, bias_correction2=1.0)
        return dict(bc, lr_scale=1.0, adam=not self._trust(group), grad_divisor=group.get(GRAD_DIVISOR, 1.0))

    @staticmethod
    def _trust(group) -> bool:
        return bool(group["use_nvlamb"]) or group["weight_decay"] != 0

    def weight_statistic(self, group):
        return "norm" if self._trust(group) else None

    def step_work(
        self, work: list[tuple[torch.Tensor, dict[str, Any]]], grad_mult: torch.Tensor | None = None
    ) -> list[tuple[torch.Tensor, dict[str, Any]]]:
        """The global-norm clip: each group with ``max_grad_norm`` > 0 steps with a view carrying
        ``c = max(1, N / max_grad_norm)`` as a device scalar (docs/migrating.md#lamb-and-lars)."""
        clipped = [g for g in {id(g): g for _, g in work}.values() if g["max_grad_norm"]]
        if not clipped:
            return work
        grads = [p.grad for p, _ in work]
        if any(is_dtensor(g) for g in grads):
            raise ValueError(
                "FusedLAMB: max_grad_norm with DTensor (FSDP2) parameters is not supported; clip with "
                "torch.nn.utils.clip_grad_norm_ before step() and set max_grad_norm=0"
            )
        if grad_mult is not None:
            mults: dict[torch.device, torch.Tensor] = {}
            grads = [
                unscaled(g, mults.setdefault(g.device, grad_mult.to(g.device, non_blocking=True))).to(g.dtype)
                for g in grads
            ]
        norm = global_grad_norm(grads)
        views = {}
        for group in clipped:
            views[id(group)] = dict(group, **{GRAD_DIVISOR: torch.clamp(norm / group["max_grad_norm"], min=1.0)})
        moved: dict[tuple[int, torch.device], dict[str, Any]] = {}
        out = []
        for p, group in work:
            view = views.get(id(group))
            if view is None:
                out.append((p, group))
                continue
            if p.device != norm.device:  # one view per (group, device): the divisor on each parameter's device
                key = (id(group), p.device)
                if key not in moved:
                    moved[key] = dict(view, **{GRAD_DIVISOR: view[GRAD_DIVISOR].to(p.device, non_blocking=True)})
                view = moved[key]
            out.append((p, view))
        return out


def global_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all finite ``grads`` together (fp32, or fp64 if all are), on the first gradient's device."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    device = grads[0].device
    wide = torch.float64 if all(dtype == torch.float64 for _, dtype in by_kind) else torch.float32
    total = torch.zeros((), dtype=wide, device=device)
    for (dev, dtype), group in by_kind.items():
        norms = torch.stack(torch._foreach_norm(group, 2, dtype=torch.float64 if dtype == torch.float64 else wide))
        norms = norms.to(wide)
        squares = norms * norms
        part = torch.where(torch.isfinite(squares), squares, 0.0).sum()
        total = total + (part if dev == device else part.to(device, non_blocking=True))
    return total.sqrt()


class FusedLAMB(GradNoneOnZero, LAMB):
    """Apex's ``FusedLAMB`` (and ColossalAI's) by name, signature and defaults. First ``g = g / c``,
    ``c = max(1, ||all gradients|| / max_grad_norm)``; then :class:`LAMB`, ``m / (1 - beta1^t)``, ``v / (1 - beta2^t)``.

    Args:
        max_grad_norm: clip by the step's global gradient norm (per group, one norm); 0 or None: no clipping.
        use_nvlamb: the trust ratio also where ``weight_decay == 0``.
        adam_w_mode: ``wd p`` added to ``r``; False: to the clipped gradient. grad_averaging: False: ``m += g``.
        amsgrad: True raises, as in Apex. set_grad_none: ``zero_grad()`` sets gradients to None.
        state_bits, ...: the storage options; ``capturable=True`` needs ``bias_correction=False``."""

    algorithm = FusedLAMBAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        amsgrad: bool = False,
        adam_w_mode: bool = True,
        grad_averaging: bool = True,
        set_grad_none: bool = True,
        max_grad_norm: float | None = 1.0,
        use_nvlamb: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        if amsgrad:
            raise RuntimeError("FusedLAMB does not support the AMSGrad variant.")  # Apex's error
        _flag("set_grad_none", set_grad_none)
        self.set_grad_none = set_grad_none
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            grad_averaging=grad_averaging,
            adam_w_mode=adam_w_mode,
            use_nvlamb=use_nvlamb,
            max_grad_norm=0.0 if max_grad_norm is None else max_grad_norm,
        )
        LowMemOptimizer.__init__(self, params, defaults, **storage)

    def _check_group(self, group):
        check_adam_group(group)
        for key in ("bias_correction", "grad_averaging", "adam_w_mode", "use_nvlamb"):
            _flag(key, group[key])
        norm = group["max_grad_norm"]
        if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm >= 0:
            raise ValueError(f"Invalid max_grad_norm: {norm!r} (a number >= 0; 0 or None: no clipping)")
        if group.get("capturable") and group["bias_correction"]:
            raise ValueError(
                "FusedLAMB: capturable=True needs bias_correction=False (its bias corrections are made "
                "on the host each step)"
            )

    def _step_some(self, work, flags=None):
        if any(group["max_grad_norm"] for _, group in work):
            raise ValueError(
                "FusedLAMB: max_grad_norm clips by the norm of every gradient of the step, which "
                "per-layer updates cannot see; set max_grad_norm=0 (or clip before step())"
            )
        super()._step_some(work, flags)


def _flag(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"Invalid {name}: expected a bool, got {type(value).__name__}")
