"""1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence
Speed", arXiv 2102.02888): data parallelism that sends 1 bit per element plus a scale after a full-precision warm-up.
The hyper-parameters and defaults are DeepSpeed's ``OnebitAdam`` (v0.16.5), on ``torch.distributed`` (gloo, NCCL);
see ``docs/onebit.md`` for where this follows the paper rather than DeepSpeed's code. Every rank steps the whole
model; each step's update reads, in place of the local gradient g (:mod:`lowmemopt.distributed.onebit`)::

    warm-up, t <= freeze_step      g_avg = mean over ranks of g            (one all-reduce per param group)
                                   m = beta1 m + (1 - beta1) g_avg;   v = beta2 v + (1 - beta2) g_avg^2
    compressed, t > freeze_step    m = C[ beta1 m + (1 - beta1) g ]        (C: the compressed mean with error feedback,
                                   v frozen                                 lowmemopt.distributed.compression)
    p <- p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
         bc1 = 1 - beta1^t, bc2 = 1 - beta2^min(t, freeze_step)   (1 and 1 with bias_correction=False, as DeepSpeed)

Any ``state_bits`` for m and v: the compressed mean is +-scale per server chunk, and chunks are padded to whole
quantization blocks, so 8-bit m holds it exactly (4-bit m to within a rounding of the scale).
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from ..checks import check_adam_group, sqrt_of
from ..distributed.onebit import OnebitStage, broadcast_parameters, onebit_comm_hook
from ..distributed.sharding import is_dtensor
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot, choose_format, format_of

__all__ = ["OnebitAdam", "OnebitAdamAlgorithm", "onebit_adam_math"]


def onebit_adam_math(
    p: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    eps_inside_sqrt: bool,
    compressed: bool,
    bias_correction1: float,
    bias_correction2_sqrt: float,
) -> torch.Tensor:
    """fp32 1-bit Adam: ``g`` is the averaged gradient in the warm-up and the compressed mean momentum afterwards
    (which becomes ``exp_avg``; ``exp_avg_sq`` stays frozen). Returns the delta for ``p``; the decoupled decay
    ``p *= 1 - lr wd`` is applied by the caller before adding it."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if compressed:
        m.copy_(g)
    else:
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    if eps_inside_sqrt:
        denom = v.div(bias_correction2_sqrt * bias_correction2_sqrt).add_(eps).sqrt_()
    else:
        denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
    return torch.mul(m, -lr / bias_correction1).div_(denom)


