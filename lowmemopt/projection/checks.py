"""GaLore's checks: a projected group's keys (defaults filled in, values validated) and, before a step, whether each
parameter's low-rank state still fits it. The group keys are listed in docs/galore.md."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..distributed.sharding import local_tensor
from ..pipeline.fits import check_kahan, check_slots, where
from ..pipeline.plan import Plan
from ..rounding import KAHAN
from . import projector as pj
from . import storage
from .state import projected_slots

__all__ = [
    "GROUP_DEFAULTS",
    "check_group",
    "check_values",
    "group_values_valid",
    "check_group_values",
    "check_low_rank_state",
]

GROUP_DEFAULTS: dict[str, Any] = dict(
    update_proj_gap=200,
    scale=0.25,
    proj_type="std",
    proj_svd="full",
    proj_moments="keep",
    proj_stagger=False,
    proj_dtype="param",
    proj_bits=32,
)
SVD_METHODS = ("full", "randomized")
MOMENT_POLICIES = ("keep", "reset", "project")
PROJ_DTYPES = ("float32", "param")


def check_group(group: dict[str, Any]) -> None:
    """Fill in a GaLore group's missing keys and validate them and its params (ValueError / TypeError)."""
    check_values(group)
    for i, p in enumerate(group["params"]):
        if p.dim() < 2:
            raise ValueError(
                f"rank={group['rank']} on a {p.dim()}-D parameter (param {i} of the group, shape {tuple(p.shape)}): "
                "GaLore projects matrices; put biases and norm weights in a group without rank "
                "(lowmemopt.galore_param_groups does this)"
            )


