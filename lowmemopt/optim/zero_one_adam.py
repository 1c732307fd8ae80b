"""0/1 Adam (Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1 Adam",
arXiv 2202.06009), with DeepSpeed's ``ZeroOneAdam`` (v0.16.5) hyper-parameters and defaults, on ``torch.distributed``.
See ``docs/onebit.md`` for where this follows the paper rather than DeepSpeed's code.

Two ideas on top of 1-bit Adam: the variance is updated only on an exponentially thinning set of steps, and after it is
frozen the ranks take local steps and synchronise their accumulated updates only now and then. Per step t::

    t <= var_freeze_step (variance phase; var_interval starts at 1 and doubles every var_update_scaler updates of v)
      t % var_interval == 0:  g = mean of the gradients (full all-reduce)
                              v = beta2 v + (1 - beta2) g^2;  m = beta1 m + (1 - beta1) g
      otherwise:              g = C[local gradient] (1-bit compressed mean, error feedback);  m = beta1 m + (1 - beta1) g
      p <- p - lr (m / bc1 / (sqrt(v) / sqrt(bc2) + eps) + wd p)
    t > var_freeze_step (local phase; local_step_interval starts at 1 and doubles, up to local_step_clipper, every
                         local_step_scaler steps)
      m = beta1 m + (1 - beta1) g_local;  d = -lr (m / bc1 / denom + wd p);  p += d;  u += d;  s += lr / bc1
      t % local_step_interval == 0 (a synchronisation):
          w = C[u * denom]    (compressed mean; the error buffers restart from zero when the local phase begins)
          p <- p - u + w / denom;   m = -w / s;   u = 0;   s = 0

``bc1 = 1 - beta1^t`` and ``bc2 = 1 - beta2^k`` (k: updates of v so far) with ``bias_correction=True``, else 1.
``u`` is the ``momentum_accumulator`` slot (fp32 whatever ``state_bits`` is: it sums small updates), ``s`` a number
per param group.
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
    """fp32 0/1 Adam, one step before any synchronisation: ``g`` is the averaged gradient ("full": v updated too),
    the compressed mean gradient ("compressed") or the local one ("local": the delta also goes into the
    ``momentum_accumulator``). Returns the delta for ``p`` (weight decay included, as a term of the update)."""
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
    """0/1 Adam for the step pipeline: :func:`zero_one_adam_math`; its schedule (the phase of each step, the
    counters in the communicate stage's ``counters`` under each param group's index, the scalers in its
    ``settings``) and its synchronisation are the communicate stage's hooks (:meth:`comm_phase`, :meth:`comm_begin`,
    :meth:`comm_after`). The phase of the step being taken is ``group["onebit"]`` while it runs."""

    math = staticmethod(zero_one_adam_math)
    hyper = ("lr", "betas", "eps", "eps_inside_sqrt", "weight_decay")

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False),
                "momentum_accumulator": Slot(signed=True, quantize=False)}

    def step_scalars(self, group, step):
        sched = group["onebit"]
        if not group["bias_correction"]:
            return dict(phase=sched["phase"], bias_correction1=1.0, bias_correction2_sqrt=1.0)
        beta1, beta2 = group["betas"]
        return dict(phase=sched["phase"], bias_correction1=1 - beta1**step,
                    bias_correction2_sqrt=math.sqrt(1 - beta2 ** max(sched["var_updates"], 1)))

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


def synchronise(stage: OnebitStage, state: dict[torch.Tensor, dict[str, Any]], index: int, group: dict[str, Any],
                params: list[torch.Tensor], sched: dict[str, Any]) -> None:
    """Average the ranks' accumulated updates (in momentum units, compressed), move every replica to the
    synchronised point and reset the momentum to the averaged one (see the module docstring)."""
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
    means = stage.communicate(index, "compressed", messages, lambda i: messages[i],
                              [align_of(group, p) for p in params])
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
    return dict(step=0, var_interval=1, var_counter=0, var_updates=0, local_interval=1, local_counter=0, lrs=0.0,
                local=False)


class ZeroOneAdam(OnebitOptimizer):
    """0/1 Adam with 32/16/8/4-bit m and v (DeepSpeed's ``ZeroOneAdam`` signature and defaults, less ``deepspeed``,
    ``cuda_aware`` and ``comm_backend_name``, plus ``process_group``). See the module docstring, ``docs/onebit.md``
    and :class:`~lowmemopt.optim.onebit.OnebitAdam` (the same requirements: torch.distributed initialized, fp32
    parameters, replicated models; :meth:`register_ddp` for a DDP-wrapped model)."""

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
        for name, value, least in [("var_freeze_step", var_freeze_step, 1), ("var_update_scaler", var_update_scaler, 1),
                                   ("local_step_scaler", local_step_scaler, 1),
                                   ("local_step_clipper", local_step_clipper, 1)]:
            check_step_count(name, value, least)
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps, eps_inside_sqrt=eps_inside_sqrt,
                        weight_decay=weight_decay)
        settings = dict(var_freeze_step=var_freeze_step, var_update_scaler=var_update_scaler,
                        local_step_scaler=local_step_scaler, local_step_clipper=local_step_clipper)
        super().__init__(params, defaults, process_group, settings, **storage)

    def _load_extra_state(self, extra):
        super()._load_extra_state({str(k): v for k, v in extra.items()})
