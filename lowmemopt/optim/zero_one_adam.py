"""0/1 Adam (Lu et al. 2022, arXiv 2202.06009) with DeepSpeed's ``ZeroOneAdam`` (v0.16.5) arguments and defaults, on
``torch.distributed``: 1-bit Adam whose variance is updated on thinning steps, then local steps whose accumulated
updates ``u`` (the fp32 ``momentum_accumulator`` slot) are synchronised now and then. The per-step math and where it
follows the paper: docs/onebit.md ("0/1 Adam"); what it shares with 1-bit Adam: :mod:`lowmemopt.optim.onebit`.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..distributed.onebit import OnebitStage, align_of, apply_mask
from ..quant.formats import Slot, format_of
from .onebit import OnebitAdamAlgorithm, OnebitOptimizer, adam_denominator, check_step_count, check_unsupported

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["ZeroOneAdam", "ZeroOneAdamAlgorithm", "zero_one_adam_math"]


def zero_one_adam_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    eps_inside_sqrt: bool,
    weight_decay: float,
    phase: str,
    bias_correction1: float,
    bias_correction2_sqrt: float,
) -> torch.Tensor:
    """fp32 0/1 Adam before any synchronisation: ``g`` is the averaged ("full": v updated too), compressed mean or
    local gradient ("local": the delta also goes into the accumulator). Returns the delta for ``p``, decay included."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if phase == "full":
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    update = torch.div(m, adam_denominator(v, eps, eps_inside_sqrt, bias_correction2_sqrt))
    update.div_(bias_correction1)  # (exact when 1; a runtime scalar of the compiled step: no branch on it)
    if weight_decay != 0:
        update.add_(p, alpha=weight_decay)
    delta = update.mul_(-lr)
    if phase == "local":
        state["momentum_accumulator"].add_(delta)
    return delta


class ZeroOneAdamAlgorithm(OnebitAdamAlgorithm):
    """0/1 Adam for the step pipeline; its schedule (the communicate stage's ``counters`` and ``settings``) and its
    synchronisation are the communicate stage's hooks. ``group["onebit"]`` is the running step's phase."""

    math = staticmethod(zero_one_adam_math)
    hyper = ("lr", "betas", "eps", "eps_inside_sqrt", "weight_decay")

    def slots(self, group, param):
        return {
            "exp_avg": Slot(signed=True),
            "exp_avg_sq": Slot(signed=False),
            "momentum_accumulator": Slot(signed=True, quantize=False),
        }

    def step_scalars(self, group, step):
        sched = group["onebit"]
        if not group["bias_correction"]:
            return dict(phase=sched["phase"], bias_correction1=1.0, bias_correction2_sqrt=1.0)
        beta1, beta2 = group["betas"]
        return dict(
            phase=sched["phase"],
            bias_correction1=1 - beta1**step,
            bias_correction2_sqrt=math.sqrt(1 - beta2 ** max(sched["var_updates"], 1)),
        )

    def decay_factor(self, group):
        return 1.0  # (the decay is a term of the update, which the accumulator sums)

    def message(self, p, g, state, group):
        """A variance-phase compressed step sends the local gradient."""
        return g.reshape(-1).float()

    # -- the schedule and the synchronisation (the communicate stage's hooks) ----------------------------------------

    @staticmethod
    def schedule(stage: OnebitStage, index: int) -> dict[str, Any]:
        """Param group ``index``'s counters (made at its first step)."""
        return stage.counters.setdefault(str(index), new_schedule())

    def comm_phase(self, stage, state, index, group):
        sched = self.schedule(stage, index)
        t = sched["step"] + 1
        if t <= stage.settings["var_freeze_step"]:
            return "full" if t % sched["var_interval"] == 0 else "compressed"
        return "local"

    def comm_begin(self, stage, plan, index, group, phase):
        sched = self.schedule(stage, index)
        sched["step"] += 1
        if phase == "full":
            sched["var_updates"] += 1
        if phase == "local" and not sched["local"]:  # the error buffers now compress another quantity
            sched["local"] = True
            stage.buckets.pop(index, None)
        group["onebit"] = dict(phase=phase, var_updates=sched["var_updates"])

    def comm_after(self, stage, plan, index, group, phase, params):
        group.pop("onebit", None)
        sched = self.schedule(stage, index)
        settings = stage.settings
        t = sched["step"]
        if phase != "local":
            if phase == "full":
                sched["var_counter"] += 1
                if sched["var_counter"] == settings["var_update_scaler"]:
                    sched["var_counter"] = 0
                    sched["var_interval"] *= 2
            return
        lr = group["lr"]
        bc1 = 1 - group["betas"][0] ** t if group["bias_correction"] else 1.0
        sched["lrs"] += float(lr) / bc1
        if t % sched["local_interval"] == 0:
            synchronise(stage, plan.state, index, group, params, sched)
        sched["local_counter"] += 1
        if sched["local_counter"] == settings["local_step_scaler"]:
            sched["local_counter"] = 0
            sched["local_interval"] = min(settings["local_step_clipper"], sched["local_interval"] * 2)


