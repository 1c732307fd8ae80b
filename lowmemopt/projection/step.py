"""The GaLore step of a :class:`~lowmemopt.LowMemOptimizer`: how a parameter of a param group with ``rank`` is updated.

::

    G_low = project(G)                       (refreshing the basis first when due; fp32, on G's device)
    state (low-rank shaped) -> decode -> delta_low = inner algorithm(p, G_low, state) -> encode
    p <- p * decay + alpha * scale * project_back(delta_low)        (row blocks; decay: the algorithm's own rule)

The inner algorithm is the optimizer's own (AdamW, Adafactor, CAME, LAMB, SGD, Lion, ...) running through the same
decode -> ``_update`` -> encode core as an unprojected parameter (:meth:`LowMemOptimizer._run_update`), on slots
declared for the low-rank shape: ``state_bits`` (16, 8) applies to them as to any slot, and Adafactor / CAME factor
the low-rank matrix. Only the gradient is projected. The parameter the inner math sees is the **full-rank** fp32
parameter: statistics of the parameter (Adafactor's RMS(p), LAMB's and LARS's ||p||) are the real ones, and weight
decay applies to the full-rank parameter and is never projected:

* decoupled decay (AdamW, Lion, ``GaLoreAdamW``'s decay after the update) through the algorithm's ``_decay_factor`` /
  ``_apply_update`` on the full parameter;
* decay inside the math (Adafactor, CAME: ``p -= a wd p``) on the full parameter, as the math does it;
* algorithms that add ``wd * p`` to a gradient-shaped tensor (SGD, Adam with L2, LAMB, LARS): that term cannot be
  added to a low-rank tensor, so for projected parameters their weight decay becomes the decoupled
  ``p <- p (1 - lr wd)`` on the full parameter (for SGD without momentum this is the same as L2).

Group keys (defaults filled in by :func:`check_group`): ``rank``, ``update_proj_gap=200``, ``scale=0.25``,
``proj_type="std"`` as in galore-torch and the HF Trainer, and lowmemopt's ``proj_svd="full" | "randomized"``,
``proj_moments="keep" | "reset" | "project"`` and ``proj_stagger=False`` (see :mod:`.projector`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import rounding
from ..distributed.galore import low_rank_layout, row_shards
from ..distributed.reduction import LOCAL
from ..optimizer import CHUNK_NUMEL, LowMemOptimizer, Slot
from ..quant.formats import format_of
from . import projector as pj

__all__ = ["GROUP_DEFAULTS", "check_group", "init_projected_state", "projected_slots", "step_projected"]

GROUP_DEFAULTS: dict[str, Any] = dict(
    update_proj_gap=200, scale=0.25, proj_type="std", proj_svd="full", proj_moments="keep", proj_stagger=False
)
SVD_METHODS = ("full", "randomized")
MOMENT_POLICIES = ("keep", "reset", "project")


def check_group(group: dict[str, Any]) -> None:
    """Fill in a GaLore group's missing keys and validate them and its params (ValueError / TypeError)."""
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
    for i, p in enumerate(group["params"]):
        if p.dim() < 2:
            raise ValueError(
                f"rank={rank} on a {p.dim()}-D parameter (param {i} of the group, shape {tuple(p.shape)}): GaLore "
                "projects matrices; put biases and norm weights in a group without rank "
                "(lowmemopt.galore_param_groups does this)"
            )


def _side(optimizer: LowMemOptimizer, group: dict[str, Any], p: torch.Tensor) -> int:
    state = optimizer.state.get(p)
    if state and pj.SIDE in state:
        return state[pj.SIDE]
    return pj.choose_side(group["proj_type"], *pj.matrix_shape(p.shape))


def projected_slots(optimizer: LowMemOptimizer, group: dict[str, Any], p: torch.Tensor) -> dict[str, Slot]:
    """The inner algorithm's slots for ``p``'s low-rank gradient, every one with an explicit shape (the algorithm's
    ``_slots`` asked about a tensor of the low-rank shape)."""
    m, n = pj.matrix_shape(p.shape)
    side = _side(optimizer, group, p)
    low, dims = low_rank_layout(p, pj.low_rank_shape(m, n, group["rank"], side), side)  # a DTensor: its local rows
    slots = optimizer._slots(group, torch.empty(low, dtype=p.dtype, device="meta"))
    return {
        k: s._replace(shape=low, dims=dims) if s.shape is None
        else s._replace(dims=None if s.dims is None else tuple(None if d is None else dims[d] for d in s.dims))
        for k, s in slots.items()
    }


def _coupled_decay(optimizer: LowMemOptimizer, group: dict[str, Any]) -> bool:
    """Does the algorithm add ``wd * p`` to a gradient-shaped tensor (so that it becomes decoupled here)?"""
    from ..optim import LAMB, LARS, SGD, Adam

    if isinstance(optimizer, (SGD, LAMB, LARS)):
        return True
    return isinstance(optimizer, Adam) and not group.get("decoupled_weight_decay", True)


def _stagger_offset(optimizer: LowMemOptimizer, p: torch.Tensor, gap: int) -> int:
    """``floor(i * gap / N)`` for the i-th of the N projected parameters (in param-group order)."""
    projected = [q for g in optimizer.param_groups if g.get("rank") is not None for q in g["params"]]
    i = next(i for i, q in enumerate(projected) if q is p)
    return i * gap // len(projected)


