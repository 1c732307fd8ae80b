"""Adafactor (Shazeer & Stern 2018). ``Adafactor`` matches ``transformers.optimization.Adafactor``::

    beta2_t = 1 - t^decay_rate;   V = beta2_t V + (1 - beta2_t) (g^2 + eps1)   factored: V ~ R C / mean(R), R, C the row
    u = g / sqrt(V);   u /= max(1, RMS(u) / clip_threshold)                    and column means of V (last two dims)
    a = rho_t * max(eps2, RMS(p)) [scale_parameter],  rho_t = lr or min(1e-2 | 1e-6 t [warmup_init], 1/sqrt(t))
    m = beta1 m + (1 - beta1) a u  [beta1 given];     p <- p - a wd p - (m or a u)

``AdafactorTorch`` matches ``torch.optim.Adafactor`` (state keys too; 32-bit results bit for bit): eps1 clamps
``V >= eps1^2``, ``rho_t = min(lr, 1/sqrt(t))`` always scaled by ``max(eps2, RMS(p))``, ``p *= 1 - lr wd``, no first
moment. Row and column statistics stay unquantized at every ``state_bits``: fp32, float64 for float64 parameters, as
the math is.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..distributed.reduction import LOCAL, Reduction
from ..checks import check_eps_pair, check_lr, check_nonneg, check_positive
from ..optimizer import LowMemOptimizer
from ..cpu import factored as native
from ..pipeline.algorithm import Algorithm, KernelSet, fused
from ..quant.formats import Slot

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["Adafactor", "AdafactorTorch", "adafactor_math", "adafactor_torch_math", "factored_slots"]

Scalar = float | torch.Tensor  # a Python number or a 0-dim tensor on the parameter's device


def rms(t: torch.Tensor, reduce: Reduction = LOCAL) -> torch.Tensor:
    """Root mean square of the whole (global) tensor, as a 0-dim tensor (no host sync)."""
    return reduce.norm(t) / math.sqrt(reduce.numel(t))


def rms64(t: torch.Tensor, reduce: Reduction = LOCAL) -> torch.Tensor:
    """``||t|| / numel ** 0.5`` in float64 from the norm in ``t``'s dtype: torch.optim.Adafactor's
    ``t.norm(2).item() / (t.numel() ** 0.5)``, as a 0-dim device tensor (no host sync)."""
    return reduce.norm(t).double() / reduce.numel(t) ** 0.5


def approx_rsqrt(row: torch.Tensor, col: torch.Tensor, out: torch.Tensor, reduce: Reduction = LOCAL) -> torch.Tensor:
    """``1 / sqrt(V)`` for the factored ``V = row col / mean(row)``, written into ``out`` (shape ``[..., R, C]``).
    ``mean(row)`` runs over the parameter's dim -2 (all R rows, also those of other shards)."""
    r_factor = (row / reduce.mean(row, dim=-1, pdim=-2, keepdim=True)).rsqrt_().unsqueeze(-1)
    c_factor = col.unsqueeze(-2).rsqrt()
    return torch.mul(r_factor, c_factor, out=out)


def add_scaled_(out: torch.Tensor, t: torch.Tensor, s: Scalar) -> torch.Tensor:
    """``out += s * t`` for a Python or a 0-dim tensor ``s``, without a host sync (both round as ``add_(alpha=s)``)."""
    return out.addcmul_(t, s) if isinstance(s, torch.Tensor) else out.add_(t, alpha=s)


def ema_factored_(
    row: torch.Tensor, col: torch.Tensor, x: torch.Tensor, beta: float, reduce: Reduction = LOCAL
) -> None:
    """Row/column statistics of ``x`` (means over the last and second-to-last dims) as EMAs, in place."""
    row.mul_(beta).add_(reduce.mean(x, dim=-1, pdim=-1), alpha=1.0 - beta)
    col.mul_(beta).add_(reduce.mean(x, dim=-2, pdim=-2), alpha=1.0 - beta)


