"""The GaLore stage of the step pipeline: how a parameter of a param group with ``rank`` is updated.

::

    G_low = project(G)                       (refreshing the basis first when due; fp32, on G's device)
    state (low-rank shaped) -> decode -> delta_low = inner algorithm(p, G_low, state) -> encode
    p <- p * decay + alpha * scale * project_back(delta_low)        (row blocks; decay: the algorithm's own rule)

The inner algorithm is the optimizer's own (AdamW, Adafactor, CAME, LAMB, SGD, Lion, ...) running through the same
decode -> ``update`` -> encode core as an unprojected parameter (:func:`lowmemopt.pipeline.backends.run_update`), on slots
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

As stages of the step pipeline (:mod:`lowmemopt.pipeline`): :func:`check_fits` (before the step: the state still fits
the parameter's shape, :mod:`lowmemopt.pipeline.fits`), :func:`prepare` (gather: state, basis refresh),
:func:`project` (batched ``torch.bmm`` per shape class on CUDA), the update, and :func:`finish` / :func:`finish_many`
(unproject and apply). Where the inner math reads the parameter only for a coupled decay (:func:`param_free`: AdamW /
Adam, SGD, Lion), the update runs through the fused backends on a zeroed low-rank stand-in (:func:`stand_ins`) that
receives ``delta_low``. Where it reads the parameter only through one statistic of it and a decay it applies to it
(``weight_stat_math``: LAMB's and LARS's ``||p||``, Adafactor's ``RMS(p)`` and ``p -= a wd p``, CAME's
``p -= lr wd p``), the fused kernels (Triton; the native CPU kernels of Adafactor and CAME) run it on the stand-in,
given that statistic of the full weight (:func:`weights`: ``Item.weight``), and :func:`finish` applies the decay to
the full weight as the math would have. Everything else takes the reference core above (:func:`update_alone`).

Group keys (defaults filled in by :func:`check_group`): ``rank``, ``update_proj_gap=200``, ``scale=0.25``,
``proj_type="std"`` as in galore-torch and the HF Trainer, and lowmemopt's ``proj_svd="full" | "randomized"``,
``proj_moments="keep" | "reset" | "project"``, ``proj_stagger=False`` (see :mod:`.projector`) and
``proj_dtype="param" | "float32"``: the projection and back-projection products in the parameter's dtype where it is
bf16 (default; :func:`proj_dtype`: bf16 matmuls with fp32 accumulation, as galore-torch's AdamW; docs/galore.md), or
in fp32 (``GaLoreAdafactor``'s default, as galore-torch's Adafactor).

float64 parameters: the basis is computed (SVD of the gradient rounded to fp32) and stored in fp32, as for every
parameter and as galore-torch computes it; the products, the low-rank gradient, the inner math and its full-precision
state are float64 (the basis widened exactly), so a float64 GaLore step follows galore-torch's float64 one.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import torch

from .. import cpu, rounding
from ..distributed.galore import low_rank_layout, row_shards
from ..distributed.reduction import LOCAL
from ..distributed.sharding import local_tensor, reduction_of
from ..pipeline.backends import init_state, run_update, update_flat
from ..work.items import Item
from ..pipeline.fits import check_kahan, check_slots, where
from ..pipeline.plan import Plan, unscaled
from ..quant.formats import format_of, math_dtype
from ..rounding import KAHAN
from . import projector as pj
from .apply import finish
from .batched import finish_many, finished_in_batches, fused_apply, give_back, project, stand_ins

if TYPE_CHECKING:
    from ..quant.formats import Slot

__all__ = [
    "GROUP_DEFAULTS", "check_group", "check_values", "values_ok", "init_projected_state", "projected_slots",
    "step_projected", "prepare", "project",
    "param_free", "fused", "stands_in", "stand_ins", "weights", "update_alone", "finish", "finish_many", "inner_group",
    "device_checkable", "again", "refresh_due", "give_back", "check_fits", "check_step_values",
]

GROUP_DEFAULTS: dict[str, Any] = dict(
    update_proj_gap=200, scale=0.25, proj_type="std", proj_svd="full", proj_moments="keep", proj_stagger=False,
    proj_dtype="param",
)
SVD_METHODS = ("full", "randomized")
MOMENT_POLICIES = ("keep", "reset", "project")
PROJ_DTYPES = ("float32", "param")


def proj_dtype(group: dict[str, Any], p: torch.Tensor) -> torch.dtype | None:
    """The dtype of ``p``'s projection products: bf16 for a bf16 parameter of a group with ``proj_dtype="param"``
    (the default; the gradient and the basis cast to bf16, fp32 accumulation inside the matmul, the
    low-rank gradient and the update rounded to bf16 once), else None: fp32 products (``"float32"``; fp16 and fp32
    parameters: fp16's range is too narrow for products of gradients). The basis, its refresh (SVD) and the inner
    math stay fp32. float64 parameters: float64 (their products and math are float64, the fp32 basis widened;
    module docstring)."""
    if p.dtype == torch.float64:
        return torch.float64
    if group.get("proj_dtype", GROUP_DEFAULTS["proj_dtype"]) == "param" and p.dtype == torch.bfloat16:
        return torch.bfloat16
    return None


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
    each step that may write (:func:`check_fits`, :mod:`lowmemopt.pipeline.program`): a value set in the group after
    it was added is refused before anything changes, not half-way through the step."""
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


def values_ok(group: dict[str, Any]) -> bool:
    """Does GaLore group ``group`` pass :func:`check_values`? (A kept step program asks when a value changed.)"""
    try:
        check_values(group)
    except (TypeError, ValueError):
        return False
    return True


def _side(plan: Plan, group: dict[str, Any], p: torch.Tensor) -> int:
    state = plan.state.get(p)
    if state and pj.SIDE in state:
        return state[pj.SIDE]
    return pj.choose_side(group["proj_type"], *pj.matrix_shape(p.shape))


def projected_slots(plan: Plan, group: dict[str, Any], p: torch.Tensor) -> dict[str, Slot]:
    """The inner algorithm's slots for ``p``'s low-rank gradient, every one with an explicit shape (the algorithm's
    ``_slots`` asked about a tensor of the low-rank shape)."""
    m, n = pj.matrix_shape(p.shape)
    side = _side(plan, group, p)
    low, dims = low_rank_layout(p, pj.low_rank_shape(m, n, group["rank"], side), side)  # a DTensor: its local rows
    slots = plan.algorithm.slots(group, _meta(low, p.dtype))
    return {k: _low_rank_slot(s, low, dims) for k, s in slots.items()}


_METAS: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}
_LOW_RANK_SLOTS: dict[tuple, Any] = {}


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A meta tensor of this shape and dtype (no storage: what ``_slots`` is asked about), one per shape and dtype
    (a step asks for every projected matrix; making one costs more than the rest of the question)."""
    t = _METAS.get((shape, dtype))
    if t is None:
        t = _METAS[(shape, dtype)] = torch.empty(shape, dtype=dtype, device="meta")
    return t


def _low_rank_slot(s: Slot, low: tuple[int, ...], dims: tuple[int | None, ...]) -> Slot:
    """Slot ``s`` of the low-rank state: shaped ``low`` if it had the parameter's shape, its dims mapped by ``dims``
    (memoized by value: a few slots x shapes)."""
    key = (s, low, dims)
    try:
        shaped = _LOW_RANK_SLOTS.get(key)
    except TypeError:  # an algorithm's slot with unhashable fields (a list shape): not memoized
        key = shaped = None
    if shaped is None:
        shaped = s._replace(shape=low, dims=dims) if s.shape is None else s._replace(
            dims=None if s.dims is None else tuple(None if d is None else dims[d] for d in s.dims))
        if key is not None:
            _LOW_RANK_SLOTS[key] = shaped
    return shaped


def _stagger_offset(plan: Plan, p: torch.Tensor, gap: int) -> int:
    """``floor(i * gap / N)`` for the i-th of the N projected parameters (in param-group order)."""
    projected = [q for g in plan.groups if g.get("rank") is not None for q in g["params"]]
    i = next(i for i, q in enumerate(projected) if q is p)
    return i * gap // len(projected)


def _refresh(plan: Plan, p: torch.Tensor, g: torch.Tensor, state: dict, slots: dict[str, Slot],
             group: dict[str, Any], t: int) -> bool:
    """Recompute the basis from the fp32 matrix ``g`` at step ``t`` (before increment). Returns False if the
    parameter has no usable basis (its first refresh failed): the caller then skips the step."""
    gap = group["update_proj_gap"]
    new = pj.compute_basis(g, group["rank"], state[pj.SIDE], group["proj_svd"], seed=t)
    had_basis = state[pj.REFRESHED_AT] >= 0
    if new is None:
        plan.record.galore_refresh_failures += 1
        pj.warn_refresh_failed(plan.record, f"a parameter of shape {tuple(p.shape)} at step {t}")
        if not had_basis:
            return False
        state[pj.NEXT_REFRESH] = t + gap
        return True
    if had_basis and group["proj_moments"] != "keep":
        _carry_moments(state, slots, group, new)
    for key, value in new.items():
        state[key].copy_(value)
    if not had_basis and group["proj_stagger"]:
        offset = _stagger_offset(plan, p, gap)
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
            m = left.to(m.dtype) @ m  # (a float64 parameter's state: the fp32 bases widened)
        if right is not None:
            m = m @ right.to(m.dtype)
        fmt.encode(state, name, 0, numel, m.reshape(-1).contiguous(), True, bs)


def init_projected_state(plan: Plan, p: torch.Tensor, group: dict[str, Any],
                         slots: dict[str, Slot] | None = None) -> dict[str, Any]:
    """Make ``p``'s first GaLore state in ``plan.state[p]``: the inner algorithm's low-rank slots and an empty
    projector (also used, on a meta twin of ``p``, by :mod:`lowmemopt.paging` to learn the layout ahead)."""
    slots = projected_slots(plan, group, p) if slots is None else slots
    m, n = pj.matrix_shape(p.shape)
    # a DTensor's ranks agree on its stochastic-rounding seed (not the paging layout probe's meta twin)
    state = init_state(p, plan.record_of(group), slots, plan.state[p],
                       reduce=LOCAL if p.device.type == "meta" else reduction_of(p))
    pj.init_projector(state, m, n, group["rank"], pj.choose_side(group["proj_type"], m, n), p.device)
    return state


def inner_group(plan: Plan, group: dict[str, Any]) -> tuple[dict[str, Any], float]:
    """``(group the inner math runs with, decay factor of the full-rank parameter)``: an algorithm that adds
    ``wd * p`` to a gradient-shaped tensor gets ``weight_decay=0`` inside and the decoupled ``1 - lr wd`` outside
    (module docstring); every other algorithm its own group and ``_decay_factor``."""
    if group.get("weight_decay") and plan.algorithm.coupled_weight_decay(group):
        return dict(group, weight_decay=0.0), 1.0 - group["lr"] * group["weight_decay"]
    return group, plan.algorithm.decay_factor(group)


def prepare(plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any],
            inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]] | None = None) -> Item | None:
    """The pipeline's *gather* for a GaLore parameter: its state (made on the first step), the basis refreshed when
    due, and an :class:`~lowmemopt.work.items.Item` whose ``grad`` is not projected yet (:func:`project`) and
    whose ``target`` is not set. None: no basis yet (the first refresh failed), the step is skipped as for a
    non-finite gradient; or a zero-size parameter, whose step is counted and has nothing to update. ``inner``: a
    cache of the inner groups by group id, so the items of one param group share one inner group (one bucket). The
    item's ``group`` is the one its stand-in's math runs with (:func:`inner_group`, and no weight decay where the
    math decays the weight itself: :func:`finish` applies it to the full weight); ``extra["core"]`` the one the
    reference core runs with."""
    state = plan.state[p]
    if group.get("rank") is None:
        raise ValueError(
            f"a parameter of shape {tuple(p.shape)} has GaLore (low-rank) state but its param group has no 'rank'; "
            "keep the group's GaLore keys, or reset this parameter's state"
        )
    slots = projected_slots(plan, group, p)
    m, n = pj.matrix_shape(p.shape)
    if "step" not in state:
        if state:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} has full-rank optimizer state but its param group has "
                f"rank={group['rank']}; reset this parameter's state to project it"
            )
        init_projected_state(plan, p, group, slots)
    if p.numel() == 0:  # nothing to project or update, as for a plain zero-size parameter: the step counts; (the
        state["step"] += 1  # inner math's row / column means over an empty side would store NaN statistics)
        return None

    shards = row_shards(p, grad, m, n, state[pj.SIDE], group["rank"])  # a DTensor: its rows (distributed.galore)
    if shards is not None:  # bf16_update changed since: the ranks make the seed together
        rounding.init_state(state, shards.param, plan.record_of(group).rounding, shards.param_reduce.agree)
    m_local, row0 = (m, 0) if shards is None else (shards.m_local, shards.row0)
    g = _matrix(plan, grad if shards is None else shards.grad, m_local, n)  # in its dtype: project() makes it fp32
    t = state["step"]
    if t >= state[pj.NEXT_REFRESH]:
        full = g.float() if shards is None else shards.full_gradient()  # the basis comes from the whole gradient
        if not _refresh(plan, p, full, state, slots, group, t):
            return None  # no basis yet: skip this step, as for a non-finite gradient
        del full
    if inner is None:
        inner = {}
    group_in, core, decay = _inner(plan, group, inner)
    return Item(param=p, group=group_in, record=plan.record_of(group_in), target=None, grad=None, state=state,
                slots=slots, projected=True,
                extra=dict(g=g, shards=shards, m_local=m_local, n=n, row0=row0, decay=decay, outer=group, core=core,
                           math_decay=None, dtype=None if shards is not None else proj_dtype(group, p)))


def _matrix(plan: Plan, g: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Gradient ``g`` as the ``(m, n)`` matrix the projection reads, in its dtype; under loss scaling the gradient
    ``unscale_`` would leave (once per step)."""
    if plan.grad_mult is not None:
        g = unscaled(g, plan.mult(g.device)).to(g.dtype)
    return g if g.shape == (m, n) else g.reshape(m, n)


