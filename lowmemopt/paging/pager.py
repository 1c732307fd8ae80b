"""The residency manager (:class:`Pager`), one per optimizer with a paged param group: between steps a paged
parameter's ``optimizer.state`` holds its *homes* (:mod:`.homes`); during ``step()`` :meth:`Pager.batches` hands the
pipeline its parameters in buckets with working copies on the device, moved by :mod:`.engine` on :mod:`.schedule`'s
plan; :mod:`.residency` decides what stays resident. How a step runs, loads and errors: docs/paging.md.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Iterable, Iterator, Protocol

import torch

from .engine import BucketInFlight, Mover
from .entry import Entry
from .homes import CopyFiles, Homes, drop_tensor_pages, transfer
from .next_pass import NextPass
from .options import check_paging, tier_of
from .placement import (
    FirstState,
    brought_back,
    buckets_of,
    check_plain,
    choose_resident,
    fill_homes,
    initial_layout,
    largest_buckets,
    make_homes,
    mesh_weight,
    nbytes_of,
    on_device,
    on_mesh,
    pageable,
    remember,
    tensors_of,
)
from ..work.record import param_place
from .residency import AUTO, AutoRoom, PagingReport, build_report, evictions, probe

__all__ = ["Entry", "Pager", "StateOwner", "LOOKAHEAD"]

#: buckets on their way ahead of the one updating, at most (and as the device's slots allow): the next one's copy
#: issued, the one after read from its files
LOOKAHEAD = 2
#: a bucket of moving state, until a step says (the pipeline's PAGE_BUCKET_BYTES): sizes the in-flight buffers
_DEFAULT_BUCKET_BYTES = 64 << 20
#: buckets of CPU parameters hold at most this much state (the host's memory holds two: the one updating and the one
#: read ahead; smaller ones overlap the files' reads and writes with the update sooner)
HOST_BUCKET_BYTES = 32 << 20

Work = list[tuple[torch.Tensor, dict[str, Any]]]


class StateOwner(Protocol):
    """What the pager reads of the optimizer it serves (by weak reference): state and param groups."""

    state: Any
    param_groups: list[dict[str, Any]]


def _reraise(e: BaseException, note: str) -> None:
    if isinstance(e, OSError) and e.errno is not None:
        raise type(e)(e.errno, f"{e.strerror}; {note}", *([e.filename] if e.filename is not None else [])) from e
    raise e


class Pager:
    """Residency manager of one optimizer's paged state (docs/paging.md#how-a-step-runs)."""

    def __init__(self, optimizer: StateOwner) -> None:
        self._optimizer = weakref.ref(optimizer)  # no strong reference: the finalizer below must not keep it alive
        self.homes = Homes()
        self.entries: dict[torch.Tensor, Entry] = {}
        self.movers: dict[torch.device, Mover] = {}
        self.rooms: dict[torch.device, AutoRoom] = {}  # "auto" residency per CUDA device
        self.staged: dict[torch.Tensor, Entry] = {}  # made by a load, installed by reconcile()
        self.bucket_bytes = _DEFAULT_BUCKET_BYTES
        self.copy_files: CopyFiles | None = None  # (the last pass's: batches())
        self.closed = False
        self.next_pass = NextPass()  # the next pass's first bucket, on its way
        self._first_state = remember(None)  # the last step's first_state (for layouts of state loaded later)
        self._finalizer = weakref.finalize(optimizer, self.close)

    # -- the step ----------------------------------------------------------------------------------------------------

    def begin(self, work: Work, first_state: FirstState | None = None) -> bool:
        """Check the parameters about to step and make homes for state not placed yet, raising (ValueError, TypeError,
        OSError) before anything changes; then raise a failed write-back and let ``"auto"`` evict.

        Returns:
            Whether any state of ``work`` moves this step (False: an unpaged step); with a DTensor in a paged group,
            True on every rank (what stays resident is each rank's choice, the way through the step must be common).
        """
        if self.closed:
            raise RuntimeError("this optimizer was closed (close() freed its paged state); create a new one")
        opt = self._opt()
        self._first_state = remember(first_state) if first_state is not None else self._first_state
        fresh, unpaged = [], []  # (unpaged: state of a group paged=False since, coming back to its device)
        moves = False  # (any state of work's that moves this step: begin's answer)
        alike = False  # (a DTensor in a paged group: every rank steps through the batches)
        for p, group in work:
            tier = tier_of(group)
            if tier is None:
                if p in self.entries:
                    unpaged.append(p)
                continue
            alike = alike or on_mesh(p)
            entry = self.entries.get(p)
            if entry is not None and entry.device != p.device:
                raise ValueError(
                    f"{self._where(p)} moved from {entry.device} to {p.device} since its paged optimizer state was "
                    "made; the state was left as it was. Move the parameter back, or re-home the state after moving "
                    "it: optimizer.load_state_dict(optimizer.state_dict())"
                )
            if not pageable(p):
                raise TypeError(
                    f"paged optimizer state needs plain tensors or DTensors as parameters; {self._where(p)} is a "
                    f"{type(p).__name__} (another tensor subclass): use paged=False for its group"
                )
            if entry is not None and entry.resident:  # (the steady case: nothing to place, nothing moves)
                continue
            moves = True
            current = opt.state.get(p)
            if (
                entry is not None
                and entry.tier == tier
                and (current is entry.state or (entry.state is None and not current))
            ):
                continue
            # new, its group's tier changed, or the state was replaced by a route that bypassed the load hooks: home it
            fresh.append((p, group, tier, current if current else None))
        for group in {id(g): g for _, g, _, _ in fresh}.values():  # (its options may have changed since: checked)
            check_paging(group, writable=False)
        self.check_writes()
        if unpaged:
            self._drop_early()
            for p in unpaged:
                self._unpage(p)
        if fresh:
            self._drop_early()
            made = self._place(fresh, first_state)
            for p in made:
                old = self.entries.pop(p, None)
                if old is not None:
                    self._free(old)
                self.entries[p] = made[p]
                if made[p].state is not None:
                    opt.state[p] = made[p].state
        if self._evict_where_short(work) or alike:
            return True
        return self.moves_any(work) if fresh else moves

    def batches(self, todo: Work, bucket_bytes: int, copy_files: CopyFiles | None = None) -> Iterator[Work]:
        """Yield ``todo`` in batches whose state is on their device in ``optimizer.state`` (working copies), while the
        next ones are on their way (:data:`LOOKAHEAD`); a batch is written back when the next is asked for.

        A batch holds paged params of one device and tier up to ``bucket_bytes`` (0: one per batch); params whose state
        does not move ride in the first. If the caller fails, that batch's homes keep the state from before the step.
        ``copy_files``: the disk tier's file copies of CPU parameters on the update's threads (None: one after another).
        """
        if bucket_bytes:
            self.bucket_bytes = bucket_bytes
        self.copy_files = copy_files
        for mover in self.movers.values():
            mover.copy_files = copy_files
        chunks = buckets_of(todo, self.entries, bucket_bytes, HOST_BUCKET_BYTES)
        moving = [[p for p, _ in chunk if self._moves(p)] for chunk in chunks]
        for device, nbytes in largest_buckets(moving, self.entries).items():
            self._mover(device).reserve(nbytes)
        handles = self.next_pass.adopt(moving[0] if moving else [], self._discard)
        positions, count = [], {}  # each bucket's place among its device's buckets of this pass
        for params in moving:
            device = self.entries[params[0]].device if params else None
            positions.append(count.get(device, 0))
            count[device] = positions[-1] + 1
        finished = False
        try:
            for k, chunk in enumerate(chunks):
                for j in range(k, min(len(chunks), k + LOOKAHEAD + 1)):
                    if j not in handles and moving[j]:
                        mover = self._mover_of(moving[j])
                        if not mover.can_prefetch():  # (its slots are held by the buckets before: later then)
                            break
                        handles[j] = mover.prefetch([self.entries[p] for p in moving[j]], positions[j])
                if k + 1 in handles:
                    self._mover_of(moving[k + 1]).advance(handles[k + 1])
                bucket = handles.pop(k, None)
                done = False
                try:
                    if bucket is not None:
                        self._load(moving[k], bucket)
                    yield chunk
                    done = True
                finally:
                    if bucket is not None:
                        if done:
                            self._store(moving[k], bucket)
                        else:
                            for p in moving[k]:
                                self._abort(p)
                            self._mover_of(moving[k]).discard(bucket)
            finished = True
        finally:
            for j, bucket in handles.items():
                self._mover_of(moving[j]).discard(bucket)
            for device, mover in self.movers.items():
                if device.type == "cpu":  # the step's files are written when it returns (no stream to order them)
                    mover.settle()
            if finished:  # (after a failure, the first error stands; a failed write-back is raised next time)
                self.check_writes()
        passed = [ps for ps in moving if ps]
        self._prefetch_next(self.next_pass.ended(passed[-1] if passed else None))

    def _discard(self, params: list[torch.Tensor], bucket: BucketInFlight) -> None:
        self._mover_of(params).discard(bucket)

    def _prefetch_next(self, params: list[torch.Tensor] | None) -> None:
        if not params or self.closed or any(not self._moves(p) or self.entries[p].state is None for p in params):
            return
        if len({(self.entries[p].device, self.entries[p].tier) for p in params}) != 1:
            return
        self.next_pass.early = (params, self._mover_of(params).prefetch([self.entries[p] for p in params], 0))

    def _drop_early(self) -> None:
        early = self.next_pass.take()
        if early is not None:
            mover = self._mover_of(early[0])
            mover.discard(early[1])
            mover.settle()  # its copies read homes that are about to change

    def moves_any(self, work: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> bool:
        """Whether any state of ``work`` may move this step (else the step runs exactly as unpaged)."""
        for p, group in work:
            entry = self.entries.get(p)
            if tier_of(group) is None:
                if entry is not None:  # (paged=False since: its state comes back to the device, in begin())
                    return True
            elif entry is None or not entry.resident:
                return True
        return False

    def _moves(self, p: torch.Tensor) -> bool:
        entry = self.entries.get(p)
        return entry is not None and not entry.resident

    def _load(self, params: list[torch.Tensor], bucket: BucketInFlight) -> None:
        opt = self._opt()
        working = self._mover_of(params).load(bucket)
        for p in params:
            entry = self.entries[p]
            state = entry.working = entry.working if entry.working is not None else {}
            state.clear()
            if entry.state is not None:  # (else the first step: the optimizer makes the state, in this dict)
                tensors = working.get(entry, {})
                state.update({k: tensors.get(k, v) for k, v in entry.state.items()})
            opt.state[p] = state

    def _store(self, params: list[torch.Tensor], bucket: BucketInFlight) -> None:
        """Write a bucket back and install the homes; a param without room for one stays resident."""
        opt = self._opt()
        items, installs, error = [], [], None
        for p in params:
            entry, working = self.entries[p], opt.state[p]
            tensors, homes = tensors_of(working), entry.home_tensors()
            changed = {
                k: t
                for k, t in tensors.items()
                if k not in homes or homes[k].shape != t.shape or homes[k].dtype != t.dtype
            }
            made: dict[str, torch.Tensor] = {}
            try:
                for k, t in changed.items():  # tensors new or re-shaped since the last write-back (rare)
                    made[k] = self._alloc(entry, k, t)
                stale = [homes[k] for k in homes if k not in tensors or k in made]
                if stale:
                    self._settle(entry)
                    for t in stale:
                        self.homes.free(t)
            except BaseException as e:  # noqa: BLE001 - no room for a new home (disk full): raised below
                for t in made.values():
                    self.homes.free(t)
                self._make_resident(p, entry, working)
                error = error or (e, p)
                continue
            homes.update(made)
            items.append((entry, [(k, t, homes[k]) for k, t in tensors.items()]))
            installs.append((p, entry, working, homes, tensors))
        self._mover_of(params).store(bucket, items)
        for p, entry, working, homes, tensors in installs:
            state = entry.state if entry.state is not None else {}
            state.clear()
            state.update({k: homes[k] if k in tensors else v for k, v in working.items()})
            entry.state, entry.reserved = state, None
            opt.state[p] = state
            if working is entry.working:
                working.clear()  # (its tensors go: the first step's state, made on the device, is freed)
        if error is not None:
            _reraise(
                error[0], f"{self._where(error[1])} was updated; its state stays on {error[1].device}, no longer paged"
            )

    def check_writes(self) -> None:
        """Raise the first failed write-back, after keeping each such param's state on its device (resident)."""
        error = None
        for mover in self.movers.values():
            failed, mover.failed = mover.failed, []
            for entry, tensors, e in failed:
                p = next((q for q, en in self.entries.items() if en is entry), None)
                if p is None or entry.state is None:
                    continue
                state = {k: tensors[k].to(entry.device) if k in tensors else v for k, v in entry.state.items()}
                self._make_resident(p, entry, state)
                error = error or (e, p)
        if error is not None:
            _reraise(
                error[0], f"{self._where(error[1])} was updated; its state stays on {error[1].device}, no longer paged"
            )

    def _abort(self, p: torch.Tensor) -> None:
        entry, opt = self.entries[p], self._opt()
        if entry.working is not None:
            entry.working.clear()
        if entry.state is None:
            opt.state.pop(p, None)
        else:
            opt.state[p] = entry.state

    def _unpage(self, p: torch.Tensor) -> None:
        """``p``'s group is no longer paged: its state comes back to its device as copies, and its homes are freed."""
        opt, entry = self._opt(), self.entries.pop(p)
        state = opt.state.get(p)
        if not entry.resident and state is not None and state is entry.state:
            self._settle(entry)
            opt.state[p] = brought_back(self.homes, state, p.device)
        self._free(entry)

    def _make_resident(self, p: torch.Tensor, entry: Entry, working: dict[str, Any]) -> None:
        self._free(entry)
        # own copies: working tensors may be views into a buffer the mover reuses for the next bucket
        working = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in working.items()}
        if entry.working is not None:
            entry.working.clear()
        entry.state, entry.reserved, entry.resident = working, None, True
        entry.nbytes = nbytes_of(tensors_of(working))
        self._opt().state[p] = working

    # -- placement and residency -------------------------------------------------------------------------------------

    def _place(
        self,
        items: list[tuple[torch.Tensor, dict[str, Any], str, dict[str, Any] | None]],
        first_state: FirstState | None = None,
        resident_ok: bool = True,
    ) -> dict[torch.Tensor, Entry]:
        """New entries for ``items``: residency by the budget, homes allocated and filled. All or nothing."""
        opt = self._opt()
        index = {id(g): gi for gi, g in enumerate(opt.param_groups)}
        position = {id(q): pi for g in opt.param_groups for pi, q in enumerate(g["params"])}
        layouts = {}
        for p, group, tier, state in items:
            layouts[p] = tensors_of(state) if state is not None else initial_layout(opt.state, p, group, first_state)
        resident = set()
        if resident_ok:
            resident = choose_resident(items, layouts, self.entries, self.rooms, self.bucket_bytes)
        made: dict[torch.Tensor, Entry] = {}
        try:
            for p, group, tier, state in items:
                offload_dir = os.fspath(group["offload_dir"]) if group.get("offload_dir") is not None else None
                label = f"g{index.get(id(group), -1)}.p{position.get(id(p), -1)}"
                weight = mesh_weight(opt.state, p, group, first_state or self._first_state())
                made[p] = Entry(tier, p.device, p in resident, offload_dir, label, nbytes_of(layouts[p] or {}), weight)
                if made[p].resident and state is not None:
                    made[p].state = {k: on_device(v, p.device) for k, v in state.items()}
            paged = [(made[p], layouts[p] or {}) for p, _, _, _ in items if not made[p].resident]
            make_homes(self.homes, paged, self._alloc)
            for p, _, _, state in items:
                entry = made[p]
                if entry.resident or state is None:
                    continue
                fill_homes(self.homes, entry.reserved, layouts[p])
                entry.state, entry.reserved = {k: entry.reserved.get(k, v) for k, v in state.items()}, None
        except BaseException as e:
            for entry in made.values():
                self._free(entry)
            _reraise(e, "the optimizer and its state were left as they were")
        return made

    def _evict_where_short(self, work: Work) -> bool:
        """``"auto"``: evict resident state where a device is short; returns whether it evicted."""
        evicted = False
        for device in {p.device for p, _ in work if p.device in self.rooms}:
            memory = probe(device)
            need = self.rooms[device].excess(memory) if memory is not None else 0
            if need <= 0:
                continue
            opt = self._opt()
            groups = {
                id(q): g
                for g in opt.param_groups
                for q in g["params"]
                if g.get("page_budget_bytes", AUTO) == AUTO and tier_of(g) is not None
            }
            held = {
                p: nbytes_of(tensors_of(opt.state[p]))
                for p, e in self.entries.items()
                if e.resident and e.device == device and id(p) in groups and opt.state.get(p)
            }
            for p in evictions(list(held.items()), need):
                self._evict(p, groups[id(p)])  # (first: one that fails, a full disk, is tried again next step)
                self.rooms[device].evicted(held[p])
                evicted = True
        return evicted

    def _evict(self, p: torch.Tensor, group: dict[str, Any]) -> None:
        opt, old = self._opt(), self.entries[p]
        entry = self._place([(p, group, old.tier, opt.state[p])], resident_ok=False)[p]
        self.entries[p] = entry
        opt.state[p] = entry.state

    def _alloc(self, entry: Entry, key: str, like: torch.Tensor) -> torch.Tensor:
        check_plain(key, like)
        if entry.tier == "disk":
            return self.homes.file(like.shape, like.dtype, entry.offload_dir, f"{entry.label}.{key}")
        return self.homes.host(like.shape, like.dtype, pin=entry.device.type == "cuda")

    def report(self) -> PagingReport:
        """Where each paged parameter's state is, and what each device holds (:class:`PagingReport`)."""
        groups = {id(q): g for g in self._opt().param_groups for q in g["params"]}
        pools = {device: mover.pool_bytes() for device, mover in self.movers.items()}
        return build_report(self.entries, groups, pools, self.rooms)

    # -- loads -------------------------------------------------------------------------------------------------------

    def stage(self, items: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]) -> dict[torch.Tensor, dict]:
        """New state for the paged params among ``items`` (param, group, loaded state), resident or in new homes.

        Returns:
            {param: state to install}; nothing is installed (:meth:`reconcile` adopts it). All or nothing.
        """
        if self.closed:
            raise RuntimeError("this optimizer was closed (close() freed its paged state); create a new one")
        self.discard_staged()
        self._drop_early()
        todo = [(p, group, tier_of(group), state) for p, group, state in items if tier_of(group) and state]
        # placed again, their current entries set aside so that their own bytes do not count against the budget
        saved = {p: self.entries.pop(p) for p, _, _, _ in todo if p in self.entries}
        try:
            made = self._place(todo)
        finally:
            self.entries.update(saved)
        self.staged = made
        return {p: e.state for p, e in made.items()}

    def reconcile(self) -> None:
        """After a load: adopt the staged states the optimizer installed, free homes whose state it no longer holds."""
        opt = self._opt()
        for p, entry in self.staged.items():
            if opt.state.get(p) is entry.state:
                old = self.entries.get(p)
                if old is not None:
                    self._free(old)
                self.entries[p] = entry
            else:
                self._free(entry)
        self.staged = {}
        for p, entry in list(self.entries.items()):
            if not entry.resident and entry.state is not None and opt.state.get(p) is not entry.state:
                self._free(entry)
                del self.entries[p]

    def discard_staged(self) -> None:
        for entry in self.staged.values():
            self._free(entry)
        self.staged = {}

    def is_staged(self, p: torch.Tensor, state: Any) -> bool:
        entry = self.staged.get(p)
        return entry is not None and entry.state is state

    # -- state_dict, pages, settling ---------------------------------------------------------------------------------

    def settle(self) -> None:
        """Wait until every write-back has reached its home; a failed one is raised."""
        for mover in self.movers.values():
            mover.settle()
        self.check_writes()

    def detach_files(self, state_dict: dict[str, Any]) -> None:
        """For ``state_dict()``: file-backed homes replaced by copies, in new dicts."""
        self.settle()
        opt = self._opt()
        for group, saved in zip(opt.param_groups, state_dict["param_groups"]):
            for p, key in zip(group["params"], saved["params"]):
                state = state_dict["state"].get(key)
                if not isinstance(state, dict) or not any(
                    isinstance(v, torch.Tensor) and self.homes.is_file(v) for v in state.values()
                ):
                    continue
                copy = {}
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and self.homes.is_file(v):
                        copy[k] = torch.empty_like(v)
                        transfer(self.homes, copy[k], v)
                    else:
                        copy[k] = v
                state_dict["state"][key] = copy

    def drop_pages(self, state: dict[str, Any] | None = None) -> None:
        """Unmap the file pages of ``state`` (default: of every home) from the process."""
        states = [state] if state is not None else [e.state for e in self.entries.values()]
        for st in states:
            for t in tensors_of(st).values():
                drop_tensor_pages(self.homes, t)

    def where_state_lives(self, p: torch.Tensor) -> str:
        """``"device"`` (unpaged or resident), ``"cpu"`` or ``"disk"``: where ``p``'s state is between steps."""
        entry = self.entries.get(p)
        if entry is None or entry.resident:
            return "device"
        return entry.tier

    # -- freeing -----------------------------------------------------------------------------------------------------

    def _settle(self, entry: Entry) -> None:
        mover = self.movers.get(entry.device)
        if mover is not None:
            mover.settle(entry)

    def _free(self, entry: Entry) -> None:
        if entry.resident:
            return
        self._settle(entry)
        mover = self.movers.get(entry.device)
        if mover is not None:
            mover.forget(entry)
        for t in entry.home_tensors().values():
            self.homes.free(t)
        entry.reserved = None

    def close(self, keep_files: bool = False) -> None:
        """Free every home and drop the paged state (files kept with ``keep_files``); idempotent."""
        if self.closed:
            return
        self.closed = True
        self.next_pass.early = None
        for mover in self.movers.values():
            try:
                mover.close()
            except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be torn down
                pass
        opt = self._optimizer()
        manifest = []
        tensors = []
        for p, entry in list(self.entries.items()) + list(self.staged.items()):
            for key, t in entry.home_tensors().items():
                tensors.append(t)
                path = self.homes.path(t)
                if keep_files and path is not None:
                    step = (entry.state or {}).get("step")
                    manifest.append(
                        dict(
                            file=path,
                            param=entry.label,
                            key=key,
                            step=step,
                            dtype=str(t.dtype).replace("torch.", ""),
                            shape=list(t.shape),
                        )
                    )
            if opt is not None and not entry.resident:
                opt.state.pop(p, None)
        self.entries.clear()
        self.staged = {}
        self.movers.clear()  # streams, slots, staging, I/O threads
        self.homes.close(tensors, keep_files=keep_files, manifest=manifest)
        self._finalizer.detach()

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _opt(self) -> StateOwner:
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the optimizer of this pager no longer exists")
        return opt

    def _mover(self, device: torch.device) -> Mover:
        mover = self.movers.get(device)
        if mover is None:
            mover = self.movers[device] = Mover(self.homes, device)
            mover.copy_files = self.copy_files
        return mover

    def _mover_of(self, params: list[torch.Tensor]) -> Mover:
        return self._mover(self.entries[params[0]].device)

    def _where(self, p: torch.Tensor) -> str:
        opt = self._optimizer()
        return param_place(opt.param_groups if opt is not None else [], p)