def synchronise(
    stage: OnebitStage,
    state: dict[torch.Tensor, dict[str, Any]],
    index: int,
    group: dict[str, Any],
    params: list[torch.Tensor],
    sched: dict[str, Any],
) -> None:
    """Average the ranks' accumulated updates (compressed), move every replica to that point, reset ``m``."""
    bs = group["block_size"]
    eps, inside = group["eps"], group["eps_inside_sqrt"]
    bc2s = 1.0
    if group["bias_correction"]:
        bc2s = math.sqrt(1 - group["betas"][1] ** max(sched["var_updates"], 1))
    denoms, accs = [], []
    for p in params:
        st = state[p]
        v = format_of(st, "exp_avg_sq").decode(st, "exp_avg_sq", 0, p.numel(), False, bs)
        denoms.append(adam_denominator(v, eps, inside, bc2s))
        accs.append(st["momentum_accumulator"].view(-1))
    messages = [u * d for u, d in zip(accs, denoms)]
    means = stage.communicate(
        index, "compressed", messages, lambda i: messages[i], [align_of(group, p) for p in params]
    )
    apply_mask(group, params, means)
    lrs = sched["lrs"]
    for p, u, d, w in zip(params, accs, denoms, means):
        flat = p.data.view(-1)
        flat.sub_(u)
        flat.add_(w.reshape(-1) / d)
        st = state[p]
        m = torch.div(w.reshape(-1), lrs).neg_()
        format_of(st, "exp_avg").encode(st, "exp_avg", 0, p.numel(), m, True, bs)
        u.zero_()
    sched["lrs"] = 0.0


def new_schedule() -> dict[str, Any]:
    """A param group's 0/1 Adam counters before its first step."""
    return dict(
        step=0, var_interval=1, var_counter=0, var_updates=0, local_interval=1, local_counter=0, lrs=0.0, local=False
    )


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam with 32/16/8/4-bit m and v; DeepSpeed's ``ZeroOneAdam`` signature and defaults (docs/onebit.md).

    Args:
        var_freeze_step: the variance phase's length. var_update_scaler: variance updates per doubling of the interval.
        local_step_scaler, local_step_clipper: steps per doubling of the synchronisation interval, and its cap.
        process_group: the ranks (default: the world). state_bits, ...: the storage options.

    The same requirements as :class:`~lowmemopt.optim.onebit.OnebitAdam`."""

    algorithm = ZeroOneAdamAlgorithm()
    #: (``onebit``: the step's phase, held in the group while the step runs)
    _extra_group_keys = OnebitOptimizer._extra_group_keys | {"onebit"}

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        *,
        process_group: Any = None,
        **storage: Unpack[StorageOptions],
    ) -> None:
        check_unsupported(type(self).__name__, amsgrad, max_grad_norm)
        for name, value, least in [
            ("var_freeze_step", var_freeze_step, 1),
            ("var_update_scaler", var_update_scaler, 1),
            ("local_step_scaler", local_step_scaler, 1),
            ("local_step_clipper", local_step_clipper, 1),
        ]:
            check_step_count(name, value, least)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        defaults = dict(
            lr=lr,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
        )
        settings = dict(
            var_freeze_step=var_freeze_step,
            var_update_scaler=var_update_scaler,
            local_step_scaler=local_step_scaler,
            local_step_clipper=local_step_clipper,
        )
        super().__init__(params, defaults, process_group, settings, **storage)

    def _load_extra_state(self, extra):
        super()._load_extra_state({str(k): v for k, v in extra.items()})
