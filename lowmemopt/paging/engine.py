"""Moving buckets of paged state between their homes and the device, carrying out :mod:`.schedule`'s plan: one
:class:`Mover` per device. Lanes: :class:`CudaLanes` (two side streams, events, reader and writer threads for files)
or :class:`HostLanes` (copies at once; the CPU's files on I/O threads, or on the update's threads when it has every
core: :meth:`HostLanes.files_here`). Buffers: :data:`~.schedule.N_SLOTS` device slots (and pinned staging) laid out as
the homes, so neighbours move in one copy (:func:`coalesce`). Why: docs/paging.md#how-a-step-runs.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .contention import CpuShare
from .entry import Entry
from .homes import ALIGN, CopyFiles, Homes, layout_offsets, transfer_all, will_need
from .schedule import N_SLOTS, N_SLOTS_HOST, N_STAGING, BucketPlan, Op, Schedule

__all__ = ["Mover", "BucketInFlight", "HostLanes", "CudaLanes", "coalesce", "route_for"]

Tensors = dict[str, torch.Tensor]
_THREAD_KINDS = ("read", "write")


def route_for(tier: str, lanes: HostLanes) -> str:
    """The schedule's route of a bucket: ``"copy"``, ``"staged"`` or ``"file"``."""
    if tier == "cpu":
        return "copy"
    return "staged" if lanes.staged_files else "file"


class HostLanes:
    """Lanes of a device without streams: every copy runs at once, every event is complete (None)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staged_files = device.type != "cpu"  # files are read into the slot only where it is host memory
        self.share = CpuShare()

    def files_here(self) -> bool:
        """Whether a bucket's files are copied on the update's threads, not on I/O threads."""
        return not self.staged_files and torch.get_num_threads() >= _cpus() and not self.share.others_busy()

    def compute(self) -> Any:
        return None

    def stream(self, name: str) -> Any:
        return None

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record(self, stream: Any) -> Any:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def sync(self, event: Any) -> None:
        pass

    def done(self, event: Any) -> bool:
        return True

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def staging(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def use(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def retire(self, t: torch.Tensor) -> None:
        pass


class CudaLanes(HostLanes):
    """A CUDA device's lanes: side streams ``h2d`` and ``d2h`` beside the current stream, ordered by events."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.streams = {"h2d": torch.cuda.Stream(device), "d2h": torch.cuda.Stream(device)}

    def compute(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def stream(self, name: str) -> Any:
        return self.streams[name]

    def copy(self, stream: Any, dst: torch.Tensor, src: torch.Tensor) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: Any) -> Any:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def sync(self, event: Any) -> None:
        event.synchronize()

    def done(self, event: Any) -> bool:
        return event.query()

    def staging(self, nbytes: int) -> torch.Tensor:
        # torch's pinned allocator: a buffer dropped while a copy still uses it is not reused before the copy is done
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def use(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)  # made on the compute stream, read on a side stream

    def retire(self, t: torch.Tensor) -> None:
        for stream in self.streams.values():  # a slot dropped while a side stream may still use it
            t.record_stream(stream)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _lanes_for(device: torch.device) -> HostLanes:
    return CudaLanes(device) if device.type == "cuda" else HostLanes(device)


@dataclass(eq=False)
class BucketInFlight:
    """One bucket on its way: its plan, entries and working tensors (views into its slot)."""

    plan: BucketPlan
    entries: list[Entry]
    loads: list[Entry]
    working: dict[Entry, Tensors] = field(default_factory=dict)
    inbound: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, src) of the device load
    reads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (dst, home) of the file reads
    nbytes: int = 0
    error: BaseException | None = None  # a failed read, raised where the bucket is loaded
    here: bool = False  # its files are read when it is loaded, in the calling thread (HostLanes.files_here)


def _byte_view(t: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), offset, (nbytes,))