def _inner(plan: Plan, group: dict[str, Any], inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]]
           ) -> tuple[dict[str, Any], dict[str, Any], float]:
    """``(group the stand-in's math runs with, group the reference core runs with, decay factor)`` of a GaLore
    param group (:func:`inner_group`; no weight decay in the stand-in's math where :func:`finish` applies it to the
    full weight), made once per group and step in ``inner``."""
    made = inner.get(id(group))
    if made is None:
        core, decay = inner_group(plan, group)
        group_in = dict(core, weight_decay=0.0) if plan.algorithm.weight_stat_math and core.get("weight_decay") else core
        made = inner[id(group)] = group_in, core, decay
    return made


def again(plan: Plan, items: list[Item], grads: list[torch.Tensor]) -> None:
    """The gather of a later step for ``items`` that :func:`prepare` made (unsharded, no refresh due:
    :func:`refresh_due`), kept by a step program (:mod:`lowmemopt.pipeline.program`): this step's gradients
    (``grads``, the parameters' in the items' order) and inner groups (a scheduler's learning rate), nothing
    projected or stood in yet."""
    inner: dict[int, tuple[dict[str, Any], dict[str, Any], float]] = {}
    outer = group_in = core = decay = record = None
    for it, g in zip(items, grads):
        extra = it.extra
        if extra["outer"] is not outer:  # (the group's inner group and record: once per run of its items)
            outer = extra["outer"]
            group_in, core, decay = _inner(plan, outer, inner)
            record = plan.record_of(group_in)
        it.group, it.record, it.target, it.grad, it.weight = group_in, record, None, None, None
        extra["g"] = _matrix(plan, g, extra["m_local"], extra["n"])
        extra["core"], extra["decay"], extra["math_decay"] = core, decay, None


