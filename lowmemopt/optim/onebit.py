"""1-bit Adam (Tang et al. 2021, arXiv 2102.02888) with DeepSpeed's ``OnebitAdam`` (v0.16.5) arguments and defaults,
on ``torch.distributed``, and :class:`OnebitOptimizer`, what the compressed optimizers share. The compressed all-reduce
is :mod:`lowmemopt.distributed.compression`; the algorithm and where it follows the paper: docs/onebit.md.

    t <= freeze_step:  g = mean of the ranks' g;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    t >  freeze_step:  m = C[b1 m + (1 - b1) g]  (compressed mean, error feedback);  v frozen
    p <- p (1 - lr wd) - lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps),  bc1 = 1 - b1^t,  bc2 = 1 - b2^min(t, freeze_step)
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Iterable

import torch

from ..checks import check_adam_group, sqrt_of
from ..distributed.compression import Layout
from ..distributed.onebit import OnebitStage, align_of, broadcast_parameters, onebit_comm_hook
from ..distributed.sharding import is_dtensor
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot, format_of

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["OnebitAdam", "OnebitAdamAlgorithm", "OnebitOptimizer", "onebit_adam_math", "adam_denominator", "group_step"]


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
    """fp32 1-bit Adam on the averaged gradient or compressed momentum ``g``: the delta (the caller decays)."""
    beta1, beta2 = betas
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if compressed:
        m.copy_(g)
    else:
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return torch.mul(m, -lr / bias_correction1).div_(adam_denominator(v, eps, eps_inside_sqrt, bias_correction2_sqrt))


def adam_denominator(
    v: torch.Tensor, eps: float, eps_inside_sqrt: bool = False, bias_correction2_sqrt: float = 1.0
) -> torch.Tensor:
    """``sqrt(v) / sqrt(bc2) + eps``, or ``sqrt(v / bc2 + eps)`` with ``eps_inside_sqrt`` (a new tensor)."""
    if eps_inside_sqrt:
        return v.div(bias_correction2_sqrt * bias_correction2_sqrt).add_(eps).sqrt_()
    return v.sqrt().div_(bias_correction2_sqrt).add_(eps)


class OnebitAdamAlgorithm(Algorithm):
    """1-bit Adam for the step pipeline; the communicate stage (``OnebitStage``) runs its hooks."""

    math = staticmethod(onebit_adam_math)
    hyper = ("lr", "betas", "eps", "eps_inside_sqrt")

    def slots(self, group, param):
        return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}

    def phase(self, group: dict[str, Any], step: int) -> str:
        """ "full" gradients in the warm-up (always in a ``non_freeze`` group), then "compressed"."""
        if group.get("non_freeze") or step <= group["freeze_step"]:
            return "full"
        return "compressed"

    def step_scalars(self, group, step):
        compressed = self.phase(group, step) == "compressed"
        if not group["bias_correction"]:
            return dict(compressed=compressed, bias_correction1=1.0, bias_correction2_sqrt=1.0)
        beta1, beta2 = group["betas"]
        frozen = step if group.get("non_freeze") else min(step, group["freeze_step"])
        return dict(
            compressed=compressed, bias_correction1=1 - beta1**step, bias_correction2_sqrt=sqrt_of(1 - beta2**frozen)
        )

    def decay_factor(self, group):
        return 1 - group["lr"] * group["weight_decay"]

    def message(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> torch.Tensor:
        """What a rank sends in a compressed step: ``beta1 m + (1 - beta1) g`` (fp32, flat)."""
        beta1 = group["betas"][0]
        g32 = g.reshape(-1).float()
        if "exp_avg" not in state and "exp_avg.codes" not in state and "exp_avg.nibbles" not in state:
            return torch.mul(g32, 1 - beta1)
        m = format_of(state, "exp_avg").decode(state, "exp_avg", 0, p.numel(), True, group["block_size"])
        return m.mul(beta1).add_(g32, alpha=1 - beta1)

    # -- the communicate stage's hooks (plain tensors, the plan's state dict and groups, the stage's counters) -------

    def comm_phase(
        self, stage: OnebitStage, state: dict[torch.Tensor, dict[str, Any]], index: int, group: dict[str, Any]
    ) -> str:
        """The phase of param group ``index``'s next step."""
        return self.phase(group, group_step(state, group) + 1)

    def comm_begin(self, stage: OnebitStage, plan: Any, index: int, group: dict[str, Any], phase: str) -> None:
        """Before param group ``index`` communicates this step (its phase known): nothing, for 1-bit Adam."""

    def comm_after(
        self, stage: OnebitStage, plan: Any, index: int, group: dict[str, Any], phase: str, params: list[torch.Tensor]
    ) -> None:
        """After the update of param group ``index`` (``params``: those that stepped): nothing, for 1-bit Adam."""


