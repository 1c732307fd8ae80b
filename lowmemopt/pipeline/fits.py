"""Does each parameter's optimizer state still fit it? :func:`check_state_fits` raises before a step changes anything
(state sized for another shape or ``block_size``, a gradient of another shape or dtype, invalid GaLore group values).
Why, and what it costs: ``docs/pipeline.md#steady-steps-a-kept-program-nothing-read-back``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..distributed.sharding import local_tensor
from ..quant.blockwise import num_blocks
from ..quant.formats import QUANTIZED, format_of, stored_sizes
from ..rounding import KAHAN
from ..work.items import LOW_RANK
from ..work.record import param_place
from .plan import Plan

__all__ = ["check_state_fits", "check_grad", "check_dtypes", "check_slots", "check_kahan", "where"]


def check_state_fits(plan: Plan, work: Sequence[tuple[torch.Tensor, dict[str, Any]]], owner: str = "optimizer") -> None:
    """Raise ValueError if the state of a parameter of ``work`` ((parameter, param group) pairs) was made for a
    tensor of another shape or, for 8- and 4-bit state, at another block size than its group's (docs/pipeline.md),
    or if its gradient's shape or dtype is not its own (TypeError for the dtype), or a GaLore group holds a value
    its key does not take. ``owner``: the optimizer's class name, for the message."""
    state_of = plan.state.get
    layouts = plan._layouts
    last = rank = record = None
    sharded = plan.sharded
    for p, group in work:
        if group is not last:  # (a group's parameters come together: one look at each group)
            last, record = group, plan.record_of(group)
            rank = record.rank
            if plan.galore is not None and rank is not None:
                plan.galore.check_group_values(plan, group, owner)
        grad = p.grad
        if grad.shape != p.shape:  # (p.data replaced after the gradient was computed: torch lets it be)
            raise ValueError(
                f"{owner}: the gradient of {where(plan, p)} has shape {tuple(grad.shape)} but the parameter "
                f"{tuple(p.shape)}: was its .data replaced by a tensor of another shape after the gradient was "
                "computed? Nothing was changed: compute the gradient again, or set p.grad = None to skip it"
            )
        if grad.dtype != p.dtype or not p.is_floating_point():
            check_dtypes(p, grad, lambda: where(plan, p), owner)
        state = state_of(p)
        if not state or "step" not in state:
            continue
        if LOW_RANK in state:  # low-rank state: the projection stage knows its shapes
            if rank is None:
                raise ValueError(
                    f"{owner}: {where(plan, p)} has GaLore (low-rank) state but its param group has no 'rank' (was it "
                    "removed from the group?). Nothing was changed: keep the group's GaLore keys, or reset this "
                    "parameter's state (del optimizer.state[p])"
                )
            if plan.galore is not None:
                plan.galore.check_low_rank_state(plan, p, group, state, owner)
            continue
        if rank is not None:
            raise ValueError(
                f"{owner}: {where(plan, p)} has full-rank optimizer state but its param group has rank="
                f"{group['rank']} (GaLore; was rank added to the group after steps?). Nothing was changed: remove the "
                "group's rank, or reset this parameter's state (del optimizer.state[p]) to project it"
            )
        local = local_tensor(p) if sharded else p
        key = (id(record), local.shape, local.dtype, p.numel())
        layout = layouts.get(key)
        if layout is None:
            slots = plan.slots_of(record, local)
            layout = layouts[key] = stored_sizes(
                slots, local.shape, p.numel(), local.dtype, record.state_bits, record.min_quant_numel, record.block_size
            )
        kahan = state.get(KAHAN)
        if kahan is not None:
            check_kahan(kahan, local.shape, lambda: where(plan, p), owner)
        try:
            if all(state[k].numel() == n for k, n in layout):
                continue
        except KeyError:
            pass
        check_slots(plan.slots_of(record, local), local.shape, state, record.block_size, lambda: where(plan, p), owner)


#: step()'s refusal of a sparse gradient (torch's words first, then what to do)
SPARSE = (
    "{owner} does not support sparse gradients: give it dense ones (nn.Embedding(..., sparse=False), or "
    "p.grad = p.grad.to_dense() before step()), or step the sparse parameters with torch.optim.SGD or "
    "SparseAdam beside it (docs/torch_optim.md). Nothing was changed"
)


def check_grad(p: torch.Tensor, groups: Any, owner: str) -> None:
    """Raise TypeError, naming the parameter (its place among ``groups``), for a sparse gradient or one that
    :func:`check_dtypes` refuses; ``step()`` calls it for a sparse gradient or one of another dtype than its
    parameter, before anything reads them (a parameter and gradient both made complex or integer through ``.data``
    are refused by :func:`check_state_fits`, which the first step after a change runs)."""
    grad = p.grad
    if grad.is_sparse:
        raise TypeError(SPARSE.format(owner=owner))
    if grad.dtype != p.dtype or not p.is_floating_point():
        check_dtypes(p, grad, lambda: param_place(groups, p), owner)