def refresh_due(states: list[dict[str, Any]]) -> bool:
    """Is a basis refresh due at this step for any of these projected parameters' states?"""
    return any(map(operator.ge, map(_step_of, states), map(_next_refresh_of, states)))


_step_of, _next_refresh_of = operator.itemgetter("step"), operator.itemgetter(pj.NEXT_REFRESH)


def param_free(plan: Plan) -> bool:
    """Can the inner algorithm run on a zeroed stand-in for the parameter (the low-rank update then lands in it)?
    True for a fused algorithm (``plan.fused``) whose math reads the parameter only
    for a coupled weight decay, which :func:`inner_group` takes out (``param_free_math``: AdamW / Adam, SGD, Lion).
    Algorithms that read statistics of the full parameter (LAMB's and LARS's ``||p||``, Adafactor's ``RMS(p)``) or
    decay it inside their math (Adafactor, CAME) take the reference core instead."""
    return plan.algorithm.param_free_math and plan.fused is not None


def fused(plan: Plan) -> bool:
    """Can the inner algorithm run on a stand-in through the fused kernels? :func:`param_free` algorithms through
    every backend; ``weight_stat_math`` ones (LAMB, LARS, Adafactor, CAME), given the full weight's statistic
    (:func:`weights`), through the kernels that take it: Triton, and the native CPU kernels of Adafactor and CAME
    (the per-tensor eager path would read the stand-in: those take the reference core)."""
    return (plan.algorithm.param_free_math or plan.algorithm.weight_stat_math) and plan.fused is not None