def clipped_preconditioned(
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    eps1: float,
    beta2: float,
    clip_threshold: float,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """Adafactor/CAME's update direction: ``V`` = EMA of ``g^2 + eps1`` (factored over the last two dims iff
    ``state`` holds ``exp_avg_sq_row``, else the full ``exp_avg_sq``), ``u = g / sqrt(V)`` clipped so that
    ``RMS(u) <= clip_threshold``. Updates the state in place; returns ``u`` (a new tensor)."""
    u = g.square().add_(eps1)
    if "exp_avg_sq_row" in state:
        row, col = state["exp_avg_sq_row"], state["exp_avg_sq_col"]
        ema_factored_(row, col, u, beta2, reduce)
        approx_rsqrt(row, col, u, reduce).mul_(g)
    else:
        v = state["exp_avg_sq"]
        v.mul_(beta2).add_(u, alpha=1.0 - beta2)
        torch.rsqrt(v, out=u).mul_(g)
    return u.div_((rms(u, reduce) / clip_threshold).clamp_(min=1.0))


def factored_shapes(shape: torch.Size) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Row and column statistic shapes of a parameter of >= 2 dims (leading dims are a batch)."""
    return tuple(shape[:-1]), tuple(shape[:-2]) + (shape[-1],)


def factored_slots(shape: torch.Size, *prefixes: str) -> dict[str, Slot]:
    """fp32 row (``<prefix>_row``, the mean over the last dim) and column (``<prefix>_col``, over dim -2) statistic
    slots of a parameter of >= 2 dims for each of ``prefixes``, each dim tagged with the parameter dim it runs along."""
    row, col = factored_shapes(shape)
    n = len(shape)
    slots = {}
    for prefix in prefixes:
        slots[prefix + "_row"] = Slot(signed=False, quantize=False, shape=row, dims=tuple(range(n - 1)))
        slots[prefix + "_col"] = Slot(signed=False, quantize=False, shape=col, dims=tuple(range(n - 2)) + (n - 1,))
    return slots


def step_size(
    rms_p: torch.Tensor | None,
    *,
    step: int,
    lr: Scalar | None,
    eps2: float,
    scale_parameter: bool,
    relative_step: bool,
    warmup_init: bool,
) -> Scalar:
    """Adafactor's step size ``a = rho_t * max(eps2, RMS(p))`` (``rho_t`` alone without ``scale_parameter``; then
    ``rms_p`` is not read). ``rms_p`` is not modified."""
    rho = lr
    if relative_step:
        rho = min(1e-6 * step if warmup_init else 1e-2, 1.0 / math.sqrt(step))
    return rms_p.clamp(min=eps2) * rho if scale_parameter else rho


def adafactor_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    step: int,
    lr: Scalar | None,
    eps1: float,
    eps2: float,
    clip_threshold: float,
    decay_rate: float,
    beta1: float | None,
    weight_decay: float,
    scale_parameter: bool,
    relative_step: bool,
    warmup_init: bool,
    reduce: Reduction = LOCAL,
) -> torch.Tensor:
    """fp32 Adafactor (transformers semantics) on a whole tensor: updates the state in place, applies the weight decay
    ``p -= a wd p`` to the fp32 working copy ``p`` in place (``a`` depends on RMS(p), so it is not a constant factor),
    and returns ``u`` with ``p_new = p - u``. Factored iff ``state`` holds ``exp_avg_sq_row``; momentum iff ``exp_avg``.
    Operation order follows transformers, so 32-bit results are bit-identical."""
    alpha = step_size(
        rms(p, reduce) if scale_parameter else None,
        step=step,
        lr=lr,
        eps2=eps2,
        scale_parameter=scale_parameter,
        relative_step=relative_step,
        warmup_init=warmup_init,
    )

    beta2t = 1.0 - math.pow(step, decay_rate)
    u = clipped_preconditioned(g, state, eps1, beta2t, clip_threshold, reduce)
    u.mul_(alpha)

    if beta1 is not None:
        m = state["exp_avg"]
        m.mul_(beta1).add_(u, alpha=1 - beta1)
        u = m
    if weight_decay != 0:
        add_scaled_(p, p, -weight_decay * alpha)
    return u


def adafactor_torch_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    step: int,
    lr: Scalar,
    beta2_decay: float,
    eps1: float,
    eps2: float,
    d: float,
    maximize: bool,
    reduce: Reduction = LOCAL,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 Adafactor (``torch.optim.Adafactor`` semantics, bit for bit): updates the state in place; returns
    ``(u, s)``, ``p_new = p (1 - lr wd) + s u`` added in one rounding (torch's ``add_(u, alpha=s)``; the caller decays
    and adds), ``s = -rho max(eps2, RMS(p)) / max(1, RMS(u) / d)`` in float64 as torch's host scalars, but a 0-dim
    tensor (no host read) rounded to ``p``'s dtype. Factored iff ``state`` holds ``row_var``."""
    if maximize:
        g = -g
    one_minus_beta2_t = step**beta2_decay
    bound = 1 / step**0.5  # (torch's expressions: ``** 0.5``, not math.sqrt)
    rho = lr.double().clamp(max=bound) if isinstance(lr, torch.Tensor) else min(lr, bound)
    alpha = rms64(p, reduce).clamp_(min=eps2) * rho

    if "row_var" in state:
        row_var, col_var = state["row_var"], state["col_var"]  # [..., R, 1] and [..., 1, C]
        row_mean = reduce.norm_along(g, -1, -1, keepdim=True).square_().div_(reduce.size(g, -1, -1))
        row_var.lerp_(row_mean, one_minus_beta2_t)
        col_mean = reduce.norm_along(g, -2, -2, keepdim=True).square_().div_(reduce.size(g, -2, -2))
        col_var.lerp_(col_mean, one_minus_beta2_t)
        var = torch.matmul(row_var, col_var)
        var.div_(reduce.mean(row_var, dim=-2, pdim=-2, keepdim=True).clamp_(min=eps1))
    else:
        variance = state["variance"]
        var = g * g
        variance.lerp_(var, one_minus_beta2_t)
        var.copy_(variance)
    u = var.clamp_(min=eps1 * eps1).rsqrt_().mul_(g)
    denom = (reduce.norm(u).double() / (reduce.numel(u) ** 0.5 * d)).clamp_(min=1.0)
    return u, (-alpha / denom).to(p.dtype)