def _own_storage(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    return t, t.data_ptr() - t.untyped_storage().data_ptr()


def coalesce(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    locate: Callable[[torch.Tensor], tuple[torch.Tensor, int]] = _own_storage,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(dst, src)`` copies merged where neighbours continue both runs (across padding only)."""
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    run: list[Any] | None = None  # [dst holder, src holder, dst byte offset, src byte offset, bytes]
    for dst, src in pairs:
        n = dst.numel() * dst.element_size()
        if n == 0:
            continue
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype):
            out.append((dst, src))
            continue
        (dh, d), (sh, s) = locate(dst), locate(src)
        if (
            run is not None
            and run[0].untyped_storage().data_ptr() == dh.untyped_storage().data_ptr()
            and run[1].untyped_storage().data_ptr() == sh.untyped_storage().data_ptr()
            and d - run[2] == s - run[3]
            and 0 <= d - (run[2] + run[4]) < ALIGN
        ):
            run[4] = d - run[2] + n
            continue
        if run is not None:
            out.append((_byte_view(run[0], run[2], run[4]), _byte_view(run[1], run[3], run[4])))
        run = [dh, sh, d, s, n]
    if run is not None:
        out.append((_byte_view(run[0], run[2], run[4]), _byte_view(run[1], run[3], run[4])))
    return out


def _views(buffer: torch.Tensor, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    return [buffer[o : o + t.numel() * t.element_size()].view(t.dtype).view(t.shape) for t, o in zip(like, offsets)]


class Mover:
    """The buffers, lanes and schedule of one device: prefetch, advance, load, store (or discard)."""

    def __init__(
        self,
        homes: Homes,
        device: torch.device,
        lanes: HostLanes | None = None,
        n_slots: int | None = None,
        n_staging: int = N_STAGING,
    ) -> None:
        self.homes, self.device = homes, device
        self.lanes = lanes if lanes is not None else _lanes_for(device)
        if n_slots is None:
            n_slots = N_SLOTS if device.type == "cuda" else N_SLOTS_HOST
        self.schedule = Schedule(n_slots, n_staging)
        self.slots: list[torch.Tensor | None] = [None] * n_slots
        self.stagings: list[torch.Tensor | None] = [None] * n_staging
        self.slot_bytes = 0  # the size slots and staging buffers are made at (the largest bucket seen)
        self._done: dict[tuple[str, int], Any] = {}  # (kind, seq) -> CUDA event or future, until known complete
        self._last: dict[Entry, list[tuple[str, int]]] = {}  # entry -> its last load and write-back
        self._threads: dict[str, cf.ThreadPoolExecutor] = {}
        self._view_cache: dict[tuple, list[torch.Tensor]] = {}
        #: the ``"file"`` route's copies of many files at once, on the threads the update runs on (set by the step
        #: pipeline: :func:`lowmemopt.cpu.fileio.copy_files`); None: one file after another
        self.copy_files: CopyFiles | None = None
        #: write-backs that failed: (entry, {key: the bytes it could not write}), for the residency manager
        self.failed: list[tuple[Entry, Tensors, BaseException]] = []

    # -- the bucket's way ----------------------------------------------------------------------------------------

    def reserve(self, nbytes: int) -> None:
        """Make buffers of at least ``nbytes`` (the coming step's largest bucket), so a step does not grow them."""
        self.slot_bytes = max(self.slot_bytes, nbytes)

    def can_prefetch(self) -> bool:
        """Whether a slot is free for another bucket ahead."""
        return self.schedule.can_plan()

    def prefetch(self, entries: list[Entry], position: int | None = None) -> BucketInFlight:
        """Plan the next bucket (``entries`` of one tier, at ``position``) and start its first load."""
        loads = [e for e in entries if e.state is not None]
        route = route_for(entries[0].tier, self.lanes)
        plan = self.schedule.plan([id(e) for e in entries], route, [id(e) for e in loads], position)
        bucket = BucketInFlight(plan, entries, loads, here=route == "file" and self.lanes.files_here())
        homes = [(e, k, t) for e in loads for k, t in e.home_tensors().items()]
        offsets, bucket.nbytes = layout_offsets([t.numel() * t.element_size() for _, _, t in homes])
        if not homes:
            return bucket
        slot = self._buffer(self.slots, plan.slot, bucket.nbytes, self.lanes.buffer)
        views = self._views_of(slot, [t for _, _, t in homes], offsets)
        for (e, k, _), v in zip(homes, views):
            bucket.working.setdefault(e, {})[k] = v
        if route == "copy":
            bucket.inbound = [(v, t) for v, (_, _, t) in zip(views, homes)]
        elif route == "file":
            bucket.reads = [(v, t) for v, (_, _, t) in zip(views, homes)]
        else:
            staging = self._buffer(self.stagings, plan.staging, bucket.nbytes, self.lanes.staging)
            staged = self._views_of(staging, [t for _, _, t in homes], offsets)
            bucket.reads = [(s, t) for s, (_, _, t) in zip(staged, homes)]
            bucket.inbound = [(v, s) for v, s in zip(views, staged)]
        for e in loads:
            self._last.setdefault(e, [("", -1), ("", -1)])[0] = (plan.load[-1].kind, plan.seq)
        if bucket.here:  # read when loaded; until then the kernel reads the files ahead into the page cache
            for _, home in bucket.reads:
                will_need(self.homes, home)
        else:
            self._issue(plan.load[0], bucket)
        return bucket

    def advance(self, bucket: BucketInFlight, now: bool = False) -> None:
        """Issue the rest of ``bucket``'s load (``now``: files read in the calling thread)."""
        for op in bucket.plan.load:
            if op.kind not in bucket.plan.issued and bucket.error is None and (now or not bucket.here):
                self._issue(op, bucket)

    def load(self, bucket: BucketInFlight) -> dict[Entry, Tensors]:
        """``bucket``'s working tensors, ready once the compute stream gets to them (a failed read raises here)."""
        self.advance(bucket, now=True)
        if bucket.plan.load:
            self._stream_wait(self.lanes.compute(), bucket.plan.kernels.waits)
        else:  # the update makes the state (the first step): its memory is bounded by the host waiting
            self._host_wait(list(bucket.plan.kernels.waits))
        if bucket.error is not None:
            raise bucket.error
        return bucket.working

    def store(
        self, bucket: BucketInFlight, items: list[tuple[Entry, list[tuple[str, torch.Tensor, torch.Tensor]]]]
    ) -> None:
        """Write ``bucket`` back: per entry, ``(key, working, home)`` of each tensor."""
        plan = bucket.plan
        kernels = self.lanes.record(self.lanes.compute())
        self._done[("kernels", plan.seq)] = kernels
        ops = self.schedule.stored(plan)
        pairs = [(e, k, w, h) for e, triples in items for k, w, h in triples]
        if plan.route == "copy":
            self._device_copies(ops[0], [(h, w) for _, _, w, h in pairs], "d2h")
        elif plan.route == "staged":
            like = [w for _, _, w, _ in pairs]
            offsets, total = layout_offsets([t.numel() * t.element_size() for t in like])
            staged = _views(self._buffer(self.stagings, plan.staging, total, self.lanes.staging), like, offsets)
            self._device_copies(ops[0], list(zip(staged, like)), "d2h")
            self._submit(ops[1], "writer", self._writes, [(e, k, s, h) for (e, k, _, h), s in zip(pairs, staged)])
        else:
            self._submit(ops[0], "writer", self._writes, pairs, self.lanes.files_here())
        for e, _ in items:
            self._last.setdefault(e, [("", -1), ("", -1)])[1] = (ops[-1].kind, plan.seq)
        self.poll()

    def discard(self, bucket: BucketInFlight) -> None:
        """``bucket`` will not be stepped: its buffers are freed in order."""
        self.schedule.discard(bucket.plan)

    # -- waiting -----------------------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Forget completed operations (never waits)."""
        for key in [k for k, token in self._done.items() if self._complete(k[0], token)]:
            del self._done[key]

    def settle(self, entry: Entry | None = None) -> None:
        """Wait until the loads and write-backs issued so far (of ``entry``, or all) are done."""
        keys = list(self._done) if entry is None else [k for k in self._last.get(entry, ()) if k in self._done]
        self._host_wait(keys)
        self.poll()

    def forget(self, entry: Entry) -> None:
        """``entry``'s homes are freed or replaced (after :meth:`settle`)."""
        self._last.pop(entry, None)
        self.schedule.forget(id(entry))

    def close(self) -> None:
        """Wait for everything issued, stop the I/O threads, drop the buffers."""
        try:
            self.settle()
        finally:
            for pool in self._threads.values():
                pool.shutdown(wait=True)
            self._threads.clear()
            self.slots = [None] * len(self.slots)
            self.stagings = [None] * len(self.stagings)
            self._view_cache.clear()

    def pool_bytes(self) -> int:
        """Bytes of the slots (device) and staging buffers (pinned host) held now."""
        return sum(b.numel() for b in self.slots + self.stagings if b is not None)

    # -- internals ---------------------------------------------------------------------------------------------------

    def _buffer(
        self, ring: list[torch.Tensor | None], index: int, nbytes: int, make: Callable[[int], torch.Tensor]
    ) -> torch.Tensor:
        buffer = ring[index]
        if buffer is None or buffer.numel() < nbytes:
            if buffer is not None:
                self.lanes.retire(buffer)
                self._view_cache.clear()  # (views of the old one: its id may come back)
            ring[index] = None  # (the old one first: its memory may serve the new one)
            self.slot_bytes = max(self.slot_bytes, nbytes)
            ring[index] = buffer = make(self.slot_bytes)
        return buffer

    def _views_of(self, buffer: torch.Tensor, like: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
        """Views of ``buffer`` shaped like ``like`` at ``offsets``, made once per bucket and buffer."""
        key = (id(buffer), tuple((t.shape, t.dtype) for t in like))
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) > 256:
                self._view_cache.clear()
            views = self._view_cache[key] = _views(buffer, like, offsets)
        return views

    def _issue(self, op: Op, bucket: BucketInFlight) -> None:
        bucket.plan.issued.add(op.kind)
        if op.kind == "read":
            self._submit(op, "reader", self._reads, bucket, bucket.here)
        else:
            self._device_copies(op, bucket.inbound, "h2d")

    def _device_copies(self, op: Op, pairs: list[tuple[torch.Tensor, torch.Tensor]], lane: str) -> None:
        stream = self.lanes.stream(lane)
        self._stream_wait(stream, op.waits)
        slot = self.slots[op.slot]
        for dst, src in coalesce(pairs, self.homes.buffer_of):
            self.lanes.copy(stream, dst, src)
        for dst, src in pairs:
            for t in (dst, src):  # device tensors made elsewhere (the first step's state): kept until copied
                if t.device.type != "cpu" and (
                    slot is None or t.untyped_storage().data_ptr() != slot.untyped_storage().data_ptr()
                ):
                    self.lanes.use(t, stream)
        self._done[(op.kind, op.seq)] = self.lanes.record(stream)

    def _submit(self, op: Op, thread: str, job: Callable[..., Any], work: Any, here: bool = False) -> None:
        if here:  # the file route with every core the update's: now, on its threads (docs/paging.md)
            self._host_wait(list(op.waits))
            job(work, True)
            return
        pool = self._threads.get(thread)
        if pool is None:
            pool = self._threads[thread] = cf.ThreadPoolExecutor(1, thread_name_prefix=f"lowmemopt-{thread}")
        tokens = [(kind, self._done.get((kind, seq))) for kind, seq in op.waits]
        self._done[(op.kind, op.seq)] = pool.submit(self._after, tokens, job, work)

    def _after(self, tokens: list[tuple[str, Any]], job: Callable[..., Any], work: Any) -> None:
        for kind, token in tokens:
            if token is None:
                continue
            if kind in _THREAD_KINDS:
                cf.wait([token])
            else:
                self.lanes.sync(token)
        job(work)

    def _reads(self, bucket: BucketInFlight, here: bool = False) -> None:
        errors = transfer_all(self.homes, bucket.reads, self.copy_files if here else None)
        bucket.error = next((e for e in errors if e is not None), None)  # (raised where the bucket is loaded)

    def _writes(self, pairs: list[tuple[Entry, str, torch.Tensor, torch.Tensor]], here: bool = False) -> None:
        """Write ``(entry, key, working, home)`` back; a failed entry is kept with its bytes (:attr:`failed`)."""
        errors = transfer_all(self.homes, [(home, src) for _, _, src, home in pairs], self.copy_files if here else None)
        failed: dict[Entry, BaseException] = {}
        for (entry, _, _, _), e in zip(pairs, errors):
            if e is not None and entry not in failed:
                failed[entry] = e
        for entry, error in failed.items():
            self.failed.append((entry, {k: s.clone() for en, k, s, _ in pairs if en is entry}, error))

    def _stream_wait(self, stream: Any, waits: tuple[tuple[str, int], ...]) -> None:
        for kind, seq in waits:
            token = self._done.get((kind, seq))
            if token is None:
                continue
            if kind in _THREAD_KINDS:
                self._host_wait([(kind, seq)])
            else:
                self.lanes.wait(stream, token)

    def _host_wait(self, keys: list[tuple[str, int]]) -> None:
        for key in keys:
            token = self._done.get(key)
            if token is None:
                continue
            if key[0] in _THREAD_KINDS:
                cf.wait([token])
            else:
                self.lanes.sync(token)

    def _complete(self, kind: str, token: Any) -> bool:
        return token.done() if kind in _THREAD_KINDS else self.lanes.done(token)
