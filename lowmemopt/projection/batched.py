"""GaLore's stages in batches of a shape class (:mod:`.stage`): the products of the matrices of one shape, side and
product dtype in one ``torch.bmm`` (on CUDA, where launches cost; the CPU keeps galore-torch's per-matrix products, bit
for bit, unless a test sets :data:`BATCH_ON_CPU`), their zeroed stand-ins carved from one buffer, and the apply pass
of a class in one launch (:mod:`lowmemopt.kernels.unproject`).

Each stage returns its *layout* (which items go in which batch, and where in its buffer), and takes it back: a step
program (:mod:`lowmemopt.pipeline.program`) hands the same items to these stages at every step and keeps their
layouts, so a step pays no per-matrix host work to sort them again; the low-rank gradients and the stand-ins are then
carved from buffers of the same layout at every step, which keeps the launch tables built for them valid up to one
offset (:meth:`lowmemopt.kernels.launch.Bucket.set_tensors`).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..quant.formats import math_dtype
from ..work.items import Item
from . import projector as pj
from . import storage
from .apply import _decay_rows, finish

if TYPE_CHECKING:
    from ..pipeline.plan import Plan

__all__ = [
    "BATCH_NUMEL",
    "BATCH_ON_CPU",
    "batches",
    "project_gradients",
    "stand_ins",
    "finish_many",
    "fused_apply",
    "finished_in_batches",
    "stacked",
    "give_back",
    "Scratch",
]

#: CUDA: elements of the stacked gradients in one batched projection (64 MiB of fp32)
BATCH_NUMEL = 1 << 24
#: tests: batch the CPU's products as CUDA's (the CPU's own are per matrix, galore-torch's bit for bit)
BATCH_ON_CPU = False


def batches(t: torch.Tensor) -> bool:
    """Are matrices on ``t``'s device projected in batches? On CUDA (launches cost there; the CPU keeps galore-torch's
    products, bit for bit). Tests set :data:`BATCH_ON_CPU` to run the batched code on the CPU."""
    return t.is_cuda or BATCH_ON_CPU


def stacked(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``torch.stack(tensors).to(dtype)`` in one pass: a multi-tensor copy that casts, into the stacked tensor (the
    values are the cast's; no stacked copy in the source dtype first)."""
    if tensors[0].dtype == dtype:
        return torch.stack(tensors)
    out = torch.empty((len(tensors), *tensors[0].shape), dtype=dtype, device=tensors[0].device)
    torch._foreach_copy_(list(out.unbind(0)), tensors)
    return out


class Scratch:
    """A buffer that holds memory only during a step (:meth:`take`, :meth:`give_back`); its views stay valid objects."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tensor = torch.empty(numel, dtype=dtype, device=device)
        self.nbytes = self.tensor.untyped_storage().nbytes()

    def take(self) -> torch.Tensor:
        """The buffer, with storage (new memory after :meth:`give_back`: its address moves, its views with it)."""
        storage = self.tensor.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        return self.tensor

    def give_back(self) -> None:
        self.tensor.untyped_storage().resize_(0)


def _chunks(members: list[Item], numel: int) -> list[list[Item]]:
    """``members`` in chunks of at most :data:`BATCH_NUMEL` elements of matrices of ``numel`` elements."""
    per = max(1, BATCH_NUMEL // numel)
    return [members[i : i + per] for i in range(0, len(members), per)]


@dataclass(eq=False)
class ProjectLayout:
    """How :func:`project_gradients` takes its items: ``alone``, ``chunks`` (a batched product each), their buffer
    offsets."""

    alone: list[Item] = field(default_factory=list)
    chunks: list[tuple[list[Item], int, torch.dtype | None]] = field(default_factory=list)  # (items, side, dtype)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    numel64: int = 0
    #: this step's: the buffer's address, and each chunk's stacked bases (P^T or Q^T, in its product dtype; the back
    #: projection of the same chunk takes them again: :func:`finish_many`)
    base: int = 0
    bases: list[torch.Tensor | None] = field(default_factory=list)
    #: made at the layout's first use: the buffers (fp32, float64), per chunk its output view and its items' views,
    #: and per chunk whose bases are cast to its product dtype the buffer and views they are stacked into
    scratch: list[Scratch] = field(default_factory=list)
    outs: list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    cast_bases: dict[int, tuple[Scratch, list[torch.Tensor], torch.Tensor]] = field(default_factory=dict)

    def give_back(self) -> None:
        """The step's buffers back to the allocator (:class:`Scratch`); the layout serves again."""
        for scratch in (*self.scratch, *(c[0] for c in self.cast_bases.values())):
            scratch.give_back()
        self.bases = []