#: Adafactor's fused kernels: Triton (``kernels/factored.py``) and C (``csrc/factored.c``, a step that can be its
#: gradient's non-finite check)
KERNELS = KernelSet("adafactor", triton="factored:ADAFACTOR", capturable=True, native=native.ADAFACTOR)
#: ``torch.optim.Adafactor``'s semantics: a native C step only
TORCH_KERNELS = KernelSet("adafactor_torch", native=native.ADAFACTOR_TORCH)


class AdafactorAlgorithm(Algorithm):
    """Adafactor for the step pipeline: its slots, math, step scalars and decay rules."""

    elementwise = False  # row/column means and RMS clipping need the whole tensor
    batched_reductions = True  # (its math communicates through reduce only)
    weight_stat_math = True  # reads p for RMS(p) and its decay p -= a wd p

    def slots(self, group, param):
        slots = {}
        if group["beta1"] is not None:
            slots["exp_avg"] = Slot(signed=True)
        if param.dim() >= 2:
            slots.update(factored_slots(param.shape, "exp_avg_sq"))
        else:
            slots["exp_avg_sq"] = Slot(signed=False)
        return slots

    def weight_statistic(self, group):
        return "rms" if group["scale_parameter"] else None

    def math_decay(self, group, step, stat):
        if group["weight_decay"] == 0:
            return None
        alpha = step_size(
            stat,
            step=step,
            lr=group["lr"],
            eps2=group["eps"][1],
            scale_parameter=group["scale_parameter"],
            relative_step=group["relative_step"],
            warmup_init=group["warmup_init"],
        )
        return -group["weight_decay"] * alpha

    @fused(KERNELS)
    def update(self, p, g, state, group, step, reduce=LOCAL):
        eps1, eps2 = group["eps"]
        u = adafactor_math(
            p,
            g,
            state,
            step=step,
            lr=group["lr"],
            eps1=eps1,
            eps2=eps2,
            clip_threshold=group["clip_threshold"],
            decay_rate=group["decay_rate"],
            beta1=group["beta1"],
            weight_decay=group["weight_decay"],
            scale_parameter=group["scale_parameter"],
            relative_step=group["relative_step"],
            warmup_init=group["warmup_init"],
            reduce=reduce,
        )
        return u, -1.0


