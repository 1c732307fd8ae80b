"""Moving one parameter's state between its home and the parameter's device.

A mover brings a home (a dict of host or file-backed tensors) to the device as *working* tensors the optimizer updates,
and writes them back afterwards. One mover per device:

* :class:`HostMover`, parameters on the CPU: plain copies in the calling thread, into one reused working buffer (the
  largest parameter's state: a fresh large allocation per parameter would pay its first-touch page faults every
  step). Files are read and written with ``pread`` / ``pwrite`` (:func:`~lowmemopt.paging.homes.transfer`); the
  prefetch of the next parameter asks the kernel to read its files ahead (``MADV_WILLNEED``), which costs the process
  no memory.
* :class:`CudaMover`, parameters on a CUDA device: host-to-device copies on a side stream (``h2d``), so the next
  parameter's state arrives while the current one updates; write-back on another side stream (``d2h``) after an event
  recorded on the compute stream, so it overlaps the next parameter's update. Nothing waits on the host per
  parameter: streams wait on events. A home's next load waits (on the device) for its last write-back. Working
  tensors are freed as soon as Python drops them; ``record_stream`` keeps the caching allocator from reusing their
  memory before every stream that used them is done. Homes in RAM are page-locked, so both copies are DMA. File
  homes go through page-locked staging buffers (torch's pinned allocator, which keeps a buffer busy until the copy
  that used it has finished): reads from the file happen on the host when the prefetch is issued; a write-back
  lands in staging on the device's schedule and reaches the file once its event has completed, checked without
  blocking at each parameter (blocking only when more than :data:`MAX_DEFERRED` are outstanding, a throttle for a
  host that runs far ahead of the device) and in :meth:`CudaMover.settle`.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from .entry import Entry
from .homes import Homes, transfer, will_need

__all__ = ["HostMover", "CudaMover", "MAX_DEFERRED", "mover_for"]

MAX_DEFERRED = 4  # CUDA + disk: write-backs waiting in staging before the host waits for the oldest
_ALIGN = 64  # working tensors in the CPU arena start on cache-line (and SIMD) boundaries

Tensors = dict[str, torch.Tensor]


class HostMover:
    """CPU parameters: synchronous copies; read-ahead for files."""

    def __init__(self, homes: Homes, device: torch.device) -> None:
        self.homes, self.device = homes, device
        #: the working buffers, one per position in a batch, each grown to the largest state loaded there
        self.arenas: list[torch.Tensor | None] = []

    def prefetch(self, entry: Entry) -> Any:
        for t in entry.home_tensors().values():
            will_need(self.homes, t)
        return None

    def load(self, entry: Entry, handle: Any, slot: int = 0) -> Tensors:
        """Copy ``entry``'s homes into working buffer ``slot`` (a batch's params use distinct slots)."""
        homes = entry.home_tensors()
        offsets, total = [], 0
        for home in homes.values():
            offsets.append(total)
            total += -(-home.numel() * home.element_size() // _ALIGN) * _ALIGN
        self.arenas += [None] * (slot + 1 - len(self.arenas))
        arena = self.arenas[slot]
        if arena is None or arena.numel() < total:
            self.arenas[slot] = arena = None  # free the old one first
            self.arenas[slot] = arena = torch.empty(total, dtype=torch.uint8, device=self.device)
        working = {}
        for (key, home), offset in zip(homes.items(), offsets):
            flat = arena[offset : offset + home.numel() * home.element_size()].view(home.dtype)
            working[key] = flat.view(home.shape)
            transfer(self.homes, working[key], home)
        return working

    def store(self, entry: Entry, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for working, home in pairs:
            transfer(self.homes, home, working)

    def discard(self, handle: Any) -> None:
        pass

    def poll(self) -> None:
        pass

    def settle(self, entry: Entry | None = None) -> None:
        pass


class CudaMover:
    """CUDA parameters: side streams and events; see the module docstring."""

    def __init__(self, homes: Homes, device: torch.device) -> None:
        self.homes, self.device = homes, device
        self.h2d = torch.cuda.Stream(device)
        self.d2h = torch.cuda.Stream(device)
        # file write-backs whose bytes are (or will be) in staging: (event, entry, [(staging, home)])
        self.deferred: deque[tuple[torch.cuda.Event, Entry, list[tuple[torch.Tensor, torch.Tensor]]]] = deque()
        self.writing: set[Entry] = set()  # entries with a write-back event not yet waited for by settle()

    def prefetch(self, entry: Entry) -> tuple[Tensors, torch.cuda.Event]:
        homes = entry.home_tensors()
        if entry.tier == "disk":
            self._finish_writes(entry)  # the file must hold the last write-back before it is read
            sources = {}
            for key, home in homes.items():
                sources[key] = torch.empty(home.shape, dtype=home.dtype, pin_memory=True)
                transfer(self.homes, sources[key], home)
        else:
            sources = homes
        with torch.cuda.stream(self.h2d):
            if entry.written is not None:
                self.h2d.wait_event(entry.written)  # the home's last write-back, on the device's schedule
            working = {}
            for key, src in sources.items():
                working[key] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
                working[key].copy_(src, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        return working, ready

    def load(self, entry: Entry, handle: tuple[Tensors, torch.cuda.Event] | None, slot: int = 0) -> Tensors:
        working, ready = handle if handle is not None else self.prefetch(entry)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(ready)
        for t in working.values():
            t.record_stream(compute)  # allocated on h2d, used on the compute stream
        return working

    def store(self, entry: Entry, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        updated = torch.cuda.Event()
        updated.record(torch.cuda.current_stream(self.device))
        staged = []
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(updated)
            for working, home in pairs:
                if entry.tier == "disk":
                    dst = torch.empty(home.shape, dtype=home.dtype, pin_memory=True)
                    staged.append((dst, home))
                else:
                    dst = home
                dst.copy_(working, non_blocking=True)
                working.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)
        entry.written = done
        self.writing.add(entry)
        if staged:
            self.deferred.append((done, entry, staged))
            self._drain(block_beyond=MAX_DEFERRED)

    def discard(self, handle: tuple[Tensors, torch.cuda.Event] | None) -> None:
        if handle is not None:  # an unused prefetch: its memory may be reused once the copy is done
            working, _ = handle
            for t in working.values():
                t.record_stream(self.h2d)

    def poll(self) -> None:
        self._drain(block_beyond=MAX_DEFERRED)

    def settle(self, entry: Entry | None = None) -> None:
        """Wait until every write-back (of ``entry``, or of all) has reached its home."""
        if entry is None:
            self._drain(block_beyond=0)
            for e in self.writing:
                if e.written is not None:
                    e.written.synchronize()
                    e.written = None
            self.writing.clear()
            return
        self._finish_writes(entry)
        if entry.written is not None:
            entry.written.synchronize()
            entry.written = None
        self.writing.discard(entry)

    def _drain(self, block_beyond: int) -> None:
        """Copy finished write-backs from staging to their files (in order); wait for the oldest ones while more
        than ``block_beyond`` are outstanding."""
        while self.deferred:
            done, entry, staged = self.deferred[0]
            if len(self.deferred) <= block_beyond and not done.query():
                return
            done.synchronize()
            for staging, home in staged:
                transfer(self.homes, home, staging)
            self.deferred.popleft()

    def _finish_writes(self, entry: Entry) -> None:
        while any(e is entry for _, e, _ in self.deferred):
            self._drain(block_beyond=len(self.deferred) - 1)


def mover_for(homes: Homes, device: torch.device) -> HostMover | CudaMover:
    if device.type == "cuda":
        return CudaMover(homes, device)
    return HostMover(homes, device)