def check_values(group: dict[str, Any]) -> None:
    """Fill in a GaLore group's missing keys and validate their values (ValueError / TypeError). Also run before
    each step that may write (:func:`check_group_values`, :mod:`lowmemopt.pipeline.program`): a value set in the
    group after it was added is refused before anything changes, not half-way through the step."""
    for key, value in GROUP_DEFAULTS.items():
        group.setdefault(key, value)
    rank = group["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"Invalid rank: expected a positive int, got {type(rank).__name__} {rank!r}")
    if rank <= 0:
        raise ValueError(f"Invalid rank: {rank} (must be a positive int)")
    gap = group["update_proj_gap"]
    if isinstance(gap, bool) or not isinstance(gap, int) or gap < 1:
        raise ValueError(f"Invalid update_proj_gap: {gap!r} (must be an int >= 1)")
    scale = group["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"Invalid scale: expected a number, got {type(scale).__name__}")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"Invalid scale: {scale} (must be a finite number > 0)")
    if group["proj_type"] not in pj.PROJ_TYPES:
        raise ValueError(f"Invalid proj_type: {group['proj_type']!r} (expected one of {', '.join(pj.PROJ_TYPES)})")
    if group["proj_svd"] not in SVD_METHODS:
        raise ValueError(f"Invalid proj_svd: {group['proj_svd']!r} (expected one of {', '.join(SVD_METHODS)})")
    if group["proj_moments"] not in MOMENT_POLICIES:
        raise ValueError(
            f"Invalid proj_moments: {group['proj_moments']!r} (expected one of {', '.join(MOMENT_POLICIES)})"
        )
    if not isinstance(group["proj_stagger"], bool):
        raise TypeError(f"Invalid proj_stagger: expected a bool, got {type(group['proj_stagger']).__name__}")
    if group["proj_dtype"] not in PROJ_DTYPES:
        raise ValueError(f"Invalid proj_dtype: {group['proj_dtype']!r} (expected one of {', '.join(PROJ_DTYPES)})")
    bits = group["proj_bits"]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in storage.PROJ_BITS:
        raise ValueError(f"Invalid proj_bits: {bits!r} (expected one of {', '.join(map(str, storage.PROJ_BITS))})")


def group_values_valid(group: dict[str, Any]) -> bool:
    """Does GaLore group ``group`` pass :func:`check_values`? (A kept step program asks when a value changed.)"""
    try:
        check_values(group)
    except (TypeError, ValueError):
        return False
    return True


def check_group_values(plan: Plan, group: dict[str, Any], owner: str) -> None:
    """Before a step writes anything: raise ValueError / TypeError, naming the param group, if a GaLore key of
    ``group`` was set to a value it does not take after the group was added (:func:`check_values`)."""
    try:
        check_values(group)
    except (TypeError, ValueError) as e:
        index = next((i for i, g in enumerate(plan.groups) if g is group), "?")
        raise type(e)(
            f"{owner}: param group {index}: {e}; nothing was changed (set a valid value before the next step)"
        ) from None


def check_low_rank_state(plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], owner: str) -> None:
    """Raise ValueError unless GaLore parameter ``p``'s ``state`` fits it (:mod:`lowmemopt.pipeline.fits`): its bases'
    sides match its matrix shape and its group's rank (a rank changed after the state was made is named as such), and
    its low-rank state that shape at the group's rank."""
    kahan = state.get(KAHAN)
    if kahan is not None:
        check_kahan(kahan, local_tensor(p).shape, lambda: where(plan, p), owner)
    m, n = pj.matrix_shape(p.shape)
    side, proj = state[pj.SIDE], state.get(pj.PROJ)
    right = state.get(pj.PROJ_RIGHT)
    for name, basis, dim, size in (
        (pj.PROJ, proj, 0 if side == pj.RIGHT else 1, n if side == pj.RIGHT else m),
        (pj.PROJ_RIGHT, right, 0, n),
    ):
        if isinstance(basis, torch.Tensor) and (basis.dim() != 2 or basis.shape[dim] != size):  # (none yet: fits)
            raise ValueError(
                f"{owner}: the GaLore state of {where(plan, p)} was made for another tensor: its basis '{name}' "
                f"{tuple(basis.shape)} does not fit the parameter's shape {tuple(p.shape)} ({m} x {n} as a matrix). "
                "Was the parameter's .data replaced by a tensor of another shape? The state was left as it was: reset "
                "this parameter's state (del optimizer.state[p]) or give the parameter its shape back"
            )
    if proj is None and not all(  # stored at 8 or 4 bits: the codes' sizes
        storage.fits(state, key, shape) for key, shape in pj.basis_shapes(m, n, group["rank"], side).items()
    ):
        problem = pj.projector_problem(pj.split_projector_state(state)[0], group, p.shape)
        if problem is not None:
            raise ValueError(
                f"{owner}: the GaLore state of {where(plan, p)} does not fit the parameter's shape {tuple(p.shape)} "
                f"at rank={group['rank']}: {problem}. Was the parameter's .data replaced, or the group's rank changed? "
                "The state was left as it was: reset this parameter's state (del optimizer.state[p])"
            )
    k = None if not isinstance(proj, torch.Tensor) else proj.shape[1] if side == pj.RIGHT else proj.shape[0]
    if k is not None and k != min(group["rank"], m, n):
        raise ValueError(
            f"{owner}: the GaLore state of {where(plan, p)} was made at rank {k} (a basis of {k} vectors of its {m} x "
            f"{n} matrix) but its param group now has rank={group['rank']}: a parameter's rank cannot change within "
            "a run. The state was left as it was: set the group's rank back, or reset this parameter's state (del "
            "optimizer.state[p]) to start it regather at the new rank"
        )
    low = pj.low_rank_shape(m, n, group["rank"], side)
    check_slots(
        projected_slots(plan, group, p),
        torch.Size(low),
        state,
        plan.record_of(group).block_size,
        lambda: where(plan, p),
        owner,
        f"the parameter has shape {tuple(p.shape)}, whose low-rank state at rank {group['rank']} is {low[0]} x "
        f"{low[1]}",
    )