class Adafactor(LowMemOptimizer):
    """Adafactor with 32/16/8/4-bit state; same signature, defaults, errors and 32-bit results as
    ``transformers.optimization.Adafactor``. See the module docstring for the update and for ``AdafactorTorch``.

    ``lr=None`` with ``relative_step=True`` (the default) uses the time-dependent step ``min(1e-2, 1/sqrt(t))``; for an
    external schedule pass ``lr`` with ``relative_step=False`` and ``scale_parameter=False``. Factored over the last two
    dims (leading dims as a batch) for params of >= 2 dims; 1-D params keep a full second moment.
    """

    algorithm = AdafactorAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor | None = None,
        eps: tuple[float, float] = (1e-30, 1e-3),
        clip_threshold: float = 1.0,
        decay_rate: float = -0.8,
        beta1: float | None = None,
        weight_decay: float = 0.0,
        scale_parameter: bool = True,
        relative_step: bool = True,
        warmup_init: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(
            lr=lr,
            eps=eps,
            clip_threshold=clip_threshold,
            decay_rate=decay_rate,
            beta1=beta1,
            weight_decay=weight_decay,
            scale_parameter=scale_parameter,
            relative_step=relative_step,
            warmup_init=warmup_init,
        )
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"], required=False)
        if group["lr"] is not None and group["relative_step"]:
            raise ValueError("Cannot combine manual `lr` and `relative_step=True` options")
        if group["warmup_init"] and not group["relative_step"]:
            raise ValueError("`warmup_init=True` requires `relative_step=True`")
        if group["lr"] is None and not group["relative_step"]:
            raise ValueError("Invalid learning rate: `relative_step=False` needs a manual `lr`")
        check_eps_pair(group["eps"])
        check_positive("clip_threshold", group["clip_threshold"])
        check_nonneg("weight_decay value", group["weight_decay"])
        if isinstance(group["decay_rate"], bool) or not isinstance(group["decay_rate"], (int, float)):
            raise TypeError(f"Invalid decay_rate: expected a number, got {type(group['decay_rate']).__name__}")
        if not group["decay_rate"] <= 0.0:
            raise ValueError(f"Invalid decay_rate: {group['decay_rate']} (must be <= 0)")
        beta1 = group["beta1"]
        if beta1 is not None:
            if isinstance(beta1, bool) or not isinstance(beta1, (int, float)):
                raise TypeError(f"Invalid beta1: expected a number or None, got {type(beta1).__name__}")
            if not 0.0 <= beta1 < 1.0:
                raise ValueError(f"Invalid beta1: {beta1} (must be in [0, 1) or None)")


class AdafactorTorchAlgorithm(Algorithm):
    """AdafactorTorch for the step pipeline: its slots, math, step scalars and decay rules."""

    elementwise = False
    batched_reductions = True
    weight_stat_math = True  # reads p for RMS(p); its decay is the factor 1 - lr wd

    def slots(self, group, param):
        if param.dim() >= 2:
            n = param.dim()
            row, col = list(param.shape), list(param.shape)
            row[-1], col[-2] = 1, 1
            dims = tuple(range(n))
            return {  # keepdim statistics: dim i runs along parameter dim i, except the reduced one (size 1)
                "row_var": Slot(signed=False, quantize=False, shape=tuple(row), dims=dims[:-1] + (None,)),
                "col_var": Slot(signed=False, quantize=False, shape=tuple(col), dims=dims[:-2] + (None, n - 1)),
            }
        return {"variance": Slot(signed=False)}

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"] if group["weight_decay"] != 0 else 1.0

    def weight_statistic(self, group):
        return "rms"

    @fused(TORCH_KERNELS)
    def update(self, p, g, state, group, step, reduce=LOCAL):
        eps1, eps2 = group["eps"]
        return adafactor_torch_math(
            p,
            g,
            state,
            step=step,
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            eps1=torch.finfo(p.dtype).eps if eps1 is None else eps1,  # (p: fp32, or float64 for float64 params)
            eps2=eps2,
            d=group["d"],
            maximize=group["maximize"],
            reduce=reduce,
        )


class AdafactorTorch(LowMemOptimizer):
    """Adafactor with ``torch.optim.Adafactor``'s signature, defaults and 32-bit results, and 32/16/8/4-bit state.

    ``eps=(None, 1e-3)``: ``None`` means the machine epsilon of the math's dtype: float32's (the math is fp32 for
    float32, bf16 and fp16 parameters; torch uses the parameter dtype's, so bf16 parameters differ), float64's for
    float64 parameters (as torch). No ``foreach``: there is one implementation.
    """

    algorithm = AdafactorTorchAlgorithm()

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float | torch.Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay, maximize=maximize)
        super().__init__(params, defaults, **storage)

    def _check_group(self, group):
        check_lr(group["lr"])
        if isinstance(group["beta2_decay"], bool) or not isinstance(group["beta2_decay"], (int, float)):
            raise TypeError(f"Invalid beta2_decay: expected a number, got {type(group['beta2_decay']).__name__}")
        if not group["beta2_decay"] <= 0.0:  # (torch's messages, after ours)
            raise ValueError(f"Invalid beta2_decay: {group['beta2_decay']} (beta2_decay should be <= 0)")
        eps1 = group["eps"][0] if isinstance(group["eps"], (tuple, list)) and group["eps"] else None
        if isinstance(eps1, (int, float)) and not isinstance(eps1, bool) and not eps1 >= 0.0:
            raise ValueError(f"Invalid eps[0]: {eps1} (epsilon1 should be >= 0)")
        check_eps_pair(group["eps"], first_optional=True)
        check_nonneg("d", group["d"])
        if not group["d"] >= 1.0:
            raise ValueError(f"Invalid d: {group['d']} (Clipping threshold d should be >= 1)")
        check_nonneg("weight_decay value", group["weight_decay"])
