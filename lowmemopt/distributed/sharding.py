"""DTensor parameters (FSDP2 ``fully_shard``, tensor parallelism): state lives on the local shard as plain tensors and
the step runs the single-process code on ``p.to_local()``; ``state_dict()`` presents it as DTensors laid out like the
parameter (:func:`present_state`) and ``load_state_dict`` localizes it back (:func:`localize_state`). Docs:
docs/distributed.md. ``torch.distributed.tensor`` is imported only once some DTensor exists (~0.7 s).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from .. import rounding
from .reduction import LOCAL, Reduction, ShardedReduction, contiguous_strides, is_shard

if TYPE_CHECKING:
    from ..quant.formats import Slot

__all__ = [
    "is_dtensor",
    "any_dtensor",
    "local_tensor",
    "local_view",
    "agree_finite",
    "slot_layout",
    "present_state",
    "presented_params",
    "dense_state_dict",
    "localize_state",
    "shard_layout",
]


def is_dtensor(t: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def any_dtensor(tensors: Iterable[Any]) -> bool:
    """Is any of ``tensors`` a DTensor? (One call for a step's tensors: False at once where none was ever made.)"""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return False
    dtensor = module.DTensor
    for t in tensors:
        if isinstance(t, dtensor):
            return True
    return False


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a view: writing to it writes the DTensor), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t


def local_view(p: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Reduction]:
    """``(p_local, grad_local, reduce)`` for one step (a ``Partial`` gradient redistributed first)."""
    if not is_dtensor(p):
        if is_dtensor(grad):
            raise TypeError("a plain tensor parameter has a DTensor gradient; shard the parameter like its gradient")
        return p, grad, LOCAL
    if not is_dtensor(grad):
        raise TypeError(
            f"a DTensor parameter {tuple(p.shape)} {p.placements} has a plain-tensor gradient: set p.grad to a DTensor "
            "with the parameter's mesh and placements"
        )
    if grad.device_mesh != p.device_mesh:
        raise ValueError(f"gradient mesh {grad.device_mesh} differs from its parameter's mesh {p.device_mesh}")
    if tuple(grad.placements) != tuple(p.placements):
        grad = grad.redistribute(p.device_mesh, p.placements)
    return p.to_local(), grad.to_local(), reduction_of(p)


def reduction_of(p: torch.Tensor) -> Reduction:
    """How the math reduces over ``p``: a :class:`ShardedReduction` for a DTensor, else :data:`LOCAL`."""
    return ShardedReduction(p.device_mesh, p.placements, p.shape) if is_dtensor(p) else LOCAL


def agree_finite(flags: list[bool], params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> list[bool]:
    """Make the non-finite skip the same on every rank holding a shard of a parameter."""
    by_mesh: dict[Any, list[int]] = {}
    for i, p in enumerate(params):
        if is_dtensor(p):
            by_mesh.setdefault(p.device_mesh, []).append(i)
    if not by_mesh:
        return flags
    flags = list(flags)
    for mesh, idx in by_mesh.items():
        device = local_tensor(grads[idx[0]]).device
        ok = torch.tensor([int(flags[i]) for i in idx], dtype=torch.int32, device=device)
        for d in range(mesh.ndim):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=mesh.get_group(d))
        for i, f in zip(idx, ok.tolist()):
            flags[i] = bool(f)
    return flags


# ---------------------------------------------------------------------------------------------------------------------
# state_dict presentation: local state <-> DTensors laid out like the parameter


def slot_layout(p, slot: "Slot", local_shape: torch.Size) -> tuple[list, torch.Size]:
    """``(placements, global shape)`` of a slot of DTensor ``p`` with local shape ``local_shape``: parameter-shaped
    slots are placed like ``p``; others follow ``slot.dims`` (sharded where a dim runs along a sharded parameter dim,
    else replicated)."""
    from torch.distributed.tensor import Replicate, Shard

    if slot.shape is None:
        return list(p.placements), p.shape
    if slot.dims is None:
        raise ValueError(f"slot of shape {slot.shape} declares no dims: cannot lay it out like a sharded parameter")
    ndim = p.dim()
    dims = [None if d is None else d % ndim for d in slot.dims]
    placements, shape = [], list(local_shape)
    for placement in p.placements:
        if placement.is_replicate():
            placements.append(Replicate())
        elif is_shard(placement):
            d = placement.dim % ndim
            if d not in dims:
                placements.append(Replicate())
                continue
            if placement.is_shard():
                placements.append(Shard(dims.index(d)))
            else:  # FSDP2 over tensor parallelism: the statistic's rows are strided as the parameter's
                from torch.distributed.tensor.placement_types import _StridedShard

                placements.append(_StridedShard(dims.index(d), split_factor=placement.split_factor))
            shape[dims.index(d)] = p.shape[d]
        else:
            raise ValueError(f"cannot lay out optimizer state for a parameter placed {placement}")
    return placements, torch.Size(shape)