def stands_in(plan: Plan, it: Item) -> bool:
    """Does this item's update run on a stand-in (:func:`fused`)? Not a row shard of a DTensor whose math reads
    the weight (its statistics would need reductions over the shards): that one takes the reference core."""
    return param_free(plan) or (fused(plan) and it.extra["shards"] is None)


def weights(plan: Plan, items: list[Item]) -> None:
    """For an algorithm whose math reads the weight (``weight_stat_math``): each stand-in's full-weight statistic
    (``it.weight``: ``||p||`` or ``RMS(p) = ||p|| / sqrt(numel)``, :meth:`~lowmemopt.pipeline.algorithm.Algorithm.weight_statistic`)
    and the decay its math applies to the weight (``extra["math_decay"]``: ``c`` of ``p <- p + c p``), per shape class
    of a param group: one multi-tensor norm (``torch._foreach_norm``: one launch on CUDA; on the CPU the reference's
    ``vector_norm`` per tensor, so the statistic is bit-identical to the reference core's), one stack, one division."""
    if not plan.algorithm.weight_stat_math:
        return
    classes: dict[tuple, list[Item]] = {}
    for it in items:
        key = (id(it.extra["outer"]), it.state["step"] + 1, it.param.device, it.param.dtype, it.param.numel())
        classes.setdefault(key, []).append(it)
    for (_, step, _, p_dtype, numel), members in classes.items():
        group = members[0].extra["outer"]
        kind = plan.algorithm.weight_statistic(group)
        stat = None
        if kind is not None:
            stat = torch.stack(torch._foreach_norm([it.param for it in members], 2, dtype=math_dtype(p_dtype)))
            if kind == "rms":
                stat = stat / math.sqrt(numel)  # rms(): the norm over sqrt(numel) rounded to fp32, as for 0-dim
            for it, s in zip(members, stat.unbind(0)):
                it.weight = s
        c = plan.algorithm.math_decay(group, step, stat)
        for i, it in enumerate(members):
            it.extra["math_decay"] = c[i] if isinstance(c, torch.Tensor) and c.dim() else c


