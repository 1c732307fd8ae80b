"""APOLLO (Zhu et al. 2024) matching ``apollo_torch.APOLLOAdamW``: AdamW's moments kept in a random rank-``r``
projection ``R`` of the gradient, used only to scale the raw gradient channel- or tensor-wise, with Fira's norm-growth
limiter; the math is :mod:`.apollo_math`. The update, the seeds, memory and FSDP2: docs/apollo.md.

    m = b1 m + (1 - b1) R;  v = b2 v + (1 - b2) R^2;  s = ||m / (sqrt(v) + eps)|| / (||R|| + 1e-8)  (channel or tensor)
    U = limit(G s);  W <- W - lr sqrt(1 - b2^t) / (1 - b1^t) U;  W <- W - lr wd W
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch

from ..checks import check_adam_group, check_nonneg
from ..distributed.reduction import LOCAL, Reduction, ShardedReduction
from ..distributed.sharding import local_tensor
from ..distributed.whole import row_block, whole_tensor
from ..optimizer import LowMemOptimizer
from ..pipeline.algorithm import Algorithm
from ..quant.formats import Slot
from . import apollo_math as am
from .hf_adamw import hf_adamw_math

if TYPE_CHECKING:  # (the storage keywords, for editors and type checkers: lowmemopt.signature)
    from typing_extensions import Unpack

    from ..signature import StorageOptions

__all__ = ["APOLLOAdamW", "APOLLOAlgorithm", "apollo_param_groups", "GROUP_DEFAULTS"]

#: an APOLLO group's keys and their defaults (the HF Trainer's for ``optim="apollo_adamw"``); ``rank`` is given
GROUP_DEFAULTS = dict(proj="random", scale_type="channel", update_proj_gap=200, scale=1.0, proj_type="std")
#: a param group's ``rank`` is held under this key: lowmemopt's GaLore stage projects groups with ``rank``
RANK = "apollo_rank"
#: the step's view of a param group carries the parameter's seed and its whole shape (a DTensor's local part has
#: another) under these keys (:meth:`APOLLOAlgorithm.step_work`)
SEED, SHAPE = "apollo.seed", "apollo.shape"
PROJ_TYPES = ("std", "reverse_std", "left", "right")


class APOLLOAlgorithm(Algorithm):
    """APOLLO for the step pipeline; transformers' AdamW for groups without a rank. Bound to an optimizer
    (``owner``) it gives each projected parameter its seed (:meth:`step_work`)."""

    elementwise = False  # the projection and the scaling factor need the whole matrix

    def __init__(self, owner: "APOLLOAdamW | None" = None) -> None:
        self._owner = None if owner is None else weakref.ref(owner)

    def slots(self, group, param):
        if group.get(RANK) is None:
            return {"exp_avg": Slot(signed=True), "exp_avg_sq": Slot(signed=False)}
        m, n = group.get(SHAPE, param.shape)  # the whole matrix's (param: a shard's local part, or the whole)
        rank = group[RANK]
        side = am.side_of(group["proj_type"], m, n)
        low = am.projected_shape(side, param.shape[0], n, rank)  # (row-sharded: the local rows, side right)
        dims = (None, 1) if side == am.LEFT else (0, None)
        one = Slot(signed=False, quantize=False, shape=(1,), dims=(None,))
        slots = {
            "exp_avg": Slot(signed=True, shape=low, dims=dims),
            "exp_avg_sq": Slot(signed=False, shape=low, dims=dims),
            "apollo.norm": one,
        }
        if group["proj"] == "svd":
            shape = am.projection_shape(side, m, n, rank)
            slots["apollo.proj"] = Slot(signed=True, quantize=False, shape=shape, dims=(None, None))
        return slots

    def step_work(self, work, grad_mult=None):
        """Each projected parameter with a view of its group holding its seed (its 1-based position) and whole shape."""
        owner = None if self._owner is None else self._owner()
        if owner is None or not any(group.get(RANK) is not None for _, group in work):
            return work
        index = {id(p): i for i, p in enumerate((p for g in owner.param_groups for p in g["params"]), 1)}
        return [
            (p, {**group, SEED: index[id(p)], SHAPE: tuple(p.shape)}) if group.get(RANK) is not None else (p, group)
            for p, group in work
        ]

    def update(self, p, g, state, group, step, reduce: Reduction = LOCAL):
        beta1, beta2 = group["betas"]
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2**step) / (1.0 - beta1**step)
        if group.get(RANK) is None:
            return hf_adamw_math(p, g, state, betas=group["betas"], eps=group["eps"], step_size=step_size)
        m, n = group.get(SHAPE, p.shape)
        rank, side = group[RANK], am.side_of(group["proj_type"], m, n)
        proj = self._projection(g, state, group, step, side, reduce)
        low, low_reduce = _project(g, proj, side, rank, reduce)
        norm_grad, alpha = hf_adamw_math(p, low, state, betas=group["betas"], eps=group["eps"], step_size=step_size)
        u = g * am.scaling_factor(norm_grad, low, group["scale_type"], 0 if m < n else 1, low_reduce)
        root = math.sqrt(group["scale"])
        if group["scale_front"]:
            u = u * root
        if not group["disable_nl"]:
            u = am.limit_norm_growth(u, state["apollo.norm"], step == 1, reduce)
        if not group["scale_front"]:
            u = u * root
        return u, alpha

    @staticmethod
    def _projection(
        g: torch.Tensor, state: dict[str, torch.Tensor], group: dict[str, Any], step: int, side: int, reduce: Reduction
    ) -> torch.Tensor:
        """This step's whole projection: regenerated from the seed, or the SVD basis (refreshed when due, from the
        gathered gradient); fp32 values in the gradient's dtype."""
        due, refreshes = am.refresh_due_at(step, group["update_proj_gap"])
        m, n = group.get(SHAPE, g.shape)
        shape = am.projection_shape(side, m, n, group[RANK])
        if group["proj"] == "svd":
            proj = state["apollo.proj"]
            if due:  # (in fp32, as apollo-torch: a float64 gradient's basis is fp32's, widened)
                proj.copy_(am.svd_projection(whole_tensor(g, reduce).float(), side, group[RANK]))
            return am.lapack_layout(proj)
        seed = group.get(SEED)
        if seed is None:
            raise RuntimeError(
                "APOLLOAdamW: a projected parameter stepped without its seed (its position among the "
                "optimizer's parameters): step through optimizer.step() or step_in_backward"
            )
        proj = am.random_projection(shape, am.projection_seed(seed, refreshes), group[RANK], g.device)
        return proj.to(g.dtype)  # (float64: fp32 values widened, as apollo-torch's)

    def apply_update(self, p32, delta, alpha, decay, group):
        p32.add_(delta, alpha=alpha)
        if group["weight_decay"] > 0.0:  # after the update, as transformers' legacy AdamW
            p32.add_(p32, alpha=-group["lr"] * group["weight_decay"])


