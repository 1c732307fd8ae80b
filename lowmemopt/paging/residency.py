"""Which paged state stays *resident* on the device (never moved, as if unpaged): an int ``page_budget_bytes`` takes
the group's smallest states first; ``"auto"`` (:class:`AutoRoom`) measures the room at the step's peak less a headroom
(:func:`probe`) and evicts, largest first, when the peak grows. And the report of where state is
(:class:`PagingReport`). Policy: docs/paging.md#what-stays-resident-page_budget_bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

__all__ = [
    "AUTO",
    "HEADROOM_FRACTION",
    "DeviceMemory",
    "probe",
    "AutoRoom",
    "smallest_first",
    "DeviceResidency",
    "PagingReport",
    "build_report",
    "evictions",
]

AUTO = "auto"
#: the default headroom of ``"auto"``: this fraction of the device's memory stays free at the peak of a step
HEADROOM_FRACTION = 0.10


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory (bytes): the driver's free and total, torch's reserved, allocated, peak."""

    free: int
    total: int
    reserved: int
    allocated: int
    peak: int

    @property
    def available(self) -> int:
        """What a new allocation can get now: the driver's free memory and torch's cached, unused blocks."""
        return self.free + self.reserved - self.allocated

    @property
    def spare_at_peak(self) -> int:
        """What was not in use at the peak so far and is free or cached now."""
        return self.free + self.reserved - self.peak


#: device types whose memory :func:`probe` reads (through ``torch.cuda``; tests add "cpu" with a mocked reading)
MEASURED = ("cuda",)


def probe(device: torch.device) -> DeviceMemory | None:
    """The memory of a CUDA device now (no synchronization: a driver query and the allocator's counters), else None."""
    if device.type not in MEASURED:
        return None
    free, total = torch.cuda.mem_get_info(device)
    return DeviceMemory(
        int(free),
        int(total),
        torch.cuda.memory_reserved(device),
        torch.cuda.memory_allocated(device),
        torch.cuda.max_memory_allocated(device),
    )


def headroom(group: dict[str, Any], memory: DeviceMemory) -> int:
    value = group.get("page_headroom_bytes")
    return int(HEADROOM_FRACTION * memory.total) if value is None else int(value)


def smallest_first(sized: list[tuple[int | None, Any]], room: int) -> list[Any]:
    """The items of ``sized`` taken smallest first while they fit ``room`` (unknown sizes never)."""
    order = sorted(range(len(sized)), key=lambda i: (sized[i][0] is None, sized[i][0] or 0, i))
    taken = []
    for i in order:
        nbytes = sized[i][0]
        if nbytes is None or nbytes > room:
            break
        room -= nbytes
        taken.append(sized[i][1])
    return taken


@dataclass
class AutoRoom:
    """The ``"auto"`` residency of one CUDA device: spare at the peak, that peak, headroom, evictions."""

    spare: int = 0
    peak: int = 0
    headroom: int = 0
    evictions: int = 0
    evicted_bytes: int = 0

    def choose(
        self, memory: DeviceMemory, sized: list[tuple[int | None, Any]], in_flight: int, headroom_bytes: int
    ) -> list[Any]:
        """The items of ``sized`` to keep resident: all if they fit, else smallest first; records the peak."""
        room = memory.spare_at_peak - headroom_bytes
        if all(n is not None for n, _ in sized) and sum(n for n, _ in sized) <= room:
            taken, in_flight = [item for _, item in sized], 0
        else:
            taken = smallest_first(sized, room - in_flight)
        chosen = {id(item) for item in taken}
        added = sum(n for n, item in sized if id(item) in chosen and n is not None) + in_flight
        self.headroom = headroom_bytes
        self.peak = max(self.peak, memory.peak + added)
        self.spare = room - added
        return taken

    def excess(self, memory: DeviceMemory) -> int:
        """Bytes of resident state to evict now (a grown peak, or free memory under the headroom); 0 if none."""
        if memory.peak > self.peak:  # (a peak under the one expected, or reset since, teaches nothing)
            self.spare -= memory.peak - self.peak
            self.peak = memory.peak
        return max(0, -self.spare, self.headroom - memory.available)

    def evicted(self, nbytes: int) -> None:
        self.spare += nbytes
        self.evictions += 1
        self.evicted_bytes += nbytes