def device_checkable(plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any],
                     memo: dict[Any, bool] | None = None) -> bool:
    """May this step of projected parameter ``p`` leave its non-finite check to the device
    (:mod:`lowmemopt.pipeline.finite`)? Where every stage that writes is masked by the flags: no basis refresh due
    (it would take the SVD of the gradient), the update on a stand-in through the kernels, and the apply through the
    batched fused pass (:func:`finish_many`). Elsewhere the host decides first. ``memo``: the answers that depend on
    the plan, device and dtype only, kept by the caller for the parameters of one step."""
    if not ("step" in state and state[pj.REFRESHED_AT] >= 0 and state["step"] < state[pj.NEXT_REFRESH]
            and finished_in_batches(p, state, plan.record_of(group).rounding)):
        return False
    key = (p.device, p.dtype)
    ok = None if memo is None else memo.get(key)
    if ok is None:
        ok = fused(plan) and fused_apply(p.device, p.dtype)
        if memo is not None:
            memo[key] = ok
    return ok


def update_alone(plan: Plan, it: Item) -> bool:
    """The update stage of one projected item (after :func:`project`) through the per-tensor backends. With a
    stand-in (:func:`stands_in`): the backends of :func:`~lowmemopt.pipeline.backends.update_flat` for a
    :func:`param_free` algorithm, the native factored CPU kernels (:func:`lowmemopt.cpu.step_factored`, given the
    weight's statistic) for the others; returns True, and :func:`finish` then applies the stand-in's update. Else
    the reference core steps the item and finishes it (the math sees the full-rank fp32 parameter): False."""
    state = it.state
    if it.target is not None and param_free(plan):
        state["step"] += 1
        update_flat(plan.algorithm, it.target, it.target.view(-1), it.grad.view(-1), state, it.slots, it.record,
                               state["step"], 1.0)
        return True
    if it.target is not None and it.target.device.type == "cpu" and cpu.ENABLED:
        formats = {name: format_of(state, name) for name in it.slots}
        t = state["step"] + 1
        native = None if plan.kernels is None else plan.kernels.native
        if cpu.step_factored(native, it.target, it.target.view(-1), it.grad.view(-1), state,
                             formats, it.record, t, 1.0, weight=it.weight):
            state["step"] = t
            return True
    state["step"] += 1
    formats = {name: format_of(state, name) for name in it.slots}
    shards = it.extra["shards"]
    local = it.param if shards is None else shards.param
    p32 = (local if local.is_contiguous() else local.contiguous()).view(it.extra["m_local"], it.extra["n"])
    p32 = p32.to(math_dtype(p32.dtype))
    reduce = LOCAL if shards is None else shards.reduction(p32)
    g_low = it.grad
    delta, alpha = run_update(plan.algorithm, p32, g_low, state, it.slots, formats, plan.record_of(it.extra["core"]),
                              state["step"], 0,
                                         g_low.numel(), g_low, reduce)
    finish(plan, it, delta, alpha, p32)
    return False