def group_step(state: dict[torch.Tensor, dict[str, Any]], group: dict[str, Any]) -> int:
    """The step count of ``group`` (its first parameter's with state; 0 before its first step)."""
    for p in group["params"]:
        st = state.get(p)
        if st and "step" in st:
            return int(st["step"])
    return 0


class OnebitOptimizer(LowMemOptimizer):
    """What the compressed optimizers share: the communicate stage, the broadcast at construction, a DDP comm hook,
    the error buffers and counters in the state dict."""

    #: DeepSpeed's group keys: a group's momentum mask, and a group that never freezes its variance
    _extra_group_keys = frozenset({"exp_avg_mask", "non_freeze"})
    #: the gradients are compressed and communicated before the update (their error feedback holds the scaled
    #: values): ``torch.amp.GradScaler`` unscales them first, on its generic path
    _step_supports_amp_scaling = False

    #: the registry, ``lowmemopt estimate`` and the Trainer factory read this: constructing one on real parameters
    #: needs ``torch.distributed`` initialized (``dist.init_process_group``, e.g. under ``torchrun``)
    requires_process_group = True
    #: what these refuse (GaLore groups, paged state), left out of ``lowmemopt estimate``'s search for what fits
    supports_galore = False
    supports_paged = False

    def __init__(
        self,
        params: Any,
        defaults: dict[str, Any],
        process_group: Any,
        settings: dict[str, Any] | None = None,
        **storage: Unpack[StorageOptions],
    ) -> None:
        params = _listed(params)
        #: built on meta parameters only: a layout (``state_nbytes``, ``lowmemopt estimate``), with no process group
        #: needed and nothing communicated; :meth:`step` refuses
        self.layout_only = _all_meta(params)
        #: the communicate stage (raises unless dist is initialized); ``settings``: the algorithm's fixed schedule
        self._stage = None if self.layout_only else OnebitStage(process_group, settings)
        self._communicate = self._stage
        self.process_group = process_group
        super().__init__(params, defaults, **storage)
        if not self.layout_only:
            broadcast_parameters([p for group in self.param_groups for p in group["params"]], process_group)

    def error_nbytes_per_param(self, world_size: int | None = None) -> dict[torch.Tensor, int]:
        """Bytes of each parameter's fp32 error buffers at ``world_size`` ranks (default: the group's; meta: 2)."""
        if world_size is None:
            world_size = self._stage.world if self._stage is not None else 2
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        out: dict[torch.Tensor, int] = {}
        if world_size == 1:
            return out
        for group in self.param_groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue
            layout = Layout.of([p.numel() for p in params], world_size, [align_of(group, p) for p in params])
            for p, chunk in zip(params, layout.chunks):
                out[p] = 4 * (world_size + 1) * chunk
        return out

    def _check_group(self, group):
        check_adam_group(group)
        if group.get("rank") is not None:
            raise ValueError(f"{type(self).__name__} does not support GaLore param groups (rank=...)")
        if group.get("paged"):
            raise ValueError(f"{type(self).__name__} does not support paged=... state")
        if group.get("capturable"):
            raise ValueError(f"{type(self).__name__} does not support capturable=True")
        for p in group.get("params", ()):
            if is_dtensor(p):
                raise ValueError(
                    f"{type(self).__name__} does not support FSDP2 / DTensor parameters: it replicates "
                    "the model on every rank (data parallelism); shard with a plain optimizer instead"
                )
            if p.dtype != torch.float32:
                raise ValueError(
                    f"{type(self).__name__} needs fp32 parameters (got {p.dtype}): keep fp32 master "
                    "weights for mixed precision"
                )
        mask = group.get("exp_avg_mask")
        if mask is not None:
            if not isinstance(mask, torch.Tensor) or not mask.is_floating_point():
                raise TypeError(
                    f"exp_avg_mask must be a floating-point tensor, got {type(mask).__name__}"
                    + (f" of {mask.dtype}" if isinstance(mask, torch.Tensor) else "")
                )
            for p in group.get("params", ()):
                try:
                    fits = torch.broadcast_shapes(mask.shape, p.shape) == p.shape
                except RuntimeError:
                    fits = False
                if not fits:
                    raise ValueError(
                        f"exp_avg_mask of shape {tuple(mask.shape)} does not broadcast to the group's "
                        f"parameter of shape {tuple(p.shape)} (one mask per param group)"
                    )

    def next_phase(self) -> str:
        """The next step's phase of the first param group: what the DDP comm hook follows."""
        return self._stage.phase_of(self._plan(), 0)

    def register_ddp(self, ddp: torch.nn.parallel.DistributedDataParallel) -> None:
        """Register :func:`~lowmemopt.distributed.onebit.onebit_comm_hook` on ``ddp`` (it follows the phase)."""
        ddp.register_comm_hook(self, onebit_comm_hook)
        self._stage.ddp_reduces = True

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One step inside :func:`lowmemopt.pipeline.communicating` (gradients replaced, then given back)."""
        if self._stage is None:
            raise RuntimeError(
                f"{type(self).__name__} was built on meta parameters (a layout for state_nbytes / "
                "lowmemopt estimate) and cannot step; build it on the model's parameters with "
                "torch.distributed initialized"
            )
        return super().step(closure)

    #: ``lowmemopt.step_in_backward`` refuses these optimizers
    per_layer_updates = False

    def _step_some(self, work, flags=None):
        raise ValueError(
            f"{type(self).__name__} does not support per-layer updates (step_in_backward): its "
            "communication moves the whole model's momentum in one bucketed call per step"
        )

    # -- checkpoints ------------------------------------------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        """What is kept beside the state and the error buffers: the schedule's counters (the stage's)."""
        return {k: dict(v) if isinstance(v, dict) else v for k, v in self._stage.counters.items()}

    def _load_extra_state(self, extra: dict[str, Any]) -> None:
        self._stage.counters = {k: dict(v) if isinstance(v, dict) else v for k, v in extra.items()}

    #: ``lowmemopt.save_state`` writes one file per rank (the error buffers differ per rank)
    per_rank_files = True

    def file_extra(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """``save_state``'s extra part: the error buffers, their layouts, world size, rank and the counters."""
        errors = self._stage.errors_state()
        tensors, groups = {}, {}
        for key, entry in errors["groups"].items():
            tensors[f"__onebit__/{key}/worker_error"] = entry["worker_error"]
            tensors[f"__onebit__/{key}/server_error"] = entry["server_error"]
            groups[key] = dict(numels=entry["numels"], aligns=entry["aligns"])
        return dict(world=errors["world"], rank=errors["rank"], groups=groups, extra=self._extra_state()), tensors

    def load_file_extra(self, info: dict[str, Any] | None, tensors: dict[str, torch.Tensor]) -> None:
        """Restore :meth:`file_extra`'s part of a state file (``lowmemopt.load_state``)."""
        saved = None
        if info is not None:
            groups = {
                key: dict(
                    entry,
                    worker_error=tensors[f"__onebit__/{key}/worker_error"],
                    server_error=tensors[f"__onebit__/{key}/server_error"],
                )
                for key, entry in info.get("groups", {}).items()
            }
            saved = dict(world=info.get("world"), rank=info.get("rank"), groups=groups, extra=info.get("extra", {}))
        self._restore(saved)

    def _restore(self, saved: dict[str, Any] | None) -> None:
        self._load_extra_state((saved or {}).get("extra", {}))
        device = next((p.device for g in self.param_groups for p in g["params"]), torch.device("cpu"))
        why = self._stage.load_errors(saved, device)
        if why is not None:
            warnings.warn(
                f"{type(self).__name__}: the compression error buffers restart from zero: {why}",
                RuntimeWarning,
                stacklevel=3,
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict plus ``"onebit"``: this rank's error buffers (save one file per rank) and the counters."""
        sd = super().state_dict()
        sd["onebit"] = dict(self._stage.errors_state(), extra=self._extra_state())
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's part, the counters and this rank's error buffers (reset, warned, at another world size)."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("onebit", None)
        masks = [group.get("exp_avg_mask") for group in self.param_groups]
        super().load_state_dict(state_dict)
        for group, mask in zip(self.param_groups, masks):  # each keeps its own exp_avg_mask (or none), as DeepSpeed's
            group.pop("exp_avg_mask", None)
            if mask is not None:
                group["exp_avg_mask"] = mask
        self._restore(saved)


class OnebitAdam(OnebitOptimizer):
    """1-bit Adam with 32/16/8/4-bit state; DeepSpeed's ``OnebitAdam`` signature and defaults (docs/onebit.md).

    Args:
        freeze_step: the warm-up's length; later steps send the compressed momentum and freeze ``v``.
        bias_correction, eps_inside_sqrt: honoured (DeepSpeed ignores them). max_grad_norm, amsgrad: refused.
        process_group: the ranks (default: the world). state_bits, ...: the storage options.

    Needs ``torch.distributed`` initialized and fp32 parameters; no DDP wrapper (or :meth:`register_ddp`), FSDP2,
    GaLore, paging, capturable steps or ``step_in_backward``."""

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
        **storage: Unpack[StorageOptions],
    ) -> None:
        check_unsupported(type(self).__name__, amsgrad, max_grad_norm)
        defaults = dict(
            lr=lr,
            freeze_step=freeze_step,
            bias_correction=bias_correction,
            betas=betas,
            eps=eps,
            eps_inside_sqrt=eps_inside_sqrt,
            weight_decay=weight_decay,
        )
        super().__init__(params, defaults, process_group, **storage)

    def _check_group(self, group):
        super()._check_group(group)
        check_step_count("freeze_step", group["freeze_step"])