def present_state(p, state: dict[str, Any], group: dict[str, Any], local_slots: dict[str, "Slot"]) -> dict[str, Any]:
    """One parameter's state as ``state_dict()`` shows it for ``torch.distributed.checkpoint``: each slot laid out
    like the parameter, q8 / q4 slots decoded to fp32 (blocks mean nothing at another sharding), ``step`` an int.
    ``local_slots``: the slots its state holds."""
    from ..quant.formats import QUANTIZED, format_of

    local = local_tensor(p)
    out: dict[str, Any] = {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
    if not any(name in state or name + ".codes" in state or name + ".nibbles" in state for name in local_slots):
        return dict(state)  # no state yet (or not ours): shown as it is
    keys = set()
    for name, slot in local_slots.items():
        shape = local.shape if slot.shape is None else torch.Size(slot.shape)
        fmt = format_of(state, name)
        keys.update(fmt.keys(name))
        if fmt in QUANTIZED:
            value = fmt.decode(state, name, 0, shape.numel(), slot.signed, group["block_size"]).view(shape)
        else:
            value = state[name]  # fp32 or bf16, the local shard's shape: shown as it is
        out[name] = _as_dtensor(p, slot, value) if is_dtensor(p) else value
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or key in keys:
            continue
        if key == rounding.KAHAN and is_dtensor(p):  # bf16_update="kahan": a buffer of the local shard's shape
            out[key] = _as_dtensor(p, None, value)
        else:  # other tensors (not laid out like the parameter): the same on every rank
            out[key] = _replicated(p, value) if is_dtensor(p) else value
    return out


def _as_dtensor(p, slot: "Slot | None", local_value: torch.Tensor):
    """``local_value`` (None: a tensor of the local shard's shape) as a DTensor laid out like ``p``, no copy."""
    from torch.distributed.tensor import DTensor

    placements, gshape = (list(p.placements), p.shape) if slot is None else slot_layout(p, slot, local_value.shape)
    return DTensor.from_local(
        local_value, p.device_mesh, placements, run_check=False, shape=gshape, stride=contiguous_strides(gshape)
    )


def _replicated(p, value: torch.Tensor):
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(value, p.device_mesh, [Replicate()] * p.device_mesh.ndim, run_check=False)


def localize_state(p, state: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(p_local, state)`` with every DTensor of ``state`` replaced by its local shard in ``p``'s layout."""
    if not is_dtensor(p):
        bad = [k for k, v in state.items() if is_dtensor(v)]
        if bad:
            raise TypeError(f"state {bad} are DTensors but the parameter {tuple(p.shape)} is a plain tensor")
        return p, state
    out = {}
    for key, value in state.items():
        if is_dtensor(value):
            if value.device_mesh != p.device_mesh:
                raise ValueError(f"state '{key}' is on mesh {value.device_mesh}, its parameter on {p.device_mesh}")
            value = value.to_local()
        elif (
            isinstance(value, torch.Tensor)
            and value.dim() > 0
            and value.shape == p.shape
            and p.shape != p.to_local().shape
        ):
            raise TypeError(
                f"state '{key}' is a full-size plain tensor {tuple(value.shape)} for a sharded parameter: load "
                "optimizer state through torch.distributed.checkpoint (get/set_optimizer_state_dict), which shards it"
            )
        out[key] = value
    return p.to_local(), out


@contextmanager
def dense_state_dict(optimizer: torch.optim.Optimizer) -> Iterator[torch.optim.Optimizer]:
    """While active, ``optimizer.state_dict()`` shows every parameter's state as for a sharded one (q8 decoded to
    fp32), so an unsharded model's DCP checkpoint matches a sharded run's::

        with lowmemopt.distributed.dense_state_dict(opt):
            sd = {"optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=path)
            set_optimizer_state_dict(model, opt, sd["optim"])
    """
    previous = getattr(optimizer, "_dense_state_dict", False)
    optimizer._dense_state_dict = True
    try:
        yield optimizer
    finally:
        optimizer._dense_state_dict = previous


def presented_params(optimizer: torch.optim.Optimizer) -> list[tuple[int, Any]]:
    """(state-dict index, param) of the parameters whose state ``state_dict()`` shows with :func:`present_state`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    dense = getattr(optimizer, "_dense_state_dict", False)
    return [(i, p) for i, p in enumerate(params) if dense or is_dtensor(p)]


# ---------------------------------------------------------------------------------------------------------------------
# per-rank files


def shard_layout(p) -> dict[str, Any] | None:
    """Where a DTensor's local shard sits (for per-rank files); None for a plain tensor."""
    if not is_dtensor(p):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return {
        "global_shape": list(p.shape),
        "local_shape": list(shape),
        "offset": list(offset),
        "placements": [str(pl) for pl in p.placements],
        "mesh": list(p.device_mesh.shape),
    }
