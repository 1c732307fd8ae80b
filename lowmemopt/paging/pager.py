"""The residency manager: one per optimizer that has a paged param group.

Between steps, a paged parameter's entry in ``optimizer.state`` holds its *home* tensors (host RAM or file-backed,
see :mod:`~lowmemopt.paging.homes`) and its ints, under the usual keys: the state is still plain named tensors, whatever
they are called (``exp_avg.codes``, a GaLore projector, ...). Nothing here looks at slot names.

During ``step()`` (see :meth:`Pager.batches`), for each batch of parameters in turn (the step pipeline's *stage*
and *write back*, :mod:`lowmemopt.pipeline`)::

    fetch(batch):   optimizer.state[p] = working copy on p's device (already prefetched, or loaded now);
                    start prefetching the next batch's state
    the pipeline's update of the batch: one fused backend call per bucket (or the per-parameter path)
    release(batch): write the working copies back to their homes (asynchronously on CUDA);
                    optimizer.state[p] = home state

Before anything changes, :meth:`Pager.begin` checks every parameter (its device is the one its state was made for)
and makes room for state that does not exist yet (files are created and their space reserved), so a full disk or an
unwritable ``offload_dir`` raises while the optimizer is still as it was.

Budget: within a param group, state of up to ``page_budget_bytes`` stays *resident* on the parameter's device (as if
unpaged). The choice is made once per parameter, when the manager first sees it: a group's new parameters are taken
smallest first (the most parameters per byte, each one a transfer saved every step) while they fit.

Loads: ``load_state_dict`` and :func:`lowmemopt.load_state` place loaded state straight into new homes
(:meth:`Pager.stage`), then swap them in (:meth:`Pager.reconcile`) and free the old ones, so state stays paged after
a load and is never gathered whole on the device. State put in ``optimizer.state`` by any other route is noticed at
the next step and moved to a home.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterable, Iterator, Protocol

import torch

from .entry import Entry
from .homes import Homes, drop_pages, transfer
from .movers import CudaMover, HostMover, mover_for
from .options import tier_of

__all__ = ["Entry", "Pager", "StateOwner"]


class StateOwner(Protocol):
    """What the pager reads of the optimizer whose state it keeps (held by a weak reference): the state dict it
    installs working copies and homes in, and the param groups (options, labels of files)."""

    state: Any
    param_groups: list[dict[str, Any]]


#: ``first_state(p, group)``: the state ``p``'s first step makes, in ``state[p]`` (on a meta twin: shapes only)
FirstState = Callable[[torch.Tensor, dict[str, Any]], dict[str, Any]]


def _tensors(state: dict[str, Any] | None) -> dict[str, torch.Tensor]:
    return {k: v for k, v in (state or {}).items() if isinstance(v, torch.Tensor)}


def _reraise(e: BaseException, note: str) -> None:
    """Raise ``e`` again; an OSError gets ``note`` (what happened to the state) added to its message."""
    if isinstance(e, OSError) and e.errno is not None:
        raise type(e)(e.errno, f"{e.strerror}; {note}") from e
    raise e


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class Pager:
    """Residency manager of one optimizer's paged state. See the module docstring."""

    def __init__(self, optimizer: StateOwner) -> None:
        self._optimizer = weakref.ref(optimizer)  # no strong reference: the finalizer below must not keep it alive
        self.homes = Homes()
        self.entries: dict[torch.Tensor, Entry] = {}
        self.movers: dict[torch.device, HostMover | CudaMover] = {}
        self.inflight: dict[torch.Tensor, Any] = {}  # prefetched, not yet fetched
        self.staged: dict[torch.Tensor, Entry] = {}  # made by a load, installed by reconcile()
        self.closed = False
        self._finalizer = weakref.finalize(optimizer, self.close)

    # -- the step ----------------------------------------------------------------------------------------------------

    def begin(self, work: list[tuple[torch.Tensor, dict[str, Any]]], first_state: FirstState | None = None) -> None:
        """Check the parameters about to step and make homes for state the manager has not placed yet (a parameter
        without state: homes laid out by ``first_state`` on a meta twin, or made at its first write-back). Raises
        (ValueError, TypeError, OSError) before anything is changed."""
        if self.closed:
            raise RuntimeError("this optimizer was closed (close() freed its paged state); create a new one")
        opt = self._opt()
        fresh = []
        for p, group in work:
            tier = tier_of(group)
            if tier is None:
                continue
            entry = self.entries.get(p)
            if entry is not None and entry.device != p.device:
                raise ValueError(
                    f"{self._where(p)} moved from {entry.device} to {p.device} since its paged optimizer state was "
                    "made; the state was left as it was. Move the parameter back, or re-home the state after moving "
                    "it: optimizer.load_state_dict(optimizer.state_dict())"
                )
            if type(p).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
                raise TypeError(
                    f"paged optimizer state needs plain tensors as parameters; {self._where(p)} is a "
                    f"{type(p).__name__} (a tensor subclass such as DTensor): use paged=False for its group"
                )
            current = opt.state.get(p)
            if entry is not None:
                if entry.resident or current is entry.state or (entry.state is None and not current):
                    continue
                # the state was replaced by a route that bypassed the load hooks: give it a home now
            fresh.append((p, group, tier, current if current else None))
        if fresh:
            made = self._place(fresh, first_state)
            for p in made:
                old = self.entries.pop(p, None)
                if old is not None:
                    self._free(old)
                self.entries[p] = made[p]
                if made[p].state is not None:
                    opt.state[p] = made[p].state

    def steps(self, todo: list[tuple[torch.Tensor, dict[str, Any]]]) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
        """Yield each (param, group) of ``todo`` with its state on the param's device in ``optimizer.state``, the
        next one's already on its way; write it back when the caller asks for the next. If the caller fails during a
        param, that param's home keeps the state it had before the step."""
        for batch in self.batches(todo, 0):
            yield from batch

    def batches(self, todo: list[tuple[torch.Tensor, dict[str, Any]]],
                bucket_bytes: int) -> Iterator[list[tuple[torch.Tensor, dict[str, Any]]]]:
        """Yield ``todo`` in consecutive batches, each with the state of its params on their device in
        ``optimizer.state`` (working copies), so that a backend can step the whole batch at once: the step
        pipeline's *stage* and *write back*. A batch holds paged params until their state reaches ``bucket_bytes``
        (at least one; 0: one param per batch); params whose state does not move (resident within the budget, or of an
        unpaged group) ride along in the first batch. While the caller steps one batch, the next one's state is
        already on its way (CUDA: on a side stream); a batch is written back when the caller asks for the next.

        Device memory for moving state is at most two batches (the one stepping and the one prefetched). If the
        caller fails during a batch, every param of that batch keeps in its home the state it had before the
        step."""
        chunks = self._chunks(todo, bucket_bytes)
        try:
            for k, chunk in enumerate(chunks):
                moving = [p for p, _ in chunk if self._moves(p)]
                for slot, p in enumerate(moving):
                    self._fetch(p, slot)
                if k + 1 < len(chunks):
                    for q, _ in chunks[k + 1]:
                        if self._moves(q) and q not in self.inflight and self.entries[q].state is not None:
                            self.inflight[q] = self._mover(q).prefetch(self.entries[q])
                done = False
                try:
                    yield chunk
                    done = True
                finally:
                    if done:
                        self._release_all(moving)
                    else:
                        for p in moving:
                            self._abort(p)
            for mover in self.movers.values():
                mover.poll()
        finally:
            for p, handle in self.inflight.items():
                self._mover(p).discard(handle)
            self.inflight.clear()

    def _chunks(self, todo: list[tuple[torch.Tensor, dict[str, Any]]],
                bucket_bytes: int) -> list[list[tuple[torch.Tensor, dict[str, Any]]]]:
        """Consecutive batches of ``todo`` (see :meth:`batches`)."""
        still = [item for item in todo if not self._moves(item[0])]
        chunks: list[list[tuple[torch.Tensor, dict[str, Any]]]] = []
        size = 0
        for item in todo:
            if not self._moves(item[0]):
                continue
            nbytes = _nbytes(self.entries[item[0]].home_tensors())
            if not chunks or size + nbytes > bucket_bytes:
                chunks.append([])
                size = 0
            chunks[-1].append(item)
            size += nbytes
        if still:
            if chunks:
                chunks[0] = still + chunks[0]
            else:
                chunks.append(still)
        return chunks

    def _release_all(self, moving: list[torch.Tensor]) -> None:
        """Write back every param of a batch; the first failure is raised after the others are written back."""
        error: BaseException | None = None
        for p in moving:
            try:
                self._release(p)
            except BaseException as e:  # noqa: BLE001 - re-raised below, once the rest of the batch is home
                error = error or e
        if error is not None:
            raise error

    def moves_any(self, work: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> bool:
        """May the state of any (param, group) of ``work`` move this step: paged and not resident within the budget,
        or paged and not placed yet (:meth:`begin` decides its residency)? When none does, a step runs exactly as
        unpaged (the pipeline's stage and write-back have nothing to do)."""
        for p, group in work:
            if tier_of(group) is None:
                continue
            entry = self.entries.get(p)
            if entry is None or not entry.resident:
                return True
        return False

    def _moves(self, p: torch.Tensor) -> bool:
        entry = self.entries.get(p)
        return entry is not None and not entry.resident

    def _fetch(self, p: torch.Tensor, slot: int = 0) -> None:
        """Install ``p``'s working state (``slot``: its position in the batch, for movers that reuse buffers)."""
        entry, opt = self.entries[p], self._opt()
        handle = self.inflight.pop(p, None)
        if entry.state is None:  # first step: the optimizer makes the state, in this dict, on the device
            self._mover(p).discard(handle)
            opt.state[p] = {}
            return
        tensors = self._mover(p).load(entry, handle, slot)
        opt.state[p] = {k: tensors.get(k, v) for k, v in entry.state.items()}

    def _release(self, p: torch.Tensor) -> None:
        entry, opt = self.entries[p], self._opt()
        working = opt.state[p]
        tensors = _tensors(working)
        homes = entry.home_tensors()
        changed = {k: t for k, t in tensors.items() if k not in homes or homes[k].shape != t.shape
                   or homes[k].dtype != t.dtype}
        made: dict[str, torch.Tensor] = {}
        try:
            for k, t in changed.items():  # tensors new or re-shaped since the last write-back (rare)
                made[k] = self._alloc(entry, k, t)
            stale = [homes[k] for k in homes if k not in tensors or k in made]
            if stale:
                self._settle(entry)
                for t in stale:
                    self.homes.free(t)
            homes.update(made)
            self._mover(p).store(entry, [(t, homes[k]) for k, t in tensors.items()])
        except BaseException as e:
            # no room for a new home (disk full) or an I/O error: the updated state stays with the parameter, on its
            # device, where it is consistent with the parameter's new value
            for t in made.values():
                self.homes.free(t)
            self._make_resident(p, entry, working)
            _reraise(e, f"{self._where(p)} was updated; its state stays on {p.device}, no longer paged")
        state = entry.state if entry.state is not None else {}
        state.clear()
        state.update({k: homes[k] if k in tensors else v for k, v in working.items()})
        entry.state, entry.reserved = state, None
        opt.state[p] = state

    def _abort(self, p: torch.Tensor) -> None:
        entry, opt = self.entries[p], self._opt()
        if entry.state is None:
            opt.state.pop(p, None)
        else:
            opt.state[p] = entry.state

    def _make_resident(self, p: torch.Tensor, entry: Entry, working: dict[str, Any]) -> None:
        self._free(entry)
        # own copies: working tensors may be views into a buffer the mover reuses for the next parameter
        working = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in working.items()}
        entry.state, entry.reserved, entry.resident = working, None, True
        entry.nbytes = _nbytes(_tensors(working))
        self._opt().state[p] = working

    # -- placement ---------------------------------------------------------------------------------------------------

    def _place(self, items: list[tuple[torch.Tensor, dict[str, Any], str, dict[str, Any] | None]],
               first_state: FirstState | None = None) -> dict[
        torch.Tensor, Entry
    ]:
        """New entries for ``items`` (param, group, tier, state or None for state not made yet): residency by the
        budget, homes allocated and filled from the given state (meta tensors: zeros). All or nothing: on error,
        everything allocated here is freed and the error raised."""
        opt = self._opt()
        index = {id(g): gi for gi, g in enumerate(opt.param_groups)}
        position = {id(q): pi for g in opt.param_groups for pi, q in enumerate(g["params"])}
        layouts = {}
        for p, group, tier, state in items:
            layouts[p] = _tensors(state) if state is not None else self._initial_layout(opt, p, group, first_state)
        resident = self._budget(items, layouts, index)
        made: dict[torch.Tensor, Entry] = {}
        try:
            for p, group, tier, state in items:
                offload_dir = os.fspath(group["offload_dir"]) if group.get("offload_dir") is not None else None
                label = f"g{index.get(id(group), -1)}.p{position.get(id(p), -1)}"
                entry = Entry(tier, p.device, p in resident, offload_dir, label, _nbytes(layouts[p] or {}))
                made[p] = entry
                if entry.resident:
                    if state is not None:
                        entry.state = {k: self._on_device(v, p.device) for k, v in state.items()}
                    continue
                layout = layouts[p] or {}
                homes = entry.reserved = {}  # filled one by one, so that a failure frees what was made
                for k, t in layout.items():
                    homes[k] = self._alloc(entry, k, t)
                if state is None:
                    continue
                for k, t in layout.items():
                    if t.device.type == "meta":
                        if not self.homes.is_file(homes[k]):
                            homes[k].zero_()
                    elif t.device.type == "cpu":
                        transfer(self.homes, homes[k], t)
                    else:
                        homes[k].copy_(t)
                    drop_pages(self.homes, homes[k])
                entry.state, entry.reserved = {k: homes.get(k, v) for k, v in state.items()}, None
        except BaseException as e:
            for entry in made.values():
                self._free(entry)
            _reraise(e, "the optimizer and its state were left as they were")
        return made

    def _budget(self, items, layouts, index) -> set[torch.Tensor]:
        """Parameters of ``items`` whose state stays resident: per group, smallest first, within what the group's
        ``page_budget_bytes`` leaves after its resident entries."""
        resident: set[torch.Tensor] = set()
        by_group: dict[int, list] = {}
        for p, group, _, _ in items:
            by_group.setdefault(id(group), []).append((p, group))
        for members in by_group.values():
            group = members[0][1]
            in_group = {id(q) for q in group["params"]}
            room = group.get("page_budget_bytes", 0) - sum(
                e.nbytes for q, e in self.entries.items() if e.resident and id(q) in in_group
            )
            sized = sorted(
                ((_nbytes(layouts[p]) if layouts[p] is not None else None, i, p) for i, (p, _) in enumerate(members)),
                key=lambda x: (x[0] is None, x[0] or 0, x[1]),
            )
            for nbytes, _, p in sized:
                if nbytes is None or nbytes > room:
                    break
                room -= nbytes
                resident.add(p)
        return resident

    @staticmethod
    def _initial_layout(opt: StateOwner, p: torch.Tensor, group: dict[str, Any],
                        first_state: FirstState | None) -> dict[str, torch.Tensor] | None:
        """The tensors ``p``'s first step will make, as meta tensors (no memory), found by running the optimizer's
        own initialization on a meta twin of ``p`` (``first_state``: GaLore's for a group with ``rank``). None if
        that fails (the homes are then made at the first write-back)."""
        twin = torch.empty_like(p, device="meta")
        try:
            if first_state is None:
                return None
            return _tensors(first_state(twin, group))
        except Exception:  # noqa: BLE001 - an algorithm whose state needs more than shapes
            return None
        finally:
            opt.state.pop(twin, None)

    def _alloc(self, entry: Entry, key: str, like: torch.Tensor) -> torch.Tensor:
        if like.layout != torch.strided or (type(like) is not torch.Tensor and like.device.type != "meta"):
            raise TypeError(f"paged optimizer state must be plain dense tensors; '{key}' is {type(like).__name__}")
        if entry.tier == "disk":
            return self.homes.file(like.shape, like.dtype, entry.offload_dir, f"{entry.label}.{key}")
        return self.homes.host(like.shape, like.dtype, pin=entry.device.type == "cuda")

    @staticmethod
    def _on_device(v: Any, device: torch.device) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if v.device.type == "meta":
            return torch.zeros(v.shape, dtype=v.dtype, device=device)
        return v.to(device)

    # -- loads -------------------------------------------------------------------------------------------------------

    def stage(self, items: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]) -> dict[torch.Tensor, dict]:
        """New state for the paged params among ``items`` (param, group, loaded state: tensors on any device, or meta
        tensors for zeros), placed where each param's state lives: resident on its device, or in a new home. Returns
        {param: state to install}. Nothing is installed: after the optimizer's state has been swapped,
        :meth:`reconcile` adopts the installed ones and frees the homes they replace. All or nothing."""
        if self.closed:
            raise RuntimeError("this optimizer was closed (close() freed its paged state); create a new one")
        self.discard_staged()
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
        """Wait until every write-back has reached its home (CUDA); host code may then read the homes."""
        for mover in self.movers.values():
            mover.settle()

    def detach_files(self, state_dict: dict[str, Any]) -> None:
        """In a ``state_dict()``: replace file-backed home tensors by ordinary copies (the files are rewritten by
        the next step and deleted on close). Entries are new dicts: the optimizer's own state is not touched."""
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
            for t in _tensors(st).values():
                drop_pages(self.homes, t)

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
        for t in entry.home_tensors().values():
            self.homes.free(t)
        entry.reserved = None

    def close(self, keep_files: bool = False) -> None:
        """Free every home (delete the files unless ``keep_files``; unregister pinned memory) and drop the paged
        state from the optimizer. Idempotent; also run when the optimizer is garbage-collected or Python exits."""
        if self.closed:
            return
        self.closed = True
        try:
            self.settle()
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
                    manifest.append(dict(file=path, param=entry.label, key=key, step=step,
                                         dtype=str(t.dtype).replace("torch.", ""), shape=list(t.shape)))
            if opt is not None and not entry.resident:
                opt.state.pop(p, None)
        self.entries.clear()
        self.staged = {}
        self.inflight.clear()
        self.movers.clear()  # streams, the CPU working buffer
        self.homes.close(tensors, keep_files=keep_files, manifest=manifest)
        self._finalizer.detach()

    # -- helpers -----------------------------------------------------------------------------------------------------

    def _opt(self) -> StateOwner:
        opt = self._optimizer()
        if opt is None:
            raise RuntimeError("the optimizer of this pager no longer exists")
        return opt

    def _mover(self, p: torch.Tensor) -> HostMover | CudaMover:
        device = self.entries[p].device
        mover = self.movers.get(device)
        if mover is None:
            mover = self.movers[device] = mover_for(self.homes, device)
        return mover

    def _where(self, p: torch.Tensor) -> str:
        opt = self._optimizer()
        for gi, group in enumerate(opt.param_groups if opt is not None else []):
            for pi, q in enumerate(group["params"]):
                if q is p:
                    return f"parameter {pi} of param group {gi}"
        return "a parameter"