def check_dtypes(p: torch.Tensor, grad: torch.Tensor, who: Any, owner: str) -> None:
    """Raise TypeError for a parameter that is no longer real floating point, or a gradient ``grad`` whose dtype is
    not ``p``'s (torch checks both when ``p.grad`` is set, not when the ``.data`` of either is replaced later; the
    kernels read a gradient in its parameter's dtype). ``who()``: the parameter, in words."""
    if p.is_complex() or not p.is_floating_point():
        raise TypeError(
            f"{owner}: {who()} is {p.dtype} now (its .data was replaced); a parameter must stay real "
            "floating point: optimize a real view of a complex tensor (torch.view_as_real). Nothing was "
            "changed"
        )
    raise TypeError(
        f"{owner}: the gradient of {who()} is {grad.dtype} but the parameter {p.dtype}: a gradient has its "
        "parameter's dtype (torch refuses another when p.grad is set); was the .data of the parameter or of its "
        "gradient replaced by a tensor of another dtype? Nothing was changed: compute the gradient again, or set "
        "p.grad = None to skip it"
    )


def slot_numel(slot: Any, shape: torch.Size) -> int:
    """Elements of ``slot`` for a tensor of ``shape`` (its own shape, if it has one)."""
    return shape.numel() if slot.shape is None else torch.Size(slot.shape).numel()


def check_slots(
    slots: dict[str, Any],
    shape: torch.Size,
    state: dict[str, Any],
    block_size: int,
    who: Any,
    owner: str,
    needs: str = "",
) -> None:
    """Each slot of ``slots`` as stored in ``state`` (whatever its format) holds the elements of a tensor of ``shape``
    (and, quantized, one scale per ``block_size`` of them); else ValueError. ``who()``: the parameter, in words;
    ``needs``: what the state should fit, in words (default: the parameter's shape)."""
    for name, slot in slots.items():
        size = slot_numel(slot, shape)
        try:
            fmt = format_of(state, name)
        except KeyError:
            raise ValueError(
                f"{owner}: the state of {who()} has no '{name}', which its algorithm needs for a tensor of shape "
                f"{tuple(shape)} with its group's options now: the parameter's shape, or an option that adds state, "
                "changed after the state was made. The state was left as it was: reset this parameter's state (del "
                "optimizer.state[p]) or change it back"
            ) from None
        ranges = fmt.key_ranges(name, 0, size, block_size)
        stored = {k: state[k].numel() for k in ranges}
        if fmt in QUANTIZED:
            data_key, scales_key = fmt.keys(name)
            if stored[data_key] == ranges[data_key][1]:
                if stored[scales_key] != ranges[scales_key][1]:
                    old = _block_size_of(size, stored[scales_key])
                    raise ValueError(
                        f"{owner}: the {fmt.bits}-bit state '{name}' of {who()} was made at block_size "
                        f"{old if old else '(unknown)'}, but its param group now has block_size {block_size}; the "
                        "state was left as it was. Quantized state keeps the block size it was made with "
                        f"(re-quantizing would add error): set the group's block_size back{f' to {old}' if old else ''}"
                    )
                continue
        elif stored[name] == size:
            continue
        held = stored[fmt.keys(name)[0]]
        held = f"{held:,} bytes of 4-bit codes" if fmt.bits == 4 else f"{held:,} elements"
        raise ValueError(
            f"{owner}: the optimizer state of {who()} was made for another tensor: its '{name}' holds {held}, "
            f"{needs or f'the parameter has shape {tuple(shape)}'} ({size:,} elements). Was the parameter's .data "
            "replaced by a tensor of another shape? The state was left as it was: reset this parameter's state (del "
            "optimizer.state[p]) or give the parameter its shape back"
        )


def check_kahan(kahan: torch.Tensor, shape: torch.Size, who: Any, owner: str) -> None:
    """A Kahan buffer (``bf16_update="kahan"``) holds the elements of a tensor of ``shape``; else ValueError.
    ``who()``: the parameter, in words."""
    if kahan.numel() != shape.numel():
        raise ValueError(
            f"{owner}: the optimizer state of {who()} was made for another tensor: its Kahan buffer ('{KAHAN}', "
            f"{kahan.numel():,} elements) does not fit the parameter's shape {tuple(shape)}. Was the parameter's .data "
            "replaced by a tensor of another shape? The state was left as it was: reset this parameter's state (del "
            "optimizer.state[p]) or give it its shape back"
        )


def _block_size_of(numel: int, scales: int) -> int | None:
    """The power-of-two block size (16 to 2^20) that gives ``numel`` elements ``scales`` blocks, if one does."""
    for shift in range(4, 21):
        if num_blocks(numel, 1 << shift) == scales:
            return 1 << shift
    return None


def where(plan: Plan, p: torch.Tensor) -> str:
    """``p`` in words: its place among the plan's param groups."""
    return param_place(plan.groups, p)
