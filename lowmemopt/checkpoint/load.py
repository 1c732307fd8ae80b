"""Loading: a state file into an optimizer, validated and planned first, converted to the optimizer's formats while
it streams, swapped in at the end (:func:`load_state`)."""

from __future__ import annotations

import glob
import math
import os
from typing import Any, Callable

import torch

from .. import paging, rounding
from ..distributed.files import rank_path
from ..distributed.sharding import local_tensor
from ..optimizer import LowMemOptimizer
from ..projection import projector as pj
from ..projection import storage
from ..quant.convert import (
    CheckpointError,
    Reader,
    check_state_values,
    format_numel,
    reformat,
    remaps,
    slot_shape,
    target_format,
)
from ..quant.formats import FORMATS
from .layout import crc32, open_state_file, sharded_path
from .sniff import check_state_file_kind
from .validation import (
    LoadPlan,
    LoadReport,
    check_optimizer,
    check_same_optimizer,
    describe_problems,
    from_json,
    plan_load,
    restorable,
    validated_meta,
)


def load_state(
    optimizer: LowMemOptimizer,
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    strict: bool = True,
    *,
    from_optimizer: str | None = None,
) -> LoadReport:
    """Load a state file written by :func:`save_state` into ``optimizer``, converting formats as needed.

    Everything is validated before the optimizer changes; a problem raises :class:`CheckpointError` naming the
    parameter. Hyper-parameters are restored when the group layout is the file's; storage options stay the
    optimizer's. What is refused and why: docs/state_format.md#loading.

    Args:
        model: names the parameters as the file does (``save_state``'s ``model``).
        strict: raise for missing, unexpected and mismatched params; False loads what matches and reports the rest.
        from_optimizer: the class name of another optimizer whose file to load deliberately (matching slots only).

    Returns:
        A :class:`LoadReport`.
    """
    check_optimizer(optimizer)
    path, sharding = sharded_path(optimizer, path)
    per_rank = getattr(optimizer, "per_rank_files", False)
    if per_rank and not os.path.exists(path):  # saved at another world size: any rank's file (replicated state)
        path, sharding = other_world_path(path, sharding)
    if sharding is not None and not os.path.exists(path):
        raise FileNotFoundError(
            f"no per-rank optimizer state file at {path!r} for rank {sharding['rank']} of world size "
            f"{sharding['world_size']}; per-rank files load only at the world size that saved them (to change it, "
            "use torch.distributed.checkpoint: docs/distributed.md)"
        )
    check_state_file_kind(path)  # a torch.save / JSON / pickle file: say what it is and what reads it
    with open_state_file(path) as f:
        meta = validated_meta(f, path)
        if meta.get("sharding", sharding) != sharding and not per_rank:
            raise CheckpointError(
                f"{path}: saved by rank/world size {meta.get('sharding')}, loading at {sharding} (per-rank files load "
                "only at the same sharding; to change it use torch.distributed.checkpoint: docs/distributed.md)"
            )
        restore = check_same_optimizer(optimizer, meta, path, from_optimizer)
        plans, report = plan_load(optimizer, meta, model, path, restore)
        if strict and (report.missing or report.unexpected or report.mismatched):
            raise CheckpointError(describe_problems(path, report, meta, model))
        extra = meta.get("extra")
        extra_tensors = {}
        for key in (extra or {}).get("tensors", {}):
            extra_tensors[key] = f.get_tensor(key).clone()
            if crc32(extra_tensors[key]) != int(meta["crc32"][key]):
                raise CheckpointError(f"{path}: tensor '{key}' fails its checksum")
        release = f.release
        # allocate all the new state first, then stream the file into it: chunk temporaries then reuse one small
        # region instead of fragmenting the heap between state tensors. Paged params' state goes to new homes.
        new_states = {plan.param: _allocate(plan) for plan in plans}
        new_states.update(paging.stage(optimizer, [(plan.param, plan.group, new_states[plan.param]) for plan in plans]))
        try:
            for plan in plans:
                _read_param(f, plan, new_states[plan.param], meta["crc32"], path, release, report.converted)
                paging.drop_pages(optimizer, new_states[plan.param])
        except BaseException:
            paging.discard_staged(optimizer)
            raise
    # everything is read and checked: swap it in
    for plan in plans:
        if new_states[plan.param]:
            optimizer.state[plan.param] = new_states[plan.param]
        else:
            optimizer.state.pop(plan.param, None)
    paging.reconcile(optimizer)  # paged: adopt the new homes, free the replaced ones
    load_extra = getattr(optimizer, "load_file_extra", None)
    if load_extra is not None:
        load_extra(None if extra is None else extra.get("info"), extra_tensors)
    if report.hyperparameters_restored:
        for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
            for k, v in saved.items():
                if restorable(k, v):
                    group[k] = from_json(v, group.get(k))
    return report