def _project(
    g: torch.Tensor, proj: torch.Tensor, side: int, rank: int, reduce: Reduction
) -> tuple[torch.Tensor, Reduction]:
    """The projected gradient of ``g`` (a row shard: side left sums over the shards)."""
    if not reduce.distributed:
        return am.apply_projection(g, proj, side), LOCAL
    row0, rows = row_block(reduce, "APOLLO")
    if side == am.RIGHT:
        m = reduce.shape[0]
        return am.apply_projection(g, proj, side), ShardedReduction(
            reduce.mesh, reduce.placements, torch.Size((m, rank))
        )
    low = am.apply_projection(g, proj[row0 : row0 + rows], side)
    reduce.sum_over(low, 0)
    return low, LOCAL


class APOLLOAdamW(LowMemOptimizer):
    """APOLLO with 32/16/8/4-bit moments; the signature, group keys, defaults, seeds and 32-bit results of
    ``apollo_torch.APOLLOAdamW``.

    Args:
        params: param groups; one with ``rank`` is projected, with the keys ``proj`` ("random" | "svd"), ``scale_type``
            ("channel" | "tensor"), ``update_proj_gap``, ``scale``, ``proj_type`` (:func:`apollo_param_groups`).
        correct_bias: ``sqrt(1 - b2^t) / (1 - b1^t)``. scale_front: ``sqrt(scale)`` before the limiter. disable_nl: no
            limiter (both also group keys). no_deprecation_warning: accepted, ignored.
        state_bits, ...: the storage options (``state_bits``: the moments').

    A group's ``rank`` is held as ``apollo_rank`` in ``param_groups`` (``rank`` is GaLore's)."""

    algorithm = APOLLOAlgorithm()
    #: a projected group's keys (its rank held as apollo_rank: lowmemopt.group_keys refuses any other)
    _extra_group_keys = frozenset({RANK, *GROUP_DEFAULTS})

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        correct_bias: bool = True,
        scale_front: bool = False,
        disable_nl: bool = False,
        no_deprecation_warning: bool = True,
        **storage: Unpack[StorageOptions],
    ) -> None:
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            correct_bias=correct_bias,
            scale_front=scale_front,
            disable_nl=disable_nl,
        )
        super().__init__(params, defaults, **storage)

    def _attach(self) -> None:
        super()._attach()
        self.algorithm = APOLLOAlgorithm(self)  # gives projected parameters their seeds

    def _slots(self, group, param):
        if group.get(RANK) is not None:
            group = {**group, SHAPE: tuple(param.shape)}
        return self.algorithm.slots(group, local_tensor(param))

    def _state_slots(self, group, p):
        return self._slots(group, p)

    def _step_some(self, work, flags=None):
        super()._step_some(self.algorithm.step_work(work), flags)  # (per-layer updates: the seeds too)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if isinstance(param_group, dict) and param_group.get("rank") is not None:  # (held as apollo_rank)
            rest = {k: v for k, v in param_group.items() if k != "rank"}
            param_group = {**GROUP_DEFAULTS, **rest, RANK: param_group["rank"]}
        super().add_param_group(param_group)

    def _check_group(self, group):
        check_adam_group(group)
        for key in ("correct_bias", "scale_front", "disable_nl"):
            if not isinstance(group[key], bool):
                raise TypeError(f"Invalid {key}: expected a bool, got {type(group[key]).__name__}")
        if group.get(RANK) is None:
            return
        rank = group[RANK]
        if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"Invalid rank: {rank!r} (a positive int)")
        if group["proj"] not in ("random", "svd"):
            raise ValueError(f"Invalid proj: {group['proj']!r} ('random' or 'svd')")
        if group["scale_type"] not in ("channel", "tensor"):
            raise ValueError(f"Invalid scale_type: {group['scale_type']!r} ('channel' or 'tensor')")
        gap = group["update_proj_gap"]
        if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
            raise ValueError(f"Invalid update_proj_gap: {gap!r} (an int >= 1)")
        check_nonneg("scale", group["scale"])
        if group["proj_type"] not in PROJ_TYPES:
            raise ValueError(f"Invalid proj_type: {group['proj_type']!r} (one of {', '.join(PROJ_TYPES)})")
        for p in group.get("params", ()):
            if p.dim() != 2:
                raise ValueError(
                    f"APOLLO: rank={rank} on a parameter of shape {tuple(p.shape)}: projected groups "
                    "hold 2-D matrices; put the others in a group without rank "
                    "(lowmemopt.apollo_param_groups does this)"
                )
            problem = am.check_factor_shape(
                tuple(p.shape), am.side_of(group["proj_type"], *p.shape), rank, group["scale_type"]
            )
            if problem:
                raise ValueError(f"APOLLO: {problem}")


def apollo_param_groups(
    model: torch.nn.Module,
    rank: int,
    target_modules: str | Sequence[str] = "all-linear",
    *,
    proj: str = "random",
    scale_type: str = "channel",
    update_proj_gap: int = 200,
    scale: float = 1.0,
    proj_type: str = "std",
    weight_decay: float | None = None,
) -> list[dict[str, Any]]:
    """Param groups for :class:`APOLLOAdamW`: the selected ``nn.Linear`` weights in one group with ``rank`` and the
    APOLLO keys, every other trainable parameter in plain (AdamW) groups. ``target_modules``, ``weight_decay``: as
    :func:`lowmemopt.galore_param_groups`. APOLLO-Mini: ``rank=1, scale_type="tensor"`` and a large ``scale`` (128)."""
    from ..projection import galore_param_groups

    groups = galore_param_groups(
        model,
        target_modules,
        rank=rank,
        update_proj_gap=update_proj_gap,
        scale=scale,
        proj_type=proj_type,
        weight_decay=weight_decay,
    )
    for group in groups:
        if "rank" in group:
            group.update(proj=proj, scale_type=scale_type)
    return groups
