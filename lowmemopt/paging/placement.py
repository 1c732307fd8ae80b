"""Placing a parameter's state: which parameters stay resident, the layout of state not made yet, and its homes
(one arena per device for host-RAM homes, in step order).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable

import torch

from .entry import Entry
from .homes import Homes, drop_tensor_pages, layout_bytes, transfer
from .residency import AUTO, AutoRoom, headroom, probe, smallest_first
from .schedule import N_SLOTS, N_SLOTS_HOST

__all__ = [
    "FirstState",
    "initial_layout",
    "choose_resident",
    "make_homes",
    "fill_homes",
    "tensors_of",
    "nbytes_of",
    "on_device",
    "brought_back",
    "check_plain",
    "pageable",
    "on_mesh",
    "mesh_weight",
    "remember",
    "meta_twin",
    "buckets_of",
    "largest_buckets",
]

#: ``first_state(p, group)``: the state ``p``'s first step makes, in ``state[p]`` (on a meta twin: shapes only)
FirstState = Callable[[torch.Tensor, dict[str, Any]], dict[str, Any]]
#: (param, group, tier, state or None for state not made yet)
Item = tuple[torch.Tensor, dict[str, Any], str, "dict[str, Any] | None"]


def tensors_of(state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    return {k: v for k, v in (state or {}).items() if isinstance(v, torch.Tensor)}


def nbytes_of(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def on_mesh(p: torch.Tensor) -> bool:
    """Is ``p`` a DTensor (FSDP2, tensor parallelism: laid out over a device mesh)?"""
    module = sys.modules.get("torch.distributed.tensor")  # (imported only once some DTensor exists)
    return module is not None and isinstance(p, module.DTensor)


def pageable(p: torch.Tensor) -> bool:
    """Can ``p``'s state page? A plain tensor, or a DTensor (FSDP2; its state is its local shard's); no other
    tensor subclass."""
    return type(p).__torch_dispatch__ is torch.Tensor.__torch_dispatch__ or on_mesh(p)


def meta_twin(p: torch.Tensor) -> torch.Tensor:
    """``p`` as a tensor without storage: a meta tensor, or for a DTensor one laid out like it over a meta shard."""
    if not on_mesh(p):
        return torch.empty_like(p, device="meta")
    from torch.distributed.tensor import DTensor

    shard = torch.empty_like(p.to_local(), device="meta")
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def initial_layout(
    state: Any, p: torch.Tensor, group: dict[str, Any], first_state: FirstState | None
) -> dict[str, torch.Tensor] | None:
    """The tensors ``p``'s first step will make, as meta tensors (None if that fails); a DTensor's twin is a DTensor
    on the same mesh whose local shard is a meta tensor."""
    twin = meta_twin(p)
    try:
        if first_state is None:
            return None
        return tensors_of(first_state(twin, group))
    except Exception:  # noqa: BLE001 - an algorithm whose state needs more than shapes
        return None
    finally:
        state.pop(twin, None)


def mesh_weight(state: Any, p: torch.Tensor, group: dict[str, Any], first_state: FirstState | None) -> int | None:
    """A DTensor's share of its whole state's bytes (the state one process would make for the whole tensor, over its
    number of shards): the same number on every rank, by which batches are cut (:func:`buckets_of`); None for a
    plain tensor."""
    if not on_mesh(p):
        return None
    shards = 1
    for d, placement in enumerate(p.placements):
        if placement.is_shard():
            shards *= p.device_mesh.size(d)
    layout = initial_layout(state, torch.empty(p.shape, dtype=p.dtype, device="meta"), group, first_state)
    nbytes = nbytes_of(layout) if layout else 2 * p.numel() * p.element_size()  # (no layout: two slots' worth)
    return -(-nbytes // shards)


def remember(first_state: FirstState | None) -> Callable[[], FirstState | None]:
    """``first_state`` to call again later, held weakly if it is a bound method (of the optimizer the pager serves:
    a strong reference would keep it alive)."""
    if hasattr(first_state, "__self__"):
        return weakref.WeakMethod(first_state)
    return lambda: first_state


def choose_resident(
    items: list[Item],
    layouts: dict[torch.Tensor, dict[str, torch.Tensor] | None],
    entries: dict[torch.Tensor, Entry],
    rooms: dict[torch.device, AutoRoom],
    bucket_bytes: int,
) -> set[torch.Tensor]:
    """Parameters of ``items`` whose state stays resident (an int budget, or ``"auto"``)."""
    resident: set[torch.Tensor] = set()
    sized = {p: (nbytes_of(layouts[p]) if layouts[p] is not None else None) for p, _, _, _ in items}
    by_group: dict[int, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
    auto: dict[torch.device, list[tuple[torch.Tensor, dict[str, Any]]]] = {}
    for p, group, _, _ in items:
        if group.get("page_budget_bytes", AUTO) == AUTO:
            auto.setdefault(p.device, []).append((p, group))
        else:
            by_group.setdefault(id(group), []).append((p, group))
    for members in by_group.values():
        group = members[0][1]
        in_group = {id(q) for q in group["params"]}
        room = group["page_budget_bytes"] - sum(
            e.nbytes for q, e in entries.items() if e.resident and id(q) in in_group
        )
        resident.update(smallest_first([(sized[p], p) for p, _ in members], room))
    for device, members in auto.items():
        memory = probe(device)
        if memory is None:  # (a device without a memory reading: the CPU)
            continue
        largest = max((n for n in sized.values() if n is not None), default=0)
        in_flight = (N_SLOTS if device.type == "cuda" else N_SLOTS_HOST) * max(bucket_bytes, largest)
        room = rooms.setdefault(device, AutoRoom())
        margin = max(headroom(group, memory) for _, group in members)
        resident.update(room.choose(memory, [(sized[p], p) for p, _ in members], in_flight, margin))
    return resident


def make_homes(
    homes: Homes,
    made: list[tuple[Entry, dict[str, torch.Tensor]]],
    alloc: Callable[[Entry, str, torch.Tensor], torch.Tensor],
) -> None:
    """Homes for each (entry, layout) of ``made``: files one by one, host RAM of a device in one arena."""
    arenas: dict[tuple[torch.device, bool], list[tuple[Entry, str, torch.Tensor]]] = {}
    for entry, layout in made:
        entry.reserved = {}
        for k, t in layout.items():
            check_plain(k, t)
            if entry.tier == "disk":
                entry.reserved[k] = alloc(entry, k, t)
            else:
                arenas.setdefault((entry.device, entry.device.type == "cuda"), []).append((entry, k, t))
    for (_, pin), members in arenas.items():
        views = homes.arena([(t.shape, t.dtype) for _, _, t in members], pin=pin)
        for (entry, k, _), view in zip(members, views):
            entry.reserved[k] = view


def check_plain(key: str, like: torch.Tensor) -> None:
    if like.layout != torch.strided or (type(like) is not torch.Tensor and like.device.type != "meta"):
        raise TypeError(f"paged optimizer state must be plain dense tensors; '{key}' is {type(like).__name__}")


def fill_homes(homes: Homes, reserved: dict[str, torch.Tensor], layout: dict[str, torch.Tensor]) -> None:
    """Copy the state ``layout`` into its new homes (meta tensors: zeros)."""
    for k, t in layout.items():
        if t.device.type == "meta":
            if not homes.is_file(reserved[k]):
                reserved[k].zero_()
        elif t.device.type == "cpu":
            transfer(homes, reserved[k], t)
        elif homes.is_file(reserved[k]):
            transfer(homes, reserved[k], t.cpu())
        else:
            reserved[k].copy_(t)
        drop_tensor_pages(homes, reserved[k])


def on_device(v: Any, device: torch.device) -> Any:
    """A loaded state's value for resident state on ``device`` (meta tensors: zeros)."""
    if not isinstance(v, torch.Tensor):
        return v
    if v.device.type == "meta":
        return torch.zeros(v.shape, dtype=v.dtype, device=device)
    return v.to(device)