def _allocate(plan: LoadPlan) -> dict[str, Any]:
    """The param's new state in the target formats, zero-filled (meta tensors for paged params)."""
    if plan.entry["step"] is None:
        return {}
    state: dict[str, Any] = {"step": plan.entry["step"]}
    device = torch.device("meta") if paging.tier_of(plan.group) else plan.param.device
    projector = plan.entry.get("projector", {})
    for key, value in projector.items():  # GaLore: ints as they are, bases to fill at the group's proj_bits
        if not isinstance(value, list):
            state[key] = value
    if projector:
        for key, shape in _basis_shapes(plan).items():
            storage.init_basis(state, key, shape, plan.group.get("proj_bits", 32), device)
    kahan_dtype = plan.param.dtype if plan.param.dtype in rounding.DTYPES else torch.bfloat16
    for key, value in plan.entry.get("bf16_update", {}).items():  # a seed; a Kahan buffer to fill (the param's dtype)
        state[key] = torch.zeros(value, dtype=kahan_dtype, device=device) if isinstance(value, list) else value
    for name, slot in plan.slots.items():
        shape = slot_shape(slot, local_tensor(plan.param).shape)
        fmt = target_format(plan.group, slot, format_numel(slot, plan.param.numel()), plan.param.dtype)
        fmt.init(state, name, shape, device, plan.group["block_size"])
    return state


def _read_param(f, plan: LoadPlan, state: dict[str, Any], crcs, path, release, converted: list[str]) -> None:
    """Fill ``state`` (from :func:`_allocate`) from the file, converting formats; checks every tensor's CRC-32."""
    entry, p, group = plan.entry, local_tensor(plan.param), plan.group
    device = next((t.device for t in state.values() if isinstance(t, torch.Tensor)), p.device)  # paged: the home's
    for name, slot in plan.slots.items():
        info = entry["slots"][name]
        shape = slot_shape(slot, p.shape)
        src = FORMATS[info["format"]]
        src_bs = info.get("block_size", 1)
        dst = target_format(group, slot, format_numel(slot, plan.param.numel()), plan.param.dtype)
        dst_bs = group["block_size"]
        sources = {}
        for key in src.keys(name):
            fkey = f"{plan.name}/{key}"
            sources[key] = _FileTensor(f.get_tensor(fkey), fkey, crcs[fkey], path, release)
        read = _checked_reader(sources, slot.signed, f"{path}: parameter '{plan.name}'")
        src_map = info.get("map")  # 8-bit: the file's map (files before format 2 of the state: the dynamic maps)
        remap = remaps(src, src_map, slot)
        reformat(
            read,
            state,
            name,
            shape,
            slot.signed,
            src,
            src_bs,
            dst,
            dst_bs,
            device,
            verbatim=src is dst and not remap,
            src_map=src_map,
        )
        for source in sources.values():
            source.finish()
        if src is not dst or remap:
            where = f" ({src_map} map)" if remap else ""
            converted.append(f"{plan.name}/{name}: {src.name}{where} -> {dst.name}")
    projector = entry.get("projector", {})
    shapes = _basis_shapes(plan) if projector else {}
    # the bases the file stores at another proj_bits than the group's: read, then converted
    converting = [b for b in shapes if not _same_format(projector, state, b)]
    other = {k for k in projector for b in converting if k == b or k.startswith(b + ".")}
    saved: dict[str, Any] = {}
    for key, value in list(projector.items()) + list(entry.get("bf16_update", {}).items()):
        if isinstance(value, list):
            fkey = f"{plan.name}/{key}"
            source = _FileTensor(f.get_tensor(fkey), fkey, crcs[fkey], path, release)
            read = _checked_reader({key: source}, True, f"{path}: parameter '{plan.name}'")
            if key in other:
                saved[key] = read(key, 0, math.prod(value)).view(value).clone()
            else:
                state[key].view(-1).copy_(read(key, 0, state[key].numel()))
            source.finish()
    for key in converting:
        storage.encode_basis(state, key, storage.decode_basis(saved, key, shapes[key]).to(device))
        converted.append(
            f"{plan.name}/{key}: proj_bits {storage.stored_bits(saved, key)} -> {storage.stored_bits(state, key)}"
        )