def _refresh(optimizer: LowMemOptimizer, p: torch.Tensor, g: torch.Tensor, state: dict, slots: dict[str, Slot],
             group: dict[str, Any], t: int) -> bool:
    """Recompute the basis from the fp32 matrix ``g`` at step ``t`` (before increment). Returns False if the
    parameter has no usable basis (its first refresh failed): the caller then skips the step."""
    gap = group["update_proj_gap"]
    new = pj.compute_basis(g, group["rank"], state[pj.SIDE], group["proj_svd"], seed=t)
    had_basis = state[pj.REFRESHED_AT] >= 0
    if new is None:
        optimizer.galore_refresh_failures = getattr(optimizer, "galore_refresh_failures", 0) + 1
        pj.warn_refresh_failed(optimizer, f"a parameter of shape {tuple(p.shape)} at step {t}")
        if not had_basis:
            return False
        state[pj.NEXT_REFRESH] = t + gap
        return True
    if had_basis and group["proj_moments"] != "keep":
        _carry_moments(state, slots, group, new)
    for key, value in new.items():
        state[key].copy_(value)
    if not had_basis and group["proj_stagger"]:
        offset = _stagger_offset(optimizer, p, gap)
        state[pj.NEXT_REFRESH] = t + (offset if offset > 0 else gap)
    else:
        state[pj.NEXT_REFRESH] = t + gap
    state[pj.REFRESHED_AT] = t
    return True


def _carry_moments(state: dict, slots: dict[str, Slot], group: dict[str, Any], new: dict[str, torch.Tensor]) -> None:
    """Apply the ``proj_moments`` policy ("reset" or "project") before the basis changes to ``new``."""
    bs = group["block_size"]
    if group["proj_moments"] == "reset":
        for name in slots:
            for key in format_of(state, name).keys(name):
                state[key].zero_()
        return
    left, right = pj.change_of_basis(state, dict(new, **{pj.SIDE: state[pj.SIDE]}))
    for name, slot in slots.items():
        if not slot.signed:
            continue  # non-negative statistics have no linear change of basis
        fmt = format_of(state, name)
        numel = math.prod(slot.shape)
        m = fmt.decode(state, name, 0, numel, True, bs).view(slot.shape)
        if left is not None:
            m = left @ m
        if right is not None:
            m = m @ right
        fmt.encode(state, name, 0, numel, m.reshape(-1).contiguous(), True, bs)


def init_projected_state(optimizer: LowMemOptimizer, p: torch.Tensor, group: dict[str, Any],
                         slots: dict[str, Slot] | None = None) -> dict[str, Any]:
    """Make ``p``'s first GaLore state in ``optimizer.state[p]``: the inner algorithm's low-rank slots and an empty
    projector (also used, on a meta twin of ``p``, by :mod:`lowmemopt.paging` to learn the layout ahead)."""
    slots = projected_slots(optimizer, group, p) if slots is None else slots
    m, n = pj.matrix_shape(p.shape)
    state = optimizer._init_state(p, group, slots)
    pj.init_projector(state, m, n, group["rank"], pj.choose_side(group["proj_type"], m, n), p.device)
    return state


def step_projected(optimizer: LowMemOptimizer, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
    """One GaLore step of parameter ``p`` (module docstring). Called by ``LowMemOptimizer._step_param``."""
    state = optimizer.state[p]
    if group.get("rank") is None:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} has GaLore (low-rank) state but its param group has no 'rank'; "
            "keep the group's GaLore keys, or reset this parameter's state"
        )
    slots = projected_slots(optimizer, group, p)
    m, n = pj.matrix_shape(p.shape)
    if "step" not in state:
        if state:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has full-rank optimizer state but its param group has "
                f"rank={group['rank']}; reset this parameter's state to project it"
            )
        init_projected_state(optimizer, p, group, slots)

    shards = row_shards(p, grad, m, n, state[pj.SIDE], group["rank"])  # a DTensor: its rows (distributed.galore)
    m_local, row0 = (m, 0) if shards is None else (shards.m_local, shards.row0)
    g = (grad if shards is None else shards.grad).reshape(m_local, n).float()
    t = state["step"]
    if t >= state[pj.NEXT_REFRESH]:
        full = g if shards is None else shards.full_gradient()  # the basis comes from the whole gradient
        if not _refresh(optimizer, p, full, state, slots, group, t):
            return  # no basis yet: skip this step, as for a non-finite gradient
        del full
    g_low = pj.project(g, state) if shards is None else shards.project(g, state, pj.bases)

    state["step"] = t + 1
    step = t + 1
    formats = {name: format_of(state, name) for name in slots}
    inner = group
    decay = optimizer._decay_factor(group)
    if group.get("weight_decay") and _coupled_decay(optimizer, group):
        inner = dict(group, weight_decay=0.0)
        decay = 1.0 - group["lr"] * group["weight_decay"]

    local = p if shards is None else shards.param
    target = local if local.is_contiguous() else local.contiguous()
    p2d = target.view(m_local, n)
    p32 = p2d.float()  # fp32 params: p itself; the inner math may read it (RMS, norms) and decay it in place
    reduce = LOCAL if shards is None else shards.reduction(p32)
    delta, alpha = optimizer._run_update(p32, g_low, state, slots, formats, inner, step, 0, g_low.numel(), g_low,
                                         reduce)
    rows = max(1, CHUNK_NUMEL // max(n, 1))
    scale = group["scale"]
    for r0 in range(0, m_local, rows):
        r1 = min(m_local, r0 + rows)
        update = pj.project_back_rows(delta, state, r0, r1, row0).mul_(scale)
        optimizer._apply_update(p32[r0:r1], update, alpha, decay, group)
    rounding.store(p2d, p32, state, group)  # bf16 params: the group's bf16_update (a copy unless fp32)
    if target is not local:
        local.copy_(target)