class OnebitAdamAlgorithm(Algorithm):
    """1-bit Adam for the step pipeline: :func:`onebit_adam_math`; its communication (:meth:`phase`,
    :meth:`message`) is the communicate stage's (:class:`~lowmemopt.distributed.onebit.OnebitStage`)."""

    math = staticmethod(onebit_adam_math)
    hyper = ("lr", "betas", "eps", "eps_inside_sqrt")

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}

    def phase(self, group: dict[str, Any], step: int) -> str:
        """What step ``step`` (1, 2, ...) of ``group`` communicates: "full" gradients in the warm-up (and always in a
        ``non_freeze`` group), then the "compressed" momentum."""
        if group.get("non_freeze") or step <= group["freeze_step"]:
            return "full"
        return "compressed"

    def step_scalars(self, group, step):
        compressed = self.phase(group, step) == "compressed"
        if not group["bias_correction"]:
            return dict(compressed=compressed, bias_correction1=1.0, bias_correction2_sqrt=1.0)
        beta1, beta2 = group["betas"]
        frozen = step if group.get("non_freeze") else min(step, group["freeze_step"])
        return dict(compressed=compressed, bias_correction1=1 - beta1**step,
                    bias_correction2_sqrt=sqrt_of(1 - beta2**frozen))

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"]

    def message(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """What a rank sends in a compressed step: its local momentum ``beta1 m + (1 - beta1) g`` (fp32, flat;
        ``m`` decoded from its format, left unchanged)."""
        beta1 = group["betas"][0]
        g32 = g.reshape(-1).float()
        if "exp_avg" not in state and "exp_avg.codes" not in state and "exp_avg.nibbles" not in state:
            return torch.mul(g32, 1 - beta1)
        m = format_of(state, "exp_avg").decode(state, "exp_avg", 0, p.numel(), True, group["block_size"])
        return m.mul(beta1).add_(g32, alpha=1 - beta1)


class OnebitAdam(LowMemOptimizer):
    """1-bit Adam with 32/16/8/4-bit state (DeepSpeed's ``OnebitAdam`` signature and defaults, less ``deepspeed``,
    ``cuda_aware`` and ``comm_backend_name``, plus ``process_group``). See the module docstring and
    ``docs/onebit.md``.

    Needs ``torch.distributed`` initialized. The parameters are broadcast from the group's first rank at
    construction; do not wrap the model in DDP, or register :meth:`register_ddp` so that DDP averages the warm-up
    gradients and leaves the compressed steps to the optimizer. fp32 parameters only (keep fp32 master weights for
    mixed precision); no FSDP2 / DTensor parameters, GaLore groups, paged state, capturable steps or per-layer
    updates (``step_in_backward``).
    """

    algorithm = OnebitAdamAlgorithm()

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
        amsgrad: bool = False,
        *,
        process_group: Any = None,
        **storage: Any,
    ) -> None:
        if amsgrad:
            raise ValueError("OnebitAdam does not support amsgrad=True (1-bit Adam freezes the variance)")
        if max_grad_norm:
            raise ValueError(f"OnebitAdam: max_grad_norm={max_grad_norm!r} is not supported (DeepSpeed accepted and "
                             "ignored it); clip the gradients before step(), e.g. torch.nn.utils.clip_grad_norm_")
        self._stage = OnebitStage(process_group)  # raises unless torch.distributed is initialized
        self.process_group = process_group
        defaults = dict(lr=lr, freeze_step=freeze_step, bias_correction=bias_correction, betas=betas, eps=eps,
                        eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay)
        super().__init__(params, defaults, **storage)
        broadcast_parameters([p for group in self.param_groups for p in group["params"]], process_group)

    def _check_group(self, group):
        check_adam_group(group)
        fs = group["freeze_step"]
        if isinstance(fs, bool) or not isinstance(fs, int) or fs < 1:
            raise ValueError(f"Invalid freeze_step: {fs!r} (must be an int >= 1: the warm-up sets the variance)")
        if group.get("rank") is not None:
            raise ValueError(f"{type(self).__name__} does not support GaLore param groups (rank=...)")
        if group.get("paged"):
            raise ValueError(f"{type(self).__name__} does not support paged=... state")
        if group.get("capturable"):
            raise ValueError(f"{type(self).__name__} does not support capturable=True")
        for p in group.get("params", ()):
            if is_dtensor(p):
                raise ValueError(f"{type(self).__name__} does not support FSDP2 / DTensor parameters: it replicates "
                                 "the model on every rank (data parallelism); shard with a plain optimizer instead")
            if p.dtype != torch.float32:
                raise ValueError(f"{type(self).__name__} needs fp32 parameters (got {p.dtype}): keep fp32 master "
                                 "weights for mixed precision")

    # -- the communicate stage ------------------------------------------------------------------------------------------

    def _group_step(self, group: dict[str, Any]) -> int:
        """The step count of ``group`` (its first parameter's with state; 0 before its first step)."""
        for p in group["params"]:
            st = self.state.get(p)
            if st and "step" in st:
                return int(st["step"])
        return 0

    def next_phase(self) -> str:
        """The communication phase of the next step of the first param group ("full" or "compressed"): what a DDP comm
        hook follows (:func:`~lowmemopt.distributed.onebit.onebit_comm_hook`)."""
        group = self.param_groups[0]
        return self.algorithm.phase(group, self._group_step(group) + 1)

    def register_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register :func:`~lowmemopt.distributed.onebit.onebit_comm_hook` on ``ddp``: DDP averages the gradients of
        full-precision steps and sends nothing on compressed ones, where this optimizer communicates."""
        ddp.register_comm_hook(self, onebit_comm_hook)
        self._stage.ddp_reduces = True

    def _align(self, group: dict[str, Any], p: torch.Tensor) -> int:
        fmt = choose_format(group["state_bits"], p.numel(), group["min_quant_numel"])
        return group["block_size"] if fmt.bits < 16 else 8

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step: the communicate stage replaces each gradient by what the update reads (see the module
        docstring), then the ordinary pipeline updates the parameters; the gradients are given back afterwards."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for index, group in enumerate(self.param_groups):
                params = [p for p in group["params"] if p.grad is not None]
                if not params:
                    continue
                grads = [p.grad for p in params]
                phase = self.algorithm.phase(group, self._group_step(group) + 1)
                message = lambda i, ps=params, gs=grads, g=group: self.algorithm.message(  # noqa: E731
                    ps[i], gs[i], self.state.get(ps[i], {}), g)
                new = self._stage.communicate(index, phase, grads, message, [self._align(group, p) for p in params])
                if new is not None:
                    for p, g in zip(params, new):
                        swapped.append((p, p.grad))
                        p.grad = g.view_as(p)
            super().step()
        finally:
            for p, g in swapped:
                p.grad = g
        return loss

    def _step_some(self, work, flags=None):
        raise ValueError(f"{type(self).__name__} does not support per-layer updates (step_in_backward): its "
                         "communication moves the whole model's momentum in one bucketed call per step")

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"onebit"``: this rank's error buffers (they differ per rank; save one file per
        rank, e.g. ``lowmemopt.distributed.rank_path``)."""
        sd = super().state_dict()
        sd["onebit"] = self._stage.errors_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's part and this rank's error buffers; at another world size (or without them) the error
        buffers restart from zero, with a warning."""
        state_dict = dict(state_dict)
        errors = state_dict.pop("onebit", None)
        super().load_state_dict(state_dict)
        why = self._stage.load_errors(errors)
        if why is not None:
            warnings.warn(f"{type(self).__name__}: the compression error buffers restart from zero: {why}",
                          RuntimeWarning, stacklevel=2)