def step_projected(plan: Plan, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
    """One GaLore step of parameter ``p`` (module docstring), alone: the pipeline's stages for one item, the update
    through the per-tensor backends (:func:`update_alone`). Called by :func:`lowmemopt.pipeline.step_param`."""
    it = prepare(plan, p, grad, group)
    if it is None:
        return
    project([it])
    if stands_in(plan, it) and (param_free(plan) or _native_may_take(plan, it)):
        stand_ins([it])
        weights(plan, [it])
    if update_alone(plan, it):
        finish(plan, it)


def _native_may_take(plan: Plan, it: Item) -> bool:
    """Is there a native CPU kernel for this stand-in's algorithm (Adafactor, CAME; it still checks the shape)?"""
    if it.grad.device.type != "cpu" or not cpu.ENABLED:
        return False
    from ..cpu.factored import FactoredStep

    return plan.kernels is not None and isinstance(plan.kernels.native, FactoredStep)


def check_step_values(plan: Plan, group: dict[str, Any], owner: str) -> None:
    """Before a step writes anything: raise ValueError / TypeError, naming the param group, if a GaLore key of
    ``group`` was set to a value it does not take after the group was added (:func:`check_values`)."""
    try:
        check_values(group)
    except (TypeError, ValueError) as e:
        index = next((i for i, g in enumerate(plan.groups) if g is group), "?")
        raise type(e)(f"{owner}: param group {index}: {e}; nothing was changed (set a valid value before the next "
                      "step)") from None


def check_fits(plan: Plan, p: torch.Tensor, group: dict[str, Any], state: dict[str, Any], owner: str) -> None:
    """Raise ValueError unless GaLore parameter ``p``'s ``state`` fits it (:mod:`lowmemopt.pipeline.fits`): its bases'
    sides match its matrix shape and its group's rank (a rank changed after the state was made is named as such), and
    its low-rank state that shape at the group's rank."""
    kahan = state.get(KAHAN)
    if kahan is not None:
        check_kahan(kahan, local_tensor(p).shape, lambda: where(plan, p), owner)
    m, n = pj.matrix_shape(p.shape)
    side, proj = state[pj.SIDE], state.get(pj.PROJ)
    right = state.get(pj.PROJ_RIGHT)
    for name, basis, dim, size in ((pj.PROJ, proj, 0 if side == pj.RIGHT else 1, n if side == pj.RIGHT else m),
                                   (pj.PROJ_RIGHT, right, 0, n)):
        if isinstance(basis, torch.Tensor) and (basis.dim() != 2 or basis.shape[dim] != size):  # (none yet: fits)
            raise ValueError(
                f"{owner}: the GaLore state of {where(plan, p)} was made for another tensor: its basis '{name}' "
                f"{tuple(basis.shape)} does not fit the parameter's shape {tuple(p.shape)} ({m} x {n} as a matrix). "
                "Was the parameter's .data replaced by a tensor of another shape? The state was left as it was: reset "
                "this parameter's state (del optimizer.state[p]) or give the parameter its shape back"
            )
    k = None if not isinstance(proj, torch.Tensor) else proj.shape[1] if side == pj.RIGHT else proj.shape[0]
    if k is not None and k != min(group["rank"], m, n):
        raise ValueError(
            f"{owner}: the GaLore state of {where(plan, p)} was made at rank {k} (a basis of {k} vectors of its {m} x "
            f"{n} matrix) but its param group now has rank={group['rank']}: a parameter's rank cannot change within "
            "a run. The state was left as it was: set the group's rank back, or reset this parameter's state (del "
            "optimizer.state[p]) to start it again at the new rank"
        )
    low = pj.low_rank_shape(m, n, group["rank"], side)
    check_slots(projected_slots(plan, group, p), torch.Size(low), state, plan.record_of(group).block_size,
                lambda: where(plan, p), owner,
                f"the parameter has shape {tuple(p.shape)}, whose low-rank state at rank {group['rank']} is {low[0]} x "
                f"{low[1]}")