def _listed(params: Any) -> Any:
    if isinstance(params, torch.Tensor):
        return params  # (LowMemOptimizer raises its own TypeError)
    out = []
    for item in params:
        if isinstance(item, dict) and not isinstance(item.get("params"), (torch.Tensor, type(None))):
            item = {**item, "params": list(item["params"])}
        out.append(item)
    return out


def _all_meta(params: Any) -> bool:
    if isinstance(params, torch.Tensor):
        return False
    tensors = []
    for item in params:
        if isinstance(item, dict):
            ps = item.get("params")
            tensors.extend([ps] if isinstance(ps, torch.Tensor) else list(ps or ()))
        else:
            tensors.append(item)
    return bool(tensors) and all(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def check_unsupported(name: str, amsgrad: bool, max_grad_norm: float) -> None:
    """DeepSpeed's arguments that these optimizers refuse rather than ignore."""
    if amsgrad:
        raise ValueError(f"{name} does not support amsgrad=True (the variance is frozen after the warm-up)")
    if max_grad_norm:
        raise ValueError(
            f"{name}: max_grad_norm={max_grad_norm!r} is not supported (DeepSpeed accepted and "
            "ignored it); clip the gradients before step(), e.g. torch.nn.utils.clip_grad_norm_"
        )


def check_step_count(name: str, value: Any, least: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"Invalid {name}: {value!r} (must be an int >= {least})")