def _project_layout(items: list[Item]) -> ProjectLayout:
    layout = ProjectLayout()
    classes: dict[tuple, list[Item]] = {}
    for it in items:
        g, dtype = it.extra["g"], it.extra["dtype"]
        if it.extra["shards"] is None and batches(g) and it.state[pj.SIDE] != pj.BOTH:
            bits = storage.stored_bits(it.state, pj.PROJ)
            key = (g.device, tuple(g.shape), it.state[pj.SIDE], it.extra["shapes"][pj.PROJ], dtype, bits)
            classes.setdefault(key, []).append(it)
        else:
            layout.alone.append(it)
    for (_, shape, side, proj, dtype, _), members in classes.items():
        m, n = shape
        low = proj[0] * n if side == pj.LEFT else m * proj[1]  # P^T G (r x n) or G Q^T (m x r)
        for chunk in _chunks(members, m * n):
            layout.chunks.append((chunk, side, dtype))
            size = -(-len(chunk) * low // 4) * 4
            if dtype == torch.float64:
                layout.offsets.append(layout.numel64)
                layout.numel64 += size
            else:
                layout.offsets.append(layout.numel)
                layout.numel += size
    return layout


def project_gradients(items: list[Item], layout: ProjectLayout | None = None) -> ProjectLayout:
    """Each item's ``grad`` becomes its low-rank gradient, one ``torch.bmm`` per chunk on CUDA, else galore-torch's
    product per matrix. Returns the layout, which a later call with the same items may take back.
    """
    if layout is None:
        layout = _project_layout(items)
    for it in layout.alone:
        g, shards, dtype = it.extra["g"], it.extra["shards"], it.extra["dtype"]
        basis = pj.decoded(it.state, it.extra["shapes"])
        if shards is None:
            low = pj.project(g.float() if dtype is None else g, basis, dtype).to(math_dtype(dtype))
        else:
            low = shards.project(g.float(), basis, pj.bases)
        it.grad = low.contiguous()
    if not layout.chunks:
        return layout
    if not layout.scratch:
        _carve_outputs(layout)
    flat = layout.scratch[0].take()
    if len(layout.scratch) > 1:
        flat64 = layout.scratch[1].take()
        flat = flat if layout.numel else flat64  # (the buffer whose address the step's tables follow)
    layout.base, layout.bases = flat.data_ptr(), []
    for k, ((chunk, side, dtype), (out, views)) in enumerate(zip(layout.chunks, layout.outs)):
        first = chunk[0]
        if len(chunk) == 1:
            basis = pj.decoded(first.state, first.extra["shapes"])
            out[0].copy_(pj.project(first.extra["g"].float() if dtype is None else first.extra["g"], basis, dtype))
            layout.bases.append(None)
        else:
            g = stacked([it.extra["g"] for it in chunk], dtype or torch.float32)  # one cast for the chunk
            basis = _stacked_bases(layout, k, chunk, dtype or torch.float32)  # P^T or Q^T
            layout.bases.append(basis)
            if dtype is None or dtype == torch.float64:
                torch.bmm(basis, g, out=out) if side == pj.LEFT else torch.bmm(g, basis, out=out)
            else:
                out.copy_(torch.bmm(basis, g) if side == pj.LEFT else torch.bmm(g, basis))
        for it, x in zip(chunk, views):
            it.grad = x
    return layout


def _carve_outputs(layout: ProjectLayout) -> None:
    """The layout's buffers (:class:`Scratch`) and the views of each chunk's output and of its items' low-rank
    gradients, made once."""
    device = layout.chunks[0][0][0].extra["g"].device
    layout.scratch = [Scratch(layout.numel, torch.float32, device)]
    if layout.numel64:
        layout.scratch.append(Scratch(layout.numel64, torch.float64, device))
    for (chunk, side, dtype), offset in zip(layout.chunks, layout.offsets):
        first = chunk[0]
        buffer = layout.scratch[-1 if dtype == torch.float64 else 0].tensor
        m, n = first.extra["g"].shape
        proj = first.extra["shapes"][pj.PROJ]
        r = proj[0] if side == pj.LEFT else proj[1]
        shape = (len(chunk), r, n) if side == pj.LEFT else (len(chunk), m, r)
        out = buffer[offset : offset + math.prod(shape)].view(shape)
        layout.outs.append((out, out.unbind(0)))


def _stacked_bases(layout: ProjectLayout, k: int, chunk: list[Item], dtype: torch.dtype) -> torch.Tensor:
    """The bases of chunk ``k`` stacked in ``dtype``: one stack where they are stored in it, else cast (or decoded,
    ``proj_bits`` 8 or 4) into a buffer of the layout (:class:`Scratch`) through views made once."""
    dense = chunk[0].state.get(pj.PROJ)
    if dense is not None and dense.dtype == dtype:
        return torch.stack([it.state[pj.PROJ] for it in chunk])
    made = layout.cast_bases.get(k)
    if made is None:
        shape = chunk[0].extra["shapes"][pj.PROJ]
        scratch = Scratch(len(chunk) * math.prod(shape), dtype, chunk[0].extra["g"].device)
        stack = scratch.tensor.view(len(chunk), *shape)
        made = layout.cast_bases[k] = (scratch, list(stack.unbind(0)), stack)
    scratch, views, stack = made
    scratch.take()
    _fill_bases(chunk, views)
    return stack


def _fill_bases(chunk: list[Item], views: Sequence[torch.Tensor]) -> None:
    """Copy (cast) or decode (``proj_bits`` 8 or 4) each item's basis into its view of a stack."""
    if pj.PROJ in chunk[0].state:
        torch._foreach_copy_(views, [it.state[pj.PROJ] for it in chunk])
        return
    for it, view in zip(chunk, views):
        storage.decode_basis_into(it.state, pj.PROJ, view)


def _bases_of(chunk: list[Item], dtype: torch.dtype) -> torch.Tensor:
    """The bases of ``chunk`` stacked in ``dtype`` (a stacked copy; decoded where stored at 8 or 4 bits)."""
    if pj.PROJ in chunk[0].state:
        return stacked([it.state[pj.PROJ] for it in chunk], dtype)
    out = torch.empty((len(chunk), *chunk[0].extra["shapes"][pj.PROJ]), dtype=dtype, device=chunk[0].param.device)
    _fill_bases(chunk, out.unbind(0))
    return out


@dataclass(eq=False)
class StandInLayout:
    """Where :func:`stand_ins` carves each item's zeroed target: per device, its elements and the classes of one shape
    (the members and each one's 16-byte aligned size) at their offsets."""

    devices: list[tuple[torch.device, torch.dtype, int, list[tuple[torch.Size, list[Item], int, int]]]] = field(
        default_factory=list
    )
    bases: list[int] = field(default_factory=list)  # this step's buffers' addresses, per device
    #: the stand-ins of each class without padding, stacked: id(first item) -> (members, [len, *shape] view)
    stacks: dict[int, tuple[list[Item], torch.Tensor]] = field(default_factory=dict)
    #: made at the layout's first use: per device its buffer (:class:`Scratch`) and the items' views of it
    carved: list[tuple[Scratch, list[tuple[Item, torch.Tensor]]]] = field(default_factory=list)

    def give_back(self) -> None:
        """The step's buffers back to the allocator (:class:`Scratch`); the layout serves again."""
        for scratch, _ in self.carved:
            scratch.give_back()


def stand_ins(items: list[Item], layout: StandInLayout | None = None) -> StandInLayout:
    """Zeroed low-rank targets for ``items`` (one allocation per device and dtype); returns the layout, reusable."""
    if layout is None:
        layout = StandInLayout()
        by_device: dict[tuple[torch.device, torch.dtype], dict[torch.Size, list[Item]]] = {}
        for it in items:
            by_device.setdefault((it.grad.device, it.grad.dtype), {}).setdefault(it.grad.shape, []).append(it)
        for (device, dtype), shapes in by_device.items():
            classes, offset = [], 0
            for shape, members in shapes.items():
                size = -(-shape.numel() // 4) * 4  # each target 16-byte aligned
                classes.append((shape, members, size, offset))
                offset += size * len(members)
            layout.devices.append((device, dtype, offset, classes))
    if not layout.carved:
        _carve_stand_ins(layout)
    layout.bases = []
    for scratch, views in layout.carved:
        layout.bases.append(scratch.take().zero_().data_ptr())
        for it, view in views:
            it.target = view
    return layout


def _carve_stand_ins(layout: StandInLayout) -> None:
    """The layout's buffers (:class:`Scratch`, one per device and dtype) and the views of each class and target,
    made once: a class without padding is one view, unbound into its targets (no view per item)."""
    for device, dtype, total, classes in layout.devices:
        scratch = Scratch(total, dtype, device)
        flat, views = scratch.tensor, []
        for shape, members, size, offset in classes:
            numel = shape.numel()
            if size == numel:
                stack = flat[offset : offset + size * len(members)].view(len(members), *shape)
                layout.stacks[id(members[0])] = (members, stack)
                views += zip(members, stack.unbind(0))
                continue
            views += (
                (it, flat[offset + k * size : offset + k * size + numel].view(shape)) for k, it in enumerate(members)
            )
        layout.carved.append((scratch, views))


def give_back(project_layout: ProjectLayout | None, stand_in_layout: StandInLayout | None) -> None:
    """Give a kept step's layouts' buffers back at the end of the step (None: none made)."""
    for layout in (project_layout, stand_in_layout):
        if layout is not None:
            layout.give_back()


def finished_in_batches(p: torch.Tensor, state: dict[str, Any], mode: str) -> bool:
    """Does :func:`finish_many` take unsharded matrix ``p`` in a batch of its shape class (CUDA, contiguous, one
    side projected, rounded to nearest: ``mode``, its group's ``bf16_update``), rather than alone?"""
    from .. import rounding

    return batches(p) and p.is_contiguous() and state[pj.SIDE] != pj.BOTH and rounding.applied(mode, p) == "nearest"


def fused_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Does the fused apply kernel (:mod:`lowmemopt.kernels.unproject`) take a batch of ``dtype`` matrices on
    ``device`` (a CUDA device with Triton, or the CPU under a test's interpreter)?"""
    from ..pipeline import triton_usable

    if not triton_usable({device}):
        return False
    from ..kernels.unproject import DTYPES

    return dtype in DTYPES


@dataclass(eq=False)
class FinishLayout:
    """How :func:`finish_many` takes its items: ``alone`` (finished one by one) and ``chunks`` (the matrices of one
    shape, side, dtype and param group), each with a dict its fused apply pass keeps its launch in."""

    alone: list[Item] = field(default_factory=list)
    #: (items, side, product dtype, fused apply, their parameters as matrices, the apply pass's memo)
    chunks: list[tuple[list[Item], int, torch.dtype | None, bool, list[torch.Tensor], dict]] = field(
        default_factory=list
    )
    #: per chunk, the chunk of a project layout with the same items and product dtype (its stacked bases serve
    #: again), or None; made for the project layout ``projected`` (by identity)
    same: list[int | None] = field(default_factory=list)
    projected: ProjectLayout | None = None


def _same_chunks(layout: FinishLayout, projected: ProjectLayout) -> None:
    """Pair each chunk of ``layout`` with the chunk of ``projected`` that holds the same items in the same order and
    product dtype (:attr:`FinishLayout.same`)."""
    by_items = {(tuple(map(id, chunk)), dtype): k for k, (chunk, _, dtype) in enumerate(projected.chunks)}
    layout.same = [by_items.get((tuple(map(id, chunk)), dtype)) for chunk, _, dtype, *_ in layout.chunks]
    layout.projected = projected


def _rows_of(chunk: list[Item], memo: dict) -> Sequence[int]:
    """The chunk's rows in the step's flags: a ``range`` where they follow one another (a slice of the flags),
    kept in ``memo`` for the same rows."""
    rows = [it.flag for it in chunk]
    kept = memo.get("rows")
    if kept is None or len(kept) != len(rows) or list(kept) != rows:
        first = rows[0]
        kept = memo["rows"] = range(first, first + len(rows)) if rows == list(range(first, first + len(rows))) else rows
    return kept


def _finish_layout(items: list[Item]) -> FinishLayout:
    layout = FinishLayout()
    classes: dict[tuple, list[Item]] = {}
    for it in items:
        p = it.param
        if it.extra["shards"] is None and finished_in_batches(p, it.state, it.record.rounding):
            key = (
                p.device,
                p.dtype,
                tuple(p.shape),
                it.state[pj.SIDE],
                it.extra["shapes"][pj.PROJ],
                storage.stored_bits(it.state, pj.PROJ),
                id(it.extra["outer"]),
                it.extra["dtype"],
            )
            classes.setdefault(key, []).append(it)
        else:
            layout.alone.append(it)
    for (device, p_dtype, shape, side, _, _, _, dtype), members in classes.items():
        apply = fused_apply(device, p_dtype)
        m, n = members[0].extra["m_local"], members[0].extra["n"]
        for chunk in _chunks(members, math.prod(shape)):
            params = [it.param if it.param.shape == (m, n) else it.param.view(m, n) for it in chunk]
            layout.chunks.append((chunk, side, dtype, apply, params, {}))
    return layout


def _targets(chunk: list[Item], dtype: torch.dtype, stand: StandInLayout | None) -> torch.Tensor:
    """The chunk's stand-ins stacked in ``dtype``: a view of the stand-in buffer where possible, else a stacked copy."""
    if stand is not None:
        for members, stack in stand.stacks.values():
            for start, it in enumerate(members):
                if it is chunk[0]:
                    end = start + len(chunk)
                    if end <= len(members) and all(map(operator.is_, members[start:end], chunk)):
                        return stack[start:end].to(dtype)
                    break
    return stacked([it.target for it in chunk], dtype)


def finish_many(
    plan: Plan,
    items: list[Item],
    flags: torch.Tensor | None = None,
    layout: FinishLayout | None = None,
    projected: ProjectLayout | None = None,
    stand: StandInLayout | None = None,
) -> FinishLayout:
    """:func:`.apply.finish` for items whose target holds the low-rank update: on CUDA one batched product back and one
    multi-tensor pass (:mod:`lowmemopt.kernels.unproject`) per shape class (equal to the per-matrix sums within fp32
    rounding), elsewhere one by one. ``flags``: device finiteness flags (a skipped item is left as it is);
    ``projected``, ``stand``: this step's layouts of :func:`project_gradients` and :func:`stand_ins`. Returns the
    layout.
    """
    if layout is None:
        layout = _finish_layout(items)
    if projected is not None and layout.projected is not projected:
        _same_chunks(layout, projected)
    for it in layout.alone:
        finish(plan, it)
    for k, (chunk, side, dtype, apply, params, memo) in enumerate(layout.chunks):
        first = chunk[0]
        if len(chunk) == 1 and not apply:
            finish(plan, first)
            continue
        target = dtype or torch.float32  # proj_dtype="param": bf16 products
        if len(chunk) == 1:  # one product, no stacked copies (a per-layer hook's matrix, a class of one)
            basis = pj.decoded(first.state, first.extra["shapes"])[pj.PROJ].to(target).t()
            low = first.target.to(target)
            update = (basis @ low if side == pj.LEFT else low @ basis).unsqueeze(0)
        else:
            same = layout.same[k] if projected is not None else None
            basis = projected.bases[same] if same is not None else None
            if basis is None:
                basis = _bases_of(chunk, target)
            basis = basis.transpose(1, 2)  # P (m x k) or Q (k x n)
            low = _targets(chunk, target, stand)
            update = torch.bmm(basis, low) if side == pj.LEFT else torch.bmm(low, basis)
        scale = first.extra["outer"]["scale"]
        decay = first.extra["decay"]
        c = first.extra["math_decay"]  # per matrix (a 0-dim tensor each) or one number for the group
        if isinstance(c, torch.Tensor):
            c = torch.stack([it.extra["math_decay"] for it in chunk])
        flagged = flags is not None and first.flag is not None
        if apply:  # one pass: read U and p, write p
            from ..kernels.unproject import apply_updates

            apply_updates(
                params,
                update,
                scale,
                decay,
                c,
                flags if flagged else None,
                _rows_of(chunk, memo) if flagged else (),
                memo,
            )
            continue
        if flagged:  # (device_may_check sends only what the fused pass takes)
            raise RuntimeError("GaLore: a parameter checked on the device reached an apply that ignores its flag")
        update = update.to(math_dtype(params[0].dtype)).mul_(scale)
        if params[0].dtype in (torch.float32, torch.float64):  # (their math's dtype: stepped in place)
            if c is not None:
                if isinstance(c, torch.Tensor):
                    torch._foreach_addcmul_(params, params, list(c.unbind(0)))
                else:
                    torch._foreach_add_(params, params, alpha=c)
            if decay != 1.0:
                torch._foreach_mul_(params, decay)
            torch._foreach_add_(params, list(update.unbind(0)))
        else:
            p32 = torch.stack(params).float()
            if c is not None:
                _decay_rows(p32, c.view(-1, 1, 1) if isinstance(c, torch.Tensor) else c)
            if decay != 1.0:
                p32.mul_(decay)
            p32.add_(update)
            torch._foreach_copy_(params, list(p32.unbind(0)))
    return layout