def _same_format(projector: dict[str, Any], state: dict[str, Any], key: str) -> bool:
    """Is basis ``key`` stored under the same keys in the file's ``projector`` entry and in ``state`` (fp32 and bf16
    share theirs: copied, rounded, as they are)?"""
    return (key in projector) == (key in state) and all(k in projector for k in state if k.startswith(key + "."))


def _basis_shapes(plan: LoadPlan) -> dict[str, tuple[int, int]]:
    """The shapes of a GaLore parameter's bases (:func:`~lowmemopt.projection.projector.basis_shapes`)."""
    m, n = pj.matrix_shape(plan.param.shape)
    return pj.basis_shapes(m, n, plan.group["rank"], plan.entry["projector"][pj.SIDE])


def _checked_reader(sources: dict[str, _FileTensor], signed: bool, where: str) -> Reader:
    """Read chunks of ``sources``, refusing values that would poison the next step (:func:`check_state_values`)."""

    def read(key: str, a: int, b: int) -> torch.Tensor:
        chunk = sources[key].read(a, b)
        check_state_values(key, chunk, signed, where)
        return chunk

    return read


class _FileTensor:
    """A memory-mapped tensor of the file read front to back: checksummed, its read pages dropped from the process."""

    def __init__(self, view: torch.Tensor, key: str, crc: int, path: str, release: Callable[[int, int], None]):
        self.flat, self.key, self.expected, self.path, self.release = view.reshape(-1), key, crc, path, release
        self.crc = 0
        self.pos = 0

    def read(self, a: int, b: int) -> torch.Tensor:
        assert a == self.pos, (self.key, a, self.pos)  # consumed strictly in order
        self._release_until(a)
        chunk = self.flat[a:b]
        self.crc = crc32(chunk, self.crc)
        self.pos = b
        return chunk

    def finish(self) -> None:
        assert self.pos == self.flat.numel(), (self.key, self.pos)
        self._release_until(self.pos)
        if self.crc != self.expected:
            param, _, key = self.key.rpartition("/")
            raise CheckpointError(
                f"{self.path}: parameter '{param}': tensor '{key}' fails its CRC-32 check: the file is corrupt"
            )

    def _release_until(self, end: int) -> None:
        if end and self.flat.numel():
            self.release(self.flat.data_ptr(), self.flat.data_ptr() + end * self.flat.element_size())


def other_world_path(path: str, sharding: dict[str, int] | None) -> tuple[str, dict[str, int] | None]:
    """For per-rank files of another world size: this rank's modulo that size; else ``path``."""
    rank = 0 if sharding is None else sharding["rank"]
    stem, ext = os.path.splitext(os.fspath(path))
    stem = stem.rsplit(".rank", 1)[0]
    for found in sorted(glob.glob(f"{glob.escape(stem)}.rank00000-of-*{glob.escape(ext)}")):
        world = int(found[len(stem) + len(".rank00000-of-") : len(found) - len(ext)])
        return rank_path(f"{stem}{ext}", rank % world, world), dict(rank=rank % world, world_size=world)
    return path, sharding