def evictions(held: list[tuple[Any, int]], need: int) -> list[Any]:
    """Which of ``held`` ((item, bytes), in order) to evict to free ``need`` bytes: the fewest, largest first."""
    out = []
    for i in sorted(range(len(held)), key=lambda i: (-held[i][1], i)):
        if need <= 0:
            break
        out.append(held[i][0])
        need -= held[i][1]
    return out


@dataclass
class DeviceResidency:
    """Where one device's paged state is (bytes and parameters) and what paging holds there."""

    device: str
    budget: str  # "auto", bytes, or "mixed" (groups with different budgets)
    resident_bytes: int = 0
    resident_params: int = 0
    paged_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes
    paged_params: int = 0
    pool_bytes: int = 0  # slots on the device and pinned staging, held between steps
    headroom_bytes: int | None = None  # "auto": the headroom kept free at the peak
    spare_bytes: int | None = None  # "auto": what was left at the peak after the resident state (at the last check)
    evictions: int = 0
    evicted_bytes: int = 0


@dataclass
class PagingReport:
    """``optimizer.paging_report()``: per device and per parameter, where the paged state is."""

    devices: list[DeviceResidency]
    params: list[tuple[str, str, int]]

    def __str__(self) -> str:
        mib: Callable[[int], str] = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
        lines = []
        for d in self.devices:
            paged = ", ".join(f"{mib(n)} in {tier}" for tier, n in sorted(d.paged_bytes.items())) or "nothing"
            lines.append(
                f"{d.device}: budget {d.budget}; resident {mib(d.resident_bytes)} ({d.resident_params} "
                f"params), paged {paged} ({d.paged_params} params); buffers {mib(d.pool_bytes)}"
            )
            if d.headroom_bytes is not None:
                lines.append(
                    f"  auto: headroom {mib(d.headroom_bytes)}, spare at the peak {mib(d.spare_bytes or 0)}, "
                    f"{d.evictions} evictions ({mib(d.evicted_bytes)})"
                )
        return "\n".join(lines) if lines else "no paged state"


def build_report(
    entries: dict[torch.Tensor, Any],
    groups: dict[int, dict[str, Any]],
    pools: dict[torch.device, int],
    rooms: dict[torch.device, AutoRoom],
) -> PagingReport:
    """The report of a manager's ``entries``; ``groups``: id(param) -> group; ``pools``: buffer bytes; ``rooms``."""
    devices: dict[torch.device, DeviceResidency] = {}
    budgets: dict[torch.device, set] = {}
    params = []
    for p, entry in entries.items():
        d = devices.setdefault(entry.device, DeviceResidency(str(entry.device), ""))
        budgets.setdefault(entry.device, set()).add(groups.get(id(p), {}).get("page_budget_bytes", AUTO))
        if entry.resident:
            nbytes = entry.nbytes
            d.resident_bytes += nbytes
            d.resident_params += 1
        else:
            nbytes = sum(t.numel() * t.element_size() for t in entry.home_tensors().values())
            d.paged_bytes[entry.tier] = d.paged_bytes.get(entry.tier, 0) + nbytes
            d.paged_params += 1
        params.append((entry.label, "device" if entry.resident else entry.tier, nbytes))
    for device, d in devices.items():
        d.budget = str(next(iter(budgets[device]))) if len(budgets[device]) == 1 else "mixed"
        d.pool_bytes = pools.get(device, 0)
        room = rooms.get(device)
        if room is not None:
            d.headroom_bytes, d.spare_bytes = room.headroom, room.spare
            d.evictions, d.evicted_bytes = room.evictions, room.evicted_bytes
    return PagingReport(list(devices.values()), params)