def brought_back(homes: Homes, state: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``state`` (homes) with each tensor copied to ``device``, as unpaged state (a file is read, not mapped)."""
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            copy = torch.empty_like(v)
            transfer(homes, copy, v)
            v = copy.to(device)
        out[k] = v
    return out


Work = list[tuple[torch.Tensor, dict[str, Any]]]


def buckets_of(todo: Work, entries: dict[torch.Tensor, Entry], bucket_bytes: int, host_bytes: int) -> list[Work]:
    """Consecutive batches of ``todo`` (:meth:`~.pager.Pager.batches`' rule; ``host_bytes``: the CPU's cap); with
    DTensors among them, cut where every rank cuts them (:func:`_cut_alike`)."""
    if any(e.weight is not None for e in (entries.get(p) for p, _ in todo) if e is not None):
        return _cut_alike(todo, entries, bucket_bytes, host_bytes)

    def moves(p: torch.Tensor) -> bool:
        return p in entries and not entries[p].resident

    still = [item for item in todo if not moves(item[0])]
    chunks: list[Work] = []
    size, kind = 0, None
    for item in todo:
        if not moves(item[0]):
            continue
        entry = entries[item[0]]
        nbytes = nbytes_of(entry.home_tensors())
        limit = bucket_bytes if entry.device.type == "cuda" else min(bucket_bytes, host_bytes)
        if not chunks or size + nbytes > limit or kind != (entry.device, entry.tier):
            chunks.append([])
            size, kind = 0, (entry.device, entry.tier)
        chunks[-1].append(item)
        size += nbytes
    if still:
        if chunks:
            chunks[0] = still + chunks[0]
        else:
            chunks.append(still)
    return chunks


def _cut_alike(todo: Work, entries: dict[torch.Tensor, Entry], bucket_bytes: int, host_bytes: int) -> list[Work]:
    """Batches of ``todo`` in its order, cut by what is the same on every rank (a DTensor's :func:`mesh_weight`, a
    plain tensor's state bytes), resident state counted as if it moved: the ranks step the same parameters in the
    same batches, so the collectives of their steps pair up (docs/distributed.md#paged-state-under-fsdp2)."""
    chunks: list[Work] = [[]]
    size, kind = 0, None
    for item in todo:
        entry = entries.get(item[0])
        if entry is not None:  # (unpaged: rides along where it is)
            nbytes = entry.weight if entry.weight is not None else nbytes_of(entry.home_tensors())
            limit = bucket_bytes if entry.device.type == "cuda" else min(bucket_bytes, host_bytes)
            if kind is not None and (size + nbytes > limit or kind != (entry.device, entry.tier)):
                chunks.append([])
                size = 0
            size, kind = size + nbytes, (entry.device, entry.tier)
        chunks[-1].append(item)
    return chunks if chunks[0] else []


def largest_buckets(moving: list[list[torch.Tensor]], entries: dict[torch.Tensor, Entry]) -> dict[torch.device, int]:
    """Per device, the bytes of the largest bucket of ``moving`` (the params of each), laid out in a slot."""
    largest: dict[torch.device, int] = {}
    for params in moving:
        if params:
            device = entries[params[0]].device
            nbytes = layout_bytes([t for p in params for t in entries[p].home_tensors().values()])
            largest[device] = max(largest.get(device, 0), nbytes)
    return largest
